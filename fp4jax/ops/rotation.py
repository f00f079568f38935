"""Hadamard rotations along a GEMM's contraction axis (docs/numerics.md, "Rotations").

A rotation of size g is the block-diagonal orthogonal matrix Q = diag(H_g diag(s), H_g diag(s), ...)
acting on the contraction axis. Applied to both operands, it cancels in the product:

    (a Q)(b Q)^T = a Q Q^T b^T = a b^T

while spreading each block's outliers over g elements, so the per-block scale wastes fewer bits.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax.ops.formats import require_power_of_two

__all__ = [
    "hadamard",
    "random_signs",
    "rotate_blocks",
]


@functools.cache
def _sylvester(n: int) -> np.ndarray:
    h = np.ones((1, 1), np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return h


def hadamard(n: int) -> np.ndarray:
    """The orthonormal Sylvester-Hadamard matrix H_n / sqrt(n) as float32: symmetric, H H^T = I."""
    require_power_of_two(n, "hadamard size")
    return (_sylvester(n) / np.sqrt(n)).astype(np.float32)


# random_signs and rotate_blocks are jitted, inline=True, as quantize.quantize_mx: an eager call is one
# compiled program, not its primitives compiled and dispatched one by one.
@functools.partial(jax.jit, static_argnames="size", inline=True)
def random_signs(key: jax.Array, size: int) -> jax.Array:
    """A vector of `size` independent random signs (+-1.0, float32)."""
    return jnp.where(jax.random.bernoulli(key, 0.5, (size,)), 1.0, -1.0).astype(jnp.float32)


def _exact_in_bf16(size: int) -> bool:
    """Whether H_size's entries, +-1/sqrt(size), are powers of two (size 1, 4, 16, 64, ...)."""
    return (size.bit_length() - 1) % 2 == 0


def _bf16_path(dtype, size: int) -> bool:
    """The bf16 x bf16 -> float32 matmul: bf16 input, exact entries, and a GPU (checked at trace time).

    GPUs run it on bf16 tensor cores; XLA's CPU runtime rejects some bf16 x bf16 = float32 dots
    ("Unsupported element type for DotThunk"), and gains nothing from it, so CPUs take float32.
    """
    gpu = jax.default_backend() in ("gpu", "cuda", "rocm")
    return gpu and dtype == jnp.bfloat16 and _exact_in_bf16(size)


@functools.partial(jax.jit, static_argnames=("axis", "size"), inline=True)
def rotate_blocks(x: jax.Array, *, axis: int, size: int, signs: jax.Array | None = None) -> jax.Array:
    """Rotates every block of `size` contiguous elements along `axis`: v -> (v * signs) @ H_size.

    A matmul with a float32 result (the sums accumulate in float32); the inverse is
    v -> (v @ H_size) * signs. On GPUs a bfloat16 x with size 4^k (H16) is multiplied as bf16 x bf16:
    H's entries +-2^-k and the signs are exact in bf16, so every product is exact, and the GPU runs one
    bf16 tensor-core pass instead of a float32 HIGHEST matmul (`_bf16_path`). Anything else is cast to
    float32 and multiplied at HIGHEST precision.
    """
    require_power_of_two(size, "rotation size")
    x = jnp.asarray(x)
    dtype = jnp.bfloat16 if _bf16_path(x.dtype, size) else jnp.float32
    x = x.astype(dtype)
    axis %= x.ndim
    if x.shape[axis] % size:
        raise ValueError(
            f"axis {axis} has length {x.shape[axis]}, not a multiple of the rotation size {size}: "
            "pad it first"
        )
    x_last = jnp.moveaxis(x, axis, -1)
    blocks = x_last.reshape(*x_last.shape[:-1], -1, size)
    if signs is not None:
        blocks = blocks * signs.astype(dtype)  # +-1: exact
    # bf16 x bf16 products are exact in the float32 accumulator at any precision setting; float32 ones
    # need HIGHEST (GPUs would otherwise round the operands to TF32).
    precision = None if dtype == jnp.bfloat16 else jax.lax.Precision.HIGHEST
    rotated = jnp.matmul(
        blocks, jnp.asarray(hadamard(size), dtype), precision=precision, preferred_element_type=jnp.float32
    )
    return jnp.moveaxis(rotated.reshape(x_last.shape), -1, axis)
