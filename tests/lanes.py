"""What differs between the two test lanes, stated once and applied only where it holds.

- CPU lane (the default, what CI runs): 8 fake CPU devices (conftest.py), IEEE float32 accumulation.
- GPU lane (`JAX_PLATFORMS=cuda,cpu` or `rocm,cpu`, see docs/testing.md): the real devices, however many, and
  tensor-core GEMMs.

Two things change on a GPU and nothing else may:
1. How many devices there are: meshes are built from the devices present (2 x 4 on the 8 CPU devices).
2. How low-precision GEMMs accumulate. Every GEMM the tests check multiplies exact values with float32
   accumulation on the CPU, and is held to FLOAT32_RTOL x |A||B| there. On a GPU, so are GEMMs that run
   as bf16 or float32 (precision HIGHEST) dots. GEMMs that run on FP8 (or MX) tensor cores do not
   accumulate in IEEE float32: Hopper's FP8 tensor cores add products in an accumulator of about 13
   fraction bits (aligned to the largest term, truncated) and fold the partial sums into float32 between
   MMA steps. NVIDIA does not document how many products share one truncation, so the lane uses an
   envelope fitted with margin to measurements, not a derivation: one loss of 2^-13 x |A||B| per 16
   products plus a floor of 4 such losses,
       |error| <= (FLOAT32_RTOL + (ceil(K / 16) + 4) 2^-13) |A||B|   for a contraction of length K.
   Measured on one H200 (jax 0.11.2, 2026-11-30, cuBLASLt FP8 without fast accumulation), in units of
   2^-13 |A||B|: worst 4.4 at K = 32, 5.3 at K = 48, 7.3 at K = 64 (allowed 6, 7, 8), and within 32 at
   K = 512 (allowed 36); one loss per 16 products alone was exceeded by 6 tests, per 8 by 2. On
   2026-12-04 the FP8 Wgrad of test_formats_nvfp4_gemm's nvfp4_fprop_dgrad reached 5.6 at K = 32. Those
   GEMMs are FP8 x FP8 (XLA emits an FP8 GEMM) and, where `auto` picks the fp8 back end (Hopper, MI300) or
   the native one (gfx950, Blackwell), GEMMs of two quantized operands. The bound is weaker than the
   CPU's (4.4e-3 |A||B| at K = 512 against the ~1e-2 |A||B| that one element rounded one grid step
   differently moves an output in these tests); the quantized operands themselves are compared bit for
   bit on every lane (test_quantize, test_fold).
"""

import math

import jax
import numpy as np

from fp4jax.ops.kernels import backends, probes

ON_GPU = jax.default_backend() == "gpu"  # CUDA and ROCm alike

FLOAT32_RTOL = 1e-5
FP8_ACCUMULATOR_FRACTION_BITS = 13
PRODUCTS_PER_TRUNCATION = 16  # the fitted envelope above
TRUNCATION_FLOOR = 4


def on_low_precision_tensor_cores(a_kind: str, b_kind: str, backend: str = "auto") -> bool:
    """True when this lane multiplies a GEMM of operands of these kinds ("none", "mx", "fp8") on FP8 or MX
    tensor cores (item 2 above), under the recipe's `backend`."""
    if not ON_GPU or "none" in (a_kind, b_kind):
        return False
    return (a_kind, b_kind) == ("fp8", "fp8") or backends.resolve_backend(backend) in ("fp8", "native")


def gemm_rtol(a_kind: str, b_kind: str, k: int, backend: str = "auto") -> float:
    """The relative bound (times |A||B|) for a GEMM of contraction length k on this lane."""
    if on_low_precision_tensor_cores(a_kind, b_kind, backend):
        losses = math.ceil(k / PRODUCTS_PER_TRUNCATION) + TRUNCATION_FLOOR
        return FLOAT32_RTOL + losses * 2.0**-FP8_ACCUMULATOR_FRACTION_BITS
    return FLOAT32_RTOL


def spread_devices(limit: int = 8) -> list:
    """The devices a test spreads over: all of them, at most `limit`."""
    return jax.devices()[:limit]


def mesh_2d(axis_names=("data", "model"), limit: int = 8) -> jax.sharding.Mesh:
    """A 2-D mesh over the devices present: 2 x 4 on 8 devices, 2 x 1 on 2, 1 x 1 on one."""
    devices = spread_devices(limit)
    n = len(devices)
    shape = (2, n // 2) if n % 2 == 0 else (1, n)
    return jax.sharding.Mesh(np.asarray(devices).reshape(shape), axis_names)


def skip_unless_native_gemms_compile() -> None:
    """Skips a test of the native back end where this process cannot compile jax.lax.scaled_dot: on the
    GPU lane of an H200, whose Triton GEMMs are off as in the trainer. There
    test_backends.py::test_native_tests_with_triton_gemms runs it in a process with them on."""
    import pytest

    error = probes.scaled_dot_compile_error()
    if error:
        pytest.skip(f"native GEMMs do not compile here (test_native_tests_with_triton_gemms): {error}")
