"""The formats: Zarr (the default), HDF5 and NumPy folders, each one class of primitive reads and writes.

`StoreWriter` and `FeatureStore` reach a store's files only through a backend. Each declares what
the rest of the package and the extraction ask of its format (its suffixes, the package it needs,
how many processes may write one store at once, whether it takes URLs or grows...), so adding a
format is one class here, added to `BACKENDS`; `format_for`, `detect_format`, `format_package`
and `check_writers` answer from those declarations.

Zarr writes every file atomically. HDF5 arrays of known length are allocated when the file is
made, so writing a chunk changes no HDF5 structure, only data; the file is flushed and synced
after every chunk. NumPy files are written in place with ``pwrite``, read as memory maps.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from ..atomic import sync_path
from ..errors import StoreError, require
from .chunks import checked_array, checked_store, stored_indices, stored_markers
from .format import _LOCK, _NPY_HALF_META, _NPY_META, _ZARR_HALF_META, _Codec, _fit, _marker_width
from .paths import Location, _bad, _check_inside, _check_no_links_out, _foreign_entries, _names, _one_line, is_url, url_failed, url_fs

_ZARR_META = re.compile(rf"zarr\.json|{_ZARR_HALF_META.pattern}")  # a partial file: one Zarr was writing
_ZARR_PARTIAL = re.compile(r"[0-9]+\.[0-9a-f]{32}\.partial")
_ZARR_CODECS = {"bytes", "blosc", "vlen-utf8", "zstd", "gzip", "crc32c", "transpose"}  # plain data: no pickle
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"


class _Backend:
    """The primitive reads and writes of one format; `StoreWriter` and `FeatureStore` use them.

    Every name passed in is a store-made name (``ids``, ``labels``, a checked ``features/...``
    path); backends still refuse one that would leave the store.
    """

    format: ClassVar[str]
    SUFFIXES: ClassVar[tuple[str, ...]] = ()  # path suffixes that choose this format
    PACKAGE: ClassVar[str]  # the package the format needs
    WRITERS: ClassVar[int | None] = None  # processes that may write one store at once; None: any number
    TOO_MANY_WRITERS: ClassVar[str] = ""  # why not, in one line, with {world} and {out}
    URLS: ClassVar[bool] = False  # whether it can be written to an object store (fsspec)
    GROWS: ClassVar[bool] = True  # whether its arrays can grow, for data of unknown length
    ONE_FILE: ClassVar[bool] = False  # the store is one file (its lock goes beside it), not a folder
    MARKER_SLOTS: ClassVar[bool] = True  # the chunk markers are one array, a slot per chunk

    MARKERS = "_chunks"

    def __init__(self, path: Location, mode: str) -> None:  # mode: "r", "r+" or "w"
        self.path, self.mode = path, mode

    @classmethod
    def holds(cls, path: Location) -> bool:
        """Whether a store of this format is at ``path`` (a URL only for formats with ``URLS``)."""
        raise NotImplementedError

    @classmethod
    def ratio(cls, arrays: Mapping[str, np.ndarray]) -> float:
        """The fraction of its size that a batch of features keeps once stored in this format."""
        return 1.0

    @staticmethod
    def text_dtype(width: int) -> tuple[Any, Any]:
        """The dtype and fill value of an array of text (ids) of at most ``width`` characters."""
        return str, ""

    def read_text(self, array: Any) -> np.ndarray:
        """All of ``array`` (one of this store's, holding text) as text."""
        return array[:]

    def read_meta(self) -> dict | None:
        raise NotImplementedError

    def write_meta(self, meta: dict) -> None:
        raise NotImplementedError

    def create(self, name: str, shape: tuple, dtype: Any, chunk: int, fill: Any) -> None:
        """A new array ``name`` of ``shape``, stored in pieces of ``chunk`` rows."""
        raise NotImplementedError

    def array(self, name: str) -> Any:
        """The format's lazy array ``name``; `KeyError` when there is none."""
        raise NotImplementedError

    def write(self, name: str, start: int, data: np.ndarray) -> None:
        raise NotImplementedError

    def resize(self, name: str, n: int) -> None:
        raise NotImplementedError

    def mark(self, chunk: int, text: str) -> None:
        """Record ``chunk`` as complete, with its marker's text."""
        raise NotImplementedError

    def markers(self) -> dict[int, str]:
        """The markers of the complete chunks; `KeyError` when the store has no markers."""
        raise NotImplementedError

    def create_markers(self, n: int, chunk_size: int) -> None:
        raise NotImplementedError

    def pieces(self, name: str) -> tuple[int, set[int]] | None:
        """Samples per stored piece of array ``name`` and which pieces exist, where a format keeps
        them apart (Zarr's chunk files); ``None`` where every row always has its storage."""
        return None

    def check(self) -> None:
        """Refuse a store whose files or arrays lead outside it or hold code (per format)."""

    def foreign(self, meta: Mapping) -> list[str]:
        """What the store holds that layertap did not write (a user's notes, plots...), which
        removing the store would lose: the top-most such entries, folders ending in ``/``."""
        arrays, groups = _names(meta)
        return _foreign_entries(self.path, lambda rel, is_dir: self._is_ours(rel, is_dir, arrays, groups))

    def _is_ours(self, rel: str, is_dir: bool, arrays: set[str], groups: set[str]) -> bool:
        """Whether the entry ``rel`` of a store folder is one this format writes (for a store of
        these arrays and groups), a leftover temporary file of a killed write included."""
        raise NotImplementedError

    def is_text(self, array: Any) -> bool:
        """Whether ``array`` (one of this store's) holds text."""
        return np.dtype(array.dtype).kind in "UT"

    def kind(self, array: Any) -> str:
        """What ``array`` holds, for people."""
        return f"{array.dtype} values"

    def sync(self) -> None:
        """Hand everything written so far to the disk, and raise if it did not take it."""

    def close(self) -> None:
        """Release files (formats that hold them open override this)."""


class _ZarrBackend(_Backend):
    format = "zarr"
    SUFFIXES = (".zarr",)
    PACKAGE = "zarr"
    URLS = True

    def __init__(self, path: Location, mode: str) -> None:  # a URL opens through fsspec
        super().__init__(path, mode)
        self.zarr = require(self.PACKAGE, "store")
        # every chunk read is checked before it is decoded (store/chunks.py); fsspec's local
        # filesystem (file://) makes no folders unless told to; object stores need none
        self.store = checked_store(path, mode == "r", {"auto_mkdir": True} if str(path).startswith("file://") else None)
        # "a", not "w": the folder holds the writer's lock, which "w" would delete
        self.root = self.zarr.open_group(self.store, mode="a" if mode == "w" else mode, zarr_format=3, use_consolidated=False)
        self._arrays: dict[str, Any] = {}
        self._written: set[str] = set()  # local chunk files written since the last sync

    @classmethod
    def holds(cls, path: Location) -> bool:
        if isinstance(path, str):  # an object store
            fs, inner = url_fs(path)
            try:
                return bool(fs.exists(f"{inner}/zarr.json"))
            except Exception as e:  # s3fs, gcsfs and botocore raise their own classes (no server, no bucket)
                raise url_failed(path, e) from e
        return (path / "zarr.json").is_file()

    @classmethod
    def ratio(cls, arrays: Mapping[str, np.ndarray]) -> float:
        return _Codec.ratio(arrays)

    def check(self) -> None:
        if not is_url(self.path):
            _check_no_links_out(Path(self.path))

    def foreign(self, meta: Mapping) -> list[str]:
        found = super().foreign(meta)
        arrays, groups = _names(meta)
        for name in ["", *sorted(arrays | groups | {self.MARKERS})]:  # attributes someone added
            try:
                node = self.root[name] if name else self.root
            except Exception:  # not there (a half-made store), or not Zarr: its files are judged above
                continue
            theirs = [a for a in node.attrs.asdict() if name or a != "layertap"]
            found += [f"attribute {a!r}" + (f" of {name!r}" if name else "") for a in theirs]
        return found

    def _is_ours(self, rel: str, is_dir: bool, arrays: set[str], groups: set[str]) -> bool:
        parts = rel.split("/")
        for k in range(1, min(len(parts), 3) + 1):  # an array's path has at most 3 parts
            if "/".join(parts[:k]) in arrays or parts[:k] == [self.MARKERS]:
                rest = parts[k:]
                if not rest:
                    return is_dir  # the array's folder
                if rest[0] != "c":
                    return len(rest) == 1 and not is_dir and _ZARR_META.fullmatch(rest[0]) is not None
                if not self.store.holds_array("/".join(parts[:k])):  # chunks of no array Zarr made: metadata naming a user's folder
                    return False
                pieces = rest[1:]  # c/0/0/...: a chunk file, or the folders it is in
                if not all(p.isascii() and p.isdigit() for p in pieces[:-1]):
                    return False
                return not pieces or (pieces[-1].isascii() and pieces[-1].isdigit()) or (not is_dir and _ZARR_PARTIAL.fullmatch(pieces[-1]) is not None)
        parent, _, name = rel.rpartition("/")
        if is_dir:
            return rel in groups
        return rel == _LOCK or ((parent == "" or parent in groups) and _ZARR_META.fullmatch(name) is not None)

    def read_meta(self) -> dict | None:
        return self.root.attrs.asdict().get("layertap")

    def write_meta(self, meta: dict) -> None:
        self.root.attrs.update({"layertap": meta})

    def create(self, name: str, shape: tuple, dtype: Any, chunk: int, fill: Any) -> None:
        parent, _, leaf = name.rpartition("/")
        group = self.root.require_group(parent) if parent else self.root
        codecs = dict(compressors=_Codec.zarr(self.zarr))
        if dtype is str:
            codecs = {}  # variable-length strings have their own codec
        # every chunk is written, even one of fill values only: a missing file then means a damaged store
        array = group.create_array(leaf, shape=shape, chunks=(chunk, *shape[1:]), dtype=dtype, fill_value=fill, config={"write_empty_chunks": True}, **codecs)
        self._arrays[name] = checked_array(self.store, self.path, name, array)

    def array(self, name: str) -> Any:
        if name not in self._arrays:
            try:
                array = self.root[name]
            except KeyError:
                raise KeyError(name) from None
            except Exception as e:  # metadata Zarr cannot parse (an unknown codec, a bad shape)
                raise _bad(self.path, f"Zarr cannot read its array {name!r} ({type(e).__name__}: {_one_line(e)})") from e
            if not isinstance(array, self.zarr.Array):
                raise _bad(self.path, f"{name!r} is a group, not an array")
            codecs = {c.get("name") if isinstance(c, dict) else c for c in array.metadata.to_dict().get("codecs", [])}
            if not codecs <= _ZARR_CODECS:
                raise _bad(self.path, f"array {name!r} uses codecs {sorted(map(str, codecs - _ZARR_CODECS))}, not plain data ones")
            if array.ndim < 1 or tuple(array.chunks[1:]) != tuple(array.shape[1:]) or array.chunks[0] < 1:
                raise _bad(self.path, f"array {name!r} is chunked {list(array.chunks)}, not in whole samples")
            self._arrays[name] = checked_array(self.store, self.path, name, array)
        return self._arrays[name]

    def write(self, name: str, start: int, data: np.ndarray) -> None:
        array = self.array(name)
        array[start : start + len(data)] = data
        if not is_url(self.path):
            rows = array.chunks[0]
            self._written.update(f"{name}/c/{i}" for i in range(start // rows, -(-(start + len(data)) // rows)))

    def resize(self, name: str, n: int) -> None:
        array = self.array(name)
        array.resize((n, *array.shape[1:]))

    def mark(self, chunk: int, text: str) -> None:
        markers = self.array(self.MARKERS)
        if chunk >= markers.shape[0]:
            markers.resize((chunk + 1,))
        markers[chunk] = text

    def markers(self) -> dict[int, str]:
        return stored_markers(self.store, self.path, self.array(self.MARKERS), self.MARKERS)

    def create_markers(self, n: int, chunk_size: int) -> None:
        # one object per marker: writers of different chunks never touch the same object
        array = self.root.create_array(self.MARKERS, shape=(n,), chunks=(1,), dtype=str, fill_value="")
        self._arrays[self.MARKERS] = checked_array(self.store, self.path, self.MARKERS, array)

    def pieces(self, name: str) -> tuple[int, set[int]] | None:
        """Samples per stored piece of ``name`` and the pieces that exist (listed, not read)."""
        return self.array(name).chunks[0], stored_indices(self.store, f"{name}/c/")

    def sync(self) -> None:
        # Zarr writes each chunk as a file of its own (atomically, by rename): sync those files
        root = Path(self.path)
        for name in self._written:
            top = root / name
            if top.is_file():  # the chunk of a 1-D array is a file, not a folder
                sync_path(top)
            for folder, _, files in os.walk(top):
                for file in files:
                    sync_path(Path(folder, file))
                sync_path(Path(folder))
        self._written.clear()


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
        # HDF5 can point outside the file: external links, external raw storage, virtual datasets
        def problem(name: str, link: Any) -> str | None:  # a value stops the visit (raising in it breaks h5py)
            if not isinstance(link, self.h5py.HardLink):
                return f"its entry {name!r} is a {type(link).__name__}, which leads outside the file"
            obj = self.file[name]
            if isinstance(obj, self.h5py.Dataset) and (obj.external or obj.is_virtual):
                return f"its array {name!r} keeps its data outside the file"
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


class _NpyBackend(_Backend):
    """A folder of ``.npy`` files, written in place with ``pwrite`` and read as memory maps."""

    format = "npy"
    PACKAGE = "numpy"
    GROWS = False
    MARKER_SLOTS = False  # a file per marker
    path: Path
    META = _NPY_META

    def __init__(self, path: Path, mode: str) -> None:
        super().__init__(path, mode)
        if mode == "w":
            path.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, tuple[int, int, int]] = {}  # name -> (fd, data offset, row bytes)
        self._maps: dict[str, np.memmap] = {}

    @classmethod
    def holds(cls, path: Location) -> bool:
        return (Path(path) / cls.META).is_file()

    @staticmethod
    def text_dtype(width: int) -> tuple[Any, Any]:
        return f"<U{width}", None  # fixed width: a memory map holds no objects

    def check(self) -> None:
        _check_no_links_out(self.path)

    def _is_ours(self, rel: str, is_dir: bool, arrays: set[str], groups: set[str]) -> bool:
        if is_dir:
            return rel in groups or rel == self.MARKERS
        parent, _, name = rel.rpartition("/")
        if rel.endswith(".npy"):
            return rel.removesuffix(".npy") in arrays
        if parent == self.MARKERS:  # a marker, or one a killed run was writing (see _replace)
            return re.fullmatch(r"\.?[0-9]+\.json(\.[0-9]+\.tmp)?", name) is not None
        return rel in (_LOCK, self.META) or _NPY_HALF_META.fullmatch(rel) is not None

    def _file(self, name: str) -> Path:
        return _check_inside(self.path, self.path / f"{name}.npy", name)

    def _replace(self, target: Path, text: str) -> None:
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        with open(tmp, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, target)  # atomic: a reader sees the old or the new file, never half

    def read_meta(self) -> dict | None:
        meta = self.path / self.META
        if not meta.is_file():
            return None
        try:
            return json.loads(_check_inside(self.path, meta, self.META).read_text())
        except (ValueError, UnicodeDecodeError, RecursionError) as e:  # RecursionError: nested too deep to read
            raise _bad(self.path, f"its {self.META} is not JSON that can be read ({_one_line(e)})") from e

    def write_meta(self, meta: dict) -> None:
        self._replace(self.path / self.META, json.dumps(meta, indent=1))

    def create(self, name: str, shape: tuple, dtype: Any, chunk: int, fill: Any) -> None:
        # a sparse file, not filled: unwritten rows read as 0 (failed rows are written filled)
        file = self._file(name)
        file.parent.mkdir(parents=True, exist_ok=True)
        np.lib.format.open_memmap(file, mode="w+", dtype=dtype, shape=shape)

    def array(self, name: str) -> Any:
        if name not in self._maps:
            file = self._file(name)
            if not file.is_file():
                raise KeyError(name)
            try:
                found = np.load(file, mmap_mode="r", allow_pickle=False)
            except (ValueError, OSError) as e:  # object arrays (pickles), bad headers, files too short
                raise _bad(self.path, f"{file.name} is not a plain NumPy array ({_one_line(e)})") from e
            if found.ndim > 1 and not found.flags.c_contiguous:  # rows are written in C order
                raise _bad(self.path, f"{file.name} is stored in Fortran order, not row by row")
            self._maps[name] = found
        return self._maps[name]

    def write(self, name: str, start: int, data: np.ndarray) -> None:
        if name not in self._files:
            fd = os.open(self._file(name), os.O_RDWR)
            with open(self._file(name), "rb") as f:
                major, _ = np.lib.format.read_magic(f)
                read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
                shape, _, dtype = read(f)
                offset = f.tell()
            self._files[name] = (fd, offset, int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize)
        fd, offset, row = self._files[name]
        view = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8).data)
        at = offset + start * row
        while view:  # pwrite may write less than asked (at most 2 GB a call on Linux)
            written = os.pwrite(fd, view, at)
            view, at = view[written:], at + written

    def resize(self, name: str, n: int) -> None:
        raise StoreError("npy arrays cannot grow: use format='zarr' or 'hdf5' for data of unknown length")

    def mark(self, chunk: int, text: str) -> None:
        folder = _check_inside(self.path, self.path / self.MARKERS, self.MARKERS)
        folder.mkdir(exist_ok=True)
        self._replace(folder / f"{chunk:09d}.json", text)

    def markers(self) -> dict[int, str]:
        folder = _check_inside(self.path, self.path / self.MARKERS, self.MARKERS)
        if not folder.is_dir():
            return {}
        files = [p for p in folder.glob("*.json") if p.stem.isdigit()]
        try:
            return {int(p.stem): _check_inside(self.path, p, f"{self.MARKERS}/{p.name}").read_text() for p in files}
        except (UnicodeDecodeError, OSError) as e:
            raise _bad(self.path, f"a chunk marker cannot be read ({_one_line(e)})") from e

    def create_markers(self, n: int, chunk_size: int) -> None:
        (self.path / self.MARKERS).mkdir(exist_ok=True)

    def sync(self) -> None:
        for fd, _, _ in self._files.values():
            os.fdatasync(fd) if hasattr(os, "fdatasync") else os.fsync(fd)

    def close(self) -> None:
        for fd, _, _ in self._files.values():
            os.close(fd)
        self._files.clear()
        self._maps.clear()


