"""Self-check: is fp4jax right, and fast, on this machine? The first command to run on a new GPU.

    python -m fp4jax.selfcheck                 # 8B layer GEMMs on a GPU, a scaled-down shape on CPU
    python -m fp4jax.selfcheck --small         # the scaled-down shape anywhere (quick)
    python -m fp4jax.selfcheck --backends fp8,emulate --train-steps 0

Prints the devices, the jax / jaxlib / plugin versions and the GEMM back end that `auto` picks and why.
Then, for every back end that can run here, the three GEMMs of one linear layer (fprop y = x W, dgrad
dx = dy W^T, wgrad dW = x^T dy) under the recipe (default mxfp4_full_h16) against `emulate`: the largest
error relative to emulate's largest output, the bound it must stay within, and TFLOP/s (median over
timed runs after warm-up; 3 GEMMs per forward+backward). On a GPU it also reads the compiled program
and says whether the GEMMs really run on FP8 operands. Then the same GEMM check for the full rung of
every block format (FORMAT_RECIPES: MXFP4, MXFP6 E2M3 and E3M2, MXFP8, NVFP4 and NVIDIA's NVFP4 recipe;
`--formats ""` skips it).
Finally a few training steps of the tiny model (loss finite and falling). Exit status 0 only if every
check passed, 1 otherwise, 2 on bad arguments.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import importlib.metadata
import math
import os
import re
import statistics
import sys
import tempfile
import time

import jax
import jax.numpy as jnp

from fp4jax.ops import BACKENDS, GEMMS, PRESETS, mx_dot_general, resolve_execution
from fp4jax.ops.kernels.backends import fp8_unfolded
from fp4jax.ops.kernels.probes import (
    DeviceDescription,
    choose_backend,
    describe_device,
    scaled_dot_compile_error,
)

__all__ = [
    "gemm_operand_types",
    "main",
    "relative_errors",
]

# One Llama 3.1-8B MLP projection: tokens x d_model -> d_ff (8192 tokens = one 8192-long sequence).
FULL_SHAPE = (8192, 4096, 14336)
SMALL_SHAPE = (256, 256, 512)
DIMS = (((1,), (0,)), ((), ()))  # x[T, K] @ w[K, N]

# Largest |backend - emulate| / max |emulate| accepted. On CPU both accumulate exactly in float32 (they
# differ only in summation order). FP8 tensor cores accumulate with reduced-precision partial sums (the
# fp8 product of an H200 measured 4.4e-6 relative to float64), MX tensor cores likewise: 1e-4 leaves
# room for that and still catches any wrong element (one E2M1 grid step moves an output by ~1e-2).
BOUNDS = {"cpu": 1e-6, "gpu": 1e-4}
# The full rung of every block format, each GEMM-checked on every back end of the machine.
FORMAT_RECIPES = ("mxfp4_full", "mxfp6_e2m3_full", "mxfp6_e3m2_full", "mxfp8", "nvfp4_full", "nvfp4_nvidia")


# ----------------------------------------------------------------------------------------------------
# what is here


def versions() -> dict[str, str]:
    """jax, jaxlib and every installed jax plugin / PJRT package."""
    found = {"jax": jax.__version__}
    for dist in importlib.metadata.distributions():
        name = (dist.metadata["Name"] or "").lower()
        if name == "jaxlib" or (name.startswith("jax-") and ("plugin" in name or "pjrt" in name)):
            found[name] = dist.version
    return found


def available_backends(desc: DeviceDescription) -> list[str]:
    """The back ends worth running on this device (emulate always; the others where hardware backs them,
    and all of them on CPU, where XLA computes FP8 and scaled dots exactly in float32)."""
    order = ("emulate", "fp8", "native")  # each back end's hardware can also run the ones before it
    best = choose_backend(desc).backend if desc.vendor != "cpu" else "native"  # the dispatch table's pick
    if best == "native" and scaled_dot_compile_error() is not None:
        best = "fp8"
    return list(order[: order.index(best) + 1])


# ----------------------------------------------------------------------------------------------------
# the GEMM check


def _operands(tokens: int, d_model: int, d_ff: int):
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    # float32, so that the gradients come back in float32 too and the comparison sees the GEMMs alone.
    x = jax.random.normal(kx, (tokens, d_model), jnp.float32)
    w = jax.random.normal(kw, (d_model, d_ff), jnp.float32) * 0.02
    dy = jax.random.normal(kg, (tokens, d_ff), jnp.float32) * 1e-3
    return x, w, dy


def layer_gemms(recipe_name: str, backend: str, quantizer: str = "auto"):
    """A jitted (x, w, dy) -> (y, dx, dw) in float32: the layer's three GEMMs under one back end."""
    recipe = dataclasses.replace(PRESETS[recipe_name], backend=backend, quantizer=quantizer)
    key = jax.random.key(1) if recipe.needs_key else None

    def fwd(x, w):
        return mx_dot_general(x, w, DIMS, recipe=recipe, key=key, preferred_element_type=jnp.float32)

    def run(x, w, dy):
        y, vjp = jax.vjp(fwd, x, w)
        dx, dw = vjp(dy)
        return y, dx, dw

    return jax.jit(run)


