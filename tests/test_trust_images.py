"""Bad image files are data failures: one line naming the file, or a ``failed`` entry, in workers too.

Every folder is made here: good images, plus a decompression bomb (a PNG whose header claims
100000x100000 pixels), a truncated JPEG, an empty file, text named .jpg, a 250-character name,
a file that vanishes after listing, an unreadable file and a directory named ``x.png``.
"""

from __future__ import annotations

import io
import os
import struct
import zlib
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from PIL import Image
from torch.utils.data import DataLoader

import layertap
from layertap.cli import run
from layertap.data import DataError, ImageFiles, image_to_tensor, iter_batches, open_data
from layertap.images import CorruptImageError, find_images, load_image
from layertap.shapes import generate, save_images


def bomb(path: Path, width: int = 100_000, height: int = 100_000) -> Path:
    """An 8x8 PNG whose header (IHDR, CRC fixed) claims ``width`` x ``height`` pixels."""
    buffer = io.BytesIO()
    Image.new("RGB", (8, 8)).save(buffer, "PNG")
    data = bytearray(buffer.getvalue())
    # signature (8 bytes), IHDR length (4), b"IHDR" (4), width (4), height (4), ...; CRC of type + data
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(bytes(data[12:29])))
    path.write_bytes(bytes(data))
    return path


def picture(path: Path, size: tuple[int, int] = (50, 40)) -> Path:
    """A real image of ``size`` (width, height): 2000 pixels by default."""
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)).save(path)
    return path


def truncated_jpeg(path: Path) -> Path:
    picture(path, (64, 64))
    path.write_bytes(path.read_bytes()[:200])
    return path


def written(path: Path, content: bytes) -> Path:
    path.write_bytes(content)
    return path


BAD: dict[str, Callable[[Path], Path]] = {
    "bomb": lambda root: bomb(root / "bomb.png"),
    "truncated": lambda root: truncated_jpeg(root / "truncated.jpg"),
    "empty": lambda root: written(root / "empty.png", b""),
    "text": lambda root: written(root / "notes.jpg", b"not an image at all"),
    "long name": lambda root: truncated_jpeg(root / ("n" * 246 + ".jpg")),
}


def folder_with(tmp_path: Path, kind: str) -> tuple[Path, Path]:
    """Six good PNGs in class folders and one bad file of ``kind`` at the root."""
    root = tmp_path / "images"
    save_images(generate(6, seed=3, size=32), root)
    return root, BAD[kind](root)


def assert_one_line(message: str, path: Path) -> None:
    assert str(path) in message, message
    assert "\n" not in message and "Traceback" not in message, message


def bad_id(root: Path, bad: Path) -> str:
    return bad.relative_to(root).as_posix()


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("kind", list(BAD))
def test_a_bad_image_stops_with_one_line_naming_it_or_is_skipped(tmp_path, kind, workers):
    root, bad = folder_with(tmp_path, kind)
    with pytest.raises(DataError) as caught:
        for _ in iter_batches(root, batch_size=2, num_workers=workers):
            pass
    assert_one_line(str(caught.value), bad)
    assert "on_error='skip'" in str(caught.value)  # the fix

    seen, failed = [], []
    for batch in iter_batches(root, batch_size=2, num_workers=workers, on_error="skip"):
        seen += batch.ids
        failed += batch.failed
    ids = find_images(root).ids()
    assert seen == [i for i in ids if i != bad_id(root, bad)]  # every good image, in order
    assert [(f.index, f.id) for f in failed] == [(ids.index(bad_id(root, bad)), bad_id(root, bad))]
    assert "\n" not in failed[0].error and "on_error" not in failed[0].error  # what went wrong, not the fix


def load_error(path: Path, max_image_pixels: int | None = None) -> CorruptImageError:
    with pytest.raises(CorruptImageError) as caught:
        load_image(path, max_image_pixels=max_image_pixels)
    return caught.value


def test_each_bad_file_raises_corrupt_image_error_with_the_cause(tmp_path):
    errors = {kind: load_error(make(tmp_path)) for kind, make in BAD.items()}
    for error in errors.values():
        assert_one_line(str(error), error.path)
        assert error.__cause__ is not None
    assert errors["bomb"].reason.startswith("DecompressionBombError")
    assert "--max-image-pixels" in str(errors["bomb"])  # a bomb may be a genuine big image: how to allow it
    assert errors["text"].reason.startswith("UnidentifiedImageError")
    assert errors["empty"].reason == "the file is empty (0 bytes)"


