"""The copy pool beyond one tap (`layertap.tap.pool`): each copy equals ``clone()`` bit for bit, a
dropped copy's memory is reused by the next copy that fits, and a value the caller still holds
(the tensor, a view, a NumPy array, its storage, a container, an autograd graph, a DLPack
capsule, shared memory) is never written. Bounded per device, aged by forwards, safe in threads.

Each test uses a pool of its own; the last one checks the process-wide functions.
"""

import threading
from types import SimpleNamespace

import pytest
import torch
import torch.autograd.forward_ad as fwAD
from c_extensions import optional_kernel
from torch.utils import dlpack

from layertap.errors import ArgumentError
from layertap.tap import pool as pool_module
from layertap.tap.pool import CopyPool

FLOAT = 4  # bytes


@pytest.fixture
def pool():
    return CopyPool()


class Caller:
    """Stands for a tap calling forward_started."""


def same_as_clone(copy, source):
    """What clone() makes, bit for bit, in memory of its own."""
    want = source.clone()
    assert type(copy) is torch.Tensor and not copy._is_view()
    assert (copy.shape, copy.stride(), copy.dtype, copy.device) == (want.shape, want.stride(), want.dtype, want.device)
    assert (copy.is_inference(), copy.is_conj(), copy.requires_grad) == (want.is_inference(), want.is_conj(), want.requires_grad)
    assert copy.untyped_storage().data_ptr() != source.untyped_storage().data_ptr()
    assert torch.equal(bits(copy), bits(want))


def bits(t):
    return t.resolve_conj().flatten().contiguous().view(torch.uint8)


def base(n=1000):
    return torch.randn(n)


LAYOUTS = {
    "contiguous": lambda: torch.randn(2, 32, 64, 64),  # 1 MiB: streams
    "channels_last": lambda: torch.randn(2, 32, 64, 64).contiguous(memory_format=torch.channels_last),
    "small": lambda: torch.randn(2, 4, 8, 8),  # 2 KiB: copy_
    "float16": lambda: torch.randn(4, 256, 256).half(),
    "int64": lambda: torch.randint(-9, 9, (300, 300)),
    "bool": lambda: torch.randn(512, 512) > 0,
    "transposed": lambda: torch.randn(2, 32, 64, 64).transpose(1, 3),  # dense, in no memory format
    "gaps": lambda: torch.randn(64, 64)[:, ::2],  # not dense: clone() makes it contiguous
    "conj": lambda: torch.view_as_complex(torch.randn(64, 64, 2)).conj(),  # a lazy conjugate
    "offset": lambda: torch.randn(300_000)[3:],  # 12 bytes into a cache line
    "scalar": lambda: torch.tensor(3.5),
}


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_copies_equal_clone_and_reuse_the_memory_of_a_dropped_one(pool, one_thread, layout, mode):
    ptrs = []
    for _ in range(3):
        with getattr(torch, mode)():
            source = LAYOUTS[layout]()
            copy = pool.copy(source)
            same_as_clone(copy, source)
        ptrs.append(copy.data_ptr())
        assert pool.held_bytes() == 0  # handed out: the caller's
        del copy  # the next one lands in its memory
        assert pool.held_bytes() == source.clone().untyped_storage().nbytes()
    assert ptrs[0] == ptrs[1] == ptrs[2]


def test_only_a_buffer_that_fits_is_taken(pool, one_thread):
    x = torch.randn(4, 6)
    copy = pool.copy(x)
    ptr = copy.data_ptr()
    del copy
    others = {
        "shape": torch.randn(6, 4),
        "strides": torch.randn(6, 4).t(),
        "dtype": torch.randn(4, 6, dtype=torch.float64)[:, :],
        "int32": torch.randint(0, 9, (4, 6), dtype=torch.int32),
        "gaps": torch.randn(4, 12)[:, ::2],
        "conj": torch.view_as_complex(torch.randn(4, 6, 2)).conj(),
    }
    kept = []
    for name, other in others.items():
        kept.append(pool.copy(other))
        same_as_clone(kept[-1], other)
        assert kept[-1].data_ptr() != ptr, name
    with torch.inference_mode():  # an inference tensor is never a normal one's buffer, nor back
        kept.append(pool.copy(x))
        assert kept[-1].is_inference() and kept[-1].data_ptr() != ptr
    again = pool.copy(x * 2)  # the one that fits, all along in the pool
    assert again.data_ptr() == ptr and torch.equal(again, x * 2)
    inference = kept.pop()
    inference_ptr = inference.data_ptr()
    del inference
    normal = pool.copy(x)
    assert not normal.is_inference() and normal.data_ptr() != inference_ptr


