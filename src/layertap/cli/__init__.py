"""The ``layertap`` command: ``inspect | extract | cam | stats | demo | report``.

Each command lives in the module of its name beside this one and registers itself on the app
of `layertap.cli.core`, which also handles errors: exit codes 0 ok, 2 usage error, 1 runtime
failure, reported in one line (``--debug`` shows the traceback), 130 interrupted.

This package imports only the standard library and `layertap.errors`, and the commands when
`run` is first called, so that the ``layertap`` script (and ``python -m layertap``) works
without the ``cli`` extra: ``--version`` prints the version, anything else says in one line
which extra to install. A Ctrl-C while the command starts (its imports take seconds: torch,
typer) ends it with one line and exit code 130 too, not with a traceback of the import chain:
see `quiet_start`.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable
from functools import partial
from types import FrameType

from ..errors import MissingExtraError

_Runner = Callable[[list[str] | None], int]


def _without_extra(missing: str, argv: list[str] | None = None) -> int:
    """The command line without the cli extra: ``--version`` works, anything else names the extra."""
    args = sys.argv[1:] if argv is None else argv
    leading = args[: next((i for i, a in enumerate(args) if not a.startswith("-")), len(args))]
    if "--version" in leading:  # as the app's eager --version: before any command
        from .. import __version__

        print(f"layertap {__version__}")
        return 0
    print(f"layertap: error: {missing}", file=sys.stderr)
    return 1


def _runner() -> _Runner:
    """`layertap.cli.core.run` with every command registered, or `_without_extra` without the extra."""
    try:
        # the commands register themselves on the app of `core` when imported
        from . import cam, demo, extract, inspect, report, stats  # noqa: F401
        from .core import run as run_app
    except MissingExtraError as missing:
        return partial(_without_extra, " ".join(str(missing).split()))
    return run_app


def run(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``) and return the exit code."""
    return _runner()(argv)


# ------------------------------------------------------------------------------- Ctrl-C at start
_COMMAND_FILES = ("layertap", "layertap.exe", "layertap-script.py")  # the console script, on POSIX and Windows
_python_handler: Callable[[int, FrameType | None], object] | int | None = None  # SIGINT's handler before quiet_start


def _interrupted(signum: int, frame: FrameType | None) -> None:
    print("layertap: interrupted", file=sys.stderr, flush=True)
    raise SystemExit(130)  # unwinds the imports quietly: a SystemExit prints no traceback


def starting_command(argv: list[str] | None = None) -> bool:
    """Whether this process is the ``layertap`` command: its script, or ``python -m layertap``
    (also under ``torchrun``), read from the interpreter's own command line ``argv``
    (default ``sys.orig_argv``). A DataLoader worker or a user's script is not."""
    args = iter((sys.orig_argv if argv is None else argv)[1:])
    for arg in args:
        if arg in ("-m", "-c"):
            return arg == "-m" and next(args, None) == "layertap"
        if arg.startswith(("-m", "-c")):  # -mlayertap
            return arg == "-mlayertap"
        if arg in ("-W", "-X"):  # the options that take a value
            next(args, None)
        elif not arg.startswith("-"):
            return os.path.basename(arg) in _COMMAND_FILES
    return False


def quiet_start() -> None:
    """Until `end_quiet_start`, Ctrl-C prints ``layertap: interrupted`` and exits 130.

    For the imports before the command runs: a KeyboardInterrupt raised in them would print a
    traceback of the whole import chain. Only Python's own handler is replaced (a SIGINT that
    is ignored stays ignored), and only in the main thread, where signal handlers live.
    """
    global _python_handler
    if threading.current_thread() is not threading.main_thread():
        return
    if signal.getsignal(signal.SIGINT) is signal.default_int_handler:
        _python_handler = signal.signal(signal.SIGINT, _interrupted)


def end_quiet_start() -> None:
    """Give SIGINT back to the handler `quiet_start` replaced: the command reports a Ctrl-C itself."""
    global _python_handler
    if _python_handler is not None and signal.getsignal(signal.SIGINT) is _interrupted:
        signal.signal(signal.SIGINT, _python_handler)
    _python_handler = None


def main() -> None:
    """Console-script entry point (also ``python -m layertap``)."""
    quiet_start()
    try:
        runner = _runner()
    finally:
        end_quiet_start()
    sys.exit(runner(None))
