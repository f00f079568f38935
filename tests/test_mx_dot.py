"""mx_dot_general against lax.dot_general (recipe bf16) and against the numpy reference GEMMs (every preset).

For a linear layer y = x W the three GEMMs are (docs/numerics.md, "The GEMM recipe"):
  Fprop  y  = x W      quantize x and W along K
  Dgrad  dx = dy W^T   quantize dy and W along N
  Wgrad  dW = x^T dy   quantize x and dy along T (all non-contracting dims of x)
The reference builds each GEMM from the contract table below, written from the numerics contract (not from
the code), and compares forward and both gradients with a per-element bound 1e-5 * (|A_q| |B_q|): the float32
accumulation error scale (on a GPU, GEMMs on FP8 or MX tensor cores get those cores' accumulation bound
instead: tests/lanes.py). One element quantized one grid step differently moves its outputs by ~1e-2 of
that scale.
Rotated presets add, per output, the room left by rotated elements lying within float32 rotation error of a
rounding boundary (computed by mx_reference; zero almost everywhere, exactly zero for exact rotations).
Where a test means float32 products (unquantized GEMMs), it asks for precision HIGHEST: GPUs otherwise
multiply float32 as TF32.
"""

import dataclasses
import functools
import itertools
import types

import jax
import jax.numpy as jnp
import lanes
import mx_reference as ref
import numpy as np
import pytest
from helpers import all_eqns, fwd_bwd

from fp4jax.ops import (
    PRESETS,
    GemmSpec,
    QuantSpec,
    Recipe,
    RotationSpec,
    get_recipe,
    make_dot_general,
    mx_dot_general,
    quantized_dot,
    random_signs,
)

Op = ref.Operand
MX4 = Op("mx", "e2m1", 32, "even", "nearest_even")
MX4_SR = Op("mx", "e2m1", 32, "even", "stochastic")
MX6_E2M3 = Op("mx", "e2m3", 32, "even", "nearest_even")  # MXFP6: the MXFP4 operand's rule, other elements
MX6_E3M2 = Op("mx", "e3m2", 32, "even", "nearest_even")
MX8 = Op("mx", "e4m3", 32, "ceil", "nearest_even")  # a decision (docs/numerics.md): NVIDIA's MXFP8 rule
FP8_FWD = Op("fp8", "e4m3")  # x and W
FP8_GRAD = Op("fp8", "e5m2")  # dy
NONE = ref.NONE

# GEMM table: (lhs, rhs, rotation); rotation None, ("deterministic", g) or ("random", g[, sign policy]),
# the policy "per_call" unless named.
_FP8 = dict(fprop=(FP8_FWD, FP8_FWD, None), dgrad=(FP8_GRAD, FP8_FWD, None), wgrad=(FP8_FWD, FP8_GRAD, None))


def _full(op, rot=None):
    return dict(fprop=(op, op, rot), dgrad=(op, op, rot), wgrad=(op, op, rot))


CONTRACT = {
    "bf16": _full(NONE),
    "fp8": _FP8,
    "fp8_delayed": _FP8,  # with delayed scaling; structure checked only
    "fp8_mlperf": _FP8,  # delayed scaling, history 4, newest amax (tests/test_recipes.py)
    "mxfp4_fprop": {**_FP8, "fprop": (MX4, MX4, None)},
    "mxfp4_fprop_dgrad": {**_FP8, "fprop": (MX4, MX4, None), "dgrad": (MX4, MX4, None)},
    "mxfp4_full": _full(MX4),
    "mxfp4_full_sr": {
        "fprop": (MX4, MX4, None),
        "dgrad": (MX4_SR, MX4_SR, None),
        "wgrad": (MX4_SR, MX4_SR, None),
    },
    "mxfp4_full_sr_prescale": {  # SR with the 3/4 prescale (tests/test_recipes.py)
        "fprop": (MX4, MX4, None),
        "dgrad": (MX4_SR, MX4_SR, None),
        "wgrad": (MX4_SR, MX4_SR, None),
    },
    "mxfp4_full_rht": _full(MX4, ("random", 16)),
    "mxfp4_full_h16": _full(MX4, ("deterministic", 16)),
    "mxfp4_full_h32": _full(MX4, ("deterministic", 32)),
    "mxfp4_full_h16_wgrad_only": {**_full(MX4), "wgrad": (MX4, MX4, ("deterministic", 16))},
    "mxfp4_wgrad": {**_FP8, "wgrad": (MX4, MX4, None)},
    "mxfp4_full_h16_fprop": {**_full(MX4), "fprop": (MX4, MX4, ("deterministic", 16))},
    "mxfp4_full_h16_fprop_dgrad": {
        **_full(MX4),
        "fprop": (MX4, MX4, ("deterministic", 16)),
        "dgrad": (MX4, MX4, ("deterministic", 16)),
    },
    # The literature's recipes (checked bit for bit below, with their pre-scales and signs).
    "mxfp4_tseng": {
        "fprop": (MX4, MX4, None),
        "dgrad": (MX4_SR, MX4_SR, ("random", 16)),
        "wgrad": (MX4_SR, MX4_SR, ("random", 16)),
    },
    "mxfp4_nvidia": {
        "fprop": (MX4, MX4, None),
        "dgrad": (MX4_SR, MX4, None),  # (dy, W): only the output gradient rounds stochastically
        "wgrad": (MX4, MX4_SR, ("random", 16, "per_run")),  # (x, dy)
    },
    "mxfp8": _full(MX8),
    # qwix's Outlier-Aware Scaling on the full rung (the reference transcribes qwix's rule).
    "mxfp4_full_oas": _full(dataclasses.replace(MX4, scale_mode="oas")),
    # The MLPerf v6.0 MI355X recipe: MXFP4 behind H16 on all GEMMs, full_h16's definition under its name.
    "mxfp4_mlperf_mi355x": _full(MX4, ("deterministic", 16)),
}
for _name, _op in (("mxfp6_e2m3", MX6_E2M3), ("mxfp6_e3m2", MX6_E3M2)):  # the ladder's rungs per format
    CONTRACT[f"{_name}_fprop"] = {**_FP8, "fprop": (_op, _op, None)}
    CONTRACT[f"{_name}_fprop_dgrad"] = {**_FP8, "fprop": (_op, _op, None), "dgrad": (_op, _op, None)}
    CONTRACT[f"{_name}_full"] = _full(_op)
    CONTRACT[f"{_name}_full_h16"] = _full(_op, ("deterministic", 16))
STOCHASTIC = ("mxfp4_full_sr", "mxfp4_full_sr_prescale", "mxfp4_full_rht", "mxfp4_tseng", "mxfp4_nvidia")
DETERMINISTIC = [n for n in CONTRACT if n not in ("fp8_delayed", "fp8_mlperf", *STOCHASTIC)]
GEMMS = ("fprop", "dgrad", "wgrad")
F32 = jax.lax.Precision.HIGHEST  # float32 products on every platform (GPUs default to TF32)

