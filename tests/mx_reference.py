"""Slow, independent numpy reference for fp4jax's numerics contract (docs/numerics.md).

Nothing here imports fp4jax: the reference is written from the contract with float64, Python ints and
fractions, and ml_dtypes only to spell the storage bit patterns. It is deliberately simple and slow.

Invariants this module encodes (the contract):
- MX scale exponent of a block with absolute maximum amax (float32 value, subnormals included):
  floor: e = floor(log2(amax)) - emax; even: amax first rounded up to the next power of two when its
  significand is >= 1.75 (add 2^21 to the float32 bits, clear the mantissa), then floor; ceil: the smallest
  integer e with max_elem * 2^e >= amax. e is clamped to [-127, 127]; an all-zero block has e = -127.
- Elements: y = x / 2^e exactly, rounded onto the element grid (nearest_even, nearest_away, or one of the
  two neighbours for stochastic), saturated at +-max_elem, sign of zero kept.
- A block holding NaN/Inf has scale bits 0xFF, data +0 and dequantizes to NaN.
- dequantize = data * 2^e exactly (computed in float64, then cast to float32: subnormals kept, overflow inf).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from fractions import Fraction

import ml_dtypes
import numpy as np


@dataclasses.dataclass(frozen=True)
class Elem:
    name: str
    dtype: type
    emax: int  # exponent of the largest binade
    max: float  # largest finite magnitude
    mbits: int  # explicit mantissa bits
    emin: int  # exponent of the smallest normal binade


ELEMS = {
    "e2m1": Elem("e2m1", ml_dtypes.float4_e2m1fn, 2, 6.0, 1, 0),
    "e4m3": Elem("e4m3", ml_dtypes.float8_e4m3fn, 8, 448.0, 3, -6),
    "e5m2": Elem("e5m2", ml_dtypes.float8_e5m2, 15, 57344.0, 2, -14),
    # MXFP6 (OCP MX v1.0, section 5.3.2): no Inf/NaN codes, every code finite.
    "e2m3": Elem("e2m3", ml_dtypes.float6_e2m3fn, 2, 7.5, 3, 0),
    "e3m2": Elem("e3m2", ml_dtypes.float6_e3m2fn, 4, 28.0, 2, -2),
}


def minifloat_grid(
    ebits: int, mbits: int, bias: int, excluded_codes: tuple[int, ...] = ()
) -> tuple[list[Fraction], list[int]]:
    """(finite magnitudes ascending, their codes) of a sign-magnitude float format, decoded from its bit
    fields with Fractions: exponent field 0 is subnormal (exponent 1 - bias), the others normal; the
    magnitude codes in `excluded_codes` (NaN/Inf) are left out."""
    pairs = []
    for code in range(2 ** (ebits + mbits)):
        if code in excluded_codes:
            continue
        exp_field, mant = code >> mbits, code & (2**mbits - 1)
        frac = Fraction(mant, 2**mbits)
        pairs.append(
            ((frac if exp_field == 0 else 1 + frac) * Fraction(2) ** (max(exp_field, 1) - bias), code)
        )
    pairs.sort()
    return [v for v, _ in pairs], [c for _, c in pairs]


def round_on_grid(
    y: Fraction, values: list[Fraction], codes: list[int], rounding: str = "nearest_even", u=None
) -> int:
    """The code of magnitude y >= 0 rounded onto the grid (values ascending, their codes), saturating at
    the largest: "nearest_even" (ties to the even code), "nearest_away" (ties up), or "stochastic" (up
    exactly when u < (y - lo) / (hi - lo), u uniform in [0, 1))."""
    if y >= values[-1]:
        return codes[-1]
    i = bisect.bisect_right(values, y) - 1
    lo, hi = values[i], values[i + 1]
    if y == lo:
        return codes[i]
    if rounding == "stochastic":
        return codes[i + 1] if u < (y - lo) / (hi - lo) else codes[i]
    if y - lo != hi - y:
        return codes[i] if y - lo < hi - y else codes[i + 1]
    if rounding == "nearest_away":
        return codes[i + 1]
    return codes[i] if codes[i] % 2 == 0 else codes[i + 1]


def all_grid_values(elem: str) -> np.ndarray:
    """Every non-negative finite value of the element format, enumerated by the format's definition."""
    f = ELEMS[elem]
    vals = {0.0}
    for m in range(1, 2**f.mbits):  # subnormals
        vals.add(m * 2.0 ** (f.emin - f.mbits))
    e = f.emin
    while True:
        for m in range(2**f.mbits):
            v = (1 + m / 2**f.mbits) * 2.0**e
            if v <= f.max:
                vals.add(v)
        if 2.0**e > f.max:
            break
        e += 1
    return np.array(sorted(vals))


