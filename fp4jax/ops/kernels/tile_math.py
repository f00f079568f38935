"""The tile math of the fused quantizer: what the XLA path and the Pallas kernels both compute.

Every function here maps one tile (a float32 array whose last axis holds whole rotation and MX blocks)
to its codes, block exponents and fold, and is written in jnp operations that lower both through XLA
and inside a Pallas (Triton) kernel body. fused_quantize runs them over the whole array at once,
fused_quantize_pallas over one tile per program; sharing them is what makes the two give the same bits.

`hadamard_rotate` is the one definition of the rotation both implementations use: log2(g) butterfly
stages of float32 adds in a fixed order, then one multiply by 1/sqrt(g) (the float32 entry of
rotation.hadamard(g), exact for g = 16). It is the same orthonormal map as rotation.rotate_blocks (a
float32 matmul) but not the same rounding: a matmul's summation order is the library's choice and
differs between back ends, so no fused kernel can reproduce it bit for bit. The two agree exactly
whenever the sums are exact, and within a few float32 ulps otherwise.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp4jax.ops import formats
from fp4jax.ops.formats import F32_ABS_MASK, F32_INF_BITS, F32_SIGN_MASK, ElemFormat, f32_bits, f32_from_bits
from fp4jax.ops.kernels import fold
from fp4jax.ops.kernels.codes import (
    MAGNITUDE_MASK,
    encode,
    encode_e2m1_nearest_even,
    fold_e2m1_to_e4m3fn,
    scale_e4m3fn,
    widen_mxfp6_to_e4m3fn,
)
from fp4jax.ops.quantize import (
    _mul_pow2,  # the reference's exact scaling: SR shares it on purpose
    round_to_grid,
    scale_exponent,
)
from fp4jax.ops.recipes import QuantSpec
from fp4jax.ops.rotation import hadamard

__all__ = [
    "E4M3FN_NAN",
    "NO_BLOCK",
    "block_info",
    "block_info_from_amax",
    "elements_per_byte",
    "encode_elements",
    "encode_nearest",
    "fold_codes",
    "fold_elements",
    "fold_window",
    "hadamard_parts",
    "hadamard_rotate",
    "pack_e2m1",
    "quantize_tile",
    "rounded_nonzero",
    "scale_bits",
    "stored_codes",
    "stored_data",
]

E4M3FN_NAN = 0x7F
NO_BLOCK = fold.NO_BLOCK  # below every block exponent: "no non-zero block in this row"


# ----------------------------------------------------------------------------------------------------
# the rotation (one definition, used by every implementation)


def hadamard_rotate(
    v: jax.Array, size: int, sign_row: jax.Array | None = None, *, spelling: str = "slices"
) -> jax.Array:
    """Rotates each run of `size` elements along v's last axis by diag(signs) H_size; float32 in and out.

    The definition (the rounding is part of it): v * signs, then for h = 1, 2, 4, ..., size/2 every
    pair (i, i + h) of each group of 2h becomes (i: a + b, i + h: a - b), each sum rounded once; zero
    results are +0 (the bits of storing every zero sum as +0); finally times c = hadamard(size)[0, 0]
    (1/sqrt(size) as float32: exact for 16). No product feeds a sum, so no compiler can contract one
    into an FMA and change the bits (the sign products are exact). Sums can overflow where the scaled
    matmul would not: only for |x| near the float32 maximum, and such a block then gets a NaN scale in
    every implementation.
    `spelling` only changes how it is written: "slices" (slices and a stack, which XLA fuses into one
    loop) or "reductions" (sums over a length-2 axis, which Triton keeps in registers and warp
    shuffles); the two give the same bits (tests/test_fused_quantize.py checks it).
    """
    rows, n = v.shape
    if sign_row is not None:
        v = v * sign_row  # +-1: exact, and exact even if contracted into the next sum's FMA
    h = 1
    while h < size:
        v3 = v.reshape(rows * n // (2 * h), 2, h)
        v3 = _butterfly_slices(v3) if spelling == "slices" else _butterfly_reductions(v3)
        v = v3.reshape(rows, n)
        h *= 2
    # A reduction may start from +0 (XLA) or not (Triton), so the spellings may differ in the sign of a
    # zero sum. That sign reaches nothing but later zero sums (x + -0 = x for x != 0), so making the
    # final zeros +0, once, gives exactly the bits of storing every zero sum as +0.
    return jnp.where(v == 0, 0.0, v) * float(hadamard(size)[0, 0])


def hadamard_parts(parts: list[jax.Array], sign_parts: list[jax.Array] | None = None) -> list[jax.Array]:
    """hadamard_rotate on the "parts" form of v: parts[k] holds element k of every run of len(parts).

    The same butterfly, pair for pair and rounding for rounding, so the same bits: the signs first, then
    for h = 1, 2, 4, ... parts i and i + h of each group of 2h become a + b and a - b, then zeros made +0
    and the scale c. Every operation is elementwise between equally shaped parts, so a Triton kernel
    that holds the parts as separate tiles (read strided, or split from one contiguous read) needs no
    cross-thread exchange for the rotation (fused_quantize_pallas).
    """
    size = len(parts)
    if sign_parts is not None:
        parts = [p * s for p, s in zip(parts, sign_parts, strict=True)]  # +-1: exact
    h = 1
    while h < size:
        paired = list(parts)
        for start in range(0, size, 2 * h):
            for i in range(start, start + h):
                paired[i], paired[i + h] = parts[i] + parts[i + h], parts[i] - parts[i + h]
        parts = paired
        h *= 2
    scale = float(hadamard(size)[0, 0])
    return [jnp.where(p == 0, 0.0, p) * scale for p in parts]


def _butterfly_slices(v3: jax.Array) -> jax.Array:
    a, b = v3[:, 0, :], v3[:, 1, :]
    return jnp.stack([a + b, a - b], axis=1)


def _butterfly_reductions(v3: jax.Array) -> jax.Array:
    first = jax.lax.broadcasted_iota(jnp.int32, (1, 2, 1), 1) == 0
    total = jnp.sum(v3, axis=1, keepdims=True)  # a + b
    difference = jnp.sum(jnp.where(first, v3, -v3), axis=1, keepdims=True)  # a + (-b): exact negation
    return jnp.where(first, total, difference)


# ----------------------------------------------------------------------------------------------------
# the stochastic path's encoding


def _encode_grid_value(magnitude: jax.Array, x_bits: jax.Array, fmt: ElemFormat) -> jax.Array:
    """The code of a non-negative float32 already on fmt's grid, with x's sign (stochastic path)."""
    return encode(f32_bits(magnitude) | (x_bits & F32_SIGN_MASK), jnp.zeros_like(x_bits), fmt, "nearest_even")


# ----------------------------------------------------------------------------------------------------
# one tile: shared by the XLA path (the whole array is one tile) and the Pallas kernels


def block_info(v: jax.Array, fmt: ElemFormat, spec: QuantSpec):
    """Float32 bits (R, bs), block exponents (R,), finite (R,), non-zero after rounding (R,)."""
    bits = f32_bits(v.reshape(-1, spec.block_size))
    amax_bits = jnp.max(bits & F32_ABS_MASK, axis=-1)
    return (bits, *block_info_from_amax(amax_bits, fmt, spec))


def block_info_from_amax(amax_bits: jax.Array, fmt: ElemFormat, spec: QuantSpec):
    """Block exponents, finite, non-zero after rounding, from the float32 bits of each block's largest
    magnitude (any shape). Under stochastic rounding non-zero-ness depends on the draw: the caller takes
    it from the codes instead (`rounded_nonzero`)."""
    finite = amax_bits < F32_INF_BITS
    exponent = scale_exponent(jnp.where(finite, amax_bits, 0), fmt, spec.scale_mode)
    # Rounding (and the prescale's multiply) is monotone, so a block is non-zero iff its largest
    # magnitude rounds to non-zero.
    if spec.prescale == 1:
        top = encode(amax_bits, exponent, fmt, _nearest(spec))
    else:
        top = encode(_prescaled_bits(amax_bits, exponent, finite, spec), 0, fmt, _nearest(spec))
    nonzero = finite & ((top & MAGNITUDE_MASK[fmt.name]) > 0)
    return exponent, finite, nonzero


def _prescaled(bits, exponent, finite, spec: QuantSpec) -> jax.Array:
    """prescale * x / 2^e as float32, as quantize_mx forms it: its exact _mul_pow2, then one multiply.

    exponent and finite broadcast against bits (per element, or per block with a trailing axis)."""
    v = f32_from_bits(jnp.where(finite, bits, 0))
    scaled = _mul_pow2(v, -exponent)
    return scaled * jnp.float32(spec.prescale) if spec.prescale != 1 else scaled


def _prescaled_bits(bits, exponent, finite, spec: QuantSpec) -> jax.Array:
    """The bits of _prescaled with x's own sign bit (quantize_mx signs its result from x)."""
    return (f32_bits(_prescaled(bits, exponent, finite, spec)) & F32_ABS_MASK) | (bits & F32_SIGN_MASK)


