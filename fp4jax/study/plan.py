"""A study as data (a TOML plan file) and the budgeted, resumable runner of it.

    python -m fp4jax.study run --plan fp4jax/study/plans/proxy125m.toml --root runs/study \
        --budget-minutes 9 --parallel 1 --gpus 0 [--stage calibration] [--set data.path=...]
    python -m fp4jax.study report --plan fp4jax/study/plans/proxy125m.toml --root runs/study --out DIR

The plan file: top-level `name`, then `[[stages]]` in the order they run, each with `name`, `design`
("scratch_paired": every arm from scratch with the same seeds, so init and data order are shared by all
arms; "branch": every arm branched from shared trunks, with keys of its own: fp4jax.study.branching),
`config` (a set-up's config file), `arms` ({arm name: recipe preset}, in report order), `baseline`
(an arm), `seeds`, `steps`, `warmup_steps`, `peak_lr`, `backend` (a GEMM back end or "auto"),
`run_minutes` (one run's expected wall time, used until runs of the stage measured it), optional
`overrides` ({dotted config key: value}), `requires` (stages that must be complete and, if gated, passed)
and `gate` (the pass rule, see `gate_result`). A scratch_paired stage may also set `count_spikes =
{spike_nats = NATS, window = UPDATES}` (the report counts each run's loss spikes by that rule:
fp4jax.study.lr_stress) and `lr_reference` (an earlier scratch_paired stage with its arms, recipes,
seeds, config, horizon, warm-up, back end and baseline at another peak LR: its runs are the series' 1x
point; it needs count_spikes).

Run layout: ROOT/<stage>/<arm>/seed<k>/ (fp4jax.study.runs), so each stage is a ladder root of its own;
a branch stage's is ROOT/<stage>/trunk/seed<k>/ and ROOT/<stage>/<arm>/at<step>/seed<k>/.

Invariants of `run`:
- every run of the call shares one persistent compilation cache, ROOT/.jax_cache (or the caller's
  JAX_COMPILATION_CACHE_DIR): an arm's seeds run one program, compiled once;
- a run with a final summary is never started again (runner); an unfinished one resumes from its
  checkpoints;
- the call holds its GPUs for at most --budget-minutes of wall time: a run is started only when its
  expected remaining time fits in what is left (or, when nothing is running and nothing fits, when at
  least MIN_START_MINUTES are left: it will be stopped with a checkpoint); at the budget's end every
  running run gets SIGTERM (it saves a checkpoint and exits; the next call resumes it) and is killed
  KILL_AFTER_S later if it has not exited;
- a run stopped by the budget before it could save is left without a summary (resumable), never
  recorded as failed;
- a run not yet started whose spec is identical to a finished run of an earlier stage (`run_identity`:
  the same trainer command apart from --workdir, under the same GEMM back end) is not rerun: its
  directory is filled from the earlier one (REUSED_FILES, no checkpoints) and its ladder_run.json says
  "reused_from": "<stage>/<arm>/seed<k>" (`reuse_earlier_run`).
"""

from __future__ import annotations

import dataclasses
import math
import os
import shutil
import statistics
import time
import tomllib

from fp4jax.study import branching, runner, runs, stats

__all__ = [
    "DESIGNS",
    "SPIKE_KEYS",
    "Plan",
    "Stage",
    "gate_result",
    "load_plan",
    "reuse_earlier_run",
    "run_identity",
    "run_plan",
    "stage_specs",
]

