"""Hadamard rotations along a GEMM's contraction axis (docs/numerics.md, "Rotations").

A rotation of size g is the block-diagonal orthogonal matrix Q = diag(diag(s) H_g, diag(s) H_g, ...)
acting on the contraction axis (row vectors: each block v becomes (v * s) @ H_g). Applied to both
operands, it cancels in the product:

    (a Q)(b Q)^T = a Q Q^T b^T = a b^T

while spreading each block's outliers over g elements, so the per-block scale wastes fewer bits.

One definition, one rounding. `hadamard_rotate` (a butterfly of float32 adds in a fixed order, then one
multiply by the float32 entry 1/sqrt(g)) is the only place a rotation is computed: `rotate_blocks`, the
GEMM path (through kernels/fused_quantize.rotate_quantize) and the Pallas kernels all call it. So a
rotated value does not depend on the back end: no matmul, whose summation order is the compiler's
choice, is involved, and every platform produces the same float32 bits (up to the sign of zero where
the final multiply underflows a subnormal sum, see `hadamard_rotate`).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax.ops.formats import require_power_of_two


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


def random_signs(key: jax.Array, size: int) -> jax.Array:
    """A vector of `size` independent random signs (+-1.0, float32)."""
    return jnp.where(jax.random.bernoulli(key, 0.5, (size,)), 1.0, -1.0).astype(jnp.float32)


# ----------------------------------------------------------------------------------------------------
# the rotation (one definition, used by every implementation)


def hadamard_rotate(
    v: jax.Array, size: int, sign_row: jax.Array | None = None, *, spelling: str = "slices"
) -> jax.Array:
    """Rotates each run of `size` elements along v's last axis by diag(signs) H_size; float32 in and out.

    v is 2-D (rows, n), n a multiple of size; sign_row, if given, is (1, n): the signs tiled over the row.
    The definition (the rounding is part of it): v * signs, then for h = 1, 2, 4, ..., size/2 every
    pair (i, i + h) of each group of 2h becomes (i: a + b, i + h: a - b), each sum rounded once and a
    zero sum stored as +0; finally times c = hadamard(size)[0, 0] (1/sqrt(size) as float32: exact
    for 16). No product feeds a sum, so no compiler can contract one into an FMA and change the bits
    (the sign products are exact). Sums can overflow where the scaled matmul would not: only for
    |x| near the float32 maximum, and such a block then gets a NaN scale in every implementation.
    Against the exact rotation, each output is off by at most (log2(size) + 1) float32 ulps of
    c * sum_j |v_j| over its block (one rounding per stage and one for c), and is exact when every
    partial sum is (e.g. small integers with size 16).
    `spelling` only changes how it is written: "slices" (slices and a stack, which XLA fuses into one
    loop) or "reductions" (sums over a length-2 axis, which Triton keeps in registers and warp
    shuffles); the two give the same bits (tests/test_fused_quantize.py checks it).
    """
    rows, n = v.shape
    if sign_row is not None:
        v = v * sign_row  # +-1: exact, and exact even if contracted into the next sum's FMA
    h = 1
    while h < size:
        v3 = v.reshape(rows * n // (2 * h), 2, h)
        v3 = _butterfly_slices(v3) if spelling == "slices" else _butterfly_reductions(v3)
        v = v3.reshape(rows, n)
        h *= 2
    return v * float(hadamard(size)[0, 0])


def _positive_zero(z: jax.Array) -> jax.Array:
    # A reduction may start from +0 (XLA) or not (Triton): a zero sum is +0 in both spellings.
    return jnp.where(z == 0, 0.0, z)


def _butterfly_slices(v3: jax.Array) -> jax.Array:
    a, b = v3[:, 0, :], v3[:, 1, :]
    return jnp.stack([_positive_zero(a + b), _positive_zero(a - b)], axis=1)


def _butterfly_reductions(v3: jax.Array) -> jax.Array:
    first = jax.lax.broadcasted_iota(jnp.int32, (1, 2, 1), 1) == 0
    total = jnp.sum(v3, axis=1, keepdims=True)  # a + b
    difference = jnp.sum(jnp.where(first, v3, -v3), axis=1, keepdims=True)  # a + (-b): exact negation
    return _positive_zero(jnp.where(first, total, difference))


def rotate_blocks(x: jax.Array, *, axis: int, size: int, signs: jax.Array | None = None) -> jax.Array:
    """Rotates every block of `size` contiguous elements along `axis`: v -> (v * signs) @ H_size.

    Computed by `hadamard_rotate` in float32; returns float32. The inverse is v -> (v @ H_size) * signs.
    Invariant: the result is the same on every back end (fixed butterfly order, no matmul), and equals
    fused_quantize.rotate_quantize's rotation bit for bit.
    """
    require_power_of_two(size, "rotation size")
    x = jnp.asarray(x, jnp.float32)
    axis %= x.ndim
    if x.shape[axis] % size:
        raise ValueError(
            f"axis {axis} has length {x.shape[axis]}, not a multiple of the rotation size {size}: "
            "pad it first"
        )
    x_last = jnp.moveaxis(x, axis, -1)
    n = x_last.shape[-1]
    if x_last.size == 0:
        return x
    sign_row = None if signs is None else jnp.tile(jnp.asarray(signs, jnp.float32), n // size)[None, :]
    rotated = hadamard_rotate(x_last.reshape(math.prod(x_last.shape[:-1]), n), size, sign_row)
    return jnp.moveaxis(rotated.reshape(x_last.shape), -1, axis)
