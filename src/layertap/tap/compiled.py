"""Compiled modules run eagerly while tapped: a graph compiled before the hooks would skip them.
A compiled wrapper outside the tapped model (``torch.compile(model)`` called while ``model`` is
tapped) is not seen; with ``fullgraph=True`` Dynamo then traces the hooks and fails, which
`traced` turns into one line naming the fix."""

from __future__ import annotations

import contextlib
import functools
import os
import sys
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from torch import nn

from ..errors import TapError
from ..select import wrapped_child

_PACKAGE = str(Path(__file__).resolve().parents[1]) + os.sep  # layertap's own files, as tracebacks name them


@contextlib.contextmanager
def eager(modules: Iterable[nn.Module]) -> Iterator[None]:
    """Run compiled (sub)modules eagerly while tapped (``modules``: every module of the model).

    A graph compiled before the hooks existed would skip them silently (pytorch#117758), so the
    tap routes ``torch.compile``'d modules back to their original module and turns off
    ``Module.compile()``'s compiled call for its lifetime. Everything is restored afterwards.
    """
    undo: list[Callable[[], None]] = []
    try:
        for module in modules:
            state = module.__dict__
            # the cheap test first: this runs over every module at each entry of the tap
            if "_orig_mod" in state["_modules"] and wrapped_child(module) == "_orig_mod" and "forward" in state:
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


def traced(error: BaseException | None) -> TapError | None:
    """The error to raise instead of ``error`` where it is Dynamo failing to trace the tap's own
    hooks (a compiled wrapper of the tapped model, with ``fullgraph=True``); else None."""
    dynamo = sys.modules.get("torch._dynamo.exc")
    if dynamo is None or not isinstance(error, dynamo.TorchDynamoException) or _PACKAGE not in str(error):
        return None
    return TapError(
        "torch.compile traced layertap's hooks, which it cannot put in one graph (fullgraph=True): the model ran "
        "through a compiled wrapper made outside the tap. Tap the compiled module itself (layertap.tap(compiled, ...)), "
        "which runs eagerly while tapped, or compile without fullgraph=True"
    )
