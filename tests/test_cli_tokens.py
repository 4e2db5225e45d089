"""`layertap extract --text` and `layertap inspect --text`: the command line of token extraction.

Each store the command writes is checked against the Python API run with the same arguments
(bit for bit: the same computation, in this process) and against the Hugging Face model run on
each document (or packed context) alone; `inspect --text`'s sizes against the real stores.

Model: the pretrained MiniLM (`hf:` its folder, so the tokenizer saved beside it is the
default), and for ``--tokenizer`` a random Llama of tests/tokens_models.py, which has none.
"""

from __future__ import annotations

import contextlib
import io
import json

import numpy as np
import pytest
import tokens_models as tm
import torch
import transformers
import zarr

import layertap
from layertap.cli import run
from layertap.extract.token_plan import token_sizes

MODEL = f"hf:{tm.minilm_path()}"
LAYERS = {"encoder.layer.0": 1, "encoder.layer.5": 6}  # layer -> hidden_states index
TOL = 2e-5  # float32, pretrained: batched (right-padded, masked) against a document alone
HALF = 1e-3  # float16 stores: one float16 ulp (2**-10 of the value at most) on top of TOL
TEXTS = tm.corpus(8)  # 1..55 words: 3..~60 tokens
MISSING = 5  # the .jsonl record without a text


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    root = tmp_path_factory.mktemp("cli_tokens")
    (root / "docs.txt").write_text("\n".join(TEXTS) + "\n")
    records = [{"key": f"d{i}", **({} if i == MISSING else {"body": t})} for i, t in enumerate(TEXTS)]
    (root / "docs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    return root


@pytest.fixture(scope="module")
def hf(one_thread):
    """The reference: MiniLM by transformers itself, and its tokenizer."""
    path = tm.minilm_path()
    return transformers.AutoModel.from_pretrained(path).eval(), transformers.AutoTokenizer.from_pretrained(path)


def alone(model, ids) -> tuple[torch.Tensor, ...]:
    with torch.no_grad():
        return tuple(h[0] for h in model(input_ids=torch.tensor([list(ids)]), output_hidden_states=True).hidden_states)


def extract(files, source, out, *extra) -> list[str]:
    args = ["extract", MODEL, "--text", str(files / source), "--out", str(files / out)]
    return [*args, *(a for layer in LAYERS for a in ("--layers", layer)), *extra]


def error_line(err: str) -> str:
    """The one line of a failure (beside transformers' own progress bar of loading weights)."""
    lines = [line for line in err.splitlines() if line.startswith("layertap: ")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


def assert_same(store: layertap.TokenStore, other: layertap.TokenStore) -> None:
    """Two stores of one computation: every array equal, bit for bit."""
    assert len(store) == len(other) and store.layers == other.layers
    for key in store.features:
        assert np.array_equal(np.asarray(store.features[key]), np.asarray(other.features[key])), key
    for field in ("tokens", "max_length", "pack", "dtype", "tokenizer", "doc_ids", "skipped"):
        assert store.card[field] == other.card[field], field


@pytest.fixture(scope="module")
def text_store(files, hf):
    """The store of docs.txt the command writes, whole (what several tests read)."""
    assert run(extract(files, "docs.txt", "a.zarr", "--batch-size", "4")) == 0
    return layertap.open_tokens(files / "a.zarr")


def test_extract_text_equals_the_api_and_each_document_alone(files, hf, text_store):
    model, tokenizer = hf
    store = text_store
    api = layertap.extract_tokens(layertap.load_model(MODEL), str(files / "docs.txt"), list(LAYERS), out=files / "api.zarr", batch_size=4, progress=False)
    assert_same(store, api)
    assert store.complete and store.card["max_length"] == 512 and store.card["tokenizer"]["name"] == tm.minilm_path()

    start = 0
    for doc, text in enumerate(TEXTS):
        ids = tokenizer(text, truncation=True, max_length=512)["input_ids"]
        rows = slice(start, start + len(ids))
        assert np.asarray(store.token_ids[rows]).tolist() == ids and set(np.asarray(store.docs[rows]).tolist()) == {doc}
        assert np.asarray(store.positions[rows]).tolist() == list(range(len(ids)))
        hidden = alone(model, ids)
        for layer, k in LAYERS.items():
            torch.testing.assert_close(store.read(layer, rows.start, rows.stop), hidden[k], atol=TOL, rtol=TOL, msg=lambda m, layer=layer: f"{layer}: {m}")
        start += len(ids)
    assert start == len(store)


def test_extract_text_resumes_refuses_other_settings_and_overwrites(files, hf, text_store, capsys):
    capsys.readouterr()
    assert run(extract(files, "docs.txt", "a.zarr", "--batch-size", "4")) == 0
    assert "already complete" in capsys.readouterr().err
    assert run(extract(files, "docs.txt", "a.zarr", "--batch-size", "4", "--max-length", "8")) == 1
    err = error_line(capsys.readouterr().err)
    assert "max_length 512, now 8" in err and "--overwrite" in err

    lengths = [min(8, len(hf[1](t)["input_ids"])) for t in TEXTS[:3]]
    assert run(extract(files, "docs.txt", "b", "--max-length", "8", "--limit", "3", "--format", "npy")) == 0
    assert f"wrote {sum(lengths)} tokens of 3 documents" in capsys.readouterr().out
    with layertap.open_tokens(files / "b") as small:
        assert small.features.format == "npy" and small.card["num_documents"] == 3
        assert np.asarray(small.positions).tolist() == [p for n in lengths for p in range(n)]
    assert run(extract(files, "docs.txt", "b", "--limit", "2", "--format", "npy", "--overwrite")) == 0
    with layertap.open_tokens(files / "b") as again:
        assert again.card["num_documents"] == 2 and again.card["max_length"] == 512


def packed_contexts(tokenizer, max_length: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """(ids, special, docs) of each context: the good documents without special tokens, each
    followed by SEP (MiniLM's WordPiece has no EOS), cut every ``max_length`` (by the contract)."""
    good = [i for i in range(len(TEXTS)) if i != MISSING]
    pieces = [tokenizer(TEXTS[i], add_special_tokens=False)["input_ids"] + [tokenizer.sep_token_id] for i in good]
    ids = np.concatenate(pieces)
    special = np.concatenate([[False] * (len(p) - 1) + [True] for p in pieces])
    docs = np.concatenate([np.full(len(p), i) for i, p in zip(good, pieces)])
    cuts = range(0, len(ids), max_length)
    return [(ids[c : c + max_length], special[c : c + max_length], docs[c : c + max_length]) for c in cuts]


PACKED = ["--text-field", "body", "--id-field", "key", "--pack", "--max-length", "24", "--tokens", "no_special", "--dtype", "float16", "--on-error", "skip"]


@pytest.fixture(scope="module")
def packed(files, hf):
    """The store of docs.jsonl the command writes, packed, and what it printed."""
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        assert run(extract(files, "docs.jsonl", "p.h5", "--batch-size", "3", *PACKED)) == 0
    return layertap.open_tokens(files / "p.h5"), printed.getvalue()


def test_extract_jsonl_packed_float16_equals_the_api_and_each_context_alone(files, hf, packed):
    model, tokenizer = hf
    store, out = packed
    assert f"skipped: document {MISSING} ('d{MISSING}')" in out and "(hdf5" in out
    api = layertap.extract_tokens(
        layertap.load_model(MODEL), str(files / "docs.jsonl"), list(LAYERS), out=files / "p-api.h5", batch_size=3, progress=False,
        text_field="body", id_field="key", pack=True, max_length=24, tokens="no_special", dtype=torch.float16, on_error="skip",
    )
    assert_same(store, api)
    assert store.doc_ids.tolist() == [f"d{i}" for i in range(len(TEXTS))] and store.dtype == torch.float16

    start = 0
    for ids, special, docs in packed_contexts(tokenizer, 24):
        keep = np.flatnonzero(~special)
        rows = slice(start, start + len(keep))
        assert np.asarray(store.token_ids[rows]).tolist() == ids[keep].tolist()
        assert np.asarray(store.docs[rows]).tolist() == docs[keep].tolist() and np.asarray(store.positions[rows]).tolist() == keep.tolist()
        hidden = alone(model, ids)
        for layer, k in LAYERS.items():
            torch.testing.assert_close(store.read(layer, rows.start, rows.stop).float(), hidden[k][keep], atol=TOL, rtol=HALF)
        start += len(keep)
    assert start == len(store) and MISSING not in np.asarray(store.docs)


def row_bytes(path, rows: int) -> int:
    """What a Zarr store's arrays of one entry per row (layers, token arrays, index) hold, uncompressed."""
    arrays = zarr.open_group(str(path), mode="r").members(max_depth=None)
    return sum(a.nbytes for _, a in arrays if isinstance(a, zarr.Array) and a.shape[:1] == (rows,))


def inspect_json(files, source, *extra) -> list[str]:
    return ["inspect", MODEL, "--text", str(files / source), *(a for layer in LAYERS for a in ("--layers", layer)), "--json", *extra]


def test_inspect_text_tells_the_size_of_the_store_extract_writes(files, text_store, capsys):
    capsys.readouterr()
    assert run(inspect_json(files, "docs.txt")) == 0
    sizes = json.loads(capsys.readouterr().out)
    store = text_store
    n = len(store)
    assert sizes["tokens"] == sizes["tokens_seen"] == n and sizes["documents"] == sizes["units"] == len(TEXTS)
    for layer in sizes["layers"]:
        array = store[layer["layer"]]
        assert layer["width"] == array.shape[1] and layer["dtype"] == "float32" and layer["bytes_per_token"] * n == array.nbytes
    written = row_bytes(store.path, n)
    assert abs(sizes["total_bytes"] - written) <= 0.05 * written and sizes["total_bytes"] == written  # exactly, in fact


def test_inspect_text_of_a_packed_float16_corpus(files, packed, capsys):
    store, _ = packed
    capsys.readouterr()
    assert run(inspect_json(files, "docs.jsonl", *PACKED)) == 0
    sizes = json.loads(capsys.readouterr().out)
    n = len(store)
    assert sizes["tokens"] == n and sizes["units"] == store.card["num_units"] and sizes["skipped"] == 1 and sizes["documents"] == len(TEXTS)
    assert sizes["tokens_seen"] == n + len(TEXTS) - 1  # each good document's separator is seen, not stored
    for layer in sizes["layers"]:
        assert layer["dtype"] == "float16" and layer["bytes_per_token"] * n == store[layer["layer"]].nbytes
    assert run(["inspect", MODEL, "--text", str(files / "docs.jsonl"), "--layers", "encoder.layer.5", *PACKED]) == 0
    table = capsys.readouterr().out
    assert "encoder.layer.5" in table and f"{n:,} stored of {sizes['tokens_seen']:,} seen" in table and "1 skipped" in table


def test_without_layers_every_layer_of_one_row_per_token_is_sized_and_extracts(files, hf, tmp_path):
    """Found by hand-written hooks on a padded batch of two documents: the modules whose first
    output tensor is [2, tokens, ...] (not MiniLM's position embeddings, [1, tokens, 384], shared by the batch)."""
    model, tokenizer = hf
    batch = tokenizer(TEXTS[:2], padding=True, return_tensors="pt")
    shapes = {}

    def first(value):  # the first tensor of an output: what a tap stores
        if isinstance(value, torch.Tensor):
            return value
        values = value.values() if isinstance(value, dict) else value if isinstance(value, (tuple, list)) else ()
        return next((t for t in map(first, values) if t is not None), None)

    hooks = [
        m.register_forward_hook(lambda m, i, o, name=name: shapes.__setitem__(name, first(o).shape))
        for name, m in model.named_modules()
        if name and name.count(".") < 3
    ]
    with torch.no_grad():
        model(**batch)
    for h in hooks:
        h.remove()
    per_token = [name for name, s in shapes.items() if len(s) >= 2 and s[0] == 2 and s[1] == batch["input_ids"].shape[1]]
    assert "encoder.layer.5" in per_token and "embeddings.position_embeddings" not in per_token and "pooler" not in per_token

    net = layertap.load_model(MODEL)
    sizes = token_sizes(net, TEXTS[:3], depth=3)
    assert sorted(s.layer for s in sizes.layers) == sorted(per_token)
    store = layertap.extract_tokens(net, TEXTS[:3], [s.layer for s in sizes.layers], out=tmp_path / "all.zarr", progress=False)
    assert sizes.tokens == len(store) and sizes.total_bytes == row_bytes(tmp_path / "all.zarr", len(store))


def test_tokenizer_from_a_folder_for_a_model_without_one(files, capsys):
    llama = ["extract", "tokens_models:llama", "--text", str(files / "docs.txt"), "--layers", "norm", "--no-progress"]
    assert run([*llama, "--out", str(files / "l0.zarr")]) == 1
    err = error_line(capsys.readouterr().err)
    assert "no tokenizer is known for this LlamaModel: give --tokenizer FOLDER" in err
    assert run([*llama, "--out", str(files / "l1.zarr"), "--tokenizer", str(files)]) == 1
    err = error_line(capsys.readouterr().err)
    assert f"no tokenizer could be read from {files}" in err and err.rstrip().endswith("give --tokenizer the folder a tokenizer was saved in")

    saved = files / "tokenizer"
    tm.minilm_tokenizer().save_pretrained(saved)
    assert run([*llama, "--out", str(files / "l.zarr"), "--tokenizer", str(saved), "--batch-size", "3"]) == 0
    store = layertap.open_tokens(files / "l.zarr")
    api = layertap.extract_tokens(tm.llama(), TEXTS, "norm", out=files / "l-api.zarr", tokenizer=tm.minilm_tokenizer(), batch_size=3, progress=False)
    assert np.array_equal(np.asarray(store["norm"]), np.asarray(api["norm"]))
    assert np.asarray(store.token_ids).tolist() == [i for t in TEXTS for i in tm.minilm_tokenizer()(t)["input_ids"]]
    assert store.card["max_length"] == 64  # the Llama's max_position_embeddings


def test_a_layer_without_one_row_per_token_is_one_line(files, capsys):
    assert run(["extract", MODEL, "--text", str(files / "docs.txt"), "--layers", "pooler", "--out", str(files / "pool.zarr"), "--no-progress"]) == 1
    err = error_line(capsys.readouterr().err)
    assert "layer 'pooler' gave shape [" in err and "one row per token" in err


@pytest.mark.parametrize(
    ("args", "named"),
    [
        (["extract", MODEL, "--text", "{txt}", "--reduce", "mean"], "'--reduce': it does not go with --text"),
        (["extract", MODEL, "--text", "{txt}", "--workers", "2"], "'--workers': it does not go with --text"),
        (["extract", MODEL, "--text", "{txt}", "--tokens", "some"], "'--tokens': 'some' is not one of real, all, no_special, last"),
        (["extract", MODEL, "--text", "{txt}", "--dtype", "int8"], "'--dtype': 'int8' is not one of"),
        (["extract", MODEL, "{root}", "--pack"], "'--pack': it is for a corpus: give --text FILE"),
        (["extract", MODEL, "{root}", "--text-field", "body"], "'--text-field': it is for a corpus"),
        (["extract", MODEL, "{root}", "--dtype", "bfloat16"], "'--dtype': 'bfloat16' is not one of float32, float16, float64"),
        (["extract", MODEL, "{root}", "--text", "{txt}"], "not both"),
        (["extract", MODEL], "give DATA (an image folder, an image or a .npy array) or --text FILE"),
        (["inspect", MODEL, "--text", "{txt}", "--input-shape", "1,16"], "'--input-shape': it does not go with --text"),
        (["inspect", MODEL, "--text", "{txt}", "--ops"], "'--ops': it does not go with --text"),
        (["inspect", MODEL, "--max-length", "8"], "'--max-length': it is for a corpus"),
    ],
)
def test_bad_combinations_are_usage_errors_in_one_line(files, args, named, capsys):
    out = files / "never.zarr"
    args = [a.format(txt=files / "docs.txt", root=files) for a in args]
    if args[0] == "extract":
        args += ["--layers", "encoder.layer.0", "--out", str(out)]
    assert run(args) == 2
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("Error:")]
    assert len(errors) == 1 and named in errors[0] and "Traceback" not in err
    assert not out.exists()
