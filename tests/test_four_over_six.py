"""Four-over-Six (quantize_nvfp4(four_over_six=...)) bit for bit against formats_reference's independent
transcription of Transformer Engine's nvfp4_4over6, on the NVFP4 tests' adversarial tensors (E2M1 and
E4M3 ties, subnormal and zero block scales, saturating scales, float32's extremes, all-zero tensors) and
blocks made for it: both candidates exact (an error tie: map-to-6 kept), map-to-4 strictly better, and
NaN/Inf blocks."""

from __future__ import annotations

import functools

import formats_reference as fref
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from test_nvfp4 import CASES

from fp4jax.ops.nvfp4 import quantize_nvfp4

F32 = np.float32


@functools.partial(jax.jit, static_argnames=("block_2d", "measure"))
def _q46(x, *, block_2d=False, measure="mse"):
    return quantize_nvfp4(x, axis=-1, block_2d=block_2d, four_over_six=measure)


def _same_f32(got, want) -> np.ndarray:
    got, want = np.asarray(got, F32), np.asarray(want, F32)
    return (got.view(np.uint32) == want.view(np.uint32)) | (np.isnan(got) & np.isnan(want))


def _assert_matches(q, r: fref.RefNVFP4, what: str):
    assert np.asarray(q.global_scale).view(np.uint32) == F32(r.s_enc).view(np.uint32), what
    same = _same_f32(q.scale.astype(jnp.float32), r.scales)
    assert same.all(), f"{what}: {(~same).sum()} block scales differ, first {np.argwhere(~same)[0]}"
    same = _same_f32(q.block_values(), r.block_values)
    assert same.all(), f"{what}: {(~same).sum()} values q * s_b differ, first {np.argwhere(~same)[0]}"
    same = _same_f32(q.dequantize(), r.dequantize())
    assert same.all(), f"{what}: dequantized values differ at {np.argwhere(~same)[:4].tolist()}"


def made_for_four_over_six(seed: int) -> np.ndarray:
    """(32, 64) with amax 1536, so S_enc = 1 and a block with maximum 6 * 2^j has the exact candidate
    scales 2^j (map-to-6) and 1.5 * 2^j (map-to-4), and every value q * s_b * amax / 1536 is exact: blocks
    on both grids ({0, 1.5, 3, 6} * 2^j: both errors 0, a tie, map-to-6 kept), blocks on map-to-4's grid
    only ({0.75, 2.25, 4.5, 6} * 2^j: map-to-4 strictly better), an all-zero block, and random blocks
    across 12 binades. Rows of the first kind are blocks 1-6, the second 7-12, zeros 13."""
    rng = np.random.default_rng(seed)
    first = rng.uniform(-1, 1, 16) * 1536
    first[0] = 1536
    blocks = [first]
    for values in ([0, 1.5, 3, 6], [0.75, 2.25, 4.5, 6]):
        for j in (-5, -2, 0, 1, 3, 5):
            row = rng.choice(values, 16) * rng.choice([-1.0, 1.0], 16)
            row[0] = 6.0
            blocks.append(row * 2.0**j)
    blocks.append(np.zeros(16))
    while len(blocks) < 128:
        blocks.append(rng.standard_normal(16) * 2.0 ** rng.uniform(-12, 8))
    return np.stack(blocks).astype(F32).reshape(32, 64)


ALL_CASES = {**CASES, "made_for_4over6": lambda: made_for_four_over_six(7)}


@pytest.mark.parametrize("measure", ["mse", "mae"])
@pytest.mark.parametrize("case", sorted(ALL_CASES))
def test_1d_blocks_match_the_reference(case, measure):
    x = ALL_CASES[case]()
    _assert_matches(_q46(jnp.asarray(x), measure=measure), fref.quantize_nvfp4_4over6(x, 1, measure), case)


@pytest.mark.parametrize("case", ["made_for_4over6", "ties_k0", "odd_scales", "random"])
def test_2d_tiles_match_the_reference(case):
    x = ALL_CASES[case]()
    _assert_matches(_q46(jnp.asarray(x), block_2d=True), fref.quantize_nvfp4_4over6(x, 16, "mse"), case)


def test_map_to_4_is_chosen_where_it_is_better_and_ties_keep_map_to_6():
    x = made_for_four_over_six(7)
    q = _q46(jnp.asarray(x))
    scales = np.asarray(q.scale.astype(jnp.float32)).reshape(-1)
    exponents = np.log2(np.abs(x).reshape(-1, 16).max(-1)[1:13] / 6)
    np.testing.assert_array_equal(scales[1:7], 2.0 ** exponents[:6])  # ties: map-to-6
    np.testing.assert_array_equal(scales[7:13], 1.5 * 2.0 ** exponents[6:])  # map-to-4 is exact there
    assert scales[13] == 0
    # ... and over the whole tensor, less error than the standard rule (jitted: eagerly the standard
    # quantizer's ops compiled one by one, 80 programs)
    dequantized = jax.jit(
        lambda v, rule: quantize_nvfp4(v, four_over_six=rule).dequantize(), static_argnums=1
    )
    err6 = np.sum((np.asarray(dequantized(jnp.asarray(x), None)) - x) ** 2)
    for measure in ("mse", "mae"):
        err46 = np.sum((np.asarray(dequantized(jnp.asarray(x), measure)) - x) ** 2)
        assert err46 < err6, measure


def test_nonfinite_blocks_get_a_nan_scale_and_spare_the_rest():
    x = made_for_four_over_six(3)
    x[0, 3], x[5, 40], x[9, 17] = np.nan, np.inf, -np.inf
    q = _q46(jnp.asarray(x))
    nan_blocks = np.isnan(np.asarray(q.scale.astype(jnp.float32)))
    assert nan_blocks.sum() == 3 and nan_blocks[0, 0] and nan_blocks[5, 2] and nan_blocks[9, 1]
    _assert_matches(q, fref.quantize_nvfp4_4over6(x, 1, "mse"), "nonfinite")


def test_four_over_six_refuses_stochastic_rounding_and_unknown_measures():
    with pytest.raises(ValueError, match="use rounding='nearest_even' or four_over_six=None"):
        quantize_nvfp4(jnp.ones((2, 16)), rounding="stochastic", key=jax.random.key(0), four_over_six="mse")
    with pytest.raises(ValueError, match="unknown four_over_six error 'max'"):
        quantize_nvfp4(jnp.ones((2, 16)), four_over_six="max")
