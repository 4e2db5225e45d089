"""kill -9 at many moments of an extraction, in every format: each resumed store equals a run
that was never interrupted. Runs start from a fork server that has imported torch and layertap
already, so each costs a fork, not an interpreter start."""

from __future__ import annotations

import multiprocessing
import os
import random
import signal
import time
import warnings

import numpy as np
import pytest
import slow_model

import layertap
from layertap.store.writer import StoreWriter

FORMATS = {"zarr": "s.zarr", "hdf5": "s.h5", "npy": "s"}
SAMPLES = 24  # 12 batches, 6 chunks
# 6 kills per format, 18 in all: before or while the store is made (batch 1), before its first chunk
# is written (batch 3), and after some chunks (from batch 5 on, to the last)
MOMENTS = 6


@pytest.fixture(scope="module")
def server():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "layertap", "slow_model"])
    return context


@pytest.fixture(scope="module")
def array(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "x.npy"
    np.save(path, np.random.default_rng(0).standard_normal((SAMPLES, 3, 2, 2), dtype=np.float32))
    return path


def extract(array, out, fmt):
    return layertap.extract_dataset(slow_model.quick(), str(array), ["1", "3"], out, format=fmt, batch_size=2, chunk_size=4, num_workers=0, progress=False)


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_killed_at_any_moment_a_run_resumes_to_the_same_store(server, array, tmp_path, fmt):
    whole = extract(array, tmp_path / f"whole-{FORMATS[fmt]}", fmt)
    expected = {k: whole.to_numpy(k) for k in whole}
    rng = random.Random(fmt)
    partial = 0  # kills that left some chunks written and some not
    for moment in range(MOMENTS):
        out = tmp_path / f"{moment}-{FORMATS[fmt]}"
        batches = server.Value("i", 0)
        run = server.Process(target=slow_model.extract_counting, args=(str(array), str(out), fmt, batches))
        run.start()
        target = 1 + moment * (SAMPLES // 2 - 2) // (MOMENTS - 1)  # spread over the run's batches, to the last
        deadline = time.monotonic() + 60
        while batches.value < target and run.is_alive() and time.monotonic() < deadline:
            time.sleep(0.0005)
        time.sleep(rng.random() * 0.004)  # between batches, in a write, in a marker, ...
        os.kill(run.pid, signal.SIGKILL)
        run.join()
        if out.exists():
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                try:
                    writer = StoreWriter.open(out)
                except layertap.StoreError:
                    writer = None  # killed while it was being made
            if writer is not None:
                partial += 0 < len(writer.done()) < writer.num_chunks
                writer.close()
        resumed = extract(array, out, fmt)
        assert resumed.complete, moment
        for key, value in expected.items():
            assert np.array_equal(resumed.to_numpy(key), value), (moment, key)
        assert np.array_equal(resumed.ids, whole.ids) and resumed.failed == []
        resumed.close()
    assert partial >= MOMENTS // 2, f"only {partial} of {MOMENTS} kills landed in the middle of a run"
