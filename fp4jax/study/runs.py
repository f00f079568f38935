"""A run directory of a study and its run summary (summary.json, training/summary.py), whichever trainer
wrote it.

Layout: <root>/<rung>[/lr<peak lr>]/seed<k>/ holds one run: metrics.jsonl and summary.json (the trainer's),
train.log and ladder_run.json (the ladder's). A directory <root>/<rung>/ that itself holds metrics.jsonl is a
single run of an older one-seed ladder (seed taken as 0).

Statuses: "reached", "not_reached", "diverged", "preempted" (the trainer's) and "failed" (the ladder's: a
crash, a timeout, or a run that wrote no summary). Older trainers wrote "target_reached" and
"budget_exhausted", read as "reached" and "not_reached". Every status but "preempted" is final: a final run
is never started again; --retry-failed reopens a failed one first (`reopen_failed`).
"""

from __future__ import annotations

import json
import math
import os
import re
from typing import NamedTuple

from fp4jax.training.divergence import LAST_FINITE, non_finite
from fp4jax.training.errors import DIVERGED_EXIT_CODE as DIVERGED_EXIT
from fp4jax.training.metrics import median_tokens_per_s, read_metrics, train_records
from fp4jax.training.summary import FINISHED, summary_path  # the trainer's rules, read back here

__all__ = [
    "DIVERGED_EXIT",
    "Eval",
    "FAILED_SUMMARY",
    "FINAL_STATUSES",
    "FINISHED",
    "OLD_STATUSES",
    "RECORD_FILE",
    "RUN_FILES",
    "derive_summary",
    "divergence_from_records",
    "evals_from",
    "find_runs",
    "first_at_or_below",
    "gpu_sharing",
    "is_finished",
    "median_tokens_per_s",
    "parse_run_path",
    "read_json",
    "read_records",
    "reopen_failed",
    "run_status",
    "status_of",
    "summary_path",
    "train_records",
    "write_json",
]


class Eval(NamedTuple):
    """One periodic evaluation of a run, the one shape every reader of evaluations uses (a tuple, so it
    serialises to JSON as [step, tokens, loss])."""

    step: int
    tokens: int
    loss: float


FINAL_STATUSES = ("reached", "not_reached", "diverged", "failed")
OLD_STATUSES = {"target_reached": "reached", "budget_exhausted": "not_reached"}


def read_json(path: str) -> dict | None:
    """The JSON object in `path`, or None when the file does not exist."""
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_json(path: str, obj: dict) -> None:
    """Writes through a temporary file, so a reader never sees half a file."""
    tmp = path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        json.dump(obj, f, indent=2, sort_keys=True)
        f.write("\n")
    os.replace(tmp, path)


def status_of(summary: dict | None) -> str | None:
    """The run summary's status (older names mapped), None without a summary."""
    if summary is None:
        return None
    status = summary.get("status")
    return OLD_STATUSES.get(status, status)


def run_status(run_dir: str) -> str | None:
    """The status of the run in `run_dir` (status_of its summary), None without one."""
    return status_of(read_json(summary_path(run_dir)))


def is_finished(run_dir: str) -> bool:
    """True when the run has a summary with a final status (never rerun)."""
    return run_status(run_dir) in FINAL_STATUSES


FAILED_SUMMARY = "summary.failed.json"  # where reopen_failed moves a failed run's summary


def reopen_failed(run_dir: str) -> dict | None:
    """A run recorded as failed made unfinished, so that it runs again (resuming from its checkpoints, if
    any): its summary.json moved to summary.failed.json, kept to read. Returns that summary, None (and
    nothing moved) when the run had not failed. The study's and the ladder's --retry-failed both use it."""
    if run_status(run_dir) != "failed":
        return None
    path = summary_path(run_dir)
    failed = read_json(path) or {}
    os.replace(path, os.path.join(run_dir, FAILED_SUMMARY))
    return failed


def read_records(run_dir: str) -> list[dict]:
    """metrics.jsonl's records, [] when the run never wrote one."""
    try:
        return read_metrics(run_dir)
    except FileNotFoundError:
        return []


def evals_from(summary: dict | None, records: list[dict]) -> list[Eval]:
    """A run's evaluations: the summary's when it lists them with tokens ([step, sequences, tokens,
    eval_loss]), else metrics.jsonl's evaluation lines (older summaries list [step, sequences, loss])."""
    return [Eval(e[0], e[2], e[3]) for e in _summary_evals(summary, records)]


def _summary_evals(summary: dict | None, records: list[dict]) -> list[list]:
    """[[step, sequences, tokens, eval_loss], ...] as a run summary lists them (evals_from's source)."""
    evals = (summary or {}).get("evals") or []
    if evals and all(len(e) == 4 for e in evals):
        return [list(e) for e in evals]
    return [[r["step"], r.get("sequences"), r["tokens"], r["eval_loss"]] for r in records if "eval_loss" in r]


