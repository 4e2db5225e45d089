"""``layertap extract``: stream layers' features over a whole dataset to a Zarr, HDF5 or NumPy store;
with ``--text``, every token's features over a corpus (`layertap.extract_tokens`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any, cast

import numpy as np

from ..data import OnError
from ..distributed import launched
from ..extract import Verify, extract_dataset, extract_tokens
from ..extract.plan import plan
from ..extract.units import POLICIES, TokenPolicy
from ..loading import load_model
from ..store.backends import FORMATS
from ..store.paths import Location, location, url_fs
from ..store.reader import FeatureStore
from ..store.tokens import TokenStore
from ..tap.controls import REDUCTIONS
from ..units import human_bytes
from .core import app, click, echo, own_allocator, typer
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
    text_field_option,
    text_option,
    tokenizer_option,
    tokens_option,
    trust_option,
)

_DTYPES = ("float32", "float16", "float64")


def _disk_size(path: Location) -> int:
    if isinstance(path, str):  # a location is a str only when it is a URL
        fs, inner = url_fs(path)
        return fs.du(inner)
    files = [path] if path.is_file() else path.rglob("*")
    return sum(p.stat().st_size for p in files if p.is_file())


@app.command()
def extract(
    model: str = model_argument(),
    data: Path | None = typer.Argument(
        None, exists=True, help="The inputs: an image folder (class sub-folders become labels), an image file or a .npy array; or --text."
    ),
    layers: list[str] = typer.Option(
        ..., "--layers", help="Layers to keep (names, globs like 'layer*', 're:REGEX', ops inside a module like 'layer1.0:add_'); repeatable."
    ),
    out: str = typer.Option(
        ..., "--out", help="The store: a .zarr folder (default), a .h5 file, a folder with --format npy, or a Zarr URL (s3://bucket/f.zarr)."
    ),
    reduce: str | None = typer.Option(None, "--reduce", help=f"Pool each feature map: {', '.join(REDUCTIONS)}."),
    format: str | None = typer.Option(None, "--format", help="zarr, hdf5 or npy (default: from --out, else zarr)."),
    batch_size: int | None = typer.Option(None, "--batch-size", min=1, help="Inputs per forward (default: 64 images, 32 documents or contexts)."),
    workers: int | None = typer.Option(None, "--workers", min=0, help="Processes reading images (default: a few)."),
    device: str | None = typer.Option(None, "--device", help="Run on this device, e.g. cuda or cuda:1 (default: cpu)."),
    dtype: str | None = typer.Option(None, "--dtype", help=f"Store features as {', '.join(_DTYPES)} (with --text also bfloat16)."),
    on_error: str = typer.Option(
        "fail", "--on-error", help="An unreadable image (or a missing or non-text document): fail (stop, naming it) or skip (record it)."
    ),
    overwrite: bool = typer.Option(
        False,
        "--overwrite",
        help="Replace an existing store (default: resume it), removing only what layertap wrote: a store folder that also holds other files is refused, naming them.",
    ),
    verify: str = typer.Option(
        "close",
        "--verify",
        help="On resume, recompute one written batch and compare it with the store: close (within 1e-4 of each array's largest value), exact (bit for bit) or off.",
    ),
    limit: int | None = typer.Option(None, "--limit", min=1, help="Only the first N samples (documents with --text)."),
    max_image_pixels: int | None = typer.Option(
        None, "--max-image-pixels", min=0, help="Refuse images of more than N pixels (default: PIL's limit, about 179 million; 0: no limit)."
    ),
    chunk_size: int | None = typer.Option(
        None, "--chunk-size", min=1, help="Samples (tokens with --text) per chunk: the unit of writing, resuming and sharing among processes (default: ~16 MB)."
    ),
    progress: bool = typer.Option(
        True, "--progress/--no-progress", help="Print the size estimate and show a progress bar (the bar on a terminal only)."
    ),
    dry_run: bool = typer.Option(
        False, "--dry-run", help="Write nothing: print the plan (size per layer, free space, measured throughput and write bandwidth, projected time, smaller options)."
    ),
    text: Path | None = text_option("Instead of DATA, a corpus"),
    text_field: str | None = text_field_option(),
    id_field: str | None = id_field_option(),
    tokenizer: Path | None = tokenizer_option(),
    max_length: int | None = max_length_option(),
    pack: bool = pack_option(),
    tokens: str | None = tokens_option(),
    arch: str | None = arch_option(),
    trust: bool = trust_option(),
) -> None:
    """Run MODEL over every sample of DATA and write the features of --layers to --out, chunk by
    chunk, in constant memory. Rerun the same command to resume an interrupted run. Under
    torchrun (torchrun --nproc-per-node N -m layertap extract ...) the processes share the chunks.
    With --text FILE instead of DATA, every stored token of the corpus gets a row (a token store,
    read with layertap.open_tokens); `layertap inspect MODEL --text FILE` tells its size first.
    With --dry-run, nothing is written: the plan of the run is printed (`layertap.extract.plan`).

    Example: layertap extract torchvision:resnet50 ./images --layers avgpool --layers layer3 --reduce mean --out feats.zarr

    Example: layertap extract hf:./minilm --text corpus.jsonl --id-field id --layers encoder.layer.5 --dtype float16 --out tokens.zarr

    Example: layertap extract torchvision:resnet50 ./images --layers layer3 --out feats.zarr --dry-run
    """
    own_allocator()
    choice(reduce, REDUCTIONS, "--reduce")
    choice(format, FORMATS, "--format")
    choice(dtype, TEXT_DTYPES if text is not None else _DTYPES, "--dtype")
    choice(on_error, ("fail", "skip"), "--on-error")
    choice(verify, ("close", "exact", "off"), "--verify")
    choice(tokens, POLICIES, "--tokens")
    given = {
        "--reduce": reduce is not None, "--workers": workers is not None, "--max-image-pixels": max_image_pixels is not None,
        "--text-field": text_field is not None, "--id-field": id_field is not None, "--tokenizer": tokenizer is not None,
        "--max-length": max_length is not None, "--pack": pack, "--tokens": tokens is not None,
    }
    check_inputs(data, text, given)
    net = load_model(model, arch=arch, trust=trust)
    target = location(out)
    if dry_run:
        the_plan = plan(
            net, str(text or data), layers, out=target, text=text is not None, reduce=reduce, dtype=dtype, batch_size=batch_size, num_workers=workers,
            device=device, format=format, on_error=cast(OnError, on_error), limit=limit, max_image_pixels=max_image_pixels,
            tokenizer=corpus_tokenizer(net, tokenizer) if text is not None else None, max_length=max_length, pack=pack,
            tokens=cast(TokenPolicy, tokens or "real"), text_field=text_field or "text", id_field=id_field,
        )
        echo(str(the_plan), keep="\n")
        return
    common: dict[str, Any] = dict(
        format=format, overwrite=overwrite, device=device, dtype=dtype, limit=limit, chunk_size=chunk_size, progress=progress,
        verify=cast(Verify, verify), on_error=cast(OnError, on_error),  # choice above has checked them
    )
    if text is not None:
        store = extract_tokens(
            net, str(text), layers, out=target, tokenizer=corpus_tokenizer(net, tokenizer),
            max_length=max_length, pack=pack, tokens=cast(TokenPolicy, tokens or "real"), batch_size=batch_size or 32,
            text_field=text_field or "text", id_field=id_field, **common,
        )
        with store:
            if launched()[0] == 0:  # under torchrun, rank 0 speaks for the job
                _report_tokens(store, target)
        return
    assert data is not None  # check_inputs has checked it
    images = extract_dataset(
        net, str(data), layers, target, reduce=reduce, batch_size=batch_size or 64, num_workers=workers, max_image_pixels=max_image_pixels, **common
    )
    with images:
        if launched()[0] == 0:
            _report(images, target)


_IMAGE_ONLY = {
    "--reduce": "a token store keeps each token's features, unpooled",
    "--workers": "the corpus is read and tokenized in this process",
    "--max-image-pixels": "a corpus holds no images",
}


def check_inputs(data: Path | None, text: Path | None, given: dict[str, bool]) -> None:
    """DATA or --text, and only the options of the one given: anything else is a usage error."""
    if data is not None and text is not None:
        raise click.UsageError(f"give DATA ({data}) or --text ({text}), not both: images and a corpus make different stores")
    if data is None and text is None:
        raise click.UsageError("give DATA (an image folder, an image or a .npy array) or --text FILE (a corpus of documents)")
    check_text_options(text, given, _IMAGE_ONLY)


def _report(store: FeatureStore, target: Location) -> None:
    arrays = ", ".join(f"{key} {list(store[key].shape[1:])}" for key in store)
    echo(f"wrote {store.num_samples} samples to {target} ({store.format}, {human_bytes(_disk_size(target))}): {arrays}")
    if store.labels is not None:
        # rows of failed samples are not valid, and images outside any class folder are labelled -1
        labels = store.labels[store.valid]
        echo(f"labels: {len(np.unique(labels[labels >= 0]))} classes")
    for failure in store.failed:
        echo(f"failed: {failure.id}: {failure.error}")


def _report_tokens(store: TokenStore, target: Location) -> None:
    card = store.card
    arrays = ", ".join(f"{layer} {list(store[layer].shape[1:])}" for layer in store.layers)
    echo(
        f"wrote {len(store)} tokens of {card['num_documents']} documents to {target} "
        f"({store.features.format}, {human_bytes(_disk_size(target))}): {arrays}"
    )
    for index, doc, error in card["skipped"]:
        echo(f"skipped: document {index} ({doc!r}): {error}")
