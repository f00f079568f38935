"""GEMM back ends: one numerics, several ways to run it, and which one `auto` picks on which device.

Every back end computes out[b, m, n] = sum_k a[b, m, k] * c[b, n, k] in float32 from quantized operands
(both contract on their last axis). An operand is a plain array, an MXArray or an FP8Array.

- `emulate`: MX operands dequantized to bf16 (exact: an E2M1/E4M3/E5M2 element times a power of two fits
  bf16's 8-bit significand), FP8 operands multiplied in as their raw elements with the per-tensor scales
  applied to the float32 result; a plain dot_general with float32 accumulation. Runs everywhere.
- `native`: MX x MX GEMMs through `jax.lax.scaled_dot` (float4_e2m1fn / float8 data, float8_e8m0fnu
  scales), which XLA lowers to hipBLASLt block-scaled GEMMs on MI355X (gfx950) and cuDNN on Blackwell,
  for the shapes `native_supports` accepts; other GEMMs and shapes run as in `emulate`.
- `fp8`: E2M1 MX operands folded exactly into E4M3 with one exponent per row (fold.py), one plain FP8
  dot_general with float32 accumulation (cuBLASLt FP8 on Hopper, hipBLASLt FP8 on MI300 with the FNUZ
  types), the row exponents applied to its result. Also MX x FP8Array. MX operands with E4M3/E5M2
  elements do not fold exactly into one E4M3 grid per row in general: those GEMMs run as in `emulate`.
- `auto`: chosen from the device (`choose_backend`), or from the environment variable FP4JAX_GEMM_BACKEND.

Every FP8 x FP8 dot_general emitted here (emulate's FP8Array x FP8Array, the fp8 back end's folded GEMM)
asks for precise float32 accumulation on NVIDIA GPUs (`fp8_dot_precision`): with no algorithm and DEFAULT
precision, XLA runs FP8 GEMMs with cuBLASLt's fast accumulation (no promotion of the tensor cores' partial
sums to float32) and its Triton FP8 dots likewise. See docs/numerics.md.

A per-tensor FP8 x FP8 GEMM whose caller wants bfloat16 writes it straight from cuBLASLt on NVIDIA GPUs,
its scale applied in the GEMM's float32 epilogue, where a run-time probe finds that spelling exact
(`fp8_scaled_matmul`); elsewhere it writes float32 and the scale follows.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import re
import sys
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax import xla_flags
from fp4jax.ops.kernels import fold
from fp4jax.ops.quantize import FP8Array, MXArray

BACKENDS = ("auto", "emulate", "native", "fp8")
ENV_VAR = "FP4JAX_GEMM_BACKEND"

# Contract the last axis of both operands, batch over the first.
_BMK_BNK = (((2,), (2,)), ((0,), (0,)))


# ----------------------------------------------------------------------------------------------------
# which back end, on which device


@dataclasses.dataclass(frozen=True)
class DeviceDescription:
    """What dispatch needs to know about a device: vendor ("nvidia", "amd", "cpu", "tpu", or the jax
    platform name), its name, and its architecture ("9.0" for an NVIDIA compute capability, "gfx942"
    for an AMD GPU, "" when unknown)."""

    vendor: str
    name: str
    arch: str = ""


@dataclasses.dataclass(frozen=True)
class BackendChoice:
    """A back end, the FP8 type its fold uses on this device, and the reason, for the start-up log."""

    backend: str
    fp8_dtype: Any
    reason: str


# AMD product names -> architecture, for runtimes that report only the name.
_AMD_NAMES = {"MI300": "gfx942", "MI325": "gfx942", "MI350": "gfx950", "MI355": "gfx950", "MI250": "gfx90a"}


def describe_device(device=None) -> DeviceDescription:
    """The description of `device` (default: the first jax device), read defensively from its attributes."""
    device = jax.devices()[0] if device is None else device
    platform = str(getattr(device, "platform", "")).lower()
    name = str(getattr(device, "device_kind", ""))
    capability = str(getattr(device, "compute_capability", "") or "")
    gfx = re.search(r"gfx[0-9a-f]+", f"{capability} {name}".lower())
    if platform == "rocm" or gfx or "amd" in name.lower() or "instinct" in name.lower():
        arch = gfx.group(0) if gfx else next((a for k, a in _AMD_NAMES.items() if k in name.upper()), "")
        return DeviceDescription("amd", name, arch)
    if platform in ("gpu", "cuda"):
        return DeviceDescription("nvidia", name, capability)
    return DeviceDescription(platform, name, "")


def _compute_capability(arch: str) -> tuple[int, int]:
    match = re.fullmatch(r"\s*(\d+)(?:\.(\d+))?\s*", arch)
    return (int(match.group(1)), int(match.group(2) or 0)) if match else (0, 0)


def has_scaled_dot() -> bool:
    """Whether this jax has `jax.lax.scaled_dot` (checked at run time: older releases do not)."""
    return hasattr(jax.lax, "scaled_dot")


@functools.cache
def scaled_dot_compile_error() -> str | None:
    """Run-time check, once per process: None when XLA compiles a small MXFP4 `jax.lax.scaled_dot` for the
    default device, else why not, in one line.

    XLA's flags are fixed per process, and they decide it: on an H200 (jax 0.11.2) XLA emits scaled-dot
    through its Triton GEMMs, so with Triton GEMMs off (the trainer's default, training/setup.py) it
    fails with "Unsupported instruction opcode: scaled-dot". Compiles from shapes alone, so it may run
    while a caller is being traced.
    """
    if not has_scaled_dot():
        return f"jax {jax.__version__} has no jax.lax.scaled_dot"
    blocks = NATIVE_K_MULTIPLE // NATIVE_BLOCK_SIZE
    operands = [
        jax.ShapeDtypeStruct((1, NATIVE_MN_MULTIPLE, NATIVE_K_MULTIPLE), jnp.float4_e2m1fn),
        jax.ShapeDtypeStruct((1, NATIVE_MN_MULTIPLE, NATIVE_K_MULTIPLE), jnp.float4_e2m1fn),
        jax.ShapeDtypeStruct((1, NATIVE_MN_MULTIPLE, blocks), jnp.float8_e8m0fnu),
        jax.ShapeDtypeStruct((1, NATIVE_MN_MULTIPLE, blocks), jnp.float8_e8m0fnu),
    ]
    try:
        jax.jit(_scaled_dot).lower(*operands).compile()
    except Exception as exc:  # noqa: BLE001 - whatever stops the compile stops every native GEMM too
        error = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        if xla_flags.boolean(xla_flags.TRITON_GEMM) is False:
            error += (
                f" (XLA_FLAGS has {xla_flags.TRITON_GEMM}=false, and on an H200 XLA compiles scaled-dot only "
                "through its Triton GEMMs: train with --config.xla_gpu_triton_gemm=True)"
            )
        return error
    return None


def choose_backend(desc: DeviceDescription, *, scaled_dot: bool | None = None) -> BackendChoice:
    """The dispatch table. gfx950 and compute capability >= 10: native MX GEMMs where this process can
    compile jax.lax.scaled_dot (`scaled_dot_compile_error`; `scaled_dot` answers for it in tests), else
    fp8; gfx942 (MI300): fp8 with float8_e4m3fnuz; compute capability 9.x (Hopper): fp8; else emulate."""

    def native_or_fp8(where: str, cores: str) -> BackendChoice:
        if scaled_dot is None:
            error = scaled_dot_compile_error()  # compiled only where the table would pick native
        else:
            error = None if scaled_dot else "no jax.lax.scaled_dot"
        if error is None:
            return BackendChoice("native", ocp, f"{where}: {cores} via jax.lax.scaled_dot")
        return BackendChoice("fp8", ocp, f"{where}; native MX GEMMs unavailable: {error}")

    ocp, fnuz = jnp.float8_e4m3fn, jnp.float8_e4m3fnuz
    label = f"{desc.name or desc.vendor}"
    if desc.vendor == "amd":
        where = f"{label}, {desc.arch or 'unknown architecture'}"
        if desc.arch == "gfx950":
            return native_or_fp8(where, "MX matrix cores")
        if desc.arch == "gfx942":
            return BackendChoice("fp8", fnuz, f"{where}: FP8 matrix cores, float8_e4m3fnuz")
        return BackendChoice("emulate", ocp, f"{where}: no FP8/MX matrix cores known to fp4jax")
    if desc.vendor == "nvidia":
        major, minor = _compute_capability(desc.arch)
        where = f"{label}, compute capability {major}.{minor}"
        if major >= 10:
            return native_or_fp8(where, "MX tensor cores")
        if major == 9:
            return BackendChoice("fp8", ocp, f"{where}")
        return BackendChoice("emulate", ocp, f"{where}: no FP8 back end chosen for it")
    return BackendChoice("emulate", ocp, f"{label or 'unknown device'}: no GPU matrix cores to use")


def fold_dtype(desc: DeviceDescription) -> Any:
    """The E4M3 variant the fold writes on this device: FNUZ on gfx942 (MI300), OCP E4M3FN elsewhere."""
    return jnp.float8_e4m3fnuz if desc.vendor == "amd" and desc.arch == "gfx942" else jnp.float8_e4m3fn


@functools.cache
def _auto_choice() -> BackendChoice:
    """What `auto` means in this process: the environment override, else the device's table entry.
    Logged once, at the first GEMM traced."""
    desc = describe_device()
    override = os.environ.get(ENV_VAR, "").strip()
    if override and override != "auto":
        check_backend(override, f"environment variable {ENV_VAR}")
        choice = BackendChoice(override, fold_dtype(desc), f"{ENV_VAR}={override}")
    else:
        choice = choose_backend(desc)
        choice = dataclasses.replace(choice, reason=f"auto: {choice.reason}")
    print(f"fp4jax: GEMM back end {choice.backend} ({choice.reason})", file=sys.stderr, flush=True)
    return choice


def auto_choice() -> BackendChoice:
    """The back end `auto` resolves to in this process, with its reason (cached; the first call logs)."""
    return _auto_choice()


def check_backend(backend: str, where: str = "backend") -> None:
    if backend not in BACKENDS:
        raise ValueError(f"unknown GEMM back end {backend!r} in {where}: use one of {', '.join(BACKENDS)}")
    if backend == "native" and not has_scaled_dot():
        raise ValueError(
            f"GEMM back end 'native' needs jax.lax.scaled_dot, which jax {jax.__version__} lacks: "
            "upgrade jax, or use backend='fp8' or 'emulate'"
        )
    if backend == "native" and (error := scaled_dot_compile_error()):
        raise ValueError(
            f"GEMM back end 'native' ({where}): XLA cannot compile jax.lax.scaled_dot in this process: "
            f"{error}. Otherwise use backend='fp8' or 'emulate'"
        )


def resolve_backend(backend: str) -> str:
    """Maps `auto` to this process's choice (auto_choice); checks that any other name exists here."""
    if backend == "auto":
        return auto_choice().backend
    check_backend(backend)
    return backend


# ----------------------------------------------------------------------------------------------------
# FP8 x FP8 accumulation


def _platform_of(operands) -> str:
    """The platform these operands run on: that of a concrete operand's devices, else the default backend
    (under jit the operands are tracers; the program is lowered for the default backend unless told
    otherwise)."""
    for x in operands:
        try:
            return next(iter(x.devices())).platform
        except Exception:  # a tracer (ConcretizationTypeError) or not an array: look further
            continue
    return jax.default_backend()


def fp8_dot_precision(*operands):
    """The `precision` for an FP8 x FP8 dot_general on the platform of `operands`, checked at trace time.

    On NVIDIA GPUs: DotAlgorithmPreset.ANY_F8_ANY_F8_F32, i.e. float32 accumulation with the tensor cores'
    partial sums promoted to float32 (cuBLASLt without CUBLASLT_MATMUL_DESC_FAST_ACCUM). Without it, XLA
    turns on fast accumulation for every FP8 GEMM of DEFAULT precision. Elsewhere: None, the plain dot
    (the CPU back end rejects the preset; it accumulates in float32 anyway; ROCm is left as it was).
    """
    if _on_nvidia_gpu(operands):
        return jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32
    return None


def _on_nvidia_gpu(operands) -> bool:
    return _platform_of(operands) in ("gpu", "cuda") and describe_device().vendor == "nvidia"


# ----------------------------------------------------------------------------------------------------
# FP8 x FP8 GEMMs that write bfloat16, the per-tensor scale in cuBLASLt's epilogue


def _scaled_after(a8, c8, scale, out_dtype, precision):
    """The contract: the float32 accumulation times the combined scale, rounded once to out_dtype."""
    out = jax.lax.dot_general(a8, c8, _BMK_BNK, precision=precision, preferred_element_type=jnp.float32)
    return (out * scale).astype(out_dtype)


def _scaled_in_epilogue(a8, c8, scale, out_dtype):
    """The same product, spelled so that XLA's GEMM rewriter makes it one cuBLASLt FP8 GEMM that writes
    out_dtype: dot(convert(a8) * broadcast(scale), convert(c8)) is its "dequantized FP8 operand" pattern,
    which it turns into the FP8 GEMM with `scale` as A's scale factor, applied to the float32 accumulator
    before the one rounding. The pattern wants the scale in the dequantized type, but XLA's excess
    precision (on by default) drops the scalar's float32 -> bfloat16 -> float32 round trip, so the epilogue
    multiplies by the float32 scale. HIGHEST keeps cuBLASLt's precise accumulation (DEFAULT would turn
    fast accumulation on). Used only where `epilogue_scaling_is_exact` has checked all of that.
    """
    wide = jnp.dtype(out_dtype)
    a = a8.astype(wide) * scale.astype(wide)
    highest = jax.lax.Precision.HIGHEST
    return jax.lax.dot_general(a, c8.astype(wide), _BMK_BNK, precision=highest, preferred_element_type=wide)


@functools.cache
def epilogue_scaling_is_exact(a_dtype, c_dtype, out_dtype) -> bool:
    """Run-time check, once per process and dtypes: does `_scaled_in_epilogue` compile to a cuBLASLt FP8 GEMM
    writing out_dtype and give `_scaled_after`'s bits on the default device?

    The probe's scale has a float32 significand that bfloat16 cannot hold, and its sums are such that a
    second rounding shows in about a quarter of them, so a scale rounded to out_dtype or a result rounded
    twice fails it. Where it fails (XLA's Triton GEMM fusions on, its default: one takes the dot with its
    dequantizing producers; presumably --xla_allow_excess_precision=false; a GPU without FP8 GEMMs) the
    GEMM keeps the float32 output: the same numbers, slower. It may run while a caller is being traced,
    so it evaluates eagerly. (Precise accumulation is the GPU lane's swamping test.)
    """
    rng = np.random.default_rng(0)
    try:
        with jax.ensure_compile_time_eval():
            a = jnp.asarray(rng.normal(size=(1, 256, 512)) * 4, a_dtype)
            c = jnp.asarray(rng.normal(size=(1, 128, 512)) * 4, c_dtype)
            scale = jnp.float32(1.0) / (jnp.float32(3.7) * jnp.float32(0.61))
            fast = jax.jit(_scaled_in_epilogue, static_argnums=3).lower(a, c, scale, out_dtype).compile()
            want = jax.jit(_scaled_after, static_argnums=(3, 4))(
                a, c, scale, out_dtype, jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32
            )
            same = bool(np.array_equal(np.asarray(fast(a, c, scale)), np.asarray(want)))
    except Exception:  # noqa: BLE001 - a platform that cannot compile the probe cannot use the spelling
        return False
    return same and writes_fp8_gemm_output(fast.as_text(), out_dtype)


_HLO_TYPES = {"bfloat16": "bf16", "float16": "f16", "float32": "f32"}


def writes_fp8_gemm_output(hlo_text: str, out_dtype) -> bool:
    """Whether compiled HLO holds a cuBLASLt FP8 GEMM whose result is out_dtype."""
    hlo_type = _HLO_TYPES[jnp.dtype(out_dtype).name]
    pattern = r"\(" + hlo_type + r"\[[^\n]*__cublas\$lt\$matmul\$f8"
    return re.search(pattern, hlo_text) is not None


def fp8_scaled_matmul(a8, c8, scale, out_dtype, precision):
    """sum_k a8 c8 * scale for two FP8 operands (B, M, K), (B, N, K), rounded once to out_dtype.

    On NVIDIA GPUs a bfloat16 result comes straight from the GEMM (half the bytes written and read
    again, and no separate scaling pass) where `epilogue_scaling_is_exact`; otherwise the GEMM writes
    float32 and the scale and rounding follow it.
    """
    narrow = jnp.dtype(out_dtype) == jnp.dtype(jnp.bfloat16) and _on_nvidia_gpu((a8, c8))
    if narrow and epilogue_scaling_is_exact(jnp.dtype(a8.dtype), jnp.dtype(c8.dtype), jnp.dtype(out_dtype)):
        return _scaled_in_epilogue(a8, c8, scale, out_dtype)
    return _scaled_after(a8, c8, scale, jnp.float32, precision)


# ----------------------------------------------------------------------------------------------------
# emulate


def _emulate_input(operand, keep_fp8: bool):
    """(values to multiply, scalar to multiply the result by, or None)."""
    if isinstance(operand, MXArray):
        return operand.dequantize(jnp.bfloat16), None
    if isinstance(operand, FP8Array):
        # FP8 x FP8 stays in FP8 so XLA can emit a native FP8 GEMM (Hopper, MI300+); exact either way.
        return (operand.data if keep_fp8 else operand.data.astype(jnp.bfloat16)), operand.scale
    return operand, None


def _emulate(a, c, precision, out_dtype=jnp.float32) -> jax.Array:
    both_fp8 = isinstance(a, FP8Array) and isinstance(c, FP8Array)
    a_values, a_scale = _emulate_input(a, both_fp8)
    c_values, c_scale = _emulate_input(c, both_fp8)
    if both_fp8:
        precision = fp8_dot_precision(a_values, c_values) or precision
        return fp8_scaled_matmul(a_values, c_values, 1.0 / (a_scale * c_scale), out_dtype, precision)
    dtype = jnp.promote_types(a_values.dtype, c_values.dtype)
    a_values, c_values = a_values.astype(dtype), c_values.astype(dtype)
    out = jax.lax.dot_general(
        a_values,
        c_values,
        _BMK_BNK,
        precision=precision,
        preferred_element_type=jnp.float32,
    )
    if a_scale is None and c_scale is None:
        return out
    a_scale = jnp.float32(1.0) if a_scale is None else a_scale
    c_scale = jnp.float32(1.0) if c_scale is None else c_scale
    return out * (1.0 / (a_scale * c_scale))


# ----------------------------------------------------------------------------------------------------
# native

# What hipBLASLt's block-scaled GEMM takes through XLA's ROCm scaled-dot lowering: OCP element types,
# E8M0 scales, blocks of 32 along K, M and N multiples of 16, K a multiple of 32 (XLA's check) and of 128
# (hipBLASLt's kernels, as reported by AMD's Transformer Engine), one batch (older XLA rejects more).
NATIVE_ELEMENT_TYPES = (jnp.float4_e2m1fn, jnp.float8_e4m3fn, jnp.float8_e5m2)
NATIVE_BLOCK_SIZE = 32
NATIVE_MN_MULTIPLE = 16
NATIVE_K_MULTIPLE = 128


def native_supports(a, c) -> bool:
    """True when an MX x MX GEMM (b, m, k) x (b, n, k) fits the shapes and types above; others fall back
    to `emulate` (same numbers, dequantized operands)."""
    if not (isinstance(a, MXArray) and isinstance(c, MXArray)):
        return False
    types = {jnp.dtype(t) for t in NATIVE_ELEMENT_TYPES}
    (batch, m, k), (_, n, _) = a.shape, c.shape
    return (
        jnp.dtype(a.data.dtype) in types
        and jnp.dtype(c.data.dtype) in types
        and a.block_size == c.block_size == NATIVE_BLOCK_SIZE
        and a.axis == c.axis == 2
        and batch == 1
        and m % NATIVE_MN_MULTIPLE == 0
        and n % NATIVE_MN_MULTIPLE == 0
        and k % NATIVE_K_MULTIPLE == 0
    )


def _scaled_dot(a_data, c_data, a_scale, c_scale) -> jax.Array:
    return jax.lax.scaled_dot(
        a_data,
        c_data,
        lhs_scale=a_scale,
        rhs_scale=c_scale,
        dimension_numbers=_BMK_BNK,
        preferred_element_type=jnp.float32,
    )


def _native(a: MXArray, c: MXArray) -> jax.Array:
    return _scaled_dot(a.data, c.data, a.scale, c.scale)


# ----------------------------------------------------------------------------------------------------
# fp8 (the fold)


@functools.cache
def _device_fold_dtype() -> Any:
    return fold_dtype(describe_device())


def _runs_as_fp8(a_fold: bool, c_fold: bool, a_fp8: bool, c_fp8: bool, fp8_dtype) -> bool:
    """The fp8 back end's rule, on what the operands are: foldable (E2M1 MX, blocks on K, or already folded)
    or per-tensor FP8. Two foldable operands, or one and an OCP FP8Array (FNUZ devices do not mix them)."""
    if a_fold and c_fold:
        return True
    ocp = jnp.dtype(fp8_dtype) == jnp.dtype(jnp.float8_e4m3fn)
    return ocp and ((a_fold and c_fp8) or (c_fold and a_fp8))


def _is_folded(x, fp8_dtype) -> bool:
    return isinstance(x, fold.FoldedOperand) and jnp.dtype(x.data.dtype) == jnp.dtype(fp8_dtype)


def fp8_supports(a, c, fp8_dtype=jnp.float8_e4m3fn) -> bool:
    """True when the fp8 back end runs this GEMM as one FP8 GEMM: both operands foldable MX (E2M1, blocks
    on K) or already folded into fp8_dtype (fold.FoldedOperand), or one of those and one OCP FP8Array (not
    on FNUZ devices, which do not mix the two)."""
    a_fold = fold.is_foldable(a) or _is_folded(a, fp8_dtype)
    c_fold = fold.is_foldable(c) or _is_folded(c, fp8_dtype)
    return _runs_as_fp8(a_fold, c_fold, isinstance(a, FP8Array), isinstance(c, FP8Array), fp8_dtype)


def quantizer_folds(a_spec, c_spec, backend: str) -> bool:
    """Whether a fused quantizer should write this GEMM's E2M1 MX operands already folded: when the fp8 back
    end will run it as one FP8 GEMM in float8_e4m3fn (the fused fold writes that type only; on FNUZ
    devices the quantizer writes MX and the back end folds). Specs are recipes.QuantSpec."""
    if backend != "fp8" or jnp.dtype(_device_fold_dtype()) != jnp.dtype(jnp.float8_e4m3fn):
        return False
    a_fold, c_fold = (s.kind == "mx" and s.elem == "e2m1" for s in (a_spec, c_spec))
    return _runs_as_fp8(a_fold, c_fold, a_spec.kind == "fp8", c_spec.kind == "fp8", jnp.float8_e4m3fn)


def _fold_or_fp8(x, fp8_dtype):
    """(FP8 values, int32 row exponents (b, rows) or None, float32 scalar to multiply by or None); an
    MXArray is folded here, a FoldedOperand (folded by a fused quantizer) is used as it is."""
    if isinstance(x, FP8Array):
        return x.data, None, 1.0 / x.scale
    folded = x if isinstance(x, fold.FoldedOperand) else fold.fold_mx_to_fp8(x, fp8_dtype=fp8_dtype)
    return folded.data, folded.row_exponent, None


def fp8_matmul(a, c, fp8_dtype=jnp.float8_e4m3fn, out_dtype=jnp.float32) -> jax.Array:
    """out = dot_fp8(fold(a), fold(c)) * 2^Ea[m] * 2^Ec[n] (* 1/scale for an FP8Array operand).

    Equal to `emulate` up to the summation order of the float32 accumulation, except for elements of
    blocks the fold flushes (more than 14 binades below their row's top block; see fold.py). Float32,
    except that out_dtype=bfloat16 with only power-of-two exponents to apply (two MX operands) asks the
    GEMM for bfloat16 directly: power-of-two scaling commutes with rounding, so the result equals the
    float32 one rounded to bfloat16 wherever that is a normal number, and the GEMM writes half the bytes
    (the scaling pass after it reads half as many).
    """
    a_data, a_exp, a_mult = _fold_or_fp8(a, fp8_dtype)
    c_data, c_exp, c_mult = _fold_or_fp8(c, fp8_dtype)
    only_exponents = a_mult is None and c_mult is None
    narrow = only_exponents and jnp.dtype(out_dtype) == jnp.dtype(jnp.bfloat16)
    precision = fp8_dot_precision(a_data, c_data)  # precise float32 accumulation on NVIDIA GPUs
    out = jax.lax.dot_general(
        a_data,
        c_data,
        _BMK_BNK,
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
        fp8_dtype = _device_fold_dtype()
        if fp8_supports(a, c, fp8_dtype):
            return fp8_matmul(a, c, fp8_dtype, out_dtype)
    if isinstance(a, fold.FoldedOperand) or isinstance(c, fold.FoldedOperand):
        raise TypeError(
            f"a folded operand runs on the fp8 back end only (backend {backend!r}, operands "
            f"{type(a).__name__} x {type(c).__name__}): quantize to MX for the others"
        )
    return _emulate(a, c, precision, out_dtype)
