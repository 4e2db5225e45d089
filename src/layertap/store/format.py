"""What a store holds, and the names of it: the facts every format shares, the codec one uses.

Every format holds the same things:

- ``features/<layer>``: one array per tapped layer, ``[samples, *feature shape]``; a layer whose
  output holds several tensors (a tuple, a dict) gets one array per tensor,
  ``features/<layer>/0``, ``features/<layer>/1``, ... (key ``"<layer>/0"``), in the order of
  `layertap.nested.tensors`;
- ``ids``: each sample's id (its file path, else its index); ``labels`` when the data has them;
- one completion marker per chunk of samples, holding the chunk's failed samples, the rank of
  the process that wrote it and a digest of every sample's input (see `layertap.extract.digests`);
- metadata: model, layers, shapes, dtypes, reductions, versions and a hash of the settings.

This module holds those names (`safe_name`, `array_key`, `array_specs`), the plan of a new store
(`StorePlan`), what a marker records (`Marker`), how arrays are chunked and filled,
and the one codec Zarr stores compress with. It imports nothing else of the package: the
rest of it builds on this.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import StoreError, require
from ..records import SkippedSample

_STORE_VERSION = 2  # 2: chunk markers hold input digests; arrays of known length allocated up front
_LOCK = ".layertap.lock"
_NPY_META = "layertap.json"
# metadata being written (to a temporary file, synced, then renamed): a writer killed before its
# first rename leaves one of these beside the lock, and nothing else. NumPy's is layertap's own
# temporary file, Zarr's the partial file Zarr writes first.
_NPY_HALF_META = re.compile(rf"\.{re.escape(_NPY_META)}\.[0-9]+\.tmp")
_ZARR_HALF_META = re.compile(r"zarr\.[0-9a-f]{32}\.partial")
_UNSAFE = re.compile(r"[^A-Za-z0-9._-]")
_ARRAY_PATH = re.compile(r"features/[A-Za-z0-9_-][A-Za-z0-9._-]*(/[0-9]+)?")


# ------------------------------------------------------------------------------ arrays
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


def _specs(meta: dict) -> list[ArraySpec]:
    return [ArraySpec(**{**a, "shape": tuple(a["shape"])}) for a in meta["arrays"]]


@dataclass
class StorePlan:
    """What a new store holds, known once the first features are: made by the extraction."""

    specs: list[ArraySpec]
    num_samples: int | None  # None: unknown, the store grows
    chunk_size: int
    ids: Sequence | None  # sample ids (paths), or None when they are the indices
    labels_dtype: str | None
    sample: Mapping[str, np.ndarray]  # one batch of features, to estimate the compressed size


_STORAGE_CHUNK_BYTES = 4 << 20


def _storage_rows(chunk_size: int, sample_bytes: int) -> int:
    """Samples per stored (compressed) chunk of an array: a divisor of ``chunk_size`` of at most
    about 4 MB, so that a chunk of writing never shares a stored chunk with another, and big
    feature maps are compressed in pieces of a size that codecs and readers handle well."""
    rows = max(1, min(chunk_size, _STORAGE_CHUNK_BYTES // max(1, sample_bytes)))
    while chunk_size % rows:
        rows -= 1
    return rows


def fill_value(dtype: Any) -> Any:
    """What rows of samples that failed to load hold: NaN (floats), -1 (signed ints) or 0."""
    kind = np.dtype(dtype).kind
    if kind in "fc":
        return float("nan")
    return -1 if kind == "i" else 0


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


# ------------------------------------------------------------------------------ markers
@dataclass
class Marker:
    """What a chunk's completion marker records."""

    failed: list[SkippedSample]
    process: int
    digests: list[str] | None  # one per sample of the chunk; None in stores written before digests

    def to_json(self) -> str:
        return json.dumps({"failed": [list(f) for f in self.failed], "process": self.process, "digests": self.digests})


_MARKER_BYTES_PER_SAMPLE = 24  # room in an HDF5 marker: a digest per sample, and failures


def _marker_width(chunk_size: int) -> int:
    """The bytes of an HDF5 chunk marker (a row of its marker array) for chunks of ``chunk_size`` samples."""
    return _MARKER_BYTES_PER_SAMPLE * chunk_size + 4096


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


# -------------------------------------------------------------------------------- codec
class _Codec:
    """The one codec features are compressed with (Blosc: LZ4 at level 5, byte shuffle): as Zarr
    writes it into a store's metadata, and as numcodecs runs it to estimate a store's size."""

    CNAME, CLEVEL, SHUFFLE = "lz4", 5, "shuffle"

    @classmethod
    def zarr(cls, zarr: Any) -> Any:
        """The codec for an array that ``zarr`` (the imported package) makes."""
        return zarr.codecs.BloscCodec(cname=cls.CNAME, clevel=cls.CLEVEL, shuffle=cls.SHUFFLE)

    @classmethod
    def ratio(cls, arrays: Mapping[str, np.ndarray]) -> float:
        """The fraction of its size that a batch of features keeps once compressed."""
        Blosc = require("numcodecs", "store").Blosc  # the codec Zarr stores with
        codec = Blosc(cname=cls.CNAME, clevel=cls.CLEVEL, shuffle=getattr(Blosc, cls.SHUFFLE.upper()))  # "shuffle": Blosc.SHUFFLE
        raw = packed = 0
        for a in arrays.values():
            a = np.ascontiguousarray(a)
            raw += a.nbytes
            packed += len(codec.encode(a))
        return packed / raw if raw else 1.0
