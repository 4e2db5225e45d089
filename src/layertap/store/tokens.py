"""Reading a token store: `open_tokens` and `TokenStore`, a store of per-token activations.

A token store is a feature store (`layertap.store.reader.FeatureStore`) whose samples are tokens:

- one ``[tokens, features]`` array per layer (``store[layer]``, the format's lazy array);
- ``token_ids``, ``docs`` (the document's index in the corpus) and ``positions`` (within what the
  model saw: the document, or the packed context), one per token, stored as arrays ``@token_ids``,
  ``@docs`` and ``@positions`` beside the layers';
- a card: what made it (model fingerprint, tokenizer name and hash, layers, token policy,
  ``max_length``, ``pack``, dtype, counts, the document ids, the layertap version);
- per layer, statistics over every stored token: per-feature mean and standard deviation and
  the mean norm, for the normalisation sparse-autoencoder training needs.

bfloat16 features are stored as their raw 16 bits in an ``int16`` array (NumPy has no
bfloat16): `TokenStore.read` gives them back as bfloat16 tensors, and outside layertap
``torch.from_numpy(a).view(torch.bfloat16)`` (or ``a.view(ml_dtypes.bfloat16)``) does.

The card, statistics and token arrays are data, checked on opening as the rest of the store is
(`layertap.store.trust`): the card's fields, its layers and dtype against the feature arrays, its
document count against what the store holds, and every written token's document, position and
id in range.

>>> import layertap
>>> store = layertap.open_tokens("tokens.zarr")                       # doctest: +SKIP
>>> x = store.read("encoder.layer.3", 0, 4096); store.docs[:4096]     # doctest: +SKIP
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..errors import StoreError
from ..printable import printable
from ..tables import Table
from ..units import human_bytes
from .paths import _bad
from .reader import FeatureStore

TOKEN_IDS, DOCS, POSITIONS = "@token_ids", "@docs", "@positions"
EXTRA = (TOKEN_IDS, DOCS, POSITIONS)
_FIRST_TOKEN_STORE = 2  # the store version token stores began at
_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16, "float64": torch.float64}


@dataclass(frozen=True)
class TokenMoments:
    """A layer's statistics over every stored token: ``mean`` and ``std`` per feature, the
    mean L2 norm of a token's features, and the number of tokens."""

    count: int
    mean: np.ndarray
    std: np.ndarray
    mean_norm: float


def _is_floats(value: Any, n: int) -> bool:
    return isinstance(value, list) and len(value) == n and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value)


def _is_count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


# ----------------------------------------------------------------------------- the card
def _check_dtype(card: dict, arrays: list[Any], where: Any) -> torch.dtype:
    """The features' dtype: the card's, in which every feature array must be stored (bfloat16 as
    its int16 bits), or with none in the card (the model's own) the one float dtype of them all."""
    name = card.get("dtype")
    if name not in (None, *_DTYPES):
        raise _bad(where, f"its token card's dtype {printable(repr(name))[:100]} is not one of {[None, *_DTYPES]}")
    stored = sorted({str(np.dtype(a.dtype)) for a in arrays})
    if name is None:
        ok = len(stored) == 1 and stored[0] in ("float16", "float32", "float64")
    else:
        ok = stored == ["int16" if name == "bfloat16" else name]
    if not ok:
        raise _bad(where, f"its token card says its features are {name or 'of one float dtype'}, but its arrays are stored as {stored} (bfloat16 as int16 bits)")
    return _DTYPES[name or stored[0]]


# Documents a store may hold no row of, beyond the skipped ones it lists: empty documents, and
# those whose every token the policy drops ("no_special", a function). Nothing in a store counts
# them, so this is the one bound on `num_documents` not read from the store: 2**24 such documents,
# 128 MB of `TokenStore.doc_ids` at most beyond what its tokens and skipped documents account for.
_ROWLESS_DOCUMENTS = 1 << 24


def _check_documents(card: dict, meta: dict, rows: int, where: Any) -> int:
    """The number of documents: a count, the settings', one id each, and bounded by what the
    store holds (`doc_ids` is made from it); the skipped ones listed in order, each among them."""
    n: Any = card.get("num_documents")
    skipped: Any = card.get("skipped")
    ids, settings = card.get("doc_ids"), meta.get("settings") or {}
    if not _is_count(n):
        raise _bad(where, f"its token card's num_documents {printable(repr(n))[:100]} is not a count (an integer from 0)")
    if settings.get("documents", n) != n:
        raise _bad(where, f"its token card's num_documents {n} is not the number of documents its settings name")
    if not (ids is None or (isinstance(ids, list) and len(ids) == n and all(isinstance(d, (str, int)) and not isinstance(d, bool) for d in ids))):
        raise _bad(where, "its token card's document ids are not a list of one id (text or integer) per document")
    if ids is not None and len({str(d) for d in ids}) != n:  # as the corpus refuses them: 1 and "1" are one id
        raise _bad(where, "its token card's document ids are not unique")
    if not isinstance(card.get("pack"), bool) or not isinstance(card.get("tokens"), str):
        raise _bad(where, "its token card's pack is not true or false, or its token policy is not a name")
    indices: list[Any] = [s[0] if isinstance(s, list) and len(s) == 3 else None for s in skipped] if isinstance(skipped, list) else [None]
    if not all(_is_count(i) and i < n for i in indices) or indices != sorted(set(indices)):
        raise _bad(where, "its token card's skipped documents are not a list of [index, id, error], in order, each one of its documents")
    # each document is skipped (and listed), holds stored tokens, or is one of a bounded few (above)
    if ids is None and n > len(skipped) + rows + _ROWLESS_DOCUMENTS:
        raise _bad(where, f"its token card counts {n} documents, more than its {rows} tokens and {len(skipped)} skipped documents can be of")
    return n


