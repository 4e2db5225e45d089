"""The formats: Zarr (the default), HDF5 and NumPy folders, each one class of primitive reads and
writes (`layertap.store.backend`), in a file of its own (``zarr_backend.py``, ``hdf5_backend.py``,
``npy_backend.py``).

`StoreWriter` and `FeatureStore` reach a store's files only through a backend. Each declares what
the rest of the package and the extraction ask of its format (its suffixes, the package it needs,
how many processes may write one store at once, whether it takes URLs or grows...), so adding a
format is one class, added to `BACKENDS` here; `format_for`, `detect_format`, `format_package`
and `check_writers` answer from those declarations.
"""

from __future__ import annotations

from pathlib import Path

from ..errors import StoreError
from .backend import _Backend
from .hdf5_backend import _HDF5Backend
from .npy_backend import _NpyBackend
from .paths import Location, is_url
from .zarr_backend import _ZarrBackend

BACKENDS: dict[str, type[_Backend]] = {b.format: b for b in (_ZarrBackend, _HDF5Backend, _NpyBackend)}  # the first is the default
FORMATS = tuple(BACKENDS)


def format_package(format: str) -> str:
    """The package that stores of ``format`` need (whose version a store records)."""
    return BACKENDS[format].PACKAGE


def check_writers(format: str, world: int, out: Location) -> None:
    """Refuse ``world`` processes writing one store of ``format`` at ``out`` when the format takes fewer."""
    backend = BACKENDS[format]
    if backend.WRITERS is not None and world > backend.WRITERS:
        raise StoreError(backend.TOO_MANY_WRITERS.format(world=world, out=out))


def format_for(path: str | Path, format: str | None) -> str:
    """The format to write ``path`` in: ``format``, an existing store's, or by suffix (default Zarr)."""
    if format is not None:
        if format not in FORMATS:
            raise ValueError(f"unknown format={format!r}: use one of {FORMATS}")
    else:
        suffix = Path(str(path)).suffix.lower()
        format = detect_format(path) or next((f for f, b in BACKENDS.items() if suffix in b.SUFFIXES), FORMATS[0])
    if is_url(path) and not BACKENDS[format].URLS:
        raise StoreError(f"{path} is a URL: only Zarr stores can be written to an object store (fsspec); use a .zarr URL")
    return format


def detect_format(path: str | Path) -> str | None:
    """The format of the layertap store at ``path``, or ``None`` if there is none."""
    url = isinstance(path, str) and is_url(path)  # an object store holds Zarr only (the formats with URLS)
    found = (f for f, b in BACKENDS.items() if (b.URLS or not url) and b.holds(path if url else Path(path)))
    return next(found, None)
