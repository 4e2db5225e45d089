"""``layertap inspect``: the layer table of any model, from one forward on a random example input."""

from __future__ import annotations

from typing import cast

from ..errors import ModelLoadError
from ..loading import DEFAULT_SPEC, load_model, spec_kind
from ..modelinfo import model_info
from ..summary import summary
from .core import app, echo, typer
from .options import arch_option, model_argument, parse_shape, trust_option


@app.command()
def inspect(
    model: str = model_argument(DEFAULT_SPEC),
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
    ops: bool = typer.Option(
        False, "--ops", help="Also list the ops inside each module's own forward, named as layers= takes them (layer1.0:add_)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the table as JSON."),
    arch: str | None = arch_option(),
    trust: bool = trust_option(),
) -> None:
    """Show every layer of MODEL: name, class, input and output shapes, calls, parameters, bytes per sample.

    Example: layertap inspect torchvision:resnet18 --input-shape 1,3,64,64 --depth 1 --ops
    """
    if arch is not None:
        try:
            spec_kind(model, arch)
        except ModelLoadError as e:
            raise typer.BadParameter(" ".join(str(e).split()), param_hint="'--arch'") from e
    net = load_model(model, arch=arch, trust=trust)
    # parse_shape, the option's callback, has made the text a shape
    example = model_info(net).example(cast("tuple[int, ...] | None", input_shape))
    table = summary(net, example, layers=layers or None, depth=depth, ops=ops)
    echo(table.to_json(indent=2) if as_json else str(table), keep="\n")
