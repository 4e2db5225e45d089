"""A token store from someone else is data: its card (documents, dtype, layers) and its token arrays
(documents, positions, token ids) are checked against each other when it is opened, so a crafted
one is refused in one line instead of reading garbage, wrapping a document index around, or
allocating what one JSON number asks for. Each store here is a small legit one, then tampered with."""

from __future__ import annotations

import shutil
import warnings
from pathlib import Path

import numpy as np
import pytest
import tokens_models as tm
import torch
from test_trust_store import FORMATS, one_line, read_meta, write_meta

import layertap
from layertap.errors import StoreError

LAYERS = ["layers.0", "norm"]
TEXTS = tm.corpus(6)
MAX_LENGTH = 64


@pytest.fixture(scope="module")
def made(tmp_path_factory, one_thread):
    """Legit token stores by (format, dtype), made when first asked for; tests tamper with copies."""
    folder, stores = tmp_path_factory.mktemp("legit"), {}
    model, tokenizer = tm.llama(), tm.minilm_tokenizer()

    def get(format: str, dtype: torch.dtype | None = None) -> Path:
        if (format, dtype) not in stores:
            out = folder / f"{str(dtype).replace('torch.', '')}-{FORMATS[format]}"
            layertap.extract_tokens(
                model, TEXTS, LAYERS, out=out, tokenizer=tokenizer, format=format, dtype=dtype, max_length=MAX_LENGTH, chunk_size=16, progress=False
            ).close()
            stores[format, dtype] = out
        return stores[format, dtype]

    return get


def copy(made, tmp_path: Path, format: str, dtype: torch.dtype | None = None) -> Path:
    source = made(format, dtype)
    out = tmp_path / source.name
    (shutil.copytree if source.is_dir() else shutil.copy)(source, out)
    return out


def edit_card(out: Path, format: str, **fields) -> None:
    meta = read_meta(out, format)
    meta["tokens"].update(fields)
    write_meta(out, format, meta)


def set_column(out: Path, format: str, key: str, change) -> None:
    """Rewrite the token array ``key`` of the store at ``out`` (same shape and dtype) with ``change(values)``."""
    path = next(a["path"] for a in read_meta(out, format)["arrays"] if a["key"] == key)
    if format == "npy":
        file = out / f"{path}.npy"
        values = np.load(file)
        change(values)
        np.save(file, values)
    elif format == "hdf5":
        import h5py

        with h5py.File(out, "r+") as f:
            values = f[path][:]
            change(values)
            f[path][:] = values
    else:
        import zarr

        array = zarr.open_group(str(out), mode="r+")[path]
        values = array[:]
        change(values)
        array[:] = values


def refused(out: Path, match: str) -> StoreError:
    with pytest.raises(StoreError, match=match) as e:
        layertap.open_tokens(out)
    assert one_line(e.value) and "extract again into a new path" in str(e.value)
    return e.value


# ------------------------------------------------------------------------------ num_documents
@pytest.mark.parametrize("value", [-3, True, 4.0, "6", None])
def test_a_num_documents_that_is_not_a_count_is_refused(made, tmp_path, value):
    out = copy(made, tmp_path, "npy")
    edit_card(out, "npy", num_documents=value)
    refused(out, "its token card's num_documents .* is not a count")


def test_a_num_documents_the_stored_tokens_disagree_with_is_refused(made, tmp_path):
    out = copy(made, tmp_path, "npy")
    with layertap.open_tokens(out) as store:
        last = int(np.asarray(store.docs).max())
        assert store.card["num_documents"] == len(TEXTS) == last + 1 and store.doc_ids.tolist() == list(range(len(TEXTS)))
    meta = read_meta(out, "npy")
    meta["tokens"]["num_documents"] = meta["settings"]["documents"] = last  # the last stored document would be outside
    write_meta(out, "npy", meta)
    refused(out, f"its token array '@docs' holds {last} at token .*, not a document index in \\[0, {last}\\)")
    edit_card(out, "npy", num_documents=len(TEXTS) + 1)  # one more than its settings say
    refused(out, f"its token card's num_documents {len(TEXTS) + 1} is not the number of documents its settings name")


def test_a_num_documents_that_would_make_doc_ids_a_memory_bomb_is_refused(made, tmp_path):
    out = copy(made, tmp_path, "npy")
    meta = read_meta(out, "npy")
    assert meta["tokens"]["doc_ids"] is None  # doc_ids would be np.arange(num_documents): 800 GB
    meta["tokens"]["num_documents"] = meta["settings"]["documents"] = 10**11  # consistent with its settings
    write_meta(out, "npy", meta)
    refused(out, "its token card counts 100000000000 documents, more than its [0-9]+ tokens and 0 skipped documents can be of")


# --------------------------------------------------------------------------- the token arrays
@pytest.mark.parametrize("format", list(FORMATS))
@pytest.mark.parametrize(
    "key, value, message",
    [
        ("@docs", -1, "'@docs' holds -1 at token 5, not a document index in \\[0, 6\\)"),
        ("@docs", 99, "'@docs' holds 99 at token 5, not a document index in \\[0, 6\\)"),
        ("@positions", -7, "'@positions' holds -7 at token 5, not a position in \\[0, 64\\)"),
        ("@positions", MAX_LENGTH, "'@positions' holds 64 at token 5, not a position in \\[0, 64\\)"),
        ("@token_ids", -(2**31), "'@token_ids' holds -2147483648 at token 5, not a token id from 0"),
    ],
    ids=["doc -1", "doc 99", "position -7", "position max_length", "token id -2**31"],
)
def test_token_arrays_out_of_range_are_refused_when_opened(made, tmp_path, format, key, value, message):
    out = copy(made, tmp_path, format)

    def change(values):
        values[5] = value

    set_column(out, format, key, change)
    refused(out, message)


