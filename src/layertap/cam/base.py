"""The base of the heatmap methods: the contract they share, the forward that starts the graph at
the layer, and the per-layer maps (ReLU, normalise, upsample, average).

`HeatmapMethod` is the calling convention every method keeps, attention rollout included:
``Method(model, layers)(inputs, targets) -> [B, *spatial]`` in ``[0, 1]``, with `layers`,
`logits` and `target_classes` set by a call. `CAM` adds the Grad-CAM family's mechanism: a
method only says how a layer's activation and gradient make a map (`CAM._raw_map`, or channel
weights in `CAM._weights`); `layertap.cam.methods` holds the methods, and the rule that picks
a layer when none is given is `layertap.cam.default_layer`.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from typing import Any, ClassVar, NamedTuple

import torch
import torch.nn.functional as F
from torch import nn

from .. import nested
from ..errors import ArgumentError, LayerForwardError, LayertapError, LayoutError, TapError
from ..progress import progress_bar
from ..runtime import run_model, running
from ..select import Layers, select
from ..tap import tap
from .default_layer import default_layer
from .layout import MapLayout, infer_layout
from .targets import OutputPick, Targets, _count_error, _per_image, pick_logits, resolve_targets, score

_EPS = 1e-7  # pytorch-grad-cam's normalisation epsilon


class ZeroGradientWarning(UserWarning):
    """The score's gradient with respect to a chosen layer's map is all zero: the heatmap is blank."""


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


# ---------------------------------------------------------------------------------- the contract
class HeatmapMethod:
    """What every heatmap method shares: ``Method(model, layers)(inputs, targets) -> [B, *spatial]``.

    The maps are in ``[0, 1]``, float32, on the input's device. ``grid=`` and ``prefix_tokens=``
    override the layout inference (`infer_layout`). After a call, `layers` names the layers
    used, `logits` holds the scored output (``None`` when the method does not need one and the
    output has none) and `target_classes` the classes explained (``None`` when a callable
    scored the images, or the map does not depend on the class).
    """

    _where: ClassVar[str] = "layertap.cam"  # where a user finds the class, for its repr

    def __init__(
        self,
        model: nn.Module,
        layers: Layers | None = None,
        *,
        grid: Sequence[int] | None = None,
        prefix_tokens: int | None = None,
    ) -> None:
        self.model = model
        self._spec = layers
        self.grid = grid
        self.prefix_tokens = prefix_tokens
        self.layers: list[str] | None = None
        self.logits: torch.Tensor | None = None
        self.target_classes: list[int] | None = None

    def __repr__(self) -> str:
        layers = "chosen at the first call" if self.layers is None else self.layers
        return f"<{self._where}.{type(self).__name__}{self._options()} layers={layers}>"

    def _options(self) -> str:
        """The options a repr names before the layers (with a leading space), if any."""
        return ""

    def __call__(self, inputs: torch.Tensor, targets: Targets = None) -> torch.Tensor:
        raise NotImplementedError

    @staticmethod
    def _check_inputs(inputs: Any) -> None:
        if not isinstance(inputs, torch.Tensor) or inputs.dim() < 3:
            raise ArgumentError(
                f"inputs must be one tensor [batch, channels, *spatial] (e.g. [B, 3, H, W]); got "
                f"{list(inputs.shape) if isinstance(inputs, torch.Tensor) else type(inputs).__name__}"
            )


# ---------------------------------------------------------------------------------- the base
class CAM(HeatmapMethod):
    """Base of the class-activation methods: ``Method(model, layer)(inputs, targets) -> [B, *size]``.

    Args:
        model: any ``nn.Module``; its mode (``train``/``eval``) and its parameters'
            ``requires_grad`` are left as they are, and no hook stays behind.
        layer: the layer(s) to explain (names, globs, classes... as `layertap.select`); several
            layers' maps are averaged. ``None`` picks the layer nearest the output whose spatial
            or token map still flows into the score: a ResNet's ``layer4``, a ViT's last ``norm1``
            (the input of the attention where the class token reads the patches), never an unused
            output, a map of class scores, a key/value projection or an attention window padded
            around a smaller map (EfficientViT's; see `default_layer`). It is
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
        super().__init__(model, layer, grid=grid, prefix_tokens=prefix_tokens)
        self.layers = None if layer is None else select(model, layer)
        self.output = output
        self.batch_size = batch_size
        self.progress = progress
        self.layouts: dict[str, MapLayout] = {}

    # -------------------------------------------------------------- the public call
    def __call__(self, inputs: torch.Tensor, targets: Targets = None) -> torch.Tensor:
        self._check_inputs(inputs)
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
        if self.layers is None:  # one image is enough to find the layer: the probe is a full backward;
            # in training mode, the first batch the call runs (BatchNorm fails on one image's 1 x 1 map)
            n = (self.batch_size or len(inputs)) if self.model.training else 1
            self.layers = [self._default_layer(inputs[:n], targets if per_image is None else per_image[:n])]
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
    def _layout(self, name: str, shape: Sequence[int], size: Sequence[int]) -> MapLayout:
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
            with running(self.model):
                with tap(self.model, self.layers) as taps:
                    output = run_model(self.model, inputs)
                _, chosen = self._scores(output, targets)
            acts = {name: _first_float(taps[name], name) for name in self.layers}
            return acts, None, _Call(inputs, chosen)

        sources: dict[str, torch.Tensor] = {}

        def start_graph(name: str, out: Any) -> Any:
            # the first chosen layer to run turns autograd on; its output becomes a fresh leaf,
            # so the backward stops here. `running` below restores the mode when the forward ends.
            torch.set_grad_enabled(True)
            t = _first_float(out, name)
            sources[name] = t if t.requires_grad else t.detach().requires_grad_()
            # downstream gets a copy: in-place ops after the layer (`out += identity`) may change
            # it, never the value whose gradient we take (and a leaf cannot change in place)
            return _replace_first(out, sources[name].clone())

        with running(self.model), tap(self.model, self.layers, edit=start_graph) as taps:
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
        layout: MapLayout,
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
        layout: MapLayout,
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

    def _default_layer(self, inputs: torch.Tensor, targets: Targets) -> str:
        """The layer nearest the output whose spatial or token map still flows into the score (`default_layer`).

        Its probe scores the output as a call does, so `logits` and `target_classes` are the probe's after it.
        """

        def scored(output: Any) -> tuple[torch.Tensor, torch.Tensor]:
            scores, _ = self._scores(output, targets)
            assert self.logits is not None  # set by _scores
            return scores, self.logits

        return default_layer(
            self.model, inputs, scored, grid=self.grid, prefix_tokens=self.prefix_tokens, gradients=self.uses_gradients
        )
