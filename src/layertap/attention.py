"""Attention probabilities ``[batch, heads, queries, keys]`` from models that never compute them.

>>> import torch, torchvision, layertap.attention
>>> model = torchvision.models.VisionTransformer(32, 16, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64)
>>> with torch.no_grad(), layertap.attention.attention(model.eval()) as att:
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
  only (`mha_weights`, the module's own ``need_weights=True`` formula; its softmax runs inside
  one torch function, out of an op tap's sight). An eager ``softmax`` over the keys in an
  attention module's own forward already is the probability: it is taken as it is (its dim,
  positional or by keyword, read from the call: `layertap.tap.ops.running_call`).
- The arguments are read by `layertap.tap` (an op tap, or a module input tap for
  ``nn.MultiheadAttention``) with ``observe=``: they are used inside the call and never kept.
  The recomputation reads detached views, without autograd, in float32 (float64 for float64
  inputs), so the model's values, outputs and gradients are untouched.
- Cost: one ``q @ k.T`` and softmax per attention call (plus the query and key projections for
  ``nn.MultiheadAttention``), and the ``[B, H, Q, K]`` tensor the fused kernel avoided. Only two
  such tensors are made, the scores (scaled and masked in place) and the probabilities, and a
  mask's additive bias once for all the layers given that mask: on a CPU
  each new one of a few MB costs page faults besides its pass (benchmarks/bench_attention.py
  compares the eager route). ``rows="cls"`` or ``"last"`` computes one query row (``Q = 1``) and
  ``heads="mean"``/``"max"`` keeps one head, so what is kept stays small.
- Rows a mask hides completely (every key masked) are all zero, as PyTorch's kernels return them
  (its reference formula would give NaN).
- Padding: when the model is called with a ``[B, T]`` ``attention_mask`` (Hugging Face models),
  ``rows="cls"`` and ``"last"`` are each sequence's first and last *real* token, for left and
  right padding alike (the mask of the running call: `layertap.tap.masks`).
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
import torch.nn.functional as F
from torch import nn

from .errors import ArgumentError, LayerNotFoundError, LayerNotRunError, TapError
from .select import Layers, OpName, Spec, selection
from .tap import Inputs, Tap, masks, tap
from .tap.controls import shares_memory
from .tap.ops import running_call

Heads = Literal["all", "mean", "max"]
Rows = Literal["all", "cls", "last"]
HEADS: tuple[str, ...] = ("all", "mean", "max")
ROWS: tuple[str, ...] = ("all", "cls", "last")
_ROWS = {"all": slice(None), "cls": slice(0, 1), "last": slice(-1, None)}
At = slice | torch.Tensor  # the query rows kept: a slice, or one position per batch entry ([B] integers)


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


def _softmax(scores: torch.Tensor, hidden: torch.Tensor | None) -> torch.Tensor:
    """Softmax over keys; the rows ``hidden`` marks (every key masked: only a mask hides a whole row,
    a causal row always sees key 0) are zero, as PyTorch's kernels give."""
    weights = torch.softmax(scores, -1)
    # asking whether any row is hidden costs nothing on a CPU and spares a pass; elsewhere it would wait for the device
    if hidden is not None and (hidden.device.type != "cpu" or bool(hidden.any())):
        weights.masked_fill_(hidden, 0.0)
    return weights


def _take_rows(t: torch.Tensor, rows: At, dims: int) -> torch.Tensor:
    """The query rows of ``t`` ``[..., Q, X]``: a slice, or one row per batch entry (``t`` then
    broadcast to ``dims`` dims, its first the batch)."""
    if isinstance(rows, slice):
        return t[..., rows, :]
    t = t.reshape((1,) * (dims - t.dim()) + tuple(t.shape))
    return torch.take_along_dim(t, rows.view(-1, *(1,) * (dims - 1)), dim=-2)


def _mask_rows(mask: torch.Tensor, rows: At, dims: int) -> torch.Tensor:
    """A mask's query rows (a mask broadcast over queries stays as it is)."""
    return _take_rows(mask, rows, dims) if mask.dim() >= 2 and mask.size(-2) != 1 else mask