def test_unwritten_chunks_of_an_incomplete_token_store_are_not_read_as_out_of_range(made, tmp_path):
    out = copy(made, tmp_path, "npy")
    meta = read_meta(out, "npy")
    meta["complete"] = False
    write_meta(out, "npy", meta)
    (out / "_chunks" / "000000001.json").unlink()  # chunk 1 (tokens 16 to 31) not written yet: its rows hold fill values

    def unwritten(values):
        values[16:32] = -1

    set_column(out, "npy", "@docs", unwritten)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # incomplete
        with layertap.open_tokens(out) as store:
            assert not store.complete and np.asarray(store.docs)[16] == -1
    set_column(out, "npy", "@docs", lambda values: values.__setitem__(15, -1))  # a written chunk's row: refused
    refused(out, "'@docs' holds -1 at token 15")


# -------------------------------------------------------------------------------- dtype, layers
@pytest.mark.parametrize(
    "stored, claimed, arrays",
    [(None, "bfloat16", "float32"), (None, "float16", "float32"), (torch.bfloat16, "float32", "int16"), (torch.bfloat16, None, "int16")],
    ids=["bfloat16 over float32", "float16 over float32", "float32 over bfloat16 bits", "none over bfloat16 bits"],
)
def test_a_card_dtype_other_than_how_the_arrays_are_stored_is_refused(made, tmp_path, stored, claimed, arrays):
    out = copy(made, tmp_path, "npy", stored)
    with layertap.open_tokens(out) as store:  # as written: its dtype is what read() gives
        assert store.dtype == store.read(LAYERS[0], 0, 2).dtype == (stored or torch.float32)
    edit_card(out, "npy", dtype=claimed)
    refused(out, f"its token card says its features are {claimed or 'of one float dtype'}, but its arrays are stored as \\['{arrays}'\\]")


@pytest.mark.parametrize(
    "layers",
    [[LAYERS[0], "@docs", LAYERS[0]], [LAYERS[0], LAYERS[0], LAYERS[1]], LAYERS[::-1], LAYERS[:1], [*LAYERS, "@positions"], "norm"],
    ids=["a token array and a repeat", "a repeat", "out of order", "one missing", "a token array", "not a list"],
)
def test_card_layers_other_than_the_feature_arrays_are_refused(made, tmp_path, layers):
    out = copy(made, tmp_path, "zarr")
    with layertap.open_tokens(out) as store:
        assert store.layers == LAYERS
    edit_card(out, "zarr", layers=layers)
    refused(out, "its token card's layers .* are not its feature arrays, \\['layers.0', 'norm'\\]")


@pytest.mark.parametrize("count", [-5, True, 2.5, None])
def test_a_statistics_count_that_is_not_a_count_is_refused(made, tmp_path, count):
    out = copy(made, tmp_path, "npy")
    meta = read_meta(out, "npy")
    for stats in meta["token_stats"].values():
        stats["count"] = count
    write_meta(out, "npy", meta)
    refused(out, r"its statistics of 'layers\.0' are not a count, a mean and std per feature, and a mean norm")


@pytest.mark.parametrize(
    "change, message",
    [
        ({"doc_ids": ["a", "a", "b", "c", "d", "e"]}, "its token card's document ids are not unique"),
        ({"doc_ids": [1, "1", 3, 4, 5, 6]}, "its token card's document ids are not unique"),
        ({"doc_ids": [True, 2, 3, 4, 5, 6]}, "its token card's document ids are not a list of one id"),
        ({"pack": "yes"}, "its token card's pack is not true or false, or its token policy is not a name"),
        ({"tokens": 5}, "its token card's pack is not true or false, or its token policy is not a name"),
        ({"num_tokens": 5}, "it is complete, but its token card's count or its statistics do not count its \\d+ tokens in every layer"),
    ],
    ids=["repeated ids", "an id as number and text", "a boolean id", "pack not a boolean", "policy not a name", "num_tokens"],
)
def test_a_card_that_contradicts_itself_or_its_arrays_is_refused(made, tmp_path, change, message):
    out = copy(made, tmp_path, "npy")
    with layertap.open_tokens(out) as store:
        assert store.card["num_documents"] == 6 and store.card["pack"] is False
    edit_card(out, "npy", **change)
    refused(out, message)


@pytest.mark.parametrize("change", ["drop a layer", "count one less", "drop all"])
def test_a_complete_store_whose_statistics_miss_tokens_or_layers_is_refused(made, tmp_path, change):
    """A complete store's statistics count every token of every layer: what would read as a bare
    KeyError, or as statistics of other rows, is refused when the store is opened."""
    out = copy(made, tmp_path, "npy")
    meta = read_meta(out, "npy")
    if change == "drop a layer":
        del meta["token_stats"][LAYERS[1]]
    elif change == "count one less":
        meta["token_stats"][LAYERS[0]]["count"] -= 1
    else:
        del meta["token_stats"]
    write_meta(out, "npy", meta)
    refused(out, "it is complete, but its token card's count or its statistics do not count its \\d+ tokens in every layer")


@pytest.mark.parametrize("format", ["zarr", "npy"])
def test_a_token_store_claiming_an_older_store_version_is_refused(made, tmp_path, format):
    """Version 1 stores have no per-chunk proof of their pieces, so a deleted feature chunk of a
    "complete" one read as fill values (NaN rows served for training). No token store was ever
    version 1: a token store that says so is crafted."""
    out = copy(made, tmp_path, format)
    meta = read_meta(out, format)
    meta["layertap_store"] = 1
    write_meta(out, format, meta)
    refused(out, "it says it is a layertap store of version 1, older than any token store")
