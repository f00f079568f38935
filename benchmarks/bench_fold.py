"""The fp8 GEMM back end on a GPU: agreement with emulate, speed against emulate and the plain FP8 dot, and
whether the compiled program really runs the GEMMs on FP8 operands. One process, about 2 minutes on an H200.

    PYTHONPATH=. python benchmarks/bench_fold.py [--shapes 16384x4096x14336,8192x8192x8192] [--out FILE.md]
        [--only SUBSTRING,...] [--skip-checks]

Every variant is lowered and compiled first, its compile time printed (and flushed) before it is timed:
on a GPU a slow compile (e.g. XLA autotuning Triton GEMM configurations of a fused FP8 dot) shows up
as such instead of as a silent wait. Try XLA_FLAGS=--xla_gpu_enable_triton_gemm=false to compare.

Per shape M x K x N (x[M, K] @ w[K, N], forward + both gradients, TFLOP/s over 3 GEMMs of 2*M*N*K):
- `xla fp8 dot x3 (pre-quantized)`: three plain E4M3 dots of operands cast once outside: the ceiling,
  with the accumulation the library asks for (precise float32 on NVIDIA: backends.fp8_dot_precision).
- `xla fp8 dot x3 (no algorithm: fast accum)`: the same dots without an algorithm, which XLA runs with
  cuBLASLt's fast accumulation on NVIDIA: what precise accumulation costs.
- `fp8 GEMMs x3 (pre-folded MXFP4)`: the fp8 back end's three GEMMs (FP8 dot + exponent epilogue) on
  operands quantized and folded once outside: the back end with quantization excluded.
- `mx_dot <recipe> <backend> fwd+bwd`: the whole quantized layer, quantization included.
Then the largest |fp8 - emulate| / max |emulate| of y, dx, dw against the bound 1e-4 (FP8 tensor cores
accumulate with reduced-precision partial sums), and the element types of every GEMM in the compiled
fwd+bwd program of the fp8 back end (expected: three FP8 GEMMs, and no bf16 GEMM but the rotations'
small matmuls, two per rotated GEMM). Exit status 1 when the agreement or the HLO check fails.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import sys
import time

import harness  # benchmarks/harness.py: timing, headings, output (this folder is on sys.path)
import jax
import jax.numpy as jnp
import numpy as np

from fp4jax.ops import PRESETS, mx_dot_general, quantize_mx
from fp4jax.ops.kernels.backends import fp8_dot_precision, fp8_matmul
from fp4jax.ops.kernels.fold import FoldedOperand, count_fold_flushes, fold_mx_to_fp8
from fp4jax.ops.kernels.probes import BMK_BNK  # contract the last axis of both operands, batch over the first
from fp4jax.selfcheck import gemm_operand_types

DIMS = (((1,), (0,)), ((), ()))  # x[M, K] @ w[K, N]
BOUND = 1e-4


def _operands(m, k, n):
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (m, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (k, n), jnp.float32) * 0.02).astype(jnp.bfloat16)
    dy = (jax.random.normal(kg, (m, n), jnp.float32) * 1e-3).astype(jnp.bfloat16)
    return x, w, dy


def plain_fp8_fwd_bwd(library_precision: bool = True):
    """Three E4M3 dots of pre-cast operands, as (batch, rows, K) x (batch, cols, K): the hardware ceiling.
    library_precision: the precision the library's FP8 dots carry (else none: XLA's default)."""

    def run(x8, wt8, dy8, w8, xt8, dyt8):
        precision = fp8_dot_precision(x8) if library_precision else None
        dot = lambda a, c: jax.lax.dot_general(
            a, c, BMK_BNK, precision=precision, preferred_element_type=jnp.float32
        ).astype(jnp.bfloat16)
        return dot(x8, wt8), dot(dy8, w8), dot(xt8, dyt8)

    return jax.jit(run)


def _bfc(x):
    return x[None]


def plain_fp8_operands(x, w, dy):
    """The six (1, rows, K) E4M3 operands of fprop (K), dgrad (N) and wgrad (M)."""
    e4 = lambda t: _bfc(t).astype(jnp.float8_e4m3fn)
    return e4(x), e4(w.T), e4(dy), e4(w), e4(x.T), e4(dy.T)


def mx_operands(x, w, dy):
    """The same six operands quantized to MXFP4 along each GEMM's contraction axis."""
    q = jax.jit(lambda t: quantize_mx(_bfc(t).astype(jnp.float32), scale_mode="even"))
    return [q(t) for t in (x, w.T, dy, w, x.T, dy.T)]


