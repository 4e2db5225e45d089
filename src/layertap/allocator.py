"""The C allocator: keep the memory of freed activations for the next forward, instead of
handing it back to the kernel and faulting it in again.

The problem: on the CPU every tensor comes from the C library's ``malloc``. A resnet50 forward
at batch 8 allocates and frees about 0.7 GB of activations, many of them tens of MB. glibc
serves a large block by ``mmap`` and unmaps it when freed, and it hands the free top of its
heap back to the kernel (*trims* it) beyond a threshold; either way the next forward gets the
same memory from the kernel again and pays a page fault for every 4 KiB it touches. glibc's
thresholds adapt at run time, but not enough: such a forward still takes 30 000-80 000 minor
page faults, every time.

The rule: a program that owns its process calls `tune_allocator` once, first thing. On glibc
it sets, through ``mallopt``:

- ``M_MMAP_THRESHOLD`` to 32 MiB, the most glibc accepts on 64-bit (half its heap size):
  smaller blocks come from the heap and are reused. A fixed value also turns the adaptive
  thresholds off;
- ``M_TRIM_THRESHOLD`` to 1 GiB: up to that much free memory at the top of the heap is kept.

Both are needed: either one alone turns the adaptive thresholds off and leaves the other at its
small default, and a forward then faults 2-4 times *more* than by default. ``M_TOP_PAD`` is
left alone: a heap that is no longer trimmed grows to its peak once. Elsewhere (macOS, Windows,
musl) `tune_allocator` does nothing and says so. The library never calls it by itself: the
settings are the whole process's, for good. The ``layertap`` command calls it for ``extract``,
``stats``, ``cam`` and ``report``, unless ``LAYERTAP_ALLOCATOR=default`` is set.

The cost: freed memory stays resident, up to the process's peak; the peak itself does not grow
(0.93 GB for a resnet50 forward either way). The gain, resnet50, batch 8, 224 px, on a 2-core
CPU (the best forward of alternating fresh processes, 7 forwards each): 0.42 s by default,
0.35 s tuned with 2 threads (0.75 and 0.68 s with one); the 0.07-0.13 s of kernel time and
30 000-80 000 page faults of each forward fell to none.

>>> from layertap.allocator import tune_allocator
>>> tuning = tune_allocator()  # once, first thing in a program that owns its process
>>> tune_allocator() == tuning  # calling it again changes nothing
True
>>> print(tuning)  # doctest: +SKIP
glibc 2.36: mmap threshold 32 MiB, trim threshold 1024 MiB

`HeapTrimmer` does the opposite on purpose, where a long run would otherwise creep up (dataset
extraction, see `layertap.extract`).
"""

from __future__ import annotations

import ctypes
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import ArgumentError

# mallopt's parameters, from glibc's malloc.h
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3

# glibc refuses a larger mmap threshold: HEAP_MAX_SIZE / 2 (32 MiB on 64-bit, 512 KiB on 32-bit)
MAX_MMAP_THRESHOLD = (32 << 20) if ctypes.sizeof(ctypes.c_void_p) == 8 else (512 << 10)
TRIM_THRESHOLD = 1 << 30
_INT_MAX = (1 << 31) - 1  # mallopt takes an int


@dataclass(frozen=True)
class AllocatorTuning:
    """What `tune_allocator` did: ``applied`` is false where the C library is not glibc, and
    ``reason`` then says why; the thresholds are in bytes."""

    applied: bool
    mmap_threshold: int | None = None
    trim_threshold: int | None = None
    reason: str = ""

    def __str__(self) -> str:
        if not self.applied:
            return f"allocator not tuned: {self.reason}"
        assert self.mmap_threshold is not None and self.trim_threshold is not None
        return f"{self.reason}: mmap threshold {self.mmap_threshold >> 20} MiB, trim threshold {self.trim_threshold >> 20} MiB"


