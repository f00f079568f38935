"""The train state, its sharded initialisation, and the pure train and eval steps.

Invariants:
- params and optimizer state are float32 (master weights); the model computes in its `dtype` (bf16).
- `state.step` counts the updates applied; the quant key of update s is fold_in(quant_key, s), and of its
  micro-batch i under gradient accumulation fold_in(fold_in(quant_key, s), i). Same seed, same run.
- fp8_meta (only for recipes with delayed FP8 scaling) is overwrite-with-gradient: the loss is
  differentiated w.r.t. it and its cotangent (the updated amax histories) replaces it; the optimizer never
  sees it. Under accumulation the last micro-batch's cotangent is kept.
"""

from typing import Any

import flax
import jax
import jax.numpy as jnp
import optax

from fp4jax.models import llama

__all__ = ["TrainState", "eval_step", "make_init_fn", "token_losses", "train_step"]

# optax.tree.norm replaces the deprecated optax.global_norm (same value: the L2 norm over all leaves);
# optax releases before optax.tree.norm existed have only the latter.
_global_norm = getattr(getattr(optax, "tree", None), "norm", None) or optax.global_norm


@flax.struct.dataclass
class TrainState:
    step: jax.Array  # int32 scalar: updates applied
    params: Any
    opt_state: Any
    fp8_meta: Any  # {} unless the recipe uses delayed FP8 scaling


def token_losses(model, params, fp8_meta, batch, key):
    """Next-token cross-entropy (nats) of every position: float32[B, T]."""
    variables = {"params": params, **({"fp8_meta": fp8_meta} if fp8_meta else {})}
    rngs = {"quant": key} if key is not None else None
    logits_BTV = model.apply(variables, batch["inputs"], rngs=rngs)
    return optax.softmax_cross_entropy_with_integer_labels(logits_BTV.astype(jnp.float32), batch["targets"])


def _mean_loss(params, fp8_meta, batch, key, model):
    return token_losses(model, params, fp8_meta, batch, key).mean()


def _grads(state, batch, key, *, model, grad_accum, micro_sharding):
    """(mean loss, params grads, new fp8_meta), averaged over `grad_accum` equal micro-batches."""
    grad_fn = jax.value_and_grad(_mean_loss, argnums=(0, 1))
    if grad_accum == 1:
        loss, (grads, meta) = grad_fn(state.params, state.fp8_meta, batch, key, model)
        return loss, grads, meta

    def split(x):
        # Micro-batch i takes rows i, i + A, i + 2A, ...: each keeps an equal share of every data shard.
        x = x.reshape(-1, grad_accum, *x.shape[1:]).swapaxes(0, 1)
        return jax.lax.with_sharding_constraint(x, micro_sharding)

    def body(carry, xs):
        i, micro = xs
        loss_sum, grads_sum = carry
        micro_key = None if key is None else jax.random.fold_in(key, i)
        loss, (grads, meta) = grad_fn(state.params, state.fp8_meta, micro, micro_key, model)
        return (loss_sum + loss, jax.tree.map(jnp.add, grads_sum, grads)), meta

    zeros = jax.tree.map(jnp.zeros_like, state.params)
    micro_batches = jax.tree.map(split, batch)
    (loss_sum, grads_sum), metas = jax.lax.scan(
        body, (jnp.zeros((), jnp.float32), zeros), (jnp.arange(grad_accum), micro_batches)
    )
    meta = jax.tree.map(lambda m: m[-1], metas)
    return loss_sum / grad_accum, jax.tree.map(lambda g: g / grad_accum, grads_sum), meta


def train_step(
    state,
    batch,
    quant_key,
    *,
    model,
    tx,
    schedule,
    needs_key,
    grad_accum=1,
    micro_sharding=None,
    nan_at_step=0,
):
    """One optimizer update. Returns (new state, metrics {loss, grad_norm, lr}), all on device.

    grad_norm is the global norm before clipping. `nan_at_step` (a debugging knob, 0 = off) poisons the
    loss and gradients of update number `nan_at_step` to exercise the NaN guard.
    """
    key = jax.random.fold_in(quant_key, state.step) if needs_key else None
    loss, grads, fp8_meta = _grads(
        state, batch, key, model=model, grad_accum=grad_accum, micro_sharding=micro_sharding
    )
    if nan_at_step:
        poison = jnp.where(state.step + 1 == nan_at_step, jnp.nan, 1.0)
        loss, grads = loss * poison, jax.tree.map(lambda g: g * poison, grads)
    updates, opt_state = tx.update(grads, state.opt_state, state.params)
    params = optax.apply_updates(state.params, updates)
    metrics = {"loss": loss, "grad_norm": _global_norm(grads), "lr": schedule(state.step)}
    new_state = TrainState(step=state.step + 1, params=params, opt_state=opt_state, fp8_meta=fp8_meta)
    return new_state, metrics


def eval_step(state, batch, quant_key, *, model, needs_key):
    """(sum of the batch's token losses, number of tokens), float32 scalars."""
    key = jax.random.fold_in(quant_key, 0x7FFFFFFF) if needs_key else None
    losses = token_losses(model, state.params, state.fp8_meta, batch, key)
    return losses.sum(), jnp.asarray(losses.size, jnp.float32)


def make_init_fn(model, tx, batch_shape: tuple[int, int]):
    """rng -> step-0 TrainState with the params still boxed (logical axis names), for
    `fp4jax.models.sharding.init_sharded`: Adam's moments inherit the params' names, so the optimizer
    state is sharded like the params, and counters are replicated. Only shapes matter for `batch_shape`
    (under jit the forward pass that init traces is dead code)."""

    def init(rng):
        variables = llama.init_variables(model, {"params": rng}, jnp.zeros(batch_shape, jnp.int32))
        params = variables["params"]
        state = TrainState(
            step=jnp.zeros((), jnp.int32),
            params=params,
            opt_state=tx.init(params),
            fp8_meta=variables.get("fp8_meta", {}),
        )
        return state

    return init
