"""Exact integer encoding of float32 values onto the MX element grids: the codes the fused kernels write.

Everything here works on float32 bit patterns and integer significands, so the results are the same on
every back end (no float rounding, no flush-to-zero): `encode` rounds |x| / 2^e onto an element grid by
shifting the integer significand, and equals quantize.py's float formulation bit for bit
(tests/test_fused_quantize.py checks it).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp4jax.ops.formats import F32_ABS_MASK, F32_MANTISSA_MASK, ElemFormat, f32_bits, f32_from_bits
from fp4jax.ops.quantize import pow2

__all__ = [
    "MAGNITUDE_MASK",
    "SIGN_SHIFT",
    "MAX_CODE",
    "encode",
    "encode_e2m1_nearest_even",
    "floor_log2_abs",
    "fold_e2m1_to_e4m3fn",
    "scale_e4m3fn",
    "widen_mxfp6_to_e4m3fn",
]


# Largest finite code (sign bit clear) of each element format: the saturation point.
# Per element format: the largest finite magnitude's code and the magnitude's bits (the sign is the
# next bit up). MXFP6's 6-bit formats have no NaN or infinity, so every magnitude code is finite.
MAX_CODE = {"e2m1": 0x7, "e2m3": 0x1F, "e3m2": 0x1F, "e4m3": 0x7E, "e5m2": 0x7B}
MAGNITUDE_MASK = {"e2m1": 0x7, "e2m3": 0x1F, "e3m2": 0x1F, "e4m3": 0x7F, "e5m2": 0x7F}
SIGN_SHIFT = {name: mask.bit_length() for name, mask in MAGNITUDE_MASK.items()}
_BITS_OF_2_TO_14 = (14 + 127) << 23


def floor_log2_abs(bits: jax.Array) -> jax.Array:
    """floor(log2|x|) of float32 bits, subnormals included (the int -> float32 convert is exact)."""
    biased = (bits >> 23) & 0xFF
    mantissa = bits & F32_MANTISSA_MASK
    of_subnormal = ((f32_bits(mantissa.astype(jnp.float32)) >> 23) & 0xFF) - 127 - 149
    return jnp.where(biased == 0, of_subnormal, biased - 127)


def encode(bits: jax.Array, exponent: jax.Array, fmt: ElemFormat, rounding: str) -> jax.Array:
    """The element code (sign included) of RN(|x| / 2^exponent) on fmt's grid, saturated; int32.

    x is given by its float32 bits (finite), exponent is an int32 in [-127, 127]. The scaled value
    |x| 2^-exponent = sig 2^(lo - exponent) is rounded by shifting the integer significand sig right by
    sh bits, so the result is exact on every back end. Code = units + (q - emin) 2^m, q the binade.
    """
    biased = (bits >> 23) & 0xFF
    mantissa = bits & F32_MANTISSA_MASK
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
    return code | ((bits >> 31) & 1) << SIGN_SHIFT[fmt.name]


def encode_e2m1_nearest_even(bits: jax.Array, exponent: jax.Array) -> jax.Array:
    """encode(bits, exponent, E2M1, "nearest_even") in about half the operations: the fused kernels' path.

    Same contract and the same bits (tests/test_codes.py checks it against `encode`), for finite x and
    exponent in [-127, 126] (every finite block's: even ceil mode gives at most 127 - 2 + 1). Two steps:

    1. y = |x| 2^-exponent as float32, exact whenever y >= 2^-126 (smaller y round to code 0 anyway).
       A subnormal x is rebuilt from its bit pattern, so that a back end that flushes subnormal inputs
       (XLA's CPU does) still sees it: with k = max(-exponent, 23), the float with x's mantissa and
       exponent field k + 1 is 2^(k-126) + m 2^(k-149), and subtracting 2^(k-126) leaves m 2^(k-149),
       exactly (Sterbenz). k is raised to 23 so that both terms stay normal; for -exponent < 23 the
       result is below 2^-103 either way.
    2. Round y onto the E2M1 grid by one float addition: in the binade of y the grid step is
       s = 1/2 (y < 2), 1 (y in [2, 4)) or 2 (y >= 4), and y + 2^23 s rounds y to a multiple of s,
       to nearest even, in hardware (y < 2^23 s, so the sum stays in the binade of 2^23 s). The
       difference of the float bits is the count of steps; the binade adds 2 codes per step up.
       Saturation is one min: 7 steps of 2 and up all land above code 7.
    """
    magnitude = bits & F32_ABS_MASK
    k = -exponent
    from_normal = f32_from_bits(magnitude) * pow2(jnp.clip(k, -126, 127))
    k_sub = jnp.maximum(k, 23)
    from_subnormal = f32_from_bits(magnitude + ((k_sub + 1) << 23)) - pow2(k_sub - 126)
    y = jnp.where(magnitude < 0x800000, from_subnormal, from_normal)
    binade = jnp.clip(f32_bits(y) >> 23, 127, 129)  # 127: y < 2, 128: [2, 4), 129: >= 4
    magic_bits = (binade + 22) << 23  # 2^(binade - 105) = 2^23 s: 2^22, 2^23, 2^24
    steps = f32_bits(y + f32_from_bits(magic_bits)) - magic_bits
    code = jnp.minimum(steps + ((binade - 127) << 1), MAX_CODE["e2m1"])
    return code | ((bits >> 28) & 0x8)


def fold_e2m1_to_e4m3fn(code: jax.Array, shift: jax.Array) -> jax.Array:
    """The float8_e4m3fn bits of E2M1 value(code) * 2^shift, for shift in [-8, 6] (the fold's window).

    Every such value is exact in E4M3FN (fold.py says why), so no rounding happens: the value is built
    as float32 bits (code 1 is 2^(shift-1); codes 2-7 add code << 22 to that, which steps the exponent
    by code // 2 and sets the top mantissa bit to code's low bit), then re-encoded (_e4m3fn_of_exact).
    Zero codes give +-0 (sign kept). `shift` may have size-1 axes: the per-block part is then computed
    once per block.
    """
    magnitude = code & 0x7
    half = (126 + shift) << 23  # float32 bits of 2^(shift - 1), E2M1's 0.5 after the shift
    value_bits = jnp.where(magnitude > 1, (magnitude << 22) + half, jnp.where(magnitude == 1, half, 0))
    return _e4m3fn_of_exact(value_bits) | ((code & 0x8) << 4)


def scale_e4m3fn(byte: jax.Array, shift: jax.Array) -> jax.Array:
    """The float8_e4m3fn bits of value(byte) * 2^shift, for a zero or normal E4M3FN byte (int32) whose
    scaled value lies on E4M3FN's grid (a multiple of 2^-9, at most 448): the fold of MXFP6 elements,
    which are stored as such bytes (widen_mxfp6_to_e4m3fn); the caller's window guarantees the grid.

    The scaled value is built as float32 bits (the byte's exponent field + 120 + shift, its 3 mantissa
    bits on top) and re-encoded as fold_e2m1_to_e4m3fn does: no rounding anywhere. Signs are kept.
    """
    magnitude = byte & 0x7F
    value_bits = (((magnitude >> 3) + 120 + shift) << 23) | ((magnitude & 0x7) << 20)
    value_bits = jnp.where(magnitude > 0, value_bits, 0)
    return _e4m3fn_of_exact(value_bits) | (byte & 0x80)


def _e4m3fn_of_exact(value_bits: jax.Array) -> jax.Array:
    """E4M3FN magnitude bits of a non-negative float32 (given by its bits) that E4M3FN holds exactly.

    Normal (>= 2^-6): re-bias the exponent field (- 120) and keep the top three mantissa bits. Below, the
    value is a multiple of E4M3's subnormal step 2^-9, and adding 2^14 (whose float32 step is 2^-9)
    leaves exactly the count of steps in the low bits. Zero gives 0.
    """
    steps_of_2_to_14 = f32_bits(f32_from_bits(value_bits) + 2.0**14) - _BITS_OF_2_TO_14
    return jnp.where(value_bits < (121 << 23), steps_of_2_to_14, (value_bits >> 20) - (120 << 3))


def widen_mxfp6_to_e4m3fn(code: jax.Array, fmt: ElemFormat) -> jax.Array:
    """The float8_e4m3fn bits of an E2M3 or E3M2 code's value: MXFP6's storage (formats.py), exact.

    A magnitude code (e field, m mantissa bits) is units 2^(max(e, 1) - bias - m) with units = the
    mantissa plus the hidden bit where e > 0, emin = 1 - bias. units < 2^(m+1) <= 16 converts to float32
    exactly, so its float32 exponent and top three mantissa bits are the value's, with the binade moved by
    max(e, 1) + emin - 1 - m. Every non-zero value is normal in E4M3 (the smallest, 2^-3 and 2^-4, are
    above 2^-6; the largest, 7.5 and 28, below 448): E4M3 exponent field = unbiased + 7. Zero gives +-0.
    Integer operations and one int -> float32 convert only: no float rounding for a back end to fold.
    """
    m = fmt.mantissa_bits
    magnitude = code & MAGNITUDE_MASK[fmt.name]
    field = magnitude >> m
    units = jnp.where(field > 0, magnitude - (field << m) + (1 << m), magnitude)
    unit_bits = f32_bits(units.astype(jnp.float32))
    exponent = (unit_bits >> 23) - 127 + jnp.maximum(field, 1) + fmt.emin - 1 - m
    e4m3 = ((exponent + 7) << 3) | ((unit_bits >> 20) & 0x7)
    return jnp.where(magnitude > 0, e4m3, 0) | (((code >> SIGN_SHIFT[fmt.name]) & 1) << 7)