def prefolded_operands(x, w, dy):
    """The six MXFP4 operands folded once outside: (E4M3 data, row exponents) each."""
    folded = [jax.jit(fold_mx_to_fp8)(q) for q in mx_operands(x, w, dy)]
    return [(f.data, f.row_exponent) for f in folded]


def prefolded_fp8_gemms():
    """The fp8 back end's three GEMMs on operands already folded: FP8 dot + exponent epilogue only."""

    def mm(a, c):
        (a_data, a_exp), (c_data, c_exp) = a, c
        no_flush = jnp.zeros((), jnp.int32)
        folded_a, folded_c = (
            FoldedOperand(a_data, a_exp, no_flush),
            FoldedOperand(c_data, c_exp, no_flush),
        )
        return fp8_matmul(folded_a, folded_c, out_dtype=jnp.bfloat16)  # what mx_dot_general runs

    def run(a1, c1, a2, c2, a3, c3):
        return mm(a1, c1), mm(a2, c2), mm(a3, c3)

    return jax.jit(run)


def layer(recipe: str, backend: str):
    rec = dataclasses.replace(PRESETS[recipe], backend=backend)
    key = jax.random.key(1) if rec.needs_key else None

    def run(x, w, dy):
        y, vjp = jax.vjp(lambda a, b: mx_dot_general(a, b, DIMS, recipe=rec, key=key), x, w)
        return (y, *vjp(dy))

    return jax.jit(run)


def check_agreement(x, w, dy, recipe: str) -> tuple[bool, str]:
    f32 = lambda t: t.astype(jnp.float32)
    outs = {}
    for backend in ("emulate", "fp8"):
        outs[backend] = [np.asarray(o, np.float64) for o in layer(recipe, backend)(f32(x), f32(w), f32(dy))]
    errors = [
        np.abs(a - b).max() / np.abs(b).max() for a, b in zip(outs["fp8"], outs["emulate"], strict=True)
    ]
    ok = bool(np.all(np.isfinite(errors)) and max(errors) <= BOUND)
    text = ", ".join(f"{n} {e:.2e}" for n, e in zip(("y", "dx", "dw"), errors, strict=True))
    return ok, f"fp8 vs emulate ({recipe}, float32 in/out): max rel. error {text} (bound {BOUND:.0e})"


def check_hlo(x, w, dy, recipe: str, dump: str) -> tuple[bool, str]:
    text = layer(recipe, "fp8").lower(x, w, dy).compile().as_text()
    if dump:
        with open(dump, "w") as f:
            f.write(text)
    types = gemm_operand_types(text)
    fp8 = sum(t.startswith("f8") for t in types)
    wide = sum(t in ("bf16", "f16", "f32") for t in types)
    library = "__cublas$lt$matmul$f8" in text
    # A rotated GEMM rotates its two operands with a small matmul each (x @ H, contraction = the rotation
    # size; bf16 tensor cores for H16 on GPUs): those are the only wide GEMMs allowed.
    rec = PRESETS[recipe]
    rotations = sum(2 for g in (rec.fprop, rec.dgrad, rec.wgrad) if g.rotation.kind != "none")
    ok = fp8 >= 3 and wide <= rotations
    return ok, (
        f"compiled fp8 fwd+bwd ({recipe}): GEMM operand types {types}; {fp8} FP8 GEMMs, {wide} bf16/f16/f32 "
        f"GEMMs (at most {rotations} allowed: the rotations' matmuls); cuBLASLt FP8 custom call present: "
        f"{library}"
    )


