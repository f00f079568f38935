"""Recipes: defaults, the MLPerf FP8 preset and the fp8_scaling mapping, and SR with the 3/4 pre-scale
(unbiased, checked statistically against a slow reference written here)."""

import dataclasses
import inspect
import math

import jax
import jax.numpy as jnp
import lanes
import ml_dtypes
import numpy as np
import pytest
from flax import linen as nn

from fp4jax.models.llama import Llama, llama_config
from fp4jax.ops import PRESETS, mx_dot_general, quantize_mx
from fp4jax.ops.recipes import (
    FP8_DIVIDE_MODES,
    FP8_SCALING_MODES,
    QuantSpec,
    get_recipe,
    resolve_recipe,
    with_fp8_divide,
    with_fp8_scaling,
)

STAGES = ("fprop", "dgrad", "wgrad")


def _operand_specs(recipe):
    return [
        (stage, side, getattr(getattr(recipe, stage), side)) for stage in STAGES for side in ("lhs", "rhs")
    ]


def _has_fp8(recipe) -> bool:
    return any(s.kind == "fp8" for *_, s in _operand_specs(recipe))


# ----------------------------------------------------------------------------------------------------
# defaults


def test_quantspec_scale_mode_default_is_quantize_mx_default():
    assert QuantSpec().scale_mode == inspect.signature(quantize_mx).parameters["scale_mode"].default


def test_presets_set_their_mx_scale_rule_explicitly():
    """Changing QuantSpec's default must not change a preset: MXFP4 and MXFP6 operands use AMD's "even"
    rule (MXFP6 the MXFP4 operand's, so a format comparison changes the elements only) and MXFP8 operands
    NVIDIA's "ceil" rule; mxfp4_full_oas is the one preset of qwix's "oas" rule."""
    for name, recipe in PRESETS.items():
        for stage, side, spec in _operand_specs(recipe):
            if spec.kind == "mx":
                want = "even" if spec.elem in ("e2m1", "e2m3", "e3m2") else "ceil"
                want = "oas" if name == "mxfp4_full_oas" else want
                assert spec.scale_mode == want, (name, stage, side)


# ----------------------------------------------------------------------------------------------------
# the MLPerf FP8 baseline and the fp8_scaling mapping


def test_fp8_mlperf_is_te_hybrid_delayed_history_4_most_recent():
    r = PRESETS["fp8_mlperf"]
    formats = {(stage, side): (s.kind, s.elem, s.fp8_scaling) for stage, side, s in _operand_specs(r)}
    assert formats == {
        ("fprop", "lhs"): ("fp8", "e4m3", "delayed"),  # x
        ("fprop", "rhs"): ("fp8", "e4m3", "delayed"),  # W
        ("dgrad", "lhs"): ("fp8", "e5m2", "delayed"),  # dy
        ("dgrad", "rhs"): ("fp8", "e4m3", "delayed"),  # W
        ("wgrad", "lhs"): ("fp8", "e4m3", "delayed"),  # x
        ("wgrad", "rhs"): ("fp8", "e5m2", "delayed"),  # dy
    }
    assert (r.fp8_amax_history_len, r.fp8_amax_compute_algo) == (4, "most_recent")
    assert r.uses_delayed_fp8 and not r.needs_key


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("mode", FP8_SCALING_MODES)
def test_with_fp8_scaling_changes_only_fp8_scaling(name, mode):
    preset = PRESETS[name]
    got = with_fp8_scaling(name, mode)
    if mode == "preset" or not _has_fp8(preset):
        assert got == preset
        return
    for (_, _, a), (_, _, b) in zip(_operand_specs(preset), _operand_specs(got), strict=True):
        if a.kind == "fp8":
            assert b == dataclasses.replace(a, fp8_scaling=mode)
        else:
            assert b == a
    for stage in STAGES:
        assert getattr(got, stage).rotation == getattr(preset, stage).rotation
    assert (got.backend, got.name, got.needs_key) == (preset.backend, preset.name, preset.needs_key)
    if mode == "delayed":
        assert (got.fp8_amax_history_len, got.fp8_amax_compute_algo) == (4, "most_recent")
        assert got.uses_delayed_fp8
    else:
        assert not got.uses_delayed_fp8