def holds(kind, copy):
    """What the caller keeps of ``copy`` (which it then drops), and how to read its values back."""
    if kind == "tensor":
        return copy, lambda h: h
    if kind == "view":
        return copy[1:], lambda h: h
    if kind == "flat view":
        return copy.view(-1), lambda h: h
    if kind == "numpy":
        return copy.numpy(), torch.from_numpy
    if kind == "storage":
        shape = copy.shape
        return copy.untyped_storage(), lambda h: torch.empty(0).set_(h, 0, shape)
    if kind == "list":
        return [copy], lambda h: h[0]
    if kind == "dict":
        return {"a": copy}, lambda h: h["a"]
    if kind == "dlpack":
        return dlpack.to_dlpack(copy), dlpack.from_dlpack  # read once, at the end
    if kind == "autograd":
        weight = torch.ones_like(copy, requires_grad=True)
        graph = (copy * weight).sum()  # saves the C++ tensor, not the Python object

        def read(h):
            h[0].backward()  # its saved tensor unchanged: no version error
            return h[1].grad

        return (graph, weight), read
    assert kind == "shared"
    copy.share_memory_()  # then sent to another process, say, which reads it later
    return None, None


KINDS = ["tensor", "view", "flat view", "numpy", "storage", "list", "dict", "dlpack", "autograd", "shared"]


@pytest.mark.parametrize("kind", KINDS)
def test_a_value_the_caller_holds_is_never_written(pool, one_thread, kind):
    x = torch.randn(8, 9)
    copy = pool.copy(x)
    ptr, want = copy.data_ptr(), copy.clone()
    held, read = holds(kind, copy)
    del copy
    assert pool.held_bytes() == 0  # not filed as free: something holds its memory
    later = []
    for i in range(4):  # copies that fit, made and dropped, in later forwards
        pool.forward_started()
        later.append(pool.copy(torch.full((8, 9), float(i))))
        assert later[-1].data_ptr() != ptr
        pool.copy(torch.full((8, 9), -1.0))
    if read is not None:
        assert torch.equal(bits(read(held)), bits(want[1:] if kind == "view" else want))
    for i, copy in enumerate(later):
        assert torch.equal(copy, torch.full((8, 9), float(i)))


@pytest.mark.parametrize("kind", ["tensor", "view", "list", "dict", "autograd"])
def test_once_the_caller_lets_go_the_memory_is_reused(pool, one_thread, kind):
    x = torch.randn(8, 9)
    copy = pool.copy(x)
    ptr = copy.data_ptr()
    held, read = holds(kind, copy)
    del copy
    if kind == "autograd":
        read(held)  # backward frees what the graph saved
    del held, read
    assert pool.held_bytes() == x.nbytes
    again = pool.copy(x + 1)
    assert again.data_ptr() == ptr and torch.equal(again, x + 1)


def test_release_frees_leaves_in_the_order_made_so_each_takes_its_own_back(pool, one_thread):
    def value():  # four leaves that fit the same buffers, in a tuple, a dict and a list
        return (
            pool.copy(torch.randn(3, 4)),
            {"a": pool.copy(torch.randn(3, 4)), "b": [pool.copy(torch.randn(3, 4)), pool.copy(torch.randn(3, 4))]},
        )

    def ptrs(v):
        return [v[0].data_ptr(), v[1]["a"].data_ptr(), *(x.data_ptr() for x in v[1]["b"])]

    box = [value()]  # the list holds the only reference: release empties it
    first = ptrs(box[0])
    pool.release(box)
    new = value()
    assert ptrs(new) == first
    held = new[1]["b"]  # the caller keeps an inner list: its leaves stay as they are
    kept = [x.clone() for x in held]
    box = [new]
    del new
    pool.release(box)
    again = value()
    assert ptrs(again)[:2] == first[:2] and not set(ptrs(again)) & {x.data_ptr() for x in held}
    assert all(torch.equal(x, k) for x, k in zip(held, kept, strict=True))


def test_a_kept_taps_pattern_writes_each_value_into_the_memory_of_the_one_it_replaces(pool, one_thread):
    # each layer's previous value is dropped just before its new copy; fresh ones are taken first,
    # so a stale buffer of the same fit (dropped before the forward) does not take its place
    stale = pool.copy(torch.randn(6, 7))
    stored = {name: pool.copy(torch.randn(6, 7)) for name in "abc"}
    del stale
    pool.forward_started()
    ptrs = {name: v.data_ptr() for name, v in stored.items()}
    for _ in range(3):
        pool.forward_started(Caller)
        for name in "abc":
            del stored[name]
            x = torch.randn(6, 7)
            stored[name] = pool.copy(x)
            assert torch.equal(stored[name], x)
        assert {name: v.data_ptr() for name, v in stored.items()} == ptrs


