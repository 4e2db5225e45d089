"""Dataset extraction throughput and memory: layertap vs the model alone, thingsvision, TorchLens.

On the same generated JPEGs and the same DataLoader, one full pass each, interleaved round by
round; the table reports the best (minimum) time of each and its throughput relative to the
plain loop, which only runs the whole model and keeps nothing (the limit for a late layer),
and the median over rounds of each round's ratio.
Then layertap's peak memory (of a fresh process) for 1x and 10x the samples.

The C allocator is set for the whole process and for good (`layertap.allocator`), so all this
runs in a child process per setting: ``--allocator default`` (glibc as it comes), ``tuned``
(`layertap.tune_allocator` first, as ``layertap extract`` does; the memory runs too), or
``both``, the default: the two children one after the other, each compared with its own plain
loop, then the tuned/default ratio of each method's minimum time.

    python benchmarks/bench_extract.py                      # resnet50, 256 JPEGs, 3 rounds, both allocators
    python benchmarks/bench_extract.py --rounds 15 --size 224
    python benchmarks/bench_extract.py --allocator tuned --skip-memory

thingsvision and TorchLens are optional (``pip install thingsvision torchlens``); a missing or
unusable one is reported in the output. thingsvision imports TensorFlow at import time though
its PyTorch extractor never uses it; where TensorFlow cannot be installed (it pins old torch
and NumPy), the TensorFlow modules are stubbed out so its PyTorch extractor can run.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.machinery
import resource
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

import allocators
import numpy as np
import torch
import torchvision
from torchvision import transforms as T

import layertap
from layertap.allocator import tune_allocator
from layertap.shapes import generate, save_images

LATE, EARLY = "avgpool", "layer1"
IMAGENET = dict(mean=(0.485, 0.456, 0.406), std=(0.229, 0.224, 0.225))


def make_loader(folder: Path, size: int, batch_size: int, workers: int, repeat: int = 1):
    dataset = torchvision.datasets.ImageFolder(str(folder), T.Compose([T.Resize((size, size)), T.ToTensor(), T.Normalize(**IMAGENET)]))
    if repeat > 1:  # the same files read `repeat` times: more samples, no more disk
        dataset = torch.utils.data.Subset(dataset, [i % len(dataset) for i in range(repeat * len(dataset))])
    return torch.utils.data.DataLoader(dataset, batch_size=batch_size, num_workers=workers)


def build_model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torchvision.models.resnet50().eval()


# ------------------------------------------------------------------------------ the methods
def plain(model, loader, layer, scratch):
    with torch.no_grad():
        for images, _ in loader:
            model(images)


def layertap_extract(model, loader, layer, scratch):
    layertap.extract_dataset(model, loader, layer, scratch / "lt.zarr", overwrite=True, progress=False)


class ImagesOnly:
    """thingsvision wants batches of images with a length."""

    def __init__(self, loader):
        self.loader = loader

    def __len__(self):
        return len(self.loader)

    def __iter__(self):
        return (images for images, _ in self.loader)


class _StubTensorFlow(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path, target=None):
        if name.split(".")[0] in ("tensorflow", "keras"):
            return importlib.machinery.ModuleSpec(name, self, is_package=True)
        return None

    def create_module(self, spec):
        module = mock.MagicMock(name=spec.name)
        module.__path__, module.__spec__ = [], spec
        return module

    def exec_module(self, module):
        pass


def import_thingsvision():
    """thingsvision's get_extractor_from_model, and a note on how it was imported."""
    try:
        from thingsvision import get_extractor_from_model

        return get_extractor_from_model, ""
    except ModuleNotFoundError as e:
        if e.name is None or e.name.split(".")[0] not in ("tensorflow", "keras"):
            raise
    sys.meta_path.insert(0, _StubTensorFlow())
    np.AxisError = np.exceptions.AxisError  # thingsvision 2.7 still reads it from NumPy 1
    for name in [m for m in sys.modules if m.startswith("thingsvision")]:
        del sys.modules[name]
    from thingsvision import get_extractor_from_model

    return get_extractor_from_model, "TensorFlow stubbed out (not installable next to this torch/NumPy); its PyTorch path ran"


def thingsvision_extract(get_extractor_from_model):
    def run(model, loader, layer, scratch):
        extractor = get_extractor_from_model(model=model, device="cpu", backend="pt")
        out = scratch / "tv"
        shutil.rmtree(out, ignore_errors=True)
        extractor.extract_features(batches=ImagesOnly(loader), module_name=layer, flatten_acts=False, output_type="ndarray", output_dir=str(out))

    return run


def torchlens_extract(torchlens):
    def run(model, loader, layer, scratch):
        out = scratch / "tl"
        shutil.rmtree(out, ignore_errors=True)
        # TorchLens batches stimuli itself: give it the same decoded images, one by one
        single = torch.utils.data.DataLoader(loader.dataset, batch_size=None, num_workers=loader.num_workers)
        images = (image for image, _ in single)
        torchlens.extract_dataset(model, images, [layer], batch_size=loader.batch_size, output_dir=out, progress=False)

    return run


