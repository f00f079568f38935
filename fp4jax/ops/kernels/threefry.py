"""jax.random.bits's uint32 draw as a counter formula: the bit of one element from its index alone.

Invariant (tests/test_fused_quantize.py checks it bit for bit): where `formula_applies(key, size)`,

    random_bits(jax.random.key_data(key), i) == jax.random.bits(key, shape, jnp.uint32).reshape(-1)[i]

for every shape of `size` elements and every row-major flat index i of it. So a Pallas kernel can draw
the bits of its own tile (the tiles' global element indices from the program ids and an iota) and give
every element the bit XLA would have drawn for it: the stochastic rounding of fused_quantize_pallas.

The source (jax 0.10.2, jax/_src/random/threefry2x32.py; earlier versions jax/_src/prng.py):
`threefry_random_bits` takes `_threefry_random_bits_partitionable` when jax_threefry_partitionable is
True (the default since jax 0.5): `(a, b) = threefry2x32_p(k0, k1, *iota_2x32_shape(shape))` and the
32-bit draw is `a ^ b`, where `iota_2x32_shape` gives each element the high and low 32-bit words of its
row-major flat index. `_threefry2x32_lowering` is Threefry-2x32 with 20 rounds: the key schedule
(k0, k1, k0 ^ k1 ^ 0x1BD11BDA) injected before the first round and after every four (the second word
also gets the injection's count), the rotations 13, 15, 26, 6 and 17, 29, 16, 24 taking turns.
With jax_threefry_partitionable False, jax hashes a flat iota split in two halves instead (another
bit for each element), and other PRNG implementations (rbg, unsafe_rbg, philox) are other functions
altogether: `formula_applies` says False for them, and callers then draw with jax.random.bits.

Everything here is elementwise uint32 adds, xors and shifts by constants, so it lowers through XLA and
inside a Pallas (Triton) kernel body alike.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

__all__ = ["formula_applies", "random_bits", "random_bits_of_shape", "threefry2x32"]

_PARITY = np.uint32(0x1BD11BDA)  # Threefish's key-schedule constant
_ROTATIONS = ((13, 15, 26, 6), (17, 29, 16, 24))
_ROUNDS = 20  # jax's: 5 groups of 4 rounds, the key injected after each


def formula_applies(key: jax.Array, size: int) -> bool:
    """Whether `random_bits` gives jax.random.bits(key, shape, jnp.uint32) for shapes of `size` elements.

    Asked at trace time, every time (never assumed from the jax version): the threefry partitionable
    mode is on (jax.threefry_partitionable, part of jit's cache key, so a trace made under the other
    setting is not reused), the key's implementation is threefry2x32, and every flat index fits the low
    word (size <= 2**32: the high word is then 0, which is all `random_bits` takes).
    """
    return (
        bool(jax.config.jax_threefry_partitionable)
        and jax.random.key_impl(key) == "threefry2x32"
        and size <= 2**32
    )


def _rotate_left(x: jax.Array, r: int) -> jax.Array:
    """x rotated left by the constant r (0 < r < 32), uint32; one funnel shift on a GPU."""
    return lax.shift_left(x, jnp.uint32(r)) | lax.shift_right_logical(x, jnp.uint32(32 - r))


def threefry2x32(
    k0: jax.Array, k1: jax.Array, x0: jax.Array, x1: jax.Array, rounds: int = _ROUNDS
) -> tuple[jax.Array, jax.Array]:
    """Threefry-2x32 of the counter words (x0, x1) under the key words (k0, k1), all uint32 and
    broadcastable against each other: with rounds=20, jax's threefry2x32_p, round for round (module
    docstring). Other round counts are Random123's threefry2x32_R(rounds, ...) (threefry.h): the key is
    injected before the first round and after every fourth, so 13 rounds end on one round past the third
    injection. sr_bits.py's "threefry13" generator runs 13."""
    if not 0 < rounds <= 32:
        raise ValueError(f"Threefry-2x32 takes 1 to 32 rounds, got {rounds}")
    schedule = (k0, k1, k0 ^ k1 ^ _PARITY)
    x0, x1 = x0 + schedule[0], x1 + schedule[1]
    for r in range(rounds):
        x0 = x0 + x1
        x1 = _rotate_left(x1, _ROTATIONS[(r // 4) % 2][r % 4]) ^ x0
        if r % 4 == 3:  # the key injection after every fourth round, with its count
            injection = (r + 1) // 4
            x0 = x0 + schedule[injection % 3]
            x1 = x1 + schedule[(injection + 1) % 3] + jnp.uint32(injection)
    return x0, x1


def random_bits(key_words, index: jax.Array) -> jax.Array:
    """jax.random.bits's uint32 for the elements of row-major flat `index` (uint32, any shape, < 2**32).

    key_words: the key's two uint32 words (jax.random.key_data(key), or anything indexable as such:
    scalars or arrays broadcastable against index). The counter is (high word 0, index)."""
    k0, k1 = key_words[0], key_words[1]
    a, b = threefry2x32(k0, k1, jnp.zeros_like(index), index)
    return a ^ b


def random_bits_of_shape(key_words: jax.Array, shape: tuple[int, ...]) -> jax.Array:
    """The formula over a whole shape (row-major indices): jax.random.bits(key, shape, jnp.uint32) where
    formula_applies(key, prod(shape)). Outside kernels this is only a check of the formula."""
    size = math.prod(shape)
    if size > 2**32:
        raise ValueError(f"{size} elements: the counter's high word would be non-zero (not built)")
    index = lax.iota(jnp.uint32, size).reshape(shape) if size else jnp.zeros(shape, jnp.uint32)
    return random_bits(key_words, index)
