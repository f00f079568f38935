"""fp4jax.gemm_errors: each statistic against an independent computation, and the study's orderings.

The GEMM-level tests build operands directly; the model-level ones use a tiny Llama whose seven linear
layers all have one shape (d_model = d_ff = n_heads * head_dim = 64), so every statistic compiles once.
"""

import functools
import json
import math
import os

import flax.linen as nn
import jax
import jax.numpy as jnp
import mx_reference as ref
import numpy as np
import pytest
from helpers import random_operands

from fp4jax import gemm_errors as diag
from fp4jax.models.llama import Llama, llama_config
from fp4jax.ops import GemmSpec, get_recipe, mx_dot_general
from fp4jax.ops.quantized_dot import quantize_operand
from fp4jax.ops.recipes import MXFP4, MXFP4_SR, MXFP4_SR_PRESCALE

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SQUARE = dict(vocab_size=256, d_model=64, n_heads=4, n_kv_heads=4, head_dim=16, d_ff=64, n_layers=2)


def _operands(seed=0, m=64, k=64, n=32, dtype=jnp.float32):
    """Gaussian x, w, dy in the canonical (1, M, K), (1, N, K), (1, M, N) layout."""
    x, w, dy = random_operands(seed, (1, m, k), (1, n, k), (1, m, n), scales=(1, 0.02, 1e-3), dtype=dtype)
    return diag.LayerOperands(x=x, w=w, dy=dy)


@functools.cache
def _jitted_layer_stats(recipe_name: str, n_draws: int = 0):
    recipe = get_recipe(recipe_name)
    return jax.jit(lambda ops, key: diag.layer_stats(ops, recipe, key, n_draws=n_draws))


def test_bf16_reports_zero_error_and_no_operand_statistics():
    stats = _jitted_layer_stats("bf16")(_operands(dtype=jnp.bfloat16), None)
    for gemm in diag.GEMMS:
        assert set(stats[gemm]) == {"out_err_sq", "out_ref_sq", "out_rel_err", "out_cos"}  # nothing quantized
        assert float(stats[gemm]["out_rel_err"]) <= 1e-6  # exact products, float32 summation order only
        assert float(stats[gemm]["out_cos"]) == pytest.approx(1.0, abs=1e-6)


def test_fp8_errors_are_smaller_than_mxfp4s():
    ops = _operands(seed=1)
    fp8 = _jitted_layer_stats("fp8")(ops, None)
    mx = _jitted_layer_stats("mxfp4_full")(ops, None)
    for gemm, (a, c) in diag.OPERAND_NAMES.items():
        assert float(fp8[gemm]["out_rel_err"]) < float(mx[gemm]["out_rel_err"])
        assert float(fp8[gemm]["out_cos"]) > float(mx[gemm]["out_cos"])
        for name in (a, c):
            assert float(fp8[gemm][f"{name}_rel_err"]) < float(mx[gemm][f"{name}_rel_err"])
    # On Gaussian data E2M1 blocks err by ~10 % per operand, E4M3 by ~2.5 %, E5M2 (dy) by ~5 %.
    assert 0.05 < float(mx["fprop"]["x_rel_err"]) < 0.2
    assert float(fp8["fprop"]["x_rel_err"]) < float(mx["fprop"]["x_rel_err"]) / 3


def _blocks_topped_at(value: float, shape, seed: int) -> jax.Array:
    """Uniform(-1, 1) values whose every 32-block along the last axis has absolute maximum `value`."""
    rng = np.random.default_rng(seed)
    x = rng.uniform(-1, 1, shape).astype(np.float32)
    blocks = x.reshape(*shape[:-1], -1, 32)
    blocks[..., 0] = value * np.sign(blocks[..., 0] + 0.5)
    return jnp.asarray(blocks.reshape(shape))


STATS_DRAWS = 32
BIAS_SIGMAS = 4.0  # the stated tolerance: an unbiased rounding's bias is within 4 standard errors of 0


@functools.cache
def _sr_gemm_stats(top: float, spec=MXFP4_SR):
    gemm = GemmSpec(spec, spec)
    a = _blocks_topped_at(top, (1, 32, 128), seed=2)
    c = _blocks_topped_at(top, (1, 16, 128), seed=3)
    fn = jax.jit(lambda a, c, k: diag.gemm_stats(a, c, gemm, k, n_draws=STATS_DRAWS))
    return jax.device_get(fn(a, c, jax.random.key(4)))


