"""Small HTML renderers of the report: escaping, inline images, numbers, colours, plots' axes."""

from __future__ import annotations

import base64
import html
import io
import json
import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from ..overlay import JET

#: Categorical colours for classes (matplotlib's tab10), cycled beyond ten classes.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")


def esc(x: Any) -> str:
    return html.escape(str(x))


def label(text: str) -> str:
    """A class name that never wraps ("class 713" stays on one line)."""
    return esc(text).replace(" ", "\u00a0")


def data_uri(image: Any, photo: bool = False) -> str:
    """A PIL image as a ``data:`` URI: PNG, or for a ``photo`` the smaller of PNG and JPEG
    (a photo's thumbnail is several times smaller as JPEG; flat drawings are smaller as PNG)."""
    encoded = []
    for fmt, options in (("PNG", {"optimize": True}), ("JPEG", {"quality": 85})) if photo else (("PNG", {"optimize": True}),):
        buffer = io.BytesIO()
        image.convert("RGB").save(buffer, format=fmt, **options)
        encoded.append((len(buffer.getvalue()), fmt.lower(), buffer.getvalue()))
    _, kind, data = min(encoded)
    return f"data:image/{kind};base64," + base64.b64encode(data).decode("ascii")


def json_script(element_id: str, value: Any) -> str:
    """``value`` as an inert JSON ``<script>`` block that no text in it can close or break out of."""
    text = json.dumps(value, separators=(",", ":")).replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")
    return f"<script type='application/json' id='{element_id}'>{text}</script>"


def num(v: float | None) -> str:
    return "–" if v is None or not math.isfinite(v) else f"{v:.4g}"


def percent(v: float) -> str:
    return "0" if not v else f"{100 * v:.3g}%"


def colour(label: int) -> str:
    return PALETTE[label % len(PALETTE)]


def legend(names: dict[int, str]) -> str:
    items = "".join(
        f"<span class='key'><span class='swatch' style='background:{colour(k)}'></span>{label(name)}</span>" for k, name in sorted(names.items())
    )
    return f"<p class='legend'>Classes: {items}</p>"


def colour_bar(low: str, high: str) -> str:
    """The heatmaps' colormap (`layertap.overlay.JET`) as a labelled CSS gradient."""
    stops = ", ".join(f"rgb({r},{g},{b}) {100 * i / 8:.0f}%" for i, (r, g, b) in enumerate(JET[np.linspace(0, 255, 9).astype(int)].tolist()))
    return (
        f"<div class='colourbar'><span>{esc(low)}</span><span class='ramp' style='background:linear-gradient(to right, {stops})'></span>"
        f"<span>{esc(high)}</span></div>"
    )


def count(n: float) -> str:
    """A count in at most three digits and a unit: 7, 5.12k, 7.37M."""
    for unit, size in (("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if n >= size:
            return f"{n / size:.3g}{unit}"
    return f"{n:g}"


def histogram(counts: np.ndarray, edges: np.ndarray, width: int = 258, height: int = 94) -> str:
    """A histogram as inline SVG with axes: log-scaled counts (tails show beside a spike at 0)
    from 1 to the largest, the values' range and 0 on the x axis, and each bar's range and count
    on hover (an SVG ``<title>``, which the page's script shows as its tooltip)."""
    left, right, bottom, top = 42, 8, 22, 8
    w, h = width - left - right, height - bottom - top
    lo, hi = float(edges[0]), float(edges[-1])
    span = hi - lo if hi > lo else 1.0

    def x(v: float) -> float:
        return left + (v - lo) / span * w

    scale = max(float(np.log1p(counts.max())), 1e-9)
    bars = []
    for i, n in enumerate(counts.tolist()):
        bar = h * math.log1p(n) / scale
        x0, x1 = x(float(edges[i])), x(float(edges[i + 1]))
        bars.append(
            f"<rect x='{x0:.1f}' y='{top + h - bar:.1f}' width='{max(x1 - x0 - 0.4, 0.6):.1f}' height='{bar:.1f}'>"
            f"<title>{num(float(edges[i]))} to {num(float(edges[i + 1]))}: {n:,} values</title></rect>"
        )
    ticks = [(lo, "start"), (hi, "end")] + ([(0.0, "middle")] if lo < 0 < hi and min(-lo, hi) > 0.12 * span else [])
    x_axis = "".join(
        f"<line x1='{x(v):.1f}' x2='{x(v):.1f}' y1='{top + h}' y2='{top + h + 4}'/><text x='{x(v):.1f}' y='{height - 6}' text-anchor='{anchor}'>{num(v)}</text>"
        for v, anchor in ticks
    )
    y_axis = "".join(
        f"<line x1='{left - 4}' x2='{left}' y1='{y:.1f}' y2='{y:.1f}'/><text x='{left - 6}' y='{y + 3:.1f}' text-anchor='end'>{count(n)}</text>"
        for n, y in ((float(counts.max()), top), (1.0, top + h - h * math.log(2) / scale))
    )
    return (
        f"<svg class='hist' width='{width}' height='{height}' role='img' aria-label='histogram from {num(lo)} to {num(hi)}'>"
        f"<g class='bars'>{''.join(bars)}</g><line x1='{left}' x2='{left + w}' y1='{top + h}' y2='{top + h}'/>"
        f"<line x1='{left}' x2='{left}' y1='{top}' y2='{top + h}'/>{x_axis}{y_axis}</svg>"
    )


def plain_list(items: Sequence[str], shown: int = 30) -> str:
    """Escaped items joined by commas, at most ``shown`` of them."""
    more = f", … ({len(items):,} in all)" if len(items) > shown else ""
    return ", ".join(esc(i) for i in items[:shown]) + more
