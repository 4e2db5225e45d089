"""Feature stores on disk: Zarr (default), HDF5 or NumPy files, written chunk by chunk, read lazily.

Every format holds the same things:

- ``features/<layer>``: one array per tapped layer, ``[samples, *feature shape]``; a layer whose
  output holds several tensors (a tuple, a dict) gets one array per tensor,
  ``features/<layer>/0``, ``features/<layer>/1``, ... (key ``"<layer>/0"``), in the order of
  `layertap.nested.tensors`;
- ``ids``: each sample's id (its file path, else its index); ``labels`` when the data has them;
- one completion marker per chunk of samples, holding the chunk's failed samples, the rank of
  the process that wrote it and a digest of every sample's input (see `layertap.extract.digests`);
- metadata: model, layers, shapes, dtypes, reductions, versions and a hash of the settings.

A chunk (``chunk_size`` consecutive samples, the arrays' chunking along samples) is written
whole, handed to the disk (fsync), and only then marked: a store interrupted at any moment
knows which chunks are complete, and is marked complete only when every chunk is. Writing a
chunk touches no other chunk's files, so several processes can fill one Zarr or NumPy store.
Zarr writes every file atomically. HDF5 arrays of known length are allocated when the file is
made, so writing a chunk changes no HDF5 structure, only data; the file is flushed and synced
after every chunk.

This module owns a store's lifecycle and its trust boundary:

- `open_or_create` is the only way in for a writer: it takes the store's lock, checks what is
  at the path, resumes, refuses or overwrites (what layertap wrote only), and creates;
- one writer at a time: a lock (a record lock on local disks, keyed on the file an HDF5 path
  resolves to; a lease object in object stores) makes a second extraction of the same store
  stop with the holder's name, and a killed holder's lock is taken over at once;
- a store is data, never code: its metadata is checked field by field, every path in it must
  stay inside the store (no ``..``, absolute paths, or symlinks out), HDF5 external links and
  external storage are refused, Zarr arrays must use plain codecs (no pickle), and NumPy files
  are read without pickle.

>>> import os, tempfile, torch, torchvision, layertap
>>> model = torchvision.models.resnet18()
>>> images = torch.randn(8, 3, 64, 64)
>>> out = os.path.join(tempfile.mkdtemp(), "features.zarr")
>>> store = layertap.extract_dataset(model, images, "avgpool", out, progress=False)
>>> feats = layertap.open_features(out)
>>> feats["avgpool"].shape, feats.ids[:3].tolist()
((8, 512, 1, 1), [0, 1, 2])
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import re
import shutil
import socket
import stat
import threading
import time
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import StoreError, StoreLockedError, require
from ..printable import printable
from ..records import SkippedSample
from ..tables import Table
from ..units import human_bytes

FORMATS = ("zarr", "hdf5", "npy")
STORE_VERSION = 2  # 2: chunk markers hold input digests; arrays of known length allocated up front
_SUFFIX_FORMATS = {".zarr": "zarr", ".h5": "hdf5", ".hdf5": "hdf5", ".hdf": "hdf5"}
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_ARRAY_PATH = re.compile(r"features/[A-Za-z0-9_-][A-Za-z0-9._-]*(/[0-9]+)?")
_ZARR_META = re.compile(r"zarr(\.json|\.[0-9a-f]{32}\.partial)")  # a partial file: one Zarr was writing
_ZARR_PARTIAL = re.compile(r"[0-9]+\.[0-9a-f]{32}\.partial")
_ZARR_CODECS = {"bytes", "blosc", "vlen-utf8", "zstd", "gzip", "crc32c", "transpose"}  # plain data: no pickle
LOCK = ".layertap.lock"


Location = Path | str  # a local path, or an fsspec URL (str) such as "s3://bucket/feats.zarr"


def is_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an fsspec URL (``s3://``, ``gs://``, ``memory://``...), not a local path."""
    return isinstance(path, str) and "://" in path


def location(path: str | os.PathLike) -> Location:
    """``path`` as the stores take it: a URL stays a string (a `Path` would fold its ``//``), and
    only a URL is a string."""
    return str(path) if is_url(path) else Path(path)


