"""quantize_nvfp4 against a slow per-element reference of Transformer Engine's NVFP4 rule.

The reference is formats_reference.quantize_nvfp4, written from the rule (docs/numerics.md, "NVFP4"):
numpy float32 arithmetic (IEEE, one rounding per operation, subnormals kept unless the rule flushes
them), the E4M3 and E2M1 roundings onto grids decoded from the formats' bit fields with Python Fractions
(nearest, ties to the even code; stochastic: up exactly when u < (a - lo) / (hi - lo), u the top 24 of
the element's 32 bits from jax.random.bits(key, shape with the block axis last)), computed for whole
arrays and held here to the rounding of one Fraction at a time (mx_reference.round_on_grid);
test_nvfp4_peers.py holds it against jax.nn's and torchao's quantizers. Nothing from fp4jax is called but
the quantizer under test.

Where torchao differs (torchao/prototype/mx_formats/nvfp4_tensor.py, nvfp4_quantize with a per-tensor
scale): it stores the decode-direction per-tensor scale amax / 2688 rather than S_enc; it clamps the
block scale to at least E4M3's smallest normal, 2^-6 (so an all-zero or tiny block gets scale 2^-6, never
0 or an E4M3 subnormal); and it divides x by (per_tensor_scale * s_b) where TE multiplies x by the
rounded reciprocal of s_b * S_dec, which can round an element next to an E2M1 midpoint the other way.
Its NVFP4 tensor has 1D blocks along the last axis only. jax.nn's "nvfp4" scaled-dot config takes the
global (decode) scale from the caller (default 1) and divides x by it. This module implements TE's rule
(the rule of NVIDIA's NVFP4 pre-training recipe), and these tests hold it to TE's float32 steps.

Where TE's own two implementations differ and which is followed here: an all-zero tensor gets S_enc = 1
(the CUDA kernel; TE's Python reference gives FLT_MAX; both quantize it to zeros); -0.0 keeps its sign
(the kernel's conversion; the Python reference maps -0.0 to +0). NaN/Inf input: TE derives S_enc from
an amax that is then NaN or Inf and so corrupts every block; here S_enc comes from the finite values, the
block that holds NaN/Inf gets a NaN scale and +0 data, and the other blocks are unaffected.
"""

from __future__ import annotations

import bisect
import functools
import math
from fractions import Fraction

import formats_reference as fref
import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from mx_reference import minifloat_grid, round_on_grid

from fp4jax.ops.nvfp4 import NVFP4Array, nvfp4_global_scale, quantize_nvfp4

F32 = np.float32
FLT_MAX = fref.FLT_MAX
BS = fref.NVFP4_BLOCK
E4M3_VALUES = fref.grid_values(fref.E4M3)


def block_encode(amax_b, s_enc) -> np.float32:
    """The element multiplier e_b of a block with absolute maximum amax_b (formats_reference.block_scale)."""
    return F32(fref.block_scale(amax_b, s_enc)[1])


# ----------------------------------------------------------------------------------------------------
# Inputs.


def solve_product(t: float, factor: np.float32) -> np.float32 | None:
    """A float32 v with float32(v * factor) exactly t, found by search around t / factor (None if none)."""
    v = F32(t / float(factor))
    for _ in range(8):
        v = np.nextafter(v, F32(0))
    for _ in range(16):
        if F32(v) * factor == F32(t):
            return v
        v = np.nextafter(v, F32(np.inf))
    return None


def scale_target_amax(t: float, s_enc: np.float32) -> np.float32 | None:
    """A block amax whose block-scale product float32(amax * (S_enc * float32(1/6))) is exactly t."""
    return solve_product(t, s_enc * F32(1.0 / 6.0))


