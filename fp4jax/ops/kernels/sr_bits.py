"""Stochastic rounding's random-bit generators: one uint32 per element from the key and the element's index.

QuantSpec.rng names the generator of an operand's stochastic rounding (docs/numerics.md, "Random bits"):

- "threefry" (the default): jax.random.bits(key, shape, uint32), one Threefry-2x32 block of 20 rounds
  per element (threefry.py). Every committed run drew these; they stay bit for bit.
- "threefry13": Random123's Threefry-2x32 with 13 rounds (Salmon, Moraes, Dror and Shaw, "Parallel
  random numbers: as easy as 1, 2, 3", SC 2011: the fewest rounds of Threefry-2x32 that their tests
  found to pass TestU01's BigCrush in every configuration; 20 is their margin of safety, which jax takes)
  and both of its output words used: element i takes word (i & 1) of threefry2x32_R(13, counter
  (0, i >> 1), key words). So one block of 13 rounds serves two elements, where "threefry" spends 20
  rounds on one: about a third of the arithmetic.

The bits of "threefry13" are a function of the key's two uint32 words and the element's row-major index
in the whole (global) array only: the XLA formula (`random_bits_of_shape`, plain uint32 ops that XLA
partitions like any elementwise op, so every device shard computes its own part) and the Pallas
kernels (fused_quantize_pallas: `pair_bits` at the tile's indices) give the same bits for any shape,
tiling and sharding. The counter takes at most 2**32 elements (the index's high word would be needed
beyond): larger operands are refused with an error rather than given another formula.

How many bits stochastic rounding consumes (either generator): quantize.round_to_grid takes the top 24
of the 32 as a uniform variate u = k / 2^24 and rounds up iff u < f, the fraction of a grid step above
the lower neighbour; so it rounds up with probability ceil(f 2^24) / 2^24. Where the scaled float32
lies in the element format's normal range, f is a multiple of 2^-(23 - mantissa bits), hence of 2^-24,
and that probability is f exactly: SR is unbiased to the last bit. Below the format's smallest normal
(its subnormal steps) f can be finer, and the rounding up is more likely by less than 2^-24 of a step.
The low 8 bits are not read; 24 bits are what a float32 uniform in [0, 1) holds.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
from jax import lax

from fp4jax.ops.kernels import threefry

__all__ = ["GENERATORS", "key_words", "pair_bits", "random_bits", "random_bits_of_shape", "stochastic_bits"]

GENERATORS = ("threefry", "threefry13")  # QuantSpec.rng
THREEFRY13_ROUNDS = 13


def check_generator(rng: str) -> None:
    if rng not in GENERATORS:
        raise ValueError(f"unknown random-bit generator rng={rng!r}: use one of {', '.join(GENERATORS)}")


def key_words(key: jax.Array) -> jax.Array:
    """The key's two uint32 words (jax.random.key_data) for the counter formulas; a one-line error for
    keys of other PRNG implementations (rbg keys have four words: no formula here takes them)."""
    words = jax.random.key_data(key)
    if words.shape != (2,):
        raise ValueError(
            f"rng='threefry13' takes a threefry2x32 key of two uint32 words (jax.random.key(seed)), got key "
            f"data of shape {words.shape}: draw the key with the default PRNG implementation"
        )
    return words


def pair_bits(words, pair_index: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Generator threefry13's bits of elements 2p and 2p + 1, for uint32 pair indices p (any shape): the
    two words of one Threefry-2x32-13 block at counter (0, p). words: the key's two uint32 words."""
    return threefry.threefry2x32(
        words[0], words[1], jnp.zeros_like(pair_index), pair_index, rounds=THREEFRY13_ROUNDS
    )


def random_bits(words, index: jax.Array) -> jax.Array:
    """Generator threefry13's uint32 for the elements of row-major flat `index` (uint32, any shape,
    < 2**32): the definition, one element at a time (it computes the whole pair and keeps one word)."""
    even, odd = pair_bits(words, index >> jnp.uint32(1))
    return jnp.where((index & jnp.uint32(1)) == 0, even, odd)


def random_bits_of_shape(words, shape: tuple[int, ...]) -> jax.Array:
    """Generator threefry13's bits over a whole shape, row-major: `random_bits` at every index, computed
    a pair at a time where the last axis is even (each block's two words interleaved along it)."""
    size = math.prod(shape)
    if size > 2**32:
        raise ValueError(
            f"{size} elements: rng='threefry13' counts at most 2**32 per operand; use rng='threefry' "
            "(jax.random.bits) for larger ones"
        )
    if size == 0:
        return jnp.zeros(shape, jnp.uint32)
    if shape and shape[-1] % 2 == 0:
        pairs = lax.iota(jnp.uint32, size // 2).reshape(*shape[:-1], shape[-1] // 2)
        even, odd = pair_bits(words, pairs)
        return jnp.stack([even, odd], axis=-1).reshape(shape)
    return random_bits(words, lax.iota(jnp.uint32, size).reshape(shape))


def stochastic_bits(key: jax.Array, shape: tuple[int, ...], rng: str = "threefry") -> jax.Array:
    """The uint32 bits generator `rng` draws for an array of `shape` under `key`, one per element."""
    check_generator(rng)
    return _stochastic_bits(key, tuple(shape), rng)


# Jitted, inline=True, as quantize.quantize_mx: an eager call is one compiled program, not its
# primitives (threefry's rounds) compiled and dispatched one by one.
@functools.partial(jax.jit, static_argnames=("shape", "rng"), inline=True)
def _stochastic_bits(key: jax.Array, shape: tuple[int, ...], rng: str) -> jax.Array:
    if rng == "threefry":
        return jax.random.bits(key, shape, jnp.uint32)
    return random_bits_of_shape(key_words(key), shape)
