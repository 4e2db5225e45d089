"""What layertap knows about a model: where it came from and how to feed it (`ModelInfo`,
`model_info`), and the image transform that feeds most vision models (`ImageTransform`).

This sits below `layertap.loading`, which records a `ModelInfo` on every model it builds, so
that what reads a model's input size or preprocessing (image views, statistics, summaries, an
extraction's defaults) needs none of the loaders. A model built elsewhere is recognised from
what it carries: a Hugging Face config, a timm data config, or ``input_size``/``mean``/``std``/
``classes`` attributes. Nothing here imports torchvision, timm or transformers until a transform
is called.

>>> from layertap.modelinfo import ModelInfo, model_info
>>> import torch
>>> model_info(torch.nn.Conv2d(3, 8, 3)).kind, ModelInfo(kind="text", vocab_size=9).example().shape
('vision', torch.Size([1, 16]))
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import nn

from .errors import DataError, require

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
_TEXT_LENGTH = 16  # tokens in a text model's default example input


# The transforms are classes, not closures, so that a loaded model (which carries its info)
# still pickles: torch.save(model), DataLoader workers, multiprocessing.
@dataclasses.dataclass(frozen=True)
class NotImages:
    """The ``transform`` of a model that does not take images: calling it says so."""

    kind: str

    def __call__(self, image: Any) -> torch.Tensor:
        takes = "token ids" if self.kind == "text" else "its own kind of input"
        raise DataError(f"this is a {self.kind} model: it takes {takes}, not images")


@dataclasses.dataclass(frozen=True)
class ImageTransform:
    """RGB PIL image -> normalised ``[C, H, W]`` tensor at ``input_size``.

    With ``crop`` (the ImageNet convention) the short side is resized to ``H / 0.875`` and the
    centre cropped; without, the image is resized to ``(H, W)``. torchvision is imported on the
    first call, so that knowing about a model never needs it.

    >>> from PIL import Image
    >>> ImageTransform((3, 32, 32))(Image.new("RGB", (50, 40))).shape
    torch.Size([3, 32, 32])
    """

    input_size: tuple[int, int, int]
    mean: tuple[float, ...] = IMAGENET_MEAN
    std: tuple[float, ...] = IMAGENET_STD
    crop: bool = True

    @functools.cached_property
    def pipeline(self) -> Callable[[Any], torch.Tensor]:
        T = require("torchvision.transforms", "vision")
        _, height, width = self.input_size
        size = (
            [T.Resize(int(height / 0.875)), T.CenterCrop((height, width))]
            if self.crop
            else [T.Resize((height, width))]
        )
        return T.Compose([*size, T.ToTensor(), T.Normalize(self.mean, self.std)])

    def __call__(self, image: Any) -> torch.Tensor:
        return self.pipeline(image.convert("RGB"))


@dataclasses.dataclass
class ModelInfo:
    """What layertap knows about a model: where it came from and how to feed it.

    Attributes:
        spec: the `load_model` spec, or ``None`` for a model built elsewhere.
        input_size: ``(C, H, W)`` of an image input (vision models).
        transform: one RGB ``PIL.Image`` -> normalised ``[C, H, W]`` float tensor; for a model
            that does not take images it raises an error that says so.
        classes: class names of the outputs, when the weights say them.
        kind: ``"vision"``, ``"text"``, ``"audio"`` or ``"other"``.
        vocab_size: size of a text model's vocabulary (for random example token ids).
    """

    spec: str | None = None
    input_size: tuple[int, int, int] = (3, 224, 224)
    transform: Callable[[Any], torch.Tensor] | None = None  # None: ImageNet preprocessing
    classes: list[str] | None = None
    kind: str = "vision"
    vocab_size: int | None = None

    def __post_init__(self) -> None:
        self.input_size = tuple(int(s) for s in self.input_size)  # type: ignore[assignment]
        if self.transform is None:
            self.transform = (
                ImageTransform(self.input_size) if self.kind == "vision" else NotImages(self.kind)
            )

    def example(self, shape: Sequence[int] | None = None) -> torch.Tensor:
        """A random example input: token ids ``[1, 16]`` for text, else ``[1, *input_size]``.

        >>> ModelInfo(kind="text", vocab_size=100).example((2, 8)).dtype
        torch.int64
        """
        if self.kind == "text":
            return torch.randint(0, self.vocab_size or 2, tuple(shape or (1, _TEXT_LENGTH)))
        return torch.randn(tuple(shape or (1, *self.input_size)))


# ---------------------------------------------------------------------------- what a model is
def hf_info(model: nn.Module, spec: str | None) -> ModelInfo:
    """Info of a Hugging Face ``PreTrainedModel``, from its config (no import of transformers)."""
    config = model.config
    # a str on a Hugging Face model; typed object, as a model found only by its attributes may hold anything
    main_input: object = model.main_input_name
    kinds: dict[object, str] = {"input_ids": "text", "pixel_values": "vision"}
    kind = kinds.get(
        main_input,
        "audio" if main_input in ("input_values", "input_features") else "other",
    )
    if kind != "vision":
        return ModelInfo(spec, kind=kind, vocab_size=getattr(config, "vocab_size", None))
    size = getattr(config, "image_size", 224)
    height, width = (size, size) if isinstance(size, int) else tuple(size)[:2]
    return ModelInfo(spec, (getattr(config, "num_channels", 3), height, width), kind="vision")


def timm_info(model: nn.Module, spec: str | None) -> ModelInfo:
    data = require("timm.data", "timm")
    config = data.resolve_data_config({}, model=model)
    return ModelInfo(spec, config["input_size"], transform=data.create_transform(**config), kind="vision")


def _declared_info(model: nn.Module, spec: str | None) -> ModelInfo | None:
    """Info from attributes a model declares itself (``input_size``, ``mean``, ``std``, ``classes``)."""
    size = getattr(model, "input_size", None)
    if not (isinstance(size, (tuple, list)) and len(size) == 3):
        return None
    mean, std = getattr(model, "mean", IMAGENET_MEAN), getattr(model, "std", IMAGENET_STD)
    classes = getattr(model, "classes", None)
    return ModelInfo(
        spec,
        tuple(size),
        transform=ImageTransform(tuple(size), tuple(mean), tuple(std), crop=False),
        classes=list(classes) if classes is not None else None,
    )


def _infer_info(model: nn.Module, spec: str | None = None) -> ModelInfo:
    if hasattr(model, "config") and hasattr(model, "main_input_name"):
        return hf_info(model, spec)
    if isinstance(getattr(model, "pretrained_cfg", None), dict):
        return timm_info(model, spec)
    return _declared_info(model, spec) or ModelInfo(spec)


def model_info(model: nn.Module) -> ModelInfo:
    """What layertap knows about ``model``: recorded by `load_model`, else inferred.

    A model built elsewhere is recognised as a Hugging Face model (from its config), a timm
    model (from its data config), a model declaring ``input_size``/``mean``/``std``/``classes``
    attributes, or else a 224×224 ImageNet-normalised vision model.

    >>> import torch
    >>> model_info(torch.nn.Conv2d(3, 8, 3)).input_size
    (3, 224, 224)
    """
    info = getattr(model, "layertap_info", None)
    return info if isinstance(info, ModelInfo) else _infer_info(model)


__all__ = [
    "model_info",
    "ModelInfo",
    "ImageTransform",
    "NotImages",
]
