"""Slow, independent numpy references for the block formats in the per-GEMM contract beside MX:
NVFP4 operands (1D blocks and 2D tiles, nearest and stochastic rounding) and the GEMMs built from them.

Nothing here imports fp4jax. The NVFP4 operand rule is written from docs/numerics.md ("NVFP4"), which
is Transformer Engine's quantizer as NVIDIA's recipe (arXiv 2509.25149) uses it: numpy float32
arithmetic (IEEE, one rounding per operation, subnormals kept, so the rule's flushes are written out),
and the E4M3 / E2M1 roundings onto grids decoded here from the formats' bit fields (nearest with ties
to the even code; stochastic: up exactly when u < (y - lo) / (hi - lo), u the top 24 of the element's 32
random bits). A GEMM multiplies the operands' q * s_b exactly (float64) and applies the two per-tensor
decode scales as one float32 multiply by float32(S_dec_a * S_dec_c), flushed below float32's normal range.
"""

from __future__ import annotations

import dataclasses
import functools

import numpy as np

F32 = np.float32
FLT_MAX = F32(np.finfo(np.float32).max)
MIN_NORMAL = 2.0**-126
NVFP4_BLOCK = 16


@functools.cache
def grid(ebits: int, mbits: int, bias: int, nan_codes: tuple[int, ...] = ()) -> tuple[np.ndarray, np.ndarray]:
    """(finite magnitudes ascending as float64, their codes) of a sign-magnitude float format, decoded
    from its bit fields: exponent field 0 is subnormal (exponent 1 - bias), the others normal."""
    pairs = []
    for code in range(2 ** (ebits + mbits)):
        if code in nan_codes:
            continue
        exp_field, mant = code >> mbits, code & (2**mbits - 1)
        frac = mant / 2**mbits
        pairs.append(((frac if exp_field == 0 else 1 + frac) * 2.0 ** (max(exp_field, 1) - bias), code))
    pairs.sort()
    return np.array([v for v, _ in pairs]), np.array([c for _, c in pairs])


E2M1 = (2, 1, 1)
E4M3 = (4, 3, 7, (0x7F,))


def round_on(y: np.ndarray, fmt, bits: np.ndarray | None = None) -> np.ndarray:
    """Magnitudes y >= 0 (float64, each a float32 value) rounded onto fmt's grid, saturating at its top:
    nearest with ties to the even code, or stochastic with the uint32 `bits` (y's shape)."""
    values, codes = grid(*fmt)
    y = np.asarray(y, np.float64)
    i = np.clip(np.searchsorted(values, y, side="right") - 1, 0, len(values) - 2)
    lo, hi = values[i], values[i + 1]
    frac = (y - lo) / (hi - lo)  # exact: spacings are powers of two, y and lo share the binade's grid
    if bits is None:
        up = (frac > 0.5) | ((frac == 0.5) & (codes[i] % 2 == 1))
    else:
        up = (np.asarray(bits, np.uint64) >> 8).astype(np.float64) * 2.0**-24 < frac
    return np.where(y >= values[-1], values[-1], np.where(up, hi, lo))


def flush(v) -> np.ndarray:
    """float32 subnormals replaced by a zero of their sign (the rule's explicit flush)."""
    v = np.asarray(v, F32)
    return np.where(np.abs(v) < MIN_NORMAL, np.copysign(F32(0), v), v).astype(F32)


@dataclasses.dataclass
class RefNVFP4:
    """An NVFP4 operand (..., F, C) quantized along C: q * s_b per element (float64, exact; NaN in
    blocks that held NaN/Inf), the E4M3 scales per block (float64 values), S_enc and S_dec (float32),
    and y = min(|x e_b|, 6), the magnitude the element rounding saw (float64)."""

    block_values: np.ndarray
    scales: np.ndarray
    s_enc: np.float32
    s_dec: np.float32
    y: np.ndarray

    def dequantize(self) -> np.ndarray:
        """(q * s_b) * S_dec, one float32 rounding, subnormals flushed."""
        with np.errstate(invalid="ignore"):
            return flush(self.block_values.astype(F32) * self.s_dec)


def quantize_nvfp4(x, tile_rows: int = 1, bits: np.ndarray | None = None) -> RefNVFP4:
    """x (..., F, C) float32 in NVFP4 along C: blocks of 16 along C (tile_rows 1) or 16 x 16 tiles of
    (F, C) (tile_rows 16); stochastic rounding with the uint32 `bits` (x's shape), else nearest even."""
    x = np.asarray(x, F32)
    *lead, f, c = x.shape
    tiles = x.reshape(*lead, f // tile_rows, tile_rows, c // NVFP4_BLOCK, NVFP4_BLOCK)
    axes = (-3, -1)
    finite = np.isfinite(tiles)
    healthy = np.all(finite, axis=axes, keepdims=True)
    xs = flush(np.where(finite, tiles, F32(0)))
    amax = F32(np.max(np.abs(xs)))
    with np.errstate(over="ignore", divide="ignore"):
        s_enc = F32(1.0) if amax == 0 else min(F32(6.0 * 448.0) / amax, FLT_MAX)
        s_dec = flush(F32(1.0) / s_enc)[()]
        amax_b = np.max(np.abs(xs), axis=axes, keepdims=True)
        t = np.minimum(amax_b * (s_enc * F32(1.0 / 6.0)), F32(448.0))
        s_b = round_on(t, E4M3).astype(F32)
        e_b = np.minimum(F32(1.0) / flush(s_b * s_dec), FLT_MAX)
        y = np.minimum(np.abs(flush(xs * e_b)), F32(6.0))
    u = None if bits is None else np.asarray(bits).reshape(tiles.shape)
    q = np.copysign(round_on(y, E2M1, u), xs)
    values = np.where(healthy, q * s_b.astype(np.float64), np.nan)
    scales = np.where(healthy, s_b.astype(np.float64), np.nan)[..., 0, :, 0]
    return RefNVFP4(values.reshape(x.shape), scales, s_enc, s_dec, y.astype(np.float64).reshape(x.shape))


def gemm_alpha(s_dec_a, s_dec_c) -> np.float32:
    """The per-tensor factor of an NVFP4 x NVFP4 GEMM: float32(S_dec_a * S_dec_c), flushed."""
    return flush(F32(s_dec_a) * F32(s_dec_c))[()]


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Sylvester-Hadamard matrix of order n (a power of two), float64."""
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / np.sqrt(n)


def rotate(x: np.ndarray, size: int, signs=None) -> np.ndarray:
    """Blocks of `size` along the last axis times diag(signs) H_size, exactly in float64, then float32."""
    x = np.asarray(x, np.float64)
    s = np.ones(size) if signs is None else np.asarray(signs, np.float64)
    blocks = x.reshape(*x.shape[:-1], -1, size) * s
    return (blocks @ hadamard(size)).reshape(x.shape).astype(F32)
