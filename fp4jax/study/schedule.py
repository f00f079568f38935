"""The pipeline's schedule layer: the budgeted, resumable runner of a plan's stages.

Invariants of `run_plan`:
- every run of the call shares one persistent compilation cache, ROOT/.jax_cache (or the caller's
  JAX_COMPILATION_CACHE_DIR): an arm's seeds run one program, compiled once;
- a run with a final summary is never started again (runner); an unfinished one resumes from its
  checkpoints; --retry-failed first reopens the chosen runs recorded as failed (their summary.json moved
  to summary.failed.json, their attempts kept in ladder_run.json), so they run like unfinished ones;
- the call holds its GPUs for at most --budget-minutes of wall time: a run is started only when its
  expected remaining time fits in what is left (progress.expected_minutes; or, when nothing is running
  and nothing fits, when at least MIN_START_MINUTES are left: it will be stopped with a checkpoint); at
  the budget's end every running run gets SIGTERM (it saves a checkpoint and exits; the next call resumes
  it) and is killed KILL_AFTER_S later if it has not exited;
- a run stopped by the budget before it could save is left without a summary (resumable), never
  recorded as failed;
- a run identical to a finished run of an earlier stage is filled from it, not rerun (fp4jax.study.reuse);
- a stage whose required stages are incomplete or whose gate has not passed waits (progress.blocked_by);
- runs that share a GPU (`--gpus 0,0`) each get XLA_PYTHON_CLIENT_MEM_FRACTION = MEM_FRACTION / runs per
  GPU unless the caller set one (runner.child_env), so that they fit beside each other.
"""

from __future__ import annotations

import dataclasses
import os
import time

from fp4jax.study import runner, runs
from fp4jax.study.plan import BACKEND_ENV, Plan, Stage, stage_root, stage_specs
from fp4jax.study.progress import blocked_by, expected_minutes, measured_minutes
from fp4jax.study.reuse import reuse_earlier_run

__all__ = [
    "COMPILE_CACHE_DIR",
    "COMPILE_CACHE_ENV",
    "KILL_AFTER_S",
    "MIN_START_MINUTES",
    "STOP_MARGIN_S",
    "arm_of",
    "run_env",
    "run_plan",
]

STOP_MARGIN_S = 60  # stop runs this long before the budget ends: they save a checkpoint and exit
KILL_AFTER_S = 60  # a run that has not exited this long after SIGTERM is killed
MIN_START_MINUTES = 3.0  # an over-long run is started on an idle machine only with this much left


def arm_of(spec: runner.RunSpec) -> str:
    """The arm whose compiled step a run uses: a scratch run's rung, a branch's "<arm>/at<step>" arm, the
    trunks' "trunk"; an arm's seeds and its branches from any step share one program."""
    return spec.rung.name.split("/")[0]


def _check_arms(arms: list[str] | None, stages: list[Stage]) -> None:
    _check_chosen("--arm", "an arm", arms, {arm for stage in stages for arm in stage.arms})


def _check_seeds(seeds: list[int] | None, stages: list[Stage]) -> None:
    _check_chosen("--seed", "a seed", seeds, {seed for stage in stages for seed in stage.seeds})


def _check_chosen(flag: str, noun: str, chosen, known: set) -> None:
    """One line naming what `flag` chose that the stages do not have, and what they do."""
    unknown = sorted(set(chosen or ()) - known)
    if unknown:
        names = ", ".join(str(k) for k in sorted(known))
        raise ValueError(f"{flag} {', '.join(map(str, unknown))}: not {noun} of these stages; use {names}")


COMPILE_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"  # jax's persistent compilation cache
COMPILE_CACHE_DIR = ".jax_cache"  # under the study's root, unless the caller's environment names one


def run_env(stage: Stage, root: str, log) -> dict[str, str]:
    """The runs' environment: the stage's GEMM back end, and one persistent compilation cache for the
    study, so that the seeds of an arm (the same program: the seed enters as data) compile it once. A
    stochastic recipe's step takes minutes to compile on an H200; the cache changes no bit of a run."""
    env = dict(os.environ)
    env.setdefault(COMPILE_CACHE_ENV, os.path.join(os.path.abspath(root), COMPILE_CACHE_DIR))
    if stage.backend == "auto":
        if env.pop(BACKEND_ENV, None) is not None:
            log(f"study: stage {stage.name} runs back end 'auto': {BACKEND_ENV} is not passed to its runs")
    else:
        env[BACKEND_ENV] = stage.backend
    return env


