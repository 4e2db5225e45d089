"""Messages that say what is really wrong, in one line: damaged files, odd paths, failed downloads,
the command without its extra. Each case here once printed something that pointed elsewhere."""

import io
import subprocess
import sys
import textwrap
import urllib.error
import zipfile

import numpy as np
import pytest
import torch
import torchvision

import layertap
from layertap.cli import run
from layertap.data import DataError, open_data
from layertap.loading import load_model


def error_line(capsys, args: list[str]) -> str:
    """The one line a failing command prints (exit code 1), without its prefix."""
    assert run(args) == 1
    err = capsys.readouterr().err
    assert err.startswith("layertap: error: ") and err.count("\n") == 1, err
    return err.removeprefix("layertap: error: ").strip()


# ---------------------------------------------------------------------------- model files
@pytest.mark.parametrize(
    "content, says, was",
    [
        (b"", "is empty (0 bytes)", "aborted"),
        (bytes(np.random.default_rng(1).integers(0, 256, 4096, dtype=np.uint8)), "is not a file written by torch.save", "--trust"),
    ],
    ids=["empty", "random"],
)
def test_a_damaged_model_file(capsys, tmp_path, content, says, was):
    path = tmp_path / "model.pt"
    path.write_bytes(content)
    line = error_line(capsys, ["inspect", str(path)])
    assert line.startswith(f"{path} {says}") and was not in line


def test_a_damaged_torchscript_file_is_refused_as_torchscript(capsys, tmp_path):
    scripted = tmp_path / "scripted.pt"
    torch.jit.script(torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU())).save(str(scripted))
    damaged = io.BytesIO()
    with zipfile.ZipFile(scripted) as src, zipfile.ZipFile(damaged, "w") as dst:
        for entry in src.infolist():  # code that no longer parses: PyTorch's parser fails an INTERNAL ASSERT
            data = src.read(entry.filename)
            dst.writestr(entry, data.replace(b"def", b"xyz") if entry.filename.endswith(".py") else data)
    path = tmp_path / "damaged.pt"
    path.write_bytes(damaged.getvalue())
    line = error_line(capsys, ["inspect", str(path)])
    assert line.startswith(f"{path} is a TorchScript archive, which layertap cannot tap") and "INTERNAL ASSERT" not in line


# ---------------------------------------------------------------------------- weights downloads
def test_a_torchvision_download_without_network_says_where_the_file_goes(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path))  # an empty cache

    def no_network(url, dst, *args, **kwargs):
        raise urllib.error.URLError("[Errno -3] Temporary failure in name resolution")

    monkeypatch.setattr(torch.hub, "download_url_to_file", no_network)
    weights = torchvision.models.ResNet18_Weights.IMAGENET1K_V1
    cached = tmp_path / "hub" / "checkpoints" / "resnet18-f37072fd.pth"
    line = error_line(capsys, ["inspect", "torchvision:resnet18:IMAGENET1K_V1"])
    assert line.startswith(
        "could not download the weights IMAGENET1K_V1 of torchvision:resnet18 "
        "(URLError: [Errno -3] Temporary failure in name resolution)"
    )
    assert f"download {weights.url} and put it at {cached}" in line
    assert line.endswith("or drop ':IMAGENET1K_V1' for random weights")
    # put where it says, the file is used without a network
    cached.parent.mkdir(parents=True, exist_ok=True)  # torch.hub made it for the download
    state = torchvision.models.resnet18().state_dict()
    torch.save(state, cached)
    assert torch.equal(load_model("torchvision:resnet18:IMAGENET1K_V1").fc.weight, state["fc.weight"])


def test_timm_pretrained_weights_offline(capsys, tmp_path, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # HF_HUB_OFFLINE=1, as read at import
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))  # nothing cached
    line = error_line(capsys, ["inspect", "timm:test_vit:pretrained"])
    assert line.startswith("could not download the pretrained weights of timm:test_vit (LocalEntryNotFoundError: ")
    assert "from the Hugging Face Hub (timm/test_vit.r160_in1k)" in line
    assert f"copy the Hugging Face cache {tmp_path} here" in line
    assert line.endswith("or drop ':pretrained' for random weights")


# ---------------------------------------------------------------------------- data and stores
@pytest.mark.parametrize(
    "write, says",
    [
        (lambda path: np.save(path, np.array(3.0)), "holds a single value (a 0-d array), not samples"),
        (lambda path: path.write_bytes(b""), "is empty (0 bytes)"),
        (lambda path: path.write_bytes(b"a,b\n1,2\n"), "is not a .npy file"),
    ],
    ids=["0-d", "empty", "csv"],
)
def test_npy_data_that_holds_no_samples(capsys, tmp_path, write, says):
    path = tmp_path / "data.npy"
    write(path)
    out = tmp_path / "feats.zarr"
    line = error_line(capsys, ["extract", "layertap:shapes", str(path), "--layers", "pool", "--out", str(out)])
    assert line.startswith(f"{path} {says}") and not out.exists()


@pytest.mark.parametrize("array", [np.array(3.0), torch.tensor(3.0)], ids=["ndarray", "tensor"])
def test_a_0d_array_in_memory(array):
    with pytest.raises(DataError, match=f"this {type(array).__name__} holds a single value"):
        open_data(array)


def test_report_of_the_current_folder_goes_beside_it(capsys, tmp_path, monkeypatch):
    store = tmp_path / "feats.zarr"
    layertap.extract_dataset(torch.nn.Sequential(torch.nn.Linear(4, 3)), torch.randn(8, 4), ["0"], store, progress=False)
    monkeypatch.chdir(store)
    assert run(["report", "."]) == 0  # was: "PosixPath('.') has an empty name"
    page = tmp_path / "feats.html"
    assert page.is_file() and f"report: {page}" in capsys.readouterr().out


# ---------------------------------------------------------------------------- the command itself
def test_an_end_of_file_is_an_error_not_an_abort(capsys, monkeypatch):
    def truncated(*args, **kwargs):
        raise EOFError("Ran out of input")

    monkeypatch.setattr("layertap.cli.inspect.load_model", truncated)
    assert error_line(capsys, ["inspect"]) == "Ran out of input"  # was: a blank line, then "aborted"


def test_an_interrupt_exits_130(capsys, monkeypatch):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr("layertap.cli.inspect.load_model", interrupted)
    assert run(["inspect"]) == 130
    assert capsys.readouterr().err == "layertap: interrupted\n"


NO_TYPER = textwrap.dedent(
    """
    import sys

    class NoTyper:  # as if layertap were installed without the cli extra
        def find_spec(self, name, path=None, target=None):
            if name.partition(".")[0] == "typer":
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)

    sys.meta_path.insert(0, NoTyper())
    """
)


@pytest.mark.parametrize(
    "start",
    ["from layertap.cli import main; main()", "import runpy; runpy.run_module('layertap', run_name='__main__')"],
    ids=["script", "python-m"],
)
def test_without_the_cli_extra_one_line_names_it(start):
    done = subprocess.run(
        [sys.executable, "-c", NO_TYPER + start, "inspect"], capture_output=True, text=True, timeout=300, check=False
    )
    assert done.returncode == 1
    assert done.stderr.splitlines() == ["layertap: error: 'typer' is needed for this; install it with: pip install 'layertap[cli]'"]


def test_version_is_the_packages_one():
    from importlib import metadata

    done = subprocess.run([sys.executable, "-m", "layertap", "--version"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == f"layertap {layertap.__version__}"
    assert metadata.version("layertap") == layertap.__version__  # one source: pyproject reads __init__
