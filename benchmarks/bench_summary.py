"""Cost of `layertap.summary` next to the plain forward it wraps (and next to a real-value tap).

Baseline: ``model(x)`` under ``torch.no_grad()`` in eval mode. Contender: ``summary(model, x)``
(one forward with input and output hooks on every module, keeping only shapes). Also shown: the
same hooks keeping the real tensors (``layertap.tap(..., keep="all")``), which is what a summary
would cost without moving values to the meta device. Rounds are interleaved in one process;
the table reports min times and their ratio to the baseline.

    python benchmarks/bench_summary.py [--rounds 15]
"""

from __future__ import annotations

import argparse
import time

import torch
import torchvision
from torch import nn

import layertap


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def bench(model: nn.Module, x: torch.Tensor, rounds: int) -> tuple[float, float, float]:
    """Min times (ms) of the plain forward, the summary and a tap keeping every real value."""

    def forward():
        with torch.no_grad():
            model(x)

    def summary():
        layertap.summary(model, x)

    def tap_all():
        with torch.no_grad(), layertap.tap(model, ["", nn.Module], capture=("input", "output"), keep="all"):
            model(x)

    contenders = (forward, summary, tap_all)
    times: list[list[float]] = [[] for _ in contenders]
    for fn in contenders:  # warm-up
        fn()
    for _ in range(rounds):
        for fn, runs in zip(contenders, times):
            runs.append(timed(fn))
    base, s, t = (min(runs) * 1e3 for runs in times)
    return base, s, t


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rounds", type=int, default=15)
    args = parser.parse_args()
    torch.set_num_threads(1)
    cases = {
        "resnet50 1x3x224x224": (torchvision.models.resnet50().eval(), torch.randn(1, 3, 224, 224)),
        "resnet18 8x3x64x64": (torchvision.models.resnet18().eval(), torch.randn(8, 3, 64, 64)),
    }
    print(f"{'model':24} {'forward ms':>11} {'summary ms':>11} {'ratio':>6} {'tap(all) ms':>12} {'ratio':>6}")
    for label, (model, x) in cases.items():
        base, s, t = bench(model, x, args.rounds)
        print(f"{label:24} {base:11.1f} {s:11.1f} {s / base:6.2f} {t:12.1f} {t / base:6.2f}")


if __name__ == "__main__":
    main()
