"""python -m fp4jax.selfcheck on CPU (small GEMMs, a few tiny-model steps), and its HLO reader."""

import functools

import numpy as np
import pytest

from fp4jax import selfcheck
from fp4jax.ops.kernels import backends

CUBLAS_F8 = (
    "  %cublas-lt-matmul.2.0 = (f32[1,8192,14336]{2,1,0}, s8[33554432]{0}) custom-call("
    "f8e4m3fn[1,8192,4096]{2,1,0} %fusion.12, f8e4m3fn[1,14336,4096]{2,1,0} %fusion.13, f32[] %c), "
    'custom_call_target="__cublas$lt$matmul$f8", backend_config={}'
)
TRITON_F8 = "  %dot.1 = f32[8192,14336]{1,0} dot(f8e5m2[8192,4096]{1,0} %p0, f8e4m3fn[14336,4096]{1,0} %p1)"
CUBLAS_BF16 = (
    "  %custom-call.3 = (f32[8192,4096]{1,0}, s8[4194304]{0}) custom-call(bf16[8192,14336]{1,0} %a, "
    'bf16[14336,4096]{1,0} %b), custom_call_target="__cublas$gemm"'
)
NOT_A_GEMM = '  %cc = f32[8]{0} custom-call(f8e4m3fn[8]{0} %x), custom_call_target="SomethingElse"'


# Newer HLO text prints operands by name only: the reader looks their types up.
BY_NAME = """  %param_0.3 = f8e4m3fn[8192,4096]{1,0} parameter(0)
  %convert.9 = bf16[8192,4096]{1,0} convert(%param_0.3)
  ROOT %dot.2 = f32[8192,14336]{1,0} dot(%param_0.3, %param_1.3), lhs_contracting_dims={1}
  %dot.3 = f32[8192,14336]{1,0} dot(%convert.9, %param_1.3), lhs_contracting_dims={1}"""


def test_gemm_operand_types_reads_library_and_fused_gemms():
    text = "\n".join([CUBLAS_F8, TRITON_F8, CUBLAS_BF16, NOT_A_GEMM, "  %add = f32[8]{0} add(f32[8] %a, %b)"])
    assert selfcheck.gemm_operand_types(text) == ["f8e4m3fn", "f8e5m2", "bf16"]
    assert selfcheck.gemm_operand_types(BY_NAME) == ["f8e4m3fn", "bf16"]


def test_gemm_operand_types_of_a_real_compiled_program():
    import jax
    import jax.numpy as jnp

    dot = lambda a, b: jax.lax.dot_general(a, b, (((1,), (1,)), ((), ())), preferred_element_type=jnp.float32)
    a = jnp.ones((32, 64), jnp.bfloat16)
    assert selfcheck.gemm_operand_types(jax.jit(dot).lower(a, a).compile().as_text()) in (["bf16"], ["f32"])


@pytest.mark.parametrize(
    "vendor, arch, native, expected",
    [
        ("nvidia", "8.0", None, ["emulate"]),  # Ampere: no FP8 tensor cores
        ("nvidia", "9.0", None, ["emulate", "fp8"]),  # Hopper
        ("nvidia", "10.0", None, ["emulate", "fp8", "native"]),  # Blackwell, scaled_dot compiles
        ("nvidia", "10.0", "no scaled_dot here", ["emulate", "fp8"]),
        ("amd", "gfx90a", None, ["emulate"]),  # MI250
        ("amd", "gfx942", None, ["emulate", "fp8"]),  # MI300
        ("amd", "gfx950", None, ["emulate", "fp8", "native"]),  # MI355X
        ("cpu", "", None, ["emulate", "fp8", "native"]),  # XLA computes every one exactly on CPU
        ("cpu", "", "no scaled_dot here", ["emulate", "fp8"]),
    ],
)
def test_the_backends_worth_checking_follow_the_hardware(monkeypatch, vendor, arch, native, expected):
    monkeypatch.setattr(selfcheck, "scaled_dot_compile_error", lambda: native)
    monkeypatch.setattr("fp4jax.ops.kernels.probes.scaled_dot_compile_error", lambda: native)
    desc = selfcheck.DeviceDescription(vendor, "a device", arch)
    assert selfcheck.available_backends(desc) == expected


