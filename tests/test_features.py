"""One-shot helpers: extract() and FeatureExtractor, and failures that name the layer."""

import pytest
import torch
import torchvision
from torch import nn
from torchvision.models.feature_extraction import create_feature_extractor

import layertap
from conftest import hook_state
from layertap import LayerForwardError


class Untraceable(nn.Module):
    """Data-dependent control flow: torch.fx cannot trace this."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x, scale=1.0):
        h = self.a(x) * scale
        if h.sum() > 0:
            h = self.b(h)
        return self.head(h)


def test_extract_input_forms():
    model = Untraceable()
    torch.manual_seed(1)
    x = torch.randn(3, 4)
    ref = model.a(x).detach()
    assert torch.equal(layertap.extract(model, x, "a")["a"], ref)
    assert torch.equal(layertap.extract(model, (x, 2.0), "a")["a"], ref)
    by_kw = layertap.extract(model, {"x": x, "scale": 3.0}, ["a", "head"], stop_early=False)
    assert torch.equal(by_kw["a"], ref)
    assert by_kw["head"].shape == (3, 2)


def test_extract_stops_early_and_runs_without_grad():
    model = torchvision.models.resnet18().eval()
    ran = []
    model.fc.register_forward_hook(lambda *a: ran.append("fc"))
    out = layertap.extract(model, torch.randn(1, 3, 64, 64), "layer3")
    assert ran == [] and not out["layer3"].requires_grad
    assert layertap.extract(model, torch.randn(1, 3, 64, 64), "layer3", capture="input")["layer3"].shape == (1, 128, 8, 8)
    with pytest.raises(ValueError, match="for gradients use"):
        layertap.extract(model, torch.randn(1, 3, 64, 64), "layer3", capture="grad")


def test_extract_on_untraceable_model_fx_cannot_do():
    model = Untraceable()
    with pytest.raises(Exception):  # noqa: B017 - FX fails on data-dependent control flow, in any of several ways
        create_feature_extractor(model, return_nodes=["b"])
    nn.init.constant_(model.a.weight, 0.5)
    x = torch.ones(2, 4)  # h.sum() > 0: the branch through b runs
    feats = layertap.extract(model, x, ["a", "b"], stop_early=False)
    torch.testing.assert_close(feats["b"], model.b(model.a(x)).detach())
    with pytest.raises(layertap.LayerNotRunError, match="'b' is tapped but has no output"):
        layertap.extract(model, -x, ["a", "b"], stop_early=False)  # the branch is not taken


def test_feature_extractor_trains_like_torchvision_backbone():
    model = torchvision.models.resnet18().eval()
    layers = ["layer2", "layer4"]
    ours = layertap.FeatureExtractor(model, layers)
    theirs = create_feature_extractor(model, return_nodes=layers)
    x = torch.randn(2, 3, 64, 64)
    a, b = ours(x), theirs(x)
    assert list(a) == layers
    for name in layers:
        torch.testing.assert_close(a[name], b[name])
        assert a[name].requires_grad
    ga = torch.autograd.grad(sum(v.square().mean() for v in a.values()), model.layer2[0].conv1.weight)[0]
    gb = torch.autograd.grad(sum(v.square().mean() for v in b.values()), theirs.get_submodule("layer2.0.conv1").weight)[0]
    torch.testing.assert_close(ga, gb)
    assert hook_state(model) == hook_state(torchvision.models.resnet18())
    # it is an nn.Module: parameters and state_dict are the model's, one optimizer step works
    assert sum(p.numel() for p in ours.parameters()) == sum(p.numel() for p in model.parameters())
    opt = torch.optim.SGD(ours.parameters(), lr=0.1)
    before = model.layer2[0].conv1.weight.detach().clone()
    ours(x)["layer2"].mean().backward()
    opt.step()
    assert not torch.equal(before, model.layer2[0].conv1.weight)


def test_feature_extractor_rejects_unknown_layer_at_construction():
    with pytest.raises(layertap.LayerNotFoundError, match="layer5.*Closest names: layer"):
        layertap.FeatureExtractor(torchvision.models.resnet18(), ["layer5"])


def test_failure_names_the_layer_with_input_shapes_and_chains_the_cause():
    model = torchvision.models.resnet18().eval()
    with pytest.raises(LayerForwardError) as err:
        layertap.extract(model, torch.randn(1, 4, 64, 64), "layer4")
    msg = str(err.value)
    assert "layer 'conv1' (Conv2d)" in msg and "[[1, 4, 64, 64]]" in msg and "torch.float32" in msg
    assert isinstance(err.value.__cause__, RuntimeError)
    assert err.value.layer == "conv1" and err.value.module_type == "Conv2d"
    # a failure deeper down names the innermost layer
    with pytest.raises(LayerForwardError, match=r"layer '1.1' \(Linear\).*\[\[1, 8\]\]"):
        layertap.FeatureExtractor(nn.Sequential(nn.Flatten(), nn.Sequential(nn.Identity(), nn.Linear(4, 2))), "1")(torch.ones(1, 8))
