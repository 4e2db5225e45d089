"""A resume proves that it computes what the store was written with, or it is refused: never a
store of rows from two computations. Each run here is interrupted after its first chunks, the
computation changed, and the same extraction run again."""

from __future__ import annotations

import copy
import os
import random
import re
from os import environ

import numpy as np
import pytest
import torch
import torchvision.transforms as T
from torch import nn

import layertap
from layertap.data import image_to_tensor
from layertap.errors import ArgumentError, DataChangedError
from layertap.extract.digests import code_fingerprint, model_fingerprint
from layertap.shapes import generate, save_images
from layertap.store import StoreError
from layertap.store.writer import StoreWriter

OPTIONS = dict(batch_size=4, chunk_size=4, num_workers=0, progress=False)  # one batch per chunk


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        # the shape of resnet50's layer1.0.conv1: 4096 weights, of which the old fingerprint sampled every 16th
        self.conv1 = nn.Conv2d(64, 64, 1, bias=False)
        self.bn1 = nn.BatchNorm2d(64)
        self.relu = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.relu(self.bn1(self.conv1(x))) + x


class Tiny(nn.Module):
    """A small ResNet-like net, with a non-persistent buffer (not in its state_dict)."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv1 = nn.Conv2d(3, 64, 3, padding=1)
        self.layer1 = nn.Sequential(Block())
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.register_buffer("offset", torch.zeros(64, 1, 1), persistent=False)
        with torch.no_grad():  # statistics unlike the defaults, so eps and train() show in the values
            self.layer1[0].bn1.running_var.uniform_(0.01, 0.1)
            self.layer1[0].bn1.running_mean.uniform_(-0.5, 0.5)
        self.eval()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.avgpool(self.layer1(self.conv1(x) + self.offset))


@pytest.fixture(scope="module")
def data():
    return torch.utils.data.TensorDataset(torch.randn(16, 3, 8, 8, generator=torch.Generator().manual_seed(1)))


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    folder = tmp_path_factory.mktemp("shapes") / "images"
    save_images(generate(12, seed=2, size=16), folder)
    return folder


def interrupted(model, data, out, layers, **options):
    """Run an extraction that an error stops in its third batch: chunks 0 and 1 are written."""
    calls: list[int] = []

    def stop(module, args):
        if len(args[0]) == 4:  # not the batch of 3 that finds the batch dimension of a [4, 4] output
            calls.append(1)
        if len(calls) > 2:
            raise RuntimeError("interrupted")

    handle = model.register_forward_pre_hook(stop)
    try:
        with pytest.raises(Exception, match="interrupted"):
            layertap.extract_dataset(model, data, layers, out, **OPTIONS, **options)
    finally:
        handle.remove()
    return written(out)


def written(out):
    """The chunks a store holds, and its arrays."""
    writer = StoreWriter.open(out)
    try:
        done = sorted(writer.done())
        assert done == [0, 1] and not writer.meta["complete"]
        return done, {s.key: np.array(writer.backend.array(s.path)) for s in writer.specs}
    finally:
        writer.close()


def assert_untouched(out, before):
    done, arrays = written(out)
    assert done == before[0]
    for key, a in arrays.items():
        assert np.array_equal(a, before[1][key], equal_nan=True), key


def features(model, x, layers, **options):
    return {k: v.numpy() for k, v in layertap.extract(model, x, layers, **options).items()}


def uninterrupted(model, x, layers):
    """The features of one run, batch by batch as it computes them."""
    parts = [features(model, x[i : i + 4], layers) for i in range(0, len(x), 4)]
    return {k: np.concatenate([p[k] for p in parts]) for k in parts[0]}


# ------------------------------------------------------------------- the model's fingerprint
def ablate(model):
    with torch.no_grad():
        model.layer1[0].conv1.weight[:, 1] = 0  # one input channel off: an ablation


def change_buffer(model):
    model.offset.fill_(0.5)


def change_eps(model):
    model.layer1[0].bn1.eps = 0.05


def gelu(model):
    model.layer1[0].relu = nn.GELU()  # no weights of its own: the state is the same


def train(model):
    model.train()


FINGERPRINT = r"'state (\w+), tree (\w+), code (\w+)'"


def differing_parts(message: str) -> set[str]:
    """Which parts of the model's fingerprint a settings error says differ."""
    found = re.search(rf"model \(fingerprint of its state, tree and code\) {FINGERPRINT}, now {FINGERPRINT}", message)
    assert found, message
    return {part for i, part in enumerate(("state", "tree", "code")) if found[i + 1] != found[i + 4]}


