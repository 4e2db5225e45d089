"""Files written whole or not at all, and logs appended without following a link.

- `write_atomic` (and `AtomicFile`, for writers that stream) writes a temporary file beside the
  target, hands it to the disk (``fsync``) and renames it over the target (``os.replace``): a
  full disk or a crash leaves the old file as it was, never a cut one.
- `AppendLog` opens a log for appending with ``O_NOFOLLOW``: a symbolic link at the path is
  refused, never followed to overwrite what it points to.

Every failure is a `OutputError` of one line that names the file (an ``OSError``'s own text
names none: ``[Errno 28] No space left on device``).

>>> import os, tempfile
>>> path = os.path.join(tempfile.mkdtemp(), "page.html")
>>> write_atomic(path, "<p>whole</p>").read_text()
'<p>whole</p>'
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
from pathlib import Path
from typing import IO

from .errors import OutputError

#: Plain words for the errors a disk gives; other errors keep their own text.
REASONS = {
    errno.ENOSPC: "the disk is full",
    errno.EDQUOT: "the disk quota is used up",
    errno.EROFS: "the disk is read-only",
    errno.EFBIG: "the file would pass this process's file size limit (ulimit -f)",
    errno.EACCES: "permission denied",
    errno.EISDIR: "it is a folder",
    errno.ELOOP: "it is a symbolic link, and layertap writes no file through a link",
}


def one_line(e: BaseException) -> str:
    """An exception's text on one line (its type's name when it has none)."""
    return " ".join(str(e).split()) or type(e).__name__


def reason(e: BaseException) -> str:
    """What went wrong, in one line without the path (the caller names the file)."""
    if isinstance(e, OSError):
        return REASONS.get(e.errno or 0) or " ".join((e.strerror or "").split()) or one_line(e)
    return one_line(e)


def check_target(path: str | os.PathLike[str], what: str) -> Path:
    """``path`` if a regular file may be written there: it is not a folder, a link or a device,
    and its folder, if it exists, is a folder. ``what`` names the file in the error."""
    path = Path(path)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        st = None
    except NotADirectoryError as e:  # a file where a folder of the path should be
        culprit = next((p for p in reversed(path.parents) if p.exists() and not p.is_dir()), path.parent)
        raise OutputError(f"cannot write {what} {path}: {culprit} is not a folder") from e
    except OSError as e:
        raise OutputError(f"cannot write {what} {path}: {reason(e)}") from e
    if st is not None and stat.S_ISLNK(st.st_mode):
        raise OutputError(f"cannot write {what} {path}: it is a symbolic link, and layertap writes no file through a link; give the real path")
    if st is not None and not stat.S_ISREG(st.st_mode):
        kind = "a folder" if stat.S_ISDIR(st.st_mode) else "not a regular file"
        raise OutputError(f"cannot write {what} {path}: it is {kind}; name a file")
    return path


class AtomicFile:
    """A binary file that appears at ``path`` whole, at `commit`, or not at all (`discard`).

    Until then the bytes go to a hidden temporary file in the same folder (so the rename cannot
    cross a disk); it takes the old file's permissions, or the umask's for a new one.
    """

    def __init__(self, path: str | os.PathLike[str], what: str = "the file") -> None:
        self.path, self.what = check_target(path, what), what
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self.temp = self.path.with_name(f".{self.path.name}.{secrets.token_hex(4)}.partial")
            fd = os.open(self.temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o666)
        except OSError as e:
            raise self.error(e) from e
        with contextlib.suppress(FileNotFoundError):
            os.fchmod(fd, stat.S_IMODE(os.stat(self.path, follow_symlinks=False).st_mode))
        self.file: IO[bytes] = os.fdopen(fd, "wb")

    def error(self, e: OSError) -> OutputError:
        kept = " (the old one is left as it was)" if self.path.is_file() else ""
        return OutputError(f"cannot write {self.what} {self.path}: {reason(e)}{kept}")

    def write(self, data: bytes) -> None:
        try:
            self.file.write(data)
        except OSError as e:
            self.discard()
            raise self.error(e) from e

    def commit(self) -> Path:
        """Hand the bytes to the disk and put the file in place."""
        try:
            self.file.flush()
            os.fsync(self.file.fileno())
            self.file.close()
            os.replace(self.temp, self.path)
        except OSError as e:
            self.discard()
            raise self.error(e) from e
        _sync_folder(self.path.parent)
        return self.path

    def discard(self) -> None:
        """Drop the temporary file; the target stays as it was."""
        with contextlib.suppress(OSError):  # a full disk may refuse the last flush too: the file goes anyway
            self.file.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.temp)


def write_atomic(path: str | os.PathLike[str], data: str | bytes, what: str = "the file") -> Path:
    """Write ``data`` (text as UTF-8) to ``path`` whole or not at all; return the path."""
    out = AtomicFile(path, what)
    try:
        out.write(data.encode("utf-8") if isinstance(data, str) else data)
    except BaseException:
        out.discard()
        raise
    return out.commit()


class AppendLog:
    """A log that grows by whole pieces (`write`), opened (made if missing, with its folder)
    only if it is a regular file, never through a symbolic link."""

    def __init__(self, path: str | os.PathLike[str], what: str = "the file") -> None:
        self.path, self.what = check_target(path, what), what
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            # O_NONBLOCK: a FIFO put there after the check must not hang the open; cleared below
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK
            self.fd = os.open(self.path, flags, 0o666)
        except OSError as e:
            raise self.error(e) from e
        if not stat.S_ISREG(os.fstat(self.fd).st_mode):
            os.close(self.fd)
            raise OutputError(f"cannot write {what} {self.path}: it is not a regular file; name a file")
        os.set_blocking(self.fd, True)

    def error(self, e: OSError) -> OutputError:
        return OutputError(f"cannot write {self.what} {self.path}: {reason(e)}")

    def write(self, data: bytes) -> None:
        """Append ``data`` whole: if the disk refuses part of it, what was written is cut off again."""
        size = os.fstat(self.fd).st_size
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError as e:
            with contextlib.suppress(OSError):  # if even that fails, the error below still says what happened
                os.ftruncate(self.fd, size)
            raise self.error(e) from e

    def close(self) -> None:
        os.close(self.fd)


def sync_path(path: str | os.PathLike[str]) -> None:
    """Hand a file, or a folder's list of entries, to the disk (``fsync``); an error is raised."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _sync_folder(folder: Path) -> None:
    """The rename itself on disk, where the system allows a folder to be synced."""
    with contextlib.suppress(OSError):  # some file systems cannot sync a folder; the file itself is synced
        sync_path(folder)


__all__ = ["AppendLog", "AtomicFile", "check_target", "one_line", "reason", "sync_path", "write_atomic"]
