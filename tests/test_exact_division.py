"""formats.divide_nearest_even against IEEE division in flush-to-zero mode: numpy's float32 divide (IEEE on
CPUs) of the inputs with subnormals flushed to zero, its subnormal results flushed to zero.

The function exists because XLA:GPU's float32 divide is not IEEE. It lowers XLA:CPU's own divide on a CPU
and the integer-corrected estimate (`divide_nearest_even_by_integers`) elsewhere; every check here runs
both programs, so a CPU run proves the integer program and the CPU's divide equal, and a GPU run proves
the integer program there. Second reference: the quotient in float64 rounded
to float32 (double rounding is harmless for division when 53 >= 2 * 24 + 2).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.ops.formats import divide_nearest_even, divide_nearest_even_by_integers

_CANONICAL_NAN = 0x7FC00000


def _flush(v):
    """Subnormals to a zero of their sign."""
    v = np.array(v, np.float32)
    v[np.abs(v) < np.finfo(np.float32).tiny] *= 0
    return v


def _ieee(a, b):
    a, b = _flush(a), _flush(b)
    with np.errstate(all="ignore"):
        want = a / b
        via_float64 = (a.astype(np.float64) / b).astype(np.float32)
        assert np.array_equal(want.view(np.uint32), via_float64.view(np.uint32))
    return _flush(want)


def _assert_ieee(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    want = _ieee(a, b)
    divides = (divide_nearest_even, divide_nearest_even_by_integers)
    for got in [jax.jit(f)(a, b) for f in divides] + [f(a, b) for f in divides]:
        got = np.asarray(got)
        assert got.dtype == np.float32
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan)
        assert np.all(got[nan].view(np.uint32) == _CANONICAL_NAN)
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
        ((-126, -100), (0, 30)),  # quotients below the normal range (flushed), and those rounding up into it
        ((100, 128), (-30, 0)),  # overflow to inf, and the largest finite values
        ((-149, -126), (-20, 20)),  # subnormal dividends
        ((-20, 20), (-149, -126)),  # subnormal divisors
    ],
)
def test_ranges(a_range, b_range):
    rng = np.random.default_rng([a + 200 for a in a_range + b_range])
    n = 1 << 16
    _assert_ieee(_magnitudes(rng, n, *a_range) * rng.choice([-1, 1], n), _magnitudes(rng, n, *b_range))


def test_quotients_just_below_the_normal_range():
    """IEEE rounds (2^24 - 1) * 2^-150 (a tie at 2^-149's spacing) up to 2^-126, which stays; anything
    smaller is subnormal and flushed. 3 * 2^-126 / 3 = 2^-126 exactly."""
    below = np.float32((2**24 - 1) * 2.0**-24)  # (2^24 - 1) * 2^-24, exact
    a = np.float32([below * 2.0**-100, np.nextafter(below, 0) * 2.0**-100, 3 * 2.0**-126, 2.0**-100])
    b = np.float32([2.0**26, 2.0**26, 3, 2.0**30])
    _assert_ieee(a, b)
    got = np.asarray(divide_nearest_even(a, b)).view(np.uint32)
    assert got.tolist() == [0x00800000, 0, 0x00800000, 0]


def test_quotients_on_either_side_of_the_round_up_to_the_normal_range():
    """Exact quotients a few ulps either side of (2^24 - 1) * 2^-150, the least that IEEE rounds up to
    2^-126, most of them not representable: those at or above it give 2^-126, those below zero (the CPU's
    own divide flushes all of them; the CPU program must tell them apart exactly)."""
    rng = np.random.default_rng(3)
    b = rng.integers(2**23, 2**24, 4096).astype(np.float32) * np.float32(2.0**20)
    edge = (2**24 - 1) * 2.0**-150 * b.astype(np.float64)  # rounding it to float32 moves it either way
    a = np.concatenate(
        [np.nextafter(edge.astype(np.float32), np.float32(k)) for k in (-1, 1)] + [edge.astype(np.float32)]
    )
    b = np.tile(b, 3)
    _assert_ieee(a, b)
    _assert_ieee(-a, b)
    got = np.asarray(divide_nearest_even(a, b))
    assert 0 < np.count_nonzero(got) < got.size  # both sides of the edge were drawn


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


@pytest.mark.parametrize("divide", [divide_nearest_even, divide_nearest_even_by_integers])
def test_dividing_by_a_broadcast_value_stays_a_divide(divide):
    """XLA:CPU turns x / broadcast(d) into x * (1 / d), which is not IEEE's quotient (348,961 of 1,048,576
    random quotients by 6 differ): a constant, a traced scalar and a row-broadcast column."""
    rng = np.random.default_rng(5)
    x = _magnitudes(rng, 1 << 16, -100, 100).reshape(256, 256)
    d = np.float32(7.0)
    cases = {
        "constant": (jax.jit(lambda x: divide(x, jnp.float32(7.0)))(x), _ieee(x, np.full_like(x, d))),
        "scalar": (jax.jit(divide)(x, d), _ieee(x, np.full_like(x, d))),
        "row": (jax.jit(lambda x: divide(x, x[:, :1]))(x), _ieee(x, np.broadcast_to(x[:, :1], x.shape))),
    }
    for what, (got, want) in cases.items():
        got = np.asarray(got)
        assert np.array_equal(got.view(np.uint32), want.view(np.uint32)), what


_NEEDS_THE_LAST_STEP = [
    (15925129, 14282752),
    (11810030, 8941568),
    (9368385, 11207040),
    (14525400, 12395008),
    (13112494, 12052855),
    (12585579, 12678782),
    (13011697, 16562963),
    (15234093, 10756203),
]


@pytest.mark.parametrize("ulps", [-2, 2])
def test_a_divide_off_by_two_ulps_changes_nothing(ulps):
    """The estimate comes from the back end's own divide; PTX's div.full.f32 is within 2 ulp of IEEE. The
    function evaluated with every float32 divide in it moved `ulps` must still give IEEE's bits."""
    from test_conversion_folding import _evaluated, divide_off_by

    rng = np.random.default_rng(7)
    a, b = (rng.integers(0, 2**32, 1 << 16, dtype=np.uint64).astype(np.uint32).view(np.float32) for _ in "ab")
    # Significand pairs (found by simulating the steps) whose remainder leaves [0, b) after the float step
    # when both divides are off by -2 ulps (the first four) or +2 (the last four), so that the last
    # integer steps run. (There the remainder misses by a hair, which rounds the same; the steps matter
    # for the rule at the edge of the normal range, which reads the exact significand.)
    pairs = np.float32(_NEEDS_THE_LAST_STEP) * np.float32(2.0**-23)
    a, b = np.concatenate([a, pairs[:, 0]]), np.concatenate([b, pairs[:, 1]])
    closed = jax.make_jaxpr(divide_nearest_even_by_integers)(a, b)
    assert any(e.primitive.name == "div" for e in closed.jaxpr.eqns)  # the estimate's divide is there
    got = np.asarray(_evaluated(divide_nearest_even_by_integers, a, b, divide=divide_off_by(ulps))[0])
    want = _ieee(a, b)
    nan = np.isnan(want)
    assert np.array_equal(np.isnan(got), nan)
    assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))


def test_the_cpu_lowers_its_own_divide_and_other_platforms_the_integer_program():
    """The platform choice is made at lowering: a CPU program holds two float divides (the quotient and
    the check of its round-up to 2^-126) and no shifts, a CUDA or ROCm program the integer correction
    (lowering needs no such device here)."""
    a = jax.ShapeDtypeStruct((8,), np.float32)

    def lowered(platform):
        return jax.jit(divide_nearest_even).trace(a, a).lower(lowering_platforms=(platform,)).as_text()

    cpu = lowered("cpu")
    assert cpu.count("stablehlo.divide") == 2 and "stablehlo.shift" not in cpu
    for platform in ("cuda", "rocm"):
        assert "stablehlo.shift" in lowered(platform)
