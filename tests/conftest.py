"""Test set-up for the two lanes (docs/testing.md).

CPU lane (the default, what CI runs): 8 fake CPU devices, so sharding is exercised on every machine.
GPU lane (`JAX_PLATFORMS=cuda,cpu` or `rocm,cpu`): the real devices as they are; XLA's GPU ops are made
deterministic (scatter-adds otherwise use atomics, so the same run twice could differ in its last bits)
and memory is allocated on demand, so that subprocesses a test starts can have some too.
Both lanes: the trainer's XLA options in this process too, and a persistent XLA compilation cache for the
session (below).

Everything here must be set before jax initialises its backends, hence at import time of conftest.
"""

import atexit
import gc
import os
import shutil
import subprocess
import sys
import tempfile

from fp4jax import xla_flags  # reads XLA_FLAGS; imports no jax

# Python's cycle collector: tracing makes millions of short-lived objects, and at the default thresholds
# (700, 10, 10) a worker spent about 6 % of its time in collections (test_mx_dot.py alone: 2.1 of 35 s;
# 1 s at these, 2026-12-06). Only how often garbage cycles are looked for changes; see also
# pytest_collection_finish.
gc.set_threshold(10_000, 20, 20)

os.environ.setdefault("JAX_PLATFORMS", "cpu")
_ON_CPU = os.environ["JAX_PLATFORMS"].split(",")[0].strip() == "cpu"


def _add_xla_flag(name: str, value: str) -> None:
    flags = os.environ.get("XLA_FLAGS", "")
    if not xla_flags.values(f"--{name}"):  # a value the user set wins
        os.environ["XLA_FLAGS"] = f"{flags} --{name}={value}".strip()


