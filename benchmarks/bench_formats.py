"""Each block format's operand quantizer on the GPU: time, effective bandwidth and stored bytes per element.

    PYTHONPATH=. python benchmarks/bench_formats.py [--shapes 8192x8192] [--calls 20] [--out FILE.md]

For one bf16 operand per shape, quantized along its last axis by `fp4jax.ops.quantize_operand` (the
per-GEMM quantizer mx_dot_general calls, every format's path: quantize_mx for MX elements, quantize_nvfp4
for NVFP4, quantize_fp8 for FP8), it reports the amortized time per call (harness.amortized_seconds,
cycling over three inputs), the effective bandwidth (bf16 bytes read + the device's bytes written, over
the time) and what one element costs in storage, every array of the result counted (data, block scales,
tensor scales): the dtypes' bits, and the bytes the device holds (`on_device_size_in_bytes`: 8 bits for
a 4-bit dtype unless the platform packs it). This is the XLA quantizer every format has; the fused
Pallas quantizer (MXFP4 only) is timed by bench_quantize.py. Deterministic rounding only (stochastic:
--rounding in bench_quantize.py).
"""

from __future__ import annotations

import argparse

import harness  # benchmarks/harness.py (this folder is on sys.path)
import jax
import jax.numpy as jnp

from fp4jax.ops import QuantSpec, quantize_operand

FORMATS = {
    "mxfp4 (E2M1)": QuantSpec(kind="mx", elem="e2m1", scale_mode="even"),
    "mxfp6 (E2M3)": QuantSpec(kind="mx", elem="e2m3", scale_mode="even"),
    "mxfp6 (E3M2)": QuantSpec(kind="mx", elem="e3m2", scale_mode="even"),
    "mxfp8 (E4M3)": QuantSpec(kind="mx", elem="e4m3"),
    "nvfp4, 1D blocks": QuantSpec(kind="nvfp4"),
    "nvfp4, 2D 16x16 tiles": QuantSpec(kind="nvfp4", block_2d=True),
    "fp8 E4M3, current scaling": QuantSpec(kind="fp8", elem="e4m3"),
}


def _bits(dtype) -> int:
    """The width of one element of `dtype` in bits (4 for float4_e2m1fn, whose numpy itemsize is 1)."""
    info = jnp.iinfo if jnp.issubdtype(dtype, jnp.integer) else jnp.finfo
    return int(info(dtype).bits)


def storage(result) -> tuple[int, int]:
    """(bits by the dtypes, bytes on the device) of every array leaf of a quantized operand."""
    leaves = jax.tree_util.tree_leaves(result)
    bits = sum(leaf.size * _bits(leaf.dtype) for leaf in leaves)
    return bits, sum(leaf.on_device_size_in_bytes() for leaf in leaves)


def bench_shape(rows: int, cols: int, calls: int) -> list[list[str]]:
    """One table row per format for a (1, rows, cols) bf16 operand."""
    keys = jax.random.split(jax.random.key(0), 3)
    inputs = [(jax.random.normal(k, (1, rows, cols), jnp.float32).astype(jnp.bfloat16),) for k in keys]
    copy = harness.amortized_seconds(jax.jit(lambda x: x * 2), inputs, calls)
    n = rows * cols
    shape = f"{rows}x{cols}"
    copy_row = [shape, "copy ceiling (x * 2)", f"{copy * 1e6:.1f}", "16", "2.000"]
    table = [[*copy_row, f"{4 * n / copy / 1e12:.2f}"]]
    for name, spec in FORMATS.items():
        fn = jax.jit(lambda x, spec=spec: quantize_operand(x, spec, None, None))
        seconds = harness.amortized_seconds(fn, inputs, calls)
        bits, device_bytes = storage(fn(*inputs[0]))
        speed = (2 * n + device_bytes) / seconds / 1e12
        per_element = [f"{bits / n:.3f}", f"{device_bytes / n:.3f}"]
        table.append([shape, name, f"{seconds * 1e6:.1f}", *per_element, f"{speed:.2f}"])
        print(" | ".join(table[-1]), flush=True)
    return table


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8192x8192", help="MxK,... (bf16 operands)")
    parser.add_argument("--calls", type=int, default=20, help="back-to-back calls per timing")
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    rows = []
    for shape in args.shapes.split(","):
        m, k = (int(v) for v in shape.lower().split("x"))
        rows += bench_shape(m, k, args.calls)
    lines = [
        harness.heading("Operand quantizer per format (quantize_operand, XLA)"),
        "",
        "| shape | format | us | bits / element (dtypes) | device bytes / element | effective TB/s |",
        "|---|---|---:|---:|---:|---:|",
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
    ]
    harness.emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
