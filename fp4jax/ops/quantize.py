"""MX block quantization, FP8 per-tensor quantization and the rounding modes (docs/numerics.md).

Exactness. Everything here is computed on float32 bit patterns wherever float arithmetic could be
inexact: XLA's CPU back end flushes subnormals to zero (inputs and results), and `exp2` is not exact for
negative exponents. So powers of two are built from bits, the block maximum is an integer max over
magnitude bit patterns, and dequantization assembles its result bit by bit. The invariants:

    quantize_mx(x).dequantize() == data * 2^e               exactly (including fp32 subnormal results)
    |x - dequantize(quantize_mx(x))| <= half an element ulp  (nearest modes, inside the element range)
    E[dequantize(quantize_mx(x, rounding="stochastic"))] == x   (inside the element range)
"""

from __future__ import annotations

import dataclasses
import functools
import struct
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax.ops import formats
from fp4jax.ops.formats import (
    F32_ABS_MASK,
    F32_INF_BITS,
    F32_MANTISSA_MASK,
    F32_SIGN_MASK,
    ElemFormat,
    f32_bits,
    f32_from_bits,
    float8_to_float32,
    get_elem_format,
)
from fp4jax.ops.kernels import sr_bits

__all__ = [
    "FP8_DIVIDES",
    "ROUNDING_MODES",
    "OAS_FACTORS",
    "SCALE_MODES",
    "FP8Array",
    "MXArray",
    "amax",
    "fp8_amax_history_update",
    "fp8_divide",
    "fp8_scale_from_amax",
    "fp8_scale_from_history",
    "ldexp_exact",
    "pow2",
    "quantize_fp8",
    "quantize_mx",
    "round_to_grid",
    "scale_exponent",
    "stochastic_bits",
]


SCALE_MODES = ("floor", "even", "ceil", "oas")
# Outlier-Aware Scaling (qwix, docs/numerics.md): the factor C that multiplies amax / max_value, for the
# element formats qwix defines it for (its "mxfp4" and "mxfp8", E4M3 elements). No other element has one.
OAS_FACTORS = {"e2m1": 12.0 / 7.0, "e4m3": 60.0 / 31.0}
_OAS_TINY_SCALE = 2.0**-63  # qwix: a scale below sqrt(float32 tiny) is replaced by 1
ROUNDING_MODES = ("nearest_even", "nearest_away", "stochastic")
# How a per-tensor FP8 scale's quotients are divided (fp8_divide): "ieee", IEEE's quotient on every back
# end (formats.divide_nearest_even; Transformer Engine's); "xla", the back end's own divide (up to 2 ulp
# from IEEE on GPUs), the program the 125M study's FP8 trunks were trained with, kept for their continuity.
FP8_DIVIDES = ("ieee", "xla")

_EVEN_ROUND_BIT = 0x200000  # 2^21: rounds a float32 significand to 2 significant bits


# ----------------------------------------------------------------------------------------------------
# float32 bit helpers


def pow2(k: jax.Array | int) -> jax.Array:
    """Exactly 2^k as float32, for integer k in [-126, 127] (the normal range), built from bits."""
    return f32_from_bits((jnp.asarray(k, jnp.int32) + 127) << 23)


def _floor_log2(abs_bits: jax.Array) -> jax.Array:
    """floor(log2(v)) of a non-negative float32 given by its bits; -127 for zero and subnormals."""
    return (abs_bits >> 23) - 127


def _mul_pow2(x: jax.Array, k: jax.Array) -> jax.Array:
    """x * 2^k for float32 x and integer k in [-126, 127], exact whenever |result| >= 2^-126.

    Subnormal x is rebuilt from its integer significand so that a flush-to-zero back end does not drop
    it. Results below 2^-104 come back as (signed) zero: they lie far below half of the smallest
    element of every format here, so they round to zero anyway.
    """
    bits = f32_bits(x)
    is_subnormal = ((bits >> 23) & 0xFF) == 0
    significand = (bits & F32_MANTISSA_MASK).astype(jnp.float32)  # the subnormal's value is this * 2^-149
    from_subnormal = jnp.where(k >= 23, significand * pow2(jnp.maximum(k - 149, -126)), 0.0)
    from_subnormal = jnp.where(bits < 0, -from_subnormal, from_subnormal)
    return jnp.where(is_subnormal, from_subnormal, x * pow2(k))


