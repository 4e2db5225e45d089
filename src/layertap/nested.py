"""Nested outputs: tuples, lists, dicts, dataclasses and Hugging Face ``ModelOutput``.

``torch.utils._pytree`` knows the containers PyTorch registers (and ``transformers`` registers
``ModelOutput``); plain dataclasses are walked field by field on top of it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch
import torch.utils._pytree as pytree


def map_leaves(fn: Callable[[Any], Any], obj: Any, leaf: type = torch.Tensor) -> Any:
    """Apply ``fn`` to every leaf of type ``leaf`` in ``obj``, keeping the structure."""
    if isinstance(obj, leaf):  # the common case first: hooks run on every forward
        return fn(obj)

    def visit(x: Any) -> Any:
        if isinstance(x, leaf):
            return fn(x)
        if dataclasses.is_dataclass(x) and not isinstance(x, type):
            changes = {
                f.name: map_leaves(fn, getattr(x, f.name), leaf)
                for f in dataclasses.fields(x)
                if f.init
            }
            return dataclasses.replace(x, **changes)
        return x

    return pytree.tree_map(visit, obj)


def tensors(obj: Any) -> list[torch.Tensor]:
    """The tensor leaves of ``obj``, in a stable order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    found: list[torch.Tensor] = []
    map_leaves(found.append, obj)
    return found


def first_tensor(obj: Any) -> torch.Tensor | None:
    """The first tensor leaf of ``obj`` (``None`` if it holds none)."""
    leaves = tensors(obj)
    return leaves[0] if leaves else None


def shapes(obj: Any) -> Any:
    """The structure of ``obj`` with each tensor replaced by its shape as a list."""
    return map_leaves(lambda t: list(t.shape), obj)
