"""Gradient checkpointing: a layer recomputed in the backward is not called again (layertap/tap/recompute.py).

References: the same network without checkpointing, read by plain hooks (a clone at the forward
hook, ``register_full_backward_hook``'s ``grad_output``) and plain autograd. The checkpointed
and plain networks run the same computation on the same batch, so values agree to the last bit
but for the order autograd sums in; the comparisons allow float rounding.
"""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import layertap
from layertap.attention import attention
from layertap.errors import TapError


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(6, 8), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.tanh(self.b(torch.relu(self.a(x))))


class Net(nn.Module):
    def __init__(self, reentrant: bool | None) -> None:
        super().__init__()
        self.block, self.head = Block(), nn.Linear(8, 2)
        self.reentrant = reentrant  # None: no checkpoint

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.block(x) if self.reentrant is None else checkpoint(self.block, x, use_reentrant=self.reentrant)
        return self.head(h)


def nets(reentrant: bool) -> tuple[Net, Net]:
    torch.manual_seed(0)
    plain = Net(None)
    checkpointed = copy.deepcopy(plain)
    checkpointed.reentrant = reentrant
    return plain, checkpointed


def batches() -> list[torch.Tensor]:
    torch.manual_seed(1)
    return [torch.randn(4, 6, requires_grad=True) for _ in range(2)]


def hooked(plain: Net, layer: str) -> dict[str, list[torch.Tensor]]:
    """Each forward and backward of ``plain`` over the batches, read by plain hooks on ``layer``."""
    seen: dict[str, list[torch.Tensor]] = {"output": [], "input": [], "grad": [], "grad_input": []}
    module = plain.get_submodule(layer)

    def backward(m: nn.Module, grad_input: tuple, grad_output: tuple) -> None:
        seen["grad"].append(grad_output[0].clone())
        seen["grad_input"].append(grad_input[0].clone())

    handles = [
        module.register_forward_pre_hook(lambda m, a: seen["input"].append(a[0].detach().clone())),
        module.register_forward_hook(lambda m, a, o: seen["output"].append(o.detach().clone())),
        module.register_full_backward_hook(backward),
    ]
    for x in batches():
        plain(x).pow(2).sum().backward()
    for h in handles:
        h.remove()
    return seen


@pytest.mark.parametrize("layer", ["block.a", "block.b", "block"])
def test_each_call_once_with_its_values_and_gradients_under_a_checkpoint(layer):
    plain, checkpointed = nets(reentrant=False)
    expected = hooked(plain, layer)
    with layertap.tap(checkpointed, layer, capture=("output", "input", "grad", "grad_input"), keep="all") as t:
        for x in batches():
            checkpointed(x).pow(2).sum().backward()
    for kind, mapping in (("output", t.outputs), ("input", t.inputs), ("grad", t.grads), ("grad_input", t.grad_inputs)):
        got = mapping[layer]
        assert len(got) == 2, f"{kind}: {len(got)} entries for 2 calls (the recomputations counted as calls)"
        for g, e in zip(got, expected[kind], strict=True):
            torch.testing.assert_close(g, e)
    assert t.order == [layer]


@pytest.mark.parametrize("frozen", [False, True], ids=["trained", "frozen"])
@pytest.mark.parametrize("layer", ["block.a", "block.b", "block"])
def test_gradients_under_a_checkpoint_whose_input_needs_none(layer, frozen):
    """The usual case: a batch that needs no gradient, and (frozen, as for a heatmap) weights that
    need none either. The tap makes what it hooks need one: the recomputation must too, or its ops
    save other tensors than the first pass's and the checkpoint fails ("a different number of
    tensors was saved"). The gradients are those of the plain network, where everything needs one."""
    plain, checkpointed = nets(reentrant=False)
    expected = hooked(plain, layer)
    checkpointed.requires_grad_(not frozen)
    with layertap.tap(checkpointed, layer, capture=("grad", "grad_input"), keep="all") as t:
        for x in batches():
            checkpointed(x.detach()).pow(2).sum().backward()
    for kind, mapping in (("grad", t.grads), ("grad_input", t.grad_inputs)):
        assert len(mapping[layer]) == 2, kind
        for g, e in zip(mapping[layer], expected[kind], strict=True):
            torch.testing.assert_close(g, e)
    with layertap.tap(checkpointed, "block:relu", capture=("grad", "grad_input")) as t:  # an op's, likewise
        checkpointed(batches()[0].detach()).pow(2).sum().backward()
    assert t.grads["block:relu"].shape == t.grad_inputs["block:relu"].shape == (4, 8)


