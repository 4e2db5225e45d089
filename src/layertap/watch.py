"""Statistics while a model trains: every N-th step, per layer, of its output and its gradient.

>>> import torch
>>> from layertap.watch import watch
>>> model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 1))
>>> opt = torch.optim.SGD(model.parameters(), lr=0.01)
>>> rows = []
>>> with watch(model, every=2, sinks=[lambda step, records: rows.extend(records)]) as w:
...     for _ in range(4):
...         opt.zero_grad()
...         model(torch.randn(32, 8)).pow(2).mean().backward()
...         opt.step()
...         w.step()
>>> sorted({r.step for r in rows}), [(r.name, r.kind) for r in rows[:2]]
([0, 2], [('0', 'output'), ('0', 'grad')])
>>> rows[0].stats.count
512

The problem: a monitor that hooks every layer slows every step, yet the statistics of one step
in a hundred tell nearly all there is to know. The rule:

- Between sampled steps the model has no hook at all; `Watch.step` (or the optimizer's own
  post-step hook, with ``optimizer=``) only counts. When the step about to start is sampled,
  one forward pre-hook goes on ``model`` itself. Its first call with autograd on enters a
  `layertap.tap` of the chosen layers with ``capture=("output", "grad")`` and ``observe=``:
  each output is summarised inside its hook (before an in-place op changes it), each gradient
  as the backward reaches it, and only the summaries are kept. (So train by calling ``model``:
  a step that only calls its submodules or methods is not seen; `LightningWatch` starts the tap
  at each training batch instead.)
- A call of the model under ``torch.no_grad()`` inside a sampled step (an evaluation) takes the
  tap off again: evaluation outputs are not training statistics, and gradients cannot be hooked
  there. Wrap an evaluation with autograd on in `Watch.paused`.
- The sampled step ends at the next `Watch.step` (or on exit), after its backward: the tap and
  the pre-hook are removed, the summaries merged (over ``torchrun`` ranks, whose steps must go
  in lockstep, as DDP's do) and handed to the sinks and the alerts.

The numbers are `layertap.stats`'s: the same `layertap.stats.summarize` (one read of a CPU
map, no copy), merged in float64 by the same Chan updates, so count, mean, std (``ddof=0``),
min and max over finite values, the fractions of zeros, NaN and Inf, and dead channels (exactly
0 in the whole step). Every forward of a sampled step counts (micro-batches of gradient accumulation
merge), and a module called several times per forward gets one row per call position
(``"layer1.0.relu#1"``). The gradient row of a layer is that of the loss with respect to its
output; for a nested output, the gradients of all of its tensors merge. Under ``GradScaler``
they are the scaled gradients.

The cost (``benchmarks/bench_watch.py``, every leaf module, 2 CPU threads): on a resnet18
training step (batch 32, 112 px) a sampled step 1.2x a plain one, an unsampled step 1.00x, and
a run at ``every=100`` within noise of 1.00x; on a small model whose plain step takes 12 ms, a
sampled step 2.1-2.7x and a run at ``every=100`` 1.02-1.05x (docs/benchmarks.md). Sinks: `TensorBoard`, `CSV`, `Parquet` (with pyarrow), `WandB` and any
``f(step, records)``. A sink that fails (a full disk, a lost server) never stops the training
from inside ``optimizer.step()``: the watch warns once, in one line naming it, and writes
nothing more to it. The file sinks never write through a symbolic link; `CSV` appends each
step's rows whole, `Parquet` puts its file in place whole at the end, and both continue a log
already at their path (``watch(start=N)`` after a resume). Alerts (`Alerts`) go to
``warnings`` as `WatchWarning`, or to ``on_alert=f(alert)``. For Lightning and Hugging Face:
`LightningWatch` and `HFWatch`, made from ``layertap.watch`` on first use, so that neither
library is imported before.
"""

from __future__ import annotations

import contextlib
import csv
import dataclasses
import functools
import io
import math
import os
import warnings
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import nested
from .atomic import AppendLog, AtomicFile, check_target, one_line, reason, write_atomic
from .distributed import Processes
from .errors import ArgumentError, LayertapError, MissingExtraError, require
from .printable import printable
from .select import Layers, named_layers, owner, select
from .stats import LayerStats, Summary, leaf_layers, merge_ranks, summarize
from .tap import Tap, tap


