"""GEMM back ends: one numerics, several ways to run it, and which one `auto` picks on which device.

Every back end computes out[b, m, n] = sum_k a[b, m, k] * c[b, n, k] in float32 from quantized operands
(both contract on their last axis). An operand is a plain array, an MXArray or an FP8Array.

- `emulate`: MX operands dequantized to bf16 (exact: an E2M1, E2M3, E3M2, E4M3 or E5M2 element times a
  power of two fits bf16's 8-bit significand), FP8 operands multiplied in as their raw elements with the
  per-tensor scales applied to the float32 result; a plain dot_general with float32 accumulation. Runs
  everywhere.
- `native`: MX x MX GEMMs through `jax.lax.scaled_dot` (float4_e2m1fn / float8 data, float8_e8m0fnu
  scales), which XLA lowers to hipBLASLt block-scaled GEMMs on MI355X (gfx950) and cuDNN on Blackwell,
  for the shapes `native_supports` accepts; NVFP4 x NVFP4 GEMMs too (float8_e4m3fn scales per 16, the
  per-tensor scales applied to the result as emulate applies them) on NVIDIA GPUs, whose block-scaled
  GEMMs take E4M3 scales (gfx950's take E8M0 only), and on the CPU; other GEMMs and shapes run as in
  `emulate`.
- `fp8`: E2M1 (MXFP4) and E2M3 (MXFP6) MX operands folded exactly into E4M3 with one exponent per row
  (fold.py), one plain FP8 dot_general with float32 accumulation (cuBLASLt FP8 on Hopper, hipBLASLt FP8
  on MI300 with the FNUZ types), the row exponents applied to its result. Also MX x FP8Array. MX
  operands with other elements (MXFP6's E3M2: exact only in a 9-binade window; MXFP8's E4M3/E5M2) are
  not folded: those GEMMs run as in `emulate` (execution.py names them in the resolved reason).
- `auto`: chosen from the device (probes.choose_backend: the dispatch table). The library reads no
  environment variable: the trainer's set-up maps FP4JAX_GEMM_BACKEND onto Recipe.backend.

Every FP8 x FP8 dot_general emitted here (emulate's FP8Array x FP8Array, the fp8 back end's folded GEMM)
asks for precise float32 accumulation on NVIDIA GPUs (`fp8_dot_precision`): with no algorithm and DEFAULT
precision, XLA runs FP8 GEMMs with cuBLASLt's fast accumulation (no promotion of the tensor cores' partial
sums to float32) and its Triton FP8 dots likewise. See docs/numerics.md.

A per-tensor FP8 x FP8 GEMM whose caller wants bfloat16 writes it straight from cuBLASLt on NVIDIA GPUs,
its scale applied in the GEMM's float32 epilogue, where a run-time probe finds that spelling exact
(`fp8_scaled_matmul`); elsewhere it writes float32 and the scale follows. The device's description,
the dispatch table and the run-time probes live in probes.py.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from fp4jax.ops import nvfp4
from fp4jax.ops.formats import divide_nearest_even, float8_to_float32, flush_subnormal
from fp4jax.ops.kernels import fold, probes
from fp4jax.ops.kernels.probes import (
    BMK_BNK,
    NATIVE_BLOCK_SIZE,
    NATIVE_ELEMENT_TYPES,
    NATIVE_K_MULTIPLE,
    NATIVE_MN_MULTIPLE,
)
from fp4jax.ops.quantize import FP8Array, MXArray, fp8_divide
from fp4jax.ops.recipes import BACKENDS, QuantSpec, Recipe

__all__ = [
    "BACKENDS",
    "check_backend",
    "fp8_dot_precision",
    "fp8_folds",
    "fp8_matmul",
    "fp8_scaled_matmul",
    "fp8_supports",
    "fp8_unfolded",
    "matmul",
    "native_supports",
    "quantizer_folds",
    "resolve_backend",
]

# ----------------------------------------------------------------------------------------------------
# which back end, on which device


def check_backend(backend: str, where: str = "backend") -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown GEMM back end {backend!r} in {where}: use one of {', '.join(BACKENDS)}")
    if backend == "native" and not probes.has_scaled_dot():
        raise ValueError(
            f"GEMM back end 'native' needs jax.lax.scaled_dot, which jax {jax.__version__} lacks: "
            "upgrade jax, or use backend='fp8' or 'emulate'"
        )
    if backend == "native" and (error := probes.scaled_dot_compile_error()):
        raise ValueError(
            f"GEMM back end 'native' ({where}): XLA cannot compile jax.lax.scaled_dot in this process: "
            f"{error}. Otherwise use backend='fp8' or 'emulate'"
        )


def resolve_backend(backend: str) -> str:
    """Maps `auto` to this process's choice (auto_choice); checks that any other name exists here."""
    if backend == "auto":
        return probes.auto_choice().backend
    check_backend(backend)
    return backend


