"""Op taps: torch function calls inside a module's own forward, against independent references.

References: torchvision FX node outputs (same ops, same batch: bit-equal), values stashed by hand
inside ``forward`` (a model FX cannot trace), plain autograd for gradients.
"""

from __future__ import annotations

import copy
import functools
import inspect
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
import torchvision
from torch import nn
from torchvision.models.feature_extraction import create_feature_extractor

import layertap
from layertap import LayerNotFoundError, TapError
from layertap.select import split_op
from layertap.tap import op_name


def _fx_pairs(model: nn.Module, fx_names: list[str], renames: dict[str, str]) -> dict[str, str]:
    """FX node name -> the op tap name for the same call (FX numbers repeats ``op_1``, we ``op#2``)."""
    pairs = {}
    for fx in fx_names:
        prefix, _, last = fx.rpartition(".")
        m = re.fullmatch(r"([a-z_0-9]+?)(?:_(\d+))?", last)
        assert m is not None
        op, k = m.group(1), m.group(2)
        pairs[fx] = f"{prefix}:{renames.get(op, op)}" + (f"#{int(k) + 1}" if k else "")
    return pairs


FX_CASES = {
    # `out += identity` is traced by FX as an add node; eagerly it is Tensor.add_
    "resnet50": (lambda names: [n for n in names if n.endswith(".add")], {"add": "add_"}),
    "densenet121": (
        lambda names: [n for n in names if n.endswith(".cat")] + ["relu", "adaptive_avg_pool2d", "flatten"],
        {},
    ),
    "efficientnet_b0": (lambda names: [n for n in names if n.endswith(".add")] + ["flatten"], {"add": "add_"}),
}


@pytest.mark.parametrize("arch", sorted(FX_CASES))
def test_op_outputs_equal_torchvision_fx_nodes(arch):
    torch.manual_seed(0)
    model = getattr(torchvision.models, arch)().eval()
    pick, renames = FX_CASES[arch]
    from torchvision.models.feature_extraction import get_graph_node_names

    fx_names = pick(get_graph_node_names(model)[1])
    pairs = _fx_pairs(model, fx_names, renames)
    x = torch.randn(2, 3, 64, 64)
    # FX returns the node's tensor itself, which a later in-place ReLU overwrites (resnet's
    # `out += identity; out = relu(out)`): its reference runs a copy without in-place ReLUs, the
    # same arithmetic. The tap runs the model as it is and must still give the value before it.
    fx_model = copy.deepcopy(model)
    for m in fx_model.modules():
        if isinstance(m, nn.ReLU):
            m.inplace = False
    with torch.no_grad():
        reference = create_feature_extractor(fx_model, return_nodes=fx_names)(x)
        with layertap.tap(model, list(pairs.values())) as taps:
            model(x)
    assert len(pairs) >= 10 if arch != "efficientnet_b0" else len(pairs) >= 9
    for fx, ours in pairs.items():
        assert torch.equal(taps[ours], reference[fx]), (fx, ours)


