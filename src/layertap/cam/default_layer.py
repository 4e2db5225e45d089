"""The default layer: which module's map a heatmap explains when no ``layer=`` is given.

`default_layer` is the rule (its docstring says why each step is there), `_probe` the one
forward and backward it reads, every module hooked through `layertap.tap`'s ``edit=`` and
``observe=``. Apart from `layertap.cam.base` so that the rule, the longest piece of the
package, reads as one piece; a method reaches it through `CAM._default_layer`.
"""

from __future__ import annotations

import contextlib
import math
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
from torch import nn

from .. import nested
from ..errors import LayoutError
from ..runtime import run_model, running
from ..select import named_layers
from ..tap import tap
from .layout import MapLayout, infer_layout

#: ``scored(output) -> (one score per image, the scored output)``, as a method scores a forward.
Scored = Callable[[Any], tuple[torch.Tensor, torch.Tensor]]


class _Seen(NamedTuple):
    """One module as the default-layer probe saw it (at its last call)."""

    name: str
    layout: MapLayout | None  # its first floating-point output read as a map (None: not a map)
    channels: int  # that map's channels
    flows: bool  # some output tensor of it flows into the score: the backward reached it
    grad_channels: int  # channels of that map whose map part (not prefix tokens) gets a non-zero gradient
    passes: str | None  # the module whose output it returned unchanged (an eval Dropout, an Identity)
    reads: frozenset[str]  # the modules whose outputs it was given as they were returned
    extent: tuple[int | None, int | None]  # grid positions of its largest map input and of its output (None: no grid)


def _channels_reached(layout: MapLayout, mask: np.ndarray) -> int:
    """How many channels of a map's non-zero-gradient mask (one image, ``shape[1:]``) are non-zero."""
    if layout.kind == "channels_first":
        per_channel = mask.reshape(mask.shape[0], -1).any(1)
    elif layout.kind == "channels_last":
        per_channel = mask.reshape(-1, mask.shape[-1]).any(0)
    else:
        per_channel = mask[layout.prefix :].any(0)
    return int(per_channel.sum())


@dataclass(frozen=True)
class _Reader:
    """`infer_layout` with a method's ``grid=`` and ``prefix_tokens=`` overrides, for any activation."""

    grid: Sequence[int] | None
    prefix_tokens: int | None

    def positions(self, shape: Sequence[int], size: Sequence[int]) -> int | None:
        """The grid positions of an activation read as a map (1 for a pooled ``[B, C, 1, 1]``), or None."""
        try:
            return math.prod(infer_layout(shape, size, grid=self.grid, prefix_tokens=self.prefix_tokens).grid)
        except LayoutError:
            return None

    def map_layout(self, shape: Sequence[int], size: Sequence[int]) -> MapLayout | None:
        """The layout of an activation as a map of more than one position, or None."""
        try:
            layout = infer_layout(shape, size, grid=self.grid, prefix_tokens=self.prefix_tokens)
        except LayoutError:
            return None
        return layout if math.prod(layout.grid) > 1 else None


def default_layer(
    model: nn.Module,
    inputs: torch.Tensor,
    scored: Scored,
    *,
    grid: Sequence[int] | None = None,
    prefix_tokens: int | None = None,
    gradients: bool = True,
) -> str:
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
    seen, logits = _probe(model, inputs, scored, _Reader(grid, prefix_tokens))
    maps = _maps(seen, inputs)
    by_name = {s.name: s for s in seen}

    def origin(name: str) -> str:  # through the modules that returned their input unchanged
        while name in by_name and by_name[name].passes in by_name:
            name = by_name[name].passes  # type: ignore[assignment]
        return name

    flowing = _flowing(maps, logits.shape[1] if logits.dim() >= 2 else None)  # 1, 2
    if not flowing:
        if not gradients:  # (a zero-initialised head) the last map the backward reaches
            return origin(([s for s in maps if s.flows] or maps)[-1].name)
        raise LayoutError(
            "the gradient of the score is zero at every layer with a spatial or token map, for these "
            "inputs: check that the output depends on the input differentiably (a zero-initialised "
            "head, such as torchvision's untrained ViT, gives zero gradients), or pass layer="
        )
    steps = _gathering_steps(seen, {origin(s.name) for s in maps if s.grad_channels}, origin)  # 3
    chosen = flowing[-1]  # 4
    if not any(origin(chosen.name) in {origin(r) for r in s.reads} for s in steps):
        chosen = _before_step(chosen, seen, steps, flowing)
    return origin(chosen.name)  # 5


