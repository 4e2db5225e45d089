"""The statistics of one tensor, in mergeable pieces: `TensorStats` and `tensor_stats`, which makes it.

`layertap.stats`, `layertap.watch` and `layertap.find_nonfinite` summarise every tapped tensor
with `tensor_stats` inside the hook and keep only the result; `TensorStats.merge` joins the
results of calls, batches and ranks. This module holds the value types and the ways of reading a
tensor, apart from the entry points that tap the layers.

>>> import torch
>>> from layertap.tensorstats import tensor_stats
>>> s = tensor_stats(torch.tensor([[0.0, 1.0], [2.0, 3.0]]))
>>> s.count, float(s.total.mean), float(s.lo), float(s.hi), int(s.zeros)
(4, 1.5, 0.0, 3.0, 1)

How the numbers are made:

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
- Histograms are one-pass and mergeable: bins have a power-of-two width on a grid anchored at 0,
  so the histograms of two batches (or ranks) always line up; when values fall outside the
  ``histogram_bins`` bins, neighbouring bins are paired (the width doubles) until they fit. Counts
  are exact for the final bins, which cover the finite values with at least half of the bins.
  A histogram costs a scaled copy of the map and a count: it is made only on request.
"""

from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

import numpy as np
import torch

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
class TensorStats:
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

    def merge(self, other: TensorStats) -> TensorStats:
        """Both summaries together; per-channel moments are dropped if the channel counts differ."""
        channels = None
        if self.channels is not None and other.channels is not None and self.channels.n.shape == other.channels.n.shape:
            channels = self.channels.merge(other.channels)
        if self.histogram is None or other.histogram is None:
            histogram = self.histogram or other.histogram
        else:
            histogram = self.histogram.merge(other.histogram)
        return TensorStats(
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


def tensor_stats(t: torch.Tensor, bins: int = 0) -> TensorStats | None:
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
        return _masked_stats(t, bins)
    mean, m2, lo, hi, zeros = reading
    channels = Moments(torch.full_like(mean, x.numel() // len(mean)), mean, m2.clamp_(min=0))
    return TensorStats(
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


def _masked_stats(t: torch.Tensor, bins: int) -> TensorStats:
    """`tensor_stats` for a tensor with NaN or Inf (or squares too large to sum): a float64 copy
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
    return TensorStats(
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



__all__ = ["tensor_stats", "TensorStats", "Moments", "Histogram"]