def test_stochastic_rounding_is_unbiased_within_the_stated_standard_errors():
    # Block maxima of exactly 1 = 2^0: the even scale puts them at 4, so nothing reaches 6 and SR is unbiased.
    stats = _sr_gemm_stats(1.0)
    assert stats["a_sat"] == 0 and stats["c_sat"] == 0
    assert stats["out_bias_se"] > 0 and stats["out_var_rel"] > 0
    assert stats["out_bias_rel"] <= BIAS_SIGMAS * stats["out_bias_se"]
    assert stats["out_bias_net"] <= BIAS_SIGMAS * stats["out_bias_se"]
    # The bias estimate of an unbiased rounding is its noise floor: close to one standard error.
    assert stats["out_bias_rel"] == pytest.approx(stats["out_bias_se"], rel=0.5)
    # One draw's relative noise and the operand error agree in size with the spread of the draws.
    assert math.sqrt(stats["out_var_rel"]) == pytest.approx(stats["out_bias_se"] * math.sqrt(STATS_DRAWS))


def test_stochastic_rounding_bias_from_saturation_is_detected():
    # Block maxima of 1.625 x 2^k sit at 6.5 after the even scale: they clip to 6, a bias SR cannot undo.
    stats = _sr_gemm_stats(1.625)
    assert stats["a_sat"] > 0
    assert stats["out_bias_rel"] > BIAS_SIGMAS * stats["out_bias_se"]
    assert stats["out_bias_net"] == pytest.approx(stats["out_bias_rel"], rel=0.05)  # the noise is small
    # The 3/4 prescale (Tseng et al. 2025) keeps those values inside the range: unbiased again.
    prescaled = _sr_gemm_stats(1.625, MXFP4_SR_PRESCALE)
    assert prescaled["a_sat"] == 0 and prescaled["c_sat"] == 0
    assert prescaled["out_bias_rel"] <= BIAS_SIGMAS * prescaled["out_bias_se"]


def test_h16_lowers_operand_error_on_outlier_channels():
    rng = np.random.default_rng(5)
    x = rng.standard_normal((1, 128, 256)).astype(np.float32)
    outliers = rng.choice(256, size=8, replace=False)
    x[..., outliers] *= 20.0  # a few input channels 20x larger, as in trained LLM activations
    w = 0.02 * rng.standard_normal((1, 64, 256)).astype(np.float32)
    stats = jax.jit(lambda x, w, recipe: diag.gemm_stats(x, w, get_recipe(recipe).fprop), static_argnums=2)
    plain, h16 = (stats(jnp.asarray(x), jnp.asarray(w), r) for r in ("mxfp4_full", "mxfp4_full_h16"))
    assert float(h16["a_rel_err"]) < 0.8 * float(plain["a_rel_err"])  # ~0.11 against ~0.16
    assert float(h16["a_flush"]) < float(plain["a_flush"])  # the outlier no longer flushes its block
    assert float(h16["out_rel_err"]) < float(plain["out_rel_err"])


def test_flush_saturation_and_exponents_against_numpy():
    rng = np.random.default_rng(6)
    blocks = rng.standard_normal((4, 8, 32)).astype(np.float32) * np.exp2(rng.integers(-6, 6, (4, 8, 1)))
    blocks[0, :, 1] = 0.0  # exact zeros are neither flushed nor counted
    blocks[1, :, 0] = 1e3 * np.abs(blocks[1, :, 0]) + 1.0  # outliers: their blocks flush small elements
    blocks[2, :, 0] = np.float32(1.7) * np.exp2(np.float32(3))  # even scale: amax lands at 6.8, clips
    x = blocks.reshape(1, 4, 256)
    spec = MXFP4
    stats_fn = jax.jit(lambda x: diag.operand_stats(x, quantize_operand(x, spec, None, None), spec))
    stats = jax.device_get(stats_fn(x))

    reference = ref.quantize_mx(x, axis=-1, elem="e2m1", block_size=32, scale_mode="even")
    deq = reference.dequantize64()
    scaled = ref.scaled_values(x, axis=-1, block_size=32, elem="e2m1", scale_mode="even")
    nonzero = x != 0
    assert stats["flush"] == pytest.approx(np.sum(nonzero & (deq == 0)) / np.sum(nonzero))
    assert stats["sat"] == pytest.approx(np.sum(nonzero & (np.abs(scaled) > 6.0)) / np.sum(nonzero))
    assert stats["flush"] > 0.01 and stats["sat"] > 0.01  # the crafted blocks do both
    assert stats["exp_min"] == reference.exp.min() and stats["exp_max"] == reference.exp.max()
    err = np.linalg.norm(deq - x) / np.linalg.norm(x)
    cos = np.sum(deq * x) / (np.linalg.norm(deq) * np.linalg.norm(x))
    assert stats["rel_err"] == pytest.approx(err, rel=1e-5)
    assert stats["cos"] == pytest.approx(cos, rel=1e-6)


