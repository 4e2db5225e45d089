"""Extraction under torchrun: processes share one store, chunk by chunk, and resume with any number.

The jobs are real: `torch.distributed.run` starts 2 processes on the CPU (Gloo), running
the ``layertap`` command as a user would (``python -m layertap extract``, or its `run` from a
script). Every process of a launch imports torch, seconds each: so one job of 2 processes
(`scenarios`) plays every scenario that kills no process, one after the other, in one process
group that the script makes, and each test reads what its scenario said. The jobs in which
``python -m layertap`` makes its own process group and takes it down are those of the test that
kills a rank and resumes.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest
import slow_model
import torch

import layertap
from layertap.cli import run
from layertap.distributed import job, launched, rank_device
from layertap.extract.run import _chunk_size as chunk_size
from layertap.extract.run import _plan as dataset_plan
from layertap.shapes import generate, save_images
from layertap.store import StoreError
from layertap.store.writer import StoreWriter

TESTS = str(Path(__file__).parent)  # on PYTHONPATH: subprocesses load slow_model from here
LAYERS = ["--layers", "features.block2", "--layers", "features.block4.relu4", "--layers", "classifier"]
FORMATS = ["zarr", "npy", "zarr URL"]  # a URL goes through fsspec, as an object store's (s3://...) would


def cli(*args: str, procs: int | None = None, env: dict | None = None, **options) -> subprocess.CompletedProcess:
    """``python -m layertap ...``, under ``torchrun --nproc-per-node procs`` when given."""
    launcher = [] if procs is None else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
    command = [sys.executable, *launcher, "-m", "layertap", *args]
    # one thread per process, as torchrun gives each: the same arithmetic, bit for bit
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    return subprocess.run(command, capture_output=True, text=True, env=full_env, timeout=300, **options)


def markers(path: Path) -> dict[int, dict]:
    writer = StoreWriter.open(path)
    try:
        return {c: json.loads(text) for c, text in writer.backend.markers().items()}
    finally:
        writer.close()


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("shapes") / "images"
    save_images(generate(44, seed=3, size=64), folder, format="jpg")
    bad = sorted(folder.rglob("*.jpg"))[10]  # in chunk 1: rank 1's
    bad.write_bytes(bad.read_bytes()[:200])  # truncated
    return folder


def shapes_command(images: Path, format: str, out: str) -> list[str]:
    """``layertap extract`` of the shapes images in ``format``, the same for 1 process and for 2."""
    options = ["--batch-size", "4", "--chunk-size", "8", "--workers", "0", "--on-error", "skip", "--format", format.split()[0]]
    return ["extract", "layertap:shapes", str(images), *LAYERS, *options, "--out", out]


# the scenarios of one job of 2 processes, in turn; each line it prints starts with the scenario's name
SCENARIOS = """
import contextlib, io, json, os, sys
import torch
from torch.nn.parallel import DistributedDataParallel
import layertap
from layertap.cli import run
from layertap.distributed import job
from layertap.store import StoreError

folder = sys.argv[1]
rank = int(os.environ["RANK"])
# one process group for all the scenarios, which layertap uses as it is: a group made again after
# one is destroyed reuses its rendezvous keys, and Gloo may connect to the old addresses
torch.distributed.init_process_group("gloo")

def say(scenario, line):
    sys.stdout.write(f"{scenario}: rank {rank}: {line}\\n")  # one write: lines of processes do not mix
    sys.stdout.flush()

# the command, as `python -m layertap` runs it: its exit code, and what it wrote to stderr
with open(os.path.join(folder, "commands.json")) as f:
    commands = json.load(f)
for name, argv in commands.items():
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = run(argv)
    with open(os.path.join(folder, f"{name}.rank{rank}.stderr"), "w") as f:
        f.write(err.getvalue())
    say(name, f"exit {code}")

# another checkpoint on rank 1: one weight differs (the old sampled fingerprint read every 16th)
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Conv2d(64, 64, 1, bias=False), torch.nn.AdaptiveAvgPool2d(1)).eval()
if rank == 1:
    with torch.no_grad():
        model[0].weight[0, 1] += 0.5
