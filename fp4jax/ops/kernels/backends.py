"""GEMM back ends: one numerics, several ways to run it.

Every back end computes out[b, m, n] = sum_k a[b, m, k] * c[b, n, k] in float32 from quantized operands
(both contract on their last axis). An operand is a plain array, an MXArray or an FP8Array.

- `emulate`: MX operands dequantized to bf16 (exact: an E2M1/E4M3/E5M2 element times a power of two fits
  bf16's 8-bit significand), FP8 operands multiplied in as their raw elements with the per-tensor scales
  applied to the float32 result; a plain dot_general with float32 accumulation. Runs everywhere.
- `native`: MX x MX GEMMs through `jax.lax.scaled_dot` (float4_e2m1fn / float8 data, float8_e8m0fnu
  scales), which XLA lowers to hipBLASLt block-scaled GEMMs on MI355X (gfx950) and cuDNN on Blackwell.
  Other GEMMs run as in `emulate`.
- `fp8`: the Hopper path (MX operands folded into E4M3 with a per-row exponent): not built yet.
- `auto`: `native` where the device has MX matrix cores, else `emulate`.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from fp4jax.ops.quantize import FP8Array, MXArray

# Contract the last axis of both operands, batch over the first.
_BMK_BNK = (((2,), (2,)), ((0,), (0,)))


@functools.cache
def _device_has_mx_matrix_cores() -> bool:
    """True on AMD gfx950 (MI350/MI355) and NVIDIA Blackwell (compute capability >= 10)."""
    device = jax.devices()[0]
    kind = getattr(device, "device_kind", "")
    if device.platform == "rocm" or "AMD" in kind:
        return "MI35" in kind or "gfx950" in kind
    if device.platform in ("gpu", "cuda"):
        capability = getattr(device, "compute_capability", "0")
        return float(capability) >= 10.0
    return False


def resolve_backend(backend: str) -> str:
    """Maps `auto` to the fastest back end that this device supports; checks the others exist."""
    if backend == "auto":
        return "native" if _device_has_mx_matrix_cores() else "emulate"
    if backend == "fp8":
        raise NotImplementedError(
            "GEMM back end 'fp8' (MX operands folded into one E4M3 GEMM for Hopper) is not built yet: "
            "use backend='emulate' or 'native'"
        )
    return backend


def _emulate_input(operand, keep_fp8: bool):
    """(values to multiply, scalar to multiply the result by, or None)."""
    if isinstance(operand, MXArray):
        return operand.dequantize(jnp.bfloat16), None
    if isinstance(operand, FP8Array):
        # FP8 x FP8 stays in FP8 so XLA can emit a native FP8 GEMM (Hopper, MI300+); exact either way.
        return (operand.data if keep_fp8 else operand.data.astype(jnp.bfloat16)), operand.scale
    return operand, None


def _emulate(a, c, precision) -> jax.Array:
    both_fp8 = isinstance(a, FP8Array) and isinstance(c, FP8Array)
    a_values, a_scale = _emulate_input(a, both_fp8)
    c_values, c_scale = _emulate_input(c, both_fp8)
    if not both_fp8:
        dtype = jnp.promote_types(a_values.dtype, c_values.dtype)
        a_values, c_values = a_values.astype(dtype), c_values.astype(dtype)
    out = jax.lax.dot_general(
        a_values,
        c_values,
        _BMK_BNK,
        precision=precision,
        preferred_element_type=jnp.float32,
    )
    if a_scale is None and c_scale is None:
        return out
    a_scale = jnp.float32(1.0) if a_scale is None else a_scale
    c_scale = jnp.float32(1.0) if c_scale is None else c_scale
    return out * (1.0 / (a_scale * c_scale))


def _native(a: MXArray, c: MXArray) -> jax.Array:
    return jax.lax.scaled_dot(
        a.data,
        c.data,
        lhs_scale=a.scale,
        rhs_scale=c.scale,
        dimension_numbers=_BMK_BNK,
        preferred_element_type=jnp.float32,
    )


def matmul(a, c, *, backend: str, precision=None) -> jax.Array:
    """out[b, m, n] = sum_k a[b, m, k] c[b, n, k] in float32, by the chosen back end."""
    both_mx = isinstance(a, MXArray) and isinstance(c, MXArray)
    if backend == "native" and both_mx and a.block_size == c.block_size:
        return _native(a, c)
    return _emulate(a, c, precision)
