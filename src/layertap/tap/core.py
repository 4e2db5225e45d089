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
- A stored tensor that shares memory with the network's own activation could be overwritten by a
  later in-place op (ResNet's ``out += identity`` after ``bn3``). The first time a call of a
  layer is seen, its value is copied and the original's version counter watched; later forwards
  copy only the calls whose activation really was changed in place, and keep a version guard on
  the others: reading a value that was changed after capture raises instead of returning wrong
  numbers (with ``keep="all"`` that entry alone reads ``None``, with a warning, and the others
  read as usual). A guard found moved when the forward ends is learned then, so the next forward
  copies. ``copy=`` names layers that are always copied, never guarded: nothing of theirs can be
  lost. ``keep="last"`` warns once for a layer that runs more than once per forward (a shared
  ``ReLU``), whose earlier calls it drops. What is learned is kept per layer *and call position
  within a forward* (a block called twice may be changed in place after its second call only),
  and shared by later taps of the same module. A reduction, cast or device move already makes a
  fresh tensor, which is never copied again. Tensors made under ``torch.inference_mode()`` have
  no version counter, so there every shared value is copied, as for a call outside a forward of
  the tapped model (a submodule called on its own): run taps under ``torch.no_grad()`` to hold
  less memory.
- Copies reuse memory. A tap kept open, or re-entered batch after batch, would otherwise
  allocate every copy anew at each forward (680 MB for every conv and BN of a resnet50 at batch
  8 under inference_mode), memory the allocator may hand back and fault in again. So when a
  value replaces one of the tap's own copies (``keep="last"``), or ``clear()`` drops them, each
  copy that nothing else holds (not the tensor, nor a view, NumPy array, storage, autograd graph
  or shared memory of it, nor a container around it) goes to a per-tap pool by shape, strides,
  dtype and device, and a later copy of a tensor that fits is written into it instead of a new
  one: a layer's value lands in the memory of its previous one. A value the caller keeps is
  never written; it just costs a new copy. The pool takes what a forward of the model, or
  ``clear()`` inside the ``with`` block, drops; each forward's start frees what waited a whole
  forward untaken, so it holds at most two forwards' copies; it is emptied when the hooks go.
  Stored values stay, so a tap re-entered per batch still reuses them. Cost: a few reference
  counts read per replaced tensor. Reductions, casts and moves allocate as before.
- Copies stream past the caches. A pooled buffer is long out of the cache when the next copy
  lands in it, and a plain store reads each line of it from memory before writing it. So a copy
  of 256 KiB or more on the CPU (contiguous or channels-last) is written with streaming stores
  (`layertap._copy`, C, on PyTorch's threads): no read of the buffer, and the network's next
  inputs stay in the cache. Every conv and BN of a resnet50 at batch 8 under inference_mode:
  1.14× a plain forward, against 1.30× with ``copy_`` in the same run. Where the package was
  built without a C compiler, copies use ``copy_``.
- The tap's own work inside a hook that fails (a value it cannot rebuild or move) raises a
  `TapError` naming the layer, with the original error chained.

Ops inside a module (``"layer1.0:add_"``, ``"**.attn:softmax"``; see `layertap.select`):

- Module hooks see only what crosses a module's boundary; the residual sum, an ``F.relu`` or
  the attention probabilities are plain function calls inside ``forward``. For every module with
  a tapped op, the tap wraps that module's ``forward`` (and hooks its descendants) for its
  lifetime; while such a forward runs, a ``TorchFunctionMode`` sees each
  torch function it calls. An op belongs to the innermost module whose ``forward`` called it:
  ops inside a child's call (its hooks included, and layertap's own hooks with the ``observe``/
  ``edit`` functions they call) are not the parent's. Only a hook added to a child after the tap
  started, or a global module hook, runs outside that and counts for the parent. Ops inside an op are not seen (``F.softmax`` is one op, not also ``Tensor.softmax``).
- Cost: nothing for modules without op taps, whose forwards are untouched. Inside a wrapped
  forward every torch function call passes through one Python function (a few microseconds);
  only the tapped ops do more. Everything is restored when the tap ends, on exceptions too.
- An op's output, inputs (the tensor for an op on one tensor, else ``Inputs(args, kwargs)``),
  ``grad``, ``grad_input``, ``edit`` and ``stop_early`` work as for modules, with the same
  in-place guarantee: ``add_`` is captured before a later ``relu_`` changes it.

``observe=f(name, kind, call, value)`` hands each value to ``f`` inside the hook instead of
keeping it, uncopied (valid during the call only): statistics and searches read every layer
without holding any. `Tap.order` is the order the tapped layers and ops first ran.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import torch
from torch import nn
from torch.autograd import forward_ad
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from .. import nested
from ..errors import ArgumentError, LayerNotFoundError, LayerNotRunError, LayertapError, TapError
from ..select import Layers, aliases, named_layers, not_found, owner, select, split_op, wrapped_child
from ..tables import Table
from ..units import human_bytes
from .controls import DType, Reduce, make_transform, shares_memory

try:  # C, optional: without a compiler the package installs without it, and copies use copy_
    from .. import _copy
except ImportError:
    _copy = None  # type: ignore[assignment]

Kind = Literal["output", "input", "grad", "grad_input"]
KINDS: tuple[str, ...] = ("output", "input", "grad", "grad_input")
KEEPS = ("last", "first", "all")
Edit = Callable[[str, Any], Any] | Mapping[Any, Callable[[str, Any], Any]] | None
Observe = Callable[[str, str, int, Any], None] | None


class Inputs(NamedTuple):
    """The inputs of a layer called with several (or keyword) arguments."""

    args: tuple
    kwargs: dict


# module -> {(kind, op or "", call position in a forward): whether a later in-place op changed
# its value}, shared by every tap
_LEARNED: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, str, int], bool]] = weakref.WeakKeyDictionary()

