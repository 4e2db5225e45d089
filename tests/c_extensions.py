"""layertap's optional C extensions, as the tests of each load them."""

import importlib
import os
from types import ModuleType


def optional_kernel(name: str) -> ModuleType | None:
    """``layertap.<name>``, or None where the package was built without it (no C compiler at
    install). CI sets ``LAYERTAP_REQUIRE_KERNEL=1``: there a build that silently failed is an
    error, not a skip."""
    try:
        return importlib.import_module(f"layertap.{name}")
    except ImportError:
        if os.environ.get("LAYERTAP_REQUIRE_KERNEL") == "1":
            raise
        return None
