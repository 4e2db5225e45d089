"""Attention probabilities (layertap.attention) against independent references: SDPA itself, the
modules' own ``need_weights=True``, and Hugging Face / timm eager attention while the tapped model
runs fused."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

from layertap.attention import mha_weights, reduce_weights, sdpa_weights
from layertap.errors import ArgumentError

TOL = 1e-6  # probabilities are in [0, 1]: absolute difference


def close(actual: torch.Tensor, expected: torch.Tensor, tol: float = TOL) -> None:
    torch.testing.assert_close(actual.double(), expected.double(), atol=tol, rtol=0)


# ---------------------------------------------------------------------------------- sdpa_weights
def sdpa_reference(q, k, **kwargs) -> torch.Tensor:
    """SDPA's own probabilities: with the identity as value, its output *is* the probability matrix."""
    eye = torch.eye(k.size(-2), dtype=torch.float64).expand(*k.shape[:-1], k.size(-2))
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q.double(), k.double(), eye, **kwargs)


def _bool_mask(*shape) -> torch.Tensor:
    mask = torch.rand(*shape) > 0.3
    mask[..., 0] = True  # no row fully masked
    return mask


SDPA_CASES = {
    "plain": (6, 6, lambda: {}),
    "bool mask LxS": (5, 7, lambda: {"attn_mask": _bool_mask(5, 7)}),
    "bool mask broadcast over heads and queries": (5, 7, lambda: {"attn_mask": _bool_mask(2, 1, 1, 7)}),
    "float mask": (5, 7, lambda: {"attn_mask": torch.randn(2, 3, 5, 7, dtype=torch.float64)}),
    "causal": (6, 6, lambda: {"is_causal": True}),
    "causal, fewer queries": (3, 7, lambda: {"is_causal": True}),
    "causal, more queries": (7, 3, lambda: {"is_causal": True}),
    "scale": (5, 7, lambda: {"scale": 0.37}),
    "gqa": (5, 7, lambda: {"enable_gqa": True}),
}


@pytest.mark.parametrize("case", SDPA_CASES)
def test_sdpa_weights_equal_sdpa(case):
    length, keys, make = SDPA_CASES[case]
    kwargs = make()
    q = torch.randn(2, 3, length, 8, dtype=torch.float64)
    k = torch.randn(2, 1 if kwargs.get("enable_gqa") else 3, keys, 8, dtype=torch.float64)
    if kwargs.get("enable_gqa"):
        q = torch.randn(2, 6, length, 8, dtype=torch.float64)
    expected = sdpa_reference(q, k, **kwargs)
    close(sdpa_weights(q, k, **kwargs), expected)
    close(sdpa_weights(q.float(), k.float(), **kwargs), expected)  # float32 inputs: float32 precision


def test_sdpa_weights_masked_rows_are_zero_as_in_pytorch_kernels():
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 5, 8)
    mask = _bool_mask(4, 5)
    mask[2] = False
    p = sdpa_weights(q, k, attn_mask=mask)
    assert not p.isnan().any() and p[..., 2, :].eq(0).all()
    close(p, sdpa_reference(q, k, attn_mask=mask))


def test_sdpa_weights_half_inputs_give_float32():
    q, k = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 5, 8)
    p = sdpa_weights(q.half(), k.half(), attn_mask=torch.zeros(4, 5, dtype=torch.half))
    assert p.dtype == torch.float32
    close(p, sdpa_reference(q.half(), k.half()))


def test_sdpa_weights_causal_bias_object():
    from torch.nn.attention.bias import causal_lower_right

    q, k = torch.randn(1, 2, 3, 8), torch.randn(1, 2, 5, 8)
    bias = causal_lower_right(3, 5)
    close(sdpa_weights(q, k, attn_mask=bias), sdpa_reference(q, k, attn_mask=bias._materialize()))


def test_sdpa_weights_refuse_mask_and_causal():
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(ArgumentError, match="is_causal"):
        sdpa_weights(q, q, attn_mask=torch.ones(3, 3, dtype=torch.bool), is_causal=True)


