"""The arguments and options that several ``layertap`` commands share, checked before any work."""

from __future__ import annotations

from typing import Any

from ..cam import METHODS, HeatmapMethod
from ..cam.rollout import AttentionRollout
from ..errors import ModelLoadError
from ..loading import spec_kind
from .core import typer

# the Grad-CAM family and attention rollout: every one is built as HEATMAPS[name](model, layers)
HEATMAPS: dict[str, type[HeatmapMethod]] = {**METHODS, "rollout": AttentionRollout}

SPEC_HELP = (
    "Model spec: torchvision:NAME[:WEIGHTS], timm:NAME[:pretrained], hf:PATH_OR_NAME, PATH.pt (a state dict, "
    "with --arch; not TorchScript), package.module:callable or layertap:shapes."
)


def check_spec(spec: str | None) -> str | None:
    """Reject a malformed model spec as a usage error (exit code 2) before loading anything."""
    if spec is None:
        return None
    try:
        spec_kind(spec)
    except ModelLoadError as e:
        raise typer.BadParameter(" ".join(str(e).split())) from e
    return spec


def check_method(name: str) -> str:
    """A heatmap method of `HEATMAPS` (in any case), else a usage error."""
    if name.lower() not in HEATMAPS:
        raise typer.BadParameter(f"unknown method {name!r}; choose from {', '.join(HEATMAPS)}")
    return name.lower()


def parse_shape(text: str | None) -> tuple[int, ...] | None:
    """``"1,3,224,224"`` -> ``(1, 3, 224, 224)``; anything else is a usage error."""
    if text is None:
        return None
    try:
        shape = tuple(int(part) for part in text.replace("x", ",").split(","))
    except ValueError:
        shape = ()
    if not shape or any(s <= 0 for s in shape):
        raise typer.BadParameter(f"{text!r} is not a shape: give positive integers like 1,3,224,224")
    return shape


def model_argument(default: Any = ...) -> Any:
    """The MODEL argument: a spec, checked as the command line is read."""
    return typer.Argument(default, callback=check_spec, help=SPEC_HELP)


def arch_option(what: str = "file") -> Any:
    return typer.Option(None, "--arch", help=f"Architecture spec for a state-dict .pt/.pth {what}.")


TRUST_HELP = (
    "Let code that comes with the model run: a whole model pickled in a .pt file, a Hugging Face folder's "
    "own modeling code (auto_map). Never asked interactively."
)


def trust_option(help: str = TRUST_HELP) -> Any:
    return typer.Option(False, "--trust", help=help)
