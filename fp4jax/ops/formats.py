"""Element formats of the OCP Microscaling (MX) v1.0 spec and FP8, with the constants the quantizers need.

Every element format here is a small float with 1 sign bit, `mantissa_bits` explicit mantissa bits and
normal exponents in [emin, emax]. Its representable magnitudes are the grid

    {k * 2^(q - mantissa_bits) : q = max(floor(log2|v|), emin)}  up to max_value,

which is what `quantize.round_to_grid` rounds onto. None of the formats has an infinity we ever produce:
values beyond `max_value` saturate.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax.numpy as jnp

__all__ = [
    "E2M1",
    "E4M3",
    "E5M2",
    "ELEM_FORMATS",
    "F32_ABS_MASK",
    "F32_INF_BITS",
    "F32_MANTISSA_MASK",
    "F32_SIGN_MASK",
    "SCALE_BIAS",
    "SCALE_DTYPE",
    "SCALE_EXP_MAX",
    "SCALE_EXP_MIN",
    "SCALE_NAN_BITS",
    "ElemFormat",
    "get_elem_format",
    "require_power_of_two",
]

# The MX shared scale: an unsigned 8-bit power of two, bias 127, 2^-127 .. 2^127, 0xFF = NaN.
SCALE_DTYPE = jnp.float8_e8m0fnu
SCALE_BIAS = 127
SCALE_EXP_MIN = -127
SCALE_EXP_MAX = 127
SCALE_NAN_BITS = 0xFF

# Float32 bit fields, as int32 (the exact quantizers work on bit patterns, never on rounded floats).
F32_MANTISSA_MASK = 0x7FFFFF
F32_ABS_MASK = 0x7FFFFFFF
F32_SIGN_MASK = -0x80000000  # 0x80000000 as an int32
F32_INF_BITS = 0x7F800000


@dataclasses.dataclass(frozen=True)
class ElemFormat:
    """One element format. `emax` is the exponent of the largest binade (OCP's emax_elem)."""

    name: str
    dtype: Any
    emax: int
    emin: int
    mantissa_bits: int
    max_value: float


E2M1 = ElemFormat("e2m1", jnp.float4_e2m1fn, emax=2, emin=0, mantissa_bits=1, max_value=6.0)
E4M3 = ElemFormat("e4m3", jnp.float8_e4m3fn, emax=8, emin=-6, mantissa_bits=3, max_value=448.0)
E5M2 = ElemFormat("e5m2", jnp.float8_e5m2, emax=15, emin=-14, mantissa_bits=2, max_value=57344.0)

ELEM_FORMATS: dict[str, ElemFormat] = {f.name: f for f in (E2M1, E4M3, E5M2)}


def require_power_of_two(n: int, what: str) -> None:
    """Raises ValueError naming `what` unless n is a positive integer power of two (1, 2, 4, ...).

    The one check behind every size that must tile a binary structure: MX block sizes, Hadamard and
    rotation sizes. bool is rejected although it is an int subclass.
    """
    if isinstance(n, bool) or not isinstance(n, int) or n < 1 or n & (n - 1):
        raise ValueError(f"{what} must be a positive power of two (1, 2, 4, ..., 16, 32, ...), got {n!r}")


def get_elem_format(name: str | ElemFormat) -> ElemFormat:
    """Looks up an element format by name ("e2m1", "e4m3", "e5m2")."""
    if isinstance(name, ElemFormat):
        return name
    try:
        return ELEM_FORMATS[name]
    except KeyError:
        raise ValueError(
            f"unknown element format {name!r}: use one of {', '.join(sorted(ELEM_FORMATS))}"
        ) from None
