"""A study's numbers from its run directories: tokens to target, seed statistics, overhead, speed-up, LR
sensitivity. Every result is a plain dict (the report's JSON).

Definitions:
- tokens to target: the eval loss is taken linear in tokens between the last evaluation above the target,
  (t0, L0), and the first at or below it, (t1, L1): t0 + (L0 - target) / (L0 - L1) x (t1 - t0). Its
  resolution is the bracket t1 - t0 (the evaluation interval, reported beside it). A run whose first
  evaluation is already at or below the target has no bracket: t1 is reported (an upper bound).
- per rung, over seeds: mean and sample sd (n - 1) of tokens to target over the seeds that reached it;
  seeds that diverged, ran out of budget or failed are counted, never averaged.
- token overhead = mean_rung / mean_baseline - 1 (same peak LR). Its standard error by the delta method,
  treating the two means as independent: (mean_rung / mean_baseline) x sqrt(se_r^2 / mean_r^2 +
  se_b^2 / mean_b^2), se = sd / sqrt(n); undefined when either side has fewer than 2 seeds that reached.
  Paired form beside it: mean and sd over seeds of (t_rung,k / t_baseline,k - 1), seeds where both reached.
- throughput: a run's median training tokens/s (its summary's tokens_per_s_median, else the same rule,
  training.metrics.median_tokens_per_s, over its metrics.jsonl: the updates after the first 3, which
  compile); a rung's is the mean over its runs, with the GPU sharing its runs ran under (runs.gpu_sharing).
  Speed-ups compare only groups whose runs all ran under one recorded sharing: "-" otherwise.
- time to target T = mean tokens to target / throughput. End-to-end speed-up = T_baseline / T_rung; time
  saved = 1 - T_rung / T_baseline. Their standard errors carry the overhead's relative error only
  (throughput is taken as exact).
- LR sensitivity: final eval loss = a run's last evaluation; mean and sd over seeds that did not diverge or
  fail; diverged seeds counted.
"""

from __future__ import annotations

import dataclasses
import math
import os
import statistics

from fp4jax.study import runs
from fp4jax.study.stats import crossing

__all__ = [
    "GEMMS",
    "NO_BASE",
    "OUTCOMES",
    "SELF",
    "StudyRun",
    "analyze",
    "crossing",
    "diagnostics",
    "first_probed",
    "group_stats",
    "load_run",
    "load_runs",
    "lr_sensitivity",
    "mean_sd",
    "outcome",
    "overhead",
    "resolve_target",
    "run_row",
    "speedup",
]

# The probe's GEMM names, fp4jax.ops.GEMMS (tested equal): the study reads metrics without the ops.
GEMMS = ("fprop", "dgrad", "wgrad")
OUTCOMES = ("reached", "not_reached", "diverged", "failed", "unfinished")
SELF = {"token_overhead": 0.0, "token_overhead_se": None, "relative_se": None, "paired": None}
NO_BASE = {"tokens_to_target_mean": None, "tokens_to_target_sd": None, "tokens_per_s": None, "runs": []}


@dataclasses.dataclass(frozen=True)
class StudyRun:
    """One run of a study as the report reads it (its directory's summary.json and metrics.jsonl)."""

    rung: str
    lr: float | None
    seed: int
    # a run summary's status (training/summary.py), "failed", or "unfinished" (no summary yet, or preempted)
    status: str
    evals: tuple[runs.Eval, ...]
    target_eval_loss: float | None
    tokens: int | None  # trained
    diverged_step: int | None
    diverged_tokens: int | None
    divergence_reason: str | None
    failure: str | None
    tokens_per_s: float | None
    directory: str
    diagnostics: dict | None = None  # diagnostics(records)
    runs_per_gpu: int | None = None  # runs.gpu_sharing of the run's attempts (None: not recorded)
    final_eval: float | None = None  # the summary's final evaluation (final_eval_sequences > 0), nats


def load_run(rung: str, lr: float | None, seed: int | None, run_dir: str) -> StudyRun:
    """A run from its summary.json (either trainer's) and metrics.jsonl."""
    summary = runs.read_json(runs.summary_path(run_dir))
    records = runs.read_records(run_dir)
    s = summary or {}
    status = runs.status_of(summary)
    return StudyRun(
        rung=rung,
        lr=lr,
        seed=seed if seed is not None else s.get("seed") or 0,
        status=status if status in runs.FINAL_STATUSES else "unfinished",
        evals=tuple(runs.evals_from(summary, records)),
        target_eval_loss=s.get("target_eval_loss"),
        tokens=s.get("tokens", records[-1]["tokens"] if records else None),
        diverged_step=s.get("diverged_step"),
        diverged_tokens=s.get("diverged_tokens"),
        divergence_reason=s.get("divergence_reason"),
        failure=s.get("failure"),
        tokens_per_s=s.get("tokens_per_s_median") or runs.median_tokens_per_s(records),
        directory=run_dir,
        diagnostics=diagnostics(records),
        runs_per_gpu=runs.gpu_sharing(_attempts_record(run_dir)),
        final_eval=(s.get("final_eval") or {}).get("final_eval_loss"),
    )