def url_fs(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url``, and the path inside it."""
    import fsspec  # a dependency of torch

    fs, inner = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()  # fsspec caches instances and listings; Zarr writes through its own instance
    return fs, inner


def occupied(path: Location) -> bool:
    """Whether something (a file, or a folder holding more than a store lock) is at ``path``."""
    if isinstance(path, str):
        fs, inner = url_fs(path)
        return fs.exists(inner) and (fs.isfile(inner) or any(not str(p).endswith(LOCK) for p in fs.ls(inner, detail=False)))
    return path.is_symlink() or (path.exists() and not (path.is_dir() and all(p.name == LOCK for p in path.iterdir())))


@dataclass
class ArraySpec:
    """One stored array: its mapping key, path in the store and per-sample shape and dtype."""

    key: str  # "layer4", or "layer4/0" for one tensor of a layer with several
    path: str  # "features/layer4": sanitised, always inside the store
    layer: str
    leaf: int | None
    shape: tuple[int, ...]
    dtype: str

    @property
    def sample_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * np.dtype(self.dtype).itemsize


def safe_name(name: str) -> str:
    """A layer name as a file/array name: letters, digits, ``._-`` only; never hidden or empty."""
    if name == "":
        return "model"  # the model itself
    safe = _UNSAFE.sub("_", name).lstrip(".")
    return safe if safe and not safe.startswith("__") else f"layer{safe}"


def array_key(layer: str, leaf: int | None) -> str:
    """The mapping key of a layer's array: the layer name, or ``"<layer>/<i>"`` for one of its tensors."""
    return layer if leaf is None else f"{layer}/{leaf}"


def array_specs(entries: Sequence[tuple[str, int | None, tuple[int, ...], str]]) -> list[ArraySpec]:
    """Arrays for ``(layer, leaf index or None, per-sample shape, dtype)`` entries, in order.

    Layer names that sanitise (or case-fold, on macOS) to the same file get a ``-2``, ``-3`` suffix.
    """
    specs, bases, taken = [], {}, set()
    keys: dict[str, tuple[str, int | None]] = {}
    for layer, leaf, shape, dtype in entries:
        key = array_key(layer, leaf)
        if key in keys:  # a module named "a/0" beside tensor 0 of a module "a": refused before anything is written
            raise StoreError(
                f"{_array_what(*keys[key])} and {_array_what(layer, leaf)} would both be stored as {key!r} (a '/' joins a "
                "layer to its tensor's index): extract them into separate stores, or rename the module"
            )
        keys[key] = (layer, leaf)
        if layer not in bases:
            base, n = safe_name(layer), 1
            while (base if n == 1 else f"{base}-{n}").lower() in taken:
                n += 1
            bases[layer] = base if n == 1 else f"{base}-{n}"
            taken.add(bases[layer].lower())
        path = f"features/{bases[layer]}" + ("" if leaf is None else f"/{leaf}")
        specs.append(ArraySpec(key, path, layer, leaf, tuple(shape), dtype))
    return specs


def _array_what(layer: str, leaf: int | None) -> str:
    return f"layer {layer!r}" if leaf is None else f"tensor {leaf} of layer {layer!r}"


def format_for(path: str | Path, format: str | None) -> str:
    """The format to write ``path`` in: ``format``, an existing store's, or by suffix (default Zarr)."""
    if format is not None:
        if format not in FORMATS:
            raise ValueError(f"unknown format={format!r}: use one of {FORMATS}")
    else:
        format = detect_format(path) or _SUFFIX_FORMATS.get(Path(str(path)).suffix.lower(), "zarr")
    if is_url(path) and format != "zarr":
        raise StoreError(f"{path} is a URL: only Zarr stores can be written to an object store (fsspec); use a .zarr URL")
    return format


def detect_format(path: str | Path) -> str | None:
    """The format of the layertap store at ``path``, or ``None`` if there is none."""
    if isinstance(path, str) and is_url(path):  # an object store holds Zarr only
        fs, inner = url_fs(path)
        return "zarr" if fs.exists(f"{inner}/zarr.json") else None
    path = Path(path)
    if path.is_file():
        with open(path, "rb") as f:
            return "hdf5" if f.read(8) == _HDF5_SIGNATURE else None
    if (path / "zarr.json").is_file():
        return "zarr"
    if (path / _NpyBackend.META).is_file():
        return "npy"
    return None


# ------------------------------------------------------------------------ the trust boundary
def _bad(path: Location, what: str) -> StoreError:
    return StoreError(
        f"{path} is not a valid layertap feature store: {what}. It is damaged, or was not written by "
        "layertap; extract again into a new path (or pass --overwrite)"
    )


def _check_inside(root: Path, path: Path, entry: str) -> Path:
    """``path`` if it resolves (symlinks followed) inside ``root``; else refused, naming ``entry``."""
    try:
        real, top = path.resolve(), root.resolve()
    except (RuntimeError, OSError) as e:  # a symlink loop
        raise _bad(root, f"its entry {entry!r} cannot be resolved ({_one_line(e)})") from e
    if real != top and top not in real.parents:
        raise _bad(root, f"its entry {entry!r} leads outside the store (to {real})")
    return path


def _check_no_links_out(root: Path) -> None:
    """Refuse a store folder holding a symlink that leads outside it (Zarr would follow it), or
    anything but files and folders (reading a FIFO or a device would hang or never end)."""
    top = root.resolve()
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            entry = Path(folder, name)
            where = str(entry.relative_to(root))
            if entry.is_symlink():
                _check_inside(top, entry, where)
            if not (entry.is_file() or entry.is_dir()):
                raise _bad(root, f"its entry {where!r} is neither a file nor a folder")


def _is_numeric(dtype: Any) -> bool:
    try:
        return np.dtype(dtype).kind in "biufc"
    except TypeError:
        return False


def _check_meta(meta: Any, path: Location, format: str) -> dict:
    """The store's metadata if every field a reader or writer uses has the right form, else a
    one-line `StoreError` naming the first bad field. Nothing here is imported or called."""

    def need(ok: bool, field: str, expected: str) -> None:
        if not ok:
            raise _bad(path, f"its metadata field {field!r} is " + ("missing" if expected == "there" else f"not {expected}"))

    count = _is_count

    need(isinstance(meta, dict), "layertap", "a JSON object")
    for key in ("layertap_store", "format", "complete", "ready", "num_samples", "chunk_size", "ids", "labels", "arrays", "layers"):
        need(key in meta, key, "there")
    need(count(meta.get("layertap_store")) and meta["layertap_store"] <= STORE_VERSION, "layertap_store", f"a store version up to {STORE_VERSION}")
    need(meta.get("format") == format, "format", f"{format!r} (the store's real format)")
    for flag in ("complete", "ready"):
        need(isinstance(meta.get(flag), bool), flag, "true or false")
    need(meta.get("num_samples") is None or count(meta["num_samples"]), "num_samples", "a count or null")
    need(count(meta.get("chunk_size")) and meta["chunk_size"] >= 1, "chunk_size", "a positive count")
    need(meta.get("ids") in ("index", "path"), "ids", "'index' or 'path'")
    need(meta.get("labels") is None or (isinstance(meta["labels"], str) and _is_numeric(meta["labels"])), "labels", "null or a numeric dtype")
    for field in ("root", "model", "data"):
        need(meta.get(field) is None or isinstance(meta[field], str), field, "a string")
    classes = meta.get("classes")
    need(classes is None or (isinstance(classes, list) and all(isinstance(c, str) for c in classes)), "classes", "a list of strings")
    settings = meta.get("settings")
    need(settings is None or isinstance(settings, dict), "settings", "an object")
    if isinstance(settings, dict) and settings.get("num_samples") is not None:
        need(meta["num_samples"] == settings["num_samples"], "num_samples", "the number of samples its settings name")
    arrays = meta.get("arrays")
    need(isinstance(arrays, list) and len(arrays) > 0, "arrays", "a non-empty list")
    keys, paths = set(), set()
    for i, a in enumerate(arrays):
        field = f"arrays[{i}]"
        need(isinstance(a, dict) and set(a) == {"key", "path", "layer", "leaf", "shape", "dtype"}, field, "an array entry (key, path, layer, leaf, shape, dtype)")
        need(isinstance(a["key"], str) and a["key"] not in keys, f"{field}.key", "a unique string")
        need(isinstance(a["layer"], str), f"{field}.layer", "a string")
        need(a["leaf"] is None or count(a["leaf"]), f"{field}.leaf", "null or a count")
        need(a["key"] == array_key(a["layer"], a["leaf"]), f"{field}.key", "its layer (and leaf index)")
        need(isinstance(a["path"], str) and _ARRAY_PATH.fullmatch(a["path"]) is not None and a["path"].lower() not in paths, f"{field}.path", "a unique path features/NAME inside the store")
        need(isinstance(a["shape"], list) and all(count(n) for n in a["shape"]), f"{field}.shape", "a list of sizes")
        need(isinstance(a["dtype"], str) and _is_numeric(a["dtype"]), f"{field}.dtype", "a numeric dtype")
        keys.add(a["key"])
        paths.add(a["path"].lower())
    layers = list(dict.fromkeys(a["layer"] for a in arrays))
    need(meta.get("layers") == layers, "layers", f"the layers of its arrays, {layers}")
    return meta


def _specs(meta: dict) -> list[ArraySpec]:
    return [ArraySpec(**{**a, "shape": tuple(a["shape"])}) for a in meta["arrays"]]


@dataclass
class Marker:
    """What a chunk's completion marker records."""

    failed: list[SkippedSample]
    process: int
    digests: list[str] | None  # one per sample of the chunk; None in stores written before digests

    def to_json(self) -> str:
        return json.dumps({"failed": [list(f) for f in self.failed], "process": self.process, "digests": self.digests})


def _parse_marker(text: str, chunk: int, rows: tuple[int, int], path: Location) -> Marker:
    """A chunk's marker, checked: its failures lie in the chunk, its digests cover it."""
    start, end = rows
    try:
        value = json.loads(text)
        failed = [SkippedSample(i, d, e) for i, d, e in value["failed"]]
        process = value["process"]
        digests = value.get("digests")
    except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
        raise _bad(path, f"the marker of chunk {chunk} cannot be read ({type(e).__name__})") from e
    if not _is_count(process) or any(not (_is_count(f.index) and isinstance(f.id, (int, str)) and isinstance(f.error, str)) for f in failed):
        raise _bad(path, f"the marker of chunk {chunk} has entries of the wrong type")
    if any(not start <= f.index < end for f in failed):
        raise _bad(path, f"the marker of chunk {chunk} lists failed samples outside it")
    if digests is not None and not (isinstance(digests, list) and len(digests) == end - start and all(isinstance(d, str) for d in digests)):
        raise _bad(path, f"the marker of chunk {chunk} does not hold a digest (a string) for each of its {end - start} samples")
    return Marker(failed, process, digests)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# ------------------------------------------------------------------------------- backends
class _Backend:
    """The primitive reads and writes of one format; `StoreWriter` and `FeatureStore` use them.

    Every name passed in is a store-made name (``ids``, ``labels``, a checked ``features/...``
    path); backends still refuse one that would leave the store.
    """

    format: str

    MARKERS = "_chunks"

    def __init__(self, path: Location, mode: str) -> None:  # mode: "r", "r+" or "w"
        self.path, self.mode = path, mode

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

    def __init__(self, path: Location, mode: str) -> None:  # a URL opens through fsspec
        super().__init__(path, mode)
        self.zarr = require("zarr", "store")
        # fsspec's local filesystem (file://) makes no folders unless told to; object stores need none
        options: dict[str, Any] = {"storage_options": {"auto_mkdir": True}} if str(path).startswith("file://") else {}
        # "a", not "w": the folder holds the writer's lock, which "w" would delete
        self.root = self.zarr.open_group(str(path), mode="a" if mode == "w" else mode, zarr_format=3, **options)
        self._arrays: dict[str, Any] = {}
        self._written: set[str] = set()  # local chunk files written since the last sync

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
                pieces = rest[1:]  # c/0/0/...: a chunk file, or the folders it is in
                if not all(p.isascii() and p.isdigit() for p in pieces[:-1]):
                    return False
                return not pieces or (pieces[-1].isascii() and pieces[-1].isdigit()) or (not is_dir and _ZARR_PARTIAL.fullmatch(pieces[-1]) is not None)
        parent, _, name = rel.rpartition("/")
        if is_dir:
            return rel in groups
        return rel == LOCK or ((parent == "" or parent in groups) and _ZARR_META.fullmatch(name) is not None)

    def read_meta(self) -> dict | None:
        return self.root.attrs.asdict().get("layertap")

    def write_meta(self, meta: dict) -> None:
        self.root.attrs.update({"layertap": meta})

    def create(self, name: str, shape: tuple, dtype: Any, chunk: int, fill: Any) -> None:
        parent, _, leaf = name.rpartition("/")
        group = self.root.require_group(parent) if parent else self.root
        codecs = dict(compressors=self.zarr.codecs.BloscCodec(cname="lz4", clevel=5, shuffle="shuffle"))
        if dtype is str:
            codecs = {}  # variable-length strings have their own codec
        # every chunk is written, even one of fill values only: a missing file then means a damaged store
        self._arrays[name] = group.create_array(
            leaf, shape=shape, chunks=(chunk, *shape[1:]), dtype=dtype, fill_value=fill, config={"write_empty_chunks": True}, **codecs
        )

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
            self._arrays[name] = array
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
        values = self.array(self.MARKERS)[:]
        return {int(i): str(values[i]) for i in np.flatnonzero(values != "")}

    def create_markers(self, n: int, chunk_size: int) -> None:
        # one object per marker: writers of different chunks never touch the same object
        self._arrays[self.MARKERS] = self.root.create_array(self.MARKERS, shape=(n,), chunks=(1,), dtype=str, fill_value="")

    def pieces(self, name: str) -> tuple[int, set[int]] | None:
        """Samples per stored piece of ``name`` and the pieces that exist (local stores only)."""
        if is_url(self.path):
            return None
        folder = Path(self.path) / name / "c"
        present = {int(p) for p in os.listdir(folder) if p.isdigit()} if folder.is_dir() else set()
        return self.array(name).chunks[0], present

    def sync(self) -> None:
        # Zarr writes each chunk as a file of its own (atomically, by rename): sync those files
        root = Path(self.path)
        for name in self._written:
            top = root / name
            if top.is_file():  # the chunk of a 1-D array is a file, not a folder
                _fsync(top)
            for folder, _, files in os.walk(top):
                for file in files:
                    _fsync(Path(folder, file))
                _fsync(Path(folder))
        self._written.clear()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


class _HDF5Backend(_Backend):
    format = "hdf5"
    path: Path

    def __init__(self, path: Path, mode: str) -> None:
        super().__init__(path, mode)
        self.h5py = require("h5py", "store")
        try:
            # no chunk cache: a write reaches the file (and fails there, on a full disk) when made,
            # not when HDF5 evicts it later, where h5py can only print the error
            self.file = self.h5py.File(path, mode, rdcc_nbytes=0)
        except OSError as e:
            raise StoreError(
                f"cannot open the HDF5 file {path} ({e}); an HDF5 file is not safe from a crash while it is "
                "written: if a run was killed, delete the file and run again, or use Zarr, which is"
            ) from e

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
        except (ValueError, TypeError) as e:
            raise _bad(self.path, "its metadata is not JSON") from e

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
        if found.chunks is not None and found.id.get_storage_size() < found.size * found.dtype.itemsize and found.dtype.kind != "O":
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

    DONE = "_done"

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
        markers = self.file[self.MARKERS]
        if self.DONE not in self.file and markers.ndim == 1:  # a version-1 store: text markers
            values = markers.asstr()[:]
            return {int(i): str(values[i]) for i in np.flatnonzero(values != "")}
        done = self.file[self.DONE]
        if markers.ndim != 2 or done.shape != markers.shape[:1]:
            raise _bad(self.path, "its chunk markers and their flags do not agree")
        try:
            return {int(c): markers[c].tobytes().rstrip(b"\0").decode() for c in np.flatnonzero(done[:])}
        except UnicodeDecodeError as e:
            raise _bad(self.path, f"a chunk marker is not text ({_one_line(e)})") from e

    def create_markers(self, n: int, chunk_size: int) -> None:
        width = MARKER_BYTES_PER_SAMPLE * chunk_size + 4096
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
    path: Path
    META = "layertap.json"

    def __init__(self, path: Path, mode: str) -> None:
        super().__init__(path, mode)
        if mode == "w":
            path.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, tuple[int, int, int]] = {}  # name -> (fd, data offset, row bytes)
        self._maps: dict[str, np.memmap] = {}

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
        return rel in (LOCK, self.META) or re.fullmatch(rf"\.{re.escape(self.META)}\.[0-9]+\.tmp", rel) is not None

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
        except (ValueError, UnicodeDecodeError) as e:
            raise _bad(self.path, f"its {self.META} is not JSON") from e

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
                shape, _, dtype = _header(f)
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