_BLOCK = 1 << 20  # rows of a token array read at once by `_check_columns`


def _check_columns(features: FeatureStore, card: dict, n_docs: int) -> None:
    """Every written token's document in ``[0, num_documents)`` (``doc_ids[docs]`` must name it,
    not wrap around to the last), position in ``[0, max_length)`` and token id from 0.

    Each token array is read once, its written chunks only, in blocks of `_BLOCK` rows: on a
    store of 1e6 tokens that is 20 MB (int64 documents and ids, int32 positions), measured from
    the page cache at 2 ms (NumPy), 5 ms (HDF5) and 25 ms (Zarr, which decompresses them), of
    the 130 to 250 ms that opening such a store takes (its markers' digests, mostly).
    """
    where, max_length, written = features.path, card.get("max_length"), features.written_ranges()
    if not (max_length is None or (_is_count(max_length) and max_length >= 1)):
        raise _bad(where, "its token card's max_length is not a positive count or null")
    for name, high, what in ((DOCS, n_docs, "a document index"), (POSITIONS, max_length, "a position"), (TOKEN_IDS, None, "a token id")):
        column = features[name]
        if column.ndim != 1 or np.dtype(column.dtype).kind not in "iu":
            raise _bad(where, f"its token array {name!r} is not one integer per token, but {column.dtype} of shape {list(column.shape)}")
        for start, end in written:
            for at in range(start, end, _BLOCK):
                block = np.asarray(column[at : min(end, at + _BLOCK)])
                wrong = (block < 0) if high is None else (block < 0) | (block >= high)
                if wrong.any():
                    i = int(np.flatnonzero(wrong)[0])
                    span = "from 0" if high is None else f"in [0, {high})"
                    raise _bad(where, f"its token array {name!r} holds {block[i]} at token {at + i}, not {what} {span}")


