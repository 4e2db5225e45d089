"""Models bigger than one device under torchrun: tensor parallelism and FSDP2, each held to an
unsharded copy of the model with the same weights (clone-at-hook and plain autograd).

Tensor parallel: a model split by ``parallelize_module`` (ColwiseParallel, then RowwiseParallel)
needs every rank of its group for each forward. One launch of 4 processes (a 2 x 2 mesh: 2
data-parallel groups of 2) and one of 2 (one tensor-parallel group) play every scenario, as
tests/test_distributed.py's `scenarios` does; each prints one JSON line per rank. Taps, edits,
stats, the CAM family and watch are held to the copy as well as extraction.

FSDP2 (``fully_shard``): each rank holds a sharded copy of a small conv net. Its scenarios
(`FSDP`, named "fsdp ...") play in the launch of 2, in the same process group: every process
of a launch imports torch, seconds each.
"""

from __future__ import annotations

import pytest
import tokens_models as tm
from torchrun_scenarios import launch, played

SCRIPT = r'''
import copy, json, os, runpy, sys, time, traceback
import torch
from torch import nn
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
    # a parent of the Rowwise layer returns its all-reduce's asynchronous result as its own output
    outer = nn.Sequential(copy.deepcopy(plain))
    parallelize_module(outer, mesh["tp"], {"0.0": ColwiseParallel(), "0.2": RowwiseParallel()})
    with layertap.tap(outer, "0", capture=("output", "grad")) as t:
        outer(x[:4]).square().sum().backward()
    want_outer = plain(x[:4])
    torch.testing.assert_close(t["0"], want_outer.detach(), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(t.grads["0"], 2 * want_outer.detach(), atol=1e-5, rtol=1e-5)
    plain.zero_grad()
    # an op inside a module computes on the rank's part, of a layout nothing records: refused, or kept as the part
    try:
        layertap.tap(model, "1:relu")
        refused = ""
    except layertap.TapError as e:
        refused = str(e)
    with torch.no_grad(), layertap.tap(model, "1:relu", gather=False) as t:
        model(x[:4])
    with torch.no_grad():
        torch.testing.assert_close(t["1:relu"], want["1"][:, 16 * mesh["tp"].get_local_rank():16 * (mesh["tp"].get_local_rank() + 1)], atol=1e-5, rtol=1e-5)
    return {"kinds": kinds, "placements": placements, "refused": refused, "part": list(t["1:relu"].shape)}

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

class Patches(nn.Module):
    """A conv stem, then tokens [B, T, C] through a tensor-parallel MLP (up: Colwise, so each
    rank holds half of its output; down: Rowwise), a mean over tokens and a class head."""

    def __init__(self):
        super().__init__()
        self.stem, self.up, self.act = nn.Conv2d(3, 8, 4, stride=4), nn.Linear(8, 16), nn.ReLU()
        self.down, self.head = nn.Linear(16, 8), nn.Linear(8, 5)

    def forward(self, images):
        tokens = self.stem(images).flatten(2).transpose(1, 2)  # [B, 16, 8]: a 4 x 4 grid of 16 px images
        return self.head(self.down(self.act(self.up(tokens))).mean(1))

torch.manual_seed(0)
vision_plain = Patches()
vision = copy.deepcopy(vision_plain)
parallelize_module(vision, mesh["tp"], {"up": ColwiseParallel(), "down": RowwiseParallel()})
images = torch.randn(3, 3, 16, 16, generator=torch.Generator().manual_seed(2))

def cams():
    """Grad-CAM and the gradient-free Score-CAM at the Colwise layer, read as a 4 x 4 token grid."""
    out = {}
    for method in (layertap.cam.GradCAM, layertap.cam.ScoreCAM):
        got = method(vision, "up", grid=(4, 4), progress=False)(images, targets=[0, 3, 4])
        want = method(vision_plain, "up", grid=(4, 4), progress=False)(images, targets=[0, 3, 4])
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        out[method.__name__] = {"shape": list(got.shape), "diff": float((got - want).abs().max()), "spread": float(want.std())}
    return out

def watched():
    """Two SGD steps of the TP model and of an unsharded copy under watch: the same rows, on every rank."""
    rows = {}
    for name, model_ in (("tp", copy.deepcopy(vision)), ("plain", copy.deepcopy(vision_plain))):
        opt = torch.optim.SGD(model_.parameters(), lr=0.1)
        rows[name] = []
        with layertap.watch(model_, every=1, alerts=False) as w:
            for _ in range(2):
                opt.zero_grad()
                model_(images).square().mean().backward()
                opt.step()
                w.step()
                rows[name] += w.last
    got, want = rows["tp"], rows["plain"]
    assert [(r.step, r.name, r.kind) for r in got] == [(r.step, r.name, r.kind) for r in want]
    diff = 0.0
    for g, r in zip(got, want):
        for field in ("mean", "std", "min", "max"):
            diff = max(diff, abs(getattr(g.stats, field) - getattr(r.stats, field)))
    assert diff <= 1e-5, diff
    # the plain copy's statistics merge over both processes (each saw the same images)
    return {"counts": {f"{r.step} {r.name} {r.kind}": [g.stats.count, r.stats.count // world] for g, r in zip(got, want)}, "diff": diff}

def token_rows(name):
    """extract_tokens of a causal LM whose first MLP is split (Colwise, then Rowwise): one store,
    written once by the group, each document's rows equal to the unsharded copy run on it alone;
    and reduce="mean" over a padded batch, equal to the copy's."""
    import numpy as np
    import tokens_models as tm
    tokenizer = tm.saved_bpe(os.path.join(folder, "bpe.json"))
    texts = tm.corpus(12, seed=4, longest=18)
    plain_lm = tm.TinyLM(len(tokenizer)).eval()
    lm = copy.deepcopy(plain_lm)
    parallelize_module(lm, mesh["tp"], {"blocks.0.mlp.0": ColwiseParallel(), "blocks.0.mlp.2": RowwiseParallel()})
    layers = ["blocks.0.mlp.0", "blocks.0.mlp.1", "blocks.0", "norm"]
    out = os.path.join(folder, name)
    layertap.extract_tokens(lm, texts, layers, out=out, tokenizer=tokenizer, batch_size=4, chunk_size=64, progress=False)
    store = layertap.open_tokens(out)
    docs = np.asarray(store.docs)
    for d, text in enumerate(texts):
        ids = torch.tensor(tokenizer(text)["input_ids"])[None]
        with torch.no_grad(), layertap.tap(plain_lm, layers) as alone:
            plain_lm(ids)
        for name in layers:
            torch.testing.assert_close(torch.from_numpy(np.asarray(store[name])[docs == d]), alone[name][0], atol=1e-5, rtol=1e-5)
    batch = dict(tokenizer(texts[:3], padding=True, return_tensors="pt"))  # padded: reduce= honours the mask
    with torch.no_grad(), layertap.tap(lm, layers[:2], reduce="mean") as t, layertap.tap(plain_lm, layers[:2], reduce="mean") as r:
        lm(**batch), plain_lm(**batch)
    for name in layers[:2]:
        torch.testing.assert_close(t[name], r[name], atol=1e-5, rtol=1e-5)
    return {"complete": store.complete, "widths": [store[n].shape[1] for n in layers], "markers": markers(out), "pooled": list(t[layers[0]].shape)}

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
    play("mesh tokens", lambda: token_rows("mesh-tokens.zarr"))
else:
    play("tp extract", lambda: extract("tp.zarr"))
    play("resume", lambda: extract("partial.zarr"))  # the 2 x 2 job's store, with 2 processes
    play("tap", taps)
    play("edit", edits)
    play("stats", statistics)
    play("cam", cams)
    play("watch", watched)
    play("tokens", lambda: token_rows("tp-tokens.zarr"))
    runpy.run_path(os.path.join(folder, "fsdp.py"))  # FSDP2 in the same process group: one launch fewer
    play("jobs", jobs)
if torch.distributed.is_initialized():
    torch.distributed.destroy_process_group()
'''


