"""fp4jax.ops.pack_mx against a reference written from the formats' definitions (OCP MX v1.0) and the
layout's words: each element's code computed from its value (sign, biased exponent, mantissa), the
codes of the whole array laid into one Python integer, little-endian, and cut into bytes."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.ops import MXArray, pack_mx, pack_nvfp4, quantize_mx, quantize_nvfp4
from fp4jax.ops.formats import get_elem_format
from fp4jax.ops.packing import PackedMXArray

# (bits, exponent bits, mantissa bits, bias) of each packed format.
LAYOUT = {"e2m1": (4, 2, 1, 1), "e2m3": (6, 2, 3, 1), "e3m2": (6, 3, 2, 3)}


def reference_code(value: float, elem: str) -> int:
    bits, _, mbits, bias = LAYOUT[elem]
    sign = int(np.signbit(value))
    a = abs(float(value))
    if a < 2.0 ** (1 - bias):  # subnormal (or zero): exponent field 0, value = m * 2^(1 - bias - mbits)
        field, mantissa = 0, a / 2.0 ** (1 - bias - mbits)
    else:
        e = int(np.floor(np.log2(a)))
        field, mantissa = e + bias, a / 2.0**e * 2**mbits - 2**mbits
    assert mantissa == int(mantissa), (value, elem)
    return sign << (bits - 1) | field << mbits | int(mantissa)


def reference_pack(values: np.ndarray, elem: str) -> np.ndarray:
    bits = LAYOUT[elem][0]
    stream = 0
    for i, v in enumerate(values.reshape(-1)):
        stream |= reference_code(v, elem) << (bits * i)
    n_bytes = values.size * bits // 8
    return np.frombuffer(stream.to_bytes(n_bytes, "little"), np.uint8)


def every_value(elem: str) -> np.ndarray:
    """Every value of the format, both zeros and both signs, in a random order, tiled to 2 x 64."""
    bits, ebits, mbits, bias = LAYOUT[elem]
    mags = [m * 2.0 ** (1 - bias - mbits) for m in range(2**mbits)]  # zero and the subnormals
    mags += [(1 + m / 2**mbits) * 2.0 ** (e - bias) for e in range(1, 2**ebits) for m in range(2**mbits)]
    assert len(mags) == 2 ** (bits - 1) and max(mags) == get_elem_format(elem).max_value
    values = np.array(mags + [-v for v in mags])
    return np.random.default_rng(bits).permutation(np.resize(values, 128)).reshape(2, 64)


def _mx(values: np.ndarray, elem: str) -> MXArray:
    """An MXArray holding `values` with every scale 2^0 (blocks of 32 along the last axis)."""
    data = jnp.asarray(values, jnp.float32).astype(get_elem_format(elem).dtype)
    scale = jnp.full((values.shape[0], values.shape[1] // 32), 1.0, jnp.float8_e8m0fnu)
    return MXArray(data, scale, axis=1, block_size=32, elem=elem)


# The quantizers jitted: eagerly each of their ops compiled on its own, per shape (3 s for a test).
_quantize_mx = jax.jit(quantize_mx, static_argnames=("elem", "axis"))
_quantize_nvfp4 = jax.jit(quantize_nvfp4, static_argnames="block_2d")


def _round_trip(mx):
    """unpack(pack(mx)), jitted as above."""
    return jax.jit(lambda m: pack_mx(m).unpack())(mx)


def _bytes(data) -> np.ndarray:
    return np.asarray(data.astype(jnp.float8_e4m3fn)).view(np.uint8)


@pytest.mark.parametrize("elem", list(LAYOUT))
def test_every_code_packs_as_the_reference_and_unpacks_bit_for_bit(elem):
    values = every_value(elem)
    mx = _mx(values, elem)
    packed = jax.jit(pack_mx)(mx)
    np.testing.assert_array_equal(np.asarray(packed.codes), reference_pack(values, elem))
    back = jax.jit(PackedMXArray.unpack)(packed)
    assert back.data.dtype == mx.data.dtype and back.elem == elem and back.shape == mx.shape
    np.testing.assert_array_equal(_bytes(back.data), _bytes(mx.data))  # -0 stays -0
    np.testing.assert_array_equal(np.asarray(back.scale_exponent()), np.asarray(mx.scale_exponent()))


@pytest.mark.parametrize("elem", list(LAYOUT))
@pytest.mark.parametrize("axis", [0, 1])
def test_quantized_adversarial_blocks_round_trip(elem, axis):
    """quantize_mx's output on zeros, ties, the largest values, subnormal scales, an outlier per block and
    non-finite inputs: unpack(pack(mx)) has the same bytes, scales and dequantized values (NaN blocks
    included)."""
    rng = np.random.default_rng(7)
    x = rng.standard_normal((64, 96)).astype(np.float32)
    x[0] = 0.0
    x[1, :32] = get_elem_format(elem).max_value * 2.0**5
    x[2] *= 2.0**-130  # scales at the bottom of E8M0's range
    x[3, ::32] = 1e4  # one outlier per block
    x[4, 5], x[5, 40], x[6, 70] = np.nan, np.inf, -np.inf
    x[7] = np.resize(np.arange(-16, 16) / 4 + 0.125, 96)  # ties of the coarser grids
    mx = _quantize_mx(jnp.asarray(x if axis == 1 else x.T), elem=elem, axis=axis)
    back = _round_trip(mx)
    assert back.axis == mx.axis and back.block_size == mx.block_size
    np.testing.assert_array_equal(_bytes(back.data), _bytes(mx.data))
    np.testing.assert_array_equal(np.asarray(back.scale).view(np.uint8), np.asarray(mx.scale).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(back.dequantize()), np.asarray(mx.dequantize()))


@pytest.mark.parametrize("elem, bits", [("e2m1", 4), ("e2m3", 6), ("e3m2", 6)])
def test_packed_size_is_the_formats_bits_plus_one_scale_byte_per_block(elem, bits):
    mx = _quantize_mx(jnp.ones((8, 256)), elem=elem)
    packed = jax.jit(pack_mx)(mx)
    assert packed.codes.dtype == jnp.uint8
    assert packed.nbytes == 8 * 256 * bits // 8 + 8 * 256 // 32
    assert packed.nbytes * 8 / mx.data.size == bits + 0.25


def test_a_packed_array_is_a_pytree_that_jit_carries():
    mx = _quantize_mx(jnp.linspace(-3, 3, 2 * 64).reshape(2, 64), elem="e2m3")
    packed = jax.jit(pack_mx)(mx)
    leaves, tree = jax.tree_util.tree_flatten(packed)
    assert [leaf.dtype for leaf in leaves] == [jnp.uint8, jnp.float8_e8m0fnu]
    again = jax.jit(lambda p: p)(jax.tree_util.tree_unflatten(tree, leaves))
    np.testing.assert_array_equal(np.asarray(again.unpack().dequantize()), np.asarray(mx.dequantize()))


def test_formats_stored_at_their_own_width_are_refused():
    mx = _quantize_mx(jnp.ones((2, 64)), elem="e4m3")
    with pytest.raises(ValueError, match="e4m3 is stored at its own width already"):
        pack_mx(mx)


@pytest.mark.parametrize("block_2d", [False, True])
def test_nvfp4_packs_two_elements_a_byte_and_unpacks_bit_for_bit(block_2d):
    """quantize_nvfp4's output (1D blocks and 2D tiles; zeros, an outlier, a non-finite block): the packed
    bytes are the reference layout of the E2M1 codes, and unpacking gives the same data, scales and values."""
    rng = np.random.default_rng(11)
    x = rng.standard_normal((32, 64)).astype(np.float32)
    x[0] = 0.0
    x[1, 3] = 1e5
    x[20, 40] = np.nan
    q = _quantize_nvfp4(jnp.asarray(x), block_2d=block_2d)
    packed = jax.jit(pack_nvfp4)(q)
    values = np.asarray(q.data.astype(jnp.float32), np.float64)
    np.testing.assert_array_equal(np.asarray(packed.codes), reference_pack(values, "e2m1"))
    assert packed.nbytes == 32 * 64 // 2 + q.scale.size + 4
    back = jax.jit(lambda p: p.unpack())(packed)
    assert (back.axis, back.block_size, back.block_2d) == (q.axis, q.block_size, q.block_2d)
    np.testing.assert_array_equal(_bytes(back.data), _bytes(q.data))
    np.testing.assert_array_equal(np.asarray(back.scale).view(np.uint8), np.asarray(q.scale).view(np.uint8))
    np.testing.assert_array_equal(np.asarray(back.global_scale), np.asarray(q.global_scale))
    dequantized = jax.jit(lambda a: a.dequantize())
    np.testing.assert_array_equal(np.asarray(dequantized(back)), np.asarray(dequantized(q)))