# dimension_numbers cases, with einsum-like subscripts (lhs, rhs, out) for the reference.
DIMS = {
    "2d": ((40, 48), (48, 24), (((1,), (0,)), ((), ())), ("tk", "kn", "tn")),
    "3d_activations": ((2, 20, 64), (64, 32), (((2,), (0,)), ((), ())), ("btk", "kn", "btn")),
    "batch": ((2, 24, 64), (2, 64, 40), (((2,), (1,)), ((0,), (0,))), ("bmk", "bkn", "bmn")),
    "two_contracting": ((24, 4, 24), (4, 24, 40), (((1, 2), (0, 1)), ((), ())), ("mpq", "pqn", "mn")),
    "rhs_contract_last": ((40, 48), (24, 48), (((1,), (1,)), ((), ())), ("tk", "nk", "tn")),
    "lhs_contract_0": ((48, 40), (48, 24), (((0,), (0,)), ((), ())), ("kt", "kn", "tn")),
}


# ----------------------------------------------------------------------------------------------------
# Inputs and the reference.


def _inputs(lhs_shape, rhs_shape, subs, seed=0):
    """lhs, rhs and a cotangent with outlier tokens and channels (x100), float32."""
    rng = np.random.default_rng(seed)
    lhs_subs, rhs_subs, out_subs = subs
    # Every third value on a coarse grid: exact round-half ties after scaling (nearest_even vs away).
    coarse = lambda v, q: np.where(rng.random(v.shape) < 1 / 3, np.round(v * q) / q, v).astype(np.float32)
    lhs = coarse(rng.standard_normal(lhs_shape), 4)
    rhs = coarse(rng.standard_normal(rhs_shape) / 8, 32)
    # Outlier channels: a few positions of lhs's last contracting letter; outlier tokens: lhs free letters.
    contract = [c for c in lhs_subs if c in rhs_subs and c not in out_subs]
    free = [c for c in lhs_subs if c not in rhs_subs]
    ax_c = lhs_subs.index(contract[-1])
    ax_t = lhs_subs.index(free[-1])
    idx = [slice(None)] * lhs.ndim
    idx[ax_c] = [1, 7]
    lhs[tuple(idx)] *= 100
    idx = [slice(None)] * lhs.ndim
    idx[ax_t] = [3]
    lhs[tuple(idx)] *= 100
    out_shape = jax.eval_shape(
        lambda a, b: jnp.einsum(f"{lhs_subs},{rhs_subs}->{out_subs}", a, b), lhs, rhs
    ).shape
    dy = coarse(rng.standard_normal(out_shape), 4)
    dy[..., 2] *= 100  # an outlier output feature in the gradient
    return lhs, rhs, dy


def _contraction_length(a, a_subs, b_subs, out_subs) -> int:
    """K of the GEMM a (a_subs) x b (b_subs) -> out_subs: the product of the contracted letters' sizes."""
    return int(np.prod([a.shape[i] for i, c in enumerate(a_subs) if c in b_subs and c not in out_subs]))


def _reference(name, lhs, rhs, dy, subs, signs=(None, None, None)):
    """[y, dlhs, drhs] from the contract table, each (value, error scale, rotation room, rtol).

    rtol is this lane's accumulation bound for the GEMM (tests/lanes.py): 1e-5 but on GPU tensor cores.
    """
    lhs_subs, rhs_subs, out_subs = subs
    table = CONTRACT[name]
    out = []
    calls = {
        "fprop": (lhs, lhs_subs, rhs, rhs_subs, out_subs),
        "dgrad": (dy, out_subs, rhs, rhs_subs, lhs_subs),
        "wgrad": (lhs, lhs_subs, dy, out_subs, rhs_subs),
    }
    for gemm, s in zip(GEMMS, signs, strict=True):
        a_op, b_op, rot = table[gemm]
        value, scale, room = ref.quantized_dot(
            *calls[gemm], a_op, b_op, rotation=rot and rot[1], signs=s, return_abs=True
        )
        a, a_subs, _, b_subs, c_subs = calls[gemm]
        k = _contraction_length(a, a_subs, b_subs, c_subs)
        rtol = lanes.gemm_rtol(a_op.kind, b_op.kind, k)
        out.append((value, scale, room, rtol))
    return out


_fwd_bwd = jax.jit(fwd_bwd, static_argnames=("dims", "recipe", "pet", "precision"))


@functools.partial(jax.jit, static_argnames=("dims", "pet", "precision"))
def _lax_fwd_bwd(lhs, rhs, dy, *, dims, pet=None, precision=None):
    f = lambda a, b: jax.lax.dot_general(a, b, dims, precision, preferred_element_type=pet)
    y, vjp = jax.vjp(f, lhs, rhs)
    return (y, *vjp(dy.astype(y.dtype)))


def _assert_close(got, want_and_scale, what, rtol=None):
    """|got - want| <= rtol |A||B| + room per element; rtol defaults to the reference's (or 1e-5)."""
    want, scale, *rest = want_and_scale  # rest: room (legitimate float32-rotation flips), the lane's rtol
    room = rest[:1]
    if rtol is None:
        rtol = rest[1] if len(rest) > 1 else lanes.FLOAT32_RTOL
    got = np.asarray(got)
    assert got.shape == want.shape, (what, got.shape, want.shape)
    assert got.dtype == np.float32, (what, got.dtype)
    err = np.abs(got.astype(np.float64) - want.astype(np.float64))
    bound = rtol * scale + (room[0] if room else 0.0) + 1e-30
    bad = ~(err <= bound)
    if bad.any():
        i = tuple(np.argwhere(bad)[0])
        rel = (err / np.maximum(scale, 1e-30)).max()
        raise AssertionError(
            f"{what}: {bad.sum()} of {bad.size} outside {rtol} * |A||B|; first {i}: got {got[i]!r} "
            f"want {want[i]!r} (scale {scale[i]:.4g}); max err / scale {rel:.3g}"
        )


# ----------------------------------------------------------------------------------------------------
# The preset table.


def _describe_operand(q: QuantSpec):
    if q.kind == "none":
        return ("none",)
    if q.kind == "fp8":
        return ("fp8", q.elem, q.fp8_scaling)
    return ("mx", q.elem, q.block_size, q.scale_mode, q.rounding)


def _describe_expected(op: ref.Operand, delayed: bool):
    if op.kind == "none":
        return ("none",)
    if op.kind == "fp8":
        return ("fp8", op.elem, "delayed" if delayed else "current")
    return ("mx", op.elem, op.block_size, op.scale_mode, op.rounding)


@pytest.mark.parametrize("name", sorted(CONTRACT))
def test_preset_matches_contract_table(name):
    recipe = PRESETS[name]
    assert isinstance(recipe, Recipe) and recipe.name == name
    assert get_recipe(name) is recipe and get_recipe(recipe) is recipe
    for gemm in GEMMS:
        spec = getattr(recipe, gemm)
        a_op, b_op, rot = CONTRACT[name][gemm]
        delayed = name in ("fp8_delayed", "fp8_mlperf")
        assert _describe_operand(spec.lhs) == _describe_expected(a_op, delayed), (gemm, "lhs", spec.lhs)
        assert _describe_operand(spec.rhs) == _describe_expected(b_op, delayed), (gemm, "rhs", spec.rhs)
        if rot is None:
            assert spec.rotation.kind == "none", (gemm, spec.rotation)
        else:
            kind, size, *policy = rot
            assert (spec.rotation.kind, spec.rotation.size) == (kind, size), (gemm, spec.rotation)
            if kind == "random":  # per_call: re-drawn every step; per_run: fixed by the spec's seed
                assert spec.rotation.signs == (policy[0] if policy else "per_call"), (gemm, spec.rotation)
    assert recipe.needs_key == (name in STOCHASTIC)