def _ask_xla(flags: str) -> subprocess.Popen:
    """A child that exits 0 if this jaxlib's XLA knows these flags (an unknown flag aborts the process, so
    a child is asked)."""
    env = {**os.environ, "XLA_FLAGS": flags, "JAX_PLATFORMS": "cpu"}
    probe = [sys.executable, "-c", "import jax; jax.devices()"]
    return subprocess.Popen(probe, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# The CPU lane compiles hundreds of small programs and runs each a few times, so compile time dominates:
# XLA's CPU back end at optimization level 0 (and without LLVM's expensive passes) compiles about 30 %
# faster, and with its elemental IR emitters instead of the MLIR fusion emitters
# (xla_cpu_use_fusion_emitters=false) about 40 % faster again (a tiny run's train step: 6.0 -> 3.5 s of
# compiling). Results stay exact: the tests compare programs compiled under the same flags, and the
# bit-exact ones do integer arithmetic or compare against numpy references. One exception, outside fp4jax:
# the elemental emitters convert float32 -> float4_e2m1fn wrongly off the grid (1.7499 -> 2, 2.5001 -> 2;
# 88 in 100,000 normal values), so a peer that relies on that conversion runs in a child process with
# XLA's defaults (test_nvfp4_peers.py); fp4jax converts only values already on the grid. The GPU lane
# compiles as users do. Checked once per session (pytest-xdist's workers inherit the answer through the
# environment: how many groups, from the first, this jaxlib accepts), because flags differ between XLA
# versions. The third group compiles each program's LLVM module in one piece instead of split for parallel
# threads: on the CPU lane's two cores, which both workers keep busy, the split only costs (test_mx_dot.py
# alone: 35.5 -> 34.3 s, 2026-12-06); the code generated is the same.
_FAST_COMPILE = (
    "--xla_backend_optimization_level=0 --xla_llvm_disable_expensive_passes=true",
    "--xla_cpu_use_fusion_emitters=false",
    "--xla_cpu_parallel_codegen_split_count=1",
)
_FAST_COMPILE_VAR = "FP4JAX_TESTS_FAST_COMPILE"


def _accepted_groups(asked_all: subprocess.Popen) -> int:
    """How many of _FAST_COMPILE's groups, from the first, this jaxlib's XLA knows: `asked_all` is the
    child asked about all of them (the only one where it knows them all), then one child per shorter
    prefix."""
    if asked_all.wait(timeout=120) == 0:
        return len(_FAST_COMPILE)
    for n in range(len(_FAST_COMPILE) - 1, 0, -1):
        if _ask_xla(" ".join(_FAST_COMPILE[:n])).wait(timeout=120) == 0:
            return n
    return 0


# The child asking about the flags runs while this process imports jax and fp4jax (below): XLA reads
# XLA_FLAGS when a backend starts, not when jax is imported, so the flags are added after the imports,
# and the workers start about a second sooner (the child takes 1.1 s, the imports 1.8 s).
_asked_all = None
if _ON_CPU:
    _add_xla_flag("xla_force_host_platform_device_count", "8")
    if _FAST_COMPILE_VAR not in os.environ:
        _asked_all = _ask_xla(" ".join(_FAST_COMPILE))
else:
    _add_xla_flag("xla_gpu_deterministic_ops", "true")
    os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

# Identical programs compile once per test session: many tests build the same tiny trainer, in this
# process, in pytest-xdist's other worker and in `python -m fp4jax.train` subprocesses. JAX reads these
# variables when it is imported, so they are set before anything imports jax: the controller sets them
# before it starts the workers, which inherit them (one directory for the whole session), as do the
# subprocesses. A fresh directory each session, so that a clean clone's run is what is timed; a directory
# the user set is used as it is. Every program is written (no minimum compile time or size): the tiny
# programs are the ones that repeat. An entry is keyed by the program, the XLA flags and the devices, so a
# hit is the executable the compile would have produced.
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    os.environ["JAX_COMPILATION_CACHE_DIR"] = tempfile.mkdtemp(prefix="fp4jax-tests-xla-cache-")
    atexit.register(shutil.rmtree, os.environ["JAX_COMPILATION_CACHE_DIR"], ignore_errors=True)
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES", "-1")

# Runs trained in this process compile as the command line's do. The trainer writes its XLA options (the
# Triton GEMM fusions off, setup.XLA_OPTIONS) into XLA_FLAGS only where jax has not started yet: in a
# test's `python -m fp4jax.train` subprocess, never in pytest's process. Without this, tests that compare a
# subprocess's run with an in-process one bit for bit (test_faults' SIGINT run) compared two programs on a
# GPU, whose GEMMs differed. The flags set above win; the subprocesses inherit the result.
from fp4jax.configs import base as _base_config  # noqa: E402  (imports jax; starts no backend)
from fp4jax.training import setup as _setup  # noqa: E402

if _ON_CPU:
    assert not _setup._backends_started(), "a jax backend started before the test flags were set"
    if _asked_all is not None:
        os.environ[_FAST_COMPILE_VAR] = str(_accepted_groups(_asked_all))
    for _flag in " ".join(_FAST_COMPILE[: int(os.environ[_FAST_COMPILE_VAR])]).split():
        _add_xla_flag(*_flag.removeprefix("--").split("="))
_setup.apply_xla_options(_base_config.get_config())

import jax  # noqa: E402

jax.config.update("jax_threefry_partitionable", True)
# The same cache settings where something imported jax before this file (a plugin, a sitecustomize).
for _option, _parse in (
    ("jax_compilation_cache_dir", str),
    ("jax_persistent_cache_min_compile_time_secs", float),
    ("jax_persistent_cache_min_entry_size_bytes", int),
):
    jax.config.update(_option, _parse(os.environ[_option.upper()]))

# The tiny training runs' session fixtures (tests/tiny_runs.py), defined once here so that every module
# shares one token cache, one compilation cache and one finished run (imported into a test module instead,
# each module would get its own).
import ordering  # noqa: E402
import pytest  # noqa: E402
import shards  # noqa: E402
from tiny_runs import good_run, good_run_events, good_run_result, token_cache, xla_cache  # noqa: E402, F401

from fp4jax import logs  # noqa: E402
from fp4jax.ops import formats, nvfp4, quantize, quantized_dot, rotation  # noqa: E402
from fp4jax.ops.kernels import probes, sr_bits  # noqa: E402

logs.configure()  # as the command lines do: tests read the trainer's messages on stderr


def pytest_report_header(config):
    d = jax.devices()
    return f"jax {jax.__version__}, devices: {len(d)} x {d[0].platform} ({d[0].device_kind})"


@pytest.fixture(scope="session")
def gpt2():
    """The bundled GPT-2 tokenizer, loaded once per worker."""
    from fp4jax.data import load_tokenizer

    return load_tokenizer("gpt2")


@pytest.fixture
def failing_scaled_dot(monkeypatch):
    """scaled-dot as XLA on an H200 with Triton GEMMs off: compiling it fails (probe caches cleared), and
    FP4JAX_GEMM_BACKEND is unset."""

    def refuse(*args):
        raise RuntimeError("INTERNAL: Unsupported instruction opcode: scaled-dot\nthe rest of XLA's message")

    probes.scaled_dot_compile_error.cache_clear()
    probes.auto_choice.cache_clear()
    monkeypatch.setattr(probes, "scaled_dot", refuse)
    monkeypatch.setenv("XLA_FLAGS", f"{xla_flags.TRITON_GEMM}=false")
    monkeypatch.delenv("FP4JAX_GEMM_BACKEND", raising=False)
    yield monkeypatch
    probes.scaled_dot_compile_error.cache_clear()
    probes.auto_choice.cache_clear()


# fp4jax's jitted entry points (inline=True): mx_dot_general's passes, the public quantizers, the
# dequantizers, the IEEE divides, FP8 decoding, SR's bits and the rotations.
_JITTED = (
    quantized_dot._mx_dot_primal,
    quantized_dot._mx_dot_fwd,
    quantized_dot._mx_dot_bwd,
    quantize.quantize_mx,
    quantize.quantize_fp8,
    nvfp4.quantize_nvfp4,
    quantize._dequantize_mx,
    quantize._dequantize_fp8,
    nvfp4._dequantize_nvfp4,
    formats.divide_nearest_even,
    formats.divide_nearest_even_by_integers,
    formats.float8_to_float32,
    sr_bits._stochastic_bits,
    rotation.random_signs,
    rotation.rotate_blocks,
)


@pytest.fixture(autouse=True)
def _traced_afresh(request):
    """A test that monkeypatches sees its patches traced: a jit reuses the trace of an earlier call with
    the same shapes and static arguments, also inlined into a caller's jit, so _JITTED's caches are
    cleared before each such test (the others keep them)."""
    if "monkeypatch" in request.fixturenames:
        for jitted in _JITTED:
            jitted.clear_cache()


def pytest_collection_finish(session):
    """What collection imported (jax, flax, the test modules) lives for the whole session: frozen out of
    the cycle collector's view, so that its full collections stop walking it again and again."""
    gc.collect()
    gc.freeze()


def pytest_addoption(parser):
    parser.addoption(
        "--shard",
        metavar="K/N",
        help="run the K-th of N shards of the collected tests (tests/shards.py; benchmarks/gpu_lane.sh)",
    )
    parser.addoption(
        "--seconds-log",
        metavar="PATH",
        help="append each test phase's seconds to PATH as it ends, in --durations=0's line format, so that "
        "a lane cut short still leaves its figures (tests/shards.py seconds reads them)",
    )


class _SecondsLog:
    """--seconds-log: one flushed line per test phase as it ends (setup, call, teardown), written by the
    main process only (pytest-xdist's workers send it their reports)."""

    def __init__(self, path: str):
        self.path = path

    def pytest_runtest_logreport(self, report):
        with open(self.path, "a") as f:
            f.write(f"{report.duration:.3f}s {report.when} {report.nodeid}\n")


def pytest_configure(config):
    path = config.getoption("seconds_log")
    if path and not hasattr(config, "workerinput"):
        config.pluginmanager.register(_SecondsLog(path), "fp4jax_seconds_log")


def _keep_shard(config, items) -> None:
    """Deselects what is not in --shard's shard: a partition of what `-m` left, the same in every worker."""
    try:
        k, n = shards.parse_shard(config.getoption("shard"))
    except ValueError as exc:
        raise pytest.UsageError(str(exc)) from None
    keep = set(shards.partition([item.nodeid for item in items], n, shards.load_seconds())[k - 1])
    config.hook.pytest_deselected(items=[item for item in items if item.nodeid not in keep])
    items[:] = [item for item in items if item.nodeid in keep]


@pytest.hookimpl(trylast=True)  # after `-m` has deselected the other lane's tests
def pytest_collection_modifyitems(config, items):
    """--shard's share of the tests, if given; then slow modules first, dealt between pytest-xdist's
    workers (tests/ordering.py) by the measured seconds of the tests collected; the same order in every
    worker, as xdist requires."""
    if config.getoption("shard"):
        _keep_shard(config, items)
    workers = getattr(config, "workerinput", {}).get("workercount", 1)
    # A GPU lane orders by the GPU's measured seconds where there are any: its compiled kernels take
    # minutes there and nothing on the CPU lane, where they skip.
    measured = (not _ON_CPU and shards.load_seconds()) or shards.load_seconds(ordering.SECONDS_FILE)
    seconds = ordering.module_seconds([item.nodeid for item in items], measured)
    order = ordering.deal([os.path.basename(item.path) for item in items], workers, seconds)
    items[:] = [items[i] for i in order]