# Python operators reach a mode under their dunder names; the tap names them as torch does
_OPERATORS = {
    "truediv": "div", "floordiv": "floor_divide", "mod": "remainder", "and": "bitwise_and",
    "or": "bitwise_or", "xor": "bitwise_xor", "invert": "bitwise_not", "lshift": "bitwise_left_shift",
    "rshift": "bitwise_right_shift",
}  # fmt: skip
_OP_NAMES: dict[Any, str] = {}
# > 0 while a layertap hook (and the observe=/edit= it calls) runs: a child's hooks run inside its
# parent's forward, and what they compute is not the parent's op
_IN_HOOK = [0]


def _holders(t: torch.Tensor) -> tuple[int, int, int, bool] | None:
    """What may hold ``t`` out of Python's sight: references to its C++ tensor (autograd), to its
    memory (a view, a NumPy array) and to its storage object, and other processes (CPU shared
    memory; a process that sends CUDA memory must keep it, says torch.multiprocessing). None
    where this PyTorch cannot tell (the counts are private API): then nothing is reused."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None or not hasattr(t, "_use_count"):
        return None
    storage = t.untyped_storage()
    return t._use_count(), use_count(storage._cdata), sys.getrefcount(storage), t.is_cpu and storage.is_shared()


_STREAM_BYTES = 1 << 18  # smaller copies stay in the cache, where copy_ is as fast


def _streams(t: torch.Tensor) -> bool:
    """Whether the tap copies ``t`` with streaming stores (see the module docstring): its bytes are its values."""
    return (
        _copy is not None and t.is_cpu and t.nbytes >= _STREAM_BYTES
        and (t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last))
        and not (t.is_conj() or t.is_neg() or t.is_quantized)
    )  # fmt: skip


def _refs(holder: Any, key: Any) -> int:
    """The references to ``holder[key]``, counted the same way wherever this is called."""
    return sys.getrefcount(holder[key])


# what the two checks read for a tensor held by one container only, measured, not assumed: the
# counts differ between PyTorch and Python versions
_ALONE = _holders(torch.empty(1))
_ALONE_REFS = _refs([object()], 0)


def _hook_work(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook``, with the torch calls it makes hidden from op taps."""

    @functools.wraps(hook)
    def run(*args: Any) -> Any:
        _IN_HOOK[0] += 1
        try:
            return hook(*args)
        finally:
            _IN_HOOK[0] -= 1

    return run


def op_name(func: Any) -> str:
    """The name an op spec uses for a torch function: ``torch.Tensor.__iadd__`` is ``add_``,
    ``Tensor.__rsub__`` is ``rsub``, ``x.mT`` is ``mT``, ``F.softmax`` is ``softmax``."""
    try:
        return _OP_NAMES[func]
    except (KeyError, TypeError):
        pass
    name = getattr(func, "__name__", "") or type(func).__name__
    if name == "__get__":  # a property such as x.mT
        name = getattr(getattr(func, "__self__", None), "__name__", name)
    elif name.startswith("__") and name.endswith("__"):
        core = name[2:-2]
        inplace = core.startswith("i") and core[1:] in ("add", "sub", "mul", "matmul", "pow", *_OPERATORS)
        if inplace or (core.startswith("r") and core[1:] in ("add", "mul", "matmul", "pow", *_OPERATORS)):
            core = core[1:]
        name = _OPERATORS.get(core, core) + ("_" if inplace else "")
    with contextlib.suppress(TypeError):
        _OP_NAMES[func] = name
    return name


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


class _Call:
    """One running call of a layer whose gradients are tapped: the versions of the tensors it was
    given (by id), and the inputs replaced by aliases, to rebase if the layer changes them in place."""

    __slots__ = ("given", "swaps")

    def __init__(self) -> None:
        self.given: dict[int, int] = {}
        self.swaps: list[tuple[torch.Tensor, torch.Tensor, int]] = []

    def saw(self, value: Any) -> None:
        # inference tensors have no version (the tap then refuses gradients, naming the mode)
        self.given = {id(t): t._version for t in nested.tensors(value) if not t.is_inference()}

    def rebase(self) -> None:
        """After the call: a tensor the layer changed in place through its alias gets that history too."""
        for original, alias, version in reversed(self.swaps):  # an alias of an alias first
            now = alias._version
            if now != version:
                original.copy_(alias)  # the same memory: no data moves, and original's graph now runs through the layer
                _set_version(original, now)  # copy_ counted as a write; the values saved for backward are unchanged
        self.swaps.clear()


def _hookable(t: torch.Tensor, kind: str, call: _Call) -> torch.Tensor:
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


class _StopForward(Exception):
    """Raised by the last tapped layer when ``stop_early=True``; the tap swallows it."""

    def __init__(self, tap: Tap) -> None:
        super().__init__("layertap stopped the forward after the last tapped layer")
        self.tap = tap


class _Frame:
    """One running forward of a module with tapped ops: its ops' call counts so far."""

    __slots__ = ("counts", "module", "sites", "star")

    def __init__(self, module: str, sites: dict[str, list[tuple[str, int | None]]], star: bool) -> None:
        self.module = module
        self.sites = sites  # op -> [(tap name, the K of "#K" or None)]
        self.star = star  # "module:*": every op
        self.counts: dict[str, int] = {}


class _OpMode(TorchFunctionMode):
    """Hands every torch function call to the tap; on the mode stack only inside a wrapped forward."""

    def __init__(self, on_op: Callable[..., Any]) -> None:
        super().__init__()
        self.on_op = on_op

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return self.on_op(func, args, kwargs or {})


