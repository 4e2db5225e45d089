"""Fingerprints: how a resumed extraction proves that it computes what the store was written with.

Two kinds, both recorded in a store and checked before a resumed run adds to it:

- **The computation** (`model_fingerprint`, `code_fingerprint`): a SHA-256 over everything that
  decides the features besides the data: every tensor of the model's state, parameters and
  buffers, persistent or not, hashed whole; the module tree with each module's class, its
  ``extra_repr()``, its training flag and its other public attributes; and the code of the
  callables that transform the inputs or reduce the features: their code objects (bytecode,
  constants, names), defaults, closure values, the globals they name, and the attributes of
  callable objects (a torchvision ``Compose`` of ``Lambda``s, a ``functools.partial``),
  recursively. Nothing of it is a memory address or a device, so every process of a job,
  and a run tomorrow, gets the same fingerprint for the same computation.
- **The samples** (`batch_digests`): a store's settings name its samples (their ids), but a
  file can be replaced under the same name. So every chunk's completion marker records a
  short digest of each of its samples' inputs, and a resumed run recomputes the digests of
  the chunks already written before adding to them; the first sample that differs stops it.

  - Image files (a folder): the digest of the file's bytes. Checking needs no decoding, only a
    read: cheap next to the forward passes of the chunks still to do.
  - Any other data (tensors, arrays, Datasets, streams): the digest of the sample's row of the
    collated batch (every input tensor and the label), as the model received it.

  A digest is 16 hex digits of SHA-256: two different samples get the same by chance with odds
  of about 1 in 10^19.

What no fingerprint sees (an edited ``forward``, another library version or kernel) is caught
by recomputing a written batch on resume (see `layertap.extract`).

>>> import torch
>>> from layertap.data import open_data
>>> source = open_data(torch.arange(6.0).reshape(3, 2), batch_size=3)
>>> digests = batch_digests(source, next(source.batches()))
>>> len(digests), digests[0] != digests[1]
(3, True)
>>> code_fingerprint(lambda t: t.mean(0)) == code_fingerprint(lambda t: t.amax(0))
False
"""

from __future__ import annotations

import contextlib
import enum
import functools
import hashlib
import io
import logging
import os
import random
import re
import threading
import types
import weakref
from collections.abc import Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from ..data import Batch, DataSource
from ..errors import ArgumentError, DataChangedError
from ..records import SkippedSample

# ----------------------------------------------------------------------- the computation
MAX_DEPTH = 24  # objects nested deeper are described by their class only
_PLAIN = (type(None), bool, int, float, complex, str, bytes)
# what a function may name without computing with it: known by their class, not their state
# (a logger's state, for one, is every logger of the process)
_ENVIRONMENT = (logging.Logger, logging.Handler, io.IOBase, threading.Thread, os._Environ)
_BUILTIN = (types.BuiltinFunctionType, types.MethodWrapperType, types.WrapperDescriptorType, types.MethodDescriptorType, types.ClassMethodDescriptorType)


def _tensor_bytes(t: torch.Tensor) -> memoryview | bytes:
    """A tensor's values as bytes, whole (a meta tensor has none)."""
    if t.is_meta:
        return b""
    t = t.detach()
    if t.layout != torch.strided:
        t = t.to_dense()
    if t.is_quantized:
        t = t.int_repr()
    flat = t.cpu().contiguous().reshape(-1)
    if flat.is_conj() or flat.is_neg():
        flat = flat.resolve_conj().resolve_neg()
    return flat.view(torch.uint8).numpy().data


