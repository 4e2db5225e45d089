"""Image files: finding them in folders (ImageFolder layout) and reading them with clear errors.

A folder whose sub-folders hold images is labelled as torchvision's ``ImageFolder`` does: the
sorted names of the top-level sub-folders are the classes, every image below one of them gets
its index. Images directly in the root get label -1. A folder of images alone is unlabelled.

Any file that does not decode (truncated, corrupt, empty, not an image, unreadable, too many
pixels) raises one `CorruptImageError` naming it, so that ``on_error`` treats them all alike.

Decoders that run no programs. Only the raster formats of `IMAGE_FORMATS` (PNG, JPEG, BMP,
GIF, TIFF, WebP, PPM) are decoded, whatever a file is named: Pillow hands EPS and PostScript to
Ghostscript, an outside program with a long history of code-execution bugs, so a PostScript file
named ``photo.png`` is an unreadable image like any other, and nothing is run.

As the model saw it. A model sees an image through its transform, which resizes and centre
crops it. `view_box` says which part of the image that is, `model_view` draws that part as
the model got it, and `to_original` lays a map over the model's input (a heatmap) back on the
whole image, at its own resolution.

Pixel limit. A few bytes of PNG can claim 100000×100000 pixels and take 30 GB to decode (a
decompression bomb). PIL refuses an image of more than twice ``PIL.Image.MAX_IMAGE_PIXELS``
(about 179 million pixels) and warns above it; layertap keeps that rule by default, and
``max_image_pixels=N`` refuses more than N pixels instead (``0``: no limit). PIL reads its
limit from a process-wide global, at open and in some decoders: a limit within PIL's own is
checked here after PIL's, without touching the global; a higher one sets the global for the
open and decode, under a lock. The cost: while a raised limit decodes, other threads of the
process wait to read an image, and those that open images with PIL directly see it too.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from .errors import ArgumentError, CorruptImageError, require
from .modelinfo import ImageTransform

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")
# Pillow's decoders that run no outside program (its JPEG one also reads MPO, a camera's JPEGs)
IMAGE_FORMATS = ("PNG", "JPEG", "BMP", "GIF", "TIFF", "WEBP", "PPM")
_FORMAT_NAMES = "PNG, JPEG, BMP, GIF, TIFF, WebP or PPM"
# formats whose Pillow decoder runs a program, named when a file turns out to be one of them
_PROGRAM_FORMATS = ((b"%!PS", "PostScript (EPS)"), (b"\xc5\xd0\xd3\xc6", "PostScript (EPS)"), (b"%PDF", "PDF"))

LIMIT_HINT = (
    "If the image is genuine, raise the limit (max_image_pixels=N / --max-image-pixels N, 0 for none); "
    "else remove it, or skip bad images (on_error='skip' / --on-error skip)"
)


@dataclass
class ImageList:
    """Image paths found under a root, with labels and class names when the layout has them."""

    root: Path
    paths: list[Path]
    labels: list[int] | None
    classes: list[str] | None

    def ids(self) -> list[str]:
        """Paths relative to the root, with '/' separators: stable sample ids."""
        return [p.relative_to(self.root).as_posix() if p != self.root else p.name for p in self.paths]


def _is_image(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_EXTENSIONS


def find_images(root: str | Path) -> ImageList:
    """All images under ``root`` (a file or a folder, searched recursively), in sorted order.

    >>> find_images("does/not/exist")
    Traceback (most recent call last):
    FileNotFoundError: no image file or folder at does/not/exist
    """
    root = Path(root)
    if root.is_file():
        if not _is_image(root):
            raise ValueError(f"{root} is not an image file (extensions: {', '.join(IMAGE_EXTENSIONS)})")
        return ImageList(root.parent, [root], None, None)
    if not root.is_dir():
        raise FileNotFoundError(f"no image file or folder at {root}")
    paths = sorted(p for p in root.rglob("*") if p.is_file() and _is_image(p))
    if not paths:
        raise FileNotFoundError(f"no images ({', '.join(IMAGE_EXTENSIONS)}) under {root}")
    tops = sorted({p.relative_to(root).parts[0] for p in paths if len(p.relative_to(root).parts) > 1})
    if not tops:
        return ImageList(root, paths, None, None)
    index = {name: i for i, name in enumerate(tops)}
    labels = [
        index[p.relative_to(root).parts[0]] if len(p.relative_to(root).parts) > 1 else -1 for p in paths
    ]
    return ImageList(root, paths, labels, tops)


_PIL_GLOBAL = threading.Lock()  # held while PIL's process-wide limit is raised for one image


def _pil_global(image_module: Any) -> int | None:
    with _PIL_GLOBAL:  # not another thread's raised limit
        return image_module.MAX_IMAGE_PIXELS


def pixel_limit(max_image_pixels: int | None = None) -> int:
    """The most pixels an image may have (``0``: no limit), ``None`` read as PIL's limit now.

    Resolve it where the data is opened: a spawned worker process would not see a change made to
    ``PIL.Image.MAX_IMAGE_PIXELS`` in its parent.
    """
    if max_image_pixels is not None:
        if max_image_pixels < 0:
            raise ValueError(f"max_image_pixels must be a number of pixels, or 0 for no limit, got {max_image_pixels}")
        return max_image_pixels
    pil = _pil_global(require("PIL.Image", "vision"))
    return 0 if pil is None else 2 * pil  # where PIL itself refuses an image


@contextmanager
def _pil_limit(image_module: Any, limit: int) -> Iterator[None]:
    """PIL's own limit, raised to ``limit`` (0: off) for the block when it is lower (see the module docs)."""
    pil = _pil_global(image_module)
    if limit and pil is not None and limit <= 2 * pil:
        yield  # PIL refuses nothing that the limit allows
        return
    with _PIL_GLOBAL:
        saved = image_module.MAX_IMAGE_PIXELS
        # PIL warns above its limit and refuses twice it: it warns only on what load_image refuses
        image_module.MAX_IMAGE_PIXELS = limit or None
        try:
            yield
        finally:
            image_module.MAX_IMAGE_PIXELS = saved


