"""`layertap report` / `build_report`: one self-contained HTML page from any feature store, that
works with its script (hover, pin, search, driven in headless Chromium) and without it."""

import base64
import contextlib
import importlib.util
import io
import json
import re
import shutil

import numpy as np
import pytest
import torch
from headless import Browser, assert_readable, needs_chromium, render
from PIL import Image

import layertap
from layertap.cli import run
from layertap.errors import LayertapError
from layertap.overlay import UNSEEN_SHADE
from layertap.report import SECTIONS, build_report
from layertap.report.context import Context
from layertap.report.probe import linear_probe, stratified_folds
from layertap.report.projection import pca
from layertap.report.render import json_script
from layertap.report.sections import stored_stats
from layertap.shapes import generate, save_images

HEADINGS = list(SECTIONS.values())
SHAPES_LAYERS = ["features.block1", "features.block4", "classifier"]


def sections(page: str) -> dict[str, str]:
    """Each section's HTML, by heading."""
    return dict(re.findall(r"<section id='\w+'><h2>(.*?)</h2>(.*?)</section>", page, flags=re.DOTALL))


def images_of(html: str) -> list[Image.Image]:
    """The inline images of a piece of the page, decoded."""
    return [Image.open(io.BytesIO(base64.b64decode(uri))) for uri in re.findall(r"src='data:image/(?:png|jpeg);base64,([^']+)'", html)]


def samples_of(page: str) -> dict:
    """The page's samples, as its script reads them."""
    return json.loads(re.search(r"<script type='application/json' id='lt-samples'>(.*?)</script>", page, flags=re.DOTALL)[1])


def assert_self_contained(page: str) -> None:
    """No address outside the page; every image inline and decodable; scripts inline only."""
    links = re.findall(r"""(?:src|href)=['"]([^'"]*)""", page)
    assert links and all(link.startswith(("data:image/png;base64,", "data:image/jpeg;base64,", "#")) for link in links), links
    assert "://" not in page.replace("file://", "")
    assert re.findall(r"<script[^>]*>", page) == ["<script type='application/json' id='lt-samples'>", "<script>"]
    for link in links:
        if link.startswith("data:"):
            Image.open(io.BytesIO(base64.b64decode(link.split(",", 1)[1]))).verify()
    for uri in samples_of(page)["images"]:
        assert uri is None or uri.startswith(("data:image/png;base64,", "data:image/jpeg;base64,"))


@pytest.fixture(scope="module")
def shapes(tmp_path_factory):
    """A store of the bundled model over 96 generated images (ImageFolder layout), as a user makes it."""
    root = tmp_path_factory.mktemp("shapes")
    save_images(generate(96, seed=5), root / "images")
    model = layertap.load_model("layertap:shapes")
    layertap.extract_dataset(model, root / "images", SHAPES_LAYERS, root / "features.zarr", reduce="mean", progress=False, num_workers=0)
    return root


@pytest.fixture(scope="module")
def shapes_page(shapes):
    """``layertap report STORE``, nothing else given: the model and images come from the store."""
    assert run(["report", str(shapes / "features.zarr"), "--out", str(shapes / "page.html"), "--trust"]) == 0
    return (shapes / "page.html").read_text()


def test_report_of_the_bundled_model_has_every_section(shapes_page):
    found = sections(shapes_page)
    assert list(found) == HEADINGS
    assert "Not shown" not in shapes_page and "failed" not in shapes_page
    assert_self_contained(shapes_page)
    assert "features.block4.conv2" in found["Layers of the model"]
    assert "layertap.stats" in found["Activation statistics"]
    assert all(f"<td style='text-align:left'>{layer}</td>" in found["Activation statistics"] for layer in SHAPES_LAYERS)


