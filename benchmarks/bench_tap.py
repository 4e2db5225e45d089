"""The tap against its baselines on resnet50, batch 8, CPU: time ratios and correctness.

Methods run interleaved in one process, round after round, each round in a shuffled order, the
first round held out (it allocates and learns); the ratio of minimum times is reported (this
noisy 2-core machine needs minima). Correctness counts, per method, the captured layers that
differ from a trusted clone-in-the-hook reference.

Side by side for the copy pool (`layertap.tap.pool`, which outlives a tap): every Conv/BN raw
under inference_mode with a tap kept across batches, with a new tap per forward
(``with layertap.tap(model, convbn) as t: model(x)``), and with hand clones in hooks; then the
setup (entering and leaving a tap on the 106 Conv/BN layers, minimum of 30) from layer names,
from a type spec and from a `layertap.select.selection` made once.

The C allocator is set for the whole process and for good (`layertap.allocator`), so the
measurement runs in a child process per setting: ``--allocator default`` (glibc as it comes),
``tuned`` (`layertap.tune_allocator` first, as the ``layertap`` command does), or ``both``, the
default: the two children one after the other, each table with its ratios to the plain forward
under the same allocator, then the tuned/default ratio of each method's minimum.

Run: python benchmarks/bench_tap.py [--rounds 15] [--batch 8] [--size 224] [--allocator both] [--only TEXT]
"""

from __future__ import annotations

import argparse
import importlib
import random
import time
from collections.abc import Callable
from unittest import mock

import allocators
import torch
import torchvision
from torch import nn
from torchvision.models.feature_extraction import create_feature_extractor

import layertap

STAGES = ["layer1", "layer2", "layer3", "layer4"]
# the copy pool's module; its C copy switched off (a private switch, for this comparison only)
# gives the copies of a package built without it: copy_
try:
    pool_module = importlib.import_module("layertap.tap.pool")
except ImportError:  # a layertap from before the pool outlived a tap (benchmarks/before_after.py): the tap module
    pool_module = importlib.import_module("layertap.tap")
select_module = importlib.import_module("layertap.select")  # layertap.select is the function
PLAIN = "plain forward (limit)"
NEW_TAP = "layertap (b) same, new tap per forward"
KEPT_TAP = "layertap (b) Conv+BN raw, under inference_mode"
HAND_CLONE = "hand hooks, Conv+BN, clone"


