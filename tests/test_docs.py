"""The documentation site: every tutorial's code runs, and the site builds with ``--strict``.

Each page under ``docs/`` that holds code is one test. Its blocks run in order, in one namespace
and in a fresh temporary directory, as a reader would paste them:

- a ```` ```python ```` block runs with ``exec``; its traceback points at the page's own lines;
- a ```` ```text title="Output" ```` block right after a Python block is that block's expected
  stdout, compared line by line (trailing spaces ignored), so a printed result on the site is
  the one the code prints;
- a ```` ```bash ```` block runs only when the line before it is ``<!-- run -->`` (with this
  environment's ``bin`` first on ``PATH``); other bash blocks are shown, never run (torchrun
  command lines, installs);
- ``<!-- skip -->`` on the line before a Python block shows it without running it. Use it rarely:
  a skipped block is code the site shows untested.

Fences must start at the beginning of a line (not inside an admonition), so that no block is
left out silently: a fence this file cannot read fails the test of its page.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import os
import re
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"
FENCE = re.compile(
    r"^(?:(?P<marker><!-- (?:skip|run) -->)\n)?```(?P<info>[^\n]*)\n(?P<body>.*?)^```[ \t]*$",
    re.MULTILINE | re.DOTALL,
)
OUTPUT_INFO = 'text title="Output"'


@dataclass
class Block:
    kind: str  # "python" or "bash"
    code: str
    line: int  # the line of the page where the code starts (1-based)
    skip: bool = False
    output: str | None = None  # the expected stdout, for a Python block followed by an Output block


def blocks(text: str, name: str) -> list[Block]:
    """The runnable blocks of a page's ``text`` in order, each Python block with its expected output."""
    found: list[Block] = []
    last_end = 0
    for m in FENCE.finditer(text):
        info = m["info"].strip()
        line = text.count("\n", 0, m.start("body")) + 1
        marker = m["marker"] or ""
        if info == OUTPUT_INFO:
            previous = found[-1] if found else None
            between = text[last_end : m.start()]
            if previous is None or previous.kind != "python" or previous.output is not None or between.strip():
                raise AssertionError(f"{name}:{line}: an Output block must follow its Python block directly")
            previous.output = m["body"]
        elif 'title="Output"' in info:
            raise AssertionError(f"{name}:{line}: an Output block is written {OUTPUT_INFO!r}, not {info!r}")
        elif info.split()[:1] == ["python"]:
            found.append(Block("python", m["body"], line, skip=marker == "<!-- skip -->"))
        elif info.split()[:1] == ["bash"] and marker == "<!-- run -->":
            found.append(Block("bash", m["body"], line))
        last_end = m.end()
    # every ```python fence in the page must have been read: an indented one would be skipped
    fences = len(re.findall(r"^[ \t]*```python", text, flags=re.MULTILINE))
    read = sum(b.kind == "python" for b in found)
    assert fences == read, f"{name}: {fences} ```python fences, {read} read (fences must start at column 0)"
    return found


PAGES = sorted(p for p in DOCS.rglob("*.md") if "```python" in p.read_text())


