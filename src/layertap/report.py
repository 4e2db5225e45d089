"""One self-contained HTML page about a feature store: what a person looks at instead of tensors.

>>> import layertap
>>> layertap.build_report("features.zarr", "report.html")      # doctest: +SKIP
PosixPath('report.html')

The page (no network, no scripts; images are inlined PNGs, plots inline SVG) has:

- **Feature store**: model, data, samples, stored arrays, settings;
- **Layers of the model**: `layertap.summary`, the stored layers in bold;
- **Heatmaps**: Grad-CAM (or another `layertap.cam` method) over a grid of the store's images,
  with each image's true and predicted class;
- **Features in 2-D (PCA)**: each stored array projected on its first two principal components
  (numpy SVD), coloured by class, with how well the classes separate there;
- **Activation statistics**: `layertap.stats` of the stored layers over the store's images, or,
  without the model, the statistics of the stored features themselves.

Everything comes from the store and, when they are at hand, the model that wrote it and the
image files its ids name. The model is used only if its weights are those that wrote the store
(`model_fingerprint`). A section that cannot be made is replaced by a note saying why and what to
pass; it never stops the page.

A store may come from someone else, so it is read as data, never as code:

- the model is the one given (``model=``, ``--model``). The spec the store records is loaded only
  with ``trust_store=True`` (``--trust``), after naming it on stderr: loading a spec runs
  code (``package.module:callable`` is imported and called, a file or folder may bring its own);
- images are read from the folder given (``images=``, ``--images``); the folder the store records
  (an absolute path, anywhere) is used only with ``trust_store=True``: a crafted store could
  name a private folder and put its pictures into a page that is then shared;
- sample ids are read only inside the image folder: an id that resolves (links followed) outside
  it, such as ``../../x.png`` or ``/home/x.png``, makes the sections that read images unavailable,
  and no file outside the folder is opened.
"""

from __future__ import annotations

import base64
import datetime
import html
import io
import json
import math
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from . import cam
from .data import ImageFiles
from .dataset import model_fingerprint
from .errors import ArgumentError, ModelLoadError, require
from .features import place_model
from .images import load_image
from .loading import load_model, model_info, spec_kind
from .overlay import overlay
from .select import named_layers
from .stats import LayerStats, StatsTable, summarize
from .stats import stats as activation_stats
from .store import FeatureStore, open_features
from .summary import summary
from .units import human_bytes

#: Categorical colours for classes (matplotlib's tab10), cycled beyond ten classes.
PALETTE = ("#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf")
SECTIONS = {
    "store": "Feature store",
    "layers": "Layers of the model",
    "heatmaps": "Heatmaps",
    "pca": "Features in 2-D (PCA)",
    "stats": "Activation statistics",
}
HISTOGRAM_BINS = 24
BLOCK_BYTES = 32 << 20  # rows read from the store at a time, at most


class Unavailable(Exception):
    """A section cannot be made; the message says why and what to pass (shown on the page)."""