def _attempts_record(run_dir: str) -> dict | None:
    """The runner's record of the attempts that made the run: its own, or for a run filled from an
    identical run of an earlier stage (plan.reuse_earlier_run: "reused_from", ROOT-relative) that one's."""
    record = runs.read_json(os.path.join(run_dir, runs.RECORD_FILE))
    origin = (record or {}).get("reused_from")
    if origin is None:
        return record
    study_root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.normpath(run_dir))))
    return runs.read_json(os.path.join(study_root, origin, runs.RECORD_FILE))


def first_probed(group: dict) -> dict | None:
    """The first run (seed order) of a report group whose diagnostics probe ran, else None."""
    return next((r for r in group["runs"] if r.get("diagnostics")), None)


def diagnostics(records: list[dict]) -> dict | None:
    """The per-GEMM probe's lines ("diag/<kind>/<gemm>/<quantity>" keys of training lines,
    docs/diagnostics.md), reduced:
    at each probed step, out_rel_err per GEMM as the mean over layer kinds; the last probe's out_rel_err
    per kind and GEMM, and its per-layer Wgrad error; overhead = sum diag_time_s / sum step_time_s over the
    run (the trainer leaves the probe's time out of step_time_s), which includes the probe's one-time
    compilation; probe_steps = median probe time after the first / median step time, the steady cost of
    one probe in steps (the overhead at every N is about probe_steps / N). None when the run was not
    probed."""
    probed = [r for r in runs.train_records(records) if "diag_time_s" in r]
    if not probed:
        return None
    last = probed[-1]
    pairs = [k.split("/")[1:3] for k in last if k.startswith("diag/") and k.endswith("/out_rel_err")]
    pairs = [(kind, gemm) for kind, gemm in pairs if not kind.startswith("layer_")]
    gemms = [g for g in GEMMS if any(gemm == g for _, gemm in pairs)]
    series = {
        g: [statistics.fmean(r[f"diag/{k}/{g}/out_rel_err"] for k, gg in pairs if gg == g) for r in probed]
        for g in gemms
    }
    layers = sorted(k for k in last if k.startswith("diag/layer_") and k.endswith("/wgrad/out_rel_err"))
    step_time = sum(r.get("step_time_s", 0.0) for r in runs.train_records(records))
    return {
        "steps": [r["step"] for r in probed],
        "out_rel_err": series,
        "last_step": last["step"],
        "last_out_rel_err": {f"{k}/{g}": last[f"diag/{k}/{g}/out_rel_err"] for k, g in pairs},
        "last_wgrad_by_layer": [last[k] for k in layers],
        "overhead": _ratio(sum(r["diag_time_s"] for r in probed), step_time),
        "probe_steps": _probe_steps(probed, runs.train_records(records)),
    }


def _probe_steps(probed: list[dict], train: list[dict]) -> float | None:
    """Median probe time after the first (which compiles) over the median step time; None below 2 probes."""
    steps = [r["step_time_s"] for r in train if r.get("step_time_s")]
    if len(probed) < 2 or not steps:
        return None
    return statistics.median(r["diag_time_s"] for r in probed[1:]) / statistics.median(steps)


def load_runs(root: str) -> list[StudyRun]:
    return [load_run(*found) for found in runs.find_runs(root)]


# ------------------------------------------------------------------------------------------- one run


def outcome(run: StudyRun, target: float) -> str:
    """reached / not_reached / diverged / failed / unfinished against the report's target (which may differ
    from the one the run stopped at); a run that crossed the target before it diverged has reached it."""
    if run.status == "unfinished":
        return "unfinished"
    if crossing(run.evals, target) is not None:
        return "reached"
    return "not_reached" if run.status in runs.FINISHED else run.status


