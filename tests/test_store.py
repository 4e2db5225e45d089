"""layertap.store: safe array names, the read-only FeatureStore, completeness."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from torch import nn

import layertap
from layertap.records import SkippedSample
from layertap.store import StoreError
from layertap.store.backends import format_for
from layertap.store.format import StorePlan, array_specs, safe_name
from layertap.store.lifecycle import remove_store
from layertap.store.writer import StoreWriter


class OddNames(nn.Module):
    """Layers whose names are no good as file names."""

    def __init__(self):
        super().__init__()
        names = ["a/b", "__init__x", "A", "a", "sp ace", "c\\d"]
        self.blocks = nn.ModuleDict({name: nn.Linear(4, 4) for name in names})

    def forward(self, x):
        return sum(block(x) for block in self.blocks.values())


@pytest.mark.parametrize("format", ["npy", "zarr"])
def test_layer_names_become_safe_array_names_inside_the_store(tmp_path, format):
    torch.manual_seed(0)
    model = OddNames().eval()
    x = torch.randn(6, 4)
    out = tmp_path / "store"
    store = layertap.extract_dataset(model, x, "blocks.*", out, format=format, batch_size=3, progress=False)
    parts = [layertap.extract(model, x[i : i + 3], "blocks.*") for i in (0, 3)]  # the same batches: bit-exact
    expected = {k: torch.cat([p[k] for p in parts]) for k in parts[0]}
    assert list(store) == list(expected)
    for key, value in expected.items():
        assert torch.equal(store.to_torch(key), value)
    paths = [spec["path"] for spec in store.meta["arrays"]]
    assert len({p.lower() for p in paths}) == len(paths)  # distinct even on a case-insensitive disk
    for root, _, files in os.walk(tmp_path):
        for name in files:
            assert os.path.realpath(os.path.join(root, name)).startswith(os.path.realpath(out) + os.sep)
    assert all("/" not in p.removeprefix("features/") and "\\" not in p for p in paths)


def test_safe_names():
    assert safe_name("layer4.1.conv2") == "layer4.1.conv2"
    assert safe_name("") == "model"
    assert safe_name("a/../b") == "a_.._b"
    assert safe_name(".hidden") == "hidden"
    assert safe_name("__x") == "layer__x"
    specs = array_specs(
        [("a b", None, (2,), "float32"), ("x", None, (2,), "float32"), ("a_b", 0, (3,), "float16"), ("a_b", 1, (1,), "int64"), ("A?b", None, (1,), "int8")]
    )
    assert [(s.key, s.path) for s in specs] == [
        ("a b", "features/a_b"),
        ("x", "features/x"),
        ("a_b/0", "features/a_b-2/0"),
        ("a_b/1", "features/a_b-2/1"),
        ("A?b", "features/A_b-3"),
    ]


def test_format_from_the_path():
    assert format_for("f.h5", None) == "hdf5"
    assert format_for("f.zarr", None) == "zarr"
    assert format_for("features", None) == "zarr"
    assert format_for("features", "npy") == "npy"
    with pytest.raises(ValueError, match="unknown format='parquet'"):
        format_for("f", "parquet")


def new_store(tmp_path, num_samples=10, chunk_size=4):
    specs = array_specs([("layer", None, (3,), "float32")])
    layout = StorePlan(specs, num_samples, chunk_size, None, "int64", {"layer": np.zeros((1, 3), np.float32)})
    return StoreWriter.create(tmp_path / "s.zarr", "zarr", {"settings": {}, "layers": ["layer"]}, layout)


def test_a_store_is_complete_only_when_every_chunk_is_written(tmp_path):
    writer = new_store(tmp_path)
    writer.write_chunk(0, {"layer": np.ones((4, 3), np.float32)}, np.arange(4), [])
    writer.write_chunk(2, {"layer": np.full((2, 3), 2, np.float32)}, np.arange(8, 10), [SkippedSample(9, 9, "OSError: unreadable")])
    with pytest.raises(StoreError, match=r"chunks \[1\]"):
        writer.finish(10)
    writer.close()
    with pytest.warns(UserWarning, match="incomplete"):
        store = layertap.open_features(tmp_path / "s.zarr")
    assert not store.complete and "INCOMPLETE" in repr(store)
    values = store.to_numpy("layer")
    assert (values[:4] == 1).all() and np.isnan(values[4:8]).all() and (values[8:] == 2).all()
    assert store.labels.tolist() == [0, 1, 2, 3, -1, -1, -1, -1, 8, 9]
    # the rows that hold features: not the unwritten chunk, not the failed sample
    assert store.valid.tolist() == [True] * 4 + [False] * 4 + [True, False]


def test_the_feature_store_is_a_read_only_mapping(tmp_path):
    writer = new_store(tmp_path, num_samples=4)
    writer.write_chunk(0, {"layer": np.ones((4, 3), np.float32)}, np.arange(4), [])
    writer.finish(4)
    writer.close()
    store = layertap.open_features(tmp_path / "s.zarr")
    assert list(store) == ["layer"] and len(store) == 1 and store.layers == ["layer"]
    assert store.to_torch("layer").dtype == torch.float32 and store.ids.tolist() == [0, 1, 2, 3]
    with pytest.raises(KeyError, match="it holds \\['layer'\\]"):
        store["other"]
    with pytest.raises(ValueError, match="read-only"):
        store["layer"][0] = 5
    assert store.to_numpy("layer")[0, 0] == 1


def test_anything_that_is_not_a_store_is_refused(tmp_path):
    (tmp_path / "folder").mkdir()
    (tmp_path / "folder" / "data.txt").write_text("mine")
    with pytest.raises(StoreError, match="no layertap feature store"):
        layertap.open_features(tmp_path / "folder")
    with pytest.raises(StoreError, match="not a layertap feature store"):
        remove_store(tmp_path / "folder")
    import zarr

    zarr.open_group(str(tmp_path / "other.zarr"), mode="w")  # a Zarr group of someone else's
    with pytest.raises(StoreError, match="not a layertap feature store"):
        remove_store(tmp_path / "other.zarr")
    assert (tmp_path / "folder" / "data.txt").exists() and (tmp_path / "other.zarr").exists()


def test_a_zarr_store_in_an_object_store_through_an_fsspec_url(tmp_path):
    """fsspec's in-memory filesystem stands in for s3:// or gs://: the same code path, no network."""
    import fsspec

    url = f"memory://layertap-test-{os.getpid()}/feats.zarr"
    model = nn.Sequential(nn.Flatten(), nn.Linear(12, 4)).eval()
    x = torch.randn(30, 3, 2, 2)
    batches = [x[i : i + 2] for i in range(0, 30, 2)]

    def breaking():
        yield from batches[:5]
        raise RuntimeError("the connection dropped")

    with pytest.raises(RuntimeError, match="dropped"):
        layertap.extract_dataset(model, breaking(), "1", url, chunk_size=4, progress=False)
    writer = StoreWriter.open(url)
    assert sorted(writer.done()) == [0, 1]  # 10 samples: two whole chunks, kept
    writer.close()
    store = layertap.extract_dataset(model, iter(batches), "1", url, chunk_size=4, progress=False)
    assert store.complete and store.path == url
    assert torch.equal(layertap.open_features(url).to_torch("1"), layertap.extract(model, x, "1")["1"])

    fs = fsspec.filesystem("memory")
    fs.pipe(f"/layertap-test-{os.getpid()}/other/data.bin", b"not ours")
    with pytest.raises(StoreError, match="is not a layertap feature store"):
        layertap.extract_dataset(model, x, "1", url.replace("feats.zarr", "other"), progress=False)
    with pytest.raises(StoreError, match="only Zarr stores can be written to an object store"):
        layertap.extract_dataset(model, x, "1", url.replace(".zarr", ".h5"), progress=False)
    remove_store(url)
    assert not fs.exists(f"/layertap-test-{os.getpid()}/feats.zarr")


