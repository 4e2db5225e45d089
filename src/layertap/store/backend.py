"""A format's backend: the primitive reads and writes of one store format (`layertap.store.backends`
lists them). Every format is a subclass, in a file of its own."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

import numpy as np

from .paths import Location, _foreign_entries, _names


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