@dataclasses.dataclass
class _Todo:
    spec: runner.RunSpec
    stage: Stage
    root: str  # the stage's root


def run_plan(
    plan: Plan,
    root: str,
    *,
    budget_minutes: float,
    parallel: int = 1,
    gpus: list[str] | None = None,
    stages: list[str] | None = None,
    arms: list[str] | None = None,
    seeds: list[int] | None = None,
    overrides: list[str] = (),
    retry_failed: bool = False,
    log=print,
    clock=time.monotonic,
) -> dict[str, dict]:
    """Runs what is not done of the plan's stages (all, or those named) within the budget; returns
    {label: summary} of the runs that ended in this call (see the module docstring for the rules).
    `arms` (names of some stages' arms) runs only those arms now, e.g. the cheap ones first; the
    report and the gates still read every arm the plan lists. `seeds` likewise runs only those seeds
    (in a branch stage: those trunks and their branches, so that a call on a fresh machine trains one
    trunk again, not all of them). `retry_failed` starts runs recorded as failed again (resuming from
    their checkpoints, if any)."""
    if budget_minutes <= 0:
        raise ValueError(f"--budget-minutes {budget_minutes:g} must be > 0")
    chosen = [plan.stage(name) for name in stages] if stages else list(plan.stages)
    _check_arms(arms, chosen)
    _check_seeds(seeds, chosen)
    deadline = clock() + budget_minutes * 60
    kind = runner.accelerator_kind()
    slots = runner._slots(parallel, gpus, 1, kind)
    done: dict[str, dict] = {}
    if retry_failed:
        for stage in chosen:
            _reopen_failed(stage, stage_root(root, stage), arms, seeds, log)
    for stage in chosen:
        reason = blocked_by(plan, root, stage)
        if reason:
            log(f"study: stage {stage.name} waits: {reason}")
            continue
        sroot = stage_root(root, stage)
        for specs in _phases(stage, sroot, arms, seeds, log):
            infos = runner.config_infos(specs, list(overrides))
            todo = []
            for spec in specs:
                if runs.is_finished(spec.directory(sroot)):
                    log(f"study: {stage.name}/{spec.label}: finished before, not rerun")
                elif not reuse_earlier_run(plan, root, stage, spec, list(overrides), log):
                    todo.append(_Todo(spec, stage, sroot))
            if todo:
                done.update(_run_stage(todo, infos, slots, kind, deadline, list(overrides), log, clock))
            if clock() >= deadline - STOP_MARGIN_S:
                break
        if clock() >= deadline - STOP_MARGIN_S:
            break
    left = max(0.0, (deadline - clock()) / 60)
    log(f"study: this call is done, {left:.1f} of {budget_minutes:g} budget minutes left")
    return done


def _reopen_failed(stage: Stage, sroot: str, arms, seeds, log) -> None:
    """The stage's failed runs among the chosen arms and seeds made unfinished (runs.reopen_failed)."""
    for spec in stage_specs(stage):
        if (seeds and spec.seed not in seeds) or (arms and arm_of(spec) not in arms):
            continue
        failed = runs.reopen_failed(spec.directory(sroot))
        if failed is not None:
            log(f"study: {stage.name}/{spec.label}: failed before ({failed.get('failure')}), to run again")


def _phases(stage: Stage, sroot: str, arms, seeds, log):
    """The stage's runs of the chosen seeds in the order they may run, in its design's phases (each chosen
    after the one before ran: a branch stage's trunks, their regenerations, then the branches)."""
    specs = [spec for spec in stage_specs(stage) if not seeds or spec.seed in seeds]
    return stage.design_impl.phases(stage, specs, sroot, arms, log)


