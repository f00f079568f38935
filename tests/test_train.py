"""The trainer: optimizer, the update (grad_accum, global-norm clipping, stochastic rounding keys),
sharded == unsharded step, loss falls, bit-identical resume, the run summary (training/summary.py) and
what a run says, the divergence rule, step timing, the diagnostics probe and the profiler switch.

Faults (bad checkpoints, signals, bad input, a full disk) are in test_faults.py. Tiny runs on the 8 fake
CPU devices of conftest.py (helpers: tiny_runs.py).
"""

import contextlib
import functools
import json
import os
import types

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import Mesh
from long_lane import SLOW
from tiny_runs import (
    compare,
    compilation_cache,
    record_dispatch_and_fetch,
    tiny_config,
    train_losses,
)

from fp4jax.models.sharding import MESH_AXES, make_mesh, sharding_context
from fp4jax.ops import get_recipe
from fp4jax.train import train
from fp4jax.training import checkpoint, integrity, metrics, setup
from fp4jax.training import summary as summaries
from fp4jax.training.divergence import DivergenceGuard
from fp4jax.training.metrics import read_metrics
from fp4jax.training.optimizer import lr_schedule, make_optimizer, mlperf_lr

FIXTURES = (compilation_cache,)  # pytest finds it here (the session's tiny-run fixtures: conftest.py)

# ------------------------------------------------------------------------------------------- optimizer


def test_mlperf_lr_table_and_schedule():
    assert mlperf_lr(32) == (8e-4, 128) and mlperf_lr(128) == (2e-3, 256)
    with pytest.raises(ValueError, match="global batches"):
        mlperf_lr(48)
    schedule = lr_schedule(1.0, warmup_steps=4, decay_steps=14, end_ratio=0.1)
    lrs = [float(schedule(c)) for c in range(20)]
    np.testing.assert_allclose(lrs[:4], [0.25, 0.5, 0.75, 1.0])  # update c + 1 of the warmup
    assert lrs[8] == pytest.approx(0.1 + 0.9 * 0.5 * (1 + np.cos(np.pi * 5 / 10)))
    np.testing.assert_allclose(lrs[13:], 0.1)  # cosine ends at 0.1 x peak, then stays


def test_weight_decay_skips_norm_scales():
    cfg = tiny_config("unused").optimizer
    tx, _ = make_optimizer(cfg)
    params = {"scale": jnp.ones((4,)), "kernel": jnp.ones((4, 4))}
    zero = jax.tree.map(jnp.zeros_like, params)
    updates, _ = jax.jit(tx.update)(zero, jax.jit(tx.init)(params), params)  # eagerly: 50 programs
    assert float(jnp.abs(updates["scale"]).max()) == 0.0  # no gradient, no decay
    assert float(updates["kernel"][0, 0]) == pytest.approx(-cfg.peak_lr / cfg.warmup_steps * cfg.weight_decay)


# ------------------------------------------------------------------------------------ sharded step


@contextlib.contextmanager
def _train_step(config, mesh):
    """Inside `mesh`'s sharding context, the trainer's jitted step of `config` (a 256-token vocabulary):
    .train_fn, .state (freshly initialised; the step donates it), .shardings, .init() (a copy of that
    fresh state, for another run from step 0: initialising is deterministic, and tracing the init again
    took over a second a call) and .batch(tokens) (inputs and targets of (batch, seq_len + 1) tokens, on the
    mesh)."""

    class Tok:
        name, vocab_size = "test", 256

    with sharding_context(mesh):
        model, _ = setup.build_model(config, Tok())
        tx, schedule = make_optimizer(config.optimizer)

        state, shardings = setup.init_train_state(model, tx, mesh, config.seed, config.seq_len)
        pristine = jax.tree.map(jnp.copy, state)  # before the step donates `state`
        yield types.SimpleNamespace(
            train_fn=setup.jit_steps(config, model, tx, schedule, mesh, shardings)[0],
            state=state,
            shardings=shardings,
            init=lambda: jax.tree.map(jnp.copy, pristine),
            batch=lambda tokens: setup.device_batch(
                {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, mesh
            ),
        )


def _one_update(config, mesh, tokens, with_opt_state=False):
    """One update of `tokens` on `mesh`: its metrics, its change to every parameter, its shardings (and
    the optimizer state after it)."""
    with _train_step(config, mesh) as step:
        initial = jax.device_get(step.state.params)
        shardings = step.shardings
        state, step_metrics = step.train_fn(step.state, step.batch(tokens), jax.random.key(7))
    update = jax.tree.map(lambda new, old: new - old, jax.device_get(state.params), initial)
    if with_opt_state:
        return jax.device_get(step_metrics), update, shardings, state.opt_state
    return jax.device_get(step_metrics), update, shardings


def _update_differences(update, want) -> list[float]:
    """Per parameter: |update - want| / |want| (Frobenius norms)."""
    pairs = zip(jax.tree.leaves(update), jax.tree.leaves(want), strict=True)
    return [float(np.linalg.norm(u - w) / np.linalg.norm(w)) for u, w in pairs]


def _tiny_float32(token_cache, **overrides):
    """The tiny config on one device's worth of work: a 256-token vocabulary, float32 compute."""
    config = tiny_config(token_cache, **overrides)
    config.model.update(vocab_size=256, dtype="float32")
    return config


ONE_DEVICE = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), MESH_AXES)


