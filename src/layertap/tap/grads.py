"""Gradient taps: the hooks that capture ``grad`` and ``grad_input``, and what they hook.

- One definition of a gradient. ``grad`` is the gradient that flows back through the layer's
  output edge (into what the layer returned, from what reads it downstream), ``grad_input`` the
  one that flows into its input through the layer alone: what ``register_full_backward_hook``
  calls ``grad_output`` and ``grad_input``. A tensor's own gradient is the sum over all its
  reads, so a hook on the tensor itself is wrong wherever it is read elsewhere too: ResNet's
  block input, read by the shortcut as well; an ``nn.Identity``, whose output is its input; a
  layer that returns ``h`` and also reads it (``return h, head(h)``). So each hook goes on a
  tensor that carries only its edge: the layer is given, in its forward pre-hook, a no-op
  identity of each input (``_Alias``: not a view, the same memory and version counter, no copy),
  and returns downstream such an identity of each output. A leaf (the caller's input, a
  parameter) gets a view instead: a hook on it would outlive the tap, and neither it nor its
  views can be changed in place. A tensor that needs no gradient gets an identity of a new leaf.
  All are made by this forward, so their hooks go with its graph: nothing stays on the caller's
  tensors. The exception: an input the layer changed in place and returned (``ReLU(inplace=True)``)
  is hooked as it is, as every later read of it reads the output (``relu_(x)`` used as a
  statement still gets its gradient).
- Gradients come from ``Tensor.register_hook``, never from full backward hooks, which wrap
  inputs and outputs in views that break when an in-place op follows the layer. A hook on a
  tensor changed in place later still receives the gradient of the value it had (fact 9); a
  view would lose it, hence identities rather than views. A layer that changes its input in
  place changes it through the identity, so the caller's tensor would hold the new values with
  the old history: after the call the tap gives it the layer's history, by ``copy_`` from the
  identity, which moves no data (the same memory), and sets the version counter back, as the
  values saved for backward did not change. The one case left: a later in-place op on what a
  layer returned while the tensor it came from is read again after that op (a layer returning
  its input, itself read again later); that read misses the in-place op's gradient. A gradient
  kept as it came is copied: if it flows on unchanged into a leaf, it becomes that leaf's
  ``.grad``, which later backwards add to in place. Only gradient taps pay for any of this (an
  identity per tapped tensor, about what a full backward hook costs); output capture alone
  adds nothing.
"""

from __future__ import annotations

import itertools
import threading
import warnings
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from .. import nested
from ..errors import LayerNotRunError, TapError
from .controls import shares_memory


