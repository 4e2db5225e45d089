"""Heatmaps drawn over images: `overlay` for one, `overlay_grid` for a batch.

>>> import torch, layertap
>>> from PIL import Image
>>> picture = layertap.overlay(Image.new("RGB", (64, 48)), torch.rand(6, 8))
>>> picture.size, picture.mode
((64, 48), 'RGB')

With ``transform=`` (the model's preprocessing) the map is drawn on the original image, where
the model saw it, at the image's own resolution.

Colormaps come from matplotlib when it is installed (any of its names); without it, ``"jet"``
is built in (`JET`, matplotlib's definition), and any ``[N, 3]`` array works as a colormap.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .errors import ArgumentError, require
from .images import to_original

Colormap = str | np.ndarray
#: How bright the parts of an image the model did not see are drawn (a NaN in the map).
UNSEEN_SHADE = 0.4


def _jet(levels: int = 256) -> np.ndarray:
    """matplotlib's ``jet`` (its segment data), sampled at ``levels`` points, as uint8 RGB."""
    segments = {  # (x, value) pairs per channel, from matplotlib._cm._jet_data
        "red": ((0.0, 0), (0.35, 0), (0.66, 1), (0.89, 1), (1.0, 0.5)),
        "green": ((0.0, 0), (0.125, 0), (0.375, 1), (0.64, 1), (0.91, 0), (1.0, 0)),
        "blue": ((0.0, 0.5), (0.11, 1), (0.34, 1), (0.65, 0), (1.0, 0)),
    }
    x = np.linspace(0.0, 1.0, levels)
    channels = [np.interp(x, [p for p, _ in segments[c]], [v for _, v in segments[c]]) for c in ("red", "green", "blue")]
    return (np.stack(channels, 1) * 255).astype(np.uint8)


#: The built-in ``jet`` colormap: 256 RGB rows, uint8.
JET: np.ndarray = _jet()


def _lut(colormap: Colormap) -> np.ndarray:
    if isinstance(colormap, np.ndarray):
        if colormap.ndim != 2 or colormap.shape[1] != 3:
            raise ArgumentError(f"a colormap array must be [N, 3] RGB rows, got shape {list(colormap.shape)}")
        return colormap.astype(np.uint8) if colormap.dtype == np.uint8 else (np.clip(colormap, 0, 1) * 255).astype(np.uint8)
    try:
        import matplotlib
    except ImportError:
        if colormap == "jet":
            return JET
        raise ArgumentError(
            f"colormap {colormap!r} needs matplotlib (pip install matplotlib); without it only 'jet' is built in"
        ) from None
    try:
        cmap = matplotlib.colormaps[colormap]
    except KeyError:
        raise ArgumentError(f"unknown colormap {colormap!r}; see matplotlib.colormaps for the names") from None
    return cmap(np.linspace(0.0, 1.0, cmap.N), bytes=True)[:, :3]


def colorize(heatmap: Any, colormap: Colormap = "jet") -> np.ndarray:
    """A ``[H, W]`` map with values in ``[0, 1]`` as a ``[H, W, 3]`` uint8 RGB array.

    Values are clipped to ``[0, 1]``; NaN is drawn as 0.
    """
    values = _as_map(heatmap)
    lut = _lut(colormap)
    index = np.clip(np.nan_to_num(values) * len(lut), 0, len(lut) - 1).astype(np.intp)
    return lut[index]


def _as_map(heatmap: Any) -> np.ndarray:
    values = heatmap.detach().float().cpu().numpy() if isinstance(heatmap, torch.Tensor) else np.asarray(heatmap, dtype=np.float32)
    while values.ndim > 2 and values.shape[0] == 1:  # [1, H, W] (one map of a batch)
        values = values[0]
    if values.ndim != 2:
        raise ArgumentError(f"a heatmap must be 2-D [H, W], got shape {list(np.shape(heatmap))}")
    return values