MARKER_BYTES_PER_SAMPLE = 24  # room in an HDF5 marker: a digest per sample, and failures


def _fit(text: str, width: int) -> bytes:
    """A marker's JSON in at most ``width`` bytes: a chunk of many failures with long messages
    keeps their error types only, then only their indices (the ids are in the ``ids`` array)."""
    data = text.encode()
    if len(data) <= width:
        return data
    value = json.loads(text)
    for shorten in (lambda f: [f[0], f[1], f[2].split(":")[0]], lambda f: [f[0], f[0], ""]):
        value["failed"] = [shorten(f) for f in value["failed"]]
        data = json.dumps(value).encode()
        if len(data) <= width:
            return data
    raise StoreError(f"a chunk marker needs {len(data)} bytes, more than the {width} an HDF5 store has room for: use Zarr")


def _header(f: Any) -> tuple[tuple, bool, np.dtype]:
    f.seek(0)
    major, _ = np.lib.format.read_magic(f)
    read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    return read(f)


_BACKENDS: dict[str, type[_Backend]] = {"zarr": _ZarrBackend, "hdf5": _HDF5Backend, "npy": _NpyBackend}


def _open_backend(path: Location, mode: str, format: str | None = None, *, half_made: bool = False) -> tuple[_Backend, dict]:
    """The store at ``path`` opened for reading (``"r"``) or adding chunks (``"r+"``), checked:
    nothing in it leads outside it, its metadata has the right form, its arrays agree with it.
    A store whose writer was killed while making it is refused, unless ``half_made`` (to remove it)."""
    format = format or detect_format(path)
    if format is None:
        raise StoreError(f"no layertap feature store at {path} (a Zarr folder, an HDF5 file or a folder of .npy files)")
    try:
        backend = _BACKENDS[format](path, mode)
    except StoreError:
        raise
    except Exception as e:  # the format's library could not read it at all
        raise _bad(path, f"{format} cannot open it ({type(e).__name__}: {_one_line(e)})") from e
    try:
        backend.check()
        meta = backend.read_meta()
        if not meta or "layertap_store" not in meta:
            raise StoreError(f"{path} is not a layertap feature store")
        _check_meta(meta, path, format)
        if meta["ready"]:
            _check_arrays(backend, meta)
        elif not half_made:  # a writer killed while making it: its arrays may be half made
            raise StoreError(
                f"{path} holds no features: it was being created when its writer stopped. Run the same "
                "extraction again (it is made anew)"
            )
    except BaseException:
        backend.close()
        raise
    return backend, meta


