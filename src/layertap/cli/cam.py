"""``layertap cam``: class-activation heatmaps of images, as overlay PNGs and raw ``.npy`` maps."""

from __future__ import annotations

import hashlib
import os
import re
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, cast

import numpy as np
import torch

from ..cam import HeatmapMethod
from ..errors import SKIP_HINT, DataError, LayertapError
from ..images import LIMIT_HINT, find_images, load_image, model_view
from ..loading import load_model
from ..modelinfo import IMAGENET_MEAN, IMAGENET_STD, ImageTransform, ModelInfo, model_info
from ..overlay import colorize, overlay
from ..runtime import place_model
from .core import app, echo, own_allocator, typer
from .options import HEATMAPS, arch_option, check_method, model_argument, parse_shape, trust_option


def _floats(text: str | None, option: str) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        values = ()
    if not values:
        raise typer.BadParameter(f"{text!r} is not a list of numbers: give e.g. 0.5,0.5,0.5", param_hint=option)
    return values


def _colormap(name: str) -> str:
    try:
        colorize(np.zeros((1, 1)), name)
    except LayertapError as e:
        raise typer.BadParameter(str(e)) from e
    return name


def _target(text: str | None, classes: list[str] | None) -> int | None:
    """A class index, or a class name the model's weights know."""
    if text is None:
        return None
    if text.lstrip("-").isdigit():
        return int(text)
    if classes and text in classes:
        return classes.index(text)
    known = f"; class names: {', '.join(classes[:20])}{' ...' if len(classes) > 20 else ''}" if classes else ""
    raise typer.BadParameter(f"--target {text!r} is neither a class index nor a class name of this model{known}")


@contextmanager
def image_advice(advice: str, limit_advice: str) -> Iterator[None]:
    """An unreadable image's error with advice this command can follow: the library's names
    ``--on-error skip``, which only ``extract`` has. ``limit_advice`` is for an image over the pixel limit."""
    try:
        yield
    except DataError as e:
        message = str(e)
        for hint, fit in ((SKIP_HINT, advice), (LIMIT_HINT, limit_advice)):
            if message.endswith(hint):
                raise DataError(message.removesuffix(hint) + fit) from e
        raise


MAX_STEM = 200  # characters (ASCII: bytes); with a clash suffix and ".png", under file systems' 255-byte names


def safe_names(ids: list[str]) -> list[str]:
    """File stems for image ids (relative paths), safe inside one folder and unique.

    Path segments are joined by ``__`` (``.``, ``..`` and empty ones dropped), the extension is
    removed and any character outside ``[A-Za-z0-9._-]`` becomes ``_``, so a name can never
    leave the output folder nor be hidden; a clash (ignoring case) gets a numeric suffix. A stem
    over `MAX_STEM` characters is cut and ends with a hash of the id, so it stays distinct.

    >>> safe_names(["cats/001.jpg", "../x y.png", "cats__001.png"])
    ['cats__001', 'x_y', 'cats__001-2']
    >>> len(safe_names(["a" * 300 + ".png"])[0])
    200
    """
    names: list[str] = []
    taken: set[str] = set()
    for image_id in ids:
        parts = [p for p in re.split(r"[\\/]+", image_id) if p not in ("", ".", "..")] or ["image"]
        last = parts[-1]
        if "." in last.lstrip("."):
            parts[-1] = last.rsplit(".", 1)[0]
        stem = re.sub(r"[^A-Za-z0-9._-]", "_", "__".join(parts)).lstrip(".") or "image"
        if len(stem) > MAX_STEM:
            digest = hashlib.sha256(image_id.encode()).hexdigest()[:12]
            stem = f"{stem[: MAX_STEM - len(digest) - 1]}-{digest}"
        name, n = stem, 1
        while name.lower() in taken:
            n += 1
            name = f"{stem}-{n}"
        taken.add(name.lower())
        names.append(name)
    return names


