"""Progress bars: one policy for every call that takes long, in terminals and in notebooks.

The problem: a dataset pass, a statistics pass or a Score-CAM run can take minutes, and silence
looks like a hang; but a bar written into a log file or a pipe is noise, and a bar that only
checks for a terminal never shows in Jupyter, whose ``stderr`` is not one.

The rule, for every long-running API (each has ``progress: bool = True``):

- a bar is shown when ``progress`` is true, this is rank 0 of a job (``RANK`` unset or ``0``:
  one bar per ``torchrun`` job), and ``stderr`` is a terminal or the code runs in an IPython
  kernel (Jupyter, VS Code, Colab);
- the bar is ``tqdm.auto``'s: a widget in a notebook (with ``ipywidgets``), text on ``stderr``
  elsewhere. tqdm comes with the ``cli`` extra; without it there is no bar, and no error;
- otherwise (piped, ``progress=False``, another rank) nothing is written.

The cost: nothing when no bar is shown; tqdm redraws at most ten times a second.

What a bar or `say` writes has its control characters escaped (`layertap.printable`): a
description or a message may name a file, whose name could hold a terminal escape sequence.

>>> from layertap.progress import progress_bar
>>> with progress_bar(3, desc="demo", unit="step", enabled=False) as steps:  # a quiet bar does nothing
...     for _ in range(3):
...         steps.update(1)
"""

from __future__ import annotations

import os
import sys
from typing import Any

from .printable import printable


def in_notebook() -> bool:
    """Whether this runs in an IPython kernel (a notebook), whose ``stderr`` is no terminal."""
    ipython = sys.modules.get("IPython")  # never imported here: a kernel has imported it already
    shell = ipython.get_ipython() if ipython is not None else None
    return getattr(shell, "kernel", None) is not None


def _is_terminal() -> bool:
    isatty = getattr(sys.stderr, "isatty", None)
    return bool(isatty and isatty())


def shows(enabled: bool = True) -> bool:
    """Whether a bar asked for with ``enabled`` is shown here (see the module docs)."""
    return enabled and os.environ.get("RANK", "0") == "0" and (_is_terminal() or in_notebook())


class Quiet:
    """The bar when none is shown: every call does nothing."""

    def update(self, n: float = 1) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> Quiet:
        return self

    def __exit__(self, *exc: Any) -> None:
        pass


def progress_bar(total: float | None, *, desc: str, unit: str = "it", enabled: bool = True, leave: bool = True) -> Any:
    """A ``tqdm.auto`` bar of ``total`` ``unit`` when `shows` says so, else a `Quiet` one.

    Use it as a context manager (or call ``close()``) and ``update(n)`` it; ``total=None`` for
    a length not known in advance. ``leave=False`` clears it when it ends (an inner bar).
    """
    if not shows(enabled):
        return Quiet()
    try:
        from tqdm.auto import tqdm
    except ImportError:  # the cli extra is not installed: no bar
        return Quiet()
    return tqdm(total=total, desc=printable(desc), unit=unit, leave=leave, dynamic_ncols=True, file=sys.stderr)


def say(message: str, enabled: bool = True) -> None:
    """Print ``layertap: message`` on ``stderr`` (when ``enabled``), above a running bar."""
    if not enabled:
        return
    message = printable(message)
    try:
        from tqdm import tqdm
    except ImportError:
        print(f"layertap: {message}", file=sys.stderr, flush=True)
    else:
        tqdm.write(f"layertap: {message}", file=sys.stderr)  # above a running bar, not through it


__all__ = ["progress_bar", "say", "shows", "in_notebook", "Quiet"]
