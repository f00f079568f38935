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
import functools
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
    "F32_MIN_NORMAL_BITS",
    "F32_SIGN_MASK",
    "SCALE_BIAS",
    "SCALE_DTYPE",
    "SCALE_EXP_MAX",
    "SCALE_EXP_MIN",
    "SCALE_NAN_BITS",
    "ElemFormat",
    "divide_nearest_even",
    "divide_nearest_even_by_integers",
    "f32_bits",
    "f32_from_bits",
    "float8_to_float32",
    "flush_subnormal",
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
F32_MIN_NORMAL_BITS = 0x00800000  # 2^-126, the smallest normal float32
_F32_CANONICAL_NAN_BITS = 0x7FC00000  # the quiet NaN divide_nearest_even returns for every NaN


def f32_bits(x: jax.Array) -> jax.Array:
    """The int32 bit pattern of x as float32 (x is cast to float32 first; a no-op for float32 tracers, so
    the Pallas kernels use it too)."""
    return lax.bitcast_convert_type(x.astype(jnp.float32), jnp.int32)


def f32_from_bits(bits: jax.Array) -> jax.Array:
    """The float32 whose bit pattern is `bits` (cast to int32 first): the inverse of f32_bits."""
    return lax.bitcast_convert_type(bits.astype(jnp.int32), jnp.float32)


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

# MXFP4 and the FP8 formats (recipes.FP8_ELEMS: the per-tensor FP8 elements are these but E2M1).
ELEM_FORMATS: dict[str, ElemFormat] = {f.name: f for f in (E2M1, E4M3, E5M2)}
# Every element format, also MXFP6: what an MX operand of a recipe takes (recipes.QuantSpec).
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


@functools.partial(jax.jit, inline=True)  # as divide_nearest_even
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
    normal = f32_from_bits(((exponent + 127 - bias) << 23) | (mantissa << (23 - m)))
    subnormal = mantissa.astype(jnp.float32) * jnp.float32(2.0 ** (fmt.emin - m))  # exact
    magnitude = jnp.where(exponent == 0, subnormal, normal)
    # Codes above the largest finite value: E5M2's +-inf (mantissa 0) and NaNs, E4M3FN's NaN (S.1111.111).
    special = jnp.where(mantissa == 0, jnp.float32(jnp.inf), jnp.float32(jnp.nan))
    magnitude = jnp.where(magnitude > fmt.max_value, special, magnitude)
    return jnp.where(bits >= 0x80, -magnitude, magnitude)


