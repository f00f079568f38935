"""The compiled train step's memory, without running a step: XLA's buffer sizes and what is live at the peak.

    PYTHONPATH=. python benchmarks/step_memory.py --config configs/llama1b_pg_bf16.py \
        --recipes bf16,mxfp4_full_h16 [--top 12] [--out FILE.md] [--dump-dir DIR] [--config.KEY=VALUE ...]

For each recipe the real train step (fp4jax.training.setup.jit_steps) is lowered on abstract arrays, so
nothing is allocated and a model too large for the device can still be sized, and compiled. Reported:
`compiled.memory_analysis()` (temporaries, arguments, outputs) and, from XLA's live-range dump of the step
(module jit_train_step), the largest buffers live at its peak. A buffer that one recipe has at the peak
and another lacks is where their difference lies: that is how the Pallas quantizer's transposed float32
weight copies were found (docs/performance.md). XLA's dump (HLO text and LLVM IR, megabytes a recipe) goes
to a temporary folder removed at the end, or to --dump-dir, which is kept for reading.
"""

from __future__ import annotations

import argparse
import glob
import os
import re
import shutil
import sys
import tempfile

import jax
import jax.numpy as jnp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import bench_train  # noqa: E402  (benchmarks/: on sys.path when run as a script)
import harness  # noqa: E402

from fp4jax.models.sharding import sharding_context  # noqa: E402
from fp4jax.training import checkpoint, setup  # noqa: E402

_PEAK = re.compile(r"^\s*Live ranges at \d+ \(peak\):")
_LIVE = re.compile(r"^\s+(\S+): (\d+) bytes \(cumulative")


def peak_buffers(live_range_text: str) -> list[tuple[str, int]]:
    """(buffer, bytes) live at the peak of an XLA live-range dump, largest first."""
    lines = live_range_text.splitlines()
    start = next((i for i, line in enumerate(lines) if _PEAK.match(line)), None)
    if start is None:
        return []
    buffers = []
    for line in lines[start + 1 :]:
        m = _LIVE.match(line)
        if not m:
            break
        buffers.append((m.group(1), int(m.group(2))))
    return sorted(buffers, key=lambda b: -b[1])


def _abstract_state(model, tx, mesh, config):
    """The step-0 state as sharded ShapeDtypeStructs: the trainer's shapes and shardings, no arrays."""
    abstract, shardings, _ = setup.lazy_train_state(model, tx, mesh, config.seed, config.seq_len)
    return checkpoint.abstract_like(abstract, shardings), shardings


def request_dump(folder: str | None = None) -> str:
    """Asks XLA to dump the train step's buffer assignment and live ranges into `folder` (None: a new
    temporary folder, which the caller removes).

    XLA reads its flags once, when the first backend starts: call this before any jax computation."""
    if folder is None:
        folder = tempfile.mkdtemp(prefix="step_memory_")
    else:
        os.makedirs(folder, exist_ok=True)
    flags = f"--xla_dump_to={folder} --xla_dump_hlo_as_text --xla_dump_hlo_module_re=jit_train_step"
    os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip()
    return folder


def measure(config, recipe: str, dump_dir: str) -> dict:
    config = config.copy_and_resolve_references()
    config.recipe = recipe
    config = setup.resolve_config(config)  # checks the recipe: an unknown one is a one-line error
    mesh = setup.make_run_mesh(config)
    before = set(glob.glob(os.path.join(dump_dir, "*live-range.txt")))
    with sharding_context(mesh):
        _, model, _, tx, schedule = setup.build_model_and_optimizer(config)
        state, shardings = _abstract_state(model, tx, mesh, config)
        train_fn, _ = setup.jit_steps(config, model, tx, schedule, mesh, shardings)
        batch = {
            k: jax.ShapeDtypeStruct((config.global_batch, config.seq_len), jnp.int32)
            for k in ("inputs", "targets")
        }
        compiled = train_fn.lower(state, batch, setup.quant_key(config.seed)).compile()
    m = compiled.memory_analysis()
    dumps = sorted(set(glob.glob(os.path.join(dump_dir, "*live-range.txt"))) - before, key=os.path.getmtime)
    peak = peak_buffers(open(dumps[-1]).read()) if dumps else []
    return {
        "recipe": recipe,
        "temp_gb": m.temp_size_in_bytes / 1e9,
        "argument_gb": m.argument_size_in_bytes / 1e9,
        "output_gb": m.output_size_in_bytes / 1e9,
        "alias_gb": m.alias_size_in_bytes / 1e9,
        "peak": peak,
    }


def to_markdown(rows, command: str, top: int) -> str:
    lines = [
        harness.heading(
            "Compiled train-step memory", f"{jax.device_count()} x {jax.devices()[0].device_kind}"
        ),
        "",
        f"Command: `{command}`",
        "",
        "| recipe | temporaries GB | arguments GB | outputs GB | aliased GB | buffers live at the peak |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['recipe']} | {r['temp_gb']:.2f} | {r['argument_gb']:.2f} | {r['output_gb']:.2f} | "
            f"{r['alias_gb']:.2f} | {len(r['peak'])} |"
        )
    for r in rows:
        lines += [
            "",
            f"Largest buffers live at the peak, {r['recipe']}:",
            "",
            "| buffer | GB |",
            "|---|---:|",
        ]
        lines += [f"| `{name}` | {size / 1e9:.3f} |" for name, size in r["peak"][:top]]
    return "\n".join(lines) + "\n"


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--recipes", default="bf16,mxfp4_full_h16")
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--out", help="also write the table to this file")
    parser.add_argument("--dump-dir", help="keep XLA's dump of the step here (default: a temporary folder)")
    args, overrides = parser.parse_known_args(argv)
    dump_dir = request_dump(args.dump_dir)
    try:
        config = bench_train.load_config(args.config, overrides)
        print(f"xla options: {setup.apply_xla_options(config)}", flush=True)  # as the trainer's command line
        rows = []
        for recipe in args.recipes.split(","):
            rows.append(measure(config, recipe, dump_dir))
            print(f"{recipe}: temporaries {rows[-1]['temp_gb']:.2f} GB", flush=True)
    finally:
        if args.dump_dir is None:
            shutil.rmtree(dump_dir, ignore_errors=True)
    command = " ".join(["python benchmarks/step_memory.py", *sys.argv[1:]])
    harness.emit(to_markdown(rows, command, args.top), args.out)


if __name__ == "__main__":
    main()