FSDP = r'''
import copy, json, os, sys
import numpy as np
import torch
from torch.distributed.fsdp import fully_shard
import layertap
from torchrun_scenarios import play

folder = sys.argv[1]  # played by SCRIPT's launch of 2, in its process group
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
    play(f"fsdp {scenario}", check)
'''


@pytest.fixture(scope="module")
def said(tmp_path_factory) -> dict[str, list[dict]]:
    folder = tmp_path_factory.mktemp("sharded")
    (folder / "fsdp.py").write_text(FSDP)
    tm.bpe_tokenizer(tm.corpus(12, seed=4, longest=18), save=folder / "bpe.json")  # token_rows's, the same on every rank
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
        # an op tap would see the rank's half of the ReLU's 32 features: refused, naming the fixes; gather=False keeps the half
        assert "op taps (1:relu) on a tensor-parallel model" in line["refused"] and "gather=False" in line["refused"]
        assert line["part"] == [4, 16]


def test_an_edit_of_a_tensor_parallel_layer_sees_the_whole_value_and_edits_each_ranks_part(said):
    for line in ok(said, "edit", 2):
        assert line["changed"]  # the edit mattered, and the sharded model matched the plain one's result


def test_stats_of_a_tensor_parallel_model_count_each_value_once(said):
    for line in ok(said, "stats", 2):
        assert all(line[n][0] == line[n][1] for n in ("0", "1", "2")), line


