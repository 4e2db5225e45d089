"""Op taps and attention maps against a plain forward, hand-written hooks and TorchLens, on CPU.

resnet50 (random weights, eval, batch 8, 224 px, no_grad): the 16 residual ``out += identity``
ops tapped inside the Bottleneck forwards (``"layer*.*:add_"``), the 16 blocks tapped as modules,
the hand-written hooks that do each job, and TorchLens, which logs every torch call of the
forward: saving the 16 ``iadd`` outputs ("record"), saving no activation ("trace" only: the graph
and metadata), and its lighter fastlog ``record`` with a predicate. TorchLens 2 spells the old
``log_forward_pass(model, x, layers_to_save=...)`` as ``trace(model, x,
capture=CaptureOptions(layers_to_save=...))``; its ``save=None`` saves *every* layer. vit_b_16 (random weights, batch 8, 224 px, no_grad): the head-mean attention map of
every encoder block, recomputed beside the fused attention.

Methods run interleaved in one process, round after round; the time of each is its minimum over
the rounds and the ratio is to the plain forward of the same model in the same run (this noisy
2-core machine needs minima); "median" is the median over rounds of each round's ratio to its own
plain forward. TorchLens takes seconds per forward, so it runs in the first
``--tl-rounds`` rounds only; its torch wrappers are installed just before each of its calls and
removed just after, outside the timing, so the other methods run on an unwrapped torch.
Correctness counts, per method, captured values that differ from an independent reference: the
input of each block's final ReLU (the ``add_`` output before ``relu_`` overwrites it), cloned in a
pre-hook, and ``nn.MultiheadAttention(need_weights=True)``'s own head-mean weights.

Run: python benchmarks/bench_ops.py [--rounds 9] [--tl-rounds 3] [--threads 2]
(``BENCH_ROUNDS=2`` or ``--rounds 2`` for a quick run; TorchLens is optional:
``pip install torchlens``.)
"""

from __future__ import annotations

import argparse
import contextlib
import os
import platform
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torchvision
from torch import nn

import layertap

BLOCKS = "layer*.*"
ADDS = "layer*.*:add_"
ATTENTION = "**.self_attention"


def cpu_name() -> str:
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def hand_hooks(model: nn.Module, names: list[str]) -> tuple[dict, list]:
    """The tutorial hook: clone each block's output in a forward hook."""
    store: dict[str, torch.Tensor] = {}
    handles = []
    for name in names:
        def hook(m, args, out, name=name):
            store[name] = out.detach().clone()

        handles.append(model.get_submodule(name).register_forward_hook(hook))
    return store, handles


def hand_add_hooks(model: nn.Module, names: list[str]) -> tuple[dict, list]:
    """The hand-written way to the residual sum: a Bottleneck calls its ``relu`` three times and
    the third call's input is ``out += identity``; clone it there, before ``relu_`` overwrites it."""
    store: dict[str, torch.Tensor] = {}
    handles = []
    for name in names:
        calls = [0]

        def pre(m, args, name=name, calls=calls):
            calls[0] += 1
            if calls[0] % 3 == 0:
                store[name] = args[0].detach().clone()

        relu = model.get_submodule(f"{name}.relu")
        handles.append(relu.register_forward_pre_hook(pre))
    return store, handles


@contextlib.contextmanager
def recomputed_attention(model: nn.Module) -> Iterator[dict[str, torch.Tensor]]:
    """Fallback while ``layertap.attention.attention`` is missing: the inputs of every
    ``self_attention`` handed to ``observe=`` and the head-mean weights recomputed from the query
    and key projections (``layertap.attention.mha_weights``); nothing else is kept."""
    from layertap.attention import mha_weights

    maps: dict[str, torch.Tensor] = {}

    def observe(name: str, kind: str, call: int, value: Any) -> None:
        args = value.args if isinstance(value, layertap.Inputs) else (value,)
        module = model.get_submodule(name)
        assert isinstance(module, nn.MultiheadAttention)
        maps[name] = mha_weights(module, args[0], args[1]).mean(1, keepdim=True)

    with layertap.tap(model, ATTENTION, capture="input", observe=observe):
        yield maps