def competitors() -> tuple[dict, list[str]]:
    methods, notes = {}, []
    try:
        get_extractor, note = import_thingsvision()
        methods["thingsvision"] = thingsvision_extract(get_extractor)
        if note:
            notes.append(f"thingsvision: {note}")
    except Exception as e:
        notes.append(f"thingsvision: not run ({type(e).__name__}: {e}); pip install thingsvision")
    try:
        import torchlens

        methods["TorchLens"] = torchlens_extract(torchlens)
    except Exception as e:
        notes.append(f"TorchLens: not run ({type(e).__name__}: {e}); pip install torchlens")
    return methods, notes


# ----------------------------------------------------------------------------------- memory
def memory_child(folder: str, size: int, batch_size: int, workers: int, repeat: int, out: str, layer: str, allocator: str) -> None:
    if allocator == "tuned":
        tune_allocator()
    loader = make_loader(Path(folder), size, batch_size, workers, repeat)
    model = build_model()
    if layer == "plain":
        plain(model, loader, layer, Path(out))
    else:
        layertap.extract_dataset(model, loader, layer, out, overwrite=True, progress=False)
    print(peak_rss_kb())


def peak_rss_kb() -> int:
    """This process's peak resident memory: VmHWM on Linux (ru_maxrss would also count the
    parent's peak, which Linux keeps across fork and exec)."""
    status = Path("/proc/self/status")
    if status.exists():
        return int(next(line.split()[1] for line in status.read_text().splitlines() if line.startswith("VmHWM")))
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss // (1 if sys.platform != "darwin" else 1024)


def peak_memory_mb(args, folder: Path, scratch: Path, repeat: int, layer: str) -> float:
    command = [sys.executable, __file__, "--memory-child", str(folder), str(args.size), str(args.batch_size), str(args.workers), str(repeat), str(scratch / f"mem{repeat}.zarr"), layer, args.allocator]
    done = subprocess.run(command, capture_output=True, text=True, check=True)
    shutil.rmtree(scratch / f"mem{repeat}.zarr", ignore_errors=True)
    return int(done.stdout.split()[-1]) / 1024


# ------------------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=256, help="JPEGs")
    parser.add_argument("--size", type=int, default=112, help="input side in pixels")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--skip-memory", action="store_true")
    parser.add_argument("--memory-only", action="store_true")
    allocators.add_option(parser)
    args = parser.parse_args()
    if not allocators.start(args):
        return

    scratch = Path(tempfile.mkdtemp(prefix="bench_extract_"))
    try:
        folder = scratch / "images"
        save_images(generate(args.n, seed=0, size=args.size), folder, format="jpg")
        if not args.memory_only:
            mins = throughput(args, folder, scratch)
            allocators.save(args, mins)
        if not args.skip_memory:
            print("\npeak memory, fresh process each (VmHWM):")
            print(f"  plain loop, {args.n} samples: {peak_memory_mb(args, folder, scratch, 1, 'plain'):8.1f} MB")
            small, large = (peak_memory_mb(args, folder, scratch, repeat, EARLY) for repeat in (1, 10))
            print(f"  layertap {EARLY} (unreduced), {args.n:>5} samples: {small:8.1f} MB")
            print(f"  layertap {EARLY} (unreduced), {10 * args.n:>5} samples: {large:8.1f} MB  ({large / small:.3f}x)")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def throughput(args, folder: Path, scratch: Path) -> dict[str, float]:
    loader = make_loader(folder, args.size, args.batch_size, args.workers)
    model = build_model()
    others, notes = competitors()
    runs = [("plain loop (whole model)", plain, LATE)]
    for layer in (LATE, EARLY):
        runs.append((f"layertap {layer}", layertap_extract, layer))
        runs += [(f"{name} {layer}", method, layer) for name, method in others.items()]
    times = {name: [] for name, _, _ in runs}
    for r in range(args.rounds):
        for name, method, layer in runs if r % 2 == 0 else runs[::-1]:  # interleaved, order alternating
            start = time.perf_counter()
            method(model, loader, layer, scratch)
            times[name].append(time.perf_counter() - start)
        print(f"round {r + 1}/{args.rounds}: " + ", ".join(f"{k} {v[-1]:.1f}s" for k, v in times.items()), flush=True)

    base = times["plain loop (whole model)"]
    print(f"\nresnet50 (random weights), {args.n} JPEGs at {args.size}px, batch {args.batch_size}, "
          f"{args.workers} loader worker(s), {torch.get_num_threads()} torch threads, {args.rounds} rounds")
    print(f"{'method':<28}{'min s':>8}{'samples/s':>11}{'vs plain (min)':>16}{'(median of rounds)':>20}")
    for name, values in times.items():
        best = min(values)
        paired = statistics.median(b / v for b, v in zip(base, values))  # each round against its own plain loop
        print(f"{name:<28}{best:>8.2f}{args.n / best:>11.1f}{min(base) / best:>15.2f}x{paired:>19.2f}x")
    for layer in (LATE, EARLY):
        if f"TorchLens {layer}" in times:
            ratio = min(times[f"TorchLens {layer}"]) / min(times[f"layertap {layer}"])
            print(f"layertap vs TorchLens, {layer}: {ratio:.2f}x")
    for note in notes:
        print(note)
    return {name: min(values) for name, values in times.items()}


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--memory-child":
        folder, size, batch, workers, repeat, out, layer, allocator = sys.argv[2:10]
        memory_child(folder, int(size), int(batch), int(workers), int(repeat), out, layer, allocator)
    else:
        main()