# ----------------------------------------------------------------------------------------------------
# FP8 x FP8 accumulation


def fp8_dot_precision(*operands):
    """The `precision` for an FP8 x FP8 dot_general on the platform of `operands`, checked at trace time.

    On NVIDIA GPUs: DotAlgorithmPreset.ANY_F8_ANY_F8_F32, i.e. float32 accumulation with the tensor cores'
    partial sums promoted to float32 (cuBLASLt without CUBLASLT_MATMUL_DESC_FAST_ACCUM). Without it, XLA
    turns on fast accumulation for every FP8 GEMM of DEFAULT precision. Elsewhere: None, the plain dot
    (the CPU back end rejects the preset; it accumulates in float32 anyway; ROCm is left as it was).
    """
    if probes.on_nvidia_gpu(operands):
        return jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32
    return None


# ----------------------------------------------------------------------------------------------------
# FP8 x FP8 GEMMs that write bfloat16, the per-tensor scale in cuBLASLt's epilogue


def fp8_scaled_matmul(a8, c8, scale, out_dtype, precision):
    """sum_k a8 c8 * scale for two FP8 operands (B, M, K), (B, N, K), rounded once to out_dtype.

    On NVIDIA GPUs a bfloat16 result comes straight from the GEMM (half the bytes written and read
    again, and no separate scaling pass) where `epilogue_scaling_is_exact`; otherwise the GEMM writes
    float32 and the scale and rounding follow it.
    """
    narrow = jnp.dtype(out_dtype) == jnp.dtype(jnp.bfloat16) and probes.on_nvidia_gpu((a8, c8))
    if narrow and probes.epilogue_scaling_is_exact(
        jnp.dtype(a8.dtype), jnp.dtype(c8.dtype), jnp.dtype(out_dtype)
    ):
        return probes.scaled_in_epilogue(a8, c8, scale, out_dtype)
    return probes.scaled_after(a8, c8, scale, jnp.float32, precision)


# ----------------------------------------------------------------------------------------------------
# emulate


def _emulate_input(operand, keep_fp8: bool):
    """(values to multiply, scalar to multiply the result by, or None)."""
    if isinstance(operand, MXArray):
        return operand.dequantize(jnp.bfloat16), None
    if isinstance(operand, FP8Array):
        # FP8 x FP8 stays in FP8 so XLA can emit a native FP8 GEMM (Hopper, MI300+); exact either way.
        # Widened from its bits: a plain astype would let XLA:GPU fold away the FP8 rounding (formats.py).
        values = operand.data if keep_fp8 else float8_to_float32(operand.data).astype(jnp.bfloat16)
        return values, operand.scale
    return operand, None


def _nvfp4_input(operand):
    """(values to multiply, float32 scalar the product is multiplied by, or None) in a GEMM with an NVFP4
    operand: NVFP4 blocks as q * s_b (exact in bf16) and S_dec; FP8 data and 1 / scale."""
    if isinstance(operand, nvfp4.NVFP4Array):
        return operand.block_values(jnp.bfloat16), operand.decode_scale()
    if isinstance(operand, FP8Array):
        # 1 / scale rounded as IEEE does it, not as a GPU's divide (formats.divide_nearest_even).
        return float8_to_float32(operand.data).astype(jnp.bfloat16), divide_nearest_even(1.0, operand.scale)
    if isinstance(operand, MXArray):
        return operand.dequantize(jnp.bfloat16), None
    return operand, None


