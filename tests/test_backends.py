"""Back-end dispatch: the table for every (platform, architecture) pair with mocked devices, the override,
the start-up log, and the native path's shape rule with its fallback (on CPU, equal to emulate)."""

import dataclasses
import logging
import os
import subprocess
import sys
import types

import jax
import jax.numpy as jnp
import lanes
import numpy as np
import pytest
from helpers import all_eqns

from fp4jax import xla_flags
from fp4jax.ops import quantize_fp8
from fp4jax.ops import quantize_mx as _quantize_mx
from fp4jax.ops.kernels import backends, probes

E4M3, FNUZ = jnp.float8_e4m3fn, jnp.float8_e4m3fnuz
ON_NVIDIA = probes.describe_device().vendor == "nvidia"


@pytest.fixture(autouse=True)
def _fresh_device_caches():
    """Every test sees the device it mocks: the per-process caches of what the device is are emptied
    around it (a mocked ROCm device's FNUZ fold type would otherwise outlive its test)."""
    caches = (probes.auto_choice, probes.device_fold_dtype, probes.epilogue_scaling_is_exact)
    for cache in caches:
        cache.cache_clear()
    yield
    for cache in caches:
        cache.cache_clear()


def _device(platform, kind, capability=None):
    attrs = {"platform": platform, "device_kind": kind}
    if capability is not None:
        attrs["compute_capability"] = capability
    return types.SimpleNamespace(**attrs)


# (mocked device, description, backend with scaled_dot, backend without, fold dtype)
TABLE = [
    (_device("cpu", "cpu"), ("cpu", ""), "emulate", "emulate", E4M3),
    (_device("tpu", "TPU v5 lite"), ("tpu", ""), "emulate", "emulate", E4M3),
    (_device("gpu", "NVIDIA A100-SXM4-80GB", "8.0"), ("nvidia", "8.0"), "emulate", "emulate", E4M3),
    (_device("gpu", "NVIDIA L40S", "8.9"), ("nvidia", "8.9"), "emulate", "emulate", E4M3),
    (_device("gpu", "NVIDIA H100 80GB HBM3", "9.0"), ("nvidia", "9.0"), "fp8", "fp8", E4M3),
    (_device("cuda", "NVIDIA H200", "9.0"), ("nvidia", "9.0"), "fp8", "fp8", E4M3),
    (_device("gpu", "NVIDIA B200", "10.0"), ("nvidia", "10.0"), "native", "fp8", E4M3),
    (_device("gpu", "NVIDIA GB300", "10.3"), ("nvidia", "10.3"), "native", "fp8", E4M3),
    (_device("gpu", "NVIDIA RTX PRO 6000", "12.0"), ("nvidia", "12.0"), "native", "fp8", E4M3),
    (_device("rocm", "AMD Instinct MI355X", "gfx950"), ("amd", "gfx950"), "native", "fp8", E4M3),
    (_device("gpu", "AMD Instinct MI350X"), ("amd", "gfx950"), "native", "fp8", E4M3),
    (_device("rocm", "AMD Instinct MI300X", "gfx942:sramecc+:xnack-"), ("amd", "gfx942"), "fp8", "fp8", FNUZ),
    (_device("rocm", "AMD Instinct MI325X"), ("amd", "gfx942"), "fp8", "fp8", FNUZ),
    (_device("rocm", "AMD Instinct MI250X", "gfx90a"), ("amd", "gfx90a"), "emulate", "emulate", E4M3),
    (_device("rocm", "AMD Radeon RX 7900 XTX", "gfx1100"), ("amd", "gfx1100"), "emulate", "emulate", E4M3),
]


@pytest.mark.parametrize("device, described, with_sd, without_sd, fold_dtype", TABLE)
def test_dispatch_table(device, described, with_sd, without_sd, fold_dtype):
    desc = probes.describe_device(device)
    assert (desc.vendor, desc.arch) == described
    assert desc.name == device.device_kind
    choice = probes.choose_backend(desc, scaled_dot=True)
    assert choice.backend == with_sd
    assert probes.choose_backend(desc, scaled_dot=False).backend == without_sd
    assert probes.fold_dtype(desc) == fold_dtype
    if choice.backend == "fp8":
        assert choice.fp8_dtype == fold_dtype
    assert desc.name in choice.reason