def test_a_directory_named_like_an_image_is_not_listed_and_not_readable(tmp_path):
    root = tmp_path / "images"
    save_images(generate(2, seed=0, size=32), root)
    (root / "x.png").mkdir()
    assert "x.png" not in find_images(root).ids()
    error = load_error(root / "x.png")
    assert_one_line(str(error), root / "x.png")
    assert error.reason.startswith("IsADirectoryError")


@pytest.mark.parametrize("workers", [0, 2])
def test_a_file_that_vanishes_or_cannot_be_opened_is_a_data_failure(tmp_path, workers):
    root = tmp_path / "images"
    save_images(generate(4, seed=0, size=32), root)
    picture(root / "locked.png").chmod(0)
    gone = root / "gone.png"
    sources = {}
    for on_error in ("skip", "fail"):
        picture(gone)
        sources[on_error] = open_data(root, batch_size=2, num_workers=workers, on_error=on_error)
        gone.unlink()  # listed, then deleted (a shared folder being cleaned)
    errors = {f.id: f.error for batch in sources["skip"].batches() for f in batch.failed}
    assert errors["gone.png"].startswith("FileNotFoundError")
    if os.geteuid() != 0:  # root reads any file
        assert errors["locked.png"].startswith("PermissionError")
    with pytest.raises(DataError) as caught:
        list(sources["fail"].batches())
    assert_one_line(str(caught.value), gone if os.geteuid() == 0 else root / "locked.png")


@pytest.mark.parametrize("workers", [0, 2])
def test_every_kind_at_once_is_listed_and_the_good_images_load(tmp_path, workers):
    root = tmp_path / "images"
    good = save_images(generate(6, seed=3, size=32), root)
    bad = [make(root) for make in BAD.values()]
    (root / "x.png").mkdir()
    batches = list(iter_batches(root, batch_size=4, num_workers=workers, on_error="skip"))
    failed = [f.id for b in batches for f in b.failed]
    assert sorted(failed) == sorted(bad_id(root, p) for p in bad)
    assert sorted(i for b in batches for i in b.ids) == sorted(bad_id(root, p) for p in good)
    assert sum(len(b.inputs) for b in batches) == len(good)


# ----------------------------------------------------------------------------------- pixel limit
def test_pils_default_limit_refuses_the_bomb_before_decoding(tmp_path):
    assert Image.MAX_IMAGE_PIXELS == 89_478_485  # PIL's default, untouched
    error = load_error(bomb(tmp_path / "bomb.png"))
    assert "10000000000 pixels" in error.reason
    assert "10000000000 pixels" in load_error(tmp_path / "bomb.png", 1000).reason  # also under a lower limit


def test_max_image_pixels_lowers_and_raises_the_limit(tmp_path, monkeypatch):
    path = picture(tmp_path / "big.png")  # 50x40 = 2000 pixels
    assert load_image(path, max_image_pixels=2000).size == (50, 40)
    error = load_error(path, 1000)
    assert "2000 pixels, more than the limit of 1000" in error.reason and "--max-image-pixels" in str(error)

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500)  # PIL refuses above 1000 pixels
    assert load_error(path).reason.startswith("DecompressionBombError")  # the default follows PIL
    assert load_image(path, max_image_pixels=5000).size == (50, 40)  # raised above PIL's own
    assert load_image(path, max_image_pixels=0).size == (50, 40)  # no limit
    assert Image.MAX_IMAGE_PIXELS == 500  # PIL's global is as it was
    with pytest.raises(ValueError, match="max_image_pixels"):
        load_image(path, max_image_pixels=-1)


def small(image: Image.Image):
    return image_to_tensor(image.resize((32, 32)))


@pytest.mark.parametrize("workers", [0, 2])
def test_open_data_applies_max_image_pixels_in_workers(tmp_path, workers):
    root = tmp_path / "images"
    save_images(generate(3, seed=0, size=32), root)  # 1024 pixels each
    big = picture(root / "big.png")  # 2000 pixels

    def failed(**options) -> list[str]:
        source = open_data(root, batch_size=2, num_workers=workers, transform=small, on_error="skip", **options)
        return [f.id for batch in source.batches() for f in batch.failed]

    assert failed() == []
    assert failed(max_image_pixels=1500) == ["big.png"]
    assert failed(max_image_pixels=1000) == find_images(root).ids()  # all of them
    with pytest.raises(DataError) as caught:
        list(open_data(root, num_workers=workers, max_image_pixels=1500).batches())
    assert_one_line(str(caught.value), big)
    assert "more than the limit of 1500" in str(caught.value)


