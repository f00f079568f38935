"""The schedule layer's run reuse: a run not yet started whose spec is identical to a finished run of an
earlier stage (`run_identity`: the same trainer command apart from --workdir, under the same GEMM back
end) is not rerun: its directory is filled from the earlier one (REUSED_FILES, no checkpoints) and its
ladder_run.json says "reused_from": "<stage>/<arm>/seed<k>" (`reuse_earlier_run`)."""

from __future__ import annotations

import os
import shutil

from fp4jax.study import runner, runs
from fp4jax.study.plan import BACKEND_ENV, Plan, Stage, stage_root, stage_specs

__all__ = ["REUSABLE_STATUSES", "REUSED_FILES", "reuse_earlier_run", "run_identity", "steps_done"]

REUSED_FILES = ("metrics.jsonl", "train.log")  # copied first; then ladder_run.json, then summary.json
REUSABLE_STATUSES = ("reached", "not_reached", "diverged")  # a run's own outcome; "failed" is not one


def steps_done(directory: str) -> int:
    """The steps of a run's newest checkpoint (0 when it has none)."""
    ckpts = os.path.join(directory, "checkpoints")
    if not os.path.isdir(ckpts):
        return 0
    return max((int(d) for d in os.listdir(ckpts) if d.isdigit()), default=0)


def run_identity(spec: runner.RunSpec, stage: Stage, overrides: list[str]) -> tuple[str, ...]:
    """What makes a run the run it is: the trainer command without --workdir, and the back end it runs
    under (passed in its environment: schedule.run_env). Runs of equal identity train the same model on
    the same data the same way, so one of them stands for all."""
    argv = list(spec.argv("", overrides))
    at = argv.index("--workdir")
    return (f"{BACKEND_ENV}={stage.backend}", *argv[:at], *argv[at + 2 :])


def _earlier_identical_run(plan: Plan, root: str, stage: Stage, spec, overrides) -> tuple[str, str] | None:
    """(label "<stage>/<arm>/seed<k>", directory) of the first finished run of an earlier stage with
    `spec`'s identity and an outcome of its own (REUSABLE_STATUSES), else None."""
    identity = run_identity(spec, stage, overrides)
    for other in plan.stages[: plan.stages.index(stage)]:
        for candidate in stage_specs(other):
            directory = candidate.directory(stage_root(root, other))
            summary = runs.read_json(runs.summary_path(directory))
            if runs.status_of(summary) in REUSABLE_STATUSES:
                if run_identity(candidate, other, overrides) == identity:
                    return f"{other.name}/{candidate.label}", directory
    return None


def reuse_earlier_run(plan: Plan, root: str, stage: Stage, spec, overrides: list[str], log) -> bool:
    """Fills `spec`'s directory from an identical finished run of an earlier stage and returns True;
    False (nothing done) when there is none or the run has already started in its own stage (it then
    resumes there). The summary is written last, so an interrupted copy is simply redone."""
    directory = spec.directory(stage_root(root, stage))
    if os.path.exists(runs.summary_path(directory)) or steps_done(directory):
        return False
    found = _earlier_identical_run(plan, root, stage, spec, overrides)
    if found is None:
        return False
    label, source = found
    origin = (runs.read_json(os.path.join(source, runs.RECORD_FILE)) or {}).get("reused_from", label)
    os.makedirs(directory, exist_ok=True)
    for name in REUSED_FILES:
        if os.path.exists(os.path.join(source, name)):
            shutil.copyfile(os.path.join(source, name), os.path.join(directory, name))
    record = {"rung": spec.rung.name, "seed": spec.seed, "lr": spec.lr, "config": spec.rung.config}
    record.update(attempts=0, history=[], reused_from=origin)
    runs.write_json(os.path.join(directory, runs.RECORD_FILE), record)
    shutil.copyfile(runs.summary_path(source), runs.summary_path(directory) + ".tmp")
    os.replace(runs.summary_path(directory) + ".tmp", runs.summary_path(directory))
    log(f"study: {stage.name}/{spec.label}: the same run as {origin}, filled from it, not rerun")
    return True
