"""The tap on small and real models: capture kinds, keep policies, controls, nesting, cleanup."""

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import torchvision
from models import MLP
from torch import nn

import layertap
from conftest import hook_state
from layertap import Inputs, LayerNotFoundError, LayerNotRunError, TapError


class Twice(nn.Module):
    """One module called twice per forward."""

    def __init__(self):
        super().__init__()
        self.block = nn.Linear(4, 4)
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.block(self.block(x)))


# ---------------------------------------------------------------- tutorial scenario (a)
def test_mlp_records_fc1_every_forward_and_fc2_gradient():
    model = MLP()
    xs = [torch.randn(1, 784) for _ in range(3)]
    with layertap.tap(model, "fc1", keep="all") as t1, layertap.tap(model, "fc2", capture="grad") as t2:
        for x in xs:
            y = model(x)
        y.backward(torch.ones(1, 10))
    assert len(t1["fc1"]) == 3
    for got, x in zip(t1["fc1"], xs):
        torch.testing.assert_close(got, x @ model.fc1.weight.T + model.fc1.bias)
    torch.testing.assert_close(t2.grads["fc2"], torch.ones(1, 10))


def test_gradient_at_fc1_equals_autograd():
    model = MLP()
    x = torch.randn(5, 784)
    with layertap.tap(model, "fc1", capture=("output", "grad")) as t:
        model(x).pow(2).sum().backward()
    h = (x @ model.fc1.weight.T + model.fc1.bias).requires_grad_()
    (ref,) = torch.autograd.grad(model.fc2(model.relu(h)).pow(2).sum(), h)
    torch.testing.assert_close(t.grads["fc1"], ref)


# ---------------------------------------------------------------- keep policies
@pytest.mark.parametrize("keep", ["last", "first", "all"])
def test_keep_policy_on_module_called_twice(keep):
    model = Twice()
    x = torch.randn(3, 4)
    with layertap.tap(model, "block", capture=("input", "output", "grad"), keep=keep) as t:
        model(x).sum().backward()
    first = model.block(x)
    second = model.block(first)
    g_second = model.head.weight.sum(0).expand(3, 4)
    g_first = g_second @ model.block.weight
    want = {
        "output": [first, second],
        "input": [x, first],
        "grad": [g_first, g_second],
    }
    for kind, pair in want.items():
        got = getattr(t, kind + "s")["block"]
        expected = {"first": pair[0], "last": pair[1], "all": pair}[keep]
        torch.testing.assert_close(got, expected)


def test_keep_all_accumulates_across_forwards_until_clear():
    model = Twice()
    with layertap.tap(model, "block", keep="all") as t:
        model(torch.randn(1, 4))
        model(torch.randn(1, 4))
        assert len(t["block"]) == 4
        t.clear()
        model(torch.randn(1, 4))
        assert len(t["block"]) == 2


class Recursive(nn.Module):
    """A module that calls itself: its calls start outer first and end inner first."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x, depth=2):
        h = self.lin(x)
        return self(h * 10, depth=depth - 1) * (depth + 2) + 1 if depth > 0 else h


def _per_call(model: nn.Module, x: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Call ``k`` (counted as calls start) by plain hooks: its input and output cloned, and the
    gradients at them, from a leaf put in place of one (a run each: a leaf cuts the graph there)."""
    got = {}
    for edge in ("in", "out"):
        started, stack = [0], []

        def pre(module, args, kwargs, edge=edge, stack=stack, started=started):
            stack.append(started[0])
            started[0] += 1
            if stack[-1] == k and edge == "in":
                got["in"] = args[0].detach().clone().requires_grad_()
                return (got["in"].clone(),), kwargs
            return None

        def post(module, args, kwargs, out, edge=edge, stack=stack):
            if stack.pop() == k and edge == "out":
                got["out"] = out.detach().clone().requires_grad_()
                return got["out"].clone()
            return None

        handles = [model.register_forward_pre_hook(pre, with_kwargs=True), model.register_forward_hook(post, with_kwargs=True)]
        model(x).sum().backward()
        for h in handles:
            h.remove()
    return got["in"].detach(), got["out"].detach(), got["out"].grad, got["in"].grad


def test_a_module_calling_itself_gives_each_call_its_own_input_output_and_gradients():
    """Entry k of every kind is call k, counted as calls start (as `order` counts): the outer call
    is 0 although it ends last. Inputs and grad_inputs were numbered as calls started, outputs and
    grads as they ended: the innermost call's output sat beside the outermost call's input."""
    model, x = Recursive(), torch.randn(2, 4)
    with layertap.tap(model, "", capture=("input", "output", "grad", "grad_input"), keep="all") as t:
        model(x).sum().backward()
    for k in range(3):
        given, out, grad, grad_in = _per_call(model, x, k)
        inputs = t.inputs[""][k]
        assert torch.equal(inputs if isinstance(inputs, torch.Tensor) else inputs.args[0], given), k
        assert torch.equal(t.outputs[""][k], out), k
        torch.testing.assert_close(t.grads[""][k], grad)
        grads_in = t.grad_inputs[""][k]
        torch.testing.assert_close(grads_in if isinstance(grads_in, torch.Tensor) else grads_in.args[0], grad_in)
    assert len({float(t.grads[""][k].abs().sum()) for k in range(3)}) == 3  # three calls, three gradients
    for keep, k in (("first", 0), ("last", 2)):
        with layertap.tap(model, "", capture=("input", "output"), keep=keep) as t:
            model(x)
        given, out, _, _ = _per_call(model, x, k)
        assert torch.equal(t.outputs[""], out) and torch.equal(t.inputs[""].args[0] if k else t.inputs[""], given), keep


class Argmax(nn.Module):
    def forward(self, x):
        return x.argmax(-1)