def _nearest(spec: QuantSpec) -> str:
    # A stochastic block is non-zero iff some element rounds up or lies above the first grid point: not
    # known from its maximum alone, so callers recompute non-zero-ness from the codes (rounded_nonzero).
    return "nearest_even" if spec.rounding == "stochastic" else spec.rounding


def quantize_tile(v: jax.Array, fmt: ElemFormat, spec: QuantSpec, random_bits=None):
    """Codes (R, bs) int32 with sign, block exponents (R,), finite (R,), non-zero (R,).

    random_bits (stochastic rounding): uint32, one per element of v in v's row-major order."""
    bits, exponent, finite, nonzero = block_info(v, fmt, spec)
    if random_bits is not None:
        random_bits = random_bits.reshape(bits.shape)
    codes = encode_elements(bits, exponent[:, None], finite[:, None], fmt, spec, random_bits)
    if spec.rounding == "stochastic":
        nonzero = rounded_nonzero(codes, finite, fmt)
    return codes, exponent, finite, nonzero


def encode_elements(bits, exponent, finite, fmt: ElemFormat, spec: QuantSpec, random_bits=None):
    """Codes (with sign) of float32 `bits` in blocks of exponent `exponent`, +0 in non-finite blocks.

    The one element step of every implementation, each rounding as quantize_mx rounds: nearest modes on
    the integer significand (`encode_nearest`); with a prescale, quantize_mx's multiply, then the encoding
    of that float32; stochastic, quantize_mx's own float formulation (quantize.round_to_grid) with
    `random_bits` (uint32 shaped like bits: the bits quantize.stochastic_bits draws for these elements).
    exponent and finite broadcast against bits.
    """
    if spec.rounding == "stochastic":
        codes = _stochastic_codes(bits, exponent, finite, fmt, spec, random_bits)
    elif spec.prescale != 1:  # the value is rounded once by the multiply, then encoded
        codes = encode(_prescaled_bits(bits, exponent, finite, spec), 0, fmt, spec.rounding)
    else:
        codes = encode_nearest(bits, exponent, fmt, spec)
    return jnp.where(finite, codes, 0)


