"""The claims layer's LR-stress analysis. Loss spikes per run of a stage that counts them (a from-scratch
stage's count_spikes), and the LR-stress series: the runs of a reference stage (1x) and of the stages
that name it as lr_reference (4x, 16x, ...), each arm's loss difference against the baseline at every
LR point with spikes and divergences beside it, and the
decision rule of docs/study_plan.md (amendment of 2026-12-04, the LR stress test).

Invariants:
- a run's spikes are stats.loss_spikes of its training losses in metrics.jsonl up to its first non-finite
  loss (that is a divergence, not a spike); a run the trainer stopped on its own rule is counted up to the
  stop;
- every run the plan lists has a row: "not run" without a directory, "unfinished" without a final
  summary; totals count only ended runs (a final status of their own: runs.FINISHED or "diverged");
- only finished runs have the primary metric (claims.primary_cells: the mean of the last k evaluations);
  a diverged run's cell says so beside the difference, it is never dropped silently;
- a series compares the stress stages' arms and seeds (the plan makes them one set) at every point, the
  reference's other arms and seeds left out, and counts spikes by their one rule at every point, 1x too;
  differences are paired by seed (seeds where both arms have the metric);
- the growth of an arm's difference from 1x to a point is the contrast (arm - baseline at the point) -
  (arm - baseline at 1x) of one paired arm x seed model over every point, arms and seeds named per point
  (no block is shared across points), so its residual variance is pooled over the points.
"""

from __future__ import annotations

import itertools
import math
import os
import statistics

from fp4jax.study import analysis, claims, plan, runs, stats

__all__ = [
    "ENDED",
    "SPIKE_KEYS",
    "GREW",
    "LESS_STABLE",
    "NOT_SHOWN",
    "WAITING",
    "paired_at",
    "reference_of",
    "references",
    "run_row",
    "run_spikes",
    "series",
    "series_markdown",
    "spikes_markdown",
    "stage_spikes",
    "totals",
]

SPIKE_KEYS = ("spike_nats", "window")  # a from-scratch stage's count_spikes: stats.loss_spikes's rule
ENDED = (*runs.FINISHED, "diverged")  # a run's own outcome; "failed" is the harness's, not the run's
GREW = 2.0  # the growth from 1x that counts: more than GREW standard errors of the contrast
LESS_STABLE = "less LR-stable than the baseline"
NOT_SHOWN = "not shown less LR-stable (the rule can detect instability, not exclude it)"
WAITING = "not decided: runs missing"


# ------------------------------------------------------------------------------------------ one run


def run_spikes(run_dir: str, rule: dict) -> dict:
    """{"spikes", "first_spike_step", "spike_steps": [[start, end], ...]} of the run's training losses under
    `rule` ({spike_nats, window}: stats.loss_spikes), up to its first non-finite loss."""
    train = runs.train_records(runs.read_records(run_dir))
    finite = list(itertools.takewhile(lambda r: math.isfinite(r["loss"]), train))
    found = stats.loss_spikes([r["step"] for r in finite], [r["loss"] for r in finite], **rule)
    return {
        "spikes": len(found),
        "first_spike_step": found[0]["start_step"] if found else None,
        "spike_steps": [[s["start_step"], s["end_step"]] for s in found],
    }


def run_row(arm: str, seed: int, run_dir: str, rule: dict) -> dict:
    """One run: its status (a final one, else "unfinished", or "not run" without a directory), whether it
    diverged and the trainer's divergence {kind, step, value} from summary.json, and its spikes (None when
    not run)."""
    summary = runs.read_json(runs.summary_path(run_dir))
    status = runs.status_of(summary)
    if status not in runs.FINAL_STATUSES:
        status = "unfinished" if os.path.isdir(run_dir) else "not run"
    divergence = None
    if status == "diverged":  # an older summary has only the flat keys
        flat = {"kind": summary.get("divergence_reason"), "step": summary.get("diverged_step"), "value": None}
        divergence = summary.get("divergence") or flat
    row = {"arm": arm, "seed": seed, "status": status, "diverged": divergence is not None}
    row.update(divergence=divergence, directory=run_dir)
    none = {"spikes": None, "first_spike_step": None, "spike_steps": []}
    return {**row, **(none if status == "not run" else run_spikes(run_dir, rule))}