def _as_image(image: Any):
    """A ``PIL.Image``, a ``[3, H, W]`` tensor in [0, 1] or an ``[H, W, 3]`` array, as RGB PIL."""
    pil = require("PIL.Image", "vision")
    if isinstance(image, pil.Image):
        return image.convert("RGB")
    if isinstance(image, torch.Tensor):
        if image.dim() != 3 or image.shape[0] not in (1, 3):
            raise ArgumentError(f"an image tensor must be [3, H, W] (or [1, H, W]) in [0, 1], got {list(image.shape)}")
        image = image.detach().float().cpu().expand(3, -1, -1).permute(1, 2, 0).numpy()
    array = np.asarray(image)
    if array.ndim == 2:
        array = np.repeat(array[..., None], 3, axis=2)
    if array.ndim != 3 or array.shape[2] != 3:
        raise ArgumentError(f"an image array must be [H, W, 3], got shape {list(array.shape)}")
    if array.dtype != np.uint8:  # floats in [0, 1]
        array = (np.clip(array, 0, 1) * 255).round().astype(np.uint8)
    return pil.fromarray(array, "RGB")


def overlay(image: Any, heatmap: Any, alpha: float = 0.5, colormap: Colormap = "jet", *, transform: Any = None):
    """Blend the colorized ``heatmap`` over ``image``: ``(1 - alpha) * image + alpha * color``.

    ``image`` is a ``PIL.Image``, a ``[3, H, W]`` tensor in [0, 1] or an ``[H, W, 3]`` array;
    ``heatmap`` (tensor or array, values in [0, 1]) is resized bilinearly to the image's size.
    With ``transform``, the model's preprocessing, ``image`` is the original picture and the map,
    over the model's input, is laid back where the model saw it (`layertap.images.to_original`),
    at the image's own resolution. Where the map is NaN (outside the model's centre crop) the
    image is dimmed, not coloured. Returns an RGB ``PIL.Image``.

    >>> import numpy as np
    >>> from PIL import Image
    >>> from layertap.modelinfo import ImageTransform
    >>> overlay(Image.new("RGB", (300, 180)), np.ones((32, 32)), transform=ImageTransform((3, 32, 32))).size
    (300, 180)
    """
    if not 0 <= alpha <= 1:
        raise ArgumentError(f"alpha must be in [0, 1], got {alpha}")
    pil = require("PIL.Image", "vision")
    base = _as_image(image)
    if transform is not None:
        values = to_original(heatmap, base, transform)
    else:
        values = _as_map(heatmap)
        if values.shape != (base.height, base.width):
            values = np.asarray(pil.fromarray(values.astype(np.float32), "F").resize(base.size, pil.BILINEAR))
    color = colorize(values, colormap).astype(np.float32)
    pixels = np.asarray(base, dtype=np.float32)
    blended = (1 - alpha) * pixels + alpha * color
    unseen = np.isnan(values)
    blended[unseen] = UNSEEN_SHADE * pixels[unseen]
    return pil.fromarray(np.clip(blended, 0, 255).round().astype(np.uint8), "RGB")


def overlay_grid(
    images: Any,
    heatmaps: Any,
    alpha: float = 0.5,
    colormap: Colormap = "jet",
    *,
    columns: int | None = None,
    path: str | Path | None = None,
):
    """Overlays of a batch tiled in a grid (each tile at the first image's size), saved to ``path``.

    ``images`` is a sequence of images (as for `overlay`) or a ``[B, 3, H, W]`` tensor in [0, 1];
    ``heatmaps`` a ``[B, H, W]`` tensor or a sequence of maps. ``columns`` defaults to
    ``ceil(sqrt(B))``.

    >>> import torch
    >>> overlay_grid(torch.rand(5, 3, 16, 16), torch.rand(5, 16, 16)).size
    (48, 32)
    """
    pil = require("PIL.Image", "vision")
    images, heatmaps = list(images), list(heatmaps)
    if len(images) != len(heatmaps) or not images:
        raise ArgumentError(f"overlay_grid needs one heatmap per image: got {len(images)} images, {len(heatmaps)} heatmaps")
    tiles = [overlay(i, h, alpha, colormap) for i, h in zip(images, heatmaps)]
    width, height = tiles[0].size
    columns = columns or math.ceil(math.sqrt(len(tiles)))
    rows = math.ceil(len(tiles) / columns)
    grid = pil.new("RGB", (columns * width, rows * height))
    for i, tile in enumerate(tiles):
        grid.paste(tile.resize((width, height)) if tile.size != (width, height) else tile, ((i % columns) * width, (i // columns) * height))
    if path is not None:
        grid.save(path)
    return grid


__all__ = ["JET", "colorize", "overlay", "overlay_grid"]
