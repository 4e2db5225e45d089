"""The layer Grad-CAM picks when none is named, on torchvision and timm classifiers (random weights).

Each row of `ZOO` gives the layer expected and why, and `after`: the modules that finish later
with a map that still flows into the score, and why each is not the layer (a projection inside
the attention that reads the chosen map, a per-class score map, a module that returns its input).
An independent reference (plain PyTorch hooks and one `torch.autograd.grad`, not the probe in
`layertap.cam`) checks that nothing else with a flowing map finishes after the chosen layer.
Inputs are small (at most 128 px, each model's minimum or near it): one image per model.
"""

from __future__ import annotations

import fnmatch
from typing import Any, NamedTuple

import pytest
import torch
import torchvision
from torch import nn

from conftest import hook_state
from layertap.cam import GradCAM, LayoutError, infer_layout


class Case(NamedTuple):
    source: str  # "tv" (torchvision.models) or "timm"
    name: str
    size: int  # the input's side: small, each model's minimum or near it
    layer: str  # the default layer expected
    why: str
    after: tuple[str, ...] = ()  # globs: maps finishing later that still flow, each explained in `why`
    options: dict[str, Any] | None = None  # for the constructor: a smaller img_size, ...
    scores: tuple[str, ...] = ()  # globs: maps finishing later that are class scores (one channel reached)
    windows: tuple[str, ...] = ()  # globs: maps finishing later padded around a 1x1 map (gradient at one position)


