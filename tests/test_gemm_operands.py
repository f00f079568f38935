"""The fused quantizer wired into mx_dot_general (Recipe.quantizer): the same GEMM operands and the
same products as the reference path (pad, move the contraction last, rotate, quantize), bit for bit.

Inputs are bf16, as in training: the rotation's products are then exact and its float32 sums of 16 or
32 terms exact too (the exponents of one block span far less than float32's 24 bits), so the fused
butterfly and the reference's matmul give the same rotated values and the comparison can be exact.
"""

import dataclasses

import jax
import jax.numpy as jnp
import long_lane
import numpy as np
import pytest

from fp4jax.ops import get_recipe, mx_dot_general, quantized_dot
from fp4jax.ops.kernels import backends, fold, fused_quantize
from fp4jax.ops.quantize import MXArray
from fp4jax.ops.recipes import QuantSpec

M, K, N = 64, 96, 80  # x (M, K) @ w (K, N): Fprop contracts K, Dgrad N, Wgrad M (tokens)
DIMS = (((1,), (0,)), ((), ()))


def _inputs(seed=0, m=M, k=K, n=N):
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((m, k)) * np.exp(rng.standard_normal((m, 1)))  # rows of different scales
    w = rng.standard_normal((k, n)) * 0.05
    dy = rng.standard_normal((m, n)) * 1e-3
    return (jnp.asarray(t, jnp.bfloat16) for t in (x, w, dy))


def _layer(recipe, backend, quantizer):
    rec = dataclasses.replace(get_recipe(recipe), backend=backend, quantizer=quantizer)
    key = jax.random.key(3) if rec.needs_key else None

    @jax.jit
    def run(x, w, dy):
        y, vjp = jax.vjp(lambda a, b: mx_dot_general(a, b, DIMS, recipe=rec, key=key), x, w)
        return (y, *vjp(dy))

    return run


def _assert_same_products_as_reference(setting, recipe, backend, inputs):
    """y, dx and dw with Recipe.quantizer=setting equal the reference path's, bit for bit."""
    inputs = tuple(inputs)
    want = _layer(recipe, backend, "reference")(*inputs)
    got = _layer(recipe, backend, setting)(*inputs)
    for name, g, r in zip(("y", "dx", "dw"), got, want, strict=True):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(r, np.float32), err_msg=name)


# Each rule once: H16 and random signs, SR's random bits, MX with E4M3 elements, MX meeting FP8 GEMMs,
# on the back end that multiplies MXArrays (emulate) and the one that takes them folded (fp8).
@pytest.mark.parametrize(
    "recipe, backend",
    [
        ("mxfp4_full_h16", "emulate"),
        ("mxfp4_full_sr", "emulate"),
        ("mxfp8", "emulate"),
        ("mxfp4_full_h16", "fp8"),
        ("mxfp4_full_rht", "fp8"),
        ("mxfp4_fprop", "fp8"),
        ("mxfp6_e2m3_full_h16", "fp8"),  # E2M3 folded by the fused quantizer
        ("mxfp6_e3m2_full", "emulate"),
    ],
)
def test_fused_wiring_gives_the_reference_products(recipe, backend):
    _assert_same_products_as_reference("xla", recipe, backend, _inputs())


@pytest.mark.skipif(
    not fused_quantize.pallas_supports(
        (256, 512), -1, QuantSpec(kind="mx"), get_recipe("mxfp4_full_h16").fprop.rotation
    ),
    reason="needs one NVIDIA GPU (where the compiled Pallas kernels run)",
)
@pytest.mark.parametrize(
    "recipe, backend",
    [
        ("mxfp4_full_h16", "fp8"),
        ("mxfp4_full", "fp8"),
        ("mxfp4_full_h16", "emulate"),
        ("mxfp4_full_sr_prescale", "fp8"),
        ("mxfp4_full_rht", "fp8"),
        ("mxfp6_e2m3_full_h16", "fp8"),
        ("mxfp6_e3m2_full", "emulate"),
    ],
)
def test_pallas_wiring_gives_the_reference_products(recipe, backend):
    """The compiled kernels in all three GEMMs (every axis a multiple of 256: every operand takes them)."""
    _assert_same_products_as_reference("pallas", recipe, backend, _inputs(2, m=256, k=512, n=256))


