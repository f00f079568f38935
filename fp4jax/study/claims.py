"""The pre-registered analysis of docs/study_plan.md: the primary metric per arm and seed, the paired
arm x seed model, the contrasts C1-C10 with Holm's correction, each arm's iso-loss token overhead, and a
verdict per claim. Pure functions over analysis.StudyRun lists (run directories are read elsewhere).

Invariants:
- the primary metric is the mean eval loss of the last `last_k` periodic evaluations, at the same tokens for
  every run (stats.final_eval_losses raises otherwise); only runs that ended (not unfinished, not failed,
  not diverged) enter the table, and the others are listed with their outcome;
- a block is a seed: every arm with seed k shares its initialisation and data order;
- the Holm family is the pre-registered family (C1-C7, C10) as far as the runs present make it
  estimable, fitted on the pre-registered arms alone (FAMILY_ARMS: the ladder's ten), so that arms added
  later change neither its pooled variance nor its degrees of freedom; the literature's contrasts (C8, C9
  and their companions) are reported outside it, with no verdict, from a second fit over every arm
  present (its own pooled sd and df, `reported_model`); while some arms are missing the analysis is
  marked interim and every verdict that needs a missing arm says so; so is it while a planned cell (an
  arm present, a planned seed) has not ended, since its verdicts then rest on fewer blocks than planned
  (a diverged or failed run is an outcome, listed under excluded, not pending);
- claim (a)'s rule reads two sums of the family's contrasts (DERIVED: C2 + C3 and C1 - C2 - C3); each is
  one contrast of the same fit, outside the family, judged by Bonferroni over the family's size;
- a contrast whose arms the design does not plan (not in `arms`, e.g. a confirmation at another scale
  with fewer arms) is outside that design's family, listed under `not_in_design`, never "not yet run";
- the secondary metric (study_plan.md) is each ended run's final evaluation (the summary's `final_eval`:
  every validation sequence); the same model over the same arms gives its differences and contrasts
  with t intervals, reported beside the primary ones with no verdict and no token conversion (the
  baseline's curve is fitted to the periodic evaluations, another set of sequences);
- token overheads come from the baseline's fitted curve L(T) = E + A T^-alpha over the second half of its
  runs' tokens (stats.iso_loss_overhead).
"""

from __future__ import annotations

import math

from fp4jax.study import plots, runs, stats

__all__ = [
    "CLAIMS",
    "CONTRASTS",
    "DEFAULT_LAST_K",
    "DERIVED",
    "FAMILY_ARMS",
    "REPORTED",
    "TOKEN_BAND",
    "analyze",
    "claim_verdicts",
    "design_forest_plot",
    "forest_plot",
    "primary_cells",
    "to_markdown",
]