def ldexp_exact(v: jax.Array, k: jax.Array) -> jax.Array:
    """v * 2^k for float32 v that is zero or normal, k integer, computed on the bit pattern.

    Exact whenever v * 2^k is representable, subnormal results included (the bits shifted out are then
    zero); that holds for every MX element times an E8M0 scale. Overflow gives +-inf.
    """
    bits = f32_bits(v)
    sign = bits & F32_SIGN_MASK
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & F32_MANTISSA_MASK
    new_exponent = exponent + k
    normal = sign | (jnp.clip(new_exponent, 1, 254) << 23) | mantissa
    shift = jnp.clip(1 - new_exponent, 0, 31)
    subnormal = sign | ((mantissa | 0x800000) >> shift)
    out = jnp.where(new_exponent >= 1, normal, subnormal)
    out = jnp.where(new_exponent >= 255, sign | F32_INF_BITS, out)
    return f32_from_bits(jnp.where(exponent == 0, bits, out))


# ----------------------------------------------------------------------------------------------------
# rounding onto an element grid


def stochastic_bits(key: jax.Array, shape: tuple[int, ...], rng: str = "threefry") -> jax.Array:
    """The uint32 random bits stochastic rounding draws for magnitudes of `shape` (one per element).

    Every implementation draws them here, over the reference's shape (quantize_mx's blocked shape), so
    the same key gives the same bit to the same element wherever it is rounded. rng names the generator
    (kernels/sr_bits.py): "threefry" is jax.random.bits; "threefry13" its cheaper counter formula.
    """
    return sr_bits.stochastic_bits(key, shape, rng)


def round_to_grid(
    abs_y: jax.Array,
    fmt: ElemFormat,
    rounding: str,
    key: jax.Array | None = None,
    *,
    random_bits: jax.Array | None = None,
    rng: str = "threefry",
) -> jax.Array:
    """Rounds non-negative float32 magnitudes onto `fmt`'s grid, saturating at fmt.max_value.

    The grid spacing in the binade of v is 2^(q - mantissa_bits) with q = max(floor(log2 v), emin), so
    v / spacing is an exact float32 and rounding it to an integer is the whole job. Stochastic rounding
    picks the upper neighbour with probability (v - lower) / spacing using 24 uniform random bits: the
    top 24 of `random_bits` (uint32 shaped like abs_y), or of stochastic_bits(key, abs_y.shape, rng). The
    fused quantizer's kernels call this same function on their tiles with the same bits, which they
    draw themselves by threefry's counter formula or read from XLA (kernels/fused_quantize.py).
    """
    q = jnp.maximum(_floor_log2(f32_bits(abs_y)), fmt.emin)
    units = abs_y * pow2(fmt.mantissa_bits - q)
    if rounding == "nearest_even":
        units = lax.round(units, lax.RoundingMethod.TO_NEAREST_EVEN)
    elif rounding == "nearest_away":
        units = lax.round(units, lax.RoundingMethod.AWAY_FROM_ZERO)
    elif rounding == "stochastic":
        if random_bits is None and key is None:
            raise ValueError("rounding='stochastic' needs a PRNG key: pass key=jax.random.key(...)")
        random_bits = stochastic_bits(key, abs_y.shape, rng) if random_bits is None else random_bits
        # < 2^24 after the shift: exact through int32, which every back end converts to float32.
        uniform = (random_bits >> 8).astype(jnp.int32).astype(jnp.float32) * (2.0**-24)  # [0, 1), 24 bits
        lower = jnp.floor(units)
        units = lower + (uniform < units - lower).astype(jnp.float32)
    else:
        raise ValueError(f"unknown rounding {rounding!r}: use one of {', '.join(ROUNDING_MODES)}")
    return jnp.minimum(units * pow2(q - fmt.mantissa_bits), fmt.max_value)


