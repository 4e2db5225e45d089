"""Checked Zarr chunk reads: every chunk of a layertap Zarr store is checked as bytes before a codec sees it.

The problem: numcodecs' Blosc decoder trusts the 16-byte header of a chunk (numcodecs#228). A
header that claims more bytes than the chunk holds makes it read past its buffer: a crash, or
heap memory handed back as features. A damaged or crafted chunk must be refused before it is
decoded, and a chunk that fails to decode must be a one-line `StoreError`, not a bare library error.

The rule: `_ZarrBackend` opens a store only through `checked_store`, a `zarr` store wrapper
(`_CheckedStore`) under every read, local or fsspec. Each array is registered (`expect`) when
the backend opens or makes it, with what its chunks must be (`chunk_rule`): Blosc only as the
last codec, right after ``bytes``, so that a chunk's bytes are one Blosc frame of exactly the
chunk's size (chunk shape x itemsize). Every Blosc chunk read is then held to its header
(`blosc_problem`): its compressed size is the bytes read, its uncompressed size the chunk's,
a stored (memcpyed) chunk is its header plus its data, and its block offsets lie inside it.
A text array's chunk (ids, markers: Zstandard) must say in its frame header how many bytes it
holds, at most `TEXT_CHUNK_BYTES` (`zstd_problem`): a few KB can inflate to GBs otherwise.
A read of a chunk of an array no one registered is refused. The array's codec pipeline is
wrapped (`checked_array`) so that a chunk that passes the header and still fails to decode
(a swapped, truncated or garbled chunk of another codec) is one `StoreError` line naming the
store, the array and the fix.

The cost: one header parse (16 bytes, and 4 bytes per Blosc block; at most 18 bytes of a
Zstandard frame) per chunk read; no copy of the chunk.
"""

from __future__ import annotations

import contextvars
import functools
import struct
import zlib
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np

from ..errors import StoreError
from .paths import Location, _bad, _check_inside, _one_line

# the chunks refused during one read of `_Pipeline` (the store hands them on as missing, and the
# read raises once all its chunks are in: an error inside Zarr's concurrent reads leaves tasks behind)
_FOUND: contextvars.ContextVar[list[StoreError] | None] = contextvars.ContextVar("layertap_refused_chunks", default=None)
_HEADER = struct.Struct("<BBBBIII")  # version, versionlz, flags, typesize, nbytes, blocksize, cbytes
_MEMCPYED = 0x02


@dataclass(frozen=True)
class ChunkRule:
    """What every stored chunk of one array must be: a Blosc frame of ``nbytes`` bytes
    (``codec`` "blosc"), a Zstandard frame that says it holds at most ``nbytes`` ("zstd": the
    text arrays' codec), or whatever its codecs check themselves ("")."""

    name: str
    codec: str
    nbytes: int


# a text chunk (ids, markers) that says it holds more is refused unread: a Zstandard frame of a
# few KB can inflate to GBs, and the length of a text is known only once it is decoded
TEXT_CHUNK_BYTES = 256 << 20
_ZSTD_MAGIC = 0xFD2FB528


def chunk_rule(where: Location, name: str, array: Any) -> ChunkRule:
    """The rule of ``array``'s chunks, from the metadata Zarr decodes them with; a codec chain
    in which Blosc's frame is not the chunk's bytes of the whole chunk is refused."""
    codecs = [c.get("name") if isinstance(c, dict) else c for c in array.metadata.to_dict().get("codecs", [])]
    dtype = np.dtype(array.dtype)
    if "zstd" in codecs[:-1]:  # a codec decoded after it could inflate what its frame header bounds
        raise _bad(where, f"its array {name!r} uses the codecs {codecs}: Zstandard only as the last codec is read")
    if codecs and codecs[-1] == "zstd":
        text = dtype.kind in "OTVU"
        return ChunkRule(name, "zstd", TEXT_CHUNK_BYTES if text else int(np.prod(array.chunks, dtype=np.int64)) * dtype.itemsize)
    if "blosc" not in codecs:
        return ChunkRule(name, "", 0)
    if codecs.count("blosc") != 1 or codecs[-1] != "blosc" or codecs[-2:-1] != ["bytes"] or dtype.kind in "OTV":
        raise _bad(where, f"its array {name!r} uses the codecs {codecs}: Blosc only as the last codec, right after 'bytes', is read")
    return ChunkRule(name, "blosc", int(np.prod(array.chunks, dtype=np.int64)) * dtype.itemsize)


