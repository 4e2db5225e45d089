"""A forward that autograd runs again during backward: a checkpoint's recomputation.

The problem: ``torch.utils.checkpoint`` (and Hugging Face's ``gradient_checkpointing_enable()``,
FSDP's activation checkpointing) frees a segment's activations after the forward and runs the
segment's modules again when the backward needs them. Their hooks fire again: a tap would count
the recomputation as a second call of every layer in the segment (``keep="all"`` twice as many
entries, ``"layer#1"`` rows in `layertap.watch`, statistics counted twice), and its gradient
hooks would go on recomputed tensors that no gradient reaches (with ``use_reentrant=False`` the
gradient flows through the first forward's graph).

The rule: a module's forward that runs while a backward pass runs in this thread is a
recomputation of a call the tap has already seen. The tap takes nothing from it and counts
nothing; only what changes the values runs again (``edit=``, ``replace=``), so that the
recomputed activations are the first forward's. A forward called by a user's own code from inside
a backward hook counts as a recomputation too. ``use_reentrant=True`` runs the first pass under
``no_grad``: outputs and inputs are taken from it, gradients cannot be (`layertap.tap.grads` says
so, naming the fix).

The cost: one read of autograd's thread-local graph task per hook call.
"""

from __future__ import annotations

import torch


def recomputing() -> bool:
    """Whether a backward pass runs in this thread now (a forward now is a recomputation).

    Autograd's graph task id, which ``torch.utils.checkpoint`` itself reads, is -1 outside a
    backward (tests/test_pytorch_facts.py checks it on the installed torch)."""
    return torch._C._current_graph_task_id() != -1
