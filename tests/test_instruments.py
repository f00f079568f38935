"""The mechanism instruments (fp4jax.instruments): planted errors through the same code the command
line runs, the update metrics on hand-computable AdamW steps, and the command on the tiny trained run."""

import dataclasses
import json
import math
import os
import shutil

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import pytest
from long_lane import SLOW
from tiny_runs import compilation_cache  # noqa: F401  (byte-level tokenizer for the tiny run's config)

from fp4jax import instruments as ins
from fp4jax.configs import base
from fp4jax.models import llama
from fp4jax.ops import get_recipe
from fp4jax.ops.recipes import MXFP4
from fp4jax.study.__main__ import main
from fp4jax.training.optimizer import make_optimizer

K = 4  # batches of the planted tests


# ----------------------------------------------------------------------------------------------------
# recipes and groups


@pytest.mark.parametrize("stage", ins.STAGES)
def test_stage_recipe_quantizes_its_gemm_only(stage):
    recipe, bf16 = ins.stage_recipe(stage), get_recipe("bf16")
    for name in ins.STAGES:
        gemm = getattr(recipe, name)
        if name == stage:
            assert gemm.lhs == gemm.rhs == MXFP4 and gemm.rotation == bf16.fprop.rotation
        else:
            assert gemm == getattr(bf16, name)
    assert not recipe.needs_key


def test_unknown_stage_is_a_one_line_error():
    with pytest.raises(ValueError, match="unknown GEMM stage 'bprop': use one of fprop, dgrad, wgrad"):
        ins.stage_recipe("bprop")


def test_param_groups_of_the_llama_tree():
    assert ins.param_group(["blocks_0_2", "attn", "q", "kernel"]) == "q"
    assert ins.param_group(["block_3", "mlp", "down", "kernel"]) == "down"
    assert ins.param_group(["blocks_0_2", "attn_norm", "scale"]) == "norm"
    assert ins.param_group(["final_norm", "scale"]) == "norm"
    assert ins.param_group(["embed", "embedding"]) == "embed"


# ----------------------------------------------------------------------------------------------------
# planted errors on a tiny model


@pytest.fixture(scope="module")
def tiny_model():
    """(model config, params, K batches of random tokens, bf16 gradient function) of a random tiny Llama."""
    cfg = llama.llama_config("tiny", vocab_size=256, remat="none", max_seq_len=16)
    tokens = jnp.zeros((1, 16), jnp.int32)
    # jitted: one program, where init run eagerly compiled each of its ops (and the forward pass's) alone
    init = jax.jit(lambda key: nn.meta.unbox(llama.init_variables(llama.Llama(cfg), {"params": key}, tokens)))
    params = init(jax.random.key(0))["params"]
    rng = np.random.default_rng(0)
    batches = []
    for _ in range(K):
        t = rng.integers(0, 256, (2, 17), dtype=np.int32)
        batches.append({"inputs": jnp.asarray(t[:, :-1]), "targets": jnp.asarray(t[:, 1:])})
    return cfg, params, batches, ins.loss_grad_fn(cfg, get_recipe("bf16"))


def planted(grad, batches, error):
    """grad_fn for `measure`: the bf16 gradient for stage None, plus error(k) for batch k otherwise."""

    def grad_fn(stage, params, batch):
        g = grad(params, batch)
        if stage is None:
            return g
        k = next(i for i, b in enumerate(batches) if b is batch)
        return jax.tree.map(jnp.add, g, error(k))

    return grad_fn


def identity_update(grads, opt_state, params):
    return grads


def group_sizes(tree) -> dict[str, int]:
    sizes = {}
    for group, leaf in zip(ins.leaf_groups(tree), jax.tree.leaves(tree), strict=True):
        for name in (group, ins.ALL):
            sizes[name] = sizes.get(name, 0) + leaf.size
    return sizes


def normal_like(tree, key, scale=1.0):
    leaves, treedef = jax.tree.flatten(tree)
    keys = jax.random.split(key, len(leaves))
    return treedef.unflatten(
        [scale * jax.random.normal(k, x.shape, jnp.float32) for k, x in zip(keys, leaves, strict=True)]
    )


