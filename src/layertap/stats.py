"""Streaming activation statistics per layer over a whole dataset: one pass, constant memory.

>>> import torch, layertap
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 2))
>>> data = [torch.randn(32, 8) for _ in range(4)]
>>> table = layertap.stats(model, data)
>>> list(table), table["1"].count
(['0', '1', '2'], 2048)
>>> table["1"].min
0.0

How the numbers are made:

- Each tapped tensor is summarised inside the hook, as soon as the layer has run (before an
  in-place op can change it), and only the summary is kept: the tap hands it over through
  ``observe=`` and neither stores nor copies it, so memory does not grow with the data.
- The summary is a `layertap.tensorstats.TensorStats`: how one tensor is read (once, by
  layertap's C kernel on the CPU), how summaries merge across calls, batches and ``torchrun``
  ranks (Chan's pairwise update, in float64), what counts as a channel and a dead one, and how
  the mergeable histograms are binned, is written there.
- A layer's statistics are those of its output, or of the first floating-point tensor of a nested
  output (the hidden states of a layer returning a tuple).
- A module called several times per forward (a ReLU reused inside a ResNet block) gets one row
  per call position, ``"layer1.0.relu#0"``, ``"#1"``, ...: each is a different activation.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import numpy as np
import torch
from torch import nn

from . import nested
from .data import open_data
from .distributed import Processes, tensor_parallel_ranks
from .errors import LayerNotFoundError
from .modelinfo import model_info
from .progress import progress_bar
from .runtime import place_model, run_model, running
from .select import Layers, Selection, leaf_layers, owner, selection, split_op
from .tables import Table, number, sparkline
from .tap import tap
from .tensorstats import Histogram, Moments, TensorStats, tensor_stats


def _first_stats(value: Any, bins: int = 0) -> TensorStats | None:
    """The statistics of the first non-empty real floating-point tensor in ``value`` (a layer's
    nested output), or ``None`` when it holds none."""
    for t in nested.tensors(value):
        summary = tensor_stats(t, bins) if t.is_floating_point() else None
        if summary is not None:
            return summary
    return None


# ---------------------------------------------------------------------------- results
def _item(t: torch.Tensor) -> float:
    return float(t.item())


@dataclasses.dataclass(frozen=True)
class LayerStats:
    """The statistics of one layer (call position) over every value it produced.

    ``mean``, ``std``, ``min`` and ``max`` are over the finite values (NaN when there are none);
    fractions are of all values. ``channel_mean`` and ``channel_std`` are filled with
    ``per_channel=True``; ``histogram`` is ``(counts, edges)`` with ``histogram_bins > 0``.
    """

    name: str  # the table key: the layer name, with "#call" for a layer run several times
    layer: str
    call: int
    module_type: str
    shape: tuple[int, ...]
    count: int
    mean: float
    std: float
    min: float
    max: float
    zero_fraction: float
    nan_fraction: float
    inf_fraction: float
    channels: int | None  # None when calls disagreed on the channel count
    dead_channels: tuple[int, ...]
    channel_mean: np.ndarray | None = dataclasses.field(default=None, repr=False)
    channel_std: np.ndarray | None = dataclasses.field(default=None, repr=False)
    histogram: tuple[np.ndarray, np.ndarray] | None = dataclasses.field(default=None, repr=False)

    @property
    def nonfinite_fraction(self) -> float:
        return self.nan_fraction + self.inf_fraction

    @property
    def absmax(self) -> float:
        """The largest finite magnitude (NaN when there are no finite values)."""
        return max(abs(self.min), abs(self.max))

    @classmethod
    def from_summary(
        cls, summary: TensorStats, *, name: str, layer: str, call: int, module_type: str, per_channel: bool = False
    ) -> LayerStats:
        s = nested.map_leaves(lambda t: t.cpu(), summary)
        n = _item(s.total.n)
        channels = s.channels
        per = per_channel and channels is not None
        return cls(
            name=name,
            layer=layer,
            call=call,
            module_type=module_type,
            shape=s.shape,
            count=s.count,
            mean=_item(s.total.mean) if n else math.nan,
            std=math.sqrt(_item(s.total.m2) / n) if n else math.nan,
            min=_item(s.lo) if n else math.nan,
            max=_item(s.hi) if n else math.nan,
            zero_fraction=_item(s.zeros) / s.count,
            nan_fraction=s.nan / s.count,
            inf_fraction=s.inf / s.count,
            channels=None if channels is None else len(channels.n),
            dead_channels=() if channels is None else tuple(torch.nonzero(s.dead()).flatten().tolist()),
            channel_mean=torch.where(channels.n > 0, channels.mean, math.nan).numpy() if per else None,  # NaN: no finite value
            channel_std=(channels.m2 / channels.n).sqrt().numpy() if per else None,
            histogram=s.histogram.arrays() if s.histogram is not None else None,
        )

    def to_dict(self) -> dict[str, Any]:
        """Plain JSON-ready values; undefined numbers (no finite values) are ``None``."""
        out: dict[str, Any] = {
            "layer": self.layer,
            "call": self.call,
            "type": self.module_type,
            "shape": list(self.shape),
            "count": self.count,
            **{k: _number(getattr(self, k)) for k in ("mean", "std", "min", "max")},
            "zero_fraction": self.zero_fraction,
            "nan_fraction": self.nan_fraction,
            "inf_fraction": self.inf_fraction,
            "channels": self.channels,
            "dead_channels": list(self.dead_channels),
        }
        if self.channel_mean is not None:
            assert self.channel_std is not None  # from_summary fills both or neither
            out["channel_mean"] = [_number(v) for v in self.channel_mean.tolist()]
            out["channel_std"] = [_number(v) for v in self.channel_std.tolist()]
        if self.histogram is not None:
            counts, edges = self.histogram
            out["histogram"] = {"counts": counts.tolist(), "edges": edges.tolist()}
        return out


def _number(v: float) -> float | None:
    return v if math.isfinite(v) else None


def _spread(values: np.ndarray | None) -> str:
    """``lo..hi`` of per-channel values (``-`` without them)."""
    if values is None or not np.isfinite(values).any():
        return "-"
    return f"{number(float(np.nanmin(values)))}..{number(float(np.nanmax(values)))}"


def _percent(v: float) -> str:
    return f"{100 * v:.3g}%" if v else "0"


_NUMERIC = {"mean", "std", "min", "max", "zeros", "non-finite", "dead", "channel means", "channel stds"}  # right-aligned


class StatsTable(Mapping[str, LayerStats]):
    """The statistics of every tapped layer, in execution order; a mapping ``name -> LayerStats``.

    ``print(table)`` shows a table, a notebook its HTML (`to_html`, with a histogram sparkline
    per row when they were computed); `to_json` / `to_dict` give the numbers. A layer *explodes*
    when it has non-finite values or a finite magnitude above ``explode_threshold``.
    """

    def __init__(self, rows: Mapping[str, LayerStats], *, missing: list[str], explode_threshold: float) -> None:
        self.rows = dict(rows)
        self.missing = missing  # tapped layers that never ran or output no floating-point tensor
        self.explode_threshold = explode_threshold

    def __getitem__(self, name: str) -> LayerStats:
        if name in self.rows:
            return self.rows[name]
        calls = [k for k in self.rows if k.startswith(f"{name}#")]
        hint = f"it runs several times per forward: use one of {calls}" if calls else f"rows: {list(self.rows)[:10]}"
        raise LayerNotFoundError(f"no statistics row {name!r}; {hint}")

    def __iter__(self) -> Iterator[str]:
        return iter(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    def dead_units(self) -> dict[str, list[int]]:
        """``{row: [dead channel indices]}`` for the rows that have dead channels."""
        return {k: list(r.dead_channels) for k, r in self.rows.items() if r.dead_channels}

    def is_exploding(self, row: LayerStats) -> bool:
        return row.nonfinite_fraction > 0 or row.absmax > self.explode_threshold

    def exploding(self) -> list[str]:
        """The rows with non-finite values or a finite magnitude above ``explode_threshold``."""
        return [k for k, r in self.rows.items() if self.is_exploding(r)]

    def to_dict(self) -> dict[str, Any]:
        return {
            "note": "mean, std, min and max are over finite values; std is the population std (ddof=0)",
            "explode_threshold": self.explode_threshold,
            "layers": {k: {**r.to_dict(), "exploding": self.is_exploding(r)} for k, r in self.rows.items()},
            "dead_units": self.dead_units(),
            "exploding": self.exploding(),
            "missing": self.missing,
        }

    def to_json(self, indent: int | None = 2) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    def flags(self, row: LayerStats) -> list[str]:
        """What is wrong with ``row``: ``NON-FINITE``, ``EXPLODING``, ``DEAD`` (none: fine)."""
        return [
            f
            for f, on in (
                ("NON-FINITE", row.nonfinite_fraction > 0),
                ("EXPLODING", self.is_exploding(row)),
                ("DEAD", bool(row.dead_channels)),
            )
            if on
        ]

    def _table(self, histograms: bool) -> Table:
        """The rows as a `Table`; ``histograms`` adds a sparkline column (HTML only)."""
        per_channel = any(r.channel_mean is not None for r in self.rows.values())
        histograms = histograms and any(r.histogram is not None for r in self.rows.values())
        head = ["layer", "type", "shape", "mean", "std", "min", "max", "zeros", "non-finite", "dead"]
        head += ["channel means", "channel stds"] if per_channel else []
        head += ["histogram"] if histograms else []
        lines = []
        for key, r in self.rows.items():
            line = [
                key,
                r.module_type,
                "x".join(map(str, r.shape)),
                *(number(v) for v in (r.mean, r.std, r.min, r.max)),
                _percent(r.zero_fraction),
                _percent(r.nonfinite_fraction),
                f"{len(r.dead_channels)}/{r.channels}" if r.channels is not None else "?",
            ]
            if per_channel:
                line += [_spread(r.channel_mean), _spread(r.channel_std)]
            if histograms:
                line.append(sparkline(*r.histogram) if r.histogram is not None else "-")
            lines.append([*line, " ".join(self.flags(r))])
        notes = ["mean, std, min and max are over finite values (non-finite values are counted apart)."]
        if self.missing:
            notes.append(
                f"{len(self.missing)} tapped layers have no statistics (they never ran, or output no floating-point "
                f"tensor): {', '.join(self.missing[:10])}{' ...' if len(self.missing) > 10 else ''}"
            )
        flagged = {i for i, r in enumerate(self.rows.values()) if self.flags(r)}
        return Table([*head, "flags"], lines, numeric=_NUMERIC, notes=notes, flagged=flagged)

    def __str__(self) -> str:
        return self._table(histograms=False).text()

    def to_html(self) -> str:
        """The table as escaped HTML, with a histogram sparkline per row when they were computed;
        flagged rows are shaded."""
        return self._table(histograms=True).html()

    _repr_html_ = to_html

    def __repr__(self) -> str:
        flagged = f"{len(self.exploding())} exploding, {len(self.dead_units())} with dead units"
        return f"<layertap.StatsTable: {len(self.rows)} rows, {flagged}>"


# ---------------------------------------------------------------------------- the entry point
def _merge(summaries: dict[Any, TensorStats], key: Any, summary: TensorStats) -> None:
    summaries[key] = summaries[key].merge(summary) if key in summaries else summary


def merge_ranks(summaries: dict[Any, TensorStats], model: nn.Module | None = None) -> dict[Any, TensorStats]:
    """Every rank's summaries merged, on every rank, when torch.distributed runs several ranks
    (a few numbers per layer travel). The ranks of a tensor-parallel group of ``model`` saw the
    same values (`layertap.tap.sharded`): only the group's first counts them."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return summaries
    group = tensor_parallel_ranks(model) if model is not None else None
    if group is not None and dist.get_rank() != group[0]:
        summaries = {}
    local = {key: nested.map_leaves(lambda t: t.cpu(), s) for key, s in summaries.items()}
    gathered = Processes(dist.get_rank(), dist.get_world_size()).gather(local)  # a few numbers per layer
    merged: dict[Any, TensorStats] = {}
    for part in gathered:
        for key, summary in part.items():
            _merge(merged, key, summary)
    return merged


