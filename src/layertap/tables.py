"""Tables for people, written once: aligned text for ``print`` and escaped HTML for notebooks.

`summary`, `stats`, the feature store and the tap show their rows through one `Table`, and a
report takes the tables' own ``to_html()``. Every cell is text, escaped in HTML (layer names and
ids are data), except an `Html` cell, which a renderer here made from numbers (a `sparkline`).

>>> from layertap.tables import Table
>>> table = Table(["layer", "mean"], [["conv<1>", "0.5"], ["fc", "12.25"]], numeric={"mean"}, notes=["2 layers"])
>>> print(table.text())
layer     mean
conv<1>    0.5
fc       12.25
2 layers
>>> "conv&lt;1&gt;" in table.html()
True
"""

from __future__ import annotations

import html
import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass

import numpy as np

from .printable import printable


class Html(str):
    """A cell that is HTML already (made here, from numbers): put in as it is, not escaped."""


def _escape(cell: str) -> str:
    return cell if isinstance(cell, Html) else html.escape(cell)


@dataclass
class Table:
    """Rows of cells under ``columns``; ``numeric`` columns align right.

    ``title`` and ``facts`` (label, value pairs) come before the rows, ``notes`` after them;
    ``flagged`` rows are shaded in HTML.
    """

    columns: Sequence[str]
    rows: Sequence[Sequence[str]]
    numeric: Collection[str] = ()
    title: str = ""
    facts: Sequence[tuple[str, str]] = ()
    notes: Sequence[str] = ()
    flagged: Collection[int] = ()

    def text(self) -> str:
        """Aligned columns, two spaces apart, with the title, facts and notes as lines."""
        # names come from models and files: escaped, so a name can neither send a terminal escape nor fake a row
        lines = [[printable(c) for c in line] for line in [self.columns, *self.rows]]
        widths = [max(len(line[i]) for line in lines) for i in range(len(self.columns))]
        right = [c in self.numeric for c in self.columns]
        body = [
            "  ".join(c.rjust(w) if r else c.ljust(w) for c, w, r in zip(line, widths, right)).rstrip()
            for line in lines
        ]
        head = [printable(self.title)] if self.title else []
        head += [printable(f"{label}: {value}") for label, value in self.facts]
        return "\n".join([*head, *body, *map(printable, self.notes)])

    def html(self) -> str:
        """One ``<div>``: the title, a table of the facts, the rows, and the notes as caption."""
        align = ["right" if c in self.numeric else "left" for c in self.columns]

        def tr(tag: str, cells: Sequence[str], style: str = "") -> str:
            inner = "".join(f"<{tag} style='text-align:{a}'>{_escape(c)}</{tag}>" for c, a in zip(cells, align))
            return f"<tr{style}>{inner}</tr>"

        shaded = " style='background:#fdeeee'"  # (not a class: a notebook keeps no stylesheet of ours)
        body = "".join(tr("td", row, shaded if i in self.flagged else "") for i, row in enumerate(self.rows))
        notes = "<br>".join(_escape(n) for n in self.notes if n)
        caption = f"<caption style='caption-side:bottom;text-align:left'>{notes}</caption>" if notes else ""
        parts = [f"<b>{_escape(self.title)}</b>"] if self.title else []
        if self.facts:
            facts = "".join(
                f"<tr><th style='text-align:left'>{_escape(k)}</th><td style='text-align:left'>{_escape(v)}</td></tr>"
                for k, v in self.facts
            )
            parts.append(f"<table>{facts}</table>")
        parts.append(f"<table>{caption}<thead>{tr('th', self.columns)}</thead><tbody>{body}</tbody></table>")
        return f"<div class='layertap'>{''.join(parts)}</div>"


def number(v: float) -> str:
    """A number in four significant digits; ``-`` for NaN and infinities (no value)."""
    return f"{v:.4g}" if math.isfinite(v) else "-"


def sparkline(counts: np.ndarray, edges: np.ndarray, width: int = 120, height: int = 26) -> Html:
    """A histogram as a small inline SVG: one bar per bin, log-scaled counts (tails show beside
    a spike at 0), its range in the tooltip and under it."""
    bar = width / len(counts)
    scale = max(float(np.log1p(counts.max())), 1e-9)
    heights = (height - 2) * np.log1p(counts) / scale
    bars = "".join(
        f"<rect x='{i * bar:.1f}' y='{height - 1 - h:.1f}' width='{max(bar - 0.5, 0.5):.1f}' height='{h:.1f}'/>"
        for i, h in enumerate(heights.tolist())
    )
    span = f"{number(float(edges[0]))} to {number(float(edges[-1]))}"
    return Html(
        f"<svg width='{width}' height='{height}' fill='#4a7fb5' role='img' aria-label='histogram from {span}'>"
        f"<title>histogram of the values (log counts), from {span}</title>{bars}</svg>"
        f"<div style='font-size:11px;color:#5b6672'>{span}</div>"
    )


__all__ = ["Table", "Html", "number", "sparkline"]