def totals(rows: list[dict]) -> dict:
    """Counts over an arm's runs: planned, ended (ENDED), ended with at least one spike, spikes, diverged,
    and `unstable` (ended runs that spiked or diverged)."""
    ended = [r for r in rows if r["status"] in ENDED]
    return {
        "runs": len(rows),
        "ended": len(ended),
        "with_spikes": sum(r["spikes"] > 0 for r in ended),
        "spikes": sum(r["spikes"] for r in ended),
        "diverged": sum(r["diverged"] for r in ended),
        "unstable": sum(r["spikes"] > 0 or r["diverged"] for r in ended),
    }


def stage_spikes(root: str, stage, rule: dict | None = None, arms=None, seeds=None) -> dict:
    """Every run the stage plans (plan.stage_specs; only `arms` and `seeds` when given) with its spikes under
    `rule` (default: the stage's count_spikes), and per arm the totals."""
    rule = rule or stage.options.count_spikes
    sroot = plan.stage_root(root, stage)
    rows = [
        run_row(spec.rung.name, spec.seed, spec.directory(sroot), rule)
        for spec in plan.stage_specs(stage)
        if (arms is None or spec.rung.name in arms) and (seeds is None or spec.seed in seeds)
    ]
    chosen = [a for a in stage.arms if arms is None or a in arms]
    by_arm = {arm: totals([r for r in rows if r["arm"] == arm]) for arm in chosen}
    return {"stage": stage.name, "peak_lr": stage.peak_lr, "rule": dict(rule), "runs": rows, "arms": by_arm}


def outcome(row: dict) -> str:
    """A run's outcome in words: 'diverged @ step N (kind)', or its status."""
    if row["diverged"]:
        return f"diverged @ step {row['divergence']['step']} ({row['divergence']['kind']})"
    return {"not_reached": "finished", "reached": "finished"}.get(row["status"], row["status"])


def _rule_text(rule: dict) -> str:
    return (
        f"a spike is a run of consecutive updates where the mean of the last {rule['window']} training "
        f"losses exceeds the lowest such mean so far by more than {rule['spike_nats']:g} nats"
    )