def test_selfcheck_passes_here(capsys, monkeypatch):
    """On the CPU lane `auto` is emulate; on a GPU lane whatever the dispatch table gives that device.
    Each program is timed once, without warm-up: the test reads no timing, and the self-check's 7 runs of
    each of its 9 GEMM programs took 2 s."""
    timed_once = functools.partial(selfcheck.median_seconds, warmup=0, iters=1)
    monkeypatch.setattr(selfcheck, "median_seconds", timed_once)
    formats = "mxfp6_e3m2_full,nvfp4_nvidia"  # two other formats here; all of them in the long lane (below)
    code = selfcheck.main(["--small", "--train-steps", "4", "--formats", formats])  # loss falls ~0.15 in 4
    out = capsys.readouterr().out
    assert f"auto picks: {backends.resolve_backend('auto')}" in out
    assert "fp8" in out and "AGREE" in out and "DISAGREE" not in out
    assert "loss falling" in out
    for name in formats.split(","):
        assert f"recipe {name}:" in out, name
    assert out.rstrip().endswith("self-check PASSED") and code == 0


@pytest.mark.slow
def test_selfcheck_covers_every_format_by_default(capsys):
    """With no --formats the self-check GEMM-checks every block format's rungs on every back end here."""
    code = selfcheck.main(["--small", "--train-steps", "0"])
    out = capsys.readouterr().out
    for name in selfcheck.FORMAT_RECIPES:
        assert f"recipe {name}:" in out, name
    failed = [line for line in out.splitlines() if "DISAGREE" in line or "FAIL " in line]
    assert not failed and out.rstrip().endswith("self-check PASSED") and code == 0, "\n".join(failed) or out


@pytest.mark.parametrize(
    "on_gpu, cores, threads", [(False, 2, 1), (False, 64, 1), (True, 16, 8), (True, 4, 4)]
)
def test_compile_threads_default_to_one_on_a_cpu_and_one_per_core_on_a_gpu_host(
    monkeypatch, on_gpu, cores, threads
):
    monkeypatch.setattr(selfcheck.os, "cpu_count", lambda: cores)
    assert selfcheck.default_compile_threads(on_gpu) == threads
    assert selfcheck.parse_args([]).compile_threads is None  # resolved once the device is known


def test_selfcheck_rejects_bad_arguments():
    with pytest.raises(SystemExit) as exc:
        selfcheck.main(["--backends", "fp4"])
    assert exc.value.code == 2
    with pytest.raises(SystemExit) as exc:
        selfcheck.main(["--formats", "mxfp5_full"])
    assert exc.value.code == 2


def test_relative_errors_are_numpys_in_float64_and_a_nan_fails():
    """The on-device error equals the float64 host computation (max |o - r| / max |r|) to float32's
    rounding, is exactly 0 for equal outputs, and is not finite where an output holds a NaN."""
    rng = np.random.default_rng(3)
    reference = [rng.standard_normal(shape).astype(np.float32) for shape in ((64, 48), (64, 32), (32, 48))]
    outs = [r.copy() for r in reference]
    outs[1][5, 7] += np.float32(3e-4)  # one wrong element in dx
    outs[2] *= np.float32(1 + 2**-20)  # every element of dw one ulp or so off
    want = [
        np.abs(o.astype(np.float64) - r).max() / np.abs(r.astype(np.float64)).max()
        for o, r in zip(outs, reference, strict=True)
    ]
    got = np.asarray(selfcheck.relative_errors(outs, reference))
    assert got[0] == 0.0 and np.allclose(got, want, rtol=1e-6, atol=0), (got, want)
    outs[0][0, 0] = np.nan
    assert not np.isfinite(np.asarray(selfcheck.relative_errors(outs, reference))[0])
