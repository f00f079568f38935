"""The study's ladder: run a set of configs, then report token overhead, throughput and speed-up.

    python -m fp4jax.ladder run --root runs/ladder configs/llama8b_c4_fp8.py configs/llama8b_c4_h16.py ...
    python -m fp4jax.ladder report --root runs/ladder --baseline llama8b_c4_fp8 --target 3.3 \
        --out docs/results/ladder

Definitions (REFERENCE.md §1):
- tokens to target: training tokens seen at the first evaluation whose loss is <= target (MLPerf stops
  there); None when no evaluation reached it.
- token overhead = tokens to target / the baseline's tokens to target - 1.
- throughput: median training tokens/s over the run's steps (the first steps, which compile, excluded).
- end-to-end speed-up = the baseline's time to target / this run's time to target, each time being
  tokens to target / throughput, i.e. the step speed-up discounted by the token overhead.
`--target auto` uses the baseline's best evaluation loss: what the baseline reached within its budget.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import statistics
import subprocess
import sys

from fp4jax.training.metrics import read_metrics

WARMUP_STEPS = 3  # steps that include compilation and are left out of throughput


@dataclasses.dataclass(frozen=True)
class RunResult:
    name: str
    tokens_to_target: int | None
    tokens_per_s: float | None
    best_eval_loss: float | None
    evals: tuple[tuple[int, float], ...]  # (tokens, eval loss)
    train: tuple[tuple[int, float], ...]  # (tokens, loss)


def tokens_to_target(evals, target: float) -> int | None:
    """Tokens at the first evaluation with loss <= target, else None."""
    return next((tokens for tokens, loss in evals if loss <= target), None)


def summarize(name: str, records: list[dict], target: float | None) -> RunResult:
    evals = tuple((r["tokens"], r["eval_loss"]) for r in records if r.get("eval_loss") is not None)
    train = tuple((r["tokens"], r["loss"]) for r in records if "eval_loss" not in r and "loss" in r)
    rates = [r["tokens_per_s"] for r in records if r.get("tokens_per_s") and r["step"] > WARMUP_STEPS]
    return RunResult(
        name=name,
        tokens_to_target=None if target is None else tokens_to_target(evals, target),
        tokens_per_s=statistics.median(rates) if rates else None,
        best_eval_loss=min((loss for _, loss in evals), default=None),
        evals=evals,
        train=train,
    )


def _ratio(a, b):
    return None if a is None or b in (None, 0) else a / b


def ladder_rows(results: list[RunResult], baseline: RunResult) -> list[dict]:
    """One row a run: overhead and speed-ups relative to the baseline (None where undefined)."""
    base_time = _ratio(baseline.tokens_to_target, baseline.tokens_per_s)
    rows = []
    for r in results:
        overhead = _ratio(r.tokens_to_target, baseline.tokens_to_target)
        time_to_target = _ratio(r.tokens_to_target, r.tokens_per_s)
        rows.append(
            dict(
                run=r.name,
                tokens_to_target=r.tokens_to_target,
                token_overhead=None if overhead is None else overhead - 1,
                tokens_per_s=r.tokens_per_s,
                step_speedup=_ratio(r.tokens_per_s, baseline.tokens_per_s),
                end_to_end_speedup=_ratio(base_time, time_to_target),
                best_eval_loss=r.best_eval_loss,
            )
        )
    return rows


def _fmt(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def to_markdown(rows: list[dict], target: float, baseline: str) -> str:
    lines = [
        f"Target eval loss {target:.4f} nats; baseline `{baseline}`.",
        "",
        "| run | tokens to target | token overhead | tokens/s | step speed-up | end-to-end speed-up "
        "| best eval loss |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        lines.append(
            f"| {row['run']} | {_fmt(row['tokens_to_target'], ',', 'not reached')} "
            f"| {_fmt(row['token_overhead'], '+.1%')} | {_fmt(row['tokens_per_s'], ',.0f')} "
            f"| {_fmt(row['step_speedup'], '.3f')} | {_fmt(row['end_to_end_speedup'], '.3f')} "
            f"| {_fmt(row['best_eval_loss'], '.4f')} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: list[RunResult], target: float, path: str) -> None:
    """Eval loss and (lightly smoothed) training loss against tokens, one line a run."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_train, ax_eval) = plt.subplots(1, 2, figsize=(13, 4.5))
    for r in results:
        if r.train:
            tokens, losses = zip(*r.train, strict=True)
            ax_train.plot(tokens, _smooth(losses), label=r.name, linewidth=1)
        if r.evals:
            tokens, losses = zip(*r.evals, strict=True)
            ax_eval.plot(tokens, losses, marker="o", markersize=3, label=r.name)
    ax_eval.axhline(target, color="k", linestyle="--", linewidth=0.8, label=f"target {target:.3f}")
    for ax, title in ((ax_train, "training loss (EMA 0.9)"), (ax_eval, "validation loss")):
        ax.set_xlabel("training tokens")
        ax.set_ylabel("nats / token")
        ax.set_title(title)
        ax.grid(alpha=0.3)
    ax_eval.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def _smooth(values, decay: float = 0.9) -> list[float]:
    out, ema = [], None
    for v in values:
        ema = v if ema is None else decay * ema + (1 - decay) * v
        out.append(ema)
    return out


