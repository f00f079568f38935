"""Evaluation: a fixed validation set, evaluated every K training sequences, and an optional larger final
evaluation after the last update.

Which windows of the validation stream: config.eval_selection, "first" (the MLPerf protocol: the first
eval_sequences windows of the unshuffled stream) or "spread" (evenly strided over the whole stream:
fp4jax.data.eval_window_ids). Either is a function of the data and the sizes only, so every run of a
study, whatever its seed or recipe, evaluates the same sequences. config.final_eval_sequences > 0 adds one
evaluation of at most that many windows (selected the same way) after the last update; its result is
kept apart from the periodic evaluations (metrics line "final_eval_loss", summary "final_eval").
"""

import jax
import numpy as np

from fp4jax.data import EVAL_SELECTIONS, make_eval_batches
from fp4jax.training.errors import ConfigError
from fp4jax.training.setup import device_batch, evaluating

__all__ = [
    "check_eval_config",
    "eval_due",
    "evaluate",
    "final_eval_record",
    "load_eval_set",
    "load_final_eval_set",
]


def check_eval_config(config) -> None:
    """ConfigError (one line) for an eval_selection or final_eval_sequences no evaluation accepts."""
    selection = config.get("eval_selection", "first")
    if selection not in EVAL_SELECTIONS:
        raise ConfigError(
            f"unknown eval_selection {selection!r}: set --config.eval_selection to one of "
            f"{', '.join(EVAL_SELECTIONS)}"
        )
    final = config.get("final_eval_sequences", 0)
    if not isinstance(final, int) or final < 0:
        raise ConfigError(
            f"final_eval_sequences must be an integer >= 0 (0 = no final evaluation), got {final!r}"
        )
    if 0 < final < config.eval_batch_size:
        raise ConfigError(
            f"final_eval_sequences {final} is below eval_batch_size {config.eval_batch_size}; raise it or "
            "set it to 0"
        )


def load_eval_set(config, tokenizer, mesh) -> list[dict]:
    """The fixed validation batches, on device ([] when the run never evaluates)."""
    check_eval_config(config)
    if not evaluating(config):
        return []
    return _device_batches(config, tokenizer, mesh, config.eval_sequences, at_most=False)


def load_final_eval_set(config, tokenizer, mesh) -> list[dict]:
    """The final evaluation's batches, on device: at most final_eval_sequences windows, all the validation
    set holds (to a multiple of eval_batch_size) when it holds fewer; [] when final_eval_sequences is 0."""
    check_eval_config(config)
    if not config.get("final_eval_sequences", 0):
        return []
    return _device_batches(config, tokenizer, mesh, config.final_eval_sequences, at_most=True)


def _device_batches(config, tokenizer, mesh, num_sequences: int, *, at_most: bool) -> list[dict]:
    local = make_eval_batches(
        config.data,
        tokenizer,
        seq_len=config.seq_len,
        num_sequences=num_sequences,
        batch_size=config.eval_batch_size,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
        selection=config.get("eval_selection", "first"),
        at_most=at_most,
    )
    return [device_batch(b, mesh) for b in local]


def evaluate(eval_fn, state, eval_batches, quant_key) -> float:
    """Mean next-token loss (nats) over the fixed validation set (sums in float64 on the host)."""
    sums = jax.device_get([eval_fn(state, batch, quant_key) for batch in eval_batches])
    return float(sum(np.float64(total) for total, _ in sums) / sum(np.float64(n) for _, n in sums))


def final_eval_record(config, step: int, eval_loss: float, batches: list[dict], seconds: float) -> dict:
    """The final evaluation's metrics line (and summary["final_eval"]): no "loss" or "eval_loss" key, so
    no reader takes it for a training line or a periodic evaluation."""
    return {
        "step": step,
        "sequences": step * config.global_batch,
        "tokens": step * config.global_batch * config.seq_len,
        "final_eval_loss": eval_loss,
        "final_eval_sequences": len(batches) * config.eval_batch_size,
        "final_eval_selection": config.get("eval_selection", "first"),
        "final_eval_time_s": seconds,
    }


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