def test_hopper_reason_reads_like_the_log():
    choice = probes.choose_backend(probes.describe_device(_device("gpu", "NVIDIA H200", "9.0")))
    assert f"GEMM back end {choice.backend} (auto: {choice.reason})" == (
        "GEMM back end fp8 (auto: NVIDIA H200, compute capability 9.0)"
    )


@pytest.fixture
def fresh_auto(monkeypatch):
    """auto_choice is cached per process: clear it around each test."""
    probes.auto_choice.cache_clear()
    yield monkeypatch
    probes.auto_choice.cache_clear()


def _auto_logs(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == probes.__name__]


def test_auto_on_a_cpu_logs_once(fresh_auto, caplog):
    """On a (mocked) CPU device auto means emulate, and says so once per process, whatever runs the test."""
    caplog.set_level(logging.INFO, logger=probes.__name__)
    fresh_auto.setattr(jax, "devices", lambda *a: [_device("cpu", "cpu")])
    assert backends.resolve_backend("auto") == "emulate"
    assert backends.resolve_backend("auto") == "emulate"
    logged = _auto_logs(caplog)
    assert len(logged) == 1 and logged[0].startswith("GEMM back end emulate (auto: cpu"), logged


@pytest.mark.skipif(
    probes.describe_device().vendor != "nvidia" or not probes.describe_device().arch.startswith("9."),
    reason="needs an NVIDIA GPU of compute capability 9.x (Hopper)",
)
def test_auto_picks_fp8_on_this_hopper(fresh_auto, caplog):
    """The real device: Hopper (H100, H200) runs MX GEMMs on the fp8 back end."""
    caplog.set_level(logging.INFO, logger=probes.__name__)
    assert backends.resolve_backend("auto") == "fp8"
    assert _auto_logs(caplog)[0].startswith("GEMM back end fp8 (auto: NVIDIA")


def test_auto_uses_the_mocked_device(fresh_auto, caplog):
    caplog.set_level(logging.INFO, logger=probes.__name__)
    fresh_auto.setattr(jax, "devices", lambda *a: [_device("gpu", "NVIDIA H200", "9.0")])
    assert backends.resolve_backend("auto") == "fp8"
    assert _auto_logs(caplog) == ["GEMM back end fp8 (auto: NVIDIA H200, compute capability 9.0)"]


def test_the_library_reads_no_environment_variable(fresh_auto):
    """FP4JAX_GEMM_BACKEND is the trainer's (training.setup), not the library's: auto stays the table's."""
    fresh_auto.setenv("FP4JAX_GEMM_BACKEND", "fp4")
    fresh_auto.setattr(jax, "devices", lambda *a: [_device("cpu", "cpu")])
    assert backends.resolve_backend("auto") == "emulate"


def test_environment_overrides_the_recipe_at_the_trainers_edge(fresh_auto):
    from fp4jax.ops import get_recipe, resolve_execution
    from fp4jax.training import setup

    env = {"FP4JAX_GEMM_BACKEND": "emulate", "FP4JAX_QUANTIZE_IMPL": " xla "}
    overrides = setup.execution_overrides(env)
    assert overrides == {"backend": "emulate", "quantizer": "xla"}
    assert setup.execution_overrides({"FP4JAX_GEMM_BACKEND": "auto", "FP4JAX_QUANTIZE_IMPL": ""}) == {}
    recipe, execution = resolve_execution("mxfp4_full_h16", **overrides, source="environment")
    assert recipe == dataclasses.replace(get_recipe("mxfp4_full_h16"), backend="emulate", quantizer="xla")
    assert (execution.backend, execution.quantizer) == ("emulate", "xla")
    assert execution.backend_reason == "set by environment"