def test_preset_names():
    """Every preset is in this contract table, but the NVFP4 ones: tests/test_formats_nvfp4_gemm.py holds
    those to their own reference (tests/formats_reference.py)."""
    nvfp4 = {n for n, r in PRESETS.items() if any(s.kind == "nvfp4" for g in r.gemms for s in (g.lhs, g.rhs))}
    assert nvfp4 == {
        *("nvfp4_fprop", "nvfp4_fprop_dgrad", "nvfp4_full", "nvfp4_full_h16", "nvfp4_nvidia"),
        *("nvfp4_nvidia_12b", "nvfp4_nvidia_8b", "nvfp4_4over6", "nvfp4_quartet2"),
    }
    assert set(PRESETS) - nvfp4 == set(CONTRACT)


# ----------------------------------------------------------------------------------------------------
# bf16 recipe == lax.dot_general.


@pytest.mark.parametrize("case", sorted(DIMS))
def test_bf16_recipe_equals_lax_dot_general(case):
    lhs_shape, rhs_shape, dims, subs = DIMS[case]
    lhs, rhs, dy = _inputs(lhs_shape, rhs_shape, subs, seed=1)
    scales = _reference("bf16", lhs, rhs, dy, subs)
    for precision in (None, F32):  # the caller's precision reaches the dot, as in lax.dot_general
        got = _fwd_bwd(lhs, rhs, dy, dims=dims, recipe="bf16", precision=precision)
        want = _lax_fwd_bwd(lhs, rhs, dy, dims=dims, precision=precision)
        for g, w, (_, scale, *_), what in zip(got, want, scales, ("y", "dlhs", "drhs"), strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape, (what, g.dtype, w.dtype, g.shape, w.shape)
            _assert_close(g, (np.asarray(w), scale), f"{case} {precision} {what}", rtol=1e-6)


# ----------------------------------------------------------------------------------------------------
# Every deterministic preset == the reference, linear layers (2-D and 3-D activations).


@pytest.mark.parametrize(
    "name,case",
    [(n, "2d") for n in DETERMINISTIC]
    + [
        (n, "3d_activations")
        for n in ("fp8", "mxfp4_full_h32", "mxfp8", "mxfp6_e2m3_full", "mxfp6_e3m2_full")
    ],
)
def test_preset_matches_reference(name, case):
    lhs_shape, rhs_shape, dims, subs = DIMS[case]
    lhs, rhs, dy = _inputs(lhs_shape, rhs_shape, subs, seed=2)
    precision = F32 if name == "bf16" else None  # bf16 on float32 inputs means float32 GEMMs
    got = _fwd_bwd(lhs, rhs, dy, dims=dims, recipe=name, precision=precision)
    want = _reference(name, lhs, rhs, dy, subs)
    for g, w, what in zip(got, want, ("fprop y", "dgrad dx", "wgrad dW"), strict=True):
        _assert_close(g, w, f"{name} {case} {what}")


@pytest.mark.parametrize("case", sorted(DIMS))
@pytest.mark.parametrize("name", ["mxfp4_full_h16"])
def test_dimension_numbers_match_reference(name, case):
    lhs_shape, rhs_shape, dims, subs = DIMS[case]
    lhs, rhs, dy = _inputs(lhs_shape, rhs_shape, subs, seed=3)
    got = _fwd_bwd(lhs, rhs, dy, dims=dims, recipe=name)
    want = _reference(name, lhs, rhs, dy, subs)
    for g, w, what in zip(got, want, ("y", "dlhs", "drhs"), strict=True):
        _assert_close(g, w, f"{name} {case} {what}")


# (shape, contracting dims, batch dims) -> whether the GEMMs take the operand as it lies, contracting on -2.
CONTRACTION_FIRST = {
    ((48, 24), (0,), ()): True,  # a Dense kernel (K, N)
    ((3, 48, 24), (1,), (0,)): True,  # a batched kernel
    ((6, 8, 24), (0, 1), ()): True,  # (heads, head_dim, N): an attention output projection
    ((24, 48), (1,), ()): False,  # (N, K)
    ((4, 40, 48), (2,), ()): False,  # activations (B, T, K)
    ((8, 6, 24), (1, 0), ()): False,  # contracting dims in the other order: no view without a transpose
}


@pytest.mark.parametrize("case", sorted(CONTRACTION_FIRST, key=str))
def test_gemm_view_reads_contraction_first_operands_in_place(case):
    shape, contract, batch = case
    layout = quantized_dot.operand_layouts(shape, shape, ((contract, contract), (batch, batch)))[0]
    assert layout.contraction_first == CONTRACTION_FIRST[case]
    x = jnp.arange(np.prod(shape), dtype=jnp.float32).reshape(shape)
    view, axis = quantized_dot.to_gemm_view(x, layout)
    assert axis == (-2 if layout.contraction_first else -1)
    as_bfc = view if axis == -1 else jnp.swapaxes(view, 1, 2)
    np.testing.assert_array_equal(as_bfc, quantized_dot.to_bfc(x, layout))
    if layout.contraction_first:
        np.testing.assert_array_equal(view.reshape(shape), x)  # the data as it lies
        np.testing.assert_array_equal(quantized_dot.from_bcf(view, layout), x)


@pytest.mark.parametrize(
    "name",
    ["mxfp4_full_h16", "mxfp4_full_h16_wgrad_only", "mxfp4_full_h16_fprop", "mxfp4_full_h16_fprop_dgrad"],
)
def test_rotated_exact_ties_round_half_even(name):
    # Coarse inputs (multiples of 1/4, 1/32) rotate exactly with H16 (entries +-1/4): many exact ties after
    # rotation, which nearest_even and nearest_away resolve differently.
    rng = np.random.default_rng(14)
    lhs = (rng.integers(-24, 25, (40, 48)) / 4).astype(np.float32)
    rhs = (rng.integers(-24, 25, (48, 24)) / 32).astype(np.float32)
    dy = (rng.integers(-24, 25, (40, 24)) / 4).astype(np.float32)
    subs = ("tk", "kn", "tn")
    got = _fwd_bwd(lhs, rhs, dy, dims=(((1,), (0,)), ((), ())), recipe=name)
    want = _reference(name, lhs, rhs, dy, subs)
    assert all((w[2] == 0).all() for w in want)  # exact rotations: no room for float32 rotation error
    for g, w, what in zip(got, want, GEMMS, strict=True):
        _assert_close(g, w, f"{name} exact ties {what}")


def test_quantization_actually_happens():
    # Guards the tolerance: the MXFP4 result is far from the unquantized one on the same scale.
    lhs_shape, rhs_shape, dims, subs = DIMS["2d"]
    lhs, rhs, dy = _inputs(lhs_shape, rhs_shape, subs, seed=2)
    y = np.asarray(_fwd_bwd(lhs, rhs, dy, dims=dims, recipe="mxfp4_full")[0])
    exact, scale, *_ = _reference("bf16", lhs, rhs, dy, subs)[0]
    assert np.median(np.abs(y - exact) / scale) > 1e-3


def test_fp8_delayed_uses_history_scales_and_returns_updated_histories():
    """Delayed scaling (owner's decision, Transformer-Engine style): each operand's scale comes from its
    incoming amax history (Fprop x: "lhs", W: "rhs"; Dgrad dy: "grad", W: "rhs"; Wgrad x: "lhs", dy: "grad");
    the cotangent of fp8_meta is the histories with this call's amax rolled in at index 0."""
    lhs_shape, rhs_shape, dims, subs = DIMS["2d"]
    lhs, rhs, dy = _inputs(lhs_shape, rhs_shape, subs, seed=12)
    amax = lambda v: np.float32(np.abs(v).max())
    f32 = np.float32
    meta = {  # stale histories: x's scale too large (saturates), W's too small, dy's close
        "lhs": np.array([amax(lhs) * 0.25, 1.0, 0.0, 0.0], f32),
        "rhs": np.array([0.01, amax(rhs) * 4, 0.0, 0.0], f32),
        "grad": np.array([0.0, 0.0, amax(dy) * 0.9, 0.0], f32),
    }

    @jax.jit
    def run(a, b, m, g):
        y, vjp = jax.vjp(
            lambda a, b, m: mx_dot_general(a, b, dims, recipe="fp8_delayed", fp8_meta=m), a, b, m
        )
        return (y, *vjp(g))

    y, dx, dw, new_meta = run(lhs, rhs, meta, dy)
    s_x = ref.fp8_scale_from_history(meta["lhs"], "e4m3")
    s_w = ref.fp8_scale_from_history(meta["rhs"], "e4m3")
    s_g = ref.fp8_scale_from_history(meta["grad"], "e5m2")
    x_op, w_op = Op("fp8", "e4m3", fp8_scale=s_x), Op("fp8", "e4m3", fp8_scale=s_w)
    g_op = Op("fp8", "e5m2", fp8_scale=s_g)
    (t, k), n = lhs.shape, rhs.shape[1]
    for got, a, a_subs, b, b_subs, out_subs, ops, length, what in (
        (y, lhs, "tk", rhs, "kn", "tn", (x_op, w_op), k, "delayed fprop"),
        (dx, dy, "tn", rhs, "kn", "tk", (g_op, w_op), n, "delayed dgrad"),
        (dw, lhs, "tk", dy, "tn", "kn", (x_op, g_op), t, "delayed wgrad"),
    ):
        want = ref.quantized_dot(a, a_subs, b, b_subs, out_subs, *ops, return_abs=True)
        _assert_close(got, want, what, rtol=lanes.gemm_rtol("fp8", "fp8", length))
    for role, v in (("lhs", lhs), ("rhs", rhs), ("grad", dy)):
        np.testing.assert_array_equal(np.asarray(new_meta[role]), ref.fp8_amax_history_update(meta[role], v))
    with pytest.raises(ValueError):
        mx_dot_general(lhs, rhs, dims, recipe="fp8_delayed")  # no fp8_meta


def _sharded(v, spec):
    mesh = lanes.mesh_2d(("data", "model"))
    return jax.device_put(v, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(*spec)))


