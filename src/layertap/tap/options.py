"""What `layertap.tap` is given: the kinds it captures, the keep policies, the checks of the options
together, and ``copy=`` resolved against the tapped layers (``edit=`` and ``replace=``: `layertap.tap.edits`);
`Inputs`, the form a captured input of several arguments takes."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from typing import Any, Literal, NamedTuple

import torch

from ..errors import ArgumentError, TapError
from ..select import Layers, Selection
from .controls import DType, Reduce

Kind = Literal["output", "input", "grad", "grad_input"]
KINDS: tuple[str, ...] = ("output", "input", "grad", "grad_input")
KEEPS = ("last", "first", "all")
Edit = Callable[[str, Any], Any] | Mapping[Any, Callable[[str, Any], Any]] | None
Observe = Callable[[str, str, int, Any], None] | None
Run = Callable[[str, Any, tuple, dict], Any]  # replace=: f(name, func, args, kwargs) -> the op's result
Replace = Run | Mapping[Any, Run] | None


class Inputs(NamedTuple):
    """The inputs of a layer called with several (or keyword) arguments."""

    args: tuple
    kwargs: dict


def _given(single: bool, args: tuple, kwargs: dict) -> Any:
    """An op's input as the tap gives it: the tensor for an op on one tensor, else ``Inputs``."""
    return args[0] if single else Inputs(args, kwargs)


def _arguments(single: bool, value: Any, kwargs: dict) -> tuple[tuple, dict]:
    """An op's arguments again, from its input as `_given` made it (with gradient hooks now)."""
    return ((value,), kwargs) if single else (value.args, value.kwargs)


class Options(NamedTuple):
    """`layertap.tap`'s options as given (`layertap.tap` documents them; `checked` checks them)."""

    capture: Kind | Sequence[Kind]
    keep: Literal["last", "first", "all"]
    detach: bool
    to: torch.device | str | None
    dtype: DType
    reduce: Reduce
    stop_early: bool
    edit: Edit
    observe: Observe
    copy: bool | Layers
    gather: bool = True
    replace: Replace = None


def checked(options: Options) -> tuple[str, ...]:
    """The kinds ``capture=`` asks for; raises for an option unknown or at odds with another."""
    capture = options.capture
    kinds = (capture,) if isinstance(capture, str) else tuple(capture)
    unknown = [k for k in kinds if k not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"unknown capture={capture!r}: use any of {KINDS}")
    if options.keep not in KEEPS:
        raise ValueError(f"unknown keep={options.keep!r}: use one of {KEEPS}")
    if options.stop_early and any(k.startswith("grad") for k in kinds):
        raise TapError(
            "stop_early=True cuts the forward, so no backward can reach the tapped layers: "
            "drop stop_early to capture gradients"
        )
    if options.observe is not None and not callable(options.observe):
        raise TypeError(f"observe must be a function f(name, kind, call, value), got {type(options.observe).__name__}")
    return kinds


def copied(copy: bool | Layers, chosen: Selection, tapped: list[str]) -> set[str]:
    """The tapped names ``copy=`` names: their values are always copied, never guarded."""
    if copy is True:
        return set(tapped)
    if copy is False or copy is None:
        return set()
    names = set(chosen.select(copy).names)
    untapped = sorted(names - set(tapped))
    if untapped:
        raise ArgumentError(f"copy= names layers that are not tapped: {untapped[:3]}; add them to the tapped layers, or use copy=True")
    return names