@pytest.mark.parametrize("keep", ["last", "all"])
def test_a_layer_with_no_float_output_says_no_gradient_can_reach_it(keep):
    model = nn.Sequential(nn.Linear(4, 4))
    model.add_module("ids", Argmax())  # called aside: its integer output feeds nothing
    model.forward = lambda x: (model.ids(x), model[0](x))[1]
    with layertap.tap(model, ["0", "ids"], capture="grad", keep=keep) as t:
        model(torch.randn(3, 4)).sum().backward()
    assert t.grads["0"] is not None
    with pytest.raises(layertap.LayerNotRunError, match=r"^layer 'ids' has no grad: its output holds no floating-point tensor \(int64\)"):
        t.grads["ids"]
    assert t.grads.get("ids") is None  # a LayerNotRunError is a KeyError: Mapping.get works


class Sparse(nn.Module):
    def __init__(self):
        super().__init__()
        self.sparse, self.head = nn.Identity(), nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.sparse(x.to_sparse()).to_dense())


def test_a_sparse_output_and_its_gradient_are_tapped():
    """A sparse tensor has no storage to compare: it is taken as a copy. The gradient's reference is
    plain autograd at a leaf put in the output's place."""
    model, x = Sparse(), torch.randn(3, 4) * (torch.arange(12).reshape(3, 4) % 3 == 0)
    with layertap.tap(model, "sparse", capture=("output", "grad")) as t:
        model(x).sum().backward()
    leaf = x.to_sparse().requires_grad_()
    model.head(leaf.to_dense()).sum().backward()
    assert t["sparse"].layout == torch.sparse_coo and torch.equal(t["sparse"].to_dense(), x)
    torch.testing.assert_close(t.grads["sparse"].to_dense(), leaf.grad.to_dense())


# ---------------------------------------------------------------- memory controls
def test_detach_and_graph():
    model = MLP()
    x = torch.randn(2, 784)
    with layertap.tap(model, "fc1") as t:
        model(x)
    assert not t["fc1"].requires_grad and t["fc1"].grad_fn is None
    with layertap.tap(model, "fc1", detach=False) as t:
        model(x)
    assert t["fc1"].requires_grad
    (g,) = torch.autograd.grad(t["fc1"].sum(), model.fc1.bias)
    torch.testing.assert_close(g, torch.full((256,), 2.0))


def test_dtype_and_device_move():
    model = MLP()
    x = torch.randn(2, 784)
    with layertap.tap(model, ["fc1", "fc2"], dtype=torch.float16, to="meta") as t:
        model(x)
    assert t["fc1"].dtype == torch.float16 and t["fc1"].device.type == "meta"
    with layertap.tap(model, "fc1", dtype=torch.bfloat16) as t:
        model(x)
    torch.testing.assert_close(t["fc1"], model.fc1(x).detach().bfloat16())


def test_reductions_match_manual():
    conv = nn.Sequential(nn.Conv2d(3, 8, 3), nn.Identity())
    x = torch.randn(2, 3, 10, 10)
    ref = conv[0](x).detach()
    cases = {
        "mean": ref.mean((2, 3)),
        "max": ref.amax((2, 3)),
        "flatten": ref.reshape(2, -1),
        (lambda t: t[:, :2]): ref[:, :2],
    }
    for reduce, want in cases.items():
        with layertap.tap(conv, "0", reduce=reduce) as t:
            conv(x)
        torch.testing.assert_close(t["0"], want)


def test_token_reductions():
    tokens = nn.Linear(6, 6)
    x = torch.randn(2, 5, 6)  # [batch, tokens, dim]
    ref = tokens(x).detach()
    for reduce, want in {"mean": ref.mean(1), "cls": ref[:, 0], "max": ref.amax(1)}.items():
        with layertap.tap(nn.Sequential(tokens), "0", reduce=reduce) as t:
            t.model(x)
        torch.testing.assert_close(t["0"], want)
        assert t["0"].shape == (2, 6)
    # cls keeps a copy of the token, not a view holding the whole activation
    assert t["0"].untyped_storage().nbytes() == 2 * 6 * 4 or reduce != "cls"


def test_cls_on_a_map_is_a_clear_error_naming_the_layer():
    with pytest.raises(TapError, match="layer '0' \\(Conv2d\\).*reduce='cls'.*reduce='mean'") as err:
        with layertap.tap(nn.Sequential(nn.Conv2d(1, 2, 1)), "0", reduce="cls") as t:
            t.model(torch.randn(1, 1, 4, 4))
    assert isinstance(err.value.__cause__, ValueError)


def test_unknown_options_are_clear_errors():
    model = MLP()
    with pytest.raises(ValueError, match="unknown reduce"):
        layertap.tap(model, "fc1", reduce="median")
    with pytest.raises(ValueError, match="unknown capture"):
        layertap.tap(model, "fc1", capture="outputs")
    with pytest.raises(ValueError, match="unknown keep"):
        layertap.tap(model, "fc1", keep="every")


# ---------------------------------------------------------------- nested outputs
@dataclasses.dataclass
class Pair:
    left: torch.Tensor
    right: torch.Tensor
    tag: str = "pair"


class Nested(nn.Module):
    def __init__(self, kind):
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(4, 4)

    def forward(self, x):
        a, b = self.lin(x), self.lin(x) * 2
        idx = torch.arange(x.shape[0])
        return {
            "tuple": (a, b, idx),
            "list": [a, [b]],
            "dict": {"a": a, "b": b, "n": 3},
            "dataclass": Pair(a, b),
        }[self.kind]


@pytest.mark.parametrize("kind", ["tuple", "list", "dict", "dataclass"])
def test_nested_outputs_keep_structure_and_controls_apply_to_each_leaf(kind):
    model = nn.Sequential(Nested(kind))
    x = torch.randn(3, 4)
    with layertap.tap(model, "0", dtype=torch.float64, capture=("output", "grad")) as t:
        out = model(x)
        loss = sum(v.sum() for v in layertap.nested.tensors(out) if v.is_floating_point())
        loss.backward()
    got, grads = t["0"], t.grads["0"]
    assert type(got) is type(out)
    a = model[0].lin(x).detach().double()
    leaves = layertap.nested.tensors(got)
    torch.testing.assert_close(leaves[0], a)
    torch.testing.assert_close(leaves[1], 2 * a)
    assert all(v.dtype == torch.float64 for v in leaves if v.is_floating_point())
    assert all(not v.requires_grad for v in leaves)
    # integer leaves are kept, not cast; their gradient slot is None
    if kind == "tuple":
        assert got[2].dtype == torch.int64 and grads[2] is None
    if kind == "dataclass":
        assert got.tag == "pair"
    floats = list(layertap.nested.tensors(grads))
    assert all(torch.all(g == 1) for g in floats)


