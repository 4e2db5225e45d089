"""The writer thread: a batch's features go to pinned host memory, then into whole chunks on disk.

The model computes batch k+1 while the thread writes batch k (`_Sink`); rows that no single batch
covers are gathered into a chunk's buffers until it is whole (`_Chunk`); chunks go through the
store's `layertap.store.StoreWriter`, each one's completion marker after its data.
"""

from __future__ import annotations

import itertools
import queue
import threading
from typing import Any

import numpy as np
import torch

from ..allocator import HeapTrimmer
from ..data import Batch
from ..records import SkippedSample
from ..store.format import ArraySpec, fill_value
from ..store.writer import StoreWriter


def _to_host(arrays: dict[str, torch.Tensor]) -> tuple[dict[str, torch.Tensor], Any]:
    """Start copying device tensors to pinned host memory; the returned CUDA event marks the end.

    On the CPU this is a no-op (the tensors are already where the writer reads them).
    """
    host, copied = {}, False
    for key, t in arrays.items():
        if t.device.type != "cpu":
            pinned = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)  # torch caches pinned blocks
            t, copied = pinned.copy_(t, non_blocking=True), True
        host[key] = t
    if not copied:
        return host, None
    event = torch.cuda.Event()
    event.record()  # after the copies, on the same stream
    return host, event


class _Chunk:
    """The rows of one chunk that no single batch covers, gathered until the chunk is whole.

    Its arrays are reused for the next such chunk: allocating big buffers again and again, in a
    thread, fragments the heap, which would make the process grow with the data.
    """

    def __init__(self, specs: list[ArraySpec], labels_dtype: str | None, length: int) -> None:
        self.arrays = {s.key: np.empty((length, *s.shape), dtype=s.dtype) for s in specs}
        self.labels = None if labels_dtype is None else np.empty(length, dtype=labels_dtype)
        self.digests: list[str] = [""] * length
        self.length = length
        self.reset()

    def reset(self) -> None:
        self.count = 0
        self.failed: list[SkippedSample] = []

    def put(self, at: np.ndarray, arrays: dict[str, np.ndarray], rows: slice, labels: np.ndarray | None, digests: list[str]) -> None:
        for key, a in arrays.items():
            self.arrays[key][at] = a[rows]
        if self.labels is not None:
            self.labels[at] = labels[rows] if labels is not None else fill_value(self.labels.dtype)
        for i, digest in zip(at.tolist(), digests[rows]):
            self.digests[i] = digest
        self.count += len(at)

    def fail(self, at: int, failure: SkippedSample, digest: str) -> None:
        for a in self.arrays.values():
            a[at] = fill_value(a.dtype)
        if self.labels is not None:
            self.labels[at] = fill_value(self.labels.dtype)
        self.digests[at] = digest
        self.failed.append(failure)
        self.count += 1


class _Sink:
    """Writes features from a background thread: rows go into whole chunks, chunks onto disk.

    A batch is handed over only when the thread is idle, so while it writes batch k the model
    computes batch k+1, and no more than those two are ever held, whatever the size of the data
    and the speed of the disk. A failure in the thread is raised in the caller at its next
    `put` or at `close`.
    """

    def __init__(self, writer: StoreWriter) -> None:
        self.writer = writer
        self.chunks: dict[int, _Chunk] = {}
        self.spare: _Chunk | None = None  # a written chunk's buffers, for the next one
        self.error: BaseException | None = None
        self.queue: queue.SimpleQueue = queue.SimpleQueue()
        self.idle = threading.Semaphore(1)
        self.trim = HeapTrimmer()
        self.thread = threading.Thread(target=self._run, name="layertap-writer", daemon=True)
        self.thread.start()

    def put(self, batch: Batch, arrays: dict[str, torch.Tensor], digests: list[str], failed: list[str]) -> None:
        """Hand over a batch's features with its samples' digests (readable, then failed ones)."""
        host, event = _to_host(arrays)  # on a GPU the copy runs while we wait
        self.idle.acquire()  # released by the writer after each batch, even one that failed
        if self.error is not None:
            raise self.error
        self.queue.put((batch.index, host, batch.labels, list(zip(batch.failed, failed)), digests, event))

    def _run(self) -> None:
        while (item := self.queue.get()) is not None:
            nbytes = sum(t.nbytes for t in item[1].values())
            try:
                if self.error is None:
                    self._add(*item)
            except BaseException as e:
                self.error = e
            finally:
                del item
                self.trim(nbytes)
                self.idle.release()

    def _chunk(self, c: int) -> _Chunk:
        if c not in self.chunks:
            start, end = self.writer.chunk_range(c)
            spare, self.spare = self.spare, None
            if spare is None or spare.length != end - start:
                spare = _Chunk(self.writer.specs, self.writer.meta["labels"], end - start)
            spare.reset()
            self.chunks[c] = spare
        return self.chunks[c]

    def _add(self, index: np.ndarray, host: dict, labels: torch.Tensor | None, failed: list[tuple[SkippedSample, str]], digests: list[str], event: Any) -> None:
        if event is not None:
            event.synchronize()
        arrays = {k: t.numpy() for k, t in host.items()}
        label_array = labels.numpy() if labels is not None else None
        size = self.writer.chunk_size
        touched = set()
        if len(index):
            chunk_of = index // size
            cuts = [0, *(np.flatnonzero(np.diff(chunk_of)) + 1).tolist(), len(index)]
            for lo, hi in itertools.pairwise(cuts):
                c = int(chunk_of[lo])
                start, end = self.writer.chunk_range(c)
                rows = slice(lo, hi)
                if c not in self.chunks and hi - lo == end - start:  # the whole chunk: write it as it is
                    part = None if label_array is None else label_array[rows]
                    self.writer.write_chunk(c, {k: a[rows] for k, a in arrays.items()}, part, [], digests[rows])
                    continue
                self._chunk(c).put(index[rows] - start, arrays, rows, label_array, digests)
                touched.add(c)
        for f, digest in failed:
            c = f.index // size
            self._chunk(c).fail(f.index - c * size, f, digest)
            touched.add(c)
        for c in sorted(touched):
            if self.chunks[c].count == self.chunks[c].length:
                self._write(c, self.chunks[c].length)

    def _write(self, c: int, rows: int) -> None:
        chunk = self.chunks.pop(c)
        labels = None if chunk.labels is None else chunk.labels[:rows]
        self.writer.write_chunk(c, {k: a[:rows] for k, a in chunk.arrays.items()}, labels, chunk.failed, chunk.digests[:rows])
        self.spare = chunk

    def close(self, end: int | None) -> None:
        """Write what is queued; ``end``: the data ended there, so its last chunk is complete.

        ``end=None`` (the run failed): whole chunks are written, a partial one is dropped.
        """
        self.queue.put(None)
        self.thread.join()
        if self.error is not None:
            raise self.error
        if end is not None:
            for c, chunk in list(self.chunks.items()):
                if chunk.count == end - c * self.writer.chunk_size:  # the data's last chunk, of unknown length
                    self._write(c, chunk.count)
