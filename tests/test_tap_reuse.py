"""A tap kept over many forwards writes each copy into the memory of a copy it dropped.

Every value is checked bit for bit against a trusted clone-in-the-hook reference run in the same
forward; reuse is checked by ``data_ptr()``; a value the caller still holds (the tensor, a view,
a NumPy array, its storage, a DLPack capsule, an autograd graph, shared memory, the container
around it) is never written. The pool (`layertap.tap.pool`) holds at most what two forwards dropped,
and outlives the tap: a new tap's forward writes into the memory of the copies an earlier tap dropped.
"""

import contextlib
import gc
import importlib

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torchvision
from torch import nn
from torch.utils import dlpack

import layertap
from layertap.tap import pool

MODES = {"no_grad": torch.no_grad, "inference_mode": torch.inference_mode}


@pytest.fixture(autouse=True)
def empty_pool():
    """The pool is the process's: each test starts and ends with no free buffers (what earlier
    tests left for the cyclic gc collected first, so that it comes back now, not mid-test)."""
    gc.collect()
    pool.clear()
    yield
    gc.collect()
    pool.clear()


@pytest.fixture(scope="module")
def resnet50():
    torch.manual_seed(0)
    return torchvision.models.resnet50().eval()


@pytest.fixture(scope="module")
def resnet18():
    torch.manual_seed(0)
    return torchvision.models.resnet18().eval()


@contextlib.contextmanager
def reference(model, names):
    """Plain forward hooks that keep a clone of each output: the values the tap must equal."""
    got = {}
    handles = [
        model.get_submodule(n).register_forward_hook(lambda m, a, out, n=n: got.__setitem__(n, out.detach().clone()))
        for n in names
    ]
    try:
        yield got
    finally:
        for h in handles:
            h.remove()


def assert_equal_to(t, ref, names):
    for n in names:
        assert torch.equal(t[n], ref[n]), n  # the same computation on the same batch: bit-exact


def held_bytes(t):
    return sum(v.untyped_storage().nbytes() for v in t.values())


@pytest.mark.parametrize("mode", list(MODES))
def test_values_over_forwards_equal_clone_in_the_hook_and_reuse_the_previous_copy(resnet50, one_thread, mode):
    # every bn3 is followed by `out += identity` and an in-place ReLU, every other BN by an in-place ReLU
    names = layertap.select(resnet50, [nn.Conv2d, nn.BatchNorm2d])
    t = layertap.tap(resnet50, names)
    ptrs = []
    for _ in range(3):
        with MODES[mode](), reference(resnet50, names) as ref, t:
            resnet50(torch.randn(2, 3, 64, 64))
        assert_equal_to(t, ref, names)
        ptrs.append({n: t[n].data_ptr() for n in names})
    # under no_grad only the values a later in-place op changes are copies (each BN's but a
    # downsample's, which is added to the block's output); inference_mode copies all
    bns = [n for n in layertap.select(resnet50, nn.BatchNorm2d) if "downsample" not in n]
    copied = names if mode == "inference_mode" else bns
    assert [n for n in copied if ptrs[2][n] != ptrs[1][n]] == []
    # the pool outlives the tap: a new tap's first forward writes into the memory of its copies
    before = pool.held_bytes("cpu")
    del t
    assert pool.held_bytes("cpu") == before + sum(ref[n].nbytes for n in copied)
    with MODES[mode](), reference(resnet50, names) as ref, layertap.tap(resnet50, names) as t:
        resnet50(torch.randn(2, 3, 64, 64))
    assert_equal_to(t, ref, names)
    assert sorted(t[n].data_ptr() for n in copied) == sorted(ptrs[2][n] for n in copied)


