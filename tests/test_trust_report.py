"""`layertap report` reads a store as data: it runs no model the store names unless trusted, and
reads no image outside the store's image folder.

The stores are real: a small extraction, then its metadata or ids rewritten as an attacker would.
What must not happen is checked for real: a marker file the named code writes, a process that
survives ``os:abort``, and Python's audit hook for every file the process opens.
"""

import base64
import html
import json
import re
import shutil
import subprocess
import sys

import h5py
import numpy as np
import pytest
import zarr

import layertap
from layertap.cli import run
from layertap.report import SECTIONS, build_report
from layertap.shapes import generate, save_images

MODEL_SECTIONS = ("Layers of the model", "Heatmaps")
SUFFIX = {"zarr": ".zarr", "npy": "", "hdf5": ".h5"}
OPENED: list[str] = []  # files opened by this process whose path names the secret (the audit hook below)


def sections(page: str) -> dict[str, str]:
    return dict(re.findall(r"<section id='\w+'><h2>(.*?)</h2>(.*?)</section>", page, flags=re.DOTALL))


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """Images in ``data/images`` (ImageFolder layout), a private image in ``secret`` beside them,
    and a store of each format made from the images by the bundled model."""
    root = tmp_path_factory.mktemp("trust")
    images = root / "data" / "images"
    save_images(generate(12, seed=7), images)
    secret = root / "secret" / "private.png"
    secret.parent.mkdir()
    shutil.copy(next(images.glob("*/*.png")), secret)

    def record(event, args):
        if event == "open" and args and "private.png" in str(args[0]):
            OPENED.append(str(args[0]))

    sys.addaudithook(record)  # for the whole session: audit hooks cannot be removed
    model = layertap.load_model("layertap:shapes")
    for format, suffix in SUFFIX.items():
        layertap.extract_dataset(model, images, "classifier", root / f"s-{format}{suffix}", format=format, progress=False, num_workers=0)
    return root


def crafted(base, tmp_path, format="zarr", ids=None, **meta):
    """A copy of the ``format`` store with ``meta`` fields replaced and, given, its sample ids."""
    source = base / f"s-{format}{SUFFIX[format]}"
    path = tmp_path / source.name
    (shutil.copytree if source.is_dir() else shutil.copy)(source, path)
    with layertap.open_features(path) as store:
        meta = {**store.meta, **meta}
    if format == "zarr":
        group = zarr.open_group(path, mode="r+")
        group.attrs.update({"layertap": meta})
        if ids is not None:
            group["ids"][:] = np.array(ids)
    elif format == "npy":
        (path / "layertap.json").write_text(json.dumps(meta))
        if ids is not None:
            np.save(path / "ids.npy", np.array(ids))
    else:
        with h5py.File(path, "r+") as f:
            f.attrs["layertap"] = json.dumps(meta)
            if ids is not None:
                f["ids"][:] = np.array(ids, dtype=object)
    return path


