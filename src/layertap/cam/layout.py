"""How an activation maps onto the input: `MapLayout` and the rules of `infer_layout`.

Every heatmap method reads a layer's activation (or its gradient) as ``[B, C, *grid]`` maps,
whatever the layer gives: channels-first maps, channels-last maps (Swin) or token sequences
whose patch grid is inferred from the input size, after their prefix tokens. The rules live
here, apart from the methods, because attention rollout and the default-layer probe read
layouts too.
"""

from __future__ import annotations

import functools
import itertools
import math
import operator
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from ..errors import LayoutError

MAX_PREFIX_TOKENS = 32  # more prefix tokens than this are never guessed: pass prefix_tokens=


@dataclass(frozen=True)
class MapLayout:
    """How an activation maps onto the input: ``kind``, spatial ``grid`` and prefix token count.

    >>> MapLayout("tokens", (14, 14), prefix=1).maps(torch.zeros(2, 197, 768)).shape
    torch.Size([2, 768, 14, 14])
    """

    kind: Literal["channels_first", "channels_last", "tokens"]
    grid: tuple[int, ...]
    prefix: int = 0

    def maps(self, t: torch.Tensor) -> torch.Tensor:
        """The activation (or its gradient) as ``[B, C, *grid]``."""
        if self.kind == "channels_first":
            return t
        if self.kind == "channels_last":
            return t.movedim(-1, 1)
        return t[:, self.prefix :].transpose(1, 2).reshape(t.shape[0], t.shape[-1], *self.grid)

    def prefix_part(self, t: torch.Tensor) -> torch.Tensor:
        """The prefix tokens of a token activation (empty for maps)."""
        return t[:, : self.prefix] if self.kind == "tokens" else t[:, :0]

    def __str__(self) -> str:
        grid = "x".join(map(str, self.grid))
        return f"{self.kind} {grid}" + (f" + {self.prefix} prefix tokens" if self.prefix else "")


def _consistent(grid: Sequence[int], size: Sequence[int]) -> bool:
    """Whether ``grid`` can be a downscaled ``size``: scale factors agree within one cell per dim."""
    if any(g < 1 or g > s for g, s in zip(grid, size)):
        return False
    frac = [g / s for g, s in zip(grid, size)]
    return all(
        abs(frac[i] - frac[j]) <= 1 / size[i] + 1 / size[j] for i, j in itertools.combinations(range(len(size)), 2)
    )


@functools.lru_cache(maxsize=64)
def _patch_grids(size: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every grid a patch embedding with an integer stride could give (floor, or ceil if padded)."""
    grids = {
        tuple(rnd(s, p) for s in size)
        for p in range(1, max(size) + 1)
        for rnd in (operator.floordiv, lambda s, p: -(-s // p))
    }
    return sorted(grids, key=math.prod, reverse=True)


def infer_layout(
    shape: Sequence[int],
    size: Sequence[int],
    *,
    grid: Sequence[int] | None = None,
    prefix_tokens: int | None = None,
) -> MapLayout:
    """Read an activation of ``shape`` (batch first) for an input of spatial ``size`` as a map.

    Channels-first is tried first, then channels-last (both must be a plausible downscaling of
    ``size``), then tokens ``[B, T, D]`` with the largest patch grid that fits in ``T``; the
    remaining leading tokens are prefix tokens (at most `MAX_PREFIX_TOKENS` are guessed).
    ``grid=`` and ``prefix_tokens=`` override the guesses.

    >>> infer_layout([2, 7, 7, 768], [224, 224])          # Swin, channels-last
    MapLayout(kind='channels_last', grid=(7, 7), prefix=0)
    >>> infer_layout([2, 54, 384], [98, 98])               # DINOv2 with 4 registers, patch 14
    MapLayout(kind='tokens', grid=(7, 7), prefix=5)
    """
    size = tuple(size)
    rest = tuple(shape[1:])
    d = len(size)
    if grid is not None:
        return _given_grid(shape, size, tuple(int(g) for g in grid), prefix_tokens)
    if prefix_tokens is None and len(rest) == d + 1:
        if _consistent(rest[1:], size):
            return MapLayout("channels_first", rest[1:])
        if _consistent(rest[:-1], size):
            return MapLayout("channels_last", rest[:-1])
    if len(rest) == 2:
        count = rest[0]
        for g in _patch_grids(size):
            prefix = count - math.prod(g)
            wanted = prefix == prefix_tokens if prefix_tokens is not None else 0 <= prefix <= MAX_PREFIX_TOKENS
            if wanted and prefix < math.prod(g):
                return MapLayout("tokens", g, prefix)
    hint = "grid=(h, w) and, for tokens, prefix_tokens=N" if d == 2 else "grid=..."
    raise LayoutError(
        f"cannot read an activation of shape {list(shape)} as a map of an input of spatial size {list(size)}: "
        f"it is neither [B, C, *grid] nor [B, *grid, C] with a grid that downscales the input, nor "
        f"[B, prefix + h*w, D] tokens with a patch grid (at most {MAX_PREFIX_TOKENS} prefix tokens). "
        f"Pass {hint}, or choose another layer"
    )


def _given_grid(
    shape: Sequence[int], size: tuple[int, ...], grid: tuple[int, ...], prefix_tokens: int | None
) -> MapLayout:
    """`infer_layout` with ``grid=`` given: the layouts that have exactly that grid."""
    rest = tuple(shape[1:])
    d = len(size)
    if len(grid) != d:
        raise LayoutError(f"grid={grid} has {len(grid)} dims but the input has {d} spatial dims {size}")
    if prefix_tokens is None and len(rest) == d + 1:
        if rest[1:] == grid:
            return MapLayout("channels_first", grid)
        if rest[:-1] == grid:
            return MapLayout("channels_last", grid)
    prefix = rest[0] - math.prod(grid) if len(rest) == 2 else -1
    if prefix >= 0 and prefix_tokens in (None, prefix):
        return MapLayout("tokens", grid, prefix)
    raise LayoutError(
        f"grid={grid}{'' if prefix_tokens is None else f' with prefix_tokens={prefix_tokens}'} does not fit "
        f"an activation of shape {list(shape)}: a map needs [B, C, *grid] or [B, *grid, C], tokens "
        f"[B, prefix + {math.prod(grid)}, D]"
    )
