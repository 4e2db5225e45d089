"""Select once: each capability resolves its layers to one `Selection` and hands it to the tap,
which walks the model no more. Checked by counting the walks of ``model.named_modules()`` that
`layertap.select` makes, by caller, and against the layers the spec selects. Also: the issue's
renames, without aliases."""

import importlib
import sys

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import layertap
from layertap.attention import attention
from layertap.nonfinite import NonfiniteReport, find_nonfinite
from layertap.tensorstats import TensorStats, tensor_stats


class Attend(nn.Module):
    """Self-attention by ``F.scaled_dot_product_attention``, then an op to tap."""

    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        q = self.proj(x).unflatten(-1, (2, 4)).transpose(1, 2)
        return F.scaled_dot_product_attention(q, q, q).transpose(1, 2).flatten(2).relu()


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 8), Attend(), nn.Identity(), nn.Linear(8, 2)).eval()


class Walks(list):
    """Who walked ``model.named_modules()`` to select layers: the caller of `layertap.select`, one
    entry per walk. (Walks that select nothing, such as naming a failing layer, are not counted.)"""

    def watch(self, model: nn.Module) -> nn.Module:
        walk = model.named_modules

        def counted(*args, **kwargs):
            frame = sys._getframe(1)
            selecting = frame.f_globals["__name__"] == "layertap.select"
            while frame.f_globals["__name__"] == "layertap.select":
                frame = frame.f_back
            if selecting:
                self.append(frame.f_globals["__name__"])
            return walk(*args, **kwargs)

        model.named_modules = counted  # type: ignore[method-assign]
        return model


@pytest.fixture
def walks():
    return Walks()


def test_stats_selects_once_and_the_tap_does_not_select_again(walks):
    net = walks.watch(model())
    data = [torch.randn(4, 3, 8) for _ in range(2)]
    table = layertap.stats(net, data, ["0", "1:*", "3"], progress=False)
    assert walks == ["layertap.stats"]
    # the rows of what the spec selects: "1:*" has none of its own, its ops have one each
    assert [k for k in table if ":" not in k] == ["0", "3"]
    assert {k.partition("#")[0] for k in table if ":" in k} >= {"1:scaled_dot_product_attention", "1:relu"}
    assert table.missing == []


def test_stats_reports_a_module_star_that_ran_no_op_as_missing():
    net = model()  # "2" is an nn.Identity: its forward calls no torch function
    table = layertap.stats(net, [torch.randn(2, 3, 8)], ["0", "1:*", "2:*"], progress=False)
    assert table.missing == ["2:*"]


def test_find_nonfinite_selects_once(walks):
    net = walks.watch(model())
    x = torch.randn(4, 3, 8)
    x[0, 0, 0] = float("nan")
    report = find_nonfinite(net, x)
    assert walks == ["layertap.nonfinite"]
    assert isinstance(report, NonfiniteReport) and (report.phase, report.layer, report.module_type) == ("forward", "0", "Linear")
    walks.clear()
    check = find_nonfinite(net, layers=["0", "1:*"])
    with check:
        net(torch.randn(2, 3, 8))
    assert walks == ["layertap.nonfinite"] and check.report is None
    assert check.names == layertap.select(net, ["0", "1:*"])


def test_summary_selects_once(walks):
    net = walks.watch(model())
    table = layertap.summary(net, torch.randn(2, 3, 8), ops=True)
    assert walks == ["layertap.summary"]
    assert [row.name for row in table if row.type != "op"] == ["", "0", "1", "1.proj", "2", "3"]
    assert "1:scaled_dot_product_attention" in table.names
    walks.clear()
    layertap.summary(net, torch.randn(2, 3, 8), layers=["1", "1:relu"])
    assert walks == ["layertap.summary"]


def test_attention_selects_once(walks):
    net = walks.watch(model())
    x = torch.randn(2, 3, 8)
    with torch.no_grad(), attention(net, "1") as att:
        net(x)
    assert walks == ["layertap.attention"]
    q = net[1].proj(net[0](x)).unflatten(-1, (2, 4)).transpose(1, 2)
    torch.testing.assert_close(att["1"], torch.softmax(q @ q.transpose(-2, -1) / 2, -1).mean(1, keepdim=True))
    walks.clear()
    mha = walks.watch(nn.MultiheadAttention(8, 2, batch_first=True).eval())  # found by default: the model itself
    with torch.no_grad(), attention(mha) as att:
        mha(x, x, x)
    assert walks == ["layertap.attention"]
    expected = mha(x, x, x, average_attn_weights=True)[1][:, None]
    torch.testing.assert_close(att[""], expected, atol=1e-6, rtol=0)


def test_renames_have_no_aliases():
    assert layertap.NonfiniteReport is NonfiniteReport and "NonfiniteReport" in layertap.__all__
    assert not hasattr(layertap, "Report") and "Report" not in layertap.__all__
    s = tensor_stats(torch.tensor([[1.0, float("nan")], [0.0, 3.0]]))
    assert isinstance(s, TensorStats) and (s.count, s.nan, float(s.hi)) == (4, 1, 3.0)
    stats_module = importlib.import_module("layertap.stats")
    assert stats_module.TensorStats is TensorStats and stats_module.tensor_stats is tensor_stats
