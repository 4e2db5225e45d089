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
from pathlib import Path
from typing import Any

AUTO_MAP = "its own Python code (auto_map in its config files)"
_KERNEL_KEYS = ("attn_implementation", "_attn_implementation", "experts_implementation", "_experts_implementation")


def names_code(config: Any, auto_map_for: str | None = None) -> str | None:
    """What code a config dict (or any of its sub-configs) names, in words, or None;
    ``auto_map_for``: only an ``auto_map`` for that class counts, and no kernel (``"AutoTokenizer"``
    in a model's ``config.json``: its modeling code and kernels are the model loader's business).
    Walked with a stack, not recursion: a config from a file may nest as deep as JSON allows."""
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
                named = [value] if isinstance(value, str) else list(value.values()) if isinstance(value, dict) else []
                kernels = [v for v in named if isinstance(v, str) and "/" in v]  # a Hub repo: ORG/REPO[@rev][:name]
                if kernels:
                    return f"a kernel from the Hugging Face Hub ({key}: {kernels[0]!r} in its config)"
        stack.extend(reversed([v for v in current.values() if isinstance(v, dict)]))  # depth first, in key order
    return None


def folder_names_code(folder: Path, name: str, auto_map_for: str | None = None) -> str | None:
    """What code the JSON file ``name`` of ``folder`` names, if it is there (see `names_code`);
    raises ValueError or OSError for a file that is there but not valid JSON (or nested past
    Python's recursion limit)."""
    path = folder / name
    try:
        return names_code(json.loads(path.read_text()), auto_map_for) if path.is_file() else None
    except RecursionError as e:
        raise ValueError(f"{name} is nested too deep to be a config") from e
