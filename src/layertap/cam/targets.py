"""What a heatmap explains: the scores picked from a model's output and the classes to score.

`pick_logits` finds the tensor to score in any output (a tensor, ``.logits``, a key, the first
tensor); `resolve_targets` turns ``targets=`` (``None``, an int, one per image, a callable)
into one class per image; `score` gives the one number per image whose gradient the methods
take. Shared by the Grad-CAM family, Score-CAM's masked forwards, the default-layer probe and
attention rollout (which reports the scores it does not need).
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from .. import nested
from ..errors import ArgumentError

Targets = int | Sequence[int] | torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None
OutputPick = str | Callable[[Any], torch.Tensor] | None


def pick_logits(output: Any, pick: OutputPick = None) -> torch.Tensor:
    """The tensor to score in a model's output: itself, ``.logits``/``["logits"]``, or the first tensor.

    ``pick`` overrides: an attribute or key name, or a callable ``f(output) -> tensor``.
    """
    found: Any
    if callable(pick):
        found = pick(output)
    elif isinstance(pick, str):
        found = output.get(pick) if isinstance(output, Mapping) else getattr(output, pick, None)
    elif isinstance(output, torch.Tensor):
        found = output
    else:
        found = getattr(output, "logits", None)
        if found is None and isinstance(output, Mapping):
            found = output.get("logits")
        if not isinstance(found, torch.Tensor):
            found = nested.first_tensor(output)
    if not isinstance(found, torch.Tensor) or not found.is_floating_point():
        raise ArgumentError(
            f"cannot find the scores to explain in the model output ({type(output).__name__}"
            f"{'' if pick is None else f', output={pick!r}'}): pass output= as the attribute or key of the "
            "logits, or a function output -> tensor [batch, classes]"
        )
    return found


def resolve_targets(logits: torch.Tensor, targets: Targets) -> list[int] | Callable:
    """One class index per image (``None``: each image's top class), or the callable as given."""
    if callable(targets):
        return targets
    batch = logits.shape[0]
    if logits.dim() < 2:
        raise ArgumentError(
            f"the scored output has shape {list(logits.shape)}, with no class dim to index: pass "
            "targets=f where f(output) -> one score per image"
        )
    classes = logits.shape[1]
    if targets is None:
        return _per_class(logits).argmax(1).tolist()
    if isinstance(targets, torch.Tensor):
        targets = targets.tolist()
    if isinstance(targets, Sequence):
        if len(targets) != batch:
            raise _count_error(len(targets), batch)
        chosen = [operator.index(t) for t in targets]
    else:
        chosen = [operator.index(targets)] * batch
    bad = [c for c in chosen if not 0 <= c < classes]
    if bad:
        raise ArgumentError(f"target class {bad[0]} is out of range: the output has {classes} classes")
    return chosen


def _count_error(given: int, batch: int) -> ArgumentError:
    return ArgumentError(f"got {given} targets for a batch of {batch}: give one class per image, or one int")


def _per_image(targets: Targets) -> Sequence[int] | torch.Tensor | None:
    """``targets`` when it gives one class per image (a sequence, a 1-D tensor), else ``None``."""
    if isinstance(targets, Sequence) or (isinstance(targets, torch.Tensor) and targets.dim()):
        return targets
    return None


def _per_class(logits: torch.Tensor) -> torch.Tensor:
    """``[B, K, ...]`` outputs (segmentation) are scored by the class's sum over the other dims."""
    return logits if logits.dim() == 2 else logits.flatten(2).sum(-1)


def score(logits: torch.Tensor, targets: list[int] | Callable) -> torch.Tensor:
    """One score per image: the target class's logit, or the callable's result."""
    if callable(targets):
        scores = targets(logits)
        if not isinstance(scores, torch.Tensor) or scores.shape != logits.shape[:1]:
            raise ArgumentError(
                f"targets(output) must return one score per image, shape [{logits.shape[0]}]; got "
                f"{list(scores.shape) if isinstance(scores, torch.Tensor) else type(scores).__name__}"
            )
        return scores
    index = torch.as_tensor(targets, device=logits.device)
    return _per_class(logits)[torch.arange(len(index), device=logits.device), index]
