"""Extraction from a tensor-parallel model under torchrun: each sample is written once.

A model split by ``parallelize_module`` (ColwiseParallel, then RowwiseParallel) over a tensor-
parallel mesh needs every rank of its group for each forward. One launch of 2 processes (one
tensor-parallel group) and one of 4 (a 2 x 2 mesh: 2 data-parallel groups of 2) play every
scenario, as tests/test_distributed.py's `scenarios` does; each prints one JSON line per rank.
The reference is an unsharded copy of the model with the same weights (plain autograd).
"""

from __future__ import annotations

import pytest
from torchrun_scenarios import launch, played

SCRIPT = r'''
import copy, json, os, sys, time, traceback
import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
import layertap
from torchrun_scenarios import play
from layertap.distributed import job
from layertap.store.writer import StoreWriter

folder, mode = sys.argv[1], sys.argv[2]
torch.distributed.init_process_group("gloo")
rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
LAYERS = ["0", "1", "2"]

torch.manual_seed(0)
plain = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 16))
model = copy.deepcopy(plain)  # the same weights, before parallelizing
shape = (world // 2, 2) if world > 2 else (1, world)
mesh = init_device_mesh("cpu", shape, mesh_dim_names=("dp", "tp"))
parallelize_module(model, mesh["tp"], {"0": ColwiseParallel(), "2": RowwiseParallel()})
x = torch.randn(40, 16, generator=torch.Generator().manual_seed(1))

def reference(inputs):
    """Every layer's output on the unsharded copy, and its gradient under sum of squares."""
    outs = {}
    hooks = [plain.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: outs.__setitem__(n, o)) for n in LAYERS]
    try:
        y = plain(inputs)
    finally:
        for h in hooks:
            h.remove()
    for o in outs.values():
        o.retain_grad()
    y.square().sum().backward()
    plain.zero_grad()
    return {n: o.detach() for n, o in outs.items()}, {n: o.grad for n, o in outs.items()}

def markers(out):
    writer = StoreWriter.open(out)
    try:
        return {c: json.loads(t)["process"] for c, t in writer.backend.markers().items()}
    finally:
        writer.close()

def compare(out):
    store = layertap.open_features(out)
    want, _ = reference(x)
    for name in LAYERS:
        torch.testing.assert_close(store.to_torch(name), want[name], atol=1e-5, rtol=1e-5)
    return {"complete": store.complete, "widths": [store.to_torch(n).shape[1] for n in LAYERS], "markers": markers(out)}

def extract(name, **options):
    out = os.path.join(folder, name)
    layertap.extract_dataset(model, x, LAYERS, out, batch_size=4, chunk_size=8, num_workers=0, progress=False, **options)
    return compare(out)

def interrupted(name):
    """An extraction that every rank stops in its third batch of 4 (before the forward's
    collectives): each data-parallel group has written its first chunk, as a killed job would."""
    calls = []

    def stop(module, args):
        calls.append(len(args[0]) == 4)
        if sum(calls) > 2:
            raise RuntimeError("interrupted")

    handle = model.register_forward_pre_hook(stop)
    try:
        extract(name)
    except RuntimeError as e:
        assert "interrupted" in str(e), e
    else:
        raise AssertionError("not interrupted")
    finally:
        handle.remove()
    torch.distributed.barrier()  # every rank has stopped
    return {"markers": markers(os.path.join(folder, name))}

def taps():
    want, grads = reference(x[:4])
    with layertap.tap(model, LAYERS) as t:
        model(x[:4])
    for n in LAYERS:
        torch.testing.assert_close(t[n], want[n], atol=1e-5, rtol=1e-5)
    with layertap.tap(model, LAYERS, gather=False) as t:
        model(x[:4])
    kinds = {n: type(t[n]).__name__ for n in LAYERS}
    gathered = dict(t.outputs)
    for n in LAYERS:
        torch.testing.assert_close(t[n].full_tensor(), want[n], atol=1e-5, rtol=1e-5)
    with layertap.tap(model, LAYERS, capture=("output", "grad")) as t:
        model(x[:4]).square().sum().backward()
    model.zero_grad()
    for n in LAYERS:
        torch.testing.assert_close(t.grads[n], grads[n], atol=1e-5, rtol=1e-5)
    with layertap.tap(model, LAYERS, capture="input") as t, layertap.tap(plain, LAYERS, capture="input") as r:
        model(x[:4]), plain(x[:4])
    for n in LAYERS:  # the input of the Rowwise layer is whole too
        torch.testing.assert_close(t.inputs[n], r.inputs[n], atol=1e-5, rtol=1e-5)
    placements = {n: str(v.placements) for n, v in gathered.items()}
    return {"kinds": kinds, "placements": placements}

def edits():
    """An edit sees the whole value and its result is split back: zero features 3 and 20, one
    in each rank's part of the ReLU's 32."""
    def edit(name, value):
        value = value.clone()
        value[:, [3, 20]] = 0
        return value
    with torch.no_grad(), layertap.tap(plain, "1", edit=edit):
        want = plain(x[:4])
    with torch.no_grad(), layertap.tap(model, "1", edit=edit):
        got = model(x[:4])
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    return {"changed": bool((want - plain(x[:4])).abs().max() > 1e-3)}

def statistics():
    """stats over the same data on both ranks of the group: each value counted once."""
    got = layertap.stats(model, x, LAYERS, batch_size=8, progress=False)
    want = layertap.stats(plain, x, LAYERS, batch_size=8, progress=False)  # one process's own, merged over the two ranks
    out = {}
    for n in LAYERS:
        out[n] = [got[n].count, want[n].count // world]
        assert abs(got[n].mean - want[n].mean) <= 1e-5 and abs(got[n].std - want[n].std) <= 1e-5, (n, got[n], want[n])
    return out

def jobs():
    """job() again and again in one process: each group has keys of its own in the launcher's
    store, so none finds the addresses of the group before it (the script's own, destroyed here)."""
    torch.distributed.destroy_process_group()
    got = []
    for i in range(4):
        if rank == 1:
            time.sleep(0.3)  # rank 0 looks for rank 1's address before rank 1 posts it
        with job() as procs:
            got.append([procs.share(lambda: i), procs.gather(procs.rank), procs.together(lambda: procs.world)])
    return {"got": got, "left": torch.distributed.is_initialized()}

if mode == "mesh":
    play("mesh extract", lambda: extract("mesh.zarr"))
    play("interrupted", lambda: interrupted("partial.zarr"))
else:
    play("tp extract", lambda: extract("tp.zarr"))
    play("resume", lambda: extract("partial.zarr"))  # the 2 x 2 job's store, with 2 processes
    play("tap", taps)
    play("edit", edits)
    play("stats", statistics)
    play("jobs", jobs)
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
'''


