"""NVFP4 in the per-GEMM contract: QuantSpec(kind="nvfp4"), every GEMM's operands, the presets.

Held to tests/formats_reference.py (independent numpy, written from docs/numerics.md): every operand of
Fprop, Dgrad and Wgrad bit for bit (q * s_b and S_dec, 1D blocks and the weight's 16 x 16 tiles,
nearest and stochastic rounding, with the recipes' rotations) on adversarial blocks; the layer's
forward and both gradients within float32 accumulation (1e-5 |A||B| alpha, as tests/test_mx_dot.py);
stochastic rounding's mean within 5 standard errors of its exact expectation; the 2D weight's Fprop and
Dgrad quantizations equal; and the back ends that cannot multiply NVFP4 (fp8, native) giving emulate's
bits. The quantizer alone: tests/test_nvfp4.py.
"""

from __future__ import annotations

import dataclasses
import functools
from unittest import mock

import formats_reference as fref
import jax
import jax.numpy as jnp
import lanes
import mx_reference as ref
import numpy as np
import pytest

from fp4jax.ops import (
    PRESETS,
    GemmSpec,
    QuantSpec,
    Recipe,
    mx_dot_general,
    quantize_mx,
    random_signs,
)
from fp4jax.ops.kernels import backends, probes
from fp4jax.ops.nvfp4 import NVFP4Array
from fp4jax.ops.quantized_dot import quantize_gemm_operands
from fp4jax.ops.recipes import NVFP4, NVFP4_SR, NVFP4_W2D, RHT16_PER_RUN, ROTATIONS
from fp4jax.ops.rotation import rotate_blocks

DIMS = (((1,), (0,)), ((), ()))
GEMMS = ("fprop", "dgrad", "wgrad")
NVFP4_PRESETS = ("nvfp4_fprop", "nvfp4_fprop_dgrad", "nvfp4_full", "nvfp4_full_h16", "nvfp4_nvidia")
RTOL = 1e-5  # float32 accumulation, as tests/lanes.FLOAT32_RTOL


# ----------------------------------------------------------------------------------------------------
# inputs


def adversarial(rows: int, cols: int, seed: int) -> np.ndarray:
    """(rows, cols) float32, blocks of 16 along rows, whose amax 2688 makes S_enc = 1: blocks with amax
    6 * 2^j (s_b = 2^j exactly) holding every E2M1 midpoint times 2^j (ties) and the grid, E4M3-subnormal
    scales (j = -7, -9), an all-zero and a -0 block, one outlier per block over tiny values, float32
    subnormals; the rest Gaussian with an outlier column."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)) * 3
    x[:, 5] *= 40  # an outlier channel
    mids = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]
    blocks = []
    for j in (4, 0, -3, -7, -9):
        for sign in (1, -1):
            blocks.append(np.array([6.0] + [sign * m for m in mids] + [0, 0.5, 1, 1.5, 2, 3, 4, -6]) * 2.0**j)
    blocks.append(np.zeros(16))
    blocks.append(-np.zeros(16))
    outlier = rng.standard_normal(16) * 2.0**-20
    outlier[9] = -300.0
    blocks.append(outlier)
    sub = rng.standard_normal(16) * 1e-3
    sub[:4] = [1e-45, -3e-40, 1e-39, -1.1e-38]
    blocks.append(sub)
    per_row = cols // 16
    for i, block in enumerate(blocks[: rows * per_row - 1]):
        r, b = divmod(i + 1, per_row)
        x[r, 16 * b : 16 * b + 16] = block
    x[0, 0] = 2688.0  # amax: S_enc = 1
    return x.astype(np.float32)


def coarse(shape, seed: int, scale: float) -> np.ndarray:
    """Multiples of scale / 4 below 25 * scale, with an outlier row and column: rotations by H16
    (entries +-1/4, any signs) are exact in float32, so rotated operands can be compared bit for bit."""
    rng = np.random.default_rng(seed)
    x = rng.integers(-100, 101, shape) / 4.0
    x[3] *= 16
    x[:, 1] *= 8
    return (x * scale).astype(np.float32)


def layer(seed: int = 0, t: int = 32, k: int = 64, n: int = 48, kind: str = "coarse"):
    """x (T, K), w (K, N), dy (T, N)."""
    if kind == "adversarial":
        x = adversarial(t, k, seed)
        w = adversarial(n, k, seed + 1).T.copy() / 64
    else:
        x, w = coarse((t, k), seed, 1.0), coarse((k, n), seed + 1, 1 / 64)
    dy = coarse((t, n), seed + 2, 1 / 8)
    return x, w, dy


# ----------------------------------------------------------------------------------------------------
# the reference GEMMs of the contract


def _row_views(x, w, dy):
    """Each GEMM's (lhs, rhs) as row-wise (F, C) arrays, contraction last, in GemmSpec order."""
    return {"fprop": (x, w.T), "dgrad": (dy, w), "wgrad": (x.T, dy.T)}