@long_lane.parametrize(  # the default lane: SR on emulate; the long lane: prescale and random signs on fp8
    "recipe, backend",
    [("mxfp4_full_sr", "emulate"), ("mxfp4_full_sr_prescale", "fp8"), ("mxfp4_full_rht", "fp8")],
)
def test_pallas_kernels_in_interpret_mode_give_the_reference_products(recipe, backend, monkeypatch):
    """quantizer="pallas" with the kernels in interpret mode, as if they ran here: every MX operand of
    all three GEMMs takes them (stochastic rounding with and without prescale, random signs per call),
    and y, dx, dw equal the reference path's bit for bit."""
    impls = []
    rotate_quantize = fused_quantize.rotate_quantize

    def interpreted(*args, **kwargs):
        impls.append(kwargs["impl"])
        return rotate_quantize(*args, interpret=True, **kwargs)

    monkeypatch.setattr(fused_quantize, "pallas_supports", lambda *args, **kwargs: True)
    monkeypatch.setattr(fused_quantize, "rotate_quantize", interpreted)
    _assert_same_products_as_reference("pallas", recipe, backend, _inputs())
    assert impls == ["pallas"] * 6  # two operands per GEMM, three GEMMs, traced once


@pytest.mark.parametrize("axis", [-1, -2])
def test_fused_operands_equal_the_reference_operands(axis):
    """Operand level, both layouts, both output forms: the fused MXArray equals the reference's field by
    field, and its fold for the fp8 back end equals fold_mx_to_fp8 of the reference MXArray."""
    x, _, dy = _inputs(1)
    gemm = get_recipe("mxfp4_full_h16").wgrad if axis == -2 else get_recipe("mxfp4_full_h16").fprop
    a, c = (x[None], dy[None]) if axis == -2 else (x[None], x[None, : M // 2])
    key = jax.random.key(5)

    def operands(backend, quantizer):  # jitted: op by op, each quantizer step would compile on its own
        quantize = lambda a, c, key: quantized_dot.quantize_gemm_operands(
            a, axis, c, axis, gemm, key, (None, None), backend=backend, quantizer=quantizer
        )
        return jax.jit(quantize)(a, c, key)

    ref = operands("emulate", "reference")
    mx, folded = operands("emulate", "xla"), operands("fp8", "xla")
    for r, m, f in zip(ref, mx, folded, strict=True):
        assert isinstance(r, MXArray) and isinstance(m, MXArray) and isinstance(f, fold.FoldedOperand)
        for field in ("data", "scale"):
            np.testing.assert_array_equal(
                np.asarray(getattr(m, field)).view(np.uint8), np.asarray(getattr(r, field)).view(np.uint8)
            )
        want = jax.jit(fold.fold_mx_to_fp8)(r)
        np.testing.assert_array_equal(np.asarray(f.data).view(np.uint8), np.asarray(want.data).view(np.uint8))
        np.testing.assert_array_equal(np.asarray(f.row_exponent), np.asarray(want.row_exponent))


def test_quantizer_folds_only_for_the_fp8_back_ends_foldable_gemms():
    e2m1 = QuantSpec(kind="mx", elem="e2m1")
    e4m3_mx = QuantSpec(kind="mx", elem="e4m3")
    fp8 = QuantSpec(kind="fp8", elem="e4m3")
    plain = QuantSpec()
    assert backends.quantizer_folds(e2m1, e2m1, "fp8")
    assert backends.quantizer_folds(e2m1, fp8, "fp8") and backends.quantizer_folds(fp8, e2m1, "fp8")
    assert not backends.quantizer_folds(e2m1, e2m1, "emulate")
    assert not backends.quantizer_folds(e2m1, e2m1, "native")
    assert not backends.quantizer_folds(e4m3_mx, e4m3_mx, "fp8")  # MXFP8 does not fold into one E4M3 grid
    assert not backends.quantizer_folds(e2m1, plain, "fp8")


def test_a_folded_operand_on_another_back_end_is_one_clear_error():
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 16, 64)), jnp.float32)
    q = fused_quantize.rotate_quantize(x, spec=QuantSpec(kind="mx", elem="e2m1"), out="fp8_fold", impl="xla")
    with pytest.raises(TypeError, match="fp8 back end only"):
        backends.matmul(q, q, backend="emulate")