def divergence_from_records(records: list[dict]) -> dict | None:
    """{kind, step, value} of the first training line with a non-finite loss or grad_norm (the trainer
    logs the update its guard rejects), None when every logged one is finite."""
    for r in train_records(records):
        bad = non_finite(r)
        if bad is not None:
            return {"kind": bad[0], "step": r["step"], "value": bad[1]}
    return None


def first_at_or_below(evals: list[list], target: float | None) -> list | None:
    """The first summary evaluation [step, sequences, tokens, loss] at or below `target` (None without)."""
    return None if target is None else next((e for e in evals if e[3] <= target), None)


def derive_summary(
    records: list[dict],
    *,
    exit_code: int | None,
    failure: str | None,
    target: float | None = None,
    recipe: str | None = None,
    seed: int | None = None,
) -> dict:
    """The run summary of a run that wrote none, from its metrics.jsonl and exit code.

    status: "diverged" for exit code DIVERGED_EXIT, else "failed". A diverged run's divergence is its first
    non-finite training line (divergence_from_records), else kind None at the step after the last logged
    one; its tokens are that step x the logged tokens per step.
    """
    train = train_records(records)
    last = train[-1] if train else {"step": 0, "tokens": 0, "sequences": 0}
    per_step = last["tokens"] / last["step"] if last["step"] else None
    diverged = exit_code == DIVERGED_EXIT
    divergence = divergence_from_records(records) if diverged else None
    if diverged and divergence is None:
        divergence = {"kind": None, "step": last["step"] + 1, "value": None}
    step = None if divergence is None else divergence["step"]
    evals = _summary_evals(None, records)
    hit = first_at_or_below(evals, target) or [None] * 4
    finite = [[r["step"], r["loss"]] for r in train if math.isfinite(r["loss"])]
    if step is not None:
        finite = [pair for pair in finite if pair[0] < step]
    return {
        "status": "diverged" if diverged else "failed",
        "failure": None if diverged else failure,
        "exit_code": exit_code,
        "written_by": "ladder",
        "recipe": recipe,
        "seed": seed,
        "steps": last["step"],
        "sequences": last.get("sequences"),
        "tokens": last["tokens"],
        "target_eval_loss": target,
        "steps_to_target": hit[0],
        "sequences_to_target": hit[1],
        "tokens_to_target": hit[2],
        "evals": evals,
        "last_eval_loss": evals[-1][3] if evals else None,
        "divergence": divergence,
        "diverged_step": step,
        "diverged_tokens": None if step is None or per_step is None else round(step * per_step),
        "divergence_reason": None if divergence is None else divergence["kind"],
        "last_finite_losses": finite[-LAST_FINITE:],
        "tokens_per_s_median": median_tokens_per_s(records),
        "wall_time_s": None,
        "devices": None,
    }


RECORD_FILE = "ladder_run.json"  # the runner's record of a run's attempts
RUN_FILES = ("metrics.jsonl", "summary.json", RECORD_FILE)


def gpu_sharing(record: dict | None) -> int | None:
    """How many runs could share the run's GPU in every one of its attempts (the `runs_per_gpu` each
    attempt of the runner's record carries: runner.slot_sharing), or None when the attempts differ, one
    did not record it, or there are none. Wall times and tokens/s compare only between equal values: a
    run alone on an H200 is about 2.5x as fast as one of three sharing it."""
    values = {h.get("runs_per_gpu") for h in (record or {}).get("history", [])}
    return values.pop() if len(values) == 1 else None


def parse_run_path(rel: str) -> tuple[str, float | None, int | None]:
    """(rung, peak lr or None, seed or None) of a run directory path relative to the root."""
    rung, *rest = rel.split(os.sep)
    lr = seed = None
    for part in rest:
        if re.fullmatch(r"seed\d+", part):
            seed = int(part[4:])
        elif part.startswith("lr"):
            lr = float(part[2:])
        else:
            raise ValueError(f"run directory {rel!r} is not <rung>[/lr<peak lr>]/seed<k>: rename or move it")
    return rung, lr, seed


def find_runs(root: str) -> list[tuple[str, float | None, int | None, str]]:
    """(rung, lr, seed, directory) of every run under root, sorted; FileNotFoundError without root."""
    if not os.path.isdir(root):
        raise FileNotFoundError(f"{root} is not a directory: run the ladder into it first")
    found = []
    for dirpath, dirnames, filenames in os.walk(root):
        if dirpath != root and any(f in filenames for f in RUN_FILES):
            found.append((*parse_run_path(os.path.relpath(dirpath, root)), dirpath))
            dirnames[:] = [d for d in dirnames if d.startswith(("seed", "lr"))]
        dirnames[:] = [d for d in dirnames if d not in ("checkpoints", "tensorboard")]
    return sorted(found, key=lambda r: (r[0], r[1] or 0.0, r[2] or 0))