def test_bad_backend_names_fail_in_one_line(fresh_auto):
    from fp4jax.training import setup
    from fp4jax.training.errors import ConfigError

    with pytest.raises(
        ConfigError, match=r"^unknown FP4JAX_GEMM_BACKEND='fp4': use one of auto, emulate, native, fp8$"
    ):
        setup.execution_overrides({"FP4JAX_GEMM_BACKEND": "fp4"})
    message = r"^unknown FP4JAX_QUANTIZE_IMPL='triton': use one of auto, pallas, xla, reference$"
    with pytest.raises(ConfigError, match=message):
        setup.execution_overrides({"FP4JAX_QUANTIZE_IMPL": "triton"})
    with pytest.raises(ValueError, match="use one of auto, emulate, native, fp8"):
        backends.resolve_backend("cublas")


def test_native_without_scaled_dot_is_refused(monkeypatch):
    monkeypatch.delattr(jax.lax, "scaled_dot", raising=False)
    assert not probes.has_scaled_dot()
    with pytest.raises(ValueError, match="needs jax.lax.scaled_dot"):
        backends.resolve_backend("native")


# ----------------------------------------------------------------------------------------------------
# the native path's shapes


quantize_mx = jax.jit(_quantize_mx, static_argnames=("block_size", "elem", "scale_mode"))
matmul_jit = jax.jit(backends.matmul, static_argnames=("backend", "precision", "out_dtype"))


def _mx(shape, seed=0, block=32, elem="e2m1"):
    x = jax.random.normal(jax.random.key(seed), shape)
    return quantize_mx(x, block_size=block, elem=elem, scale_mode="even")


@pytest.mark.parametrize(
    "a_shape, c_shape, block, fits",
    [
        ((1, 32, 256), (1, 48, 256), 32, True),
        ((1, 32, 128), (1, 16, 128), 32, True),
        ((1, 24, 256), (1, 48, 256), 32, False),  # M not a multiple of 16
        ((1, 32, 256), (1, 40, 256), 32, False),  # N not a multiple of 16
        ((1, 32, 96), (1, 48, 96), 32, False),  # K not a multiple of 128
        ((2, 32, 256), (2, 48, 256), 32, False),  # batched
        ((1, 32, 256), (1, 48, 256), 16, False),  # blocks of 16
    ],
)
def test_native_shape_rule_and_fallback(a_shape, c_shape, block, fits):
    a, c = _mx(a_shape, 1, block), _mx(c_shape, 2, block)
    assert backends.native_supports(a, c) == fits
    lanes.skip_unless_native_gemms_compile()
    jaxpr = str(jax.make_jaxpr(lambda x, y: backends.matmul(x, y, backend="native"))(a, c))
    assert ("scaled_dot" in jaxpr) == fits
    got = np.asarray(matmul_jit(a, c, backend="native"))
    want = np.asarray(matmul_jit(a, c, backend="emulate"))
    if jax.default_backend() == "cpu":  # exact float32 accumulation, same order
        np.testing.assert_array_equal(got, want)
    else:  # MX matrix cores / library GEMMs: reduced-precision partial sums
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_scaled_dot_probe_says_whether_native_gemms_compile():
    """The probe's answer is this process's: a native GEMM of a fitting shape compiles exactly when the
    probe found no error (on the CPU lane always; on an H200 only with XLA's Triton GEMMs on)."""
    if not probes.has_scaled_dot():
        pytest.skip("this jax has no jax.lax.scaled_dot")
    error = probes.scaled_dot_compile_error()
    a, c = _mx((1, 32, 256), 1), _mx((1, 48, 256), 2)
    try:
        jax.jit(backends._native).lower(a, c).compile()
        compiled = True
    except Exception:  # noqa: BLE001 - the probe's own rule
        compiled = False
    assert compiled == (error is None), error


def test_native_that_cannot_compile_is_one_line_naming_the_triton_flag(failing_scaled_dot):
    if not probes.has_scaled_dot():
        pytest.skip("this jax has no jax.lax.scaled_dot")
    error = probes.scaled_dot_compile_error()
    assert error.startswith("INTERNAL: Unsupported instruction opcode: scaled-dot (XLA_FLAGS has")
    assert "--config.xla_gpu_triton_gemm=True" in error and "\n" not in error
    with pytest.raises(
        ValueError, match=r"native' \(backend\): XLA cannot compile jax.lax.scaled_dot"
    ) as info:
        backends.resolve_backend("native")
    assert "\n" not in str(info.value) and "use backend='fp8' or 'emulate'" in str(info.value)
    failing_scaled_dot.setenv("XLA_FLAGS", "")
    assert "Triton" not in probes.scaled_dot_compile_error.__wrapped__()  # the hint only where it applies


