"""The fold of MXFP6 E2M3 operands into E4M3 rows, and the fp8 back end that multiplies them.

The expectations are written here from the contract (docs/numerics.md, "The fold" and "Which formats
fold"), in float64 numpy, without fp4jax's fold: E = the largest block exponent of the row's non-zero
blocks (0 if none), folded = q * 2^(e_b - E + shift) for blocks with e_b - E >= -window, else +0 and
counted, row exponent E - shift; a NaN block makes its row NaN (row exponent 0) and counts nothing.
E2M3: shift 5 and window 11 into float8_e4m3fn, shift 5 and window 12 into float8_e4m3fnuz.
"""

import dataclasses

import jax
import jax.numpy as jnp
import ml_dtypes
import mx_reference
import numpy as np
import pytest
from helpers import all_eqns, fwd_bwd, random_operands

from fp4jax.ops import PRESETS, MXArray, quantize_mx
from fp4jax.ops.kernels import backends, fold, probes
from fp4jax.ops.kernels.fold import is_foldable
from fp4jax.ops.recipes import QuantSpec

FP8 = {"e4m3fn": jnp.float8_e4m3fn, "e4m3fnuz": jnp.float8_e4m3fnuz}
NP_FP8 = {"e4m3fn": ml_dtypes.float8_e4m3fn, "e4m3fnuz": ml_dtypes.float8_e4m3fnuz}
# Derived by hand (docs/numerics.md): shift = the largest s with max * 2^s <= 448 (FNUZ 240); window =
# shift + (emin - mantissa bits) + 9 (FNUZ + 10). None: no shift fits.
HAND_DERIVED = {
    ("e2m1", "e4m3fn"): (6, 14),
    ("e2m1", "e4m3fnuz"): (5, 14),
    ("e2m3", "e4m3fn"): (5, 11),
    ("e2m3", "e4m3fnuz"): (5, 12),
    ("e3m2", "e4m3fn"): (4, 9),
    ("e3m2", "e4m3fnuz"): (3, 9),
    ("e4m3", "e4m3fn"): (0, 0),
    ("e4m3", "e4m3fnuz"): None,
    ("e5m2", "e4m3fn"): None,
    ("e5m2", "e4m3fnuz"): None,
}
E2M3 = {fp8: HAND_DERIVED[("e2m3", fp8)] for fp8 in FP8}
NAN_EXP = mx_reference.FOLD_NAN_EXP
BLOCK = 8


def _mx(q: np.ndarray, e: np.ndarray) -> MXArray:
    """An E2M3 MXArray holding element values q with block exponents e (NAN_EXP: a NaN scale)."""
    scale = jax.lax.bitcast_convert_type(jnp.asarray(e + 127, jnp.uint8), jnp.float8_e8m0fnu)
    return MXArray(jnp.asarray(q, jnp.float8_e4m3fn), scale, axis=1, block_size=BLOCK, elem="e2m3")


def _adversarial_rows(rng) -> tuple[np.ndarray, np.ndarray]:
    """(values, exponents): rows of 16 blocks of 8 E2M3 elements that test the fold's edges.

    0: blocks 0..13 binades below a top block holding 7.5 (FN keeps 0..11, FNUZ 0..12), two all-zero
       blocks with exponents above the top (ignored); 1: all zero; 2: one NaN block and one block far
       below (NaN row, nothing counted); 3: only subnormal E2M3 values 0.125..0.875; 4: every grid value
       of both signs, at exponents spread over 40 binades."""
    grid = mx_reference.all_grid_values("e2m3")  # 0 .. 7.5, subnormals 0.125 .. 0.875 included
    signed = np.concatenate([grid, -grid])
    q = rng.choice(signed, size=(5, 16 * BLOCK))
    e = rng.integers(-20, 21, size=(5, 16))
    q[0, 0], q[0, 1:BLOCK] = 7.5, 0.125  # the largest and the smallest element in the top block
    q[0, BLOCK::BLOCK] = 0.125  # every lower block holds the smallest element: lands on fp8's tiniest
    e[0, :14] = 3 - np.arange(14)
    q[0, 14 * BLOCK :], e[0, 14:] = 0.0, 40
    q[1] = 0.0
    e[2, 5], e[2, 9] = NAN_EXP, -60
    q[2, 9 * BLOCK : 10 * BLOCK] = 1.0
    q[3] = rng.choice(grid[1:8], size=16 * BLOCK) * rng.choice([-1, 1], size=16 * BLOCK)
    q[4, : 2 * len(grid)] = signed
    return q, e


