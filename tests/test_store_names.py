"""Array keys of a store are unique: a module named like another layer's tensor is refused before writing."""

import pytest
import torch
from torch import nn

import layertap
from layertap.errors import StoreError


class Pair(nn.Module):
    def forward(self, x):
        return x * 2, x * 3


class Clash(nn.Module):
    """``d.a`` returns two tensors (stored as ``d.a/0`` and ``d.a/1``) beside a module named ``d.a/0``."""

    def __init__(self):
        super().__init__()
        self.d = nn.ModuleDict({"a": Pair(), "a/0": nn.Identity()})

    def forward(self, x):
        y, z = self.d["a"](x)
        return self.d["a/0"](y * 10) + z


@pytest.mark.parametrize("suffix, format", [("s.zarr", "zarr"), ("s.npyd", "npy"), ("s.h5", "hdf5")])
def test_a_module_named_like_a_tensor_of_another_is_refused_before_anything_is_written(tmp_path, suffix, format):
    out = tmp_path / suffix
    with pytest.raises(StoreError, match=r"^tensor 0 of layer 'd\.a' and layer 'd\.a/0' would both be stored as 'd\.a/0'") as caught:
        layertap.extract_dataset(Clash(), torch.ones(4, 4), ["d.a", "d.a/0"], out, format=format, progress=False, num_workers=0)
    assert "\n" not in str(caught.value)
    assert not out.exists()


@pytest.mark.parametrize("suffix", ["s.zarr", "s.npyd", "s.h5"])
def test_a_file_name_that_is_not_utf8_is_stored_with_its_bytes_escaped(tmp_path, suffix):
    import os

    from layertap.shapes import generate, save_images

    folder = tmp_path / "images"
    save_images(generate(3, seed=4, size=16), folder)
    first = sorted(folder.rglob("*.png"))[0]
    os.rename(first, os.path.join(os.fsencode(first.parent), b"caf\xe9.png"))  # Latin-1, from an old archive
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.AdaptiveAvgPool2d(1), nn.Flatten())
    out = tmp_path / suffix
    with layertap.extract_dataset(model, str(folder), ["2"], out, batch_size=2, num_workers=0, progress=False) as store:
        assert store.complete and bool(store.valid.all())
        ids = [str(i) for i in store.ids]
    assert any(i.endswith("caf\\xe9.png") for i in ids), ids  # the byte shown, not a crash of the whole run
    # a rerun finds the same ids (the digest is of the same names) and returns the store as it is
    with layertap.extract_dataset(model, str(folder), ["2"], out, batch_size=2, num_workers=0, progress=False) as again:
        assert [str(i) for i in again.ids] == ids