@pytest.mark.parametrize("name", sorted(PRESETS))
@pytest.mark.parametrize("mode", FP8_DIVIDE_MODES)
def test_with_fp8_divide_changes_only_the_fp8_operands_divide(name, mode):
    preset = PRESETS[name]
    got = with_fp8_divide(name, mode)
    assert all(s.fp8_divide == "ieee" for *_, s in _operand_specs(preset))  # every preset's
    for (_, _, a), (_, _, b) in zip(_operand_specs(preset), _operand_specs(got), strict=True):
        want = a.kind == "fp8" and mode != "preset"
        assert b == (dataclasses.replace(a, fp8_divide=mode) if want else a)
    assert dataclasses.replace(got, **{g: getattr(preset, g) for g in STAGES}) == preset


def test_fp8_divide_is_checked_where_it_is_set():
    with pytest.raises(ValueError, match="unknown fp8_divide 'fast': use one of ieee, xla"):
        QuantSpec(kind="fp8", elem="e4m3", fp8_divide="fast")
    with pytest.raises(ValueError, match="fp8_divide applies to kind 'fp8'"):
        QuantSpec(kind="mx", fp8_divide="xla")
    with pytest.raises(ValueError, match="unknown fp8_divide 'fast': use one of preset, ieee, xla"):
        with_fp8_divide("fp8", "fast")
    assert resolve_recipe("fp8_mlperf", "preset", "preset", "xla") == with_fp8_divide("fp8_mlperf", "xla")


def test_the_config_key_fp8_divide_reaches_the_recipe():
    import ml_collections

    from fp4jax.configs import base
    from fp4jax.training import setup
    from fp4jax.training.errors import ConfigError

    assert base.get_config().fp8_divide == "preset"
    config = ml_collections.ConfigDict({"recipe": "mxfp4_fprop", "fp8_scaling": "delayed"})
    assert setup.run_recipe(config) == with_fp8_scaling("mxfp4_fprop", "delayed")  # a config without the key
    config.fp8_divide = "xla"
    assert setup.run_recipe(config).dgrad.lhs.fp8_divide == "xla"
    config.fp8_divide = "fast"
    with pytest.raises(ConfigError, match="^unknown fp8_divide 'fast'"):
        setup.run_recipe(config)


def test_fp8_under_delayed_scaling_is_the_mlperf_preset():
    assert with_fp8_scaling("fp8", "delayed") == dataclasses.replace(PRESETS["fp8_mlperf"], name="fp8")
    assert resolve_recipe("fp8_mlperf", "current") == dataclasses.replace(
        PRESETS["fp8"], name="fp8_mlperf", fp8_amax_history_len=4, fp8_amax_compute_algo="most_recent"
    )


def test_bad_fp8_scaling_and_amax_settings_are_one_line_errors():
    with pytest.raises(ValueError, match="fp8_scaling 'later'"):
        with_fp8_scaling("fp8", "later")
    with pytest.raises(ValueError, match="fp8_amax_compute_algo"):
        dataclasses.replace(get_recipe("fp8"), fp8_amax_compute_algo="mean")
    with pytest.raises(ValueError, match="fp8_amax_history_len"):
        dataclasses.replace(get_recipe("fp8"), fp8_amax_history_len=0)
    with pytest.raises(ValueError, match="prescale"):
        QuantSpec(kind="fp8", elem="e4m3", prescale=0.75)


def _fp8_fake_quant(v: np.ndarray, scale: float, dtype) -> np.ndarray:
    """Independent FP8 rounding: ml_dtypes' round-half-even cast (values chosen not to saturate)."""
    return (v * scale).astype(dtype).astype(np.float64) / scale


