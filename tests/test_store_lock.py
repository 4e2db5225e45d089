"""One writer per store: the lock meets every path to one HDF5 file (symlinks, ``..``), holds
without HDF5's own file locking, is never held by a forked child (a data-loader worker), and is
taken over at once, saying so, when its holder was killed. Other writers start from a fork
server that has imported torch and layertap already: each costs a fork, not an interpreter."""

from __future__ import annotations

import multiprocessing
import os
import signal
import time
from pathlib import Path

import numpy as np
import pytest
import slow_model
import torch

import layertap
from layertap.errors import StoreLockedError
from layertap.store.backends import detect_format
from layertap.store.lock import StoreLock

OPTIONS = dict(batch_size=4, chunk_size=4, progress=False)


@pytest.fixture(scope="module")
def server():
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "layertap", "slow_model"])  # as test_crash_resume: one server
    return context


# ------------------------------------------------------------- what the other processes run
def extract_counting(data: str, out: str, format: str, workers: int, batches, hdf5_locking: str = "TRUE") -> None:
    """Extract with `slow_model.Slow` (a batch takes 0.15 s), counting batches begun in ``batches``."""
    os.environ["HDF5_USE_FILE_LOCKING"] = hdf5_locking
    # a child of the fork server would start loader workers from the server too: fork them from
    # this process, as on Linux by default, so that they inherit its open files, the lock's too
    multiprocessing.set_start_method("fork", force=True)
    model = slow_model.Slow()

    def count(module, args):
        with batches.get_lock():
            batches.value += 1

    model.register_forward_pre_hook(count)
    layertap.extract_dataset(model, data, ["conv", "pool"], out, format=format, num_workers=workers, **OPTIONS)


def try_lock(path: str, format: str) -> None:
    StoreLock(path, format).acquire()


def hold_and_fork(stores: list[tuple[str, str]], child_pid) -> None:
    """Take the locks, then fork a child that lives on (as a data-loader worker does), and wait."""
    for path, format in stores:
        StoreLock(path, format).acquire()
    child = os.fork()
    if child == 0:
        time.sleep(60)
        os._exit(0)
    child_pid.value = child
    time.sleep(60)


# ----------------------------------------------------------------------------------- helpers
def wait_for(value, at_least: int, process) -> None:
    deadline = time.monotonic() + 60
    while value.value < at_least and process.is_alive() and time.monotonic() < deadline:
        time.sleep(0.005)
    assert value.value >= at_least, f"the process ended before it was far enough (exit code {process.exitcode})"


def children(pid: int) -> list[int]:
    """The processes ``pid`` started (Linux's /proc), e.g. its data-loader workers."""
    return [int(c) for task in Path(f"/proc/{pid}/task").iterdir() for c in (task / "children").read_text().split()]


def alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except FileNotFoundError:
        return False


def kill(pids) -> None:
    for pid in pids:
        if alive(pid):
            os.kill(pid, signal.SIGKILL)


def data(tmp_path: Path, n: int) -> Path:
    array = tmp_path / "x.npy"
    np.save(array, np.random.default_rng(0).standard_normal((n, 3, 8, 8), dtype=np.float32))
    return array


# ------------------------------------------------------------------------------------- tests
def test_every_path_to_an_hdf5_file_meets_one_lock_without_hdf5_file_locking(server, tmp_path, monkeypatch):
    """HDF5_USE_FILE_LOCKING=FALSE, as on NFS or Lustre: a second writer through a symlink, a
    path with ``..`` or a symlinked folder is refused naming the first, which finishes undisturbed."""
    monkeypatch.setenv("HDF5_USE_FILE_LOCKING", "FALSE")
    array = data(tmp_path, 80)  # 20 batches, 3 s: the first writer is still running after the attempts
    real = tmp_path / "data" / "s.h5"
    (tmp_path / "data" / "sub").mkdir(parents=True)
    (tmp_path / "link.h5").symlink_to(real)
    (tmp_path / "folder").symlink_to(tmp_path / "data", target_is_directory=True)
    batches = server.Value("i", 0)
    first = server.Process(target=extract_counting, args=(str(array), str(real), "hdf5", 0, batches, "FALSE"))
    first.start()
    try:
        deadline = time.monotonic() + 60
        while detect_format(real) is None and first.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)  # the file is made once the first features give its shapes
        assert detect_format(real) == "hdf5" and first.is_alive()
        for alias in (tmp_path / "link.h5", tmp_path / "data" / "sub" / ".." / "s.h5", tmp_path / "folder" / "s.h5"):
            with pytest.raises(StoreLockedError, match=f"process {first.pid} on .* since") as e:
                layertap.extract_dataset(slow_model.Slow(), str(array), ["conv", "pool"], alias, format="hdf5", **OPTIONS)
            assert "\n" not in str(e.value)
        first.join(timeout=120)
        assert first.exitcode == 0, "the first writer was disturbed"
    finally:
        kill([first.pid])
    expected = layertap.extract(slow_model.Slow(), torch.from_numpy(np.load(array)), "pool")["pool"].numpy()
    with layertap.open_features(tmp_path / "link.h5") as store:
        assert store.complete
        np.testing.assert_allclose(store.to_numpy("pool"), expected, rtol=1e-5, atol=1e-6)  # batches of 4 vs one of 80


