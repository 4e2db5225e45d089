"""Names with terminal escape sequences are printed escaped: the `failed:` lines, errors, `cam`'s
result line, progress messages and layertap's exceptions. The attack: a file named with OSC 52
(ESC ] 52 ; c ; <base64> BEL), which writes the clipboard of the terminal that prints it."""

from __future__ import annotations

import pickle
import sys
import traceback
import unicodedata

import numpy as np
import pytest
from PIL import Image

import layertap
from layertap import progress
from layertap.cli import run
from layertap.printable import printable

OSC52 = "\x1b]52;c;SGVsbG8=\x07"  # sets the clipboard to "Hello"
EVIL = f"cat{OSC52}\x9b31m\u202egnp"  # also a one-byte CSI and a right-to-left override
SHOWN = "cat\\x1b]52;c;SGVsbG8=\\x07\\x9b31m\\u202egnp"
BIDI_CONTROLS = {"LRE", "RLE", "LRO", "RLO", "PDF", "LRI", "RLI", "FSI", "PDI"}


def unsafe(text: str) -> bool:
    """Whether a terminal could act on ``text``: a control, surrogate, line separator or bidi control."""
    return any(
        unicodedata.category(c) in ("Cc", "Cs", "Zl", "Zp") or unicodedata.bidirectional(c) in BIDI_CONTROLS for c in text
    )


# ---------------------------------------------------------------------------- the function
def test_exactly_the_characters_a_terminal_acts_on_are_escaped_as_repr_writes_them():
    """Against Unicode's own categories, over the first 0x3000 code points and every surrogate."""
    for code in [*range(0x3000), *range(0xD800, 0xE000, 7)]:
        c = chr(code)
        if unsafe(c):
            assert printable(c) == repr(c)[1:-1] and not unsafe(printable(c)), hex(code)
        else:
            assert printable(c) == c, hex(code)


def test_ordinary_text_is_kept_and_escaping_twice_changes_nothing():
    text = "dogs/ünï cödé (1)/日本語 🐱 \\x1b C:\\path"
    assert printable(text) == text
    assert printable(EVIL) == SHOWN and printable(SHOWN) == SHOWN
    assert printable("a\nb\tc\rd", keep="\n\t") == "a\nb\tc\\rd"
    assert printable(3) == "3"


# ---------------------------------------------------------------------------- exceptions
@pytest.mark.parametrize(
    "cls", [layertap.LayertapError, layertap.LayerNotFoundError, layertap.StoreError, layertap.MissingExtraError]
)
def test_a_layertap_error_shows_its_message_escaped(cls):
    error = cls(f"no layer {EVIL!s} here;\nsee the list")
    assert str(error) == f"no layer {SHOWN} here;\nsee the list"  # a KeyError is not quoted; line breaks stay
    shown = "".join(traceback.format_exception_only(error))  # what a Python user's traceback prints
    assert not unsafe(shown.replace("\n", ""))
    again = pickle.loads(pickle.dumps(error))  # as it crosses from a DataLoader worker
    assert type(again) is cls and again.args == error.args and str(again) == str(error)


def test_an_error_made_of_an_escaped_message_reads_the_same():
    """A worker's failure travels back as str(e), and the main process raises it again."""
    inner = layertap.CorruptImageError(f"/data/{EVIL}.png", "cannot identify image file")
    outer = layertap.DataError(str(inner))
    assert str(outer) == str(inner) and SHOWN in str(outer)


# ---------------------------------------------------------------------------- progress
def test_progress_messages_and_bar_descriptions_are_escaped(monkeypatch, capsys):
    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # a bar is shown
    progress.say(f"resuming {EVIL}.zarr")
    with progress.progress_bar(2, desc=EVIL, unit="image") as bar:
        bar.update(2)
    err = capsys.readouterr().err
    assert f"layertap: resuming {SHOWN}.zarr" in err and SHOWN in err.split("\n", 1)[1]
    assert "\x1b]" not in err and "\x07" not in err and "\u202e" not in err


# ---------------------------------------------------------------------------- the command
@pytest.fixture
def images(tmp_path):
    """Three PNGs in one class folder, one with an OSC 52 sequence in its name."""
    folder = tmp_path / "images" / "shapes"
    folder.mkdir(parents=True)
    pixels = np.random.default_rng(0).integers(0, 255, (24, 24, 3), dtype=np.uint8)
    for name in ("a.png", "b.png", f"{EVIL}.png"):
        Image.fromarray(pixels).save(folder / name, format="PNG")
    return tmp_path / "images"


