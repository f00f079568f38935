"""mx_dot_general's operands: what each back end is fed equals the reference quantizer bit for bit.

Every GEMM quantizes its two operands through fused_quantize.rotate_quantize, one pass per operand, in
the layout the GEMM needs (row-wise: contraction on the last axis; column-wise: on the middle axis,
written transposed) and in the form the back end consumes (MXArray; fold.FoldedOperand for the fp8
back end). The reference is the unfused path written out here: move the contraction axis last, zero-pad
it, rotation.rotate_blocks, quantize_mx (and fold_mx_to_fp8), with the same keys; for nearest rounding
also the independent numpy quantizer of tests/mx_reference.py.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import mx_reference as ref
import numpy as np
import pytest

from fp4jax.ops import mx_dot_general, quantize
from fp4jax.ops import quantized_dot as qd
from fp4jax.ops.kernels import backends, fold
from fp4jax.ops.recipes import PRESETS
from fp4jax.ops.rotation import random_signs, rotate_blocks

B, M, K, N = 2, 48, 80, 64  # K and M are padded (to 96 and 64) by every MX recipe
STAGES = ("fprop", "dgrad", "wgrad")


def _inputs(seed: int = 0):
    rng = np.random.default_rng(seed)

    def heavy(*shape):
        v = rng.standard_normal(shape) * np.exp(rng.standard_normal(shape[:-1] + (1,)))
        v[..., 3] *= 50  # an outlier channel
        return jnp.asarray(v, jnp.float32).astype(jnp.bfloat16)

    return heavy(B, M, K), heavy(B, N, K), heavy(B, M, N)  # x_bmk, w_bnk, dy_bmn


def _stage_operands(stage, x, w, dy):
    """(a, a_axis, c, c_axis): the GEMM table of quantized_dot (contraction on axis -1 or -2)."""
    return {"fprop": (x, -1, w, -1), "dgrad": (dy, -1, w, -2), "wgrad": (x, -2, dy, -2)}[stage]


def _reference_operand(v, axis, spec, gemm, signs, key, fold_it):
    v = v if axis == -1 else jnp.swapaxes(v, -1, -2)
    pad = -v.shape[-1] % gemm.contraction_multiple
    v = jnp.pad(v, ((0, 0), (0, 0), (0, pad)))
    if gemm.rotation.kind != "none":
        v = rotate_blocks(v, axis=-1, size=gemm.rotation.size, signs=signs)
    if spec.kind == "fp8":
        return quantize.quantize_fp8(v, elem=spec.elem)
    if spec.kind == "none":
        return v
    kw = dict(elem=spec.elem, block_size=spec.block_size, scale_mode=spec.scale_mode, rounding=spec.rounding)
    mx = quantize.quantize_mx(v, axis=-1, key=key, prescale=spec.prescale, **kw)
    if spec.rounding != "stochastic" and spec.prescale == 1:  # the independent numpy quantizer too
        independent = ref.quantize_mx(np.asarray(v), axis=-1, **kw)
        np.testing.assert_array_equal(np.asarray(mx.dequantize(), np.float64), independent.dequantize64())
        np.testing.assert_array_equal(np.asarray(mx.scale_exponent()), independent.exp)
    return fold.fold_mx_to_fp8(mx) if fold_it else mx


def _bits(a) -> np.ndarray:
    a = jnp.asarray(a)
    if jnp.dtype(a.dtype) == jnp.dtype(jnp.float4_e2m1fn):
        a = a.astype(jnp.float32)  # exact, keeps the sign of zero
    width = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32}[jnp.dtype(a.dtype).itemsize]
    return np.asarray(jax.lax.bitcast_convert_type(a, width))


def _assert_same(got, want):
    assert type(got) is type(want), (type(got), type(want))
    got_leaves, want_leaves = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(got_leaves) == len(want_leaves)
    for g, w in zip(got_leaves, want_leaves, strict=True):
        assert g.shape == w.shape and g.dtype == w.dtype, (g.shape, w.shape, g.dtype, w.dtype)
        np.testing.assert_array_equal(_bits(g), _bits(w))
    if isinstance(want, quantize.MXArray):
        assert (got.axis, got.block_size) == (want.axis, want.block_size)


def _reference_pair(stage, gemm, x, w, dy, gemm_key, backend):
    a, a_axis, c, c_axis = _stage_operands(stage, x, w, dy)
    rotation_key, a_key, c_key = jax.random.split(gemm_key, 3)
    signs = None
    if gemm.rotation.kind == "random":
        sign_key = jax.random.key(gemm.rotation.seed) if gemm.rotation.signs == "per_run" else rotation_key
        signs = random_signs(sign_key, gemm.rotation.size)
    fold_it = backends.quantizer_folds(gemm.lhs, gemm.rhs, backend)
    return (
        _reference_operand(a, a_axis, gemm.lhs, gemm, signs, a_key, fold_it),
        _reference_operand(c, c_axis, gemm.rhs, gemm, signs, c_key, fold_it),
    )


# Plain MXFP4, H16, random signs, SR with prescale, MXFP8 (E4M3 elements: not folded), FP8 per-tensor.
PRESET_NAMES = (
    "mxfp4_full",
    "mxfp4_full_h16",
    "mxfp4_full_rht",
    "mxfp4_full_sr_prescale",
    "mxfp8",
    "mxfp4_fprop",
)


@pytest.mark.parametrize("backend", ["emulate", "native", "fp8"])
@pytest.mark.parametrize("name", PRESET_NAMES)
def test_gemm_operands_equal_the_reference_on_each_backend(backend, name):
    recipe = PRESETS[name]
    x, w, dy = _inputs()
    key = jax.random.key(11)
    for stage in STAGES:
        gemm = getattr(recipe, stage)
        a, a_axis, c, c_axis = _stage_operands(stage, x, w, dy)
        got = qd.quantize_gemm_operands(a, a_axis, c, c_axis, gemm, key, (None, None), backend=backend)
        want = _reference_pair(stage, gemm, x, w, dy, key, backend)
        for g, wnt in zip(got, want, strict=True):
            _assert_same(g, wnt)
        # The form each back end consumes: folded E4M3 for fp8 (E2M1 x E2M1), MX elsewhere.
        both_e2m1 = all(s.kind == "mx" and s.elem == "e2m1" for s in (gemm.lhs, gemm.rhs))
        if gemm.lhs.kind == "mx":
            form = fold.FoldedOperand if backend == "fp8" and both_e2m1 else quantize.MXArray
            assert isinstance(got[0], form), (stage, type(got[0]))


@pytest.mark.parametrize("backend", ["emulate", "fp8"])
def test_mx_dot_general_feeds_each_gemm_these_operands(backend, monkeypatch):
    """Through the custom_vjp: Fprop row-wise (x, W along K), Dgrad (dy row-wise, W column-wise along
    N), Wgrad column-wise (x, dy along tokens), each with the GEMM's own key."""
    recipe = dataclasses.replace(PRESETS["mxfp4_full_rht"], backend=backend)
    x, w, dy = _inputs(seed=1)
    x2, w2, g2 = x[0], jnp.swapaxes(w[0], 0, 1), dy[0]  # y[m, n] = sum_k x[m, k] w[k, n]
    seen = []
    real = backends.matmul

    def spy(a, c, **kw):
        seen.append((a, c))
        return real(a, c, **kw)

    monkeypatch.setattr(backends, "matmul", spy)
    key = jax.random.key(5)
    dims = (((1,), (0,)), ((), ()))
    out, vjp = jax.vjp(lambda a, b: mx_dot_general(a, b, dims, recipe=recipe, key=key), x2, w2)
    vjp(g2.astype(out.dtype))
    assert len(seen) == 3
    for i, (stage, (qa, qc)) in enumerate(zip(STAGES, seen, strict=True)):
        gemm_key = jax.random.fold_in(key, i)
        want = _reference_pair(stage, getattr(recipe, stage), x[:1], w[:1], dy[:1], gemm_key, backend)
        _assert_same(qa, want[0])
        _assert_same(qc, want[1])
