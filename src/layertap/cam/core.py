"""Class-activation heatmaps: the Grad-CAM family on any model, batched, any activation layout.

>>> import torch, torchvision, layertap
>>> model = torchvision.models.resnet18().eval()
>>> cam = layertap.cam.GradCAM(model, "layer4")
>>> maps = cam(torch.randn(2, 3, 64, 64), targets=[3, 7])   # one class per image
>>> tuple(maps.shape), bool(maps.min() >= 0), bool(maps.max() <= 1)
((2, 64, 64), True, True)

How it works, and the conventions it shares with pytorch-grad-cam (maps agree to 1e-5):

- The forward runs without autograd up to the first chosen layer; there the graph starts (a fresh
  leaf that requires grad), so the backward covers only the layers after it: a late layer costs
  about one inference forward, not a training step.
- Activations of any layout become ``[B, C, *grid]`` maps: channels-first maps (``[B, C, H, W]``,
  1-D ``[B, C, L]``, 3-D ``[B, C, D, H, W]``), channels-last maps (Swin's ``[B, H, W, C]``) and
  token sequences ``[B, T, D]`` whose patch grid is inferred from the input size, the first
  ``T - h*w`` tokens being prefix tokens (class, distillation, register tokens). See `infer_layout`.
- Each layer's map is ReLU'd, min-max normalised per image (``(m - min) / (max - min + 1e-7)``),
  upsampled (bilinear, ``align_corners=False``, as ``cv2.resize``) to the input size; the layers'
  maps are averaged and normalised again.
- ``targets=None`` scores each image's top class; the scores of the batch are summed before the
  backward, as pytorch-grad-cam does (images stay independent unless the model mixes them, e.g.
  batch norm in ``train()`` mode).
- ``batch_size=`` bounds the images per forward (a progress bar counts them); the methods return
  plain tensors, and `show` draws them over their images as a grid a notebook displays.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import html
import io
import itertools
import math
import operator
import warnings
import weakref
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, Literal, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .. import nested
from ..errors import ArgumentError, LayerForwardError, LayertapError, LayoutError, TapError, require
from ..overlay import Colormap, overlay
from ..progress import progress_bar
from ..runtime import explain_failures, run_model
from ..select import Layers, named_layers, select
from ..tap import tap

Targets = int | Sequence[int] | torch.Tensor | Callable[[torch.Tensor], torch.Tensor] | None
OutputPick = str | Callable[[Any], torch.Tensor] | None

MAX_PREFIX_TOKENS = 32  # more prefix tokens than this are never guessed: pass prefix_tokens=
_EPS = 1e-7  # pytorch-grad-cam's normalisation epsilon


class ZeroGradientWarning(UserWarning):
    """The score's gradient with respect to a chosen layer's map is all zero: the heatmap is blank."""


# ---------------------------------------------------------------------------------- layouts
@dataclass(frozen=True)
class Layout:
    """How an activation maps onto the input: ``kind``, spatial ``grid`` and prefix token count.

    >>> Layout("tokens", (14, 14), prefix=1).maps(torch.zeros(2, 197, 768)).shape
    torch.Size([2, 768, 14, 14])
    """

    kind: Literal["channels_first", "channels_last", "tokens"]
    grid: tuple[int, ...]
    prefix: int = 0

    def maps(self, t: torch.Tensor) -> torch.Tensor:
        """The activation (or its gradient) as ``[B, C, *grid]``."""
        if self.kind == "channels_first":
            return t
        if self.kind == "channels_last":
            return t.movedim(-1, 1)
        return t[:, self.prefix :].transpose(1, 2).reshape(t.shape[0], t.shape[-1], *self.grid)

    def prefix_part(self, t: torch.Tensor) -> torch.Tensor:
        """The prefix tokens of a token activation (empty for maps)."""
        return t[:, : self.prefix] if self.kind == "tokens" else t[:, :0]

    def __str__(self) -> str:
        grid = "x".join(map(str, self.grid))
        return f"{self.kind} {grid}" + (f" + {self.prefix} prefix tokens" if self.prefix else "")


def _consistent(grid: Sequence[int], size: Sequence[int]) -> bool:
    """Whether ``grid`` can be a downscaled ``size``: scale factors agree within one cell per dim."""
    if any(g < 1 or g > s for g, s in zip(grid, size)):
        return False
    frac = [g / s for g, s in zip(grid, size)]
    return all(
        abs(frac[i] - frac[j]) <= 1 / size[i] + 1 / size[j] for i, j in itertools.combinations(range(len(size)), 2)
    )


@functools.lru_cache(maxsize=64)
def _patch_grids(size: tuple[int, ...]) -> list[tuple[int, ...]]:
    """Every grid a patch embedding with an integer stride could give (floor, or ceil if padded)."""
    grids = {
        tuple(rnd(s, p) for s in size)
        for p in range(1, max(size) + 1)
        for rnd in (operator.floordiv, lambda s, p: -(-s // p))
    }
    return sorted(grids, key=math.prod, reverse=True)


def infer_layout(
    shape: Sequence[int],
    size: Sequence[int],
    *,
    grid: Sequence[int] | None = None,
    prefix_tokens: int | None = None,
) -> Layout:
    """Read an activation of ``shape`` (batch first) for an input of spatial ``size`` as a map.

    Channels-first is tried first, then channels-last (both must be a plausible downscaling of
    ``size``), then tokens ``[B, T, D]`` with the largest patch grid that fits in ``T``; the
    remaining leading tokens are prefix tokens (at most `MAX_PREFIX_TOKENS` are guessed).
    ``grid=`` and ``prefix_tokens=`` override the guesses.

    >>> infer_layout([2, 7, 7, 768], [224, 224])          # Swin, channels-last
    Layout(kind='channels_last', grid=(7, 7), prefix=0)
    >>> infer_layout([2, 54, 384], [98, 98])               # DINOv2 with 4 registers, patch 14
    Layout(kind='tokens', grid=(7, 7), prefix=5)
    """
    size = tuple(size)
    rest = tuple(shape[1:])
    d = len(size)
    if grid is not None:
        grid = tuple(int(g) for g in grid)
        if len(grid) != d:
            raise LayoutError(f"grid={grid} has {len(grid)} dims but the input has {d} spatial dims {size}")
        if prefix_tokens is None and len(rest) == d + 1:
            if rest[1:] == grid:
                return Layout("channels_first", grid)
            if rest[:-1] == grid:
                return Layout("channels_last", grid)
        prefix = rest[0] - math.prod(grid) if len(rest) == 2 else -1
        if prefix >= 0 and prefix_tokens in (None, prefix):
            return Layout("tokens", grid, prefix)
        raise LayoutError(
            f"grid={grid}{'' if prefix_tokens is None else f' with prefix_tokens={prefix_tokens}'} does not fit "
            f"an activation of shape {list(shape)}: a map needs [B, C, *grid] or [B, *grid, C], tokens "
            f"[B, prefix + {math.prod(grid)}, D]"
        )
    if prefix_tokens is None and len(rest) == d + 1:
        if _consistent(rest[1:], size):
            return Layout("channels_first", rest[1:])
        if _consistent(rest[:-1], size):
            return Layout("channels_last", rest[:-1])
    if len(rest) == 2:
        count = rest[0]
        for g in _patch_grids(size):
            prefix = count - math.prod(g)
            wanted = prefix == prefix_tokens if prefix_tokens is not None else 0 <= prefix <= MAX_PREFIX_TOKENS
            if wanted and prefix < math.prod(g):
                return Layout("tokens", g, prefix)
    hint = "grid=(h, w) and, for tokens, prefix_tokens=N" if d == 2 else "grid=..."
    raise LayoutError(
        f"cannot read an activation of shape {list(shape)} as a map of an input of spatial size {list(size)}: "
        f"it is neither [B, C, *grid] nor [B, *grid, C] with a grid that downscales the input, nor "
        f"[B, prefix + h*w, D] tokens with a patch grid (at most {MAX_PREFIX_TOKENS} prefix tokens). "
        f"Pass {hint}, or choose another layer"
    )


# ---------------------------------------------------------------------------------- scoring
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


# ---------------------------------------------------------------------------------- maps
def _spatial(t: torch.Tensor) -> tuple[int, ...]:
    return tuple(range(2, t.dim()))


def normalize(maps: torch.Tensor, eps: float = _EPS) -> torch.Tensor:
    """Per-image min-max normalisation of ``[B, *spatial]`` maps (default: pytorch-grad-cam's epsilon)."""
    flat = maps.flatten(1)
    low = flat.amin(1).view(-1, *[1] * (maps.dim() - 1))
    maps = maps - low
    return maps / (eps + maps.flatten(1).amax(1).view_as(low))


def upsample(maps: torch.Tensor, size: Sequence[int], align_corners: bool = False) -> torch.Tensor:
    """Resize ``[B, C, *grid]`` to ``[B, C, *size]``, (bi/tri)linearly."""
    mode = {1: "linear", 2: "bilinear", 3: "trilinear"}[len(size)]
    return F.interpolate(maps, size=tuple(size), mode=mode, align_corners=align_corners)


class _Call(NamedTuple):
    """What a method needs about the current call beyond the layer's maps."""

    inputs: torch.Tensor
    targets: list[int] | Callable


class _Seen(NamedTuple):
    """One module as the default-layer probe saw it (at its last call)."""

    name: str
    layout: Layout | None  # its first floating-point output read as a map (None: not a map)
    channels: int  # that map's channels
    flows: bool  # some output tensor of it flows into the score: the backward reached it
    grad_channels: int  # channels of that map whose map part (not prefix tokens) gets a non-zero gradient
    passes: str | None  # the module whose output it returned unchanged (an eval Dropout, an Identity)
    reads: frozenset[str]  # the modules whose outputs it was given as they were returned
    extent: tuple[int | None, int | None]  # grid positions of its largest map input and of its output (None: no grid)


def _channels_reached(layout: Layout, mask: np.ndarray) -> int:
    """How many channels of a map's non-zero-gradient mask (one image, ``shape[1:]``) are non-zero."""
    if layout.kind == "channels_first":
        per_channel = mask.reshape(mask.shape[0], -1).any(1)
    elif layout.kind == "channels_last":
        per_channel = mask.reshape(-1, mask.shape[-1]).any(0)
    else:
        per_channel = mask[layout.prefix :].any(0)
    return int(per_channel.sum())


# ---------------------------------------------------------------------------------- the base
class CAM:
    """Base of the class-activation methods: ``Method(model, layer)(inputs, targets) -> [B, *size]``.

    Args:
        model: any ``nn.Module``; its mode (``train``/``eval``) and its parameters'
            ``requires_grad`` are left as they are, and no hook stays behind.
        layer: the layer(s) to explain (names, globs, classes... as `layertap.select`); several
            layers' maps are averaged. ``None`` picks the layer nearest the output whose spatial
            or token map still flows into the score: a ResNet's ``layer4``, a ViT's last ``norm1``
            (the input of the attention where the class token reads the patches), never an unused
            output, a map of class scores, a key/value projection or an attention window padded
            around a smaller map (EfficientViT's; see `_default_layer`). It is
            chosen at the first call, for the cost of one forward and backward through the whole
            network on one image, with any method; `layers` names it afterwards.
        output: what to score in the model's output when it is not a tensor: an attribute/key
            name or ``f(output) -> tensor``; default ``.logits`` or the first tensor.
        grid, prefix_tokens: override the layout inference (`infer_layout`) for every layer.
        batch_size: the most images per forward (``None``: all at once); maps, `logits` and
            `target_classes` are those of all the images, in order.
        progress: show a progress bar over the batches, when there are several (and Score-CAM's
            over its masks), in a terminal or a notebook (see `layertap.progress`).

    Call with ``inputs`` ``[B, C, *spatial]`` (the model's single argument) and ``targets``:
    ``None`` (top class per image), an int, one int per image, or ``f(output) -> Tensor[B]``
    (rows must be scored independently: ScoreCAM calls it on masked copies, and with
    ``batch_size`` it is called per batch). Returns maps in
    ``[0, 1]`` of shape ``[B, *spatial]``, float32, on the input's device. After a call,
    `logits` holds the scored output and `target_classes` the classes explained. A call under
    ``torch.no_grad()`` gives the same maps (the graph after the layer is the method's own); an
    empty batch, or a call inside ``torch.inference_mode()``, is a one-line error, and so is a
    3-D input the model fails on (one image ``[C, H, W]``: add a batch dimension with ``x[None]``).
    """

    uses_gradients: ClassVar[bool] = True

    def __init__(
        self,
        model: nn.Module,
        layer: Layers | None = None,
        *,
        output: OutputPick = None,
        grid: Sequence[int] | None = None,
        prefix_tokens: int | None = None,
        batch_size: int | None = None,
        progress: bool = True,
    ) -> None:
        if batch_size is not None and batch_size < 1:
            raise ArgumentError(f"batch_size must be at least 1 (or None: every image at once), got {batch_size}")
        self.model = model
        self.layers: list[str] | None = None if layer is None else select(model, layer)
        self.output = output
        self.grid = grid
        self.prefix_tokens = prefix_tokens
        self.batch_size = batch_size
        self.progress = progress
        self.layouts: dict[str, Layout] = {}
        self.logits: torch.Tensor | None = None
        self.target_classes: list[int] | None = None

    def __repr__(self) -> str:
        layers = "chosen at the first call" if self.layers is None else self.layers
        return f"<layertap.cam.{type(self).__name__} layers={layers}>"

    # -------------------------------------------------------------- the public call
    def __call__(self, inputs: torch.Tensor, targets: Targets = None) -> torch.Tensor:
        if not isinstance(inputs, torch.Tensor) or inputs.dim() < 3:
            raise ArgumentError(
                f"inputs must be one tensor [batch, channels, *spatial] (e.g. [B, 3, H, W]); got "
                f"{list(inputs.shape) if isinstance(inputs, torch.Tensor) else type(inputs).__name__}"
            )
        if not len(inputs):
            raise ArgumentError(
                f"got 0 samples (inputs of shape {list(inputs.shape)}): pass at least one image, or skip "
                "empty batches before calling the method"
            )
        if torch.is_inference_mode_enabled():
            raise TapError("heatmaps need autograd: call the method outside torch.inference_mode()")
        per_image = _per_image(targets)
        if per_image is not None and len(per_image) != len(inputs):  # checked whole, before batches cut it
            raise _count_error(len(per_image), len(inputs))
        try:
            return self._call(inputs, targets, per_image)
        except LayerForwardError as e:
            if inputs.dim() != 3:
                raise
            # most likely one image [C, H, W], read as C images: say so, not what its first conv made of it
            raise ArgumentError(
                f"{type(self).__name__} expects a batch [B, C, H, W]; the model failed at layer {e.layer!r} "
                f"({e.module_type}) on inputs of shape {list(inputs.shape)}: for one image, add a batch "
                "dimension with x[None]"
            ) from e

    def _call(self, inputs: torch.Tensor, targets: Targets, per_image: Sequence[int] | torch.Tensor | None) -> torch.Tensor:
        """`__call__` once its arguments are checked."""
        if self.layers is None:  # one image is enough to find the layer: the probe is a full backward
            self.layers = [self._default_layer(inputs[:1], targets if per_image is None else per_image[:1])]
        step = self.batch_size or len(inputs)
        several = step < len(inputs)
        maps: list[torch.Tensor] = []
        logits: list[torch.Tensor] = []
        classes: list[list[int] | None] = []
        with progress_bar(len(inputs), desc=type(self).__name__, unit="image", enabled=self.progress and several) as bar:
            for start in range(0, len(inputs), step):
                rows = slice(start, start + step)
                maps.append(self._maps(inputs[rows], targets if per_image is None else per_image[rows]))
                assert self.logits is not None  # every batch's forward sets it
                logits.append(self.logits)
                classes.append(self.target_classes)
                bar.update(len(maps[-1]))
        if several:  # the whole call's, not the last batch's
            self.logits = torch.cat(logits)
            self.target_classes = None if classes[0] is None else [c for part in classes for c in part or ()]
        return torch.cat(maps) if several else maps[0]

    def _maps(self, inputs: torch.Tensor, targets: Targets) -> torch.Tensor:
        """The maps of one batch of images."""
        assert self.layers is not None  # chosen by now
        size = tuple(inputs.shape[2:])
        acts, grads, call = self._run(inputs, targets)
        maps = []
        with torch.autocast(inputs.device.type, enabled=False):
            for name in self.layers:
                layout = self._layout(name, acts[name].shape, size)
                self.layouts[name] = layout
                a = layout.maps(acts[name]).float()
                g = None if grads is None else self._gradient(name, grads[name], acts[name], layout, inputs, targets)
                raw = self._raw_map(a, g, call).clamp(min=0)
                maps.append(upsample(normalize(raw)[:, None], size)[:, 0])
            return normalize(torch.stack(maps).mean(0))

    # -------------------------------------------------------------- what a method defines
    def _raw_map(self, a: torch.Tensor, g: torch.Tensor | None, call: _Call) -> torch.Tensor:
        """The layer's map ``[B, *grid]`` (before ReLU) from activation and gradient ``[B, C, *grid]``."""
        weights = self._weights(a, g, call)
        return (weights.view(*weights.shape, *[1] * (a.dim() - 2)) * a).sum(1)

    def _weights(self, a: torch.Tensor, g: torch.Tensor | None, call: _Call) -> torch.Tensor:
        """Channel weights ``[B, C]``, for the methods that weigh whole channels."""
        raise NotImplementedError

    # -------------------------------------------------------------- running the model
    def _layout(self, name: str, shape: Sequence[int], size: Sequence[int]) -> Layout:
        try:
            return infer_layout(shape, size, grid=self.grid, prefix_tokens=self.prefix_tokens)
        except LayoutError as e:
            raise LayoutError(f"layer {name!r}: {e}") from None

    def _scores(self, output: Any, targets: Targets) -> tuple[torch.Tensor, list[int] | Callable]:
        logits = pick_logits(output, self.output)
        chosen = resolve_targets(logits, targets)
        self.logits = logits.detach()
        self.target_classes = None if callable(chosen) else chosen
        return score(logits, chosen), chosen

    def _run(self, inputs: torch.Tensor, targets: Targets) -> tuple[dict, dict | None, _Call]:
        """Activations (and gradients) of the chosen layers, first tensor of each output."""
        assert self.layers is not None
        if not self.uses_gradients:
            with explain_failures(self.model), torch.no_grad():
                with tap(self.model, self.layers) as taps:
                    output = run_model(self.model, inputs)
                _, chosen = self._scores(output, targets)
            acts = {name: _first_float(taps[name], name) for name in self.layers}
            return acts, None, _Call(inputs, chosen)

        sources: dict[str, torch.Tensor] = {}

        def start_graph(name: str, out: Any) -> Any:
            # the first chosen layer to run turns autograd on; its output becomes a fresh leaf,
            # so the backward stops here. `no_grad` below restores the mode when the forward ends.
            torch.set_grad_enabled(True)
            t = _first_float(out, name)
            sources[name] = t if t.requires_grad else t.detach().requires_grad_()
            # downstream gets a copy: in-place ops after the layer (`out += identity`) may change
            # it, never the value whose gradient we take (and a leaf cannot change in place)
            return _replace_first(out, sources[name].clone())

        with explain_failures(self.model), torch.no_grad(), tap(self.model, self.layers, edit=start_graph) as taps:
            output = run_model(self.model, inputs)
        with torch.enable_grad():  # under the caller's no_grad too: the graph started above is the method's own
            scores, chosen = self._scores(output, targets)
            total = scores.sum()
        acts = {name: _first_float(taps[name], name) for name in self.layers}
        wanted = [sources[name] for name in self.layers]
        found = torch.autograd.grad(total, wanted, allow_unused=True) if total.requires_grad else [None] * len(wanted)
        return acts, dict(zip(self.layers, found)), _Call(inputs, chosen)

    # -------------------------------------------------------------- gradients and the default layer
    def _gradient(
        self,
        name: str,
        grad: torch.Tensor | None,
        act: torch.Tensor,
        layout: Layout,
        inputs: torch.Tensor,
        targets: Targets,
    ) -> torch.Tensor:
        """The gradient as ``[B, C, *grid]`` float32; warns when it is zero for some image."""
        if grad is None:
            grad = torch.zeros_like(act)
        maps = layout.maps(grad).float()
        dead = (maps.flatten(1) == 0).all(1)
        if bool(dead.any()):
            self._warn_zero(name, grad, layout, dead, inputs, targets)
        return maps

    def _warn_zero(
        self,
        name: str,
        grad: torch.Tensor,
        layout: Layout,
        dead: torch.Tensor,
        inputs: torch.Tensor,
        targets: Targets,
    ) -> None:
        if layout.prefix_part(grad).ne(0).any():
            why = (
                "only its prefix (class/register) tokens reach the score: the layers after it treat "
                "tokens one by one (LayerNorm, MLP) and the head reads the class token, so the patch "
                "tokens get no gradient. Use a layer before the last attention"
            )
        elif bool(dead.all()) and grad.eq(0).all():
            why = (
                "the score does not depend on its output through differentiable operations after it (an "
                "unused branch, a detach, argmax, dead ReLUs, or a head that reads a pooled output the "
                "layer computed inside itself, as Hugging Face *Model wrappers do)"
            )
        else:
            why = "the gradient vanishes there for these images (e.g. dead or saturated units after it)"
        images = dead.nonzero().flatten().tolist()
        which = "every image" if len(images) == len(dead) else f"images {images}"
        try:
            better = self._default_layer(inputs, targets)
        except LayertapError:
            better = name
        instead = f"; layer {better!r} gets a gradient" if better != name else ""
        warnings.warn(
            f"the gradient of the score with respect to layer {name!r} ({layout}) is all zero for "
            f"{which}, so its heatmap is blank: {why}{instead}",
            ZeroGradientWarning,
            stacklevel=5,  # the caller of __call__, above _maps, _gradient and this
        )

    def _probe(self, inputs: torch.Tensor, targets: Targets) -> list[_Seen]:
        """Every module the forward ran, in the order its (last) call finished, as `_Seen`.

        One forward and backward on ``inputs`` under a `layertap.tap` on every module. Its
        ``edit=`` hands on a copy of each floating-point output: the copy's own gradient hook
        then sees only the uses after the module returned (not a pooled output the module
        computed from it, as in `_run`), and the copy, found again in a later module's inputs by
        ``observe=``, tells who reads it. ``observe=`` also notes, at each module's return, the
        layout of its first floating-point output. (Its gradients are watched on the copies, not
        through ``observe=``: the probe needs to know which tensor of a call each gradient is for,
        and must not give a gradient to an output that had none.)
        """
        size = tuple(inputs.shape[2:])
        outs: dict[str, tuple[Layout | None, int, int | None]] = {}  # in the order modules finish
        calls: dict[str, int] = {}
        masks: dict[str, np.ndarray] = {}
        flows: set[str] = set()
        made: weakref.WeakValueDictionary[int, torch.Tensor] = weakref.WeakValueDictionary()
        maker: dict[int, str] = {}  # id of a copy handed on -> the module that returned it
        passes: dict[str, str] = {}
        reads: dict[str, frozenset[str]] = {}
        given: dict[str, int | None] = {}  # grid positions of each module's largest map input

        def producers(value: Any) -> list[str]:
            return [maker[id(t)] for t in nested.tensors(value) if made.get(id(t)) is t]

        def watch(name: str, call: int, first: bool) -> Callable:
            def hook(grad: torch.Tensor) -> None:
                if calls[name] == call:  # the module's last call, as `outs` has it
                    flows.add(name)
                    if first:  # per position, over the batch: small, never a copy of the activation
                        masks[name] = grad.ne(0).any(0).cpu().numpy()

            return hook

        def hand_on(name: str, out: Any) -> Any:
            floats = [t for t in nested.tensors(out) if t.is_floating_point()]
            calls[name] = call = calls.get(name, 0) + 1
            source = producers(floats[:1])
            passes.pop(name, None)
            if source and source[0] != name and not source[0].startswith(name + "."):  # (a container returns its child's)
                passes[name] = source[0]  # it returned its input unchanged

            def copy(t: torch.Tensor) -> torch.Tensor:
                if not (t.is_floating_point() and t.requires_grad):
                    return t
                new = t.clone()
                made[id(new)], maker[id(new)] = new, name
                new.register_hook(watch(name, call, t is floats[0]))
                return new

            return nested.map_leaves(copy, out)

        def observe(name: str, kind: str, call: int, value: Any) -> None:
            floats = [t for t in nested.tensors(value) if t.is_floating_point()]
            if kind == "input":
                reads[name] = frozenset(producers(value))
                given[name] = max((g for t in floats if (g := self._positions(t.shape, size)) is not None), default=None)
                return
            layout = self._map_layout(floats[0].shape, size) if floats else None
            channels = 0 if layout is None else floats[0].shape[1 if layout.kind == "channels_first" else -1]
            outs.pop(name, None)  # a module called again finishes again
            outs[name] = (layout, channels, self._positions(floats[0].shape, size) if floats else None)

        # a tensor made under inference_mode cannot require grad: its copy can
        x = (inputs.clone() if inputs.is_inference() else inputs.detach()).requires_grad_(inputs.is_floating_point())
        modules = [name for name in named_layers(self.model) if name]
        # detach=False: observe sees the very tensors the modules were given, copies included
        probe = (
            tap(self.model, modules, capture=("input", "output"), detach=False, edit=hand_on, observe=observe)
            if modules
            else contextlib.nullcontext()
        )
        with explain_failures(self.model), torch.enable_grad(), probe:
            output = run_model(self.model, x)
            scores, _ = self._scores(output, targets)
            if scores.requires_grad:
                torch.autograd.grad(scores.sum(), x, allow_unused=True)
        return [
            _Seen(
                name,
                layout,
                channels,
                flows=name in flows,
                grad_channels=_channels_reached(layout, masks[name]) if layout and name in masks else 0,
                passes=passes.get(name),
                reads=reads.get(name, frozenset()),
                extent=(given.get(name), positions),
            )
            for name, (layout, channels, positions) in outs.items()
        ]

    def _positions(self, shape: Sequence[int], size: Sequence[int]) -> int | None:
        """The grid positions of an activation read as a map (1 for a pooled ``[B, C, 1, 1]``), or None."""
        try:
            return math.prod(infer_layout(shape, size, grid=self.grid, prefix_tokens=self.prefix_tokens).grid)
        except LayoutError:
            return None

    def _map_layout(self, shape: Sequence[int], size: Sequence[int]) -> Layout | None:
        """The layout of an activation as a map of more than one position, or None."""
        try:
            layout = infer_layout(shape, size, grid=self.grid, prefix_tokens=self.prefix_tokens)
        except LayoutError:
            return None
        return layout if math.prod(layout.grid) > 1 else None

    def _default_layer(self, inputs: torch.Tensor, targets: Targets) -> str:
        """The layer nearest the output whose spatial or token map still flows into the score.

        The problem: the last module with a map is often not the map the score depends on. A
        model pools its last map (a CNN's global pool) or lets class tokens read it (the last
        attention of a ViT or PiT, CaiT's class attention, CrossViT's cross attention), and what
        runs later with a map layout no longer carries it: a ViT's final norm reaches the score
        only through its class token. A module whose output is never used (DLA's
        ``level4.project``) and a head of per-class maps (SqueezeNet's last conv, VOLO's
        ``aux_head``: class scores, where Grad-CAM's channel weights are one-hot) have maps too,
        an attention's key/value projections (CaiT's ``attn.v``) are maps inside the step that
        reads the patches, and an eval-mode Dropout returns the map it was given.

        The rule, from one probe (`_probe`: a forward and a backward on one image, every
        module hooked, in the order the modules finish):

        1. A *map* is a module's first floating-point output read as a spatial or token map of
           the whole input (`infer_layout`), with more than one position, and not a *window*: a
           grid finer than both the largest map a module around it is given and the one it
           returns (EfficientViT's attention pads its stage's 1x1 map to a 4x4 window at 64 px:
           15 of its positions are padding, not places in the image).
        2. It *flows* when the backward from the score reaches that very output (autograd
           reachability: an unused output never does) with a non-zero gradient on its map
           part, not only on prefix (class) tokens, and it is not a *class-score map*: one whose
           gradient lies in a single channel and that has as many channels as the scored output
           has classes.
        3. A *gathering step* is a module given a flowing map (its very output, as returned)
           whose own output still reaches the score but whose map does not flow, or is no map:
           a global pool, an attention whose class tokens read the patches.
        4. The layer is the last flowing map to finish, unless no gathering step is given it
           and it lies inside one: then it was computed inside the step from the step's input (a
           key or value projection, LeViT's subsampling attention's ``kv``), and the layer is
           the last flowing map to finish before the innermost such step starts, i.e. its input
           (a ViT's last ``norm1``, CaiT's last class-attention ``norm1``). A step with no flowing
           map before it (a Hugging Face wrapper that pools inside itself) is passed over.
        5. A module that returned its input unchanged (an eval Dropout, an Identity) gives way to
           the module that made the value (SqueezeNet's ``features``, not ``classifier.0``).

        So a module that joins branches (Inception's ``Mixed_7c``, HRNet's ``final_layer``)
        finishes after them and is chosen, and of branches never joined as maps (CrossViT's two
        patch sizes), the one read last, nearest the output. A map that only a functional op
        pools (LeViT's ``mean``) is found as well as one a module pools.

        The cost: one forward and backward through the whole network on one image, at the
        first call only, with a copy of every module's floating-point outputs (each module keeps
        a non-zero mask of its gradient, no activation). Gradient-free methods (EigenCAM,
        ScoreCAM) use the same rule and pay the same backward; where every gradient is zero (a
        zero-initialised head) they take the last map the backward reaches.
        """
        seen = self._probe(inputs, targets)
        extents = {s.name: s.extent for s in seen}

        def window(s: _Seen) -> bool:  # 1: finer than what a module around it is given and returns
            assert s.layout is not None
            size, parts = math.prod(s.layout.grid), s.name.split(".")
            around = (extents.get(".".join(parts[:i]), (None, None)) for i in range(1, len(parts)))
            return any(given is not None and out is not None and max(given, out) < size for given, out in around)

        maps = [s for s in seen if s.layout is not None and not window(s)]
        if not maps:
            raise LayoutError(
                f"no layer of the model gives a spatial or token map for an input of size "
                f"{list(inputs.shape[2:])}: pass layer= (and grid= if its layout cannot be inferred)"
            )
        by_name = {s.name: s for s in seen}

        def origin(name: str) -> str:  # through the modules that returned their input unchanged
            while name in by_name and by_name[name].passes in by_name:
                name = by_name[name].passes  # type: ignore[assignment]
            return name

        classes = self.logits.shape[1] if self.logits is not None and self.logits.dim() >= 2 else None
        flowing = [s for s in maps if s.grad_channels and not (s.grad_channels == 1 and s.channels == classes)]  # 1, 2
        if not flowing:
            if not self.uses_gradients:  # (a zero-initialised head) the last map the backward reaches
                return origin(([s for s in maps if s.flows] or maps)[-1].name)
            raise LayoutError(
                "the gradient of the score is zero at every layer with a spatial or token map, for these "
                "inputs: check that the output depends on the input differentiably (a zero-initialised "
                "head, such as torchvision's untrained ViT, gives zero gradients), or pass layer="
            )
        mapped = {origin(s.name) for s in maps if s.grad_channels}
        steps = [s for s in seen if s.flows and not s.grad_channels and {origin(r) for r in s.reads} & mapped]  # 3
        chosen = flowing[-1]  # 4
        if not any(origin(chosen.name) in {origin(r) for r in s.reads} for s in steps):
            position = {s.name: i for i, s in enumerate(seen)}
            around = [s for s in steps if chosen.name.startswith(s.name + ".")]
            for step in sorted(around, key=lambda s: len(s.name), reverse=True):  # they nest: innermost first
                inside = step.name + "."
                before = [f for f in flowing if position[f.name] < position[step.name] and not f.name.startswith(inside)]
                if before:
                    chosen = before[-1]
                    break
        return origin(chosen.name)  # 5


def _first_float(obj: Any, name: str) -> torch.Tensor:
    t = next((t for t in nested.tensors(obj) if t.is_floating_point()), None)
    if t is None:
        raise LayoutError(
            f"layer {name!r} outputs no floating-point tensor ({type(obj).__name__}), so it has no map "
            "to explain: choose another layer"
        )
    return t


def _replace_first(obj: Any, new: torch.Tensor) -> Any:
    """``obj`` with its first floating-point tensor replaced by ``new``."""
    done = False

    def swap(t: torch.Tensor) -> torch.Tensor:
        nonlocal done
        if done or not t.is_floating_point():
            return t
        done = True
        return new

    return nested.map_leaves(swap, obj)


# ---------------------------------------------------------------------------------- the methods
class GradCAM(CAM):
    """Grad-CAM (Selvaraju et al. 2017): channels weighted by their mean gradient.

    >>> import torch, torchvision
    >>> maps = GradCAM(torchvision.models.resnet18().eval(), "layer4")(torch.randn(1, 3, 64, 64))
    >>> maps.shape
    torch.Size([1, 64, 64])
    """

    def _weights(self, a, g, call):
        return g.mean(_spatial(g))


class GradCAMPlusPlus(CAM):
    """Grad-CAM++ (Chattopadhyay et al. 2018, eq. 19): positive gradients weighted per position."""

    def _weights(self, a, g, call):
        g2 = g.pow(2)
        total = a.sum(_spatial(a), keepdim=True)
        alpha = g2 / (2 * g2 + total * g2 * g + 1e-6)
        alpha = torch.where(g != 0, alpha, torch.zeros_like(alpha))
        return (g.clamp(min=0) * alpha).sum(_spatial(g))


class XGradCAM(CAM):
    """XGrad-CAM (Fu et al. 2020): gradients weighted by the normalised activation."""

    def _weights(self, a, g, call):
        return (g * a / (a.sum(_spatial(a), keepdim=True) + 1e-7)).sum(_spatial(a))


class HiResCAM(CAM):
    """HiResCAM (Draelos & Carin 2020): the element-wise product of gradient and activation."""

    def _raw_map(self, a, g, call):
        return (g * a).sum(1)


class LayerCAM(CAM):
    """LayerCAM (Jiang et al. 2021): activations weighted by their positive gradient, per position."""

    def _raw_map(self, a, g, call):
        return (g.clamp(min=0) * a).sum(1)


class EigenCAM(CAM):
    """Eigen-CAM (Muhammad & Yeasin 2020): the first principal component of the activations.

    Gradient-free; ``targets`` only chooses what `logits`/`target_classes` report. SVD's sign is
    arbitrary (pytorch-grad-cam keeps LAPACK's): here the component is oriented so that its
    channel weights sum to a positive number, i.e. the map follows the overall activation.
    """

    uses_gradients = False

    def _raw_map(self, a, g, call):
        x = a.flatten(2).transpose(1, 2)  # [B, positions, C]
        x = x - x.mean(1, keepdim=True)
        _, _, vh = torch.linalg.svd(x, full_matrices=False)
        v = vh[:, 0]
        v = v * torch.where(v.sum(1, keepdim=True) < 0, -1.0, 1.0)
        return (x @ v[..., None]).reshape(a.shape[0], *a.shape[2:])


class ScoreCAM(CAM):
    """Score-CAM (Wang et al. 2020): each channel weighted by the score of the input masked by it.

    Gradient-free but costly: one forward per channel and image, ``batch_size`` masked copies
    at a time (and images, for the first forward). As in pytorch-grad-cam, each channel is
    upsampled with ``align_corners=True``, min-max scaled (epsilon 1e-8) and multiplied into the
    input; the masked scores are softmaxed over channels. The progress bar counts the masks.
    """

    uses_gradients = False

    def __init__(self, model: nn.Module, layer: Layers | None = None, *, batch_size: int = 32, **options: Any) -> None:
        super().__init__(model, layer, batch_size=batch_size, **options)

    def _weights(self, a, g, call):
        size = call.inputs.shape[2:]
        scores = torch.empty(a.shape[:2])
        step = self.batch_size
        # leave=False: beside the bar over batches of images, this one goes when its batch is done
        bar = progress_bar(a.shape[0] * a.shape[1], desc="ScoreCAM", unit="mask", enabled=self.progress, leave=False)
        with bar, explain_failures(self.model), torch.no_grad():
            for b, start in itertools.product(range(a.shape[0]), range(0, a.shape[1], step)):
                chunk = upsample(a[b : b + 1, start : start + step], size, align_corners=True)[0]
                masks = normalize(chunk, eps=1e-8)[:, None]  # pytorch-grad-cam's Score-CAM epsilon
                output = run_model(self.model, call.inputs[b : b + 1] * masks.to(call.inputs.dtype))
                targets = call.targets if callable(call.targets) else [call.targets[b]] * len(masks)
                scores[b, start : start + len(masks)] = score(pick_logits(output, self.output), targets).float().cpu()
                bar.update(len(masks))
        return scores.softmax(-1).to(a.device)


# ---------------------------------------------------------------------------------- showing maps
class HeatmapGrid:
    """Heatmaps drawn over their images, tiled in a grid that a notebook shows (HTML, or PNG).

    Made by `show`; `image` is the grid as one ``PIL.Image`` and `save` writes it.
    """

    def __init__(self, tiles: list[Any], captions: Sequence[str], columns: int) -> None:
        self.tiles = tiles
        self.captions = list(captions)
        self.columns = min(columns, len(tiles))

    def __len__(self) -> int:
        return len(self.tiles)

    def __repr__(self) -> str:
        return f"<layertap.cam.HeatmapGrid: {len(self)} heatmaps in {self.columns} columns>"

    def image(self) -> Any:
        """The tiles in one RGB ``PIL.Image``, each at the first tile's size, without captions."""
        width, height = self.tiles[0].size
        grid = require("PIL.Image", "vision").new("RGB", (self.columns * width, math.ceil(len(self) / self.columns) * height), "white")
        for i, tile in enumerate(self.tiles):
            grid.paste(tile.resize((width, height)), ((i % self.columns) * width, (i // self.columns) * height))
        return grid

    def save(self, path: str | Path) -> None:
        self.image().save(path)

    def _repr_png_(self) -> bytes:
        return _png(self.image())

    def _repr_html_(self) -> str:
        width = max(self.tiles[0].size[0], 128)  # small inputs (64 px) are drawn larger, pixels kept sharp
        figures = "".join(
            f"<figure style='margin:0'><img width='{width}' style='image-rendering:pixelated' "
            f"src='data:image/png;base64,{base64.b64encode(_png(tile)).decode()}'>"
            f"<figcaption style='font-size:12px;max-width:{width}px'>{html.escape(caption)}</figcaption></figure>"
            for tile, caption in zip(self.tiles, self.captions)
        )
        return f"<div style='display:grid;grid-template-columns:repeat({self.columns}, max-content);gap:6px'>{figures}</div>"


def _png(image: Any) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, format="PNG")
    return buffer.getvalue()


def _pictures(images: Any) -> list[Any]:
    """Images as `overlay` takes them; a tensor outside ``[0, 1]`` (a normalised input) is
    stretched to it, image by image."""
    if not isinstance(images, torch.Tensor):
        return list(images)
    x = images.detach().float().cpu()
    low = x.flatten(1).amin(1).view(-1, *[1] * (x.dim() - 1))
    high = x.flatten(1).amax(1).view_as(low)
    stretched = (x - low) / (high - low).clamp(min=1e-8)
    return list(torch.where((low < 0) | (high > 1), stretched, x))


def show(
    images: Any,
    maps: Any,
    captions: Sequence[str] | None = None,
    *,
    alpha: float = 0.5,
    colormap: Colormap = "jet",
    columns: int = 8,
) -> HeatmapGrid:
    """Draw the ``maps`` a method returned over their ``images``, as a grid a notebook shows.

    ``images`` is the method's input ``[B, 3, H, W]`` (normalised values are stretched to
    ``[0, 1]`` per image), a uint8 ``[B, H, W, 3]`` array or a list of ``PIL`` images; ``maps``
    is ``[B, H, W]``; ``captions``, one text per image, go under the tiles. The methods keep
    returning plain tensors; this is the view of one.

    >>> import torch, torchvision
    >>> model = torchvision.models.resnet18().eval()
    >>> x = torch.randn(2, 3, 64, 64)
    >>> grid = show(x, GradCAM(model, "layer4")(x), ["a <cat>", "a dog"])
    >>> grid.image().size, "a &lt;cat&gt;" in grid._repr_html_()
    ((128, 64), True)
    """
    pictures, heatmaps = _pictures(images), list(maps)
    captions = [""] * len(pictures) if captions is None else list(captions)
    if not pictures or len(heatmaps) != len(pictures) or len(captions) != len(pictures):
        raise ArgumentError(
            f"show needs one map (and caption) per image: got {len(pictures)} images, {len(heatmaps)} maps, "
            f"{len(captions)} captions"
        )
    tiles = [overlay(p, m, alpha, colormap) for p, m in zip(pictures, heatmaps)]
    return HeatmapGrid(tiles, captions, columns)


METHODS: dict[str, type[CAM]] = {
    "gradcam": GradCAM,
    "gradcam++": GradCAMPlusPlus,
    "xgradcam": XGradCAM,
    "hirescam": HiResCAM,
    "layercam": LayerCAM,
    "eigencam": EigenCAM,
    "scorecam": ScoreCAM,
}

__all__ = [
    "CAM",
    "METHODS",
    "EigenCAM",
    "GradCAM",
    "GradCAMPlusPlus",
    "HeatmapGrid",
    "HiResCAM",
    "LayerCAM",
    "Layout",
    "LayoutError",
    "ScoreCAM",
    "XGradCAM",
    "ZeroGradientWarning",
    "infer_layout",
    "pick_logits",
    "show",
]