x = torch.randn(96, 64, 2, 2, generator=torch.Generator().manual_seed(1))
try:
    layertap.extract_dataset(model, x, "1", os.path.join(folder, "one-weight.zarr"), batch_size=8, progress=False)
    say("one weight", "done")
except Exception as e:
    say("one weight", f"{type(e).__name__}: {e}")

class Net(torch.nn.Module):
    \"\"\"resnet's names (layer2, fc) and its batch norm, whose buffers DDP broadcasts, in a few weights\"\"\"
    def __init__(self):
        super().__init__()
        self.layer1 = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.BatchNorm2d(4), torch.nn.ReLU())
        self.layer2 = torch.nn.Sequential(torch.nn.Conv2d(4, 8, 3, stride=2), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
        self.fc = torch.nn.Linear(8, 10)

    def forward(self, x):
        return self.fc(self.layer2(self.layer1(x)).mean((2, 3)))

with job() as procs:
    torch.manual_seed(0)
    model = Net()
    ddp = DistributedDataParallel(model)
    x = torch.randn(2, 3, 16, 16, generator=torch.Generator().manual_seed(procs.rank))  # each rank: its own samples
    with layertap.tap(ddp, ["layer2", "module.fc"], capture=("output", "grad")) as t:
        ddp(x).square().sum().backward()
    reference = layertap.extract(model, x, ["layer2", "fc"])
    ok = torch.allclose(t["layer2"], reference["layer2"], atol=1e-6) and torch.allclose(t["module.fc"], reference["fc"], atol=1e-6)
    grad_ok = torch.allclose(t.grads["module.fc"], 2 * reference["fc"], atol=1e-5)
    say("ddp", f"batch {t['layer2'].shape[0]} same {ok} grad {grad_ok}")

# last: a rank that fails leaves its error in the launcher's store, where later failures would find it
def broken():
    raise StoreError("rank 0 could not make it")

with job() as procs:
    for step in (lambda: procs.share(broken), lambda: procs.share(lambda: [procs.rank, "made"])):
        try:
            say("collectives", repr(step()))
        except Exception as e:
            say("collectives", f"{type(e).__name__}: {e}")

    def work():
        if procs.rank == 1:
            raise ValueError("rank 1 broke")
        return "fine"
    try:
        say("collectives", repr(procs.together(work)))
    except Exception as e:  # rank 1 leaves at once, without waiting for rank 0
        say("collectives", f"{type(e).__name__}: {e}")
torch.distributed.destroy_process_group()  # rank 1's: rank 0, still waiting for it, finds it gone
"""

DIFFERENT = """
import os, torch

def seeded_by_rank():
    torch.manual_seed(int(os.environ["RANK"]))  # a mistake: every process gets other random weights
    return torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 4))
"""


@dataclass
class Scenarios:
    """What the job of `SCENARIOS` wrote, in ``folder``, and printed."""

    folder: Path
    stdout: str

    def said(self, scenario: str) -> set[str]:
        """The lines ``rank N: ...`` that ``scenario`` printed."""
        prefix = f"{scenario}: "
        return {line.removeprefix(prefix) for line in self.stdout.splitlines() if line.startswith(prefix)}

    def stderr(self, command: str) -> str:
        """What ``command`` wrote to stderr, on both ranks."""
        return "".join((self.folder / f"{command}.rank{rank}.stderr").read_text() for rank in (0, 1))


@pytest.fixture(scope="module")
def scenarios(images, tmp_path_factory) -> Scenarios:
    folder = tmp_path_factory.mktemp("scenarios")
    (folder / "different.py").write_text(textwrap.dedent(DIFFERENT))
    np.save(folder / "x.npy", np.zeros((16, 3, 2, 2), dtype=np.float32))
    commands = {format: shapes_command(images, format, two_out(folder, format)) for format in FORMATS}
    commands["different"] = ["extract", "different:seeded_by_rank", str(folder / "x.npy"), "--layers", "1", "--out", str(folder / "different.zarr")]
    (folder / "commands.json").write_text(json.dumps(commands))
    (folder / "script.py").write_text(SCENARIOS)
    launcher = ["-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(folder)}  # PYTHONPATH: the model spec different:...
    done = subprocess.run([sys.executable, *launcher, str(folder / "script.py"), str(folder)], capture_output=True, text=True, timeout=400, env=env)
    assert done.returncode == 0, done.stderr
    return Scenarios(folder, done.stdout)


def two_out(folder: Path, format: str) -> str:
    """Where the job of 2 processes writes ``format``: a file:// URL for "zarr URL"."""
    path = folder / f"two-{format.replace(' ', '-')}"
    return f"file://{path}" if format.endswith("URL") else str(path)


