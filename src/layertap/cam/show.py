"""Showing heatmaps: `show` draws a method's maps over their images as a `HeatmapGrid`.

The methods return plain tensors; this is the view of one, as a grid a notebook displays
(HTML, or PNG) and `HeatmapGrid.save` writes. The colours come from `layertap.overlay`.
"""

from __future__ import annotations

import base64
import html
import io
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ..errors import ArgumentError, require
from ..overlay import Colormap, overlay


class HeatmapGrid:
    """Heatmaps drawn over their images, tiled in a grid that a notebook shows (HTML, or PNG).

    Made by `show`; `image` is the grid as one ``PIL.Image`` and `save` writes it.
    """

    def __init__(self, tiles: list[Any], captions: Sequence[str], columns: int) -> None:
        self.tiles = tiles
        self.captions = list(captions)
        self.columns = min(columns, len(tiles))

    def __len__(self) -> int:
        return len(self.tiles)

    def __repr__(self) -> str:
        return f"<layertap.cam.HeatmapGrid: {len(self)} heatmaps in {self.columns} columns>"

    def image(self) -> Any:
        """The tiles in one RGB ``PIL.Image``, each at the first tile's size, without captions."""
        width, height = self.tiles[0].size
        grid = require("PIL.Image", "vision").new("RGB", (self.columns * width, math.ceil(len(self) / self.columns) * height), "white")
        for i, tile in enumerate(self.tiles):
            grid.paste(tile.resize((width, height)), ((i % self.columns) * width, (i // self.columns) * height))
        return grid

    def save(self, path: str | Path) -> None:
        self.image().save(path)

    def _repr_png_(self) -> bytes:
        return _png(self.image())

    def _repr_html_(self) -> str:
        width = max(self.tiles[0].size[0], 128)  # small inputs (64 px) are drawn larger, pixels kept sharp
        figures = "".join(
            f"<figure style='margin:0'><img width='{width}' style='image-rendering:pixelated' "
            f"src='data:image/png;base64,{base64.b64encode(_png(tile)).decode()}'>"
            f"<figcaption style='font-size:12px;max-width:{width}px'>{html.escape(caption)}</figcaption></figure>"
            for tile, caption in zip(self.tiles, self.captions)
        )
        return f"<div style='display:grid;grid-template-columns:repeat({self.columns}, max-content);gap:6px'>{figures}</div>"


def _png(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _pictures(images: Any) -> list[Any]:
    """Images as `overlay` takes them; a tensor outside ``[0, 1]`` (a normalised input) is
    stretched to it, image by image."""
    if not isinstance(images, torch.Tensor):
        return list(images)
    x = images.detach().float().cpu()
    low = x.flatten(1).amin(1).view(-1, *[1] * (x.dim() - 1))
    high = x.flatten(1).amax(1).view_as(low)
    stretched = (x - low) / (high - low).clamp(min=1e-8)
    return list(torch.where((low < 0) | (high > 1), stretched, x))


def show(
    images: Any,
    maps: Any,
    captions: Sequence[str] | None = None,
    *,
    alpha: float = 0.5,
    colormap: Colormap = "jet",
    columns: int = 8,
) -> HeatmapGrid:
    """Draw the ``maps`` a method returned over their ``images``, as a grid a notebook shows.

    ``images`` is the method's input ``[B, 3, H, W]`` (normalised values are stretched to
    ``[0, 1]`` per image), a uint8 ``[B, H, W, 3]`` array or a list of ``PIL`` images; ``maps``
    is ``[B, H, W]``; ``captions``, one text per image, go under the tiles. The methods keep
    returning plain tensors; this is the view of one.

    >>> import torch, torchvision
    >>> from layertap.cam import GradCAM
    >>> model = torchvision.models.resnet18().eval()
    >>> x = torch.randn(2, 3, 64, 64)
    >>> grid = show(x, GradCAM(model, "layer4")(x), ["a <cat>", "a dog"])
    >>> grid.image().size, "a &lt;cat&gt;" in grid._repr_html_()
    ((128, 64), True)
    """
    pictures, heatmaps = _pictures(images), list(maps)
    captions = [""] * len(pictures) if captions is None else list(captions)
    if not pictures or len(heatmaps) != len(pictures) or len(captions) != len(pictures):
        raise ArgumentError(
            f"show needs one map (and caption) per image: got {len(pictures)} images, {len(heatmaps)} maps, "
            f"{len(captions)} captions"
        )
    tiles = [overlay(p, m, alpha, colormap) for p, m in zip(pictures, heatmaps)]
    return HeatmapGrid(tiles, captions, columns)
