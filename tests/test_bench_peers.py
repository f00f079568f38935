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
from fp4jax.ops import get_recipe
from fp4jax.training import setup

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
            finite = all(math.isfinite(v) for v in row["first_step"].values())
            assert row["finite"] == finite
            # fp4jax's rows must be finite; a peer's may not be (jax 0.11.2's jax.nn MXFP8 on the CPU
            # gives a NaN gradient norm), and its row says so
            assert finite or (row["family"] != "fp4jax" and f"NOT FINITE {row['variant']}" in stdout), row
            assert finite or "**not finite** (first step: loss" in stdout
            assert row["tokens_per_s"] > 0 and len(row["step_times_s"]) == 1
    assert rows["bf16"]["status"] == rows["mxfp4_full_ceil"]["status"] == "done"
    assert rows["bf16"]["step_buffers_gib"] > 0 and results["meta"]["memory_fraction"]
    assert (
        rows["bf16"]["numerics"].startswith("unquantized")
        and "back end" in rows["mxfp4_full_ceil"]["numerics"]
    )
    assert_plain(results)
    assert rows["mxfp4_full_ceil"]["vs_bf16"] > 0
    for mode in ("mxfp8", "nvfp4"):  # jax 0.10's scaled_matmul has no CPU lowering; a later jax may
        row = rows[f"jax_nn_{mode}"]
        assert row["status"] == "done" or "scaled_dot_general" in row["reason"]


def assert_plain(value) -> None:
    """Only Python numbers, strings, lists and dicts (the rows keep no array)."""
    if isinstance(value, dict):
        for v in value.values():
            assert_plain(v)
    elif isinstance(value, list):
        for v in value:
            assert_plain(v)
    else:
        assert value is None or type(value) in (str, int, float, bool), type(value)


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


def test_a_variant_takes_the_recipe_as_the_trainer_resolves_it():
    """--config.fp8_divide / sr_rng / fp8_scaling reach an fp4jax variant's recipe (setup.run_recipe's
    resolution), so one benchmark call can compare a preset under two settings."""
    config_path, overrides = bench_peers.SIZES["tiny"]
    settings = ["--config.fp8_divide=xla", "--config.sr_rng=threefry13", "--config.fp8_scaling=delayed"]
    config = bench_peers.load_config(config_path, [*overrides, *settings])
    base = llama_config("tiny", vocab_size=256, n_layers=1)
    for name in ("fp8_mlperf", "mxfp4_full_sr"):
        as_trained = config.copy_and_resolve_references()
        as_trained.recipe = name
        recipe = bench_peers.fp4jax_variant(name, config, Llama(base)).model.recipe
        assert recipe == setup.run_recipe(as_trained) != get_recipe(name)
    fp8 = bench_peers.fp4jax_variant("fp8_mlperf", config, Llama(base)).model.recipe
    assert fp8.fprop.lhs.fp8_divide == "xla"


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


# ------------------------------------------------------------------ the 1B config's structure on CPU


def scanned_tiny(**overrides):
    """(the bf16 Llama, params, tokens) with the 1B config's structure: blocks scanned, bfloat16
    activations, remat minimal_attention (XLA's attention on the CPU: minimal)."""
    cfg = llama_config(
        "tiny", vocab_size=256, n_layers=2, scan_layers=True, remat="minimal_attention", **overrides
    )
    assert cfg.dtype == overrides.get("dtype", "bfloat16")
    base = Llama(cfg, recipe="bf16")
    tokens = jnp.zeros((2, 32), jnp.int32)
    return base, base.init(jax.random.key(0), tokens)["params"], tokens


def loss_and_grads(model, tokens):
    return jax.value_and_grad(lambda p: model.apply({"params": p}, tokens).astype(jnp.float32).mean())


