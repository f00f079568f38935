"""The claims layer's analysis of a branch stage (fp4jax.study.branching): per branch step s and eval
tokens T shared by the branches from s, each arm's eval loss minus the baseline arm's branch from the
same trunk (seed) and step, per seed and as the paired model's contrast (stats.fit_additive over arms x
trunks, residual variance pooled over arms) and, beside it, the per-trunk differences' paired t interval
(stats.paired_t, 2 trunks or more). `branch_runs` gives the branches from one step as the from-scratch
analysis reads runs, for the claims per branch point.
"""

from __future__ import annotations

import math
import os
import statistics

from fp4jax.study import analysis, runs, stats
from fp4jax.study.plan import stage_specs

__all__ = ["analyze", "branch_runs", "to_markdown", "trunk_tokens"]


def _arm(spec) -> str:
    """A branch's arm: its rung "<arm>/at<step>" without the step."""
    return spec.rung.name.split("/")[0]


def _evals(directory: str) -> dict[int, tuple[int, float]] | None:
    """{tokens: (step, eval loss)} of a finished, not diverged branch; None otherwise."""
    summary = runs.read_json(runs.summary_path(directory))
    if runs.status_of(summary) not in ("reached", "not_reached"):
        return None
    return {
        int(e.tokens): (int(e.step), float(e.loss))
        for e in runs.evals_from(summary, [])
        if math.isfinite(e.loss)
    }


def branch_runs(sroot: str, stage, at: int) -> list[analysis.StudyRun]:
    """The branches from trunk step `at` that have a directory, as the from-scratch analysis reads runs
    (rung = arm, seed = trunk): the pre-registered claims (claims.analyze) apply to them per branch step,
    the trunk standing for the seed (docs/study_plan.md, amendment "the claims on the branching ladder")."""
    return [
        analysis.load_run(_arm(spec), None, spec.seed, spec.directory(sroot))
        for spec in _branches_from(stage, at)
        if os.path.isdir(spec.directory(sroot))
    ]


def trunk_tokens(branches: list[analysis.StudyRun], at: int) -> int:
    """The tokens a trunk had trained at step `at`: at x the tokens per update that the branches'
    evaluations record (every (step, tokens) pair must give the same whole number)."""
    per_update = {tokens / step for run in branches for step, tokens, _ in run.evals if step > 0}
    if len(per_update) != 1 or not float(next(iter(per_update))).is_integer():
        raise ValueError(
            f"the branches from step {at} record {sorted(per_update)} tokens per update, not one whole "
            "number: their batch size differs or changed, so the trunk's tokens are not at x one count"
        )
    return int(at * per_update.pop())


def _branches_from(stage, at: int) -> list:
    """The stage's branches from trunk step `at`, in stage_specs' order."""
    return [s for s in stage_specs(stage) if getattr(s, "at", None) == at]


def analyze(sroot: str, stage) -> dict:
    """Per branch step, per eval tokens every branch from that step reached: per arm its eval loss minus
    the baseline's branch from the same trunk and step (per seed, their mean), and the paired model's
    contrast arm - baseline (estimate, SE, 95 % t interval, df; None where the table has no residual df).
    Runs without a final, not diverged summary are listed under "missing" and left out."""
    points = []
    for at in stage.options.branch_steps:
        curves, missing = {}, []
        for spec in _branches_from(stage, at):
            evals = _evals(spec.directory(sroot))
            if evals is None:
                missing.append(spec.label)
            else:
                curves[(_arm(spec), spec.seed)] = evals
        points.append({"at": at, "missing": missing, "evals": _point_evals(curves, stage)})
    return {
        "stage": stage.name,
        "design": "branch",
        "baseline": stage.baseline,
        "trunk_arm": stage.options.trunk_arm,
        "branch_length": stage.options.branch_length,
        "points": points,
    }


def _point_evals(curves: dict, stage) -> list[dict]:
    """One entry per eval tokens count shared by every branch present at a branch step."""
    if not curves:
        return []
    shared = sorted(set.intersection(*(set(c) for c in curves.values())))
    arms = [a for a in stage.arms if any(arm == a for arm, _ in curves)]
    rows = []
    for tokens in shared:
        loss = {key: c[tokens][1] for key, c in curves.items()}
        step = next(iter(curves.values()))[tokens][0]
        rows.append({"tokens": tokens, "step": step, "arms": _differences(loss, arms, stage)})
    return rows


def _differences(loss: dict, arms: list[str], stage) -> dict:
    base = stage.baseline
    table = {(arm, f"seed{seed}"): value for (arm, seed), value in loss.items()}
    fit = stats.fit_additive(*stats.cells_to_table(table, arms=arms)) if base in arms else None
    out = {}
    for arm in arms:
        per_seed = {s: loss[(arm, s)] for (a, s) in loss if a == arm}
        diffs = {s: v - loss[(base, s)] for s, v in per_seed.items() if (base, s) in loss}
        row = {
            "loss": {str(s): v for s, v in per_seed.items()},
            "difference": {str(s): d for s, d in diffs.items()},
            "mean_difference": statistics.fmean(diffs.values()) if diffs else None,
            "contrast": None,
            # the per-trunk differences' one-sample t, beside the pooled contrast (2 trunks or more)
            "paired": stats.paired_t(list(diffs.values())) if arm != base and len(diffs) >= 2 else None,
        }
        if fit is not None and arm != base and diffs:
            try:
                row["contrast"] = stats.contrast(fit, {arm: 1.0, base: -1.0}, f"{arm} - {base}")
            except ValueError:  # no residual df (one trunk), or not estimable: the differences stand alone
                pass
        out[arm] = row
    return out


def _interval_cell(row: dict | None) -> str:
    if row is None:
        return "-"
    return f"{row['estimate']:+.4f} ± {row['se']:.4f} [{row['ci_low']:+.4f}, {row['ci_high']:+.4f}]"


def to_markdown(result: dict) -> str:
    """Per branch step, the last shared evaluation: each arm's loss difference to the baseline's branch."""
    lines = [
        f"Branching design: trunks of `{result['trunk_arm']}`, {result['branch_length']} updates per branch; "
        f"eval loss minus the `{result['baseline']}` branch from the same trunk and step (nats).",
    ]
    for point in result["points"]:
        lines += ["", f"Branched at step {point['at']}:", ""]
        if not point["evals"]:
            lines.append("no finished branches yet")
            continue
        last = point["evals"][-1]
        lines += [
            f"| arm | difference at {last['tokens']:,} tokens (mean over trunks) | contrast ± SE [95 % CI] | "
            "paired t [95 % CI] | each trunk |",
            "|---|---|---|---|---|",
        ]
        for arm, row in last["arms"].items():
            mean = "-" if row["mean_difference"] is None else f"{row['mean_difference']:+.4f}"
            each = ", ".join(f"s{s}: {d:+.4f}" for s, d in row["difference"].items())
            cells = [arm, mean, _interval_cell(row["contrast"]), _interval_cell(row.get("paired")), each]
            lines.append("| " + " | ".join(cells) + " |")
        if point["missing"]:
            lines.append(f"\nnot finished (left out): {', '.join(point['missing'])}")
    return "\n".join(lines) + "\n"