def test_a_fixed_error_is_fully_coherent(tiny_model):
    """e_k = b for every k: ||K b|| / sqrt(K ||b||^2) = sqrt(K) exactly; only float32's rounding of
    (g + b) - g moves it (relative 1e-7 per element), so 1e-4 is a bound, not a fit."""
    _, params, batches, grad = tiny_model
    bias = normal_like(params, jax.random.key(1), 1e-3)
    result = ins.measure(
        planted(grad, batches, lambda k: bias), identity_update, params, None, batches, ["wgrad"]
    )
    coherence = {g: m["coherence"] for g, m in result["wgrad"]["gradient"].items()}
    assert set(coherence) >= {*llama_kinds(), "embed", "lm_head", "norm", ins.ALL}
    np.testing.assert_allclose(list(coherence.values()), math.sqrt(K), rtol=1e-4)


def llama_kinds():
    return ("q", "k", "v", "o", "gate", "up", "down")


def test_independent_zero_mean_errors_have_coherence_near_one(tiny_model):
    """e_k = n_k, i.i.d. N(0, s^2) over a group's D elements: C^2 = ||sum n_k||^2 / sum ||n_k||^2 =
    K chi2_D / chi2_KD, mean 1 + O(1/D), and by the delta method (Cov(||S||^2, sum ||n_k||^2) = 2 K D s^4)
    Var C^2 = 2 (1 - 1/K) / D. Held to 5 standard deviations per group (the smallest, the norm scales,
    has D = 320: |C^2 - 1| <= 0.43)."""
    _, params, batches, grad = tiny_model
    noise = lambda k: normal_like(params, jax.random.fold_in(jax.random.key(2), k), 1e-3)  # noqa: E731
    result = ins.measure(planted(grad, batches, noise), identity_update, params, None, batches, ["dgrad"])
    for group, d in group_sizes(params).items():
        c2 = result["dgrad"]["gradient"][group]["coherence"] ** 2
        assert abs(c2 - 1) <= 5 * math.sqrt(2 * (1 - 1 / K) / d), (group, d, c2)


def test_a_bias_under_noise_lies_between(tiny_model):
    """e_k = b + n_k, b and every n_k drawn N(0, s^2) per element (so ||b||^2 ~ E||n_k||^2 = D s^2):
    C^2 = ||K b + sum n_k||^2 / sum ||b + n_k||^2 -> (K^2 + K) / (2 K) = (K + 1) / 2 = 2.5 for K = 4. Over
    the whole model (D = 1.3e5) its spread is about 0.01 (the chi-square spreads of ||b||^2 and ||n_k||^2,
    sqrt(2 / D) each, and the cross terms <b, n_k>, sqrt(K / D)); held to 0.1."""
    _, params, batches, grad = tiny_model
    bias = normal_like(params, jax.random.key(3), 1e-3)
    error = lambda k: jax.tree.map(  # noqa: E731
        jnp.add, bias, normal_like(params, jax.random.fold_in(jax.random.key(4), k), 1e-3)
    )
    result = ins.measure(planted(grad, batches, error), identity_update, params, None, batches, ["fprop"])
    assert abs(result["fprop"]["gradient"][ins.ALL]["coherence"] ** 2 - (K + 1) / 2) <= 0.1


def test_an_error_that_follows_the_gradient_has_the_gradients_coherence(tiny_model):
    """e_k = c g(b_k): ||sum e_k|| / sqrt(sum ||e_k||^2) is the gradients' own ratio, whatever c (to
    float32 rounding)."""
    _, params, batches, grad = tiny_model
    scaled = lambda stage, p, b: jax.tree.map(lambda g: 1.25 * g, grad(p, b)) if stage else grad(p, b)  # noqa: E731
    result = ins.measure(scaled, identity_update, params, None, batches, ["wgrad"])
    for metrics in result["wgrad"]["gradient"].values():
        np.testing.assert_allclose(metrics["coherence"], metrics["grad_coherence"], rtol=1e-4)


def test_noise_ratio_against_a_numpy_reference(tiny_model):
    """With a planted error of known norm, noise_ratio = ||b|| / sqrt(mean over pairs ||g(A) - g(B)||^2),
    the pairs' gradients taken here, apart from the instruments, and compared in float64."""
    _, params, batches, grad = tiny_model
    bias = normal_like(params, jax.random.key(5), 1e-4)
    result = ins.measure(
        planted(grad, batches, lambda k: bias), identity_update, params, None, batches, ["wgrad"]
    )
    flat = lambda tree: np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])  # noqa: E731
    g = [flat(grad(params, b)) for b in batches]
    noise_ms = np.mean([np.sum((g[i] - g[i + 1]) ** 2) for i in range(0, K, 2)])
    expected = np.linalg.norm(flat(bias)) / math.sqrt(noise_ms)
    metrics = result["wgrad"]["gradient"][ins.ALL]
    np.testing.assert_allclose(metrics["noise_ratio"], expected, rtol=1e-4)
    np.testing.assert_allclose(metrics["grad_norm"], math.sqrt(np.mean([np.sum(x**2) for x in g])), rtol=1e-5)