class WatchWarning(UserWarning):
    """An alert of `watch`: a non-finite value, dead units, or a layer whose scale explodes."""


# ---------------------------------------------------------------------------- records
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


# ---------------------------------------------------------------------------- sinks
class Sink(Protocol):
    """Where the records of each sampled step go (on rank 0 only under ``torchrun``)."""

    def write(self, step: int, records: Sequence[Record]) -> None: ...

    def close(self) -> None: ...


class Callback:
    """``f(step, records)`` as a sink; a plain function in ``sinks=`` becomes one."""

    def __init__(self, fn: Callable[[int, list[Record]], Any]) -> None:
        self.fn = fn

    def write(self, step: int, records: Sequence[Record]) -> None:
        self.fn(step, list(records))

    def close(self) -> None:
        pass


class CSV:
    """One row per step, layer and kind, with the columns of `COLUMNS`; opened at the first write.

    Each step's rows are appended whole (a failed write is cut back off) and handed to the
    file at once, so the log reads while training runs. A log already at ``path`` is continued
    (a resumed run, ``watch(start=N)``): its rows before the first step written now stay, those
    of the steps run again (at or after it) are dropped. A file that is not a watch log, a
    folder or a symbolic link at ``path`` is refused.

    >>> import tempfile, os
    >>> sink = CSV(os.path.join(tempfile.mkdtemp(), "watch.csv"))
    >>> sink.close()  # nothing written, no file made
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = check_target(path, WHAT)  # now, not inside a training step
        self._log: AppendLog | None = None

    def write(self, step: int, records: Sequence[Record]) -> None:
        if self._log is None:
            self._log = self._open(step)
        text = io.StringIO()
        csv.DictWriter(text, fieldnames=COLUMNS).writerows(r.row() for r in records)
        self._log.write(text.getvalue().encode("utf-8"))

    def _open(self, first: int) -> AppendLog:
        """The log to append to, after the old one's rows at steps ``>= first`` are dropped."""
        check_target(self.path, WHAT)  # again: a link may have been put there since
        header = io.StringIO()
        csv.writer(header).writerow(COLUMNS)
        try:
            with open(self.path, newline="", encoding="utf-8", opener=_no_follow) as f:
                table = list(csv.reader(f))
        except FileNotFoundError:
            table = []
        except (OSError, UnicodeDecodeError) as e:
            raise LayertapError(f"cannot continue the watch log {self.path}: {one_line(e)}") from e
        if table and table[0] != list(COLUMNS):
            raise LayertapError(f"{self.path} is not a layertap watch log (its first row is not the columns of one): choose another path, or move the file away")
        kept = [row for row in table[1:] if len(row) == len(COLUMNS) and row[0].isdigit() and int(row[0]) < first]
        if len(kept) < len(table) - 1 or not table:  # rows to drop (or a new file): the log is rewritten whole
            _say_replaced(self.path, [int(row[0]) for row in table[1:] if row and row[0].isdigit()], first)
            body = io.StringIO()
            csv.writer(body).writerows(kept)
            write_atomic(self.path, header.getvalue() + body.getvalue(), WHAT)
        return AppendLog(self.path, WHAT)

    def close(self) -> None:
        if self._log is not None:
            self._log.close()
            self._log = None


