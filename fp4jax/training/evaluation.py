"""The MLPerf evaluation protocol: a fixed validation set, evaluated every K training sequences."""

import jax
import numpy as np

from fp4jax.data import make_eval_batches
from fp4jax.training.setup import device_batch


def evaluating(config) -> bool:
    return config.eval_every_sequences > 0 or config.eval_at_end


def load_eval_set(config, tokenizer, mesh) -> list[dict]:
    """The fixed validation batches, on device ([] when the run never evaluates)."""
    if not evaluating(config):
        return []
    local = make_eval_batches(
        config.data,
        tokenizer,
        seq_len=config.seq_len,
        num_sequences=config.eval_sequences,
        batch_size=config.eval_batch_size,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    return [device_batch(b, mesh) for b in local]


def evaluate(eval_fn, state, eval_batches, quant_key) -> float:
    """Mean next-token loss (nats) over the fixed validation set (sums in float64 on the host)."""
    sums = jax.device_get([eval_fn(state, batch, quant_key) for batch in eval_batches])
    return float(sum(np.float64(total) for total, _ in sums) / sum(np.float64(n) for _, n in sums))


def crossed(sequences: int, global_batch: int, every: int) -> bool:
    """True when the last update's batch took the sequence count past a multiple of `every`."""
    return every > 0 and sequences // every > (sequences - global_batch) // every


def eval_due(config, step: int, last_step: int) -> bool:
    """Whether the state after update `step` is evaluated: a multiple of eval_every_sequences was passed,
    or it is the run's last update and eval_at_end is set."""
    seqs = step * config.global_batch
    return crossed(seqs, config.global_batch, config.eval_every_sequences) or (
        step == last_step and config.eval_at_end
    )
