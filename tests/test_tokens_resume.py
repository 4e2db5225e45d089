"""Token extraction (layertap.extract_tokens) interrupted and resumed, changed under the same
document ids, and shared by 2 processes under torchrun: each ends as the store of one
uninterrupted run in one process.

The model is tests/tokens_models.py's TinyLM (PyTorch alone, so a process starts quickly) with a
byte-level BPE saved to a file. The runs are real subprocesses (tests/tokens_models.py run as a
script): one killed with SIGKILL once some chunks are marked, one torchrun job of 2 CPU
processes (Gloo). Every run, here and there, uses one thread, so the same batch is the same
arithmetic, bit for bit.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import tokens_models as tm
import torch

import layertap
from layertap.store.writer import StoreWriter

SCRIPT = str(Path(__file__).parent / "tokens_models.py")
TEXTS = tm.corpus(40, seed=2, longest=40)  # about 900 tokens: 20 batches of 2 documents
CHUNK = 96  # tokens per chunk: about 10 chunks, most of them cutting a document in two
KILL_AT = 8  # batches begun when the run is killed
ENV = {**os.environ, "OMP_NUM_THREADS": "1"}
EXTRA = ["token_ids", "docs", "positions"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("corpus")


@pytest.fixture(scope="module")
def corpus(folder) -> Path:
    return tm.write_jsonl(folder / "c.jsonl", TEXTS)


@pytest.fixture(scope="module")
def tokenizer(folder) -> Path:
    tm.bpe_tokenizer(tm.corpus(60, seed=1), save=folder / "tokenizer.json")
    return folder / "tokenizer.json"


def extract(out: Path, corpus: Path, tokenizer: Path) -> layertap.TokenStore:
    return tm.extract(str(out), corpus, tokenizer, CHUNK)


@pytest.fixture(scope="module")
def whole(one_thread, corpus, tokenizer, tmp_path_factory) -> layertap.TokenStore:
    """The store of a run never interrupted, in this process."""
    return extract(tmp_path_factory.mktemp("whole") / "w.zarr", corpus, tokenizer)


def chunks(path: Path) -> tuple[set[int], int]:
    """The marked chunks of a store, and how many it has."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        writer = StoreWriter.open(path)
    try:
        return writer.done(), writer.num_chunks or 0
    finally:
        writer.close()


def assert_same(a: layertap.TokenStore, b: layertap.TokenStore) -> None:
    """Two stores of the same corpus hold the same rows, bit for bit."""
    assert a.complete and b.complete and len(a) == len(b) and a.layers == b.layers
    for key in EXTRA:
        assert np.array_equal(np.asarray(getattr(a, key)), np.asarray(getattr(b, key))), key
    for key in a.layers:
        assert np.array_equal(np.asarray(a[key]), np.asarray(b[key])), key
    assert np.array_equal(a.doc_ids, b.doc_ids)


def edited(corpus: Path, tmp_path: Path, doc: int, same_length: bool) -> tuple[Path, list[str]]:
    """The corpus with document ``doc``'s text changed under its id: one word for another (as
    many tokens), or a word added."""
    texts = list(TEXTS)
    words = texts[doc].split()
    words[0] = "cat" if words[0] != "cat" else "dog"
    texts[doc] = " ".join(words if same_length else [*words, "rivers"])
    return tm.write_jsonl(tmp_path / "changed.jsonl", texts), texts


def refused_or_redone(out: Path, changed: Path, tokenizer: Path, tmp_path: Path) -> None:
    """Resume ``out`` on the changed corpus: a one-line StoreError, or the store of a fresh run
    of the changed corpus. Never old rows beside new ones."""
    try:
        store = extract(out, changed, tokenizer)
    except layertap.StoreError as e:  # DataChangedError is one
        assert "\n" not in str(e), str(e)
        return
    assert_same(store, extract(tmp_path / "fresh.zarr", changed, tokenizer))