# ----------------------------------------------------------------------------------------------------
# Element rounding.


def _grid_quantum(a: np.ndarray, f: Elem) -> np.ndarray:
    """Spacing of the element grid in the binade of |y| = a (a >= 0), subnormal spacing below emin."""
    _, ex = np.frexp(a)  # a = m 2^ex with m in [0.5, 1): floor(log2 a) = ex - 1
    binade = np.maximum(ex.astype(np.int64) - 1, f.emin)
    return np.ldexp(1.0, binade - f.mbits)


def round_to_grid(y: np.ndarray, elem: str, rounding: str) -> np.ndarray:
    """y (float64, exact) rounded onto the grid of `elem`, saturated at +-max, sign of zero kept."""
    f = ELEMS[elem]
    y = np.asarray(y, np.float64)
    a = np.abs(y)
    quantum = _grid_quantum(a, f)
    q = a / quantum  # exact: division by a power of two, q < 2^(mbits+1)
    if rounding == "nearest_even":
        r = np.rint(q)
    elif rounding == "nearest_away":
        r = np.floor(q + 0.5)
    else:
        raise ValueError(rounding)
    out = np.where(a >= f.max, f.max, np.minimum(r * quantum, f.max))
    return np.copysign(out, y)


def sr_neighbours(y: np.ndarray, elem: str):
    """The two candidate grid values of stochastic rounding of y and the probability of the upper one.

    Returns (lo, hi, p_hi) as magnitudes with y's sign applied: |lo| <= |y| <= |hi|; beyond max both are max.
    """
    f = ELEMS[elem]
    y = np.asarray(y, np.float64)
    a = np.abs(y)
    quantum = _grid_quantum(a, f)
    q = a / quantum
    fl = np.floor(q)
    lo = np.minimum(fl * quantum, f.max)
    hi = np.minimum((fl + 1) * quantum, f.max)
    p_hi = q - fl
    sat = a >= f.max
    lo = np.where(sat, f.max, lo)
    hi = np.where(sat, f.max, hi)
    p_hi = np.where(sat, 0.0, p_hi)
    exact = lo == a
    hi = np.where(exact, lo, hi)
    p_hi = np.where(exact, 0.0, p_hi)
    return np.copysign(lo, y), np.copysign(hi, y), p_hi


# ----------------------------------------------------------------------------------------------------
# MX scale exponent.


def floor_log2(v: float) -> int:
    """floor(log2(v)) for a positive finite float, exact (also for float32 subnormals)."""
    _, ex = math.frexp(v)
    return ex - 1


# qwix's Outlier-Aware Scaling, transcribed from google/qwix commit 901efed (qwix/_src/core/qarray.py,
# compute_scale_zero_point): scale = absmax / qmax; scale < sqrt(tiny) -> 1; then for 'mxfp4' (E2M1,
# qmax 6) c = 12 / 7, for 'mxfp8' (E4M3, qmax 448) c = 60 / 31; scale_bf16 = (scale * c).astype(bfloat16);
# scale = (scale_bf16.view(int16) & 0x7F80).view(bfloat16). Here in numpy float32 (IEEE, subnormals kept)
# and ml_dtypes' bfloat16 cast.
QWIX_OAS_C = {"e2m1": 12.0 / 7.0, "e4m3": 60.0 / 31.0}


