"""benchmarks/bench_peers.py's wiring on CPU with a tiny model: every variant that can run here trains a
step to a finite loss from the same state and batch, a peer that cannot run is a row that says why, and
--check finds qwix's MXFP4 bit-equal to fp4jax's `ceil` rule where the contract says so. No timing."""

import importlib.util
import json
import math
import os
import subprocess
import sys

import jax
import jax.numpy as jnp
import pytest
from long_lane import SLOW
from tiny_runs import subprocess_env

from fp4jax.models.llama import Llama, llama_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))  # as when the script runs: its harness beside it
_spec = importlib.util.spec_from_file_location(
    "bench_peers", os.path.join(ROOT, "benchmarks", "bench_peers.py")
)
bench_peers = importlib.util.module_from_spec(_spec)
sys.modules["bench_peers"] = bench_peers  # its dataclasses look their module up by name
_spec.loader.exec_module(bench_peers)

HAS_QWIX = bench_peers.qwix_missing() is None
VARIANTS = ["bf16", "qwix_mxfp4", "jax_nn_mxfp8", "jax_nn_nvfp4", "mxfp4_full_ceil"]


# The session's compile-speed flags (conftest.py) that the child keeps: XLA's optimisation level, LLVM's
# expensive passes and the unsplit codegen; with the first two the child took 16 s of CPU instead of 23.5
# (2026-12-06). Every variant of one run is compiled under the same flags, so the rows stay comparable.
KEPT_XLA_FLAGS = (
    "--xla_backend_optimization_level",
    "--xla_llvm_disable_expensive_passes",
    "--xla_cpu_parallel_codegen_split_count",
)