def dequantized_matmul(a, b, a_scales, b_scales, *, preferred_element_type):
    """jax.nn.scaled_matmul as jax 0.11 lowers it on the CPU: each block times its scale, then one dot."""
    t = preferred_element_type

    def dequantize(x, scales):
        blocks = x.astype(t).reshape(*scales.shape, -1) * scales.astype(t)[..., None]
        return blocks.reshape(x.shape)

    dims = (((2,), (2,)), ((0,), (0,)))
    return jax.lax.dot_general(
        dequantize(a, a_scales), dequantize(b, b_scales), dims, preferred_element_type=t
    )


@pytest.fixture
def scaled_matmul_on_cpu(monkeypatch):
    """jax.nn.scaled_matmul lowered on the CPU for the test's duration, where this jax has no CPU
    lowering (jax 0.10; 0.11 has one): the GPU's programs then lower and run here."""
    try:
        from jax._src.cudnn.scaled_matmul_stablehlo import _scaled_matmul_p as prim
        from jax._src.interpreters import mlir

        cpu = mlir._platform_specific_lowerings["cpu"]
        if prim not in cpu and prim not in mlir._lowerings:
            rule = mlir.lower_fun(dequantized_matmul, multiple_results=False)
            monkeypatch.setitem(cpu, prim, mlir.LoweringRuleEntry(rule, True))
    except (ImportError, AttributeError, KeyError) as e:
        pytest.skip(f"this jax's scaled_matmul lowering table is not where the test looks: {e}")


@pytest.mark.skipif(not HAS_QWIX, reason=f"qwix is not installed: {bench_peers.INSTALL_QWIX}")
def test_qwix_on_a_gpu_keeps_the_scanned_blocks_carry_type(monkeypatch):
    """qwix 0.1.8 multiplies through jax.nn.scaled_matmul on a GPU, returning float32: with scanned
    blocks the residual stream (the scan's carry) then changed type, a TypeError. The GPU path is taken
    here by telling qwix it runs on one; tracing is enough, where the error was raised."""
    from qwix._src.core import mxfp_dot

    monkeypatch.setattr(mxfp_dot, "_get_primary_platform", lambda: "gpu")
    base, params, tokens = scanned_tiny()
    model = bench_peers.qwix_variant(base).model
    jaxpr = jax.make_jaxpr(loss_and_grads(model, tokens))(params)
    assert bench_peers.count_primitive(jaxpr, bench_peers.SCALED_MATMUL) > 0  # qwix's GPU path ran


def scaled_matmul_scales(jaxpr) -> set:
    """The (lhs, rhs) scale dtypes of a program's jax.nn.scaled_matmul calls."""
    return {
        tuple(str(v.aval.dtype) for v in eqn.invars[2:])
        for eqn in bench_peers.equations(jaxpr)
        if eqn.primitive.name.startswith(bench_peers.SCALED_MATMUL)
    }


@pytest.mark.skipif(not HAS_QWIX, reason=f"qwix is not installed: {bench_peers.INSTALL_QWIX}")
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_qwix_on_a_gpu_scales_its_gradient_gemms_in_two_dtypes_at_bfloat16(monkeypatch, dtype):
    """On the H200 qwix 0.1.8's bfloat16 step failed ("INTERNAL: Input datatypes do not match") and the
    check's float32 one ran. Through qwix's GPU path (traced here): at bfloat16 its Dgrad and Wgrad give
    jax.nn.scaled_matmul the float32 gradient's scales beside the saved bfloat16 operand's, and the cause
    the row names is found; at float32 every scale is float32 and none is."""
    from qwix._src.core import mxfp_dot

    monkeypatch.setattr(mxfp_dot, "_get_primary_platform", lambda: "gpu")
    base, params, tokens = scanned_tiny(dtype=dtype)
    jaxpr = jax.make_jaxpr(loss_and_grads(bench_peers.qwix_variant(base).model, tokens))(params)
    cause = bench_peers.qwix_scale_mismatch(jaxpr)
    if dtype == "float32":
        assert scaled_matmul_scales(jaxpr) == {("float32", "float32")} and cause is None
        return
    assert scaled_matmul_scales(jaxpr) == {("bfloat16", "bfloat16"), ("float32", "bfloat16")}
    assert cause.startswith("qwix 0.1.8 on GPUs: ") and "(float32 with bfloat16)" in cause
    assert "\n" not in cause and "mxfp_dot.py:88" in cause


