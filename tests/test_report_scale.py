"""A report that scales: caps on the layers drawn, probed and listed and on the points per plot,
with the page naming what it left out; and features read a block of rows at a time, wide
layers hashed to a bounded width, so memory follows the sampled rows, not a layer's width.

The case: a store of 1,000 small layers took 43 s and wrote a 35.7 MB page of 300,000 SVG
circles; a 300k-feature layer peaked at 3.3 GB. The numbers after the fix are in the docs
(measured by a script, not here: the tests check the rule at a small size).
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from torch import nn

import layertap
from layertap.cli import run
from layertap.report import build_report, context
from layertap.report.context import spread, vectors
from layertap.report.projection import pca

LAYERS = 30


class Fan(nn.Module):
    """``LAYERS`` small layers, each fed the input (none feeds another), one of them huge."""

    def __init__(self, huge: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.branches = nn.ModuleList(nn.Linear(4, 3) for _ in range(LAYERS))
        with torch.no_grad():
            self.branches[huge].weight *= 1e6  # magnitudes above 1e4: flagged in the statistics

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.stack([b(x) for b in self.branches]).sum(0)


@pytest.fixture(scope="module")
def many(tmp_path_factory):
    """A store of 30 small layers over 40 labelled samples; layer 3 is flagged."""
    root = tmp_path_factory.mktemp("many")
    data = torch.utils.data.TensorDataset(torch.randn(40, 4), torch.arange(40) % 2)
    layers = [f"branches.{i}" for i in range(LAYERS)]
    layertap.extract_dataset(Fan(huge=3), data, layers, root / "many.zarr", progress=False, num_workers=0)
    return root / "many.zarr", layers


def plot_titles(page: str) -> list[str]:
    return re.findall(r"<svg class='plot'[^>]*aria-label='([^']+)'", page)


def test_layers_drawn_probed_and_listed_are_capped_and_named(many, tmp_path):
    store, layers = many
    page = build_report(store, tmp_path / "r.html", max_layers=5, max_points=10, progress=False).read_text()
    expected = [layers[i] for i in (0, 7, 14, 22, 29)]  # evenly spread, the first and the last among them
    assert plot_titles(page) == expected
    plots = re.findall(r"<svg class='plot'.*?</svg>", page, flags=re.DOTALL)
    assert [p.count("<circle") for p in plots] == [10] * 5
    samples = re.search(r"id='lt-samples'>(.*?)</script>", page)[1]
    assert samples.count('"ids":[') == 1 and len(re.search(r'"ids":\[(.*?)\]', samples)[1].split(",")) == 10
    left = [n for n in layers if n not in expected]
    note = f"Drawn: 5 of the 30 stored layers, evenly spread from the first to the last; left out: {', '.join(left[:12])}, … (25 in all)."
    assert note in page and "Pass max_layers= / --max-layers N to show more." in page
    assert "Probed: 5 of the 30 stored layers" in page
    probe_rows = re.findall(r"<tr><td[^>]*>(\d+)</td><td[^>]*>(branches\.\d+)</td><td[^>]*>(\d+)</td>", page)
    assert sorted(name for _, name, _ in probe_rows) == sorted(expected)
    assert all(int(depth) == layers.index(name) + 1 for _, name, depth in probe_rows)  # depth in the whole store
    stats = page[page.index("<section id='stats'>") :]
    listed = re.findall(r"<td style='text-align:left'>(branches\.\d+)</td>", stats)
    assert listed == sorted(expected + ["branches.3"], key=layers.index)  # the flagged one too, though not spread
    assert "Listed: 6 of the 30 stored layers, evenly spread from the first to the last, and every flagged one" in stats
    assert "evenly spread over the 40 in the store; pass max_points= / --max-points N to draw more" in page


def test_the_default_caps(many, tmp_path):
    """The case: every layer got a plot (300,000 circles for 1,000 layers of 300 samples)."""
    store, layers = many
    page = build_report(store, tmp_path / "r.html", progress=False).read_text()
    assert plot_titles(page) == [layers[i] for i in spread(np.arange(LAYERS), 24)]
    assert len(plot_titles(page)) == 24 and "Drawn: 24 of the 30 stored layers" in page
    assert page.count("<circle") == 24 * 40


def test_a_store_within_the_caps_shows_everything_and_says_nothing(many, tmp_path):
    store, layers = many
    page = build_report(store, tmp_path / "r.html", max_layers=LAYERS, progress=False).read_text()
    assert plot_titles(page) == layers and "left out" not in page and "stored layers, evenly spread" not in page


def test_the_cli_passes_the_caps(many, tmp_path):
    store, layers = many
    out = tmp_path / "r.html"
    assert run(["report", str(store), "--out", str(out), "--max-layers", "2", "--max-points", "5", "--no-progress"]) == 0
    page = out.read_text()
    assert plot_titles(page) == [layers[0], layers[-1]] and page.count("<circle") == 10
    assert run(["report", str(store), "--out", str(out), "--max-layers", "0"]) == 2  # a usage error
    with pytest.raises(layertap.ArgumentError, match="max_layers >= 1"):
        build_report(store, out, max_layers=0)


class Reads:
    """A stored array (NumPy's, in memory) that records the bytes of every read."""

    def __init__(self, values: np.ndarray) -> None:
        self.values, self.shape, self.dtype, self.reads = values, values.shape, values.dtype, []

    def __getitem__(self, index):
        part = self.values[index]
        self.reads.append(part.nbytes)
        return part


def test_a_wide_layer_is_read_a_block_at_a_time_and_hashed_to_a_bounded_width(monkeypatch):
    """The case: a 300k-feature layer was read whole and copied in float64 (3.3 GB). Here a
    layer 5x wider than the bound, low-rank plus noise: its rows are read a block at a time,
    hashed to `FEATURES` columns, and keep the exact principal components and distances."""
    monkeypatch.setattr(context, "BLOCK_BYTES", 1 << 20)
    rng = np.random.default_rng(0)
    n, width = 300, 5 * context.FEATURES
    basis = rng.normal(size=(3, width)).astype(np.float32)
    values = (rng.normal(size=(n, 3)) * [9, 4, 2]).astype(np.float32) @ basis + rng.normal(size=(n, width)).astype(np.float32)
    array = Reads(values)
    rows = np.arange(0, n, 2)
    x, features, how = vectors(array, rows)
    assert x.shape == (len(rows), context.FEATURES) and features == width
    assert how == f"hashed into {context.FEATURES:,} by signed feature hashing"
    assert max(array.reads) <= 1 << 20  # never more than a block of rows at once
    assert sum(array.reads) == values.nbytes  # each row read once
    exact = values[rows].astype(np.float64)
    # distances between samples, to a few percent (feature hashing's error is ~ 1/sqrt(FEATURES))
    i, j = rng.integers(0, len(rows), (2, 200))
    keep = i != j
    hashed_d = np.linalg.norm(x[i[keep]] - x[j[keep]], axis=1)
    exact_d = np.linalg.norm(exact[i[keep]] - exact[j[keep]], axis=1)
    np.testing.assert_allclose(hashed_d, exact_d, rtol=0.1)
    # the plane the report draws: the exact PCA's coordinates up to sign, to 5% of their scale
    # (hashing's relative error on a dot product is about sqrt(2 / FEATURES), 3%)
    coords, _ = pca(x)
    reference, _ = pca(exact)
    signs = np.sign((coords * reference).sum(0))
    assert np.abs(coords * signs - reference).max() <= 0.05 * np.abs(reference).max()
    again, _, _ = vectors(array, rows)
    assert np.array_equal(again, x)  # seeded: the same page on every run


def test_maps_are_averaged_per_block_as_before():
    """Maps and tokens are reduced as they were (each channel averaged, tokens averaged)."""
    rng = np.random.default_rng(1)
    maps = rng.normal(size=(20, 6, 4, 4)).astype(np.float32)
    tokens = rng.normal(size=(20, 5, 7)).astype(np.float32)
    rows = np.array([0, 3, 4, 19])
    x, width, how = vectors(maps, rows)
    np.testing.assert_allclose(x, maps[rows].mean((2, 3)), rtol=1e-6)
    assert (width, how) == (6, "each channel averaged over its positions")
    x, width, how = vectors(tokens, rows)
    np.testing.assert_allclose(x, tokens[rows].mean(1), rtol=1e-6)
    assert (width, how) == (7, "averaged over tokens")


def test_a_wide_store_makes_a_page_that_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(context, "FEATURES", 64)  # so that a small store is wide
    model = nn.Sequential(nn.Linear(4, 1000))
    data = torch.utils.data.TensorDataset(torch.randn(30, 4), torch.arange(30) % 3)
    layertap.extract_dataset(model, data, ["0"], tmp_path / "wide.zarr", progress=False, num_workers=0)
    page = build_report(tmp_path / "wide.zarr", tmp_path / "r.html", progress=False).read_text()
    assert "1,000 features (hashed into 64 by signed feature hashing)" in page
    assert "Before probing: hashed into 64 by signed feature hashing." in page
    assert re.search(r"<td[^>]*>0</td><td[^>]*>1</td><td[^>]*>1,000</td>", page)  # the probe table gives the real width
