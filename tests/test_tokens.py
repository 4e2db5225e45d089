"""Token extraction (layertap.extract_tokens) against independent references.

The reference of every stored row is the Hugging Face model run on that document (or packed
context) alone: input_ids of shape [1, L], no padding, no attention mask, ``output_hidden_states``
(``hidden_states[i + 1]`` is layer i's output; the last entry is after the final norm). The units
are rebuilt here from the tokenizer itself (``tokenizer(doc, truncation=True)``; packing by hand),
so token ids, documents and positions are checked against them too.

Models: pretrained MiniLM (BERT), a random GPT-2 (learned positions) with a byte-level BPE adding
BOS/EOS, and a random Llama (RoPE) with MiniLM's WordPiece (CLS/SEP); both tokenizers pad on the
*left*, which layertap must ignore. Documents of 3 to about 60 tokens share batches of 4.
"""

from __future__ import annotations

import csv
import json
import warnings
from functools import cache

import h5py
import numpy as np
import pytest
import tokens_models as tm
import torch
import transformers
import zarr

import layertap
from layertap.errors import DataError

MINILM_TOL = 2e-5  # float32, pretrained: batched (right-padded, masked) vs alone
RANDOM_TOL = 1e-4  # float32, random tiny models
TEXTS = tm.corpus(12)  # 1..55 words: 3..~60 tokens
BPE_TEXTS = tm.corpus(60, seed=1)  # what the BPE is trained on


def every_token(ids: torch.Tensor, mask: torch.Tensor, special: torch.Tensor) -> torch.Tensor:
    return torch.ones_like(ids, dtype=torch.bool)


def odd_rule(ids: torch.Tensor, mask: torch.Tensor, special: torch.Tensor) -> torch.Tensor:
    """A policy of its own: ids divisible by 3, and position 1, never a special token."""
    return mask.bool() & ~special.bool() & ((ids % 3 == 0) | (torch.arange(len(ids)) == 1))


