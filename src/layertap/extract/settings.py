"""What a store's features depend on, written into it and held against a resumed run.

- The settings (`_settings`): the model's fingerprint, the layers, ``reduce``/``dtype``, the
  data's length, ids and transform. A resumed run must match them exactly, and under
  ``torchrun`` every process must have the same (`_check_same_everywhere`).
- The metadata record (`_store_meta`): the settings, their hash, and what people read (the
  model's name, the data, the classes, library versions, the time).
- The recompute check (`_tolerance`, `_difference`): how far rows computed again on resume may
  be from the stored ones, for ``verify=`` (see `layertap.extract_dataset`).
"""

from __future__ import annotations

import contextlib
import datetime
import hashlib
import json
import re
from typing import Any, Literal

import numpy as np
import torch
from torch import nn

from ..data import DataSource
from ..distributed import Processes
from ..errors import StoreError
from ..store.backends import format_package
from ..store.lifecycle import settings_differences
from ..tap.controls import Reduce
from .digests import code_fingerprint, model_fingerprint

Verify = Literal["close", "exact", "off"]


def describe(obj: Any) -> str | None:
    """A reduction or transform, for people and for comparing: its name (or repr, without
    addresses) and the fingerprint of its code and values (see `layertap.extract.digests`)."""
    if obj is None or isinstance(obj, str):
        return obj
    name = getattr(obj, "__qualname__", None)
    text = f"{getattr(obj, '__module__', '')}.{name}" if name else repr(obj)
    return f"{re.sub(r' at 0x[0-9a-fA-F]+', '', text)} (code {code_fingerprint(obj)})"


def _ids_digest(source: DataSource) -> str | None:
    if source.ids is None:
        return None
    digest = hashlib.sha256()
    for i in source.ids:
        # a file name that is not UTF-8 (surrogate-escaped by the OS) is hashed as its own bytes
        digest.update(f"{i}\0".encode("utf-8", "surrogateescape"))
    return digest.hexdigest()[:16]


def _settings(model: nn.Module, names: list[str], reduce: Reduce, dtype: torch.dtype | None, source: DataSource) -> dict:
    """What determines the store's contents: a resumed run must match it exactly."""
    settings = {
        "model": model_fingerprint(model),
        "layers": names,
        "reduce": describe(reduce),
        "dtype": str(dtype) if dtype is not None else None,
        "num_samples": source.num_samples,
        "ids": _ids_digest(source),
        "transform": describe(source.transform),
    }
    return json.loads(json.dumps(settings))


def _versions(format: str) -> dict:
    from importlib import metadata

    versions = {"torch": torch.__version__, "numpy": np.__version__}
    for package in ("layertap", format_package(format)):
        with contextlib.suppress(metadata.PackageNotFoundError):
            versions[package] = metadata.version(package)
    return versions


def _store_meta(settings: dict, model_name: str, source: DataSource, format: str) -> dict:
    """The record a new store is created with: ``settings`` (compared on resume) and their hash,
    with what people read beside them."""
    return {
        "model": model_name,
        **{k: settings[k] for k in ("layers", "reduce", "dtype")},
        "data": source.description,
        "root": str(source.root) if source.root is not None else None,
        "classes": source.classes,
        "settings": settings,
        "settings_hash": hashlib.sha256(json.dumps(settings, sort_keys=True).encode()).hexdigest()[:16],
        "versions": _versions(format),
        "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def _check_same_everywhere(procs: Processes, settings: dict) -> None:
    """Refuse a job whose processes would write different things into one store: every process
    compares all the settings (the model's full fingerprint among them), before the first
    batch, and all raise the same one-line error."""
    every = procs.gather(settings)
    others = [rank for rank, theirs in enumerate(every) if theirs != every[0]]
    if others:
        changed = settings_differences(every[0], every[others[0]], " vs ")
        ranks = ", ".join(map(str, others))
        raise StoreError(
            f"rank{'s' if len(others) > 1 else ''} {ranks} of {procs.world} {'have' if len(others) > 1 else 'has'} other settings "
            f"than rank 0: {changed}: every process must load the same model (seed random weights) and read the same data"
        )


def _tolerance(verify: Verify, model: nn.Module, dtype: torch.dtype | None) -> float:
    """How far recomputed rows may be from stored ones, as a fraction of each feature's largest
    value (see `_difference`)."""
    if verify == "exact":
        return 0.0
    half = (torch.float16, torch.bfloat16)
    return 1e-2 if dtype in half or any(p.dtype in half for p in model.parameters()) else 1e-4


def _difference(new: np.ndarray, old: np.ndarray, rtol: float) -> tuple[float, int, float, float] | None:
    """``None`` when recomputed rows ``new`` match the stored ``old`` within ``rtol``, else
    ``(the largest absolute difference, the feature most beyond its allowance, its difference,
    its allowance)``. The allowance is per feature (a column of the flattened rows): ``rtol``
    times that feature's largest stored magnitude, at least 1e-3 of the whole array's, so one
    massive channel hides no change in the others and features near 0 are not held to exact.
    Integers must be equal; NaN and infinities must sit in the same places."""
    new, old = new.reshape(len(new), -1), old.reshape(len(old), -1)
    if not np.issubdtype(old.dtype, np.inexact):
        rtol = 0.0
    new, old = new.astype(np.float64), old.astype(np.float64)
    finite = np.isfinite(new) & np.isfinite(old)
    if not (finite | (new == old) | (np.isnan(new) & np.isnan(old))).all():  # equal infinities are the same
        bad = int(np.flatnonzero(~(finite | (new == old) | (np.isnan(new) & np.isnan(old))).any(0))[0])
        return float("inf"), bad, float("inf"), 0.0
    with np.errstate(invalid="ignore"):  # inf - inf, where the mask drops it
        diff = np.where(finite, np.abs(new - old), 0.0).max(0, initial=0.0)
    size = np.where(np.isfinite(old), np.abs(old), 0.0).max(0, initial=0.0)
    allowed = rtol * np.maximum(size, 1e-3 * size.max(initial=0.0))
    beyond = diff - allowed
    if not (beyond > 0).any():
        return None
    worst = int(np.argmax(beyond / np.maximum(allowed, np.finfo(np.float64).tiny)))
    return float(diff.max()), worst, float(diff[worst]), float(allowed[worst])


__all__ = ["Verify", "model_fingerprint"]