def compile_variant(name: str, fn, args):
    """fn lowered and compiled for args, with the seconds each took (printed at once)."""
    start = time.perf_counter()
    lowered = fn.lower(*args)
    lowered_s = time.perf_counter() - start
    compiled = lowered.compile()
    compile_s = time.perf_counter() - start - lowered_s
    print(f"  compile {name}: lower {lowered_s:.1f} s, compile {compile_s:.1f} s", flush=True)
    return compiled, compile_s


def run(shapes, iters: int, recipes, dump: str, only=(), checks: bool = True):
    rows, notes, ok = [], [], True
    for m, k, n in shapes:
        x, w, dy = _operands(m, k, n)
        flops = 3 * 2 * m * n * k
        variants = {
            "xla fp8 dot x3 (pre-quantized)": (plain_fp8_fwd_bwd, plain_fp8_operands),
            "xla fp8 dot x3 (no algorithm: fast accum)": (
                lambda: plain_fp8_fwd_bwd(library_precision=False),
                plain_fp8_operands,
            ),
            "fp8 GEMMs x3 (pre-folded MXFP4)": (prefolded_fp8_gemms, prefolded_operands),
        }
        for recipe in recipes:
            for backend in ("emulate", "fp8"):
                variants[f"mx_dot {recipe} {backend} fwd+bwd"] = (
                    functools.partial(layer, recipe, backend),
                    lambda x, w, dy: (x, w, dy),
                )
        for name, (make_fn, make_args) in variants.items():
            if only and not any(o in name for o in only):
                continue
            args = make_args(x, w, dy)
            compiled, compile_s = compile_variant(name, make_fn(), args)
            seconds = harness.median_seconds(compiled, [args], iters)
            rows.append((f"{m}x{k}x{n}", name, compile_s, seconds * 1e3, flops / seconds / 1e12))
            print(
                f"{m}x{k}x{n}  {name:44s} compile {compile_s:6.1f} s  {seconds * 1e3:9.3f} ms  "
                f"{rows[-1][4]:8.1f} TFLOP/s",
                flush=True,
            )
        if (m, k, n) == shapes[0] and checks:
            flushed = [int(count_fold_flushes(q)) for q in mx_operands(x, w, dy)]
            notes.append(f"fold flushes on these random operands (6 operands): {flushed}")
            for check in (check_agreement(x, w, dy, recipes[0]), check_hlo(x, w, dy, recipes[0], dump)):
                ok &= check[0]
                notes.append(("ok: " if check[0] else "FAIL: ") + check[1])
                print(notes[-1], flush=True)
    return rows, notes, ok


def to_markdown(rows, notes, command: str) -> str:
    lines = [
        harness.heading("fp8 back end"),
        "",
        f"Command: `{command}`",
        "",
        "| M x K x N | variant (forward + both gradients) | compile s | median ms | TFLOP/s |",
        "|---|---|---:|---:|---:|",
    ]
    lines += [f"| {shape} | {name} | {cs:.1f} | {ms:.3f} | {tf:.1f} |" for shape, name, cs, ms, tf in rows]
    lines += [""] + [f"- {note}" for note in notes]
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="16384x4096x14336,8192x8192x8192", help="MxKxN,...")
    parser.add_argument("--recipes", default="mxfp4_full,mxfp4_full_h16")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--out", default="", help="write the markdown table here")
    parser.add_argument("--dump-hlo", default="", help="write the compiled fp8 fwd+bwd HLO text here")
    parser.add_argument("--only", default="", help="run only variants whose name contains one of these")
    parser.add_argument("--skip-checks", action="store_true", help="no agreement / HLO checks (3 compiles)")
    args = parser.parse_args()
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")]
    recipes = args.recipes.split(",")
    only = tuple(o for o in args.only.split(",") if o)
    rows, notes, ok = run(shapes, args.iters, recipes, args.dump_hlo, only, checks=not args.skip_checks)
    table = to_markdown(rows, notes, "python benchmarks/bench_fold.py " + " ".join(sys.argv[1:]))
    if args.out:
        with open(args.out, "w") as f:
            f.write(table)
    print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