def test_the_corpus_spans_many_chunks(whole):
    done, total = chunks(whole.path)
    assert total >= 8 and done == set(range(total)) and len(whole) == whole.card["num_tokens"]
    lengths = np.bincount(np.asarray(whole.docs))
    assert lengths.min() <= 4 and lengths.max() >= 35


def test_killed_mid_run_it_resumes_to_the_store_of_an_uninterrupted_run(whole, corpus, tokenizer, tmp_path):
    out = tmp_path / "k.zarr"
    run = subprocess.Popen([sys.executable, SCRIPT, str(out), str(corpus), str(tokenizer), str(CHUNK), "--slow"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=ENV)
    begun = 0
    while begun < KILL_AT:
        line = run.stdout.readline()
        assert line, f"the run ended before it could be killed (rc={run.wait()}): {run.stderr.read()}"
        begun += line.startswith("batch")
    os.kill(run.pid, signal.SIGKILL)
    run.wait()
    run.stdout.close()
    run.stderr.close()
    done, total = chunks(out)
    assert 0 in done and 0 < len(done) < total, (done, total)

    changed_copy = tmp_path / "copy.zarr"
    shutil.copytree(out, changed_copy)
    resumed = extract(out, corpus, tokenizer)
    assert_same(resumed, whole)
    for key in whole.layers:
        s, w = resumed.stats[key], whole.stats[key]
        assert s.count == w.count and np.array_equal(s.mean, w.mean) and np.array_equal(s.std, w.std) and s.mean_norm == w.mean_norm
    assert resumed.card == whole.card

    # the same interrupted store, resumed on a corpus whose document 0 (in a written chunk) changed
    changed, texts = edited(corpus, tmp_path, 0, same_length=True)
    bpe = tm.saved_bpe(tokenizer)
    before, after = (bpe(t)["input_ids"] for t in (TEXTS[0], texts[0]))
    assert len(before) == len(after) and before != after  # only the tokens tell them apart
    refused_or_redone(changed_copy, changed, tokenizer, tmp_path)


@pytest.mark.parametrize("same_length", [True, False], ids=["same length", "longer"])
def test_a_complete_store_is_not_mixed_with_a_changed_document(whole, corpus, tokenizer, tmp_path, same_length):
    out = tmp_path / "c.zarr"
    shutil.copytree(whole.path, out)
    changed, _ = edited(corpus, tmp_path, len(TEXTS) // 2, same_length)
    refused_or_redone(out, changed, tokenizer, tmp_path)


def test_two_processes_under_torchrun_write_the_store_of_one(whole, corpus, tokenizer, tmp_path):
    out = tmp_path / "t.zarr"
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    job = subprocess.run([*launcher, SCRIPT, str(out), str(corpus), str(tokenizer), str(CHUNK)], capture_output=True, text=True, timeout=240, env=ENV)
    assert job.returncode == 0, job.stderr[-3000:]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        writer = StoreWriter.open(out)
    try:
        writers = {json.loads(text)["process"] for text in writer.backend.markers().values()}
    finally:
        writer.close()
    assert writers == {0, 1}  # both processes wrote chunks

    store = layertap.open_tokens(out)
    assert store.complete and len(store) == len(whole) and store.layers == whole.layers
    for key in EXTRA:
        assert np.array_equal(np.asarray(getattr(store, key)), np.asarray(getattr(whole, key))), key
    assert np.array_equal(store.doc_ids, whole.doc_ids) and store.card == whole.card
    for key in whole.layers:
        # the same batches, one thread each: float32 rounding at most (values are O(1))
        torch.testing.assert_close(store.read(key, 0, len(store)), whole.read(key, 0, len(whole)), atol=1e-6, rtol=1e-6)
        s, w = store.stats[key], whole.stats[key]
        assert s.count == w.count  # statistics merged from the 2 processes' shares
        np.testing.assert_allclose(s.mean, w.mean, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(s.std, w.std, rtol=1e-6, atol=1e-7)
        np.testing.assert_allclose(s.mean_norm, w.mean_norm, rtol=1e-9)
