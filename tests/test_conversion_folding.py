"""The numbers must not depend on XLA:GPU folding float conversions.

XLA:GPU's simplify-fp-conversions pass (on under xla_allow_excess_precision, XLA's default) replaces a
chain of float conversions float32 -> narrow -> float32 by nothing. Where the narrow conversion rounds (a
value not on the narrow grid), the rounding disappears on GPUs and stays on CPUs, so CPU tests cannot see
it. This file compiles each program twice on the CPU: as written, and with every such chain read from its
source as that pass would compile it; the two must agree bit for bit. Chains of values
already on the narrow grid (an MX element written to its storage type) fold harmlessly and pass.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import long_lane
import ml_dtypes
import numpy as np
import pytest
from helpers import fwd_bwd
from jax.extend import core as jcore

from fp4jax.ops import PRESETS, GemmSpec, QuantSpec, Recipe
from fp4jax.ops.formats import float8_to_float32
from fp4jax.ops.nvfp4 import quantize_nvfp4
from fp4jax.ops.quantize import quantize_fp8
from fp4jax.ops.recipes import with_fp8_divide

# Ops that only move or replicate elements: XLA's other passes may move a conversion across them, so a
# chain through them is treated as direct.
_LAYOUT_OPS = {"reshape", "transpose", "squeeze", "expand_dims", "broadcast_in_dim", "slice", "copy", "rev"}
# Call-like primitives whose body runs once, evaluated inside; others (scan, while, cond) are bound
# as they are, so a chain inside them is not checked here.
_CALLS = {
    "pjit",
    "jit",
    "closed_call",
    "core_call",
    "remat",
    "checkpoint",
    "custom_jvp_call",
    "custom_vjp_call",
}
_CALL_PARAMS = ("jaxpr", "call_jaxpr", "fun_jaxpr")


def _float(aval) -> bool:
    return jnp.issubdtype(aval.dtype, jnp.floating)


def _cuda_branch(platforms) -> int:
    """The branch lax.platform_dependent lowers for CUDA: the one naming it, else the default (None)."""
    named = [i for i, names in enumerate(platforms) if names is not None and "cuda" in names]
    return named[0] if named else platforms.index(None)


def _evaluate(jaxpr, consts, args, sources, fold: bool, divide=None):
    """Runs jaxpr op by op. `sources` maps a variable made by a float conversion to the value it was
    converted from (through layout ops); with fold, a float conversion of such a variable converts
    that source instead, which is what XLA:GPU compiles. `divide`, if given, replaces every float32
    divide (a model of XLA:GPU's div.full.f32, which is not IEEE). A platform-dependent choice
    (`lax.platform_dependent`) takes the CUDA branch: the program evaluated is the one a GPU compiles."""
    env, source = dict(zip(jaxpr.constvars, consts, strict=True)), {}
    for var, arg, src in zip(jaxpr.invars, args, sources, strict=True):
        env[var] = arg
        if src is not None:
            source[var] = src
    read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]
    src_of = lambda v: None if isinstance(v, jcore.Literal) else source.get(v)
    for eqn in jaxpr.eqns:
        vals = [read(v) for v in eqn.invars]
        srcs = [src_of(v) for v in eqn.invars]
        name = eqn.primitive.name
        if name == "div" and divide is not None and eqn.outvars[0].aval.dtype == np.float32:
            env[eqn.outvars[0]] = divide(*vals)
            continue
        if name == "convert_element_type" and _float(eqn.invars[0].aval) and _float(eqn.outvars[0].aval):
            (out,) = eqn.outvars
            operand = srcs[0] if fold and srcs[0] is not None else vals[0]
            env[out] = eqn.primitive.bind(operand, **eqn.params)
            source[out] = srcs[0] if srcs[0] is not None else vals[0]
            continue
        if name == "platform_index":
            env[eqn.outvars[0]] = _cuda_branch(eqn.params["platforms"])
            continue
        if name == "cond" and isinstance(vals[0], int):  # the index a platform_index gave
            branch = eqn.params["branches"][vals[0]]
            outs = _evaluate(branch.jaxpr, branch.consts, vals[1:], srcs[1:], fold, divide)
            env.update(zip(eqn.outvars, outs, strict=True))
            continue
        if name in _LAYOUT_OPS and srcs[0] is not None:
            env[eqn.outvars[0]] = eqn.primitive.bind(*vals, **eqn.params)
            source[eqn.outvars[0]] = eqn.primitive.bind(srcs[0], *vals[1:], **eqn.params)
            continue
        inner = next((eqn.params[p] for p in _CALL_PARAMS if p in eqn.params), None)
        if name in _CALLS and inner is not None and (divide is not None or any(s is not None for s in srcs)):
            closed = inner if isinstance(inner, jcore.ClosedJaxpr) else jcore.ClosedJaxpr(inner, [])
            outs = _evaluate(closed.jaxpr, closed.consts, vals, srcs, fold, divide)
        else:
            outs = eqn.primitive.bind(*vals, **eqn.params)
            outs = outs if eqn.primitive.multiple_results else [outs]
        env.update(zip(eqn.outvars, outs, strict=True))
    return [read(v) for v in jaxpr.outvars]


def _evaluated(f, *args, fold: bool = False, divide=None):
    """f's outputs from the evaluator traced under jit on the CPU (folding conversions, replacing divides as
    _evaluate does), so that two calls' programs differ only in what they change. On the CPU on every
    lane: on a GPU, XLA would fold the chains of the program as written too, and the two would agree
    whatever the library does."""
    cpu = jax.devices("cpu")[0]
    with jax.default_device(cpu):
        closed = jax.make_jaxpr(f)(*args)
        consts = jax.device_put(closed.consts, cpu)
        flat = jax.device_put(jax.tree.leaves(args), cpu)
        evaluate = lambda *a: _evaluate(closed.jaxpr, consts, a, [None] * len(a), fold, divide)
        return jax.jit(evaluate)(*flat)


def _both_ways(f, *args):
    """(f's outputs as written, f's outputs with the float-conversion chains folded)."""
    return _evaluated(f, *args), _evaluated(f, *args, fold=True)


def _assert_same_bits(written, folded, what):
    for i, (a, b) in enumerate(zip(written, folded, strict=True)):
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        differ = int(np.sum(a.view(np.uint32) != b.view(np.uint32)))
        assert differ == 0, f"{what}: output {i} changes in {differ} elements when XLA:GPU folds conversions"


def _operands():
    rng = np.random.default_rng(0)
    x = rng.standard_normal((32, 64)) * np.exp2(rng.integers(-8, 3, (32, 64)))
    x[::5, 7] *= 300  # an outlier channel
    w = rng.standard_normal((64, 48)) * 0.1
    dy = rng.standard_normal((32, 48))
    return (jnp.asarray(a, jnp.float32) for a in (x, w, dy))


def _fp8_meta(recipe):
    """Amax histories for a delayed-scaling FP8 recipe, one value per operand."""
    n = recipe.fp8_amax_history_len
    return {k: jnp.full((n,), v, jnp.float32) for k, v in (("lhs", 30.0), ("rhs", 0.3), ("grad", 3.0))}


def _layer(recipe, dy, meta=None):
    """(x, w) -> helpers.fwd_bwd with the cotangent dy, and a fixed key where the recipe draws one."""
    key = jax.random.key(3) if recipe.needs_key else None
    return lambda x, w: fwd_bwd(x, w, dy, key, recipe=recipe, fp8_meta=meta)


# Every preset on both back ends; the default lane keeps NVFP4 (its block scales round by conversion) and
# the FP8 baseline, the long lane the rest.
_CASES = [(name, backend) for name in sorted(PRESETS) for backend in ("emulate", "fp8")]
_DEFAULT_LANE = ("nvfp4_full", "fp8_mlperf")


@long_lane.parametrize(
    "name, backend", _CASES, default=[i for i, (name, _) in enumerate(_CASES) if name in _DEFAULT_LANE]
)
def test_presets_do_not_depend_on_folded_conversions(name, backend):
    """Every preset's forward and both gradients, on the back ends the CPU runs (fp8 as emulate where it
    does not fold, its own fold otherwise)."""
    recipe = dataclasses.replace(PRESETS[name], backend=backend)
    x, w, dy = _operands()
    meta = _fp8_meta(recipe) if recipe.uses_delayed_fp8 else None
    _assert_same_bits(*_both_ways(_layer(recipe, dy, meta), x, w), f"{name} on {backend}")


_FP8 = QuantSpec(kind="fp8", elem="e4m3")
_MIXED = {
    "nvfp4_x_fp8": (PRESETS["nvfp4_full"].fprop.lhs, _FP8),
    "fp8_x_mxfp4": (_FP8, PRESETS["mxfp4_full"].fprop.rhs),
    "fp8_x_float32": (_FP8, QuantSpec()),
}


@pytest.mark.parametrize("pair", list(_MIXED))
def test_fp8_against_other_kinds_does_not_depend_on_folded_conversions(pair):
    """A per-tensor FP8 operand times NVFP4, MXFP4 or float32 widens its FP8 data in the same program."""
    recipe = Recipe(fprop=GemmSpec(*_MIXED[pair]))
    x, w, dy = _operands()
    _assert_same_bits(*_both_ways(_layer(recipe, dy), x, w), pair)


def test_fp8_dequantize_does_not_depend_on_folded_conversions():
    x, _, _ = _operands()
    _assert_same_bits(*_both_ways(lambda v: quantize_fp8(v * 3.7).dequantize(), x), "FP8Array.dequantize")


def test_the_check_sees_a_rounding_that_folds_away():
    """The evaluator itself: float32 -> E4M3 -> float32 of off-grid values folds to the input."""
    x, _, _ = _operands()
    written, folded = _both_ways(lambda v: v.astype(jnp.float8_e4m3fn).astype(jnp.float32) * 2, x)
    assert np.array_equal(np.asarray(folded[0]), np.asarray(x) * 2)
    assert not np.array_equal(np.asarray(written[0]), np.asarray(folded[0]))
    written, folded = _both_ways(lambda v: float8_to_float32(v.astype(jnp.float8_e4m3fn)) * 2, x)
    _assert_same_bits(written, folded, "float8_to_float32")


@pytest.mark.parametrize("dtype", [jnp.float8_e4m3fn, jnp.float8_e5m2])
def test_float8_to_float32_decodes_every_code(dtype):
    """All 256 codes against ml_dtypes' conversion: the same float32 bits (every NaN as a NaN)."""
    codes = np.arange(256, dtype=np.uint8).view(jnp.dtype(dtype))
    want = codes.astype(np.float32)
    for got in (float8_to_float32(jnp.asarray(codes)), jax.jit(float8_to_float32)(jnp.asarray(codes))):
        got = np.asarray(got)
        assert got.dtype == np.float32
        nan = np.isnan(want)
        assert np.array_equal(np.isnan(got), nan)
        assert np.array_equal(got[~nan].view(np.uint32), want[~nan].view(np.uint32))  # -0 and subnormals too
    assert np.isinf(want).sum() == (2 if dtype == jnp.float8_e5m2 else 0)


