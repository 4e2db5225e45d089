"""Where a store is, and what leads out of it: local paths and URLs, and the entries of a store folder.

A store is a local path or an fsspec URL (`Location`). Every path a store names, and every entry
in its folder, must stay inside it: `_check_inside` and `_check_no_links_out` refuse what leads
out (``..``, absolute paths, symlinks) and what is neither a file nor a folder; the backends run
them before they read. `_foreign_entries` finds what a store folder holds that layertap did not
write, which removing the store would lose. A refusal is `_bad`: one `StoreError` line.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..atomic import one_line
from ..errors import StoreError
from .format import _ARRAY_PATH

Location = Path | str  # a local path, or an fsspec URL (str) such as "s3://bucket/feats.zarr"


def is_url(path: str | os.PathLike) -> bool:
    """Whether ``path`` is an fsspec URL (``s3://``, ``gs://``, ``memory://``...), not a local path."""
    return isinstance(path, str) and "://" in path


def location(path: str | os.PathLike) -> Location:
    """``path`` as the stores take it: a URL stays a string (a `Path` would fold its ``//``), and
    only a URL is a string."""
    return str(path) if is_url(path) else Path(path)


def url_fs(url: str) -> tuple[Any, str]:
    """The fsspec filesystem of ``url``, and the path inside it."""
    import fsspec  # a dependency of torch

    fs, inner = fsspec.core.url_to_fs(url)
    fs.invalidate_cache()  # fsspec caches instances and listings; Zarr writes through its own instance
    return fs, inner


def url_failed(url: str, e: BaseException) -> StoreError:
    """The one-line error of an object-store call on ``url`` that failed (no bucket, no access, no
    server): s3fs, gcsfs and botocore raise classes of their own, with long messages."""
    return StoreError(
        f"cannot reach {url} ({type(e).__name__}: {_one_line(e)}): check that its bucket exists, that you may "
        "write to it, and that the object store's endpoint is reachable (fsspec's FSSPEC_<PROTOCOL>_ENDPOINT_URL)"
    )


def _bad(path: Location, what: str) -> StoreError:
    return StoreError(
        f"{path} is not a valid layertap feature store: {what}. It is damaged, or was not written by "
        "layertap; extract again into a new path (or pass --overwrite)"
    )


def _one_line(e: BaseException) -> str:
    return one_line(e)[:300]


def _check_inside(root: Path, path: Path, entry: str) -> Path:
    """``path`` if it resolves (symlinks followed) inside ``root``; else refused, naming ``entry``."""
    try:
        real, top = path.resolve(), root.resolve()
    except (RuntimeError, OSError) as e:  # a symlink loop
        raise _bad(root, f"its entry {entry!r} cannot be resolved ({_one_line(e)})") from e
    if real != top and top not in real.parents:
        raise _bad(root, f"its entry {entry!r} leads outside the store (to {real})")
    return path


def _check_no_links_out(root: Path) -> None:
    """Refuse a store folder holding a symlink that leads outside it (Zarr would follow it), or
    anything but files and folders (reading a FIFO or a device would hang or never end)."""
    top = root.resolve()
    for folder, dirs, files in os.walk(root):
        for name in dirs + files:
            entry = Path(folder, name)
            where = str(entry.relative_to(root))
            if entry.is_symlink():
                _check_inside(top, entry, where)
            if not (entry.is_file() or entry.is_dir()):
                raise _bad(root, f"its entry {where!r} is neither a file nor a folder")


# ------------------------------------------------------------------- what is not ours
def _names(meta: Mapping) -> tuple[set[str], set[str]]:
    """The paths of the arrays (features, ids, labels) and groups that a store of ``meta`` holds;
    of a damaged store's metadata, only paths of the form layertap writes."""
    arrays = {a["path"] for a in meta.get("arrays") or [] if isinstance(a, dict) and isinstance(a.get("path"), str) and _ARRAY_PATH.fullmatch(a["path"])}
    return arrays | {"ids", "labels"}, {"features"} | {a.rpartition("/")[0] for a in arrays}


def _foreign_entries(path: Location, ours: Callable[[str, bool], bool]) -> list[str]:
    """The top-most entries under the folder (or object-store prefix) ``path`` that are not
    ``ours(relative path, is a folder)``, folders ending in ``/``. Symlinks are never followed."""
    if isinstance(path, str):
        fs, inner = url_fs(path)
        inner = inner.rstrip("/")
        listed = fs.find(inner, withdirs=True, detail=True)
        entries = [(name[len(inner) + 1 :], info["type"] == "directory") for name, info in listed.items() if name.rstrip("/") != inner]
        found = {rel: is_dir for rel, is_dir in entries if not ours(rel, is_dir)}
        return [rel + "/" * d for rel, d in sorted(found.items()) if not any(found.get("/".join(rel.split("/")[:k])) for k in range(1, rel.count("/") + 1))]
    foreign = []
    for folder, dirs, files in os.walk(path):
        for name in sorted(dirs + files):
            entry = Path(folder, name)
            rel, is_dir = entry.relative_to(path).as_posix(), name in dirs and not entry.is_symlink()
            if not ours(rel, is_dir):
                foreign.append(rel + "/" * is_dir)
                if name in dirs:
                    dirs.remove(name)  # not looked into: everything in it is the user's
    return sorted(foreign)