def test_heatmaps_show_each_image_whole_beside_its_map(shapes_page):
    heatmaps = sections(shapes_page)["Heatmaps"]
    tiles = re.findall(r"<figure class='tile (ok|wrong)' data-id='([^']+)'>(.*?)</figure>", heatmaps, flags=re.DOTALL)
    assert len(tiles) == 16
    verdicts = []
    for verdict, image_id, tile in tiles:
        true, predicted = re.search(r"true: <b>(\w+)</b>.*?predicted: <b>(\w+)</b>", tile).groups()
        assert image_id.split("/")[0] == true  # the class folder the image came from
        assert verdict == ("ok" if true == predicted else "wrong")
        verdicts.append(verdict)
        raw, heat = images_of(tile)
        assert raw.size == heat.size == (64, 64)  # the image's own resolution (the shapes images are 64x64)
    assert verdicts == sorted(verdicts, key=lambda v: v == "ok")  # misclassified first
    # the bundled model is right on >= 95% of images: a mix-up of class orders would show here
    assert verdicts.count("ok") >= 14
    assert len({image_id.split("/")[0] for _, image_id, _ in tiles}) == 6  # spread over the store: every class shows
    assert "class='colourbar'" in heatmaps
    right = verdicts.count("ok")
    assert ("All 16 predictions shown are right" in heatmaps) == (right == 16)
    assert "the others red" not in heatmaps and (right == 16 or f"the {16 - right} wrong (red) come first" in heatmaps)


def test_misclassified_images_come_first(shapes, tmp_path):
    """Two circles filed as squares: the store's stored output says they are wrong, the grid
    shows both first, in red, and says how many it found."""
    folder = tmp_path / "images"
    shutil.copytree(shapes / "images", folder)
    moved = sorted((folder / "circle").glob("*.png"))[:2]
    for path in moved:
        path.rename(folder / "square" / f"x{path.name}")
    model = layertap.load_model("layertap:shapes")
    layertap.extract_dataset(model, folder, ["features.block4", "classifier"], tmp_path / "f.zarr", progress=False, num_workers=0)
    page = build_report(tmp_path / "f.zarr", tmp_path / "f.html", model=model, images=folder, heatmaps=8).read_text()
    heatmaps = sections(page)["Heatmaps"]
    tiles = re.findall(r"<figure class='tile (ok|wrong)' data-id='([^']+)'>", heatmaps)
    assert tiles[:2] == [("wrong", f"square/x{p.name}") for p in moved] and all(v == "ok" for v, _ in tiles[2:])
    assert "2 of the 96 sampled images are misclassified by the store's own output (<code>classifier</code>); the grid shows them" in heatmaps
    assert "6 of the 8 predictions shown are right (green frames); the 2 wrong (red) come first." in heatmaps


def test_classes_separate_deeper_in_the_network(shapes_page):
    plots = re.findall(r"aria-label='([^']+)'>.*?nearest class mean: (\d+)% right", sections(shapes_page)["Features in 2-D"])
    separation = {layer: int(share) for layer, share in plots}
    assert list(separation) == SHAPES_LAYERS
    assert separation["classifier"] >= 90 > separation["features.block1"]


def test_points_know_their_sample(shapes_page):
    """Every point names its sample (a tooltip without scripts) and indexes the page's samples:
    id, true class, the prediction of the stored output, a thumbnail."""
    samples = samples_of(shapes_page)
    assert len(samples["ids"]) == 96 and all(uri.startswith("data:image/") for uri in samples["images"])
    assert all(i.split("/")[0] == t for i, t in zip(samples["ids"], samples["truth"]))
    assert sum(p == t for p, t in zip(samples["predicted"], samples["truth"])) >= 90
    plots = re.findall(r"<svg class='plot'.*?</svg>", sections(shapes_page)["Features in 2-D"], flags=re.DOTALL)
    for plot in plots:
        points = re.findall(r"<circle [^>]*data-i='(\d+)'><title>([^<]*)</title></circle>", plot)
        assert sorted(int(i) for i, _ in points) == list(range(96))
        i, tip = points[0]
        assert tip == f"{samples['ids'][int(i)]} · true: {samples['truth'][int(i)]} · predicted: {samples['predicted'][int(i)]}"
    assert Image.open(io.BytesIO(base64.b64decode(samples["images"][0].split(",", 1)[1]))).size == (64, 64)


