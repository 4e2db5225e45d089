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

The numbers are `layertap.stats`'s: the same `layertap.tensorstats.tensor_stats` (one read of a CPU
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

This module holds `Watch` (the hooks, the sampled steps, the merge) and `watch`; the rows, sinks,
alerts and trainer adapters it composes are in ``layertap/_watch/``, one file each, and are
imported from here.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Callable, Iterator, Sequence
from typing import Any, ParamSpec

import torch
from torch import nn
from torch.utils.hooks import RemovableHandle

from . import nested
from ._watch.adapters import hf_class, lightning_class
from ._watch.alerts import Alert, Alerts, Judge
from ._watch.rows import COLUMNS, STATS, Record, WatchWarning
from ._watch.sinks import CSV, Callback, Parquet, Sink, TensorBoard, WandB, as_sink, sink_name
from .atomic import one_line
from .distributed import Processes
from .errors import ArgumentError, LayertapError
from .printable import printable
from .select import Layers, Selection, leaf_layers, owner, selection
from .stats import LayerStats, merge_ranks
from .tap import Tap, tap
from .tensorstats import TensorStats, tensor_stats


# ---------------------------------------------------------------------------- the watch
def _summaries(value: Any, bins: int) -> Iterator[TensorStats]:
    for t in nested.tensors(value):
        if t.is_floating_point() and (s := tensor_stats(t, bins)) is not None:
            yield s


class Watch:
    """Per-layer statistics of every ``every``-th training step; made by `layertap.watch`.

    Call `step` once per training step, after the optimizer's step (or pass ``optimizer=``).
    ``last`` holds the records of the last sampled step, ``alerts`` every alert so far,
    ``global_step`` the number of the step now running.

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
        # resolved once: each sampled step's tap takes it as it is, without selecting again
        self.selection: Selection = selection(model, layers if layers is not None else leaf_layers(model))
        self.every = every
        self.sinks: list[Sink] = [as_sink(s) for s in sinks]
        rules = Alerts() if alerts is True else alerts or None
        self._judge = Judge(rules) if rules else None
        self.on_alert = on_alert
        self.optimizer = optimizer
        self.histogram_bins = histogram_bins
        self.global_step = start
        self.last: list[Record] = []
        self.alerts: list[Alert] = []
        self._hook: RemovableHandle | None = None  # the model's forward pre-hook, in a sampled step
        self._tap: Tap | None = None
        self._sampling = False
        self._summaries: dict[tuple[str, str, int], TensorStats] = {}  # (kind, layer, call position)
        self._order: dict[str, None] = {}  # layers in forward order, over the step's taps
        self._step_hook: RemovableHandle | None = None
        self._open = False

    @property
    def names(self) -> list[str]:
        """The watched layers (and ops), in ``named_modules()`` order."""
        return list(self.selection.names)

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
        self._tap = tap(self.model, self.selection, capture=("output", "grad"), observe=observe)
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
        summaries, self._summaries = merge_ranks(self._summaries, self.model), {}
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
            what = one_line(e) if isinstance(e, LayertapError) else f"the watch sink {sink_name(sink)} failed: {type(e).__name__}: {one_line(e)}"
            warnings.warn(printable(f"{what}; the watch writes nothing more to it, and training goes on"), WatchWarning, stacklevel=4)
            return False

    def _records(self, summaries: dict[tuple[str, str, int], TensorStats]) -> list[Record]:
        """Rows in forward order, output then gradient; gradients in backward order for alerts."""
        order = {layer: i for i, layer in enumerate(self._order)}
        repeated = {layer for _, layer, call in summaries if call > 0}
        keys = sorted(summaries, key=lambda k: (order.get(k[1], len(order)), k[2], k[0] != "output"))
        records = []
        for kind, layer, call in keys:
            name = f"{layer}#{call}" if layer in repeated else layer
            stats = LayerStats.from_summary(
                summaries[kind, layer, call], name=name, layer=layer, call=call, module_type=self._module_type(layer)
            )
            records.append(Record(self.global_step, kind, stats))
        return records

    def _module_type(self, layer: str) -> str:
        """The class of the module a row belongs to; an op's is the module whose forward calls it."""
        chosen = self.selection
        op = chosen.ops.get(layer)
        # a name neither selected op nor module is an op of "MODULE:*", named as it ran
        module = op.module if op is not None else layer if layer in chosen.modules else owner(layer)
        return type(chosen.modules[module]).__name__


def _rank_world() -> tuple[int, int]:
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


_P = ParamSpec("_P")


def _arguments_of(cls: Callable[_P, Watch]) -> Callable[[Callable[..., Watch]], Callable[_P, Watch]]:
    """Give a factory the arguments of ``cls`` for type checkers: its signature is written once, there."""
    return lambda factory: factory


@_arguments_of(Watch)
def watch(model: nn.Module, layers: Layers | None = None, **options: Any) -> Watch:
    """Per-layer statistics of outputs and gradients on every ``every``-th training step.

    The arguments are those of `Watch`: ``every``, ``sinks``, ``alerts``, ``on_alert``,
    ``optimizer``, ``histogram_bins`` and ``start``, all keywords.

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
    return Watch(model, layers, **options)


# ---------------------------------------------------------------------------- trainer adapters
@functools.cache
def _lightning_class() -> type:
    return lightning_class(Watch)


@functools.cache
def _hf_class() -> type:
    return hf_class(Watch)


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
