"""Token batches: units padded into fixed batches, and the model under one tap over them.

The engine of `layertap.extract_dataset` stores one row per sample. For tokens a *row* is a
stored token, so `TokenSource` is a `layertap.data.DataSource` whose samples are the rows of
`layertap.extract.units.Units`: the run deals out, writes, marks and resumes chunks of rows as
it does chunks of images.

Why each row is exact, whatever the tokenizer's padding side:

- layertap pads every batch itself, **on the right**, and passes the attention mask. A real
  token then sits at the position it has when its unit runs alone (absolute positions, as
  GPT-2's, and rotary ones, as Llama's, both start at 0 with the unit), and no real token
  attends to padding: a causal model never looks right, and an encoder masks it out. The
  tokenizer's own ``padding_side`` is never used.
- a unit is always computed in the same batch: batch ``k`` is units ``k*B`` to ``(k+1)*B``,
  whatever rows a process or a resumed run needs of it. The same batch gives the same padded
  shape, so a resumed run recomputes bit for bit what an uninterrupted one would have (rows of a
  unit that straddles two chunks are computed by both chunks' runs: one batch more per chunk).

A layer's output holds one value per token: ``[batch, tokens, ...]`` (the first tensor of a
tuple, as everywhere), or the tokens in another dimension (an SDPA output is ``[batch, heads,
tokens, head_dim]``). Which dimension is the tokens' is known, not guessed from sizes (heads may
be as many as the tokens): the first two units of the first batch run once more, one token
shorter, and the dimension that follows is the tokens'. The rest is flattened: each layer is stored as
``[rows, features]``.

>>> import torch
>>> from layertap.extract.units import Units
>>> source = TokenSource(Units.of([[5, 6, 7], [8]], [[0, 0, 0], [0]]), batch_size=2, pad_id=0, description="2 docs")
>>> batch = next(source.batches())
>>> batch.inputs.model_inputs["attention_mask"].tolist(), batch.index.tolist()
([[1, 1, 1], [1, 0, 0]], [0, 1, 2, 3])
"""

from __future__ import annotations

import hashlib
import inspect
import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from .. import nested
from ..data import Batch, DataSource
from ..errors import ArgumentError, StoreError
from ..runtime import run_model, running
from ..select import wrapped_child
from ..tap import Tap, tap
from .forward import Leaves
from .units import Units

# the arrays every token store holds beside its layers' (see `layertap.store.tokens`)
TOKEN_IDS, DOCS, POSITIONS = "@token_ids", "@docs", "@positions"


@dataclass
class TokenInputs:
    """A padded batch of units and the (unit, position) of each of its rows."""

    model_inputs: dict[str, torch.Tensor]  # input_ids, attention_mask: [units, padded length]
    unit: torch.Tensor  # [rows]: the row's unit, within the batch
    position: torch.Tensor  # [rows]: the row's position within its unit
    token_ids: torch.Tensor  # [rows] int32
    docs: torch.Tensor  # [rows] int64
    unit_hash: torch.Tensor  # [rows] int64: a hash of the row's whole unit (what its value depends on)

    def take(self, rows: torch.Tensor) -> TokenInputs:
        return replace(self, **{k: getattr(self, k)[rows] for k in ("unit", "position", "token_ids", "docs", "unit_hash")})


class TokenBatch(Batch):
    """A batch whose samples are rows (stored tokens) of a padded batch of units."""

    inputs: TokenInputs

    def take(self, rows: np.ndarray) -> TokenBatch:
        if len(rows) == len(self):
            return self
        keep = torch.from_numpy(np.asarray(rows, dtype=np.int64))
        ids = cast(_RowIds, self.ids)
        return TokenBatch(self.inputs.take(keep), None, _RowIds(ids.docs[rows], ids.positions[rows], ids.doc_ids), self.index[rows], self.failed)

    def row_tensors(self) -> list[torch.Tensor]:
        """A row's value depends on its whole unit, its position and its token."""
        i = self.inputs
        return [torch.stack([i.unit_hash, i.position.long(), i.token_ids.long(), i.docs], 1)]


