"""layertap.extract_dataset: features on disk equal layertap.extract, for every format, resumable."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import slow_model
import torch
import torchvision
from torch import nn

import layertap
from layertap.data import DataError, image_to_tensor
from layertap.extract import run as dataset_module
from layertap.images import find_images, load_image
from layertap.shapes import generate, save_images
from layertap.store import StoreError
from layertap.store.writer import StoreWriter

FORMATS = {"zarr": "feats.zarr", "hdf5": "feats.h5", "npy": "feats"}


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    return torchvision.models.resnet18(num_classes=5).eval()


@pytest.fixture(scope="module")
def samples():
    generator = torch.Generator().manual_seed(1)
    return torch.randn(10, 3, 32, 32, generator=generator), torch.arange(10) % 3


def reference(model, inputs, layers, batch_size, **options):
    """layertap.extract on the same batches, concatenated."""
    parts = [layertap.extract(model, inputs[i : i + batch_size], layers, **options) for i in range(0, len(inputs), batch_size)]
    return {k: torch.cat([p[k] for p in parts]) for k in parts[0]}


@pytest.mark.parametrize("format", list(FORMATS))
def test_features_equal_extract_in_every_format(resnet, samples, tmp_path, format):
    x, y = samples
    out = tmp_path / FORMATS[format]
    # chunks of 2 batches: rows are assembled across batches and the last chunk is partial
    store = layertap.extract_dataset(
        resnet, torch.utils.data.TensorDataset(x, y), ["layer2", "avgpool"], out,
        batch_size=4, chunk_size=8, format=format, progress=False,
    )
    expected = reference(resnet, x, ["layer2", "avgpool"], 4)
    assert store.format == format and store.complete
    assert list(store) == ["layer2", "avgpool"]
    for key in store:
        assert store[key].shape == tuple(expected[key].shape)
        assert torch.equal(store.to_torch(key), expected[key])
    assert store.labels.tolist() == y.tolist()
    assert store.ids.tolist() == list(range(10))
    assert store.failed == []
    meta = store.meta
    assert meta["layers"] == ["layer2", "avgpool"] and meta["versions"]["torch"] == torch.__version__
    assert meta["arrays"][0]["shape"] == [128, 4, 4] and meta["arrays"][0]["dtype"] == "float32"
    store.close()
    reopened = layertap.open_features(out)
    assert np.array_equal(reopened.to_numpy("avgpool"), expected["avgpool"].numpy())
    reopened.close()


def test_reduce_and_dtype_are_applied_before_storing(resnet, samples, tmp_path):
    x, _ = samples
    store = layertap.extract_dataset(
        resnet, x, "layer3", tmp_path / "f.zarr", reduce="mean", dtype="float16", batch_size=5, progress=False
    )
    expected = reference(resnet, x, "layer3", 5, reduce="mean", dtype=torch.float16)["layer3"]
    assert store["layer3"].dtype == np.float16
    assert torch.equal(store.to_torch("layer3"), expected)
    assert store.labels is None  # bare inputs: no labels


def make_images(folder: Path, n: int, seed: int = 0) -> list[Path]:
    return save_images(generate(n, seed=seed), folder, format="jpg")


def small(image):
    return image_to_tensor(image.resize((32, 32)))


def test_image_folder_ids_and_labels_line_up_with_samples(resnet, tmp_path):
    make_images(tmp_path / "images", 12)
    store = layertap.extract_dataset(
        resnet, tmp_path / "images", "avgpool", tmp_path / "f.zarr", transform=small,
        batch_size=4, num_workers=1, progress=False,
    )
    found = find_images(tmp_path / "images")
    assert store.ids.tolist() == found.ids()
    assert store.labels.tolist() == found.labels
    # the labels are the class folders of the ids
    assert [found.classes[label] for label in store.labels] == [i.split("/")[0] for i in store.ids]
    images = torch.stack([small(load_image(p)) for p in found.paths])
    assert torch.equal(store.to_torch("avgpool"), reference(resnet, images, "avgpool", 4)["avgpool"])


class TwoOutputs(nn.Module):
    """A layer whose output is a tuple holding a tensor and a dict of two more."""

    def forward(self, x):
        return x.relu(), {"neg": -x, "square": x * x}


class TupleNet(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, 3)
        self.split = TwoOutputs()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        a, rest = self.split(self.conv(x))
        return self.head((a + rest["neg"] + rest["square"]).mean((2, 3)))


def test_a_tuple_output_layer_keeps_all_its_tensors(samples, tmp_path):
    model = TupleNet().eval()
    x, _ = samples
    store = layertap.extract_dataset(model, x, ["split", "conv"], tmp_path / "f.zarr", batch_size=4, progress=False)
    value = layertap.extract(model, x, "split")["split"]
    expected = [value[0], value[1]["neg"], value[1]["square"]]
    assert list(store) == ["conv", "split/0", "split/1", "split/2"]
    for i, tensor in enumerate(expected):
        assert torch.allclose(store.to_torch(f"split/{i}"), tensor)
    assert store.meta["arrays"][1]["path"] == "features/split/0"


def test_an_output_that_is_not_batch_first_is_refused(tmp_path):
    model = nn.LSTM(3, 5, batch_first=True)  # returns (out, (h, c)); h and c are [layers, batch, hidden]
    with pytest.raises(StoreError, match="tensor 1 of layer ''"):
        layertap.extract_dataset(model, torch.randn(6, 4, 3), "", tmp_path / "f.zarr", batch_size=3, progress=False)


class Counting(torch.utils.data.Dataset):
    """Samples made from their index; counts the samples read."""

    def __init__(self, n: int):
        self.n, self.reads = n, 0

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        self.reads += 1
        return torch.randn(3, 32, 32, generator=torch.Generator().manual_seed(int(i))), int(i) % 4


def test_unknown_layers_fail_before_any_work(resnet, tmp_path):
    data = Counting(8)
    with pytest.raises(layertap.LayerNotFoundError, match="layer9"):
        layertap.extract_dataset(resnet, data, ["layer1", "layer9"], tmp_path / "f.zarr", progress=False)
    assert data.reads == 0 and not (tmp_path / "f.zarr").exists()


def test_an_early_layer_does_not_run_the_rest_of_the_network(resnet, tmp_path):
    calls = []
    handle = resnet.layer2.register_forward_hook(lambda *a: calls.append(1))
    try:
        layertap.extract_dataset(resnet, Counting(8), "layer1", tmp_path / "f.zarr", batch_size=4, progress=False)
    finally:
        handle.remove()
    assert calls == []


def test_changed_settings_are_refused_unless_overwrite(resnet, tmp_path):
    out = tmp_path / "f.zarr"
    data = Counting(6)
    layertap.extract_dataset(resnet, data, "layer1", out, reduce="mean", batch_size=3, progress=False)
    with pytest.raises(StoreError, match=r"other settings: layers \['layer1'\], now \['layer2'\].*overwrite=True"):
        layertap.extract_dataset(resnet, data, "layer2", out, reduce="mean", batch_size=3, progress=False)
    with pytest.raises(StoreError, match="reduce 'mean', now 'max'"):
        layertap.extract_dataset(resnet, data, "layer1", out, reduce="max", batch_size=3, progress=False)
    with pytest.raises(StoreError, match="already holds features"):
        layertap.extract_dataset(resnet, data, "layer1", out, reduce="mean", resume=False, progress=False)
    other = torchvision.models.resnet18(num_classes=5).eval()  # other random weights
    with pytest.raises(StoreError, match=r"model \(fingerprint"):
        layertap.extract_dataset(other, data, "layer1", out, reduce="mean", batch_size=3, progress=False)
    # the same settings find the store complete and return it as it is
    reads = data.reads
    assert layertap.extract_dataset(resnet, data, "layer1", out, reduce="mean", batch_size=3, progress=False).complete
    assert data.reads == reads
    store = layertap.extract_dataset(resnet, data, "layer2", out, reduce="mean", overwrite=True, progress=False)
    assert list(store) == ["layer2"]


def test_a_folder_that_is_not_a_store_is_never_overwritten(resnet, tmp_path):
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("precious")
    with pytest.raises(StoreError, match="not a layertap feature store"):
        layertap.extract_dataset(resnet, Counting(4), "layer1", tmp_path / "mine", overwrite=True, progress=False)
    assert (tmp_path / "mine" / "notes.txt").read_text() == "precious"


@pytest.fixture
def folder_with_corrupt_jpeg(tmp_path):
    paths = make_images(tmp_path / "images", 10)
    bad = paths[3]
    bad.write_bytes(bad.read_bytes()[:200])  # truncated JPEG
    return tmp_path / "images", bad


def test_a_corrupt_jpeg_stops_the_run_with_its_path(resnet, folder_with_corrupt_jpeg, tmp_path):
    folder, bad = folder_with_corrupt_jpeg
    out = tmp_path / "f.zarr"
    with pytest.raises(DataError, match=f"cannot read image {bad}"):
        layertap.extract_dataset(resnet, folder, "avgpool", out, transform=small, batch_size=2, chunk_size=2, num_workers=1, progress=False)
    with pytest.warns(UserWarning, match="incomplete"):
        assert not layertap.open_features(out).complete


def test_a_corrupt_jpeg_is_recorded_and_skipped(resnet, folder_with_corrupt_jpeg, tmp_path):
    folder, bad = folder_with_corrupt_jpeg
    store = layertap.extract_dataset(
        resnet, folder, "avgpool", tmp_path / "f.h5", transform=small, batch_size=4, on_error="skip", progress=False
    )
    found = find_images(folder)
    index = found.paths.index(bad)
    assert store.complete and store.num_samples == 10
    assert [(f.index, f.id) for f in store.failed] == [(index, found.ids()[index])]
    assert "UnidentifiedImageError" in store.failed[0].error or "OSError" in store.failed[0].error
    features = store.to_torch("avgpool")
    assert torch.isnan(features[index]).all()
    good = [i for i in range(10) if i != index]
    images = torch.stack([small(load_image(found.paths[i])) for i in good])
    assert torch.allclose(features[good], layertap.extract(resnet, images, "avgpool")["avgpool"], atol=1e-6)
    assert store.labels.tolist() == [label if i != index else -1 for i, label in enumerate(found.labels)]


# ----------------------------------------------------------------------------- resuming
@pytest.mark.parametrize("format", ["zarr"])  # the default; every format is killed at 6 moments in test_crash_resume.py
def test_a_run_killed_by_sigkill_resumes_to_the_same_store(tmp_path, format):
    data = tmp_path / "x.npy"
    np.save(data, np.random.default_rng(0).standard_normal((60, 3, 32, 32), dtype=np.float32))
    out = tmp_path / FORMATS[format]
    proc = subprocess.Popen([sys.executable, slow_model.__file__, str(data), str(out), format], stdout=subprocess.PIPE, text=True)
    started = 0
    while started < 9:  # 15 batches in all: kill it in the middle
        line = proc.stdout.readline()
        assert line, f"the run ended before it could be killed (rc={proc.wait()})"
        started += line.startswith("batch")
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()

    model = slow_model.Slow()
    batches = []
    model.register_forward_pre_hook(lambda m, args: batches.append(len(args[0])))
    writer = StoreWriter.open(out)
    done = sorted(writer.done())
    writer.close()
    assert 0 < len(done) < 8, f"chunks done at the kill: {done}"
    resumed = layertap.extract_dataset(model, str(data), ["conv", "pool"], out, format=format, batch_size=4, chunk_size=8, progress=False)
    # only the missing chunks ran, and the first batch of the first and of the last written chunk (checked)
    assert sum(batches) == 60 - 8 * len(done) + 4 * min(len(done), 2)
    whole = layertap.extract_dataset(model, str(data), ["conv", "pool"], tmp_path / f"whole-{FORMATS[format]}", format=format, batch_size=4, chunk_size=8, progress=False)
    assert resumed.complete and list(resumed) == list(whole)
    for key in whole:
        assert np.array_equal(resumed.to_numpy(key), whole.to_numpy(key)), key
    assert np.array_equal(resumed.ids, whole.ids)


def test_data_of_unknown_length_resumes_after_a_failure(resnet, samples, tmp_path):
    x, y = samples
    batches = [(x[i : i + 2], y[i : i + 2]) for i in range(0, 10, 2)]

    def failing():
        yield from batches[:4]
        raise RuntimeError("the data source broke")

    out = tmp_path / "f.zarr"
    with pytest.raises(RuntimeError, match="broke"):
        layertap.extract_dataset(resnet, failing(), "avgpool", out, chunk_size=4, progress=False)
    writer = StoreWriter.open(out)
    assert sorted(writer.done()) == [0, 1]  # 8 samples: two whole chunks
    writer.close()
    store = layertap.extract_dataset(resnet, iter(batches), "avgpool", out, chunk_size=4, progress=False)
    assert store.complete and store.num_samples == 10
    assert torch.equal(store.to_torch("avgpool"), reference(resnet, x, "avgpool", 2)["avgpool"])
    assert store.labels.tolist() == y.tolist() and store.ids.tolist() == list(range(10))


def test_missing_chunks_are_dealt_out_to_processes_without_overlap(resnet, tmp_path):
    out = tmp_path / "f.zarr"
    store = layertap.extract_dataset(resnet, Counting(22), "avgpool", out, batch_size=2, chunk_size=4, progress=False)
    store.close()
    writer = StoreWriter.open(out)
    writer.meta["complete"] = False
    for chunk in (1, 3, 5):  # forget three chunks, as a run killed in the middle would
        writer.backend.root["_chunks"][chunk] = ""
    plans = [dataset_module._plan(writer, writer.done(), rank, 2) for rank in range(2)]
    writer.close()
    assert plans[0].tolist() == [4, 5, 6, 7, 20, 21]  # chunks 1 and 5 (the last, partial)
    assert plans[1].tolist() == [12, 13, 14, 15]  # chunk 3


# ------------------------------------------------------------------------ data arguments
def test_a_dataloader_keeps_its_batches_and_a_shuffled_one_is_refused(resnet, samples, tmp_path):
    x, y = samples
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=3)
    store = layertap.extract_dataset(resnet, loader, "avgpool", tmp_path / "f.zarr", progress=False)
    assert torch.equal(store.to_torch("avgpool"), reference(resnet, x, "avgpool", 3)["avgpool"])
    assert store.labels.tolist() == y.tolist()
    shuffled = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(x, y), batch_size=3, shuffle=True)
    with pytest.raises(DataError, match="shuffle=False"):
        layertap.extract_dataset(resnet, shuffled, "avgpool", tmp_path / "g.zarr", progress=False)


def test_npy_file_and_limit(resnet, samples, tmp_path):
    x, _ = samples
    np.save(tmp_path / "x.npy", x.numpy())
    store = layertap.extract_dataset(resnet, tmp_path / "x.npy", "avgpool", tmp_path / "f", format="npy", limit=7, batch_size=4, progress=False)
    assert store.num_samples == 7 and isinstance(store["avgpool"], np.memmap)
    assert torch.equal(store.to_torch("avgpool"), reference(resnet, x[:7], "avgpool", 4)["avgpool"])


# --------------------------------------------------------------------- size, progress, memory
def test_the_size_is_estimated_and_a_run_that_does_not_fit_stops_before_writing(resnet, tmp_path, monkeypatch, capsys):
    layertap.extract_dataset(resnet, Counting(8), "layer1", tmp_path / "a.zarr", batch_size=4, progress=True)
    line = capsys.readouterr().err
    assert "for 8 samples" in line and "free" in line
    assert "sample/s" not in line and "it/s" not in line  # no progress bar when stderr is not a terminal

    monkeypatch.setattr(shutil, "disk_usage", lambda path: type("Usage", (), {"free": 1000})())
    with pytest.raises(StoreError, match="only 1.0 KB is free"):
        layertap.extract_dataset(resnet, Counting(8), "layer1", tmp_path / "b.zarr", batch_size=4, progress=False)
    assert not (tmp_path / "b.zarr").exists()
    assert capsys.readouterr().err == ""  # progress=False: quiet


def test_a_progress_bar_on_a_terminal(resnet, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)
    layertap.extract_dataset(resnet, Counting(8), "avgpool", tmp_path / "f.zarr", batch_size=4)
    err = capsys.readouterr().err
    assert "8/8" in err and "sample/s" in err and "layertap: ~" in err


MEMORY_RUN = """
import sys, torch, layertap

