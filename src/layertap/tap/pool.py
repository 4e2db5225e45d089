"""The copy pool: the memory of the tap's copies, kept from one tap to the next.

A tap copies a value whose memory the network owns (see `layertap.tap.core` for which);
`copy` makes that copy, and its memory comes from here:

- Copies reuse memory. Every copy would otherwise be allocated anew at each forward (680 MB for
  every conv and BN of a resnet50 at batch 8 under inference_mode), memory the allocator may
  hand back and fault in again, whether a tap is kept across batches or made anew per batch
  (``with tap(model, layers) as t: model(x)``). So the pool keeps the buffer of each copy it
  hands out, and hands out another tensor object on the same memory, which it watches (a weak
  reference). Once the caller has dropped that tensor (a tap under ``keep="last"`` replaced it,
  ``clear()`` dropped it, or the tap itself was dropped) the buffer goes to a free list by
  shape, strides, dtype, device and inference mode, unless something else still holds its
  memory (a view, a NumPy array, its storage, an autograd graph, a DLPack capsule, shared
  memory), read from the buffer's own reference counts when it is next needed, not assumed:
  then the pool forgets it, and it is freed with its last holder. A later copy of a tensor
  that fits is written into a free buffer instead of a new one, the first freed first, from
  those freed in the running forward first (what a tap kept across batches replaces, just
  before the copy), else from before it (a tap dropped whole, its values in the order they were
  made): a layer's value lands in the memory of its previous one. A value the caller can still reach is
  never written; it just costs a new copy. Cost: a weak reference and a lock per copy, a few
  reference counts read per buffer handed back.
- Bounded. The free buffers of a device hold at most its limit (`DEFAULT_LIMIT`, 768 MiB: the
  678 MiB of every conv and BN of a resnet50 at batch 8, and some room; `set_limit`); past it
  the oldest are freed. Each forward of a tapped model calls `forward_started`, which frees
  what waited free through a whole forward untaken, so a pool that no forward needs holds
  about one forward's copies, and `clear()` frees them all at once. Handed-out copies are the
  caller's and count against nothing.
- Copies stream past the caches. A pooled buffer is long out of the cache when the next copy
  lands in it, and a plain store reads each line of it from memory before writing it. So a copy
  of 256 KiB or more on the CPU (contiguous or channels-last) is written with streaming stores
  (`layertap._copy`, C, on PyTorch's threads): no read of the buffer, and the network's next
  inputs stay in the cache. Every conv and BN of a resnet50 at batch 8 under inference_mode:
  1.14× a plain forward, against 1.30× with ``copy_`` in the same run. Where the package was
  built without a C compiler, copies use ``copy_``.

Taps in several threads (``nn.DataParallel`` replicas) may copy at once: a lock guards the
free lists, and the weak-reference callbacks, which run wherever the caller lets go, only queue
the buffer for the next call to look at.
"""

from __future__ import annotations

import collections
import sys
import threading
import weakref
from typing import Any

import torch
from torch.autograd import forward_ad

from .. import nested
from ..errors import ArgumentError

try:  # C, optional: without a compiler the package installs without it, and copies use copy_
    from .. import _copy
except ImportError:
    _copy = None  # type: ignore[assignment]

__all__ = ["DEFAULT_LIMIT", "CopyPool", "clear", "copy", "forward_started", "held_bytes", "limit", "release", "set_limit"]

DEFAULT_LIMIT = 768 << 20  # bytes of free buffers per device
_STREAM_BYTES = 1 << 18  # smaller copies stay in the cache, where copy_ is as fast


def _holders(t: torch.Tensor) -> tuple[int, int, int, bool] | None:
    """What may hold ``t`` out of Python's sight: references to its C++ tensor (autograd), to its
    memory (a view, a NumPy array) and to its storage object, and other processes (CPU shared
    memory; a process that sends CUDA memory must keep it, says torch.multiprocessing). None
    where this PyTorch cannot tell (the counts are private API): then nothing is reused."""
    use_count = getattr(torch._C, "_storage_Use_Count", None)
    if use_count is None or not hasattr(t, "_use_count"):
        return None
    storage = t.untyped_storage()
    return t._use_count(), use_count(storage._cdata), sys.getrefcount(storage), t.is_cpu and storage.is_shared()


def _streams(t: torch.Tensor) -> bool:
    """Whether ``t`` is copied with streaming stores (see the module docstring): its bytes are its values."""
    return (
        _copy is not None and t.is_cpu and t.nbytes >= _STREAM_BYTES
        and (t.is_contiguous() or t.is_contiguous(memory_format=torch.channels_last))
        and not (t.is_conj() or t.is_neg() or t.is_quantized)
    )  # fmt: skip