# ------------------------------------------------------------------------------ what we know
class _Context:
    """The store and what can be found about it: class names, image files, the matching model."""

    def __init__(
        self, store: FeatureStore, model: nn.Module | str | None, images: str | Path | None, max_samples: int, trust_store: bool = False
    ) -> None:
        self.store = store
        self.meta = store.meta
        self.ids = store.ids
        self.labels = store.labels
        self.valid = np.flatnonzero(store.valid)  # read and written rows only
        self.sample = _spread(self.valid, max_samples)
        self.classes = self._class_names()
        self.root, self.root_note = self._image_root(images, trust_store)
        self.model, self.model_note = self._model(model, trust_store)

    def _class_names(self) -> list[str] | None:
        if self.labels is None:
            return None
        if self.meta.get("classes"):
            return list(self.meta["classes"])
        if self.meta["ids"] == "path":  # ImageFolder labels: the sorted class sub-folders
            tops = sorted({i.split("/")[0] for i in self.ids.tolist() if "/" in i})
            if tops and int(self.labels.max()) < len(tops):
                return tops
        return None

    def class_name(self, label: int) -> str:
        if self.classes is not None and 0 <= label < len(self.classes):
            return self.classes[label]
        return f"class {label}"

    def _image_root(self, images: str | Path | None, trust_store: bool) -> tuple[Path | None, str]:
        """The image folder, and why there is none: the one given, or with consent the recorded one."""
        if self.meta["ids"] != "path":
            return None, "the store's samples are not image files (their ids are indices), so there are no images to show"
        if images is None:
            root = self.meta.get("root")
            data = str(self.meta.get("data", ""))
            if root is None and data.startswith("images "):  # extract_dataset's description of a folder
                root = data.removeprefix("images ")
            if root is None:
                return None, "the store does not record its image folder; pass it with images= / --images DIR"
            if not trust_store:
                return None, (
                    f"the store records its images as {root!r}, which is read only if you trust the store; pass the "
                    "folder with images= / --images DIR, or trust_store=True / --trust"
                )
            images = root
        found = Path(images)
        return (found.parent if found.is_file() else found), ""

    def _model(self, model: nn.Module | str | None, trust_store: bool) -> tuple[nn.Module | None, str]:
        """The model, and a note when it cannot explain the stored features.

        A spec given here must load. The spec the store records is only tried, and only with
        ``trust_store``: it is data from whoever wrote the store, and loading it runs code.
        """
        if isinstance(model, str):
            model = load_model(model)
        elif model is None:
            spec = str(self.meta.get("model", ""))
            try:
                spec_kind(spec)  # parses the text only
            except ModelLoadError:
                return None, f"the store names its model only as {spec!r}, not as a spec to load; pass the model with model= / --model SPEC"
            if not trust_store:
                return None, (
                    f"the store records its model as {spec!r}, which is loaded only if you trust the store (loading a model "
                    f"runs code); pass the model with model= / --model SPEC, or trust_store=True / --trust to load {spec!r}"
                )
            # quoted: the text is the store's, and must not pass control characters to the terminal
            print(f"layertap: loading the model the store records (trusted): {spec!r}", file=sys.stderr, flush=True)
            try:
                model = load_model(spec, trust=True)
            except Exception as e:  # a model that no longer loads only costs the sections that need it
                return None, f"the store's model {spec!r} could not be loaded ({_one_line(e)}); pass it with model= / --model SPEC"
        expected = (self.meta.get("settings") or {}).get("model")
        if expected is not None and model_fingerprint(model) != expected:
            return model, (
                "the model's weights are not those that wrote the store (new random weights, or another "
                "checkpoint), so it cannot explain its features; pass the model that wrote them"
            )
        return model, ""

    def matching_model(self) -> nn.Module:
        if self.model is None or self.model_note:
            raise Unavailable(self.model_note or "no model")
        return self.model

    def image_paths(self, rows: np.ndarray) -> list[Path]:
        if self.root is None:
            raise Unavailable(self.root_note)
        root = self.root.resolve()
        paths: list[Path] = []
        outside: list[str] = []
        for i in rows:
            path = _inside(root, str(self.ids[i]))
            if path is None:
                outside.append(str(self.ids[i]))
            else:
                paths.append(path)
        if outside:  # checked before any file is touched: a store must not show images from elsewhere
            more = f" (and {len(outside) - 1} more)" if len(outside) > 1 else ""
            raise Unavailable(
                f"the store's sample id {outside[0]!r}{more} leads outside its image folder {root}, and layertap reads "
                "no image outside it; the store was altered: extract it again from the images"
            )
        missing = [p for p in paths if not p.is_file()]
        if missing:
            raise Unavailable(f"{len(missing)} of the store's image files are not where it says, e.g. {missing[0]}; pass the image folder with images= / --images DIR")
        return paths


def _inside(root: Path, name: str) -> Path | None:
    """``root / name`` resolved (links followed) when it lies inside ``root`` (resolved), else ``None``."""
    try:
        path = (root / name).resolve()
    except (OSError, ValueError):  # a loop of links, a NUL byte
        return None
    return path if path.is_relative_to(root) else None


