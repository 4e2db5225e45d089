"""``edit=`` and ``replace=`` resolved against the tapped layers, and what the edits changed.

An edit may return a value of another shape, dtype or device than its layer gave (a pooled
output, a cast): sometimes on purpose, often not. The model's next layer then fails with
PyTorch's own message, which names neither the edit nor the layer. `Changes` records, per
forward, the first such difference of each edit, and the tap adds it as a note to an error that
leaves its ``with`` block, so that the traceback ends with the edit that caused it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
from torch import nn
from torch.utils import _pytree as pytree

from ..errors import TapError
from ..select import OpName, Selection
from .ops import shown
from .options import Edit, Replace


class Changes:
    """The edits of the running forward whose result differs in kind from what their layer gave."""

    def __init__(self) -> None:
        self.seen: dict[str, str] = {}  # edited name -> how its result differs, this forward

    def watched(self, edit: Callable[..., Any]) -> Callable[[str, Any], Any]:
        """``edit``, recording how its result differs from the layer's value."""

        def checked(name: str, value: Any) -> Any:
            try:
                new = edit(name, value)
            except Exception as e:  # raised inside the layer's hook: say it is the edit's, not the layer's
                e.add_note(f"layertap: raised by the edit= function of {name!r}, not by the layer")
                raise
            if new is not None and name not in self.seen:
                change = _difference(value, new)
                if change:
                    self.seen[name] = change
            return new

        return checked

    def forward_started(self) -> None:
        self.seen.clear()

    def annotate(self, error: BaseException | None) -> None:
        """Add a note naming the first differing edit to an error raised after it."""
        if error is None or not self.seen or not isinstance(error, Exception):
            return
        name, change = next(iter(self.seen.items()))
        error.add_note(
            f"layertap: the edit= of {name!r} returned {change}. If the error above comes from a later layer, "
            "return a value of the layer's own shape, dtype and device from edit="
        )


def _difference(value: Any, new: Any) -> str | None:
    """How ``new`` differs from ``value`` in its tensors' shape, dtype or device (None: it does not)."""
    old_leaves, new_leaves = (
        [t for t in pytree.tree_leaves(v) if isinstance(t, torch.Tensor)] for v in (value, new)
    )  # fmt: skip
    if len(old_leaves) != len(new_leaves):
        return f"{len(new_leaves)} tensor(s) where the layer gave {len(old_leaves)}"
    for old, t in zip(old_leaves, new_leaves, strict=True):
        if (old.shape, old.dtype, old.device) != (t.shape, t.dtype, t.device):
            return f"a {_kind(t)} tensor where the layer gave {_kind(old)}"
    return None


def _kind(t: torch.Tensor) -> str:
    return f"{list(t.shape)} {str(t.dtype).removeprefix('torch.')} on {t.device}"


def applied(edits: dict[str, Callable[[str, Any], Any]], names: list[str], out: Any) -> Any:
    """``out`` after the edits of ``names``, in turn: what each returns (unless None) replaces it."""
    for name in names:
        edit = edits.get(name)
        new = edit(name, out) if edit is not None else None
        if new is not None:
            out = new
    return out


def ran(runs: dict[str, Callable[..., Any]], hits: list[str], func: Any, args: tuple, kwargs: dict) -> Any:
    """The op's call, or in its place the first ``replace=`` function of the names it hits."""
    for name in hits:
        run = runs.get(name)
        if run is not None:
            return run(name, func, args, kwargs)
    return shown(func, args, kwargs)


class Edits(NamedTuple):
    """``edit=`` (or ``replace=``) resolved: the function of each name, and the ops and modules named."""

    functions: dict[str, Callable[..., Any]]
    ops: dict[str, OpName]
    modules: dict[str, nn.Module]


def edited(edit: Edit | Replace, chosen: Selection, tapped: list[str], changes: Changes | None = None, option: str = "edit") -> Edits:
    """``edit=`` (or the ``option`` named, ``replace=``) resolved against the model's ``chosen``
    layers (``tapped``: the names known now); each function watched by ``changes`` if given."""
    edits = Edits({}, {}, {})
    if edit is None:
        return edits
    watch = changes.watched if changes is not None else _as_given
    if callable(edit):
        if chosen.star:
            raise TapError(f"{option}= needs named ops, not 'module:*' (named only as they run): list them with summary(model, x, ops=True)")
        edits.functions.update(dict.fromkeys(tapped, watch(edit)))
        edits.ops.update((name, op) for name, op in chosen.ops.items() if name in edits.functions)
        return edits
    for spec, fn in edit.items():
        found = chosen.select([spec])  # a tuple key is one (module, op) spec, not a list of specs
        for name in found.names:
            op = found.ops.get(name)
            if op is not None and op.op == "*":
                raise TapError(f"{option}= needs named ops, not {name!r}: list the ops with summary(model, x, ops=True)")
            if op is not None:
                edits.ops[name] = op
            edits.functions[name] = watch(fn)
        edits.modules.update(found.modules)
    return edits


def replaced(replace: Replace, chosen: Selection, tapped: list[str]) -> Edits:
    """``replace=`` resolved: ops only, since a module's hooks cannot stand in for its forward."""
    runs = edited(replace, chosen, tapped, option="replace")
    modules = [name for name in runs.functions if name not in runs.ops]
    if modules:
        raise TapError(
            f"replace= stands in for ops inside a module's forward ('module:op'), and {modules[0]!r} is a module: "
            "name its op (list them with summary(model, x, ops=True)), or change its output with edit="
        )
    return runs


def _as_given(function: Callable[..., Any]) -> Callable[..., Any]:
    return function