DESIGNS = ("scratch_paired", "branch")  # branch: fp4jax.study.branching
STAGE_KEYS = (
    {
        "name",
        "design",
        "config",
        "arms",
        "baseline",
        "seeds",
        "steps",
        "warmup_steps",
        "peak_lr",
        "backend",
        "run_minutes",
        "overrides",
        "requires",
        "gate",
        "count_spikes",
        "lr_reference",
    }
    | branching.KEYS
    | branching.OPTIONAL_KEYS
)
SCRATCH_KEYS = {"count_spikes", "lr_reference"}  # a scratch_paired stage's only
REQUIRED_KEYS = (
    STAGE_KEYS - {"overrides", "requires", "gate"} - SCRATCH_KEYS - branching.KEYS - branching.OPTIONAL_KEYS
)
GATE_KEYS = {"arm", "against", "last_evals", "smallest_overhead", "sigmas"}
SPIKE_KEYS = ("spike_nats", "window")  # count_spikes's: stats.loss_spikes's rule
# What a stage shares with its lr_reference (the same runs but for the peak LR and the overrides).
SAME_AS_REFERENCE = ("design", "config", "baseline", "steps", "warmup_steps", "backend")
# The trainer's back ends and the variable that picks one (fp4jax.ops.BACKENDS, training.setup's
# GEMM_BACKEND_ENV; tested equal), restated so that planning imports neither the ops nor the trainer.
BACKENDS = ("auto", "emulate", "fp8", "native")
STOP_MARGIN_S = 60  # stop runs this long before the budget ends: they save a checkpoint and exit
KILL_AFTER_S = 60  # a run that has not exited this long after SIGTERM is killed
MIN_START_MINUTES = 3.0  # an over-long run is started on an idle machine only with this much left
RESUME_OVERHEAD_MINUTES = 1.0  # a resumed run's start-up and compile
BACKEND_ENV = "FP4JAX_GEMM_BACKEND"  # see BACKENDS


@dataclasses.dataclass(frozen=True)
class Stage:
    name: str
    design: str
    config: str
    arms: dict[str, str]
    baseline: str
    seeds: tuple[int, ...]
    steps: int
    warmup_steps: int
    peak_lr: float
    backend: str
    run_minutes: float
    overrides: dict[str, object] = dataclasses.field(default_factory=dict)
    requires: tuple[str, ...] = ()
    gate: dict | None = None
    count_spikes: dict | None = None  # {spike_nats, window}: the report counts each run's loss spikes
    lr_reference: str | None = None  # the earlier stage whose runs are this one's 1x LR point
    trunk_arm: str | None = None  # the branch design's keys (fp4jax.study.branching)
    branch_steps: tuple[int, ...] = ()
    branch_length: int = 0
    arm_branch_steps: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str
    stages: tuple[Stage, ...]
    path: str

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise ValueError(f"plan {self.name} has no stage {name!r}: its stages are {self.stage_names}")

    @property
    def stage_names(self) -> str:
        return ", ".join(s.name for s in self.stages)


def load_plan(path: str) -> Plan:
    """The plan in a TOML file, checked: a ValueError of one line names the first bad entry."""
    if not os.path.isfile(path):
        raise ValueError(f"plan file {path} does not exist; the committed plans are in fp4jax/study/plans/")
    with open(path, "rb") as f:
        try:
            data = tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"plan file {path} is not valid TOML: {exc}") from None
    stages = data.get("stages")
    if not isinstance(data.get("name"), str) or not isinstance(stages, list) or not stages:
        raise ValueError(f"plan file {path} needs a top-level name and at least one [[stages]] table")
    parsed: list[Stage] = []
    for i, raw in enumerate(stages):
        where = f"{path}: stage {raw.get('name', i)!r}"
        parsed.append(_stage(raw, where, [s.name for s in parsed]))
        _check_lr_reference(parsed[-1], parsed[:-1], where)
    return Plan(data["name"], tuple(parsed), path)