def test_sharded_tokens_match_reference_and_unsharded():
    # Tokens sharded over all devices (8 per shard on the 8 CPU devices): Wgrad's 32-blocks along T span
    # four shards. On one GPU the sharding is trivial and this checks the unsharded path.
    subs = ("tk", "kn", "tn")
    lhs, rhs, dy = _inputs((64, 48), (48, 24), subs, seed=13)
    dims = (((1,), (0,)), ((), ()))
    tokens = (("data", "model"), None)
    xs, ws, dys = _sharded(lhs, tokens), _sharded(rhs, (None, None)), _sharded(dy, tokens)
    got = _fwd_bwd(xs, ws, dys, dims=dims, recipe="mxfp4_full_h16")
    for g, w, what in zip(got, _reference("mxfp4_full_h16", lhs, rhs, dy, subs), GEMMS, strict=True):
        _assert_close(g, w, f"sharded {what}")
    # Stochastic rounding draws the same bits whatever the sharding.
    key = jax.random.key(3)
    sharded = _fwd_bwd(xs, ws, dys, key, dims=dims, recipe="mxfp4_full_sr")
    single = _fwd_bwd(lhs, rhs, dy, key, dims=dims, recipe="mxfp4_full_sr")
    for a, b, (_, scale, _, rtol), what in zip(
        sharded, single, _reference("mxfp4_full", lhs, rhs, dy, subs), GEMMS, strict=True
    ):
        # Two results, each within the lane's accumulation bound of the exact one (1e-5 on the CPU).
        both = lanes.FLOAT32_RTOL + 2 * (rtol - lanes.FLOAT32_RTOL)
        _assert_close(a, (np.asarray(b), scale), f"sr sharded vs unsharded {what}", rtol=both)


# ----------------------------------------------------------------------------------------------------
# Output dtypes.


@pytest.mark.parametrize("name", ["bf16", "mxfp4_full"])
def test_output_dtype_and_preferred_element_type(name):
    lhs_shape, rhs_shape, dims, subs = DIMS["2d"]
    lhs, rhs, dy = _inputs(lhs_shape, rhs_shape, subs, seed=4)
    lb, rb, dyb = (jnp.asarray(v, jnp.bfloat16) for v in (lhs, rhs, dy))
    for pet in (None, jnp.float32):
        got = _fwd_bwd(lb, rb, dyb, dims=dims, recipe=name, pet=pet)
        want = _lax_fwd_bwd(lb, rb, dyb, dims=dims, pet=pet)
        for g, w, what in zip(got, want, ("y", "dlhs", "drhs"), strict=True):
            assert g.dtype == w.dtype and g.shape == w.shape, (name, pet, what, g.dtype, w.dtype)
    # Values: bf16 inputs are exact in float32, so the reference applies; one bf16 output rounding.
    y = _fwd_bwd(lb, rb, dyb, dims=dims, recipe=name)[0]
    reference = _reference(name, lb.astype(jnp.float32), rb.astype(jnp.float32), dy, subs)[0]
    want, scale, _, rtol = reference
    err = np.abs(np.asarray(y, np.float32) - want)
    assert (err <= 2.0**-8 * np.abs(want) + rtol * scale).all()
    y32 = _fwd_bwd(lb, rb, dyb, dims=dims, recipe=name, pet=jnp.float32)[0]
    _assert_close(y32, reference, f"{name} bf16 inputs, float32 output")


# ----------------------------------------------------------------------------------------------------
# Stochastic rounding preset.