# Differences of the primary metric (nats; positive: the first arm is worse). docs/study_plan.md's table.
CONTRASTS: dict[str, dict[str, float]] = {
    "C1": {"full": 1, "fprop_dgrad": -1},
    "C2": {"fprop": 1, "fp8": -1},
    "C3": {"fprop_dgrad": 1, "fprop": -1},
    "C4": {"full": 1, "h16_wgrad_only": -1},
    "C5": {"full_sr": 1, "full": -1},
    "C6": {"full_sr_prescale": 1, "full": -1},
    "C7": {"full_rht": 1, "full": -1},
    "C10": {"full_h16": 1, "fprop": -1},
}
# The literature's recipes (docs/study_plan.md's amendment): reported, outside the Holm family, no verdict.
REPORTED: dict[str, dict[str, float]] = {
    "C8": {"tseng": 1, "full": -1},
    "C9": {"nvidia": 1, "full": -1},
    "tseng - full_sr_prescale": {"tseng": 1, "full_sr_prescale": -1},
    "nvidia - full_rht": {"nvidia": 1, "full_rht": -1},
    # The decomposition (docs/study_plan.md, amendment of 2026-12-05 "H16's channel"): Wgrad's MXFP4 cost
    # with the other GEMMs in FP8, H16's whole recovery and the parts of it through each rotated GEMM.
    "wgrad - fp8": {"wgrad": 1, "fp8": -1},
    "full - full_h16": {"full": 1, "full_h16": -1},
    "full - h16_fprop": {"full": 1, "h16_fprop": -1},
    "full - h16_fprop_dgrad": {"full": 1, "h16_fprop_dgrad": -1},
    "h16_fprop_dgrad - full_h16": {"h16_fprop_dgrad": 1, "full_h16": -1},
}
# Claim (a)'s rule (docs/study_plan.md) reads two sums of its contrasts: the ordering C1 > C2 + C3, as one
# contrast C1 - C2 - C3 = full - 2 fprop_dgrad + fp8, and the Fprop and Dgrad GEMMs' joint share
# C2 + C3 = fprop_dgrad - fp8. Neither is a member of the Holm family, so "significant" means Bonferroni
# at the family's size m (p * m <= alpha): Holm's most stringent step, and the interval that goes with
# Holm's procedure (docs/study_analysis.md).
DERIVED: dict[str, dict[str, float]] = {
    "C1 - C2 - C3": {"full": 1, "fprop_dgrad": -2, "fp8": 1},
    "C2 + C3": {"fprop_dgrad": 1, "fp8": -1},
}
# The arms the pre-registered family is fitted on: the ladder's ten (docs/study_plan.md, "Model": 10 arms
# x 3 seeds, 18 df), full_h32 among them though no contrast names it.
FAMILY_ARMS = (
    "fp8", "fprop", "fprop_dgrad", "full", "full_sr", "full_sr_prescale", "full_rht", "full_h16",
    "full_h32", "h16_wgrad_only",
)  # fmt: skip
CLAIMS = {
    "a": "Wgrad drives the degradation (C1 large against C2 and C3)",
    "b": "SR and random Hadamard do not stabilise full MXFP4 (C5-C7 not < 0)",
    "c": "deterministic H16 restores full MXFP4 to the Fprop-only level (C10 within +-2.5 % tokens)",
}
DEFAULT_LAST_K = 5  # the plan's primary metric averages the last 5 evaluations
TOKEN_BAND = 0.025  # claim (c)'s equivalence band in token overhead
CURVE_FRACTION = 0.5  # the baseline's curve is fitted over its last half of tokens


def primary_cells(study_runs, last_k: int) -> tuple[dict, tuple[int, ...], list[dict]]:
    """({(arm, "seed<k>"): primary metric}, the tokens it averages over, [excluded runs with outcome])."""
    ended, excluded = {}, []
    for run in study_runs:
        if run.status in runs.FINISHED and len(run.evals) >= last_k:
            ended[(run.rung, f"seed{run.seed}")] = run.evals
        else:
            excluded.append({"arm": run.rung, "seed": run.seed, "status": run.status})
    if not ended:
        return {}, (), excluded
    cells, tokens = stats.final_eval_losses(ended, last_k)
    return cells, tokens, excluded


def _baseline_curve(study_runs, baseline: str) -> stats.PowerLaw:
    points = [(t, loss) for r in study_runs if r.rung == baseline for _, t, loss in r.evals]
    if not points:
        raise ValueError(f"the baseline arm {baseline!r} has no evaluations: no curve to convert losses")
    last = max(t for t, _ in points)
    tail = [(t, loss) for t, loss in points if t >= CURVE_FRACTION * last]
    return stats.fit_power_law([t for t, _ in tail], [loss for _, loss in tail])


def _with_tokens(row: dict, curve, tokens) -> dict:
    return dict(row, tokens=stats.iso_loss_overhead(curve, tokens, row["estimate"], row["se"], row["df"]))


def _fit(cells: dict, arms: list[str]) -> stats.AdditiveFit:
    """The arm x seed model over the cells of `arms` only."""
    y, arm_names, blocks = stats.cells_to_table({k: v for k, v in cells.items() if k[0] in arms}, arms=arms)
    return stats.fit_additive(y, arm_names, blocks)


