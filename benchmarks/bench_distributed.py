"""Extraction with 1 and 2 processes under torchrun, next to a plain single-process loop.

The same generated JPEGs, model and layer for every row; each row is a fresh job, and its time
is the extraction's own (from a barrier before to a barrier after ``extract_dataset``, so the
processes' start and imports are left out; they are shown apart as "job wall"). torchrun gives
each of N processes 1/N of the cores (``OMP_NUM_THREADS``); the single process gets them all.

    python benchmarks/bench_distributed.py                  # resnet50 avgpool, 256 JPEGs, 2 rounds
    python benchmarks/bench_distributed.py --n 512 --rounds 3
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

LAYER = "avgpool"


def child(kind: str, folder: str, out: str, batch_size: int, workers: int) -> None:
    """One job's process: time the extraction (or the plain loop) between two barriers."""
    import torchvision

    import layertap
    from layertap.distributed import job

    model = layertap.load_model("torchvision:resnet50")
    with job() as procs:
        procs.gather(None)  # every process is ready
        start = time.perf_counter()
        if kind == "plain":  # the same images, preprocessing and batches, through the model alone
            dataset = torchvision.datasets.ImageFolder(folder, layertap.model_info(model).transform)
            with torch.no_grad():
                for images, _ in torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers):
                    model(images)
        else:
            layertap.extract_dataset(model, folder, LAYER, out, batch_size=batch_size, num_workers=workers, overwrite=True, progress=False)
        procs.gather(None)  # every process is done
        if procs.main:
            print(f"SECONDS {time.perf_counter() - start:.3f}", flush=True)


def run_job(kind: str, procs: int | None, args, folder: Path, scratch: Path) -> tuple[float, float]:
    """(extraction seconds, whole job's wall seconds) of one fresh job."""
    launcher = [] if procs is None else ["-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={procs}"]
    out = scratch / "feats.zarr"
    command = [sys.executable, *launcher, __file__, "--child", kind, str(folder), str(out), str(args.batch_size), str(args.workers)]
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, text=True, check=False)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        sys.exit(f"{kind} with {procs} process(es) failed:\n{done.stderr[-3000:]}")
    shutil.rmtree(out, ignore_errors=True)
    seconds = float(next(line.split()[1] for line in done.stdout.splitlines() if line.startswith("SECONDS")))
    return seconds, wall


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=256, help="JPEGs")
    parser.add_argument("--size", type=int, default=112, help="side of the generated JPEGs in pixels (the model's preprocessing resizes them to 224)")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=0, help="image-reading processes per extracting process")
    args = parser.parse_args()

    from layertap.shapes import generate, save_images

    rows = [
        ("plain loop, 1 process", "plain", None),
        ("layertap, 1 process", "layertap", None),
        ("layertap, torchrun 1 process", "layertap", 1),
        ("layertap, torchrun 2 processes", "layertap", 2),
    ]
    scratch = Path(tempfile.mkdtemp(prefix="bench_distributed_"))
    try:
        folder = scratch / "images"
        save_images(generate(args.n, seed=0, size=args.size), folder, format="jpg")
        times: dict[str, list[tuple[float, float]]] = {name: [] for name, _, _ in rows}
        for r in range(args.rounds):
            for name, kind, procs in rows if r % 2 == 0 else rows[::-1]:
                times[name].append(run_job(kind, procs, args, folder, scratch))
            print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1][0]:.1f}s" for k, v in times.items()), flush=True)
        base = min(t for t, _ in times["layertap, 1 process"])
        print(f"\nresnet50 (random weights) to {LAYER}, {args.n} JPEGs (resized to the model's 224 px), batch {args.batch_size}, "
              f"{args.workers} reading worker(s) per process, {os.cpu_count()} cores, {args.rounds} rounds, min time")
        print(f"{'job':<34}{'extract s':>10}{'samples/s':>11}{'vs 1 process':>14}{'job wall s':>12}")
        for name, values in times.items():
            best = min(t for t, _ in values)
            wall = min(w for _, w in values)
            print(f"{name:<34}{best:>10.2f}{args.n / best:>11.1f}{base / best:>13.2f}x{wall:>12.1f}")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        kind, folder, out, batch, workers = sys.argv[2:7]
        child(kind, folder, out, int(batch), int(workers))
    else:
        main()
