"""Image files: finding them in folders (ImageFolder layout) and reading them with clear errors.

A folder whose sub-folders hold images is labelled as torchvision's ``ImageFolder`` does: the
sorted names of the top-level sub-folders are the classes, every image below one of them gets
its index. Images directly in the root get label -1. A folder of images alone is unlabelled.

Any file that does not decode (truncated, corrupt, empty, not an image, unreadable, too many
pixels) raises one `CorruptImageError` naming it, so that ``on_error`` treats them all alike.

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

from .errors import CorruptImageError, require

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")

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


def is_image(path: Path) -> bool:
    return path.suffix.lower() in IMAGE_EXTENSIONS


def find_images(root: str | Path) -> ImageList:
    """All images under ``root`` (a file or a folder, searched recursively), in sorted order.

    >>> find_images("does/not/exist")
    Traceback (most recent call last):
    FileNotFoundError: no image file or folder at does/not/exist
    """
    root = Path(root)
    if root.is_file():
        if not is_image(root):
            raise ValueError(f"{root} is not an image file (extensions: {', '.join(IMAGE_EXTENSIONS)})")
        return ImageList(root.parent, [root], None, None)
    if not root.is_dir():
        raise FileNotFoundError(f"no image file or folder at {root}")
    paths = sorted(p for p in root.rglob("*") if p.is_file() and is_image(p))
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


def load_image(path: str | Path, max_image_pixels: int | None = None):
    """Read an image fully as RGB ``PIL.Image``.

    Any file that does not decode, or has more than ``max_image_pixels`` pixels (default: PIL's
    limit; ``0``: none; see the module docs), raises `CorruptImageError` naming it.
    """
    image_module = require("PIL.Image", "vision")
    path = Path(path)
    limit = pixel_limit(max_image_pixels)
    try:
        with _pil_limit(image_module, limit), image_module.open(path) as img:
            width, height = img.size
            if limit and width * height > limit:  # before decoding: the pixels are not allocated yet
                raise CorruptImageError(
                    path, f"it has {width}x{height} = {width * height} pixels, more than the limit of {limit}", LIMIT_HINT
                )
            img.load()  # decode now: a truncated file fails here, not later in a worker
            return img.convert("RGB")
    except CorruptImageError:
        raise
    except image_module.DecompressionBombError as e:
        raise CorruptImageError(path, f"{type(e).__name__}: {e}", LIMIT_HINT) from e
    except Exception as e:  # PIL raises many kinds (OSError, SyntaxError, struct.error, ...): all mean unreadable
        raise CorruptImageError(path, f"{type(e).__name__}: {e}") from e
