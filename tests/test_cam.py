"""Heatmaps (layertap.cam) against pytorch-grad-cam, on CNNs, ViTs, Swin and Hugging Face models."""

from collections import OrderedDict

import numpy as np
import pytest
import torch
import torchvision
from torch import nn

import layertap
from conftest import hook_state
from layertap.cam import (
    METHODS,
    EigenCAM,
    GradCAM,
    LayoutError,
    MapLayout,
    ScoreCAM,
    ZeroGradientWarning,
    infer_layout,
)
from layertap.errors import LayerForwardError, LayertapError

TOL = 1e-5  # maps are in [0, 1]: absolute difference after normalisation


def reference(method: str, model: nn.Module, layers: list, x, targets, reshape=None) -> np.ndarray:
    """pytorch-grad-cam's map (it calls model.eval(): give it an eval model or a copy)."""
    # the reference (grad-cam, a test dependency), imported when used: its import (OpenCV, SciPy,
    # Matplotlib) costs seconds in every pytest worker that collects this file
    import pytorch_grad_cam as P
    from pytorch_grad_cam.utils.model_targets import ClassifierOutputTarget

    cam = getattr(P, method)(model, target_layers=layers, reshape_transform=reshape)
    try:
        return cam(x, [ClassifierOutputTarget(t) for t in targets])
    finally:
        cam.activations_and_grads.release()


def tokens_to_maps(prefix: int, grid: tuple[int, int]):
    """The reshape_transform users write by hand for pytorch-grad-cam."""

    def reshape(t):
        return t[:, prefix:].reshape(t.shape[0], *grid, t.shape[-1]).permute(0, 3, 1, 2)

    return reshape


def random_head(model: nn.Module, head: nn.Linear) -> nn.Module:
    # torchvision's ViT zero-initialises its head: every gradient would be zero
    torch.manual_seed(1)
    nn.init.normal_(head.weight, std=0.5)
    return model.eval()


@pytest.fixture(scope="module")
def resnet50():
    torch.manual_seed(0)
    return torchvision.models.resnet50().eval()


@pytest.fixture(scope="module")
def batch():
    torch.manual_seed(0)
    return torch.randn(4, 3, 128, 128), [1, 20, 300, 999]


@pytest.fixture(scope="module")
def small_vit():
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(
        image_size=64, patch_size=16, num_layers=2, num_heads=2, hidden_dim=64, mlp_dim=128, num_classes=10
    )
    return random_head(model, model.heads.head)


# ---------------------------------------------------------------------------------- parity
@pytest.mark.parametrize(
    "method", ["GradCAM", "GradCAMPlusPlus", "XGradCAM", "HiResCAM", "LayerCAM", "EigenCAM"]
)
def test_resnet50_matches_pytorch_grad_cam_per_image_targets(resnet50, batch, method):
    x, targets = batch
    before = hook_state(resnet50)
    ours = getattr(layertap.cam, method)(resnet50, "layer4")(x, targets)
    assert hook_state(resnet50) == before
    assert ours.shape == (4, 128, 128) and ours.dtype == torch.float32
    expected = reference(method, resnet50, [resnet50.layer4], x, targets)
    np.testing.assert_allclose(ours.numpy(), expected, atol=TOL, rtol=0)
    assert float(ours.min()) == 0 and float(ours.max()) == pytest.approx(1, abs=1e-6)


def test_several_layers_are_averaged_as_pytorch_grad_cam_does(resnet50, batch):
    x, targets = batch
    ours = GradCAM(resnet50, ["layer3", "layer4"])(x, targets)
    expected = reference("GradCAM", resnet50, [resnet50.layer3, resnet50.layer4], x, targets)
    np.testing.assert_allclose(ours.numpy(), expected, atol=TOL, rtol=0)


