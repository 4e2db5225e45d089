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


def test_14_hook_on_a_view_is_lost_when_the_view_is_changed_in_place():
    lin = nn.Linear(3, 3)
    h = lin(torch.randn(2, 4, 3))  # Linear on a 3-D input returns a view of a 2-D result
    assert h._is_view()
    fired = []
    h.register_hook(lambda g: fired.append(g))
    h.relu_()  # rebases the view's history: the node holding the hook is left out of the graph
    h.sum().backward()
    assert fired == []  # this is why layertap hooks a non-view alias of a view


class Alias(torch.autograd.Function):
    """A non-view alias: ``detach()`` inside a custom function, its gradient passed through."""

    @staticmethod
    def forward(ctx, x):
        return x.detach()

    @staticmethod
    def backward(ctx, g):
        return g


def test_15_detach_in_a_custom_function_is_a_non_view_alias_that_keeps_hooks():
    lin = nn.Linear(3, 3)
    x = torch.randn(2, 4, 3)
    h = lin(x)
    a = Alias.apply(h)
    assert not a._is_view() and a.data_ptr() == h.data_ptr()
    version = h._version
    got = {}
    a.register_hook(lambda g: got.update(g=g))
    a.relu_()
    assert h._version != version and bool((h >= 0).all())  # one version counter, one memory
    (a * torch.arange(3.0)).sum().backward()
    ref_in = lin(x).detach().requires_grad_()
    (ref,) = torch.autograd.grad((torch.relu(ref_in) * torch.arange(3.0)).sum(), ref_in)
    torch.testing.assert_close(got["g"], ref, rtol=0, atol=0)  # the same ops on the same values
    sig = torch.sigmoid(torch.randn(2, 2, 2, requires_grad=True))  # sigmoid saves its output
    Alias.apply(sig.flatten(1)).sum().backward()  # no version bump: its backward still runs


def test_16_a_leaf_and_its_views_cannot_be_changed_in_place_and_leaf_hooks_stay():
    x = torch.randn(2, 2, requires_grad=True)
    with pytest.raises(RuntimeError, match="leaf Variable that requires grad"):
        x.relu_()
    with pytest.raises(RuntimeError, match="view of a leaf Variable"):
        x.view_as(x).relu_()
    x.register_hook(lambda g: None)
    (x * 2).sum().backward()
    assert len(x._backward_hooks) == 1  # a hook on a leaf outlives every backward
    v = x.view_as(x)
    v.register_hook(lambda g: None)
    assert len(x._backward_hooks) == 1  # one on a view of it stays with the view


def test_17_packed_sequence_keeps_batch_sizes_on_the_cpu():
    from torch.nn.utils.rnn import PackedSequence, pack_sequence

    seq = pack_sequence([torch.randn(3, 2), torch.randn(1, 2), torch.randn(2, 2)], enforce_sorted=False)
    moved = seq.to("meta")
    assert moved.data.device.type == "meta" and moved.sorted_indices.device.type == "meta"
    assert moved.batch_sizes.device.type == "cpu" and moved.batch_sizes.dtype == torch.int64
    with pytest.raises(ValueError, match="batch_sizes should always be on CPU"):
        PackedSequence(seq.data, seq.batch_sizes.to("meta"), seq.sorted_indices, seq.unsorted_indices)


def test_18_torch_compile_wraps_the_model_in_an_optimized_module_as_orig_mod():
    model = nn.Linear(2, 2)
    compiled = torch.compile(model, backend="eager")
    from torch._dynamo.eval_frame import OptimizedModule

    assert type(compiled) is OptimizedModule and compiled._orig_mod is model
    assert [n for n, _ in compiled.named_modules()] == ["", "_orig_mod"]
    dp = nn.DataParallel(model)
    assert dp.module is model and [n for n, _ in dp.named_modules()] == ["", "module"]


# ------------------------------------------------------------------ facts the op taps rely on
class _Names(torch.overrides.TorchFunctionMode):
    def __init__(self) -> None:
        super().__init__()
        self.calls: list[str] = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.calls.append(getattr(func, "__name__", "?"))
        return func(*args, **(kwargs or {}))


def test_19_a_function_mode_sees_operators_under_torch_names_and_not_the_ops_inside_an_op():
    x, y = torch.randn(2, 3), torch.randn(2, 3)
    with _Names() as mode:
        _ = x + y
        x += y
        _ = x @ y.T
        torch.nn.functional.softmax(x, dim=-1)  # calls Tensor.softmax inside: not seen again
        torch.nn.functional.relu(x)
    assert mode.calls == ["add", "add_", "__get__", "matmul", "softmax", "relu"]