def test_a_second_lock_in_the_same_process_is_refused_and_leaves_the_first_held(server, tmp_path):
    """A record lock belongs to its process: a second attempt there must be refused, and must not
    release the first (closing any descriptor of the file would)."""
    (tmp_path / "s.h5").touch()
    stores = [(tmp_path / "s.h5", "hdf5"), (tmp_path / "s.zarr", "zarr")]
    held = [StoreLock(path, format).acquire() for path, format in stores]
    try:
        for path, format in stores:
            alias = tmp_path / f"alias-{format}"
            alias.symlink_to(path)
            with pytest.raises(StoreLockedError, match=f"process {os.getpid()} on"):
                StoreLock(alias, format).acquire()
            other = server.Process(target=try_lock, args=(str(path), format))
            other.start()
            other.join(timeout=60)
            assert other.exitcode == 1, "another process got the lock: the refused attempt released it"
    finally:
        for lock in held:
            lock.release()
    for path, format in stores:
        StoreLock(path, format).acquire().release()


def test_a_killed_holders_lock_is_taken_over_at_once_though_its_forked_child_lives(server, tmp_path):
    """A data-loader worker is a child forked while the lock is held. Killing the holder leaves
    the child running; the next run takes the lock over at once, warning with the killed pid."""
    stores = [(tmp_path / "s.zarr", "zarr"), (tmp_path / "s.h5", "hdf5")]
    child = server.Value("i", 0)
    holder = server.Process(target=hold_and_fork, args=([(str(p), f) for p, f in stores], child))
    holder.start()
    try:
        wait_for(child, 1, holder)
        for path, format in stores:
            with pytest.raises(StoreLockedError, match=f"process {holder.pid} on"):
                StoreLock(path, format).acquire()
        os.kill(holder.pid, signal.SIGKILL)
        holder.join()
        for path, format in stores:
            with pytest.warns(UserWarning, match=f"its last writer \\(process {holder.pid} on .*\\) ended without releasing .* takes the lock over"):
                lock = StoreLock(path, format).acquire()
            lock.release()
        assert alive(child.value)  # taken over while the child still runs
    finally:
        kill([child.value, holder.pid])


def test_a_released_lock_is_taken_without_a_warning(tmp_path, recwarn):
    StoreLock(tmp_path / "s.zarr", "zarr").acquire().release()
    StoreLock(tmp_path / "s.zarr", "zarr").acquire().release()
    assert not [w for w in recwarn if "lock" in str(w.message)]


def test_after_kill_9_of_an_extraction_with_loader_workers_a_rerun_takes_over_at_once(server, tmp_path):
    """The real case: an extraction whose DataLoader has workers is killed with SIGKILL; the run
    started right after takes the lock over (saying so) and finishes the store, equal to a run
    never interrupted."""
    array, out = data(tmp_path, 32), tmp_path / "s.zarr"  # 8 batches: killed after the third
    batches = server.Value("i", 0)
    run = server.Process(target=extract_counting, args=(str(array), str(out), "zarr", 2, batches))
    run.start()
    workers: list[int] = []
    try:
        wait_for(batches, 3, run)
        workers = [pid for pid in children(run.pid) if "python" in Path(f"/proc/{pid}/cmdline").read_text()]
        assert len(workers) >= 2, "the run has no loader workers of its own to inherit its files"
        os.kill(run.pid, signal.SIGKILL)
        run.join()
        with pytest.warns(UserWarning, match=f"process {run.pid} on .* ended without releasing"):
            resumed = layertap.extract_dataset(slow_model.Slow(), str(array), ["conv", "pool"], out, num_workers=0, **OPTIONS)
    finally:
        kill([*workers, run.pid])
    whole = layertap.extract_dataset(slow_model.Slow(), str(array), ["conv", "pool"], tmp_path / "whole.zarr", num_workers=0, **OPTIONS)
    assert resumed.complete
    for key in whole:
        np.testing.assert_array_equal(resumed.to_numpy(key), whole.to_numpy(key))  # the same batches: bit-exact
