"""`layertap extract`: end to end on a hundred generated JPEGs, against layertap.extract."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

import layertap
from layertap.cli import run
from layertap.images import find_images, load_image
from layertap.shapes import ShapesCNN, generate, save_images

ARCH = "layertap.shapes:ShapesCNN"
LAYERS = ["features.block2", "pool"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A ShapesCNN saved as a state dict, and 100 JPEGs in class folders (4 batches of 32, the last short)."""
    root = tmp_path_factory.mktemp("cli_extract")
    torch.manual_seed(0)
    model = ShapesCNN().eval()
    weights = root / "weights.pt"
    torch.save(model.state_dict(), weights)
    save_images(generate(100, seed=5), root / "images", format="jpg")
    return model, str(weights), root / "images", root


def command(weights, folder, out, *extra):
    args = ["extract", weights, str(folder), "--arch", ARCH, "--out", str(out), "--batch-size", "32"]
    for layer in LAYERS:
        args += ["--layers", layer]
    return [*args, *extra]


def test_extract_a_folder_of_jpegs_end_to_end(setup, capsys):
    model, weights, folder, root = setup
    out = root / "feats.zarr"
    assert run(command(weights, folder, out, "--reduce", "mean")) == 0
    captured = capsys.readouterr()
    assert f"wrote 100 samples to {out} (zarr" in captured.out and "labels: 6 classes" in captured.out
    assert "for 100 samples" in captured.err  # the size estimate

    found = find_images(folder)
    transform = layertap.model_info(model).transform  # what the command feeds the model
    images = torch.stack([transform(load_image(p)) for p in found.paths])
    expected = layertap.extract(model, images, LAYERS, reduce="mean")
    with layertap.open_features(out) as store:
        assert store.ids.tolist() == found.ids() and store.labels.tolist() == found.labels
        assert store.meta["reduce"] == "mean"
        for layer in LAYERS:
            np.testing.assert_allclose(store.to_numpy(layer), expected[layer].numpy(), rtol=1e-5, atol=1e-6)

    # the same command again finds the store complete; other settings are refused; --overwrite replaces
    assert run(command(weights, folder, out, "--reduce", "mean")) == 0
    assert "already complete" in capsys.readouterr().err
    assert run(command(weights, folder, out, "--reduce", "max")) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "reduce 'mean', now 'max'" in err and "--overwrite" in err
    assert run(command(weights, folder, out, "--reduce", "max", "--overwrite", "--limit", "40", "--format", "zarr")) == 0
    with layertap.open_features(out) as store:
        assert store.num_samples == 40 and store.meta["reduce"] == "max"


def test_on_error_skip_and_fail(setup, tmp_path, capsys):
    _, weights, _, _ = setup
    paths = save_images(generate(6, seed=1), tmp_path / "images", format="jpg")
    paths[2].write_bytes(b"not a jpeg at all")
    assert run(command(weights, tmp_path / "images", tmp_path / "a", "--format", "npy", "--on-error", "fail")) == 1
    assert f"cannot read image {paths[2]}" in capsys.readouterr().err
    assert run(command(weights, tmp_path / "images", tmp_path / "b.h5", "--on-error", "skip")) == 0
    assert f"failed: {paths[2].relative_to(tmp_path / 'images').as_posix()}: UnidentifiedImageError" in capsys.readouterr().out
    with layertap.open_features(tmp_path / "b.h5") as store:
        assert store.format == "hdf5" and len(store.failed) == 1


@pytest.mark.parametrize(
    "option, value", [("--reduce", "median"), ("--format", "parquet"), ("--on-error", "ignore"), ("--dtype", "int3")]
)
def test_bad_options_are_usage_errors(setup, tmp_path, option, value):
    _, weights, folder, _ = setup
    assert run(command(weights, folder, tmp_path / "f.zarr", option, value)) == 2
    assert not (tmp_path / "f.zarr").exists()


def test_an_unknown_layer_fails_in_one_line_before_writing(setup, tmp_path, capsys):
    _, weights, folder, _ = setup
    args = ["extract", weights, str(folder), "--arch", ARCH, "--layers", "features.block9", "--out", str(tmp_path / "f.zarr")]
    assert run(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("layertap: error: 'features.block9' matches no layer") and err.count("\n") == 1
    assert not (tmp_path / "f.zarr").exists()


def test_help_shows_a_runnable_example(capsys):
    assert run(["extract", "--help"]) == 0  # in this process, as the other commands' help
    assert "Example: layertap extract" in capsys.readouterr().out


def test_labels_count_only_the_classes_of_readable_samples(setup, tmp_path, capsys):
    _, weights, _, _ = setup
    folder = tmp_path / "images"
    for name, images in zip(["a", "b", "c"], np.split(generate(6, seed=3).images, 3)):
        (folder / name).mkdir(parents=True)
        for i, pixels in enumerate(images):
            Image.fromarray(pixels).save(folder / name / f"{i}.png")
    (folder / "a" / "0.png").write_bytes(b"not a png")
    assert run(command(weights, folder, tmp_path / "f.zarr", "--on-error", "skip")) == 0
    assert "labels: 3 classes" in capsys.readouterr().out  # was 4: the -1 of the failed sample counted
    with layertap.open_features(tmp_path / "f.zarr") as store:
        assert store.labels[~store.valid].tolist() == [-1]


def test_torchscript_is_refused_before_a_store_is_made(tmp_path, capsys):
    path = tmp_path / "scripted.pt"
    torch.jit.trace(ShapesCNN().eval(), torch.randn(1, 3, 64, 64)).save(str(path))
    data = tmp_path / "x.npy"
    np.save(data, np.zeros((2, 3, 64, 64), dtype=np.float32))
    assert run(["extract", str(path), str(data), "--layers", "pool", "--out", str(tmp_path / "f.zarr")]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"layertap: error: {path} is a TorchScript archive, which layertap cannot tap") and err.count("\n") == 1
    assert not (tmp_path / "f.zarr").exists()
