"""The batch dimension of a stored output is known, not guessed: an output whose first size only
happens to equal the batch size is never stored as if it were batch-first."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import layertap
from layertap.store import StoreError

OPTIONS = dict(num_workers=0, progress=False)


class SequenceFirst(nn.Module):
    """Reads batch-first [B, T, H] inputs, runs a sequence-first encoder: its output is [T, B, H]."""

    def __init__(self, batch_first: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.batch_first = batch_first
        self.enc = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=batch_first)
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.enc(x if self.batch_first else x.transpose(0, 1))
        return h.mean(1 if self.batch_first else 0)


@pytest.fixture(scope="module")
def tokens():
    return torch.randn(8, 4, 8, generator=torch.Generator().manual_seed(1))  # 8 samples of T=4 steps


def test_a_sequence_first_output_whose_length_is_the_batch_size_is_refused(tokens, tmp_path):
    model, out = SequenceFirst(), tmp_path / "f.zarr"
    # T = 4 = the batch size: [4, 4, 8] looks batch-first, but dimension 1 is the batch
    with pytest.raises(StoreError, match=r"layer 'enc''s output has shape \[4, 4, 8\]: its batch of 4 is dimension 1, not the first.*batch_first=True"):
        layertap.extract_dataset(model, tokens, "enc", out, batch_size=4, **OPTIONS)
    assert not out.exists()
    # another batch size, the same answer
    with pytest.raises(StoreError, match=r"shape \[4, 2, 8\]: its batch of 2 is dimension 1, not the first"):
        layertap.extract_dataset(model, tokens, "enc", out, batch_size=2, **OPTIONS)
    # the fix the message names: put the batch first
    store = layertap.extract_dataset(model, tokens, "enc", out, batch_size=4, reduce=lambda t: t.transpose(0, 1), **OPTIONS)
    expected = torch.cat([layertap.extract(model, tokens[i : i + 4], "enc")["enc"].transpose(0, 1) for i in (0, 4)])
    assert torch.equal(store.to_torch("enc"), expected)


def test_a_batch_first_output_whose_length_is_the_batch_size_is_stored(tokens, tmp_path):
    model = SequenceFirst(batch_first=True)
    sizes = []
    model.register_forward_pre_hook(lambda m, args: sizes.append(len(args[0])))
    store = layertap.extract_dataset(model, tokens, "enc", tmp_path / "f.zarr", batch_size=4, **OPTIONS)
    expected = torch.cat([layertap.extract(model, tokens[i : i + 4], "enc")["enc"] for i in (0, 4)])
    assert store.complete and torch.equal(store.to_torch("enc"), expected)
    assert sizes[:4] == [4, 3, 4, 4]  # a batch of 3, once, told which dimension is the batch


def test_a_batch_of_one_is_checked_against_a_batch_of_two(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1)).eval()  # [1, 4, 1, 1]: three dimensions of 1
    x = torch.randn(3, 3, 8, 8)
    store = layertap.extract_dataset(model, x, "1", tmp_path / "f.zarr", batch_size=1, **OPTIONS)
    assert torch.equal(store.to_torch("1"), torch.cat([layertap.extract(model, x[i : i + 1], "1")["1"] for i in range(3)]))


class Table(nn.Module):
    """Returns a [4, 4] table whatever the batch: no dimension is the batch's."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.randn(4, 4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.weight


class WithTable(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.table = Table()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.table(x)


def test_an_output_without_a_batch_dimension_is_refused(tmp_path):
    with pytest.raises(StoreError, match=r"layer 'table''s output has shape \[4, 4\] for a batch of 4 and \[4, 4\] for 3, so no dimension is the batch's"):
        layertap.extract_dataset(WithTable(), torch.randn(8, 4), "table", tmp_path / "f.zarr", batch_size=4, **OPTIONS)
    assert not (tmp_path / "f.zarr").exists()
    # with another batch size it was refused already
    with pytest.raises(StoreError, match=r"shape \[4, 4\]: no dimension is its batch of 2"):
        layertap.extract_dataset(WithTable(), torch.randn(8, 4), "table", tmp_path / "f.zarr", batch_size=2, **OPTIONS)


@pytest.mark.parametrize("reduce", ["mean", "max", "flatten"])
def test_a_sequence_first_output_under_reduce_is_refused_and_a_batch_first_one_stored(tokens, tmp_path, reduce):
    # [T, B, H] = [4, 4, 8]: "mean"/"max" pool dimension 1 (the batch) to [4, 8], "flatten" gives
    # [4, 32]; both look batch-first, and only a batch of another size tells
    with pytest.raises(StoreError, match=r"layer 'enc''s output has shape \[4, \d+\] \(after reduce=\) for a batch of 4 and \[4, \d+\] for 3, so no dimension is the batch's: build the layer batch-first"):
        layertap.extract_dataset(SequenceFirst(), tokens, "enc", tmp_path / "f.zarr", batch_size=4, reduce=reduce, **OPTIONS)
    assert not (tmp_path / "f.zarr").exists()
    model = SequenceFirst(batch_first=True)
    store = layertap.extract_dataset(model, tokens, "enc", tmp_path / "g.zarr", batch_size=4, reduce=reduce, **OPTIONS)
    with torch.no_grad():
        h = model.enc(tokens)  # [B, T, H], the reference: each sample's own pooled row
    expected = {"mean": h.mean(1), "max": h.amax(1), "flatten": h.flatten(1)}[reduce]
    torch.testing.assert_close(store.to_torch("enc"), expected, rtol=1e-5, atol=1e-6)  # batches of 4 vs one of 8


def test_a_reduced_output_of_a_plainly_batch_first_layer_costs_no_second_batch(tmp_path):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 5, 3), nn.ReLU()).eval()  # [B, 5, 6, 6]: the batch size nowhere else
    sizes = []
    model.register_forward_pre_hook(lambda m, args: sizes.append(len(args[0])))
    x = torch.randn(8, 3, 8, 8)
    store = layertap.extract_dataset(model, x, "1", tmp_path / "f.zarr", batch_size=4, reduce="mean", **OPTIONS)
    assert sizes == [4, 4]
    with torch.no_grad():
        torch.testing.assert_close(store.to_torch("1"), model(x).mean((2, 3)), rtol=1e-5, atol=1e-6)
