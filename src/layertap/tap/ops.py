"""Op taps: the torch functions a module's own ``forward`` calls, seen through a ``TorchFunctionMode``.

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
  Descendants get their blind frames from hooks, not from forwards set on them: another tap or
  library may set or remove a child's forward while this one runs, and a copy of the model made
  meanwhile (``copy.deepcopy``, DataParallel's replicas) would keep a forward bound to the original.
- An op's output, inputs (the tensor for an op on one tensor, else ``Inputs(args, kwargs)``),
  ``grad``, ``grad_input``, ``edit`` and ``stop_early`` work as for modules, with the same
  in-place guarantee: ``add_`` is captured before a later ``relu_`` changes it.
  The op's call itself (``softmax(x, dim=-1)``'s keyword dim) is `running_call` while its hooks run.
- Every layertap hook runs inside `hidden`, which counts, per thread, the hooks running: what a
  hook computes is not an op of the module whose forward it runs in. The count is thread-local:
  ``nn.DataParallel`` runs each replica's hooks in a thread of its own, and a count shared by
  threads could lose an update (``x += 1`` is not atomic), after which no op tap in the process
  would see anything, silently.

`OpTaps` holds the sites (module -> op -> tap names), each thread's running frames and mode, and what each
module was seen calling; it finds which tapped names a call hits and hands the call to the tap's
op hook (`layertap.tap.core`), which captures it as a module hook would.
"""

from __future__ import annotations

import contextlib
import functools
import threading
import warnings
import weakref
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils.hooks import RemovableHandle

from .. import nested
from ..errors import LayerNotFoundError, TapError
from ..select import OpName

# Python operators reach a mode under their dunder names; the tap names them as torch does
_OPERATORS = {
    "truediv": "div", "floordiv": "floor_divide", "mod": "remainder", "and": "bitwise_and",
    "or": "bitwise_or", "xor": "bitwise_xor", "invert": "bitwise_not", "lshift": "bitwise_left_shift",
    "rshift": "bitwise_right_shift",
}  # fmt: skip
_OP_NAMES: dict[Any, str] = {}


class _Hooks(threading.local):
    """> 0 while a layertap hook (and the observe=/edit= it calls) runs in this thread: a child's
    hooks run inside its parent's forward, and what they compute is not the parent's op."""

    running = 0


_HOOKS = _Hooks()


class _Call(threading.local):
    """The tapped op call whose hooks run now in this thread: ``(func, args, kwargs)``."""

    value: tuple[Any, tuple, dict] | None = None


_CALL = _Call()


def running_call() -> tuple[Any, tuple, dict] | None:
    """``(func, args, kwargs)`` of the tapped op whose hooks (and ``observe=``) run now in this
    thread, as its module's forward made the call, or None outside them. An op on one tensor hands
    its hooks that tensor only: its other arguments (``softmax(x, dim=-1)``'s dim) are read here."""
    return _CALL.value


def hidden(hook: Callable[..., Any]) -> Callable[..., Any]:
    """``hook``, with the torch calls it makes hidden from op taps (in the thread that runs it)."""
    hooks = _HOOKS

    def run(*args: Any) -> Any:
        hooks.running += 1
        try:
            return hook(*args)
        finally:
            hooks.running -= 1

    return run


def shown(func: Any, args: tuple, kwargs: dict) -> Any:
    """``func(*args, **kwargs)`` run from inside an op hook as the module's own op, seen by the
    op taps of other taps on the module (the hook's other work is hidden from them)."""
    hooks = _HOOKS
    running, hooks.running = hooks.running, 0
    try:
        return func(*args, **kwargs)
    finally:
        hooks.running = running


def weak(method: Callable[..., Any]) -> Callable[..., Any]:
    """``method`` of a tap, for a helper (and a hook) to call without keeping the tap alive.

    A tap must go when its last reference goes, by reference counting, not at the next cyclic
    garbage collection: its copies then return to the pool at once, for the next tap's forward
    (``with tap(...) as t: model(x)`` batch after batch). Gradient hooks can outlive the tap (a
    backward after ``del t``): nobody can read what they would store, so they store nothing.
    """
    ref = weakref.WeakMethod(method)

    def call(*args: Any) -> Any:
        bound = ref()
        return None if bound is None else bound(*args)

    return call


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


_PLAIN = (int, float, bool, str, torch.Size, torch.dtype, torch.device, type(None))  # never hold a tensor


def returns_tensor(out: Any) -> bool:
    """Whether an op's result holds a tensor (``size()``, ``dim()``, ``shape`` have nothing to tap).
    Plain results are told at once: every op of a tapped module's forward asks, and a walk of
    ``x.shape`` as a tree costs ten times the op."""
    if isinstance(out, torch.Tensor):
        return True
    return not isinstance(out, _PLAIN) and nested.first_tensor(out) is not None


