"""The fused kernels' short E2M1 encoder and E2M1 -> E4M3FN fold against float64 references written here.

codes.encode (the general integer encoder) is checked through the whole quantizer in
test_fused_quantize.py; the two short paths are checked here element by element, over every block
exponent, the E2M1 ties, subnormal inputs (which XLA's CPU flushes in float arithmetic) and the
saturation region, and also against codes.encode itself.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np

from fp4jax.ops import formats
from fp4jax.ops.kernels import codes

E2M1_GRID = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def _e2m1_code_reference(x: np.ndarray, exponent: np.ndarray) -> np.ndarray:
    """Nearest grid point of |x| 2^-exponent (float64: exact), ties to the even code, then x's sign."""
    y = np.abs(x.astype(np.float64)) * np.exp2(-exponent.astype(np.float64))
    distance = np.abs(y[..., None] - E2M1_GRID)
    nearest = distance.min(axis=-1, keepdims=True)
    candidates = np.where(distance == nearest, np.arange(8), 99)
    even = np.where(candidates % 2 == 0, candidates, 99).min(axis=-1)
    code = np.where(even < 99, even, candidates.min(axis=-1))  # one nearest point, or the even of two
    code = np.where(y > 6.0, 7, code)
    return code | (np.signbit(x).astype(np.int64) << 3)


def _inputs(rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """float32 x and block exponents: every exponent, dense over y in [0, 8), ties, subnormals, zeros."""
    exponent = np.arange(-127, 127)
    parts = []
    y = rng.uniform(0.0, 8.0, (exponent.size, 64))
    ties = rng.choice(
        np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.0, 6.0, 0.5, 4.0]), (exponent.size, 32)
    )
    tiny = rng.uniform(0.0, 0.3, (exponent.size, 32))
    for part in (y, ties, tiny):
        scaled = part * np.exp2(exponent[:, None].astype(np.float64))
        parts.append(np.where(rng.random(part.shape) < 0.5, -scaled, scaled))
    # Subnormal float32 inputs under the smallest block exponents (the cases a flushing back end loses).
    subnormal = np.float32(2.0**-149) * rng.integers(0, 2**23, (exponent.size, 32)).astype(np.float32)
    parts.append(np.where(rng.random(subnormal.shape) < 0.5, -subnormal, subnormal))
    parts.append(
        np.tile(np.array([0.0, -0.0, 2.0**-126, 2.0**-127, 2.0**-149, -(2.0**-148)]), (exponent.size, 1))
    )
    x = np.concatenate(parts, axis=1)
    x = np.where(np.abs(x) < np.finfo(np.float32).max, x, 0.0).astype(np.float32)  # encode takes finite x
    return x, np.broadcast_to(exponent[:, None], x.shape).astype(np.int32)


def _bits_of(x: np.ndarray) -> jax.Array:
    return jnp.asarray(x.view(np.int32))


def test_e2m1_short_encoder_matches_float64_reference_and_encode():
    x, exponent = _inputs(np.random.default_rng(0))
    # The float64 reference needs y exact: x * 2^-e with |x| >= 2^-149 and e >= -127 is.
    keep = np.abs(x.astype(np.float64)) * np.exp2(-exponent.astype(np.float64)) < 2.0**60
    short = np.asarray(jax.jit(codes.encode_e2m1_nearest_even)(_bits_of(x), jnp.asarray(exponent)))
    general = np.asarray(
        jax.jit(codes.encode, static_argnums=(2, 3))(
            _bits_of(x), jnp.asarray(exponent), formats.E2M1, "nearest_even"
        )
    )
    want = _e2m1_code_reference(x, exponent)
    assert keep.mean() > 0.99
    np.testing.assert_array_equal(short[keep], want[keep])
    np.testing.assert_array_equal(short, general)
    # The inputs reach every code, both signs, and subnormal x with non-zero codes.
    assert set(np.unique(short)) == set(range(16))
    subnormal = (np.abs(x) < 2.0**-126) & (np.abs(x) > 0)
    assert np.any(short[subnormal] & 0x7)