def test_a_value_the_caller_holds_is_never_overwritten(resnet18, one_thread):
    names = ["bn1", "layer1.0.bn2", "layer2.1.bn1", "layer3.0.bn1", "layer4.1.bn2", "layer4.0.bn1", "layer2.0.bn1", "layer1.1.bn1"]
    t = layertap.tap(resnet18, names)
    x = torch.randn(2, 3, 64, 64)
    with torch.no_grad(), t:
        resnet18(x)
        resnet18(x)  # a learned forward: these are copies, replaced in place when nobody holds them
    held = {
        "bn1": t["bn1"],
        "layer1.0.bn2": t["layer1.0.bn2"][0],  # a view holds the memory, not the tensor object
        "layer2.1.bn1": t["layer2.1.bn1"].view(-1),
        "layer3.0.bn1": t["layer3.0.bn1"].numpy(),  # the array holds the memory
        "layer4.1.bn2": t["layer4.1.bn2"].untyped_storage(),
        "layer4.0.bn1": dlpack.to_dlpack(t["layer4.0.bn1"]),
    }
    # an autograd graph holds the C++ tensor it saved, not the Python object
    weight = torch.ones_like(t["layer2.0.bn1"], requires_grad=True)
    graph = (t["layer2.0.bn1"] * weight).sum()
    t["layer1.1.bn1"].share_memory_()  # then sent to another process, say, which reads it later
    before = {n: t[n].clone() for n in names}
    ptrs = {n: t[n].data_ptr() for n in names}
    with torch.no_grad(), reference(resnet18, names) as ref, t:
        resnet18(torch.randn(2, 3, 64, 64))
    assert_equal_to(t, ref, names)
    for n in names:
        assert t[n].data_ptr() != ptrs[n], n  # the tap holds a new tensor
    assert torch.equal(held["bn1"], before["bn1"])
    assert torch.equal(held["layer1.0.bn2"], before["layer1.0.bn2"][0])
    assert torch.equal(held["layer2.1.bn1"], before["layer2.1.bn1"].view(-1))
    assert torch.equal(torch.from_numpy(held["layer3.0.bn1"]), before["layer3.0.bn1"])
    storage = held["layer4.1.bn2"]
    assert torch.equal(torch.empty(0).set_(storage, 0, before["layer4.1.bn2"].shape), before["layer4.1.bn2"])
    assert torch.equal(dlpack.from_dlpack(held["layer4.0.bn1"]), before["layer4.0.bn1"])
    graph.backward()  # its saved tensor unchanged: no version error
    assert torch.equal(weight.grad, before["layer2.0.bn1"])
    # once the caller lets go, the next forward writes into the memory again
    ptrs = {n: t[n].data_ptr() for n in names}
    del held, storage, graph
    with torch.no_grad(), reference(resnet18, names) as ref, t:
        resnet18(torch.randn(2, 3, 64, 64))
        resnet18(x)
    assert_equal_to(t, ref, names)
    assert {n: t[n].data_ptr() for n in names} == ptrs


class Nested(nn.Module):
    """Returns a tuple with a dict and a list inside."""

    def forward(self, x):
        return x * 2, {"a": x + 1, "b": [x - 1, x.sum(1)]}


class UsesNested(nn.Module):
    """Changes every leaf of ``Nested``'s output in place, so the tap copies them all."""

    def __init__(self):
        super().__init__()
        self.nested = Nested()

    def forward(self, x):
        a, d = self.nested(x)
        b, c = d["b"]
        return a.relu_() + d["a"].relu_() + b.relu_() + c.relu_().unsqueeze(1)


def leaves(value):
    return [value[0], value[1]["a"], *value[1]["b"]]


def test_nested_outputs_are_reused_leaf_by_leaf_unless_a_container_is_held(one_thread):
    model = UsesNested()
    t = layertap.tap(model, "nested")

    def forward():
        x = torch.randn(3, 4)
        with torch.no_grad(), t:
            model(x)
        want = [x * 2, x + 1, x - 1, x.sum(1)]
        for got, w in zip(leaves(t["nested"]), want):
            assert torch.equal(got, w)
        return [v.data_ptr() for v in leaves(t["nested"])]

    forward()
    ptrs = forward()
    assert forward() == ptrs
    held = t["nested"][1]["b"]  # an inner list: its two leaves are not written, the others are
    kept = [v.clone() for v in held]
    new = forward()
    assert new[:2] == ptrs[:2] and new[2] != ptrs[2] and new[3] != ptrs[3]
    assert all(torch.equal(a, b) for a, b in zip(held, kept))
    held = t["nested"]  # the whole value: nothing in it is written
    kept = [v.clone() for v in leaves(held)]
    ptrs = forward()
    assert not set(ptrs) & {v.data_ptr() for v in leaves(held)}
    assert all(torch.equal(a, b) for a, b in zip(leaves(held), kept))


