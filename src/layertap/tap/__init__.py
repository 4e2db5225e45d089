"""The tap: hooks on chosen layers that capture outputs, inputs and gradients, then go away.

Where each part lives (each file's docstring says how its mechanism works):

- ``core.py``: `Tap` (checks the options, resolves the layers once, owns the hooks' lifetime and
  runs the hook bodies) and `tap`, which makes it;
- ``results.py``: `Results`, the read side `Tap` inherits: the mappings of each kind, `order`;
- ``options.py``: what `tap` is given (kinds, keep policies) and the checks of the options together;
- ``edits.py``: ``edit=`` and ``replace=`` resolved and run, and an edit's result unlike its layer's
  value named in a note on the error that follows;
- ``controls.py``: ``detach``, ``reduce``, ``dtype`` and ``to``, applied to each tensor in the hook;
- ``kept.py``: the keep policy's stores, the DataParallel replicas' parts, the views that read them;
- ``inplace.py``: which values a later in-place op changes (learned, shared by taps), version guards;
- ``copies.py``: the tap's side of the copy pool: its forwards, its copies, the values it drops;
- ``pool.py``: the copy pool: the copies' memory per device, kept from one tap to the next,
  bounded, handed back only once the values are dropped, written with streaming stores;
- ``grads.py``: gradients, hooked on tensors that carry only one edge of a layer;
- ``masks.py``: the running call's ``attention_mask`` (per thread), and reductions over real tokens;
- ``sharded.py``: a tensor-parallel model's values seen whole (``gather=``), edits split back;
- ``ops.py``: op taps through a ``TorchFunctionMode``, and the thread-local in-hook count;
- ``compiled.py``: compiled modules run eagerly while tapped.
- ``recompute.py``: a checkpoint's recomputation in the backward is not a new call.
"""

from .core import Tap, tap
from .ops import op_name
from .options import KINDS, Inputs, Kind

__all__ = ["tap", "Tap", "Inputs", "Kind", "KINDS", "op_name"]
