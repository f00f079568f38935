"""The pipeline's first layer: a study as data, the TOML plan file and its parsing.

    python -m fp4jax.study run --plan fp4jax/study/plans/proxy125m.toml --root runs/study --budget-minutes 9
    python -m fp4jax.study report --plan fp4jax/study/plans/proxy125m.toml --root runs/study --out DIR

The plan file: top-level `name`, then `[[stages]]` in the order they run, each with `name`, `design` (a
name of fp4jax.study.designs.DESIGNS: "scratch_paired", every arm from scratch with the same seeds, so
init and data order are shared by all arms; "branch", every arm branched from shared trunks), `config`
(a set-up's config file), `arms` ({arm name: recipe preset}, in report order), `baseline` (an arm),
`seeds`, `steps`, `warmup_steps`, `peak_lr`, `backend` (a GEMM back end or "auto"), `run_minutes` (one
run's expected wall time, used until runs of the stage measured it), optional `overrides` ({dotted config
key: value}), `requires` (stages that must be complete and, if gated, passed) and `gate` (the pass rule:
fp4jax.study.gate), and the keys of its design (each design's module lists them).

The claims the study tests are data too: a top-level `[claims]` table (fp4jax.study.claims reads it:
the Holm family of contrasts, the reported and derived ones, the family's arms, each hypothesis's text
and thresholds), or `claims_from = "<plan file>"` (relative to this file's directory) for a plan that
tests another plan's claims. A plan with neither has no claims analysis.

Run layout: ROOT/<stage>/<arm>/seed<k>/ (fp4jax.study.runs), so each stage is a ladder root of its own;
a design may lay its runs out otherwise (branch: ROOT/<stage>/trunk/seed<k>/, <arm>/at<step>/seed<k>/).

A design is an object with the interface `Design` below; the plan stores it with each stage
(`Stage.design_impl`), so the layers that run and report a stage reach its design without importing
the table (which sits above them).
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Iterable, Mapping
from typing import Protocol

from fp4jax.study import runner

__all__ = [
    "BACKENDS",
    "BACKEND_ENV",
    "COMMON_KEYS",
    "GATE_KEYS",
    "Design",
    "Plan",
    "Stage",
    "common_overrides",
    "load_plan",
    "stage_root",
    "stage_specs",
]

COMMON_KEYS = {
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
}
OPTIONAL_KEYS = {"overrides", "requires", "gate"}
GATE_KEYS = {"arm", "against", "last_evals", "smallest_overhead", "sigmas"}
# The trainer's back ends and the variable that picks one (fp4jax.ops.BACKENDS, training.setup's
# GEMM_BACKEND_ENV; tested equal), restated so that planning imports neither the ops nor the trainer.
BACKENDS = ("auto", "emulate", "fp8", "native")
BACKEND_ENV = "FP4JAX_GEMM_BACKEND"  # see BACKENDS


class Design(Protocol):
    """What the pipeline asks of a design (fp4jax.study.designs.DESIGNS holds one per name).

    keys / optional_keys: the stage keys the design adds; implied: common keys it fills itself (not set in
    the file). `options` checks the raw table and returns the design's own values (Stage.options) and
    the common keys it fills. The schedule calls `specs`, `phases`, `span` and `default_minutes`; the
    report calls `report`."""

    name: str
    keys: frozenset[str]
    optional_keys: frozenset[str]
    implied: frozenset[str]

    def options(self, raw: dict, where: str, earlier: list[Stage]) -> tuple[object, dict]: ...

    def specs(self, stage: Stage, common: list[str]) -> list[runner.RunSpec]: ...

    def phases(self, stage: Stage, specs, sroot: str, arms, log) -> Iterable[list[runner.RunSpec]]: ...

    def span(self, spec: runner.RunSpec, stage: Stage) -> tuple[int, int]: ...

    def default_minutes(self, stage: Stage, first: int, last: int) -> float: ...

    def report(self, stage: Stage, plan: Plan, root: str, out: str | None, target: str, emit) -> dict: ...


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
    options: object = None  # the design's own keys, as its `options` checked them
    design_impl: Design | None = dataclasses.field(default=None, compare=False, repr=False)


@dataclasses.dataclass(frozen=True)
class Plan:
    name: str
    stages: tuple[Stage, ...]
    path: str
    claims: dict | None = None  # the [claims] table (fp4jax.study.claims), None without one

    def stage(self, name: str) -> Stage:
        for s in self.stages:
            if s.name == name:
                return s
        raise ValueError(f"plan {self.name} has no stage {name!r}: its stages are {self.stage_names}")

    @property
    def stage_names(self) -> str:
        return ", ".join(s.name for s in self.stages)


def _read_toml(path: str) -> dict:
    if not os.path.isfile(path):
        raise ValueError(f"plan file {path} does not exist; the committed plans are in fp4jax/study/plans/")
    with open(path, "rb") as f:
        try:
            return tomllib.load(f)
        except tomllib.TOMLDecodeError as exc:
            raise ValueError(f"plan file {path} is not valid TOML: {exc}") from None


def load_plan(path: str, designs: Mapping[str, Design]) -> Plan:
    """The plan in a TOML file, checked against `designs` (fp4jax.study.designs.DESIGNS): a ValueError of
    one line names the first bad entry."""
    data = _read_toml(path)
    stages = data.get("stages")
    if not isinstance(data.get("name"), str) or not isinstance(stages, list) or not stages:
        raise ValueError(f"plan file {path} needs a top-level name and at least one [[stages]] table")
    unknown = set(data) - {"name", "stages", "claims", "claims_from"}
    if unknown:
        raise ValueError(f"plan file {path}: unknown top-level keys {sorted(unknown)}")
    parsed: list[Stage] = []
    for i, raw in enumerate(stages):
        parsed.append(_stage(raw, f"{path}: stage {raw.get('name', i)!r}", parsed, designs))
    return Plan(data["name"], tuple(parsed), path, _claims_table(data, path))


def _claims_table(data: dict, path: str) -> dict | None:
    """The plan's [claims] table, or that of the plan file `claims_from` names (one level, no chains)."""
    if "claims" in data and "claims_from" in data:
        raise ValueError(f"plan file {path}: set [claims] or claims_from, not both")
    if "claims_from" not in data:
        return data.get("claims")
    source = os.path.join(os.path.dirname(path), str(data["claims_from"]))
    table = _read_toml(source).get("claims")
    if not isinstance(table, dict):
        raise ValueError(f"plan file {path}: claims_from {data['claims_from']!r} has no [claims] table")
    return table


