"""The from-scratch paired design (design = "scratch_paired"): every arm trained from scratch with the
stage's seeds, so that an arm's run of seed k shares its initialisation and data order with every other
arm's (a seed is a block of the paired model).

Stage keys beside the common ones (fp4jax.study.plan): optional `count_spikes = {spike_nats = NATS,
window = UPDATES}` (the report counts each run's loss spikes by that rule: fp4jax.study.lr_stress) and
`lr_reference` (an earlier scratch_paired stage with its arms, recipes, seeds, config, horizon, warm-up,
back end and baseline at another peak LR: its runs are the series' 1x point; it needs count_spikes).

Runs: ROOT/<stage>/<arm>/seed<k>/, seed-major (every arm's seed 0 before any seed 1), one phase.
Report: <stage>.md/.json and its figures (analysis.analyze, tables, plots.plot_all), with the runs' loss
spikes for a stage that counts them, and <stage>_gate.json for a gated stage (fp4jax.study.gate).
"""

from __future__ import annotations

import dataclasses
import json

from fp4jax.study import analysis, lr_stress, plots, report, runner, tables
from fp4jax.study.gate import gate_result
from fp4jax.study.lr_stress import SPIKE_KEYS, reference_of
from fp4jax.study.plan import Stage, stage_root

__all__ = ["DESIGN", "SAME_AS_REFERENCE", "ScratchOptions", "ScratchPaired"]

# What a stage shares with its lr_reference (the same runs but for the peak LR and the overrides).
SAME_AS_REFERENCE = ("design", "config", "baseline", "steps", "warmup_steps", "backend")


@dataclasses.dataclass(frozen=True)
class ScratchOptions:
    count_spikes: dict | None = None  # {spike_nats, window}: the report counts each run's loss spikes
    lr_reference: str | None = None  # the earlier stage whose runs are this one's 1x LR point


class ScratchPaired:
    """The design's hooks (plan.Design)."""

    name = "scratch_paired"
    keys = frozenset()
    optional_keys = frozenset({"count_spikes", "lr_reference"})
    implied = frozenset()

    def options(self, raw: dict, where: str, earlier: list[Stage]) -> tuple[ScratchOptions, dict]:
        spikes = _count_spikes(raw.get("count_spikes"), where)
        checked = {**raw, "count_spikes": spikes, "lr_reference": raw.get("lr_reference")}
        _check_lr_reference(checked, earlier, where)
        return ScratchOptions(spikes, raw.get("lr_reference")), {}

    def specs(self, stage: Stage, common: list[str]) -> list[runner.RunSpec]:
        """Arm = the config with its recipe and the stage's common overrides; seed-major."""
        rungs = [
            runner.Rung(arm, stage.config, (*common, f"--config.recipe={recipe}"))
            for arm, recipe in stage.arms.items()
        ]
        return runner.plan(rungs, list(stage.seeds), None)

    def phases(self, stage: Stage, specs, sroot: str, arms, log):
        return [[spec for spec in specs if not arms or spec.rung.name in arms]]

    def span(self, spec: runner.RunSpec, stage: Stage) -> tuple[int, int]:
        return 0, stage.steps

    def default_minutes(self, stage: Stage, first: int, last: int) -> float:
        """run_minutes per run of the stage's steps."""
        return stage.run_minutes * (last - first) / stage.steps

    def report(self, stage: Stage, plan, root: str, out: str | None, target: str, emit) -> dict:
        """<stage>.md/.json/.png (and _overhead, _lr, _diagnostics figures), <stage>_gate.json; its claims
        are pooled with the other from-scratch stages' (report.write_claims), so none are returned."""
        result = analysis.analyze(
            analysis.load_runs(stage_root(root, stage)), stage.baseline, target, list(stage.arms)
        )
        if stage.options.count_spikes is not None:
            result["spikes"] = lr_stress.stage_spikes(root, stage)
        base = None if out is None else f"{out}/{stage.name}"
        report.write(base, tables.to_markdown(result), result, lambda b: plots.plot_all(result, b), emit)
        if stage.gate is not None:
            gate = gate_result(root, stage)
            emit(f"gate of {stage.name}: " + json.dumps(gate, sort_keys=True))
            if out:
                report.write_json(f"{out}/{stage.name}_gate.json", gate, emit)
        return {}


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


def _check_lr_reference(stage: dict, earlier: list[Stage], where: str) -> None:
    """A stage's lr_reference names an earlier stage that runs this stage's runs but for the peak LR (and
    the overrides, e.g. the trainer's divergence rule): SAME_AS_REFERENCE, the arms with their recipes
    and the seeds; the stage counts spikes, and every stage of one reference (one LR series) has the same
    arms, seeds and count_spikes."""
    if stage["lr_reference"] is None:
        return
    ref = next((s for s in earlier if s.name == stage["lr_reference"]), None)
    if ref is None or ref.design != "scratch_paired" or stage["count_spikes"] is None:
        name = stage["lr_reference"]
        raise ValueError(f"{where}: lr_reference {name!r} must be an earlier stage, with count_spikes set")
    same = all(getattr(ref, key) == stage[key] for key in SAME_AS_REFERENCE)
    arms = all(ref.arms.get(arm) == recipe for arm, recipe in stage["arms"].items())
    if not (same and arms and set(stage["seeds"]) <= set(ref.seeds)) or ref.peak_lr == stage["peak_lr"]:
        raise ValueError(
            f"{where}: lr_reference {ref.name!r} must have this stage's arms (same recipes), seeds, "
            f"{', '.join(SAME_AS_REFERENCE)} at another peak_lr"
        )
    sibling = next((s for s in earlier if reference_of(s) == ref.name), None)
    if sibling and (
        sibling.arms != stage["arms"]
        or sibling.seeds != tuple(stage["seeds"])
        or sibling.options.count_spikes != stage["count_spikes"]
    ):
        shared = ("arms", "seeds", "count_spikes")
        raise ValueError(f"{where}: the stages of lr_reference {ref.name!r} share {', '.join(shared)}")


DESIGN = ScratchPaired()
