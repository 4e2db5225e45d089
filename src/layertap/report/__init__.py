"""One self-contained HTML page about a feature store: what a person looks at instead of tensors.

>>> import layertap
>>> layertap.build_report("features.zarr", "report.html")      # doctest: +SKIP
PosixPath('report.html')

The page opens offline, from the file, with no server. It has:

- **Feature store**: model, data, samples, stored arrays (shapes per sample), settings;
- **Layers of the model**: `layertap.summary`, the stored layers in bold;
- **Heatmaps**: Grad-CAM (or another `layertap.cam` method) of a grid of the store's images, each
  image shown whole beside its map, laid where the model saw it (`layertap.images.to_original`),
  with a colour bar and the true and predicted classes; misclassified images first;
- **Features in 2-D**: each stored layer's features by PCA (and t-SNE / UMAP when asked for and
  installed), coloured by class; hover a point for its thumbnail, id, true and predicted class,
  click to pin it, search an id to ring it in every layer's plot;
- **Linear probes**: per layer, the cross-validated accuracy of a logistic regression predicting
  the class from the features (`layertap.report.probe`), layers ranked by it;
- **Activation statistics**: `layertap.stats` of the stored layers over the store's images (or,
  without the model, of the stored features), with sample counts, shapes per sample and
  histograms whose bars give their range and count on hover.

Scale. A store of many layers shows at most ``max_layers`` of them (24) in the plots, the probes
and the statistics table, evenly spread from the first to the last (and every flagged layer in
the table); each plot draws at most ``max_points`` samples (1,000). The page names what it
left out. Features are read a block of rows at a time and reduced as they are read; a layer
wider than 2,048 features is hashed to 2,048 (signed feature hashing, which keeps distances
and principal components approximately), so memory follows the sampled rows, not the width.
The page is written whole or not at all (a temporary file renamed over the old page).

Scripts. The page's one script is inline, hand-written and short (hover cards, pinning, search);
there is no plotting library. A library would cost far more than it brings here: Plotly's
bundle alone is about 3.5 MB per page, and the plots are a few hundred points each, which SVG
draws at once. Because the points, tables and images are plain HTML and SVG on the page, it
reads the same with scripts off: the same sections, the points with their ids and classes as
tooltips, the heatmap grid and the probe table; only the hover thumbnails and search need the
script. The samples' data (ids, classes, thumbnails) is an inert JSON block, escaped so that no
id can end it, and the script writes ids into the page as text, never as HTML.

Everything comes from the store and, when they are at hand, the model that wrote it and the
image files its ids name. The model is used only if its weights are those that wrote the store
(`model_fingerprint`); the model's predictions come from the store, when it holds the model's
output layer. A section that cannot be made is replaced by a note saying why and what to pass;
it never stops the page.

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

import datetime
import string
import time
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path

from torch import nn

from .. import cam
from ..atomic import check_target, write_atomic
from ..errors import ArgumentError, StoreError, require
from ..printable import printable
from ..progress import progress_bar
from ..stats import StatsTable
from ..store import FeatureStore, open_features
from .context import MAX_LAYERS, MAX_POINTS, Context, Unavailable, one_line
from .projection import PROJECTIONS
from .render import data_uri, esc, json_script
from .sections import (
    HISTOGRAM_BINS,
    heatmaps_section,
    layers_section,
    probe_section,
    projection_section,
    stats_section,
    store_section,
)

SECTIONS = {
    "store": "Feature store",
    "layers": "Layers of the model",
    "heatmaps": "Heatmaps",
    "projection": "Features in 2-D",
    "probe": "Linear probes",
    "stats": "Activation statistics",
}
THUMBNAIL = 96  # pixels on the long side of the hover thumbnails, at most


def _samples(ctx: Context) -> tuple[dict[str, list], list[str], str]:
    """The sampled rows as the page's script reads them (ids, classes, thumbnails), each point's
    tooltip without scripts, and a note when there are no thumbnails."""
    rows = ctx.points.tolist()
    truth = [ctx.true_name(r) for r in rows]
    predicted = [ctx.predicted_name(ctx.predictions[r]) if r in ctx.predictions else None for r in rows]
    ids = [str(ctx.ids[r]) for r in rows]
    note = ""
    try:
        images: list[str | None] = [data_uri(t, photo=True) for t in ctx.thumbnails(ctx.points, THUMBNAIL)]
    except Exception as e:  # no folder, an id outside it, an unreadable file: no thumbnails, still a page
        images, note = [None] * len(rows), f" Hover shows no images: {esc(one_line(e))}."
    if not ctx.predictions:
        note += " No predicted classes: the store does not hold the model's output layer" + (
            "." if ctx.model is not None else ", or there is no model to tell which layer that is."
        )
    tips = [
        esc(" · ".join([i] + ([f"true: {t}"] if t else []) + ([f"predicted: {p}"] if p else []))) for i, t, p in zip(ids, truth, predicted)
    ]
    return {"ids": ids, "truth": truth, "predicted": predicted, "images": images}, tips, note


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
    max_layers: int = MAX_LAYERS,
    max_points: int = MAX_POINTS,
    projections: Sequence[str] = ("pca",),
    title: str | None = None,
    trust_store: bool = False,
    progress: bool = True,
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
        max_samples: samples probed and used for the statistics (over images or over the stored
            features), evenly spread over the store.
        max_layers: stored layers drawn, probed and listed in the statistics (evenly spread from
            the first to the last; flagged ones are listed too); the page names those left out.
        max_points: samples drawn in each plot, at most (evenly spread over those sampled).
        projections: ``"pca"``, ``"tsne"`` (needs scikit-learn), ``"umap"`` (needs umap-learn).
        title: the page title; default names the model.
        trust_store: use what the store records: without ``model``, load its spec (named on
            stderr first), as ``load_model(spec, trust=True)``, which runs code the store names
            (a ``package.module:callable``, a pickled model, a Hugging Face folder's own code);
            without ``images``, read its image folder. Pass it only for a store you trust.
        progress: show the sections being built on a progress bar (see `layertap.progress`).

    Example:
        >>> import layertap
        >>> layertap.build_report("feats.zarr", "feats.html", model="torchvision:resnet18")  # doctest: +SKIP
    """
    if cam_method not in cam.METHODS:
        raise ArgumentError(f"unknown cam_method {cam_method!r}; choose from {list(cam.METHODS)}")
    if heatmaps < 1 or max_samples < 3 or max_layers < 1 or max_points < 3:
        raise ArgumentError(
            f"need heatmaps >= 1, max_samples >= 3, max_layers >= 1 and max_points >= 3, got {heatmaps}, {max_samples}, {max_layers} and {max_points}"
        )
    unknown = [p for p in projections if p not in PROJECTIONS]
    if unknown or not projections:
        raise ArgumentError(f"unknown projections {unknown}; choose from {list(PROJECTIONS)}")
    require("PIL.Image", "vision")
    out = check_target(out_html, "the report")  # before the work, not after it
    started = time.perf_counter()
    opened = store if isinstance(store, FeatureStore) else open_features(store)
    try:
        ctx = Context(opened, model, images, max_samples, trust_store, max_layers, max_points)
        samples, tips, hover_note = _samples(ctx)
        builders: dict[str, Callable[[], str]] = {
            "store": lambda: store_section(ctx),
            "layers": lambda: layers_section(ctx),
            "heatmaps": lambda: heatmaps_section(ctx, cam_method, heatmaps, cam_layer),
            "projection": lambda: projection_section(ctx, projections, tips, hover_note),
            "probe": lambda: probe_section(ctx),
            "stats": lambda: stats_section(ctx, stats, progress),
        }
        sections = []
        with progress_bar(len(builders), desc="report", unit="section", enabled=progress) as bar:
            for key, build in builders.items():
                try:
                    body = build()
                except Unavailable as e:
                    body = f"<p class='missing'>Not shown: {esc(e)}.</p>"
                except StoreError:  # a damaged store (a chunk that does not decode) fails the report, in one line
                    raise
                except Exception as e:  # one failing section must not cost the rest of the page
                    body = f"<p class='missing'>This section failed: {esc(type(e).__name__)}: {esc(one_line(e))}</p>"
                sections.append(f"<section id='{key}'><h2>{SECTIONS[key]}</h2>{body}</section>")
                bar.update(1)
        subtitle = f"{opened.num_samples:,} samples × {len(opened.layers)} layers from <code>{esc(opened.path)}</code>"
    finally:
        if opened is not store:
            opened.close()
    name = title or f"layertap report: {ctx.meta.get('model', 'model')}"
    made = datetime.datetime.now().astimezone().strftime("%Y-%m-%d %H:%M")
    page = string.Template(resources.files(__name__).joinpath("template.html").read_text(encoding="utf-8")).substitute(
        title=esc(name),
        subtitle=subtitle,
        nav="".join(f"<a href='#{key}'>{text}</a>" for key, text in SECTIONS.items()),
        sections="\n".join(sections),
        samples=json_script("lt-samples", samples),
        footer=(
            f"Made by layertap on {made} in {time.perf_counter() - started:.1f} s. This page is self-contained: it loads "
            "nothing from the network. Its short inline script adds the hover cards and search; without it, all else shows."
        ),
    )
    # control and bidirectional characters (ESC, BEL, U+202E) from the store's names made visible, as
    # in the terminal (markup is escaped where each part is made); whole or not at all: a full disk
    # leaves the old page as it was, and says which file
    return write_atomic(out, printable(page, keep="\n\t\r"), "the report")


__all__ = ["HISTOGRAM_BINS", "SECTIONS", "build_report"]
