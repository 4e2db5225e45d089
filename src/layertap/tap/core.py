"""The tap: hooks on chosen layers that capture outputs, inputs and gradients, then go away.

>>> import torch, torchvision, layertap
>>> model = torchvision.models.resnet18().eval()
>>> with layertap.tap(model, ["layer1", "layer4"]) as taps:
...     logits = model(torch.randn(2, 3, 64, 64))
>>> taps["layer4"].shape
torch.Size([2, 512, 2, 2])

How values are kept correct and cheap (each mechanism lives in its own file of this package,
which says how it works):

- Inputs are captured in a forward *pre*-hook, before an in-place module (``ReLU(inplace=True)``)
  overwrites them; outputs in a forward hook.
- One definition of a gradient, hooked on tensors that carry only the layer's edge:
  `layertap.tap.grads`.
- A stored tensor that shares memory with the network's own activation is copied where a later
  in-place op changes it, and guarded elsewhere: `layertap.tap.inplace`.
- Copies reuse memory and stream past the caches: `layertap.tap.copies`.
- What is kept per call (``keep=``), the DataParallel replicas' parts, the views: `layertap.tap.kept`.
- A padded text batch's ``attention_mask``, for reductions over the real tokens only:
  `layertap.tap.masks`.
- A tensor-parallel model's values are the full logical activations (``gather=``):
  `layertap.tap.sharded`.
- Ops inside a module's forward (``"layer1.0:add_"``), through a ``TorchFunctionMode``:
  `layertap.tap.ops`. Compiled modules run eagerly while tapped: `layertap.tap.compiled`.
- A checkpoint's recomputation during backward is not a new call: `layertap.tap.recompute`.
- The tap's own work inside a hook that fails (a value it cannot rebuild or move) raises a
  `TapError` naming the layer, with the original error chained.

``observe=f(name, kind, call, value)`` hands each value to ``f`` inside the hook instead of
keeping it, uncopied (valid during the call only): statistics and searches read every layer
without holding any. `Tap.order` is the order the tapped layers and ops first ran.

`Tap` composes those helpers: it checks the options, resolves the layers once (a
`layertap.select.Selection`), owns the hooks' lifetime and runs the hook bodies, which count
each call and hand its value to the helpers.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Sequence
from typing import Any, Literal

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from .. import nested
from ..errors import LayerNotFoundError, LayertapError, TapError
from ..select import Layers, OpName, Selection, selection
from . import masks
from .compiled import eager, traced
from .controls import DType, Reduce, capture_failed, make_transform, shares_memory
from .copies import Copies
from .edits import Changes, applied, edited, ran, replaced
from .grads import Call, Gradients, Grads, required
from .inplace import InPlace
from .kept import Kept, _Store
from .ops import OpTaps, hidden, op_name, returns_tensor, weak
from .options import KINDS, Edit, Inputs, Kind, Observe, Options, Replace, _arguments, _given, checked, copied
from .recompute import recomputing
from .results import Results
from .sharded import Sharded, arrived, whole


class _StopForward(Exception):
    """Raised by the last tapped layer when ``stop_early=True``; the tap swallows it."""

    def __init__(self, tap: Tap) -> None:
        super().__init__("layertap stopped the forward after the last tapped layer")
        self.tap = tap


class Tap(Results):
    """Hooks on the chosen layers of a model; made by `layertap.tap`, which documents the options.

    The tap is a read-only mapping from layer name to its output; ``outputs``, ``inputs``,
    ``grads`` and ``grad_inputs`` are the mappings of each kind. Hooks exist only between
    ``__enter__`` and ``__exit__``.
    """

    def __init__(self, model: nn.Module, layers: Layers | Selection, options: Options) -> None:
        kinds = checked(options)
        self.model, self.capture, self.keep, self.stop_early = model, kinds, options.keep, options.stop_early
        self._observe = options.observe
        self._selection = chosen = selection(model, layers)
        # "module:*" names every op as it runs; the other names are known now
        if chosen.star and self.stop_early:
            raise TapError(
                "stop_early=True (the default of layertap.extract and FeatureExtractor) needs a known set of layers: "
                "name the ops instead of 'module:*', or pass stop_early=False"
            )
        self.names: list[str] = [n for n in chosen.names if n not in chosen.ops or chosen.ops[n].op != "*"]
        self._tapped = set(self.names)
        self._modules: dict[str, nn.Module] = dict(chosen.modules)  # the tapped and edited modules, and ops' owners
        # op name -> its parsed site: the tapped and edited ops, and those of "module:*" as they run
        self._sites: dict[str, OpName] = {n: op for n, op in chosen.ops.items() if n in self._tapped}
        self._aliases: dict[str, str] = {}  # a tapped layer may be read by its name with or without wrapper segments
        for name in self.names:
            self._add_aliases(name)
        self._kept = Kept(model, kinds, self.keep, warns=self.keep == "last" and self._observe is None)
        if self._kept.parallel and self.stop_early:
            raise TapError("stop_early=True is not supported under nn.DataParallel: tap model.module, or drop stop_early")
        self._changes = Changes()  # what an edit returns unlike its layer, named on an error (edits.py)
        edits = edited(options.edit, chosen, self.names, self._changes)
        self._sharded = sharded = Sharded.of(chosen.every, options.gather)  # tensor-parallel parts seen whole (sharded.py)
        self._edits = edits.functions if sharded is None else {n: sharded.edit(f) for n, f in edits.functions.items()}
        runs = replaced(options.replace, chosen, self.names)  # ops only: their modules are the ops' owners
        self._runs = runs.functions
        self._modules.update(edits.modules | runs.modules)
        self._sites.update((name, op) for name, op in (edits.ops | runs.ops).items() if name not in self._sites)
        self._ops = OpTaps(self._sites, chosen.star, self._modules, weak(self._op_hook), changes={*self._edits, *self._runs})
        self._ops.refuse(self._kept.parallel, None if sharded is None else sharded.check_ops)
        gather = None if sharded is None else lambda t: whole(t, options.gather)
        self._transform = make_transform(detach=options.detach, to=options.to, dtype=options.dtype, reduce=options.reduce, whole=gather)
        # who may read the call's mask, and the modules whose own mask it may be (masks.py)
        self._masks = masks.around(model, chosen.layers, self._modules, chosen.aliases) if options.reduce is not None or self._observe is not None else None
        self._grads = Grads(self._transform, self._observe, self.keep, weak(self._put_grads))
        self._copies = Copies()
        # only a tap that may keep a tensor of the network's own learns about in-place ops: a reduction always makes a fresh one
        learns = options.reduce is None and self._observe is None and bool({"output", "input"} & set(kinds))
        self._inplace = InPlace(learns, copied(options.copy, chosen, self.names), weak(self._where))
        self._handles: list[RemovableHandle] = []
        self._restore: contextlib.ExitStack | None = None
        self._calls: dict[str | tuple[str, int], int] = {}  # calls counted per layer since clear()
        self._order: dict[str, None] = {}  # names in the order their first call started
        self._fired: set[str] = set()
        self._want_input, self._want_grad_input = "input" in kinds, "grad_input" in kinds
        self._want_grads, self._only_inputs = self._want_grad_input or "grad" in kinds, not ({"output", "grad"} & set(kinds))
        self._open: dict[str, list[int]] = {}  # per module, the numbers of its calls started and not ended (recursion)

    def _add_aliases(self, name: str) -> None:
        op = self._sites.get(name)
        for alias in self._selection.aliases(name if op is None else op.module):
            self._aliases.setdefault(alias if op is None else op.on(alias), name)

    # ------------------------------------------------------------------ hook lifetime
    def __enter__(self) -> Tap:
        if self._restore is not None:
            raise TapError("this tap is already active: create a new layertap.tap for a nested tap")
        self._restore = contextlib.ExitStack()
        try:
            self._restore.enter_context(eager(self._selection.every))
            self._register()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, exc_type, exc, tb) -> bool:
        self.remove()
        if isinstance(exc, _StopForward) and exc.tap is self:
            return True
        self._changes.annotate(exc)
        refused = traced(exc)
        if refused is not None:
            raise refused from None
        return False

    def remove(self) -> None:
        """Remove every hook now (idempotent); captured values stay readable."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._grads.open.clear()
        self._open.clear()  # calls a failed forward started and never ended
        self._inplace.stop()
        if self._restore is not None:
            self._restore.close()
            self._restore = None

    def clear(self) -> None:
        """Forget every captured value and restart call counting (for ``keep='all'``)."""
        self._copies.drop(self._kept.dropped())  # first leaf first: each new copy can take its predecessor's memory
        self._calls.clear()
        self._open.clear()
        self._order.clear()
        self._fired.clear()
        self._inplace.restart()

    def _register(self) -> None:
        assert self._restore is not None
        handles, root = self._handles, self.model
        handles.append(root.register_forward_pre_hook(hidden(self._on_root_start), with_kwargs=True))
        handles.append(root.register_forward_hook(hidden(self._on_root_end), always_call=True))
        for name in dict.fromkeys(self.names + list(self._edits)):
            if name in self._sites:
                continue
            module = self._modules[name]
            tapped = name in self._tapped
            if tapped:  # notes the start (for `order`) and captures inputs
                handles.append(module.register_forward_pre_hook(hidden(self._pre_hook(name)), with_kwargs=True))
            handles.append(module.register_forward_hook(hidden(self._hook(name, tapped))))
        if self._ops:
            self._ops.register(handles, self._restore)
        if self._sharded is not None:
            self._sharded.register(handles)
        # the call's attention_mask for the reductions, until the root's own hook has run: hooked last
        if self._masks is not None:
            handles += masks.watch(root, self._masks)

    def _on_root_start(self, module: nn.Module, args: tuple, kwargs: dict) -> None:
        if recomputing():  # a checkpoint's recomputation of the model: no new forward (recompute.py)
            return
        self._fired.clear()
        self._changes.forward_started()
        self._copies.forward_started()
        self._inplace.forward_started(self._calls)
        self._kept.forward_started(self._calls)
        self._grads.forward_started()

    def _on_root_end(self, module: nn.Module, args: tuple, output: Any) -> None:
        if recomputing():
            return
        self._inplace.forward_ended()
        self._kept.forward_ended(self._calls)
        self._grads.forward_ended()

    # ------------------------------------------------------------------ the hooks
    def _pre_hook(self, name: str) -> Callable:
        want_inputs = self._want_input or self._want_grad_input
        grads, sharded, numbers = self._want_grads, self._sharded, not self._only_inputs and not self._kept.parallel

        def hook(module: nn.Module, args: tuple, kwargs: dict) -> tuple | None:
            if recomputing():  # a checkpoint's recomputation: nothing taken, nothing counted (recompute.py)
                return required((args, kwargs)) if self._grows("grad_input", name) else None  # but what the first pass grew
            if name not in self._order:
                self._order[name] = None
            # a call is numbered as it starts, for all kinds: one that calls its own module ends after the inner call
            index = self._next_call(name) if numbers else None
            if index is not None:
                self._open.setdefault(name, []).append(index)
            if not (want_inputs or grads):
                return None
            single = len(args) == 1 and not kwargs
            value = args[0] if single else Inputs(args, kwargs)
            unwrap = None
            if sharded is not None:
                value, unwrap = sharded.wrap_parts(module, value)
            call = Call()
            if want_inputs:
                value = self._take_input(name, module, value, self._replica(module, name, value), call, index)
            if grads:  # what the layer is given, for its forward hook
                call.saw(value)
                self._grads.opened(name, module, call)
            if not self._want_grad_input:
                return None
            if unwrap is not None:
                value = unwrap(value)
            return ((value,), {}) if single else (value.args, value.kwargs)

        return hook

    def _hook(self, name: str, tapped: bool) -> Callable:
        edit = self._edits.get(name)
        counts = tapped and not self._only_inputs
        grads, sharded = tapped and self._want_grads, self._sharded
        grown = counts and "grad" in self._kept.stores  # its outputs needed a gradient: in a recomputation too (`_grows`)

        def hook(module: nn.Module, args: tuple, output: Any) -> Any:
            again = recomputing()  # a checkpoint's recomputation: only the edit runs again (recompute.py)
            call = self._grads.closed(name, module, output) if grads and not again else None  # the call its pre-hook opened
            part = None if sharded is None else sharded.part(name, module, args, output)
            if part is not None:  # a rank's plain part: the tap works on the DTensor it is part of
                output = part.wrap(output)
            # the edit runs first: what it returns is what flows on, is captured and gets the
            # gradient hooks (heatmaps rely on this to turn autograd on at their layer)
            new = edit(name, output) if edit is not None else None
            if new is not None:
                output = new
            if again and grown and self._grows("grad", name):
                output = new = required(output)
            if counts and not again:
                taken = self._take_output(name, module, output, self._replica(module, name, output), call)
                if taken is not output:
                    new = taken
            if part is not None:
                return part.unwrap(output if new is None else new)
            return new

        return hook

    def _take_input(
        self, name: str, module: nn.Module, value: Any, part: int | None, call: Call, index: int | None = None, watch: bool = True
    ) -> Any:
        """Capture one call's input (numbered ``index``, if its pre-hook numbered it); returns it, with gradient
        hooks if ``grad_input`` is captured (and ``watch``): the aliases it makes go to ``call``, to rebase after the call."""
        try:
            key = name if part is None else (name, part)
            if index is None:
                index = self._next_call(key) if self._only_inputs else self._calls.get(key, 0)
            if self._want_grad_input and watch:
                value, _ = self._watch("grad_input", name, index, value, part, call)
            if self._want_input:
                self._record("input", name, index, value, part)
        except LayertapError:
            raise
        except Exception as e:  # costs nothing unless raised
            raise capture_failed("input", name, module, e, value, self._observe is not None) from e
        if self._only_inputs:
            self._fire(name)
        return value

    def _take_output(self, name: str, module: nn.Module, output: Any, part: int | None, call: Call | None) -> Any:
        """Capture one call's output; returns it, with gradient hooks if ``grad`` is captured
        (``call``: what the call was given)."""
        try:
            started = self._open.get(name) if part is None else None  # numbered as it started (a module's call)
            index = started.pop() if started else self._next_call(name if part is None else (name, part))
            if "grad" in self._kept.stores:
                output, _ = self._watch("grad", name, index, output, part, call or Call())
            if "output" in self._kept.stores:
                self._record("output", name, index, output, part)
        except LayertapError:
            raise
        except Exception as e:
            raise capture_failed("output", name, module, e, output, self._observe is not None) from e
        self._fire(name)
        return output

    def _op_hook(self, owner: str, hits: list[str], star: OpName | None, saw: Callable[[Any], bool], func: Any, args: tuple, kwargs: dict) -> Any:
        """One call of a tapped op, or of any op of a module tapped whole (``star``), inside its
        module's forward (see `layertap.tap.ops`): captured as a module's call would be."""
        if recomputing():  # a checkpoint's recomputation: the op runs (or is replaced) and is edited again, nothing taken
            return self._again(hits, star is not None, func, args, kwargs)
        tapped = [name for name in hits if name in self._tapped]
        module = self._modules[owner]
        # an op on one tensor gives that tensor as its input, whatever options it got (F.relu's inplace=)
        single = len(args) == 1 and nested.first_tensor(kwargs) is None
        call = Call()
        if tapped and (self._want_input or self._want_grad_input):
            args, kwargs = self._op_inputs(tapped, module, single, args, kwargs, call)
        every = star.on(owner) if star is not None else ""  # this call's name, as "module:*" names it
        index, grads = (self._calls.get(every, 0) if star is not None else 0), None
        if star is not None and self._want_grad_input:
            # before the op, which may change its input in place; kept only if it returns a tensor
            value, grads = self._star_grads(every, module, index, _given(single, args, kwargs), call)
            args, kwargs = _arguments(single, value, kwargs)
        if self._want_grads:
            call.saw((args, kwargs))
        out = ran(self._runs, hits, func, args, kwargs)
        if call.swaps:
            call.rebase()
        if not saw(out):
            return out  # size(), dim(), shape: nothing to tap
        if star is not None:
            self._found(every, star, module, _given(single, args, kwargs), call, index, grads)
            tapped.append(every)
        out = applied(self._edits, hits, out)
        if not self._only_inputs:
            for name in tapped:
                self._started(name)
                out = self._take_output(name, module, out, None, call)
        return out

    def _again(self, hits: list[str], star: bool, func: Any, args: tuple, kwargs: dict) -> Any:
        """An op's call in a checkpoint's recomputation: run (or replaced) and edited again, with
        what needs a gradient in the first pass (`required`) needing one again."""
        tapped = next((name for name in hits if name in self._tapped), None)  # None for an op only "module:*" names
        if (star or tapped) and self._grows("grad_input", tapped):
            args, kwargs = required((args, kwargs))
        out = ran(self._runs, hits, func, args, kwargs)
        if not returns_tensor(out):
            return out
        out = applied(self._edits, hits, out)
        return required(out) if (star or tapped) and not self._only_inputs and self._grows("grad", tapped) else out

    def _grows(self, kind: str, name: str | None) -> bool:
        """Whether the first pass of a call being recomputed made its ``kind`` edge need a gradient:
        as `Grads.watch` does for a call the keep policy wants (``keep="first"``: none kept yet)."""
        if kind not in self._kept.stores:
            return False
        kept = self._kept.stores[kind].entries.get(name) if name is not None else None
        return self._observe is not None or self.keep != "first" or not kept

    def _op_inputs(self, tapped: list[str], module: nn.Module, single: bool, args: tuple, kwargs: dict, call: Call) -> tuple[tuple, dict]:
        """Capture the inputs of an op's call; returns its arguments, with gradient hooks for ``grad_input``."""
        value = _given(single, args, kwargs)
        for name in tapped:
            self._started(name)
            value = self._take_input(name, module, value, None, call)
        return _arguments(single, value, kwargs) if self._want_grad_input else (args, kwargs)

    def _star_grads(self, name: str, module: nn.Module, index: int, value: Any, call: Call) -> tuple[Any, Gradients | None]:
        """Gradient hooks on the input of a call of an op of a module tapped whole."""
        try:
            return self._watch("grad_input", name, index, value, None, call, put=False)
        except LayertapError:
            raise
        except Exception as e:
            raise capture_failed("input", name, module, e, value, self._observe is not None) from e

    def _found(self, name: str, site: OpName, module: nn.Module, value: Any, call: Call, index: int, grads: Gradients | None) -> None:
        """A call of an op of a module tapped whole (``"module:*"``) that returned a tensor: tapped from now on."""
        if name not in self._tapped:
            self.names.append(name)
            self._tapped.add(name)
            self._sites[name] = site
            self._add_aliases(name)
        self._started(name)
        if self._want_input or self._want_grad_input:
            self._take_input(name, module, value, None, call, watch=False)
        if grads is not None and self.keep == "all" and not grads.stored:  # entry i is call i
            grads.stored = True
            self._put_grads("grad_input", name, index, grads, None)

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
        return self._kept.replica(module, self._modules[name], value) if self._kept.parallel else None

    def _fire(self, name: str) -> None:
        if not self.stop_early:
            return
        self._fired.add(name)
        if len(self._fired) == len(self.names):
            self._fired.clear()
            raise _StopForward(self)

    def _watch(
        self, kind: str, name: str, index: int, value: Any, part: int | None, call: Call, put: bool = True
    ) -> tuple[Any, Gradients | None]:
        return self._grads.watch(kind, name, index, value, part, call, self._kept.stores[kind].wants(name, index), put)

    def _put_grads(self, kind: str, name: str, index: int, grads: Gradients, part: int | None) -> None:
        self._kept.put(self._kept.stores[kind], name, index, grads, [], part)

    def _record(self, kind: Kind, name: str, index: int, value: Any, part: int | None = None) -> None:
        transform = self._transform
        if self._observe is not None:  # handed over as it is now, kept by nobody here
            self._observe(name, kind, index, nested.map_leaves(transform, value))
            return
        store: _Store = self._kept.stores[kind]
        if not store.wants(name, index):
            return
        value = value if self._sharded is None else nested.map_leaves(arrived, value)  # read what arrived, not a promise
        inplace, copies = self._inplace, self._copies
        if part is None and inplace.start is not None:
            # the value this call replaces is dropped first, so that the pool can hand its memory
            # to the new copy; only inside a forward of the model (start is None elsewhere, and
            # for a tap that never copies)
            replaced = store.pop_replaced(name, index)
            if replaced:
                copies.drop(replaced)
        guards: list = []

        def keep(t: torch.Tensor) -> torch.Tensor:
            out = transform(t)
            if not shares_memory(out, t):
                return out
            return inplace.copied(out, copies.copy(out)) if inplace.must_copy(t, out, kind, name, index, part, guards) else out

        self._kept.put(store, name, index, nested.map_leaves(keep, value), guards, part)


