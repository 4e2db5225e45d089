"""Tensor-parallel values, seen whole: a tapped value is the full logical activation.

A model split by ``torch.distributed.tensor.parallel.parallelize_module`` computes on shards.
``ColwiseParallel`` leaves each rank's Linear with a slice of the output features, and its
style's forward hook hands that slice on as a plain tensor (``use_local_output=True``); a ReLU
after it sees only the slice too. A naive hook would store half the features as if they were
all of them. The rule here: a tapped value is what the unsharded model computes, the same on
every rank of the tensor-parallel group; ``gather=False`` keeps the rank's part instead, as a
DTensor with its placements, with no collective.

Where the layout comes from (never from shapes alone):

- a DTensor says it itself (`DTensor.placements`): gathered by ``full_tensor()``;
- the plain tensor a parallel style hands on: its layout is the style's ``output_layouts``, read
  from the hook `distribute_module` registered on the module, and its mesh with it;
- a layer with no style of its own, fed such a tensor (an activation between Colwise and
  Rowwise): its output has its input's layout when it keeps its input's shape (elementwise
  layers); any other such layer is refused with a `TapError`, never stored as a part;
- an op inside a module (``"attn:scaled_dot_product_attention"``, ``"mlp.1:gelu"``) computes on
  views and products of parts, whose layout nothing records (an attention's heads are split
  across ranks, a GELU's features): op taps on a model with parallel styles are refused unless
  ``gather=False``, which keeps each rank's part as it is.
- a style's all-reduce hands on an asynchronous result: the tap waits for it before reading it
  (a parent of a ``RowwiseParallel`` layer returns that result as its own output).

Such a plain part is wrapped as a DTensor (`DTensor.from_local`, no communication) for the tap's
own work (capture, gradient hooks, ``edit=``) and unwrapped for the network, which sees exactly
what it would have. Its gradient is then a DTensor too, gathered like the value. An edit sees the
whole value; what it returns is split back to the rank's part. Cost: one all-gather per tapped
sharded value (none for ``gather=False``); a model without DTensors pays nothing.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle
from torch.utils.weak import WeakIdKeyDictionary

from .. import nested
from ..errors import TapError

Layout = tuple[Any, tuple]  # a DeviceMesh and its placements


def _dtensor() -> Any:
    from torch.distributed.tensor import DTensor

    return DTensor


def _has_dtensors(modules: Sequence[nn.Module]) -> bool:
    if not torch.distributed.is_available():
        return False
    DTensor = _dtensor()
    return any(isinstance(p, DTensor) for m in modules for p in m._parameters.values())


def _style_output(module: nn.Module) -> tuple[bool, Layout | None]:
    """Whether a parallel style hooks ``module``, and the layout of the plain tensor it hands on
    (None: the style hands on a DTensor, or its layout cannot be read)."""
    for hook in module._forward_hooks.values():
        code = getattr(hook, "__code__", None)
        if code is None or not code.co_filename.replace("\\", "/").endswith("distributed/tensor/_api.py"):
            continue
        cells = dict(zip(code.co_freevars, (c.cell_contents for c in hook.__closure__ or ())))
        output_fn, mesh = cells.get("output_fn"), cells.get("device_mesh")
        if not isinstance(output_fn, functools.partial):
            return True, None
        layouts = [a for a in output_fn.args if isinstance(a, tuple)]
        local = [a for a in output_fn.args if isinstance(a, bool)]
        if mesh is None or len(layouts) != 1 or local != [True]:
            return True, None
        return True, (mesh, layouts[0])
    return False, None


def whole(t: torch.Tensor, gather: bool) -> torch.Tensor:
    """``t`` as the tap keeps it: a DTensor's full value (or, with ``gather=False``, a copy of
    the DTensor); an asynchronous collective's result once it has arrived."""
    if isinstance(t, _dtensor()):
        if not gather:
            return t.detach().clone()
        full = arrived(t.full_tensor())
        # a replicated value's full tensor is the rank's own memory, which the network may change
        return full.clone() if full.untyped_storage().data_ptr() == t.to_local().untyped_storage().data_ptr() else full
    return arrived(t)


class _Wait(torch.autograd.Function):
    """``wait()`` on an asynchronous collective's result, keeping its autograd history (the
    gradient passes through unchanged); no copy."""

    @staticmethod
    def forward(ctx: Any, t: Any) -> torch.Tensor:
        return t.wait()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        return grad


def arrived(t: Any) -> Any:
    """An asynchronous collective's result (a style's all-reduce) once it has arrived, as a plain
    tensor (the tap reads its memory); anything else as it is."""
    return _Wait.apply(t) if type(t).__name__ == "AsyncCollectiveTensor" else t