BACKENDS: dict[str, type[_Backend]] = {b.format: b for b in (_ZarrBackend, _HDF5Backend, _NpyBackend)}  # the first is the default
FORMATS = tuple(BACKENDS)


def format_package(format: str) -> str:
    """The package that stores of ``format`` need (whose version a store records)."""
    return BACKENDS[format].PACKAGE


def check_writers(format: str, world: int, out: Location) -> None:
    """Refuse ``world`` processes writing one store of ``format`` at ``out`` when the format takes fewer."""
    backend = BACKENDS[format]
    if backend.WRITERS is not None and world > backend.WRITERS:
        raise StoreError(backend.TOO_MANY_WRITERS.format(world=world, out=out))


def format_for(path: str | Path, format: str | None) -> str:
    """The format to write ``path`` in: ``format``, an existing store's, or by suffix (default Zarr)."""
    if format is not None:
        if format not in FORMATS:
            raise ValueError(f"unknown format={format!r}: use one of {FORMATS}")
    else:
        suffix = Path(str(path)).suffix.lower()
        format = detect_format(path) or next((f for f, b in BACKENDS.items() if suffix in b.SUFFIXES), FORMATS[0])
    if is_url(path) and not BACKENDS[format].URLS:
        raise StoreError(f"{path} is a URL: only Zarr stores can be written to an object store (fsspec); use a .zarr URL")
    return format


def detect_format(path: str | Path) -> str | None:
    """The format of the layertap store at ``path``, or ``None`` if there is none."""
    url = isinstance(path, str) and is_url(path)  # an object store holds Zarr only (the formats with URLS)
    found = (f for f, b in BACKENDS.items() if (b.URLS or not url) and b.holds(path if url else Path(path)))
    return next(found, None)
