"""MX block quantization and FP8 per-tensor scaling against the independent numpy reference.

Every comparison is bit-exact: element data bits, scale bits and the float32 dequantized values. The inputs
are built to hit the contract's edges: round-half ties, the `even` bump at significand 1.75, the `ceil`
boundary max_elem * 2^k, saturation, elements that underflow (negative ones to -0), fp32-subnormal blocks,
blocks near the float32 maximum, all-zero blocks and NaN/Inf blocks.
"""

import functools

import jax
import jax.numpy as jnp
import ml_dtypes
import mx_reference as ref
import numpy as np
import pytest

from fp4jax.ops import quantize_fp8, quantize_mx
from fp4jax.ops.quantize import fp8_amax_history_update, fp8_scale_from_amax, fp8_scale_from_history

ELEMS = ("e2m1", "e4m3", "e5m2")
SCALE_MODES = ("floor", "even", "ceil")
F32_MAX = float(np.finfo(np.float32).max)


# ----------------------------------------------------------------------------------------------------
# Inputs.


def _block_cases(rng: np.random.Generator, bs: int, elem: str) -> np.ndarray:
    """(n_blocks, bs) float32 blocks, each row one edge case of the contract."""
    emax_val = ref.ELEMS[elem].max
    grid = ref.all_grid_values(elem)
    mids = (grid[1:] + grid[:-1]) / 2
    rows = []

    def with_amax(amax, fill=None):
        """A block whose absolute maximum is exactly `amax` (float32), other elements random below it."""
        amax = np.float32(amax)
        v = rng.uniform(-1, 1, bs) * amax if fill is None else np.asarray(fill, np.float64)
        v = np.clip(v, -float(amax), float(amax)).astype(np.float32)
        v[rng.integers(bs)] = amax * (1 if rng.random() < 0.5 else -1)
        return v

    # Ordinary blocks across magnitudes.
    for p in (-30, -7, -1, 0, 3, 17, 40):
        rows.append((rng.standard_normal(bs) * 2.0**p).astype(np.float32))
    # Ties after scaling: grid midpoints (both signs) times 2^e with a block max that pins e.
    for e in (-3, 0, 5):
        k = rng.integers(0, len(mids), bs)
        v = mids[k] * rng.choice([-1.0, 1.0], bs)
        v[0] = emax_val  # amax = max_elem: floor and ceil give 2^e multiples we can reason about
        rows.append((v * 2.0**e).astype(np.float32))
        v2 = grid[rng.integers(0, len(grid), bs)] * rng.choice([-1.0, 1.0], bs)  # exact grid values
        v2[0] = 2.0 ** ref.ELEMS[elem].emax
        rows.append((v2 * 2.0**e).astype(np.float32))
    # Low precision integers: many exact ties under every scale mode.
    rows.append((rng.integers(-40, 41, bs) / 4).astype(np.float32))
    # Huge dynamic range: small elements underflow, negative ones must become -0.
    v = (rng.standard_normal(bs) * 2.0 ** rng.integers(-45, 0, bs)).astype(np.float32)
    v[3] = 1.0
    rows.append(v)
    # The `even` bump at significand 1.75, and the `ceil` boundary, at several binades.
    f32 = np.float32
    for p in (-100, 0, 60):
        s = 2.0**p
        for a in (
            1.75 * s,
            np.nextafter(f32(1.75 * s), f32(0)),
            1.5 * s,
            s,
            np.nextafter(f32(2 * s), f32(0)),
        ):
            rows.append(with_amax(a))
        for a in (
            emax_val * s,
            np.nextafter(f32(emax_val * s), f32(np.inf)),
            np.nextafter(f32(emax_val * s), f32(0)),
        ):
            rows.append(with_amax(a))
    # Saturation: floor scale leaves y up to 2^(emax+1) > max_elem.
    rows.append(with_amax(np.nextafter(f32(2.0 ** (ref.ELEMS[elem].emax + 1)), f32(0))))
    # Tiny blocks: fp32-subnormal amax, min normal, and values where the clamp at -127 matters.
    for a in (
        1e-45,
        3e-42,
        1e-40,
        0.76 * 2.0**-126,
        2.0**-126,
        1.8 * 2.0**-126,
        2.0**-125,
        1.9 * 2.0**-120,
        2.0**-110,
    ):
        rows.append(with_amax(a))
    # Huge blocks: the `even` rule reaches 2^128 and dequantization overflows to inf.
    for a in (F32_MAX, 1.75 * 2.0**127, np.nextafter(f32(1.75 * 2.0**127), f32(0)), 2.0**127, 1e38, 3e36):
        rows.append(with_amax(a))
    # All-zero block, a single non-zero element, an all-equal block.
    rows.append(np.zeros(bs, np.float32))
    one = np.zeros(bs, np.float32)
    one[bs // 2] = -3.3
    rows.append(one)
    rows.append(np.full(bs, 0.7, np.float32))
    out = np.stack(rows).astype(np.float32)
    assert np.all(np.isfinite(out))
    return out


def _nonfinite_cases(rng: np.random.Generator, bs: int) -> np.ndarray:
    rows = []
    for bad in (np.nan, np.inf, -np.inf):
        v = rng.standard_normal(bs).astype(np.float32)
        v[rng.integers(bs)] = bad
        rows.append(v)
    v = np.full(bs, np.nan, np.float32)
    rows.append(v)
    rows.append(rng.standard_normal(bs).astype(np.float32))  # a healthy neighbour block
    return np.stack(rows)


# ----------------------------------------------------------------------------------------------------
# Comparison helpers.


def _bits_of(a) -> np.ndarray:
    a = np.asarray(a)
    return a.view(np.uint8) if a.dtype.itemsize == 1 else a.view(np.uint32)


def _assert_same_f32(got, want, what: str):
    """Bit-exact float32 comparison; NaNs compare as NaN (any payload), zeros compare with their sign."""
    got = np.asarray(got)
    want = np.asarray(want, np.float32)
    assert got.dtype == np.float32, got.dtype
    assert got.shape == want.shape
    nan_g, nan_w = np.isnan(got), np.isnan(want)
    bad = (nan_g != nan_w) | (~nan_w & (got.view(np.uint32) != want.view(np.uint32)))
    if bad.any():
        idx = np.argwhere(bad)[:8]
        detail = ", ".join(f"{tuple(i)}: got {got[tuple(i)]!r} want {want[tuple(i)]!r}" for i in idx)
        raise AssertionError(f"{what}: {bad.sum()} of {bad.size} differ; {detail}")


def _assert_mx_matches(mx, r: ref.RefMX, x: np.ndarray, what: str):
    elem_dtype = ref.ELEMS[r.elem].dtype
    assert mx.data.dtype == elem_dtype, (mx.data.dtype, elem_dtype)
    assert mx.scale.dtype == jnp.float8_e8m0fnu, mx.scale.dtype
    assert mx.data.shape == x.shape
    assert mx.scale.shape == r.exp.shape, (mx.scale.shape, r.exp.shape)
    scale_bits = np.asarray(mx.scale).view(np.uint8)
    bad = scale_bits != r.scale_bits
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {bad.sum()} scale bytes differ; first at block {i}: got {scale_bits[i]:#x} "
            f"want {r.scale_bits[i]:#x}"
        )
    data_bits = np.asarray(mx.data).view(np.uint8)
    bad = data_bits != r.data_bits
    if bad.any():
        idx = np.argwhere(bad)[:8]
        detail = ", ".join(
            f"{tuple(i)}: x={x[tuple(i)]!r} got {np.asarray(mx.data)[tuple(i)]} want {r.data[tuple(i)]}"
            for i in idx
        )
        raise AssertionError(f"{what}: {bad.sum()} of {bad.size} data elements differ; {detail}")
    _assert_same_f32(mx.dequantize(jnp.float32), r.dequantize(), f"{what} dequantize")


@functools.partial(jax.jit, static_argnames=("axis", "elem", "block_size", "scale_mode", "rounding"))
def _qmx_jit(x, key=None, **kw):
    return quantize_mx(x, key=key, **kw)


def _dequant_jit(mx):
    return jax.jit(lambda m: m.dequantize(jnp.float32))(mx)


# ----------------------------------------------------------------------------------------------------
# Reference self-checks (the reference must be right before it judges anything).


@pytest.mark.parametrize("elem", ELEMS)
def test_reference_grid_matches_ml_dtypes(elem):
    f = ref.ELEMS[elem]
    n = 16 if elem == "e2m1" else 256
    allv = np.arange(n, dtype=np.uint8).view(f.dtype).astype(np.float64)
    np.testing.assert_array_equal(np.unique(np.abs(allv[np.isfinite(allv)])), ref.all_grid_values(elem))
    # Round-half-even onto the grid equals ml_dtypes' float32 -> element cast inside the range.
    rng = np.random.default_rng(0)
    g = ref.all_grid_values(elem)
    y = rng.uniform(-f.max, f.max, 20000) * np.exp2(rng.integers(-20, 1, 20000))
    y = np.concatenate([y, (g[1:] + g[:-1]) / 2, -(g[1:] + g[:-1]) / 2]).astype(np.float32).astype(np.float64)
    np.testing.assert_array_equal(
        ref.round_to_grid(y, elem, "nearest_even"), y.astype(f.dtype).astype(np.float64)
    )


def test_reference_scale_exponent_edges():
    f32 = np.float32
    assert ref.scale_exponent(1.0, "e2m1", "floor") == -2
    assert ref.scale_exponent(1.75, "e2m1", "even") == -1
    assert ref.scale_exponent(np.nextafter(f32(1.75), f32(0)), "e2m1", "even") == -2
    assert ref.scale_exponent(6.0, "e2m1", "ceil") == 0
    assert ref.scale_exponent(np.nextafter(f32(6), f32(7)), "e2m1", "ceil") == 1
    assert ref.scale_exponent(448.0, "e4m3", "ceil") == 0
    assert ref.scale_exponent(F32_MAX, "e2m1", "even") == 126  # 2^128 after rounding, then floor rule
    assert ref.scale_exponent(F32_MAX, "e2m1", "floor") == 125
    for mode in SCALE_MODES:
        for elem in ELEMS:
            assert ref.scale_exponent(1e-40, elem, mode) == -127
            assert ref.scale_exponent(0.0, elem, mode) == -127


@pytest.mark.parametrize("scale_mode", SCALE_MODES)
@pytest.mark.parametrize("elem", ELEMS)
def test_reference_vectorised_exponent_equals_exact_rule(elem, scale_mode):
    rng = np.random.default_rng(5)
    a = (rng.uniform(1, 2, 3000) * np.exp2(rng.integers(-149, 128, 3000))).astype(np.float32)
    edges = [0.0, 1e-45, 1e-40, 2.0**-126, 1.75, 6.0, 448.0, 57344.0, F32_MAX, 1.75 * 2.0**127]
    a = np.concatenate([a, np.array(edges, np.float32)])
    with np.errstate(over="ignore"):
        a = np.concatenate([a, np.nextafter(a, np.float32(np.inf)), np.nextafter(a, np.float32(0))])
    a = a[np.isfinite(a)]
    exact = np.array([ref.scale_exponent(v, elem, scale_mode) for v in a])
    np.testing.assert_array_equal(ref.scale_exponents(a, elem, scale_mode), exact)


# ----------------------------------------------------------------------------------------------------
# MX quantization.


@pytest.mark.parametrize("rounding", ("nearest_even", "nearest_away"))
@pytest.mark.parametrize("scale_mode", SCALE_MODES)
@pytest.mark.parametrize("elem", ELEMS)
def test_quantize_mx_matches_reference(elem, scale_mode, rounding):
    rng = np.random.default_rng(
        [ELEMS.index(elem), SCALE_MODES.index(scale_mode), rounding == "nearest_away"]
    )
    x = _block_cases(rng, 32, elem)
    kw = dict(axis=-1, elem=elem, block_size=32, scale_mode=scale_mode, rounding=rounding)
    r = ref.quantize_mx(x, **kw)
    mx = _qmx_jit(jnp.asarray(x), **kw)
    _assert_mx_matches(mx, r, x, f"{elem}/{scale_mode}/{rounding}")
    _assert_same_f32(_dequant_jit(mx), r.dequantize(), "jitted dequantize")


def test_quantize_mx_eager_equals_reference():
    rng = np.random.default_rng(7)
    x = _block_cases(rng, 32, "e2m1")
    r = ref.quantize_mx(x, elem="e2m1", scale_mode="even")
    mx = quantize_mx(jnp.asarray(x), elem="e2m1", scale_mode="even")
    _assert_mx_matches(mx, r, x, "eager e2m1/even")


@pytest.mark.parametrize(
    "shape,axis,block_size",
    [
        ((64, 5), 0, 32),
        ((3, 48, 2), 1, 16),
        ((3, 48, 2), -2, 8),
        ((2, 3, 64), -1, 64),
        ((4, 6), -1, 1),
        ((4, 24), 1, 3),
    ],
)
@pytest.mark.parametrize("scale_mode", ("even", "ceil"))
def test_quantize_mx_axes_and_block_sizes(shape, axis, block_size, scale_mode):
    rng = np.random.default_rng(len(shape) * 100 + block_size)
    x = (rng.standard_normal(shape) * np.exp2(rng.integers(-8, 8, shape))).astype(np.float32)
    x.flat[:: max(1, x.size // 5)] *= 100  # outliers
    kw = dict(axis=axis, elem="e2m1", block_size=block_size, scale_mode=scale_mode, rounding="nearest_even")
    r = ref.quantize_mx(x, **kw)
    mx = _qmx_jit(jnp.asarray(x), **kw)
    assert mx.axis % x.ndim == axis % x.ndim and mx.block_size == block_size
    _assert_mx_matches(mx, r, x, f"shape {shape} axis {axis} block {block_size}")


def test_quantize_mx_bf16_input_uses_float32_values():
    rng = np.random.default_rng(3)
    x = (rng.standard_normal((4, 64)) * 3).astype(ml_dtypes.bfloat16)
    r = ref.quantize_mx(x.astype(np.float32), elem="e2m1", scale_mode="even")
    mx = _qmx_jit(jnp.asarray(x), elem="e2m1", scale_mode="even")
    _assert_mx_matches(mx, r, x.astype(np.float32), "bf16 input")


def test_dequantize_bfloat16_dtype():
    rng = np.random.default_rng(4)
    x = rng.standard_normal((4, 64)).astype(np.float32)
    r = ref.quantize_mx(x, elem="e4m3", scale_mode="floor")
    got = jax.jit(lambda v: quantize_mx(v, elem="e4m3", scale_mode="floor").dequantize(jnp.bfloat16))(
        jnp.asarray(x)
    )
    assert got.dtype == jnp.bfloat16
    # e4m3 values times a power of two in the normal range are exact in bfloat16.
    np.testing.assert_array_equal(np.asarray(got).astype(np.float64), r.dequantize64())


@pytest.mark.parametrize("scale_mode", SCALE_MODES)
@pytest.mark.parametrize("elem", ("e2m1", "e4m3"))
def test_quantize_mx_nonfinite_blocks(elem, scale_mode):
    rng = np.random.default_rng(11)
    x = _nonfinite_cases(rng, 32)
    kw = dict(axis=-1, elem=elem, block_size=32, scale_mode=scale_mode, rounding="nearest_even")
    mx = _qmx_jit(jnp.asarray(x), **kw)
    scale_bits = np.asarray(mx.scale).view(np.uint8)
    np.testing.assert_array_equal(scale_bits[:4, 0], [0xFF] * 4)
    np.testing.assert_array_equal(np.asarray(mx.data)[:4].view(np.uint8), 0)  # +0, not -0
    deq = np.asarray(mx.dequantize(jnp.float32))
    assert np.isnan(deq[:4]).all(), deq[:4]
    # The healthy block is untouched by its neighbours.
    r = ref.quantize_mx(x[4:], **kw)
    assert scale_bits[4, 0] == r.scale_bits[0, 0]
    np.testing.assert_array_equal(np.asarray(mx.data)[4:].view(np.uint8), r.data_bits)
    _assert_same_f32(deq[4:], r.dequantize(), "healthy block next to NaN blocks")


def test_quantize_mx_nonfinite_along_axis0():
    x = np.ones((64, 3), np.float32)
    x[40, 1] = np.inf
    deq = np.asarray(_dequant_jit(_qmx_jit(jnp.asarray(x), axis=0, block_size=32)))
    assert np.isnan(deq[32:, 1]).all()
    assert not np.isnan(np.delete(deq, 1, axis=1)).any() and not np.isnan(deq[:32, 1]).any()


def test_quantize_mx_zero_and_negative_zero_data():
    x = np.zeros((2, 32), np.float32)
    x[1, 0] = 6.0
    x[1, 1] = -1e-6  # underflows: must keep its sign
    x[1, 2] = 1e-6
    mx = _qmx_jit(jnp.asarray(x), block_size=32, scale_mode="floor")
    scale_bits = np.asarray(mx.scale).view(np.uint8)
    assert scale_bits[0, 0] == 0  # all-zero block: e = -127
    bits = np.asarray(mx.data).view(np.uint8)
    assert (bits[0] == 0).all()
    assert bits[1, 1] == 0x8, "negative value rounding to zero must give -0 (bits 0x8 in e2m1)"
    assert bits[1, 2] == 0x0
    deq = np.asarray(_dequant_jit(mx))
    assert deq[1, 1] == 0 and np.signbit(deq[1, 1])


def test_quantize_mx_errors():
    x = jnp.ones((4, 48))
    with pytest.raises(ValueError) as err:
        quantize_mx(x, axis=1, block_size=32)
    msg = str(err.value)
    assert "axis" in msg and "48" in msg and "32" in msg, msg
    with pytest.raises(ValueError) as err:
        quantize_mx(jnp.ones((48, 4)), axis=-2, block_size=32)
    assert "48" in str(err.value) and "32" in str(err.value)
    with pytest.raises(ValueError):
        quantize_mx(x, elem="e3m4", block_size=16)
    with pytest.raises(ValueError):
        quantize_mx(x, elem="int4", block_size=16)
    with pytest.raises(ValueError):
        quantize_mx(x, block_size=16, scale_mode="round")
    with pytest.raises(ValueError):
        quantize_mx(x, block_size=16, rounding="nearest")
    for bad in (0, -16):
        with pytest.raises(ValueError):
            quantize_mx(x, block_size=bad)
    with pytest.raises(ValueError):
        quantize_mx(x, block_size=16, rounding="stochastic")  # no key


def test_mxarray_is_a_pytree():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((4, 64)), jnp.float32)
    mx = _qmx_jit(x, axis=-1, block_size=32)
    leaves = jax.tree.leaves(mx)
    assert len(leaves) == 2
    out = jax.jit(lambda m: m)(mx)
    np.testing.assert_array_equal(np.asarray(out.data).view(np.uint8), np.asarray(mx.data).view(np.uint8))
    assert out.axis == mx.axis and out.block_size == mx.block_size
    assert mx.scale.shape == (4, 2)


# ----------------------------------------------------------------------------------------------------
# Stochastic rounding: every sample is a neighbour, the mean is unbiased, keys behave.

_SR_SHAPE = (4, 32)


def _sr_input() -> np.ndarray:
    rng = np.random.default_rng(21)
    x = (rng.standard_normal(_SR_SHAPE) * np.exp2(rng.integers(-3, 3, _SR_SHAPE))).astype(np.float32)
    x[0, :8] = [6.0, 4.0, -3.0, 2.5, -0.25, 0.75, 1e-3, -1e-3]  # exact grid values, ties, underflow
    x[1, 0] = 7.9  # floor scale: y = 7.9 > 6 saturates deterministically
    x[1, 1:4] = [7.0, -6.5, 5.2]
    return x


@pytest.mark.parametrize("scale_mode", ("floor", "even"))
def test_stochastic_samples_are_neighbours_and_unbiased(scale_mode):
    x = _sr_input()
    kw = dict(axis=-1, elem="e2m1", block_size=32, scale_mode=scale_mode, rounding="stochastic")
    n = 2000
    keys = jax.random.split(jax.random.key(0), n)
    sample = jax.jit(jax.vmap(lambda k: quantize_mx(jnp.asarray(x), key=k, **kw)))(keys)
    data = np.asarray(sample.data).astype(np.float64)  # (n, 4, 32)
    r = ref.quantize_mx(x, axis=-1, elem="e2m1", block_size=32, scale_mode=scale_mode)
    np.testing.assert_array_equal(
        np.asarray(sample.scale).view(np.uint8), np.broadcast_to(r.scale_bits, (n, 4, 1))
    )
    y = ref.scaled_values(x, axis=-1, block_size=32, elem="e2m1", scale_mode=scale_mode)
    lo, hi, p_hi = ref.sr_neighbours(y, "e2m1")
    is_lo, is_hi = data == lo, data == hi
    assert (is_lo | is_hi).all(), f"samples off the two neighbours at {np.argwhere(~(is_lo | is_hi))[:5]}"
    # Mean over keys: E[q] = p*hi + (1-p)*lo which equals y inside the range, sat(y) beyond it.
    expect = p_hi * hi + (1 - p_hi) * lo
    inside = np.abs(y) < 6
    np.testing.assert_array_equal(expect[inside], y[inside])
    sigma = np.abs(hi - lo) * np.sqrt(p_hi * (1 - p_hi) / n)
    # Bound: 5 sigma of the exact Bernoulli mean, plus 2^-20 |hi - lo| for a finite-resolution uniform.
    bound = 5 * sigma + 2.0**-20 * np.abs(hi - lo)
    mean = data.mean(axis=0)
    err = np.abs(mean - expect)
    assert (err <= bound).all(), f"biased SR at {np.argwhere(err > bound)[:5]}: mean {mean[err > bound][:5]}"
    # Aggregate: the standardised errors of all random elements average to ~N(0, 1/m).
    rnd = sigma > 0
    z = (mean - expect)[rnd] / sigma[rnd]
    assert abs(z.mean()) < 5 / np.sqrt(rnd.sum()), z.mean()
    # Deterministic elements (exact grid values, saturated) never move.
    assert (data[:, p_hi == 0] == lo[p_hi == 0]).all()
    assert (data[:, 1, 0] == 6.0).all() if scale_mode == "floor" else True


def test_stochastic_keys():
    x = jnp.asarray(_sr_input())
    q = lambda k: np.asarray(_qmx_jit(x, rounding="stochastic", key=k, scale_mode="even").data).view(np.uint8)
    k1, k2 = jax.random.key(1), jax.random.key(2)
    np.testing.assert_array_equal(q(k1), q(k1))
    assert (q(k1) != q(k2)).any()
    # Old-style uint32 keys work too.
    np.testing.assert_array_equal(q(jax.random.PRNGKey(5)), q(jax.random.PRNGKey(5)))


@pytest.mark.parametrize("p_hi", [2.0**-10, 1 - 2.0**-10])
def test_stochastic_probability_resolution(p_hi):
    """Rare round-ups happen at their exact rate: P(up) = 2^-10 needs a uniform finer than 2^-10."""
    x = np.full((256, 32), 2.0 + p_hi, np.float32)  # floor scale with block max 4: e = 0, y in (2, 3)
    x[:, 0] = 4.0
    n_keys = 10
    keys = jax.random.split(jax.random.key(11), n_keys)
    kw = dict(axis=-1, elem="e2m1", block_size=32, scale_mode="floor", rounding="stochastic")
    data = np.asarray(jax.jit(jax.vmap(lambda k: quantize_mx(jnp.asarray(x), key=k, **kw).data))(keys))
    vals = data.astype(np.float64)[:, :, 1:]
    assert set(np.unique(vals)) <= {2.0, 3.0}
    n = vals.size
    ups = (vals == 3.0).sum()
    sd = np.sqrt(n * p_hi * (1 - p_hi))
    assert abs(ups - n * p_hi) < 5 * sd + 1, (ups, n * p_hi, sd)


def test_stochastic_bits_differ_across_device_shards():
    # Eight identical rows, one per device: each shard must draw its own bits (docs/numerics.md: "every device
    # shard gets its own"), and the result must not depend on the sharding.
    x = np.full((8, 32), 2.5, np.float32)
    x[:, 0] = 4.0
    mesh = jax.sharding.Mesh(np.asarray(jax.devices()[:8]), ("d",))
    xs = jax.device_put(jnp.asarray(x), jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("d")))
    kw = dict(scale_mode="floor", rounding="stochastic")
    sharded = np.asarray(_qmx_jit(xs, key=jax.random.key(0), **kw).data).view(np.uint8)
    assert len({row.tobytes() for row in sharded}) == 8, sharded
    single = np.asarray(_qmx_jit(jnp.asarray(x), key=jax.random.key(0), **kw).data).view(np.uint8)
    np.testing.assert_array_equal(sharded, single)


def test_stochastic_elements_draw_independently():
    # 31 elements at y = 2.5 (exactly halfway between 2 and 3): each must flip its own coin.
    x = np.full((3, 32), 2.5, np.float32)
    x[:, 0] = 4.0
    ups = 0
    for i in range(3):
        d = np.asarray(
            _qmx_jit(jnp.asarray(x), scale_mode="floor", rounding="stochastic", key=jax.random.key(i)).data
        )
        d = d.astype(np.float64)[:, 1:]
        assert set(np.unique(d)) <= {2.0, 3.0}
        ups += (d == 3.0).sum()
    n = 3 * 3 * 31
    assert abs(ups - n / 2) < 6 * np.sqrt(n / 4), (ups, n)


# ----------------------------------------------------------------------------------------------------
# FP8 per-tensor scaling.


def _fp8_input(seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((16, 24)) * np.exp2(rng.integers(-6, 6, (16, 24)))).astype(np.float32)
    x[2, :] *= 100  # an outlier token
    x[:, 5] *= 50  # an outlier channel
    x[0, :4] = [0.0, -1e-12, 3.0, -3.0]
    return x


def _assert_fp8_dequant(got, want):
    """data / scale, each element IEEE's quotient (fp8_divide "ieee"): bit for bit. (XLA:CPU's own
    vectorised divide is 1 ulp off the IEEE quotient for ~15% of these inputs.)"""
    got = np.asarray(got)
    assert got.dtype == np.float32
    np.testing.assert_array_equal(got.view(np.uint32), np.asarray(want, np.float32).view(np.uint32))


@pytest.mark.parametrize("elem", ("e4m3", "e5m2"))
def test_quantize_fp8_current_scaling(elem):
    x = _fp8_input(1)
    want_data, want_scale = ref.quantize_fp8(x, elem=elem)
    q = jax.jit(functools.partial(quantize_fp8, elem=elem))(jnp.asarray(x))
    assert q.data.dtype == ref.ELEMS[elem].dtype and q.data.shape == x.shape
    scale = np.asarray(q.scale)
    assert scale.dtype == np.float32 and scale.size == 1
    assert scale.reshape(()).view(np.uint32) == want_scale.view(np.uint32), (scale, want_scale)
    got = np.asarray(q.data)
    want = want_data.astype(ref.ELEMS[elem].dtype)
    bad = got.view(np.uint8) != want.view(np.uint8)
    assert not bad.any(), f"{bad.sum()} differ: x {x[bad][:5]} got {got[bad][:5]} want {want[bad][:5]}"
    _assert_fp8_dequant(q.dequantize(jnp.float32), ref.dequantize_fp8(want_data, want_scale))
    assert np.abs(got.astype(np.float64)).max() == ref.ELEMS[elem].max  # amax maps onto max_elem


@pytest.mark.parametrize("elem", ("e4m3", "e5m2"))
def test_quantize_fp8_explicit_scale_saturates(elem):
    x = _fp8_input(2)
    scale = np.float32(ref.ELEMS[elem].max) / np.float32(np.abs(x).max()) * np.float32(8.0)  # stale amax
    want_data, _ = ref.quantize_fp8(x, elem=elem, scale=scale)
    q = jax.jit(functools.partial(quantize_fp8, elem=elem))(jnp.asarray(x), scale=jnp.float32(scale))
    np.testing.assert_array_equal(
        np.asarray(q.data).view(np.uint8), want_data.astype(ref.ELEMS[elem].dtype).view(np.uint8)
    )
    assert not np.isnan(np.asarray(q.data).astype(np.float32)).any()
    assert (np.abs(np.asarray(q.data).astype(np.float64)) == ref.ELEMS[elem].max).sum() > 1
    _assert_fp8_dequant(q.dequantize(jnp.float32), ref.dequantize_fp8(want_data, scale))


def _fp8_rounding_probes(elem: str) -> np.ndarray:
    """Every midpoint of the non-negative grid, one float32 ulp either side of it, the grid itself, the
    band above max (its would-be next midpoint, inf) and half the smallest subnormal; both signs."""
    bits = np.arange(128, dtype=np.uint8).view(ref.ELEMS[elem].dtype).astype(np.float64)
    grid = np.unique(bits[np.isfinite(bits)])
    mids = ((grid[:-1] + grid[1:]) / 2).astype(np.float32)  # exact: one more significant bit than the grid
    top = np.float32(ref.ELEMS[elem].max)
    tail = np.array([top * 1.0625, np.nextafter(top, np.inf), np.inf, grid[1] / 2], np.float32)
    probes = np.concatenate(
        [grid.astype(np.float32), mids, np.nextafter(mids, np.inf), np.nextafter(mids, 0), tail, tail * 1.001]
    )
    return np.concatenate([probes, -probes]).astype(np.float32)


@pytest.mark.parametrize("elem", ("e4m3", "e5m2"))
def test_quantize_fp8_rounds_every_midpoint_once(elem):
    """The cast rounds once, half to even, subnormals included: a float32 -> float16 -> FP8 conversion
    would turn "just above a midpoint" into a tie and fail here."""
    x = _fp8_rounding_probes(elem)
    want = ref.round_to_grid(x.astype(np.float64), elem, "nearest_even").astype(ref.ELEMS[elem].dtype)
    q = jax.jit(functools.partial(quantize_fp8, elem=elem))(jnp.asarray(x), scale=jnp.float32(1.0))
    got = np.asarray(q.data)
    bad = got.view(np.uint8) != want.view(np.uint8)
    assert not bad.any(), f"{bad.sum()} differ: x {x[bad][:5]} got {got[bad][:5]} want {want[bad][:5]}"


def test_quantize_fp8_zero_tensor():
    q = jax.jit(functools.partial(quantize_fp8, elem="e4m3"))(jnp.zeros((4, 8)))
    assert float(q.scale) == 1.0
    assert (np.asarray(q.data).view(np.uint8) == 0).all()
    np.testing.assert_array_equal(np.asarray(jax.jit(lambda a: a.dequantize(jnp.float32))(q)), 0)


def test_fp8_amax_history():
    hist = jnp.asarray([3.0, 1.0, 7.0, 2.0], jnp.float32)
    x = jnp.asarray([[-5.5, 1.0], [2.0, 0.5]], jnp.float32)
    new = fp8_amax_history_update(hist, x)
    np.testing.assert_array_equal(np.asarray(new), ref.fp8_amax_history_update(hist, x))
    np.testing.assert_array_equal(np.asarray(new), [5.5, 3.0, 1.0, 7.0])
    for elem in ("e4m3", "e5m2"):
        s = fp8_scale_from_history(new, elem)
        assert (
            np.float32(s)
            == ref.fp8_scale_from_history(new, elem)
            == np.float32(ref.ELEMS[elem].max) / np.float32(7)
        )
        assert float(fp8_scale_from_history(jnp.zeros(4), elem)) == 1.0
    # Jittable, and the oldest entry drops out after L updates.
    upd = jax.jit(fp8_amax_history_update)
    h = jnp.zeros(3)
    for v in (1.0, 2.0, 3.0, 4.0):
        h = upd(h, jnp.full((2, 2), v))
    np.testing.assert_array_equal(np.asarray(h), [4.0, 3.0, 2.0])


def test_fp8_scales_are_ieee_quotients_of_every_amax():
    """max / amax as IEEE rounds it (numpy's float32 divide, overflow to inf) for amaxes across the whole
    range and beside the divisors of 448, vectorised and per scalar. XLA:CPU's own divide agrees here; a
    GPU's div.full.f32 does not always, which the GPU lane checks. "xla" is the back end's divide."""
    rng = np.random.default_rng(7)
    amaxes = np.concatenate(
        [
            np.exp2(rng.uniform(-120, 120, 4000)).astype(np.float32),
            np.float32(448) / np.arange(1, 300, dtype=np.float32),
            np.nextafter(np.float32(448) / np.arange(1, 300, dtype=np.float32), np.float32(np.inf)),
        ]
    )
    for elem, top in (("e4m3", 448.0), ("e5m2", 57344.0)):
        with np.errstate(over="ignore"):
            want = np.float32(top) / amaxes
        got = np.asarray(jax.jit(lambda a, e=elem: fp8_scale_from_amax(a, e))(jnp.asarray(amaxes)))
        np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32), err_msg=elem)
        for a in amaxes[:: len(amaxes) // 25]:
            assert np.float32(fp8_scale_from_history(jnp.full(4, a), elem)) == np.float32(top) / a
    xla = jax.jit(lambda a: fp8_scale_from_amax(a, "e4m3", divide="xla"))(jnp.asarray(amaxes))
    np.testing.assert_array_equal(np.asarray(xla), np.asarray(jax.jit(lambda a: 448.0 / a)(amaxes)))
    with pytest.raises(ValueError, match="unknown fp8_divide 'fast'"):
        fp8_scale_from_amax(jnp.float32(3.0), "e4m3", divide="fast")


def test_an_fp8_arrays_divide_is_static_and_kept():
    """The divide travels with the array as structure (not a leaf), through jit and the GEMM's transpose."""
    q = quantize_fp8(jnp.asarray(_fp8_input(3)), divide="xla")
    assert q.divide == "xla" and len(jax.tree.leaves(q)) == 2
    assert jax.jit(lambda a: a)(q).divide == "xla"
    assert quantize_fp8(jnp.ones((2, 2))).divide == "ieee"


# ----------------------------------------------------------------------------------------------------
# qwix's Outlier-Aware Scaling (scale_mode "oas"), bit for bit against its rule transcribed in the reference.

OAS_ELEMS = tuple(ref.QWIX_OAS_C)


def _oas_cases(rng: np.random.Generator, elem: str) -> np.ndarray:
    """_block_cases plus blocks at OAS's own edges: block maxima on both sides of every point where
    amax / max * C crosses a binade before and after its bfloat16 rounding, and around qwix's tiny-scale
    guard (amax / max = 2^-63)."""
    f32 = np.float32
    emax_val = ref.ELEMS[elem].max
    c = ref.QWIX_OAS_C[elem]
    rows = [_block_cases(rng, 32, elem)]
    edges = []
    for p in (-60, -9, 0, 1, 7, 90):
        crossing = f32(emax_val / c * 2.0**p)  # amax whose exact scale * C is 2^p
        for k in range(-300, 301, 25):  # inside and beyond bfloat16's half-ulp below the binade
            edges.append(f32(crossing * (1 + k * 2.0**-16)))
        edges += [np.nextafter(crossing, f32(0)), crossing, np.nextafter(crossing, f32(np.inf))]
    guard = f32(emax_val * 2.0**-63)
    edges += [np.nextafter(guard, f32(0)), guard, np.nextafter(guard, f32(np.inf)), f32(2.0**-70)]
    block = np.zeros((len(edges), 32), np.float32)
    for i, a in enumerate(edges):
        block[i] = (rng.uniform(-1, 1, 32) * a).astype(np.float32)
        block[i, rng.integers(32)] = a
    rows.append(block)
    return np.concatenate(rows)


@pytest.mark.parametrize("rounding", ("nearest_even", "stochastic"))
@pytest.mark.parametrize("elem", OAS_ELEMS)
def test_quantize_mx_oas_matches_qwix_rule(elem, rounding):
    rng = np.random.default_rng([OAS_ELEMS.index(elem), rounding == "stochastic"])
    x = _oas_cases(rng, elem)
    kw = dict(axis=-1, elem=elem, block_size=32, scale_mode="oas")
    key = jax.random.key(3)
    if rounding == "stochastic":
        bits = np.asarray(jax.random.bits(key, (x.shape[0], 1, 32), jnp.uint32)).reshape(x.shape)
        r = ref.quantize_mx(x, **kw, rounding=rounding, uniforms=(bits >> 8) * 2.0**-24)
        mx = _qmx_jit(jnp.asarray(x), **kw, rounding=rounding, key=key)
    else:
        r = ref.quantize_mx(x, **kw, rounding=rounding)
        mx = _qmx_jit(jnp.asarray(x), **kw, rounding=rounding)
    _assert_mx_matches(mx, r, x, f"{elem}/oas/{rounding}")


def test_oas_reference_reproduces_qwix_own_test_values():
    """qwix's test_compute_scale_zero_point_mxfp_oas_bias (same commit): scales 1, 2 for block maxima
    6.5, 7.5 (mxfp4) and 460, 465 (mxfp8); and the implementation's exponents agree."""
    for elem, values in (("e2m1", [6.5, 7.5]), ("e4m3", [460.0, 465.0])):
        np.testing.assert_array_equal(ref.qwix_oas_scale(np.array(values, np.float32), elem), [1.0, 2.0])
        x = np.zeros((2, 32), np.float32)
        x[:, 0] = values
        mx = _qmx_jit(jnp.asarray(x), axis=-1, elem=elem, block_size=32, scale_mode="oas")
        np.testing.assert_array_equal(np.asarray(mx.scale_exponent())[:, 0], [0, 1])


def test_oas_differs_from_even_where_bfloat16_rounds_up():
    """For E2M1 the exact OAS threshold (amax = 7 * 2^k) is the even rule's; qwix's bfloat16 rounding
    moves it down by up to half a bfloat16 ulp, so blocks just below 7 take the larger scale: the rule is
    qwix's, not the even rule renamed."""
    a = np.float32(7 * (1 - 2.0**-10))
    x = np.zeros((1, 32), np.float32)
    x[0, 0] = a
    oas = _qmx_jit(jnp.asarray(x), axis=-1, elem="e2m1", block_size=32, scale_mode="oas")
    even = _qmx_jit(jnp.asarray(x), axis=-1, elem="e2m1", block_size=32, scale_mode="even")
    assert int(oas.scale_exponent()[0, 0]) == 1 and int(even.scale_exponent()[0, 0]) == 0


@pytest.mark.parametrize("elem", OAS_ELEMS)
def test_quantize_mx_oas_nonfinite_blocks(elem):
    rng = np.random.default_rng(12)
    x = _nonfinite_cases(rng, 32)
    kw = dict(axis=-1, elem=elem, block_size=32, scale_mode="oas", rounding="nearest_even")
    mx = _qmx_jit(jnp.asarray(x), **kw)
    np.testing.assert_array_equal(np.asarray(mx.scale).view(np.uint8)[:4, 0], [0xFF] * 4)
    assert np.isnan(np.asarray(mx.dequantize(jnp.float32))[:4]).all()
    _assert_mx_matches(_qmx_jit(jnp.asarray(x[4:]), **kw), ref.quantize_mx(x[4:], **kw), x[4:], "healthy")


@pytest.mark.parametrize("elem", ("e2m3", "e3m2", "e5m2"))
def test_oas_is_refused_for_elements_qwix_defines_no_factor_for(elem):
    from fp4jax.ops.recipes import QuantSpec

    with pytest.raises(ValueError, match="defined for elem 'e2m1' and 'e4m3' only"):
        quantize_mx(jnp.ones((1, 32)), elem=elem, scale_mode="oas")
    with pytest.raises(ValueError, match="defined for elem 'e2m1' and 'e4m3' only"):
        QuantSpec(kind="mx", elem=elem, scale_mode="oas")
