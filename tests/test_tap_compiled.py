"""Compiled models under a tap: a compiled module inside the tapped model runs eagerly while
tapped; code compiled before the tap skips its hooks (named where the layer seems not to run); a
compiled wrapper outside the tapped model with fullgraph=True is refused in one line. Each fix
the messages name is checked to work."""

import pytest
import torch
from models import MLP
from torch import nn

import layertap


@pytest.fixture(autouse=True)
def fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("how", ["torch.compile", "Module.compile"])
def test_compiled_model_is_tapped_not_silently_ignored(how):
    model = MLP()
    x = torch.randn(2, 784)
    if how == "torch.compile":
        compiled = torch.compile(model, backend="eager")
    else:
        compiled = model
        compiled.compile(backend="eager")
    compiled(x)  # compiled once, without hooks
    with layertap.tap(compiled, "fc1", capture=("output", "grad")) as t:
        compiled(x).sum().backward()
    torch.testing.assert_close(t["fc1"], model.fc1(x).detach())
    assert t.grads["fc1"].shape == (2, 256)
    # afterwards the compiled path is back
    if how == "torch.compile":
        assert compiled.forward is not model.__call__ and "forward" in compiled.__dict__
    else:
        assert model._compiled_call_impl is not None
    torch.testing.assert_close(compiled(x), model.fc2(model.relu(model.fc1(x))))


def test_a_function_compiled_before_the_tap_is_named_where_the_layer_seems_not_to_have_run():
    """Dynamo does not guard compiled code on hooks added later: a compiled training step runs the
    model without the tap's hooks. Reading the layer says so, with the fixes, which work."""
    model = MLP()
    x = torch.randn(2, 784)
    step = torch.compile(lambda t: model(t), backend="eager")
    step(x)
    with layertap.tap(model, "fc1") as t:
        step(x)
    with pytest.raises(layertap.LayerNotRunError, match=r"code torch.compile made before the tap started \(a compiled function.*torch._dynamo.reset\(\) after starting the tap"):
        t["fc1"]
    with layertap.tap(model, "fc1") as t:
        torch._dynamo.reset()
        step(x)
    torch.testing.assert_close(t["fc1"], model.fc1(x).detach())
    torch._dynamo.reset()


def test_a_fullgraph_wrapper_of_a_tapped_model_is_refused_in_one_line_and_the_fix_works():
    """``torch.compile(model, fullgraph=True)`` called while ``model`` is tapped: Dynamo traces the
    hooks and cannot (a 40-line trace). One line names the fix: tap the compiled module."""
    model = MLP()
    x = torch.randn(2, 784)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    with pytest.raises(layertap.TapError, match=r"fullgraph=True.*Tap the compiled module itself") as caught:
        with layertap.tap(model, "relu"):
            compiled(x)
    assert caught.value.__suppress_context__ and "\n" not in str(caught.value)
    with layertap.tap(compiled, "relu") as t:
        y = compiled(x)
    torch.testing.assert_close(t["relu"], model.relu(model.fc1(x)).detach())
    torch.testing.assert_close(y, model(x))


def test_a_wrapper_compiled_before_the_tap_of_the_model_inside_is_named_and_the_fix_works():
    """Dynamo guards a user-defined forward on the hooks (it retraces them: the one-line error
    above), but not nn.Sequential's: its graph runs on, skipping the hooks."""
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10))
    x = torch.randn(2, 784)
    compiled = torch.compile(model, backend="eager", fullgraph=True)
    compiled(x)
    with layertap.tap(model, "0") as t:
        compiled(x)
    with pytest.raises(layertap.LayerNotRunError, match=r"torch.compile\(model\) wrapper of a model tapped inside it.*layertap.tap\(compiled"):
        t["0"]
    with layertap.tap(compiled, "0") as t:
        compiled(x)
    torch.testing.assert_close(t["0"], model[0](x).detach())
