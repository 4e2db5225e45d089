"""``layertap cam``: overlays and raw maps written per image, predicted classes printed."""

from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from layertap.cam import GradCAM, LayerCAM
from layertap.cli import run
from layertap.cli.cam import safe_names
from layertap.images import load_image
from layertap.loading import load_model
from layertap.modelinfo import model_info

SPEC = "torchvision:resnet18"  # random weights, the preprocessing of its published weights


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """Three images: two in class folders, one with spaces and a non-ASCII name."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    files = [root / "cats" / "001.png", root / "dogs" / "001.png", root / "dogs" / "ünï cödé (1).png"]
    for f in files:
        f.parent.mkdir(exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (40, 50, 3), dtype=np.uint8)).save(f)
    return root


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    net = load_model(SPEC)
    return net, model_info(net).transform


def inputs_of(model, paths):
    _, transform = model
    return torch.stack([transform(load_image(p)) for p in paths])


def test_writes_one_overlay_and_map_per_image(images, model, tmp_path, capsys):
    torch.manual_seed(0)
    out = tmp_path / "out"
    assert run(["cam", SPEC, str(images), "--out", str(out), "--batch-size", "2"]) == 0
    printed = capsys.readouterr().out
    # file names: folders joined by '__', unsafe characters replaced, all inside --out
    stems = ["cats__001", "dogs__001", "dogs___n__c_d___1_"]
    assert sorted(p.name for p in out.iterdir()) == sorted([s + ".npy" for s in stems] + [s + ".png" for s in stems])
    # the maps are those of the library on the same preprocessed images
    net, _ = model
    paths = [images / "cats" / "001.png", images / "dogs" / "001.png", images / "dogs" / "ünï cödé (1).png"]
    x = inputs_of(model, paths)
    cam = GradCAM(net)
    expected = cam(x)
    for stem, m in zip(stems, expected):
        saved = np.load(out / f"{stem}.npy")
        assert saved.shape == (224, 224)
        np.testing.assert_allclose(saved, m.numpy(), atol=1e-5)
        with Image.open(out / f"{stem}.png") as png:
            assert png.size == (224, 224) and png.mode == "RGB"
    with torch.no_grad():
        top = net(x).argmax(1).tolist()
    for rel, cls in zip(["cats/001.png", "dogs/001.png", "dogs/ünï cödé (1).png"], top):
        assert f"{rel}: {cls} (" in printed
    assert f"layer: {cam.layers[0]}; method: gradcam; 3 heatmaps" in printed


def test_method_layer_target_and_size(images, model, tmp_path, capsys):
    out = tmp_path / "out"
    file = images / "cats" / "001.png"
    args = ["cam", SPEC, str(file), "--out", str(out), "--method", "LayerCAM", "--layer", "layer3", "--target", "7"]
    assert run(args + ["--size", "96,128"]) == 0
    printed = capsys.readouterr().out
    assert "explained class 7" in printed or ": 7 (" in printed
    assert "layer: layer3; method: layercam" in printed
    saved = np.load(out / "001.npy")
    assert saved.shape == (96, 128)
    # --size keeps the ImageNet statistics of the weights' preprocessing: rebuild it by hand
    import torchvision.transforms as T

    pipeline = T.Compose([T.Resize(int(96 / 0.875)), T.CenterCrop((96, 128)), T.ToTensor(),
                          T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))])
    net, _ = model
    expected = LayerCAM(net, "layer3")(pipeline(load_image(file))[None], 7)[0]
    np.testing.assert_allclose(saved, expected.numpy(), atol=1e-5)


def test_usage_and_runtime_errors(images, tmp_path, capsys):
    out = str(tmp_path / "out")
    assert run(["cam", SPEC, str(images), "--out", out, "--method", "nope"]) == 2
    assert "unknown method 'nope'" in capsys.readouterr().err
    assert run(["cam", SPEC, str(images), "--out", out, "--target", "zebra"]) == 2
    assert "neither a class index nor a class name" in capsys.readouterr().err
    assert run(["cam", SPEC, str(images), "--out", out, "--colormap", "nope"]) == 2
    assert "unknown colormap 'nope'" in capsys.readouterr().err
    assert run(["cam", SPEC, str(tmp_path / "missing.png"), "--out", out]) == 2
    assert run(["cam", "notaspec", str(images), "--out", out]) == 2
    capsys.readouterr()
    assert run(["cam", SPEC, str(images), "--out", out, "--layer", "layer9"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("layertap: error:") and "layer4" in err and len(err.strip().splitlines()) == 1


def test_safe_names_never_leave_the_folder():
    names = safe_names(["../../etc/passwd", "/abs/x.png", "a\\b.png", ".hidden.png", "A.png", "a.png", "x"])
    assert names == ["etc__passwd", "abs__x", "a__b", "hidden", "A", "a-2", "x"]
    for name in names:
        assert "/" not in name and "\\" not in name and not name.startswith(".")


def test_long_names_are_shortened_and_a_failure_leaves_nothing(tmp_path, capsys):
    images = tmp_path / "images"
    long_class = "c" * 250  # a legal folder name; with "__001.png" no longer a legal file name
    pixels = np.random.default_rng(1).integers(0, 255, (40, 50, 3), dtype=np.uint8)
    for folder in ("short", long_class):
        (images / folder).mkdir(parents=True)
        Image.fromarray(pixels).save(images / folder / "001.png")
    out = tmp_path / "out"
    assert run(["cam", "layertap:shapes", str(images), "--out", str(out), "--batch-size", "1"]) == 0
    names = sorted(p.name for p in out.iterdir())
    stem = safe_names([f"{long_class}/001.png"])[0]
    assert names == sorted([f"{stem}.npy", f"{stem}.png", "short__001.npy", "short__001.png"])
    assert len(stem) == 200 and stem.startswith("c" * 150)
    assert f"{long_class}/001.png: " in capsys.readouterr().out
    assert sorted(p.name for p in tmp_path.iterdir()) == ["images", "out"]  # no staging folder left

    # an image that fails after others were drawn: no file of this run is written
    (images / "zz").mkdir()
    (images / "zz" / "bad.png").write_bytes(b"not a png")
    again = tmp_path / "again"
    assert run(["cam", "layertap:shapes", str(images), "--out", str(again), "--batch-size", "1"]) == 1
    assert "cannot read image" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["images", "out"]


def test_safe_names_are_cut_with_a_hash():
    ids = ["d" * 300 + "/a.png", "d" * 300 + "/b.png"]
    names = safe_names(ids)
    assert all(len(n) == 200 for n in names) and names[0] != names[1]
    assert names == safe_names(ids)  # deterministic: the same files get the same names on a rerun


@pytest.mark.parametrize(
    "extra, bad, advice",
    [
        ([], "b.png", "Remove or replace the file, or leave it out"),
        (["--max-image-pixels", "100"], "a.png", "raise the limit (--max-image-pixels N"),  # 400 pixels each
    ],
)
def test_a_bad_image_gets_advice_cam_can_follow(tmp_path, capsys, extra, bad, advice):
    """cam has no --on-error: its message must not tell the user to pass one (issue 23, item 13)."""
    folder = tmp_path / "images"
    folder.mkdir()
    Image.fromarray(np.zeros((20, 20, 3), np.uint8)).save(folder / "a.png")
    (folder / "b.png").write_bytes(b"not an image")
    assert run(["cam", "layertap:shapes", str(folder), "--out", str(tmp_path / "out"), *extra]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"layertap: error: cannot read image {folder / bad}: ")
    assert advice in err and "on-error" not in err and "on_error" not in err and "\n" not in err
    assert not (tmp_path / "out").exists()