def _with_sign(magnitude: jax.Array, x: jax.Array) -> jax.Array:
    """Applies x's sign bit to a magnitude, so a negative value that rounds to zero gives -0."""
    return jnp.where(f32_bits(x) < 0, -magnitude, magnitude)


# ----------------------------------------------------------------------------------------------------
# MX block quantization


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class MXArray:
    """A block-scaled tensor: `data` (x's shape, element dtype) and one E8M0 `scale` per block.

    Blocks are `block_size` contiguous elements along `axis`; scale has x's shape with
    shape[axis] // block_size. The value of element i is data[i] * 2^(scale exponent of its block).

    `elem` names the element format the data hold (formats.ALL_ELEM_FORMATS). It is static (pytree aux
    data) and must be given where the data dtype does not decide it: E2M3, E3M2 and E4M3 are all stored
    as float8_e4m3fn, and the fp8 back end folds E2M3 but not the other two. Invariant: `elem`'s storage
    dtype is data's dtype (checked whenever data has a dtype; tree leaves that are not arrays, such as
    vmap's axis specs, are not checked).
    """

    data: jax.Array
    scale: jax.Array
    axis: int = dataclasses.field(metadata=dict(static=True))
    block_size: int = dataclasses.field(metadata=dict(static=True))
    elem: str | None = dataclasses.field(default=None, metadata=dict(static=True))

    def __post_init__(self):
        object.__setattr__(self, "elem", _element_of(self.data, self.elem))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    def scale_exponent(self) -> jax.Array:
        """The scale as an int32 exponent e (scale = 2^e); 128 marks a NaN scale."""
        return lax.bitcast_convert_type(self.scale, jnp.uint8).astype(jnp.int32) - formats.SCALE_BIAS

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        """data * 2^e exactly in float32 (then cast to dtype); NaN for every element of a NaN block."""
        return _dequantize_mx(self, dtype=dtype)


# Jitted, inline=True, as quantize_mx: an eager call is one compiled program, not some twenty primitives
# compiled and dispatched one by one (0.27 s -> 0.04 s for a new shape on a 2-core CPU).
@functools.partial(jax.jit, static_argnames="dtype", inline=True)
def _dequantize_mx(array: MXArray, dtype: Any) -> jax.Array:
    exponent = jnp.repeat(array.scale_exponent(), array.block_size, axis=array.axis)
    values = ldexp_exact(array.data.astype(jnp.float32), exponent)
    values = jnp.where(exponent == formats.SCALE_NAN_BITS - formats.SCALE_BIAS, jnp.nan, values)
    return values.astype(dtype)


def _element_of(data, elem: str | None) -> str | None:
    """The element format's name for MXArray data, checked against the data's dtype.

    elem=None is taken from the dtype where exactly one format is stored in it (float4_e2m1fn -> e2m1,
    float8_e5m2 -> e5m2); float8_e4m3fn holds E2M3, E3M2 or E4M3, so it needs elem. Leaves without a
    dtype (or float0 tangents) are not checked: the static elem is carried through pytree maps as is.
    """
    dtype = getattr(data, "dtype", None)
    if dtype is None or jnp.dtype(dtype) == jnp.dtype(jax.dtypes.float0):
        return elem
    dtype = jnp.dtype(dtype)
    stored_here = sorted(f.name for f in formats.ALL_ELEM_FORMATS.values() if jnp.dtype(f.dtype) == dtype)
    if elem is None and len(stored_here) == 1:
        return stored_here[0]
    if elem is None:
        holds = f"holds {', '.join(stored_here)}: pass elem=" if stored_here else "is no MX element dtype"
        raise ValueError(f"MXArray data of dtype {dtype} {holds}")
    name = get_elem_format(elem).name
    if name not in stored_here:
        raise ValueError(
            f"MXArray elem={name!r} is stored as {jnp.dtype(get_elem_format(name).dtype)}, "
            f"but its data are {dtype}"
        )
    return name


