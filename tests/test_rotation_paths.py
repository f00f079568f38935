"""Rotation kinds declare their implementations: a kind written for the reference path alone is refused by
the fused quantizer (with a reason) and quantized on the reference path, never run as a Hadamard."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.ops import mx_dot_general, quantize_mx, rotation
from fp4jax.ops.kernels import fused_quantize, probes
from fp4jax.ops.recipes import MXFP4, ROTATIONS, GemmSpec, Recipe, RotationKind, RotationSpec

NVIDIA = probes.DeviceDescription("nvidia", "NVIDIA H200", "9.0")
DIMS = (((1,), (0,)), ((), ()))  # x (T, K) @ w (K, N)

# The GEMMs and their references run jitted (one program each; eagerly, every op of the quantizer was
# compiled on its own, 7 s for a test): what is checked is which path a recipe takes, decided as the
# function is traced either way.
_mx_dot = jax.jit(functools.partial(mx_dot_general, dimension_numbers=DIMS), static_argnames="recipe")


@functools.partial(jax.jit, static_argnames="reference_operand")
def _reference_gemm(x, w, reference_operand):
    """x @ w with both operands quantized by reference_operand (a (rows, K) array contracting on K)."""
    return reference_operand(x) @ reference_operand(w.T).T


def _reverse_blocks(x, *, axis, size, signs=None):
    """The toy rotation: each block of `size` reversed (a permutation, so orthogonal; no Hadamard)."""
    assert signs is None and axis == -1
    blocks = x.astype(jnp.float32).reshape(*x.shape[:-1], -1, size)
    return blocks[..., ::-1].reshape(x.shape)


@pytest.fixture
def toy():
    ROTATIONS["reverse"] = RotationKind("reverse", _reverse_blocks)  # reference path only
    yield RotationSpec(kind="reverse", size=16)
    del ROTATIONS["reverse"]


def test_the_fused_path_refuses_a_kind_it_does_not_implement(toy):
    shape = (256, 256)
    assert fused_quantize.pallas_supports(
        shape, -1, MXFP4, RotationSpec("deterministic"), device=NVIDIA, device_count=1
    )
    assert not fused_quantize.pallas_supports(shape, -1, MXFP4, toy, device=NVIDIA, device_count=1)
    assert "not 'reverse'" in fused_quantize.fused_refusal(MXFP4, toy)
    with pytest.raises(ValueError, match="rotates by none, deterministic, random only, not 'reverse'"):
        fused_quantize.rotate_quantize(jnp.ones(shape), spec=MXFP4, rotation=toy, impl="xla")


@pytest.mark.parametrize("quantizer", ["xla", "pallas", "auto"])
def test_a_reference_only_rotation_is_never_run_as_a_hadamard(toy, quantizer):
    """Whatever the quantizer setting, the GEMM is the toy rotation's reference: both operands reversed in
    blocks of 16, quantized with quantize_mx, multiplied exactly; and not the Hadamard's result."""
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((32, 64)) * np.exp(rng.standard_normal((32, 64))), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 48)), jnp.float32)

    def recipe(rotation):
        gemm = GemmSpec(MXFP4, MXFP4, rotation)
        return Recipe(fprop=gemm, backend="emulate", quantizer=quantizer)

    got = _mx_dot(x, w, recipe=recipe(toy))
    want = _reference_gemm(x, w, _reversed_operand)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want, np.float32))
    hadamard = _mx_dot(x, w, recipe=recipe(dataclasses.replace(toy, kind="deterministic")))
    assert not np.array_equal(np.asarray(got), np.asarray(hadamard))


def _reversed_operand(v):
    """The toy rotation's reference operand: reversed in blocks of 16, quantized, dequantized."""
    return quantize_mx(_reverse_blocks(v, axis=-1, size=16), **_mx_args()).dequantize(jnp.float32)


def _mx_args():
    return dict(
        elem=MXFP4.elem, block_size=MXFP4.block_size, scale_mode=MXFP4.scale_mode, rounding=MXFP4.rounding
    )


def test_an_unknown_rotation_kind_is_a_one_line_error():
    with pytest.raises(ValueError, match="unknown rotation kind 'reverse'"):
        RotationSpec(kind="reverse")


MXFP4_OAS = dataclasses.replace(MXFP4, scale_mode="oas")


def test_the_fused_path_refuses_the_oas_scale_rule():
    """qwix's rule is reference-only: the fused quantizer (XLA, Pallas) says so, never runs another rule."""
    shape = (256, 256)
    assert not fused_quantize.pallas_supports(
        shape, -1, MXFP4_OAS, RotationSpec(), device=NVIDIA, device_count=1
    )
    assert "not scale_mode='oas'" in fused_quantize.fused_refusal(MXFP4_OAS, RotationSpec())
    with pytest.raises(ValueError, match="scale rules floor, even, ceil only"):
        fused_quantize.rotate_quantize(jnp.ones(shape), spec=MXFP4_OAS, rotation=RotationSpec(), impl="xla")


@pytest.mark.parametrize("quantizer", ["xla", "pallas", "auto"])
def test_an_oas_gemm_takes_the_reference_path_whatever_the_quantizer(quantizer):
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((32, 64)) * np.exp(rng.standard_normal((32, 64))), jnp.float32)
    w = jnp.asarray(rng.standard_normal((64, 48)), jnp.float32)
    gemm = GemmSpec(MXFP4_OAS, MXFP4_OAS, RotationSpec("deterministic"))
    got = _mx_dot(x, w, recipe=Recipe(fprop=gemm, quantizer=quantizer))
    want = _reference_gemm(x, w, _oas_operand)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want, np.float32))


def _oas_operand(v):
    """The OAS GEMM's reference operand: H16-rotated, quantized with the oas rule, dequantized."""
    rotated = rotation.rotate_blocks(v, axis=-1, size=16)
    return quantize_mx(rotated, **dict(_mx_args(), scale_mode="oas")).dequantize(jnp.float32)