def _capture_failed(what: str, name: str, module: nn.Module, exc: Exception) -> TapError:
    """The error for the tap's own work failing inside a hook, e.g. a value it cannot rebuild."""
    # under vmap/grad the layer sees wrapped tensors, which have no memory of their own to copy
    peek = getattr(torch._C._functorch, "peek_interpreter_stack", None)
    fix = (
        "it ran inside a torch.func transform (vmap, grad, jacrev...), whose tensors cannot leave it: "
        "call the model outside the transform while it is tapped"
        if peek is not None and peek() is not None
        else "change to=, dtype= or reduce=, or tap another layer"
    )
    return TapError(f"layertap could not capture the {what} of layer {name!r} ({type(module).__name__}); {fix}. {type(exc).__name__}: {exc}")


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

    @property
    def received(self) -> bool:
        return any(g is not None for g in self.slots)

    def value(self) -> Any:
        """The gradients in the call's structure; ``None`` if no backward reached the call."""
        if not self.received:
            return None
        return nested.map_leaves(lambda s: self.slots[s.index], self.skeleton, leaf=_Slot)


class _Parts:
    """One call's values from the replicas of ``nn.DataParallel``, gathered in batch order on read."""

    __slots__ = ("device", "guards", "slots")

    def __init__(self, size: int, device: torch.device) -> None:
        self.slots: list[Any] = [None] * size
        self.device = device
        self.guards: list = []

    @property
    def received(self) -> bool:
        return any(p.received if isinstance(p, _Grads) else p is not None for p in self.slots)

    def value(self) -> Any:
        parts = [p.value() if isinstance(p, _Grads) else p for p in self.slots]
        parts = [p for p in parts if p is not None]
        if not parts:
            return None
        leaves = [nested.tensors(p) for p in parts]
        position = itertools.count()

        def gather(t: torch.Tensor) -> torch.Tensor:
            i = next(position)
            return torch.cat([part[i].to(self.device) for part in leaves]) if t.dim() else t

        return nested.map_leaves(gather, parts[0])


def _received(value: Any) -> bool:
    """Whether a stored value holds anything: a gradient entry may be waiting for its backward."""
    return value.received if isinstance(value, (_Grads, _Parts)) else True


