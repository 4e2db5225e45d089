"""Images are decoded only by Pillow's raster decoders: a PostScript file named ``photo.png`` runs no Ghostscript.

A fake ``gs`` first on ``PATH`` logs every run: the tests read its log, not a mock. Pillow looks
for Ghostscript once per process and remembers, so each test makes it look again (worker
processes forked from the test inherit that, and the ``PATH``). The control test shows that
Pillow, called plainly, does run the fake.
"""

from __future__ import annotations

import os
import shlex
import struct
import subprocess
from pathlib import Path

import numpy as np
import pytest
from PIL import EpsImagePlugin, Image, features

import layertap
from layertap.cli import run
from layertap.data import iter_batches
from layertap.images import CorruptImageError, load_image
from layertap.shapes import generate, save_images

EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 8 8\n0 0 moveto 8 8 lineto stroke\nshowpage\n"
# a DOS EPS: a binary header (magic, then offset and length of the PostScript) before the same text
DOS_EPS = struct.pack("<IIIIIIIH", 0xC6D3D0C5, 30, len(EPS), 0, 0, 0, 0, 0xFFFF) + EPS


@pytest.fixture
def gs_log(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A logging ``gs`` first on PATH; the log exists once anything ran it."""
    folder, log = tmp_path / "bin", tmp_path / "gs.log"
    folder.mkdir()
    gs = folder / "gs"
    gs.write_text(f'#!/bin/sh\necho "$@" >> {shlex.quote(str(log))}\n[ "$1" = --version ] && {{ echo 10.02.1; exit 0; }}\nexit 1\n')
    gs.chmod(0o755)
    monkeypatch.setenv("PATH", f"{folder}{os.pathsep}{os.environ['PATH']}")
    monkeypatch.setattr(EpsImagePlugin, "gs_binary", None)  # make Pillow look for gs again
    return log


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    """Four good PNGs in class folders and a PostScript file named ``photo.png`` at the root."""
    root = tmp_path / "images"
    save_images(generate(4, seed=1, size=32), root)
    (root / "photo.png").write_bytes(EPS)
    return root


def test_control_pillow_alone_hands_postscript_to_the_fake_gs(tmp_path, gs_log):
    (tmp_path / "photo.png").write_bytes(EPS)
    with pytest.raises(subprocess.CalledProcessError), Image.open(tmp_path / "photo.png") as image:  # the fake renders nothing
        image.load()
    assert gs_log.exists()


@pytest.mark.parametrize("content", [EPS, DOS_EPS], ids=["eps", "dos eps"])
def test_load_image_refuses_postscript_without_running_it(tmp_path, gs_log, content):
    path = tmp_path / "photo.png"
    path.write_bytes(content)
    with pytest.raises(CorruptImageError) as refused:
        load_image(path)
    message = str(refused.value)
    assert "\n" not in message and str(path) in message
    assert refused.value.reason.startswith("it is a PostScript (EPS) file, a format layertap never decodes")
    assert "PNG, JPEG, BMP, GIF, TIFF, WebP or PPM" in refused.value.reason
    assert not gs_log.exists()


def test_a_file_of_another_format_is_an_unreadable_image(tmp_path):
    path = tmp_path / "icon.png"
    Image.new("RGB", (8, 8), "red").save(path, format="ICO")  # a decoder Pillow has, outside the list
    assert Image.open(path).format == "ICO"
    with pytest.raises(CorruptImageError) as refused:
        load_image(path)
    assert refused.value.reason == "UnidentifiedImageError: not a PNG, JPEG, BMP, GIF, TIFF, WebP or PPM image, the only formats layertap decodes"


FORMATS = [("PNG", ".png"), ("JPEG", ".jpg"), ("BMP", ".bmp"), ("GIF", ".gif"), ("TIFF", ".tif"), ("PPM", ".ppm"), ("PPM", ".pgm"), ("JPEG", ".png")]
if features.check("webp"):
    FORMATS.append(("WEBP", ".webp"))


@pytest.mark.parametrize(("format", "suffix"), FORMATS)
def test_every_allowed_format_reads_as_pillow_reads_it(tmp_path, format, suffix):
    """Each raster format, named by its suffix or not (a JPEG named .png), reads as Pillow's own open."""
    pixels = np.random.default_rng(0).integers(0, 255, (12, 10, 3), dtype=np.uint8)
    image = Image.fromarray(pixels).convert("L" if suffix == ".pgm" else "RGB")
    path = tmp_path / f"image{suffix}"
    image.save(path, format=format)
    with Image.open(path) as reference:
        assert reference.format in (format, "MPO")
        expected = np.asarray(reference.convert("RGB"))
    np.testing.assert_array_equal(np.asarray(load_image(path)), expected)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_postscript_file_in_a_folder_is_a_skipped_sample(folder, gs_log, workers):
    batches = list(iter_batches(folder, batch_size=2, num_workers=workers, on_error="skip"))
    [failure] = [f for batch in batches for f in batch.failed]
    assert failure.id == "photo.png" and failure.error.startswith("it is a PostScript (EPS) file")
    assert sum(len(batch) for batch in batches) == 4
    assert not gs_log.exists()


# --------------------------------------------------------------------------- every command
def test_cli_extract_records_it_as_failed(folder, gs_log, tmp_path, capsys):
    command = ["extract", "layertap:shapes", str(folder), "--layers", "pool", "--out", str(tmp_path / "f.zarr"), "--on-error", "skip"]
    assert run(command) == 0
    failed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("failed:")]
    assert failed == ["failed: photo.png: it is a PostScript (EPS) file, a format layertap never decodes (its decoder runs a program); images must be PNG, JPEG, BMP, GIF, TIFF, WebP or PPM"]
    assert not gs_log.exists()


@pytest.mark.parametrize("command", ["stats", "cam"])
def test_cli_stats_and_cam_stop_with_one_line(folder, gs_log, tmp_path, capsys, command):
    extra = ["--out", str(tmp_path / "maps")] if command == "cam" else []
    assert run([command, "layertap:shapes", str(folder), *extra]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot read image {folder / 'photo.png'}: it is a PostScript (EPS) file" in err
    assert not gs_log.exists()


def test_cli_report_images_runs_no_ghostscript(folder, gs_log, tmp_path, capsys):
    (folder / "photo.png").unlink()
    store = tmp_path / "f.zarr"
    layertap.extract_dataset(layertap.load_model("layertap:shapes"), folder, "pool", store, progress=False, num_workers=0)
    next(folder.glob("*/*.png")).write_bytes(EPS)  # an image replaced after the extraction
    out = tmp_path / "page.html"
    assert run(["report", str(store), "--out", str(out), "--images", str(folder), "--model", "layertap:shapes", "--heatmaps", "2"]) == 0
    assert "PostScript (EPS) file" in out.read_text()  # said on the page, where the image would be
    assert not gs_log.exists()