class Untraceable(nn.Module):
    """Data-dependent control flow FX cannot trace; stashes its intermediate values by hand."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.stash: list[torch.Tensor] = []

    def forward(self, x):
        h = self.lin(x)
        steps = int(h.abs().sum() > 1) + 1  # data decides how many steps run
        for _ in range(steps):
            h = torch.tanh(h) * 2
            self.stash.append(h.detach().clone())
        if h.mean() > 0:
            h = h.exp()
        else:
            h = -h
        h += 1  # in place: the tap must keep the value before the relu_ below
        self.stash.append(h.detach().clone())
        return h.relu_()


def test_untraceable_model_ops_match_values_stashed_in_forward():
    torch.manual_seed(0)
    model = Untraceable()
    with pytest.raises(TypeError):  # FX: a Proxy cannot be turned into a bool or an int
        torch.fx.symbolic_trace(model)
    x = torch.randn(4, 8) * 3
    with torch.no_grad(), layertap.tap(model, [":mul", ":add_", ":mul#2"], keep="all") as taps:
        model(x)
    *steps, summed = model.stash
    assert len(steps) == 2
    torch.testing.assert_close(taps[":mul"], steps, rtol=0, atol=0)
    assert torch.equal(taps[":mul#2"][0], steps[1])
    assert torch.equal(taps[":add_"][0], summed)
    assert (summed < 0).any()  # the relu_ after it would have changed a kept view


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        h = self.lin(x)
        h += x
        return torch.relu_(h) * 3


def test_op_gradients_equal_autograd_through_in_place_ops():
    torch.manual_seed(0)
    model = Block()
    x = torch.randn(5, 6, requires_grad=True)
    with layertap.tap(model, ":add_", capture=("output", "input", "grad", "grad_input")) as taps:
        model(x).square().sum().backward()
    # reference: the same math out of place, the sum's gradient from autograd
    h = model.lin(x)
    s = h + x
    s.retain_grad()
    h.retain_grad()
    (torch.relu(s) * 3).square().sum().backward()
    assert torch.equal(taps[":add_"], s.detach())
    torch.testing.assert_close(taps.grads[":add_"], s.grad, rtol=1e-6, atol=1e-6)
    inputs = taps.inputs[":add_"]
    assert isinstance(inputs, layertap.Inputs)
    assert torch.equal(inputs.args[0], h.detach())  # captured before add_ changed it
    assert torch.equal(inputs.args[1], x.detach())
    # the in-place op's first argument is the same tensor its output is; its gradient is the sum's
    torch.testing.assert_close(taps.grad_inputs[":add_"].args[1], s.grad, rtol=1e-6, atol=1e-6)


def test_the_input_of_an_op_on_one_tensor_is_that_tensor():
    model = torchvision.models.densenet121().eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad(), layertap.tap(model, [":relu", "features"], capture=("input", "output")) as taps:
        model(x)
    # F.relu(features, inplace=True): one tensor (and an option), captured before it changed
    assert isinstance(taps.inputs[":relu"], torch.Tensor)
    assert torch.equal(taps.inputs[":relu"], taps["features"])
    assert (taps.inputs[":relu"] < 0).any() and torch.equal(taps[":relu"], taps["features"].relu())


class KeywordSoftmax(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.softmax(x * 2, dim=0)


def test_running_call_gives_the_options_an_op_on_one_tensor_got():
    from layertap.tap.ops import running_call

    seen = []

    def observe(name, kind, call, value):
        seen.append((kind, value, running_call()))

    x = torch.randn(3, 4)
    with layertap.tap(KeywordSoftmax(), ":softmax", capture=("input", "output"), observe=observe) as taps:
        taps.model(x)
    (kind, value, (func, args, kwargs)), (out_kind, out, out_call) = seen
    assert kind == "input" and func is F.softmax and kwargs["dim"] == 0
    assert torch.equal(value, x * 2) and torch.equal(args[0], x * 2)  # the tensor alone is what the tap gives
    assert out_kind == "output" and torch.equal(out, F.softmax(x * 2, dim=0)) and out_call[2]["dim"] == 0
    assert running_call() is None


def test_in_place_op_keeps_its_value_across_forwards_on_resnet():
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    block = model.layer1[0]
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad(), layertap.tap(model, ["layer1.0:add_", "maxpool"], keep="all") as taps:
        model(x)
        model(x.flip(0))
    for i, inp in enumerate(taps["maxpool"]):
        expected = block.bn2(block.conv2(block.relu(block.bn1(block.conv1(inp))))) + inp
        assert torch.equal(taps["layer1.0:add_"][i], expected)
        assert (expected < 0).any()


def test_edit_replaces_an_op_result_downstream():
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    x = torch.randn(2, 3, 64, 64)

    def no_residual(name, out):
        return model_input.pop()  # the block's output before the skip: ablate the identity

    # reference: the block with its skip connection removed, by hand
    block = model.layer1[0]
    with torch.no_grad(), layertap.tap(model, "maxpool") as first:
        model(x)
    inp = first["maxpool"]
    branch = block.bn2(block.conv2(block.relu(block.bn1(block.conv1(inp)))))
    model_input = [branch.clone()]
    with torch.no_grad(), layertap.tap(model, ["layer1.0", "layer1.0:add_"], edit={"layer1.0:add_": no_residual}) as taps:
        model(x)
    assert torch.equal(taps["layer1.0:add_"], branch)
    assert torch.equal(taps["layer1.0"], branch.relu())


def test_stop_early_after_the_last_tapped_op():
    model = torchvision.models.resnet18().eval()
    ran = []
    handle = model.layer2.register_forward_hook(lambda *a: ran.append(1))
    try:
        with torch.no_grad(), layertap.tap(model, "layer1.1:add_", stop_early=True) as taps:
            model(torch.randn(1, 3, 32, 32))
    finally:
        handle.remove()
    assert ran == [] and taps["layer1.1:add_"].shape == (1, 64, 8, 8)


def test_selectors_and_names():
    model = torchvision.models.resnet18()
    assert layertap.select(model, "layer1.*:add_") == ["layer1.0:add_", "layer1.1:add_"]
    assert layertap.select(model, (torchvision.models.resnet.BasicBlock, "add_"))[:2] == ["layer1.0:add_", "layer1.1:add_"]
    assert layertap.select(model, "re:layer4\\.[01]:add_") == ["layer4.0:add_", "layer4.1:add_"]
    assert layertap.select(model, ":flatten") == [":flatten"]
    assert split_op("layer1.0:relu#2") == ("layer1.0", "relu", 2)
    assert split_op("re:(?:a)") is None
    assert [op_name(f) for f in (torch.Tensor.__iadd__, torch.Tensor.__rsub__, torch.Tensor.__truediv__, F.softmax)] == [
        "add_", "rsub", "div", "softmax"
    ]


def test_unknown_op_names_what_the_module_really_calls():
    model = torchvision.models.resnet18().eval()
    with torch.no_grad(), layertap.tap(model, ["layer1.0:softmax", "layer1.0:add_#2"]) as taps:
        model(torch.randn(1, 3, 32, 32))
    with pytest.raises(LayerNotFoundError, match=r"'softmax' is not called by the forward of module 'layer1.0' \(BasicBlock\); its own forward calls: add_"):
        taps["layer1.0:softmax"]
    with pytest.raises(LayerNotFoundError, match=r"called 1 time\(s\) per forward .* no call #2"):
        taps["layer1.0:add_#2"]
    with pytest.raises(LayerNotFoundError, match="matches no layer"):
        layertap.tap(model, "layer9:add_")


def test_ops_of_children_are_not_the_parents():
    model = torchvision.models.resnet18().eval()
    with torch.no_grad(), layertap.tap(model, ["layer1:*", "layer1.0:*"]) as taps:
        model(torch.randn(1, 3, 32, 32))
    # layer1 is a Sequential: its own forward calls only its children, no torch function
    assert taps.names == ["layer1.0:add_#1"]
    # nor are the torch calls of the tap's own hooks on a child (its copies) the parent's
    with torch.no_grad(), layertap.tap(model, ["layer1.0:*", "layer1.0.conv1", "layer1.0.bn1"], capture=("input", "output")) as taps:
        model(torch.randn(1, 3, 32, 32))
    assert taps.names == ["layer1.0.conv1", "layer1.0.bn1", "layer1.0:add_#1"]


def test_mode_and_wrappers_are_removed_even_when_the_forward_fails():
    model = torchvision.models.resnet18().eval()
    with pytest.raises(RuntimeError), layertap.tap(model, ["layer1.0:add_", "layer2.0:add_"]):
        model(torch.randn(1, 5, 32, 32))  # wrong channel count: conv1 fails
    with pytest.raises(RuntimeError), layertap.tap(model, "layer1.0:add_"):
        model.layer1[0](torch.randn(1, 3, 8, 8))  # fails inside the framed forward
    assert all("forward" not in m.__dict__ for m in model.modules())
    assert not torch.overrides._is_torch_function_mode_enabled()
    with torch.no_grad():
        model(torch.randn(1, 3, 32, 32))  # and the model still runs


def test_modules_without_op_taps_are_left_alone():
    model = torchvision.models.resnet18().eval()
    with layertap.tap(model, ["layer2", "layer1.0:add_"]):
        wrapped = {name for name, m in model.named_modules() if "forward" in m.__dict__}
    assert wrapped == {"layer1.0"}  # its descendants get blind frames from hooks, not forwards set on them
    assert all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


class Summed(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(4, 4)

    def forward(self, x):
        return (self.proj(x) * 10).sum(-1)


def test_a_childs_own_hooks_do_not_make_ops_of_its_parent():
    torch.manual_seed(0)
    model = nn.Sequential(Summed())
    sums = []
    hook = model[0].proj.register_forward_hook(lambda m, a, out: sums.append(out.sum()))  # a user's torch call
    x = torch.randn(2, 4)
    try:
        with torch.no_grad(), layertap.tap(model, ["0:sum#1", "0:*"]) as taps:
            model(x)
    finally:
        hook.remove()
    assert taps.names == ["0:sum#1", "0:mul#1"]  # the hook's sum is not the block's
    with torch.no_grad():
        assert torch.equal(taps["0:sum#1"], (model[0].proj(x) * 10).sum(-1))


class TwoSoftmaxes(nn.Module):
    """Its own softmax between two children that call softmax too."""

    def __init__(self) -> None:
        super().__init__()
        self.first, self.last = nn.Softmax(-1), nn.Softmax(-1)

    def forward(self, x):
        return self.last(torch.softmax(self.first(x) * 3, -1) * 5)


def test_childrens_ops_stay_theirs_with_or_without_hooks_and_forwards_come_back():
    """A child's softmax, in its forward or in a user's hook on it, is not the parent's, whose own
    softmax is call #1; a forward set on a child's instance is left as it is."""
    torch.manual_seed(0)
    model = nn.Sequential(TwoSoftmaxes())
    x = torch.randn(2, 4)
    own = model[0].last.forward = functools.partial(nn.Softmax.forward, model[0].last)  # a forward set on the instance
    calls = []
    hook = model[0].first.register_forward_hook(lambda m, a, out: calls.append(torch.softmax(out, -1)))  # a user's softmax
    try:
        with torch.no_grad(), layertap.tap(model, ["0:*", "0:softmax#1"]) as taps:
            signature = inspect.signature(model[0].last.forward)
            model(x)
    finally:
        hook.remove()
    assert sorted(taps.names) == ["0:mul#1", "0:mul#2", "0:softmax#1"]
    torch.testing.assert_close(taps["0:softmax#1"], torch.softmax(torch.softmax(x, -1) * 3, -1), rtol=0, atol=0)
    assert signature == inspect.signature(own)
    assert model[0].last.__dict__["forward"] is own and "forward" not in model[0].first.__dict__