@pytest.mark.parametrize(
    "device", [_device("gpu", "NVIDIA B200", "10.0"), _device("rocm", "AMD Instinct MI355X")]
)
def test_auto_takes_fp8_where_scaled_dot_does_not_compile(failing_scaled_dot, device):
    choice = probes.choose_backend(probes.describe_device(device))
    assert choice.backend == "fp8" and choice.fp8_dtype == E4M3
    assert (
        "native MX GEMMs unavailable: INTERNAL: Unsupported instruction opcode: scaled-dot" in choice.reason
    )
    failing_scaled_dot.setattr(jax, "devices", lambda *a: [device])
    assert backends.resolve_backend("auto") == "fp8"


@pytest.mark.skipif(
    not ON_NVIDIA or probes.scaled_dot_compile_error() is None,
    reason="needs an NVIDIA GPU where scaled-dot does not compile in this process (Triton GEMMs off)",
)
def test_native_tests_with_triton_gemms():
    """Runs the native GEMM tests in a process with XLA's Triton GEMMs on, through which XLA emits
    scaled-dot on an H200 (the lane turns them off, as the trainer does)."""
    selected = "native_shape_rule or probe_says or (backends_equal_emulate and native)"
    mx_dot_tests = os.path.join(os.path.dirname(__file__), "test_mx_dot.py")
    _run_with_triton_gemms("true", selected, [__file__, mx_dot_tests], passed=10)


def _run_with_triton_gemms(value: str, selected: str, files: list[str], passed: int) -> None:
    """Runs the tests `selected` (-k) of `files` in one child process whose XLA_FLAGS set Triton GEMMs to
    `value` (XLA flags are fixed per process), and checks that `passed` of them passed."""
    flags = f"{os.environ.get('XLA_FLAGS', '')} {xla_flags.TRITON_GEMM}={value}".strip()
    options = ["-o", "addopts=", "-q", "-p", "no:cacheprovider", "-k", selected]  # one process, a summary
    cmd = [sys.executable, "-m", "pytest", *options, *files]
    env = {**os.environ, "XLA_FLAGS": flags}
    run = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0 and f"{passed} passed" in run.stdout, run.stdout[-3000:] + run.stderr[-2000:]


def test_native_takes_mxfp8_but_not_mixed_blocks():
    a, c = _mx((1, 32, 256), 1, elem="e4m3"), _mx((1, 16, 256), 2, elem="e4m3")
    assert backends.native_supports(a, c)
    assert not backends.native_supports(_mx((1, 32, 256), 1), _mx((1, 16, 256), 2, block=16))


# ----------------------------------------------------------------------------------------------------
# FP8 x FP8 accumulation: precise (promoted to float32) on NVIDIA GPUs


def _dot_precisions(fn, *args) -> list:
    """The `precision` of every dot_general in fn's jaxpr (nested jaxprs included)."""
    eqns = all_eqns(jax.make_jaxpr(fn)(*args))
    return [eqn.params["precision"] for eqn in eqns if eqn.primitive.name == "dot_general"]


def _fp8_pair():
    ka, kc = jax.random.split(jax.random.key(3))
    a = quantize_fp8(jax.random.normal(ka, (1, 16, 64)))
    c = quantize_fp8(jax.random.normal(kc, (1, 8, 64)), elem="e5m2")
    return a, c


def _fp8_gemms():
    a, c = _fp8_pair()
    mx = _mx((1, 16, 64), 4)
    return [
        _dot_precisions(lambda x, y: backends.matmul(x, y, backend="emulate"), a, c),
        _dot_precisions(lambda x, y: backends.matmul(x, y, backend="fp8"), mx, _mx((1, 8, 64), 5)),
        _dot_precisions(lambda x, y: backends.matmul(x, y, backend="fp8"), mx, c),
    ]