def _adam_first_moment(opt_state) -> list[np.ndarray]:
    """Adam's mu (its leaves) in an optimizer state of make_optimizer."""
    (adam,) = [
        s
        for s in jax.tree.leaves(opt_state, is_leaf=lambda x: isinstance(x, optax.ScaleByAdamState))
        if isinstance(s, optax.ScaleByAdamState)
    ]
    return [np.asarray(m) for m in jax.tree.leaves(jax.device_get(adam.mu))]


def test_grad_accum_splits_the_batch_and_changes_no_update(token_cache):
    """grad_accum=2 on a batch is grad_accum=1 on the same batch: the same loss, gradient norm and update,
    up to float32 summation order (a gradient from only some micro-batches is far off: 1e-4 bounds)."""
    tokens = np.random.default_rng(0).integers(0, 256, (8, 33)).astype(np.int32)
    runs = [
        _one_update(_tiny_float32(token_cache, recipe="bf16", grad_accum=a), ONE_DEVICE, tokens)
        for a in (1, 2)
    ]
    (whole, whole_update, _), (accumulated, accumulated_update, _) = runs
    np.testing.assert_allclose(accumulated["loss"], whole["loss"], rtol=1e-6)
    np.testing.assert_allclose(accumulated["grad_norm"], whole["grad_norm"], rtol=1e-5)
    assert max(_update_differences(accumulated_update, whole_update)) < 1e-4


def test_gradients_are_clipped_to_global_norm_1(token_cache):
    """optimizer.clip_grad_norm = 1.0 (the default) scales the whole gradient by 1 / its global norm when
    that is above 1: Adam's first moment after one update is (1 - b1) x the unclipped run's / grad_norm,
    and its global norm (1 - b1) x 1.0. A batch whose every target is the same gives the tiny model a
    first gradient of norm above 1.5 (a random one: 0.8), so the clipping matters."""
    tokens = np.full((8, 33), 7, np.int32)  # every target the same: the gradients add up
    moments = {}
    for clip in (1.0, 0.0):
        config = _tiny_float32(token_cache, recipe="bf16", **{"optimizer.clip_grad_norm": clip})
        step_metrics, _, _, opt_state = _one_update(config, ONE_DEVICE, tokens, with_opt_state=True)
        moments[clip] = _adam_first_moment(opt_state)
    b1, grad_norm = config.optimizer.b1, float(step_metrics["grad_norm"])  # grad_norm: before clipping
    assert tiny_config(token_cache).optimizer.clip_grad_norm == 1.0 and grad_norm > 1.5
    norm = float(np.sqrt(sum(np.sum(np.square(m, dtype=np.float64)) for m in moments[1.0])))
    assert norm == pytest.approx((1 - b1) * 1.0, rel=1e-5)
    # Entries many orders below the largest moment (whole leaves of them where the constant batch leaves
    # a gradient of about 0) are float32 cancellation residue whose bits differ between jax versions:
    # compare them against the largest moment of all, not their own size.
    scale = max(float(np.max(np.abs(m))) for m in moments[0.0]) / grad_norm
    for clipped, unclipped in zip(moments[1.0], moments[0.0], strict=True):
        np.testing.assert_allclose(clipped, unclipped / grad_norm, rtol=1e-5, atol=1e-6 * scale)