@pytest.mark.skipif(not HAS_QWIX, reason=f"qwix is not installed: {bench_peers.INSTALL_QWIX}")
def test_a_failed_qwix_row_on_a_gpu_names_the_cause_before_the_error(monkeypatch):
    """The row of a step that fails: the cause qwix's program shows, then the error's first line; a
    variant that knows no cause (bf16) keeps the error alone."""
    from qwix._src.core import mxfp_dot

    monkeypatch.setattr(mxfp_dot, "_get_primary_platform", lambda: "gpu")
    config_path, overrides = bench_peers.SIZES["tiny"]
    config = bench_peers.load_config(
        config_path, [*overrides, f"--config.global_batch={jax.device_count()}", "--config.model.n_layers=1"]
    )
    shared = bench_peers.build_setup(config)
    error = "INTERNAL: Input datatypes do not match.\n(the rest of XLA's message)"

    def compile_step(*_):
        raise RuntimeError(error)

    monkeypatch.setattr(bench_peers, "compile_step", compile_step)
    results = bench_peers.Results("", {})
    for name in ("qwix_mxfp4", "bf16"):
        assert bench_peers.prepare(shared, name, 1, results) is None
    qwix, bf16 = (results.entries[n] for n in ("qwix_mxfp4", "bf16"))
    assert qwix["status"] == bf16["status"] == "failed"
    assert bf16["reason"] == "RuntimeError: INTERNAL: Input datatypes do not match."
    assert qwix["reason"].startswith("qwix 0.1.8 on GPUs: ") and "\n" not in qwix["reason"]
    assert qwix["reason"].endswith("; the step failed: " + bf16["reason"])


def test_a_row_whose_first_step_is_not_finite_says_so():
    """A variant that trains to a NaN is timed like the others, and the table flags it with its values."""
    meta = dict(devices="1 x cpu", size="tiny", params=1, global_batch=1, seq_len=8, remat="none")
    meta.update(blocks=1, steps=1)
    results = bench_peers.Results("", meta)
    first = {"loss": 6.25, "grad_norm": float("nan")}
    results.update("jax_nn_mxfp8", family="jax.nn", numerics="MXFP8", first_step=first, finite=False)
    results.update("bf16", family="fp4jax", numerics="unquantized", first_step={"loss": 6.25}, finite=True)
    rows = {line.split(" | ")[0]: line for line in bench_peers.to_markdown(results, "cmd").splitlines()}
    assert "**not finite** (first step: loss 6.25, grad_norm nan): MXFP8 |" in rows["| jax_nn_mxfp8"]
    assert "not finite" not in rows["| bf16"]


@pytest.mark.parametrize("mode", ["mxfp8", "nvfp4"])
def test_jax_nn_lowers_in_scanned_blocks(mode, scaled_matmul_on_cpu):
    """NVFP4's per-tensor scale once went into jax.nn's configs, static arguments of its custom_vjp: the
    traced scale was closed over by the gradient, and the scanned model failed to lower ("No constant
    handler for type: DynamicJaxprTracer" for the train step, an UnexpectedTracerError for this one)."""
    if not hasattr(jax.nn, "scaled_dot_general"):
        pytest.skip(f"jax {jax.__version__} has no jax.nn.scaled_dot_general")
    base, params, tokens = scanned_tiny()
    model = bench_peers.RoutedModel(base, bench_peers.jax_nn_dot_general(mode))
    loss, grads = jax.jit(loss_and_grads(model, tokens))(params)
    assert math.isfinite(float(loss)) and all(jnp.isfinite(g).all() for g in jax.tree.leaves(grads))


