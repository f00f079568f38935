"""python -m fp4jax.study run|report|instruments: the study's plan file run within a GPU-time budget per
call, its report regenerated from whatever runs exist (fp4jax.study.plan), and the mechanism instruments
on a run's checkpoints (fp4jax.study.instruments).

    python -m fp4jax.study run --plan fp4jax/study/plans/proxy125m.toml --root runs/study \
        --budget-minutes 9 [--parallel 2 --gpus 0,0] [--stage calibration] [--set data.path=DIR ...]
    python -m fp4jax.study report --plan fp4jax/study/plans/proxy125m.toml --root runs/study --out DIR
    python -m fp4jax.study instruments --run RUN_DIR [--steps 250,500,1000] --out DIR \
        [--stages fprop,dgrad,wgrad] [--batches 4] [--batch B] [--seq-len T] [--data config|bundled|synthetic]

`run` never reruns a finished run; a run the budget stops saves a checkpoint and the next call resumes
it. Exit code 0 when the call ends (whatever the runs' outcomes), 2 for bad input, 130 when interrupted.
`report` writes DIR/<stage>.md/.json/.png (fp4jax.study.report; with each run's loss spikes for a stage
that sets count_spikes), DIR/<stage>_gate.json for a gated stage, DIR/lr_stress_<reference>.md/.json for
each LR series (fp4jax.study.lr_stress: the stages that name a reference stage as their 1x point), and
DIR/claims.md/.json/.png: the pre-registered contrasts and the verdict per claim (fp4jax.study.claims;
the LR series' stress stages, at other LRs, are not in it); for a branch stage, DIR/<stage>.md/.json/
.png (the differences against tokens) and, when its arms make any of the contrasts,
DIR/<stage>_claims_at<step>.md/.json/.png: the same analysis per branch point, trunks as blocks
(docs/study_plan.md).
`instruments` writes DIR/instruments.json, instruments.txt and instruments_<stage>.png
(docs/diagnostics.md, Mechanism instruments).
"""

from __future__ import annotations

import argparse
import json
import os
import sys

from fp4jax.report_files import write_json
from fp4jax.study import analysis, branching, claims, lr_stress, plan, plots, records, report
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
        seeds=args.seed or None,
        overrides=overrides,
        log=lambda line: print(line, flush=True),
    )
    write_progress(the_plan, args.root, None)  # what is left after this call


def cmd_report(args) -> None:
    the_plan = plan.load_plan(args.plan)
    designs = {}  # "branched at N" -> the claims' analysis of that branch point
    for stage in the_plan.stages:
        sroot = plan.stage_root(args.root, stage)
        if not os.path.isdir(sroot):
            print(f"study: stage {stage.name}: not run (no runs yet)")
            continue
        if stage.design == "branch":
            designs.update(_branch_report(stage, sroot, args.out))
            continue
        result = analysis.analyze(analysis.load_runs(sroot), stage.baseline, args.target, list(stage.arms))
        if stage.count_spikes is not None:
            result["spikes"] = lr_stress.stage_spikes(args.root, stage)
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
    write_lr_series(the_plan, args.root, args.out)
    scratch = write_claims(the_plan, args.root, args.out)
    if scratch is not None:
        designs = {"from scratch": scratch, **designs}
    if args.out and len(designs) > 1:
        path = os.path.join(args.out, "claims_by_design.png")
        claims.design_forest_plot(designs, path)
        print(f"wrote {path}")
    write_progress(the_plan, args.root, args.out)


def write_progress(the_plan, root: str, out: str | None) -> None:
    """Where the plan stands, stage by stage (plan.progress): progress.md and .json."""
    rows = plan.progress(the_plan, root)
    text = plan.progress_markdown(rows)
    print(text)
    if out:
        _write_md_json(os.path.join(out, "progress"), text, {"stages": rows})


def write_lr_series(the_plan, root: str, out: str | None) -> None:
    """Each LR series (lr_stress.series) whose stages have any run: printed, and DIR/lr_stress_<reference>
    .md, .json and .png (plots.plot_lr_series); its points without runs read "not run"."""
    for reference in lr_stress.references(the_plan):
        stages = [s for s in the_plan.stages if reference in (s.name, s.lr_reference)]
        if not any(os.path.isdir(plan.stage_root(root, s)) for s in stages):
            print(f"study: LR series of {reference}: not run (no runs yet)")
            continue
        result = lr_stress.series(the_plan, root, reference)
        text = lr_stress.series_markdown(result)
        print(text)
        if out:
            base = os.path.join(out, f"lr_stress_{reference}")
            _write_md_json(base, text, result)
            plots.plot_lr_series(result, base + ".png")


