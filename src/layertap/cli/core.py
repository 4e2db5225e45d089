"""The root of the ``layertap`` command: the app that the commands register on, and its error handling.

Exit codes: 0 ok, 2 usage error, 1 runtime failure, reported in one line (``--debug`` shows the
traceback), 130 interrupted.

Everything the command prints goes through `echo` or the error handling of `run`, which escape
control characters (`layertap.printable`): results and errors name files, ids, classes, layers
and models, which may hold terminal escape sequences.

A command owns its process: ``extract``, ``stats``, ``cam`` and ``report`` call `own_allocator`
first, which tunes glibc's allocator to keep freed memory for the next forward (see
`layertap.allocator`), unless the environment says ``LAYERTAP_ALLOCATOR=default``.
"""

from __future__ import annotations

import os
import sys
import traceback

from .. import allocator
from ..errors import require
from ..printable import printable

typer = require("typer", "cli")
click = require("click", "cli")

app = typer.Typer(
    name="layertap",
    help="Tap any layer of any PyTorch model. Example: layertap inspect torchvision:resnet18 --depth 1",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
    epilog="Environment: LAYERTAP_ALLOCATOR=default keeps the C allocator as it comes; by default extract, stats, "
    "cam and report tune it to keep freed memory for the next forward (a resnet50 forward on the CPU: about 15% faster).",
)

_ALLOCATOR_ENV = "LAYERTAP_ALLOCATOR"

_debug = False


def _version(shown: bool) -> None:
    if shown:
        from .. import __version__

        typer.echo(f"layertap {__version__}")
        raise typer.Exit()


@app.callback()
def _options(
    debug: bool = typer.Option(False, "--debug", help="Show the full traceback of a failure."),
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version and exit."),
) -> None:
    global _debug
    _debug = debug


def echo(text: str, keep: str = "") -> None:
    """Print ``text`` on stdout with control characters escaped; ``keep="\\n"`` for a table of lines."""
    typer.echo(printable(text, keep))


def own_allocator() -> allocator.AllocatorTuning | None:
    """Tune the C allocator for this process, which the command owns (`layertap.allocator`),
    unless ``LAYERTAP_ALLOCATOR=default``; ``tuned`` (or unset) tunes, anything else is a usage error."""
    choice = os.environ.get(_ALLOCATOR_ENV, "").strip().lower() or "tuned"
    if choice == "default":
        return None
    if choice != "tuned":
        raise click.UsageError(f"{_ALLOCATOR_ENV}={os.environ[_ALLOCATOR_ENV]!r}: give 'default' (glibc as it comes) or 'tuned'")
    return allocator.tune_allocator()


def run(argv: list[str] | None = None) -> int:
    """Run the command line with ``argv`` (default: ``sys.argv[1:]``) and return the exit code."""
    args = list(sys.argv[1:] if argv is None else argv)
    command = typer.main.get_command(app)
    try:
        # the context is driven here, not by click's main: that turns any EOFError (an empty or
        # truncated file) into a blank line and "Aborted", and layertap never reads stdin
        with command.make_context("layertap", args) as ctx:
            result = command.invoke(ctx)
    except (click.exceptions.Exit, typer.Exit) as e:
        return e.exit_code
    # usage errors: exit code 2 (newer typer raises its own copies of click's exceptions)
    except (click.ClickException, getattr(typer, "TyperException", click.ClickException)) as e:
        e.message = printable(e.message, keep="\n")  # it may quote a value or a class name of the model
        e.show()
        return e.exit_code
    except KeyboardInterrupt:
        print("layertap: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # the reader of stdout left (`layertap inspect | head`): nothing to say
        sys.stdout = click.utils.PacifyFlushWrapper(sys.stdout)
        return 1
    except Exception as e:  # one line, not a traceback, unless --debug
        if _debug or "--debug" in args:
            print(printable(traceback.format_exc(), keep="\n"), end="", file=sys.stderr)
        message = " ".join(printable(str(e), keep="\n\t").split()) or type(e).__name__
        print(f"layertap: error: {message}", file=sys.stderr)
        return 1
    return result if isinstance(result, int) else 0