def test_hugging_face_model_output_structure():
    transformers = pytest.importorskip("transformers")
    config = transformers.BertConfig(
        vocab_size=50, hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32
    )
    model = transformers.BertModel(config).eval()
    ids = torch.randint(0, 50, (2, 7))
    with layertap.tap(model, "", reduce="cls") as t:
        out = model(input_ids=ids)
    got = t[""]
    assert isinstance(got, transformers.modeling_outputs.BaseModelOutputWithPoolingAndCrossAttentions)
    torch.testing.assert_close(got.last_hidden_state, out.last_hidden_state[:, 0])
    torch.testing.assert_close(got.pooler_output, out.pooler_output)  # 2-D: cls is for 3-D only


# ---------------------------------------------------------------- inputs
class KwargModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.inner = Inner()

    def forward(self, x):
        return self.inner(x, scale=torch.tensor(3.0))


class Inner(nn.Module):
    def forward(self, x, scale=1.0):
        return x * scale


def test_input_capture_positional_and_keyword():
    model = KwargModel()
    x = torch.randn(2, 3)
    with layertap.tap(model, "inner", capture="input") as t:
        model(x)
    got = t.inputs["inner"]
    assert isinstance(got, Inputs)
    torch.testing.assert_close(got.args[0], x)
    torch.testing.assert_close(got.kwargs["scale"], torch.tensor(3.0))


def test_input_of_in_place_relu_is_captured_before_it_is_overwritten():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True))
    x = torch.randn(8, 4)
    with layertap.tap(model, "1", capture=("input", "output")) as t:
        model(x)
    pre = model[0](x).detach()
    torch.testing.assert_close(t.inputs["1"], pre)
    assert (t.inputs["1"] < 0).any()
    torch.testing.assert_close(t["1"], pre.clamp(min=0))


def test_grad_input_of_first_layer_and_in_place_relu():
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(inplace=True), nn.Linear(4, 1))
    x = torch.randn(6, 4)  # does not require grad: the tap still gives d score / d input
    with layertap.tap(model, ["0", "1"], capture="grad_input") as t:
        model(x).sum().backward()
    xr = x.clone().requires_grad_()
    h = model[0](xr)
    hr = h.detach().requires_grad_()
    score = model[2](F.relu(hr)).sum()
    (gh,) = torch.autograd.grad(score, hr)
    (gx,) = torch.autograd.grad(h, xr, gh)
    torch.testing.assert_close(t.grad_inputs["1"], gh)
    torch.testing.assert_close(t.grad_inputs["0"], gx)


# ---------------------------------------------------------------- gradients
def test_gradient_with_in_place_relu_after_the_layer_matches_split_reference():
    model = torchvision.models.resnet18().eval()
    x = torch.randn(2, 3, 64, 64)
    target = ["layer3.1.bn2", "layer1.0.bn1"]  # both followed by in-place ops
    with layertap.tap(model, target, capture=("output", "grad")) as t:
        model(x)[:, 3].sum().backward()
    # reference: run layer3.1 by hand, cutting the graph after bn2
    m = model
    with torch.no_grad():
        h = m.layer2(m.layer1(m.maxpool(m.relu(m.bn1(m.conv1(x))))))
        h = m.layer3[0](h)
    blk = m.layer3[1]
    out = blk.relu(blk.bn1(blk.conv1(h)))
    b2 = blk.bn2(blk.conv2(out)).detach().requires_grad_()
    y = blk.relu(b2 + h)
    score = m.fc(torch.flatten(m.avgpool(m.layer4(y)), 1))[:, 3].sum()
    (ref,) = torch.autograd.grad(score, b2)
    torch.testing.assert_close(t.grads["layer3.1.bn2"], ref)
    torch.testing.assert_close(t["layer3.1.bn2"], b2.detach())
    assert t.grads["layer1.0.bn1"].shape == (2, 64, 16, 16)


def test_gradient_on_frozen_model_and_after_the_with_block():
    model = MLP()
    model.requires_grad_(False)
    x = torch.randn(2, 784)
    with layertap.tap(model, "fc1", capture="grad") as t:
        y = model(x)
    y.pow(2).sum().backward()  # the backward may happen after the tap is gone
    h = (x @ model.fc1.weight.T + model.fc1.bias).requires_grad_()
    (ref,) = torch.autograd.grad(model.fc2(model.relu(h)).pow(2).sum(), h)
    torch.testing.assert_close(t.grads["fc1"], ref)
    assert not any(p.requires_grad for p in model.parameters())


@pytest.mark.parametrize("ctx", [torch.no_grad, torch.inference_mode])
def test_gradients_under_no_grad_is_a_clear_error(ctx):
    model = MLP()
    with pytest.raises(TapError, match=r"under torch.no_grad\(\), torch.inference_mode\(\)"):
        with layertap.tap(model, "fc1", capture="grad"), ctx():
            model(torch.randn(1, 784))
    assert hook_state(model) == hook_state(MLP())


def test_stop_early_with_gradients_is_refused():
    with pytest.raises(TapError, match="stop_early"):
        layertap.tap(MLP(), "fc1", capture="grad", stop_early=True)