def test_sr_preset_keys_and_forward():
    lhs_shape, rhs_shape, dims, subs = DIMS["2d"]
    lhs, rhs, dy = _inputs(lhs_shape, rhs_shape, subs, seed=5)
    k1, k2 = jax.random.key(1), jax.random.key(2)
    a = _fwd_bwd(lhs, rhs, dy, k1, dims=dims, recipe="mxfp4_full_sr")
    b = _fwd_bwd(lhs, rhs, dy, k1, dims=dims, recipe="mxfp4_full_sr")
    c = _fwd_bwd(lhs, rhs, dy, k2, dims=dims, recipe="mxfp4_full_sr")
    for i in range(3):
        np.testing.assert_array_equal(np.asarray(a[i]), np.asarray(b[i]))
    np.testing.assert_array_equal(np.asarray(a[0]), np.asarray(c[0]))  # Fprop rounds to nearest
    assert (np.asarray(a[1]) != np.asarray(c[1])).any() and (np.asarray(a[2]) != np.asarray(c[2])).any()
    _assert_close(a[0], _reference("mxfp4_full_sr", lhs, rhs, dy, subs)[0], "sr fprop")
    with pytest.raises(ValueError):
        mx_dot_general(lhs, rhs, dims, recipe="mxfp4_full_sr")  # no key


def test_sr_gradients_are_unbiased():
    """Mean over n keys of each SR gradient -> E[Q(a)] E[Q(b)] (operands drawn independently), computed
    exactly by the reference. Bound: 5 sample standard deviations of the mean, plus the float32 scale.

    The GEMMs run on the emulate back end (what `auto` is on the CPU): a statistical test of the rounding
    needs an unbiased accumulation, and FP8 tensor cores truncate (tests/lanes.py)."""
    lhs_shape, rhs_shape, dims, subs = DIMS["2d"]
    lhs, rhs, dy = _inputs(lhs_shape, rhs_shape, subs, seed=6)
    n = 400
    keys = jax.random.split(jax.random.key(0), n)
    recipe = dataclasses.replace(PRESETS["mxfp4_full_sr"], backend="emulate")
    run = jax.jit(jax.vmap(lambda k: _fwd_bwd(lhs, rhs, dy, k, dims=dims, recipe=recipe)[1:]))
    dlhs, drhs = (np.asarray(v, np.float64) for v in run(keys))
    want = _reference("mxfp4_full_sr", lhs, rhs, dy, subs)[1:]
    nearest = _reference("mxfp4_full", lhs, rhs, dy, subs)[1:]
    for samples, (expect, scale, *_), (rne, *_), what in zip(
        (dlhs, drhs), want, nearest, ("dgrad", "wgrad"), strict=True
    ):
        mean, sd = samples.mean(0), samples.std(0, ddof=1)
        err = np.abs(mean - expect)
        bound = 5 * sd / np.sqrt(n) + 1e-5 * scale
        assert (err <= bound).all(), (what, np.argwhere(err > bound)[:5], (err / bound).max())
        z = (mean - expect)[sd > 0] / (sd[sd > 0] / np.sqrt(n))
        assert abs(z.mean()) < 5 / np.sqrt(z.size), (what, z.mean())
        assert (sd > 0).mean() > 0.9, what  # the gradients really are random
        # SR's mean is not the round-to-nearest result.
        assert (np.abs(mean - rne) > bound).any(), what


# ----------------------------------------------------------------------------------------------------
# Random Hadamard preset: identify the shared sign vector by exhaustive search, then check exactly.


@functools.cache  # on first use, not when each worker collects the module (about 1 s)
def _sign_classes():
    """Coset representatives of {+-1}^16 modulo the group {+-h_j} (rows of the +-1 Hadamard matrix).

    s -> s * h_j only permutes the columns of each rotated block (D_h H = H P_j) in both operands alike, and
    s -> -s flips both operands; neither changes the quantized product, so signs are identifiable only up to
    this 32-element group. Returns (representatives (2048, 16), class code of every sign vector)."""
    all_signs = np.array(list(itertools.product([1, -1], repeat=16)), np.int8)  # (65536, 16)
    group = np.concatenate([np.sign(ref.hadamard(16)), -np.sign(ref.hadamard(16))]).astype(np.int8)
    weights = 1 << np.arange(16)
    orbit_codes = ((all_signs[:, None, :] * group[None]) > 0).astype(np.int64) @ weights  # (65536, 32)
    canonical = orbit_codes.min(axis=1)
    reps = np.unique(canonical)
    bits = (reps[:, None] >> np.arange(16)) & 1
    return np.where(bits == 1, 1.0, -1.0), canonical


def _class_of(signs) -> int:
    code = int(((np.asarray(signs) > 0).astype(np.int64) << np.arange(16)).sum())
    return int(_sign_classes()[1][code])


def _rotate_candidates(v, signs):
    """v (r, c) rotated along its last axis with each candidate sign vector: (n_signs, r, c), float32."""
    vb = v.astype(np.float64).reshape(v.shape[0], -1, 16)
    out = np.einsum("rbj,sj,jl->srbl", vb, signs, ref.hadamard(16))
    return out.reshape(len(signs), *v.shape).astype(np.float32).astype(np.float64)


def _find_signs(a_rows, b_cols, got, op):
    """Sign classes s for which Q(a D_s H) Q(H D_s b) reproduces got[:2, :2]; a_rows (2, C), b_cols (C, 2)."""
    kw = dict(axis=-1, elem=op.elem, block_size=op.block_size, scale_mode=op.scale_mode)
    reps = _sign_classes()[0]
    qa = ref.quantize_mx(_rotate_candidates(a_rows, reps), **kw).dequantize64()
    qb = ref.quantize_mx(_rotate_candidates(b_cols.T, reps), **kw).dequantize64()
    prod = np.einsum("sik,sjk->sij", qa, qb)
    scale = np.einsum("sik,sjk->sij", np.abs(qa), np.abs(qb))
    rtol = lanes.gemm_rtol("mx", "mx", a_rows.shape[1])
    ok = (np.abs(prod - got[None, :2, :2]) <= rtol * scale + 1e-30).all(axis=(1, 2))
    return reps[ok]


def test_sign_classes():
    reps = _sign_classes()[0]
    assert reps.shape == (2048, 16)
    # Every member of a class gives the same quantized product (the symmetry the search relies on).
    rng = np.random.default_rng(0)
    a = rng.standard_normal((2, 32)).astype(np.float32)
    b = rng.standard_normal((32, 2)).astype(np.float32)
    s = reps[123]
    h = np.sign(ref.hadamard(16))[5]
    ys = [ref.quantized_dot(a, "mk", b, "kn", "mn", MX4, MX4, rotation=16, signs=v) for v in (s, -s * h)]
    np.testing.assert_allclose(ys[0], ys[1], rtol=1e-6)
    assert _class_of(s) == _class_of(-s * h) != _class_of(reps[124])