def test_taps_on_a_module_and_its_child_may_end_in_any_order():
    """Two taps, one on an op of a block and one on an op of its child, the first ended first: the
    second still captures, nothing is left on the model, and a copy of it computes with its own weights."""
    torch.manual_seed(0)
    model = nn.Sequential(Summed())
    x = torch.randn(2, 4)
    outer = layertap.tap(model, "0:sum").__enter__()
    inner = layertap.tap(model, "0.proj:linear").__enter__()
    outer.__exit__(None, None, None)
    with torch.no_grad():
        model(x)
    inner.__exit__(None, None, None)
    torch.testing.assert_close(inner["0.proj:linear"], model[0].proj(x).detach(), rtol=0, atol=0)
    assert all("forward" not in m.__dict__ and not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())
    twin = copy.deepcopy(model)
    with torch.no_grad():
        twin[0].proj.weight.zero_(), twin[0].proj.bias.zero_()
        assert torch.equal(twin(x), torch.zeros(2)) and not torch.equal(model(x), torch.zeros(2))


def test_op_taps_under_inference_mode_and_compile():
    model = torchvision.models.resnet18().eval()
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad(), layertap.tap(model, "layer3.1:add_") as plain:
        model(x)
    with torch.inference_mode(), layertap.tap(model, "layer3.1:add_") as taps:
        model(x)
    assert torch.equal(taps["layer3.1:add_"], plain["layer3.1:add_"])
    compiled = torch.compile(model, backend="eager")
    with torch.no_grad(), layertap.tap(compiled, "layer3.1:add_", reduce="mean") as taps:
        compiled(x)
    torch.testing.assert_close(taps["layer3.1:add_"], plain["layer3.1:add_"].mean((2, 3)), rtol=1e-6, atol=1e-6)