class Parquet:
    """The rows of `CSV` in a Parquet file, one row group per sampled step (needs ``pyarrow``).

    The file is written beside ``path`` and put in place whole when the watch ends: until then
    (or if the disk fills) the old file stays as it was. Its rows before the first step written
    now are kept, as `CSV` does.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        try:
            import pyarrow  # noqa: F401
        except ImportError as e:
            raise MissingExtraError("the Parquet sink needs pyarrow: pip install pyarrow (or write CSV)") from e
        self.path = check_target(path, WHAT)
        self._out: AtomicFile | None = None
        self._writer: Any = None

    def write(self, step: int, records: Sequence[Record]) -> None:
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            table = pa.Table.from_pylist([r.row() for r in records], schema=_arrow_schema(pa))
            if self._writer is None:
                old = self._old_rows(pa, pq, step)
                self._out = AtomicFile(self.path, WHAT)
                self._writer = pq.ParquetWriter(self._out.file, table.schema)
                if old is not None and old.num_rows:
                    self._writer.write_table(old)
            self._writer.write_table(table)
        except (OSError, pa.ArrowException) as e:
            self._discard()
            raise LayertapError(f"cannot write the watch log {self.path}: {reason(e)}") from e

    def _old_rows(self, pa: Any, pq: Any, first: int) -> Any:
        import pyarrow.compute as pc

        if not check_target(self.path, WHAT).exists():  # a link put there since is refused
            return None
        try:
            old = pq.read_table(self.path)
        except (OSError, pa.ArrowException) as e:
            raise LayertapError(f"{self.path} is not a layertap watch log ({one_line(e)}): choose another path, or move the file away") from e
        if old.schema != _arrow_schema(pa):
            raise LayertapError(f"{self.path} is not a layertap watch log (its columns differ): choose another path, or move the file away")
        _say_replaced(self.path, old["step"].to_pylist(), first)
        return old.filter(pc.less(old["step"], first))

    def _discard(self) -> None:
        self._writer = None
        if self._out is not None:
            self._out.discard()
            self._out = None

    def close(self) -> None:
        if self._writer is None or self._out is None:
            return
        import pyarrow as pa

        try:
            self._writer.close()
        except (OSError, pa.ArrowException) as e:
            self._discard()
            raise LayertapError(f"cannot write the watch log {self.path}: {reason(e)}") from e
        out, self._out, self._writer = self._out, None, None
        out.commit()


WHAT = "the watch log"


def _no_follow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW)


def _say_replaced(path: Path, steps: list[int], first: int) -> None:
    """Warn when a continued log held rows of the steps run again."""
    again = [s for s in steps if s >= first]
    if again:
        warnings.warn(
            printable(f"the watch log {path} held rows of steps {min(again)}-{max(again)}, at or after this run's first step {first}: "
            "they are replaced by this run's"), WatchWarning, stacklevel=2,
        )


def _arrow_schema(pa: Any) -> Any:
    types = {"step": pa.int64(), "call": pa.int64(), "count": pa.int64(), "channels": pa.int64(), "dead_channels": pa.int64()}
    text = {"name", "layer", "kind", "type"}
    return pa.schema([(c, pa.string() if c in text else types.get(c, pa.float64())) for c in COLUMNS])


def _tag(record: Record, stat: str) -> str:
    # grouped by kind and statistic: one TensorBoard section compares a statistic across layers
    return f"{record.kind}.{stat}/{record.name or '(model)'}"


class TensorBoard:
    """Scalars ``"{kind}.{stat}/{layer}"`` (``"output.std/layer1.0.conv1"``) at each sampled step,
    and histograms ``"{kind}/{layer}"`` when `watch` computes them (``histogram_bins=``).

    ``log_dir`` makes a ``SummaryWriter`` at the first write (closed at the end); or pass your
    own ``writer`` (left open). ``stats`` chooses among `STATS`. Needs ``tensorboard``.
    """

    def __init__(self, log_dir: str | os.PathLike[str] | None = None, *, writer: Any = None, stats: Sequence[str] = STATS) -> None:
        unknown = [s for s in stats if s not in STATS]
        if unknown:
            raise ArgumentError(f"unknown stats {unknown}: use any of {STATS}")
        if (log_dir is None) == (writer is None):
            raise ArgumentError("TensorBoard needs log_dir or writer (one of them)")
        self._module = require("torch.utils.tensorboard", "watch")  # checked now, not at step 100
        self.log_dir, self.writer, self.stats = log_dir, writer, tuple(stats)
        self._own = writer is None

    def write(self, step: int, records: Sequence[Record]) -> None:
        if self.writer is None:
            self.writer = self._module.SummaryWriter(log_dir=str(self.log_dir))
        writer = self.writer
        for r in records:
            for stat in self.stats:
                writer.add_scalar(_tag(r, stat), r.value(stat), step)
            if r.stats.histogram is not None:
                counts, edges = r.stats.histogram
                middle = (edges[:-1] + edges[1:]) / 2
                writer.add_histogram_raw(
                    f"{r.kind}/{r.name or '(model)'}", min=r.stats.min, max=r.stats.max, num=int(counts.sum()),
                    sum=float((counts * middle).sum()), sum_squares=float((counts * middle**2).sum()),
                    bucket_limits=edges[1:].tolist(), bucket_counts=counts.tolist(), global_step=step,
                )  # fmt: skip
        writer.flush()

    def close(self) -> None:
        if self._own and self.writer is not None:
            self.writer.close()
            self.writer = None


class WandB:
    """``run.log`` of ``"layertap/{kind}.{stat}/{layer}"`` against its own x-axis ``"layertap/step"``
    (``define_metric``), and ``wandb.Histogram`` when `watch` computes histograms.

    ``run`` defaults to ``wandb.run`` (call ``wandb.init()`` first). Tested in offline mode only.
    """

    def __init__(self, run: Any = None, *, stats: Sequence[str] = STATS) -> None:
        try:
            import wandb
        except ImportError as e:
            raise MissingExtraError("the WandB sink needs wandb: pip install wandb") from e
        self._wandb, self.run, self.stats = wandb, run, tuple(stats)
        self._defined = False

    def write(self, step: int, records: Sequence[Record]) -> None:
        run = self.run or self._wandb.run
        if run is None:
            raise LayertapError("the WandB sink found no run: call wandb.init() before training, or pass WandB(run)")
        if not self._defined:
            run.define_metric("layertap/step")
            run.define_metric("layertap/*", step_metric="layertap/step")
            self._defined = True
        data: dict[str, Any] = {"layertap/step": step}
        for r in records:
            data.update({"layertap/" + _tag(r, stat): r.value(stat) for stat in self.stats})
            if r.stats.histogram is not None:
                data[f"layertap/{r.kind}/{r.name or '(model)'}"] = self._wandb.Histogram(np_histogram=r.stats.histogram)
        run.log(data)

    def close(self) -> None:
        pass


def _sink_name(sink: Any) -> str:
    """A sink as its error names it: its file or folder, or its type (a function: its name)."""
    if isinstance(sink, Callback):
        return getattr(sink.fn, "__qualname__", type(sink.fn).__name__)
    where = getattr(sink, "path", None) or getattr(sink, "log_dir", None)
    return f"{type(sink).__name__}({str(where)!r})" if where is not None else type(sink).__name__


def _sink(sink: Any) -> Sink:
    if isinstance(sink, (str, os.PathLike)):
        path = Path(sink)
        if path.suffix == ".csv":
            return CSV(path)
        if path.suffix == ".parquet":
            return Parquet(path)
        raise ArgumentError(f"sink path {str(path)!r}: name a .csv or .parquet file, or pass TensorBoard(log_dir)")
    if hasattr(sink, "write") and hasattr(sink, "close"):
        return sink
    if callable(sink):
        return Callback(sink)
    raise ArgumentError(f"a sink is f(step, records), a .csv/.parquet path or an object with write() and close(); got {type(sink).__name__}")


# ---------------------------------------------------------------------------- alerts
@dataclasses.dataclass(frozen=True)
class Alert:
    """Something wrong at a sampled step; ``layer`` is the first row it concerns, in the order the
    forward (or the backward) reached them, ``layers`` every row newly concerned."""

    kind: Literal["nonfinite", "dead", "explode"]
    step: int
    phase: Literal["forward", "backward"]
    layer: str
    module_type: str
    layers: tuple[str, ...]
    message: str

    def __str__(self) -> str:
        return self.message


@dataclasses.dataclass(frozen=True)
class Alerts:
    """When `watch` raises an alert; each fires once per layer and phase.

    Attributes:
        nonfinite: the first NaN or Inf of the whole run (one alert).
        dead_fraction: the share of a layer output's channels that are exactly zero in the whole
            sampled step, above which dead units are reported (``None``: never).
        explode_factor: a row's std this many times its first sampled (finite, non-zero) std.
        explode_threshold: a row's largest finite magnitude above this.
    """

    nonfinite: bool = True
    dead_fraction: float | None = 0.5
    explode_factor: float | None = 100.0
    explode_threshold: float | None = 1e4


def _phase(kind: str) -> Literal["forward", "backward"]:
    return "forward" if kind == "output" else "backward"


def _what(kind: str) -> str:
    return "output" if kind == "output" else "output gradient"


class _Judge:
    """Turns each sampled step's records into alerts, remembering what it already said."""

    def __init__(self, rules: Alerts) -> None:
        self.rules = rules
        self.nonfinite_seen = False
        self.first_std: dict[tuple[str, str], tuple[int, float]] = {}
        self.said: set[tuple[str, str, str]] = set()  # (alert kind, row kind, row name)

    def alerts(self, step: int, records: list[Record]) -> list[Alert]:
        out: list[Alert] = []
        rules = self.rules
        for kind in ("output", "grad"):
            rows = [r for r in records if r.kind == kind]
            if kind == "grad":
                rows.reverse()  # in the order the backward reached them
            if rules.nonfinite and not self.nonfinite_seen:
                bad = [r for r in rows if r.stats.nonfinite_fraction > 0]
                if bad:
                    self.nonfinite_seen = True
                    s = bad[0].stats
                    out.append(self._alert("nonfinite", step, kind, bad, (
                        f"layertap.watch: step {step}, {_phase(kind)}: layer {s.name!r} ({s.module_type}) is the first "
                        f"whose {_what(kind)} holds non-finite values (NaN {s.nan_fraction:.3g}, Inf {s.inf_fraction:.3g})"
                        + _also(bad)
                    )))  # fmt: skip
            if kind == "output" and rules.dead_fraction is not None:
                limit = rules.dead_fraction
                dead = [r for r in rows if r.dead_fraction > limit and ("dead", kind, r.name) not in self.said]
                if dead:
                    s = dead[0].stats
                    out.append(self._alert("dead", step, kind, dead, (
                        f"layertap.watch: step {step}: {len(s.dead_channels)} of {s.channels} channels of layer {s.name!r} "
                        f"({s.module_type}) are dead (exactly 0 in the whole step), more than {limit:.0%}" + _also(dead)
                    )))  # fmt: skip
            out += self._explode(step, kind, rows)
        return out

    def _explode(self, step: int, kind: str, rows: list[Record]) -> list[Alert]:
        rules, why = self.rules, {}
        for r in rows:
            s, key = r.stats, (kind, r.name)
            first = self.first_std.get(key)
            if first is None and math.isfinite(s.std) and s.std > 0:
                self.first_std[key] = first = (step, s.std)
            if ("explode", kind, r.name) in self.said:
                continue
            if rules.explode_factor is not None and first is not None and s.std > rules.explode_factor * first[1]:
                why[r.name] = f"std {s.std:.4g} is {s.std / first[1]:.3g}x its first sampled value {first[1]:.4g} (step {first[0]})"
            elif rules.explode_threshold is not None and s.absmax > rules.explode_threshold:
                why[r.name] = f"largest magnitude {s.absmax:.4g} is above {rules.explode_threshold:.4g}"
        if not why:
            return []
        hit = [r for r in rows if r.name in why]
        s = hit[0].stats
        message = (
            f"layertap.watch: step {step}, {_phase(kind)}: the scale of layer {s.name!r} ({s.module_type}) explodes, "
            f"its {_what(kind)}'s {why[s.name]}" + _also(hit)
        )
        return [self._alert("explode", step, kind, hit, message)]

    def _alert(self, what: Literal["nonfinite", "dead", "explode"], step: int, kind: str, rows: list[Record], message: str) -> Alert:
        self.said.update((what, kind, r.name) for r in rows)
        s = rows[0].stats
        return Alert(what, step, _phase(kind), s.name, s.module_type, tuple(r.name for r in rows), message)


