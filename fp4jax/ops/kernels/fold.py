"""MX -> E4M3 fold: an MX operand as FP8 elements with one power-of-two exponent per row.

For an MXArray with elements q of format F (E2M1 or E2M3: FOLDED_ELEMS) and blocks along its last axis
(the contraction axis) with block exponents e_b, let E be the largest e_b of the row's non-zero blocks (0
for an all-zero row). With (shift, window) = fold_params(F, fp8 dtype),

    folded[..., k]  = fp8( q[k] * 2^(e_b(k) - E + shift) )     for e_b(k) - E >= -window, else 0
    row_exponent    = E - shift
    dequantize(x)[..., k] == folded[..., k] * 2^row_exponent    exactly, for every block in the window.

Why it is exact (fold_params derives both numbers): F's values have at most E4M3's 4 significant bits and
are multiples of 2^(emin - mantissa_bits); shift is the largest s with max_value * 2^s <= the fp8 type's
largest value, so the top block fits; and a block `window` binades below the top is scaled by
2^(shift - window), which puts F's smallest step on the fp8 type's smallest subnormal (2^-9 for
float8_e4m3fn, 2^-10 for float8_e4m3fnuz). E2M1: shift 6 / 5, window 14 / 14 (FN / FNUZ); E2M3: shift
5 / 5, window 11 / 12. Blocks further below are flushed to zero and counted: their elements are at most
max_value * 2^(E - window - 1), i.e. 2^-14 (E2M1) or 2^-10.9 (E2M3) of the row's largest element when
the top block came from quantize_mx (docs/numerics.md, "Which formats fold"). A NaN block scale makes
the whole row NaN (as the dequantized product would be). The product of two folded operands is then

    out[m, n] = dot_fp8(folded_a[m], folded_c[n]) * 2^row_exponent_a[m] * 2^row_exponent_c[n],

which `backends.fp8_matmul` computes (one FP8 GEMM, the exponents applied to its float32 result).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes

from fp4jax.ops import formats
from fp4jax.ops.quantize import MXArray, pow2

__all__ = [
    "FOLDED_ELEMS",
    "FP8_DTYPES",
    "NO_BLOCK",
    "FoldParams",
    "FoldedOperand",
    "apply_exponents",
    "count_fold_flushes",
    "fold_mx_to_fp8",
    "fold_params",
    "fold_shift",
    "is_foldable",
]

# The E4M3 variants the fold writes: OCP's (NVIDIA, gfx950) and MI300's FNUZ (gfx942).
FP8_DTYPES = (jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e4m3fnuz))
# The elements the fp8 back end folds. Every element whose fold_params exist embeds exactly in its
# window; this is the choice of which windows are wide enough: a flushed E2M1 element is below 2^-14 of
# its row's largest, an E2M3 one below 2^-10.9, both under bfloat16's half-ulp (2^-9). E3M2 (window 9)
# would flush elements up to 2^-9 of the row's largest, so it stays emulate; E4M3 (window 0) and E5M2
# (no shift fits 448) do not fold.
FOLDED_ELEMS = ("e2m1", "e2m3")
_NAN_EXPONENT = formats.SCALE_NAN_BITS - formats.SCALE_BIAS
NO_BLOCK = -(2**20)  # below every real block exponent: marks "no non-zero block" in the row max


@dataclasses.dataclass(frozen=True)
class FoldParams:
    """The fold of one element format into one E4M3 variant: blocks down to `window` binades below the
    row's top block are scaled by 2^(e_b - E + shift), exactly (module docstring)."""

    shift: int
    window: int


def _fp8_info(fp8_dtype) -> ml_dtypes.finfo:
    try:
        dtype = jnp.dtype(fp8_dtype)
    except TypeError:
        dtype = None
    if dtype not in FP8_DTYPES:
        raise ValueError(
            f"cannot fold MX operands into {fp8_dtype}: use jnp.float8_e4m3fn (NVIDIA, gfx950) "
            "or jnp.float8_e4m3fnuz (MI300, gfx942)"
        )
    return ml_dtypes.finfo(dtype)