class _Store:
    """The values of one kind per layer, under the keep policy, with their version guards."""

    def __init__(self, kind: str, keep: str) -> None:
        self.kind = kind
        self.keep = keep
        # name -> [(call index, value, [(tensor, version, copy key), ...])], sorted by call index
        self.entries: dict[str, list[tuple[int, Any, list]]] = {}

    def wants(self, name: str, index: int) -> bool:
        kept = self.entries.get(name)
        return self.keep != "first" or not kept or kept[0][0] == index

    def has(self, name: str) -> bool:
        return any(_received(value) for _, value, _ in self.entries.get(name, ()))

    def find(self, name: str, index: int) -> Any:
        """The value stored for call ``index`` (another replica's part of the same call)."""
        return next((v for i, v, _ in self.entries.get(name, ()) if i == index), None)

    def pop_replaced(self, name: str, index: int) -> tuple[int, Any, list] | None:
        """Remove and return the entry that a value of call ``index`` would replace."""
        kept = self.entries.get(name)
        if self.keep != "last" or not kept or index < kept[0][0]:
            return None
        del self.entries[name]
        return kept[0]

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
        dtype: DType = None,
        reduce: Reduce = None,
        stop_early: bool = False,
        edit: Edit = None,
        observe: Observe = None,
        copy: bool | Layers = False,
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
        if observe is not None and not callable(observe):
            raise TypeError(f"observe must be a function f(name, kind, call, value), got {type(observe).__name__}")
        self.model = model
        self._layers = named_layers(model)
        selected = select(model, layers)
        # "module:*" names every op as it runs; the other names are known now
        self._star = {owner(n) for n in selected if n.endswith(":*")}
        if self._star and stop_early:
            raise TapError("stop_early=True needs a known set of layers: name the ops instead of 'module:*'")
        self.names: list[str] = [n for n in selected if not n.endswith(":*")]
        self._tapped = set(self.names)
        self._module_aliases: dict[str, list[str]] = {}
        for alias, name in aliases(model).items():
            self._module_aliases.setdefault(name, []).append(alias)
        # a tapped layer may be read by its name with or without wrapper segments
        self._aliases: dict[str, str] = {}
        for name in self.names:
            self._add_aliases(name)
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
        self._observe = observe
        self._edits = self._resolve_edits(edit)
        # module name -> op -> [(tap name, the K of "#K" or None)]: tapped and edited ops
        self._sites: dict[str, dict[str, list[tuple[str, int | None]]]] = {}
        for name in dict.fromkeys(self.names + list(self._edits)):
            op = split_op(name)
            if op is not None:
                self._sites.setdefault(op.module, {}).setdefault(op.op, []).append((name, op.call))
        if (self._sites or self._star) and parallel:
            raise TapError("op taps are not supported under nn.DataParallel: tap model.module")
        self._frames: list[_Frame | None] = []
        self._mode = _OpMode(self._on_op)
        # module name -> op -> most calls in one forward, for every op that returned a tensor
        self._ops_seen: dict[str, dict[str, int]] = {}
        self._transform = make_transform(detach=detach, to=to, dtype=dtype, reduce=reduce)
        self._stores = {k: _Store(k, keep) for k in kinds}
        self._handles: list[RemovableHandle] = []
        self._restore: contextlib.ExitStack | None = None
        self._calls: dict[str | tuple[str, int], int] = {}  # calls counted per layer since clear()
        self._order: dict[str, None] = {}  # names in the order their first call started
        # the counts when the running forward of the model started (None outside one): a call's
        # position within its forward is its count minus this. Only a tap that may keep a
        # tensor of the network's own needs it: a reduction always makes a fresh one
        self._learns = reduce is None and observe is None and bool({"output", "input"} & set(kinds))
        # layers whose values are always copied, never guarded: an in-place op can lose none of them
        self._always_copy = self._resolve_copy(copy)
        # keep='last' warns once per layer that runs more than once per forward: the counts when
        # the running forward began, and the layers warned about
        self._multi: tuple[dict[str | tuple[str, int], int], set[str]] | None = (
            ({}, set()) if keep == "last" and observe is None else None
        )
        self._start: dict[str | tuple[str, int], int] | None = None
        self._fired: set[str] = set()
        # (kind, name, position) -> None: unknown yet, True: changed in place downstream, so copy;
        # False: guard. What earlier taps learned about a call position of a module is reused: it
        # is a property of the model's code.
        self._copy: dict[tuple[str, str, int], bool | None] = {}
        self._pending: list[tuple[tuple[str, str, int], torch.Tensor, int]] = []
        # the values guarded in the running forward: one changed by its end is copied from the next on
        self._guarded: list[tuple[torch.Tensor, int, tuple[str, str, int]]] = []
        # the copies this tap made (by id), and the pool of those it dropped, by what fits them:
        # dropped since the running forward began, and before (freed when the next one begins)
        self._made: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        self._pool: dict[tuple, list[torch.Tensor]] = {}
        self._stale: dict[tuple, list[torch.Tensor]] = {}
        self._want_input = "input" in kinds
        self._want_grad_input = "grad_input" in kinds
        self._want_grads = self._want_grad_input or "grad" in kinds
        # (name, id(module)) -> the running calls of a layer whose gradients are tapped, innermost last
        self._open: dict[tuple[str, int], list[_Call]] = {}
        self._only_inputs = not ({"output", "grad"} & set(kinds))

    def _add_aliases(self, name: str) -> None:
        module, op = owner(name), name[len(owner(name)):]  # op: "" or ":add_#2"
        for alias in self._module_aliases.get(module, [module]):
            self._aliases.setdefault(alias + op, name)

    def _resolve_copy(self, copy: bool | Layers) -> set[str]:
        if copy is True:
            return set(self.names)
        if copy is False or copy is None:
            return set()
        names = set(select(self.model, copy))
        untapped = sorted(names - self._tapped)
        if untapped:
            raise ArgumentError(f"copy= names layers that are not tapped: {untapped[:3]}; add them to the tapped layers, or use copy=True")
        return names

    def _resolve_edits(self, edit: Edit) -> dict[str, Callable[[str, Any], Any]]:
        if edit is None:
            return {}
        if callable(edit):
            if self._star:
                raise TapError("edit= needs named ops, not 'module:*' (named only as they run): list them with summary(model, x, ops=True)")
            return dict.fromkeys(self.names, edit)
        edits: dict[str, Callable[[str, Any], Any]] = {}
        for spec, fn in edit.items():
            for name in select(self.model, spec):
                if name.endswith(":*"):
                    raise TapError(f"edit= needs named ops, not {name!r}: list the ops with summary(model, x, ops=True)")
                edits[name] = fn
        return edits

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
        self._open.clear()
        self._pending.clear()
        self._guarded.clear()
        self._start = None
        self._pool, self._stale = {}, {}
        if self._restore is not None:
            self._restore.close()
            self._restore = None

    def clear(self) -> None:
        """Forget every captured value and restart call counting (for ``keep='all'``)."""
        for store in self._stores.values():
            dropped = [entry for kept in store.entries.values() for entry in kept]
            store.entries.clear()
            if self._restore is not None:  # the pool lives with the hooks
                for entry in dropped:
                    self._release(entry, 1)
        self._calls.clear()
        self._order.clear()
        self._fired.clear()
        if self._start is not None:
            self._start = {}

    def _register(self) -> None:
        root = self.model
        self._handles.append(root.register_forward_pre_hook(_hook_work(self._on_root_start), with_kwargs=True))
        self._handles.append(root.register_forward_hook(_hook_work(self._on_root_end), always_call=True))
        for name in dict.fromkeys(self.names + list(self._edits)):
            if split_op(name) is not None:
                continue
            module = self._layers[name]
            tapped = name in self._tapped
            if tapped:  # notes the start (for `order`) and captures inputs
                self._handles.append(module.register_forward_pre_hook(_hook_work(self._pre_hook(name)), with_kwargs=True))
            self._handles.append(module.register_forward_hook(_hook_work(self._hook(name, tapped))))
        # every module with tapped ops runs its forward in its own frame; around the whole call of
        # it and of each of its descendants (their hooks included) a blind frame hides their ops
        # from the module that called them
        sited = list(dict.fromkeys([*self._sites, *sorted(self._star)]))
        framed = {id(m): m for site in sited for m in self._layers[site].modules()}
        frames = self._frames

        def blind(module: nn.Module, args: tuple) -> None:
            if frames:
                frames.append(None)

        def see(module: nn.Module, args: tuple, output: Any) -> None:
            if frames:
                frames.pop()

        for module in framed.values():
            self._handles.append(module.register_forward_pre_hook(blind, prepend=True))
            self._handles.append(module.register_forward_hook(see, always_call=True))
        for site in sited:
            self._frame_forward(self._layers[site], site)

    def _frame_forward(self, module: nn.Module, name: str) -> None:
        """Run ``module``'s own forward (not its hooks) in a frame in which its ops are seen."""
        assert self._restore is not None
        frames, mode = self._frames, self._mode
        sites, star, seen = self._sites.get(name, {}), name in self._star, self._ops_seen
        inner = module.forward
        own = module.__dict__.get("forward")

        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            depth = len(frames)
            seen.setdefault(name, {})
            frames.append(_Frame(name, sites, star))
            if not depth:
                mode.__enter__()
            try:
                return inner(*args, **kwargs)
            finally:
                del frames[depth:]  # also the blind frames of a child a KeyboardInterrupt cut short
                if not depth:
                    mode.__exit__(None, None, None)

        module.forward = forward  # restored when the tap ends
        if own is None:
            self._restore.callback(module.__dict__.pop, "forward", None)
        else:
            self._restore.callback(setattr, module, "forward", own)

    def _on_root_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        self._fired.clear()
        self._pool, self._stale = {}, self._pool  # what waited a whole forward untaken is freed
        if self._learns:
            self._start = self._calls.copy()
        if self._multi is not None:
            self._multi = (self._calls.copy(), self._multi[1])
        self._open.clear()  # calls a raising forward left open

    def _on_root_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        for key, original, version in self._pending:
            if self._copy.get(key) is not True:
                self._learn(key, original._version != version)
        for kept, version, key in self._guarded:
            if kept._version != version:
                self._learn(key, True)
        self._pending.clear()
        self._guarded.clear()
        self._start = None
        if self._multi is not None:
            self._warn_repeats(*self._multi)

    def _warn_repeats(self, start: dict[str | tuple[str, int], int], warned: set[str]) -> None:
        """Warn once per layer that ran more than once in the forward that just ended (keep='last')."""
        for key, count in self._calls.items():
            runs = count - start.get(key, 0)
            if runs > 1 and isinstance(key, str) and key not in warned:
                warned.add(key)
                warnings.warn(
                    f"layertap: layer {key!r} ran {runs} times in one forward, and keep='last' keeps only "
                    "its last call; use keep='all' for every call, or keep='first'",
                    stacklevel=2,
                )

    def _learn(self, key: tuple[str, str, int], changed: bool) -> None:
        kind, name, position = key
        self._copy[key] = changed
        module = owner(name)
        _LEARNED.setdefault(self._layers[module], {})[kind, name[len(module):], position] = changed

    # ------------------------------------------------------------------ the hooks
    def _pre_hook(self, name: str) -> Callable:
        want_inputs = self._want_input or self._want_grad_input
        grads = self._want_grads

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
            if name not in self._order:
                self._order[name] = None
            if not (want_inputs or grads):
                return None
            single = len(args) == 1 and not kwargs
            value = args[0] if single else Inputs(args, kwargs)
            call = _Call()
            if want_inputs:
                value = self._take_input(name, module, value, self._replica(module, name, value), call)
            if grads:  # what the layer is given, for its forward hook
                call.saw(value)
                self._open.setdefault((name, id(module)), []).append(call)
            if not self._want_grad_input:
                return None
            return ((value,), {}) if single else (value.args, value.kwargs)

        return hook

    def _hook(self, name: str, tapped: bool) -> Callable:
        edit = self._edits.get(name)
        counts = tapped and not self._only_inputs
        grads = tapped and self._want_grads

        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            call = None
            if grads:  # the call its pre-hook opened
                calls = self._open.get((name, id(module)))
                call = calls.pop() if calls else _Call()
                call.rebase()
            # the edit runs first: what it returns is what flows on, is captured and gets the
            # gradient hooks (heatmaps rely on this to turn autograd on at their layer)
            new = edit(name, output) if edit is not None else None
            if new is not None:
                output = new
            if counts:
                taken = self._take_output(name, module, output, self._replica(module, name, output), call)
                if taken is not output:
                    new = taken
            return new

        return hook

    def _take_input(self, name: str, module: nn.Module, value: Any, part: int | None, call: _Call, watch: bool = True) -> Any:
        """Capture one call's input; returns it, with gradient hooks if ``grad_input`` is captured
        (and ``watch``): the aliases it makes go to ``call``, to rebase after the call."""
        try:
            key = name if part is None else (name, part)
            index = self._next_call(key) if self._only_inputs else self._calls.get(key, 0)
            if self._want_grad_input and watch:
                value, _ = self._watch_grads("grad_input", name, index, value, part, call)
            if self._want_input:
                self._record("input", name, index, value, part)
        except LayertapError:
            raise
        except Exception as e:  # costs nothing unless raised
            raise _capture_failed("input", name, module, e) from e
        if self._only_inputs:
            self._fire(name)
        return value

    def _take_output(self, name: str, module: nn.Module, output: Any, part: int | None, call: _Call | None) -> Any:
        """Capture one call's output; returns it, with gradient hooks if ``grad`` is captured
        (``call``: what the call was given)."""
        try:
            index = self._next_call(name if part is None else (name, part))
            if "grad" in self._stores:
                output, _ = self._watch_grads("grad", name, index, output, part, call or _Call())
            if "output" in self._stores:
                self._record("output", name, index, output, part)
        except LayertapError:
            raise
        except Exception as e:
            raise _capture_failed("output", name, module, e) from e
        self._fire(name)
        return output

    def _on_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """One torch function call inside a wrapped forward (the mode is off while this runs)."""
        frame = self._frames[-1]
        if frame is None or _IN_HOOK[0]:  # inside a descendant's forward or a hook: not this module's op
            return func(*args, **kwargs)
        op = op_name(func)
        count = frame.counts[op] = frame.counts.get(op, 0) + 1
        hits = [name for name, call in frame.sites.get(op, ()) if call is None or call == count]
        if not hits and not frame.star:
            out = func(*args, **kwargs)
            self._saw(frame.module, op, count, out)
            return out
        tapped = [name for name in hits if name in self._tapped]
        module = self._layers[frame.module]
        # an op on one tensor gives that tensor as its input, whatever options it got (F.relu's inplace=)
        single = len(args) == 1 and nested.first_tensor(kwargs) is None
        call = _Call()
        if tapped and (self._want_input or self._want_grad_input):
            value: Any = args[0] if single else Inputs(args, kwargs)
            for name in tapped:
                self._started(name)
                value = self._take_input(name, module, value, None, call)
            if self._want_grad_input:
                args, kwargs = ((value,), kwargs) if single else (value.args, value.kwargs)
        star = f"{frame.module}:{op}#{count}" if frame.star else None
        star_grads, star_call = None, self._calls.get(star, 0) if star is not None else 0
        if star is not None and self._want_grad_input:
            # before the op, which may change its input in place; kept only if it returns a tensor
            value = args[0] if single else Inputs(args, kwargs)
            try:
                value, star_grads = self._watch_grads("grad_input", star, star_call, value, None, call, put=False)
            except LayertapError:
                raise
            except Exception as e:
                raise _capture_failed("input", star, module, e) from e
            args, kwargs = ((value,), kwargs) if single else (value.args, value.kwargs)
        if self._want_grads:
            call.saw((args, kwargs))
        out = func(*args, **kwargs)
        if call.swaps:
            call.rebase()
        if not self._saw(frame.module, op, count, out):
            return out  # size(), dim(), shape: nothing to tap
        if star is not None:
            if star not in self._tapped:
                self.names.append(star)
                self._tapped.add(star)
                self._add_aliases(star)
            tapped.append(star)
            self._started(star)
            if self._want_input or self._want_grad_input:
                self._take_input(star, module, args[0] if single else Inputs(args, kwargs), None, call, watch=False)
            if star_grads is not None and self.keep == "all" and not star_grads.stored:  # entry i is call i
                star_grads.stored = True
                self._put(self._stores["grad_input"], star, star_call, star_grads, [], None)
        for name in hits:
            edit = self._edits.get(name)
            new = edit(name, out) if edit is not None else None
            if new is not None:
                out = new
        if not self._only_inputs:
            for name in tapped:
                self._started(name)
                out = self._take_output(name, module, out, None, call)
        return out

    def _saw(self, module: str, op: str, count: int, out: Any) -> bool:
        """Note an op of ``module`` that returned a tensor (for discovery and errors)."""
        if not isinstance(out, torch.Tensor) and nested.first_tensor(out) is None:
            return False
        seen = self._ops_seen[module]
        if seen.get(op, 0) < count:
            seen[op] = count
        return True

    def _started(self, name: str) -> None:
        if name not in self._order:
            self._order[name] = None

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
            if isinstance(parts, _Parts):  # stored already: fill in this replica's share
                parts.slots[part] = value
                parts.guards.extend(guards)
                return
            assert self._gather_device is not None  # replicas exist only under DataParallel, which sets it
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

    def _record(self, kind: Kind, name: str, index: int, value: Any, part: int | None = None) -> None:
        transform = self._transform
        if self._observe is not None:  # handed over as it is now, kept by nobody here
            self._observe(name, kind, index, nested.map_leaves(transform, value))
            return
        store = self._stores[kind]
        if not store.wants(name, index):
            return
        if part is None and self._start is not None:
            # the value this call replaces is dropped first, so that its copies can take the new
            # one; only inside a forward of the model, as the next forward frees what the pool
            # did not need (start is None elsewhere, and for a tap that never copies)
            replaced = store.pop_replaced(name, index)
            if replaced is not None:
                self._release(replaced, 1)
        guards: list = []

        def keep(t: torch.Tensor) -> torch.Tensor:
            out = transform(t)
            if not shares_memory(out, t):
                return out
            start = self._start
            # no version counter to watch under inference_mode, and no call position to learn
            # for outside a forward of the model (nor for a layer of copy=): copy
            if start is None or t.is_inference() or name in self._always_copy:
                return self._copy_of(out)
            position = index - start.get(name if part is None else (name, part), 0)
            key = (kind, name, position)
            try:
                copy = self._copy[key]
            except KeyError:  # new to this tap: what an earlier tap learned, if any
                module = owner(name)
                learned = _LEARNED.get(self._layers[module], {})
                copy = self._copy[key] = learned.get((kind, name[len(module):], position))
            if copy is False:
                guards.append((out, out._version, key))
                self._guarded.append((out, out._version, key))
                return out
            if copy is None:
                self._pending.append((key, t, t._version))
            return self._copy_of(out)

        self._put(store, name, index, nested.map_leaves(keep, value), guards, part)

    def _copy_of(self, out: torch.Tensor) -> torch.Tensor:
        """The tap's own copy of ``out``: in a pooled buffer that fits, if any (see the module docstring)."""
        # a subclass, a tensor in a graph (forward-mode AD's too: a dual tensor), a nested or
        # sparse one: cloned as before
        if (
            type(out) is not torch.Tensor or out.requires_grad or out.is_nested or out.layout != torch.strided
            or forward_ad.unpack_dual(out).tangent is not None
        ):  # fmt: skip
            return out.clone()
        # the buffer is what clone() would make: strides are preserved, an inference tensor under inference_mode
        fit = (out.shape, out.stride(), out.dtype, out.device, torch.is_inference_mode_enabled())
        buffers = self._pool.get(fit) or self._stale.get(fit)  # the last dropped first: its own, in place
        if _streams(out):
            copy = buffers.pop() if buffers else torch.empty_like(out)
            _copy.copy(copy.data_ptr(), out.data_ptr(), out.nbytes, torch.get_num_threads())
        else:
            copy = buffers.pop().copy_(out) if buffers else out.clone()
        self._made[id(copy)] = copy
        return copy

    def _release(self, holder: Any, key: Any) -> None:
        """Pool the tap's copies in ``holder[key]`` that nothing else holds, directly or through a container."""
        if _refs(holder, key) != _ALONE_REFS:
            return
        value = holder[key]
        if isinstance(value, torch.Tensor):
            if self._made.get(id(value)) is value and not value.requires_grad and _ALONE is not None and _holders(value) == _ALONE:
                fit = (value.shape, value.stride(), value.dtype, value.device, value.is_inference())
                self._pool.setdefault(fit, []).append(value)
        elif isinstance(value, (tuple, list)):  # last leaf first, so that each leaf takes its own back
            for i in reversed(range(len(value))):
                self._release(value, i)
        elif isinstance(value, dict):
            for k in reversed(value):
                self._release(value, k)

    def _watch_grads(
        self, kind: Kind, name: str, index: int, value: Any, part: int | None, call: _Call, put: bool = True
    ) -> tuple[Any, _Grads | None]:
        """Register gradient hooks on the tensors of ``value``; returns it, with the tensors that
        carry the hooks in place of its own, and the entry the gradients fill (None if not kept).
        ``put=False``: the caller stores a ``keep='all'`` entry itself."""
        if not torch.is_grad_enabled():
            raise TapError(
                f"capture={kind!r} needs autograd, but layer {name!r} ran under torch.no_grad() or "
                "torch.inference_mode(): run the forward without them"
            )
        store = self._stores[kind]
        observe = self._observe
        if observe is None and not store.wants(name, index):
            return value, None
        counter = itertools.count()
        skeleton = nested.map_leaves(lambda t: _Slot(next(counter)), value)
        grads = _Grads(skeleton, next(counter))
        if put and self.keep == "all" and observe is None:  # one entry per call, in call order; None until a backward reaches it
            grads.stored = True
            self._put(store, name, index, grads, [], part)
        transform = self._transform
        slot = itertools.count()

        def watch(t: torch.Tensor) -> torch.Tensor:
            i = next(slot)
            if not (t.is_floating_point() or t.is_complex()):
                return t
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
                    self._put(store, name, index, grads, [], part)

            t.register_hook(on_grad)
            return t

        return nested.map_leaves(watch, value), (grads if observe is None else None)

    # ------------------------------------------------------------------ results
    def _read(self, kind: str, name: str) -> Any:
        if kind not in self._stores:
            raise TapError(f"capture={kind!r} was not requested: add it, e.g. capture=('output', {kind!r})")
        layer = self._name(name)
        if self._observe is not None:
            raise TapError(f"this tap hands every value to observe= and keeps none: read {layer!r} there")
        store = self._stores[kind]
        if not store.has(layer):
            self._check_op(layer)
            when = "no backward reached it" if kind.startswith("grad") else "it did not run"
            raise LayerNotRunError(
                f"layer {layer!r} is tapped but has no {kind} yet: nothing was recorded since the "
                f"tap started (or since clear()) because {when}. Check that the forward "
                f"{'and backward ' if kind.startswith('grad') else ''}went through this layer "
                f"(calling module.forward() directly bypasses hooks)"
            )
        values: list[Any] = []
        lost: list[int] = []
        for _, value, guards in store.entries[layer]:
            changed = next((key for t, v, key in guards if t._version != v), None)
            if changed is not None:
                self._learn(changed, True)
                if self.keep != "all":
                    raise TapError(
                        f"the {kind} of layer {layer!r} was changed in place after it was captured "
                        "(a later in-place op in the forward) and is lost for that forward; layertap "
                        "copies it from now on: run the forward again"
                    )
                lost.append(len(values))  # this entry alone: the others are intact
                values.append(None)
                continue
            values.append(value.value() if isinstance(value, (_Grads, _Parts)) else value)
        if lost:
            warnings.warn(
                f"layertap: entries {lost} of the {len(values)} {kind}s of layer {layer!r} were changed in place "
                "after capture (a later in-place op in the forward) and are lost (None); the others are intact, "
                f"and layertap copies those calls from now on. To lose none, tap with copy=True or copy=[{layer!r}]",
                stacklevel=3,
            )
        return values if self.keep == "all" else values[0]

    def _check_op(self, name: str) -> None:
        """Raise `LayerNotFoundError` for an op its module ran without calling."""
        op = split_op(name)
        seen = self._ops_seen.get(op.module) if op is not None else None
        if op is None or seen is None or seen.get(op.op, 0) >= (op.call or 1):
            return
        module = self._layers[op.module]
        where = f"module {op.module!r}" if op.module else "the model"
        if op.op in seen:
            wrong = f"is called {seen[op.op]} time(s) per forward of {where}, so it has no call #{op.call}"
        else:
            wrong = f"is not called by the forward of {where} ({type(module).__name__})"
        calls = ", ".join(sorted(seen)) or "no torch function that returns a tensor"
        raise LayerNotFoundError(
            f"op {op.op!r} {wrong}; its own forward calls: {calls}. Ops inside a child module belong "
            f"to the child (tap 'child:op'); list them with layertap.summary(model, x, ops=True)"
        )

    def _name(self, name: str) -> str:
        layer = self._aliases.get(name)
        if layer is None:
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
        """Layer name -> the gradient that flows back through the layer's output edge (same structure)."""
        return _View(self, "grad")

    @property
    def grad_inputs(self) -> Mapping[str, Any]:
        """Layer name -> the gradient that flows into the layer's input through the layer alone (same structure)."""
        return _View(self, "grad_input")

    def __repr__(self) -> str:
        state = "active" if self._restore is not None else "inactive"
        return f"<layertap.Tap {state}: {len(self.names)} layers, capture={self.capture}, keep={self.keep!r}>"

    def _repr_html_(self) -> str:
        """The tap in a notebook: per layer and kind, the shape, dtype and bytes of what it holds."""
        ran = self.order
        rows, total = [], 0
        for name in ran + [n for n in self.names if n not in ran]:
            for kind in self.capture:
                kept = [v.value() if isinstance(v, (_Grads, _Parts)) else v for _, v, _ in self._stores[kind].entries.get(name, ())]
                tensors = [nested.tensors(v) for v in kept if v is not None]
                size = sum(t.numel() * t.element_size() for ts in tensors for t in ts)
                total += size
                shape = ", ".join(str(list(t.shape)) for t in tensors[-1]) if tensors else "-"
                dtypes = ", ".join(sorted({str(t.dtype).removeprefix("torch.") for ts in tensors for t in ts}))
                rows.append([name, kind, str(len(tensors)), shape, dtypes or "-", human_bytes(size) if tensors else "-"])
        state = "active (inside its with block)" if self._restore is not None else "inactive"
        held = "none: every value goes to observe=" if self._observe is not None else f"{human_bytes(total)} (keep={self.keep!r})"
        return Table(
            ["layer", "kind", "calls kept", "shape (last call)", "dtype", "bytes"],
            rows,
            numeric={"calls kept", "bytes"},
            title="layertap.Tap",
            facts=[("state", state), ("layers", f"{len(self.names)}, {len(ran)} ran"), ("held", held)],
        ).html()


