"""Where the rows of each sampled step go: `CSV`, `Parquet`, `TensorBoard`, `WandB`, or ``f(step, records)``.

A sink is anything with ``write(step, records)`` and ``close()`` (`Sink`); `as_sink` turns what
``watch(sinks=...)`` is given (a path, a function, a sink) into one. The sinks run inside the
training step (``optimizer.step()``): `layertap.watch.Watch` guards each call, so a sink's failure
is one warning and never stops the training. The file sinks never write through a symbolic link
and continue a log already at their path (a resumed run).
"""

from __future__ import annotations

import csv
import io
import os
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Protocol

from ..atomic import AppendLog, AtomicFile, check_target, one_line, reason, write_atomic
from ..errors import ArgumentError, LayertapError, MissingExtraError, require
from ..printable import printable
from .rows import COLUMNS, STATS, Record, WatchWarning


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


def sink_name(sink: Any) -> str:
    """A sink as its error names it: its file or folder, or its type (a function: its name)."""
    if isinstance(sink, Callback):
        return getattr(sink.fn, "__qualname__", type(sink.fn).__name__)
    where = getattr(sink, "path", None) or getattr(sink, "log_dir", None)
    return f"{type(sink).__name__}({str(where)!r})" if where is not None else type(sink).__name__


def as_sink(sink: Any) -> Sink:
    """A sink from what ``watch(sinks=...)`` was given: a ``.csv``/``.parquet`` path, a sink, or a function."""
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


__all__ = ["Sink", "Callback", "CSV", "Parquet", "TensorBoard", "WandB", "as_sink", "sink_name"]
