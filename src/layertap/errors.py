"""The exceptions layertap raises, all of them. Each message names the problem and the fix.

Every class derives from `LayertapError` and, where one fits, from the matching built-in
exception, so ``except KeyError`` or ``except ValueError`` code keeps working:

>>> import layertap
>>> issubclass(layertap.LayerNotFoundError, KeyError), issubclass(layertap.ArgumentError, ValueError)
(True, True)
"""

from __future__ import annotations

from pathlib import Path

from .printable import printable


class LayertapError(Exception):
    """Base class of every error layertap raises on purpose.

    Its message (``str(e)``, hence a traceback) shows control characters escaped (`printable`):
    it names files, layers and models, which may hold terminal escape sequences. Line breaks and
    tabs are kept. The arguments stay as given (``e.args``), so a pickled error is the same.
    """

    def __str__(self) -> str:
        # one argument is the message itself, even for a KeyError, which would print it quoted with repr()
        text = str(self.args[0]) if len(self.args) == 1 else super().__str__()
        return printable(text, keep="\n\t")


class ArgumentError(LayertapError, ValueError):
    """An argument has the wrong shape, type or value; the message says what is expected."""


class LayerNotFoundError(LayertapError, KeyError):
    """A layer spec matched no module; the message lists the closest real names."""


class LayerNotRunError(LayertapError, KeyError):
    """A tapped layer has no value: it never ran since the tap started (or since ``clear()``)."""


class TapError(LayertapError, RuntimeError):
    """A tap was asked for something it cannot do in this setting (e.g. gradients under no_grad)."""


class LayoutError(LayertapError, ValueError):
    """A layer's activation cannot be read as a spatial or token map (for heatmaps)."""


class LayerForwardError(LayertapError, RuntimeError):
    """The model's forward raised inside a layer; the message names the layer and its inputs.

    The original exception is chained as ``__cause__``.
    """

    def __init__(self, message: str, layer: str, module_type: str) -> None:
        super().__init__(message)
        self.layer = layer
        self.module_type = module_type


class DataError(LayertapError, ValueError):
    """The data cannot be read as samples; the message says what was expected."""


SKIP_HINT = (
    "Remove or replace the file, or skip bad images (on_error='skip' / --on-error skip) to record it "
    "in the store's failed list"
)


class CorruptImageError(DataError):
    """An image file could not be read; ``path`` names it and ``reason`` says why (one line)."""

    def __init__(self, path: Path, reason: str, hint: str = SKIP_HINT) -> None:
        self.path = path
        self.reason = " ".join(reason.split()).rstrip(".")  # one line, whatever the decoder said
        super().__init__(f"cannot read image {path}: {self.reason}. {hint}")


class ModelLoadError(LayertapError, ValueError):
    """A model spec could not be turned into a model; the message says what to change."""


class StoreError(LayertapError):
    """A feature store cannot be written or read as asked; the message says why and what to do.

    It covers stores that are damaged or crafted, settings that differ, and refused writes, so
    it has no built-in base of its own; `DataChangedError` is also a ``ValueError``.
    """


class StoreLockedError(StoreError):
    """Another extraction is writing the store; the message names it (host, pid, start time)."""


class DataChangedError(StoreError, ValueError):
    """A resumed extraction found samples that differ from those its written chunks were made of."""


class OutputError(LayertapError, OSError):
    """A file layertap writes (a report, a watch log) could not be written; the message names it."""


class MissingExtraError(LayertapError, ImportError):
    """An optional dependency is missing; the message names the extra to install."""


class RankFailedError(LayertapError, RuntimeError):
    """Another process of the job failed; its error is in the message (and in its own output)."""


def require(module: str, extra: str):
    """Import an optional dependency or raise `MissingExtraError` naming the pip extra."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise MissingExtraError(
            f"{module!r} is needed for this; install it with: pip install 'layertap[{extra}]'"
        ) from e
