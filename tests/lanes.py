"""What differs between the two test lanes, stated once and applied only where it holds.

- CPU lane (the default, what CI runs): 8 fake CPU devices (conftest.py), IEEE float32 accumulation.
- GPU lane (`JAX_PLATFORMS=cuda` or `rocm`, see docs/testing.md): the real devices, however many, and
  tensor-core GEMMs.

Two things change on a GPU and nothing else may:
1. How many devices there are: meshes are built from the devices present (2 x 4 on the 8 CPU devices).
2. How low-precision GEMMs accumulate. Every GEMM the tests check multiplies exact values with float32
   accumulation on the CPU, and is held to FLOAT32_RTOL x |A||B| there. On a GPU, so are GEMMs that run
   as bf16 or float32 (precision HIGHEST) dots. GEMMs that run on FP8 (or MX) tensor cores do not
   accumulate in IEEE float32: Hopper's FP8 tensor cores keep the running sum to 13 fraction bits (a
   22-bit e8m13 accumulator, truncated) and fold it into float32 only between MMA steps of at least 16
   products. So each step may lose up to 2^-13 of the sum's magnitude, which never exceeds |A||B|:
       |error| <= (FLOAT32_RTOL + ceil(K / 16) 2^-13) |A||B|   for a contraction of length K.
   Those GEMMs are FP8 x FP8 (XLA emits an FP8 GEMM) and, where `auto` picks the fp8 back end (Hopper,
   MI300) or the native one (gfx950, Blackwell), GEMMs of two quantized operands. The bound is about 60
   times below what one element rounded one grid step differently moves an output in these tests
   (~1e-2 |A||B|), so it still tells a wrong quantization from a GPU's accumulation.
"""

import math

import jax
import numpy as np

from fp4jax.ops.kernels import backends

ON_GPU = jax.default_backend() == "gpu"  # CUDA and ROCm alike

FLOAT32_RTOL = 1e-5
FP8_ACCUMULATOR_FRACTION_BITS = 13
FP8_MMA_MIN_K = 16


def on_low_precision_tensor_cores(a_kind: str, b_kind: str, backend: str = "auto") -> bool:
    """True when this lane multiplies a GEMM of operands of these kinds ("none", "mx", "fp8") on FP8 or MX
    tensor cores (item 2 above), under the recipe's `backend`."""
    if not ON_GPU or "none" in (a_kind, b_kind):
        return False
    return (a_kind, b_kind) == ("fp8", "fp8") or backends.resolve_backend(backend) in ("fp8", "native")


def gemm_rtol(a_kind: str, b_kind: str, k: int, backend: str = "auto") -> float:
    """The relative bound (times |A||B|) for a GEMM of contraction length k on this lane."""
    if on_low_precision_tensor_cores(a_kind, b_kind, backend):
        return FLOAT32_RTOL + math.ceil(k / FP8_MMA_MIN_K) * 2.0**-FP8_ACCUMULATOR_FRACTION_BITS
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
