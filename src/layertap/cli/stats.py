"""``layertap stats``: streaming statistics of every layer over a dataset, dead units and explosions."""

from __future__ import annotations

from pathlib import Path

from ..loading import load_model
from ..stats import stats as layer_stats
from .cam import image_advice
from .core import app, echo, own_allocator, typer
from .options import arch_option, model_argument, trust_option


@app.command()
def stats(
    model: str = model_argument(),
    data: Path = typer.Argument(..., exists=True, help="The inputs: an image folder, an image file or a .npy array."),
    layers: list[str] | None = typer.Option(
        None,
        "--layers",
        help="Only these layers (names, globs like 'layer*', 're:REGEX'); repeatable. Default: every leaf module.",
    ),
    per_channel: bool = typer.Option(False, "--per-channel", help="Also report each channel's mean and std."),
    bins: int = typer.Option(0, "--bins", min=0, help="Add a histogram of at most N bins per layer (in --json)."),
    batch_size: int = typer.Option(32, "--batch-size", min=1, help="Inputs per forward."),
    device: str | None = typer.Option(
        None, "--device", help="Run on this device, e.g. cuda:0 (default: where the weights are)."
    ),
    as_json: bool = typer.Option(False, "--json", help="Print the statistics as JSON."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a progress bar (on a terminal only)."),
    arch: str | None = arch_option(),
    trust: bool = trust_option(),
) -> None:
    """Mean, std, min, max, zeros and NaN/Inf of every layer's output over DATA, in one pass;
    flags dead channels (zero on every input) and exploding layers.

    Example: layertap stats layertap:shapes ./images --layers 'features.*' --per-channel
    """
    own_allocator()
    if bins == 1:
        raise typer.BadParameter("a histogram needs at least 2 bins (or 0 for none)", param_hint="'--bins'")
    net = load_model(model, arch=arch, trust=trust)
    # stats reads every input: a bad file must go (`layertap extract --on-error skip` can record it)
    leave_out = "move it out of DATA, or record it with `layertap extract --on-error skip` instead"
    with image_advice(f"Remove or replace the file, or {leave_out}", f"Shrink or remove the file, or {leave_out}"):
        table = layer_stats(
            net,
            str(data),
            layers or None,
            per_channel=per_channel,
            histogram_bins=bins,
            batch_size=batch_size,
            device=device,
            progress=progress,
        )
    echo(table.to_json() if as_json else str(table), keep="\n")
