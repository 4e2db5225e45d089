"""A plan before a long run: what `layertap.extract_dataset` or `layertap.extract_tokens` would
write, how long it would take and what bounds it, before anything is written.

`plan` runs the model on a few real batches (one warm-up, then `TIMED` timed) and writes a short
probe file beside the target (`write_bandwidth`, removed afterwards, even on error). From these:

- each layer's bytes per row (a sample; a token for a corpus, sized by
  `layertap.extract.token_plan.token_sizes`) and the store's size, uncompressed;
- the free space at the target (``None``, unknown, for an object-store URL); a run that cannot
  fit on a local disk is refused, in the words and by the check a run itself uses;
- the store's compression throughput (`compression`: the first batch's features encoded with the
  store's own codec);
- the projected wall time: the model's (rows over the measured throughput) beside the writer
  thread's (compressing the store, then writing its compressed size at the measured bandwidth),
  the larger of the two, and what bounds it: the model, the compression or the store;
- reductions that shrink the store, each with its size: float16, ``reduce="mean"`` (feature maps),
  ``tokens="last"`` (token stores), and leaving out the largest layer.

>>> import os, tempfile, layertap
>>> from layertap.extract.plan import plan
>>> from layertap.shapes import ShapesDataset
>>> model = layertap.load_model("layertap:shapes")
>>> p = plan(model, ShapesDataset(8), ["features.block1"], out=os.path.join(tempfile.mkdtemp(), "f.zarr"), batch_size=2)
>>> p.rows, p.layers[0].shape, p.bound in ("model", "compression", "store")
(8, (24, 32, 32), True)
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from ..data import Batch, OnError, open_data
from ..errors import ArgumentError, StoreError
from ..modelinfo import model_info
from ..select import Layers, select
from ..store.backends import BACKENDS
from ..store.format import StorePlan, array_key, array_specs
from ..store.paths import Location, is_url
from ..store.writer import check_room, free_space
from ..tables import Table
from ..tap.controls import Reduce, as_dtype, reducer
from ..units import human_bytes
from .batches import TokenForward
from .forward import Leaves, ModelForward, SampleForward
from .run import numpy_dtype, resolve_target
from .token_plan import INDEX_BYTES, pad_id, plan_tokens, sizes_of
from .units import TokenPolicy

TIMED = 3  # batches timed after the warm-up
PROBE_BYTES = 32 << 20  # written and synced to measure the target's write bandwidth
CODEC_S = 0.1  # the least time the store's compressor is timed for
_CORPUS_SUFFIXES = (".txt", ".jsonl", ".json", ".csv", ".parquet")


@dataclass(frozen=True)
class PlannedArray:
    """One stored array: its layer, shape and dtype per row, and bytes per row."""

    layer: str
    shape: tuple[int, ...]
    dtype: str
    bytes_per_row: int


@dataclass(frozen=True)
class Reduction:
    """An option that shrinks the store, and the store's size (uncompressed) with it."""

    option: str
    total_bytes: int