@pytest.mark.parametrize("format", FORMATS)
def test_two_processes_write_the_store_one_process_writes(images, scenarios, tmp_path, one_thread, format):
    assert scenarios.said(format) == {"rank 0: exit 0", "rank 1: exit 0"}, scenarios.stderr(format)
    target = two_out(scenarios.folder, format)
    assert scenarios.stdout.count(f"wrote 44 samples to {target} (") == 1  # rank 0 speaks for the job
    # one_thread: as each process of the job ran, the same arithmetic, bit for bit
    assert run(shapes_command(images, format, str(tmp_path / "one"))) == 0

    a, b = layertap.open_features(tmp_path / "one"), layertap.open_features(target.removeprefix("file://"))
    assert b.complete and list(a) == list(b) == ["features.block2", "features.block4.relu4", "classifier"]
    for key in a:
        assert a[key].shape == b[key].shape and np.array_equal(a.to_numpy(key), b.to_numpy(key), equal_nan=True), key
    assert np.array_equal(a.ids, b.ids) and np.array_equal(a.labels, b.labels)
    assert [f.index for f in b.failed] == [10] and b.failed == a.failed  # the truncated JPEG, recorded once
    assert np.isnan(b.to_numpy("classifier")[10]).all() and not np.isnan(np.delete(b.to_numpy("classifier"), 10, 0)).any()
    assert b.meta["classes"] == a.meta["classes"] and b.meta["root"] == str(images.absolute())
    # 6 chunks of 8 samples, dealt out in turn: each process wrote its own
    assert {c: m["process"] for c, m in markers(Path(target.removeprefix("file://"))).items()} == {0: 0, 1: 1, 2: 0, 3: 1, 4: 0, 5: 1}


def test_one_failing_rank_fails_every_rank_instead_of_leaving_them_waiting(scenarios):
    lines = scenarios.said("collectives")
    assert {"rank 0: StoreError: rank 0 could not make it", "rank 1: StoreError: rank 0 could not make it"} <= lines
    assert {"rank 0: [0, 'made']", "rank 1: [0, 'made']"} <= lines  # made on rank 0, given to all
    assert "rank 1: ValueError: rank 1 broke" in lines  # its own error
    # rank 0 finds its peer gone, and says why from what rank 1 left in the launcher's store
    assert any(line.startswith("rank 0: RankFailedError: rank 1 of 2: ValueError: rank 1 broke; the whole chunks") for line in lines), lines


def test_processes_with_different_weights_are_refused(scenarios):
    said, stderr = scenarios.said("different"), scenarios.stderr("different")
    assert len(said) == 2 and "rank 0: exit 0" not in said and "rank 1: exit 0" not in said, said
    assert "rank 1 of 2 has other settings than rank 0: model (fingerprint" in stderr, stderr
    assert "every process must load the same model" in stderr
    assert not (scenarios.folder / "different.zarr").exists()


def test_ranks_whose_weights_differ_anywhere_are_all_stopped_before_the_first_batch(scenarios):
    lines = sorted(scenarios.said("one weight"))
    said = [line.split(": ", 1)[1] for line in lines]
    assert [line.split(":")[0] for line in lines] == ["rank 0", "rank 1"] and said[0] == said[1], lines  # one line, the same on every rank
    assert said[0].startswith("StoreError: rank 1 of 2 has other settings than rank 0: model (fingerprint of its state, tree and code) '"), lines
    assert said[0].endswith("every process must load the same model (seed random weights) and read the same data")
    assert not (scenarios.folder / "one-weight.zarr").exists()  # before the first batch: nothing was written