def _names(meta: Mapping) -> tuple[set[str], set[str]]:
    """The paths of the arrays (features, ids, labels) and groups that a store of ``meta`` holds;
    of a damaged store's metadata, only paths of the form layertap writes."""
    arrays = {a["path"] for a in meta.get("arrays") or [] if isinstance(a, dict) and isinstance(a.get("path"), str) and _ARRAY_PATH.fullmatch(a["path"])}
    return arrays | {"ids", "labels"}, {"features"} | {a.rpartition("/")[0] for a in arrays}


def _foreign_entries(path: Location, ours: Callable[[str, bool], bool]) -> list[str]:
    """The top-most entries under the folder (or object-store prefix) ``path`` that are not
    ``ours(relative path, is a folder)``, folders ending in ``/``. Symlinks are never followed."""
    if isinstance(path, str):
        fs, inner = url_fs(path)
        inner = inner.rstrip("/")
        listed = fs.find(inner, withdirs=True, detail=True)
        entries = [(name[len(inner) + 1 :], info["type"] == "directory") for name, info in listed.items() if name.rstrip("/") != inner]
        found = {rel: is_dir for rel, is_dir in entries if not ours(rel, is_dir)}
        return [rel + "/" * d for rel, d in sorted(found.items()) if not any(found.get("/".join(rel.split("/")[:k])) for k in range(1, rel.count("/") + 1))]
    foreign = []
    for folder, dirs, files in os.walk(path):
        for name in sorted(dirs + files):
            entry = Path(folder, name)
            rel, is_dir = entry.relative_to(path).as_posix(), name in dirs and not entry.is_symlink()
            if not ours(rel, is_dir):
                foreign.append(rel + "/" * is_dir)
                if name in dirs:
                    dirs.remove(name)  # not looked into: everything in it is the user's
    return sorted(foreign)


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split())[:300]


