"""`layertap.extract.plan`: its sizes against the stores real runs write, the probe file, free space
at a URL, and the refusal of a run that cannot fit (the timing against real runs: benchmarks/bench_plan.py)."""

from __future__ import annotations

import dataclasses
import os

import pytest
import tokens_models as tm
import zarr

import layertap
from layertap.errors import StoreError
from layertap.extract import plan as plan_module
from layertap.extract.plan import plan
from layertap.shapes import generate, save_images
from layertap.store import writer

SHAPES_LAYERS = ["features.block1", "features.block3"]
MINILM_LAYERS = ["encoder.layer.0", "encoder.layer.5"]


def array_bytes(path, rows: int) -> int:
    """What a Zarr store's arrays of one entry per row hold, uncompressed (as test_cli_tokens.py measures)."""
    arrays = zarr.open_group(str(path), mode="r").members(max_depth=None)
    return sum(a.nbytes for _, a in arrays if isinstance(a, zarr.Array) and a.shape[:1] == (rows,))


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("plan_images")
    save_images(generate(24, seed=1), folder)
    return folder


def test_plan_of_an_image_folder_sizes_the_store_the_run_writes(images, tmp_path, one_thread):
    model = layertap.load_model("layertap:shapes")
    out = tmp_path / "f.zarr"
    p = plan(model, str(images), SHAPES_LAYERS, out=out, batch_size=4, num_workers=0)
    assert not out.exists() and os.listdir(tmp_path) == []  # nothing written, the probe file removed
    store = layertap.extract_dataset(model, str(images), SHAPES_LAYERS, out, batch_size=4, num_workers=0, progress=False)
    written = array_bytes(out, store.num_samples)
    assert p.rows == 24 and abs(p.total_bytes - written) <= 0.05 * written
    assert [a.bytes_per_row for a in p.layers] == [store[k].nbytes // store.num_samples for k in SHAPES_LAYERS]
    assert p.free_bytes is not None and p.write_bytes_per_s and p.bound in ("model", "compression", "store")
    assert p.compress_bytes_per_s and p.compress_s > 0 and "compression:" in str(p)  # Zarr compresses: its CPU counts
    options = {r.option: r.total_bytes for r in p.reductions}
    assert options["dtype='float16'"] < p.total_bytes and options["reduce='mean'"] < options["dtype='float16'"]
    assert "free space" in str(p) and "bound by the" in str(p)


def test_plan_of_a_text_file_sizes_the_token_store_the_run_writes(tmp_path, one_thread):
    path = tm.minilm_path()
    model = layertap.load_model(f"hf:{path}")
    corpus = tmp_path / "docs.txt"
    corpus.write_text("\n".join(tm.corpus(6, longest=20)) + "\n")
    out = tmp_path / "t.zarr"
    p = plan(model, str(corpus), MINILM_LAYERS, out=out, batch_size=4)
    assert p.unit == "token" and not out.exists()
    store = layertap.extract_tokens(model, str(corpus), MINILM_LAYERS, out=out, batch_size=4, progress=False)
    written = array_bytes(out, len(store))
    assert p.rows == len(store) and abs(p.total_bytes - written) <= 0.05 * written
    options = {r.option: r.total_bytes for r in p.reductions}
    assert options["tokens='last'"] == 6 * p.bytes_per_row and "without layer 'encoder.layer.0' (the largest)" in options


def test_the_text_plan_tokenizes_the_corpus_once_and_plans_its_first_documents(tmp_path, monkeypatch, one_thread):
    from layertap.extract import token_plan

    calls = []
    tokenize = token_plan.tokenize
    monkeypatch.setattr(token_plan, "tokenize", lambda corpus, *a, **k: calls.append(len(corpus)) or tokenize(corpus, *a, **k))
    model = layertap.load_model(f"hf:{tm.minilm_path()}")
    texts = tm.corpus(6, longest=20)
    p = plan(model, texts, MINILM_LAYERS, out=tmp_path / "t.zarr", batch_size=2, limit=4)
    assert calls == [4]  # once, over the 4 documents planned
    sizes = token_plan.token_sizes(model, texts[:4], MINILM_LAYERS)
    assert p.rows == sizes.tokens and token_plan.token_sizes(model, texts, MINILM_LAYERS, limit=4).tokens == sizes.tokens


def test_a_raw_format_compresses_nothing_and_the_writer_can_bound_the_time(tmp_path, one_thread):
    p = plan(layertap.load_model("layertap:shapes"), layertap.shapes.ShapesDataset(4), ["features.block1"], out=tmp_path / "f", format="npy", batch_size=2)
    assert p.compress_bytes_per_s is None and p.compress_s == 0 and "compression: none (stored raw)" in str(p)
    # the writer compresses a chunk, then writes it, beside the model: the slower bounds the time
    slow_codec = dataclasses.replace(p, model_s=1.0, write_bytes_per_s=p.stored_bytes / 0.5, compress_bytes_per_s=p.total_bytes / 0.75)
    assert slow_codec.bound == "compression" and slow_codec.seconds == pytest.approx(1.25)
    slow_disk = dataclasses.replace(slow_codec, write_bytes_per_s=p.stored_bytes / 2.0)
    assert slow_disk.bound == "store" and slow_disk.seconds == pytest.approx(2.75)
    assert dataclasses.replace(p, model_s=3.0, write_bytes_per_s=p.stored_bytes / 2.0).bound == "model"


def test_the_probe_file_is_removed_even_on_error(tmp_path, monkeypatch):
    def refuse(fd):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "fsync", refuse)
    with pytest.raises(OSError):
        plan_module.write_bandwidth(tmp_path / "f.zarr", 1 << 20)
    assert os.listdir(tmp_path) == []


def test_a_url_target_has_free_space_unknown(one_thread):
    p = plan(layertap.load_model("layertap:shapes"), layertap.shapes.ShapesDataset(4), ["features.block1"], out="memory://plan/f.zarr", batch_size=2)
    assert p.free_bytes is None and p.write_bytes_per_s is None and p.bound == "model"
    assert "free space: unknown (object storage)" in str(p)


def test_a_run_that_cannot_fit_is_refused_before_writing(tmp_path, monkeypatch, one_thread):
    monkeypatch.setattr(writer, "free_space", lambda path: 1000)
    out = tmp_path / "f.zarr"
    with pytest.raises(StoreError, match="the features need .* but only 1.0 KB is free"):
        plan(layertap.load_model("layertap:shapes"), layertap.shapes.ShapesDataset(4), ["features.block1"], out=out, batch_size=2)
    assert os.listdir(tmp_path) == []


def test_extract_dry_run_prints_the_plan_and_writes_nothing(images, tmp_path, capsys, one_thread):
    from layertap.cli import run

    out = tmp_path / "f.zarr"
    args = ["extract", "layertap:shapes", str(images), "--layers", "features.block1", "--out", str(out), "--workers", "0", "--batch-size", "4", "--dry-run"]
    assert run(args) == 0
    printed = capsys.readouterr().out
    assert "rows: 24 samples" in printed and "bound by the" in printed and "smaller: reduce='mean'" in printed
    assert os.listdir(tmp_path) == []
