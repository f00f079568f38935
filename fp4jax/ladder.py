"""The study's ladder: train rungs x seeds (x peak LRs), then report tokens to target, overhead and speed-up.

    python -m fp4jax.ladder run --root runs/ladder --seeds 0,1,2 --parallel 2 \
        configs/llama125m_pg_fp8.py configs/llama125m_pg_full.py [NAME=CONFIG ...] \
        [--set steps=2000 ...] [--rung-set NAME:key=value ...] [--rung-seeds NAME:0,1,2 ...] \
        [--lrs 3e-4,1e-3,3e-3] [--recipes fp8_mlperf,mxfp4_full,...] [-- --config.X=Y ...]
    python -m fp4jax.ladder report --root runs/ladder --baseline llama125m_pg_fp8 [--target config] \
        --out docs/results/ladder

`run` trains each rung once per seed (and peak LR) into ROOT/<rung>[/lr<lr>]/seed<k>, passing
--config.seed=k (and --config.optimizer.peak_lr); a run that finished (summary.json with a final status:
reached, not_reached, diverged, failed) is never rerun (delete its summary.json to train it further;
--retry-failed reruns "failed" ones), an interrupted one resumes. A run that diverges
(exit 3), crashes or times out (--timeout-min) is recorded and the ladder goes on. --parallel N runs N at
once, one GPU each (chosen through CUDA_VISIBLE_DEVICES / ROCR_VISIBLE_DEVICES / HIP_VISIBLE_DEVICES). Logs:
<run dir>/train.log. Exit code 0 once every run has ended, whatever its outcome; 2 bad input.

`report` writes OUT.md (tables), OUT.json (every number) and plots; definitions in fp4jax/study/analysis.py.
--target: config (default: the configs' target_eval_loss), a loss in nats, or auto[+MARGIN] (the worst of
the baseline runs' best eval loss, plus MARGIN).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import re
import sys

from fp4jax import logs
from fp4jax.study import analysis, plots, report, runner, tables
from fp4jax.study.command import run_command

__all__ = ["build_parser", "cmd_report", "cmd_run", "main", "parse_overrides", "parse_rungs"]


def parse_rungs(specs, rung_sets=(), rung_seeds=(), recipes=None) -> list[runner.Rung]:
    """[NAME=]CONFIG positional specs (NAME defaults to the file's stem); with recipes, one rung a config and
    recipe (named by the recipe, or NAME_RECIPE with several configs); then NAME:key=value overrides and
    NAME:0,1,2 seeds of one rung."""
    rungs = {}
    for spec in specs:
        name, _, config = spec.rpartition("=") if re.match(r"^[\w.-]+=", spec) else ("", "", spec)
        name = name or os.path.splitext(os.path.basename(config))[0]
        for recipe in recipes or [None]:
            rung = name if recipe is None else recipe if len(specs) == 1 else f"{name}_{recipe}"
            if rung in rungs:
                raise ValueError(f"rung {rung!r} is given twice; name one NAME=CONFIG")
            rungs[rung] = runner.Rung(rung, config, () if recipe is None else (f"--config.recipe={recipe}",))
    for item in rung_sets:
        name, sep, kv = item.partition(":")
        if not sep or "=" not in kv or name not in rungs:
            raise ValueError(f"--rung-set {item!r}: want NAME:key=value with NAME one of {sorted(rungs)}")
        rungs[name] = dataclasses.replace(rungs[name], overrides=(*rungs[name].overrides, "--config." + kv))
    for item in rung_seeds:
        name, sep, seeds = item.partition(":")
        if not sep or name not in rungs:
            raise ValueError(f"--rung-seeds {item!r}: want NAME:0,1,2 with NAME one of {sorted(rungs)}")
        rungs[name] = dataclasses.replace(rungs[name], seeds=tuple(_numbers(seeds, int, "--rung-seeds")))
    return list(rungs.values())


def parse_overrides(sets: list[str], passthrough: list[str], lrs) -> list[str]:
    """--set key=value and raw --config.key=value arguments; the seed and (when swept) the LR are the
    ladder's own."""
    overrides = ["--config." + kv for kv in sets] + passthrough
    for arg in overrides:
        if not re.match(r"^--config\.[\w.]+=", arg):
            raise ValueError(f"override {arg!r} is not --config.KEY=VALUE (or --set KEY=VALUE)")
        if arg.startswith("--config.seed="):
            raise ValueError("the seed is the ladder's: use --seeds 0,1,2 instead of --config.seed")
        if lrs and arg.startswith("--config.optimizer.peak_lr="):
            raise ValueError("--lrs sets optimizer.peak_lr: drop the peak_lr override")
    return overrides


def _numbers(text: str | None, kind, flag: str):
    """Comma-separated values of `kind`, None when the flag was not given."""
    if text is None:
        return None
    try:
        values = [kind(x) for x in text.split(",") if x.strip()]
    except ValueError:
        values = []
    if not values:
        raise ValueError(f"{flag} {text!r}: want comma-separated {kind.__name__} values, e.g. {flag} 0,1,2")
    return values


def cmd_run(args, passthrough: list[str]) -> None:
    lrs = _numbers(args.lrs, float, "--lrs")
    overrides = parse_overrides(args.set, passthrough, lrs)
    rungs = parse_rungs(
        args.configs, args.rung_set, args.rung_seeds, _numbers(args.recipes, str, "--recipes")
    )
    specs = runner.plan(rungs, _numbers(args.seeds, int, "--seeds"), lrs)
    runner.run_grid(
        specs,
        args.root,
        overrides,
        parallel=args.parallel,
        gpus=_numbers(args.gpus, str, "--gpus"),
        gpus_per_run=args.gpus_per_run,
        timeout_min=args.timeout_min,
        retry_failed=args.retry_failed,
        log=lambda line: print(line, flush=True),
    )
    if args.report:
        if not args.baseline:
            raise ValueError("--report needs --baseline NAME")
        cmd_report(argparse.Namespace(**{**vars(args), "out": args.report, "rungs": None}))


def cmd_report(args) -> None:
    runs = analysis.load_runs(args.root)
    result = analysis.analyze(runs, args.baseline, args.target, _numbers(args.rungs, str, "--rungs"))
    report.write(
        args.out or None, tables.to_markdown(result), result, lambda base: plots.plot_all(result, base)
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m fp4jax.ladder", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="train every rung x seed (x LR) into ROOT", allow_abbrev=False)
    run_p.add_argument("--root", required=True)
    run_p.add_argument("configs", nargs="+", help="[NAME=]CONFIG, one a rung")
    run_p.add_argument("--seeds", default="0", help="comma-separated seeds (default 0)")
    run_p.add_argument("--lrs", default=None, help="comma-separated peak LRs: an LR sweep")
    run_p.add_argument("--recipes", default=None, help="comma-separated recipes: one rung each (per config)")
    run_p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE", help="config override")
    run_p.add_argument("--rung-set", action="append", default=[], metavar="NAME:KEY=VALUE")
    run_p.add_argument(
        "--rung-seeds", action="append", default=[], metavar="NAME:SEEDS", help="e.g. fp8:0,1,2"
    )
    run_p.add_argument("--parallel", type=int, default=1, help="runs at once (one GPU each)")
    run_p.add_argument("--gpus", default=None, help="GPU ids to use (default: the visible ones)")
    run_p.add_argument("--gpus-per-run", type=int, default=1)
    run_p.add_argument("--timeout-min", type=float, default=None, help="stop a run after this long")
    run_p.add_argument("--retry-failed", action="store_true", help="rerun runs recorded as failed")
    run_p.add_argument("--report", default=None, metavar="OUT", help="then write the report to OUT")
    rep_p = sub.add_parser("report", help="tabulate and plot the runs under ROOT", allow_abbrev=False)
    rep_p.add_argument("--root", required=True)
    for p in (run_p, rep_p):
        p.add_argument("--baseline", required=p is rep_p, help="the baseline rung's name")
        p.add_argument("--target", default="config", help="config, auto[+MARGIN], or a loss in nats")
    rep_p.add_argument("--rungs", default=None, help="comma-separated rungs, in report order")
    rep_p.add_argument("--out", default=None, help="write OUT.md, OUT.json and OUT*.png")
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    passthrough = argv[argv.index("--") + 1 :] if "--" in argv else []
    argv = argv[: argv.index("--")] if "--" in argv else argv
    logs.configure()
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if args.command == "report" and (unknown or passthrough):
        parser.error(f"unrecognized arguments: {' '.join(unknown + passthrough)}")
    if args.command == "run":  # bare --config.KEY=VALUE arguments pass through too
        return run_command(lambda: cmd_run(args, unknown + passthrough), "ladder")
    return run_command(lambda: cmd_report(args), "ladder")


if __name__ == "__main__":
    sys.exit(main())