def open_image(path: str | Path) -> Any:
    """``PIL.Image.open(path)`` restricted to `IMAGE_FORMATS`: the one way layertap opens an image file.

    A file of another format (EPS, PDF, ...) raises ``PIL.UnidentifiedImageError`` before any
    decoder of its own sees it; `load_image` turns that into a `CorruptImageError`.
    """
    return require("PIL.Image", "vision").open(path, formats=IMAGE_FORMATS)


def _unidentified(path: Path, error: Exception) -> str:
    """Why a file is no image layertap reads, naming its format when its decoder would run a program."""
    try:
        with path.open("rb") as f:
            head: bytes | None = f.read(8)
    except OSError:
        head = None
    if head == b"":
        return "the file is empty (0 bytes)"
    found = next((name for magic, name in _PROGRAM_FORMATS if head and head.startswith(magic)), None)
    if found is not None:
        return f"it is a {found} file, a format layertap never decodes (its decoder runs a program); images must be {_FORMAT_NAMES}"
    return f"{type(error).__name__}: not a {_FORMAT_NAMES} image, the only formats layertap decodes"


def load_image(path: str | Path, max_image_pixels: int | None = None, *, draft: tuple[int, int] | None = None):
    """Read an image fully as RGB ``PIL.Image``.

    Any file that does not decode, or has more than ``max_image_pixels`` pixels (default: PIL's
    limit; ``0``: none; see the module docs), raises `CorruptImageError` naming it. ``draft``
    (width, height) lets a JPEG decode at a reduced scale no smaller than that: for thumbnails,
    several times faster.
    """
    image_module = require("PIL.Image", "vision")
    path = Path(path)
    limit = pixel_limit(max_image_pixels)
    try:
        with _pil_limit(image_module, limit), open_image(path) as img:
            width, height = img.size
            if limit and width * height > limit:  # before decoding: the pixels are not allocated yet
                raise CorruptImageError(
                    path, f"it has {width}x{height} = {width * height} pixels, more than the limit of {limit}", LIMIT_HINT
                )
            if draft is not None:
                img.draft("RGB", draft)
            img.load()  # decode now: a truncated file fails here, not later in a worker
            return img.convert("RGB")
    except CorruptImageError:
        raise
    except image_module.DecompressionBombError as e:
        raise CorruptImageError(path, f"{type(e).__name__}: {e}", LIMIT_HINT) from e
    except image_module.UnidentifiedImageError as e:
        raise CorruptImageError(path, _unidentified(path, e)) from e
    except Exception as e:  # PIL raises many kinds (OSError, SyntaxError, struct.error, ...): all mean unreadable
        raise CorruptImageError(path, f"{type(e).__name__}: {e}") from e