# ---------------------------------------------------------------- stop_early
def test_stop_early_skips_the_rest_in_execution_order():
    model = torchvision.models.resnet18().eval()
    ran = []
    handles = [
        m.register_forward_pre_hook(lambda mod, a, n=n: ran.append(n))
        for n, m in model.named_children()
    ]
    x = torch.randn(1, 3, 64, 64)
    with layertap.tap(model, ["layer2", "layer1"], stop_early=True) as t:
        model(x)
        pytest.fail("the forward should have stopped")  # pragma: no cover
    for h in handles:
        h.remove()
    assert ran == ["conv1", "bn1", "relu", "maxpool", "layer1", "layer2"]
    with torch.no_grad():
        ref = model.layer2(model.layer1(model.maxpool(model.relu(model.bn1(model.conv1(x))))))
    torch.testing.assert_close(t["layer2"], ref)


def test_stop_early_on_input_capture_stops_before_the_layer_runs():
    model = MLP()
    called = []
    model.fc2.register_forward_hook(lambda *a: called.append(1))
    with layertap.tap(model, "fc2", capture="input", stop_early=True) as t:
        model(torch.randn(1, 784))
    assert called == [] and t.inputs["fc2"].shape == (1, 256)


def test_stop_early_works_forward_after_forward():
    model = MLP()
    with layertap.tap(model, "fc1", stop_early=True, keep="all") as t:
        for _ in range(3):
            with pytest.raises(Exception) as err:
                model(torch.randn(1, 784))
            assert type(err.value).__name__ == "_StopForward"
    assert len(t["fc1"]) == 3


# ---------------------------------------------------------------- edit
def test_edit_ablates_a_channel_downstream():
    model = MLP()
    x = torch.randn(2, 784)

    def ablate(name, out):
        out = out.clone()
        out[:, :10] = 0
        return out

    with layertap.tap(model, "fc1", edit=ablate) as t:
        y = model(x)
    h = model.fc1(x).detach()
    h[:, :10] = 0
    torch.testing.assert_close(y, model.fc2(model.relu(h)))
    torch.testing.assert_close(t["fc1"], h)  # the captured value is what flowed downstream


@pytest.mark.parametrize(
    ("edit", "said"),
    [
        (lambda n, o: o[:, :100], "a [2, 100] float32 on cpu tensor where the layer gave [2, 256] float32 on cpu"),
        (lambda n, o: o.double(), "a [2, 256] float64 on cpu tensor where the layer gave [2, 256] float32 on cpu"),
        (lambda n, o: (o, o), "2 tensor(s) where the layer gave 1"),
    ],
)
def test_an_edit_of_another_shape_or_dtype_is_named_under_the_next_layers_error(edit, said):
    """PyTorch's error comes from fc2 and names neither the edit nor fc1: the tap adds a note that does."""
    model = MLP()
    hooks = hook_state(model)
    with pytest.raises((RuntimeError, TypeError)) as caught, layertap.tap(model, "fc1", edit=edit):
        model(torch.randn(2, 784))
    notes = getattr(caught.value, "__notes__", [])
    assert len(notes) == 1 and f"the edit= of 'fc1' returned {said}." in notes[0], notes
    assert hook_state(model) == hooks


def test_an_error_raised_by_an_edit_is_the_edits_not_the_layers_in_tap_and_extract():
    model, x = MLP(), torch.randn(2, 784)
    with pytest.raises(ZeroDivisionError) as caught, layertap.tap(model, "fc1", edit=lambda n, o: 1 / 0):
        model(x)
    assert caught.value.__notes__ == ["layertap: raised by the edit= function of 'fc1', not by the layer"]
    with pytest.raises(layertap.LayerForwardError, match=r"^layer 'fc1' \(Linear\) raised ZeroDivisionError.*\(layertap: raised by the edit= function of 'fc1', not by the layer\)$"):
        layertap.extract(model, x, "fc2", edit={"fc1": lambda n, o: 1 / 0})
    with pytest.raises(layertap.LayerForwardError, match=r"^layer 'fc2' \(Linear\).*\(layertap: the edit= of 'fc1' returned a \[2, 100\] float32"):
        layertap.extract(model, x, "fc2", edit={"fc1": lambda n, o: o[:, :100]})


def test_an_edit_that_keeps_the_kind_or_an_error_before_any_edit_gets_no_note():
    model = MLP()
    # an op's edit, same shape and dtype: whatever error follows is not the edit's
    with pytest.raises(RuntimeError) as caught, layertap.tap(model, "fc1:linear", edit=lambda n, o: o * 2):
        model(torch.randn(2, 784))
        model(torch.randn(2, 5))  # fc1 itself fails: no edit ran in this forward
    assert not getattr(caught.value, "__notes__", None)
    # an edit that changes the shape on purpose, at the model's end: nothing fails, nothing said
    with layertap.tap(model, "fc2", edit=lambda n, o: o.mean(0)):
        assert model(torch.randn(2, 784)).shape == (10,)


def test_edit_dict_patches_other_layer_and_none_means_unchanged():
    model = MLP()
    x = torch.randn(2, 784)
    patched = torch.randn(2, 256)
    seen = []
    edits = {"fc1": lambda n, o: patched, "relu": lambda n, o: seen.append(n)}
    with layertap.tap(model, "fc2", edit=edits) as t:
        y = model(x)
    torch.testing.assert_close(y, model.fc2(F.relu(patched)))
    assert seen == ["relu"] and list(t) == ["fc2"]


# ---------------------------------------------------------------- lifetime and errors
def test_hooks_removed_after_exception_and_after_success():
    model = torchvision.models.resnet18()
    before = hook_state(model)
    with pytest.raises(RuntimeError):
        with layertap.tap(model, [nn.Conv2d, nn.BatchNorm2d], capture=("input", "output", "grad")):
            model(torch.randn(2, 5, 64, 64))  # wrong channel count
    assert hook_state(model) == before
    with layertap.tap(model, "**", capture=("input", "output", "grad"), keep="all"):
        model(torch.randn(2, 3, 64, 64)).sum().backward()
    assert hook_state(model) == before


