"""Test isolation: no docstring example names a fixed temporary path, and each example runs in a
folder of its own (the repository's conftest.py), so two runs on one machine never meet. The
run of two copies at once is `make isolation` (.ci/isolation, in CI): issue 23's `make test`
failed on a fresh clone while another run used the same /tmp/doc.zarr."""

from __future__ import annotations

import ast
import doctest
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "src" / "layertap").rglob("*.py"))
# a path every run on the machine shares: the system temp folders, or one built from gettempdir()
FIXED = re.compile(r"""["'](?:/tmp|/var/tmp|/dev/shm)(?:/|["'])|gettempdir\(""")


def examples(path: Path) -> list[tuple[int, str]]:
    """(line, source) of every example that runs (not ``+SKIP``) in the docstrings of ``path``."""
    found = []
    tree = ast.parse(path.read_text())
    parser = doctest.DocTestParser()
    for node in ast.walk(tree):
        if not isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        docstring = ast.get_docstring(node, clean=False)
        if not docstring:
            continue
        start = node.body[0].lineno  # the docstring's first line
        for example in parser.get_examples(docstring):
            if not example.options.get(doctest.SKIP):
                found.append((start + example.lineno, example.source))
    return found


def fixed_paths(paths: list[Path], root: Path = ROOT) -> list[str]:
    return [
        f"{path.relative_to(root)}:{line}: {source.strip()}"
        for path in paths
        for line, source in examples(path)
        if FIXED.search(source)
    ]


def test_no_docstring_example_writes_a_fixed_temporary_path():
    found = fixed_paths(SOURCES)
    assert not found, "examples that name a path every run shares (use tempfile.mkdtemp()):\n" + "\n".join(found)


def test_no_test_names_a_fixed_temporary_path():
    """Tests write under ``tmp_path`` (or a ``tempfile`` folder of their own), never a shared path."""
    found = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sorted((ROOT / "tests").glob("*.py"))
        if path.name != Path(__file__).name  # this file's probes name such paths on purpose
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if FIXED.search(line)
    ]
    assert not found, "tests that name a path every run shares (use tmp_path):\n" + "\n".join(found)


def test_the_scan_finds_fixed_paths(tmp_path):
    module = tmp_path / "probe.py"
    module.write_text(textwrap.dedent('''
        """
        >>> store = extract(model, data, "/tmp/doc.zarr")
        >>> open("/tmp/doc.zarr")   # doctest: +SKIP
        >>> path = os.path.join(tempfile.gettempdir(), "x")
        >>> fine = os.path.join(tempfile.mkdtemp(), "doc.zarr")
        """
        def f():
            """
            >>> open('/var/tmp/x', 'w')
            """
    '''))
    found = fixed_paths([module], root=tmp_path)
    assert [line.split(": ", 1)[0] for line in found] == ["probe.py:3", "probe.py:5", "probe.py:10"], found


def test_each_example_runs_in_a_folder_of_its_own(tmp_path):
    """The repository's conftest.py gives every example its own working directory and temp
    folder: what ``mkdtemp()`` returns lies inside it, and it is not where pytest was started."""
    module = tmp_path / "probe.py"
    module.write_text(textwrap.dedent(f'''
        """
        >>> import os, tempfile
        >>> here = os.getcwd()
        >>> here != {str(tmp_path)!r} and os.path.commonpath([tempfile.mkdtemp(), here]) == here
        True
        >>> os.path.commonpath([tempfile.gettempdir(), here]) == here
        True
        """
    '''))
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "conftest", "-p", "no:cacheprovider", "--doctest-modules", str(module)],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},  # the repository's conftest.py, as a plugin
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-2000:]
    assert "1 passed" in done.stdout


def test_ci_runs_two_copies_at_once():
    assert "make isolation" in (ROOT / ".ci" / "run").read_text()
    script = (ROOT / ".ci" / "isolation").read_text()
    assert os.access(ROOT / ".ci" / "isolation", os.X_OK)
    assert "--doctest-modules src/layertap" in script and "for copy in a b" in script