def test_probes_rank_layers(shapes_page):
    probe = sections(shapes_page)["Linear probes"]
    ranked = re.findall(r"<tr><td style='text-align:right'>(\d)</td><td style='text-align:left'>([\w.]+)</td>.*?>([\d.]+)%</td>", probe)
    accuracy = {layer: float(a) for _, layer, a in ranked}
    assert [int(rank) for rank, _, _ in ranked] == [1, 2, 3]
    assert list(accuracy.values()) == sorted(accuracy.values(), reverse=True)
    assert accuracy["classifier"] >= 90 and accuracy["features.block4"] >= 90 > accuracy["features.block1"]
    assert "5 stratified folds of 96 labelled samples" in probe


def test_statistics_count_samples_and_show_shapes_per_sample(shapes_page):
    found = sections(shapes_page)["Activation statistics"]
    row = re.search(r"<tr><td style='text-align:left'>features.block1</td>.*?</tr>", found, flags=re.DOTALL)[0]
    cells = re.findall(r"<td style='text-align:\w+'>(.*?)</td>", row, flags=re.DOTALL)
    assert cells[2:4] == ["96", "24 × 32 × 32"]  # samples, and the shape of one (not of the first batch)
    assert "Flags" not in found and "No layer is flagged" in found  # no empty column
    bars = re.findall(r"<rect [^>]*><title>([^<]*)</title></rect>", row)
    assert bars and all(re.fullmatch(r"\S+ to \S+: [\d,]+ values", b) for b in bars)
    total = sum(int(b.rsplit(": ", 1)[1].split()[0].replace(",", "")) for b in bars)
    assert total == 96 * 24 * 32 * 32  # every value in one bar


