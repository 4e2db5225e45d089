"""Memory controls applied to each captured tensor inside the hook, before it is stored.

``detach`` drops the autograd graph, ``reduce`` pools (on the layer's own device, so less is
moved), ``dtype`` (a floating-point dtype) casts floating-point tensors, and complex ones to the
complex dtype of its precision (never dropping the imaginary part; bfloat16 has none: they stay
as they are), ``to`` moves. Integer and
boolean leaves are only detached and moved. A ``[B, T, C]`` token tensor of a model called with a ``[B, T]``
``attention_mask`` is pooled over its real tokens only (`layertap.tap.masks`), so that a
document's feature does not depend on its batch-mates' padding.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from .. import nested
from ..errors import ArgumentError, TapError
from . import masks

Reduce = str | Callable[[torch.Tensor], torch.Tensor] | None
DType = torch.dtype | str | None
REDUCTIONS = ("mean", "max", "flatten", "cls", "last")


def _pool_dims(t: torch.Tensor) -> tuple[int, ...]:
    """All dims but batch and channel: channel is dim 1 for >= 4-D, the last dim for 3-D tokens."""
    if t.dim() >= 4:
        return tuple(range(2, t.dim()))
    if t.dim() == 3:
        return (1,)
    return ()


def _mean(t: torch.Tensor) -> torch.Tensor:
    dims = _pool_dims(t)
    return t.mean(dim=dims) if dims else t


def _max(t: torch.Tensor) -> torch.Tensor:
    dims = _pool_dims(t)
    return t.amax(dim=dims) if dims else t


def _flatten(t: torch.Tensor) -> torch.Tensor:
    return t.flatten(1) if t.dim() > 2 else t


def _token(position: int, name: str) -> Callable[[torch.Tensor], torch.Tensor]:
    def pick(t: torch.Tensor) -> torch.Tensor:
        if t.dim() > 3:
            raise ValueError(
                f"reduce={name!r} takes one token of a [batch, tokens, dim] tensor, got shape {list(t.shape)}; "
                "use reduce='mean' for feature maps"
            )
        return t[:, position] if t.dim() == 3 else t  # 2-D leaves (a pooler output) are already one vector

    return pick


def _honouring_mask(how: str, unmasked: Callable[[torch.Tensor], torch.Tensor]) -> Callable[[torch.Tensor], torch.Tensor]:
    """``unmasked``, but over the real tokens only where the running call's mask fits the tensor."""

    def pool(t: torch.Tensor) -> torch.Tensor:
        out = masks.pooled(t, how)
        return unmasked(t) if out is None else out

    return pool


_TABLE = {
    "mean": _honouring_mask("mean", _mean),
    "max": _honouring_mask("max", _max),
    "flatten": _flatten,
    "cls": _honouring_mask("cls", _token(0, "cls")),
    "last": _honouring_mask("last", _token(-1, "last")),
}


def reducer(reduce: Reduce) -> Callable[[torch.Tensor], torch.Tensor] | None:
    """The function for a ``reduce=`` argument (``None`` for no reduction).

    ``"mean"`` and ``"max"`` pool all dims but batch and channel (dim 1 of a feature map, the last
    of a ``[B, T, C]`` token tensor); ``"cls"`` and ``"last"`` take token 0 and the last token. Under
    a ``[B, T]`` ``attention_mask`` a token tensor is reduced over its real tokens only: ``"cls"``
    is then the first real token and ``"last"`` the last, whatever the padding side (see
    `layertap.tap.masks`). A callable gets the tensor as it is.

    >>> import torch
    >>> reducer("last")(torch.arange(6.0).view(1, 3, 2)).tolist()   # no model call running: no mask
    [[4.0, 5.0]]
    """
    if reduce is None or callable(reduce):
        return reduce
    if reduce not in _TABLE:
        raise ArgumentError(f"unknown reduce={reduce!r}: use one of {REDUCTIONS} or a callable")
    return _TABLE[reduce]


def as_dtype(dtype: DType) -> torch.dtype | None:
    """The ``torch.dtype`` for a ``dtype=`` argument: a dtype, or its name (``"float16"``, ``"torch.float16"``)."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    found = getattr(torch, dtype.removeprefix("torch."), None) if isinstance(dtype, str) else None
    if not isinstance(found, torch.dtype):
        raise ArgumentError(f"unknown dtype={dtype!r}: use a torch dtype or its name, e.g. torch.float16 or 'float16'")
    return found


def shares_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Whether ``a`` and ``b`` live in the same storage (so an in-place op on one changes the other)."""
    if a.device != b.device or type(a).__name__ == "DTensor" or type(b).__name__ == "DTensor":
        return False  # a DTensor is only ever kept as a copy (layertap.tap.sharded)
    if a.layout != torch.strided or b.layout != torch.strided:  # sparse: no storage to compare; may share (its values)
        return True
    return a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()


_COMPLEX = {torch.float16: torch.complex32, torch.float32: torch.complex64, torch.float64: torch.complex128}


def make_transform(
    *,
    detach: bool = True,
    to: torch.device | str | None = None,
    dtype: DType = None,
    reduce: Reduce = None,
    whole: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Callable[[torch.Tensor], torch.Tensor]:
    """One function applying the controls in the cheapest order: detach, reduce, cast, move.

    ``whole`` comes first: a tensor-parallel part made whole (`layertap.tap.sharded`).

    A reduction that returns a view (``cls``) is copied, so that the small result does not keep
    the whole activation alive.
    """
    pool = reducer(reduce)
    dtype = as_dtype(dtype)  # a string would reach Tensor.to as a device name
    if dtype is not None and not dtype.is_floating_point:
        raise ArgumentError(f"dtype={dtype} is not a floating-point dtype: pass one (torch.float16, torch.bfloat16, torch.float32) or None")
    as_complex = None if dtype is None else _COMPLEX.get(dtype)  # complex values keep their imaginary part, at this precision
    device = torch.device(to) if to is not None else None

    def transform(t: torch.Tensor) -> torch.Tensor:
        if whole is not None:
            t = whole(t)
        src = t
        if detach:
            t = t.detach()
        floating = t.is_floating_point() or t.is_complex()
        if pool is not None and floating:
            t = pool(t)
            if shares_memory(t, src):
                t = t.clone()
        if dtype is not None and floating:
            t = t.to(dtype if not t.is_complex() else as_complex or t.dtype)
        if device is not None:
            t = t.to(device)
        return t

    return transform


def capture_failed(what: str, name: str, module: torch.nn.Module, exc: Exception, value: Any, observing: bool) -> TapError:
    """The error for the tap's own work failing inside a hook, e.g. a value it cannot rebuild
    (or the ``observe=`` function failing, when there is one)."""
    # under vmap/grad the layer sees wrapped tensors, which have no memory of their own to copy
    peek = getattr(torch._C._functorch, "peek_interpreter_stack", None)
    if peek is not None and peek() is not None:
        fix = "it ran inside a torch.func transform (vmap, grad, jacrev...), whose tensors cannot leave it: call the model outside the transform while it is tapped"
    elif any(t.is_nested for t in nested.tensors(value)):
        fix = (
            "its value is a nested tensor (nn.TransformerEncoder's fast path in eval with a padding mask), "
            "which cannot be reduced or read as one: build the encoder with enable_nested_tensor=False, or tap another layer"
        )
    else:
        fix = f"change to=, dtype= or reduce={', or the observe= function' if observing else ''}, or tap another layer"
    return TapError(f"layertap could not capture the {what} of layer {name!r} ({type(module).__name__}); {fix}. {type(exc).__name__}: {exc}")