# Both divides are jitted, inline=True, as quantize.quantize_mx: an eager call is one compiled program, not
# its 10-60 primitives compiled and dispatched one by one (0.26-0.42 s -> 0.05 s for a new shape on a
# 2-core CPU); inside a caller's trace they are inlined as before.
@functools.partial(jax.jit, inline=True)
def divide_nearest_even(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """numerator / denominator in float32 as IEEE 754 rounds it (to nearest even) in flush-to-zero mode:
    subnormal inputs count as zero and subnormal results become a zero of their sign; zeros, infinities
    and NaNs follow IEEE's table, every NaN as 0x7FC00000. The same bits on every back end. Both arguments
    float32 and broadcastable.

    Why two programs: XLA:GPU lowers a float32 divide to PTX's div.full.f32 (up to 2 ulp from IEEE), so
    GPUs (and any back end but the CPU) take `divide_nearest_even_by_integers`. XLA:CPU's own divide is
    IEEE's in flush-to-zero mode already (tests/test_exact_division.py holds the two equal), and lowering
    only it there keeps the CPU's programs small: the integer program is about 60 operations per divide.
    The choice is made when the program is lowered for its platform (`lax.platform_dependent`).
    """
    a = jnp.asarray(numerator, jnp.float32)
    b = jnp.asarray(denominator, jnp.float32)
    return lax.platform_dependent(a, b, cpu=_cpu_divide, default=divide_nearest_even_by_integers)


def _cpu_divide(a: jax.Array, b: jax.Array) -> jax.Array:
    """XLA:CPU's IEEE divide, subnormals flushed explicitly, NaNs made the one canonical NaN.

    Where the hardware's flush differs from IEEE's rounding followed by a flush: x86 flushes a quotient
    below 2^-126 before rounding it, so one that IEEE rounds up to 2^-126 (exact value at least
    (2^24 - 1) * 2^-150, the tie at 2^-149's spacing, which goes to the even 2^-126) comes out zero. Such
    a quotient means |a| < 4, so A = |a| * 2^64 is exact and A / |b| rounds in the normal range: above
    T = (2^24 - 1) * 2^-86 it is 2^-62 and the quotient is 2^-126; equal to T it is decided exactly by
    A - |b| * 2^-62 >= -|b| * 2^-86 (a difference Sterbenz's lemma makes exact, |b| >= 1 there).
    """
    # XLA:CPU rewrites a divide by a broadcast value (a constant or a scalar) as a multiply by its
    # reciprocal, which is not IEEE's quotient: the barrier hides the broadcast from that rewrite.
    # Subnormals are flushed here as well as by the CPU's arithmetic mode, so that the bits do not
    # depend on that mode.
    a, b = lax.optimization_barrier(jnp.broadcast_arrays(flush_subnormal(a), flush_subnormal(b)))
    quotient = flush_subnormal(a / b)
    numerator, denominator = jnp.abs(a) * jnp.float32(2.0**64), jnp.abs(b)
    scaled = numerator / denominator
    at_threshold = scaled == jnp.float32((2**24 - 1) * 2.0**-86)
    reaches = numerator - denominator * jnp.float32(2.0**-62) >= -(denominator * jnp.float32(2.0**-86))
    rounds_to_normal = (scaled == jnp.float32(2.0**-62)) | (at_threshold & reaches)
    least_normal = jnp.where((a < 0) != (b < 0), jnp.float32(-(2.0**-126)), jnp.float32(2.0**-126))
    quotient = jnp.where(rounds_to_normal, least_normal, quotient)
    return jnp.where(jnp.isnan(quotient), f32_from_bits(jnp.int32(_F32_CANONICAL_NAN_BITS)), quotient)


def flush_subnormal(v: jax.Array) -> jax.Array:
    """v with float32 subnormals replaced by a zero of their sign (what flush-to-zero does, made explicit;
    read from the bits, so whatever the back end's arithmetic mode)."""
    bits = f32_bits(v)
    signed_zero = f32_from_bits(bits & F32_SIGN_MASK)
    return jnp.where((bits & F32_ABS_MASK) < F32_MIN_NORMAL_BITS, signed_zero, v)


@functools.partial(jax.jit, inline=True)  # as divide_nearest_even
def divide_nearest_even_by_integers(numerator: jax.Array, denominator: jax.Array) -> jax.Array:
    """`divide_nearest_even`'s bits on any back end, from the back end's divide as an estimate only.

    The quotient's binade comes from comparing the significands; its 24 significant bits are estimated
    with the back end's divide and corrected with the exact integer remainder (computed modulo 2^32, exact
    because it is small), then rounded once. Flush-to-zero is XLA:CPU's own arithmetic and costs less
    code than gradual underflow.
    """
    a = jnp.asarray(numerator, jnp.float32)
    b = jnp.asarray(denominator, jnp.float32)
    a, b = jnp.broadcast_arrays(a, b)
    a_bits, b_bits = f32_bits(a), f32_bits(b)
    a_abs, b_abs = a_bits & F32_ABS_MASK, b_bits & F32_ABS_MASK
    a_field, b_field = (a_bits >> 23) & 0xFF, (b_bits >> 23) & 0xFF  # biased exponents; 0: zero (flushed)
    a_sig = (a_bits & F32_MANTISSA_MASK) | 0x800000
    b_sig = (b_bits & F32_MANTISSA_MASK) | 0x800000
    below = a_sig < b_sig  # then double the dividend, so that a_sig / b_sig lies in [1, 2)
    a_sig = jnp.where(below, a_sig << 1, a_sig)  # < 2^25, and even when doubled: exact in float32
    exponent = a_field - b_field - below.astype(jnp.int32)  # quotient = (a_sig / b_sig) * 2^exponent

    # sig = floor(a_sig * 2^23 / b_sig) in [2^23, 2^24) and remainder = a_sig * 2^23 - sig * b_sig in
    # [0, b_sig). The divide's estimate is a few units off (2 ulp for div.full.f32); the remainder, in
    # wrapping uint32 arithmetic, is exact since its true magnitude is below 2^27; one float step takes
    # it to within one b_sig of the target, one integer step each way the rest.
    sig = jnp.floor(a_sig.astype(jnp.float32) / b_sig.astype(jnp.float32) * jnp.float32(2.0**23))
    sig = sig.astype(jnp.int32)
    wide = (a_sig.astype(jnp.uint32) << 23) - sig.astype(jnp.uint32) * b_sig.astype(jnp.uint32)
    remainder = lax.bitcast_convert_type(wide, jnp.int32)
    steps = jnp.floor(remainder.astype(jnp.float32) / b_sig.astype(jnp.float32)).astype(jnp.int32)
    sig, remainder = sig + steps, remainder - steps * b_sig
    low = remainder < 0
    sig, remainder = sig - low, remainder + jnp.where(low, b_sig, 0)
    high = remainder >= b_sig
    sig, remainder = sig + high, remainder - jnp.where(high, b_sig, 0)

    # The biased exponent is exponent + 127; the implicit bit of sig (2^23) adds the 1 to exponent + 126,
    # and a carry out of the rounding moves to the next binade by the same addition. Exact halves cannot
    # occur for normal results. A quotient just below the normal range that IEEE rounds up to 2^-126:
    # exponent -127 with sig = 2^24 - 1.
    round_up = (2 * remainder > b_sig) | ((2 * remainder == b_sig) & ((sig & 1) == 1))
    normal_bits = ((jnp.clip(exponent, -126, 128) + 126) << 23) + sig + round_up.astype(jnp.int32)
    magnitude_bits = jnp.minimum(normal_bits, F32_INF_BITS)
    rounds_to_normal = (exponent == -127) & (sig == (1 << 24) - 1)
    below_normal_bits = jnp.where(rounds_to_normal, F32_MIN_NORMAL_BITS, 0)
    magnitude_bits = jnp.where(exponent < -126, below_normal_bits, magnitude_bits)

    # Zeros (flushed subnormals too), infinities and NaNs by IEEE's table.
    a_zero, b_zero = a_field == 0, b_field == 0
    a_inf, b_inf = a_abs == F32_INF_BITS, b_abs == F32_INF_BITS
    nan = (a_abs > F32_INF_BITS) | (b_abs > F32_INF_BITS) | (a_zero & b_zero) | (a_inf & b_inf)
    magnitude_bits = jnp.where(a_inf | b_zero, F32_INF_BITS, magnitude_bits)
    magnitude_bits = jnp.where(a_zero | b_inf, 0, magnitude_bits)
    sign = (a_bits ^ b_bits) & F32_SIGN_MASK
    bits = jnp.where(nan, _F32_CANONICAL_NAN_BITS, magnitude_bits | sign)
    return f32_from_bits(bits)
