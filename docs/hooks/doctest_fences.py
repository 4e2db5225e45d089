"""A Griffe extension for the docs build: docstring examples (``>>>`` lines) as code blocks.

layertap's docstrings hold doctests in plain text, outside any "Examples:" section. Markdown
would read ``>>>`` as three nested quotes; this extension wraps each doctest (its ``>>>`` and
``...`` lines and the expected output after them, up to a blank line) in a ```` ```pycon ````
fence at the same indentation, and drops ``# doctest: +SKIP``-style directives, which mean
nothing to a reader. Only the copy of the docstring that the docs render is changed.

mkdocs.yml loads it with ``extensions: [docs/hooks/doctest_fences.py]`` (mkdocstrings-python).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_PROMPT = re.compile(r"^(\s*)>>>( |$)")
_DIRECTIVE = re.compile(r"\s*# doctest:.*$")


def fence_doctests(text: str) -> str:
    """``text`` with every doctest block wrapped in a ```` ```pycon ```` fence.

    ``"Intro.\\n\\n>>> 1 + 1\\n2\\n\\nMore."`` becomes the same text with a fence line before
    ``>>> 1 + 1`` and another after ``2`` (tests/test_docs.py checks it).
    """
    lines = text.splitlines()
    out: list[str] = []
    fenced = False  # inside a fence the docstring wrote itself: leave it alone
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.lstrip().startswith("```"):
            fenced = not fenced
        match = None if fenced else _PROMPT.match(line)
        if match is None:
            out.append(line)
            i += 1
            continue
        indent = match.group(1)
        out.append(f"{indent}```pycon")
        while i < len(lines) and lines[i].strip():
            out.append(_DIRECTIVE.sub("", lines[i]))
            i += 1
        out.append(f"{indent}```")
    return "\n".join(out)


class DoctestFences(griffe.Extension):
    """Fences the doctests of every docstring Griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = fence_doctests(obj.docstring.value)