def check_oas_elem(scale_mode: str, elem: str) -> None:
    """A one-line error where scale_mode "oas" meets an element format qwix defines no factor for."""
    if scale_mode == "oas" and get_elem_format(elem).name not in OAS_FACTORS:
        raise ValueError(
            f"scale_mode='oas' (qwix's Outlier-Aware Scaling) is defined for elem "
            f"{' and '.join(map(repr, OAS_FACTORS))} only, not {elem!r}: choose floor, even or ceil"
        )


def _check_mx_args(
    x: jax.Array, axis: int, block_size: int, scale_mode: str, rounding: str, elem: str
) -> int:
    if not isinstance(block_size, int) or block_size <= 0:
        raise ValueError(f"block_size must be a positive integer, got {block_size!r}")
    if scale_mode not in SCALE_MODES:
        raise ValueError(f"unknown scale_mode {scale_mode!r}: use one of {', '.join(SCALE_MODES)}")
    if rounding not in ROUNDING_MODES:
        raise ValueError(f"unknown rounding {rounding!r}: use one of {', '.join(ROUNDING_MODES)}")
    check_oas_elem(scale_mode, elem)
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for an array of rank {x.ndim}")
    axis %= x.ndim
    if x.shape[axis] % block_size:
        raise ValueError(
            f"axis {axis} has length {x.shape[axis]}, not a multiple of block_size {block_size}: "
            "pad it (mx_dot_general pads contraction axes itself) or choose another block size"
        )
    return axis


def _mantissa_bits_of(value: float) -> int:
    return struct.unpack("<I", struct.pack("<f", value))[0] & F32_MANTISSA_MASK


def _bfloat16_bits(v_bits: jax.Array) -> jax.Array:
    """The float32 bits of a finite float32 (given by its bits) rounded to bfloat16, to nearest even.

    On the bits, not by conversion: XLA:GPU folds a float32 -> bfloat16 -> float32 chain away."""
    return (v_bits + 0x7FFF + ((v_bits >> 16) & 1)) & ~0xFFFF


def _oas_exponent(amax_bits: jax.Array, fmt: ElemFormat) -> jax.Array:
    """qwix's Outlier-Aware Scaling (commit 901efed, qarray.compute_scale_zero_point) as an exponent.

    In float32: s = amax / max_value (IEEE), s = 1 where s < 2^-63, t = s * float32(C), then t rounded
    to bfloat16 (nearest even) with its mantissa cleared: the scale is 2^(t's bfloat16 exponent).
    """
    amax = f32_from_bits(amax_bits)
    scale = formats.divide_nearest_even(amax, jnp.float32(fmt.max_value))
    scale = jnp.where(scale < _OAS_TINY_SCALE, jnp.float32(1.0), scale)
    scaled = scale * jnp.float32(OAS_FACTORS[fmt.name])
    return _floor_log2(_bfloat16_bits(f32_bits(scaled)))


def scale_exponent(amax_bits: jax.Array, fmt: ElemFormat, scale_mode: str) -> jax.Array:
    """The shared exponent e of blocks whose absolute maxima have float32 bits `amax_bits` (finite).

    floor: floor(log2 amax) - emax.  even: the same after rounding amax to 2 significant bits.
    ceil: the smallest e with max_value * 2^e >= amax. oas: qwix's Outlier-Aware Scaling
    (_oas_exponent; E2M1 and E4M3 only). Clamped to [-127, 127].
    """
    if scale_mode == "oas":
        return jnp.clip(_oas_exponent(amax_bits, fmt), formats.SCALE_EXP_MIN, formats.SCALE_EXP_MAX)
    if scale_mode == "even":
        amax_bits = (amax_bits + _EVEN_ROUND_BIT) & ~F32_MANTISSA_MASK
    exponent = _floor_log2(amax_bits) - fmt.emax
    if scale_mode == "ceil":
        # amax = 2^f * m_a and max_value = 2^emax * m_max with m in [1, 2): one more binade iff m_a > m_max.
        above = (amax_bits & F32_MANTISSA_MASK) > _mantissa_bits_of(fmt.max_value)
        exponent = exponent + above.astype(jnp.int32)
    return jnp.clip(exponent, formats.SCALE_EXP_MIN, formats.SCALE_EXP_MAX)