def test_fp8_dots_ask_for_precise_accumulation_on_nvidia_gpus(monkeypatch):
    """With the platform mocked as an NVIDIA GPU, every FP8 x FP8 dot the library traces carries
    DotAlgorithmPreset.ANY_F8_ANY_F8_F32 (not the FAST_ACCUM one); MX x bf16-emulated dots do not."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *a: [_device("cuda", "NVIDIA H200", "9.0")])
    preset = jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32
    for precisions in _fp8_gemms():
        assert precisions == [preset], precisions
    mx = _mx((1, 16, 64), 4)
    emulated = _dot_precisions(lambda x, y: backends.matmul(x, y, backend="emulate"), mx, mx)
    assert emulated == [None]


ELSEWHERE = [("cpu", _device("cpu", "cpu")), ("gpu", _device("rocm", "AMD Instinct MI300X", "gfx942"))]


@pytest.mark.parametrize("platform, device", ELSEWHERE)
def test_fp8_dots_elsewhere_are_plain(monkeypatch, platform, device):
    """CPU (which rejects the preset) and ROCm keep the plain FP8 dot_general."""
    monkeypatch.setattr(jax, "default_backend", lambda: platform)
    monkeypatch.setattr(jax, "devices", lambda *a: [device])
    for precisions in _fp8_gemms():
        assert precisions == [None], precisions


def test_concrete_operands_decide_the_platform(monkeypatch):
    """Outside jit the operands' own devices decide (here the CPU), not the default backend."""
    try:
        cpu = jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        pytest.skip("no CPU backend in this process: run the GPU lane with JAX_PLATFORMS=cuda,cpu")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    x = jax.device_put(jnp.zeros((2,), E4M3), cpu)
    assert backends.fp8_dot_precision(x, x) is None


@pytest.mark.parametrize("named", ["device", "platform"])
def test_a_default_device_in_force_decides_the_platform_of_traced_operands(monkeypatch, named):
    """Under jit the operands are tracers: a program traced inside `jax.default_device(cpu)` is lowered
    for the CPU, which rejects the GPU's FP8 preset, even on a machine whose default backend is a GPU."""
    try:
        cpu = jax.local_devices(backend="cpu")[0]
    except RuntimeError:
        pytest.skip("no CPU backend in this process: run the GPU lane with JAX_PLATFORMS=cuda,cpu")
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *a: [_device("cuda", "NVIDIA H200", "9.0")])
    traced = lambda x: backends.fp8_dot_precision(x, x)
    x = jnp.zeros((2,), E4M3)
    seen = []
    jax.make_jaxpr(lambda x: seen.append(traced(x)) or x)(x)  # the GPU's preset: no default device named
    with jax.default_device(cpu if named == "device" else "cpu"):
        jax.make_jaxpr(lambda x: seen.append(traced(x)) or x)(x)
    assert seen == [jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32, None]


@pytest.mark.skipif(not ON_NVIDIA, reason="needs an NVIDIA GPU")
def test_fp8_accumulation_is_promoted_to_float32_on_this_gpu():
    """Swamping probe: one product of 448 * 448 (~2^17.6) first, then 4095 products of 2^-4. A tensor-core
    accumulator of 13-14 fraction bits near 2^17.6 has a unit in the last place of 8-16, so without
    promotion (fast accumulation) every later product (and every MMA step's sum of them, 2 per 32) is lost:
    the result stays 200704. With promotion to float32 every few MMA steps only the first interval's small
    products can be lost (at most a few hundred), so at least half of the 4095 * 2^-4 = 255.9 survives."""
    k = 4096
    a = np.full((1, 16, k), 0.25, np.float32)
    a[:, :, 0] = 448.0
    c = np.full((1, 16, k), 0.25, np.float32)
    c[:, :, 0] = 448.0
    one = jnp.float32(1.0)
    fa = backends.FP8Array(jnp.asarray(a, E4M3), one)
    fc = backends.FP8Array(jnp.asarray(c, E4M3), one)
    got = np.asarray(matmul_jit(fa, fc, backend="emulate"), np.float64)
    exact = 448.0 * 448.0 + (k - 1) * 0.0625
    assert np.all(got - 448.0 * 448.0 > 0.5 * (k - 1) * 0.0625), (got.min(), exact)
    assert np.all(got <= exact)