@pytest.fixture(scope="module")
def said(tmp_path_factory) -> dict[str, list[dict]]:
    folder = tmp_path_factory.mktemp("tp")
    mesh, tp = launch(SCRIPT, folder, 4, "mesh", timeout=120), launch(SCRIPT, folder, 2, "tp", timeout=120)
    return {**mesh, **tp}  # no scenario plays in both


def ok(said: dict[str, list[dict]], scenario: str, ranks: int) -> list[dict]:
    return played(said, scenario, ranks)


def test_tensor_parallel_extraction_writes_the_unsharded_features_once(said):
    for line in ok(said, "tp extract", 2):
        # compare() asserted the features equal the unsharded copy's (1e-5); full width, not the shards
        assert line["complete"] and line["widths"] == [32, 32, 16]
        assert line["markers"] == {str(c): 0 for c in range(5)}  # every chunk written once, by TP rank 0


def test_a_2x2_mesh_deals_the_data_to_its_groups_and_each_group_writes_once(said):
    for line in ok(said, "mesh extract", 4):
        assert line["complete"] and line["widths"] == [32, 32, 16]
        # 5 chunks dealt to the 2 data-parallel groups, in turn; each written by its group's first rank
        assert line["markers"] == {"0": 0, "1": 2, "2": 0, "3": 2, "4": 0}


def test_a_stopped_2x2_job_resumes_with_2_processes(said):
    stopped = ok(said, "interrupted", 4)
    assert all(line["markers"] == {"0": 0, "1": 2} for line in stopped), stopped  # each group's first chunk
    for line in ok(said, "resume", 2):
        assert line["complete"] and line["widths"] == [32, 32, 16]
        assert line["markers"] == {"0": 0, "1": 2, "2": 0, "3": 0, "4": 0}  # only the missing chunks ran again


def test_tapped_values_of_a_tensor_parallel_model_are_the_unsharded_ones(said):
    # taps() asserted, on every rank: the outputs and grads equal the unsharded copy's (1e-5),
    # and gather=False's full_tensor() too
    for line in ok(said, "tap", 2):
        assert line["kinds"] == {"0": "DTensor", "1": "DTensor", "2": "DTensor"}
        # each rank's part, with the placements the styles give: features split, then all-reduced
        assert line["placements"] == {"0": "(Shard(dim=1),)", "1": "(Shard(dim=1),)", "2": "(Replicate(),)"}


def test_an_edit_of_a_tensor_parallel_layer_sees_the_whole_value_and_edits_each_ranks_part(said):
    for line in ok(said, "edit", 2):
        assert line["changed"]  # the edit mattered, and the sharded model matched the plain one's result


def test_stats_of_a_tensor_parallel_model_count_each_value_once(said):
    for line in ok(said, "stats", 2):
        assert all(line[n][0] == line[n][1] for n in ("0", "1", "2")), line


def test_job_can_run_again_and_again_in_one_process(said):
    for line in ok(said, "jobs", 2):
        assert line["got"] == [[i, [0, 1], 2] for i in range(4)] and not line["left"]