@dataclass
class Plan:
    """What a run would write and how long it would take (see the module's docstring).

    ``unit`` is ``"sample"`` or ``"token"``: what a row is. ``stored_bytes`` is the size on disk
    (compressed as the format compresses); ``free_bytes`` and ``write_bytes_per_s`` are ``None``
    for an object store, which tells neither; ``compress_bytes_per_s`` (raw bytes per second the
    store's codec encodes) is ``None`` for a format that stores raw.
    """

    target: str
    format: str
    unit: Literal["sample", "token"]
    rows: int
    layers: list[PlannedArray]
    extra_bytes_per_row: int
    stored_bytes: int
    free_bytes: int | None
    model_s: float
    write_bytes_per_s: float | None
    compress_bytes_per_s: float | None = None
    reductions: list[Reduction] = field(default_factory=list)

    @property
    def bytes_per_row(self) -> int:
        return sum(a.bytes_per_row for a in self.layers) + self.extra_bytes_per_row

    @property
    def total_bytes(self) -> int:
        """The store's arrays, uncompressed."""
        return self.rows * self.bytes_per_row

    @property
    def store_s(self) -> float | None:
        """Seconds to write the compressed store (``None``: unknown, object storage)."""
        return None if self.write_bytes_per_s is None else self.stored_bytes / self.write_bytes_per_s

    @property
    def compress_s(self) -> float:
        """Seconds the store's compressor takes over the whole store (0: the format stores raw)."""
        return 0.0 if self.compress_bytes_per_s is None else self.total_bytes / self.compress_bytes_per_s

    @property
    def seconds(self) -> float:
        """The projected wall time: the model, and beside it the writer thread, which compresses
        each chunk and then writes it; the slower of the two bounds it."""
        return max(self.model_s, self.compress_s + (self.store_s or 0.0))

    @property
    def bound(self) -> Literal["model", "compression", "store"]:
        """What bounds `seconds`: the model, or the writer's larger part."""
        if self.compress_s + (self.store_s or 0.0) <= self.model_s:
            return "model"
        return "compression" if self.compress_s > (self.store_s or 0.0) else "store"

    def table(self) -> Table:
        rows = [[a.layer, str(list(a.shape)), a.dtype, f"{a.bytes_per_row:,}", human_bytes(a.bytes_per_row * self.rows)] for a in self.layers]
        extra = "(token id, document, position, index)" if self.unit == "token" else "(ids, labels)"
        rows.append([extra, "", "", f"{self.extra_bytes_per_row:,}", human_bytes(self.extra_bytes_per_row * self.rows)])
        free = "unknown (object storage)" if self.free_bytes is None else human_bytes(self.free_bytes)
        write = "unknown (object storage)" if self.write_bytes_per_s is None else f"{human_bytes(self.write_bytes_per_s)}/s"
        store = "" if self.store_s is None else f", store {self.store_s:.3g} s"
        codec = "none (stored raw)" if self.compress_bytes_per_s is None else f"{human_bytes(self.compress_bytes_per_s)}/s"
        facts = [
            ("target", f"{self.target} ({self.format})"),
            ("rows", f"{self.rows:,} {self.unit}s"),
            ("size", f"{human_bytes(self.total_bytes)} uncompressed ({self.bytes_per_row:,} bytes per {self.unit}), ~{human_bytes(self.stored_bytes)} on disk"),
            ("free space", free),
            ("write bandwidth", write),
            ("compression", codec),
            ("projected time", f"{self.seconds:.3g} s, bound by the {self.bound} (model {self.model_s:.3g} s, compression {self.compress_s:.3g} s{store})"),
        ]
        notes = [f"smaller: {r.option}: {human_bytes(r.total_bytes)}" for r in self.reductions]
        return Table(["array", f"shape per {self.unit}", "dtype", f"bytes/{self.unit}", "size"], rows, numeric={f"bytes/{self.unit}", "size"}, facts=facts, notes=notes)

    def __str__(self) -> str:
        return self.table().text()

    def _repr_html_(self) -> str:
        return self.table().html()


