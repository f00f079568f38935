"""Rotate + quantize (+ fold) in one pass: what the GEMM back ends consume, straight from x.

mx_dot_general quantizes its MX operands here (quantized_dot._fused_impl): by default through the Pallas
kernels wherever they run (one NVIDIA GPU: 1.2x the reference path's 1B training step on an H200,
docs/performance.md), elsewhere through the reference path; FP4JAX_QUANTIZE_IMPL=xla forces the fused
XLA formulation (slower than the reference path on GPUs: it lets CPU tests exercise the wiring) and
=reference the reference path.

`rotate_quantize(x, axis=..., spec=..., rotation=..., out=...)` applies the block Hadamard rotation,
picks the MX block scales, rounds, and writes either

  out="mx":       an MXArray (E2M1/E4M3/E5M2 data, E8M0 scales, blocks along the last axis), or
  out="fp8_fold": a fold.FoldedOperand (contract B: E4M3 data, int32 row exponents, flushed count),

for the row-wise layout (axis=-1: blocks along x's last axis, result shaped like x) or the column-wise
layout (axis=-2: blocks along x's second-to-last axis, result shaped like swapaxes(x, -1, -2), which is
what the Wgrad GEMM quantizes: x and dy along tokens).

Invariants (tests/test_fused_quantize.py checks them bit for bit on CPU, Pallas in interpret mode):

    rotate_quantize(x, axis=-1, out="mx")        == quantize_mx(hadamard_rotate(x), axis=-1)
    rotate_quantize(x, axis=-2, out="mx")        == quantize_mx(hadamard_rotate(swapaxes(x)), axis=-1)
    rotate_quantize(x, ..., out="fp8_fold")      == fold_mx_to_fp8(rotate_quantize(x, ..., out="mx"))

`hadamard_rotate` is the one definition of the rotation both implementations use: log2(g) butterfly
stages of float32 adds in a fixed order, then one multiply by 1/sqrt(g) (the float32 entry of
rotation.hadamard(g), exact for g = 16). It is the same orthonormal map as rotation.rotate_blocks (a
float32 matmul) but not the same rounding: a matmul's summation order is the library's choice and
differs between back ends, so no fused kernel can reproduce it bit for bit. The two agree exactly
whenever the sums are exact, and within a few float32 ulps otherwise.

Exactness of the quantizer does not depend on the platform: rounding is done on integer significands
(no float rounding, no flush-to-zero), so results equal quantize.py's exact arithmetic everywhere.
Stochastic rounding and prescale run on the XLA path only (SR's random bits are jax.random.bits over the
reference's shape, so it matches quantize_mx bit for bit); impl="pallas" with either is an error.

Which implementation: impl="auto" asks `choose_impl` (Pallas where `pallas_supports`, XLA elsewhere;
FP4JAX_QUANTIZE_IMPL=xla or =reference: XLA).
"""

from __future__ import annotations

import functools
import os

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax.ops import formats
from fp4jax.ops.formats import ElemFormat, get_elem_format
from fp4jax.ops.kernels import backends, fold
from fp4jax.ops.kernels.codes import (
    MAGNITUDE_MASK,
    encode,
    encode_e2m1_nearest_even,
    f32_bits,
    fold_e2m1_to_e4m3fn,
)
from fp4jax.ops.quantize import (
    MXArray,
    _mul_pow2,  # the reference's exact scaling: SR shares it on purpose
    round_to_grid,
    scale_exponent,
)
from fp4jax.ops.recipes import QuantSpec, RotationSpec
from fp4jax.ops.rotation import hadamard

OUTPUTS = ("mx", "fp8_fold")
IMPLS = ("auto", "pallas", "xla")

_ABS_MASK = 0x7FFFFFFF
_INF_BITS = 0x7F800000
_E4M3FN_NAN = 0x7F
_NO_BLOCK = -(2**20)  # below every block exponent: "no non-zero block in this row"


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
    return encode(f32_bits(magnitude) | (x_bits & -0x80000000), jnp.zeros_like(x_bits), fmt, "nearest_even")


# ----------------------------------------------------------------------------------------------------
# one tile: shared by the XLA path (the whole array is one tile) and the Pallas kernels


def _block_info(v: jax.Array, fmt: ElemFormat, spec: QuantSpec):
    """Float32 bits (R, bs), block exponents (R,), finite (R,), non-zero after rounding (R,)."""
    bits = f32_bits(v.reshape(-1, spec.block_size))
    amax_bits = jnp.max(bits & _ABS_MASK, axis=-1)
    return (bits, *block_info_from_amax(amax_bits, fmt, spec))


