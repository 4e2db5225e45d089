"""The tap's observer (``observe=``) and execution order (`Tap.order`) on real models, against plain
PyTorch hooks and autograd: the same values in the same order, nothing kept, no copy made."""

import gc
import weakref

import pytest
import torch
import torchvision
from models import Reordered
from torch import nn

import layertap
from conftest import hook_state
from layertap import TapError

CONV_BN = (nn.Conv2d, nn.BatchNorm2d)


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def resnet():
    torch.manual_seed(0)
    return torchvision.models.resnet18().eval()


def x64():
    return torch.randn(2, 3, 64, 64, generator=torch.Generator().manual_seed(1))


def names_of(model, classes):
    return [name for name, m in model.named_modules() if isinstance(m, classes)]


def clone_at_hook(model, names, kind="output"):
    """The reference: (name, clone) for every call of each module, in hook order, by plain hooks."""
    seen = []

    def hook(name):
        if kind == "input":
            return lambda m, args: seen.append((name, args[0].clone()))
        return lambda m, args, out: seen.append((name, out.clone()))

    register = "register_forward_pre_hook" if kind == "input" else "register_forward_hook"
    run_hooked(model, [getattr(model.get_submodule(n), register)(hook(n)) for n in names])
    return seen


def run_hooked(model, handles):
    """One forward on `x64()` with plain hooks, removed afterwards."""
    try:
        with torch.no_grad():
            model(x64())
    finally:
        for h in handles:
            h.remove()


# ---------------------------------------------------------------------------- (a) the values
@pytest.mark.parametrize("kind", ["output", "input"])
def test_observe_sees_what_plain_hooks_clone_in_the_same_order(resnet, kind):
    names = names_of(resnet, CONV_BN)
    reference = clone_at_hook(resnet, names, kind)
    seen, calls = [], []

    def observe(name, what, call, value):
        assert what == kind
        seen.append((name, value.clone()))  # valid during the call only: the test keeps a copy
        calls.append((name, call))

    with torch.no_grad(), layertap.tap(resnet, CONV_BN, capture=kind, observe=observe):
        resnet(x64())
    assert [n for n, _ in seen] == [n for n, _ in reference]  # BatchNorm's output before the in-place ReLU
    for (name, value), (_, expected) in zip(seen, reference):
        assert torch.equal(value, expected), name
    assert all(call == 0 for _, call in calls)  # each conv and norm runs once per forward


# ---------------------------------------------------------------------------- (b) nothing kept
def test_nothing_is_stored_nor_held_nor_copied(resnet):
    before = hook_state(resnet)
    refs, shared = [], []
    plain = {}
    handle = resnet.layer1[0].bn1.register_forward_hook(lambda m, a, out: plain.update(ptr=out.data_ptr()))

    def observe(name, kind, call, value):
        refs.append(weakref.ref(value))
        if (name, kind) == ("layer1.0.bn1", "output"):
            shared.append(value.data_ptr())

    with torch.no_grad(), layertap.tap(resnet, CONV_BN, capture=("input", "output"), detach=False, observe=observe) as taps:
        resnet(x64())
        for view in (taps, taps.inputs):
            with pytest.raises(TapError, match="observe"):
                view["layer1.0.bn1"]
        assert len(taps.outputs) == 0 and "conv1" not in taps
    handle.remove()
    gc.collect()
    assert len(refs) == 2 * len(names_of(resnet, CONV_BN))
    assert all(ref() is None for ref in refs)  # the tap held none of them once the forward ended
    assert shared == [plain["ptr"]]  # the network's own tensor, not a copy
    assert hook_state(resnet) == before


def test_a_value_kept_past_the_call_may_change_in_place():
    """The documented contract: the value is the network's own, so an observer that wants it
    later copies it (BasicBlock's ReLU overwrites bn1's output)."""
    torch.manual_seed(0)
    block = torchvision.models.resnet.BasicBlock(4, 4).eval()
    kept = {}
    with torch.no_grad(), layertap.tap(block, "bn1", observe=lambda n, k, c, v: kept.update(raw=v, copy=v.clone())):
        block(torch.randn(1, 4, 8, 8))
    assert bool((kept["copy"] < 0).any()) and bool((kept["raw"] >= 0).all())
    assert torch.equal(kept["raw"], kept["copy"].relu())