def test_scorecam_matches_pytorch_grad_cam():
    # one forward per channel and image: a 128-channel layer of resnet18 keeps it short
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    x, targets = torch.randn(2, 3, 32, 32), [5, 700]
    ours = ScoreCAM(model, "layer2.0.conv1", batch_size=48)(x, targets)
    expected = reference("ScoreCAM", model, [model.layer2[0].conv1], x, targets)
    np.testing.assert_allclose(ours.numpy(), expected, atol=TOL, rtol=0)


def test_eigencam_follows_the_activation_not_its_negative():
    # the SVD sign is arbitrary: ours orients the component so that its channel weights sum positive,
    # so a blob that every channel shows (scaled, plus noise) is bright, never dark
    torch.manual_seed(0)
    model = nn.Sequential(nn.Identity(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(16, 3))
    blob = torch.zeros(16, 16)
    blob[3:6, 9:12] = 1.0
    x = torch.rand(2, 16, 1, 1) * blob + 0.05 * torch.randn(2, 16, 16, 16)
    maps = EigenCAM(model, "0")(x)
    assert maps.shape == (2, 16, 16)
    assert bool((maps[:, 3:6, 9:12].mean((1, 2)) > 0.8).all())
    assert bool((maps.mean((1, 2)) < 0.3).all())


# ---------------------------------------------------------------------------------- default layer
def test_default_layer_on_resnet50_is_layer4(resnet50, batch):
    x, targets = batch[0][:2, :, :64, :64], batch[1][:2]
    cam = GradCAM(resnet50)
    assert cam.layers is None
    before = hook_state(resnet50)
    maps = cam(x, targets)
    assert hook_state(resnet50) == before
    assert cam.layers == ["layer4"]
    assert torch.equal(maps, GradCAM(resnet50, "layer4")(x, targets))
    assert cam.target_classes == targets


def test_vit_b_16_default_layer_and_tokens_without_reshape():
    torch.manual_seed(0)
    model = torchvision.models.vit_b_16()
    model = random_head(model, model.heads.head)
    x = torch.randn(1, 3, 224, 224)
    cam = GradCAM(model)
    ours = cam(x, [7])
    name = "encoder.layers.encoder_layer_11.ln_1"  # the last block's input norm, as pytorch-grad-cam advises
    assert cam.layers == [name]
    assert cam.layouts[name] == MapLayout("tokens", (14, 14), prefix=1)
    assert float(ours.amax()) == pytest.approx(1, abs=1e-6)  # (parity on tokens: the small ViT below)


def test_vit_batch_with_per_image_targets_matches_reference(small_vit):
    x, targets = torch.randn(3, 3, 64, 64), [0, 4, 9]
    name = "encoder.layers.encoder_layer_1.ln_1"
    for method in ("GradCAM", "LayerCAM"):
        ours = getattr(layertap.cam, method)(small_vit, name)(x, targets)
        layer = small_vit.encoder.layers.encoder_layer_1.ln_1
        expected = reference(method, small_vit, [layer], x, targets, reshape=tokens_to_maps(1, (4, 4)))
        np.testing.assert_allclose(ours.numpy(), expected, atol=TOL, rtol=0)


def test_vit_final_norm_warns_zero_gradient_and_names_the_fix(small_vit):
    x = torch.randn(2, 3, 64, 64)
    with pytest.warns(ZeroGradientWarning, match="prefix .*class.* tokens.*'encoder.layers.encoder_layer_1.ln_1'"):
        maps = GradCAM(small_vit, "encoder.ln")(x)
    assert float(maps.abs().sum()) == 0


def test_timm_vit_with_register_tokens():
    import timm

    model = timm.create_model("vit_small_patch14_reg4_dinov2", pretrained=False, img_size=70).eval()
    x, targets = torch.randn(2, 3, 70, 70), [3, 11]
    cam = GradCAM(model)
    ours = cam(x, targets)
    name = f"blocks.{len(model.blocks) - 1}.norm1"
    assert cam.layers == [name]
    # timm's own record of the layout is the reference: 1 class + 4 register tokens, 5x5 patches
    grid, prefix = tuple(model.patch_embed.grid_size), model.num_prefix_tokens
    assert cam.layouts[name] == MapLayout("tokens", grid, prefix=prefix) == MapLayout("tokens", (5, 5), prefix=5)
    expected = reference("GradCAM", model, [model.blocks[-1].norm1], x, targets, reshape=tokens_to_maps(prefix, grid))
    np.testing.assert_allclose(ours.numpy(), expected, atol=TOL, rtol=0)


def test_swin_channels_last_maps():
    torch.manual_seed(0)
    model = torchvision.models.swin_t().eval()
    x, targets = torch.randn(2, 3, 96, 96), [2, 8]
    cam = GradCAM(model, "features.7")
    ours = cam(x, targets)
    assert cam.layouts["features.7"] == MapLayout("channels_last", (3, 3))
    expected = reference("GradCAM", model, [model.features[7]], x, targets, reshape=lambda t: t.permute(0, 3, 1, 2))
    np.testing.assert_allclose(ours.numpy(), expected, atol=TOL, rtol=0)


def test_hugging_face_model_output_is_scored_through_logits():
    import transformers

    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=32, patch_size=8, num_hidden_layers=2, hidden_size=32, num_attention_heads=2,
        intermediate_size=64, num_labels=5,
    )
    model = transformers.ViTForImageClassification(config).eval()
    x = torch.randn(3, 3, 32, 32)
    cam = GradCAM(model)
    ours = cam(x)
    with torch.no_grad():
        top = model(x).logits.argmax(1).tolist()
    assert cam.target_classes == top
    (name,) = cam.layers
    assert name.endswith("1.layernorm_before"), name
    assert cam.layouts[name] == MapLayout("tokens", (4, 4), prefix=1)

    class Logits(nn.Module):  # what pytorch-grad-cam users must write for a ModelOutput
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x):
            return self.inner(x).logits

    layer = dict(model.named_modules())[name]
    expected = reference("GradCAM", Logits(model), [layer], x, top, reshape=tokens_to_maps(1, (4, 4)))
    np.testing.assert_allclose(ours.numpy(), expected, atol=TOL, rtol=0)