def block_info_from_amax(amax_bits: jax.Array, fmt: ElemFormat, spec: QuantSpec):
    """Block exponents, finite, non-zero after rounding, from the float32 bits of each block's largest
    magnitude (any shape; with a prescale, one-dimensional)."""
    finite = amax_bits < _INF_BITS
    exponent = scale_exponent(jnp.where(finite, amax_bits, 0), fmt, spec.scale_mode)
    # Rounding (and the prescale's multiply) is monotone, so a block is non-zero iff its largest
    # magnitude rounds to non-zero.
    if spec.prescale == 1:
        top = encode(amax_bits, exponent, fmt, _nearest(spec))
    else:
        prescaled = _prescaled_bits(amax_bits[:, None], exponent, finite, spec)[:, 0]
        top = encode(prescaled, 0, fmt, _nearest(spec))
    nonzero = finite & ((top & MAGNITUDE_MASK[fmt.name]) > 0)
    return exponent, finite, nonzero


def _prescaled(bits, exponent, finite, spec: QuantSpec) -> jax.Array:
    """prescale * x / 2^e as float32, as quantize_mx forms it: its exact _mul_pow2, then one multiply."""
    v = lax.bitcast_convert_type(jnp.where(finite[:, None], bits, 0), jnp.float32)
    scaled = _mul_pow2(v, -exponent[:, None])
    return scaled * jnp.float32(spec.prescale) if spec.prescale != 1 else scaled


def _prescaled_bits(bits, exponent, finite, spec: QuantSpec) -> jax.Array:
    """The bits of _prescaled with x's own sign bit (quantize_mx signs its result from x)."""
    return (f32_bits(_prescaled(bits, exponent, finite, spec)) & _ABS_MASK) | (bits & -0x80000000)


def _nearest(spec: QuantSpec) -> str:
    # A stochastic block is non-zero iff its max rounds up or is above the first grid point; only the
    # XLA path reaches here with stochastic, and it recomputes non-zero-ness from the codes instead.
    return "nearest_even" if spec.rounding == "stochastic" else spec.rounding


def _quantize_tile(v: jax.Array, fmt: ElemFormat, spec: QuantSpec, key=None, bits_shape=None):
    """Codes (R, bs) int32 with sign, block exponents (R,), finite (R,), non-zero (R,)."""
    bits, exponent, finite, nonzero = _block_info(v, fmt, spec)
    if spec.rounding == "stochastic":
        codes = _stochastic_codes(bits, exponent, finite, fmt, spec, key, bits_shape)
        nonzero = finite & (jnp.max(codes & MAGNITUDE_MASK[fmt.name], axis=-1) > 0)
    elif spec.prescale != 1:  # XLA path only: the value is rounded once by the multiply, then encoded
        codes = encode(_prescaled_bits(bits, exponent, finite, spec), 0, fmt, spec.rounding)
    else:
        codes = encode_nearest(bits, exponent[:, None], fmt, spec)
    codes = jnp.where(finite[:, None], codes, 0)
    return codes, exponent, finite, nonzero


def encode_nearest(bits: jax.Array, exponent: jax.Array, fmt: ElemFormat, spec: QuantSpec) -> jax.Array:
    """Codes (with sign) of float32 `bits` scaled by 2^-exponent, rounded to nearest (spec.rounding)."""
    if fmt.name == "e2m1" and spec.rounding == "nearest_even":  # the study's format: the short path
        return encode_e2m1_nearest_even(bits, exponent)
    return encode(bits, exponent, fmt, spec.rounding)


def _stochastic_codes(bits, exponent, finite, fmt, spec, key, bits_shape):
    """quantize.py's own float formulation, with its random bits drawn over the reference's shape."""
    abs_scaled = jnp.abs(_prescaled(bits, exponent, finite, spec)).reshape(bits_shape)
    magnitude = round_to_grid(abs_scaled, fmt, "stochastic", key).reshape(bits.shape)
    return _encode_grid_value(magnitude, bits, fmt)


def _scale_bits(exponent: jax.Array, finite: jax.Array) -> jax.Array:
    return jnp.where(finite, exponent + formats.SCALE_BIAS, formats.SCALE_NAN_BITS)


def _pack_e2m1(codes: jax.Array) -> jax.Array:
    """Two 4-bit codes per byte, element 2i in the low nibble (float4_e2m1fn's bitcast order).

    Written as a sum over a length-2 axis (disjoint bits, so exact): register-local in Triton.
    """
    shift = 4 * jax.lax.broadcasted_iota(jnp.int32, (1, 2), 1)
    return jnp.sum((codes.reshape(-1, 2) & 0xF) << shift, axis=1)


