"""layertap.allocator: glibc tuned for real (in subprocesses: mallopt is the whole process's and
cannot be undone), a no-op elsewhere; the command line tunes its own process, flat in memory."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import numpy as np
import pytest

from layertap import allocator
from layertap.cli import run
from layertap.errors import ArgumentError

glibc_only = pytest.mark.skipif(allocator._glibc() is None, reason="mallopt and /proc/self/status are glibc's and Linux's")


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without the variables that set glibc's allocator from outside."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LAYERTAP_ALLOCATOR")}
    return {**env, **extra}


# Minor page faults per round of allocating, filling and freeing 6 blocks of 20 MiB (30 720
# pages of 4 KiB), each under the 32 MiB mmap threshold, together over glibc's adaptive trim
# threshold (twice the largest block freed so far): by default the heap's top goes back to the
# kernel and is faulted in again. The first round, which grows the heap, is not counted. The
# blocks come from malloc itself: torch's tensors bring small allocations of their own, which
# may pin the top of the heap and make the default's faults come and go.
CHURN = """
import ctypes
import resource

libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.malloc.argtypes, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_size_t], [ctypes.c_void_p]
BLOCKS, SIZE = 6, 20 << 20

def status(key):
    return int(next(line.split()[1] for line in open("/proc/self/status") if line.startswith(key)))

def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt

def churn(rounds=3):
    new, dropped = [], []
    for _ in range(rounds):
        before = faults()
        blocks = [libc.malloc(SIZE) for _ in range(BLOCKS)]
        for block in blocks:
            ctypes.memset(block, 1, SIZE)
        held = status("VmRSS")
        for block in blocks:
            libc.free(block)
        dropped.append(held - status("VmRSS"))
        new.append(faults() - before)
    return {"faults": min(new[1:]), "rss_dropped_kb": min(dropped[1:])}
"""


@glibc_only
def test_tuned_glibc_keeps_freed_memory_and_takes_no_new_page_faults():
    script = CHURN + """
import json
from layertap.allocator import tune_allocator

import torch

def tensor_churn(rounds=5):  # the same with torch's tensors: after a few rounds, no new faults
    new = []
    for _ in range(rounds):
        before = faults()
        tensors = [torch.ones(SIZE // 4) for _ in range(BLOCKS)]
        del tensors
        new.append(faults() - before)
    return min(new[2:])

default = churn()
tuning = tune_allocator()
again = tune_allocator()
tuned = churn()
tensors = tensor_churn()
print(json.dumps({"default": default, "tuned": tuned, "tensors": tensors, "tuning": str(tuning), "applied": tuning.applied, "idempotent": again == tuning}))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, env=clean_env())
    got = json.loads(done.stdout)
    pages = 6 * (20 << 20) // 4096
    assert got["applied"] and got["idempotent"], got
    assert "mmap threshold 32 MiB" in got["tuning"] and "trim threshold 1024 MiB" in got["tuning"]
    # glibc as it comes: the freed blocks go back to the kernel and are faulted in again
    assert got["default"]["faults"] > pages / 2, got
    assert got["default"]["rss_dropped_kb"] > 60_000, got
    # tuned: the heap keeps them, and the next allocation reuses them without a fault
    assert got["tuned"]["faults"] < pages / 50, got
    assert got["tuned"]["rss_dropped_kb"] < 10_000, got
    assert got["tensors"] < pages / 50, got


def test_elsewhere_it_does_nothing_and_says_why(monkeypatch):
    def no_libc(name):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(allocator.ctypes, "CDLL", no_libc)  # Linux without glibc's libc.so.6 (musl)
    tuning = allocator.tune_allocator()
    assert not tuning.applied and tuning.mmap_threshold is None and "not glibc" in tuning.reason
    assert str(tuning).startswith("allocator not tuned: ")
    trimmer = allocator.HeapTrimmer(every=1)
    assert trimmer.trim is None
    trimmer(10)  # no-op

    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda name: types.SimpleNamespace())  # a libc.so.6 that is not glibc
    assert not allocator.tune_allocator().applied

    monkeypatch.setattr(allocator, "sys", types.SimpleNamespace(platform="darwin"))  # macOS, Windows: not even looked for
    monkeypatch.setattr(allocator.ctypes, "CDLL", lambda name: pytest.fail("a C library was loaded"))
    assert allocator.tune_allocator() == allocator.AllocatorTuning(False, reason="the C library is not glibc (darwin)")


