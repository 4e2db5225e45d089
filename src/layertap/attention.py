"""Attention probabilities ``[batch, heads, queries, keys]`` from models that never compute them.

>>> import torch, torchvision, layertap.attention
>>> model = torchvision.models.vit_b_16(image_size=32).eval()
>>> with torch.no_grad(), layertap.attention.attention(model) as att:
...     logits = model(torch.randn(2, 3, 32, 32))
>>> att["encoder.layers.encoder_layer_0.self_attention"].shape   # heads averaged, 1 + 2x2 tokens
torch.Size([2, 1, 5, 5])

The problem, the rule and the cost:

- Fused attention (``F.scaled_dot_product_attention``, ``nn.MultiheadAttention``'s fast path,
  Hugging Face's ``"sdpa"`` implementation) never materialises the probabilities, and asking
  for them (``output_attentions=True``, ``need_weights=True``) changes the code path that runs.
- So the model runs as it is, fused, and the probabilities are *recomputed* beside it from what
  the attention was given: the query, key, mask, causality, scale and grouped heads of each
  ``scaled_dot_product_attention`` call (`sdpa_weights`, PyTorch's documented reference
  formula), or the inputs of an ``nn.MultiheadAttention`` through its query and key projections
  only (`mha_weights`, the module's own ``need_weights=True`` formula). An eager ``softmax``
  in an attention module's forward already is the probability: it is taken as it is.
- Values, outputs and gradients of the model are untouched: the recomputation runs on detached
  copies, without autograd, in float32 (or float64 for float64 inputs).
- Cost: one ``q @ k.T`` and softmax per attention call, and the ``[B, H, Q, K]`` float32 tensor
  the fused kernel avoided. ``rows="cls"`` or ``"last"`` computes one query row (``Q = 1``) and
  ``heads="mean"``/``"max"`` keeps one head, so what is kept stays small.
- Rows a mask hides completely (every key masked) are all zero, as PyTorch's kernels return them
  (its reference formula would give NaN).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ArgumentError

Heads = Literal["all", "mean", "max"]
Rows = Literal["all", "cls", "last"]
HEADS: tuple[str, ...] = ("all", "mean", "max")
ROWS: tuple[str, ...] = ("all", "cls", "last")
_ROWS = {"all": slice(None), "cls": slice(0, 1), "last": slice(-1, None)}


# ---------------------------------------------------------------------------------- arguments
def _check(heads: str, rows: str) -> None:
    if heads not in HEADS:
        raise ArgumentError(f"heads={heads!r} is not one of {HEADS}: 'all' keeps every head, 'mean'/'max' fuse them")
    if rows not in ROWS:
        raise ArgumentError(
            f"rows={rows!r} is not one of {ROWS}: 'all' keeps every query, 'cls' query 0, 'last' the last query"
        )


def _dtype(t: torch.Tensor) -> torch.dtype:
    """float32 at least: half and bfloat16 probabilities would round visibly."""
    return torch.promote_types(t.dtype, torch.float32) if t.is_floating_point() else torch.float32


def _softmax(scores: torch.Tensor) -> torch.Tensor:
    """Softmax over keys; a row whose keys are all masked (-inf) is zero, as PyTorch's kernels give."""
    hidden = scores.amax(-1, keepdim=True) == -math.inf
    return torch.softmax(scores, -1).masked_fill(hidden, 0.0)


def _mask_rows(mask: torch.Tensor, rows: slice) -> torch.Tensor:
    """A mask's query rows (a mask broadcast over queries stays as it is)."""
    return mask[..., rows, :] if mask.dim() >= 2 and mask.size(-2) != 1 else mask


def reduce_weights(weights: torch.Tensor, heads: Heads = "all", rows: Rows = "all") -> torch.Tensor:
    """Keep ``rows`` (query 0, the last query, or all) and fuse ``heads`` of ``[B, H, Q, K]`` weights.

    The result stays 4-D: ``[B, 1 or H, 1 or Q, K]``.

    >>> w = torch.softmax(torch.randn(2, 4, 5, 5), -1)
    >>> reduce_weights(w, heads="mean", rows="cls").shape
    torch.Size([2, 1, 1, 5])
    """
    _check(heads, rows)
    if rows != "all":
        weights = weights[..., _ROWS[rows], :]
    if heads == "mean":
        return weights.mean(1, keepdim=True)
    if heads == "max":
        return weights.amax(1, keepdim=True)
    return weights


# ---------------------------------------------------------------------------------- the formulas
def _sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    rows: slice,
) -> torch.Tensor:
    dtype = _dtype(query)
    length, keys = query.size(-2), key.size(-2)
    if is_causal and attn_mask is not None:
        raise ArgumentError("is_causal=True and an attn_mask cannot both be given (as in F.scaled_dot_product_attention)")
    if attn_mask is not None and hasattr(attn_mask, "_materialize"):  # torch.nn.attention.bias.CausalBias
        attn_mask = attn_mask._materialize(query.device)
    q = query[..., rows, :].to(dtype)
    k = key.to(dtype)
    if enable_gqa:
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
    factor = 1 / math.sqrt(query.size(-1)) if scale is None else scale
    scores = q @ k.transpose(-2, -1) * factor
    if is_causal:  # top-left aligned, as PyTorch's is_causal
        positions = torch.arange(length, device=q.device)[rows]
        scores = scores.masked_fill(positions[:, None] < torch.arange(keys, device=q.device), -math.inf)
    if attn_mask is not None:
        mask = _mask_rows(attn_mask, rows)
        if mask.dtype == torch.bool:
            scores = torch.where(mask, scores, -math.inf)
        else:
            scores = scores + mask.to(dtype)
    return _softmax(scores)


