"""Element formats of the OCP Microscaling (MX) v1.0 spec and FP8, with the constants the quantizers need.

MXFP4 (E2M1), MXFP6 (E2M3, E3M2) and MXFP8 (E4M3, E5M2) elements. Every element format here is a small
float with 1 sign bit, `mantissa_bits` explicit mantissa bits and normal exponents in [emin, emax]. Its
representable magnitudes are the grid

    {k * 2^(q - mantissa_bits) : q = max(floor(log2|v|), emin)}  up to max_value,

which is what `quantize.round_to_grid` rounds onto. None of the formats has an infinity we ever produce:
values beyond `max_value` saturate.

Storage. XLA (this JAX) has no 6-bit float arrays, so E2M3 and E3M2 data are held as float8_e4m3fn, which
represents every E2M3 and E3M2 value exactly (3 mantissa bits >= 3 and 2; exponents 2^-9 .. 2^8 cover
2^-3 .. 7.5 and 2^-4 .. 28): `dtype` is what arrays hold, `code_dtype` the format's own ml_dtypes type,
whose bit patterns are the 6-bit codes (`np.asarray(data).astype(fmt.code_dtype)` is exact).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import ml_dtypes
from jax import lax

__all__ = [
    "ALL_ELEM_FORMATS",
    "E2M1",
    "E2M3",
    "E3M2",
    "E4M3",
    "E5M2",
    "ELEM_FORMATS",
    "F32_ABS_MASK",
    "F32_INF_BITS",
    "F32_MANTISSA_MASK",
    "F32_SIGN_MASK",
    "SCALE_BIAS",
    "SCALE_DTYPE",
    "SCALE_EXP_MAX",
    "SCALE_EXP_MIN",
    "SCALE_NAN_BITS",
    "ElemFormat",
    "divide_nearest_even",
    "float8_to_float32",
    "get_elem_format",
    "require_power_of_two",
]

# The MX shared scale: an unsigned 8-bit power of two, bias 127, 2^-127 .. 2^127, 0xFF = NaN.
SCALE_DTYPE = jnp.float8_e8m0fnu
SCALE_BIAS = 127
SCALE_EXP_MIN = -127
SCALE_EXP_MAX = 127
SCALE_NAN_BITS = 0xFF

# Float32 bit fields, as int32 (the exact quantizers work on bit patterns, never on rounded floats).
F32_MANTISSA_MASK = 0x7FFFFF
F32_ABS_MASK = 0x7FFFFFFF
F32_SIGN_MASK = -0x80000000  # 0x80000000 as an int32
F32_INF_BITS = 0x7F800000


@dataclasses.dataclass(frozen=True)
class ElemFormat:
    """One element format. `emax` is the exponent of the largest binade (OCP's emax_elem); `dtype` is the
    array dtype its data are stored in, `code_dtype` the format's own dtype (the same unless wider storage
    is needed, see the module docstring)."""

    name: str
    dtype: Any
    emax: int
    emin: int
    mantissa_bits: int
    max_value: float
    code_dtype: Any = None

    def __post_init__(self):
        if self.code_dtype is None:
            object.__setattr__(self, "code_dtype", self.dtype)


E2M1 = ElemFormat("e2m1", jnp.float4_e2m1fn, emax=2, emin=0, mantissa_bits=1, max_value=6.0)
# MXFP6, OCP MX v1.0 section 5.3.2: E2M3 (bias 1, no inf/NaN) and E3M2 (bias 3, no inf/NaN).
E2M3 = ElemFormat(
    "e2m3",
    jnp.float8_e4m3fn,
    emax=2,
    emin=0,
    mantissa_bits=3,
    max_value=7.5,
    code_dtype=ml_dtypes.float6_e2m3fn,
)
E3M2 = ElemFormat(
    "e3m2",
    jnp.float8_e4m3fn,
    emax=4,
    emin=-2,
    mantissa_bits=2,
    max_value=28.0,
    code_dtype=ml_dtypes.float6_e3m2fn,
)
E4M3 = ElemFormat("e4m3", jnp.float8_e4m3fn, emax=8, emin=-6, mantissa_bits=3, max_value=448.0)
E5M2 = ElemFormat("e5m2", jnp.float8_e5m2, emax=15, emin=-14, mantissa_bits=2, max_value=57344.0)

# The formats the GEMM recipes take (recipes.QuantSpec): MXFP4, MXFP8 and FP8.
ELEM_FORMATS: dict[str, ElemFormat] = {f.name: f for f in (E2M1, E4M3, E5M2)}
# Every format the quantizers take: also MXFP6 (quantize_mx only; not yet a recipe's operand).
ALL_ELEM_FORMATS: dict[str, ElemFormat] = {**ELEM_FORMATS, E2M3.name: E2M3, E3M2.name: E3M2}


def require_power_of_two(n: int, what: str) -> None:
    """Raises ValueError naming `what` unless n is a positive integer power of two (1, 2, 4, ...).

    The one check behind every size that must tile a binary structure: MX block sizes, Hadamard and
    rotation sizes. bool is rejected although it is an int subclass.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(f"{what} must be a positive power of two (1, 2, 4, ..., 16, 32, ...), got {n!r}")