def assert_escaped(text: str) -> None:
    assert SHOWN in text and not unsafe(text.replace("\n", "")), text


def test_failed_lines_and_errors_of_extract(images, tmp_path, capsys):
    (images / "shapes" / f"{EVIL}.png").write_bytes(b"not a png")
    common = ["extract", "layertap:shapes", str(images), "--layers", "pool", "--no-progress"]
    assert run([*common, "--out", str(tmp_path / "skip.zarr"), "--on-error", "skip"]) == 0
    out = capsys.readouterr().out
    failed = [line for line in out.splitlines() if line.startswith("failed: ")]
    assert len(failed) == 1 and failed[0].startswith(f"failed: shapes/{SHOWN}.png: ")
    assert_escaped(out)
    assert run([*common, "--out", str(tmp_path / "fail.zarr"), "--on-error", "fail"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("layertap: error: cannot read image ") and err.count("\n") == 1
    assert_escaped(err)


def test_the_result_lines_of_cam(images, tmp_path, capsys):
    out = tmp_path / f"maps{OSC52}"
    assert run(["cam", "layertap:shapes", str(images), "--out", str(out), "--batch-size", "3"]) == 0
    printed = capsys.readouterr().out
    lines = printed.splitlines()
    assert len(lines) == 4 and lines[2].startswith(f"shapes/{SHOWN}.png: ")  # sorted: 'a', 'b', then 'c...'
    assert_escaped(printed)


def test_an_error_from_elsewhere_and_its_debug_traceback(monkeypatch, capsys):
    def fails(*args, **kwargs):
        raise OSError(f"cannot open {EVIL}")  # not a layertap error: raised by a library

    monkeypatch.setattr("layertap.cli.inspect.load_model", fails)
    assert run(["inspect"]) == 1
    err = capsys.readouterr().err
    assert err == f"layertap: error: cannot open {SHOWN}\n"
    assert run(["--debug", "inspect"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" in err and err.count(SHOWN) == 2
    assert_escaped(err)


MODEL_WITH_EVIL_CLASSES = f"""
from layertap.shapes import ShapesCNN


def build():
    model = ShapesCNN().eval()
    model.classes = [{EVIL!r}] * 6  # class names a model (its config, its weights' metadata) declares
    return model
"""


def test_class_names_of_a_model_in_cams_result_and_usage_errors(images, tmp_path, monkeypatch, capsys):
    (tmp_path / "evil_classes.py").write_text(MODEL_WITH_EVIL_CLASSES)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert run(["cam", "evil_classes:build", str(images), "--out", str(tmp_path / "maps"), "--target", "0"]) == 0
    printed = capsys.readouterr().out
    assert printed.splitlines()[0].startswith(f"shapes/a.png: {SHOWN} (")
    assert_escaped(printed)
    assert run(["cam", "evil_classes:build", str(images), "--out", str(tmp_path / "maps"), "--target", "dog"]) == 2
    err = capsys.readouterr().err  # the usage error lists the class names
    assert f"class names: {SHOWN}, " in err
    assert_escaped(err)


MODEL_WITH_AN_EVIL_LAYER = f"""
import torch


def build():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    model.add_module({EVIL!r}, torch.nn.ReLU())  # any text without a '.' is a module name
    return model
"""


def test_layer_names_in_the_layer_table_and_the_extract_line(tmp_path, monkeypatch, capsys):
    (tmp_path / "evil_layer.py").write_text(MODEL_WITH_AN_EVIL_LAYER)
    monkeypatch.syspath_prepend(str(tmp_path))
    assert run(["inspect", "evil_layer:build", "--input-shape", "1,4"]) == 0
    table = capsys.readouterr().out
    assert any(line.startswith(f"{SHOWN} ") for line in table.splitlines())
    assert_escaped(table)
    np.save(tmp_path / "x.npy", np.zeros((4, 4), np.float32))
    extract = ["extract", "evil_layer:build", str(tmp_path / "x.npy"), "--layers", "re:cat.*", "--no-progress"]
    assert run([*extract, "--out", str(tmp_path / "f.zarr")]) == 0
    printed = capsys.readouterr().out
    assert f"): {SHOWN} [3]" in printed.splitlines()[0]
    assert_escaped(printed)
