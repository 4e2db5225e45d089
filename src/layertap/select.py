r"""Choosing layers: names, globs, regexes, module classes and predicates.

Every layertap entry point resolves its ``layers=`` argument here, so the rules are the same
everywhere:

- an exact qualified name as in ``model.named_modules()`` (``"layer4.1.conv2"``; ``""`` is the
  model itself);
- a glob: ``*`` matches within one dotted segment, ``**`` spans segments (``"layer*.0.conv?"``,
  ``"**.bn1"``);
- a regex, ``re.compile(...)`` or a string ``"re:..."``, matched against the whole name;
- a module class (``nn.BatchNorm2d``): every instance;
- a predicate ``f(name, module) -> bool``;
- an *op* inside a module's own ``forward``: ``"MODULE:OP"`` or ``"MODULE:OP#K"``, where MODULE is
  any string spec above (``""`` is the model itself, as in ``":add"``), OP a torch function's name
  (``x + y`` is ``add``, ``x += y`` is ``add_``, ``x @ y`` is ``matmul``, ``x[i]`` is
  ``getitem``) and ``#K`` its K-th call in that forward, counted from 1; without ``#K`` every
  call is tapped. A class or predicate takes its op as a pair: ``(nn.MultiheadAttention,
  "softmax")``. An op belongs to the innermost module whose ``forward`` called it. Each
  matched module gives one name, ``"layer1.0:add_"``. ``OP`` may be ``*``: every op the module
  calls, named ``"MODULE:OP#K"`` as they run (what ``summary(ops=True)`` lists).

Names holding the spec syntax's own characters (a ModuleDict key ``"a[0]"``, a module registered
as ``"d:relu"``, or with ``*`` or ``?``) are selected like any other:

- an exact module name always wins: a spec equal to a module's name selects that module, never a
  glob or an op (``"a.b[0]"``, ``"d:relu"``);
- a backslash makes the next character literal, in names, globs and op specs: ``r"**.b\[0\]"``,
  ``r"d\:relu:add"`` (the op ``add`` of module ``d:relu``), ``r"x\*"``;
- every name layertap reports is a spec that selects exactly that layer: a ``:`` or ``\`` inside a
  module's own name is reported escaped (module ``d:relu`` is ``"d\:relu"``, its ops
  ``"d\:relu:add"``), and so is a ``*`` after a ``:`` (module ``g:*`` is ``"g\:\*"``), so a
  module name never reads as an op. The op ``relu`` of a module ``d``
  beside a module ``d:relu`` is the pair ``("d", "relu")`` in a list.

Globs and regexes are matched against the names as modules have them (``re:d\:relu`` or
``re:d:r.*`` match ``d:relu``; a regex's own colons, before its last one, stay its own). A regex or
glob that does not compile is an `ArgumentError` naming it.

Wrappers are seen through: the ``module.`` segment of DataParallel/DDP and the ``_orig_mod.``
segment of ``torch.compile`` are dropped from the names layertap reports, and a spec may use a
name with or without them: names, globs and regexes are matched against both the reported name
(unescaped) and the name ``named_modules()`` gives. Only the segment that holds an actual wrapper's model is
dropped; an EMA or weight-norm wrapper's own ``self.module`` keeps its name. A module registered
at two paths keeps its first name, as ``named_modules()`` reports it.
"""

from __future__ import annotations

import difflib
import re
import sys
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from types import MappingProxyType
from typing import Any, NamedTuple, TypeGuard, Union, cast

from torch import nn

from .errors import ArgumentError, LayerNotFoundError

ModuleSpec = Union[str, "re.Pattern[str]", type, Callable[[str, nn.Module], bool]]
Spec = ModuleSpec | tuple[ModuleSpec, str]
Layers = Spec | Sequence[Spec]
_OP = re.compile(r"(?:[A-Za-z_][A-Za-z0-9_]*(?:#[1-9][0-9]*)?|\*)")
_PARALLEL = (nn.DataParallel, nn.parallel.DistributedDataParallel)
_ESCAPED = re.compile(r"\\(.)", re.DOTALL)
_GLOB = re.compile(r"(?<!\\)(?:\\\\)*[*?\[]")  # an unescaped glob metacharacter


