"""The instruments across tokens per step (docs/study_plan.md, amendments "the scale and batch trend" and
"the instruments' batches at large tokens per step"): one instruments output per gradient accumulation A
on the same checkpoint, read back and set side by side, and the amendment's condition for adding the 125M
branching set at the 8B run's tokens per step.

A set is a directory of `A<k>/instruments.json` files, each written by

    python -m fp4jax.study instruments --run TRUNK --steps S --batches K --accumulate <k> --data next \
        --out DIR/A<k>

(fp4jax.instruments; this module reads their JSON only, so the study still imports neither models nor
ops). Every file of a set must come from the same run, checkpoint step, K and data source, or the set is
refused: the A's must differ in A alone.

The condition (written before the runs): the 125M set at 262,144 tokens per step is run only if the
instruments predict a larger Wgrad share there, read as Wgrad's whole-model error-to-noise ratio
(`noise_ratio`, group "all") at that batch above Fprop's. It is a prediction, not a verdict. Both ratios
share their denominator (the same batches' minibatch noise), so their quotient is
sqrt(sum_k ||e_wgrad,k||^2 / sum_k ||e_fprop,k||^2); where the files keep each batch's squared error
(`per_batch`), its 95 % interval is a paired percentile bootstrap over the K batches (scipy, a fixed
seed, so a report regenerates byte for byte). It spans one checkpoint's batches, not checkpoints or
trunks. Files written before the instruments kept per-batch errors have no interval, and the report says so.
"""

from __future__ import annotations

import glob
import inspect
import json
import math
import os
import re

import numpy as np
from scipy import stats

__all__ = ["STAGES", "condition", "error_quotient_interval", "load_set", "rows_markdown"]

STAGES = ("fprop", "dgrad", "wgrad")
# The whole-model figures carried into the trend, per stage: the gradient's (instruments.gradient_metrics)
# and the update's (instruments.update_metrics).
GRADIENT_FIELDS = ("noise_ratio", "coherence", "grad_coherence", "sqrt3_ratio", "err_norm", "noise_norm")
UPDATE_FIELDS = ("rel_err", "cos")
# What every file of a set must share: the A's differ in A alone.
SHARED = ("run", "recipe", "batches", "batch", "seq_len", "data")