class _View(Mapping):
    """A read-only mapping of one kind of captured value."""

    def __init__(self, tap: Tap, kind: Kind) -> None:
        self._tap, self._kind = tap, kind

    def __getitem__(self, name: str) -> Any:
        return self._tap._read(self._kind, name)

    def _present(self) -> list[str]:
        store = self._tap._stores.get(self._kind)
        return [n for n in self._tap.names if store is not None and store.has(n)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._present())

    def __len__(self) -> int:
        return len(self._present())

    def __contains__(self, name: object) -> bool:  # one lookup, not a scan: callers test every layer
        store = self._tap._stores.get(self._kind)
        found = self._tap._aliases.get(name) if isinstance(name, str) else None
        return store is not None and found in self._tap._tapped and store.has(found)

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
            # the cheap test first: this runs over every module at each entry of the tap
            if "_orig_mod" in module._modules and wrapped_child(module) == "_orig_mod" and "forward" in state:
                old_forward = state["forward"]
                module.forward = module._orig_mod.__call__  # type: ignore[operator]  # an nn.Module, as the wrapper check says
                undo.append(functools.partial(setattr, module, "forward", old_forward))
            if state.get("_compiled_call_impl") is not None:
                old_call = state["_compiled_call_impl"]
                module._compiled_call_impl = None
                undo.append(functools.partial(setattr, module, "_compiled_call_impl", old_call))
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
    dtype: DType = None,
    reduce: Reduce = None,
    stop_early: bool = False,
    edit: Edit = None,
    observe: Observe = None,
    copy: bool | Layers = False,
) -> Tap:
    """Tap ``layers`` of ``model`` for the duration of a ``with`` block.

    Args:
        layers: names, globs, regexes, module classes or predicates (see `layertap.select`).
        capture: any of ``"output"``, ``"input"``, ``"grad"`` (the gradient that flows back
            through the layer's output edge) and ``"grad_input"`` (the gradient that flows into
            its input through the layer alone): ``register_full_backward_hook``'s
            ``grad_output`` and ``grad_input``, whatever else uses those tensors. Gradients come
            from your own backward, inside the ``with`` block or after it.
        keep: ``"last"`` or ``"first"`` call, or ``"all"`` (a list, one entry per call, across
            forwards until ``clear()``). A gradient entry of ``"all"`` is ``None`` for a call that
            no backward reached, so entry ``i`` always belongs to call ``i``; ``"last"`` and
            ``"first"`` give the last or first call a backward reached. An ``"all"`` entry that a
            later in-place op changed after capture is ``None`` too, with a warning naming it
            (the others read as usual). ``"last"`` warns once for a layer that runs more than
            once per forward (a shared ``ReLU``).
        detach: drop the autograd graph of each captured tensor (applied first, inside the hook).
        to: a device to move each captured tensor to, after ``reduce`` and ``dtype``.
        dtype: a floating-point dtype (or its name, ``"float16"``) to cast captured
            floating-point tensors to, after ``reduce``.
        reduce: ``"mean"``, ``"max"``, ``"flatten"``, ``"cls"`` or a callable, applied on the
            layer's own device before the tensor is stored.
        stop_early: end the forward (by an exception the tap swallows) as soon as every tapped
            layer has fired, so the rest of the network never runs; put the forward last in the
            ``with`` block.
        edit: ``f(name, output) -> new_output`` for every tapped layer, or ``{spec: f}``; the
            result (unless ``None``) replaces the output downstream, and is what is captured.
        copy: ``True``, or specs of tapped layers, whose values are always copied rather than
            guarded, so that no in-place op can lose one (the cost: a copy per call).
        observe: ``f(name, kind, call, value)``, called inside the hook with each value as it
            would be stored (after ``detach``/``to``/``dtype``/``reduce``), for every call
            whatever ``keep`` says; the tap then keeps nothing. ``call`` counts the layer's
            calls since the tap began (or ``clear()``). The value is not copied: it is valid
            during the call only (a later in-place op may change it). A gradient is handed over
            tensor by tensor, as the backward reaches each.

    Layers may be ops inside a module's forward (``"layer1.0:add_"``, see `layertap.select`),
    with every option above.

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
        observe=observe,
        copy=copy,
    )


__all__ = ["tap", "Tap", "Inputs", "KINDS", "LayerNotFoundError", "op_name"]