def _maps(seen: list[_Seen], inputs: torch.Tensor) -> list[_Seen]:
    """Step 1: the modules whose output is a map of the whole input, not a window."""
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
    return maps


def _flowing(maps: list[_Seen], classes: int | None) -> list[_Seen]:
    """Step 2: the maps with a non-zero gradient on their map part, class-score maps left out."""
    return [s for s in maps if s.grad_channels and not (s.grad_channels == 1 and s.channels == classes)]


def _gathering_steps(seen: list[_Seen], mapped: set[str], origin: Callable[[str], str]) -> list[_Seen]:
    """Step 3: the modules given a flowing map (one of ``mapped``) whose output, but not its map, still flows."""
    return [s for s in seen if s.flows and not s.grad_channels and {origin(r) for r in s.reads} & mapped]


def _before_step(chosen: _Seen, seen: list[_Seen], steps: list[_Seen], flowing: list[_Seen]) -> _Seen:
    """Step 4's exception: ``chosen`` lies inside a gathering step that is not given it, so the
    layer is the last flowing map before the innermost such step (with one) starts."""
    position = {s.name: i for i, s in enumerate(seen)}
    around = [s for s in steps if chosen.name.startswith(s.name + ".")]
    for step in sorted(around, key=lambda s: len(s.name), reverse=True):  # they nest: innermost first
        inside = step.name + "."
        before = [f for f in flowing if position[f.name] < position[step.name] and not f.name.startswith(inside)]
        if before:
            return before[-1]
    return chosen


def _probe(model: nn.Module, inputs: torch.Tensor, scored: Scored, reader: _Reader) -> tuple[list[_Seen], torch.Tensor]:
    """Every module the forward ran, in the order its (last) call finished, as `_Seen`.

    One forward and backward on ``inputs`` under a `layertap.tap` on every module. Its
    ``edit=`` hands on a copy of each floating-point output: the copy's own gradient hook
    then sees only the uses after the module returned (not a pooled output the module
    computed from it, as in `CAM._run`), and the copy, found again in a later module's inputs by
    ``observe=``, tells who reads it. ``observe=`` also notes, at each module's return, the
    layout of its first floating-point output. (Its gradients are watched on the copies, not
    through ``observe=``: the probe needs to know which tensor of a call each gradient is for,
    and must not give a gradient to an output that had none.)
    """
    size = tuple(inputs.shape[2:])
    outs: dict[str, tuple[MapLayout | None, int, int | None]] = {}  # in the order modules finish
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
            given[name] = max((g for t in floats if (g := reader.positions(t.shape, size)) is not None), default=None)
            return
        layout = reader.map_layout(floats[0].shape, size) if floats else None
        channels = 0 if layout is None else floats[0].shape[1 if layout.kind == "channels_first" else -1]
        outs.pop(name, None)  # a module called again finishes again
        outs[name] = (layout, channels, reader.positions(floats[0].shape, size) if floats else None)

    # a tensor made under inference_mode cannot require grad: its copy can
    x = (inputs.clone() if inputs.is_inference() else inputs.detach()).requires_grad_(inputs.is_floating_point())
    modules = [name for name in named_layers(model) if name]
    # detach=False: observe sees the very tensors the modules were given, copies included
    probe = (
        tap(model, modules, capture=("input", "output"), detach=False, edit=hand_on, observe=observe)
        if modules
        else contextlib.nullcontext()
    )
    with running(model, grad=True), probe:
        output = run_model(model, x)
        scores, logits = scored(output)
        if scores.requires_grad:
            torch.autograd.grad(scores.sum(), x, allow_unused=True)
    seen = [
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
    return seen, logits
