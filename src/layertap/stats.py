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
- The cost is memory traffic, not arithmetic. On the CPU, a map is read from memory once, by
  layertap's C kernel (``_moments.c``, built with the package): block by block in the L1 cache,
  one pass for min, max, zeros and a rough mean, a second over the cached block for the centred
  sums, merged in float64 (Chan). It runs on PyTorch's own threads. Sums are float64, except on
  x86 vector units (AVX2, AVX-512), where float32 lanes hold a few centred values each before
  they join float64 sums. Elsewhere (a GPU, or where the package was built without a C
  compiler with OpenMP) PyTorch's kernels read a large ``[N, C, H, W]`` map three times (min
  and max; centred moments per (sample, channel) row from group normalization, whose output is
  discarded; the zeros), and copy token and feature maps (``[..., C]``) to float64 once.
  Against numpy in float64, every way: mean and std within 1e-6 relative, or 1e-8 of the
  largest magnitude for a mean near 0; min, max and counts exact (``tests/test_stats.py``,
  every layout and dtype; ``tests/test_moments.py``). A map holding NaN or Inf takes a masked
  float64 copy (slower, and rare).
- Calls, batches and ``torchrun`` ranks are merged in float64 with the pairwise update of Chan,
  Golub and LeVeque (Welford's for two groups), in any order and without the cancellation of a
  sum-of-squares formula. ``std`` is the population standard deviation (``ddof=0``, like
  ``numpy.std``).
- ``mean``, ``std``, ``min`` and ``max`` are over the *finite* values only; NaN and ±Inf are
  counted apart (``nan_fraction``, ``inf_fraction``) and flag the layer.
- A channel is dim 1 of a tensor with 4 or more dims (``[batch, C, H, W]``) and the last dim of
  ``[batch, tokens, dim]`` and ``[batch, features]``, as for ``reduce="mean"``; a 1-D output is one
  channel. A *dead* channel is exactly zero in every value the dataset produced.
- A layer's statistics are those of its output, or of the first floating-point tensor of a nested
  output (the hidden states of a layer returning a tuple).
- A module called several times per forward (a ReLU reused inside a ResNet block) gets one row
  per call position, ``"layer1.0.relu#0"``, ``"#1"``, ...: each is a different activation.
- Histograms are one-pass and mergeable: bins have a power-of-two width on a grid anchored at 0,
  so the histograms of two batches (or ranks) always line up; when values fall outside the
  ``histogram_bins`` bins, neighbouring bins are paired (the width doubles) until they fit. Counts
  are exact for the final bins, which cover the finite values with at least half of the bins.
  A histogram costs a scaled copy of the map and a count: it is made only on request.
"""

from __future__ import annotations

import dataclasses
import json
import math
from collections.abc import Callable, Iterator, Mapping
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from . import nested
from .data import open_data
from .distributed import Processes
from .errors import LayerNotFoundError
from .loading import model_info
from .progress import progress_bar
from .runtime import explain_failures, place_model, run_model
from .select import Layers, named_layers, owner, select
from .tables import Table, number, sparkline
from .tap import tap

try:  # the one-read kernel, compiled with the package; where it could not be, PyTorch's kernels
    from . import _moments
except ImportError:
    _moments = None  # type: ignore[assignment]


# ---------------------------------------------------------------------------- mergeable pieces
class Moments(NamedTuple):
    """Count, mean and sum of squared deviations from the mean (per channel, or in all)."""

    n: torch.Tensor
    mean: torch.Tensor
    m2: torch.Tensor

    def merge(self, other: Moments) -> Moments:
        """The moments of both groups together (Chan et al.); exact for empty groups too."""
        n = self.n + other.n
        delta = other.mean - self.mean
        share = other.n / n.clamp(min=1)
        return Moments(n, self.mean + delta * share, self.m2 + other.m2 + delta.square() * self.n * share)

    def pooled(self) -> Moments:
        """The moments of all channels as one group."""
        n = self.n.sum()
        mean = (self.n * self.mean).sum() / n.clamp(min=1)
        return Moments(n, mean, self.m2.sum() + (self.n * (self.mean - mean).square()).sum())


def _grid_exponent(lo: float, hi: float, bins: int) -> int:
    """The smallest power-of-two bin width that puts ``[lo, hi]`` in ``bins`` aligned bins."""
    scale = max(abs(lo), abs(hi))
    # no finer than 2**-40 of the values' magnitude, so that bin indices stay exact integers
    exponent = max(math.frexp(scale)[1] - 40 if scale else -40, -960)
    width = hi / bins - lo / bins
    if width > 0:
        exponent = max(exponent, math.ceil(math.log2(width)))
    while math.floor(math.ldexp(hi, -exponent)) - math.floor(math.ldexp(lo, -exponent)) >= bins:
        exponent += 1
    return exponent


@dataclasses.dataclass
class Histogram:
    """Counts in bins ``[(origin + i) * 2**exponent, (origin + i + 1) * 2**exponent)``."""

    exponent: int
    origin: int
    counts: torch.Tensor  # int64, one per bin

    @classmethod
    def of(cls, values: torch.Tensor, lo: float, hi: float, bins: int) -> Histogram:
        """The histogram of ``values`` (finite), whose min and max are ``lo``, ``hi``."""
        exponent = _grid_exponent(lo, hi, bins)
        origin = math.floor(math.ldexp(lo, -exponent))
        # scaling by a power of two is exact, so floor() puts every value in its true bin
        index = (values * math.ldexp(1.0, -exponent)).floor_().long().sub_(origin)
        return cls(exponent, origin, torch.bincount(index, minlength=bins))

    def merge(self, other: Histogram) -> Histogram:
        """Both histograms on the finest common grid that fits their bin count."""
        bins = len(self.counts)
        used = [(h, torch.nonzero(h.counts).flatten()) for h in (self, other)]
        occupied = [(h.origin + int(nz[0]), h.origin + int(nz[-1]), h.exponent) for h, nz in used]

        def span(exponent: int) -> tuple[int, int]:
            """First and last occupied bin at width ``2**exponent`` (>> floors, negatives too)."""
            return min(a >> (exponent - e) for a, _, e in occupied), max(b >> (exponent - e) for _, b, e in occupied)

        exponent = max(self.exponent, other.exponent)
        origin, end = span(exponent)
        while end - origin >= bins:
            exponent += 1
            origin, end = span(exponent)
        counts = torch.zeros_like(self.counts)
        for h, nz in used:
            counts.index_add_(0, ((nz + h.origin) >> (exponent - h.exponent)) - origin, h.counts[nz])
        return Histogram(exponent, origin, counts)

    def arrays(self) -> tuple[np.ndarray, np.ndarray]:
        """``(counts, edges)`` over the occupied bins, as ``numpy.histogram`` returns them."""
        counts = self.counts.cpu().numpy()
        used = np.flatnonzero(counts)
        first, last = used[0], used[-1]
        edges = (self.origin + np.arange(first, last + 2)).astype(np.float64) * math.ldexp(1.0, self.exponent)
        return counts[first : last + 1], edges


@dataclasses.dataclass
class Summary:
    """Mergeable statistics of the values one layer call position produced so far."""

    shape: tuple[int, ...]  # of the first tensor seen
    count: int  # every value, finite or not
    nan: int
    inf: int
    zeros: torch.Tensor  # exact zeros (0-d)
    lo: torch.Tensor  # smallest finite value (+inf when none)
    hi: torch.Tensor
    total: Moments  # of all finite values
    channels: Moments | None  # per channel; None once two calls disagree on the channel count
    histogram: Histogram | None

    def dead(self) -> torch.Tensor | None:
        """Which channels are exactly zero everywhere: all values finite, mean 0 and no spread.

        (Exact: the float64 square of a difference of float32 values is 0 only if they are equal.)
        """
        if self.channels is None:
            return None
        n, mean, m2 = self.channels
        return (n == self.count // len(n)) & (mean == 0) & (m2 == 0)

    def merge(self, other: Summary) -> Summary:
        """Both summaries together; per-channel moments are dropped if the channel counts differ."""
        channels = None
        if self.channels is not None and other.channels is not None and self.channels.n.shape == other.channels.n.shape:
            channels = self.channels.merge(other.channels)
        if self.histogram is None or other.histogram is None:
            histogram = self.histogram or other.histogram
        else:
            histogram = self.histogram.merge(other.histogram)
        return Summary(
            shape=self.shape,
            count=self.count + other.count,
            nan=self.nan + other.nan,
            inf=self.inf + other.inf,
            zeros=self.zeros + other.zeros,
            lo=torch.minimum(self.lo, other.lo),
            hi=torch.maximum(self.hi, other.hi),
            total=self.total.merge(other.total),
            channels=channels,
            histogram=histogram,
        )


def _by_channel(t: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...]]:
    """``t`` and the dims to reduce so that one value per channel remains."""
    if t.dim() >= 4:
        return t, (0, *range(2, t.dim()))
    if t.dim() >= 2:
        return t, tuple(range(t.dim() - 1))
    return t.reshape(-1, 1), (0,)


def _map_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per channel of a contiguous ``[N, C, ...]`` map, in float64: mean and sum of squared
    deviations. Group normalization with a group per channel is one fused kernel that reads each
    (sample, channel) row once and gives its centred mean and variance (its normalized output is
    thrown away); the rows are merged in float64 (Chan)."""
    n, c = x.shape[:2]
    length = x[0, 0].numel()
    _, means, rstd = torch.ops.aten.native_group_norm(x, None, None, n, c, length, c, 0.0)
    means, m2s = means.double().view(n, c), rstd.double().pow_(-2).mul_(length).view(n, c)  # rstd = 1 / sqrt(variance)
    mean = means.mean(dim=0)
    return mean, m2s.sum(dim=0) + (means - mean).square_().sum(dim=0) * length


def _feature_moments(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_map_moments` for ``[..., C]`` (tokens, features: the channel is the last dim), from a
    float64 copy: reducing along the rows of a float32 ``[R, C]`` view is slow and its sums of
    squares cancel, while batch normalization's statistics kernel gives the centred moments of a
    float64 one in a pass (for a handful of channels, which it serves badly, two plain passes)."""
    flat = x.reshape(-1, x.shape[-1]).double()
    if flat.shape[1] >= 8:
        mean, var = torch.batch_norm_update_stats(flat, None, None, 0.0)
        return mean, var * len(flat)
    mean = flat.mean(dim=0)
    return mean, flat.sub_(mean).square_().sum(dim=0)


class _Reading(NamedTuple):
    """What one reading of a map gives: per-channel mean and M2 (float64), min, max, zeros."""

    mean: torch.Tensor
    m2: torch.Tensor
    lo: torch.Tensor
    hi: torch.Tensor
    zeros: torch.Tensor


def _read_once(x: torch.Tensor, kernel: int = 0) -> _Reading | None:
    """`_Reading` of a CPU float32/float64 map from layertap's C kernel (``_moments.c``): one read
    of memory, sums in float64 (on x86 vector units, the squares of centred values are summed in
    float32 a few at a time first). ``None`` when it holds NaN or Inf. ``kernel`` indexes
    ``_moments.KERNELS`` (the CPU's fastest first)."""
    assert _moments is not None
    x = x.contiguous()  # channels-last memory is copied once
    if x.dim() >= 4:  # [N, C, H, W]: the channel's rows are H * W values apart
        outer, c, inner = x.shape[0], x.shape[1], x[0, 0].numel()
    else:  # [..., C]: columns, unless there is one (then it is one long row, read as such)
        c = x.shape[-1]
        outer, inner = (1, x.numel()) if c == 1 else (x.numel() // c, 1)
    out = torch.empty(c, 5, dtype=torch.float64)  # mean, M2, min, max, non-zeros
    # PyTorch's threads (the kernel shares its OpenMP pool), one per 2**15 values at most
    threads = max(1, min(torch.get_num_threads(), x.numel() >> 15))
    status = _moments.moments(x.data_ptr(), outer, c, inner, out.data_ptr(), x.dtype == torch.float64, threads, kernel)
    if status == 0:  # NaN or Inf
        return None
    if status == 2:  # a channel's spread under 2**-50: float32 squares of its deviations lose digits
        return _read_once(x.double())
    return _Reading(out[:, 0], out[:, 1], out[:, 2].min(), out[:, 3].max(), x.numel() - out[:, 4].sum().long())


# group normalization splits even a tiny map among the threads, whose wake-up (milliseconds on a
# busy machine) would then dwarf the work: smaller maps are summed as features
_FUSED = 1 << 18


def _read_eagerly(x: torch.Tensor) -> _Reading | None:
    """`_Reading` from PyTorch's own kernels (any device): three reads of a large ``[N, C, H, W]``
    map, a float64 copy of others. ``None`` when it holds NaN or Inf, or squares beyond its dtype."""
    lo, hi = (v.double() for v in torch.aminmax(x))
    low, high = float(lo), float(hi)
    if not (math.isfinite(low) and math.isfinite(high)):
        return None
    if x.dtype == torch.float32 and max(-low, high) < 2**-50:
        x = x.double()  # the squares would fall below float32's normal numbers, and lose digits
    if x.dim() >= 4 and x.numel() >= _FUSED:
        mean, m2 = _map_moments(x.contiguous())  # channels-last memory is copied once
    else:
        mean, m2 = _feature_moments(x.movedim(1, -1) if x.dim() >= 4 else x)
    if not bool(torch.isfinite(m2).all()):
        return None
    return _Reading(mean, m2, lo, hi, x.numel() - torch.count_nonzero(x.bool()))  # bool first: ten times faster


def summarize(t: torch.Tensor, bins: int = 0) -> Summary | None:
    """The statistics of one real floating-point tensor, on its own device.

    ``None`` for an empty or complex tensor. ``bins > 0`` adds a histogram of the finite values.
    One read of a CPU map, three of a large ``[N, C, H, W]`` map on a GPU (see the module docs).
    """
    if t.numel() == 0 or t.is_complex():
        return None
    x = t.detach()
    if x.dtype not in (torch.float32, torch.float64):
        x = x.float()  # float16 and bfloat16 values are exact in float32
    if x.dim() < 2:
        x = x.reshape(-1, 1)  # one channel
    reading = _read_once(x) if _moments is not None and x.device.type == "cpu" else _read_eagerly(x)
    if reading is None:  # NaN or Inf among the values
        return _summarize_masked(t, bins)
    mean, m2, lo, hi, zeros = reading
    channels = Moments(torch.full_like(mean, x.numel() // len(mean)), mean, m2.clamp_(min=0))
    return Summary(
        shape=tuple(t.shape),
        count=t.numel(),
        nan=0,
        inf=0,
        zeros=zeros,
        lo=lo,
        hi=hi,
        total=channels.pooled(),
        channels=channels,
        histogram=Histogram.of(x.reshape(-1), float(lo), float(hi), bins) if bins else None,
    )


def _summarize_masked(t: torch.Tensor, bins: int) -> Summary:
    """`summarize` for a tensor with NaN or Inf (or squares too large to sum): a float64 copy
    whose non-finite values are masked out, summed twice (sum, then squared deviations)."""
    values, dims = _by_channel(t.detach())
    x = values.to(torch.float64, copy=True)  # our own copy, changed in place below
    ok = torch.isfinite(x)
    n = ok.sum(dim=dims, keepdim=True, dtype=torch.float64)
    lo, hi = torch.where(ok, x, math.inf).amin(), torch.where(ok, x, -math.inf).amax()
    nan = int(torch.isnan(x).sum())
    inf = x.numel() - int(n.sum()) - nan
    finite = x[ok]
    x.masked_fill_(~ok, 0.0)
    mean = x.sum(dim=dims, keepdim=True) / n.clamp(min=1)
    histogram = Histogram.of(finite, float(lo), float(hi), bins) if bins and finite.numel() else None
    x.sub_(mean).masked_fill_(~ok, 0.0)
    channels = Moments(n.flatten(), mean.flatten(), x.square_().sum(dim=dims))
    return Summary(
        shape=tuple(t.shape),
        count=t.numel(),
        nan=nan,
        inf=inf,
        zeros=t.numel() - values.bool().sum(dim=dims).sum(),
        lo=lo,
        hi=hi,
        total=channels.pooled(),
        channels=channels,
        histogram=histogram,
    )


def _first_summary(value: Any, bins: int = 0) -> Summary | None:
    """The statistics of the first non-empty real floating-point tensor in ``value`` (a layer's
    nested output), or ``None`` when it holds none."""
    for t in nested.tensors(value):
        summary = summarize(t, bins) if t.is_floating_point() else None
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
        cls, summary: Summary, *, name: str, layer: str, call: int, module_type: str, per_channel: bool = False
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
def leaf_layers(model: nn.Module) -> list[str]:
    """Every module without submodules (the default layers of `stats`); the model itself if none."""
    leaves = [name for name, m in named_layers(model).items() if name and next(m.children(), None) is None]
    return leaves or [""]


def _merge(summaries: dict[Any, Summary], key: Any, summary: Summary) -> None:
    summaries[key] = summaries[key].merge(summary) if key in summaries else summary


def merge_ranks(summaries: dict[Any, Summary]) -> dict[Any, Summary]:
    """Every rank's summaries merged, on every rank, when torch.distributed runs several ranks
    (a few numbers per layer travel)."""
    dist = torch.distributed
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return summaries
    local = {key: nested.map_leaves(lambda t: t.cpu(), s) for key, s in summaries.items()}
    gathered = Processes(dist.get_rank(), dist.get_world_size()).gather(local)  # a few numbers per layer
    merged: dict[Any, Summary] = {}
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
    names = select(model, layers) if layers is not None else leaf_layers(model)
    device = place_model(model, device)
    summaries: dict[tuple[str, int], Summary] = {}

    def observe(layer: str, kind: str, call: int, value: Any) -> None:
        # summarised at once: the value is the network's own tensor, valid only during the hook
        summary = _first_summary(value, histogram_bins)
        if summary is not None:
            _merge(summaries, (layer, call), summary)

    transform = transform or model_info(model).transform
    source = open_data(data, batch_size=batch_size, transform=transform, num_workers=num_workers)
    bar = progress_bar(source.num_samples, desc="stats", unit="sample", enabled=progress)
    with bar, explain_failures(model), torch.no_grad(), tap(model, names, observe=observe) as taps:
        for batch in source.batches():
            run_model(model, nested.map_leaves(lambda t: t.to(device), batch.inputs))
            taps.clear()  # `call` restarts: a row is a call position within one forward
            bar.update(len(batch))
    summaries = merge_ranks(summaries)
    repeated = {layer for layer, call in summaries if call > 0}
    modules = named_layers(model)
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
    seen = {layer for layer, _ in summaries}
    # "module:*" has no row of its own: its ops get rows under the names they ran as
    missing = [n for n in names if n not in seen and not (n.endswith(":*") and any(s.startswith(n[:-1]) for s in seen))]
    return StatsTable(rows, missing=missing, explode_threshold=explode_threshold)


__all__ = [
    "stats",
    "StatsTable",
    "LayerStats",
    "leaf_layers",
    "summarize",
    "merge_ranks",
    "Summary",
    "Moments",
    "Histogram",
]
