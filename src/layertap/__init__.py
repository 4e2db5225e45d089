"""layertap: tap any layer of any PyTorch model — outputs, inputs, gradients — without editing it.

>>> import torch, torchvision, layertap
>>> model = torchvision.models.resnet18().eval()
>>> feats = layertap.extract(model, torch.randn(2, 3, 64, 64), ["layer2", "layer4"], reduce="mean")
>>> {name: tuple(f.shape) for name, f in feats.items()}
{'layer2': (2, 128), 'layer4': (2, 512)}
"""

from .errors import (
    LayerForwardError,
    LayerNotFoundError,
    LayerNotRunError,
    LayertapError,
    MissingExtraError,
    TapError,
)
from .features import FeatureExtractor, extract
from .select import select
from .tap import Inputs, Tap, tap

__version__ = "0.1.0"

__all__ = [
    "tap",
    "Tap",
    "Inputs",
    "select",
    "extract",
    "FeatureExtractor",
    "LayertapError",
    "LayerNotFoundError",
    "LayerNotRunError",
    "LayerForwardError",
    "TapError",
    "MissingExtraError",
]