def escape(name: str) -> str:
    """A module's own name (one segment) as layertap reports it: ``:`` and ``\\`` escaped, and a
    ``*`` after a ``:``, so that no module name reads as ``"MODULE:*"`` (every op of a module)."""
    return name.replace("\\", "\\\\").replace(":", "\\:").replace("\\:*", "\\:\\*")


def unescape(name: str) -> str:
    """A name or spec with its backslash escapes resolved: ``"d\\:relu"`` is ``"d:relu"``."""
    return _ESCAPED.sub(r"\1", name)


def _rsplit_op(name: str) -> tuple[str, str] | None:
    """``name`` split at its last colon that no backslash escapes, or None."""
    end = len(name)
    while (i := name.rfind(":", 0, end)) >= 0:
        slashes = i - len(name[:i].rstrip("\\"))
        if slashes % 2 == 0:
            return name[:i], name[i + 1 :]
        end = i
    return None


def wrapped_child(module: nn.Module) -> str | None:
    """The child under which a wrapper holds the model: ``module`` for DataParallel and DDP,
    ``_orig_mod`` for torch.compile's OptimizedModule; ``None`` for any other module."""
    if isinstance(module, _PARALLEL):
        return "module"
    # torch.compile loads torch._dynamo; before that no OptimizedModule can exist (and importing
    # it here would make every select slow to start)
    eval_frame = sys.modules.get("torch._dynamo.eval_frame")
    if eval_frame is not None and isinstance(module, eval_frame.OptimizedModule):
        return "_orig_mod"
    return None


class _Layer(NamedTuple):
    module: nn.Module
    raw: str  # the name named_modules() gives, wrapper segments included
    plain: str  # the canonical name unescaped: what patterns are matched against, with `raw`


def _index(model: nn.Module) -> dict[str, _Layer]:
    """Every module but the wrappers, by canonical name, in ``named_modules()`` order."""
    return _walk(model)[0]


def _walk(model: nn.Module) -> tuple[dict[str, _Layer], tuple[nn.Module, ...]]:
    """`_index`, and every module, wrappers included, in ``named_modules()`` order."""
    canonical: dict[str, str] = {}
    holds: dict[str, str | None] = {}  # raw name -> the child it wraps, for wrappers
    layers: dict[str, _Layer] = {}
    every = []
    for raw, module in model.named_modules():  # parents come before their children
        every.append(module)
        parent, _, last = raw.rpartition(".")
        if not raw:
            name = ""
        elif holds[parent] == last:  # the wrapped model takes its wrapper's name
            name = canonical[parent]
        else:
            name = f"{canonical[parent]}.{escape(last)}" if canonical[parent] else escape(last)
        canonical[raw] = name
        holds[raw] = wrapped_child(module)
        if holds[raw] is None:
            layers.setdefault(name, _Layer(module, raw, unescape(name) if "\\" in name else name))
    return layers, tuple(every)


def named_layers(model: nn.Module) -> dict[str, nn.Module]:
    """All modules of ``model`` by canonical name, in ``named_modules()`` order.

    Wrapper modules themselves (DataParallel, DDP, torch.compile's OptimizedModule) are hidden:
    the wrapped model takes the name ``""``.
    """
    return {name: layer.module for name, layer in _index(model).items()}


def _aliases(index: Mapping[str, _Layer]) -> dict[str, str]:
    names = {layer.raw: name for name, layer in index.items()}
    names.update((layer.plain, name) for name, layer in index.items() if layer.plain not in names)
    names.update((name, name) for name in index)  # a canonical name wins over an equal raw name
    return names


def aliases(model: nn.Module) -> dict[str, str]:
    """Every name a layer may be given by (canonical, unescaped, or as ``named_modules()`` has it) -> canonical."""
    return _aliases(_index(model))