def _also(rows: list[Record]) -> str:
    if len(rows) == 1:
        return ""
    more = ", ".join(repr(r.name) for r in rows[1:4])
    return f"; also {len(rows) - 1} later: {more}{' ...' if len(rows) > 4 else ''}"


# ---------------------------------------------------------------------------- the watch
def _summaries(value: Any, bins: int) -> Iterator[Summary]:
    for t in nested.tensors(value):
        if t.is_floating_point() and (s := summarize(t, bins)) is not None:
            yield s


class Watch:
    """Per-layer statistics of every ``every``-th training step; made by `layertap.watch`.

    Call `step` once per training step, after the optimizer's step (or pass ``optimizer=``).
    ``last`` holds the records of the last sampled step, ``alerts`` every alert so far,
    ``global_step`` the number of the step now running.
    """

    def __init__(
        self,
        model: nn.Module,
        layers: Layers | None = None,
        *,
        every: int = 100,
        sinks: Sequence[Any] = (),
        alerts: bool | Alerts = True,
        on_alert: Callable[[Alert], Any] | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        histogram_bins: int = 0,
        start: int = 0,
    ) -> None:
        if not isinstance(every, int) or every < 1:
            raise ArgumentError(f"every={every!r}: use a whole number of steps, 1 or more")
        if histogram_bins and histogram_bins < 2:
            raise ArgumentError(f"histogram_bins={histogram_bins}: use 0 (no histogram) or 2 or more bins")
        self.model = model
        self.names = select(model, layers) if layers is not None else leaf_layers(model)
        self.every = every
        self.sinks: list[Sink] = [_sink(s) for s in sinks]
        rules = Alerts() if alerts is True else alerts or None
        self._judge = _Judge(rules) if rules else None
        self.on_alert = on_alert
        self.optimizer = optimizer
        self.histogram_bins = histogram_bins
        self.global_step = start
        self.last: list[Record] = []
        self.alerts: list[Alert] = []
        self._types = {n: type(m).__name__ for n, m in named_layers(model).items()}
        self._hook: RemovableHandle | None = None  # the model's forward pre-hook, in a sampled step
        self._tap: Tap | None = None
        self._sampling = False
        self._summaries: dict[tuple[str, str, int], Summary] = {}  # (kind, layer, call position)
        self._order: dict[str, None] = {}  # layers in forward order, over the step's taps
        self._step_hook: RemovableHandle | None = None
        self._open = False

    # ------------------------------------------------------------------ lifetime
    def __enter__(self) -> Watch:
        if self._open:
            raise LayertapError("this watch is already running: make a new layertap.watch")
        self._open = True
        if self.optimizer is not None:
            self._step_hook = self.optimizer.register_step_post_hook(lambda *_: self.step())
        self._begin()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """End the running step (its statistics are written if it was sampled) and close the sinks."""
        if not self._open:
            return
        self._open = False
        if self._step_hook is not None:
            self._step_hook.remove()
            self._step_hook = None
        try:
            self._end()
        finally:
            for sink in self.sinks:
                self._guard(sink, sink.close)

    def step(self) -> None:
        """The training step ends: write its statistics if it was sampled; the next one begins."""
        if not self._open:
            raise LayertapError("watch.step() outside the watch: use it inside `with layertap.watch(...) as w:`")
        self._end()
        self.global_step += 1
        self._begin()

    def _goto(self, step: int) -> None:
        """Make ``step`` the running step (for trainers that count steps themselves)."""
        if step != self.global_step:
            self._end()
            self.global_step = step
            self._begin()

    @contextlib.contextmanager
    def paused(self) -> Iterator[None]:
        """No statistics inside the block (an evaluation with autograd on, inside a sampled step)."""
        hook, self._hook = self._hook, None
        if hook is not None:
            hook.remove()
        self._stop_tap()
        try:
            yield
        finally:
            if hook is not None and self._sampling:
                self._hook = self.model.register_forward_pre_hook(self._on_forward)

    # ------------------------------------------------------------------ a sampled step
    def _begin(self) -> None:
        self._sampling = self.global_step % self.every == 0
        if self._sampling:
            self._summaries, self._order = {}, {}
            self._hook = self.model.register_forward_pre_hook(self._on_forward)

    def _on_forward(self, module: nn.Module, args: Any) -> None:
        if not torch.is_grad_enabled():
            self._stop_tap()  # an evaluation inside the step: not training statistics
        elif self._tap is None:
            self._start_tap()  # its hooks run from the children on, in this very forward
        else:
            self._keep_order()
            self._tap.clear()  # `call` restarts: a row is a call position within one forward

    def _start_tap(self) -> None:
        """Tap the layers now, if the running step is sampled (trainers call it at a batch's start)."""
        if not self._sampling or self._tap is not None:
            return
        observe = functools.partial(self._observe, self.global_step)
        self._tap = tap(self.model, self.names, capture=("output", "grad"), observe=observe)
        self._tap.__enter__()
        if self._hook is not None:
            # this hook goes after the tap's own pre-hook: a hook removed before it runs, in the
            # forward that removes it, would be called without its kwargs (PyTorch reads that
            # flag per hook, from the live dict)
            self._hook.remove()
            self._hook = self.model.register_forward_pre_hook(self._on_forward)

    def _observe(self, step: int, layer: str, kind: str, call: int, value: Any) -> None:
        if step != self.global_step or not self._sampling:
            return  # a backward that came after its step ended
        summaries = self._summaries
        for s in _summaries(value, self.histogram_bins):
            key = (kind, layer, call)
            summaries[key] = summaries[key].merge(s) if key in summaries else s
            if kind == "output":
                break  # the first floating-point tensor of a nested output, as layertap.stats

    def _keep_order(self) -> None:
        if self._tap is not None:
            self._order.update(dict.fromkeys(self._tap.order))

    def _stop_tap(self) -> None:
        if self._tap is not None:
            self._keep_order()
            self._tap.remove()
            self._tap = None

    def _end(self) -> None:
        if not self._sampling:
            return
        self._sampling = False
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._stop_tap()
        summaries, self._summaries = merge_ranks(self._summaries), {}
        records = self._records(summaries)
        if not records:  # no forward ran in the step (the one that was starting when training ended)
            return
        self.last = records
        procs = Processes(*_rank_world())
        if procs.main:
            for sink in list(self.sinks):
                if not self._guard(sink, functools.partial(sink.write, self.global_step, records)):
                    self.sinks.remove(sink)
                    self._guard(sink, sink.close)
        if self._judge is not None:
            for alert in self._judge.alerts(self.global_step, records):
                self.alerts.append(alert)
                if self.on_alert is not None:  # on every rank: they see the same merged numbers
                    self.on_alert(alert)
                elif procs.main:
                    warnings.warn(printable(alert.message), WatchWarning, stacklevel=3)

    def _guard(self, sink: Sink, call: Callable[[], Any]) -> bool:
        """Run a sink's ``call``; if it fails, warn (one line naming the sink) and return False.
        A sink runs inside the optimizer's step: its failure must not stop the training."""
        try:
            call()
            return True
        except Exception as e:
            what = one_line(e) if isinstance(e, LayertapError) else f"the watch sink {_sink_name(sink)} failed: {type(e).__name__}: {one_line(e)}"
            warnings.warn(printable(f"{what}; the watch writes nothing more to it, and training goes on"), WatchWarning, stacklevel=4)
            return False

    def _records(self, summaries: dict[tuple[str, str, int], Summary]) -> list[Record]:
        """Rows in forward order, output then gradient; gradients in backward order for alerts."""
        order = {layer: i for i, layer in enumerate(self._order)}
        repeated = {layer for _, layer, call in summaries if call > 0}
        keys = sorted(summaries, key=lambda k: (order.get(k[1], len(order)), k[2], k[0] != "output"))
        records = []
        for kind, layer, call in keys:
            name = f"{layer}#{call}" if layer in repeated else layer
            stats = LayerStats.from_summary(
                summaries[kind, layer, call], name=name, layer=layer, call=call, module_type=self._types[owner(layer)]
            )
            records.append(Record(self.global_step, kind, stats))
        return records


