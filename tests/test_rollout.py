"""Attention rollout (layertap.rollout) against a hand-written reference from Hugging Face's eager
attentions, and on each vision-transformer family: torchvision, timm, DeiT, DINOv2 with registers."""

import copy

import pytest
import torch
import torch.nn.functional as F

from layertap.cam.rollout import AttentionRollout, attention_rollout
from layertap.errors import ArgumentError, LayerNotFoundError, LayoutError

TOL = 1e-6


def reference_rollout(attentions, head_fusion: str, discard_ratio: float) -> torch.Tensor:
    """Abnar & Zuidema's rollout written out plainly, image by image and row by row, in float64."""
    batch, _, n, _ = attentions[0].shape
    out = []
    for b in range(batch):
        result = torch.eye(n, dtype=torch.float64)
        for layer in attentions:
            heads = layer[b].double()
            fused = {"mean": heads.mean(0), "max": heads.max(0).values, "min": heads.min(0).values}[head_fusion]
            a = fused.clone()
            for i in range(n):
                order = sorted(range(n), key=lambda j: float(fused[i, j]))
                for j in order[: int(n * discard_ratio)]:
                    if j != 0:  # the class token's column is kept
                        a[i, j] = 0.0
            a = a + torch.eye(n, dtype=torch.float64)
            a = a / a.sum(1, keepdim=True)
            result = a @ result
        out.append(result)
    return torch.stack(out)


def reference_heatmap(rollout: torch.Tensor, prefix: int, grid: tuple, size: tuple) -> torch.Tensor:
    def minmax(m):
        m = m - m.flatten(1).min(1).values.view(-1, 1, 1)
        return m / (m.flatten(1).max(1).values.view(-1, 1, 1) + 1e-7)

    heat = minmax(rollout[:, 0, prefix:].reshape(-1, *grid).float())
    heat = F.interpolate(heat[:, None], size=size, mode="bilinear", align_corners=False)[:, 0]
    return minmax(heat)


@pytest.fixture(scope="module")
def hf_vit():
    from transformers import ViTConfig, ViTForImageClassification

    config = ViTConfig(image_size=32, patch_size=8, hidden_size=32, num_hidden_layers=3, num_attention_heads=2,
                       intermediate_size=64, num_labels=10)
    return ViTForImageClassification(config).eval().double()


@pytest.mark.parametrize(("head_fusion", "discard_ratio"), [("mean", 0.0), ("max", 0.5), ("min", 0.25)])
def test_rollout_equals_a_hand_written_reference_on_hf_eager_attentions(hf_vit, head_fusion, discard_ratio):
    x = torch.randn(2, 3, 32, 32, dtype=torch.float64)
    eager = copy.deepcopy(hf_vit)
    eager.set_attn_implementation("eager")
    with torch.no_grad():
        attentions = eager(pixel_values=x, output_attentions=True).attentions
    expected = reference_rollout(attentions, head_fusion, discard_ratio)
    torch.testing.assert_close(attention_rollout(attentions, head_fusion, discard_ratio), expected, atol=TOL, rtol=0)

    hf_vit.set_attn_implementation("sdpa")  # the heatmap: from the fused model, through layertap.attention
    rollout = AttentionRollout(hf_vit, head_fusion=head_fusion, discard_ratio=discard_ratio)
    maps = rollout(x)
    assert rollout.layers == [f"vit.layers.{i}.attention" for i in range(3)]
    torch.testing.assert_close(rollout.rollout, expected, atol=TOL, rtol=0)
    assert maps.dtype == torch.float32 and maps.shape == (2, 32, 32)
    # the map is min-max scaled in float32: a rounding of the rollout (float32 eps × its size) grows by
    # 1 / its range; a random ViT's rollout is nearly flat (a range of ~1e-2), so 1e-5 alone failed 1 run in 2
    row = expected[:, 0, 1:]
    spread = (row.amax(1) - row.amin(1)).min().item()
    tol = max(1e-5, 64 * torch.finfo(torch.float32).eps * row.abs().max().item() / spread)
    torch.testing.assert_close(maps, reference_heatmap(expected, 1, (4, 4), (32, 32)), atol=tol, rtol=0)


