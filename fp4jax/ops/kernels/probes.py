"""What this device is and can do: its description, the back-end dispatch table, and run-time probes.

The GEMM back ends (backends.py) and the fused quantizer ask here which device they run on; the
probes compile small programs once per process to learn what XLA can do with this device and these
flags (native scaled-dot GEMMs, FP8 GEMMs that write bfloat16 with the scale in their epilogue). The
probes evaluate eagerly and are cached; `run_probes` makes them all up front (the trainer's set-up calls
it), so that no program is compiled while a step is being traced.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import re
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from fp4jax import xla_flags

__all__ = [
    "BMK_BNK",
    "NATIVE_BLOCK_SIZE",
    "NATIVE_ELEMENT_TYPES",
    "NATIVE_K_MULTIPLE",
    "NATIVE_MN_MULTIPLE",
    "BackendChoice",
    "DeviceDescription",
    "auto_choice",
    "choose_backend",
    "describe_device",
    "device_fold_dtype",
    "epilogue_scaling_is_exact",
    "fold_dtype",
    "has_scaled_dot",
    "nvfp4_scaled_dot_compiles",
    "on_nvidia_gpu",
    "platform_of",
    "run_probes",
    "scaled_after",
    "scaled_dot",
    "scaled_dot_compile_error",
    "scaled_in_epilogue",
    "writes_fp8_gemm_output",
]

logger = logging.getLogger(__name__)

# The dimension numbers of every GEMM the back ends emit: (B, M, K) x (B, N, K), contracting the last axis
# of both operands, batching over the first.
BMK_BNK = (((2,), (2,)), ((0,), (0,)))


# What hipBLASLt's block-scaled GEMM takes through XLA's ROCm scaled-dot lowering: OCP element types,
# E8M0 scales, blocks of 32 along K, M and N multiples of 16, K a multiple of 32 (XLA's check) and of 128
# (hipBLASLt's kernels, as reported by AMD's Transformer Engine), one batch (older XLA rejects more).
NATIVE_ELEMENT_TYPES = (jnp.float4_e2m1fn, jnp.float8_e4m3fn, jnp.float8_e5m2)
NATIVE_BLOCK_SIZE = 32
NATIVE_MN_MULTIPLE = 16
NATIVE_K_MULTIPLE = 128


def scaled_dot(a_data, c_data, a_scale, c_scale) -> jax.Array:
    """The native MX GEMM spelling (what scaled_dot_compile_error compiles)."""
    return jax.lax.scaled_dot(
        a_data,
        c_data,
        lhs_scale=a_scale,
        rhs_scale=c_scale,
        dimension_numbers=BMK_BNK,
        preferred_element_type=jnp.float32,
    )


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
    error = _small_scaled_dot_error(jnp.float8_e8m0fnu, NATIVE_BLOCK_SIZE)
    if error is not None and xla_flags.boolean(xla_flags.TRITON_GEMM) is False:
        error += (
            f" (XLA_FLAGS has {xla_flags.TRITON_GEMM}=false, and on an H200 XLA compiles scaled-dot only "
            "through its Triton GEMMs: train with --config.xla_gpu_triton_gemm=True)"
        )
    return error


def _small_scaled_dot_error(scale_dtype, block_size: int) -> str | None:
    """None when XLA compiles a (1, 16, 128) x (1, 16, 128) E2M1 scaled_dot with `scale_dtype` scales per
    `block_size` for the default device, else the first line of why not (from shapes alone)."""
    data = jax.ShapeDtypeStruct((1, NATIVE_MN_MULTIPLE, NATIVE_K_MULTIPLE), jnp.float4_e2m1fn)
    scale = jax.ShapeDtypeStruct((1, NATIVE_MN_MULTIPLE, NATIVE_K_MULTIPLE // block_size), scale_dtype)
    try:
        jax.jit(scaled_dot).lower(data, data, scale, scale).compile()
    except Exception as exc:  # noqa: BLE001 - whatever stops the compile stops every such GEMM too
        return (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return None


@functools.cache
def nvfp4_scaled_dot_compiles() -> bool:
    """Run-time check, once per process: whether XLA compiles a small NVFP4 `jax.lax.scaled_dot` (E2M1 data,
    float8_e4m3fn scales per 16) for the default device; the native back end multiplies NVFP4 x NVFP4
    through it only then (an XLA without E4M3 block scales keeps NVFP4 on emulate's path)."""
    if scaled_dot_compile_error() is not None:
        return False
    if _small_scaled_dot_error(jnp.float8_e4m3fn, 16) is not None:  # NVFP4's blocks of 16
        logger.info("fp4jax: XLA cannot compile an NVFP4 scaled_dot here: native NVFP4 GEMMs run as emulate")
        return False
    return True


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
def auto_choice() -> BackendChoice:
    """The back end `auto` resolves to in this process: the device's table entry, with its reason.

    Cached, and logged once (at INFO) by the first call: the trainer's set-up makes it before tracing.
    """
    choice = choose_backend(describe_device())
    choice = dataclasses.replace(choice, reason=f"auto: {choice.reason}")
    logger.info("GEMM back end %s (%s)", choice.backend, choice.reason)
    return choice


@functools.cache
def device_fold_dtype() -> Any:
    """The E4M3 variant the fold writes on this process's default device (`fold_dtype`)."""
    return fold_dtype(describe_device())


def platform_of(operands) -> str:
    """The platform these operands run on: that of a concrete operand's devices; else, under jit (the
    operands are tracers), that of the device `jax.default_device(...)` names where one is in force (a
    program traced inside it is lowered for it: a GPU machine's CPU, say), else the default backend."""
    for x in operands:
        try:
            return next(iter(x.devices())).platform
        except Exception:  # a tracer (ConcretizationTypeError) or not an array: look further
            continue
    default = getattr(jax.config, "jax_default_device", None)  # a Device, a platform name or None
    if default is not None:
        return default if isinstance(default, str) else default.platform
    return jax.default_backend()


def on_nvidia_gpu(operands=()) -> bool:
    """Whether `operands` (tracers or arrays; none: the default backend) run on an NVIDIA GPU: the
    one rule the GEMMs and the fused quantizer use."""
    return platform_of(operands) in ("gpu", "cuda") and describe_device().vendor == "nvidia"


def scaled_after(a8, c8, scale, out_dtype, precision):
    """The contract: the float32 accumulation times the combined scale, rounded once to out_dtype."""
    out = jax.lax.dot_general(a8, c8, BMK_BNK, precision=precision, preferred_element_type=jnp.float32)
    return (out * scale).astype(out_dtype)


def scaled_in_epilogue(a8, c8, scale, out_dtype):
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
    return jax.lax.dot_general(a, c8.astype(wide), BMK_BNK, precision=highest, preferred_element_type=wide)


@functools.cache
def epilogue_scaling_is_exact(a_dtype, c_dtype, out_dtype) -> bool:
    """Run-time check, once per process and dtypes: does `scaled_in_epilogue` compile to a cuBLASLt FP8 GEMM
    writing out_dtype and give `scaled_after`'s bits on the default device?

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
            fast = jax.jit(scaled_in_epilogue, static_argnums=3).lower(a, c, scale, out_dtype).compile()
            want = jax.jit(scaled_after, static_argnums=(3, 4))(
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


def run_probes(backend: str) -> None:
    """Runs, once per process, every probe the GEMMs of `backend` (resolved) may ask while traced."""
    if backend == "fp8" and on_nvidia_gpu():
        fp8 = jnp.dtype(jnp.float8_e4m3fn), jnp.dtype(jnp.float8_e5m2)
        for a_dtype in fp8:
            for c_dtype in fp8:
                epilogue_scaling_is_exact(a_dtype, c_dtype, jnp.dtype(jnp.bfloat16))
