"""What each store format declares, which the rest of layertap asks instead of knowing it: the package a
format needs, how many writers it takes, and the one codec Zarr stores (and estimates sizes) with."""

from __future__ import annotations

import importlib
from importlib import metadata

import numpy as np
import pytest

from layertap.store import StoreError
from layertap.store.backends import FORMATS, check_writers, format_package
from layertap.store.format import StorePlan, _Codec, array_specs
from layertap.store.writer import StoreWriter


@pytest.mark.parametrize("format", FORMATS)
def test_each_format_names_the_package_its_backend_imports(format):
    # the packages that reading and writing each format imports (zarr.open_group, h5py.File, np.load)
    assert format_package(format) == {"zarr": "zarr", "hdf5": "h5py", "npy": "numpy"}[format]
    importlib.import_module(format_package(format))
    assert metadata.version(format_package(format))  # what a store records of it


def test_hdf5_takes_one_writer_and_zarr_and_npy_one_per_process(tmp_path):
    with pytest.raises(StoreError, match=r"^2 processes cannot write one HDF5 file \(.*f\.h5\): HDF5 takes one writer at a time\. Write Zarr"):
        check_writers("hdf5", 2, tmp_path / "f.h5")
    check_writers("hdf5", 1, tmp_path / "f.h5")
    for format in ("zarr", "npy"):
        check_writers(format, 64, tmp_path / "f")


def test_the_size_estimate_compresses_as_the_store_does(tmp_path):
    # one codec: the estimate of a batch is the size of the chunk file Zarr writes for it
    data = np.round(np.random.default_rng(0).standard_normal((8, 64)), 1).astype(np.float32)
    plan = StorePlan(array_specs([("layer", None, (64,), "float32")]), 8, 8, None, None, {"layer": data})
    writer = StoreWriter.create(tmp_path / "s.zarr", "zarr", {"settings": {}, "layers": ["layer"]}, plan)
    writer.write_chunk(0, {"layer": data}, None, [])
    writer.close()
    stored = (tmp_path / "s.zarr" / "features" / "layer" / "c" / "0" / "0").stat().st_size
    assert stored < data.nbytes  # compressed, so the comparison says something
    assert _Codec.ratio({"layer": data}) * data.nbytes == stored


def test_an_hdf5_file_this_process_holds_open_names_closing_it(tmp_path):
    """HDF5 refuses to open a file for writing that this process has open for reading (a store opened
    to look at a killed run, not closed): the fix is to close it, not to delete the file."""
    import h5py

    data = np.ones((8, 4), dtype=np.float32)
    plan = StorePlan(array_specs([("layer", None, (4,), "float32")]), 8, 8, None, None, {"layer": data})
    StoreWriter.create(tmp_path / "s.h5", "hdf5", {"settings": {}, "layers": ["layer"]}, plan).close()
    with h5py.File(tmp_path / "s.h5", "r"), pytest.raises(StoreError, match=r"already open.*; close the store this process has open on it \(store\.close\(\)"):
        StoreWriter.open(tmp_path / "s.h5")
    StoreWriter.open(tmp_path / "s.h5").close()  # closed: it opens