def stage_rtol(gemm: GemmSpec, k: int) -> float:
    """This lane's accumulation bound for one GEMM of contraction length k: the FP8 stages of the
    nvfp4_fprop* rungs run as FP8 GEMMs, on a GPU on FP8 tensor cores (tests/lanes.py)."""
    if gemm.lhs.kind == "nvfp4":
        return RTOL
    return lanes.gemm_rtol("fp8", "fp8", k)


def _gemm_draws(gemm: GemmSpec, key):
    if key is None:
        return None, None, None
    rotation_key, a_key, c_key = jax.random.split(key, 3)
    signs = None
    if gemm.rotation.kind == "random":
        sign_key = rotation_key if gemm.rotation.signs == "per_call" else jax.random.key(gemm.rotation.seed)
        signs = np.asarray(random_signs(sign_key, gemm.rotation.size))
    return signs, a_key, c_key


def ref_operand(a: np.ndarray, spec: QuantSpec, key, expected: bool = False):
    """(values to multiply float64, their per-tensor factor, RefNVFP4 or None) of a padded, rotated (F, C)
    operand. expected: a stochastic operand's expectation E[q] s_b = y s_b instead of a draw."""
    assert spec.kind == "nvfp4", spec
    if spec.rounding == "ms_eden":  # one uint32 per block, drawn over (1, F, groups, blocks per group)
        groups = (1, a.shape[0], a.shape[1] // 128, 8)
        q, _ = fref.quantize_ms_eden(a, np.asarray(jax.random.bits(key, groups, jnp.uint32)))
        return q.block_values, q.s_dec, q
    if spec.scale_mode.startswith("4over6_"):
        q = fref.quantize_nvfp4_4over6(a, 16 if spec.block_2d else 1, spec.scale_mode.removeprefix("4over6_"))
        return q.block_values, q.s_dec, q
    sr = spec.rounding == "stochastic"
    bits = np.asarray(jax.random.bits(key, (1, *a.shape), jnp.uint32))[0] if sr and not expected else None
    q = fref.quantize_nvfp4(a, 16 if spec.block_2d else 1, bits)
    values = q.block_values
    if sr and expected:
        scales = np.repeat(np.repeat(q.scales, 16, axis=-1), 16 if spec.block_2d else 1, axis=-2)
        values = np.copysign(q.y, a) * scales
    return values, q.s_dec, q


def ref_gemm(a, c, gemm: GemmSpec, key, expected: bool = False):
    """(out float64, error scale |A||B| alpha) of out[m, n] = sum_k a[m, k] c[n, k] under `gemm`."""
    k = a.shape[-1]
    kp = -(-k // gemm.contraction_multiple) * gemm.contraction_multiple
    a, c = (np.pad(v, [(0, 0), (0, kp - k)]) for v in (a, c))
    signs, a_key, c_key = _gemm_draws(gemm, key)
    if gemm.rotation.kind != "none":
        a, c = (fref.rotate(v, gemm.rotation.size, signs) for v in (a, c))
    if gemm.lhs.kind != "nvfp4":  # the FP8 stages of the nvfp4_fprop* rungs: the MX reference's GEMM
        ops = [ref.Operand("fp8", s.elem) for s in (gemm.lhs, gemm.rhs)]
        out, scale = ref.quantized_dot(a, "mk", c, "nk", "mn", *ops, return_abs=True)[:2]
        return out.astype(np.float64), scale
    va, da, _ = ref_operand(a, gemm.lhs, a_key, expected)
    vc, dc, _ = ref_operand(c, gemm.rhs, c_key, expected)
    alpha = float(fref.gemm_alpha(da, dc))
    return (va @ vc.T) * alpha, (np.abs(va) @ np.abs(vc).T) * alpha


def ref_layer(recipe: Recipe, x, w, dy, key, expected: bool = False):
    """[(y, scale), (dx, scale), (dw, scale)] in the layer's layouts."""
    views = _row_views(x, w, dy)
    out = []
    for i, stage in enumerate(GEMMS):
        gemm_key = None if key is None else jax.random.fold_in(key, i)
        value, scale = ref_gemm(*views[stage], getattr(recipe, stage), gemm_key, expected)
        out.append((value, scale))
    return out


def fwd_bwd(recipe, x, w, dy, key=None):
    f = lambda a, b: mx_dot_general(a, b, DIMS, recipe=recipe, key=key)
    y, vjp = jax.vjp(f, x, w)
    return (y, *vjp(dy))


def assert_close(got, want, scale, what, rtol=RTOL):
    got = np.asarray(got, np.float64)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    err = np.abs(got - want)
    bad = ~(err <= rtol * scale + 1e-30)
    worst = (err / scale).max()
    assert not bad.any(), f"{what}: {bad.sum()} outside; first {np.argwhere(bad)[0]}, max {worst:.3g}"


def f32_bits(v) -> np.ndarray:
    return np.asarray(v, np.float32).view(np.uint32)


# ----------------------------------------------------------------------------------------------------
# the spec


def test_nvfp4_spec_defaults_and_presets():
    assert QuantSpec(kind="nvfp4").block_size == 16 and QuantSpec(kind="mx").block_size == 32
    assert QuantSpec(kind="mx") == QuantSpec(kind="mx", block_size=32)
    assert NVFP4_SR.needs_key and not NVFP4.needs_key and NVFP4_W2D.block_2d
    for rung in ("fprop", "fprop_dgrad", "full", "full_h16"):  # the MXFP4 rungs' structure, NVFP4 operands
        mx, nv = PRESETS[f"mxfp4_{rung}"], PRESETS[f"nvfp4_{rung}"]
        for g_mx, g_nv in zip(mx.gemms, nv.gemms, strict=True):
            assert g_nv.rotation == g_mx.rotation
            for s_mx, s_nv in ((g_mx.lhs, g_nv.lhs), (g_mx.rhs, g_nv.rhs)):
                assert s_nv == (NVFP4 if s_mx.kind == "mx" else s_mx), (rung, s_nv)
    nvidia = PRESETS["nvfp4_nvidia"]
    assert (nvidia.fprop.lhs, nvidia.fprop.rhs, nvidia.fprop.rotation.kind) == (NVFP4, NVFP4_W2D, "none")
    assert (nvidia.dgrad.lhs, nvidia.dgrad.rhs, nvidia.dgrad.rotation.kind) == (NVFP4_SR, NVFP4_W2D, "none")
    assert (nvidia.wgrad.lhs, nvidia.wgrad.rhs, nvidia.wgrad.rotation) == (NVFP4, NVFP4_SR, RHT16_PER_RUN)


@pytest.mark.parametrize(
    "build, words",
    [
        (lambda: QuantSpec(kind="nvfp4", elem="e2m3"), "NVFP4 elements are E2M1"),
        (lambda: QuantSpec(kind="nvfp4", block_size=32), "NVFP4 blocks are 16 elements, got block_size=32"),
        (lambda: QuantSpec(kind="nvfp4", block_size=24), "block_size must be a positive power of two"),
        (lambda: QuantSpec(kind="nvfp4", rounding="nearest_away"), "NVFP4 rounds nearest_even or stochastic"),
        (lambda: QuantSpec(kind="nvfp4", scale_mode="even"), "scale_mode='even' is an MX scale rule"),
        (lambda: QuantSpec(kind="nvfp4", prescale=0.75), "prescale applies to MX operands only"),
        (lambda: QuantSpec(kind="mx", block_2d=True), "block_2d (16 x 16 tiles) applies to NVFP4 operands"),
        (lambda: QuantSpec(kind="nvfp4", block_2d=1), "block_2d must be True or False"),
        (lambda: QuantSpec(kind="nvfp5"), "unknown quantization kind 'nvfp5'"),
        (lambda: Recipe(wgrad=GemmSpec(NVFP4_W2D, NVFP4)), "wgrad.lhs has block_2d=True"),
        (lambda: Recipe(fprop=GemmSpec(NVFP4_W2D, NVFP4_W2D)), "fprop.lhs has block_2d=True"),
    ],
)
def test_bad_specs_raise_one_line_value_errors(build, words):
    with pytest.raises(ValueError) as err:
        build()
    assert words in str(err.value) and "\n" not in str(err.value), str(err.value)


def test_2d_weight_tiles_need_features_in_multiples_of_16():
    """Refused while tracing (shapes only: nothing is computed or compiled)."""
    x, w = jax.ShapeDtypeStruct((8, 32), jnp.float32), jax.ShapeDtypeStruct((32, 40), jnp.float32)  # N = 40
    recipe = Recipe(fprop=GemmSpec(NVFP4, NVFP4_W2D))
    with pytest.raises(ValueError, match="2D NVFP4 tiles need both of the weight's GEMM axes") as err:
        jax.eval_shape(lambda a, b: mx_dot_general(a, b, DIMS, recipe=recipe), x, w)
    assert "\n" not in str(err.value)


# ----------------------------------------------------------------------------------------------------
# every GEMM's operands, bit for bit


@functools.partial(jax.jit, static_argnums=0)
def _gemm_operands(recipe: Recipe, x, w, dy, key):
    """{stage: (qa, qc)} as mx_dot_general quantizes them: x (T, K) row-wise in Fprop and column-wise in
    Wgrad; W (K, N) column-wise in Fprop and row-wise in Dgrad (a Dense kernel, read in place)."""
    x, w, dy = (jnp.asarray(v)[None] for v in (x, w, dy))
    views = {"fprop": (x, -1, w, -2), "dgrad": (dy, -1, w, -1), "wgrad": (x, -2, dy, -2)}
    out = {}
    for i, stage in enumerate(GEMMS):
        gemm_key = None if key is None else jax.random.fold_in(key, i)
        out[stage] = quantize_gemm_operands(
            *views[stage], getattr(recipe, stage), gemm_key, (None, None), backend="emulate", quantizer="auto"
        )
    return out


def _operands_and_rotated_rows(recipe: Recipe, x, w, dy, key):
    """(_gemm_operands' result, the (1, F, C) rows the library rotated before quantizing, in the order it
    rotated them: each rotating GEMM's lhs, then rhs), from one compiled program. A rotation that is not
    exact in float32 gives the reference its input only this way on a GPU, whose float32 GEMM may sum
    the products of a separately compiled rotation in another order."""
    rotated = []

    def recording(v, **kwargs):
        out = rotate_blocks(v, **kwargs)
        rotated.append(out)
        return out

    patched = {k: dataclasses.replace(r, reference=recording) for k, r in ROTATIONS.items() if r.reference}
    with mock.patch.dict(ROTATIONS, patched):
        body = lambda *a: (_gemm_operands.__wrapped__(recipe, *a), rotated)  # noqa: E731
        return jax.jit(body)(x, w, dy, key)


@jax.jit
def _read_back(q: NVFP4Array):
    """(S_dec, q * s_b in bfloat16 as the GEMM multiplies it, the dequantized operand) of a quantized one."""
    return q.decode_scale(), q.block_values(jnp.bfloat16), q.dequantize()


@pytest.mark.parametrize(
    "name, kind",
    [
        ("nvfp4_full", "adversarial"),
        ("nvfp4_nvidia", "adversarial"),
        ("nvfp4_nvidia", "coarse"),
        ("nvfp4_4over6", "adversarial"),
        ("nvfp4_4over6", "coarse"),
        ("nvfp4_quartet2", "adversarial"),
    ],
)
def test_every_gemms_operands_match_the_reference_bit_for_bit(name, kind):
    """q * s_b (bf16 in the GEMM, exact) and S_dec of both operands of Fprop, Dgrad and Wgrad: 1D blocks,
    the weight's 2D tiles, dy's stochastic rounding, Wgrad's fixed-sign H16 (exact on these inputs)."""
    recipe, key = PRESETS[name], jax.random.key(11)
    sizes = dict(t=128, n=128) if name == "nvfp4_quartet2" else {}  # MS-EDEN's groups of 128
    x, w, dy = layer(3, kind=kind, **sizes)
    got, rotated = _operands_and_rotated_rows(recipe, x, w, dy, key)
    rotated = iter(rotated)
    views = _row_views(x, w, dy)
    checked = 0
    for i, stage in enumerate(GEMMS):
        gemm = getattr(recipe, stage)
        signs, a_key, c_key = _gemm_draws(gemm, jax.random.fold_in(key, i))
        rows = views[stage]
        library_rows = [np.asarray(next(rotated)[0]) for _ in rows] if gemm.rotation.rotates else None
        if gemm.rotation.size == 128:  # H128 is not exact in float32: the library's rotated rows, quantized
            rows = library_rows
        elif gemm.rotation.kind != "none":
            if kind != "coarse":
                continue  # rotations of these inputs are not exact in float32: checked on the coarse ones
            rows = [fref.rotate(v, gemm.rotation.size, signs) for v in rows]
        sides = zip(got[stage], rows, (gemm.lhs, gemm.rhs), (a_key, c_key), "ac", strict=True)
        for q, v, spec, k, side in sides:
            assert isinstance(q, NVFP4Array) and q.block_2d == spec.block_2d, (stage, side)
            values, s_dec, r = ref_operand(v, spec, k)
            what = f"{name}/{kind} {stage} {side}"
            decode_scale, block_values, dequantized = _read_back(q)
            np.testing.assert_array_equal(f32_bits(decode_scale), f32_bits(s_dec), err_msg=what)
            got_values = np.asarray(block_values[0], np.float64)
            same = (got_values == values) | (np.isnan(got_values) & np.isnan(values))
            assert same.all(), f"{what}: {(~same).sum()} elements differ, first {np.argwhere(~same)[0]}"
            np.testing.assert_array_equal(f32_bits(dequantized[0]), f32_bits(r.dequantize()), err_msg=what)
            checked += 1
    assert checked == (4 if kind != "coarse" and name in ("nvfp4_nvidia", "nvfp4_4over6") else 6)
    assert next(rotated, None) is None  # every operand the library rotated was accounted for


@pytest.mark.parametrize("case", ["float32_max", "non_finite"])
def test_extreme_operands_match_the_reference(case):
    """The largest finite float32 values (S_enc below 1, scales saturating) and NaN/Inf (their blocks,
    and only theirs, NaN), in every GEMM of nvfp4_full."""
    x, w, dy = layer(5, kind="adversarial")
    if case == "float32_max":
        x = (x.astype(np.float64) * (float(fref.FLT_MAX) / 2688.0)).astype(np.float32)
    else:
        x[2, 17], x[9, 40] = np.nan, -np.inf
    got = _gemm_operands(PRESETS["nvfp4_full"], x, w, dy, None)
    views = _row_views(x, w, dy)
    for stage in ("fprop", "wgrad"):  # x's two GEMMs
        q, v = got[stage][0], views[stage][0]
        values, s_dec, _ = ref_operand(v, NVFP4, None)
        got_values = np.asarray(q.block_values()[0], np.float64)
        assert ((got_values == values) | (np.isnan(got_values) & np.isnan(values))).all(), (case, stage)
        np.testing.assert_array_equal(f32_bits(q.decode_scale()), f32_bits(s_dec))
        if case == "non_finite":
            assert np.isnan(values).sum() == 2 * 16, stage  # two blocks, along K (Fprop) or T (Wgrad)


def test_2d_weight_is_the_same_in_fprop_and_dgrad():
    """nvfp4_nvidia's W in 16 x 16 tiles: Fprop (contracting K) and Dgrad (contracting N) multiply the
    same values, bit for bit; with 1D blocks (nvfp4_full) they differ."""
    x, w, dy = layer(4, kind="adversarial")
    for name, same in (("nvfp4_nvidia", True), ("nvfp4_full", False)):
        ops = _gemm_operands(PRESETS[name], x, w, dy, jax.random.key(0))
        w_fprop = np.asarray(ops["fprop"][1].dequantize()[0]).T  # (N, K) -> (K, N)
        w_dgrad = np.asarray(ops["dgrad"][1].dequantize()[0])  # (K, N)
        equal = (f32_bits(w_fprop) == f32_bits(w_dgrad)).all()
        assert equal == same, name


# ----------------------------------------------------------------------------------------------------
# the presets: forward and both gradients


@pytest.mark.parametrize("name", NVFP4_PRESETS)
def test_presets_forward_and_gradients_match_the_reference(name):
    recipe = PRESETS[name]
    key = jax.random.key(21) if recipe.needs_key else None
    x, w, dy = layer(6)
    got = jax.jit(lambda *a: fwd_bwd(recipe, *a))(x, w, dy, key)
    want = ref_layer(recipe, x, w, dy, key)
    exact = (x @ w, dy @ w.T, x.T @ dy)
    views = _row_views(x, w, dy)
    for g, (value, scale), e, stage in zip(got, want, exact, GEMMS, strict=True):
        what = {"fprop": "y", "dgrad": "dx", "wgrad": "dw"}[stage]
        rtol = stage_rtol(getattr(recipe, stage), views[stage][0].shape[-1])
        assert_close(g, value, scale, f"{name} {what}", rtol=rtol)
        assert np.median(np.abs(value - e) / np.maximum(scale, 1e-30)) > 1e-4, (name, what)  # quantized


def test_wgrad_pads_the_token_axis():
    """T = 40 tokens: Wgrad's contraction is zero-padded to 48 (three blocks of 16)."""
    recipe = PRESETS["nvfp4_full"]
    x, w, dy = layer(7, t=40)
    got = jax.jit(lambda *a: fwd_bwd(recipe, *a))(x, w, dy)
    value, scale = ref_layer(recipe, x, w, dy, None)[2]
    assert_close(got[2], value, scale, "wgrad T=40")


def test_non_finite_input_spoils_only_its_blocks_outputs():
    x, w, dy = layer(8)
    x[5, 20] = np.nan
    y, dx, dw = jax.jit(lambda *a: fwd_bwd(PRESETS["nvfp4_full"], *a))(x, w, dy)
    y, dw = np.asarray(y), np.asarray(dw)
    assert np.isnan(y[5]).all() and np.isfinite(np.delete(y, 5, axis=0)).all()
    assert np.isnan(dw[20]).all() and np.isfinite(np.delete(dw, 20, axis=0)).all()  # Wgrad: x's T block
    assert np.isfinite(np.asarray(dx)).all()  # Dgrad reads dy and W only


def test_mixed_operands_nvfp4_times_fp8_mx_and_plain():
    """An NVFP4 operand against per-tensor FP8 (its 1 / scale), MXFP4 and a plain float32 operand."""
    x, w, _ = layer(9)
    mx4 = PRESETS["mxfp4_full"].fprop.rhs
    for other in (QuantSpec(kind="fp8", elem="e4m3"), mx4, QuantSpec()):
        recipe = Recipe(fprop=GemmSpec(NVFP4, other))
        product = jax.jit(functools.partial(mx_dot_general, dimension_numbers=DIMS, recipe=recipe))
        y = np.asarray(product(x, w), np.float64)
        va, da, _ = ref_operand(x, NVFP4, None)
        if other.kind == "fp8":
            data, scale = ref.quantize_fp8(w.T, elem="e4m3")
            vc, mult = data.astype(np.float64), float(np.float32(1.0) / np.float32(scale))
        elif other.kind == "mx":
            vc = ref.quantize_mx(w.T, elem="e2m1", block_size=32, scale_mode="even").dequantize64()
            mult = 1.0
        else:
            vc, mult = w.T.astype(np.float64), 1.0
        want = (va @ vc.T) * float(np.float32(da)) * mult
        scale = (np.abs(va) @ np.abs(vc).T) * float(da) * mult
        assert_close(y, want, scale, f"nvfp4 x {other.kind}", rtol=2e-5)


# ----------------------------------------------------------------------------------------------------
# stochastic rounding


def test_stochastic_gradients_are_unbiased():
    """nvfp4_nvidia's Dgrad and Wgrad round dy stochastically: the mean over n = 300 keys of each output is
    within 5 standard errors (plus the float32 scale) of its exact expectation E[q] s_b S_dec products
    (reference, y = min(|x e_b|, 6): SR never saturates below 6), and differs from round-to-nearest."""
    recipe = dataclasses.replace(PRESETS["nvfp4_nvidia"], backend="emulate")
    x, w, dy = layer(10, t=32, k=32, n=32)
    n = 300
    keys = jax.random.split(jax.random.key(1), n)
    run = jax.jit(jax.vmap(lambda k: fwd_bwd(recipe, x, w, dy, k)[1:]))
    samples = [np.asarray(v, np.float64) for v in run(keys)]
    # The expectation: every draw shares the per-run signs; only dy's bits differ.
    want = ref_layer(recipe, x, w, dy, keys[0], expected=True)[1:]
    nearest = ref_layer(PRESETS["nvfp4_full"], x, w, dy, None)[1:]
    for s, (expect, scale), (rne, _), what in zip(samples, want, nearest, ("dgrad", "wgrad"), strict=True):
        mean, sd = s.mean(0), s.std(0, ddof=1)
        bound = 5 * sd / np.sqrt(n) + RTOL * scale
        err = np.abs(mean - expect)
        assert (err <= bound).all(), (what, (err / bound).max())
        assert (sd > 0).mean() > 0.9, what
        assert (np.abs(mean - rne) > bound).any(), what


# ----------------------------------------------------------------------------------------------------
# back ends


@pytest.mark.parametrize("backend", ["fp8", "native"])
def test_backends_without_nvfp4_gemms_multiply_as_emulate(backend):
    """The fold does not take NVFP4 (E4M3 block scales times E2M1 leave E4M3's grid), nor scaled_dot these
    shapes (K not a multiple of 128): both run emulate's GEMM, bit for bit, and the resolved execution
    names them (below)."""
    x, w, dy = layer(12)
    ops = _gemm_operands(PRESETS["nvfp4_nvidia"], x, w, dy, jax.random.key(2))
    for stage, (qa, qc) in ops.items():
        assert not backends.fp8_supports(qa, qc) and not backends.native_supports(qa, qc)
        want = jax.jit(functools.partial(backends.matmul, backend="emulate"))(qa, qc)
        got = jax.jit(functools.partial(backends.matmul, backend=backend))(qa, qc)
        np.testing.assert_array_equal(f32_bits(got), f32_bits(want), err_msg=stage)


@pytest.mark.parametrize("name", ["nvfp4_full", "nvfp4_nvidia"])
def test_native_multiplies_nvfp4_pairs_through_scaled_dot_as_emulate(name):
    """NVFP4 x NVFP4 through jax.lax.scaled_dot (E4M3 scales per 16; the weight's 2D tiles as per-row
    scales; dy's SR and Wgrad's rotation in nvfp4_nvidia) gives emulate's float32 bits on adversarial
    operands, NaN blocks included: the same exact products, summed in float32, times the same alpha."""
    if error := probes.scaled_dot_compile_error():
        pytest.skip(f"scaled_dot does not compile in this process: {error}")
    if jax.default_backend() != "cpu" and not probes.nvfp4_scaled_dot_compiles():
        pytest.skip("XLA does not compile an NVFP4 scaled_dot on this device")
    assert probes.nvfp4_scaled_dot_compiles()  # on the CPU it must
    x, w, dy = layer(13, t=256, k=128, n=128, kind="adversarial")
    x[3, 5] = np.nan
    ops = _gemm_operands(PRESETS[name], x, w, dy, jax.random.key(3))
    for stage, (qa, qc) in ops.items():
        assert backends.native_supports(qa, qc), stage
        want = jax.jit(functools.partial(backends.matmul, backend="emulate"))(qa, qc)
        got = jax.jit(functools.partial(backends.matmul, backend="native"))(qa, qc)
        jaxpr = jax.make_jaxpr(functools.partial(backends.matmul, backend="native"))(qa, qc)
        assert any(e.primitive.name == "scaled_dot" for e in jaxpr.jaxpr.eqns), stage
        assert np.isnan(np.asarray(want)).any() or stage == "dgrad", stage  # x's NaN block reaches the output
        np.testing.assert_array_equal(f32_bits(got), f32_bits(want), err_msg=stage)


GFX950 = probes.DeviceDescription("amd", "MI355X", "gfx950")


BLACKWELL = probes.DeviceDescription("nvidia", "B200", "10.0")


def test_native_leaves_nvfp4_where_scaled_dot_cannot_take_it(monkeypatch):
    """The decision, on described devices (the one the tests run on may take NVFP4 or not)."""
    monkeypatch.setattr(probes, "nvfp4_scaled_dot_compiles", lambda: True)
    monkeypatch.setattr(probes, "describe_device", lambda: BLACKWELL)
    x, w, dy = layer(14, t=256, k=128, n=128)
    qa, qc = _gemm_operands(PRESETS["nvfp4_full"], x, w, dy, None)["fprop"]
    assert backends.native_supports(qa, qc)
    mx = quantize_mx(jnp.asarray(w.T)[None], elem="e2m1")
    assert not backends.native_supports(qa, mx)  # NVFP4 x MX
    monkeypatch.setattr(probes, "nvfp4_scaled_dot_compiles", lambda: False)
    assert not backends.native_supports(qa, qc)  # an XLA without E4M3 block scales (Hopper's)
    monkeypatch.setattr(probes, "nvfp4_scaled_dot_compiles", lambda: True)
    monkeypatch.setattr(probes, "describe_device", lambda: GFX950)
    assert not backends.native_supports(qa, qc)  # gfx950's block-scaled GEMMs take E8M0 scales only


def test_the_resolved_execution_names_nvfp4_operands(monkeypatch):
    from fp4jax.ops.execution import resolve_execution

    monkeypatch.setattr(backends, "check_backend", lambda *a, **k: None)
    monkeypatch.setattr("fp4jax.ops.kernels.probes.run_probes", lambda backend: None)
    monkeypatch.setattr(probes, "nvfp4_scaled_dot_compiles", lambda: True)  # a Blackwell GPU's XLA
    monkeypatch.setattr(probes, "describe_device", lambda: BLACKWELL)
    _, fp8 = resolve_execution("nvfp4_full", backend="fp8")
    _, native = resolve_execution("nvfp4_nvidia", backend="native")
    _, emulate = resolve_execution("nvfp4_full", backend="emulate")
    assert fp8.backend_reason.endswith("; GEMMs with NVFP4 operands run as in emulate (no exact fold)")
    assert "run as in emulate" not in native.backend_reason  # every GEMM is NVFP4 x NVFP4
    assert "run as in emulate" not in emulate.backend_reason
    mixed = dataclasses.replace(
        PRESETS["nvfp4_full"], fprop=dataclasses.replace(PRESETS["nvfp4_full"].fprop, rhs=QuantSpec())
    )
    _, native_mixed = resolve_execution(mixed, backend="native")
    only_pairs = "; GEMMs with NVFP4 operands run as in emulate (native multiplies NVFP4 by NVFP4 only)"
    assert native_mixed.backend_reason.endswith(only_pairs)
    only_nvidia = (
        "run as in emulate (native multiplies NVFP4 on NVIDIA GPUs only, where XLA compiles its scaled_dot)"
    )
    monkeypatch.setattr(probes, "nvfp4_scaled_dot_compiles", lambda: False)  # an XLA without it
    _, native_old_xla = resolve_execution("nvfp4_nvidia", backend="native")
    assert native_old_xla.backend_reason.endswith("; GEMMs with NVFP4 operands " + only_nvidia)
    monkeypatch.setattr(probes, "nvfp4_scaled_dot_compiles", lambda: True)
    monkeypatch.setattr(probes, "describe_device", lambda: GFX950)
    _, native_amd = resolve_execution("nvfp4_nvidia", backend="native")
    assert native_amd.backend_reason.endswith("; GEMMs with NVFP4 operands " + only_nvidia)


def test_gemm_error_statistics_of_nvfp4_operands():
    """gemm_errors' operand statistics on NVFP4 (diagnostics of the nvfp4_* recipes): sat and the block
    scale binades against the reference quantizer's scales."""
    from fp4jax import gemm_errors

    x, w, dy = layer(13)
    gemm = PRESETS["nvfp4_full"].fprop
    stats = jax.jit(lambda a, c: gemm_errors.gemm_stats(a, c, gemm, names=("x", "w")))(x[None], w.T[None])
    for name, v in (("x", x), ("w", w.T)):
        r = fref.quantize_nvfp4(v)
        block_scale = np.repeat(r.scales, 16, axis=-1).astype(np.float32) * r.s_dec  # float32, as measured
        nonzero = v != 0
        want_sat = (np.abs(v) > np.float32(6) * block_scale)[nonzero].mean()
        assert abs(float(stats[f"{name}_sat"]) - want_sat) < 1e-6, name
        binades = np.floor(np.log2(block_scale[nonzero & (block_scale > 0)]))
        assert (float(stats[f"{name}_exp_min"]), float(stats[f"{name}_exp_max"])) == (
            binades.min(),
            binades.max(),
        )
        assert 0 < want_sat < 0.2
