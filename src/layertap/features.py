"""One-shot feature extraction: `extract` for a batch, `FeatureExtractor` as a trainable backbone."""

from __future__ import annotations

from typing import Any, Literal

from torch import nn

from .runtime import run_model, running
from .select import Layers, Selection, selection
from .tap import tap


def extract(
    model: nn.Module,
    inputs: Any,
    layers: Layers | Selection,
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
    ``reduce`` of a padded text batch given with its ``attention_mask`` pools each document's
    real tokens only, so its feature does not depend on its batch-mates. A layer that runs several
    times per forward (a shared ``ReLU``) gives its first call, whatever other layers are chosen
    (the forward may stop there), as torchvision's ``create_feature_extractor`` names it; pass
    ``keep="all"`` with ``stop_early=False`` for every call.

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
    # detach=False: the caller's autograd mode, so the values can carry gradients
    with running(model, grad=None if tap_options.get("detach") is False else False):
        with tap(model, selection(model, layers), capture=capture, stop_early=stop_early, **{"keep": "first", **tap_options}) as taps:
            run_model(model, inputs)
    view = taps.outputs if capture == "output" else taps.inputs
    return {name: view[name] for name in taps.names}


class FeatureExtractor(nn.Module):
    """Wrap ``model`` so that its forward returns ``{layer name: feature}``, gradients flowing.

    Like torchvision's ``create_feature_extractor`` but without tracing, so it works on any
    model; the forward stops after the last chosen layer (``stop_early=True``). Options are those
    of `layertap.tap`; a layer that runs several times per forward gives its first call, as in `extract`. Parameters of the layers that never run get no gradient (use
    ``find_unused_parameters=True`` under DDP, or ``stop_early=False``).

    >>> import torch, torchvision, layertap
    >>> backbone = layertap.FeatureExtractor(torchvision.models.resnet18(), ["layer3", "layer4"])
    >>> feats = backbone(torch.randn(2, 3, 64, 64))
    >>> feats["layer4"].requires_grad, tuple(feats["layer3"].shape)
    (True, (2, 256, 4, 4))
    """

    def __init__(
        self, model: nn.Module, layers: Layers | Selection, *, detach: bool = False, stop_early: bool = True, **tap_options: Any
    ) -> None:
        super().__init__()
        self.model = model
        self._selection = selection(model, layers)  # resolved once, for every forward
        self.layers = list(self._selection.names)
        self._options = {"keep": "first", **dict(detach=detach, stop_early=stop_early, **tap_options)}

    def forward(self, *args: Any, **kwargs: Any) -> dict[str, Any]:
        with running(self.model, grad=None):  # gradients flow
            chosen = self._selection
            if chosen.model is not self.model:  # a replica (nn.DataParallel) or a copy: its own modules
                chosen = selection(self.model, self.layers)
            with tap(self.model, chosen, **self._options) as taps:
                self.model(*args, **kwargs)
        return {name: taps[name] for name in taps.names}