def _pending_cells(cells: dict, excluded: list[dict], present: list[str], seeds) -> list[str]:
    """The planned cells ("arm/seed<k>") of the arms present whose run has no final status yet."""
    ended = {(e["arm"], f"seed{e['seed']}") for e in excluded if e["status"] in runs.FINAL_STATUSES}
    settled = set(cells) | ended
    return [f"{a}/seed{k}" for a in present for k in seeds if (a, f"seed{k}") not in settled]


def analyze(study_runs, baseline: str, arms, last_k: int, seeds=()) -> dict:
    """Every number of the pre-registered analysis as JSON-ready data (see the module docstring).
    seeds: the planned blocks; a planned cell not yet ended makes the analysis interim."""
    cells, tokens, excluded = primary_cells(study_runs, last_k)
    present = [a for a in arms if any(arm == a for arm, _ in cells)]
    pending = _pending_cells(cells, excluded, present, seeds)
    family_arms = [a for a in present if a in FAMILY_ARMS or a == baseline]
    fit = _fit(cells, family_arms)
    every_fit = fit if family_arms == present else _fit(cells, present)
    curve = _baseline_curve(study_runs, baseline)
    estimable = {n: w for n, w in CONTRASTS.items() if set(w) <= set(present)}
    family = stats.contrast_family(fit, estimable) if estimable and fit.df > 0 else []
    reported = [
        stats.contrast(every_fit, w, n)
        for n, w in REPORTED.items()
        if set(w) <= set(present) and every_fit.df > 0
    ]
    versus = [
        stats.contrast(
            fit if arm in family_arms else every_fit, {arm: 1, baseline: -1}, f"{arm} - {baseline}"
        )
        for arm in present
        if arm != baseline and fit.df > 0
    ]
    derived = [
        _bonferroni(stats.contrast(fit, w, name), len(family))
        for name, w in DERIVED.items()
        if set(w) <= set(present) and fit.df > 0
    ]
    result = {
        "baseline": baseline,
        "metric": f"mean eval loss of the last {last_k} evaluations",
        "metric_tokens": list(tokens),
        "arms": list(arms),
        "arms_present": present,
        "arms_missing": [a for a in arms if a not in present],
        "cells_pending": pending,
        "interim": any(a not in present for a in arms) or bool(pending),
        "cells": {f"{a}/{b}": v for (a, b), v in sorted(cells.items())},
        "excluded": excluded,
        "pooled_sd": None if fit.sigma2 is None else math.sqrt(fit.sigma2),
        "df": fit.df,
        "family_arms": family_arms,
        "reported_model": {
            "arms": present,
            "pooled_sd": None if every_fit.sigma2 is None else math.sqrt(every_fit.sigma2),
            "df": every_fit.df,
        },
        "curve": {
            "E": curve.E,
            "A": curve.A,
            "alpha": curve.alpha,
            "df": curve.df,
            "points_from": "last half",
        },
        "versus_baseline": [_with_tokens(r, curve, tokens) for r in versus],
        "contrasts": [_with_tokens(r, curve, tokens) for r in family],
        "reported": [_with_tokens(r, curve, tokens) for r in reported],
        "derived": [_with_tokens(r, curve, tokens) for r in derived],
        "secondary": _secondary(study_runs, baseline, family_arms),
        "not_in_design": [n for n, w in CONTRASTS.items() if not set(w) <= set(arms)],
        "not_estimable": [n for n, w in CONTRASTS.items() if n not in estimable and set(w) <= set(arms)],
        "reported_not_estimable": [n for n, w in REPORTED.items() if not set(w) <= set(present)],
    }
    result["verdicts"] = claim_verdicts(result)
    return result