def stats(
    model: nn.Module,
    data: Any,
    layers: Layers | None = None,
    *,
    per_channel: bool = False,
    histogram_bins: int = 0,
    batch_size: int = 64,
    device: torch.device | str | None = None,
    transform: Callable[[Any], torch.Tensor] | None = None,
    num_workers: int | None = None,
    explode_threshold: float = 1e4,
    progress: bool = True,
) -> StatsTable:
    """Statistics of the outputs of ``layers`` over all of ``data``, in one pass and constant memory.

    Args:
        data: anything `layertap.data.iter_batches` takes: a Dataset, a DataLoader, an iterable
            of batches, an image folder or file, a ``.npy`` array.
        layers: a layer spec (see `layertap.select`); ``None`` (the default) taps every leaf
            module, i.e. every module without submodules. (The glob ``"*"`` matches one
            name segment only: the model's direct children.)
        per_channel: also report the mean and std of each channel. (Per-channel moments are
            accumulated anyway, at no extra pass: dead units need them.)
        histogram_bins: ``>= 2`` adds a histogram of at most this many power-of-two-wide bins
            (see the module docs).
        batch_size, num_workers, transform: how ``data`` is read (see `iter_batches`; a
            DataLoader keeps its own); image files default to the model's preprocessing
            (`layertap.model_info`).
        device: where to run; the model is moved there. Default: where its weights are.
        explode_threshold: a finite magnitude above which a layer is flagged as exploding.
        progress: show a progress bar over the samples, in a terminal or a notebook (see
            `layertap.progress`).

    The model runs as it is (call ``model.eval()`` first for inference statistics), without
    autograd. Under ``torchrun`` every rank calls `stats` on its own part of the data; the
    ranks' summaries are gathered and merged, and every rank returns the same table.

    >>> import torch, torchvision, layertap
    >>> model = torchvision.models.resnet18().eval()
    >>> images = torch.utils.data.TensorDataset(torch.randn(8, 3, 64, 64))
    >>> table = layertap.stats(model, images, ["layer1", "layer4"], batch_size=4)
    >>> table["layer4"].count, table["layer4"].min >= 0
    (16384, True)
    """
    if histogram_bins and histogram_bins < 2:
        raise ValueError(f"histogram_bins={histogram_bins}: use 0 (no histogram) or 2 or more bins")
    chosen = selection(model, layers if layers is not None else leaf_layers(model))
    device = place_model(model, device)
    summaries: dict[tuple[str, int], TensorStats] = {}

    def observe(layer: str, kind: str, call: int, value: Any) -> None:
        # summarised at once: the value is the network's own tensor, valid only during the hook
        summary = _first_stats(value, histogram_bins)
        if summary is not None:
            _merge(summaries, (layer, call), summary)

    transform = transform or model_info(model).transform
    source = open_data(data, batch_size=batch_size, transform=transform, num_workers=num_workers)
    bar = progress_bar(source.num_samples, desc="stats", unit="sample", enabled=progress)
    with bar, running(model), tap(model, chosen, observe=observe) as taps:
        for batch in source.batches():
            run_model(model, nested.map_leaves(lambda t: t.to(device), batch.inputs))
            taps.clear()  # `call` restarts: a row is a call position within one forward
            bar.update(len(batch))
    summaries = merge_ranks(summaries, model)
    repeated = {layer for layer, call in summaries if call > 0}
    modules = chosen.layers
    rows = {}
    for (layer, call), summary in summaries.items():
        name = f"{layer}#{call}" if layer in repeated else layer
        rows[name] = LayerStats.from_summary(
            summary,
            name=name,
            layer=layer,
            call=call,
            module_type=type(modules[owner(layer)]).__name__,
            per_channel=per_channel,
        )
    return StatsTable(rows, missing=_missing(chosen, {layer for layer, _ in summaries}), explode_threshold=explode_threshold)


def _missing(chosen: Selection, seen: set[str]) -> list[str]:
    """The selected names that gave no statistics. A ``"MODULE:*"`` has no row of its own: its
    ops get rows under the names they ran as, so it is missing only if none of them ran."""
    ran_ops = {op.module for op in map(split_op, seen) if op is not None}
    every_op = {name for name, op in chosen.ops.items() if op.op == "*" and op.module in ran_ops}
    return [name for name in chosen if name not in seen and name not in every_op]


__all__ = [
    "stats",
    "StatsTable",
    "LayerStats",
    "tensor_stats",
    "merge_ranks",
    "TensorStats",
    "Moments",
    "Histogram",
]
