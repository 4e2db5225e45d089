"""Dataset-scale extraction: run a model over a whole dataset and stream layers' features to disk.

How it stays as fast as the model and as small as one batch:

- one `layertap.tap` is kept for the whole run with ``stop_early=True``, so the network runs only
  up to the last chosen layer, and ``reduce``/``dtype`` shrink features on the device;
- on a GPU, features are copied to the host without blocking, into pinned memory; a background
  thread assembles rows into whole chunks and writes them while the model runs the next batch,
  and takes a new batch only when idle: two batches at most are held, whatever the data;
- chunks are a whole number of batches, so a resumed run cuts the same batches as a full one;
  each chunk's completion marker is written after its data (see `layertap.store`);
- under ``torchrun`` the chunks still to write are dealt out to the processes in turn, and each
  writes its own into the one store (see `layertap.distributed`).

>>> import os, tempfile, torch, torchvision, layertap
>>> model = torchvision.models.resnet18()
>>> data = torch.utils.data.TensorDataset(torch.randn(8, 3, 64, 64), torch.arange(8))
>>> out = os.path.join(tempfile.mkdtemp(), "features.zarr")
>>> store = layertap.extract_dataset(model, data, ["layer3", "avgpool"], out, reduce="mean", progress=False)
>>> store["layer3"].shape, store.labels.tolist()[:3]
((8, 256), [0, 1, 2])
"""

from __future__ import annotations

import contextlib
import datetime
import functools
import hashlib
import itertools
import json
import queue
import re
import threading
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from .. import nested
from ..allocator import HeapTrimmer
from ..data import Batch, DataSource, OnError, open_data
from ..distributed import Processes, job, launched, rank_device
from ..errors import DataChangedError
from ..loading import model_info
from ..progress import progress_bar, say
from ..records import SkippedSample
from ..runtime import explain_failures, place_model, run_model
from ..select import Layers, select
from ..store import (
    ArraySpec,
    FeatureStore,
    Layout,
    Location,
    StoreError,
    StoreWriter,
    array_key,
    array_specs,
    fill_value,
    format_for,
    location,
    open_or_create,
    settings_differences,
)
from ..tap import Tap, tap
from ..tap.controls import Reduce, as_dtype, reducer
from .digests import Verifier, batch_digests, code_fingerprint, failed_digests, model_fingerprint

Verify = Literal["close", "exact", "off"]
CHUNK_BYTES = 16 << 20  # aim for chunks of about this size (all layers together)
MAX_CHUNK = 4096  # samples: also the granularity of resuming


# ----------------------------------------------------------------------------------- settings
def _describe(obj: Any) -> str | None:
    """A reduction or transform, for people and for comparing: its name (or repr, without
    addresses) and the fingerprint of its code and values (see `layertap.extract.digests`)."""
    if obj is None or isinstance(obj, str):
        return obj
    name = getattr(obj, "__qualname__", None)
    text = f"{getattr(obj, '__module__', '')}.{name}" if name else repr(obj)
    return f"{re.sub(r' at 0x[0-9a-fA-F]+', '', text)} (code {code_fingerprint(obj)})"


