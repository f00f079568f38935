"""Training throughput and MFU of the real trainer, one recipe after another, each in a process of its own.

    PYTHONPATH=. python benchmarks/bench_train.py --config configs/llama1b_pg_bf16.py \
        --recipes bf16,fp8,mxfp4_full_h16 --steps 30 [--one-process] [--out FILE.md] [--json FILE.json] \
        [--config.KEY=VALUE ...]

Each recipe trains `--steps` updates through `fp4jax.train.train` (the real data pipeline, jitted step,
one-step-behind metrics) with evaluation and checkpoints off. The table reports the median over the
updates after the first `--skip` (compilation and warm-up) of tokens/s and MFU as the trainer logs them,
the device's peak memory, and the last training loss, so a recipe that diverges shows it. A recipe entry
NAME@RNG trains preset NAME with the config's sr_rng set to RNG (stochastic rounding's bit generator:
"threefry", "threefry13"; recipes.with_sr_rng). `--json FILE` rewrites FILE whole after every recipe.

Why a process per recipe: jax cannot reset a device's peak_bytes_in_use, so in one process every recipe
reports the high-water mark of all before it. `--one-process` runs them in this process anyway (no
start-up per recipe; the peak column then says "so far").
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

import jax

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness  # benchmarks/harness.py (this folder is on sys.path when run as a script)

from fp4jax import train as trainer  # noqa: E402
from fp4jax.training import setup  # noqa: E402


def load_config(path: str, overrides: list[str]):
    """The config file with --config.KEY=VALUE overrides applied, through the trainer's own flag parser."""
    config, _, _ = trainer.parse_flags(["bench", f"--config={path}", *overrides])
    return config


def train_records(config, recipe: str, steps: int) -> list[dict]:
    """The training metrics lines of `steps` updates of `recipe` through the real trainer (evaluation,
    checkpoints, progress bar and TensorBoard off), exactly as it logged them."""
    config = config.copy_and_resolve_references()
    config.recipe, _, rng = recipe.partition("@")
    if rng:
        config.sr_rng = rng
    config.steps = steps
    config.eval_every_sequences, config.eval_at_end = 0, False
    config.checkpoint_every_steps, config.progress_bar, config.tensorboard = 0, False, False
    with tempfile.TemporaryDirectory() as workdir:
        trainer.train(config, workdir)
        with open(os.path.join(workdir, "metrics.jsonl")) as f:
            return [json.loads(line) for line in f if "eval_loss" not in line]


def bench_recipe(config, recipe: str, steps: int, skip: int) -> dict:
    records = train_records(config, recipe, steps)
    timed = [r for r in records if r["step"] > skip]
    return {
        "recipe": recipe,
        "tokens_per_s": statistics.median(r["tokens_per_s"] for r in timed),
        "mfu": statistics.median(r["mfu"] for r in timed) if "mfu" in timed[0] else None,
        "step_time_s": statistics.median(r["step_time_s"] for r in timed),
        "last_loss": records[-1]["loss"],
        "peak_memory_gb": max((r["peak_memory_gb"] for r in records if "peak_memory_gb" in r), default=None),
    }


def bench_in_child(recipe: str, args, overrides: list[str]) -> dict:
    """bench_recipe in a fresh process (this script with --one-process and one recipe): its own peak."""
    cmd = [sys.executable, os.path.abspath(__file__), "--config", args.config, "--recipes", recipe]
    cmd += ["--steps", str(args.steps), "--skip", str(args.skip), "--one-process", *overrides]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True)  # stderr passes through
    lines = done.stdout.splitlines()
    table = next((i for i, line in enumerate(lines) if line.startswith("### ")), len(lines))
    print("\n".join(line for line in lines[:table] if not line.startswith("{")), flush=True)
    rows = [json.loads(line) for line in lines if line.startswith("{")]
    if done.returncode != 0 or not rows:
        raise SystemExit(f"error: recipe {recipe} failed (exit {done.returncode}); its output is above")
    return rows[-1]


def to_markdown(rows, config, command: str, one_process: bool = False) -> str:
    m = config.model
    peak_header = "peak GB so far" if one_process else "peak GB"
    lines = [
        harness.heading("Train step", f"{jax.device_count()} x {jax.devices()[0].device_kind}"),
        "",
        f"Model `{m.size}`, global batch {config.global_batch} x seq {config.seq_len}, remat "
        f"`{m.remat or 'full'}`, blocks {'unrolled' if m.scan_layers is False else 'scanned'}, "
        f"updates {'dispatched ahead' if config.dispatch_ahead else 'in turn'}. Command: `{command}`",
        "",
        # In one process a row's peak is the high-water mark of every recipe so far (module docstring).
        f"| recipe | tokens/s | vs first row | MFU (bf16 peak) | step s | {peak_header} | last loss |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    base = rows[0]["tokens_per_s"]
    for r in rows:
        mfu = "-" if r["mfu"] is None else f"{r['mfu']:.1%}"
        peak = "-" if r["peak_memory_gb"] is None else f"{r['peak_memory_gb']:.1f}"
        lines.append(
            f"| {r['recipe']} | {r['tokens_per_s']:,.0f} | {r['tokens_per_s'] / base:.3f} | {mfu} "
            f"| {r['step_time_s']:.3f} | {peak} | {r['last_loss']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--recipes", default="bf16,fp8,mxfp4_full_h16")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--skip", type=int, default=5, help="leading updates left out of the medians")
    parser.add_argument("--one-process", action="store_true", help="every recipe in this process")
    parser.add_argument("--out", default="")
    parser.add_argument("--json", default="", help="write the rows here as JSON, after every recipe")
    args, overrides = parser.parse_known_args()
    config = load_config(args.config, overrides)
    if args.one_process:
        print(f"xla options: {setup.apply_xla_options(config)}", flush=True)  # as the trainer's command line
    command = " ".join(["python benchmarks/bench_train.py", *sys.argv[1:]])
    sink = harness.JsonRows(args.json, command)
    rows = []
    for recipe in args.recipes.split(","):
        if args.one_process:
            rows.append(bench_recipe(config, recipe, args.steps, args.skip))
        else:
            rows.append(bench_in_child(recipe, args, overrides))
        print(json.dumps(rows[-1]), flush=True)
        sink.add(rows[-1])
    harness.emit(to_markdown(rows, config, command, args.one_process), args.out)


if __name__ == "__main__":
    main()