def qwix_oas_scale(absmax: np.ndarray, elem: str) -> np.ndarray:
    """qwix's OAS block scale (a power of two, as float32) for float32 block maxima."""
    absmax = np.asarray(absmax, np.float32)
    scale = absmax / np.float32(ELEMS[elem].max)
    tiny_sqrt = np.sqrt(np.finfo(np.float32).tiny)
    scale = np.where(scale < tiny_sqrt, np.float32(1.0), scale).astype(np.float32)
    scale_bf16 = (scale * np.float32(QWIX_OAS_C[elem])).astype(ml_dtypes.bfloat16)
    return (scale_bf16.view(np.int16) & 0x7F80).view(ml_dtypes.bfloat16).astype(np.float32)


def _oas_exponents(amax: np.ndarray, elem: str) -> np.ndarray:
    _, ex = np.frexp(qwix_oas_scale(amax, elem).astype(np.float64))  # scale = 2^(ex - 1) exactly
    return np.clip(ex.astype(np.int64) - 1, -127, 127)


def scale_exponent(amax: float, elem: str, scale_mode: str) -> int:
    """The clamped block exponent for a finite block absolute maximum `amax` (a float32 value)."""
    f = ELEMS[elem]
    amax = float(np.float32(amax))
    if scale_mode == "oas":  # qwix's rule, which gives an all-zero block the scale 1
        return int(_oas_exponents(np.float32(amax), elem))
    if amax == 0.0:
        return -127
    fa = Fraction(amax)
    if scale_mode == "floor":
        e = floor_log2(amax) - f.emax
    elif scale_mode == "even":
        if amax < 2.0**-126:
            # The bit trick on a float32 subnormal yields 0 or 2^-126; either way e clamps to -127.
            return -127
        fl = floor_log2(amax)
        significand = fa / Fraction(2) ** fl  # in [1, 2)
        e = fl + (1 if significand >= Fraction(7, 4) else 0) - f.emax
    elif scale_mode == "ceil":
        fmax = Fraction(f.max)
        e = floor_log2(amax) - floor_log2(f.max) - 2
        while fmax * Fraction(2) ** e < fa:
            e += 1
        assert fmax * Fraction(2) ** (e - 1) < fa <= fmax * Fraction(2) ** e
    else:
        raise ValueError(scale_mode)
    return max(-127, min(127, e))


def scale_exponents(amax: np.ndarray, elem: str, scale_mode: str) -> np.ndarray:
    """Vectorised `scale_exponent` (same rules through frexp; cross-checked against it in the tests)."""
    if scale_mode == "oas":
        return _oas_exponents(amax, elem)
    f = ELEMS[elem]
    a = np.asarray(amax, np.float32).astype(np.float64)
    sig, ex = np.frexp(a)  # a = sig 2^ex, sig in [0.5, 1)
    fl = ex.astype(np.int64) - 1
    sig = sig * 2  # a = sig 2^fl, sig in [1, 2)
    if scale_mode == "floor":
        e = fl - f.emax
    elif scale_mode == "even":
        e = fl + (sig >= 1.75) - f.emax
        e = np.where(a < 2.0**-126, -127, e)
    elif scale_mode == "ceil":
        msig, mex = math.frexp(f.max)
        e = fl - (mex - 1) + (sig > 2 * msig)
    else:
        raise ValueError(scale_mode)
    return np.where(a == 0, -127, np.clip(e, -127, 127)).astype(np.int64)


# ----------------------------------------------------------------------------------------------------
# MX block quantization.


@dataclasses.dataclass
class RefMX:
    data: np.ndarray  # float64 grid values, x's shape, sign of zero meaningful
    exp: np.ndarray  # int64 block exponents, x's shape with shape[axis] // block_size (0 in NaN blocks)
    nan: np.ndarray  # bool, NaN/Inf blocks, same shape as exp
    axis: int
    block_size: int
    elem: str

    @property
    def scale_bits(self) -> np.ndarray:
        return np.where(self.nan, 0xFF, self.exp + 127).astype(np.uint8)

    @property
    def data_bits(self) -> np.ndarray:
        return self.data.astype(ELEMS[self.elem].dtype).view(np.uint8)

    def dequantize64(self) -> np.ndarray:
        """data * 2^e in float64 (exact), NaN in NaN blocks."""
        e = np.repeat(self.exp, self.block_size, axis=self.axis)
        nan = np.repeat(self.nan, self.block_size, axis=self.axis)
        return np.where(nan, np.nan, np.ldexp(self.data, e))

    def dequantize(self) -> np.ndarray:
        with np.errstate(over="ignore"):
            return self.dequantize64().astype(np.float32)