def _glob_to_regex(glob: str) -> re.Pattern[str]:
    out, i = [], 0
    while i < len(glob):
        if glob[i] == "\\" and i + 1 < len(glob):  # an escaped character is itself
            out.append(re.escape(glob[i + 1]))
            i += 2
        elif glob.startswith("**.", i):  # any number of leading segments, including none
            out.append(r"(?:.*\.)?")
            i += 3
        elif glob.startswith(".**", i) and i + 3 == len(glob):
            out.append(r"(?:\..*)?")
            i += 3
        elif glob.startswith("**", i):
            out.append(r".*")
            i += 2
        elif glob[i] == "*":
            out.append(r"[^.]*")
            i += 1
        elif glob[i] == "?":
            out.append(r"[^.]")
            i += 1
        elif glob[i] == "[":
            end = glob.find("]", i + 1)
            if end < 0:
                out.append(re.escape(glob[i]))
                i += 1
            else:
                body = glob[i + 1 : end]
                if body.startswith("!"):
                    body = "^" + body[1:]
                out.append("[" + body + "]")
                i = end + 1
        else:
            out.append(re.escape(glob[i]))
            i += 1
    return _compile("".join(out), glob, "glob")


def _compile(pattern: str, spec: str, what: str) -> re.Pattern[str]:
    try:
        return re.compile(pattern)
    except re.error as e:
        raise ArgumentError(
            f"{what} {spec!r} is not a valid pattern ({e}): fix it, or put a backslash before each "
            r"special character meant literally (r'\(', r'\['); a module's exact name needs none"
        ) from None


class OpName(NamedTuple):
    """A tapped op's name split up: ``"layer1.0:relu#2"`` is ``OpName("layer1.0", "relu", 2)``."""

    module: str
    op: str
    call: int | None  # the K of "#K"; None: every call

    def on(self, module: str) -> str:
        """The op's name with ``module`` (another name of its module) before it: ``"module.a:relu#2"``."""
        return f"{module}:{self.op}" + (f"#{self.call}" if self.call is not None else "")


def split_op(name: str) -> OpName | None:
    """The parts of an op name as `select` returns it, or ``None`` for a module name.

    >>> split_op("layer1.0:relu#2"), split_op("layer1.0"), split_op(r"d\\:relu")
    (OpName(module='layer1.0', op='relu', call=2), None, None)
    """
    parts = _rsplit_op(name)
    if parts is None or not _OP.fullmatch(parts[1]):
        return None
    module, (op, _, call) = parts[0], parts[1].partition("#")
    return OpName(module, op, int(call) if call else None)


def owner(name: str) -> str:
    """The module a selected name belongs to: itself, or the module whose forward calls the op."""
    op = split_op(name)
    return name if op is None else op.module


def _op_spec(spec: Spec) -> tuple[ModuleSpec, str] | None:
    """``(module spec, "op#K")`` for an op spec, else None. A regex's own colons stay its own."""
    if isinstance(spec, tuple):
        if len(spec) == 2 and isinstance(spec[1], str) and _OP.fullmatch(spec[1]):
            return spec[0], spec[1]
        raise TypeError(f"an op spec pair is (module spec, op name), e.g. (nn.MultiheadAttention, 'softmax'), got {spec!r}")
    if not isinstance(spec, str):
        return None
    prefix, body = ("re:", spec[3:]) if spec.startswith("re:") else ("", spec)
    parts = _rsplit_op(body)
    if parts is None or not _OP.fullmatch(parts[1]) or (prefix and not parts[0]):
        return None
    return prefix + parts[0], parts[1]


def _describe(spec: Spec) -> str:
    if isinstance(spec, tuple):
        return f"{_describe(spec[0])} (op {spec[1]!r})"
    if isinstance(spec, re.Pattern):
        return f"regex {spec.pattern!r}"
    if isinstance(spec, type):
        return f"class {spec.__name__}"
    if isinstance(spec, str):
        return repr(spec)
    return f"predicate {getattr(spec, '__name__', spec)!r}"


def _closest(spec: str, names: Iterable[str], n: int = 5) -> list[str]:
    names = [name for name in names if name]
    close = difflib.get_close_matches(spec, names, n=n, cutoff=0.5)
    if len(close) < n:  # names sharing the last segment, e.g. 'bn1' -> 'layer1.0.bn1'
        last = spec.rsplit(".", 1)[-1]
        close += [m for m in names if m.rsplit(".", 1)[-1] == last and m not in close]
    return close[:n]


