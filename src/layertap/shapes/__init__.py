"""Bundled "shapes" dataset generator and a small trained CNN (offline demo data).

Example:
    >>> import torch
    >>> from layertap.shapes import generate, load_shapes_model, preprocess
    >>> batch = generate(16, seed=123)
    >>> model = load_shapes_model()
    >>> with torch.inference_mode():
    ...     logits = model(preprocess(batch.images))
    >>> logits.shape
    torch.Size([16, 6])
"""

from .data import (
    CLASSES,
    MEAN,
    STD,
    ShapesBatch,
    ShapesDataset,
    ShapesTransform,
    generate,
    preprocess,
    save_images,
)
from .model import WEIGHTS_PATH, ShapesCNN, load_shapes_model

__all__ = [
    "CLASSES",
    "MEAN",
    "STD",
    "WEIGHTS_PATH",
    "ShapesBatch",
    "ShapesCNN",
    "ShapesDataset",
    "ShapesTransform",
    "generate",
    "load_shapes_model",
    "preprocess",
    "save_images",
]
