"""layertap: tap any layer of any PyTorch model — outputs, inputs, gradients — without editing it.

>>> import torch, torchvision, layertap
>>> model = torchvision.models.resnet18().eval()
>>> feats = layertap.extract(model, torch.randn(2, 3, 64, 64), ["layer2", "layer4"], reduce="mean")
>>> {name: tuple(f.shape) for name, f in feats.items()}
{'layer2': (2, 128), 'layer4': (2, 512)}
"""

from . import cli as _cli  # first, and only the standard library: a Ctrl-C in the imports below ends the command in one line

if _cli.starting_command():
    _cli.quiet_start()

from . import attention, cam
from .allocator import tune_allocator
from .cam import rollout
from .errors import (
    ArgumentError,
    CorruptImageError,
    DataChangedError,
    DataError,
    LayerForwardError,
    LayerNotFoundError,
    LayerNotRunError,
    LayertapError,
    LayoutError,
    MissingExtraError,
    ModelLoadError,
    OutputError,
    RankFailedError,
    StoreError,
    StoreLockedError,
    TapError,
)
from .extract import extract_dataset, extract_tokens
from .extract.plan import Plan, plan
from .features import FeatureExtractor, extract
from .loading import load_model
from .modelinfo import ModelInfo, model_info
from .nonfinite import NonfiniteReport, find_nonfinite
from .overlay import overlay, overlay_grid
from .report import build_report
from .select import select
from .stats import LayerStats, StatsTable, stats
from .store import FeatureStore, TokenStore, open_features, open_tokens
from .summary import LayerTable, summary
from .tap import Inputs, Tap, tap
from .tokenloader import TokenLoader
from .watch import Watch, WatchWarning, watch

__version__ = "0.1.0"

__all__ = [
    "stats",
    "StatsTable",
    "tune_allocator",
    "watch",
    "Watch",
    "WatchWarning",
    "LayerStats",
    "find_nonfinite",
    "build_report",
    "NonfiniteReport",
    "tap",
    "Tap",
    "Inputs",
    "select",
    "extract",
    "FeatureExtractor",
    "extract_dataset",
    "extract_tokens",
    "plan",
    "Plan",
    "open_tokens",
    "TokenStore",
    "TokenLoader",
    "open_features",
    "FeatureStore",
    "StoreError",
    "summary",
    "LayerTable",
    "load_model",
    "model_info",
    "ModelInfo",
    "cam",
    "attention",
    "rollout",
    "overlay",
    "overlay_grid",
    "LayertapError",
    "LayerNotFoundError",
    "LayerNotRunError",
    "LayerForwardError",
    "TapError",
    "MissingExtraError",
    "ArgumentError",
    "StoreLockedError",
    "DataChangedError",
    "RankFailedError",
    "DataError",
    "CorruptImageError",
    "ModelLoadError",
    "OutputError",
    "LayoutError",
]