def _read(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def load_set(directory: str, step: int) -> dict:
    """The set under `directory` at checkpoint `step`: {"shared": {...}, "rows": [one per A, ascending
    tokens per step]}, each row {"accumulate", "tokens_per_step", stage: {field: value}}. A ValueError of
    one line names a missing file, a missing step or a file that differs from the others in more than A."""
    paths = sorted(glob.glob(os.path.join(directory, "A*", "instruments.json")))
    paths = [p for p in paths if re.fullmatch(r"A\d+", os.path.basename(os.path.dirname(p)))]
    if not paths:
        raise ValueError(f"{directory}: no A<k>/instruments.json: run `python -m fp4jax.study instruments` "
                         f"with --out {directory}/A<k> first")  # fmt: skip
    files = [(p, _read(p)) for p in paths]
    shared = {k: files[0][1].get(k) for k in SHARED}
    rows = []
    for path, data in files:
        differs = [k for k in SHARED if data.get(k) != shared[k]]
        if differs:
            raise ValueError(f"{path}: differs from {paths[0]} in {differs}; a set varies A alone")
        at = data["steps"].get(str(step))
        if at is None:
            raise ValueError(f"{path}: no checkpoint step {step} (it has {sorted(data['steps'])})")
        rows.append(_row(data, at))
    return {"shared": {**shared, "step": step}, "rows": sorted(rows, key=lambda r: r["tokens_per_step"])}


def _row(data: dict, at: dict) -> dict:
    row = {"accumulate": data["accumulate"], "tokens_per_step": data["tokens_per_step"]}
    for stage in STAGES:
        gradient, update = at[stage]["gradient"]["all"], at[stage]["update"]["all"]
        row[stage] = {
            **{f: gradient[f] for f in GRADIENT_FIELDS},
            **{f"update_{f}": update[f] for f in UPDATE_FIELDS},
        }
        per_batch = at[stage].get("per_batch")
        if per_batch is not None:
            row[stage]["err_sq_per_batch"] = per_batch["err_sq"]["all"]
    return row


BOOTSTRAP_RESAMPLES = 9999
BOOTSTRAP_SEED = 0


def error_quotient_interval(numerator: list[float], denominator: list[float]) -> dict:
    """sqrt(sum numerator / sum denominator) over paired per-batch squared errors, with its 95 %
    percentile-bootstrap interval (batches resampled in pairs)."""

    def quotient(num, den, axis=-1):
        return np.sqrt(np.sum(num, axis=axis) / np.sum(den, axis=axis))

    seed = np.random.default_rng(BOOTSTRAP_SEED)
    # scipy 1.15 renamed random_state to rng; the project supports scipy >= 1.11
    key = "rng" if "rng" in inspect.signature(stats.bootstrap).parameters else "random_state"
    result = stats.bootstrap(
        (np.asarray(numerator), np.asarray(denominator)),
        quotient,
        paired=True,
        vectorized=True,
        n_resamples=BOOTSTRAP_RESAMPLES,
        method="percentile",
        **{key: seed},
    )
    ci = result.confidence_interval
    estimate = math.sqrt(sum(numerator) / sum(denominator))
    return {"estimate": estimate, "lo": float(ci.low), "hi": float(ci.high), "batches": len(numerator)}


def condition(instrument_set: dict, tokens_per_step: int) -> dict:
    """The amendment's condition at `tokens_per_step`: met when Wgrad's noise_ratio exceeds Fprop's there;
    not evaluated (met None) when the set has no row at that batch."""
    row = next((r for r in instrument_set["rows"] if r["tokens_per_step"] == tokens_per_step), None)
    if row is None:
        return {"tokens_per_step": tokens_per_step, "met": None, "why": "no instruments at this batch"}
    wgrad, fprop = row["wgrad"]["noise_ratio"], row["fprop"]["noise_ratio"]
    kept = all("err_sq_per_batch" in row[s] for s in ("wgrad", "fprop"))
    quotient = (
        error_quotient_interval(row["wgrad"]["err_sq_per_batch"], row["fprop"]["err_sq_per_batch"])
        if kept
        else None
    )
    spread = (
        f"; Wgrad / Fprop {quotient['estimate']:.2f} [{quotient['lo']:.2f}, {quotient['hi']:.2f}], "
        f"bootstrap over {quotient['batches']} batches"
        if quotient
        else "; no interval: these files keep no per-batch errors"
    )
    return {
        "tokens_per_step": tokens_per_step,
        "wgrad_noise_ratio": wgrad,
        "fprop_noise_ratio": fprop,
        "wgrad_over_fprop": quotient,
        "met": wgrad > fprop,
        "why": f"Wgrad's error-to-noise ratio {wgrad:.3f} {'>' if wgrad > fprop else '<='} "
        f"Fprop's {fprop:.3f}{spread}",
    }


def rows_markdown(instrument_set: dict) -> list[str]:
    """The set as a table: per tokens per step and stage, the whole-model figures."""
    lines = [
        "| tokens / step | A | stage | error / noise | coherence (gradient's) | sqrt(3) ratio | "
        "update rel. error | update cos |",
        "|---:|---:|---|---:|---:|---:|---:|---:|",
    ]
    for row in instrument_set["rows"]:
        for stage in STAGES:
            s = row[stage]
            lines.append(
                f"| {row['tokens_per_step']:,} | {row['accumulate']} | {stage} | {s['noise_ratio']:.3f} | "
                f"{s['coherence']:.2f} ({s['grad_coherence']:.2f}) | {s['sqrt3_ratio']:.2f} | "
                f"{s['update_rel_err']:.4f} | {s['update_cos']:.4f} |"
            )
    return lines