def test_stochastic_rounding_keys_differ_per_step_and_layer_and_repeat_per_seed(token_cache, monkeypatch):
    """Every quantized GEMM call of an update draws its own key (each layer of the scanned stack too),
    the next update draws new ones, and the same seed draws the same ones again (training.state: the key
    of update s is fold_in(quant_key, s); linen's make_rng folds in the module path and the layer)."""
    from fp4jax.ops.flax_adapters import QuantDotGeneral

    drawn, draw = [], QuantDotGeneral._key

    def recorded_key(self, recipe):
        key = draw(self, recipe)
        if key is not None and not self.is_initializing():
            jax.debug.callback(
                lambda data: drawn.append(np.asarray(data).tobytes()), jax.random.key_data(key)
            )
        return key

    monkeypatch.setattr(QuantDotGeneral, "_key", recorded_key)
    config = _tiny_float32(token_cache, recipe="mxfp4_full_sr")
    tokens = np.random.default_rng(2).integers(0, 256, (8, 33)).astype(np.int32)

    with _train_step(config, ONE_DEVICE) as step:
        batch = step.batch(tokens)

        def keys_of_updates(seed: int, updates: int) -> list[list[bytes]]:
            state = step.init()
            per_update = []
            for _ in range(updates):
                state, step_metrics = step.train_fn(state, batch, setup.quant_key(seed))
                jax.block_until_ready(step_metrics)
                jax.effects_barrier()
                per_update.append(list(drawn))
                drawn.clear()
            return per_update

        first, second = keys_of_updates(seed=0, updates=2)
        again = keys_of_updates(seed=0, updates=1)[0]
        other_seed = keys_of_updates(seed=1, updates=1)[0]
    layers = config.model.n_layers or 2  # the tiny size's
    assert len(first) >= 2 * layers and len(set(first)) == len(first), "a key repeats within an update"
    assert not set(first) & set(second), "update 2 drew update 1's keys"
    assert sorted(again) == sorted(first) and not set(other_seed) & set(first)


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (the CPU lane's fake ones)")
@SLOW
def test_sharded_train_step_matches_unsharded(token_cache):
    """One mxfp4_full_h16 update with grad_accum=2 on fsdp=2 x tensor=4 is one device's, up to
    reduction order, and the bounds would catch one sequence in eight gone astray (a lost shard).

    Reduction order is not nothing here: the H16 rotation is a float32 matmul whose summation order the
    CPU's dot picks by the local shape, and one rounding flip ahead of an FP4 quantizer moves a whole
    element (docs/numerics.md, "Rotations"). Measured: loss equal, grad norm 7e-5 apart, the worst
    parameter's update 3 % apart; with one of the 8 sequences changed, every update is 57-120 % apart.
    (Several updates on every mesh: test_multidevice.py.)
    """
    config = tiny_config(token_cache, recipe="mxfp4_full_h16", grad_accum=2)
    config.model.update(vocab_size=256, n_heads=4, n_kv_heads=4, dtype="float32")  # tensor=4 divides heads
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 256, (8, 33)).astype(np.int32)
    one = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), MESH_AXES)
    want_metrics, want_update, _ = _one_update(config, one, tokens)
    got_metrics, got_update, shardings = _one_update(config, make_mesh(data=1, fsdp=2, tensor=4), tokens)
    q_spec = shardings.params["blocks_0_2"]["attn"]["q"]["kernel"].spec
    assert "fsdp" in q_spec and "tensor" in q_spec
    np.testing.assert_allclose(got_metrics["loss"], want_metrics["loss"], rtol=1e-5)  # the forward pass
    np.testing.assert_allclose(got_metrics["grad_norm"], want_metrics["grad_norm"], rtol=1e-3)
    assert got_metrics["lr"] == want_metrics["lr"]
    assert max(_update_differences(got_update, want_update)) < 0.2

    astray = tokens.copy()
    astray[-1] = rng.integers(0, 256, 33)
    _, astray_update, _ = _one_update(config, one, astray)
    assert min(_update_differences(astray_update, want_update)) > 0.2


# ---------------------------------------------------------------------------- runs and checkpoints


