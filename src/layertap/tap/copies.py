"""The tap's copies of values whose memory the network owns, made by the process's copy pool.

A value the tap keeps that shares memory with the network's own activation is copied where a
later in-place op may change it (see `layertap.tap.inplace`). The copy comes from
`layertap.tap.pool`, which outlives the tap: a layer's value lands in the memory of one dropped
before, whether the tap is kept across batches or made anew per batch, and copies of 256 KiB or
more on the CPU are written with streaming stores. The tap's share of that is small:

- each forward of its model ages the pool (`forward_started`), so that what waited a whole
  forward untaken is freed;
- a value it drops goes back first, in the order its leaves were made (`drop`): under
  ``keep="last"`` the value a call replaces is dropped before the new one is copied, and
  ``clear()`` drops them all, so that each new copy can take its predecessor's memory. A value
  the caller still holds is never written; it just costs a new copy.
"""

from __future__ import annotations

from typing import Any

import torch

from . import pool


class Copies:
    """One tap's side of the copy pool: its forwards, its copies and the values it drops."""

    __slots__ = ("__weakref__",)  # the pool tells forwards apart by their taps, weakly

    def forward_started(self) -> None:
        pool.forward_started(self)

    def copy(self, out: torch.Tensor) -> torch.Tensor:
        """The tap's own copy of ``out`` (what ``out.clone()`` makes), in pooled memory if some fits."""
        return pool.copy(out)

    def drop(self, values: list[Any]) -> None:
        """Drop ``values``, the tap's last references to them (the list is emptied), first leaf first."""
        pool.release(values)