def fold_window(exponent, row_top, shift: int):
    """Per block: (the power of two its E2M1 values are scaled by in the fold, whether it is in the window).

    Blocks more than fold.WINDOW binades below their row's top block are outside (flushed to +0).
    """
    delta = exponent - row_top
    return jnp.clip(delta, -fold.WINDOW, 0) + shift, delta >= -fold.WINDOW


def fold_elements(codes, shift, in_window, nan_row):
    """E4M3FN codes of E2M1 `codes` times 2^shift; +0 outside the window, NaN in NaN rows (fold.py's rule).

    The arguments broadcast against each other (per element, per block or per row)."""
    folded = jnp.where(in_window, fold_e2m1_to_e4m3fn(codes, shift), 0)
    return jnp.where(nan_row, _E4M3FN_NAN, folded)


def _fold_codes(codes, exponent, nonzero, row_top, nan_row, shift: int):
    """E4M3FN codes of q 2^(e_b - top + shift), flushed blocks +0, NaN rows NaN (fold.py's rule)."""
    block_shift, in_window = fold_window(exponent, row_top, shift)
    folded = fold_elements(codes, block_shift[:, None], in_window[:, None], nan_row[:, None])
    flushed = nonzero & ~in_window & ~nan_row
    return folded, flushed


# ----------------------------------------------------------------------------------------------------
# argument checks


