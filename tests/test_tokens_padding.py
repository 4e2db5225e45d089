"""Models that let a batch's padding into its real tokens are refused, never stored wrong.

layertap pads each batch on the right with the mask, which is exact for a model that honours its
``attention_mask``. Two kinds do not: a forward without the parameter (FNet: ``**kwargs`` swallow
the mask, and its Fourier mixing spreads the padding into every token), and one that takes it but
reads the padding anyway (ConvBERT's span convolution). The reference is each document run alone,
with no padding at all; both run exactly with ``batch_size=1``.
"""

from __future__ import annotations

import pytest
import tokens_models as tm
import torch
import transformers
from torch import nn

import layertap
from layertap.errors import ArgumentError
from layertap.extract.batches import takes_mask

TEXTS = ["the cat sat on the mat", "once upon a time there was a little girl who lived near the forest", "dogs ran far"]


@pytest.fixture(scope="module")
def tokenizer():
    return tm.minilm_tokenizer()


def fnet(tokenizer) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.FNetConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, intermediate_size=64, max_position_embeddings=128)
    return transformers.FNetModel(config).eval()


def convbert(tokenizer) -> nn.Module:
    torch.manual_seed(0)
    config = transformers.ConvBertConfig(
        vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64,
        embedding_size=32, conv_kernel_size=9, head_ratio=2,
    )  # fmt: skip
    return transformers.ConvBertModel(config).eval()


def alone(model: nn.Module, tokenizer, layer: str, text: str) -> torch.Tensor:
    """The layer's rows for ``text`` run alone (a clone in a forward hook)."""
    got = []
    handle = model.get_submodule(layer).register_forward_hook(lambda m, i, o: got.append((o[0] if isinstance(o, tuple) else o)[0].clone()))
    with torch.no_grad():
        model(**tokenizer(text, return_tensors="pt", return_token_type_ids=False))
    handle.remove()
    return got[0]


@pytest.mark.parametrize(
    ("build", "refusal"),
    [
        (fnet, r"FNetModel.forward takes no attention_mask.*pass batch_size=1"),
        (convbert, r"layer 'encoder.layer.1' of ConvBertModel computes other values for a document's real tokens when padding "
                   r"follows them \(up to .* apart\).*Pass batch_size=1"),
    ],
)  # fmt: skip
def test_a_model_that_lets_padding_in_is_refused_and_runs_exactly_one_document_a_batch(tokenizer, tmp_path, build, refusal):
    model = build(tokenizer)
    with pytest.raises(ArgumentError, match=refusal):
        layertap.extract_tokens(model, TEXTS, "encoder.layer.1", out=tmp_path / "s.zarr", tokenizer=tokenizer, batch_size=2, progress=False)
    assert not (tmp_path / "s.zarr").exists()  # nothing left to mix with: the fix runs into the same path
    store = layertap.extract_tokens(model, TEXTS, "encoder.layer.1", out=tmp_path / "s.zarr", tokenizer=tokenizer, batch_size=1, progress=False)
    rows, docs = store.read("encoder.layer.1"), store.docs[:]
    for d, text in enumerate(TEXTS):
        torch.testing.assert_close(rows[torch.from_numpy(docs == d)], alone(model, tokenizer, "encoder.layer.1", text), atol=1e-5, rtol=1e-5)


def test_with_padding_the_leak_is_real_and_the_mask_honouring_twin_is_exact(tokenizer, tmp_path):
    """What the refusal prevents, by hand: ConvBERT's padded rows are off, BERT's (same tokenizer,
    same batch) are not, and BERT passes the check at batch_size=2."""
    texts = TEXTS[:2]
    batch = tokenizer(texts, return_tensors="pt", padding=True, padding_side="right", return_token_type_ids=False)
    real = int(batch["attention_mask"][0].sum())
    torch.manual_seed(0)
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2,
                                                          num_attention_heads=4, intermediate_size=64)).eval()  # fmt: skip
    for model, leaks in ((convbert(tokenizer), True), (bert, False)):
        got: list[torch.Tensor] = []
        handle = model.encoder.layer[1].register_forward_hook(lambda m, i, o, got=got: got.append((o[0] if isinstance(o, tuple) else o)[0, :real].clone()))
        with torch.no_grad():
            model(**batch)
        handle.remove()
        apart = float((got[0] - alone(model, tokenizer, "encoder.layer.1", texts[0])).abs().max())
        assert (apart > 1e-3) == leaks, (type(model).__name__, apart)
    store = layertap.extract_tokens(bert, texts, "encoder.layer.1", out=tmp_path / "s.zarr", tokenizer=tokenizer, batch_size=2, progress=False)
    rows, docs = store.read("encoder.layer.1"), store.docs[:]
    torch.testing.assert_close(rows[torch.from_numpy(docs == 0)], alone(bert, tokenizer, "encoder.layer.1", texts[0]), atol=1e-5, rtol=1e-5)


def test_a_wrapper_takes_the_mask_its_model_takes(tokenizer):
    model = fnet(tokenizer)
    assert not takes_mask(model) and not takes_mask(nn.DataParallel(model))
    bert = transformers.BertModel(transformers.BertConfig(vocab_size=100, hidden_size=8, num_hidden_layers=1, num_attention_heads=2, intermediate_size=8))
    assert takes_mask(bert) and takes_mask(nn.DataParallel(bert))


def test_a_bfloat16_model_stored_in_float32_is_not_taken_for_one_that_lets_padding_in(tokenizer, tmp_path):
    """Its rows with and without padding differ by bfloat16 rounding (0.0005 to 0.016 here), not
    by float32's: the check allows the coarser of the model's and the store's dtypes."""
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=32, num_hidden_layers=2, num_attention_heads=4, intermediate_size=64)
    model = transformers.BertModel(config).to(torch.bfloat16).eval()
    store = layertap.extract_tokens(model, TEXTS, "encoder.layer.1", out=tmp_path / "s.zarr", tokenizer=tokenizer, batch_size=3,
                                    dtype=torch.float32, progress=False)  # fmt: skip
    rows, docs = store.read("encoder.layer.1"), store.docs[:]
    assert rows.dtype == torch.float32
    for d, text in enumerate(TEXTS):
        torch.testing.assert_close(rows[torch.from_numpy(docs == d)], alone(model, tokenizer, "encoder.layer.1", text).float(), atol=0.05, rtol=0.02)