def get_elem_format(name: str | ElemFormat) -> ElemFormat:
    """Looks up an element format by name ("e2m1", "e2m3", "e3m2", "e4m3", "e5m2")."""
    if isinstance(name, ElemFormat):
        return name
    try:
        return ALL_ELEM_FORMATS[name]
    except (KeyError, TypeError):
        raise ValueError(
            f"unknown element format {name!r}: use one of {', '.join(sorted(ALL_ELEM_FORMATS))}"
        ) from None


_FLOAT8_FORMATS = {jnp.dtype(f.dtype): f for f in (E4M3, E5M2)}


def float8_to_float32(x: jax.Array) -> jax.Array:
    """The float32 values of a float8_e4m3fn or float8_e5m2 array, decoded from its bit patterns.

    Use this, not x.astype(float32), where x was rounded to FP8 in the same program: XLA:GPU's
    simplify-fp-conversions pass (on under xla_allow_excess_precision, XLA's default) folds a chain of
    float conversions float32 -> FP8 -> float32 into nothing, so the widened values would be the unrounded
    float32 ones on GPUs (not on CPUs). Integer decoding is not a conversion chain, so the rounding stays.
    Exact for every code: subnormals, -0, E5M2's infinities and NaNs, E4M3FN's NaN.
    """
    fmt = _FLOAT8_FORMATS.get(jnp.dtype(x.dtype))
    if fmt is None:
        raise ValueError(f"float8_to_float32 takes float8_e4m3fn or float8_e5m2 arrays, got {x.dtype}")
    m, bias = fmt.mantissa_bits, 1 - fmt.emin
    bits = lax.bitcast_convert_type(x, jnp.uint8).astype(jnp.int32)
    exponent = (bits >> m) & (0x7F >> m)
    mantissa = bits & ((1 << m) - 1)
    normal = lax.bitcast_convert_type(((exponent + 127 - bias) << 23) | (mantissa << (23 - m)), jnp.float32)
    subnormal = mantissa.astype(jnp.float32) * jnp.float32(2.0 ** (fmt.emin - m))  # exact
    magnitude = jnp.where(exponent == 0, subnormal, normal)
    # Codes above the largest finite value: E5M2's +-inf (mantissa 0) and NaNs, E4M3FN's NaN (S.1111.111).
    special = jnp.where(mantissa == 0, jnp.float32(jnp.inf), jnp.float32(jnp.nan))
    magnitude = jnp.where(magnitude > fmt.max_value, special, magnitude)
    return jnp.where(bits >= 0x80, -magnitude, magnitude)


_QUOTIENT_BITS = 26  # the 24 of a float32 significand, a guard bit, and one for a quotient below 1