# ---------------------------------------------------------------------------- as the model saw it
@dataclass(frozen=True)
class View:
    """Where a model's input lies on an image: the part it saw, and at what size.

    ``box`` is ``(left, top, right, bottom)`` in the image's pixel coordinates (edges, not pixel
    centres; beyond the image where the transform pads), ``size`` the input's ``(width, height)``, ``resample`` the filter that resized it.
    Resizing and centre cropping, in any order and number, always come down to one such box.
    """

    box: tuple[float, float, float, float]
    size: tuple[int, int]
    resample: str = "bilinear"  # how the transform resizes, as torchvision names it (for `model_view`)

    def crop(self, left: float, top: float, width: int, height: int) -> View:
        """The view after cutting ``width`` x ``height`` input pixels at ``(left, top)`` out of it."""
        x0, y0, x1, y1 = self.box
        sx, sy = (x1 - x0) / self.size[0], (y1 - y0) / self.size[1]
        box = (x0 + left * sx, y0 + top * sy, x0 + (left + width) * sx, y0 + (top + height) * sy)
        return View(box, (width, height), self.resample)


# torchvision's interpolation names -> PIL's filters
_RESAMPLE = {"nearest": 0, "nearest-exact": 0, "lanczos": 1, "bilinear": 2, "bicubic": 3, "box": 4, "hamming": 5}

# transforms in a torchvision Compose that change values, never where pixels lie (timm's MaybeToTensor too)
_VALUE_ONLY = {"ToTensor", "PILToTensor", "MaybeToTensor", "MaybePILToTensor", "Normalize", "ConvertImageDtype", "ToDtype", "ToImage", "ToPureTensor"}


def _resized(view: View, size: Any, max_size: int | None = None, resample: Any = "bilinear") -> View:
    """torchvision's ``Resize(size, max_size)``: an int (or one-item list) is the short side."""
    width, height = view.size
    if isinstance(size, int) or len(size) == 1:
        short, long = sorted((width, height))
        new_short = size if isinstance(size, int) else size[0]
        new_long = int(new_short * long / short)
        if max_size is not None and new_long > max_size:
            new_short, new_long = int(max_size * new_short / new_long), max_size
        width, height = (new_short, new_long) if width <= height else (new_long, new_short)
    else:
        height, width = size
    return View(view.box, (int(width), int(height)), str(getattr(resample, "value", resample)))


def _centre_cropped(view: View, size: Any) -> View:
    """torchvision's ``CenterCrop(size)``: padded with zeros first where the crop is larger."""
    height, width = (size, size) if isinstance(size, int) else (size[0], size[-1])
    pad_left = (width - view.size[0]) // 2 if width > view.size[0] else 0
    pad_top = (height - view.size[1]) // 2 if height > view.size[1] else 0
    left = round((max(view.size[0], width) - width) / 2.0) - pad_left  # banker's rounding, as torchvision
    top = round((max(view.size[1], height) - height) / 2.0) - pad_top
    return view.crop(left, top, width, height)