def test_20_an_instance_forward_runs_inside_the_hooks_and_is_restorable():
    m = nn.Linear(2, 2)
    order = []
    m.register_forward_pre_hook(lambda *a: order.append("pre"))
    m.register_forward_hook(lambda *a: order.append("post"))
    inner = m.forward

    def forward(x):
        order.append("forward")
        return inner(x)

    m.forward = forward
    m(torch.ones(1, 2))
    assert order == ["pre", "forward", "post"]
    del m.__dict__["forward"]
    m(torch.ones(1, 2))
    assert order[-2:] == ["pre", "post"]


def test_21_a_function_mode_is_seen_under_no_grad_and_inference_mode():
    with _Names() as mode, torch.inference_mode():
        torch.ones(2).exp()
    with _Names() as mode2, torch.no_grad():
        torch.ones(2).exp()
    assert "exp" in mode.calls and "exp" in mode2.calls


def test_22_a_tensors_own_hook_sums_all_its_uses_a_full_backward_hook_only_the_modules_edge():
    # the definition of grad/grad_input is the full backward hook's; a hook on the input tensor
    # itself differs wherever that tensor is read elsewhere too (ResNet's shortcut)
    lin, skip = nn.Linear(3, 3), nn.Identity()
    h = nn.Linear(3, 3)(torch.randn(4, 3))
    seen = {}
    lin.register_full_backward_hook(lambda m, gi, go: seen.update(lin=gi[0]))
    skip.register_full_backward_hook(lambda m, gi, go: seen.update(skip_in=gi[0], skip_out=go[0]))
    h.register_hook(lambda g: seen.update(total=g))
    (lin(h).sum() + skip(h).sum() * 2 + (h * 3).sum()).backward()
    torch.testing.assert_close(seen["lin"], lin.weight.sum(0).expand(4, 3))  # through lin only
    torch.testing.assert_close(seen["skip_out"], torch.full((4, 3), 2.0))  # nn.Identity's output edge only
    torch.testing.assert_close(seen["skip_in"], torch.full((4, 3), 2.0))
    torch.testing.assert_close(seen["total"], seen["lin"] + 2 + 3)


def test_23_modules_that_return_their_input_object():
    import torchvision

    x = torch.randn(2, 3)
    block = torchvision.models.swin_t().eval().features[1][0]
    for module in (nn.Identity(), nn.Dropout().eval(), block.stochastic_depth):
        assert module(x) is x  # their output edge is not the tensor's only use


def test_24_a_full_backward_hook_refuses_an_in_place_module():
    relu = nn.ReLU(inplace=True)
    relu.register_full_backward_hook(lambda *a: None)
    with pytest.raises(RuntimeError, match="BackwardHookFunction.*inplace"):
        relu(torch.randn(2, requires_grad=True) * 1)  # so in-place layers are checked against their out-of-place twin


def test_25_copy_from_the_same_memory_moves_nothing_and_the_version_can_be_set_back():
    # what the tap does after a layer changed its input in place through an alias: the caller's
    # tensor gets the layer's history without a copy, and saved values still pass their checks
    x = torch.randn(1 << 20, requires_grad=True)
    h = x * 1
    a = Alias.apply(h)
    a.relu_()  # ReluBackward saves its result, at this version
    version, pointer, before = a._version, h.data_ptr(), h.detach().clone()
    h.copy_(a)
    assert h.data_ptr() == pointer and torch.equal(h, before) and type(h.grad_fn).__name__ == "CopyBackwards"
    assert h._version == version + 1 == a._version  # one counter, bumped by the write
    torch._C._autograd._unsafe_set_version_counter((h,), (version,))
    assert a._version == version
    (h * 2).sum().backward()  # the saved result passes its version check; the gradient runs through the ReLU
    torch.testing.assert_close(x.grad, 2.0 * (before > 0))


def test_26_a_checkpoint_recomputes_its_modules_during_backward_where_a_graph_task_runs():
    # how the tap tells a checkpoint's recomputation from a call (layertap/tap/recompute.py)
    from torch.utils.checkpoint import checkpoint

    net = nn.Sequential(nn.Linear(3, 3), nn.Tanh(), nn.Linear(3, 3))
    tasks, grad_modes = [], []
    net[0].register_forward_hook(lambda m, a, o: tasks.append(torch._C._current_graph_task_id()))
    net[0].register_forward_pre_hook(lambda m, a: grad_modes.append(torch.is_grad_enabled()))
    x = torch.randn(2, 3, requires_grad=True)
    for reentrant in (False, True):
        tasks.clear(), grad_modes.clear()
        checkpoint(net, x, use_reentrant=reentrant).sum().backward()
        assert tasks[0] == -1 and tasks[1] != -1 and len(tasks) == 2  # the forward, then its recomputation in the backward
        # the reentrant first pass runs without autograd: there is no gradient to hook in it
        assert grad_modes == [not reentrant, True]
    tasks.clear()
    net(x).sum().backward()
    assert tasks == [-1]
