"""``layertap inspect``: the layer table of any model, from one forward on a random example input."""

from __future__ import annotations

from ..loading import DEFAULT_SPEC, ModelLoadError, load_model, model_info, spec_kind
from ..summary import summary
from . import app, typer


def check_spec(spec: str) -> str:
    """Reject a malformed model spec as a usage error (exit code 2) before loading anything."""
    try:
        spec_kind(spec)
    except ModelLoadError as e:
        raise typer.BadParameter(" ".join(str(e).split())) from e
    return spec


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


@app.command()
def inspect(
    model: str = typer.Argument(
        DEFAULT_SPEC,
        callback=check_spec,
        help="Model spec: torchvision:NAME[:WEIGHTS], timm:NAME, hf:PATH_OR_NAME, PATH.pt, "
        "package.module:callable or layertap:shapes.",
    ),
    input_shape: str | None = typer.Option(
        None,
        "--input-shape",
        callback=parse_shape,
        help="Shape of the random example input, e.g. 1,3,224,224; token ids for text models, e.g. 1,16. "
        "Default: one sample at the model's input size.",
    ),
    layers: list[str] | None = typer.Option(
        None, "--layers", help="Only these layers (names, globs like 'layer*.0', 're:REGEX'); repeatable."
    ),
    depth: int | None = typer.Option(None, "--depth", min=0, help="Only names with at most N dotted parts."),
    as_json: bool = typer.Option(False, "--json", help="Print the table as JSON."),
    arch: str | None = typer.Option(None, "--arch", help="Architecture spec for a state-dict .pt/.pth file."),
    trust: bool = typer.Option(
        False, "--trust", help="Allow unpickling a whole model from a file (runs its code)."
    ),
) -> None:
    """Show every layer of MODEL: name, class, input and output shapes, calls, parameters, bytes per sample.

    Example: layertap inspect torchvision:resnet18 --input-shape 1,3,64,64 --depth 1
    """
    if arch is not None:
        try:
            spec_kind(model, arch)
        except ModelLoadError as e:
            raise typer.BadParameter(" ".join(str(e).split()), param_hint="'--arch'") from e
    net = load_model(model, arch=arch, trust=trust)
    example = model_info(net).example(input_shape)
    table = summary(net, example, layers=layers or None, depth=depth)
    typer.echo(table.to_json(indent=2) if as_json else str(table))