def spikes_markdown(spikes: dict) -> list[str]:
    """The stage's spike tables: per run, then per arm (at the stage's one peak LR)."""
    lines = [f"Loss spikes at peak LR {spikes['peak_lr']:g} ({_rule_text(spikes['rule'])}):", ""]
    lines += ["| arm | seed | outcome | spikes | first spike (update) |", "|---|---|---|---|---|"]
    for r in spikes["runs"]:
        cells = [r["arm"], str(r["seed"]), outcome(r), _text(r["spikes"]), _text(r["first_spike_step"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += [
        "",
        "| arm | runs ended / planned | runs with spikes | spikes | diverged |",
        "|---|---|---|---|---|",
    ]
    for arm, t in spikes["arms"].items():
        lines.append(
            f"| {arm} | {t['ended']} / {t['runs']} | {t['with_spikes']} | {t['spikes']} | {t['diverged']} |"
        )
    return lines


def _text(value) -> str:
    return "-" if value is None else str(value)


# ---------------------------------------------------------------------------------------- the series


def reference_of(stage) -> str | None:
    """The stage a stage names as its 1x LR point (a from-scratch stage's lr_reference), else None."""
    return getattr(stage.options, "lr_reference", None)


def references(the_plan) -> list[str]:
    """The stages some stage names as its lr_reference, in plan order: one LR series each."""
    named = {reference_of(s) for s in the_plan.stages}
    return [s.name for s in the_plan.stages if s.name in named]


def _point(root: str, stage, ref, arms, seeds, rule: dict, last_k: int) -> tuple[dict, dict]:
    """(the point's JSON: stage, LR, its multiple of the reference's, per arm the paired differences and
    totals; its primary-metric cells {(arm@label, seed<k>@label): loss} for the model)."""
    label = f"{stage.peak_lr / ref.peak_lr:g}x"
    spikes = stage_spikes(root, stage, rule, arms, seeds)
    loaded = [
        analysis.load_run(r["arm"], None, r["seed"], r["directory"])
        for r in spikes["runs"]
        if r["status"] != "not run"
    ]
    cells, _, _ = claims.primary_cells(loaded, last_k)
    by_arm = {
        arm: _arm_cell(arm, stage.baseline, cells, [r for r in spikes["runs"] if r["arm"] == arm], totals_)
        for arm, totals_ in spikes["arms"].items()
    }
    point = {"stage": stage.name, "peak_lr": stage.peak_lr, "label": label, "rule": dict(rule)}
    named = {(f"{a}@{label}", f"{b}@{label}"): v for (a, b), v in cells.items()}
    return {**point, "arms": by_arm, "runs": spikes["runs"]}, named


def _arm_cell(arm: str, baseline: str, cells: dict, rows: list[dict], counts: dict) -> dict:
    """Per seed the primary metric and the difference against the baseline's same seed; their mean; the
    runs without the metric with their outcome; the arm's totals."""
    per_seed = {}
    for r in rows:
        mine, base = cells.get((arm, f"seed{r['seed']}")), cells.get((baseline, f"seed{r['seed']}"))
        per_seed[str(r["seed"])] = None if mine is None or base is None else mine - base
    diffs = [d for d in per_seed.values() if d is not None]
    missing = [
        {"seed": r["seed"], "outcome": outcome(r)} for r in rows if (arm, f"seed{r['seed']}") not in cells
    ]
    return {
        "difference": statistics.fmean(diffs) if diffs else None,
        "per_seed": per_seed,
        "no_metric": missing,
        **counts,
    }


def paired_at(cells: dict, arm: str, baseline: str, label: str) -> bool:
    """Whether arm and baseline both have the primary metric in some seed at LR point `label`: the plan's
    condition for rule (2); without it the model could still link them through a third arm."""

    def seeds(name: str) -> set:
        return {block for (row, block) in cells if row == f"{name}@{label}"}

    return bool(seeds(arm) & seeds(baseline))


def _growth(fit, cells: dict, arm: str, baseline: str, label: str) -> dict | None:
    """The contrast (arm - baseline at `label`) - (arm - baseline at 1x) with GREW x its SE, None where
    the plan says it cannot be computed (arm and baseline share no seed with the metric at `label` or at
    1x) or the model cannot estimate it (no residual df)."""
    weights = {f"{arm}@{label}": 1, f"{baseline}@{label}": -1, f"{arm}@1x": -1, f"{baseline}@1x": 1}
    if fit is None or fit.df == 0 or not set(weights) <= set(fit.arms):
        return None
    if not (paired_at(cells, arm, baseline, label) and paired_at(cells, arm, baseline, "1x")):
        return None
    try:
        row = stats.contrast(fit, weights, f"{arm}: {label} - 1x")
    except ValueError:  # the arms at one point share no seed with the metric
        return None
    return dict(row, threshold=GREW * row["se"], grew=row["estimate"] > GREW * row["se"])


def _verdict(arm: str, baseline: str, points: list[dict], growth: dict) -> dict:
    """docs/study_plan.md's rule: less LR-stable when, at a stress point, every seed of the arm spiked or
    diverged and no seed of the baseline did, or when its difference grew from 1x to the highest point by
    more than GREW standard errors."""
    unstable = [
        p["label"]
        for p in points[1:]
        if p["arms"][arm]["ended"] == p["arms"][arm]["runs"] == p["arms"][arm]["unstable"]
        and p["arms"][baseline]["ended"] == p["arms"][baseline]["runs"]
        and p["arms"][baseline]["unstable"] == 0
    ]
    top = growth.get(points[-1]["label"])
    why = [f"every seed spiked or diverged at {', '.join(unstable)}, the baseline's none"] if unstable else []
    if top is not None:
        why.append(f"growth 1x to {points[-1]['label']} {top['estimate']:+.4f} (2 SE {top['threshold']:.4f})")
    complete = all(p["arms"][a]["ended"] == p["arms"][a]["runs"] for p in points for a in (arm, baseline))
    if unstable or (top is not None and top["grew"]):
        verdict = LESS_STABLE
    else:
        verdict = NOT_SHOWN if complete else WAITING
    return {"verdict": verdict, "why": "; ".join(why) or "-"}


def series(the_plan, root: str, reference: str) -> dict:
    """The LR series of `reference` (see the module docstring) as JSON-ready data."""
    ref = the_plan.stage(reference)
    stress = sorted((s for s in the_plan.stages if reference_of(s) == reference), key=lambda s: s.peak_lr)
    arms, seeds, rule = (
        list(stress[0].arms),
        sorted(stress[0].seeds),
        stress[0].options.count_spikes,
    )  # shared
    last_k = next((s.gate["last_evals"] for s in the_plan.stages if s.gate), claims.DEFAULT_LAST_K)
    points, cells = [], {}
    for stage in (ref, *stress):
        point, named = _point(root, stage, ref, arms, seeds, rule, last_k)
        points.append(point)
        cells.update(named)
    fit = None
    if cells:
        names = list(dict.fromkeys(a for a, _ in cells))
        fit = stats.fit_additive(*stats.cells_to_table(cells, arms=names))
    others = [a for a in arms if a != ref.baseline]
    growth = {
        a: {p["label"]: _growth(fit, cells, a, ref.baseline, p["label"]) for p in points[1:]} for a in others
    }
    return {
        "reference": reference,
        "baseline": ref.baseline,
        "arms": arms,
        "metric": f"mean eval loss of the last {last_k} evaluations, paired by seed",
        "seeds": seeds,
        "points": points,
        "pooled_sd": None if fit is None or fit.sigma2 is None else math.sqrt(fit.sigma2),
        "df": None if fit is None else fit.df,
        "growth": growth,
        "verdicts": {a: _verdict(a, ref.baseline, points, growth[a]) for a in others},
    }


def _cell(cell: dict, is_baseline: bool) -> str:
    if cell["ended"] == 0 and all(m["outcome"] == "not run" for m in cell["no_metric"]):
        return "not run"
    if is_baseline:
        parts = ["baseline"]
    elif cell["difference"] is None:
        parts = [] if cell["no_metric"] else ["-"]
    else:
        seeds = ", ".join(f"s{k} {d:+.4f}" for k, d in cell["per_seed"].items() if d is not None)
        parts = [f"{cell['difference']:+.4f} ({seeds})"]
    parts += [f"s{m['seed']} {m['outcome']}: no metric" for m in cell["no_metric"]]
    if cell["spikes"] == 0:
        parts.append(f"no spike ({cell['ended']} runs ended)")
    else:
        n = cell["spikes"]
        parts.append(f"{n} spike{'s' * (n > 1)} in {cell['with_spikes']} of {cell['ended']} ended runs")
    return "; ".join(parts)


def _growth_text(rows: dict) -> str:
    shown = [f"{label} {g['estimate']:+.4f} ± {g['se']:.4f}" for label, g in rows.items() if g is not None]
    return "; ".join(shown) or "-"


def series_markdown(result: dict) -> str:
    """The series' table: arms x LR points, growth from 1x, verdict; then the rule and the pooled sd."""
    points, base = result["points"], result["baseline"]
    head = ["arm", *(f"{p['label']} (LR {p['peak_lr']:g}, stage {p['stage']})" for p in points)]
    head += ["growth from 1x ± SE", "verdict"]
    lines = [
        f"LR stress: each arm's loss difference against {base} at the same peak LR ({result['metric']}, "
        f"seeds {', '.join(map(str, result['seeds']))}); a diverged run has no metric and is named in its "
        f"cell. Spikes: {_rule_text(points[-1]['rule'])}.",
        "",
        "| " + " | ".join(head) + " |",
        "|" + "---|" * len(head),
    ]
    for arm in result["arms"]:
        verdict = result["verdicts"].get(arm, {"verdict": "baseline", "why": "-"})
        cells = [_cell(p["arms"][arm], arm == base) for p in points]
        why = "" if verdict["why"] == "-" else f" ({verdict['why']})"
        growth = _growth_text(result["growth"].get(arm, {}))
        lines.append("| " + " | ".join([arm, *cells, growth, verdict["verdict"] + why]) + " |")
    sd = result["pooled_sd"]
    lines += [
        "",
        f"Growth: the contrast (arm - {base} at the point) - (arm - {base} at 1x) of the paired arm x seed "
        f"model at every point, residual sd pooled over the points: "
        + ("none yet" if sd is None else f"{sd:.4f} nats ({result['df']} df)")
        + f"; it counts when above {GREW:g} SE.",
    ]
    return "\n".join(lines) + "\n"