def test_rht_preset_uses_shared_random_signs():
    """The rht output equals the reference for some sign vector shared by both operands of each GEMM
    (found by exhaustive search over the 2048 sign classes), and a new key draws new signs."""
    t, k, n = 32, 32, 32  # every contraction is one MX block = two rotation blocks
    rng = np.random.default_rng(8)
    x = rng.standard_normal((t, k)).astype(np.float32)
    x[:, 5] *= 100
    w = (rng.standard_normal((k, n)) / 8).astype(np.float32)
    dy = rng.standard_normal((t, n)).astype(np.float32)
    dy[:, 2] *= 100
    dims = (((1,), (0,)), ((), ()))
    subs = ("tk", "kn", "tn")
    found = {}
    for seed in (1, 2):
        key = jax.random.key(seed)
        y, dx, dw = (np.asarray(v) for v in _fwd_bwd(x, w, dy, key, dims=dims, recipe="mxfp4_full_rht"))
        again = _fwd_bwd(x, w, dy, key, dims=dims, recipe="mxfp4_full_rht")
        for a, b in zip((y, dx, dw), again, strict=True):
            np.testing.assert_array_equal(a, np.asarray(b))
        # Operands of each GEMM as (rows, contraction) and (contraction, cols).
        s_f = _find_signs(x[:2], w[:, :2], y, MX4)
        s_d = _find_signs(dy[:2], w.T[:, :2], dx, MX4)
        s_w = _find_signs(x.T[:2], dy[:, :2], dw, MX4)
        for what, s in (("fprop", s_f), ("dgrad", s_d), ("wgrad", s_w)):
            assert len(s) >= 1, f"{what}: no shared sign vector reproduces the output (seed {seed})"
        signs = (s_f[0], s_d[0], s_w[0])
        want = _reference("mxfp4_full_rht", x, w, dy, subs, signs=signs)
        for g, ws, what in zip((y, dx, dw), want, GEMMS, strict=True):
            _assert_close(g, ws, f"rht {what} with the identified signs")
        found[seed] = [{_class_of(v) for v in s} for s in (s_f, s_d, s_w)]
    # Per-call signs: a new key draws new signs (same class by chance: 1/2048).
    assert not (found[1][0] & found[2][0]), "fprop signs did not change with the key"


# ----------------------------------------------------------------------------------------------------
# The literature's recipes, bit for bit: each GEMM built here from the reference quantizer, operand by
# operand, with the random bits and signs the contract says a call draws (docs/numerics.md,
# "Randomness"): GEMM key = fold_in(key, GEMM index), split into (rotation, lhs, rhs) keys; per_run signs
# from key(seed). Inputs are bf16 values of moderate range, so the rotation (H16 entries +-1/4) and the
# float32 accumulation of the FP4 products are exact: any correct implementation gives these bits.

# Per GEMM: lhs and rhs as (rounding, prescale), and the rotation's sign policy (None: no rotation).
RTN, SR, SR_PRESCALED = ("nearest_even", 1.0), ("stochastic", 1.0), ("stochastic", 0.75)
LITERATURE = {
    "mxfp4_tseng": {  # Tseng et al. 2025: SR with 3/4 and a per-call RHT on both backward GEMMs
        "fprop": (RTN, RTN, None),
        "dgrad": (SR_PRESCALED, SR_PRESCALED, "per_call"),
        "wgrad": (SR_PRESCALED, SR_PRESCALED, "per_call"),
    },
    "mxfp4_nvidia": {  # NVIDIA 2025 on MXFP4: SR on dy only, one fixed random-sign H16 on Wgrad only
        "fprop": (RTN, RTN, None),
        "dgrad": (SR, RTN, None),
        "wgrad": (RTN, SR, "per_run"),
    },
}
NVIDIA_SIGN_SEED = 0  # the seed the contract fixes for mxfp4_nvidia's Wgrad signs (docs/numerics.md)


