"""Grad-CAM on resnet50 (CPU, random weights): layertap against pytorch-grad-cam and Captum.

Every method explains a batch (one class per image) at ``layer4``:

- ``plain forward``: ``model(x)`` under ``torch.inference_mode()``, the baseline;
- ``layertap GradCAM``: ``layertap.cam.GradCAM(model, "layer4")(x, targets)``;
- ``pytorch-grad-cam``: ``pytorch_grad_cam.GradCAM(model, [model.layer4])(x, targets)``;
- ``Captum LayerGradCam``: ``LayerGradCam(model, model.layer4).attribute(x, targets)``, then the
  same ReLU / min-max / bilinear upsampling as the others, so that the maps compare;
- ``hand-written``: forward with autograd on, the layer4 output caught by a hook,
  ``torch.autograd.grad(score, activation)``, channel weights by hand.

Time: the methods run interleaved in one process, round after round (the order rotating), and
the ratios of the minimum and median wall times to the plain forward's are reported, with the
ratio of minimum process CPU times, which other programs on a shared machine disturb less (with
one thread, ``--threads 1``, it is free of the threads' spin-waiting too).

Memory: the peak *extra* resident memory of one call, as a ratio to the plain forward's. Each
method runs in a fresh subprocess: build the model and the batch, run the method once (one-time
costs: thread pools, oneDNN kernels), reset the kernel's peak-RSS counter (``/proc/self/clear_refs``),
read the resident memory, run the method again and read the peak (``VmHWM``). glibc is told to
serve every allocation above 64 KiB by ``mmap`` (``MALLOC_MMAP_THRESHOLD_``), so freed tensors go
back to the kernel at once and the resident memory follows what is really alive. This counts
torch tensors and numpy arrays alike (pytorch-grad-cam computes its maps in numpy, which torch's
allocator statistics would miss); ``tracemalloc`` would see only the numpy half. Linux only.

Maps: the largest absolute difference from layertap's maps (all are in [0, 1]).

Run: python benchmarks/bench_cam.py [--rounds 15] [--batch 8] [--size 224] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable

import numpy as np
import torch
import torchvision

import layertap
from layertap.cam import normalize, upsample

METHODS = ["plain forward", "layertap GradCAM", "pytorch-grad-cam", "Captum LayerGradCam", "hand-written"]


def build(batch: int, size: int) -> tuple[torch.nn.Module, torch.Tensor, list[int]]:
    torch.manual_seed(0)
    model = torchvision.models.resnet50().eval()
    x = torch.randn(batch, 3, size, size)
    targets = [(37 * i + 11) % 1000 for i in range(batch)]
    return model, x, targets


def finish(raw: torch.Tensor, size: tuple[int, ...]) -> np.ndarray:
    """The ReLU / normalise / upsample / normalise steps every library applies (pytorch-grad-cam's)."""
    raw = raw.detach().float().clamp(min=0)
    return normalize(upsample(normalize(raw)[:, None], size)[:, 0]).numpy()


def methods(model: torch.nn.Module, x: torch.Tensor, targets: list[int]) -> dict[str, Callable[[], object]]:
    """Each method as a function of nothing; ``None`` where its library is not installed."""
    size = tuple(x.shape[2:])
    index = torch.arange(len(targets))

    def plain() -> None:
        with torch.inference_mode():
            model(x)

    ours = layertap.cam.GradCAM(model, "layer4")

    def hand_written() -> np.ndarray:
        caught = {}
        handle = model.layer4.register_forward_hook(lambda m, i, o: caught.update(a=o))
        try:
            score = model(x)[index, targets].sum()
        finally:
            handle.remove()
        (g,) = torch.autograd.grad(score, caught["a"])
        return finish((g.mean((2, 3), keepdim=True) * caught["a"]).sum(1), size)

    table: dict[str, Callable[[], object] | None] = {
        "plain forward": plain,
        "layertap GradCAM": lambda: ours(x, targets).numpy(),
        "pytorch-grad-cam": None,
        "Captum LayerGradCam": None,
        "hand-written": hand_written,
    }
    try:
        import pytorch_grad_cam
        from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

        wanted = [ClassifierOutputTarget(t) for t in targets]

        def reference() -> np.ndarray:
            with pytorch_grad_cam.GradCAM(model, [model.layer4]) as cam:
                return cam(x, wanted)

        table["pytorch-grad-cam"] = reference
    except ImportError:
        pass
    try:
        from captum.attr import LayerGradCam

        captum = LayerGradCam(model, model.layer4)
        table["Captum LayerGradCam"] = lambda: finish(captum.attribute(x, target=targets)[:, 0], size)
    except ImportError:
        pass
    return table


def peak_memory(name: str, batch: int, size: int, threads: int) -> float | None:
    """Extra peak resident memory (MiB) of one call of ``name``, measured in a fresh subprocess."""
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="65536", MALLOC_TRIM_THRESHOLD_="0")
    args = [sys.executable, __file__, "--measure", name, "--batch", str(batch), "--size", str(size), "--threads", str(threads)]
    done = subprocess.run(args, env=env, capture_output=True, text=True, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"memory measurement of {name!r} failed:\n{done.stderr}")
    return json.loads(done.stdout.strip().splitlines()[-1])["extra_mib"]


