"""Grad-CAM on an empty batch, under ``torch.no_grad()`` and on inference tensors (issue 23, item 13).

An empty batch is a one-line `ArgumentError`. Under ``no_grad`` the methods run as outside it: the
graph they start after the chosen layer is their own (the forward before it runs without autograd
in any case), so the maps equal, bit for bit, those of the same call outside ``no_grad``, and a
plain-autograd Grad-CAM computed here by hand.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from layertap import ArgumentError, TapError
from layertap.cam import METHODS, GradCAM


@pytest.fixture
def model():
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1), nn.ReLU(), nn.Conv2d(8, 8, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(8, 5),
    ).eval()


def by_hand(model: nn.Module, x: torch.Tensor, layer: int) -> torch.Tensor:
    """Grad-CAM of each image's top class at ``model[layer]``, with one forward hook and autograd."""
    acts = []
    handle = model[layer].register_forward_hook(lambda _m, _a, out: acts.append(out))
    with torch.enable_grad():
        logits = model(x)
    handle.remove()
    score = logits.gather(1, logits.argmax(1, keepdim=True)).sum()
    (grad,) = torch.autograd.grad(score, acts[0])
    raw = (grad.mean((2, 3), keepdim=True) * acts[0]).sum(1).clamp(min=0).detach()

    def normalize(m):
        low = m.flatten(1).amin(1).view(-1, 1, 1)
        m = m - low
        return m / (1e-7 + m.flatten(1).amax(1).view(-1, 1, 1))

    up = F.interpolate(normalize(raw)[:, None], size=x.shape[2:], mode="bilinear", align_corners=False)[:, 0]
    return normalize(up)


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("layer", ["3", None])
def test_an_empty_batch_is_a_one_line_error(model, method, layer):
    cam = METHODS[method](model, layer, progress=False)
    with pytest.raises(ArgumentError) as err:
        cam(torch.randn(0, 3, 16, 16))
    msg = str(err.value)
    assert msg.startswith("got 0 samples (inputs of shape [0, 3, 16, 16])") and "\n" not in msg
    assert "at least one image" in msg


@pytest.mark.parametrize("layer", ["3", None])
def test_under_no_grad_the_maps_are_those_outside_it(model, layer):
    x = torch.randn(2, 3, 16, 16)
    outside = GradCAM(model, layer)(x)
    with torch.no_grad():
        cam = GradCAM(model, layer)
        inside = cam(x)
        assert not torch.is_grad_enabled()  # the caller's mode, as it was
    assert cam.layers == ["3"]
    assert torch.equal(inside, outside)
    torch.testing.assert_close(inside, by_hand(model, x, 3), rtol=1e-5, atol=1e-6)


def test_inputs_made_under_inference_mode(model):
    with torch.inference_mode():
        x = torch.randn(2, 3, 16, 16)
    torch.testing.assert_close(GradCAM(model)(x), by_hand(model, x.clone(), 3), rtol=1e-5, atol=1e-6)


def test_inside_inference_mode_is_a_one_line_error(model):
    with torch.inference_mode(), pytest.raises(TapError, match=r"^heatmaps need autograd: call the method outside"):
        GradCAM(model, "3")(torch.randn(1, 3, 16, 16))


@pytest.mark.parametrize("method", sorted(METHODS))
@pytest.mark.parametrize("layer", ["3", None])
def test_one_image_without_a_batch_dim_is_a_one_line_error(model, method, layer):
    image = torch.randn(3, 16, 16)
    with pytest.raises(ArgumentError) as err:
        METHODS[method](model, layer, progress=False)(image)
    msg = str(err.value)
    assert msg.startswith(f"{METHODS[method].__name__} expects a batch [B, C, H, W]; the model failed at layer ")
    assert msg.endswith("on inputs of shape [3, 16, 16]: for one image, add a batch dimension with x[None]")
    assert "\n" not in msg
    # the advice works: the same image as a batch of one gives its map
    assert METHODS[method](model, layer, progress=False)(image[None]).shape == (1, 16, 16)


def test_a_batch_of_1d_signals_is_not_mistaken_for_one_image():
    torch.manual_seed(0)
    net = nn.Sequential(nn.Conv1d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool1d(1), nn.Flatten(), nn.Linear(4, 2))
    x = torch.randn(2, 3, 16)  # [B, C, L]
    acts = []
    handle = net[1].register_forward_hook(lambda _m, _a, out: acts.append(out))
    logits = net(x)
    handle.remove()
    (grad,) = torch.autograd.grad(logits.gather(1, logits.argmax(1, keepdim=True)).sum(), acts[0])
    raw = (grad.mean(2, keepdim=True) * acts[0]).sum(1).clamp(min=0).detach()
    raw = raw - raw.amin(1, keepdim=True)
    want = raw / (1e-7 + raw.amax(1, keepdim=True))  # already at the input's length: no resize
    torch.testing.assert_close(GradCAM(net, "1")(x), want, rtol=1e-5, atol=1e-6)