def test_cams_of_a_tensor_parallel_model_are_the_unsharded_ones(said):
    for line in ok(said, "cam", 2):
        # cams() asserted, on every rank, the maps equal the unsharded copy's (1e-5)
        for method in ("GradCAM", "ScoreCAM"):
            assert line[method]["shape"] == [3, 16, 16] and line[method]["spread"] > 0.05, line  # maps, not blanks


def test_watch_of_a_tensor_parallel_model_logs_the_unsharded_statistics_once(said):
    # each step's values, counted once: stem [3, 8, 4, 4], up and act [3, 16, 16], down [3, 16, 8], head [3, 5]
    sizes = {"stem": 384, "up": 768, "act": 768, "down": 384, "head": 15}
    want = {f"{step} {name} {kind}": [size, size] for step in (0, 1) for name, size in sizes.items() for kind in ("output", "grad")}
    for line in ok(said, "watch", 2):
        # watched() asserted mean, std, min and max equal the unsharded copy's (1e-5), on every rank
        assert line["counts"] == want, line["counts"]


def test_extract_tokens_of_a_tensor_parallel_lm_writes_each_document_once_at_full_width(said):
    # token_rows() asserted each document's rows equal the unsharded LM's on it alone (1e-5)
    for line in ok(said, "tokens", 2):
        assert line["complete"] and line["widths"] == [64, 64, 32, 32]
        assert set(line["markers"].values()) == {0}  # every chunk written by the group's first rank
        assert line["pooled"] == [3, 64]  # reduce="mean" of the split layer: whole, equal to the copy's (1e-5)


def test_extract_tokens_on_a_2x2_mesh_writes_each_document_once(said):
    for line in ok(said, "mesh tokens", 4):
        # each document's rows equal the unsharded LM's on it alone (1e-5), at full width
        assert line["complete"] and line["widths"] == [64, 64, 32, 32] and line["pooled"] == [3, 64]
        assert set(line["markers"].values()) == {0, 2}  # chunks dealt to both groups, each written by its first rank


def test_job_can_run_again_and_again_in_one_process(said):
    for line in ok(said, "jobs", 2):
        assert line["got"] == [[i, [0, 1], 2] for i in range(4)] and not line["left"]


# ------------------------------------------------------------------------------ FSDP2
def both_ranks(said: dict[str, list[dict]], scenario: str) -> list[dict]:
    return played(said, f"fsdp {scenario}", 2)


def test_tap_of_a_sharded_model_gives_the_unsharded_outputs_and_gradients(said):
    both_ranks(said, "tap")


def test_extract_dataset_of_a_sharded_model_writes_the_unsharded_features(said):
    assert [r["samples"] for r in both_ranks(said, "extract")] == [16, 16]


def test_stats_merged_over_sharded_ranks_equal_the_unsharded_model_over_all_data(said):
    counts = [r["count"] for r in both_ranks(said, "stats")]
    assert counts[0] == counts[1] and counts[0]["fc"] == 16 * 5


def test_watch_merged_over_sharded_ranks_equals_the_unsharded_step_over_all_data(said):
    assert [r["rows"] for r in both_ranks(said, "watch")] == [6, 6]