def test_never_run_layer_raises_naming_it():
    class Branchy(nn.Module):
        def __init__(self):
            super().__init__()
            self.used = nn.Linear(2, 2)
            self.unused = nn.Linear(2, 2)

        def forward(self, x):
            return self.used(x)

    model = Branchy()
    with layertap.tap(model, ["used", "unused"], capture=("output", "grad")) as t:
        model(torch.randn(1, 2))
    assert list(t) == ["used"] and "unused" not in t
    with pytest.raises(LayerNotRunError, match="'unused' is tapped but has no output"):
        t["unused"]
    with pytest.raises(LayerNotRunError, match="no grad yet.*no backward reached it"):
        t.grads["used"]
    with pytest.raises(LayerNotFoundError, match="matches no layer of the tap. Closest names: used"):
        t["usde"]
    with pytest.raises(TapError, match="capture='input' was not requested"):
        t.inputs["used"]


def test_nested_taps_on_the_same_model():
    model = MLP()
    x = torch.randn(2, 784)
    before = hook_state(model)
    with layertap.tap(model, "fc1", reduce=lambda t: t.amax(1)) as outer:
        with layertap.tap(model, ["fc1", "fc2"]) as inner:
            model(x)
        assert hook_state(model) != before
        model(x)
    assert hook_state(model) == before
    torch.testing.assert_close(outer["fc1"], inner["fc1"].amax(1))
    with pytest.raises(TapError, match="already active"):
        with outer:
            with outer:
                pass


def test_dataparallel_wrapped_model():
    model = MLP()
    dp = nn.DataParallel(model)  # no GPU: DataParallel just calls the module
    x = torch.randn(2, 784)
    with layertap.tap(dp, "fc1") as t:
        dp(x)
    torch.testing.assert_close(t["fc1"], model.fc1(x).detach())
    torch.testing.assert_close(t["module.fc1"], t["fc1"])


def test_stored_values_survive_later_in_place_ops_across_forwards():
    """ResNet's Bottleneck: bn3's output gets `out += identity`; ReLUs are in place."""
    model = torchvision.models.resnet50().eval()
    layers = layertap.select(model, [nn.Conv2d, nn.BatchNorm2d])
    xs = [torch.randn(1, 3, 48, 48) for _ in range(3)]
    ref = {}

    def clone_hook(name):
        def hook(m, a, out):
            ref[name] = out.detach().clone()

        return hook

    with torch.no_grad(), layertap.tap(model, layers) as t:
        for x in xs:  # the 1st forward copies everything; later ones only what is changed in place
            handles = [model.get_submodule(n).register_forward_hook(clone_hook(n)) for n in layers]
            model(x)
            for h in handles:
                h.remove()
            wrong = [n for n in layers if not torch.equal(t[n], ref[n])]
            assert wrong == []
    copied = sorted(n for (kind, n, position), copy in t._inplace.learned.items() if copy)
    assert len(copied) == 49 and all(".bn" in n or n == "bn1" for n in copied)


def test_value_changed_in_place_later_raises_instead_of_lying():
    class Sometimes(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.mutate = False

        def forward(self, x):
            out = self.lin(x)
            if self.mutate:
                out.mul_(0)
            return out + 1

    model = Sometimes()
    with torch.no_grad(), layertap.tap(model, "lin") as t:
        model(torch.randn(1, 3))  # learns: 'lin' is not changed in place
        model(torch.randn(1, 3))
        model.mutate = True
        model(torch.randn(1, 3))
        with pytest.raises(TapError, match="changed in place after it was captured"):
            t["lin"]
        x = torch.randn(1, 3)
        model(x)  # copied from now on
        torch.testing.assert_close(t["lin"], model.lin(x))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="nn.DataParallel replicates only with >= 2 GPUs")
def test_dataparallel_replicas_are_gathered_in_batch_order():
    model = torchvision.models.resnet18().cuda().eval()
    dp = nn.DataParallel(model, device_ids=[0, 1])
    x = torch.randn(6, 3, 64, 64, device="cuda")
    with torch.no_grad(), layertap.tap(dp, ["layer2", "fc"], capture=("input", "output")) as t:
        dp(x)
    with torch.no_grad(), layertap.tap(model, ["layer2", "fc"], capture=("input", "output")) as ref:
        model(x)
    for name in ("layer2", "fc"):
        assert t[name].shape[0] == 6
        torch.testing.assert_close(t[name], ref[name])
        torch.testing.assert_close(t.inputs[name], ref.inputs[name])
    with layertap.tap(dp, "layer4", capture="grad") as t:
        dp(x).sum().backward()
    with layertap.tap(model, "layer4", capture="grad") as ref:
        model(x).sum().backward()
    torch.testing.assert_close(t.grads["layer4"], ref.grads["layer4"])


def test_keep_all_grads_of_a_multi_tensor_output_are_one_entry_per_call():
    model = nn.Sequential(Nested("tuple"))
    with layertap.tap(model, "0", capture="grad", keep="all") as t:
        for _ in range(2):
            a, b, _ = model(torch.randn(3, 4))
            (a.sum() + 3 * b.sum()).backward()
    grads = t.grads["0"]
    assert len(grads) == 2
    for g in grads:
        assert torch.all(g[0] == 1) and torch.all(g[1] == 3) and g[2] is None


def test_a_new_tap_reuses_what_earlier_taps_learned_about_in_place_ops():
    model = torchvision.models.resnet18().eval()
    layers = ["layer1.0.bn1", "layer1.0.conv1"]  # bn1 is followed by an in-place ReLU
    with torch.no_grad(), layertap.tap(model, layers) as first:
        model(torch.randn(1, 3, 32, 32))
    assert first._inplace.learned == {("output", "layer1.0.bn1", 0): True, ("output", "layer1.0.conv1", 0): False}
    second = layertap.tap(model, layers)
    x = torch.randn(1, 3, 32, 32)
    with torch.no_grad(), second:
        model(x)
    assert second._inplace.learned == first._inplace.learned
    [(_, _, guards)] = second._kept.stores["output"].entries["layer1.0.conv1"]
    assert guards  # guarded, not copied: no blanket copy on the new tap's first forward
    with torch.no_grad():
        h = model.maxpool(model.relu(model.bn1(model.conv1(x))))
        conv = model.layer1[0].conv1(h)
        torch.testing.assert_close(second["layer1.0.conv1"], conv)
        torch.testing.assert_close(second["layer1.0.bn1"], model.layer1[0].bn1(conv))