def sdpa_weights(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
) -> torch.Tensor:
    """The probabilities ``F.scaled_dot_product_attention`` uses with these arguments (no dropout).

    ``softmax(query @ key.T * scale + bias)`` as PyTorch documents it: a boolean ``attn_mask`` is
    True where a key may be attended to, a float one is added; ``is_causal`` hides the keys after
    each query (top-left aligned when queries and keys differ in length); ``scale`` defaults to
    ``1 / sqrt(E)``; ``enable_gqa`` repeats each key head for its group of query heads. Returns
    ``[..., L, S]`` in float32 (float64 for float64 inputs); a row with every key masked is zero.

    >>> q, k = torch.randn(2, 4, 6, 8), torch.randn(2, 4, 6, 8)
    >>> p = sdpa_weights(q, k, is_causal=True)
    >>> p.shape, bool(torch.allclose(p.sum(-1), torch.ones(2, 4, 6))), p[0, 0, 0, 1].item()
    (torch.Size([2, 4, 6, 6]), True, 0.0)
    """
    with torch.no_grad():
        return _sdpa(query, key, attn_mask, is_causal, scale, enable_gqa, slice(None))


def _float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """nn.MultiheadAttention's convention: a boolean mask is True where *masked* (-inf), a float one added."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, -math.inf)
    if not mask.is_floating_point():
        raise ArgumentError(f"masks of nn.MultiheadAttention must be bool or float, got {mask.dtype}")
    return mask.to(dtype)


def _mha(
    module: nn.MultiheadAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    rows: slice,
) -> torch.Tensor:
    # follows F.multi_head_attention_forward with need_weights=True, without value and out projections
    if is_causal and attn_mask is None:
        raise ArgumentError(
            "is_causal=True is only a hint in nn.MultiheadAttention: it needs the causal attn_mask too "
            "(nn.Transformer.generate_square_subsequent_mask makes one)"
        )
    batched = query.dim() == 3
    if not batched:
        query, key = query.unsqueeze(1), key.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    elif module.batch_first:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    dtype = _dtype(query)
    length, batch, embed = query.shape
    heads = module.num_heads
    head_dim = embed // heads
    if module._qkv_same_embed_dim:
        w_q, w_k = module.in_proj_weight[:embed], module.in_proj_weight[embed : 2 * embed]
    else:
        w_q, w_k = module.q_proj_weight, module.k_proj_weight
    bias = module.in_proj_bias
    b_q, b_k = (None, None) if bias is None else (bias[:embed].to(dtype), bias[embed : 2 * embed].to(dtype))
    q = F.linear(query[rows].to(dtype), w_q.to(dtype), b_q)
    k = F.linear(key.to(dtype), w_k.to(dtype), b_k)
    mask = _float_mask(attn_mask, dtype)
    padding = _float_mask(key_padding_mask, dtype)
    if mask is not None:
        mask = _mask_rows(mask.unsqueeze(0) if mask.dim() == 2 else mask, rows)
    if module.bias_k is not None:
        k = torch.cat([k, module.bias_k.to(dtype).repeat(1, batch, 1)])
        mask = None if mask is None else F.pad(mask, (0, 1))
        padding = None if padding is None else F.pad(padding, (0, 1))
    q = q.reshape(q.shape[0], batch * heads, head_dim).transpose(0, 1)
    k = k.reshape(k.shape[0], batch * heads, head_dim).transpose(0, 1)
    if module.add_zero_attn:
        k = torch.cat([k, k.new_zeros(batch * heads, 1, head_dim)], 1)
        mask = None if mask is None else F.pad(mask, (0, 1))
        padding = None if padding is None else F.pad(padding, (0, 1))
    keys = k.size(1)
    if padding is not None:
        padding = padding.view(batch, 1, 1, keys).expand(-1, heads, -1, -1).reshape(batch * heads, 1, keys)
        mask = padding if mask is None else mask + padding
    q = q * math.sqrt(1.0 / head_dim)
    scores = torch.bmm(q, k.transpose(-2, -1)) if mask is None else torch.baddbmm(mask, q, k.transpose(-2, -1))
    weights = _softmax(scores).view(batch, heads, q.size(1), keys)
    return weights if batched else weights[0]


def mha_weights(
    module: nn.MultiheadAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor | None = None,
    key_padding_mask: torch.Tensor | None = None,
    attn_mask: torch.Tensor | None = None,
    is_causal: bool = False,
) -> torch.Tensor:
    """The per-head weights of ``module(query, key, value, ...)``, from the query and key projections only.

    Equal to ``module(..., need_weights=True, average_attn_weights=False)[1]`` in eval mode (no
    dropout): ``[B, heads, L, S]``, or ``[heads, L, S]`` for unbatched (2-D) inputs, in float32
    (float64 for float64 inputs). ``value`` is not needed and not read. Masks follow the module:
    a boolean ``attn_mask``/``key_padding_mask`` is True where *masked*, a float one is added;
    ``is_causal`` is a hint that the ``attn_mask`` given is causal, so the mask is what counts.
    A row with every key masked is zero (the module gives NaN).

    >>> mha = torch.nn.MultiheadAttention(16, 4, batch_first=True).eval()
    >>> x = torch.randn(2, 5, 16)
    >>> w = mha_weights(mha, x, x)
    >>> w.shape, bool(torch.allclose(w, mha(x, x, x, average_attn_weights=False)[1], atol=1e-6))
    (torch.Size([2, 4, 5, 5]), True)
    """
    with torch.no_grad():
        return _mha(module, query, key, key_padding_mask, attn_mask, is_causal, slice(None))
