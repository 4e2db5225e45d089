"""Feature stores on disk: Zarr (default), HDF5 or NumPy files, written chunk by chunk, read lazily.

Every format holds the same things:

- ``features/<layer>``: one array per tapped layer, ``[samples, *feature shape]``; a layer whose
  output holds several tensors (a tuple, a dict) gets one array per tensor,
  ``features/<layer>/0``, ``features/<layer>/1``, ... (key ``"<layer>/0"``), in the order of
  `layertap.nested.tensors`;
- ``ids``: each sample's id (its file path, else its index); ``labels`` when the data has them;
- one completion marker per chunk of samples, holding the chunk's failed samples and the rank
  of the process that wrote it;
- metadata: model, layers, shapes, dtypes, reductions, versions and a hash of the settings.

A chunk (``chunk_size`` consecutive samples, the arrays' chunking along samples) is written
whole, and its marker only after its data: a store interrupted at any moment knows which
chunks are complete, and is marked complete only when every chunk is. Writing a chunk touches
no other chunk's files, so several processes can fill one Zarr or NumPy store. Zarr writes
every file atomically; HDF5 is flushed after every chunk, but the format has no journal, so
a crash in the middle of a write can still damage the file.

>>> import torch, torchvision, layertap
>>> model = torchvision.models.resnet18()
>>> images = torch.randn(8, 3, 64, 64)
>>> store = layertap.extract_dataset(model, images, "avgpool", "/tmp/doc.zarr", overwrite=True, progress=False)
>>> feats = layertap.open_features("/tmp/doc.zarr")
>>> feats["avgpool"].shape, feats.ids[:3].tolist()
((8, 512, 1, 1), [0, 1, 2])
"""

from __future__ import annotations

import json
import os
import re
import shutil
import warnings
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .data import Failure
from .errors import LayertapError, require

FORMATS = ("zarr", "hdf5", "npy")
STORE_VERSION = 1
_SUFFIX_FORMATS = {".zarr": "zarr", ".h5": "hdf5", ".hdf5": "hdf5", ".hdf": "hdf5"}
_HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")


class StoreError(LayertapError):
    """A feature store cannot be written or read as asked; the message says why and what to do."""


Location = Path | str  # a local path, or an fsspec URL (str) such as "s3://bucket/feats.zarr"