class _Hasher:
    """Feeds a description of objects, recursively, into one SHA-256.

    Each part is typed and length-prefixed, so different objects never describe alike; an
    object met again (a cycle, or shared) is fed as a reference to its first visit.
    """

    def __init__(self, parts: bool = False) -> None:
        self.digest = hashlib.sha256()
        # a model's fingerprint in three parts, so that a difference says where it is
        self.parts = {"state": hashlib.sha256(), "tree": self.digest, "code": hashlib.sha256()} if parts else None
        self.seen: dict[int, int] = {}
        self.alive: list[Any] = []  # keeps visited objects alive, so their ids stay theirs
        self.where = ""  # the module tensor being hashed, for an error

    def feed(self, *parts: Any) -> None:
        for part in parts:
            data = part if isinstance(part, (bytes, memoryview)) else str(part).encode()
            self.digest.update(len(data).to_bytes(8, "little"))  # 1-D bytes: len() is the size
            self.digest.update(data)

    def hexdigest(self) -> str:
        if self.parts is not None:
            return ", ".join(f"{part} {digest.hexdigest()[:16]}" for part, digest in self.parts.items())
        return self.digest.hexdigest()[:16]

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Feed what is fed meanwhile into part ``name`` (when the hash has parts)."""
        outer = self.digest
        self.digest = self.parts[name] if self.parts is not None else outer
        try:
            yield
        finally:
            self.digest = outer

    def value(self, obj: Any, depth: int = 0) -> None:
        if self.atom(obj):
            return
        if depth > MAX_DEPTH:
            self.feed("deep", _name(type(obj)))
            return
        if id(obj) in self.seen:
            self.feed("again", self.seen[id(obj)])
            return
        self.seen[id(obj)] = len(self.seen)
        self.alive.append(obj)
        depth += 1
        # the kinds in turn, the first that takes it wins (a Parameter is a tensor, ...)
        if not (self.data(obj, depth) or self.collection(obj, depth)):
            self.other(obj, depth)

    def atom(self, obj: Any) -> bool:
        """Feed a value known by what it is, never met again by reference; whether it was one."""
        if isinstance(obj, _PLAIN):
            self.feed(type(obj).__name__, obj if isinstance(obj, bytes) else repr(obj))
        elif isinstance(obj, (torch.dtype, torch.layout, torch.memory_format, enum.Enum)):
            self.feed(type(obj).__name__, obj)
        elif isinstance(obj, torch.device):  # every process has its own: only the kind counts
            self.feed("device", obj.type)
        else:
            return False
        return True

    def data(self, obj: Any, depth: int) -> bool:
        """Feed tensors, arrays and random states; whether ``obj`` was one."""
        # a lazy module's tensors have no shape and no values yet: their kind
        if isinstance(obj, (nn.parameter.UninitializedParameter, nn.parameter.UninitializedBuffer)):
            self.feed("uninitialized", _name(type(obj)))
        elif isinstance(obj, torch.Tensor):
            self.tensor(obj, depth)
        elif isinstance(obj, random.Random):  # seeded or drawn from: its state, not its (empty) attributes
            self.feed("random", _name(type(obj)), repr(obj.getstate()))
        elif isinstance(obj, torch.Generator):
            self.feed("generator", obj.device.type)
            self.value(obj.get_state(), depth)
        elif isinstance(obj, np.random.Generator):
            self.feed("numpy generator")
            self.value(obj.bit_generator.state, depth)
        elif isinstance(obj, np.random.RandomState):
            self.feed("numpy random state")
            self.value(obj.get_state(legacy=False), depth)
        elif isinstance(obj, np.ndarray):
            if obj.dtype.hasobject:
                self.feed("array", obj.shape)
                self.value(obj.tolist(), depth)
            else:
                self.feed("array", obj.dtype.str, obj.shape, np.ascontiguousarray(obj).reshape(-1).view(np.uint8).data)
        elif isinstance(obj, np.generic):
            self.feed("scalar", obj.dtype.str, obj.tobytes())
        else:
            return False
        return True

    def collection(self, obj: Any, depth: int) -> bool:
        """Feed a list, tuple, dict or set, item by item; whether ``obj`` was one."""
        if isinstance(obj, (list, tuple)):
            self.feed(type(obj).__name__, len(obj))
            for item in obj:
                self.value(item, depth)
        elif isinstance(obj, dict):
            self.feed(type(obj).__name__, len(obj))
            for key, item in obj.items():
                self.value(key, depth)
                self.value(item, depth)
        elif isinstance(obj, (set, frozenset)):  # their order changes with the process's hash seed
            self.feed(type(obj).__name__, *sorted(code_fingerprint(item) for item in obj))
        else:
            return False
        return True

    def other(self, obj: Any, depth: int) -> None:
        """Feed modules, code and callables, classes, and any other object by its attributes."""
        if isinstance(obj, nn.Module):
            self.module(obj, depth)
        elif isinstance(obj, types.FunctionType):
            self.function(obj, depth)
        elif isinstance(obj, types.CodeType):
            self.code(obj, depth)
        elif isinstance(obj, types.MethodType):
            self.feed("method")
            self.value(obj.__func__, depth)
            self.value(obj.__self__, depth)
        elif isinstance(obj, functools.partial):
            self.feed("partial")
            self.value(obj.func, depth)
            self.value(obj.args, depth)
            self.value(obj.keywords, depth)
        elif isinstance(obj, types.ModuleType):
            self.feed("module", obj.__name__)
        elif isinstance(obj, _ENVIRONMENT):
            self.feed("environment", _name(type(obj)))
        elif isinstance(obj, (type, *_BUILTIN)):  # classes and C functions: known by their names
            self.feed(type(obj).__name__, getattr(obj, "__module__", None) if isinstance(obj, _BUILTIN) else "", _name(obj))
        else:
            self.instance(obj, depth)

    def tensor(self, t: torch.Tensor, depth: int) -> None:
        if type(t).__name__ == "DTensor":  # sharded (FSDP2, tensor parallel): the whole tensor, the same on every rank
            t = t.full_tensor()  # type: ignore[attr-defined]
        if t.is_nested:  # its pieces, each whole (a nested tensor has no bytes of its own to read)
            self.feed("nested", t.dtype)
            self.value(list(t.detach().unbind()), depth)
            return
        try:
            data = _tensor_bytes(t)
        except RuntimeError as e:
            raise ArgumentError(
                f"cannot fingerprint {self.where or 'a tensor'} ({t.layout}, {t.dtype}, {type(t).__name__}): its values "
                f"cannot be read ({str(e).splitlines()[0]}), and a store is only resumed for a model whose values are known: "
                "hold it as a plain dense tensor (e.g. .to_dense()) while extracting"
            ) from e
        self.feed("tensor", t.dtype, tuple(t.shape), data)

    def instance(self, obj: Any, depth: int) -> None:
        """Any other object: its class and its attributes (``vars()``, ``__slots__``), else its repr."""
        self.feed("object", _name(type(obj)))
        state = dict(vars(obj)) if hasattr(obj, "__dict__") else {}
        for cls in type(obj).__mro__:
            for slot in getattr(cls, "__slots__", ()):
                if isinstance(slot, str) and slot not in ("__dict__", "__weakref__") and hasattr(obj, slot):
                    state[slot] = getattr(obj, slot)
        if state or hasattr(obj, "__dict__"):
            self.value(state, depth)
        else:  # a C object: its repr, without addresses
            self.feed(re.sub(r"0x[0-9a-fA-F]+", "", repr(obj)))

    def function(self, fn: types.FunctionType, depth: int) -> None:
        """A Python function: its code, defaults, closure values and the globals it names."""
        self.feed("function", fn.__qualname__)
        self.code(fn.__code__, depth)
        self.value(fn.__defaults__, depth)
        self.value(fn.__kwdefaults__, depth)
        for cell in fn.__closure__ or ():
            try:
                self.value(cell.cell_contents, depth)
            except ValueError:  # a cell not filled yet
                self.feed("empty cell")
        names = sorted(n for n in _global_names(fn.__code__) if n in fn.__globals__)
        for name in names:
            self.feed(name)
            self.value(fn.__globals__[name], depth)

    def code(self, code: types.CodeType, depth: int) -> None:
        # not the file or line numbers: moving code does not change what it computes
        self.feed("code", code.co_code, code.co_argcount, code.co_posonlyargcount, code.co_kwonlyargcount, code.co_flags)
        self.feed(*code.co_names, "|", *code.co_varnames, "|", *code.co_freevars, "|", *code.co_cellvars)
        self.value(code.co_consts, depth)

    def module(self, model: nn.Module, depth: int) -> None:
        """A module tree: each module's class, configuration, mode, other attributes, and state."""
        self.feed("module", _name(type(model)))
        for name, module in model.named_modules():
            self.feed(name, _name(type(module)), module.training, module.extra_repr())
            with self.part("code"):
                self.feed(_class_code(type(module)))
            for key, value in vars(module).items():
                # torch's own bookkeeping, and layertap's note of the spec a model was loaded from
                # (the same weights loaded through another spec compute the same values)
                if not key.startswith("_") and key not in ("training", "layertap_info"):
                    self.feed(key)
                    self.value(value, depth)
            for kind, tensors in (("parameter", module._parameters), ("buffer", module._buffers)):
                for key, t in tensors.items():
                    self.where = f"{kind} {'.'.join(filter(None, (name, key)))!r}"
                    with self.part("state"):
                        self.feed(kind, key, key in module._non_persistent_buffers_set)
                        self.value(t, depth)
                    self.where = ""


