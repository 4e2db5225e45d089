"""The PyTorch hook behaviours layertap relies on (shared/reference/pytorch-hooks.md), re-checked
on the installed torch. If one of these changes, the tap's design must change with it."""

import warnings

import pytest
import torch
from torch import nn


def test_1_handle_remove_is_idempotent_and_a_context_manager():
    m = nn.Linear(2, 2)
    h = m.register_forward_hook(lambda *a: None)
    h.remove()
    h.remove()
    assert not m._forward_hooks
    with m.register_forward_hook(lambda *a: None):
        assert len(m._forward_hooks) == 1
    assert not m._forward_hooks


def test_2_plain_hook_sees_positional_args_only():
    seen = {}
    m = nn.Identity()
    with m.register_forward_hook(lambda mod, args, out: seen.setdefault("plain", args)):
        with m.register_forward_hook(lambda mod, args, kw, out: seen.setdefault("kw", (args, kw)), with_kwargs=True):
            m(input=torch.ones(1))
    assert seen["plain"] == ()
    assert seen["kw"][0] == () and "input" in seen["kw"][1]


def test_3_forward_hook_sees_in_place_module_input_already_overwritten():
    relu = nn.ReLU(inplace=True)
    x = torch.tensor([-1.0, 2.0])
    seen = {}
    relu.register_forward_pre_hook(lambda m, a: seen.update(pre=a[0].clone()))
    relu.register_forward_hook(lambda m, a, o: seen.update(post=a[0].clone()))
    relu(x)
    assert seen["pre"][0] == -1 and seen["post"][0] == 0


def test_4_return_values_replace_output_and_inputs():
    m = nn.Identity()
    m.register_forward_hook(lambda mod, a, out: out * 2)
    m.register_forward_pre_hook(lambda mod, a, kw: ((a[0] + 1,), kw), with_kwargs=True)
    assert m(torch.ones(1)).item() == 4


def test_5_always_call_hooks_run_on_exception_with_none_output():
    class Boom(nn.Module):
        def forward(self, x):
            raise ValueError("boom")

    outer = nn.Sequential(Boom())
    seen = []
    outer.register_forward_hook(lambda m, a, o: seen.append(o), always_call=True)
    outer[0].register_forward_hook(lambda m, a, o: 1 / 0, always_call=True)  # its error becomes a warning
    with warnings.catch_warnings(record=True) as w, pytest.raises(ValueError, match="boom"):
        warnings.simplefilter("always")
        outer(torch.ones(1))
    assert seen == [None] and any("forward hook" in str(x.message) for x in w)


def test_6_direct_forward_bypasses_hooks_and_reuse_fires_twice():
    m = nn.Identity()
    calls = []
    m.register_forward_hook(lambda *a: calls.append(1))
    m.forward(torch.ones(1))
    assert calls == []
    nn.Sequential(m, m)(torch.ones(1))
    assert calls == [1, 1]


def test_7_stored_reference_changes_with_later_in_place_op():
    m = nn.Linear(2, 2)
    kept = {}
    m.register_forward_hook(lambda mod, a, o: kept.update(o=o))
    with torch.no_grad():
        out = m(torch.ones(1, 2))
        before = out.clone()
        out += 1
    assert torch.equal(kept["o"], before + 1)


def test_8_full_backward_hook_breaks_on_in_place_after_the_module():
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU(inplace=True))
    model[0].register_full_backward_hook(lambda *a: None)
    with pytest.raises(RuntimeError, match="BackwardHookFunction.*inplace"):
        model(torch.randn(1, 2, requires_grad=True))


def test_9_tensor_hook_before_in_place_op_matches_split_reference():
    lin = nn.Linear(3, 3)
    x = torch.randn(4, 3)
    got = {}
    h = lin(x)
    h.register_hook(lambda g: got.update(g=g))
    h.relu_()
    (h * torch.arange(3.0)).sum().backward()
    ref_in = lin(x).detach().requires_grad_()
    (ref,) = torch.autograd.grad((torch.relu(ref_in) * torch.arange(3.0)).sum(), ref_in)
    torch.testing.assert_close(got["g"], ref)


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
def test_10_register_hook_without_grad_raises(ctx):
    lin = nn.Linear(2, 2)
    with ctx():
        out = lin(torch.ones(1, 2))
    with pytest.raises(RuntimeError, match="doesn't require gradient"):
        out.register_hook(lambda g: None)


def test_11_global_hooks_fire_before_local_unless_prepend():
    from torch.nn.modules.module import register_module_forward_hook

    order = []
    m = nn.Identity()
    m.register_forward_hook(lambda *a: order.append("local"))
    m.register_forward_hook(lambda *a: order.append("first"), prepend=True)
    with register_module_forward_hook(lambda *a: order.append("global")):
        m(torch.ones(1))
    assert order == ["global", "first", "local"]


def test_12_hook_added_after_compilation_silently_never_fires():
    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(2, 2), nn.ReLU())
    compiled = torch.compile(model, backend="eager")
    compiled(torch.ones(1, 2))
    fired = []
    with model[0].register_forward_hook(lambda *a: fired.append(1)):
        compiled(torch.ones(1, 2))
    assert fired == []  # this is why layertap runs compiled modules eagerly while tapped


def test_13_named_modules_names_and_shared_modules():
    shared = nn.Linear(2, 2)
    model = nn.Sequential(nn.ModuleList([shared, nn.ReLU()]), shared)
    names = dict(model.named_modules())
    assert "0.0" in names and model.get_submodule("0.0") is shared
    assert "1" not in names  # dropped as a duplicate of '0.0'
    assert "1" in dict(model.named_modules(remove_duplicate=False))