class InPlaceBlock(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc, self.act, self.fc2 = nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(self.act(self.fc(x)))


@pytest.mark.parametrize(("layer", "kind"), [("fc", "grad"), ("act", "grad_input")])
def test_gradients_of_a_frozen_checkpointed_block_with_an_in_place_op_after_the_layer(layer, kind):
    """What the tap makes need a gradient is an alias, not a bare leaf, in the recomputation too:
    the in-place ReLU after it would otherwise fail ("a leaf Variable that requires grad is being
    used in an in-place operation"). Reference: plain autograd on the block with a leaf there."""
    torch.manual_seed(0)
    block, x = InPlaceBlock().requires_grad_(False), torch.randn(3, 4)
    with layertap.tap(block, layer, capture=kind) as t:
        checkpoint(block, x, use_reentrant=False).sum().backward()
    h = block.fc(x)
    leaf = (h if kind == "grad" else h.clone()).requires_grad_()
    block.fc2(torch.relu(leaf)).sum().backward()
    torch.testing.assert_close((t.grads if kind == "grad" else t.grad_inputs)[layer], leaf.grad)


def test_keep_first_leaves_later_forwards_without_a_graph():
    """Calls the keep policy does not keep get no gradient hooks, and nothing made to need a gradient."""
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 2)).requires_grad_(False)
    with layertap.tap(model, "0", capture="grad", keep="first") as t:
        model(torch.randn(2, 4)).sum().backward()
        later = model(torch.randn(2, 4))
    assert t.grads["0"].shape == (2, 4) and not later.requires_grad


def test_an_op_inside_a_checkpointed_module_is_called_once_per_forward():
    # the reference: the relu's value and its gradient by plain autograd on the network without checkpointing
    plain, checkpointed = nets(reentrant=False)
    expected = {"output": [], "grad": []}
    for x in batches():
        r = torch.relu(plain.block.a(x))
        out = plain.head(torch.tanh(plain.block.b(r)))
        (grad,) = torch.autograd.grad(out.pow(2).sum(), r)
        expected["output"].append(r.detach())
        expected["grad"].append(grad)
    with layertap.tap(checkpointed, "block:relu", capture=("output", "grad"), keep="all") as t:
        for x in batches():
            checkpointed(x).pow(2).sum().backward()
    for kind in ("output", "grad"):
        got = getattr(t, kind + "s")["block:relu"]
        assert len(got) == 2
        for g, e in zip(got, expected[kind], strict=True):
            torch.testing.assert_close(g, e)


def test_an_edit_is_applied_again_when_the_checkpoint_recomputes():
    # what the backward reads must be what the forward computed: the edited values
    plain, checkpointed = nets(reentrant=False)
    x = batches()[0]
    handle = plain.block.a.register_forward_hook(lambda m, a, o: o * -2.0)  # the hand-written edit
    plain(x).pow(2).sum().backward()
    handle.remove()
    expected = [p.grad.clone() for p in plain.parameters()]
    x.grad = None
    with layertap.tap(checkpointed, "block.a", edit=lambda name, out: out * -2.0):
        checkpointed(x).pow(2).sum().backward()
    for g, e in zip([p.grad for p in checkpointed.parameters()], expected, strict=True):
        torch.testing.assert_close(g, e)


