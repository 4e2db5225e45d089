"""The formulas of attention probabilities: what ``F.scaled_dot_product_attention`` and
``nn.MultiheadAttention`` attend with, recomputed from their arguments (`sdpa_weights`,
`mha_weights`), and maps reduced to fewer heads and query rows (`reduce_weights`).
`layertap.attention` reads the arguments from a running model and calls these.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ArgumentError

Heads = Literal["all", "mean", "max"]
Rows = Literal["all", "cls", "last"]
HEADS: tuple[str, ...] = ("all", "mean", "max")
ROWS: tuple[str, ...] = ("all", "cls", "last")
ROW_SLICES = {"all": slice(None), "cls": slice(0, 1), "last": slice(-1, None)}
At = slice | torch.Tensor  # the query rows kept: a slice, or one position per batch entry ([B] integers)


# ---------------------------------------------------------------------------------- arguments
def check_options(heads: str, rows: str) -> None:
    if heads not in HEADS:
        raise ArgumentError(f"heads={heads!r} is not one of {HEADS}: 'all' keeps every head, 'mean'/'max' fuse them")
    if rows not in ROWS:
        raise ArgumentError(
            f"rows={rows!r} is not one of {ROWS}: 'all' keeps every query, 'cls' query 0, 'last' the last query"
        )


def compute_dtype(t: torch.Tensor) -> torch.dtype:
    """float32 at least: half and bfloat16 probabilities would round visibly."""
    return torch.promote_types(t.dtype, torch.float32) if t.is_floating_point() else torch.float32


def softmax_shown(scores: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
    """Softmax over keys; the rows ``hidden`` marks (every key masked: only a mask hides a whole row,
    a causal row always sees key 0) are zero, as PyTorch's kernels give."""
    weights = torch.softmax(scores, -1)
    # asking whether any row is hidden costs nothing on a CPU and spares a pass; elsewhere it would wait for the device
    if hidden is not None and (hidden.device.type != "cpu" or bool(hidden.any())):
        weights.masked_fill_(hidden, 0.0)
    return weights


def take_rows(t: torch.Tensor, rows: At, dims: int) -> torch.Tensor:
    """The query rows of ``t`` ``[..., Q, X]``: a slice, or one row per batch entry (``t`` then
    broadcast to ``dims`` dims, its first the batch)."""
    if isinstance(rows, slice):
        return t[..., rows, :]
    t = t.reshape((1,) * (dims - t.dim()) + tuple(t.shape))
    return torch.take_along_dim(t, rows.view(-1, *(1,) * (dims - 1)), dim=-2)


def mask_rows(mask: torch.Tensor, rows: At, dims: int) -> torch.Tensor:
    """A mask's query rows (a mask broadcast over queries stays as it is)."""
    return take_rows(mask, rows, dims) if mask.dim() >= 2 and mask.size(-2) != 1 else mask


def fuse_heads(weights: torch.Tensor, heads: str) -> torch.Tensor:
    if heads == "mean":
        return weights.mean(1, keepdim=True)
    if heads == "max":
        return weights.amax(1, keepdim=True)
    return weights


def reduce_weights(weights: torch.Tensor, heads: Heads = "all", rows: Rows = "all") -> torch.Tensor:
    """Keep ``rows`` (query 0, the last query, or all) and fuse ``heads`` of ``[B, H, Q, K]`` weights.

    The result stays 4-D: ``[B, 1 or H, 1 or Q, K]``.

    >>> w = torch.softmax(torch.randn(2, 4, 5, 5), -1)
    >>> reduce_weights(w, heads="mean", rows="cls").shape
    torch.Size([2, 1, 1, 5])
    """
    check_options(heads, rows)
    return fuse_heads(weights if rows == "all" else weights[..., ROW_SLICES[rows], :], heads)