@pytest.mark.parametrize(
    ("change", "parts"),
    [(ablate, {"state"}), (change_buffer, {"state"}), (change_eps, {"tree"}), (gelu, {"tree", "code"}), (train, {"tree"})],
)
def test_a_resume_after_the_model_changed_is_refused(data, tmp_path, change, parts):
    model, x = Tiny(), data.tensors[0][:4]
    before_values = features(model, x, ["layer1", "avgpool"])
    out = tmp_path / "f.zarr"
    before = interrupted(model, data, out, ["layer1", "avgpool"])
    change(model)
    changed = features(copy.deepcopy(model), x, ["layer1", "avgpool"])  # a copy: in train() the forward moves BN's statistics
    assert not np.allclose(changed["layer1"], before_values["layer1"], atol=1e-4)  # the change shows in the features
    with pytest.raises(StoreError, match=rf"was written with other settings: model \(fingerprint of its state, tree and code\) {FINGERPRINT}, now {FINGERPRINT}: pass overwrite=True") as e:
        layertap.extract_dataset(model, data, ["layer1", "avgpool"], out, **OPTIONS)
    assert differing_parts(str(e.value)) == parts  # the message says where the difference is
    assert_untouched(out, before)


def test_every_tensor_counts_whole_and_nothing_else_does():
    a, b = Tiny(), Tiny()
    assert model_fingerprint(a) == model_fingerprint(b)  # the same model made twice
    with torch.no_grad():
        b.layer1[0].conv1.weight[5, 7] += 1e-7  # one weight, by a hair
    assert model_fingerprint(a) != model_fingerprint(b)
    # where the weights sit, and hooks (layertap's own taps), are not the computation
    b = Tiny()
    b.register_forward_hook(lambda *args: None)
    b.to(torch.float32).share_memory()
    assert model_fingerprint(a) == model_fingerprint(b)


# --------------------------------------------------------------- transforms and reductions
def first(im):
    return image_to_tensor(im)


def second(im):
    return image_to_tensor(im).flip(-1)


class Scaled:
    """A transform object with no __repr__ of its own."""

    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, im):
        return image_to_tensor(im) * self.factor


TRANSFORMS = {
    "lambda": (lambda im: image_to_tensor(im), lambda im: image_to_tensor(im).flip(-1)),
    "Compose of Lambda": (T.Compose([T.Lambda(first)]), T.Compose([T.Lambda(second)])),
    "object without repr": (Scaled(1.0), Scaled(2.0)),
}


@pytest.mark.parametrize("case", list(TRANSFORMS))
def test_a_resume_with_another_transform_is_refused(images, tmp_path, case):
    old, new = TRANSFORMS[case]
    model, out = Tiny(), tmp_path / "f.zarr"
    before = interrupted(model, images, out, ["avgpool"], transform=old)
    with pytest.raises(StoreError, match=r"was written with other settings: transform '.*\(code \w+\)', now '.*\(code \w+\)'"):
        layertap.extract_dataset(model, images, ["avgpool"], out, transform=new, **OPTIONS)
    assert_untouched(out, before)
    # the same transform (made again) resumes
    again = {"lambda": old, "Compose of Lambda": T.Compose([T.Lambda(first)]), "object without repr": Scaled(1.0)}[case]
    store = layertap.extract_dataset(model, images, ["avgpool"], out, transform=again, **OPTIONS)
    whole = layertap.extract_dataset(model, images, ["avgpool"], tmp_path / "whole.zarr", transform=again, **OPTIONS)
    assert store.complete and np.array_equal(store.to_numpy("avgpool"), whole.to_numpy("avgpool"))


