"""Nested outputs: tuples, lists, dicts, dataclasses, Hugging Face ``ModelOutput`` and ``PackedSequence``.

``torch.utils._pytree`` knows the containers PyTorch registers (and ``transformers`` registers
``ModelOutput``); plain dataclasses are walked field by field on top of it.

A ``PackedSequence`` holds one value, its ``data``. Its ``batch_sizes`` must stay a CPU int64
tensor and its permutations live on the data's device, so they are carried along rather than
mapped, as ``PackedSequence.to()`` does: pytree would pass every field to ``fn`` and rebuild
through ``PackedSequence.__new__``, which rejects a moved ``batch_sizes`` and non-tensor leaves.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree
from torch.nn.utils.rnn import PackedSequence


def _is_packed(x: Any) -> bool:
    return isinstance(x, PackedSequence)


def _repack(old: PackedSequence, data: Any) -> PackedSequence:
    """``old`` with new ``data``; ``batch_sizes`` kept, the permutations moved to the data's device."""
    if not isinstance(data, torch.Tensor):  # a skeleton or a description (shapes), never run
        return PackedSequence._make((data, *old[1:]))  # _make skips __new__'s checks of batch_sizes

    def follow(t: torch.Tensor | None) -> torch.Tensor | None:
        return None if t is None else t.to(data.device)

    return PackedSequence(data, old.batch_sizes, follow(old.sorted_indices), follow(old.unsorted_indices))


# values that hold no tensor and are no container: a flat call's other arguments (dims, flags, None)
_PLAIN = (int, float, bool, str, bytes, type(None), torch.dtype, torch.device, torch.Size, slice)


def _flat(obj: Any, leaf: type | tuple[type, ...]) -> bool:
    """Whether ``obj`` is leaves and plain values in plain tuples, lists, dicts and namedtuples
    (a call's ``Inputs(args, kwargs)``): what `map_leaves` and `tensors` walk without pytree, in
    pytree's own order (a dict's in insertion order), at a fraction of its cost."""
    if isinstance(obj, (leaf, _PLAIN) if isinstance(leaf, type) else (*leaf, *_PLAIN)):
        return True
    kind = type(obj)
    if kind is dict:
        return all(_flat(v, leaf) for v in obj.values())
    if kind is tuple or kind is list or (kind.__bases__ == (tuple,) and hasattr(kind, "_make")):  # namedtuples (not structseqs)
        return all(_flat(v, leaf) for v in obj)
    return False


def _flat_map(fn: Callable[[Any], Any], obj: Any, leaf: type | tuple[type, ...]) -> Any:
    """``obj``, which `_flat` accepted, with ``fn`` applied to its leaves."""
    if isinstance(obj, leaf):
        return fn(obj)
    if isinstance(obj, _PLAIN):  # torch.Size is a tuple too
        return obj
    kind = type(obj)
    if kind is dict:
        return {k: _flat_map(fn, v, leaf) for k, v in obj.items()}
    if kind is tuple or kind is list:
        return kind(_flat_map(fn, v, leaf) for v in obj)
    if isinstance(obj, tuple):  # a namedtuple, rebuilt as pytree does
        return kind(*(_flat_map(fn, v, leaf) for v in obj))
    return obj


def map_leaves(fn: Callable[[Any], Any], obj: Any, leaf: type | tuple[type, ...] = torch.Tensor) -> Any:
    """Apply ``fn`` to every leaf of type ``leaf`` in ``obj``, keeping the structure."""
    if isinstance(obj, leaf):  # the common case first: hooks run on every forward
        return fn(obj)
    if _flat(obj, leaf):
        return _flat_map(fn, obj, leaf)

    def visit(x: Any) -> Any:
        if isinstance(x, leaf):
            return fn(x)
        if isinstance(x, PackedSequence):
            return _repack(x, map_leaves(fn, x.data, leaf))
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            changes = {
                f.name: map_leaves(fn, getattr(x, f.name), leaf)
                for f in dataclasses.fields(x)
                if f.init
            }
            return dataclasses.replace(x, **changes)
        return x

    return pytree.tree_map(visit, obj, is_leaf=_is_packed)


def tensors(obj: Any) -> list[torch.Tensor]:
    """The tensor leaves of ``obj`` (a ``PackedSequence`` gives its data), in a stable order.

    Collected without rebuilding any container, so it works on any value, even one whose
    constructor would reject its own leaves.
    """
    if isinstance(obj, torch.Tensor):
        return [obj]
    found: list[torch.Tensor] = []
    if _flat(obj, torch.Tensor):
        _flat_map(found.append, obj, torch.Tensor)
        return found
    for x in pytree.tree_leaves(obj, is_leaf=_is_packed):
        if isinstance(x, torch.Tensor):
            found.append(x)
        elif isinstance(x, PackedSequence):
            found.append(x.data)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            found += tensors([getattr(x, f.name) for f in dataclasses.fields(x) if f.init])
    return found


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The first tensor leaf of ``obj`` (``None`` if it holds none)."""
    leaves = tensors(obj)
    return leaves[0] if leaves else None


def shapes(obj: Any) -> Any:
    """The structure of ``obj`` with each tensor (and each field of a ``PackedSequence``) replaced
    by its shape as a list."""

    def shape(x: torch.Tensor | PackedSequence) -> Any:
        if isinstance(x, PackedSequence):
            return PackedSequence._make(None if t is None else list(t.shape) for t in x)
        return list(x.shape)

    return map_leaves(shape, obj, leaf=(torch.Tensor, PackedSequence))
