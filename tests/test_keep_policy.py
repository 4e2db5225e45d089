"""Recording that keeps what it can: with ``keep="all"`` an entry an in-place op changed after capture
is lost alone, ``copy=`` loses none, and ``keep="last"`` warns once for a layer run twice per forward."""

from __future__ import annotations

import warnings

import pytest
import torch
import torchvision
from torch import nn

import layertap
from layertap import ArgumentError


class Sometimes(nn.Module):
    """``lin``'s output is changed in place on the forwards the caller asks for."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)

    def forward(self, x, mutate=False):
        out = self.lin(x)
        if mutate:
            out.mul_(0)
        return out + 1


def run(model, xs, mutate, **options):
    """Tap ``lin`` over forwards of ``xs``; the reference is a plain hook's clone of each call."""
    ref = []
    handle = model.lin.register_forward_hook(lambda m, a, out: ref.append(out.detach().clone()))
    with torch.no_grad(), layertap.tap(model, "lin", keep="all", **options) as t:
        for x, m in zip(xs, mutate):
            model(x, mutate=m)
    handle.remove()
    return t, ref


def test_keep_all_loses_only_the_entry_changed_in_place_and_says_which():
    model = Sometimes()
    xs = [torch.randn(1, 3) for _ in range(4)]
    # 1st: copied and watched (nothing changes it); 2nd: guarded; 3rd: guarded, then changed, which
    # the tap learns as the forward ends; 4th: copied
    t, ref = run(model, xs, [False, False, True, True])
    with pytest.warns(UserWarning, match=r"entries \[2\] of the 4 outputs of layer 'lin' were changed in place.*copy=True") as seen:
        got = t["lin"]
    assert len(seen) == 1 and "\n" not in str(seen[0].message)
    assert got[2] is None
    for i in (0, 1, 3):  # the same forward: bit-exact
        assert torch.equal(got[i], ref[i])


@pytest.mark.parametrize("copy", [True, ["lin"], "lin"])
def test_copy_keeps_every_entry_whatever_an_in_place_op_does(copy):
    model = Sometimes()
    xs = [torch.randn(1, 3) for _ in range(4)]
    t, ref = run(model, xs, [False, False, True, True], copy=copy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing lost, nothing to say
        got = t["lin"]
    assert len(got) == 4 and all(torch.equal(g, r) for g, r in zip(got, ref))


def test_copy_naming_an_untapped_layer_is_refused_in_one_line():
    with pytest.raises(ArgumentError, match=r"copy= names layers that are not tapped: \['1'\]; add them") as err:
        layertap.tap(nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2)), "0", copy=["1"])
    assert "\n" not in str(err.value)


def test_keep_last_warns_once_for_a_layer_run_twice_per_forward():
    model = torchvision.models.resnet18().eval()
    x = torch.randn(1, 3, 32, 32)
    # BasicBlock calls its one ReLU twice: its kept output is the block's output, not its first ReLU's
    with warnings.catch_warnings(record=True) as seen, torch.no_grad():
        warnings.simplefilter("always")
        with layertap.tap(model, ["layer1.0.relu", "layer1.0.conv2"], capture=("input", "output")) as t:
            model(x)
            model(x)
    messages = [str(w.message) for w in seen if "layertap" in str(w.message)]
    assert len(messages) == 1 and "\n" not in messages[0]
    assert "layer 'layer1.0.relu' ran 2 times in one forward" in messages[0] and "keep='all'" in messages[0]
    assert not torch.equal(t["layer1.0.relu"], t.inputs["layer1.0.conv2"])  # the warned-of case
    with warnings.catch_warnings(), torch.no_grad():  # once per call it keeps: quiet
        warnings.simplefilter("error")
        for keep in ("all", "first"):
            with layertap.tap(model, "layer1.0.relu", keep=keep) as t:
                model(x)
        with layertap.tap(model, ["layer1.0.conv1", "layer1.0"]) as t:
            model(x)
    with torch.no_grad(), layertap.tap(model, ["layer1.0.relu", "layer1.0.conv2"], keep="all", capture=("input", "output")) as t:
        model(x)
    assert torch.equal(t["layer1.0.relu"][0], t.inputs["layer1.0.conv2"][0])  # the fix the warning names
