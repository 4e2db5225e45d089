"""A store's life: made, resumed, refused or replaced, through `open_or_create`, the only way in for a writer.

`open_or_create` takes the store's lock, checks what is at the path, resumes, refuses or
overwrites (what layertap wrote only), and creates. A store is resumed only when it was written
with the same settings (`settings_differences` says which differ), by a layertap whose stores
prove on resume that the data is the same. `remove_store` deletes a store when all it holds is
what layertap wrote, and refuses, naming them, when it holds anything else; nothing else at a
path (a folder or file that is not a store) is ever touched. A store is marked complete by its
writer (`StoreWriter.finish`) once every chunk is marked.
"""

from __future__ import annotations

import contextlib
import os
import shutil
from collections.abc import Callable, Mapping
from pathlib import Path

from ..errors import StoreError
from .backends import BACKENDS, detect_format, format_for
from .format import _LOCK, _NPY_HALF_META, _STORE_VERSION, _ZARR_HALF_META, StorePlan
from .lock import StoreLock
from .paths import Location, location, url_fs
from .trust import _open_backend
from .writer import StoreWriter

# settings a later layertap records that an older store's settings lack: not a difference, as the
# resume's recomputation of written rows proves them (`layertap.extract.run`, whatever verify= says)
ADDED_SETTINGS = frozenset({"calls"})


def settings_differences(old: Mapping, new: Mapping, sep: str) -> str:
    """The settings in which ``new`` differs from ``old``, for people; ``""`` when none does."""
    what = {"model": "model (fingerprint of its state, tree and code)", "ids": "sample ids (digest)"}
    return "; ".join(
        f"{what.get(k, k)} {old.get(k)!r}{sep}{new[k]!r}" for k in new if old.get(k) != new[k] and (k in old or k not in ADDED_SETTINGS)
    )



def open_or_create(
    out: str | os.PathLike,
    format: str | None,
    meta: dict,
    *,
    resume: bool,
    overwrite: bool,
    layout: Callable[[], StorePlan],
    say: Callable[[str], None] = lambda message: None,
) -> StoreWriter:
    """The only way for a writer into a store: lock it, then resume, refuse, replace or create.

    Args:
        out: the store's path or URL.
        format: the format asked for (``None``: the existing store's, or by suffix).
        meta: the new store's metadata; its ``"settings"`` must equal a store's to resume it.
        resume: continue a store with the same settings (its missing chunks only).
        overwrite: replace the layertap store at ``out``; one that holds anything layertap did
            not write (a user's files beside its arrays) is refused, naming it (`remove_store`).
        layout: called only when a new store is made: its `StorePlan` (arrays and size).
        say: where the size estimate is told.

    Returns:
        a `StoreWriter` holding the store's lock; ``writer.state`` says ``"complete"``,
        ``"resume"`` or ``"new"``.
    """
    out = location(out)
    fmt = format_for(out, format)
    if isinstance(out, Path) and _occupied(out) and detect_format(out) is None:
        raise StoreError(f"{out} exists and is not a layertap feature store: choose another output path")
    if isinstance(out, Path) and (found := detect_format(out)) and BACKENDS[found].ONE_FILE != BACKENDS[fmt].ONE_FILE:
        kinds = {True: "one file", False: "a folder"}  # checked before anything is removed: the new store could not be made there
        raise StoreError(
            f"{out} is a {found} store ({kinds[BACKENDS[found].ONE_FILE]}), which a {fmt} store ({kinds[BACKENDS[fmt].ONE_FILE]}) "
            "cannot replace: write to another path, or remove the old store first"
        )
    made = isinstance(out, Path) and not out.exists()  # a folder made for the lock goes again on failure
    lock = StoreLock(out, fmt).acquire()
    try:
        writer = _resume_or_refuse(out, format, meta["settings"], resume, overwrite)
        if writer is None:
            writer = StoreWriter.create(out, fmt, meta, layout(), say=say)
        writer.lock = lock
        return writer
    except BaseException:
        lock.release()
        if made and isinstance(out, Path) and out.is_dir():
            with contextlib.suppress(OSError):
                out.rmdir()  # only if nothing was written
        raise


