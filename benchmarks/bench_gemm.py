"""GEMM throughput of fp4jax.ops.mx_dot_general against plain bf16 / FP8 dots, side by side in one run.

    PYTHONPATH=. python benchmarks/bench_gemm.py [--shapes 8192x8192x8192,16384x4096x14336] [--out FILE.md]
    PYTHONPATH=. python benchmarks/bench_gemm.py --backends emulate,fp8   # each MX preset per GEMM back end
    PYTHONPATH=. python benchmarks/bench_gemm.py --shapes 32768x2048x8192,32768x8192x2048 \
        --presets mxfp4_full,mxfp4_full_sr,mxfp4_full_sr@threefry13 --modes fwd+bwd --json FILE.json

Each variant is jitted once, warmed up, then timed `--iters` times (block_until_ready per call); the
table reports the median. TFLOP/s counts 2*M*N*K per GEMM (3 GEMMs for forward+backward), so a
quantized path is charged for its quantization work inside the same time.

`--presets` names the MX presets timed; NAME@RNG times preset NAME with every stochastically rounded
operand drawing its bits from generator RNG (recipes.with_sr_rng: "threefry", "threefry13"), so
round-to-nearest and both SR generators run side by side in one process. `--json FILE` rewrites FILE
after every timing (whole, never half-written), so a run cut short keeps what it measured.
"""

from __future__ import annotations

import argparse
import dataclasses

import harness  # benchmarks/harness.py: timing, headings, output (this folder is on sys.path)
import jax
import jax.numpy as jnp

from fp4jax.ops import get_recipe, mx_dot_general
from fp4jax.ops.recipes import with_sr_rng

DIMS = (((1,), (0,)), ((), ()))  # x[M, K] @ w[K, N]
PRESETS = ("bf16", "fp8", "mxfp4_fprop", "mxfp4_full", "mxfp4_full_h16", "mxfp4_full_sr", "mxfp8")


def _baselines(x, w):
    """Plain XLA dots: bf16, and an FP8 E4M3 x E4M3 dot of pre-quantized operands (the hardware ceiling)."""
    x8, w8 = x.astype(jnp.float8_e4m3fn), w.astype(jnp.float8_e4m3fn)
    bf16 = jax.jit(lambda a, b: jax.lax.dot_general(a, b, DIMS, preferred_element_type=jnp.bfloat16))
    fp8 = jax.jit(lambda a, b: jax.lax.dot_general(a, b, DIMS, preferred_element_type=jnp.bfloat16))
    return {"xla bf16 dot": (bf16, (x, w), 1), "xla fp8 e4m3 dot (pre-quantized)": (fp8, (x8, w8), 1)}


def preset_recipe(entry: str):
    """The Recipe of a --presets entry: a preset's name, or NAME@RNG (its SR operands on generator RNG)."""
    name, _, rng = entry.partition("@")
    return with_sr_rng(name, rng) if rng else get_recipe(name)


MODES = ("fwd", "fwd+bwd")


def _mx_variants(x, w, dy, key, backend: str = "auto", presets=PRESETS, modes=MODES):
    """Forward alone, and forward + both gradients for a random cotangent dy.

    The cotangent must be random: with jax.grad of a sum it would be all ones, and XLA turns a dot with
    a broadcast of ones into a reduction (and drops the unused forward), which times nothing real.
    """
    variants = {}
    suffix = "" if backend == "auto" else f" [{backend}]"
    for name in presets:
        recipe = dataclasses.replace(preset_recipe(name), backend=backend)
        k = key if recipe.needs_key else None

        def fwd(a, b, recipe=recipe, k=k):
            return mx_dot_general(a, b, DIMS, recipe=recipe, key=k)

        def fwd_bwd(a, b, g, fwd=fwd):
            out, vjp = jax.vjp(fwd, a, b)
            return out, vjp(g)

        if "fwd" in modes:
            variants[f"mx_dot {name}{suffix} fwd"] = (jax.jit(fwd), (x, w), 1)
        if "fwd+bwd" in modes:
            variants[f"mx_dot {name}{suffix} fwd+bwd"] = (jax.jit(fwd_bwd), (x, w, dy), 3)
    return variants


def run(
    shapes,
    iters: int,
    backends=("auto",),
    presets=PRESETS,
    sink: harness.JsonRows | None = None,
    modes=MODES,
) -> list[tuple[str, str, float, float]]:
    rows = []
    for m, k, n in shapes:
        kx, kw, kg, kq = jax.random.split(jax.random.key(0), 4)
        x = jax.random.normal(kx, (m, k), jnp.bfloat16)
        w = (jax.random.normal(kw, (k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
        dy = (jax.random.normal(kg, (m, n), jnp.float32) * 1e-3).astype(jnp.bfloat16)
        variants = _baselines(x, w)
        for backend in backends:
            variants.update(_mx_variants(x, w, dy, kq, backend, presets, modes))
        for name, (fn, args, gemms) in variants.items():
            seconds = harness.median_seconds(fn, [args], iters)
            tflops = gemms * 2 * m * n * k / seconds / 1e12
            rows.append((f"{m}x{k}x{n}", name, seconds * 1e3, tflops))
            if sink is not None:
                sink.add(dict(shape=f"{m}x{k}x{n}", variant=name, median_ms=seconds * 1e3, tflops=tflops))
            print(f"{m}x{k}x{n}  {name:40s} {seconds * 1e3:9.3f} ms  {tflops:8.1f} TFLOP/s", flush=True)
    return rows


def to_markdown(rows, command: str) -> str:
    lines = [
        harness.heading("GEMMs"),
        "",
        f"Command: `{command}`",
        "",
        "| M x K x N | variant | median ms | TFLOP/s |",
        "|---|---|---:|---:|",
    ]
    lines += [f"| {shape} | {name} | {ms:.3f} | {tf:.1f} |" for shape, name, ms, tf in rows]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8192x8192x8192,16384x4096x14336", help="MxKxN,...")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--backends", default="auto", help="MX presets per back end: auto,emulate,fp8")
    parser.add_argument("--presets", default=",".join(PRESETS), help="MX presets, NAME or NAME@RNG")
    parser.add_argument("--modes", default=",".join(MODES), help="what is timed per preset: fwd,fwd+bwd")
    parser.add_argument("--out", default="", help="write the markdown table here")
    parser.add_argument("--json", default="", help="write the rows here as JSON, after every timing")
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    presets, modes = tuple(args.presets.split(",")), tuple(args.modes.split(","))
    if unknown := set(modes) - set(MODES):
        parser.error(f"unknown --modes {', '.join(sorted(unknown))}: use fwd and/or fwd+bwd")
    for entry in presets:
        try:  # a bad name or generator is one line, before anything is compiled
            preset_recipe(entry)
        except ValueError as err:
            parser.error(f"--presets {entry}: {err}")
    command = (
        f"python benchmarks/bench_gemm.py --shapes {args.shapes} --backends {args.backends} "
        f"--presets {args.presets} --modes {args.modes} --iters {args.iters}"
    )
    sink = harness.JsonRows(args.json, command)
    rows = run(shapes, args.iters, tuple(args.backends.split(",")), presets, sink, modes)
    harness.emit(to_markdown(rows, command), args.out)


if __name__ == "__main__":
    main()
