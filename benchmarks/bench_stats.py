"""The cost of `layertap.stats` over the plain forward on resnet50 (CPU, random weights).

Per round, one batch goes through: the plain forward under inference_mode (the baseline),
`stats` of the 4 stages, of every Conv2d and BatchNorm2d (106 maps; again with PyTorch's kernels
instead of layertap's C kernel, as where the package was built without it), of every leaf module (the
default: 126 modules, 158 rows since the ReLUs of each block run 3 times), and every leaf with
per-channel output and a 64-bin histogram.
The methods run interleaved in one process, round after round; the ratio of minimum times is
reported, since this shared 2-core machine is noisy: wall time, and the process's CPU time
(both threads), which other processes disturb less.

The allocator matters (`layertap.allocator`): by default both settings run, each in a child
process (see ``allocators.py``).

Run: python benchmarks/bench_stats.py [--rounds 15] [--batch 8] [--size 224] [--allocator both]
"""

from __future__ import annotations

import argparse
import importlib
import statistics
import time
from collections.abc import Callable
from unittest import mock

import allocators
import torch
import torchvision
from torch import nn

import layertap

# the module that reads tensors; its kernel switched off (a private switch, for this
# comparison only) gives the statistics of a package built without its C kernel
try:
    stats_module = importlib.import_module("layertap.tensorstats")
except ImportError:  # a layertap from before the split (benchmarks/before_after.py): the kernel was read in stats
    stats_module = importlib.import_module("layertap.stats")
STAGES = ["layer1", "layer2", "layer3", "layer4"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    allocators.add_option(parser)
    args = parser.parse_args()
    if not allocators.start(args):
        return

    torch.manual_seed(0)
    model = torchvision.models.resnet50().eval()
    batch = [torch.randn(args.batch, 3, args.size, args.size)]

    convbn = layertap.select(model, [nn.Conv2d, nn.BatchNorm2d])

    def forward() -> None:
        with torch.inference_mode():
            model(batch[0])

    methods: dict[str, Callable[[], object]] = {
        "plain forward": forward,
        "stats, 4 stages": lambda: layertap.stats(model, batch, STAGES, progress=False),
        "stats, every Conv2d+BN": lambda: layertap.stats(model, batch, convbn, progress=False),
        "  PyTorch's kernels": mock.patch.object(stats_module, "_moments", None)(lambda: layertap.stats(model, batch, convbn, progress=False)),
        "stats, every leaf": lambda: layertap.stats(model, batch, progress=False),
        "  + per-channel, 64 bins": lambda: layertap.stats(model, batch, per_channel=True, histogram_bins=64, progress=False),
    }
    rows = {name: len(fn()) if name != "plain forward" else 0 for name, fn in methods.items()}  # warm-up
    wall: dict[str, list[float]] = {name: [] for name in methods}
    cpu: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(args.rounds):
        for name, fn in methods.items():
            start, start_cpu = time.perf_counter(), time.process_time()
            fn()
            wall[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)

    base, base_cpu = min(wall["plain forward"]), min(cpu["plain forward"])
    print(
        f"resnet50, batch {args.batch}x3x{args.size}x{args.size}, {args.rounds} rounds, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}"
    )
    print(f"{'method':26} {'rows':>5} {'min s':>7} {'median s':>9} {'ratio':>6} {'min cpu s':>10} {'cpu ratio':>10}")
    for name in methods:
        ts, cs = wall[name], cpu[name]
        print(
            f"{name:26} {rows[name] or '-':>5} {min(ts):7.3f} {statistics.median(ts):9.3f} {min(ts) / base:6.2f} "
            f"{min(cs):10.3f} {min(cs) / base_cpu:10.2f}"
        )
    allocators.save(args, {name: min(ts) for name, ts in wall.items()})


if __name__ == "__main__":
    main()
