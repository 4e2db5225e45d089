"""One definition of a gradient: ``grad`` is the gradient that flows back through a layer's output
edge, ``grad_input`` the one that flows into its input through the layer alone, whatever kind of
tensor carries them (plain, view, leaf, one tensor given twice, a layer returning its input), and
in-place ops stay safe.

References: ``register_full_backward_hook`` (its ``grad_output`` and ``grad_input``) where it works,
its out-of-place twin where the layer is in place, and on the zoo a two-clone reference: the layer
is given a clone of a clone of each input, and returns a clone of a clone of each output, and
autograd differentiates the score with respect to the outer clones, which only that edge reads.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torchvision
from torch import nn
from zoo_models import fast_build

import layertap
from layertap import Inputs

# the same math on the same values, summed in another order across the graph's branches
TOL = {"rtol": 1e-5, "atol": 1e-6}


def first(gs):
    """A full backward hook's tuple for a one-tensor edge, or the tuple."""
    return gs[0] if len(gs) == 1 else gs


def full_hook_reference(model, names, run):
    """``grad_output`` and ``grad_input`` from full backward hooks, one entry per call."""
    got = {n: {"grad": [], "grad_input": []} for n in names}

    def hook(n):
        def record(module, grad_input, grad_output):
            got[n]["grad"].append(first(grad_output))
            got[n]["grad_input"].append(first(grad_input))

        return record

    handles = [model.get_submodule(n).register_full_backward_hook(hook(n)) for n in names]
    try:
        run()
    finally:
        for h in handles:
            h.remove()
    return got


def tapped(model, names, run):
    with layertap.tap(model, names, capture=("grad", "grad_input"), keep="all") as t:
        run()
    return {n: {"grad": t.grads[n], "grad_input": t.grad_inputs[n]} for n in names}


def grads_of(value):
    """The gradients of a tap entry as a flat tuple (an ``Inputs`` entry by its args)."""
    if isinstance(value, Inputs):
        value = value.args
    return tuple(value) if isinstance(value, (tuple, list)) else (value,)


def assert_same(got, want):
    for n in want:
        for kind in ("grad", "grad_input"):
            assert len(got[n][kind]) == len(want[n][kind]), (n, kind)
            for g, w in zip(got[n][kind], want[n][kind]):
                for a, b in zip(grads_of(g), grads_of(w), strict=True):
                    torch.testing.assert_close(a, b, **TOL, msg=lambda m, n=n, kind=kind: f"{n} {kind}: {m}")