# ---------------------------------------------------------------- reported defects
def clone_at_hook(model, names, kind="output"):
    """Independent reference: plain hooks that clone each call's output (or first input)."""
    got = {n: [] for n in names}
    handles = []
    for n in names:
        m = model.get_submodule(n)
        if kind == "output":
            handles.append(m.register_forward_hook(lambda mod, a, o, n=n: got[n].append(o.detach().clone())))
        else:
            handles.append(m.register_forward_pre_hook(lambda mod, a, n=n: got[n].append(a[0].detach().clone())))
    return got, handles


class EMA(nn.Module):
    """An EMA / weight-norm style wrapper: the model is ``self.module``, as under DDP."""

    def __init__(self, model):
        super().__init__()
        self.module = model

    def forward(self, x):
        return self.module(x)


def test_a_child_named_module_is_tapped_and_read_with_or_without_a_real_wrapper():
    model = EMA(MLP())
    x = torch.randn(2, 784)
    ref, handles = clone_at_hook(model, ["module", "module.fc1"])
    with layertap.tap(model, ["module", "module.fc1"]) as t:
        model(x)
    for h in handles:
        h.remove()
    assert list(t) == ["module", "module.fc1"]
    assert torch.equal(t["module"], ref["module"][0])  # the same forward: bit-exact
    assert torch.equal(t["module.fc1"], ref["module.fc1"][0])
    dp = nn.DataParallel(model)  # CPU: it just calls the module; raw names 'module.module.fc1'
    with layertap.tap(dp, "module.fc1") as t:
        dp(x)
    assert torch.equal(t["module.fc1"], ref["module.fc1"][0])
    assert torch.equal(t["module.module.fc1"], ref["module.fc1"][0])
    assert "module.module.fc1" in t and "fc1" not in t


def lstm_model():
    from torch.nn.utils.rnn import pack_sequence

    class Reader(nn.Module):
        def __init__(self):
            super().__init__()
            self.lstm = nn.LSTM(3, 4)
            self.head = nn.Linear(4, 2)

        def forward(self, seq):
            out, (h, _) = self.lstm(seq)
            return self.head(h[-1]), out

    seqs = [torch.randn(5, 3), torch.randn(2, 3), torch.randn(4, 3)]
    return Reader(), pack_sequence(seqs, enforce_sorted=False)


@pytest.mark.parametrize("to", [None, "meta"])
def test_packed_sequence_moves_only_its_data(to):
    model, seq = lstm_model()
    ref, handles = {}, [model.lstm.register_forward_hook(lambda m, a, o: ref.update(out=o))]
    with torch.no_grad(), layertap.tap(model, "lstm", capture=("input", "output"), to=to) as t:
        model(seq)
    handles[0].remove()
    (packed, (h, _)), (want, (want_h, _)) = t["lstm"], ref["out"]
    assert type(packed) is type(want) and type(t.inputs["lstm"]) is type(seq)
    assert packed.batch_sizes.device.type == "cpu" and packed.batch_sizes.dtype == torch.int64
    assert torch.equal(packed.batch_sizes, want.batch_sizes)
    device = to or "cpu"
    assert packed.data.device.type == device and packed.sorted_indices.device.type == device
    assert packed.data.shape == want.data.shape and h.shape == want_h.shape
    if to is None:  # the same forward: bit-exact
        assert torch.equal(packed.data, want.data) and torch.equal(packed.unsorted_indices, want.unsorted_indices)


def test_packed_sequence_gradient_matches_autograd():
    model, seq = lstm_model()
    with layertap.tap(model, "lstm", capture="grad") as t:
        logits, out = model(seq)
        (logits.sum() + out.data.pow(2).sum()).backward()
    grad, (grad_h, grad_c) = t.grads["lstm"]
    out, (h, _) = model.lstm(seq)
    h_ref = h.detach().requires_grad_()
    (want_h,) = torch.autograd.grad(model.head(h_ref[-1]).sum(), h_ref)
    # the same ops on the same values; float32 defaults of assert_close
    torch.testing.assert_close(grad.data, 2 * out.data.detach())
    assert torch.equal(grad.batch_sizes, seq.batch_sizes) and grad_c is None
    torch.testing.assert_close(grad_h, want_h)


def test_an_error_in_the_taps_own_work_is_a_tap_error_naming_the_layer():
    class Pinned(tuple):
        """A result whose constructor insists on CPU tensors (as PackedSequence does for batch_sizes)."""

        def __new__(cls, values):
            if any(v.device.type != "cpu" for v in values):
                raise ValueError("Pinned holds CPU tensors only")
            return super().__new__(cls, values)

    import torch.utils._pytree as pytree

    pytree.register_pytree_node(Pinned, lambda p: (list(p), None), lambda values, _: Pinned(values))
    try:
        model = nn.Sequential(nn.Linear(2, 2))
        model[0].register_forward_hook(lambda m, a, out: Pinned([out, out * 2]))
        failed = pytest.raises(TapError, match=r"capture the output of layer '0' \(Linear\).*Pinned holds CPU")
        with failed as err, layertap.tap(model, "0", to="meta"):
            model(torch.randn(1, 2))
        assert isinstance(err.value.__cause__, ValueError)
    finally:
        pytree._deregister_pytree_node(Pinned)