class TokenStore:
    """A token store, opened for reading (see the module's docstring).

    ``len(store)`` is the number of stored tokens; ``store[layer]`` a lazy ``[tokens, features]``
    array; `read` a slice of it as a tensor in its dtype.

    >>> import layertap
    >>> store = layertap.open_tokens("tokens.zarr")          # doctest: +SKIP
    >>> len(store), store.layers, store.stats[store.layers[0]].mean.shape    # doctest: +SKIP
    """

    def __init__(self, path: str | Path) -> None:
        self.features = FeatureStore(path)
        try:
            self.card, self._stats = self._checked()
        except BaseException:
            self.features.close()
            raise

    def _checked(self) -> tuple[dict, dict]:
        meta, where = self.features.meta, self.features.path
        card = meta.get("tokens")
        if not isinstance(card, dict):
            raise StoreError(f"{where} is a feature store, not a token store: open it with layertap.open_features")
        if meta["layertap_store"] < _FIRST_TOKEN_STORE:  # an older one is crafted, and its checks are weaker
            raise _bad(where, f"it says it is a layertap store of version {meta['layertap_store']}, older than any token store")
        if not all(k in self.features for k in EXTRA):
            raise _bad(where, f"it lacks one of the token arrays {list(EXTRA)}")
        layers = card.get("layers")
        features = [a["key"] for a in meta["arrays"] if a["key"] not in EXTRA]
        if layers != features:  # each feature array once, in order, and no token array
            raise _bad(where, f"its token card's layers {printable(repr(layers))[:200]} are not its feature arrays, {printable(repr(features))[:200]}")
        self._dtype = _check_dtype(card, [self.features[k] for k in features], where)
        n_docs = _check_documents(card, meta, len(self), where)
        _check_columns(self.features, card, n_docs)
        stats = meta.get("token_stats") or {}
        widths = {a["key"]: int(np.prod(a["shape"], dtype=np.int64)) for a in meta["arrays"]}
        if not isinstance(stats, dict):
            raise _bad(where, "its token statistics are not a record per layer")
        for layer, s in stats.items():
            if not (isinstance(s, dict) and layer in layers and _is_count(s.get("count")) and _is_floats([s.get("mean_norm")], 1)) or not all(
                _is_floats(s.get(k), widths[layer]) for k in ("mean", "std")
            ):
                raise _bad(where, f"its statistics of {layer!r} are not a count, a mean and std per feature, and a mean norm")
        if self.features.complete:  # a complete store was counted whole: every layer, every token
            rows = len(self)
            if card.get("num_tokens") != rows or sorted(stats) != sorted(layers) or any(s["count"] != rows for s in stats.values()):
                raise _bad(where, f"it is complete, but its token card's count or its statistics do not count its {rows} tokens in every layer")
        return card, stats

    # ------------------------------------------------------------------------------ reading
    @property
    def path(self) -> Any:
        return self.features.path

    @property
    def layers(self) -> list[str]:
        return list(self.card["layers"])

    @property
    def complete(self) -> bool:
        return self.features.complete

    @property
    def dtype(self) -> torch.dtype:
        """The dtype of the features (bfloat16 ones are stored as int16 bits; `read` views them back)."""
        return self._dtype

    def __len__(self) -> int:
        return self.features.num_samples

    def __getitem__(self, layer: str) -> Any:
        if layer not in self.card["layers"]:
            raise KeyError(f"{layer!r} is not a layer of this token store; it holds {self.layers}")
        return self.features[layer]

    def __contains__(self, layer: object) -> bool:
        return layer in self.card["layers"]

    def read(self, layer: str, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows ``start:stop`` of ``layer`` as a CPU tensor of the store's dtype (one contiguous read)."""
        values = np.ascontiguousarray(self[layer][start:stop])
        if not values.flags.writeable:  # a NumPy store's memory map: a tensor must own what it may write
            values = values.copy()
        rows = torch.from_numpy(values)
        return rows.view(torch.bfloat16) if self.dtype == torch.bfloat16 else rows

    @property
    def token_ids(self) -> Any:
        """Each token's id (lazy: slice it, or ``np.asarray`` it)."""
        return self.features[TOKEN_IDS]

    @property
    def docs(self) -> Any:
        """Each token's document: its index in the corpus (lazy)."""
        return self.features[DOCS]

    @property
    def positions(self) -> Any:
        """Each token's position within what the model saw, its document or packed context (lazy)."""
        return self.features[POSITIONS]

    @property
    def doc_ids(self) -> np.ndarray:
        """Every document's id (``id_field``), or its index when the corpus had none."""
        ids = self.card["doc_ids"]
        return np.arange(self.card["num_documents"], dtype=np.int64) if ids is None else np.array(ids)

    @property
    def stats(self) -> dict[str, TokenMoments]:
        """Per layer, statistics over every stored token (empty until the store is complete)."""
        return {
            k: TokenMoments(s["count"], np.asarray(s["mean"], dtype=np.float64), np.asarray(s["std"], dtype=np.float64), float(s["mean_norm"]))
            for k, s in self._stats.items()
        }

    def close(self) -> None:
        self.features.close()

    def __enter__(self) -> TokenStore:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "" if self.complete else ", INCOMPLETE"
        return (
            f"<layertap.TokenStore {self.features.format} {str(self.path)!r}: {len(self):,} tokens of "
            f"{self.card['num_documents']:,} documents{state}; layers {self.layers}>"
        )

    def _repr_html_(self) -> str:
        """The store in a notebook: what made it, how complete it is, and its layers."""
        c, n = self.card, len(self)
        facts = [
            ("path", str(self.path)),
            ("tokens", f"{n:,} of {c['num_documents']:,} documents ({'complete' if self.complete else 'INCOMPLETE'})"),
            ("model", str(c.get("model_name"))),
            ("tokenizer", str((c.get("tokenizer") or {}).get("name"))),
            ("policy", f"tokens={c.get('tokens')!r}, max_length={c.get('max_length')}, pack={c.get('pack')}"),
            ("dtype", str(self.dtype).replace("torch.", "")),
        ]
        stats = self.stats
        rows = [
            [layer, str(list(self[layer].shape)), human_bytes(self[layer].nbytes), f"{stats[layer].mean_norm:.4g}" if layer in stats else "-"]
            for layer in self.layers
        ]
        return Table(["layer", "shape", "size", "mean norm"], rows, title="layertap.TokenStore", facts=facts).html()


def open_tokens(path: str | Path) -> TokenStore:
    """Open a token store written by `layertap.extract_tokens` (see `TokenStore`).

    >>> import layertap
    >>> store = layertap.open_tokens("tokens.zarr")  # doctest: +SKIP
    """
    store = TokenStore(path)
    if not store.complete:
        warnings.warn(
            printable(f"the token store {path} is incomplete (its extraction was interrupted): run the same extraction again to finish it"),
            stacklevel=2,
        )
    return store