def _check_args(x, axis, spec: QuantSpec, rotation: RotationSpec, signs, out, impl, fp8_dtype):
    if spec.kind != "mx":
        raise ValueError(f"rotate_quantize takes an MX QuantSpec (kind='mx'), got kind={spec.kind!r}")
    if out not in OUTPUTS:
        raise ValueError(f"unknown out {out!r}: use one of {', '.join(OUTPUTS)}")
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}: use one of {', '.join(IMPLS)}")
    if x.ndim < 2 or axis not in (-1, -2, x.ndim - 1, x.ndim - 2):
        raise ValueError(
            f"axis must be -1 (row-wise) or -2 (column-wise, transposed result) of an array of rank >= 2, "
            f"got axis={axis} for rank {x.ndim}"
        )
    if out == "fp8_fold" and spec.elem != "e2m1":
        raise ValueError(f"out='fp8_fold' folds E2M1 elements only, got elem={spec.elem!r}")
    if out == "fp8_fold" and jnp.dtype(fp8_dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError(
            f"the fused fold writes float8_e4m3fn only, got {fp8_dtype}: for e4m3fnuz use "
            "fold.fold_mx_to_fp8(rotate_quantize(..., out='mx'), fp8_dtype=...)"
        )
    if rotation.kind == "random" and (signs is None or signs.shape != (rotation.size,)):
        raise ValueError(f"rotation kind 'random' needs signs of shape ({rotation.size},): pass signs=")
    if spec.rounding == "stochastic" and impl == "pallas":
        raise ValueError("stochastic rounding runs on the XLA path only: use impl='xla' or 'auto'")
    if spec.prescale != 1 and impl == "pallas":
        raise ValueError("prescale runs on the XLA path only: use impl='xla' or 'auto'")
    length = x.shape[axis]
    multiple = max(spec.block_size, rotation.size if rotation.kind != "none" else 1)
    if length % multiple:
        raise ValueError(
            f"axis {axis} has length {length}, not a multiple of {multiple} (block and rotation size): "
            "pad it first (mx_dot_general pads contraction axes)"
        )


def _sign_row(rotation: RotationSpec, signs, n: int):
    if rotation.kind != "random":
        return None
    return jnp.tile(jnp.asarray(signs, jnp.float32), n // rotation.size)[None, :]


def _rotation_size(rotation: RotationSpec) -> int | None:
    return None if rotation.kind == "none" else rotation.size


# ----------------------------------------------------------------------------------------------------
# the XLA path


def _xla_rotate_quantize(x2, spec, rotation, sign_row, key, out, bits_shape):
    """x2: (rows, n), already in the output orientation; returns the raw output arrays."""
    fmt = get_elem_format(spec.elem)
    rows, n = x2.shape
    v = x2.astype(jnp.float32)
    if rotation.kind != "none":
        v = hadamard_rotate(v, rotation.size, sign_row)
    codes, exponent, finite, nonzero = _quantize_tile(v, fmt, spec, key, bits_shape)
    if out == "mx":
        data = _pack_e2m1(codes) if fmt.name == "e2m1" else codes.reshape(-1)
        return data.astype(jnp.uint8).reshape(rows, -1), _scale_bits(exponent, finite).reshape(rows, -1)
    blocks = n // spec.block_size
    row_e = jnp.where(nonzero, exponent, _NO_BLOCK).reshape(rows, blocks)
    row_top = jnp.max(row_e, axis=-1)
    row_top = jnp.where(row_top == _NO_BLOCK, 0, row_top)
    nan_row = jnp.any(~finite.reshape(rows, blocks), axis=-1)
    shift = fold.fold_shift(jnp.float8_e4m3fn)
    folded, flushed = _fold_codes(
        codes,
        exponent,
        nonzero,
        jnp.repeat(row_top, blocks),
        jnp.repeat(nan_row, blocks),
        shift,
    )
    row_exponent = jnp.where(nan_row, 0, row_top - shift)
    return folded.astype(jnp.uint8).reshape(rows, n), row_exponent, jnp.sum(flushed.astype(jnp.int32))


# ----------------------------------------------------------------------------------------------------
# the public entry point


# Which implementation `impl="auto"` runs (`choose_impl`), and the environment variable that overrides it.
IMPL_ENV_VAR = "FP4JAX_QUANTIZE_IMPL"
# Its values: IMPLS, and "reference", which sends mx_dot_general's GEMMs back to the reference path
# (rotate_blocks + quantize_mx; for rotate_quantize itself it means XLA).
SETTINGS = (*IMPLS, "reference")
# Whether "auto" takes the Pallas kernels where they can run, here and in mx_dot_general's GEMMs. Yes since
# the short encoder (codes.encode_e2m1_nearest_even): in the 1B training step on an H200 (2026-12-01,
# docs/performance.md) mxfp4_full_h16 ran at 59,226 tokens/s against 49,026 on the reference path
# (+21 %), mxfp4_full at 61,197 against 52,048 (+18 %), one process after the other on one GPU.
AUTO_PREFERS_PALLAS = True
# The smallest tiles the kernels are run with where they have been checked on a GPU: output rows in
# multiples of 16, quantized-axis length in multiples of 256 (and block/rotation sizes up to 256).
PALLAS_ROW_MULTIPLE = 16
PALLAS_COL_MULTIPLE = 256


def impl_setting() -> str:
    """FP4JAX_QUANTIZE_IMPL: "auto" (unset), "xla", "pallas" or "reference"; else a one-line ValueError."""
    value = os.environ.get(IMPL_ENV_VAR, "").strip() or "auto"
    if value not in SETTINGS:
        raise ValueError(f"unknown {IMPL_ENV_VAR}={value!r}: use one of {', '.join(SETTINGS)}")
    return value


def pallas_supports(
    shape, axis: int, spec: QuantSpec, rotation: RotationSpec, *, device=None, device_count=None
) -> bool:
    """Whether the Pallas (Triton) kernels can run this quantization here.

    Only on NVIDIA GPUs (the kernels are Triton; checked on an H200 by benchmarks/bench_quantize.py),
    with one device in the process (a pallas_call is opaque to XLA's sharding propagation: on a mesh it
    would need shard_map, not written yet), nearest rounding without prescale (stochastic rounding and
    prescale stay on the XLA path), and full tiles (PALLAS_ROW_MULTIPLE, PALLAS_COL_MULTIPLE).
    """
    device = backends.describe_device() if device is None else device
    device_count = jax.device_count() if device_count is None else device_count
    if device.vendor != "nvidia" or device_count != 1:
        return False
    if spec.kind != "mx" or spec.rounding == "stochastic" or spec.prescale != 1:
        return False
    column = axis % len(shape) == len(shape) - 2
    out_rows, n = (shape[-1], shape[-2]) if column else (shape[-2], shape[-1])
    multiple = max(spec.block_size, rotation.size if rotation.kind != "none" else 1)
    full_tiles = out_rows % PALLAS_ROW_MULTIPLE == 0 and n % PALLAS_COL_MULTIPLE == 0
    return full_tiles and multiple <= PALLAS_COL_MULTIPLE


def choose_impl(shape, axis: int, spec: QuantSpec, rotation: RotationSpec, *, setting=None, **where) -> str:
    """The implementation rotate_quantize(impl="auto") uses: "xla" or "pallas" (either output form).

    setting (default: the environment, `impl_setting`): "xla" (and "reference") always XLA; "pallas" the
    kernels wherever `pallas_supports` says they run, XLA elsewhere; "auto" the same as "pallas" if
    AUTO_PREFERS_PALLAS, else XLA. Both give the same bits (tests/test_fused_quantize.py), so the choice
    is one of speed only. `where` (device, device_count) is for tests.
    """
    setting = impl_setting() if setting is None else setting
    if setting not in SETTINGS:
        raise ValueError(f"unknown quantize impl {setting!r}: use one of {', '.join(SETTINGS)}")
    wants_pallas = setting == "pallas" or (setting == "auto" and AUTO_PREFERS_PALLAS)
    if wants_pallas and pallas_supports(shape, axis, spec, rotation, **where):
        return "pallas"
    return "xla"


def rotate_quantize(
    x: jax.Array,
    *,
    axis: int = -1,
    spec: QuantSpec,
    rotation: RotationSpec = RotationSpec(),
    signs: jax.Array | None = None,
    key: jax.Array | None = None,
    out: str = "mx",
    fp8_dtype=jnp.float8_e4m3fn,
    impl: str = "auto",
    interpret: bool = False,
):
    """Rotates and quantizes x along `axis` in one pass (module docstring: layouts and invariants).

    Args:
      axis: -1 (row-wise) or -2 (column-wise: the result is for swapaxes(x, -1, -2)).
      spec: an MX QuantSpec; rotation: a RotationSpec ("random" needs its `signs`, as
        quantized_dot's _rotation_signs draws them); key: for rounding="stochastic" (XLA path).
      out: "mx" -> MXArray; "fp8_fold" -> fold.FoldedOperand (E2M1 only, float8_e4m3fn).
      impl: "auto" (`choose_impl`: FP4JAX_QUANTIZE_IMPL; Pallas where it runs by default), "pallas", "xla".
      interpret: run the Pallas kernels in interpret mode (CPU tests).
    """
    x = jnp.asarray(x)
    _check_args(x, axis, spec, rotation, signs, out, impl, fp8_dtype)
    if spec.rounding == "stochastic" and key is None:
        raise ValueError("rounding='stochastic' needs a PRNG key: pass key=jax.random.key(...)")
    column = axis % x.ndim == x.ndim - 2
    if impl == "auto":
        impl = choose_impl(x.shape, axis, spec, rotation)
    return _rotate_quantize(x, column, spec, rotation, signs, key, out, impl, interpret)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 6, 7, 8))
