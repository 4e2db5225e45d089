"""``layertap demo``: the whole tour on the bundled model and generated images, offline."""

from __future__ import annotations

from pathlib import Path

from ..demo import run_demo
from .core import app, typer


@app.command()
def demo(
    out: Path = typer.Option(Path("layertap-demo"), "--out", help="Folder for the images, the feature store and report.html."),
    images: int = typer.Option(300, "--images", min=3, help="How many images to generate."),
    seed: int = typer.Option(0, "--seed", help="Seed of the generated images."),
) -> None:
    """Run layertap on its bundled shapes model: layer table, feature extraction into a Zarr
    store, Grad-CAM heatmaps, activation statistics, and OUT/report.html to open in a browser.
    Needs no download; takes well under a minute on a laptop.

    Example: layertap demo --out ./layertap-demo
    """
    run_demo(out, n_images=images, seed=seed)
