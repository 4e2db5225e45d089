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

The card and statistics are data: their types and sizes are checked on opening, as the rest of
the store's metadata is (`layertap.store.trust`).

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
        keys = set(self.features)
        layers = card.get("layers")
        if not (isinstance(layers, list) and all(isinstance(x, str) and x in keys for x in layers) and all(k in keys for k in EXTRA)):
            raise _bad(where, "its token card names layers or token arrays that it does not hold")
        docs = card.get("doc_ids")
        n_docs = card.get("num_documents")
        if not (isinstance(n_docs, int) and (docs is None or (isinstance(docs, list) and len(docs) == n_docs and all(isinstance(d, (str, int)) for d in docs)))):
            raise _bad(where, "its token card's document ids are not a list of one id (text or integer) per document")
        if card.get("dtype") not in (None, *_DTYPES):
            raise _bad(where, f"its token card's dtype {card.get('dtype')!r} is not a float dtype")
        stats = meta.get("token_stats") or {}
        widths = {a["key"]: int(np.prod(a["shape"], dtype=np.int64)) for a in meta["arrays"]}
        if not isinstance(stats, dict):
            raise _bad(where, "its token statistics are not a record per layer")
        for layer, s in stats.items():
            if not (isinstance(s, dict) and layer in layers and isinstance(s.get("count"), int) and _is_floats([s.get("mean_norm")], 1)) or not all(
                _is_floats(s.get(k), widths[layer]) for k in ("mean", "std")
            ):
                raise _bad(where, f"its statistics of {layer!r} are not a count, a mean and std per feature, and a mean norm")
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
        return _DTYPES[self.card.get("dtype") or "float32"]

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