def _read(transform: Any, view: View) -> View | None:
    """``view`` after ``transform``, for the transforms whose geometry can be read; else ``None``."""
    kind = type(transform).__name__
    if isinstance(transform, ImageTransform):
        _, height, width = transform.input_size
        if not transform.crop:
            return _resized(view, (height, width))
        return _centre_cropped(_resized(view, int(height / 0.875)), (height, width))
    if kind == "ShapesTransform":  # the bundled model's (layertap.shapes, which sits above this module)
        width, height = transform.size
        return _resized(view, (height, width), resample="bicubic")  # PIL's default
    if kind == "ImageClassification" and hasattr(transform, "resize_size"):  # torchvision's weights presets
        return _centre_cropped(_resized(view, transform.resize_size, resample=transform.interpolation), transform.crop_size)
    if kind == "Resize":
        return _resized(view, transform.size, transform.max_size, transform.interpolation)
    if kind == "CenterCrop":
        return _centre_cropped(view, transform.size)
    if kind == "Compose":
        for step in transform.transforms:
            if type(step).__name__ in _VALUE_ONLY:
                continue
            read = _read(step, view)
            if read is None:
                return None
            view = read
        return view
    return None


def _measured(transform: Any, image_size: tuple[int, int]) -> View:
    """The view of any transform, measured: what it makes of images whose colours code x and y.

    Black and white images give each channel's normalisation; a third image has red rising with
    x and green with y, so each input pixel's colour says where on the image it came from.
    Straight lines fitted through those positions give the box, to a fraction of a pixel.
    """
    pil = require("PIL.Image", "vision")
    width, height = image_size
    coded = np.zeros((height, width, 3), np.uint8)
    coded[..., 0] = np.round((np.arange(width) + 0.5) / width * 255)[None, :]
    coded[..., 1] = np.round((np.arange(height) + 0.5) / height * 255)[:, None]
    black, white, seen = (
        np.asarray(transform(pil.fromarray(a, "RGB")), dtype=np.float64)
        for a in (np.zeros_like(coded), np.full_like(coded, 255), coded)
    )
    problem = "its output is not an RGB image tensor [3, H, W]"
    if seen.ndim == 3 and seen.shape[0] == 3 and min(seen.shape[1:]) >= 2:
        problem = "it does more than resize, crop and pad (the positions it keeps are not on straight lines)"
        edges = []
        for channel, axis, extent in ((0, 0, width), (1, 1, height)):
            shown = np.abs(white[channel] - black[channel]) > 1e-6  # not padding
            counts = shown.sum(axis)
            positions = np.where(shown, (seen[channel] - black[channel]) / np.where(shown, white[channel] - black[channel], 1), 0).sum(axis)
            positions = positions / np.maximum(counts, 1) * extent  # where on the image each input column (row) lies
            used = np.flatnonzero(counts)
            inner = used[len(used) // 10 : len(used) - len(used) // 10]  # resampling clamps at the borders
            if len(inner) < 2:
                break
            slope, offset = np.polyfit(inner + 0.5, positions[inner], 1)
            if np.abs(slope * (inner + 0.5) + offset - positions[inner]).max() > 2.5 * extent / 255 + 0.5 or slope <= 0:
                break
            edges.append((offset, offset + slope * len(positions)))
        else:
            (x0, x1), (y0, y1) = edges
            return View((x0, y0, x1, y1), (seen.shape[2], seen.shape[1]))
    raise ArgumentError(
        f"cannot tell which part of the image {transform!r} shows the model: {problem}; pass an image transform "
        "made of torchvision Resize and CenterCrop steps"
    )


def view_box(transform: Any, image_size: tuple[int, int]) -> View:
    """Which part of an image of ``image_size`` (width, height) ``transform`` gives the model.

    Read exactly from layertap's `layertap.modelinfo.ImageTransform`, the bundled model's
    transform, torchvision's weights presets and ``Compose`` pipelines of ``Resize`` and
    ``CenterCrop`` (timm's eval transforms are those); measured for any other transform that
    only resizes, crops and pads (a Hugging Face image processor, say).

    >>> from layertap.modelinfo import ImageTransform
    >>> view_box(ImageTransform((3, 32, 32)), (300, 180))   # short side to 36, then the centre 32x32
    View(box=(70.0, 10.0, 230.0, 170.0), size=(32, 32), resample='bilinear')
    """
    view = View((0.0, 0.0, float(image_size[0]), float(image_size[1])), (int(image_size[0]), int(image_size[1])))
    read = _read(transform, view)
    return read if read is not None else _measured(transform, image_size)


def model_view(image: Any, transform: Any):
    """The image as ``transform`` showed it to the model: resized and cropped, not normalised.

    Returns an RGB ``PIL.Image`` of the model's input size, to draw a heatmap on pixel for pixel.
    Where the transform pads (a crop larger than the image), the padding is black.

    >>> from PIL import Image
    >>> from layertap.modelinfo import ImageTransform
    >>> model_view(Image.new("RGB", (300, 180)), ImageTransform((3, 32, 32))).size
    (32, 32)
    """
    pil = require("PIL.Image", "vision")
    image = image.convert("RGB")
    view = view_box(transform, image.size)
    left, top, right, bottom = view.box
    sx, sy = (right - left) / view.size[0], (bottom - top) / view.size[1]
    # the input pixels that show the image: all of them, but for whole pixels of padding at the edges
    u0, v0 = max(0, round(-left / sx)), max(0, round(-top / sy))
    u1, v1 = min(view.size[0], round((image.width - left) / sx)), min(view.size[1], round((image.height - top) / sy))
    box = (max(0.0, left + u0 * sx), max(0.0, top + v0 * sy), min(image.width, left + u1 * sx), min(image.height, top + v1 * sy))
    shown = image.resize((u1 - u0, v1 - v0), _RESAMPLE.get(view.resample, pil.BILINEAR), box=box)
    if shown.size == view.size:
        return shown
    canvas = pil.new("RGB", view.size)
    canvas.paste(shown, (u0, v0))
    return canvas


def to_original(heatmap: Any, image: Any, transform: Any, size: tuple[int, int] | None = None) -> np.ndarray:
    """A map over the model's input (``[h, w]``, any resolution) laid on the original image.

    Returns a float32 ``[H, W]`` array at the image's own resolution (or ``size``, a
    ``(width, height)`` such as a thumbnail's), sampled bilinearly; NaN where the model did not
    look (outside its centre crop).

    >>> import numpy as np
    >>> from PIL import Image
    >>> from layertap.modelinfo import ImageTransform
    >>> hot = np.zeros((32, 32)); hot[5, 20] = 1                # one input pixel
    >>> mapped = to_original(hot, Image.new("RGB", (300, 180)), ImageTransform((3, 32, 32)))
    >>> mapped.shape, np.unravel_index(np.nanargmax(mapped), mapped.shape)
    ((180, 300), (np.int64(37), np.int64(172)))
    """
    values = np.asarray(heatmap.detach().float().cpu() if hasattr(heatmap, "detach") else heatmap, dtype=np.float32)
    while values.ndim > 2 and values.shape[0] == 1:  # [1, H, W]: one map of a batch
        values = values[0]
    if values.ndim != 2:
        raise ArgumentError(f"a heatmap must be 2-D [H, W], got shape {list(values.shape)}")
    width, height = image.size
    out_w, out_h = size or (width, height)
    x0, y0, x1, y1 = view_box(transform, (width, height)).box

    def taps(n_out: int, extent: int, lo: float, hi: float, n_map: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Per output pixel: the two map pixels around it, the weight of the second, whether it was seen."""
        centre = (np.arange(n_out) + 0.5) * extent / n_out  # in the image's coordinates
        at = np.clip((centre - lo) / (hi - lo) * n_map - 0.5, 0, n_map - 1)  # map pixel centres are integers
        first = np.floor(at).astype(np.intp)
        return first, np.minimum(first + 1, n_map - 1), (at - first).astype(np.float32), (centre >= lo) & (centre < hi)

    r0, r1, fy, seen_y = taps(out_h, height, y0, y1, values.shape[0])
    c0, c1, fx, seen_x = taps(out_w, width, x0, x1, values.shape[1])
    rows = values[r0] * (1 - fy)[:, None] + values[r1] * fy[:, None]
    mapped = rows[:, c0] * (1 - fx) + rows[:, c1] * fx
    mapped[~(seen_y[:, None] & seen_x[None, :])] = np.nan
    return mapped.astype(np.float32)