def _literature_inputs(t=64, k=80, n=48, seed=12):
    """x (T, K), W (K, N), dy (T, N): bf16 values in float32, rows of different scales. K and N are not
    multiples of 32, so Fprop and Dgrad also pad their contraction axes."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((t, k)) * np.exp(rng.standard_normal((t, 1)))
    w = rng.standard_normal((k, n)) * 0.05
    dy = rng.standard_normal((t, n)) * np.exp(rng.standard_normal((1, n))) * 1e-3
    return tuple(np.asarray(jnp.asarray(v, jnp.bfloat16), np.float32) for v in (x, w, dy))


def _literature_operand(rows, operand, signs, key):
    """One (rows, contraction) operand: zero-padded to the block, rotated, quantized; float64 values."""
    rounding, prescale = operand
    rows = np.pad(rows.astype(np.float64), [(0, 0), (0, -rows.shape[1] % 32)])
    if signs is not None:
        rows = ref.rotate_blocks(rows, axis=-1, size=16, signs=signs).astype(np.float32)
    uniforms = None
    if rounding == "stochastic":  # quantize_mx's draw: 24 bits of a uint32 per element, from this key
        bits = np.asarray(jax.random.bits(key, (1, *rows.shape), jnp.uint32))[0]
        uniforms = (bits >> 8).astype(np.float64) * 2.0**-24
    kw = dict(axis=-1, elem="e2m1", block_size=32, scale_mode="even", rounding=rounding)
    return ref.quantize_mx(rows, **kw, uniforms=uniforms, prescale=prescale).dequantize64()


def _exact_sums(qa, qb) -> bool:
    """Whether every output's sum of products is exact in float32 in any order: all its terms on one
    grid 2^q with sum |terms| < 2^(q + 24) (products of two FP4 values are exact float32 values)."""
    terms = (qa[:, None, :] * qb[None, :, :]).astype(np.float32)
    q = np.where(terms == 0, 10**6, ref._lowest_bit_exponent(terms)).min(-1)
    return bool((np.abs(terms.astype(np.float64)).sum(-1) < np.ldexp(1.0, np.minimum(q + 24, 1000))).all())


def _literature_reference(name, x, w, dy, key, flip_a_sign=False):
    """[y, dx, dW] of `name` as the table above and the contract's keys say, float32. flip_a_sign: the
    first of every rotation's signs flipped (a sign vector outside the drawn one's class of equivalent
    ones, which are those times a row of +-H16), so that rotated GEMMs come out different."""
    operands = {"fprop": (x, w.T), "dgrad": (dy, w), "wgrad": (x.T, dy.T)}  # (rows, contraction) each
    out = []
    for i, gemm in enumerate(GEMMS):
        lhs, rhs, policy = LITERATURE[name][gemm]
        rotation_key, lhs_key, rhs_key = jax.random.split(jax.random.fold_in(key, i), 3)
        signs = {
            None: None,
            "per_call": np.asarray(random_signs(rotation_key, 16)),
            "per_run": np.asarray(random_signs(jax.random.key(NVIDIA_SIGN_SEED), 16)),
        }[policy]
        if signs is not None and flip_a_sign:
            signs = signs * np.where(np.arange(16) == 0, -1.0, 1.0)
        a, b = operands[gemm]
        qa = _literature_operand(a, lhs, signs, lhs_key)
        qb = _literature_operand(b, rhs, signs, rhs_key)
        assert _exact_sums(qa, qb), f"{name} {gemm}: inputs whose float32 sums are not exact"
        prod = (qa @ qb.T).astype(np.float32)  # exact (checked above)
        out.append(prod * np.float32(1 / (lhs[1] * rhs[1])))  # the pre-scales undone: one float32 multiply
    return out  # y (T, N), dx (T, K), dW (K, N)


@pytest.mark.parametrize("name", sorted(LITERATURE))
def test_literature_presets_match_the_hand_built_gemms_bit_for_bit(name):
    """Forward and both gradients of mx_dot_general equal the GEMMs built here, for two keys; with one
    sign flipped the rotated GEMMs of the reference no longer match (the comparison sees the signs)."""
    x, w, dy = _literature_inputs()
    dims = (((1,), (0,)), ((), ()))
    recipe = dataclasses.replace(PRESETS[name], backend="emulate")
    results = {}
    for seed in (1, 2):
        key = jax.random.key(seed)
        got = [np.asarray(v) for v in _fwd_bwd(x, w, dy, key, dims=dims, recipe=recipe)]
        want = _literature_reference(name, x, w, dy, key)
        for g, r, what in zip(got, want, ("fprop y", "dgrad dx", "wgrad dW"), strict=True):
            assert g.dtype == np.float32 and g.shape == r.shape, (what, g.dtype, g.shape, r.shape)
            np.testing.assert_array_equal(g, r, err_msg=f"{name} key {seed}: {what}")
        results[seed] = got
    # Round-to-nearest Fprop ignores the key; the stochastic gradients follow it.
    np.testing.assert_array_equal(results[1][0], results[2][0])
    assert all((results[1][i] != results[2][i]).any() for i in (1, 2))
    flipped = _literature_reference(name, x, w, dy, jax.random.key(2), flip_a_sign=True)
    for i, gemm in enumerate(GEMMS):
        rotated = LITERATURE[name][gemm][2] is not None
        assert (flipped[i] != results[2][i]).any() == rotated, (name, gemm)


@pytest.mark.parametrize(
    "name", sorted(n for n, r in PRESETS.items() if any(getattr(r, g).needs_key for g in GEMMS))
)
def test_batched_stage_draws_equal_the_per_gemm_contract(name):
    """mx_dot makes a call's three GEMMs' draws in batched calls (quantized_dot._stage_keys); each must be
    the contract's own: split(fold_in(key, GEMM index), 3) = (rotation, lhs, rhs) keys, signs drawn from
    the rotation key (per_call) or from key(seed) (per_run), for typed and raw keys."""
    from fp4jax.ops import quantized_dot

    recipe = PRESETS[name]
    for key in (jax.random.key(7), jax.random.PRNGKey(8)):
        batched = quantized_dot._stage_keys(recipe, key)
        for i, gemm_name in enumerate(GEMMS):
            gemm = getattr(recipe, gemm_name)
            rotation_key, lhs_key, rhs_key = jax.random.split(jax.random.fold_in(key, i), 3)
            got = batched[i]
            for what, g, want in (("lhs", got.a_key, lhs_key), ("rhs", got.c_key, rhs_key)):
                data = jax.random.key_data if jnp.issubdtype(want.dtype, jax.dtypes.prng_key) else np.asarray
                np.testing.assert_array_equal(data(g), data(want), err_msg=f"{name} {gemm_name} {what}")
            rotation = gemm.rotation
            if rotation.kind != "random":
                assert got.signs is None, (name, gemm_name)
                continue
            sign_key = rotation_key if rotation.needs_key else jax.random.key(rotation.seed)
            want_signs = random_signs(sign_key, rotation.size)
            np.testing.assert_array_equal(got.signs, want_signs, err_msg=f"{name} {gemm_name} signs")


def test_nvidia_wgrad_signs_are_fixed_for_the_run():
    """mxfp4_nvidia's Wgrad rotation needs no key (per_run); its only randomness is dy's rounding. With dy
    rounded to nearest (a copy of the recipe without SR), two keys give the same Wgrad bit for bit."""
    recipe = PRESETS["mxfp4_nvidia"]
    assert recipe.wgrad.rotation.signs == "per_run" and not recipe.wgrad.rotation.needs_key
    assert recipe.wgrad.rotation.seed == NVIDIA_SIGN_SEED
    dy_nearest = dataclasses.replace(recipe.wgrad.rhs, rounding="nearest_even")
    nearest = dataclasses.replace(recipe.wgrad, rhs=dy_nearest)
    deterministic = dataclasses.replace(recipe, wgrad=nearest, backend="emulate")
    x, w, dy = _literature_inputs(seed=13)
    dims = (((1,), (0,)), ((), ()))
    a, b = (_fwd_bwd(x, w, dy, jax.random.key(s), dims=dims, recipe=deterministic)[2] for s in (1, 2))
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_random_rotation_cancels_without_quantization():
    rot = RotationSpec(kind="random", size=16, signs="per_call")
    recipe = Recipe(fprop=GemmSpec(rotation=rot), dgrad=GemmSpec(rotation=rot), wgrad=GemmSpec(rotation=rot))
    assert recipe.needs_key
    lhs_shape, rhs_shape, dims, subs = DIMS["3d_activations"]
    lhs, rhs, dy = _inputs(lhs_shape, rhs_shape, subs, seed=9)
    got = _fwd_bwd(lhs, rhs, dy, jax.random.key(0), dims=dims, recipe=recipe, precision=F32)
    want = _reference("bf16", lhs, rhs, dy, subs)
    for g, w, what in zip(got, want, ("y", "dx", "dW"), strict=True):
        _assert_close(g, w, f"random rotation, unquantized: {what}")


# ----------------------------------------------------------------------------------------------------
# Recipes: names, hashing, jit, back ends, make_dot_general.


def test_unknown_recipe_lists_valid_names():
    for call in (
        lambda: get_recipe("nope"),
        lambda: mx_dot_general(jnp.ones((2, 32)), jnp.ones((32, 2)), (((1,), (0,)), ((), ())), recipe="nope"),
    ):
        with pytest.raises(ValueError) as err:
            call()
        msg = str(err.value)
        assert "nope" in msg and all(name in msg for name in PRESETS), msg


def test_recipes_are_hashable_static_args():
    for name, recipe in PRESETS.items():
        assert hash(recipe) == hash(dataclasses.replace(recipe)) and recipe == dataclasses.replace(recipe), (
            name
        )
    assert len({PRESETS[n] for n in PRESETS}) == len(PRESETS)
    custom = dataclasses.replace(PRESETS["mxfp4_full"], name="custom_full")
    x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 32)), jnp.float32)
    w = jnp.asarray(np.random.default_rng(1).standard_normal((32, 4)), jnp.float32)
    f = jax.jit(
        lambda a, b, recipe: mx_dot_general(a, b, (((1,), (0,)), ((), ())), recipe=recipe),
        static_argnames="recipe",
    )
    np.testing.assert_array_equal(
        np.asarray(f(x, w, recipe=custom)), np.asarray(f(x, w, recipe=PRESETS["mxfp4_full"]))
    )
    np.testing.assert_array_equal(
        np.asarray(f(x, w, recipe="mxfp4_full")), np.asarray(f(x, w, recipe=PRESETS["mxfp4_full"]))
    )


@pytest.mark.parametrize(
    "name,backend",
    [("mxfp4_full", "native"), ("mxfp8", "native"), ("mxfp4_full", "fp8"), ("mxfp4_fprop", "fp8")],
)
def test_backends_equal_emulate(name, backend):
    """Every back end computes emulate's numbers: on the CPU up to float32 summation order; on a GPU up to
    the tensor cores' accumulation (tests/lanes.py). mxfp4_fprop's FP8 x FP8 GEMMs run as FP8 GEMMs."""
    if backend == "native":
        lanes.skip_unless_native_gemms_compile()
    lhs_shape, rhs_shape, dims, subs = DIMS["3d_activations"]
    lhs, rhs, dy = _inputs(lhs_shape, rhs_shape, subs, seed=10)
    emulate = _fwd_bwd(lhs, rhs, dy, dims=dims, recipe=dataclasses.replace(PRESETS[name], backend="emulate"))
    other = _fwd_bwd(lhs, rhs, dy, dims=dims, recipe=dataclasses.replace(PRESETS[name], backend=backend))
    want = _reference(name, lhs, rhs, dy, subs)
    lengths = {"fprop": 64, "dgrad": 32, "wgrad": 40}  # K, N and T of 3d_activations
    for e, o, (_, scale, *_), gemm in zip(emulate, other, want, GEMMS, strict=True):
        a_op, b_op, _ = CONTRACT[name][gemm]
        rtols = [lanes.gemm_rtol(a_op.kind, b_op.kind, lengths[gemm], b) for b in ("emulate", backend)]
        rtol = sum(rtols) - lanes.FLOAT32_RTOL  # two results, each within its own bound of the exact one
        _assert_close(o, (np.asarray(e), scale), f"{name} {backend} vs emulate: {gemm}", rtol=rtol)


def test_make_dot_general_is_a_drop_in():
    lhs_shape, rhs_shape, dims, subs = DIMS["3d_activations"]
    lhs, rhs, dy = _inputs(lhs_shape, rhs_shape, subs, seed=11)
    dg = make_dot_general("mxfp4_full_h16")
    y = jax.jit(lambda a, b: dg(a, b, dims, None, None))(lhs, rhs)
    _assert_close(y, _reference("mxfp4_full_h16", lhs, rhs, dy, subs)[0], "make_dot_general")
    y2 = jax.jit(
        lambda a, b: dg(a, b, dims, precision=None, preferred_element_type=jnp.float32, out_sharding=None)
    )(lhs, rhs)
    np.testing.assert_array_equal(np.asarray(y2), np.asarray(y))


def test_an_eager_call_is_one_compiled_program(monkeypatch):
    """Called outside any jit, mx_dot_general (and its gradient) runs as compiled programs that a second
    call of the same shapes reuses, not as the quantizers' primitives dispatched one by one: the forward's
    Python runs once for two calls, and once more for the gradient's forward pass. Inside a caller's
    trace its result is the eager one. (Whether the passes show in the caller's jaxpr as nested jits
    depends on the jax version: inlined on 0.10, nested jit calls on 0.11.2.)"""
    traced = []  # the passes' caches start empty (conftest.py's _traced_afresh)
    forward = quantized_dot._forward
    monkeypatch.setattr(quantized_dot, "_forward", lambda *a: traced.append(1) or forward(*a))
    lhs_shape, rhs_shape, dims, subs = DIMS["3d_activations"]
    lhs, rhs, _ = _inputs(lhs_shape, rhs_shape, subs, seed=12)
    call = functools.partial(mx_dot_general, dimension_numbers=dims, recipe="mxfp4_full_h16")
    first = call(lhs, rhs)
    np.testing.assert_array_equal(np.asarray(call(lhs, rhs)), np.asarray(first))
    assert len(traced) == 1
    loss = lambda a, b: jnp.sum(call(a, b) ** 2)  # noqa: E731
    grads = [jax.grad(loss, argnums=(0, 1))(lhs, rhs) for _ in range(2)]
    assert len(traced) == 2
    np.testing.assert_array_equal(np.asarray(grads[0][1]), np.asarray(grads[1][1]))
    np.testing.assert_array_equal(np.asarray(jax.jit(call)(lhs, rhs)), np.asarray(first))
    eqns = all_eqns(jax.make_jaxpr(jax.grad(loss, argnums=(0, 1)))(lhs, rhs))
    assert sum(e.primitive.name == "dot_general" for e in eqns) >= 3  # the three GEMMs, nested or not


# ----------------------------------------------------------------------------------------------------
# The public module, and the precision of each GEMM's dot.


def test_mx_dot_module_is_the_public_surface():
    import fp4jax.ops
    import fp4jax.ops.mx_dot
    from fp4jax.ops import mx_dot

    assert isinstance(mx_dot, types.ModuleType) and mx_dot is fp4jax.ops.mx_dot
    wanted = {"mx_dot_general", "make_dot_general", "QuantDotGeneral", "NnxQuantDotGeneral", "PRESETS"}
    assert wanted | {"get_recipe", "Recipe", "GemmSpec", "QuantSpec", "RotationSpec"} <= set(mx_dot.__all__)
    for name in mx_dot.__all__:  # one object under both spellings
        assert getattr(mx_dot, name) is getattr(fp4jax.ops, name), name
    assert mx_dot.mx_dot_general is mx_dot_general


def _dot_precisions(jaxpr) -> list:
    """The precision of every dot_general in a jaxpr, sub-jaxprs (custom_vjp, pjit) included."""
    return [eqn.params["precision"] for eqn in all_eqns(jaxpr) if eqn.primitive.name == "dot_general"]


def test_plain_operand_times_quantized_one_is_a_float32_product():
    """A plain float32 operand times a quantized one is multiplied at precision HIGHEST (GPUs would round it
    to TF32 otherwise, an error no recipe asks for); GEMMs of two plain operands keep the caller's precision,
    as lax.dot_general does."""
    mxfp4 = QuantSpec(kind="mx", elem="e2m1", block_size=32, scale_mode="even", rounding="nearest_even")
    mixed = Recipe(fprop=GemmSpec(lhs=mxfp4), name="mx_times_plain")  # MX4 x NONE
    lhs_shape, rhs_shape, dims, subs = DIMS["2d"]
    lhs, rhs, _ = _inputs(lhs_shape, rhs_shape, subs, seed=15)
    trace = lambda recipe: jax.make_jaxpr(lambda a, b: mx_dot_general(a, b, dims, recipe=recipe))(lhs, rhs)
    (mixed_precision,) = _dot_precisions(trace(mixed).jaxpr)
    assert mixed_precision == (F32, F32), mixed_precision
    assert _dot_precisions(trace("bf16").jaxpr) == [None]
    got = jax.jit(lambda a, b: mx_dot_general(a, b, dims, recipe=mixed))(lhs, rhs)
    want = ref.quantized_dot(lhs, "tk", rhs, "kn", "tn", MX4, NONE, return_abs=True)
    _assert_close(got, want, "mx x plain")
