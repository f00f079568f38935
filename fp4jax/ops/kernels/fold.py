"""MX -> E4M3 fold: an MXFP4 operand as FP8 elements with one power-of-two exponent per row.

For an MXArray with E2M1 elements q and blocks along its last axis (the contraction axis) with block
exponents e_b, let E be the largest e_b of the row's non-zero blocks (0 for an all-zero row). Then

    folded[..., k]  = fp8( q[k] * 2^(e_b(k) - E + shift) )     shift = 6 (E4M3FN), 5 (E4M3FNUZ)
    row_exponent    = E - shift
    dequantize(x)[..., k] == folded[..., k] * 2^row_exponent    exactly, for every block in the window.

Why it is exact: q is a multiple of 0.5 below 6, and e_b - E + shift <= shift, so the largest folded value
is 6 * 2^6 = 384 <= 448 (FNUZ: 6 * 2^5 = 192 <= 240); the smallest non-zero is 0.5 * 2^(e_b - E + shift),
which sits on the E4M3 subnormal grid (2^-9, FNUZ 2^-10) exactly when e_b - E >= -14. Every E2M1 value has
at most two significant bits, so it fits E4M3's four. Blocks further below (e_b - E < -14: every element
at most 6 * 2^(E - 15), i.e. 2^-14 of the row's largest element when that block came from quantize_mx,
whose top element is >= 3) are flushed to zero and counted. A NaN block scale makes the whole row NaN (as
the dequantized product would be). The product of two folded operands is then

    out[m, n] = dot_fp8(folded_a[m], folded_c[n]) * 2^row_exponent_a[m] * 2^row_exponent_c[n],

which `backends.fp8_matmul` computes (one FP8 GEMM, the exponents applied to its float32 result).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from fp4jax.ops import formats
from fp4jax.ops.quantize import MXArray, pow2

__all__ = [
    "NO_BLOCK",
    "SHIFTS",
    "WINDOW",
    "FoldedOperand",
    "apply_exponents",
    "count_fold_flushes",
    "fold_mx_to_fp8",
    "fold_shift",
    "is_foldable",
]


# The window below a row's top block that folds exactly, and the shift that puts the top block's largest
# element (6 * 2^E) at the top of each E4M3 variant: 6 * 2^6 = 384 <= 448, 6 * 2^5 = 192 <= 240.
WINDOW = 14
SHIFTS = {jnp.dtype(jnp.float8_e4m3fn): 6, jnp.dtype(jnp.float8_e4m3fnuz): 5}
_NAN_EXPONENT = formats.SCALE_NAN_BITS - formats.SCALE_BIAS
NO_BLOCK = -(2**20)  # below every real block exponent: marks "no non-zero block" in the row max


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


def fold_shift(fp8_dtype) -> int:
    """The shift of the fold into `fp8_dtype` (6 for float8_e4m3fn, 5 for float8_e4m3fnuz)."""
    try:
        return SHIFTS[jnp.dtype(fp8_dtype)]
    except (KeyError, TypeError):
        raise ValueError(
            f"cannot fold MX operands into {fp8_dtype}: use jnp.float8_e4m3fn (NVIDIA, gfx950) "
            "or jnp.float8_e4m3fnuz (MI300, gfx942)"
        ) from None


def is_foldable(x) -> bool:
    """True for an MXArray with E2M1 elements blocked along its last axis (what fold_mx_to_fp8 takes)."""
    return (
        isinstance(x, MXArray)
        and jnp.dtype(x.data.dtype) == jnp.dtype(formats.ELEM_FORMATS["e2m1"].dtype)
        and x.axis == x.data.ndim - 1
    )


def _check_foldable(x) -> None:
    if not isinstance(x, MXArray):
        raise TypeError(f"fold_mx_to_fp8 takes an MXArray, got {type(x).__name__}")
    if jnp.dtype(x.data.dtype) != jnp.dtype(formats.ELEM_FORMATS["e2m1"].dtype):
        raise ValueError(
            f"fold_mx_to_fp8 folds E2M1 elements only, got {x.data.dtype}: E4M3/E5M2 MX elements do not "
            "fit one E4M3 grid per row in general (use backend='emulate' for them)"
        )
    if x.axis != x.data.ndim - 1:
        raise ValueError(
            f"fold_mx_to_fp8 needs blocks along the last axis, got axis={x.axis} of rank {x.data.ndim}: "
            "quantize along the contraction axis, moved last"
        )


def _block_view(x: MXArray) -> tuple[jax.Array, jax.Array]:
    """(elements as float32 (..., blocks, block_size), block exponents int32 (..., blocks))."""
    values = x.data.astype(jnp.float32)  # exact: every E2M1 value is a float32
    blocks = values.reshape(*values.shape[:-1], -1, x.block_size)
    return blocks, x.scale_exponent()


@dataclasses.dataclass(frozen=True)
class _RowWindow:
    """Per block: the elements, whether it is non-zero, its exponent below the row's top (delta <= 0 for
    every non-zero block), and per row the top exponent and whether a NaN block poisons it."""

    blocks: jax.Array  # float32 (..., blocks, block_size)
    nonzero_block: jax.Array  # (..., blocks)
    delta: jax.Array  # int32 (..., blocks)
    row_top: jax.Array  # int32 (..., 1); 0 for an all-zero row
    nan_row: jax.Array  # (...)

    @property
    def in_window(self) -> jax.Array:
        return self.delta >= -WINDOW

    @property
    def flushed(self) -> jax.Array:
        """How many non-zero blocks fall below the window (rows with a NaN block count nothing)."""
        out = self.nonzero_block & ~self.in_window & ~self.nan_row[..., None]
        return jnp.sum(out.astype(jnp.int32))


def _row_window(x: MXArray) -> _RowWindow:
    _check_foldable(x)
    blocks, exponent = _block_view(x)
    is_nan_block = exponent == _NAN_EXPONENT
    nonzero_block = jnp.any(blocks != 0, axis=-1) & ~is_nan_block
    row_top = jnp.max(jnp.where(nonzero_block, exponent, NO_BLOCK), axis=-1, keepdims=True)
    row_top = jnp.where(row_top == NO_BLOCK, 0, row_top)
    nan_row = jnp.any(is_nan_block, axis=-1)
    return _RowWindow(blocks, nonzero_block, exponent - row_top, row_top, nan_row)


def fold_mx_to_fp8(x: MXArray, *, fp8_dtype=jnp.float8_e4m3fn) -> FoldedOperand:
    """Folds an E2M1 MXArray (blocks on the last axis) into E4M3 with one exponent per row (see module)."""
    shift = fold_shift(fp8_dtype)
    w = _row_window(x)
    # q * 2^(delta + shift): a power of two in [2^-8, 2^6] times a multiple of 0.5 below 6: exact in
    # float32, and on the E4M3 grid, so the cast below does not round.
    factor = pow2(jnp.clip(w.delta, -WINDOW, 0) + shift)
    folded = jnp.where(w.in_window[..., None], w.blocks * factor[..., None], 0.0)
    folded = folded.reshape(x.data.shape)
    folded = jnp.where(w.nan_row[..., None], jnp.nan, folded).astype(fp8_dtype)
    row_exponent = jnp.where(w.nan_row, 0, w.row_top[..., 0] - shift).astype(jnp.int32)
    return FoldedOperand(data=folded, row_exponent=row_exponent, flushed_blocks=w.flushed)


def count_fold_flushes(x: MXArray) -> jax.Array:
    """How many non-zero blocks of x the fold would flush (e_b more than 14 binades below the row's top).

    Only the block exponents and a non-zero test are read; rows with a NaN block count nothing.
    """
    return _row_window(x).flushed


def apply_exponents(out: jax.Array, exponent: jax.Array) -> jax.Array:
    """out * 2^exponent for a float32 FP8-GEMM result, exact whenever the true result is a normal float32.

    The FP8 GEMM's result is 0 or a normal float32 with |out| in [2^-26, 2^64]: every product of two FP8
    values (E4M3/E4M3FNUZ, or E5M2 on one side) is a multiple of 2^-26, and a sum of K < 2^39 products
    stays below 2^64. The exponent (Ea + Ec, each in [-132, 121]) can leave float32's range, so it is
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
