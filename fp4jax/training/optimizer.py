"""AdamW with MLPerf llama3.1_8b hyper-parameters and its learning-rate schedule.

Weight decay choice (see docs/training.md): decay every parameter with two or more dimensions
(projections, embedding, LM head) and not the RMSNorm scales. This is Megatron-Core's default parameter
grouping, which the MLPerf NeMo reference runs on; `weight_decay_mask="all"` decays everything.
"""

import jax
import jax.numpy as jnp
import optax

__all__ = [
    "MLPERF_LR_TABLE",
    "SCHEDULES",
    "constant_schedule",
    "lr_schedule",
    "make_optimizer",
    "make_schedule",
    "mlperf_lr",
    "weight_decay_mask",
]

# Global batch (sequences) -> (peak LR, warmup steps) of the MLPerf llama3.1_8b rules.
SCHEDULES = ("cosine", "constant")
MLPERF_LR_TABLE = {16: (4e-4, 16), 32: (8e-4, 128), 64: (8e-4, 96), 128: (2e-3, 256)}


def mlperf_lr(global_batch: int) -> tuple[float, int]:
    """(peak learning rate, warmup steps) of the MLPerf llama3.1_8b rules for `global_batch` sequences."""
    if global_batch not in MLPERF_LR_TABLE:
        raise ValueError(
            f"MLPerf llama3.1_8b defines the learning rate for global batches {sorted(MLPERF_LR_TABLE)}, "
            f"not {global_batch}; set optimizer.peak_lr and optimizer.warmup_steps explicitly"
        )
    return MLPERF_LR_TABLE[global_batch]


def lr_schedule(peak_lr: float, warmup_steps: int, decay_steps: int, end_ratio: float = 0.1):
    """Linear warmup to `peak_lr`, then cosine to `end_ratio * peak_lr` at update `decay_steps`.

    The schedule takes optax's update count c (updates already applied) and uses update number s = c + 1,
    as Megatron does, so the first update has LR peak / warmup rather than 0. Constant at the end value
    after `decay_steps`.
    """
    shifted = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=peak_lr,
        warmup_steps=warmup_steps,
        decay_steps=max(decay_steps, warmup_steps + 1),
        end_value=peak_lr * end_ratio,
    )
    return lambda count: shifted(jnp.asarray(count) + 1)


def constant_schedule(peak_lr: float, warmup_steps: int):
    """Linear warmup to `peak_lr`, then constant: the proxy studies' schedule (at 8B the cosine over
    1.2M steps barely decays within a run). Update number s = count + 1, as in `lr_schedule`."""
    shifted = optax.join_schedules(
        [optax.linear_schedule(0.0, peak_lr, warmup_steps), optax.constant_schedule(peak_lr)], [warmup_steps]
    )
    return lambda count: shifted(jnp.asarray(count) + 1)


def make_schedule(opt_cfg):
    """The LR schedule named by optimizer.schedule: "cosine" (MLPerf, the default) or "constant"."""
    kind = opt_cfg.get("schedule", "cosine")
    if kind == "cosine":
        return lr_schedule(
            opt_cfg.peak_lr, opt_cfg.warmup_steps, opt_cfg.lr_decay_steps, opt_cfg.end_lr_ratio
        )
    if kind == "constant":
        return constant_schedule(opt_cfg.peak_lr, opt_cfg.warmup_steps)
    raise ValueError(f"unknown optimizer.schedule {kind!r}; use one of {', '.join(SCHEDULES)}")


def weight_decay_mask(params, mode: str):
    """Pytree of bools: True where weight decay applies. mode "matrices" (ndim >= 2) or "all"."""
    if mode == "all":
        return jax.tree.map(lambda _: True, params)
    if mode == "matrices":
        return jax.tree.map(lambda p: p.ndim >= 2, params)
    raise ValueError(f"unknown optimizer.weight_decay_mask {mode!r}; use 'matrices' or 'all'")


def make_optimizer(opt_cfg) -> tuple[optax.GradientTransformation, callable]:
    """(AdamW with global-norm clipping, its LR schedule) from the config's `optimizer` block."""
    weight_decay_mask(jnp.zeros(()), opt_cfg.weight_decay_mask)  # validate the mode early
    schedule = make_schedule(opt_cfg)
    chain = []
    if opt_cfg.clip_grad_norm > 0:
        chain.append(optax.clip_by_global_norm(opt_cfg.clip_grad_norm))
    chain.append(
        optax.adamw(
            schedule,
            b1=opt_cfg.b1,
            b2=opt_cfg.b2,
            eps=opt_cfg.eps,
            weight_decay=opt_cfg.weight_decay,
            mask=lambda p: weight_decay_mask(p, opt_cfg.weight_decay_mask),
        )
    )
    return optax.chain(*chain), schedule
