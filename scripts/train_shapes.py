#!/usr/bin/env python
"""Train the bundled shapes CNN and write ``src/layertap/shapes/shapes_cnn.pt``.

Deterministic (fixed seeds, deterministic torch algorithms, 2 CPU threads) and
CPU-only; takes a few minutes on 2 cores. Every epoch trains on freshly
generated images (seeds 1000 + epoch), and the model is evaluated on
``generate(2000, seed=12345)``, which no training seed produces.

Usage:
    python scripts/train_shapes.py [--epochs 8] [--per-epoch 4000] [--out PATH]
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

try:
    from layertap.shapes import WEIGHTS_PATH, ShapesCNN, generate, preprocess
except ImportError:  # running from a checkout without installing the package
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from layertap.shapes import WEIGHTS_PATH, ShapesCNN, generate, preprocess

TRAIN_SEED_BASE = 1000
TEST_SEED = 12345


def evaluate(model: ShapesCNN, n: int = 2000, seed: int = TEST_SEED) -> tuple[float, float]:
    """Return (accuracy, Grad-CAM pointing-game score) on ``generate(n, seed)``."""
    batch = generate(n, seed=seed)
    model.eval()
    correct = hits = 0
    for start in range(0, n, 250):
        x = preprocess(batch.images[start : start + 250])
        feats = model.features(x)  # last conv block output [B, C, 8, 8]
        logits = model.classifier(model.flatten(model.pool(feats)))
        pred = logits.argmax(1)
        correct += int((pred == torch.from_numpy(batch.labels[start : start + 250])).sum())
        grads = torch.autograd.grad(logits.gather(1, pred[:, None]).sum(), feats)[0]
        cam = F.relu((grads.mean(dim=(2, 3), keepdim=True) * feats).sum(1, keepdim=True))
        cam = F.interpolate(cam, size=x.shape[-2:], mode="bilinear", align_corners=False)[:, 0]
        flat = cam.flatten(1).argmax(1)
        ys, xs = flat // x.shape[-1], flat % x.shape[-1]
        box = torch.from_numpy(batch.boxes[start : start + 250])
        inside = (xs >= box[:, 0]) & (xs < box[:, 2]) & (ys >= box[:, 1]) & (ys < box[:, 3])
        hits += int(inside.sum())
    return correct / n, hits / n


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--epochs", type=int, default=8)
    parser.add_argument("--per-epoch", type=int, default=4000, help="fresh images generated per epoch")
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--out", type=Path, default=WEIGHTS_PATH)
    args = parser.parse_args()

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    shuffle = torch.Generator().manual_seed(0)

    model = ShapesCNN()
    n_params = sum(p.numel() for p in model.parameters())
    steps_per_epoch = -(-args.per_epoch // args.batch_size)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=5e-4)
    sched = torch.optim.lr_scheduler.OneCycleLR(
        opt, max_lr=args.lr, total_steps=args.epochs * steps_per_epoch, pct_start=0.2
    )
    print(f"ShapesCNN: {n_params} parameters; {args.epochs} epochs x {args.per_epoch} fresh images")

    t0, cpu0 = time.perf_counter(), time.process_time()
    for epoch in range(args.epochs):
        batch = generate(args.per_epoch, seed=TRAIN_SEED_BASE + epoch)
        x_all = preprocess(batch.images)
        y_all = torch.from_numpy(batch.labels)
        model.train()
        total_loss = total_correct = 0.0
        for idx in torch.randperm(len(y_all), generator=shuffle).split(args.batch_size):
            x, y = x_all[idx], y_all[idx]
            logits = model(x)
            loss = F.cross_entropy(logits, y, label_smoothing=0.05)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            total_loss += float(loss.detach()) * len(y)
            total_correct += float((logits.argmax(1) == y).sum())
        print(
            f"epoch {epoch + 1}/{args.epochs}: loss {total_loss / len(y_all):.4f} "
            f"train acc {total_correct / len(y_all):.4f} ({time.perf_counter() - t0:.0f}s)",
            flush=True,
        )
    train_time, cpu_time = time.perf_counter() - t0, time.process_time() - cpu0

    model.eval()
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(state, args.out)
    acc, pointing = evaluate(model)
    print(f"train time: {train_time:.1f}s wall, {cpu_time:.1f}s CPU ({torch.get_num_threads()} threads)")
    print(f"test accuracy (generate(2000, seed={TEST_SEED})): {acc:.4f}")
    print(f"Grad-CAM pointing game (features.block4, predicted class): {pointing:.4f}")
    print(f"saved {args.out} ({args.out.stat().st_size / 1024:.0f} KiB)")


if __name__ == "__main__":
    main()
