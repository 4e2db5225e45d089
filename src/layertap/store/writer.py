"""Writing a store: `StoreWriter` writes whole chunks of samples, each handed to the disk before it is marked.

A chunk (``chunk_size`` consecutive samples, the arrays' chunking along samples) is written
whole, handed to the disk (fsync), and only then marked: a store interrupted at any moment
knows which chunks are complete, and is marked complete only when every chunk is. Writing a
chunk touches no other chunk's files, so several processes can fill one Zarr or NumPy store.

A new store is made (`StoreWriter.create`) once the disk is known to hold it: its metadata
first, marked not ready, then its arrays, its ids, and the metadata again, ready. A store whose
writer was killed before that is known as a half-made one of layertap's, made anew by the next
run (`layertap.store.lifecycle`).
"""

from __future__ import annotations

import re
import shutil
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np

from ..atomic import reason
from ..errors import StoreError
from ..records import SkippedSample
from ..units import human_bytes
from .backend import _Backend
from .backends import BACKENDS
from .format import _STORE_VERSION, Marker, StorePlan, _specs, _storable_id, _storage_rows, fill_value
from .lock import StoreLock
from .paths import Location, _bad, _one_line, is_url, location
from .trust import _open_backend, _parse_marker


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
        # called with each chunk's number and rows once it is marked (the token run's statistics)
        self.on_chunk: Callable[[int, Mapping[str, np.ndarray]], None] | None = None

    @classmethod
    def create(cls, path: str | Path, format: str, meta: dict, plan: StorePlan, *, say: Callable[[str], None] = lambda m: None) -> StoreWriter:
        """A new store at ``path`` laid out as ``plan``, once the disk is known to hold it."""
        path = location(path)
        n, chunk_size = plan.num_samples, plan.chunk_size
        if n is None and not BACKENDS[format].GROWS:
            raise StoreError(
                f"the {format} format needs the number of samples before writing, and this data does not say it: "
                "use format='zarr' or 'hdf5', or give data with a length (a Dataset, a list)"
            )
        check_room(path, format, plan, say)
        rows = n or 0
        ids = None if plan.ids is None else [_storable_id(i) for i in (plan.ids[:rows] if n is not None else plan.ids)]
        meta = {
            **meta,
            "layertap_store": _STORE_VERSION,
            "format": format,
            "complete": False,
            "num_samples": n,
            "chunk_size": chunk_size,
            "arrays": [{**asdict(s), "shape": list(s.shape)} for s in plan.specs],
            "ids": "index" if ids is None else "path",
            "labels": plan.labels_dtype,
        }
        backend = BACKENDS[format](path, "w")
        try:
            backend.write_meta({**meta, "ready": False})  # first: a half-made store is known as ours
            for spec in plan.specs:
                dtype = np.dtype(spec.dtype)
                backend.create(spec.path, (rows, *spec.shape), dtype, _storage_rows(chunk_size, spec.sample_bytes), fill_value(dtype))
            if plan.labels_dtype is not None:
                dtype = np.dtype(plan.labels_dtype)
                backend.create("labels", (rows,), dtype, chunk_size, fill_value(dtype))
            backend.create_markers(-(-rows // chunk_size), chunk_size)
            _write_ids(backend, ids, rows, chunk_size)
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
        and leaves the chunk unmarked, to be written again by a resumed run. Then `on_chunk`, if
        set, sees the rows (its failure fails the run, the chunk staying written)."""
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
        if self.on_chunk is not None:
            self.on_chunk(chunk, arrays)

    def _write_error(self, e: OSError | RuntimeError) -> StoreError:
        if not isinstance(e, OSError) and (found := re.search(r"errno = (\d+)", str(e))):  # HDF5's text
            e = OSError(int(found.group(1)), _one_line(e))
        return StoreError(f"cannot write to {self.backend.path}: {reason(e)}; the store stays incomplete: fix that and run the same extraction again to resume")

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



def free_space(path: Location) -> int | None:
    """Free bytes where ``path`` goes; ``None`` for an object store (it does not say)."""
    if is_url(path):
        return None
    path = Path(path).absolute()
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def check_room(path: Location, format: str, plan: StorePlan, say: Callable[[str], None]) -> None:
    """Tell the size a store of ``plan`` takes, and refuse one that the disk has no room for."""
    n, specs = plan.num_samples, plan.specs
    sample_bytes = sum(s.sample_bytes for s in specs)
    ratio = BACKENDS[format].ratio(plan.sample)
    if n is None:
        say(f"writing ~{human_bytes(sample_bytes * ratio)} per sample to {path} ({format}); the number of samples is not known yet")
        return
    need = int(sample_bytes * ratio * n) + n * 8
    free = free_space(path)
    room = "free space unknown" if free is None else f"{human_bytes(free)} free"
    say(f"~{human_bytes(need)} for {n:,} samples × {len(specs)} arrays ({human_bytes(sample_bytes)} per sample) to {path} ({format}); {room}")
    if free is not None and need > free:
        raise StoreError(
            f"the features need ~{human_bytes(need)} but only {human_bytes(free)} is free where {path} goes: free "
            "some space, write elsewhere, or store less (reduce='mean', dtype='float16', fewer layers)"
        )


def _write_ids(backend: _Backend, ids: list[str] | None, rows: int, chunk_size: int) -> None:
    """The ids array: the samples' indices, or their paths as text."""
    dtype, fill = (np.int64, None) if ids is None else backend.text_dtype(max(map(len, ids), default=1))
    backend.create("ids", (rows,), dtype, chunk_size, fill)
    for start in range(0, rows, 1 << 16):  # in pieces: a million paths are no small array
        end = min(rows, start + (1 << 16))
        backend.write("ids", start, np.arange(start, end, dtype=np.int64) if ids is None else np.array(ids[start:end], dtype=dtype))