def _spread(rows: np.ndarray, k: int) -> np.ndarray:
    """At most ``k`` of ``rows``, evenly spaced (folders are sorted by class: every class shows)."""
    if len(rows) <= k:
        return rows
    return rows[np.unique(np.linspace(0, len(rows) - 1, k).round().astype(np.int64))]


def _one_line(e: BaseException) -> str:
    return " ".join(str(e).split()) or type(e).__name__


# ------------------------------------------------------------------------------ small renderers
def _esc(x: Any) -> str:
    return html.escape(str(x))


def _png(image: Any) -> str:
    """A PIL image as a ``data:`` URI."""
    buffer = io.BytesIO()
    image.save(buffer, format="PNG", optimize=True)
    return "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")


def _num(v: float | None) -> str:
    return "–" if v is None or not math.isfinite(v) else f"{v:.4g}"


def _percent(v: float) -> str:
    return "0" if not v else f"{100 * v:.3g}%"


def _colour(label: int) -> str:
    return PALETTE[label % len(PALETTE)]


def _legend(ctx: _Context, labels: Sequence[int]) -> str:
    items = "".join(
        f"<span class='key'><span class='swatch' style='background:{_colour(k)}'></span>{_esc(ctx.class_name(k))}</span>"
        for k in sorted(set(labels))
    )
    return f"<p class='legend'>Classes: {items}</p>"