def _secondary(study_runs, baseline: str, family_arms: list[str]) -> dict | None:
    """The final evaluation's arm x seed analysis over the family's arms: each arm against the baseline,
    the family's contrasts and claim (a)'s sums, t intervals, no correction and no verdict; None without
    residual df."""
    cells = {
        (r.rung, f"seed{r.seed}"): r.final_eval
        for r in study_runs
        if r.status in runs.FINISHED and r.final_eval is not None and r.rung in family_arms
    }
    arms = [a for a in family_arms if any(arm == a for arm, _ in cells)]
    if baseline not in arms or len(arms) < 2:
        return None
    fit = _fit(cells, arms)
    if fit.df == 0:
        return None
    versus = [stats.contrast(fit, {a: 1, baseline: -1}, f"{a} - {baseline}") for a in arms if a != baseline]
    named = {**CONTRASTS, **DERIVED}
    family = [stats.contrast(fit, w, n) for n, w in named.items() if set(w) <= set(arms)]
    return {
        "metric": "final evaluation (the summary's final_eval_loss)",
        "cells": len(cells),
        "pooled_sd": None if fit.sigma2 is None else math.sqrt(fit.sigma2),
        "df": fit.df,
        "versus_baseline": versus,
        "contrasts": family,
    }


def _bonferroni(row: dict, family_size: int) -> dict:
    """A contrast outside the Holm family judged at Bonferroni's level over it: p_bonferroni = p * m."""
    adjusted = min(1.0, row["p"] * max(family_size, 1))
    return dict(row, p_bonferroni=adjusted, reject=adjusted <= stats.ALPHA, family_size=family_size)


def _by_name(rows: list[dict]) -> dict[str, dict]:
    return {row["name"]: row for row in rows}


def _missing(names, rows) -> list[str]:
    return [n for n in names if n not in rows]


def _pending(names, rows, not_estimable, not_in_design) -> tuple[str, str]:
    """The verdict of a claim whose contrasts are not all in the family: arms the design does not plan,
    arms not run, or (every arm run) a table without residual degrees of freedom, e.g. one trunk."""
    unplanned = [n for n in names if n in not_in_design]
    if unplanned:
        return "not in this design", "needs " + ", ".join(unplanned) + " (arms not planned)"
    unrun = [n for n in names if n in not_estimable]
    if unrun:
        return "not yet run", "needs " + ", ".join(unrun)
    return (
        "not yet estimable",
        f"{', '.join(_missing(names, rows))}: no residual df (needs a second seed or trunk)",
    )


def _verdict_a(rows: dict, derived: dict, not_estimable, not_in_design) -> tuple[str, str]:
    """Supported: C1 significantly > 0 and C1 > C2 + C3 (the ordering significant); refuted: C1 not
    significantly > 0 while C2 + C3 is; otherwise not resolved. C1 by Holm, the two sums by Bonferroni."""
    if _missing(("C1", "C2", "C3"), rows) or _missing(DERIVED, derived):
        return _pending(("C1", "C2", "C3"), rows, not_estimable, not_in_design)
    c1, ordering, front = rows["C1"], derived["C1 - C2 - C3"], derived["C2 + C3"]
    why = "; ".join(
        [f"C1 = {c1['estimate']:+.4f} nats (Holm p {c1['p_holm']:.3g})"]
        + [
            f"{r['name']} = {r['estimate']:+.4f} (Bonferroni p {r['p_bonferroni']:.3g})"
            for r in (front, ordering)
        ]
    )
    c1_large = c1["reject"] and c1["estimate"] > 0
    if c1_large and ordering["reject"] and ordering["estimate"] > 0:
        return "supported", why
    if not c1_large and front["reject"] and front["estimate"] > 0:
        return "refuted", why
    return "not resolved at this scale", why


def _verdict_b(rows: dict, not_estimable, not_in_design) -> tuple[str, str]:
    names = ("C5", "C6", "C7")
    if _missing(names, rows):
        return _pending(names, rows, not_estimable, not_in_design)
    helps = [n for n in names if rows[n]["reject"] and rows[n]["estimate"] < 0]
    why = "; ".join(f"{n} = {rows[n]['estimate']:+.4f} (Holm p {rows[n]['p_holm']:.3g})" for n in names)
    return ("refuted" if helps else "supported"), why