def _check_arrays(backend: _Backend, meta: dict) -> None:
    """Every array the metadata names exists with the rows, shape and dtype it says."""
    path = backend.path

    def get(name: str) -> Any:
        try:
            return backend.array(name)
        except KeyError:
            raise _bad(path, f"its array {name!r} is missing") from None

    ids = get("ids")
    rows = ids.shape[0] if len(ids.shape) == 1 else -1
    n = meta["num_samples"]
    if rows < 0 or (n is not None and rows != n):
        raise _bad(path, f"its ids hold {list(ids.shape)} entries, not {n} samples")
    if meta["ids"] == "index" and not _is_numeric(ids.dtype):
        raise _bad(path, "its ids are not indices, as its metadata says")
    if meta["ids"] == "path" and not backend.is_text(ids):
        raise _bad(path, f"its ids are not paths (text) as its metadata says, but {backend.kind(ids)}")
    expected = [(s.path, (rows, *s.shape), np.dtype(s.dtype)) for s in _specs(meta)]
    if meta["labels"] is not None:
        expected.append(("labels", (rows,), np.dtype(meta["labels"])))
    else:
        with contextlib.suppress(KeyError):
            backend.array("labels")
            raise _bad(path, "it holds labels that its metadata does not name")
    for name, shape, dtype in expected:
        array = get(name)
        if tuple(array.shape) != shape or np.dtype(array.dtype) != dtype:
            raise _bad(path, f"its array {name!r} is {list(array.shape)} {array.dtype}, its metadata says {list(shape)} {dtype}")
    chunk = meta["chunk_size"]
    chunks = -(-rows // chunk)
    if not isinstance(backend, _NpyBackend):  # one marker slot per chunk, read whole below
        slots = get(backend.MARKERS).shape[0]
        if slots > chunks or (meta["num_samples"] is not None and slots != chunks):
            raise _bad(path, f"it has {slots} chunk markers for {chunks} chunks")
    try:
        done = sorted(backend.markers())
    except KeyError:
        raise _bad(path, "its chunk markers are missing") from None
    if meta["num_samples"] is not None and (done[-1:] and done[-1] >= chunks):
        raise _bad(path, f"it marks chunk {done[-1]} written, of {chunks}")
    if meta["complete"] and len(done) != chunks:
        raise _bad(path, f"it says it is complete, but {chunks - len(done)} of its {chunks} chunks are not marked written")
    # every written row has its storage: a chunk file lost in a copy is not read as fill values
    # (stores of version 1 did not write chunks of fill values only)
    for name, _, _ in expected + [("ids", None, None)] if meta["layertap_store"] >= 2 else []:
        found = backend.pieces(name)
        if found is None:
            continue
        size, present = found
        needed = range(-(-rows // size)) if name == "ids" else (
            p for c in done for p in range(c * chunk // size, -(-min(rows, (c + 1) * chunk) // size))
        )
        if missing := sorted(set(needed) - present)[:3]:
            raise _bad(path, f"the stored pieces {missing} of its array {name!r} are missing (a partial copy?)")


# ------------------------------------------------------------------------------------ locking
class StoreLock:
    """One writer per store: an exclusive lock that names its holder (host, pid, start time).

    On a local disk it is a POSIX record lock (``fcntl.lockf``) on a file inside the store, or
    for an HDF5 file beside the file its path resolves to (symlinks followed), so every path
    to one file meets one lock, whatever HDF5's own locking is set to. A record lock belongs to
    its process: the system drops it when the process ends, however it ends, and a child
    (a data-loader worker forked while it is held) never holds it. A run that finds the lock
    of a holder that ended without releasing it (killed) takes it over, with a warning naming
    that process. In an object store, where nothing locks, it is a lease object that the
    holder renews while it writes: a lease whose holder is gone from this host, or which has
    expired, is taken over.
    """

    LEASE = 600.0  # seconds an object-store lease lasts without renewal
    RENEW = 60.0

    def __init__(self, path: Location, format: str) -> None:
        self.path = path
        self.owner = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        self._fd: int | None = None
        self._key = (-1, -1)  # the lock file's (device, inode), once held
        self._renewed = 0.0
        if str(path).startswith("file://"):  # a local disk behind a URL: lock it as one
            path = Path(str(path).removeprefix("file://"))
        if is_url(path):
            self.file: Location = f"{str(path).rstrip('/')}/{LOCK}"
        elif format == "hdf5":  # beside the file itself: a symlink to it meets the same lock
            real = Path(os.path.realpath(path))
            self.file = real.with_name(f".{real.name}{LOCK}")
        else:
            self.file = Path(path) / LOCK

    def acquire(self) -> StoreLock:
        if is_url(self.file):
            self._take_lease()
        else:
            with _HELD_GUARD:
                self._lock_file(Path(self.file))
        return self

    def _held_by(self, text: str) -> StoreLockedError:
        return StoreLockedError(
            f"{self.path} is being written by another extraction ({_holder(text)}): wait for it to end or stop it; "
            "a store takes one writer at a time"
        )

    def _lock_file(self, file: Path) -> None:
        import fcntl

        file.parent.mkdir(parents=True, exist_ok=True)
        while True:
            # a lock this process holds: a record lock would grant it again, and closing a second
            # descriptor of the file would drop it, so it is refused before the file is opened
            with contextlib.suppress(OSError):
                st = os.stat(file, follow_symlinks=False)
                if (held := _HELD.get((st.st_dev, st.st_ino))) is not None and held.owner["pid"] == os.getpid():
                    raise self._held_by(json.dumps(held.owner))
            try:  # never through a symlink: it could point at any file, which the owner line would overwrite
                fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0), 0o644)
            except OSError as e:
                raise StoreError(f"cannot use {file} as the lock of {self.path} ({_one_line(e)}): remove it (a lock is a plain file)") from e
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise StoreError(f"{file}, the lock of {self.path}, is not a plain file: remove it")
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EACCES, errno.EAGAIN):
                    os.close(fd)
                    raise StoreError(f"cannot lock {file}, the lock of {self.path} ({_one_line(e)}): write the store on a disk that supports locks") from e
                text = os.pread(fd, 4096, 0).decode(errors="replace")
                os.close(fd)
                raise self._held_by(text) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(file).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # its last holder removed the file as we opened it: lock the new one
        left = os.pread(fd, 4096, 0)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(self.owner).encode(), 0)
        self._fd = fd
        info = os.fstat(fd)
        self._key = (info.st_dev, info.st_ino)
        _HELD[self._key] = self
        if left:  # a holder releases by removing the file: this one's ended without (killed)
            warnings.warn(
                # the holder's text is read from the lock file: escaped before it reaches a terminal
                printable(f"{self.path}: its last writer ({_holder(left.decode(errors='replace'))}) ended without releasing "
                "the store's lock (killed?); this run takes the lock over"),
                stacklevel=2,
            )

    def _take_lease(self) -> None:
        fs, inner = url_fs(str(self.file))
        if fs.exists(inner):
            text = fs.cat_file(inner).decode(errors="replace")
            if not self._stale(text):
                raise self._held_by(text)
        self.renew(force=True)
        time.sleep(0.05)  # object stores have no exclusive create: the last writer wins; check it is us
        text = fs.cat_file(inner).decode(errors="replace")
        if {k: json.loads(text).get(k) for k in self.owner} != self.owner:
            self._renewed = 0.0  # not ours to remove
            raise self._held_by(text)

    def _stale(self, text: str) -> bool:
        try:
            lease = json.loads(text)
            expires, now = float(lease["expires"]), time.time()
            # expired, or not a time a holder renewing every minute could have written (NaN, far ahead)
            if not now <= expires <= now + 2 * self.LEASE:
                return True
            return lease["host"] == self.owner["host"] and not _alive(int(lease["pid"]))
        except (ValueError, KeyError, TypeError, OverflowError):
            return True  # not a lease this code wrote

    def renew(self, force: bool = False) -> None:
        """Extend an object-store lease (a no-op on local disks, and when renewed recently)."""
        if not is_url(self.file) or (not force and time.monotonic() - self._renewed < self.RENEW):
            return
        fs, inner = url_fs(str(self.file))
        fs.pipe_file(inner, json.dumps({**self.owner, "expires": time.time() + self.LEASE}).encode())
        self._renewed = time.monotonic()

    def release(self) -> None:
        if self._fd is not None:
            with _HELD_GUARD:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, 0)  # no owner line left: the next writer sees a clean release
                with contextlib.suppress(OSError):
                    os.unlink(self.file)  # while still held: the next writer locks a new file
                os.close(self._fd)
                _HELD.pop(self._key, None)
                self._fd = None
        elif is_url(self.file) and self._renewed:
            fs, inner = url_fs(str(self.file))
            with contextlib.suppress(OSError, FileNotFoundError):
                fs.rm(inner)
            self._renewed = 0.0


_HELD: dict[tuple[int, int], StoreLock] = {}  # (device, inode) of the lock files this process holds
_HELD_GUARD = threading.Lock()


def _holder(text: str) -> str:
    """Who a lock file's owner line names, for people."""
    try:
        owner = json.loads(text)
        return f"process {int(owner['pid'])} on {owner['host']}, since {owner['started']}"
    except (ValueError, KeyError, TypeError):
        return "another process"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):
        return False
    except PermissionError:
        return True
    return True


# -------------------------------------------------------------------------------- writing
STORAGE_CHUNK_BYTES = 4 << 20