def test_float8_to_float32_rejects_other_dtypes():
    with pytest.raises(ValueError, match="float8_e4m3fn or float8_e5m2 arrays, got bfloat16"):
        float8_to_float32(jnp.ones(3, jnp.bfloat16))
    with pytest.raises(ValueError, match="got float8_e8m0fnu"):
        float8_to_float32(jnp.asarray(np.ones(3, ml_dtypes.float8_e8m0fnu)))


# ----------------------------------------------------------------------------------------------------
# Divides: XLA:GPU lowers a float32 divide to div.full.f32 (up to 2 ulp from IEEE), XLA:CPU to IEEE.


def divide_off_by(ulps: int):
    """A divide that is never IEEE's: every finite non-zero quotient moved `ulps` (up if > 0, towards zero
    if < 0)."""

    def divide(a, b):
        q = a / b
        moved = q
        for _ in range(abs(ulps)):
            moved = jnp.nextafter(moved, jnp.float32(jnp.inf if ulps > 0 else 0))
        return jnp.where(jnp.isfinite(q) & (q != 0), moved, q)

    return divide


def _written_and_off_divided(f, *args):
    return _evaluated(f, *args), _evaluated(f, *args, divide=divide_off_by(1))


@long_lane.parametrize("name", ["nvfp4_full", "nvfp4_nvidia", "nvfp4_4over6", "nvfp4_quartet2"])
def test_nvfp4_does_not_depend_on_the_divides_rounding(name):
    """NVFP4's scales are quotients; they must be IEEE's on every back end (formats.divide_nearest_even)."""
    x, w, dy = _operands()
    written, off = _written_and_off_divided(_layer(PRESETS[name], dy), x * 1e-3, w)
    _assert_same_bits(written, off, f"{name} under a non-IEEE divide")