class _Alias(torch.autograd.Function):
    """``x`` as a new tensor that is not a view: the same memory and version counter (``detach``
    shares both), its own node in the graph; the gradient passes through unchanged."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.detach()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def _set_version(t: torch.Tensor, version: int) -> None:
    """Set the version counter ``t`` shares (private API; its signature changed in PyTorch 2.5)."""
    setter = getattr(torch._C._autograd, "_unsafe_set_version_counter", None)
    if setter is None:
        raise TapError(
            "capture='grad_input' of a layer that changes its input in place needs PyTorch >= 2.3: "
            "upgrade torch, or tap the layer before it with capture='grad'"
        )
    try:
        setter((t,), (version,))
    except TypeError:
        setter(t, version)


class Call:
    """One running call of a layer whose gradients are tapped: the tensors it was given and their
    versions (by id), and the inputs replaced by aliases, to rebase if the layer changes them in place."""

    __slots__ = ("given", "inputs", "swaps")

    def __init__(self) -> None:
        self.given: dict[int, int] = {}
        self.inputs: list[torch.Tensor] = []
        self.swaps: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def saw(self, value: Any) -> None:
        # inference tensors have no version (the tap then refuses gradients, naming the mode)
        self.inputs = [t for t in nested.tensors(value) if not t.is_inference()]
        self.given = {id(t): t._version for t in self.inputs}

    def passed_on(self, t: torch.Tensor) -> bool:
        """Whether ``t``, returned by the layer, is (a view of) one of its inputs that carries a
        gradient, unchanged."""
        return any(i.requires_grad and shares_memory(t, i) and self.given[id(i)] == i._version for i in self.inputs)

    def rebase(self) -> None:
        """After the call: a tensor the layer changed in place through its alias gets that history too."""
        for original, alias, version in reversed(self.swaps):  # an alias of an alias first
            now = alias._version
            if now != version:
                original.copy_(alias)  # the same memory: no data moves, and original's graph now runs through the layer
                _set_version(original, now)  # copy_ counted as a write; the values saved for backward are unchanged
        self.swaps.clear()


def _grown(t: torch.Tensor) -> torch.Tensor:
    # through an alias, as `_hookable`: an in-place op after the layer must not meet a bare leaf
    return _Alias.apply(t.detach().requires_grad_()) if (t.is_floating_point() or t.is_complex()) and not t.requires_grad else t


def required(value: Any) -> Any:
    """``value`` with each floating-point tensor that needs no gradient made a leaf that does, as
    `_hookable` makes it for a gradient hook: a checkpoint's recomputation of a gradient-tapped
    layer must see that too, or its ops save other tensors than the first pass's (the checkpoint
    then fails: "a different number of tensors was saved")."""
    return nested.map_leaves(_grown, value)


def _hookable(t: torch.Tensor, kind: str, call: Call) -> torch.Tensor:
    """The tensor to hook for the gradient on one edge of a layer, used downstream of the hook in
    place of ``t`` (see the module docstring: the gradient of that edge alone, in-place safe)."""
    if not t.requires_grad:  # nothing upstream needs a graph: a new leaf loses nothing
        return _Alias.apply(t.detach().requires_grad_())
    if t.grad_fn is None:  # a leaf: hook a view of it, so nothing stays on the leaf
        return t.view_as(t)
    if kind == "grad" and call.given.get(id(t), t._version) != t._version:
        # the layer changed its input in place and returned it: every later read of it is of the output
        return t
    alias = _Alias.apply(t)  # only the layer (an input) or the layer's caller (an output) reads it
    if kind == "grad_input":
        call.swaps.append((t, alias, alias._version))
    return alias


class _Passing(threading.local):
    """One thread's tensors that layers passed on of their input: ``(layer, tensor, version)``."""

    def __init__(self) -> None:
        self.passed: list[tuple[str, torch.Tensor, int]] = []


class _Slot:
    """Where a tensor stood in a nested value (a plain class: pytree would open a tuple)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class Gradients:
    """The gradients of one call's tensors, filled by tensor hooks as backward reaches them."""

    __slots__ = ("skeleton", "slots", "stored")

    def __init__(self, skeleton: Any, size: int) -> None:
        self.skeleton = skeleton
        self.slots: list[Any] = [None] * size
        self.stored = False  # stored once; later tensors' gradients fill the same object

    @property
    def received(self) -> bool:
        return any(g is not None for g in self.slots)

    def value(self) -> Any:
        """The gradients in the call's structure; ``None`` if no backward reached the call."""
        if not self.received:
            return None
        return nested.map_leaves(lambda s: self.slots[s.index], self.skeleton, leaf=_Slot)


# where a call's gradients go: (kind, name, call index, the entry, replica part or None)
Put = Callable[[str, str, int, Gradients, "int | None"], None]


