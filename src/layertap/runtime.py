"""Running a model: calling it on a batch, placing it on a device, and naming the layer a failing
forward died in (found from the traceback at no cost to a good forward). `running` is the one
way layertap's own functions run a model: autograd as they need it, a failure named.

>>> import torch, layertap
>>> from layertap.runtime import explain_failures
>>> model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(5, 2))
>>> with explain_failures(model):          # doctest: +ELLIPSIS
...     model(torch.randn(3, 4))
Traceback (most recent call last):
layertap.errors.LayerForwardError: layer '1' (Linear) raised RuntimeError: ... inputs: [[3, 8]] (torch.float32)
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from . import nested
from .errors import LayerForwardError, LayertapError
from .select import named_layers


def run_model(model: nn.Module, inputs: Any) -> Any:
    """Call ``model`` on ``inputs``: a tuple is positional args, a dict keyword args, else one arg.

    A list stays one argument (detection models take a list of images).
    """
    if isinstance(inputs, dict):
        return model(**inputs)
    if isinstance(inputs, tuple):
        return model(*inputs)
    return model(inputs)


def place_model(model: nn.Module, device: torch.device | str | None) -> torch.device:
    """Move ``model`` to ``device`` if given; return the device its inputs should go to."""
    if device is not None:
        model.to(device)
        return torch.device(device)
    tensor = next(model.parameters(), None)
    return tensor.device if tensor is not None else torch.device("cpu")


_CALL_FRAMES = ("_call_impl", "_wrapped_call_impl")


def _locate(exc: BaseException, model: nn.Module) -> tuple[str, nn.Module, tuple, dict] | None:
    """The innermost layer of ``model`` whose call is on ``exc``'s traceback, with its inputs."""
    names = {id(m): name for name, m in named_layers(model).items()}
    found = None
    tb = exc.__traceback__
    while tb is not None:
        frame = tb.tb_frame
        if frame.f_code.co_name in _CALL_FRAMES:
            module = frame.f_locals.get("self")
            if isinstance(module, nn.Module) and id(module) in names:
                local = frame.f_locals
                found = (names[id(module)], module, local.get("args", ()), local.get("kwargs", {}))
        tb = tb.tb_next
    return found


def _describe_inputs(args: tuple, kwargs: dict) -> str:
    """Shapes and dtypes of a call's inputs, e.g. ``[[3, 8]] (torch.float32)``.

    Never raises: it describes an error already being raised, which it must not replace.
    """
    leaves = nested.tensors((args, kwargs))
    try:
        shown: Any = list(nested.shapes(list(args)))
        if kwargs:
            shown = {"args": shown, "kwargs": nested.shapes(dict(kwargs))}
    except Exception:  # a container that cannot hold shapes: list the tensors instead
        shown = [list(t.shape) for t in leaves]
    dtypes = sorted({str(t.dtype) for t in leaves})
    return f"{shown} ({', '.join(dtypes) or 'no tensors'})"


@contextlib.contextmanager
def explain_failures(model: nn.Module) -> Iterator[None]:
    """Re-raise an exception from inside ``model`` as `LayerForwardError` naming the layer.

    The original exception is chained (``raise ... from``), never swallowed.
    """
    try:
        yield
    except LayertapError:
        raise
    except Exception as exc:
        found = _locate(exc, model)
        if found is None:
            raise
        name, module, args, kwargs = found
        where = f"layer {name!r}" if name else "the model's own forward"
        cls = type(module).__name__
        notes = "".join(f" ({note})" for note in getattr(exc, "__notes__", ()) if note.startswith("layertap: "))
        raise LayerForwardError(
            f"{where} ({cls}) raised {type(exc).__name__}: {exc}; its inputs: {_describe_inputs(args, kwargs)}{notes}",
            layer=name,
            module_type=cls,
        ) from exc


@contextlib.contextmanager
def running(model: nn.Module, *, grad: bool | None = False) -> Iterator[None]:
    """Run ``model`` in the block: autograd off (``grad=False``, the default), on (``True``,
    even under the caller's ``no_grad``) or as the caller has it (``None``); an exception from
    inside the model is raised as `LayerForwardError` naming the layer (`explain_failures`).

    With ``grad`` given, the mode the block began with is restored when it ends, even where a
    hook changed it inside (CAM's turns autograd on at its first layer).

    >>> import torch
    >>> model = torch.nn.Linear(4, 2)
    >>> with running(model):
    ...     out = run_model(model, torch.randn(3, 4))
    >>> out.requires_grad
    False
    """
    mode = contextlib.nullcontext() if grad is None else torch.set_grad_enabled(grad)
    with explain_failures(model), mode:
        yield


__all__ = ["run_model", "place_model", "running", "explain_failures"]
