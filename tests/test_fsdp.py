"""Tapping a model sharded by FSDP (``torch.distributed.fsdp.fully_shard``) under torchrun.

One job of 2 processes (Gloo, CPU) plays every scenario, as tests/test_distributed.py's
`scenarios` does: each rank holds a sharded copy of a small conv net and, beside it, an
unsharded copy with the same weights. Each scenario prints one JSON line per rank, which the
tests read. The references are independent of layertap: clone-at-hook and plain autograd on the
unsharded copy, and torch's own arithmetic for the statistics.
"""

from __future__ import annotations

import pytest
from torchrun_scenarios import launch, played

SCRIPT = r'''
import copy, json, os, sys, traceback
import numpy as np
import torch
from torch.distributed.fsdp import fully_shard
import layertap
from torchrun_scenarios import play

folder = sys.argv[1]
torch.distributed.init_process_group("gloo")
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()

class Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block1 = torch.nn.Sequential(torch.nn.Conv2d(3, 6, 3), torch.nn.ReLU())
        self.block2 = torch.nn.Sequential(torch.nn.Conv2d(6, 8, 3, stride=2), torch.nn.Tanh())
        self.fc = torch.nn.Linear(8, 5)

    def forward(self, x):
        return self.fc(self.block2(self.block1(x)).mean((2, 3)))

LAYERS = ["block1", "block2.1", "fc"]
torch.manual_seed(0)
plain = Net()
sharded = copy.deepcopy(plain)  # the same weights, before sharding
for part in (sharded.block1, sharded.block2, sharded):
    fully_shard(part)
whole = torch.randn(16, 3, 10, 10, generator=torch.Generator().manual_seed(1))
mine = whole[rank * 8 : (rank + 1) * 8]  # each rank: its own samples

def reference(x, backward=True):
    """Outputs (cloned in the hook) and output gradients (plain autograd) of LAYERS on the unsharded copy."""
    outs, grads, handles = {}, {}, []
    def hook(name):
        def f(module, args, out):
            outs[name] = out.detach().clone()
            if out.requires_grad:
                out.register_hook(lambda g: grads.__setitem__(name, g.clone()))
        return f
    modules = dict(plain.named_modules())
    handles = [modules[n].register_forward_hook(hook(n)) for n in LAYERS]
    try:
        y = plain(x)
        if backward:
            y.square().sum().backward()
    finally:
        for h in handles:
            h.remove()
        plain.zero_grad()
    return outs, grads

def tapped():
    with layertap.tap(sharded, LAYERS, capture=("output", "grad")) as t:
        sharded(mine).square().sum().backward()
    outs, grads = reference(mine)
    for n in LAYERS:
        torch.testing.assert_close(t[n], outs[n], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(t.grads[n], grads[n], rtol=1e-5, atol=1e-5)
    sharded.zero_grad()
    return {"layers": sorted(t.keys()) if hasattr(t, "keys") else LAYERS}

def extracted():
    out = os.path.join(folder, "sharded.zarr")
    store = layertap.extract_dataset(sharded, whole, LAYERS, out, batch_size=4, chunk_size=4, num_workers=0, progress=False)
    outs, _ = reference(whole, backward=False)
    for n in LAYERS:
        torch.testing.assert_close(torch.from_numpy(store.to_numpy(n)), outs[n], rtol=1e-5, atol=1e-5)
    return {"samples": int(store.to_numpy("fc").shape[0])}

def numbers(t):
    t = t.double()
    return {"count": t.numel(), "mean": t.mean().item(), "std": t.std(correction=0).item(), "min": t.min().item(), "max": t.max().item()}

def same(row, expected, what):
    got = {k: getattr(row, k) for k in expected}
    assert got["count"] == expected["count"], (what, got, expected)
    for k in ("mean", "std", "min", "max"):
        assert abs(got[k] - expected[k]) <= 1e-5 * (1 + abs(expected[k])), (what, k, got, expected)

def statistics():
    table = layertap.stats(sharded, torch.utils.data.TensorDataset(mine), LAYERS, batch_size=4, progress=False)
    with torch.no_grad():
        outs, _ = reference(whole, backward=False)  # the whole data: what the merged table covers
    for n in LAYERS:
        same(table[n], numbers(outs[n]), n)
    return {"count": {n: table[n].count for n in LAYERS}}

def watched():
    rows = []
    with layertap.watch(sharded, LAYERS, every=1, sinks=[lambda step, records: rows.extend(records)], alerts=False) as w:
        sharded(mine).square().sum().backward()
        w.step()
    sharded.zero_grad()
    outs, grads = reference(whole)  # the loss of each rank's samples alone: the same gradients, sample by sample
    mine_rows = w.last if rank else rows  # sinks write on rank 0; every rank keeps the merged rows
    got = {(r.kind, r.stats.name): r.stats for r in mine_rows}
    for n in LAYERS:
        same(got["output", n], numbers(outs[n]), f"output {n}")
        same(got["grad", n], numbers(grads[n]), f"grad {n}")
    return {"rows": len(mine_rows)}

for scenario, check in [("tap", tapped), ("extract", extracted), ("stats", statistics), ("watch", watched)]:
    play(scenario, check)
torch.distributed.destroy_process_group()
'''


@pytest.fixture(scope="module")
def said(tmp_path_factory) -> dict[str, list[dict]]:
    """What each scenario printed, one line per rank, by scenario name."""
    return launch(SCRIPT, tmp_path_factory.mktemp("fsdp"), 2)


def both_ranks(said: dict[str, list[dict]], scenario: str) -> list[dict]:
    return played(said, scenario, 2)


def test_tap_of_a_sharded_model_gives_the_unsharded_outputs_and_gradients(said):
    both_ranks(said, "tap")


def test_extract_dataset_of_a_sharded_model_writes_the_unsharded_features(said):
    assert [r["samples"] for r in both_ranks(said, "extract")] == [16, 16]


def test_stats_merged_over_sharded_ranks_equal_the_unsharded_model_over_all_data(said):
    counts = [r["count"] for r in both_ranks(said, "stats")]
    assert counts[0] == counts[1] and counts[0]["fc"] == 16 * 5


def test_watch_merged_over_sharded_ranks_equals_the_unsharded_step_over_all_data(said):
    assert [r["rows"] for r in both_ranks(said, "watch")] == [6, 6]
