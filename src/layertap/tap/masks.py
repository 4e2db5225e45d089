"""The attention mask of the running model call, and the reductions of token tensors that honour it.

A padded batch of texts holds padding tokens whose activations belong to no document: pooled in,
they make a document's feature depend on its batch-mates. The mask comes from the model's inputs.

- `watch` hooks the tapped model for a tap's lifetime (``model.module`` of an
  ``nn.DataParallel``, whose replicas run its hooks, each in a thread of its own, on their part
  of the batch): while a call runs, its ``attention_mask`` (a keyword, the positional argument of
  the forward's parameter of that name, or an entry of a dict given as the first argument) is the running mask of the thread that runs it. The state is per thread,
  so a model run by several threads at once has one mask per call. Calls nest (a tapped model
  inside another tapped one): the innermost mask that fits is used.
- `real_tokens(batch, length)` is the running mask as booleans if it is ``[batch, length]``, else
  None: only a 2-D mask of exactly that shape counts, so a vision model, a pooled output or a
  sequence the model lengthened (a prepended token) are reduced as before. A nonzero entry is a
  real token, as in Hugging Face's ``attention_mask``.
- `pooled` reduces a ``[B, T, C]`` tensor over the real tokens only: ``"mean"``/``"max"`` over
  them, ``"cls"`` the first real token (token 0, or the first after a left padding), ``"last"``
  the last real token whatever the padding side. A row without a real token gives NaN (mean),
  -inf (max), token 0 (cls) or token T - 1 (last).

>>> import torch
>>> from torch import nn
>>> import layertap
>>> class Tokens(nn.Module):
...     def forward(self, input_ids, attention_mask):
...         return input_ids[..., None].float()
>>> ids, mask = torch.tensor([[1, 2, 3], [4, 5, 0]]), torch.tensor([[1, 1, 1], [1, 1, 0]])
>>> with layertap.tap(Tokens(), "", reduce="mean") as t:
...     _ = t.model(ids, attention_mask=mask)
>>> t[""].flatten().tolist()   # the pad of the second row is left out: (4 + 5) / 2
[2.0, 4.5]
"""

from __future__ import annotations

import contextlib
import inspect
import threading
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .ops import hidden


class _Call:
    """One running call of a watched model: its mask as given, and as booleans once asked for."""

    __slots__ = ("given", "owner", "real")

    def __init__(self, owner: _Watch, given: torch.Tensor | None) -> None:
        self.owner, self.given = owner, given
        self.real: torch.Tensor | None = None


class _Running(threading.local):
    """This thread's running calls of watched models, innermost last."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []


_RUNNING = _Running()


def _mask_of(args: tuple, kwargs: dict, at: int | None) -> torch.Tensor | None:
    mask = kwargs.get("attention_mask")
    if mask is None and at is not None and len(args) > at:
        mask = args[at]
    if mask is None and args and isinstance(args[0], Mapping):
        mask = args[0].get("attention_mask")
    return mask if isinstance(mask, torch.Tensor) and mask.dim() == 2 else None


_POSITIONS: weakref.WeakKeyDictionary[Any, int | None] = weakref.WeakKeyDictionary()


def _position(model: nn.Module) -> int | None:
    """Where ``model(ids, mask)`` passes ``attention_mask`` positionally: its forward's parameter of
    that name (``BertModel.forward(input_ids, attention_mask, ...)``), or None; read once per
    forward function (a tap entered batch after batch would read the signature each time; a class
    whose forward is patched gets the new one's)."""
    forward = model.__dict__.get("forward") or type(model).forward  # an instance's own (an op tap's wrapper) first
    try:
        return _POSITIONS[forward]
    except (KeyError, TypeError):
        pass
    try:
        parameters = list(inspect.signature(model.forward).parameters.values())
    except (TypeError, ValueError):  # a forward without a signature Python can read
        parameters = []
    at = _find(parameters)
    with contextlib.suppress(TypeError):  # a callable that takes no weak reference: read each time
        _POSITIONS[forward] = at
    return at


def _find(parameters: list[inspect.Parameter]) -> int | None:
    for i, p in enumerate(parameters):
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            return None
        if p.name == "attention_mask":
            return i
    return None


class _Watch:
    """The hooks of one tap on its model. A ``KeyboardInterrupt`` skips the end hook (``always_call``
    covers ``Exception`` only), so a call may stay behind: it counts only while its watch is still
    hooked, and the watch's next call drops it."""

    def __init__(self, at: int | None) -> None:
        self.handle: RemovableHandle | None = None
        self.at = at  # the position of the forward's attention_mask parameter

    def hooked(self) -> bool:
        handle = self.handle
        if handle is None:
            return False
        hooks = handle.hooks_dict_ref()
        return hooks is not None and handle.id in hooks

    def started(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        calls = _RUNNING.calls
        calls[:] = [c for c in calls if c.owner is not self and c.owner.hooked()]  # calls left behind
        calls.append(_Call(self, _mask_of(args, kwargs, self.at)))

    def ended(self, module: nn.Module, args: tuple, output: Any) -> None:
        calls = _RUNNING.calls
        for i in range(len(calls) - 1, -1, -1):
            if calls[i].owner is self:
                del calls[i]
                return


def watch(model: nn.Module) -> list[RemovableHandle]:
    """Hooks that make each call's ``attention_mask`` the running mask while the call runs.

    Register them after the tap's own hooks on ``model``: the mask is then running from before the
    first of them to after the last (a tapped root's input and output are reduced under it).
    """
    target = model.module if isinstance(model, nn.DataParallel) else model
    watcher = _Watch(_position(target))
    watcher.handle = target.register_forward_pre_hook(hidden(watcher.started), with_kwargs=True, prepend=True)
    return [watcher.handle, target.register_forward_hook(hidden(watcher.ended), always_call=True)]


def real_tokens(batch: int, length: int) -> torch.Tensor | None:
    """The running mask as a bool ``[batch, length]`` tensor, if the innermost call with a mask of
    that shape has one; else None."""
    for call in reversed(_RUNNING.calls):
        given = call.given
        if given is None or given.shape != (batch, length) or not call.owner.hooked():
            continue
        if call.real is None:
            call.real = given if given.dtype == torch.bool else given != 0
        return call.real
    return None


def first_real(real: torch.Tensor) -> torch.Tensor:
    """The position of each row's first real token (0 for a row without one)."""
    return real.to(torch.uint8).argmax(1)  # argmax gives the first of equal maxima


def last_real(real: torch.Tensor) -> torch.Tensor:
    """The position of each row's last real token (the last position for a row without one)."""
    return real.size(1) - 1 - real.flip(1).to(torch.uint8).argmax(1)


def pooled(t: torch.Tensor, how: str) -> torch.Tensor | None:
    """``t`` ``[B, T, C]`` reduced over its real tokens (``how``: mean, max, cls or last), or None if
    no running mask is ``[B, T]``."""
    real = real_tokens(t.size(0), t.size(1)) if t.dim() == 3 else None
    if real is None:
        return None
    real = real.to(t.device)
    if how == "mean":
        return torch.where(real[..., None], t, 0).sum(1) / real.sum(1, keepdim=True)
    if how == "max":
        return torch.where(real[..., None], t, float("-inf")).amax(1)
    at = first_real(real) if how == "cls" else last_real(real)
    return t[torch.arange(t.size(0), device=t.device), at]  # indexing copies: no view of the whole activation
