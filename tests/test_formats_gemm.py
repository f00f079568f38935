"""MXFP6 (E2M3, E3M2) in the per-GEMM contract: how its operands are quantized and multiplied.

The presets' numbers are held against the independent reference in tests/test_mx_dot.py (the CONTRACT
table: every mxfp6_* rung, forward and both gradients). Here: the routing around them. The fused
quantizer encodes MXFP6 too (tests/test_fused_quantize.py holds its bits) but folds E2M1 only, so an
E2M3 operand comes out of it as an MXArray that the fp8 back end folds exactly into E4M3
(tests/test_fold_mxfp6.py);
E3M2's exact window is too narrow, so its GEMMs multiply as in emulate, bit for bit, and the resolved
execution says so.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers import fwd_bwd, random_operands

from fp4jax.ops import PRESETS, quantize_mx
from fp4jax.ops.execution import resolve_execution
from fp4jax.ops.kernels import backends, fused_quantize, probes
from fp4jax.ops.kernels.fold import is_foldable
from fp4jax.ops.recipes import MXFP6_E2M3, MXFP6_E3M2, QuantSpec, RotationSpec

MXFP6 = {"e2m3": MXFP6_E2M3, "e3m2": MXFP6_E3M2}
DIMS = (((1,), (0,)), ((), ()))


def _operands(seed: int = 0):
    return random_operands(seed, (32, 64), (64, 48), (32, 48), scales=(3, 1 / 8, 1))


@pytest.mark.parametrize("elem", sorted(MXFP6))
def test_fused_fold_takes_e2m3_and_refuses_e3m2_in_one_line(elem):
    x = jax.numpy.ones((16, 64))
    if elem == "e2m3":
        folded = fused_quantize.rotate_quantize(x, axis=-1, spec=MXFP6[elem], out="fp8_fold", impl="xla")
        assert folded.data.dtype == jax.numpy.float8_e4m3fn
    else:
        with pytest.raises(ValueError, match=f"folds E2M1 and E2M3 elements only, got elem='{elem}'") as err:
            fused_quantize.rotate_quantize(x, axis=-1, spec=MXFP6[elem], out="fp8_fold", impl="xla")
        assert "\n" not in str(err.value)
    nvidia = probes.DeviceDescription(vendor="nvidia", name="NVIDIA H200", arch="9.0")
    where = {"device": nvidia, "device_count": 1}
    assert fused_quantize.pallas_supports((1024, 1024), -1, MXFP6[elem], RotationSpec(), **where)


@pytest.mark.parametrize("name", ["mxfp6_e3m2_full_h16", "mxfp6_e2m3_full"])
def test_every_quantizer_setting_gives_the_reference_paths_bits(name):
    """quantizer "xla" runs the fused XLA formulation on the MXFP6 operands, "auto" the reference path
    here (no GPU): the three settings agree bit for bit."""
    x, w, dy = _operands(1)
    runs = {
        q: jax.jit(functools.partial(fwd_bwd, recipe=dataclasses.replace(PRESETS[name], quantizer=q)))(
            x, w, dy
        )
        for q in ("reference", "xla", "auto")
    }
    for q in ("xla", "auto"):
        for got, want in zip(runs[q], runs["reference"], strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want), err_msg=f"{name} {q}")


@pytest.mark.parametrize("elem", ["e3m2"])
def test_fp8_back_end_multiplies_e3m2_as_emulate(elem):
    x, w, _ = _operands(2)
    quantize = lambda v: quantize_mx(v, axis=-1, elem=elem, block_size=32, scale_mode="even")
    qa, qc = jax.jit(lambda a, c: (quantize(a), quantize(c)))(x[None], w.T[None])
    assert not backends.fp8_supports(qa, qc)
    got = jax.jit(functools.partial(backends.matmul, backend="fp8"))(qa, qc)
    want = jax.jit(functools.partial(backends.matmul, backend="emulate"))(qa, qc)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("elem", ["e2m1", *sorted(MXFP6), "e4m3", "e5m2"])
def test_the_spec_rule_of_the_fold_is_the_array_rule(elem):
    """backends.fp8_folds (what recipes, the resolved reason and the self-check ask) says of a QuantSpec
    what fold.is_foldable says of the MXArray it quantizes to; NVFP4 never folds."""
    x = jax.ShapeDtypeStruct((1, 4, 64), jnp.float32)
    quantized = jax.eval_shape(lambda v: quantize_mx(v, axis=-1, elem=elem, block_size=32), x)  # its types
    assert backends.fp8_folds(QuantSpec(kind="mx", elem=elem)) == is_foldable(quantized)
    assert not backends.fp8_folds(QuantSpec(kind="nvfp4"))


def test_fp8_unfolded_lists_a_recipes_block_scaled_operands_the_fold_refuses():
    assert backends.fp8_unfolded(PRESETS["mxfp4_full"]) == () == backends.fp8_unfolded(PRESETS["fp8"])
    assert backends.fp8_unfolded(PRESETS["mxfp6_e3m2_fprop"]) == (MXFP6_E3M2, MXFP6_E3M2)
    assert backends.fp8_unfolded(PRESETS["mxfp6_e2m3_full"]) == ()  # E2M3 folds
    assert {s.kind for s in backends.fp8_unfolded(PRESETS["nvfp4_full"])} == {"nvfp4"}


def test_the_resolved_execution_names_the_operands_fp8_cannot_fold(monkeypatch):
    """On the fp8 back end a recipe with MX operands it does not fold (E3M2) says which run as in emulate;
    MXFP4's and MXFP6 E2M3's reasons have no such clause. (The back end's availability check is
    bypassed: CPU has no FP8 GEMMs, and what is tested is the reason's text.)"""
    monkeypatch.setattr(backends, "check_backend", lambda *a, **k: None)
    monkeypatch.setattr("fp4jax.ops.kernels.probes.run_probes", lambda backend: None)
    _, e3m2 = resolve_execution("mxfp6_e3m2_full", backend="fp8")
    assert e3m2.backend_reason.endswith("; GEMMs with MXFP6_E3M2 operands run as in emulate (no exact fold)")
    for folded in ("mxfp4_full", "mxfp6_e2m3_full"):
        assert "emulate" not in resolve_execution(folded, backend="fp8")[1].backend_reason


def test_bad_element_formats_get_one_line_errors():
    with pytest.raises(ValueError, match="an fp8 operand needs elem 'e4m3' or 'e5m2', not 'e2m3'"):
        QuantSpec(kind="fp8", elem="e2m3")
    with pytest.raises(ValueError, match="unknown element format 'e6m1': use one of .*e2m3, e3m2"):
        QuantSpec(kind="mx", elem="e6m1")
