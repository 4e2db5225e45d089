"""Class activation maps: the Grad-CAM family over one base class, attention rollout and the pointing game."""
# ruff: noqa: F401  (transitional: names the other packages import, until they import the submodules)

from . import pointing, rollout
from .core import (
    CAM,
    METHODS,
    EigenCAM,
    GradCAM,
    GradCAMPlusPlus,
    HeatmapGrid,
    HiResCAM,
    LayerCAM,
    Layout,
    LayoutError,
    ScoreCAM,
    XGradCAM,
    ZeroGradientWarning,
    infer_layout,
    pick_logits,
    show,
)

__all__ = [
    "CAM", "METHODS", "EigenCAM", "GradCAM", "GradCAMPlusPlus", "HeatmapGrid", "HiResCAM", "LayerCAM",
    "Layout", "LayoutError", "ScoreCAM", "XGradCAM", "ZeroGradientWarning", "infer_layout", "pick_logits", "show",
]