def _glibc() -> Any:
    """The C library if it is glibc, else None (macOS, Windows and musl have no such ``mallopt``)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.gnu_get_libc_version.restype = ctypes.c_char_p
        libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
    except (OSError, AttributeError):  # no libc.so.6, or one without glibc's functions
        return None
    return libc


def tune_allocator(mmap_threshold: int = MAX_MMAP_THRESHOLD, trim_threshold: int = TRIM_THRESHOLD) -> AllocatorTuning:
    """Make glibc keep freed memory for reuse: for the whole process, and for good.

    Call it once, first thing, in a program that owns its process (a script, a training or
    extraction job; the ``layertap`` command does). Calling it again with the same values
    changes nothing. On other C libraries it does nothing, raises nothing, and returns
    ``applied=False`` with the reason.

    Args:
        mmap_threshold: blocks of this many bytes or more get their own ``mmap`` (unmapped when
            freed); smaller ones come from the heap. At most `MAX_MMAP_THRESHOLD`, 32 MiB.
        trim_threshold: free memory at the top of the heap is given back to the kernel only
            beyond this many bytes (at most 2 GiB - 1).

    Returns:
        What was applied.

    Raises:
        ArgumentError: a threshold outside the range glibc accepts, before anything is changed.

    >>> tune_allocator(mmap_threshold=64 << 20)
    Traceback (most recent call last):
      ...
    layertap.errors.ArgumentError: mmap_threshold=67108864: glibc accepts 1 to 33554432 bytes (32 MiB)
    """
    if not 0 < mmap_threshold <= MAX_MMAP_THRESHOLD:
        raise ArgumentError(f"mmap_threshold={mmap_threshold}: glibc accepts 1 to {MAX_MMAP_THRESHOLD} bytes ({MAX_MMAP_THRESHOLD >> 20} MiB)")
    if not 0 <= trim_threshold <= _INT_MAX:
        raise ArgumentError(f"trim_threshold={trim_threshold}: give 0 to {_INT_MAX} bytes (2 GiB - 1)")
    libc = _glibc()
    if libc is None:
        return AllocatorTuning(False, reason=f"the C library is not glibc ({sys.platform})")
    version = f"glibc {libc.gnu_get_libc_version().decode()}"
    if not libc.mallopt(M_MMAP_THRESHOLD, mmap_threshold):
        return AllocatorTuning(False, reason=f"{version} refused M_MMAP_THRESHOLD={mmap_threshold}")
    if not libc.mallopt(M_TRIM_THRESHOLD, trim_threshold):
        return AllocatorTuning(False, reason=f"{version} refused M_TRIM_THRESHOLD={trim_threshold}")
    return AllocatorTuning(True, mmap_threshold, trim_threshold, version)


class HeapTrimmer:
    """Hands the C heap's free memory back to the system (glibc's ``malloc_trim``; elsewhere a
    no-op) after every ``every`` bytes of data that went through a caller.

    In dataset extraction, batches of features are allocated by the model's thread and freed by
    the writer's, among the codec's buffers; glibc keeps such freed memory, fragmented, and the
    process would creep up to a plateau well above its working size. A trim costs a few ms and
    holds the heap's lock, so it is done per amount of data, not per batch (Dask's workers trim
    the same way). After `tune_allocator` a trim also hands back the model's free activations,
    which the next forward faults in again: with large features (an unreduced early layer,
    16 MB or more a batch) that is once a batch, and most of the tuning's gain is lost there.
    """

    EVERY = 16 << 20

    def __init__(self, every: int = EVERY) -> None:
        self.every = every
        self.since = 0
        libc = _glibc()
        self.trim: Callable[[int], Any] | None = libc.malloc_trim if libc is not None else None

    def __call__(self, nbytes: int) -> None:
        """Count ``nbytes`` more; trim if `every` bytes went through since the last trim."""
        self.since += nbytes
        if self.trim is not None and self.since >= self.every:
            self.trim(0)
            self.since = 0


__all__ = ["tune_allocator", "AllocatorTuning", "MAX_MMAP_THRESHOLD", "TRIM_THRESHOLD", "HeapTrimmer"]