def storage_rows(chunk_size: int, sample_bytes: int) -> int:
    """Samples per stored (compressed) chunk of an array: a divisor of ``chunk_size`` of at most
    about 4 MB, so that a chunk of writing never shares a stored chunk with another, and big
    feature maps are compressed in pieces of a size that codecs and readers handle well."""
    rows = max(1, min(chunk_size, STORAGE_CHUNK_BYTES // max(1, sample_bytes)))
    while chunk_size % rows:
        rows -= 1
    return rows


def fill_value(dtype: Any) -> Any:
    """What rows of samples that failed to load hold: NaN (floats), -1 (signed ints) or 0."""
    kind = np.dtype(dtype).kind
    if kind in "fc":
        return float("nan")
    return -1 if kind == "i" else 0


@dataclass
class Layout:
    """What a new store holds, known once the first features are: made by the extraction."""

    specs: list[ArraySpec]
    num_samples: int | None  # None: unknown, the store grows
    chunk_size: int
    ids: Sequence | None  # sample ids (paths), or None when they are the indices
    labels_dtype: str | None
    sample: Mapping[str, np.ndarray]  # one batch of features, to estimate the compressed size


def _storable_id(sample_id: str) -> str:
    """A file name's id as UTF-8 text: the bytes of a name that is not UTF-8 (which Python holds as
    lone surrogates) are written as ``\\xNN``, so such a file is stored, not a crash of the whole run."""
    try:
        sample_id.encode("utf-8")
        return sample_id
    except UnicodeEncodeError:
        try:
            raw = sample_id.encode("utf-8", "surrogateescape")
        except UnicodeEncodeError:  # a surrogate that no file name's byte makes
            raw = sample_id.encode("utf-8", "backslashreplace")
        return raw.decode("utf-8", "backslashreplace")


def settings_differences(old: Mapping, new: Mapping, sep: str) -> str:
    """The settings in which ``new`` differs from ``old``, for people; ``""`` when none does."""
    what = {"model": "model (fingerprint of its state, tree and code)", "ids": "sample ids (digest)"}
    return "; ".join(f"{what.get(k, k)} {old.get(k)!r}{sep}{new[k]!r}" for k in new if old.get(k) != new[k])


def open_or_create(
    out: str | os.PathLike,
    format: str | None,
    meta: dict,
    *,
    resume: bool,
    overwrite: bool,
    layout: Callable[[], Layout],
    say: Callable[[str], None] = lambda message: None,
) -> StoreWriter:
    """The only way for a writer into a store: lock it, then resume, refuse, replace or create.

    Args:
        out: the store's path or URL.
        format: the format asked for (``None``: the existing store's, or by suffix).
        meta: the new store's metadata; its ``"settings"`` must equal a store's to resume it.
        resume: continue a store with the same settings (its missing chunks only).
        overwrite: replace the layertap store at ``out``; one that holds anything layertap did
            not write (a user's files beside its arrays) is refused, naming it (`remove_store`).
        layout: called only when a new store is made, for its arrays and size.
        say: where the size estimate is told.

    Returns:
        a `StoreWriter` holding the store's lock; ``writer.state`` says ``"complete"``,
        ``"resume"`` or ``"new"``.
    """
    out = location(out)
    fmt = format_for(out, format)
    if isinstance(out, Path) and occupied(out) and detect_format(out) is None:
        raise StoreError(f"{out} exists and is not a layertap feature store: choose another output path")
    made = isinstance(out, Path) and not out.exists()  # a folder made for the lock goes again on failure
    lock = StoreLock(out, fmt).acquire()
    try:
        writer = _resume_or_refuse(out, format, meta["settings"], resume, overwrite)
        if writer is None:
            writer = StoreWriter.create(out, fmt, meta, layout(), say=say)
        writer.lock = lock
        return writer
    except BaseException:
        lock.release()
        if made and isinstance(out, Path) and out.is_dir():
            with contextlib.suppress(OSError):
                out.rmdir()  # only if nothing was written
        raise


def _resume_or_refuse(out: Location, format: str | None, settings: dict, resume: bool, overwrite: bool) -> StoreWriter | None:
    """The store to continue at ``out``, or ``None`` to write a new one (after removing an old one)."""
    found = detect_format(out)
    if found is None:
        if occupied(out):
            raise StoreError(f"{out} exists and is not a layertap feature store: choose another output path")
        return None
    if overwrite:
        remove_store(out)
        return None
    backend, meta = _open_backend(out, "r", half_made=True)
    if not meta["ready"]:  # killed while creating it: nothing to keep
        backend.close()
        remove_store(out)
        return None
    backend.close()
    writer = StoreWriter.open(out)
    problem = None
    if not resume:
        problem = "already holds features"
    elif format is not None and format != meta["format"]:
        problem = f"is a {meta['format']} store, not {format}"
    elif meta["layertap_store"] < STORE_VERSION:
        problem = "was written by an older layertap, whose stores cannot prove on resume that the data is the same"
    elif changed := settings_differences(meta.get("settings") or {}, settings, ", now "):
        problem = f"was written with other settings: {changed}"
    if problem:
        writer.close()
        raise StoreError(f"{out} {problem}: pass overwrite=True (--overwrite) to replace it, or write to another path")
    writer.state = "complete" if meta["complete"] else "resume"
    return writer


def compression_ratio(arrays: Mapping[str, np.ndarray], format: str) -> float:
    """The fraction of its size that a batch of features keeps once stored in ``format``."""
    if format != "zarr":
        return 1.0
    Blosc = require("numcodecs", "store").Blosc  # the codec Zarr stores with

    codec = Blosc(cname="lz4", clevel=5, shuffle=Blosc.SHUFFLE)
    raw = packed = 0
    for a in arrays.values():
        a = np.ascontiguousarray(a)
        raw += a.nbytes
        packed += len(codec.encode(a))
    return packed / raw if raw else 1.0


def free_space(path: Location) -> int | None:
    """Free bytes where ``path`` goes; ``None`` for an object store (it does not say)."""
    if is_url(path):
        return None
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


class StoreWriter:
    """Writes whole chunks of samples into a store and marks each complete after its data.

    Made by `open_or_create` (holding the store's lock), or by `StoreWriter.open` for another
    process of a ``torchrun`` job that shares the store; used by `layertap.extract_dataset`.
    """

    def __init__(self, backend: _Backend, meta: dict) -> None:
        self.backend, self.meta = backend, meta
        self.specs = _specs(meta)
        self.chunk_size: int = meta["chunk_size"]
        self.num_samples: int | None = meta["num_samples"]
        self.rows: int = backend.array("ids").shape[0]  # grows while the length is unknown
        self.process = 0  # the rank of the process writing: each chunk's marker records it
        self.lock: StoreLock | None = None
        self.state = "new"
        self.broken = False  # a write failed: the store stays incomplete

    @classmethod
    def create(cls, path: str | Path, format: str, meta: dict, layout: Layout, *, say: Callable[[str], None] = lambda m: None) -> StoreWriter:
        """A new store at ``path`` laid out as ``layout``, once the disk is known to hold it."""
        path = location(path)
        specs, n, chunk_size = layout.specs, layout.num_samples, layout.chunk_size
        if n is None and format == "npy":
            raise StoreError(
                "the npy format needs the number of samples before writing, and this data does not say it: "
                "use format='zarr' or 'hdf5', or give data with a length (a Dataset, a list)"
            )
        sample_bytes = sum(s.sample_bytes for s in specs)
        ratio = compression_ratio(layout.sample, format)
        if n is None:
            say(f"writing ~{human_bytes(sample_bytes * ratio)} per sample to {path} ({format}); the number of samples is not known yet")
        else:
            need = int(sample_bytes * ratio * n) + n * 8
            free = free_space(path)
            room = "free space unknown" if free is None else f"{human_bytes(free)} free"
            say(f"~{human_bytes(need)} for {n:,} samples × {len(specs)} arrays ({human_bytes(sample_bytes)} per sample) to {path} ({format}); {room}")
            if free is not None and need > free:
                raise StoreError(
                    f"the features need ~{human_bytes(need)} but only {human_bytes(free)} is free where {path} goes: free "
                    "some space, write elsewhere, or store less (reduce='mean', dtype='float16', fewer layers)"
                )
        rows = n or 0
        ids = None if layout.ids is None else [_storable_id(i) for i in (layout.ids[:rows] if n is not None else layout.ids)]
        meta = {
            **meta,
            "layertap_store": STORE_VERSION,
            "format": format,
            "complete": False,
            "num_samples": n,
            "chunk_size": chunk_size,
            "arrays": [{**asdict(s), "shape": list(s.shape)} for s in specs],
            "ids": "index" if ids is None else "path",
            "labels": layout.labels_dtype,
        }
        backend = _BACKENDS[format](path, "w")
        try:
            backend.write_meta({**meta, "ready": False})  # first: a half-made store is known as ours
            for spec in specs:
                dtype = np.dtype(spec.dtype)
                backend.create(spec.path, (rows, *spec.shape), dtype, storage_rows(chunk_size, spec.sample_bytes), fill_value(dtype))
            if layout.labels_dtype is not None:
                dtype = np.dtype(layout.labels_dtype)
                backend.create("labels", (rows,), dtype, chunk_size, fill_value(dtype))
            backend.create_markers(-(-rows // chunk_size), chunk_size)
            if ids is None:
                backend.create("ids", (rows,), np.int64, chunk_size, None)
                for start in range(0, rows, 1 << 16):
                    backend.write("ids", start, np.arange(start, min(rows, start + (1 << 16)), dtype=np.int64))
            else:
                width = max(map(len, ids), default=1)
                text: Any = str if format != "npy" else f"<U{width}"
                backend.create("ids", (rows,), text, chunk_size, "" if format != "npy" else None)
                for start in range(0, rows, 1 << 16):  # in pieces: a million paths are no small array
                    backend.write("ids", start, np.array(ids[start : start + (1 << 16)], dtype=text))
            meta["ready"] = True
            backend.sync()
            backend.write_meta(meta)
        except BaseException:
            backend.close()
            raise
        return cls(backend, meta)

    @classmethod
    def open(cls, path: str | Path) -> StoreWriter:
        """An existing store, checked, to add its missing chunks (the caller coordinates writers)."""
        return cls(*_open_backend(location(path), "r+"))

    def chunk_range(self, chunk: int) -> tuple[int, int]:
        start = chunk * self.chunk_size
        end = start + self.chunk_size
        return start, end if self.num_samples is None else min(end, self.num_samples)

    @property
    def num_chunks(self) -> int | None:
        return None if self.num_samples is None else -(-self.num_samples // self.chunk_size)

    def done(self) -> set[int]:
        """The complete chunks (their failed samples are read by `FeatureStore.failed`)."""
        return set(self.backend.markers())

    def markers(self) -> dict[int, Marker]:
        """The complete chunks' markers, checked: since version 2 each holds its samples' digests."""
        markers = {c: _parse_marker(text, c, self.chunk_range(c), self.backend.path) for c, text in self.backend.markers().items()}
        if self.meta["layertap_store"] >= 2 and (lacking := [c for c, m in markers.items() if m.digests is None]):
            raise _bad(self.backend.path, f"the marker of chunk {lacking[0]} has no digests of its samples")
        return markers

    def write_chunk(
        self,
        chunk: int,
        arrays: Mapping[str, np.ndarray],
        labels: np.ndarray | None,
        failed: Sequence[SkippedSample],
        digests: Sequence[str] | None = None,
    ) -> None:
        """Write the rows of ``chunk`` (all of them, failed ones filled) and hand them to the disk,
        then its marker. A write the disk refuses (full, read-only, I/O error) raises `StoreError`
        and leaves the chunk unmarked, to be written again by a resumed run."""
        start, _ = self.chunk_range(chunk)
        n = len(arrays[self.specs[0].key])
        try:
            if self.num_samples is None and start + n > self.rows:
                self._grow(start + n)
            for spec in self.specs:
                self.backend.write(spec.path, start, arrays[spec.key])
            if labels is not None and self.meta["labels"] is not None:
                self.backend.write("labels", start, labels)
            self.backend.sync()
            self.backend.mark(chunk, Marker(list(failed), self.process, None if digests is None else list(digests)).to_json())
            self.backend.sync()
        except (OSError, RuntimeError) as e:  # h5py reports a failed HDF5 flush as a RuntimeError
            self.broken = True
            raise self._write_error(e) from e
        if self.lock is not None:
            self.lock.renew()

    def _write_error(self, e: OSError | RuntimeError) -> StoreError:
        code = getattr(e, "errno", None)
        if code is None and (found := re.search(r"errno = (\d+)", str(e))):  # HDF5's text
            code = int(found.group(1))
        reason = {errno.ENOSPC: "the disk is full", errno.EROFS: "the disk is read-only", errno.EDQUOT: "the disk quota is used up"}.get(
            code or 0, _one_line(e)
        )
        return StoreError(f"cannot write to {self.backend.path}: {reason}; the store stays incomplete: fix that and run the same extraction again to resume")

    def _grow(self, rows: int) -> None:
        for name in [s.path for s in self.specs] + ["ids"] + (["labels"] if self.meta["labels"] else []):
            self.backend.resize(name, rows)
        self.backend.write("ids", self.rows, np.arange(self.rows, rows, dtype=np.int64))
        self.rows = rows

    def finish(self, num_samples: int) -> None:
        """Mark the store complete, after checking that every one of its chunks is written."""
        if self.num_samples is None:
            self.meta["num_samples"] = self.num_samples = num_samples
        missing = sorted(set(range(self.num_chunks or 0)) - self.done())
        if missing:
            raise StoreError(f"chunks {missing[:10]} of {self.backend.path} are not written; the store stays incomplete")
        self.meta["complete"] = True
        try:
            self.backend.sync()
            self.backend.write_meta(self.meta)
            self.backend.sync()
        except (OSError, RuntimeError) as e:
            self.meta["complete"] = False
            self.broken = True
            raise self._write_error(e) from e

    def close(self) -> None:
        try:
            self.backend.close()
        except (OSError, RuntimeError):
            if not self.broken:  # after a refused write, the error that says why was raised already
                raise
        finally:
            if self.lock is not None:
                self.lock.release()
                self.lock = None


def remove_store(path: str | Path) -> None:
    """Delete the layertap store at ``path``: what layertap wrote in it, when that is all it
    holds. Anything else (not a store; a user's notes or plots in the folder; arrays or
    attributes added to the HDF5 file) is refused, naming it, and nothing is deleted.

    The store's lock file stays: the writer that holds it is the one removing the store.
    """
    path = location(path)
    if not occupied(path):
        return
    format = detect_format(path)
    meta, foreign = None, []
    if format:
        backend = _BACKENDS[format](path, "r")
        try:
            meta = backend.read_meta()
            if isinstance(meta, dict) and "layertap_store" in meta:
                foreign = backend.foreign(meta)
        except StoreError:
            meta = None
        finally:
            backend.close()
    if not isinstance(meta, dict) or "layertap_store" not in meta:
        raise StoreError(f"{path} exists and is not a layertap feature store: choose another output path")
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        raise StoreError(
            f"{path} holds what layertap did not write ({', '.join(map(repr, foreign[:5]))}{more}), which replacing the "
            "store would delete: move that out of it, or write to another path"
        )
    if isinstance(path, str):
        fs, inner = url_fs(path)
        for entry in fs.ls(inner, detail=False):
            if not str(entry).endswith(LOCK):
                fs.rm(entry, recursive=True)
    elif path.is_dir():
        for entry in path.iterdir():
            if entry.name == LOCK:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()  # a symlink is removed, never what it points to
    else:
        # the file itself, where a symlink leads: the new store is made there (through the
        # link), beside the lock that every path to the file meets
        Path(os.path.realpath(path)).unlink()


# -------------------------------------------------------------------------------- reading
class FeatureStore(Mapping[str, Any]):
    """A read-only feature store: layer name -> lazily loaded array, with ids, labels and metadata.

    Values are the format's own lazy arrays (``zarr.Array``, ``h5py.Dataset``, ``np.memmap``):
    slicing reads only what is asked. Samples that failed to load (``on_error='skip'``) are
    listed in `failed` and their rows hold NaN (floats) or -1/0 (integers). Opening checks the
    store (see the module docs): a damaged or crafted one is refused with a `StoreError`. A
    notebook shows its arrays, how complete it is and how many samples failed.

    >>> import layertap
    >>> feats = layertap.open_features("features.zarr")       # doctest: +SKIP
    >>> x = feats.to_numpy("avgpool"); y = feats.labels        # doctest: +SKIP
    """

    def __init__(self, path: str | Path) -> None:
        self.path = location(path)
        self._backend, self.meta = _open_backend(self.path, "r")
        self._specs = {a["key"]: a for a in self.meta["arrays"]}
        chunk, n = self.meta["chunk_size"], self.num_samples
        try:
            self._markers = {c: _parse_marker(t, c, (c * chunk, min(n, (c + 1) * chunk)), self.path) for c, t in self._backend.markers().items()}
        except BaseException:
            self._backend.close()
            raise

    @property
    def format(self) -> str:
        return self.meta["format"]

    @property
    def complete(self) -> bool:
        """Whether every sample was written (an interrupted run leaves it ``False``)."""
        return bool(self.meta["complete"])

    @property
    def num_samples(self) -> int:
        return self._backend.array("ids").shape[0]

    @property
    def layers(self) -> list[str]:
        return list(dict.fromkeys(a["layer"] for a in self.meta["arrays"]))

    def __getitem__(self, key: str) -> Any:
        if key not in self._specs:
            raise KeyError(f"{key!r} is not in this store; it holds {list(self._specs)}")
        return self._backend.array(self._specs[key]["path"])

    def __iter__(self) -> Iterator[str]:
        return iter(self._specs)

    def __len__(self) -> int:
        return len(self._specs)

    @property
    def ids(self) -> np.ndarray:
        """The id of every sample: file paths (str) or indices (int64)."""
        ids = self._backend.array("ids")
        if self.meta["ids"] != "path":
            return np.asarray(ids[:], dtype=np.int64)
        try:
            values = ids.asstr()[:] if self.format == "hdf5" else ids[:]
        except UnicodeDecodeError as e:
            raise _bad(self.path, "its ids are not text") from e
        return np.array(values.tolist(), dtype=str)  # Zarr gives NumPy's variable-width StringDType

    @property
    def labels(self) -> np.ndarray | None:
        """The label of every sample, or ``None`` when the data had none."""
        return np.asarray(self._backend.array("labels")[:]) if self.meta["labels"] else None

    @property
    def failed(self) -> list[SkippedSample]:
        """Samples that could not be loaded: ``SkippedSample(index, id, error)``, by index."""
        return sorted((f for m in self._markers.values() for f in m.failed), key=lambda f: f.index)

    @property
    def valid(self) -> np.ndarray:
        """Which rows hold features: ``True`` for every sample that was read and written, ``False``
        for samples that could not be read (`failed`) and for chunks not yet written.

        >>> import os, tempfile, torch, layertap
        >>> model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())
        >>> out = os.path.join(tempfile.mkdtemp(), "features.zarr")
        >>> feats = layertap.extract_dataset(model, torch.randn(8, 4), "0", out, progress=False)
        >>> good = feats.to_numpy("0")[feats.valid]  # the rows to analyse
        >>> int(feats.valid.sum()), len(good)
        (8, 8)
        """
        mask = np.zeros(self.num_samples, dtype=bool)
        chunk = self.meta["chunk_size"]
        for c in self._markers:
            mask[c * chunk : (c + 1) * chunk] = True
        mask[[f.index for f in self.failed]] = False
        return mask

    def to_numpy(self, key: str) -> np.ndarray:
        """All of ``key``'s array, in memory."""
        return np.asarray(self[key][:])

    def to_torch(self, key: str) -> torch.Tensor:
        """All of ``key``'s array as a CPU tensor."""
        return torch.from_numpy(np.array(self[key][:]))

    def close(self) -> None:
        self._backend.close()

    def __enter__(self) -> FeatureStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        arrays = ", ".join(f"{a['key']} {tuple(a['shape'])} {a['dtype']}" for a in self.meta["arrays"])
        state = "" if self.complete else ", INCOMPLETE"
        return f"<layertap.FeatureStore {self.format} {str(self.path)!r}: {self.num_samples} samples{state}; {arrays}>"

    def _repr_html_(self) -> str:
        """The store in a notebook: what it holds, how complete it is, and its arrays."""
        n, chunk = self.num_samples, self.meta["chunk_size"]
        chunks = -(-n // chunk)
        written = "complete" if self.complete else f"INCOMPLETE: {len(self._markers)} of {chunks} chunks written"
        facts = [
            ("path", str(self.path)),
            ("format", self.format),
            ("samples", f"{n:,} ({written}; {int(self.valid.sum()):,} rows hold features)"),
            ("failed", f"{len(self.failed):,}"),
            ("labels", self.meta["labels"] or "none"),
            ("model", str(self.meta.get("model"))),
            ("reduce", str(self.meta.get("reduce") or "none")),
        ]
        rows = [
            [a["key"], str([n, *a["shape"]]), a["dtype"], human_bytes(n * ArraySpec(**a).sample_bytes)]
            for a in self.meta["arrays"]
        ]
        table = Table(["array", "shape", "dtype", "size"], rows, numeric={"size"}, title="layertap.FeatureStore", facts=facts)
        return table.html()


def open_features(path: str | Path) -> FeatureStore:
    """Open the feature store at ``path`` (written by `layertap.extract_dataset`) for reading.

    An incomplete store (an interrupted run) opens with a warning; rerun the extraction to
    finish it. A store is data: opening one never runs anything from it, and one that is
    damaged or crafted (paths leading out, metadata that disagrees with its arrays) is
    refused with a `StoreError`.
    """
    store = FeatureStore(path)
    if not store.complete:
        warnings.warn(
            printable(
                f"the feature store {path} is incomplete (its extraction was interrupted): rows of unwritten "
                "chunks read as NaN/0; run the same extraction again to finish it"
            ),
            stacklevel=2,
        )
    return store


__all__ = [
    "FeatureStore",
    "open_features",
    "open_or_create",
    "StoreError",
    "StoreWriter",
    "StoreLock",
    "ArraySpec",
    "Layout",
    "Marker",
    "FORMATS",
    "format_for",
    "detect_format",
    "is_url",
    "location",
]
