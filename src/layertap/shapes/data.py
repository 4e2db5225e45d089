"""Procedural "shapes" dataset: one coloured shape per image on a textured background.

Everything is generated with numpy from a seed, so a given ``(n, seed, size)``
always gives the same images, labels and boxes. No files are downloaded.

Example:
    >>> from layertap.shapes import generate, CLASSES
    >>> batch = generate(8, seed=0)
    >>> batch.images.shape, batch.images.dtype.name
    ((8, 64, 64, 3), 'uint8')
    >>> [CLASSES[i] for i in batch.labels[:3]] == list(batch.names[:3])
    True
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset

__all__ = [
    "CLASSES",
    "MEAN",
    "STD",
    "ShapesBatch",
    "ShapesDataset",
    "generate",
    "preprocess",
    "save_images",
]

#: Class names, in label order.
CLASSES: tuple[str, ...] = ("circle", "square", "triangle", "star", "cross", "ring")

#: Per-channel mean and std (RGB, in [0, 1] units) used by :func:`preprocess`.
#: Measured on ``generate(4000, seed=0)`` and rounded.
MEAN: tuple[float, float, float] = (0.5, 0.5, 0.5)
STD: tuple[float, float, float] = (0.24, 0.24, 0.24)

_MIN_COLOUR_DISTANCE = 0.45  # Euclidean distance in RGB [0, 1]^3 (max is sqrt(3))
_COLOUR_CANDIDATES = 16


@dataclass
class ShapesBatch:
    """A batch of generated images.

    Attributes:
        images: uint8 array ``[N, size, size, 3]`` (RGB).
        labels: int64 array ``[N]``, indices into ``classes``.
        boxes: int64 array ``[N, 4]`` of ``(x0, y0, x1, y1)``, the tight
            bounding box of the shape's pixels (x1, y1 exclusive).
        classes: the class names.
        masks: bool array ``[N, size, size]``, True on the shape's pixels.
    """

    images: np.ndarray
    labels: np.ndarray
    boxes: np.ndarray
    classes: tuple[str, ...] = CLASSES
    masks: np.ndarray | None = None

    def __len__(self) -> int:
        return int(self.labels.shape[0])

    @property
    def names(self) -> list[str]:
        """The class name of each image."""
        return [self.classes[int(i)] for i in self.labels]


# --------------------------------------------------------------------------- shapes
# Each mask function gets rotated, centred coordinates ``u, v`` (pixels, [k, H, W]),
# ``d = hypot(u, v)`` and the outer radius ``r`` ([k, 1, 1]) and returns a bool mask.


def _circle(u: np.ndarray, v: np.ndarray, d: np.ndarray, r: np.ndarray) -> np.ndarray:
    return d <= r * 0.9


def _square(u: np.ndarray, v: np.ndarray, d: np.ndarray, r: np.ndarray) -> np.ndarray:
    return np.maximum(np.abs(u), np.abs(v)) <= r * 0.72


def _triangle(u: np.ndarray, v: np.ndarray, d: np.ndarray, r: np.ndarray) -> np.ndarray:
    mask = np.ones(u.shape, dtype=bool)
    for k in range(3):
        a = np.pi / 2 + 2 * np.pi * k / 3
        mask &= u * np.cos(a) + v * np.sin(a) <= r * 0.5
    return mask


def _star(u: np.ndarray, v: np.ndarray, d: np.ndarray, r: np.ndarray) -> np.ndarray:
    sector = 2 * np.pi / 5
    phi = np.arctan2(v, u)
    psi = np.abs(np.mod(phi, sector) - sector / 2)  # 0 at a valley, sector/2 at a tip
    psi = sector / 2 - psi  # 0 at a tip, pi/5 at a valley
    outer, inner = r, r * 0.45
    s, c = np.sin(sector / 2), np.cos(sector / 2)
    x, y = d * np.cos(psi), d * np.sin(psi)
    return inner * s * x + (outer - inner * c) * y <= inner * s * outer


def _cross(u: np.ndarray, v: np.ndarray, d: np.ndarray, r: np.ndarray) -> np.ndarray:
    au, av = np.abs(u), np.abs(v)
    w, arm = r * 0.3, r * 0.95
    return ((au <= w) & (av <= arm)) | ((av <= w) & (au <= arm))


def _ring(u: np.ndarray, v: np.ndarray, d: np.ndarray, r: np.ndarray) -> np.ndarray:
    return (d <= r * 0.95) & (d >= r * 0.52)


_MASKS = (_circle, _square, _triangle, _star, _cross, _ring)
assert len(_MASKS) == len(CLASSES)


# ----------------------------------------------------------------------- generator


def _background(rng: np.random.Generator, n: int, size: int) -> np.ndarray:
    """Textured backgrounds in [0, 1], float32 ``[n, size, size, 3]``.

    A random two-colour linear gradient, a low-frequency colour wave and soft
    sinusoidal stripes (absent in about a third of the images).
    """
    coords = (np.arange(size, dtype=np.float32) + 0.5) / size - 0.5
    yy, xx = np.meshgrid(coords, coords, indexing="ij")
    xx, yy = xx[None], yy[None]

    def direction(theta: np.ndarray) -> np.ndarray:
        c = np.cos(theta).astype(np.float32)[:, None, None]
        s = np.sin(theta).astype(np.float32)[:, None, None]
        return c * xx + s * yy  # [n, H, W], roughly in [-0.71, 0.71]

    c0 = rng.uniform(0.0, 1.0, (n, 3)).astype(np.float32)
    c1 = rng.uniform(0.0, 1.0, (n, 3)).astype(np.float32)
    t = direction(rng.uniform(0, 2 * np.pi, n)) / np.float32(np.sqrt(2.0)) + np.float32(0.5)
    bg = c0[:, None, None, :] + (c1 - c0)[:, None, None, :] * t[..., None]

    # Low-frequency colour wave (about one period across the image).
    freq = rng.uniform(0.5, 1.5, n).astype(np.float32)[:, None, None]
    phase = rng.uniform(0, 2 * np.pi, n).astype(np.float32)[:, None, None]
    wave = np.sin(2 * np.pi * freq * direction(rng.uniform(0, 2 * np.pi, n)) + phase)
    wave_col = rng.uniform(-0.15, 0.15, (n, 3)).astype(np.float32)
    bg += wave[..., None] * wave_col[:, None, None, :]

    # Soft stripes: 3-10 periods across the image, random orientation.
    freq = rng.uniform(3.0, 10.0, n).astype(np.float32)[:, None, None]
    phase = rng.uniform(0, 2 * np.pi, n).astype(np.float32)[:, None, None]
    stripes = np.sin(2 * np.pi * freq * direction(rng.uniform(0, 2 * np.pi, n)) + phase)
    amp = rng.uniform(0.03, 0.12, n).astype(np.float32) * (rng.uniform(size=n) < 0.7)
    stripe_col = rng.uniform(-1.0, 1.0, (n, 3)).astype(np.float32)
    stripe_col /= np.linalg.norm(stripe_col, axis=1, keepdims=True) + 1e-6
    bg += stripes[..., None] * (amp[:, None] * stripe_col)[:, None, None, :]
    return bg


def _column(values: np.ndarray, idx: np.ndarray) -> np.ndarray:
    """``values[idx]`` as float32 ``[k, 1, 1]`` for broadcasting over images."""
    return values[idx].astype(np.float32)[:, None, None]


def generate(n: int, seed: int = 0, size: int = 64) -> ShapesBatch:
    """Generate ``n`` RGB images, each with one shape on a textured background.

    Shape class, colour, size, rotation and position are random; the shape's
    colour is kept at least a fixed RGB distance from the background under it.
    The result depends only on ``(n, seed, size)``.

    Args:
        n: number of images.
        seed: random seed.
        size: image height and width in pixels (at least 16).

    Returns:
        A :class:`ShapesBatch`.

    Example:
        >>> b = generate(4, seed=1)
        >>> b.labels.dtype.name, b.boxes.shape
        ('int64', (4, 4))
        >>> bool((generate(4, seed=1).images == b.images).all())
        True
    """
    n, size = int(n), int(size)
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    if size < 16:
        raise ValueError(f"size must be >= 16, got {size}")
    rng = np.random.default_rng(seed)

    labels = rng.integers(0, len(CLASSES), n).astype(np.int64)
    radius = rng.uniform(0.14, 0.32, n) * size  # outer radius, pixels
    cx = rng.uniform(radius + 1, size - 1 - radius)
    cy = rng.uniform(radius + 1, size - 1 - radius)
    theta = rng.uniform(0, 2 * np.pi, n)
    bg = _background(rng, n, size)

    # Shape masks, one class at a time.
    pix = np.arange(size, dtype=np.float32) + 0.5
    masks = np.zeros((n, size, size), dtype=bool)
    for k, mask_fn in enumerate(_MASKS):
        idx = np.flatnonzero(labels == k)
        if idx.size == 0:
            continue
        x = pix[None, None, :] - _column(cx, idx)
        y = pix[None, :, None] - _column(cy, idx)
        c, s = np.cos(_column(theta, idx)), np.sin(_column(theta, idx))
        u, v = c * x + s * y, c * y - s * x
        masks[idx] = mask_fn(u, v, np.hypot(u, v), _column(radius, idx))

    # Shape colour: the first random candidate far enough from the mean
    # background colour under the shape (or the farthest candidate).
    area = masks.sum(axis=(1, 2)).astype(np.float32)
    under = np.einsum("nhw,nhwc->nc", masks.astype(np.float32), bg) / np.maximum(area, 1)[:, None]
    cand = rng.uniform(0.0, 1.0, (n, _COLOUR_CANDIDATES, 3)).astype(np.float32)
    dist = np.linalg.norm(cand - under[:, None, :], axis=2)
    ok = dist >= _MIN_COLOUR_DISTANCE
    pick = np.where(ok.any(axis=1), ok.argmax(axis=1), dist.argmax(axis=1))
    colour = cand[np.arange(n), pick]

    # Gentle shading across the shape, then sensor-like noise over everything.
    coords = (pix - size / 2) / size
    shade_dir = rng.normal(size=(n, 2)).astype(np.float32) * 0.12
    shade = shade_dir[:, 0, None, None] * coords[None, None, :] + shade_dir[:, 1, None, None] * coords[None, :, None]
    img = np.where(masks[..., None], colour[:, None, None, :] + shade[..., None], bg)
    sigma = rng.uniform(0.01, 0.06, n).astype(np.float32)[:, None, None, None]
    img += rng.standard_normal(img.shape, dtype=np.float32) * sigma
    images = np.clip(np.rint(img * 255.0), 0, 255).astype(np.uint8)

    cols = masks.any(axis=1)  # [n, W]
    rows = masks.any(axis=2)  # [n, H]
    assert isinstance(cols, np.ndarray) and isinstance(rows, np.ndarray)  # masks is 3-D: one axis reduced leaves 2
    x0 = cols.argmax(axis=1)
    x1 = size - cols[:, ::-1].argmax(axis=1)
    y0 = rows.argmax(axis=1)
    y1 = size - rows[:, ::-1].argmax(axis=1)
    boxes = np.stack([x0, y0, x1, y1], axis=1).astype(np.int64)
    return ShapesBatch(images=images, labels=labels, boxes=boxes, classes=CLASSES, masks=masks)


# ------------------------------------------------------------------ preprocessing


def preprocess(images: Any) -> torch.Tensor:
    """Turn images into the model's normalised float input ``[N, 3, H, W]``.

    Accepts a uint8 numpy array ``[N, H, W, 3]`` or ``[H, W, 3]`` (float
    arrays are taken to be in ``[0, 1]`` already), a PIL image, or a list of
    PIL images / ``[H, W, 3]`` arrays of equal size.

    Example:
        >>> x = preprocess(generate(2, seed=0).images)
        >>> tuple(x.shape), x.dtype
        ((2, 3, 64, 64), torch.float32)
    """
    if isinstance(images, (list, tuple)):
        arr = np.stack([_to_array(im) for im in images])
    else:
        arr = _to_array(images)
    if arr.ndim == 3:
        arr = arr[None]
    if arr.ndim != 4 or arr.shape[-1] != 3:
        raise ValueError(f"expected images [N, H, W, 3] or [H, W, 3], got shape {arr.shape}")
    arr = np.ascontiguousarray(arr)
    if not arr.flags.writeable:  # e.g. np.asarray(PIL image); torch wants writable memory
        arr = arr.copy()
    x = torch.from_numpy(arr).permute(0, 3, 1, 2)
    x = x.float().div_(255.0) if arr.dtype == np.uint8 else x.float()
    mean = torch.tensor(MEAN, dtype=torch.float32).view(1, 3, 1, 1)
    std = torch.tensor(STD, dtype=torch.float32).view(1, 3, 1, 1)
    return ((x - mean) / std).contiguous()


def _to_array(image: Any) -> np.ndarray:
    if isinstance(image, np.ndarray):
        return image
    if hasattr(image, "convert") and hasattr(image, "size"):  # PIL image
        return np.asarray(image.convert("RGB"))
    if isinstance(image, torch.Tensor):
        raise TypeError("preprocess expects raw images (numpy or PIL), not a tensor")
    return np.asarray(image)



# a class, not a closure, so that a loaded model (which carries it in its info) still pickles
@dataclass(frozen=True)
class ShapesTransform:
    """The bundled model's own preprocessing, after resizing to the 64x64 it was trained on."""

    size: tuple[int, int]  # (width, height)

    def __call__(self, image: Any) -> torch.Tensor:
        image = image.convert("RGB")
        if image.size != self.size:
            image = image.resize(self.size)
        return preprocess(image)[0]

