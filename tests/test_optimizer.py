"""The optimizer's learning-rate schedules, against formulas written here: the MLPerf cosine (default)
and the proxy studies' constant-after-warmup."""

import math

import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import optax
import pytest

from fp4jax.configs import base
from fp4jax.training.optimizer import make_optimizer


def _opt_cfg(**overrides):
    cfg = ml_collections.ConfigDict(base.get_config().optimizer.to_dict())
    cfg.update(peak_lr=2e-3, warmup_steps=10, lr_decay_steps=50, end_lr_ratio=0.1, **overrides)
    return cfg


def _expected(kind: str, count: int) -> float:
    """LR of the update after `count` updates: update number s = count + 1 (Megatron's convention)."""
    s, peak, warmup, decay = count + 1, 2e-3, 10, 50
    if s <= warmup:
        return peak * s / warmup
    if kind == "constant":
        return peak
    progress = min(1.0, (s - warmup) / (decay - warmup))
    return 0.1 * peak + 0.9 * peak * 0.5 * (1 + math.cos(math.pi * progress))


@pytest.mark.parametrize("kind", ["cosine", "constant"])
def test_schedule_matches_its_formula(kind):
    _, schedule = make_optimizer(_opt_cfg(schedule=kind))
    counts = [0, 4, 9, 10, 11, 30, 49, 50, 200, 10_000]
    got = [float(schedule(jnp.asarray(c))) for c in counts]
    np.testing.assert_allclose(got, [_expected(kind, c) for c in counts], rtol=1e-5)


def test_cosine_is_the_default_and_constant_keeps_adamw():
    assert base.get_config().optimizer.schedule == "cosine"
    cfg = _opt_cfg()
    del cfg["schedule"]  # a config from before the key existed still means the MLPerf cosine
    _, schedule = make_optimizer(cfg)
    assert float(schedule(jnp.asarray(49))) == pytest.approx(_expected("cosine", 49), rel=1e-5)
    tx, _ = make_optimizer(_opt_cfg(schedule="constant"))
    params = {"w": jnp.ones((2, 2)), "b": jnp.zeros(2)}
    grads = {"w": jnp.ones((2, 2)), "b": jnp.ones(2)}
    updates, _ = jax.jit(tx.update)(grads, jax.jit(tx.init)(params), params)  # eagerly: 30 programs
    new = optax.apply_updates(params, updates)
    assert float(new["w"][0, 0]) < 1.0 and float(new["b"][0]) < 0.0  # a step was taken


def test_unknown_schedule_is_a_one_line_error():
    with pytest.raises(ValueError, match="unknown optimizer.schedule 'linear'; use one of cosine, constant"):
        make_optimizer(_opt_cfg(schedule="linear"))
