"""python -m fp4jax.study run|report: the study's plan file, run within a GPU-time budget per call, and
its report regenerated from whatever runs exist (fp4jax.study.plan).

    python -m fp4jax.study run --plan fp4jax/study/plans/proxy125m.toml --root runs/study \
        --budget-minutes 9 [--parallel 2 --gpus 0,0] [--stage calibration] [--set data.path=DIR ...]
    python -m fp4jax.study report --plan fp4jax/study/plans/proxy125m.toml --root runs/study --out DIR

`run` never reruns a finished run; a run the budget stops saves a checkpoint and the next call resumes
it. Exit code 0 when the call ends (whatever the runs' outcomes), 2 for bad input, 130 when interrupted.
`report` writes DIR/<stage>.md/.json/.png (fp4jax.study.report) and DIR/<stage>_gate.json for a gated
stage.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from fp4jax.study import analysis, branching, plan, report
from fp4jax.study.command import run_command


def cmd_run(args) -> None:
    the_plan = plan.load_plan(args.plan)
    overrides = ["--config." + kv for kv in args.set]
    for arg in overrides:
        if "=" not in arg or arg.startswith(("--config.seed=", "--config.recipe=")):
            raise ValueError(f"--set {arg[9:]!r}: want KEY=VALUE, not the seed or recipe (the plan's)")
    plan.run_plan(
        the_plan,
        args.root,
        budget_minutes=args.budget_minutes,
        parallel=args.parallel,
        gpus=args.gpus.split(",") if args.gpus else None,
        stages=args.stage or None,
        arms=args.arm or None,
        overrides=overrides,
        log=lambda line: print(line, flush=True),
    )


def cmd_report(args) -> None:
    the_plan = plan.load_plan(args.plan)
    for stage in the_plan.stages:
        sroot = plan.stage_root(args.root, stage)
        if not os.path.isdir(sroot):
            print(f"study: stage {stage.name} has no runs yet")
            continue
        if stage.design == "branch":
            _branch_report(stage, sroot, args.out)
            continue
        result = analysis.analyze(analysis.load_runs(sroot), stage.baseline, args.target, list(stage.arms))
        print(report.to_markdown(result))
        if stage.gate is not None:
            gate = plan.gate_result(args.root, stage)
            print(f"gate of {stage.name}: " + json.dumps(gate, sort_keys=True))
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            for path in report.write(result, os.path.join(args.out, stage.name)):
                print(f"wrote {path}")
            if stage.gate is not None:
                path = os.path.join(args.out, f"{stage.name}_gate.json")
                with open(path, "w", encoding="utf-8") as f:
                    json.dump(gate, f, indent=2, sort_keys=True)
                    f.write("\n")
                print(f"wrote {path}")


def _branch_report(stage, sroot: str, out: str | None) -> None:
    """A branch stage's differences at fixed tokens (fp4jax.study.branching): DIR/<stage>.md and .json."""
    result = branching.analyze(sroot, stage)
    text = branching.to_markdown(result)
    print(text)
    if out:
        os.makedirs(out, exist_ok=True)
        base = os.path.join(out, stage.name)
        with open(base + ".md", "w", encoding="utf-8") as f:
            f.write(text)
        with open(base + ".json", "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1, sort_keys=True)
            f.write("\n")
        print(f"wrote {base}.md and {base}.json")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fp4jax.study", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="run what is not done, within the budget", allow_abbrev=False)
    run_p.add_argument("--budget-minutes", type=float, required=True, help="wall minutes this call holds")
    run_p.add_argument("--parallel", type=int, default=1, help="runs at once")
    run_p.add_argument("--gpus", default=None, help="GPU ids, one per parallel slot (0,0: two on GPU 0)")
    run_p.add_argument("--stage", action="append", default=[], help="only this stage (repeatable)")
    run_p.add_argument("--arm", action="append", default=[], help="only this arm now (repeatable)")
    run_p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    rep_p = sub.add_parser("report", help="tables, plots and the gate from the runs", allow_abbrev=False)
    rep_p.add_argument("--out", default=None, help="directory for <stage>.md/.json/.png and gates")
    rep_p.add_argument("--target", default="config", help="config, auto[+MARGIN], or a loss in nats")
    for p in (run_p, rep_p):
        p.add_argument("--plan", required=True, help="a plan file (fp4jax/study/plans/*.toml)")
        p.add_argument("--root", required=True, help="the runs' root directory")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    return run_command(lambda: cmd_run(args) if args.command == "run" else cmd_report(args), "study")


if __name__ == "__main__":
    sys.exit(main())
