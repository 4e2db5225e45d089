"""The attention mask of the running model call, and the reductions of token tensors that honour it.

A padded batch of texts holds padding tokens whose activations belong to no document: pooled in,
they make a document's feature depend on its batch-mates. The mask comes from the model's inputs.

- `watch` hooks the tapped model for a tap's lifetime (``model.module`` of an
  ``nn.DataParallel``, whose replicas run its hooks, each in a thread of its own, on their part
  of the batch): while a call runs, its ``attention_mask`` (a keyword, the positional argument of
  the forward's parameter of that name, or an entry of a dict given as the first argument) is
  the running mask of the thread that runs it. The state is per thread, so a model run by
  several threads at once has one mask per call.
- A model may hold several token streams: an encoder-decoder's decoder, CLIP's vision tower,
  with their own lengths, often equal to the text's. So the modules on the way from the model to
  each tapped layer that start a stream (whose forward takes ``input_ids``, ``inputs_embeds``,
  ``pixel_values``, ``input_features`` or ``input_values``: an encoder, a decoder, a vision
  tower) are hooked too, and the innermost running one that says decides: its
  ``attention_mask``, or none (BART's decoder called with ``attention_mask=None``, CLIP's vision
  tower, which takes pixels and no mask). An embedding layer (ids, no mask) is its caller's
  stream; an attention module's own ``attention_mask`` decides nothing: it masks keys, another
  stream's in cross-attention. Nor does a 4-D mask, made for attention from the 2-D one, nor a
  floating-point 2-D mask below the model (an additive bias): the caller's mask still holds; and
  a mask of another shape than the tensor's is passed over. Cost: two hooks on each such module.
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
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .ops import hidden


class _Call:
    """One running call of a watched module: whether it decides the mask (given ``attention_mask``,
    or ``None`` for none), the mask as given, and as booleans once asked for."""

    __slots__ = ("decides", "given", "owner", "real")

    def __init__(self, owner: _Watch, decides: bool, given: torch.Tensor | None) -> None:
        self.owner, self.decides, self.given = owner, decides, given
        self.real: torch.Tensor | None = None


class _Running(threading.local):
    """This thread's running calls of watched modules, innermost last."""

    def __init__(self) -> None:
        self.calls: list[_Call] = []


_RUNNING = _Running()


class _Parameter(NamedTuple):
    """How a forward takes ``attention_mask``: its position (None: not positionally), whether it
    names the parameter, whether ``**kwargs`` may carry it, and whether the forward starts a token
    stream (it takes a model's input: `_ENTRIES`)."""

    at: int | None
    named: bool
    var_keyword: bool
    entry: str  # "text", "signal" (pixels, audio) or ""


_NONE = _Parameter(None, False, False, "")
# what a module that starts a stream of tokens takes: an encoder, a decoder (text); a vision or audio tower (signal)
_ENTRIES = {"input_ids": "text", "inputs_embeds": "text", "pixel_values": "signal", "input_features": "signal", "input_values": "signal"}
_PARAMETERS: weakref.WeakKeyDictionary[Any, _Parameter] = weakref.WeakKeyDictionary()


def _parameter(module: nn.Module) -> _Parameter:
    """How ``module``'s forward takes ``attention_mask`` (``BertModel.forward(input_ids,
    attention_mask, ...)``: position 1); read once per forward function (a tap entered batch after
    batch would read the signature each time; a class whose forward is patched gets the new one's)."""
    forward = module.__dict__.get("forward") or type(module).forward  # an instance's own (an op tap's wrapper) first
    try:
        return _PARAMETERS[forward]
    except (KeyError, TypeError):
        pass
    try:
        parameters = list(inspect.signature(module.forward).parameters.values())
    except (TypeError, ValueError):  # a forward without a signature Python can read
        parameters = []
    found = _NONE
    for i, p in enumerate(parameters):
        if p.name == "attention_mask" and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY):
            positional = p.kind != p.KEYWORD_ONLY and all(q.kind in (q.POSITIONAL_ONLY, q.POSITIONAL_OR_KEYWORD) for q in parameters[:i])
            found = found._replace(at=i if positional else None, named=True)
        elif p.kind == p.VAR_KEYWORD:
            found = found._replace(var_keyword=True)
        elif p.name in _ENTRIES and found.entry != "text":
            found = found._replace(entry=_ENTRIES[p.name])
    with contextlib.suppress(TypeError):  # a callable that takes no weak reference: read each time
        _PARAMETERS[forward] = found
    return found


_UNSET = object()


def _decision(args: tuple, kwargs: dict, parameter: _Parameter, root: bool) -> tuple[bool, torch.Tensor | None]:
    """Whether a call decides the running mask, and the ``[B, T]`` mask it gives (None: none).

    The model decides, and so do the modules that start a stream of tokens, given a mask or
    taking one (an encoder, a decoder called with ``attention_mask=None``), or taking pixels or
    audio (a vision tower, which has none). An embedding layer (ids, no mask) is its caller's
    stream; an attention module's ``attention_mask`` masks its keys, another stream's in
    cross-attention: neither decides. Nor does a 4-D mask (made for attention from the 2-D one),
    nor a floating-point 2-D one below the model (an additive bias): the caller's mask holds."""
    if not (root or parameter.entry):
        return False, None
    mask: Any = kwargs.get("attention_mask", _UNSET)
    if mask is _UNSET and parameter.at is not None and len(args) > parameter.at:
        mask = args[parameter.at]
    if mask is _UNSET and root and args and isinstance(args[0], Mapping):
        mask = args[0].get("attention_mask", _UNSET)
    if mask is _UNSET:  # called without a mask: none, for a stream that could have had one or has none
        return (True, None) if root or parameter.named or parameter.entry == "signal" else (False, None)
    if mask is None:
        return True, None
    if isinstance(mask, torch.Tensor) and mask.dim() == 2 and (root or not mask.is_floating_point()):
        return True, mask
    return False, None