def odd_tensor(seed: int) -> np.ndarray:
    """(32, 64) float32 whose S_enc and block scales are not powers of two, with exact ties anyway: blocks
    whose scale product lands on E4M3 midpoints, and blocks whose elements x * e_b land exactly on every
    E2M1 midpoint (x solved for the block's own e_b), so that an implementation that rounds any float32
    step differently from the rule (x * S_enc / s_b, amax / 6 * S_enc, ...) flips some of them."""
    rng = np.random.default_rng(seed)
    top = F32(2688.0 * 1.37)
    s_enc = fref.global_scale(top)
    first = rng.uniform(-1, 1, BS) * top
    first[0] = top
    blocks = [first]
    e4m3 = E4M3_VALUES
    for t in [(a + b) / 2 for a, b in zip(e4m3[:-1], e4m3[1:], strict=True)][1::3]:
        amax = scale_target_amax(t, s_enc)
        if amax is not None:
            blocks.append(np.concatenate([[amax], rng.uniform(-1, 1, BS - 1) * float(amax)]))
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    while len(blocks) < 128:
        amax_b = F32(top * 2.0 ** rng.uniform(-12, 0))
        encode = block_encode(amax_b, s_enc)
        row = [amax_b] + [solve_product(m, encode) for m in mids for _ in (0, 1)]
        row = [float(v) if v is not None else 0.0 for v in row][:BS]
        row += [0.0] * (BS - len(row))
        blocks.append(np.array(row) * rng.choice([-1.0, 1.0], BS))
    return np.stack(blocks).astype(np.float32).reshape(32, 4 * BS)


