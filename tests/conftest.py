import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("LAYERTAP_ALLOCATOR", "default")  # in-process CLI runs leave the pytest process's allocator alone


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


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a module of tiny inputs: a second thread gains nothing there, and
    beside another busy process OpenMP's barriers make two threads many times slower than one."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