def _resume_or_refuse(out: Location, format: str | None, settings: dict, resume: bool, overwrite: bool) -> StoreWriter | None:
    """The store to continue at ``out``, or ``None`` to write a new one (after removing an old one)."""
    found = detect_format(out)
    if found is None:
        if _occupied(out):
            raise StoreError(f"{out} exists and is not a layertap feature store: choose another output path")
        return None
    if overwrite:
        remove_store(out)
        return None
    backend, meta = _open_backend(out, "r", half_made=True)
    if not meta["ready"]:  # killed while creating it: nothing to keep
        backend.close()
        remove_store(out)
        return None
    backend.close()
    writer = StoreWriter.open(out)
    problem = None
    if not resume:
        problem = "already holds features"
    elif format is not None and format != meta["format"]:
        problem = f"is a {meta['format']} store, not {format}"
    elif meta["layertap_store"] < _STORE_VERSION:
        problem = "was written by an older layertap, whose stores cannot prove on resume that the data is the same"
    elif changed := settings_differences(meta.get("settings") or {}, settings, ", now "):
        problem = f"was written with other settings: {changed}"
    if problem:
        writer.close()
        raise StoreError(f"{out} {problem}: pass overwrite=True (--overwrite) to replace it, or write to another path")
    writer.state = "complete" if meta["complete"] else "resume"
    return writer



def remove_store(path: str | Path) -> None:
    """Delete the layertap store at ``path``: what layertap wrote in it, when that is all it
    holds. Anything else (not a store; a user's notes or plots in the folder; arrays or
    attributes added to the HDF5 file) is refused, naming it, and nothing is deleted.

    The store's lock file stays: the writer that holds it is the one removing the store.
    """
    path = location(path)
    if not _occupied(path):
        return
    format = detect_format(path)
    meta, foreign = None, []
    if format:
        backend = BACKENDS[format](path, "r")
        try:
            meta = backend.read_meta()
            if isinstance(meta, dict) and "layertap_store" in meta:
                foreign = backend.foreign(meta)
        except StoreError:
            meta = None
        finally:
            backend.close()
    if not isinstance(meta, dict) or "layertap_store" not in meta:
        raise StoreError(f"{path} exists and is not a layertap feature store: choose another output path")
    if foreign:
        more = f" and {len(foreign) - 5} more" if len(foreign) > 5 else ""
        raise StoreError(
            f"{path} holds what layertap did not write ({', '.join(map(repr, foreign[:5]))}{more}), which replacing the "
            "store would delete: move that out of it, or write to another path"
        )
    if isinstance(path, str):
        fs, inner = url_fs(path)
        for entry in fs.ls(inner, detail=False):
            if not str(entry).endswith(_LOCK):
                fs.rm(entry, recursive=True)
    elif path.is_dir():
        for entry in path.iterdir():
            if entry.name == _LOCK:
                continue
            if entry.is_dir() and not entry.is_symlink():
                shutil.rmtree(entry)
            else:
                entry.unlink()  # a symlink is removed, never what it points to
    else:
        # the file itself, where a symlink leads: the new store is made there (through the
        # link), beside the lock that every path to the file meets
        Path(os.path.realpath(path)).unlink()



def _occupied(path: Location) -> bool:
    """Whether something is at ``path``: a file, or a folder holding more than a store lock and
    the metadata a writer killed while making a store left half written."""
    if isinstance(path, str):
        fs, inner = url_fs(path)
        return fs.exists(inner) and (fs.isfile(inner) or any(not str(p).endswith(_LOCK) for p in fs.ls(inner, detail=False)))
    if path.is_symlink():
        return True
    if not path.exists():
        return False
    return not path.is_dir() or any(not _left_by_a_writer(p.name) for p in path.iterdir())


def _left_by_a_writer(name: str) -> bool:
    return name == _LOCK or _NPY_HALF_META.fullmatch(name) is not None or _ZARR_HALF_META.fullmatch(name) is not None