# ----------------------------------------------------------------------------------------------------
# FP8 x FP8 GEMMs that write bfloat16 (the per-tensor scale in cuBLASLt's epilogue)

BF16 = jnp.bfloat16


def _random_fp8(shape, dtype, seed, scale):
    values = np.random.default_rng(seed).normal(size=shape) * 6
    return backends.FP8Array(jnp.asarray(values, dtype), jnp.float32(scale))


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the probe must fail: a CPU test")
def test_fp8_bfloat16_output_keeps_the_contract_where_the_epilogue_probe_fails(monkeypatch):
    """Mocked as an NVIDIA GPU on CPU, the epilogue probe cannot pass (this platform rejects the FP8 dot
    algorithm), so a bfloat16-wanted FP8 x FP8 GEMM stays the precise float32 dot times the combined
    scale, in float32."""
    a, c = _random_fp8((1, 8, 64), E4M3, 1, 3.7), _random_fp8((1, 16, 64), jnp.float8_e5m2, 2, 0.61)
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    monkeypatch.setattr(jax, "devices", lambda *args: [_device("cuda", "NVIDIA H200", "9.0")])

    def bf16_wanted(x, y):
        return backends.matmul(x, y, backend="emulate", out_dtype=BF16)

    assert _dot_precisions(bf16_wanted, a, c) == [jax.lax.DotAlgorithmPreset.ANY_F8_ANY_F8_F32]
    assert jax.make_jaxpr(bf16_wanted)(a, c).out_avals[0].dtype == jnp.float32
    assert not probes.epilogue_scaling_is_exact(jnp.dtype(E4M3), jnp.dtype(E4M3), jnp.dtype(BF16))


def test_hlo_check_finds_the_output_type_of_the_fp8_gemm():
    line = (
        '%g = (bf16[64,32]{1,0}, s8[1024]{0}) custom-call(%a, %b), custom_call_target="__cublas$lt$matmul$f8"'
    )
    assert probes.writes_fp8_gemm_output(line, BF16)
    assert not probes.writes_fp8_gemm_output(line, jnp.float32)
    assert not probes.writes_fp8_gemm_output(line.replace("$f8", ""), BF16)


FP8_PAIRS = [(E4M3, E4M3), (jnp.float8_e5m2, E4M3), (E4M3, jnp.float8_e5m2)]
TRITON_GEMMS_OFF = xla_flags.boolean(xla_flags.TRITON_GEMM) is False
needs_triton_off = pytest.mark.skipif(
    not ON_NVIDIA or not TRITON_GEMMS_OFF,
    reason=f"needs an NVIDIA GPU and XLA_FLAGS={xla_flags.TRITON_GEMM}=false "
    "(test_fp8_epilogue_tests_without_triton)",
)


@needs_triton_off
@pytest.mark.parametrize("a_dtype, c_dtype", FP8_PAIRS, ids=lambda d: jnp.dtype(d).name)
def test_fp8_gemm_writes_bfloat16_with_the_float32_scale_in_its_epilogue(a_dtype, c_dtype):
    """Without Triton GEMM fusions (which otherwise take the dequantized operands first), a bfloat16-wanted
    FP8 x FP8 GEMM is one cuBLASLt FP8 GEMM writing bfloat16, bit for bit the precise float32 GEMM times
    the combined float32 scale, rounded once (scales chosen so that a bfloat16-rounded scale or a second
    rounding would show)."""
    assert probes.epilogue_scaling_is_exact(jnp.dtype(a_dtype), jnp.dtype(c_dtype), jnp.dtype(BF16))
    a, c = _random_fp8((1, 2048, 4096), a_dtype, 3, 3.7), _random_fp8((1, 1024, 4096), c_dtype, 4, 0.0123)
    got = matmul_jit(a, c, backend="emulate", out_dtype=BF16)
    assert got.dtype == BF16
    want = matmul_jit(a, c, backend="emulate").astype(BF16)  # the float32 contract, rounded once
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    text = matmul_jit.lower(a, c, backend="emulate", out_dtype=BF16).compile().as_text()
    assert probes.writes_fp8_gemm_output(text, BF16)