# class -> (the functions its code was hashed from, the digest): a class edited since (a method
# replaced) is hashed again; holding the functions keeps their ids from being reused
_CLASS_CODE: weakref.WeakKeyDictionary[type, tuple[tuple[Any, ...], str]] = weakref.WeakKeyDictionary()


def _functions(value: Any) -> list[types.FunctionType]:
    """The Python functions a class attribute holds: a function, a static or class method's, a property's."""
    if isinstance(value, (staticmethod, classmethod)):
        value = value.__func__
    parts = (value.fget, value.fset, value.fdel) if isinstance(value, property) else (value,)
    return [f for f in parts if isinstance(f, types.FunctionType)]


def _class_code(cls: type) -> str:
    """A digest of the code of a module's class: the functions in the own ``__dict__`` of each class
    of its MRO up to `nn.Module` (their code objects and defaults), so an edited ``forward`` counts."""
    mro = cls.__mro__
    found = tuple(
        (c, key, f) for c in mro[: mro.index(nn.Module) if nn.Module in mro else len(mro)] for key, value in vars(c).items() for f in _functions(value)
    )
    cached = _CLASS_CODE.get(cls)
    if cached is not None and len(cached[0]) == len(found) and all(a[2] is b[2] for a, b in zip(cached[0], found)):
        return cached[1]
    hasher = _Hasher()
    for c, key, f in found:
        hasher.feed(_name(c), key)
        hasher.code(f.__code__, 0)
        hasher.value(f.__defaults__)
        hasher.value(f.__kwdefaults__)
    _CLASS_CODE[cls] = (found, hasher.hexdigest())
    return _CLASS_CODE[cls][1]


