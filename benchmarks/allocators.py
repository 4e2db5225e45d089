"""Run a benchmark under glibc's allocator as it comes and tuned (`layertap.tune_allocator`).

The C allocator is set for the whole process and for good, so each setting runs in a child
process: ``--allocator default``, ``tuned``, or ``both`` (the benchmarks' default): the two
children one after the other, each with its ratios to its own baseline, then the tuned/default
ratio of each method's minimum time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from layertap.allocator import tune_allocator


def add_option(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--allocator", choices=["default", "tuned", "both"], default="both",
                        help="glibc's allocator as it comes, tuned, or both (a child process each)")
    parser.add_argument("--json", help=argparse.SUPPRESS)  # a child writes its minimum times here


def start(args: argparse.Namespace) -> bool:
    """For ``both``: run the two children, compare them, and return False (nothing left to do).
    Otherwise set this process's allocator, say which it is, and return True."""
    if args.allocator == "both":
        _both()
        return False
    tuning = tune_allocator() if args.allocator == "tuned" else None
    print(f"allocator: {args.allocator}" + (f" ({tuning})" if tuning is not None else " (glibc's adaptive thresholds)"), flush=True)
    return True


def save(args: argparse.Namespace, mins: dict[str, float]) -> None:
    """Hand a child's minimum times to its parent."""
    if args.json:
        Path(args.json).write_text(json.dumps(mins))


def _both() -> None:
    argv = sys.argv[1:]
    if "--allocator" in argv:
        i = argv.index("--allocator")
        del argv[i : i + 2]
    mins = {}
    with tempfile.TemporaryDirectory(prefix="bench_allocators_") as scratch:
        for allocator in ("default", "tuned"):
            out = Path(scratch, f"{allocator}.json")
            subprocess.run([sys.executable, sys.argv[0], *argv, "--allocator", allocator, "--json", str(out)], check=True)
            mins[allocator] = json.loads(out.read_text()) if out.exists() else {}
            print(flush=True)
    if mins["default"] and mins["tuned"]:
        print(f"{'tuned / default allocator, min time':48s} {'ratio':>7s}")
        for name, default in mins["default"].items():
            print(f"{name:48s} {mins['tuned'][name] / default:6.2f}x")
