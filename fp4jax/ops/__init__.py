"""fp4jax.ops: exact MX / FP8 quantization, Hadamard rotations and the per-GEMM quantized dot_general.

from fp4jax.ops import mx_dot   # the module: mx_dot.mx_dot_general, mx_dot.QuantDotGeneral, ...
from fp4jax.ops import mx_dot_general, QuantDotGeneral, NnxQuantDotGeneral, make_dot_general
"""

# `fp4jax.ops.mx_dot` is the module of the quantized dot_general's public names (mx_dot.py), never a
# function: `import fp4jax.ops.mx_dot` and `from fp4jax.ops import mx_dot` give the same module.
from fp4jax.ops import mx_dot
from fp4jax.ops.flax_adapters import NnxQuantDotGeneral, QuantDotGeneral
from fp4jax.ops.formats import ELEM_FORMATS, ElemFormat, get_elem_format
from fp4jax.ops.quantize import (
    FP8Array,
    MXArray,
    fp8_amax_history_update,
    fp8_scale_from_history,
    quantize_fp8,
    quantize_mx,
)
from fp4jax.ops.quantized_dot import make_dot_general, mx_dot_general, operand_layouts
from fp4jax.ops.recipes import PRESETS, GemmSpec, QuantSpec, Recipe, RotationSpec, get_recipe
from fp4jax.ops.rotation import hadamard, random_signs, rotate_blocks

__all__ = [
    "ELEM_FORMATS",
    "PRESETS",
    "ElemFormat",
    "FP8Array",
    "GemmSpec",
    "MXArray",
    "NnxQuantDotGeneral",
    "QuantDotGeneral",
    "QuantSpec",
    "Recipe",
    "RotationSpec",
    "fp8_amax_history_update",
    "fp8_scale_from_history",
    "get_elem_format",
    "get_recipe",
    "hadamard",
    "make_dot_general",
    "mx_dot",
    "mx_dot_general",
    "operand_layouts",
    "quantize_fp8",
    "quantize_mx",
    "random_signs",
    "rotate_blocks",
]
