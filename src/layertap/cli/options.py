"""The arguments and options that several ``layertap`` commands share, checked before any work."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..cam import METHODS, HeatmapMethod
from ..cam.rollout import AttentionRollout
from ..errors import ArgumentError, ModelLoadError
from ..extract.tokenizer import default_tokenizer, read_tokenizer
from ..extract.units import POLICIES
from ..loading import spec_kind
from .core import typer

# the Grad-CAM family and attention rollout: every one is built as HEATMAPS[name](model, layers)
HEATMAPS: dict[str, type[HeatmapMethod]] = {**METHODS, "rollout": AttentionRollout}

SPEC_HELP = (
    "Model spec: torchvision:NAME[:WEIGHTS], timm:NAME[:pretrained], hf:PATH_OR_NAME, PATH.pt (a state dict, "
    "with --arch; not TorchScript), package.module:callable or layertap:shapes."
)


TEXT_DTYPES = ("float32", "float16", "float64", "bfloat16")  # a token store keeps bfloat16's raw bits


def choice(value: str | None, choices: tuple[str, ...], option: str) -> str | None:
    """``value`` if it is one of ``choices`` (or ``None``), else a usage error naming ``option``."""
    if value is not None and value not in choices:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(choices)}", param_hint=f"'{option}'")
    return value


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


def corpus_tokenizer(model: Any, folder: Path | None) -> Any:
    """The tokenizer of ``--text``: the one saved in ``folder`` (``--tokenizer``), read as data (a
    tokenizer that needs its own code is refused), else the one beside an ``hf:`` model."""
    if folder is None:
        try:
            return default_tokenizer(model)
        except ArgumentError as e:  # no folder is known for the model
            raise ArgumentError(f"no tokenizer is known for this {type(model).__name__}: give --tokenizer FOLDER, a folder holding a Hugging Face tokenizer") from e
    return read_tokenizer(folder, fix="give --tokenizer the folder a tokenizer was saved in")


def check_text_options(text: Path | None, given: dict[str, bool], not_with_text: dict[str, str]) -> None:
    """Refuse as usage errors the options given (``given[option]``) that do not go with whether
    ``--text`` is: ``not_with_text`` says why each of those is not for a corpus, and every other
    option of ``given`` is for a corpus only."""
    for option, set_ in given.items():
        if set_ and text is not None and option in not_with_text:
            raise typer.BadParameter(f"it does not go with --text ({not_with_text[option]}): leave it out", param_hint=f"'{option}'")
        if set_ and text is None and option not in not_with_text:
            raise typer.BadParameter("it is for a corpus: give --text FILE too, or leave it out", param_hint=f"'{option}'")


# ------------------------------------------------------------------ a corpus (--text), for extract and inspect
def text_option(what: str) -> Any:
    return typer.Option(
        None, "--text", exists=True, dir_okay=False,
        help=f"{what}: a .txt (one document per line), .jsonl/.json, .csv or .parquet file; every stored token is a row.",
    )


def text_field_option() -> Any:
    return typer.Option(None, "--text-field", help="With --text: the records' field that holds the text (default: text).")


def id_field_option() -> Any:
    return typer.Option(None, "--id-field", help="With --text: the records' field that holds each document's id (default: its index).")


def tokenizer_option() -> Any:
    return typer.Option(
        None, "--tokenizer", exists=True, file_okay=False, help="With --text: a folder holding a Hugging Face tokenizer (default: the one beside an hf: model)."
    )


def max_length_option() -> Any:
    return typer.Option(
        None, "--max-length", min=1, help="With --text: tokens per document (truncated) or per packed context (default: the most the model takes)."
    )


def pack_option() -> Any:
    return typer.Option(False, "--pack", help="With --text: join the documents, each followed by EOS (else SEP), into contexts of --max-length.")


def tokens_option() -> Any:
    return typer.Option(None, "--tokens", help=f"With --text: which tokens to store: {', '.join(POLICIES)} (default: real, every token but padding).")