@pytest.mark.parametrize("supported", [True, False])
def test_which_quantizer_the_gemms_use(supported, monkeypatch):
    """auto and pallas: the kernels where they run, else the reference path; xla: the fused XLA
    formulation everywhere; reference: the reference path; plain and FP8 operands: the reference path
    always."""
    monkeypatch.setattr(fused_quantize, "pallas_supports", lambda *args, **kwargs: supported)
    mx, fp8 = QuantSpec(kind="mx", elem="e2m1"), QuantSpec(kind="fp8", elem="e4m3")
    rotation = get_recipe("mxfp4_full_h16").fprop.rotation
    kernels = "pallas" if supported else None
    expected = {"auto": kernels, "pallas": kernels, "xla": "xla", "reference": None}
    for setting, want in expected.items():
        choose = lambda spec, setting=setting: quantized_dot._fused_impl(
            (1, 256, 256), -1, spec, rotation, setting
        )
        assert choose(mx) == want, setting
        assert choose(fp8) is None and choose(QuantSpec()) is None


def test_the_prescales_are_undone_by_one_multiply_by_the_float32_reciprocal():
    """mxfp4_tseng's backward GEMMs prescale both operands by 3/4: multiply_gemm_operands undoes 9/16 on
    the float32 product as one multiply by float32(16/9), one rounding (docs/numerics.md; the bit-exact
    literature tests of test_mx_dot.py build it so). A correctly rounded division by 9/16 differs from it
    on about a tenth of these outputs, but XLA compiles a division by a constant into this very multiply
    (and on a CPU any float32 division into a multiply by the reciprocal), so the bits here cannot tell the
    two apart: the traced program is checked too, the product's one operation a multiply by float32(16/9).
    """
    gemm = get_recipe("mxfp4_tseng").dgrad
    assert (gemm.lhs.prescale, gemm.rhs.prescale) == (0.75, 0.75)
    rng = np.random.default_rng(0)
    a, c = (jnp.asarray(rng.standard_normal((1, rows, 128)), jnp.float32) for rows in (64, 48))
    quantize = lambda a, c, key: quantized_dot.quantize_gemm_operands(  # noqa: E731
        a, -1, c, -1, gemm, key, (None, None), backend="emulate", quantizer="reference"
    )
    qa, qc = jax.jit(quantize)(a, c, jax.random.key(1))  # op by op, each quantizer step compiled alone
    product = np.asarray(
        backends.matmul(qa, qc, backend="emulate", precision=jax.lax.Precision.HIGHEST, out_dtype=jnp.float32)
    )
    reciprocal = np.float32(16 / 9)
    assert (product * reciprocal != product / np.float32(9 / 16)).mean() > 0.05  # where a divide would differ

    def undone(qa, qc):
        return quantized_dot.multiply_gemm_operands(qa, qc, gemm, backend="emulate")

    np.testing.assert_array_equal(np.asarray(undone(qa, qc)), product * reciprocal)
    eqns = jax.make_jaxpr(undone)(qa, qc).jaxpr.eqns
    last_dot = max(i for i, e in enumerate(eqns) if e.primitive.name == "dot_general")
    (undo,) = eqns[last_dot + 1 :]
    constants = [np.float32(v.val) for v in undo.invars if hasattr(v, "val")]
    assert undo.primitive.name == "mul" and constants == [reciprocal], undo