def _torchvision():
    import torchvision

    return torchvision.models.vit_b_16(image_size=32), 32, 1


def _timm(name: str, size: int, prefix: int, **kwargs):
    def make():
        import timm

        return timm.create_model(name, img_size=size, **kwargs), size, prefix

    return make


FAMILIES = {
    "torchvision vit_b_16": _torchvision,
    "timm vit": _timm("vit_tiny_patch16_224", 64, 1, depth=3),
    "timm deit distilled": _timm("deit_tiny_distilled_patch16_224", 64, 2, depth=3),
    "timm dinov2 with registers": _timm("vit_small_patch14_reg4_dinov2", 56, 5, depth=3),
}


@pytest.mark.parametrize("family", FAMILIES)
def test_families_shape_range_and_prefix_tokens(family):
    model, size, prefix = FAMILIES[family]()
    model.eval()
    x = torch.randn(2, 3, size, size)
    rollout = AttentionRollout(model)
    maps = rollout(x, targets=[1, 2])  # targets are ignored: rollout is class-agnostic
    assert maps.shape == (2, size, size) and maps.dtype == torch.float32
    assert bool(maps.min() >= 0) and bool(maps.max() <= 1) and not maps.isnan().any()
    assert rollout.layout is not None and rollout.layout.prefix == prefix
    assert rollout.layers is not None and len(rollout.layers) == (12 if "torchvision" in family else 3)
    torch.testing.assert_close(maps, rollout(x), atol=0, rtol=0)


def test_attention_pooling_is_left_out():
    import timm

    model = timm.create_model("vit_tiny_patch16_224", img_size=32, depth=2, global_pool="map", class_token=False).eval()
    rollout = AttentionRollout(model)
    maps = rollout(torch.randn(1, 3, 32, 32))
    assert rollout.layers == ["blocks.0.attn", "blocks.1.attn"]  # not attn_pool: its map is [B, H, 1, N]
    assert rollout.layout is not None and rollout.layout.prefix == 0  # no class token: the mean row
    assert maps.shape == (1, 32, 32)


def test_errors():
    import torchvision

    uniform = torch.full((1, 2, 4, 4), 0.25)
    with pytest.raises(ArgumentError, match="head_fusion"):
        attention_rollout([uniform], head_fusion="median")  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="discard_ratio"):
        AttentionRollout(torch.nn.Identity(), discard_ratio=1.0)
    with pytest.raises(LayoutError, match="same N"):
        attention_rollout([uniform, torch.full((1, 2, 5, 5), 0.2)])
    with pytest.raises(LayerNotFoundError, match="no attention module"):
        AttentionRollout(torchvision.models.resnet18())(torch.randn(1, 3, 32, 32))
    with pytest.raises(ArgumentError, match="inputs must be one tensor"):
        AttentionRollout(torch.nn.Identity())([torch.randn(1, 3, 8, 8)])  # type: ignore[arg-type]


def tiny_vit() -> torch.nn.Module:
    """A small torchvision ViT for the command line test (loaded as ``test_rollout:tiny_vit``)."""
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.VisionTransformer(32, 8, num_layers=2, num_heads=2, hidden_dim=32, mlp_dim=64, num_classes=5)


def test_layertap_cam_method_rollout_writes_the_same_maps(tmp_path):
    import numpy as np
    from PIL import Image

    from layertap.cli import run

    Image.fromarray((np.random.default_rng(0).random((32, 32, 3)) * 255).astype("uint8")).save(tmp_path / "a.png")
    argv = ["cam", "test_rollout:tiny_vit", str(tmp_path / "a.png"), "--method", "rollout", "--size", "32,32", "--out", str(tmp_path / "h")]
    assert run(argv) == 0
    saved = torch.from_numpy(np.load(tmp_path / "h" / "a.npy"))
    model = tiny_vit().eval()
    from layertap.images import load_image
    from layertap.modelinfo import IMAGENET_MEAN, IMAGENET_STD, ImageTransform

    x = ImageTransform((3, 32, 32), IMAGENET_MEAN, IMAGENET_STD, crop=True)(load_image(tmp_path / "a.png"))[None]
    torch.testing.assert_close(saved, AttentionRollout(model)(x)[0], rtol=0, atol=1e-6)