# ------------------------------------------------------------------------------ store rows
def _blocks(array: Any, rows: np.ndarray) -> Iterator[np.ndarray]:
    """``array[rows]`` (sorted rows), block by block: every read is a contiguous slice."""
    row_bytes = max(1, int(np.prod(array.shape[1:], dtype=np.int64)) * np.dtype(array.dtype).itemsize)
    block = max(1, BLOCK_BYTES // row_bytes)
    for start in range(0, int(array.shape[0]), block):
        picked = rows[(rows >= start) & (rows < start + block)]
        if len(picked):
            yield np.asarray(array[start : start + block])[picked - start]


def _per_channel(x: np.ndarray) -> tuple[np.ndarray, str]:
    """Rows ``[N, ...]`` as ``[N, D]`` vectors: maps averaged per channel, as ``reduce="mean"``."""
    if x.ndim >= 4:  # [N, C, *spatial]
        return x.reshape(*x.shape[:2], -1).mean(-1), "each channel averaged over its positions"
    if x.ndim == 3:  # [N, tokens, D]
        return x.mean(1), "averaged over tokens"
    return x.reshape(len(x), -1), ""


# ------------------------------------------------------------------------------ sections
def _store_section(ctx: _Context) -> str:
    meta, store = ctx.meta, ctx.store
    arrays = "<br>".join(
        f"<code>{_esc(a['key'])}</code> {_esc(' × '.join(map(str, a['shape'])) or 'scalar')} {_esc(a['dtype'])}" for a in meta["arrays"]
    )
    state = "complete" if store.complete else "<b class='bad'>incomplete</b>: the extraction was interrupted; run it again to finish"
    failed = len(store.failed)
    rows = [
        ("Store", f"<code>{_esc(store.path)}</code> ({_esc(store.format)}, {state})"),
        ("Model", _esc(meta.get("model", "?"))),
        ("Data", _esc(meta.get("data", "?"))),
        ("Samples", f"{store.num_samples:,}" + (f", of which {failed:,} could not be read" if failed else "")),
        ("Labels", _labels_line(ctx)),
        ("Stored arrays", arrays),
        ("Reduction", _esc(meta.get("reduce") or "none (whole outputs)")),
        ("Created", _esc(meta.get("created", "?")) + " with " + _esc(", ".join(f"{k} {v}" for k, v in meta.get("versions", {}).items()))),
    ]
    if ctx.model_note:
        rows.append(("Note", _esc(ctx.model_note)))
    body = "".join(f"<tr><th>{k}</th><td>{v}</td></tr>" for k, v in rows)
    return f"<table class='facts'>{body}</table>"


def _labels_line(ctx: _Context, shown: int = 30) -> str:
    if ctx.labels is None:
        return "none"
    present = np.unique(ctx.labels[ctx.valid])
    names = ", ".join(_esc(ctx.class_name(int(k))) for k in present[:shown])
    return names + (f", … ({len(present):,} classes)" if len(present) > shown else "")


def _layers_section(ctx: _Context) -> str:
    if ctx.model is None:
        raise Unavailable(ctx.model_note)
    table = summary(ctx.model)
    stored = set(ctx.store.layers)
    head = "".join(f"<th>{c}</th>" for c in ("Layer", "Type", "Input", "Output", "Calls", "Params", "Output per sample"))
    body = []
    for row in table.to_dicts():
        name = row["name"] or "(model)"
        depth = name.count(".") + (1 if row["name"] else 0)
        cells = [
            f"<td style='padding-left:{0.4 + 1.1 * depth:.1f}em'>{_esc(name)}</td>",
            f"<td>{_esc(row['type'])}</td>",
            f"<td>{_esc(_shape(row['input']))}</td>",
            f"<td>{_esc(_shape(row['output']))}</td>",
            f"<td class='n'>{row['calls']}</td>",
            f"<td class='n'>{row['params_total']:,}</td>",
            f"<td class='n'>{human_bytes(row['bytes_per_sample']) if row['calls'] else '–'}</td>",
        ]
        cls = " class='stored'" if row["name"] in stored else ""
        body.append(f"<tr{cls}>{''.join(cells)}</tr>")
    note = " These are its layers, but its weights are not those that wrote the store (see the note above)." if ctx.model_note else ""
    caption = (
        f"{_esc(table.model)}: {table.params:,} parameters, shapes for an example batch of {table.batch_size}. "
        f"<b>Bold</b> rows are the layers in the store.{note}"
    )
    table_html = f"<table class='grid'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"
    if len(body) > 80:  # a long table stays folded
        table_html = f"<details><summary>Show all {len(body)} layers</summary>{table_html}</details>"
    return f"<p class='caption'>{caption}</p>{table_html}"


def _shape(structure: Any) -> str:
    if structure is None:
        return "–"
    return json.dumps(structure, separators=(", ", ": "))


def _heatmaps_section(ctx: _Context, method: str, count: int, layer: str | None) -> str:
    model = ctx.matching_model()
    info = model_info(model)
    if info.kind != "vision":
        raise Unavailable(f"heatmaps need an image model; this one is a {info.kind} model")
    rows = _spread(ctx.valid, count)
    paths = ctx.image_paths(rows)
    transform = info.transform
    assert transform is not None  # ModelInfo.__post_init__ fills in the default
    x = torch.stack([transform(load_image(p)) for p in paths])
    device = place_model(model, None)
    explainer = cam.METHODS[method](model, layer)
    maps = explainer(x.to(device)).cpu()
    assert explainer.logits is not None  # set by the call above
    probs = explainer.logits.detach().float().softmax(-1).cpu()
    # show the input as the model saw it (resized, cropped), its normalisation undone by a stretch to [0, 1]
    low = x.flatten(1).amin(1).view(-1, 1, 1, 1)
    high = x.flatten(1).amax(1).view(-1, 1, 1, 1)
    shown = (x - low) / (high - low).clamp(min=1e-8)
    tiles, right, judged = [], 0, 0
    for k, row in enumerate(rows):
        cls = int(probs[k].argmax())
        predicted = info.classes[cls] if info.classes and cls < len(info.classes) else f"class {cls}"
        true = ctx.class_name(int(ctx.labels[row])) if ctx.labels is not None else None
        # judged only when the true class is one of the model's (folder names may be other names)
        judge = true is not None and true in (info.classes or ())
        verdict = "" if not judge else " ok" if true == predicted else " wrong"
        judged += judge
        right += judge and true == predicted
        label = "" if true is None else f"true: <b>{_esc(true)}</b><br>"
        tiles.append(
            f"<figure class='tile{verdict}'><img src='{_png(overlay(shown[k], maps[k]))}' alt='{_esc(ctx.ids[row])}' title='{_esc(ctx.ids[row])}'>"
            f"<figcaption>{label}predicted: <b>{_esc(predicted)}</b> ({100 * float(probs[k, cls]):.0f}%)</figcaption></figure>"
        )
    score = f" {right} of {judged} predictions shown are right (green), the others red." if judged else ""
    caption = (
        f"{_esc(type(explainer).__name__)} at <code>{_esc(', '.join(explainer.layers or []))}</code> for the predicted class "
        f"of {len(rows)} images spread over the store; red is where the evidence for that class lies.{score}"
    )
    return f"<p class='caption'>{caption}</p><div class='tiles'>{''.join(tiles)}</div>"


def _pca(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The first two principal components' coordinates ``[N, 2]`` and shares of the variance."""
    t = torch.from_numpy(x).double()
    t = t - t.mean(0)
    # torch's LAPACK, not numpy's: OpenBLAS's threaded SVD takes seconds on a small matrix on a
    # busy 2-core machine, where torch's takes milliseconds
    u, s, _ = torch.linalg.svd(t, full_matrices=False)
    var = s.square()
    share = (var[:2] / var.sum() if var.sum() > 0 else torch.zeros(2)).numpy()
    coords = (u[:, :2] * s[:2]).numpy()
    if coords.shape[1] < 2:  # a single feature: one component
        coords, share = np.pad(coords, ((0, 0), (0, 2 - coords.shape[1]))), np.pad(share, (0, 2 - len(share)))
    return coords, share


def _nearest_mean(coords: np.ndarray, labels: np.ndarray) -> float:
    """Share of points nearer to their own class's mean than to any other (in the plane)."""
    classes = np.unique(labels)
    means = np.stack([coords[labels == k].mean(0) for k in classes])
    nearest = classes[((coords[:, None, :] - means[None]) ** 2).sum(-1).argmin(1)]
    return float((nearest == labels).mean())


def _scatter(coords: np.ndarray, share: np.ndarray, labels: np.ndarray | None, title: str, subtitle: str) -> str:
    width, height, left, right, top, bottom = 380, 330, 34, 12, 46, 40
    w, h = width - left - right, height - top - bottom
    lo, hi = coords.min(0), coords.max(0)
    span = np.where(hi - lo > 0, hi - lo, 1.0)
    px = left + 4 + (coords[:, 0] - lo[0]) / span[0] * (w - 8)
    py = top + 4 + (1 - (coords[:, 1] - lo[1]) / span[1]) * (h - 8)
    order = np.random.default_rng(0).permutation(len(coords))  # no class drawn entirely on top
    dots = "".join(
        f"<circle cx='{px[i]:.1f}' cy='{py[i]:.1f}' r='2.6' fill='{_colour(int(labels[i])) if labels is not None else '#1f77b4'}'/>"
        for i in order
    )
    return (
        f"<svg class='plot' width='{width}' height='{height}' viewBox='0 0 {width} {height}' role='img' aria-label='{_esc(title)}'>"
        f"<text x='{width / 2}' y='18' class='t'>{_esc(title)}</text>"
        f"<text x='{width / 2}' y='35' class='s'>{_esc(subtitle)}</text>"
        f"<rect x='{left}' y='{top}' width='{w}' height='{h}' class='frame'/>"
        f"<g fill-opacity='0.75'>{dots}</g>"
        f"<text x='{left + w / 2}' y='{height - 12}' class='a'>PC1 ({100 * share[0]:.0f}% of variance)</text>"
        f"<text x='14' y='{top + h / 2}' class='a' transform='rotate(-90 14 {top + h / 2})'>PC2 ({100 * share[1]:.0f}% of variance)</text>"
        "</svg>"
    )


def _pca_section(ctx: _Context) -> str:
    rows = ctx.sample
    if len(rows) < 3:
        raise Unavailable(f"a projection needs at least 3 readable samples; the store has {len(rows)}")
    labels = ctx.labels[rows] if ctx.labels is not None else None
    plots = []
    for key in ctx.store:
        x, note = _per_channel(np.concatenate(list(_blocks(ctx.store[key], rows))))
        finite = np.isfinite(x).all(1)
        if finite.sum() < 3:
            plots.append(f"<p class='missing'>{_esc(key)}: fewer than 3 samples without NaN or Inf, nothing to project.</p>")
            continue
        coords, share = _pca(x[finite])
        lab = labels[finite] if labels is not None else None
        subtitle = f"{x.shape[1]:,} features" + (f" ({note})" if note else "")
        if not finite.all():
            subtitle += f"; {int((~finite).sum())} with NaN/Inf left out"
        if lab is not None and len(np.unique(lab)) > 1:
            subtitle += f"; nearest class mean: {100 * _nearest_mean(coords, lab):.0f}% right"
        plots.append(_scatter(coords, share, lab, key, subtitle))
    sample = f"{len(rows):,} samples" + (f" (evenly spread over the {len(ctx.valid):,} in the store)" if len(rows) < len(ctx.valid) else "")
    caption = (
        f"Each stored layer's features for {sample}, projected on their first two principal components. "
        "Classes that form separate clouds are told apart by that layer; they usually separate more deeply "
        "in the network. <i>Nearest class mean</i> is the share of points lying nearer to the centre of their "
        "own class than to any other in the plane."
    )
    legend = _legend(ctx, labels.tolist()) if labels is not None else "<p class='legend'>The store has no labels: points are not coloured by class.</p>"
    return f"<p class='caption'>{caption}</p>{legend}<div class='plots'>{''.join(plots)}</div>"


def _stored_stats(ctx: _Context) -> StatsTable:
    """The statistics of the stored features (of the sampled rows), as `layertap.stats` reports them."""
    layer_of = {a["key"]: a["layer"] for a in ctx.meta["arrays"]}
    modules = named_layers(ctx.model) if ctx.model is not None else {}
    rows = {}
    for key in ctx.store:
        total = None
        for block in _blocks(ctx.store[key], ctx.sample):
            part = summarize(torch.from_numpy(np.ascontiguousarray(block)).float(), HISTOGRAM_BINS)
            if part is not None:
                total = part if total is None else total.merge(part)
        if total is not None:
            layer = layer_of[key]
            kind = type(modules[layer]).__name__ if layer in modules else "–"
            rows[key] = LayerStats.from_summary(total, name=key, layer=layer, call=0, module_type=kind)
    return StatsTable(rows, missing=[], explode_threshold=1e4)


def _stats_section(ctx: _Context, table: StatsTable | None) -> str:
    source = "of the layers' whole outputs, computed by <code>layertap.stats</code>"
    if table is None:
        try:
            model = ctx.matching_model()
            paths = ctx.image_paths(ctx.sample)
            table = activation_stats(
                model, ImageFiles(paths, None, model_info(model).transform), ctx.store.layers, histogram_bins=HISTOGRAM_BINS, num_workers=0
            )
            source = f"of each stored layer's whole output, computed by <code>layertap.stats</code> over {len(paths):,} of the store's images"
        except Unavailable as e:
            table = _stored_stats(ctx)
            source = (
                f"of the stored features themselves, over {len(ctx.sample):,} samples, not of the layers' whole "
                f"outputs: {_esc(e)}"
            )
    head = "".join(f"<th>{c}</th>" for c in ("Layer", "Type", "Shape per sample", "Mean", "Std", "Min", "Max", "Zeros", "Non-finite", "Dead channels", "Histogram", "Flags"))
    body = []
    for key, r in table.items():
        dead = f"{len(r.dead_channels)} / {r.channels}" if r.channels is not None else "?"
        flags = [f for f, on in (("non-finite", r.nonfinite_fraction > 0), ("exploding", table.is_exploding(r)), ("dead units", bool(r.dead_channels))) if on]
        cls = " class='flagged'" if flags else ""
        body.append(
            f"<tr{cls}><td>{_esc(key)}</td><td>{_esc(r.module_type)}</td><td>{_esc(' × '.join(map(str, r.shape[1:])) or 'scalar')}</td>"
            + "".join(f"<td class='n'>{_num(v)}</td>" for v in (r.mean, r.std, r.min, r.max))
            + f"<td class='n'>{_percent(r.zero_fraction)}</td><td class='n'>{_percent(r.nonfinite_fraction)}</td>"
            f"<td class='n'>{dead}</td><td>{_sparkline(r.histogram)}</td><td>{_esc(', '.join(flags))}</td></tr>"
        )
    caption = (
        f"Statistics {source}. Mean, std, min and max are over finite values; <i>zeros</i> is the share of exact zeros "
        "(ReLU outputs are often half zero); a <i>dead</i> channel is zero for every sample; histogram bars are log-scaled counts. Flagged rows are shaded."
    )
    return f"<p class='caption'>{caption}</p><table class='grid'><thead><tr>{head}</tr></thead><tbody>{''.join(body)}</tbody></table>"


def _sparkline(histogram: tuple[np.ndarray, np.ndarray] | None) -> str:
    if histogram is None:
        return "–"
    counts, edges = histogram
    width, height = 120, 26
    bar = width / len(counts)
    heights = (height - 2) * np.log1p(counts) / max(float(np.log1p(counts.max())), 1e-9)  # log: tails show beside a spike at 0
    bars = "".join(
        f"<rect x='{i * bar:.1f}' y='{height - 1 - h:.1f}' width='{max(bar - 0.5, 0.5):.1f}' height='{h:.1f}'/>"
        for i, h in enumerate(heights.tolist())
    )
    span = f"{_num(float(edges[0]))} to {_num(float(edges[-1]))}"
    return (
        f"<svg class='spark' width='{width}' height='{height}' role='img' aria-label='histogram from {span}'>"
        f"<title>histogram of the values (log counts), from {span}</title>{bars}</svg><div class='range'>{span}</div>"
    )


# ------------------------------------------------------------------------------ the page
_CSS = """
body{font:15px/1.45 system-ui,-apple-system,"Segoe UI",Roboto,"DejaVu Sans",sans-serif;color:#1d232a;background:#fff;margin:0}
main{max-width:1240px;margin:0 auto;padding:24px 28px 60px}
h1{font-size:26px;margin:0 0 4px}h2{font-size:20px;margin:34px 0 8px;padding-top:12px;border-top:2px solid #e3e7ec}
nav a{margin-right:14px;color:#0b62a8}.sub{color:#5b6672;margin:0 0 10px}
code{font:13px ui-monospace,"DejaVu Sans Mono",monospace;background:#f2f4f7;padding:1px 4px;border-radius:3px}
.caption{color:#3a4450;max-width:960px}.missing{background:#fff6e0;border-left:4px solid #e0a400;padding:8px 12px}
table{border-collapse:collapse;font-size:13px}th,td{padding:3px 10px;text-align:left;vertical-align:top}
table.grid th{background:#eef1f5;position:sticky;top:0}table.grid tr:nth-child(even) td{background:#fafbfc}
table.grid td.n{text-align:right;font-variant-numeric:tabular-nums}table.grid tr.stored td{font-weight:700}
table.grid tr.flagged td{background:#fdeeee}table.facts th{color:#5b6672;font-weight:600;white-space:nowrap}
.tiles{display:grid;grid-template-columns:repeat(auto-fill,minmax(132px,1fr));gap:12px}
.tile{margin:0;border:2px solid #d5dbe2;border-radius:6px;padding:4px;background:#fafbfc}
.tile.ok{border-color:#2ca02c}.tile.wrong{border-color:#d62728}
.tile img{width:100%;image-rendering:auto;display:block;border-radius:3px}
.tile figcaption{font-size:13px;padding:4px 2px 0}
.plots{display:flex;flex-wrap:wrap;gap:14px}.plot{border:1px solid #e3e7ec;border-radius:6px;background:#fff}
.plot .t{font-weight:700;font-size:14px;text-anchor:middle}.plot .s{font-size:11.5px;fill:#5b6672;text-anchor:middle}
.plot .a{font-size:12px;fill:#3a4450;text-anchor:middle}.plot .frame{fill:none;stroke:#c4ccd5}
.legend .key{margin-right:14px;white-space:nowrap}.swatch{display:inline-block;width:12px;height:12px;border-radius:6px;margin-right:5px;vertical-align:-1px}
.spark rect{fill:#4a7fb5}.range{font-size:11px;color:#5b6672}.bad{color:#b3261e}footer{margin-top:40px;color:#7a8590;font-size:12px}
"""


def build_report(
    store: str | Path | FeatureStore,
    out_html: str | Path,
    *,
    model: nn.Module | str | None = None,
    images: str | Path | None = None,
    stats: StatsTable | None = None,
    cam_method: str = "gradcam",
    cam_layer: str | None = None,
    heatmaps: int = 16,
    max_samples: int = 1000,
    title: str | None = None,
    trust_store: bool = False,
) -> Path:
    """Write one self-contained HTML page about ``store`` to ``out_html``; return its path.

    Args:
        store: a feature store (path or `FeatureStore`) written by `layertap.extract_dataset`.
        model: the model that wrote it, or its spec. Without it, the sections that need a model
            say how to give one.
        images: the image folder the store's ids are relative to; default, with ``trust_store``:
            the one it records.
        stats: statistics to show instead of computing them (e.g. the `layertap.stats` table
            you already have).
        cam_method: a `layertap.cam.METHODS` name; ``cam_layer`` its layer (default: chosen by it).
        heatmaps: how many images the heatmap grid shows.
        max_samples: samples drawn in the projections and used for the statistics over images.
        title: the page title; default names the model.
        trust_store: use what the store records: without ``model``, load its spec (named on
            stderr first), as ``load_model(spec, trust=True)``, which runs code the store names
            (a ``package.module:callable``, a pickled model, a Hugging Face folder's own code);
            without ``images``, read its image folder. Pass it only for a store you trust.

    Example:
        >>> import layertap
        >>> layertap.build_report("feats.zarr", "feats.html", model="torchvision:resnet18")  # doctest: +SKIP
    """
    if cam_method not in cam.METHODS:
        raise ArgumentError(f"unknown cam_method {cam_method!r}; choose from {list(cam.METHODS)}")
    if heatmaps < 1 or max_samples < 3:
        raise ArgumentError(f"need heatmaps >= 1 and max_samples >= 3, got {heatmaps} and {max_samples}")
    require("PIL.Image", "vision")
    started = time.perf_counter()
    opened = store if isinstance(store, FeatureStore) else open_features(store)
    try:
        ctx = _Context(opened, model, images, max_samples, trust_store)
        builders = {
            "store": lambda: _store_section(ctx),
            "layers": lambda: _layers_section(ctx),
            "heatmaps": lambda: _heatmaps_section(ctx, cam_method, heatmaps, cam_layer),
            "pca": lambda: _pca_section(ctx),
            "stats": lambda: _stats_section(ctx, stats),
        }
        sections = []
        for key, build in builders.items():
            try:
                body = build()
            except Unavailable as e:
                body = f"<p class='missing'>Not shown: {_esc(e)}.</p>"
            except Exception as e:  # one failing section must not cost the rest of the page
                body = f"<p class='missing'>This section failed: {_esc(type(e).__name__)}: {_esc(_one_line(e))}</p>"
            sections.append(f"<section id='{key}'><h2>{SECTIONS[key]}</h2>{body}</section>")
        subtitle = f"{opened.num_samples:,} samples × {len(opened.layers)} layers from <code>{_esc(opened.path)}</code>"
    finally:
        if opened is not store:
            opened.close()
    name = title or f"layertap report: {ctx.meta.get('model', 'model')}"
    nav = "".join(f"<a href='#{key}'>{text}</a>" for key, text in SECTIONS.items())
    made = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M")
    page = (
        "<!DOCTYPE html><html lang='en'><head><meta charset='utf-8'>"
        "<meta name='viewport' content='width=device-width, initial-scale=1'>"
        f"<title>{_esc(name)}</title><style>{_CSS}</style></head><body><main>"
        f"<h1>{_esc(name)}</h1><p class='sub'>{subtitle}</p><nav>{nav}</nav>{''.join(sections)}"
        f"<footer>Made by layertap on {made} in {time.perf_counter() - started:.1f} s. "
        "This page is self-contained: it loads nothing from the network.</footer></main></body></html>"
    )
    out = Path(out_html)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(page, encoding="utf-8")
    return out


__all__ = ["SECTIONS", "build_report"]
