"""Each block format's operand quantizer on the GPU: time, effective bandwidth and stored bytes per element.

    PYTHONPATH=. python benchmarks/bench_formats.py [--shapes 8192x8192] [--calls 20] [--out FILE.md]

For one bf16 operand per shape, quantized along its last axis by `quantized_dot.quantize_operand` (the
per-GEMM quantizer mx_dot_general calls, every format's path: quantize_mx for MX elements, quantize_nvfp4
for NVFP4, quantize_fp8 for FP8), it reports the amortized time per call (harness.amortized_seconds,
cycling over three inputs), the effective bandwidth (bf16 bytes read + the device's bytes written, over
the time) and what one element costs in storage, every array of the result counted (data, block scales,
tensor scales): the dtypes' bits, and the bytes the device holds (`on_device_size_in_bytes`: 8 bits for
a 4-bit dtype unless the platform packs it). This is the XLA quantizer every format has. For the MX
formats the last columns time the fused Pallas quantizer too (`rotate_quantize(impl="pallas")`, where
`pallas_supports` says it runs, else "-") and check that its bits are quantize_operand's; for the
elements the `fp8` back end folds (E2M1, E2M3), the operand that back end multiplies, made both ways: XLA's
quantize_operand then fold_mx_to_fp8, and the fused fold in one pass (`out="fp8_fold"`). Deterministic
rounding only (stochastic: --rounding in bench_quantize.py, which times the fused kernels' layouts).
"""

from __future__ import annotations

import argparse

import harness  # benchmarks/harness.py (this folder is on sys.path)
import jax
import jax.numpy as jnp
import numpy as np

from fp4jax.ops import QuantSpec, RotationSpec
from fp4jax.ops.kernels.fold import fold_mx_to_fp8, is_foldable
from fp4jax.ops.kernels.fused_quantize import pallas_supports, rotate_quantize
from fp4jax.ops.quantized_dot import quantize_operand

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
    table = [[*copy_row, f"{4 * n / copy / 1e12:.2f}", "", "", "", "", "", ""]]
    for name, spec in FORMATS.items():
        fn = jax.jit(lambda x, spec=spec: quantize_operand(x, spec, None, None))
        seconds = harness.amortized_seconds(fn, inputs, calls)
        result = fn(*inputs[0])
        bits, device_bytes = storage(result)
        speed = (2 * n + device_bytes) / seconds / 1e12
        per_element = [f"{bits / n:.3f}", f"{device_bytes / n:.3f}"]
        fused = _fused(spec, inputs, calls, result, 2 * n + device_bytes)
        folded = _folded(spec, inputs, calls, result)
        table.append([shape, name, f"{seconds * 1e6:.1f}", *per_element, f"{speed:.2f}", *fused, *folded])
        print(" | ".join(table[-1]), flush=True)
    return table


def _fused(spec: QuantSpec, inputs, calls: int, reference, moved_bytes: int) -> list[str]:
    """[us, TB/s, same bits] of the fused Pallas quantizer on this MX operand, or dashes where it does
    not run (another format, another platform, partial tiles)."""
    shape = inputs[0][0].shape
    if spec.kind != "mx" or not pallas_supports(shape, -1, spec, RotationSpec()):
        return ["-", "-", "-"]
    fn = jax.jit(lambda x: rotate_quantize(x, axis=-1, spec=spec, out="mx", impl="pallas"))
    seconds = harness.amortized_seconds(fn, inputs, calls)
    got = fn(*inputs[0])
    same = _same_bits((got.data, reference.data), (got.scale, reference.scale))
    return [f"{seconds * 1e6:.1f}", f"{moved_bytes / seconds / 1e12:.2f}", same]


def _folded(spec: QuantSpec, inputs, calls: int, quantized) -> list[str]:
    """[us of XLA's quantize + fold, us of the fused fold, same bits] of the fp8 back end's operand, or
    dashes for a format it does not fold (`quantized`, quantize_operand's result, is not foldable) or
    where the kernels do not run."""
    shape = inputs[0][0].shape
    if not is_foldable(quantized) or not pallas_supports(shape, -1, spec, RotationSpec()):
        return ["-", "-", "-"]
    xla = jax.jit(lambda x: fold_mx_to_fp8(quantize_operand(x, spec, None, None)))
    fused = jax.jit(lambda x: rotate_quantize(x, axis=-1, spec=spec, out="fp8_fold", impl="pallas"))
    times = [harness.amortized_seconds(fn, inputs, calls) for fn in (xla, fused)]
    want, got = xla(*inputs[0]), fused(*inputs[0])
    same = _same_bits((got.data, want.data), (got.row_exponent, want.row_exponent))
    return [f"{times[0] * 1e6:.1f}", f"{times[1] * 1e6:.1f}", same]


def _same_bits(*pairs) -> str:
    """ "yes" when every (got, want) pair of arrays holds the same bytes, else "NO"."""
    same = all(np.array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8)) for a, b in pairs)
    return "yes" if same else "NO"


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
        harness.heading("Operand quantizer per format (quantize_operand, XLA; fused Pallas for MX)"),
        "",
        "| shape | format | us | bits / element (dtypes) | device bytes / element | effective TB/s "
        "| fused us | fused TB/s | same bits "
        "| fp8 operand: XLA quantize + fold us | fused fold us | same bits |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|---:|---:|---|",
        *("| " + " | ".join(r) + " |" for r in rows),
        "",
    ]
    harness.emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()