def _blocks(x: np.ndarray, axis: int, block_size: int) -> np.ndarray:
    """x with `axis` moved last and split into (..., n_blocks, block_size)."""
    xm = np.moveaxis(x, axis, -1)
    return xm.reshape(xm.shape[:-1] + (xm.shape[-1] // block_size, block_size))


def _unblocks(xb: np.ndarray, axis: int) -> np.ndarray:
    xm = xb.reshape(xb.shape[:-2] + (xb.shape[-2] * xb.shape[-1],))
    return np.moveaxis(xm, -1, axis)


def quantize_mx(
    x,
    *,
    axis: int = -1,
    elem: str = "e2m1",
    block_size: int = 32,
    scale_mode: str = "floor",
    rounding: str = "nearest_even",
    uniforms: np.ndarray | None = None,
    prescale: float = 1.0,
) -> RefMX:
    """Reference MX quantizer. `rounding="stochastic"` needs `uniforms` (x's shape, in [0, 1)).

    `prescale` (the contract's QuantSpec.prescale): the block's exponent comes from x itself; then each
    scaled value x / 2^e, exact in float32, is multiplied by the float32 prescale, one float32 rounding,
    and that product is what the element rounding sees. The result represents prescale * x."""
    x32 = np.asarray(x).astype(np.float32)
    axis = axis % x32.ndim
    assert x32.shape[axis] % block_size == 0
    xb = _blocks(x32, axis, block_size).astype(np.float64)
    nan = ~np.all(np.isfinite(xb), axis=-1)
    amax = np.max(np.abs(np.where(np.isfinite(xb), xb, 0.0)), axis=-1)
    exp = np.where(nan, 0, scale_exponents(amax, elem, scale_mode))
    y = np.ldexp(np.where(nan[..., None], 0.0, xb), -exp[..., None])  # exact
    if prescale != 1:
        y = (y.astype(np.float32) * np.float32(prescale)).astype(np.float64)
    if rounding == "stochastic":
        lo, hi, p_hi = sr_neighbours(y, elem)
        u = _blocks(np.asarray(uniforms, np.float64), axis, block_size)
        q = np.where(u < p_hi, hi, lo)
    else:
        q = round_to_grid(y, elem, rounding)
    q = np.where(nan[..., None], 0.0, q)  # +0 in NaN blocks
    return RefMX(
        _unblocks(q, axis), np.moveaxis(exp, -1, axis), np.moveaxis(nan, -1, axis), axis, block_size, elem
    )


def sr_expected_dequantize(x, *, axis: int, block_size: int, elem: str, scale_mode: str) -> np.ndarray:
    """E[dequantize(quantize_mx(x, rounding="stochastic"))] in float64: p hi + (1 - p) lo, times 2^e."""
    ref = quantize_mx(x, axis=axis, block_size=block_size, elem=elem, scale_mode=scale_mode)
    e = np.repeat(ref.exp, block_size, axis=ref.axis)
    y = np.ldexp(np.asarray(x).astype(np.float32).astype(np.float64), -e)
    lo, hi, p_hi = sr_neighbours(y, elem)
    return np.ldexp(p_hi * hi + (1 - p_hi) * lo, e)


def scaled_values(x, *, axis: int, block_size: int, elem: str, scale_mode: str) -> np.ndarray:
    """y = x / 2^e (float64, exact) for every element: the value the element rounding acts on."""
    ref = quantize_mx(x, axis=axis, block_size=block_size, elem=elem, scale_mode=scale_mode)
    e = np.repeat(ref.exp, block_size, axis=ref.axis)
    return np.ldexp(np.asarray(x).astype(np.float32).astype(np.float64), -e)


# ----------------------------------------------------------------------------------------------------
# FP8 per-tensor scaling.


def fp8_current_scale(x, elem: str) -> np.float32:
    amax = np.float32(np.max(np.abs(np.asarray(x, np.float32))))
    if amax == 0:
        return np.float32(1.0)
    return np.float32(ELEMS[elem].max) / amax


def quantize_fp8(x, *, elem: str = "e4m3", scale=None):
    """(data as float64 grid values, scale as np.float32): data = sat(rne(x * scale)), x * scale in f32."""
    x32 = np.asarray(x).astype(np.float32)
    scale = fp8_current_scale(x32, elem) if scale is None else np.float32(scale)
    with np.errstate(over="ignore"):
        y = (x32 * scale).astype(np.float64)
    return round_to_grid(y, elem, "nearest_even"), scale


def dequantize_fp8(data, scale) -> np.ndarray:
    return (np.asarray(data, np.float64).astype(np.float32) / np.float32(scale)).astype(np.float32)


def fp8_amax_history_update(history, x) -> np.ndarray:
    """Newest amax at index 0, the oldest dropped."""
    h = np.asarray(history, np.float32)
    amax = np.float32(np.max(np.abs(np.asarray(x, np.float32))))
    return np.concatenate([np.array([amax], np.float32), h[:-1]])


def fp8_scale_from_history(history, elem: str) -> np.float32:
    m = np.float32(np.max(np.asarray(history, np.float32)))
    return np.float32(1.0) if m == 0 else np.float32(ELEMS[elem].max) / m


# ----------------------------------------------------------------------------------------------------
# Rotations.


FOLD_NAN_EXP = 128  # the block exponent a NaN scale (E8M0 0xFF) reads as


def reference_fold(q: np.ndarray, e: np.ndarray, block: int, shift: int, window: int):
    """The fold of MX rows into FP8 rows (docs/numerics.md, "The fold"), in float64.

    q: element values (rows x K), e: block exponents (rows x K/block, FOLD_NAN_EXP = a NaN scale).
    E = the largest exponent of the row's non-zero blocks (0 if none); folded = q * 2^(e_b - E + shift)
    for blocks with e_b - E >= -window, else +0 (a non-zero one counted as flushed); row exponent
    E - shift. A NaN block makes its row NaN (row exponent 0) and counts nothing.
    Returns (folded, row exponents, flushed block count, mask of the flushed blocks' elements)."""
    blocks = q.reshape(len(q), -1, block)
    nan_row = np.any(e == FOLD_NAN_EXP, axis=1)
    nonzero = np.any(blocks != 0, axis=-1) & (e != FOLD_NAN_EXP)
    top = np.max(np.where(nonzero, e, -(10**6)), axis=1, keepdims=True)
    top = np.where(np.any(nonzero, axis=1, keepdims=True), top, 0)
    kept = e - top >= -window
    folded = np.where(kept[..., None], blocks * np.exp2(e - top + shift)[..., None], 0.0)
    folded[nan_row] = np.nan
    flushed = nonzero & ~kept & ~nan_row[:, None]
    mask = np.repeat(~kept & ~nan_row[:, None], block, axis=1)
    return folded.reshape(q.shape), np.where(nan_row, 0, top[:, 0] - shift), int(flushed.sum()), mask


def hadamard(n: int) -> np.ndarray:
    """Orthonormal Sylvester Hadamard matrix, float64."""
    assert n >= 1 and n & (n - 1) == 0
    h = np.ones((1, 1))
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h / math.sqrt(n)


def rotate_blocks(x, *, axis: int, size: int, signs=None) -> np.ndarray:
    """Each contiguous block v of `size` along `axis` -> (v * signs) @ H_size, in float64."""
    x64 = np.asarray(x).astype(np.float64)
    axis = axis % x64.ndim
    xb = _blocks(x64, axis, size)
    if signs is not None:
        xb = xb * np.asarray(signs, np.float64)
    return _unblocks(xb @ hadamard(size), axis)


# ----------------------------------------------------------------------------------------------------
# Quantized GEMM.


@dataclasses.dataclass(frozen=True)
class Operand:
    """How one GEMM operand is quantized: kind "none" (high precision), "mx" or "fp8" (per-tensor; current
    scaling unless `fp8_scale` gives the delayed scale)."""

    kind: str = "none"
    elem: str = "e2m1"
    block_size: int = 32
    scale_mode: str = "even"
    rounding: str = "nearest_even"
    fp8_scale: float | None = None


NONE = Operand("none")


def _to_gemm_layout(a, subs, batch, free, contract):
    perm = [subs.index(c) for c in batch + free + contract]
    t = np.transpose(a, perm)
    shp = dict(zip(subs, a.shape, strict=True))
    nb = int(np.prod([shp[c] for c in batch], dtype=np.int64))
    nf = int(np.prod([shp[c] for c in free], dtype=np.int64))
    nc = int(np.prod([shp[c] for c in contract], dtype=np.int64))
    return t.reshape(nb, nf, nc), shp


def _quantize_operand(a_bmk: np.ndarray, op: Operand):
    """(batch, free, K) float64 -> (values float64 to multiply, multiplier applied to the product)."""
    if op.kind == "none":
        return a_bmk, 1.0
    if op.kind == "mx" and op.rounding == "stochastic":
        # The expectation over the rounding: E[product] when the two operands draw independently.
        kw = dict(axis=-1, elem=op.elem, block_size=op.block_size, scale_mode=op.scale_mode)
        return sr_expected_dequantize(a_bmk, **kw), 1.0
    if op.kind == "mx":
        ref = quantize_mx(
            a_bmk,
            axis=-1,
            elem=op.elem,
            block_size=op.block_size,
            scale_mode=op.scale_mode,
            rounding=op.rounding,
        )
        assert not ref.nan.any()
        return ref.dequantize64(), 1.0
    if op.kind == "fp8":
        data, scale = quantize_fp8(a_bmk, elem=op.elem, scale=op.fp8_scale)
        return data, 1.0 / float(scale)
    raise ValueError(op.kind)


def _lowest_bit_exponent(v: np.ndarray) -> np.ndarray:
    """Exponent of the lowest set bit of each float32 value (a large number for zeros)."""
    mant, ex = np.frexp(v)
    k = np.abs(mant * 2.0**24).astype(np.int64)  # float32 values: 24-bit integer significands
    trailing = np.log2(np.where(k == 0, 1, k & -k)).astype(np.int64)
    return np.where(k == 0, 10**6, ex.astype(np.int64) - 24 + trailing)


def _rotation_band(v: np.ndarray, size: int) -> np.ndarray:
    """Bound on |float32 rotation - exact rotation| for every element of v rotated along its last axis.

    (size + 2) u sum_j |x_j| |h| for a general block; zero where every partial sum is exact in float32:
    H entries a power of two (size a power of 4) and all terms on a grid 2^q with sum |terms| < 2^(q + 24).
    """
    vb = np.abs(v).reshape(*v.shape[:-1], -1, size)
    total = vb.sum(-1, keepdims=True) / math.sqrt(size)
    band = (size + 2) * 2.0**-24 * total
    if math.log2(size) % 2 == 0:
        q = _lowest_bit_exponent(vb).min(-1, keepdims=True) - int(math.log2(size)) // 2
        band = np.where(total < np.ldexp(1.0, np.minimum(q + 24, 1000)), 0.0, band)
    return np.broadcast_to(band, vb.shape).reshape(v.shape)


def _rotation_flip_room(v: np.ndarray, band: np.ndarray, op: Operand) -> np.ndarray:
    """How far (dequantized) each element of an MX operand may move if its rotated input is off by <= band.

    The implementation rotates in float32 (its own summation order, float32 H entries), so its rotated values
    may differ from the correctly rounded ones by a few ulps; an element within that band of a rounding
    boundary (or a block max within it of a scale boundary) may legitimately land one grid step away.
    Zero for every element not that close to a boundary."""
    if op.kind != "mx" or op.rounding == "stochastic":
        return np.zeros_like(v)
    kw = dict(axis=-1, elem=op.elem, block_size=op.block_size, scale_mode=op.scale_mode, rounding=op.rounding)
    nominal = quantize_mx(v, **kw).dequantize64()
    room = np.zeros_like(v)
    for shifted in (np.abs(v) + band, np.maximum(np.abs(v) - band, 0.0)):
        alt = quantize_mx(np.copysign(shifted, v).astype(np.float32), **kw).dequantize64()
        room = np.maximum(room, np.abs(alt - nominal))
    return room


def quantized_dot(
    a, a_subs, b, b_subs, out_subs, a_op=NONE, b_op=NONE, rotation=None, signs=None, return_abs=False
):
    """Reference quantized GEMM written with einsum-like subscripts, e.g. ("btk", "kn", "btn").

    Contraction letters (in both operands, not in the output) are flattened in `a_subs` order into one axis,
    zero-padded to a multiple of the block/rotation size, rotated with block-diagonal H_rotation (times
    diag(signs)) on both operands, quantized along that axis, dequantized and multiplied in float64.
    Stochastic MX operands contribute their expectation E[Q(x)] (exact; see `sr_expected_dequantize`).
    Returns float32 in `out_subs` layout; with return_abs returns (out, scale, room): scale = |A_q| |B_q|
    (float64), the scale of the float32 accumulation error of each output element, and room, the largest
    legitimate change of each output from rotated elements within float32 rotation error of a rounding
    boundary (see `_rotation_flip_room`; zero without rotation).
    """
    contract = [c for c in a_subs if c in b_subs and c not in out_subs]
    batch = [c for c in out_subs if c in a_subs and c in b_subs]
    a_free = [c for c in a_subs if c not in b_subs]
    b_free = [c for c in b_subs if c not in a_subs]
    assert sorted(out_subs) == sorted(batch + a_free + b_free)
    a3, a_shp = _to_gemm_layout(np.asarray(a, np.float32).astype(np.float64), a_subs, batch, a_free, contract)
    b3, b_shp = _to_gemm_layout(np.asarray(b, np.float32).astype(np.float64), b_subs, batch, b_free, contract)
    k = a3.shape[-1]
    mult = 1
    for op in (a_op, b_op):
        if op.kind == "mx":
            mult = math.lcm(mult, op.block_size)
    if rotation:
        mult = math.lcm(mult, rotation)
    kp = -(-k // mult) * mult
    a3 = np.pad(a3, [(0, 0), (0, 0), (0, kp - k)])
    b3 = np.pad(b3, [(0, 0), (0, 0), (0, kp - k)])
    room_a = room_b = None
    if rotation:
        # Rotations are computed exactly and rounded once to float32: the values the quantizer sees. A float32
        # rotation is within (g + 2) u sum_j |x_j h_j| of that (g-term sum, float32 H entries).
        bands = [_rotation_band(v, rotation) for v in (a3, b3)]
        a3 = rotate_blocks(a3, axis=-1, size=rotation, signs=signs).astype(np.float32).astype(np.float64)
        b3 = rotate_blocks(b3, axis=-1, size=rotation, signs=signs).astype(np.float32).astype(np.float64)
        room_a = _rotation_flip_room(a3, bands[0], a_op)
        room_b = _rotation_flip_room(b3, bands[1], b_op)
    qa, ma = _quantize_operand(a3, a_op)
    qb, mb = _quantize_operand(b3, b_op)
    shp = {**a_shp, **b_shp}
    perm = [(batch + a_free + b_free).index(c) for c in out_subs]

    def to_out(prod):
        return np.transpose(prod.reshape([shp[c] for c in batch + a_free + b_free]), perm)

    def abs_dot(u, v):
        return to_out(np.matmul(np.abs(u), np.swapaxes(np.abs(v), -1, -2)) * (ma * mb))

    out = to_out(np.matmul(qa, np.swapaxes(qb, -1, -2)) * (ma * mb)).astype(np.float32)
    if not return_abs:
        return out
    room = np.zeros(out.shape)
    if rotation:
        room = abs_dot(room_a, qb) + abs_dot(qa, room_b) + abs_dot(room_a, room_b)
    return out, abs_dot(qa, qb), room