class Noise(torch.utils.data.Dataset):
    def __init__(self, n): self.n = n
    def __len__(self): return self.n
    def __getitem__(self, i): return torch.randn(3, 16, 16, generator=torch.Generator().manual_seed(i))

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU())
layertap.extract_dataset(model, Noise(int(sys.argv[1])), "0", sys.argv[2], batch_size=50, progress=False)
# this process's own peak: ru_maxrss would also count the parent's, kept across fork and exec
print(next(line.split()[1] for line in open("/proc/self/status") if line.startswith("VmHWM")))
"""


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads the peak memory from Linux's /proc")
def test_peak_memory_does_not_grow_with_the_number_of_samples(tmp_path):
    # 64 KB of features per sample: 1600 samples are 100 MB, which a run keeping them would show
    def start(n: int) -> subprocess.Popen:
        return subprocess.Popen([sys.executable, "-c", MEMORY_RUN, str(n), str(tmp_path / f"{n}.zarr")], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def peak(run: subprocess.Popen) -> int:
        out, err = run.communicate()
        assert run.returncode == 0, err
        return int(out.split()[-1])

    small, large = start(200), start(1600)  # side by side: each reads its own peak
    small_run, large_run = peak(small), peak(large)
    assert large_run < small_run * 1.10, (small_run, large_run)


def test_a_layer_run_twice_per_forward_is_stored_as_its_first_call_whatever_else_is_chosen(tmp_path):
    # resnet's block ReLU runs twice; FX's node without a suffix is the first call. Before, the
    # store held the first call alone and the second beside a later layer: both now hold the first
    from torchvision.models.feature_extraction import create_feature_extractor

    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    data = torch.randn(6, 3, 32, 32)
    with torch.no_grad():
        want = create_feature_extractor(model, return_nodes=["layer1.0.relu"])(data)["layer1.0.relu"]
    alone = layertap.extract_dataset(model, data, "layer1.0.relu", out=tmp_path / "a.zarr", batch_size=4, progress=False)
    with_later = layertap.extract_dataset(model, data, ["layer1.0.relu", "fc"], out=tmp_path / "b.zarr", batch_size=4, progress=False)
    for store in (alone, with_later):
        torch.testing.assert_close(store.to_torch("layer1.0.relu"), want, rtol=1e-5, atol=1e-6)  # another batch split than FX's
        assert store.meta["settings"]["calls"] == "first"


class SharedReLU(nn.Module):
    """One ReLU called twice per forward, a head after it."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.relu, self.b, self.head = nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.relu(self.b(self.relu(self.a(x)))))