def _ids_digest(source: DataSource) -> str | None:
    if source.ids is None:
        return None
    digest = hashlib.sha256()
    for i in source.ids:
        # a file name that is not UTF-8 (surrogate-escaped by the OS) is hashed as its own bytes
        digest.update(f"{i}\0".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()[:16]


def _settings(model: nn.Module, names: list[str], reduce: Reduce, dtype: torch.dtype | None, source: DataSource) -> dict:
    """What determines the store's contents: a resumed run must match it exactly."""
    settings = {
        "model": model_fingerprint(model),
        "layers": names,
        "reduce": _describe(reduce),
        "dtype": str(dtype) if dtype is not None else None,
        "num_samples": source.num_samples,
        "ids": _ids_digest(source),
        "transform": _describe(source.transform),
    }
    return json.loads(json.dumps(settings))


def _numpy_dtype(dtype: torch.dtype) -> str:
    return str(torch.empty(0, dtype=dtype).numpy().dtype)


# ------------------------------------------------------------------------------ the forward
Leaves = dict[tuple[str, int | None], torch.Tensor]  # {(layer, leaf index or None): tensor}


class _Forward:
    """The model under one tap, batch after batch: ``{(layer, leaf index or None): tensor}``.

    Each output is stored one row per sample, so its batch dimension must be the first. That is
    known, not guessed: a leaf whose first size is not the batch's is refused; one where the
    batch size also appears in another dimension (a ``[T, B, H]`` output with ``T == B``) is run
    once more on a batch of another size, to see which dimension follows it. Under a
    ``reduce=``, that is decided on the layers' raw outputs, which the reduction sees first: it
    may pool the batch away (``"mean"`` of a ``[T, B, H]`` output is ``[T, H]``), leaving a first
    size that only equals the batch's.
    """

    def __init__(self, model: nn.Module, names: list[str], reduce: Reduce, dtype: torch.dtype | None, device: torch.device) -> None:
        self.model, self.names, self.device = model, names, device
        pool = reducer(reduce)
        self.reduced = pool is not None
        self.raw: list[torch.Size] | None = [] if pool is not None else None  # shapes the reduction saw, until proven

        def reduce_recording(t: torch.Tensor) -> torch.Tensor:
            if self.raw is not None:
                self.raw.append(t.shape)
            assert pool is not None
            return pool(t)

        # one Tap, entered per batch: it learns once which values need copying (see layertap.tap)
        self.tap: Tap = tap(model, names, reduce=reduce_recording if pool is not None else None, dtype=dtype, stop_early=True)
        self.batch_first: set[tuple[str, int | None]] = set()  # the leaves proven batch-first

    def __call__(self, inputs: Any, n: int) -> Leaves:
        inputs = nested.map_leaves(lambda t: t.to(self.device, non_blocking=True), inputs)
        leaves = self._run(inputs)
        for key, t in leaves.items():
            if t.dim() == 0 or t.shape[0] != n:
                raise _not_batch_first(key, t.shape, n, [d for d, size in enumerate(t.shape) if size == n])
        # which reduced leaf a raw output became is not known: one not plainly batch-first makes all unsure
        pooled = any(len(s) == 0 or s[0] != n or n in s[1:] for s in self.raw or ())
        if unsure := [k for k, t in leaves.items() if k not in self.batch_first and (pooled or n in t.shape[1:])]:
            self._probe(inputs, n, {k: leaves[k].shape for k in unsure})
        self.batch_first.update(leaves)
        self.raw = None  # every leaf proven: the reduction need not be watched again
        return leaves

    def _run(self, inputs: Any) -> Leaves:
        with torch.no_grad(), explain_failures(self.model), self.tap:
            run_model(self.model, inputs)
        leaves = {}
        for name in self.names:
            value = self.tap[name]
            for i, t in enumerate(nested.tensors(value)):
                if t.dtype == torch.bfloat16:  # NumPy has no bfloat16: stored as float32, exactly
                    t = t.float()
                leaves[(name, None if isinstance(value, torch.Tensor) else i)] = t
        return leaves

    def _probe(self, inputs: Any, n: int, shapes: dict[tuple[str, int | None], torch.Size]) -> None:
        """Find the batch dimension of ``shapes`` (of a batch of ``n``) from a batch of another size:
        the dimension that follows the batch size is the batch's."""
        m = n - 1 if n > 2 else n + 1  # never 1 from more: a model may squeeze a batch of one
        rows = torch.arange(m, device=self.device) % n
        try:
            other = self._run(nested.map_leaves(lambda t: t[rows], inputs))
        except Exception as e:
            key, shape = next(iter(shapes.items()))
            raise StoreError(
                f"{_leaf_name(key)} has shape {list(shape)}, with the batch size {n} in several dimensions, and a batch of "
                f"{m} to tell which is the batch failed ({type(e).__name__}: {e}): choose a batch_size that no other "
                "dimension of the output has"
            ) from e
        for key, shape in shapes.items():
            got = other[key].shape
            follows = [d for d, (a, b) in enumerate(zip(shape, got)) if a == n and b == m]
            if len(got) != len(shape) or any(a != b for d, (a, b) in enumerate(zip(shape, got)) if d not in follows) or not follows:
                reduced = " (after reduce=)" if self.reduced else ""
                raise StoreError(
                    f"{_leaf_name(key)} has shape {list(shape)}{reduced} for a batch of {n} and {list(got)} for {m}, so no "
                    "dimension is the batch's: build the layer batch-first (e.g. batch_first=True), tap another layer, or "
                    "reduce it with a callable that returns [batch, ...]"
                )
            if 0 not in follows:
                raise _not_batch_first(key, shape, n, follows)


def _leaf_name(key: tuple[str, int | None]) -> str:
    name, leaf = key
    return f"layer {name!r}'s output" if leaf is None else f"tensor {leaf} of layer {name!r}'s output"


def _not_batch_first(key: tuple[str, int | None], shape: torch.Size | tuple[int, ...], n: int, batch_dims: list[int]) -> StoreError:
    where = f"its batch of {n} is dimension {batch_dims[0]}" if batch_dims else f"no dimension is its batch of {n}"
    return StoreError(
        f"{_leaf_name(key)} has shape {list(shape)}: {where}, not the first, and only batch-first outputs can be stored "
        "per sample: build the layer batch-first (e.g. batch_first=True for nn.LSTM, nn.GRU, nn.MultiheadAttention, "
        "nn.TransformerEncoderLayer), tap another layer, or reduce it with a callable that returns [batch, ...], "
        "e.g. reduce=lambda t: t.transpose(0, 1)"
    )


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


# ------------------------------------------------------------------------------ the writer
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


# ------------------------------------------------------------------------------- the run
def _chunk_size(batch: int, sample_bytes: int, chunk_size: int | None, num_samples: int | None = None, processes: int = 1) -> int:
    """Samples per chunk: whole batches, about `CHUNK_BYTES`; with several processes, small enough
    that each gets a few chunks (chunks are what they share, and a few each end them together)."""
    if chunk_size is not None:
        return chunk_size
    batches = max(1, CHUNK_BYTES // max(1, batch * sample_bytes))
    size = min(MAX_CHUNK // batch * batch, batch * batches)
    if processes > 1 and num_samples:
        size = min(size, num_samples // (4 * processes) // batch * batch)
    return max(batch, size)


def _plan(writer: StoreWriter, done: Iterable[int], rank: int = 0, world: int = 1) -> np.ndarray | None:
    """The samples of the chunks not ``done`` that process ``rank`` of ``world`` takes: the missing
    chunks are dealt out in turn, so processes never share a chunk and get as many as one another.
    ``None`` when the data's length is unknown (it is read through)."""
    if writer.num_samples is None:
        return None
    size, n, done = writer.chunk_size, writer.num_samples, set(done)
    missing = [c for c in range(-(-n // size)) if c not in done][rank::world]
    parts = [np.arange(c * size, min(n, (c + 1) * size), dtype=np.int64) for c in missing]
    return np.concatenate(parts) if parts else np.zeros(0, dtype=np.int64)


def _versions(format: str) -> dict:
    from importlib import metadata

    versions = {"torch": torch.__version__, "numpy": np.__version__}
    for package in ("layertap", {"zarr": "zarr", "hdf5": "h5py", "npy": "numpy"}[format]):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    return versions


def extract_dataset(
    model: nn.Module,
    data: Any,
    layers: Layers,
    out: str | Path,
    *,
    reduce: Reduce = None,
    dtype: torch.dtype | str | None = None,
    batch_size: int = 64,
    num_workers: int | None = None,
    device: torch.device | str | None = None,
    format: str | None = None,
    resume: bool = True,
    overwrite: bool = False,
    on_error: OnError = "fail",
    progress: bool = True,
    transform: Callable[[Any], Any] | None = None,
    chunk_size: int | None = None,
    limit: int | None = None,
    distributed: bool = True,
    max_image_pixels: int | None = None,
    verify: Verify = "close",
) -> FeatureStore:
    """Run ``model`` over all of ``data`` and write the features of ``layers`` to ``out``.

    Args:
        data: an image folder or file, a ``.npy`` array, a Dataset, a DataLoader (not
            shuffled), a tensor of samples or an iterable of batches (see `layertap.data`).
            Samples may be ``(input, label)`` pairs or bare inputs.
        layers: names, globs, regexes, classes or predicates (see `layertap.select`); unknown
            layers fail before any work. A layer whose output holds several tensors gets one
            array per tensor, ``"<layer>/0"``, ``"<layer>/1"``, ...
        out: the store: a Zarr folder (default), an HDF5 file (``.h5``/``.hdf5``) or a folder
            of ``.npy`` files (``format="npy"``); or an fsspec URL of a Zarr store in an object
            store (``"s3://bucket/feats.zarr"``, with that protocol's fsspec package installed).
        reduce, dtype: applied on the device before anything is copied (see `layertap.tap`);
            bfloat16 features are stored as float32 (NumPy has no bfloat16).
        batch_size, num_workers, transform: how ``data`` is read (a DataLoader keeps its own);
            image files default to the model's preprocessing (`layertap.model_info`).
        device: where to run; the model is moved there. Default: where its weights are.
        format: ``"zarr"``, ``"hdf5"`` or ``"npy"``; default from ``out``'s suffix, else Zarr.
        resume: continue the interrupted run that wrote ``out`` with the same settings (its
            missing chunks only), after checking that the samples of its written chunks are
            the same, content and all (see `layertap.extract.digests`). Different settings or data,
            or ``resume=False``, are an error unless ``overwrite=True``, which replaces the
            store, removing only what layertap wrote (a store folder that also holds other
            files is refused, naming them). One extraction writes a store at a time: another one
            running on ``out`` is an error naming it (`layertap.errors.StoreLockedError`).
        verify: before a resumed run writes anything, it recomputes written batches (the first
            of the first and of the last written chunk) and compares them with the stored rows:
            ``"close"`` within 1e-4 of each feature's largest value, or of 1e-3 of the array's if
            more (1e-2 for 16-bit features or models), ``"exact"``
            bit for bit (the same machine, libraries and threads), or ``"off"``. A difference is
            a `layertap.errors.DataChangedError` naming the first array that differs and by how
            much: something the settings' fingerprints do not see changed (an edited
            ``forward``, a library, a kernel).
        on_error: an unreadable image stops the run naming it (``"fail"``) or is recorded in
            the store's ``failed`` list, its rows NaN (``"skip"``).
        progress: print the size estimate and show a progress bar (in a terminal or a notebook;
            see `layertap.progress`).
        chunk_size: samples per chunk (default: whole batches, about 16 MB); the unit of
            writing and of resuming.
        limit: only the first ``limit`` samples.
        max_image_pixels: the largest image (in pixels) read from files; ``None``: Pillow's limit
            against decompression bombs, ``0``: none. A larger image fails as a bad image does.
        distributed: under ``torchrun`` (``WORLD_SIZE`` > 1), share the work with the job's
            other processes, which must all make this same call (see `layertap.distributed`).
            ``False``: this process extracts alone, e.g. on rank 0 of a training job.

    Returns:
        the finished store, opened for reading (`layertap.open_features`).

    The disk size is estimated from the first batch and printed; a run that would not fit
    stops before writing anything.
    """
    names = select(model, layers)  # unknown layers fail here, before any work
    if verify not in ("close", "exact", "off"):
        raise ValueError(f"verify must be 'close', 'exact' or 'off', not {verify!r}")
    reducer(reduce)
    dtype = as_dtype(dtype)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    out = location(out)
    fmt = format_for(out, format)
    _, world, local_rank = launched() if distributed else (0, 1, 0)
    if world > 1 and fmt == "hdf5":
        raise StoreError(
            f"{world} processes cannot write one HDF5 file ({out}): HDF5 takes one writer at a time. Write "
            "Zarr (the default: --out feats.zarr), or npy; both take a writer per process"
        )
    if world > 1 and str(out).startswith("memory://"):
        raise StoreError(f"{out} is in this process's memory, which the other {world - 1} processes cannot see: write to a shared folder or an object store")
    device = rank_device(device, local_rank, world)
    run_device = place_model(model, device)
    info = model_info(model)
    transform = transform or info.transform
    source = open_data(
        data,
        batch_size=batch_size,
        num_workers=num_workers,
        transform=transform,
        on_error=on_error,
        limit=limit,
        pin_memory=run_device.type == "cuda",
        max_image_pixels=max_image_pixels,
    )
    if source.num_samples == 0:
        raise StoreError(f"{source.description} holds no samples")
    if world > 1 and not source.indexed:
        raise StoreError(
            f"{source.description} can only be read in order, so {world} processes cannot share it out: "
            "give a Dataset, a DataLoader over one, an image folder or a .npy array"
        )
    with job(device, together=distributed) as procs:
        settings = _settings(model, names, reduce, dtype, source)
        _check_same_everywhere(procs, settings)
        meta = {
            "model": info.spec or type(model).__name__,
            **{k: settings[k] for k in ("layers", "reduce", "dtype")},
            "data": source.description,
            "root": str(source.root) if source.root is not None else None,
            "classes": source.classes,
            "settings": settings,
            "settings_hash": hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16],
            "versions": _versions(fmt),
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        forward = _Forward(model, names, reduce, dtype, run_device)
        run = _Run(forward, source, out, format, meta, progress, chunk_size, procs, verify=verify, rtol=_tolerance(verify, model, dtype))
        try:
            run.extract(resume=resume, overwrite=overwrite)
        finally:
            if run.writer is not None:
                run.writer.close()
    return FeatureStore(out)


def _tolerance(verify: Verify, model: nn.Module, dtype: torch.dtype | None) -> float:
    """How far recomputed rows may be from stored ones, as a fraction of each feature's largest
    value (see `_difference`)."""
    if verify == "exact":
        return 0.0
    half = (torch.float16, torch.bfloat16)
    return 1e-2 if dtype in half or any(p.dtype in half for p in model.parameters()) else 1e-4


def _check_same_everywhere(procs: Processes, settings: dict) -> None:
    """Refuse a job whose processes would write different things into one store: every process
    compares all the settings (the model's full fingerprint among them), before the first
    batch, and all raise the same one-line error."""
    every = procs.gather(settings)
    others = [rank for rank, theirs in enumerate(every) if theirs != every[0]]
    if others:
        changed = settings_differences(every[0], every[others[0]], " vs ")
        ranks = ", ".join(map(str, others))
        raise StoreError(
            f"rank{'s' if len(others) > 1 else ''} {ranks} of {procs.world} {'have' if len(others) > 1 else 'has'} other settings "
            f"than rank 0: {changed}: every process must load the same model (seed random weights) and read the same data"
        )


Computed = tuple[Batch, Leaves]  # a batch and its features


class _Run:
    """One extraction: open or create the store, check what it holds, run the missing batches.

    With several processes, rank 0 alone opens (locks), checks, creates and finishes the
    store; each process writes the chunks dealt to it.
    """

    def __init__(
        self,
        forward: _Forward,
        source: DataSource,
        out: Location,
        format: str | None,
        meta: dict,
        progress: bool,
        chunk_size: int | None,
        procs: Processes,
        *,
        verify: Verify = "close",
        rtol: float = 1e-4,
    ) -> None:
        self.forward, self.source, self.out, self.format, self.meta = forward, source, out, format, meta
        self.chunk_size, self.procs = chunk_size, procs
        self.progress = progress and procs.main  # one bar and one voice per job
        self.writer: StoreWriter | None = None
        self.read_first: list[Computed] = []  # batches read to lay out a new store, still to write
        self.reader: Iterator[Computed] | None = None  # the run's batches, when reading them began there
        self.end = 0  # where the data read so far ended (for data of unknown length)
        self.verify, self.rtol = verify, rtol  # how a resume recomputes a written batch, and within what
        self.to_recompute: list[int] = []  # the written chunks whose first batch a resume computes again

    @property
    def store(self) -> StoreWriter:
        """The writer, once `_start` (rank 0) or `_open` (the others) made it."""
        assert self.writer is not None
        return self.writer

    def extract(self, *, resume: bool, overwrite: bool) -> None:
        procs = self.procs
        state = procs.share(lambda: self._start(resume, overwrite))
        if state == "complete":
            say(f"{self.out} is already complete", self.progress)
            return
        procs.together(self._open)  # rank 0 made or checked it; the others open it
        store = self.store
        store.process = procs.rank
        # one view of the chunks done, taken before any process writes, so the plans agree
        done = procs.share(lambda: sorted(store.done()))
        verifier = None
        if state == "resume":
            say(f"resuming {self.out}: {len(done)} of {store.num_chunks or '?'} chunks already written", self.progress)
            # the first batch of the first and of the last written chunk: two ends of what was
            # written, so a change that shows only on some data has two chances to show
            self.to_recompute = sorted({done[0], done[-1]}) if done and self.verify != "off" else []
            recorded = {c: m.digests for c, m in store.markers().items() if m.digests is not None}
            verifier = Verifier(recorded, store.chunk_size, self.source, str(self.out))
            if self.source.indexed:  # a stream is checked as it is read again
                procs.share(verifier.check_all)
                for chunk in list(self.to_recompute):  # each is crossed off when compared
                    procs.share(functools.partial(self._recompute, chunk))
        end = procs.together(lambda: self._batches(done, verifier))
        procs.share(lambda: store.finish(self.source.num_samples or end))

    def _open(self) -> None:
        if self.writer is not None:
            return
        try:
            self.writer = StoreWriter.open(self.out)
        except StoreError as e:
            raise StoreError(
                f"{e}, though rank 0 made or found one there: every process must reach the same store, in a "
                "folder that all machines share (with the same path) or at an object-store URL"
            ) from e

    def _start(self, resume: bool, overwrite: bool) -> str:
        """On rank 0: lock the store, then ``"complete"``, ``"resume"`` or ``"new"``."""
        self.writer = open_or_create(
            self.out, self.format, self.meta, resume=resume, overwrite=overwrite, layout=self._layout, say=lambda m: say(m, self.progress)
        )
        return self.writer.state

    def _layout(self) -> Layout:
        """A new store's arrays, from the first readable features: alone, the first batches of
        the run itself (read once); with other processes, a probe of two samples."""
        if self.procs.world == 1:
            reader = self._read(None, [], None)
            for batch, leaves in reader:
                self.read_first.append((batch, leaves))
                if leaves:
                    self.reader = itertools.chain(self.read_first, reader)
                    return self._layout_of(batch, leaves)
            raise self._unreadable([f for b, _ in self.read_first for f in b.failed])
        return self._layout_of(*self._probe())

    def _probe(self) -> Computed:
        """The features of the first two readable samples: the store's shapes, before the real run."""
        n = self.source.num_samples
        assert n is not None  # several processes share indexed data only, whose length is known
        failed: list[SkippedSample] = []
        for shard in (np.arange(min(2, n)), np.arange(min(2, n), n)):
            for batch in self.source.batches(shard):
                if len(batch):
                    batch = batch.take(np.arange(min(2, len(batch))))
                    return batch, self.forward(batch.inputs, len(batch))
                failed += batch.failed
        raise self._unreadable(failed)

    def _unreadable(self, failed: list[SkippedSample]) -> StoreError:
        first = f", first {failed[0].id}: {failed[0].error}" if failed else ""
        return StoreError(f"no sample of {self.source.description} could be read ({len(failed)} failed{first})")

    def _layout_of(self, batch: Batch, leaves: dict[tuple[str, int | None], torch.Tensor]) -> Layout:
        specs = array_specs([(*k, tuple(t.shape[1:]), _numpy_dtype(t.dtype)) for k, t in leaves.items()])
        size = _chunk_size(
            self.source.batch_size or len(batch) + len(batch.failed),
            sum(s.sample_bytes for s in specs),
            self.chunk_size,
            self.source.num_samples,
            self.procs.world,
        )
        return Layout(
            specs,
            self.source.num_samples,
            size,
            self.source.ids,
            None if batch.labels is None else str(batch.labels.numpy().dtype),
            {array_key(*k): t.detach().cpu().numpy() for k, t in leaves.items()},
        )

    def _read(self, shard: np.ndarray | None, done: list[int], verifier: Verifier | None) -> Iterator[Computed]:
        """The batches of ``shard`` with their features. Data read in order (``shard=None``) skips
        the rows of chunks ``done`` before, after checking them against the store."""
        for batch in self.source.batches(shard):
            self.end = max(self.end, *(int(i) + 1 for i in batch.index[-1:]), *(f.index + 1 for f in batch.failed))
            if done and shard is None:
                written = np.isin(batch.index // self.store.chunk_size, done)
                if verifier is not None and written.any():
                    old = batch.take(np.flatnonzero(written))
                    verifier.check(old.index, batch_digests(self.source, old))
                    if len(old) and int(old.index[0]) // self.store.chunk_size in self.to_recompute:
                        self._compare(old)
                batch = batch.take(np.flatnonzero(~written))
            yield batch, (self.forward(batch.inputs, len(batch)) if len(batch) else {})

    def _batches(self, done: list[int], verifier: Verifier | None) -> int:
        """Run the batches of this process's chunks into the store; where the data ended."""
        # data read in order is read through, its written chunks checked as they pass (see `_read`)
        shard = _plan(self.store, done, self.procs.rank, self.procs.world) if self.source.indexed else None
        reader = self.reader or self._read(shard, done, verifier)
        total = len(shard) if shard is not None else self.source.num_samples and self.source.num_samples - sum(self._rows(c) for c in done)
        bar = progress_bar(total, desc="extract", unit="sample", enabled=self.progress)
        sink = _Sink(self.store)
        try:
            for batch, leaves in reader:
                arrays = {array_key(*k): t for k, t in leaves.items()}
                if arrays:
                    self._check(arrays, batch)
                if arrays or batch.failed:
                    digests = batch_digests(self.source, batch) if len(batch) else []
                    sink.put(batch, arrays, digests, failed_digests(self.source, batch.failed))
                bar.update(len(batch) + len(batch.failed))
        except BaseException:
            with contextlib.suppress(BaseException):
                sink.close(None)  # keep every whole chunk done so far
            raise
        else:
            sink.close(self.end)
        finally:
            self.read_first.clear()
            bar.close()
        return self.end

    def _rows(self, chunk: int) -> int:
        start, end = self.store.chunk_range(chunk)
        return end - start

    def _recompute(self, chunk: int) -> None:
        """Recompute the first batch of written ``chunk`` and compare it with its stored rows."""
        start, _ = self.store.chunk_range(chunk)
        for batch in self.source.batches(np.arange(start, start + self._rows(chunk), dtype=np.int64)):
            if len(batch):
                self._compare(batch)
                return

    def _compare(self, batch: Batch) -> None:
        """Raise `DataChangedError` at the first array whose recomputed rows of ``batch`` (written
        ones, the first of their chunk) differ from the stored rows by more than ``self.verify`` allows."""
        self.to_recompute.remove(int(batch.index[0]) // self.store.chunk_size)
        arrays = {array_key(*k): t for k, t in self.forward(batch.inputs, len(batch)).items()}
        self._check(arrays, batch)
        lo = int(batch.index.min())
        rows = batch.index - lo
        for spec in self.store.specs:
            new = arrays[spec.key].detach().cpu().numpy()
            old = np.asarray(self.store.backend.array(spec.path)[lo : lo + int(rows.max()) + 1])[rows]
            found = _difference(new, old, self.rtol)
            if found is not None:
                err, feature, at, allowed = found
                where = f" in feature {feature}, which differs by {at:.3g}" if allowed else ""
                raise DataChangedError(
                    f"{self.out} cannot be resumed: {len(batch)} of its written samples (from {batch.ids[0]!r}), computed again, "
                    f"differ from the stored rows in {spec.key!r} by up to {err:.3g} (max abs; verify={self.verify!r} allows "
                    f"{allowed:.3g}{where}): what computes the features changed since they were written (the model's code, a "
                    "library, a kernel), so new rows would not match them: restore it, or pass overwrite=True "
                    "(--overwrite) to extract everything again"
                )

    def _check(self, arrays: dict[str, torch.Tensor], batch: Batch) -> None:
        for spec in self.store.specs:
            t = arrays.get(spec.key)
            if t is None or tuple(t.shape[1:]) != spec.shape or _numpy_dtype(t.dtype) != spec.dtype:
                got = "nothing" if t is None else f"{list(t.shape[1:])} {_numpy_dtype(t.dtype)}"
                raise StoreError(
                    f"{spec.key!r} gave {got} per sample at sample {batch.ids[0]!r}, but the store holds "
                    f"{list(spec.shape)} {spec.dtype}: samples must give one feature shape (resize inputs to one "
                    "size, or pool with reduce='mean')"
                )


def _difference(new: np.ndarray, old: np.ndarray, rtol: float) -> tuple[float, int, float, float] | None:
    """``None`` when recomputed rows ``new`` match the stored ``old`` within ``rtol``, else
    ``(the largest absolute difference, the feature most beyond its allowance, its difference,
    its allowance)``. The allowance is per feature (a column of the flattened rows): ``rtol``
    times that feature's largest stored magnitude, at least 1e-3 of the whole array's, so one
    massive channel hides no change in the others and features near 0 are not held to exact.
    Integers must be equal; NaN and infinities must sit in the same places."""
    new, old = new.reshape(len(new), -1), old.reshape(len(old), -1)
    if not np.issubdtype(old.dtype, np.inexact):
        rtol = 0.0
    new, old = new.astype(np.float64), old.astype(np.float64)
    finite = np.isfinite(new) & np.isfinite(old)
    if not (finite | (new == old) | (np.isnan(new) & np.isnan(old))).all():  # equal infinities are the same
        bad = int(np.flatnonzero(~(finite | (new == old) | (np.isnan(new) & np.isnan(old))).any(0))[0])
        return float("inf"), bad, float("inf"), 0.0
    with np.errstate(invalid="ignore"):  # inf - inf, where the mask drops it
        diff = np.where(finite, np.abs(new - old), 0.0).max(0, initial=0.0)
    size = np.where(np.isfinite(old), np.abs(old), 0.0).max(0, initial=0.0)
    allowed = rtol * np.maximum(size, 1e-3 * size.max(initial=0.0))
    beyond = diff - allowed
    if not (beyond > 0).any():
        return None
    worst = int(np.argmax(beyond / np.maximum(allowed, np.finfo(np.float64).tiny)))
    return float(diff.max()), worst, float(diff[worst]), float(allowed[worst])


__all__ = ["extract_dataset", "model_fingerprint"]