def _stage(raw: dict, where: str, earlier: list[str]) -> Stage:
    branch = raw.get("design") == "branch"
    required = REQUIRED_KEYS - {"steps"} | branching.KEYS if branch else REQUIRED_KEYS
    known = STAGE_KEYS - SCRATCH_KEYS if branch else STAGE_KEYS - branching.KEYS - branching.OPTIONAL_KEYS
    unknown, missing = set(raw) - known, required - set(raw)
    if unknown or missing:
        what = f"unknown keys {sorted(unknown)}" if unknown else f"missing keys {sorted(missing)}"
        raise ValueError(f"{where}: {what}; a stage has {', '.join(sorted(STAGE_KEYS))}")
    if raw["name"] in earlier or not str(raw["name"]).isidentifier():
        raise ValueError(f"{where}: a stage name is a unique identifier")
    if raw["design"] not in DESIGNS:
        raise ValueError(f"{where}: design {raw['design']!r} is not one of {', '.join(DESIGNS)}")
    raw = branching.normalize(raw, where) if branch else raw
    if raw["backend"] not in BACKENDS:
        raise ValueError(f"{where}: backend {raw['backend']!r} is not one of {', '.join(BACKENDS)}")
    arms = raw["arms"]
    if not isinstance(arms, dict) or not arms or raw["baseline"] not in arms:
        raise ValueError(f"{where}: arms is a table {{arm = recipe}} that includes the baseline")
    for key in ("seeds",):
        if not raw[key] or not all(isinstance(s, int) and s >= 0 for s in raw[key]):
            raise ValueError(f"{where}: seeds is a non-empty list of integers >= 0")
    if not (raw["steps"] >= 1 and 0 <= raw["warmup_steps"] < raw["steps"] and raw["peak_lr"] > 0):
        raise ValueError(f"{where}: want steps >= 1, 0 <= warmup_steps < steps and peak_lr > 0")
    for need in raw.get("requires", []):
        if need not in earlier:
            raise ValueError(f"{where}: requires {need!r}, which is not an earlier stage")
    gate = raw.get("gate")
    if gate is not None and (set(gate) != GATE_KEYS or {gate["arm"], gate["against"]} - set(arms)):
        raise ValueError(f"{where}: gate needs exactly {sorted(GATE_KEYS)}, arm and against among the arms")
    return Stage(
        name=raw["name"],
        design=raw["design"],
        config=raw["config"],
        arms=dict(arms),
        baseline=raw["baseline"],
        seeds=tuple(raw["seeds"]),
        steps=int(raw["steps"]),
        warmup_steps=int(raw["warmup_steps"]),
        peak_lr=float(raw["peak_lr"]),
        backend=raw["backend"],
        run_minutes=float(raw["run_minutes"]),
        overrides=dict(raw.get("overrides", {})),
        requires=tuple(raw.get("requires", [])),
        gate=None if gate is None else dict(gate),
        count_spikes=_count_spikes(raw.get("count_spikes"), where),
        lr_reference=raw.get("lr_reference"),
        **({"trunk_arm": raw["trunk_arm"], "branch_steps": tuple(raw["branch_steps"])} if branch else {}),
        **({"branch_length": int(raw["branch_length"])} if branch else {}),
        arm_branch_steps={arm: tuple(at) for arm, at in raw.get("arm_branch_steps", {}).items()},
    )


def _count_spikes(rule, where: str) -> dict | None:
    """count_spikes checked: {"spike_nats": float > 0, "window": int >= 1}, None when the stage has none."""
    if rule is None:
        return None
    if not isinstance(rule, dict) or set(rule) != set(SPIKE_KEYS):
        got = sorted(rule) if isinstance(rule, dict) else repr(rule)
        raise ValueError(f"{where}: count_spikes is {{spike_nats = NATS, window = UPDATES}}, not {got}")
    nats, window = rule["spike_nats"], rule["window"]
    numbers = not isinstance(nats, bool) and isinstance(nats, int | float) and type(window) is int
    if not (numbers and nats > 0 and window >= 1):
        raise ValueError(f"{where}: count_spikes wants spike_nats > 0 (nats) and window >= 1 (updates)")
    return {"spike_nats": float(nats), "window": window}


def _check_lr_reference(stage: Stage, earlier: list[Stage], where: str) -> None:
    """A stage's lr_reference names an earlier stage that runs this stage's runs but for the peak LR (and
    the overrides, e.g. the trainer's divergence rule): SAME_AS_REFERENCE, the arms with their recipes
    and the seeds; the stage counts spikes, and every stage of one reference (one LR series) has the same
    arms, seeds and count_spikes."""
    if stage.lr_reference is None:
        return
    ref = next((s for s in earlier if s.name == stage.lr_reference), None)
    if ref is None or stage.count_spikes is None:
        name = stage.lr_reference
        raise ValueError(f"{where}: lr_reference {name!r} must be an earlier stage, with count_spikes set")
    same = all(getattr(ref, key) == getattr(stage, key) for key in SAME_AS_REFERENCE)
    arms = all(ref.arms.get(arm) == recipe for arm, recipe in stage.arms.items())
    if not (same and arms and set(stage.seeds) <= set(ref.seeds)) or ref.peak_lr == stage.peak_lr:
        raise ValueError(
            f"{where}: lr_reference {ref.name!r} must have this stage's arms (same recipes), seeds, "
            f"{', '.join(SAME_AS_REFERENCE)} at another peak_lr"
        )
    sibling = next((s for s in earlier if s.lr_reference == ref.name), None)
    shared = ("arms", "seeds", "count_spikes")
    if sibling and any(getattr(sibling, key) != getattr(stage, key) for key in shared):
        raise ValueError(f"{where}: the stages of lr_reference {ref.name!r} share {', '.join(shared)}")