def not_found(spec: Spec, layers: dict[str, nn.Module], what: str = "model", model: nn.Module | None = None) -> LayerNotFoundError:
    """The error for a spec that matched nothing, with the closest real names (or, for a second
    path of a module registered twice, its name)."""
    shared = _first_name(spec, layers, model)
    if shared is not None:
        return LayerNotFoundError(
            f"{_describe(spec)} is a second path of layer {shared!r}: a module registered at two paths keeps its first "
            f"name, as named_modules() gives it: select {shared!r}"
        )
    msg = f"{_describe(spec)} matches no layer of the {what}"
    if isinstance(spec, type):
        classes = sorted({type(m).__name__ for m in layers.values()})
        msg += f"; module classes present: {', '.join(classes[:20])}"
    elif isinstance(spec, str):
        close = _closest(unescape(spec.removeprefix("re:")), layers)
        if close:
            msg += f". Closest names: {', '.join(close)}"
        msg += ". See every name with layertap.summary(model, example_input) or list(dict(model.named_modules()))"
    return LayerNotFoundError(msg)


def _first_name(spec: Spec, layers: dict[str, nn.Module], model: nn.Module | None) -> str | None:
    """The name ``layers`` knows a module by, where ``spec`` is another path to it (``self.b = self.a``)."""
    if model is None or not isinstance(spec, str) or not spec or spec.startswith("re:"):
        return None
    try:
        module = model.get_submodule(unescape(spec))
    except AttributeError:
        return None
    return next((name for name, m in layers.items() if m is module), None)


def _matcher(spec: ModuleSpec) -> Callable[[str, nn.Module], bool]:
    if isinstance(spec, re.Pattern):
        return lambda name, _m: spec.fullmatch(name) is not None
    if isinstance(spec, type):
        if not issubclass(spec, nn.Module):
            raise TypeError(f"a class spec must be an nn.Module subclass, got {spec.__name__}")
        return lambda _name, m: isinstance(m, spec)
    if isinstance(spec, str):
        if spec.startswith("re:"):
            return _matcher(_compile(spec[3:], spec, "regex"))
        pattern = _glob_to_regex(spec)  # exact names never get here: `select` looks them up
        return lambda name, _m: pattern.fullmatch(name) is not None
    if callable(spec):
        return lambda name, m: bool(spec(name, m))
    raise TypeError(
        f"cannot select layers with {spec!r}: give a name, a glob, a regex, "
        "an nn.Module class or a predicate f(name, module) -> bool"
    )


def _is_name(spec: ModuleSpec) -> TypeGuard[str]:
    return isinstance(spec, str) and not spec.startswith("re:") and not _GLOB.search(spec)


def _specs(layers: Layers) -> list[Spec]:
    if isinstance(layers, (str, re.Pattern, type)) or callable(layers) or _op_pair(layers):
        return [cast(Spec, layers)]
    if not isinstance(layers, Iterable):
        raise ArgumentError(
            f"layers must be a name, glob, regex, module class, predicate, (module spec, op) pair or a list of "
            f"them, not {type(layers).__name__} ({layers!r}): e.g. 'layer1', 'layer*', nn.Conv2d or 'layer1.0:add_'"
        )
    return list(cast(Sequence[Spec], layers))


def _op_pair(layers: object) -> bool:
    return isinstance(layers, tuple) and len(layers) == 2 and isinstance(layers[1], str) and not isinstance(layers[0], str)


