"""fused_quantize equals the reference path bit for bit: rotate, quantize_mx, fold_mx_to_fp8.

The reference path is what quantized_dot runs wherever the Pallas kernels do not, with the rotation
defined once (fused_quantize.hadamard_rotate, checked here against float64 and rotation.rotate_blocks).
Pallas kernels run in interpret mode on CPU; their lowering to Triton IR is checked without a GPU.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import long_lane
import numpy as np
import pytest
from helpers import all_eqns

from fp4jax.ops import formats, quantize
from fp4jax.ops.kernels import fold, probes, threefry, tile_math
from fp4jax.ops.kernels import fused_quantize as fq
from fp4jax.ops.kernels.fused_quantize_pallas import Tile
from fp4jax.ops.recipes import QuantSpec, RotationSpec
from fp4jax.ops.rotation import hadamard, random_signs, rotate_blocks

H16 = RotationSpec(kind="deterministic", size=16)
H32 = RotationSpec(kind="deterministic", size=32)
RANDOM32 = RotationSpec(kind="random", size=32)
RANDOM16 = RotationSpec(kind="random", size=16)
NO_ROTATION = RotationSpec()


def _hard_inputs(rows: int = 64, cols: int = 128, seed: int = 0) -> np.ndarray:
    """Row groups of 8: normal, heavy-tailed, ties, zeros, subnormal, near-max, NaN/Inf, wide range."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((rows, cols)).astype(np.float32)
    g = rows // 8
    x[g : 2 * g] = rng.standard_t(1.2, (g, cols)) * np.exp2(rng.integers(-20, 20, (g, 1)))
    # Ties of E2M1 (odd multiples of half a grid step) under a block maximum 4 * 2^s: same e in all modes.
    mids = np.array([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, -0.25, -2.5, -5.0], np.float32)
    ties = rng.choice(mids, (g, cols)) * np.exp2(rng.integers(-10, 10, (g, cols // 32))).repeat(32, 1)
    ties[:, ::32] = 4.0 * np.exp2(rng.integers(-10, 10, (g, cols // 32)))
    x[2 * g : 3 * g] = ties
    zeros = np.where(rng.random((g, cols)) < 0.5, 0.0, -0.0).astype(np.float32)
    zeros[0, 5] = 1e-3
    zeros[1, 40:48] = -3.0
    x[3 * g : 4 * g] = zeros
    tiny = rng.standard_normal((g, cols)) * 1e-39
    tiny[0, :32] = np.float32(2.0**-127)
    tiny[1, 32:] = np.float32(2.0**-149) * rng.integers(1, 9, cols - 32)
    tiny[2, :] *= 1e-6
    x[4 * g : 5 * g] = tiny
    near = rng.choice([5.9, 6.0, 6.5, 7.0, 7.5, 7.99, 3.0e38, -3.4e38, 1.7e38], (g, cols))
    x[5 * g : 6 * g] = near * np.where(np.abs(near) < 1e30, np.exp2(rng.integers(-3, 3, (g, cols))), 1.0)
    bad = x[6 * g : 7 * g]
    bad[0, 3], bad[1, 70], bad[2, 100] = np.nan, np.inf, -np.inf
    x[6 * g : 7 * g] = bad
    x[7 * g :] = rng.standard_normal((g, cols)) * np.exp2(rng.integers(-40, 8, (g, cols)))
    return x.astype(np.float32)


def _bits(a: jax.Array) -> np.ndarray:
    """Storage bits of any quantized array (distinguishes -0 and NaN payloads)."""
    if jnp.dtype(a.dtype) == jnp.dtype(jnp.float4_e2m1fn):
        a = a.astype(jnp.float32)  # exact; keeps the sign of zero
    width = {1: jnp.uint8, 4: jnp.uint32}[jnp.dtype(a.dtype).itemsize]
    return np.asarray(jax.lax.bitcast_convert_type(a, width))


@functools.partial(jax.jit, static_argnames=("axis", "spec", "rotation", "out"))
def _reference(x, signs, key, *, axis, spec, rotation, out):
    """rotate -> quantize_mx -> fold_mx_to_fp8, in the output orientation (blocks on the last axis)."""
    xt = x if axis == -1 else jnp.swapaxes(x, -1, -2)
    v = xt.astype(jnp.float32)
    if rotation.kind != "none":
        sign_row = None if signs is None else jnp.tile(signs, v.shape[-1] // rotation.size)[None]
        v = fq.hadamard_rotate(v.reshape(-1, v.shape[-1]), rotation.size, sign_row).reshape(v.shape)
    mx = quantize.quantize_mx(
        v,
        axis=-1,
        elem=spec.elem,
        block_size=spec.block_size,
        scale_mode=spec.scale_mode,
        rounding=spec.rounding,
        key=key,
        prescale=spec.prescale,
        rng=spec.rng,
    )
    return mx if out == "mx" else fold.fold_mx_to_fp8(mx)


def _assert_same(got, want):
    if isinstance(want, quantize.MXArray):
        assert (got.axis, got.block_size, got.data.dtype) == (want.axis, want.block_size, want.data.dtype)
        np.testing.assert_array_equal(_bits(got.data), _bits(want.data))
        np.testing.assert_array_equal(_bits(got.scale), _bits(want.scale))
    else:
        np.testing.assert_array_equal(_bits(got.data), _bits(want.data))
        np.testing.assert_array_equal(np.asarray(got.row_exponent), np.asarray(want.row_exponent))
        assert int(got.flushed_blocks) == int(want.flushed_blocks)


def _check(x, *, axis, spec, rotation=NO_ROTATION, out="mx", impl="xla", signs=None, key=None, **config):
    got = fq.rotate_quantize(
        x,
        axis=axis,
        spec=spec,
        rotation=rotation,
        signs=signs,
        key=key,
        out=out,
        impl=impl,
        interpret=impl == "pallas",
        **config,
    )
    want = _reference(x, signs, key, axis=axis, spec=spec, rotation=rotation, out=out)
    _assert_same(got, want)
    return got


# ----------------------------------------------------------------------------------------------------
# the rotation


# Jitted, as the kernels and the XLA path run it (eagerly each butterfly step compiles on its own).
_hadamard_rotate = jax.jit(fq.hadamard_rotate, static_argnums=1)


def test_rotation_is_the_orthonormal_hadamard_to_float32_rounding():
    x = np.random.default_rng(1).standard_normal((16, 64)).astype(np.float32)
    for size in (16, 32):
        exact = (x.astype(np.float64).reshape(-1, size) @ hadamard(size).astype(np.float64)).reshape(x.shape)
        exact = exact * (np.sqrt(size) * np.float64(hadamard(size)[0, 0]))  # the float32 entry's scale
        got = np.asarray(_hadamard_rotate(jnp.asarray(x), size))
        np.testing.assert_allclose(got, exact, rtol=0, atol=4 * np.finfo(np.float32).eps * np.abs(x).max())


def test_rotation_equals_rotate_blocks_where_sums_are_exact():
    # Small integers: every H16 product (x / 4) and partial sum is exact, so any summation order agrees.
    x = np.random.default_rng(2).integers(-64, 64, (8, 64)).astype(np.float32)
    signs = random_signs(jax.random.key(0), 16)
    want = jax.jit(rotate_blocks, static_argnames=("axis", "size"))(x, axis=-1, size=16, signs=signs)
    got = _hadamard_rotate(jnp.asarray(x), 16, jnp.tile(signs, 4)[None])
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_rotation_spellings_give_the_same_bits():
    """The spellings (slices, reductions, parts) agree bit for bit on every lane, and no zero *sum* comes
    out as -0.

    A -0 output is still legitimate where the final multiply by c = hadamard(size)[0, 0] (1/4, 1/sqrt(32))
    underflows a non-zero subnormal sum: a GPU keeps subnormals, so a sum of -2^-149 times 1/4 rounds to
    -0 (IEEE); XLA's CPU flushes subnormal sums to zero first, which the butterflies store as +0, so the
    CPU lane sees no -0 at all. The check is therefore: on CPU none; on a GPU only where the exact
    rotated value is below the smallest subnormal, 2^-149."""
    x_np = _hard_inputs(rows=64, cols=128, seed=8)
    x = jnp.asarray(x_np)

    @functools.partial(jax.jit, static_argnums=2)  # as the kernels run them (eagerly: 177 programs, 4 s)
    def spellings(x, signs, size):
        slices = fq.hadamard_rotate(x, size, signs, spelling="slices")
        reductions = fq.hadamard_rotate(x, size, signs, spelling="reductions")
        # hadamard_parts: part k is element k of every block; interleaved back into the row order.
        parts, sign_parts = ([v[:, k::size] for k in range(size)] for v in (x, signs))
        by_parts = tile_math.hadamard_parts(parts, sign_parts)
        return slices, reductions, jnp.stack(by_parts, axis=-1).reshape(x.shape)

    for size in (16, 32):
        signs = jnp.tile(random_signs(jax.random.key(size), size), 128 // size)[None]
        slices, reductions, by_parts = spellings(x, signs, size)
        # Bits equal, except that a NaN's sign is unspecified (a NaN makes its block NaN either way).
        nan = np.isnan(np.asarray(slices))
        for other in (reductions, by_parts):
            np.testing.assert_array_equal(nan, np.isnan(np.asarray(other)))
            np.testing.assert_array_equal(_bits(slices)[~nan], _bits(other)[~nan])
        negative_zero = _bits(slices) == 0x80000000
        if jax.default_backend() == "cpu":
            assert not np.any(negative_zero)  # zero sums are +0 by definition
        else:
            h = np.asarray(hadamard(size), np.float64)
            signed = (x_np.astype(np.float64) * np.asarray(signs, np.float64)).reshape(-1, size)
            rotated = (signed @ (h / h[0, 0])).reshape(x_np.shape) * float(hadamard(size)[0, 0])
            assert np.all(np.abs(rotated[negative_zero]) < 2.0**-149), rotated[negative_zero]


# ----------------------------------------------------------------------------------------------------
# XLA path


@pytest.mark.parametrize(
    "scale_mode, rounding, axis",
    [
        ("floor", "nearest_even", -1),
        ("floor", "nearest_away", -2),
        ("even", "nearest_even", -2),
        ("even", "nearest_away", -1),
        ("ceil", "nearest_even", -1),
        ("ceil", "nearest_away", -2),
    ],
)
def test_xla_e2m1_matches_reference(scale_mode, rounding, axis):
    x = jnp.asarray(_hard_inputs())
    _check(x, axis=axis, spec=QuantSpec(kind="mx", scale_mode=scale_mode, rounding=rounding))


@pytest.mark.parametrize(
    "scale_mode, rounding, axis",
    [("floor", "nearest_even", -2), ("even", "nearest_even", -1), ("ceil", "nearest_away", -2)],
)
def test_xla_fold_matches_reference(scale_mode, rounding, axis):
    x = jnp.asarray(_hard_inputs(seed=1))
    spec = QuantSpec(kind="mx", scale_mode=scale_mode, rounding=rounding)
    _check(x, axis=axis, spec=spec, out="fp8_fold")


@pytest.mark.parametrize("elem", ["e4m3", "e5m2"])
def test_xla_fp8_elements_match_reference(elem):
    x = jnp.asarray(_hard_inputs(seed=3))
    for scale_mode, axis in (("floor", -1), ("ceil", -2)):
        _check(x, axis=axis, spec=QuantSpec(kind="mx", elem=elem, scale_mode=scale_mode))


def _mxfp6_ties(fmt_name: str, rows: int = 32, cols: int = 256, seed: int = 0) -> np.ndarray:
    """Blocks whose largest element pins the scale (the format's top binade at 2^s) and whose others are
    midpoints of the MXFP6 grid there (ties), grid points and random values, both signs."""
    fmt = formats.get_elem_format(fmt_name)
    rng = np.random.default_rng(seed)
    grid = np.unique(np.arange(64, dtype=np.uint8).view(fmt.code_dtype).astype(np.float64))
    grid = grid[grid >= 0]
    mids = (grid[1:] + grid[:-1]) / 2
    pick = rng.choice(np.concatenate([mids, mids, grid, rng.uniform(0, fmt.max_value, 32)]), (rows, cols))
    pick[:, ::32] = fmt.max_value  # every block's maximum: the block exponent is the same in every mode
    x = pick * np.exp2(rng.integers(-30, 30, (rows, 1))) * np.where(rng.random((rows, cols)) < 0.5, -1, 1)
    return x.astype(np.float32)


@pytest.mark.parametrize("elem", ["e2m3", "e3m2"])
def test_xla_mxfp6_elements_match_reference(elem):
    """MXFP6, held as E4M3 bytes: hard inputs and the grid's ties, every rounding, both layouts."""
    hard, ties = jnp.asarray(_hard_inputs(seed=3)), jnp.asarray(_mxfp6_ties(elem))
    for x in (hard, ties):
        for scale_mode, rounding, axis in (("floor", "nearest_even", -1), ("even", "nearest_away", -2)):
            spec = QuantSpec(kind="mx", elem=elem, scale_mode=scale_mode, rounding=rounding)
            _check(x, axis=axis, spec=spec)
    spec = QuantSpec(kind="mx", elem=elem, rounding="stochastic")
    _check(hard, axis=-1, spec=spec, rotation=H16, key=jax.random.key(4))
    tied = _check(ties, axis=-1, spec=QuantSpec(kind="mx", elem=elem))
    assert tied.data.dtype == jnp.float8_e4m3fn
    if elem in fq.FOLDED_ELEMS:  # E2M3 folds exactly into E4M3 (fold.py): the fused fold, both layouts
        for x, axis in ((hard, -1), (ties, -2)):
            _check(x, axis=axis, spec=QuantSpec(kind="mx", elem=elem, scale_mode="even"), out="fp8_fold")
        _check(hard, axis=-2, spec=spec, rotation=H16, key=jax.random.key(4), out="fp8_fold")


def test_the_e2m3_fold_keeps_blocks_11_binades_below_the_row_top_and_flushes_12():
    """E2M3's window (fold.fold_params: 11 binades into float8_e4m3fn, against E2M1's 14): a block 11
    binades below its row's top block is kept exactly, one 12 below is flushed and counted."""
    x = np.random.default_rng(13).uniform(-0.9, 0.9, (2, 16, 128)).astype(np.float32)
    x[..., ::32] = 1.0  # every block's largest: the same block exponent everywhere
    x[0, 3, 32:64] *= 2.0**-11
    x[1, 5, 64:96] *= 2.0**-12
    spec = QuantSpec(kind="mx", elem="e2m3", scale_mode="even")
    for impl in ("xla", "pallas"):
        folded = _check(jnp.asarray(x), axis=-1, spec=spec, out="fp8_fold", impl=impl)
        assert int(folded.flushed_blocks) == 1, impl
        kept = np.asarray(folded.data[0, 3, 32:64]).astype(np.float32)
        assert np.all(kept != 0), impl  # the block 11 binades down: its values, not zeros


@pytest.mark.parametrize("rotation", [H16, H32, RANDOM32], ids=["h16", "h32", "random32"])
def test_xla_rotated_match_reference(rotation):
    x = jnp.asarray(_hard_inputs(seed=4)).astype(jnp.bfloat16)
    signs = random_signs(jax.random.key(1), rotation.size) if rotation.kind == "random" else None
    spec = QuantSpec(kind="mx", scale_mode="even")
    _check(x, axis=-2, spec=spec, rotation=rotation, signs=signs)
    _check(x, axis=-1, spec=spec, rotation=rotation, out="fp8_fold", signs=signs)


def test_xla_stochastic_rounding_matches_reference_bits():
    x = jnp.asarray(_hard_inputs(seed=5)[:32, :64])
    spec = QuantSpec(kind="mx", rounding="stochastic")
    key = jax.random.key(7)
    # The key matters: the reference draws its bits from it, so ignoring it would not match.
    _check(x, axis=-1, spec=spec, key=key)
    _check(x, axis=-2, spec=spec, rotation=H16, key=key)


@pytest.mark.parametrize("rounding", ["nearest_even", "nearest_away", "stochastic"])
def test_xla_prescale_matches_reference(rounding):
    """QuantSpec.prescale (3/4 in the SR-with-prescale preset): quantize_mx's one float32 multiply."""
    x = jnp.asarray(_hard_inputs(seed=9))
    spec = QuantSpec(kind="mx", scale_mode="even", rounding=rounding, prescale=0.75)
    key = jax.random.key(3) if rounding == "stochastic" else None
    _check(x, axis=-1, spec=spec, key=key)
    _check(x, axis=-2, spec=spec, rotation=H16, key=key)
    _check(x, axis=-2, spec=spec, out="fp8_fold", key=key)
    _check(x, axis=-1, spec=dataclasses.replace(spec, elem="e4m3", scale_mode="ceil"), key=key)


def test_batch_dimensions_and_fold_flushes():
    x = np.random.default_rng(6).standard_normal((2, 32, 64)).astype(np.float32)
    x[0, 1, 32:] *= 2.0**-30  # one block 30 binades below its row's top: flushed by the fold
    spec = QuantSpec(kind="mx")
    row = _check(jnp.asarray(x), axis=-1, spec=spec, out="fp8_fold")
    assert row.data.shape == x.shape and int(row.flushed_blocks) == 1
    column = _check(jnp.asarray(x), axis=-2, spec=spec, out="fp8_fold")
    assert column.data.shape == (2, 64, 32)
    column_pallas = _check(jnp.asarray(x), axis=-2, spec=spec, rotation=H16, impl="pallas")
    assert column_pallas.data.shape == (2, 64, 32)


# ----------------------------------------------------------------------------------------------------
# Pallas (interpret mode on CPU)


# The default lane: rows and columns, each output, rotated or not (cases 0, 3, 10); the long lane: the rest.
@long_lane.parametrize(
    "axis, rotation, scale_mode, rounding, elem, out",
    [
        (-1, NO_ROTATION, "floor", "nearest_even", "e2m1", "mx"),
        (-2, NO_ROTATION, "even", "nearest_even", "e2m1", "mx"),
        (-2, NO_ROTATION, "ceil", "nearest_away", "e4m3", "mx"),
        (-2, H16, "even", "nearest_away", "e2m1", "mx"),
        (-1, RANDOM32, "ceil", "nearest_even", "e2m1", "mx"),
        (-2, RANDOM32, "floor", "nearest_even", "e2m1", "mx"),
        (-2, H32, "even", "nearest_even", "e4m3", "mx"),
        (-1, RANDOM32, "ceil", "nearest_even", "e2m1", "via_mx"),
        (-2, H16, "floor", "nearest_even", "e2m1", "via_mx"),
        (-2, NO_ROTATION, "floor", "nearest_even", "e2m1", "via_mx"),
        (-1, H16, "even", "nearest_even", "e2m1", "one_pass"),
        (-1, RANDOM32, "ceil", "nearest_away", "e2m1", "one_pass"),
        (-1, NO_ROTATION, "floor", "nearest_even", "e2m1", "one_pass"),
        (-2, H16, "even", "nearest_even", "e2m1", "one_pass"),  # columns: one_pass goes via_mx
        (-1, NO_ROTATION, "even", "nearest_even", "e2m3", "mx"),
        (-2, H16, "floor", "nearest_away", "e3m2", "mx"),
        (-2, NO_ROTATION, "ceil", "nearest_even", "e2m3", "mx"),
        (-1, H16, "even", "nearest_even", "e2m3", "one_pass"),
        (-1, NO_ROTATION, "floor", "nearest_away", "e2m3", "via_mx"),
        (-2, RANDOM32, "even", "nearest_even", "e2m3", "via_mx"),
    ],
    default=(0, 3, 10, 15, 19),
    ids=lambda v: f"{v.kind}{v.size}" if isinstance(v, RotationSpec) else str(v),
)
def test_pallas_interpret_matches_reference(axis, rotation, scale_mode, rounding, elem, out):
    """out is "mx", or the fold method ("via_mx" or "one_pass") of an fp8_fold output."""
    spec = QuantSpec(kind="mx", elem=elem, scale_mode=scale_mode, rounding=rounding)
    _check_pallas(axis, rotation, spec, out, seed=7, signs_seed=2)


# The fold of rows that fit one pass goes via the mx kernel where one pass is switched off.
VIA_MX_ROWS = fq.KernelConfig(one_pass_max_row_rotated=0, one_pass_max_row_unrotated=0)


def _check_pallas(axis, rotation, spec, out, *, seed, signs_seed, config=fq.KernelConfig()):
    """The Pallas kernels (interpret mode) against the reference on hard inputs; out is "mx" or the fold
    method of an fp8_fold output ("one_pass" is the default for rows that fit; columns go via_mx)."""
    if out == "via_mx" and axis == -1:
        config = dataclasses.replace(config, one_pass_max_row_rotated=0, one_pass_max_row_unrotated=0)
    x = jnp.asarray(_hard_inputs(rows=32, cols=512, seed=seed))
    signs = random_signs(jax.random.key(signs_seed), rotation.size) if rotation.kind == "random" else None
    out_kind = "mx" if out == "mx" else "fp8_fold"
    _check(
        x, axis=axis, spec=spec, rotation=rotation, out=out_kind, impl="pallas", signs=signs, config=config
    )


def test_pallas_whole_tile_reads_still_match_reference():
    """The mx kernel's other spelling: whole tiles, butterflies over reshaped views (where the rotation
    blocks do not tile the MX block, and unrotated columns with column_parts=0)."""
    x = jnp.asarray(_hard_inputs(rows=32, cols=512, seed=9))
    whole = fq.KernelConfig(column_parts=0)
    for axis in (-1, -2):
        for spec, rotation in (
            (QuantSpec(kind="mx", block_size=16), H32),
            (QuantSpec(kind="mx"), NO_ROTATION),
        ):
            _check(x, axis=axis, spec=spec, rotation=rotation, out="mx", impl="pallas", config=whole)


# The defaults (KernelConfig.split_loads, one_pass_split_loads) are covered by the tests above; these
# are the other ways of loading parts.
MEMORY_ACCESS = {
    "strided": fq.KernelConfig(split_loads=False, one_pass_split_loads=False),
    "split_everywhere": fq.KernelConfig(split_loads=True, one_pass_split_loads=True),
}


# The default lane: the first access on the first case; the long lane every other pair.
@long_lane.parametrize("access", list(MEMORY_ACCESS))
@long_lane.parametrize(
    "axis, rotation, elem, out",
    [
        (-1, H16, "e2m1", "mx"),
        (-2, H16, "e2m1", "mx"),
        (-1, RANDOM32, "e4m3", "mx"),
        (-2, NO_ROTATION, "e2m1", "mx"),  # unrotated columns by parts: the loads are contiguous anyway
        (-1, H16, "e2m1", "one_pass"),
        (-2, H16, "e2m1", "via_mx"),
    ],
    ids=lambda v: f"{v.kind}{v.size}" if isinstance(v, RotationSpec) else str(v),
)
def test_pallas_parts_by_any_memory_access_match_reference(axis, rotation, elem, out, access):
    """Strided or split loads: the same parts, so the reference bits."""
    spec = QuantSpec(kind="mx", elem=elem, scale_mode="even")
    _check_pallas(axis, rotation, spec, out, seed=11, signs_seed=4, config=MEMORY_ACCESS[access])


def test_interleave_puts_part_q_at_position_q_of_each_run():
    from fp4jax.ops.kernels import fused_quantize_pallas as kernels

    parts = [jnp.full((2, 3), q, jnp.int32) + 100 * jnp.arange(3) for q in range(8)]
    got = np.asarray(kernels._interleave(parts))
    want = np.array([[100 * run + q for run in range(3) for q in range(8)]] * 2)
    np.testing.assert_array_equal(got, want)


@long_lane.parametrize("parts", [2, 8, 32])
def test_pallas_unrotated_columns_by_parts_of_any_size(parts):
    """column_parts is a speed knob only: every size that divides the block gives the reference bits."""
    x = jnp.asarray(_hard_inputs(rows=32, cols=256, seed=10))
    config = fq.KernelConfig(column_parts=parts)
    _check(x, axis=-2, spec=QuantSpec(kind="mx", scale_mode="even"), out="mx", impl="pallas", config=config)


@pytest.mark.parametrize("access", list(MEMORY_ACCESS) + ["default"])
def test_pallas_lowers_to_triton_without_a_gpu(access):
    from fp4jax.ops.kernels import fused_quantize_pallas as kernels

    config = MEMORY_ACCESS.get(access, fq.KernelConfig())
    x = jax.ShapeDtypeStruct((1, 64, 512), jnp.bfloat16)
    signs = jax.ShapeDtypeStruct((1, 64), jnp.float32)
    spec = QuantSpec(kind="mx", scale_mode="even")
    for out in fq.OUTPUTS:
        for column, rotation, sign_row in ((False, H16, None), (True, RANDOM32, signs)):

            def run(x, s, column=column, rotation=rotation, out=out):
                return kernels.rotate_quantize_3d(x, column, spec, rotation, s, None, out, False, config)

            text = jax.jit(run).trace(x, sign_row).lower(lowering_platforms=("cuda",)).as_text()
            assert "__gpu$xla.gpu.triton" in text or "triton" in text


@pytest.mark.parametrize("elem", ["e2m3", "e3m2"])
def test_pallas_mxfp6_lowers_to_triton_without_a_gpu(elem):
    """MXFP6's widening to E4M3 bytes (an int -> float32 convert and bit operations) lowers, both
    layouts, rotated by parts and whole; so does E2M3's fold, in one pass (rows) and via mx (columns)."""
    from fp4jax.ops.kernels import fused_quantize_pallas as kernels

    x = jax.ShapeDtypeStruct((1, 64, 512), jnp.bfloat16)
    spec = QuantSpec(kind="mx", elem=elem, scale_mode="even")
    outs = fq.OUTPUTS if elem in fq.FOLDED_ELEMS else ("mx",)
    for out in outs:
        for column, rotation in ((False, H16), (True, NO_ROTATION), (True, H32)):

            def run(x, column=column, rotation=rotation, out=out):
                return kernels.rotate_quantize_3d(
                    x, column, spec, rotation, None, None, out, False, fq.KernelConfig()
                )

            assert "triton" in jax.jit(run).trace(x).lower(lowering_platforms=("cuda",)).as_text()


# ----------------------------------------------------------------------------------------------------
# Pallas with stochastic rounding and prescale: the kernels draw the reference's bits themselves (by
# default; the tests of threefry.py below), or read them as an input tiled like the output (fallback)

SR = QuantSpec(kind="mx", scale_mode="even", rounding="stochastic")
SR_PRESCALE = dataclasses.replace(SR, prescale=0.75)
PRESCALE = QuantSpec(kind="mx", scale_mode="even", prescale=0.75)


def _adversarial(seed: int) -> jax.Array:
    """_hard_inputs (zeros, ties, subnormals, the largest finite values, NaN/Inf, wide ranges), 32 x 256,
    with the first rows' blocks holding one outlier each (2^12 times the rest, at a random position)."""
    x = _hard_inputs(rows=32, cols=256, seed=seed)
    rng = np.random.default_rng(seed)
    blocks = x[:4].reshape(4, -1, 32)
    blocks[np.arange(4)[:, None], np.arange(8)[None], rng.integers(0, 32, (4, 8))] *= 4096.0
    x[:4] = blocks.reshape(4, -1)
    return jnp.asarray(x)


SR_CASES = {  # (axis, rotation, spec, out or fold method, key seed or None)
    "row-sr-mx": (-1, NO_ROTATION, SR, "mx", 0),
    "col-h16-sr-mx": (-2, H16, SR, "mx", 1),
    "col-random16-sr_prescale-mx": (-2, RANDOM16, SR_PRESCALE, "mx", 2),
    "row-random16-sr_prescale-one_pass": (-1, RANDOM16, SR_PRESCALE, "one_pass", 3),
    "col-sr_prescale-via_mx": (-2, NO_ROTATION, SR_PRESCALE, "via_mx", 4),
    "col-h16-prescale-mx": (-2, H16, PRESCALE, "mx", None),
    "row-e4m3-prescale-mx": (
        -1,
        NO_ROTATION,
        dataclasses.replace(PRESCALE, elem="e4m3", scale_mode="ceil"),
        "mx",
        None,
    ),
}


@long_lane.parametrize("case", list(SR_CASES), default=2)  # SR by rows, rotated columns
def test_pallas_stochastic_and_prescale_match_reference(case):
    """The kernels (interpret mode) give quantize_mx's bits for the same key, both layouts, by parts
    (rotated or not) and for each fold method; in the first case another key gives other bits (the bits
    reach the kernel)."""
    axis, rotation, spec, out, key = SR_CASES[case]
    x = _adversarial(seed=20 + (key or 0))
    signs = random_signs(jax.random.key(9), rotation.size) if rotation.kind == "random" else None
    config = VIA_MX_ROWS if out == "via_mx" else fq.KernelConfig()
    out_kind = "mx" if out == "mx" else "fp8_fold"
    check = functools.partial(
        _check, x, axis=axis, spec=spec, rotation=rotation, out=out_kind, impl="pallas", signs=signs
    )
    got = check(key=None if key is None else jax.random.key(key), config=config)
    if key == 0:
        other = check(key=jax.random.key(100), config=config)
        assert np.any(_bits(got.data) != _bits(other.data))


def test_pallas_stochastic_whole_tile_reads_match_reference():
    """SR in the kernels' other spelling: tiles read whole (rotation blocks that do not tile the MX
    block; unrotated columns with column_parts=0), the bits' tile reshaped like the values'."""
    x = _adversarial(seed=30)
    whole = fq.KernelConfig(column_parts=0)
    key = jax.random.key(11)
    _check(
        x,
        axis=-1,
        spec=dataclasses.replace(SR_PRESCALE, block_size=16),
        rotation=H32,
        impl="pallas",
        key=key,
        config=whole,
    )
    _check(x, axis=-2, spec=SR, impl="pallas", key=key, config=whole, out="fp8_fold")


def test_pallas_stochastic_lowers_to_triton_without_a_gpu():
    from fp4jax.ops.kernels import fused_quantize_pallas as kernels

    x = jax.ShapeDtypeStruct((1, 64, 512), jnp.bfloat16)
    for out, column in (("mx", True), ("fp8_fold", False)):
        bits = jax.ShapeDtypeStruct((1, 512, 64) if column else (1, 64, 512), jnp.uint32)

        def run(x, b, column=column, out=out):
            return kernels.rotate_quantize_3d(
                x, column, SR_PRESCALE, H16, None, b, out, False, fq.KernelConfig()
            )

        text = jax.jit(run).trace(x, bits).lower(lowering_platforms=("cuda",)).as_text()
        assert "triton" in text


def _assert_lowers_to_triton(spec) -> None:
    """The kernels that draw their own bits for `spec` lower to Triton (no GPU needed) for both layouts and
    every output method."""
    from fp4jax.ops.kernels import fused_quantize_pallas as kernels

    x = jax.ShapeDtypeStruct((2, 64, 512), jnp.bfloat16)
    words = jax.ShapeDtypeStruct((2,), jnp.uint32)
    for out, column, rotation in (("mx", True, H16), ("mx", False, NO_ROTATION), ("fp8_fold", False, H16)):

        def run(x, w, column=column, out=out, rotation=rotation):
            return kernels.rotate_quantize_3d(
                x, column, spec, rotation, None, None, out, False, fq.KernelConfig(), w
            )

        assert "triton" in jax.jit(run).trace(x, words).lower(lowering_platforms=("cuda",)).as_text()


def test_pallas_stochastic_with_key_words_lowers_to_triton_without_a_gpu():
    """The kernels that draw their own bits (threefry's uint32 adds, xors, shifts; the key words read as
    two scalars) lower to Triton for both layouts and every output method."""
    _assert_lowers_to_triton(SR_PRESCALE)


# ----------------------------------------------------------------------------------------------------
# stochastic rounding's bits drawn inside the kernels: threefry.py's formula is jax.random.bits


# Keys whose two words are both non-zero (fold_in), so a swap of the words would show; and a plain seed.
FORMULA_KEYS = (jax.random.fold_in(jax.random.key(1), 5), jax.random.key(2**31 - 3))


def test_threefry_formula_is_jax_random_bits():
    """threefry.random_bits at each row-major index == jax.random.bits(key, shape, uint32), bit for bit:
    odd sizes, one element, several leading axes, the blocked shapes quantize_mx draws over."""
    for key in FORMULA_KEYS:
        for shape in ((1,), (7,), (3, 5, 7), (2, 3, 4, 33), (2, 3, 16, 2, 32)):
            want = jax.random.bits(key, shape, jnp.uint32)
            got = jax.jit(threefry.random_bits_of_shape, static_argnums=1)(jax.random.key_data(key), shape)
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_threefry_formula_applies_only_where_it_is_jax():
    key = FORMULA_KEYS[0]
    assert threefry.formula_applies(key, 2**32) and threefry.formula_applies(jax.random.PRNGKey(0), 64)
    assert not threefry.formula_applies(key, 2**32 + 1)  # the counter's high word would be used
    assert not threefry.formula_applies(jax.random.key(0, impl="rbg"), 64)
    with jax.threefry_partitionable(False):
        assert not threefry.formula_applies(key, 64)


# Small tiles, so that every term of a tile's draw numbers is exercised: two batch axes, two row tiles
# and two column tiles per batch element (two rows per one-pass program); the bits drawn in the kernels
# in both layouts.
SMALL_TILES = fq.KernelConfig(
    mx_row=Tile(16, 128, 4),
    mx_column=Tile(16, 128, 8),
    mx_column_unrotated=Tile(16, 128, 8),
    one_pass=Tile(1, 512, 8),
    kernel_bits="always",
)
KERNEL_BITS_CASES = {  # (axis, rotation, spec, out or fold method)
    "row-sr-mx": (-1, NO_ROTATION, SR, "mx"),  # the tile drawn whole
    "col-h16-sr_prescale-via_mx": (-2, H16, SR_PRESCALE, "via_mx"),  # drawn by parts of 16, transposed
    "row-h16-sr_prescale-one_pass": (-1, H16, SR_PRESCALE, "one_pass"),
    "col-sr-mx": (-2, NO_ROTATION, SR, "mx"),  # unrotated columns: parts of column_parts
    "row-sr-via_mx": (-1, NO_ROTATION, SR, "via_mx"),
}


def _batched_operand(axis: int) -> jax.Array:
    """(2, 2, 32, 256) hard inputs in the output orientation; x itself is transposed for columns."""
    x = jnp.asarray(_hard_inputs(rows=128, cols=256, seed=13).reshape(2, 2, 32, 256))
    return x if axis == -1 else jnp.swapaxes(x, -1, -2)


def _pallas_sr(x, axis, rotation, spec, out, key, config=SMALL_TILES):
    """(rotate_quantize in interpret mode, whether its jaxpr draws bits in XLA, the reference)."""
    out_kind = "mx" if out == "mx" else "fp8_fold"
    if out == "via_mx":
        config = dataclasses.replace(config, one_pass_max_row_rotated=0, one_pass_max_row_unrotated=0)

    def run(x, key):
        return fq.rotate_quantize(
            x,
            axis=axis,
            spec=spec,
            rotation=rotation,
            key=key,
            out=out_kind,
            impl="pallas",
            interpret=True,
            config=config,
        )

    xla_draws = _bits_passed_to_kernels(jax.make_jaxpr(run)(x, key).jaxpr, x.size)
    want = _reference(x, None, key, axis=axis, spec=spec, rotation=rotation, out=out_kind)
    return run(x, key), xla_draws, want


def _bits_passed_to_kernels(jaxpr, size: int) -> bool:
    """Whether some pallas_call in the jaxpr reads a uint32 input of `size` elements (bits drawn by XLA)."""
    return any(
        eqn.primitive.name == "pallas_call"
        and any(v.aval.dtype == jnp.uint32 and v.aval.size == size for v in eqn.invars)
        for eqn in all_eqns(jaxpr)
    )


@long_lane.parametrize("case", list(KERNEL_BITS_CASES), default=2)
def test_pallas_kernel_drawn_bits_match_reference(case):
    """The kernels draw the bits themselves (no random_bits left in XLA) and give quantize_mx's codes,
    scales and folds for the same key, over two batch axes and several tiles each way."""
    axis, rotation, spec, out = KERNEL_BITS_CASES[case]
    got, xla_draws, want = _pallas_sr(_batched_operand(axis), axis, rotation, spec, out, FORMULA_KEYS[0])
    assert not xla_draws
    _assert_same(got, want)


def test_pallas_falls_back_to_xla_drawn_bits_where_the_formula_is_not_jax():
    """Without jax_threefry_partitionable (jax then draws other bits), with a non-threefry key, or with
    KernelConfig(kernel_bits="never"), XLA draws the bits and the kernels read them: the reference's bits
    still. The first is checked to differ from the partitionable draw, so equality there says something."""
    axis, rotation, spec, out = KERNEL_BITS_CASES["row-sr-mx"]
    x, key = _batched_operand(axis), FORMULA_KEYS[0]
    with jax.threefry_partitionable(False):
        got, xla_draws, want = _pallas_sr(x, axis, rotation, spec, out, key)
    assert xla_draws
    _assert_same(got, want)
    partitionable, _, _ = _pallas_sr(x, axis, rotation, spec, out, key)
    assert np.any(_bits(partitionable.data) != _bits(got.data))
    for other_key, config in (
        (jax.random.key(3, impl="rbg"), SMALL_TILES),
        (key, dataclasses.replace(SMALL_TILES, kernel_bits="never")),
    ):
        got, xla_draws, want = _pallas_sr(x, axis, rotation, spec, out, other_key, config)
        assert xla_draws
        _assert_same(got, want)


def test_by_default_the_kernels_draw_column_operands_bits_and_xla_row_operands():
    """KernelConfig's default, kernel_bits="columns" (the H200's faster choice): a column-wise SR operand's
    bits are drawn in the kernel, a row-wise one's by XLA; the reference's bits both ways. A bad value is
    one line."""
    default = dataclasses.replace(SMALL_TILES, kernel_bits=fq.KernelConfig().kernel_bits)
    for case, drawn_by_xla in (("col-sr-mx", False), ("row-sr-mx", True)):
        axis, rotation, spec, out = KERNEL_BITS_CASES[case]
        x = _batched_operand(axis)
        got, xla_draws, want = _pallas_sr(x, axis, rotation, spec, out, FORMULA_KEYS[0], default)
        assert xla_draws == drawn_by_xla, case
        _assert_same(got, want)
    with pytest.raises(ValueError, match="unknown KernelConfig.kernel_bits 'rows': use one of always") as err:
        fq.KernelConfig(kernel_bits="rows")
    assert "\n" not in str(err.value)


THREEFRY13_CASES = {  # (axis, rotation, spec, out or fold method): whole tiles, parts, both layouts
    "row-sr-mx": (-1, NO_ROTATION, SR, "mx"),
    "col-h16-sr_prescale-via_mx": (-2, H16, SR_PRESCALE, "via_mx"),
    "row-h16-sr_prescale-one_pass": (-1, H16, SR_PRESCALE, "one_pass"),
    "col-sr-mx": (-2, NO_ROTATION, SR, "mx"),
}


@long_lane.parametrize("case", list(THREEFRY13_CASES), default=(0, 1))
def test_pallas_draws_threefry13_bits_in_both_layouts_by_default(case):
    """Generator "threefry13" (sr_bits.py): the kernels draw it themselves for both layouts under the
    default KernelConfig (no bits read from XLA) and give quantize_mx(rng="threefry13")'s codes, scales and
    folds bit for bit, whole tiles and parts of 16 and 8 alike; another generator gives other bits."""
    axis, rotation, spec, out = THREEFRY13_CASES[case]
    spec = dataclasses.replace(spec, rng="threefry13")
    default = dataclasses.replace(SMALL_TILES, kernel_bits=fq.KernelConfig().kernel_bits)
    x = _batched_operand(axis)
    got, xla_draws, want = _pallas_sr(x, axis, rotation, spec, out, FORMULA_KEYS[0], default)
    assert not xla_draws
    _assert_same(got, want)
    if case == "row-sr-mx":
        other, _, _ = _pallas_sr(
            x, axis, rotation, dataclasses.replace(spec, rng="threefry"), out, FORMULA_KEYS[0]
        )
        assert np.any(_bits(other.data) != _bits(got.data))
        never = dataclasses.replace(SMALL_TILES, kernel_bits="never")
        read, xla_draws, _ = _pallas_sr(x, axis, rotation, spec, out, FORMULA_KEYS[0], never)
        assert xla_draws
        _assert_same(read, want)


# KernelConfig.encode_joined_from(_rows): tiles read by parts encode the joined tile (by default from 32
# parts on, except in the row-wise mx kernel) or each part apart. Both ways, every size of parts, give the
# reference's bits.
ENCODINGS = {  # joined for every size of parts in every kernel, or apart everywhere
    "joined": {"encode_joined_from": 1, "encode_joined_from_rows": 1},
    "apart": {"encode_joined_from": 0, "encode_joined_from_rows": 0},
}
JOINED_CASES = {  # (axis, rotation, spec, out or fold method, rng); SMALL_TILES, the bits drawn in kernels
    "col-h32-sr-mx": (-2, H32, SR, "mx", "threefry"),
    "row-h32-sr_prescale-one_pass": (-1, H32, SR_PRESCALE, "one_pass", "threefry"),
    "col-h16-sr_prescale-via_mx": (-2, H16, SR_PRESCALE, "via_mx", "threefry"),
    "col-sr-mx": (-2, NO_ROTATION, SR, "mx", "threefry"),  # unrotated columns: parts of column_parts
    "row-h32-sr-mx-threefry13": (-1, H32, SR, "mx", "threefry13"),
    "col-h16-sr_prescale-via_mx-threefry13": (-2, H16, SR_PRESCALE, "via_mx", "threefry13"),
    "row-h16-prescale-one_pass": (-1, H16, PRESCALE, "one_pass", "threefry"),
    "col-h32-e2m3-mx": (-2, H32, dataclasses.replace(PRESCALE, elem="e2m3", prescale=1.0), "mx", "threefry"),
}


@long_lane.parametrize("encoding", list(ENCODINGS))
@long_lane.parametrize("case", list(JOINED_CASES))
def test_pallas_parts_encoded_joined_or_apart_match_reference(case, encoding):
    """Tiles read by parts give quantize_mx's codes, scales and folds whether each part is encoded apart
    or the rotated parts are joined and the tile encoded once, for every size of parts (32: H32, 16: H16,
    8: unrotated columns), drawn bits of both generators, and every fold method."""
    axis, rotation, spec, out, rng = JOINED_CASES[case]
    config = dataclasses.replace(SMALL_TILES, **ENCODINGS[encoding])
    spec = dataclasses.replace(spec, rng=rng)
    got, xla_draws, want = _pallas_sr(
        _batched_operand(axis), axis, rotation, spec, out, FORMULA_KEYS[0], config
    )
    assert not xla_draws
    _assert_same(got, want)


def test_random32_parts_read_xla_drawn_bits_joined_or_apart():
    """The 32-point random rotation (its signs read as scalars by parts), SR's bits drawn by XLA and
    read by the kernels, both layouts, every kernel encoding joined and apart."""
    x = _adversarial(seed=40)
    signs = random_signs(jax.random.key(12), 32)
    for encoding, axis in ((e, a) for e in ENCODINGS for a in (-1, -2)):
        config = fq.KernelConfig(kernel_bits="never", **ENCODINGS[encoding])
        check = functools.partial(_check, x, axis=axis, rotation=RANDOM32, impl="pallas", signs=signs)
        check(spec=SR_PRESCALE, key=jax.random.key(13), config=config, out="fp8_fold")
        check(spec=SR, key=jax.random.key(14), config=config)


def _kernel_equations(config: fq.KernelConfig, rotation=RANDOM32) -> int:
    """Equations of the column-wise mx kernel's body for a 32-point random rotation with SR drawn in the
    kernel: a measure of the Triton program it lowers to."""
    from fp4jax.ops.kernels import fused_quantize_pallas as kernels

    def run(x, signs, words):
        return kernels.rotate_quantize_3d(x, True, SR, rotation, signs, None, "mx", False, config, words)

    args = (jnp.zeros((1, 256, 64)), jnp.ones((1, 256)), jnp.zeros((2,), jnp.uint32))
    jaxpr = jax.make_jaxpr(run)(*args)
    [kernel] = [eqn for eqn in all_eqns(jaxpr) if eqn.primitive.name == "pallas_call"]
    return sum(1 for _ in all_eqns(kernel.params["jaxpr"]))


def test_joined_parts_keep_one_copy_of_the_encoding_and_the_generator():
    """Encoded apart, a 32-part kernel holds 32 copies of the element encoding and of threefry's rounds
    (about 8600 equations; its Triton compile took 27-54 s on an H100); joined, one (about 800)."""
    apart = _kernel_equations(fq.KernelConfig(encode_joined_from=0))
    joined = _kernel_equations(fq.KernelConfig())
    assert joined * 8 < apart, (joined, apart)


def test_pallas_threefry13_lowers_to_triton_without_a_gpu():
    """The kernels drawing generator threefry13 (pairs of words interleaved by joins) lower to Triton."""
    _assert_lowers_to_triton(dataclasses.replace(SR_PRESCALE, rng="threefry13"))


# ----------------------------------------------------------------------------------------------------
# bad input


def test_bad_input_is_one_clear_error():
    x = jnp.zeros((32, 64))
    spec = QuantSpec(kind="mx")
    with pytest.raises(ValueError, match="needs a PRNG key"):
        fq.rotate_quantize(x, spec=QuantSpec(kind="mx", rounding="stochastic"), impl="pallas")
    with pytest.raises(ValueError, match="folds E2M1 and E2M3 elements only, got elem='e4m3'"):
        fq.rotate_quantize(x, spec=QuantSpec(kind="mx", elem="e4m3"), out="fp8_fold")
    with pytest.raises(ValueError, match="needs signs"):
        fq.rotate_quantize(x, spec=spec, rotation=RANDOM32)
    with pytest.raises(ValueError, match="not a multiple"):
        fq.rotate_quantize(jnp.zeros((32, 48)), spec=spec)
    with pytest.raises(ValueError, match="axis must be"):
        fq.rotate_quantize(jnp.zeros((2, 32, 64)), axis=0, spec=spec)


# ----------------------------------------------------------------------------------------------------
# which implementation


H200 = probes.DeviceDescription("nvidia", "NVIDIA H200", "9.0")


def test_choose_impl_takes_pallas_only_where_asked_and_supported():
    spec = QuantSpec(kind="mx", scale_mode="even")
    here = dict(device=H200, device_count=1)

    def choose(shape=(2, 256, 512), axis=-1, spec=spec, rotation=H16, setting="pallas", **kw):
        return fq.choose_impl(shape, axis, spec, rotation, setting=setting, **{**here, **kw})

    assert choose() == "pallas" and choose(axis=-2) == "pallas"
    assert choose(setting="xla") == "xla" and choose(setting="reference") == "xla"
    assert choose(setting="auto") == "pallas"
    assert (
        choose(rotation=RANDOM16, setting="auto") == "pallas"
    )  # random signs: a sign row, as mxfp4_full_rht
    # Stochastic rounding and prescale run in the kernels too.
    sr_prescale = dataclasses.replace(spec, rounding="stochastic", prescale=0.75)
    assert (
        choose(spec=sr_prescale, setting="auto") == "pallas" and choose(spec=sr_prescale, axis=-2) == "pallas"
    )
    assert choose(spec=sr_prescale, setting="xla") == "xla"
    # Where the kernels do not run, "pallas" and "auto" fall back to XLA (same bits).
    assert choose(device=probes.DeviceDescription("cpu", "cpu")) == "xla"
    assert choose(device=probes.DeviceDescription("amd", "MI300X", "gfx942")) == "xla"
    assert choose(device_count=8) == "xla"  # a pallas_call does not shard
    assert choose(shape=(2, 256, 480)) == "xla"  # quantized axis not a multiple of 256
    assert choose(shape=(2, 256, 480), axis=-2) == "pallas"  # column-wise: 480 output rows, 256 quantized
    assert choose(shape=(2, 8, 512)) == "xla"  # 8 output rows: below the checked tile


def test_quantizer_reads_no_environment_variable(monkeypatch):
    """The choice of implementation is an argument: bogus environment values change nothing."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((32, 64)), jnp.float32)
    spec = QuantSpec(kind="mx")
    want = fq.rotate_quantize(x, spec=spec, impl="xla")
    for value in ("xla", "pallas", "reference", "triton"):
        monkeypatch.setenv("FP4JAX_QUANTIZE_IMPL", value)
        monkeypatch.setenv("FP4JAX_GEMM_BACKEND", value)
        # On this CPU "auto" means XLA: the kernels run on NVIDIA GPUs only (interpret mode aside).
        _assert_same(fq.rotate_quantize(x, spec=spec), want)
    with pytest.raises(ValueError, match="unknown quantize impl"):
        fq.choose_impl(x.shape, -1, spec, NO_ROTATION, setting="fast")


def test_kernel_config_is_hashable_and_checked():
    assert hash(fq.KernelConfig()) == hash(fq.KernelConfig())
    with pytest.raises(ValueError, match="column_parts"):
        fq.KernelConfig(column_parts=3)
    with pytest.raises(ValueError, match="encode_joined_from_rows must be >= 0 .0: never., got -1"):
        fq.KernelConfig(encode_joined_from_rows=-1)
    with pytest.raises(TypeError, match="config must be a KernelConfig"):
        fq.rotate_quantize(jnp.zeros((32, 64)), spec=QuantSpec(kind="mx"), config={"column_parts": 8})


def _compiled_cases(elem: str) -> list[tuple[QuantSpec, str]]:
    """(spec, out) of the compiled sweep: E2M1 in every rounding, scale and prescale mode with both outputs;
    MXFP6 (written as E4M3 bytes) nearest-even and stochastic, E2M3 also folded."""
    if elem == "e2m1":
        specs = (QuantSpec(kind="mx"), QuantSpec(kind="mx", scale_mode="even"), SR_PRESCALE, SR, PRESCALE)
        return [(spec, out) for spec in specs for out in fq.OUTPUTS]
    specs = (QuantSpec(kind="mx", elem=elem, scale_mode="even"), dataclasses.replace(SR, elem=elem))
    return [(spec, out) for spec in specs for out in (fq.OUTPUTS if elem in fq.FOLDED_ELEMS else ("mx",))]


def _differences(got, want) -> str | None:
    """None where got has want's bits, else which parts differ and in how many elements."""
    if isinstance(want, quantize.MXArray):
        layout = lambda a: (a.axis, a.block_size, a.data.dtype)
        if layout(got) != layout(want):
            return f"(axis, block size, dtype) {layout(got)} instead of {layout(want)}"
        parts = {"data": (_bits(got.data), _bits(want.data)), "scale": (_bits(got.scale), _bits(want.scale))}
    else:
        parts = {
            "data": (_bits(got.data), _bits(want.data)),
            "row_exponent": (np.asarray(got.row_exponent), np.asarray(want.row_exponent)),
            "flushed_blocks": (np.asarray(got.flushed_blocks), np.asarray(want.flushed_blocks)),
        }
    differ = []
    for name, (a, b) in parts.items():
        if a.shape != b.shape:
            differ.append(f"{name} of shape {a.shape} instead of {b.shape}")
        elif np.any(a != b):
            differ.append(f"{name} in {int(np.sum(a != b))} of {a.size}")
    return ", ".join(differ) or None


@pytest.mark.skipif(
    probes.describe_device().vendor != "nvidia",
    reason="needs an NVIDIA GPU: the compiled Triton kernels (interpret mode runs everywhere, above)",
)
@pytest.mark.parametrize("elem", ["e2m1", "e2m3", "e3m2"])
@pytest.mark.parametrize("axis", [-1, -2])
@pytest.mark.parametrize("rotation", [NO_ROTATION, H16, RANDOM32], ids=["none", "h16", "random32"])
def test_compiled_pallas_matches_reference_on_hard_inputs(axis, rotation, elem):
    """The Triton kernels themselves (not interpret mode) on ties, subnormals, zeros, Inf/NaN, wide ranges.

    The GPU keeps float32 subnormals where XLA's CPU flushes them, so this is the lane where the short
    E2M1 encoder's and the rotation's subnormal handling meet real subnormal arithmetic. Each kernel is
    compiled: a column-wise MXFP6 kernel with the 32-point rotation took 27-54 s on an H100 whose CPUs
    other compilations shared (2026-12-07), so the sweep is split by element type for the workers; a
    case that differs does not hide the others: every differing (spec, out) is listed.
    """
    x = jnp.asarray(np.concatenate([_hard_inputs(rows=64, cols=512, seed=s) for s in (11, 12)]))
    signs = random_signs(jax.random.key(4), rotation.size) if rotation.kind == "random" else None
    key = jax.random.key(6)
    differing = []
    for spec, out in _compiled_cases(elem):
        got = fq.rotate_quantize(
            x, axis=axis, spec=spec, rotation=rotation, signs=signs, key=key, out=out, impl="pallas"
        )
        want = _reference(x, signs, key, axis=axis, spec=spec, rotation=rotation, out=out)
        what = _differences(got, want)
        if what:
            differing.append(f"{spec} out={out}: {what}")
    assert not differing, "\n".join(differing)
