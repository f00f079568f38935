"""Slow, independent numpy references for the block formats in the per-GEMM contract beside MX:
NVFP4 operands (1D blocks and 2D tiles, nearest and stochastic rounding) and the GEMMs built from them.

Nothing here imports fp4jax. The NVFP4 operand rule is written from docs/numerics.md ("NVFP4"), which
is Transformer Engine's quantizer as NVIDIA's recipe (arXiv 2509.25149) uses it: numpy float32
arithmetic (IEEE, one rounding per operation, subnormals kept, so the rule's flushes are written out),
and the E4M3 / E2M1 roundings on the references' one grid decoder (mx_reference.minifloat_grid) by its
one grid rounding's rule (mx_reference.round_on_grid: nearest with ties to the even code; stochastic: up
exactly when u < (y - lo) / (hi - lo), u the top 24 of the element's 32 random bits), here computed for
whole arrays (round_on; tests/test_nvfp4.py holds it to round_on_grid element by element). A GEMM
multiplies the operands' q * s_b exactly (float64) and applies the two per-tensor decode scales as one
float32 multiply by float32(S_dec_a * S_dec_c), flushed below float32's normal range.
"""

from __future__ import annotations

import dataclasses
import functools
from fractions import Fraction

import numpy as np
from mx_reference import minifloat_grid, rotate_blocks

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
MIN_NORMAL = 2.0**-126
NVFP4_BLOCK = 16


E2M1 = (2, 1, 1)  # (exponent bits, mantissa bits, bias, NaN codes): mx_reference.minifloat_grid's arguments
E4M3 = (4, 3, 7, (0x7F,))


@functools.cache
def _grid(fmt) -> tuple[list[Fraction], list[int]]:
    """mx_reference.minifloat_grid of fmt: its finite magnitudes ascending, and their codes."""
    return minifloat_grid(*fmt)


def round_on(y: np.ndarray, fmt, bits: np.ndarray | None = None) -> np.ndarray:
    """Magnitudes y >= 0 (float64, each a float32 value) rounded onto fmt's grid, saturating at its top, by
    mx_reference.round_on_grid's rule: nearest with ties to the even code, or stochastic, up exactly when
    u < (y - lo) / (hi - lo) with u = k / 2^24, k the top 24 of the uint32 `bits` (y's shape).

    Whole arrays at once in float64 (element by element in Fractions took 5 s for a 512 x 1024 operand),
    where every step below the grid's top is exact, so this is the rule itself: the grid values are
    dyadics of a few bits, so are their midpoints and spacings (powers of two); y - lo is exact (lo = 0,
    or lo <= y < hi <= 2 lo: Sterbenz's lemma), and so are (y - lo) 2^24 and k (hi - lo)."""
    grid, codes = _grid_arrays(fmt)
    y = np.asarray(y, np.float64)
    if not np.all(np.isfinite(y) & (y >= 0)):
        raise ValueError("round_on rounds finite magnitudes >= 0")
    i = np.clip(np.searchsorted(grid, y, side="right") - 1, 0, grid.size - 2)
    lo, hi = grid[i], grid[i + 1]  # lo <= y < hi below the top
    if bits is None:
        middle = (lo + hi) / 2
        up = (y > middle) | ((y == middle) & (codes[i] % 2 == 1))  # a tie goes to the even code
    else:
        k = (np.asarray(bits, np.uint32) >> 8).astype(np.float64)
        up = k * (hi - lo) < (y - lo) * 2.0**24
    return np.where(y >= grid[-1], grid[-1], np.where(up, hi, lo))


@functools.cache
def _grid_arrays(fmt) -> tuple[np.ndarray, np.ndarray]:
    """fmt's finite magnitudes ascending, as float64 (exact), and their codes."""
    return np.array(grid_values(fmt)), np.array(_grid(fmt)[1])


def flush(v) -> np.ndarray:
    """float32 subnormals replaced by a zero of their sign (the rule's explicit flush)."""
    v = np.asarray(v, F32)
    return np.where(np.abs(v) < MIN_NORMAL, np.copysign(F32(0), v), v).astype(F32)


def grid_values(fmt) -> list[float]:
    """fmt's finite magnitudes, ascending."""
    return [float(v) for v in _grid(fmt)[0]]