def test_observe_and_order_with_ops():
    model = torchvision.models.resnet18().eval()
    seen = []
    with torch.no_grad(), layertap.tap(model, ["layer1.1:add_", "layer1.1", "layer1.0:add_"], observe=lambda *a: seen.append(a[:3])) as taps:
        model(torch.randn(1, 3, 32, 32))
    assert seen == [("layer1.0:add_", "output", 0), ("layer1.1:add_", "output", 0), ("layer1.1", "output", 0)]
    assert taps.order == ["layer1.0:add_", "layer1.1", "layer1.1:add_"]
    with pytest.raises(TapError, match="observe="):
        taps["layer1.1"]


def test_ops_work_in_extract_dataset_and_the_cli(tmp_path):
    from layertap.cli import run

    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    x = torch.randn(4, 3, 32, 32)
    names = ["layer1.0:add_", ":flatten"]
    direct = layertap.extract(model, x, names, reduce="mean")
    layertap.extract_dataset(model, x, names, out=tmp_path / "f.zarr", batch_size=2, reduce="mean", progress=False)
    store = layertap.open_features(tmp_path / "f.zarr")
    for name in names:
        torch.testing.assert_close(torch.from_numpy(store[name][:]), direct[name], rtol=1e-5, atol=1e-6)
    import numpy as np

    np.save(tmp_path / "x.npy", x.numpy())
    argv = ["extract", "torchvision:resnet18", str(tmp_path / "x.npy"), "--layers", "layer4.1:add_", "--format", "npy",
            "--out", str(tmp_path / "c"), "--reduce", "mean"]  # fmt: skip
    assert run(argv) == 0
    assert layertap.open_features(tmp_path / "c")["layer4.1:add_"].shape == (4, 512)