def report(root: str, baseline: str, target: str, out: str | None) -> str:
    names = sorted(d for d in os.listdir(root) if os.path.exists(os.path.join(root, d, "metrics.jsonl")))
    if baseline not in names:
        raise ValueError(f"baseline run {baseline!r} has no metrics under {root}: runs found: {names}")
    records = {n: read_metrics(os.path.join(root, n)) for n in names}
    base = summarize(baseline, records[baseline], None)
    if target == "auto":
        if base.best_eval_loss is None:
            raise ValueError(f"baseline {baseline!r} has no evaluation: --target auto needs one")
        target_loss = base.best_eval_loss
    else:
        target_loss = float(target)
    results = [summarize(n, records[n], target_loss) for n in names]
    base = next(r for r in results if r.name == baseline)
    table = to_markdown(ladder_rows(results, base), target_loss, baseline)
    if out:
        os.makedirs(os.path.dirname(out) or ".", exist_ok=True)
        with open(out + ".md", "w", encoding="utf-8") as f:
            f.write(table)
        plot(results, target_loss, out + ".png")
    return table


def run_configs(root: str, configs: list[str], overrides: list[str]) -> None:
    """Trains each config in turn into root/<config name> (each resumes if it was interrupted)."""
    for config in configs:
        name = os.path.splitext(os.path.basename(config))[0]
        cmd = [
            sys.executable,
            "-m",
            "fp4jax.train",
            "--config",
            config,
            "--workdir",
            os.path.join(root, name),
        ]
        print(f"ladder: {' '.join(cmd + overrides)}", flush=True)
        subprocess.run(cmd + overrides, check=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fp4jax.ladder", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run_p = sub.add_parser("run", help="train each config into ROOT/<config name>")
    run_p.add_argument("--root", required=True)
    run_p.add_argument("configs", nargs="+")
    rep_p = sub.add_parser("report", help="tabulate and plot the runs under ROOT")
    rep_p.add_argument("--root", required=True)
    rep_p.add_argument("--baseline", required=True, help="the baseline run's directory name")
    rep_p.add_argument("--target", default="auto", help="eval loss target (nats), or 'auto'")
    rep_p.add_argument("--out", default=None, help="write OUT.md and OUT.png")
    args, overrides = parser.parse_known_args(argv)
    if args.command == "report" and overrides:
        parser.error(f"unrecognized arguments: {' '.join(overrides)}")
    try:
        if args.command == "run":
            run_configs(args.root, args.configs, overrides)
        else:
            print(report(args.root, args.baseline, args.target, args.out))
    except (ValueError, FileNotFoundError, subprocess.CalledProcessError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