@pytest.mark.parametrize("fmt, leftover", [("npy", ".layertap.json.4242.tmp"), ("zarr", f"zarr.{'ab12' * 8}.partial")])
def test_a_store_killed_in_its_first_metadata_write_is_made_anew(tmp_path, fmt, leftover):
    """What a kill inside the first write of a store's metadata leaves, before the rename that
    makes it the store's (layertap's temporary file for NumPy, Zarr's partial file): its folder
    holding only that file. The next run makes the store there (it used to refuse the folder as
    not a store, for good); the same file beside anything else is still a folder that is not one."""
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    data = torch.randn(10, 4)
    whole = layertap.extract_dataset(model, data, "0", tmp_path / f"whole.{fmt}", format=fmt, batch_size=4, progress=False).to_numpy("0")
    out, other = tmp_path / f"f.{fmt}", tmp_path / f"g.{fmt}"
    for folder in (out, other):
        folder.mkdir()
        (folder / leftover).write_text('{"layertap_store": 2, "for')
    (other / "notes.txt").write_text("mine")
    again = layertap.extract_dataset(model, data, "0", out, format=fmt, batch_size=4, progress=False)
    assert again.complete and np.array_equal(again.to_numpy("0"), whole)
    with pytest.raises(layertap.StoreError, match="is not a layertap feature store"):
        layertap.extract_dataset(model, data, "0", other, format=fmt, batch_size=4, progress=False)


@pytest.mark.parametrize("fmt", ["npy", "zarr"])
def test_a_store_killed_while_being_made_is_made_anew_and_never_read(tmp_path, fmt):
    import json
    import shutil

    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
    data = torch.randn(10, 4)
    out = tmp_path / f"f.{fmt}"
    whole = layertap.extract_dataset(model, data, "0", out, format=fmt, batch_size=4, progress=False).to_numpy("0")
    # what a kill between the metadata and the arrays leaves: ready=False, an array missing
    meta_file = out / ("layertap.json" if fmt == "npy" else "zarr.json")
    meta = json.loads(meta_file.read_text())
    layer_meta = meta if fmt == "npy" else meta["attributes"]["layertap"]
    layer_meta.update(ready=False, complete=False)
    meta_file.write_text(json.dumps(meta))
    (out / "ids.npy").unlink() if fmt == "npy" else shutil.rmtree(out / "ids")
    with pytest.raises(layertap.StoreError, match="holds no features: it was being created"):
        layertap.open_features(out)
    again = layertap.extract_dataset(model, data, "0", out, format=fmt, batch_size=4, progress=False)
    assert again.complete and np.array_equal(again.to_numpy("0"), whole)
