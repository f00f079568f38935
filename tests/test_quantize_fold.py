"""fold.quantize_fold: the fp8 back end's operand straight from x, bit for bit the two-step path.

The reference here is the library's own two steps, quantize_mx then fold_mx_to_fp8, each of which is
checked against the independent slow references in mx_reference.py (test_quantize.py, test_fold.py);
this file checks that the one-pass formulation and its wiring into mx_dot_general change no bit.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.ops import quantize, quantized_dot
from fp4jax.ops.kernels import backends, fold
from fp4jax.ops.recipes import MXFP4, MXFP4_SR, MXFP4_SR_PRESCALE, MXFP8, get_recipe


def _inputs() -> np.ndarray:
    """(2, 40, 256) float32, rows of: many binades apart, outliers, blocks far below their row's top
    (flushed), special values, all-zero rows and blocks, float32 subnormals, exact rounding ties."""
    rng = np.random.default_rng(7)
    spread = rng.standard_normal((24, 256)) * np.exp2(rng.integers(-40, 40, (24, 1)))
    outliers = rng.standard_normal((16, 256))
    outliers[::3, 5] *= 2.0**12
    wide = rng.standard_normal((12, 256)) * np.exp2(np.repeat(rng.integers(-30, 4, (12, 8)), 32, axis=1))
    special = rng.standard_normal((16, 256))
    special[1, 7], special[2, 40], special[3, 64] = np.nan, np.inf, -np.inf
    special[4] = 0.0
    special[5, :32] = 0.0
    special[6] = rng.standard_normal(256) * 2.0**-140  # float32 subnormals
    special[7, :32] = -1e-45
    ties = rng.integers(-12, 13, (12, 256)) * 0.25  # many exact rounding ties
    return np.concatenate([spread, outliers, wide, special, ties]).astype(np.float32).reshape(2, 40, 256)


def _assert_same_fold(got: fold.FoldedOperand, want: fold.FoldedOperand) -> None:
    np.testing.assert_array_equal(np.asarray(got.data).view(np.uint8), np.asarray(want.data).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(got.row_exponent), np.asarray(want.row_exponent))
    assert int(got.flushed_blocks) == int(want.flushed_blocks)


@pytest.mark.parametrize("scale_mode", ["floor", "even", "ceil"])
@pytest.mark.parametrize("rounding", ["nearest_even", "nearest_away"])
@pytest.mark.parametrize("fp8_dtype", [jnp.float8_e4m3fn, jnp.float8_e4m3fnuz])
def test_quantize_fold_equals_quantize_then_fold(scale_mode, rounding, fp8_dtype):
    spec = dataclasses.replace(MXFP4, scale_mode=scale_mode, rounding=rounding)
    flushed = 0
    for dtype in (jnp.float32, jnp.bfloat16):
        x = jnp.asarray(_inputs(), dtype)
        mx = quantize.quantize_mx(x, axis=-1, elem="e2m1", scale_mode=scale_mode, rounding=rounding)
        want = fold.fold_mx_to_fp8(mx, fp8_dtype=fp8_dtype)
        _assert_same_fold(fold.quantize_fold(x, spec, fp8_dtype=fp8_dtype), want)
        flushed += int(want.flushed_blocks)
    assert flushed > 0  # the out-of-window rule was exercised


def test_quantize_fold_block_size_16():
    spec = dataclasses.replace(MXFP4, block_size=16)
    x = jnp.asarray(_inputs())
    want = fold.fold_mx_to_fp8(quantize.quantize_mx(x, axis=-1, block_size=16, scale_mode="even"))
    _assert_same_fold(fold.quantize_fold(x, spec), want)


def test_quantize_fold_takes_only_what_it_can_fold():
    assert fold.can_quantize_fold(MXFP4)
    for spec in (MXFP4_SR, MXFP4_SR_PRESCALE, MXFP8):
        assert not fold.can_quantize_fold(spec)
        with pytest.raises(ValueError, match="quantize_fold takes an MX E2M1 spec"):
            fold.quantize_fold(jnp.ones((2, 32)), spec)
    with pytest.raises(ValueError, match="not a multiple of block_size 32"):
        fold.quantize_fold(jnp.ones((2, 48)), MXFP4)


# ----------------------------------------------------------------------------------------------------
# the wiring: mx_dot_general on the fp8 back end


@pytest.mark.parametrize(
    "preset, direct_gemms",
    [
        ("mxfp4_full", {"fprop", "dgrad", "wgrad"}),
        ("mxfp4_full_h16", {"fprop", "dgrad", "wgrad"}),
        ("mxfp4_full_sr", {"fprop", "dgrad", "wgrad"}),  # targeted; its SR operands fold in two steps
        ("mxfp4_fprop", {"fprop"}),
        ("fp8", set()),
    ],
)
def test_fold_target_per_gemm(preset, direct_gemms, monkeypatch):
    recipe = get_recipe(preset)
    for fp8_dtype in (jnp.float8_e4m3fn, jnp.float8_e4m3fnuz):
        monkeypatch.setattr(backends, "device_fold_dtype", lambda d=fp8_dtype: d)
        for stage in ("fprop", "dgrad", "wgrad"):
            target = quantized_dot._fold_target(getattr(recipe, stage), "fp8")
            assert (target is not None) == (stage in direct_gemms), (preset, stage, fp8_dtype)
            if target is not None:
                assert jnp.dtype(target) == jnp.dtype(fp8_dtype)
            assert quantized_dot._fold_target(getattr(recipe, stage), "emulate") is None


@pytest.mark.parametrize("preset", ["mxfp4_full", "mxfp4_full_h16", "mxfp4_full_sr", "mxfp4_fprop"])
def test_direct_fold_changes_no_bit_of_the_gemms(preset, monkeypatch):
    """Value and both gradients on the fp8 back end, with and without folding while quantizing."""
    recipe = dataclasses.replace(get_recipe(preset), backend="fp8")
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((2, 40, 96)), jnp.bfloat16)
    w = jnp.asarray(rng.standard_normal((96, 72)) * 0.1, jnp.float32)
    dims = (((2,), (0,)), ((), ()))
    key = jax.random.key(5)

    def loss(x, w):
        y = quantized_dot.mx_dot_general(
            x, w, dims, recipe=recipe, key=key, preferred_element_type=jnp.float32
        )
        return jnp.sum(y * jnp.cos(y))

    direct = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
    monkeypatch.setattr(quantized_dot, "_fold_target", lambda gemm, backend: None)
    two_step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1)))(x, w)
    for got, want in zip(jax.tree.leaves(direct), jax.tree.leaves(two_step), strict=True):
        np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