def _codes_of(magnitudes: np.ndarray, fmt) -> np.ndarray:
    """The codes (uint8) of magnitudes on fmt's grid; each must be a grid value."""
    grid, codes = _grid_arrays(fmt)
    magnitudes = np.asarray(magnitudes, np.float64)
    i = np.minimum(np.searchsorted(grid, magnitudes), grid.size - 1)
    if not np.array_equal(grid[i], magnitudes):
        raise ValueError("_codes_of takes magnitudes on the grid only")
    return codes[i].astype(np.uint8)


def global_scale(amax) -> np.float32:
    """S_enc = float32(6 * 448 / amax) of a tensor's absolute maximum; FLT_MAX where it overflows, 1 at 0."""
    amax = F32(amax)
    if amax == 0:
        return F32(1.0)
    with np.errstate(over="ignore"):
        return min(F32(6.0 * 448.0) / amax, FLT_MAX)


def block_scale(amax_b, s_enc) -> tuple[np.ndarray, np.ndarray]:
    """(s_b, e_b) of blocks with absolute maxima amax_b (float32): the E4M3 scale s_b = E4M3(min(amax_b *
    (S_enc * float32(1/6)), 448)) and the element multiplier e_b = float32(1 / flush(s_b * S_dec)),
    FLT_MAX where that overflows (a zero scale)."""
    s_dec = flush(F32(1.0) / F32(s_enc))
    with np.errstate(over="ignore", divide="ignore"):
        t = np.minimum(np.asarray(amax_b, F32) * (F32(s_enc) * F32(1.0 / 6.0)), F32(448.0))
        s_b = round_on(t, E4M3).astype(F32)
        return s_b, np.minimum(F32(1.0) / flush(s_b * s_dec), FLT_MAX)


@dataclasses.dataclass
class RefNVFP4:
    """An NVFP4 operand (..., F, C) quantized along C: q * s_b per element (float64, exact; NaN in
    blocks that held NaN/Inf), the E4M3 scales per block (float64 values), S_enc and S_dec (float32),
    and y = min(|x e_b|, 6), the magnitude the element rounding saw (float64). As stored: `codes`, the
    E2M1 bytes (sign at 0x8; +0 in blocks that held NaN/Inf), and `scale_bytes`, the E4M3 bytes of the
    scales (0x7F, NaN, for those blocks); None where a reference compares values only (Four-over-Six's
    and MS-EDEN's, whose tests hold the library's codes and scales to these values)."""

    block_values: np.ndarray
    scales: np.ndarray
    s_enc: np.float32
    s_dec: np.float32
    y: np.ndarray
    codes: np.ndarray | None = None
    scale_bytes: np.ndarray | None = None

    def dequantize(self) -> np.ndarray:
        """(q * s_b) * S_dec, one float32 rounding, subnormals flushed."""
        with np.errstate(invalid="ignore"):
            return flush(self.block_values.astype(F32) * self.s_dec)


