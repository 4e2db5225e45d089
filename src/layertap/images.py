"""Image files: finding them in folders (ImageFolder layout) and reading them with clear errors.

A folder whose sub-folders hold images is labelled as torchvision's ``ImageFolder`` does: the
sorted names of the top-level sub-folders are the classes, every image below one of them gets
its index. Images directly in the root get label -1. A folder of images alone is unlabelled.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from .errors import LayertapError, require

IMAGE_EXTENSIONS = (".jpg", ".jpeg", ".png", ".bmp", ".gif", ".webp", ".tif", ".tiff", ".ppm", ".pgm")


class CorruptImageError(LayertapError):
    """An image file could not be read; ``path`` names it."""

    def __init__(self, path: Path, reason: str) -> None:
        super().__init__(
            f"cannot read image {path}: {reason}. Remove or replace the file, or skip bad images "
            "(on_error='skip' / --on-error skip) to record it in the store's failed list"
        )
        self.path = path


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


def load_image(path: str | Path):
    """Read an image fully as RGB ``PIL.Image``; a truncated or corrupt file raises `CorruptImageError`."""
    image_module = require("PIL.Image", "vision")
    path = Path(path)
    try:
        with image_module.open(path) as img:
            img.load()  # decode now: a truncated file fails here, not later in a worker
            return img.convert("RGB")
    except (OSError, SyntaxError, ValueError) as e:
        raise CorruptImageError(path, f"{type(e).__name__}: {e}") from e
