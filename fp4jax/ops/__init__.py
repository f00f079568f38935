"""fp4jax.ops: exact MX / FP8 / NVFP4 quantization, block rotations and the per-GEMM quantized dot_general.

`__all__` is the public face, what a user of the quantized matmul needs; docs/api.md lists it, one line
per name, and tests/test_ops_face.py checks the two agree. `fp4jax.ops.mx_dot` is the module a Flax
model imports, the model-facing subset:

    from fp4jax.ops import mx_dot   # mx_dot.mx_dot_general, mx_dot.QuantDotGeneral, ...
    from fp4jax.ops import mx_dot_general, QuantDotGeneral, NnxQuantDotGeneral, make_dot_general

Everything else is internal and imported from its own module: the per-GEMM steps
(fp4jax.ops.quantized_dot), the fused quantizer and its KernelConfig (fp4jax.ops.kernels.fused_quantize),
the fold and the GEMM back ends (fp4jax.ops.kernels.fold, .backends), this device's probes
(fp4jax.ops.kernels.probes), FP8 amax histories and exact scaling (fp4jax.ops.quantize).
"""

# `fp4jax.ops.mx_dot` is the module of the quantized dot_general's public names (mx_dot.py), never a
# function: `import fp4jax.ops.mx_dot` and `from fp4jax.ops import mx_dot` give the same module.
from fp4jax.ops import mx_dot
from fp4jax.ops.execution import Execution, resolve_execution
from fp4jax.ops.flax_adapters import NnxQuantDotGeneral, QuantDotGeneral
from fp4jax.ops.formats import ElemFormat, get_elem_format
from fp4jax.ops.nvfp4 import NVFP4Array, quantize_nvfp4
from fp4jax.ops.packing import pack_mx, pack_nvfp4
from fp4jax.ops.quant_formats import FORMATS, QuantFormat
from fp4jax.ops.quantize import FP8Array, MXArray, quantize_fp8, quantize_mx
from fp4jax.ops.quantized_dot import make_dot_general, mx_dot_general
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
)
from fp4jax.ops.rotation import hadamard, random_signs, rotate_blocks

__all__ = [
    "BACKENDS",
    "FORMATS",
    "GEMMS",
    "PRESETS",
    "QUANTIZERS",
    "ElemFormat",
    "Execution",
    "FP8Array",
    "GemmSpec",
    "MXArray",
    "NVFP4Array",
    "NnxQuantDotGeneral",
    "QuantDotGeneral",
    "QuantFormat",
    "QuantSpec",
    "Recipe",
    "RotationSpec",
    "get_elem_format",
    "get_recipe",
    "hadamard",
    "make_dot_general",
    "mx_dot",
    "mx_dot_general",
    "pack_mx",
    "pack_nvfp4",
    "quantize_fp8",
    "quantize_mx",
    "quantize_nvfp4",
    "random_signs",
    "resolve_execution",
    "rotate_blocks",
]