def run_row(run: StudyRun, target: float) -> dict:
    hit = crossing(run.evals, target)
    return {
        "rung": run.rung,
        "lr": run.lr,
        "seed": run.seed,
        "outcome": outcome(run, target),
        "status": run.status,
        "tokens_to_target": hit and hit["tokens"],
        "crossing": hit,
        "tokens_trained": run.tokens,
        "diverged_step": run.diverged_step,
        "diverged_tokens": run.diverged_tokens,
        "divergence_reason": run.divergence_reason,
        "failure": run.failure,
        "tokens_per_s": run.tokens_per_s,
        "runs_per_gpu": run.runs_per_gpu,
        "final_eval_loss": run.evals[-1].loss if run.evals else None,
        "evals": [list(e) for e in run.evals],
        "directory": run.directory,
        "diagnostics": run.diagnostics,
    }


# --------------------------------------------------------------------------------------------- seeds


def mean_sd(values: list[float]) -> tuple[float | None, float | None]:
    """(mean, sample sd with n - 1); sd None below 2 values, both None for none."""
    if not values:
        return None, None
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else None


def group_stats(rows: list[dict]) -> dict:
    """Seed statistics of one (rung, lr): counts of each outcome, tokens to target, throughput, final loss."""
    reached = [r for r in rows if r["outcome"] == "reached"]
    ttt_mean, ttt_sd = mean_sd([r["tokens_to_target"] for r in reached])
    finals = [r["final_eval_loss"] for r in rows if r["outcome"] in runs.FINISHED]
    final_mean, final_sd = mean_sd([f for f in finals if f is not None])
    intervals = sorted({r["crossing"]["interval"] for r in reached})
    rates = [r["tokens_per_s"] for r in rows if r["tokens_per_s"]]
    sharing = {r.get("runs_per_gpu") for r in rows}
    return {
        "rung": rows[0]["rung"],
        "lr": rows[0]["lr"],
        "seeds": [r["seed"] for r in rows],
        "counts": {k: sum(r["outcome"] == k for r in rows) for k in OUTCOMES},
        "tokens_to_target_mean": ttt_mean,
        "tokens_to_target_sd": ttt_sd,
        "tokens_to_target_n": len(reached),
        "eval_intervals": intervals,
        "tokens_per_s": statistics.fmean(rates) if rates else None,
        "runs_per_gpu": next(iter(sharing)) if len(sharing) == 1 else None,  # None: mixed or not recorded
        # Every run's sharing recorded but not one value: the report says so instead of "not recorded".
        "gpu_sharings": sorted(sharing) if len(sharing) > 1 and None not in sharing else None,
        "final_eval_loss_mean": final_mean,
        "final_eval_loss_sd": final_sd,
        "runs": rows,
    }


def _se(group: dict) -> float | None:
    sd, n = group["tokens_to_target_sd"], group["tokens_to_target_n"]
    return None if sd is None else sd / math.sqrt(n)


def overhead(group: dict, base: dict) -> dict:
    """Token overhead against the baseline group and its spread (module docstring's rules)."""
    m_r, m_b = group["tokens_to_target_mean"], base["tokens_to_target_mean"]
    if m_r is None or m_b is None:
        return {"token_overhead": None, "token_overhead_se": None, "relative_se": None, "paired": None}
    se_r, se_b = _se(group), _se(base)
    rel = None if se_r is None or se_b is None else math.hypot(se_r / m_r, se_b / m_b)
    base_by_seed = {r["seed"]: r for r in base["runs"] if r["outcome"] == "reached"}
    ratios = [
        r["tokens_to_target"] / base_by_seed[r["seed"]]["tokens_to_target"] - 1
        for r in group["runs"]
        if r["outcome"] == "reached" and r["seed"] in base_by_seed
    ]
    p_mean, p_sd = mean_sd(ratios)
    return {
        "token_overhead": m_r / m_b - 1,
        "token_overhead_se": None if rel is None else m_r / m_b * rel,
        "relative_se": rel,
        "paired": {"mean": p_mean, "sd": p_sd, "n": len(ratios)} if ratios else None,
    }


def speedup(group: dict, base: dict, relative_se: float | None) -> dict:
    """Step speed-up, end-to-end speed-up T_b / T_r and time saved 1 - T_r / T_b, with standard errors;
    all None unless every run of both groups ran with the same recorded GPU sharing (runs.gpu_sharing):
    throughputs measured under different sharing differ by the sharing, not the recipe."""
    comparable = group.get("runs_per_gpu") is not None and group.get("runs_per_gpu") == base.get(
        "runs_per_gpu"
    )
    step = _ratio(group["tokens_per_s"], base["tokens_per_s"]) if comparable else None
    t_r = _ratio(group["tokens_to_target_mean"], group["tokens_per_s"])
    t_b = _ratio(base["tokens_to_target_mean"], base["tokens_per_s"])
    ratio = _ratio(t_b, t_r) if comparable else None
    saved = None if ratio is None else 1 - 1 / ratio
    return {
        "step_speedup": step,
        "time_to_target_s": t_r,
        "end_to_end_speedup": ratio,
        "end_to_end_speedup_se": None if ratio is None or relative_se is None else ratio * relative_se,
        "time_saved": saved,
        "time_saved_se": None if ratio is None or relative_se is None else relative_se / ratio,
    }


