"""The `layertap` command as it starts: without the cli extra (typer, click, rich), ``--version``
works and anything else names the extra in one line; a Ctrl-C while it starts is one line, exit 130."""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import pytest

import layertap
from layertap.cli import end_quiet_start, quiet_start, starting_command

WITHOUT_CLI = textwrap.dedent(
    """
    import sys

    for name in ("typer", "click", "rich"):  # as if layertap were installed without the cli extra
        sys.modules[name] = None
    """
)


def test_without_the_cli_extra_version_works_and_the_rest_names_the_extra():
    program = WITHOUT_CLI + "from layertap.cli import main, run\nassert run(['--help']) == 1\nmain()"  # main: as the script
    done = subprocess.run(  # one process for both: each start imports torch
        [sys.executable, "-c", program, "--version"], capture_output=True, text=True, timeout=300, check=False
    )
    assert (done.returncode, done.stdout) == (0, f"layertap {layertap.__version__}\n")
    assert done.stderr.splitlines() == ["layertap: error: 'typer' is needed for this; install it with: pip install 'layertap[cli]'"]


CTRL_C_AT_IMPORT = textwrap.dedent(
    """
    import os, signal, sys

    # a terminal delivers Ctrl-C; a parent that ignores SIGINT (a background job) would hand that on
    signal.signal(signal.SIGINT, signal.default_int_handler)

    class CtrlC:  # the user presses Ctrl-C as {module!r} is being imported
        def find_spec(self, name, path=None, target=None):
            if name == {module!r}:
                sys.meta_path.remove(self)
                os.kill(os.getpid(), signal.SIGINT)

    sys.meta_path.insert(0, CtrlC())
    from layertap.cli import main  # what pip's console script does
    sys.exit(main())
    """
)


@pytest.mark.parametrize("module", ["torch", "typer"])
def test_ctrl_c_while_the_command_imports_is_one_line(tmp_path, module):
    script = tmp_path / "layertap"  # the console script's name: the command is starting
    script.write_text(CTRL_C_AT_IMPORT.format(module=module))
    done = subprocess.run([sys.executable, str(script), "--help"], capture_output=True, text=True, timeout=300, check=False)
    assert (done.returncode, done.stdout, done.stderr) == (130, "", "layertap: interrupted\n")


@pytest.mark.parametrize(
    "argv, command_",
    [
        (["/venv/bin/python", "/venv/bin/layertap", "--help"], True),  # the console script
        (["python", "-u", "-m", "layertap", "extract"], True),  # python -m, as torchrun starts it
        (["python", "-mlayertap"], True),
        (["python", "-X", "dev", "/venv/bin/layertap"], True),
        (["python", "train.py", "layertap"], False),  # a user's script
        (["python", "-m", "pytest", "layertap"], False),
        (["python", "-c", "from multiprocessing.spawn import spawn_main; spawn_main()", "--multiprocessing-fork"], False),
        (["python", "-W", "layertap", "x.py"], False),  # an option's value is no script
        (["python"], False),
    ],
)
def test_which_process_is_the_command(argv, command_):
    assert starting_command(argv) is command_


def test_the_quiet_start_gives_sigint_back():
    before = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        quiet_start()
        assert signal.getsignal(signal.SIGINT) is not signal.default_int_handler
        quiet_start()  # twice, as the package's import and main() both may
        end_quiet_start()
        assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the command reports Ctrl-C itself
        signal.signal(signal.SIGINT, signal.SIG_IGN)  # e.g. a background job: stays ignored
        quiet_start()
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN
        end_quiet_start()
    finally:
        signal.signal(signal.SIGINT, before)