# ----------------------------------------------------------------- small models, full backward hooks
class UsedElsewhere(nn.Module):
    """Each tapped layer's input is also read by another branch, and the layers return tensors of every kind."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)
        self.same = nn.Identity() if kind != "dropout" else nn.Dropout(0.5)  # eval: returns its input
        self.pair = nn.Bilinear(4, 4, 4)

    def forward(self, x):
        # plain: a's output; view: Linear on 3-D returns a view; leaf: the caller's x itself
        h = x if self.kind == "leaf" else self.a(x)
        return (self.b(h) * 2 + self.same(h) * 5 + self.pair(h, h) * 7 + h * 3).sum(-1)


@pytest.mark.parametrize("kind", ["plain", "view", "leaf", "dropout"])
def test_grad_and_grad_input_equal_full_backward_hooks_when_the_input_is_used_elsewhere(kind):
    model = UsedElsewhere(kind).eval()
    shape = (2, 3, 4) if kind == "view" else (3, 4)
    x = torch.randn(*shape, requires_grad=kind == "leaf")
    if kind == "view":
        assert model.a(x)._is_view()
    weights = torch.randn(shape[:-1])

    def run():
        (model(x) * weights).sum().backward()

    names = ["b", "same", "pair"]
    want = full_hook_reference(model, names, run)
    got = tapped(model, names, run)
    assert_same(got, want)
    # the case: the tensor's own gradient is the sum over its uses, not b's share of it
    with layertap.tap(model, "a", capture="grad") as total:
        run()
    if kind != "leaf":
        assert not torch.allclose(got["b"]["grad_input"][0], total.grads["a"])


def test_an_identity_returning_its_input_gets_the_gradient_of_its_own_output_edge():
    class Shortcut(nn.Module):  # ResNet without a downsample: the identity's input is also the block's shortcut
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.skip = nn.Identity()

        def forward(self, x):
            h = self.lin(x)
            return self.skip(h) * 2 + h.square()

    model = Shortcut()
    x = torch.randn(4, 3)

    def run():
        model(x).sum().backward()

    want = full_hook_reference(model, ["skip"], run)
    got = tapped(model, ["skip"], run)
    assert_same(got, want)
    torch.testing.assert_close(got["skip"]["grad"][0], torch.full((4, 3), 2.0), rtol=0, atol=0)  # d(2 id(h))/d id(h)


def test_each_output_leaf_is_its_own_edge_even_when_the_layer_reads_it_too():
    class Heads(nn.Module):  # returns h twice and a head of h: no leaf's gradient is h's own
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)
            self.head = nn.Linear(3, 2)

        def forward(self, x):
            h = self.lin(x)
            return h, self.head(h), h

    class Outer(nn.Module):
        def __init__(self):
            super().__init__()
            self.heads = Heads()

        def forward(self, x):
            h, y, again = self.heads(x)
            return (h * 2).sum() + (y * 3).sum() + (again * 5).sum()

    model = Outer()
    x = torch.randn(4, 3, requires_grad=True)

    def run():
        model(x).backward()

    names = ["heads", "heads.lin"]
    got = tapped(model, names, run)
    assert_same(got, full_hook_reference(model, names, run))
    assert [float(g.unique()) for g in got["heads"]["grad"][0]] == [2.0, 3.0, 5.0]


def test_a_parent_and_its_last_child_share_the_output_edge():
    model = nn.Sequential(nn.Linear(3, 3), nn.Sequential(nn.Tanh(), nn.Linear(3, 2)))
    x = torch.randn(4, 3, requires_grad=True)  # a full backward hook gives no grad_input for an input that needs none

    def run():
        model(x).pow(2).sum().backward()

    names = ["1", "1.1", "0"]
    assert_same(tapped(model, names, run), full_hook_reference(model, names, run))


# ----------------------------------------------------------------- in place
class InPlace(nn.Module):
    """An in-place activation whose input was read before it, and is read again after it by name."""

    def __init__(self, inplace: bool, statement: bool = False) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.act = nn.ReLU(inplace=inplace)
        self.b = nn.Linear(4, 4)
        self.statement = statement
        self.probe = None

    def forward(self, x):
        h = self.a(x)
        before = h * 3  # reads h before the activation changes it
        if self.statement:  # the activation's result is read through h itself
            self.act(h)
            r = h
        else:
            r = self.act(h)
        if self.probe is not None:
            r.register_hook(self.probe)
        return self.b(r) * 2 + before + r


@pytest.mark.parametrize("capture", [("grad", "grad_input"), ("grad_input",), ("grad",)])
def test_an_in_place_layer_gets_the_gradients_of_its_out_of_place_twin(capture):
    x = torch.randn(5, 4)
    twin = InPlace(inplace=False)
    model = InPlace(inplace=True)
    model.load_state_dict(twin.state_dict())
    want = full_hook_reference(twin, ["act"], lambda: twin(x).sum().backward())
    with layertap.tap(model, "act", capture=capture) as t:
        model(x).sum().backward()
    for kind in capture:
        torch.testing.assert_close(getattr(t, kind + "s")["act"], want["act"][kind][0], **TOL)
    # and the model's own gradients are those of the untapped model
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad, q.grad, **TOL)


def test_a_layer_that_changes_its_input_in_place_leaves_the_callers_tensor_with_its_history():
    # the caller reads the activation's result through its own name: the tap gives the layer an
    # alias, and must give the caller's tensor the in-place op's history back
    x = torch.randn(5, 4)
    model = InPlace(inplace=True, statement=True)
    seen = {}
    model.probe = lambda g: seen.update(after=g)  # d score / d (h after the ReLU), by plain autograd
    h = model.a(x).detach()
    model(x).sum().backward()
    want_params = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    with layertap.tap(model, "act", capture=("grad", "grad_input")) as t:
        model(x).sum().backward()
    for p, w in zip(model.parameters(), want_params):  # the model's own backward is unchanged
        torch.testing.assert_close(p.grad, w, rtol=0, atol=0)
    # through the layer: the ReLU's backward of the gradient at its result, whoever reads it
    torch.testing.assert_close(t.grad_inputs["act"], seen["after"] * (h > 0), rtol=0, atol=0)


def test_an_in_place_op_changing_its_input_keeps_the_models_gradients():
    class Block(nn.Module):  # `h += x` used as a statement: the sum is read through h
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(4, 4)

        def forward(self, x):
            h = self.lin(x)
            h.add_(x)
            return (h * h).sum()

    model = Block()
    x = torch.randn(3, 4, requires_grad=True)
    model(x).backward()
    want = [p.grad.clone() for p in (*model.parameters(), x)]
    model.zero_grad()
    x.grad = None
    with layertap.tap(model, ":add_", capture=("grad", "grad_input")) as t:
        model(x).backward()
    for p, w in zip((*model.parameters(), x), want):
        torch.testing.assert_close(p.grad, w, rtol=0, atol=0)
    s = (model.lin(x) + x).detach()
    torch.testing.assert_close(t.grad_inputs[":add_"].args[0], 2 * s, **TOL)
    torch.testing.assert_close(t.grad_inputs[":add_"].args[1], 2 * s, **TOL)


def test_an_op_returning_its_input_gets_its_own_output_edge():
    class Contig(nn.Module):  # contiguous() of a contiguous tensor returns that tensor
        def __init__(self):
            super().__init__()
            self.lin = nn.Linear(3, 3)

        def forward(self, x):
            h = self.lin(x)
            return (h.contiguous() * 2 + h.square()).sum()

    model = Contig()
    with layertap.tap(model, ":contiguous", capture=("grad", "grad_input")) as t:
        model(torch.randn(4, 3)).backward()
    torch.testing.assert_close(t.grads[":contiguous"], torch.full((4, 3), 2.0), rtol=0, atol=0)
    torch.testing.assert_close(t.grad_inputs[":contiguous"], torch.full((4, 3), 2.0), rtol=0, atol=0)


# ----------------------------------------------------------------- the zoo, two-clone reference
def two_clone_reference(model, names, run):
    """d score / d each edge of each call of ``names``, by autograd through two clones per tensor."""
    edges = {n: {"grad": [], "grad_input": []} for n in names}
    handles = []

    def outer(t):  # what autograd differentiates: only the inner clone reads it
        return t.clone() if t.requires_grad else t.detach().requires_grad_()

    def pre(n):
        def hook(module, args, kwargs):
            kept = []

            def swap(t):
                if not (isinstance(t, torch.Tensor) and t.is_floating_point()):
                    return t
                o = outer(t)
                kept.append(o)
                return o.clone()

            args, kwargs = torch.utils._pytree.tree_map(swap, (args, kwargs))
            edges[n]["grad_input"].append(kept)
            return args, kwargs

        return hook

    def post(n):
        def hook(module, args, output):
            kept = []

            def swap(t):
                o = outer(t)
                kept.append(o)
                return o.clone()

            edges[n]["grad"].append(kept)
            return torch.utils._pytree.tree_map_only(torch.Tensor, swap, output)

        return hook

    for n in names:
        m = model.get_submodule(n)
        handles.append(m.register_forward_pre_hook(pre(n), with_kwargs=True))
        handles.append(m.register_forward_hook(post(n)))
    try:
        score = run()
    finally:
        for h in handles:
            h.remove()
    flat = [o for n in names for kind in ("grad", "grad_input") for call in edges[n][kind] for o in call]
    grads = iter(torch.autograd.grad(score, flat, allow_unused=True))
    return {n: {kind: [tuple(next(grads) for _ in call) for call in edges[n][kind]] for kind in ("grad", "grad_input")} for n in names}


ZOO = {
    # conv1's input is the block input, also read by the downsample shortcut; bn3 is followed by
    # `out += identity`; relu is one in-place module called three times per block
    "resnet50": ["layer4.0.conv1", "layer4.0", "layer1.0.bn3", "layer1.0.relu", "layer1.0.downsample"],
    # a dense layer's input is a list of tensors every later layer reads too
    "densenet121": ["features.denseblock1.denselayer2", "features.denseblock1.denselayer2.norm1", "features.transition1.conv"],
    # norm1 gets a view; stochastic depth in eval returns its input
    "swin_t": ["features.1.0.norm1", "features.1.0.attn", "features.1.0.stochastic_depth", "features.5.1.norm2"],
    # the inverted residual's input is also added to its block's result; SE multiplies its input
    "mobilenet_v3_small": ["features.3.block", "features.3.block.0", "features.1.block.1"],
    # the block's input is also the residual (`result += input`); the block's LayerNorm gets a view
    "convnext_tiny": ["features.1.1.block", "features.1.0.block.3", "features.1.0.stochastic_depth"],
}


@pytest.mark.parametrize("arch", list(ZOO))
def test_zoo_gradients_equal_the_two_clone_reference(arch, one_thread):
    torch.manual_seed(0)
    model = fast_build(getattr(torchvision.models, arch)).eval()
    x = torch.randn(1, 3, 64, 64)
    weights = torch.randn(1000)
    names = ZOO[arch]

    def run():
        return (model(x) * weights).sum()

    want = two_clone_reference(model, names, run)
    got = tapped(model, names, lambda: run().backward())
    for n in names:
        for kind in ("grad", "grad_input"):
            assert len(got[n][kind]) == len(want[n][kind]) >= 1, (n, kind)
            for g, w in zip(got[n][kind], want[n][kind]):
                leaves = [t for t in torch.utils._pytree.tree_leaves(g) if isinstance(t, torch.Tensor)]
                assert len(leaves) == len(w), (n, kind)
                for a, b in zip(leaves, w):
                    scale = b.abs().max().item()
                    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5 * scale, msg=lambda m, n=n, kind=kind: f"{arch} {n} {kind}: {m}")


def test_grad_input_of_a_layer_fed_token_ids_says_its_input_carries_none():
    """register_full_backward_hook gives grad_input (None,) for an Embedding: the backward reached
    the layer (its grad is there), its integer input carries no gradient."""
    torch.manual_seed(0)
    net = nn.Sequential(nn.Embedding(10, 4), nn.Linear(4, 1))
    ids = torch.randint(0, 10, (2, 3))
    seen = {}
    handle = net[0].register_full_backward_hook(lambda m, grad_input, grad_output: seen.update(gi=grad_input))
    net(ids).sum().backward()
    handle.remove()
    assert seen["gi"] == (None,)
    with layertap.tap(net, "0", capture=("grad", "grad_input")) as t:
        net(ids).sum().backward()
    assert t.grads["0"].shape == (2, 3, 4)
    with pytest.raises(layertap.LayerNotRunError, match=r"layer '0' has no grad_input: its input holds no floating-point tensor \(int64\)"):
        t.grad_inputs["0"]


class PassedOn(nn.Module):
    """An eval Dropout passes its input on; ReLU(inplace=True) changes it; the residual reads it again."""

    def __init__(self, middle: nn.Module) -> None:
        super().__init__()
        self.a, self.middle, self.act, self.b = nn.Linear(8, 8), middle, nn.ReLU(inplace=True), nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.a(x)
        return self.b(self.act(self.middle(h))) + h


@pytest.mark.parametrize("capture", ["grad", "grad_input"])
@pytest.mark.parametrize("middle", [nn.Dropout(0.5), nn.Flatten(1)], ids=["returns-its-input", "returns-a-view"])
def test_an_in_place_op_on_a_passed_on_input_is_warned_of(middle, capture):
    # the one case the aliases cannot keep exact (docs/correctness.md): the model's own gradients
    # differ while tapped, and the tap says so, naming the layer
    torch.manual_seed(0)
    model, x = PassedOn(middle).eval(), torch.randn(4, 8)
    model(x).pow(2).sum().backward()
    expected = model.a.weight.grad.clone()
    model.zero_grad()
    with pytest.warns(UserWarning, match=r"layer 'middle' returned \(a view of\) its input.*in place"):
        with layertap.tap(model, "middle", capture=capture):
            model(x).pow(2).sum().backward()
    assert not torch.allclose(model.a.weight.grad, expected)  # what the warning is about
    model.act.inplace = False  # no in-place op after it: nothing to warn of, the same gradients
    model.zero_grad()
    model(x).pow(2).sum().backward()
    expected = model.a.weight.grad.clone()
    model.zero_grad()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with layertap.tap(model, "middle", capture=capture):
            model(x).pow(2).sum().backward()
    torch.testing.assert_close(model.a.weight.grad, expected)


def test_an_input_that_carries_no_gradient_is_not_warned_of():
    class NoGradientBefore(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.middle, self.b = nn.Identity(), nn.Linear(8, 8)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            h = x * 2  # no parameter before: nothing upstream to lose a gradient
            return self.b(self.middle(h).relu_()) + h

    model = NoGradientBefore()
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        with layertap.tap(model, "middle", capture="grad") as t:
            model(torch.randn(4, 8)).sum().backward()
    assert t.grads["middle"].shape == (4, 8)