def test_run_lowers_loss_resumes_bit_identically_and_summarises(tmp_path, token_cache, good_run_result):
    """The full run is the session's tiny_runs.good_run (train(tiny_config(token_cache)), which the fault
    tests only copy), with the summary train() returned."""
    config = tiny_config(token_cache)
    good_run, full = good_run_result
    records = read_metrics(str(good_run))
    losses = train_losses(good_run)
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3
    assert [r["step"] for r in records if "eval_loss" in r] == [4]
    with open(good_run / "summary.json") as f:
        assert json.load(f) == full
    assert full["status"] == "not_reached" and full["tokens"] == 6 * 8 * 32 and full["seed"] == 0
    assert full["tokens_to_target"] is None and full["diverged_step"] is None  # target 2.0 is not reached
    assert full["evals"] == [[4, 32, 4 * 8 * 32, records[4]["eval_loss"]]]
    assert full["last_finite_losses"] == [[s + 1, loss] for s, loss in enumerate(losses)]
    rates = sorted(r["tokens_per_s"] for r in records if "tokens_per_s" in r and r["step"] > 3)
    assert len(rates) == 3 and full["tokens_per_s_median"] == pytest.approx(rates[1])  # warm-up left out
    assert any(name.startswith("events") for name in os.listdir(good_run / "tensorboard"))

    # Stopped after step 3 (between checkpoints 2 and 4), then restarted with the full budget.
    train(tiny_config(token_cache, steps=3), str(tmp_path / "resumed"))
    assert sorted(checkpoint.make_manager(str(tmp_path / "resumed"), keep=3).all_steps()) == [2, 3]
    resumed = train(config, str(tmp_path / "resumed"))
    assert compare(tmp_path / "resumed") == compare(good_run)
    assert resumed["evals"] == full["evals"] and resumed["resumed_from_step"] == 3
    assert resumed["last_finite_losses"] == full["last_finite_losses"]  # the guard's window is checkpointed

    # logged exactly where the device reports memory statistics (GPUs do, CPUs do not)
    reports_memory = "peak_bytes_in_use" in (jax.local_devices()[0].memory_stats() or {})
    assert all(("peak_memory_gb" in r) == reports_memory for r in records if "tokens_per_s" in r)


def test_target_reached_status_and_stop(tmp_path, token_cache, monkeypatch, capsys):
    """Also: each update is timed over exactly one wait for its results, the last one (fetched with no
    update behind it) included. The step timer's clock moves only inside jax.device_get, by 1 s, so any
    other span would show as a time other than 1 (no wall clock: the CI machine's load cannot matter).
    The evaluation is said as it happens (before the checkpoint after it), and the finished run started
    again says when it reached its target."""
    clock, device_get = [0.0], jax.device_get

    def waiting_device_get(x):
        clock[0] += 1.0
        return device_get(x)

    said_before_save, save = {}, checkpoint.save

    def save_after_reading_stderr(manager, step, *args, **kwargs):
        said_before_save[step] = capsys.readouterr().err
        return save(manager, step, *args, **kwargs)

    monkeypatch.setattr(jax, "device_get", waiting_device_get)
    monkeypatch.setattr(metrics, "StepTimer", functools.partial(metrics.StepTimer, clock=lambda: clock[0]))
    monkeypatch.setattr(checkpoint, "save", save_after_reading_stderr)
    config = tiny_config(token_cache, target_eval_loss=99.0, stop_at_target=True)
    summary = train(config, str(tmp_path))
    assert summary["status"] == "reached" and summary["steps"] == summary["steps_to_target"] == 4
    assert summary["tokens_to_target"] == 4 * 8 * 32
    assert checkpoint.make_manager(str(tmp_path), keep=3).all_steps()[-1] == 4
    times = [r["step_time_s"] for r in read_metrics(str(tmp_path)) if "step_time_s" in r]
    assert times == [1.0] * 4
    eval_loss = summary["evals"][0][-1]
    assert "eval loss" not in said_before_save[2]
    assert f"update 4: eval loss {eval_loss:.4f} (8 sequences); target 99.0 reached\n" in said_before_save[4]

    assert train(config, str(tmp_path)) == summary
    assert (
        f"the run in {tmp_path} is finished: it reached eval loss 99.0 at update 4, where it stopped; its "
        f"summary is {tmp_path / 'summary.json'}; set --config.stop_at_target=false to train further"
    ) in capsys.readouterr().err


def test_a_finished_run_says_when_it_reached_the_target_and_when_it_stopped():
    summary = {"status": "reached", "steps": 300, "steps_to_target": 200, "target_eval_loss": 3.3}
    config = tiny_config("unused", stop_at_target=False)
    assert summaries.finished_line("runs/a", summary, config) == (
        "the run in runs/a is finished: it reached eval loss 3.3 at update 200 and stopped after update 300; "
        "its summary is runs/a/summary.json; raise --config.steps to train further"
    )