def test_under_ddp_each_rank_taps_its_own_replica(scenarios):
    assert scenarios.said("ddp") == {"rank 0: batch 2 same True grad True", "rank 1: batch 2 same True grad True"}


def test_a_job_that_loses_a_rank_resumes_with_another_number_of_processes(tmp_path, one_thread):
    data = tmp_path / "x.npy"
    np.save(data, np.random.default_rng(0).standard_normal((60, 3, 32, 32), dtype=np.float32))
    out = tmp_path / "f.zarr"
    args = ["extract", "slow_model:slow", str(data), "--layers", "conv", "--layers", "pool", "--out", str(out), "--batch-size", "4", "--chunk-size", "8"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": TESTS}
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    job_ = subprocess.Popen([*launcher, "-m", "layertap", *args], stdout=subprocess.PIPE, stderr=open(tmp_path / "job.log", "w"), text=True, env=env)  # noqa: SIM115 - the job writes to it until it ends
    started = {"0": 0, "1": 0}
    while started["1"] < 4:  # rank 1 has written its first chunk (2 batches) and is on its second
        line = job_.stdout.readline()
        assert line, f"the job ended before it could be killed (rc={job_.wait()})"
        if line.startswith("batch"):
            _, rank, pid = line.split()
            started[rank] += 1
    os.kill(int(pid), signal.SIGKILL)  # rank 1 dies; torchrun stops the job
    assert job_.wait(timeout=60) != 0
    job_.stdout.close()

    done = markers(out)
    assert 0 < len(done) < 8 and 1 in done and done[1]["process"] == 1, done
    assert not layertap.FeatureStore(out).complete

    resumed = cli(*args, env={"PYTHONPATH": TESTS})  # one process, without torchrun: the job of 2 is a store of 1
    assert resumed.returncode == 0, resumed.stderr
    assert f"resuming {out}: {len(done)} of 8 chunks already written" in resumed.stderr
    # only the missing chunks ran: 2 batches each, 1 for the last (4 samples)
    # and the first batch of the first and of the last written chunk, computed again on rank 0 to check them
    checked = 2 if len(done) > 1 else 1
    assert resumed.stdout.count("batch ") == sum(2 if c < 7 else 1 for c in range(8) if c not in done) + checked
    written = markers(out)
    assert {m["process"] for c, m in written.items() if c not in done} == {0}

    # one_thread: as each process of the job ran, the same arithmetic, bit for bit
    whole = layertap.extract_dataset(slow_model.Slow(), str(data), ["conv", "pool"], tmp_path / "whole.zarr", batch_size=4, chunk_size=8, progress=False)
    store = layertap.open_features(out)
    assert store.complete
    for key in whole:
        assert np.array_equal(store.to_numpy(key), whole.to_numpy(key)), key


# ------------------------------------------------------------ in one process: the pieces
def test_hdf5_is_refused_when_several_processes_would_write_it(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 4))
    with pytest.raises(StoreError, match="cannot write one HDF5 file.*HDF5 takes one writer at a time.*Zarr"):
        layertap.extract_dataset(model, torch.zeros(8, 3, 2, 2), "1", tmp_path / "f.h5", progress=False)
    assert not (tmp_path / "f.h5").exists()


class Stream(torch.utils.data.IterableDataset):
    """Samples that can only be read in order, though their number is known."""

    def __len__(self):
        return 6

    def __iter__(self):
        return (torch.zeros(3, 2, 2) for _ in range(6))


def test_data_read_only_in_order_is_refused_when_several_processes_would_share_it(monkeypatch, tmp_path):
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 4))
    for data in ((torch.zeros(2, 3, 2, 2) for _ in range(3)), Stream(), torch.utils.data.DataLoader(Stream(), batch_size=2)):
        with pytest.raises(StoreError, match="can only be read in order, so 2 processes cannot share it out"):
            layertap.extract_dataset(model, data, "1", tmp_path / "f.zarr", progress=False)
    assert not torch.distributed.is_initialized()  # refused before any process group was made
    with pytest.raises(StoreError, match="in this process's memory, which the other 1 processes cannot see"):
        layertap.extract_dataset(model, torch.zeros(4, 3, 2, 2), "1", "memory://x/f.zarr", progress=False)