# ---------------------------------------------------------------------------------- mha_weights
def mha_case(name: str):
    """(module, call args, call kwargs) for one nn.MultiheadAttention variant, in eval mode."""
    e, h, b, length, keys = 16, 4, 2, 5, 7
    options: dict = {"batch_first": "batch_first" in name}
    if "kdim" in name:
        options.update(kdim=12, vdim=10)
    if "no bias" in name:
        options["bias"] = False
    if "bias_kv" in name:
        options["add_bias_kv"] = True
    if "zero_attn" in name:
        options["add_zero_attn"] = True
    module = nn.MultiheadAttention(e, h, dropout=0.3, **options).eval()  # dropout: eval turns it off
    kdim = options.get("kdim", e)
    vdim = options.get("vdim", e)
    seq = (lambda n, d: torch.randn(b, n, d)) if options["batch_first"] else (lambda n, d: torch.randn(n, b, d))
    if "unbatched" in name:
        seq = lambda n, d: torch.randn(n, d)
    if "self" in name:
        x = seq(length, e)
        q = k = v = x
        keys = length
    else:
        q, k, v = seq(length, e), seq(keys, kdim), seq(keys, vdim)
    kwargs: dict = {}
    if "bool attn_mask" in name:
        kwargs["attn_mask"] = ~_bool_mask(length, keys)  # True = masked, in MHA
    if "float attn_mask" in name:
        kwargs["attn_mask"] = torch.randn(length, keys)
    if "3-D attn_mask" in name:
        kwargs["attn_mask"] = torch.randn(b * h, length, keys)
    if "bool padding" in name:
        pad = torch.zeros(b, keys, dtype=torch.bool)
        pad[1, -2:] = True
        kwargs["key_padding_mask"] = pad
    if "float padding" in name:
        kwargs["key_padding_mask"] = torch.randn(b, keys)
    if "causal" in name:
        kwargs["attn_mask"] = nn.Transformer.generate_square_subsequent_mask(length)
        kwargs["is_causal"] = True
    return module, (q, k, v), kwargs


MHA_CASES = [
    "self batch_first",
    "self seq_first",
    "cross batch_first",
    "cross kdim batch_first",
    "cross kdim seq_first bool padding",
    "self unbatched",
    "cross unbatched float attn_mask",
    "self no bias batch_first",
    "cross bias_kv batch_first bool attn_mask bool padding",
    "cross zero_attn seq_first float attn_mask",
    "cross bias_kv zero_attn batch_first 3-D attn_mask float padding",
    "self batch_first causal",
    "self batch_first causal float padding",
    "cross batch_first bool attn_mask",
]


@pytest.mark.parametrize("case", MHA_CASES)
def test_mha_weights_equal_the_modules_own(case):
    module, (q, k, v), kwargs = mha_case(case)
    with torch.no_grad():
        expected = module(q, k, v, need_weights=True, average_attn_weights=False, **kwargs)[1]
    close(mha_weights(module, q, k, v, **kwargs), expected)


def test_mha_weights_need_the_mask_for_is_causal():
    module = nn.MultiheadAttention(8, 2, batch_first=True).eval()
    x = torch.randn(1, 3, 8)
    with pytest.raises(ArgumentError, match="attn_mask"):
        mha_weights(module, x, x, is_causal=True)


# ---------------------------------------------------------------------------------- reductions
def test_reduce_weights():
    w = torch.softmax(torch.randn(2, 4, 5, 6), -1)
    assert reduce_weights(w) is w
    close(reduce_weights(w, "mean", "cls"), w[:, :, :1].mean(1, keepdim=True))
    close(reduce_weights(w, "max", "last"), w[:, :, -1:].amax(1, keepdim=True))
    with pytest.raises(ArgumentError, match="heads="):
        reduce_weights(w, heads="sum")  # type: ignore[arg-type]
    with pytest.raises(ArgumentError, match="rows="):
        reduce_weights(w, rows="first")  # type: ignore[arg-type]


def test_rows_cost_one_query_and_agree_with_all_rows():
    from layertap.attention import _mha, _sdpa

    q, k = torch.randn(2, 3, 6, 8), torch.randn(2, 3, 9, 8)
    mask = torch.randn(2, 1, 6, 9)
    full = _sdpa(q, k, mask, False, None, False, slice(None))
    for rows in ("cls", "last"):
        got = _sdpa(q, k, mask, False, None, False, {"cls": slice(0, 1), "last": slice(-1, None)}[rows])
        assert got.shape == (2, 3, 1, 9)
        close(got, reduce_weights(full, rows=rows))
    causal = _sdpa(q, k[..., :6, :], None, True, None, False, slice(-1, None))
    close(causal, sdpa_weights(q, k[..., :6, :], is_causal=True)[..., -1:, :])
    module, (x, y, _), kwargs = mha_case("cross bias_kv zero_attn batch_first 3-D attn_mask float padding")
    close(_mha(module, x, y, kwargs["key_padding_mask"], kwargs["attn_mask"], False, slice(0, 1)),
          mha_weights(module, x, y, **kwargs)[..., :1, :])