@app.command()
def cam(
    model: str = model_argument(),
    images: list[Path] = typer.Argument(..., exists=True, help="Image files or folders (searched recursively)."),
    layer: list[str] | None = typer.Option(
        None,
        "--layer",
        help="Layer(s) to explain (names, globs, 're:REGEX'); repeatable, maps averaged. Default: the last "
        "layer with a map that the gradient reaches.",
    ),
    method: str = typer.Option("gradcam", "--method", callback=check_method, help=f"One of: {', '.join(HEATMAPS)} (attention rollout, for vision transformers)."),
    target: str | None = typer.Option(
        None, "--target", help="Class to explain (index or name) for every image. Default: each image's top class."
    ),
    out: Path = typer.Option(Path("heatmaps"), "--out", help="Folder for the overlay PNGs and .npy maps."),
    alpha: float = typer.Option(0.5, "--alpha", min=0.0, max=1.0, help="Heatmap opacity in the overlay."),
    colormap: str = typer.Option(
        "jet", "--colormap", callback=_colormap, help="Colormap name (matplotlib's, or the built-in jet)."
    ),
    size: str | None = typer.Option(
        None, "--size", callback=parse_shape, help="Override the input size H,W (resize and centre crop, as ImageNet)."
    ),
    mean: str | None = typer.Option(None, "--mean", help="Override the normalisation mean, e.g. 0.5,0.5,0.5."),
    std: str | None = typer.Option(None, "--std", help="Override the normalisation std, e.g. 0.5,0.5,0.5."),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="Images per forward."),
    device: str | None = typer.Option(None, "--device", help="Run on this device, e.g. cuda:0 (default: cpu)."),
    max_image_pixels: int | None = typer.Option(
        None, "--max-image-pixels", min=0, help="Refuse images of more than N pixels (default: PIL's limit, about 179 million; 0: no limit)."
    ),
    arch: str | None = arch_option(),
    trust: bool = trust_option(),
) -> None:
    """Draw where MODEL looks when it classifies each image: one overlay PNG and one raw map (.npy) per image in --out, and the predicted class of each printed.

    Preprocessing comes from the model's weights when known (torchvision weights, timm data config), else ImageNet normalisation at the model's input size; --size/--mean/--std override it.

    Example: layertap cam layertap:shapes ./images --method gradcam --out heatmaps
    """
    own_allocator()
    mean_values, std_values = _floats(mean, "'--mean'"), _floats(std, "'--std'")
    if size is not None and len(size) != 2:
        raise typer.BadParameter("give the input size as H,W, e.g. 224,224", param_hint="'--size'")
    net = load_model(model, arch=arch, trust=trust)
    where = place_model(net, device)
    info = model_info(net)
    transform = _preprocessing(info, cast("tuple[int, int] | None", size), mean_values, std_values)  # parse_shape's
    class_index = _target(target, info.classes)
    found = [find_images(path) for path in images]
    paths = [p for f in found for p in f.paths]
    ids = [i for f in found for i in f.ids()]
    if out.exists() and not out.is_dir():
        raise typer.BadParameter(f"{out} is a file, not a folder", param_hint="'--out'")
    names = safe_names(ids)
    explainer = HEATMAPS[method](net, layer or None)
    lines: list[str] = []
    out.parent.mkdir(parents=True, exist_ok=True)
    # files are written beside --out and moved in at the end, so a failure leaves nothing behind
    with tempfile.TemporaryDirectory(dir=out.parent, prefix=".layertap-cam-") as staging:
        for start in range(0, len(paths), batch_size):
            chunk = range(start, min(start + batch_size, len(paths)))
            with image_advice(
                "Remove or replace the file, or leave it out of the images given",
                "If the image is genuine, raise the limit (--max-image-pixels N, 0 for none); else remove it "
                "or leave it out of the images given",
            ):
                pictures = [load_image(paths[i], max_image_pixels) for i in chunk]
            inputs = torch.stack([transform(p) for p in pictures])
            maps = explainer(inputs.to(where), class_index)
            for k, i in enumerate(chunk):
                heat = maps[k].cpu()
                np.save(Path(staging, f"{names[i]}.npy"), heat.numpy())
                # drawn on the picture as the model got it (resized, cropped): the map's own frame
                overlay(model_view(pictures[k], transform), heat, alpha, colormap).save(Path(staging, f"{names[i]}.png"))
                lines.append(f"{ids[i]}: {_prediction(explainer, k, info.classes)} -> {out / names[i]}.png")
        out.mkdir(exist_ok=True)
        for name in os.listdir(staging):
            os.replace(Path(staging, name), out / name)  # a rename: the same file system
    for line in lines:  # one per image: an id or class name with a line break cannot make a second
        echo(line)
    echo(f"layer: {', '.join(explainer.layers or [])}; method: {method}; {len(paths)} heatmaps in {out}")


def _preprocessing(
    info: ModelInfo,
    size: tuple[int, int] | None,
    mean: tuple[float, ...] | None,
    std: tuple[float, ...] | None,
) -> Callable[[Any], torch.Tensor]:
    """The model's preprocessing, with ``--size``/``--mean``/``--std`` in place of its own."""
    transform = info.transform
    assert transform is not None  # ModelInfo.__post_init__ fills in the default
    if size is None and mean is None and std is None:
        return transform
    # what is not overridden keeps the weights' statistics when the transform tells them
    height, width = size or info.input_size[1:]
    return ImageTransform(
        (info.input_size[0], height, width),
        tuple(mean or getattr(transform, "mean", None) or IMAGENET_MEAN),
        tuple(std or getattr(transform, "std", None) or IMAGENET_STD),
        crop=getattr(transform, "crop", True),
    )


def _prediction(explainer: HeatmapMethod, k: int, classes: list[str] | None) -> str:
    """Image ``k``'s predicted class (its name, when known) and probability, and the class explained if another."""
    assert explainer.logits is not None  # set by the call that made the maps
    probs = explainer.logits[k].float().softmax(-1).cpu()
    top = int(probs.argmax())
    label = classes[top] if classes and top < len(classes) else str(top)
    explained = explainer.target_classes[k] if explainer.target_classes else top
    what = "" if explained == top else f", explained class {explained}"
    return f"{label} ({float(probs[top]):.2f}){what}"