class Selection:
    """Layers of one model resolved once: what `selection` returns, and what `layertap.tap` (and
    every capability built on it) accepts as ``layers=`` without selecting or walking the model again.

    Immutable. ``names`` are the selected names in ``named_modules()`` order (op names after their
    module's name, ``"MODULE:*"`` included), ``modules`` maps every selected module name and the
    owner of each op to its module, ``ops`` maps each op name to its parsed `OpName` (``op`` is
    ``"*"`` for ``"MODULE:*"``, whose ops are named as they run). It iterates over ``names``.
    The model's index of named layers is made once, here; a module added to the model later is
    not in it: select again.

    >>> import torchvision
    >>> s = selection(torchvision.models.resnet18(), ["layer1.0.conv1", "layer1.*:add_"])
    >>> s.names, s.ops["layer1.0:add_"]
    (('layer1.0:add_', 'layer1.0.conv1', 'layer1.1:add_'), OpName(module='layer1.0', op='add_', call=None))
    >>> type(s.modules["layer1.1"]).__name__, len(s)
    ('BasicBlock', 3)
    """

    __slots__ = ("_aliases", "_index", "every", "model", "modules", "names", "ops")

    model: nn.Module
    names: tuple[str, ...]
    modules: Mapping[str, nn.Module]
    ops: Mapping[str, OpName]
    every: tuple[nn.Module, ...]  # every module, wrappers included, in named_modules() order
    _index: Mapping[str, _Layer]
    _aliases: dict[str, tuple[str, ...]] | None

    def __init__(
        self, model: nn.Module, names: Sequence[str], ops: Mapping[str, OpName], walk: tuple[Mapping[str, _Layer], tuple[nn.Module, ...]]
    ) -> None:
        index, every = walk
        init = object.__setattr__
        init(self, "model", model)
        init(self, "every", every)
        init(self, "names", tuple(names))
        init(self, "ops", MappingProxyType(dict(ops)))
        owners = (ops[n].module if n in ops else n for n in self.names)
        init(self, "modules", MappingProxyType({n: index[n].module for n in owners}))
        init(self, "_index", index)
        init(self, "_aliases", None)

    def __setattr__(self, name: str, value: object) -> None:
        raise AttributeError(f"a Selection is immutable: select again to change {name!r}")

    def __reduce__(self) -> tuple[Any, tuple[nn.Module, list[str]]]:
        # pickled or copied by its names, each a spec that selects exactly itself
        return selection, (self.model, list(self.names))

    def __len__(self) -> int:
        return len(self.names)

    def __iter__(self) -> Iterator[str]:
        return iter(self.names)

    def __contains__(self, name: object) -> bool:
        return name in self.names

    def __repr__(self) -> str:
        return f"<layertap.Selection of {type(self.model).__name__}: {len(self.names)} names {list(self.names[:4])}{'...' if len(self.names) > 4 else ''}>"

    @property
    def star(self) -> frozenset[str]:
        """The modules selected as ``"MODULE:*"``: every op of theirs, named as they run."""
        return frozenset(op.module for op in self.ops.values() if op.op == "*")

    @property
    def layers(self) -> Mapping[str, nn.Module]:
        """Every module of the model by canonical name (wrappers hidden), as `named_layers` gives."""
        return MappingProxyType({name: layer.module for name, layer in self._index.items()})

    def aliases(self, module: str) -> tuple[str, ...]:
        """Every name module ``module`` may be given by (canonical first, then unescaped, and as
        ``named_modules()`` has it, wrapper segments included)."""
        known = self._aliases
        if known is None:
            by_module: dict[str, list[str]] = {}
            for alias, name in _aliases(self._index).items():
                by_module.setdefault(name, []).append(alias)
            known = {name: tuple(found) for name, found in by_module.items()}
            object.__setattr__(self, "_aliases", known)
        return known.get(module, (module,))

    def select(self, layers: Layers | Selection) -> Selection:
        """Another spec resolved on the same model, from the index made once (``copy=``, ``edit=``)."""
        if isinstance(layers, Selection):
            return _same_model(layers, self.model)
        return _resolve(self.model, (self._index, self.every), layers)


def _same_model(chosen: Selection, model: nn.Module) -> Selection:
    if chosen.model is not model:
        raise ArgumentError(
            f"this Selection was made for another model ({type(chosen.model).__name__} at {id(chosen.model):#x}): "
            "make it with selection(model, layers) for the model you tap"
        )
    # a module replaced since (model.layer1[0] = ...) would be hooked where it no longer runs: a
    # lookup per name along its raw path, far cheaper than the walk a Selection saves; only where
    # a lookup misses (a name with a dot inside one segment) does the walk decide
    index, walked = chosen._index, None
    for name, module in chosen.modules.items():
        now: nn.Module | None = model
        for part in index[name].raw.split(".") if index[name].raw else ():
            now = now._modules.get(part) if now is not None else None
        if now is not module:
            walked = walked or _walk(model)[0]
            now = walked[name].module if name in walked else None
        if now is not module:
            raise ArgumentError(
                f"this Selection is stale: module {name!r} of the model was replaced "
                f"({type(module).__name__} -> {type(now).__name__ if now is not None else 'nothing'}) since it was made; "
                "select again with selection(model, layers)"
            )
    return chosen


