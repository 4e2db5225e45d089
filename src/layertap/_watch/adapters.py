"""The watch in a trainer's callbacks: `LightningWatch` (a Lightning ``Callback``) and `HFWatch`
(a Hugging Face ``TrainerCallback``).

Each class is made on first use, by ``layertap.watch.LightningWatch`` (the module's
``__getattr__``), so that neither library is imported before. `layertap.watch` hands its `Watch`
in as ``make``: this file sits below it and does not import it.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Protocol, Self

from torch import nn

from ..errors import LayertapError, MissingExtraError
from ..select import Layers


class Stepped(Protocol):
    """What an adapter drives: a `layertap.watch.Watch`, told the trainer's step."""

    def __enter__(self) -> Self: ...

    def _goto(self, step: int) -> None: ...

    def _start_tap(self) -> None: ...

    def _stop_tap(self) -> None: ...

    def close(self) -> None: ...


MakeWatch = Callable[..., Stepped]  # Watch(model, layers, start=..., **options)


class _Adapter:
    """What both adapters share: the arguments of `watch`, kept until training starts, and the
    watch made then. ``make`` is set on each adapter class when it is made."""

    make: ClassVar[MakeWatch]

    def __init__(self, layers: Layers | None = None, **options: Any) -> None:
        self.layers, self.options = layers, options
        self.watch: Stepped | None = None

    def _start(self, model: nn.Module, step: int) -> None:
        self.watch = type(self).make(model, self.layers, start=step, **self.options).__enter__()

    def _goto(self, step: int) -> None:
        if self.watch is not None:
            self.watch._goto(step)

    def _close(self) -> None:
        if self.watch is not None:
            self.watch.close()


def lightning_class(make: MakeWatch) -> type:
    """The `LightningWatch` class, on the Lightning package installed (``lightning`` or the older ``pytorch_lightning``)."""
    import importlib

    Callback: Any  # from whichever Lightning package is installed
    try:
        Callback = importlib.import_module("lightning.pytorch").Callback
    except ImportError:
        try:
            Callback = importlib.import_module("pytorch_lightning").Callback  # the older package name
        except ImportError as e:
            raise MissingExtraError("LightningWatch needs Lightning: pip install lightning") from e

    class LightningWatch(_Adapter, Callback):
        """`watch` as a Lightning ``Callback``: steps are the trainer's ``global_step`` (optimizer
        steps), validation is not counted. Arguments are those of `watch`, without ``optimizer``."""

        def on_fit_start(self, trainer: Any, pl_module: nn.Module) -> None:
            self._start(pl_module, trainer.global_step)

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
            self._close()

        def on_exception(self, trainer: Any, pl_module: nn.Module, exception: BaseException) -> None:
            self.on_fit_end(trainer, pl_module)

    LightningWatch.make = make
    return LightningWatch


def hf_class(make: MakeWatch) -> type:
    """The `HFWatch` class, on the ``transformers`` installed."""
    try:
        from transformers import TrainerCallback
    except ImportError as e:
        raise MissingExtraError("HFWatch needs transformers: pip install 'layertap[hf]'") from e

    class HFWatch(_Adapter, TrainerCallback):
        """`watch` as a Hugging Face ``TrainerCallback``: steps are ``state.global_step`` (optimizer
        steps), evaluation is not counted. Arguments are those of `watch`, without ``optimizer``."""

        def on_train_begin(self, args: Any, state: Any, control: Any, model: nn.Module | None = None, **kwargs: Any) -> None:
            if model is None:
                raise LayertapError("HFWatch got no model from the Trainer")
            self._start(model, state.global_step)

        def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._goto(state.global_step)

        def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._goto(state.global_step)

        def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            self._close()

    HFWatch.make = make
    return HFWatch


__all__ = ["lightning_class", "hf_class", "Stepped", "MakeWatch"]