@pytest.fixture
def marker_module(tmp_path, monkeypatch):
    """A module that writes a marker file when imported; its ``build`` returns the bundled model."""
    marker = tmp_path / "ran"
    (tmp_path / "store_models.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('ran')\n"
        "import layertap\n\n\ndef build():\n    return layertap.load_model('layertap:shapes')\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    yield "store_models:build", marker
    sys.modules.pop("store_models", None)


# ---------------------------------------------------------------------------- the store's model
@pytest.mark.parametrize("format", list(SUFFIX))
def test_the_model_a_store_names_is_not_loaded_without_consent(base, tmp_path, marker_module, format, capsys):
    spec, marker = marker_module
    store = crafted(base, tmp_path, format, model=spec)
    page = build_report(store, tmp_path / "page.html").read_text()
    assert not marker.exists()
    found = sections(page)
    assert list(found) == list(SECTIONS.values())
    for section in MODEL_SECTIONS:
        note = found[section]
        assert note.startswith("<p class='missing'>Not shown: the store records its model as &#x27;store_models:build&#x27;")
        assert "--model SPEC" in note and "--trust to load &#x27;store_models:build&#x27;" in note
    assert "<svg class='plot'" in found[SECTIONS["projection"]]  # the store's own data is all shown
    assert capsys.readouterr().err == ""


def test_breakpoint_named_by_a_store_is_never_called(base, tmp_path, monkeypatch):
    called = []
    monkeypatch.setattr(sys, "breakpointhook", lambda *a, **k: called.append(a))
    store = crafted(base, tmp_path, model="builtins:breakpoint")
    page = build_report(store, tmp_path / "page.html").read_text()
    assert not called and "--trust to load &#x27;builtins:breakpoint&#x27;" in page


def test_os_abort_named_by_a_store_does_not_kill_the_report(base, tmp_path):
    store = crafted(base, tmp_path, model="os:abort")
    out = tmp_path / "page.html"
    done = subprocess.run(
        [sys.executable, "-m", "layertap", "report", str(store), "--out", str(out)],
        capture_output=True, text=True, timeout=300, check=False,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"report: {out}" and done.stderr == ""
    assert "--trust to load &#x27;os:abort&#x27;" in out.read_text()


def test_consent_loads_the_recorded_model_and_names_it_first(base, tmp_path, marker_module, capsys):
    spec, marker = marker_module
    store = crafted(base, tmp_path, model=spec)
    page = build_report(store, tmp_path / "page.html", trust_store=True).read_text()
    assert marker.read_text() == "ran"
    assert capsys.readouterr().err == f"layertap: loading the model the store records (trusted): {spec!r}\n"
    found = sections(page)
    assert "Not shown" not in page and found["Heatmaps"].count("<figure") == 12  # the model that wrote the store


def test_cli_trust(base, tmp_path, marker_module, capsys):
    spec, marker = marker_module
    store = crafted(base, tmp_path, model=spec)
    out = tmp_path / "page.html"
    assert run(["report", str(store), "--out", str(out)]) == 0
    assert not marker.exists() and capsys.readouterr().err == ""
    assert "--trust to load" in out.read_text()

    assert run(["report", str(store), "--out", str(out), "--trust"]) == 0
    printed = capsys.readouterr()
    assert printed.err.splitlines() == [f"layertap: loading the model the store records (trusted): {spec!r}"]
    assert printed.out.strip() == f"report: {out}"
    assert marker.exists() and "Not shown" not in out.read_text()


def test_a_hugging_face_spec_in_a_store_needs_consent(base, tmp_path):
    import transformers

    folder = tmp_path / "vit"
    config = transformers.ViTConfig(image_size=32, patch_size=8, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=20)
    transformers.ViTModel(config).save_pretrained(folder)
    store = crafted(base, tmp_path, model=f"hf:{folder}")
    page = sections(build_report(store, tmp_path / "page.html").read_text())
    assert f"--trust to load &#x27;hf:{folder}&#x27;" in page["Layers of the model"]
    trusted = sections(build_report(store, tmp_path / "trusted.html", trust_store=True).read_text())
    assert "ViTLayer" in trusted["Layers of the model"]  # loaded, though not the model that wrote the store
    assert "Not shown: the model&#x27;s weights are not those that wrote the store" in trusted["Heatmaps"]


# ---------------------------------------------------------------------------- the store's sample ids
@pytest.mark.parametrize("bad", ["inside (control)", "../../secret/private.png", "absolute", "link out", "NUL byte"])
def test_sample_ids_are_read_only_inside_the_image_folder(base, tmp_path, bad):
    secret = base / "secret" / "private.png"
    images = base / "data" / "images"
    with layertap.open_features(base / "s-zarr.zarr") as store:
        ids = store.ids.tolist()
    if bad == "link out":  # a link inside the folder to a file outside it
        images = tmp_path / "images"
        shutil.copytree(base / "data" / "images", images)
        (images / "circle" / "link.png").symlink_to(secret)
        ids[0] = "circle/link.png"
    elif bad != "inside (control)":
        ids[0] = {"absolute": str(secret), "NUL byte": "circle/\x00.png"}.get(bad, bad)
    store = crafted(base, tmp_path, ids=ids)
    OPENED.clear()
    page = build_report(store, tmp_path / "page.html", model=layertap.load_model("layertap:shapes"), images=images).read_text()
    found = sections(page)
    assert not OPENED  # the private image was never opened
    if bad == "inside (control)":
        assert found["Heatmaps"].count("<figure") == 12 and "Not shown" not in page
        return
    assert found["Heatmaps"] == (
        f"<p class='missing'>Not shown: the store&#x27;s sample id {html.escape(repr(ids[0]))} leads outside its image "
        f"folder {images.resolve()}, and layertap reads no image outside it; the store was altered: extract it again "
        "from the images.</p>"
    )
    assert "of the stored features themselves" in found["Activation statistics"]  # the stored data instead
    assert "leads outside its image folder" in found["Activation statistics"]
    assert base64.b64encode(secret.read_bytes()[:60]).decode() not in page


@pytest.mark.parametrize("format", ["npy", "hdf5"])
def test_the_cli_refuses_ids_outside_too(base, tmp_path, format):
    secret = base / "secret" / "private.png"
    with layertap.open_features(base / f"s-{format}{SUFFIX[format]}") as store:
        ids = store.ids.tolist()
    store = crafted(base, tmp_path, format, ids=ids[:5] + ["../../secret/private.png", str(secret)] + ids[7:])
    out = tmp_path / "page.html"
    OPENED.clear()
    assert run(["report", str(store), "--out", str(out), "--model", "layertap:shapes", "--trust"]) == 0
    heatmaps = sections(out.read_text())["Heatmaps"]
    assert not OPENED and "&#x27;../../secret/private.png&#x27; (and 1 more) leads outside" in heatmaps


def test_the_image_folder_a_store_records_is_read_only_with_consent(base, tmp_path):
    """A crafted store may record someone's private folder as its images: it is not read unless
    the user names the folder or trusts the store."""
    private = base / "secret"
    store = crafted(base, tmp_path, root=str(private), ids=["private.png"] * 12)
    OPENED.clear()
    page = build_report(store, tmp_path / "page.html", model="layertap:shapes").read_text()
    assert not OPENED
    assert "the store records its images as" in sections(page)["Heatmaps"] and "--trust" in sections(page)["Heatmaps"]


def test_the_named_spec_cannot_write_to_the_terminal(base, tmp_path, capsys):
    """The line on stderr quotes the store's text: no newline or escape sequence gets through."""
    spec = "hf:/nowhere\n\x1b[2Jlayertap: all good"
    store = crafted(base, tmp_path, model=spec)
    page = build_report(store, tmp_path / "page.html", trust_store=True).read_text()
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "\x1b" not in err and repr(spec) in err
    assert "could not be loaded" in sections(page)["Layers of the model"]


def test_control_and_bidirectional_characters_from_a_store_never_reach_the_page(base, tmp_path):
    """ESC, BEL and U+202E in names a store holds are shown escaped, as on the terminal."""
    text = "\u202e\x1b[31mRED\x1b]0;title\x07<b>"
    store = crafted(base, tmp_path, model=f"m{text}", data=f"d{text}")
    page = build_report(store, tmp_path / "page.html").read_text()
    assert not any(c in page for c in ("\x1b", "\x07", "\u202e"))
    assert "\\x1b[31mRED" in page and "\\u202e" in page and "&lt;b&gt;" in page