def test_a_copy_whose_storage_was_resized_is_not_reused(pool, one_thread):
    copy = pool.copy(torch.randn(300, 300))  # streams, where a buffer too small would be written past
    copy.untyped_storage().resize_(0)  # a library freeing memory by hand
    del copy
    assert pool.held_bytes() == 0
    x = torch.randn(300, 300)
    assert torch.equal(pool.copy(x), x)


class Sub(torch.Tensor):
    pass


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors")
@pytest.mark.filterwarnings("ignore:torch.quantize_per_tensor:UserWarning")
@pytest.mark.filterwarnings("ignore:`torch.jit.script` is deprecated:FutureWarning")
@pytest.mark.parametrize("kind", ["subclass", "requires_grad", "nested", "sparse", "dual", "quantized"])
def test_tensors_clone_cannot_be_replaced_for_are_cloned_and_never_pooled(pool, one_thread, kind):
    with fwAD.dual_level():
        x = torch.randn(4, 5)
        source = {
            "subclass": lambda: x.as_subclass(Sub),
            "requires_grad": lambda: x.clone().requires_grad_(),
            "nested": lambda: torch.nested.nested_tensor([x, x[:2]]),
            "sparse": lambda: x.relu().to_sparse(),
            "dual": lambda: fwAD.make_dual(x, torch.randn_like(x)),
            "quantized": lambda: torch.quantize_per_tensor(x, 0.1, 0, torch.qint8),
        }[kind]()
        for _ in range(2):
            copy = pool.copy(source)
            want = source.clone()
            assert type(copy) is type(want) and copy.requires_grad == want.requires_grad
            if kind == "dual":
                got, ref = fwAD.unpack_dual(copy), fwAD.unpack_dual(want)
                assert torch.equal(got.primal, ref.primal) and torch.equal(got.tangent, ref.tangent)
            elif kind == "nested":
                assert all(torch.equal(a, b) for a, b in zip(copy.unbind(), want.unbind(), strict=True))
            elif kind == "quantized":
                assert torch.equal(copy.int_repr(), want.int_repr()) and copy.q_scale() == want.q_scale()
            else:
                assert torch.equal(copy.detach().to_dense(), want.detach().to_dense())
            del copy
            assert pool.held_bytes() == 0


@pytest.mark.skipif(optional_kernel("_copy") is None, reason="layertap._copy was not built (no C compiler at install)")
def test_large_dense_cpu_copies_stream_and_others_use_copy_(pool, one_thread, monkeypatch):
    kernel, streamed = pool_module._copy, []

    def spy(dst, src, nbytes, *rest):  # the kernel, noting where it wrote
        streamed.append((dst, nbytes))
        kernel.copy(dst, src, nbytes, *rest)

    monkeypatch.setattr(pool_module, "_copy", SimpleNamespace(KERNELS=kernel.KERNELS, copy=spy))
    names = ["contiguous", "channels_last", "float16", "int64", "bool", "offset"]  # >= 256 KiB, dense
    for _ in range(2):  # new memory, then reused
        copies = {}
        for layout, make in LAYOUTS.items():
            source = make()
            copies[layout] = pool.copy(source)
            same_as_clone(copies[layout], source)
        assert sorted(streamed) == sorted((copies[n].data_ptr(), copies[n].nbytes) for n in names)
        streamed.clear()
        del copies


def test_free_buffers_stay_within_the_limit_per_device(one_thread):
    n = 1000 * FLOAT
    pool = CopyPool(limit=3 * n)
    copies = [pool.copy(base()) for _ in range(5)]
    del copies
    assert pool.held_bytes() == pool.held_bytes("cpu") == 3 * n  # the others were freed
    big = pool.copy(base(4000))  # larger than the limit: never kept
    del big
    assert pool.held_bytes() == 3 * n
    pool.set_limit(n)  # a lower limit frees at once
    assert pool.held_bytes() == n and pool.limit() == n == pool.limit("cpu")
    pool.set_limit(0, "cpu")
    assert pool.held_bytes() == 0 and pool.limit("cpu") == 0 and pool.limit() == n
    copy = pool.copy(base())
    del copy
    assert pool.held_bytes() == 0  # a limit of 0 keeps nothing
    for bad in (-1, 1.5, True, "1GB"):
        with pytest.raises(ArgumentError, match="number of bytes"):
            pool.set_limit(bad)
    with pytest.raises(ArgumentError):
        CopyPool(limit=-5)