def _rank_world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def watch(
    model: nn.Module,
    layers: Layers | None = None,
    *,
    every: int = 100,
    sinks: Sequence[Any] = (),
    alerts: bool | Alerts = True,
    on_alert: Callable[[Alert], Any] | None = None,
    optimizer: torch.optim.Optimizer | None = None,
    histogram_bins: int = 0,
    start: int = 0,
) -> Watch:
    """Per-layer statistics of outputs and gradients on every ``every``-th training step.

    Args:
        layers: a layer spec (see `layertap.select`); default every leaf module.
        every: sample steps ``start``, ``start + every``, ... (step numbers count `Watch.step` calls).
        sinks: `TensorBoard`, `CSV`, `Parquet`, `WandB`, a ``.csv``/``.parquet`` path, or
            ``f(step, records)``; written on rank 0 under ``torchrun``, where the statistics are
            merged over every rank.
        alerts: ``True`` (the default `Alerts`), ``False``, or your own `Alerts`.
        on_alert: ``f(alert)`` instead of a `WatchWarning` (called on every rank).
        optimizer: advance on its ``step()`` (its post-step hook) instead of calling `Watch.step`.
        histogram_bins: ``>= 2`` adds histograms of the outputs (to TensorBoard and W&B).
        start: the number of the first step (a resumed run's): a `CSV` or `Parquet` log at the
            path keeps its rows of earlier steps and replaces those of the steps run again.

    A forward under ``torch.no_grad()`` inside a sampled step is not counted; wrap an
    evaluation with autograd on in ``w.paused()``.

    >>> import torch
    >>> from layertap.watch import watch
    >>> model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU(), torch.nn.Linear(4, 1))
    >>> opt = torch.optim.SGD(model.parameters(), lr=0.1)
    >>> with watch(model, every=1, optimizer=opt) as w:
    ...     model(torch.randn(8, 4)).sum().backward()
    ...     opt.step()   # the step is counted here, and step 0's statistics written
    >>> w.global_step, [(r.name, r.kind) for r in w.last][:2]
    (1, [('0', 'output'), ('0', 'grad')])
    """
    return Watch(
        model, layers, every=every, sinks=sinks, alerts=alerts, on_alert=on_alert, optimizer=optimizer,
        histogram_bins=histogram_bins, start=start,
    )  # fmt: skip