def _emulate_nvfp4(a, c, precision) -> jax.Array:
    """A GEMM with an NVFP4 operand: out = float32(sum_k v_a v_c) * float32(m_a * m_c), v and m from
    _nvfp4_input (for two NVFP4 operands m_a * m_c = S_dec_a * S_dec_c, the GEMM's alpha as NVIDIA's
    NVFP4 GEMMs take it), one float32 rounding of the product, which is flushed to zero below float32's
    normal range so that every back end gives the same (docs/numerics.md)."""
    (a_values, a_mult), (c_values, c_mult) = _nvfp4_input(a), _nvfp4_input(c)
    dtype = jnp.promote_types(a_values.dtype, c_values.dtype)
    out = jax.lax.dot_general(
        a_values.astype(dtype),
        c_values.astype(dtype),
        BMK_BNK,
        precision=precision,
        preferred_element_type=jnp.float32,
    )
    mults = [m for m in (a_mult, c_mult) if m is not None]
    alpha = mults[0] if len(mults) == 1 else flush_subnormal(mults[0] * mults[1])
    return out * alpha


def _scales_divide(a, c) -> str:
    """How a GEMM divides by its FP8 operands' scales: IEEE's quotient, unless an operand was scaled
    under fp8_divide "xla" (then the back end's divide, the program such operands were trained with)."""
    return "xla" if any(isinstance(x, FP8Array) and x.divide == "xla" for x in (a, c)) else "ieee"


def _emulate(a, c, precision, out_dtype=jnp.float32) -> jax.Array:
    if isinstance(a, nvfp4.NVFP4Array) or isinstance(c, nvfp4.NVFP4Array):
        return _emulate_nvfp4(a, c, precision)
    both_fp8 = isinstance(a, FP8Array) and isinstance(c, FP8Array)
    a_values, a_scale = _emulate_input(a, both_fp8)
    c_values, c_scale = _emulate_input(c, both_fp8)
    divide = _scales_divide(a, c)
    if both_fp8:
        precision = fp8_dot_precision(a_values, c_values) or precision
        inverse = fp8_divide(1.0, a_scale * c_scale, divide)
        return fp8_scaled_matmul(a_values, c_values, inverse, out_dtype, precision)
    dtype = jnp.promote_types(a_values.dtype, c_values.dtype)
    a_values, c_values = a_values.astype(dtype), c_values.astype(dtype)
    out = jax.lax.dot_general(
        a_values,
        c_values,
        BMK_BNK,
        precision=precision,
        preferred_element_type=jnp.float32,
    )
    if a_scale is None and c_scale is None:
        return out
    a_scale = jnp.float32(1.0) if a_scale is None else a_scale
    c_scale = jnp.float32(1.0) if c_scale is None else c_scale
    return out * fp8_divide(1.0, a_scale * c_scale, divide)


# ----------------------------------------------------------------------------------------------------
# native


# Where `native` multiplies NVFP4 x NVFP4 through scaled_dot: NVIDIA's block-scaled GEMMs take E4M3 scales
# per 16 (Blackwell); gfx950's take E8M0 only, where XLA would expand the dot instead. The CPU expands it
# too, exactly, which is how the tests check this path.
NVFP4_NATIVE_VENDORS = ("nvidia", "cpu")


def native_multiplies_nvfp4() -> bool:
    """Whether `native` takes NVFP4 x NVFP4 GEMMs here: a vendor above, and XLA compiles the probe's
    E4M3-scaled scaled_dot (probes.nvfp4_scaled_dot_compiles, once per process)."""
    return probes.describe_device().vendor in NVFP4_NATIVE_VENDORS and probes.nvfp4_scaled_dot_compiles()


def _native_shape_fits(a, c) -> bool:
    (batch, m, k), (_, n, _) = a.shape, c.shape
    return (
        batch == 1
        and m % NATIVE_MN_MULTIPLE == 0
        and n % NATIVE_MN_MULTIPLE == 0
        and k % NATIVE_K_MULTIPLE == 0
    )


def native_supports(a, c) -> bool:
    """True when an MX x MX or NVFP4 x NVFP4 GEMM (b, m, k) x (b, n, k) fits the shapes and types above;
    others fall back to `emulate` (same numbers, dequantized operands)."""
    if isinstance(a, nvfp4.NVFP4Array) and isinstance(c, nvfp4.NVFP4Array):
        return (
            a.block_size == c.block_size == nvfp4.NVFP4_BLOCK_SIZE
            and all(x.block_2d or x.axis == 2 for x in (a, c))
            and _native_shape_fits(a, c)
            and native_multiplies_nvfp4()
        )
    if not (isinstance(a, MXArray) and isinstance(c, MXArray)):
        return False
    types = {jnp.dtype(t) for t in NATIVE_ELEMENT_TYPES}
    return (
        jnp.dtype(a.data.dtype) in types
        and jnp.dtype(c.data.dtype) in types
        and a.block_size == c.block_size == NATIVE_BLOCK_SIZE
        and a.axis == c.axis == 2
        and _native_shape_fits(a, c)
    )