ZOO = [
    # the models the default layer used to get wrong
    Case("timm", "dla34", 64, "level5",
         "the last tree before the global pool (level4.project's output is never used: it gathers "
         "nothing, it is simply left over)"),
    Case("timm", "crossvit_tiny_240", 120, "blocks.2.fusion.1.norm1",
         "the small-patch branch (10x10, the whole input) as the last cross attention reads it: nearest "
         "the output; its key/value projections come after", ("blocks.2.fusion.1.attn.w[kv]",), {"img_size": 120}),
    Case("tv", "squeezenet1_0", 64, "features",
         "the last Fire module's map; classifier.1/.2 are class scores (one channel per class, only the "
         "target's gets a gradient), classifier.0 an eval Dropout returning features' map",
         ("classifier.0",), scores=("classifier.[12]",)),
    Case("tv", "squeezenet1_1", 64, "features", "as squeezenet1_0", ("classifier.0",), scores=("classifier.[12]",)),
    Case("timm", "volo_d1_224", 64, "norm",
         "the patch tokens the token-labelling aux head reads (a per-token linear class head, max over "
         "tokens, added to the class token's logits), as SqueezeNet's features; aux_head holds class "
         "scores, head_drop returns norm's output", ("head_drop",), {"img_size": 64}, scores=("aux_head",)),
    Case("timm", "cait_xxs24_224", 64, "blocks_token_only.1.norm1",
         "the input of the last class attention, where the class token reads the patches (ViT's last "
         "norm1); attn.k/attn.v are its projections", ("blocks_token_only.1.attn.[kv]",), {"img_size": 64}),
    Case("timm", "pit_ti_224", 64, "transformers.2.blocks.3.norm1",
         "the input of the last attention (the head reads the class token); the last stage's pooled "
         "map output is never used", ("transformers.2.blocks.3.attn.qkv",), {"img_size": 64}),
    # a broad set of common classifiers
    Case("tv", "resnet18", 64, "layer4", "the last stage, before the global pool"),
    Case("tv", "densenet121", 64, "features", "the final norm5 + ReLU map, before the global pool"),
    Case("tv", "mobilenet_v3_small", 64, "features", "the last conv block, before the global pool"),
    Case("tv", "efficientnet_b0", 64, "features", "the last conv block, before the global pool"),
    Case("tv", "regnet_y_400mf", 64, "trunk_output", "the last stage, before the global pool"),
    Case("tv", "shufflenet_v2_x0_5", 64, "conv5", "the last conv, before the functional mean"),
    Case("tv", "googlenet", 64, "inception5b",
         "the last Inception block, which joins its four branches", options={"init_weights": False}),
    Case("timm", "convnext_atto", 64, "stages",
         "the last stage; norm_pre is an Identity returning it (the head norms after pooling)", ("norm_pre",)),
    Case("timm", "regnetx_002", 64, "s4", "the last stage; final_conv is an Identity returning it", ("final_conv",)),
    Case("timm", "mobilenetv3_small_100", 64, "blocks", "the last block: the head pools before its conv"),
    Case("timm", "hrnet_w18_small", 64, "final_layer", "joins the four resolution branches, before the pool"),
    Case("timm", "vit_tiny_patch16_224", 64, "blocks.11.norm1",
         "the last block's input norm, as pytorch-grad-cam advises; qkv is the attention's projection",
         ("blocks.11.attn.qkv",), {"img_size": 64}),
    Case("timm", "deit_tiny_distilled_patch16_224", 64, "blocks.11.norm1",
         "as ViT, with class and distillation tokens", ("blocks.11.attn.qkv",), {"img_size": 64}),
    Case("timm", "swin_tiny_patch4_window7_224", 64, "norm", "the final norm (channels-last), before the pool",
         options={"img_size": 64}),
    Case("timm", "levit_128s", 128, "stages",
         "the last stage (2x2 tokens), which the head averages in a functional mean, not a module",
         options={"img_size": 128}),
    Case("timm", "levit_128s", 64, "stages.1",
         "at 64 px the last stage has one token: the input of the subsampling attention that leaves it "
         "(not its kv projection)", ("stages.2.downsample.attn_downsample.kv*",), {"img_size": 64}),
    Case("tv", "swin_t", 64, "permute",
         "the final norm's map laid channels-first for the pool (the same values as norm)"),
    Case("timm", "xcit_nano_12_p16_224", 64, "cls_attn_blocks.1.norm1",
         "the input of the last class-attention block, as CaiT", ("cls_attn_blocks.1.attn.[kv]",), {"img_size": 64}),
    Case("timm", "eva02_tiny_patch14_224", 70, "blocks.11",
         "the head averages the patch tokens of the last block (norm is an Identity, fc_norm comes "
         "after the pool)", ("norm",), {"img_size": 70}),
    Case("timm", "mobilevit_xxs", 64, "final_conv", "the 1x1 conv after the last MobileViT stage, before the pool"),
    Case("timm", "efficientvit_m0", 64, "stages.2.downsample.res1",
         "the last 2x2 map the gradient reaches: the input of the patch merging that leaves it (not the 1x1 "
         "expansion conv inside it, as ViT's qkv); the last stage's attentions are 4x4 windows padded around "
         "a 1x1 map, whose gradient reaches one position (not stages.1, which finishes before)",
         ("stages.2.downsample.patchmerge.conv1*",), windows=("stages.2.blocks.*.mixer.m.attn*",)),
]


# one image of at most 128 px gains nothing from intra-op threads; on two shared cores, two
# threads waiting for each other at every small op made this file 6x slower (84 s, not 13 s)
pytestmark = pytest.mark.usefixtures("one_thread")


def build(case: Case) -> nn.Module:
    torch.manual_seed(0)
    if case.source == "tv":
        return getattr(torchvision.models, case.name)(**(case.options or {})).eval()
    import timm

    return timm.create_model(case.name, pretrained=False, **(case.options or {})).eval()


