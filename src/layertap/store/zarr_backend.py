"""Zarr stores (the default format): every file written atomically, through fsspec for a URL, and
read only through the checked store of `layertap.store.chunks`."""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ..atomic import sync_path
from ..errors import require
from .backend import _Backend
from .chunks import checked_array, checked_store, stored_indices, stored_markers
from .format import _LOCK, _ZARR_HALF_META, _Codec
from .paths import Location, _bad, _check_no_links_out, _names, _one_line, is_url, url_failed, url_fs

_ZARR_META = re.compile(rf"zarr\.json|{_ZARR_HALF_META.pattern}")  # a partial file: one Zarr was writing
_ZARR_PARTIAL = re.compile(r"[0-9]+\.[0-9a-f]{32}\.partial")
# plain data (no pickle), and no compressor whose chunks cannot be bounded before they inflate
# (gzip: a 9 MB chunk inflated to 2 GiB, 8.4 GB of memory at its peak); layertap writes Blosc and Zstandard
_ZARR_CODECS = {"bytes", "blosc", "vlen-utf8", "zstd", "crc32c", "transpose"}


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
                raise _bad(
                    self.path,
                    f"array {name!r} uses codecs {sorted(map(str, codecs - _ZARR_CODECS))}, which layertap does not read (plain data "
                    "whose chunks it can bound before they inflate: Blosc, Zstandard)",
                )
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