def fold_params(elem: str, fp8_dtype=jnp.float8_e4m3fn) -> FoldParams | None:
    """(shift, window) of the exact fold of `elem` into `fp8_dtype`, or None where no shift embeds it.

    shift = the largest s with max_value * 2^s <= the fp8 type's max (None if s < 0 or the element has
    more significant bits than the fp8 type); window = shift + (emin - mantissa_bits) - log2(the fp8
    type's smallest subnormal), i.e. + 9 for float8_e4m3fn and + 10 for float8_e4m3fnuz: the most binades
    a block may lie below its row's top block with its smallest step still on the fp8 grid. Derived from
    the formats, not tabled: E2M1 6/14 (FNUZ 5/14), E2M3 5/11 (5/12), E3M2 4/9 (3/9), E4M3 0/0 (FNUZ
    None), E5M2 None.
    """
    fmt, info = formats.get_elem_format(elem), _fp8_info(fp8_dtype)
    fits = [s for s in range(32) if fmt.max_value * 2.0**s <= float(info.max)]  # exact float64 products
    if not fits or fmt.mantissa_bits > info.nmant:
        return None
    shift = fits[-1]
    tiniest = round(math.log2(float(info.smallest_subnormal)))  # -9 (FN), -10 (FNUZ): exact powers of two
    return FoldParams(shift=shift, window=shift + (fmt.emin - fmt.mantissa_bits) - tiniest)


def _require_params(elem: str, fp8_dtype) -> FoldParams:
    params = fold_params(elem, fp8_dtype)
    if params is None or elem not in FOLDED_ELEMS:
        raise ValueError(
            f"fold_mx_to_fp8 folds {' and '.join(e.upper() for e in FOLDED_ELEMS)} elements only, got "
            f"{elem.upper()}: E3M2's exact window (9 binades) is too narrow, E4M3/E5M2 do not fit one E4M3 "
            "grid per row (use backend='emulate' for them)"
        )
    return params


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class FoldedOperand:
    """E4M3 `data` (the MX operand's shape), int32 `row_exponent` (shape[:-1]), int32 scalar `flushed_blocks`.

    Invariant: data[..., k] * 2^row_exponent[...] == the MX operand's dequantized value, for every element
    of every block that was not flushed; rows with a NaN block are all NaN (row_exponent 0).
    """

    data: jax.Array
    row_exponent: jax.Array
    flushed_blocks: jax.Array


def fold_shift(fp8_dtype, elem: str = "e2m1") -> int:
    """The shift of the fold of `elem` into `fp8_dtype` (E2M1: 6 for float8_e4m3fn, 5 for e4m3fnuz)."""
    return _require_params(elem, fp8_dtype).shift


def is_foldable(x) -> bool:
    """True for an MXArray with FOLDED_ELEMS elements blocked along its last axis (what fold_mx_to_fp8
    takes)."""
    return isinstance(x, MXArray) and x.elem in FOLDED_ELEMS and x.axis == x.data.ndim - 1


def _check_foldable(x) -> None:
    if not isinstance(x, MXArray):
        raise TypeError(f"fold_mx_to_fp8 takes an MXArray, got {type(x).__name__}")
    if x.axis != x.data.ndim - 1:
        raise ValueError(
            f"fold_mx_to_fp8 needs blocks along the last axis, got axis={x.axis} of rank {x.data.ndim}: "
            "quantize along the contraction axis, moved last"
        )


def _block_view(x: MXArray) -> tuple[jax.Array, jax.Array]:
    """(elements as float32 (..., blocks, block_size), block exponents int32 (..., blocks))."""
    values = x.data.astype(jnp.float32)  # exact: every MX element value is a float32
    blocks = values.reshape(*values.shape[:-1], -1, x.block_size)
    return blocks, x.scale_exponent()


@dataclasses.dataclass(frozen=True)
class _RowWindow:
    """Per block: the elements, whether it is non-zero, its exponent below the row's top (delta <= 0 for
    every non-zero block), and per row the top exponent and whether a NaN block poisons it; `params`:
    the shift and window of the element's fold into the target fp8 type (fold_params)."""

    blocks: jax.Array  # float32 (..., blocks, block_size)
    nonzero_block: jax.Array  # (..., blocks)
    delta: jax.Array  # int32 (..., blocks)
    row_top: jax.Array  # int32 (..., 1); 0 for an all-zero row
    nan_row: jax.Array  # (...)
    params: FoldParams

    @property
    def in_window(self) -> jax.Array:
        return self.delta >= -self.params.window

    @property
    def flushed(self) -> jax.Array:
        """How many non-zero blocks fall below the window (rows with a NaN block count nothing)."""
        out = self.nonzero_block & ~self.in_window & ~self.nan_row[..., None]
        return jnp.sum(out.astype(jnp.int32))