@pytest.mark.parametrize("recipe", ["fp8", "mxfp4_full_sr_prescale", "mxfp4_full_rht"])
def test_recomputed_gemms_are_the_ones_mx_dot_general_runs(recipe):
    ops = _operands(seed=7)
    key = jax.random.key(8)
    r = get_recipe(recipe)

    @jax.jit
    def both(ops, key):
        dims = (((1,), (1,)), ((), ()))  # y[m, n] = sum_k x[m, k] w[n, k]
        y, vjp = jax.vjp(lambda x, w: mx_dot_general(x, w, dims, recipe=r, key=key), ops.x[0], ops.w[0])
        dx, dw = vjp(ops.dy[0])
        ours = {
            g: diag.quantized_output(*diag.gemm_operands(ops, g), getattr(r, g), jax.random.fold_in(key, i))[
                0
            ]
            for g, i in diag.GEMM_INDEX.items()
        }
        return {"fprop": y, "dgrad": dx, "wgrad": dw.T}, ours

    theirs, ours = both(ops, key)
    for gemm in diag.GEMMS:
        np.testing.assert_array_equal(np.asarray(ours[gemm]), np.asarray(theirs[gemm]))


@pytest.fixture(scope="module")
def tiny():
    cfg = llama_config("tiny", **SQUARE)
    model = Llama(cfg, recipe="mxfp4_full_sr")
    tokens = jax.random.randint(jax.random.key(0), (2, 33), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(1), batch["inputs"])["params"])
    return model, params, batch


def test_capture_matches_the_models_own_gradients(tiny):
    model, params, batch = tiny
    loss, operands = jax.jit(functools.partial(diag.capture_operands, model.config))(params, batch)
    assert sorted(operands) == [(i, k) for i in range(2) for k in sorted(diag.LAYER_KINDS)]
    # dW from the captured x and dy equals the gradient the (bf16) model itself computes.
    bf16 = Llama(model.config, recipe="bf16")

    def loss_fn(p):
        logits = bf16.apply({"params": p}, batch["inputs"])
        return jnp.mean(
            jax.nn.logsumexp(logits, -1)
            - jnp.take_along_axis(logits, batch["targets"][..., None], -1)[..., 0]
        )

    want_loss, grads = jax.jit(jax.value_and_grad(loss_fn))(params)
    assert float(loss) == pytest.approx(float(want_loss), rel=1e-3)  # bf16 activations, other fusion
    ops = operands[(1, "up")]
    dw_kn = jnp.einsum("bmk,bmn->kn", ops.x.astype(jnp.float32), ops.dy.astype(jnp.float32))
    want = grads["blocks_0_2"]["mlp"]["up"]["kernel"][1]
    assert float(jnp.linalg.norm(dw_kn - want) / jnp.linalg.norm(want)) < 0.02  # bf16 rounding only


def test_probe_runs_under_jit_and_returns_finite_scalars(tiny):
    model, params, batch = tiny
    probe = diag.make_training_probe(model, "mxfp4_full_sr", n_draws=2)
    out = jax.device_get(jax.jit(probe)(params, batch, jax.random.key(2)))
    assert all(np.isfinite(v) and np.ndim(v) == 0 for v in out.values())
    assert all(k.startswith("diag/") for k in out)
    for kind in diag.LAYER_KINDS:
        assert 0 < out[f"diag/{kind}/wgrad/out_rel_err"] < 1
        assert out[f"diag/{kind}/wgrad/out_bias_se"] > 0  # SR draws on wgrad
        assert f"diag/{kind}/fprop/out_bias_rel" not in out  # fprop rounds to nearest: no draws
    assert 0 < out["diag/layer_01/wgrad/out_rel_err"] < 1
    assert len(out) < 400  # moderate: per kind and GEMM, plus one per layer


