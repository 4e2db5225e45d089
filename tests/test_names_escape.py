"""Module names holding the spec syntax's characters (``[ ] : * ? \\``): exact names win, a backslash
escapes, reported names select themselves, and `summary` lists any name (issue 23, item 13).

The reference is ``model.named_modules()`` with plain forward hooks (a clone at the hook).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import layertap
from layertap import ArgumentError
from layertap.select import named_layers


class AddOne(nn.Module):
    def forward(self, x):
        return x + 1


class Odd(nn.Module):
    """Children registered under names a glob or an op spec would misread."""

    def __init__(self) -> None:
        super().__init__()
        self.heads = nn.ModuleDict({"a[0]": nn.Linear(4, 4), "a0": nn.Linear(4, 4)})
        self.add_module("d:relu", nn.ReLU())
        self.d = nn.Linear(4, 4)
        self.add_module("blk:x", AddOne())
        self.add_module("x*y", nn.Tanh())
        self.add_module("q?", nn.Identity())
        self.add_module("w\\v", nn.Sigmoid())

    def forward(self, x):
        m = self._modules
        x = self.heads["a0"](self.heads["a[0]"](x))
        x = m["d:relu"](self.d(x))
        return m["w\\v"](m["q?"](m["x*y"](m["blk:x"](x))))


@pytest.fixture
def model():
    torch.manual_seed(0)
    return Odd().eval()


def reference_outputs(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """Each module's output by its ``named_modules()`` name, cloned at a plain forward hook."""
    outs: dict[str, torch.Tensor] = {}
    handles = [
        m.register_forward_hook(lambda _m, _a, out, n=n: outs.__setitem__(n, out.detach().clone()))
        for n, m in model.named_modules()
        if n and n != "heads"
    ]
    try:
        model(x)
    finally:
        for h in handles:
            h.remove()
    return outs


REAL = ["heads.a[0]", "heads.a0", "d:relu", "d", "blk:x", "x*y", "q?", "w\\v"]


def test_every_exact_name_selects_its_module(model):
    modules = dict(model.named_modules())
    layers = named_layers(model)
    for real in REAL:
        (name,) = layertap.select(model, real)
        assert layers[name] is modules[real], real
    # names with ':' or '\' are reported escaped; the others as they are
    assert layertap.select(model, REAL) == [
        "heads.a[0]", "heads.a0", "d\\:relu", "d", "blk\\:x", "x*y", "q?", "w\\\\v"
    ]


def test_exact_name_wins_over_a_glob_and_an_op(model):
    assert layertap.select(model, "heads.a[0]") == ["heads.a[0]"]  # as a glob it is 'heads.a0'
    assert layertap.select(model, "heads.a[01]") == ["heads.a0"]  # no such name: a glob
    assert layertap.select(model, "d:relu") == ["d\\:relu"]  # not the op relu of module d
    assert layertap.select(model, [("d", "relu")]) == ["d:relu"]  # that op, as a pair


def test_backslash_escapes_in_names_globs_and_ops(model):
    assert layertap.select(model, r"heads.a\[0\]") == ["heads.a[0]"]
    assert layertap.select(model, r"**.a\[0\]") == ["heads.a[0]"]
    assert layertap.select(model, r"x\*y") == ["x*y"]
    assert layertap.select(model, r"x\**") == ["x*y"]  # a literal '*', then a glob's
    assert layertap.select(model, r"blk\:x:add") == ["blk\\:x:add"]
    assert layertap.select(model, "blk:x:add") == ["blk\\:x:add"]  # the module part is an exact name
    assert layertap.select(model, r"re:blk\:.*") == ["blk\\:x"]
    assert layertap.select(model, "re:d:r.*") == ["d\\:relu"]  # matched against the real name


def test_tap_reads_each_module_and_op_as_plain_hooks_do(model):
    x = torch.randn(3, 4)
    want = reference_outputs(model, x)
    with layertap.tap(model, REAL + [r"blk\:x:add"]) as t:
        model(x)
    for real in REAL:
        assert torch.equal(t[real], want[real]), real  # read by its real name
    for name in t.names:
        assert torch.equal(t[name], t[layertap.select(model, name)[0]])  # and by the reported one
    assert torch.equal(t["blk\\:x:add"], want["d:relu"] + 1)  # the op inside blk:x's forward


def test_summary_lists_every_name_and_each_reselects_itself(model):
    x = torch.randn(2, 4)
    want = reference_outputs(model, x)
    table = layertap.summary(model, x, ops=True)
    layers = named_layers(model)
    modules = {name: module for name, module in layers.items() if name}
    real = {id(m): n for n, m in model.named_modules()}
    assert {row.name for row in table if row.type != "op"} == set(layers)
    for row in table:
        assert layertap.select(model, row.name) == [row.name]  # a name layertap reports is a spec
        if row.name and row.type != "op" and row.calls:
            assert row.output == want[real[id(modules[row.name])]].shape
    assert "blk\\:x:add" in table.names and "blk\\:x" in str(table)
    assert table["blk:x"] is table["blk\\:x"] and table["blk:x"].type == "AddOne"  # by either name
    with layertap.tap(model, table.names) as t:  # every row can be tapped
        model(x)
    assert torch.equal(t["blk\\:x:add"], want["d:relu"] + 1)


@pytest.mark.parametrize(
    "spec, shown",
    [("re:(", "regex 're:('"), ("re:(:add", "regex 're:('"), ("layer[z-a]", "glob 'layer[z-a]'")],
)
def test_a_pattern_that_does_not_compile_is_a_one_line_error(model, spec, shown):
    with pytest.raises(ArgumentError) as err:
        layertap.select(model, spec)
    msg = str(err.value)
    assert msg.startswith(f"{shown} is not a valid pattern") and "backslash" in msg and "\n" not in msg
    assert err.value.__cause__ is None and err.value.__suppress_context__


class GlobStar(nn.Module):
    """A module registered as ``g:*``: its name must not read as "every op of ``g``"."""

    def __init__(self) -> None:
        super().__init__()
        self.d = nn.ModuleDict({"g:*": nn.Linear(4, 4), "h:add": nn.Linear(4, 4)})

    def forward(self, x):
        return self.d["h:add"](self.d["g:*"](x))


@pytest.mark.parametrize("spec", ["d.g:*", r"d.g\:*", r"d.g\:\*"])
def test_a_module_named_like_every_op_is_tapped_as_the_module(spec):
    torch.manual_seed(0)
    model, x = GlobStar().eval(), torch.randn(2, 4)
    want = reference_outputs(model, x)["d.g:*"]
    (name,) = layertap.select(model, spec)
    assert named_layers(model)[name] is model.d["g:*"]
    with layertap.tap(model, [spec]) as t:
        model(x)
    assert t.names == [name] and torch.equal(t[name], want)  # the Linear's output, not its op
    table = layertap.summary(model, x, ops=True)
    assert table[name].type == "Linear" and layertap.select(model, name) == [name]
    with layertap.tap(model, [(lambda n, _m: n == name, "linear")]) as t:  # its op, by a pair
        model(x)
    assert torch.equal(t[f"{name}:linear"], want)