def test_a_new_batch_size_makes_new_tensors_and_the_pool_stays_bounded(resnet18, one_thread):
    names = [n for n in layertap.select(resnet18, nn.BatchNorm2d) if "downsample" not in n]  # all copies
    sizes = [2, 3, 2, 1, 3, 3, 8, 5, 4, 1, 7, 2, 6, 4, 3, 1, 1, 8, 2, 4, 4, 7, 6, 3, 5, 2, 1, 3]
    t = layertap.tap(resnet18, names)
    most = 0
    with t:  # one block: the pool lives across every forward
        for i, batch in enumerate(sizes):
            before = {n: (t[n].shape, t[n].data_ptr()) for n in names} if i else {}
            with torch.no_grad(), reference(resnet18, names) as ref:
                resnet18(torch.randn(batch, 3, 32, 32))
            assert_equal_to(t, ref, names)
            if i > 1 and batch != sizes[i - 1]:
                assert all(t[n].data_ptr() != before[n][1] for n in names)
            most = max(most, held_bytes(t))
            # the pool holds what the last two forwards dropped, at most
            assert pool.held_bytes() <= 2 * most
    assert pool.held_bytes() <= 2 * most  # the pool outlives the hooks, within its bound


def test_keep_all_and_clear_reuse_the_pool_and_keep_first_is_unchanged(resnet18, one_thread):
    names = layertap.select(resnet18, nn.BatchNorm2d)
    xs = [torch.randn(2, 3, 32, 32) for _ in range(3)]
    with layertap.tap(resnet18, names, keep="all") as every, layertap.tap(resnet18, names, keep="first") as first:
        refs = []
        for x in xs:
            with torch.no_grad(), reference(resnet18, names) as ref:
                resnet18(x)
            refs.append(ref)
        for n in names:
            assert all(torch.equal(got, ref[n]) for got, ref in zip(every[n], refs, strict=True)), n
            assert torch.equal(first[n], refs[0][n]), n
        ptrs = {p for n in names for p in (v.data_ptr() for v in every[n])}
        every.clear()
        assert 0 < pool.held_bytes() <= 3 * held_bytes(first)
        with torch.no_grad(), reference(resnet18, names) as ref:
            resnet18(xs[0])
        for n in names:
            assert torch.equal(every[n][0], ref[n]), n
            if "downsample" not in n:  # a copy (the others are the network's tensors, kept with a guard)
                assert every[n][0].data_ptr() in ptrs  # written into a buffer clear() dropped
            assert torch.equal(first[n], refs[0][n]), n
    before = pool.held_bytes()
    every.clear()  # outside the block too, the copies go to the pool, which outlives the hooks
    assert pool.held_bytes() == before + sum(ref[n].nbytes for n in names if "downsample" not in n)


def test_a_tap_re_entered_per_batch_reuses_its_values_and_never_writes_an_edit_result(resnet18, one_thread):
    edited = []  # the caller's own tensors, with their values when made

    def double(name, out):
        edited.append((out * 2, out * 2))
        return edited[-1][0]

    t = layertap.tap(resnet18, "layer1.0.bn1", edit=double)
    ptrs = []
    for _ in range(4):
        with torch.no_grad(), t:
            resnet18(torch.randn(2, 3, 32, 32))
        assert torch.equal(t["layer1.0.bn1"], edited[-1][1])  # captured before the in-place ReLU
        ptrs.append(t["layer1.0.bn1"].data_ptr())
    assert ptrs[1] == ptrs[2] == ptrs[3]
    # each edit result was changed by the network's in-place ReLU only, never by the tap
    assert all(torch.equal(mine, made.relu()) for mine, made in edited)


def test_gradients_and_outputs_under_autograd_are_unchanged(resnet18, one_thread):
    convs = layertap.select(resnet18, nn.Conv2d)  # not changed in place: autograd.grad can start at them
    names = convs + layertap.select(resnet18, nn.BatchNorm2d)
    t = layertap.tap(resnet18, names, capture=("output", "grad"))
    outs = {}
    hooks = [resnet18.get_submodule(n).register_forward_hook(lambda m, a, o, n=n: outs.__setitem__(n, o)) for n in convs]
    ptrs = []
    for _ in range(3):
        with reference(resnet18, names) as ref, t:
            loss = resnet18(torch.randn(2, 3, 32, 32)).square().sum()
            want = torch.autograd.grad(loss, [outs[n] for n in convs])  # also runs the tap's gradient hooks
        assert_equal_to(t, ref, names)
        for n, g in zip(convs, want, strict=True):
            assert torch.equal(t.grads[n], g), n
        ptrs.append(t["bn1"].data_ptr())
    for h in hooks:
        h.remove()
    assert ptrs[1] == ptrs[2]


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
def test_nested_tensors_are_copied_as_before(one_thread):
    # the encoder's fast path runs its layers on nested tensors, which have no strides
    layer = nn.TransformerEncoderLayer(8, 2, 16, batch_first=True)
    encoder = nn.TransformerEncoder(layer, 2).eval()
    mask = torch.tensor([[False] * 5, [False] * 3 + [True] * 2])
    t = layertap.tap(encoder, ["layers.0", "layers.1"])
    for _ in range(3):
        x = torch.randn(2, 5, 8)
        with torch.no_grad():
            with t:
                encoder(x, src_key_padding_mask=mask)
            want = encoder.layers[1](encoder.layers[0](x, src_key_padding_mask=mask), src_key_padding_mask=mask)
        assert t["layers.1"].is_nested
        for got, w, n in zip(t["layers.1"].unbind(), want.unbind(), [5, 3], strict=True):
            torch.testing.assert_close(got, w[:n])  # the fast path: other kernels, not bit-exact