# Jitted with its settings static, inline=True: as mx_dot_general's passes (quantized_dot.py), an eager call
# is one compiled program, not its primitives dispatched one by one (changelog, 2026-12-07). Inside a
# caller's trace it is inlined into the jaxpr on jax 0.10 and stays a nested jit on 0.11.2.
@functools.partial(
    jax.jit,
    static_argnames=("axis", "elem", "block_size", "scale_mode", "rounding", "prescale", "rng"),
    inline=True,
)
def quantize_mx(
    x: jax.Array,
    *,
    axis: int = -1,
    elem: str = "e2m1",
    block_size: int = 32,
    scale_mode: str = "floor",
    rounding: str = "nearest_even",
    key: jax.Array | None = None,
    prescale: float = 1.0,
    rng: str = "threefry",
) -> MXArray:
    """Quantizes x into MX blocks along `axis` (OCP MX v1.0; docs/numerics.md).

    elem: "e2m1" (MXFP4), "e2m3" or "e3m2" (MXFP6, stored as float8_e4m3fn: formats.py), "e4m3" or
    "e5m2" (MXFP8).

    Invariant: quantize_mx(x).dequantize() rounds each prescale * x / 2^e onto the element grid, with e
    the block's shared exponent chosen from x itself; a block holding NaN or +-Inf gets a NaN scale (and
    +0 data). So the result represents prescale * x: with prescale 3/4 and the floor or even rule no
    value exceeds E2M1's maximum, and stochastic rounding stays unbiased (Tseng et al. 2025). rng: the
    generator of stochastic rounding's bits (stochastic_bits).
    """
    fmt = get_elem_format(elem)
    x = jnp.asarray(x)
    axis = _check_mx_args(x, axis, block_size, scale_mode, rounding, elem)

    x_last = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    blocks = x_last.reshape(*x_last.shape[:-1], -1, block_size)
    # Integer max of magnitude bits: exact, immune to flush-to-zero, and NaN/Inf sort above every finite.
    amax_bits = jnp.max(f32_bits(blocks) & F32_ABS_MASK, axis=-1, keepdims=True)
    finite = amax_bits < F32_INF_BITS
    exponent = scale_exponent(jnp.where(finite, amax_bits, 0), fmt, scale_mode)

    scaled = _mul_pow2(jnp.where(finite, blocks, 0.0), -exponent)
    if prescale != 1:
        scaled = scaled * jnp.float32(prescale)
    magnitude = round_to_grid(jnp.abs(scaled), fmt, rounding, key, rng=rng)
    data = jnp.where(finite, _with_sign(magnitude, blocks), 0.0).astype(fmt.dtype)

    scale_bits = jnp.where(finite, exponent + formats.SCALE_BIAS, formats.SCALE_NAN_BITS)
    scale = lax.bitcast_convert_type(scale_bits[..., 0].astype(jnp.uint8), formats.SCALE_DTYPE)
    return MXArray(
        data=jnp.moveaxis(data.reshape(x_last.shape), -1, axis),
        scale=jnp.moveaxis(scale, -1, axis),
        axis=axis,
        block_size=block_size,
        elem=fmt.name,
    )


