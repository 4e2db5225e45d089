"""The Grad-CAM family: each method is what it makes of a layer's activation and gradient.

A method subclasses `layertap.cam.CAM` and defines either channel weights (`CAM._weights`: Grad-CAM,
Grad-CAM++, XGrad-CAM, Score-CAM) or the whole raw map (`CAM._raw_map`: HiResCAM, LayerCAM,
Eigen-CAM); the base does the rest. `METHODS` names them for the command line and the report.
To add one: a class here and its line in `METHODS`.
"""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from ..progress import progress_bar
from ..runtime import run_model, running
from ..select import Layers
from .base import CAM, _spatial, normalize, upsample
from .targets import pick_logits, score


class GradCAM(CAM):
    """Grad-CAM (Selvaraju et al. 2017): channels weighted by their mean gradient.

    >>> import torch, torchvision
    >>> maps = GradCAM(torchvision.models.resnet18().eval(), "layer4")(torch.randn(1, 3, 64, 64))
    >>> maps.shape
    torch.Size([1, 64, 64])
    """

    def _weights(self, a, g, call):
        return g.mean(_spatial(g))


class GradCAMPlusPlus(CAM):
    """Grad-CAM++ (Chattopadhyay et al. 2018, eq. 19): positive gradients weighted per position."""

    def _weights(self, a, g, call):
        g2 = g.pow(2)
        total = a.sum(_spatial(a), keepdim=True)
        alpha = g2 / (2 * g2 + total * g2 * g + 1e-6)
        alpha = torch.where(g != 0, alpha, torch.zeros_like(alpha))
        return (g.clamp(min=0) * alpha).sum(_spatial(g))


class XGradCAM(CAM):
    """XGrad-CAM (Fu et al. 2020): gradients weighted by the normalised activation."""

    def _weights(self, a, g, call):
        return (g * a / (a.sum(_spatial(a), keepdim=True) + 1e-7)).sum(_spatial(a))


class HiResCAM(CAM):
    """HiResCAM (Draelos & Carin 2020): the element-wise product of gradient and activation."""

    def _raw_map(self, a, g, call):
        return (g * a).sum(1)


class LayerCAM(CAM):
    """LayerCAM (Jiang et al. 2021): activations weighted by their positive gradient, per position."""

    def _raw_map(self, a, g, call):
        return (g.clamp(min=0) * a).sum(1)


class EigenCAM(CAM):
    """Eigen-CAM (Muhammad & Yeasin 2020): the first principal component of the activations.

    Gradient-free; ``targets`` only chooses what `logits`/`target_classes` report. SVD's sign is
    arbitrary (pytorch-grad-cam keeps LAPACK's): here the component is oriented so that its
    channel weights sum to a positive number, i.e. the map follows the overall activation.
    """

    uses_gradients = False

    def _raw_map(self, a, g, call):
        x = a.flatten(2).transpose(1, 2)  # [B, positions, C]
        x = x - x.mean(1, keepdim=True)
        _, _, vh = torch.linalg.svd(x, full_matrices=False)
        v = vh[:, 0]
        v = v * torch.where(v.sum(1, keepdim=True) < 0, -1.0, 1.0)
        return (x @ v[..., None]).reshape(a.shape[0], *a.shape[2:])


class ScoreCAM(CAM):
    """Score-CAM (Wang et al. 2020): each channel weighted by the score of the input masked by it.

    Gradient-free but costly: one forward per channel and image, ``batch_size`` masked copies
    at a time (and images, for the first forward). As in pytorch-grad-cam, each channel is
    upsampled with ``align_corners=True``, min-max scaled (epsilon 1e-8) and multiplied into the
    input; the masked scores are softmaxed over channels. The progress bar counts the masks.
    """

    uses_gradients = False

    def __init__(self, model: nn.Module, layer: Layers | None = None, *, batch_size: int = 32, **options: Any) -> None:
        super().__init__(model, layer, batch_size=batch_size, **options)

    def _weights(self, a, g, call):
        size = call.inputs.shape[2:]
        scores = torch.empty(a.shape[:2])
        step = self.batch_size
        # leave=False: beside the bar over batches of images, this one goes when its batch is done
        bar = progress_bar(a.shape[0] * a.shape[1], desc="ScoreCAM", unit="mask", enabled=self.progress, leave=False)
        with bar, running(self.model):
            for b, start in itertools.product(range(a.shape[0]), range(0, a.shape[1], step)):
                chunk = upsample(a[b : b + 1, start : start + step], size, align_corners=True)[0]
                masks = normalize(chunk, eps=1e-8)[:, None]  # pytorch-grad-cam's Score-CAM epsilon
                output = run_model(self.model, call.inputs[b : b + 1] * masks.to(call.inputs.dtype))
                targets = call.targets if callable(call.targets) else [call.targets[b]] * len(masks)
                scores[b, start : start + len(masks)] = score(pick_logits(output, self.output), targets).float().cpu()
                bar.update(len(masks))
        return scores.softmax(-1).to(a.device)


METHODS: dict[str, type[CAM]] = {
    "gradcam": GradCAM,
    "gradcam++": GradCAMPlusPlus,
    "xgradcam": XGradCAM,
    "hirescam": HiResCAM,
    "layercam": LayerCAM,
    "eigencam": EigenCAM,
    "scorecam": ScoreCAM,
}
