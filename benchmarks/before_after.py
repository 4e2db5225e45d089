"""Benchmarks before and after a change, side by side in one run: the same scripts, two source trees.

A restructuring should cost nothing. This runs each benchmark script of this checkout against the
package of an earlier revision and against the working tree, alternating which goes first, round
after round, and prints every run's output under its label: the ratios each script prints (to a
plain forward, to hand-written hooks) are then read side by side, measured under the same load.

The earlier revision is exported with ``git archive`` into a temporary folder; the compiled C
extensions of this checkout are copied next to it when its C sources are the same (else that tree
runs without them, and a line says so).

Run: python benchmarks/before_after.py --before REV [--rounds 2] [--timeout 1200] bench_tap.py "bench_stats.py --rounds 5" ...
"""

from __future__ import annotations

import argparse
import filecmp
import os
import shlex
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGE = ROOT / "src" / "layertap"


def export(rev: str, into: Path) -> Path:
    """The ``src`` tree of ``rev``, unpacked into ``into``, with this checkout's extensions if they match."""
    archive = into / "src.tar"
    with archive.open("wb") as out:
        subprocess.run(["git", "-C", str(ROOT), "archive", "--format=tar", rev, "src"], stdout=out, check=True)
    with tarfile.open(archive) as tar:
        tar.extractall(into, filter="data")
    package = into / "src" / "layertap"
    for built in PACKAGE.glob("*.so"):
        source = PACKAGE / (built.name.split(".")[0] + ".c")
        if (package / source.name).exists() and filecmp.cmp(source, package / source.name, shallow=False):
            shutil.copy2(built, package / built.name)
        else:
            print(f"note: {source.name} differs at {rev}: that tree runs without {built.name}")
    return into / "src"


def run(label: str, src: Path, script: list[str], timeout: float) -> None:
    env = dict(os.environ, PYTHONPATH=str(src))
    where = subprocess.run([sys.executable, "-c", "import layertap; print(layertap.__file__)"], env=env, capture_output=True, text=True)
    print(f"\n===== {label}: {' '.join(script)}  (layertap from {where.stdout.strip() or where.stderr.strip()})", flush=True)
    done = subprocess.run([sys.executable, str(ROOT / "benchmarks" / script[0]), *script[1:]], env=env, timeout=timeout, text=True, capture_output=True)
    print(done.stdout, end="", flush=True)
    if done.returncode:
        print(f"[{label} exited {done.returncode}] {done.stderr[-2000:]}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", required=True, help="the earlier revision (a commit, tag or branch)")
    parser.add_argument("--rounds", type=int, default=2, help="runs of each script per tree, alternating which goes first")
    parser.add_argument("--timeout", type=float, default=1200, help="seconds one run of one script may take")
    parser.add_argument("scripts", nargs="+", help="benchmark scripts in benchmarks/, each with its options, quoted")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="layertap-before-") as folder:
        trees = {f"before ({args.before})": export(args.before, Path(folder)), "after (working tree)": ROOT / "src"}
        for line in args.scripts:
            script = shlex.split(line)
            for round_ in range(args.rounds):
                order = list(trees.items()) if round_ % 2 == 0 else list(reversed(trees.items()))
                for label, src in order:
                    run(f"{label}, round {round_ + 1}", src, script, args.timeout)


if __name__ == "__main__":
    main()