@pytest.mark.skipif(not ON_NVIDIA, reason="needs an NVIDIA GPU")
def test_fp8_gemm_with_bfloat16_output_accumulates_precisely():
    """The swamping probe of test_fp8_accumulation_is_promoted_to_float32_on_this_gpu, sized for a
    bfloat16 result, through whichever spelling this process gets: 448 * 448 first, then 65535 products
    of 2^-4 (4096 in all). Without promotion they are all lost (200704); with it at most the first few MMA
    steps' are, and the nearest bfloat16 to what survives is 204800 (200 * 1024)."""
    k = 65536
    a = np.full((1, 16, k), 0.25, np.float32)
    a[:, :, 0] = 448.0
    fa = backends.FP8Array(jnp.asarray(a, E4M3), jnp.float32(1.0))
    got = matmul_jit(fa, fa, backend="emulate", out_dtype=BF16).astype(BF16)  # float32 where no epilogue
    np.testing.assert_array_equal(np.asarray(got, np.float32), 204800.0)


@pytest.mark.skipif(not ON_NVIDIA or TRITON_GEMMS_OFF, reason="needs an NVIDIA GPU")
def test_fp8_epilogue_tests_without_triton():
    """Runs the two tests above in a process with Triton GEMM fusions off, where the epilogue spelling
    applies (XLA flags are fixed per process)."""
    _run_with_triton_gemms(
        "false", "writes_bfloat16_with or bfloat16_output_accumulates", [__file__], passed=4
    )


def test_the_execution_record_says_what_the_kernels_run(monkeypatch):
    """On one NVIDIA GPU the record names stochastic rounding and prescale where the recipe has them."""
    from fp4jax.ops import execution, get_recipe

    monkeypatch.setattr(probes, "describe_device", lambda: probes.DeviceDescription("nvidia", "H200", "9.0"))
    monkeypatch.setattr(jax, "device_count", lambda: 1)
    runs = lambda name: execution._quantizer_runs(get_recipe(name))  # noqa: E731
    assert (
        runs("mxfp4_full")
        == runs("mxfp4_full_rht")
        == "pallas kernels where the tiles fit, reference elsewhere"
    )
    assert runs("mxfp4_full_sr") == (
        "pallas kernels (stochastic rounding in the kernels, which draw its bits themselves where jax's "
        "threefry formula applies) "
        "where the tiles fit, reference elsewhere"
    )
    assert "; prescale in the kernels)" in runs("mxfp4_full_sr_prescale")


def test_the_run_trains_with_the_recipe_the_environment_resolves(fresh_auto):
    """training.setup's edge: the config's preset, its fp8_scaling, then the environment's overrides; what
    the run's summary records as `execution`."""
    import ml_collections

    from fp4jax.ops.recipes import resolve_recipe
    from fp4jax.training import setup

    fresh_auto.setattr(jax, "devices", lambda *a: [_device("cpu", "cpu")])
    config = ml_collections.ConfigDict({"recipe": "mxfp4_full_h16", "fp8_scaling": "delayed"})
    recipe, execution = setup.resolve_run_execution(config, {})
    assert recipe == resolve_recipe("mxfp4_full_h16", "delayed")  # "auto" stays: resolved once, cached
    assert execution.as_dict() == {
        "backend": "emulate",
        "backend_reason": "auto: cpu: no GPU matrix cores to use",
        "quantizer": "auto",
        "quantizer_runs": "reference (the Pallas kernels run on one NVIDIA GPU only)",
    }
    recipe, execution = setup.resolve_run_execution(config, {"FP4JAX_QUANTIZE_IMPL": "xla"})
    assert recipe.quantizer == execution.quantizer == "xla" and execution.quantizer_runs == "xla"