# ----------------------------------------------------------------------------------------------------
# FP8 per-tensor quantization (the baseline)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FP8Array:
    """A per-tensor scaled FP8 tensor: value = data / scale, `scale` a float32 scalar multiplier."""

    data: jax.Array
    scale: jax.Array
    # How the quotients of this scale are divided (FP8_DIVIDES): where the scale came from and how a GEMM
    # takes its reciprocal. Static: part of the tree's structure, not a leaf.
    divide: str = dataclasses.field(default="ieee", metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        """data / scale, each element's quotient divided as `divide` does (fp8_divide)."""
        return _dequantize_fp8(self, dtype=dtype)


@functools.partial(jax.jit, static_argnames="dtype", inline=True)  # as _dequantize_mx
def _dequantize_fp8(array: FP8Array, dtype: Any) -> jax.Array:
    return fp8_divide(float8_to_float32(array.data), array.scale, array.divide).astype(dtype)


def amax(x: jax.Array) -> jax.Array:
    """max |x| over the whole tensor, as float32 (NaN if x holds NaN)."""
    return jnp.max(jnp.abs(jnp.asarray(x, jnp.float32)))


def fp8_divide(numerator, denominator, divide: str = "ieee") -> jax.Array:
    """numerator / denominator in float32 for a per-tensor FP8 scale: IEEE's quotient on every back end
    (divide "ieee") or the back end's own divide ("xla"; FP8_DIVIDES)."""
    if divide == "ieee":
        return formats.divide_nearest_even(numerator, denominator)
    if divide == "xla":
        return numerator / denominator
    raise ValueError(f"unknown fp8_divide {divide!r}: use one of {', '.join(FP8_DIVIDES)}")


def fp8_scale_from_amax(tensor_amax: jax.Array, elem: str = "e4m3", divide: str = "ieee") -> jax.Array:
    """Current scaling: max_value / amax, so the largest magnitude lands on the format's maximum; 1 if 0.
    The quotient as `divide` (FP8_DIVIDES) computes it."""
    fmt = get_elem_format(elem)
    tensor_amax = jnp.asarray(tensor_amax, jnp.float32)
    safe = jnp.where(tensor_amax > 0, tensor_amax, 1.0)
    return jnp.where(tensor_amax > 0, fp8_divide(jnp.float32(fmt.max_value), safe, divide), jnp.float32(1.0))


@functools.partial(jax.jit, static_argnames=("elem", "divide"), inline=True)  # as quantize_mx
def quantize_fp8(
    x: jax.Array, *, elem: str = "e4m3", scale: jax.Array | None = None, divide: str = "ieee"
) -> FP8Array:
    """Per-tensor FP8: data = saturate(round_half_even(x * scale)); scale=None means current scaling
    (its quotient as `divide` computes it, which the FP8Array keeps for the GEMM's reciprocal).

    The rounding is the element dtype's own conversion from float32 (IEEE round-half-to-even, subnormals
    kept), after a clip that saturates at the format's largest finite value: a three-operation chain that
    XLA fuses into whatever produced x. tests/test_quantize.py checks it bit for bit against an independent
    float64 rounding on every midpoint of both grids (a conversion that went through float16 would round
    twice and fail there).
    """
    fmt = get_elem_format(elem)
    if fmt.name not in ("e4m3", "e5m2"):
        raise ValueError(
            f"quantize_fp8 takes elem 'e4m3' or 'e5m2'; {fmt.name} is an MX element (quantize_mx)"
        )
    x = jnp.asarray(x, jnp.float32)
    scale = fp8_scale_from_amax(amax(x), elem, divide) if scale is None else jnp.asarray(scale, jnp.float32)
    y = x * scale
    saturated = jnp.clip(y, -fmt.max_value, fmt.max_value)
    data = jnp.where(jnp.isnan(y), jnp.nan, saturated)  # one NaN pattern, whatever the sign of y's NaN
    return FP8Array(data=data.astype(fmt.dtype), scale=scale, divide=divide)


def fp8_amax_history_update(history: jax.Array, x: jax.Array) -> jax.Array:
    """Delayed scaling: shifts the amax history by one and puts amax(x) first (the oldest drops out)."""
    return jnp.roll(history, 1).at[0].set(amax(x))


def fp8_scale_from_history(
    history: jax.Array, elem: str = "e4m3", algo: str = "max", divide: str = "ieee"
) -> jax.Array:
    """Delayed scaling (Transformer Engine's DelayedScaling): the scale from the history's largest amax
    (algo "max") or its newest one, history[0] (algo "most_recent"), divided as `divide` does."""
    if algo not in ("max", "most_recent"):
        raise ValueError(f"unknown amax algo {algo!r}: use 'max' or 'most_recent'")
    return fp8_scale_from_amax(jnp.max(history) if algo == "max" else history[0], elem, divide)