@pytest.fixture
def one_thread():
    # the pages' inputs are tiny: intra-op threads gain nothing, and on two shared cores two
    # threads waiting for each other at every small op made a forward 100x slower
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(DOCS)))
def test_page_code_runs(page, tmp_path, monkeypatch, one_thread):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("PATH", f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    namespace: dict = {"__name__": "__main__"}
    for block in blocks(page.read_text(), page.name):
        if block.skip:
            continue
        where = f"{page.relative_to(ROOT)}:{block.line}"
        if block.kind == "bash":
            done = subprocess.run(["bash", "-euo", "pipefail", "-c", block.code], capture_output=True, text=True, timeout=300, check=False)
            assert done.returncode == 0, f"{where}: the bash block failed\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
            continue
        # padded so that a traceback names the page's own line numbers
        code = compile("\n" * (block.line - 1) + block.code, str(page), "exec")
        stdout = io.StringIO()
        with contextlib.redirect_stdout(stdout):
            exec(code, namespace)
        if block.output is not None:
            got = [line.rstrip() for line in stdout.getvalue().rstrip("\n").splitlines()]
            want = [line.rstrip() for line in block.output.rstrip("\n").splitlines()]
            assert got == want, f"{where}: the block printed\n" + "\n".join(got) + "\nbut the page shows\n" + "\n".join(want)


def test_every_tutorial_has_code():
    tutorials = sorted((DOCS / "tutorials").glob("*.md"))
    assert tutorials and all(page in PAGES for page in tutorials)


def test_fence_rules():
    text = '```python\nprint(1)\n```\n\n```text title="Output"\n1\n```\n\n<!-- run -->\n```bash\necho hi\n```\n'
    text += "\n```bash\nnot run\n```\n\n<!-- skip -->\n```python\nshown only\n```\n"
    found = blocks(text, "probe.md")
    assert [(b.kind, b.output, b.skip) for b in found] == [("python", "1\n", False), ("bash", None, False), ("python", None, True)]
    with pytest.raises(AssertionError, match="column 0"):
        blocks("    ```python\n    print(1)\n    ```\n", "probe.md")
    with pytest.raises(AssertionError, match="must follow"):
        blocks('```bash\nls\n```\n```text title="Output"\nx\n```\n', "probe.md")
    with pytest.raises(AssertionError, match="is written"):
        blocks('```python\nprint(1)\n```\n```title="Output"\n1\n```\n', "probe.md")


def docs_hook(name: str):
    """One of the docs build's Griffe extensions (docs/hooks/NAME.py), imported from its file."""
    spec = importlib.util.spec_from_file_location(name, DOCS / "hooks" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    hook = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hook)
    return hook


def test_docstring_examples_render_as_code():
    """The docs' Griffe extension fences doctests, which Markdown would read as nested quotes."""
    pytest.importorskip("griffe", reason="the docs extra is not installed: pip install -e '.[docs]'")
    fence = docs_hook("doctest_fences").fence_doctests
    assert fence("Intro.\n\n>>> 1 + 1\n2\n\nMore.") == "Intro.\n\n```pycon\n>>> 1 + 1\n2\n```\n\nMore."
    # indented (an Args: section), continuation lines, a directive dropped
    assert fence("  >>> f(1,\n  ...   2)  # doctest: +SKIP\n  3") == "  ```pycon\n  >>> f(1,\n  ...   2)\n  3\n  ```"
    # a fence the docstring wrote itself is left alone
    assert fence("```python\n>>> x\n```") == "```python\n>>> x\n```"


def test_site_builds_strict(tmp_path):
    pytest.importorskip("mkdocs", reason="the docs extra is not installed: pip install -e '.[docs]'")
    pytest.importorskip("mkdocstrings", reason="the docs extra is not installed: pip install -e '.[docs]'")
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "NO_MKDOCS_2_WARNING": "1"},
        check=False,
    )
    assert done.returncode == 0, done.stderr[-5000:]
    reference = sorted((tmp_path / "site" / "reference").glob("*/index.html"))
    assert len(reference) == len(list((DOCS / "reference").glob("*.md"))) > 10
    for page in reference:  # a doctest left unfenced would render as nested block quotes
        assert "<blockquote" not in page.read_text(), page


def test_grouped_parameters_are_documented_one_by_one():
    """``detach, to, dtype, reduce:`` documents four parameters: the docs' Griffe extension writes
    one entry per name, so the API reference takes each one's type and default from the signature
    (Griffe read the group as one unknown parameter, shown with no default, as if required)."""
    hook = docs_hook("parameter_groups")
    split = hook.split_parameter_groups
    text = "Tap.\n\nArgs:\n    keep: one.\n    detach, to (str): applied\n        in the hook.\n    edit: two.\n\nMore, text: here."
    want = "Tap.\n\nArgs:\n    keep: one.\n    detach (str): applied\n        in the hook.\n    to (str): applied\n        in the hook.\n    edit: two.\n\nMore, text: here."
    assert split(text) == want
    assert split("Args:\n    a: b, c: not a group, a continuation\n") == "Args:\n    a: b, c: not a group, a continuation"
    griffe = pytest.importorskip("griffe", reason="the docs extra is not installed: pip install -e '.[docs]'")
    loaded = griffe.load("layertap.tap", search_paths=[str(ROOT / "src")], extensions=griffe.load_extensions(hook.ParameterGroups()))
    (section,) = [s for s in loaded["tap"].docstring.parse("google") if s.kind.value == "parameters"]
    defaults = {p.name: p.default for p in section.value}
    assert {name: defaults.get(name) for name in ("detach", "to", "dtype", "reduce")} == {"detach": "True", "to": "None", "dtype": "None", "reduce": "None"}