class Op(nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


class Layouts(nn.Module):
    """Outputs of every kind a copy may stream (256 KiB or more, dense) or not, all changed in
    place after capture, as the network's own memory would be."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(8, 32, 3, padding=1)  # [2, 32, 64, 64] float32: 1 MiB
        self.channels_last = Op(lambda y: y.contiguous(memory_format=torch.channels_last))
        self.offset = Op(lambda y: y.flatten()[3:])  # contiguous, 12 bytes into a cache line
        self.float16 = Op(lambda y: y.half())  # 512 KiB
        self.int64 = Op(lambda y: (y * 100).long())
        self.bool = Op(lambda y: y > 0)  # 256 KiB
        self.transposed = Op(lambda y: y.transpose(1, 3))  # dense in no memory format: copy_
        self.conj = Op(lambda y: torch.view_as_complex(y.unflatten(-1, (-1, 2))).conj())  # lazy conjugate: copy_
        self.small = Op(lambda y: y[:, :2].contiguous())  # 64 KiB: copy_
        self.streamed = ["conv", "channels_last", "offset", "float16", "int64", "bool"]

    def forward(self, x):
        y = self.conv(x)
        outs = [m(y) for name, m in self.named_children() if name != "conv"]
        for out in outs:
            out.zero_()
        return y.relu_()


@pytest.mark.parametrize("mode", list(MODES))
def test_streamed_copies_equal_clone_in_the_hook_in_every_layout_and_reuse_the_previous_copy(monkeypatch, one_thread, mode):
    model = Layouts()
    names = [name for name, _ in model.named_children()]
    tap_module = importlib.import_module("layertap.tap.pool")
    streamed = []
    if tap_module._copy is not None:  # built (LAYERTAP_REQUIRE_KERNEL=1 makes test_copy.py fail where it is not)
        kernel = tap_module._copy

        class Spy:
            KERNELS = kernel.KERNELS

            @staticmethod
            def copy(dst, src, nbytes, threads, *rest):
                streamed.append((dst, nbytes))
                kernel.copy(dst, src, nbytes, threads, *rest)

        monkeypatch.setattr(tap_module, "_copy", Spy)
    t = layertap.tap(model, names)
    ptrs = []
    for _ in range(3):
        streamed.clear()
        with MODES[mode](), reference(model, names) as ref, t:
            model(torch.randn(2, 8, 64, 64))
        assert_equal_to(t, ref, names)
        ptrs.append({n: t[n].data_ptr() for n in names})
        if tap_module._copy is not None:
            assert sorted(streamed) == sorted((t[n].data_ptr(), t[n].nbytes) for n in model.streamed)
    assert ptrs[2] == ptrs[1]  # every copy, streamed or not, in the memory of the previous one


@pytest.mark.parametrize("rows", [4, 200])  # 8 KiB: copy_; 400 KiB: a size that streams
def test_a_dual_tensor_keeps_its_tangent_with_detach_false(one_thread, rows):
    # forward-mode AD: the copy of a dual tensor is dual too, as clone() makes it; bytes alone are not
    model = nn.Sequential(nn.Linear(512, 512), nn.ReLU(inplace=True))
    t = layertap.tap(model, ["0"], detach=False)
    ref = {}
    for _ in range(2):
        x = torch.randn(rows, 512)
        hook = model[0].register_forward_hook(lambda m, a, out: ref.__setitem__("0", out.clone()))  # not detached
        with torch.no_grad(), fwAD.dual_level(), t:
            model(fwAD.make_dual(x, torch.randn_like(x)))
            hook.remove()
            got, want = fwAD.unpack_dual(t["0"]), fwAD.unpack_dual(ref["0"])
            assert torch.equal(got.primal, want.primal) and want.tangent is not None
            assert torch.equal(got.tangent, want.tangent)