# what the check reads for a buffer nothing else holds, measured, not assumed: the counts differ
# between PyTorch and Python versions
_ALONE = _holders(torch.empty(1))

# what a free buffer is filed under on its device: everything that decides what clone() makes of
# the source (shape, strides, dtype, inference mode, the lazy conjugate and negative bits)
Fit = tuple[torch.Size, tuple[int, ...], torch.dtype, bool, bool, bool]
# a copy handed out: its device and fit, the buffer under it, and the buffer's bytes then
_Lent = tuple[torch.device, Fit, torch.Tensor, int]


class _Device:
    """The free buffers of one device, by fit, the first freed first: those freed since the
    running forward began (fresh), and before (stale)."""

    __slots__ = ("fresh", "held", "limit", "stale")

    def __init__(self, limit: int) -> None:
        self.fresh: dict[Fit, collections.deque[tuple[torch.Tensor, int]]] = {}
        self.stale: dict[Fit, collections.deque[tuple[torch.Tensor, int]]] = {}
        self.held = 0  # bytes
        self.limit = limit

    def take(self, fit: Fit) -> tuple[torch.Tensor, int] | None:
        for free in (self.fresh, self.stale):
            buffers = free.get(fit)
            if buffers:
                buffer = buffers.popleft()
                if not buffers:
                    del free[fit]
                self.held -= buffer[1]
                return buffer
        return None

    def put(self, fit: Fit, base: torch.Tensor, nbytes: int) -> None:
        if nbytes > self.limit:
            return
        self.shrink(self.limit - nbytes)
        self.fresh.setdefault(fit, collections.deque()).append((base, nbytes))
        self.held += nbytes

    def shrink(self, most: int) -> None:
        """Free the oldest buffers until at most ``most`` bytes are held: stale ones first, then
        fresh, the fit first filed first."""
        for free in (self.stale, self.fresh):
            while self.held > most and free:
                fit = next(iter(free))
                buffers = free[fit]
                self.held -= buffers.popleft()[1]
                if not buffers:
                    del free[fit]

    def age(self) -> None:
        self.held -= sum(nbytes for buffers in self.stale.values() for _, nbytes in buffers)
        self.stale, self.fresh = self.fresh, {}


def _device(device: torch.device | str) -> torch.device:
    """``device`` as a tensor on it names it (``"cuda"`` is ``cuda:0`` or the current one)."""
    return torch.empty(0, device=device).device