def tap(
    model: nn.Module,
    layers: Layers | Selection,
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
    gather: bool = True,
    replace: Replace = None,
) -> Tap:
    """Tap ``layers`` of ``model`` for the duration of a ``with`` block.

    Args:
        layers: names, globs, regexes, module classes or predicates (see `layertap.select`), or a
            `layertap.select.Selection` of ``model`` made once by `layertap.select.selection`.
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
            floating-point tensors to, after ``reduce`` (complex ones: to the complex dtype of
            that precision; bfloat16 has none, so they stay as they are).
        reduce: ``"mean"``, ``"max"``, ``"flatten"``, ``"cls"`` (token 0), ``"last"`` (the last
            token) or a callable, applied on the layer's own device before the tensor is stored.
            When the model is called with a ``[B, T]`` ``attention_mask``, a ``[B, T, C]`` tensor
            is reduced over its real tokens only: mean and max leave the padding out, ``"cls"``
            and ``"last"`` are the first and last real tokens, whatever the padding side.
        stop_early: end the forward (by an exception the tap swallows) as soon as every tapped
            layer has fired, so the rest of the network never runs; put the forward last in the
            ``with`` block.
        edit: ``f(name, output) -> new_output`` for every tapped layer, or ``{spec: f}``; the
            result (unless ``None``) replaces the output downstream, and is what is captured.
            If it differs from the output in shape, dtype or device and an error leaves the
            ``with`` block, the error gets a note naming the edit and both kinds.
        replace: ``f(name, func, args, kwargs) -> result`` for every tapped op, or ``{op spec: f}``:
            called *in place of* the op (``func(*args, **kwargs)`` is not run unless ``f`` runs
            it; of several naming one call, the first); its result is the op's, then edited
            and captured as usual.
        copy: ``True``, or specs of tapped layers, whose values are always copied rather than
            guarded, so that no in-place op can lose one (the cost: a copy per call).
        observe: ``f(name, kind, call, value)``, called inside the hook with each value as it
            would be stored (after ``detach``/``to``/``dtype``/``reduce``), for every call
            whatever ``keep`` says; the tap then keeps nothing. ``call`` counts the layer's
            calls since the tap began (or ``clear()``). The value is not copied: it is valid
            during the call only (a later in-place op may change it). A gradient is handed over
            tensor by tensor, as the backward reaches each.
        gather: on a tensor-parallel model (DTensor weights, ``parallelize_module``), each value
            is the full logical activation, the same on every rank (one all-gather each);
            ``False`` keeps the rank's part as a DTensor with its placements, with no collective
            (see `layertap.tap.sharded`).

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
    return Tap(model, layers, Options(capture, keep, detach, to, dtype, reduce, stop_early, edit, observe, copy, gather, replace))


__all__ = ["tap", "Tap", "Inputs", "KINDS", "LayerNotFoundError", "op_name"]
