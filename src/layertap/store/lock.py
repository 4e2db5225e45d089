"""One writer per store: `StoreLock`, a lock that names its holder and is taken over from a killed one.

One writer at a time: a lock (a record lock on local disks, keyed on the file an HDF5 path
resolves to; a lease object in object stores) makes a second extraction of the same store stop
with the holder's name, and a killed holder's lock is taken over at once. `open_or_create` takes
it before it looks at what is at the path; the `StoreWriter` it returns holds it until closed.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import json
import os
import socket
import stat
import threading
import time
import warnings
from pathlib import Path

from ..errors import StoreError, StoreLockedError
from ..printable import printable
from .backends import BACKENDS
from .format import _LOCK
from .paths import Location, _one_line, is_url, url_failed, url_fs


class StoreLock:
    """One writer per store: an exclusive lock that names its holder (host, pid, start time).

    On a local disk it is a POSIX record lock (``fcntl.lockf``) on a file inside the store, or
    for an HDF5 file beside the file its path resolves to (symlinks followed), so every path
    to one file meets one lock, whatever HDF5's own locking is set to. A record lock belongs to
    its process: the system drops it when the process ends, however it ends, and a child
    (a data-loader worker forked while it is held) never holds it. A run that finds the lock
    of a holder that ended without releasing it (killed) takes it over, with a warning naming
    that process. In an object store, where nothing locks, it is a lease object that the
    holder renews while it writes: a lease whose holder is gone from this host, or which has
    expired, is taken over.
    """

    LEASE = 600.0  # seconds an object-store lease lasts without renewal
    RENEW = 60.0

    def __init__(self, path: Location, format: str) -> None:
        self.path = path
        self.owner = {
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
        self._fd: int | None = None
        self._key = (-1, -1)  # the lock file's (device, inode), once held
        self._renewed = 0.0
        if str(path).startswith("file://"):  # a local disk behind a URL: lock it as one
            path = Path(str(path).removeprefix("file://"))
        if is_url(path):
            self.file: Location = f"{str(path).rstrip('/')}/{_LOCK}"
        elif BACKENDS[format].ONE_FILE:  # beside the file itself: a symlink to it meets the same lock
            real = Path(os.path.realpath(path))
            self.file = real.with_name(f".{real.name}{_LOCK}")
        else:
            self.file = Path(path) / _LOCK

    def acquire(self) -> StoreLock:
        if is_url(self.file):
            try:
                self._take_lease()
            except StoreError:
                raise
            except Exception as e:  # no bucket, no access, no server: s3fs and botocore raise their own classes
                raise url_failed(str(self.path), e) from e
        else:
            with _HELD_GUARD:
                self._lock_file(Path(self.file))
        return self

    def _held_by(self, text: str) -> StoreLockedError:
        return StoreLockedError(
            f"{self.path} is being written by another extraction ({_holder(text)}): wait for it to end or stop it; "
            "a store takes one writer at a time"
        )

    def _lock_file(self, file: Path) -> None:
        import fcntl

        file.parent.mkdir(parents=True, exist_ok=True)
        while True:
            # a lock this process holds: a record lock would grant it again, and closing a second
            # descriptor of the file would drop it, so it is refused before the file is opened
            with contextlib.suppress(OSError):
                st = os.stat(file, follow_symlinks=False)
                if (held := _HELD.get((st.st_dev, st.st_ino))) is not None and held.owner["pid"] == os.getpid():
                    raise self._held_by(json.dumps(held.owner))
            try:  # never through a symlink: it could point at any file, which the owner line would overwrite
                fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0), 0o644)
            except OSError as e:
                raise StoreError(f"cannot use {file} as the lock of {self.path} ({_one_line(e)}): remove it (a lock is a plain file)") from e
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise StoreError(f"{file}, the lock of {self.path}, is not a plain file: remove it")
            try:
                fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError as e:
                if e.errno not in (errno.EACCES, errno.EAGAIN):
                    os.close(fd)
                    raise StoreError(f"cannot lock {file}, the lock of {self.path} ({_one_line(e)}): write the store on a disk that supports locks") from e
                text = os.pread(fd, 4096, 0).decode(errors="replace")
                os.close(fd)
                raise self._held_by(text) from None
            try:
                same = os.fstat(fd).st_ino == os.stat(file).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # its last holder removed the file as we opened it: lock the new one
        left = os.pread(fd, 4096, 0)
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps(self.owner).encode(), 0)
        self._fd = fd
        info = os.fstat(fd)
        self._key = (info.st_dev, info.st_ino)
        _HELD[self._key] = self
        if left:  # a holder releases by removing the file: this one's ended without (killed)
            warnings.warn(
                # the holder's text is read from the lock file: escaped before it reaches a terminal
                printable(f"{self.path}: its last writer ({_holder(left.decode(errors='replace'))}) ended without releasing "
                "the store's lock (killed?); this run takes the lock over"),
                stacklevel=2,
            )

    def _take_lease(self) -> None:
        fs, inner = url_fs(str(self.file))
        if fs.exists(inner):
            text = fs.cat_file(inner).decode(errors="replace")
            if not self._stale(text):
                raise self._held_by(text)
        self.renew(force=True)
        time.sleep(0.05)  # object stores have no exclusive create: the last writer wins; check it is us
        text = fs.cat_file(inner).decode(errors="replace")
        if {k: json.loads(text).get(k) for k in self.owner} != self.owner:
            self._renewed = 0.0  # not ours to remove
            raise self._held_by(text)

    def _stale(self, text: str) -> bool:
        try:
            lease = json.loads(text)
            expires, now = float(lease["expires"]), time.time()
            # expired, or not a time a holder renewing every minute could have written (NaN, far ahead)
            if not now <= expires <= now + 2 * self.LEASE:
                return True
            return lease["host"] == self.owner["host"] and not _alive(int(lease["pid"]))
        except (ValueError, KeyError, TypeError, OverflowError):
            return True  # not a lease this code wrote

    def renew(self, force: bool = False) -> None:
        """Extend an object-store lease (a no-op on local disks, and when renewed recently)."""
        if not is_url(self.file) or (not force and time.monotonic() - self._renewed < self.RENEW):
            return
        fs, inner = url_fs(str(self.file))
        fs.pipe_file(inner, json.dumps({**self.owner, "expires": time.time() + self.LEASE}).encode())
        self._renewed = time.monotonic()

    def release(self) -> None:
        if self._fd is not None:
            with _HELD_GUARD:
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, 0)  # no owner line left: the next writer sees a clean release
                with contextlib.suppress(OSError):
                    os.unlink(self.file)  # while still held: the next writer locks a new file
                os.close(self._fd)
                _HELD.pop(self._key, None)
                self._fd = None
        elif is_url(self.file) and self._renewed:
            fs, inner = url_fs(str(self.file))
            with contextlib.suppress(OSError, FileNotFoundError):
                fs.rm(inner)
            self._renewed = 0.0


_HELD: dict[tuple[int, int], StoreLock] = {}  # (device, inode) of the lock files this process holds
_HELD_GUARD = threading.Lock()


def _holder(text: str) -> str:
    """Who a lock file's owner line names, for people."""
    try:
        owner = json.loads(text)
        return f"process {int(owner['pid'])} on {owner['host']}, since {owner['started']}"
    except (ValueError, KeyError, TypeError):
        return "another process"


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except (ProcessLookupError, OverflowError, ValueError):
        return False
    except PermissionError:
        return True
    return True