def test_nvfp4_tensor_scales_around_the_call_equal_them_inside(scaled_matmul_on_cpu):
    """Outside jax.nn's call (divided before, multiplied after) the per-tensor scales give the product and
    both gradients bit for bit as jax.nn gives them with the scales in its configs (run eagerly here,
    where the scales are concrete); the gradients in the operands' dtype."""
    if not hasattr(jax.nn, "scaled_dot_general"):
        pytest.skip(f"jax {jax.__version__} has no jax.nn.scaled_dot_general")
    lhs = (jax.random.normal(jax.random.key(1), (2, 32, 64)) * 3).astype(jnp.bfloat16)
    rhs = (jax.random.normal(jax.random.key(2), (64, 48)) * 0.02).astype(jnp.bfloat16)
    dims = (((2,), (0,)), ((), ()))

    scales = [bench_peers.tensor_scale(x).reshape(1) for x in (lhs, rhs)] + [jnp.ones((1,), jnp.float32)]
    configs = [jax.nn.get_scaled_dot_general_config("nvfp4", global_scale=s) for s in scales]  # concrete

    def inside(a, b):
        return jax.nn.scaled_dot_general(a, b, dims, preferred_element_type=jnp.bfloat16, configs=configs)

    outside = lambda a, b: bench_peers.jax_nn_dot_general("nvfp4")(a, b, dims)  # noqa: E731
    cotangent = jax.random.normal(jax.random.key(3), (2, 32, 48)).astype(jnp.bfloat16)
    got = []
    for f in (inside, outside):
        out, vjp = jax.vjp(f, lhs, rhs)
        got.append([out, *vjp(cotangent)])
    for a, b in zip(*got, strict=True):
        assert a.dtype == b.dtype == jnp.bfloat16
        assert jnp.array_equal(a.view(jnp.uint16), b.view(jnp.uint16))
    assert not jnp.array_equal(got[1][0], jax.lax.dot_general(lhs, rhs, dims))  # quantized


# ------------------------------------------------------------------------------------------ memory


def test_the_memory_fraction_is_the_users_else_the_default():
    env = {}
    assert bench_peers.default_memory_fraction(env) == bench_peers.MEMORY_FRACTION
    assert env == {"XLA_PYTHON_CLIENT_MEM_FRACTION": bench_peers.MEMORY_FRACTION}
    env = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.5"}
    assert (
        bench_peers.default_memory_fraction(env) == "0.5" and env["XLA_PYTHON_CLIENT_MEM_FRACTION"] == "0.5"
    )


def test_a_step_that_does_not_fit_is_one_line_naming_the_fix(monkeypatch):
    """The H100's numbers at JAX's default pool: 13.2 GiB new state + 36.3 GiB temporaries beside the
    13.2 GiB state, in a 59.7 GiB pool; at the benchmark's 0.95 (75.7 GiB) it fits."""
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")
    gib = 2**30
    need, in_use = int(49.5 * gib), int(13.2 * gib)
    reason = bench_peers.memory_shortfall(need, {"bytes_limit": int(59.7 * gib), "bytes_in_use": in_use})
    assert "\n" not in reason and "XLA_PYTHON_CLIENT_MEM_FRACTION" in reason and "global_batch" in reason
    assert "49.5 GiB" in reason
    assert (
        bench_peers.memory_shortfall(need, {"bytes_limit": int(75.7 * gib), "bytes_in_use": in_use}) is None
    )
    assert bench_peers.memory_shortfall(need, None) is None  # the CPU reports no pool
    monkeypatch.setenv("XLA_PYTHON_CLIENT_MEM_FRACTION", bench_peers.MEMORY_FRACTION)
    full = {"bytes_limit": int(75.7 * gib), "bytes_in_use": int(40 * gib)}
    assert bench_peers.memory_shortfall(need, full).endswith(": lower --config.global_batch")


def test_the_step_buffers_are_its_outputs_and_temporaries():
    compiled = jax.jit(lambda x: (x * 2, x.sum())).lower(jnp.ones((256, 256), jnp.float32)).compile()
    assert bench_peers.step_buffers(compiled) >= 256 * 256 * 4
