"""The branching design of a study stage (design = "branch"): one trunk per seed, every arm branched from it.

Stage keys beside the common ones (fp4jax.study.plan): `trunk_arm` (the arm whose recipe trains the
trunks, usually the baseline), `branch_steps` (the trunk steps to branch at, ascending, e.g. one early and
one late), `branch_length` (updates per branch), and optionally `arm_branch_steps` ({arm = [steps]}: an arm
branched at only some of branch_steps, e.g. an arm added later at the late point only; every other arm
branches at all of them). `steps` is not set: the trunk trains to the last branch
step, saving and keeping a checkpoint at every branch step (config.keep_checkpoint_steps). `run_minutes`
is one branch's expected wall time; the trunk's is taken as run_minutes x its updates / branch_length
until runs measured it. A branch stage has no gate.

Runs, under the stage's root: trunk/seed<k>/ (trunk_arm's recipe from scratch, seed k, to the last branch
step), then <arm>/at<step>/seed<k>/ for every branch step, seed and arm (trunk_arm included): the trunk's
checkpoint at that step continued for branch_length updates with the arm's recipe (config.init_from,
fp4jax.training.branch: the trunk's params, optimizer state, step, data position and LR schedule; amax
histories where they fit). Every run of a stage has the stage's warm-up, peak LR, overrides and seed k, so
a branch sees the trunk's next batches and its schedule. A branch starts only once its trunk has saved the
checkpoint it starts from; the never-rerun and budget rules are the scratch runs' (plan.run_plan).

Checkpoints do not travel with the committed runs (a trunk's is gigabytes), so a finished trunk whose
checkpoint a pending branch needs is trained again into trunk/seed<k>/regenerated/ (a scratch directory,
replaced whenever it lacks the checkpoint; the report never reads it) up to that branch step, and its
branches start from there only if it repeated the trunk exactly: every training loss and gradient norm
the trunk logged up to the branch step, bit for bit (regenerated/identity.json). Deterministic trunks
(xla_gpu_deterministic_ops, the same process set-up) repeat; a trunk that did not leaves its branches
waiting, with the first step that differs in the log.

Report (`Branch.report`): <stage>.md/.json/.png, the differences against tokens (branch_analysis), and
for a stage whose arms make any of the plan's contrasts, <stage>_claims_at<step>.md/.json/.png: the
claims per branch point, trunks as blocks (docs/study_plan.md).
"""

from __future__ import annotations

import dataclasses
import os
import shutil

from fp4jax.study import branch_analysis, claims, plots, report, runner, runs
from fp4jax.study.plan import Stage, stage_root
from fp4jax.study.schedule import arm_of
from fp4jax.training import integrity

__all__ = [
    "DESIGN",
    "KEYS",
    "OPTIONAL_KEYS",
    "REGENERATED",
    "TRUNK",
    "Branch",
    "BranchOptions",
    "BranchRun",
    "TrunkRegeneration",
    "normalize",
    "phases",
    "span",
    "stage_specs",
    "start_point",
    "steps_of",
]

KEYS = {"trunk_arm", "branch_steps", "branch_length"}
OPTIONAL_KEYS = {"arm_branch_steps"}
TRUNK = "trunk"  # the trunks' directory under the stage root, so no arm may take the name
REGENERATED = "regenerated"  # a trunk trained again for its checkpoints, inside the trunk's directory
# What a regenerated trunk must repeat bit for bit, per training update the trunk logged.
REPEATED_KEYS = ("loss", "grad_norm")


def trunk_dir(sroot: str, seed: int) -> str:
    return os.path.join(sroot, TRUNK, f"seed{seed}")


@dataclasses.dataclass(frozen=True)
class BranchRun(runner.RunSpec):
    """A run branched at trunk step `at` from the trunk of its seed (<stage root>/trunk/seed<k>, or its
    regenerated copy when only that holds the checkpoint: start_point)."""

    at: int = 0

    def argv(self, root: str, overrides: list[str]) -> list[str]:
        """The trainer's command line, then where it branches from (the last of a key wins)."""
        source = start_point(self, root) or trunk_dir(root, self.seed)
        branch = [f"--config.init_from={source}", f"--config.init_from_step={self.at}"]
        return [*super().argv(root, overrides), *branch]


