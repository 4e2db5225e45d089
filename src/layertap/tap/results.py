"""The tap's read side: a read-only mapping from layer name to output, the mappings of each kind
(``outputs``, ``inputs``, ``grads``, ``grad_inputs``), `order`, and the errors of a read that
cannot be answered (a kind not captured, a name not tapped, values handed to ``observe=``).
`layertap.tap.core.Tap` is one; its hooks fill what these read (`layertap.tap.kept`)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from torch import nn

from ..errors import TapError
from ..select import OpName, not_found
from .grads import Grads
from .inplace import InPlace, Site
from .kept import Kept, View
from .ops import OpTaps
from .options import Observe


class Results(Mapping):
    """What a tap holds, read by layer name (or an alias of it)."""

    names: list[str]
    capture: tuple[str, ...]
    keep: str
    _kept: Kept
    _inplace: InPlace
    _grads: Grads
    _ops: OpTaps
    _sites: dict[str, OpName]
    _modules: dict[str, nn.Module]
    _aliases: dict[str, str]
    _tapped: set[str]
    _order: dict[str, None]
    _observe: Observe
    _restore: contextlib.ExitStack | None

    def _where(self, name: str) -> tuple[nn.Module, Site]:
        """The module a tapped name belongs to, and its op there (None: the module itself)."""
        op = self._sites.get(name)
        return (self._modules[name], None) if op is None else (self._modules[op.module], (op.op, op.call))

    @property
    def order(self) -> list[str]:
        """The tapped names (layers and ops) in the order their first call started, since the tap
        began or ``clear()``: parents before their children, as the forward ran them.

        >>> import torch, torchvision, layertap
        >>> model = torchvision.models.resnet18()
        >>> with layertap.tap(model, ["layer2", "conv1", "layer1.0:add_"]) as t:
        ...     _ = model(torch.randn(1, 3, 64, 64))
        >>> t.order
        ['conv1', 'layer1.0:add_', 'layer2']
        """
        return list(self._order)

    def _read(self, kind: str, name: str) -> Any:
        if kind not in self._kept.stores:
            raise TapError(f"capture={kind!r} was not requested: add it, e.g. capture=('output', {kind!r})")
        layer = self._name(name)
        if self._observe is not None:
            raise TapError(f"this tap hands every value to observe= and keeps none: read {layer!r} there")
        return self._kept.read(kind, layer, self._inplace.learn, lambda: self._missing(kind, layer))

    def _missing(self, kind: str, layer: str) -> None:
        """Raise for what a layer cannot have (an op its module never called, a gradient with no float to flow through)."""
        self._ops.check(self._sites.get(layer))
        if kind.startswith("grad"):
            self._grads.check_floats(kind, layer)

    def _name(self, name: str) -> str:
        layer = self._aliases.get(name)
        if layer is None:
            raise not_found(name, {n: self._where(n)[0] for n in self.names}, what="tap")
        return layer

    def __getitem__(self, name: str) -> Any:
        return self._read("output", name)

    def __iter__(self) -> Iterator[str]:
        return iter(self.outputs)

    def __len__(self) -> int:
        return len(self.outputs)

    def __contains__(self, name: object) -> bool:
        return name in self.outputs

    @property
    def outputs(self) -> Mapping[str, Any]:
        """Layer name -> output (a list of one per call with ``keep='all'``)."""
        return View(self, "output")

    @property
    def inputs(self) -> Mapping[str, Any]:
        """Layer name -> input: the tensor for a one-argument call, else ``Inputs(args, kwargs)``."""
        return View(self, "input")

    @property
    def grads(self) -> Mapping[str, Any]:
        """Layer name -> the gradient that flows back through the layer's output edge (same structure)."""
        return View(self, "grad")

    @property
    def grad_inputs(self) -> Mapping[str, Any]:
        """Layer name -> the gradient that flows into the layer's input through the layer alone (same structure)."""
        return View(self, "grad_input")

    def __repr__(self) -> str:
        state = "active" if self._restore is not None else "inactive"
        return f"<layertap.Tap {state}: {len(self.names)} layers, capture={self.capture}, keep={self.keep!r}>"

    def _repr_html_(self) -> str:
        """The tap in a notebook: per layer and kind, the shape, dtype and bytes of what it holds."""
        ran = self.order
        state = "active (inside its with block)" if self._restore is not None else "inactive"
        facts = [("state", state), ("layers", f"{len(self.names)}, {len(ran)} ran")]
        return self._kept.table(self.names, ran, self.capture, facts, self._observe is not None)
