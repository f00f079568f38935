"""The quantization formats as one table: what each is, who quantizes it, which back ends multiply it.

Two levels, as a QuantSpec names them (recipes.QuantSpec: `kind`, then `elem`):

- KINDS: one QuantKind per QuantSpec.kind ("none", "mx", "fp8", "nvfp4"): the quantizer behind it
  (`quantize`, the array type it returns), how it lies on the contraction axis (`blocked`, or
  `per_tensor`: elementwise, so it commutes with a transpose), the spec fields it takes (elements,
  default block size, prescale, 2D blocks, delayed scaling) and its own checks, and whether the fused
  quantizer encodes it. The quantizers, the GEMM and the recipes ask this entry instead of switching on
  the kind's string.
- FORMATS: one QuantFormat per named format (MXFP4, MXFP6 E2M3 / E3M2, MXFP8 E4M3 / E5M2, NVFP4, FP8
  E4M3 / E5M2): its element, block size, scale format, tensor scale, stored bits per element, and which
  back ends multiply it how (`backends`): "native" (jax.lax.scaled_dot), "fold" (the fp8 back end's exact
  fold into E4M3, kernels/fold.py), "fp8" (an FP8 GEMM as it is), "emulate" (dequantized, bf16).

Adding a format: its quantizer module (an array type with dequantize(), a quantize function), one
QuantKind here if it is a new kind, one QuantFormat row; docs/design.md lists the places it touches.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

from fp4jax.ops import ms_eden, nvfp4, quantize
from fp4jax.ops.nvfp4 import NVFP4_BLOCK_SIZE, NVFP4_ROUNDING_MODES

# NVFP4's block-scale rules, as QuantSpec.scale_mode names them, and quantize_nvfp4's four_over_six for
# each: "floor" (QuantSpec's default) is the standard rule, the block maximum scaled to 6 (Transformer
# Engine's); the "4over6_" rules choose per block between scaling it to 6 or to 4 by the named error.
NVFP4_SCALE_MODES = {"floor": None, "4over6_mse": "mse", "4over6_mae": "mae"}
# NVFP4's roundings: quantize_nvfp4's, and MS-EDEN (ms_eden.quantize_ms_eden: the randomness in the block
# scale; its operand must come rotated by random signs in groups of ms_eden.MS_EDEN_GROUP).
MS_EDEN = "ms_eden"
NVFP4_ROUNDINGS = (*NVFP4_ROUNDING_MODES, MS_EDEN)
# Every rounding some kind takes; those that draw random bits (a QuantSpec with one needs a key).
ROUNDINGS = (*quantize.ROUNDING_MODES, MS_EDEN)
RANDOM_ROUNDINGS = ("stochastic", MS_EDEN)

__all__ = [
    "FORMATS",
    "KINDS",
    "MS_EDEN",
    "NVFP4_ROUNDINGS",
    "NVFP4_SCALE_MODES",
    "RANDOM_ROUNDINGS",
    "ROUNDINGS",
    "SCALE_MODES",
    "QuantFormat",
    "QuantKind",
    "format_of",
]


def _no_checks(spec) -> None:
    return None


@dataclasses.dataclass(frozen=True)
class QuantKind:
    """One QuantSpec.kind. `quantize(x, spec, key, fp8_scale)` quantizes a (B, F, C) operand along C
    (quantized_dot.quantize_operand); `array_type` is what it returns (None: the array itself)."""

    name: str
    quantize: Callable[..., Any]
    array_type: type | None = None
    blocked: bool = False  # quantized in blocks along the contraction axis (their size pads it)
    per_tensor: bool = False  # elementwise with one scale per tensor: commutes with a transpose
    default_block_size: int = 32
    prescale: bool = False  # takes QuantSpec.prescale
    block_2d: bool = False  # takes QuantSpec.block_2d (16 x 16 tiles of the weight)
    delayed_scaling: bool = False  # takes QuantSpec.fp8_scaling="delayed" (amax histories)
    fused: bool = False  # the fused quantizer (kernels/fused_quantize.py) encodes it
    check: Callable[[Any], None] = _no_checks  # the kind's own checks of a QuantSpec (one-line errors)

    @property
    def quantized(self) -> bool:
        return self.array_type is not None


def _quantize_mx(x, spec, key, fp8_scale):
    args = dict(
        elem=spec.elem, block_size=spec.block_size, scale_mode=spec.scale_mode, rounding=spec.rounding
    )
    return quantize.quantize_mx(x, axis=-1, key=key, prescale=spec.prescale, rng=spec.rng, **args)


def _quantize_fp8(x, spec, key, fp8_scale):
    return quantize.quantize_fp8(x, elem=spec.elem, scale=fp8_scale, divide=spec.fp8_divide)


def _quantize_nvfp4(x, spec, key, fp8_scale):
    if spec.rounding == MS_EDEN:
        return ms_eden.quantize_ms_eden(x, axis=-1, key=key)
    if spec.block_2d and x.shape[-2] % spec.block_size:
        raise ValueError(
            f"2D NVFP4 tiles need both of the weight's GEMM axes to be multiples of {spec.block_size}; "
            f"its free axis has {x.shape[-2]}: pad the layer's features or use 1D blocks (block_2d=False)"
        )
    return nvfp4.quantize_nvfp4(
        x,
        axis=-1,
        block_2d=spec.block_2d,
        block_size=spec.block_size,
        rounding=spec.rounding,
        key=key,
        rng=spec.rng,
        four_over_six=NVFP4_SCALE_MODES[spec.scale_mode],
    )


FP8_ELEMS = ("e4m3", "e5m2")


def _check_fp8(spec) -> None:
    if spec.elem not in FP8_ELEMS:
        raise ValueError(f"an fp8 operand needs elem 'e4m3' or 'e5m2', not {spec.elem!r}")
    if spec.rounding != "nearest_even":
        raise ValueError("fp8 per-tensor operands round half-to-even only")


def _check_mx(spec) -> None:
    if spec.rounding not in quantize.ROUNDING_MODES:
        raise ValueError(
            f"rounding={spec.rounding!r} is NVFP4's (kind='nvfp4'); MX operands round "
            f"{', '.join(quantize.ROUNDING_MODES)}"
        )
    if spec.scale_mode not in quantize.SCALE_MODES:
        raise ValueError(
            f"scale_mode={spec.scale_mode!r} is an NVFP4 block-scale rule; MX scales take "
            f"{', '.join(quantize.SCALE_MODES)}: choose one of them (or kind='nvfp4')"
        )
    quantize.check_oas_elem(spec.scale_mode, spec.elem)


def _check_nvfp4(spec) -> None:
    if spec.elem != "e2m1":
        raise ValueError(f"NVFP4 elements are E2M1: drop elem={spec.elem!r} (or use kind='mx' for it)")
    if spec.block_size != NVFP4_BLOCK_SIZE:
        raise ValueError(
            f"NVFP4 blocks are {NVFP4_BLOCK_SIZE} elements, got block_size={spec.block_size}: "
            f"drop block_size (or use kind='mx' for blocks of {spec.block_size})"
        )
    if spec.rounding not in NVFP4_ROUNDINGS:
        raise ValueError(
            f"NVFP4 rounds {' or '.join(NVFP4_ROUNDINGS)}, not {spec.rounding!r}: choose one of them"
        )
    if spec.rounding == MS_EDEN and spec.block_2d:
        raise ValueError("MS-EDEN quantizes 1D blocks (Quartet II's): drop block_2d for rounding='ms_eden'")
    if spec.scale_mode not in NVFP4_SCALE_MODES:
        raise ValueError(
            f"scale_mode={spec.scale_mode!r} is an MX scale rule; NVFP4 block scales are E4M3 under a "
            f"per-tensor scale (docs/numerics.md): drop scale_mode or choose {', '.join(NVFP4_SCALE_MODES)}"
        )
    if NVFP4_SCALE_MODES[spec.scale_mode] is not None and spec.rounding != "nearest_even":
        raise ValueError(
            f"scale_mode={spec.scale_mode!r} (Four-over-Six) chooses between two round-to-nearest "
            "encodings: use rounding='nearest_even' for it, or scale_mode='floor' with stochastic rounding"
        )


# Every scale_mode some kind takes (QuantSpec checks a value against this; each kind's check refuses
# the ones it does not take, saying whose they are).
SCALE_MODES = (*quantize.SCALE_MODES, *(m for m in NVFP4_SCALE_MODES if m not in quantize.SCALE_MODES))

KINDS: dict[str, QuantKind] = {
    "none": QuantKind("none", lambda x, spec, key, fp8_scale: x),
    "mx": QuantKind(
        "mx", _quantize_mx, quantize.MXArray, blocked=True, prescale=True, fused=True, check=_check_mx
    ),
    "fp8": QuantKind(
        "fp8", _quantize_fp8, quantize.FP8Array, per_tensor=True, delayed_scaling=True, check=_check_fp8
    ),
    "nvfp4": QuantKind(
        "nvfp4",
        _quantize_nvfp4,
        nvfp4.NVFP4Array,
        blocked=True,
        default_block_size=NVFP4_BLOCK_SIZE,
        block_2d=True,
        check=_check_nvfp4,
    ),
}


@dataclasses.dataclass(frozen=True)
class QuantFormat:
    """One named format: a (kind, elem) pair and what it is. `backends` maps each GEMM back end to how it
    multiplies an operand of this format: "native", "fold", "fp8" or "emulate" (module docstring); where
    a GEMM's two operands disagree, the back end runs it as emulate (backends.matmul)."""

    name: str
    kind: str
    elem: str
    block_size: int | None  # None: one scale per tensor
    scale: str  # the scale's format: "E8M0" (power of two), "E4M3", "float32"
    tensor_scale: str | None  # a second, per-tensor scale: "float32" or None
    storage_bits: int  # bits per element as packing.pack_mx / pack_nvfp4 store it (arrays hold bytes)
    backends: dict[str, str]


