"""The tokenizer of a token extraction: which one, what it is (its fingerprint), and a corpus
turned into `layertap.extract.units.Units` with it.

- `default_tokenizer`: the tokenizer saved beside an ``hf:`` model (its folder), read as data:
  a tokenizer whose config files name code (`layertap.hfcode`) is refused, as `layertap.load_model` refuses models.
- `tokenizer_fingerprint`: the tokenizer's name and a hash of what tokenizes (vocabulary,
  merges, normalisation, special tokens), not of its padding side, which layertap does not use:
  it pads batches itself, on the right (see `layertap.extract.batches`).
- `tokenize`: every document tokenized (in batches, with the fast tokenizer where there is one),
  truncated to ``max_length``, or packed; a document that is missing or not a string is a
  one-line error naming its index, or is skipped and recorded with ``on_error="skip"``.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
from torch import nn

from ..data import OnError
from ..errors import ArgumentError, DataError, ModelLoadError, require
from ..hfcode import folder_names_code
from ..modelinfo import model_info
from ..records import SkippedSample
from .corpus import Corpus
from .units import TokenPolicy, Units, pack

_BATCH = 1024  # documents per tokenizer call


def _model_folder(model: nn.Module) -> Path | None:
    # only the folder the user named: a config's own ``_name_or_path`` is data from a file,
    # which could name any folder on the machine
    spec = model_info(model).spec or ""
    return Path(spec[3:]).expanduser() if spec.startswith("hf:") else None


def default_tokenizer(model: nn.Module) -> Any:
    """The tokenizer saved beside a model loaded by ``layertap.load_model("hf:FOLDER")``; any other
    model needs ``tokenizer=`` (a config's ``_name_or_path`` is not followed: a file sets it)."""
    folder = _model_folder(model)
    if folder is None or not folder.is_dir():
        raise ArgumentError(
            f"no tokenizer is known for this {type(model).__name__}: pass tokenizer= (e.g. "
            "transformers.AutoTokenizer.from_pretrained(folder)), or load the model with layertap.load_model('hf:FOLDER')"
        )
    return read_tokenizer(folder)


def read_tokenizer(folder: Path, fix: str = "pass tokenizer=") -> Any:
    """The Hugging Face tokenizer saved in ``folder``, read as data: one whose config files name
    code (its ``auto_map``, in ``tokenizer_config.json`` or ``config.json``, or a Hub kernel) is refused;
    ``fix`` ends the messages of failures."""
    transformers = require("transformers", "text")
    try:
        # transformers also reads a tokenizer's auto_map from the model's config.json
        code = folder_names_code(folder, "tokenizer_config.json") or folder_names_code(folder, "config.json", "AutoTokenizer")
    except ModelLoadError:  # names the file and what is wrong in it already
        raise
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"a config file in {folder} is not valid JSON ({e}): fix or remove it, or {fix}") from e
    if code is not None:
        raise ModelLoadError(f"the tokenizer in {folder} comes with {code}, which layertap does not run: {fix}")
    try:
        return transformers.AutoTokenizer.from_pretrained(str(folder), trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise ModelLoadError(f"no tokenizer could be read from {folder} ({type(e).__name__}: {e}): {fix}") from e


def tokenizer_fingerprint(tokenizer: Any) -> dict:
    """``{"name", "class", "hash"}``: what tokenizes, hashed (not the padding side, see above)."""
    h = hashlib.sha256(type(tokenizer).__name__.encode())
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        for key in ("padding", "truncation"):
            state.pop(key, None)
        h.update(json.dumps(state, sort_keys=True).encode())
    else:
        h.update(json.dumps(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(sorted((str(k), str(v)) for k, v in tokenizer.special_tokens_map.items())).encode())
    return {"name": getattr(tokenizer, "name_or_path", "") or "", "class": type(tokenizer).__name__, "hash": h.hexdigest()[:16]}


def default_max_length(model: nn.Module, tokenizer: Any) -> int:
    """The longest input the model and tokenizer both take (512 when neither says). A position
    embedding with a padding index (RoBERTa, XLM-R) numbers real tokens from after it."""
    config = getattr(model, "config", None)
    limits = [getattr(config, k, None) for k in ("max_position_embeddings", "n_positions")]
    limits.append(getattr(tokenizer, "model_max_length", None))
    limits += [
        m.num_embeddings - m.padding_idx - 1
        for name, m in model.named_modules()
        if name.endswith("position_embeddings") and isinstance(m, nn.Embedding) and m.padding_idx is not None and m.padding_idx >= 0
    ]
    found = [int(x) for x in limits if isinstance(x, int) and 0 < x < 1_000_000]
    return min(found) if found else 512


def check_positions(model: nn.Module, longest: int, batch_size: int) -> None:
    """Refuse units whose rotary positions would depend on their batch: a Hugging Face RoPE of type
    ``"dynamic"`` or ``"longrope"`` changes its frequencies with the padded length of the batch
    above ``original_max_position_embeddings`` (``"dynamic"`` also keeps the longest length seen)."""
    config = getattr(model, "config", None)
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None)
    if not isinstance(rope, dict):
        return
    # one, or one per layer type (Gemma 3's sliding and full attention)
    kinds = [rope] if "rope_type" in rope or "type" in rope else [r for r in rope.values() if isinstance(r, dict)]
    for r in kinds:
        kind = r.get("rope_type", r.get("type"))
        if kind not in ("dynamic", "longrope") or (kind == "longrope" and batch_size == 1):
            continue
        # "dynamic" scales beyond the model's own positions; "longrope" beyond the original ones it names
        limit = None if kind == "dynamic" else r.get("original_max_position_embeddings") or getattr(config, "original_max_position_embeddings", None)
        limit = limit if isinstance(limit, int) else getattr(config, "max_position_embeddings", None)
        if isinstance(limit, int) and longest > limit:
            fix = f"pass max_length={limit} or less" + (", or batch_size=1" if kind == "longrope" else "")
            raise ArgumentError(
                f"the model's rotary positions (rope_type {kind!r}) change with the sequence's length above {limit} tokens, so a "
                f"unit of {longest} tokens would be computed with frequencies set by its batch-mates"
                f"{' and by earlier batches' if kind == 'dynamic' else ''}, not as it is alone: {fix}"
            )


def _separator(tokenizer: Any) -> int:
    for name in ("eos_token_id", "sep_token_id"):
        token = getattr(tokenizer, name, None)
        if isinstance(token, int):
            return token
    raise ArgumentError("pack=True joins documents with the tokenizer's EOS (or SEP) token, and this tokenizer has neither: set tokenizer.eos_token, or pack=False")


def _bad(corpus: Corpus, i: int, doc: Any) -> str | None:
    if corpus.pretokenized:
        values = np.asarray(doc) if doc is not None and not isinstance(doc, str) else None
        return None if values is not None and values.ndim == 1 and (values.dtype.kind in "iu" or values.size == 0) else f"is {type(doc).__name__}, not token ids"
    if doc is None:
        return "is missing"
    if isinstance(doc, str):
        return None
    try:
        kind = np.asarray(doc).dtype if hasattr(doc, "__len__") and not isinstance(doc, (bytes, dict)) else None
    except (ValueError, TypeError, RuntimeError):  # ragged, or nothing NumPy reads
        kind = None
    if kind is not None and kind.kind in "fcb":  # token ids of the wrong type, read as text
        return f"is a {type(doc).__name__} of {kind} numbers, not a string or token ids (integers: cast them, e.g. to int64)"
    return f"is a {type(doc).__name__}, not a string"


def _special_mask(tokenizer: Any, ids: np.ndarray) -> np.ndarray:
    if tokenizer is None:
        return np.zeros(len(ids), dtype=bool)
    return np.isin(ids, np.asarray(tokenizer.all_special_ids, dtype=np.int64))


def tokenize(
    corpus: Corpus, tokenizer: Any, *, max_length: int, pack_documents: bool, tokens: TokenPolicy, on_error: OnError
) -> Units:
    """The units of ``corpus`` (see `layertap.extract.units`) and which of their tokens are stored."""
    if max_length < 1:
        raise ArgumentError(f"max_length must be at least 1, got {max_length}")
    good, skipped = [], []
    for i, doc in enumerate(corpus.docs):
        problem = _bad(corpus, i, doc)
        if problem is None:
            good.append(i)
        elif on_error == "skip":
            skipped.append(SkippedSample(i, corpus.id_of(i), f"DataError: the document {problem}"))
        else:
            raise DataError(f"document {i} ({corpus.id_of(i)!r}) of {corpus.description} {problem}: fix it, or pass on_error='skip' to leave it out")
    ids, special = _token_ids(corpus, tokenizer, good, max_length, pack_documents)
    if pack_documents:
        ids, special, docs = pack(ids, special, good, _separator(tokenizer), max_length)
        units = Units.of(ids, special, tokens=tokens, docs=docs)
    else:
        units = Units.of(ids, special, tokens=tokens, docs=[[d] * len(i) for d, i in zip(good, ids)])
    units.skipped, units.num_documents = skipped, len(corpus)
    return units


def _token_ids(corpus: Corpus, tokenizer: Any, good: list[int], max_length: int, packing: bool) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """Each good document's token ids and special-token mask (truncated unless ``packing``)."""
    limit = None if packing else max_length
    if corpus.pretokenized:
        ids = [np.asarray(corpus.docs[i], dtype=np.int64)[:limit] for i in good]
        return ids, [_special_mask(tokenizer, i) for i in ids]
    if tokenizer is None:
        raise ArgumentError("texts are strings, so a tokenizer is needed: pass tokenizer=, or give token ids")
    ids = []
    for start in range(0, len(good), _BATCH):
        texts = [corpus.docs[i] for i in good[start : start + _BATCH]]
        out = tokenizer(
            texts,
            add_special_tokens=not packing,
            truncation=not packing,
            max_length=limit,
            return_attention_mask=False,
            return_token_type_ids=False,
        )
        ids += [np.asarray(i, dtype=np.int64) for i in out["input_ids"]]
        longest = max(map(len, out["input_ids"]), default=0)
        if limit is not None and longest > limit:  # truncation cannot cut the special tokens it adds: it keeps them all
            added = tokenizer.num_special_tokens_to_add() if hasattr(tokenizer, "num_special_tokens_to_add") else longest - 1
            raise ArgumentError(
                f"max_length={limit} is shorter than the {added} special tokens the tokenizer adds to every document, so it "
                f"returned {longest} tokens for one: pass max_length={added + 1} or more (or pack=True)"
            )
    # special by id, as for token ids given: the tokenizer's own special_tokens_mask marks only the
    # tokens it added, not a [SEP] or [UNK] inside the text
    return ids, [_special_mask(tokenizer, i) for i in ids]
