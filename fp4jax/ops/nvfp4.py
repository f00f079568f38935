"""NVFP4: E2M1 elements, one E4M3 scale per block of 16, one float32 scale per tensor (docs/numerics.md).

The rule is Transformer Engine's NVFP4 quantizer (its CUDA kernel, core_nvfp4.cuh, and its Python
reference), step for step in float32, as NVIDIA's NVFP4 pre-training recipe (arXiv 2509.25149) uses it:

    S_enc = 448 * 6 / amax(x)          FLT_MAX where the quotient overflows, 1 where amax = 0
    S_dec = 1 / S_enc
    s_b   = E4M3(min(amax_b * (S_enc * float32(1/6)), 448))   round to nearest even (saturating)
    e_b   = min(1 / (s_b * S_dec), FLT_MAX)                    FLT_MAX for a zero scale
    q     = E2M1(min(|x * e_b|, 6)) with x's sign               nearest even, or stochastic
    value = (q * s_b) * S_dec                                   q * s_b exact, then one rounding

Every float32 operation above rounds to nearest once: XLA's multiplies are IEEE on CPUs and GPUs, its
divides are not (XLA:GPU lowers them to div.full.f32, up to 2 ulp off; XLA:CPU turns a divide by a
broadcast value into a multiply), so the three quotients are formats.divide_nearest_even: IEEE
division (flush-to-zero) from the back end's estimate corrected in integers, the same bits everywhere.
Float32 subnormals, which XLA's CPU back end flushes in arithmetic and a GPU may keep, are flushed to
zero explicitly (inputs and intermediates; the exact divide flushes its own), so every back end computes
the same; for tensors with amax >= 2^-96 no intermediate is subnormal and the result is TE's
(tests/test_nvfp4.py).

Blocks: 1D blocks are block_size contiguous elements along `axis`; 2D blocks are block_size x
block_size tiles of the last two axes (weights: under nearest rounding, quantizing W and W^T gives the
same values; stochastic rounding draws its bits in the layout with `axis` last, so not the same ones).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp4jax.ops import formats
from fp4jax.ops.formats import (
    F32_ABS_MASK,
    F32_INF_BITS,
    f32_bits,
    flush_subnormal,
    require_power_of_two,
)
from fp4jax.ops.quantize import round_to_grid, stochastic_bits

__all__ = [
    "FOUR_OVER_SIX_BOUND",
    "FOUR_OVER_SIX_ERRORS",
    "NVFP4Array",
    "NVFP4_BLOCK_SIZE",
    "NVFP4_ROUNDING_MODES",
    "as_nvfp4_array",
    "nvfp4_global_scale",
    "quantize_nvfp4",
]

NVFP4_BLOCK_SIZE = 16
NVFP4_ROUNDING_MODES = ("nearest_even", "stochastic")

_E2M1_MAX = 6.0
_E4M3_MAX = 448.0
_F32_MAX = float(np.finfo(np.float32).max)
_RCP_6 = float(np.float32(1.0 / 6.0))  # TE folds float32(1/6) into S_enc rather than dividing by 6
_E4M3_NAN_BITS = 0x7F
# Four-over-Six (Cook et al., arXiv 2512.02010, as Transformer Engine's nvfp4_4over6 computes it): the
# error measures it chooses a block's scale by, and the tensor scale's E4M3 bound (256, TE's default
# NVTE_NVFP4_4OVER6_E4M3_USE_256 and the paper's, so that the map-to-4 scale 1.5 * 256 fits E4M3's 448).
FOUR_OVER_SIX_ERRORS = ("mse", "mae")
FOUR_OVER_SIX_BOUND = 256.0
_MAP_TO_4 = 1.5


def nvfp4_global_scale(tensor_amax: jax.Array, e4m3_bound: float = _E4M3_MAX) -> jax.Array:
    """S_enc = e4m3_bound * 6 / amax in float32: FLT_MAX where that overflows, 1 where amax is 0 (TE's
    rule; the bound is 448, or 256 under Four-over-Six)."""
    a = jnp.asarray(tensor_amax, jnp.float32)
    positive = a > 0
    quotient = formats.divide_nearest_even(jnp.float32(e4m3_bound * _E2M1_MAX), jnp.where(positive, a, 1.0))
    return jnp.where(positive, jnp.minimum(quotient, _F32_MAX), jnp.float32(1.0))


def _decode_scale(global_scale: jax.Array) -> jax.Array:
    """S_dec = float32(1 / S_enc), flushed to zero below the normal range (divide_nearest_even does)."""
    return formats.divide_nearest_even(jnp.float32(1.0), global_scale)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class NVFP4Array:
    """An NVFP4 tensor: E2M1 `data` (x's shape), float8_e4m3fn block `scale`, float32 `global_scale`
    (S_enc, a scalar).

    1D blocks: scale has x's shape with shape[axis] // block_size. 2D blocks (block_2d): scale has x's
    shape with each of the last two axes divided by block_size. The value of element i is
    data[i] * scale[block of i] / global_scale (dequantize); a NaN scale marks a block that held NaN/Inf.
    """

    data: jax.Array
    scale: jax.Array
    global_scale: jax.Array
    axis: int = dataclasses.field(metadata=dict(static=True))
    block_size: int = dataclasses.field(metadata=dict(static=True))
    block_2d: bool = dataclasses.field(metadata=dict(static=True))

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    def element_scales(self) -> jax.Array:
        """Each element's block scale as float32, x's shape (NaN in NaN blocks)."""
        scale = self.scale.astype(jnp.float32)
        axes = (scale.ndim - 2, scale.ndim - 1) if self.block_2d else (self.axis,)
        for axis in axes:
            scale = jnp.repeat(scale, self.block_size, axis=axis)
        return scale

    def block_values(self, dtype: Any = jnp.float32) -> jax.Array:
        """data * block scale, without the per-tensor scale: exact in float32 and in bfloat16 (an E2M1 value
        times an E4M3 one has at most 6 significant bits and lies in [2^-10, 2688]); NaN in NaN blocks.
        What a GEMM multiplies; decode_scale() is then applied to its float32 result."""
        return (self.data.astype(jnp.float32) * self.element_scales()).astype(dtype)

    def decode_scale(self) -> jax.Array:
        """S_dec = float32(1 / global_scale), flushed to zero below the normal range (a float32 scalar)."""
        return _decode_scale(self.global_scale)

    def dequantize(self, dtype: Any = jnp.float32) -> jax.Array:
        """(data * block scale) * float32(1 / global_scale): the product exact, then one float32 rounding
        (subnormal results flushed to zero); NaN for every element of a NaN block."""
        return _dequantize_nvfp4(self, dtype=dtype)


# Jitted, inline=True, as quantize.MXArray.dequantize: an eager call is one compiled program.
@functools.partial(jax.jit, static_argnames="dtype", inline=True)
def _dequantize_nvfp4(array: NVFP4Array, dtype: Any) -> jax.Array:
    values = array.data.astype(jnp.float32) * array.element_scales()
    return flush_subnormal(values * _decode_scale(array.global_scale)).astype(dtype)


def _check_nvfp4_args(
    x: jax.Array, axis: int, block_size: int, block_2d: bool, rounding: str, key, four_over_six
) -> int:
    require_power_of_two(block_size, "block_size")
    if four_over_six is not None and four_over_six not in FOUR_OVER_SIX_ERRORS:
        choices = ", ".join(FOUR_OVER_SIX_ERRORS)
        raise ValueError(f"unknown four_over_six error {four_over_six!r}: use one of {choices} (or None)")
    if four_over_six is not None and rounding != "nearest_even":
        raise ValueError(
            "Four-over-Six chooses between two round-to-nearest encodings (Transformer Engine refuses it "
            "with stochastic rounding too): use rounding='nearest_even' or four_over_six=None"
        )
    if rounding not in NVFP4_ROUNDING_MODES:
        choices = ", ".join(NVFP4_ROUNDING_MODES)
        raise ValueError(f"unknown rounding {rounding!r} for NVFP4: use one of {choices}")
    if rounding == "stochastic" and key is None:
        raise ValueError("rounding='stochastic' needs a PRNG key: pass key=jax.random.key(...)")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for an array of rank {x.ndim}")
    axis %= x.ndim
    if block_2d and (x.ndim < 2 or axis < x.ndim - 2):
        raise ValueError(
            f"2D blocks tile the last two axes: axis {axis} of a rank-{x.ndim} array is not one of them"
        )
    for a in (x.ndim - 2, x.ndim - 1) if block_2d else (axis,):
        if x.shape[a] % block_size:
            raise ValueError(
                f"axis {a} has length {x.shape[a]}, not a multiple of block_size {block_size}: pad it first"
            )
    return axis


def _to_blocks(x_last: jax.Array, block_size: int, block_2d: bool) -> tuple[jax.Array, tuple[int, ...]]:
    """x_last (block axis last) as (..., nb, bs) for 1D blocks or (..., mb, bs, nb, bs) for 2D tiles of
    the last two axes, with the axes a block spans."""
    lead, n = x_last.shape[:-1], x_last.shape[-1]
    if not block_2d:
        return x_last.reshape(*lead, n // block_size, block_size), (-1,)
    m = lead[-1]
    return x_last.reshape(*lead[:-1], m // block_size, block_size, n // block_size, block_size), (-3, -1)


def _block_scales(block_amax: jax.Array, global_scale: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(s_b as float8_e4m3fn, e_b as float32) of blocks with absolute maxima block_amax: TE's steps."""
    s_b = jnp.minimum(block_amax * (global_scale * jnp.float32(_RCP_6)), _E4M3_MAX)
    s_b = s_b.astype(jnp.float8_e4m3fn)  # round to nearest even; the clip above is the saturation
    # Decoded from its bits: s_b.astype(float32) would let XLA:GPU fold the rounding away (formats.py).
    block_decode = formats.float8_to_float32(s_b) * _decode_scale(global_scale)
    # The divide counts a subnormal block_decode as 0 (flush-to-zero): 1 / 0 = inf -> FLT_MAX below.
    encode = formats.divide_nearest_even(jnp.float32(1.0), block_decode)
    return s_b, jnp.minimum(encode, _F32_MAX)


def _encode(xs: jax.Array, encode: jax.Array, rounding: str, random_bits=None) -> jax.Array:
    """The signed E2M1 values (float32) of xs under the block encode scales e_b: min(|x * e_b|, 6) rounded."""
    y = jnp.minimum(jnp.abs(flush_subnormal(xs * encode)), _E2M1_MAX)
    magnitude = round_to_grid(y, formats.E2M1, rounding, random_bits=random_bits)
    return jnp.where(f32_bits(xs) < 0, -magnitude, magnitude)


def _candidate_scales(block_amax, global_scale, expand: float | None):
    """(s_b, e_b) of one Four-over-Six candidate, TE's compute_scale_pair: base = amax_b / 6 * S_enc
    (an IEEE divide, then one multiply), times 1.5 for map-to-4, clipped to 448, E4M3 to nearest even."""
    base = flush_subnormal(formats.divide_nearest_even(block_amax, jnp.float32(_E2M1_MAX)) * global_scale)
    if expand is not None:
        base = flush_subnormal(base * jnp.float32(expand))
    s_b = jnp.minimum(base, _E4M3_MAX).astype(jnp.float8_e4m3fn)
    block_decode = flush_subnormal(formats.float8_to_float32(s_b) * _decode_scale(global_scale))
    encode = formats.divide_nearest_even(jnp.float32(1.0), block_decode)
    return s_b, jnp.minimum(encode, _F32_MAX)


def _block_error(xs, q, s_b, tensor_amax, block_2d: bool, measure: str) -> jax.Array:
    """A candidate's error per block (tile), TE's accumulate_dequant_error in float32 (flushed to zero):
    val = ((q * s_b) * amax) / (6 * 256), diff = val - x, |diff| or diff^2 summed over the 16 elements of a
    block row in order; a 2D tile sums its 16 rows' errors as a tree (8 + 8, 4 + 4, 2 + 2, 1 + 1)."""
    scale = formats.float8_to_float32(s_b)
    val = flush_subnormal(flush_subnormal(q * scale) * tensor_amax)
    val = formats.divide_nearest_even(val, jnp.float32(_E2M1_MAX * FOUR_OVER_SIX_BOUND))
    diff = flush_subnormal(val - xs)
    per_element = jnp.abs(diff) if measure == "mae" else flush_subnormal(diff * diff)
    total = per_element[..., 0]
    for i in range(1, per_element.shape[-1]):  # in order, as the kernel adds them
        total = flush_subnormal(total + per_element[..., i])
    if block_2d:  # total is (..., mb, bs, nb): the tile's rows on axis -2
        while total.shape[-2] > 1:
            half = total.shape[-2] // 2
            total = flush_subnormal(total[..., :half, :] + total[..., half:, :])
        return total[..., None]  # (..., mb, 1, nb, 1)
    return total[..., None]


def _four_over_six(xs, block_amax, tensor_amax, global_scale, block_2d: bool, measure: str):
    """(s_b, signed E2M1 values) by Four-over-Six: both candidates encoded to nearest even, the map-to-4
    one kept where its error is strictly smaller (ties keep map-to-6), as Transformer Engine's kernel."""
    s6, e6 = _candidate_scales(block_amax, global_scale, None)
    s4, e4 = _candidate_scales(block_amax, global_scale, _MAP_TO_4)
    q6, q4 = _encode(xs, e6, "nearest_even"), _encode(xs, e4, "nearest_even")
    err6 = _block_error(xs, q6, s6, tensor_amax, block_2d, measure)
    err4 = _block_error(xs, q4, s4, tensor_amax, block_2d, measure)
    pick4 = err4 < err6
    bits4, bits6 = (lax.bitcast_convert_type(s, jnp.uint8) for s in (s4, s6))
    s_b = lax.bitcast_convert_type(jnp.where(pick4, bits4, bits6), jnp.float8_e4m3fn)
    return s_b, jnp.where(pick4, q4, q6)


@functools.partial(  # as quantize.quantize_mx: one compiled program when called eagerly
    jax.jit,
    static_argnames=("axis", "block_2d", "block_size", "rounding", "rng", "four_over_six"),
    inline=True,
)
def quantize_nvfp4(
    x: jax.Array,
    *,
    axis: int = -1,
    block_2d: bool = False,
    block_size: int = NVFP4_BLOCK_SIZE,
    rounding: str = "nearest_even",
    key: jax.Array | None = None,
    rng: str = "threefry",
    four_over_six: str | None = None,
) -> NVFP4Array:
    """Quantizes x to NVFP4 along `axis` (the contraction axis), by Transformer Engine's rule (module doc).

    four_over_six ("mse" or "mae"; None: the standard rule): each block (tile) takes the better of two
    encodings, its maximum scaled to 6 or to 4, by Transformer Engine's nvfp4_4over6 (_four_over_six).

    S_enc comes from the largest finite |x| of the whole tensor. A block holding NaN or +-Inf gets a NaN
    scale and +0 data and leaves the other blocks alone. Stochastic rounding draws
    stochastic_bits(key, shape of x with `axis` moved last, rng), one per element; it is unbiased for
    |x * e_b| <= 6, and a block maximum whose E4M3 scale rounded down saturates at 6.
    """
    x = jnp.asarray(x)
    axis = _check_nvfp4_args(x, axis, block_size, block_2d, rounding, key, four_over_six)
    x_last = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    blocks, block_axes = _to_blocks(x_last, block_size, block_2d)

    abs_bits = f32_bits(blocks) & F32_ABS_MASK
    finite = abs_bits < F32_INF_BITS
    healthy = jnp.all(finite, axis=block_axes, keepdims=True)
    xs = flush_subnormal(jnp.where(finite, blocks, 0.0))
    magnitudes = jnp.abs(xs)
    tensor_amax = jnp.max(magnitudes)
    block_amax = jnp.max(magnitudes, axis=block_axes, keepdims=True)

    if four_over_six is None:
        global_scale = nvfp4_global_scale(tensor_amax)
        s_b, encode = _block_scales(block_amax, global_scale)
        random_bits = None
        if rounding == "stochastic":
            random_bits = stochastic_bits(key, x_last.shape, rng).reshape(blocks.shape)
        signed = _encode(xs, encode, rounding, random_bits)
    else:
        global_scale = nvfp4_global_scale(tensor_amax, FOUR_OVER_SIX_BOUND)
        s_b, signed = _four_over_six(xs, block_amax, tensor_amax, global_scale, block_2d, four_over_six)
    data = jnp.where(healthy, signed, 0.0).astype(formats.E2M1.dtype)

    scale_bits = jnp.where(healthy, lax.bitcast_convert_type(s_b, jnp.uint8), jnp.uint8(_E4M3_NAN_BITS))
    return as_nvfp4_array(
        data, jnp.squeeze(scale_bits, block_axes), global_scale, x_last.shape, axis, block_size, block_2d
    )


def as_nvfp4_array(data, scale_bits, global_scale, last_shape, axis: int, block_size: int, block_2d: bool):
    """The NVFP4Array of E2M1 `data` (any blocking of x with the contraction axis moved last, shape
    `last_shape` when reshaped) and the E4M3 bytes of its block scales (blocks along the last axis), both
    moved back to `axis`: the one place a quantizer's codes become the stored operand."""
    scale = lax.bitcast_convert_type(scale_bits, jnp.float8_e4m3fn)
    return NVFP4Array(
        data=jnp.moveaxis(data.reshape(last_shape), -1, axis),
        scale=jnp.moveaxis(scale, -1, axis),
        global_scale=global_scale,
        axis=axis,
        block_size=block_size,
        block_2d=block_2d,
    )