def test_the_limit_is_fixed_in_the_parent_so_a_spawned_worker_keeps_it(tmp_path, monkeypatch):
    # a spawned worker imports PIL afresh, with PIL's default limit: only the number the
    # dataset carries can make it refuse what the parent refuses
    path = picture(tmp_path / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500)
    dataset = ImageFiles([path], None, None)
    assert dataset.max_image_pixels == 1000
    loader = DataLoader(dataset, batch_size=1, num_workers=1, multiprocessing_context="spawn")
    with pytest.raises(Exception, match="more than the limit of 1000"):
        next(iter(loader))


def test_raising_the_limit_in_threads_leaves_each_call_its_own_limit(tmp_path, monkeypatch):
    path = picture(tmp_path / "big.png")
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 500)  # PIL alone refuses above 1000 pixels

    def outcome(limit: int | None) -> str:
        try:
            load_image(path, max_image_pixels=limit)
        except CorruptImageError:
            return "refused"
        return "loaded"

    limits = [None, 1000, 5000, 0] * 40
    with ThreadPoolExecutor(8) as pool:
        outcomes = list(pool.map(outcome, limits))
    expected = {None: "refused", 1000: "refused", 5000: "loaded", 0: "loaded"}
    assert outcomes == [expected[limit] for limit in limits]
    assert Image.MAX_IMAGE_PIXELS == 500


# ------------------------------------------------------------------------------- end to end
def test_extract_dataset_records_every_bad_image(tmp_path):
    root = tmp_path / "images"
    save_images(generate(6, seed=3, size=32), root)
    bad = [make(root) for make in BAD.values()]
    model = layertap.load_model("layertap:shapes")
    store = layertap.extract_dataset(
        model, root, "pool", tmp_path / "s.zarr", on_error="skip", num_workers=2, batch_size=4, progress=False
    )
    with store:
        assert sorted(f.id for f in store.failed) == sorted(bad_id(root, p) for p in bad)
        assert store.complete and store.num_samples == 6 + len(bad)
        features = store.to_numpy("pool")
        rows = [store.ids.tolist().index(bad_id(root, p)) for p in bad]
        assert np.isnan(features[rows]).all() and not np.isnan(np.delete(features, rows, axis=0)).any()


@pytest.fixture
def bomb_folder(tmp_path) -> tuple[Path, Path]:
    root = tmp_path / "images"
    save_images(generate(6, seed=3, size=32), root)
    return root, bomb(root / "bomb.png")


def extract_command(root: Path, out: Path, *extra: str) -> list[str]:
    return ["extract", "layertap:shapes", str(root), "--layers", "pool", "--out", str(out), "--workers", "2", *extra]


def test_cli_extract_stops_at_a_bomb_with_one_line(bomb_folder, tmp_path, capsys):
    root, path = bomb_folder
    assert run(extract_command(root, tmp_path / "f.zarr")) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    [line] = [line for line in err.splitlines() if line.startswith("layertap: error:")]
    assert f"cannot read image {path}: DecompressionBombError" in line and "--max-image-pixels" in line


def test_cli_extract_max_image_pixels_reaches_the_workers(bomb_folder, tmp_path, capsys):
    root, _ = bomb_folder
    picture(root / "big.png")  # 2000 pixels; the shapes are 1024
    assert run(extract_command(root, tmp_path / "f.zarr", "--on-error", "skip", "--max-image-pixels", "1500")) == 0
    failed = [line for line in capsys.readouterr().out.splitlines() if line.startswith("failed:")]
    assert failed[0] == "failed: big.png: it has 50x40 = 2000 pixels, more than the limit of 1500"
    assert failed[1].startswith("failed: bomb.png: DecompressionBombError") and len(failed) == 2


def test_cli_cam_takes_max_image_pixels(tmp_path, capsys):
    path = picture(tmp_path / "big.png")  # 2000 pixels
    command = ["cam", "layertap:shapes", str(path), "--out", str(tmp_path / "maps")]
    assert run([*command, "--max-image-pixels", "1000"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and f"cannot read image {path}: it has 50x40 = 2000 pixels" in err
    assert run([*command, "--max-image-pixels", "2000"]) == 0
