"""The format table (fp4jax.ops.quant_formats) drives every format: each row's spec quantizes through its
kind's entry to the row's element, block and scale, and its GEMM equals the dequantized operands' product."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.ops import mx_dot_general
from fp4jax.ops.kernels import backends, fold
from fp4jax.ops.quant_formats import FORMATS, KINDS, format_of
from fp4jax.ops.recipes import GemmSpec, QuantSpec, Recipe


def _spec(row) -> QuantSpec:
    return QuantSpec(kind=row.kind, elem=row.elem)


@functools.partial(jax.jit, static_argnums=0)
def _quantized(spec: QuantSpec, x):
    """(the quantized array, its dequantized float32 values): one compiled program per spec and shape, not
    the quantizer's few hundred ops compiled one by one (NVFP4's took 7 s)."""
    q = spec.quant_kind.quantize(x, spec, None, None)
    return q, q.dequantize(jnp.float32)


@pytest.mark.parametrize("name", sorted(FORMATS))
def test_each_row_quantizes_and_multiplies_as_it_says(name):
    row = FORMATS[name]
    spec = _spec(row)
    assert format_of(spec) is row and spec.format is row
    assert spec.block_size == (row.block_size or spec.quant_kind.default_block_size)
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((2, 32, 64)), jnp.float32)
    q, values = _quantized(spec, x)
    assert isinstance(q, KINDS[row.kind].array_type)
    if row.block_size is not None:
        assert q.scale.shape[-1] == 64 // row.block_size and q.block_size == row.block_size
    values = np.asarray(values)
    row_max = np.max(np.abs(np.asarray(x)), axis=-1, keepdims=True)
    assert np.all(np.abs(values - np.asarray(x)) <= row_max / 4)  # within the coarsest grid's half-step
    # the GEMM: y = x w, each operand quantized along K by the row's spec, multiplied by emulate
    w = jnp.asarray(rng.standard_normal((64, 48)), jnp.float32)
    recipe = Recipe(fprop=GemmSpec(spec, spec), backend="emulate", quantizer="reference")
    got = jax.jit(mx_dot_general, static_argnums=2, static_argnames="recipe")(
        x[0], w, (((1,), (0,)), ((), ())), recipe=recipe
    )
    qa = _quantized(spec, x[:1])[1][0]
    qc = _quantized(spec, w.T[None])[1][0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(qa) @ np.asarray(qc).T, rtol=1e-5, atol=1e-5)


def test_the_fold_column_is_the_folds_rule():
    folded = {row.elem for row in FORMATS.values() if row.backends.get("fp8") == "fold"}
    assert folded == set(fold.FOLDED_ELEMS)
    for row in FORMATS.values():
        assert backends.fp8_folds(_spec(row)) == (row.backends.get("fp8") == "fold"), row.name