class _RowIds(Sequence):
    """Each row's id, made when asked (a message names one): ``"doc <document id> token <position>"``."""

    def __init__(self, docs: np.ndarray, positions: np.ndarray, doc_ids: Sequence | None = None) -> None:
        self.docs, self.positions, self.doc_ids = docs, positions, doc_ids

    def __len__(self) -> int:
        return len(self.docs)

    def __getitem__(self, i: Any) -> Any:
        doc = int(self.docs[i])
        return f"document {self.doc_ids[doc] if self.doc_ids is not None else doc} token {int(self.positions[i])}"


def _unit_hash(ids: np.ndarray) -> int:
    return int.from_bytes(hashlib.blake2b(ids.tobytes(), digest_size=8).digest(), "little", signed=True)


class TokenSource(DataSource):
    """The rows of ``units`` as samples, in fixed batches of ``batch_size`` units (see above)."""

    indexed = True
    num_samples: int
    batch_size: int

    def __init__(self, units: Units, *, batch_size: int, pad_id: int, description: str, doc_ids: Sequence | None = None) -> None:
        self.units, self.batch_size, self.pad_id, self.doc_ids = units, batch_size, pad_id, doc_ids
        self.num_samples = units.num_rows
        self.ids = None
        self.description = description
        self.hashes = np.array([_unit_hash(i) for i in units.ids], dtype=np.int64)
        self.unit_of_row = np.repeat(np.arange(len(units), dtype=np.int64), np.diff(units.offsets))

    def batches(self, shard: Sequence[int] | np.ndarray | None = None) -> Iterator[Batch]:
        rows = np.arange(self.num_samples, dtype=np.int64) if shard is None else np.asarray(shard, dtype=np.int64)
        if not len(rows):
            return
        group = self.unit_of_row[rows] // self.batch_size
        cuts = [0, *(np.flatnonzero(np.diff(group)) + 1).tolist(), len(rows)]
        for lo, hi in itertools.pairwise(cuts):
            yield self._batch(int(group[lo]), rows[lo:hi])

    def _batch(self, k: int, rows: np.ndarray) -> TokenBatch:
        u = self.units
        first, last = k * self.batch_size, min(len(u), (k + 1) * self.batch_size)
        length = max(1, max(len(u.ids[i]) for i in range(first, last)))
        ids = np.full((last - first, length), self.pad_id, dtype=np.int64)
        mask = np.zeros((last - first, length), dtype=np.int64)
        for b, i in enumerate(range(first, last)):
            ids[b, : len(u.ids[i])] = u.ids[i]
            mask[b, : len(u.ids[i])] = 1
        unit = self.unit_of_row[rows]
        positions, docs = [], []
        for i in np.unique(unit):  # rows are sorted: grouped by unit, in order
            p = u.selected[i][rows[unit == i] - u.offsets[i]]
            positions.append(p)
            docs.append(u.docs[i][p])
        position = np.concatenate(positions)
        local = unit - first
        inputs = TokenInputs(
            {"input_ids": torch.from_numpy(ids), "attention_mask": torch.from_numpy(mask)},
            torch.from_numpy(local),
            torch.from_numpy(position),
            torch.from_numpy(ids[local, position].astype(np.int32)),
            torch.from_numpy(np.concatenate(docs)),
            torch.from_numpy(self.hashes[unit]),
        )
        return TokenBatch(inputs, None, _RowIds(inputs.docs.numpy(), position, self.doc_ids), rows)


def takes_mask(model: nn.Module) -> bool:
    """Whether ``model.forward`` takes an ``attention_mask`` by name (a wrapper's: its model's).
    ``**kwargs`` alone says nothing: FNet takes them and drops the mask, and a padded batch then
    changes every real token (by up to 2.8)."""
    if "attention_mask" in inspect.signature(model.forward).parameters:
        return True
    child = wrapped_child(model)
    return child is not None and takes_mask(getattr(model, child))