def test_hugging_face_wrapper_with_pooled_output_is_not_chosen_and_warns():
    import transformers

    config = transformers.ResNetConfig(embedding_size=16, hidden_sizes=[16, 32], depths=[1, 1], num_labels=5)
    model = transformers.ResNetForImageClassification(config).eval()
    x = torch.randn(2, 3, 32, 32)
    cam = GradCAM(model)
    assert float(cam(x).amax()) > 0
    assert cam.layers == ["resnet.encoder"]
    # ResNetModel pools its last map inside itself: the head never sees its returned map
    with pytest.warns(ZeroGradientWarning, match="pooled output.*'resnet.encoder' gets a gradient"):
        GradCAM(model, "resnet")(x)


class UnusedMaps(nn.Module):
    """After each conv a map that is never used (as DLA's ``level4.project``), then a global pool."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(3, 8, 3, stride=2, padding=1)
        self.unused1 = nn.Conv2d(8, 8, 1)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.unused2 = nn.Conv2d(16, 16, 1)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        x = self.conv1(x).relu()
        self.unused1(x)
        x = self.conv2(x).relu()
        self.unused2(x.detach())  # (a side output: nothing flows back to the input through it)
        return self.head(x.mean((2, 3)))


@pytest.mark.parametrize("method", [GradCAM, EigenCAM])
def test_default_layer_never_takes_an_unused_map(method):
    # the unused maps used to pass for a layer that gathers the map (Grad-CAM chose conv1) or for
    # the last map (gradient-free methods chose unused2): only outputs the score depends on count
    cam = method(UnusedMaps().eval())
    cam(torch.randn(2, 3, 32, 32))
    assert cam.layers == ["conv2"]


def test_default_layer_skips_class_score_maps_and_dropout():
    # SqueezeNet's head: a 1x1 conv to one channel per class, ReLU, global pool; its maps are class
    # scores (only the target's channel gets a gradient), and the Dropout before returns its input
    torch.manual_seed(0)
    features = nn.Sequential(nn.Conv2d(3, 8, 3, stride=2, padding=1), nn.ReLU())
    classifier = nn.Sequential(nn.Dropout(), nn.Conv2d(8, 5, 1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    model = nn.Sequential(OrderedDict(features=features, classifier=classifier)).eval()
    cam = GradCAM(model)
    cam(torch.randn(2, 3, 32, 32), [1, 3])
    assert cam.layers == ["features"]


class ClassAttention(nn.Module):
    """CaiT's class attention: the class token's query reads keys and values of every token."""

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.q, self.k, self.v = nn.Linear(dim, dim), nn.Linear(dim, dim), nn.Linear(dim, dim)

    def forward(self, x):
        attn = (self.q(x[:, :1]) @ self.k(x).transpose(1, 2)).softmax(-1)
        return attn @ self.v(x)


class ClassTokenModel(nn.Module):
    def __init__(self, dim: int = 16) -> None:
        super().__init__()
        self.embed = nn.Conv2d(3, dim, 8, stride=8)
        self.cls = nn.Parameter(torch.randn(1, 1, dim))
        self.norm = nn.LayerNorm(dim)
        self.attn = ClassAttention(dim)
        self.head = nn.Linear(dim, 4)

    def forward(self, x):
        tokens = self.embed(x).flatten(2).transpose(1, 2)
        tokens = torch.cat([self.cls.expand(len(x), -1, -1), tokens], 1)
        return self.head(self.attn(self.norm(tokens))[:, 0])


def test_default_layer_is_the_input_of_the_attention_not_its_value_projection():
    # k and v are the last maps that flow, but they are computed inside the step that gathers
    # the patches into the class token: the layer is that step's input
    torch.manual_seed(0)
    cam = GradCAM(ClassTokenModel().eval())
    cam(torch.randn(2, 3, 32, 32))
    assert cam.layers == ["norm"]
    assert cam.layouts["norm"] == MapLayout("tokens", (4, 4), prefix=1)


def test_gradient_free_default_layer_without_any_gradient():
    # torchvision's untrained ViT zero-initialises its head: no map flows into the score. Grad-CAM
    # has nothing to explain; EigenCAM needs no gradient and takes the last map the backward reaches
    torch.manual_seed(0)
    model = torchvision.models.VisionTransformer(
        image_size=32, patch_size=16, num_layers=1, num_heads=2, hidden_dim=16, mlp_dim=32, num_classes=3
    ).eval()
    x = torch.randn(1, 3, 32, 32)
    with pytest.raises(LayertapError, match="gradient of the score is zero at every layer"):
        GradCAM(model)(x)
    cam = EigenCAM(model)
    assert cam(x).shape == (1, 32, 32)
    assert cam.layers == ["encoder"]


# ---------------------------------------------------------------------------------- robustness
class SmallCNN(nn.Module):
    def __init__(self, inplace: bool) -> None:
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.relu = nn.ReLU(inplace=inplace)
        self.conv2 = nn.Conv2d(8, 16, 3, stride=2, padding=1)
        self.relu2 = nn.ReLU(inplace=inplace)
        self.head = nn.Linear(16, 5)

    def forward(self, x):
        x = self.relu2(self.conv2(self.relu(self.conv(x))))
        return self.head(x.mean((2, 3)))


def test_in_place_relu_after_the_layer():
    torch.manual_seed(0)
    model = SmallCNN(inplace=True).eval()
    plain = SmallCNN(inplace=False).eval()
    plain.load_state_dict(model.state_dict())
    x, targets = torch.randn(3, 3, 32, 32), [0, 2, 4]
    for layer in ("conv", "relu"):  # followed by an in-place ReLU / itself in place
        ours = GradCAM(model, layer)(x, targets)
        expected = reference("GradCAM", plain, [getattr(plain, layer)], x, targets)
        np.testing.assert_allclose(ours.numpy(), expected, atol=TOL, rtol=0)
    # pytorch-grad-cam keeps the activation that the in-place ReLU overwrote
    corrupted = reference("GradCAM", model, [model.conv], x, targets)
    assert np.abs(corrupted - GradCAM(model, "conv")(x, targets).numpy()).max() > 0.01


def by_hand(model: nn.Module, layer: str, x: torch.Tensor, targets: list) -> np.ndarray:
    """Grad-CAM with a full backward (driven from the input, so no parameter gets a .grad)."""
    x = x.clone().requires_grad_()
    with layertap.tap(model, layer, capture=("output", "grad")) as t:
        torch.autograd.grad(model(x)[torch.arange(len(targets)), targets].sum(), x)
    a, g = t[layer].float(), t.grads[layer].float()
    raw = (g.mean((2, 3), keepdim=True) * a).sum(1).clamp(min=0).numpy()
    from pytorch_grad_cam.utils.image import scale_cam_image

    return scale_cam_image(scale_cam_image(raw, tuple(x.shape[:1:-1])))


def test_autocast_bfloat16_on_cpu(resnet50, batch):
    x, targets = batch[0][:2, :, :64, :64], batch[1][:2]  # CPU bfloat16 is slow: a small batch
    cam = GradCAM(resnet50, "layer4")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        maps = cam(x, targets)
        expected = by_hand(resnet50, "layer4", x, targets)
        with pytest.raises(TypeError, match="BFloat16"):  # pytorch-grad-cam cannot
            reference("GradCAM", resnet50, [resnet50.layer4], x, targets)
    assert cam.logits.dtype == torch.bfloat16  # autocast really ran the model
    assert maps.dtype == torch.float32
    np.testing.assert_allclose(maps.numpy(), expected, atol=TOL, rtol=0)


def test_train_mode_frozen_parameters_are_left_alone():
    torch.manual_seed(0)
    model = torchvision.models.resnet18().train()
    for p in model.layer1.parameters():
        p.requires_grad_(False)
    flags = [p.requires_grad for p in model.parameters()]
    hooks = hook_state(model)
    x, targets = torch.randn(3, 3, 64, 64), [1, 2, 3]
    ours = GradCAM(model, "layer4")(x, targets)
    assert all(m.training for m in model.modules())
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())
    assert hook_state(model) == hooks
    # batch norm uses the batch's statistics in train mode, in both
    np.testing.assert_allclose(ours.numpy(), by_hand(model, "layer4", x, targets), atol=TOL, rtol=0)


def test_the_graph_starts_at_the_layer(resnet50, batch):
    x, targets = batch
    seen = {}

    def record(name):
        def hook(module, args, output):
            seen.setdefault(name, torch.is_grad_enabled())

        return hook

    handles = [getattr(resnet50, name).register_forward_hook(record(name)) for name in ("layer1", "layer3", "fc")]
    try:
        GradCAM(resnet50, "layer4")(x[:1], targets[:1])
    finally:
        for h in handles:
            h.remove()
    assert seen == {"layer1": False, "layer3": False, "fc": True}


def test_no_hooks_left_after_a_failing_forward(resnet50):
    before = hook_state(resnet50)
    with pytest.raises(LayerForwardError, match="conv1"):
        GradCAM(resnet50, "layer4")(torch.randn(1, 4, 32, 32))
    assert hook_state(resnet50) == before


def test_inference_mode_is_refused(resnet50):
    with torch.inference_mode(), pytest.raises(LayertapError, match="inference_mode"):
        GradCAM(resnet50, "layer4")(torch.randn(1, 3, 32, 32))


# ---------------------------------------------------------------------------------- targets and outputs
def test_targets_forms(resnet50, batch):
    x = batch[0][:2, :, :64, :64]
    cam = GradCAM(resnet50, "layer4")
    with torch.no_grad():
        top = resnet50(x).argmax(1).tolist()
    top_maps = cam(x)
    assert cam.target_classes == top
    assert torch.equal(top_maps, cam(x, top))
    assert torch.equal(cam(x, torch.tensor(top)), top_maps)
    assert torch.equal(cam(x, 5), cam(x, [5, 5]))
    assert cam.target_classes == [5, 5]
    by_callable = cam(x, lambda out: out[:, 5])
    assert cam.target_classes is None
    torch.testing.assert_close(by_callable, cam(x, 5))
    with pytest.raises(LayertapError, match="3 targets for a batch of 2"):
        cam(x, [1, 2, 3])
    with pytest.raises(LayertapError, match="out of range.*1000 classes"):
        cam(x, 1000)
    with pytest.raises(LayertapError, match="one score per image"):
        cam(x, lambda out: out.sum())


class DictOutput(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = SmallCNN(inplace=False)

    def forward(self, x):
        logits = self.body(x)
        return {"aux": -logits, "logits": logits}


def test_dict_and_tuple_outputs_and_the_override():
    torch.manual_seed(0)
    model = DictOutput().eval()
    x = torch.randn(2, 3, 32, 32)
    plain = GradCAM(model.body, "conv2")(x, [1, 3])
    assert torch.equal(GradCAM(model, "body.conv2")(x, [1, 3]), plain)  # .logits, not the first leaf
    negated = GradCAM(model.body, "conv2")(x, lambda out: -out[:, 1])
    assert torch.equal(GradCAM(model, "body.conv2", output="aux")(x, [1, 1]), negated)
    assert torch.equal(GradCAM(model, "body.conv2", output=lambda o: o["aux"])(x, [1, 1]), negated)
    with pytest.raises(LayertapError, match="output="):
        GradCAM(model, "body.conv2", output="missing")(x)


# ---------------------------------------------------------------------------------- layouts
@pytest.mark.parametrize(
    "shape, size, expected",
    [
        ((2, 2048, 7, 7), (224, 224), MapLayout("channels_first", (7, 7))),
        ((2, 512, 4, 3), (100, 70), MapLayout("channels_first", (4, 3))),
        ((2, 7, 7, 768), (224, 224), MapLayout("channels_last", (7, 7))),
        ((2, 24, 24, 96), (96, 96), MapLayout("channels_last", (24, 24))),
        ((2, 197, 768), (224, 224), MapLayout("tokens", (14, 14), 1)),
        ((2, 198, 384), (224, 224), MapLayout("tokens", (14, 14), 2)),  # DeiT: class + distillation
        ((2, 261, 384), (224, 224), MapLayout("tokens", (16, 16), 5)),  # DINOv2 + 4 registers, patch 14
        ((2, 49, 768), (224, 224), MapLayout("tokens", (7, 7), 0)),  # no class token (Swin, HF)
        ((2, 1 + 14 * 7, 64), (224, 112), MapLayout("tokens", (14, 7), 1)),  # non-square input
        ((2, 16, 50), (200,), MapLayout("channels_first", (50,))),  # 1-D signal
        ((2, 8, 4, 8, 8), (16, 32, 32), MapLayout("channels_first", (4, 8, 8))),  # volume
    ],
)
def test_infer_layout(shape, size, expected):
    assert infer_layout(shape, size) == expected
    maps = expected.maps(torch.zeros(shape))
    assert maps.shape[2:] == expected.grid and maps.shape[:2] == (2, shape[-1] if expected.kind != "channels_first" else shape[1])


def test_layout_overrides_and_errors():
    assert infer_layout((2, 70, 32), (64, 64), grid=(8, 8)) == MapLayout("tokens", (8, 8), 6)
    assert infer_layout((2, 70, 32), (64, 64), prefix_tokens=6) == MapLayout("tokens", (8, 8), 6)
    assert infer_layout((2, 5, 5, 5), (64, 64), grid=(5, 5)) == MapLayout("channels_first", (5, 5))
    with pytest.raises(LayoutError, match="prefix_tokens=N"):
        infer_layout((2, 12, 12, 12, 12), (64, 64))
    with pytest.raises(LayoutError, match="does not fit"):
        infer_layout((2, 70, 32), (64, 64), grid=(9, 9))
    with pytest.raises(LayoutError, match="prefix_tokens"):
        infer_layout((2, 300, 64), (64, 64))  # 256 patches + 44 prefix: too many to guess
    # tokens as maps: the prefix tokens dropped, the patch tokens laid out row by row
    t = torch.arange(2 * 7 * 3, dtype=torch.float32).reshape(2, 7, 3)
    maps = MapLayout("tokens", (2, 3), 1).maps(t)
    assert torch.equal(maps, t[:, 1:].reshape(2, 2, 3, 3).permute(0, 3, 1, 2))


def test_unreadable_layer_names_the_fix(resnet50):
    with pytest.raises(LayoutError, match="layer 'fc'.*grid="):
        GradCAM(resnet50, "fc")(torch.randn(1, 3, 64, 64))


def test_one_dimensional_signals_and_volumes():
    torch.manual_seed(0)
    signal = nn.Sequential(nn.Conv1d(2, 8, 5, stride=4, padding=2), nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(8, 3))
    cam = GradCAM(signal)
    maps = cam(torch.randn(2, 2, 200), [0, 1])
    assert cam.layers == ["1"] and cam.layouts["1"] == MapLayout("channels_first", (50,))
    assert maps.shape == (2, 200) and float(maps.amax()) == pytest.approx(1, abs=1e-6)
    volume = nn.Sequential(nn.Conv3d(1, 4, 3, stride=2, padding=1), nn.ReLU(), nn.AdaptiveAvgPool3d(1), nn.Flatten(), nn.Linear(4, 3))
    maps = GradCAM(volume, "1")(torch.randn(2, 1, 8, 16, 16), [0, 1])
    assert maps.shape == (2, 8, 16, 16)


# ---------------------------------------------------------------------------------- overlays
def test_builtin_jet_is_matplotlibs():
    import matplotlib  # installed with grad-cam

    from layertap.overlay import JET, colorize

    expected = matplotlib.colormaps["jet"](np.linspace(0, 1, 256), bytes=True)[:, :3]
    np.testing.assert_array_equal(JET, expected)
    h = np.random.default_rng(0).random((9, 11))
    np.testing.assert_array_equal(colorize(h, JET), matplotlib.colormaps["jet"](h, bytes=True)[..., :3])


def test_overlay_and_grid(tmp_path):
    from PIL import Image

    from layertap.overlay import colorize

    image = Image.fromarray(np.random.default_rng(0).integers(0, 255, (32, 48, 3), dtype=np.uint8))
    heat = torch.rand(32, 48)
    assert np.array_equal(np.asarray(layertap.overlay(image, heat, alpha=0)), np.asarray(image))
    assert np.array_equal(np.asarray(layertap.overlay(image, heat, alpha=1)), colorize(heat))
    half = np.asarray(layertap.overlay(image, heat, alpha=0.5)).astype(int)
    np.testing.assert_allclose(half, (np.asarray(image).astype(int) + colorize(heat)) / 2, atol=1)
    small = layertap.overlay(image, torch.rand(4, 6))  # resized to the image
    assert small.size == (48, 32)
    grid = layertap.overlay_grid([image] * 3, [heat] * 3, columns=2, path=tmp_path / "grid.png")
    assert grid.size == (96, 64)
    assert Image.open(tmp_path / "grid.png").size == (96, 64)
    assert np.array_equal(np.asarray(grid)[32:, :48], np.asarray(layertap.overlay(image, heat)))
    with pytest.raises(LayertapError, match="alpha"):
        layertap.overlay(image, heat, alpha=2)
    with pytest.raises(LayertapError, match="one heatmap per image"):
        layertap.overlay_grid([image] * 2, [heat])


def test_methods_table_lists_every_method():
    assert set(METHODS.values()) == {getattr(layertap.cam, n) for n in
                                     ["GradCAM", "GradCAMPlusPlus", "XGradCAM", "HiResCAM", "LayerCAM", "EigenCAM", "ScoreCAM"]}
