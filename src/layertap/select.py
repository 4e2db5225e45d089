"""Choosing layers: names, globs, regexes, module classes and predicates.

Every layertap entry point resolves its ``layers=`` argument here, so the rules are the same
everywhere:

- an exact qualified name as in ``model.named_modules()`` (``"layer4.1.conv2"``; ``""`` is the
  model itself);
- a glob: ``*`` matches within one dotted segment, ``**`` spans segments (``"layer*.0.conv?"``,
  ``"**.bn1"``);
- a regex, ``re.compile(...)`` or a string ``"re:..."``, matched against the whole name;
- a module class (``nn.BatchNorm2d``): every instance;
- a predicate ``f(name, module) -> bool``.

Wrappers are seen through: the ``module.`` prefix of DataParallel/DDP and the ``_orig_mod.``
prefix of ``torch.compile`` are dropped from the names layertap reports, and names with or
without them are accepted. A module registered at two paths keeps its first name, as
``named_modules()`` reports it.
"""

from __future__ import annotations

import difflib
import re
from collections.abc import Callable, Iterable, Sequence
from typing import Union

from torch import nn

from .errors import LayerNotFoundError

Spec = Union[str, "re.Pattern[str]", type, Callable[[str, nn.Module], bool]]
Layers = Union[Spec, Sequence[Spec]]

_WRAPPER_SEGMENTS = ("module", "_orig_mod")


def _is_wrapper(module: nn.Module) -> bool:
    """DataParallel/DDP hold the model as ``.module``; torch.compile as ``._orig_mod``."""
    if isinstance(module, (nn.DataParallel, nn.parallel.DistributedDataParallel)):
        return True
    return hasattr(module, "_orig_mod") and isinstance(getattr(module, "_orig_mod"), nn.Module)


def canonical_name(name: str) -> str:
    """Drop wrapper segments (``module.``, ``_orig_mod.``) from a qualified name."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_SEGMENTS)


def named_layers(model: nn.Module) -> dict[str, nn.Module]:
    """All modules of ``model`` by canonical name, in ``named_modules()`` order.

    Wrapper modules themselves (DataParallel, DDP, torch.compile's OptimizedModule) are hidden:
    the wrapped model takes the name ``""``.
    """
    layers: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        if _is_wrapper(module):
            continue
        layers.setdefault(canonical_name(name), module)
    return layers


def _glob_to_regex(glob: str) -> re.Pattern[str]:
    out, i = [], 0
    while i < len(glob):
        if glob.startswith("**.", i):  # any number of leading segments, including none
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
    return re.compile("".join(out))


def _describe(spec: Spec) -> str:
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


def not_found(spec: Spec, layers: dict[str, nn.Module], what: str = "model") -> LayerNotFoundError:
    """The error for a spec that matched nothing, with the closest real names."""
    msg = f"{_describe(spec)} matches no layer of the {what}"
    if isinstance(spec, type):
        classes = sorted({type(m).__name__ for m in layers.values()})
        msg += f"; module classes present: {', '.join(classes[:20])}"
    elif isinstance(spec, str):
        close = _closest(canonical_name(spec.removeprefix("re:")), layers)
        if close:
            msg += f". Closest names: {', '.join(close)}"
        msg += ". See every name with layertap.summary(model, example_input) or list(dict(model.named_modules()))"
    return LayerNotFoundError(msg)


def _matcher(spec: Spec) -> Callable[[str, nn.Module], bool]:
    if isinstance(spec, re.Pattern):
        return lambda name, _m: spec.fullmatch(name) is not None
    if isinstance(spec, type):
        if not issubclass(spec, nn.Module):
            raise TypeError(f"a class spec must be an nn.Module subclass, got {spec.__name__}")
        return lambda _name, m: isinstance(m, spec)
    if isinstance(spec, str):
        if spec.startswith("re:"):
            return _matcher(re.compile(spec[3:]))
        if any(c in spec for c in "*?["):
            pattern = _glob_to_regex(canonical_name(spec))
            return lambda name, _m: pattern.fullmatch(name) is not None
        wanted = canonical_name(spec)
        return lambda name, _m: name == wanted
    if callable(spec):
        return lambda name, m: bool(spec(name, m))
    raise TypeError(
        f"cannot select layers with {spec!r}: give a name, a glob, a regex, "
        "an nn.Module class or a predicate f(name, module) -> bool"
    )


def _specs(layers: Layers) -> list[Spec]:
    if isinstance(layers, (str, re.Pattern, type)) or callable(layers):
        return [layers]
    return list(layers)


def select(model: nn.Module, layers: Layers) -> list[str]:
    """Resolve ``layers`` to qualified module names, in ``model.named_modules()`` order.

    Raises `LayerNotFoundError` (listing the closest names) if any spec matches nothing.

    >>> import torchvision, torch.nn as nn
    >>> m = torchvision.models.resnet18()
    >>> select(m, ["layer4", "**.0.bn?"])[:3]
    ['layer1.0.bn1', 'layer1.0.bn2', 'layer2.0.bn1']
    >>> len(select(m, nn.Conv2d))
    20
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
    all_layers = named_layers(model)
    specs = _specs(layers)
    if not specs:
        raise ValueError("no layers given: pass a name, a glob, a regex, a class or a predicate")
    chosen: set[str] = set()
    for spec in specs:
        match = _matcher(spec)
        # the root ("") is selected only by its exact name, never by a pattern
        hits = {
            name
            for name, m in all_layers.items()
            if (name or spec == "") and match(name, m)
        }
        if not hits:
            raise not_found(spec, all_layers)
        chosen |= hits
    return [name for name in all_layers if name in chosen]


def resolve(model: nn.Module, names: Iterable[str]) -> dict[str, nn.Module]:
    """Map already-selected canonical names to their modules."""
    all_layers = named_layers(model)
    return {name: all_layers[name] for name in names}


__all__ = ["select", "named_layers", "canonical_name", "resolve", "Spec", "Layers"]