# ---------------------------------------------------------------------------- (c) gradients
def test_observed_gradients_equal_autograd(resnet):
    names = names_of(resnet, (nn.Conv2d, nn.Linear))  # outputs no in-place op changes: autograd.grad takes them
    x = x64()
    weights = torch.randn(2, 1000, generator=torch.Generator().manual_seed(2))
    outputs = {}
    handles = [resnet.get_submodule(n).register_forward_hook(lambda m, a, out, n=n: outputs.update({n: out})) for n in names]
    try:
        loss = (resnet(x) * weights).sum()
    finally:
        for h in handles:
            h.remove()
    expected = dict(zip(names, torch.autograd.grad(loss, [outputs[n] for n in names])))

    values, grads = {}, {}

    def observe(name, kind, call, value):
        (values if kind == "output" else grads)[name] = value.clone()

    with layertap.tap(resnet, (nn.Conv2d, nn.Linear), capture=("output", "grad"), observe=observe):
        (resnet(x) * weights).sum().backward()
    resnet.zero_grad(set_to_none=True)
    assert set(grads) == set(names) == set(values)
    for name in names:
        assert torch.equal(values[name], outputs[name].detach()), name
        torch.testing.assert_close(grads[name], expected[name], rtol=0, atol=0, msg=name)


# ---------------------------------------------------------------------------- (d) the order
def first_starts(model, x):
    """The reference: module names in the order their first forward pre-hook ran."""
    order = []
    handles = [
        m.register_forward_pre_hook(lambda mod, a, n=n: order.append(n) if n not in order else None)
        for n, m in model.named_modules()
    ]
    try:
        with torch.no_grad():
            model(x)
    finally:
        for h in handles:
            h.remove()
    return order


@pytest.mark.parametrize("observed", [False, True], ids=["stored", "observed"])
@pytest.mark.parametrize("case", ["resnet18", "reuse"])
def test_order_is_the_order_of_first_starts(resnet, case, observed):
    model, x = (resnet, x64()) if case == "resnet18" else (Reordered(), torch.randn(2, 4))
    expected = first_starts(model, x)
    observe = (lambda *a: None) if observed else None
    with torch.no_grad(), layertap.tap(model, ["", nn.Module], observe=observe) as taps:
        assert taps.order == []
        model(x)
        assert taps.order == expected
        taps.clear()
        assert taps.order == []
        model(x)
        model(x)  # later calls do not move a name
        assert taps.order == expected
    if case == "reuse":
        assert expected == ["", "act", "body", "head"]  # the unused module never started


# ---------------------------------------------------------------------------- (e) ops
def second_relu_inputs(model, blocks):
    """The reference for each block's ``out += identity``: the input of its ReLU's second call."""
    seen, calls = {}, {}

    def pre(name):
        def hook(m, args):
            calls[name] = calls.get(name, 0) + 1
            if calls[name] == 2:
                seen[name] = args[0].clone()

        return hook

    run_hooked(model, [model.get_submodule(f"{b}.relu").register_forward_pre_hook(pre(b)) for b in blocks])
    return seen


@pytest.mark.parametrize("spec", ["layer*.*:add_", "layer*.*:*"])
def test_observe_on_ops(resnet, spec):
    blocks = [f"layer{i}.{j}" for i in range(1, 5) for j in range(2)]
    expected = second_relu_inputs(resnet, blocks)
    seen = []

    def observe(name, kind, call, value):
        seen.append((name, call, value.clone()))

    with torch.no_grad(), layertap.tap(resnet, spec, observe=observe) as taps:
        resnet(x64())
    suffix = ":add_" if spec.endswith("add_") else ":add_#1"  # "MODULE:*" names each op by its call
    assert [name for name, _, _ in seen] == [b + suffix for b in blocks] == taps.names == taps.order
    for (name, call, value), block in zip(seen, blocks):
        assert call == 0 and torch.equal(value, expected[block]), name


class Scaled(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(x) * 2


def test_an_observers_own_torch_calls_are_not_ops_of_the_module():
    model = nn.Sequential(Scaled())
    with torch.no_grad(), layertap.tap(model, ["0.fc", "0:*"], observe=lambda n, k, c, v: v.sum()) as taps:
        model(torch.randn(3, 4))
    assert taps.names == ["0.fc", "0:mul#1"]