def _verdict_c(rows: dict, not_estimable, not_in_design) -> tuple[str, str]:
    if "C10" not in rows:
        return _pending(("C10",), rows, not_estimable, not_in_design)
    tok = rows["C10"]["tokens"]
    if tok["overhead"] is None:
        return "not resolved at this scale", tok.get("note") or "no token conversion"
    why = f"C10 = {tok['overhead']:+.2%} tokens [{tok['ci_low']:+.2%}, {tok['ci_high']:+.2%}]"
    if -TOKEN_BAND <= tok["ci_low"] and tok["ci_high"] <= TOKEN_BAND:
        return "supported", why
    if tok["ci_low"] > TOKEN_BAND:
        return "refuted", why
    return "not resolved at this scale", why


def claim_verdicts(result: dict) -> dict[str, dict]:
    """docs/study_plan.md's decision rules: {claim: {claim, verdict, why}}."""
    rows = _by_name(result["contrasts"])
    unrun, unplanned = result["not_estimable"], result["not_in_design"]
    decided = {
        "a": _verdict_a(rows, _by_name(result["derived"]), unrun, unplanned),
        "b": _verdict_b(rows, unrun, unplanned),
        "c": _verdict_c(rows, unrun, unplanned),
    }
    return {k: {"claim": CLAIMS[k], "verdict": v, "why": why} for k, (v, why) in decided.items()}


def _nats(value: float | None) -> str:
    return "- (no residual df)" if value is None else f"{value:.4f} nats"


def _row(row: dict, adjusted: str | None = None) -> str:
    """One table row; `adjusted` names the row's corrected p ("p_holm", "p_bonferroni") if it has one."""
    tok = row["tokens"]
    tokens = (
        "-"
        if tok["overhead"] is None
        else f"{tok['overhead']:+.1%} [{tok['ci_low']:+.1%}, {tok['ci_high']:+.1%}]"
    )
    cells = [
        row["name"],
        stats.weights_text(row["weights"]),
        f"{row['estimate']:+.4f} [{row['ci_low']:+.4f}, {row['ci_high']:+.4f}]",
        tokens,
        f"{row['p']:.3g}",
        *([f"{row[adjusted]:.3g}" + (" *" if row["reject"] else "")] if adjusted else []),
    ]
    return "| " + " | ".join(cells) + " |"


def to_markdown(result: dict) -> str:
    """The tables a reader wants: each arm against the baseline, the contrasts, the verdicts."""
    at = ", ".join(f"{t:,}" for t in result["metric_tokens"])
    lines = [
        f"Primary metric: {result['metric']} (tokens {at}); "
        f"paired arm x seed model over the pre-registered arms, pooled residual sd "
        f"{_nats(result['pooled_sd'])} ({result['df']} df); 95 % t intervals; token overhead through the "
        "baseline's fitted curve.",
    ]
    other = [a for a in result["reported_model"]["arms"] if a not in result["family_arms"]]
    if other:
        model = result["reported_model"]
        lines.append(
            f"Rows of {', '.join(other)} (and the literature's contrasts): the same model over every arm, "
            f"pooled residual sd {_nats(model['pooled_sd'])} ({model['df']} df)."
        )
    if result["arms_missing"]:
        lines.append(f"Interim: arms not yet run: {', '.join(result['arms_missing'])}.")
    if result["cells_pending"]:
        lines.append(
            f"Interim: planned runs not yet ended: {', '.join(result['cells_pending'])}; "
            "the verdicts below may change when they have."
        )
    head = "| {} | weights | loss difference, nats [95 %] | token overhead [95 %] | p |"
    lines += ["", head.format("arm"), "|---|---|---|---|---|"]
    lines += [_row(r) for r in result["versus_baseline"]]
    lines += ["", head.format("contrast") + " Holm p (* rejected) |", "|---|---|---|---|---|---|"]
    lines += [_row(r, "p_holm") for r in result["contrasts"]]
    if result["derived"]:
        m = result["derived"][0]["family_size"]
        title = f"Claim (a)'s sums of contrasts, outside the family, judged by Bonferroni over its {m}:"
        lines += ["", title, ""]
        lines += [head.format("sum") + " Bonferroni p (* rejected) |", "|---|---|---|---|---|---|"]
        lines += [_row(r, "p_bonferroni") for r in result["derived"]]
    if result["not_estimable"]:
        lines.append(f"\nNot estimable yet: {', '.join(result['not_estimable'])}.")
    if result["not_in_design"]:
        lines.append(f"\nNot in this design (arms not planned): {', '.join(result['not_in_design'])}.")
    lines += _secondary_markdown(result.get("secondary"))
    if result["reported"]:
        lines += ["", "The literature's recipes, outside the Holm family (no verdict):", ""]
        lines += [head.format("contrast"), "|---|---|---|---|---|"]
        lines += [_row(r) for r in result["reported"]]
    lines += ["", "| claim | verdict | numbers |", "|---|---|---|"]
    lines += [f"| ({k}) {v['claim']} | {v['verdict']} | {v['why']} |" for k, v in result["verdicts"].items()]
    return "\n".join(lines) + "\n"


