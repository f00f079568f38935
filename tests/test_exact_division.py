"""formats.divide_nearest_even against IEEE division, which numpy's float32 divide is on CPUs.

The function exists because XLA:GPU's float32 divide is not IEEE; on a GPU this file is the check that
the integer long division gives IEEE's bits there too. Second reference: the quotient in float64 rounded
to float32 (double rounding is harmless for division when 53 >= 2 * 24 + 2).
"""

from __future__ import annotations

import jax
import numpy as np
import pytest

from fp4jax.ops.formats import divide_nearest_even


def _ieee(a, b):
    with np.errstate(all="ignore"):
        want = a / b
        assert np.array_equal(want.view(np.uint32), (a.astype(np.float64) / b).astype(np.float32).view(np.uint32))
    return want


def _assert_ieee(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    want = _ieee(a, b)
    for got in (jax.jit(divide_nearest_even)(a, b), divide_nearest_even(a, b)):
        got = np.asarray(got)
        assert got.dtype == np.float32
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan)
        differ = np.flatnonzero(got[~nan].view(np.uint32) != want[~nan].view(np.uint32))
        assert differ.size == 0, (
            f"{differ.size} quotients differ; first {a[~nan][differ[0]]!r} / {b[~nan][differ[0]]!r}: "
            f"got {got[~nan][differ[0]]!r}, want {want[~nan][differ[0]]!r}"
        )


def _magnitudes(rng, n, lo, hi):
    return ((1 + rng.random(n)) * np.exp2(rng.integers(lo, hi, n))).astype(np.float32)


def test_random_bit_patterns():
    """Every float32 class at once: normal, subnormal, zero, inf, NaN, both signs."""
    rng = np.random.default_rng(0)
    a, b = (rng.integers(0, 2**32, 1 << 18, dtype=np.uint64).astype(np.uint32).view(np.float32) for _ in "ab")
    _assert_ieee(a, b)


@pytest.mark.parametrize(
    "a_range, b_range",
    [
        ((-10, 10), (-10, 10)),  # the ordinary range
        ((-126, -100), (0, 30)),  # subnormal quotients, and those that round up to the smallest normal
        ((100, 128), (-30, 0)),  # overflow to inf, and the largest finite values
        ((-149, -126), (-20, 20)),  # subnormal dividends
        ((-20, 20), (-149, -126)),  # subnormal divisors
    ],
)
def test_ranges(a_range, b_range):
    rng = np.random.default_rng([a + 200 for a in a_range + b_range])
    n = 1 << 16
    _assert_ieee(_magnitudes(rng, n, *a_range) * rng.choice([-1, 1], n), _magnitudes(rng, n, *b_range))


def test_ties_in_the_subnormal_range_round_to_even():
    """Exact halfway quotients only occur below the normal range: 3 * 2^-126 / 2^24 = 1.5 * 2^-149."""
    a = np.float32([3, 5, 7, 3, 1]) * np.float32(2.0**-126)
    b = np.float32([2.0**24, 2.0**24, 2.0**24, 2.0**25, 2.0**24])
    _assert_ieee(a, b)
    got = np.asarray(divide_nearest_even(a, b)).view(np.uint32)  # in units of 2^-149
    assert got.tolist() == [2, 2, 4, 1, 0]  # 1.5, 2.5, 3.5 to even; 0.75 up; 0.5 to even (zero)


def test_the_quantizers_quotients():
    """What NVFP4 divides: 2688 / amax, 1 / S_enc and 1 / (s_b * S_dec), on integers as reciprocals."""
    rng = np.random.default_rng(1)
    n = 1 << 16
    _assert_ieee(np.full(n, 2688, np.float32), _magnitudes(rng, n, -126, 128))
    _assert_ieee(np.ones(n, np.float32), _magnitudes(rng, n, -126, 128))
    _assert_ieee(np.ones(n, np.float32), rng.integers(1, 2**24, n).astype(np.float32))


def test_zeros_infinities_and_nans_follow_ieee():
    specials = np.float32([0, -0.0, np.inf, -np.inf, np.nan, 1, -1, 1e-45, -3e-39, 3.4e38])
    a, b = np.meshgrid(specials, specials)
    _assert_ieee(a, b)


def test_broadcasts_like_a_divide():
    got = divide_nearest_even(np.float32(1.0), np.float32([[3.0], [7.0]]))
    assert got.shape == (2, 1)
    _assert_ieee(np.ones((2, 1), np.float32), np.float32([[3.0], [7.0]]))
