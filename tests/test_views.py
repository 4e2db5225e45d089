"""Notebook views: the HTML of StatsTable, LayerTable, FeatureStore and Tap shows their numbers,
escaped; `layertap.cam.show` draws maps over images as a grid (HTML and PNG)."""

import html
import re
from collections import OrderedDict

import numpy as np
import pytest
import torch
from torch import nn

import layertap
from layertap.cam import GradCAM, HeatmapGrid, show
from layertap.records import SkippedSample
from layertap.store.format import StorePlan, array_specs
from layertap.store.writer import StoreWriter
from layertap.tables import Table, sparkline

NAME = "<b>a&b</b>"  # a layer name is data: it must come out escaped
ESCAPED = "&lt;b&gt;a&amp;b&lt;/b&gt;"


def model_with_a_strange_name() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(OrderedDict([(NAME, nn.Linear(4, 3)), ("relu", nn.ReLU())]))


def cells(html: str) -> list[list[str]]:
    """The text of each row's cells (tags dropped), for checking numbers where they belong."""
    return [re.findall(r"<t[dh][^>]*>(.*?)</t[dh]>", row) for row in re.findall(r"<tr[^>]*>(.*?)</tr>", html)]


def row_of(html: str, first: str) -> list[str]:
    return next(row for row in cells(html) if row and row[0] == first)


# --------------------------------------------------------------------- the one renderer
def test_the_table_escapes_every_cell_but_its_own_html():
    table = Table(["name", "n"], [["<i>", "1"], ["x", sparkline(np.array([1, 3]), np.array([0.0, 1.0, 2.0]))]], numeric={"n"})
    page = table.html()
    assert "&lt;i&gt;" in page and "<i>" not in page
    assert page.count("<rect") == 2 and "0 to 2" in page
    assert "text-align:right'>1<" in page  # numbers align right


# --------------------------------------------------------------------- stats
def test_stats_table_html_has_the_numbers_and_sparklines():
    model = model_with_a_strange_name()
    data = [torch.randn(16, 4) for _ in range(3)]
    table = layertap.stats(model, data, histogram_bins=8, progress=False)
    page = table._repr_html_()
    assert ESCAPED in page and NAME not in page
    row = table["relu"]
    cells_relu = row_of(page, "relu")
    assert cells_relu[:7] == ["relu", "ReLU", "16x3", f"{row.mean:.4g}", f"{row.std:.4g}", "0", f"{row.max:.4g}"]
    assert cells_relu[7] == f"{100 * row.zero_fraction:.3g}%"
    counts, _ = row.histogram
    svg = re.search(r"<svg.*?</svg>", cells_relu[-2]).group(0)
    assert svg.count("<rect") == len(counts)  # one bar per bin
    assert page.count("<svg") == 2  # one sparkline per row
    assert "mean, std, min and max are over finite values" in page


def test_stats_table_html_without_histograms_has_no_sparkline_and_shades_flagged_rows():
    model = nn.Sequential(nn.Linear(4, 3), nn.ReLU())
    with torch.no_grad():
        model[0].weight.zero_()
        model[0].bias.fill_(-1.0)  # every ReLU unit is dead
    table = layertap.stats(model, [torch.randn(8, 4)], progress=False)
    page = table.to_html()
    assert "<svg" not in page and "histogram" not in page
    assert row_of(page, "1")[-2:] == ["3/3", "DEAD"]
    assert page.count("background:#fdeeee") == 1  # the dead layer's row
    assert str(table).splitlines()[0].split()[:3] == ["layer", "type", "shape"]  # the text table stays


# --------------------------------------------------------------------- summary
def test_layer_table_html_has_the_numbers_escaped():
    table = layertap.summary(model_with_a_strange_name(), torch.randn(2, 4))
    page = table._repr_html_()
    assert page == table.to_html() and ESCAPED in page and NAME not in page
    assert row_of(page, ESCAPED) == [ESCAPED, "Linear", "[2, 4]", "[2, 3]", "float32", "1", "15", "15", "12 B"]
    assert "Sequential: 15 parameters (15 trainable); example batch of 2" in page