@dataclasses.dataclass(frozen=True)
class TrunkRegeneration(runner.RunSpec):
    """A finished trunk trained again up to step `upto` into trunk/seed<k>/regenerated (module docstring)."""

    upto: int = 0

    @property
    def label(self) -> str:
        return f"{TRUNK}/seed{self.seed}/{REGENERATED}"

    def config_args(self, overrides: list[str]) -> list[str]:
        return [*super().config_args(overrides), _set("steps", self.upto)]


def normalize(raw: dict, where: str) -> dict:
    """A branch stage's table checked, with `steps` (the trunk's: the last branch step) filled in; a
    ValueError of one line names the first bad entry."""
    if "steps" in raw or "gate" in raw:
        raise ValueError(
            f"{where}: a branch stage sets no steps (its trunk trains to the last of branch_steps), no gate"
        )
    steps, length = raw["branch_steps"], raw["branch_length"]
    if (
        not isinstance(steps, list)
        or not steps
        or not all(isinstance(s, int) and s >= 1 for s in steps)
        or steps != sorted(set(steps))
    ):
        raise ValueError(f"{where}: branch_steps is an ascending list of distinct trunk steps >= 1")
    if not isinstance(length, int) or length < 1:
        raise ValueError(f"{where}: branch_length (updates per branch) is an integer >= 1")
    arms = raw.get("arms") if isinstance(raw.get("arms"), dict) else {}
    if raw["trunk_arm"] not in arms or TRUNK in arms:
        raise ValueError(f"{where}: trunk_arm is one of the arms, and no arm is called {TRUNK!r}")
    _check_arm_branch_steps(raw.get("arm_branch_steps", {}), arms, steps, raw["baseline"], where)
    return {**raw, "steps": steps[-1]}


def _check_arm_branch_steps(table, arms: dict, steps: list[int], baseline: str, where: str) -> None:
    """arm_branch_steps names arms of the stage (not the baseline, which every branch is paired with), each
    with a non-empty ascending subset of branch_steps."""
    if not isinstance(table, dict):
        raise ValueError(f"{where}: arm_branch_steps is a table {{arm = [branch steps]}}")
    for arm, subset in table.items():
        if arm not in arms or arm == baseline:
            raise ValueError(
                f"{where}: arm_branch_steps names {arm!r}, not one of the arms other than the baseline"
            )
        if (
            not isinstance(subset, list)
            or not subset
            or subset != sorted(set(subset))
            or set(subset) - set(steps)
        ):
            raise ValueError(
                f"{where}: arm_branch_steps.{arm} is an ascending, non-empty subset of branch_steps"
            )


def steps_of(stage, arm: str) -> tuple[int, ...]:
    """The trunk steps `arm` branches at: its arm_branch_steps entry, else every branch step."""
    return tuple(stage.options.arm_branch_steps.get(arm, stage.options.branch_steps))


def stage_specs(stage, common: list[str]) -> list[runner.RunSpec]:
    """The trunks, then per seed, per arm, its branches (early first): an arm's branches follow each other,
    so a call compiles its step once for both (the compiled program does not depend on the branch step)."""
    opts = stage.options
    keep = ",".join(str(s) for s in opts.branch_steps)
    trunk = runner.Rung(
        TRUNK,
        stage.config,
        (*common, _set("recipe", stage.arms[opts.trunk_arm]), _set("keep_checkpoint_steps", f"({keep},)")),
    )
    specs: list[runner.RunSpec] = runner.plan([trunk], list(stage.seeds), None)
    for seed in stage.seeds:
        for arm, recipe in stage.arms.items():
            for at in steps_of(stage, arm):
                overrides = (*common, _set("recipe", recipe), _set("steps", at + opts.branch_length))
                specs.append(BranchRun(runner.Rung(f"{arm}/at{at}", stage.config, overrides), seed, at=at))
    return specs


def _set(key: str, value) -> str:
    return f"--config.{key}={value}"


def span(spec: runner.RunSpec, stage) -> tuple[int, int]:
    """(first, last) step of a run: a branch's trunk step and that + branch_length; else 0 and the stage's
    steps."""
    if isinstance(spec, BranchRun):
        return spec.at, spec.at + stage.options.branch_length
    if isinstance(spec, TrunkRegeneration):
        return 0, spec.upto
    return 0, stage.steps


