"""MS-EDEN: unbiased NVFP4 rounding with the randomness in the block scale (Quartet II; docs/numerics.md).

Panferov, Schultheis, Tabesh and Alistarh, "Quartet II: Accurate LLM Pre-Training in NVFP4 by Improved
Unbiased Gradient Estimation", arXiv 2601.22813; the rule is the authors' kernel eden_1x16s_fp4_kernel
(IST-DASLab/Quartet-II, src/models/quantization/schemes/quartet_2.py), which quantizes a tensor already
rotated by a random-sign Hadamard of GROUP elements along the contraction axis. In float32:

    val_max = 6 / (17/16 * 0.93)                         the block maximum maps a little above 6
    S_enc   = 255.99 * val_max / amax(x)                 1 where amax = 0; S_dec = 1 / S_enc
    s_b     = E4M3(amax_b / val_max * S_enc)             nearest even; 1 where that is 0
    x_s     = x * (1 / (s_b * S_dec))                    x in the block's scaled units
    q       = E2M1(min(|x_s|, 6)), x's sign              nearest, ties away from zero
    S_g     = sum(x_s^2) / sum(x_s * q) over each group  1 where the denominator is 0
    scale   = SR_E4M3(s_b * S_g)                         stochastic rounding onto E4M3's grid
    value   = q * scale * S_dec

S_g corrects the group's scale so that the quantized group's projection on x_s is x_s's own length
(EDEN); rounding the corrected scale stochastically keeps it unbiased. Where this differs from the
kernel's float32 steps (it divides where this multiplies by a rounded reciprocal, S_dec is its
amax / 255.99 / val_max, its probability is a float32 quotient, its sums are Triton's order) is listed
in docs/numerics.md; the sums here are halving trees, so every back end gives the same bits.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from fp4jax.ops import formats
from fp4jax.ops.formats import F32_ABS_MASK, F32_INF_BITS, f32_bits, flush_subnormal
from fp4jax.ops.nvfp4 import NVFP4_BLOCK_SIZE, NVFP4Array, as_nvfp4_array
from fp4jax.ops.quantize import round_to_grid, stochastic_bits

__all__ = ["MS_EDEN_GROUP", "MS_EDEN_SCALE_MAX", "MS_EDEN_VAL_MAX", "quantize_ms_eden"]

# Quartet II's rotation (and EDEN correction) group: its runs use a 128-point Hadamard (HADAMARD_DIM).
MS_EDEN_GROUP = 128
# The kernel's constants: backward_scale_override = 17/16 * 0.93, val_max = 6 / it (evaluated in float64
# as Triton's constexpr arithmetic does, then float32), and the block scales' bound 255.99 (not 448, so
# that the corrected scale has room above it).
MS_EDEN_VAL_MAX = float(np.float32(6.0 / ((17 / 16) * 0.93)))
MS_EDEN_SCALE_MAX = 255.99
_E2M1_MAX = 6.0
_F32_MAX = float(np.finfo(np.float32).max)
_E4M3_NAN_BITS = 0x7F


def _tree_sum(v: jax.Array) -> jax.Array:
    """Sum over the last axis (a power of two) as a halving tree, each partial sum flushed to zero."""
    while v.shape[-1] > 1:
        half = v.shape[-1] // 2
        v = flush_subnormal(v[..., :half] + v[..., half:])
    return v[..., 0]


def _global_scale(tensor_amax: jax.Array) -> jax.Array:
    """S_enc = (255.99 * val_max) / amax in float32 (IEEE divide): FLT_MAX where it overflows, 1 where 0."""
    positive = tensor_amax > 0
    numerator = jnp.float32(MS_EDEN_SCALE_MAX) * jnp.float32(MS_EDEN_VAL_MAX)
    quotient = formats.divide_nearest_even(numerator, jnp.where(positive, tensor_amax, 1.0))
    return jnp.where(positive, jnp.minimum(quotient, _F32_MAX), jnp.float32(1.0))


def quantize_ms_eden(
    x: jax.Array, *, key: jax.Array, axis: int = -1, group: int = MS_EDEN_GROUP
) -> NVFP4Array:
    """x (already rotated in groups of `group` along `axis`) in NVFP4 by MS-EDEN (module doc).

    Invariants: E[scale] = s_b * S_g within E4M3's range (stochastic rounding with 24 random bits per
    block: stochastic_bits(key, the block scales' shape with `axis` last)); a block holding NaN or +-Inf
    gets a NaN scale and +0 data, and its group's correction is taken with it zeroed.
    """
    x = jnp.asarray(x)
    if key is None:
        raise ValueError("MS-EDEN rounds its block scales stochastically: pass key=jax.random.key(...)")
    if not -x.ndim <= axis < x.ndim:
        raise ValueError(f"axis {axis} is out of range for an array of rank {x.ndim}")
    axis %= x.ndim
    if group % NVFP4_BLOCK_SIZE or x.shape[axis] % group:
        raise ValueError(
            f"MS-EDEN corrects groups of {group} (a multiple of {NVFP4_BLOCK_SIZE}) along axis {axis} of "
            f"length {x.shape[axis]}: pad it to a multiple of {group} (mx_dot_general pads to its rotation)"
        )
    x_last = jnp.moveaxis(x.astype(jnp.float32), axis, -1)
    lead, n = x_last.shape[:-1], x_last.shape[-1]
    blocks = x_last.reshape(*lead, n // group, group // NVFP4_BLOCK_SIZE, NVFP4_BLOCK_SIZE)

    finite = (f32_bits(blocks) & F32_ABS_MASK) < F32_INF_BITS
    healthy = jnp.all(finite, axis=-1, keepdims=True)
    xs = flush_subnormal(jnp.where(finite, blocks, 0.0))
    magnitudes = jnp.abs(xs)
    global_scale = _global_scale(jnp.max(magnitudes))
    decode = formats.divide_nearest_even(jnp.float32(1.0), global_scale)

    block_amax = jnp.max(magnitudes, axis=-1, keepdims=True)
    target = flush_subnormal(
        formats.divide_nearest_even(block_amax, jnp.float32(MS_EDEN_VAL_MAX)) * global_scale
    )
    s_b = formats.float8_to_float32(jnp.minimum(target, 448.0).astype(jnp.float8_e4m3fn))
    s_b = jnp.where(s_b == 0, jnp.float32(1.0), s_b)
    encode = formats.divide_nearest_even(jnp.float32(1.0), flush_subnormal(s_b * decode))
    scaled = flush_subnormal(xs * jnp.minimum(encode, _F32_MAX))
    magnitude = round_to_grid(jnp.minimum(jnp.abs(scaled), _E2M1_MAX), formats.E2M1, "nearest_away")
    q = jnp.where(f32_bits(scaled) < 0, -magnitude, magnitude)

    group_shape = (*lead, n // group, group)
    numerator = _tree_sum(flush_subnormal(scaled * scaled).reshape(group_shape))
    denominator = _tree_sum(flush_subnormal(scaled * q).reshape(group_shape))
    safe = jnp.where(denominator == 0, 1.0, denominator)
    correction = jnp.where(denominator == 0, 1.0, formats.divide_nearest_even(numerator, safe))
    corrected = flush_subnormal(s_b[..., 0] * correction[..., None])  # (..., groups, blocks per group)
    random_bits = stochastic_bits(key, corrected.shape)
    scale = round_to_grid(corrected, formats.E4M3, "stochastic", random_bits=random_bits)

    data = jnp.where(healthy, q, 0.0).astype(formats.E2M1.dtype)
    scale_bits = lax.bitcast_convert_type(scale.astype(jnp.float8_e4m3fn), jnp.uint8)
    scale_bits = jnp.where(healthy[..., 0], scale_bits, jnp.uint8(_E4M3_NAN_BITS))
    scale_bits = scale_bits.reshape(*lead, n // NVFP4_BLOCK_SIZE)
    return as_nvfp4_array(data, scale_bits, global_scale, x_last.shape, axis, NVFP4_BLOCK_SIZE, False)