def _secondary_markdown(secondary: dict | None) -> list[str]:
    if not secondary:
        return []
    lines = [
        "",
        f"Secondary metric: {secondary['metric']}, {secondary['cells']} runs; the same model, pooled "
        f"residual sd {_nats(secondary['pooled_sd'])} ({secondary['df']} df); 95 % t intervals, no "
        "correction, no verdict:",
        "",
        "| arm or contrast | weights | difference, nats [95 %] | p |",
        "|---|---|---|---|",
    ]
    for row in secondary["versus_baseline"] + secondary["contrasts"]:
        interval = f"{row['estimate']:+.4f} [{row['ci_low']:+.4f}, {row['ci_high']:+.4f}]"
        weights = stats.weights_text(row["weights"])
        lines.append(f"| {row['name']} | {weights} | {interval} | {row['p']:.3g} |")
    return lines


def forest_plot(result: dict, path: str) -> None:
    """Each arm's and contrast's token overhead with its 95 % interval (plots.plot_forest)."""
    every = result["versus_baseline"] + result["contrasts"] + result["derived"] + result["reported"]
    rows = [r for r in every if r["tokens"]["overhead"] is not None]
    plots.plot_forest([(_label(r), r["tokens"]) for r in rows], TOKEN_BAND, path)


def design_forest_plot(results: dict[str, dict], path: str) -> None:
    """The pre-registered contrasts (and full against the baseline) of several analyses side by side:
    results maps a design's name (e.g. "from scratch", "branched at 250") to its `analyze` dict."""
    names = ["full - fp8", *CONTRASTS, *DERIVED]
    labels, series = [], {design: [] for design in results}
    for name in names:
        found = {d: _find(r, name) for d, r in results.items()}
        if not any(found.values()):
            continue
        labels.append(_label(next(row for row in found.values() if row)))
        for design, row in found.items():
            series[design].append(row["tokens"] if row else None)
    plots.plot_forest_by_design(labels, series, TOKEN_BAND, path)


def _find(result: dict, name: str) -> dict | None:
    rows = result["versus_baseline"] + result["contrasts"] + result["derived"]
    return next((r for r in rows if r["name"] == name), None)


def _label(row: dict) -> str:
    if row["name"] in DERIVED:
        return f"{row['name']}: " + stats.weights_text(row["weights"])
    if row["name"] not in {**CONTRASTS, **REPORTED} or " " in row["name"]:
        return row["name"]
    return f"{row['name']}: " + " - ".join(
        a for a, _ in sorted(row["weights"].items(), key=lambda kv: -kv[1])
    )