def rounded_nonzero(codes: jax.Array, finite: jax.Array, fmt: ElemFormat) -> jax.Array:
    """Per block (codes' last axis): finite and some element's code non-zero in magnitude."""
    return finite & (jnp.max(codes & MAGNITUDE_MASK[fmt.name], axis=-1) > 0)


def encode_nearest(bits: jax.Array, exponent: jax.Array, fmt: ElemFormat, spec: QuantSpec) -> jax.Array:
    """Codes (with sign) of float32 `bits` scaled by 2^-exponent, rounded to nearest (spec.rounding)."""
    if fmt.name == "e2m1" and spec.rounding == "nearest_even":  # the study's format: the short path
        return encode_e2m1_nearest_even(bits, exponent)
    return encode(bits, exponent, fmt, spec.rounding)


def _stochastic_codes(bits, exponent, finite, fmt, spec, random_bits):
    """quantize.py's own float formulation, on the random bits the reference draws for these elements."""
    if random_bits is None:
        raise ValueError("rounding='stochastic' needs random bits: pass the key to rotate_quantize")
    abs_scaled = jnp.abs(_prescaled(bits, exponent, finite, spec))
    magnitude = round_to_grid(abs_scaled, fmt, "stochastic", random_bits=random_bits)
    return _encode_grid_value(magnitude, bits, fmt)