ROWS = _adversarial_rows(np.random.default_rng(0))
fold_jit = jax.jit(fold.fold_mx_to_fp8, static_argnames="fp8_dtype")
count_jit = jax.jit(fold.count_fold_flushes, static_argnames="fp8_dtype")


def _check_fold(x: MXArray, q: np.ndarray, e: np.ndarray, fp8: str) -> int:
    """Checks the fold of x (values q, exponents e) into `fp8` against the reference; its flush count."""
    shift, window = E2M3[fp8]
    out = fold_jit(x, fp8_dtype=FP8[fp8])
    want, want_exp, want_flushed, mask = mx_reference.reference_fold(q, e, x.block_size, shift, window)
    got = np.asarray(out.data.astype(jnp.float32), np.float64).reshape(q.shape)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(out.row_exponent).reshape(-1), want_exp)
    assert int(out.flushed_blocks) == want_flushed == int(count_jit(x, fp8_dtype=FP8[fp8]))
    # The reference's folded values are fp8 numbers (so the fold's cast had nothing to round) ...
    np.testing.assert_array_equal(want.astype(NP_FP8[fp8]).astype(np.float64), want)
    # ... and folded * 2^row_exponent is q * 2^e_b (float64, exact), also x.dequantize() bit for bit.
    exact = q * np.exp2(np.repeat(np.where(e == NAN_EXP, 0, e), x.block_size, axis=1))
    value = got * np.exp2(np.asarray(out.row_exponent, np.float64).reshape(-1, 1))
    live = ~mask & ~np.isnan(value)
    np.testing.assert_array_equal(value[live], exact[live])
    np.testing.assert_array_equal(value[live], np.asarray(x.dequantize(), np.float64).reshape(q.shape)[live])
    assert np.all(value[mask] == 0)
    return want_flushed


# ----------------------------------------------------------------------------------------------------
# (a) the fold of E2M3 blocks is exact in its window


@pytest.mark.parametrize("fp8", list(FP8))
def test_e2m3_fold_is_exact_on_adversarial_blocks(fp8):
    q, e = ROWS
    flushed = _check_fold(_mx(q, e), q, e, fp8)
    out = fold_jit(_mx(q, e), fp8_dtype=FP8[fp8])
    data = np.asarray(out.data.astype(jnp.float32), np.float64)
    shift, window = E2M3[fp8]
    tiniest = float(ml_dtypes.finfo(NP_FP8[fp8]).smallest_subnormal)
    # Row 0: the top block's 7.5 lands at 7.5 * 2^shift = 240, its smallest element `window` binades down
    # on the fp8 type's smallest subnormal; the blocks past the window are flushed.
    assert data[0, 0] == 240.0 and data[0, window * BLOCK] == tiniest
    assert np.all(data[0, (window + 1) * BLOCK :] == 0)
    assert np.all(data[1] == 0) and int(out.row_exponent[1]) == -shift  # all-zero row: E = 0
    assert np.all(np.isnan(data[2])) and int(out.row_exponent[2]) == 0
    # FN flushes blocks 12 and 13 of row 0, FNUZ block 13 only; row 4 flushes more in both.
    assert flushed > 13 - window