def test_the_gemm_back_end_is_said_once(token_cache, monkeypatch, capsys):
    """The library says the back end `auto` resolves to once per process, the trainer says it with the
    quantizer: a run shows one of the two lines."""
    from fp4jax.ops.kernels import probes

    class Tok:
        name, vocab_size = "test", 256

    monkeypatch.delenv(setup.GEMM_BACKEND_ENV, raising=False)
    probes.auto_choice.cache_clear()  # as in a fresh process: auto not resolved yet
    try:
        setup.build_model(tiny_config(token_cache, recipe="mxfp4_full_h16"), Tok())
    finally:
        probes.auto_choice.cache_clear()
    said = [line for line in capsys.readouterr().err.splitlines() if "GEMM back end" in line]
    assert len(said) == 1 and said[0].startswith("GEMM back end emulate (auto: ") and "quantizer" in said[0]


# ------------------------------------------------------------------------------ divergence and timing


def test_loss_spike_rule_and_its_state_survives_a_resume():
    """Mean of the last `window` losses > lowest such mean + spike_nats: diverged at that step."""
    losses = [5.0, 4.0, 3.0, 3.0, 4.0, 6.5]  # window-2 means: 4.5, 3.5, 3.0, 3.5, 5.25
    guard = DivergenceGuard(spike_nats=2.0, window=2)
    verdicts = [guard.check(s, {"loss": x, "grad_norm": 1.0}) for s, x in enumerate(losses[:4], 1)]
    resumed = DivergenceGuard(spike_nats=2.0, window=2, saved=json.loads(json.dumps(guard.state())))
    assert verdicts == [None] * 4 and resumed.check(5, {"loss": 4.0, "grad_norm": 1.0}) is None
    div = resumed.check(6, {"loss": 6.5, "grad_norm": 1.0})  # 5.25 > 3.0 + 2.0
    assert (div.kind, div.step, div.value) == ("loss_spike", 6, 5.25)
    assert resumed.last_finite() == [[s, x] for s, x in enumerate(losses, 1)]
    nan = DivergenceGuard(spike_nats=0.0, window=20).check(7, {"loss": 3.0, "grad_norm": float("inf")})
    assert nan.kind == "non_finite_grad_norm" and nan.value == float("inf")
    off = DivergenceGuard(spike_nats=0.0, window=2)
    assert all(off.check(s, {"loss": x, "grad_norm": 1.0}) is None for s, x in enumerate([1.0, 9.0, 99.0]))


def test_step_timer_counts_each_update_once():
    """Laps are consecutive spans; excluded time (the probe) and restarts (eval, save) are left out."""
    now = [0.0]
    timer = metrics.StepTimer(clock=lambda: now[0])
    spans = []
    for t, action in [
        (1.0, "lap"),
        (2.5, "lap"),
        (2.7, "restart"),
        (3.7, "lap"),
        (4.0, "exclude"),
        (5.2, "lap"),
    ]:
        now[0] = t
        if action == "lap":
            spans.append(timer.lap())
        elif action == "restart":
            timer.restart()
        else:
            timer.exclude(0.3)
    np.testing.assert_allclose(spans, [1.0, 1.5, 1.0, 1.2])


def test_dispatch_ahead_only_between_plain_updates_and_changes_no_number(
    tmp_path, token_cache, good_run, good_run_events, monkeypatch
):
    """Update s + 1 goes out before s's metrics are fetched unless an evaluation or a checkpoint falls
    after s (the tiny run: checkpoints after 2, 4, 6, an evaluation after 4); the metrics and the
    checkpoints are the same as with dispatch_ahead off. The run with it on (the default) is the session's
    good run, whose order tiny_runs recorded."""
    events = record_dispatch_and_fetch(monkeypatch)
    train(tiny_config(token_cache, dispatch_ahead=False), str(tmp_path / "in_turn"))
    assert tiny_config(token_cache).dispatch_ahead
    assert events == ["d1", "f1", "d2", "f2", "d3", "f3", "d4", "f4", "d5", "f5", "d6", "f6"]
    assert good_run_events == ["d1", "d2", "f1", "f2", "d3", "d4", "f3", "f4", "d5", "d6", "f5", "f6"]
    assert compare(tmp_path / "in_turn") == compare(good_run)
    assert checkpoint.make_manager(str(tmp_path / "in_turn"), keep=3).all_steps() == [2, 4, 6]
    assert sorted(integrity.step_dirs(str(good_run / "checkpoints"))) == [2, 4, 6]


