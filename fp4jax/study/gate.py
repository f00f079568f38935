"""The gate and statistics layer's per-stage rule: the calibration gate a later stage waits for.

A stage's `gate` (plan file: arm, against, last_evals, smallest_overhead, sigmas) passes when the paired
seed-to-seed noise of the primary metric (stats.primary_metric: the mean eval loss of the last
`last_evals` evaluations) is small enough to resolve the smallest token overhead of interest. The
schedule reads it (a stage that requires a gated stage waits until it passes); the report writes it.
"""

from __future__ import annotations

import math
import statistics

import scipy.stats

from fp4jax.study import runs, stats
from fp4jax.study.plan import Stage, stage_root, stage_specs

__all__ = ["gate_result", "local_slope", "primary_loss"]


def primary_loss(summary: dict | None, last_evals: int) -> float | None:
    """A run's primary metric from its summary: None for a run without a final status or with fewer
    evaluations."""
    if runs.status_of(summary) not in runs.FINISHED:
        return None
    evals = runs.evals_from(summary, [])
    if len(evals) < last_evals:
        return None
    return stats.primary_metric(evals, last_evals)[0]


def local_slope(evals_by_seed: list[list[runs.Eval]], last_fraction: float = 0.5) -> float | None:
    """-dL/d(ln T) of the seeds' mean eval curve over the last `last_fraction` of its tokens (a least-squares
    line in ln T, scipy's linregress): a loss difference dL at the horizon is a token ratio of
    exp(dL / slope)."""
    curves = [{e.tokens: e.loss for e in evals} for evals in evals_by_seed if evals]
    if not curves:
        return None
    tokens = sorted(set.intersection(*(set(c) for c in curves)))
    tokens = [t for t in tokens if t > 0 and t >= (1 - last_fraction) * tokens[-1]] if tokens else []
    if len(tokens) < 3:
        return None
    mean_loss = [statistics.fmean(c[t] for c in curves) for t in tokens]
    return -float(scipy.stats.linregress([math.log(t) for t in tokens], mean_loss).slope)


def gate_result(root: str, stage: Stage) -> dict:
    """The calibration gate of a stage (stage.gate: arm, against, last_evals, smallest_overhead, sigmas).

    Per seed k the paired difference d_k = L(arm, k) - L(against, k) of the primary metric. The gate passes
    when `sigmas` standard errors of the mean difference over the stage's seeds, sd(d) / sqrt(n), are at
    most the loss difference of the smallest token overhead of interest, slope x ln(1 + smallest_overhead),
    with slope the `against` arm's local -dL/d(ln T) at the horizon (`local_slope`). Equivalently the
    paired sd may be at most sd_max = slope x ln(1 + smallest_overhead) x sqrt(n) / sigmas. Not passed (and
    "complete": False) while any run of the two arms lacks its primary metric. ci95: mean +- the t
    quantile (n - 1 df) x sd / sqrt(n).
    """
    gate = stage.gate
    sroot = stage_root(root, stage)
    loss: dict[str, dict[int, float | None]] = {}
    evals: dict[str, list] = {}
    for spec in stage_specs(stage):
        summary = runs.read_json(runs.summary_path(spec.directory(sroot)))
        loss.setdefault(spec.rung.name, {})[spec.seed] = primary_loss(summary, gate["last_evals"])
        evals.setdefault(spec.rung.name, []).append(runs.evals_from(summary, []))
    a, b = loss[gate["arm"]], loss[gate["against"]]
    seeds = [s for s in stage.seeds if a.get(s) is not None and b.get(s) is not None]
    result = {
        "stage": stage.name,
        "metric": f"mean eval loss of the last {gate['last_evals']} evaluations",
        "arm": gate["arm"],
        "against": gate["against"],
        "per_seed": {str(s): {gate["arm"]: a.get(s), gate["against"]: b.get(s)} for s in stage.seeds},
        "complete": len(seeds) == len(stage.seeds),
        "passed": False,
    }
    n = len(seeds)
    if n < 2:
        return result
    diffs = [a[s] - b[s] for s in seeds]
    mean, sd = statistics.fmean(diffs), statistics.stdev(diffs)
    half = stats.t_quantile(n - 1) * sd / math.sqrt(n)
    slope = local_slope(evals[gate["against"]])
    unpaired = {
        arm: statistics.stdev([loss[arm][s] for s in seeds]) for arm in (gate["arm"], gate["against"])
    }
    result.update(
        differences={str(s): d for s, d in zip(seeds, diffs, strict=True)},
        mean_difference=mean,
        paired_sd=sd,
        unpaired_sd=unpaired,
        ci95=[mean - half, mean + half],
        slope=slope,
    )
    if slope is None or slope <= 0:
        result["why"] = "the baseline's curve has no falling tail to convert losses to tokens"
        return result
    smallest = slope * math.log1p(gate["smallest_overhead"])
    sd_max = smallest * math.sqrt(n) / gate["sigmas"]
    result.update(
        smallest_loss_difference=smallest,
        paired_sd_max=sd_max,
        token_ratio=math.exp(mean / slope),
        token_ratio_ci95=[math.exp(x / slope) for x in result["ci95"]],
        passed=result["complete"] and sd <= sd_max,
    )
    return result
