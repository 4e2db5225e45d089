"""The tap: hooks on chosen layers that capture outputs, inputs and gradients, then go away.

>>> import torch, torchvision, layertap
>>> model = torchvision.models.resnet18().eval()
>>> with layertap.tap(model, ["layer1", "layer4"]) as taps:
...     logits = model(torch.randn(2, 3, 64, 64))
>>> taps["layer4"].shape
torch.Size([2, 512, 2, 2])

How values are kept correct and cheap:

- Inputs are captured in a forward *pre*-hook, before an in-place module (``ReLU(inplace=True)``)
  overwrites them; outputs in a forward hook.
- Gradients come from ``Tensor.register_hook`` on the layer's output (and input) tensors, never
  from full backward hooks, which break when an in-place op follows the layer.
- A stored tensor that shares memory with the network's own activation could be overwritten by
  a later in-place op (ResNet's ``out += identity`` after ``bn3``). The first forward copies every
  such value and watches the original's version counter; later forwards copy only the layers whose
  activation really was changed in place, and keep a version guard on the others: reading a value
  that was changed after capture raises instead of returning wrong numbers. A reduction, cast or
  device move already makes a fresh tensor, which is never copied again. Tensors made under
  ``torch.inference_mode()`` have no version counter, so there every shared value is copied:
  run taps under ``torch.no_grad()`` for the cheaper path.
"""

from __future__ import annotations

import contextlib
import itertools
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, NamedTuple, Union

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import nested
from .controls import Reduce, make_transform, shares_memory
from .errors import LayerNotFoundError, LayerNotRunError, TapError
from .select import Layers, canonical_name, named_layers, not_found, select

Kind = Literal["output", "input", "grad", "grad_input"]
KINDS: tuple[str, ...] = ("output", "input", "grad", "grad_input")
KEEPS = ("last", "first", "all")
Edit = Union[Callable[[str, Any], Any], Mapping[Any, Callable[[str, Any], Any]], None]


class Inputs(NamedTuple):
    """The inputs of a layer called with several (or keyword) arguments."""

    args: tuple
    kwargs: dict


# module -> {kind: whether a later in-place op changed its value}, shared by every tap
_LEARNED: weakref.WeakKeyDictionary[nn.Module, dict[str, bool]] = weakref.WeakKeyDictionary()


class _StopForward(Exception):
    """Raised by the last tapped layer when ``stop_early=True``; the tap swallows it."""

    def __init__(self, tap: Tap) -> None:
        super().__init__("layertap stopped the forward after the last tapped layer")
        self.tap = tap


class _Slot:
    """Where a tensor stood in a nested value (a plain class: pytree would open a tuple)."""

    __slots__ = ("index",)

    def __init__(self, index: int) -> None:
        self.index = index


class _Grads:
    """The gradients of one call's tensors, filled by tensor hooks as backward reaches them."""

    __slots__ = ("skeleton", "slots", "stored")

    def __init__(self, skeleton: Any, size: int) -> None:
        self.skeleton = skeleton
        self.slots: list[Any] = [None] * size
        self.stored = False  # stored once; later tensors' gradients fill the same object

    def value(self) -> Any:
        return nested.map_leaves(lambda s: self.slots[s.index], self.skeleton, leaf=_Slot)


class _Parts:
    """One call's values from the replicas of ``nn.DataParallel``, gathered in batch order on read."""

    __slots__ = ("slots", "device", "guards")

    def __init__(self, size: int, device: torch.device) -> None:
        self.slots: list[Any] = [None] * size
        self.device = device
        self.guards: list = []

    def value(self) -> Any:
        parts = [p.value() if isinstance(p, _Grads) else p for p in self.slots if p is not None]
        leaves = [nested.tensors(p) for p in parts]
        position = itertools.count()

        def gather(t: torch.Tensor) -> torch.Tensor:
            i = next(position)
            return torch.cat([part[i].to(self.device) for part in leaves]) if t.dim() else t

        return nested.map_leaves(gather, parts[0])