def _nvfp4_tiles(x, tile_rows: int):
    """x (..., F, C) float32 as NVFP4 tiles (..., F / rows, rows, C / 16, 16), the tile axes, which tiles
    hold only finite values, and the tiles with non-finite values zeroed and subnormals flushed."""
    x = np.asarray(x, F32)
    *lead, f, c = x.shape
    tiles = x.reshape(*lead, f // tile_rows, tile_rows, c // NVFP4_BLOCK, NVFP4_BLOCK)
    axes = (-3, -1)
    finite = np.isfinite(tiles)
    healthy = np.all(finite, axis=axes, keepdims=True)
    return tiles, axes, healthy, flush(np.where(finite, tiles, F32(0)))


def quantize_nvfp4(x, tile_rows: int = 1, bits: np.ndarray | None = None, tensor_amax=None) -> RefNVFP4:
    """x (..., F, C) float32 in NVFP4 along C: blocks of 16 along C (tile_rows 1) or 16 x 16 tiles of
    (F, C) (tile_rows 16); stochastic rounding with the uint32 `bits` (x's shape), else nearest even.
    `tensor_amax`: the amax S_enc comes from where x is part of a larger tensor (default: x's own)."""
    tiles, axes, healthy, xs = _nvfp4_tiles(x, tile_rows)
    s_enc = global_scale(np.max(np.abs(xs)) if tensor_amax is None else tensor_amax)
    s_dec = flush(F32(1.0) / s_enc)[()]
    s_b, e_b = block_scale(np.max(np.abs(xs), axis=axes, keepdims=True), s_enc)
    with np.errstate(over="ignore"):
        y = np.minimum(np.abs(flush(xs * e_b)), F32(6.0))
    u = None if bits is None else np.asarray(bits).reshape(tiles.shape)
    magnitudes = round_on(y, E2M1, u)
    q = np.copysign(magnitudes, xs)
    values = np.where(healthy, q * s_b.astype(np.float64), np.nan)
    scales = np.where(healthy, s_b.astype(np.float64), np.nan)[..., 0, :, 0]
    sign = np.where(np.signbit(xs) & healthy, 0x8, 0).astype(np.uint8)
    codes = np.where(healthy, _codes_of(magnitudes, E2M1) | sign, 0).astype(np.uint8)
    scale_bytes = np.where(healthy[..., 0, :, 0], _codes_of(s_b[..., 0, :, 0], E4M3), 0x7F).astype(np.uint8)
    shape = x.shape
    return RefNVFP4(
        values.reshape(shape),
        scales,
        s_enc,
        s_dec,
        y.astype(np.float64).reshape(shape),
        codes.reshape(shape),
        scale_bytes,
    )


def gemm_alpha(s_dec_a, s_dec_c) -> np.float32:
    """The per-tensor factor of an NVFP4 x NVFP4 GEMM: float32(S_dec_a * S_dec_c), flushed."""
    return flush(F32(s_dec_a) * F32(s_dec_c))[()]


def rotate(x: np.ndarray, size: int, signs=None) -> np.ndarray:
    """Blocks of `size` along the last axis times diag(signs) H_size, exactly in float64
    (mx_reference.rotate_blocks), then float32."""
    return rotate_blocks(x, axis=-1, size=size, signs=signs).astype(F32)


def quantize_nvfp4_4over6(x, tile_rows: int = 1, measure: str = "mse") -> RefNVFP4:
    """Four-over-Six (Cook et al., arXiv 2512.02010) as Transformer Engine's nvfp4_4over6 computes it
    (transformer_engine/common/cast/nvfp4/quantize_4over6_nvfp4.cuh and the Python reference
    pytorch/custom_recipes/reference_nvfp4.py, _quantize_blockwise_4over6_reference), written again here:
    S_enc = 256 * 6 / amax; base = amax_b / 6 * S_enc; the map-to-6 scale E4M3(min(base, 448)) and the
    map-to-4 scale E4M3(min(1.5 base, 448)); each candidate encoded to nearest even as the standard rule
    encodes; its error sum over a block row, in element order, of |v - x| ("mae") or (v - x)^2 ("mse")
    with v = ((q * s_b) * amax) / (6 * 256); a 16 x 16 tile adds its rows' errors as a halving tree; the
    map-to-4 candidate where its error is strictly smaller. float32 throughout, flushed to zero."""
    tiles, axes, healthy, xs = _nvfp4_tiles(x, tile_rows)
    amax = F32(np.max(np.abs(xs)))
    candidates = []
    with np.errstate(over="ignore", divide="ignore"):
        s_enc = F32(1.0) if amax == 0 else min(F32(6.0 * 256.0) / amax, FLT_MAX)
        s_dec = flush(F32(1.0) / s_enc)[()]
        base = flush(flush(np.max(np.abs(xs), axis=axes, keepdims=True) / F32(6.0)) * s_enc)
        for expand in (None, F32(1.5)):
            target = base if expand is None else flush(base * expand)
            s_b = round_on(np.minimum(target, F32(448.0)), E4M3).astype(F32)
            e_b = np.minimum(F32(1.0) / flush(s_b * s_dec), FLT_MAX)
            y = np.minimum(np.abs(flush(xs * e_b)), F32(6.0))
            q = np.copysign(round_on(y, E2M1), xs).astype(F32)
            value = flush(flush(flush(q * s_b) * amax) / F32(6.0 * 256.0))
            diff = flush(value - xs)
            per_element = np.abs(diff) if measure == "mae" else flush(diff * diff)
            error = per_element[..., 0]
            for i in range(1, NVFP4_BLOCK):
                error = flush(error + per_element[..., i])
            while error.shape[-2] > 1:  # a tile's rows (tile_rows 16) as a tree; 1D blocks skip this
                half = error.shape[-2] // 2
                error = flush(error[..., :half, :] + error[..., half:, :])
            candidates.append((s_b, q, error[..., None]))
    (s6, q6, err6), (s4, q4, err4) = candidates
    pick4 = err4 < err6
    s_b, q = np.where(pick4, s4, s6), np.where(pick4, q4, q6)
    values = np.where(healthy, q.astype(np.float64) * s_b.astype(np.float64), np.nan)
    scales = np.where(healthy, s_b.astype(np.float64), np.nan)[..., 0, :, 0]
    y = np.zeros(x.shape)  # not defined for two candidates
    return RefNVFP4(values.reshape(x.shape), scales, s_enc, s_dec, y)


MS_EDEN_VAL_MAX = F32(6.0 / ((17 / 16) * 0.93))  # Quartet II's backward_scale_override and val_max


def _e2m1_nearest_away(y: np.ndarray) -> np.ndarray:
    """|q| from |x_s| by Quartet II's kernel's thresholds (ties away from zero, saturating at 6)."""
    out = np.zeros(y.shape)
    for threshold, value in ((0.25, 0.5), (0.75, 1), (1.25, 1.5), (1.75, 2), (2.5, 3), (3.5, 4), (5, 6)):
        out = np.where(y >= threshold, value, out)
    return out


def _halving_sum(v: np.ndarray) -> np.ndarray:
    while v.shape[-1] > 1:
        half = v.shape[-1] // 2
        v = flush(v[..., :half] + v[..., half:])
    return v[..., 0]


def quantize_ms_eden(x, bits: np.ndarray, group: int = 128) -> RefNVFP4:
    """MS-EDEN (Quartet II, arXiv 2601.22813; its kernel eden_1x16s_fp4_kernel in IST-DASLab/Quartet-II,
    src/models/quantization/schemes/quartet_2.py) of x (..., C), already rotated, along C, as
    docs/numerics.md states it: float32, flushed to zero; S_enc = 255.99 * val_max / amax; s_b =
    E4M3(amax_b / val_max * S_enc), 1 where 0; x_s = x * (1 / (s_b S_dec)); |q| by the kernel's
    thresholds; per group of `group`, S = sum x_s^2 / sum x_s q (halving trees; 1 where the denominator
    is 0); the scale s_b * S rounded stochastically onto E4M3 with u = the top 24 of its block's `bits`
    (uint32, one per block, in the blocks' order). Also returns the corrected scales s_b * S (float64, one
    per block), the value whose stochastic rounding the scale is: (RefNVFP4, corrected)."""
    x = np.asarray(x, F32)
    *lead, c = x.shape
    blocks = x.reshape(*lead, c // group, group // NVFP4_BLOCK, NVFP4_BLOCK)
    finite = np.isfinite(blocks)
    healthy = np.all(finite, axis=-1, keepdims=True)
    xs = flush(np.where(finite, blocks, F32(0)))
    amax = F32(np.max(np.abs(xs)))
    with np.errstate(over="ignore", divide="ignore", invalid="ignore"):
        s_enc = F32(1.0) if amax == 0 else min((F32(255.99) * MS_EDEN_VAL_MAX) / amax, FLT_MAX)
        s_dec = flush(F32(1.0) / s_enc)[()]
        amax_b = np.max(np.abs(xs), axis=-1, keepdims=True)
        s_b = round_on(np.minimum(flush(flush(amax_b / MS_EDEN_VAL_MAX) * s_enc), F32(448)), E4M3).astype(F32)
        s_b = np.where(s_b == 0, F32(1.0), s_b)
        e_b = np.minimum(F32(1.0) / flush(s_b * s_dec), FLT_MAX)
        scaled = flush(xs * e_b)
        q = np.copysign(_e2m1_nearest_away(np.abs(scaled)), scaled).astype(F32)
        numerator = _halving_sum(flush(scaled * scaled).reshape(*lead, c // group, group))
        denominator = _halving_sum(flush(scaled * q).reshape(*lead, c // group, group))
        correction = np.where(denominator == 0, F32(1.0), flush(numerator / denominator)).astype(F32)
    corrected = flush(s_b[..., 0] * correction[..., None])
    scale = round_on(corrected, E4M3, np.asarray(bits, np.uint32).reshape(corrected.shape))
    values = np.where(healthy, q.astype(np.float64) * scale[..., None], np.nan)
    scales = np.where(healthy[..., 0], scale, np.nan).reshape(*lead, c // NVFP4_BLOCK)
    ref = RefNVFP4(values.reshape(x.shape), scales, s_enc, s_dec, np.zeros(x.shape))
    return ref, corrected.astype(np.float64).reshape(scales.shape)
