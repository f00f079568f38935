"""How an FP8 x FP8 GEMM with a per-tensor scale can write bfloat16 on an NVIDIA GPU: spellings side by side.

    PYTHONPATH=. python benchmarks/bench_fp8_epilogue.py [--out FILE.md]
    XLA_FLAGS=--xla_gpu_enable_triton_gemm=false PYTHONPATH=. python benchmarks/bench_fp8_epilogue.py

The fp8 recipes' GEMMs are sum_k a8 c8 times 1 / (scale_a * scale_c), rounded once to bfloat16
(backends.fp8_scaled_matmul). Per shape of the 1B model's step (M x K x N; the first operand E4M3, or
E5M2 for the Dgrad shape) and spelling: the median time over 20 back-to-back calls, TFLOP/s, the share
of outputs equal to the contract's ("f32 GEMM * s, then bf16"), the XLA GEMM calls in the compiled
program with their output types, and its fusion count. XLA flags are fixed per process: run it twice as
above to compare with and without XLA's Triton GEMM fusions (they take the dequantized spelling away from
cuBLASLt's FP8 GEMM).
"""

from __future__ import annotations

import argparse
import os
import re
import sys

import harness  # benchmarks/harness.py (this folder is on sys.path when run as a script)
import jax
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from fp4jax.ops.kernels.probes import describe_device, scaled_after, scaled_in_epilogue  # noqa: E402

PRESET = jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32
DIMS = (((2,), (2,)), ((0,), (0,)))
F32, BF16 = jnp.float32, jnp.bfloat16
SHAPES = ((32768, 2048, 8192, jnp.float8_e4m3fn), (32768, 8192, 2048, jnp.float8_e5m2))


def _dot(a, c, out, precision):
    return jax.lax.dot_general(a, c, DIMS, precision=precision, preferred_element_type=out)


SPELLINGS = {
    "f32 GEMM * s, then bf16 (the contract; the float32 path)": lambda a, c, s: scaled_after(
        a, c, s, jnp.dtype(BF16), PRESET
    ),
    "f32 GEMM, no scale": lambda a, c, s: _dot(a, c, F32, PRESET),
    "bf16 GEMM, no scale (the ceiling)": lambda a, c, s: _dot(a, c, BF16, PRESET),
    "bf16 GEMM, then * s (rounds twice)": lambda a, c, s: (_dot(a, c, BF16, PRESET).astype(F32) * s).astype(
        BF16
    ),
    "dequantized lhs, bf16 out (ops.scaled_in_epilogue)": lambda a, c, s: scaled_in_epilogue(
        a, c, s, jnp.dtype(BF16)
    ),
}


def gemm_calls(hlo: str) -> str:
    calls = []
    for line in hlo.splitlines():
        target = re.search(r'custom_call_target="(__cublas[^"]*)"', line)
        if target:
            out_type = re.search(r"= \(?(\w+)\[", line)
            calls.append(f"{target.group(1)} -> {out_type.group(1) if out_type else '?'}")
    if "__triton_gemm" in hlo or "gemm_fusion" in hlo:
        calls.append("Triton GEMM fusion")
    return ", ".join(calls) or "none"


def run() -> list[str]:
    rows = []
    for m, k, n, lhs_type in SHAPES:
        ka, kc = jax.random.split(jax.random.key(m + n))
        a = (jax.random.normal(ka, (1, m, k)) * 2).astype(lhs_type)
        c = (jax.random.normal(kc, (1, n, k)) * 2).astype(jnp.float8_e4m3fn)
        s = jnp.float32(1.0) / (jnp.float32(3.7) * jnp.float32(0.61))
        contract = None
        for name, fn in SPELLINGS.items():
            f = jax.jit(fn)
            try:
                hlo = f.lower(a, c, s).compile().as_text()
            except Exception as exc:  # noqa: BLE001 - a spelling this XLA cannot compile is a row too
                rows.append(f"| {m}x{k}x{n} | {name} | failed: {type(exc).__name__} | | | | |")
                continue
            seconds = harness.amortized_seconds(f, [(a, c, s)], calls=20, repeats=5)
            y = np.asarray(f(a, c, s).astype(F32))
            contract = y if contract is None else contract
            fusions = sum(" fusion(" in line for line in hlo[hlo.index("ENTRY") :].splitlines())
            rows.append(
                f"| {m}x{k}x{n} {jnp.dtype(lhs_type).name} | {name} | {seconds * 1e3:.3f} | "
                f"{2 * m * n * k / seconds / 1e12:.0f} | {np.mean(y == contract):.6f} | {gemm_calls(hlo)} "
                f"| {fusions} |"
            )
            print(rows[-1], flush=True)
    return rows


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    if describe_device().vendor != "nvidia":
        raise SystemExit(
            f"error: this compares cuBLASLt spellings: run it on an NVIDIA GPU, not {jax.devices()[0]}"
        )
    flags = os.environ.get("XLA_FLAGS", "") or "(none)"
    table = [
        harness.heading(
            "FP8 GEMM epilogue spellings", f"{jax.device_count()} x {jax.devices()[0].device_kind}"
        ),
        "",
        f"XLA_FLAGS: `{flags}`. Command: `python benchmarks/bench_fp8_epilogue.py`",
        "",
        "| M x K x N, lhs | spelling | ms | TFLOP/s | equal to the contract | GEMM calls -> output "
        "| fusions |",
        "|---|---|---:|---:|---:|---|---:|",
        *run(),
    ]
    harness.emit("\n".join(table) + "\n", args.out)


if __name__ == "__main__":
    main()
