"""Fused rotate+quantize(+fold) against the reference XLA path: effective TB/s and bit-equality, on GPU.

    PYTHONPATH=. python benchmarks/bench_quantize.py [--shapes 8192x8192,16384x4096] [--iters 30]
        [--tiles mx_row=32x256x4,...] [--sweep | --access | --column-parts 0,8,16,32] [--out FILE.md]
        [--rounding stochastic [--sr-bits kernel,xla]] [--prescale 0.75]

For each bf16 operand shape, rotation (none, H16), layout (row: blocks along the last axis; col: along
the first, transposed result), and output (mx: packed E2M1 + E8M0; fp8_fold: the fp8 back end's
folded operand, E4M3 + int32 row exponents), it times

  reference  what quantized_dot runs where Pallas does not: rotation.rotate_blocks (a float32 matmul),
             quantize_mx, and fold_mx_to_fp8 for fp8_fold (the column layout swaps axes first),
  xla        fused_quantize's XLA formulation,
  pallas     fused_quantize's Triton kernels (under one KernelConfig: the default, or --tiles),

timed with harness.amortized_seconds (`--iters` back-to-back calls, one wait, median of 5), cycling over
three different inputs so that nothing stays in L2; `kernels` counts the compiled program's kernels.
The operand is AMD's MXFP4 (E2M1, blocks of 32, the even scale rule); --rounding and --prescale change
its rounding and prescale for every row (mxfp4_full_sr's Dgrad/Wgrad operand: --rounding stochastic;
mxfp4_full_sr_prescale's: --rounding stochastic --prescale 0.75). Every call then takes one fixed key
as an argument, so stochastic rounding draws its bits at run time (inside each timed call) as in
training, and `same` compares against quantize_mx with that key. --sr-bits picks the Pallas rows by
where their random bits come from (KernelConfig.kernel_bits): `kernel` (row "pallas": drawn inside the
kernels in both layouts, "always") and `xla` (row "pallas xla-bits": drawn by XLA, read by the kernels,
"never"), so `--sr-bits kernel,xla` times both in one process (the default, "columns", takes the
kernel's row for column-wise operands and XLA's for row-wise ones).
Effective TB/s = (bytes of the bf16 input + bytes of the outputs) / median time (stochastic rounding's
uint32 bits, written by XLA and read by the kernel in the xla-bits rows, are not counted); the copy
ceiling is a plain bf16 `x * 2` (read + write). `same` says whether the result equals, bit for bit, the
reference path with fused_quantize's rotation (hadamard_rotate, the rotation both fused paths share);
`vs matmul` gives the fraction of output bytes that differ from the literal reference (its matmul
rotation rounds differently, so H16 rows may differ in a few elements; rows without rotation must show 0).
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import traceback

import harness  # benchmarks/harness.py: timing, headings, output (this folder is on sys.path)
import jax
import jax.numpy as jnp

from fp4jax import ops
from fp4jax.ops import RotationSpec, quantize
from fp4jax.ops.kernels.fold import fold_mx_to_fp8
from fp4jax.ops.kernels.fused_quantize import KernelConfig, rotate_quantize
from fp4jax.ops.kernels.fused_quantize_pallas import Tile
from fp4jax.ops.kernels.tile_math import hadamard_rotate
from fp4jax.ops.quantized_dot import quantize_operand

SPEC = ops.get_recipe("mxfp4_full").fprop.lhs  # the library's MXFP4 operand (recipes.MXFP4)
KEY = jax.random.key(0)  # every timed function takes (x, key); stochastic rounding draws from it
ROTATIONS = {"none": RotationSpec(), "H16": RotationSpec(kind="deterministic", size=16)}


def _reference_fn(axis: int, rotation: RotationSpec, out: str, rotate):
    """The unfused path: rotate (matmul or the shared butterfly), quantize_mx (as quantized_dot calls it),
    fold."""

    def run(x, key):
        xt = x if axis == -1 else jnp.swapaxes(x, -1, -2)
        v = xt  # bf16, as quantized_dot rotates it (rotate_blocks: bf16 x bf16 for H16)
        if rotation.kind != "none":
            v = rotate(v, rotation.size)
        mx = quantize_operand(v, SPEC, key, None)  # quantized_dot's own call: quantize_mx along the last axis
        return mx if out == "mx" else fold_mx_to_fp8(mx)

    return jax.jit(run)


def _matmul_rotate(v, size):
    return ops.rotate_blocks(v, axis=-1, size=size)


def _butterfly_rotate(v, size):
    return hadamard_rotate(v.astype(jnp.float32).reshape(-1, v.shape[-1]), size).reshape(v.shape)


def _fused_fn(axis: int, rotation: RotationSpec, out: str, impl: str, config: KernelConfig = KernelConfig()):
    def run(x, key):
        return rotate_quantize(
            x, axis=axis, spec=SPEC, rotation=rotation, key=key, out=out, impl=impl, config=config
        )

    return jax.jit(run)


def _leaves(result) -> list[jax.Array]:
    """Every output array as integer bit patterns, on the device (so -0 and NaN compare exactly)."""
    if isinstance(result, quantize.MXArray):
        data = jax.lax.bitcast_convert_type(result.data.astype(jnp.float32), jnp.uint32)
        return [data, jax.lax.bitcast_convert_type(result.scale, jnp.uint8)]
    data = jax.lax.bitcast_convert_type(result.data, jnp.uint8)
    return [data, result.row_exponent, result.flushed_blocks]


def _differ_fraction(a, b) -> float:
    data_a, data_b = _leaves(a)[0], _leaves(b)[0]
    return float(jnp.mean(data_a != data_b)) if data_a.shape == data_b.shape else 1.0


def _same(a, b) -> bool:
    pairs = zip(_leaves(a), _leaves(b), strict=True)
    return all(x.shape == y.shape and bool(jnp.all(x == y)) for x, y in pairs)


def _io_bytes(m: int, k: int, out: str) -> int:
    read = 2 * m * k
    written = m * k // 2 + m * k // 32 if out == "mx" else m * k + 4 * m + 4
    return read + written


def _copy_ceiling(inputs, iters: int) -> tuple[float, float]:
    """(seconds, TB/s) of a bf16 x * 2: reads and writes 2 bytes per element."""
    seconds = harness.amortized_seconds(jax.jit(lambda x: x * 2), [(x,) for x in inputs], iters)
    return seconds, 4 * inputs[0].size / seconds / 1e12


def _activation_like(m: int, k: int) -> list[jax.Array]:
    """Three bf16 (m, k) inputs with heavy tails, like activations: a normal times a log-normal per row."""
    keys = jax.random.split(jax.random.key(0), 3)
    return [
        (jax.random.normal(kk, (m, k)) * jnp.exp(jax.random.normal(kk, (m, 1)))).astype(jnp.bfloat16)
        for kk in keys
    ]


def _copy_row(inputs, iters: int) -> tuple:
    m, k = inputs[0].shape
    seconds, ceiling = _copy_ceiling(inputs, iters)
    print(f"{m}x{k} bf16: copy (x*2) {ceiling:.2f} TB/s", flush=True)
    return (f"{m}x{k}", "-", "-", "-", "copy x*2", seconds * 1e6, ceiling, "", "", 1)


OUTPUTS = ("mx", "fp8_fold")


def run(shapes, iters: int, impls: list[str], config: KernelConfig) -> list[tuple]:
    rows = []
    for m, k in shapes:
        inputs = _activation_like(m, k)
        rows.append(_copy_row(inputs, iters))
        for rot_name, rotation in ROTATIONS.items():
            for layout, axis in (("row", -1), ("col", -2)):
                for out in OUTPUTS:
                    case = (inputs, m, k, rot_name, rotation, layout, axis, out, iters, impls, config)
                    rows += _one_case(*case)
    return rows


# --sr-bits: the Pallas row of each source of stochastic rounding's bits, and its KernelConfig.kernel_bits.
SR_BITS = {"kernel": ("pallas", "always"), "xla": ("pallas xla-bits", "never")}


def _candidates(axis, rotation, out, impls, config):
    """The implementations to time for one case, by name (those that apply to it)."""
    found = {"reference": _reference_fn(axis, rotation, out, _matmul_rotate)}
    found["xla"] = _fused_fn(axis, rotation, out, "xla")
    for name, kernel_bits in SR_BITS.values():
        changed = dataclasses.replace(config, kernel_bits=kernel_bits)
        found[name] = _fused_fn(axis, rotation, out, "pallas", changed)
    return {name: fn for name, fn in found.items() if name == "reference" or name in impls}


def _one_case(inputs, m, k, rot_name, rotation, layout, axis, out, iters, impls, config):
    rows = []
    same_rotation = _reference_fn(axis, rotation, out, _butterfly_rotate)(inputs[0], KEY)
    candidates = _candidates(axis, rotation, out, impls, config)
    literal = candidates["reference"](inputs[0], KEY)
    for impl, fn in candidates.items():
        kernels_run = 0
        try:
            seconds = harness.amortized_seconds(fn, [(x, KEY) for x in inputs], iters)
            kernels_run = harness.kernel_count(fn, inputs[0], KEY)
            result = fn(inputs[0], KEY)
            same = "-" if impl == "reference" else ("yes" if _same(result, same_rotation) else "NO")
            differ = f"{_differ_fraction(result, literal):.2e}"
            tbs = _io_bytes(m, k, out) / seconds / 1e12
        except Exception as e:  # a kernel that fails to compile is a row of the table, not a crash
            print("".join(traceback.format_exception_only(e))[-3000:], flush=True)
            seconds, tbs, same, differ = float("nan"), float("nan"), f"FAILED {type(e).__name__}", ""
        rows.append((f"{m}x{k}", rot_name, layout, out, impl, seconds * 1e6, tbs, same, differ, kernels_run))
        print(
            f"{m}x{k} {rot_name:4s} {layout} {out:8s} {impl:14s} {seconds * 1e6:9.1f} us "
            f"{tbs:6.2f} TB/s  same={same} vs_matmul={differ} kernels={kernels_run}",
            flush=True,
        )
    return rows


# The fold of rows that fit one pass (KernelConfig.one_pass_max_row), sent via the mx kernel instead.
VIA_MX = {"one_pass_max_row_rotated": 0, "one_pass_max_row_unrotated": 0}

# Candidates for --sweep, per (out, column layout): (name, KernelConfig changes); the first of each is
# the default. The fold's candidates are its two methods and the tiles of the fold through mx.
SWEEP = {
    ("mx", False): [("mx_row", t) for t in ((32, 256, 4), (64, 256, 8), (16, 512, 4))],
    ("mx", True): [("mx_column", t) for t in ((16, 256, 8), (32, 128, 8), (16, 256, 4))],
    ("fp8_fold", False): [("one_pass", None), ("via_mx", None)]
    + [("fold_from_mx", t) for t in ((16, 256, 8), (32, 512, 8))],
    ("fp8_fold", True): [("fold_from_mx", t) for t in ((32, 256, 8), (16, 256, 8), (32, 512, 8))],
}


def _sweep_config(base: KernelConfig, field: str, tile) -> tuple[str, KernelConfig]:
    """(row name, config) of one --sweep candidate."""
    if field == "one_pass":
        return "pallas one_pass", base
    if field == "via_mx":
        return "pallas via_mx", dataclasses.replace(base, **VIA_MX)
    changes = {field: Tile(*tile)}
    if field == "fold_from_mx" and tile is not None:
        changes.update(VIA_MX)  # a row fold reaches the fold_from_mx kernel only via mx
    return f"pallas {field} " + "x".join(map(str, tile)), dataclasses.replace(base, **changes)


def _time_candidate(fn, inputs, want, m, k, out, iters):
    try:
        seconds = harness.amortized_seconds(fn, [(x, KEY) for x in inputs], iters)
        same = "yes" if _same(fn(inputs[0], KEY), want) else "NO"
        return seconds, _io_bytes(m, k, out) / seconds / 1e12, same
    except Exception as e:
        print("".join(traceback.format_exception_only(e))[-2000:], flush=True)
        return float("nan"), float("nan"), f"FAILED {type(e).__name__}"


def sweep(m: int, k: int, iters: int, base: KernelConfig) -> list[tuple]:
    """Times each candidate tile / fold method of each Pallas kernel (H16, one shape)."""
    rows = []
    inputs = [jax.random.normal(kk, (m, k), jnp.bfloat16) for kk in jax.random.split(jax.random.key(1), 3)]
    rotation = ROTATIONS["H16"]
    for (out, column), candidates in SWEEP.items():
        axis, layout = (-2, "col") if column else (-1, "row")
        want = _reference_fn(axis, rotation, out, _butterfly_rotate)(inputs[0], KEY)
        for field, tile in candidates:
            name, config = _sweep_config(base, field, tile)
            fn = _fused_fn(axis, rotation, out, "pallas", config)
            seconds, tbs, same = _time_candidate(fn, inputs, want, m, k, out, iters)
            rows.append((f"{m}x{k}", "H16", layout, out, name, seconds * 1e6, tbs, same, "", 0))
            print(f"sweep {m}x{k} {layout} {out:8s} {name:28s} {seconds * 1e6:9.1f} us {tbs:6.2f} TB/s")
    return rows


# --access: how the parts of a tile are loaded (KernelConfig.split_loads for the mx kernel,
# one_pass_split_loads for the one-pass fold); the column layout's loads are contiguous either way.
MEMORY_ACCESS = {
    "strided loads": {"split_loads": False, "one_pass_split_loads": False},
    "split loads": {"split_loads": True, "one_pass_split_loads": True},
}


def access_sweep(shapes, iters: int, base: KernelConfig) -> list[tuple]:
    """Every memory access x fold method of the Pallas kernels, per shape, rotation and layout (the inputs
    of `run`), each checked bit for bit against the reference with the shared rotation."""
    rows = []
    for m, k in shapes:
        inputs = _activation_like(m, k)
        rows.append(_copy_row(inputs, iters))
        for (rot_name, rotation), (layout, axis) in itertools.product(
            ROTATIONS.items(), (("row", -1), ("col", -2))
        ):
            methods = [("mx", "")] + [("fp8_fold", "via_mx")] + [("fp8_fold", "one_pass")] * (axis == -1)
            for out, method in methods:
                config = dataclasses.replace(base, **VIA_MX) if method == "via_mx" else base
                case = (inputs, m, k, rot_name, rotation, layout, axis, out, method, iters, config)
                rows += _access_rows(*case)
    return rows


def _access_rows(inputs, m, k, rot_name, rotation, layout, axis, out, method, iters, base) -> list[tuple]:
    rows = []
    want = _reference_fn(axis, rotation, out, _butterfly_rotate)(inputs[0], KEY)
    for access, changes in MEMORY_ACCESS.items():
        if axis == -2 and access == "split loads":
            continue  # column tiles: the same kernels as without split loads
        fn = _fused_fn(axis, rotation, out, "pallas", dataclasses.replace(base, **changes))
        seconds, tbs, same = _time_candidate(fn, inputs, want, m, k, out, iters)
        name = f"pallas {method + ', ' if method else ''}{access}"
        rows.append((f"{m}x{k}", rot_name, layout, out, name, seconds * 1e6, tbs, same, "", 0))
        print(f"{m}x{k} {rot_name:4s} {layout} {out:8s} {name:30s} {seconds * 1e6:9.1f} us", flush=True)
    return rows


def column_parts_sweep(m: int, k: int, iters: int, sizes: list[int], base: KernelConfig) -> list[tuple]:
    """Times the unrotated column-wise kernels (mx, and the fold through it) for each column_parts size
    (0: the whole tile transposed) and each candidate column tile."""
    rows = []
    inputs = [jax.random.normal(kk, (m, k), jnp.bfloat16) for kk in jax.random.split(jax.random.key(2), 3)]
    rotation = ROTATIONS["none"]
    for out in OUTPUTS:
        want = _reference_fn(-2, rotation, out, _butterfly_rotate)(inputs[0], KEY)
        for size in sizes:
            for _, tile in SWEEP["mx", True]:
                config = dataclasses.replace(
                    base, column_parts=size, mx_column=Tile(*tile), mx_column_unrotated=Tile(*tile)
                )
                fn = _fused_fn(-2, rotation, out, "pallas", config)
                seconds, tbs, same = _time_candidate(fn, inputs, want, m, k, out, iters)
                name = f"parts {size} tile {'x'.join(map(str, tile))}"
                rows.append((f"{m}x{k}", "none", "col", out, name, seconds * 1e6, tbs, same, "", 0))
                print(f"parts {m}x{k} col {out:8s} {name:24s} {seconds * 1e6:9.1f} us {tbs:6.2f} TB/s {same}")
    return rows


TILE_FIELDS = [f.name for f in dataclasses.fields(KernelConfig) if f.type in (Tile, "Tile")]


def config_from_tiles(text: str) -> KernelConfig:
    """KernelConfig with --tiles overrides: comma-separated FIELD=ROWSxCOLSxWARPS (FIELD in TILE_FIELDS)."""
    changes = {}
    for item in filter(None, text.split(",")):
        name, dims = item.split("=")
        if name not in TILE_FIELDS:
            raise SystemExit(f"unknown tile {name!r} in --tiles: use one of {', '.join(TILE_FIELDS)}")
        changes[name] = Tile(*(int(v) for v in dims.split("x")))
    return dataclasses.replace(KernelConfig(), **changes)


def to_markdown(rows, command: str) -> str:
    lines = [
        harness.heading("Fused rotate+quantize"),
        "",
        f"Command: `{command}`",
        "",
        "| shape | rotation | layout | out | impl | us per call | TB/s | same | vs matmul | kernels |",
        "|---|---|---|---|---|---:|---:|---|---:|---:|",
    ]
    for shape, rot, layout, out, impl, us, tbs, same, differ, count in rows:
        cells = (shape, rot, layout, out, impl, f"{us:.1f}", f"{tbs:.2f}", same, differ, str(count or ""))
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def _pallas_rows(impls: list[str], sr_bits: str) -> list[str]:
    """--impls with "pallas" replaced by the Pallas row of each --sr-bits source."""
    unknown = set(sr_bits.split(",")) - set(SR_BITS)
    if unknown:
        raise SystemExit(f"unknown --sr-bits {', '.join(sorted(unknown))}: use {', '.join(SR_BITS)}")
    rows = [SR_BITS[source][0] for source in sr_bits.split(",")] if "pallas" in impls else []
    return [impl for impl in impls if impl != "pallas"] + rows


def _pair(text: str) -> tuple[int, int]:
    a, b = text.split("x")
    return int(a), int(b)


def main():
    global SPEC  # --rounding / --prescale: the operand every row quantizes
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="8192x8192,16384x4096", help="MxK,... (bf16 operands)")
    parser.add_argument("--iters", type=int, default=30, help="back-to-back calls per timing")
    parser.add_argument(
        "--impls",
        default="xla,pallas",
        help="which implementations to time besides the reference (comma-separated)",
    )
    parser.add_argument(
        "--tiles",
        default="",
        help="Pallas tile overrides, e.g. mx_row=32x256x4,mx_column=16x256x8 "
        "(rows x cols x warps; the Tile fields of fp4jax.ops.kernels.fused_quantize.KernelConfig)",
    )
    parser.add_argument("--out", default="", help="write the markdown table here")
    parser.add_argument(
        "--rounding", default=SPEC.rounding, choices=quantize.ROUNDING_MODES, help="the operand's rounding"
    )
    parser.add_argument("--prescale", type=float, default=SPEC.prescale, help="the operand's prescale")
    parser.add_argument(
        "--sr-bits",
        default="kernel",
        help="the Pallas rows by where stochastic rounding's bits come from, comma-separated: kernel "
        "(drawn in the kernels), xla (drawn by XLA and read by the kernels)",
    )
    parser.add_argument("--sweep", action="store_true", help="only time candidate Pallas tiles (first shape)")
    parser.add_argument(
        "--access",
        action="store_true",
        help="only time the Pallas kernels' memory accesses and fold methods (every shape, both rotations)",
    )
    parser.add_argument(
        "--column-parts",
        default="",
        help="only time the unrotated column kernels for these column_parts sizes, e.g. 0,8,16,32 "
        "(first shape; 0 = whole-tile transpose), each with the candidate column tiles",
    )
    args = parser.parse_args()
    SPEC = dataclasses.replace(SPEC, rounding=args.rounding, prescale=args.prescale)
    config = config_from_tiles(args.tiles)
    shapes = [_pair(s) for s in args.shapes.split(",")]
    impls = _pallas_rows(args.impls.split(","), args.sr_bits)
    if args.column_parts:
        sizes = [int(v) for v in args.column_parts.split(",")]
        rows = column_parts_sweep(*shapes[0], args.iters, sizes, config)
    elif args.access:
        rows = access_sweep(shapes, args.iters, config)
    elif args.sweep:
        rows = sweep(*shapes[0], args.iters, config)
    else:
        rows = run(shapes, args.iters, impls, config)
    tiles = ",".join(
        f"{name}={'x'.join(map(str, dataclasses.astuple(getattr(config, name))))}" for name in TILE_FIELDS
    )
    command = f"python benchmarks/bench_quantize.py --shapes {args.shapes} --iters {args.iters}"
    command += f" --impls {args.impls}"
    command += " --sweep" if args.sweep else ""
    command += " --access" if args.access else ""
    command += f" --column-parts {args.column_parts}" if args.column_parts else ""
    command += f" --rounding {args.rounding} --sr-bits {args.sr_bits} --prescale {args.prescale:g}"
    command += f" --tiles {tiles}"
    harness.emit(to_markdown(rows, command), args.out)


if __name__ == "__main__":
    main()