class _Store:
    """The values of one kind per layer, under the keep policy, with their version guards."""

    def __init__(self, kind: str, keep: str) -> None:
        self.kind = kind
        self.keep = keep
        # name -> [(call index, value, [(tensor, version), ...])], sorted by call index
        self.entries: dict[str, list[tuple[int, Any, list]]] = {}

    def wants(self, name: str, index: int) -> bool:
        kept = self.entries.get(name)
        return self.keep != "first" or not kept or kept[0][0] == index

    def find(self, name: str, index: int) -> Any:
        """The value stored for call ``index`` (another replica's part of the same call)."""
        return next((v for i, v, _ in self.entries.get(name, ()) if i == index), None)

    def put(self, name: str, index: int, value: Any, guards: list) -> None:
        kept = self.entries.get(name)
        if kept is None:
            self.entries[name] = [(index, value, guards)]
        elif self.keep == "all":
            kept.append((index, value, guards))
            if kept[-2][0] > index:  # gradients arrive in reverse call order
                kept.sort(key=lambda e: e[0])
        elif (self.keep == "last") == (index >= kept[0][0]):
            kept[0] = (index, value, guards)


class Tap(Mapping):
    """Hooks on the chosen layers of a model; use it through `layertap.tap`.

    The tap is a read-only mapping from layer name to its output; ``outputs``, ``inputs``,
    ``grads`` and ``grad_inputs`` are the mappings of each kind. Hooks exist only between
    ``__enter__`` and ``__exit__``.
    """

    def __init__(
        self,
        model: nn.Module,
        layers: Layers,
        *,
        capture: Kind | Sequence[Kind] = "output",
        keep: Literal["last", "first", "all"] = "last",
        detach: bool = True,
        to: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        reduce: Reduce = None,
        stop_early: bool = False,
        edit: Edit = None,
    ) -> None:
        kinds = (capture,) if isinstance(capture, str) else tuple(capture)
        unknown = [k for k in kinds if k not in KINDS]
        if unknown or not kinds:
            raise ValueError(f"unknown capture={capture!r}: use any of {KINDS}")
        if keep not in KEEPS:
            raise ValueError(f"unknown keep={keep!r}: use one of {KEEPS}")
        if stop_early and any(k.startswith("grad") for k in kinds):
            raise TapError(
                "stop_early=True cuts the forward, so no backward can reach the tapped layers: "
                "drop stop_early to capture gradients"
            )
        self.model = model
        self.names: list[str] = select(model, layers)
        self._tapped = frozenset(self.names)
        # nn.DataParallel runs replicas of every module in threads, one per device; they share the
        # hooks, so the tap gathers their parts in device (= batch) order
        parallel = model if isinstance(model, nn.DataParallel) and model.device_ids else None
        self._devices = [torch.device("cuda", d).index if isinstance(d, int) else torch.device(d).index
                         for d in (parallel.device_ids if parallel else [])]
        self._gather_device = torch.device("cuda", parallel.output_device) if parallel else None
        if parallel and stop_early:
            raise TapError("stop_early=True is not supported under nn.DataParallel: tap model.module, or drop stop_early")
        self.capture = kinds
        self.keep = keep
        self.stop_early = stop_early
        self._layers = named_layers(model)
        self._edits = self._resolve_edits(edit)
        self._transform = make_transform(detach=detach, to=to, dtype=dtype, reduce=reduce)
        self._stores = {k: _Store(k, keep) for k in kinds}
        self._handles: list[RemovableHandle] = []
        self._restore: contextlib.ExitStack | None = None
        self._calls: dict[str, int] = {}  # calls counted per layer since clear()
        self._fired: set[str] = set()
        # (kind, name) -> None: unknown yet, True: changed in place downstream, so copy; False: guard.
        # What earlier taps learned about a module is reused: it is a property of the model's code.
        self._copy: dict[tuple[str, str], bool | None] = {
            (kind, name): _LEARNED.get(self._layers[name], {}).get(kind) for kind in kinds for name in self.names
        }
        self._pending: list[tuple[tuple[str, str], torch.Tensor, int]] = []

    def _resolve_edits(self, edit: Edit) -> dict[str, Callable[[str, Any], Any]]:
        if edit is None:
            return {}
        if callable(edit):
            return {name: edit for name in self.names}
        edits: dict[str, Callable[[str, Any], Any]] = {}
        for spec, fn in edit.items():
            for name in select(self.model, spec):
                edits[name] = fn
        return edits

    # ------------------------------------------------------------------ hook lifetime
    def __enter__(self) -> Tap:
        if self._restore is not None:
            raise TapError("this tap is already active: create a new layertap.tap for a nested tap")
        self._restore = contextlib.ExitStack()
        try:
            self._restore.enter_context(_eager(self.model))
            self._register()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.remove()
        return isinstance(exc, _StopForward) and exc.tap is self

    def remove(self) -> None:
        """Remove every hook now (idempotent); captured values stay readable."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._pending.clear()
        if self._restore is not None:
            self._restore.close()
            self._restore = None

    def clear(self) -> None:
        """Forget every captured value and restart call counting (for ``keep='all'``)."""
        for store in self._stores.values():
            store.entries.clear()
        self._calls.clear()
        self._fired.clear()

    def _register(self) -> None:
        hooked = list(dict.fromkeys(self.names + list(self._edits)))
        wants_pre = "input" in self.capture or "grad_input" in self.capture
        root = self.model
        self._handles.append(root.register_forward_pre_hook(self._on_root_start))
        self._handles.append(root.register_forward_hook(self._on_root_end, always_call=True))
        for name in hooked:
            module = self._layers[name]
            tapped = name in self.names
            if tapped and wants_pre:
                self._handles.append(
                    module.register_forward_pre_hook(self._pre_hook(name), with_kwargs=True)
                )
            self._handles.append(module.register_forward_hook(self._hook(name, tapped)))

    def _on_root_start(self, module: nn.Module, args: tuple) -> None:
        self._fired.clear()

    def _on_root_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        for key, original, version in self._pending:
            if self._copy.get(key) is not True:
                self._learn(key, original._version != version)
        self._pending.clear()

    def _learn(self, key: tuple[str, str], changed: bool) -> None:
        kind, name = key
        self._copy[key] = changed
        _LEARNED.setdefault(self._layers[name], {})[kind] = changed

    # ------------------------------------------------------------------ the hooks
    def _pre_hook(self, name: str) -> Callable:
        want_input = "input" in self.capture
        want_grad = "grad_input" in self.capture
        only_inputs = not ({"output", "grad"} & set(self.capture))

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
            changed = None
            single = len(args) == 1 and not kwargs
            value = args[0] if single else Inputs(args, kwargs)
            part = self._replica(module, name, value)
            key = name if part is None else (name, part)
            index = self._next_call(key) if only_inputs else self._calls.get(key, 0)
            if want_grad:
                value = self._watch_grads("grad_input", name, index, value, part)
                changed = ((value,), {}) if single else (value.args, value.kwargs)
            if want_input:
                self._record("input", name, index, value, part)
            if only_inputs:
                self._fire(name)
            return changed

        return hook

    def _hook(self, name: str, tapped: bool) -> Callable:
        edit = self._edits.get(name)
        want_output = tapped and "output" in self.capture
        want_grad = tapped and "grad" in self.capture
        counts = tapped and ("output" in self.capture or want_grad)

        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            replaced = None
            # the edit runs first: what it returns is what flows on, is captured and gets the
            # gradient hooks (heatmaps rely on this to turn autograd on at their layer)
            if edit is not None:
                new = edit(name, output)
                if new is not None:
                    output = replaced = new
            if counts:
                part = self._replica(module, name, output)
                index = self._next_call(name if part is None else (name, part))
                if want_grad:
                    output = replaced = self._watch_grads("grad", name, index, output, part)
                if want_output:
                    self._record("output", name, index, output, part)
                self._fire(name)
            return replaced

        return hook

    def _next_call(self, key: str | tuple[str, int]) -> int:
        # the pre-hook reads the count without advancing it: the forward hook counts the call
        index = self._calls.get(key, 0)
        self._calls[key] = index + 1
        return index

    def _replica(self, module: nn.Module, name: str, value: Any) -> int | None:
        """The position of a DataParallel replica's device, or None for the model's own module."""
        if not self._devices or module is self._layers[name]:
            return None
        first = nested.first_tensor(value)
        return self._devices.index(first.get_device()) if first is not None else 0

    def _put(self, store: _Store, name: str, index: int, value: Any, guards: list, part: int | None) -> None:
        if part is not None:  # one replica's share of the batch
            parts = store.find(name, index)
            if not isinstance(parts, _Parts):
                parts = _Parts(len(self._devices), self._gather_device)
            parts.slots[part] = value
            parts.guards.extend(guards)
            value, guards = parts, parts.guards
        store.put(name, index, value, guards)

    def _fire(self, name: str) -> None:
        if not self.stop_early:
            return
        self._fired.add(name)
        if len(self._fired) == len(self.names):
            self._fired.clear()
            raise _StopForward(self)

    def _record(self, kind: str, name: str, index: int, value: Any, part: int | None = None) -> None:
        store = self._stores[kind]
        if not store.wants(name, index):
            return
        key = (kind, name)
        copy = self._copy.get(key)
        transform = self._transform
        guards: list = []

        def keep(t: torch.Tensor) -> torch.Tensor:
            out = transform(t)
            if not shares_memory(out, t):
                return out
            if t.is_inference():  # no version counter to watch under inference_mode: copy
                return out.clone()
            if copy is False:
                guards.append((out, out._version))
                return out
            if copy is None:
                self._pending.append((key, t, t._version))
            return out.clone()

        self._put(store, name, index, nested.map_leaves(keep, value), guards, part)

    def _watch_grads(self, kind: str, name: str, index: int, value: Any, part: int | None = None) -> Any:
        """Register gradient hooks on the tensors of ``value``; returns it (maybe with new leaves)."""
        if not torch.is_grad_enabled():
            raise TapError(
                f"capture={kind!r} needs autograd, but layer {name!r} ran under torch.no_grad() or "
                "torch.inference_mode(): run the forward without them"
            )
        store = self._stores[kind]
        if not store.wants(name, index):
            return value
        counter = itertools.count()
        skeleton = nested.map_leaves(lambda t: _Slot(next(counter)), value)
        grads = _Grads(skeleton, next(counter))
        transform = self._transform
        slot = itertools.count()

        def watch(t: torch.Tensor) -> torch.Tensor:
            i = next(slot)
            if not (t.is_floating_point() or t.is_complex()):
                return t
            if not t.requires_grad:
                # nothing upstream needs a graph, so a fresh leaf loses nothing; the clone lets
                # in-place ops follow (a leaf that requires grad cannot be changed in place)
                t = t.detach().requires_grad_().clone()

            def on_grad(g: torch.Tensor) -> None:
                grads.slots[i] = transform(g)
                if not grads.stored:
                    grads.stored = True
                    self._put(store, name, index, grads, [], part)

            t.register_hook(on_grad)
            return t

        return nested.map_leaves(watch, value)

    # ------------------------------------------------------------------ results
    def _read(self, kind: str, name: str) -> Any:
        if kind not in self._stores:
            raise TapError(f"capture={kind!r} was not requested: add it, e.g. capture=('output', {kind!r})")
        layer = self._name(name)
        entries = self._stores[kind].entries.get(layer)
        if not entries:
            when = "no backward reached it" if kind.startswith("grad") else "it did not run"
            raise LayerNotRunError(
                f"layer {layer!r} is tapped but has no {kind} yet: nothing was recorded since the "
                f"tap started (or since clear()) because {when}. Check that the forward "
                f"{'and backward ' if kind.startswith('grad') else ''}went through this layer "
                "(calling module.forward() directly bypasses hooks)"
            )
        values = []
        for _, value, guards in entries:
            if any(t._version != v for t, v in guards):
                self._learn((kind, layer), True)
                raise TapError(
                    f"the {kind} of layer {layer!r} was changed in place after it was captured "
                    "(a later in-place op in the forward) and is lost for that forward; layertap "
                    "copies it from now on: run the forward again"
                )
            values.append(value.value() if isinstance(value, (_Grads, _Parts)) else value)
        return values if self.keep == "all" else values[0]

    def _name(self, name: str) -> str:
        layer = canonical_name(name)
        if layer not in self._tapped:
            raise not_found(name, {n: self._layers[n] for n in self.names}, what="tap")
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
        return _View(self, "output")

    @property
    def inputs(self) -> Mapping[str, Any]:
        """Layer name -> input: the tensor for a one-argument call, else ``Inputs(args, kwargs)``."""
        return _View(self, "input")

    @property
    def grads(self) -> Mapping[str, Any]:
        """Layer name -> gradient with respect to the layer's output (same structure)."""
        return _View(self, "grad")

    @property
    def grad_inputs(self) -> Mapping[str, Any]:
        """Layer name -> gradient with respect to the layer's input (same structure)."""
        return _View(self, "grad_input")

    def __repr__(self) -> str:
        state = "active" if self._restore is not None else "inactive"
        return f"<layertap.Tap {state}: {len(self.names)} layers, capture={self.capture}, keep={self.keep!r}>"