def _native(a, c) -> jax.Array:
    if isinstance(a, nvfp4.NVFP4Array):
        # emulate's numbers: float32(sum of q s_b products, each exact) times one float32 alpha.
        out = probes.scaled_dot(a.data, c.data, _nvfp4_row_scales(a), _nvfp4_row_scales(c))
        return out * flush_subnormal(a.decode_scale() * c.decode_scale())
    return probes.scaled_dot(a.data, c.data, a.scale, c.scale)


def _nvfp4_row_scales(x: nvfp4.NVFP4Array) -> jax.Array:
    """(b, rows, k / 16) E4M3 scales as scaled_dot takes them: a 2D tile's scale repeated over its rows."""
    return jnp.repeat(x.scale, x.block_size, axis=-2) if x.block_2d else x.scale


# ----------------------------------------------------------------------------------------------------
# fp8 (the fold)


def _runs_as_fp8(a_fold: bool, c_fold: bool, a_fp8: bool, c_fp8: bool, fp8_dtype) -> bool:
    """The fp8 back end's rule, on what the operands are: foldable (E2M1/E2M3 MX, blocks on K, or folded)
    or per-tensor FP8. Two foldable operands, or one and an OCP FP8Array (FNUZ devices do not mix them)."""
    if a_fold and c_fold:
        return True
    ocp = jnp.dtype(fp8_dtype) == jnp.dtype(jnp.float8_e4m3fn)
    return ocp and ((a_fold and c_fp8) or (c_fold and a_fp8))


def _is_folded(x, fp8_dtype) -> bool:
    return isinstance(x, fold.FoldedOperand) and jnp.dtype(x.data.dtype) == jnp.dtype(fp8_dtype)


def fp8_supports(a, c, fp8_dtype=jnp.float8_e4m3fn) -> bool:
    """True when the fp8 back end runs this GEMM as one FP8 GEMM: both operands foldable MX (E2M1 or E2M3,
    blocks on K; fold.is_foldable) or already folded into fp8_dtype (fold.FoldedOperand), or one of
    those and one OCP FP8Array (not on FNUZ devices, which do not mix the two)."""
    a_fold = fold.is_foldable(a) or _is_folded(a, fp8_dtype)
    c_fold = fold.is_foldable(c) or _is_folded(c, fp8_dtype)
    return _runs_as_fp8(a_fold, c_fold, isinstance(a, FP8Array), isinstance(c, FP8Array), fp8_dtype)


def fp8_folds(spec: QuantSpec) -> bool:
    """Whether the fp8 back end folds operands quantized by `spec` exactly into E4M3: MX with elements in
    fold.FOLDED_ELEMS, E2M1 or E2M3 (the spec-side twin of fold.is_foldable; a GEMM operand's blocks
    always lie on its contraction axis).

    MXFP6's E3M2 folds exactly only within 9 binades of its row's top block, MXFP8's elements do not fit
    one E4M3 grid per row in general, and NVFP4's E4M3 block scales times E2M1 elements leave E4M3's
    grid: GEMMs with such an operand run as in emulate (the same numbers). The one statement of the rule
    for recipes: quantizer_folds, fp8_unfolded and, through fp8_unfolded, execution's resolved reason and
    the self-check's FP8-GEMM count use it.
    """
    return spec.format is not None and spec.format.backends.get("fp8") == "fold"


def fp8_unfolded(recipe: Recipe) -> tuple[QuantSpec, ...]:
    """The recipe's block-scaled operands (QuantSpec.blocked) that the fp8 back end does not fold
    (fp8_folds), in GEMM order (fprop, dgrad, wgrad; lhs before rhs). Empty: every GEMM with a block-scaled
    operand runs as one FP8 GEMM there; per-tensor FP8 and unquantized operands are not listed."""
    return tuple(s for s in recipe.operands if s.blocked and not fp8_folds(s))


