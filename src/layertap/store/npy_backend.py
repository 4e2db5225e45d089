"""NumPy stores: a folder of ``.npy`` files written in place with ``pwrite``, read as memory maps."""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import StoreError
from .backend import _Backend
from .format import _LOCK, _NPY_HALF_META, _NPY_META
from .paths import Location, _bad, _check_inside, _check_no_links_out, _one_line


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