def blosc_problem(data: Any, nbytes: int) -> str | None:
    """What is wrong with the Blosc frame ``data`` (a buffer) of a chunk of ``nbytes`` bytes, or ``None``."""
    size = len(data)
    if size < _HEADER.size:
        return f"it holds {size} bytes, less than a Blosc header"
    _, _, flags, typesize, claimed, blocksize, cbytes = _HEADER.unpack_from(data)
    if cbytes != size:
        return f"its header says {cbytes} bytes, the file holds {size}"
    if claimed != nbytes:
        return f"its header says {claimed} bytes uncompressed, a chunk holds {nbytes}"
    if flags & _MEMCPYED:
        return None if cbytes == claimed + _HEADER.size else f"it is stored uncompressed in {cbytes} bytes, not {claimed} and a header"
    if typesize < 1 or blocksize < 1:
        return "its header gives no type or block size"
    blocks = -(-claimed // blocksize)
    table = _HEADER.size + 4 * blocks
    if table > cbytes:
        return f"its {blocks} blocks' offsets do not fit in it"
    starts = np.frombuffer(data, dtype="<u4", count=blocks, offset=_HEADER.size)
    if blocks and (int(starts.min()) < table or int(starts.max()) >= cbytes):
        return "its blocks' offsets lead outside it"
    return None


def zstd_problem(data: Any, most: int) -> str | None:
    """What is wrong with the Zstandard frame ``data`` of a chunk of at most ``most`` bytes, read
    from its header (RFC 8878): a frame that does not say its size, or says more, is refused."""
    head = bytes(data[:18])
    if len(head) < 5 or int.from_bytes(head[:4], "little") != _ZSTD_MAGIC:
        return "it is not a Zstandard frame"
    descriptor = head[4]
    single, dictionary = (descriptor >> 5) & 1, descriptor & 3
    at = 5 + (0 if single else 1) + (0, 1, 2, 4)[dictionary]  # after the window and dictionary fields
    width = (1 if single else 0, 2, 4, 8)[descriptor >> 6]
    if width == 0:
        return "its frame does not say how many bytes it holds"
    if at + width > len(head):
        return "its frame header is cut short"
    size = int.from_bytes(head[at : at + width], "little") + (256 if width == 2 else 0)
    return None if size <= most else f"it says it holds {size} bytes, more than the {most} a chunk of it may"


def damaged(where: Location, name: str, what: str) -> StoreError:
    return _bad(where, f"a chunk of its array {name!r} is damaged ({what})")


def checked_store(path: Location, read_only: bool, storage_options: dict | None) -> Any:
    """The Zarr store at ``path`` (a local folder, or a URL through fsspec) under the chunk check; a
    local store's root metadata must not be a link out of it (Zarr reads it on opening)."""
    from zarr.storage import FsspecStore, LocalStore

    if not isinstance(path, str):  # Zarr reads the root's metadata on opening: a link out of the store is refused first
        _check_inside(path, path / "zarr.json", "zarr.json")
    inner = FsspecStore.from_url(path, storage_options=storage_options, read_only=read_only) if isinstance(path, str) else LocalStore(path, read_only=read_only)
    return _store_class()(inner, path)


@functools.cache
def _store_class() -> type:
    """The checked store: a ``zarr.storage.WrapperStore`` (made on first use: zarr is an optional package)."""
    from zarr.storage import WrapperStore

    class CheckedStore(WrapperStore):
        def __init__(self, store: Any, where: Location, rules: dict[str, ChunkRule] | None = None) -> None:
            super().__init__(store)
            self.where, self.rules = where, {} if rules is None else rules  # array path -> rule, shared by copies
            self.made: dict[str, bool] = {}

        def _with_store(self, store: Any) -> Any:
            return type(self)(store, self.where, self.rules)

        def holds_array(self, path: str) -> bool:
            """Whether Zarr made an array at ``path`` (its metadata is there): its chunks are a store's."""
            from zarr.core.sync import sync

            if path not in self.made:
                self.made[path] = sync(self._store.exists(f"{path}/zarr.json"))
            return self.made[path]

        def expect(self, path: str, rule: ChunkRule) -> None:
            self.rules[path.strip("/")] = rule

        def _check(self, key: str, data: Any, byte_range: Any) -> None:
            if key == "zarr.json" or key.endswith("/zarr.json"):
                return
            parts = key.split("/")
            rule = next((self.rules[p] for k in range(len(parts) - 1, 0, -1) if (p := "/".join(parts[:k])) in self.rules), None)
            if rule is None:
                raise _bad(self.where, f"Zarr read {key!r}, a chunk of no array layertap checked")
            if not rule.codec or data is None:
                return
            if byte_range is not None:
                raise damaged(self.where, rule.name, "read in part, which a compressed chunk of layertap's never is")
            check = blosc_problem if rule.codec == "blosc" else zstd_problem
            problem = check(data.as_numpy_array(), rule.nbytes)
            if problem:
                raise damaged(self.where, rule.name, f"{key}: {problem}")

        def _checked(self, key: str, data: Any, byte_range: Any) -> Any:
            try:
                self._check(key, data, byte_range)
            except StoreError as e:
                found = _FOUND.get()
                if found is None:  # not a read of `_Pipeline` (a write's read of a chunk it completes)
                    raise
                found.append(e)  # raised by the read once its other chunks are in: never decoded
                return None
            return data

        async def get(self, key: str, prototype: Any, byte_range: Any = None) -> Any:
            return self._checked(key, await self._store.get(key, prototype, byte_range), byte_range)

        async def _get_many(self, requests: Iterable[tuple[str, Any, Any]]) -> Any:
            # the wrapper's own hands requests to the inner store unchecked: each goes through `get`
            for key, prototype, byte_range in requests:
                yield key, await self.get(key, prototype, byte_range)

        async def get_partial_values(self, prototype: Any, key_ranges: Iterable[tuple[str, Any]]) -> list[Any]:
            key_ranges = list(key_ranges)
            found = await self._store.get_partial_values(prototype, key_ranges)
            return [self._checked(key, data, byte_range) for (key, byte_range), data in zip(key_ranges, found, strict=True)]

    return CheckedStore


# what a chunk that fails to decode raises (numcodecs' Blosc and Zstd: RuntimeError; gzip: zlib.error,
# EOFError; a chunk of the wrong size: ValueError from NumPy's reshape); not OSError (a disk, a network)
_DECODE_ERRORS = (ValueError, RuntimeError, TypeError, IndexError, EOFError, zlib.error, struct.error)


class _Pipeline:
    """An array's codec pipeline whose reads fail in one `StoreError` line when a chunk does not decode."""

    def __init__(self, inner: Any, where: Location, name: str) -> None:
        self._inner, self._where, self._name = inner, where, name

    def __getattr__(self, attr: str) -> Any:
        return getattr(self._inner, attr)

    async def read(self, *args: Any, **kwargs: Any) -> Any:
        found: list[StoreError] = []
        token = _FOUND.set(found)  # seen by the store's reads, in the tasks this read starts
        try:
            await self._inner.read(*args, **kwargs)
        except StoreError:
            raise
        except _DECODE_ERRORS as e:
            raise damaged(self._where, self._name, f"{type(e).__name__}: {_one_line(e)}") from e
        finally:
            _FOUND.reset(token)
        if found:
            raise found[0]


def checked_array(store: Any, where: Location, name: str, array: Any) -> Any:
    """``array`` (a ``zarr.Array`` of ``store``, a `checked_store`) with its chunks registered
    and its decoding failures made `StoreError`s."""
    if hasattr(store, "expect"):
        store.expect(array.path, chunk_rule(where, name, array))
    inner = array._async_array
    if not isinstance(inner.codec_pipeline, _Pipeline):
        object.__setattr__(inner, "codec_pipeline", _Pipeline(inner.codec_pipeline, where, name))
    return array


# ------------------------------------------------------------------------ what is stored
def stored_indices(store: Any, prefix: str) -> set[int]:
    """The first chunk index of every chunk stored under ``prefix`` (``"ids/c/"``), listed, not
    read: what opening a store costs follows the files it holds, not the shapes it declares."""
    from zarr.core.sync import sync

    async def listed() -> list[str]:
        return [key[len(prefix) :] async for key in store.list_prefix(prefix)]

    return {int(first) for key in sync(listed()) if (first := key.split("/")[0]).isascii() and first.isdigit()}


def stored_markers(store: Any, where: Location, array: Any, name: str) -> dict[int, str]:
    """The chunk markers (one marker a stored chunk) that are written, read from the marker
    files there are only: a marker array declaring many more slots costs nothing."""
    if tuple(array.chunks) != (1,):
        raise _bad(where, f"its chunk markers are stored {array.chunks[0]} to a piece, not one a piece as layertap writes them")
    present = sorted(i for i in stored_indices(store, f"{array.path}/c/") if i < array.shape[0])
    values = array.get_orthogonal_selection(np.array(present, dtype=np.int64)) if present else []
    return {i: str(v) for i, v in zip(present, values, strict=True) if v != ""}