def token_dim(short: torch.Size | None, longer: torch.Size | None, units: int, length: int) -> int | None:
    """The token dimension of an output of ``short`` shape for ``units`` units of ``length``
    tokens, given its ``longer`` shape for one padding token more: the one dimension (after the
    batch's) that follows the length; ``None`` when there is no such one dimension."""
    if short is None or longer is None or len(short) != len(longer) or not short or short[0] != units:
        return None
    follows = [d for d in range(1, len(short)) if short[d] == length and longer[d] == length + 1]
    return follows[0] if len(follows) == 1 else None


def longer_by_one(model_inputs: dict[str, torch.Tensor], pad_id: int) -> dict[str, torch.Tensor]:
    """The same batch, one padding token longer (masked out, right of every real token)."""
    return {k: torch.cat([v, torch.full_like(v[:, :1], pad_id if k == "input_ids" else 0)], 1) for k, v in model_inputs.items()}


class TokenForward:
    """The model under one tap, over token batches: ``{(layer, None): [rows, features]}``, and the
    rows' token ids, documents and positions (stored beside the layers' arrays).

    ``bits=True`` stores bfloat16 features as their raw 16 bits (int16: NumPy has no bfloat16).
    """

    def __init__(self, model: nn.Module, names: list[str], dtype: torch.dtype | None, device: torch.device, *, batch_size: int, pad_id: int) -> None:
        self.model, self.names, self.device, self.pad_id = model, names, device, pad_id
        self.token_dims: dict[str, int] = {}  # each layer's token dimension, once proven (`_prove`)
        self.bits = dtype == torch.bfloat16
        self.masks = takes_mask(model)
        params = inspect.signature(model.forward).parameters
        self.ids_by_name = "input_ids" in params or any(p.kind == p.VAR_KEYWORD for p in params.values())
        if not self.masks and batch_size > 1:
            raise ArgumentError(
                f"{type(model).__name__}.forward takes no attention_mask, so the padding of a batch would change what its "
                "real tokens compute: pass batch_size=1, or a model that takes attention_mask"
            )
        self.tap: Tap = tap(model, names, dtype=dtype, stop_early=True)

    def _run(self, model_inputs: dict[str, torch.Tensor], taps: Tap | None = None) -> dict[str, torch.Tensor | None]:
        """Each layer's per-token tensor (the first of its output, of its first call) for one padded batch."""
        taps = self.tap if taps is None else taps  # a Tap is a mapping: empty until it runs
        ids, rest = model_inputs["input_ids"], {k: v for k, v in model_inputs.items() if k != "input_ids"}
        with running(self.model), taps:
            if self.ids_by_name:
                run_model(self.model, model_inputs)
            else:  # a forward whose first argument has another name (TransformerLens' `input`)
                self.model(ids, **rest)
        return {name: next(iter(nested.tensors(taps[name])), None) for name in self.names}

    def _prove(self, model_inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor | None]) -> None:
        """Find each layer's token dimension: the one that follows the padded length when the
        batch's first two units run again one token shorter (the last column cut: only shapes are
        compared, and no position past the model's last is asked for), or one padding token longer
        for a batch one token long. Two, not the batch: only the shapes after the batch dimension
        are compared (and two keep it where a model squeezes a batch of one). Then `_unpadded`."""
        ids = model_inputs["input_ids"]
        units, length = ids.shape
        first = {k: v[:2] for k, v in model_inputs.items()}
        every = tap(self.model, self.names, keep="all")  # the whole forward, every call: how often each layer runs
        again = self._run({k: v[:, :-1] for k, v in first.items()} if length > 1 else longer_by_one(first, self.pad_id), every)
        for name in self.names:
            if len(every[name]) > 1:  # the run stops at the first call (stop_early): the others would be lost, silently
                raise ArgumentError(
                    f"layer {name!r} runs {len(every[name])} times per forward (a module shared by several layers, or an op "
                    "without #K), and a token store holds one row per token and layer: tap the modules that call it, or "
                    "name one call of an op ('module:op#2')"
                )
        for name, t in outputs.items():
            other = again[name]
            shapes = (None if t is None else t.shape, None if other is None else other.shape)
            short, longer = shapes[::-1] if length > 1 else shapes
            dim = token_dim(short, longer, min(units, 2) if length > 1 else units, length - 1 if length > 1 else length)
            if dim is None:
                got = "no tensor" if t is None else f"shape {list(t.shape)}"
                raise StoreError(
                    f"layer {name!r} gave {got} for a batch of {list(ids.shape)} tokens, with no one dimension that follows the "
                    "number of tokens: a token store holds one row per token, so tap a layer whose output is [batch, tokens, ...] "
                    "(a block, an MLP, an attention op)"
                )
            self.token_dims[name] = dim
        self._unpadded(model_inputs, outputs)

    def _unpadded(self, model_inputs: dict[str, torch.Tensor], outputs: dict[str, torch.Tensor | None]) -> None:
        """Refuse a model whose real tokens' rows change with the padding after them: the batch's
        most padded unit runs again without its padding (twice: a batch of two, as above). A model
        that honours its mask gives the same rows to float rounding; FNet (no mask), ConvBERT's span
        convolution, YOSO and CANINE let padding in, by 0.01 to 4."""
        mask = model_inputs.get("attention_mask")
        if mask is None or int(mask.sum(1).min()) in (0, mask.shape[1]):
            return
        real = mask.sum(1)
        unit = int(real.argmin())
        count = int(real[unit])
        alone = self._run({k: v[[unit, unit], :count] for k, v in model_inputs.items()}, tap(self.model, self.names, stop_early=True))
        for name, t in outputs.items():
            dim, other = self.token_dims[name], alone[name]
            if t is not None and other is not None:
                _check_unpadded(name, self.model, t.movedim(dim, 1)[unit, :count], other.movedim(dim, 1)[0, :count])

    def __call__(self, inputs: TokenInputs, n: int) -> Leaves:
        model_inputs = {k: v.to(self.device, non_blocking=True) for k, v in inputs.model_inputs.items() if self.masks or k == "input_ids"}
        unit, position = inputs.unit.to(self.device), inputs.position.to(self.device)
        outputs = self._run(model_inputs)
        if len(self.token_dims) < len(self.names):
            self._prove(model_inputs, outputs)
        leaves: Leaves = {}
        for name, t in outputs.items():
            assert t is not None  # proven above
            rows = t.movedim(self.token_dims[name], 1)[unit, position].reshape(n, -1)
            leaves[(name, None)] = rows.view(torch.int16) if self.bits else rows
        leaves[(TOKEN_IDS, None)] = inputs.token_ids
        leaves[(DOCS, None)] = inputs.docs
        leaves[(POSITIONS, None)] = inputs.position.to(torch.int32)
        return leaves


def _check_unpadded(name: str, model: nn.Module, padded: torch.Tensor, alone: torch.Tensor) -> None:
    """Refuse the model if a unit's real rows with padding after them (``padded``, in the store's
    dtype) are not those it gives without (``alone``, in the model's) to the coarser one's rounding
    (at least 1e-3 of their scale: a bfloat16 model stored in float32 differs by its own rounding)."""
    a, b = padded.float(), alone.to(padded.dtype).float()
    eps = max((torch.finfo(t.dtype).eps for t in (padded, alone) if t.is_floating_point()), default=0.0)
    finite = b.isfinite()
    scale = float(b[finite].abs().max()) if bool(finite.any()) else 0.0
    tolerance = max(1e-3, 8 * eps) * (scale + 1e-6)
    close = torch.isclose(a, b, rtol=0, atol=tolerance, equal_nan=True)  # the same infinities are the same
    if not bool(close.all()):
        apart = float((a - b).abs()[~close].max())
        raise ArgumentError(
            f"layer {name!r} of {type(model).__name__} computes other values for a document's real tokens when padding follows "
            f"them (up to {apart:.3g} apart), although it is masked out: the model lets padding in. Pass batch_size=1, which pads nothing"
        )
