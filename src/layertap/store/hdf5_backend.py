"""HDF5 stores: one file whose arrays of known length are allocated when it is made, so writing a
chunk changes data only, never the file's structure; flushed and synced after every chunk."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import StoreError, require
from .backend import _Backend
from .format import _fit, _marker_width
from .paths import Location, _bad, _names, _one_line

_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_HELD = "close the store this process has open on it (store.close(), or a with block) and run again"
_TORN = "an HDF5 file is not safe from a crash while it is written: if a run was killed, delete the file and run again, or use Zarr, which resumes after a crash"


class _HDF5Backend(_Backend):
    format = "hdf5"
    SUFFIXES = (".h5", ".hdf5", ".hdf")
    PACKAGE = "h5py"
    WRITERS = 1
    TOO_MANY_WRITERS = (
        "{world} processes cannot write one HDF5 file ({out}): HDF5 takes one writer at a time. Write "
        "Zarr (the default: --out feats.zarr), or npy; both take a writer per process"
    )
    ONE_FILE = True
    DONE = "_done"  # a flag per chunk, set once its marker (in MARKERS) is written
    path: Path

    def __init__(self, path: Path, mode: str) -> None:
        super().__init__(path, mode)
        self.h5py = require(self.PACKAGE, "store")
        try:
            # no chunk cache: a write reaches the file (and fails there, on a full disk) when made,
            # not when HDF5 evicts it later, where h5py can only print the error
            self.file = self.h5py.File(path, mode, rdcc_nbytes=0)
        except OSError as e:  # "already open": this process holds it (a store opened and not closed)
            raise StoreError(f"cannot open the HDF5 file {path} ({e}); " + (_HELD if "already open" in str(e) else _TORN)) from e

    @classmethod
    def holds(cls, path: Location) -> bool:
        path = Path(path)
        if not path.is_file():
            return False
        with open(path, "rb") as f:
            return f.read(8) == _HDF5_SIGNATURE

    def read_text(self, array: Any) -> np.ndarray:
        return array.asstr()[:]

    def check(self) -> None:
        # HDF5 can point outside the file: external links, external raw storage, virtual datasets;
        # and filters, which layertap never writes: one may inflate a chunk without bound (deflate
        # grows its buffer until the stream ends) or load a plugin the file names
        def problem(name: str, link: Any) -> str | None:  # a value stops the visit (raising in it breaks h5py)
            if not isinstance(link, self.h5py.HardLink):
                return f"its entry {name!r} is a {type(link).__name__}, which leads outside the file"
            obj = self.file[name]
            if isinstance(obj, self.h5py.Dataset) and (obj.external or obj.is_virtual):
                return f"its array {name!r} keeps its data outside the file"
            plist = obj.id.get_create_plist() if isinstance(obj, self.h5py.Dataset) else None
            if plist is not None and plist.get_nfilters():
                names = [plist.get_filter(i)[3].decode(errors="replace")[:40] for i in range(plist.get_nfilters())]
                return (
                    f"its array {name!r} is stored through HDF5 filters {names}, which layertap never writes (a filter "
                    "can inflate a chunk without bound, or load a plugin): extract it again with layertap"
                )
            return None

        found = self.file.visititems_links(problem)
        if found:
            raise _bad(self.path, found)

    def foreign(self, meta: Mapping) -> list[str]:
        """The file's arrays, groups and attributes that layertap did not write."""
        arrays, groups = _names(meta)
        ours = arrays | groups | {self.MARKERS, self.DONE}
        names: list[str] = []
        self.file.visit_links(names.append)  # every name, links included, none followed
        found = [f"attribute {a!r}" for a in self.file.attrs if a != "layertap"] + [n for n in names if n not in ours]
        for name in names:
            if name in ours and isinstance(self.file.get(name, getlink=True), self.h5py.HardLink):
                found += [f"attribute {a!r} of {name!r}" for a in self.file[name].attrs]
        return found

    def read_meta(self) -> dict | None:
        text = self.file.attrs.get("layertap")
        if text is None:
            return None
        try:
            return json.loads(text)
        except (ValueError, TypeError, RecursionError) as e:  # RecursionError: nested too deep to read
            raise _bad(self.path, f"its metadata is not JSON that can be read ({_one_line(e)})") from e

    def write_meta(self, meta: dict) -> None:
        self.file.attrs["layertap"] = json.dumps(meta)
        self.sync()

    def create(self, name: str, shape: tuple, dtype: Any, chunk: int, fill: Any) -> None:
        if dtype is str:
            dtype, fill = self.h5py.string_dtype(), None
        dcpl = self.h5py.h5p.create(self.h5py.h5p.DATASET_CREATE)
        # allocated now: writing a chunk later changes data only, never the file's structure
        dcpl.set_alloc_time(self.h5py.h5d.ALLOC_TIME_EARLY)
        self.file.create_dataset(
            name, shape=shape, maxshape=(None, *shape[1:]), chunks=(max(1, chunk), *shape[1:]), dtype=dtype, fillvalue=fill, dcpl=dcpl
        )

    def array(self, name: str) -> Any:
        if name not in self.file:
            raise KeyError(name)
        found = self.file[name]
        if not isinstance(found, self.h5py.Dataset):
            raise _bad(self.path, f"{name!r} is a group, not an array")
        # allocated whole when made, whatever the layout: without it, fill values read as data (or a huge shape as memory)
        if found.id.get_storage_size() < found.size * found.dtype.itemsize:  # (variable-length text: 16 bytes stored per 8)
            raise _bad(self.path, f"array {name!r} has no storage for all its rows (a layertap HDF5 store allocates it all)")
        return found

    def is_text(self, array: Any) -> bool:
        return self.h5py.check_string_dtype(array.dtype) is not None

    def kind(self, array: Any) -> str:
        if self.h5py.check_ref_dtype(array.dtype) is not None:
            return "HDF5 object references"
        return "HDF5 variable-length objects" if array.dtype.kind == "O" else super().kind(array)

    def write(self, name: str, start: int, data: np.ndarray) -> None:
        self.file[name][start : start + len(data)] = data

    def resize(self, name: str, n: int) -> None:
        self.file[name].resize(n, axis=0)

    def mark(self, chunk: int, text: str) -> None:
        # markers are fixed-size rows allocated with the file: marking a chunk writes data into
        # space that exists, so a full disk cannot leave the file's structure half written
        markers, done = self.file[self.MARKERS], self.file[self.DONE]
        if chunk >= markers.shape[0]:
            markers.resize(chunk + 1, axis=0)
            done.resize(chunk + 1, axis=0)
        row = _fit(text, markers.shape[1])
        markers[chunk] = np.frombuffer(row.ljust(markers.shape[1], b"\0"), dtype=np.uint8)
        self.sync()  # the marker's text before its flag
        done[chunk] = 1

    def markers(self) -> dict[int, str]:
        markers = self.array(self.MARKERS)  # through `array`: arrays, with their storage, or refused
        if self.DONE not in self.file and markers.ndim == 1 and self.is_text(markers):  # a version-1 store: text markers
            values = markers.asstr()[:]
            return {int(i): str(values[i]) for i in np.flatnonzero(values != "")}
        done = self.array(self.DONE)  # KeyError when missing: the markers are refused as missing
        if markers.ndim != 2 or markers.dtype != np.uint8 or done.shape != markers.shape[:1] or done.dtype.kind not in "biu":
            raise _bad(self.path, "its chunk markers (bytes, a row per chunk) and their flags (a number per chunk) do not agree")
        try:
            return {int(c): markers[c].tobytes().rstrip(b"\0").decode() for c in np.flatnonzero(done[:])}
        except UnicodeDecodeError as e:
            raise _bad(self.path, f"a chunk marker is not text ({_one_line(e)})") from e

    def create_markers(self, n: int, chunk_size: int) -> None:
        width = _marker_width(chunk_size)
        for name, shape, dtype in ((self.MARKERS, (n, width), np.uint8), (self.DONE, (n,), np.uint8)):
            self.create(name, shape, dtype, 1 if name == self.MARKERS else 256, 0)

    def sync(self) -> None:
        self.file.flush()
        os.fsync(self.file.id.get_vfd_handle())

    def close(self) -> None:
        if self.file:  # closing a file twice is an error in h5py
            self.file.close()
