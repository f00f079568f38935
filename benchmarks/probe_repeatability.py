"""Does the same training run give the same numbers twice on this device, in one process and across processes?

    PYTHONPATH=. python benchmarks/probe_repeatability.py --config configs/proxy125m_c4.py \
        --recipes bf16,mxfp4_full_h16 --steps 8 --processes 2 --in-process 2 \
        [--variants default,deterministic] [--out FILE.md] [--config.KEY=VALUE ...]

Each (recipe, variant) trains `--steps` updates through `fp4jax.train.train` `--in-process` times in each
of `--processes` fresh processes, with evaluation and checkpoints off, and compares the per-update
training losses and gradient norms bit for bit. In one process the second run reuses XLA's choices of
the first (its autotuning results are cached per process), so a difference there means a program
that is not repeatable by itself (atomics, a race, a read of unwritten memory); a difference only across
processes means choices made anew when each process compiles (GEMM algorithms picked by timing).

Variants (XLA_FLAGS added for the children): `default` (nothing), `deterministic`
(--xla_gpu_deterministic_ops=true: XLA's scatter-adds, as in the embedding gradient, without atomics),
`no_autotune` (that and --xla_gpu_autotune_level=0: XLA's default GEMM algorithms, none timed) and
`xla_quantizer` (FP4JAX_QUANTIZE_IMPL=xla: the XLA quantizer instead of the Pallas kernels).
`--gemm MxKxN` instead calls one compiled forward + backward of each recipe's dot GEMM_CALLS times on the
same inputs and says which outputs changed.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_train  # benchmarks/bench_train.py: the config loader and the trainer's metrics lines
import harness

from fp4jax.training import setup  # noqa: E402

# Each variant's environment for the children: XLA_FLAGS are added to the caller's, the rest set.
VARIANTS = {
    "default": {},
    "deterministic": {"XLA_FLAGS": "--xla_gpu_deterministic_ops=true"},
    "no_autotune": {"XLA_FLAGS": "--xla_gpu_deterministic_ops=true --xla_gpu_autotune_level=0"},
    "xla_quantizer": {"FP4JAX_QUANTIZE_IMPL": "xla"},
}
GEMM_CALLS = 5  # calls of one compiled GEMM forward + backward in --gemm mode


def variant_env(variant: str) -> dict:
    env = {**os.environ, **VARIANTS[variant]}
    if "XLA_FLAGS" in VARIANTS[variant]:
        env["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {VARIANTS[variant]['XLA_FLAGS']}".strip()
    return env


def train_once(config, recipe: str, steps: int) -> dict:
    """One run's per-update training loss and gradient norm, exactly as the trainer logged them."""
    import jax

    records = bench_train.train_records(config, recipe, steps)
    return {
        "loss": [r["loss"] for r in records],
        "grad_norm": [r["grad_norm"] for r in records],
        "device": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
    }


def gemm_repeats(recipe: str, shape: tuple[int, int, int], calls: int) -> str:
    """Whether `calls` calls of one compiled forward + backward of the recipe's dot (x [M, K] @ w [K, N],
    bfloat16, a fixed cotangent) return the same bits each time: 'same' or which outputs differ."""
    import jax
    import jax.numpy as jnp

    from fp4jax.ops import mx_dot

    m, k, n = shape
    keys = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
    w = (jax.random.normal(keys[1], (k, n), jnp.float32) / k**0.5).astype(jnp.bfloat16)
    g = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
    dot = mx_dot.make_dot_general(recipe)

    @jax.jit
    def forward_backward(x, w, g):
        y, pullback = jax.vjp(lambda x, w: dot(x, w, (((1,), (0,)), ((), ()))), x, w)
        return (y, *pullback(g))

    first, *rest = [jax.device_get(forward_backward(x, w, g)) for _ in range(calls)]
    names = ("y", "dx", "dw")
    differ = sorted({names[i] for out in rest for i in range(3) if not (out[i] == first[i]).all()})
    return "same" if not differ else f"{', '.join(differ)} differ"


def runs_in_child(args, overrides: list[str], recipe: str, variant: str) -> list[dict]:
    """`--in-process` runs of `recipe` in a fresh process with the variant's environment."""
    env = variant_env(variant)
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "--config", args.config]
    cmd += ["--recipes", recipe, "--steps", str(args.steps), "--in-process", str(args.in_process), *overrides]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, text=True, env=env)  # stderr passes through
    runs = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    if done.returncode != 0 or len(runs) != args.in_process:
        raise SystemExit(f"error: {recipe} ({variant}) failed (exit {done.returncode}); its log is above")
    return runs