# ---------------------------------------------------------------------------- trainer adapters
@functools.cache
def _lightning_class() -> type:
    import importlib

    Callback: Any  # from whichever Lightning package is installed
    try:
        Callback = importlib.import_module("lightning.pytorch").Callback
    except ImportError:
        try:
            Callback = importlib.import_module("pytorch_lightning").Callback  # the older package name
        except ImportError as e:
            raise MissingExtraError("LightningWatch needs Lightning: pip install lightning") from e

    class LightningWatch(Callback):
        """`watch` as a Lightning ``Callback``: steps are the trainer's ``global_step`` (optimizer
        steps), validation is not counted. Arguments are those of `watch`, without ``optimizer``."""

        def __init__(self, layers: Layers | None = None, **options: Any) -> None:
            self.layers, self.options = layers, options
            self.watch: Watch | None = None

        def on_fit_start(self, trainer: Any, pl_module: nn.Module) -> None:
            self.watch = Watch(pl_module, self.layers, start=trainer.global_step, **self.options).__enter__()

        def on_train_batch_start(self, trainer: Any, pl_module: nn.Module, batch: Any, batch_idx: int) -> None:
            if self.watch is not None:
                self.watch._goto(trainer.global_step)
                # now, not at the module's forward: training_step may call a submodule directly
                self.watch._start_tap()

        def on_train_batch_end(self, trainer: Any, pl_module: nn.Module, outputs: Any, batch: Any, batch_idx: int) -> None:
            if self.watch is not None:
                self.watch._stop_tap()  # its backward is done: nothing more until the next batch
                self.watch._goto(trainer.global_step)  # after an optimizer step: the sampled step is done

        def on_fit_end(self, trainer: Any, pl_module: nn.Module) -> None:
            if self.watch is not None:
                self.watch.close()

        def on_exception(self, trainer: Any, pl_module: nn.Module, exception: BaseException) -> None:
            self.on_fit_end(trainer, pl_module)

    return LightningWatch