def write_claims(the_plan, root: str, out: str | None) -> dict | None:
    """The pre-registered analysis over every paired from-scratch stage with the first one's baseline and
    back end (their seeds are shared, so the arms of all of them enter one arm x seed table; a run reused
    by several stages counts once); returned, None without such stages."""
    stages = [
        s
        for s in the_plan.stages
        if s.design == "scratch_paired" and s.lr_reference is None and os.path.isdir(plan.stage_root(root, s))
    ]
    # A check that reruns a cell under another back end or against another baseline (backend_check) is
    # not a block of the claims' design: only the stages sharing the first one's are pooled.
    stages = [s for s in stages if (s.baseline, s.backend) == (stages[0].baseline, stages[0].backend)]
    if not stages:
        return None
    seen, pooled, arms = set(), [], []
    for stage in stages:
        arms += [a for a in stage.arms if a not in arms]
        for run in analysis.load_runs(plan.stage_root(root, stage)):
            if (run.rung, run.seed) not in seen:
                seen.add((run.rung, run.seed))
                pooled.append(run)
    last_k = next((s.gate["last_evals"] for s in stages if s.gate), claims.DEFAULT_LAST_K)
    seeds = sorted(set().union(*(s.seeds for s in stages)))
    result = claims.analyze(pooled, stages[0].baseline, arms, last_k, seeds=seeds)
    print(claims.to_markdown(result))
    if out:
        base = os.path.join(out, "claims")
        with open(base + ".md", "w", encoding="utf-8") as f:
            f.write(claims.to_markdown(result))
        write_json(result, base + ".json")
        claims.forest_plot(result, base + ".png")
        print(f"wrote {base}.md, .json and .png")
    return result


def _int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of steps") from None


def cmd_instruments(args) -> None:
    from fp4jax.study import instruments  # jax and the model: only this command needs them

    result = instruments.run_instruments(
        args.run,
        steps=args.steps,
        stages=[s for s in args.stages.split(",") if s],
        n_batches=args.batches,
        accumulate=args.accumulate,
        batch=args.batch,
        seq_len=args.seq_len,
        data=args.data,
        log=lambda line: print(line, file=sys.stderr, flush=True),
    )
    print(instruments.table(result))
    for path in instruments.write(result, args.out):
        print(f"wrote {path}")


def _branch_report(stage, sroot: str, out: str | None) -> dict:
    """A branch stage's differences at fixed tokens (fp4jax.study.branching): DIR/<stage>.md and .json;
    for a stage whose arms make any pre-registered contrast (its family: the contrasts it plans), also
    the claims per branch step, returned as {"branched at <step>": analysis} for the steps whose
    contrasts are estimable."""
    estimable = {}
    result = branching.analyze(sroot, stage)
    text = branching.to_markdown(result)
    print(text)
    if out:
        _write_md_json(os.path.join(out, stage.name), text, result)
        plots.plot_branches(result, os.path.join(out, stage.name + ".png"))
    if not any(set(w) <= set(stage.arms) for w in claims.CONTRASTS.values()):
        return estimable
    for at in stage.branch_steps:
        found = branching.branch_runs(sroot, stage, at)
        cells, _, _ = claims.primary_cells(found, claims.DEFAULT_LAST_K)
        if not any(arm == stage.baseline for arm, _ in cells):
            continue  # no baseline branch from this step has ended yet
        claimed = claims.analyze(
            found,
            stage.baseline,
            list(stage.arms),
            claims.DEFAULT_LAST_K,
            stage.seeds,
            trunk_tokens=branching.trunk_tokens(found, at),
        )
        text = f"Branched at step {at} (rows: arms; blocks: trunks).\n\n" + claims.to_markdown(claimed)
        print(text)
        if out:
            base = os.path.join(out, f"{stage.name}_claims_at{at}")
            _write_md_json(base, text, claimed)
            claims.forest_plot(claimed, base + ".png")
        if claimed["df"] > 0:
            estimable[f"branched at {at}"] = claimed
    return estimable