@pytest.mark.parametrize("transform", ["vmap", "grad"])
def test_a_forward_inside_a_torch_func_transform_is_refused_naming_it(transform):
    # its tensors are wrappers without memory of their own, and cannot outlive the transform
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU())
    run = torch.func.vmap(model) if transform == "vmap" else torch.func.grad(lambda x: model(x).sum())
    with pytest.raises(TapError, match=r"layer '0' \(Linear\); it ran inside a torch.func transform.*outside the transform"):
        with layertap.tap(model, "0"):
            run(torch.randn(3, 4))
    x = torch.randn(3, 4)
    with layertap.tap(model, "0") as t:  # the same model, outside: captured
        model(x)
    assert torch.equal(t["0"], model[0](x))


@pytest.mark.parametrize("shape", [(2, 5, 4), (1, 3, 3, 4)])  # 3-D tokens, 4-D like swin_v2's cpb_mlp
def test_gradient_of_a_view_output_changed_in_place_matches_autograd(shape):
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(inplace=True), nn.Linear(8, 3))
    x = torch.randn(*shape)
    assert model[0](x)._is_view()  # the case: Linear on a >2-D input returns a view
    weights = torch.randn(*shape[:-1], 3)
    ref, handles = clone_at_hook(model, ["0"])
    with layertap.tap(model, "0", capture=("output", "grad")) as t:
        y = model(x)
        (y * weights).sum().backward()
    with layertap.tap(model, "1", capture="grad_input") as t_in:  # the ReLU changes its own input
        (model(x) * weights).sum().backward()
    handles[0].remove()
    assert torch.equal(t["0"], ref["0"][0])  # the forward itself is unchanged: bit-exact
    h = model[0](x).detach().requires_grad_()  # reference: cut the graph at the layer's output
    (want,) = torch.autograd.grad((model[2](F.relu(h)) * weights).sum(), h)
    assert want.abs().sum() > 0
    # the same ops on the same values; float32 defaults of assert_close
    torch.testing.assert_close(t.grads["0"], want)
    torch.testing.assert_close(t_in.grad_inputs["1"], want)
    torch.testing.assert_close(y, model(x))


def test_gradient_through_a_view_keeps_the_models_own_backward():
    # Sigmoid saves its output for backward; Flatten returns a view of it. The tap must neither
    # bump its version (the backward would fail) nor change the gradient upstream.
    model = nn.Sequential(nn.Conv2d(1, 2, 3), nn.Sigmoid(), nn.Flatten(), nn.Linear(8, 1))
    x = torch.randn(3, 1, 4, 4)
    with layertap.tap(model, "2", capture="grad") as t:
        model(x).sum().backward()
    tapped = model[0].weight.grad.clone()
    model.zero_grad()
    model(x).sum().backward()
    torch.testing.assert_close(model[0].weight.grad, tapped, rtol=0, atol=0)  # the same backward
    torch.testing.assert_close(t.grads["2"], model[3].weight.expand(3, 8))


class Called4Times(nn.Module):
    def __init__(self):
        super().__init__()
        self.c = nn.Linear(3, 3)

    def forward(self, x):
        return [self.c(x + i) for i in range(4)]


def test_keep_all_grads_have_one_entry_per_call_with_none_where_no_backward_reached():
    model = Called4Times()
    xs = [torch.randn(2, 3) for _ in range(2)]

    def loss(outs):  # calls 1 and 3 reach the loss; 0 and 2 do not
        return (outs[1] * 2).sum() + (outs[3] * torch.arange(3.0)).sum()

    with layertap.tap(model, "c", capture="grad", keep="all") as t:
        for x in xs:
            loss(model(x)).backward()
    got = t.grads["c"]
    assert len(got) == 8
    for k, x in enumerate(xs):
        outs = model(x)  # reference: autograd on the same calls
        want = torch.autograd.grad(loss(outs), [outs[1], outs[3]])
        entries = got[4 * k : 4 * k + 4]
        assert entries[0] is None and entries[2] is None
        torch.testing.assert_close(entries[1], want[0], rtol=0, atol=0)  # the same op on the same values
        torch.testing.assert_close(entries[3], want[1], rtol=0, atol=0)
    with layertap.tap(model, "c", capture="grad", keep="all") as t:
        model(xs[0])
    assert "c" not in t.grads
    with pytest.raises(LayerNotRunError, match="no backward reached it"):
        t.grads["c"]