def nice_tensor(k: int, seed: int) -> np.ndarray:
    """(32, 64) float32 with amax 2688 * 2^k (so S_enc = 2^-k) whose blocks hit the rule's edges.

    A block with amax 6 * 2^(j + k) gets s_b = 2^j exactly and e_b = 2^-(j + k), so its elements
    m * 2^(j + k) scale to exactly m: every E2M1 midpoint (ties), one float32 ulp either side, the grid.
    Other blocks put s_b's product exactly on E4M3 midpoints (ties of the scale rounding, E4M3
    subnormals and the tie between 0 and 2^-9 included: a zero scale), or hold one outlier, zeros, -0
    or float32 subnormals. Blocks run along rows, four to a row of 64.
    """
    rng = np.random.default_rng(seed)
    top = 2688.0 * 2.0**k
    first = rng.uniform(-1, 1, BS) * top
    first[0] = top  # the block that sets amax: its product is ~448 and saturates onto 448
    blocks = [first]
    grid_vals = [0.0, 0.5, 1, 1.5, 2, 3, 4, 6]
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    near = np.concatenate(
        [np.nextafter(mids.astype(F32), F32(np.inf)), np.nextafter(mids.astype(F32), F32(0))]
    )
    elems = np.concatenate([mids, -mids, near, -near, grid_vals, -np.array(grid_vals)])
    for j in (8, 2, 0, -3, -7, -9):  # s_b = 2^j: normal and subnormal E4M3 scales
        for chunk in np.array_split(elems, -(-len(elems) // (BS - 1))):
            row = np.zeros(BS)
            row[0] = 6.0  # pins amax = 6 * 2^(j + k)
            row[1 : 1 + len(chunk)] = chunk
            blocks.append(row * 2.0 ** (j + k))
    s_enc = F32(2.0**-k)
    e4m3 = E4M3_VALUES
    targets = [(a + b) / 2 for a, b in zip(e4m3[:-1], e4m3[1:], strict=True)][::9] + [2.0**-10, 3 * 2.0**-11]
    for t in targets:  # ties of the block-scale rounding
        amax = scale_target_amax(t, s_enc)
        if amax is not None:
            blocks.append(np.concatenate([[amax], rng.uniform(-1, 1, BS - 1) * float(amax)]))
    for p in (-20, -4, 0):  # one outlier per block: the others underflow
        row = rng.standard_normal(BS) * top * 2.0 ** (p - 14)
        row[rng.integers(BS)] = -top * 2.0**p
        blocks.append(row)
    blocks += [np.zeros(BS), -np.zeros(BS)]
    sub = np.zeros(BS)
    sub[:4] = [1e-45, -3e-40, 1e-39, -1.1e-38]  # float32 subnormals: read as +-0
    sub[5] = top * 2.0**-3
    blocks.append(sub)
    assert len(blocks) <= 128, len(blocks)
    blocks += [rng.standard_normal(BS) * top / 100 for _ in range(128 - len(blocks))]
    return np.stack(blocks).astype(np.float32).reshape(32, 4 * BS)


def random_tensor(scale: float, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((32, 64)) * np.exp2(rng.integers(-8, 3, (32, 64)))
    x[::5, 7] *= 300  # outlier channel
    return (x * scale).astype(np.float32)


def float32_max_tensor(seed: int) -> np.ndarray:
    x = random_tensor(1.0, seed).astype(np.float64) / 1e4 * float(FLT_MAX)
    x[0, 0], x[3, 20] = FLT_MAX, -FLT_MAX
    return x.astype(np.float32)


CASES = {
    "ties_k0": lambda: nice_tensor(0, 1),
    "ties_k-20": lambda: nice_tensor(-20, 2),
    "ties_k30": lambda: nice_tensor(30, 3),
    "odd_scales": lambda: odd_tensor(10),
    "random": lambda: random_tensor(1.0, 4),
    "float32_max": lambda: float32_max_tensor(5),
    "tiny_2^-90": lambda: (random_tensor(2.0**-90, 6)).astype(np.float32),
    "zeros": lambda: np.zeros((32, 64), np.float32),
}


# ----------------------------------------------------------------------------------------------------
# Comparison.


@functools.partial(jax.jit, static_argnames=("axis", "block_2d", "rounding"))
def _q(x, key=None, *, axis=-1, block_2d=False, rounding="nearest_even"):
    return quantize_nvfp4(x, axis=axis, block_2d=block_2d, rounding=rounding, key=key)


@jax.jit
def _dequantize(q):
    return q.dequantize()


def _f32_same(got, want) -> np.ndarray:
    got, want = np.asarray(got, np.float32), np.asarray(want, np.float32)
    return (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))


def assert_matches(q: NVFP4Array, ref: fref.RefNVFP4, what: str, transpose: bool = False):
    """q's arrays (transposed back when `transpose`) equal the reference's codes, scales and values."""
    t = (lambda a: np.asarray(a).T) if transpose else np.asarray
    assert q.data.dtype == jnp.float4_e2m1fn and q.scale.dtype == jnp.float8_e4m3fn, what
    gs = np.asarray(q.global_scale)
    assert gs.shape == () and gs.dtype == np.float32, what
    assert gs.view(np.uint32) == ref.s_enc.view(np.uint32), (what, gs, ref.s_enc)
    scale_bytes = t(q.scale).view(np.uint8)
    assert scale_bytes.shape == ref.scale_bytes.shape, (what, scale_bytes.shape)
    bad = scale_bytes != ref.scale_bytes
    assert not bad.any(), f"{what}: {bad.sum()} block scales differ, first {np.argwhere(bad)[0]}"
    codes = t(q.data).view(np.uint8)
    bad = codes != ref.codes
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        raise AssertionError(
            f"{what}: {bad.sum()} codes differ; at {i} got {codes[i]:#x} want {ref.codes[i]:#x}"
        )
    for how, deq in (("eager", q.dequantize()), ("jitted", _dequantize(q))):
        same = _f32_same(t(deq), ref.dequantize())
        assert same.all(), f"{what}: {how} dequantized values differ at {np.argwhere(~same)[:4].tolist()}"


# ----------------------------------------------------------------------------------------------------
# Tests.


def test_reference_grids_match_ml_dtypes():
    for fmt, dtype, n in (
        (fref.E2M1, ml_dtypes.float4_e2m1fn, 16),
        (fref.E4M3, ml_dtypes.float8_e4m3fn, 256),
    ):
        decoded = np.arange(n // 2, dtype=np.uint8).view(dtype).astype(np.float64)
        values, codes = minifloat_grid(*fmt)
        assert [decoded[c] for c in codes] == [float(v) for v in values]


@pytest.mark.parametrize("fmt", [fref.E2M1, fref.E4M3], ids=["e2m1", "e4m3"])
def test_reference_rounding_is_the_exact_rule_element_by_element(fmt):
    """formats_reference.round_on (whole arrays, float64) gives mx_reference.round_on_grid's value (one
    Fraction at a time) at the grid values, the midpoints between them, beyond the top, the float32
    values next to each of those, and at random magnitudes; stochastically with u just below, at and just
    above each element's threshold (y - lo) / (hi - lo)."""
    values, codes = minifloat_grid(*fmt)
    magnitude = {c: float(v) for v, c in zip(values, codes, strict=True)}
    grid = np.array([float(v) for v in values])
    edges = np.concatenate([grid, (grid[1:] + grid[:-1]) / 2, grid[-1] * np.array([1.5, 2.0, 1e30])])
    edges = edges.astype(F32)
    rng = np.random.default_rng(0)
    y = np.concatenate(
        [
            edges,
            np.nextafter(edges, F32(0)),
            np.nextafter(edges, F32(np.inf)),
            rng.uniform(0, grid[-1], 1000).astype(F32),
            rng.uniform(0, grid[1], 100).astype(F32),  # between 0 and the smallest subnormal
        ]
    ).astype(np.float64)
    exact = [Fraction(v) for v in y.tolist()]
    want = [magnitude[round_on_grid(v, values, codes)] for v in exact]
    np.testing.assert_array_equal(fref.round_on(y, fmt), want)

    def threshold(v: Fraction) -> int:
        """floor(2^24 (v - lo) / (hi - lo)): u = k / 2^24 rounds v up exactly for k below 2^24 times it."""
        i = bisect.bisect_right(values, v) - 1
        if i + 1 == len(values):
            return 0  # at or beyond the top: saturates whatever u is
        return math.floor((v - values[i]) / (values[i + 1] - values[i]) * 2**24)

    for offset in (-1, 0, 1):
        k = np.clip([threshold(v) + offset for v in exact], 0, 2**24 - 1)
        bits = (k.astype(np.uint32) << 8) | rng.integers(0, 256, k.size, dtype=np.uint32)  # low 8 unread
        want = [
            magnitude[round_on_grid(v, values, codes, "stochastic", Fraction(int(u), 2**24))]
            for v, u in zip(exact, k, strict=True)
        ]
        np.testing.assert_array_equal(fref.round_on(y, fmt, bits), want, err_msg=f"offset {offset}")


def test_global_scale_rule():
    """S_enc = 2688 / amax in float32, FLT_MAX where it overflows, 1 for amax = 0."""
    amaxes = [0.0, 1.0, 2688.0, 3.0, 1e-3, 7e-36, 8e-36, 2.0**-100, float(FLT_MAX), 12345.678]
    got = np.asarray(jax.jit(jax.vmap(nvfp4_global_scale))(jnp.asarray(amaxes, jnp.float32)))
    want = np.array([fref.global_scale(a) for a in amaxes], np.float32)
    np.testing.assert_array_equal(got.view(np.uint32), want.view(np.uint32))
    assert got[0] == 1.0 and got[1] == 2688.0 and got[2] == 1.0 and got[5] == FLT_MAX


@pytest.mark.parametrize("case", list(CASES))
def test_1d_blocks_match_the_reference(case):
    """1D blocks of 16 along the last axis and along axis 0 (the same blocks of the transpose), with
    round-to-nearest-even and stochastic rounding: codes, E4M3 scale bytes, S_enc, dequantized bits."""
    x = CASES[case]()
    key = jax.random.key(7)
    bits = np.asarray(jax.random.bits(key, x.shape, jnp.uint32))
    assert_matches(_q(jnp.asarray(x)), fref.quantize_nvfp4(x, 1), f"{case}/rne")
    assert_matches(
        _q(jnp.asarray(x), key, rounding="stochastic"), fref.quantize_nvfp4(x, 1, bits), f"{case}/sr"
    )
    # Blocks along axis 0 of x^T are x's blocks; the random bits are drawn with that axis last.
    assert_matches(_q(jnp.asarray(x.T), axis=0), fref.quantize_nvfp4(x, 1), f"{case}/axis0", transpose=True)


@pytest.mark.parametrize("case", ["ties_k0", "random", "float32_max"])
def test_2d_tiles_match_the_reference_and_commute_with_transposition(case):
    """16 x 16 tiles: the reference's tile rule, and quantizing W^T (either axis) gives W's values."""
    x = CASES[case]()
    q = _q(jnp.asarray(x), block_2d=True)
    assert q.scale.shape == (2, 4)
    assert_matches(q, fref.quantize_nvfp4(x, BS), f"{case}/2d")
    for axis in (0, 1):
        qt = _q(jnp.asarray(x.T), axis=axis, block_2d=True)
        np.testing.assert_array_equal(np.asarray(qt.data).view(np.uint8).T, np.asarray(q.data).view(np.uint8))
        np.testing.assert_array_equal(
            np.asarray(qt.scale).view(np.uint8).T, np.asarray(q.scale).view(np.uint8)
        )
        assert _f32_same(np.asarray(qt.dequantize()).T, q.dequantize()).all()
    key = jax.random.key(3)
    bits = np.asarray(jax.random.bits(key, x.shape, jnp.uint32))
    assert_matches(
        _q(jnp.asarray(x), key, block_2d=True, rounding="stochastic"),
        fref.quantize_nvfp4(x, BS, bits),
        "2d/sr",
    )
    # The transposition property is the tiles': 1D blocks of W and W^T differ.
    q1, q1t = _q(jnp.asarray(x)), _q(jnp.asarray(x.T))
    assert not _f32_same(np.asarray(q1t.dequantize()).T, q1.dequantize()).all()


def test_2d_tiles_of_a_batched_array_along_the_second_to_last_axis():
    x = np.stack([CASES["random"](), CASES["ties_k-20"]()])  # (2, 32, 64): tiles of each matrix
    q = _q(jnp.asarray(x), axis=1, block_2d=True)
    assert q.scale.shape == (2, 2, 4) and q.axis == 1
    amax = F32(np.max(np.abs(x)))
    for i in range(2):
        sub = NVFP4Array(q.data[i], q.scale[i], q.global_scale, axis=0, block_size=BS, block_2d=True)
        assert_matches(sub, fref.quantize_nvfp4(x[i], BS, tensor_amax=amax), f"batched 2d [{i}]")


def test_tiny_tensors_flush_to_zero_as_documented():
    """amax below ~3e-35: S_dec = 1 / S_enc is below the float32 normal range and is flushed, so the
    tensor dequantizes to zeros (every back end alike; docs/numerics.md)."""
    x = (np.random.default_rng(9).uniform(-1, 1, (32, 64)) * 2.0**-116).astype(np.float32)
    x[0, 0] = 2.0**-116  # S_enc = 2688 * 2^116 (normal), S_dec = 2^-127.4 (subnormal)
    q = _q(jnp.asarray(x))
    assert_matches(q, fref.quantize_nvfp4(x, 1), "tiny 2^-116")
    assert (np.asarray(q.dequantize()) == 0).all()


def test_nonfinite_blocks_get_a_nan_scale_and_spare_the_rest():
    x = CASES["random"]()
    bad = x.copy()
    bad[0, 3], bad[5, 40], bad[9, 17] = np.nan, np.inf, -np.inf
    for block_2d, tile in ((False, 1), (True, BS)):
        q = _q(jnp.asarray(bad), block_2d=block_2d)
        assert_matches(q, fref.quantize_nvfp4(bad, tile), f"non-finite, 2d={block_2d}")
        deq = np.asarray(q.dequantize())
        assert np.isnan(deq[0, :16]).all() and np.isnan(deq[5, 32:48]).all()
        healthy = ~np.isnan(deq)
        assert healthy.sum() == x.size - 3 * (256 if block_2d else 16)  # three blocks (tiles) hold them
        clean = bad.copy()
        clean[~np.isfinite(clean)] = 0
        ref_clean = np.asarray(_q(jnp.asarray(clean), block_2d=block_2d).dequantize())
        assert _f32_same(deq[healthy], ref_clean[healthy]).all()


def test_stochastic_rounding_is_unbiased_and_picks_a_neighbour():
    """N = 1000 keys: every sample is one of the two E2M1 neighbours of y = |x * e_b|, and each element's
    mean is within 5 sigma (sigma = (hi - lo) sqrt(p (1 - p) / N)) of E[q] = y for y <= 6."""
    x = CASES["ties_k0"]()[:8]
    ref = fref.quantize_nvfp4(x, 1)
    n = 1000
    keys = jax.random.split(jax.random.key(5), n)
    sample = jax.jit(jax.vmap(lambda k: quantize_nvfp4(jnp.asarray(x), rounding="stochastic", key=k).data))
    q = np.abs(np.asarray(sample(keys)).astype(np.float64))
    y = ref.y
    g = np.array([0.0, 0.5, 1, 1.5, 2, 3, 4, 6])
    i = np.clip(np.searchsorted(g, y, side="right") - 1, 0, 6)
    lo, hi = g[i], np.where(y >= 6, 6.0, g[i + 1])
    lo = np.where(y >= 6, 6.0, lo)
    hit = (q == lo) | (q == hi)
    assert hit.all(), f"samples off the neighbours at {np.argwhere(~hit)[:3].tolist()}"
    p = np.where(hi > lo, (y - lo) / np.where(hi > lo, hi - lo, 1.0), 0.0)
    sigma = (hi - lo) * np.sqrt(p * (1 - p) / n)
    err = np.abs(q.mean(0) - y)
    assert (err <= 5 * sigma + 2.0**-20).all(), err.max()
    assert (sigma > 0).sum() > 100  # ties and near-ties: the bound is exercised


@pytest.mark.parametrize(
    "kwargs, word",
    [
        (dict(block_size=0), "block_size"),
        (dict(block_size=24), "block_size"),
        (dict(block_size="16"), "block_size"),
        (dict(block_size=64), "64"),
        (dict(axis=0, block_size=16, x=np.ones((24, 32))), "24"),
        (dict(axis=2), "axis"),
        (dict(rounding="nearest_away"), "rounding"),
        (dict(rounding="stochastic"), "key"),
        (dict(block_2d=True, x=np.ones((4, 32, 16)), axis=0), "2D"),
        (dict(block_2d=True, x=np.ones((24, 32))), "24"),
        (dict(block_2d=True, x=np.ones(32)), "2D"),
    ],
)
def test_bad_input_raises_one_line_value_errors(kwargs, word):
    x = kwargs.pop("x", np.ones((4, 48)))
    with pytest.raises(ValueError) as err:
        quantize_nvfp4(jnp.asarray(x, jnp.float32), **kwargs)
    message = str(err.value)
    assert word in message and "\n" not in message, message


def test_nvfp4_array_is_a_pytree_and_dequantizes_to_bfloat16():
    x = CASES["random"]()
    q = _q(jnp.asarray(x))
    assert len(jax.tree.leaves(q)) == 3
    out = jax.jit(lambda a: a)(q)
    assert (out.axis, out.block_size, out.block_2d) == (1, BS, False)
    got = np.asarray(jax.jit(lambda a: a.dequantize(jnp.bfloat16))(q))
    np.testing.assert_array_equal(got, np.asarray(q.dequantize()).astype(ml_dtypes.bfloat16))


def test_bfloat16_input_is_quantized_from_its_float32_values():
    x = CASES["odd_scales"]().astype(ml_dtypes.bfloat16)
    assert_matches(_q(jnp.asarray(x)), fref.quantize_nvfp4(x.astype(np.float32), 1), "bf16 input")
