"""A Griffe extension for the docs build: ``a, b, c: text`` in an ``Args:`` section documents each.

layertap's docstrings document related parameters together (``detach, to, dtype, reduce: ...``).
Griffe's Google parser reads such a line as one parameter named ``"detach, to, dtype, reduce"``,
which matches nothing in the signature: the API reference then showed it with no type and no
default, as if required. This extension rewrites the copy of the docstring the docs render into
one entry per name, each with the shared text, so every row takes its type and default from the
signature (and a name that is not a parameter warns, which fails the ``--strict`` build).

mkdocs.yml loads it with ``extensions: [docs/hooks/parameter_groups.py]`` (mkdocstrings-python).
"""

from __future__ import annotations

import re
from typing import Any

import griffe

_SECTION = re.compile(r"^(\s*)(?:Args|Arguments|Parameters|Keyword Args|Keyword Arguments|Other Parameters):\s*$")
_GROUP = re.compile(r"^(\s+)(\w+(?:\s*,\s*\w+)+)(\s*\([^)]*\))?:(.*)$")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def split_parameter_groups(text: str) -> str:
    """``text`` with every grouped entry of its parameter sections written once per name.

    ``"Args:\\n    a, b: shared.\\n        more."`` becomes ``"Args:\\n    a: shared.\\n        more.\\n
    b: shared.\\n        more."`` (with the same indentation; tests/test_docs.py checks it).
    """
    lines = text.splitlines()
    out: list[str] = []
    section: int | None = None  # the indentation of the section header we are in
    item: int | None = None  # the indentation of that section's entries
    i = 0
    while i < len(lines):
        line = lines[i]
        header = _SECTION.match(line)
        if header:
            section, item = _indent(line), None
            out.append(line)
            i += 1
            continue
        if section is not None and line.strip():
            if _indent(line) <= section:
                section = None  # the section ended
            elif item is None:
                item = _indent(line)
        group = _GROUP.match(line) if section is not None and line.strip() and _indent(line) == item else None
        if group is None:
            out.append(line)
            i += 1
            continue
        indent, names, kind, rest = group.group(1), group.group(2), group.group(3) or "", group.group(4)
        i += 1
        more = []  # the entry's continuation lines
        while i < len(lines) and lines[i].strip() and _indent(lines[i]) > len(indent):
            more.append(lines[i])
            i += 1
        for name in re.split(r"\s*,\s*", names):
            out.append(f"{indent}{name}{kind}:{rest}")
            out.extend(more)
    return "\n".join(out)


class ParameterGroups(griffe.Extension):
    """Splits grouped parameter entries in every docstring Griffe loads."""

    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = split_parameter_groups(obj.docstring.value)
