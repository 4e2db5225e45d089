"""Many processes, one job: which process this is under ``torchrun``, and the few collectives
that dataset extraction needs to share one store among them.

``torchrun --nproc-per-node N [--nnodes M ...]`` starts every process with ``RANK``,
``WORLD_SIZE``, ``LOCAL_RANK`` and a rendezvous address in its environment. `job` reads them,
initialises the default process group when the user has not (NCCL when the job runs on CUDA
devices, Gloo on the CPU) and takes it down again afterwards; outside a launcher it is one
process of one, and every collective is a plain call.

>>> from layertap.distributed import job
>>> with job() as procs:                       # no launcher: one process
...     procs.rank, procs.world, procs.share(lambda: "made on rank 0")
(0, 1, 'made on rank 0')
"""

from __future__ import annotations

import contextlib
import datetime
import itertools
import os
import pickle
from collections.abc import Callable, Iterator
from typing import Any, TypeVar

import torch
from torch import nn

from .errors import ArgumentError, RankFailedError

T = TypeVar("T")


def launched() -> tuple[int, int, int]:
    """``(rank, world size, local rank)`` from a running process group, else from the launcher's
    environment (``torchrun`` sets ``RANK``, ``WORLD_SIZE`` and ``LOCAL_RANK``), else ``(0, 1, 0)``."""
    local = int(os.environ.get("LOCAL_RANK", "0"))
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), local
    return int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1")), local


def rank_device(device: torch.device | str | None, local_rank: int, world: int) -> torch.device | str | None:
    """The device for this process: a bare ``"cuda"`` means this process's own GPU,
    ``cuda:LOCAL_RANK``, when several processes run (one per GPU, as ``torchrun`` starts them)."""
    if device is None or world == 1:
        return device
    device = torch.device(device)
    if device.type != "cpu" and device.index is None:
        return torch.device(device.type, local_rank)
    return device


def tensor_parallel_ranks(model: nn.Module, fsdp: bool = False) -> list[int] | None:
    """The global ranks of this process's tensor-parallel group (``parallelize_module``), in mesh
    order, from the device mesh of ``model``'s DTensor parameters; None for a model with none.
    They compute the same values. ``fsdp=True`` counts FSDP2's shard group too
    (`torch.distributed.fsdp.fully_shard`), whose forwards all-gather the parameters, so that
    every rank of it must run every forward: extraction has such a group read the same batches.
    """
    dist = torch.distributed
    if not dist.is_available():
        return None
    from torch.distributed.fsdp import FSDPModule
    from torch.distributed.tensor import DTensor

    sharded = set() if fsdp else {id(p) for m in model.modules() if isinstance(m, FSDPModule) for p in m.parameters()}
    meshes = {p.device_mesh for p in model.parameters() if isinstance(p, DTensor) and id(p) not in sharded}
    if not meshes:
        return None
    mesh = next(iter(meshes))
    if len(meshes) > 1 or mesh.ndim != 1:
        raise ArgumentError(
            f"the model's DTensor parameters lie on {len(meshes)} device meshes ({mesh.ndim}-D): extraction takes one "
            "1-D tensor-parallel mesh; parallelize the model over one mesh dimension, e.g. mesh['tp']"
        )
    return [int(r) for r in mesh.mesh.flatten().tolist()]