# ------------------------------------------------------------------------------------------- the runs


def _override(key: str, value) -> str:
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return f"--config.{key}={text}"


def stage_specs(stage: Stage) -> list[runner.RunSpec]:
    """The stage's runs, seed-major (every arm's seed 0 before any seed 1): arm = the config with its recipe,
    the stage's horizon, warm-up, LR and overrides."""
    common = [
        _override("steps", stage.steps),
        _override("optimizer.warmup_steps", stage.warmup_steps),
        _override("optimizer.peak_lr", repr(stage.peak_lr)),
        *(_override(k, v) for k, v in stage.overrides.items()),
    ]
    if stage.design == "branch":
        return branching.stage_specs(stage, common)
    rungs = [
        runner.Rung(arm, stage.config, (*common, _override("recipe", recipe)))
        for arm, recipe in stage.arms.items()
    ]
    return runner.plan(rungs, list(stage.seeds), None)


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


def stage_root(root: str, stage: Stage) -> str:
    return os.path.join(root, stage.name)


def stage_complete(root: str, stage: Stage) -> bool:
    return all(runs.is_finished(s.directory(stage_root(root, stage))) for s in stage_specs(stage))


def blocked_by(plan: Plan, root: str, stage: Stage) -> str | None:
    """Why `stage` may not run yet (an earlier stage unfinished, or its gate not passed), else None."""
    for need in stage.requires:
        other = plan.stage(need)
        if not stage_complete(root, other):
            return f"stage {need} is not complete"
        if other.gate is not None and not gate_result(root, other)["passed"]:
            return f"stage {need}'s gate did not pass"
    return None


COMPILE_CACHE_ENV = "JAX_COMPILATION_CACHE_DIR"  # jax's persistent compilation cache
COMPILE_CACHE_DIR = ".jax_cache"  # under the study's root, unless the caller's environment names one


def _env(stage: Stage, root: str, log) -> dict[str, str]:
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


def expected_minutes(spec: runner.RunSpec, directory: str, stage: Stage, measured: dict[str, float]) -> float:
    """What is left of a run, in minutes: the arm's measured wall time per run (else the plan's
    run_minutes) times the fraction of steps left, plus a resume's overhead when it already has steps."""
    first, last = branching.span(spec, stage)  # a branch starts at its trunk step
    full = measured.get(spec.rung.name, branching.default_minutes(stage, first, last))
    done = max(0, steps_done(directory) - first)
    left = max(0.0, 1.0 - done / (last - first))
    return full * left + (RESUME_OVERHEAD_MINUTES if done else 0.0)


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


def steps_done(directory: str) -> int:
    """The steps of a run's newest checkpoint (0 when it has none)."""
    ckpts = os.path.join(directory, "checkpoints")
    if not os.path.isdir(ckpts):
        return 0
    return max((int(d) for d in os.listdir(ckpts) if d.isdigit()), default=0)


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
    log=print,
    clock=time.monotonic,
) -> dict[str, dict]:
    """Runs what is not done of the plan's stages (all, or those named) within the budget; returns
    {label: summary} of the runs that ended in this call (see the module docstring for the rules).
    `arms` (names of some stages' arms) runs only those arms now, e.g. the cheap ones first; the
    report and the gates still read every arm the plan lists. `seeds` likewise runs only those seeds
    (in a branch stage: those trunks and their branches, so that a call on a fresh machine trains one
    trunk again, not all of them)."""
    if budget_minutes <= 0:
        raise ValueError(f"--budget-minutes {budget_minutes:g} must be > 0")
    chosen = [plan.stage(name) for name in stages] if stages else list(plan.stages)
    _check_arms(arms, chosen)
    _check_seeds(seeds, chosen)
    deadline = clock() + budget_minutes * 60
    kind = runner.accelerator_kind()
    slots = runner._slots(parallel, gpus, 1, kind)
    done: dict[str, dict] = {}
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


def _phases(stage: Stage, sroot: str, arms, seeds, log):
    """The stage's runs of the chosen seeds in the order they may run: one phase (scratch), or the trunks,
    their regenerations and the branches that have a start point (branch design, each phase chosen after
    the one before ran)."""
    specs = [spec for spec in stage_specs(stage) if not seeds or spec.seed in seeds]
    if stage.design == "branch":
        return branching.phases(specs, sroot, arms, log)
    return [[spec for spec in specs if not arms or spec.rung.name in arms]]