def as_older(out: Path, last_chunk: int) -> None:
    """The store as a layertap before the "calls" setting left it when killed: its settings say
    nothing of which call it keeps, and its last chunk is not written."""
    import json

    meta_path = out / "zarr.json"
    meta = json.loads(meta_path.read_text())
    layertap_meta = meta["attributes"]["layertap"]
    del layertap_meta["settings"]["calls"]
    layertap_meta["complete"] = False
    meta_path.write_text(json.dumps(meta))
    (out / "_chunks" / "c" / str(last_chunk)).unlink()


@pytest.mark.parametrize("verify", ["close", "off"])
def test_a_store_of_an_older_layertap_is_resumed_and_never_mixed(tmp_path, verify):
    torch.manual_seed(0)
    model, data = SharedReLU().eval(), torch.randn(12, 4)
    options = {"batch_size": 4, "chunk_size": 4, "progress": False, "num_workers": 0}
    # no layer runs twice before the last: the older store resumes into the same rows
    whole = layertap.extract_dataset(model, data, ["a", "head"], out=tmp_path / "whole.zarr", **options).to_numpy("head")
    layertap.extract_dataset(model, data, ["a", "head"], out=tmp_path / "s.zarr", **options)
    as_older(tmp_path / "s.zarr", last_chunk=2)
    resumed = layertap.extract_dataset(model, data, ["a", "head"], out=tmp_path / "s.zarr", verify=verify, **options)
    assert resumed.complete and np.array_equal(resumed.to_numpy("head"), whole)
    # the ReLU beside a later layer: an older layertap stored its last call, this one its first;
    # the written rows are recomputed and found to differ, whatever verify= says: refused, unmixed
    out = tmp_path / "r.zarr"
    layertap.extract_dataset(model, data, ["relu", "head"], out=out, **options)
    calls = []
    handle = model.relu.register_forward_hook(lambda m, a, o: calls.append(o.detach().clone()))
    with torch.no_grad():
        model(data)
    handle.remove()
    import zarr

    zarr.open_array(str(out / "features" / "relu"), mode="r+")[:] = calls[1].numpy()  # what the older one wrote
    as_older(out, last_chunk=2)
    with pytest.raises(layertap.errors.DataChangedError, match=r"differ from the stored rows in 'relu'"):
        layertap.extract_dataset(model, data, ["relu", "head"], out=out, verify=verify, **options)
    assert not layertap.open_features(out).complete