def is_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an fsspec URL (``s3://``, ``gs://``, ``memory://``...), not a local path."""
    return isinstance(path, str) and "://" in path


def location(path: str | os.PathLike) -> Location:
    """``path`` as the stores take it: a URL stays a string (a `Path` would fold its ``//``)."""
    return path if is_url(path) else Path(path)


def url_fs(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url``, and the path inside it."""
    import fsspec  # a dependency of torch

    fs, inner = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()  # fsspec caches instances and listings; Zarr writes through its own instance
    return fs, inner


def occupied(path: Location) -> bool:
    """Whether something (a file, or a folder that is not empty) is at ``path``."""
    if is_url(path):
        fs, inner = url_fs(path)
        return fs.exists(inner) and (fs.isfile(inner) or bool(fs.ls(inner)))
    return path.exists() and not (path.is_dir() and not any(path.iterdir()))


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
    for layer, leaf, shape, dtype in entries:
        if layer not in bases:
            base, n = safe_name(layer), 1
            while (base if n == 1 else f"{base}-{n}").lower() in taken:
                n += 1
            bases[layer] = base if n == 1 else f"{base}-{n}"
            taken.add(bases[layer].lower())
        path = f"features/{bases[layer]}" + ("" if leaf is None else f"/{leaf}")
        specs.append(ArraySpec(array_key(layer, leaf), path, layer, leaf, tuple(shape), dtype))
    return specs


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
    if is_url(path):  # an object store holds Zarr only
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


# ------------------------------------------------------------------------------- backends
class _Backend:
    """The primitive reads and writes of one format; `StoreWriter` and `FeatureStore` use them."""

    format: str

    def __init__(self, path: Location, mode: str) -> None:  # mode: "r", "r+" or "w"
        self.path, self.mode = path, mode

    # read_meta, write_meta, create, array, write, resize, mark, markers, create_markers: per format

    def flush(self) -> None:
        """Hand written data to the OS (formats that buffer it override this)."""

    def close(self) -> None:
        """Release files (formats that hold them open override this)."""


class _ZarrBackend(_Backend):
    format = "zarr"
    MARKERS = "_chunks"

    def __init__(self, path: Location, mode: str) -> None:  # a URL opens through fsspec
        super().__init__(path, mode)
        self.zarr = require("zarr", "store")
        # fsspec's local filesystem (file://) makes no folders unless told to; object stores need none
        options = {"storage_options": {"auto_mkdir": True}} if str(path).startswith("file://") else {}
        self.root = self.zarr.open_group(str(path), mode=mode, **options)
        self._arrays: dict[str, Any] = {}

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
        self._arrays[name] = group.create_array(leaf, shape=shape, chunks=(chunk, *shape[1:]), dtype=dtype, fill_value=fill, **codecs)

    def array(self, name: str) -> Any:
        if name not in self._arrays:
            self._arrays[name] = self.root[name]
        return self._arrays[name]

    def write(self, name: str, start: int, data: np.ndarray) -> None:
        self.array(name)[start : start + len(data)] = data

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

    def create_markers(self, n: int) -> None:
        # one object per marker: writers of different chunks never touch the same object
        self._arrays[self.MARKERS] = self.root.create_array(self.MARKERS, shape=(n,), chunks=(1,), dtype=str, fill_value="")


class _HDF5Backend(_Backend):
    format = "hdf5"
    MARKERS = "_chunks"

    def __init__(self, path: Path, mode: str) -> None:
        super().__init__(path, mode)
        self.h5py = require("h5py", "store")
        try:
            self.file = self.h5py.File(path, mode)
        except OSError as e:
            raise StoreError(
                f"cannot open the HDF5 file {path} ({e}); an HDF5 file is not safe from a crash while it is "
                "written: if a run was killed, delete the file and run again, or use Zarr, which is"
            ) from e

    def read_meta(self) -> dict | None:
        text = self.file.attrs.get("layertap")
        return json.loads(text) if text is not None else None

    def write_meta(self, meta: dict) -> None:
        self.file.attrs["layertap"] = json.dumps(meta)
        self.file.flush()

    def create(self, name: str, shape: tuple, dtype: Any, chunk: int, fill: Any) -> None:
        if dtype is str:
            dtype, fill = self.h5py.string_dtype(), None
        self.file.create_dataset(
            name, shape=shape, maxshape=(None, *shape[1:]), chunks=(max(1, chunk), *shape[1:]), dtype=dtype, fillvalue=fill
        )

    def array(self, name: str) -> Any:
        return self.file[name]

    def write(self, name: str, start: int, data: np.ndarray) -> None:
        self.file[name][start : start + len(data)] = data

    def resize(self, name: str, n: int) -> None:
        self.file[name].resize(n, axis=0)

    def mark(self, chunk: int, text: str) -> None:
        markers = self.file[self.MARKERS]
        if chunk >= markers.shape[0]:
            markers.resize(chunk + 1, axis=0)
        markers[chunk] = text

    def markers(self) -> dict[int, str]:
        values = self.file[self.MARKERS].asstr()[:]
        return {int(i): str(values[i]) for i in np.flatnonzero(values != "")}

    def create_markers(self, n: int) -> None:
        self.file.create_dataset(self.MARKERS, shape=(n,), maxshape=(None,), chunks=(256,), dtype=self.h5py.string_dtype())

    def flush(self) -> None:
        self.file.flush()

    def close(self) -> None:
        self.file.close()


class _NpyBackend(_Backend):
    """A folder of ``.npy`` files, written in place with ``pwrite`` and read as memory maps."""

    format = "npy"
    META = "layertap.json"
    MARKERS = "_chunks"

    def __init__(self, path: Path, mode: str) -> None:
        super().__init__(path, mode)
        if mode == "w":
            path.mkdir(parents=True, exist_ok=True)
        self._files: dict[str, tuple[int, int, int]] = {}  # name -> (fd, data offset, row bytes)
        self._maps: dict[str, np.memmap] = {}

    def _file(self, name: str) -> Path:
        return self.path / f"{name}.npy"

    def _replace(self, target: Path, text: str) -> None:
        tmp = target.with_name(f".{target.name}.{os.getpid()}.tmp")
        tmp.write_text(text)
        os.replace(tmp, target)  # atomic: a reader sees the old or the new file, never half

    def read_meta(self) -> dict | None:
        meta = self.path / self.META
        return json.loads(meta.read_text()) if meta.is_file() else None

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
            self._maps[name] = np.load(file, mmap_mode="r")
        return self._maps[name]

    def write(self, name: str, start: int, data: np.ndarray) -> None:
        if name not in self._files:
            fd = os.open(self._file(name), os.O_RDWR)
            with open(self._file(name), "rb") as f:
                shape, _, dtype = _header(f)
                offset = f.tell()
            self._files[name] = (fd, offset, int(np.prod(shape[1:], dtype=np.int64)) * dtype.itemsize)
        fd, offset, row = self._files[name]
        view = memoryview(np.ascontiguousarray(data).reshape(-1).view(np.uint8))
        at = offset + start * row
        while view:  # pwrite may write less than asked (at most 2 GB a call on Linux)
            written = os.pwrite(fd, view, at)
            view, at = view[written:], at + written

    def resize(self, name: str, n: int) -> None:
        raise StoreError("npy arrays cannot grow: use format='zarr' or 'hdf5' for data of unknown length")

    def mark(self, chunk: int, text: str) -> None:
        folder = self.path / self.MARKERS
        folder.mkdir(exist_ok=True)
        self._replace(folder / f"{chunk:09d}.json", text)

    def markers(self) -> dict[int, str]:
        folder = self.path / self.MARKERS
        if not folder.is_dir():
            return {}
        return {int(p.stem): p.read_text() for p in folder.glob("*.json") if p.stem.isdigit()}

    def create_markers(self, n: int) -> None:
        (self.path / self.MARKERS).mkdir(exist_ok=True)

    def close(self) -> None:
        for fd, _, _ in self._files.values():
            os.close(fd)
        self._files.clear()
        self._maps.clear()


def _header(f: Any) -> tuple[tuple, bool, np.dtype]:
    f.seek(0)
    major, _ = np.lib.format.read_magic(f)
    read = np.lib.format.read_array_header_1_0 if major == 1 else np.lib.format.read_array_header_2_0
    return read(f)


_BACKENDS: dict[str, type[_Backend]] = {"zarr": _ZarrBackend, "hdf5": _HDF5Backend, "npy": _NpyBackend}


def _open_backend(path: Location, mode: str, format: str | None = None) -> _Backend:
    format = format or detect_format(path)
    if format is None:
        raise StoreError(f"no layertap feature store at {path} (a Zarr folder, an HDF5 file or a folder of .npy files)")
    return _BACKENDS[format](path, mode)


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


class StoreWriter:
    """Writes whole chunks of samples into a store and marks each complete after its data.

    Made by `StoreWriter.create` (a new store) or `StoreWriter.open` (to resume); used by
    `layertap.extract_dataset`, one writer per process.
    """

    def __init__(self, backend: _Backend, meta: dict) -> None:
        self.backend, self.meta = backend, meta
        self.specs = [ArraySpec(**{**a, "shape": tuple(a["shape"])}) for a in meta["arrays"]]
        self.chunk_size: int = meta["chunk_size"]
        self.num_samples: int | None = meta["num_samples"]
        self.rows: int = backend.array("ids").shape[0]  # grows while the length is unknown
        self.process = 0  # the rank of the process writing: each chunk's marker records it

    @classmethod
    def create(
        cls,
        path: str | Path,
        format: str,
        meta: dict,
        specs: Sequence[ArraySpec],
        *,
        num_samples: int | None,
        chunk_size: int,
        ids: Sequence | None,
        labels_dtype: str | None,
    ) -> StoreWriter:
        """A new store at ``path`` for ``num_samples`` samples (``None``: unknown, it grows)."""
        path = location(path)
        rows = num_samples or 0
        meta = {
            **meta,
            "layertap_store": STORE_VERSION,
            "format": format,
            "complete": False,
            "num_samples": num_samples,
            "chunk_size": chunk_size,
            "arrays": [{**asdict(s), "shape": list(s.shape)} for s in specs],
            "ids": "index" if ids is None else "path",
            "labels": labels_dtype,
        }
        if num_samples is None and format == "npy":
            raise StoreError(
                "the npy format needs the number of samples before writing, and this data does not say it: "
                "use format='zarr' or 'hdf5', or give data with a length (a Dataset, a list)"
            )
        backend = _BACKENDS[format](path, "w")
        try:
            backend.write_meta({**meta, "ready": False})  # first: a half-made store is known as ours
            for spec in specs:
                dtype = np.dtype(spec.dtype)
                backend.create(spec.path, (rows, *spec.shape), dtype, storage_rows(chunk_size, spec.sample_bytes), fill_value(dtype))
            if labels_dtype is not None:
                dtype = np.dtype(labels_dtype)
                backend.create("labels", (rows,), dtype, chunk_size, fill_value(dtype))
            backend.create_markers(-(-rows // chunk_size))
            if ids is None:
                backend.create("ids", (rows,), np.int64, chunk_size, None)
                for start in range(0, rows, 1 << 16):
                    backend.write("ids", start, np.arange(start, min(rows, start + (1 << 16)), dtype=np.int64))
            else:
                width = max(map(len, ids), default=1)
                backend.create("ids", (rows,), str if format != "npy" else f"<U{width}", chunk_size, "" if format != "npy" else None)
                for start in range(0, rows, 1 << 16):  # in pieces: a million paths are no small array
                    backend.write("ids", start, np.array(ids[start : start + (1 << 16)], dtype=str if format != "npy" else f"<U{width}"))
            meta["ready"] = True
            backend.write_meta(meta)
            backend.flush()
        except BaseException:
            backend.close()
            raise
        return cls(backend, meta)

    @classmethod
    def open(cls, path: str | Path) -> StoreWriter:
        """An existing store, to add its missing chunks."""
        backend = _open_backend(location(path), "r+")
        meta = backend.read_meta()
        if not meta:
            backend.close()
            raise StoreError(f"{path} is not a layertap feature store")
        return cls(backend, meta)

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

    def write_chunk(self, chunk: int, arrays: Mapping[str, np.ndarray], labels: np.ndarray | None, failed: Sequence[Failure]) -> None:
        """Write the rows of ``chunk`` (all of them, failed ones filled), then its marker."""
        start, _ = self.chunk_range(chunk)
        n = len(arrays[self.specs[0].key])
        if self.num_samples is None and start + n > self.rows:
            self._grow(start + n)
        for spec in self.specs:
            self.backend.write(spec.path, start, arrays[spec.key])
        if labels is not None and self.meta["labels"] is not None:
            self.backend.write("labels", start, labels)
        self.backend.flush()
        self.backend.mark(chunk, json.dumps({"failed": [list(f) for f in failed], "process": self.process}))
        self.backend.flush()

    def _grow(self, rows: int) -> None:
        for name in [s.path for s in self.specs] + ["ids"] + (["labels"] if self.meta["labels"] else []):
            self.backend.resize(name, rows)
        self.backend.write("ids", self.rows, np.arange(self.rows, rows, dtype=np.int64))
        self.rows = rows

    def finish(self, num_samples: int) -> None:
        """Mark the store complete, after checking that every one of its chunks is."""
        if self.num_samples is None:
            self.meta["num_samples"] = self.num_samples = num_samples
        missing = sorted(set(range(self.num_chunks or 0)) - self.done())
        if missing:
            raise StoreError(f"chunks {missing[:10]} of {self.backend.path} are not written; the store stays incomplete")
        self.meta["complete"] = True
        self.backend.write_meta(self.meta)
        self.backend.flush()

    def close(self) -> None:
        self.backend.close()


def remove_store(path: str | Path) -> None:
    """Delete the layertap store at ``path``; refuse anything else, so no user data is lost."""
    path = location(path)
    if not occupied(path):
        return
    format = detect_format(path)
    backend = _open_backend(path, "r", format) if format else None
    meta = backend.read_meta() if backend else None
    if backend:
        backend.close()
    if not meta or "layertap_store" not in meta:
        raise StoreError(f"{path} exists and is not a layertap feature store: choose another output path")
    if is_url(path):
        fs, inner = url_fs(path)
        fs.rm(inner, recursive=True)
    elif path.is_dir():
        shutil.rmtree(path)
    else:
        path.unlink()


# -------------------------------------------------------------------------------- reading
class FeatureStore(Mapping[str, Any]):
    """A read-only feature store: layer name -> lazily loaded array, with ids, labels and metadata.

    Values are the format's own lazy arrays (``zarr.Array``, ``h5py.Dataset``, ``np.memmap``):
    slicing reads only what is asked. Samples that failed to load (``on_error='skip'``) are
    listed in `failed` and their rows hold NaN (floats) or -1/0 (integers).

    >>> import layertap
    >>> feats = layertap.open_features("/tmp/doc.zarr")       # doctest: +SKIP
    >>> x = feats.to_numpy("avgpool"); y = feats.labels        # doctest: +SKIP
    """

    def __init__(self, path: str | Path) -> None:
        self.path = location(path)
        self._backend = _open_backend(self.path, "r")
        meta = self._backend.read_meta()
        if not meta or "layertap_store" not in meta:
            self._backend.close()
            raise StoreError(f"{self.path} is not a layertap feature store")
        self.meta: dict = meta
        self._specs = {a["key"]: a for a in meta["arrays"]}

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
        values = ids.asstr()[:] if self.format == "hdf5" else ids[:]
        return np.array(values.tolist(), dtype=str)  # Zarr gives NumPy's variable-width StringDType

    @property
    def labels(self) -> np.ndarray | None:
        """The label of every sample, or ``None`` when the data had none."""
        return np.asarray(self._backend.array("labels")[:]) if self.meta["labels"] else None

    @property
    def failed(self) -> list[Failure]:
        """Samples that could not be loaded: ``Failure(index, id, error)``, by index."""
        records = [Failure(*f) for text in self._backend.markers().values() for f in json.loads(text)["failed"]]
        return sorted(records, key=lambda f: f.index)

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


def open_features(path: str | Path) -> FeatureStore:
    """Open the feature store at ``path`` (written by `layertap.extract_dataset`) for reading.

    An incomplete store (an interrupted run) opens with a warning; rerun the extraction to
    finish it.
    """
    store = FeatureStore(path)
    if not store.complete:
        warnings.warn(
            f"the feature store {path} is incomplete (its extraction was interrupted): rows of unwritten "
            "chunks read as NaN/0; run the same extraction again to finish it",
            stacklevel=2,
        )
    return store


__all__ = ["FeatureStore", "open_features", "StoreError", "StoreWriter", "ArraySpec", "FORMATS", "format_for", "detect_format", "is_url", "location"]