def _name(obj: Any) -> str:
    """A class's or function's name, without its module: code run as a script (``__main__``)
    and imported is the same code."""
    return str(getattr(obj, "__qualname__", None) or getattr(obj, "__name__", "?"))


def _global_names(code: types.CodeType) -> set[str]:
    """The names that ``code`` (and the code nested in it) looks up, globals among them."""
    names = set(code.co_names)
    for const in code.co_consts:
        if isinstance(const, types.CodeType):
            names |= _global_names(const)
    return names


def model_fingerprint(model: nn.Module) -> str:
    """The SHA-256 of the whole of ``model``, in three parts of 16 hex digits each, so that a
    difference says where it is: ``state`` (every tensor of its state, parameters and buffers,
    persistent or not, hashed whole), ``tree`` (the module tree: each module's class name,
    ``extra_repr()``, training flag and public attributes) and ``code`` (the code of each
    module's class and its bases up to `nn.Module`).

    >>> import torch
    >>> model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.ReLU())
    >>> before = model_fingerprint(model)
    >>> with torch.no_grad():
    ...     model[0].weight[0, 1] += 1e-6
    >>> [part.split()[1] == old.split()[1] for part, old in zip(model_fingerprint(model).split(", "), before.split(", "))]
    [False, True, True]
    """
    hasher = _Hasher(parts=True)
    with torch.no_grad():
        hasher.value(model)
    return hasher.hexdigest()


