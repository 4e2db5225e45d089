"""What a tap keeps: one store per captured kind under the keep policy, and the views that read them.

- ``keep="last"`` replaces a layer's value at each call, ``"first"`` keeps its first call's,
  ``"all"`` keeps one entry per call, in call order (gradients arrive in reverse call order, and
  are sorted in). Each entry holds its version guards (see `layertap.tap.inplace`), checked when
  it is read.
- ``nn.DataParallel`` runs replicas of every module in threads, one per device; they share the
  hooks, so the tap gathers their parts (`_Parts`) in device (= batch) order, on read.
- `_View` is the read-only mapping of one kind (``outputs``, ``inputs``, ``grads``,
  ``grad_inputs``); `Kept.table` what the tap holds, for a notebook.
"""

from __future__ import annotations

import itertools
import sys
import threading
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, Protocol

import torch
from torch import nn

from .. import nested
from ..errors import LayerNotRunError, TapError
from ..tables import Table
from ..units import human_bytes
from .grads import Gradients


class _Parts:
    """One call's values from the replicas of ``nn.DataParallel``, gathered in batch order on read."""

    __slots__ = ("device", "guards", "slots")

    def __init__(self, size: int, device: torch.device) -> None:
        self.slots: list[Any] = [None] * size
        self.device = device
        self.guards: list = []

    @property
    def received(self) -> bool:
        return any(p.received if isinstance(p, Gradients) else p is not None for p in self.slots)

    def value(self) -> Any:
        parts = [p.value() if isinstance(p, Gradients) else p for p in self.slots]
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
    return value.received if isinstance(value, (Gradients, _Parts)) else True


def _value(value: Any) -> Any:
    """What an entry reads as: gradients and replicas' parts put together."""
    return value.value() if isinstance(value, (Gradients, _Parts)) else value


class _Store:
    """The values of one kind per layer, under the keep policy, with their version guards."""

    def __init__(self, kind: str, keep: str) -> None:
        self.kind = kind
        self.keep = keep
        # name -> [(call index, value, [(tensor, version, copy key), ...])], sorted by call index
        self.entries: dict[str, list[tuple[int, Any, list]]] = {}
        # one model may run in several threads at once: a list being sorted reads as empty to
        # the others, and two first values of a layer would each make its list
        self._lock = threading.Lock()

    def wants(self, name: str, index: int) -> bool:
        kept = self.entries.get(name)
        return self.keep != "first" or not kept or index <= kept[0][0]  # a call that started earlier ends later inside it

    def has(self, name: str) -> bool:
        return any(_received(value) for _, value, _ in self.entries.get(name, ()))

    def find(self, name: str, index: int) -> Any:
        """The value stored for call ``index`` (another replica's part of the same call)."""
        return next((v for i, v, _ in self.entries.get(name, ()) if i == index), None)

    def pop_replaced(self, name: str, index: int) -> list[Any]:
        """Remove the value that a value of call ``index`` would replace; returns it in a list
        that holds its last reference here (empty if none)."""
        with self._lock:
            kept = self.entries.get(name)
            if self.keep != "last" or not kept or index < kept[0][0]:
                return []
            del self.entries[name]
            return [kept.pop()[1]]

    def put(self, name: str, index: int, value: Any, guards: list) -> None:
        with self._lock:
            kept = self.entries.get(name)
            if kept is None:
                self.entries[name] = [(index, value, guards)]
            elif self.keep == "all":
                kept.append((index, value, guards))
                if kept[-2][0] > index:  # gradients arrive in reverse call order
                    kept.sort(key=lambda e: e[0])
            elif (self.keep == "last") == (index >= kept[0][0]):
                kept[0] = (index, value, guards)