def test_a_resume_with_another_reduce_callable_is_refused(data, tmp_path):
    model, out = Tiny(), tmp_path / "f.zarr"
    before = interrupted(model, data, out, ["layer1"], reduce=lambda t: t.mean(dim=(2, 3)))
    with pytest.raises(StoreError, match=r"other settings: reduce '.*<lambda> \(code \w+\)', now '.*<lambda> \(code \w+\)'"):
        layertap.extract_dataset(model, data, ["layer1"], out, reduce=lambda t: t.amax(dim=(2, 3)), **OPTIONS)
    assert_untouched(out, before)


def test_code_is_told_apart_by_what_it_computes():
    k = 2.0

    def scale(t, factor=3.0):
        return t * factor * k

    same = code_fingerprint(scale)
    assert code_fingerprint(lambda t: t.mean(0)) != code_fingerprint(lambda t: t.amax(0))
    assert code_fingerprint(lambda t: t.mean(0)) == code_fingerprint(lambda t: t.mean(0))  # the same code
    k = 4.0  # a closure's value
    assert code_fingerprint(scale) != same
    scale.__defaults__ = (5.0,)  # a default
    k = 2.0
    assert code_fingerprint(scale) != same
    # callable objects by their attributes, nested and cyclic ones too
    assert code_fingerprint(T.Compose([T.Lambda(first), Scaled(1.0)])) != code_fingerprint(T.Compose([T.Lambda(first), Scaled(1.5)]))
    loop = Scaled(1.0)
    loop.me = loop
    assert code_fingerprint(loop) == code_fingerprint(loop)
    # a set's order changes with the process's hash seed; its fingerprint does not
    assert code_fingerprint({"a", "b", "c"}) == code_fingerprint({"c", "b", "a"})


# ------------------------------------------------------------------ the recompute check
SHIFT = 0.0  # read by Shifted.forward: what no fingerprint sees (like an edited forward)


