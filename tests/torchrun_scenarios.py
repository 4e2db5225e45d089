"""One torchrun launch that plays many scenarios, each rank printing one JSON line per scenario.

Every process of a launch imports torch (seconds each), so one launch plays every scenario of a
test file. The script side: ``from torchrun_scenarios import play`` (this folder is on the
launched processes' ``PYTHONPATH``). The test side: `launch` and `played`.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import traceback
from collections.abc import Callable
from pathlib import Path

TESTS = str(Path(__file__).parent)


def play(scenario: str, check: Callable[[], dict | None]) -> None:
    """Run ``check`` on this rank and print what it returned, or how it failed."""
    import torch

    rank = torch.distributed.get_rank()
    try:
        fields = {"ok": True, **(check() or {})}
    except Exception as e:
        fields = {"ok": False, "error": f"{type(e).__name__}: {e}", "where": traceback.format_exc()[-1500:]}
    sys.stdout.write(json.dumps({"scenario": scenario, "rank": rank, **fields}) + "\n")
    sys.stdout.flush()


def launch(script: str, folder: Path, procs: int, *args: str, timeout: int = 300) -> dict[str, list[dict]]:
    """``script`` under ``torchrun --nproc-per-node procs`` (one thread each): the lines each
    scenario printed, by scenario name."""
    (folder / "script.py").write_text(script)
    launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "PYTHONPATH": os.pathsep.join([TESTS, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([*launcher, str(folder / "script.py"), str(folder), *args], capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, done.stderr[-4000:]
    said: dict[str, list[dict]] = {}
    for line in done.stdout.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            said.setdefault(record["scenario"], []).append(record)
    return said


def played(said: dict[str, list[dict]], scenario: str, ranks: int) -> list[dict]:
    """The lines of ``scenario``, one per rank in rank order, each of a check that passed."""
    lines = sorted(said.get(scenario, []), key=lambda line: line["rank"])
    assert [line["rank"] for line in lines] == list(range(ranks)), lines
    assert all(line["ok"] for line in lines), [(line.get("error"), line.get("where")) for line in lines]
    return lines