class Gated(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        return self.lin(torch.sigmoid(x) * x)


def test_replace_runs_in_place_of_the_op_and_is_captured():
    """replace= stands in for the op: the op itself never runs, what the function returns flows on
    (the model's output is what a forward with that op swapped by hand gives) and is what is captured."""
    torch.manual_seed(0)
    model, x = Gated().eval(), torch.randn(3, 6)
    calls = []

    def hard(name, func, args, kwargs):
        calls.append((name, func))
        return (args[0] > 0).to(args[0].dtype)  # a hard gate in place of the sigmoid

    with torch.no_grad(), layertap.tap(model, ["", ":sigmoid"], replace={":sigmoid": hard}) as t:
        out = model(x)
    assert calls == [(":sigmoid", torch.sigmoid)]
    expected = model.lin((x > 0).float() * x)
    torch.testing.assert_close(out, expected, rtol=0, atol=0)
    assert torch.equal(t[":sigmoid"], (x > 0).float()) and torch.equal(t[""], out)
    assert torch.equal(model(x), model.lin(torch.sigmoid(x) * x))  # the op is the model's own again


def test_replace_of_an_op_not_tapped_and_by_a_module_op_tuple():
    """A (module, op) tuple is one spec, as key of replace= and of edit=; the replaced op need not be tapped."""
    model, x = Gated().eval(), torch.randn(3, 6)
    ran = []
    with torch.no_grad(), layertap.tap(model, "lin", replace={("", "sigmoid"): lambda n, f, a, k: ran.append(n) or f(*a, **k) * 0}) as t:
        model(x)
    assert ran == [":sigmoid"] and torch.equal(t["lin"], model.lin(torch.zeros(3, 6)))
    with torch.no_grad(), layertap.tap(model, "lin", edit={("", "sigmoid"): lambda name, out: out * 0}) as t:
        model(x)
    assert torch.equal(t["lin"], model.lin(torch.zeros(3, 6)))


def test_replace_takes_ops_only():
    model = Gated()
    with pytest.raises(layertap.TapError, match="replace= stands in for ops inside a module's forward .* 'lin' is a module"):
        layertap.tap(model, "lin", replace=lambda name, func, args, kwargs: func(*args, **kwargs))
    with pytest.raises(layertap.TapError, match="replace= needs named ops, not 'module:\\*'"):
        layertap.tap(model, ":*", replace=lambda name, func, args, kwargs: func(*args, **kwargs))


@pytest.mark.parametrize("work", ["capture", "edit", "observe", "replace"])
def test_a_taps_own_work_is_no_op_of_the_module_for_a_tap_entered_after_it(work):
    """Two taps on one module: the inner one's copies, edit=, observe= and replace= functions run
    torch functions of their own, which the other tap must not take for the module's ops."""
    torch.manual_seed(0)
    model, x = Gated().eval(), torch.randn(3, 6)
    options = {
        "capture": {},
        "edit": {"edit": lambda name, out: torch.tanh(out)},
        "observe": {"observe": lambda name, kind, call, value: value.abs().sum()},
        "replace": {"replace": lambda name, func, args, kwargs: func(*args, **kwargs).clone()},
    }[work]
    with torch.no_grad(), layertap.tap(model, ":sigmoid", **options), layertap.tap(model, ":*") as every:
        model(x)
    # a replaced op is the replacing tap's business: a tap entered after it sees it no more
    assert every.order == ([":mul#1"] if work == "replace" else [":sigmoid#1", ":mul#1"])


def test_a_replaced_op_is_seen_by_the_taps_entered_before_the_one_that_replaces_it():
    model, x = Gated().eval(), torch.randn(3, 6)
    halve = {":sigmoid": lambda name, func, args, kwargs: func(*args, **kwargs) / 2}
    with torch.no_grad(), layertap.tap(model, ":sigmoid") as seen, layertap.tap(model, "lin", replace=halve) as t:
        model(x)
    assert torch.equal(seen[":sigmoid"], torch.sigmoid(x) / 2)
    assert torch.equal(t["lin"], model.lin(torch.sigmoid(x) / 2 * x))


@pytest.mark.parametrize("option", ["edit", "replace"])
def test_an_edit_or_replacement_of_an_op_the_module_never_calls_is_warned_of(option):
    # nothing is read that would raise: the change did nothing, and the warning says so
    torch.manual_seed(0)
    model = torchvision.models.resnet18().eval()
    x = torch.randn(1, 3, 32, 32)
    change = (lambda name, out: out * 0) if option == "edit" else (lambda name, func, args, kwargs: func(*args, **kwargs) * 0)
    with pytest.warns(UserWarning, match=r"'layer1:add_' changed nothing: the forward of 'layer1' ran without that call.*belong to the child"):
        with torch.no_grad(), layertap.tap(model, "layer1.0", **{option: {"layer1:add_": change}}):  # the add_ is layer1.0's
            model(x)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a change that ran: no warning
        with torch.no_grad(), layertap.tap(model, "layer1.0", **{option: {"layer1.0:add_": change}}):
            model(x)