def _run_stage(todo, infos, slots, kind, deadline, overrides, log, clock) -> dict[str, dict]:
    stage = todo[0].stage
    sharing = runner.slot_sharing(slots)
    measured = measured_minutes(os.path.dirname(todo[0].root), stage, max(sharing))
    env = _env(stage, os.path.dirname(todo[0].root), log)
    running: dict[int, tuple[runner.Job, _Todo]] = {}
    stopping: dict[int, float] = {}  # slot -> when the budget's SIGTERM was sent
    done: dict[str, dict] = {}
    try:
        while todo or running:
            now = clock()
            stop_at = deadline - STOP_MARGIN_S
            for slot in [i for i in range(len(slots)) if i not in running]:
                busy = {branching.arm_of(started.spec) for _, started in running.values()}
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
    return sorted(todo, key=lambda t: branching.arm_of(t.spec) in running_arms)  # stable


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


# ---------------------------------------------------------------------------- runs shared by stages

REUSED_FILES = ("metrics.jsonl", "train.log")  # copied first; then ladder_run.json, then summary.json
REUSABLE_STATUSES = ("reached", "not_reached", "diverged")  # a run's own outcome; "failed" is not one


def run_identity(spec: runner.RunSpec, stage: Stage, overrides: list[str]) -> tuple[str, ...]:
    """What makes a run the run it is: the trainer command without --workdir, and the back end it runs
    under (passed in its environment, `_env`). Runs of equal identity train the same model on the same
    data the same way, so one of them stands for all."""
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


# ------------------------------------------------------------------------------------------- the gate


def primary_loss(summary: dict | None, last_evals: int) -> float | None:
    """The primary metric of a run: the mean eval loss of its last `last_evals` periodic evaluations (None
    for a run without a final status or with fewer evaluations)."""
    if runs.status_of(summary) not in runs.FINISHED:
        return None
    evals = summary.get("evals") or []
    if len(evals) < last_evals:
        return None
    return statistics.fmean(e[-1] for e in evals[-last_evals:])


def local_slope(evals_by_seed: list[list[list]], last_fraction: float = 0.5) -> float | None:
    """-dL/d(ln T) of the seeds' mean eval curve over the last `last_fraction` of its tokens (a least-squares
    line in ln T): a loss difference dL at the horizon is a token ratio of exp(dL / slope)."""
    curves = [{e[2]: e[3] for e in evals} for evals in evals_by_seed if evals]
    if not curves:
        return None
    tokens = sorted(set.intersection(*(set(c) for c in curves)))
    tokens = [t for t in tokens if t > 0 and t >= (1 - last_fraction) * tokens[-1]] if tokens else []
    if len(tokens) < 3:
        return None
    x = [math.log(t) for t in tokens]
    y = [statistics.fmean(c[t] for c in curves) for t in tokens]
    mx, my = statistics.fmean(x), statistics.fmean(y)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / sum((a - mx) ** 2 for a in x)
    return -slope


def gate_result(root: str, stage: Stage) -> dict:
    """The calibration gate of a stage (stage.gate: arm, against, last_evals, smallest_overhead, sigmas).

    Per seed k the paired difference d_k = L(arm, k) - L(against, k) of the primary metric. The gate passes
    when `sigmas` standard errors of the mean difference over the stage's seeds, sd(d) / sqrt(n), are at
    most the loss difference of the smallest token overhead of interest, slope x ln(1 + smallest_overhead),
    with slope the `against` arm's local -dL/d(ln T) at the horizon (`local_slope`). Equivalently the
    paired sd may be at most sd_max = slope x ln(1 + smallest_overhead) x sqrt(n) / sigmas. Not passed (and
    "complete": False) while any run of the two arms lacks its primary metric.
    """
    gate = stage.gate
    sroot = stage_root(root, stage)
    loss: dict[str, dict[int, float | None]] = {}
    evals: dict[str, list] = {}
    for spec in stage_specs(stage):
        summary = runs.read_json(runs.summary_path(spec.directory(sroot)))
        loss.setdefault(spec.rung.name, {})[spec.seed] = primary_loss(summary, gate["last_evals"])
        evals.setdefault(spec.rung.name, []).append((summary or {}).get("evals") or [])
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
    half = stats.t_quantile(n - 1, level=0.95) * sd / math.sqrt(n)
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