def hand_hooks(model: nn.Module, names: list[str], clone: bool) -> tuple[dict, list]:
    """The tutorial hook: store each output in a dict, with or without clone()."""
    store: dict[str, torch.Tensor] = {}
    handles = []
    for name in names:
        def hook(m, args, out, name=name):
            store[name] = out.detach().clone() if clone else out.detach()

        handles.append(model.get_submodule(name).register_forward_hook(hook))
    return store, handles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--only", action="append", default=[], metavar="TEXT",
                        help="run only the methods whose name contains TEXT (repeatable); the plain forward always runs")
    allocators.add_option(parser)
    args = parser.parse_args()
    if not allocators.start(args):
        return

    torch.manual_seed(0)
    model = torchvision.models.resnet50().eval()
    x = torch.randn(args.batch, 3, args.size, args.size)
    convbn = layertap.select(model, [nn.Conv2d, nn.BatchNorm2d])

    t0 = time.perf_counter()
    fx_stages = create_feature_extractor(model, return_nodes=STAGES)
    fx_trace_stages = time.perf_counter() - t0
    t0 = time.perf_counter()
    fx_layer2 = create_feature_extractor(model, return_nodes=["layer2"])
    fx_trace_layer2 = time.perf_counter() - t0
    t0 = time.perf_counter()
    fx_convbn = create_feature_extractor(model, return_nodes=convbn)
    fx_trace_convbn = time.perf_counter() - t0

    # taps kept open across batches, as in an extraction loop; setup is measured apart
    taps = {
        "stages": layertap.tap(model, STAGES),
        "convbn": layertap.tap(model, convbn),
        # its own tap: one alternating between no_grad (49 copies) and inference_mode (106) would
        # allocate the 57 others afresh at every switch, which no extraction loop does
        "convbn_inference": layertap.tap(model, convbn),
        "convbn_inference_copy_": layertap.tap(model, convbn),
        "convbn_mean": layertap.tap(model, convbn, reduce="mean"),
        "layer2_stop": layertap.tap(model, "layer2", stop_early=True),
    }

    def run_tap(key: str, mode: Callable = torch.no_grad) -> Callable[[], dict]:
        # no_grad, not inference_mode: inference tensors have no version counter, so under
        # inference_mode the tap must copy every value that shares the network's memory
        def run() -> dict:
            with mode(), taps[key] as t:
                model(x)
            return t

        return run

    def inference(fn: Callable) -> Callable[[], object]:
        def run() -> object:
            with torch.inference_mode():
                return fn()

        return run

    def run_hooks(names: list[str], clone: bool) -> Callable[[], dict]:
        def run() -> dict:
            store, handles = hand_hooks(model, names, clone)
            model(x)
            for h in handles:
                h.remove()
            return store

        return run

    def new_tap(mode: Callable) -> Callable[[], dict]:
        # a fresh tap per batch: its first forward copies every value, into the memory of the
        # previous tap's copies (dropped by the caller), from the pool that outlives a tap
        def run() -> dict:
            with mode(), layertap.tap(model, convbn) as t:
                model(x)
            return t

        return run

    methods: dict[str, Callable[[], object]] = {
        PLAIN: inference(lambda: model(x)),
        "plain forward, no_grad": torch.no_grad()(lambda: model(x)),
        "hand hooks, 4 stages, clone": inference(run_hooks(STAGES, True)),
        "hand hooks, Conv+BN, no clone": inference(run_hooks(convbn, False)),
        "hand hooks, Conv+BN, clone": inference(run_hooks(convbn, True)),
        "FX extractor, 4 stages": inference(lambda: fx_stages(x)),
        "FX extractor, Conv+BN": inference(lambda: fx_convbn(x)),
        "FX truncated at layer2": inference(lambda: fx_layer2(x)),
        "layertap (a) 4 stages": run_tap("stages"),
        "layertap (b) Conv+BN raw": run_tap("convbn"),
        KEPT_TAP: run_tap("convbn_inference", torch.inference_mode),
        "layertap (b) same, copies by copy_": mock.patch.object(pool_module, "_copy", None)(run_tap("convbn_inference_copy_", torch.inference_mode)),
        "layertap (b) Conv+BN raw, new tap per batch": new_tap(torch.no_grad),
        NEW_TAP: new_tap(torch.inference_mode),
        "layertap (c) Conv+BN reduce=mean": run_tap("convbn_mean"),
        "layertap (d) layer2 stop_early": run_tap("layer2_stop"),
    }
    if args.only:
        methods = {name: fn for name, fn in methods.items() if name == PLAIN or any(text in name for text in args.only)}
    times: dict[str, list[float]] = {name: [] for name in methods}
    order, shuffle = list(methods), random.Random(0).shuffle
    for held_out in [True] + [False] * args.rounds:
        shuffle(order)
        for name in order:
            t0 = time.perf_counter()
            methods[name]()  # results are dropped at once: holding every method's would skew the allocator
            if not held_out:
                times[name].append(time.perf_counter() - t0)

    with torch.no_grad():  # trusted reference for correctness: clone in the hook
        ref, handles = hand_hooks(model, convbn, clone=True)
        model(x)
        for h in handles:
            h.remove()

    def setup(layers: object) -> float:
        """Entering and leaving a tap on ``layers``: the minimum of 30, in seconds."""
        best = float("inf")
        for _ in range(30):
            t0 = time.perf_counter()
            with layertap.tap(model, layers):
                pass
            best = min(best, time.perf_counter() - t0)
        return best

    setups = {"names": setup(convbn), "type spec": setup([nn.Conv2d, nn.BatchNorm2d])}
    if hasattr(select_module, "selection"):  # a Selection made once, as every capability hands tap() one
        setups["Selection"] = setup(select_module.selection(model, convbn))

    def wrong(name: str) -> str:
        if name.startswith("plain") or "stages" in name or "layer2" in name:
            return ""
        got = methods[name]()
        keys = [n for n in convbn if n in got]
        if "mean" in name:
            bad = sum(not torch.allclose(got[n], ref[n].mean((2, 3)), atol=1e-5) for n in keys)
        else:
            bad = sum(not torch.equal(got[n], ref[n]) for n in keys)
        return f"{bad}/{len(convbn)} wrong"

    base = min(times[PLAIN])
    print(f"resnet50, batch {args.batch}, {args.size}px, {args.rounds} rounds, torch {torch.__version__}, "
          f"{torch.get_num_threads()} threads")
    print(f"{'method':48s} {'min s':>8s} {'ratio':>7s}  correctness")
    for name in methods:
        print(f"{name:48s} {min(times[name]):8.3f} {min(times[name]) / base:6.2f}x  {wrong(name)}")
    if "FX truncated at layer2" in times and "layertap (d) layer2 stop_early" in times:
        fx2 = min(times["FX truncated at layer2"])
        print(f"layertap (d) / FX truncated at layer2: {min(times['layertap (d) layer2 stop_early']) / fx2:.2f}x")
    print(f"FX trace time: 4 stages {fx_trace_stages:.2f} s, layer2 {fx_trace_layer2:.2f} s, Conv+BN {fx_trace_convbn:.2f} s")
    side = [(label, name) for label, name in [("kept tap", KEPT_TAP), ("new tap per forward", NEW_TAP), ("hand clones", HAND_CLONE)] if name in times]
    if side:
        print("Conv+BN raw under inference_mode, / plain forward: "
              + ", ".join(f"{label} {min(times[name]) / base:.2f}x" for label, name in side))
    print(f"layertap setup+teardown for {len(convbn)} layers (min of 30): "
          + ", ".join(f"{how} {took * 1e3:.2f} ms" for how, took in setups.items()))
    allocators.save(args, {name: min(values) for name, values in times.items()})


if __name__ == "__main__":
    main()
