"""``layertap extract``: stream layers' features over a whole dataset to a Zarr, HDF5 or NumPy store."""

from __future__ import annotations

from pathlib import Path
from typing import cast

import numpy as np

from ..data import OnError
from ..distributed import launched
from ..extract import Verify, extract_dataset
from ..loading import load_model
from ..store.backends import FORMATS
from ..store.paths import Location, location, url_fs
from ..tap.controls import REDUCTIONS
from ..units import human_bytes
from .core import app, echo, own_allocator, typer
from .options import arch_option, model_argument, trust_option

_DTYPES = ("float32", "float16", "float64")


def _choice(value: str | None, choices: tuple[str, ...], option: str) -> str | None:
    if value is not None and value not in choices:
        raise typer.BadParameter(f"{value!r} is not one of {', '.join(choices)}", param_hint=f"'{option}'")
    return value


def _disk_size(path: Location) -> int:
    if isinstance(path, str):  # a location is a str only when it is a URL
        fs, inner = url_fs(path)
        return fs.du(inner)
    files = [path] if path.is_file() else path.rglob("*")
    return sum(p.stat().st_size for p in files if p.is_file())


@app.command()
def extract(
    model: str = model_argument(),
    data: Path = typer.Argument(
        ..., exists=True, help="The inputs: an image folder (class sub-folders become labels), an image file or a .npy array."
    ),
    layers: list[str] = typer.Option(
        ..., "--layers", help="Layers to keep (names, globs like 'layer*', 're:REGEX', ops inside a module like 'layer1.0:add_'); repeatable."
    ),
    out: str = typer.Option(
        ..., "--out", help="The store: a .zarr folder (default), a .h5 file, a folder with --format npy, or a Zarr URL (s3://bucket/f.zarr)."
    ),
    reduce: str | None = typer.Option(None, "--reduce", help=f"Pool each feature map: {', '.join(REDUCTIONS)}."),
    format: str | None = typer.Option(None, "--format", help="zarr, hdf5 or npy (default: from --out, else zarr)."),
    batch_size: int = typer.Option(64, "--batch-size", min=1, help="Inputs per forward."),
    workers: int | None = typer.Option(None, "--workers", min=0, help="Processes reading images (default: a few)."),
    device: str | None = typer.Option(None, "--device", help="Run on this device, e.g. cuda or cuda:1 (default: cpu)."),
    dtype: str | None = typer.Option(None, "--dtype", help=f"Store features as {', '.join(_DTYPES)}."),
    on_error: str = typer.Option("fail", "--on-error", help="An unreadable image: fail (stop, naming it) or skip (record it)."),
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
    limit: int | None = typer.Option(None, "--limit", min=1, help="Only the first N samples."),
    max_image_pixels: int | None = typer.Option(
        None, "--max-image-pixels", min=0, help="Refuse images of more than N pixels (default: PIL's limit, about 179 million; 0: no limit)."
    ),
    chunk_size: int | None = typer.Option(
        None, "--chunk-size", min=1, help="Samples per chunk: the unit of writing, resuming and sharing among processes (default: ~16 MB)."
    ),
    progress: bool = typer.Option(
        True, "--progress/--no-progress", help="Print the size estimate and show a progress bar (the bar on a terminal only)."
    ),
    arch: str | None = arch_option(),
    trust: bool = trust_option(),
) -> None:
    """Run MODEL over every sample of DATA and write the features of --layers to --out, chunk by
    chunk, in constant memory. Rerun the same command to resume an interrupted run. Under
    torchrun (torchrun --nproc-per-node N -m layertap extract ...) the processes share the chunks.

    Example: layertap extract torchvision:resnet50 ./images --layers avgpool --layers layer3 --reduce mean --out feats.zarr
    """
    own_allocator()
    _choice(reduce, REDUCTIONS, "--reduce")
    _choice(format, FORMATS, "--format")
    _choice(dtype, _DTYPES, "--dtype")
    _choice(on_error, ("fail", "skip"), "--on-error")
    _choice(verify, ("close", "exact", "off"), "--verify")
    net = load_model(model, arch=arch, trust=trust)
    target = location(out)
    store = extract_dataset(
        net,
        str(data),
        layers,
        target,
        reduce=reduce,
        dtype=dtype,
        batch_size=batch_size,
        num_workers=workers,
        device=device,
        format=format,
        overwrite=overwrite,
        verify=cast(Verify, verify),  # _choice above has checked it
        on_error=cast(OnError, on_error),  # _choice above has checked it
        limit=limit,
        chunk_size=chunk_size,
        max_image_pixels=max_image_pixels,
        progress=progress,
    )
    with store:
        if launched()[0] != 0:  # under torchrun, rank 0 speaks for the job
            return
        arrays = ", ".join(f"{key} {list(store[key].shape[1:])}" for key in store)
        echo(f"wrote {store.num_samples} samples to {target} ({store.format}, {human_bytes(_disk_size(target))}): {arrays}")
        if store.labels is not None:
            # rows of failed samples are not valid, and images outside any class folder are labelled -1
            labels = store.labels[store.valid]
            echo(f"labels: {len(np.unique(labels[labels >= 0]))} classes")
        for failure in store.failed:
            echo(f"failed: {failure.id}: {failure.error}")
