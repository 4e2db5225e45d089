"""Models under Hugging Face accelerate's offloading: `cpu_offload`, `disk_offload` and
`dispatch_model` move weights in and out around each module's forward with hooks of their own.
layertap's taps, attention maps, op taps and Grad-CAM of the offloaded model must equal those of
the plain model it was copied from (a tiny random-weight ViT)."""

from __future__ import annotations

import copy
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

import layertap
from layertap.attention import attention
from layertap.cam import GradCAM

accelerate = pytest.importorskip("accelerate")
transformers = pytest.importorskip("transformers")

TOL = {"rtol": 1e-5, "atol": 1e-6}  # the same arithmetic on the same device: all but bit for bit
LAYERS = ["vit.layers.0.mlp", "vit.layers.1.layernorm_before", "classifier"]
OP = "vit.layers.1.attention:scaled_dot_product_attention"


@pytest.fixture(scope="module")
def plain() -> torch.nn.Module:
    torch.manual_seed(0)
    config = transformers.ViTConfig(
        image_size=32, patch_size=8, num_hidden_layers=2, hidden_size=32, num_attention_heads=2, intermediate_size=64, num_labels=5
    )
    return transformers.ViTForImageClassification(config).eval()


def cpu_offloaded(model: torch.nn.Module, folder: Path) -> torch.nn.Module:
    return accelerate.cpu_offload(model, execution_device="cpu")


def disk_offloaded(model: torch.nn.Module, folder: Path) -> torch.nn.Module:
    return accelerate.disk_offload(model, offload_dir=str(folder), execution_device="cpu")


def dispatched(model: torch.nn.Module, folder: Path) -> torch.nn.Module:
    device_map = {"vit.embeddings": "cpu", "vit.layers.0": "cpu", "vit.layers.1": "cpu", "vit.layernorm": "cpu", "classifier": "cpu"}
    return accelerate.dispatch_model(model, device_map=device_map, main_device="cpu", force_hooks=True)


OFFLOADS: dict[str, Callable[[torch.nn.Module, Path], torch.nn.Module]] = {"cpu_offload": cpu_offloaded, "disk_offload": disk_offloaded, "dispatch_model": dispatched}


@pytest.fixture(params=list(OFFLOADS))
def offloaded(request, plain, tmp_path) -> torch.nn.Module:
    model = OFFLOADS[request.param](copy.deepcopy(plain), tmp_path)
    assert any(hasattr(m, "_hf_hook") for m in model.modules()), "accelerate put no hooks on the model"
    if request.param != "dispatch_model":  # the weights are elsewhere between forwards: only the hooks bring them in
        assert {p.device.type for p in model.parameters()} == {"meta"}
    return model


def images() -> torch.Tensor:
    return torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(1))


def test_tap_outputs_and_op_equal_the_plain_model(plain, offloaded):
    x = images()
    with torch.no_grad(), layertap.tap(plain, [*LAYERS, OP]) as want, layertap.tap(offloaded, [*LAYERS, OP]) as got:
        plain(x)
        offloaded(x)
    for name in [*LAYERS, OP]:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=name)


def test_attention_maps_equal_the_plain_model(plain, offloaded):
    x = images()
    with torch.no_grad():
        with attention(plain, heads="all") as want:
            plain(x)
        with attention(offloaded, heads="all") as got:
            offloaded(x)
    assert list(got) == list(want) and len(want) == 2
    for name in want:
        torch.testing.assert_close(got[name], want[name], **TOL, msg=name)


def test_gradcam_equals_the_plain_model(plain, offloaded):
    x = images()
    want = GradCAM(plain)(x)
    got = GradCAM(offloaded)(x)
    torch.testing.assert_close(got, want, **TOL)
