"""The cost of `layertap.watch` on a resnet18 training step (CPU, random weights, batch 32).

Images are 112 px, not 224: a 224-px step takes seconds on this shared 2-core machine, and the
ratios are what matters. Every leaf module is watched (the default: 52 modules, 60 rows per
kind, since each block's ReLU runs twice). Per round, in one process, interleaved:

- ``plain``: zero_grad, forward, cross-entropy, backward, SGD step;
- ``watch, sampled step``: the same inside a watch whose step is sampled (step 0), the
  flush of its statistics included (``w.step()``);
- ``watch, unsampled step``: the same and ``w.step()``, on a step the watch does not sample;
- with ``--sinks``, the sampled step again with a CSV and a TensorBoard sink;
- ``wandb.watch(log="all")`` (offline, when wandb is installed), logging every step
  (``log_freq=1``) and every 100 (``log_freq=100``, a step it does not log).

A watch every 100 steps costs ``(99 x unsampled + sampled) / 100`` per step: that amortised
ratio is reported beside the two measured ones. Minimum times over the rounds: wall clock, and
the process's CPU time (both threads), which other processes disturb less.

Run: python benchmarks/bench_watch.py [--rounds 8] [--batch 32] [--size 112] [--sinks] [--threads N]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import tempfile
import time
from collections.abc import Callable
from typing import Any

import torch
import torchvision
from torch import nn

from layertap.watch import CSV, TensorBoard, watch


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--sinks", action="store_true", help="also time a sampled step with CSV and TensorBoard sinks")
    parser.add_argument("--no-wandb", action="store_true")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    torch.manual_seed(0)
    model = torchvision.models.resnet18()
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)  # small: weights stay sane over the rounds
    x = torch.randn(args.batch, 3, args.size, args.size)
    y = torch.randint(0, 1000, (args.batch,))
    loss_fn = nn.CrossEntropyLoss()

    def train_step() -> None:
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        opt.step()

    folder = tempfile.mkdtemp()
    with contextlib.ExitStack() as stack:
        # a sampled step is step 0 of a watch of its own (made, entered, and its statistics
        # flushed at the exit: about 1 ms beside the step); the unsampled steps are those of one
        # watch that runs throughout, from step 1, every 1000 steps: none is sampled here
        rarely = stack.enter_context(watch(model, every=1000, start=1, alerts=False))

        def unsampled() -> None:
            train_step()
            rarely.step()

        methods: dict[str, Callable[[], None]] = {
            "plain": train_step,
            "watch, sampled step": lambda: _watched(model, train_step, every=1),
            "watch, unsampled step": unsampled,
        }
        if args.sinks:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(os.path.join(folder, "tb"))
            stack.callback(writer.close)
            table = CSV(os.path.join(folder, "watch.csv"))
            stack.callback(table.close)
            sinks = [_Open(table), TensorBoard(writer=writer)]
            methods["watch, sampled step, CSV + TensorBoard"] = lambda: _watched(model, train_step, every=1, sinks=sinks)
        run = None if args.no_wandb else _wandb(stack, folder)
        if run is not None:
            methods["wandb.watch(log='all'), logging step"] = lambda: _wandb_step(run, model, train_step, 1)
            methods["wandb.watch(log='all'), log_freq=100 step"] = lambda: _wandb_step(run, model, train_step, 100)

        for fn in methods.values():  # warm-up
            fn()
        times: dict[str, list[float]] = {name: [] for name in methods}
        cpu: dict[str, list[float]] = {name: [] for name in methods}
        for _ in range(args.rounds):
            for name, fn in methods.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                fn()
                times[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)

    base, base_cpu = min(times["plain"]), min(cpu["plain"])
    print(f"resnet18 training step, batch {args.batch}, {args.size} px, {torch.get_num_threads()} threads, "
          f"min of {args.rounds} rounds (interleaved)")  # fmt: skip
    print(f"{'method':45s} {'wall s':>7s} {'x plain':>8s} {'CPU s':>7s} {'x plain':>8s}")
    for name in methods:
        wall, busy = min(times[name]), min(cpu[name])
        print(f"{name:45s} {wall:7.3f} {wall / base:8.3f} {busy:7.3f} {busy / base_cpu:8.3f}")
    amortised = [(99 * min(t["watch, unsampled step"]) + min(t["watch, sampled step"])) / 100 / min(t["plain"]) for t in (times, cpu)]
    print(f"{'watch every=100, amortised (99 + 1 sampled)':45s} {'':7s} {amortised[0]:8.3f} {'':7s} {amortised[1]:8.3f}")


def _watched(model: nn.Module, step: Callable[[], None], **options: Any) -> None:
    """One training step inside a watch of its own, then the watch's ``step()`` and exit."""
    with watch(model, alerts=False, **options) as w:
        step()
        w.step()


class _Open:
    """A sink that the per-step watches cannot close: one file for all the rounds."""

    def __init__(self, sink: Any) -> None:
        self.sink = sink

    def write(self, step: int, records: Any) -> None:
        self.sink.write(step, records)

    def close(self) -> None:
        pass


def _wandb(stack: contextlib.ExitStack, folder: str):
    try:
        import wandb
    except ImportError:
        print("wandb is not installed: its row is left out")
        return None
    os.environ.setdefault("WANDB_SILENT", "true")
    run = wandb.init(project="bench_watch", mode="offline", dir=folder)
    stack.callback(run.finish)
    return run


def _wandb_step(run, model: nn.Module, step: Callable[[], None], log_freq: int) -> None:
    """One step under ``wandb.watch``: with ``log_freq=1`` it logs every parameter's and gradient's
    histogram; with 100, the step is one it does not log (its hooks still run)."""
    run.watch(model, log="all", log_freq=log_freq)
    try:
        step()
        run.log({"loss": 0.0})
    finally:
        run.unwatch(model)


if __name__ == "__main__":
    main()
