"""Which layer first made a NaN or an Inf, in the forward or in the backward.

>>> import torch, layertap
>>> class Log(torch.nn.Module):
...     def forward(self, x):
...         return torch.log(x)
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), Log(), torch.nn.Linear(4, 2))
>>> report = layertap.find_nonfinite(model, torch.randn(8, 4))
>>> report.phase, report.layer, report.module_type
('forward', '1', 'Log')

Every module is tapped (the model itself too, for what its own ``forward`` computes between
submodules); the tap hands each tensor to an observer (``observe=``), which checks it inside the
hook and keeps only a small summary, never the activations. A module's hook runs when it
returns, so of nested modules the innermost one that made the value comes first. Ops inside a
module's ``forward`` can be checked too (``layers=[nn.Module, "block:*"]``, see
`layertap.select`): an op returns before its module does, so the op that made a NaN is named
(``"block:log#1"``) before the module that returned it. Gradients are watched with tensor hooks
on the layers' outputs (no module backward hooks, which break on in-place ops).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Literal, NamedTuple, overload

import torch
from torch import nn

from . import nested
from .runtime import run_model, running
from .select import Layers, Selection, owner, selection
from .stats import LayerStats
from .tap import Kind, Tap, tap
from .tensorstats import TensorStats, tensor_stats

Phase = Literal["forward", "backward"]


@dataclasses.dataclass(frozen=True)
class NonfiniteReport:
    """Where a non-finite value first appeared.

    Attributes:
        phase: ``"forward"`` (a layer's output) or ``"backward"`` (the gradient of the loss with
            respect to a layer's output).
        layer, module_type, call: the layer (``""`` is the model itself) or op, the class of the
            module (for an op, of the module whose forward called it), and which of its calls
            (0 = first) since the check started.
        value: statistics of the non-finite tensor: the output, or the gradient.
        inputs: statistics of the layer's floating-point inputs in that call of the forward.
        previous: the layer that came just before in the same order, with its output (forward)
            or gradient (backward); ``None`` for the first.
    """

    phase: Phase
    layer: str
    module_type: str
    call: int
    value: LayerStats
    inputs: list[LayerStats]
    previous: LayerStats | None

    def __str__(self) -> str:
        where = (
            f"layer {self.layer!r} ({self.module_type}, call {self.call})"
            if self.layer
            else f"the model's own forward ({self.module_type})"
        )
        what = "output" if self.phase == "forward" else "output gradient"
        lines = [f"{self.phase}: {where} is the first whose {what} holds non-finite values: {_describe(self.value)}"]
        lines += [f"  input {i}: {_describe(s)}" for i, s in enumerate(self.inputs)]
        if self.phase == "forward" and any(s.nonfinite_fraction for s in self.inputs):
            lines.append(
                "  its input was already non-finite: the value was made outside any module (a functional op "
                "in the parent's forward, or the model's input); check the parent's ops too: layers=[..., 'PARENT:*']"
            )
        if self.previous is not None:
            kind = "output" if self.phase == "forward" else "gradient"
            lines.append(
                f"  previous layer {self.previous.layer!r} ({self.previous.module_type}), "
                f"its {kind}: {_describe(self.previous)}"
            )
        if self.phase == "backward":
            lines.append(
                "  a gradient turns non-finite in the backward of what consumes this output: the previous "
                "layer above, or functional ops between the two (or loss_fn, for the model's output)"
            )
        return "\n".join(lines)


def _describe(s: LayerStats) -> str:
    return (
        f"shape {list(s.shape)}, NaN {s.nan_fraction:.3g}, Inf {s.inf_fraction:.3g}, finite values: "
        f"mean {s.mean:.4g}, std {s.std:.4g}, min {s.min:.4g}, max {s.max:.4g}"
    )


def _nonfinite(summary: TensorStats) -> bool:
    return summary.nan + summary.inf > 0


class _Call(NamedTuple):
    """One call of a checked layer, with the summaries of its floating-point tensors."""

    layer: str
    call: int
    summaries: list[TensorStats]


def _every_module(model: nn.Module) -> Selection:
    """Every module, the model itself first, resolved from one walk of the model."""
    root = selection(model, "")
    return root.select(list(root.layers))


class NonfiniteCheck:
    """Watches every forward (and backward) inside a ``with`` block; ``report`` is set on exit.

    Made by ``layertap.find_nonfinite(model)``. Gradients are watched when autograd is enabled
    on entry. The first non-finite forward output is reported, else the first non-finite
    gradient; ``report`` is ``None`` when everything was finite. Wrap one training step: the
    summaries of every call in the block are kept until it ends.
    """

    def __init__(self, model: nn.Module, layers: Layers | None = None, *, grads: bool | None = None) -> None:
        self.model = model
        self._selection = _every_module(model) if layers is None else selection(model, layers)
        self.names = list(self._selection.names)
        self.grads = grads
        self.report: NonfiniteReport | None = None
        self._modules = self._selection.layers
        # the tap's observer fills these, each in the order its values came
        self._outputs: list[_Call] = []
        self._inputs: dict[tuple[str, int], list[TensorStats]] = {}
        self._grads: dict[tuple[str, int], _Call] = {}
        self._tap: Tap | None = None

    def __enter__(self) -> NonfiniteCheck:
        grads = torch.is_grad_enabled() if self.grads is None else self.grads
        capture: tuple[Kind, ...] = ("output", "input", "grad") if grads else ("output", "input")
        self.report = None
        self._tap = tap(self.model, self._selection, capture=capture, observe=self._observe)
        self._tap.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        taps = self._tap
        assert taps is not None  # set by __enter__, which a with block runs first
        taps.remove()
        try:
            self.report = self._find()
        finally:
            self._outputs, self._inputs, self._grads = [], {}, {}

    def _observe(self, layer: str, kind: str, call: int, value: Any) -> None:
        summaries = [s for t in nested.tensors(value) if t.is_floating_point() and (s := tensor_stats(t)) is not None]
        if not summaries:  # an integer output (token ids, indices): nothing to check
            return
        if kind == "output":
            self._outputs.append(_Call(layer, call, summaries))
        elif kind == "input":
            self._inputs[layer, call] = summaries
        else:  # a gradient comes tensor by tensor; the call takes its place with its first
            self._grads.setdefault((layer, call), _Call(layer, call, [])).summaries.extend(summaries)

    def _find(self) -> NonfiniteReport | None:
        phases: list[tuple[Phase, list[_Call]]] = [("forward", self._outputs), ("backward", list(self._grads.values()))]
        for phase, calls in phases:
            first = next((i for i, c in enumerate(calls) if any(map(_nonfinite, c.summaries))), None)
            if first is None:
                continue
            bad = calls[first]
            inputs = self._inputs.get((bad.layer, bad.call), [])
            previous = calls[first - 1] if first else None
            return NonfiniteReport(
                phase=phase,
                layer=bad.layer,
                module_type=self._type(bad.layer),
                call=bad.call,
                value=self._stats(bad.layer, bad.call, next(filter(_nonfinite, bad.summaries))),
                inputs=[self._stats(bad.layer, bad.call, s, f" input {i}") for i, s in enumerate(inputs)],
                previous=self._stats(previous.layer, previous.call, previous.summaries[0]) if previous else None,
            )
        return None

    def _type(self, layer: str) -> str:
        return type(self._modules[owner(layer)]).__name__

    def _stats(self, layer: str, call: int, summary: TensorStats, suffix: str = "") -> LayerStats:
        return LayerStats.from_summary(summary, name=layer + suffix, layer=layer, call=call, module_type=self._type(layer))


def _backward(model: nn.Module, loss: Any) -> None:
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        shape = list(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise ValueError(f"loss_fn must return a one-element tensor (a scalar loss), got {shape}")
    params = [p for p in model.parameters() if p.requires_grad]
    if params:  # gradients are returned, not accumulated in .grad: the model is left as it was
        torch.autograd.grad(loss, params, allow_unused=True)
    else:
        loss.backward()


_NO_INPUTS: Any = object()


@overload
def find_nonfinite(model: nn.Module, *, layers: Layers | None = None) -> NonfiniteCheck: ...


@overload
def find_nonfinite(
    model: nn.Module, inputs: Any, *, loss_fn: Callable[[Any], torch.Tensor] | None = None, layers: Layers | None = None
) -> NonfiniteReport | None: ...


def find_nonfinite(
    model: nn.Module,
    inputs: Any = _NO_INPUTS,
    *,
    loss_fn: Callable[[Any], torch.Tensor] | None = None,
    layers: Layers | None = None,
) -> NonfiniteReport | NonfiniteCheck | None:
    """The first layer whose output (forward) or output gradient (backward) holds NaN or Inf.

    Runs ``model`` on ``inputs`` (a tensor, a tuple of args or a dict of kwargs), and with
    ``loss_fn(output) -> scalar`` the backward too (no ``.grad`` is written). Returns a `NonfiniteReport`
    with the layer, its class, its inputs' statistics and the previous layer's, or ``None``
    when every value is finite. ``layers`` restricts the check (default: every module). The
    model runs as it is: in train mode, BatchNorm updates its running statistics as usual.

    Without ``inputs`` it returns a context manager for your own training step:

    >>> import torch, layertap
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    >>> with layertap.find_nonfinite(model) as check:
    ...     model(torch.randn(16, 4)).pow(2).mean().backward()
    >>> check.report is None
    True
    """
    if inputs is _NO_INPUTS:
        if loss_fn is not None:
            raise TypeError("loss_fn goes with inputs: find_nonfinite(model, inputs, loss_fn=...)")
        return NonfiniteCheck(model, layers)
    check = NonfiniteCheck(model, layers, grads=loss_fn is not None)
    with running(model, grad=loss_fn is not None), check:
        output = run_model(model, inputs)
        if loss_fn is not None:
            _backward(model, loss_fn(output))
    return check.report


__all__ = ["find_nonfinite", "NonfiniteReport", "NonfiniteCheck"]