def _stage(raw: dict, where: str, earlier: list[Stage], designs: Mapping[str, Design]) -> Stage:
    design = designs.get(raw.get("design"))
    if design is None:
        raise ValueError(f"{where}: design {raw.get('design')!r} is not one of {', '.join(designs)}")
    every = COMMON_KEYS | set().union(*(d.keys | d.optional_keys for d in designs.values()))
    known = COMMON_KEYS | design.keys | design.optional_keys
    required = (COMMON_KEYS - OPTIONAL_KEYS - design.implied) | design.keys
    unknown, missing = set(raw) - known, required - set(raw)
    if unknown or missing:
        what = f"unknown keys {sorted(unknown)}" if unknown else f"missing keys {sorted(missing)}"
        raise ValueError(f"{where}: {what}; a stage has {', '.join(sorted(every))}")
    if raw["name"] in [s.name for s in earlier] or not str(raw["name"]).isidentifier():
        raise ValueError(f"{where}: a stage name is a unique identifier")
    options, filled = design.options(raw, where, earlier)
    raw = {**raw, **filled}
    _check_common(raw, where, [s.name for s in earlier])
    gate = raw.get("gate")
    return Stage(
        name=raw["name"],
        design=raw["design"],
        config=raw["config"],
        arms=dict(raw["arms"]),
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
        options=options,
        design_impl=design,
    )


def _check_common(raw: dict, where: str, earlier: list[str]) -> None:
    """The keys every design shares, checked (after the design filled the ones it implies)."""
    if raw["backend"] not in BACKENDS:
        raise ValueError(f"{where}: backend {raw['backend']!r} is not one of {', '.join(BACKENDS)}")
    arms = raw["arms"]
    if not isinstance(arms, dict) or not arms or raw["baseline"] not in arms:
        raise ValueError(f"{where}: arms is a table {{arm = recipe}} that includes the baseline")
    if not raw["seeds"] or not all(isinstance(s, int) and s >= 0 for s in raw["seeds"]):
        raise ValueError(f"{where}: seeds is a non-empty list of integers >= 0")
    if not (raw["steps"] >= 1 and 0 <= raw["warmup_steps"] < raw["steps"] and raw["peak_lr"] > 0):
        raise ValueError(f"{where}: want steps >= 1, 0 <= warmup_steps < steps and peak_lr > 0")
    for need in raw.get("requires", []):
        if need not in earlier:
            raise ValueError(f"{where}: requires {need!r}, which is not an earlier stage")
    gate = raw.get("gate")
    if gate is not None and (set(gate) != GATE_KEYS or {gate["arm"], gate["against"]} - set(arms)):
        raise ValueError(f"{where}: gate needs exactly {sorted(GATE_KEYS)}, arm and against among the arms")


# ----------------------------------------------------------------------------------- a stage's runs


def _override(key: str, value) -> str:
    text = str(value).lower() if isinstance(value, bool) else str(value)
    return f"--config.{key}={text}"


def common_overrides(stage: Stage) -> list[str]:
    """The trainer overrides every run of the stage shares: its horizon, warm-up, LR and overrides."""
    return [
        _override("steps", stage.steps),
        _override("optimizer.warmup_steps", stage.warmup_steps),
        _override("optimizer.peak_lr", repr(stage.peak_lr)),
        *(_override(k, v) for k, v in stage.overrides.items()),
    ]


def stage_specs(stage: Stage) -> list[runner.RunSpec]:
    """The stage's runs, in the order its design runs them (its `specs`)."""
    return stage.design_impl.specs(stage, common_overrides(stage))


def stage_root(root: str, stage: Stage) -> str:
    return os.path.join(root, stage.name)
