"""`layertap demo`, end to end in a subprocess, as a new user runs it."""

import re
import subprocess
import sys

import pytest
from headless import assert_readable, needs_chromium, render

import layertap
from layertap.cli import run
from layertap.demo import DEMO_LAYERS, run_demo
from layertap.errors import LayertapError
from layertap.report import SECTIONS


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    out = tmp_path_factory.mktemp("demo") / "layertap-demo"
    done = subprocess.run(
        [sys.executable, "-m", "layertap", "demo", "--out", str(out)], capture_output=True, text=True, timeout=600, check=False
    )
    return done, out


def test_demo_runs_the_tour(demo):
    done, out = demo
    assert done.returncode == 0, done.stderr[-3000:]
    lines = done.stdout.splitlines()
    assert f"5/5 report: {out / 'report.html'}" in lines
    assert re.fullmatch(r"run time: \d+\.\d s", lines[-1])
    assert re.search(r"^ShapesCNN: [\d,]+ parameters", done.stdout, flags=re.MULTILINE)  # the layer table's footer
    assert all(re.search(rf"^\s*{re.escape(layer)}\s+", done.stdout, flags=re.MULTILINE) for layer in DEMO_LAYERS)
    pointing = re.search(r"peak falls inside the shape in ([\d.]+)% of the 300 images", done.stdout)
    assert pointing and float(pointing[1]) >= 90


def test_demo_store_reopens(demo):
    _, out = demo
    with layertap.open_features(out / "features.zarr") as store:
        assert store.format == "zarr" and store.complete
        assert store.num_samples == 300 and store.layers == DEMO_LAYERS
        assert store["classifier"].shape == (300, 6) and len(set(store.labels.tolist())) == 6
        assert store.meta["model"] == "layertap:shapes"


def test_demo_report_has_every_section(demo):
    _, out = demo
    page = (out / "report.html").read_text()
    assert re.findall(r"<h2>(.*?)</h2>", page) == list(SECTIONS.values())
    assert "Not shown" not in page and "<script src" not in page  # its one script is inline
    assert page.count("<figure class='tile") == 16 and page.count("<svg class='plot'") == len(DEMO_LAYERS)


def test_demo_probes_rise_with_depth(demo):
    """The bundled model is right on 99.9% of images: a linear probe must find the classes in
    its last block and its logits, and much less in its first blocks."""
    _, out = demo
    probe = re.search(r"<section id='probe'>.*?</section>", (out / "report.html").read_text(), flags=re.DOTALL)[0]
    accuracy = {layer: float(a) for layer, a in re.findall(r"<td style='text-align:left'>([\w.]+)</td>.*?>([\d.]+)%</td>", probe)}
    assert sorted(accuracy) == sorted(DEMO_LAYERS)
    assert accuracy["features.block4"] >= 97 and accuracy["classifier"] >= 97
    assert max(accuracy["features.block1"], accuracy["features.block2"]) < 60 < accuracy["features.block4"]
    assert accuracy["features.block1"] < accuracy["features.block3"] < accuracy["features.block4"]
    assert "5 stratified folds of 300 labelled samples" in probe


@needs_chromium
def test_demo_report_renders_in_chromium(demo):
    _, out = demo
    assert_readable(render(out / "report.html"), list(SECTIONS.values()))


def test_demo_leaves_folders_it_did_not_write(tmp_path):
    (tmp_path / "images").mkdir()
    (tmp_path / "images" / "mine.txt").write_text("keep")
    with pytest.raises(LayertapError, match="was not written by layertap demo"):
        run_demo(tmp_path)
    assert (tmp_path / "images" / "mine.txt").read_text() == "keep"


def test_demo_help_shows_an_example(capsys):
    assert run(["demo", "--help"]) == 0
    assert "Example: layertap demo --out" in capsys.readouterr().out
