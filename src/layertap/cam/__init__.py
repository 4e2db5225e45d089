"""Class-activation heatmaps: the Grad-CAM family on any model, batched, any activation layout.

>>> import torch, torchvision, layertap
>>> model = torchvision.models.resnet18().eval()
>>> cam = layertap.cam.GradCAM(model, "layer4")
>>> maps = cam(torch.randn(2, 3, 64, 64), targets=[3, 7])   # one class per image
>>> tuple(maps.shape), bool(maps.min() >= 0), bool(maps.max() <= 1)
((2, 64, 64), True, True)

How it works, and the conventions it shares with pytorch-grad-cam (maps agree to 1e-5):

- The forward runs without autograd up to the first chosen layer; there the graph starts (a fresh
  leaf that requires grad), so the backward covers only the layers after it: a late layer costs
  about one inference forward, not a training step.
- Activations of any layout become ``[B, C, *grid]`` maps: channels-first maps (``[B, C, H, W]``,
  1-D ``[B, C, L]``, 3-D ``[B, C, D, H, W]``), channels-last maps (Swin's ``[B, H, W, C]``) and
  token sequences ``[B, T, D]`` whose patch grid is inferred from the input size, the first
  ``T - h*w`` tokens being prefix tokens (class, distillation, register tokens). See `infer_layout`.
- Each layer's map is ReLU'd, min-max normalised per image (``(m - min) / (max - min + 1e-7)``),
  upsampled (bilinear, ``align_corners=False``, as ``cv2.resize``) to the input size; the layers'
  maps are averaged and normalised again.
- ``targets=None`` scores each image's top class; the scores of the batch are summed before the
  backward, as pytorch-grad-cam does (images stay independent unless the model mixes them, e.g.
  batch norm in ``train()`` mode).
- ``batch_size=`` bounds the images per forward (a progress bar counts them); the methods return
  plain tensors, and `show` draws them over their images as a grid a notebook displays.

The files, each importing only ones above it in this list:

- ``layout.py``: `MapLayout` and `infer_layout`, how an activation maps onto the input.
- ``targets.py``: `pick_logits` and the classes to score (``targets=``).
- ``default_layer.py``: the rule that picks a layer when none is given, and its probe.
- ``base.py``: `HeatmapMethod`, the contract every method keeps; `CAM`, the Grad-CAM family's
  base (the forward that starts the graph at the layer, the maps, the zero-gradient warning);
  `normalize` and `upsample`.
- ``methods.py``: the methods (`GradCAM` ... `ScoreCAM`) and `METHODS`, their names.
- ``rollout.py``: attention rollout for vision transformers (`layertap.rollout`).
- ``show.py``: `show` and `HeatmapGrid`, maps drawn over their images.
- ``pointing.py``: the pointing game on the shapes images (``python -m layertap.cam.pointing``).
"""

from ..errors import LayoutError
from . import rollout  # noqa: F401  (layertap.cam.rollout with the package; pointing is imported by name, so ``-m`` runs it clean)
from .base import CAM, HeatmapMethod, ZeroGradientWarning, normalize, upsample
from .layout import MapLayout, infer_layout
from .methods import METHODS, EigenCAM, GradCAM, GradCAMPlusPlus, HiResCAM, LayerCAM, ScoreCAM, XGradCAM
from .show import HeatmapGrid, show
from .targets import Targets, pick_logits

__all__ = [
    "CAM",
    "METHODS",
    "EigenCAM",
    "GradCAM",
    "GradCAMPlusPlus",
    "HeatmapGrid",
    "HeatmapMethod",
    "HiResCAM",
    "LayerCAM",
    "LayoutError",
    "MapLayout",
    "ScoreCAM",
    "Targets",
    "XGradCAM",
    "ZeroGradientWarning",
    "infer_layout",
    "normalize",
    "pick_logits",
    "show",
    "upsample",
]