class _View(Mapping):
    """A read-only mapping of one kind of captured value."""

    def __init__(self, tap: Tap, kind: str) -> None:
        self._tap, self._kind = tap, kind

    def __getitem__(self, name: str) -> Any:
        return self._tap._read(self._kind, name)

    def _present(self) -> list[str]:
        store = self._tap._stores.get(self._kind)
        return [n for n in self._tap.names if store is not None and store.entries.get(n)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._present())

    def __len__(self) -> int:
        return len(self._present())

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and canonical_name(name) in self._present()

    def __repr__(self) -> str:
        return f"<layertap {self._kind}s of {self._present()}>"


@contextlib.contextmanager
def _eager(model: nn.Module) -> Iterator[None]:
    """Run compiled (sub)modules eagerly while tapped.

    A graph compiled before the hooks existed would skip them silently (pytorch#117758), so the
    tap routes ``torch.compile``'d modules back to their original module and turns off
    ``Module.compile()``'s compiled call for its lifetime. Everything is restored afterwards.
    """
    undo: list[Callable[[], None]] = []
    try:
        for module in model.modules():
            state = module.__dict__
            if "_orig_mod" in module._modules and "forward" in state:
                old_forward = state["forward"]
                module.forward = module._orig_mod.__call__
                undo.append(lambda m=module, f=old_forward: setattr(m, "forward", f))
            if state.get("_compiled_call_impl") is not None:
                old_call = state["_compiled_call_impl"]
                module._compiled_call_impl = None
                undo.append(lambda m=module, c=old_call: setattr(m, "_compiled_call_impl", c))
        yield
    finally:
        for fn in reversed(undo):
            fn()