def _mx(name: str, elem: str, bits: int, fp8: str) -> QuantFormat:
    """An MX row: E8M0 scales per 32, scaled_dot on native; `fp8`: "fold" or "emulate" on the fp8 back end."""
    return QuantFormat(
        name, "mx", elem, 32, "E8M0", None, bits, {"native": "native", "fp8": fp8, "emulate": "emulate"}
    )


def _fp8(name: str, elem: str) -> QuantFormat:
    """A per-tensor FP8 row: one float32 scale; an FP8 GEMM on every back end."""
    return QuantFormat(
        name, "fp8", elem, None, "float32", None, 8, {"native": "fp8", "fp8": "fp8", "emulate": "fp8"}
    )


_NVFP4_BACKENDS = {"native": "native", "fp8": "emulate", "emulate": "emulate"}
FORMATS: dict[str, QuantFormat] = {
    f.name: f
    for f in (
        _mx("MXFP4", "e2m1", 4, "fold"),
        _mx("MXFP6_E2M3", "e2m3", 6, "fold"),
        _mx("MXFP6_E3M2", "e3m2", 6, "emulate"),
        _mx("MXFP8_E4M3", "e4m3", 8, "emulate"),
        _mx("MXFP8_E5M2", "e5m2", 8, "emulate"),
        QuantFormat("NVFP4", "nvfp4", "e2m1", 16, "E4M3", "float32", 4, _NVFP4_BACKENDS),
        _fp8("FP8_E4M3", "e4m3"),
        _fp8("FP8_E5M2", "e5m2"),
    )
}
_BY_KIND_ELEM = {(f.kind, f.elem): f for f in FORMATS.values()}


def format_of(spec) -> QuantFormat | None:
    """The FORMATS row of a QuantSpec (its kind and elem), or None for an unquantized operand."""
    return _BY_KIND_ELEM.get((spec.kind, spec.elem))
