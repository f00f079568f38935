"""Tiny training runs for tests/test_train.py and tests/test_faults.py.

The tiny_c4 set-up (configs/tiny_c4_h16.py) shrunk: recipe fp8_delayed (its amax histories are train state
that must survive a resume), 32-token sequences, batch 8, a handful of steps. Runs of one program (new jit
objects each) compile once through a persistent XLA cache, the CLI subprocesses too.
"""

import os

import jax
import pytest

from fp4jax.configs import ladder
from fp4jax.training.metrics import read_metrics

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "tiny_c4_h16.py")
COMPARED = ("step", "loss", "grad_norm", "lr", "eval_loss", "tokens")

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
    """The tiny config with TINY_OVERRIDES, then `overrides` (dotted keys: **{"data.path": p})."""
    c = ladder.rung("tiny_c4", "mxfp4_full_h16")
    for key, value in {**TINY_OVERRIDES, "data.cache_dir": str(token_cache), **overrides}.items():
        *parents, leaf = key.split(".")
        node = c
        for parent in parents:
            node = node[parent]
        node[leaf] = value
    return c


def cli_args(workdir, token_cache, **overrides) -> list[str]:
    values = {**TINY_OVERRIDES, "data.cache_dir": str(token_cache), **overrides}
    return ["--config", CONFIG, "--workdir", str(workdir)] + [f"--config.{k}={v}" for k, v in values.items()]


def compare(workdir) -> list[dict]:
    """The metrics lines' deterministic fields (no timings)."""
    return [{k: r.get(k) for k in COMPARED} for r in read_metrics(str(workdir))]


def train_losses(workdir) -> list[float]:
    return [r["loss"] for r in read_metrics(str(workdir)) if "eval_loss" not in r]


def error_lines(capsys) -> list[str]:
    """stderr's "error: ..." lines (warnings and orbax's log lines are not errors)."""
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error")]


def xla_cache_env(xla_cache) -> dict:
    return dict(
        os.environ, JAX_COMPILATION_CACHE_DIR=str(xla_cache), JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0"
    )


@pytest.fixture(scope="session")
def token_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("token_cache")


@pytest.fixture(scope="session")
def xla_cache(tmp_path_factory):
    return tmp_path_factory.mktemp("xla_cache")


@pytest.fixture(scope="module", autouse=True)
def compilation_cache(xla_cache):
    """Train runs of one program compile once; the previous settings are restored for other modules."""
    from jax.experimental.compilation_cache import compilation_cache as cc

    old = (jax.config.jax_compilation_cache_dir, jax.config.jax_persistent_cache_min_compile_time_secs)
    cc.reset_cache()
    jax.config.update("jax_compilation_cache_dir", str(xla_cache))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    yield
    jax.config.update("jax_compilation_cache_dir", old[0])
    jax.config.update("jax_persistent_cache_min_compile_time_secs", old[1])
    cc.reset_cache()
