"""Rotate + quantize (+ fold) in one pass: what the GEMM back ends consume, straight from x.

mx_dot_general quantizes its MX operands here (quantized_dot's `_fused_impl`, as Recipe.quantizer says):
by default through the Pallas kernels wherever they run (one NVIDIA GPU), elsewhere through the
reference path (rotate_blocks + quantize_mx); quantizer="xla" runs the fused XLA formulation (slower
than the reference path on GPUs: it lets CPU tests exercise the wiring).

`rotate_quantize(x, axis=..., spec=..., rotation=..., out=...)` applies the block Hadamard rotation,
picks the MX block scales, rounds, and writes either

  out="mx":       an MXArray (E2M1, E2M3, E3M2, E4M3 or E5M2 data, MXFP6 held as E4M3 bytes of the
                  same values; E8M0 scales; blocks along the last axis), or
  out="fp8_fold": a fold.FoldedOperand of E2M1 or E2M3 elements (what the fp8 back end multiplies: E4M3
                  data, one int32 exponent per row, the count of flushed blocks; fold.py),

for the row-wise layout (axis=-1: blocks along x's last axis, result shaped like x) or the column-wise
layout (axis=-2: blocks along x's second-to-last axis, result shaped like swapaxes(x, -1, -2), which is
what the Wgrad GEMM quantizes: x and dy along tokens).

Invariants (tests/test_fused_quantize.py checks them bit for bit on CPU, Pallas in interpret mode):

    rotate_quantize(x, axis=-1, out="mx")        == quantize_mx(hadamard_rotate(x), axis=-1)
    rotate_quantize(x, axis=-2, out="mx")        == quantize_mx(hadamard_rotate(swapaxes(x)), axis=-1)
    rotate_quantize(x, ..., out="fp8_fold")      == fold_mx_to_fp8(rotate_quantize(x, ..., out="mx"))

Both implementations compute the tile math of tile_math.py (the rotation's definition, the exact
integer encoding, the fold), so they give the same bits; only the tiling differs. Exactness does not
depend on the platform: rounding is done on integer significands (no float rounding, no flush-to-zero),
so results equal quantize.py's exact arithmetic everywhere.

Stochastic rounding and prescale run in both implementations. SR's random bits are the reference's:
quantize.stochastic_bits (jax.random.bits, uint32) over the very shape quantize_mx draws them over (the
output orientation, (..., rows, n / block_size, block_size)), whose row-major order is row-major over
the output, so element i of the output (row-major) takes draw number i. The XLA path draws them so. The
Pallas kernels draw them themselves: jax's draw is a counter formula, threefry.random_bits(key words,
i), and each tile evaluates it at its elements' output indices (for a column-wise operand x's tile is
transposed in registers; the indices are the output's). That holds where threefry.formula_applies,
asked each time the quantizer is traced (jax_threefry_partitionable on, a threefry2x32 key, at most
2**32 elements) and KernelConfig.kernel_bits asks (by default for column-wise operands: on the H200
that is where it is faster); elsewhere XLA draws the bits and the kernels read them as one more input
tiled like the output (4 bytes written and 4 read per element more): the same bits either way, never a
change of numerics. tile_math.encode_elements applies
quantize.round_to_grid's own formula to them (the top 24 bits as the uniform variate), so the same key
gives the reference's result. A prescale is quantize_mx's one float32 multiply after the exact scaling,
in both implementations.

Which implementation: impl="auto" asks `choose_impl` (Pallas where `pallas_supports`, XLA elsewhere).
How the Pallas kernels tile and move memory is a `KernelConfig` (a static argument; the default is the
tuned one). Nothing here reads the environment: the trainer's set-up maps FP4JAX_QUANTIZE_IMPL onto
Recipe.quantizer.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax.ops import formats, quantize
from fp4jax.ops.formats import get_elem_format
from fp4jax.ops.kernels import fold, probes, sr_bits, threefry
from fp4jax.ops.kernels import fused_quantize_pallas as pallas_kernels
from fp4jax.ops.kernels.codes import MAX_CODE
from fp4jax.ops.kernels.fused_quantize_pallas import KernelConfig
from fp4jax.ops.kernels.tile_math import (
    NO_BLOCK,
    fold_codes,
    hadamard_rotate,
    quantize_tile,
    scale_bits,
    stored_data,
)
from fp4jax.ops.quant_formats import KINDS
from fp4jax.ops.quantize import MXArray
from fp4jax.ops.recipes import QUANTIZERS, ROTATIONS, QuantSpec, RotationSpec

__all__ = [
    "FUSED_ELEMS",
    "IMPLS",
    "OUTPUTS",
    "PALLAS_COL_MULTIPLE",
    "PALLAS_ROW_MULTIPLE",
    "KernelConfig",
    "choose_impl",
    "fused_refusal",
    "hadamard_rotate",
    "pallas_supports",
    "rotate_quantize",
]

OUTPUTS = ("mx", "fp8_fold")
# The element formats the fused kernels encode (codes.MAX_CODE): every MX element format; and those
# they also fold (out="fp8_fold"): the ones that fold exactly into E4M3 (fold.FOLDED_ELEMS).
FUSED_ELEMS = tuple(MAX_CODE)
FOLDED_ELEMS = fold.FOLDED_ELEMS
IMPLS = ("auto", "pallas", "xla")
# The MX scale rules the fused quantizer computes. "oas" (qwix's rule: an IEEE divide and a bfloat16
# rounding per block) is written for the reference path only, so the fused path refuses it.
FUSED_SCALE_MODES = ("floor", "even", "ceil")


# ----------------------------------------------------------------------------------------------------
# argument checks


def fused_refusal(spec: QuantSpec, rotation: RotationSpec) -> str | None:
    """Why the fused quantizer (either implementation) does not take this operand, or None when it does.

    It encodes MX elements (FUSED_ELEMS) and rotates only by the kinds that declare a fused implementation
    (recipes.ROTATIONS: the signed Hadamard); a kind written for the reference path alone is refused here,
    never run as a Hadamard. Callers take the reference path on a refusal (quantized_dot._fused_impl).
    """
    if not spec.quant_kind.fused:
        fused = ", ".join(repr(name) for name, kind in KINDS.items() if kind.fused)
        return f"the fused quantizer takes the kinds {fused} only, got kind={spec.kind!r}"
    if spec.elem not in FUSED_ELEMS:
        return (
            f"the fused quantizer encodes {', '.join(FUSED_ELEMS)} elements, got elem={spec.elem!r}: "
            "quantize it with quantize.quantize_mx"
        )
    if spec.scale_mode not in FUSED_SCALE_MODES:
        return (
            f"the fused quantizer computes the scale rules {', '.join(FUSED_SCALE_MODES)} only, not "
            f"scale_mode={spec.scale_mode!r}: it runs on the reference path (quantize.quantize_mx)"
        )
    if not rotation.implementation.fused:
        return (
            f"the fused quantizer rotates by {', '.join(k for k, r in ROTATIONS.items() if r.fused)} only, "
            f"not {rotation.kind!r}: quantize it on the reference path (Recipe.quantizer='reference')"
        )
    return None


def _check_args(x, axis, spec: QuantSpec, rotation: RotationSpec, signs, out, impl, fp8_dtype):
    if (refusal := fused_refusal(spec, rotation)) is not None:
        raise ValueError(refusal)
    if out not in OUTPUTS:
        raise ValueError(f"unknown out {out!r}: use one of {', '.join(OUTPUTS)}")
    if impl not in IMPLS:
        raise ValueError(f"unknown impl {impl!r}: use one of {', '.join(IMPLS)}")
    if x.ndim < 2 or axis not in (-1, -2, x.ndim - 1, x.ndim - 2):
        raise ValueError(
            f"axis must be -1 (row-wise) or -2 (column-wise, transposed result) of an array of rank >= 2, "
            f"got axis={axis} for rank {x.ndim}"
        )
    if out == "fp8_fold" and spec.elem not in FOLDED_ELEMS:
        raise ValueError(
            f"out='fp8_fold' folds {' and '.join(e.upper() for e in FOLDED_ELEMS)} elements only, got "
            f"elem={spec.elem!r}: use out='mx' (the fp8 back end multiplies it as emulate does)"
        )
    if out == "fp8_fold" and jnp.dtype(fp8_dtype) != jnp.dtype(jnp.float8_e4m3fn):
        raise ValueError(
            f"the fused fold writes float8_e4m3fn only, got {fp8_dtype}: for e4m3fnuz use "
            "fold.fold_mx_to_fp8(rotate_quantize(..., out='mx'), fp8_dtype=...)"
        )
    if rotation.implementation.signs and (signs is None or signs.shape != (rotation.size,)):
        raise ValueError(f"rotation kind 'random' needs signs of shape ({rotation.size},): pass signs=")
    length = x.shape[axis]
    multiple = rotation.length_multiple(spec.block_size)
    if length % multiple:
        raise ValueError(
            f"axis {axis} has length {length}, not a multiple of {multiple} (block and rotation size): "
            "pad it first (mx_dot_general pads contraction axes)"
        )


def _sign_row(rotation: RotationSpec, signs, n: int):
    if not rotation.implementation.signs:
        return None
    return jnp.tile(jnp.asarray(signs, jnp.float32), n // rotation.size)[None, :]


# ----------------------------------------------------------------------------------------------------
# the XLA path


def _xla_rotate_quantize(x2, spec, rotation, sign_row, random_bits, out):
    """x2: (rows, n), already in the output orientation (random_bits too); returns the raw outputs."""
    fmt = get_elem_format(spec.elem)
    rows, n = x2.shape
    v = x2.astype(jnp.float32)
    if rotation.rotates:
        v = hadamard_rotate(v, rotation.size, sign_row)
    codes, exponent, finite, nonzero = quantize_tile(v, fmt, spec, random_bits)
    if out == "mx":
        data = stored_data(codes, fmt).astype(jnp.uint8).reshape(rows, -1)
        return data, scale_bits(exponent, finite).reshape(rows, -1)
    blocks = n // spec.block_size
    row_e = jnp.where(nonzero, exponent, NO_BLOCK).reshape(rows, blocks)
    row_top = jnp.max(row_e, axis=-1)
    row_top = jnp.where(row_top == NO_BLOCK, 0, row_top)
    nan_row = jnp.any(~finite.reshape(rows, blocks), axis=-1)
    shift = fold.fold_shift(jnp.float8_e4m3fn, spec.elem)
    folded, flushed = fold_codes(
        codes,
        exponent,
        nonzero,
        jnp.repeat(row_top, blocks),
        jnp.repeat(nan_row, blocks),
        fmt,
    )
    row_exponent = jnp.where(nan_row, 0, row_top - shift)
    return folded.astype(jnp.uint8).reshape(rows, n), row_exponent, jnp.sum(flushed.astype(jnp.int32))


# ----------------------------------------------------------------------------------------------------
# the public entry point


# The smallest tiles the kernels are run with where they have been checked on a GPU: output rows in
# multiples of 16, quantized-axis length in multiples of 256 (and block/rotation sizes up to 256).
PALLAS_ROW_MULTIPLE = 16
PALLAS_COL_MULTIPLE = 256


def pallas_supports(
    shape, axis: int, spec: QuantSpec, rotation: RotationSpec, *, device=None, device_count=None
) -> bool:
    """Whether the Pallas (Triton) kernels can run this quantization here.

    Only on NVIDIA GPUs (the kernels are Triton; checked on an H200 by benchmarks/bench_quantize.py),
    with one device in the process (a pallas_call is opaque to XLA's sharding propagation: on a mesh it
    would need shard_map, not written yet), and full tiles (PALLAS_ROW_MULTIPLE, PALLAS_COL_MULTIPLE).
    Every rounding mode and prescale runs in the kernels (stochastic rounding draws its bits in them, or
    reads them as an input where the in-kernel draw would not be jax's).
    """
    device = probes.describe_device() if device is None else device
    device_count = jax.device_count() if device_count is None else device_count
    if device.vendor != "nvidia" or device_count != 1:
        return False
    if fused_refusal(spec, rotation) is not None:
        return False
    column = axis % len(shape) == len(shape) - 2
    out_rows, n = (shape[-1], shape[-2]) if column else (shape[-2], shape[-1])
    full_tiles = out_rows % PALLAS_ROW_MULTIPLE == 0 and n % PALLAS_COL_MULTIPLE == 0
    return full_tiles and rotation.length_multiple(spec.block_size) <= PALLAS_COL_MULTIPLE


def choose_impl(shape, axis: int, spec: QuantSpec, rotation: RotationSpec, *, setting="auto", **where) -> str:
    """The implementation rotate_quantize(impl="auto") uses: "xla" or "pallas" (either output form).

    setting (a Recipe.quantizer value): "xla" (and "reference") always XLA; "auto" and "pallas" the
    kernels wherever `pallas_supports` says they run, XLA elsewhere. Both give the same bits
    (tests/test_fused_quantize.py), so the choice is one of speed only. `where` (device, device_count)
    is for tests.
    """
    if setting not in QUANTIZERS:
        raise ValueError(f"unknown quantize impl {setting!r}: use one of {', '.join(QUANTIZERS)}")
    if setting in ("auto", "pallas") and pallas_supports(shape, axis, spec, rotation, **where):
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
    config: KernelConfig = KernelConfig(),
):
    """Rotates and quantizes x along `axis` in one pass (module docstring: layouts and invariants).

    Args:
      axis: -1 (row-wise) or -2 (column-wise: the result is for swapaxes(x, -1, -2)).
      spec: an MX QuantSpec; rotation: a RotationSpec ("random" needs its `signs`, as
        quantized_dot's _rotation_signs draws them); key: for rounding="stochastic" (either impl; the
        same key gives quantize_mx's bits).
      out: "mx" -> MXArray; "fp8_fold" -> fold.FoldedOperand (E2M1 or E2M3, float8_e4m3fn).
      impl: "auto" (`choose_impl`: Pallas where it runs), "pallas", "xla".
      interpret: run the Pallas kernels in interpret mode (CPU tests).
      config: how the Pallas kernels tile and move memory (KernelConfig; the same bits whatever it says).
    """
    x = jnp.asarray(x)
    _check_args(x, axis, spec, rotation, signs, out, impl, fp8_dtype)
    if not isinstance(config, KernelConfig):
        raise TypeError(f"config must be a KernelConfig, got {type(config).__name__}")
    if spec.rounding == "stochastic" and key is None:
        raise ValueError("rounding='stochastic' needs a PRNG key: pass key=jax.random.key(...)")
    column = axis % x.ndim == x.ndim - 2
    if impl == "auto":
        impl = choose_impl(x.shape, axis, spec, rotation)
    return _rotate_quantize(x, column, spec, rotation, signs, key, out, impl, interpret, config)


@functools.partial(jax.jit, static_argnums=(1, 2, 3, 6, 7, 8, 9))
def _rotate_quantize(x, column, spec, rotation, signs, key, out, impl, interpret, config):
    lead = x.shape[:-2]
    xt = jnp.swapaxes(x, -1, -2) if column else x  # the output orientation: blocks on the last axis
    out_shape = xt.shape
    n = out_shape[-1]
    sign_row = _sign_row(rotation, signs, n)
    if impl == "pallas":
        x3 = x.reshape(-1, *x.shape[-2:])
        key_words = _kernel_key_words(spec, key, x.size, config.draws_in_kernel(column, spec.rng))
        random_bits = None if key_words is not None else _random_bits(spec, key, out_shape)
        bits3 = None if random_bits is None else random_bits.reshape(x3.shape[0], -1, n)
        raw = pallas_kernels.rotate_quantize_3d(
            x3, column, spec, rotation, sign_row, bits3, out, interpret, config, key_words
        )
    else:
        random_bits = _random_bits(spec, key, out_shape)
        bits2 = None if random_bits is None else random_bits.reshape(-1, n)
        raw = _xla_rotate_quantize(xt.reshape(-1, n), spec, rotation, sign_row, bits2, out)
    return _assemble(raw, out_shape, lead, spec, out)


def _random_bits(spec: QuantSpec, key, out_shape):
    """Stochastic rounding's uint32 bits, one per output element, or None for nearest rounding.

    Drawn by quantize.stochastic_bits over the shape quantize_mx draws them over (the output orientation,
    blocks split off the last axis), so with the same key every element gets the reference's bit;
    row-major over that shape is row-major over out_shape, the order both implementations read them in.
    """
    if spec.rounding != "stochastic":
        return None
    n = out_shape[-1]
    shape = (*out_shape[:-1], n // spec.block_size, spec.block_size)
    return quantize.stochastic_bits(key, shape, spec.rng)


def _kernel_key_words(spec: QuantSpec, key, size: int, in_kernel: bool):
    """The key's two uint32 words where the Pallas kernels draw SR's bits themselves, else None.

    They do where the config asks for this layout (in_kernel) and the generator's formula gives its bits
    for this key and size: for rng="threefry", where threefry's formula is jax.random.bits, asked here,
    when tracing (jax_threefry_partitionable is part of jit's cache key, and a key's implementation is
    part of its type); rng="threefry13" is its formula (sr_bits.key_words refuses keys it does not take,
    and `_random_bits` operands of more than 2**32 elements). Elsewhere `_random_bits` draws the same bits
    in XLA.
    """
    if spec.rounding != "stochastic" or not in_kernel:
        return None
    if spec.rng == "threefry":
        return jax.random.key_data(key) if threefry.formula_applies(key, size) else None
    return sr_bits.key_words(key) if size <= 2**32 else None


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
            elem=fmt.name,
        )
    data_u8, row_exponent, flushed = raw
    data = lax.bitcast_convert_type(data_u8.astype(jnp.uint8), jnp.float8_e4m3fn).reshape(out_shape)
    return fold.FoldedOperand(
        data=data,
        row_exponent=row_exponent.astype(jnp.int32).reshape(out_shape[:-1]),
        flushed_blocks=jnp.asarray(flushed, jnp.int32),
    )