def _run_stage(todo, infos, slots, kind, deadline, overrides, log, clock) -> dict[str, dict]:
    stage = todo[0].stage
    sharing = runner.slot_sharing(slots)
    measured = measured_minutes(os.path.dirname(todo[0].root), stage, max(sharing))
    env = run_env(stage, os.path.dirname(todo[0].root), log)
    running: dict[int, tuple[runner.Job, _Todo]] = {}
    stopping: dict[int, float] = {}  # slot -> when the budget's SIGTERM was sent
    done: dict[str, dict] = {}
    try:
        while todo or running:
            now = clock()
            stop_at = deadline - STOP_MARGIN_S
            for slot in [i for i in range(len(slots)) if i not in running]:
                busy = {arm_of(started.spec) for _, started in running.values()}
                item = _next_fitting(_spread(todo, busy), (stop_at - now) / 60, measured, not running, log)
                if item is None:
                    break
                todo.remove(item)
                job = _start(item, overrides, slots[slot], kind, env, sharing[slot])
                running[slot] = (job, item)
                where = f" on GPU {','.join(slots[slot])}" if slots[slot] else ""
                log(f"study: start {stage.name}/{item.spec.label}{where}")
            if not running:
                for item in todo:
                    need = expected_minutes(item.spec, item.spec.directory(item.root), stage, measured)
                    log(
                        f"study: {stage.name}/{item.spec.label} left for the next call "
                        f"(needs ~{need:.1f} min)"
                    )
                break
            for slot, (job, item) in list(running.items()):
                if clock() >= stop_at and slot not in stopping and job.proc.poll() is None:
                    job.proc.send_signal(15)  # SIGTERM: the trainer saves a checkpoint and exits
                    stopping[slot] = clock()
                    log(
                        f"study: budget spent, stopping {stage.name}/{item.spec.label} (it saves and resumes)"
                    )
                elif slot in stopping and clock() - stopping[slot] > KILL_AFTER_S:
                    job.proc.kill()
                code = job.proc.poll()
                if code is None:
                    continue
                del running[slot]
                summary = _finish(job, code, infos[item.spec], budget_stopped=slot in stopping)
                stopping.pop(slot, None)
                if summary is not None:
                    done[item.spec.label] = summary
                    log(f"study: {stage.name}/{item.spec.label}: {runner.describe(summary)}")
            time.sleep(runner.POLL_S)
    except KeyboardInterrupt:
        runner.stop_all({slot: job for slot, (job, _) in running.items()}, log)
        raise
    return done


def _spread(todo: list[_Todo], running_arms: set[str]) -> list[_Todo]:
    """todo with the runs of arms not running now first (order kept otherwise): two runs of one arm
    started together both compile its step, one started after the other reads it from the compilation
    cache (measured on an H200: first update 9-12 s from the cache, 28-35 s compiling beside another)."""
    return sorted(todo, key=lambda t: arm_of(t.spec) in running_arms)  # stable


def _next_fitting(todo: list[_Todo], minutes_left: float, measured, idle: bool, log) -> _Todo | None:
    """The first run whose expected remaining time fits in `minutes_left`; on an idle machine with nothing
    fitting, the first run if at least MIN_START_MINUTES are left (the budget will stop it)."""
    if minutes_left <= 0:
        return None
    for item in todo:
        if expected_minutes(item.spec, item.spec.directory(item.root), item.stage, measured) <= minutes_left:
            return item
    return todo[0] if todo and idle and minutes_left >= MIN_START_MINUTES else None


def _start(item: _Todo, overrides, gpus, kind, env, runs_per_gpu: int) -> runner.Job:
    return runner.start(item.spec, item.root, overrides, gpus, kind, None, env=env, runs_per_gpu=runs_per_gpu)


def _finish(job: runner.Job, code: int, info: dict, *, budget_stopped: bool) -> dict | None:
    """runner.finish, except for a run the budget stopped before it wrote a summary: no summary is derived
    for it (it stays resumable), and the attempt is recorded as "stopped_by_budget"."""
    fresh = runner._mtime(runs.summary_path(job.run_dir)) not in (None, job.summary_mtime)
    if budget_stopped and not fresh:
        job.log_file.close()
        runner.record_attempt(job, code, time.monotonic() - job.started, {"status": "stopped_by_budget"})
        return None
    return runner.finish(job, code, info)