def test_per_batch_errors_are_each_batchs_own_and_sum_to_the_whole(tiny_model):
    """e_k = (k + 1) b: batch k's squared error norm is (k + 1)^2 ||b||^2 (b's norm taken here in float64),
    in batch order, and the batches' errors make up err_norm."""
    _, params, batches, grad = tiny_model
    bias = normal_like(params, jax.random.key(7), 1e-3)
    error = lambda k: jax.tree.map(lambda x: (k + 1) * x, bias)  # noqa: E731
    result = ins.measure(planted(grad, batches, error), identity_update, params, None, batches, ["dgrad"])
    flat = np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(bias)])
    each = result["dgrad"]["per_batch"]["err_sq"]
    expected = [(k + 1) ** 2 * np.sum(flat**2) for k in range(K)]
    np.testing.assert_allclose(each[ins.ALL], expected, rtol=1e-4)
    assert set(each) == set(result["dgrad"]["gradient"])
    err_norm = result["dgrad"]["gradient"][ins.ALL]["err_norm"]
    np.testing.assert_allclose(math.sqrt(np.mean(each[ins.ALL])), err_norm, rtol=1e-6)


def test_sqrt3_ratio_of_a_planted_error_is_chmiels_formula(tiny_model):
    """e_k = b: sqrt3_ratio = sqrt(sum_k ||g_k||^2 / (3 K ||b||^2)) per group, the gradients and the
    norms taken here in float64; b scaled so the whole model sits near the threshold (ratio ~ 1)."""
    _, params, batches, grad = tiny_model
    flat = lambda tree: np.concatenate([np.asarray(x, np.float64).ravel() for x in jax.tree.leaves(tree)])  # noqa: E731
    g = [flat(grad(params, b)) for b in batches]
    grad_ms = np.mean([np.sum(x**2) for x in g])
    unit = normal_like(params, jax.random.key(6))
    bias = jax.tree.map(lambda x: x * math.sqrt(grad_ms / 3) / np.linalg.norm(flat(unit)), unit)
    result = ins.measure(
        planted(grad, batches, lambda k: bias), identity_update, params, None, batches, ["dgrad"]
    )
    expected = math.sqrt(grad_ms / (3 * np.sum(flat(bias) ** 2)))
    np.testing.assert_allclose(result["dgrad"]["gradient"][ins.ALL]["sqrt3_ratio"], expected, rtol=1e-4)
    np.testing.assert_allclose(expected, 1.0, rtol=1e-6)
    for group, metrics in result["dgrad"]["gradient"].items():
        ratio = metrics["grad_norm"] / (math.sqrt(3) * metrics["err_norm"])
        np.testing.assert_allclose(metrics["sqrt3_ratio"], ratio, rtol=1e-6, err_msg=group)


def test_micro_batches_are_grouped_disjointly_in_order():
    micro = [object() for _ in range(12)]
    groups = ins.group_micro_batches(micro, 4, 3)
    assert [len(grp) for grp in groups] == [3] * 4
    assert [m for grp in groups for m in grp] == micro  # each used once, group k = windows 3k .. 3k + 2
    with pytest.raises(ValueError, match="11 micro-batches for 4 batches x 3 accumulated"):
        ins.group_micro_batches(micro[:11], 4, 3)
    with pytest.raises(ValueError, match="--accumulate 0: give an integer >= 1"):
        ins.group_micro_batches(micro, 4, 0)