def _compiled_hint() -> str:
    """Why a layer may seem not to run where torch.compile has compiled code in this process."""
    dynamo = sys.modules.get("torch._dynamo.utils")
    # a compiled function counts its frames; a compiled module with fullgraph=True only its graphs
    if dynamo is None or not (dynamo.counters["frames"].get("ok") or dynamo.counters["stats"].get("unique_graphs")):
        return ""
    return (
        "; or the model ran as code torch.compile made before the tap started (a compiled function, or the "
        "torch.compile(model) wrapper of a model tapped inside it), which skips hooks added later (edit= too): "
        "tap the compiled module itself (layertap.tap(compiled, ...)), which runs eagerly while tapped, or call "
        "torch._dynamo.reset() after starting the tap"
    )


class Kept:
    """A tap's stores, one per captured kind, and the replicas of ``nn.DataParallel`` they gather."""

    def __init__(self, model: nn.Module, kinds: Sequence[str], keep: str, warns: bool) -> None:
        self.keep = keep
        # keep='last' warns once per layer that runs more than once per forward: the counts when
        # the running forward began, and the layers warned about
        self._multi: tuple[dict[str | tuple[str, int], int], set[str]] | None = ({}, set()) if warns else None
        self.stores = {k: _Store(k, keep) for k in kinds}
        parallel = model if isinstance(model, nn.DataParallel) and model.device_ids else None
        self.devices = [torch.device("cuda", d).index if isinstance(d, int) else torch.device(d).index
                        for d in (parallel.device_ids if parallel else [])]  # fmt: skip
        self.gather_device = torch.device("cuda", parallel.output_device) if parallel else None

    @property
    def parallel(self) -> bool:
        """Whether the model is an ``nn.DataParallel`` with replicas."""
        return bool(self.devices)

    def replica(self, module: nn.Module, own: nn.Module, value: Any) -> int | None:
        """The position of a DataParallel replica's device, or None for the model's own module ``own``."""
        if not self.devices or module is own:
            return None
        first = nested.first_tensor(value)
        return self.devices.index(first.get_device()) if first is not None else 0

    def put(self, store: _Store, name: str, index: int, value: Any, guards: list, part: int | None) -> None:
        if part is not None:  # one replica's share of the batch
            parts = store.find(name, index)
            if isinstance(parts, _Parts):  # stored already: fill in this replica's share
                parts.slots[part] = value
                parts.guards.extend(guards)
                return
            assert self.gather_device is not None  # replicas exist only under DataParallel, which sets it
            parts = _Parts(len(self.devices), self.gather_device)
            parts.slots[part] = value
            parts.guards.extend(guards)
            value, guards = parts, parts.guards
        store.put(name, index, value, guards)

    def dropped(self) -> list[Any]:
        """Forget every value; returns them, in a list that holds their last references here."""
        out = [value for store in self.stores.values() for kept in store.entries.values() for _, value, _ in kept]
        for store in self.stores.values():
            store.entries.clear()
        return out

    def forward_started(self, calls: dict[str | tuple[str, int], int]) -> None:
        if self._multi is not None:
            self._multi = (calls.copy(), self._multi[1])

    def forward_ended(self, calls: dict[str | tuple[str, int], int]) -> None:
        """Warn once per layer that ran more than once in the forward that just ended (keep='last')."""
        if self._multi is None:
            return
        start, warned = self._multi
        for key, count in calls.items():
            runs = count - start.get(key, 0)
            if runs > 1 and isinstance(key, str) and key not in warned:
                warned.add(key)
                warnings.warn(
                    f"layertap: layer {key!r} ran {runs} times in one forward, and keep='last' keeps only "
                    "its last call; use keep='all' for every call, or keep='first'",
                    stacklevel=2,
                )

    def read(self, kind: str, layer: str, learn: Callable[[Any, bool], None], missing: Callable[[], None]) -> Any:
        """What ``layer`` holds of ``kind`` under the keep policy. An entry a later in-place op
        changed after capture raises (``keep='all'``: reads ``None``, with a warning), and its
        copy key is learned; ``missing()`` raises the error for an op its module never called."""
        if not self.stores[kind].has(layer):
            missing()
            when = "no backward reached it" if kind.startswith("grad") else "it did not run"
            if kind == "grad_input":  # register_full_backward_hook's grad_input is None there too
                when += ", or its input carries none (token ids, a tensor that does not require grad)"
            raise LayerNotRunError(
                f"layer {layer!r} is tapped but has no {kind} yet: nothing was recorded since the "
                f"tap started (or since clear()) because {when}. Check that the forward "
                f"{'and backward ' if kind.startswith('grad') else ''}went through this layer "
                f"(calling module.forward() directly bypasses hooks){_compiled_hint()}"
            )
        values: list[Any] = []
        lost: list[int] = []
        for _, value, guards in self.stores[kind].entries[layer]:
            changed = next((key for t, v, key in guards if t._version != v), None)
            if changed is not None:
                learn(changed, True)
                if self.keep != "all":
                    raise TapError(
                        f"the {kind} of layer {layer!r} was changed in place after it was captured "
                        "(by an in-place op later in the forward, or after it) and is lost for that forward; layertap "
                        "copies it from now on: run the forward again"
                    )
                lost.append(len(values))  # this entry alone: the others are intact
                values.append(None)
                continue
            values.append(_value(value))
        if lost:
            warnings.warn(
                f"layertap: entries {lost} of the {len(values)} {kind}s of layer {layer!r} were changed in place "
                "after capture (by an in-place op later in the forward, or after it) and are lost (None); the others are intact, "
                f"and layertap copies those calls from now on. To lose none, tap with copy=True or copy=[{layer!r}]",
                stacklevel=4,
            )
        return values if self.keep == "all" else values[0]

    def table(self, names: Sequence[str], ran: Sequence[str], capture: Sequence[str], facts: list[tuple[str, str]], observing: bool) -> str:
        """The tap in a notebook: per layer and kind, the shape, dtype and bytes of what it holds."""
        rows, total = [], 0
        for name in [*ran, *(n for n in names if n not in ran)]:
            for kind in capture:
                kept = [_value(v) for _, v, _ in self.stores[kind].entries.get(name, ())]
                tensors = [nested.tensors(v) for v in kept if v is not None]
                size = sum(t.numel() * t.element_size() for ts in tensors for t in ts)
                total += size
                shape = ", ".join(str(list(t.shape)) for t in tensors[-1]) if tensors else "-"
                dtypes = ", ".join(sorted({str(t.dtype).removeprefix("torch.") for ts in tensors for t in ts}))
                rows.append([name, kind, str(len(tensors)), shape, dtypes or "-", human_bytes(size) if tensors else "-"])
        held = "none: every value goes to observe=" if observing else f"{human_bytes(total)} (keep={self.keep!r})"
        return Table(
            ["layer", "kind", "calls kept", "shape (last call)", "dtype", "bytes"],
            rows,
            numeric={"calls kept", "bytes"},
            title="layertap.Tap",
            facts=[*facts, ("held", held)],
        ).html()


class _Reads(Protocol):
    """What a view reads of its tap."""

    names: list[str]
    _kept: Kept
    _aliases: dict[str, str]
    _tapped: set[str]

    def _read(self, kind: str, name: str) -> Any: ...


class View(Mapping):
    """A read-only mapping of one kind of captured value."""

    def __init__(self, tap: _Reads, kind: str) -> None:
        self._tap, self._kind = tap, kind

    def __getitem__(self, name: str) -> Any:
        return self._tap._read(self._kind, name)

    def _present(self) -> list[str]:
        store = self._tap._kept.stores.get(self._kind)
        return [n for n in self._tap.names if store is not None and store.has(n)]

    def __iter__(self) -> Iterator[str]:
        return iter(self._present())

    def __len__(self) -> int:
        return len(self._present())

    def __contains__(self, name: object) -> bool:  # one lookup, not a scan: callers test every layer
        store = self._tap._kept.stores.get(self._kind)
        found = self._tap._aliases.get(name) if isinstance(name, str) else None
        return store is not None and found in self._tap._tapped and store.has(found)

    def __repr__(self) -> str:
        return f"<layertap {self._kind}s of {self._present()}>"