class ShapesDataset(Dataset):
    """``torch`` dataset of generated shapes returning ``(image_tensor, label)``.

    ``image_tensor`` is ``preprocess(image)[0]`` (float ``[3, size, size]``).
    The raw data stays available as ``.images`` (uint8), ``.labels``,
    ``.boxes``, ``.masks`` and ``.classes``.

    Example:
        >>> ds = ShapesDataset(10, seed=3)
        >>> x, y = ds[0]
        >>> tuple(x.shape), isinstance(y, int), len(ds)
        ((3, 64, 64), True, 10)
    """

    def __init__(self, n: int, seed: int = 0, size: int = 64) -> None:
        self.batch = generate(n, seed=seed, size=size)
        self.images = self.batch.images
        self.labels = self.batch.labels
        self.boxes = self.batch.boxes
        self.masks = self.batch.masks
        self.classes = self.batch.classes

    def __len__(self) -> int:
        return len(self.batch)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return preprocess(self.images[index])[0], int(self.labels[index])


def save_images(batch: ShapesBatch, folder: str | Path, format: str = "png") -> list[Path]:
    """Write the images as ``folder/<class>/<index>.<format>`` (ImageFolder layout).

    Args:
        batch: images from :func:`generate`.
        folder: output folder (created if needed).
        format: ``"png"`` (lossless) or ``"jpg"``/``"jpeg"``.

    Returns:
        The written paths, in batch order. Needs pillow.

    Example:
        >>> import tempfile
        >>> paths = save_images(generate(3, seed=0), tempfile.mkdtemp())
        >>> [p.parent.name for p in paths] == generate(3, seed=0).names
        True
    """
    from PIL import Image  # optional dependency, only needed here

    fmt = format.lower().lstrip(".")
    if fmt not in ("png", "jpg", "jpeg"):
        raise ValueError(f"format must be 'png' or 'jpg', got {format!r}")
    folder = Path(folder)
    width = max(5, len(str(max(len(batch) - 1, 0))))
    paths: list[Path] = []
    for i, (image, label) in enumerate(zip(batch.images, batch.labels)):
        sub = folder / batch.classes[int(label)]
        sub.mkdir(parents=True, exist_ok=True)
        path = sub / f"{i:0{width}d}.{fmt}"
        pil = Image.fromarray(np.ascontiguousarray(image))
        if fmt == "png":
            pil.save(path, format="PNG")
        else:
            pil.save(path, format="JPEG", quality=95)
        paths.append(path)
    return paths