def scale_bits(exponent: jax.Array, finite: jax.Array) -> jax.Array:
    return jnp.where(finite, exponent + formats.SCALE_BIAS, formats.SCALE_NAN_BITS)


def stored_codes(codes: jax.Array, fmt: ElemFormat) -> jax.Array:
    """The byte an unpacked element is stored as: its code, except where the format is held in a wider
    dtype (MXFP6: the float8_e4m3fn bits of its values, formats.py "Storage"). E2M1 codes are packed by
    pack_e2m1."""
    if fmt.code_dtype != fmt.dtype:
        return widen_mxfp6_to_e4m3fn(codes, fmt)
    return codes


def elements_per_byte(fmt: ElemFormat) -> int:
    """How many elements one byte of an MXArray's data holds: E2M1 packs two, the others take a byte."""
    return 2 if fmt.name == "e2m1" else 1


def stored_data(codes: jax.Array, fmt: ElemFormat) -> jax.Array:
    """A tile's codes as the flat bytes an MXArray's data hold: E2M1 packed two to a byte, else one
    stored_codes byte per element."""
    return pack_e2m1(codes) if elements_per_byte(fmt) == 2 else stored_codes(codes, fmt).reshape(-1)


def pack_e2m1(codes: jax.Array) -> jax.Array:
    """Two 4-bit codes per byte, element 2i in the low nibble (float4_e2m1fn's bitcast order).

    Written as a sum over a length-2 axis (disjoint bits, so exact): register-local in Triton.
    """
    shift = 4 * jax.lax.broadcasted_iota(jnp.int32, (1, 2), 1)
    return jnp.sum((codes.reshape(-1, 2) & 0xF) << shift, axis=1)


def fold_window(exponent, row_top, fmt: ElemFormat):
    """Per block: (the power of two its values are scaled by in the fold, whether it is in the window).

    Blocks more than the element's window (fold.fold_params: 14 binades for E2M1, 11 for E2M3) below
    their row's top block are outside (flushed to +0).
    """
    params = fold.fold_params(fmt.name)
    delta = exponent - row_top
    return jnp.clip(delta, -params.window, 0) + params.shift, delta >= -params.window


def fold_elements(codes, shift, in_window, nan_row, fmt: ElemFormat):
    """E4M3FN codes of fmt's `codes` times 2^shift; +0 outside the window, NaN in NaN rows (fold.py's
    rule). E2M1 codes are folded directly, E2M3 codes through their stored E4M3 bytes.

    The arguments broadcast against each other (per element, per block or per row)."""
    if fmt.name == "e2m1":
        scaled = fold_e2m1_to_e4m3fn(codes, shift)
    else:
        scaled = scale_e4m3fn(stored_codes(codes, fmt), shift)
    folded = jnp.where(in_window, scaled, 0)
    return jnp.where(nan_row, E4M3FN_NAN, folded)


def fold_codes(codes, exponent, nonzero, row_top, nan_row, fmt: ElemFormat):
    """E4M3FN codes of q 2^(e_b - top + shift), flushed blocks +0, NaN rows NaN (fold.py's rule)."""
    block_shift, in_window = fold_window(exponent, row_top, fmt)
    folded = fold_elements(codes, block_shift[:, None], in_window[:, None], nan_row[:, None], fmt)
    flushed = nonzero & ~in_window & ~nan_row
    return folded, flushed