def attention_capture(model: nn.Module) -> tuple[str, Callable[[], Any]]:
    """A fresh head-mean attention context for ``model``, and how it is made."""
    try:
        from layertap.attention import attention
    except ImportError:
        return "tap(observe=) + mha_weights, fallback", lambda: recomputed_attention(model)
    return "layertap.attention", lambda: attention(model, heads="mean")


def load_torchlens() -> tuple[Any, str]:
    try:
        import torchlens
        from torchlens.backends.torch.wrappers import unwrap_torch, wrap_torch
        from torchlens.options import CaptureOptions
    except Exception as e:  # not installed, or broken against this torch
        return None, f"torchlens not installed ({type(e).__name__}: {e}); pip install torchlens"
    return (torchlens, wrap_torch, unwrap_torch, CaptureOptions), f"torchlens {torchlens.__version__}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=int(os.environ.get("BENCH_ROUNDS", 9)))
    parser.add_argument("--tl-rounds", type=int, default=int(os.environ.get("BENCH_TL_ROUNDS", 3)))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    warnings.filterwarnings("ignore", module="torchlens")
    started = time.perf_counter()

    torch.manual_seed(0)
    resnet = torchvision.models.resnet50().eval()
    vit = torchvision.models.vit_b_16().eval()
    x = torch.randn(args.batch, 3, args.size, args.size)
    blocks = layertap.select(resnet, BLOCKS)
    adds = layertap.select(resnet, ADDS)
    assert len(blocks) == 16 and len(adds) == 16, (blocks, adds)

    # taps kept open across batches, as in an extraction loop (see bench_tap.py)
    op_tap = layertap.tap(resnet, ADDS)
    module_tap = layertap.tap(resnet, BLOCKS)
    att_how, att_context = attention_capture(vit)

    def run_tap(t: layertap.Tap) -> Callable[[], Any]:
        def run() -> Any:
            with t:
                resnet(x)
            return t

        return run

    def run_hooks(install: Callable[[nn.Module, list[str]], tuple[dict, list]]) -> Callable[[], dict]:
        def run() -> dict:
            store, handles = install(resnet, blocks)
            resnet(x)
            for h in handles:
                h.remove()
            return store

        return run

    def run_attention() -> dict:
        with att_context() as maps:
            vit(x)
        return dict(maps)

    methods: dict[str, Callable[[], Any]] = {
        "resnet50 plain forward": lambda: resnet(x),
        "layertap op taps, 16 add_ (layer*.*:add_)": run_tap(op_tap),
        "hand hooks, 16 add_ (relu pre-hook, clone)": run_hooks(hand_add_hooks),
        "layertap module taps, 16 blocks (layer*.*)": run_tap(module_tap),
        "hand hooks, 16 blocks (forward hook, clone)": run_hooks(hand_hooks),
    }
    tl, tl_note = load_torchlens()
    tl_methods: list[str] = []
    if tl is not None:
        torchlens, wrap_torch, unwrap_torch, CaptureOptions = tl
        with torch.no_grad():  # the labels TorchLens gives the 16 add_ ops (an untimed warm-up)
            wrap_torch()
            labels = torchlens.trace(resnet, x, capture=CaptureOptions(layers_to_save=None)).layer_labels
            unwrap_torch()
        iadds = [label.rsplit("_", 1)[0] for label in labels if label.startswith("iadd_")]
        assert len(iadds) == 16, iadds

        tl_runs: dict[str, Callable[[], Any]] = {
            "TorchLens trace, layers_to_save=16 iadd": lambda: torchlens.trace(
                resnet, x, capture=CaptureOptions(layers_to_save=iadds)
            ),
            "TorchLens trace, layers_to_save=None": lambda: torchlens.trace(
                resnet, x, capture=CaptureOptions(layers_to_save=None)
            ),
            "TorchLens fastlog record, func('__iadd__')": lambda: torchlens.record(
                resnet, x, save=torchlens.func("__iadd__")
            ),
        }
        methods.update(tl_runs)
        tl_methods = list(tl_runs)
    methods["vit_b_16 plain forward"] = lambda: vit(x)
    methods[f"vit_b_16 attention, 12 blocks, head mean ({att_how})"] = run_attention

    phases = [time.perf_counter()]
    with torch.no_grad():  # independent references for the correctness column
        ref_adds, handles = hand_add_hooks(resnet, blocks)
        resnet(x)
        for h in handles:
            h.remove()
        ref_blocks, handles = hand_hooks(resnet, blocks)
        resnet(x)
        for h in handles:
            h.remove()
        queries: dict[str, torch.Tensor] = {}
        attns = layertap.select(vit, ATTENTION)
        handles = [
            vit.get_submodule(n).register_forward_pre_hook(lambda m, a, n=n: queries.__setitem__(n, a[0]))
            for n in attns
        ]
        vit(x)
        for h in handles:
            h.remove()
        ref_att = {n: vit.get_submodule(n)(q, q, q, need_weights=True)[1] for n, q in queries.items()}

    maps: dict[str, torch.Tensor] = {}

    def wrong(name: str, got: Any) -> str:
        """Captured values that differ from the reference, read from a method's last timed round."""
        if "plain" in name:
            return ""
        if name in tl_methods:
            if "fastlog" in name:
                values = [r.ram_payload for r in got.records]
            elif "None" in name:
                return "saves nothing"
            else:
                values = [got[label].out for label in iadds]
            bad = sum(not torch.equal(v, ref_adds[b]) for v, b in zip(values, blocks))
            return f"{bad + 16 - len(values)}/16 wrong"
        if "attention" in name:
            maps.update(got)
            bad = sum(not torch.allclose(got[n][:, 0], ref_att[n], atol=1e-5) for n in attns)
            return f"{bad}/{len(attns)} wrong"
        if "add_" in name:
            keys = adds if "layertap" in name else blocks
            bad = sum(not torch.equal(got[k], ref_adds[b]) for k, b in zip(keys, blocks))
        else:
            bad = sum(not torch.equal(got[b], ref_blocks[b]) for b in blocks)
        return f"{bad}/16 wrong"

    times: dict[str, list[float]] = {name: [] for name in methods}
    checks: dict[str, str] = {}
    phases.append(time.perf_counter())
    with torch.no_grad():
        for round_ in range(args.rounds):
            for name, fn in methods.items():
                last = args.rounds - 1
                if name in tl_methods:
                    last = min(args.tl_rounds, args.rounds) - 1
                    if round_ > last:
                        continue
                    wrap_torch()
                t0 = time.perf_counter()
                got = fn()
                times[name].append(time.perf_counter() - t0)
                if name in tl_methods:
                    unwrap_torch()
                if round_ == last:  # checked after the clock stopped
                    checks[name] = wrong(name, got)
                del got  # results are dropped at once: holding every method's would skew the allocator
    phases.append(time.perf_counter())

    print(f"CPU: {cpu_name()}, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"torchvision {torchvision.__version__}, {tl_note}")
    tl_rounds = f" (TorchLens: {min(args.rounds, args.tl_rounds)})" if tl_methods else ""
    print(f"batch {args.batch}, {args.size} px, no_grad, random weights; min of {args.rounds} interleaved rounds{tl_rounds}")
    print(f"{'work':62s} {'ms':>9s} {'ratio':>7s} {'median':>7s}  correctness")
    base: list[float] = []
    for name in methods:
        if "plain" in name:
            base = times[name]
        best = min(times[name])
        paired = statistics.median(v / b for b, v in zip(base, times[name]))  # each round against its own plain forward
        print(f"{name:62s} {best * 1e3:9.1f} {best / min(base):6.2f}x {paired:6.2f}x  {checks[name]}")
    if tl is None:
        print(tl_note)
    some = next(iter(maps.values()))
    per_map = some[0].numel() * some.element_size()
    print(f"attention map per sample per block: {list(some.shape[1:])} {some.dtype} = {per_map:,} bytes; "
          f"{len(maps)} blocks = {per_map * len(maps):,} bytes per sample, "
          f"{per_map * len(maps) * args.batch:,} per batch of {args.batch}")
    print(f"run: setup {phases[0] - started:.0f} s, references {phases[1] - phases[0]:.0f} s, "
          f"timing {phases[2] - phases[1]:.0f} s")


if __name__ == "__main__":
    main()
