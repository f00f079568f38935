"""The schedule layer's bookkeeping: which stages are complete or waiting, each run's expected remaining
wall time (measured where runs of its arm ran under the same GPU sharing, else the plan's run_minutes),
and the plan's progress table (progress.md / .json)."""

from __future__ import annotations

import os
import statistics

from fp4jax.study import runner, runs
from fp4jax.study.gate import gate_result
from fp4jax.study.plan import Plan, Stage, stage_root, stage_specs
from fp4jax.study.reuse import steps_done

__all__ = [
    "RESUME_OVERHEAD_MINUTES",
    "blocked_by",
    "expected_minutes",
    "failed_runs",
    "measured_minutes",
    "progress",
    "progress_markdown",
    "stage_complete",
]

RESUME_OVERHEAD_MINUTES = 1.0  # a resumed run's start-up and compile


def stage_complete(root: str, stage: Stage) -> bool:
    return all(runs.is_finished(s.directory(stage_root(root, stage))) for s in stage_specs(stage))


def failed_runs(root: str, stage: Stage) -> list[str]:
    """The labels of the stage's runs recorded as failed: the harness's failures (a crash, a timeout, out
    of memory), not a run's own outcome such as a divergence."""
    sroot = stage_root(root, stage)
    return [s.label for s in stage_specs(stage) if runs.run_status(s.directory(sroot)) == "failed"]


def blocked_by(plan: Plan, root: str, stage: Stage) -> str | None:
    """Why `stage` may not run yet (an earlier stage unfinished or with failed runs, or its gate not
    passed), else None. A failed run ends but measures nothing, so it never lets a later stage start."""
    for need in stage.requires:
        other = plan.stage(need)
        if not stage_complete(root, other):
            return f"stage {need} is not complete"
        failed = failed_runs(root, other)
        if failed:
            return (
                f"stage {need} has {len(failed)} failed run(s) ({failed[0]}, ...): rerun them with "
                "--retry-failed once their cause is fixed"
            )
        if other.gate is not None and not gate_result(root, other)["passed"]:
            return f"stage {need}'s gate did not pass"
    return None


def expected_minutes(spec: runner.RunSpec, directory: str, stage: Stage, measured: dict[str, float]) -> float:
    """What is left of a run, in minutes: the arm's measured wall time per run (else the design's
    default from run_minutes) times the fraction of steps left, plus a resume's overhead when it already
    has steps."""
    first, last = stage.design_impl.span(spec, stage)  # a branch starts at its trunk step
    full = measured.get(spec.rung.name, stage.design_impl.default_minutes(stage, first, last))
    done = max(0, steps_done(directory) - first)
    left = max(0.0, 1.0 - done / (last - first))
    return full * left + (RESUME_OVERHEAD_MINUTES if done else 0.0)


def measured_minutes(root: str, stage: Stage, runs_per_gpu: int = 1) -> dict[str, float]:
    """{arm: median over its finished runs of the wall time of all their attempts}, in minutes, from the
    runs whose every attempt ran with `runs_per_gpu` runs sharing its GPU (runner.slot_sharing): three
    runs on one H200 each take about 2.5x a run alone, so a wall time measured under another setting (or
    under an unrecorded one) says nothing about this call's and is not used (the plan's run_minutes is)."""
    walls: dict[str, list[float]] = {}
    for spec in stage_specs(stage):
        directory = spec.directory(stage_root(root, stage))
        record = runs.read_json(os.path.join(directory, runs.RECORD_FILE))
        status = runs.run_status(directory)
        if not record or "reused_from" in record or status not in runs.FINISHED:
            continue
        if runs.gpu_sharing(record) == runs_per_gpu:
            total = sum(h.get("wall_time_s") or 0.0 for h in record["history"])
            walls.setdefault(spec.rung.name, []).append(total / 60)
    return {arm: statistics.median(w) for arm, w in walls.items()}


def progress(plan: Plan, root: str) -> list[dict]:
    """Per stage, where the plan stands: runs in all, finished (and of those diverged or failed), left, the
    estimated GPU-minutes left for one run at a time (expected_minutes: measured alone where runs were,
    else the plan's run_minutes; a branch stage's trunks counted as unfinished runs, not their
    regenerations), and what it waits for (blocked_by)."""
    rows = []
    for stage in plan.stages:
        sroot = stage_root(root, stage)
        measured = measured_minutes(root, stage, 1)
        specs = stage_specs(stage)
        statuses = [runs.run_status(s.directory(sroot)) for s in specs]
        left = [s for s, status in zip(specs, statuses, strict=True) if status not in runs.FINAL_STATUSES]
        rows.append(
            {
                "stage": stage.name,
                "design": stage.design,
                "runs": len(specs),
                "finished": len(specs) - len(left),
                "diverged_or_failed": sum(status in ("diverged", "failed") for status in statuses),
                "left": len(left),
                "gpu_minutes_left": round(
                    sum(expected_minutes(s, s.directory(sroot), stage, measured) for s in left), 1
                ),
                "waits_for": blocked_by(plan, root, stage) if left else None,
            }
        )
    return rows


def progress_markdown(rows: list[dict]) -> str:
    head = "stage | design | runs | finished | diverged or failed | left | GPU-min left (est.) | waits for"
    lines = [f"| {head} |", "|---|---|---:|---:|---:|---:|---:|---|"]
    for r in rows:
        cells = [r["stage"], r["design"], r["runs"], r["finished"], r["diverged_or_failed"], r["left"]]
        cells += [f"{r['gpu_minutes_left']:g}" if r["left"] else "-", r["waits_for"] or "-"]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines) + "\n"