def first_difference(a: dict, b: dict) -> tuple[int, str] | None:
    """The first update (1-based) whose loss or gradient norm differs between two runs, and which of the
    two ('loss' if both), or None. A loss that differs at update 1 means the forward pass itself did."""
    pairs_a = zip(a["loss"], a["grad_norm"], strict=True)
    pairs_b = zip(b["loss"], b["grad_norm"], strict=True)
    for update, (pair_a, pair_b) in enumerate(zip(pairs_a, pairs_b, strict=True), start=1):
        if pair_a != pair_b:
            return update, "loss" if pair_a[0] != pair_b[0] else "grad_norm"
    return None


def describe(runs: list[dict]) -> str:
    """'same', or 'FIELD differs from update N' (the earliest), for a group of runs against its first."""
    firsts = [first_difference(runs[0], r) for r in runs[1:]]
    firsts = [f for f in firsts if f is not None]
    if not firsts:
        return "same"
    update, field = min(firsts)
    return f"{field} differs from update {update}"


def row(recipe: str, variant: str, processes: list[list[dict]]) -> str:
    within = [describe(runs) for runs in processes]
    across = describe([runs[0] for runs in processes])
    last_losses = [run["loss"][-1] for runs in processes for run in runs]
    finals = sorted({f"{loss:.6f}" for loss in last_losses})
    spread = max(last_losses) - min(last_losses)
    return f"| {recipe} | {variant} | {'; '.join(within)} | {across} | {', '.join(finals)} | {spread:.2e} |"


def gemm_table(recipes: list[str], gemm: str) -> str:
    import jax

    m, k, n = shape = tuple(int(d) for d in gemm.split("x"))
    device = f"{jax.device_count()} x {jax.devices()[0].device_kind}"
    lines = [
        harness.heading("Repeatability of one GEMM", device),
        "",
        f"Forward + backward of x [{m}, {k}] @ w [{k}, {n}], bfloat16, one compiled program called "
        f"{GEMM_CALLS} times on the same inputs. Command: "
        f"`python benchmarks/probe_repeatability.py {' '.join(sys.argv[1:])}`",
        "",
        f"| recipe | outputs over {GEMM_CALLS} calls |",
        "|---|---|",
    ]
    return "\n".join(lines + [f"| {r} | {gemm_repeats(r, shape, GEMM_CALLS)} |" for r in recipes]) + "\n"


def runs_table(args, overrides: list[str], config) -> str:
    # The children hold the device (jax here would take its memory first); their runs name it.
    table = []
    for recipe in args.recipes.split(","):
        for variant in args.variants.split(","):
            processes = [runs_in_child(args, overrides, recipe, variant) for _ in range(args.processes)]
            table.append(row(recipe, variant, processes))
            print(table[-1], flush=True)
    lines = [
        harness.heading("Repeatability", processes[0][0]["device"]),
        "",
        f"Model `{config.model.size}`, batch {config.global_batch} x {config.seq_len}, {args.steps} updates, "
        f"{args.in_process} runs in each of {args.processes} processes, losses and gradient norms compared "
        f"bit for bit. Command: `python benchmarks/probe_repeatability.py {' '.join(sys.argv[1:])}`",
        "",
        "| recipe | variant | within each process | across processes | last losses | spread |",
        "|---|---|---|---|---|---:|",
        *table,
    ]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--recipes", default="bf16,mxfp4_full_h16")
    parser.add_argument("--variants", default="default,deterministic")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--processes", type=int, default=2)
    parser.add_argument("--in-process", type=int, default=2, help="runs in each process")
    parser.add_argument("--gemm", default="", help="MxKxN: one GEMM's forward+backward instead of training")
    parser.add_argument("--child", action="store_true", help="(internal) run in this process, print JSON")
    parser.add_argument("--out", default="")
    args, overrides = parser.parse_known_args()
    for variant in args.variants.split(","):
        if variant not in VARIANTS:
            raise SystemExit(f"error: unknown variant {variant!r}: use some of {', '.join(VARIANTS)}")
    config = bench_train.load_config(args.config, overrides)
    if args.child:
        setup.apply_xla_options(config)  # as the trainer's command line does, before jax starts
        for _ in range(args.in_process):
            print(json.dumps(train_once(config, args.recipes, args.steps)), flush=True)
        return
    if args.gemm:
        harness.emit(gemm_table(args.recipes.split(","), args.gemm), args.out)
    else:
        harness.emit(runs_table(args, overrides, config), args.out)


if __name__ == "__main__":
    main()
