"""The trainer: optimizer, sharded == unsharded step, loss falls, bit-identical resume, the command line's
one-line errors (exit 2), the NaN guard (exit 3) and SIGTERM (exit 0).

Tiny model, 32-token sequences, a handful of steps on the 8 fake CPU devices of conftest.py. Runs that
compile the same program share a persistent XLA cache (the CLI subprocess too).
"""

import json
import os
import signal
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from configs import tiny_c4_h16  # noqa: E402
from fp4jax import train as trainer  # noqa: E402
from fp4jax.models.sharding import MESH_AXES, make_mesh, sharding_context  # noqa: E402
from fp4jax.training import checkpoint  # noqa: E402
from fp4jax.training.metrics import read_metrics  # noqa: E402
from fp4jax.training.optimizer import lr_schedule, make_optimizer, mlperf_lr  # noqa: E402

COMPARED = ("step", "loss", "grad_norm", "lr", "eval_loss", "tokens")


# configs/tiny_c4_h16.py shrunk: recipe fp8_delayed (its amax histories are train state that must survive a
# resume; the sharded test runs mxfp4_full_h16), 32-token sequences, batch 8, 6 steps, evaluation at step 4.
TINY_OVERRIDES = {
    "recipe": "fp8_delayed",
    "model.remat": "none",
    "seq_len": 32,
    "global_batch": 8,
    "steps": 6,
    "optimizer.peak_lr": 1e-2,
    "optimizer.warmup_steps": 1,
    "optimizer.lr_decay_steps": 6,
    "eval_every_sequences": 32,
    "eval_sequences": 8,
    "eval_batch_size": 8,
    "eval_at_end": False,
    "checkpoint_every_steps": 2,
    "progress_bar": False,
    "data.num_threads": 1,
}


def tiny_config(token_cache, **overrides):
    c = tiny_c4_h16.get_config()
    for key, value in {**TINY_OVERRIDES, "data.cache_dir": str(token_cache), **overrides}.items():
        *parents, leaf = key.split(".")
        node = c
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return c


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("token_cache")