# --------------------------------------------------------------------- the store
def test_feature_store_html_shows_arrays_completeness_and_failures(tmp_path):
    specs = array_specs([(NAME, None, (3,), "float32")])
    layout = StorePlan(specs, 10, 4, None, "int64", {specs[0].key: np.zeros((1, 3), np.float32)})
    writer = StoreWriter.create(tmp_path / "s.zarr", "zarr", {"settings": {}, "layers": [NAME]}, layout)
    writer.write_chunk(0, {specs[0].key: np.ones((4, 3), np.float32)}, np.arange(4), [])
    writer.write_chunk(2, {specs[0].key: np.ones((2, 3), np.float32)}, np.arange(8, 10), [SkippedSample(9, 9, "OSError")])
    writer.close()
    with pytest.warns(UserWarning, match="incomplete"):
        store = layertap.open_features(tmp_path / "s.zarr")
    page = store._repr_html_()
    facts = dict(row for row in cells(page) if len(row) == 2)
    assert facts["samples"] == "10 (INCOMPLETE: 2 of 3 chunks written; 5 rows hold features)"
    assert facts["failed"] == "1" and facts["format"] == "zarr" and facts["labels"] == "int64"
    assert row_of(page, html.escape(specs[0].key))[1:] == ["[10, 3]", "float32", "120 B"]


def test_a_complete_store_says_so(tmp_path):
    data = torch.utils.data.TensorDataset(torch.randn(6, 4), torch.arange(6))
    store = layertap.extract_dataset(model_with_a_strange_name(), data, "relu", tmp_path / "f.zarr", progress=False)
    page = store._repr_html_()
    assert "6 (complete; 6 rows hold features)" in page and row_of(page, "relu")[1:] == ["[6, 3]", "float32", "72 B"]


# --------------------------------------------------------------------- the tap
def test_tap_html_shows_layers_shapes_and_bytes():
    model = model_with_a_strange_name()
    with layertap.tap(model, [NAME, "relu"], capture=("output", "grad"), keep="all") as taps:
        model(torch.randn(2, 4, requires_grad=True)).sum().backward()
        model(torch.randn(2, 4))
    page = taps._repr_html_()
    assert ESCAPED in page and NAME not in page
    assert row_of(page, "relu")[1:] == ["output", "2", "[2, 3]", "float32", "48 B"]  # two forwards kept
    grads = [row for row in cells(page) if row[:2] == ["relu", "grad"]]
    assert grads == [["relu", "grad", "1", "[2, 3]", "float32", "24 B"]]  # only the first forward had a backward
    assert dict(row for row in cells(page) if len(row) == 2)["held"] == "144 B (keep=&#x27;all&#x27;)"  # (48 + 24) B per layer


def test_tap_html_before_any_forward_and_with_observe():
    model = model_with_a_strange_name()
    page = layertap.tap(model, "relu")._repr_html_()
    assert row_of(page, "relu")[1:] == ["output", "0", "-", "-", "-"]
    with layertap.tap(model, "relu", observe=lambda *args: None) as taps:
        model(torch.randn(2, 4))
        assert "every value goes to observe=" in taps._repr_html_()


# --------------------------------------------------------------------- heatmaps
def test_show_draws_a_grid_of_heatmaps():
    pytest.importorskip("PIL", reason="the vision extra draws images")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(4, 3))
    x = torch.randn(5, 3, 16, 16)  # normalised inputs: stretched to [0, 1] for drawing
    maps = GradCAM(model, "0")(x)
    assert isinstance(maps, torch.Tensor)  # the methods still return tensors
    grid = show(x, maps, [f"<{i}>" for i in range(5)], columns=3)
    assert isinstance(grid, HeatmapGrid) and len(grid) == 5
    assert grid.image().size == (48, 32)  # 3 columns, 2 rows of 16 px tiles
    page = grid._repr_html_()
    assert page.count("<img") == 5 and "&lt;4&gt;" in page and "<4>" not in page
    assert grid._repr_png_().startswith(b"\x89PNG")
    uint8 = show((np.random.default_rng(0).random((2, 16, 16, 3)) * 255).astype(np.uint8), maps[:2])
    assert uint8.image().size == (32, 16)
    with pytest.raises(layertap.ArgumentError, match="one map .* per image: got 5 images, 2 maps"):
        show(x, maps[:2])
