"""One-shot feature extraction: `extract` for a batch, `FeatureExtractor` as a trainable backbone."""

from __future__ import annotations

import contextlib
from typing import Any, Literal

import torch
from torch import nn

from .runtime import explain_failures, run_model
from .select import Layers, select
from .tap import tap


def extract(
    model: nn.Module,
    inputs: Any,
    layers: Layers,
    *,
    capture: Literal["output", "input"] = "output",
    stop_early: bool = True,
    **tap_options: Any,
) -> dict[str, Any]:
    """Run ``model`` once on ``inputs`` and return ``{layer name: value}`` for the chosen layers.

    ``inputs`` is a tensor, a tuple of positional args or a dict of keyword args. The forward
    stops after the last chosen layer (``stop_early=False`` runs it all) and, unless
    ``detach=False``, runs without autograd. Other options are those of `layertap.tap`
    (``reduce``, ``dtype``, ``to``, ``keep``, ``edit``). For gradients use `layertap.tap`.

    >>> import torch, torchvision, layertap
    >>> model = torchvision.models.resnet18()
    >>> out = layertap.extract(model, torch.randn(2, 3, 64, 64), "layer*", reduce="mean")
    >>> [tuple(v.shape) for v in out.values()]
    [(2, 64), (2, 128), (2, 256), (2, 512)]
    """
    if capture not in ("output", "input"):
        raise ValueError(
            f"extract captures 'output' or 'input', not {capture!r}: for gradients use "
            "layertap.tap(model, layers, capture='grad') around your own backward"
        )
    grad_mode = contextlib.nullcontext() if tap_options.get("detach") is False else torch.no_grad()
    with explain_failures(model), grad_mode:
        with tap(model, layers, capture=capture, stop_early=stop_early, **tap_options) as taps:
            run_model(model, inputs)
    view = taps.outputs if capture == "output" else taps.inputs
    return {name: view[name] for name in taps.names}


class FeatureExtractor(nn.Module):
    """Wrap ``model`` so that its forward returns ``{layer name: feature}``, gradients flowing.

    Like torchvision's ``create_feature_extractor`` but without tracing, so it works on any
    model; the forward stops after the last chosen layer (``stop_early=True``). Options are those
    of `layertap.tap`. Parameters of the layers that never run get no gradient (use
    ``find_unused_parameters=True`` under DDP, or ``stop_early=False``).

    >>> import torch, torchvision, layertap
    >>> backbone = layertap.FeatureExtractor(torchvision.models.resnet18(), ["layer3", "layer4"])
    >>> feats = backbone(torch.randn(2, 3, 64, 64))
    >>> feats["layer4"].requires_grad, tuple(feats["layer3"].shape)
    (True, (2, 256, 4, 4))
    """

    def __init__(
        self, model: nn.Module, layers: Layers, *, detach: bool = False, stop_early: bool = True, **tap_options: Any
    ) -> None:
        super().__init__()
        self.model = model
        self.layers = select(model, layers)
        self._options = dict(detach=detach, stop_early=stop_early, **tap_options)

    def forward(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        with explain_failures(self.model):
            with tap(self.model, self.layers, **self._options) as taps:
                self.model(*args, **kwargs)
        return {name: taps[name] for name in taps.names}
