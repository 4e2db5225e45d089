"""Streaming layer statistics, checked against NumPy over the concatenated activations."""

import functools
import importlib
import json
import socket

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

import layertap
from layertap.tensorstats import Histogram, tensor_stats

stats_module = importlib.import_module("layertap.tensorstats")  # where a tensor is read

RTOL = 1e-6  # the bound
# float32 maps may be summed in float32 a few (centred) values at a time, in float64 beyond: a mean
# near 0 is exact to ~1e-10 of the values' magnitude, not to float64's 1e-16
ATOL = 1e-8


def close(actual, expected, scale=1.0):
    """Relative error <= 1e-6, with an absolute floor of 1e-8 of the data's scale (a mean near 0)."""
    np.testing.assert_allclose(actual, expected, rtol=RTOL, atol=ATOL * scale)


def check_row(row, values, channel_axis=None):
    """``row`` against NumPy over ``values`` (float64): finite values for the moments."""
    values = np.asarray(values, dtype=np.float64)
    finite = values[np.isfinite(values)]
    scale = np.abs(finite).max()
    assert row.count == values.size
    close(row.mean, finite.mean(), scale)
    close(row.std, finite.std(), scale)
    assert row.min == finite.min() and row.max == finite.max()
    assert row.zero_fraction == np.mean(values == 0)
    assert row.nan_fraction == np.mean(np.isnan(values))
    assert row.inf_fraction == np.mean(np.isinf(values))
    if channel_axis is not None:
        moved = np.moveaxis(values, channel_axis, -1).reshape(-1, values.shape[channel_axis])
        close(row.channel_mean, moved.mean(axis=0), scale)
        close(row.channel_std, moved.std(axis=0), scale)
        assert row.dead_channels == tuple(np.flatnonzero((moved == 0).all(axis=0)))