# ------------------------------------------------------------------------------- references
class Ref:
    """A model, its tokenizer and layers (name -> hidden_states index), and its documents' runs alone."""

    def __init__(self, model: torch.nn.Module, tokenizer, layers: dict[str, int]) -> None:
        self.model, self.tokenizer, self.layers = model, tokenizer, layers
        self._alone = cache(self._run)

    def _run(self, ids: tuple[int, ...]) -> tuple[torch.Tensor, ...]:
        with torch.no_grad():
            out = self.model(input_ids=torch.tensor([ids]), output_hidden_states=True)
        return tuple(h[0] for h in out.hidden_states)

    def alone(self, ids: np.ndarray) -> tuple[torch.Tensor, ...]:
        return self._alone(tuple(int(i) for i in ids))

    def doc_units(self, texts: list, max_length: int, indices: list[int] | None = None) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """(ids, special mask, docs) of each document, tokenized alone and truncated."""
        units = []
        for i in indices if indices is not None else range(len(texts)):
            enc = self.tokenizer(texts[i], truncation=True, max_length=max_length, return_special_tokens_mask=True)
            ids = np.asarray(enc["input_ids"])
            units.append((ids, np.asarray(enc["special_tokens_mask"], dtype=bool), np.full(len(ids), i)))
        return units

    def packed_units(self, texts: list[str], max_length: int, separator: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
        """Documents without special tokens, each followed by ``separator``, cut every ``max_length``."""
        pieces = [self.tokenizer(t, add_special_tokens=False)["input_ids"] + [separator] for t in texts]
        ids = np.concatenate(pieces)
        special = np.concatenate([[False] * (len(p) - 1) + [True] for p in pieces])
        docs = np.concatenate([np.full(len(p), i) for i, p in enumerate(pieces)])
        cuts = range(0, len(ids), max_length)
        return [(ids[c : c + max_length], special[c : c + max_length], docs[c : c + max_length]) for c in cuts]


def select(tokens, ids: np.ndarray, special: np.ndarray, ends: np.ndarray) -> np.ndarray:
    """The positions a policy keeps in one unit, by the contract (not by layertap)."""
    if tokens in ("real", "all"):
        return np.arange(len(ids))
    if tokens == "no_special":
        return np.flatnonzero(~special)
    if tokens == "last":
        return np.flatnonzero(ends)
    t = torch.from_numpy(ids)
    return np.flatnonzero(tokens(t, torch.ones_like(t), torch.from_numpy(special.astype(np.int64))).numpy())


def expected(ref: Ref, units, tokens) -> dict[str, np.ndarray | torch.Tensor]:
    """The rows of ``units`` under ``tokens``: ids, documents, positions and each layer's features."""
    flat_docs = np.concatenate([d for _, _, d in units])
    last = np.append(flat_docs[1:] != flat_docs[:-1], True)  # a document's last token, across contexts
    ends = np.split(last, np.cumsum([len(d) for _, _, d in units])[:-1])
    rows: dict[str, list] = {"token_ids": [], "docs": [], "positions": [], **{k: [] for k in ref.layers}}
    for (ids, special, docs), end in zip(units, ends):
        keep = select(tokens, ids, special, end)
        hidden = ref.alone(ids)
        rows["token_ids"].append(ids[keep])
        rows["docs"].append(docs[keep])
        rows["positions"].append(keep)
        for layer, k in ref.layers.items():
            rows[layer].append(hidden[k][torch.from_numpy(keep)])
    return {k: torch.cat(v) if k in ref.layers else np.concatenate(v) for k, v in rows.items()}


def check(store: layertap.TokenStore, ref: Ref, units, tokens="real", tol: float = RANDOM_TOL) -> None:
    want = expected(ref, units, tokens)
    n = len(want["token_ids"])
    assert store.complete and len(store) == n and store.card["num_tokens"] == n
    assert np.array_equal(np.asarray(store.token_ids), want["token_ids"])
    assert np.array_equal(np.asarray(store.docs), want["docs"])
    assert np.array_equal(np.asarray(store.positions), want["positions"])
    for layer in ref.layers:
        got = store.read(layer, 0, n).float()
        assert got.shape == want[layer].shape, layer
        torch.testing.assert_close(got, want[layer], atol=tol, rtol=tol, msg=lambda m, layer=layer: f"{layer}: {m}")


# --------------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def minilm(one_thread):
    path = tm.minilm_path()
    return Ref(transformers.AutoModel.from_pretrained(path).eval(), tm.minilm_tokenizer(), {"embeddings": 0, "encoder.layer.0": 1, "encoder.layer.5": 6})


@pytest.fixture(scope="module")
def llama(one_thread):
    return Ref(tm.llama(), tm.minilm_tokenizer(), {"layers.0": 1, "norm": 2})


@pytest.fixture(scope="module")
def gpt2(one_thread):
    tokenizer = tm.bpe_tokenizer(BPE_TEXTS)
    return Ref(tm.gpt2(len(tokenizer)), tokenizer, {"transformer.h.0": 1, "transformer.ln_f": 2})


@pytest.fixture(scope="module")
def refs(llama, gpt2):
    return {"llama": llama, "gpt2": gpt2}


def run(ref: Ref, texts, out, **options) -> layertap.TokenStore:
    options = {"tokenizer": ref.tokenizer, "batch_size": 4, "progress": False, **options}
    return layertap.extract_tokens(ref.model, texts, list(ref.layers), out=out, **options)


@pytest.fixture(scope="module")
def stores(llama, tmp_path_factory):
    """The Llama's stores of TEXTS, by dtype (made when first asked for)."""
    folder, made = tmp_path_factory.mktemp("dtypes"), {}

    def get(dtype: torch.dtype | None = None) -> layertap.TokenStore:
        if dtype not in made:
            made[dtype] = run(llama, TEXTS, folder / f"{dtype}.zarr", dtype=dtype)
        return made[dtype]

    return get


# ------------------------------------------------------------------------------- exactness
def test_the_corpus_mixes_short_and_long_documents(llama):
    lengths = [len(llama.tokenizer(t)["input_ids"]) for t in TEXTS]
    assert min(lengths) <= 3 and max(lengths) >= 55 and max(lengths) <= 64


def test_minilm_rows_equal_each_document_run_alone(minilm, tmp_path):
    store = run(minilm, TEXTS, tmp_path / "m.zarr")
    check(store, minilm, minilm.doc_units(TEXTS, 512), tol=MINILM_TOL)
    assert store.card["max_length"] == 512 and store["encoder.layer.5"].shape == (len(store), 384)


def test_minilm_without_a_tokenizer_uses_the_one_saved_beside_it(one_thread, tmp_path):
    model = layertap.load_model(f"hf:{tm.minilm_path()}")
    store = layertap.extract_tokens(model, TEXTS[:3], "encoder.layer.0", out=tmp_path / "d.zarr", progress=False)
    saved = transformers.AutoTokenizer.from_pretrained(tm.minilm_path())
    assert np.array_equal(np.asarray(store.token_ids), np.concatenate([saved(t)["input_ids"] for t in TEXTS[:3]]))


def test_a_folder_named_inside_a_config_is_never_read_for_a_tokenizer(minilm, tmp_path):
    # from_pretrained sets _name_or_path, and so can any config.json: layertap follows only a folder the user named
    assert minilm.model.config._name_or_path == str(tm.minilm_path())
    with pytest.raises(layertap.errors.ArgumentError, match="pass tokenizer="):
        layertap.extract_tokens(minilm.model, TEXTS[:3], "encoder.layer.0", out=tmp_path / "d.zarr", progress=False)
    assert not (tmp_path / "d.zarr").exists()


@pytest.mark.parametrize("tokens", ["real", "all", "no_special", "last", odd_rule], ids=["real", "all", "no_special", "last", "callable"])
@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_every_policy_stores_the_rows_of_each_document_run_alone(refs, name, tokens, tmp_path):
    ref = refs[name]
    store = run(ref, TEXTS, tmp_path / "s.zarr", tokens=tokens)
    units = ref.doc_units(TEXTS, 64)
    check(store, ref, units, tokens)
    specials = set(ref.tokenizer.all_special_ids) - {ref.tokenizer.unk_token_id}
    stored = set(np.asarray(store.token_ids).tolist())
    if tokens in ("no_special", odd_rule):
        assert not stored & specials
    if tokens in ("real", "all"):  # special tokens kept: each document's first and last
        assert len(store) == sum(len(i) for i, _, _ in units) and {units[0][0][0], units[0][0][-1]} <= stored & specials
    if tokens == "last":
        assert np.array_equal(np.asarray(store.docs), np.arange(len(TEXTS)))


def test_a_policy_that_keeps_everything_equals_real(llama, stores, tmp_path):
    store = run(llama, TEXTS, tmp_path / "c.zarr", tokens=every_token)
    base = stores()
    for key in ["layers.0", "norm"]:
        assert np.array_equal(np.asarray(store[key]), np.asarray(base[key]))


def test_documents_longer_than_max_length_are_truncated(llama, tmp_path):
    store = run(llama, TEXTS, tmp_path / "t.zarr", max_length=16)
    units = llama.doc_units(TEXTS, 16)
    assert max(len(i) for i, _, _ in units) == 16 and store.card["max_length"] == 16
    check(store, llama, units)


@pytest.mark.parametrize("name", ["gpt2", "llama"])
def test_packed_contexts_each_equal_the_context_run_alone(refs, name, tmp_path):
    ref = refs[name]
    # GPT-2's BPE has an EOS; MiniLM's WordPiece only a SEP
    separator = ref.tokenizer.eos_token_id if name == "gpt2" else ref.tokenizer.sep_token_id
    store = run(ref, TEXTS, tmp_path / "p.zarr", pack=True, max_length=16)
    units = ref.packed_units(TEXTS, 16, separator)
    check(store, ref, units)
    starts = np.flatnonzero(np.asarray(store.positions) == 0)
    lengths = np.diff(np.append(starts, len(store)))
    assert len(lengths) == len(units) > 10 and (lengths[:-1] == 16).all() and 1 <= lengths[-1] <= 16
    assert store.card["pack"] is True and store.card["num_documents"] == len(TEXTS)


@pytest.mark.parametrize("tokens", ["last", "no_special", odd_rule], ids=["last", "no_special", "callable"])
def test_packed_policies_pick_the_rows_of_the_contexts_run_alone(gpt2, tokens, tmp_path):
    store = run(gpt2, TEXTS, tmp_path / "pl.zarr", pack=True, max_length=16, tokens=tokens)
    check(store, gpt2, gpt2.packed_units(TEXTS, 16, gpt2.tokenizer.eos_token_id), tokens)
    separators = np.asarray(store.token_ids) == gpt2.tokenizer.eos_token_id
    if tokens == "last":  # one row per document: its separator
        assert np.array_equal(np.asarray(store.docs), np.arange(len(TEXTS))) and separators.all()
    else:
        assert not separators.any()


def test_an_attention_op_is_stored_per_token_even_when_the_heads_are_as_many_as_the_tokens(llama, tmp_path):
    """SDPA gives [batch, heads, tokens, head_dim]: stored as [tokens, heads * head_dim], the input
    of o_proj. The first batch is padded to 4 tokens, as many as the Llama's 4 heads."""
    texts = ["cat dog", "a", TEXTS[0], "quiet rivers"]
    lengths = [len(llama.tokenizer(t)["input_ids"]) for t in texts]
    assert max(lengths[:2]) == llama.model.config.num_attention_heads == 4 and lengths[2] > 4
    layer = "layers.0.self_attn:scaled_dot_product_attention"
    store = layertap.extract_tokens(llama.model, texts, layer, out=tmp_path / "a.zarr", tokenizer=llama.tokenizer, batch_size=2, progress=False)
    seen = []
    hook = llama.model.layers[0].self_attn.o_proj.register_forward_pre_hook(lambda module, args: seen.append(args[0][0]))
    try:
        for t in texts:  # each alone, not from the cache: the hook must see it run
            with torch.no_grad():
                llama.model(input_ids=torch.tensor([llama.tokenizer(t)["input_ids"]]))
    finally:
        hook.remove()
    docs = np.asarray(store.docs)
    assert np.array_equal(docs, np.repeat(np.arange(len(texts)), lengths))
    for i, want in enumerate(seen):
        got = torch.from_numpy(np.asarray(store[layer])[docs == i])
        torch.testing.assert_close(got, want, atol=RANDOM_TOL, rtol=RANDOM_TOL, msg=lambda m, i=i: f"document {i} ({lengths[i]} tokens, batch {i // 2}): {m}")


def test_limit_keeps_the_first_documents(llama, tmp_path):
    store = run(llama, TEXTS, tmp_path / "l.zarr", limit=5)
    check(store, llama, llama.doc_units(TEXTS, 64, list(range(5))))
    assert store.card["num_documents"] == 5


# ---------------------------------------------------------------------------------- inputs
def _records(path, rows: list[dict]):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _corpus(form: str, tmp_path, tokenizer):
    """TEXTS as ``form``: (texts argument, options, expected doc_ids or None for indices)."""
    ids = [f"doc-{i}" for i in range(len(TEXTS))]
    if form == "txt":
        (tmp_path / "c.txt").write_text("\n".join(TEXTS) + "\n")
        return tmp_path / "c.txt", {}, None
    if form == "jsonl":
        return tm.write_jsonl(tmp_path / "c.jsonl", TEXTS), {"id_field": "id"}, ids
    if form == "json":
        (tmp_path / "c.json").write_text(json.dumps([{"body": t, "key": k} for t, k in zip(TEXTS, ids)]))
        return tmp_path / "c.json", {"text_field": "body", "id_field": "key"}, ids
    if form == "csv":
        with open(tmp_path / "c.csv", "w", newline="") as f:
            writer = csv.DictWriter(f, ["id", "text"])
            writer.writeheader()
            writer.writerows({"id": k, "text": t} for k, t in zip(ids, TEXTS))
        return tmp_path / "c.csv", {"id_field": "id"}, ids
    if form == "parquet":
        import pyarrow as pa
        import pyarrow.parquet as pq

        pq.write_table(pa.table({"text": TEXTS, "n": list(range(100, 100 + len(TEXTS)))}), tmp_path / "c.parquet")
        return tmp_path / "c.parquet", {"id_field": "n"}, list(range(100, 100 + len(TEXTS)))
    if form == "dataset":
        import datasets  # in the test extra (pyproject.toml)

        return datasets.Dataset.from_dict({"text": TEXTS, "id": ids}), {"id_field": "id"}, ids
    tokenized = [tokenizer(t)["input_ids"] for t in TEXTS]
    if form == "token lists":
        return tokenized, {"tokenizer": None}, None
    if form == "token arrays":
        return [np.asarray(t, dtype=np.int32) for t in tokenized], {"tokenizer": None}, None
    assert form == "input_ids dict"
    return {"input_ids": tokenized}, {}, None


@pytest.mark.parametrize("form", ["txt", "jsonl", "json", "csv", "parquet", "dataset", "token lists", "token arrays", "input_ids dict"])
def test_every_input_form_gives_the_store_of_the_list_of_strings(llama, stores, form, tmp_path):
    texts, options, doc_ids = _corpus(form, tmp_path, llama.tokenizer)
    store = run(llama, texts, tmp_path / "s.zarr", **options)
    base = stores()
    assert len(store) == len(base)
    for key in ["token_ids", "docs", "positions"]:
        assert np.array_equal(np.asarray(getattr(store, key)), np.asarray(getattr(base, key))), key
    for key in llama.layers:  # the same batches: bit for bit
        assert np.array_equal(np.asarray(store[key]), np.asarray(base[key])), key
    want = np.arange(len(TEXTS)) if doc_ids is None else np.array(doc_ids)
    assert np.array_equal(store.doc_ids, want) and store.card["num_documents"] == len(TEXTS)


BAD = {
    "missing": ([TEXTS[0], None, TEXTS[2]], 1, "is missing"),
    "a number": ([TEXTS[0], TEXTS[1], 7], 2, "is a int, not a string"),
    "a list of words": ([["a", "cat"], TEXTS[1]], 0, "is a list, not a string"),
    "float token ids": ([[2.0, 9.0], [3.0]], 0, "is a list of float64 numbers, not a string or token ids (integers: cast them"),
}


@pytest.mark.parametrize("case", BAD)
def test_a_bad_document_is_a_one_line_error_naming_its_index(llama, case, tmp_path):
    texts, index, what = BAD[case]
    with pytest.raises(DataError) as e:
        run(llama, texts, tmp_path / "e.zarr")
    message = str(e.value)
    assert "\n" not in message and f"document {index}" in message and what in message and "on_error='skip'" in message


def test_a_record_without_text_is_named_by_its_index(llama, tmp_path):
    path = _records(tmp_path / "c.jsonl", [{"id": "a", "text": TEXTS[0]}, {"id": "b", "body": TEXTS[1]}, {"id": "c", "text": TEXTS[2]}])
    with pytest.raises(DataError) as e:
        run(llama, path, tmp_path / "e.zarr", id_field="id")
    assert "\n" not in str(e.value) and "document 1" in str(e.value) and "'b'" in str(e.value)


def test_a_null_in_a_parquet_file_is_named_by_its_index(llama, tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": [TEXTS[0], TEXTS[1], None, TEXTS[3]]}), tmp_path / "c.parquet")
    with pytest.raises(DataError) as e:
        run(llama, tmp_path / "c.parquet", tmp_path / "e.zarr")
    assert "\n" not in str(e.value) and "document 2" in str(e.value)
    store = run(llama, tmp_path / "c.parquet", tmp_path / "k.zarr", on_error="skip")
    assert [s[0] for s in store.card["skipped"]] == [2] and set(np.asarray(store.docs).tolist()) == {0, 1, 3}


def test_skipped_documents_are_left_out_and_recorded(llama, tmp_path):
    texts = [TEXTS[0], None, TEXTS[2], 5, TEXTS[4], TEXTS[5]]
    store = run(llama, texts, tmp_path / "k.zarr", on_error="skip")
    good = [0, 2, 4, 5]
    check(store, llama, llama.doc_units(texts, 64, good))
    assert [s[0] for s in store.card["skipped"]] == [1, 3] and store.card["num_documents"] == len(texts)
    assert set(np.unique(np.asarray(store.docs)).tolist()) == set(good)


# ---------------------------------------------------------------------------------- stores
@pytest.mark.parametrize("name, options, kind", [("s.h5", {}, h5py.Dataset), ("s", {"format": "npy"}, np.ndarray), ("s.zarr", {"format": "zarr"}, zarr.Array)])
def test_every_format_stores_the_same_rows(llama, stores, tmp_path, name, options, kind):
    store = run(llama, TEXTS, tmp_path / name, **options)
    base = stores()
    assert isinstance(base["norm"], zarr.Array)  # the default
    reopened = layertap.open_tokens(tmp_path / name)
    for s in (store, reopened):
        for key in llama.layers:
            assert isinstance(s[key], kind) and np.array_equal(np.asarray(s[key]), np.asarray(base[key])), key
        for key in ["token_ids", "docs", "positions"]:
            assert np.array_equal(np.asarray(getattr(s, key)), np.asarray(getattr(base, key))), key
    assert reopened.card == store.card and reopened.complete
    reopened.close()


def test_float16_stores_two_bytes_within_float16_rounding(llama, stores):
    half, full = stores(torch.float16), stores()
    assert half.dtype == torch.float16 and half.card["dtype"] == "float16"
    for key in llama.layers:
        raw = np.asarray(half[key])
        assert raw.dtype == np.float16 and raw.itemsize == 2
        # the float32 computation, rounded once: at most half a float16 ulp (2**-11 relative) away
        torch.testing.assert_close(half.read(key, 0, len(half)).float(), full.read(key, 0, len(full)), rtol=2**-11, atol=2**-25)
    check(half, llama, llama.doc_units(TEXTS, 64), tol=1e-3)  # and to the documents run alone


@pytest.mark.parametrize("name, options", [("zarr", {}), ("s.h5", {}), ("s", {"format": "npy"})], ids=["zarr", "hdf5", "npy"])
def test_bfloat16_is_stored_as_its_bits_and_read_back(llama, stores, tmp_path, name, options):
    brain = stores(torch.bfloat16) if name == "zarr" else run(llama, TEXTS, tmp_path / name, dtype=torch.bfloat16, **options)
    full = stores()
    assert brain.dtype == torch.bfloat16 and brain.card["dtype"] == "bfloat16"
    for key in llama.layers:
        want = full.read(key, 0, len(full)).to(torch.bfloat16)
        got = brain.read(key, 0, len(brain))
        assert got.dtype == torch.bfloat16 and torch.equal(got, want), key
        raw = np.asarray(brain[key])
        assert raw.itemsize == 2 and raw.dtype.kind in "iu"  # the raw 16 bits, as int16 or uint16
        assert np.array_equal(raw.view(np.uint16), want.view(torch.int16).numpy().view(np.uint16)), key
        assert torch.equal(brain.read(key, 5, 9), want[5:9])


@pytest.mark.parametrize("dtype", [None, torch.float16, torch.bfloat16], ids=["float32", "float16", "bfloat16"])
def test_stats_are_the_moments_of_the_stored_rows(llama, stores, dtype):
    store = stores(dtype)
    assert set(store.stats) == set(llama.layers)
    for key in llama.layers:
        rows = store.read(key, 0, len(store)).double().numpy()
        s = store.stats[key]
        assert s.count == len(store) == len(rows)
        # mean and std are kept as float32 numbers
        np.testing.assert_allclose(s.mean, rows.mean(0), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(s.std, rows.std(0), rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(s.mean_norm, np.linalg.norm(rows, axis=1).mean(), rtol=1e-9)


def test_the_card_says_what_made_the_store(llama, stores):
    store = stores()
    card = store.card
    n = sum(len(llama.tokenizer(t)["input_ids"]) for t in TEXTS)
    assert card["num_tokens"] == len(store) == n and card["num_documents"] == len(TEXTS) and card["num_units"] == len(TEXTS)
    assert card["layers"] == store.layers == list(llama.layers)
    assert card["tokens"] == "real" and card["max_length"] == 64 and card["pack"] is False and card["dtype"] is None
    assert card["skipped"] == [] and card["doc_ids"] is None and card["layertap"] == layertap.__version__
    assert card["tokenizer"]["hash"] and card["tokenizer"]["class"] == type(llama.tokenizer).__name__ and card["model"]
    assert len(np.unique(np.asarray(store.docs))) == len(TEXTS)


def test_chunk_moments_in_any_order_equal_a_read_back_in_chunk_order():
    """The statistics taken from chunks as they are written (out of order, some written before and
    read back, some beyond what is held ahead) equal, bit for bit, each chunk read back in order."""
    from types import SimpleNamespace

    from layertap.extract.tokens import _ChunkMoments, _Moments
    from layertap.store.format import ArraySpec

    size, n = 5, 48
    rows = torch.randn(n, 3, 4, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16).view(torch.int16).numpy()
    spec = ArraySpec("h", "features/h", "h", None, (3, 4), "int16")
    store = SimpleNamespace(
        specs=[spec, ArraySpec("@docs", "features/@docs", "@docs", None, (), "int64")],
        num_chunks=-(-n // size),
        chunk_range=lambda c: (c * size, min(n, (c + 1) * size)),
        backend=SimpleNamespace(array=lambda path: rows),
    )
    done = [0, 4]
    moments = _ChunkMoments(store, SimpleNamespace(rank=0, world=1), done)
    moments.AHEAD = 3
    for c in [2, 1, 3, 9, 8, 7, 6, 5]:  # 1, 2, 3 wait for 0 (read back); 9 .. 6 are more than 3 ahead
        start, end = store.chunk_range(c)
        moments.written(c, {"h": rows[start:end].copy(), "@docs": np.zeros(end - start, dtype=np.int64)})
    got = moments.total()["h"]
    want = _Moments(12)
    for c in range(store.num_chunks):
        start, end = store.chunk_range(c)
        want.merge(_Moments.of(torch.from_numpy(rows[start:end]).view(torch.bfloat16)))
    assert got.n == n and np.array_equal(got.mean, want.mean) and np.array_equal(got.m2, want.m2) and got.norms == want.norms
    reference = torch.from_numpy(rows).view(torch.bfloat16).double().reshape(n, -1).numpy()
    np.testing.assert_allclose(got.mean, reference.mean(0), rtol=1e-12)
    np.testing.assert_allclose(got.m2 / n, reference.var(0), rtol=1e-10)


# ------------------------------------------------------------------ what would make rows depend on their batch
def test_a_model_in_training_mode_is_refused(tmp_path):
    model = tm.llama().train()  # dropout: every run another row
    model.config.attention_dropout = 0.5
    with pytest.raises(layertap.ArgumentError, match=r"training mode.*model\.eval\(\)"):
        layertap.extract_tokens(model, TEXTS[:2], "layers.0", out=tmp_path / "s.zarr", tokenizer=tm.minilm_tokenizer(), progress=False)
    assert not (tmp_path / "s.zarr").exists()


def rope_llama(kind: str) -> Ref:
    """A Llama whose rotary frequencies depend on the sequence's length above 8 tokens."""
    rope = {"rope_type": "dynamic", "factor": 4.0} if kind == "dynamic" else {
        "rope_type": "longrope", "short_factor": [1.0] * 4, "long_factor": [8.0] * 4, "original_max_position_embeddings": 8,
    }  # fmt: skip
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, vocab_size=30522,
        max_position_embeddings=8 if kind == "dynamic" else 64, pad_token_id=0, initializer_range=0.5, rope_scaling=rope,
    )  # fmt: skip
    return Ref(transformers.LlamaModel(config).eval(), tm.minilm_tokenizer(), {"layers.0": 1, "norm": 2})


@pytest.mark.parametrize("kind", ["dynamic", "longrope"])
def test_rotary_positions_that_change_with_the_length_are_refused_above_it(kind, tmp_path):
    ref = rope_llama(kind)
    texts = ["a cat", "the dogs ran far away from the house into the old dark wood"]  # 4 and 15 tokens
    with pytest.raises(layertap.ArgumentError, match=rf"rope_type '{kind}'.*above 8 tokens.*max_length=8 or less"):
        run(ref, texts, tmp_path / "s.zarr", batch_size=2, max_length=64)  # a dynamic RoPE's default: its 8 positions
    assert not (tmp_path / "s.zarr").exists()
    # within the length the frequencies hold for, every row is its document's alone
    check(run(ref, texts, tmp_path / "short.zarr", max_length=8, batch_size=2), ref, ref.doc_units(texts, 8))


def test_longrope_alone_in_its_batch_is_exact_at_any_length(tmp_path):
    ref = rope_llama("longrope")  # its frequencies depend on the length of the call alone: a batch of one is the document alone
    texts = ["a cat", "the dogs ran far away from the house into the old dark wood"]
    check(run(ref, texts, tmp_path / "s.zarr", batch_size=1, max_length=64), ref, ref.doc_units(texts, 64))


def test_a_layer_that_runs_several_times_per_forward_is_refused(llama, tmp_path):
    # the run stops at a layer's first call: its other calls would be lost, silently
    albert = transformers.AlbertModel(transformers.AlbertConfig(
        vocab_size=30522, embedding_size=16, hidden_size=32, num_hidden_layers=3, num_attention_heads=4, intermediate_size=64,
        max_position_embeddings=64,
    )).eval()  # fmt: skip
    shared = "encoder.albert_layer_groups.0.albert_layers.0"  # one module, called by each of the 3 layers
    with pytest.raises(layertap.ArgumentError, match=rf"layer '{shared}' runs 3 times per forward"):
        layertap.extract_tokens(albert, TEXTS[:3], shared, out=tmp_path / "a.zarr", tokenizer=llama.tokenizer, progress=False)
    with pytest.raises(layertap.ArgumentError, match=r"'layers.0:add' runs 2 times per forward.*module:op#2"):  # the 2 residual sums
        layertap.extract_tokens(llama.model, TEXTS[:3], "layers.0:add", out=tmp_path / "b.zarr", tokenizer=llama.tokenizer, progress=False)
    store = layertap.extract_tokens(llama.model, TEXTS[:3], "layers.0:add#2", out=tmp_path / "c.zarr", tokenizer=llama.tokenizer, progress=False)
    assert store.complete and store.layers == ["layers.0:add#2"]


def test_a_unit_as_long_as_the_models_positions_runs(tmp_path):
    # absolute positions end at the model's last: nothing asks for one past it
    tokenizer = tm.bpe_tokenizer(BPE_TEXTS)
    torch.manual_seed(0)
    model = transformers.GPT2Model(transformers.GPT2Config(n_layer=1, n_embd=32, n_head=4, n_positions=16, vocab_size=len(tokenizer))).eval()
    ref = Ref(model, tokenizer, {"ln_f": 1})  # the last hidden state is ln_f's output
    texts = [BPE_TEXTS[0] * 4, BPE_TEXTS[1]]  # the first cut to the 16 positions
    store = run(ref, texts, tmp_path / "g.zarr")
    assert store.card["max_length"] == 16 and int(np.asarray(store.positions).max()) == 15
    check(store, ref, ref.doc_units(texts, 16))


def test_roberta_positions_after_the_padding_index_bound_the_default_length(tmp_path):
    # RoBERTa numbers real tokens from padding_idx + 1: 20 position embeddings hold 18 tokens
    tokenizer = tm.minilm_tokenizer()
    torch.manual_seed(0)
    config = transformers.RobertaConfig(vocab_size=30522, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=64,
                                        max_position_embeddings=20, pad_token_id=1)  # fmt: skip
    ref = Ref(transformers.RobertaModel(config).eval(), tokenizer, {"encoder.layer.0": 1})
    texts = [" ".join("abcdefghijklmnopqrstuvwxyz"), "short one"]
    limit = tokenizer.model_max_length
    tokenizer.model_max_length = int(1e30)  # as a tokenizer saved without a limit
    try:
        store = run(ref, texts, tmp_path / "r.zarr")
    finally:
        tokenizer.model_max_length = limit
    assert store.card["max_length"] == 18
    check(store, ref, ref.doc_units(texts, 18))


def test_values_beyond_float16_are_named_with_the_fix(tmp_path):
    model = tm.llama()
    with torch.no_grad():
        model.norm.weight.mul_(1e5)  # a residual stream past float16's 65,504
    ref = Ref(model, tm.minilm_tokenizer(), {"layers.0": 1, "norm": 2})
    with pytest.warns(UserWarning, match=r"rows of 'norm' hold inf or NaN.*torch\.bfloat16"):
        store = run(ref, TEXTS[:4], tmp_path / "h.zarr", dtype=torch.float16)
    assert np.isinf(np.asarray(store["norm"])).any() and np.isfinite(np.asarray(store["layers.0"])).all()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # bfloat16 holds them
        run(ref, TEXTS[:4], tmp_path / "b.zarr", dtype=torch.bfloat16)


def test_a_tokens_function_that_raises_is_named_with_its_unit(llama, tmp_path):
    def last_word(ids, mask, special):
        keep = torch.zeros(len(ids), dtype=torch.bool)
        keep[(special == 0).nonzero().max()] = True  # fails on a unit of special tokens only
        return keep

    with pytest.raises(layertap.ArgumentError, match=r"tokens= function raised RuntimeError .* on unit \d+ of 1 tokens \(1 special\)"):
        # one document, as long as a context: its separator makes a second context alone
        run(llama, TEXTS[:1], tmp_path / "p.zarr", tokens=last_word, pack=True, max_length=len(llama.tokenizer(TEXTS[0], add_special_tokens=False)["input_ids"]))
