"""Gradient taps leave nothing behind on tensors that outlive them: the caller's inputs, parameters."""

import pytest
import torch
from torch import nn

import layertap


def hooks(t: torch.Tensor) -> int:
    return len(t._backward_hooks or {})


def model_and_reference():
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 1))

    def grad_wrt_input(x: torch.Tensor) -> torch.Tensor:
        xr = x.detach().requires_grad_()  # reference: plain autograd on a copy of the input
        (g,) = torch.autograd.grad(model(xr).sum(), xr)
        return g

    return model, grad_wrt_input


@pytest.mark.parametrize("leaf", [True, False])
def test_many_grad_input_taps_leave_no_hook_on_the_callers_input(leaf):
    model, reference = model_and_reference()
    source = torch.randn(5, 3, requires_grad=True)
    x = source if leaf else source * 2  # the caller's own tensor: a leaf, or made by its own graph
    taps = []
    for _ in range(100):
        with layertap.tap(model, "0", capture="grad_input", keep="all") as t:
            model(x).sum().backward(retain_graph=not leaf)
        taps.append(t)
    assert hooks(x) == 0 and hooks(source) == 0
    want = reference(x)
    for t in (taps[0], taps[-1]):
        (got,) = t.grad_inputs["0"]
        torch.testing.assert_close(got, want, rtol=0, atol=0)  # the same ops on the same values
    # a later backward through the caller's tensor calls nothing of layertap's
    model(x).sum().backward()
    assert all(len(t.grad_inputs["0"]) == 1 for t in taps)


def test_a_parameter_fed_to_a_tapped_layer_gets_no_hook():
    class Queries(nn.Module):
        def __init__(self):
            super().__init__()
            self.query = nn.Parameter(torch.randn(2, 3))
            self.proj = nn.Linear(3, 3)

        def forward(self, x):
            return self.proj(self.query) + x

    model = Queries()
    for _ in range(10):
        with layertap.tap(model, "proj", capture=("grad_input", "grad")) as t:
            model(torch.randn(2, 3)).pow(2).sum().backward()
    assert hooks(model.query) == 0
    q = model.query.detach().requires_grad_()  # reference: autograd on the same values
    x = torch.randn(2, 3)
    with layertap.tap(model, "proj", capture="grad_input") as t:
        model(x).pow(2).sum().backward()
    (want,) = torch.autograd.grad((model.proj(q) + x).pow(2).sum(), q)
    torch.testing.assert_close(t.grad_inputs["proj"], want, rtol=0, atol=0)


def test_backward_after_the_block_still_reaches_every_tapped_layer_and_leaves_no_hook():
    model, reference = model_and_reference()
    x = torch.randn(5, 3, requires_grad=True) * 1  # not a leaf: the caller's own tensor
    with layertap.tap(model, ["0", "2"], capture="grad_input") as t:
        y = model(x)
    y.sum().backward()
    h = torch.tanh(model[0](x)).detach().requires_grad_()
    (want,) = torch.autograd.grad(model[2](h).sum(), h)
    torch.testing.assert_close(t.grad_inputs["2"], want, rtol=0, atol=0)  # the same ops on the same values
    # the hook is on an alias this forward made, not on the caller's tensor
    torch.testing.assert_close(t.grad_inputs["0"], reference(x), rtol=0, atol=0)
    assert hooks(x) == 0
