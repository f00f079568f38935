"""python -m fp4jax.study run|report|instruments|records|trend: the study's plan file run within a GPU-time
budget per call (fp4jax.study.schedule), its report regenerated from whatever runs exist
(fp4jax.study.report), the mechanism instruments on a run's checkpoints (fp4jax.instruments), and the
runs' records packed into or unpacked from records/ (fp4jax.study.records), and the scale trend across
settings' claims reports (fp4jax.study.trend). This module only parses
arguments and calls those.

    python -m fp4jax.study run --plan fp4jax/study/plans/proxy125m.toml --root runs/study \
        --budget-minutes 9 [--parallel 2 --gpus 0,0] [--stage calibration] [--set data.path=DIR ...]
    python -m fp4jax.study report --plan fp4jax/study/plans/proxy125m.toml --root runs/study --out DIR
    python -m fp4jax.study instruments --run RUN_DIR [--steps 250,500,1000] --out DIR \
        [--stages fprop,dgrad,wgrad] [--batches 4] [--batch B] [--seq-len T] \
        [--data config|bundled|synthetic|next]
    python -m fp4jax.study records unpack|pack records/study125m --root runs/study [--stage NAME]

`run` never reruns a finished run; a run the budget stops saves a checkpoint and the next call resumes
it. Exit code 0 when the call ends (whatever the runs' outcomes), 2 for bad input, 130 when interrupted.
`report` writes DIR/<stage>.md/.json/.png (fp4jax.study.scratch; with each run's loss spikes for a stage
that sets count_spikes), DIR/<stage>_gate.json for a gated stage, DIR/lr_stress_<reference>.md/.json for
each LR series (fp4jax.study.lr_stress: the stages that name a reference stage as their 1x point), and
DIR/claims.md/.json/.png: the pre-registered contrasts and the verdict per claim (fp4jax.study.claims;
the LR series' stress stages, at other LRs, are not in it); for a branch stage, DIR/<stage>.md/.json/
.png (the differences against tokens) and, when its arms make any of the contrasts,
DIR/<stage>_claims_at<step>.md/.json/.png: the same analysis per branch point, trunks as blocks
(fp4jax.study.branching, docs/study_plan.md); DIR/progress.md/.json.
`instruments` writes DIR/instruments.json, instruments.txt and instruments_<stage>.png
(docs/diagnostics.md, Mechanism instruments). `records unpack` extracts every records/<study>/<stage>.tar.xz
under --root; `records pack` writes them from --root's record files (no checkpoints).
"""

from __future__ import annotations

import argparse
import sys

from fp4jax.study import designs, records, report, schedule, trend
from fp4jax.study.command import run_command


def cmd_run(args) -> None:
    the_plan = designs.load_plan(args.plan)
    overrides = ["--config." + kv for kv in args.set]
    for arg in overrides:
        if "=" not in arg or arg.startswith(("--config.seed=", "--config.recipe=")):
            raise ValueError(f"--set {arg[9:]!r}: want KEY=VALUE, not the seed or recipe (the plan's)")
    schedule.run_plan(
        the_plan,
        args.root,
        budget_minutes=args.budget_minutes,
        parallel=args.parallel,
        gpus=args.gpus.split(",") if args.gpus else None,
        stages=args.stage or None,
        arms=args.arm or None,
        seeds=args.seed or None,
        overrides=overrides,
        retry_failed=args.retry_failed,
        log=report.emit_print,
    )
    report.write_progress(the_plan, args.root, None)  # what is left after this call


def cmd_report(args) -> None:
    report.report_plan(designs.load_plan(args.plan), args.root, args.out, args.target)


def cmd_instruments(args) -> None:
    from fp4jax import instruments  # jax and the model: only this command needs them

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


def cmd_records(args) -> None:
    """Packs a runs root into its records, or unpacks records into a runs root (study.records)."""
    if args.action == "pack":
        written = records.pack(args.root, args.records, args.stage or None)
        print(f"wrote {len(written)} archive(s) in {args.records}" + "".join(f"\n  {p}" for p in written))
        return
    if args.stage:
        raise ValueError("--stage applies to pack only: unpack extracts every archive")
    files = records.unpack(args.records, args.root)
    print(f"unpacked {len(files)} files of {args.records} under {args.root}")


def cmd_trend(args) -> None:
    trend.write_trend(args.settings, args.out)


def _int_list(text: str) -> list[int]:
    try:
        return [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of steps") from None


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
    run_p.add_argument("--retry-failed", action="store_true", help="start runs recorded as failed again")
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
    ins_p.add_argument(
        "--data",
        default="config",
        help="config, bundled, synthetic (as fp4jax.diagnose) or next (the run's next batches)",
    )
    rec_p = sub.add_parser(
        "records", help="pack runs into records/<study>/<stage>.tar.xz, or unpack them", allow_abbrev=False
    )
    rec_p.add_argument("action", choices=("pack", "unpack"))
    rec_p.add_argument("records", help="the records directory (records/<study>)")
    rec_p.add_argument("--root", required=True, help="the runs' root (pack reads it, unpack fills it)")
    rec_p.add_argument("--stage", action="append", default=[], help="pack only this stage (repeatable)")
    trend_p = sub.add_parser(
        "trend", help="Wgrad's share and H16's recovery across settings (scale_trend)", allow_abbrev=False
    )
    trend_p.add_argument("--settings", required=True, help="a settings file (plans/scale_trend.toml)")
    trend_p.add_argument("--out", default=None, help="directory for scale_trend.md/.json/.png")
    for p in (run_p, rep_p):
        p.add_argument("--plan", required=True, help="a plan file (fp4jax/study/plans/*.toml)")
        p.add_argument("--root", required=True, help="the runs' root directory")
    return parser


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    commands = {
        "run": cmd_run,
        "report": cmd_report,
        "instruments": cmd_instruments,
        "records": cmd_records,
        "trend": cmd_trend,
    }
    return run_command(lambda: commands[args.command](args), "study")


if __name__ == "__main__":
    sys.exit(main())
