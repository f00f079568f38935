"""Exact integer encoding of float32 values onto the MX element grids: the codes the fused kernels write.

Everything here works on float32 bit patterns and integer significands, so the results are the same on
every back end (no float rounding, no flush-to-zero): `encode` rounds |x| / 2^e onto an element grid by
shifting the integer significand, and equals quantize.py's float formulation bit for bit
(tests/test_fused_quantize.py checks it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax.ops.formats import ElemFormat
from fp4jax.ops.quantize import pow2

_MANTISSA_MASK = 0x7FFFFF
# Largest finite code (sign bit clear) of each element format: the saturation point.
MAX_CODE = {"e2m1": 0x7, "e4m3": 0x7E, "e5m2": 0x7B}
MAGNITUDE_MASK = {"e2m1": 0x7, "e4m3": 0x7F, "e5m2": 0x7F}


def f32_bits(v: jax.Array) -> jax.Array:
    return lax.bitcast_convert_type(v, jnp.int32)


def floor_log2_abs(bits: jax.Array) -> jax.Array:
    """floor(log2|x|) of float32 bits, subnormals included (the int -> float32 convert is exact)."""
    biased = (bits >> 23) & 0xFF
    mantissa = bits & _MANTISSA_MASK
    of_subnormal = ((f32_bits(mantissa.astype(jnp.float32)) >> 23) & 0xFF) - 127 - 149
    return jnp.where(biased == 0, of_subnormal, biased - 127)


def encode(bits: jax.Array, exponent: jax.Array, fmt: ElemFormat, rounding: str) -> jax.Array:
    """The element code (sign included) of RN(|x| / 2^exponent) on fmt's grid, saturated; int32.

    x is given by its float32 bits (finite), exponent is an int32 in [-127, 127]. The scaled value
    |x| 2^-exponent = sig 2^(lo - exponent) is rounded by shifting the integer significand sig right by
    sh bits, so the result is exact on every back end. Code = units + (q - emin) 2^m, q the binade.
    """
    biased = (bits >> 23) & 0xFF
    mantissa = bits & _MANTISSA_MASK
    sig = jnp.where(biased == 0, mantissa, mantissa | 0x800000)
    lo = jnp.where(biased == 0, -149, biased - 150)
    q = jnp.maximum(floor_log2_abs(bits) - exponent, fmt.emin)
    # units = sig * 2^-sh; sh >= 1 always (the scaled value is < 2^(emax+1)); beyond 31 it rounds to 0.
    sh = jnp.clip(q + exponent - fmt.mantissa_bits - lo, 1, 31)
    units = sig >> sh
    rest = sig & ((1 << sh) - 1)
    half = 1 << (sh - 1)
    if rounding == "nearest_even":
        up = (rest > half) | ((rest == half) & ((units & 1) == 1))
    elif rounding == "nearest_away":
        up = rest >= half
    else:
        raise ValueError(f"encode rounds nearest_even or nearest_away, got {rounding!r}")
    code = units + up.astype(jnp.int32) + ((q - fmt.emin) << fmt.mantissa_bits)
    code = jnp.minimum(code, MAX_CODE[fmt.name])
    sign_shift = 3 if fmt.name == "e2m1" else 7
    return code | ((bits >> 31) & 1) << sign_shift


def e2m1_value(code: jax.Array) -> jax.Array:
    """|E2M1 value| of a code as float32: 0, .5, 1, 1.5 (codes 0-3), then (2 + odd) 2^(code/2 - 2)."""
    mag = code & 0x7
    small = mag.astype(jnp.float32) * 0.5
    large = (2 + (mag & 1)).astype(jnp.float32) * pow2((mag >> 1) - 2)
    return jnp.where(mag < 4, small, large)
