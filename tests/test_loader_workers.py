"""DataLoader workers that layertap starts end with their parent, even after ``kill -9``.

A real extraction runs in a subprocess over a dataset whose samples each take 60 s: its workers
announce themselves with a file named by their pid, then the extraction is killed. Whether a
worker lives is read from ``/proc`` (a zombie has ended), not from anything layertap says.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader

from layertap.data import iter_batches
from layertap.workers import EndWithParent

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="PR_SET_PDEATHSIG and /proc are Linux's")

SLOW_DATA = textwrap.dedent(
    """
    import os, pathlib, time
    import torch

    class Slow(torch.utils.data.Dataset):
        def __init__(self, marks):
            self.marks = marks

        def __len__(self):
            return 8

        def __getitem__(self, i):
            pathlib.Path(self.marks, str(os.getpid())).touch()
            time.sleep(60)
            return torch.zeros(4)
    """
)

EXTRACT = textwrap.dedent(
    """
    import sys
    import torch, layertap
    from slow_data import Slow

    model = torch.nn.Sequential(torch.nn.Linear(4, 2))
    layertap.extract_dataset(model, Slow(sys.argv[1]), "0", sys.argv[2], num_workers=2, batch_size=1, progress=False)
    """
)


def alive(pid: int) -> bool:
    """Whether ``pid`` runs: it exists and is no zombie."""
    try:
        return Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[0] not in (b"Z", b"X")
    except (OSError, IndexError):
        return False


def parent_of(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_bytes().rpartition(b")")[2].split()[1])


def wait_for(condition, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def test_workers_end_within_seconds_of_a_kill_9(tmp_path):
    marks = tmp_path / "marks"
    marks.mkdir()
    (tmp_path / "slow_data.py").write_text(SLOW_DATA)
    (tmp_path / "extract.py").write_text(EXTRACT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]), "OMP_NUM_THREADS": "1"}
    extraction = subprocess.Popen([sys.executable, str(tmp_path / "extract.py"), str(marks), str(tmp_path / "f.zarr")], env=env, cwd=tmp_path)
    workers: list[int] = []
    try:
        assert wait_for(lambda: len(list(marks.iterdir())) >= 2 or extraction.poll() is not None, 120), "no workers started"
        workers = [int(p.name) for p in marks.iterdir()]
        assert len(workers) == 2 and all(parent_of(pid) == extraction.pid for pid in workers)  # the loader's workers
        os.kill(extraction.pid, signal.SIGKILL)
        extraction.wait(10)
        start = time.monotonic()
        assert wait_for(lambda: not any(alive(pid) for pid in workers), 5), "workers outlived their parent"
        assert time.monotonic() - start < 5
    finally:
        for pid in [extraction.pid, *workers]:  # leave nothing behind, whatever failed
            if alive(pid):
                os.kill(pid, signal.SIGKILL)
        extraction.wait(10)


def test_a_worker_whose_parent_died_before_it_started_ends_at_once():
    """The kill lands between fork and the worker's init: no death signal could be asked for in time."""
    gone = subprocess.Popen(["true"])
    gone.wait()
    hook = EndWithParent(None)
    hook.parent = gone.pid  # as if the process that made the loader had ended
    child = os.fork()
    if child == 0:  # the worker
        try:
            hook(0)
        finally:
            os._exit(0)  # still running after the hook: the parent's death went unseen
    _, status = os.waitpid(child, 0)
    assert os.WEXITSTATUS(status) == 1


class Marking:
    """A user's worker_init_fn: writes a file per worker id."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder

    def __call__(self, worker_id: int) -> None:
        (self.folder / f"init-{worker_id}").touch()


def test_a_loaders_own_worker_init_fn_still_runs(tmp_path):
    data = torch.utils.data.TensorDataset(torch.arange(8.0).reshape(8, 1))
    loader = DataLoader(data, batch_size=2, num_workers=2, worker_init_fn=Marking(tmp_path))
    batches = [b.inputs for b in iter_batches(loader)]  # layertap re-makes the loader around its dataset
    torch.testing.assert_close(torch.cat([b[0] for b in batches]), data.tensors[0], rtol=0, atol=0)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["init-0", "init-1"]
