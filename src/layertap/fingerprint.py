"""Content fingerprints of samples: how a resumed extraction proves its data is what it was.

A store's settings name its samples (their ids), but a file can be replaced under the same
name. So every chunk's completion marker records a short digest of each of its samples'
inputs, and a resumed run recomputes the digests of the chunks already written before adding
to them; the first sample that differs stops it.

- Image files (a folder): the digest of the file's bytes. Checking needs no decoding, only a
  read: cheap next to the forward passes of the chunks still to do.
- Any other data (tensors, arrays, Datasets, streams): the digest of the sample's row of the
  collated batch (every input tensor and the label), as the model received it.

A digest is 16 hex digits of SHA-256: two different samples get the same by chance with odds of
about 1 in 10^19.

>>> import torch
>>> from layertap.data import open_data
>>> source = open_data(torch.arange(6.0).reshape(3, 2), batch_size=3)
>>> digests = batch_digests(source, next(source.batches()))
>>> len(digests), digests[0] != digests[1]
(3, True)
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np
import torch

from . import nested
from .data import Batch, DataSource, Failure
from .errors import DataChangedError

FAILED = "failed"  # the digest of a sample that could not be read (data other than files)
MISSING = "missing"  # the digest of a file that is gone or unreadable


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    except OSError:
        return MISSING
    return digest.hexdigest()[:16]


def _files(source: DataSource) -> bool:
    """Whether the source's samples are files under its root (an image folder)."""
    return source.root is not None and source.ids is not None


def _row_digests(tensors: Sequence[torch.Tensor], n: int) -> list[str]:
    """The digest of each of ``n`` rows across ``tensors`` (all batch first)."""
    digests = [hashlib.sha256() for _ in range(n)]
    for t in tensors:
        head = f"{t.dtype}{tuple(t.shape[1:])};".encode()
        rows = t.detach().cpu().contiguous().reshape(n, -1).view(torch.uint8).numpy()
        for digest, row in zip(digests, rows):
            digest.update(head)
            digest.update(row)
    return [d.hexdigest()[:16] for d in digests]


def batch_digests(source: DataSource, batch: Batch) -> list[str]:
    """The digest of every readable sample of ``batch``, in batch order."""
    if _files(source):
        return [_file_digest(source.root / source.id_of(i)) for i in batch.index]
    tensors = nested.tensors(batch.inputs) + ([batch.labels] if batch.labels is not None else [])
    return _row_digests(tensors, len(batch))


def failed_digests(source: DataSource, failed: Iterable[Failure]) -> list[str]:
    """The digests of samples that could not be read: a file's bytes still have one."""
    if _files(source):
        return [_file_digest(source.root / source.id_of(f.index)) for f in failed]
    return [FAILED for _ in failed]


class Verifier:
    """Compares samples with the digests that a store's markers recorded for them.

    Args:
        recorded: for each written chunk, the digest of each of its samples.
        chunk_size: samples per chunk.
    """

    def __init__(self, recorded: Mapping[int, Sequence[str]], chunk_size: int, source: DataSource, store: str) -> None:
        self.recorded, self.chunk_size, self.source, self.store = recorded, chunk_size, source, store

    def check(self, index: Iterable[int], digests: Iterable[str]) -> None:
        """Raise `DataChangedError` at the first sample whose digest is not the recorded one."""
        for i, digest in zip(index, digests):
            chunk, row = divmod(int(i), self.chunk_size)
            expected = self.recorded.get(chunk)
            if expected is not None and (row >= len(expected) or expected[row] != digest):
                raise DataChangedError(
                    f"sample {self.source.id_of(int(i))!r} is not what {self.store} was written from (its content "
                    "changed since), so its features would not match: restore the data, or pass overwrite=True "
                    "(--overwrite) to extract everything again"
                )

    def check_all(self) -> None:
        """Check every recorded chunk against the data (data that can be read by index only)."""
        shard = np.concatenate(
            [np.arange(c * self.chunk_size, c * self.chunk_size + len(d), dtype=np.int64) for c, d in sorted(self.recorded.items())]
            or [np.zeros(0, dtype=np.int64)]
        )
        if _files(self.source):  # the bytes of the files: no decoding
            self.check(shard, (_file_digest(self.source.root / self.source.id_of(int(i))) for i in shard))
            return
        for batch in self.source.batches(shard):
            self.check(batch.index, batch_digests(self.source, batch))
            self.check([f.index for f in batch.failed], failed_digests(self.source, batch.failed))


__all__ = ["Verifier", "batch_digests", "failed_digests"]
