"""``layertap report``: one self-contained HTML page about a feature store."""

from __future__ import annotations

import os
from pathlib import Path

from ..cam import METHODS
from ..loading import load_model
from ..report import build_report
from ..report.context import MAX_LAYERS, MAX_POINTS
from ..report.projection import PROJECTIONS
from ..store.paths import is_url, location
from .core import app, echo, own_allocator, typer
from .options import TRUST_HELP, arch_option, check_method, check_spec, trust_option


def _check_projections(names: list[str]) -> list[str]:
    unknown = [n for n in names if n not in PROJECTIONS]
    if unknown:
        raise typer.BadParameter(f"unknown projection {unknown[0]!r}; choose from {', '.join(PROJECTIONS)}")
    return names


@app.command()
def report(
    store: str = typer.Argument(..., help="A feature store written by `layertap extract` (Zarr, HDF5 or npy), or a Zarr URL."),
    out: Path | None = typer.Option(None, "--out", help="The HTML file to write (default: beside the store, STORE.html)."),
    model: str | None = typer.Option(
        None, "--model", callback=check_spec,
        help="The model that wrote the store, as a spec (default: none; with --trust, the spec the store records).",
    ),
    arch: str | None = arch_option("--model"),
    images: Path | None = typer.Option(None, "--images", help="The image folder the store's ids are relative to (default: none; with --trust, the one the store records)."),
    method: str = typer.Option("gradcam", "--method", callback=check_method, help=f"Heatmap method: {', '.join(METHODS)}."),
    heatmaps: int = typer.Option(16, "--heatmaps", min=1, help="How many images the heatmap grid shows."),
    max_samples: int = typer.Option(1000, "--max-samples", min=3, help="Samples probed and used for statistics."),
    max_layers: int = typer.Option(
        MAX_LAYERS, "--max-layers", min=1,
        help="Stored layers drawn, probed and listed in the statistics, evenly spread (flagged ones are listed too); the page names those left out.",
    ),
    max_points: int = typer.Option(MAX_POINTS, "--max-points", min=3, help="Samples drawn in each 2-D plot, at most."),
    projection: list[str] = typer.Option(
        ["pca"], "--projection", callback=_check_projections,
        help="How the features are drawn in 2-D, repeatable: pca, tsne (needs scikit-learn), umap (needs umap-learn).",
    ),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show the sections being built on a progress bar (on a terminal only)."),
    trust: bool = trust_option(
        "Use what the store records: without --model, its model spec (named on stderr first; it runs code the store "
        "names); without --images, its image folder. "
        + TRUST_HELP
    ),
) -> None:
    """Write one HTML page (it opens offline, from the file) with the model's layer table, heatmaps
    of the store's images with true and predicted classes, every stored layer's features in 2-D
    (hover a point for its image, search an id), a linear probe's accuracy per layer, and
    activation statistics with histograms. Sections that need what the store lacks (the model,
    the image files) say so instead. A store is data: the model and the image folder it records
    are used only with --trust, and only images inside the image folder are read.

    Example: layertap report ./features.zarr --out report.html
    """
    own_allocator()
    if arch is not None and model is None:
        raise typer.BadParameter("--arch names the architecture of a --model state-dict file: give --model too", param_hint="'--arch'")
    where = location(store)
    if is_url(where) and out is None:
        raise typer.BadParameter(f"{store} is a URL: say where the page goes with --out", param_hint="'--out'")
    if isinstance(where, Path) and not where.exists():  # a location is a str only when it is a URL
        raise typer.BadParameter(f"no feature store at {store}", param_hint="'STORE'")
    # "." and ".." name no store: the absolute path does (symlinks kept, so it is beside the name given)
    target = out or Path(os.path.abspath(where)).with_suffix(".html")
    net = load_model(model, arch=arch, trust=trust) if model is not None else None
    path = build_report(
        where, target, model=net, images=images, cam_method=method, heatmaps=heatmaps, max_samples=max_samples,
        max_layers=max_layers, max_points=max_points, projections=projection, trust_store=trust, progress=progress,
    )
    echo(f"report: {path}")
