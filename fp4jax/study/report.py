"""The pipeline's report layer: the one writer of every report file (BASE.md, BASE.json and the figures
beside them) and `report_plan`, the report of a whole plan from whatever runs exist.

`report_plan` writes, into OUT: per stage its design's report (the design's `report`: a from-scratch
stage's <stage>.md/.json/.png and <stage>_gate.json, a branch stage's differences and its claims per
branch point); lr_stress_<reference>.md/.json/.png per LR series; claims.md/.json/.png, the claims over
the pooled from-scratch stages (`pooled_scratch_runs`); claims_by_design.png when more than one design
has claims; progress.md/.json. Every file is written by `write`, and the text is printed as written.
"""

from __future__ import annotations

import os

from fp4jax import report_files
from fp4jax.study import analysis, claims, lr_stress, plots
from fp4jax.study.plan import Plan, stage_root
from fp4jax.study.progress import progress, progress_markdown

__all__ = ["emit_print", "pooled_scratch_runs", "report_plan", "write", "write_claims", "write_progress"]


def emit_print(line: str) -> None:
    print(line, flush=True)


def write(base: str | None, text: str, data: dict, draw=None, emit=emit_print) -> list[str]:
    """Prints `text`; with a `base`, writes BASE.md (the text), BASE.json (the data: compact, sorted keys)
    and the figures `draw(base)` writes (it returns their paths), the directory made first. Returns the
    paths written."""
    emit(text.rstrip("\n"))
    if base is None:
        return []
    os.makedirs(os.path.dirname(base) or ".", exist_ok=True)
    with open(base + ".md", "w", encoding="utf-8") as f:
        f.write(text)
    report_files.write_json(data, base + ".json")
    paths = [base + ".md", base + ".json", *(draw(base) if draw else [])]
    emit(f"wrote {', '.join(paths)}")
    return paths


def write_json(path: str, data: dict, emit=emit_print) -> None:
    """A bare JSON file (compact, sorted keys), e.g. a stage's gate."""
    report_files.write_json(data, path)
    emit(f"wrote {path}")


def _base(out: str | None, name: str) -> str | None:
    return None if out is None else os.path.join(out, name)


def report_plan(plan: Plan, root: str, out: str | None, target: str = "config", emit=emit_print) -> None:
    """Every report of the plan from the runs under `root` (module docstring), into `out` (None: printed
    only)."""
    by_design = {}  # "branched at N" -> the claims' analysis of that branch point
    for stage in plan.stages:
        if not os.path.isdir(stage_root(root, stage)):
            emit(f"study: stage {stage.name}: not run (no runs yet)")
            continue
        by_design.update(stage.design_impl.report(stage, plan, root, out, target, emit))
    write_lr_series(plan, root, out, emit)
    scratch = write_claims(plan, root, out, emit)
    if scratch is not None:
        by_design = {"from scratch": scratch, **by_design}
    if out and len(by_design) > 1:
        path = os.path.join(out, "claims_by_design.png")
        plots.claims_by_design(by_design, claims.Hypotheses.from_plan(plan), path)
        emit(f"wrote {path}")
    write_progress(plan, root, out, emit)


def write_progress(plan: Plan, root: str, out: str | None, emit=emit_print) -> None:
    """Where the plan stands, stage by stage (progress.progress): progress.md and .json."""
    rows = progress(plan, root)
    write(_base(out, "progress"), progress_markdown(rows), {"stages": rows}, emit=emit)


def write_lr_series(plan: Plan, root: str, out: str | None, emit=emit_print) -> None:
    """Each LR series (lr_stress.series) whose stages have any run: DIR/lr_stress_<reference>.md, .json and
    .png (plots.plot_lr_series); its points without runs read "not run"."""
    for reference in lr_stress.references(plan):
        stages = [s for s in plan.stages if reference in (s.name, lr_stress.reference_of(s))]
        if not any(os.path.isdir(stage_root(root, s)) for s in stages):
            emit(f"study: LR series of {reference}: not run (no runs yet)")
            continue
        result = lr_stress.series(plan, root, reference)

        def draw(base, result=result):
            plots.plot_lr_series(result, base + ".png")
            return [base + ".png"]

        write(_base(out, f"lr_stress_{reference}"), lr_stress.series_markdown(result), result, draw, emit)


def pooled_scratch_runs(plan: Plan, root: str) -> tuple[list, list, list[str], list[int]] | None:
    """The stage-pooling rule of the claims from scratch: every paired from-scratch stage that is not an
    LR point and shares the first such stage's baseline and back end (a check that reruns a cell under
    another back end or against another baseline is not a block of the claims' design). Their seeds are
    shared, so the arms of all of them enter one arm x seed table; a run reused by several stages counts
    once. Returns (stages, runs, arms, seeds), None without such stages."""
    stages = [
        s
        for s in plan.stages
        if s.design == "scratch_paired"
        and lr_stress.reference_of(s) is None
        and os.path.isdir(stage_root(root, s))
    ]
    stages = [s for s in stages if (s.baseline, s.backend) == (stages[0].baseline, stages[0].backend)]
    if not stages:
        return None
    seen, pooled, arms = set(), [], []
    for stage in stages:
        arms += [a for a in stage.arms if a not in arms]
        for run in analysis.load_runs(stage_root(root, stage)):
            if (run.rung, run.seed) not in seen:
                seen.add((run.rung, run.seed))
                pooled.append(run)
    seeds = sorted(set().union(*(s.seeds for s in stages)))
    return stages, pooled, arms, seeds


def write_claims(plan: Plan, root: str, out: str | None, emit=emit_print) -> dict | None:
    """The claims' analysis over the pooled from-scratch stages (pooled_scratch_runs) with the first one's
    baseline, the primary metric of the first gate (else claims.DEFAULT_LAST_K): claims.md, .json and
    .png; returned, None without such stages or without claims in the plan."""
    pooled = pooled_scratch_runs(plan, root) if plan.claims is not None else None
    if pooled is None:
        return None
    stages, study_runs, arms, seeds = pooled
    hypotheses = claims.Hypotheses.from_plan(plan)
    last_k = next((s.gate["last_evals"] for s in stages if s.gate), claims.DEFAULT_LAST_K)
    result = claims.analyze(study_runs, stages[0].baseline, arms, last_k, hypotheses, seeds=seeds)
    write(_base(out, "claims"), claims.to_markdown(result), result, claims_figure(result, hypotheses), emit)
    return result


def claims_figure(result: dict, hypotheses: claims.Hypotheses):
    """The `draw` of a claims analysis: BASE.png, its forest plot (plots.claims_forest)."""

    def draw(base: str) -> list[str]:
        plots.claims_forest(result, hypotheses, base + ".png")
        return [base + ".png"]

    return draw