class Processes:
    """This process among the ``world`` processes of a job, with object collectives over them.

    The collectives carry small Python objects (settings, lists of chunks, errors), never features:
    every process writes its own features to the shared store. A tensor-parallel model
    (`tensor_parallel`) makes groups of processes one data-parallel reader: ``dp_rank`` of
    ``dp_world``, where only the group's first process ``writes``.
    """

    def __init__(self, rank: int = 0, world: int = 1) -> None:
        self.rank, self.world = rank, world
        self.tp_ranks = [rank]  # this process's tensor-parallel group (global ranks): itself alone
        self.dp_rank, self.dp_world, self.writes = rank, world, True

    @property
    def main(self) -> bool:
        """Whether this is rank 0, the process that creates, checks and finishes shared things."""
        return self.rank == 0

    @property
    def with_main(self) -> bool:
        """Whether this process is in rank 0's tensor-parallel group (rank 0 included): its
        forwards must run with rank 0's, whose collectives need every rank of the group."""
        return 0 in self.tp_ranks

    def tensor_parallel(self, ranks: list[int] | None) -> None:
        """Take this process's tensor-parallel group (global ``ranks``; None: none) into account:
        the groups, gathered from every process, must be disjoint and cover the job. Each group
        reads the batches of one data-parallel rank; its first process writes them."""
        groups = self.gather(list(ranks) if ranks else [self.rank])
        for r, group in enumerate(groups):
            if r not in group or any(not 0 <= p < self.world or groups[p] != group for p in group):
                raise ArgumentError(
                    f"rank {r} of {self.world} is in tensor-parallel group {group}, but {[groups[p] for p in group if 0 <= p < self.world]} "
                    "is what those ranks say: the tensor-parallel groups must be disjoint and cover the job (one mesh "
                    "dimension of init_device_mesh over all processes)"
                )
        firsts = sorted({g[0] for g in groups})
        self.tp_ranks = groups[self.rank]
        self.dp_rank, self.dp_world, self.writes = firsts.index(self.tp_ranks[0]), len(firsts), self.tp_ranks[0] == self.rank

    def gather(self, value: Any) -> list[Any]:
        """Every process's ``value``, by rank, on every process."""
        if self.world == 1:
            return [value]
        values: list[Any] = [None] * self.world
        torch.distributed.all_gather_object(values, value)
        return values

    def share(self, make: Callable[[], T], *, peers: bool = False) -> T:
        """``make()`` run on rank 0 only; its result (or its error) reaches every process.

        The other processes wait for it, so this is also a barrier. ``peers=True``: rank 0's
        tensor-parallel peers run ``make()`` with it (a forward needs them all); theirs is dropped.
        """
        if self.world == 1:
            return make()
        box: list[Any] = [None]
        error = None
        if self.main or (peers and self.with_main):
            try:
                box[0] = ("ok", make())
            except BaseException as e:
                error, box[0] = e, ("error", _portable(e))
        try:
            torch.distributed.broadcast_object_list(box, src=0)
        except BaseException as e:
            if error is not None:
                raise error from e
            raise self._failed(e) from e
        status, value = box[0]
        if error is not None:
            raise error
        if status == "error":
            raise value
        return value

    def together(self, work: Callable[[], T]) -> T:
        """Run ``work()`` on every process, then wait until all are done.

        A process whose work fails says so to the others (through the launcher's store) and
        raises at once, without waiting: under ``torchrun`` its exit stops the job. A process
        that then finds a peer gone raises `RankFailedError` with that peer's error.
        """
        if self.world == 1:
            return work()
        try:
            result = work()
        except BaseException as e:
            with contextlib.suppress(Exception):  # best effort: the error itself matters more
                _store().set(_FAILED, f"rank {self.rank} of {self.world}: {type(e).__name__}: {e}")
            raise
        try:
            self.gather(None)
        except BaseException as e:
            raise self._failed(e) from e
        return result

    def _failed(self, error: BaseException) -> BaseException:
        """What to raise when a collective broke: the failure a peer posted, if any, else ``error``."""
        with contextlib.suppress(Exception):
            store = _store()
            if store.check([_FAILED]):
                said = store.get(_FAILED).decode()
                return RankFailedError(f"{said}; the whole chunks written so far are kept: fix the cause and run again to resume")
        return error


_FAILED = "layertap/failed"


def _store() -> Any:
    """The key-value store that the launcher's rendezvous gave the default process group."""
    return torch.distributed.distributed_c10d._get_default_store()


def _portable(error: BaseException) -> BaseException:
    """``error`` if it can travel to other processes (pickled), else a `RankFailedError` saying it."""
    try:
        pickle.loads(pickle.dumps(error))
        return error
    except Exception:
        return RankFailedError(f"rank 0 failed: {type(error).__name__}: {error}")


# how long a process waits for the others: at the end, the first to finish waits for the slowest
TIMEOUT = datetime.timedelta(hours=6)
# the jobs this process made a group for: each group's keys get their own prefix in the launcher's
# store, since a group made again would find the old one's (Gloo would connect to dead addresses)
_groups = itertools.count()


@contextlib.contextmanager
def job(device: torch.device | str | None = None, *, together: bool = True) -> Iterator[Processes]:
    """This process's place in the job, for the duration of the block.

    Under a launcher (``WORLD_SIZE`` > 1) with no process group yet, one is initialised from the
    environment (``env://``) with NCCL when ``device`` is a CUDA device, else Gloo, and destroyed
    at the end of the block; a group the user initialised is used as it is and left alone.
    ``together=False``: this process works alone, whatever the environment says.
    """
    if not together:
        yield Processes()
        return
    rank, world, local = launched()
    dist = torch.distributed
    ours = world > 1 and not (dist.is_available() and dist.is_initialized())
    if ours:
        if not dist.is_available():
            raise RuntimeError(f"WORLD_SIZE={world} asks for {world} processes, but this PyTorch has no torch.distributed")
        cuda = device is not None and torch.device(device).type == "cuda"
        if cuda:
            torch.cuda.set_device(local)  # NCCL's object collectives run on the current device
        store, _, _ = next(dist.rendezvous("env://", rank, world, timeout=TIMEOUT))
        store = dist.PrefixStore(f"layertap/job{next(_groups)}", store)
        dist.init_process_group(backend="nccl" if cuda else "gloo", store=store, rank=rank, world_size=world, timeout=TIMEOUT)
    try:
        yield Processes(rank, world)
    finally:
        if ours:
            dist.destroy_process_group()


__all__ = ["Processes", "job", "launched", "rank_device", "tensor_parallel_ranks"]