@pytest.mark.parametrize("features", [7, 90])  # fewer features than samples, and more
def test_pca_agrees_with_numpy_svd(features):
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, features)) * np.linspace(5, 0.1, features) + 4
    coords, share = pca(x.astype(np.float32))
    centred = x - x.mean(0)
    u, s, _ = np.linalg.svd(centred, full_matrices=False)
    expected = u[:, :2] * s[:2]
    signs = np.sign((coords * expected).sum(0))  # a component's sign is arbitrary
    np.testing.assert_allclose(coords * signs, expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(share, s[:2] ** 2 / (s**2).sum(), rtol=1e-5)
    one, share1 = pca(x[:, :1])  # a single feature: one component, the other zero
    assert one.shape == (60, 2) and share1[0] == pytest.approx(1) and share1[1] == 0


def test_probe_agrees_with_scikit_learn():
    """Fold by fold, the probe predicts as scikit-learn's LogisticRegression (C=1, on features
    standardised by the training folds) does."""
    linear_model = pytest.importorskip("sklearn.linear_model")
    rng = np.random.default_rng(1)
    y = rng.integers(0, 4, 150)
    x = rng.normal(size=(150, 12)) + 0.7 * np.eye(4, 12)[y] + 3 * rng.normal(size=12)  # overlapping classes
    result = linear_probe(x, y, folds=5)
    expected = []
    for f in range(5):
        train, test = result.folds != f, result.folds == f
        mean, std = x[train].mean(0), x[train].std(0)
        reference = linear_model.LogisticRegression(C=1.0, tol=1e-10, max_iter=10_000).fit((x[train] - mean) / std, y[train])
        expected.append(reference.score((x[test] - mean) / std, y[test]))
    np.testing.assert_allclose(result.fold_accuracy, expected)
    assert 0.4 < result.accuracy < 0.95 and result.chance == np.bincount(y).max() / 150


def test_folds_are_stratified():
    y = np.array([0] * 50 + [1] * 23 + [2] * 7)
    folds = stratified_folds(y, 5)
    for k in range(3):
        per_fold = np.bincount(folds[y == k], minlength=5)
        assert per_fold.max() - per_fold.min() <= 1  # each class spread evenly
    assert np.bincount(folds).max() - np.bincount(folds).min() <= 1
    assert np.array_equal(folds, stratified_folds(y, 5))  # seeded: the same folds on every run


@pytest.fixture(scope="module")
def plain(tmp_path_factory):
    """A store without model spec, image files or class names: a tensor dataset through an MLP."""
    root = tmp_path_factory.mktemp("plain")
    model = torch.nn.Sequential(torch.nn.Linear(5, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3))
    data = torch.utils.data.TensorDataset(torch.randn(80, 5), torch.arange(80) % 3)
    layertap.extract_dataset(model, data, ["1", "2"], root / "labelled.zarr", progress=False)
    layertap.extract_dataset(model, torch.randn(40, 5), ["1"], root / "bare.h5", progress=False)
    broken = torch.randn(30, 5)
    broken[:2] = float("nan")  # two samples the model turns into NaN
    layertap.extract_dataset(model, broken, ["0"], root / "nan.zarr", progress=False)
    return root


def test_statistics_of_stored_features_match_numpy(plain):
    store = layertap.open_features(plain / "labelled.zarr")
    table = stored_stats(Context(store, None, None, max_samples=1000))
    for key in ("1", "2"):
        x = store.to_numpy(key)
        row = table[key]
        assert row.count == x.size and row.shape[1:] == x.shape[1:]
        assert row.mean == pytest.approx(x.mean(dtype=np.float64), rel=1e-6)
        assert row.std == pytest.approx(x.std(dtype=np.float64), rel=1e-6)
        assert (row.min, row.max) == (x.min(), x.max())
        assert row.zero_fraction == pytest.approx((x == 0).mean())
        assert row.dead_channels == tuple(np.flatnonzero((x == 0).all(0)))
    store.close()


def test_a_store_alone_gives_what_it_can(plain):
    page = build_report(plain / "labelled.zarr", plain / "labelled.html").read_text()
    found = sections(page)
    assert list(found) == HEADINGS
    for section in ("Layers of the model", "Heatmaps"):
        assert "Not shown: the store names its model only as &#x27;Sequential&#x27;" in found[section]
        assert "--model SPEC" in found[section]
    assert found["Features in 2-D"].count("<svg class='plot'") == 2
    assert "class\u00a00" in found["Features in 2-D"]  # labels without names, on one line
    assert "Hover shows no images: the store&#x27;s samples are not image files" in found["Features in 2-D"]
    assert "No predicted classes" in found["Features in 2-D"]
    assert "5 stratified folds of 80 labelled samples" in found["Linear probes"]
    assert "of the stored features themselves, over 80 samples" in found["Activation statistics"]
    assert_self_contained(page)
    assert samples_of(page)["images"] == [None] * 80

    bare = build_report(plain / "bare.h5", plain / "bare.html").read_text()  # HDF5, no labels
    assert "The store has no labels" in bare and "class\u00a00" not in bare
    assert "Not shown: the store has no labels, and a probe learns to predict them" in sections(bare)["Linear probes"]


def test_non_finite_features_are_shown_not_hidden(plain):
    found = sections(build_report(plain / "nan.zarr", plain / "nan.html").read_text())
    assert "16 features; 2 with NaN/Inf left out" in found["Features in 2-D"]
    assert "<th style='text-align:left'>Flags</th>" in found["Activation statistics"]
    row = re.search(r"<tr style='background:#fdeeee'><td style='text-align:left'>0</td>.*?</tr>", found["Activation statistics"])
    assert row and "6.67%" in row[0] and "non-finite" in row[0]  # 2 of 30 samples


@pytest.fixture(scope="module")
def torchvision_store(shapes):
    """resnet18 over 12 of the shapes images, as `layertap extract` writes it, with weights that
    its spec does not rebuild (a fine-tuned model: the spec's random weights are seeded)."""
    model = layertap.load_model("torchvision:resnet18")
    with torch.no_grad():
        model.fc.bias += 1
    path = shapes / "resnet.zarr"
    layertap.extract_dataset(model, shapes / "images", ["layer1", "layer4", "fc"], path, reduce="mean", limit=12, progress=False, num_workers=0)
    return path, model


@pytest.fixture(scope="module")
def torchvision_page(torchvision_store):
    """``layertap report STORE`` of the resnet18 store, and what it printed."""
    path, _ = torchvision_store
    with contextlib.redirect_stdout(io.StringIO()) as printed:
        assert run(["report", str(path), "--trust"]) == 0  # its page goes beside it
    return path.with_suffix(".html"), printed.getvalue()


def test_report_of_a_torchvision_store(torchvision_page):
    page, printed = torchvision_page
    assert printed.strip() == f"report: {page}"
    found = sections(page.read_text())
    assert list(found) == HEADINGS
    # the spec loads resnet18 with other weights: its layers, but not its heatmaps
    assert "layer4.1.conv2" in found["Layers of the model"] and "its weights are not those that wrote the store" in found["Layers of the model"]
    assert "Not shown: the model&#x27;s weights are not those that wrote the store" in found["Heatmaps"]
    assert re.findall(r"<svg class='plot'[^>]*aria-label='([^']+)'", found["Features in 2-D"]) == ["layer1", "layer4", "fc"]
    assert "of the stored features themselves, over 12 samples" in found["Activation statistics"]


def test_the_model_that_wrote_a_store_explains_it(torchvision_store):
    path, model = torchvision_store
    page = build_report(path, path.with_name("same.html"), model=model, cam_layer="layer4", heatmaps=4, trust_store=True).read_text()
    found = sections(page)
    assert [name for name, body in found.items() if "Not shown" in body] == ["Linear probes"]
    assert "the store has 1 and 12" in found["Linear probes"]  # its 12 images are all circles
    assert "GradCAM at <code>layer4</code>" in found["Heatmaps"] and found["Heatmaps"].count("<figure") == 4
    assert "computed by <code>layertap.stats</code> over 12 of the store's images" in found["Activation statistics"]
    # random weights know no class names: "class 713" stays on one line
    assert re.findall(r"predicted: <b>class\u00a0\d+</b>", found["Heatmaps"]) and "predicted: <b>class " not in found["Heatmaps"]
    # resnet18 resizes the 64x64 images to 256 and crops the centre 224: drawn on the whole image,
    # a border of 64 * 16 / 256 = 4 pixels that the model did not see is dimmed, not coloured
    first = re.search(r"<figure class='tile[^']*' data-id='([^']+)'>(.*?)</figure>", found["Heatmaps"], flags=re.DOTALL)
    heat = np.asarray(images_of(first[2])[1], dtype=float)
    raw = np.asarray(Image.open(path.parent / "images" / first[1]).convert("RGB"), dtype=float)
    assert heat.shape == raw.shape == (64, 64, 3)
    border = np.ones((64, 64), bool)
    border[4:60, 4:60] = False
    assert np.abs(heat[border] - np.round(UNSEEN_SHADE * raw[border])).max() <= 1
    assert np.abs(heat[~border] - UNSEEN_SHADE * raw[~border]).mean() > 20


def test_missing_images_and_unreadable_samples(shapes, tmp_path):
    nowhere = build_report(shapes / "features.zarr", tmp_path / "a.html", model="layertap:shapes", images=tmp_path / "nowhere").read_text()
    assert "Not shown: 16 of the store&#x27;s image files are not where it says" in sections(nowhere)["Heatmaps"]

    folder = tmp_path / "images"
    shutil.copytree(shapes / "images" / "circle", folder / "circle")
    (folder / "circle" / "broken.png").write_bytes(b"not a png")
    model = layertap.load_model("layertap:shapes")
    layertap.extract_dataset(model, folder, ["classifier"], tmp_path / "f.zarr", on_error="skip", progress=False, num_workers=0)
    page = build_report(tmp_path / "f.zarr", tmp_path / "b.html", model=model, images=folder).read_text()
    good = len(list(folder.glob("circle/0*.png")))
    assert f"{good + 1:,}, of which 1 could not be read" in page
    assert "broken.png" not in sections(page)["Heatmaps"] and "Not shown" not in sections(page)["Heatmaps"]
    assert f"for {good} samples" in page


def test_usage_errors(shapes, tmp_path, capsys):
    assert run(["report", str(tmp_path / "missing.zarr")]) == 2
    assert run(["report", str(shapes / "features.zarr"), "--arch", "torchvision:resnet18"]) == 2
    assert run(["report", str(shapes / "features.zarr"), "--method", "gradcamm"]) == 2
    assert run(["report", str(shapes / "images")]) == 1
    assert "layertap: error:" in capsys.readouterr().err.splitlines()[-1]  # one line, not a traceback
    with pytest.raises(LayertapError, match="unknown cam_method"):
        build_report(shapes / "features.zarr", tmp_path / "x.html", cam_method="gradcamm")
    assert run(["report", "--help"]) == 0
    assert "Example: layertap report" in capsys.readouterr().out


def test_a_store_at_a_url(shapes, tmp_path, capsys):
    url = f"file://{tmp_path}/copy.zarr"  # through fsspec, as an object store's URL
    shutil.copytree(shapes / "features.zarr", tmp_path / "copy.zarr")
    assert run(["report", url]) == 2  # a page cannot go "beside" a URL
    assert "say where the page goes with --out" in capsys.readouterr().err
    assert run(["report", url, "--out", str(tmp_path / "r.html"), "--heatmaps", "2"]) == 0
    assert list(sections((tmp_path / "r.html").read_text())) == HEADINGS


def test_data_is_named_once(shapes, tmp_path, monkeypatch):
    """A store of a relative image folder names it as "the image folder images", not "images images"."""
    monkeypatch.chdir(shapes)
    model = layertap.load_model("layertap:shapes")
    layertap.extract_dataset(model, "images", ["classifier"], tmp_path / "rel.zarr", limit=6, progress=False, num_workers=0)
    store = sections(build_report(tmp_path / "rel.zarr", tmp_path / "rel.html").read_text())["Feature store"]
    assert "<th>Data</th><td>the image folder <code>images</code></td>" in store


def test_other_projections_only_when_installed(plain, tmp_path):
    page = sections(build_report(plain / "labelled.zarr", tmp_path / "p.html", projections=("pca", "tsne", "umap")).read_text())["Features in 2-D"]
    for title, module in (("t-SNE", "sklearn"), ("UMAP", "umap")):
        if importlib.util.find_spec(module) is None:
            assert f"{title} is not drawn: it needs <code>{module}</code> installed" in page
        else:
            assert f"<h3>{title}</h3>" in page
    assert page.count("<h3>") >= 1 and "<h3>PCA</h3>" in page
    with pytest.raises(LayertapError, match="unknown projections"):
        build_report(plain / "labelled.zarr", tmp_path / "x.html", projections=("mds",))


@needs_chromium
def test_a_page_with_missing_sections_renders(torchvision_page):
    page, _ = torchvision_page
    assert_readable(render(page), HEADINGS)


POINT = """(function (plot, index) {
  var circle = document.querySelectorAll("svg.plot")[plot].querySelectorAll("circle[data-i]")[index];
  circle.scrollIntoView({block: "center"});
  var box = circle.getBoundingClientRect();
  return [box.x + box.width / 2, box.y + box.height / 2, +circle.getAttribute("data-i")];
})"""
TIP = """(function () {
  var tip = document.getElementById("lt-tip"), img = tip.querySelector("img");
  var lines = [].filter.call(tip.children, function (e) { return e.tagName !== "IMG"; });
  return {shown: !tip.hidden, pinned: tip.classList.contains("pinned"), text: lines.map(function (e) { return e.textContent; }),
          image: img ? img.src : null, hovered: document.querySelectorAll("circle.hover").length,
          marked: [].map.call(document.querySelectorAll("circle.hover, circle.pinned, circle.hit"), function (c) { return +c.getAttribute("data-i"); })};
})()"""


@needs_chromium
def test_hover_pin_and_search_in_a_browser(shapes_page, shapes):
    """Real mouse events at a point's place on the screen show its thumbnail, id and classes,
    ring the same sample in every plot; a click pins it; typing an id finds it everywhere."""
    samples = samples_of(shapes_page)
    plots = len(SHAPES_LAYERS)
    with Browser() as browser:
        browser.open(shapes / "page.html")
        x, y, i = browser.evaluate(f"{POINT}(0, 10)")
        browser.move(x, y)
        tip = browser.evaluate(TIP)
        assert tip["shown"] and not tip["pinned"]
        assert tip["text"] == [samples["ids"][i], f"true: {samples['truth'][i]}", f"predicted: {samples['predicted'][i]}"]
        assert tip["image"] == samples["images"][i]  # the thumbnail
        assert tip["hovered"] == plots and set(tip["marked"]) == {i}  # the same sample in every layer's plot

        browser.click(x, y)
        assert browser.evaluate(TIP)["pinned"]
        x2, y2, other = browser.evaluate(f"{POINT}(2, 40)")
        browser.move(x2, y2)
        assert browser.evaluate(TIP)["text"][0] == samples["ids"][i]  # pinned: hovering others leaves it
        browser.click(5, 5)  # elsewhere: unpinned
        assert not browser.evaluate(TIP)["shown"]

        browser.evaluate("document.getElementById('lt-find').focus()")
        browser.type(samples["ids"][other])
        tip = browser.evaluate(TIP)
        assert tip["pinned"] and tip["text"][0] == samples["ids"][other]
        assert browser.evaluate("document.querySelectorAll('circle.hit').length") == plots
        assert browser.evaluate("document.getElementById('lt-found').textContent") == f"{samples['ids'][other]}: ringed in every plot"

        x, y = browser.evaluate("(function () { var bar = document.querySelector('svg.hist rect'); bar.scrollIntoView({block: 'center'});"
                                " var b = bar.getBoundingClientRect(); return [b.x + b.width / 2, b.bottom - 1]; })()")
        browser.click(5, 5)
        browser.move(x, y)
        assert re.fullmatch(r"\S+ to \S+: [\d,]+ values", browser.evaluate("document.getElementById('lt-tip').textContent"))
        assert browser.errors() == []


@needs_chromium
def test_without_scripts_the_page_keeps_its_sections(shapes_page, shapes, tmp_path):
    """Scripts off, the page reads the same: every section, the points (named in tooltips),
    the heatmap grid, the probe table; only the finder, which needs the script, is hidden."""
    with Browser(scripts=False, height=2000) as browser:
        browser.open(shapes / "page.html")
        assert browser.evaluate("document.documentElement.className") == ""  # the page's script did not run
        assert browser.evaluate("[].map.call(document.querySelectorAll('h2'), function (h) { return h.textContent; })") == HEADINGS
        assert browser.evaluate("document.querySelectorAll('svg.plot').length") == len(SHAPES_LAYERS)
        assert browser.evaluate("document.querySelectorAll('svg.plot circle > title').length") == 96 * len(SHAPES_LAYERS)
        assert browser.evaluate("document.querySelectorAll('figure.tile img').length") == 32
        assert browser.evaluate("document.querySelector('#probe table').rows.length") == 1 + len(SHAPES_LAYERS)
        assert browser.evaluate("getComputedStyle(document.querySelector('.finder')).display") == "none"
        browser.screenshot(tmp_path / "off.png")
        assert browser.errors() == []
    pixels = np.asarray(Image.open(tmp_path / "off.png").convert("RGB"))
    assert pixels.shape == (2000, 1280, 3) and len(np.unique(pixels.reshape(-1, 3)[::7], axis=0)) > 200  # not blank


@needs_chromium
def test_sample_ids_are_text_never_markup(shapes, tmp_path):
    """An image named like markup shows as its name: escaped in the HTML, inert in the JSON
    block, written as text by the script (it would set ``window.pwned`` if run)."""
    folder = tmp_path / "images"
    for name in ("circle", "cross"):
        shutil.copytree(shapes / "images" / name, folder / name)
    evil = "<img src=x onerror=window.pwned=1>'\"&.png"
    Image.open(next((folder / "cross").glob("*.png"))).transpose(Image.Transpose.ROTATE_90).save(folder / "circle" / evil)  # a point of its own
    model = layertap.load_model("layertap:shapes")
    layertap.extract_dataset(model, folder, ["classifier"], tmp_path / "f.zarr", progress=False, num_workers=0)
    page_file = build_report(tmp_path / "f.zarr", tmp_path / "f.html", model=model, images=folder)
    page = page_file.read_text()
    assert "<img src=x" not in page
    assert json_script("x", ["</script><b>"]) == "<script type='application/json' id='x'>[\"\\u003c/script\\u003e\\u003cb\\u003e\"]</script>"
    samples = samples_of(page)
    i = samples["ids"].index(f"circle/{evil}")
    with Browser() as browser:
        browser.open(page_file)
        x, y, _ = browser.evaluate(f"""(function () {{
          var circle = document.querySelector("svg.plot circle[data-i='{i}']");
          circle.scrollIntoView({{block: "center"}});
          var box = circle.getBoundingClientRect();
          return [box.x + box.width / 2, box.y + box.height / 2, 0];
        }})()""")
        browser.move(x, y)
        assert browser.evaluate(TIP)["text"][0] == f"circle/{evil}"
        browser.evaluate("document.getElementById('lt-find').focus()")
        browser.type(evil)
        assert browser.evaluate("document.getElementById('lt-found').textContent") == f"circle/{evil}: ringed in every plot"
        assert browser.evaluate("window.pwned === undefined") and browser.errors() == []


def test_a_store_killed_before_its_first_chunk_says_to_resume(tmp_path, capsys):
    """The case: `report` of such a store gave NumPy's ``need at least one array to concatenate``.
    The extraction stops in its first chunk, after the store is made: what a kill there leaves."""
    save_images(generate(12, seed=3), tmp_path / "images")
    model = layertap.load_model("layertap:shapes")
    forwards = []

    def stop(module, args):
        forwards.append(1)
        if len(forwards) == 2:  # the first chunk's second batch
            raise KeyboardInterrupt

    hook = model.register_forward_pre_hook(stop)
    store = tmp_path / "killed.zarr"
    with pytest.raises(KeyboardInterrupt):
        layertap.extract_dataset(model, tmp_path / "images", SHAPES_LAYERS, store, batch_size=2, chunk_size=4, num_workers=0, progress=False)
    hook.remove()
    expected = (
        f"the feature store {store} holds no complete rows yet: its extraction stopped before writing its first chunk; "
        "run the same extraction again to resume it, then make the report"
    )
    with pytest.warns(UserWarning, match="incomplete"), pytest.raises(layertap.StoreError) as caught:
        build_report(store, tmp_path / "r.html", model=model, images=tmp_path / "images", progress=False)
    assert str(caught.value) == expected
    args = ["report", str(store), "--out", str(tmp_path / "r.html"), "--model", "layertap:shapes", "--images", str(tmp_path / "images")]
    with pytest.warns(UserWarning, match="incomplete"):
        assert run(args) == 1
    assert capsys.readouterr().err == f"layertap: error: {expected}\n"
    assert not (tmp_path / "r.html").exists()