def code_fingerprint(obj: Any) -> str:
    """16 hex digits of SHA-256 over what a callable (a transform, a ``reduce=`` function) or any
    other object computes with: code objects, constants, defaults, closure values, named
    globals and attributes, recursively (see the module's docstring)."""
    hasher = _Hasher()
    with torch.no_grad():
        hasher.value(obj)
    return hasher.hexdigest()


# ------------------------------------------------------------------------------ the samples
FAILED = "failed"  # the digest of a sample that could not be read (data other than files)
MISSING = "missing"  # the digest of a file that is gone or unreadable


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    try:
        with open(path, "rb") as f:
            while block := f.read(1 << 20):
                digest.update(block)
    except OSError:
        return MISSING
    return digest.hexdigest()[:16]


def _files(source: DataSource) -> bool:
    """Whether the source's samples are files under its root (an image folder)."""
    return source.root is not None and source.ids is not None


def _row_digests(tensors: Sequence[torch.Tensor], n: int) -> list[str]:
    """The digest of each of ``n`` rows across ``tensors`` (all batch first)."""
    digests = [hashlib.sha256() for _ in range(n)]
    for t in tensors:
        head = f"{t.dtype}{tuple(t.shape[1:])};".encode()
        rows = t.detach().cpu().contiguous().reshape(n, -1).view(torch.uint8).numpy()
        for digest, row in zip(digests, rows):
            digest.update(head)
            digest.update(row)
    return [d.hexdigest()[:16] for d in digests]


def batch_digests(source: DataSource, batch: Batch) -> list[str]:
    """The digest of every readable sample of ``batch``, in batch order."""
    if _files(source):
        return [_file_digest(source.root / source.id_of(i)) for i in batch.index]
    return _row_digests(batch.row_tensors(), len(batch))


def failed_digests(source: DataSource, failed: Iterable[SkippedSample]) -> list[str]:
    """The digests of samples that could not be read: a file's bytes still have one."""
    if _files(source):
        return [_file_digest(source.root / source.id_of(f.index)) for f in failed]
    return [FAILED for _ in failed]


class Verifier:
    """Compares samples with the digests that a store's markers recorded for them.

    Args:
        recorded: for each written chunk, the digest of each of its samples.
        chunk_size: samples per chunk.
    """

    def __init__(self, recorded: Mapping[int, Sequence[str]], chunk_size: int, source: DataSource, store: str) -> None:
        self.recorded, self.chunk_size, self.source, self.store = recorded, chunk_size, source, store

    def check(self, index: Iterable[int], digests: Iterable[str]) -> None:
        """Raise `DataChangedError` at the first sample whose digest is not the recorded one."""
        for i, digest in zip(index, digests):
            chunk, row = divmod(int(i), self.chunk_size)
            expected = self.recorded.get(chunk)
            if expected is not None and (row >= len(expected) or expected[row] != digest):
                raise DataChangedError(
                    f"sample {self.source.id_of(int(i))!r} is not what {self.store} was written from (its content "
                    "changed since), so its features would not match: restore the data, or pass overwrite=True "
                    "(--overwrite) to extract everything again"
                )

    def check_all(self) -> None:
        """Check every recorded chunk against the data (data that can be read by index only)."""
        shard = np.concatenate(
            [np.arange(c * self.chunk_size, c * self.chunk_size + len(d), dtype=np.int64) for c, d in sorted(self.recorded.items())]
            or [np.zeros(0, dtype=np.int64)]
        )
        if _files(self.source):  # the bytes of the files: no decoding
            self.check(shard, (_file_digest(self.source.root / self.source.id_of(int(i))) for i in shard))
            return
        for batch in self.source.batches(shard):
            self.check(batch.index, batch_digests(self.source, batch))
            self.check([f.index for f in batch.failed], failed_digests(self.source, batch.failed))


__all__ = ["Verifier", "batch_digests", "code_fingerprint", "failed_digests", "model_fingerprint"]