def test_watch_rows_of_a_hugging_face_model_with_gradient_checkpointing():
    transformers = pytest.importorskip("transformers")
    from layertap.watch import watch

    config = transformers.BertConfig(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64)
    config.hidden_dropout_prob = config.attention_probs_dropout_prob = 0.0
    torch.manual_seed(0)
    plain = transformers.BertModel(config).train()
    checkpointed = copy.deepcopy(plain)
    checkpointed.activation_checkpointing_enable()  # use_reentrant=False, transformers' default
    ids = torch.randint(0, 100, (2, 7))
    rows: dict[str, list] = {"plain": [], "checkpointed": []}
    for key, model in (("plain", plain), ("checkpointed", checkpointed)):
        with watch(model, layers="encoder.layer.*.output.dense", every=1, sinks=[lambda s, r, key=key: rows[key].extend(r)]) as w:
            model(ids).last_hidden_state.pow(2).mean().backward()
            w.step()
    got = {(r.name, r.kind): r.stats for r in rows["checkpointed"]}
    want = {(r.name, r.kind): r.stats for r in rows["plain"]}
    assert sorted(got) == sorted(want)  # no "#1" rows: the recomputation is not a second call
    for key, stats in want.items():
        assert got[key].count == stats.count
        torch.testing.assert_close(got[key].mean, stats.mean, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(got[key].std, stats.std, rtol=1e-5, atol=1e-7)


def test_attention_kernel_eager_runs_again_in_the_recomputation():
    # the replaced kernel must compute in the recomputation what it computed in the forward:
    # the gradients equal those of an eager model without checkpointing
    transformers = pytest.importorskip("transformers")

    def bert(attention: str) -> nn.Module:
        config = transformers.BertConfig(
            vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
            hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, attn_implementation=attention,
        )  # fmt: skip
        torch.manual_seed(0)
        return transformers.BertModel(config).double().train()

    fused, eager = bert("sdpa"), bert("eager")
    fused.activation_checkpointing_enable()
    ids = torch.randint(1, 100, (2, 7))
    mask = torch.tensor([[1] * 7, [1] * 4 + [0] * 3])
    out = eager(ids, attention_mask=mask, output_attentions=True)
    out.last_hidden_state.pow(2).sum().backward()
    with attention(fused, heads="all", kernel="eager") as att:
        fused(ids, attention_mask=mask).last_hidden_state.pow(2).sum().backward()
    for (name, p), (_, q) in zip(fused.named_parameters(), eager.named_parameters(), strict=True):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-9, atol=1e-10, msg=name)
    for got, want in zip(att.values(), out.attentions, strict=True):
        torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    # the recomputation, after the model's call, knows no mask: the maps kept are the forward's
    with attention(fused, heads="all", rows="last", kernel="eager") as last:
        fused(ids, attention_mask=mask).last_hidden_state.pow(2).sum().backward()
    for got, want in zip(last.values(), out.attentions, strict=True):
        torch.testing.assert_close(got[:, :, 0], torch.stack([want[0, :, 6], want[1, :, 3]]), rtol=1e-9, atol=1e-10)


def test_reentrant_checkpoint_outputs_once_and_gradients_refused_naming_the_fix():
    plain, checkpointed = nets(reentrant=True)
    expected = hooked(plain, "block.a")
    with layertap.tap(checkpointed, "block.a", keep="all") as t:
        for x in batches():
            checkpointed(x).pow(2).sum().backward()
    assert len(t["block.a"]) == 2
    for g, e in zip(t["block.a"], expected["output"], strict=True):
        torch.testing.assert_close(g, e)
    with pytest.raises(TapError, match=r"use_reentrant=True.*use_reentrant=False"):
        with layertap.tap(checkpointed, "block.a", capture="grad"):
            checkpointed(batches()[0]).sum().backward()
