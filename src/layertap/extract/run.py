"""The run: `extract_dataset` checks its arguments, opens the data and the store (new, resumed or
complete), deals the chunks still to write out to the job's processes, and verifies what a resume
adds to; `_Run` is one such run. How it stays fast and small is told in `layertap.extract`.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..data import Batch, DataSource, OnError, open_data
from ..distributed import Processes, job, launched, rank_device, tensor_parallel_ranks
from ..errors import DataChangedError, StoreError
from ..modelinfo import model_info
from ..progress import progress_bar, say
from ..records import SkippedSample
from ..runtime import place_model
from ..select import Layers, select
from ..store.backends import check_writers, format_for
from ..store.format import StorePlan, array_key, array_specs
from ..store.lifecycle import ADDED_SETTINGS, open_or_create
from ..store.paths import Location, location
from ..store.reader import FeatureStore
from ..store.writer import StoreWriter
from ..tap.controls import Reduce, as_dtype, reducer
from .digests import Verifier, batch_digests, failed_digests
from .forward import Leaves, ModelForward, SampleForward
from .settings import Verify, _check_same_everywhere, _difference, _settings, _store_meta, _tolerance
from .sink import _Sink

CHUNK_BYTES = 16 << 20  # aim for chunks of about this size (all layers together)
MAX_CHUNK = 4096  # samples: also the granularity of resuming


def numpy_dtype(dtype: torch.dtype) -> str:
    return str(torch.empty(0, dtype=dtype).numpy().dtype)


# ------------------------------------------------------------------------------- the run
def _chunk_size(
    batch: int, sample_bytes: int, chunk_size: int | None, num_samples: int | None = None, processes: int = 1, most: int = MAX_CHUNK
) -> int:
    """Samples per chunk: whole batches, about `CHUNK_BYTES` and at most ``most`` samples; with
    several processes, small enough that each gets a few chunks (chunks are what they share, and
    a few each end them together)."""
    if chunk_size is not None:
        return chunk_size
    batches = max(1, CHUNK_BYTES // max(1, batch * sample_bytes))
    size = min(max(1, most // batch) * batch, batch * batches)
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
    reducer(reduce)
    dtype = as_dtype(dtype)
    out, fmt, world, device, run_device = resolve_target(model, out, format, device, distributed, verify, chunk_size)
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

    def make(procs: Processes) -> _Run:
        # a layer that runs several times per forward: its first call, whatever else is chosen (stores
        # made before said nothing, and kept the last call where a later layer was chosen: not resumed)
        settings = {**_settings(model, names, reduce, dtype, source), "calls": "first"}
        _check_same_everywhere(procs, settings)
        meta = _store_meta(settings, info.spec or type(model).__name__, source, fmt)
        forward = SampleForward(model, names, reduce, dtype, run_device)
        return _Run(forward, source, out, format, meta, progress, chunk_size, procs, verify=verify, rtol=_tolerance(verify, model, dtype))

    run_job(make, device, distributed, resume=resume, overwrite=overwrite)
    return FeatureStore(out)


def resolve_target(
    model: nn.Module, out: str | Path, format: str | None, device: torch.device | str | None, distributed: bool, verify: str, chunk_size: int | None
) -> tuple[Location, str, int, torch.device | str | None, torch.device]:
    """Check where a run writes and how: the store's location and format, the job's size, this
    process's device and the device the model's inputs go to (the model is moved there)."""
    if verify not in ("close", "exact", "off"):
        raise ValueError(f"verify must be 'close', 'exact' or 'off', not {verify!r}")
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be at least 1, got {chunk_size}")
    out = location(out)
    fmt = format_for(out, format)
    _, world, local_rank = launched() if distributed else (0, 1, 0)
    check_writers(fmt, world, out)
    if world > 1 and str(out).startswith("memory://"):
        raise StoreError(f"{out} is in this process's memory, which the other {world - 1} processes cannot see: write to a shared folder or an object store")
    device = rank_device(device, local_rank, world)
    return out, fmt, world, device, place_model(model, device)


def run_job(make: Callable[[Processes], _Run], device: torch.device | str | None, distributed: bool, *, resume: bool, overwrite: bool) -> None:
    """Make the run of this process of the job (``make(procs)``) and run it, its store closed after."""
    with job(device, together=distributed) as procs:
        run = make(procs)
        try:
            run.extract(resume=resume, overwrite=overwrite)
        finally:
            if run.writer is not None:
                run.writer.close()


Computed = tuple[Batch, Leaves]  # a batch and its features


class _Run:
    """One extraction: open or create the store, check what it holds, run the missing batches.

    With several processes, rank 0 alone opens (locks), checks, creates and finishes the
    store; each process writes the chunks dealt to it. Under tensor parallelism the chunks are
    dealt to the groups (``procs.dp_rank`` of ``dp_world``): every process of a group reads them
    and runs the forward, whose collectives need them all, and the group's first writes them.
    """

    MOST = MAX_CHUNK  # samples per chunk at most

    def __init__(
        self,
        forward: ModelForward,
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
        self.probed: Computed | None = None  # a tensor-parallel probe, run by rank 0's group together

    @property
    def store(self) -> StoreWriter:
        """The writer, once `_start` (rank 0) or `_open` (the others) made it."""
        assert self.writer is not None
        return self.writer

    def extract(self, *, resume: bool, overwrite: bool) -> None:
        procs = self.procs
        procs.tensor_parallel(tensor_parallel_ranks(self.forward.model, fsdp=True))
        if len(procs.tp_ranks) > 1 and self.source.indexed:  # rank 0 may need it to lay out the store, and cannot run it alone
            procs.share(self._keep_probe, peers=True)
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
            # a store made before layertap recorded which call of a layer run several times it keeps
            # (then the last, beside a later layer) is checked whatever verify= says: never mixed
            older = not set(store.meta.get("settings") or {}) >= ADDED_SETTINGS
            self.to_recompute = sorted({done[0], done[-1]}) if done and (self.verify != "off" or older) else []
            recorded = {c: m.digests for c, m in store.markers().items() if m.digests is not None}
            verifier = Verifier(recorded, store.chunk_size, self.source, str(self.out))
            if self.source.indexed:  # a stream is checked as it is read again
                procs.share(verifier.check_all)
                for chunk in list(self.to_recompute):  # each is crossed off when compared
                    procs.share(functools.partial(self._recompute, chunk), peers=True)
        end = procs.together(lambda: self._batches(done, verifier))
        self._finish(self.source.num_samples or end)

    def _finish(self, num_samples: int) -> None:
        """Every chunk is written: mark the store complete (rank 0)."""
        self.procs.share(lambda: self.store.finish(num_samples))

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
            self.out, self.format, self.meta, resume=resume, overwrite=overwrite, layout=self._store_plan, say=lambda m: say(m, self.progress)
        )
        return self.writer.state

    def _store_plan(self) -> StorePlan:
        """A new store's arrays, from the first readable features: alone, the first batches of
        the run itself (read once); with other processes, a probe of two samples."""
        if self.procs.world == 1:
            reader = self._read(None, [], None)
            for batch, leaves in reader:
                self.read_first.append((batch, leaves))
                if leaves:
                    self.reader = itertools.chain(self.read_first, reader)
                    return self._store_plan_of(batch, leaves)
            raise self._unreadable([f for b, _ in self.read_first for f in b.failed])
        return self._store_plan_of(*(self.probed or self._probe()))

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

    def _keep_probe(self) -> None:
        self.probed = self._probe()

    def _unreadable(self, failed: list[SkippedSample]) -> StoreError:
        first = f", first {failed[0].id}: {failed[0].error}" if failed else ""
        return StoreError(f"no sample of {self.source.description} could be read ({len(failed)} failed{first})")

    def _store_plan_of(self, batch: Batch, leaves: Leaves) -> StorePlan:
        specs = array_specs([(*k, tuple(t.shape[1:]), numpy_dtype(t.dtype)) for k, t in leaves.items()])
        size = _chunk_size(
            self._granule(batch), sum(s.sample_bytes for s in specs), self.chunk_size, self.source.num_samples, self.procs.dp_world, self.MOST
        )
        return StorePlan(
            specs,
            self.source.num_samples,
            size,
            self.source.ids,
            None if batch.labels is None else str(batch.labels.numpy().dtype),
            {array_key(*k): t.detach().cpu().numpy() for k, t in leaves.items()},
        )

    def _granule(self, batch: Batch) -> int:
        """Chunks are a whole number of these samples: a batch (a resume cuts the same batches)."""
        return self.source.batch_size or len(batch) + len(batch.failed)

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
        shard = _plan(self.store, done, self.procs.dp_rank, self.procs.dp_world) if self.source.indexed else None
        reader = self.reader or self._read(shard, done, verifier)
        total = len(shard) if shard is not None else self.source.num_samples and self.source.num_samples - sum(self._rows(c) for c in done)
        bar = progress_bar(total, desc="extract", unit="sample", enabled=self.progress)
        sink = _Sink(self.store) if self.procs.writes else None  # a tensor-parallel peer only computes
        try:
            for batch, leaves in reader:
                arrays = {array_key(*k): t for k, t in leaves.items()}
                if arrays:
                    self._check(arrays, batch)
                if sink is not None and (arrays or batch.failed):
                    digests = batch_digests(self.source, batch) if len(batch) else []
                    sink.put(batch, arrays, digests, failed_digests(self.source, batch.failed))
                bar.update(len(batch) + len(batch.failed))
        except BaseException:
            with contextlib.suppress(BaseException):
                if sink is not None:
                    sink.close(None)  # keep every whole chunk done so far
            raise
        else:
            if sink is not None:
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
            found = _difference(self._values(spec.key, new), self._values(spec.key, old), self.rtol)
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

    def _values(self, key: str, stored: np.ndarray) -> np.ndarray:
        """What stored rows of array ``key`` mean as numbers (as they are, here)."""
        return stored

    def _check(self, arrays: dict[str, torch.Tensor], batch: Batch) -> None:
        for spec in self.store.specs:
            t = arrays.get(spec.key)
            if t is None or tuple(t.shape[1:]) != spec.shape or numpy_dtype(t.dtype) != spec.dtype:
                got = "nothing" if t is None else f"{list(t.shape[1:])} {numpy_dtype(t.dtype)}"
                raise StoreError(
                    f"{spec.key!r} gave {got} per sample at sample {batch.ids[0]!r}, but the store holds "
                    f"{list(spec.shape)} {spec.dtype}: samples must give one feature shape (resize inputs to one "
                    "size, or pool with reduce='mean')"
                )


__all__ = ["extract_dataset", "Verify"]