def test_devices_have_buffers_and_limits_of_their_own(pool, one_thread):
    # the meta device stands for a second device: this machine may have no GPU
    cpu, meta = pool.copy(base()), pool.copy(torch.empty(1000, device="meta"))
    assert meta.device.type == "meta"
    del cpu, meta
    assert pool.held_bytes("cpu") == pool.held_bytes("meta") == 1000 * FLOAT
    assert pool.held_bytes() == 2 * 1000 * FLOAT
    copy = pool.copy(torch.empty(1000, device="meta"))  # takes the meta buffer, not the CPU one
    assert pool.held_bytes("meta") == 0 and pool.held_bytes("cpu") == 1000 * FLOAT
    pool.set_limit(0, "meta")
    del copy
    assert pool.held_bytes("meta") == 0 and pool.held_bytes("cpu") == 1000 * FLOAT


def test_a_buffer_that_waits_a_whole_forward_untaken_is_freed(pool, one_thread):
    n = 1000 * FLOAT
    first, second = Caller(), Caller()  # two taps on one model: both start each forward
    copy = pool.copy(base())
    del copy
    for _ in range(2):
        pool.forward_started(first)
        pool.forward_started(second)
        assert pool.held_bytes() == n  # free during this forward, for any copy that fits
    pool.forward_started(first)
    assert pool.held_bytes() == 0  # untaken through the whole forward before
    # what a forward takes and drops again stays
    for _ in range(4):
        pool.forward_started(first)
        copy = pool.copy(base())
        del copy
    assert pool.held_bytes() == n
    # a new tap per forward: the previous one is gone when the next starts
    pool.clear()
    copy = pool.copy(base())
    del copy
    for held in (n, n, 0):
        tap = Caller()
        pool.forward_started(tap)
        del tap
        assert pool.held_bytes() == held
    copy = pool.copy(base())
    del copy
    pool.forward_started()  # without a caller, every call is a forward
    pool.forward_started()
    assert pool.held_bytes() == 0


def test_clear_frees_every_free_buffer_and_lent_ones_come_back_later(pool, one_thread):
    kept = pool.copy(base())
    ptr = kept.data_ptr()
    dropped = [pool.copy(base()) for _ in range(3)]
    del dropped
    pool.clear()
    assert pool.held_bytes() == 0
    assert torch.equal(kept, kept.clone())
    del kept
    assert pool.held_bytes() == 1000 * FLOAT
    assert pool.copy(base()).data_ptr() == ptr


def test_threads_copying_at_once_never_share_or_overwrite_a_held_copy(pool):
    shapes = [(64, 64), (32, 128), (256, 256)]  # 256 KiB: the threads share fits, streamed and not
    kept: list[list[tuple[torch.Tensor, torch.Tensor]]] = [[] for _ in range(8)]
    errors = []
    start = threading.Barrier(8)

    def work(i):
        try:
            g = torch.Generator().manual_seed(i)
            start.wait()
            for step in range(60):
                x = torch.randn(shapes[step % 3], generator=g)
                copy = pool.copy(x)
                if step % 4 == 0:
                    kept[i].append((copy, x))
                if step % 20 == 0:
                    pool.forward_started()
        except Exception as e:  # reported by the test thread
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    held = [pair for pairs in kept for pair in pairs]
    assert len({copy.data_ptr() for copy, _ in held}) == len(held) == 8 * 15
    for copy, source in held:
        assert torch.equal(copy, source)


def test_without_the_reference_counts_nothing_is_reused(pool, one_thread, monkeypatch):
    monkeypatch.setattr(pool_module, "_ALONE", None)  # a PyTorch that cannot tell who holds a tensor
    x = base()
    copy = pool.copy(x)
    same_as_clone(copy, x)
    del copy
    assert pool.held_bytes() == 0


def test_the_process_pool_functions(one_thread):
    limit = pool_module.limit()
    assert limit == pool_module.DEFAULT_LIMIT >= 711_294_976  # every conv and BN of resnet50 at batch 8
    try:
        pool_module.clear()
        x = base()
        copy = pool_module.copy(x)
        ptr = copy.data_ptr()
        del copy
        assert pool_module.held_bytes("cpu") == x.nbytes
        assert pool_module.copy(x).data_ptr() == ptr
        pool_module.set_limit(0)
        assert pool_module.held_bytes() == 0
    finally:
        pool_module.set_limit(limit)
        pool_module.clear()