class _Watch:
    """The hooks of one tap on its model and the modules around its layers. A ``KeyboardInterrupt``
    skips the end hooks (``always_call`` covers ``Exception`` only), so calls may stay behind: they
    count only while the watch is still hooked, and its model's next call drops them."""

    def __init__(self) -> None:
        self.handle: RemovableHandle | None = None  # of the model's start hook

    def hooked(self) -> bool:
        handle = self.handle
        if handle is None:
            return False
        hooks = handle.hooks_dict_ref()
        return hooks is not None and handle.id in hooks

    def hook(self, module: nn.Module, root: bool) -> list[RemovableHandle]:
        parameter = _parameter(module)

        def started(module: nn.Module, args: tuple, kwargs: dict) -> None:
            calls = _RUNNING.calls
            if root:
                calls[:] = [c for c in calls if c.owner is not self and c.owner.hooked()]  # calls left behind
            calls.append(_Call(self, *_decision(args, kwargs, parameter, root)))

        start = module.register_forward_pre_hook(hidden(started), with_kwargs=True, prepend=True)
        if root:
            self.handle = start
        return [start, module.register_forward_hook(hidden(self.ended), always_call=True)]

    def ended(self, module: nn.Module, args: tuple, output: Any) -> None:
        calls = _RUNNING.calls
        for i in range(len(calls) - 1, -1, -1):
            if calls[i].owner is self:
                del calls[i]
                return


def _target(model: nn.Module) -> nn.Module:
    return model.module if isinstance(model, nn.DataParallel) else model


def around(model: nn.Module, layers: Mapping[str, nn.Module], inner: Iterable[str], aliases: Any) -> list[nn.Module]:
    """The modules below ``model`` that start a stream of tokens on the way to each of ``inner``
    (the names of the tapped layers and the ops' owners), those included: found once per tap from
    the selection's index of ``layers`` (no walk of the model), along every name a module has
    (``aliases(name)``: one shared by an encoder and a decoder has one for each)."""
    root = _target(model)
    found: dict[int, nn.Module] = {}
    for name in inner:
        for alias in aliases(name):
            parts = alias.split(".") if alias else []
            found.update((id(m), m) for k in range(1, len(parts) + 1) if (m := layers.get(".".join(parts[:k]))) is not None)
    return [m for m in found.values() if m is not root and _parameter(m).entry]


def watch(model: nn.Module, inner: list[nn.Module]) -> list[RemovableHandle]:
    """Hooks that make a call's ``attention_mask`` the running mask while the call runs: the
    model's, and that of each of ``inner`` (`around`).

    Register them after the tap's own hooks: the mask is then running from before the first of
    them to after the last (a tapped module's input and output are reduced under its own mask).
    """
    watcher = _Watch()
    handles = watcher.hook(_target(model), root=True)
    for module in inner:
        handles += watcher.hook(module, root=False)
    return handles


def real_tokens(batch: int, length: int) -> torch.Tensor | None:
    """The running mask as a bool ``[batch, length]`` tensor: that of the innermost running call
    that decides one with that shape (a call given none ends the search: its tokens have none);
    else None. A mask of another shape (a causal ``[T, T]`` one, another stream's) is passed over."""
    for call in reversed(_RUNNING.calls):
        if not call.decides or not call.owner.hooked():
            continue
        given = call.given
        if given is None:
            return None
        if given.shape != (batch, length):
            continue
        if call.real is None:
            call.real = given if given.dtype == torch.bool else given != 0
        return call.real
    return None


def _pads(batch: int, length: int) -> bool | None:
    """Whether a running ``[batch, length]`` mask hides a token (None: no such mask runs)."""
    real = real_tokens(batch, length)
    return None if real is None else not bool(real.all())


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
        # a feature map's pooled dims (all past 1): one as long as a running mask that pads is taken for tokens
        # (an attention op's [B, heads, T, head dim]); not with tokens on dim 1, which pooling keeps apart
        padded = [d for d in range(2, t.dim()) if t.dim() > 3 and _pads(t.size(0), t.size(d)) and _pads(t.size(0), t.size(1)) is None]
        if padded:
            raise ValueError(
                f"reduce={how!r} would pool the padding of the running [batch, {t.size(padded[0])}] attention_mask into "
                f"a tensor of shape {list(t.shape)} (tokens on dim {padded[0]}, not 1): tap it without reduce= and pool "
                "its real tokens yourself, or pass a function as reduce="
            )
        return None
    real = real.to(t.device)
    if how == "mean":
        return torch.where(real[..., None], t, 0).sum(1) / real.sum(1, keepdim=True)
    if how == "max":
        return torch.where(real[..., None], t, float("-inf")).amax(1)
    at = first_real(real) if how == "cls" else last_real(real)
    return t[torch.arange(t.size(0), device=t.device), at]  # indexing copies: no view of the whole activation