# ---------------------------------------------------------------------------------- the formulas
class MaskTerms:
    """What a mask adds to the scores: ``bias`` (0 or -inf for a boolean mask, the float mask
    itself otherwise) and ``hidden``, the rows it hides completely (None: none, as known on a CPU).

    Made once per mask: a model hands the same mask to every layer, and an additive float bias
    costs one pass over the scores where a boolean mask costs a slower masked fill."""

    __slots__ = ("bias", "hidden", "key", "mask")

    def __init__(self, mask: torch.Tensor, rows: At, dims: int, dtype: torch.dtype) -> None:
        kept = mask_rows(mask, rows, dims)
        if kept.dtype == torch.bool:
            bias = torch.zeros(kept.shape, dtype=dtype, device=kept.device).masked_fill_(~kept, -math.inf)
            hidden = ~kept.any(-1, keepdim=True)
        else:
            bias = kept.to(dtype)
            hidden = (bias == -math.inf).all(-1, keepdim=True)
        # asking whether any row is hidden costs nothing on a CPU and spares a pass; elsewhere it would wait for the device
        self.bias = bias
        self.hidden = hidden if hidden.device.type != "cpu" or bool(hidden.any()) else None
        self.key = mask_terms_key(mask, rows, dtype)
        self.mask = mask


def mask_terms_key(mask: torch.Tensor, rows: At, dtype: torch.dtype) -> tuple | None:
    """Which mask ``MaskTerms`` were made from (None: rows per batch entry, made anew each call); the
    ``MaskTerms`` hold the mask alive, so its memory is not another mask's while they are kept."""
    if not isinstance(rows, slice) or mask.is_inference():  # an inference tensor has no version to tell a change by
        return None
    graded = mask.requires_grad and torch.is_grad_enabled()  # terms made under no_grad carry no gradient to the mask
    return (mask.data_ptr(), mask.shape, mask.stride(), mask.dtype, mask.device, mask._version, rows.indices(1 << 62), dtype, graded)


def sdpa_rows(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    rows: At,
    terms: MaskTerms | None = None,
) -> torch.Tensor:
    """The probabilities (`sdpa_weights`); ``terms``: those of ``attn_mask``, made before. Under
    autograd (a query or key that requires grad, grad mode on) no step is in place, so that the
    probabilities can carry gradients (``kernel="eager"`` of `layertap.attention`)."""
    dtype = compute_dtype(query)
    length, keys = query.size(-2), key.size(-2)
    if is_causal and attn_mask is not None:
        raise ArgumentError("is_causal=True and an attn_mask cannot both be given (as in F.scaled_dot_product_attention)")
    dims = query.dim()
    q = take_rows(query, rows, dims).to(dtype)
    k = key.to(dtype)
    if enable_gqa:
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
    factor = 1 / math.sqrt(query.size(-1)) if scale is None else scale
    # scaled and masked in place: each new [B, H, Q, K] tensor costs its memory and, on a CPU, its page faults
    scores = q @ k.transpose(-2, -1)
    hidden = None
    if attn_mask is not None and terms is None:
        terms = MaskTerms(materialize(attn_mask, query.device), rows, dims, dtype)
    # in place, unless autograd records the steps (for the query and key, or a mask that learns)
    fresh = not (scores.requires_grad or (terms is not None and terms.bias.requires_grad))
    if terms is not None:
        # bias + factor * scores in one pass; a mask broadcasts to the weights' shape (SDPA's own rule)
        scores = torch.add(terms.bias, scores, alpha=factor, out=scores) if fresh else torch.add(terms.bias, scores, alpha=factor)
        hidden = terms.hidden
    else:
        scores = scores.mul_(factor) if fresh else scores * factor
    if is_causal:  # top-left aligned, as PyTorch's is_causal
        at = torch.arange(length, device=q.device)[rows] if isinstance(rows, slice) else rows.view(-1, *(1,) * (dims - 2))
        future = at[..., None] < torch.arange(keys, device=q.device)
        scores = scores.masked_fill_(future, -math.inf) if fresh else scores.masked_fill(future, -math.inf)
    if hidden is not None and not fresh:  # a row of -inf alone: its softmax's NaN would reach the gradients
        scores = scores.masked_fill(hidden, 0.0)
    weights = torch.softmax(scores, -1)
    if hidden is not None:  # rows every key of which is masked are zero, as PyTorch's kernels give
        weights = weights.masked_fill_(hidden, 0.0) if fresh else weights.masked_fill(hidden, 0.0)
    return weights


