import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)


HOOK_DICTS = (
    "_forward_hooks",
    "_forward_hooks_with_kwargs",
    "_forward_hooks_always_called",
    "_forward_pre_hooks",
    "_forward_pre_hooks_with_kwargs",
    "_backward_hooks",
    "_backward_pre_hooks",
    "_state_dict_hooks",
    "_load_state_dict_pre_hooks",
)


def hook_state(model: torch.nn.Module) -> dict:
    """Every hook dictionary of every module, copied: compare before and after a tap."""
    return {
        (name, attr): dict(getattr(m, attr, {}))
        for name, m in model.named_modules(remove_duplicate=False)
        for attr in HOOK_DICTS
    }
