"""fp4jax.ops: exact MX / FP8 quantization, Hadamard rotations and the per-GEMM quantized dot_general.

This package's namespace is the canonical public face: every name in `__all__` is supported, and
nothing outside fp4jax/ops imports fp4jax.ops.kernels (the kernels, back ends and probes, private to
ops; tests/test_ops_face.py checks it). `fp4jax.ops.mx_dot` is the module a Flax model imports, a thin
re-export of the model-facing subset:

    from fp4jax.ops import mx_dot   # mx_dot.mx_dot_general, mx_dot.QuantDotGeneral, ...
    from fp4jax.ops import mx_dot_general, QuantDotGeneral, NnxQuantDotGeneral, make_dot_general

Groups: formats and recipes (what to compute); quantizers (quantize_mx, quantize_fp8, quantize_nvfp4,
rotate_quantize with its KernelConfig, the fold, pack_mx's storage at the formats' widths); the quantized
dot_general and its per-GEMM steps (quantize_operand, quantize_gemm_operands, rotated_gemm_operands,
multiply_gemm_operands); GEMM back ends and this device (resolve_execution, describe_device,
choose_backend, fp8_unfolded, ...).
"""

# `fp4jax.ops.mx_dot` is the module of the quantized dot_general's public names (mx_dot.py), never a
# function: `import fp4jax.ops.mx_dot` and `from fp4jax.ops import mx_dot` give the same module.
from fp4jax.ops import mx_dot
from fp4jax.ops.execution import Execution, resolve_execution
from fp4jax.ops.flax_adapters import NnxQuantDotGeneral, QuantDotGeneral
from fp4jax.ops.formats import ELEM_FORMATS, ElemFormat, get_elem_format
from fp4jax.ops.kernels.backends import (
    fp8_dot_precision,
    fp8_matmul,
    fp8_scaled_matmul,
    fp8_unfolded,
    matmul,
)
from fp4jax.ops.kernels.fold import FoldedOperand, count_fold_flushes, fold_mx_to_fp8, is_foldable
from fp4jax.ops.kernels.fused_quantize import KernelConfig, choose_impl, pallas_supports, rotate_quantize
from fp4jax.ops.kernels.fused_quantize_pallas import Tile
from fp4jax.ops.kernels.probes import (
    BackendChoice,
    DeviceDescription,
    choose_backend,
    describe_device,
    epilogue_scaling_is_exact,
    scaled_after,
    scaled_dot_compile_error,
    scaled_in_epilogue,
)
from fp4jax.ops.kernels.tile_math import hadamard_rotate
from fp4jax.ops.nvfp4 import NVFP4Array, nvfp4_global_scale, quantize_nvfp4
from fp4jax.ops.packing import PACKED_BITS, PackedMXArray, PackedNVFP4Array, pack_mx, pack_nvfp4
from fp4jax.ops.quantize import (
    FP8Array,
    MXArray,
    fp8_amax_history_update,
    fp8_scale_from_history,
    ldexp_exact,
    quantize_fp8,
    quantize_mx,
)
from fp4jax.ops.quantized_dot import (
    RotatedOperands,
    make_dot_general,
    multiply_gemm_operands,
    mx_dot_general,
    operand_layouts,
    quantize_gemm_operands,
    quantize_operand,
    rotated_gemm_operands,
    to_bfc,
)
from fp4jax.ops.recipes import (
    BACKENDS,
    GEMMS,
    PRESETS,
    QUANTIZERS,
    GemmSpec,
    QuantSpec,
    Recipe,
    RotationSpec,
    get_recipe,
    resolve_recipe,
)
from fp4jax.ops.rotation import hadamard, random_signs, rotate_blocks

__all__ = [
    "BACKENDS",
    "ELEM_FORMATS",
    "GEMMS",
    "PACKED_BITS",
    "PRESETS",
    "QUANTIZERS",
    "BackendChoice",
    "DeviceDescription",
    "ElemFormat",
    "Execution",
    "FP8Array",
    "FoldedOperand",
    "GemmSpec",
    "KernelConfig",
    "MXArray",
    "NVFP4Array",
    "NnxQuantDotGeneral",
    "PackedMXArray",
    "PackedNVFP4Array",
    "QuantDotGeneral",
    "QuantSpec",
    "Recipe",
    "RotatedOperands",
    "RotationSpec",
    "Tile",
    "choose_backend",
    "choose_impl",
    "count_fold_flushes",
    "describe_device",
    "epilogue_scaling_is_exact",
    "fold_mx_to_fp8",
    "fp8_amax_history_update",
    "fp8_dot_precision",
    "fp8_matmul",
    "fp8_scale_from_history",
    "fp8_scaled_matmul",
    "fp8_unfolded",
    "get_elem_format",
    "get_recipe",
    "hadamard",
    "hadamard_rotate",
    "is_foldable",
    "ldexp_exact",
    "make_dot_general",
    "matmul",
    "multiply_gemm_operands",
    "nvfp4_global_scale",
    "mx_dot",
    "mx_dot_general",
    "operand_layouts",
    "pack_mx",
    "pack_nvfp4",
    "pallas_supports",
    "quantize_fp8",
    "quantize_gemm_operands",
    "quantize_mx",
    "quantize_nvfp4",
    "quantize_operand",
    "random_signs",
    "resolve_execution",
    "resolve_recipe",
    "rotate_blocks",
    "rotate_quantize",
    "rotated_gemm_operands",
    "scaled_after",
    "scaled_dot_compile_error",
    "scaled_in_epilogue",
    "to_bfc",
]
