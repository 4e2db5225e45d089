"""Files written whole or not at all: the report page on a full disk, and `layertap.atomic`.

A full disk is made two ways. The kernel's own limit on a file's size (``RLIMIT_FSIZE``) makes
every write past it fail, whatever code writes (``EFBIG``, the error a full disk gives but for
its number); and `FullDisk` makes the writes into one folder fail with ``ENOSPC`` itself, for
the message.
"""

from __future__ import annotations

import contextlib
import errno
import os
import resource
import signal

import pytest
import torch

import layertap
from layertap.atomic import AppendLog, AtomicFile, write_atomic
from layertap.cli import run
from layertap.errors import OutputError
from layertap.report import build_report


@contextlib.contextmanager
def file_size_limit(nbytes: int):
    """No file of this process grows past ``nbytes`` in the block: the write that would is cut
    there, and the next fails (the kernel's ``RLIMIT_FSIZE``; its signal is ignored)."""
    old = resource.getrlimit(resource.RLIMIT_FSIZE)
    handler = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (nbytes, old[1]))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, old)
        signal.signal(signal.SIGXFSZ, handler)


class FullDisk:
    """The disk of ``folder`` has ``room`` bytes left: writes to files in it, through
    ``os.write`` or the file objects of ``os.fdopen``, fit up to that, then fail with ENOSPC."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, folder: os.PathLike[str], room: int) -> None:
        self.folder, self.room = os.fspath(folder) + os.sep, room
        real_write, real_fdopen = os.write, os.fdopen

        def write(fd: int, data) -> int:
            if not self.holds(fd):
                return real_write(fd, data)
            return real_write(fd, bytes(memoryview(data)[: self.take(len(data))]))

        def fdopen(fd: int, *args, **kwargs):
            file = real_fdopen(fd, *args, **kwargs)
            return Filling(file, self) if self.holds(fd) else file

        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(os, "fdopen", fdopen)

    def holds(self, fd: int) -> bool:
        try:
            return os.readlink(f"/proc/self/fd/{fd}").startswith(self.folder)
        except OSError:
            return False

    def take(self, n: int) -> int:
        """How many of ``n`` bytes fit; none fit: ENOSPC."""
        if self.room == 0:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        fits = min(n, self.room)
        self.room -= fits
        return fits


class Filling:
    """A file object on a `FullDisk`: what fits is written, then ENOSPC."""

    def __init__(self, file, disk: FullDisk) -> None:
        self._file, self._disk = file, disk

    def write(self, data) -> int:
        fits = self._disk.take(len(data))
        self._file.write(bytes(memoryview(data)[:fits]))
        if fits < len(data):
            self._file.flush()
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return fits

    def __getattr__(self, name: str):
        return getattr(self._file, name)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """A small labelled store: 60 samples of a linear layer."""
    path = tmp_path_factory.mktemp("store") / "s.zarr"
    data = torch.utils.data.TensorDataset(torch.randn(60, 5), torch.arange(60) % 3)
    layertap.extract_dataset(torch.nn.Sequential(torch.nn.Linear(5, 3)), data, ["0"], path, progress=False)
    return path


@pytest.fixture
def old_page(tmp_path):
    """A report already there, bigger than what the full disk lets through."""
    out = tmp_path / "site" / "report.html"
    out.parent.mkdir()
    out.write_bytes(b"<html><p>the old report</p></html>\n" * 4000)  # 140 KB
    return out, out.read_bytes()


def test_report_on_a_full_disk_keeps_the_old_page(store, old_page, capsys):
    """The case: `report` cut the existing page to what fitted and said ``[Errno 27/28]`` only."""
    out, before = old_page
    with file_size_limit(8 << 10):
        code = run(["report", str(store), "--out", str(out), "--no-progress"])
    err = capsys.readouterr().err
    assert code == 1
    assert err.count("\n") == 1 and err.startswith(f"layertap: error: cannot write the report {out}: ")
    assert "(the old one is left as it was)" in err
    assert out.read_bytes() == before
    assert os.listdir(out.parent) == ["report.html"]  # no temporary file left behind


def test_enospc_is_named_with_the_file(store, old_page, monkeypatch):
    out, before = old_page
    FullDisk(monkeypatch, out.parent, room=10_000)
    with pytest.raises(OutputError) as caught:
        build_report(store, out, progress=False)
    assert str(caught.value) == f"cannot write the report {out}: the disk is full (the old one is left as it was)"
    assert out.read_bytes() == before and os.listdir(out.parent) == ["report.html"]


def test_a_report_is_written_whole_and_replaces_the_old(store, old_page):
    out, _ = old_page
    os.chmod(out, 0o640)
    assert build_report(store, out, progress=False) == out
    page = out.read_text()
    assert page.startswith("<!DOCTYPE html>") and page.rstrip().endswith("</html>")
    assert os.stat(out).st_mode & 0o777 == 0o640  # the old file's permissions stay
    assert os.listdir(out.parent) == ["report.html"]


def test_bad_report_paths_are_refused_before_the_work(store, tmp_path, monkeypatch):
    folder = tmp_path / "folder.html"
    folder.mkdir()
    victim = tmp_path / "victim.html"
    victim.write_text("keep me")
    (tmp_path / "link.html").symlink_to(victim)
    monkeypatch.setattr("layertap.report.Context", None)  # the work would fail: it never starts
    with pytest.raises(OutputError, match=r"^cannot write the report .*folder\.html: it is a folder; name a file$"):
        build_report(store, folder, progress=False)
    with pytest.raises(OutputError, match=r"^cannot write the report .*link\.html: it is a symbolic link"):
        build_report(store, tmp_path / "link.html", progress=False)
    assert victim.read_text() == "keep me"


def test_atomic_file_on_a_full_disk(tmp_path, monkeypatch):
    target = tmp_path / "f.bin"
    target.write_bytes(b"old")
    FullDisk(monkeypatch, tmp_path, room=5)
    with pytest.raises(OutputError, match=r"f\.bin: the disk is full \(the old one is left as it was\)$"):
        write_atomic(target, b"0123456789", "the file")
    assert target.read_bytes() == b"old" and os.listdir(tmp_path) == ["f.bin"]
    out = AtomicFile(tmp_path / "new.bin")  # a file not yet there: nothing is left of it
    with pytest.raises(OutputError, match=r"new\.bin: the disk is full$"):
        out.write(b"x" * 10)
    assert os.listdir(tmp_path) == ["f.bin"]


def test_append_log_appends_whole_pieces_or_nothing(tmp_path, monkeypatch):
    path = tmp_path / "log.txt"
    log = AppendLog(path)
    log.write(b"one\n")
    FullDisk(monkeypatch, tmp_path, room=3)  # the next piece half fits
    with pytest.raises(OutputError, match=r"log\.txt: the disk is full$"):
        log.write(b"two\n")
    log.close()
    assert path.read_bytes() == b"one\n"  # the cut piece was taken off again


def test_append_log_never_follows_a_link(tmp_path):
    victim = tmp_path / "victim"
    victim.write_text("keep me")
    (tmp_path / "log").symlink_to(victim)
    with pytest.raises(OutputError, match=r"log: it is a symbolic link, and layertap writes no file through a link"):
        AppendLog(tmp_path / "log")
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    with pytest.raises(OutputError, match=r"fifo: it is not a regular file; name a file$"):
        AppendLog(fifo)  # refused at once: opening a FIFO to write would wait for a reader
    assert victim.read_text() == "keep me"