def median_seconds(fn, *args, warmup: int = 2, iters: int = 5) -> float:
    for _ in range(warmup):
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(iters):
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


@jax.jit
def relative_errors(outs, reference) -> jax.Array:
    """max |o - r| / max |r| of each output against its reference, computed where the arrays live: at the
    8B shape the three outputs are 208M floats, which copied to the host in float64 took longer than the
    GEMMs. In float32 that loses nothing the bounds can see: o - r is exact where o and r are within a
    factor of 2 (Sterbenz), and rounded by at most 2**-24 of itself elsewhere. A NaN or Inf anywhere gives
    a non-finite error (a failed check)."""
    return jnp.stack(
        [
            jnp.max(jnp.abs(o - r)) / jnp.maximum(jnp.max(jnp.abs(r)), 1e-30)
            for o, r in zip(outs, reference, strict=True)
        ]
    )


_DEFINITION = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*\(?(\w+)\[")
_GEMM_CALL = re.compile(r"\b(?:dot|custom-call)\(\s*(?:(\w+)\[[^\]]*\]\S*\s+)?%?([\w.\-]+)")


def _is_gemm(line: str) -> bool:
    if " dot(" in line:
        return True
    target = re.search(r'custom_call_target="([^"]*)"', line)
    return (
        " custom-call(" in line
        and target is not None
        and re.search(r"matmul|gemm", target.group(1)) is not None
    )


def gemm_operand_types(hlo_text: str) -> list[str]:
    """The element type of the first operand of every dot / library GEMM call in compiled HLO text
    (e.g. ['f8e4m3fn', 'f8e4m3fn', 'f8e4m3fn'] when all three GEMMs run on FP8 operands). Reads operand
    types printed inline, or else looks the operand up by name (newer HLO text omits operand shapes)."""
    lines = hlo_text.splitlines()
    types = {}
    for line in lines:
        match = _DEFINITION.match(line)
        if match:
            types[match.group(1)] = match.group(2)
    found = []
    for line in lines:
        call = _GEMM_CALL.search(line) if _is_gemm(line) else None
        if call:
            found.append(call.group(1) or types.get(call.group(2), "?"))
    return found


def _with_emulate_first(backend_names) -> list[str]:
    return ["emulate"] + [b for b in backend_names if b != "emulate"]


GPU_COMPILE_THREADS = 8


def default_compile_threads(on_gpu: bool) -> int:
    """--compile-threads' default: 1 where XLA compiles for the CPU (on 2 cores one thread was fastest,
    compile_all), one per core up to GPU_COMPILE_THREADS where it compiles for a GPU, so that a GPU host's
    cores compile the programs side by side."""
    return min(GPU_COMPILE_THREADS, os.cpu_count() or 1) if on_gpu else 1


def compile_all(recipes, shape, backend_names, quantizer: str = "auto", threads: int = 1) -> dict:
    """{(recipe, backend): compiled layer_gemms} for every pair, each program compiled once (the checks
    run, time and read the HLO of these executables; reading it by compiling again doubled the fp8 back
    end's compiles), on `threads` threads (0: one per core). Most of the self-check's time is compiling;
    on a 2-core CPU one thread was fastest (2026-12-05: 20 s for 21 programs, 43 s on two threads)."""
    x, w, dy = _operands(*shape)
    pairs = [(r, b) for r in recipes for b in _with_emulate_first(backend_names)]
    start = time.perf_counter()
    threads = min(len(pairs), threads or os.cpu_count() or 1)
    with concurrent.futures.ThreadPoolExecutor(max_workers=threads) as pool:
        compiled = pool.map(lambda p: layer_gemms(*p, quantizer).lower(x, w, dy).compile(), pairs)
        out = dict(zip(pairs, compiled, strict=True))
    seconds = time.perf_counter() - start
    print(f"\ncompiled {len(pairs)} layer programs in {seconds:.1f} s on {threads} thread(s)")
    return out


def check_gemms(
    recipe: str, shape, backend_names, bound: float, on_gpu: bool, quantizer: str = "auto", compiled=None
) -> bool:
    """The layer's GEMMs of `recipe` on each back end against emulate's (`compiled`: compile_all's
    executables, else each is compiled here)."""
    tokens, d_model, d_ff = shape
    x, w, dy = _operands(tokens, d_model, d_ff)
    flops = 3 * 2 * tokens * d_model * d_ff
    reference = None
    ok = True
    print(f"\nGEMMs of one layer, recipe {recipe}: tokens {tokens} x d_model {d_model} x d_ff {d_ff}")
    for backend in _with_emulate_first(backend_names):
        if compiled is None:
            fn = layer_gemms(recipe, backend, quantizer).lower(x, w, dy).compile()
        else:
            fn = compiled[recipe, backend]
        outs = jax.block_until_ready(fn(x, w, dy))
        seconds = median_seconds(fn, x, w, dy)
        line = f"  {backend:8s} {flops / seconds / 1e12:9.2f} TFLOP/s ({seconds * 1e3:.2f} ms fwd+bwd)"
        if reference is None:
            reference = outs
            print(line + "  [reference]")
            continue
        errors = [float(e) for e in relative_errors(outs, reference)]
        agree = all(math.isfinite(e) for e in errors) and max(errors) <= bound
        ok &= agree
        detail = ", ".join(f"{n} {e:.2e}" for n, e in zip(GEMMS, errors, strict=True))
        print(f"{line}  max rel. error vs emulate: {detail}  (bound {bound:.0e}) {_verdict(agree)}")
        if on_gpu and backend == "native":
            text = fn.as_text()
            block_scaled = any(t in text for t in ("matmul$mx", "blockScaled", "block_scaled"))
            print(f"           block-scaled library GEMM in the compiled program: {block_scaled}")
        if on_gpu and backend == "fp8":
            types = gemm_operand_types(fn.as_text())
            fp8_gemms = sum(t.startswith("f8") for t in types)
            print(f"           GEMM operand types in the compiled program: {types}")
            if not fp8_unfolded(PRESETS[recipe]):
                ok &= _report(fp8_gemms >= 3, "all three GEMMs run on FP8 operands")
            else:
                print("           its MX elements do not fold into E4M3: the GEMMs run as in emulate")
    return ok


# ----------------------------------------------------------------------------------------------------
# the training check


def tiny_config(recipe: str, steps: int):
    """The tiny model on the bundled C4 sample, shortened to `steps` updates without evals or saves."""
    from fp4jax.configs import rungs

    c = rungs.rung("tiny_c4", recipe)
    c.steps = steps
    c.optimizer.update(warmup_steps=max(1, steps // 4), lr_decay_steps=max(steps, 2))
    c.eval_every_sequences = 10**9
    c.eval_at_end = False
    c.checkpoint_every_steps = 10**9
    c.progress_bar = False
    c.tensorboard = False
    return c


def training_losses(workdir: str) -> list[float]:
    from fp4jax.training.metrics import read_metrics, train_records

    return [float(r["loss"]) for r in train_records(read_metrics(workdir))]


def check_training(recipe: str, steps: int) -> bool:
    from fp4jax.train import train

    print(f"\nTraining the tiny model, recipe {recipe}, {steps} steps")
    with tempfile.TemporaryDirectory(prefix="fp4jax_selfcheck_") as workdir:
        start = time.perf_counter()
        try:
            train(tiny_config(recipe, steps), workdir)
        except Exception as exc:  # report any failure as a failed check, with its one-line reason
            print(f"  training failed: {type(exc).__name__}: {exc}")
            return _report(False, "training ran")
        losses = training_losses(workdir)
    print(f"  losses: {' '.join(f'{v:.3f}' for v in losses)}  ({time.perf_counter() - start:.1f} s)")
    finite = len(losses) == steps and all(math.isfinite(v) for v in losses)
    tail = losses[-max(1, steps // 4) :]
    falling = finite and sum(tail) / len(tail) < losses[0] - 0.02
    return _report(finite, "loss finite at every step") & _report(falling, "loss falling")


# ----------------------------------------------------------------------------------------------------


def _verdict(ok: bool) -> str:
    return "AGREE" if ok else "DISAGREE"


def _report(ok: bool, what: str) -> bool:
    print(f"  {'ok  ' if ok else 'FAIL'} {what}")
    return ok


def parse_args(argv):
    parser = argparse.ArgumentParser(prog="python -m fp4jax.selfcheck", description=__doc__.splitlines()[0])
    size = parser.add_mutually_exclusive_group()
    size.add_argument("--small", action="store_true", help=f"GEMM shape {SMALL_SHAPE} (default on CPU)")
    size.add_argument("--full", action="store_true", help=f"GEMM shape {FULL_SHAPE} (default on GPU)")
    parser.add_argument("--recipe", default="mxfp4_full_h16", help="preset for the GEMMs and training")
    parser.add_argument("--backends", default="", help="comma list (default: every one available here)")
    parser.add_argument(
        "--compile-threads",
        type=int,
        default=None,
        help="threads compiling the GEMM programs (default: 1 on a CPU back end, one per core up to "
        f"{GPU_COMPILE_THREADS} on a GPU host; 0: one per core)",
    )
    parser.add_argument("--train-steps", type=int, default=12, help="tiny-model updates (0: skip)")
    parser.add_argument(
        "--formats", default=",".join(FORMAT_RECIPES), help="comma list of presets GEMM-checked as well"
    )
    args = parser.parse_args(argv)
    if args.recipe not in PRESETS:
        parser.error(f"unknown recipe {args.recipe!r}: use one of {', '.join(PRESETS)}")
    for name in filter(None, args.formats.split(",")):
        if name not in PRESETS:
            parser.error(
                f"unknown --formats preset {name!r}: use presets such as {', '.join(FORMAT_RECIPES)}"
            )
    for name in filter(None, args.backends.split(",")):
        if name not in BACKENDS or name == "auto":
            parser.error(f"unknown back end {name!r}: use emulate, fp8 or native")
    if args.compile_threads is not None and args.compile_threads < 0:
        parser.error("--compile-threads must be >= 0 (0: one per core)")
    if args.train_steps < 0 or args.train_steps == 1:
        parser.error("--train-steps must be 0 (skip) or at least 2")
    return args


def resolved_execution(recipe: str):
    """What the trainer would run `recipe` with here (the environment's overrides applied, as in
    training.setup), or None after printing a one-line error."""
    from fp4jax.training import setup
    from fp4jax.training.errors import ConfigError

    try:
        overrides = setup.execution_overrides()
        source = f"environment variable {setup.GEMM_BACKEND_ENV}"
        return resolve_execution(PRESETS[recipe], **overrides, source=source)[1]
    except (ConfigError, ValueError) as exc:
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr)
        return None


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    devices = jax.devices()
    desc = describe_device(devices[0])
    on_gpu = desc.vendor in ("nvidia", "amd")
    print(f"devices: {len(devices)} x {desc.name} (vendor {desc.vendor}, architecture {desc.arch or '-'})")
    print("versions: " + ", ".join(f"{k} {v}" for k, v in versions().items()))
    choice = choose_backend(desc)
    print(f"auto picks: {choice.backend} ({choice.reason}); fold type {jnp.dtype(choice.fp8_dtype).name}")
    execution = resolved_execution(args.recipe)
    if execution is None:
        return 2
    print(
        f"recipe {args.recipe} here: GEMM back end {execution.backend} ({execution.backend_reason}); "
        f"quantizer {execution.quantizer}: {execution.quantizer_runs}"
    )
    chosen = [b for b in args.backends.split(",") if b] or available_backends(desc)
    shape = SMALL_SHAPE if args.small or (not args.full and not on_gpu) else FULL_SHAPE
    bound = BOUNDS["gpu" if on_gpu else "cpu"]

    recipes = [args.recipe] + [n for n in filter(None, args.formats.split(",")) if n != args.recipe]
    threads = default_compile_threads(on_gpu) if args.compile_threads is None else args.compile_threads
    compiled = compile_all(recipes, shape, chosen, execution.quantizer, threads)
    ok = True
    for name in recipes:
        ok &= check_gemms(name, shape, chosen, bound, on_gpu, execution.quantizer, compiled)
    if args.train_steps:
        ok &= check_training(args.recipe, args.train_steps)
    print(f"\nself-check {'PASSED' if ok else 'FAILED'}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
