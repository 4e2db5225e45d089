"""The trust boundary: what a store must look like before anything of it is used.

A store is data, never code: its metadata is checked field by field, every path in it must
stay inside the store (no ``..``, absolute paths, or symlinks out), HDF5 external links and
external storage are refused, Zarr arrays must use plain codecs (no pickle), and NumPy files
are read without pickle.

`_open_backend` is the one way to open an existing store, for reading or for adding chunks: it
runs the format's own checks (the backends' ``check`` and ``array``, with the path checks of
`layertap.store.paths`), then the ones every format shares, here: the metadata's form
(`_check_meta`) and the arrays and chunk markers against it (`_check_arrays`); a marker is
checked when read (`_parse_marker`). A refusal is one `StoreError` line that names the first
thing wrong.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable
from typing import Any

import numpy as np

from ..errors import StoreError
from ..records import SkippedSample
from ..units import human_bytes
from .backend import _Backend
from .backends import BACKENDS, detect_format
from .format import _ARRAY_PATH, _STORAGE_CHUNK_BYTES, _STORE_VERSION, Marker, _marker_width, _specs, array_key
from .paths import Location, _bad, _one_line


def _is_numeric(dtype: Any) -> bool:
    try:
        return np.dtype(dtype).kind in "biufc"
    except TypeError:
        return False


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# ------------------------------------------------------------------------------ metadata
_Need = Callable[[bool, str, str], None]


def _check_meta(meta: Any, path: Location, format: str) -> dict:
    """The store's metadata if every field a reader or writer uses has the right form, else a
    one-line `StoreError` naming the first bad field. Nothing here is imported or called."""

    def need(ok: bool, field: str, expected: str) -> None:
        if not ok:
            raise _bad(path, f"its metadata field {field!r} is " + ("missing" if expected == "there" else f"not {expected}"))

    need(isinstance(meta, dict), "layertap", "a JSON object")
    _check_fields(meta, format, need)
    arrays = meta.get("arrays")
    need(isinstance(arrays, list) and len(arrays) > 0, "arrays", "a non-empty list")
    _check_entries(arrays, need)
    layers = list(dict.fromkeys(a["layer"] for a in arrays))
    need(meta.get("layers") == layers, "layers", f"the layers of its arrays, {layers}")
    return meta


def _check_fields(meta: dict, format: str, need: _Need) -> None:
    """The metadata's fields other than its arrays, in the order `_check_meta` reports them."""
    count = _is_count
    for key in ("layertap_store", "format", "complete", "ready", "num_samples", "chunk_size", "ids", "labels", "arrays", "layers"):
        need(key in meta, key, "there")
    need(count(meta.get("layertap_store")) and meta["layertap_store"] <= _STORE_VERSION, "layertap_store", f"a store version up to {_STORE_VERSION}")
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
    versions = meta.get("versions", {})  # read by the report: package -> version
    need(isinstance(versions, dict) and all(isinstance(v, str) for v in versions.values()), "versions", "an object of version strings")
    if isinstance(settings, dict) and settings.get("num_samples") is not None:
        need(meta["num_samples"] == settings["num_samples"], "num_samples", "the number of samples its settings name")


def _check_entries(arrays: list, need: _Need) -> None:
    """The metadata's array entries: each well formed, keys and paths unique."""
    count = _is_count
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


# ------------------------------------------------------------------------------- markers
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


# -------------------------------------------------------------------------------- arrays
_Expected = list[tuple[str, tuple[int, ...], np.dtype]]


def _check_arrays(backend: _Backend, meta: dict) -> None:
    """Every array the metadata names exists with the rows, shape and dtype it says."""
    rows = _check_ids(backend, meta)
    expected = _check_shapes(backend, meta, rows)
    # every written row has its storage: a chunk file lost in a copy is not read as fill values
    # (stores of version 1 did not write chunks of fill values only); the ids' first, before the
    # markers are read: the rows a store declares are then rows it holds files of
    pieces = meta["layertap_store"] >= 2
    if pieces:
        _check_pieces(backend, meta, ["ids"], rows, [])
    done = _check_markers(backend, meta, rows)
    if pieces:
        _check_pieces(backend, meta, [name for name, _, _ in expected], rows, done)


def _get(backend: _Backend, name: str) -> Any:
    try:
        return backend.array(name)
    except KeyError:
        raise _bad(backend.path, f"its array {name!r} is missing") from None


def _check_ids(backend: _Backend, meta: dict) -> int:
    """The number of rows, which the ids hold, one per sample, of the kind the metadata says."""
    path, ids = backend.path, _get(backend, "ids")
    rows = ids.shape[0] if len(ids.shape) == 1 else -1
    n = meta["num_samples"]
    if rows < 0 or (n is not None and rows != n):
        raise _bad(path, f"its ids hold {list(ids.shape)} entries, not {n} samples")
    _check_chunking(backend, meta, "ids", ids, rows)
    if meta["ids"] == "index" and not _is_numeric(ids.dtype):
        raise _bad(path, "its ids are not indices, as its metadata says")
    if meta["ids"] == "path" and not backend.is_text(ids):
        raise _bad(path, f"its ids are not paths (text) as its metadata says, but {backend.kind(ids)}")
    return rows