def test_most_recent_amax_sets_the_fp8_scale():
    """fprop under fp8_mlperf scales x by 448 / history[0] (the newest amax), not by the history's max."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((8, 64)).astype(np.float32)
    w = (rng.standard_normal((64, 16)) * 0.1).astype(np.float32)
    ax, aw = float(np.abs(x).max()), float(np.abs(w).max())
    meta = {  # newest entries above the true amax, so nothing saturates; older ones far larger
        "lhs": np.array([2 * ax, 64 * ax, 0, 0], np.float32),
        "rhs": np.array([3 * aw, 0, 80 * aw, 0], np.float32),
        "grad": np.ones(4, np.float32),
    }
    dims = (((1,), (0,)), ((), ()))
    y = mx_dot_general(x, w, dims, precision=jax.lax.Precision.HIGHEST, recipe="fp8_mlperf", fp8_meta=meta)
    e4m3 = ml_dtypes.float8_e4m3fn

    def reference(hx, hw):
        return _fp8_fake_quant(x, 448 / hx, e4m3) @ _fp8_fake_quant(w, 448 / hw, e4m3)

    want = reference(meta["lhs"][0], meta["rhs"][0])
    got = np.asarray(y, np.float64)
    if lanes.on_low_precision_tensor_cores("fp8", "fp8"):  # the GPU's FP8 accumulation (tests/lanes.py)
        xq = _fp8_fake_quant(x, 448 / meta["lhs"][0], e4m3)
        wq = _fp8_fake_quant(w, 448 / meta["rhs"][0], e4m3)
        bound = lanes.gemm_rtol("fp8", "fp8", x.shape[1]) * (np.abs(xq) @ np.abs(wq))
        assert np.all(np.abs(got - want) <= bound)
    else:
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-5 * np.abs(want).max())
    stale = reference(meta["lhs"].max(), meta["rhs"].max())  # what "max" would give: visibly different
    assert np.abs(stale - want).max() > 1e-3 * np.abs(want).max()
    assert np.abs(got - want).max() < np.abs(got - stale).max()  # and y is the newest amax's, on any lane


def test_delayed_rung_keeps_amax_histories_of_the_recipe_length():
    """The trainer's recipe (resolve_recipe) decides the fp8_meta shapes: 4 steps under "delayed"."""
    config = llama_config("tiny", vocab_size=256, dtype="float32", remat="none", n_layers=1)
    tokens = jnp.zeros((1, 8), jnp.int32)
    for recipe, length in ((resolve_recipe("mxfp4_fprop", "delayed"), 4), (get_recipe("fp8_delayed"), 1024)):
        shapes = jax.eval_shape(Llama(config, recipe).init, jax.random.key(0), tokens)
        leaves = jax.tree.leaves(nn.meta.unbox(shapes["fp8_meta"]))
        assert leaves and all(leaf.shape[-1] == length for leaf in leaves), recipe.name
    shapes = jax.eval_shape(
        Llama(config, resolve_recipe("mxfp4_fprop", "current")).init, jax.random.key(0), tokens
    )
    assert "fp8_meta" not in shapes


# ----------------------------------------------------------------------------------------------------
# stochastic rounding with the 3/4 pre-scale (Tseng et al. 2025), against a slow reference

E2M1_GRID = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def _even_exponent(amax: float) -> int:
    """The "even" rule, from its definition: amax's significand >= 1.75 rounds up a binade; e = floor - 2."""
    f = math.floor(math.log2(amax))
    if amax / 2.0**f >= 1.75:
        f += 1
    return f - 2  # E2M1's largest binade is 2^2


def _sr_moments(v: float) -> tuple[float, float]:
    """Mean and variance of stochastic rounding of |v| onto E2M1 (values above 6 saturate to 6)."""
    a = abs(v)
    if a >= 6.0:
        return math.copysign(6.0, v), 0.0
    hi = next(g for g in E2M1_GRID if g >= a)
    lo = max(g for g in E2M1_GRID if g <= a)
    return math.copysign(a, v), (hi - a) * (a - lo)  # mean = a: SR is unbiased inside the range


def reference_sr_moments(block: np.ndarray, prescale: float) -> tuple[np.ndarray, np.ndarray]:
    """Mean and variance, in x's units, of SR-quantizing one 32-element block with its values times
    `prescale` after the even scale is chosen, then divided by `prescale`."""
    e = _even_exponent(float(np.abs(block).max()))
    moments = np.array([_sr_moments(prescale * float(v) / 2.0**e) for v in block])
    unit = 2.0**e / prescale
    return moments[:, 0] * unit, moments[:, 1] * unit**2