class Shifted(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a = nn.Linear(12, 8)
        self.b = nn.Linear(8, 4)

    def forward(self, x):
        return self.b(self.a(x.flatten(1)) + SHIFT)


def test_a_changed_computation_that_no_fingerprint_sees_is_found_by_recomputing(data, tmp_path, monkeypatch):
    x = data.tensors[0][:, :, :2, :2]
    dataset, out = torch.utils.data.TensorDataset(x), tmp_path / "f.h5"
    model = Shifted()
    before = interrupted(model, dataset, out, ["a", "b"])
    monkeypatch.setitem(globals(), "SHIFT", 0.25)
    expected = np.abs(features(model, x[:4], "b")["b"] - before[1]["b"][:4]).max()
    with pytest.raises(DataChangedError, match=r"4 of its written samples \(from 0\), computed again, differ from the stored rows in 'b' by up to (\S+) \(max abs; verify='close' allows") as e:
        layertap.extract_dataset(model, dataset, ["a", "b"], out, **OPTIONS)
    assert f"by up to {expected:.3g} " in str(e.value) and "\n" not in str(e.value)  # 'a' is unchanged: 'b' is the first
    assert_untouched(out, before)  # nothing new was written


class Stream(torch.utils.data.IterableDataset):
    """Samples that can only be read in order, though their number is known."""

    def __init__(self, x: torch.Tensor) -> None:
        self.x = x

    def __len__(self) -> int:
        return len(self.x)

    def __iter__(self):
        return iter(self.x)


@pytest.mark.parametrize("kind", ["batches of unknown number", "a stream of known length"])
def test_data_read_in_order_is_checked_and_recomputed_too(data, tmp_path, monkeypatch, kind):
    x = data.tensors[0][:, :, :2, :2]

    def read(x):
        return iter([x[i : i + 4] for i in range(0, 16, 4)]) if kind.startswith("batches") else Stream(x)

    model, out = Shifted(), tmp_path / "f.zarr"
    before = interrupted(model, read(x), out, ["a", "b"])
    with pytest.raises(DataChangedError, match=r"sample 0 is not what .* was written from"):
        layertap.extract_dataset(model, read(x * 2), ["a", "b"], out, **OPTIONS)
    monkeypatch.setitem(globals(), "SHIFT", 0.25)
    with pytest.raises(DataChangedError, match=r"differ from the stored rows in 'b'"):
        layertap.extract_dataset(model, read(x), ["a", "b"], out, **OPTIONS)
    assert_untouched(out, before)
    monkeypatch.setitem(globals(), "SHIFT", 0.0)
    store = layertap.extract_dataset(model, read(x), ["a", "b"], out, verify="exact", **OPTIONS)
    assert store.complete and np.array_equal(store.to_numpy("b"), uninterrupted(model, x, "b")["b"])


def test_close_allows_rounding_and_exact_does_not(data, tmp_path, monkeypatch):
    x = data.tensors[0][:, :, :2, :2]
    dataset, model = torch.utils.data.TensorDataset(x), Shifted()
    for verify, out in (("exact", tmp_path / "same"), ("exact", tmp_path / "shifted"), ("close", tmp_path / "close")):
        monkeypatch.setitem(globals(), "SHIFT", 0.0)
        interrupted(model, dataset, out, ["a", "b"], format="npy")
        monkeypatch.setitem(globals(), "SHIFT", 0.0 if out.name == "same" else 1e-6)  # 1e-6: as another kernel might round
        if out.name == "shifted":
            with pytest.raises(DataChangedError, match=r"by up to \S+ \(max abs; verify='exact' allows 0\)"):
                layertap.extract_dataset(model, dataset, ["a", "b"], out, verify=verify, format="npy", **OPTIONS)
            continue
        store = layertap.extract_dataset(model, dataset, ["a", "b"], out, verify=verify, format="npy", **OPTIONS)
        reference = uninterrupted(model, x, ["a", "b"])
        for key in ("a", "b"):
            if verify == "exact":  # resumed unchanged: bit for bit an uninterrupted run
                assert np.array_equal(store.to_numpy(key), reference[key]), key
            else:  # within the stated tolerance of one run
                np.testing.assert_allclose(store.to_numpy(key), reference[key], rtol=0, atol=1e-4 * np.abs(reference[key]).max())
    with pytest.raises(ValueError, match="verify must be 'close', 'exact' or 'off', not 'yes'"):
        layertap.extract_dataset(model, dataset, ["a"], tmp_path / "x", verify="yes", **OPTIONS)


# ------------------------------------------------------- what the fingerprint also sees (issue 23 follow-up)
class Gated(Shifted):
    """A custom class whose forward may be edited; its layers are the library's."""

    def forward(self, x):
        return self.b(self.a(x.flatten(1)))


def clamped_forward(self, x):  # the edit: only large inputs change (not those of the first batch)
    return self.b(self.a(x.flatten(1).clamp(-20, 20)))


def large_after_the_first_batch(data):
    x = data.tensors[0][:, :, :2, :2].clone()
    x[4:] *= 10
    return x


def test_an_edited_forward_of_a_custom_class_is_refused(data, tmp_path, monkeypatch):
    x = large_after_the_first_batch(data)
    dataset, model, out = torch.utils.data.TensorDataset(x), Gated(), tmp_path / "f.zarr"
    before = interrupted(model, dataset, out, ["a", "b"])
    monkeypatch.setattr(Gated, "forward", clamped_forward)
    assert not np.allclose(features(model, x[4:8], "b")["b"], before[1]["b"][4:8], atol=1e-3)  # the edit shows in chunk 1
    with pytest.raises(StoreError, match=r"was written with other settings: model \(fingerprint of its state, tree and code\)") as e:
        layertap.extract_dataset(model, dataset, ["a", "b"], out, **OPTIONS)
    assert differing_parts(str(e.value)) == {"code"}
    assert_untouched(out, before)


def test_the_code_of_each_class_counts_and_is_hashed_again_when_edited(monkeypatch):
    model = Gated()
    original = model_fingerprint(model)
    assert model_fingerprint(Gated()) == original  # the same class, made again
    monkeypatch.setattr(Gated, "forward", clamped_forward)
    edited = model_fingerprint(model)
    assert edited != original  # the class's own code (not cached from before the edit)
    monkeypatch.setattr(nn.Linear, "extra_repr", lambda self: f"in_features={self.in_features}, out_features={self.out_features}, bias=True")
    assert model_fingerprint(model) != edited  # a base library class's code too
    monkeypatch.undo()
    assert model_fingerprint(model) == original


GATE = float("inf")  # read by Thresholded.forward: a global no fingerprint sees


class Thresholded(Gated):
    def forward(self, x):
        return self.b(self.a(x.flatten(1).clamp(-GATE, GATE)))


def test_the_recompute_check_computes_the_last_written_chunk_too(data, tmp_path, monkeypatch):
    # a change that shows only on some data: not in chunk 0's first batch, in chunk 1's
    x = large_after_the_first_batch(data)
    dataset, model, out = torch.utils.data.TensorDataset(x), Thresholded(), tmp_path / "f.zarr"
    before = interrupted(model, dataset, out, ["a", "b"])
    monkeypatch.setitem(globals(), "GATE", 20.0)
    assert np.array_equal(features(model, x[:4], "a")["a"], before[1]["a"][:4])  # chunk 0 is unchanged
    with pytest.raises(DataChangedError, match=r"4 of its written samples \(from 4\), computed again, differ from the stored rows in 'a'"):
        layertap.extract_dataset(model, dataset, ["a", "b"], out, **OPTIONS)
    assert_untouched(out, before)


class Massive(nn.Module):
    """One channel of a huge constant size (a 'massive activation'), seven ordinary ones."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.conv = nn.Conv2d(3, 8, 3, padding=1)
        self.pool = nn.AdaptiveAvgPool2d(1)
        with torch.no_grad():
            self.conv.bias[7] = 1e4
        self.eval()

    def forward(self, x):
        return self.pool(self.conv(x))


def test_close_is_per_feature_so_a_massive_channel_hides_no_ablation(data, tmp_path):
    model, out = Massive(), tmp_path / "f.zarr"
    before = interrupted(model, data, out, ["pool"])
    # channel 0 off (a hook: what no fingerprint sees); it is far below 1e-4 of the 1e4 channel
    model.conv.register_forward_hook(lambda m, args, y: y * torch.tensor([0.0] + [1.0] * 7).view(1, 8, 1, 1))
    expected = np.abs(before[1]["pool"][:4, 0]).max()
    assert expected < 1e-4 * np.abs(before[1]["pool"][:8]).max()  # the written rows
    with pytest.raises(DataChangedError, match=r"in 'pool' by up to (\S+) \(max abs; verify='close' allows \S+ in feature 0, which differs by") as e:
        layertap.extract_dataset(model, data, ["pool"], out, **OPTIONS)
    assert f"by up to {expected:.3g} " in str(e.value)
    assert_untouched(out, before)


def test_close_allows_rounding_in_each_feature_and_near_zero():
    from layertap.extract.settings import _difference

    old = np.array([[1e4, 1.0, 0.0], [1e4, -2.0, 1e-9]], dtype=np.float32)
    assert _difference(old * (1 + 1e-6), old, 1e-4) is None  # rounding, relative to each feature
    near_zero = old.copy()
    near_zero[:, 2] += 1e-6  # a feature near 0: held to 1e-4 of 1e-3 of the array's largest (1e-3), not to exact
    assert _difference(near_zero, old, 1e-4) is None
    ablated = old.copy()
    ablated[:, 1] = 0
    assert _difference(ablated, old, 1e-4) == (2.0, 1, 2.0, pytest.approx(1e-3))  # 1e-4 of max(2, 1e-3 * 1e4)
    assert _difference(old.astype(np.int64) + [[0, 0, 1], [0, 0, 0]], old.astype(np.int64), 1e-4) == (1.0, 2, 1.0, 0.0)


def test_an_unrelated_environment_variable_changes_no_fingerprint(monkeypatch):
    def reduce(t):
        return t.mean((2, 3)) * (2 if environ.get("FEATURES_DEBUG") else 1)  # a global: os.environ itself

    before = code_fingerprint(reduce)
    monkeypatch.setenv("SOME_UNRELATED_VARIABLE", "changed")  # another shell, a job id
    assert code_fingerprint(reduce) == before


def test_seeded_random_generators_count_by_their_state():
    def closing_over(generator):
        return lambda t: t + torch.rand(1, generator=generator) if isinstance(generator, torch.Generator) else t + generator.random()

    for make in (random.Random, lambda seed: torch.Generator().manual_seed(seed), np.random.default_rng, np.random.RandomState):
        assert code_fingerprint(closing_over(make(0))) == code_fingerprint(closing_over(make(0))), make
        assert code_fingerprint(closing_over(make(0))) != code_fingerprint(closing_over(make(1))), make


class Opaque(torch.Tensor):
    """A tensor whose values cannot be read here (like a sharded or fake tensor)."""

    @staticmethod
    def __new__(cls, shape):
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=torch.float32)

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        raise RuntimeError(f"{func} is not supported here")


def test_models_with_lazy_nested_or_unreadable_tensors_are_fingerprinted_or_refused_in_one_line(tmp_path):
    torch.manual_seed(0)
    lazy = nn.Sequential(nn.LazyLinear(3), nn.ReLU())
    uninitialized = model_fingerprint(lazy)  # no values yet: its kind
    store = layertap.extract_dataset(lazy, torch.randn(8, 4), ["0"], tmp_path / "lazy.zarr", **OPTIONS)
    assert store.complete and model_fingerprint(lazy) != uninitialized  # materialized: its values
    pieces = [torch.ones(2), torch.ones(3)]
    nested = [nn.Linear(3, 3) for _ in range(3)]
    for module in nested[1:]:
        module.load_state_dict(nested[0].state_dict())
    for module, last in zip(nested, (1.0, 1.0, 2.0)):
        module.register_buffer("n", torch.nested.nested_tensor([pieces[0], pieces[1] * last]))
    assert model_fingerprint(nested[0]) == model_fingerprint(nested[1])
    assert model_fingerprint(nested[0]) != model_fingerprint(nested[2])  # the pieces' values count
    opaque = nn.Linear(3, 3)
    opaque.register_buffer("table", Opaque((2, 2)))
    with pytest.raises(ArgumentError, match=r"^cannot fingerprint buffer 'table' \(torch.strided, torch.float32, Opaque\): its values cannot be read .*: hold it as a plain dense tensor") as e:
        model_fingerprint(opaque)
    assert "\n" not in str(e.value)


def test_ids_that_are_not_utf8_are_hashed(tmp_path):
    from layertap.data import open_data
    from layertap.extract.settings import _ids_digest

    folder = tmp_path / "images"
    save_images(generate(2, seed=2, size=16), folder)
    first = next(p for p in folder.rglob("*.png"))
    digest = _ids_digest(open_data(folder, batch_size=2))
    os.rename(first, os.path.join(os.fsencode(first.parent), b"caf\xe9.png"))  # Latin-1, from an old archive
    source = open_data(folder, batch_size=2)
    assert any("\udce9" in i for i in source.ids)  # the OS gives it surrogate-escaped
    assert _ids_digest(source) not in (None, digest)