def tap(
    model: nn.Module,
    layers: Layers,
    *,
    capture: Kind | Sequence[Kind] = "output",
    keep: Literal["last", "first", "all"] = "last",
    detach: bool = True,
    to: torch.device | str | None = None,
    dtype: torch.dtype | None = None,
    reduce: Reduce = None,
    stop_early: bool = False,
    edit: Edit = None,
) -> Tap:
    """Tap ``layers`` of ``model`` for the duration of a ``with`` block.

    Args:
        layers: names, globs, regexes, module classes or predicates (see `layertap.select`).
        capture: any of ``"output"``, ``"input"``, ``"grad"`` (gradient with respect to the
            layer's output) and ``"grad_input"`` (with respect to its input).
        keep: ``"last"`` or ``"first"`` call, or ``"all"`` (a list, one entry per call, across
            forwards until ``clear()``).
        detach, to, dtype, reduce: applied to each tensor inside the hook, before it is stored;
            ``reduce`` is ``"mean"``, ``"max"``, ``"flatten"``, ``"cls"`` or a callable.
        stop_early: end the forward (by an exception the tap swallows) as soon as every tapped
            layer has fired, so the rest of the network never runs; put the forward last in the
            ``with`` block.
        edit: ``f(name, output) -> new_output`` for every tapped layer, or ``{spec: f}``; the
            result (unless ``None``) replaces the output downstream, and is what is captured.

    >>> import torch, torchvision, layertap
    >>> model = torchvision.models.resnet18()
    >>> x = torch.randn(1, 3, 64, 64)
    >>> with layertap.tap(model, "layer3", capture=("output", "grad")) as t:
    ...     model(x).sum().backward()
    >>> t.grads["layer3"].shape == t["layer3"].shape
    True
    """
    return Tap(
        model,
        layers,
        capture=capture,
        keep=keep,
        detach=detach,
        to=to,
        dtype=dtype,
        reduce=reduce,
        stop_early=stop_early,
        edit=edit,
    )


__all__ = ["tap", "Tap", "Inputs", "KINDS", "LayerNotFoundError"]
