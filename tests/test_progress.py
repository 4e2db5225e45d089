"""Progress bars (layertap.progress): shown in a terminal or a notebook, quiet when piped or off, on
every long-running call: extract_dataset, stats, the CAM methods' batches and Score-CAM's masks."""

import sys
import types

import numpy as np
import pytest
import torch
from torch import nn

import layertap
from layertap import progress
from layertap.cam import GradCAM, ScoreCAM

pytest.importorskip("tqdm", reason="the bars are tqdm's: pip install -e '.[cli]'")


def small_cnn() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3)).eval()


def as_terminal(monkeypatch):
    """stderr claims to be a terminal. (Called in the test: during fixture setup, sys.stderr is
    not yet capsys's stream.)"""
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)


@pytest.fixture
def notebook(monkeypatch):
    """The code believes it runs in a Jupyter kernel (stderr stays no terminal)."""
    monkeypatch.setattr(progress, "in_notebook", lambda: True)


# --------------------------------------------------------------------- the policy
def test_the_policy(monkeypatch, capsys):
    assert not progress.shows()  # pytest's captured stderr is a pipe
    monkeypatch.setattr(progress, "in_notebook", lambda: True)
    assert progress.shows() and not progress.shows(enabled=False)
    monkeypatch.setenv("RANK", "1")  # one bar per torchrun job: rank 0's
    assert not progress.shows()
    monkeypatch.setenv("RANK", "0")
    assert progress.shows()


def test_a_notebook_is_an_ipython_kernel(monkeypatch):
    shell = types.SimpleNamespace(kernel=None)
    monkeypatch.setitem(sys.modules, "IPython", types.SimpleNamespace(get_ipython=lambda: shell))
    assert not progress.in_notebook()  # a terminal IPython has no kernel
    shell.kernel = object()
    assert progress.in_notebook()
    monkeypatch.delitem(sys.modules, "IPython")
    assert not progress.in_notebook()


def test_without_tqdm_no_bar_and_no_error(monkeypatch, capsys):
    as_terminal(monkeypatch)
    monkeypatch.setitem(sys.modules, "tqdm.auto", None)  # import fails, as when the cli extra is absent
    with progress.progress_bar(4, desc="x") as bar:
        bar.update(4)
    assert isinstance(bar, progress.Quiet) and capsys.readouterr().err == ""


# --------------------------------------------------------------------- stats
def test_stats_bar_in_a_terminal_and_quiet_otherwise(monkeypatch, capsys):
    as_terminal(monkeypatch)
    data = torch.utils.data.TensorDataset(torch.randn(12, 3, 8, 8))
    layertap.stats(small_cnn(), data, batch_size=4)
    err = capsys.readouterr().err
    assert "stats" in err and "12/12" in err and "sample" in err

    layertap.stats(small_cnn(), data, batch_size=4, progress=False)
    assert capsys.readouterr().err == ""


def test_stats_is_quiet_when_piped(capsys):
    layertap.stats(small_cnn(), torch.utils.data.TensorDataset(torch.randn(12, 3, 8, 8)), batch_size=4)
    assert capsys.readouterr().err == ""


def test_stats_bar_in_a_notebook(notebook, capsys):
    layertap.stats(small_cnn(), torch.utils.data.TensorDataset(torch.randn(8, 3, 8, 8)), batch_size=4)
    assert "8/8" in capsys.readouterr().err


# --------------------------------------------------------------------- extraction
def test_extract_dataset_bar_in_a_notebook(notebook, tmp_path, capsys):
    data = torch.utils.data.TensorDataset(torch.randn(8, 3, 8, 8))
    layertap.extract_dataset(small_cnn(), data, "2", tmp_path / "a.zarr", batch_size=4)
    err = capsys.readouterr().err
    assert "extract" in err and "8/8" in err

    layertap.extract_dataset(small_cnn(), data, "2", tmp_path / "b.zarr", batch_size=4, progress=False)
    assert capsys.readouterr().err == ""


# --------------------------------------------------------------------- heatmaps
def test_cam_bar_over_batches_of_images(monkeypatch, capsys):
    as_terminal(monkeypatch)
    x = torch.randn(6, 3, 8, 8)
    GradCAM(small_cnn(), "0", batch_size=2)(x)
    err = capsys.readouterr().err
    assert "GradCAM" in err and "6/6" in err and "image" in err

    GradCAM(small_cnn(), "0", batch_size=2, progress=False)(x)
    GradCAM(small_cnn(), "0")(x)  # one batch: nothing to count
    assert capsys.readouterr().err == ""


def test_cam_is_quiet_when_piped(capsys):
    GradCAM(small_cnn(), "0", batch_size=2)(torch.randn(6, 3, 8, 8))
    ScoreCAM(small_cnn(), "0", batch_size=2)(torch.randn(2, 3, 8, 8))
    assert capsys.readouterr().err == ""


def test_scorecam_bar_counts_masks(monkeypatch, capsys):
    as_terminal(monkeypatch)
    ScoreCAM(small_cnn(), "0", batch_size=2)(torch.randn(2, 3, 8, 8))  # 2 images x 4 channels
    err = capsys.readouterr().err
    assert "ScoreCAM" in err and "/8 " in err and "mask/s" in err  # (cleared when done: leave=False)

    ScoreCAM(small_cnn(), "0", batch_size=2, progress=False)(torch.randn(2, 3, 8, 8))
    assert capsys.readouterr().err == ""


def test_batches_give_the_maps_of_one_call():
    model, x = small_cnn(), torch.randn(5, 3, 8, 8)
    for method in (GradCAM, ScoreCAM):
        whole = method(model, "0", batch_size=None if method is GradCAM else 32)
        cut = method(model, "0", batch_size=2, progress=False)
        torch.testing.assert_close(cut(x, [0, 1, 2, 0, 1]), whole(x, [0, 1, 2, 0, 1]), atol=1e-6, rtol=0)
        assert cut.target_classes == [0, 1, 2, 0, 1]
        torch.testing.assert_close(cut.logits, whole.logits)
    top = GradCAM(model, "0", batch_size=2)
    top(x)
    assert top.target_classes == top.logits.argmax(1).tolist() and len(top.target_classes) == 5
    with pytest.raises(layertap.ArgumentError, match="got 3 targets for a batch of 5"):
        GradCAM(model, "0", batch_size=2)(x, [0, 1, 2])
    with pytest.raises(layertap.ArgumentError, match="batch_size must be at least 1"):
        GradCAM(model, "0", batch_size=0)


# --------------------------------------------------------------------- the command line
def test_the_commands_take_no_progress(monkeypatch, tmp_path, capsys):
    pytest.importorskip("typer", reason="the cli extra is not installed")
    from layertap.cli import run

    np.save(tmp_path / "x.npy", np.random.default_rng(0).standard_normal((8, 3, 64, 64)).astype(np.float32))
    as_terminal(monkeypatch)
    assert run(["stats", "layertap:shapes", str(tmp_path / "x.npy"), "--layers", "classifier", "--batch-size", "4"]) == 0
    assert "8/8" in capsys.readouterr().err
    assert run(["stats", "layertap:shapes", str(tmp_path / "x.npy"), "--layers", "classifier", "--no-progress"]) == 0
    extract = ["extract", "layertap:shapes", str(tmp_path / "x.npy"), "--layers", "classifier", "--out", str(tmp_path / "f.zarr")]
    assert run([*extract, "--no-progress"]) == 0
    assert capsys.readouterr().err == ""