def materialize(mask: Any, device: torch.device) -> torch.Tensor:
    """A mask as a tensor (``torch.nn.attention.bias.CausalBias`` makes its own)."""
    return mask._materialize(device) if hasattr(mask, "_materialize") else mask


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
        return sdpa_rows(query, key, attn_mask, is_causal, scale, enable_gqa, slice(None))


def mha_float_mask(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """nn.MultiheadAttention's convention: a boolean mask is True where *masked* (-inf), a float one added."""
    if mask is None:
        return None
    if mask.dtype == torch.bool:
        return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(mask, -math.inf)
    if not mask.is_floating_point():
        raise ArgumentError(f"masks of nn.MultiheadAttention must be bool or float, got {mask.dtype}")
    return mask.to(dtype)


def mha_project(
    module: nn.MultiheadAttention, query: torch.Tensor, key: torch.Tensor, same: bool, rows: At, dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor]:
    """The query rows and keys through the module's query and key projections, ``[L, B, E]``, in ``dtype``."""
    embed = query.shape[-1]
    if module._qkv_same_embed_dim:
        w_q, w_k = module.in_proj_weight[:embed], module.in_proj_weight[embed : 2 * embed]
    else:
        w_q, w_k = module.q_proj_weight, module.k_proj_weight
    bias = module.in_proj_bias
    b_q, b_k = (None, None) if bias is None else (bias[:embed].to(dtype), bias[embed : 2 * embed].to(dtype))
    if same and isinstance(rows, slice) and rows == slice(None) and module._qkv_same_embed_dim:
        # self-attention: one matrix product makes both projections
        b_qk = None if bias is None else bias[: 2 * embed].to(dtype)
        both = F.linear(query.to(dtype), module.in_proj_weight[: 2 * embed].to(dtype), b_qk)
        return both[..., :embed], both[..., embed:]
    # [L, B, E]: one query row per batch entry is taken along dim 0
    kept = query[rows] if isinstance(rows, slice) else torch.take_along_dim(query, rows.view(1, -1, 1), dim=0)
    return F.linear(kept.to(dtype), w_q.to(dtype), b_q), F.linear(key.to(dtype), w_k.to(dtype), b_k)


def mha_rows(
    module: nn.MultiheadAttention,
    query: torch.Tensor,
    key: torch.Tensor,
    key_padding_mask: torch.Tensor | None,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    rows: At,
) -> torch.Tensor:
    # follows F.multi_head_attention_forward with need_weights=True, without value and out projections
    if is_causal and attn_mask is None:
        raise ArgumentError(
            "is_causal=True is only a hint in nn.MultiheadAttention: it needs the causal attn_mask too "
            "(nn.Transformer.generate_square_subsequent_mask makes one)"
        )
    # self-attention (the tap hands over detached aliases, so compare memory, not identity)
    same = query.data_ptr() == key.data_ptr() and query.shape == key.shape and query.stride() == key.stride()
    batched = query.dim() == 3
    if not batched:
        query, key = query.unsqueeze(1), key.unsqueeze(1)
        if key_padding_mask is not None:
            key_padding_mask = key_padding_mask.unsqueeze(0)
    elif module.batch_first:
        query, key = query.transpose(0, 1), key.transpose(0, 1)
    dtype = compute_dtype(query)
    _, batch, embed = query.shape
    heads = module.num_heads
    head_dim = embed // heads
    q, k = mha_project(module, query, key, same, rows, dtype)
    mask = mha_float_mask(attn_mask, dtype)
    padding = mha_float_mask(key_padding_mask, dtype)
    if mask is not None:  # [B * heads, L, S], batch-major: a batch entry's row for each of its heads
        at = rows if isinstance(rows, slice) else rows.repeat_interleave(heads)
        mask = mask_rows(mask.unsqueeze(0) if mask.dim() == 2 else mask, at, 3)
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
    hidden = None if mask is None else (mask == -math.inf).all(-1, keepdim=True)
    weights = softmax_shown(scores, hidden).view(batch, heads, q.size(1), keys)
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
        return mha_rows(module, query, key, key_padding_mask, attn_mask, is_causal, slice(None))