@pytest.mark.parametrize("backend", ["emulate", "fp8"])
@pytest.mark.parametrize("name", ["fp8", "fp8_mlperf", "mxfp4_fprop"])
def test_the_fp8_recipes_do_not_depend_on_the_divides_rounding(name, backend):
    """The per-tensor FP8 scale max / amax and the GEMM's reciprocal of the scales are IEEE's quotients
    (fp8_divide "ieee", every preset's), under current and delayed scaling and beside MX operands."""
    recipe = dataclasses.replace(PRESETS[name], backend=backend)
    x, w, dy = _operands()
    meta = _fp8_meta(recipe) if recipe.uses_delayed_fp8 else None
    _assert_same_bits(*_written_and_off_divided(_layer(recipe, dy, meta), x, w), f"{name} on {backend}")


@pytest.mark.parametrize("backend", ["emulate", "fp8"])
def test_fp8_divide_xla_keeps_the_back_ends_divide(backend):
    """fp8_divide "xla" is the program the 125M study's FP8 trunks were trained with: its quotients are the
    back end's own, so a divide one ulp off moves its outputs (the check would see IEEE's not move)."""
    recipe = dataclasses.replace(with_fp8_divide("fp8_mlperf", "xla"), backend=backend)
    x, w, dy = _operands()
    # _fp8_meta's amaxes would not do for Wgrad: with 448 / 30 and 57344 / 3 one ulp up in each scale and
    # one up in 1 / (product) cancel exactly; with 57344 / 2.5 they do not.
    meta = {**_fp8_meta(recipe), "grad": jnp.full((recipe.fp8_amax_history_len,), 2.5, jnp.float32)}
    written, off = _written_and_off_divided(_layer(recipe, dy, meta), x, w)
    moved = [not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(written, off, strict=True)]
    assert all(moved), f"outputs unmoved by a one-ulp divide under fp8_divide='xla': {moved}"


@pytest.mark.parametrize("case", ["odd_scales", "tiny_2^-90", "random"])
def test_the_nvfp4_quantizer_does_not_depend_on_the_divides_rounding(case):
    """Codes, scales and values of test_nvfp4's cases; odd E4M3 scales put |x * e_b| within an ulp of a
    rounding boundary, where a divide's last bit decides the code (these failed on an H200 before)."""
    from test_nvfp4 import CASES

    def codes_scales_values(x):
        q = quantize_nvfp4(x)
        return q.data.astype(jnp.float32), float8_to_float32(q.scale), q.global_scale, q.dequantize()

    written, off = _written_and_off_divided(codes_scales_values, jnp.asarray(CASES[case]()))
    _assert_same_bits(written, off, f"quantize_nvfp4 on {case} under a non-IEEE divide")


def test_the_divide_check_sees_a_quotient():
    x, _, _ = _operands()
    written, off = _written_and_off_divided(lambda v: v / 3.0, x)
    assert not np.array_equal(np.asarray(written[0]), np.asarray(off[0]))
