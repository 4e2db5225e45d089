"""What proving "the same data" costs a resumed extraction, next to the resume itself.

A resumed run first recomputes the digest of every sample in the chunks already written (for
image files: a read and a SHA-256 of each file, no decoding) and compares them with the digests
those chunks' markers recorded (`layertap.extract.digests`). Here: resnet50 (random weights), 256
generated JPEGs from an image folder, avgpool; a first run is stopped after half its chunks
(they are unmarked, as a kill would leave them), then resumed. Printed, for each round: the
resume's wall time, the check's own time (the same `Verifier.check_all` the resume runs) and
their ratio. Goal: the check under 10% of the resumed run.

    python benchmarks/bench_resume.py                  # 256 JPEGs at 112 px, 3 rounds
    python benchmarks/bench_resume.py --images 1024 --size 224
"""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torchvision

import layertap
from layertap.data import open_data
from layertap.extract.digests import Verifier
from layertap.shapes import generate, save_images
from layertap.store.writer import StoreWriter


def unmark_second_half(out: Path) -> None:
    writer = StoreWriter.open(out)
    writer.meta["complete"] = False
    writer.backend.write_meta(writer.meta)
    for c in range(writer.num_chunks // 2, writer.num_chunks):
        writer.backend.root["_chunks"][c] = ""
    writer.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--size", type=int, default=112)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    args = parser.parse_args()
    torch.manual_seed(0)
    model = torchvision.models.resnet50().eval()
    transform = torchvision.transforms.Compose(
        [torchvision.transforms.Resize((args.size, args.size)), torchvision.transforms.ToTensor()]
    )
    options = dict(batch_size=args.batch_size, chunk_size=args.batch_size, num_workers=1, transform=transform, progress=False)
    with tempfile.TemporaryDirectory() as scratch:
        folder = Path(scratch) / "images"
        save_images(generate(args.images, seed=0, size=args.size), folder, format="jpg")
        out = Path(scratch) / "feats.zarr"
        layertap.extract_dataset(model, folder, "avgpool", out, **options).close()
        ratios = []
        print(f"resnet50 avgpool, {args.images} JPEGs at {args.size} px, half the chunks to redo")
        print(f"{'round':>5} {'resume s':>9} {'check s':>8} {'check/resume':>13}")
        for r in range(args.rounds):
            unmark_second_half(out)
            writer = StoreWriter.open(out)
            recorded = {c: m.digests for c, m in writer.markers().items()}
            chunk = writer.chunk_size
            writer.close()
            source = open_data(folder, batch_size=args.batch_size, num_workers=1, transform=transform)
            started = time.perf_counter()
            Verifier(recorded, chunk, source, str(out)).check_all()
            check = time.perf_counter() - started
            started = time.perf_counter()
            layertap.extract_dataset(model, folder, "avgpool", out, **options).close()
            resume = time.perf_counter() - started
            ratios.append(check / resume)
            print(f"{r:>5} {resume:>9.2f} {check:>8.3f} {check / resume:>12.1%}")
        print(f"median check/resume: {statistics.median(ratios):.1%} (goal: under 10%)")


if __name__ == "__main__":
    main()
