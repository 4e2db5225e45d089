"""The model under one tap, batch after batch, and the proof that each output is batch-first.

A store holds one row per sample, so every tapped output must have the batch as its first
dimension: `SampleForward` knows that rather than guessing it (see its docstring).
"""

from __future__ import annotations

from typing import Any, Protocol

import torch
from torch import nn

from .. import nested
from ..errors import StoreError
from ..runtime import run_model, running
from ..tap import Tap, tap
from ..tap.controls import Reduce, reducer

Leaves = dict[tuple[str, int | None], torch.Tensor]  # {(layer, leaf index or None): tensor}


class ModelForward(Protocol):
    """What a run computes with: a batch's features (``n`` samples) from ``model``, whose
    tensor-parallel layout the run reads (`layertap.distributed.tensor_parallel_ranks`)."""

    model: nn.Module

    def __call__(self, inputs: Any, n: int) -> Leaves: ...


class SampleForward:
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
        # keep="first": the forward stops after each layer's first call (a later call would depend on what else is chosen)
        self.tap: Tap = tap(model, names, reduce=reduce_recording if pool is not None else None, dtype=dtype, stop_early=True, keep="first")
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
        self.tap.clear()  # keep="first" keeps the first call since clear(): this batch's
        with running(self.model), self.tap:
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