class ChangedOnSecondCall(nn.Module):
    """One layer called twice per forward; only its second output is changed in place."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x):
        a = self.lin(x)
        b = self.lin(x * 2)
        b.mul_(3)
        return a + b


@pytest.mark.parametrize("later", ["last", "all"])
def test_what_a_keep_first_tap_learns_does_not_make_a_later_tap_guard(later):
    model = ChangedOnSecondCall()
    with torch.no_grad(), layertap.tap(model, "lin", keep="first"):
        model(torch.randn(1, 3))  # sees the first call only, which nothing changes in place
    x = torch.randn(1, 3)
    ref, handles = clone_at_hook(model, ["lin"])
    with torch.no_grad(), layertap.tap(model, "lin", keep=later) as t:
        model(x)
    handles[0].remove()
    want = ref["lin"] if later == "all" else ref["lin"][-1]
    got = t["lin"]  # read without TapError, and right: the same forward, bit-exact
    assert all(map(torch.equal, got, want)) if later == "all" else torch.equal(got, want)
    with torch.no_grad(), layertap.tap(model, "lin") as again:  # what both taps learned is reused
        model(x)
    assert torch.equal(again["lin"], ref["lin"][-1])


def test_a_kept_gradient_is_not_a_leafs_grad_that_later_backwards_add_to():
    class Plus(nn.Module):  # its backward passes the gradient on as it is, into x.grad
        def forward(self, x):
            return x + 1

    model = nn.Sequential(Plus())
    x = torch.randn(4, requires_grad=True)
    weights = [torch.randn(4) for _ in range(3)]
    with layertap.tap(model, "0", capture=("grad", "grad_input"), keep="all") as t:
        for w in weights:
            (model(x) * w).sum().backward()
    for kind in ("grads", "grad_inputs"):  # d(x+1)*w/d(x+1) = w, for each backward on its own
        for got, w in zip(getattr(t, kind)["0"], weights):
            torch.testing.assert_close(got, w, rtol=0, atol=0)


def test_keep_all_stores_one_entry_per_call_for_the_parts_of_dataparallel_replicas():
    # white-box (DataParallel replicates only with >= 2 GPUs): two replicas' shares of each call
    t = layertap.tap(MLP(), "fc1", keep="all")
    t._kept.devices, t._kept.gather_device = [0, 1], torch.device("cpu")
    store = t._kept.stores["output"]
    halves = [torch.randn(2, 3) for _ in range(4)]
    for index, (first, second) in enumerate([halves[:2], halves[2:]]):
        t._kept.put(store, "fc1", index, second, [], part=1)  # replicas finish in any order
        t._kept.put(store, "fc1", index, first, [], part=0)
    got = t["fc1"]
    assert len(got) == 2
    assert torch.equal(got[0], torch.cat(halves[:2])) and torch.equal(got[1], torch.cat(halves[2:]))


@pytest.mark.parametrize("dtype", ["float16", "torch.bfloat16", torch.float64])
def test_dtype_accepts_a_torch_dtype_or_its_name(dtype):
    model = nn.Sequential(nn.Linear(3, 3))
    x = torch.randn(2, 3)
    with torch.no_grad(), layertap.tap(model, "0", dtype=dtype) as t:
        model(x)
    want = getattr(torch, dtype.removeprefix("torch.")) if isinstance(dtype, str) else dtype
    assert torch.equal(t["0"], model(x).to(want))


def test_an_unknown_dtype_name_is_refused_in_one_line():
    with pytest.raises(layertap.ArgumentError, match=r"unknown dtype='half16': use a torch dtype or its name, e.g. torch.float16 or 'float16'"):
        layertap.tap(nn.Linear(2, 2), "", dtype="half16")
    for dtype in (torch.int32, "bool", torch.complex64):  # a cast to these truncated every value
        with pytest.raises(layertap.ArgumentError, match=r"^dtype=torch\.\w+ is not a floating-point dtype"):
            layertap.tap(nn.Linear(2, 2), "", dtype=dtype)


@pytest.mark.filterwarnings("ignore:Complex modules:UserWarning", "ignore:ComplexHalf support:UserWarning")
@pytest.mark.parametrize(("dtype", "kept"), [(torch.float16, torch.complex32), (torch.float64, torch.complex128), (torch.bfloat16, torch.complex64)])
def test_dtype_keeps_a_complex_values_imaginary_part(dtype, kept):
    model = nn.Sequential(nn.Linear(3, 3).to(torch.complex64), nn.Linear(3, 2))
    x = torch.randn(2, 3, dtype=torch.complex64)
    with torch.no_grad(), layertap.tap(model, "0", dtype=dtype) as t:
        model[0](x)
    assert t["0"].dtype == kept
    torch.testing.assert_close(t["0"].to(torch.complex64), model[0](x), atol=1e-2, rtol=1e-2)  # float16: 3 digits


def test_every_documented_option_of_tap_is_its_own_parameter_with_its_default():
    # the API reference (mkdocstrings, Google style) shows a documented name missing from the
    # signature as a required parameter: "detach, to, dtype, reduce:" did that
    griffe = pytest.importorskip("griffe", reason="the docs extra is not installed: pip install -e '.[docs]'")
    import inspect

    docstring = griffe.Docstring(inspect.getdoc(layertap.tap), parser="google")
    documented = [p.name for section in docstring.parse() if section.kind.value == "parameters" for p in section.value]
    signature = inspect.signature(layertap.tap).parameters
    assert documented and set(documented) <= set(signature)
    assert {name for name, p in signature.items() if p.default is not inspect.Parameter.empty} <= set(documented)


def test_a_write_through_data_after_the_layer_is_learned_and_copied():
    """``h.data.clamp_(0)`` changes the network's tensor without its version counter: the forward
    that learns the call position compares the copy with the tensor at its end, so the later
    forwards copy the value too (a clone in a plain forward hook is the reference)."""

    class Clamped(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = nn.Linear(4, 4), nn.Linear(4, 4)

        def forward(self, x):
            h = self.a(x)
            h.data.clamp_(min=0)
            return self.b(h)

    torch.manual_seed(0)
    model, x = Clamped(), torch.randn(3, 4)
    seen = []
    handle = model.a.register_forward_hook(lambda m, i, o: seen.append(o.detach().clone()))
    with torch.no_grad(), layertap.tap(model, "a", keep="all") as t:
        for _ in range(3):
            model(x)
    handle.remove()
    assert (seen[0] < 0).any()  # the write would change what was captured
    assert len(t["a"]) == 3 and all(torch.equal(v, ref) for v, ref in zip(t["a"], seen))


def test_a_nested_tensor_that_cannot_be_reduced_names_the_fast_path_and_the_fix():
    from layertap.attention import attention

    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2).eval()  # nested tensors by default
    x, padding = torch.randn(2, 5, 16), torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    with pytest.raises(TapError, match=r"nested tensor \(nn.TransformerEncoder's fast path.*enable_nested_tensor=False"), torch.no_grad():
        with layertap.tap(encoder, "layers.0", reduce="mean"):
            encoder(x, src_key_padding_mask=padding)
    with pytest.raises(TapError, match=r"nested tensor.*enable_nested_tensor=False"), torch.no_grad():
        with attention(encoder, "layers.0.self_attn"):
            encoder(x, src_key_padding_mask=padding)
    assert hook_state(encoder) == hook_state(nn.TransformerEncoder(nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2))


def test_a_failing_observe_function_is_named_among_the_fixes():
    def observe(name, kind, call, value):
        raise ValueError("my bug")

    model = MLP()
    with pytest.raises(TapError, match=r"or the observe= function.*ValueError: my bug"):
        with layertap.tap(model, "fc1", observe=observe):
            model(torch.randn(1, 784))
    assert hook_state(model) == hook_state(MLP())