class Sharded:
    """The tap's side of a tensor-parallel model: which layers hand on parts, and their layouts."""

    def __init__(self, modules: Sequence[nn.Module], gather: bool) -> None:
        self.gather = gather
        self._styles: dict[nn.Module, Layout | None] = {}
        for module in modules:
            styled, layout = _style_output(module)
            if styled:
                self._styles[module] = layout
        self._parts: WeakIdKeyDictionary = WeakIdKeyDictionary()  # plain tensor -> its layout, this forward

    @staticmethod
    def of(modules: Sequence[nn.Module], gather: bool) -> Sharded | None:
        """The helper for a model's ``modules`` (every one, as its selection walked them), or
        None for a model with no DTensor parameters."""
        return Sharded(modules, gather) if _has_dtensors(modules) else None

    def check_ops(self, names: Sequence[str]) -> None:
        """Refuse op taps whose values would be parts of unknown layout (the module docstring)."""
        if names and self._styles and self.gather:
            raise TapError(
                f"op taps ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''}) on a tensor-parallel model would "
                "see this rank's part of the activation, whose layout is not known inside a module: tap the modules "
                "instead (their values are gathered whole), or pass gather=False to keep each rank's part as it is"
            )

    def register(self, handles: list[RemovableHandle]) -> None:
        """Note every part a style hands on, so that the layers after it know its layout."""
        for module, layout in self._styles.items():
            if layout is not None:
                handles.append(module.register_forward_hook(self._noter(layout)))

    def _noter(self, layout: Layout) -> Callable:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            for t in nested.tensors(output):
                self._parts[t] = layout

        return hook

    def part(self, name: str, module: nn.Module, args: tuple, output: Any) -> _Part | None:
        """A plain ``output`` that is a rank's part, with its layout, else None."""
        layout = self._layout(name, module, args, output)
        return None if layout is None else _Part(self, layout)

    def _layout(self, name: str, module: nn.Module, args: tuple, output: Any) -> Layout | None:
        DTensor = _dtensor()
        if not isinstance(output, torch.Tensor) or isinstance(output, DTensor):
            return None
        if module in self._styles:
            return self._styles[module]
        fed = [(t, self._parts[t]) for t in nested.tensors(args) if t in self._parts]
        if not fed:
            return None
        same = [layout for t, layout in fed if t.shape == output.shape]
        if not same and not self.gather:
            return None
        if not same:
            raise TapError(
                f"layer {name!r} ({type(module).__name__}) computes on this rank's part of a tensor-parallel activation "
                "and changes its shape, so the whole value is unknown: tap the layer with the parallel style before or "
                "after it, or pass gather=False to keep each rank's part"
            )
        return same[0]

    def wrap(self, t: torch.Tensor, layout: Layout) -> Any:
        """A rank's plain part as the DTensor it is part of (no communication)."""
        mesh, placements = layout
        return _dtensor().from_local(arrived(t), mesh, placements, run_check=False)

    def wrap_parts(self, module: nn.Module, value: Any) -> tuple[Any, Callable[[Any], Any] | None]:
        """A layer's input with the parts in it wrapped (for an unstyled layer; a style's own
        input hook has made its layer's input DTensors already), and what unwraps them (None:
        there were none)."""
        if module in self._styles:
            return value, None
        wrapped = False

        def wrap(t: torch.Tensor) -> Any:
            nonlocal wrapped
            layout = self._parts.get(t)
            if layout is None:
                return t
            wrapped = True
            return self.wrap(t, layout)

        value = nested.map_leaves(wrap, value)
        return value, (self._unwrap_parts if wrapped else None)

    def _unwrap_parts(self, value: Any) -> Any:
        """The input as the layer is given it again: every DTensor back to the rank's part."""
        DTensor = _dtensor()
        return nested.map_leaves(lambda t: self.unwrap(t, (t.device_mesh, t.placements)) if isinstance(t, DTensor) else t, value)

    def unwrap(self, value: Any, layout: Layout) -> torch.Tensor:
        """What the network goes on with: the rank's part, noted for the layers after it."""
        local = value.to_local() if isinstance(value, _dtensor()) else value
        self._parts[local] = layout
        return local

    def edit(self, edit: Callable[[str, Any], Any]) -> Callable[[str, Any], Any]:
        """``edit`` on whole values: it sees each DTensor's full value, and what it returns (or the
        value it changed in place) is split back to the rank's part with the same placements."""
        DTensor = _dtensor()

        def split(t: Any, full: torch.Tensor, new: Any) -> Any:
            from torch.distributed.tensor import Replicate

            value = full if new is None else new
            replicated = DTensor.from_local(value, t.device_mesh, [Replicate()] * t.device_mesh.ndim, run_check=False)
            return replicated.redistribute(t.device_mesh, t.placements)

        def edited(name: str, output: Any) -> Any:
            if not isinstance(output, DTensor):
                return edit(name, output)
            full = output.full_tensor()
            return split(output, full, edit(name, full))

        return edited


class _Part:
    """One plain part of a layer's call and its layout: wrapped for the tap, unwrapped for the network."""

    __slots__ = ("layout", "sharded")

    def __init__(self, sharded: Sharded, layout: Layout) -> None:
        self.sharded, self.layout = sharded, layout

    def wrap(self, t: torch.Tensor) -> Any:
        return self.sharded.wrap(t, self.layout)

    def unwrap(self, value: Any) -> torch.Tensor:
        return self.sharded.unwrap(value, self.layout)