def test_stop_agreed_with_an_update_ahead_saves_that_update(tmp_path, token_cache, good_run, monkeypatch):
    """The stop is agreed after update 1 while update 2 is already dispatched: the run finishes 2, saves
    it and stops there, with 1 and 2 logged as in the full run."""
    from fp4jax.training.preemption import StopSignals

    monkeypatch.setattr(StopSignals, "agreed", lambda self, step: step == 1)
    events = record_dispatch_and_fetch(monkeypatch)
    summary = train(tiny_config(token_cache, checkpoint_every_steps=0), str(tmp_path))
    assert events == ["d1", "d2", "f1", "f2"]
    assert (summary["status"], summary["steps"]) == ("preempted", 2)
    assert checkpoint.make_manager(str(tmp_path), keep=3).all_steps() == [2]
    assert compare(tmp_path) == compare(good_run)[:2]


# -------------------------------------------------------------------------- probe and profiler switches


def test_diagnostics_probe_and_profiler_switch(tmp_path, token_cache, monkeypatch):
    """diagnostics.every=2 calls the probe (its diag/... metric lines) on updates 2, 4, 6 with that update's
    batch; the profile switch writes a trace of updates 3-4 that TensorBoard's profile plugin reads."""
    import sys
    import types

    calls = []

    def make_training_probe(model, recipe):
        calls.append(recipe)
        return lambda params, batch, key: {"diag/rows": jnp.float32(batch["inputs"].shape[0])}

    monkeypatch.setitem(
        sys.modules, "fp4jax.gemm_errors", types.SimpleNamespace(make_training_probe=make_training_probe)
    )
    overrides = {"diagnostics.every": 2, "profile.start_step": 3, "profile.num_steps": 2}
    train(tiny_config(token_cache, **overrides), str(tmp_path))
    records = [r for r in read_metrics(str(tmp_path)) if "eval_loss" not in r]
    assert calls == [get_recipe("fp8_delayed")]  # the recipe the run trains with
    assert [r["step"] for r in records if "diag/rows" in r] == [2, 4, 6]
    assert all(r["diag/rows"] == 8 and r["diag_time_s"] > 0 for r in records if "diag/rows" in r)
    files = [f for _, _, names in os.walk(tmp_path / "profile") for f in names]
    assert sum(f.endswith(".xplane.pb") for f in files) == 1 and "perfetto_trace.json.gz" in files, files


# ----------------------------------------------------------------------------------------------------
# XLA options the command line sets before jax starts


def test_xla_options_turn_triton_gemms_off_before_jax_starts(monkeypatch):
    config = tiny_config("unused")
    monkeypatch.setenv("XLA_FLAGS", "--xla_dump_to=/tmp/d")
    monkeypatch.setattr(setup, "_backends_started", lambda: False)
    wanted = "--xla_gpu_enable_triton_gemm=false --xla_gpu_deterministic_ops=false"
    assert setup.apply_xla_options(config) == f"XLA_FLAGS += {wanted}"
    assert os.environ["XLA_FLAGS"] == f"--xla_dump_to=/tmp/d {wanted}"
    config.xla_gpu_triton_gemm = config.xla_gpu_deterministic_ops = True
    monkeypatch.setenv("XLA_FLAGS", "")
    setup.apply_xla_options(config)
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=true --xla_gpu_deterministic_ops=true"


def test_xla_options_leave_the_users_flag_and_a_started_jax_alone(monkeypatch):
    config = tiny_config("unused")
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm=true")
    monkeypatch.setattr(setup, "_backends_started", lambda: False)
    said = setup.apply_xla_options(config)
    assert said == (
        "XLA_FLAGS already sets --xla_gpu_enable_triton_gemm; XLA_FLAGS += --xla_gpu_deterministic_ops=false"
    )
    assert os.environ["XLA_FLAGS"] == "--xla_gpu_enable_triton_gemm=true --xla_gpu_deterministic_ops=false"
    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setattr(setup, "_backends_started", lambda: True)
    assert "not applied" in setup.apply_xla_options(config)
    assert os.environ["XLA_FLAGS"] == ""
    monkeypatch.setenv("XLA_FLAGS", "--xla_gpu_enable_triton_gemm_any_type=true")  # another flag, same prefix
    monkeypatch.setattr(setup, "_backends_started", lambda: False)
    assert "already sets" not in setup.apply_xla_options(config)
    assert "--xla_gpu_enable_triton_gemm=false" in os.environ["XLA_FLAGS"]
    monkeypatch.undo()
    assert setup._backends_started()  # this test process has started jax: the real check says so


