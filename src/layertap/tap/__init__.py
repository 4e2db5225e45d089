"""The tap: hooks on chosen layers that capture outputs, inputs and gradients, then go away.

See `layertap.tap.core` for how values are kept correct and cheap.
"""

from .core import KINDS, Inputs, Kind, Tap, op_name, tap

__all__ = ["tap", "Tap", "Inputs", "Kind", "KINDS", "op_name"]
