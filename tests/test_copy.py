"""layertap's C copy with streaming stores (``src/layertap/_copy.c``), each variant this CPU runs:
every byte arrives, none around the destination is written, for any size, alignment and thread
count.

The extension is optional (the package installs without it where nothing can compile C, and the
tap then copies with ``copy_``). CI sets ``LAYERTAP_REQUIRE_KERNEL=1``, so a build that silently
failed there is an error, not a skip.
"""

import pytest
import torch
from c_extensions import optional_kernel

_copy = optional_kernel("_copy")

pytestmark = pytest.mark.skipif(_copy is None, reason="layertap._copy was not built (no C compiler at install)")
KERNELS = _copy.KERNELS if _copy else ()
LINE, PER_THREAD = 64, 1 << 18  # as in _copy.c
GUARD = 3 * LINE


@pytest.mark.parametrize("kernel", range(len(KERNELS)), ids=list(KERNELS))
@pytest.mark.parametrize("size", [0, 1, LINE - 1, LINE, LINE + 1, 4095, PER_THREAD - 1, PER_THREAD, 3 * PER_THREAD + 17, (1 << 22) + 5])
def test_every_byte_arrives_and_none_around_it_is_written(kernel, size):
    g = torch.Generator().manual_seed(size)
    for src_offset, dst_offset, threads in [(0, 0, 1), (1, 0, 2), (0, 3, 3), (5, 63, 7), (63, 1, 2)]:
        src = torch.randint(0, 256, (size + src_offset,), dtype=torch.uint8, generator=g)[src_offset:]
        # 64-byte aligned allocations, then offsets that misalign the destination's lines
        dst = torch.full((size + dst_offset + 2 * GUARD,), 0xA5, dtype=torch.uint8)
        window = dst[GUARD + dst_offset : GUARD + dst_offset + size]
        _copy.copy(window.data_ptr(), src.data_ptr(), size, threads, kernel)
        assert torch.equal(window, src), (src_offset, dst_offset, threads)
        assert (dst[: GUARD + dst_offset] == 0xA5).all() and (dst[GUARD + dst_offset + size :] == 0xA5).all()


def test_float_values_and_thread_counts_beyond_the_size():
    x = torch.randn(8, 256, 56, 56)  # a resnet50 map at batch 8: 24.5 MiB
    for kernel in range(len(KERNELS)):
        for threads in (1, 2, 300):  # more than MAX_THREADS, and than the bytes are worth
            out = torch.empty_like(x)
            _copy.copy(out.data_ptr(), x.data_ptr(), x.nbytes, threads, kernel)
            assert torch.equal(out, x)


def test_kernels_are_named_fastest_first_and_bad_calls_are_refused():
    assert KERNELS[-1] == "portable" and len(set(KERNELS)) == len(KERNELS)
    x = torch.zeros(4)
    with pytest.raises(ValueError, match="negative size"):
        _copy.copy(x.data_ptr(), x.data_ptr(), -1, 1)
    with pytest.raises(ValueError, match="no such kernel"):
        _copy.copy(x.data_ptr(), x.data_ptr(), 4, 1, len(KERNELS))
    with pytest.raises(TypeError):
        _copy.copy(x.data_ptr(), x.data_ptr(), 4)
