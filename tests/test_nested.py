"""layertap.nested's walk of a call's inputs and outputs, against torch.utils._pytree itself: the
fast path for plain containers (a call's ``Inputs(args, kwargs)``) gives pytree's structure and
order, and everything else still goes through pytree."""

from __future__ import annotations

import collections
from typing import NamedTuple

import pytest
import torch
import torch.utils._pytree as pytree
from torch.nn.utils.rnn import pack_padded_sequence

from layertap import nested
from layertap.tap import Inputs


class Pair(NamedTuple):
    first: object
    second: object


def _t(*shape):
    return torch.randn(*shape)


FLAT = {
    "tuple": lambda: (_t(2), 3, None, _t(1, 2)),
    "list": lambda: [_t(2), "x", torch.float16, _t(3)],
    "dict": lambda: {"b": _t(2), "a": 0.5, "c": _t(1)},  # insertion order, not sorted
    "Inputs": lambda: Inputs((_t(2, 3), _t(2, 3), None), {"attn_mask": _t(2, 3), "dropout_p": 0.0, "is_causal": False, "scale": None}),
    "nested": lambda: (_t(1), [_t(2), {"k": (_t(3), 4)}], Pair(_t(5), slice(1, 2))),
}
NOT_FLAT = {
    "OrderedDict": lambda: collections.OrderedDict(b=_t(2), a=_t(1)),
    "return_types": lambda: torch.max(_t(3, 4), 1),
    "packed": lambda: pack_padded_sequence(_t(3, 2, 4), torch.tensor([3, 2])),
    "object inside": lambda: (_t(2), object()),
}


@pytest.mark.parametrize("case", list(FLAT) + list(NOT_FLAT))
def test_map_and_leaves_equal_pytrees(case):
    obj = {**FLAT, **NOT_FLAT}[case]()
    assert nested._flat(obj, torch.Tensor) == (case in FLAT)
    mapped = nested.map_leaves(lambda t: t * 2, obj)
    if case != "packed":  # pytree would rebuild a PackedSequence through __new__ (see nested's docstring)
        expected = pytree.tree_map(lambda x: x * 2 if isinstance(x, torch.Tensor) else x, obj)
        assert type(mapped) is type(expected)
        got, want = pytree.tree_leaves(mapped), pytree.tree_leaves(expected)
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert (torch.equal(a, b) if isinstance(a, torch.Tensor) else a is b or a == b), (a, b)
        assert pytree.tree_structure(mapped) == pytree.tree_structure(expected)
    leaves = nested.tensors(obj)
    expected_leaves = [x.data if isinstance(x, torch.nn.utils.rnn.PackedSequence) else x for x in pytree.tree_leaves(obj, is_leaf=nested._is_packed)]
    expected_leaves = [x for x in expected_leaves if isinstance(x, torch.Tensor)]
    assert len(leaves) == len(expected_leaves) and all(a is b for a, b in zip(leaves, expected_leaves))


def test_a_size_stays_a_size():
    """pytree would rebuild a torch.Size as a plain tuple; the fast path keeps the value as given."""
    size = torch.Size([2, 3])
    assert type(nested.map_leaves(lambda t: t, (_t(1), size))[1]) is torch.Size


def test_a_flat_structure_is_mapped_once_per_leaf():
    """fn runs once per tensor (it may copy or record), never again after a fallback."""
    calls = []
    obj = FLAT["nested"]()
    nested.map_leaves(lambda t: calls.append(t) or t, obj)
    assert len(calls) == 4
