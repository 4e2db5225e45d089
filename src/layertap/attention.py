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
- ``kernel="eager"`` trades that promise for speed where the fused kernel costs as much as the
  eager formula (short sequences on a CPU): each ``scaled_dot_product_attention`` call is then
  computed by the collector, in the kernel's place (the tap's ``replace=``), from the
  probabilities it keeps, so that they are made once: outputs equal the fused kernel's to float
  rounding, as after a reload with ``attn_implementation="eager"``, without the reload.
- Rows a mask hides completely (every key masked) are all zero, as PyTorch's kernels return them
  (its reference formula would give NaN).
- Padding: when the model is called with a ``[B, T]`` ``attention_mask`` (Hugging Face models),
  ``rows="cls"`` and ``"last"`` are each sequence's first and last *real* token, for left and
  right padding alike (the mask of the running call: `layertap.tap.masks`).
"""

from __future__ import annotations

import inspect
import warnings
from collections.abc import Iterator, Mapping
from typing import Any, Literal

import torch
from torch import nn

from . import nested
from .attention_weights import (
    HEADS,
    ROW_SLICES,
    ROWS,
    At,
    Heads,
    MaskTerms,
    Rows,
    check_options,
    compute_dtype,
    fuse_heads,
    mask_terms_key,
    materialize,
    mha_rows,
    mha_weights,
    reduce_weights,
    sdpa_rows,
    sdpa_weights,
    take_rows,
)
from .errors import ArgumentError, LayerNotFoundError, LayerNotRunError, TapError
from .select import Layers, OpName, Spec, selection
from .tap import Inputs, Tap, masks, tap
from .tap.controls import shares_memory
from .tap.ops import running_call
from .tap.recompute import recomputing

Kernel = Literal["fused", "eager"]
KERNELS: tuple[str, ...] = ("fused", "eager")


def _rows_at(rows: str, batch: int, length: int, device: torch.device) -> At:
    """Where the ``rows`` kept are, for queries ``[batch, ..., length, E]``: under a running
    ``[batch, length]`` attention_mask, each sequence's first ("cls") or last real token."""
    real = masks.real_tokens(batch, length) if rows != "all" else None
    if real is None:
        return ROW_SLICES[rows]
    return (masks.first_real(real) if rows == "cls" else masks.last_real(real)).to(device)


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
        kernel: Kernel = "fused",
    ) -> None:
        check_options(heads, rows)
        if kernel not in KERNELS:
            raise ArgumentError(
                f"kernel={kernel!r} is not one of {KERNELS}: 'fused' leaves the model's attention kernel to run and "
                "recomputes the probabilities beside it, 'eager' computes the result from the probabilities in its place"
            )
        self.kernel = kernel
        self.model = model
        self.heads = heads
        self.rows = rows
        self.to = None if to is None else torch.device(to)
        chosen = selection(model, "" if layers is None else layers)
        if layers is None:
            modules = chosen.layers
            found = [name for name, module in modules.items() if is_attention(name, module)]
            # the innermost of nested ones: a wrapper (BertAttention around BertSelfAttention)
            # computes none, and framing its ops would cost every call of its children a hook
            names = [n for n in found if not any(o.startswith(f"{n}.") or (not n and o) for o in found)]
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
        self._terms: MaskTerms | None = None  # those of the last mask, for the next layers given the same
        # kernel="eager": each scaled_dot_product_attention call is computed here, in the kernel's place,
        # and so not tapped (its inputs and output would only pass by)
        runs = None
        read = self._selection
        if kernel == "eager":
            runs = {spec: self._run_sdpa for spec in specs if isinstance(spec, tuple) and spec[1] == _SDPA}
            read = chosen.select([spec for spec in specs if spec not in runs])
        # made once: a collector entered batch after batch only adds and removes its hooks
        self._tap: Tap = tap(self.model, read, capture=("input", "output"), observe=self._observe, replace=runs)

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
        with warnings.catch_warnings():  # a module that computes its softmax itself calls no kernel to replace: as meant
            warnings.filterwarnings("ignore", message="layertap: edit=/replace=")
            self._tap.remove()

    def _observe(self, name: str, kind: str, call: int, value: Any) -> None:
        try:
            self._read(name, kind, value)
        except Exception as e:  # name the module: the traceback would point into the model's forward
            op = self._selection.ops.get(name)
            module, what = (name, "inputs") if op is None else (op.module, f"{op.op} {kind}")
            nested_input = any(t.is_nested for t in nested.tensors(value.args if isinstance(value, Inputs) else value))
            fix = (
                "its input is a nested tensor (nn.TransformerEncoder's fast path in eval with a padding mask): build the "
                "encoder with enable_nested_tensor=False" if nested_input else "Leave it out with layers=, or report the model"
            )
            raise TapError(
                f"layertap.attention could not recompute the attention of {module!r} "
                f"({type(self.sites[module]).__name__}) from its {what}: {type(e).__name__}: {e}. {fix}"
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
                kept = fuse_heads(take_rows(weights, at, 4), self.heads).to(compute_dtype(weights))
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
        query = a["query"]
        at = _rows_at(self.rows, query.size(0), query.size(-2), query.device) if query.dim() >= 3 else ROW_SLICES[self.rows]
        return fuse_heads(_four_d(self._weights(a, at)), self.heads)

    def _weights(self, a: dict[str, Any], at: At = ROW_SLICES["all"]) -> torch.Tensor:
        """The probabilities of a scaled_dot_product_attention call's arguments ``a``, at query rows ``at``
        (a mask's terms kept for the next layers given the same mask)."""
        query, mask, terms = a["query"], a.get("attn_mask"), None
        if mask is not None:
            mask = materialize(mask, query.device)
            dtype = compute_dtype(query)
            key = mask_terms_key(mask, at, dtype)
            terms = self._terms
            if terms is None or key is None or terms.key != key:
                terms = MaskTerms(mask, at, query.dim(), dtype)
                self._terms = terms if key is not None else None
        causal, gqa = bool(a.get("is_causal", False)), bool(a.get("enable_gqa", False))
        return sdpa_rows(query, a["key"], mask, causal, a.get("scale"), gqa, at, terms)

    def _run_sdpa(self, name: str, func: Any, args: tuple, kwargs: dict) -> Any:
        """A scaled_dot_product_attention call computed in the kernel's place (``kernel="eager"``):
        ``softmax(q kᵀ·scale + mask) @ v``, with autograd as the call had it; a call with dropout runs
        its kernel (its random mask cannot be drawn again here), its probabilities recomputed beside it."""
        op = self._selection.ops[name]
        a = _arguments(Inputs(args, kwargs), _SDPA_ARGS)
        if a.get("dropout_p") or a["query"].dim() < 3:
            with torch.no_grad():
                self._read_inputs(name, op, Inputs(args, kwargs))
            return func(*args, **kwargs)
        try:
            weights = self._weights(a)
            value = a["value"]
            if a.get("enable_gqa"):
                value = value.repeat_interleave(a["query"].size(-3) // value.size(-3), -3)
            out = (weights @ value.to(weights.dtype)).to(a["query"].dtype)
        except Exception as e:
            raise TapError(
                f"layertap.attention (kernel='eager') could not compute the attention of {op.module!r} "
                f"({type(self.sites[op.module]).__name__}): {type(e).__name__}: {e}. Use kernel='fused', or leave it out with layers="
            ) from e
        if not recomputing():  # a checkpoint's recomputation computes again what the forward kept
            self._sdpa.add(op.module)
            at = _rows_at(self.rows, weights.size(0), weights.size(-2), weights.device)
            self._put(op.module, fuse_heads(_four_d(take_rows(weights.detach(), at, weights.dim())), self.heads))
        return out

    def _from_mha(self, name: str, value: Any) -> torch.Tensor:
        module = self.sites[name]
        assert isinstance(module, nn.MultiheadAttention)
        signature = self._signatures.get(name)
        if signature is None:
            signature = self._signatures[name] = inspect.signature(type(module).forward)
        a = _arguments(value, signature)
        causal = bool(a.get("is_causal", False))
        query = a["query"]
        at: At = ROW_SLICES[self.rows]
        if query.dim() == 3:  # batched: [B, L, E] or [L, B, E]
            batch, length = (query.size(0), query.size(1)) if module.batch_first else (query.size(1), query.size(0))
            at = _rows_at(self.rows, batch, length, query.device)
        weights = mha_rows(module, query, a["key"], a.get("key_padding_mask"), a.get("attn_mask"), causal, at)
        return fuse_heads(_four_d(weights), self.heads)


def attention(
    model: nn.Module,
    layers: Layers | None = None,
    *,
    heads: Heads = "mean",
    rows: Rows = "all",
    to: torch.device | str | None = None,
    kernel: Kernel = "fused",
) -> Attention:
    """Collect the attention probabilities of ``model``'s attention modules while a ``with`` block runs.

    Args:
        layers: the attention modules (any `layertap.select` spec). ``None`` takes every
            ``nn.MultiheadAttention`` and every module whose class name contains ``"Attention"``
            but holds none (the innermost: ``BertSelfAttention``, not the ``BertAttention``
            wrapping it); a module whose own forward calls neither
            ``scaled_dot_product_attention`` nor ``softmax`` records nothing.
        heads: ``"all"`` keeps ``[B, H, Q, K]``; ``"mean"`` or ``"max"`` fuse the heads to one.
        rows: ``"all"`` queries, ``"cls"`` query 0 only or ``"last"`` the last query only. When
            the model is called with a ``[B, T]`` ``attention_mask``, they are each sequence's
            first and last *real* token, whether the batch is padded on the left or the right.
        to: the device results are moved to (default: where the model computes).
        kernel: what computes a ``scaled_dot_product_attention`` call's result. ``"fused"`` leaves
            the model's own kernel to run and recomputes the probabilities beside it: the model's
            outputs are bit for bit its own, at the cost of one more ``q @ kᵀ`` and softmax a
            call. ``"eager"`` computes the probabilities once and the result from them, in the
            kernel's place, as ``attn_implementation="eager"`` would (``softmax(q kᵀ·scale +
            mask) @ v``, with autograd): outputs equal the kernel's to float rounding, at the
            cost of the eager route or less. A call with dropout keeps its kernel either way.

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
    return Attention(model, layers, heads=heads, rows=rows, to=to, kernel=kernel)


__all__ = [
    "HEADS", "KERNELS", "ROWS", "Attention", "Heads", "Kernel", "Rows",
    "attention", "is_attention", "mha_weights", "reduce_weights", "sdpa_weights",
]  # fmt: skip
