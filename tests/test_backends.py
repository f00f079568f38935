"""Back-end dispatch: the table for every (platform, architecture) pair with mocked devices, the override,
the start-up log, and the native path's shape rule with its fallback (on CPU, equal to emulate)."""

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from fp4jax.ops import quantize_mx as _quantize_mx
from fp4jax.ops.kernels import backends

E4M3, FNUZ = jnp.float8_e4m3fn, jnp.float8_e4m3fnuz


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
    desc = backends.describe_device(device)
    assert (desc.vendor, desc.arch) == described
    assert desc.name == device.device_kind
    choice = backends.choose_backend(desc, scaled_dot=True)
    assert choice.backend == with_sd
    assert backends.choose_backend(desc, scaled_dot=False).backend == without_sd
    assert backends.fold_dtype(desc) == fold_dtype
    if choice.backend == "fp8":
        assert choice.fp8_dtype == fold_dtype
    assert desc.name in choice.reason


def test_hopper_reason_reads_like_the_log():
    choice = backends.choose_backend(backends.describe_device(_device("gpu", "NVIDIA H200", "9.0")))
    assert f"GEMM back end {choice.backend} (auto: {choice.reason})" == (
        "GEMM back end fp8 (auto: NVIDIA H200, compute capability 9.0)"
    )


@pytest.fixture
def fresh_auto(monkeypatch):
    """auto_choice is cached per process: clear it around each test."""
    backends._auto_choice.cache_clear()
    yield monkeypatch
    backends._auto_choice.cache_clear()


def test_auto_on_this_cpu_logs_once(fresh_auto, capsys):
    fresh_auto.delenv(backends.ENV_VAR, raising=False)
    assert backends.resolve_backend("auto") == "emulate"
    assert backends.resolve_backend("auto") == "emulate"
    err = capsys.readouterr().err
    assert err.count("fp4jax: GEMM back end emulate (auto: cpu") == 1


def test_auto_uses_the_mocked_device(fresh_auto, capsys):
    fresh_auto.delenv(backends.ENV_VAR, raising=False)
    fresh_auto.setattr(jax, "devices", lambda *a: [_device("gpu", "NVIDIA H200", "9.0")])
    assert backends.resolve_backend("auto") == "fp8"
    assert "fp4jax: GEMM back end fp8 (auto: NVIDIA H200, compute capability 9.0)" in capsys.readouterr().err


def test_environment_overrides_auto_not_an_explicit_backend(fresh_auto, capsys):
    fresh_auto.setenv(backends.ENV_VAR, "fp8")
    assert backends.resolve_backend("auto") == "fp8"
    assert backends.resolve_backend("emulate") == "emulate"
    assert "(FP4JAX_GEMM_BACKEND=fp8)" in capsys.readouterr().err


def test_bad_backend_names_fail_in_one_line(fresh_auto):
    fresh_auto.setenv(backends.ENV_VAR, "fp4")
    with pytest.raises(ValueError, match="unknown GEMM back end 'fp4' in environment variable"):
        backends.resolve_backend("auto")
    with pytest.raises(ValueError, match="use one of auto, emulate, native, fp8"):
        backends.resolve_backend("cublas")


def test_native_without_scaled_dot_is_refused(monkeypatch):
    monkeypatch.delattr(jax.lax, "scaled_dot", raising=False)
    assert not backends.has_scaled_dot()
    with pytest.raises(ValueError, match="needs jax.lax.scaled_dot"):
        backends.resolve_backend("native")


# ----------------------------------------------------------------------------------------------------
# the native path's shapes


quantize_mx = jax.jit(_quantize_mx, static_argnames=("block_size", "elem", "scale_mode"))
matmul_jit = jax.jit(backends.matmul, static_argnames=("backend", "precision"))


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
    if not backends.has_scaled_dot():
        pytest.skip("this jax has no jax.lax.scaled_dot")
    jaxpr = str(jax.make_jaxpr(lambda x, y: backends.matmul(x, y, backend="native"))(a, c))
    assert ("scaled_dot" in jaxpr) == fits
    got = np.asarray(matmul_jit(a, c, backend="native"))
    want = np.asarray(matmul_jit(a, c, backend="emulate"))
    if jax.default_backend() == "cpu":  # exact float32 accumulation, same order
        np.testing.assert_array_equal(got, want)
    else:  # MX matrix cores / library GEMMs: reduced-precision partial sums
        np.testing.assert_allclose(got, want, rtol=0, atol=1e-4 * np.abs(want).max())


def test_native_takes_mxfp8_but_not_mixed_blocks():
    a, c = _mx((1, 32, 256), 1, elem="e4m3"), _mx((1, 16, 256), 2, elem="e4m3")
    assert backends.native_supports(a, c)
    assert not backends.native_supports(_mx((1, 32, 256), 1), _mx((1, 16, 256), 2, block=16))