def _rows_at(rows: str, batch: int, length: int, device: torch.device) -> At:
    """Where the ``rows`` kept are, for queries ``[batch, ..., length, E]``: under a running
    ``[batch, length]`` attention_mask, each sequence's first ("cls") or last real token."""
    real = masks.real_tokens(batch, length) if rows != "all" else None
    if real is None:
        return _ROWS[rows]
    return (masks.first_real(real) if rows == "cls" else masks.last_real(real)).to(device)


def _heads(weights: torch.Tensor, heads: str) -> torch.Tensor:
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
    _check(heads, rows)
    return _heads(weights if rows == "all" else weights[..., _ROWS[rows], :], heads)


# ---------------------------------------------------------------------------------- the formulas
class _Terms:
    """What a mask adds to the scores: ``bias`` (0 or -inf for a boolean mask, the float mask
    itself otherwise) and ``hidden``, the rows it hides completely (None: none, as known on a CPU).

    Made once per mask: a model hands the same mask to every layer, and an additive float bias
    costs one pass over the scores where a boolean mask costs a slower masked fill."""

    __slots__ = ("bias", "hidden", "key", "mask")

    def __init__(self, mask: torch.Tensor, rows: At, dims: int, dtype: torch.dtype) -> None:
        kept = _mask_rows(mask, rows, dims)
        if kept.dtype == torch.bool:
            bias = torch.zeros(kept.shape, dtype=dtype, device=kept.device).masked_fill_(~kept, -math.inf)
            hidden = ~kept.any(-1, keepdim=True)
        else:
            bias = kept.to(dtype)
            hidden = (bias == -math.inf).all(-1, keepdim=True)
        # asking whether any row is hidden costs nothing on a CPU and spares a pass; elsewhere it would wait for the device
        self.bias = bias
        self.hidden = hidden if hidden.device.type != "cpu" or bool(hidden.any()) else None
        self.key = _terms_key(mask, rows, dtype)
        self.mask = mask


def _terms_key(mask: torch.Tensor, rows: At, dtype: torch.dtype) -> tuple | None:
    """Which mask ``_Terms`` were made from (None: rows per batch entry, made anew each call); the
    ``_Terms`` hold the mask alive, so its memory is not another mask's while they are kept."""
    if not isinstance(rows, slice):
        return None
    return (mask.data_ptr(), mask.shape, mask.stride(), mask.dtype, mask.device, mask._version, rows.indices(1 << 62), dtype)


