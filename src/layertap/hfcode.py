"""What a Hugging Face folder's config files ask transformers to import, read before anything loads.

transformers runs code named in a folder's JSON: a model's or tokenizer's own modules
(``auto_map``, with ``trust_remote_code=True``), and kernels downloaded from the Hub and imported
(``"attn_implementation": "ORG/REPO"`` through the ``kernels`` package, which asks no
``trust_remote_code`` for the kernels of its own community repositories). `names_code` finds either in a config dict and its sub-configs, so
that `layertap.load_model` and the token extraction's tokenizer reader refuse the folder unless
the user trusts it.

>>> names_code({"model_type": "bert", "attn_implementation": "sdpa"}) is None
True
>>> names_code({"text_config": {"attn_implementation": "some-org/flash-kernel"}})
"a kernel from the Hugging Face Hub (attn_implementation: 'some-org/flash-kernel' in its config)"
"""

from __future__ import annotations

import json
import reprlib
from pathlib import Path
from typing import Any

from .errors import ModelLoadError

AUTO_MAP = "its own Python code (auto_map in its config files)"
_KERNEL_KEYS = ("attn_implementation", "_attn_implementation", "experts_implementation", "_experts_implementation")


def names_code(config: Any, auto_map_for: str | None = None, where: str = "config.json") -> str | None:
    """What code a config dict (or any of its sub-configs) names, in words, or None;
    ``auto_map_for``: only an ``auto_map`` for that class counts, and no kernel (``"AutoTokenizer"``
    in a model's ``config.json``: its modeling code and kernels are the model loader's business).
    Walked with a stack, not recursion: a config from a file may nest as deep as JSON allows.

    Raises `ModelLoadError` (``where`` names the config) for a kernel key that is not a string,
    ``null`` or a dict of them (per sub-config): transformers would fail on it with a bare error.
    """
    stack = [config]
    while stack:
        current = stack.pop()
        if not isinstance(current, dict):
            continue
        auto_map = current.get("auto_map")
        if "auto_map" in current and (auto_map_for is None or not isinstance(auto_map, dict) or auto_map_for in auto_map):
            return AUTO_MAP
        for key, value in current.items():
            # one implementation, or one per sub-config {"": ..., "text_config": ...}; the underscored
            # keys are transformers' own, which it does not read from JSON today: refused all the same
            if key in _KERNEL_KEYS and auto_map_for is None:
                kernels = [v for v in _implementations(key, value, where) if "/" in v]  # a Hub repo: ORG/REPO[@rev][:name]
                if kernels:
                    return f"a kernel from the Hugging Face Hub ({key}: {kernels[0]!r} in its config)"
        stack.extend(reversed([v for v in current.values() if isinstance(v, dict)]))  # depth first, in key order
    return None


def _implementations(key: str, value: Any, where: str) -> list[str]:
    """The implementations a kernel key names: a string, or strings in a dict per sub-config (whose
    values transformers hands to the sub-configs, where a dict is one per sub-config again)."""
    named, stack = [], [value]
    while stack:
        current = stack.pop()
        if isinstance(current, str):
            named.append(current)
        elif isinstance(current, dict):
            stack.extend(reversed(list(current.values())))
        elif current is not None:
            kind = type(current).__name__
            raise ModelLoadError(
                f"{where} gives {key} as {'an' if kind[0] in 'aeiou' else 'a'} {kind} ({reprlib.repr(current)}), not the name of an implementation: "
                'give a string (such as "sdpa" or "eager"), or a dict of them by sub-config, or remove the key'
            )
    return named


def folder_names_code(folder: Path, name: str, auto_map_for: str | None = None) -> str | None:
    """What code the JSON file ``name`` of ``folder`` names, if it is there (see `names_code`);
    raises ValueError or OSError for a file that is there but not valid JSON (or nested past
    Python's recursion limit)."""
    path = folder / name
    try:
        return names_code(json.loads(path.read_text()), auto_map_for, str(path)) if path.is_file() else None
    except RecursionError as e:
        raise ValueError(f"{name} is nested too deep to be a config") from e
