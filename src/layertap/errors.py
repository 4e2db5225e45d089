"""The exceptions layertap raises. Each message names the problem and the fix."""

from __future__ import annotations


class LayertapError(Exception):
    """Base class of every error layertap raises on purpose."""


class LayerNotFoundError(LayertapError, KeyError):
    """A layer spec matched no module; the message lists the closest real names."""

    def __str__(self) -> str:  # KeyError would print the message quoted with repr()
        return str(self.args[0]) if self.args else ""


class LayerNotRunError(LayertapError, KeyError):
    """A tapped layer has no value: it never ran since the tap started (or since ``clear()``)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class TapError(LayertapError):
    """A tap was asked for something it cannot do in this setting (e.g. gradients under no_grad)."""


class LayerForwardError(LayertapError):
    """The model's forward raised inside a layer; the message names the layer and its inputs.

    The original exception is chained as ``__cause__``.
    """

    def __init__(self, message: str, layer: str, module_type: str) -> None:
        super().__init__(message)
        self.layer = layer
        self.module_type = module_type


class StoreError(LayertapError):
    """A feature store cannot be written or read as asked; the message says why and what to do."""


class StoreLockedError(StoreError):
    """Another extraction is writing the store; the message names it (host, pid, start time)."""


class DataChangedError(StoreError):
    """A resumed extraction found samples that differ from those its written chunks were made of."""


class MissingExtraError(LayertapError, ImportError):
    """An optional dependency is missing; the message names the extra to install."""


def require(module: str, extra: str):
    """Import an optional dependency or raise `MissingExtraError` naming the pip extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(
            f"{module!r} is needed for this; install it with: pip install 'layertap[{extra}]'"
        ) from e