def test_accumulating_a_micro_batches_is_one_batch_a_times_larger(tiny_model):
    """The mean gradient over A = 2 micro-batches of 2 sequences is the gradient of the mean loss over the
    4 sequences concatenated (equal token counts), and every instrument reads the same through both."""
    cfg, params, _, _ = tiny_model
    # float32 activations: the tiny model's bf16 activations round the two paths' gradients apart (~1 %)
    grad = ins.loss_grad_fn(dataclasses.replace(cfg, dtype="float32"), get_recipe("bf16"))
    rng = np.random.default_rng(7)
    micro = []
    for _ in range(2 * K):
        t = rng.integers(0, 256, (2, 17), dtype=np.int32)
        micro.append({"inputs": jnp.asarray(t[:, :-1]), "targets": jnp.asarray(t[:, 1:])})
    groups = ins.group_micro_batches(micro, K, 2)
    large = [{key: jnp.concatenate([m[key] for m in grp]) for key in grp[0]} for grp in groups]
    mean_grad = ins.accumulated(lambda stage, p, b: grad(p, b))
    for grp, big in zip(groups, large, strict=True):
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(a, b, rtol=2e-5, atol=1e-7),
            mean_grad(None, params, grp),
            grad(params, big),
        )
    bias = normal_like(params, jax.random.key(8), 1e-3)
    accumulated = ins.measure(
        ins.accumulated(planted(grad, micro, lambda k: bias)),
        identity_update,
        params,
        None,
        groups,
        ["fprop"],
    )
    direct = ins.measure(
        planted(grad, large, lambda k: bias), identity_update, params, None, large, ["fprop"]
    )
    for part in ("gradient", "update"):
        for group, metrics in direct["fprop"][part].items():
            for name, value in metrics.items():
                got = accumulated["fprop"][part][group][name]
                np.testing.assert_allclose(got, value, rtol=1e-3, err_msg=f"{part} {group} {name}")


def test_the_command_parses_accumulate():
    from fp4jax.study.__main__ import build_parser

    args = build_parser().parse_args(["instruments", "--run", "R", "--out", "O", "--accumulate", "8"])
    assert args.accumulate == 8
    assert build_parser().parse_args(["instruments", "--run", "R", "--out", "O"]).accumulate == 1


def test_an_odd_number_of_batches_is_refused(tiny_model):
    _, params, batches, grad = tiny_model
    with pytest.raises(ValueError, match="even number >= 2 of batches, got 3"):
        ins.measure(planted(grad, batches, None), identity_update, params, None, batches[:3], ["wgrad"])


# ----------------------------------------------------------------------------------------------------
# the AdamW update's error


def optimizer_config(clip: float) -> ml_collections.ConfigDict:
    opt = base.get_config().optimizer
    opt.update(schedule="constant", peak_lr=1e-2, warmup_steps=1, weight_decay=0.1, b1=0.9, b2=0.95, eps=1e-8)
    opt.clip_grad_norm = clip
    return opt


def numpy_adamw(g, p, mu, nu, t, opt):
    """AdamW's update number t + 1 (mu, nu after t updates), global-norm clipping first, float64."""
    norm = np.linalg.norm(g)
    g = g * min(1.0, opt.clip_grad_norm / norm) if opt.clip_grad_norm > 0 else g
    mu, nu = opt.b1 * mu + (1 - opt.b1) * g, opt.b2 * nu + (1 - opt.b2) * g**2
    m_hat, v_hat = mu / (1 - opt.b1 ** (t + 1)), nu / (1 - opt.b2 ** (t + 1))
    return -opt.peak_lr * (m_hat / (np.sqrt(v_hat) + opt.eps) + opt.weight_decay * p)


def test_first_adam_update_is_a_sign_so_one_flipped_gradient_sign_is_visible():
    """At count 0 AdamW's update is -lr (sign(g) + wd p) (to eps): with p = 0 and one of four gradient
    signs flipped, u_q - u = 2 lr at one element and ||u|| = 2 lr: rel_err 1, cos 2/4, sign_agree 3/4."""
    tx, _ = make_optimizer(optimizer_config(clip=0.0))
    params = {"w": jnp.zeros((2, 2), jnp.float32)}
    g_ref = {"w": jnp.array([[1.0, -2.0], [3.0, -4.0]])}
    g_q = {"w": jnp.array([[1.0, -2.0], [3.0, 4.0]])}
    update = ins.update_fn(tx)
    state = tx.init(params)
    sums = jax.device_get(ins.update_sums(update(g_q, state, params), update(g_ref, state, params)))
    metrics = ins.update_metrics(sums)["w"]
    np.testing.assert_allclose(
        [metrics["rel_err"], metrics["cos"], metrics["sign_agree"]], [1, 0.5, 0.75], atol=1e-6
    )


