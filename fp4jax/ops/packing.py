"""Block-scaled elements stored at their format's width: MXFP6 at 6 bits, MXFP4 and NVFP4 at 4, anywhere.

Why: XLA has no 6-bit arrays, so quantize_mx holds E2M3 and E3M2 elements in float8_e4m3fn bytes (8 bits
for 6), and only some back ends pack float4_e2m1fn two to a byte (NVIDIA GPUs do, XLA's CPU does not).
`pack_mx` turns an MXArray into a PackedMXArray whose elements take exactly the format's bits plus one
E8M0 byte per block (MXFP6: 6.25 bits per element, MXFP4: 4.25); `PackedMXArray.unpack` gives the MXArray
back bit for bit. `pack_nvfp4` does the same for an NVFP4Array (4.5 bits per element with its E4M3
scales). Use them to keep quantized tensors (saved operands, quantized weights) small; the GEMMs take the
unpacked arrays.

Layout (a little-endian bit stream): the data are flattened in row-major order; each group of G
elements (G = 4 for 6-bit codes, 2 for 4-bit) is one word, element i of the group at bits
[bits * i, bits * (i + 1)), written as its bytes, least significant first. A 6-bit group of codes
c0..c3 is thus the 3 bytes of c0 | c1 << 6 | c2 << 12 | c3 << 18. A code is the element's bit pattern in
its format (sign, exponent, mantissa; ml_dtypes' float6_e2m3fn / float6_e3m2fn / float4_e2m1fn). OCP MX
v1.0 fixes the codes, not how they are laid out in memory; this layout is fp4jax's.

Invariant: an MXArray's data hold only values of its element format (quantize_mx's output does); a
value outside it has no code, and pack_mx maps its byte to code 0. A NaN block's data are zeros (its NaN
is in the scale), so NaN blocks round-trip too.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from jax import lax

from fp4jax.ops.formats import get_elem_format
from fp4jax.ops.nvfp4 import NVFP4Array
from fp4jax.ops.quantize import MXArray

__all__ = ["PACKED_BITS", "PackedMXArray", "PackedNVFP4Array", "pack_mx", "pack_nvfp4"]

# Element formats pack_mx stores narrower than their array dtype, and their width in bits.
PACKED_BITS = {"e2m1": 4, "e2m3": 6, "e3m2": 6}


def _code_tables(elem: str) -> tuple[np.ndarray, np.ndarray]:
    """(code -> float8_e4m3fn byte, float8_e4m3fn byte -> code) for one element format.

    Every E2M1, E2M3 and E3M2 value is a float8_e4m3fn value (numerics.md, Storage), so going through
    E4M3 bytes is exact; the assertion re-checks it when the module loads.
    """
    codes = np.arange(2 ** PACKED_BITS[elem], dtype=np.uint8)
    values = codes.view(get_elem_format(elem).code_dtype).astype(np.float32)
    e4m3_bytes = values.astype(ml_dtypes.float8_e4m3fn).view(np.uint8)
    assert np.array_equal(e4m3_bytes.view(ml_dtypes.float8_e4m3fn).astype(np.float32), values)
    to_code = np.zeros(256, np.uint8)
    to_code[e4m3_bytes] = codes  # +0 and -0 are distinct bytes and distinct codes
    return e4m3_bytes, to_code


_TABLES = {elem: _code_tables(elem) for elem in PACKED_BITS}


def _nbytes(*arrays: jax.Array) -> int:
    return sum(a.size * a.dtype.itemsize for a in arrays)


def _group(bits: int) -> tuple[int, int]:
    """(elements, bytes) of one packing group: the fewest elements that fill whole bytes."""
    elements = 8 // math.gcd(bits, 8)
    return elements, elements * bits // 8


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedMXArray:
    """An MXArray with its elements packed (module docstring: layout). `codes` is uint8 of
    size * bits / 8 bytes; `scale`, `axis`, `block_size` and `elem` are the MXArray's; `shape` its data's."""

    codes: jax.Array
    scale: jax.Array
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))
    block_size: int = dataclasses.field(metadata=dict(static=True))
    elem: str = dataclasses.field(metadata=dict(static=True))

    @property
    def nbytes(self) -> int:
        """Bytes held: the packed elements and the scales."""
        return _nbytes(self.codes, self.scale)

    def unpack(self) -> MXArray:
        """The MXArray that was packed, bit for bit."""
        data = _unpack_elements(self.codes, self.elem, self.shape)
        return MXArray(data, self.scale, self.axis, self.block_size, self.elem)


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PackedNVFP4Array:
    """An NVFP4Array with its E2M1 elements two to a byte (the module's layout); `scale` (E4M3 per block),
    `global_scale`, `axis`, `block_size` and `block_2d` are the NVFP4Array's; `shape` its data's."""

    codes: jax.Array
    scale: jax.Array
    global_scale: jax.Array
    shape: tuple[int, ...] = dataclasses.field(metadata=dict(static=True))
    axis: int = dataclasses.field(metadata=dict(static=True))
    block_size: int = dataclasses.field(metadata=dict(static=True))
    block_2d: bool = dataclasses.field(metadata=dict(static=True))

    @property
    def nbytes(self) -> int:
        """Bytes held: the packed elements, the block scales and the per-tensor scale."""
        return _nbytes(self.codes, self.scale, self.global_scale)

    def unpack(self) -> NVFP4Array:
        """The NVFP4Array that was packed, bit for bit."""
        data = _unpack_elements(self.codes, "e2m1", self.shape)
        return NVFP4Array(data, self.scale, self.global_scale, self.axis, self.block_size, self.block_2d)


def pack_mx(mx: MXArray) -> PackedMXArray:
    """`mx` with its elements at their format's width (MXFP6 6 bits, MXFP4 4 bits); jit-compatible.

    The data's size must be a multiple of the packing group (4 elements for 6 bits, 2 for 4 bits),
    which any MXArray's is: its block axis holds whole blocks of 32.
    """
    if mx.elem not in PACKED_BITS:
        raise ValueError(
            f"pack_mx packs {', '.join(PACKED_BITS)} elements; {mx.elem} is stored at its own width already"
        )
    codes = _pack_elements(mx.data, mx.elem)
    return PackedMXArray(codes, mx.scale, tuple(mx.data.shape), mx.axis, mx.block_size, mx.elem)


def pack_nvfp4(x: NVFP4Array) -> PackedNVFP4Array:
    """`x` with its E2M1 elements at 4 bits on every platform (jit-compatible); scales kept as they are."""
    codes = _pack_elements(x.data, "e2m1")
    return PackedNVFP4Array(
        codes, x.scale, x.global_scale, tuple(x.data.shape), x.axis, x.block_size, x.block_2d
    )


def _pack_elements(data: jax.Array, elem: str) -> jax.Array:
    """uint8 bytes of `data`'s codes in the module's layout (size * bits / 8 of them)."""
    bits = PACKED_BITS[elem]
    per_group, group_bytes = _group(bits)
    if data.size % per_group:
        raise ValueError(f"packing needs a multiple of {per_group} {elem} elements, got {data.size}")
    e4m3_bytes = lax.bitcast_convert_type(data.astype(jnp.float8_e4m3fn), jnp.uint8)
    codes = jnp.asarray(_TABLES[elem][1])[e4m3_bytes].reshape(-1, per_group).astype(jnp.uint32)
    word = sum(codes[:, i] << (bits * i) for i in range(per_group))
    stream = jnp.stack([(word >> (8 * j)) & 0xFF for j in range(group_bytes)], axis=-1)
    return stream.astype(jnp.uint8).reshape(-1)


def _unpack_elements(packed: jax.Array, elem: str, shape: tuple[int, ...]) -> jax.Array:
    """The inverse of _pack_elements: data of `shape` in the format's storage dtype."""
    bits = PACKED_BITS[elem]
    per_group, group_bytes = _group(bits)
    stream = packed.reshape(-1, group_bytes).astype(jnp.uint32)
    word = sum(stream[:, j] << (8 * j) for j in range(group_bytes))
    codes = jnp.stack([(word >> (bits * i)) & (2**bits - 1) for i in range(per_group)], axis=-1)
    e4m3_bytes = jnp.asarray(_TABLES[elem][0])[codes.reshape(shape)]
    data = lax.bitcast_convert_type(e4m3_bytes, jnp.float8_e4m3fn)
    return data.astype(get_elem_format(elem).dtype)  # exact: E2M1 values are E4M3 values
