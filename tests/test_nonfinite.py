"""find_nonfinite: the first layer whose output (forward) or output gradient (backward) is NaN/Inf."""

import copy

import pytest
import torch
import torchvision
from torch import nn

import layertap
from conftest import hook_state


class Log(nn.Module):
    def forward(self, x):
        return torch.log(x)  # NaN for negative inputs


class Ratio(nn.Module):
    def forward(self, x):
        return x / (x - x)  # a division by zero: NaN (0/0) and Inf


class Sqrt(nn.Module):
    def forward(self, x):
        return torch.sqrt(x)  # finite at 0, but its gradient there is Inf


class Block(nn.Module):
    def __init__(self, inner):
        super().__init__()
        self.fc = nn.Linear(6, 6)
        self.inner = inner

    def forward(self, x):
        return self.inner(self.fc(x)) + 1


class OwnLog(nn.Module):
    """A NaN made by a functional op in the model's own forward, between two submodules."""

    def __init__(self):
        super().__init__()
        self.fc1 = nn.Linear(4, 4)
        self.fc2 = nn.Linear(4, 2)

    def forward(self, x):
        return self.fc2(torch.log(self.fc1(x)))


def test_forward_log_of_a_negative_value_is_located():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), Log(), nn.Linear(4, 2))
    x = torch.randn(8, 4)
    report = layertap.find_nonfinite(model, x)
    assert (report.phase, report.layer, report.module_type, report.call) == ("forward", "1", "Log", 0)
    h = model[0](x).detach()
    expected_nan = torch.log(h).isnan().float().mean().item()
    assert report.value.nan_fraction == pytest.approx(expected_nan) and expected_nan > 0
    # its input was finite, with the negative values that made the NaN
    [given] = report.inputs
    assert given.nonfinite_fraction == 0 and given.min == pytest.approx(h.min().item())
    assert report.previous.layer == "0" and report.previous.max == pytest.approx(h.max().item())
    assert "layer '1' (Log, call 0)" in str(report)


def test_forward_division_by_zero_deep_inside_containers():
    torch.manual_seed(1)
    model = nn.Sequential(nn.Linear(6, 6), nn.Sequential(Block(nn.Tanh()), Block(Ratio())), nn.Linear(6, 3))
    report = layertap.find_nonfinite(model, torch.randn(5, 6))
    # the innermost module that made it, not the containers that returned it afterwards
    assert (report.layer, report.module_type) == ("1.1.inner", "Ratio")
    assert report.value.nan_fraction + report.value.inf_fraction == 1.0
    assert report.previous.layer == "1.1.fc"


def test_functional_op_between_modules_is_reported_at_its_consumer():
    torch.manual_seed(2)
    report = layertap.find_nonfinite(OwnLog(), torch.randn(8, 4))
    assert report.layer == "fc2" and report.inputs[0].nan_fraction > 0
    assert "outside any module" in str(report)


def test_backward_nonfinite_gradient_is_located_and_no_grad_is_written():
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), Sqrt(), nn.Linear(8, 1))
    x = torch.randn(16, 4)
    assert layertap.find_nonfinite(model, x) is None  # the forward is finite
    report = layertap.find_nonfinite(model, x, loss_fn=lambda out: out.sum())
    # sqrt's backward at the ReLU's zeros makes Inf: the ReLU's output gradient is the first bad one
    assert (report.phase, report.layer, report.module_type) == ("backward", "1", "ReLU")
    assert report.previous.layer == "2" and report.previous.nonfinite_fraction == 0
    # the reference: autograd's own gradient with respect to the ReLU output
    h = model[1](model[0](x)).detach().requires_grad_()
    (grad,) = torch.autograd.grad(model[3](torch.sqrt(h)).sum(), h)
    assert report.value.inf_fraction == pytest.approx(grad.isinf().float().mean().item()) and grad.isinf().any()
    assert report.inputs[0].shape == (16, 8)  # the ReLU's forward input
    assert all(p.grad is None for p in model.parameters())
    assert "backward" in str(report) and "output gradient" in str(report)


