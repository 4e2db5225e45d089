"""layertap's C kernel for statistics (``src/layertap/_moments.c``), each variant this CPU runs,
against NumPy in float64: per channel mean, M2, min, max and non-zeros of ``[N, C, L]`` maps and
of ``[R, C]`` ones, at the edges of its vectors and blocks.

The kernel is optional (the package installs without it where nothing can compile C, and
``layertap.stats`` then uses PyTorch's kernels, which ``test_stats.py`` checks too). CI sets
``LAYERTAP_REQUIRE_KERNEL=1``, so a build that silently failed there is an error, not a skip.
"""


import numpy as np
import pytest
import torch
from c_extensions import optional_kernel

_moments = optional_kernel("_moments")

pytestmark = pytest.mark.skipif(_moments is None, reason="layertap._moments was not built (no C compiler at install)")
KERNELS = _moments.KERNELS if _moments else ()


def moments(x, kernel=0, threads=1, columns=False):
    """The kernel's [C, 5] output for ``x`` ([N, C, L], or [R, C] with ``columns``) and its status
    (1; 0 for NaN or Inf; 2 for a float32 channel spread over less than 2**-50)."""
    outer, c, inner = (x.shape[0], x.shape[1], 1) if columns else x.shape
    out = torch.full((c, 5), float("nan"), dtype=torch.float64)
    status = _moments.moments(x.data_ptr(), outer, c, inner, out.data_ptr(), x.dtype == torch.float64, threads, kernel)
    return out.numpy(), status


def reference(x, columns=False):
    """NumPy, float64: per channel mean, M2, min, max, non-zeros."""
    v = x.double().numpy()
    v = v.reshape(-1, v.shape[-1]).T if columns else v.transpose(1, 0, 2).reshape(v.shape[1], -1)
    mean = v.mean(axis=1)
    return np.stack([mean, ((v - mean[:, None]) ** 2).sum(axis=1), v.min(axis=1), v.max(axis=1), (v != 0).sum(axis=1)], axis=1)


def check(actual, expected):
    # mean within 1e-6 relative (floor 1e-9 of the channel's scale), M2 within 2e-6 (the square of
    # the std's 1e-6); min, max and counts exact
    scale = np.maximum(np.abs(expected[:, 2]), np.abs(expected[:, 3]))
    np.testing.assert_allclose(actual[:, 0], expected[:, 0], rtol=1e-6, atol=0)
    assert (np.abs(actual[:, 0] - expected[:, 0]) <= 1e-6 * np.abs(expected[:, 0]) + 1e-9 * scale).all()
    np.testing.assert_allclose(actual[:, 1], expected[:, 1], rtol=2e-6, atol=1e-300)
    np.testing.assert_array_equal(actual[:, 2:], expected[:, 2:])


# row lengths around the vector widths (8, 16, 32 values) and the 4096-value block
LENGTHS = [1, 2, 7, 8, 9, 15, 16, 17, 31, 32, 33, 49, 196, 4095, 4096, 4097, 10_000]


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("length", LENGTHS)
def test_rows_of_every_length_match_numpy(kernel, length):
    torch.manual_seed(length)
    x = (torch.randn(3, 5, length) * 2 + 3).relu()  # zeros, and a mean above the spread
    x[1, 2] = 0.0  # a dead row
    x[0, 4, length // 2] = -0.0  # negative zero is a zero
    check(*[moments(x, KERNELS.index(kernel))[0]], reference(x))


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_mean_a_million_times_the_spread_keeps_the_std(kernel):
    # float32 sums of squares would keep nothing of it: the deviations are summed, centred
    torch.manual_seed(1)
    x = torch.randn(4, 6, 3000) * 1e-3 + 1e3
    actual, status = moments(x, KERNELS.index(kernel))
    assert status == 1
    check(actual, reference(x))


@pytest.mark.parametrize("kernel", KERNELS)
def test_a_float32_spread_too_fine_for_its_squares_is_reported(kernel):
    x = torch.randn(2, 3, 50) * 1e-20
    assert moments(x, KERNELS.index(kernel))[1] == 2
    assert moments(x.double(), KERNELS.index(kernel))[1] == 1  # float64 squares keep them
    assert moments(torch.zeros(2, 3, 50), KERNELS.index(kernel))[1] == 1  # no spread at all


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("rows", [1, 2, 17, 255, 256, 257, 1000])  # around the 256-row block
def test_columns_of_every_width_match_numpy(kernel, rows):
    # tokens and features: a channel is a column, a vector's lanes are columns (8 or 16 of them)
    for width in (1, 3, 8, 15, 16, 17, 33, 769):
        torch.manual_seed(rows * width)
        x = (torch.randn(rows, width) * 2 + 3).relu()
        x[:, width // 2] = 0.0  # a dead column
        x[0, 0] = -0.0
        check(moments(x, KERNELS.index(kernel), columns=True)[0], reference(x, columns=True))
    offset = torch.randn(4000, 7) * 1e-3 + 1e3  # the mean a million times the spread
    check(moments(offset, KERNELS.index(kernel), columns=True)[0], reference(offset, columns=True))


@pytest.mark.parametrize("kernel", KERNELS)
def test_float64_maps(kernel):
    torch.manual_seed(2)
    x = torch.randn(4, 7, 300, dtype=torch.float64) * 1e-4 + 7  # float64 takes the portable code
    check(moments(x, KERNELS.index(kernel))[0], reference(x))
    tokens = torch.randn(37, 769, dtype=torch.float64) * 0.1 + 5
    check(moments(tokens, KERNELS.index(kernel), columns=True)[0], reference(tokens, columns=True))


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("where", ["first", "middle", "tail"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_nan_or_inf_anywhere_is_reported(kernel, where, bad):
    x = torch.randn(2, 3, 37)
    x[1, 2, {"first": 0, "middle": 20, "tail": 36}[where]] = bad
    assert moments(x, KERNELS.index(kernel))[1] == 0
    assert moments(x.reshape(6, 37), KERNELS.index(kernel), columns=True)[1] == 0


@pytest.mark.parametrize("kernel", KERNELS)
def test_squares_beyond_float32_are_reported_not_wrong(kernel):
    # float32 squares of deviations of 1e30 overflow: the caller takes its float64 path
    x = torch.randn(2, 3, 64) * 1e30
    actual, status = moments(x, KERNELS.index(kernel))
    assert status == 0 or np.allclose(actual[:, 1], reference(x)[:, 1], rtol=2e-6)


def test_threads_split_channels_and_change_nothing():
    # each channel is summed by one thread with the same code: bit-identical for any thread count
    torch.manual_seed(3)
    x = torch.randn(4, 13, 2000).relu()
    one, _ = moments(x, threads=1)
    for threads in (2, 3, 13, 64):
        np.testing.assert_array_equal(moments(x, threads=threads)[0], one)
    tokens = torch.randn(300, 13)
    np.testing.assert_array_equal(moments(tokens, threads=4, columns=True)[0], moments(tokens, columns=True)[0])


def test_bad_calls_are_refused():
    out = torch.empty(1, 5, dtype=torch.float64)
    x = torch.randn(4)
    with pytest.raises(ValueError, match="empty map"):
        _moments.moments(x.data_ptr(), 0, 1, 4, out.data_ptr(), False, 1)
    with pytest.raises(ValueError, match="no such kernel"):
        _moments.moments(x.data_ptr(), 1, 1, 4, out.data_ptr(), False, 1, len(KERNELS))
    assert KERNELS[-1] == "portable"