def test_e2m1_short_encoder_on_random_bit_patterns():
    """Any finite float32 against any block exponent of [-127, 126], far beyond a block's own range."""
    rng = np.random.default_rng(1)
    bits = rng.integers(-(2**31), 2**31, 200_000, dtype=np.int64).astype(np.int32)
    finite = (bits & 0x7F800000) != 0x7F800000
    bits = bits[finite]
    exponent = rng.integers(-127, 127, bits.size).astype(np.int32)
    short = jax.jit(codes.encode_e2m1_nearest_even)(jnp.asarray(bits), jnp.asarray(exponent))
    general = jax.jit(codes.encode, static_argnums=(2, 3))(
        jnp.asarray(bits), jnp.asarray(exponent), formats.E2M1, "nearest_even"
    )
    np.testing.assert_array_equal(np.asarray(short), np.asarray(general))


def test_fold_to_e4m3fn_matches_float64_values_for_every_code_and_shift():
    code = np.arange(16, dtype=np.int32)[:, None]
    shift = np.arange(-8, 7, dtype=np.int32)[None, :]
    code, shift = np.broadcast_arrays(code, shift)
    got = np.asarray(jax.jit(codes.fold_e2m1_to_e4m3fn)(jnp.asarray(code), jnp.asarray(shift)))
    value = E2M1_GRID[code & 7] * np.exp2(shift.astype(np.float64))
    value = np.where(code & 8, -value, value)
    want_fp8 = value.astype(ml_dtypes.float8_e4m3fn)
    assert np.all(want_fp8.astype(np.float64) == value)  # every value is exact in E4M3FN
    np.testing.assert_array_equal(got.astype(np.uint8), want_fp8.view(np.uint8))


def test_scaling_an_e4m3_byte_matches_ml_dtypes_wherever_the_result_is_exact():
    """scale_e4m3fn (the fold of MXFP6's stored bytes): every zero or normal E4M3FN byte, both signs,
    times 2^shift for shifts across and beyond the fold's, against ml_dtypes' encoding of the float64
    product, on every product E4M3FN holds exactly (the fold's window guarantees it holds them)."""
    byte = np.arange(256, dtype=np.int32)
    field, magnitude = (byte & 0x7F) >> 3, byte & 0x7F
    byte = byte[((field > 0) & (magnitude != 0x7F)) | (magnitude == 0)]  # zero, normal, not NaN
    value = byte.astype(np.uint8).view(ml_dtypes.float8_e4m3fn).astype(np.float64)
    checked = 0
    for shift in range(-14, 10):
        scaled = value * 2.0**shift
        exact = (np.abs(scaled) <= 448) & (np.mod(np.abs(scaled), 2.0**-9) == 0)
        got = np.asarray(jax.jit(codes.scale_e4m3fn)(jnp.asarray(byte), jnp.int32(shift)))
        want = scaled.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
        np.testing.assert_array_equal(got[exact].astype(np.uint8), want[exact], err_msg=f"shift {shift}")
        checked += int(exact.sum())
    assert checked > 3000  # subnormal results (shifts below -6) and the largest (448) among them


def test_mxfp6_codes_widen_to_their_values_in_e4m3():
    """Every E2M3 and E3M2 code (both signs): the float8_e4m3fn bits of its value, as ml_dtypes decodes
    the 6-bit code and encodes the value (exact: every MXFP6 value is an E4M3 value)."""
    code = np.arange(64, dtype=np.int32)
    for fmt in (formats.E2M3, formats.E3M2):
        value = code.astype(np.uint8).view(fmt.code_dtype).astype(np.float64)
        want = value.astype(ml_dtypes.float8_e4m3fn)
        assert np.array_equal(want.astype(np.float64), value)  # the widening is exact
        got = np.asarray(jax.jit(codes.widen_mxfp6_to_e4m3fn, static_argnums=1)(jnp.asarray(code), fmt))
        np.testing.assert_array_equal(got.astype(np.uint8), want.view(np.uint8), err_msg=fmt.name)