def test_resnet_finite_then_a_corrupt_batchnorm_and_no_hooks_left():
    torch.manual_seed(4)
    model = torchvision.models.resnet18(num_classes=10)  # in-place ReLUs, train-mode BatchNorm
    before = hook_state(model)
    x, y = torch.randn(2, 3, 32, 32), torch.tensor([1, 3])
    assert layertap.find_nonfinite(model, x, loss_fn=lambda out: nn.functional.cross_entropy(out, y)) is None
    assert hook_state(model) == before
    model.eval()
    model.layer3[0].bn1.running_var[7] = -1.0  # a corrupt checkpoint: sqrt of a negative variance
    report = layertap.find_nonfinite(model, x)
    assert (report.layer, report.module_type) == ("layer3.0.bn1", "BatchNorm2d")
    assert report.previous.layer == "layer3.0.conv1" and report.inputs[0].nonfinite_fraction == 0
    assert report.value.nan_fraction == pytest.approx(1 / 256)  # one channel of 256
    assert hook_state(model) == before


def test_loss_fn_must_give_a_scalar():
    model = nn.Linear(3, 2)
    with pytest.raises(ValueError, match="one-element tensor"):
        layertap.find_nonfinite(model, torch.randn(4, 3), loss_fn=lambda out: out)
    with pytest.raises(TypeError, match="loss_fn goes with inputs"):
        layertap.find_nonfinite(model, loss_fn=lambda out: out.sum())


def _step(model, x, y):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss.detach()


def test_context_manager_around_training_steps():
    torch.manual_seed(5)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 1))
    x, y = torch.randn(16, 4), torch.randn(16, 1)
    reference = copy.deepcopy(model)

    with layertap.find_nonfinite(model) as check:
        loss = _step(model, x, y)
    assert check.report is None
    # the watch changes nothing: same loss and same updated weights as an unwatched step
    assert torch.equal(loss, _step(reference, x, y))
    for p, q in zip(model.parameters(), reference.parameters()):
        assert torch.equal(p, q)

    with torch.no_grad():
        model[2].weight[0, 3] = float("inf")
    with layertap.find_nonfinite(model) as check:
        _step(model, x, y)
    assert (check.report.phase, check.report.layer) == ("forward", "2")

    # a step whose forward is finite but whose backward is not
    sick = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), Sqrt(), nn.Linear(8, 1))
    with layertap.find_nonfinite(sick) as check:
        _step(sick, x, y)
    assert (check.report.phase, check.report.layer) == ("backward", "1")


class Shifted(nn.Module):
    """A NaN made by an op inside a module's own forward (the log of a negative value)."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)

    def forward(self, x):
        return self.fc(torch.log(x - 5))


class WithBlock(nn.Module):
    def __init__(self):
        super().__init__()
        self.stem = nn.Linear(4, 4)
        self.block = Shifted()
        self.head = nn.Linear(4, 2)

    def forward(self, x):
        return self.head(self.block(self.stem(x)))


@pytest.mark.parametrize(("spec", "named"), [("block:*", "block:log#1"), ("block:log", "block:log")])
def test_an_op_inside_a_forward_is_named_before_its_module(spec, named):
    torch.manual_seed(6)
    model = WithBlock()
    x = torch.randn(8, 4)
    # without the ops, the first non-finite output is the module the log's NaN flows into
    assert layertap.find_nonfinite(model, x).layer == "block.fc"
    report = layertap.find_nonfinite(model, x, layers=[nn.Module, spec])
    assert (report.phase, report.layer, report.module_type, report.call) == ("forward", named, "Shifted", 0)
    shifted = model.stem(x).detach() - 5
    assert report.value.nan_fraction == pytest.approx(shifted.lt(0).float().mean().item()) and shifted.lt(0).any()
    [given] = report.inputs  # the log's tensor argument: finite
    assert given.nonfinite_fraction == 0 and given.max == pytest.approx(shifted.max().item())
    # "block:*" lists "block:sub#1" (x - 5) first: finite, just before the log
    assert report.previous.layer == ("block:sub#1" if spec == "block:*" else "stem")


def test_an_op_gradient_is_located_in_the_backward():
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), Sqrt(), nn.Linear(8, 1))
    x = torch.randn(16, 4)
    report = layertap.find_nonfinite(model, x, loss_fn=lambda out: out.sum(), layers=["0", "1", "2:*", "3"])
    # the sqrt op's gradient is finite; what flows back into the ReLU's output is not
    assert (report.phase, report.layer) == ("backward", "1") and report.previous.layer == "2:sqrt#1"