class _Frame:
    """One running forward of a module with tapped ops: its ops' call counts so far."""

    __slots__ = ("counts", "module", "seen", "sites", "star")

    def __init__(self, module: str, sites: dict[str, list[tuple[str, int | None]]], star: bool, seen: dict[str, int]) -> None:
        self.module = module
        self.sites = sites  # op -> [(tap name, the K of "#K" or None)]
        self.star = star  # "module:*": every op
        self.seen = seen  # the module's most calls in one forward, of each op that returned a tensor
        self.counts: dict[str, int] = {}


class _Thread(threading.local):
    """One thread's running frames and mode: a tapped model may run in several threads at once
    (``nn.DataParallel`` replicas, a server's request threads), each forward with its own ops."""

    def __init__(self, on_op: Callable[..., Any]) -> None:
        self.frames: list[_Frame | None] = []
        self.mode = _OpMode(on_op)


class _OpMode(TorchFunctionMode):
    """Hands every torch function call to the tap; on the mode stack only inside a wrapped forward."""

    def __init__(self, on_op: Callable[..., Any]) -> None:
        super().__init__()
        self.on_op = on_op

    def __torch_function__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        return self.on_op(func, args, kwargs or {})


# the tap's op hook: (module name, tap names hit, this call's site if the module is tapped whole
# ("module:*"), saw(result) -> whether it holds a tensor (and notes it), func, args, kwargs) -> the
# op's result, captured
OpHook = Callable[[str, list[str], "OpName | None", Callable[[Any], bool], Any, tuple, dict], Any]


