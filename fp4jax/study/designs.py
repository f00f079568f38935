"""The table of a study's designs: a plan file's `design = "<name>"` picks one. A new design is one module
with an object of the plan.Design interface (keys, runs, phases, report) and one entry here."""

from __future__ import annotations

from fp4jax.study import branching, scratch
from fp4jax.study.plan import Design, Plan
from fp4jax.study.plan import load_plan as _load_plan

__all__ = ["DESIGNS", "load_plan"]

DESIGNS: dict[str, Design] = {
    scratch.DESIGN.name: scratch.DESIGN,  # every arm from scratch, seeds shared (fp4jax.study.scratch)
    branching.DESIGN.name: branching.DESIGN,  # every arm branched from shared trunks (fp4jax.study.branching)
}


def load_plan(path: str) -> Plan:
    """The plan file at `path`, its stages' designs looked up in DESIGNS (plan.load_plan)."""
    return _load_plan(path, DESIGNS)