@pytest.mark.parametrize("scale_mode", ["floor", "even", "ceil"])
def test_quantized_ties_fold_exactly(scale_mode):
    """Midpoints between neighbouring E2M3 values (the element rounding's ties where a block's scale is
    its binade's: floor and ceil) and 7.5, blocks 2 binades apart along the row (30 in all): the MXArray
    quantize_mx makes of them is the independent reference quantizer's, and it folds exactly, with the
    flushed blocks counted, in both fp8 types."""
    grid = mx_reference.all_grid_values("e2m3")
    ties = (grid[1:] + grid[:-1]) / 2  # 31 midpoints
    values = np.resize(np.concatenate([ties, -ties, [7.5]]), (4, 16 * 32))
    x = values * np.exp2(np.repeat(-2 * np.arange(16), 32))[None]  # blocks 2 binades apart
    mx = jax.jit(lambda v: quantize_mx(v, elem="e2m3", scale_mode=scale_mode))(jnp.asarray(x, jnp.float32))
    ref = mx_reference.quantize_mx(x, elem="e2m3", scale_mode=scale_mode, block_size=32)
    q = np.asarray(mx.data.astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(q, ref.data)
    np.testing.assert_array_equal(np.asarray(mx.scale_exponent()), ref.exp)
    assert all(_check_fold(mx, ref.data, ref.exp, fp8) > 0 for fp8 in FP8)


# ----------------------------------------------------------------------------------------------------
# (b) shift and window from the element format


@pytest.mark.parametrize(("elem", "fp8"), list(HAND_DERIVED))
def test_fold_params_are_the_hand_derived_numbers(elem, fp8):
    params = fold.fold_params(elem, FP8[fp8])
    assert (params and (params.shift, params.window)) == HAND_DERIVED[(elem, fp8)]


@pytest.mark.parametrize(("elem", "fp8"), [k for k, v in HAND_DERIVED.items() if v is not None])
def test_the_window_is_the_widest_exact_one(elem, fp8):
    """Every element value times 2^s is an fp8 number for s in [shift - window, shift], and some is not
    for s = shift + 1 (overflow) or s = shift - window - 1 (off the subnormal grid): found by casting."""
    shift, window = HAND_DERIVED[(elem, fp8)]
    values = mx_reference.all_grid_values(elem)

    def exact(s):
        scaled = values * 2.0**s
        return np.array_equal(scaled.astype(NP_FP8[fp8]).astype(np.float64), scaled)

    assert all(exact(s) for s in range(shift - window, shift + 1))
    assert not exact(shift + 1) and not exact(shift - window - 1)


def test_e2m3_folds_e3m2_and_mxfp8_do_not():
    assert fold.FOLDED_ELEMS == ("e2m1", "e2m3")
    for elem in ("e2m1", "e2m3", "e3m2", "e4m3", "e5m2"):
        assert backends.fp8_folds(QuantSpec(kind="mx", elem=elem)) == (elem in fold.FOLDED_ELEMS)
    with pytest.raises(ValueError, match="got E3M2: E3M2's exact window .9 binades. is too narrow"):
        fold.fold_mx_to_fp8(quantize_mx(jnp.ones((2, 32)), elem="e3m2"))


# ----------------------------------------------------------------------------------------------------
# (c) the fp8 back end on E2M3 GEMMs: emulate's bits, one FP8 GEMM each


E2M3_PRESETS = ["mxfp6_e2m3_full", "mxfp6_e2m3_full_h16"]
DIMS = (((2,), (0,)), ((), ()))


def _operands():
    """x (2, 32, 96), w, dy: Wgrad contracts 64 tokens."""
    return random_operands(5, (2, 32, 96), (96, 64), (2, 32, 64), scales=(1, 0.1, 1))


@pytest.mark.parametrize("preset", E2M3_PRESETS)
def test_mx_dot_fp8_back_end_is_emulate_bit_for_bit(preset):
    """Gaussian operands: every block lies within 11 binades of its row's top, so nothing is flushed and
    the folded GEMMs (three FP8 dots) give emulate's float32 outputs, forward and both gradients: bit
    for bit on CPU, where both accumulate in float32; within 1e-4 of the largest output on a GPU, whose
    FP8 tensor cores accumulate otherwise (tests/test_fold.py)."""
    operands = _operands()
    recipes = {b: dataclasses.replace(PRESETS[preset], backend=b) for b in ("emulate", "fp8")}
    jaxpr = jax.make_jaxpr(lambda *a: fwd_bwd(*a, recipe=recipes["fp8"], dims=DIMS))(*operands)
    # The three GEMMs are FP8 dots; no dequantized (bf16) GEMM is left (the Hadamard rotation's float32
    # dots in the _h16 preset are not GEMMs of quantized operands).
    dots = [{v.aval.dtype for v in e.invars} for e in all_eqns(jaxpr) if e.primitive.name == "dot_general"]
    assert dots.count({jnp.dtype(probes.device_fold_dtype())}) == 3
    assert not any(jnp.dtype(jnp.bfloat16) in d for d in dots)
    runs = {
        b: jax.jit(lambda *a, r=r: fwd_bwd(*a, recipe=r, dims=DIMS))(*operands) for b, r in recipes.items()
    }
    for name, got, want in zip(("y", "dx", "dw"), runs["fp8"], runs["emulate"], strict=True):
        assert got.dtype == want.dtype == jnp.float32
        got, want, where = np.asarray(got), np.asarray(want), f"{preset} {name}"
        if jax.default_backend() == "cpu":
            np.testing.assert_array_equal(got, want, err_msg=where)
        else:
            np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max(), err_msg=where)