def _check_shapes(backend: _Backend, meta: dict, rows: int) -> _Expected:
    """The feature arrays and labels as the metadata says them, each checked; no labels it does not name."""
    expected = [(s.path, (rows, *s.shape), np.dtype(s.dtype)) for s in _specs(meta)]
    if meta["labels"] is not None:
        expected.append(("labels", (rows,), np.dtype(meta["labels"])))
    else:
        with contextlib.suppress(KeyError):
            backend.array("labels")
            raise _bad(backend.path, "it holds labels that its metadata does not name")
    for name, shape, dtype in expected:
        array = _get(backend, name)
        if tuple(array.shape) != shape or np.dtype(array.dtype) != dtype:
            raise _bad(backend.path, f"its array {name!r} is {list(array.shape)} {array.dtype}, its metadata says {list(shape)} {dtype}")
        _check_chunking(backend, meta, name, array, rows)
    return expected


_LARGEST_CHUNK_BYTES = 256 << 20  # a stored chunk of ids or labels: chunk_size rows of at most 8 bytes, 32 M rows


def _check_chunking(backend: _Backend, meta: dict, name: str, array: Any, rows: int) -> None:
    """Stored chunks (Zarr's, HDF5's) no bigger than layertap makes them: at most ``chunk_size``
    rows, and no more rows than the array has unless they fit in a stored chunk's bytes
    (`_storage_rows`): reading one row never inflates more than that (a compression bomb). Both
    numbers come from the store itself, so a chunk is also bounded in bytes whatever they say
    (`_LARGEST_CHUNK_BYTES`: an ids or labels chunk is ``chunk_size`` rows, which the user sets)."""
    chunks = getattr(array, "chunks", None)
    if not chunks or rows < 0:
        return
    per, row_bytes = int(chunks[0]), max(1, int(np.prod(array.shape[1:], dtype=np.int64)) * np.dtype(array.dtype).itemsize)
    big = per * row_bytes > max(_LARGEST_CHUNK_BYTES, row_bytes)
    if big or per > meta["chunk_size"] or (per > rows and per * row_bytes > max(_STORAGE_CHUNK_BYTES, row_bytes)):
        most = f"{human_bytes(_LARGEST_CHUNK_BYTES)}" if big else f"the {min(rows, meta['chunk_size'])} rows"
        raise _bad(backend.path, f"its array {name!r} is stored in chunks of {per} rows, more than {most} layertap puts in one")


def _check_markers(backend: _Backend, meta: dict, rows: int) -> list[int]:
    """The chunks marked written, in order: no more than the store has, all when it says complete."""
    path, chunks = backend.path, -(-rows // meta["chunk_size"])
    if backend.MARKER_SLOTS:  # one marker slot per chunk, read whole below
        shape = _get(backend, backend.MARKERS).shape
        if not shape:
            raise _bad(path, "its chunk markers are one value, not a marker per chunk")
        slots, *width = shape
        if slots > chunks or (meta["num_samples"] is not None and slots != chunks):
            raise _bad(path, f"it has {slots} chunk markers for {chunks} chunks")
        if width and width[0] > _marker_width(meta["chunk_size"]):  # bytes per marker (HDF5): each is read whole
            raise _bad(path, f"its chunk markers are {width[0]} bytes each, more than the {_marker_width(meta['chunk_size'])} its writer makes")
    try:
        done = sorted(backend.markers())
    except KeyError as e:
        raise _bad(path, f"its chunk markers are missing (it has no array {e.args[0] if e.args else backend.MARKERS!r})") from None
    if meta["num_samples"] is not None and (done[-1:] and done[-1] >= chunks):
        raise _bad(path, f"it marks chunk {done[-1]} written, of {chunks}")
    if meta["complete"] and len(done) != chunks:
        raise _bad(path, f"it says it is complete, but {chunks - len(done)} of its {chunks} chunks are not marked written")
    return done


def _check_pieces(backend: _Backend, meta: dict, names: list[str], rows: int, done: list[int]) -> None:
    """Every stored piece of the written chunks of arrays ``names`` exists (all of the ids')."""
    chunk = meta["chunk_size"]
    for name in names:
        found = backend.pieces(name)
        if found is None:
            continue
        size, present = found
        have = np.array(sorted(present), dtype=np.int64)
        spans = [(0, -(-rows // size))] if name == "ids" else [(c * chunk // size, -(-min(rows, (c + 1) * chunk) // size)) for c in done]
        for start, end in spans:  # counted against the pieces there are: no range of a declared size is made
            if int(np.searchsorted(have, end) - np.searchsorted(have, start)) < end - start:
                missing = [p for p in range(start, min(end, start + len(have) + 3)) if p not in present][:3]
                raise _bad(backend.path, f"the stored pieces {missing} of its array {name!r} are missing (a partial copy?)")


# --------------------------------------------------------------------------- the gate
def _open_backend(path: Location, mode: str, format: str | None = None, *, half_made: bool = False) -> tuple[_Backend, dict]:
    """The store at ``path`` opened for reading (``"r"``) or adding chunks (``"r+"``), checked:
    nothing in it leads outside it, its metadata has the right form, its arrays agree with it.
    A store whose writer was killed while making it is refused, unless ``half_made`` (to remove it)."""
    format = format or detect_format(path)
    if format is None:
        raise StoreError(f"no layertap feature store at {path} (a Zarr folder, an HDF5 file or a folder of .npy files)")
    try:
        backend = BACKENDS[format](path, mode)
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