def _sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    attn_mask: torch.Tensor | None,
    is_causal: bool,
    scale: float | None,
    enable_gqa: bool,
    rows: At,
    terms: _Terms | None = None,
) -> torch.Tensor:
    """The probabilities (`sdpa_weights`); ``terms``: those of ``attn_mask``, made before."""
    dtype = _dtype(query)
    length, keys = query.size(-2), key.size(-2)
    if is_causal and attn_mask is not None:
        raise ArgumentError("is_causal=True and an attn_mask cannot both be given (as in F.scaled_dot_product_attention)")
    dims = query.dim()
    q = _take_rows(query, rows, dims).to(dtype)
    k = key.to(dtype)
    if enable_gqa:
        k = k.repeat_interleave(q.size(-3) // k.size(-3), -3)
    factor = 1 / math.sqrt(query.size(-1)) if scale is None else scale
    # scaled and masked in place: each new [B, H, Q, K] tensor costs its memory and, on a CPU, its page faults
    scores = q @ k.transpose(-2, -1)
    hidden = None
    if attn_mask is not None:
        if terms is None:
            terms = _Terms(_materialize(attn_mask, query.device), rows, dims, dtype)
        # bias + factor * scores in one pass; a mask broadcasts to the weights' shape (SDPA's own rule)
        torch.add(terms.bias, scores, alpha=factor, out=scores)
        hidden = terms.hidden
    else:
        scores.mul_(factor)
    if is_causal:  # top-left aligned, as PyTorch's is_causal
        at = torch.arange(length, device=q.device)[rows] if isinstance(rows, slice) else rows.view(-1, *(1,) * (dims - 2))
        scores.masked_fill_(at[..., None] < torch.arange(keys, device=q.device), -math.inf)
    weights = torch.softmax(scores, -1)
    if hidden is not None:  # rows every key of which is masked are zero, as PyTorch's kernels give
        weights.masked_fill_(hidden, 0.0)
    return weights


def _materialize(mask: Any, device: torch.device) -> torch.Tensor:
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


def _project(
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


def _mha(
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
    dtype = _dtype(query)
    _, batch, embed = query.shape
    heads = module.num_heads
    head_dim = embed // heads
    q, k = _project(module, query, key, same, rows, dtype)
    mask = _float_mask(attn_mask, dtype)
    padding = _float_mask(key_padding_mask, dtype)
    if mask is not None:  # [B * heads, L, S], batch-major: a batch entry's row for each of its heads
        mask_rows = rows if isinstance(rows, slice) else rows.repeat_interleave(heads)
        mask = _mask_rows(mask.unsqueeze(0) if mask.dim() == 2 else mask, mask_rows, 3)
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
    weights = _softmax(scores, hidden).view(batch, heads, q.size(1), keys)
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


# ---------------------------------------------------------------------------------- the collector
_SDPA = "scaled_dot_product_attention"
_SDPA_ARGS = ("query", "key", "value", "attn_mask", "dropout_p", "is_causal", "scale", "enable_gqa")


def _arguments(value: Any, names: tuple[str, ...] | inspect.Signature) -> dict[str, Any]:
    """A captured input (a tensor, or `Inputs`) as ``{parameter: argument}``."""
    args, kwargs = (value.args, value.kwargs) if isinstance(value, Inputs) else ((value,), {})
    if isinstance(names, inspect.Signature):
        return dict(names.bind_partial(None, *args, **kwargs).arguments)
    return {**dict(zip(names, args)), **kwargs}


def _four_d(weights: torch.Tensor) -> torch.Tensor:
    """``[B, H, Q, K]``: a 3-D map is one head; heads spread over several dims are merged."""
    if weights.dim() == 4:
        return weights
    if weights.dim() == 3:
        return weights[:, None]
    if weights.dim() == 2:
        return weights[None, None]
    return weights.flatten(1, -3)


def is_attention(name: str, module: nn.Module) -> bool:
    """The modules `attention` searches by default (a `layertap.select` predicate): ``nn.MultiheadAttention``
    and any module whose class name contains ``"Attention"`` (timm's ``Attention``, ``BertSelfAttention``...)."""
    return isinstance(module, nn.MultiheadAttention) or "Attention" in type(module).__name__


class Attention(Mapping[str, torch.Tensor]):
    """The attention probabilities of a model's attention modules, by module name (see `attention`).

    Filled while its ``with`` block runs; each entry is the module's last call, ``[B, H', Q', K]``
    float32 (float64 for a float64 model). Iteration follows the order the modules first ran.
    """

    def __init__(
        self,
        model: nn.Module,
        layers: Layers | None = None,
        *,
        heads: Heads = "mean",
        rows: Rows = "all",
        to: torch.device | str | None = None,
    ) -> None:
        _check(heads, rows)
        self.model = model
        self.heads = heads
        self.rows = rows
        self.to = None if to is None else torch.device(to)
        chosen = selection(model, "" if layers is None else layers)
        if layers is None:
            modules = chosen.layers
            names = [name for name, module in modules.items() if is_attention(name, module)]
            if not names:
                classes = sorted({type(m).__name__ for m in modules.values()})
                raise LayerNotFoundError(
                    f"found no attention module in {type(model).__name__}: layertap.attention looks for "
                    "nn.MultiheadAttention and classes named *Attention*, and the model has "
                    f"{', '.join(classes[:20])}{', ...' if len(classes) > 20 else ''}. Pass layers= with the "
                    "modules whose forward calls scaled_dot_product_attention or softmax"
                )
            chosen = chosen.select(names)
        # the modules selected, and those whose ops were
        self.sites: dict[str, nn.Module] = dict(chosen.modules)
        # what the tap reads: an nn.MultiheadAttention's inputs, the others' attention ops
        specs: list[Spec] = []
        for name, module in self.sites.items():
            specs += [name] if isinstance(module, nn.MultiheadAttention) else [(name, _SDPA), (name, "softmax")]
        self._selection = chosen.select(specs)
        self._maps: dict[str, torch.Tensor] = {}
        self._sdpa: set[str] = set()  # sites read from scaled_dot_product_attention: their softmax is not attention
        self._softmax_last_dim: dict[str, bool] = {}
        self._signatures: dict[str, inspect.Signature] = {}
        self._terms: _Terms | None = None  # those of the last mask, for the next layers given the same
        # made once: a collector entered batch after batch only adds and removes its hooks
        self._tap: Tap = tap(self.model, self._selection, capture=("input", "output"), observe=self._observe)

    # -------------------------------------------------------------- the mapping
    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            return self._maps[name]
        except KeyError:
            pass
        if name in self.sites:
            found = ", ".join(list(self._maps)[:5]) or "none"
            raise LayerNotRunError(
                f"no attention recorded for {name!r} ({type(self.sites[name]).__name__}): it did not run inside "
                "the with block, or its forward calls neither scaled_dot_product_attention nor softmax over "
                f"the keys (a custom kernel, or attention in a child module). Recorded: {found}"
            )
        raise LayerNotFoundError(
            f"{name!r} is not an attention module of this collector; its modules are "
            f"{', '.join(list(self.sites)[:8])}{', ...' if len(self.sites) > 8 else ''}"
        )

    def __iter__(self) -> Iterator[str]:
        return iter(self._maps)

    def __len__(self) -> int:
        return len(self._maps)

    def __repr__(self) -> str:
        return f"<layertap.attention heads={self.heads!r} rows={self.rows!r} of {list(self._maps)}>"

    def clear(self) -> None:
        """Forget what was recorded (the collector keeps collecting)."""
        self._maps.clear()
        self._sdpa.clear()

    # -------------------------------------------------------------- collecting
    def __enter__(self) -> Attention:
        self._tap.__enter__()
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        self.remove()

    def remove(self) -> None:
        """Stop collecting (the ``with`` block does it); what was recorded stays readable."""
        self._terms = None
        self._tap.remove()

    def _observe(self, name: str, kind: str, call: int, value: Any) -> None:
        try:
            self._read(name, kind, value)
        except Exception as e:  # name the module: the traceback would point into the model's forward
            op = self._selection.ops.get(name)
            module, what = (name, "inputs") if op is None else (op.module, f"{op.op} {kind}")
            raise TapError(
                f"layertap.attention could not recompute the attention of {module!r} "
                f"({type(self.sites[module]).__name__}) from its {what}: "
                f"{type(e).__name__}: {e}. Leave it out with layers=, or report the model"
            ) from e

    def _read(self, name: str, kind: str, value: Any) -> None:
        op = self._selection.ops.get(name)
        if op is None or op.op == _SDPA:  # read from the inputs: an output is passed by as it is, at no cost
            if kind == "input":
                with torch.no_grad():
                    self._read_inputs(name, op, value)
            return
        with torch.no_grad():
            if kind == "input":  # softmax: attention only over the last dim
                # the call's own arguments: for softmax(x, dim=-1) the tap hands over x only
                call = running_call()
                a = _arguments(value if call is None else Inputs(call[1], call[2]), ("input", "dim"))
                x = a.get("input")
                dim = a.get("dim")
                last = isinstance(x, torch.Tensor) and x.dim() >= 2 and dim in (-1, x.dim() - 1)
                self._softmax_last_dim[op.module] = last
            elif self._softmax_last_dim.pop(op.module, False) and op.module not in self._sdpa:
                weights = _four_d(value)
                at = _rows_at(self.rows, weights.size(0), weights.size(-2), weights.device)
                kept = _heads(_take_rows(weights, at, 4), self.heads).to(_dtype(weights))
                self._put(op.module, kept.clone() if shares_memory(kept, weights) else kept)

    def _read_inputs(self, name: str, op: OpName | None, value: Any) -> None:
        """An nn.MultiheadAttention's inputs (``op`` None) or a scaled_dot_product_attention call's."""
        if op is None:
            self._put(name, self._from_mha(name, value))
        else:
            self._sdpa.add(op.module)
            self._put(op.module, self._from_sdpa(value))

    def _put(self, name: str, weights: torch.Tensor) -> None:
        if self.to is not None:
            weights = weights.to(self.to)
        self._maps[name] = weights

    def _from_sdpa(self, value: Any) -> torch.Tensor:
        a = _arguments(value, _SDPA_ARGS)
        causal, gqa = bool(a.get("is_causal", False)), bool(a.get("enable_gqa", False))
        query = a["query"]
        at = _rows_at(self.rows, query.size(0), query.size(-2), query.device) if query.dim() >= 3 else _ROWS[self.rows]
        mask, terms = a.get("attn_mask"), None
        if mask is not None:
            mask = _materialize(mask, query.device)
            dtype = _dtype(query)
            key = _terms_key(mask, at, dtype)
            terms = self._terms
            if terms is None or key is None or terms.key != key:
                terms = _Terms(mask, at, query.dim(), dtype)
                self._terms = terms if key is not None else None
        weights = _sdpa(query, a["key"], mask, causal, a.get("scale"), gqa, at, terms)
        return _heads(_four_d(weights), self.heads)

    def _from_mha(self, name: str, value: Any) -> torch.Tensor:
        module = self.sites[name]
        assert isinstance(module, nn.MultiheadAttention)
        signature = self._signatures.get(name)
        if signature is None:
            signature = self._signatures[name] = inspect.signature(type(module).forward)
        a = _arguments(value, signature)
        causal = bool(a.get("is_causal", False))
        query = a["query"]
        at: At = _ROWS[self.rows]
        if query.dim() == 3:  # batched: [B, L, E] or [L, B, E]
            batch, length = (query.size(0), query.size(1)) if module.batch_first else (query.size(1), query.size(0))
            at = _rows_at(self.rows, batch, length, query.device)
        weights = _mha(module, query, a["key"], a.get("key_padding_mask"), a.get("attn_mask"), causal, at)
        return _heads(_four_d(weights), self.heads)


def attention(
    model: nn.Module,
    layers: Layers | None = None,
    *,
    heads: Heads = "mean",
    rows: Rows = "all",
    to: torch.device | str | None = None,
) -> Attention:
    """Collect the attention probabilities of ``model``'s attention modules while a ``with`` block runs.

    Args:
        layers: the attention modules (any `layertap.select` spec). ``None`` takes every
            ``nn.MultiheadAttention`` and every module whose class name contains ``"Attention"``;
            those whose own forward calls neither ``scaled_dot_product_attention`` nor ``softmax``
            (a wrapper such as ``BertAttention``) record nothing.
        heads: ``"all"`` keeps ``[B, H, Q, K]``; ``"mean"`` or ``"max"`` fuse the heads to one.
        rows: ``"all"`` queries, ``"cls"`` query 0 only or ``"last"`` the last query only. When
            the model is called with a ``[B, T]`` ``attention_mask``, they are each sequence's
            first and last *real* token, whether the batch is padded on the left or the right.
        to: the device results are moved to (default: where the model computes).

    How each module is read: an ``nn.MultiheadAttention`` from its inputs (`mha_weights`); any
    other from the arguments of its ``scaled_dot_product_attention`` call (`sdpa_weights`) or,
    if it calls none, from the output of its ``softmax`` over the last dim (eager attention).
    A module called several times keeps its last call. The model runs, and computes, as without
    the collector (``nn.TransformerEncoderLayer`` skips its fused fast path while its attention is
    hooked, as under any tap: the same numbers to rounding). Limits: attention computed by other
    kernels (flash-attn, xformers, flex attention) is not seen; Hugging Face's one-token decoding
    step with grouped heads packs the heads into the query dim.

    >>> import torch, timm, layertap.attention
    >>> model = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=2).eval()
    >>> with torch.no_grad(), layertap.attention.attention(model, heads="all", rows="cls") as att:
    ...     logits = model(torch.randn(2, 3, 32, 32))
    >>> {name: tuple(a.shape) for name, a in att.items()}
    {'blocks.0.attn': (2, 3, 1, 5), 'blocks.1.attn': (2, 3, 1, 5)}
    """
    return Attention(model, layers, heads=heads, rows=rows, to=to)
