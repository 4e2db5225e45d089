r"""Text that is safe to print: control characters in names escaped, ordinary Unicode kept.

File names, sample ids, class names, layer and model names come from files and models, so they
can hold anything, including terminal escape sequences: ``ESC ] 52 ; c ; <base64> BEL`` (OSC 52)
writes the clipboard of the terminal that prints it, and click's stripping of styles when the
output is no terminal lets it through. `printable` turns every character that a terminal or a
log viewer would act on, instead of showing, into a visible escape, as Python's ``repr`` writes it
(``\t``, ``\n``, ``\x1b``, ``\u202e``):

- C0 controls (U+0000–U+001F, e.g. ESC ``\x1b``, BEL ``\x07``, CR, newline), DEL and the C1
  controls (U+0080–U+009F, e.g. the one-character CSI ``\x9b``);
- Unicode's bidirectional overrides, embeddings and isolates (U+202A–U+202E, U+2066–U+2069),
  which reorder what is shown ("Trojan Source"), and the line and paragraph separators
  U+2028/U+2029;
- lone surrogates (U+D800–U+DFFF): the bytes of a file name that are not UTF-8, which would be
  written back raw (a byte 0x9B is a CSI) or fail to print.

Everything else (accents, CJK, emoji, backslashes) is left as it is, so escaping twice changes
nothing: ``printable(printable(s)) == printable(s)``.

>>> printable("cat\x1b]52;c;SGVsbG8=\x07.png")
'cat\\x1b]52;c;SGVsbG8=\\x07.png'
>>> print(printable("é/日本/🐱\u202e.png"))
é/日本/🐱\u202e.png
>>> printable("two\nlines\tand a tab", keep="\n\t") == "two\nlines\tand a tab"
True
"""

from __future__ import annotations

import re

# every character escaped, as one class: C0, DEL, C1, bidi controls, line/paragraph separators, surrogates
_UNSAFE = re.compile("[\x00-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069\ud800-\udfff]")


def _escape(match: re.Match[str]) -> str:
    return match.group().encode("unicode_escape").decode("ascii")  # as repr() writes it: \t, \x1b, \u202e


def printable(text: object, keep: str = "") -> str:
    """``str(text)`` with the characters a terminal would act on escaped (see the module docs).

    ``keep``: characters to leave as they are, e.g. ``"\\n"`` for a table of several lines
    (a layertap message or table that is meant to span lines).
    """
    return _UNSAFE.sub(lambda m: m.group() if m.group() in keep else _escape(m), str(text))


__all__ = ["printable"]