def _rotate_quantize(x, column, spec, rotation, signs, key, out, impl, interpret):
    lead = x.shape[:-2]
    xt = jnp.swapaxes(x, -1, -2) if column else x  # the output orientation: blocks on the last axis
    out_shape = xt.shape
    n = out_shape[-1]
    sign_row = _sign_row(rotation, signs, n)
    if impl == "pallas":
        from fp4jax.ops.kernels import fused_quantize_pallas as kernels

        x3 = x.reshape(-1, *x.shape[-2:])
        raw = kernels.rotate_quantize_3d(x3, column, spec, rotation, sign_row, out, interpret)
    else:
        bits_shape = (*out_shape[:-1], n // spec.block_size, spec.block_size)
        raw = _xla_rotate_quantize(xt.reshape(-1, n), spec, rotation, sign_row, key, out, bits_shape)
    return _assemble(raw, out_shape, lead, spec, out)


def _assemble(raw, out_shape, lead, spec, out):
    """Typed outputs from the kernels' uint8 / int32 arrays (bitcasts only)."""
    fmt = get_elem_format(spec.elem)
    if out == "mx":
        data_u8, scale_u8 = raw
        data = lax.bitcast_convert_type(data_u8.astype(jnp.uint8), fmt.dtype)
        scale = lax.bitcast_convert_type(scale_u8.astype(jnp.uint8), formats.SCALE_DTYPE)
        return MXArray(
            data=data.reshape(out_shape),
            scale=scale.reshape(*out_shape[:-1], -1),
            axis=len(out_shape) - 1,
            block_size=spec.block_size,
        )
    data_u8, row_exponent, flushed = raw
    data = lax.bitcast_convert_type(data_u8.astype(jnp.uint8), jnp.float8_e4m3fn).reshape(out_shape)
    return fold.FoldedOperand(
        data=data,
        row_exponent=row_exponent.astype(jnp.int32).reshape(out_shape[:-1]),
        flushed_blocks=jnp.asarray(flushed, jnp.int32),
    )


__all__ = [
    "rotate_quantize",
    "hadamard_rotate",
    "encode",
    "choose_impl",
    "pallas_supports",
    "impl_setting",
    "OUTPUTS",
    "IMPLS",
]