def flowing_maps(model: nn.Module, x: torch.Tensor) -> list[tuple[str, int, int]]:
    """(name, channels reached, positions reached) of every module whose map's map part gets a
    non-zero gradient of the top class's score, in the order the modules (last) finish: the
    reference, with plain hooks."""
    outputs: dict[str, torch.Tensor] = {}

    def first_float(out: Any) -> tuple[torch.Tensor | None, Any]:
        if isinstance(out, torch.Tensor):
            return (out, lambda new: new) if out.is_floating_point() else (None, None)
        if isinstance(out, (tuple, list)):
            for i, item in enumerate(out):
                if isinstance(item, torch.Tensor) and item.is_floating_point():
                    return item, lambda new, i=i: type(out)([*out[:i], new, *out[i + 1 :]])
        return None, None

    def hook(name: str):
        def record(module, args, out):
            t, rebuild = first_float(out)
            if t is None or not t.requires_grad:
                return None
            outputs.pop(name, None)
            outputs[name] = t.clone()  # a node of its own, whatever in-place op comes next
            return rebuild(outputs[name])

        return record

    handles = [m.register_forward_hook(hook(n)) for n, m in model.named_modules() if n]
    try:
        logits = model(x.requires_grad_())
    finally:
        for h in handles:
            h.remove()
    names = list(outputs)
    grads = torch.autograd.grad(logits[0, logits[0].argmax()], [outputs[n] for n in names], allow_unused=True)
    found = []
    for name, grad in zip(names, grads):
        try:
            layout = infer_layout(grad.shape, x.shape[2:]) if grad is not None else None
        except LayoutError:
            continue
        if layout is not None and len(layout.grid) and layout.grid != (1,) * len(layout.grid):
            nonzero = layout.maps(grad)[0].ne(0).flatten(1)  # [C, positions]
            reached = int(nonzero.any(1).sum())
            if reached:
                found.append((name, reached, int(nonzero.any(0).sum())))
    return found


@pytest.mark.parametrize("case", ZOO, ids=[f"{c.name}@{c.size}" for c in ZOO])
def test_default_layer(case: Case):
    model = build(case)
    x = torch.randn(1, 3, case.size, case.size)
    hooks = hook_state(model)
    cam = GradCAM(model)
    maps = cam(x)
    assert hook_state(model) == hooks
    assert cam.layers == [case.layer], case.why
    assert maps.shape == (1, case.size, case.size) and bool(maps.isfinite().all())
    flowing = flowing_maps(model, x)
    names = [name for name, _, _ in flowing]
    assert case.layer in names, "the chosen layer's map must flow into the score"
    later = flowing[names.index(case.layer) + 1 :]

    def matches(name: str, globs: tuple[str, ...]) -> bool:
        return any(fnmatch.fnmatchcase(name, glob) for glob in globs)

    unexplained = [name for name, _, _ in later if not matches(name, case.after + case.scores + case.windows)]
    assert not unexplained, f"maps that flow finish after {case.layer!r}: {unexplained}"
    scores = {name: reached for name, reached, _ in later if matches(name, case.scores)}
    assert all(reached == 1 for reached in scores.values()), f"class scores get a gradient in one channel: {scores}"
    windows = {name: positions for name, _, positions in later if matches(name, case.windows)}
    assert bool(windows) == bool(case.windows), f"no map finishing later matches {case.windows}"
    assert all(p == 1 for p in windows.values()), f"a padded window's gradient reaches its one real position: {windows}"


def test_the_default_layer_of_a_model_in_training_mode_is_found_on_the_batch():
    """In training mode BatchNorm fails on one image whose map is 1 x 1 (resnet18's layer4 at 32 px),
    which a probe of one image was: the probe runs the call's first batch, and finds the layer
    eval mode finds; the heatmaps equal those of the layer named."""
    torch.manual_seed(0)
    model, x = torchvision.models.resnet18(), torch.randn(2, 3, 32, 32)
    found = GradCAM(model.eval(), progress=False)
    found(x, [1, 2])
    cam = GradCAM(model.train(), progress=False)
    maps = cam(x, [1, 2])
    assert cam.layers == found.layers == ["layer3"]
    torch.testing.assert_close(maps, GradCAM(model, "layer3", progress=False)(x, [1, 2]), rtol=0, atol=1e-6)
