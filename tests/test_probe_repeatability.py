"""benchmarks/probe_repeatability.py: runs compared bit for bit, per update, within and across processes."""

import sys

import pytest
from helpers import benchmark_script

probe = benchmark_script("probe_repeatability")


def _run(losses, norms=None):
    return {"loss": list(losses), "grad_norm": list(norms or [1.0] * len(losses))}


def test_the_first_differing_update_is_found_in_either_field():
    a = _run([10.5, 9.25, 8.0])
    assert probe.first_difference(a, _run([10.5, 9.25, 8.0])) is None
    assert probe.first_difference(a, _run([10.5, 9.25, 8.0 + 2**-20])) == (3, "loss")  # one ulp counts
    assert probe.first_difference(a, _run([10.5, 9.25, 8.0], [1.0, 1.0 + 1e-12, 1.0])) == (2, "grad_norm")


def test_a_group_reports_its_earliest_difference():
    base = _run([3.0, 2.0, 1.0])
    assert probe.describe([base, _run([3.0, 2.0, 1.0])]) == "same"
    later, earlier = _run([3.0, 2.0, 1.5]), _run([3.0, 2.5, 1.0])
    assert probe.describe([base, later, earlier]) == "loss differs from update 2"


def test_a_row_separates_within_from_across_processes():
    same = [_run([2.0, 1.0]), _run([2.0, 1.0])]
    other = [_run([2.0, 1.25]), _run([2.0, 1.25])]
    line = probe.row("mxfp4_full_h16", "default", [same, other])
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:4] == ["mxfp4_full_h16", "default", "same; same", "loss differs from update 2"]
    assert cells[5] == "2.50e-01"


def test_an_unknown_variant_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["probe", "--config", "configs/tiny_c4_h16.py", "--variants", "fast"])
    with pytest.raises(SystemExit, match="unknown variant .fast.: use some of default, deterministic,"):
        probe.main()


def test_one_gemm_repeats_on_the_cpu_and_a_changing_one_is_caught(monkeypatch):
    import itertools

    import jax
    import jax.numpy as jnp
    from jax.experimental import io_callback

    from fp4jax.ops import mx_dot

    assert probe.gemm_repeats("mxfp4_full_h16", (64, 128, 32), calls=3) == "same"
    counter = itertools.count()

    def drifting(recipe):  # a dot whose output moves by one unit per call, its gradients do not
        def dot(lhs, rhs, dimension_numbers, **_):
            tick = io_callback(lambda: jnp.float32(next(counter)), jax.ShapeDtypeStruct((), jnp.float32))
            out = jax.lax.dot_general(lhs, rhs, dimension_numbers)
            return out + jax.lax.stop_gradient(tick).astype(out.dtype)

        return dot

    monkeypatch.setattr(mx_dot, "make_dot_general", drifting)
    assert probe.gemm_repeats("bf16", (64, 128, 32), calls=3) == "y differ"


def test_a_variant_adds_its_xla_flags_and_sets_the_rest(monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "--xla_mine=1")
    assert probe.variant_env("deterministic")["XLA_FLAGS"] == "--xla_mine=1 --xla_gpu_deterministic_ops=true"
    env = probe.variant_env("xla_quantizer")
    assert env["FP4JAX_QUANTIZE_IMPL"] == "xla" and env["XLA_FLAGS"] == "--xla_mine=1"
