"""`layertap report` / `build_report`: one self-contained HTML page from any feature store."""

import base64
import contextlib
import io
import re
import shutil

import numpy as np
import pytest
import torch
from headless import assert_readable, needs_chromium, render
from PIL import Image

import layertap
from layertap.cli import run
from layertap.errors import LayertapError
from layertap.report import SECTIONS, _Context, _pca, _stored_stats, build_report
from layertap.shapes import generate, save_images

HEADINGS = list(SECTIONS.values())
SHAPES_LAYERS = ["features.block1", "features.block4", "classifier"]


def sections(page: str) -> dict[str, str]:
    """Each section's HTML, by heading."""
    return dict(re.findall(r"<section id='\w+'><h2>(.*?)</h2>(.*?)</section>", page, flags=re.DOTALL))


def assert_self_contained(page: str) -> None:
    """No address outside the page; every image an inline PNG that decodes."""
    links = re.findall(r"""(?:src|href)=['"]([^'"]*)""", page)
    assert links and all(link.startswith(("data:image/png;base64,", "#")) for link in links), links
    assert "<script" not in page and "://" not in page.replace("file://", "")
    for link in links:
        if link.startswith("data:"):
            Image.open(io.BytesIO(base64.b64decode(link.split(",", 1)[1]))).verify()


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
    assert all(f"<td>{layer}</td>" in found["Activation statistics"] for layer in SHAPES_LAYERS)


def test_heatmaps_name_true_and_predicted_classes(shapes_page):
    tiles = re.findall(r"<figure class='tile (ok|wrong)'><img [^>]*title='([^']+)'>.*?true: <b>(\w+)</b>.*?predicted: <b>(\w+)</b>", shapes_page)
    assert len(tiles) == 16
    for verdict, image_id, true, predicted in tiles:
        assert image_id.split("/")[0] == true  # the class folder the image came from
        assert verdict == ("ok" if true == predicted else "wrong")
    # the bundled model is right on >= 95% of images: a mix-up of class orders would show here
    assert sum(v == "ok" for v, *_ in tiles) >= 14
    assert len({true for _, _, true, _ in tiles}) == 6  # spread over the store: every class shows


def test_classes_separate_deeper_in_the_network(shapes_page):
    plots = re.findall(r"aria-label='([^']+)'>.*?nearest class mean: (\d+)% right", sections(shapes_page)["Features in 2-D (PCA)"])
    separation = {layer: int(share) for layer, share in plots}
    assert list(separation) == SHAPES_LAYERS
    assert separation["classifier"] >= 90 > separation["features.block1"]


def test_pca_agrees_with_numpy_svd():
    rng = np.random.default_rng(0)
    x = rng.normal(size=(60, 7)) * np.array([5, 3, 1, 1, 0.5, 0.2, 0.1]) + 4
    coords, share = _pca(x.astype(np.float32))
    centred = x - x.mean(0)
    u, s, _ = np.linalg.svd(centred, full_matrices=False)
    expected = u[:, :2] * s[:2]
    signs = np.sign((coords * expected).sum(0))  # a component's sign is arbitrary
    np.testing.assert_allclose(coords * signs, expected, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(share, s[:2] ** 2 / (s**2).sum(), rtol=1e-5)
    one, share1 = _pca(x[:, :1])  # a single feature: one component, the other zero
    assert one.shape == (60, 2) and share1[0] == pytest.approx(1) and share1[1] == 0


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
    table = _stored_stats(_Context(store, None, None, max_samples=1000))
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
    assert found["Features in 2-D (PCA)"].count("<svg class='plot'") == 2
    assert "class 0" in found["Features in 2-D (PCA)"]  # labels without names
    assert "of the stored features themselves, over 80 samples" in found["Activation statistics"]
    assert_self_contained(page)

    bare = build_report(plain / "bare.h5", plain / "bare.html").read_text()  # HDF5, no labels
    assert "The store has no labels" in bare and "class 0" not in bare


def test_non_finite_features_are_shown_not_hidden(plain):
    found = sections(build_report(plain / "nan.zarr", plain / "nan.html").read_text())
    assert "16 features; 2 with NaN/Inf left out" in found["Features in 2-D (PCA)"]
    row = re.search(r"<tr class='flagged'><td>0</td>.*?</tr>", found["Activation statistics"])
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
    assert re.findall(r"aria-label='([^']+)'", found["Features in 2-D (PCA)"]) == ["layer1", "layer4", "fc"]
    assert "of the stored features themselves, over 12 samples" in found["Activation statistics"]


def test_the_model_that_wrote_a_store_explains_it(torchvision_store):
    path, model = torchvision_store
    page = build_report(path, path.with_name("same.html"), model=model, cam_layer="layer4", heatmaps=4, trust_store=True).read_text()
    found = sections(page)
    assert "Not shown" not in page
    assert "GradCAM at <code>layer4</code>" in found["Heatmaps"] and found["Heatmaps"].count("<figure") == 4
    assert "computed by <code>layertap.stats</code> over 12 of the store's images" in found["Activation statistics"]


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
    assert "broken.png" not in sections(page)["Heatmaps"] and "Not shown" not in page
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


@needs_chromium
def test_a_page_with_missing_sections_renders(torchvision_page):
    page, _ = torchvision_page
    assert_readable(render(page), HEADINGS)
