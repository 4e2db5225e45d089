"""--overwrite (overwrite=True) removes only what layertap wrote: its arrays, markers and metadata.
A store folder or HDF5 file that holds anything else is refused, naming it, and nothing is deleted."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from torch import nn

import layertap
from layertap.errors import StoreError

FORMATS = {"zarr": "s.zarr", "hdf5": "s.h5", "npy": "s"}


def tiny() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 5), nn.ReLU(), nn.Linear(5, 3)).eval()


def data(seed: int = 0) -> torch.utils.data.TensorDataset:
    g = torch.Generator().manual_seed(seed)
    return torch.utils.data.TensorDataset(torch.randn(10, 3, 2, 2, generator=g), torch.arange(10) % 3)


def extract(out, format, seed=0, **options):
    options = {"batch_size": 2, "chunk_size": 4, "progress": False, **options}
    return layertap.extract_dataset(tiny(), data(seed), ["1", "3"], out, format=format, **options)


def reference(seed: int) -> np.ndarray:
    """Layer 1's features of ``data(seed)``, computed by the model directly."""
    model = tiny()
    with torch.no_grad():
        return model[1](model[0](data(seed).tensors[0])).numpy()


def snapshot(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line(e: BaseException) -> bool:
    return "\n" not in str(e)


@pytest.mark.parametrize("format", ["zarr", "npy"])
def test_overwrite_refuses_a_store_folder_holding_the_users_files_and_deletes_nothing(tmp_path, format):
    out = tmp_path / FORMATS[format]
    extract(out, format).close()
    (out / "NOTES.md").write_text("what these features are for")
    (out / "plots").mkdir()
    (out / "plots" / "umap.png").write_bytes(b"\x89PNG a plot")
    before = snapshot(out)
    with pytest.raises(StoreError, match=r"holds what layertap did not write \('NOTES.md', 'plots/'\)") as e:
        extract(out, format, seed=1, overwrite=True)
    assert one_line(e.value) and "move that out of it" in str(e.value)
    assert snapshot(out) == before  # not one file touched: the store still reads as before
    with layertap.open_features(out) as store:
        np.testing.assert_array_equal(store.to_numpy("1"), reference(0))
    # moved out, the same overwrite replaces the store
    (out / "NOTES.md").rename(tmp_path / "NOTES.md")
    (out / "plots").rename(tmp_path / "plots")
    with extract(out, format, seed=1, overwrite=True) as store:
        assert store.complete
        np.testing.assert_array_equal(store.to_numpy("1"), reference(1))


@pytest.mark.parametrize("format", ["zarr", "npy"])
@pytest.mark.parametrize("where", ["features/README.txt", "features/1/notes.txt", "_chunks/mine.json", "ids/x"])
def test_a_users_file_deep_inside_a_store_folder_is_found_too(tmp_path, format, where):
    out = tmp_path / FORMATS[format]
    extract(out, format).close()
    if format == "npy" and where.startswith(("features/1/", "ids/")):
        where = where.replace("features/1/", "features/").replace("ids/", "")  # npy arrays are files, not folders
    (out / where).parent.mkdir(parents=True, exist_ok=True)
    (out / where).write_text("mine")
    before = snapshot(out)
    with pytest.raises(StoreError, match=f"did not write \\({where!r}\\)"):
        extract(out, format, overwrite=True)
    assert snapshot(out) == before


def test_overwrite_removes_what_a_killed_write_left_behind(tmp_path):
    """Temporary files of a write killed midway are layertap's too: they go, and nothing is refused."""
    zarr_store, npy_store = tmp_path / "s.zarr", tmp_path / "s"
    extract(zarr_store, "zarr").close()
    extract(npy_store, "npy").close()
    left = [
        zarr_store / f"zarr.{'a' * 32}.partial",  # Zarr writes a file under a temporary name, then renames it
        zarr_store / "features" / "1" / "c" / "0" / f"0.{'b' * 32}.partial",
        npy_store / ".layertap.json.4242.tmp",
        npy_store / "_chunks" / ".000000001.json.4242.tmp",
    ]
    for file in left:
        file.write_bytes(b"half")
    for out, format in ((zarr_store, "zarr"), (npy_store, "npy")):
        with extract(out, format, seed=1, overwrite=True) as store:
            np.testing.assert_array_equal(store.to_numpy("1"), reference(1))
    assert not any(file.exists() for file in left)


def test_overwrite_refuses_an_hdf5_file_holding_the_users_arrays_or_attributes(tmp_path):
    import h5py

    out = tmp_path / "s.h5"
    extract(out, "hdf5").close()
    with h5py.File(out, "r+") as f:
        f["my_analysis/umap"] = np.ones((10, 2))
        f.attrs["author"] = "me"
        f["features/1"].attrs["note"] = "checked"
    before = out.read_bytes()
    with pytest.raises(StoreError, match=r"did not write \(\"attribute 'author'\", 'my_analysis', 'my_analysis/umap', \"attribute 'note' of 'features/1'\"\)") as e:
        extract(out, "hdf5", seed=1, overwrite=True)
    assert one_line(e.value) and out.read_bytes() == before
    with h5py.File(out, "r+") as f:
        del f["my_analysis"], f.attrs["author"], f["features/1"].attrs["note"]
    with extract(out, "hdf5", seed=1, overwrite=True) as store:
        np.testing.assert_array_equal(store.to_numpy("1"), reference(1))


def test_overwrite_refuses_a_zarr_store_holding_the_users_attributes(tmp_path):
    import zarr

    out = tmp_path / "s.zarr"
    extract(out, "zarr").close()
    group = zarr.open_group(str(out), mode="r+")
    group.attrs["author"] = "me"
    group["features/1"].attrs["note"] = "checked"
    before = snapshot(out)
    with pytest.raises(StoreError, match=r"did not write \(\"attribute 'author'\", \"attribute 'note' of 'features/1'\"\)"):
        extract(out, "zarr", seed=1, overwrite=True)
    assert snapshot(out) == before


def test_overwrite_through_a_symlink_to_an_hdf5_file_replaces_that_file(tmp_path):
    """The store is the file the link leads to: it is replaced there, and the link stays a link."""
    real = tmp_path / "data" / "real.h5"
    real.parent.mkdir()
    extract(real, "hdf5").close()
    link = tmp_path / "link.h5"
    link.symlink_to(real)
    with extract(link, "hdf5", seed=1, overwrite=True) as store:
        np.testing.assert_array_equal(store.to_numpy("1"), reference(1))
    assert link.is_symlink() and link.resolve() == real.resolve()
    with layertap.open_features(real) as store:
        np.testing.assert_array_equal(store.to_numpy("1"), reference(1))


def test_a_half_made_store_holding_the_users_files_is_not_removed_either(tmp_path):
    """A store whose writer was killed while making it is made anew on the next run, unless
    the folder holds someone's files."""
    out = tmp_path / "s.zarr"
    extract(out, "zarr").close()
    meta_file = out / "zarr.json"
    group = json.loads(meta_file.read_text())
    group["attributes"]["layertap"]["ready"] = False
    meta_file.write_text(json.dumps(group))
    (out / "NOTES.md").write_text("mine")
    with pytest.raises(StoreError, match=r"did not write \('NOTES.md'\)"):
        extract(out, "zarr")
    assert (out / "NOTES.md").read_text() == "mine"
    os.remove(out / "NOTES.md")
    with extract(out, "zarr") as store:
        assert store.complete


def test_overwrite_in_an_object_store_refuses_the_users_objects_too():
    import fsspec

    url = f"memory://layertap-overwrite-{os.getpid()}/s.zarr"
    fs = fsspec.filesystem("memory")
    try:
        extract(url, "zarr").close()
        fs.pipe(f"/layertap-overwrite-{os.getpid()}/s.zarr/plots/umap.png", b"a plot")
        with pytest.raises(StoreError, match=r"did not write \('plots/'\)"):
            extract(url, "zarr", seed=1, overwrite=True)
        assert fs.cat(f"/layertap-overwrite-{os.getpid()}/s.zarr/plots/umap.png") == b"a plot"
        fs.rm(f"/layertap-overwrite-{os.getpid()}/s.zarr/plots", recursive=True)
        with extract(url, "zarr", seed=1, overwrite=True) as store:
            np.testing.assert_array_equal(store.to_numpy("1"), reference(1))
    finally:
        fs.rm(f"/layertap-overwrite-{os.getpid()}", recursive=True)


def test_an_overwrite_across_a_folder_and_a_file_store_is_refused_and_nothing_removed(tmp_path):
    # a Zarr folder at "u.h5" overwritten as HDF5: it was emptied, then the file could not be made
    out = tmp_path / "u.h5"
    extract(out, "zarr")
    before = sorted(p.relative_to(out) for p in out.rglob("*"))
    with pytest.raises(StoreError, match=r"^.*u\.h5 is a zarr store \(a folder\), which a hdf5 store \(one file\) cannot replace: write to another path") as e:
        extract(out, "hdf5", overwrite=True)
    assert "\n" not in str(e.value)
    assert sorted(p.relative_to(out) for p in out.rglob("*")) == before
    with layertap.open_features(out) as store:
        np.testing.assert_allclose(store.to_numpy("1"), reference(0), rtol=1e-5)
    # and the other way: an HDF5 file overwritten as a folder store
    h5 = tmp_path / "f.h5"
    extract(h5, "hdf5")
    with pytest.raises(StoreError, match=r"is a hdf5 store \(one file\), which a npy store \(a folder\) cannot replace"):
        extract(h5, "npy", overwrite=True)
    assert layertap.open_features(h5).num_samples == 10


def test_metadata_naming_a_users_folder_as_an_array_does_not_make_overwrite_delete_it(tmp_path):
    out = tmp_path / "s.zarr"
    extract(out, "zarr")
    mine = out / "features" / "mine" / "c" / "0"
    mine.parent.mkdir(parents=True)
    mine.write_text("precious")
    meta = json.loads((out / "zarr.json").read_text())
    lt = meta["attributes"]["layertap"]
    lt["arrays"].append({"key": "mine", "path": "features/mine", "layer": "mine", "leaf": None, "shape": [3], "dtype": "float32"})
    lt["layers"].append("mine")
    (out / "zarr.json").write_text(json.dumps(meta))
    with pytest.raises(StoreError, match=r"holds what layertap did not write \('features/mine/c/'\)"):
        extract(out, "zarr", overwrite=True)
    assert mine.read_text() == "precious"
