"""Feature stores in an object store: a real S3 API server (moto's, on 127.0.0.1) that fsspec's
s3fs talks to over HTTP, configured as a user would, through fsspec's environment configuration
(``FSSPEC_S3_ENDPOINT_URL``, ``FSSPEC_S3_KEY``, ``FSSPEC_S3_SECRET``). Every store written there
is compared with the same run written to a local folder."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import slow_model
import tokens_models as tm
import torch

import layertap
from layertap.cli import run
from layertap.loading import load_model
from layertap.shapes import generate, save_images
from layertap.store.writer import StoreWriter

moto_server = pytest.importorskip("moto.server")
s3fs = pytest.importorskip("s3fs")
fsspec = pytest.importorskip("fsspec")

TESTS = str(Path(__file__).parent)  # on PYTHONPATH: the subprocesses load slow_model from here
BUCKET = "feats"
LAYERS = ["features.block2", "classifier"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def s3() -> Iterator[dict[str, str]]:
    """A moto S3 server with one bucket; fsspec pointed at it, in this process and its children."""
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=free_port())
    server.start()
    host, port = server.get_host_and_port()
    env = {
        "FSSPEC_S3_ENDPOINT_URL": f"http://{host}:{port}",
        "FSSPEC_S3_KEY": "testing",
        "FSSPEC_S3_SECRET": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",
    }
    with pytest.MonkeyPatch.context() as mp:
        for k, v in env.items():
            mp.setenv(k, v)
        # fsspec read its environment configuration when it was imported: for this process, set it again
        mp.setitem(fsspec.config.conf, "s3", {"endpoint_url": env["FSSPEC_S3_ENDPOINT_URL"], "key": "testing", "secret": "testing"})
        s3fs.S3FileSystem.clear_instance_cache()
        s3fs.S3FileSystem().mkdir(BUCKET)
        try:
            yield env
        finally:
            s3fs.S3FileSystem.clear_instance_cache()
            server.stop()


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("shapes") / "images"
    save_images(generate(12, seed=3, size=64), folder, format="png")
    return folder


@pytest.fixture(scope="module")
def array(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("data") / "x.npy"
    np.save(path, np.random.default_rng(0).standard_normal((24, 3, 8, 8), dtype=np.float32))
    return path


def same_store(a: layertap.FeatureStore, b: layertap.FeatureStore) -> None:
    assert list(a) == list(b) and b.complete
    for key in a:
        assert np.array_equal(a.to_numpy(key), b.to_numpy(key), equal_nan=True), key
    assert np.array_equal(a.ids, b.ids)


def shapes(images: Path, out: str | Path) -> layertap.FeatureStore:
    model = load_model("layertap:shapes")
    return layertap.extract_dataset(model, str(images), LAYERS, out, batch_size=4, chunk_size=4, num_workers=0, progress=False)


@pytest.fixture(scope="module")
def written(s3, images, tmp_path_factory) -> tuple[layertap.FeatureStore, str]:
    """The shapes features in a local folder, and the URL of the same run written to S3."""
    local = shapes(images, tmp_path_factory.mktemp("local") / "x.zarr")
    url = f"s3://{BUCKET}/x.zarr"
    shapes(images, url)
    return local, url


def test_a_store_written_to_s3_equals_the_local_one(written):
    local, url = written
    same_store(local, layertap.open_features(url))
    assert s3fs.S3FileSystem().exists(f"{BUCKET}/x.zarr/zarr.json")  # really in the bucket


def test_report_reads_a_store_from_s3(written, tmp_path):
    _, url = written
    page = tmp_path / "r.html"
    assert run(["report", url, "--out", str(page)]) == 0
    assert "features.block2" in page.read_text()


def extract_command(array: Path, url: str) -> list[str]:
    options = ["--layers", "conv", "--layers", "pool", "--batch-size", "2", "--chunk-size", "2", "--workers", "0"]
    return [sys.executable, "-m", "layertap", "extract", "slow_model:slow", str(array), *options, "--out", url]


def started(array: Path, url: str, env: dict[str, str], batches: int) -> subprocess.Popen:
    """``layertap extract`` of the slow model to ``url``, once it has begun ``batches`` batches."""
    full = {**os.environ, **env, "PYTHONPATH": TESTS, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(extract_command(array, url), stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=full)
    assert proc.stdout is not None
    seen = 0
    for line in proc.stdout:
        seen += line.startswith("batch ")
        if seen == batches:
            return proc
    raise AssertionError(f"the run ended after {seen} batches (exit {proc.wait()})")


def test_killed_run_to_s3_resumes_to_the_uninterrupted_store_and_refuses_a_second_writer(s3, array, tmp_path):
    whole = layertap.extract_dataset(slow_model.slow().eval(), str(array), ["conv", "pool"], tmp_path / "whole.zarr", batch_size=2, chunk_size=2, num_workers=0, progress=False)
    url = f"s3://{BUCKET}/resumed.zarr"
    proc = started(array, url, s3, batches=6)  # 12 batches, one chunk each: about half written
    try:  # a second writer while the first holds the lease: refused at once, naming the holder
        with pytest.raises(layertap.StoreError, match="is being written by another extraction") as e:
            layertap.extract_dataset(slow_model.slow(), str(array), ["conv", "pool"], url, batch_size=2, chunk_size=2, num_workers=0, progress=False)
        assert f"process {proc.pid} on " in str(e.value) and "\n" not in str(e.value)
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    writer = StoreWriter.open(url)
    try:
        assert 0 < len(writer.done()) < writer.num_chunks
    finally:
        writer.close()
    # the killed holder's lease (its pid gone from this host) is taken over; eval(): as the command loads it
    resumed = layertap.extract_dataset(slow_model.slow().eval(), str(array), ["conv", "pool"], url, batch_size=2, chunk_size=2, num_workers=0, progress=False)
    assert resumed.complete and list(resumed) == list(whole)
    for key in whole:  # another process and thread count: close, not bit for bit
        torch.testing.assert_close(torch.from_numpy(resumed.to_numpy(key)), torch.from_numpy(whole.to_numpy(key)), rtol=1e-5, atol=1e-6)


def refused(url: str, array: Path) -> str:
    """The one-line layertap error of an extraction to ``url``."""
    with pytest.raises(layertap.LayertapError) as e:
        layertap.extract_dataset(slow_model.slow(), str(array), ["conv"], url, batch_size=8, num_workers=0, progress=False)
    assert "\n" not in str(e.value), str(e.value)
    return str(e.value)


def test_a_missing_bucket_is_one_line_naming_it(s3, array):
    assert "s3://no-such-bucket/x.zarr" in refused("s3://no-such-bucket/x.zarr", array)


def test_an_unreachable_endpoint_is_one_line_and_no_hang(s3, array, monkeypatch):
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    monkeypatch.setitem(fsspec.config.conf, "s3", {**fsspec.config.conf["s3"], "endpoint_url": dead, "config_kwargs": {"retries": {"max_attempts": 1}, "connect_timeout": 2}})
    s3fs.S3FileSystem.clear_instance_cache()
    try:
        line = refused(f"s3://{BUCKET}/y.zarr", array)
    finally:
        s3fs.S3FileSystem.clear_instance_cache()
    assert f"s3://{BUCKET}/y.zarr" in line and "127.0.0.1" in line, line


def test_a_token_store_on_s3_equals_the_local_one_with_its_stats_and_loader(s3, tmp_path):
    """extract_tokens to s3://, read back by open_tokens (arrays, token ids, the running statistics)
    and TokenLoader's shuffled epoch: the same as the run written to a local folder."""
    texts = tm.corpus(24, seed=2, longest=20)
    tokenizer = tm.bpe_tokenizer(texts, save=tmp_path / "bpe.json")
    url = f"s3://{BUCKET}/t.zarr"
    stores = {}
    for out in (str(tmp_path / "t.zarr"), url):
        torch.manual_seed(0)
        model = tm.TinyLM(len(tokenizer)).eval()
        layertap.extract_tokens(model, texts, tm.TINY_LAYERS, out=out, tokenizer=tokenizer, batch_size=4, chunk_size=128, progress=False)
        stores[out] = layertap.open_tokens(out)
    local, remote = stores.values()
    assert remote.complete and s3fs.S3FileSystem().exists(f"{BUCKET}/t.zarr/zarr.json")
    assert len(remote) == len(local) > 100 and remote.layers == local.layers
    assert np.array_equal(remote.token_ids, local.token_ids) and np.array_equal(remote.docs, local.docs)
    for layer in local.layers:
        assert np.array_equal(np.asarray(remote[layer]), np.asarray(local[layer])), layer
        a, b = remote.stats[layer], local.stats[layer]
        assert a.count == b.count == len(local) and np.array_equal(a.mean, b.mean) and np.array_equal(a.std, b.std)
    rows = [batch["index"] for batch in layertap.TokenLoader(url, batch_size=16, seed=3, rank=0, world_size=1)]
    assert sorted(torch.cat(rows).tolist()) == list(range(len(local)))  # every row once