def _status(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])  # kB
    raise RuntimeError(f"no {field} in /proc/self/status")


def measure(name: str, batch: int, size: int) -> None:
    """Subprocess side of `peak_memory`: prints ``{"extra_mib": ...}`` (``null`` if not installed)."""
    model, x, targets = build(batch, size)
    fn = methods(model, x, targets)[name]
    if fn is None:
        print(json.dumps({"extra_mib": None}))
        return
    fn()
    best = None
    for _ in range(2):
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets VmHWM to the current resident size
        before = _status("VmRSS")
        fn()
        extra = (_status("VmHWM") - before) / 1024
        best = extra if best is None else min(best, extra)
    print(json.dumps({"extra_mib": best}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--no-memory", action="store_true", help="skip the memory measurement")
    parser.add_argument("--measure", help=argparse.SUPPRESS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    if args.measure:
        measure(args.measure, args.batch, args.size)
        return

    model, x, targets = build(args.batch, args.size)
    table = methods(model, x, targets)
    for name, fn in table.items():
        if fn is None:
            print(f"note: {name} is not installed; its row is left empty (pip install "
                  f"{'grad-cam' if 'grad' in name else 'captum'})")
    active = {name: fn for name, fn in table.items() if fn is not None}
    maps = {name: fn() for name, fn in active.items()}  # warm-up, and the maps to compare
    times: dict[str, list[float]] = {name: [] for name in active}
    cpu: dict[str, list[float]] = {name: [] for name in active}
    names = list(active)
    for r in range(args.rounds):
        # the order rotates each round, so that no method always runs after the same one
        for name in names[r % len(names) :] + names[: r % len(names)]:
            start, start_cpu = time.perf_counter(), time.process_time()
            active[name]()
            times[name].append(time.perf_counter() - start)
            cpu[name].append(time.process_time() - start_cpu)
    memory = {name: None if args.no_memory else peak_memory(name, args.batch, args.size, args.threads) for name in active}

    base_time = min(times["plain forward"])
    base_memory = memory["plain forward"]
    print(f"resnet50 (random weights, eval), layer4, batch {args.batch}x3x{args.size}x{args.size}, "
          f"{args.rounds} rounds, {args.threads} threads, torch {torch.__version__}")
    base_median = sorted(times["plain forward"])[len(times["plain forward"]) // 2]
    base_cpu = min(cpu["plain forward"])
    print(f"{'method':22} {'min s':>7} {'median s':>9} {'min ratio':>10} {'med ratio':>10} {'cpu ratio':>10} "
          f"{'extra MiB':>10} {'mem ratio':>10} {'max |map diff|':>15}")
    for name in METHODS:
        if name not in active:
            print(f"{name:22} {'(not installed)':>7}")
            continue
        ts = sorted(times[name])
        mib = memory[name]
        diff = "" if name == "plain forward" else f"{np.abs(maps[name] - maps['layertap GradCAM']).max():.2e}"
        mem = "" if mib is None else f"{mib:10.1f} {mib / base_memory:10.2f}" if base_memory else f"{mib:10.1f} {'':>10}"
        median = ts[len(ts) // 2]
        print(f"{name:22} {ts[0]:7.3f} {median:9.3f} {ts[0] / base_time:10.2f} {median / base_median:10.2f} "
              f"{min(cpu[name]) / base_cpu:10.2f} {mem:>21} {diff:>15}")


if __name__ == "__main__":
    main()