class CopyPool:
    """Free buffers per device for the tap's copies, and the buffers of the copies handed out
    (see the module docstring). The module's functions use one pool for the whole process."""

    def __init__(self, limit: int = DEFAULT_LIMIT) -> None:
        self._lock = threading.Lock()
        self._limit = _checked(limit)
        self._limits: dict[torch.device, int] = {}  # set per device
        self._devices: dict[torch.device, _Device] = {}
        # the copies handed out (by a weak reference to each), with the buffer under each, and
        # the buffers of those dropped since, for the next call to look at
        self._lent: dict[weakref.ref, _Lent] = {}
        self._returned: collections.deque[_Lent] = collections.deque()
        # the callers of forward_started since the pool last aged its buffers (by id: a tap is
        # a Mapping, so unhashable), weakly
        self._starts: dict[int, weakref.ref] = {}

        def dropped(ref: weakref.ref, pop: Any = self._lent.pop, push: Any = self._returned.append) -> None:
            # runs wherever the caller let go, in any thread, even inside this pool's own calls:
            # no lock, and the buffer is looked at later, once the copy is gone for good
            entry = pop(ref, None)
            if entry is not None:
                push(entry)

        self._dropped = dropped

    def copy(self, t: torch.Tensor) -> torch.Tensor:
        """The tap's own copy of ``t``, whose memory the network owns: what ``t.clone()`` makes
        (shape, strides, dtype, device; an inference tensor under inference_mode), in a free
        buffer that fits if there is one."""
        # a subclass, a tensor in a graph (forward-mode AD's too: a dual tensor), a nested,
        # sparse or quantized one: cloned, never pooled
        if (
            type(t) is not torch.Tensor or t.requires_grad or t.is_nested or t.layout != torch.strided
            or t.is_quantized or forward_ad.unpack_dual(t).tangent is not None
        ):  # fmt: skip
            return t.clone()
        fit = (t.shape, t.stride(), t.dtype, torch.is_inference_mode_enabled(), t.is_conj(), t.is_neg())
        device = t.device
        buffer = None
        if _ALONE is not None:
            with self._lock:
                if self._returned:
                    self._take_back()
                free = self._devices.get(device)
                if free is not None:
                    buffer = free.take(fit)
        if buffer is not None:
            base, nbytes = buffer
            if _streams(t):
                _copy.copy(base.data_ptr(), t.data_ptr(), t.nbytes, torch.get_num_threads())
            else:
                base.copy_(t)
        elif _streams(t):
            base = torch.empty_like(t)  # dense: the strides clone() gives
            _copy.copy(base.data_ptr(), t.data_ptr(), t.nbytes, torch.get_num_threads())
        else:
            base = t.clone()
        if _ALONE is None:  # no telling who holds it: it is the caller's alone
            return base
        if buffer is None:
            nbytes = base.untyped_storage().nbytes()
        out = base.detach()  # the same memory, not a view: the pool keeps base, and watches out
        self._lent[weakref.ref(out, self._dropped)] = (device, fit, base, nbytes)
        return out

    def release(self, values: list[Any]) -> None:
        """Drop the values in ``values``, the caller's last references to them (the list is
        emptied), each tensor in the order the tap made them: the first leaf of a nested value
        is freed first, so each leaf of the next value that fits lands in its own memory
        (dropping a value any other way is as safe, but its leaves may swap buffers)."""
        leaves = nested.tensors(values)
        values.clear()  # the containers go, and what else held only through them
        leaves.reverse()
        while leaves:
            leaves.pop()  # the first one first; those the caller holds elsewhere stay

    def _take_back(self) -> None:
        """File the buffers of the copies dropped since the last call, those that nothing else
        holds (under the lock)."""
        while self._returned:
            device, fit, base, nbytes = self._returned.popleft()
            # else forgotten, freed with its last holder; or its storage was resized meanwhile
            if _holders(base) == _ALONE and base.untyped_storage().nbytes() == nbytes:
                self._free(device).put(fit, base, nbytes)

    def _free(self, device: torch.device) -> _Device:
        free = self._devices.get(device)
        if free is None:
            free = self._devices[device] = _Device(self._limits.get(device, self._limit))
        return free

    def forward_started(self, caller: Any = None) -> None:
        """A forward of a tapped model begins: free what waited free through a whole forward
        untaken. ``caller`` (a tap, weakly referenced) tells taps of one forward apart from
        forwards: the pool ages once a caller comes again, or one that came is gone. Without
        one, every call ages the pool."""
        with self._lock:
            if self._returned:
                self._take_back()
            starts = self._starts
            if caller is None or id(caller) in starts or any(ref() is None for ref in starts.values()):
                for free in self._devices.values():
                    free.age()
                starts.clear()
            if caller is not None:
                starts[id(caller)] = weakref.ref(caller)

    def set_limit(self, nbytes: int, device: torch.device | str | None = None) -> None:
        """Keep at most ``nbytes`` of free buffers on ``device`` (every device: None); 0 keeps none."""
        nbytes = _checked(nbytes)
        with self._lock:
            if device is None:
                self._limit = nbytes
                self._limits.clear()
                devices = list(self._devices.values())
            else:
                key = _device(device)
                self._limits[key] = nbytes
                devices = [self._devices[key]] if key in self._devices else []
            for free in devices:
                free.limit = nbytes
                free.shrink(nbytes)

    def limit(self, device: torch.device | str | None = None) -> int:
        """The bytes of free buffers kept at most on ``device`` (by default: None)."""
        return self._limit if device is None else self._limits.get(_device(device), self._limit)

    def held_bytes(self, device: torch.device | str | None = None) -> int:
        """The bytes of free buffers held now on ``device`` (every device: None)."""
        with self._lock:
            if self._returned:
                self._take_back()
            if device is None:
                return sum(free.held for free in self._devices.values())
            free = self._devices.get(_device(device))
            return 0 if free is None else free.held

    def clear(self) -> None:
        """Free every free buffer now; copies still handed out come back when dropped."""
        with self._lock:
            self._returned.clear()
            for free in self._devices.values():
                free.shrink(0)


def _checked(nbytes: int) -> int:
    if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes < 0:
        raise ArgumentError(f"a pool limit is a number of bytes >= 0, not {nbytes!r}: e.g. set_limit(1 << 30)")
    return nbytes


# one pool for the process: every tap draws from it
_POOL = CopyPool()
copy = _POOL.copy
release = _POOL.release
forward_started = _POOL.forward_started
set_limit = _POOL.set_limit
limit = _POOL.limit
held_bytes = _POOL.held_bytes
clear = _POOL.clear
