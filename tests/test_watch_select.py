"""`layertap.watch` selects its layers once: each sampled step's tap takes the resolved `Selection`.

The reference for "no new walk" is ``nn.Module.named_modules`` itself, counted while training
runs; the reference for the row types is the model's own ``named_modules()``.
"""

from __future__ import annotations

import torch
from torch import nn

from layertap.watch import watch


class Block(nn.Module):
    """A module whose own forward calls ops (``add``, ``relu``) around a child."""

    def __init__(self) -> None:
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x) + x)


def fresh() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(Block(), nn.ReLU(), nn.Linear(4, 1))


def train(model: nn.Module, w, steps: int) -> None:
    for _ in range(steps):
        model(torch.randn(8, 4)).sum().backward()
        w.step()


def test_a_sampled_step_does_not_walk_the_model_again(monkeypatch):
    model = fresh()
    w = watch(model, every=2, alerts=False)
    walks = []
    walk = nn.Module.named_modules
    monkeypatch.setattr(nn.Module, "named_modules", lambda self, *a, **k: walks.append(type(self).__name__) or walk(self, *a, **k))
    with w:
        train(model, w, 4)  # steps 0 and 2 sampled, each with its own tap
    monkeypatch.undo()
    assert walks == []
    assert {r.step for r in w.last} == {2}
    assert [r.name for r in w.last if r.kind == "output"] == w.names == ["0.lin", "1", "2"]


def test_op_rows_carry_the_type_of_the_module_whose_forward_calls_them():
    model = fresh()
    types = {name: type(m).__name__ for name, m in model.named_modules()}
    for layers, rows in (
        (["0:add", "2"], ["0:add", "2"]),  # a selected op, and a module
        (["0:*", "0.lin"], ["0.lin", "0:add#1", "0:relu#1"]),  # every op of 0, named as they ran
    ):
        with watch(model, layers, every=1, alerts=False) as w:
            train(model, w, 1)
        got = {(r.name, r.kind): r.stats.module_type for r in w.last}
        want = {(name, kind): types[name.partition(":")[0]] for name in rows for kind in ("output", "grad")}
        assert got == want
