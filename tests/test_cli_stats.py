"""`layertap stats`: end to end on an image folder, against NumPy over the model's activations."""

import json
import os
import re
import shlex
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

import layertap
from layertap.cli import run
from layertap.cli.stats import stats as stats_command
from layertap.shapes import ShapesCNN, generate, save_images

ARCH = "layertap.shapes:ShapesCNN"
LAYERS = ["features.block1.bn", "features.block1.relu", "features.block2.pool", "classifier"]


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    """A ShapesCNN whose block1 channels 2 and 5 never fire, saved as a state dict, and 10 images.

    The images are stacked in the order the command reads the folder: sorted paths.
    """
    root = tmp_path_factory.mktemp("cli_stats")
    torch.manual_seed(0)
    model = ShapesCNN().eval()
    with torch.no_grad():
        model.features.block1.conv.weight[[2, 5]] = 0.0
        model.features.block1.bn.bias[[2, 5]] = -1.0
    weights = root / "weights.pt"
    torch.save(model.state_dict(), weights)
    paths = sorted(save_images(generate(10, seed=3), root / "images"))
    transform = layertap.model_info(model).transform  # what the command uses for images
    images = torch.stack([transform(Image.open(p)) for p in paths])
    return model, str(weights), root / "images", images


def reference(model, inputs, batch_size=None):
    """The layers' outputs over ``inputs``, as float64, run in batches of ``batch_size`` (default: one)."""
    batches = inputs.split(batch_size) if batch_size else [inputs]
    with torch.no_grad():
        outputs = [layertap.extract(model, b, LAYERS, stop_early=False) for b in batches]
    return {n: torch.cat([o[n] for o in outputs]).double().numpy() for n in LAYERS}


def test_subprocess_json_matches_numpy(setup):
    model, weights, folder, images = setup
    args = [weights, str(folder), "--arch", ARCH, "--per-channel", "--bins", "16", "--json", "--batch-size", "4"]
    for layer in LAYERS:
        args += ["--layers", layer]
    # one thread in the command and in the reference, and the reference cut into the command's
    # batches (4 + 4 + 2): MKL picks other kernels for other batch sizes (and may for other thread
    # counts), which moves values by an ulp on AVX-512, and min, max and the histogram are exact
    one_thread = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    done = subprocess.run(
        [sys.executable, "-m", "layertap", "stats", *args],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
        env=one_thread,
    )
    assert done.returncode == 0, done.stderr
    saved = json.loads(done.stdout)
    assert list(saved["layers"]) == LAYERS
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        expected = reference(model, images, batch_size=4)
    finally:
        torch.set_num_threads(threads)
    for name, values in expected.items():
        row = saved["layers"][name]
        scale = np.abs(values).max()
        assert row["count"] == values.size
        np.testing.assert_allclose(
            [row["mean"], row["std"]], [values.mean(), values.std()], rtol=1e-6, atol=1e-12 * scale
        )
        assert (row["min"], row["max"]) == (values.min(), values.max())
        channels = np.moveaxis(values, 1, -1).reshape(-1, values.shape[1])
        np.testing.assert_allclose(row["channel_mean"], channels.mean(axis=0), rtol=1e-6, atol=1e-12 * scale)
        np.testing.assert_array_equal(
            row["histogram"]["counts"], np.histogram(values, bins=row["histogram"]["edges"])[0]
        )
        assert row["dead_channels"] == np.flatnonzero((channels == 0).all(axis=0)).tolist()
    assert saved["dead_units"]["features.block1.relu"] == [2, 5]


def test_text_table_flags_dead_channels(setup, capsys):
    _, weights, folder, _ = setup
    assert run(["stats", weights, str(folder), "--arch", ARCH, "--layers", "features.block1.*"]) == 0
    out = capsys.readouterr().out
    rows = {line.split()[0]: line for line in out.splitlines() if line.startswith("features.")}
    assert list(rows) == ["features.block1.conv", "features.block1.bn", "features.block1.relu", "features.block1.pool"]
    assert "2/24" in rows["features.block1.relu"] and "DEAD" in rows["features.block1.relu"]
    assert "DEAD" not in rows["features.block1.bn"]  # -1 before the ReLU is not dead
    assert "over finite values" in out


def test_npy_array_input(setup, tmp_path, capsys):
    model, weights, _, images = setup
    array = tmp_path / "inputs.npy"
    np.save(array, images.numpy())
    assert run(["stats", weights, str(array), "--arch", ARCH, "--layers", "classifier", "--json"]) == 0
    row = json.loads(capsys.readouterr().out)["layers"]["classifier"]
    values = reference(model, images)["classifier"]
    assert row["count"] == values.size and row["min"] == values.min() and row["max"] == values.max()


@pytest.mark.parametrize(
    "extra, message",
    [(["--bins", "1"], "at least 2 bins"), (["--batch-size", "0"], "--batch-size")],
)
def test_usage_errors_exit_2(setup, capsys, extra, message):
    _, weights, folder, _ = setup
    assert run(["stats", weights, str(folder), "--arch", ARCH, *extra]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_missing_data_is_a_usage_error(capsys, tmp_path):
    assert run(["stats", "torchvision:resnet18", str(tmp_path / "nowhere")]) == 2
    assert "does not exist" in capsys.readouterr().err


def test_unknown_layer_fails_in_one_line(setup, capsys):
    _, weights, folder, _ = setup
    assert run(["stats", weights, str(folder), "--arch", ARCH, "--layers", "features.block9"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("layertap: error: ") and "matches no layer" in err and "\n" not in err


def test_help_shows_an_example_that_runs(setup, capsys, tmp_path):
    assert run(["stats", "--help"]) == 0
    shown = " ".join(capsys.readouterr().out.split())
    example = re.search(r"Example: (layertap .+)", stats_command.__doc__).group(1)
    assert example in shown
    # the example, with its folder of images made and the bundled model's weights swapped for ours
    _, weights, folder, _ = setup
    args = shlex.split(example)[2:]
    assert args[:2] == ["layertap:shapes", "./images"]
    assert run(["stats", weights, str(folder), "--arch", ARCH, *args[2:]]) == 0
    out = capsys.readouterr().out
    assert [line.split()[0] for line in out.splitlines()[1:5]] == [f"features.block{i}" for i in range(1, 5)]


def test_a_bad_image_gets_advice_stats_can_follow(setup, tmp_path, capsys):
    """stats has no --on-error: its message names what it can do instead (issue 23, item 13)."""
    _, weights, folder, _ = setup
    bad = tmp_path / "images"
    bad.mkdir()
    for p in sorted(folder.rglob("*.png"))[:2]:
        (bad / p.name).write_bytes(p.read_bytes())
    (bad / "zz_bad.png").write_bytes(b"not an image")
    assert run(["stats", weights, str(bad), "--arch", ARCH]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"layertap: error: cannot read image {bad / 'zz_bad.png'}") and "\n" not in err
    assert "move it out of DATA" in err and "layertap extract --on-error skip" in err
    assert "on_error='skip'" not in err and not err.endswith("--on-error skip")