def _ratio(a, b):
    return None if a is None or not b else a / b


# ------------------------------------------------------------------------------------------ the study


def resolve_target(all_runs: list[StudyRun], baseline: str, spec: str) -> tuple[float, str]:
    """(target eval loss, the rule that chose it) for --target: "config" (the runs' target_eval_loss, one
    value), a number, or "auto" / "auto+MARGIN" (the worst over the baseline's runs of their best eval
    loss, plus MARGIN nats, so that every baseline run that evaluated reaches it)."""
    if spec == "config":
        targets = sorted({r.target_eval_loss for r in all_runs if r.target_eval_loss is not None})
        if len(targets) != 1:
            raise ValueError(f"runs' target_eval_loss values are {targets}: pass --target LOSS or auto")
        return targets[0], "the configs' target_eval_loss"
    if spec.startswith("auto"):
        margin = float(spec[5:] or 0) if spec[4:5] in ("", "+") else None
        if margin is None:
            raise ValueError(f"--target {spec}: use auto or auto+MARGIN, e.g. auto+0.02")
        bests = [min(e.loss for e in r.evals) for r in all_runs if r.rung == baseline and r.evals]
        if not bests:
            raise ValueError(f"baseline {baseline!r} has no evaluation: --target auto needs one")
        rule = f"auto: the worst of the baseline's {len(bests)} run(s)' best eval loss + {margin:g} nats"
        return max(bests) + margin, rule
    try:
        return float(spec), "given (--target)"
    except ValueError:
        raise ValueError(f"--target {spec!r}: use config, auto, auto+MARGIN or a loss in nats") from None


def analyze(all_runs: list[StudyRun], baseline: str, target_spec: str = "config", rungs=None) -> dict:
    """The study's JSON: target and its rule, one group a (rung, peak LR) with overhead and speed-up
    against the baseline at the same LR (or its only LR), names of rungs asked for but absent."""
    found = sorted({r.rung for r in all_runs})
    if baseline not in found:
        raise ValueError(f"baseline run {baseline!r} has no runs: rungs found: {found}")
    order = list(rungs) if rungs else [baseline] + [n for n in found if n != baseline]
    target, rule = resolve_target(all_runs, baseline, target_spec)
    groups = {}
    for run in sorted(all_runs, key=lambda r: (r.seed, r.lr or 0.0)):
        if run.rung in order:
            groups.setdefault((run.rung, run.lr), []).append(run_row(run, target))
    stats = {key: group_stats(rows) for key, rows in groups.items()}
    base_lrs = [lr for rung, lr in stats if rung == baseline]
    only_base = stats[(baseline, base_lrs[0])] if len(base_lrs) == 1 else NO_BASE
    table = []
    for (_, lr), group in sorted(stats.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1] or 0.0)):
        base = stats.get((baseline, lr), only_base)
        rel = overhead(group, base)
        if group is base and rel["token_overhead"] is not None:
            rel = SELF  # the baseline against itself: 0 by definition, no spread
        table.append({**group, **rel, **speedup(group, base, rel["relative_se"])})
    return {
        "target_eval_loss": target,
        "target_rule": rule,
        "baseline": baseline,
        "definitions": __doc__,
        "missing_rungs": [n for n in order if n not in found],
        "groups": table,
        "lr_sensitivity": lr_sensitivity(table),
    }


def lr_sensitivity(groups: list[dict]) -> dict | None:
    """{rung: [[peak lr, final eval loss mean, sd, n not diverged, n diverged], ...]} when runs swept the
    LR (more than one LR for some rung), else None."""
    curves: dict[str, list] = {}
    for g in groups:
        if g["lr"] is not None:
            n_ok = g["counts"]["reached"] + g["counts"]["not_reached"]
            row = [g["lr"], g["final_eval_loss_mean"], g["final_eval_loss_sd"], n_ok, g["counts"]["diverged"]]
            curves.setdefault(g["rung"], []).append(row)
    if not any(len(c) > 1 for c in curves.values()):
        return None
    return {rung: sorted(rows) for rung, rows in curves.items()}
