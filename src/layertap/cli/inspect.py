"""``layertap inspect``: the layer table of any model, from one forward on a random example input;
with ``--text``, the size of the token store of a corpus (`layertap.extract.token_plan`)."""

from __future__ import annotations

from pathlib import Path
from typing import cast

from ..data import OnError
from ..errors import ModelLoadError
from ..extract.token_plan import token_sizes
from ..extract.units import POLICIES, TokenPolicy
from ..loading import DEFAULT_SPEC, load_model, spec_kind
from ..modelinfo import model_info
from ..summary import summary
from .core import app, echo, typer
from .options import (
    TEXT_DTYPES,
    arch_option,
    check_text_options,
    choice,
    corpus_tokenizer,
    id_field_option,
    max_length_option,
    model_argument,
    pack_option,
    parse_shape,
    text_field_option,
    text_option,
    tokenizer_option,
    tokens_option,
    trust_option,
)

_NOT_WITH_TEXT = {
    "--input-shape": "the model runs on the corpus's own tokens",
    "--ops": "name ops in --layers instead, e.g. 'encoder.layer.0.attention.self:scaled_dot_product_attention'",
}


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
    text: Path | None = text_option("Size the token store of this corpus instead"),
    text_field: str | None = text_field_option(),
    id_field: str | None = id_field_option(),
    tokenizer: Path | None = tokenizer_option(),
    max_length: int | None = max_length_option(),
    pack: bool = pack_option(),
    tokens: str | None = tokens_option(),
    dtype: str | None = typer.Option(None, "--dtype", help=f"With --text: the stored dtype, {', '.join(TEXT_DTYPES)} (default: the layers' own)."),
    on_error: str | None = typer.Option(None, "--on-error", help="With --text: a missing or non-text document: fail (stop, naming it) or skip."),
    arch: str | None = arch_option(),
    trust: bool = trust_option(),
) -> None:
    """Show every layer of MODEL: name, class, input and output shapes, calls, parameters, bytes per sample.
    With --text FILE, what `layertap extract MODEL --text FILE` would store instead: each layer's
    width and bytes per token, and the size of the whole corpus (every document tokenized; the
    layers' widths from one forward). Without --layers: every layer whose output is one row per token.

    Example: layertap inspect torchvision:resnet18 --input-shape 1,3,64,64 --depth 1 --ops

    Example: layertap inspect hf:./minilm --text corpus.txt --layers 'encoder.layer.*' --dtype float16
    """
    if arch is not None:
        try:
            spec_kind(model, arch)
        except ModelLoadError as e:
            raise typer.BadParameter(" ".join(str(e).split()), param_hint="'--arch'") from e
    choice(dtype, TEXT_DTYPES, "--dtype")
    choice(tokens, POLICIES, "--tokens")
    choice(on_error, ("fail", "skip"), "--on-error")
    given = {
        "--input-shape": input_shape is not None, "--ops": ops, "--text-field": text_field is not None, "--id-field": id_field is not None,
        "--tokenizer": tokenizer is not None, "--max-length": max_length is not None, "--pack": pack, "--tokens": tokens is not None,
        "--dtype": dtype is not None, "--on-error": on_error is not None,
    }
    check_text_options(text, given, _NOT_WITH_TEXT)
    net = load_model(model, arch=arch, trust=trust)
    if text is not None:
        sizes = token_sizes(
            net, str(text), layers or None, tokenizer=corpus_tokenizer(net, tokenizer), max_length=max_length,
            pack=pack, tokens=cast(TokenPolicy, tokens or "real"), dtype=dtype, text_field=text_field or "text", id_field=id_field,
            on_error=cast(OnError, on_error or "fail"), depth=depth,  # choice above has checked them
        )
        echo(sizes.to_json(indent=2) if as_json else str(sizes), keep="\n")
        return
    # parse_shape, the option's callback, has made the text a shape
    example = model_info(net).example(cast("tuple[int, ...] | None", input_shape))
    table = summary(net, example, layers=layers or None, depth=depth, ops=ops)
    echo(table.to_json(indent=2) if as_json else str(table), keep="\n")