class Reuse(nn.Module):
    """A ReLU called twice per forward, a tuple output, and token-shaped activations."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 5)
        self.relu = nn.ReLU()
        self.b = nn.Linear(5, 5)
        self.pair = Pair()

    def forward(self, x):  # x: [batch, tokens, 6]
        h = self.relu(self.b(self.relu(self.a(x))))
        first, _ = self.pair(h)
        return first


class Pair(nn.Module):
    def forward(self, x):
        return x * 2, torch.arange(3)  # only the first floating-point tensor counts


@pytest.fixture(scope="module")
def resnet():
    # imported here, not above: each Gloo rank below is a spawned process that imports this module
    import torchvision

    torch.manual_seed(0)
    return torchvision.models.resnet18().eval()


def test_resnet_rows_match_numpy_over_the_dataset(resnet):
    torch.manual_seed(1)
    images = torch.randn(6, 3, 64, 64)
    loader = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(images), batch_size=4)  # 4 + 2
    table = layertap.stats(resnet, loader, per_channel=True)
    leaves = [n for n, m in resnet.named_modules() if n and not list(m.children())]
    # every leaf, one row per call of the ReLUs reused inside each block
    assert {r.layer for r in table.values()} == set(leaves) and table.missing == []
    assert [k for k in table if k.startswith("layer1.0.relu")] == ["layer1.0.relu#0", "layer1.0.relu#1"]
    assert list(table)[:4] == ["conv1", "bn1", "relu", "maxpool"]  # execution order
    with pytest.raises(KeyError, match="runs several times"):
        table["layer1.0.relu"]

    # the reference: every call of every checked layer, captured whole by the tap, per batch
    checked = ["conv1", "layer1.0.bn1", "layer1.0.relu", "layer2.1.bn2", "layer4.1.relu", "fc"]
    outs = {n: [] for n in checked}
    with torch.no_grad(), layertap.tap(resnet, checked, keep="all") as taps:
        for (batch,) in loader:
            resnet(batch)
            for n in checked:
                outs[n].append(taps.outputs[n])
            taps.clear()
    for name in checked:
        calls = list(zip(*outs[name]))  # per call position: that call's output in each batch
        for call, per_batch in enumerate(calls):
            key = f"{name}#{call}" if len(calls) > 1 else name
            values = torch.cat(per_batch).numpy()
            check_row(table[key], values, channel_axis=1)
    # the ReLU after bn1 overwrote bn1's output in place: bn1's row still saw the negative values
    assert table["layer1.0.bn1"].min < 0 and table["layer1.0.relu#0"].min == 0


def test_tokens_reuse_nested_outputs_and_histograms():
    model = Reuse()
    torch.manual_seed(2)
    batches = [torch.randn(3, 4, 6), torch.randn(2, 7, 6) * 50, torch.randn(5, 4, 6) * 0.01]  # ranges widen then shrink
    table = layertap.stats(model, batches, per_channel=True, histogram_bins=32)
    assert list(table) == ["a", "relu#0", "b", "relu#1", "pair"]
    with torch.no_grad(), layertap.tap(model, ["relu", "pair"], keep="all") as taps:
        outs = []
        for x in batches:
            model(x)
            outs.append((taps.outputs["relu"], taps.outputs["pair"][0][0]))
            taps.clear()
    for key, pick in (("relu#0", lambda o: o[0][0]), ("relu#1", lambda o: o[0][1]), ("pair", lambda o: o[1])):
        tokens = np.concatenate([pick(o).reshape(-1, 5).numpy() for o in outs])  # channel: the last dim
        check_row(table[key], tokens, channel_axis=1)
        counts, edges = table[key].histogram
        assert len(counts) <= 32 and counts.sum() == tokens.size
        widths = np.diff(edges)
        assert np.all(widths == widths[0]) and np.log2(widths[0]).is_integer()
        np.testing.assert_array_equal(counts, np.histogram(tokens, bins=edges)[0])


def test_histogram_merging_is_exact_in_any_order():
    torch.manual_seed(3)
    parts = [torch.randn(1000, dtype=torch.float64) * s + o for s, o in ((1, 0), (1e3, 5), (1e-3, -2), (7, 100))]
    hists = [Histogram.of(p, float(p.min()), float(p.max()), 16) for p in parts]
    forward, backward = hists[0], hists[-1]
    for h in hists[1:]:
        forward = forward.merge(h)
    for h in reversed(hists[:-1]):
        backward = backward.merge(h)
    every = torch.cat(parts).numpy()
    for merged in (forward, backward):
        counts, edges = merged.arrays()
        assert len(counts) <= 16 and counts.sum() == every.size
        np.testing.assert_array_equal(counts, np.histogram(every, bins=edges)[0])
    assert forward.exponent == backward.exponent and torch.equal(forward.counts, backward.counts)


def test_stable_for_a_large_offset_and_counts_nonfinite_apart():
    # float32 sums of squares lose everything at mean 1e4, std 1e-2; Chan merging in float64 does not
    torch.manual_seed(4)
    batches = [(torch.randn(64, 8) * 1e-2 + 1e4) for _ in range(5)]
    batches[2][3, 1] = float("nan")
    batches[4][0, 0] = float("inf")
    batches[4][1, 2] = 0.0
    table = layertap.stats(nn.Identity(), batches, per_channel=True)
    values = torch.cat(batches).double().numpy()
    row = table[""]
    check_row(row, values)
    assert row.nan_fraction == 1 / values.size and row.inf_fraction == 1 / values.size
    finite = np.where(np.isfinite(values), values, np.nan)
    close(row.channel_mean, np.nanmean(finite, axis=0), 1e4)
    close(row.channel_std, np.nanstd(finite, axis=0), 1e4)
    assert table.exploding() == [""]  # non-finite values flag the layer
    assert json.loads(table.to_json())["layers"][""]["exploding"] is True


def test_dead_channels_and_exploding_layers_are_flagged():
    torch.manual_seed(5)
    conv = nn.Conv2d(3, 6, 3)
    with torch.no_grad():  # channels 1 and 4 can never fire: zero weights, negative bias
        conv.weight[[1, 4]] = 0.0
        conv.bias[[1, 4]] = -1.0
    loud = nn.Linear(6, 4)
    with torch.no_grad():
        loud.weight.mul_(1e6)
    model = nn.Sequential(conv, nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), loud)
    data = torch.utils.data.TensorDataset(torch.randn(10, 3, 16, 16))
    table = layertap.stats(model, data, batch_size=4)
    with torch.no_grad():
        relu = model[1](conv(data.tensors[0])).numpy()
    reference_dead = np.flatnonzero((relu == 0).all(axis=(0, 2, 3)))
    assert reference_dead.tolist() == [1, 4]
    assert table.dead_units() == {"1": [1, 4], "2": [1, 4], "3": [1, 4]}  # zero after pooling too
    assert table["0"].dead_channels == ()  # constant -1 before the ReLU: not dead
    assert table.exploding() == ["4"]
    text = str(table)
    assert "2/6" in text and "DEAD" in text and "EXPLODING" in text
    saved = json.loads(table.to_json())
    assert saved["layers"]["1"]["dead_channels"] == [1, 4] and saved["exploding"] == ["4"]
    assert "channel_mean" not in saved["layers"]["1"]  # per_channel=False


def test_bad_arguments_have_clear_errors():
    model = nn.Sequential(nn.Linear(2, 2))
    with pytest.raises(ValueError, match="histogram_bins=1"):
        layertap.stats(model, [torch.randn(2, 2)], histogram_bins=1)
    with pytest.raises(layertap.LayerNotFoundError, match="matches no layer"):
        layertap.stats(model, [torch.randn(2, 2)], "1")
    assert tensor_stats(torch.empty(0, 3)) is None


# ---------------------------------------------------------------------------- two Gloo ranks
def _model():
    torch.manual_seed(6)
    return nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3))


def _shards():
    torch.manual_seed(7)
    return [[torch.randn(5, 3, 8, 8), torch.randn(2, 3, 8, 8) * 4], [torch.randn(3, 3, 8, 8) + 2]]


def _rank(rank, world, port, out):
    torch.set_num_threads(1)  # as the reference runs: the same kernels, bit for bit
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        table = layertap.stats(_model(), _shards()[rank], per_channel=True, histogram_bins=8)
        with open(f"{out}/{rank}.json", "w") as f:
            f.write(table.to_json())
    finally:
        dist.destroy_process_group()


def test_two_gloo_ranks_merge_to_the_whole_dataset(tmp_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    # spawn, not fork: a child forked after the parent used its OpenMP threads can hang
    mp.spawn(_rank, args=(2, port, str(tmp_path)), nprocs=2)
    saved = [json.loads((tmp_path / f"{r}.json").read_text()) for r in range(2)]
    assert saved[0] == saved[1]  # every rank returns the merged table
    # the reference: each rank's batches as the ranks ran them (one thread, the same batch sizes),
    # concatenated. One forward over all 10 samples would not do: MKL picks other kernels for other
    # batch sizes (the Linear's outputs move by an ulp on AVX-512), and min, max and the histogram
    # counts are compared exactly.
    model = _model()
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.no_grad():
            per_batch = [layertap.extract(model, x, ["0", "1", "3"], stop_early=False) for s in _shards() for x in s]
    finally:
        torch.set_num_threads(threads)
    outputs = {name: torch.cat([o[name] for o in per_batch]) for name in per_batch[0]}
    assert [len(v) for v in outputs.values()] == [10, 10, 10]
    for name, values in outputs.items():
        values = values.double().numpy()
        row = saved[0]["layers"][name]
        scale = np.abs(values).max()
        assert row["count"] == values.size
        close(row["mean"], values.mean(), scale)
        close(row["std"], values.std(), scale)
        assert (row["min"], row["max"]) == (values.min(), values.max())
        channels = np.moveaxis(values, 1, -1).reshape(-1, values.shape[1])
        close(row["channel_mean"], channels.mean(axis=0), scale)
        close(row["channel_std"], channels.std(axis=0), scale)
        counts, edges = row["histogram"]["counts"], row["histogram"]["edges"]
        np.testing.assert_array_equal(counts, np.histogram(values, bins=edges)[0])
        assert sum(counts) == values.size


# maps of 2**18 values or more take the fused kernel; smaller ones, tokens and features the sums
LAYOUTS = {
    "NCHW, mean 30x the spread": lambda: torch.randn(8, 32, 32, 32) * 0.1 + 3,
    "NCHW, mean 1e6x the spread": lambda: torch.randn(8, 32, 32, 32) * 1e-3 + 1e3,
    "small NCHW, mean 30x the spread": lambda: torch.randn(4, 16, 16, 16) * 0.1 + 3,
    "small NCHW, mean 1e6x the spread": lambda: torch.randn(4, 16, 32, 32) * 1e-3 + 1e3,
    "channels-last memory": lambda: (torch.randn(8, 32, 32, 32) + 2).contiguous(memory_format=torch.channels_last),
    "tokens [B, T, D]": lambda: torch.randn(16, 197, 96) * 0.1 + 5,
    "features [N, D]": lambda: torch.randn(3000, 64) + 1,
    "1-D": lambda: torch.randn(100_000) + 4,
    "float16": lambda: (torch.randn(8, 64, 28, 28) + 2).half(),
    "bfloat16": lambda: (torch.randn(8, 64, 28, 28) + 2).bfloat16(),
    "float64": lambda: torch.randn(8, 16, 48, 48, dtype=torch.float64) * 1e-4 + 7,
    "strided": lambda: (torch.randn(32, 64, 20, 20) + 1)[:, ::2],
    "transposed": lambda: (torch.randn(96, 4000) + 1).T,
    "5-D": lambda: torch.randn(4, 16, 16, 16, 16) + 3,
    "prime sizes": lambda: torch.randn(4, 5, 131, 127) + 2,
    "after a ReLU": lambda: torch.randn(8, 64, 56, 56).relu(),
    "dead channels": lambda: torch.randn(8, 64, 56, 56).relu() * (torch.arange(64) % 5 != 0).float().view(1, -1, 1, 1),
    "constant channels": lambda: torch.full((8, 32, 32, 32), 0.3),
    "squares beyond float32": lambda: torch.randn(2, 3, 40, 40, 6) * 1e30,
    "tiny values": lambda: torch.randn(8, 32, 32, 32) * 1e-30,
}


# every way a map can be read: PyTorch's kernels, and each of the C kernels this CPU can run
READERS = ["pytorch", *(stats_module._moments.KERNELS if stats_module._moments else ())]


@pytest.fixture(params=READERS)
def reader(request, monkeypatch):
    """``tensor_stats`` reading maps the ``request.param`` way."""
    if request.param == "pytorch":
        monkeypatch.setattr(stats_module, "_moments", None)
    else:
        kernel = stats_module._moments.KERNELS.index(request.param)
        monkeypatch.setattr(stats_module, "_read_once", functools.partial(stats_module._read_once, kernel=kernel))
    return request.param


@pytest.mark.parametrize("layout", LAYOUTS)
def test_summarize_matches_numpy_in_every_layout_and_dtype(layout, reader):
    # the float32 vector kernels sum a few centred values at a time in float32, and PyTorch's
    # group normalization whole rows: the mean-1e6x-the-spread case tells if one does not centre
    torch.manual_seed(5)
    t = LAYOUTS[layout]()
    summary = tensor_stats(t, bins=16)
    row = LayerStats_of(summary)
    values = t.double().numpy()
    channel_axis = 1 if t.dim() >= 4 else t.dim() - 1 if t.dim() >= 2 else None
    check_row(row, values, channel_axis)
    counts, edges = row.histogram
    assert counts.sum() == values.size and edges[0] <= values.min() and values.max() < edges[-1]
    assert (np.histogram(values, edges)[0] == counts).all()


# a mean near 0 of a few values: a float32 sum of the values themselves misses it by a rounding of
# one of them (6e-8 of its size, 6x the tolerance's floor); found by outside testing
NEAR_ZERO = {
    "4 samples, 1 value each": torch.tensor([1.0007095336914062, -1.0006883144378662, 1.0019965171813965, -1.0020637512207031]).view(4, 1, 1, 1),
    "16 values, 1-D": torch.tensor([-0.77075183, 0.48692176, -0.67403924, -0.84250712, -1.21941733, -1.88617623, -1.01055646, 0.80824506,
                                    1.03505266, 0.08488967, 0.53233737, 0.72818506, 1.10258615, 1.79461133, -1.21008408, 1.07819736]),
}


@pytest.mark.parametrize("shape", [(2, 3, 5, 5), (1, 8, 4, 4), (6, 512, 2, 2), (3, 2, 7), (8, 16), (16,), (4, 1, 1, 1)])
def test_small_maps_with_a_mean_near_zero(shape, reader):
    gen = torch.Generator().manual_seed(7)
    maps = [torch.randn(shape, generator=gen) for _ in range(40 if np.prod(shape) < 1000 else 3)]
    for t in [*maps, *(v for v in NEAR_ZERO.values() if v.dim() == len(shape))]:
        values = t.double().numpy()
        check_row(LayerStats_of(tensor_stats(t)), values, 1 if t.dim() >= 4 else t.dim() - 1 if t.dim() >= 2 else None)


def LayerStats_of(summary):
    return layertap.LayerStats.from_summary(summary, name="x", layer="x", call=0, module_type="T", per_channel=True)


def test_a_channel_without_finite_values_has_nan_moments():
    t = torch.randn(4, 3, 5, 5)
    t[:, 1] = float("nan")
    t[:, 2, 0, 0] = float("inf")
    row = LayerStats_of(tensor_stats(t))
    assert np.isnan(row.channel_mean[1]) and np.isnan(row.channel_std[1])
    finite = t[:, 2].double().numpy()
    close(row.channel_mean[2], finite[np.isfinite(finite)].mean(), 1.0)
    close(row.mean, t[:, [0, 2]].double().numpy()[np.isfinite(t[:, [0, 2]].numpy())].mean(), 1.0)