def test_update_error_from_a_saved_optimizer_state_matches_numpy():
    """After one update (mu, nu, count = 1 and decayed params), with clipping active: the instruments'
    update is the run's optax chain (numpy reference to float32 rounding), and rel_err / cos / sign_agree
    are the pooled sums' definitions, recomputed here in float64."""
    opt = optimizer_config(clip=1.0)
    tx, _ = make_optimizer(opt)
    rng = np.random.default_rng(7)
    p0, g0 = rng.normal(size=(4, 8)), rng.normal(size=(4, 8))
    params = {"w": jnp.asarray(p0, jnp.float32)}
    state = tx.init(params)
    u0, state = tx.update({"w": jnp.asarray(g0, jnp.float32)}, state, params)
    params = {"w": params["w"] + u0["w"]}
    g_ref, g_q = rng.normal(size=(4, 8)), rng.normal(size=(4, 8))
    g_q = g_ref + 0.3 * g_q
    update = ins.update_fn(tx)
    u_q = update({"w": jnp.asarray(g_q, jnp.float32)}, state, params)
    u_ref = update({"w": jnp.asarray(g_ref, jnp.float32)}, state, params)
    # numpy: the state after update 1, then update 2 from each gradient
    g0c = g0 * min(1.0, 1.0 / np.linalg.norm(g0))
    mu, nu = (1 - opt.b1) * g0c, (1 - opt.b2) * g0c**2
    p1 = np.asarray(params["w"], np.float64)
    ref_q, ref_r = (numpy_adamw(g, p1, mu, nu, 1, opt) for g in (g_q, g_ref))
    np.testing.assert_allclose(np.asarray(u_q["w"]), ref_q, rtol=2e-5, atol=1e-9)
    np.testing.assert_allclose(np.asarray(u_ref["w"]), ref_r, rtol=2e-5, atol=1e-9)
    metrics = ins.update_metrics(jax.device_get(ins.update_sums(u_q, u_ref)))[ins.ALL]
    expected = [
        np.linalg.norm(ref_q - ref_r) / np.linalg.norm(ref_r),
        np.sum(ref_q * ref_r) / (np.linalg.norm(ref_q) * np.linalg.norm(ref_r)),
        np.mean(np.sign(ref_q) == np.sign(ref_r)),
    ]
    np.testing.assert_allclose(
        [metrics["rel_err"], metrics["cos"], metrics["sign_agree"]], expected, rtol=1e-4
    )


# ----------------------------------------------------------------------------------------------------
# the command on the tiny trained run (checkpoints 2, 4, 6)


@SLOW
def test_command_on_the_tiny_run(good_run, tmp_path, capsys):
    out = tmp_path / "instruments"
    argv = ["instruments", "--run", str(good_run), "--out", str(out), "--batches", "2", "--batch", "2"]
    assert main([*argv, "--accumulate", "2"]) == 0
    printed = capsys.readouterr().out
    assert "noise_ratio" in printed and "wgrad" in printed
    result = json.loads((out / "instruments.json").read_text())
    assert list(result["steps"]) == ["2", "4", "6"] and result["stages"] == list(ins.STAGES)
    assert result["accumulate"] == 2 and result["tokens_per_step"] == 2 * 2 * result["seq_len"]
    for step in result["steps"].values():
        for stage in ins.STAGES:
            g, u = step[stage]["gradient"], step[stage]["update"]
            assert set(g) == set(u) >= {*llama_kinds(), ins.ALL}
            assert 0 < g[ins.ALL]["noise_ratio"] < math.inf and 0 <= g[ins.ALL]["coherence"] <= math.sqrt(2)
            assert -1 <= u[ins.ALL]["cos"] <= 1 and 0 <= u[ins.ALL]["sign_agree"] <= 1
            assert 0 < g[ins.ALL]["sqrt3_ratio"] < math.inf
    # the same params and batches at each step for the bf16 shadow: its gradient differs between steps
    norms = [result["steps"][s]["wgrad"]["gradient"][ins.ALL]["grad_norm"] for s in ("2", "4", "6")]
    assert len(set(norms)) == 3
    assert sorted(p.name for p in out.iterdir()) == sorted(
        ["instruments.json", "instruments.txt"] + [f"instruments_{s}.png" for s in ins.STAGES]
    )


def test_checkpoint_state_is_the_runs_own(good_run):
    """load_state reads the trainer's TrainState: its params are the ones fp4jax.diagnose reads alone
    (another restore path), bit for bit, and AdamW's count is the step."""
    from fp4jax import diagnose
    from fp4jax.training import setup

    assert ins.verified_steps(str(good_run), [4]) == [4]
    config = ins.run_config(str(good_run), 4)
    model_cfg = setup.model_config(config, 384)
    tx, _ = make_optimizer(config.optimizer)
    params, opt_state = ins.load_state(str(good_run), 4, ins.abstract_state(config, model_cfg, tx))
    alone = diagnose.restore_params(str(good_run / "checkpoints" / "4"))
    jax.tree.map(np.testing.assert_array_equal, params, alone)
    counts = [int(x) for x in jax.tree.leaves(opt_state) if np.ndim(x) == 0]
    assert counts and set(counts) == {4}


