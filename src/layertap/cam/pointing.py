"""The pointing game: does a heatmap's maximum fall inside the object it should explain?

Every generated shapes image comes with the true bounding box of its shape, so the quality of
a class-activation method is measurable: the share of images whose heatmap peaks inside the
true box (Zhang et al. 2016, "Top-down neural attention by excitation backprop", without their
tolerance margin).

>>> from layertap.cam.pointing import pointing_scores
>>> scores = pointing_scores(64, methods=["gradcam"])       # doctest: +SKIP
>>> scores["gradcam"] >= 0.9                                 # doctest: +SKIP
True

``python -m layertap.cam.pointing [N]`` prints the score of every method on N fresh images.
"""

from __future__ import annotations

import sys
from collections.abc import Iterable
from typing import Any

import numpy as np
import torch
from torch import nn

from ..errors import ArgumentError
from ..shapes.data import generate, preprocess
from ..shapes.model import load_shapes_model
from .methods import METHODS

__all__ = ["EVAL_SEED", "peaks", "pointing_game", "pointing_hits", "pointing_scores"]

#: Seed of the images `pointing_scores` draws by default: none of the training seeds.
EVAL_SEED = 777


def _as_numpy(x: Any) -> np.ndarray:
    return x.detach().float().cpu().numpy() if isinstance(x, torch.Tensor) else np.asarray(x)


def peaks(maps: Any) -> np.ndarray:
    """The ``(x, y)`` pixel of each map's maximum (the first in row-major order on ties), ``[N, 2]``.

    >>> m = np.zeros((1, 4, 5)); m[0, 3, 1] = 1
    >>> peaks(m).tolist()
    [[1, 3]]
    """
    m = _as_numpy(maps)
    if m.ndim != 3:
        raise ArgumentError(f"maps must be [N, H, W], got shape {list(m.shape)}")
    y, x = np.unravel_index(np.nan_to_num(m, nan=-np.inf).reshape(len(m), -1).argmax(1), m.shape[1:])
    return np.stack([x, y], 1)


def pointing_hits(maps: Any, boxes: Any) -> np.ndarray:
    """Whether each map's maximum lies inside its box, as a bool array ``[N]``.

    Boxes are ``(x0, y0, x1, y1)`` in the maps' pixels, ``x1``/``y1`` exclusive (as
    `layertap.shapes.generate` gives them). A flat map (blank: no maximum) is a miss.
    """
    m = _as_numpy(maps)
    b = _as_numpy(boxes).astype(np.int64)
    if m.ndim != 3 or b.shape != (len(m), 4):
        raise ArgumentError(
            f"need maps [N, H, W] and boxes [N, 4] for the same N, got {list(m.shape)} and {list(b.shape)}"
        )
    x, y = peaks(m).T
    flat = m.reshape(len(m), -1)
    blank = ~(np.nanmax(flat, 1) > np.nanmin(flat, 1)) if m.size else np.zeros(len(m), bool)
    inside = (b[:, 0] <= x) & (x < b[:, 2]) & (b[:, 1] <= y) & (y < b[:, 3])
    return inside & ~blank


def pointing_game(maps: Any, boxes: Any) -> float:
    """The share of ``maps`` (``[N, H, W]``) whose maximum falls inside its box (``[N, 4]``).

    >>> maps = np.zeros((2, 8, 8)); maps[0, 2, 2] = maps[1, 7, 7] = 1
    >>> pointing_game(maps, [[0, 0, 4, 4], [0, 0, 4, 4]])
    0.5
    """
    hits = pointing_hits(maps, boxes)
    if not len(hits):
        raise ArgumentError("the pointing game needs at least one map")
    return float(hits.mean())


def pointing_scores(
    n: int = 200,
    *,
    seed: int = EVAL_SEED,
    methods: Iterable[str] | None = None,
    model: nn.Module | None = None,
    layer: str | None = "features.block4",
    batch_size: int = 50,
) -> dict[str, float]:
    """The pointing game of each CAM method on ``n`` freshly generated shapes images.

    Each method explains the true class of every image (as in the pointing game's definition)
    at ``layer`` of ``model`` (default: the bundled model and its last conv block).

    Args:
        methods: names from `layertap.cam.METHODS` (default: all of them).
        batch_size: images per heatmap call.

    Returns:
        ``{method: share of hits}``, in the order of ``methods``.
    """
    names = list(METHODS if methods is None else methods)
    unknown = [m for m in names if m not in METHODS]
    if unknown:
        raise ArgumentError(f"unknown CAM methods {unknown}; choose from {list(METHODS)}")
    model = load_shapes_model() if model is None else model
    batch = generate(n, seed=seed)
    scores = {}
    for name in names:
        explainer = METHODS[name](model, layer)
        hits = [
            pointing_hits(
                explainer(preprocess(batch.images[i : i + batch_size]), batch.labels[i : i + batch_size].tolist()),
                batch.boxes[i : i + batch_size],
            )
            for i in range(0, n, batch_size)
        ]
        scores[name] = float(np.concatenate(hits).mean())
    return scores


def main(argv: list[str] | None = None) -> None:
    """Print the pointing game of every CAM method: ``python -m layertap.cam.pointing [N]``."""
    args = sys.argv[1:] if argv is None else argv
    n = int(args[0]) if args else 200
    for name, score in pointing_scores(n).items():
        print(f"{name:10s} {100 * score:5.1f}%  ({n} images)")


if __name__ == "__main__":
    main()