def _row_window(x: MXArray, fp8_dtype) -> _RowWindow:
    _check_foldable(x)
    params = _require_params(x.elem, fp8_dtype)
    blocks, exponent = _block_view(x)
    is_nan_block = exponent == _NAN_EXPONENT
    nonzero_block = jnp.any(blocks != 0, axis=-1) & ~is_nan_block
    row_top = jnp.max(jnp.where(nonzero_block, exponent, NO_BLOCK), axis=-1, keepdims=True)
    row_top = jnp.where(row_top == NO_BLOCK, 0, row_top)
    nan_row = jnp.any(is_nan_block, axis=-1)
    return _RowWindow(blocks, nonzero_block, exponent - row_top, row_top, nan_row, params)


def fold_mx_to_fp8(x: MXArray, *, fp8_dtype=jnp.float8_e4m3fn) -> FoldedOperand:
    """Folds an E2M1 or E2M3 MXArray (blocks on the last axis) into E4M3 with one exponent per row.

    Invariant (module docstring): data * 2^row_exponent == x.dequantize() for every block within the
    element's window below its row's top block; blocks below it become +0 and are counted.
    """
    w = _row_window(x, fp8_dtype)
    shift, window = w.params.shift, w.params.window
    # q * 2^(delta + shift): q has at most 4 significant bits and is a multiple of 2^(emin - mantissa),
    # the power of two lies in [2^(shift - window), 2^shift]: exact in float32, and on the E4M3 grid
    # (fold_params), so the cast below does not round.
    factor = pow2(jnp.clip(w.delta, -window, 0) + shift)
    folded = jnp.where(w.in_window[..., None], w.blocks * factor[..., None], 0.0)
    folded = folded.reshape(x.data.shape)
    folded = jnp.where(w.nan_row[..., None], jnp.nan, folded).astype(fp8_dtype)
    row_exponent = jnp.where(w.nan_row, 0, w.row_top[..., 0] - shift).astype(jnp.int32)
    return FoldedOperand(data=folded, row_exponent=row_exponent, flushed_blocks=w.flushed)


def count_fold_flushes(x: MXArray, *, fp8_dtype=jnp.float8_e4m3fn) -> jax.Array:
    """How many non-zero blocks of x the fold into fp8_dtype would flush (e_b more than the element's
    window below the row's top: 14 binades for E2M1, 11 for E2M3 into float8_e4m3fn, 12 into e4m3fnuz).

    Only the block exponents and a non-zero test are read; rows with a NaN block count nothing.
    """
    return _row_window(x, fp8_dtype).flushed


def apply_exponents(out: jax.Array, exponent: jax.Array) -> jax.Array:
    """out * 2^exponent for a float32 FP8-GEMM result, exact whenever the true result is a normal float32.

    The FP8 GEMM's result is 0 or a normal float32 with |out| in [2^-26, 2^64]: every product of two FP8
    values (E4M3/E4M3FNUZ, or E5M2 on one side) is a multiple of 2^-26, and a sum of K < 2^39 products
    stays below 2^64. The exponent (Ea + Ec, each in [-133, 122]) can leave float32's range, so it is
    applied as two exact power-of-two multiplies: first 2^k1 with k1 = clip(k, -95, 60), which keeps
    |out * 2^k1| in [2^-121, 2^124] (normal, hence exact), then 2^k2 with the rest. If k2 > 127 the true
    result is >= 2^161 and overflows to inf, as it should; if k2 < -126 it is below 2^-157, under half the
    smallest subnormal, and becomes a signed zero. So the result is exact whenever the true result is a
    normal float32; a subnormal one is rounded once by the second multiply (on a device that keeps
    subnormals; XLA's CPU back end flushes it to zero). A bfloat16 `out` (the GEMM's float32 result
    rounded once) is scaled in bfloat16 the same way: it has float32's exponent range, so the same
    holds for it.
    """
    k1 = jnp.clip(exponent, -95, 60)
    k2 = exponent - k1
    scaled = out * pow2(k1).astype(out.dtype)
    second = jnp.where(k2 < -126, 0.0, pow2(jnp.clip(k2, -126, 127)))
    return scaled * second.astype(out.dtype)