def test_command_names_the_steps_a_run_has_and_the_stages(good_run, tmp_path, capsys):
    argv = ["instruments", "--run", str(good_run), "--out", str(tmp_path), "--steps", "5"]
    assert main(argv) == 2
    assert "has no checkpoint at step 5 (it has: 2, 4, 6); set --steps" in capsys.readouterr().err
    argv = ["instruments", "--run", str(good_run), "--out", str(tmp_path), "--stages", "wgrad,wgrad"]
    assert main(argv) == 2
    assert "give distinct ones of fprop, dgrad, wgrad" in capsys.readouterr().err


def test_command_refuses_a_checkpoint_that_fails_its_manifest(good_run, tmp_path, capsys):
    """A step whose file was changed in place (same size) is a one-line error, exit 2, before any model."""
    run = tmp_path / "run"
    shutil.copytree(good_run / "checkpoints" / "2", run / "checkpoints" / "2")
    files = [os.path.join(d, f) for d, _, fs in os.walk(run / "checkpoints" / "2" / "state") for f in fs]
    with open(max(files, key=os.path.getsize), "r+b") as f:
        head = f.read(64)
        f.seek(0)
        f.write(bytes(255 - b for b in head))
    argv = ["instruments", "--run", str(run), "--out", str(tmp_path / "out"), "--steps", "2"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert f"--run checkpoint {run / 'checkpoints' / '2'} is bad: " in err and "choose another step" in err
    assert err.count("\n") == 1


def test_next_batches_are_the_ones_the_run_trains_on_after_the_checkpoint(good_run):
    """--data next: after checkpoint 4 the run's own iterator, read from the start of its data, gives
    batches 5, 6, ... of the run; next_training_batches gives the same from the checkpoint's data state,
    also at another batch size (the windows in the same order)."""
    from fp4jax.data.iterator import make_train_iterator
    from fp4jax.training import setup

    config = ins.run_config(str(good_run), 4)
    tokenizer = setup.load_tokenizer(config.data.tokenizer)
    gb = config.global_batch
    from_start = make_train_iterator(
        config.data, tokenizer, seq_len=config.seq_len, global_batch=gb, seed=config.seed, progress=False
    )
    for _ in range(4):
        next(from_start)
    expected = [next(from_start) for _ in range(2)]
    got = ins.next_training_batches(str(good_run), 4, config, tokenizer, n=2, batch=gb)
    for e, g in zip(expected, got, strict=True):
        for key in ("inputs", "targets"):
            np.testing.assert_array_equal(g[key], e[key])
    halves = ins.next_training_batches(str(good_run), 4, config, tokenizer, n=4, batch=gb // 2)
    np.testing.assert_array_equal(
        np.concatenate([h["inputs"] for h in halves]), np.concatenate([e["inputs"] for e in expected])
    )


def test_next_batches_refuse_to_run_into_seen_text(good_run):
    config = ins.run_config(str(good_run), 4)
    from fp4jax.training import setup

    tokenizer = setup.load_tokenizer(config.data.tokenizer)
    with pytest.raises(
        ValueError, match=r"--data next at step 4: .* unseen ones are left in the epoch; ask for fewer"
    ):
        ins.next_training_batches(str(good_run), 4, config, tokenizer, n=10**6, batch=config.global_batch)


def test_the_command_measures_on_the_next_batches(good_run, tmp_path, capsys):
    """One stage (wgrad): the data mode is what is tested here, and each stage compiles its own gradient
    (all three: 13 s alone, one: 6 s); every stage is run by the long lane's test_command_on_the_tiny_run."""
    out = tmp_path / "next"
    argv = ["instruments", "--run", str(good_run), "--out", str(out), "--batches", "2", "--batch", "2"]
    assert main([*argv, "--steps", "2,4", "--stages", "wgrad", "--data", "next"]) == 0
    result = json.loads((out / "instruments.json").read_text())
    assert result["data"] == "next" and list(result["steps"]) == ["2", "4"] and result["stages"] == ["wgrad"]
    assert main([*argv, "--data", "next", "--seq-len", "8"]) == 2
    assert "--data next reads the run's own windows" in capsys.readouterr().err
