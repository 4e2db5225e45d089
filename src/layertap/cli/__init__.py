"""The ``layertap`` command: ``inspect | extract | cam | stats | demo | report``.

Each command lives in the module of its name beside this one and registers itself on the app
of `layertap.cli.core`, which also handles errors: exit codes 0 ok, 2 usage error, 1 runtime
failure, reported in one line (``--debug`` shows the traceback), 130 interrupted.

This package imports without the ``cli`` extra, so that the ``layertap`` script (and
``python -m layertap``) can say in one line which extra to install, not fail in a traceback.
"""

from __future__ import annotations

import sys

from ..errors import MissingExtraError

try:
    # the commands register themselves on the app of `core` when imported, in the order of --help
    from . import (
        cam,  # noqa: F401
        demo,  # noqa: F401
        extract,  # noqa: F401
        inspect,  # noqa: F401
        report,  # noqa: F401
        stats,  # noqa: F401
    )
    from .core import run
except MissingExtraError as missing:
    _MISSING = " ".join(str(missing).split())

    def run(argv: list[str] | None = None) -> int:
        """Say which extra the command line needs, and fail: it is not installed."""
        print(f"layertap: error: {_MISSING}", file=sys.stderr)
        return 1


def main() -> None:
    """Console-script entry point (also ``python -m layertap``)."""
    sys.exit(run())