def quantizer_folds(a_spec: QuantSpec, c_spec: QuantSpec, backend: str) -> bool:
    """Whether a fused quantizer should write this GEMM's MX operands already folded: when the fp8 back end
    will run it as one FP8 GEMM in float8_e4m3fn (the fused fold writes that type only; on FNUZ devices
    the quantizer writes MX and the back end folds, `_fold_or_fp8`)."""
    if backend != "fp8" or jnp.dtype(probes.device_fold_dtype()) != jnp.dtype(jnp.float8_e4m3fn):
        return False
    a_fold, c_fold = (fp8_folds(s) for s in (a_spec, c_spec))
    a_fp8, c_fp8 = (s.quant_kind.per_tensor for s in (a_spec, c_spec))
    return _runs_as_fp8(a_fold, c_fold, a_fp8, c_fp8, jnp.float8_e4m3fn)


def _fold_or_fp8(x, fp8_dtype):
    """(FP8 values, int32 row exponents (b, rows) or None, float32 scalar to multiply by or None); an
    MXArray is folded here, a FoldedOperand (folded by a fused quantizer) is used as it is."""
    if isinstance(x, FP8Array):
        return x.data, None, fp8_divide(1.0, x.scale, x.divide)
    folded = x if isinstance(x, fold.FoldedOperand) else fold.fold_mx_to_fp8(x, fp8_dtype=fp8_dtype)
    return folded.data, folded.row_exponent, None


def fp8_matmul(a, c, fp8_dtype=jnp.float8_e4m3fn, out_dtype=jnp.float32) -> jax.Array:
    """out = dot_fp8(fold(a), fold(c)) * 2^Ea[m] * 2^Ec[n] (* 1/scale for an FP8Array operand).

    Equal to `emulate` up to the summation order of the float32 accumulation, except for elements of
    blocks the fold flushes (more than the element's window below their row's top block: 14 binades for
    E2M1, 11 / 12 for E2M3; see fold.py). Float32, except that out_dtype=bfloat16 with only power-of-two
    exponents to apply (two MX operands) asks the GEMM for bfloat16 directly: power-of-two scaling
    commutes with rounding, so the result equals the float32 one rounded to bfloat16 wherever that is a
    normal number, and the GEMM writes half the bytes (the scaling pass after it reads half as many).
    """
    a_data, a_exp, a_mult = _fold_or_fp8(a, fp8_dtype)
    c_data, c_exp, c_mult = _fold_or_fp8(c, fp8_dtype)
    only_exponents = a_mult is None and c_mult is None
    narrow = only_exponents and jnp.dtype(out_dtype) == jnp.dtype(jnp.bfloat16)
    precision = fp8_dot_precision(a_data, c_data)  # precise float32 accumulation on NVIDIA GPUs
    out = jax.lax.dot_general(
        a_data,
        c_data,
        BMK_BNK,
        precision=precision,
        preferred_element_type=out_dtype if narrow else jnp.float32,
    )
    exponent = jnp.zeros((), jnp.int32)
    if a_exp is not None:
        exponent = exponent + a_exp[:, :, None]
    if c_exp is not None:
        exponent = exponent + c_exp[:, None, :]
    out = fold.apply_exponents(out, exponent)
    for mult in (a_mult, c_mult):
        if mult is not None:
            out = out * mult
    return out


# ----------------------------------------------------------------------------------------------------


def matmul(a, c, *, backend: str, precision=None, out_dtype=jnp.float32) -> jax.Array:
    """out[b, m, n] = sum_k a[b, m, k] c[b, n, k] in float32, by the chosen (resolved) back end.

    out_dtype: what the caller rounds the result to; a back end may return it in that dtype directly
    where that gives the same values (fp8_matmul), else float32.
    """
    if backend == "native" and native_supports(a, c):
        return _native(a, c)
    if backend == "fp8":
        fp8_dtype = probes.device_fold_dtype()
        if fp8_supports(a, c, fp8_dtype):
            return fp8_matmul(a, c, fp8_dtype, out_dtype)
    if isinstance(a, fold.FoldedOperand) or isinstance(c, fold.FoldedOperand):
        raise TypeError(
            f"a folded operand runs on the fp8 back end only (backend {backend!r}, operands "
            f"{type(a).__name__} x {type(c).__name__}): quantize to MX for the others"
        )
    return _emulate(a, c, precision, out_dtype)
