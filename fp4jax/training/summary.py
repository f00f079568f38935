"""The run summary, <workdir>/summary.json: a run's result, and whether a run is finished.

The study (fp4jax/study/runs.py) reads these files; the ladder writes one of the same shape, with
`written_by: "ladder"`, for a run that wrote none (a crash or a timeout). Keys: status, recipe, seed, steps,
sequences, tokens, target_eval_loss, steps/sequences/tokens_to_target, evals ([step, sequences, tokens,
eval_loss] each), last_eval_loss, divergence ({kind, step, value} or None; kind is one of
training.divergence.KINDS), diverged_step, diverged_tokens, divergence_reason (= divergence.kind),
last_finite_losses, tokens_per_s_median (training.metrics.median_tokens_per_s), devices, and run extras.

status: "reached" (an evaluation at or below target_eval_loss; the run stopped there with stop_at_target,
else trained to its budget), "not_reached" (budget spent), "diverged" (see training.divergence), or
"preempted" (stopped by a signal after a clean save: run again to continue).
"""

import dataclasses
import json
import logging
import os

import jax

from fp4jax.training import metrics

__all__ = [
    "FINISHED",
    "finished_line",
    "finished_summary",
    "median_tokens_per_s",
    "run_summary",
    "say",
    "summary_path",
    "write_summary",
]

log = logging.getLogger(__name__)

FINISHED = ("reached", "not_reached")


def summary_path(workdir: str) -> str:
    """<workdir>/summary.json, the one place a run's summary lives (the study reads it there too)."""
    return os.path.join(workdir, "summary.json")


def finished_summary(workdir: str, config, last_step: int) -> dict | None:
    """The summary of a run in `workdir` that has nothing left to do under `config` (it reached its target
    and stops there, or trained `last_step` updates), else None."""
    try:
        with open(summary_path(workdir), encoding="utf-8") as f:
            summary = json.load(f)
    except (OSError, ValueError):
        return None
    if not isinstance(summary, dict) or summary.get("status") not in FINISHED:
        return None
    stopped_at_target = summary["status"] == "reached" and config.stop_at_target
    return summary if stopped_at_target or summary.get("steps", 0) >= last_step else None


def finished_line(workdir: str, summary: dict, config) -> str:
    """What a finished run started again says: the target reached and when, or not, the update it stopped
    after, where its summary is, and how to train further under `config`."""
    steps, target = summary["steps"], summary["target_eval_loss"]
    if summary["status"] == "reached":
        at = summary["steps_to_target"]
        outcome = f"reached eval loss {target} at update {at}"
        outcome += ", where it stopped" if at == steps else f" and stopped after update {steps}"
    else:
        outcome = f"did not reach eval loss {target} in its {steps} updates"
    stopped_at_target = summary["status"] == "reached" and config.stop_at_target
    hint = "set --config.stop_at_target=false" if stopped_at_target else "raise --config.steps"
    where = f"its summary is {summary_path(workdir)}"
    return f"the run in {workdir} is finished: it {outcome}; {where}; {hint} to train further"


def run_summary(
    config, meta: dict, *, status: str, step: int, devices: str, divergence=None, **extra
) -> dict:
    """The summary dict; `meta` holds evals ([step, sequences, tokens, eval_loss] each) and target_step."""
    tokens_per_step = config.global_batch * config.seq_len
    target, evals = meta["target_step"], meta["evals"]
    return {
        "status": status,
        "recipe": config.recipe,
        "seed": config.seed,
        "steps": step,
        "sequences": step * config.global_batch,
        "tokens": step * tokens_per_step,
        "target_eval_loss": config.target_eval_loss,
        "steps_to_target": target,
        "sequences_to_target": None if target is None else target * config.global_batch,
        "tokens_to_target": None if target is None else target * tokens_per_step,
        "evals": evals,
        "last_eval_loss": evals[-1][-1] if evals else None,
        "divergence": None if divergence is None else dataclasses.asdict(divergence),
        "diverged_step": None if divergence is None else divergence.step,
        "diverged_tokens": None if divergence is None else divergence.step * tokens_per_step,
        "divergence_reason": None if divergence is None else divergence.kind,
        "devices": devices,
        **extra,
    }


def median_tokens_per_s(workdir: str) -> float | None:
    """metrics.median_tokens_per_s of the run's metrics.jsonl; None where this process has none."""
    try:
        return metrics.median_tokens_per_s(metrics.read_metrics(workdir))
    except (OSError, ValueError):
        return None


def write_summary(workdir: str, summary: dict):
    """Process 0 writes summary.json (atomically); the command line prints it (fp4jax.train)."""
    if jax.process_index() != 0:
        return
    path = summary_path(workdir)
    with open(path + ".tmp", "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(path + ".tmp", path)


def say(line: str):
    """A one-line message for the user: logged at INFO (fp4jax.log_setup shows process 0's)."""
    log.info(line)