@functools.cache
def _hf_class() -> type:
    try:
        from transformers import TrainerCallback
    except ImportError as e:
        raise MissingExtraError("HFWatch needs transformers: pip install 'layertap[hf]'") from e

    class HFWatch(TrainerCallback):
        """`watch` as a Hugging Face ``TrainerCallback``: steps are ``state.global_step`` (optimizer
        steps), evaluation is not counted. Arguments are those of `watch`, without ``optimizer``."""

        def __init__(self, layers: Layers | None = None, **options: Any) -> None:
            self.layers, self.options = layers, options
            self.watch: Watch | None = None

        def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any) -> None:
            if model is None:
                raise LayertapError("HFWatch got no model from the Trainer")
            self.watch = Watch(model, self.layers, start=state.global_step, **self.options).__enter__()

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.watch is not None:
                self.watch._goto(state.global_step)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.watch is not None:
                self.watch._goto(state.global_step)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            if self.watch is not None:
                self.watch.close()

    return HFWatch


def __getattr__(name: str) -> Any:
    # the trainer libraries are imported only when an adapter is asked for
    if name == "LightningWatch":
        return _lightning_class()
    if name == "HFWatch":
        return _hf_class()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "watch",
    "Watch",
    "Record",
    "Alert",
    "Alerts",
    "WatchWarning",
    "TensorBoard",
    "CSV",
    "Parquet",
    "WandB",
    "Callback",
    "Sink",
    "STATS",
    "COLUMNS",
]  # and LightningWatch, HFWatch: made on first access (module __getattr__), so not in __all__
