"""The pipeline's claims layer: the pre-registered analysis of docs/study_plan.md. The primary metric per
arm and seed, the paired arm x seed model, the contrasts with Holm's correction, each arm's iso-loss
token overhead, and a verdict per claim. The contrasts and hypotheses are the plan file's [claims] table
(`Hypotheses`); the verdict rules are the code below. Pure functions over analysis.StudyRun lists (run
directories are read elsewhere; the report layer writes and plots the results).

Invariants:
- the primary metric is the mean eval loss of the last `last_k` periodic evaluations, at the same tokens for
  every run (stats.final_eval_losses raises otherwise); only runs that ended (not unfinished, not failed,
  not diverged) enter the table, and the others are listed with their outcome;
- a block is a seed: every arm with seed k shares its initialisation and data order;
- the Holm family is the pre-registered family (C1-C7, C10) as far as the runs present make it
  estimable, fitted on the pre-registered arms alone (the plan's family_arms: the ladder's ten), so that
  arms added later change neither its pooled variance nor its degrees of freedom; the literature's
  contrasts (C8, C9 and their companions) are reported outside it, with no verdict, from a second fit
  over every arm
  present (its own pooled sd and df, `reported_model`); while some arms are missing the analysis is
  marked interim and every verdict that needs a missing arm says so; so is it while a planned cell (an
  arm present, a planned seed) has not ended, since its verdicts then rest on fewer blocks than planned
  (a diverged or failed run is an outcome, listed under excluded, not pending);
- claim (a)'s rule reads two sums of the family's contrasts (the plan's derived: C2 + C3 and
  C1 - C2 - C3); each is one contrast of the same fit, outside the family, judged by Bonferroni over
  the family's size;
- a contrast whose arms the design does not plan (not in `arms`, e.g. a confirmation at another scale
  with fewer arms) is outside that design's family, listed under `not_in_design`, never "not yet run";
- the secondary metric (study_plan.md) is each ended run's final evaluation (the summary's `final_eval`:
  every validation sequence); the same model over the same arms gives its differences and contrasts
  with t intervals, reported beside the primary ones with no verdict and no token conversion (the
  baseline's curve is fitted to the periodic evaluations, another set of sequences);
- token overheads come from the baseline's fitted curve L(T) = E + A T^-alpha over the second half of its
  runs' tokens (stats.iso_loss_overhead); for a branch design (trunk_tokens given) every row also has its
  overhead per branch token (stats.per_branch_token), the unit claim (c)'s band and (b)'s margin apply in;
- every row has, beside the pooled model's numbers, the paired t numbers ("paired": the contrast's value
  per block over the blocks where all its arms ended; Holm over the family's contrasts with 2 or more
  blocks, Bonferroni over that size for claim (a)'s sums; None with fewer than 2 blocks) and
  "model_dependent": whether the two models decide differently (None without paired numbers);
- the verdicts follow docs/study_plan.md's amendment of 2026-12-05 ("verdicts restated on direct tests"),
  each reached under both models and "model-dependent" where they differ; the pre-registered rules'
  verdicts stay beside them ("preregistered", superseded).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from fp4jax.study import runs, stats

__all__ = [
    "CURVE_FRACTION",
    "DEFAULT_LAST_K",
    "Hypotheses",
    "analyze",
    "band_tokens",
    "claim_verdicts",
    "primary_cells",
    "share_text",
    "to_markdown",
]

DEFAULT_LAST_K = 5  # the plan's primary metric averages the last 5 evaluations (a gate may say otherwise)
CURVE_FRACTION = 0.5  # the baseline's curve is fitted over its last half of tokens
TABLE_KEYS = {
    "family_arms", "stabilisers", "margin", "token_band", "contrasts", "reported", "derived", "share",
    "hypotheses",
}  # fmt: skip
OPTIONAL_KEYS = {"recovery"}  # H16's recovery (amendment "the scale and batch trend"): reported, no verdict


@dataclasses.dataclass(frozen=True)
class Hypotheses:
    """The claims a study tests, as its plan file's [claims] table states them (docs/study_plan.md).

    contrasts: the pre-registered Holm family {name: {arm: weight}}; reported: contrasts reported outside
    it with no verdict; derived: claim (a)'s sums of contrasts (Bonferroni over the family's size);
    family_arms: the arms the family's model is fitted on; claims: {claim: its text}; share: claim (a)'s
    ratio (numerator and denominator weights), the value it must exceed (share_above) and the 8B study's
    (share_at_8b); recovery: H16's share of full's cost recovered, (full - full_h16) / (full - fp8), as
    numerator and denominator weights, and the 8B study's value (recovery_at_8b), or None; stabilisers:
    claim (b)'s contrasts; margin: (b)'s non-inferiority margin in tokens; token_band: claim (c)'s
    equivalence band in tokens. The verdict rules (code below) name the contrasts C1, C2, C3, C10 and
    the sum "C1 - C2 - C3"."""

    contrasts: dict[str, dict[str, float]]
    reported: dict[str, dict[str, float]]
    derived: dict[str, dict[str, float]]
    family_arms: tuple[str, ...]
    claims: dict[str, str]
    share: tuple[dict[str, float], dict[str, float]]
    share_above: float
    share_at_8b: float
    recovery: tuple[dict[str, float], dict[str, float]] | None
    recovery_at_8b: float | None
    stabilisers: tuple[str, ...]
    margin: float
    token_band: float

    @classmethod
    def from_plan(cls, plan) -> Hypotheses:
        """The plan's claims (plan.Plan.claims: its [claims] table or claims_from's), checked."""
        table = plan.claims
        if table is None:
            raise ValueError(f"plan {plan.path} has no [claims] table (or claims_from): no claims to test")
        if not TABLE_KEYS <= set(table) <= TABLE_KEYS | OPTIONAL_KEYS:
            raise ValueError(
                f"plan {plan.path}: [claims] needs {sorted(TABLE_KEYS)} (optional: {sorted(OPTIONAL_KEYS)}), "
                f"not {sorted(table)}"
            )
        recovery = table.get("recovery")
        if recovery is not None and set(recovery) != {"numerator", "denominator", "at_8b"}:
            raise ValueError(f"plan {plan.path}: [claims.recovery] is numerator, denominator, at_8b")
        share = table["share"]
        if set(share) != {"numerator", "denominator", "above", "at_8b"}:
            raise ValueError(f"plan {plan.path}: [claims.share] is numerator, denominator, above, at_8b")
        if set(table["hypotheses"]) != {"a", "b", "c"} or set(table["stabilisers"]) - set(table["contrasts"]):
            raise ValueError(
                f"plan {plan.path}: [claims] states hypotheses a, b, c; stabilisers are contrasts"
            )
        return cls(
            contrasts=_weights(table["contrasts"]),
            reported=_weights(table["reported"]),
            derived=_weights(table["derived"]),
            family_arms=tuple(table["family_arms"]),
            claims=dict(table["hypotheses"]),
            share=(dict(share["numerator"]), dict(share["denominator"])),
            share_above=float(share["above"]),
            share_at_8b=float(share["at_8b"]),
            recovery=None
            if recovery is None
            else (dict(recovery["numerator"]), dict(recovery["denominator"])),  # fmt: skip
            recovery_at_8b=None if recovery is None else float(recovery["at_8b"]),
            stabilisers=tuple(table["stabilisers"]),
            margin=float(table["margin"]),
            token_band=float(table["token_band"]),
        )


def _ratio_weights(table: dict | None) -> tuple[dict[str, float], dict[str, float]] | None:
    return None if table is None else (dict(table["numerator"]), dict(table["denominator"]))


def _weights(table: dict) -> dict[str, dict[str, float]]:
    """{name: {arm: weight}} as the file lists them (integers stay integers: weights_text prints them)."""
    return {name: dict(weights) for name, weights in table.items()}


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
    cells, tokens = stats.primary_metrics(ended, last_k)
    return cells, tokens, excluded


def _baseline_curve(study_runs, baseline: str) -> stats.PowerLaw:
    points = [(t, loss) for r in study_runs if r.rung == baseline for _, t, loss in r.evals]
    if not points:
        raise ValueError(f"the baseline arm {baseline!r} has no evaluations: no curve to convert losses")
    last = max(t for t, _ in points)
    tail = [(t, loss) for t, loss in points if t >= CURVE_FRACTION * last]
    return stats.fit_power_law([t for t, _ in tail], [loss for _, loss in tail])


def _fit(cells: dict, arms: list[str]) -> stats.AdditiveFit:
    """The arm x seed model over the cells of `arms` only."""
    y, arm_names, blocks = stats.cells_to_table({k: v for k, v in cells.items() if k[0] in arms}, arms=arms)
    return stats.fit_additive(y, arm_names, blocks)


def _pending_cells(cells: dict, excluded: list[dict], present: list[str], seeds) -> list[str]:
    """The planned cells ("arm/seed<k>") of the arms present whose run has no final status yet."""
    ended = {(e["arm"], f"seed{e['seed']}") for e in excluded if e["status"] in runs.FINAL_STATUSES}
    settled = set(cells) | ended
    return [f"{a}/seed{k}" for a in present for k in seeds if (a, f"seed{k}") not in settled]


def analyze(
    study_runs, baseline: str, arms, last_k: int, h: Hypotheses, seeds=(), trunk_tokens: int | None = None
) -> dict:
    """Every number of the pre-registered analysis as JSON-ready data (see the module docstring).
    seeds: the planned blocks; a planned cell not yet ended makes the analysis interim. trunk_tokens: for
    a branch design, the trunk's tokens at the branch point (overheads per branch token beside the
    whole-run ones); None from scratch."""
    cells, tokens, excluded = primary_cells(study_runs, last_k)
    present = [a for a in arms if any(arm == a for arm, _ in cells)]
    pending = _pending_cells(cells, excluded, present, seeds)
    family_arms = [a for a in present if a in h.family_arms or a == baseline]
    fit = _fit(cells, family_arms)
    every_fit = fit if family_arms == present else _fit(cells, present)
    table = stats.cells_to_table({k: v for k, v in cells.items() if k[0] in present}, arms=present)
    curve = _baseline_curve(study_runs, baseline)
    estimable = {n: w for n, w in h.contrasts.items() if set(w) <= set(present)}
    family = stats.contrast_family(fit, estimable) if estimable and fit.df > 0 else []
    reported = [
        stats.contrast(every_fit, w, n)
        for n, w in h.reported.items()
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
        for name, w in h.derived.items()
        if set(w) <= set(present) and fit.df > 0
    ]
    family, derived = _paired_family(family, derived, table)
    versus, reported = ([_with_paired(r, table) for r in rows] for rows in (versus, reported))
    finish = _finisher(curve, tokens, trunk_tokens)
    result = {
        "baseline": baseline,
        "metric": f"mean eval loss of the last {last_k} evaluations",
        "metric_tokens": list(tokens),
        "trunk_tokens": trunk_tokens,
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
        "versus_baseline": [finish(r) for r in versus],
        "contrasts": [finish(r) for r in family],
        "reported": [finish(r) for r in reported],
        "derived": [finish(r) for r in derived],
        "wgrad_share": _wgrad_share(fit, table, h),
        "h16_recovery": _h16_recovery(fit, table, h),
        "secondary": _secondary(study_runs, baseline, family_arms, h),
        "not_in_design": [n for n, w in h.contrasts.items() if not set(w) <= set(arms)],
        "not_estimable": [n for n, w in h.contrasts.items() if n not in estimable and set(w) <= set(arms)],
        "reported_not_estimable": [n for n, w in h.reported.items() if not set(w) <= set(present)],
    }
    result["verdicts"] = claim_verdicts(result, h)
    return result


def _paired(table, weights, name: str) -> dict | None:
    """The paired t row of a contrast (stats.paired_t over the blocks where all its arms ended, named as
    the pooled row); None with fewer than 2 such blocks."""
    y, arms, blocks = table
    if not set(weights) <= set(arms):
        return None
    values, used = stats.block_values(y, arms, blocks, weights)
    if values.size < 2:
        return None
    return {"name": name, "weights": dict(weights), **stats.paired_t(values), "blocks": list(used)}


def _with_paired(row: dict, table) -> dict:
    return dict(row, paired=_paired(table, row["weights"], row["name"]))


def _paired_family(family: list[dict], derived: list[dict], table) -> tuple[list[dict], list[dict]]:
    """The family's rows and claim (a)'s sums with their paired rows: Holm over the family's contrasts that
    have one, Bonferroni over that number for the sums (as the pooled model's)."""
    family = [_with_paired(r, table) for r in family]
    paired = [r["paired"] for r in family if r["paired"]]
    for row, adjusted in zip(paired, stats.holm([r["p"] for r in paired]), strict=True):
        row.update(p_holm=float(adjusted), reject=bool(adjusted <= stats.ALPHA), alpha=stats.ALPHA)
    derived = [_with_paired(r, table) for r in derived]
    for row in derived:
        if row["paired"]:
            row["paired"] = _bonferroni(row["paired"], len(paired))
    return family, derived


def _finisher(curve, tokens, trunk_tokens):
    """A row -> the row with its token overheads (whole-run; per branch token when trunk_tokens is set),
    its paired row's likewise, and whether the two models decide it differently."""

    def finish(row: dict) -> dict:
        out = dict(row, tokens=stats.iso_loss_overhead(curve, tokens, row["estimate"], row["se"], row["df"]))
        if trunk_tokens is not None:
            out["per_branch_token"] = stats.per_branch_token(curve, tokens, trunk_tokens, out["tokens"])
        if "paired" in row:
            out["paired"] = row["paired"] and finish(row["paired"])
            out["model_dependent"] = row["paired"] and _decision(row) != _decision(row["paired"])
        return out

    return finish


def _decision(row: dict) -> tuple[bool, bool]:
    """(rejected, positive): rejected at the row's corrected level ("reject"), else at p <= 0.05."""
    reject = row.get("reject", row["p"] <= stats.ALPHA)
    return bool(reject), bool(reject and row["estimate"] > 0)


def _ratio(fit: stats.AdditiveFit, table, num: dict, den: dict) -> dict | None:
    """num / den of two contrasts with Fieller's interval from the pooled fit and, under "paired", from the
    blocks where every arm of either ended (None with fewer than 2), and the arms it reads under "arms";
    None when an arm is missing or the fit has no residual df."""
    y, arms, blocks = table
    needed = sorted(set(num) | set(den))
    if not set(needed) <= set(fit.arms) or fit.df == 0:
        return None
    ratio = stats.fit_ratio(fit, num, den)
    rows = [arms.index(a) for a in needed]
    complete = ~np.isnan(y[rows]).any(axis=0)
    sub = (y[:, complete], arms, [b for b, keep in zip(blocks, complete, strict=True) if keep])
    paired = None
    if complete.sum() >= 2:
        paired = stats.paired_ratio(stats.block_values(*sub, num)[0], stats.block_values(*sub, den)[0])
    return {**ratio, "paired": paired, "arms": needed}


def _wgrad_share(fit: stats.AdditiveFit, table, h: Hypotheses) -> dict | None:
    """Wgrad's share of full's cost, C1 / (full - fp8) (claim (a)'s primary test), as `_ratio`."""
    share = _ratio(fit, table, *h.share)
    return None if share is None else {**share, "claimed_above": h.share_above, "at_8b": h.share_at_8b}


def _h16_recovery(fit: stats.AdditiveFit, table, h: Hypotheses) -> dict | None:
    """The share of full's cost that H16 recovers, (full - full_h16) / (full - fp8), as `_ratio` (no
    verdict: the scale trend's second measure); None where the plan names no recovery."""
    if h.recovery is None:
        return None
    recovery = _ratio(fit, table, *h.recovery)
    return None if recovery is None else {**recovery, "at_8b": h.recovery_at_8b}


def _secondary(study_runs, baseline: str, family_arms: list[str], h: Hypotheses) -> dict | None:
    """The final evaluation's arm x seed analysis over the family's arms: each arm against the baseline,
    the family's contrasts and claim (a)'s sums, t intervals (pooled, and paired beside them), no
    correction and no verdict; None without residual df."""
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
    table = stats.cells_to_table(cells, arms=arms)
    versus = [stats.contrast(fit, {a: 1, baseline: -1}, f"{a} - {baseline}") for a in arms if a != baseline]
    named = {**h.contrasts, **h.derived}
    family = [stats.contrast(fit, w, n) for n, w in named.items() if set(w) <= set(arms)]
    versus, family = ([_paired_beside(r, table) for r in rows] for rows in (versus, family))
    return {
        "metric": "final evaluation (the summary's final_eval_loss)",
        "cells": len(cells),
        "pooled_sd": None if fit.sigma2 is None else math.sqrt(fit.sigma2),
        "df": fit.df,
        "versus_baseline": versus,
        "contrasts": family,
    }


def _paired_beside(row: dict, table) -> dict:
    """A row with no correction and its paired row, model-dependent where one has p <= 0.05 and the
    other not."""
    out = _with_paired(row, table)
    out["model_dependent"] = out["paired"] and _decision(row) != _decision(out["paired"])
    return out


def _bonferroni(row: dict, family_size: int) -> dict:
    """A contrast outside the Holm family judged at Bonferroni's level over it: p_bonferroni = p * m."""
    adjusted = min(1.0, row["p"] * max(family_size, 1))
    return dict(row, p_bonferroni=adjusted, reject=adjusted <= stats.ALPHA, family_size=family_size)


def _by_name(rows: list[dict]) -> dict[str, dict]:
    return {row["name"]: row for row in rows}


def _missing(names, rows) -> list[str]:
    return [n for n in names if n not in rows]


def _pending(names, rows, not_estimable, not_in_design, model="pooled") -> tuple[str, str]:
    """The verdict of a claim whose contrasts are not all in the family: arms the design does not plan,
    arms not run, or (every arm run) too few blocks: no residual df (pooled) or fewer than 2 blocks with
    every arm of the contrast ended (paired)."""
    unplanned = [n for n in names if n in not_in_design]
    if unplanned:
        return "not in this design", "needs " + ", ".join(unplanned) + " (arms not planned)"
    unrun = [n for n in names if n in not_estimable]
    if unrun:
        return "not yet run", "needs " + ", ".join(unrun)
    short = "no residual df" if model == "pooled" else "fewer than 2 blocks with all its arms"
    return "not yet estimable", f"{', '.join(_missing(names, rows))}: {short} (needs another seed or trunk)"


# --------------------------------------------------------- the rules of the amendment of 2026-12-05


def band_tokens(row: dict) -> dict:
    """The overhead the bands and margins apply to: per branch token in a branch design, else whole-run."""
    return row.get("per_branch_token") or row["tokens"]


def _unit(row: dict) -> str:
    return "per branch token" if "per_branch_token" in row else "tokens"


def _pct_interval(tok: dict) -> str:
    ends = ("-" if v is None else f"{v:+.1%}" for v in (tok["ci_low"], tok["ci_high"]))
    return "-" if tok["overhead"] is None else f"{tok['overhead']:+.1%} [{', '.join(ends)}]"


def share_text(share: dict) -> str:
    """Wgrad's share with its Fieller set, e.g. "0.16 [-0.35, 0.52]" or "0.16, unbounded (all but ...)"."""
    if share["bounded"]:
        return f"{share['estimate']:.2f} [{share['lo']:.2f}, {share['hi']:.2f}]"
    if share["kind"] == "two half-lines":
        low, high = share["excluded"]
        return f"{share['estimate']:.2f}, unbounded (all but ({low:.2f}, {high:.2f}))"
    estimate = "-" if share["estimate"] is None else f"{share['estimate']:.2f}"
    return f"{estimate}, unbounded (every value)"


def _verdict_a(rows: dict, derived: dict, share, unrun, unplanned, model, h: Hypotheses) -> tuple[str, str]:
    """Supported when Wgrad's share's Fieller interval is bounded and above 1/2, refuted when bounded and
    below it; otherwise (an unbounded set: full - fp8 not significantly non-zero) not resolved."""
    if share is None:
        return _pending(("C1", "C2", "C3"), rows, unrun, unplanned, model)
    why = f"Wgrad's share C1 / (full - fp8) = {share_text(share)}"
    ordering = derived.get("C1 - C2 - C3")
    if ordering:
        why += f"; C1 - C2 - C3 = {ordering['estimate']:+.4f} [{ordering['ci_low']:+.4f}, "
        why += f"{ordering['ci_high']:+.4f}] nats"
    if share["bounded"] and share["lo"] > h.share_above:
        return "supported", why
    if share["bounded"] and share["hi"] < h.share_above:
        return "refuted", why
    return "not resolved at this scale", why


def _loss_reading_b(rows: dict, unrun, unplanned, model, h: Hypotheses) -> tuple[str, str]:
    """(b)'s loss reading: "better than full" when one of C5-C7 is significantly < 0 after Holm; "not
    better than full" when every one's lower token bound lies above -h.margin (each improvement's upper bound
    below the margin: an intersection-union test); otherwise not resolved."""
    if _missing(h.stabilisers, rows):
        return _pending(h.stabilisers, rows, unrun, unplanned, model)
    tokens = {n: band_tokens(rows[n]) for n in h.stabilisers}
    why = "; ".join(
        f"{n} = {_pct_interval(tokens[n])} {_unit(rows[n])} (Holm p {rows[n]['p_holm']:.3g})"
        for n in h.stabilisers
    )
    if any(rows[n]["reject"] and rows[n]["estimate"] < 0 for n in h.stabilisers):
        return "better than full", why
    if all(tokens[n]["ci_low"] is not None and tokens[n]["ci_low"] > -h.margin for n in h.stabilisers):
        return "not better than full", why
    return "not resolved at this scale", why


def _verdict_c(rows: dict, unrun, unplanned, model, h: Hypotheses) -> tuple[str, str]:
    """C10's token interval (per branch token in a branch design) within +-token_band: supported; wholly
    above +token_band: refuted; otherwise not resolved."""
    if "C10" not in rows:
        return _pending(("C10",), rows, unrun, unplanned, model)
    tok = band_tokens(rows["C10"])
    if tok["overhead"] is None or tok["ci_low"] is None or tok["ci_high"] is None:
        return "not resolved at this scale", tok.get("note") or "no token conversion"
    why = f"C10 = {tok['overhead']:+.2%} {_unit(rows['C10'])} [{tok['ci_low']:+.2%}, {tok['ci_high']:+.2%}]"
    if -h.token_band <= tok["ci_low"] and tok["ci_high"] <= h.token_band:
        return "supported", why
    if tok["ci_low"] > h.token_band:
        return "refuted", why
    return "not resolved at this scale", why


def _divergence_b(result: dict, h: Hypotheses) -> tuple[str, str]:
    """(b) as the study states it: not testable where no run of full diverged; else refuted when a
    stabiliser ended in every block where full diverged, supported when each diverged in every such
    block, otherwise not resolved."""
    diverged = {(e["arm"], f"seed{e['seed']}") for e in result["excluded"] if e["status"] == "diverged"}
    blocks = sorted(b for a, b in diverged if a == "full")
    if not blocks:
        return "not testable as stated", "no run of full diverged"
    ended = {tuple(key.split("/")) for key in result["cells"]}
    arms = [next(a for a in h.contrasts[n] if a != "full") for n in h.stabilisers]
    outcome = {a: [_outcome((a, b), ended, diverged) for b in blocks] for a in arms}
    why = f"full diverged in {', '.join(blocks)}; there " + "; ".join(
        f"{a}: {', '.join(o)}" for a, o in outcome.items()
    )
    if any(all(o == "ended" for o in outs) for outs in outcome.values()):
        return "refuted", why
    if all(all(o == "diverged" for o in outs) for outs in outcome.values()):
        return "supported", why
    return "not resolved at this scale", why


def _outcome(cell: tuple[str, str], ended: set, diverged: set) -> str:
    return "ended" if cell in ended else "diverged" if cell in diverged else "-"


def _model_rows(result: dict, model: str) -> tuple[dict, dict, dict | None]:
    """(family rows, claim (a)'s sums, Wgrad's share) by name under one model: "pooled" or "paired"."""
    share = result.get("wgrad_share")
    if model == "pooled":
        return _by_name(result["contrasts"]), _by_name(result["derived"]), share
    pick = [r["paired"] for r in result["contrasts"] if r.get("paired")]
    sums = [r["paired"] for r in result["derived"] if r.get("paired")]
    return _by_name(pick), _by_name(sums), share and share.get("paired")


def _both(pooled: tuple[str, str], paired: tuple[str, str]) -> dict:
    """A verdict reached under both models: stated where they agree, "model-dependent" where not."""
    agree = pooled[0] == paired[0]
    return {
        "verdict": pooled[0] if agree else "model-dependent",
        "why": pooled[1],
        "model_dependent": not agree,
        "pooled": {"verdict": pooled[0], "why": pooled[1]},
        "paired": {"verdict": paired[0], "why": paired[1]},
    }


def claim_verdicts(result: dict, h: Hypotheses) -> dict[str, dict]:
    """docs/study_plan.md's decision rules as amended on 2026-12-05, under both models, with the
    pre-registered rules' verdicts beside them: {claim: {claim, verdict, why, model_dependent, pooled,
    paired, preregistered}}; (b)'s verdict is the divergence test, its loss reading under "loss_reading"."""
    unrun, unplanned = result["not_estimable"], result["not_in_design"]
    judged = {}
    for model in ("pooled", "paired"):
        rows, sums, share = _model_rows(result, model)
        judged[model] = {
            "a": _verdict_a(rows, sums, share, unrun, unplanned, model, h),
            "b": _loss_reading_b(rows, unrun, unplanned, model, h),
            "c": _verdict_c(rows, unrun, unplanned, model, h),
        }
    out = {k: {"claim": h.claims[k], **_both(judged["pooled"][k], judged["paired"][k])} for k in h.claims}
    stated, why = _divergence_b(result, h)
    loss = {**out["b"], "margin": h.margin}
    del loss["claim"]
    out["b"] = {"claim": h.claims["b"], "verdict": stated, "why": why, "model_dependent": False}
    out["b"]["loss_reading"] = loss
    for k, verdict in _preregistered(result, h).items():
        out[k]["preregistered"] = {"verdict": verdict[0], "why": verdict[1]}
    return out


# ------------------------------------------------- the pre-registered rules (superseded, reported beside)


def _preregistered(result: dict, h: Hypotheses) -> dict[str, tuple[str, str]]:
    """study_plan.md's decision rules as pre-registered, on the pooled model and whole-run tokens."""
    rows, sums = _by_name(result["contrasts"]), _by_name(result["derived"])
    unrun, unplanned = result["not_estimable"], result["not_in_design"]
    return {
        "a": _preregistered_a(rows, sums, unrun, unplanned, h),
        "b": _preregistered_b(rows, unrun, unplanned, h),
        "c": _preregistered_c(rows, unrun, unplanned, h),
    }


def _preregistered_a(
    rows: dict, derived: dict, not_estimable, not_in_design, h: Hypotheses
) -> tuple[str, str]:
    """Supported: C1 significantly > 0 and C1 > C2 + C3 (the ordering significant); refuted: C1 not
    significantly > 0 while C2 + C3 is; otherwise not resolved. C1 by Holm, the two sums by Bonferroni."""
    if _missing(("C1", "C2", "C3"), rows) or _missing(h.derived, derived):
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


def _preregistered_b(rows: dict, not_estimable, not_in_design, h: Hypotheses) -> tuple[str, str]:
    if _missing(h.stabilisers, rows):
        return _pending(h.stabilisers, rows, not_estimable, not_in_design)
    helps = [n for n in h.stabilisers if rows[n]["reject"] and rows[n]["estimate"] < 0]
    why = "; ".join(
        f"{n} = {rows[n]['estimate']:+.4f} (Holm p {rows[n]['p_holm']:.3g})" for n in h.stabilisers
    )
    return ("refuted" if helps else "supported"), why


def _preregistered_c(rows: dict, not_estimable, not_in_design, h: Hypotheses) -> tuple[str, str]:
    """C10's whole-run token interval against the +-2.5 % band."""
    if "C10" not in rows:
        return _pending(("C10",), rows, not_estimable, not_in_design)
    whole = {k: v for k, v in rows["C10"].items() if k != "per_branch_token"}
    return _verdict_c({"C10": whole}, not_estimable, not_in_design, "pooled", h)


def _nats(value: float | None) -> str:
    return "- (no residual df)" if value is None else f"{value:.4f} nats"


def _interval(row: dict) -> str:
    return f"{row['estimate']:+.4f} [{row['ci_low']:+.4f}, {row['ci_high']:+.4f}]"


def _corrected(row: dict, adjusted: str | None) -> str:
    """A row's p, and its corrected p (with * where rejected) if it has one."""
    if not adjusted or adjusted not in row:
        return f"{row['p']:.3g}"
    label = {"p_holm": "Holm", "p_bonferroni": "Bonferroni"}[adjusted]
    return f"{row['p']:.3g} ({label} {row[adjusted]:.3g}{' *' if row['reject'] else ''})"


def _models(row: dict) -> str:
    if row.get("paired") is None:
        return "-"
    return "model-dependent" if row["model_dependent"] else "agree"


def _head(first: str, branch: bool) -> list[str]:
    cells = [first, "weights", "loss difference, nats [95 %]", "token overhead [95 %]"]
    cells += ["per branch token [95 %]"] if branch else []
    cells += ["p (corrected, * rejected)", "paired t, nats [95 %]", "paired p (corrected)", "models"]
    return ["| " + " | ".join(cells) + " |", "|" + "---|" * len(cells)]


def _row(row: dict, adjusted: str | None = None) -> str:
    """One table row: the pooled model's numbers, per branch token where the row has them, then the paired
    t numbers and whether the two models decide alike. `adjusted` names the corrected p, if any."""
    paired = row.get("paired")
    cells = [
        row["name"],
        stats.weights_text(row["weights"]),
        _interval(row),
        _pct_interval(row["tokens"]),
        *([_pct_interval(row["per_branch_token"])] if "per_branch_token" in row else []),
        _corrected(row, adjusted),
        "-" if paired is None else _interval(paired),
        "-" if paired is None else _corrected(paired, adjusted),
        _models(row),
    ]
    return "| " + " | ".join(cells) + " |"


def _intro(result: dict) -> list[str]:
    at = ", ".join(f"{t:,}" for t in result["metric_tokens"])
    units = "token overhead through the baseline's fitted curve"
    if result.get("trunk_tokens") is not None:
        units += (
            f", in whole-run tokens and per branch token (the trunk's {result['trunk_tokens']:,} tokens "
            "taken out of both counts; the bands apply per branch token)"
        )
    return [
        f"Primary metric: {result['metric']} (tokens {at}); "
        f"paired arm x seed model over the pre-registered arms, pooled residual sd "
        f"{_nats(result['pooled_sd'])} ({result['df']} df); 95 % t intervals; {units}. Beside it, the "
        "paired t interval of each contrast over the blocks where all its arms ended (df = blocks - 1); "
        '"model-dependent": the two models decide differently.',
    ]


def _share_lines(share: dict | None) -> list[str]:
    if share is None:
        return []
    paired = "-" if share["paired"] is None else share_text(share["paired"])
    return [
        "",
        f"Claim (a)'s primary test, Wgrad's share of full's cost C1 / (full - fp8) with Fieller's 95 % "
        f"interval: pooled {share_text(share)}; paired t {paired}. The claim needs it above "
        f"{share['claimed_above']:g}; the study's 8B figures give about {share['at_8b']:.2f}.",
    ]


def _recovery_lines(recovery: dict | None) -> list[str]:
    if recovery is None:
        return []
    paired = "-" if recovery["paired"] is None else share_text(recovery["paired"])
    return [
        "",
        "H16's recovery, (full - full_h16) / (full - fp8) with Fieller's 95 % interval (no verdict; the "
        f"scale trend's measure): pooled {share_text(recovery)}; paired t {paired}. The study's 8B figures "
        f"give about {recovery['at_8b']:.2f}.",
    ]


def _verdict_cell(verdict: dict) -> str:
    return f"{verdict['verdict']}: {verdict['why']}"


def _verdict_lines(verdicts: dict) -> list[str]:
    lines = [
        "",
        "| claim | verdict | pooled model | paired t | pre-registered rule (superseded) |",
        "|---|---|---|---|---|",
    ]
    for k, v in verdicts.items():
        judged = v.get("loss_reading", v)
        prefix = f"loss reading, margin {judged['margin']:.1%}: " if "loss_reading" in v else ""
        verdict = f"**{v['verdict']}**" + (f": {v['why']}" if "loss_reading" in v else "")
        cells = [f"({k}) {v['claim']}", verdict]
        cells += [prefix + _verdict_cell(judged[m]) for m in ("pooled", "paired")]
        cells.append(_verdict_cell(v["preregistered"]))
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def to_markdown(result: dict) -> str:
    """The tables a reader wants: each arm against the baseline, the contrasts, the verdicts."""
    lines = _intro(result)
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
    branch = result.get("trunk_tokens") is not None
    lines += ["", *_head("arm", branch), *(_row(r) for r in result["versus_baseline"])]
    lines += ["", "The pre-registered family, Holm's correction in each model:", ""]
    lines += [*_head("contrast", branch), *(_row(r, "p_holm") for r in result["contrasts"])]
    if result["derived"]:
        m = result["derived"][0]["family_size"]
        title = f"Claim (a)'s sums of contrasts, outside the family, judged by Bonferroni over its {m}:"
        lines += ["", title, "", *_head("sum", branch), *(_row(r, "p_bonferroni") for r in result["derived"])]
    lines += _share_lines(result.get("wgrad_share"))
    lines += _recovery_lines(result.get("h16_recovery"))
    if result["not_estimable"]:
        lines.append(f"\nNot estimable yet: {', '.join(result['not_estimable'])}.")
    if result["not_in_design"]:
        lines.append(f"\nNot in this design (arms not planned): {', '.join(result['not_in_design'])}.")
    lines += _secondary_markdown(result.get("secondary"))
    if result["reported"]:
        lines += ["", "The literature's recipes, outside the Holm family (no verdict):", ""]
        lines += [*_head("contrast", branch), *(_row(r) for r in result["reported"])]
    lines += _verdict_lines(result["verdicts"])
    return "\n".join(lines) + "\n"


def _secondary_markdown(secondary: dict | None) -> list[str]:
    if not secondary:
        return []
    lines = [
        "",
        f"Secondary metric: {secondary['metric']}, {secondary['cells']} runs; the same model, pooled "
        f"residual sd {_nats(secondary['pooled_sd'])} ({secondary['df']} df); 95 % t intervals, paired t "
        "beside them, no correction, no verdict:",
        "",
        "| arm or contrast | weights | difference, nats [95 %] | p | paired t, nats [95 %] | paired p "
        "| models |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in secondary["versus_baseline"] + secondary["contrasts"]:
        paired = row.get("paired")
        cells = [row["name"], stats.weights_text(row["weights"]), _interval(row), f"{row['p']:.3g}"]
        cells += ["-", "-"] if paired is None else [_interval(paired), f"{paired['p']:.3g}"]
        lines.append("| " + " | ".join([*cells, _models(row)]) + " |")
    return lines
