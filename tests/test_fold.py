"""The MX -> E4M3 fold and the fp8 GEMM back end, against an independent numpy reference.

The reference fold (mx_reference.reference_fold) is written from the contract (docs/numerics.md, "Back
ends"), in float64 numpy: E = max block exponent of the row's non-zero blocks (0 if none), folded =
q * 2^(e_b - E + shift) for blocks with e_b - E >= -14, else 0 (and counted), row exponent E - shift; a
NaN block makes the row NaN.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import lanes
import ml_dtypes
import numpy as np
import pytest
from mx_reference import reference_fold

from fp4jax.ops import PRESETS, MXArray, mx_dot_general, quantize_fp8
from fp4jax.ops import quantize_mx as _quantize_mx
from fp4jax.ops.kernels import backends, fold, probes

# Jitted: on CPU, op-by-op dispatch of the quantizer costs far more than one compile per signature.
quantize_mx = jax.jit(_quantize_mx, static_argnames=("axis", "elem", "block_size", "scale_mode", "rounding"))

# On CPU every back end accumulates exactly in float32 (only the summation order differs). On a GPU the
# FP8 tensor cores accumulate with reduced-precision partial sums: allow 1e-4 of the largest output there.
ON_CPU = jax.default_backend() == "cpu"
GPU_RTOL = 1e-4
E2M1_VALUES = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6])
SHIFT = {"e4m3fn": 6, "e4m3fnuz": 5}
FOLD_WINDOW = 14  # E2M1 blocks more than 14 binades below the row's top flush, in both FP8 formats
FP8 = {"e4m3fn": jnp.float8_e4m3fn, "e4m3fnuz": jnp.float8_e4m3fnuz}
NP_FP8 = {"e4m3fn": ml_dtypes.float8_e4m3fn, "e4m3fnuz": ml_dtypes.float8_e4m3fnuz}


def _as_numpy(x: MXArray):
    q = np.asarray(x.data.astype(jnp.float32), np.float64)
    e = np.asarray(x.scale_exponent(), np.int64)
    return q.reshape(-1, q.shape[-1]), e.reshape(-1, e.shape[-1])


def _random_mx(key, rows, k, exp_low, exp_high, block=32, zero_blocks=0.0) -> MXArray:
    """An MXArray with random E2M1 codes and block exponents drawn uniformly in [exp_low, exp_high]."""
    kq, ke, kz = jax.random.split(key, 3)
    codes = jax.random.randint(kq, (rows, k), 0, 16)
    values = jnp.asarray(E2M1_VALUES, jnp.float32)[codes]
    if zero_blocks:
        keep = jax.random.uniform(kz, (rows, k // block, 1)) >= zero_blocks
        values = (values.reshape(rows, -1, block) * keep).reshape(rows, k)
    exps = jax.random.randint(ke, (rows, k // block), exp_low, exp_high + 1)
    scale = jax.lax.bitcast_convert_type((exps + 127).astype(jnp.uint8), jnp.float8_e8m0fnu)
    return MXArray(data=values.astype(jnp.float4_e2m1fn), scale=scale, axis=1, block_size=block)


@functools.cache  # built on first use, not when each worker collects the module (about 2 s)
def _inputs():
    key = jax.random.key(7)
    k1, k2, k3, k4, k5 = jax.random.split(key, 5)
    normal = jax.random.normal(k1, (24, 256))
    outlier = normal.at[:, 5].multiply(2.0**30).at[3, 200].set(1e-30)  # one huge element per row
    spread = normal * jnp.exp2(jax.random.randint(k2, (24, 8, 1), -30, 30)).repeat(32, 1).reshape(24, 256)
    return {
        "random": quantize_mx(normal, scale_mode="even"),
        "random_floor_sr": quantize_mx(normal, scale_mode="floor", rounding="stochastic", key=k5),
        "outlier_rows": quantize_mx(outlier, scale_mode="ceil"),
        "wide_range": quantize_mx(spread, scale_mode="even"),
        "extreme_exponents": _random_mx(k3, 32, 512, -127, 127, zero_blocks=0.2),
        "near_window": _random_mx(k4, 32, 512, -17, 0, block=16),
    }


INPUT_NAMES = ("random", "random_floor_sr", "outlier_rows", "wide_range", "extreme_exponents", "near_window")

fold_jit = jax.jit(fold.fold_mx_to_fp8, static_argnames="fp8_dtype")
dequantize_jit = jax.jit(lambda x: x.dequantize())
count_jit = jax.jit(fold.count_fold_flushes)
fp8_matmul_jit = jax.jit(backends.fp8_matmul, static_argnums=2)
matmul_jit = jax.jit(backends.matmul, static_argnames=("backend", "precision"))


# ----------------------------------------------------------------------------------------------------
# the fold


@pytest.mark.parametrize("fp8", ["e4m3fn", "e4m3fnuz"])
@pytest.mark.parametrize("name", INPUT_NAMES)
def test_fold_matches_reference_and_dequantize(name, fp8):
    x = _inputs()[name]
    out = fold_jit(x, fp8_dtype=FP8[fp8])
    assert out.data.dtype == FP8[fp8] and out.row_exponent.dtype == jnp.int32
    q, e = _as_numpy(x)
    want, want_exp, want_flushed, flushed_mask = reference_fold(q, e, x.block_size, SHIFT[fp8], FOLD_WINDOW)
    got = np.asarray(out.data.astype(jnp.float32), np.float64).reshape(q.shape)
    np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(np.asarray(out.row_exponent).reshape(-1), want_exp)
    assert int(out.flushed_blocks) == want_flushed == int(count_jit(x))
    # The folded values, bit for bit, are E4M3 numbers (the cast did not round) ...
    np.testing.assert_array_equal(want.astype(NP_FP8[fp8]).astype(np.float64), want)
    # ... and folded * 2^row_exponent is the dequantized operand outside flushed blocks, zero inside.
    deq = np.asarray(x.dequantize(jnp.float32), np.float64).reshape(q.shape)
    value = got * np.exp2(np.asarray(out.row_exponent, np.float64).reshape(-1, 1))
    kept = ~flushed_mask
    finite_deq = np.isfinite(deq) & (np.abs(deq) >= 2.0**-126)  # CPU dequantize flushes subnormals
    np.testing.assert_array_equal(value[kept & finite_deq], deq[kept & finite_deq])
    assert np.all(value[flushed_mask] == 0)


def test_inputs_exercise_the_window():
    """The wide inputs really contain flushed blocks and blocks on the edge of the window."""
    inputs = _inputs()
    assert list(inputs) == list(INPUT_NAMES)
    assert int(count_jit(inputs["extreme_exponents"])) > 100
    assert int(count_jit(inputs["near_window"])) > 0
    assert int(count_jit(inputs["random"])) == 0


def test_out_of_window_rule():
    """Blocks 14 binades below the top fold exactly (smallest element -> E4M3's smallest subnormal);
    15 below are flushed and counted; all-zero blocks are neither the top nor counted."""
    block = np.zeros((1, 5, 32), np.float32)
    block[0, 0, 0] = 6.0  # top block, e = 3
    block[0, 1, 0] = 0.5  # e = 3 - 14: smallest element, folds to 2^-9 exactly
    block[0, 2, 1] = -6.0  # e = 3 - 15: flushed
    block[0, 3, 2] = 0.5  # e = 3 - 20: flushed
    # block 4 all zero, with exponent 10 (above the top): ignored
    exps = np.array([[3, 3 - 14, 3 - 15, 3 - 20, 10]])
    scale = jax.lax.bitcast_convert_type(jnp.asarray(exps + 127, jnp.uint8), jnp.float8_e8m0fnu)
    x = MXArray(jnp.asarray(block.reshape(1, 160), jnp.float4_e2m1fn), scale, axis=1, block_size=32)
    out = fold_jit(x)
    data = np.asarray(out.data.astype(jnp.float32))[0]
    assert int(out.row_exponent[0]) == 3 - 6 and int(out.flushed_blocks) == 2
    assert data[0] == 6.0 * 64 and data[32] == 2.0**-9
    assert np.all(data[64:] == 0)
    # FNUZ: the same rule, smallest element at FNUZ's smallest subnormal 2^-10.
    out = fold_jit(x, fp8_dtype=jnp.float8_e4m3fnuz)
    data = np.asarray(out.data.astype(jnp.float32))[0]
    assert int(out.row_exponent[0]) == 3 - 5 and data[0] == 192 and data[32] == 2.0**-10
    assert int(out.flushed_blocks) == 2


@pytest.mark.parametrize("scale_mode", ["floor", "even", "ceil"])
@pytest.mark.parametrize("rounding", ["nearest_even", "stochastic"])
def test_flushed_elements_are_below_2_to_minus_14_of_their_row(scale_mode, rounding):
    """The documented bound: quantize_mx puts every non-zero block's largest element at >= 3 * 2^e, so a
    flushed element (<= 6 * 2^(E - 15)) is at most 2^-14 of its row's largest element."""
    k1, k2, k3 = jax.random.split(jax.random.key(11), 3)
    blocks = jax.random.normal(k1, (64, 16, 32)) * jnp.exp2(jax.random.randint(k2, (64, 16, 1), -40, 1))
    x = quantize_mx(blocks.reshape(64, 512), scale_mode=scale_mode, rounding=rounding, key=k3)
    q, e = _as_numpy(x)
    nonzero_max = np.abs(q.reshape(64, 16, 32)).max(axis=-1)
    assert np.all(nonzero_max[nonzero_max > 0] >= 3)
    _, _, flushed, mask = reference_fold(q, e, 32, 6, FOLD_WINDOW)
    assert flushed > 0
    deq = np.abs(np.asarray(dequantize_jit(x), np.float64))
    row_max = deq.max(axis=1, keepdims=True)
    assert np.all(np.where(mask, deq, 0) <= 2.0**-14 * row_max)


def test_nan_block_makes_nan_row_and_zero_row_has_exponent_zero():
    x = quantize_mx(jnp.zeros((3, 64)).at[1, 40].set(jnp.inf).at[2, 3].set(1.0))
    out = fold_jit(x)
    data = np.asarray(out.data.astype(jnp.float32))
    assert np.all(data[0] == 0) and int(out.row_exponent[0]) == 0 - 6  # all-zero row: E = 0
    assert np.all(np.isnan(data[1])) and int(out.row_exponent[1]) == 0
    assert np.isfinite(data[2]).all() and int(out.flushed_blocks) == 0


def test_fold_rejects_what_it_cannot_fold():
    with pytest.raises(ValueError, match="E2M1 and E2M3 elements only"):
        fold.fold_mx_to_fp8(quantize_mx(jnp.ones((2, 32)), elem="e4m3"))
    with pytest.raises(ValueError, match="last axis"):
        fold.fold_mx_to_fp8(quantize_mx(jnp.ones((32, 2)), axis=0))
    with pytest.raises(ValueError, match="float8_e4m3fnuz"):
        fold.fold_mx_to_fp8(quantize_mx(jnp.ones((2, 32))), fp8_dtype=jnp.float8_e5m2)


def test_apply_exponents_exact_where_normal():
    """out * 2^k for out on the FP8 GEMM's range and k over the whole range of Ea + Ec, against float64."""
    rng = np.random.default_rng(0)
    mantissa = rng.integers(2**23, 2**24, 4000)
    out = (mantissa * np.exp2(rng.integers(-26 - 23, 64 - 23, 4000)) * rng.choice([-1, 1], 4000)).astype(
        np.float32
    )
    k = rng.integers(-266, 243, 4000)
    got = np.asarray(fold.apply_exponents(jnp.asarray(out), jnp.asarray(k, jnp.int32)), np.float64)
    want = out.astype(np.float64) * np.exp2(k.astype(np.float64))
    normal = (np.abs(want) >= 2.0**-126) & (np.abs(want) < 2.0**128)
    assert normal.sum() > 1000 and (~normal).sum() > 1000
    np.testing.assert_array_equal(got[normal], want[normal])
    assert np.all(np.isinf(got[np.abs(want) >= 2.0**128]))
    tiny = np.abs(want) < 2.0**-126  # subnormal or below: rounded once on GPU, flushed on CPU
    assert np.all(np.abs(got[tiny]) <= 2.0**-126)


def test_apply_exponents_in_bfloat16_is_the_float32_result_rounded():
    """A bfloat16 GEMM result scaled in bfloat16 == the float32 result scaled, then rounded to bfloat16."""
    rng = np.random.default_rng(1)
    mantissa = rng.integers(2**23, 2**24, 4000)
    out = (mantissa * np.exp2(rng.integers(-26 - 23, 64 - 23, 4000)) * rng.choice([-1, 1], 4000)).astype(
        np.float32
    )
    k = jnp.asarray(rng.integers(-266, 243, 4000), jnp.int32)
    narrow = fold.apply_exponents(jnp.asarray(out).astype(jnp.bfloat16), k)
    assert narrow.dtype == jnp.bfloat16
    wide = fold.apply_exponents(jnp.asarray(out), k).astype(jnp.bfloat16)
    magnitude = np.abs(np.asarray(wide, np.float32))
    normal = (magnitude >= 2.0**-126) & np.isfinite(magnitude)
    assert normal.sum() > 1000
    np.testing.assert_array_equal(
        np.asarray(narrow).view(np.uint16)[normal], np.asarray(wide).view(np.uint16)[normal]
    )


# ----------------------------------------------------------------------------------------------------
# the fp8 product


def _summation_bound(a_deq, c_deq):
    """Two float32 accumulations of the same K products, in any order, differ by at most
    2 * gamma_K * sum_k |a_k c_k| (gamma_K = K u / (1 - K u), u = 2^-24)."""
    k = a_deq.shape[-1]
    gamma = k * 2.0**-24 / (1 - k * 2.0**-24)
    return 2 * gamma * np.einsum("bmk,bnk->bmn", np.abs(a_deq), np.abs(c_deq))


def _fp8_vs_emulate_bound(a_deq, c_deq, kinds):
    """How far the fp8 back end's product may be from emulate's, elementwise, on this lane.

    CPU: both accumulate exactly in float32, so only the summation order differs (_summation_bound).
    GPU: the fp8 GEMM runs on FP8 tensor cores, held to lanes.gemm_rtol x |A||B| (tests/lanes.py), and
    emulate's bf16 GEMM to FLOAT32_RTOL x |A||B|; plus 2^-126 for results below float32's normal range,
    which a GPU keeps as subnormals and rounds (fold.apply_exponents) where XLA's CPU flushes them.
    Returns (bound, relative part of it)."""
    if ON_CPU:
        return _summation_bound(a_deq, c_deq), None
    rtol = lanes.gemm_rtol(*kinds, a_deq.shape[-1], backend="fp8") + lanes.FLOAT32_RTOL
    abs_product = np.einsum("bmk,bnk->bmn", np.abs(a_deq), np.abs(c_deq))
    return rtol * abs_product + 2.0**-126, rtol


@functools.partial(jax.jit, static_argnums=(1, 2))
def _mx(key, shape, spread=0):
    x = jax.random.normal(key, shape)
    if spread:
        x = x * jnp.exp2(jax.random.randint(jax.random.fold_in(key, 1), shape[:-1] + (1,), -spread, spread))
    return quantize_mx(x, scale_mode="even")


@pytest.mark.parametrize("fp8", ["e4m3fn", "e4m3fnuz"])
def test_fp8_product_matches_emulate(fp8):
    if fp8 == "e4m3fnuz" and probes.describe_device().vendor == "nvidia":
        pytest.skip("FNUZ FP8 is MI300's format: NVIDIA GPUs have no GEMM for it (ALG_DOT_ANY_F8_ANY_F8_F32)")
    ka, kc = jax.random.split(jax.random.key(1))
    a, c = _mx(ka, (2, 48, 512), spread=60), _mx(kc, (2, 40, 512), spread=60)
    got = np.asarray(fp8_matmul_jit(a, c, FP8[fp8]), np.float64)
    emulated = np.asarray(matmul_jit(a, c, backend="emulate"), np.float64)
    a_deq, c_deq = np.asarray(dequantize_jit(a), np.float64), np.asarray(dequantize_jit(c), np.float64)
    bound, rtol = _fp8_vs_emulate_bound(a_deq, c_deq, ("mx", "mx"))
    assert np.all(np.abs(got - emulated) <= bound)
    # The bound is meaningful: on CPU far below the outputs themselves; on a GPU (rows spread over 2^+-60,
    # so only a relative bound can be) below the ~1e-2 |A||B| that one element rounded one E2M1 grid step
    # differently moves an output (tests/lanes.py).
    if ON_CPU:
        assert np.all(bound < 1e-4 * np.abs(emulated).max(axis=(1, 2), keepdims=True) + np.abs(emulated))
    else:
        assert rtol < 1e-2


def test_fp8_product_in_bfloat16_is_the_float32_product_rounded():
    """out_dtype=bfloat16 (two MX operands): the GEMM's bfloat16 result, scaled in bfloat16, equals the
    float32 product rounded to bfloat16 (CPU: bit for bit; GPU: the GEMM may accumulate in another
    order, so within the lane's FP8 bound of the float32 product)."""
    ka, kc = jax.random.split(jax.random.key(11))
    a, c = _mx(ka, (2, 48, 512), spread=60), _mx(kc, (2, 40, 512), spread=60)
    narrow = jax.jit(backends.fp8_matmul, static_argnums=(2, 3))(a, c, jnp.float8_e4m3fn, jnp.bfloat16)
    assert narrow.dtype == jnp.bfloat16
    wide = fp8_matmul_jit(a, c, jnp.float8_e4m3fn)
    if ON_CPU:
        np.testing.assert_array_equal(
            np.asarray(narrow).view(np.uint16), np.asarray(wide.astype(jnp.bfloat16)).view(np.uint16)
        )
    else:
        a_deq, c_deq = np.asarray(dequantize_jit(a), np.float64), np.asarray(dequantize_jit(c), np.float64)
        bound, _ = _fp8_vs_emulate_bound(a_deq, c_deq, ("mx", "mx"))
        difference = np.abs(np.asarray(narrow, np.float64) - np.asarray(wide, np.float64))
        assert np.all(difference <= bound + 2.0**-8 * np.abs(np.asarray(wide, np.float64)))
    # With a per-tensor FP8 operand (a non-power-of-two scale to apply) the product stays float32.
    fp8 = quantize_fp8(jax.random.normal(kc, (2, 40, 512)), elem="e4m3")
    assert jax.eval_shape(
        lambda x, y: backends.fp8_matmul(x, y, jnp.float8_e4m3fn, jnp.bfloat16), a, fp8
    ).dtype == (jnp.float32)


def test_fp8_product_mx_times_per_tensor_fp8():
    ka, kc = jax.random.split(jax.random.key(2))
    a = _mx(ka, (1, 32, 256))
    for elem in ("e4m3", "e5m2"):
        c = jax.jit(quantize_fp8, static_argnames="elem")(jax.random.normal(kc, (1, 24, 256)) * 3, elem=elem)
        assert backends.fp8_supports(a, c) and backends.fp8_supports(c, a)
        assert not backends.fp8_supports(a, c, jnp.float8_e4m3fnuz)  # FNUZ does not mix with OCP FP8
        for lhs, rhs in ((a, c), (c, a)):
            got = np.asarray(fp8_matmul_jit(lhs, rhs, jnp.float8_e4m3fn), np.float64)
            emulated = np.asarray(matmul_jit(lhs, rhs, backend="emulate"), np.float64)
            lhs_deq = np.asarray(dequantize_jit(lhs), np.float64)
            rhs_deq = np.asarray(dequantize_jit(rhs), np.float64)
            kinds = ("mx", "fp8") if lhs is a else ("fp8", "mx")
            bound, _ = _fp8_vs_emulate_bound(lhs_deq, rhs_deq, kinds)
            # CPU: plus the rounding of the float32 multiply by 1/scale, applied in a different place.
            slack = 1e-7 * np.abs(emulated) if ON_CPU else 0.0
            assert np.all(np.abs(got - emulated) <= bound + slack), (elem, kinds)


def test_fp8_backend_falls_back_for_unfoldable_operands():
    """MXFP8 (E4M3 elements) and plain operands run as emulate under backend='fp8' (same jaxpr)."""
    ka, kc = jax.random.split(jax.random.key(3))
    a = quantize_mx(jax.random.normal(ka, (1, 16, 64)), elem="e4m3", scale_mode="ceil")
    c = quantize_mx(jax.random.normal(kc, (1, 16, 64)), elem="e4m3", scale_mode="ceil")
    assert not backends.fp8_supports(a, c)
    got = matmul_jit(a, c, backend="fp8")
    np.testing.assert_array_equal(got, matmul_jit(a, c, backend="emulate"))


def test_fp8_gemm_is_one_fp8_dot():
    """The traced fp8 GEMM is one dot_general of float8_e4m3fn operands (no dequantized operand)."""
    ka, kc = jax.random.split(jax.random.key(4))
    a, c = _mx(ka, (1, 32, 128)), _mx(kc, (1, 16, 128))
    jaxpr = jax.make_jaxpr(lambda x, y: backends.matmul(x, y, backend="fp8"))(a, c)
    dots = [e for e in jaxpr.jaxpr.eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 1
    assert all(v.aval.dtype == jnp.float8_e4m3fn for v in dots[0].invars)


# ----------------------------------------------------------------------------------------------------
# end to end: every MXFP4 preset, forward and both gradients


MXFP4_PRESETS = [name for name in PRESETS if name.startswith("mxfp4")]


@pytest.mark.parametrize("preset", MXFP4_PRESETS)
def test_mx_dot_general_fp8_backend_matches_emulate(preset):
    kx, kw, kg, kq = jax.random.split(jax.random.key(5), 4)
    x = jax.random.normal(kx, (4, 16, 96))  # (batch, tokens, features): wgrad contracts 64 tokens
    w = jax.random.normal(kw, (96, 80)) * 0.1
    dy = jax.random.normal(kg, (4, 16, 80))
    dims = (((2,), (0,)), ((), ()))
    results = {}
    for backend in ("emulate", "fp8"):
        recipe = dataclasses.replace(PRESETS[preset], backend=backend)
        key = kq if recipe.needs_key else None

        def fwd_bwd(a, b, g, recipe=recipe, key=key):
            y, vjp = jax.vjp(lambda a, b: mx_dot_general(a, b, dims, recipe=recipe, key=key), a, b)
            return (y, *vjp(g))

        results[backend] = jax.jit(fwd_bwd)(x, w, dy)
    for name, got, want in zip(("y", "dx", "dw"), results["fp8"], results["emulate"], strict=True):
        got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
        # Same quantized operands, same products; only the float32 summation order may differ.
        scale = np.abs(want).max()
        rtol = 1e-5 if ON_CPU else GPU_RTOL
        np.testing.assert_allclose(got, want, rtol=0, atol=rtol * scale, err_msg=f"{preset} {name}")