@pytest.mark.parametrize("options", [dict(mmap_threshold=64 << 20), dict(mmap_threshold=0), dict(trim_threshold=-1), dict(trim_threshold=1 << 31)])
def test_thresholds_glibc_would_refuse_are_refused_before_any_change(options, monkeypatch):
    monkeypatch.setattr(allocator, "_glibc", lambda: pytest.fail("the allocator was touched"))
    with pytest.raises(ArgumentError, match="threshold"):
        allocator.tune_allocator(**options)


class Tuned(Exception):
    pass


COMMANDS = {
    "extract": ["layertap:shapes", "{data}", "--layers", "pool", "--out", "{data}/out.zarr", "--no-progress"],
    "stats": ["layertap:shapes", "{data}", "--no-progress"],
    "cam": ["layertap:shapes", "{data}", "--out", "{data}/maps"],
    "report": ["{data}/none.zarr"],
}


@pytest.mark.parametrize("command", COMMANDS)
def test_the_commands_that_run_models_tune_their_process_first(command, tmp_path, monkeypatch, capsys):
    def tune():  # stands in for the real one, which would change the allocator of this process
        raise Tuned("tuned")

    monkeypatch.setattr(allocator, "tune_allocator", tune)
    monkeypatch.delenv("LAYERTAP_ALLOCATOR", raising=False)
    args = [command, *(a.format(data=tmp_path) for a in COMMANDS[command])]
    assert run(args) == 1
    assert capsys.readouterr().err == "layertap: error: tuned\n"

    monkeypatch.setenv("LAYERTAP_ALLOCATOR", "tuned")
    assert run(args) == 1 and "tuned" in capsys.readouterr().err

    monkeypatch.setenv("LAYERTAP_ALLOCATOR", "default")  # the command goes on, untuned (and fails: no data)
    assert run(args) in (1, 2) and "tuned" not in capsys.readouterr().err

    monkeypatch.setenv("LAYERTAP_ALLOCATOR", "fast")
    assert run(args) == 2 and "LAYERTAP_ALLOCATOR='fast'" in capsys.readouterr().err


def test_other_commands_leave_the_allocator_alone(monkeypatch):
    monkeypatch.setattr(allocator, "tune_allocator", lambda: pytest.fail("inspect tuned the allocator"))
    assert run(["inspect", "torch.nn:Identity"]) == 0


# 64 KB of features per sample, as in test_dataset's memory test: 1600 samples are 100 MB
TINY_MODEL = """
import torch

def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Conv2d(3, 64, 3, padding=1), torch.nn.ReLU())
"""

EXTRACT = """
import sys

from layertap.cli import run

data, out = sys.argv[1:]
assert run(["extract", "tiny:model", data, "--layers", "0", "--out", out, "--batch-size", "50", "--no-progress"]) == 0
""" + CHURN + """
# this process's own peak (ru_maxrss would also count the parent's), and proof that it was tuned
print(status("VmHWM"), churn()["faults"])
"""


@glibc_only
def test_peak_memory_does_not_grow_with_the_number_of_samples_when_tuned(tmp_path):
    """test_dataset's flat-memory test, through ``layertap extract``: tune_allocator, then extract_dataset."""
    (tmp_path / "tiny.py").write_text(TINY_MODEL)
    env = clean_env(PYTHONPATH=os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]))

    def start(n: int) -> subprocess.Popen:
        data = tmp_path / f"{n}.npy"
        np.save(data, np.random.default_rng(n).standard_normal((n, 3, 16, 16), dtype=np.float32))
        command = [sys.executable, "-c", EXTRACT, str(data), str(tmp_path / f"{n}.zarr")]
        return subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)

    def peak(run: subprocess.Popen) -> int:
        out, err = run.communicate()
        assert run.returncode == 0, err
        vmhwm, faults = map(int, out.split()[-2:])
        assert faults < 600, f"the command did not tune its process: {faults} page faults"
        return vmhwm

    small, large = start(200), start(1600)  # side by side: each reads its own peak
    small_run, large_run = peak(small), peak(large)
    assert large_run < small_run * 1.10, (small_run, large_run)