@pytest.fixture(scope="session")
def xla_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("xla_cache")


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(xla_cache):
    """Train runs of one program (new jit objects each) compile once; restored for other modules."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    old = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    cc.reset_cache()
    jax.config.update("jax_compilation_cache_dir", str(xla_cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    yield
    jax.config.update("jax_compilation_cache_dir", old[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])
    cc.reset_cache()


def _compare(workdir):
    return [{k: r.get(k) for k in COMPARED} for r in read_metrics(workdir)]


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
    updates, _ = tx.update(zero, tx.init(params), params)
    assert float(jnp.abs(updates["scale"]).max()) == 0.0  # no gradient, no decay
    assert float(updates["kernel"][0, 0]) == pytest.approx(-cfg.peak_lr / cfg.warmup_steps * cfg.weight_decay)


# ------------------------------------------------------------------------------------ sharded step


def _one_step(config, mesh, tokens):
    class Tok:
        name, vocab_size = "test", 256

    with sharding_context(mesh):
        model, _ = trainer.build_model(config, Tok())
        tx, schedule = make_optimizer(config.optimizer)
        state, shardings = trainer.init_train_state(model, tx, mesh, config.seed, config.seq_len)
        train_fn, _ = trainer.jit_steps(config, model, tx, schedule, mesh, shardings)
        batch = trainer.device_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, mesh)
        state, metrics = train_fn(state, batch, jax.random.key(7))
    return jax.device_get(metrics), jax.device_get(state.params), shardings


def test_sharded_train_step_matches_unsharded(token_cache):
    config = tiny_config(token_cache, recipe="mxfp4_full_h16", grad_accum=2)
    config.model.update(vocab_size=256, n_heads=4, n_kv_heads=4, dtype="float32")  # tensor=4 divides heads
    tokens = np.random.default_rng(0).integers(0, 256, (8, 33)).astype(np.int32)
    one = Mesh(np.array(jax.devices()[:1]).reshape(1, 1, 1), MESH_AXES)
    want_metrics, want_params, _ = _one_step(config, one, tokens)
    got_metrics, got_params, shardings = _one_step(config, make_mesh(data=1, fsdp=2, tensor=4), tokens)
    q_spec = shardings.params["blocks_0_2"]["attn"]["q"]["kernel"].spec
    assert "fsdp" in q_spec and "tensor" in q_spec
    for key in ("loss", "grad_norm", "lr"):
        np.testing.assert_allclose(got_metrics[key], want_metrics[key], rtol=2e-5)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6), got_params, want_params)


# ---------------------------------------------------------------------------- runs and checkpoints


def test_run_lowers_loss_and_resumes_bit_identically(tmp_path, token_cache):
    config = tiny_config(token_cache)
    full = trainer.train(config, str(tmp_path / "full"))
    records = read_metrics(str(tmp_path / "full"))
    losses = [r["loss"] for r in records if "eval_loss" not in r]
    assert len(losses) == 6 and losses[-1] < losses[0] - 0.3
    assert [r["step"] for r in records if "eval_loss" in r] == [4]
    assert full["status"] == "budget_exhausted" and full["tokens"] == 6 * 8 * 32
    assert full["tokens_to_target"] is None  # target 6.5 is far below what 6 steps reach
    with open(tmp_path / "full" / "summary.json") as f:
        assert json.load(f)["steps"] == 6
    assert any(name.startswith("events") for name in os.listdir(tmp_path / "full" / "tensorboard"))

    # Stopped after step 3 (between checkpoints 2 and 4), then restarted with the full budget.
    trainer.train(tiny_config(token_cache, steps=3), str(tmp_path / "resumed"))
    assert sorted(checkpoint.make_manager(str(tmp_path / "resumed"), keep=3).all_steps()) == [2, 3]
    resumed = trainer.train(config, str(tmp_path / "resumed"))
    assert _compare(tmp_path / "resumed") == _compare(tmp_path / "full")
    assert resumed["evals"] == full["evals"]


# ---------------------------------------------------------------------------------- command line

CONFIG = os.path.join(ROOT, "configs", "tiny_c4_h16.py")


def cli_args(workdir, token_cache, **overrides):
    values = {**TINY_OVERRIDES, "data.cache_dir": str(token_cache), **overrides}
    return ["--config", CONFIG, "--workdir", str(workdir)] + [f"--config.{k}={v}" for k, v in values.items()]


@pytest.mark.parametrize(
    "override, message",
    [
        ("--config.no_such_key=1", "unknown config key --config.no_such_key"),
        ("--config.recipe=mxfp5", "unknown recipe 'mxfp5'"),
        ("--config.mesh.tensor=3", "does not fit 8 devices"),
        ("--config.global_batch=12", "global batch 12 is not divisible"),
        ("--config.data.path=/no/such/dir", "/no/such/dir"),
        ("--config.init_checkpoint=/no/such/ckpt", "init_checkpoint /no/such/ckpt does not exist"),
    ],
)
def test_bad_input_is_one_line_and_exit_code_2(override, message, tmp_path, capsys):
    assert trainer.main(["fp4jax.train", "--config", CONFIG, "--workdir", str(tmp_path), override]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err


def test_nan_exits_3_naming_the_step_and_keeps_the_last_good_checkpoint(tmp_path, token_cache, capsys):
    argv = ["fp4jax.train", *cli_args(tmp_path, token_cache, debug_nan_at_step=3)]
    assert trainer.main(argv) == 3
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: non-finite loss") and "at step 3" in err[0], err
    assert checkpoint.make_manager(str(tmp_path), keep=3).all_steps() == [2]
    # The kept checkpoint restores and training continues from it (the NaN was injected, not real).
    trainer.train(tiny_config(token_cache, steps=3), str(tmp_path))
    records = read_metrics(str(tmp_path))
    assert [r["step"] for r in records] == [1, 2, 3] and np.isfinite([r["loss"] for r in records]).all()


def test_cli_lowers_loss_and_sigterm_saves_and_exits_0(tmp_path, token_cache, xla_cache):
    """The real command line in a subprocess; SIGTERM once 5 steps are logged: save, exit 0, resumable."""
    env = dict(
        os.environ, JAX_COMPILATION_CACHE_DIR=str(xla_cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0"
    )
    cmd = [sys.executable, "-m", "fp4jax.train", *cli_args(tmp_path, token_cache, steps=100_000)]
    proc = subprocess.Popen(
        cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    metrics_path = tmp_path / "metrics.jsonl"
    deadline = time.monotonic() + 240
    while not (metrics_path.exists() and len(metrics_path.read_text().splitlines()) >= 5):
        assert proc.poll() is None, proc.stdout.read()
        assert time.monotonic() < deadline, "no 5 steps logged in time"
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=120)
    assert proc.returncode == 0, out
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "preempted"
    steps = checkpoint.make_manager(str(tmp_path), keep=3).all_steps()
    assert steps[-1] == summary["steps"] >= 5
    losses = [r["loss"] for r in read_metrics(str(tmp_path)) if "eval_loss" not in r]
    assert losses[-1] < losses[0]

    resumed = trainer.train(tiny_config(token_cache, steps=summary["steps"] + 1), str(tmp_path))
    assert resumed["steps"] == summary["steps"] + 1
    assert read_metrics(str(tmp_path))[-1]["step"] == summary["steps"] + 1
