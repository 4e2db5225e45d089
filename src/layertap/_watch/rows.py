"""One row of the watch: the statistics of a layer and kind at a sampled step, and its columns.

What the sinks write and the alerts judge, so both import it from here; `WatchWarning` is the one
warning class of the watch (its alerts, and the sinks' failures).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from ..stats import LayerStats


class WatchWarning(UserWarning):
    """An alert of `watch`: a non-finite value, dead units, or a layer whose scale explodes."""


STATS = ("mean", "std", "min", "max", "zero_fraction", "nan_fraction", "inf_fraction", "dead_fraction")
COLUMNS = ("step", "name", "layer", "call", "kind", "type", "count", *STATS[:-1], "channels", "dead_channels", "dead_fraction")


@dataclasses.dataclass(frozen=True)
class Record:
    """The statistics of one layer (call position) and kind (``"output"`` or ``"grad"``) at one step."""

    step: int
    kind: str
    stats: LayerStats

    @property
    def name(self) -> str:
        """The row name: the layer, with ``#call`` for a module called several times per forward."""
        return self.stats.name

    @property
    def dead_fraction(self) -> float:
        """The fraction of channels that were exactly zero everywhere (NaN when unknown)."""
        channels = self.stats.channels
        return len(self.stats.dead_channels) / channels if channels else math.nan

    def row(self) -> dict[str, Any]:
        """One flat row, the columns of `COLUMNS` (a CSV or Parquet row)."""
        s = self.stats
        return {
            "step": self.step, "name": s.name, "layer": s.layer, "call": s.call, "kind": self.kind,
            "type": s.module_type, "count": s.count, "mean": s.mean, "std": s.std, "min": s.min, "max": s.max,
            "zero_fraction": s.zero_fraction, "nan_fraction": s.nan_fraction, "inf_fraction": s.inf_fraction,
            "channels": s.channels, "dead_channels": len(s.dead_channels), "dead_fraction": self.dead_fraction,
        }  # fmt: skip

    def value(self, stat: str) -> float:
        """One of `STATS`."""
        return self.dead_fraction if stat == "dead_fraction" else float(getattr(self.stats, stat))


__all__ = ["Record", "WatchWarning", "STATS", "COLUMNS"]