def bench(out, *extra: str) -> str:
    """One tiny run of the benchmark, in a child without the session's XLA_FLAGS but KEPT_XLA_FLAGS:
    qwix converts to float4_e2m1fn with XLA's own conversion, which the session's elemental emitters
    (xla_cpu_use_fusion_emitters=false, conftest.py) get wrong, and the child sees one CPU device.
    Returns its stdout."""
    flags = [f for f in os.environ.get("XLA_FLAGS", "").split() if f.split("=")[0] in KEPT_XLA_FLAGS]
    env = {**subprocess_env(ROOT, JAX_PLATFORMS="cpu"), "XLA_FLAGS": " ".join(flags)}
    cmd = [sys.executable, "benchmarks/bench_peers.py", "--size", "tiny", "--variants", ",".join(VARIANTS)]
    cmd += ["--warmup", "1", "--steps", "1", "--out", str(out), *extra]
    cmd += ["--config.model.remat=none", "--config.model.n_layers=1"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """(the JSON, stdout) of a tiny run of VARIANTS, without --check (about 15 s on 2 cores)."""
    out = tmp_path_factory.mktemp("peers") / "peers.json"
    stdout = bench(out)
    return json.loads(out.read_text()), stdout


@pytest.fixture(scope="module")
def checked(tmp_path_factory):
    """The same with --check (two more programs compiled: about 35 s on 2 cores, the long lane)."""
    out = tmp_path_factory.mktemp("peers_check") / "peers.json"
    stdout = bench(out, "--check")
    return json.loads(out.read_text()), stdout


def test_every_variant_is_a_row_that_ran_or_says_why(run):
    results, stdout = run
    rows = {r["variant"]: r for r in results["variants"]}
    assert list(rows) == VARIANTS
    for row in rows.values():
        if row["status"] == "skipped":
            assert row["reason"] and f"SKIPPED {row['variant']}: {row['reason']}" in stdout
            assert f"| {row['variant']} |" in stdout and "**skipped**" in stdout
        else:
            assert row["status"] == "done", row
            assert row["finite"] and all(math.isfinite(v) for v in row["first_step"].values())
            assert row["tokens_per_s"] > 0 and len(row["step_times_s"]) == 1
    assert rows["bf16"]["status"] == rows["mxfp4_full_ceil"]["status"] == "done"
    assert rows["mxfp4_full_ceil"]["vs_bf16"] > 0
    for mode in ("mxfp8", "nvfp4"):  # jax 0.10's scaled_matmul has no CPU lowering; a later jax may
        row = rows[f"jax_nn_{mode}"]
        assert row["status"] == "done" or "scaled_dot_general" in row["reason"]


@pytest.mark.skipif(HAS_QWIX, reason="qwix is installed: its row runs (the other tests)")
def test_without_qwix_its_row_says_how_to_install(run):
    results, _ = run
    row = next(r for r in results["variants"] if r["variant"] == "qwix_mxfp4")
    assert row["status"] == "skipped" and "pip install '.[peers]'" in row["reason"]


@SLOW
@pytest.mark.skipif(HAS_QWIX, reason="qwix is installed: the check runs (the other tests)")
def test_without_qwix_the_check_says_how_to_install(checked):
    results, _ = checked
    assert results["check"] == [{"what": "qwix bit-equality", "skipped": bench_peers.qwix_missing()}]


@pytest.mark.skipif(not HAS_QWIX, reason=f"qwix is not installed: {bench_peers.INSTALL_QWIX}")
def test_qwix_quantizes_the_projections_like_the_ceil_twin(run):
    """qwix's rule matched (its first step is not bf16's) and it lands nearer fp4jax's ceil twin, which
    differs from it only in the bfloat16 band's blocks, than bf16 (loss and gradient norm)."""
    results, _ = run
    first = {r["variant"]: r["first_step"] for r in results["variants"] if r["status"] == "done"}
    for key in ("loss", "grad_norm"):
        qwix, twin, bf16 = (first[v][key] for v in ("qwix_mxfp4", "mxfp4_full_ceil", "bf16"))
        assert qwix != bf16
        assert abs(qwix - twin) < 0.5 * abs(qwix - bf16), key


@SLOW
@pytest.mark.skipif(not HAS_QWIX, reason=f"qwix is not installed: {bench_peers.INSTALL_QWIX}")
def test_check_finds_qwix_equal_where_the_contract_says(checked):
    results, stdout = checked
    rows = {c["what"]: c for c in results["check"]}
    quantizers = [c for c in results["check"] if c["what"].startswith("quantizer:")]
    assert len(quantizers) == 5 and all(c["contract_holds"] for c in quantizers)
    for c in quantizers:
        if "float32" in c["what"] and "N(0" in c["what"]:
            assert c["bits_equal"] and c["band_blocks"] == 0  # random float32: no block near the edge
        assert c["bits_equal"] == (c["why"] == "")
    edge = next(c for c in quantizers if "6 * 2^k" in c["what"])
    assert edge["band_blocks"] == edge["blocks"] and edge["differ_in_band"] > 0  # the check can see it
    gemm = next(c for w, c in rows.items() if w.startswith("Fprop GEMM"))
    assert gemm["bits_equal"]  # on the CPU both multiply the same dequantized operands with one XLA dot
    step = next(c for w, c in rows.items() if w.startswith("one step at float32"))
    assert step["bits_equal"] and step["max_abs_diff"] == 0 and step["loss"][0] == step["loss"][1]
    timed = next(c for w, c in rows.items() if w.startswith("first timed step"))
    assert timed["bits_equal"] == (timed["why"] == "") and timed["loss"][1] == first_loss(
        results, "qwix_mxfp4"
    )
    assert not [c for c in results["check"] if "error" in c or "skipped" in c]
    assert "Bit-equality with qwix (`--check`):" in stdout and "BROKEN" not in stdout


def first_loss(results, variant: str) -> float:
    return next(r["first_step"]["loss"] for r in results["variants"] if r["variant"] == variant)


@pytest.mark.parametrize("mode", ["mxfp8", "nvfp4"])
def test_jax_nn_dot_general_reaches_every_projection(mode):
    """Traced, not compiled (its CPU lowering may be missing): the routed tiny Llama's loss and gradients
    hold one block-scaled forward GEMM per projection (7 per block), and the gradient differentiates
    through jax.nn's custom_vjp (NVFP4's per-call tensor scales are constants to it)."""
    if not hasattr(jax.nn, "scaled_dot_general"):
        pytest.skip(f"jax {jax.__version__} has no jax.nn.scaled_dot_general")
    cfg = llama_config("tiny", vocab_size=256, n_layers=1, remat="none")
    base = Llama(cfg, recipe="bf16")
    tokens = jnp.zeros((1, 32), jnp.int32)
    params = base.init(jax.random.key(0), tokens)["params"]
    model = bench_peers.RoutedModel(base, bench_peers.jax_nn_dot_general(mode))
    loss = lambda p: model.apply({"params": p}, tokens).mean()  # noqa: E731
    jaxpr = jax.make_jaxpr(jax.value_and_grad(loss))(params)
    projections = 7 * cfg.n_layers
    per_projection = bench_peers.backward_gemms_quantized(mode)  # 1 to 3: forward, dgrad, wgrad
    assert per_projection >= 1
    assert bench_peers.count_primitive(jaxpr, bench_peers.SCALED_MATMUL) == projections * per_projection


def test_a_missing_qwix_is_one_line_naming_the_extra(monkeypatch):
    monkeypatch.setattr(bench_peers.importlib.util, "find_spec", lambda name: None)
    reason = bench_peers.qwix_missing()
    assert reason == f"qwix is not installed: {bench_peers.INSTALL_QWIX}" and "\n" not in reason


def test_an_unknown_variant_is_one_line_listing_the_known():
    with pytest.raises(SystemExit, match="unknown variant.*no_such.*qwix_mxfp4"):
        bench_peers.check_names(["bf16", "no_such"])
