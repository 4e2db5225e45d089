"""In-place learning: which captured values a later in-place op changes, and the guards on the others.

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
  less memory. A write that bypasses the version counter (``h.data.clamp_(0)``, a NumPy view
  written in place) is seen in the forward that learns a call position, by comparing the copy
  with the network's tensor at its end (one read of each, once): the next forwards copy it. Such
  a write that happens only in some forwards cannot be told from a guard: ``copy=`` is the way.

`InPlace` holds one tap's share of this: what it learned (by kind, name and call position), the
values it copied to learn from and the ones it guards in the running forward, and the call
counts when that forward began. What it learns goes to `_LEARNED` too, for later taps.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable

import torch
from torch import nn

# a call position: (kind, tap name, position within a forward)
Key = tuple[str, str, int]
# where a tapped name lives: its module, and the op within it ((op, K of "#K" or None); None: the module itself)
Site = tuple[str, "int | None"] | None

# module -> {(kind, op or None, call position in a forward): whether a later in-place op changed
# its value}, shared by every tap
_LEARNED: weakref.WeakKeyDictionary[nn.Module, dict[tuple[str, Site, int], bool]] = weakref.WeakKeyDictionary()


class InPlace:
    """What one tap learns about in-place ops after its layers' calls, and the guards it keeps."""

    def __init__(self, learns: bool, always_copy: set[str], where: Callable[[str], tuple[nn.Module, Site]]) -> None:
        # the counts when the running forward of the model started (None outside one): a call's
        # position within its forward is its count minus this. Only a tap that may keep a
        # tensor of the network's own needs it: a reduction always makes a fresh one
        self.learns = learns
        self.start: dict[str | tuple[str, int], int] | None = None
        # layers whose values are always copied, never guarded: an in-place op can lose none of them
        self.always_copy = always_copy
        self._where = where
        # (kind, name, position) -> None: unknown yet, True: changed in place downstream, so copy;
        # False: guard. What earlier taps learned about a call position of a module is reused: it
        # is a property of the model's code.
        self.learned: dict[Key, bool | None] = {}
        # the call positions learned in the running forward: (key, the network's tensor, its
        # version, the value captured of it, the copy kept of that value, once made)
        self.pending: list[list] = []
        # the values guarded in the running forward: one changed by its end is copied from the next on
        self.guarded: list[tuple[torch.Tensor, int, Key]] = []

    def forward_started(self, calls: dict[str | tuple[str, int], int]) -> None:
        if self.learns:
            self.start = calls.copy()

    def forward_ended(self) -> None:
        """Learn what the forward that just ended changed in place."""
        for key, original, version, value, copy in self.pending:
            if self.learned.get(key) is not True:
                # a write that bypasses the version counter (h.data.clamp_(0), a NumPy view) shows
                # only in the values: compared once per call position, in the forward that learns it
                plain = copy is not None and value.layout == torch.strided and not value.is_nested  # what torch.equal reads
                bypassed = plain and not torch.equal(value, copy)
                self.learn(key, original._version != version or bypassed)
        for kept, version, key in self.guarded:
            if kept._version != version:
                self.learn(key, True)
        self.stop()

    def stop(self) -> None:
        """Outside a forward now (the hooks went, or it ended)."""
        self.pending.clear()
        self.guarded.clear()
        self.start = None

    def restart(self) -> None:
        """Call counting restarted (``clear()``) inside a forward."""
        if self.start is not None:
            self.start = {}

    def learn(self, key: Key, changed: bool) -> None:
        kind, name, position = key
        self.learned[key] = changed
        module, site = self._where(name)
        _LEARNED.setdefault(module, {})[kind, site, position] = changed

    def must_copy(self, t: torch.Tensor, out: torch.Tensor, kind: str, name: str, index: int, part: int | None, guards: list) -> bool:
        """Whether ``out`` (sharing memory with the network's ``t``) is copied; if not, it is guarded (in ``guards``)."""
        start = self.start
        # no version counter to watch under inference_mode, and no call position to learn
        # for outside a forward of the model (nor for a layer of copy=): copy
        if start is None or t.is_inference() or name in self.always_copy:
            return True
        position = index - start.get(name if part is None else (name, part), 0)
        key = (kind, name, position)
        try:
            copy = self.learned[key]
        except KeyError:  # new to this tap: what an earlier tap learned, if any
            module, site = self._where(name)
            copy = self.learned[key] = _LEARNED.get(module, {}).get((kind, site, position))
        if copy is False:
            guards.append((out, out._version, key))
            self.guarded.append((out, out._version, key))
            return False
        if copy is None:
            self.pending.append([key, t, t._version, out, None])
        return True

    def copied(self, out: torch.Tensor, copy: torch.Tensor) -> torch.Tensor:
        """``copy``, the copy `must_copy` asked for of ``out``; kept beside it to compare at the end
        of a forward that learns its call position."""
        if self.pending and self.pending[-1][3] is out:
            self.pending[-1][4] = copy
        return copy