def write_bandwidth(out: Location, size: int = PROBE_BYTES) -> float | None:
    """Bytes per second that ``size`` bytes are written and synced (``fsync``) at, in a temporary
    file in the target's folder (its nearest existing one), removed afterwards; ``None`` for a URL."""
    if is_url(out):
        return None
    folder = Path(out).absolute().parent
    while not folder.exists():
        folder = folder.parent
    block = os.urandom(min(size, 1 << 20))
    fd, name = tempfile.mkstemp(prefix=".layertap-probe-", dir=folder)
    try:
        start = time.perf_counter()
        for _ in range(max(1, size // len(block))):
            view = memoryview(block)
            while view:
                view = view[os.write(fd, view) :]
        os.fsync(fd)
        elapsed = time.perf_counter() - start
    finally:
        os.close(fd)
        os.unlink(name)
    return max(1, size // len(block)) * len(block) / max(elapsed, 1e-9)


def _timed(batches: Iterator[Batch], forward: ModelForward, work: Callable[[Batch], int], device: torch.device) -> tuple[Batch, Leaves, float]:
    """The first readable batch and its features, and the seconds per unit of ``work`` over the
    next `TIMED` batches (reading them included, as a run reads them); the warm-up's, if it is all."""
    timed: list[tuple[int, float]] = []  # (work, seconds) of each batch, the warm-up first
    first: tuple[Batch, Leaves] | None = None
    try:
        start = time.perf_counter()
        for batch in batches:
            if len(batch):
                leaves = forward(batch.inputs, len(batch))
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                first = first or (batch, leaves)
                timed.append((work(batch), time.perf_counter() - start))
                if len(timed) > TIMED:
                    break
            start = time.perf_counter()
    finally:  # a DataLoader's workers end with the generator
        getattr(batches, "close", lambda: None)()
    if first is None:
        raise StoreError("no sample of the data could be read: nothing to plan")
    measured = timed[1:] or timed
    return *first, sum(s for _, s in measured) / max(1, sum(w for w, _ in measured))


def _check_store(out: Location, fmt: str, leaves: Leaves, rows: int) -> tuple[float, float | None]:
    """The run's own check (`layertap.store.writer`): a store of ``rows`` rows of these features
    that the disk has no room for is refused. Then `compression` of the features."""
    arrays = {array_key(*k): t.detach().cpu().numpy() for k, t in leaves.items()}
    specs = array_specs([(*k, tuple(t.shape[1:]), numpy_dtype(t.dtype)) for k, t in leaves.items()])
    check_room(out, fmt, StorePlan(specs, rows, rows, None, None, arrays), lambda m: None)
    return compression(fmt, arrays)


def compression(fmt: str, arrays: dict[str, np.ndarray]) -> tuple[float, float | None]:
    """The fraction of its size a batch of features keeps in a store of format ``fmt``, and the
    raw bytes per second its compressor encodes (``None``: the format stores them raw), timed
    over at least `CODEC_S` seconds of encoding the batch again and again."""
    encode = BACKENDS[fmt].ratio  # compresses with the codec the store writes with
    ratio = encode(arrays)  # also the warm-up
    if ratio == 1.0:  # no codec: a compressor's output always differs in size (Blosc adds a header)
        return ratio, None
    runs, start = 0, time.perf_counter()
    while runs == 0 or time.perf_counter() - start < CODEC_S:
        encode(arrays)
        runs += 1
    return ratio, runs * sum(a.nbytes for a in arrays.values()) / max(time.perf_counter() - start, 1e-9)


def _fewer_layers(layers: list[PlannedArray], total: int, rows: int) -> list[Reduction]:
    if len({a.layer for a in layers}) < 2:
        return []
    largest = max(layers, key=lambda a: a.bytes_per_row)
    return [Reduction(f"without layer {largest.layer!r} (the largest)", total - largest.bytes_per_row * rows)]


def _half(layers: list[PlannedArray], total: int, rows: int) -> list[Reduction]:
    saved = sum(a.bytes_per_row - a.bytes_per_row * 2 // np.dtype(a.dtype).itemsize for a in layers if a.dtype in ("float32", "float64"))
    return [Reduction("dtype='float16'", total - saved * rows)] if saved else []


def plan(
    model: nn.Module,
    data: Any,
    layers: Layers,
    *,
    out: str | Path,
    text: bool | None = None,
    reduce: Reduce = None,
    dtype: torch.dtype | str | None = None,
    batch_size: int | None = None,
    num_workers: int | None = None,
    device: torch.device | str | None = None,
    format: str | None = None,
    on_error: OnError = "fail",
    transform: Callable[[Any], Any] | None = None,
    limit: int | None = None,
    max_image_pixels: int | None = None,
    tokenizer: Any = None,
    max_length: int | None = None,
    pack: bool = False,
    tokens: TokenPolicy = "real",
    text_field: str = "text",
    id_field: str | None = None,
) -> Plan:
    """The plan of the run `layertap.extract_dataset` (or, for a corpus, `layertap.extract_tokens`)
    would make with these arguments; nothing is written but the probe file, removed after.

    ``text``: ``data`` is a corpus (default: a list of strings or token lists, or a ``.txt``,
    ``.jsonl``, ``.json``, ``.csv`` or ``.parquet`` file). ``batch_size`` defaults as the run's
    (64 samples, 32 documents). A run that cannot fit on a local disk is a `layertap.errors.StoreError`.
    """
    names = select(model, layers)
    reducer(reduce)
    stored = as_dtype(dtype)
    if text is None:
        text = _is_corpus(data)
    if text and reduce is not None:
        raise ArgumentError("reduce= does not apply to a corpus: a token store keeps each token's features, unpooled")
    target, fmt, _, device, run_device = resolve_target(model, out, format, device, False, "off", None)
    if text:
        size = batch_size or 32
        tokenized = plan_tokens(model, data, tokenizer=tokenizer, max_length=max_length, pack=pack, tokens=tokens, dtype=stored,
                                text_field=text_field, id_field=id_field, on_error=on_error, limit=limit)  # the corpus, tokenized once
        sizes = sizes_of(model, tokenized, names, run_device)
        forward = TokenForward(model, names, stored, run_device, batch_size=size, pad_id=pad_id(tokenized.tokenizer))
        source = tokenized.first(size * (TIMED + 1), size)
        _, leaves, per_token = _timed(source.batches(), forward, _seen_tokens, run_device)
        arrays = [PlannedArray(s.layer, (s.width,), s.dtype, s.bytes_per_token) for s in sizes.layers]
        rows, extra, model_s = sizes.tokens, sizes.extra_bytes_per_token, per_token * sizes.tokens_seen
        last = [Reduction("tokens='last'", sizes.documents * sizes.bytes_per_token)] if tokens != "last" else []
    else:
        samples = open_data(data, batch_size=batch_size or 64, num_workers=num_workers, transform=transform or model_info(model).transform,
                            on_error=on_error, limit=limit, pin_memory=run_device.type == "cuda", max_image_pixels=max_image_pixels)
        if not samples.num_samples:
            known = "holds no samples" if samples.num_samples == 0 else "has no known length: plan a Dataset, an image folder or an array"
            raise StoreError(f"{samples.description} {known}")
        batch, leaves, per_sample = _timed(samples.batches(None), SampleForward(model, names, reduce, stored, run_device), len, run_device)
        rows = samples.num_samples
        arrays = [PlannedArray(array_key(*k), tuple(t.shape[1:]), numpy_dtype(t.dtype), t[0].numel() * t.element_size()) for k, t in leaves.items()]
        extra, model_s = INDEX_BYTES * (1 if batch.labels is None else 2), per_sample * rows  # the ids array, and int64 labels
        maps = sum(a.bytes_per_row - a.shape[0] * np.dtype(a.dtype).itemsize for a in arrays if len(a.shape) > 1)
        last = [Reduction("reduce='mean'", (sum(a.bytes_per_row for a in arrays) + extra - maps) * rows)] if reduce is None and maps else []
    ratio, compress = _check_store(target, fmt, leaves, rows)
    total = rows * (sum(a.bytes_per_row for a in arrays) + extra)
    reductions = [*_half(arrays, total, rows), *last, *_fewer_layers(arrays, total, rows)]
    unit: Literal["sample", "token"] = "token" if text else "sample"
    return Plan(str(target), fmt, unit, rows, arrays, extra, int(total * ratio), free_space(target), model_s, write_bandwidth(target), compress, reductions)


def _seen_tokens(batch: Batch) -> int:
    """The real tokens the model runs over in a token batch (what its time grows with)."""
    inputs = batch.inputs.model_inputs
    return int(inputs["attention_mask"].sum()) if "attention_mask" in inputs else int(inputs["input_ids"].numel())


def _is_corpus(data: Any) -> bool:
    if isinstance(data, (str, os.PathLike)):
        return Path(data).suffix.lower() in _CORPUS_SUFFIXES
    return isinstance(data, (list, tuple)) and bool(data) and isinstance(data[0], (str, list, dict))


__all__ = ["Plan", "PlannedArray", "Reduction", "compression", "plan", "write_bandwidth"]