def test_one_process_of_a_job_can_extract_alone(monkeypatch, tmp_path):
    # e.g. rank 0 of a training job: the others never call extract_dataset
    monkeypatch.setenv("WORLD_SIZE", "2")
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 4))
    x = torch.randn(8, 3, 2, 2)
    store = layertap.extract_dataset(model, x, "1", tmp_path / "f.h5", batch_size=4, progress=False, distributed=False)
    assert store.complete and torch.equal(store.to_torch("1"), layertap.extract(model, x, "1")["1"])
    assert not torch.distributed.is_initialized()


def test_the_launchers_environment_says_rank_and_world(monkeypatch):
    assert launched() == (0, 1, 0)
    monkeypatch.setenv("RANK", "5")
    monkeypatch.setenv("WORLD_SIZE", "8")
    monkeypatch.setenv("LOCAL_RANK", "1")
    assert launched() == (5, 8, 1)


def test_each_process_takes_its_own_gpu():
    assert rank_device("cuda", 3, 4) == torch.device("cuda", 3)  # torchrun: one process per GPU
    assert rank_device("cuda:0", 3, 4) == torch.device("cuda", 0)  # a device the user named stays
    assert rank_device("cpu", 3, 4) == torch.device("cpu")
    assert rank_device("cuda", 0, 1) == "cuda" and rank_device(None, 3, 4) is None


def test_one_process_alone_needs_no_process_group():
    with job() as procs:
        assert (procs.rank, procs.world, procs.main) == (0, 1, True)
        assert procs.gather("x") == ["x"] and procs.share(lambda: 7) == 7 and procs.together(lambda: 8) == 8
        with pytest.raises(ValueError, match="own error"):
            procs.share(lambda: (_ for _ in ()).throw(ValueError("its own error")))
    assert not torch.distributed.is_initialized()


def test_chunks_are_dealt_out_to_any_number_of_processes(tmp_path):
    model = torch.nn.Sequential(torch.nn.Flatten(), torch.nn.Linear(12, 4))
    store = layertap.extract_dataset(model, torch.randn(30, 3, 2, 2), "1", tmp_path / "f.zarr", batch_size=2, chunk_size=4, progress=False)
    store.close()
    writer = StoreWriter.open(tmp_path / "f.zarr")
    try:
        for world in (1, 2, 3, 5, 9):  # 8 chunks; with 9 processes one gets none
            plans = [dataset_plan(writer, [2, 6], rank, world) for rank in range(world)]
            taken = np.concatenate(plans)
            assert sorted(taken.tolist()) == [i for i in range(30) if i // 4 not in (2, 6)]  # every missing sample once
            assert all(len(set((p // 4).tolist()) & set((q // 4).tolist())) == 0 for i, p in enumerate(plans) for q in plans[i + 1 :])
            sizes = [len(set((p // 4).tolist())) for p in plans]
            assert max(sizes) - min(sizes) <= 1, sizes  # as even as whole chunks allow
    finally:
        writer.close()


def test_every_process_gets_a_few_chunks_even_of_a_small_dataset():
    # resnet50's avgpool: 8 KB per sample, so one process writes chunks of 2048 samples (16 MB)
    assert chunk_size(32, 8192, None, 256, 1) == 2048
    assert chunk_size(32, 8192, None, 256, 2) == 32  # 256 samples, 2 processes: 4 chunks each
    assert chunk_size(32, 8192, None, 10**6, 8) == 2048  # a big dataset keeps its 16 MB chunks
    assert chunk_size(32, 8192, None, 40, 4) == 32  # never less than a batch
    assert chunk_size(32, 8192, 100, 256, 2) == 100  # the caller's choice stands


def test_random_weights_are_the_same_in_every_process_that_loads_them():
    state = torch.random.get_rng_state()
    a, b = layertap.load_model("torchvision:squeezenet1_1"), layertap.load_model("torchvision:squeezenet1_1")  # a small one
    assert all(torch.equal(x, y) for x, y in zip(a.state_dict().values(), b.state_dict().values()))
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random stream is left alone