def test_cli_writes_table_json_and_plot(tmp_path, capsys):
    from fp4jax import diagnose

    out = tmp_path / "diag"
    args = [
        "diagnose",
        f"--config={os.path.join(ROOT, 'configs', 'tiny_c4_h16.py')}",
        "--recipes=bf16,mxfp4_full",
        "--batches=1",
        "--batch=1",
        "--seq-len=32",
        "--data=synthetic",
        f"--out={out}",
        *(f"--config.model.{k}={v}" for k, v in SQUARE.items()),
    ]
    assert diagnose.main(args) == 0
    table = capsys.readouterr().out
    assert "mxfp4_full" in table and "dW" in table and "gate" in table
    result = json.loads((out / "diagnose.json").read_text())
    by_kind = result["recipes"]["mxfp4_full"]["by_kind"]
    assert set(by_kind) == set(diag.LAYER_KINDS)
    assert (
        by_kind["up"]["wgrad"]["out_rel_err"]
        > result["recipes"]["bf16"]["by_kind"]["up"]["wgrad"]["out_rel_err"]
    )
    assert (out / "diagnose.png").stat().st_size > 0
    # bf16 through the whole path (capture, layout, reference): zero error up to float32 summation order.
    bf16 = result["recipes"]["bf16"]["by_kind"]
    assert max(bf16[k][g]["out_rel_err"] for k in diag.LAYER_KINDS for g in diag.GEMMS) <= 1e-6
    assert all(set(bf16[k][g]) == {"out_rel_err", "out_cos"} for k in diag.LAYER_KINDS for g in diag.GEMMS)


def test_cli_rejects_an_unknown_recipe_in_one_line(tmp_path, capsys):
    from fp4jax import diagnose

    args = ["diagnose", f"--config={os.path.join(ROOT, 'configs', 'tiny_c4_h16.py')}", "--recipes=bf16,nope"]
    assert diagnose.main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "nope" in err[0]


def test_params_restore_from_a_trainer_checkpoint(tmp_path, tiny):
    import optax
    import orbax.checkpoint as ocp

    from fp4jax import diagnose
    from fp4jax.training.state import TrainState

    _, params, _ = tiny
    state = TrainState(step=jnp.int32(5), params=params, opt_state=optax.adam(1e-3).init(params), fp8_meta={})
    ckptr = ocp.StandardCheckpointer()
    ckptr.save(tmp_path / "run" / "checkpoints" / "5" / "state", state)  # the trainer's layout
    ckptr.wait_until_finished()
    for path in ("run", "run/checkpoints", "run/checkpoints/5"):
        restored = diagnose.restore_params(str(tmp_path / path))
        jax.tree.map(np.testing.assert_array_equal, restored, params)
    with pytest.raises(diagnose.UsageError, match="no checkpoint"):
        diagnose.restore_params(str(tmp_path))


def test_the_study_reads_the_gemm_names_the_probe_writes():
    """One list of GEMM names: the Recipe's fields in Recipe.gemms order, the probe's keys, the study's."""
    from fp4jax.study import analysis

    recipe = get_recipe("mxfp4_fprop_dgrad")  # fprop and dgrad MXFP4, wgrad FP8: the order shows
    assert tuple(getattr(recipe, g) for g in diag.GEMMS) == recipe.gemms
    assert analysis.GEMMS == diag.GEMMS == ("fprop", "dgrad", "wgrad")


def test_cli_help_shows_the_usage_lines_and_every_flags_help(capsys):
    from fp4jax import diagnose

    with pytest.raises(SystemExit) as stop:
        diagnose.parse_flags(["diagnose", "--help"])
    text = capsys.readouterr().out
    assert stop.value.code == 0 and "no help available" not in text
    assert (
        "    python -m fp4jax.diagnose --config configs/llama125m_pg_h16.py [--checkpoint RUN_DIR] \\\n"
        in text
    )
    assert "--recipes: comma-separated recipe presets" in text