def cmd_records(args) -> int:
    """Packs a runs root into its records, or unpacks records into a runs root (study.records)."""
    if args.action == "pack":
        written = records.pack(args.root, args.records, args.stage or None)
        print(f"wrote {len(written)} archive(s) in {args.records}" + "".join(f"\n  {p}" for p in written))
    else:
        if args.stage:
            raise ValueError("--stage applies to pack only: unpack extracts every archive")
        files = records.unpack(args.records, args.root)
        print(f"unpacked {len(files)} files of {args.records} under {args.root}")
    return 0


def _write_md_json(base: str, text: str, result: dict) -> None:
    """BASE.md (the text) and BASE.json (the result), the directory made first."""
    os.makedirs(os.path.dirname(base) or ".", exist_ok=True)
    with open(base + ".md", "w", encoding="utf-8") as f:
        f.write(text)
    write_json(result, base + ".json")
    print(f"wrote {base}.md and {base}.json")


def _summary(doc: str) -> str:
    """The docstring's first paragraph as one line: --help's description (argparse re-wraps it)."""
    return " ".join(doc.split("\n\n")[0].split())


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fp4jax.study", description=_summary(__doc__))
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="run what is not done, within the budget", allow_abbrev=False)
    run_p.add_argument("--budget-minutes", type=float, required=True, help="wall minutes this call holds")
    run_p.add_argument("--parallel", type=int, default=1, help="runs at once")
    run_p.add_argument("--gpus", default=None, help="GPU ids, one per parallel slot (0,0: two on GPU 0)")
    run_p.add_argument("--stage", action="append", default=[], help="only this stage (repeatable)")
    run_p.add_argument("--arm", action="append", default=[], help="only this arm now (repeatable)")
    run_p.add_argument(
        "--seed", action="append", type=int, default=[], help="only this seed (trunk) now (repeatable)"
    )
    run_p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    rep_p = sub.add_parser("report", help="tables, plots and the gate from the runs", allow_abbrev=False)
    rep_p.add_argument("--out", default=None, help="directory for <stage>.md/.json/.png and gates")
    rep_p.add_argument("--target", default="config", help="config, auto[+MARGIN], or a loss in nats")
    ins_p = sub.add_parser(
        "instruments", help="gradient and update errors of one MXFP4 stage at a time", allow_abbrev=False
    )
    ins_p.add_argument("--run", required=True, help="a run directory (it holds checkpoints/)")
    ins_p.add_argument("--steps", type=_int_list, default=None, help="checkpoint steps (default: all)")
    ins_p.add_argument("--out", required=True, help="directory for instruments.json/.txt/_<stage>.png")
    ins_p.add_argument("--stages", default="fprop,dgrad,wgrad", help="GEMM stages, one in MXFP4 at a time")
    ins_p.add_argument("--batches", type=int, default=4, help="K disjoint batches (even)")
    ins_p.add_argument("--accumulate", type=int, default=1, help="micro-batches averaged per batch (A)")
    ins_p.add_argument("--batch", type=int, default=None, help="sequences per batch (default: global_batch)")
    ins_p.add_argument("--seq-len", type=int, default=None, help="tokens per sequence (default: the run's)")
    ins_p.add_argument("--data", default="config", help="config, bundled or synthetic (as fp4jax.diagnose)")
    rec_p = sub.add_parser(
        "records", help="pack runs into records/<study>/<stage>.tar.xz, or unpack them", allow_abbrev=False
    )
    rec_p.add_argument("action", choices=("pack", "unpack"))
    rec_p.add_argument("records", help="the records directory (records/<study>)")
    rec_p.add_argument("--root", required=True, help="the runs' root (pack reads it, unpack fills it)")
    rec_p.add_argument("--stage", action="append", default=[], help="pack only this stage (repeatable)")
    for p in (run_p, rep_p):
        p.add_argument("--plan", required=True, help="a plan file (fp4jax/study/plans/*.toml)")
        p.add_argument("--root", required=True, help="the runs' root directory")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    commands = {"run": cmd_run, "report": cmd_report, "instruments": cmd_instruments, "records": cmd_records}
    return run_command(lambda: commands[args.command](args), "study")


if __name__ == "__main__":
    sys.exit(main())