def _unpack_finite(bits: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(significand, exponent) of finite non-zero float32 magnitudes' bits: value = sig * 2^(exp - 23) with
    sig in [2^23, 2^24), subnormals normalized (count leading zeros)."""
    field = bits >> 23
    fraction = bits & F32_MANTISSA_MASK
    subnormal_shift = lax.clz(jnp.maximum(fraction, 1)) - 8  # moves the leading one to bit 23
    sig = jnp.where(field == 0, fraction << subnormal_shift, fraction | 0x800000)
    exp = jnp.where(field == 0, -126 - subnormal_shift, field - 127)
    return sig, exp


def divide_nearest_even(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """numerator / denominator in float32, rounded to nearest even, computed with integer arithmetic.

    Why: XLA:GPU lowers a float32 divide to PTX's div.full.f32 (up to 2 ulp off, and not the same
    rounding as XLA:CPU's), so a quantizer whose scales come from a quotient (NVFP4's) would not
    be bit-exact on GPUs. This is IEEE 754 division, subnormal results and overflow to inf included,
    the same bits on every back end: a restoring long division of the significands into 26 quotient
    bits, then one rounding with the remainder as sticky bit; zeros, infinities and NaNs by IEEE's table
    (a NaN result is the quiet NaN 0x7FC00000). Both arguments float32 and broadcastable.
    """
    a = jnp.asarray(numerator, jnp.float32)
    b = jnp.asarray(denominator, jnp.float32)
    a, b = jnp.broadcast_arrays(a, b)
    a_bits = lax.bitcast_convert_type(a, jnp.int32)
    b_bits = lax.bitcast_convert_type(b, jnp.int32)
    a_abs, b_abs = a_bits & F32_ABS_MASK, b_bits & F32_ABS_MASK
    regular = (a_abs != 0) & (b_abs != 0) & (a_abs < F32_INF_BITS) & (b_abs < F32_INF_BITS)
    a_sig, a_exp = _unpack_finite(jnp.where(regular, a_abs, 0x3F800000))
    b_sig, b_exp = _unpack_finite(jnp.where(regular, b_abs, 0x3F800000))
    below = a_sig < b_sig  # then shift the dividend so the quotient lies in [1, 2)
    remainder = jnp.where(below, a_sig << 1, a_sig)
    exponent = a_exp - b_exp - below.astype(jnp.int32)  # quotient = 1.f * 2^exponent
    quotient = jnp.zeros_like(remainder)
    for _ in range(_QUOTIENT_BITS):  # remainder < 2 * b_sig < 2^25: no overflow
        take = remainder >= b_sig
        quotient = (quotient << 1) | take.astype(jnp.int32)
        remainder = (remainder - jnp.where(take, b_sig, 0)) << 1
    # quotient holds 1.f in units of 2^(exponent - 25). Keep 24 bits (normal results) or the bits that
    # reach 2^-149 (subnormal ones); round what is dropped to nearest even, the remainder breaking ties.
    drop = jnp.clip(-exponent - 124, _QUOTIENT_BITS - 24, _QUOTIENT_BITS + 1)
    kept = lax.shift_right_logical(quotient, drop)
    dropped = quotient & ((1 << drop) - 1)
    half = 1 << (drop - 1)
    round_up = (dropped > half) | ((dropped == half) & ((remainder != 0) | ((kept & 1) == 1)))
    kept = kept + round_up.astype(jnp.int32)
    # Normal: the implicit bit of `kept` (2^23) adds one to the biased exponent, so use exponent + 126;
    # a carry out of the significand moves to the next binade by the same addition. Subnormal: the
    # bits are `kept` itself (reaching 2^23 is the smallest normal number, also right).
    normal_bits = ((jnp.clip(exponent, -126, 128) + 126) << 23) + kept
    magnitude_bits = jnp.where(exponent < -126, kept, jnp.minimum(normal_bits, F32_INF_BITS))
    # Zeros and infinities by IEEE's table, not the hardware's divide: XLA:CPU flushes a subnormal
    # numerator to zero first, so 1e-45 / 0 would be NaN there.
    a_nan, b_nan = a_abs > F32_INF_BITS, b_abs > F32_INF_BITS
    a_inf, b_inf = a_abs == F32_INF_BITS, b_abs == F32_INF_BITS
    invalid = a_nan | b_nan | ((a_abs == 0) & (b_abs == 0)) | (a_inf & b_inf)
    magnitude_bits = jnp.where(a_inf | (b_abs == 0), F32_INF_BITS, magnitude_bits)
    magnitude_bits = jnp.where((a_abs == 0) | b_inf, 0, magnitude_bits)
    magnitude_bits = jnp.where(invalid, 0x7FC00000, magnitude_bits)
    sign = jnp.where(invalid, 0, (a_bits ^ b_bits) & F32_SIGN_MASK)
    return lax.bitcast_convert_type(magnitude_bits | sign, jnp.float32)
