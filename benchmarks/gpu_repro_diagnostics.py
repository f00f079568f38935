"""Bisects the GPU compile failure of fp4jax.gemm_errors.capture_operands in one short process.

On one H200 (jax 0.11.2) jitting capture_operands on the tiny model failed while compiling with
`IndexError: absl::container_internal::raw_hash_map<>::at` (a C++ map lookup of XLA's that found
nothing). This script compiles the same capture under one change at a time and prints, for each
variant, ok or the error, then the full traceback of the first failure:

    JAX_PLATFORMS=cuda python benchmarks/gpu_repro_diagnostics.py        (< 90 s on one GPU)

Variants (each against the baseline = what tests/test_diagnostics.py compiles: tiny model, attention
"auto" (cuDNN flash attention on NVIDIA), remat "full", XLA's deterministic ops on, as tests/conftest.py
sets them on a GPU):
  baseline, deterministic_off, attention_xla, remat_none, no_perturb (dy not captured: sow only, then
  the gradient of the params instead), scanned_params (params of a scan_layers=True model), and the two
  reference GEMMs the probe runs on captured operands (bf16 x bf16 -> f32, and f32 at HIGHEST).
XLA flags are per compile here (`Lowered.compile(compiler_options)`), so one process covers them all.
"""

from __future__ import annotations

import os

os.environ.setdefault("JAX_TRACEBACK_FILTERING", "off")
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import dataclasses  # noqa: E402
import functools  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
import traceback  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from fp4jax import gemm_errors as diag  # noqa: E402
from fp4jax.models.llama import Llama, llama_config  # noqa: E402

TINY = dict(vocab_size=256, d_model=64, n_heads=4, n_kv_heads=4, head_dim=16, d_ff=64, n_layers=2)
BUDGET_S = 80.0


def _model(**overrides) -> tuple[Llama, dict, dict]:
    cfg = dataclasses.replace(llama_config("tiny", **TINY), **overrides)
    model = Llama(cfg, recipe="mxfp4_full_sr")
    tokens = jax.random.randint(jax.random.key(0), (2, 33), 0, cfg.vocab_size)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    params = nn.meta.unbox(jax.jit(model.init)(jax.random.key(1), batch["inputs"])["params"])
    return model, params, batch


def _capture_without_perturb(model_cfg, params, batch):
    """capture_operands' forward with x and W sown but no perturbation (so no dy), then the gradient of
    the params in place of the cotangents'."""
    model, params = diag.capture_model(model_cfg), diag.per_block_params(params, model_cfg)

    def loss(p):
        return diag.recorded_loss(model, {"params": p}, batch, [diag.OPERANDS], perturb=False)

    (value, sown), grads = jax.value_and_grad(loss, has_aux=True)(params)
    return value, sown, grads


def _variants():
    """(name, thunk returning (function, args), compiler options)."""
    det_on = {"xla_gpu_deterministic_ops": True}
    det_off = {"xla_gpu_deterministic_ops": False}

    def capture(**overrides):
        model, params, batch = _model(**overrides)
        return functools.partial(diag.capture_operands, model.config), (params, batch)

    def no_perturb():
        model, params, batch = _model()
        return functools.partial(_capture_without_perturb, model.config), (params, batch)

    def reference(dtype):
        a = jax.random.normal(jax.random.key(2), (1, 64, 96)).astype(dtype)
        c = jax.random.normal(jax.random.key(3), (1, 80, 96)).astype(dtype)
        return diag.reference_output, (a, c)

    return [
        ("baseline", capture, det_on),
        ("deterministic_off", capture, det_off),
        ("attention_xla", functools.partial(capture, attention="xla"), det_on),
        ("remat_none", functools.partial(capture, remat="none"), det_on),
        ("attention_xla+remat_none", functools.partial(capture, attention="xla", remat="none"), det_on),
        ("no_perturb", no_perturb, det_on),
        ("scanned_params", functools.partial(capture, scan_layers=True), det_on),
        ("unscanned_params", functools.partial(capture, scan_layers=False), det_on),
        ("reference_bf16_f32_dot", functools.partial(reference, jnp.bfloat16), det_on),
        ("reference_f32_highest_dot", functools.partial(reference, jnp.float32), det_on),
    ]


def main() -> int:
    print(f"jax {jax.__version__}, devices {jax.devices()}", flush=True)
    start, first_failure, results = time.perf_counter(), None, []
    for name, make, options in _variants():
        if time.perf_counter() - start > BUDGET_S:
            print(f"{name:28s} skipped (over the {BUDGET_S:.0f} s budget)", flush=True)
            continue
        t0 = time.perf_counter()
        try:
            fn, args = make()
            compiled = jax.jit(fn).lower(*args).compile(compiler_options=options)
            jax.block_until_ready(compiled(*args))
            status = "ok"
        except Exception as e:  # report every variant, keep the first traceback
            status = f"FAILED {type(e).__name__}: {str(e).splitlines()[0][:120]}"
            if first_failure is None:
                first_failure = (name, traceback.format_exc())
        results.append((name, status))
        print(f"{name:28s} {status}  ({time.perf_counter() - t0:.1f} s)", flush=True)
    if first_failure is not None:
        print(
            f"\n=== full traceback of the first failure ({first_failure[0]}) ===\n{first_failure[1]}",
            flush=True,
        )
    failed = [n for n, s in results if s != "ok"]
    print(f"failed: {', '.join(failed) or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
