"""Units: what the model sees, one at a time, and which of their tokens are stored.

A *unit* is one document (truncated to ``max_length`` tokens) or, with ``pack=True``, one packed
context: documents tokenized without special tokens, each followed by the separator (the
tokenizer's EOS, else SEP), concatenated and cut into contexts of ``max_length`` tokens (the
last one may be shorter). Every token of a unit keeps the document it came from.

The token policy picks the stored tokens of each unit (its *rows*, in position order):

- ``"real"`` / ``"all"``: every token of the unit. Padding is never part of a unit (layertap pads
  batches itself, and drops the positions an ``attention_mask`` of tokenized input masks), so
  the two are the same; both keep special tokens;
- ``"no_special"``: drop every token whose id is one of the tokenizer's special tokens
  (``all_special_ids``: BOS/CLS/SEP/EOS, PAD, UNK, MASK and added ones), whether the text was
  tokenized here or given as ids (the ``special_tokens_mask`` a function policy gets too);
- ``"last"``: the last token of each document (with ``pack=True``, its separator);
- a function ``(input_ids, attention_mask, special_tokens_mask) -> bool mask``, called once per
  unit with 1-D tensors of the unit's length.

The rows of all units, in unit order, are the store's rows; ``offsets`` says where each unit's
begin, so the rows of any range are known before the model runs.

>>> units = Units.of([[101, 7, 8, 102], [101, 9, 102]], [[1, 0, 0, 1], [1, 0, 1]], tokens="no_special")
>>> units.num_rows, units.offsets.tolist(), units.rows_of(1).tolist()
(3, [0, 2, 3], [1])
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import torch

from ..errors import ArgumentError
from ..records import SkippedSample

TokenPolicy = Literal["real", "all", "no_special", "last"] | Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]
POLICIES = ("real", "all", "no_special", "last")


def check_policy(tokens: Any) -> None:
    if not callable(tokens) and tokens not in POLICIES:
        raise ArgumentError(f"tokens={tokens!r} is not a token policy: use one of {POLICIES} or a function (input_ids, attention_mask, special_tokens_mask) -> bool mask")


@dataclass
class Units:
    """The units of a corpus, their documents, and the positions of their stored tokens."""

    ids: list[np.ndarray]  # per unit: its token ids (int64)
    special: list[np.ndarray]  # per unit: which tokens are special (bool)
    docs: list[np.ndarray]  # per unit: the document of each token (int64)
    selected: list[np.ndarray]  # per unit: the positions of its stored tokens (int64), ascending
    offsets: np.ndarray = field(init=False)  # [units + 1]: where each unit's rows begin
    skipped: list[SkippedSample] = field(default_factory=list)  # documents left out (on_error="skip")
    num_documents: int = 0

    def __post_init__(self) -> None:
        self.offsets = np.concatenate([[0], np.cumsum([len(s) for s in self.selected], dtype=np.int64)]).astype(np.int64)

    @classmethod
    def of(cls, ids: Sequence[Any], special: Sequence[Any], *, tokens: TokenPolicy = "real", docs: Sequence[Any] | None = None) -> Units:
        """Units from token ids and special-token masks (each unit one document unless ``docs`` says otherwise)."""
        ids_ = [np.asarray(i, dtype=np.int64) for i in ids]
        special_ = [np.asarray(s, dtype=bool) for s in special]
        docs_ = [np.full(len(i), u, dtype=np.int64) for u, i in enumerate(ids_)] if docs is None else [np.asarray(d, dtype=np.int64) for d in docs]
        ends = _document_ends(docs_)
        selected = [_select(tokens, i, s, e, u) for u, (i, s, e) in enumerate(zip(ids_, special_, ends))]
        return cls(ids_, special_, docs_, selected, num_documents=len(ids_) if docs is None else 0)

    def __len__(self) -> int:
        return len(self.ids)

    @property
    def num_rows(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_tokens(self) -> int:
        """Tokens the model sees (stored or not)."""
        return sum(len(i) for i in self.ids)

    def rows_of(self, unit: int) -> np.ndarray:
        """The positions within ``unit`` of its stored tokens."""
        return self.selected[unit]

    def digest(self) -> str:
        """16 hex digits over every unit's tokens, their documents and stored positions: what the
        rows are of (a packed context holds several documents: where each begins counts too)."""
        h = hashlib.sha256()
        for i, s, d in zip(self.ids, self.selected, self.docs):
            h.update(len(i).to_bytes(8, "little"))
            h.update(i.tobytes())
            h.update(s.tobytes())
            h.update(d.tobytes())
        return h.hexdigest()[:16]


def _document_ends(docs: list[np.ndarray]) -> list[np.ndarray]:
    """Per unit: which tokens are the last of their document, over the whole run of units (a
    packed document may go on in the next context)."""
    flat = np.concatenate(docs) if docs else np.zeros(0, dtype=np.int64)
    last = np.ones(len(flat), dtype=bool)
    last[:-1] = flat[1:] != flat[:-1]
    return np.split(last, np.cumsum([len(d) for d in docs])[:-1])


def _select(tokens: TokenPolicy, ids: np.ndarray, special: np.ndarray, ends: np.ndarray, unit: int) -> np.ndarray:
    if tokens in ("real", "all"):
        return np.arange(len(ids), dtype=np.int64)
    if tokens == "no_special":
        return np.flatnonzero(~special).astype(np.int64)
    if tokens == "last":
        return np.flatnonzero(ends).astype(np.int64)
    assert callable(tokens)
    t = torch.from_numpy(ids)
    try:
        mask = tokens(t, torch.ones_like(t), torch.from_numpy(special.astype(np.int64)))
    except Exception as e:  # a rule written for documents may meet a unit of special tokens only (a packed context's end)
        raise ArgumentError(
            f"the tokens= function raised {type(e).__name__} ({e}) on unit {unit} of {len(ids)} tokens "
            f"({int(special.sum())} special): make it handle every unit it is given"
        ) from e
    if not isinstance(mask, torch.Tensor) or mask.shape != t.shape:
        got = list(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise ArgumentError(f"the tokens= function returned {got} for unit {unit} of {len(ids)} tokens: it must return a bool tensor of the input_ids' shape")
    return np.flatnonzero(mask.detach().cpu().numpy().astype(bool)).astype(np.int64)


def pack(ids: list[np.ndarray], special: list[np.ndarray], docs: list[int], separator: int, max_length: int) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """Documents joined, each followed by ``separator``, and cut into contexts of ``max_length``
    tokens (the last one may be shorter): the contexts' ids, special masks and documents."""
    if not ids:
        return [], [], []
    sep = np.array([separator], dtype=np.int64)
    flat = np.concatenate([np.concatenate([i, sep]) for i in ids])
    flat_special = np.concatenate([np.concatenate([s, [True]]) for s in special])
    flat_docs = np.concatenate([np.full(len(i) + 1, d, dtype=np.int64) for i, d in zip(ids, docs)])
    cuts = range(0, len(flat), max_length)
    return ([flat[c : c + max_length] for c in cuts], [flat_special[c : c + max_length] for c in cuts], [flat_docs[c : c + max_length] for c in cuts])
