"""Attention rollout (Abnar & Zuidema, 2020): where a vision transformer's class token reads from.

>>> import torch, timm, layertap
>>> model = timm.create_model("vit_tiny_patch16_224", img_size=64, depth=2).eval()
>>> maps = layertap.rollout.AttentionRollout(model)(torch.randn(2, 3, 64, 64))
>>> tuple(maps.shape), bool(maps.min() >= 0), bool(maps.max() <= 1)
((2, 64, 64), True, True)

The problem, the rule and the cost:

- One layer's attention says which tokens a token mixes in *at that layer*; through a stack of
  layers with residual connections, information also flows along the skip path and through
  tokens that themselves mixed others in. Rollout follows both: each layer's heads are fused
  (mean, max or min), the identity is added for the residual path and rows are renormalised
  (``(A + I)`` over its row sums, which is ``0.5 A + 0.5 I`` for a softmax), and the layers'
  matrices are multiplied in order, ``R = A_L ... A_2 A_1``. The class token's row of ``R``
  over the patch tokens is the heatmap.
- The probabilities come from `layertap.attention.attention` (fused attention is recomputed
  beside the model, which runs unchanged), so any model it reads works: torchvision's and
  timm's ViTs, DeiT, DINOv2 with registers, Hugging Face ViT.
- The map is read on the patch grid with the same layout rules as the Grad-CAM family
  (`layertap.cam.infer_layout`: prefix tokens, class, distillation and register tokens, come
  first), then min-max normalised and upsampled to the input size as they are.
- Cost: one forward without autograd, plus ``[B, H, N, N]`` per layer held until the product.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import nn

from ..attention import attention
from ..errors import ArgumentError, LayerNotRunError, LayertapError, LayoutError
from ..runtime import run_model, running
from ..select import Layers
from .base import HeatmapMethod, normalize, upsample
from .layout import MapLayout, infer_layout
from .targets import Targets, pick_logits

HeadFusion = Literal["mean", "max", "min"]
HEAD_FUSIONS: tuple[str, ...] = ("mean", "max", "min")


def _check(head_fusion: str, discard_ratio: float) -> None:
    if head_fusion not in HEAD_FUSIONS:
        raise ArgumentError(f"head_fusion={head_fusion!r} is not one of {HEAD_FUSIONS}")
    if not 0 <= discard_ratio < 1:
        raise ArgumentError(f"discard_ratio={discard_ratio!r} must be in [0, 1): the fraction of each row's weights set to 0")


def attention_rollout(
    maps: Sequence[torch.Tensor],
    head_fusion: HeadFusion = "mean",
    discard_ratio: float = 0.0,
) -> torch.Tensor:
    """The rollout ``[B, N, N]`` of per-layer attention ``[B, H, N, N]``, first layer first.

    Each layer: heads fused by ``head_fusion``; then, if ``discard_ratio > 0``, the lowest
    ``int(N * discard_ratio)`` weights of each row are set to 0, except the weight on token 0
    (the class token), which is always kept, as in jacobgil's vit-explain (which instead drops
    the lowest of the whole matrix and spares only its first entry); then ``A + I``, each row
    divided by its sum. Computed in float32 at least.

    >>> uniform = torch.full((1, 2, 4, 4), 0.25)
    >>> attention_rollout([uniform, uniform])[0, 0]
    tensor([0.4375, 0.1875, 0.1875, 0.1875])
    """
    _check(head_fusion, discard_ratio)
    if not maps:
        raise ArgumentError("attention_rollout needs at least one layer's attention [B, H, N, N]")
    result: torch.Tensor | None = None
    for a in maps:
        if a.dim() != 4 or a.size(-1) != a.size(-2) or (result is not None and a.shape[-1] != result.shape[-1]):
            raise LayoutError(
                f"attention_rollout needs square maps [B, H, N, N] over the same N tokens in every layer; got "
                f"{list(a.shape)}" + ("" if result is None else f" after layers with N = {result.shape[-1]}")
            )
        a = a.to(torch.promote_types(a.dtype, torch.float32))
        fused = a.mean(1) if head_fusion == "mean" else a.amax(1) if head_fusion == "max" else a.amin(1)
        n = fused.size(-1)
        drop = int(n * discard_ratio)
        if drop:
            lowest = fused.topk(drop, -1, largest=False).indices
            hidden = torch.zeros_like(fused, dtype=torch.bool).scatter_(-1, lowest, True)
            hidden[..., 0] = False
            fused = fused.masked_fill(hidden, 0.0)
        mixed = fused + torch.eye(n, dtype=fused.dtype, device=fused.device)
        mixed = mixed / mixed.sum(-1, keepdim=True)
        result = mixed if result is None else mixed @ result
    assert result is not None
    return result


class AttentionRollout(HeatmapMethod):
    """Attention rollout heatmaps with the calling convention of `layertap.cam.GradCAM`.

    Args:
        model: a vision transformer; its mode and parameters are left as they are.
        layers: its attention modules (any `layertap.select` spec), first to last; ``None``
            takes every attention module `layertap.attention.attention` finds whose map is
            square (self-attention over all tokens; an attention-pooling head is left out).
        head_fusion, discard_ratio: as in `attention_rollout`.
        grid, prefix_tokens: override the token layout inference (`layertap.cam.infer_layout`).

    Call with ``inputs`` ``[B, C, H, W]``; returns maps ``[B, H, W]`` in ``[0, 1]``, float32.
    ``targets`` is accepted for the Grad-CAM convention and ignored: rollout does not depend on
    the class. The map is the rollout's class-token row (query 0) over the patch tokens; a model
    without prefix tokens uses the mean of all rows. After a call, `layers` names the modules
    used, `layout` the token layout and `rollout` holds ``[B, N, N]``; `logits` holds the
    model's scores when its output has them (else ``None``) and `target_classes` is ``None``.
    """

    _where = "layertap.rollout"  # as users reach it: the attribute of the package

    def __init__(
        self,
        model: nn.Module,
        layers: Layers | None = None,
        *,
        head_fusion: HeadFusion = "mean",
        discard_ratio: float = 0.0,
        grid: Sequence[int] | None = None,
        prefix_tokens: int | None = None,
    ) -> None:
        _check(head_fusion, discard_ratio)
        super().__init__(model, layers, grid=grid, prefix_tokens=prefix_tokens)
        self.head_fusion = head_fusion
        self.discard_ratio = discard_ratio
        self.layout: MapLayout | None = None
        self.rollout: torch.Tensor | None = None

    def _options(self) -> str:
        return f" head_fusion={self.head_fusion!r}"

    def __call__(self, inputs: torch.Tensor, targets: Targets = None) -> torch.Tensor:
        self._check_inputs(inputs)
        size = tuple(inputs.shape[2:])
        with running(self.model):
            with attention(self.model, self._spec, heads="all") as att:
                output = run_model(self.model, inputs)
        try:
            self.logits = pick_logits(output).detach()
        except LayertapError:  # a backbone without scores: the heatmap does not need them
            self.logits = None
        maps = {name: a for name, a in att.items() if a.size(-1) == a.size(-2)}
        if not maps:
            raise LayerNotRunError(
                f"no self-attention was recorded in {type(self.model).__name__}: pass layers= with its attention "
                "modules (their forward must call scaled_dot_product_attention or softmax, or be nn.MultiheadAttention)"
            )
        self.layers = list(maps)
        self.rollout = rollout = attention_rollout(list(maps.values()), self.head_fusion, self.discard_ratio)
        batch, tokens = rollout.shape[:2]
        try:
            layout = infer_layout((batch, tokens, 1), size, grid=self.grid, prefix_tokens=self.prefix_tokens)
        except LayoutError as e:
            raise LayoutError(f"attention rollout over {tokens} tokens: {e}") from None
        if layout.kind != "tokens":
            raise LayoutError(f"cannot read {tokens} tokens as a patch grid of an input of size {list(size)}: pass grid=")
        self.layout = layout
        row = rollout[:, 0] if layout.prefix else rollout.mean(1)
        heat = row[:, layout.prefix :].reshape(batch, *layout.grid)
        with torch.autocast(inputs.device.type, enabled=False):
            heat = upsample(normalize(heat.float())[:, None], size)[:, 0]
            return normalize(heat).to(inputs.device)
