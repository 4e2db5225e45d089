"""The DataLoader worker processes that layertap starts: how many by default, and that they end with their parent.

Worker processes end with their parent. On Linux each DataLoader worker that layertap starts
asks the kernel to kill it when the process that started it dies (``PR_SET_PDEATHSIG``), so an
extraction killed with ``kill -9`` leaves no worker behind holding memory or the store's lock
(torch's own check notices only between samples, and a worker can block at exit on a full pipe).
A ``worker_init_fn`` of your DataLoader still runs, after that.

Kept apart from `layertap.data`, which says what the batches are: this is process handling only.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import sys
from collections.abc import Callable

_PR_SET_PDEATHSIG = 1  # from <linux/prctl.h>


def _ended(pid: int) -> bool:
    """Whether process ``pid`` has ended: gone, or a zombie not yet reaped (Linux's /proc)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rpartition(b")")[2].split()[0] in (b"Z", b"X")
    except (OSError, IndexError):
        return True


class EndWithParent:
    """A DataLoader ``worker_init_fn``: the worker is killed when the process that made the loader
    dies (Linux), then the loader's own ``worker_init_fn``, if any, runs."""

    def __init__(self, then: Callable[[int], None] | None) -> None:
        self.then = then
        self.parent = os.getpid()  # made where the loader is iterated, which starts the workers

    def __call__(self, worker_id: int) -> None:
        if sys.platform == "linux":
            with contextlib.suppress(OSError, AttributeError):  # no prctl (another libc): torch's own check remains
                ctypes.CDLL(None).prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
            # the parent may have died before the signal was asked for; a forkserver parent is not it
            if os.getppid() != self.parent and _ended(self.parent):
                os._exit(1)
        if self.then is not None:
            self.then(worker_id)


def default_workers(files: bool) -> int:
    # decoding image files is the slow part of a data pipeline: give it processes
    return min(4, max(1, (os.cpu_count() or 2) - 1)) if files else 0


__all__ = ["EndWithParent", "default_workers"]