def selection(model: nn.Module, layers: Layers | Selection) -> Selection:
    """Resolve ``layers`` once, to a `Selection` (modules and parsed op sites) that `layertap.tap`
    takes as ``layers=``. A `Selection` is returned as it is, if it is of ``model``.

    Raises `LayerNotFoundError` (listing the closest names) if any spec matches nothing.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    if isinstance(layers, Selection):
        return _same_model(layers, model)
    return _resolve(model, _walk(model), layers)


def _resolve(model: nn.Module, walk: tuple[Mapping[str, _Layer], tuple[nn.Module, ...]], layers: Layers) -> Selection:
    index = walk[0]
    specs = _specs(layers)
    if not specs:
        raise ValueError("no layers given: pass a name, a glob, a regex, a class or a predicate")
    names = _aliases(index)

    def hits(spec: ModuleSpec) -> set[str]:
        if isinstance(spec, str) and spec in names:  # an exact name wins over a glob's reading
            found = {names[spec]}
        elif _is_name(spec):
            # a name with escapes, with or without wrapper segments; only a name selects the root ("")
            found = {names[unescape(spec)]} if unescape(spec) in names else set()
        else:
            match = _matcher(spec)
            # a glob or regex matches the name unescaped or as named_modules() gives it; a class
            # or predicate is given the canonical name
            pattern = isinstance(spec, (str, re.Pattern))
            found = {
                name
                for name, (module, raw, plain) in index.items()
                if name and (match(plain if pattern else name, module) or (pattern and raw != plain and match(raw, module)))
            }
        if not found:
            raise not_found(spec, {name: layer.module for name, layer in index.items()}, model=model)
        return found

    chosen: set[str] = set()
    ops: dict[str, list[str]] = {}  # module name -> ops chosen on it, in the order given
    for spec in specs:
        # a module's exact name is that module, though it reads as an op spec ("d:relu")
        op_spec = None if isinstance(spec, str) and spec in names else _op_spec(spec)
        if op_spec is None:
            assert not isinstance(spec, tuple)  # pairs are op specs
            chosen |= hits(spec)
            continue
        module_spec, op = op_spec
        for name in hits(module_spec):
            ops.setdefault(name, []).append(op)
    out: list[str] = []
    sites: dict[str, OpName] = {}
    for name in index:
        if name in chosen:
            out.append(name)
        for op in dict.fromkeys(ops.get(name, ())):
            func, _, call = op.partition("#")
            sites[f"{name}:{op}"] = OpName(name, func, int(call) if call else None)
            out.append(f"{name}:{op}")
    return Selection(model, out, sites, walk)


def select(model: nn.Module, layers: Layers | Selection) -> list[str]:
    """Resolve ``layers`` to qualified module names, in ``model.named_modules()`` order.

    Raises `LayerNotFoundError` (listing the closest names) if any spec matches nothing. An op
    spec gives a name per matched module (``"layer1.0:add_"``); whether that module's forward
    really calls the op is known only when it runs (see `layertap.tap`). `selection` gives the
    same names resolved once, with their modules and op sites.

    >>> import torchvision, torch.nn as nn
    >>> m = torchvision.models.resnet18()
    >>> select(m, ["layer4", "**.0.bn?"])[:3]
    ['layer1.0.bn1', 'layer1.0.bn2', 'layer2.0.bn1']
    >>> len(select(m, nn.Conv2d))
    20
    >>> select(m, "layer1.*:add_")
    ['layer1.0:add_', 'layer1.1:add_']
    """
    return list(selection(model, layers).names)


def leaf_layers(model: nn.Module) -> list[str]:
    """Every module without submodules (the default layers of `stats`); the model itself if none."""
    leaves = [name for name, m in named_layers(model).items() if name and next(m.children(), None) is None]
    return leaves or [""]


__all__ = [
    "select", "selection", "Selection", "leaf_layers", "named_layers", "aliases", "wrapped_child", "split_op", "owner",
    "escape", "unescape", "OpName", "Spec", "Layers",
]
