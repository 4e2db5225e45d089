"""`layertap.runtime.running`: the one way layertap runs a model, autograd as asked, a failure named."""

from __future__ import annotations

import pytest
import torch

from layertap.errors import LayerForwardError
from layertap.runtime import run_model, running


@pytest.fixture
def model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))


@pytest.mark.parametrize("outside", [True, False])
def test_autograd_off_on_or_as_the_caller_has_it(model, outside):
    x = torch.randn(3, 4)
    with torch.set_grad_enabled(outside):
        for grad, expected in ((False, False), (True, True), (None, outside)):
            with running(model, grad=grad):
                out = run_model(model, x)
            assert out.requires_grad is expected, (grad, outside)
            assert torch.is_grad_enabled() is outside  # the caller's mode, back
            torch.testing.assert_close(out.detach(), model(x).detach(), rtol=0, atol=0)  # the same computation


@pytest.mark.parametrize("grad", [False, True])
def test_the_callers_mode_is_back_even_after_a_hook_turned_autograd_on(model, grad):
    # CAM's first chosen layer turns autograd on mid-forward; that must not outlive the forward
    def start_graph(module, args, out):
        torch.set_grad_enabled(True)

    handle = model[1].register_forward_hook(start_graph)
    try:
        with torch.no_grad():
            with running(model, grad=grad):
                out = run_model(model, torch.randn(3, 4))
            assert not torch.is_grad_enabled()
    finally:
        handle.remove()
    assert out.requires_grad  # the hook took effect: the layers after it ran with autograd


def test_a_failure_inside_names_its_layer_and_chains_the_original():
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(5, 2))
    with pytest.raises(LayerForwardError, match=r"layer '1' \(Linear\) raised RuntimeError.*\[\[3, 8\]\]") as info:
        with running(model):
            run_model(model, torch.randn(3, 4))
    assert isinstance(info.value.__cause__, RuntimeError)
    assert torch.is_grad_enabled()  # left as it was, after the failure too