class OpTaps:
    """The ops a tap watches: per module the ops tapped or edited, and the modules tapped whole (``"MODULE:*"``)."""

    def __init__(
        self, sites: Mapping[str, OpName], star: Iterable[str], modules: Mapping[str, nn.Module], hook: OpHook, changes: Iterable[str] = ()
    ) -> None:
        # module name -> op -> [(tap name, the K of "#K" or None)]: tapped and edited ops
        self.sites: dict[str, dict[str, list[tuple[str, int | None]]]] = {}
        for name, op in sites.items():
            self.sites.setdefault(op.module, {}).setdefault(op.op, []).append((name, op.call))
        self._changes = {name: sites[name] for name in changes if name in sites}  # edited or replaced ops: nothing to read them by
        self._completed: set[str] = set()  # modules whose framed forward ran to its end
        self.star = set(star)
        self._modules = modules
        self._hook = hook
        self._thread = _Thread(self.on_op)
        # module name -> op -> most calls in one forward, for every op that returned a tensor
        self.seen: dict[str, dict[str, int]] = {}
        self._framed: list[nn.Module] | None = None  # the modules framed: those with tapped ops and their descendants

    def __bool__(self) -> bool:
        return bool(self.sites or self.star)

    @property
    def names(self) -> list[str]:
        """The tapped, edited and replaced ops' names, and ``"module:*"`` for each module tapped whole."""
        return [name for ops in self.sites.values() for entries in ops.values() for name, _ in entries] + [f"{m}:*" for m in sorted(self.star)]

    def refuse(self, parallel: bool, sharded: Callable[[list[str]], None] | None) -> None:
        """Refuse op taps a model split across devices cannot give whole: under ``nn.DataParallel``
        (``parallel``), or on a tensor-parallel one (``sharded``: its check, `layertap.tap.sharded`)."""
        if self and parallel:
            raise TapError("op taps are not supported under nn.DataParallel: tap model.module")
        if self and sharded is not None:
            sharded(self.names)

    def register(self, handles: list[RemovableHandle], restore: contextlib.ExitStack) -> None:
        """Frame the forwards of the modules with tapped ops (undone by ``handles`` and ``restore``)."""
        # every module with tapped ops runs its forward in its own frame; around the whole call of
        # it and of each of its descendants (their hooks included) a blind frame hides their ops
        # from the module that called them
        sited = list(dict.fromkeys([*self.sites, *sorted(self.star)]))
        if self._framed is None:  # found once: a tap entered batch after batch walks the modules once
            self._framed = list({id(m): m for site in sited for m in self._modules[site].modules()}.values())
        thread = self._thread

        def blind(module: nn.Module, args: tuple) -> None:
            frames = thread.frames
            if frames:
                frames.append(None)

        def see(module: nn.Module, args: tuple, output: Any) -> None:
            frames = thread.frames
            if frames:
                frames.pop()

        for module in self._framed:
            handles.append(module.register_forward_pre_hook(blind, prepend=True))
            handles.append(module.register_forward_hook(see, always_call=True))
        for site in sited:
            self._frame_forward(self._modules[site], site, restore)
        if self._changes:
            restore.callback(self._unused)

    def _unused(self) -> None:
        """Warn of an edited or replaced op that a whole forward of its module never called: its
        change did nothing, and unlike a captured op nothing is read that would say so."""
        for name, op in self._changes.items():
            seen = self.seen.get(op.module, {})
            if op.module in self._completed and seen.get(op.op, 0) < (op.call or 1):
                calls = _own_calls(seen)
                warnings.warn(
                    f"layertap: edit=/replace= {name!r} changed nothing: the forward of {op.module!r} ran without that call "
                    f"(its own calls: {calls}); ops inside a child module belong to the child",
                    stacklevel=4,
                )

    def _frame_forward(self, module: nn.Module, name: str, restore: contextlib.ExitStack) -> None:
        """Run ``module``'s own forward (not its hooks) in a frame in which its ops are seen."""
        thread = self._thread
        sites, star, seen, completed = self.sites.get(name, {}), name in self.star, self.seen, self._completed
        inner = module.forward
        own = module.__dict__.get("forward")

        @functools.wraps(inner)
        def forward(*args: Any, **kwargs: Any) -> Any:
            frames, mode = thread.frames, thread.mode
            depth = len(frames)
            frames.append(_Frame(name, sites, star, seen.setdefault(name, {})))
            if not depth:
                mode.__enter__()
            try:
                out = inner(*args, **kwargs)
                completed.add(name)
                return out
            finally:
                del frames[depth:]  # also the blind frames of a child a KeyboardInterrupt cut short
                if not depth:
                    mode.__exit__(None, None, None)

        module.forward = forward  # restored when the tap ends
        if own is None:
            restore.callback(module.__dict__.pop, "forward", None)
        else:
            restore.callback(setattr, module, "forward", own)

    def on_op(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """One torch function call inside a wrapped forward (the mode is off while this runs)."""
        frame = self._thread.frames[-1]
        if frame is None or _HOOKS.running:  # inside a descendant's forward or a hook: not this module's op
            return func(*args, **kwargs)
        try:  # op_name's own cache, read here: every op of a framed forward passes
            op = _OP_NAMES[func]
        except (KeyError, TypeError):
            op = op_name(func)
        count = frame.counts[op] = frame.counts.get(op, 0) + 1
        sites = frame.sites.get(op)
        hits = [name for name, call in sites if call is None or call == count] if sites else []
        if not hits and not frame.star:  # an op nobody taps: run it, note it
            out = func(*args, **kwargs)
            if frame.seen.get(op, 0) < count:  # a forward after the first has seen them all: no test of the result
                self._saw(frame.seen, op, count, out)
            return out
        star = OpName(frame.module, op, count) if frame.star else None
        saw = functools.partial(self._saw, frame.seen, op, count)
        outer, _CALL.value = _CALL.value, (func, args, kwargs)
        # the hook's own work (captures, edit=, observe=, replace=) is no module's op for a tap
        # entered after this one, whose mode sees what this one passes on: only the op is (`shown`)
        _HOOKS.running += 1
        try:
            return self._hook(frame.module, hits, star, saw, func, args, kwargs)
        finally:
            _HOOKS.running -= 1
            _CALL.value = outer

    @staticmethod
    def _saw(seen: dict[str, int], op: str, count: int, out: Any) -> bool:
        """Note in ``seen`` (a module's) an op that returned a tensor (for discovery and errors)."""
        if not returns_tensor(out):
            return False
        if seen.get(op, 0) < count:
            seen[op] = count
        return True

    def check(self, op: OpName | None) -> None:
        """Raise `LayerNotFoundError` for an op its module ran without calling."""
        seen = self.seen.get(op.module) if op is not None else None
        if op is None or seen is None or seen.get(op.op, 0) >= (op.call or 1):
            return
        module = self._modules[op.module]
        where = f"module {op.module!r}" if op.module else "the model"
        if op.op in seen:
            wrong = f"is called {seen[op.op]} time(s) per forward of {where}, so it has no call #{op.call}"
        else:
            wrong = f"is not called by the forward of {where} ({type(module).__name__})"
        calls = _own_calls(seen)
        raise LayerNotFoundError(
            f"op {op.op!r} {wrong}; its own forward calls: {calls}. Ops inside a child module belong "
            f"to the child (tap 'child:op'); list them with layertap.summary(model, x, ops=True)"
        )


def _own_calls(seen: Mapping[str, int]) -> str:
    """The ops a module's forward was seen calling, for a message."""
    return ", ".join(sorted(seen)) or "no torch function that returns a tensor"