def default_minutes(stage, first: int, last: int) -> float:
    """A run's expected wall time before any was measured: run_minutes per branch_length updates."""
    return stage.run_minutes * (last - first) / stage.options.branch_length


def _has_checkpoint(run_dir: str, step: int) -> bool:
    """The run's checkpoint at `step` is saved and its manifest written (so it is complete)."""
    step_dir = os.path.join(run_dir, "checkpoints", str(step))
    return os.path.isdir(step_dir) and integrity.has_manifest(step_dir)


def _repeats(trunk: str, copy: str, upto: int) -> int | None:
    """None when `copy` logged every training update of `trunk` up to `upto` with the same REPEATED_KEYS,
    bit for bit; else the first step that differs (or is missing)."""

    def updates(run_dir):
        records = runs.read_records(run_dir)
        return {r["step"]: tuple(r.get(k) for k in REPEATED_KEYS) for r in records if "loss" in r}

    want, got = updates(trunk), updates(copy)
    steps = sorted(s for s in want if s <= upto)
    if not steps or steps[-1] < upto:
        return steps[-1] + 1 if steps else 1  # the trunk's own log does not reach the branch step
    return next((s for s in steps if got.get(s) != want[s]), None)


def start_point(spec: BranchRun, sroot: str) -> str | None:
    """Where a branch starts: its trunk's directory if it holds the checkpoint, else the regenerated copy's
    if that holds it and repeated the trunk (identity.json), else None."""
    trunk = trunk_dir(sroot, spec.seed)
    if _has_checkpoint(trunk, spec.at):
        return trunk
    copy = os.path.join(trunk, REGENERATED)
    identity = runs.read_json(os.path.join(copy, "identity.json")) or {}
    if _has_checkpoint(copy, spec.at) and identity.get(str(spec.at), {}).get("first_difference", 0) is None:
        return copy
    return None


def _check_regenerated(trunk: str, at: int, log) -> None:
    """Records in regenerated/identity.json whether the copy repeated the trunk up to `at`."""
    copy = os.path.join(trunk, REGENERATED)
    path = os.path.join(copy, "identity.json")
    identity = runs.read_json(path) or {}
    if str(at) in identity or not _has_checkpoint(copy, at):
        return
    first = _repeats(trunk, copy, at)
    identity[str(at)] = {"first_difference": first, "compared": list(REPEATED_KEYS)}
    runs.write_json(path, identity)
    if first is not None:
        log(
            f"study: {os.path.relpath(copy)} differs from its trunk from step {first}: its branches from "
            f"step {at} wait (run the trunk's set-up exactly: the same flags, XLA_FLAGS and GPU sharing)"
        )


def _regenerations(trunks, pending: list[BranchRun], sroot: str) -> list[TrunkRegeneration]:
    """A regeneration per finished trunk whose checkpoint some pending branch needs and neither the trunk
    nor its copy holds (a copy that holds it but did not repeat the trunk is not tried again); a copy
    lacking it is removed first (it is scratch)."""
    out = []
    for trunk in trunks:
        tdir = trunk_dir(sroot, trunk.seed)
        copy = os.path.join(tdir, REGENERATED)
        needed = [
            b.at
            for b in pending
            if b.seed == trunk.seed and start_point(b, sroot) is None and not _has_checkpoint(copy, b.at)
        ]
        if not needed or runs.run_status(tdir) not in runs.FINISHED:
            continue  # an unfinished trunk runs in the first phase; a failed or diverged one has no branches
        if os.path.isdir(copy):
            shutil.rmtree(copy)
        out.append(TrunkRegeneration(trunk.rung, trunk.seed, trunk.lr, upto=max(needed)))
    return out


def phases(specs: list[runner.RunSpec], sroot: str, arms: list[str] | None, log):
    """The stage's runs in three phases, yielded in turn (each chosen after the one before has run): the
    trunks (always: every branch needs one), the regenerations of finished trunks whose checkpoints are
    gone, then the branches of the named arms (all when None) that have a start point; the others are
    logged as waiting."""
    trunks = [s for s in specs if not isinstance(s, BranchRun)]
    yield trunks
    chosen = [s for s in specs if isinstance(s, BranchRun) and not (arms and arm_of(s) not in arms)]
    pending = [s for s in chosen if not runs.is_finished(s.directory(sroot))]
    _check_copies(trunks, pending, sroot, log)
    yield _regenerations(trunks, pending, sroot)
    _check_copies(trunks, pending, sroot, log)
    ready = []
    for spec in chosen:
        if spec not in pending or start_point(spec, sroot) is not None:
            ready.append(spec)
        else:
            log(f"study: {spec.label} waits: its trunk has no checkpoint at step {spec.at} yet")
    yield ready