# One block whose largest values lie in (6, 7) times its scale: they saturate under plain SR.
BLOCK = np.array(
    [6.9, -6.6, 6.3, 5.9, -5.1, 4.4, 3.3, -2.7, 2.2, 1.7, -1.2, 0.8, 0.3, -0.1, 0.0, 3.9]
    + list(np.linspace(-6.0, 6.0, 16)),
    np.float32,
)
# The same shape peaking at 8.8: plain SR does not saturate it (8.8 / 2 = 4.4), but choosing the scale
# after the pre-scale would (0.75 x 8.8 = 6.6): the scale must come from the block itself.
BLOCKS = {"top_6.9": BLOCK, "top_8.8": (BLOCK * np.float32(8.8 / 6.9)).astype(np.float32)}
DRAWS = 4000
K_SE = 5.0  # |mean - expected| <= 5 standard errors: a false alarm ~ 6e-7 per element


def _sr_draws(block: np.ndarray, prescale: float) -> np.ndarray:
    keys = jax.random.split(jax.random.key(7), DRAWS)
    quant = jax.jit(
        jax.vmap(
            lambda k: quantize_mx(
                jnp.asarray(block), scale_mode="even", rounding="stochastic", key=k, prescale=prescale
            ).dequantize()
        )
    )
    return np.asarray(quant(keys), np.float64) / prescale


def test_reference_says_plain_sr_is_biased_at_the_block_top_and_prescaled_sr_is_not():
    plain, _ = reference_sr_moments(BLOCK, 1.0)
    prescaled, _ = reference_sr_moments(BLOCK, 0.75)
    assert plain[0] == 6.0 and plain[1] == -6.0  # 6.9 and -6.6 saturate
    np.testing.assert_allclose(prescaled, BLOCK, rtol=1e-6, atol=0)


@pytest.mark.parametrize("block", sorted(BLOCKS))
@pytest.mark.parametrize("prescale", [1.0, 0.75])
def test_sr_draws_match_the_reference_in_expectation(prescale, block):
    block = BLOCKS[block]
    draws = _sr_draws(block, prescale)
    mean, var = reference_sr_moments(block, prescale)
    se = np.sqrt(var / DRAWS)
    err = np.abs(draws.mean(axis=0) - mean)
    assert np.all(err <= K_SE * se + 1e-6 * np.abs(block)), (err, se)
    # and every draw is a grid neighbour of the element: mean +- at most one grid step
    step = 2.0 ** (_even_exponent(float(np.abs(block).max())) + 1) / prescale  # E2M1's largest step, 2
    assert np.all(np.abs(draws - mean) <= step + 1e-6)
    if prescale == 0.75:  # unbiased for every element, the block's top included
        assert np.all(np.abs(draws.mean(axis=0) - block) <= K_SE * se + 1e-6 * np.abs(block))


def test_prescaled_sr_gemm_is_unbiased_where_plain_sr_is_not():
    """dx = dy W^T through mx_dot_general's Dgrad (both operands SR): averaged over draws it matches
    the exact product within K_SE standard errors under mxfp4_full_sr_prescale, and misses it far
    beyond that under mxfp4_full_sr (dy's rows peak at 6.9 x 2^k, which plain SR saturates)."""
    rng = np.random.default_rng(3)
    dy = np.tile(BLOCK, (4, 1)) * np.float32(2.0) ** np.arange(-1, 3, dtype=np.float32)[:, None]
    w = rng.standard_normal((32, 16)).astype(np.float32)  # y = x W^T: x (4, 16), W (32, 16), dy (4, 32)
    x = rng.standard_normal((4, 16)).astype(np.float32)
    dims = (((1,), (1,)), ((), ()))
    exact = dy.astype(np.float64) @ w.astype(np.float64)
    keys = jax.random.split(jax.random.key(11), 1000)

    def mean_and_se(recipe):
        def dx(key):
            _, vjp = jax.vjp(lambda a: mx_dot_general(a, w, dims, recipe=recipe, key=key), x)
            return vjp(jnp.asarray(dy))[0]

        d = np.asarray(jax.jit(jax.vmap(dx))(keys), np.float64)
        return d.mean(axis=0), d.std(axis=0, ddof=1) / np.sqrt(len(keys))

    mean, se = mean_and_se("mxfp4_full_sr_prescale")
    assert np.all(np.abs(mean - exact) <= K_SE * se + 1e-5 * np.abs(exact).max())
    mean, se = mean_and_se("mxfp4_full_sr")
    assert np.max(np.abs(mean - exact) / (se + 1e-12)) > 20