def test_flush_count_on_an_input_across_the_window():
    """Blocks 0 .. 15 binades below the row's top block (quantize_mx, then the fold's count) flush as
    many blocks as the independent reference quantizer's exponents predict, and every flushed element is
    below the documented bound, 7.5 / 3.5 * 2^-12 of its row's largest (scale rule `even`)."""
    rng = np.random.default_rng(3)
    x = rng.standard_normal((8, 16 * 32)) * np.exp2(-rng.integers(0, 16, (8, 16)).repeat(32, axis=1))
    mx = jax.jit(lambda v: quantize_mx(v, elem="e2m3", scale_mode="even"))(jnp.asarray(x, jnp.float32))
    ref = mx_reference.quantize_mx(x, elem="e2m3", scale_mode="even", block_size=32)
    deq = np.abs(ref.data * np.exp2(ref.exp.repeat(32, axis=1)))
    for fp8, (shift, window) in E2M3.items():
        _, _, want, mask = mx_reference.reference_fold(ref.data, ref.exp, 32, shift, window)
        assert want > 0 and int(count_jit(mx, fp8_dtype=FP8[fp8])) == want
        assert int(fold_jit(mx, fp8_dtype=FP8[fp8]).flushed_blocks) == want
        assert np.all(np.where(mask, deq, 0) <= 7.5 / 3.5 * 2.0**-12 * deq.max(axis=1, keepdims=True))


# ----------------------------------------------------------------------------------------------------
# (d) an MXArray says which element it holds


def test_mxarray_elem_must_match_its_data():
    x = quantize_mx(jnp.ones((2, 32)), elem="e2m3")
    assert x.elem == "e2m3" and is_foldable(x)
    assert not is_foldable(dataclasses.replace(x, elem="e3m2"))  # same bytes, another grid
    assert jax.jit(lambda v: v)(x).elem == "e2m3"  # static: carried through pytrees
    cases = [
        (dict(elem="e2m1"), "MXArray elem='e2m1' is stored as float4_e2m1fn, but its data are float8_e4m3fn"),
        (dict(), "MXArray data of dtype float8_e4m3fn holds e2m3, e3m2, e4m3: pass elem="),
        (dict(elem="e6m1"), "unknown element format 'e6m1'"),
    ]
    for kwargs, message in cases:
        with pytest.raises(ValueError, match=message) as err:
            MXArray(x.data, x.scale, axis=x.axis, block_size=x.block_size, **kwargs)
        assert "\n" not in str(err.value)
    e2m1 = quantize_mx(jnp.ones((2, 32)))
    assert MXArray(e2m1.data, e2m1.scale, axis=1, block_size=32).elem == "e2m1"  # the dtype decides