@pytest.mark.parametrize(
    "xla_flags, from_config, expected",
    [
        ("", False, False),
        ("", True, True),
        ("--xla_gpu_deterministic_ops=true", False, True),
        ("--xla_gpu_deterministic_ops", False, True),  # a bare boolean flag is true
        ("--xla_gpu_deterministic_ops=false", True, False),  # the user's XLA_FLAGS win over the config
        ("--xla_gpu_deterministic_ops=true --xla_gpu_deterministic_ops=0", False, False),  # the last counts
        ("--xla_gpu_deterministic_ops_other=true", False, False),  # another flag's name
    ],
)
def test_deterministic_ops_read_from_xla_flags_first(monkeypatch, xla_flags, from_config, expected):
    config = tiny_config("unused")
    config.xla_gpu_deterministic_ops = from_config
    monkeypatch.setenv("XLA_FLAGS", xla_flags)
    assert setup.deterministic_ops(config) is expected


@pytest.mark.parametrize(
    "attention, nvidia, seq_len, expected",
    [
        (None, False, 64, "xla"),
        ("auto", False, 64, "xla"),
        ("auto", True, 64, "pallas"),  # shorter than a block: one block
        ("auto", True, 1024, "pallas"),
        ("auto", True, 1000, "xla"),  # the Pallas blocks do not tile it
        ("cudnn", True, 1024, "cudnn"),
    ],
)
def test_deterministic_runs_take_a_repeatable_attention_unless_told_otherwise(
    monkeypatch, attention, nvidia, seq_len, expected
):
    from fp4jax.models import llama

    monkeypatch.setenv("XLA_FLAGS", "")
    monkeypatch.setattr(llama, "_on_nvidia_gpu", lambda: nvidia)
    config = tiny_config("unused")
    config.model.attention, config.seq_len = attention, seq_len
    assert setup.resolve_config(config).model.attention == attention  # off: as configured
    config.xla_gpu_deterministic_ops = True
    assert setup.resolve_config(config).model.attention == expected


def test_pallas_attention_on_a_sequence_its_blocks_do_not_tile_is_a_config_error(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    config = tiny_config("unused")
    config.model.attention, config.seq_len = "pallas", 200
    with pytest.raises(setup.ConfigError, match="seq_len is 200: set --config.seq_len to a multiple of 128"):
        setup.resolve_config(config)


def test_info_lines_come_from_process_zero_and_warnings_from_every_process(monkeypatch, capsys):
    """fp4jax.logs' rule (conftest configures it as the command lines do)."""
    import logging

    log = logging.getLogger("fp4jax.training.summary")
    for index in (0, 1):
        monkeypatch.setattr(jax, "process_index", lambda index=index: index)
        log.info("progress of process %d", index)
        log.warning("trouble on process %d", index)
    assert capsys.readouterr().err.splitlines() == [
        "progress of process 0",
        "warning: trouble on process 0",
        "warning: trouble on process 1",
    ]


def test_diagnose_starts_from_the_trainers_step_0_params(token_cache):
    """python -m fp4jax.diagnose without --checkpoint measures the weights a run starts from, unrolled
    layers (which draw as their scanned twin) included; bf16, since the recipe draws no parameter."""
    from flax import linen as nn

    from fp4jax import diagnose

    class Tok:
        name, vocab_size = "test", 256

    config = tiny_config(token_cache, seed=3, recipe="bf16")
    config.model.update(vocab_size=256, scan_layers=False)
    model, model_cfg = setup.build_model(config, Tok())
    assert setup.model_config(config, 256) == model_cfg
    tx, _ = make_optimizer(config.optimizer)
    one = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), MESH_AXES)
    with sharding_context(one):
        state, _ = setup.init_train_state(model, tx, one, config.seed, config.seq_len)
    want = nn.meta.unbox(jax.device_get(state.params))
    got = diagnose.init_params(model_cfg, config.seed)
    jax.tree.map(np.testing.assert_array_equal, got, want)
