"""The ``layertap`` command: ``inspect | extract | cam | stats | demo | report``.

Each command lives in the module of its name beside this one and registers itself on `app`.
Exit codes: 0 ok, 2 usage error, 1 runtime failure, reported in one line (``--debug`` shows the
traceback).
"""

from __future__ import annotations

import sys
import traceback

from ..errors import require

typer = require("typer", "cli")
click = require("click", "cli")

app = typer.Typer(
    name="layertap",
    help="Tap any layer of any PyTorch model. Example: layertap inspect torchvision:resnet18 --depth 1",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)

_debug = False


@app.callback()
def _options(
    debug: bool = typer.Option(False, "--debug", help="Show the full traceback of a failure."),
) -> None:
    global _debug
    _debug = debug


def run(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``) and return the exit code."""
    try:
        result = app(args=argv, prog_name="layertap", standalone_mode=False)
    except (click.exceptions.Exit, typer.Exit) as e:
        return e.exit_code
    # usage errors: exit code 2 (newer typer raises its own copies of click's exceptions)
    except (click.ClickException, getattr(typer, "TyperException", click.ClickException)) as e:
        e.show()
        return e.exit_code
    except (click.exceptions.Abort, typer.Abort):
        print("layertap: aborted", file=sys.stderr)
        return 1
    except Exception as e:  # one line, not a traceback, unless --debug
        if _debug or "--debug" in (argv if argv is not None else sys.argv):
            traceback.print_exc()
        message = " ".join(str(e).split()) or type(e).__name__
        print(f"layertap: error: {message}", file=sys.stderr)
        return 1
    return result if isinstance(result, int) else 0


def main() -> None:
    """Console-script entry point."""
    sys.exit(run())


# the commands register themselves on `app` when imported
from . import inspect  # noqa: E402,F401
from . import stats  # noqa: E402,F401
from . import extract  # noqa: E402,F401
from . import cam  # noqa: E402,F401
from . import demo  # noqa: E402,F401
from . import report  # noqa: E402,F401