def _check_copies(trunks, pending: list[BranchRun], sroot: str, log) -> None:
    for at in sorted({b.at for b in pending}):
        for trunk in trunks:
            _check_regenerated(trunk_dir(sroot, trunk.seed), at, log)


# ------------------------------------------------------------------------------------------ the design


@dataclasses.dataclass(frozen=True)
class BranchOptions:
    trunk_arm: str
    branch_steps: tuple[int, ...]
    branch_length: int
    arm_branch_steps: dict[str, tuple[int, ...]] = dataclasses.field(default_factory=dict)


class Branch:
    """The design's hooks (plan.Design)."""

    name = "branch"
    keys = frozenset(KEYS)
    optional_keys = frozenset(OPTIONAL_KEYS)
    implied = frozenset({"steps"})  # the trunk's: the last branch step

    def options(self, raw: dict, where: str, earlier: list[Stage]) -> tuple[BranchOptions, dict]:
        raw = normalize(raw, where)
        options = BranchOptions(
            trunk_arm=raw["trunk_arm"],
            branch_steps=tuple(raw["branch_steps"]),
            branch_length=int(raw["branch_length"]),
            arm_branch_steps={arm: tuple(at) for arm, at in raw.get("arm_branch_steps", {}).items()},
        )
        return options, {"steps": raw["steps"]}

    def specs(self, stage: Stage, common: list[str]) -> list[runner.RunSpec]:
        return stage_specs(stage, common)

    def phases(self, stage: Stage, specs, sroot: str, arms, log):
        return phases(specs, sroot, arms, log)

    def span(self, spec: runner.RunSpec, stage: Stage) -> tuple[int, int]:
        return span(spec, stage)

    def default_minutes(self, stage: Stage, first: int, last: int) -> float:
        return default_minutes(stage, first, last)

    def report(self, stage: Stage, plan, root: str, out: str | None, target: str, emit) -> dict:
        """<stage>.md/.json/.png (branch_analysis) and, when its arms make any of the plan's contrasts,
        the claims per branch step: {"branched at <step>": analysis} for the steps whose contrasts are
        estimable."""
        sroot = stage_root(root, stage)
        result = branch_analysis.analyze(sroot, stage)

        def draw(base: str) -> list[str]:
            plots.plot_branches(result, base + ".png")
            return [base + ".png"]

        report.write(_base(out, stage.name), branch_analysis.to_markdown(result), result, draw, emit)
        if plan.claims is None:
            return {}
        hypotheses = claims.Hypotheses.from_plan(plan)
        if not any(set(w) <= set(stage.arms) for w in hypotheses.contrasts.values()):
            return {}
        estimable = {}
        for at in stage.options.branch_steps:
            found = branch_analysis.branch_runs(sroot, stage, at)
            cells, _, _ = claims.primary_cells(found, claims.DEFAULT_LAST_K)
            if not any(arm == stage.baseline for arm, _ in cells):
                continue  # no baseline branch from this step has ended yet
            claimed = claims.analyze(
                found,
                stage.baseline,
                list(stage.arms),
                claims.DEFAULT_LAST_K,
                hypotheses,
                stage.seeds,
                trunk_tokens=branch_analysis.trunk_tokens(found, at),
            )
            text = f"Branched at step {at} (rows: arms; blocks: trunks).\n\n" + claims.to_markdown(claimed)
            figure = report.claims_figure(claimed, hypotheses)
            report.write(_base(out, f"{stage.name}_claims_at{at}"), text, claimed, figure, emit)
            if claimed["df"] > 0:
                estimable[f"branched at {at}"] = claimed
        return estimable


def _base(out: str | None, name: str) -> str | None:
    return None if out is None else os.path.join(out, name)


DESIGN = Branch()