class Grads:
    """A tap's gradient hooks: the running calls of its layers, and hooks on the tensors of each edge."""

    def __init__(self, transform: Callable[[torch.Tensor], torch.Tensor], observe: Any, keep: str, put: Put) -> None:
        self._transform = transform
        self._observe = observe
        self._keep = keep
        self._put = put
        # (name, id(module)) -> the running calls of a layer whose gradients are tapped, innermost last
        self.open: dict[tuple[str, int], list[Call]] = {}
        # what layers passed on of their input in this thread's forward, and its version then
        # (`forward_ended`; per thread: nn.DataParallel's replicas each run a forward)
        self._passing = _Passing()
        self._warned: set[str] = set()
        self._floatless: dict[tuple[str, str], list[str]] = {}  # (kind, name) -> the dtypes of a last call with no float to hook

    def check_floats(self, kind: str, name: str) -> None:
        """Raise for a layer none of whose calls had a floating-point tensor on that edge: no gradient can reach it."""
        dtypes = self._floatless.get((kind, name))
        if dtypes is not None:
            edge = "output" if kind == "grad" else "input"
            raise LayerNotRunError(
                f"layer {name!r} has no {kind}: its {edge} holds no floating-point tensor ({', '.join(dtypes) or 'none'}), "
                f"so no gradient flows through it; tap a layer whose {edge} is floating-point"
            )

    def forward_started(self) -> None:
        self.open.clear()  # calls a raising forward left open
        self._passing.passed.clear()

    def forward_ended(self) -> None:
        """Warn once per layer whose passed-on input an in-place op changed later in the forward.

        The one case the aliases cannot keep exact (see the module docstring): the tensor the
        layer was given is also read downstream, and that read carries the history before the
        in-place op, so the model's own gradients would differ while tapped."""
        passed = self._passing.passed
        for name, t, version in passed:
            if t._version != version and name not in self._warned:
                self._warned.add(name)
                warnings.warn(
                    f"layertap: layer {name!r} returned (a view of) its input, and the forward changed it in place "
                    "afterwards: while its gradient is tapped, a later read of the tensor the layer was given misses "
                    "that in-place op's gradient, so the model's own gradients may differ. Tap the layer before "
                    "or after it instead, or capture outputs only",
                    stacklevel=2,
                )
        passed.clear()

    def opened(self, name: str, module: nn.Module, call: Call) -> None:
        """``call`` of layer ``name`` started (its pre-hook saw what it was given)."""
        self.open.setdefault((name, id(module)), []).append(call)

    def closed(self, name: str, module: nn.Module, output: Any) -> Call:
        """The call its pre-hook opened, now ended: rebased onto what the layer changed in place."""
        calls = self.open.get((name, id(module)))
        call = calls.pop() if calls else Call()
        call.rebase()
        self.passed(name, call, output)
        return call

    def passed(self, name: str, call: Call, value: Any) -> None:
        """Note the tensors of ``value`` that a layer passed on of its input (`forward_ended` checks them)."""
        if call.inputs:
            self._passing.passed += [(name, t, t._version) for t in nested.tensors(value) if call.passed_on(t)]

    def watch(
        self, kind: str, name: str, index: int, value: Any, part: int | None, call: Call, wanted: bool, put: bool = True
    ) -> tuple[Any, Gradients | None]:
        """Register gradient hooks on the tensors of ``value``; returns it, with the tensors that
        carry the hooks in place of its own, and the entry the gradients fill (None if not kept).
        ``wanted``: the keep policy keeps this call. ``put=False``: the caller stores a
        ``keep='all'`` entry itself."""
        if not torch.is_grad_enabled():
            raise TapError(
                f"capture={kind!r} needs autograd, but layer {name!r} ran without it: under torch.no_grad(), "
                "torch.inference_mode(), or in the first pass of a checkpoint with use_reentrant=True: run the forward "
                "with autograd, and checkpoint with use_reentrant=False (Hugging Face's default; older versions took "
                "gradient_checkpointing_kwargs={'use_reentrant': False})"
            )
        observe = self._observe
        if observe is None and not wanted:
            return value, None
        counter = itertools.count()
        skeleton = nested.map_leaves(lambda t: _Slot(next(counter)), value)
        grads = Gradients(skeleton, next(counter))
        store = self._put
        if put and self._keep == "all" and observe is None:  # one entry per call, in call order; None until a backward reaches it
            grads.stored = True
            store(kind, name, index, grads, part)
        transform = self._transform
        slot = itertools.count()
        others: set[str] = set()  # the dtypes of the tensors no gradient reaches
        hooked = [0]  # the tensors one does

        def watch(t: torch.Tensor) -> torch.Tensor:
            i = next(slot)
            if not (t.is_floating_point() or t.is_complex()):
                others.add(str(t.dtype).removeprefix("torch."))
                return t
            hooked[0] += 1
            t = _hookable(t, kind, call)

            def on_grad(g: torch.Tensor) -> None:
                kept = transform(g)
                if observe is not None:  # each tensor's gradient as backward reaches it
                    observe(name, kind, index, kept)
                    return
                # a gradient that flows on unchanged into a leaf becomes its .grad, which later
                # backwards add to in place: keep a copy (a reduced, cast or moved one is fresh)
                grads.slots[i] = kept.clone() if shares_memory(kept, g) else kept
                if not grads.stored:
                    grads.stored = True
                    store(kind, name, index, grads, part)

            t.register_hook(on_grad)
            return t

        watched = nested.map_leaves(watch, value)
        if hooked[0]:
            self._floatless.pop((kind, name), None)
        else:
            self._floatless[(kind, name)] = sorted(others)
        return watched, (grads if observe is None else None)
