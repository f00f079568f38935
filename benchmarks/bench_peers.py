"""Peers side by side: the Llama training step with fp4jax's recipes, qwix's MXFP4 and jax.nn's
scaled_dot_general dropped into the same model, in one process.

    PYTHONPATH=. python benchmarks/bench_peers.py [--size 1b|tiny] [--variants NAME,...] [--warmup 2]
        [--steps 5] [--check] [--out FILE.json] [--compile-budget-s 420] [--config.KEY=VALUE ...]

Every variant trains the same Llama (the size's config: `configs/llama1b_pg_bf16.py` at seq 2048 x 16 for
"1b", `configs/tiny_c4_h16.py` shrunk for "tiny") from the same initial state on the same batch of random
tokens, through the trainer's own pure step (`fp4jax.training.state.train_step`: loss, gradients, AdamW).
What differs is the dot_general of the seven projections (q, k, v, o, gate, up, down); the embedding,
attention and LM head stay as the model has them:

- fp4jax: a recipe (a PRESETS name, resolved as the trainer resolves it: the config's fp8_scaling,
  sr_rng and fp8_divide applied), and `mxfp4_full_ceil`: mxfp4_full with qwix's scale rule (`ceil`),
  fp4jax's twin of qwix's variant.
- `qwix_mxfp4`: qwix 0.1.8's quantized training (`QtProvider`, `qwix.quantize_model`): MXFP4 on both
  operands of every forward GEMM and, through its backward settings, on both operands of Dgrad and Wgrad,
  each projection handed to it as one 2-D product (`as_matrix_product` says why). On a GPU with bfloat16
  activations qwix 0.1.8's step failed (the H200, jax 0.11.2: "INTERNAL: Input datatypes do not match"):
  its Dgrad and Wgrad give jax.nn.scaled_matmul a float32-scaled gradient and a bfloat16-scaled operand,
  a qwix bug (`qwix_scale_mismatch` has its lines); a failed row names that cause where its program
  shows it.
- `jax_nn_mxfp8`, `jax_nn_nvfp4`: `jax.nn.scaled_dot_general` with `jax.nn.get_scaled_dot_general_config`
  configs. NVFP4's per-tensor scale is the operand's amax / (448 * 6) per call, as Transformer Engine's,
  applied around jax.nn's call (`jax_nn_dot_general` says why).

How a peer gets in: each projection is an `nn.DenseGeneral` whose dot_general is fp4jax's
`QuantDotGeneral` (fp4jax/models/llama.py); the peer variants run the bf16 model under
`flax.linen.intercept_methods`, which hands every `QuantDotGeneral` call to the peer's dot_general instead
(for qwix: to `jax.lax.dot_general`, which qwix's provider intercepts by module path). Nothing else of
the model changes, so every row multiplies the same GEMMs.

Timing (harness.py's rule): each variant is compiled and warmed up (`--warmup` steps, the first one's
loss recorded), then `--steps` timed rounds run the variants in turn, one synchronised step each, so a
drift of the device's clocks touches every variant alike; a row reports the median. The step is not
donated: every step starts from the same state, which the variants share (one copy of the 1B state, not
one per variant); the trainer's donated step is up to a few percent faster, alike for all rows.

Memory: not donated, the 1B step holds the state, the new state and its temporaries, about 64 GiB
(MEMORY_FRACTION's comment has the arithmetic), more than JAX's default pool of 75 % of an 80 GB card.
XLA_PYTHON_CLIENT_MEM_FRACTION is set to 0.95 unless given; a compiled step larger than what the pool has
free is not run, its row names the fix (`step_buffers_gib` in each row: XLA's outputs and temporaries).

Peers are optional (`pip install '.[peers]'` for qwix; jax.nn's configurations come with jax where this
jax and device compile them). A variant that cannot run here is skipped with its reason in the table and
the JSON, never silently: which jax.nn modes exist and compile is found by compiling a small one here, not
from jax's version.

`--out FILE.json` is rewritten (atomically) after every event: one entry per variant as it is skipped,
compiled, warmed up and timed, so a run cut short keeps what it finished. The markdown table goes to stdout.
No variant starts compiling after `--compile-budget-s` from the start (a GPU command may run 10 minutes):
the rest are rows that say so, and the compiled ones are still timed. Baselines and peers come first.

`--check`: bit-equality with qwix where the numerics contract says so (docs/numerics.md, the `ceil` rule).
qwix 0.1.8 scales a block by 2^ceil(log2(amax / 6)), computed in the operand's floating-point dtype;
fp4jax's `ceil` takes the exact exponent from amax's bits. They agree on every block except those whose
amax / 6 lies within the dtype's rounding of a power of two (the rounded log2 lands on the wrong side of
the integer: float32's log2(2^-30) is -29.999998), and those below 6 * 2^-63, where qwix's scale is 1.
The check quantizes operands both ways and counts differing blocks outside and inside that band (outside
must be 0), then compares `mxfp4_full_ceil` with `qwix_mxfp4` on one Fprop GEMM of float32 operands, on one
step's loss and every gradient at float32 activations (at most 2 blocks, one sequence), and on the timed
first step (bfloat16 activations: not expected bit-equal). On the CPU both multiply the same dequantized
operands with XLA's dot and every row but the bfloat16 ones is bit-equal; on a GPU the GEMM kernels
differ (the rows say so).

Estimated runtime of the default command with `--check` (1B, seq 2048 x 16, 11 variants with the ceil
twin): compiling took about 13 s a variant on one H100 (2026-12-06, a run whose steps then ran out of
memory), about 2.5 minutes for all, plus 11 x 7 steps of about 0.5 s and 30-60 s for the check's
programs: about 4 minutes; a complete run not yet measured.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import gc
import importlib.metadata
import importlib.util
import json
import math
import os
import statistics
import sys
import time
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.extend.core
import jax.numpy as jnp
import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import harness  # benchmarks/harness.py (this folder is on sys.path when run as a script)
from bench_train import load_config  # the trainer's flag parser, --config.KEY=VALUE overrides

from fp4jax.models.llama import Llama  # noqa: E402
from fp4jax.models.sharding import sharding_context  # noqa: E402
from fp4jax.ops.execution import resolve_execution  # noqa: E402
from fp4jax.ops.flax_adapters import QuantDotGeneral  # noqa: E402
from fp4jax.ops.quantize import quantize_mx  # noqa: E402
from fp4jax.ops.quantized_dot import bind_recipe  # noqa: E402
from fp4jax.ops.recipes import MXFP4, PRESETS, GemmSpec, Recipe  # noqa: E402
from fp4jax.training import setup  # noqa: E402
from fp4jax.training.optimizer import make_optimizer  # noqa: E402
from fp4jax.training.state import TrainState, token_losses, train_step  # noqa: E402

QWIX_VERSION = "0.1.8"
INSTALL_QWIX = f"pip install '.[peers]' (qwix=={QWIX_VERSION}) in the repository, then rerun"
MX_BLOCK = 32
E2M1_MAX = 6.0

GPT2_PADDED_VOCAB = 50304  # the 1B config's tokenizer (GPT-2, 50,257) padded to a multiple of 128
# Each size: its config file and the overrides that shape it for this benchmark (the command line's
# --config.KEY=VALUE come after and win). 1b: blocks scanned, so that ten variants compile within the
# time budget (inline blocks are up to 3.6 % faster, docs/performance.md, and compile longer), and the
# vocabulary the trainer derives from the config's tokenizer (the batch is random tokens: none is loaded).
# tiny: a 512-token vocabulary, because the GPT-2 one is most of so small a model's work; head_dim 32,
# because with 16 XLA:CPU (jaxlib 0.10.2) rejects the float32 check step's qwix program ("does not support
# custom element sizes on non-sub-byte types", a convert of the v projection's (64, 32) weight).
SIZES = {
    "1b": (
        "configs/llama1b_pg_bf16.py",
        ["--config.model.scan_layers=True", f"--config.model.vocab_size={GPT2_PADDED_VOCAB}"],
    ),
    "tiny": (
        "configs/tiny_c4_h16.py",
        [
            "--config.seq_len=64",
            "--config.global_batch=2",
            "--config.model.head_dim=32",
            "--config.model.vocab_size=512",
            "--config.model.attention=xla",
        ],
    ),
}
CEIL_RECIPE_NAME = "mxfp4_full_ceil"
PEER_NAMES = ("qwix_mxfp4", "jax_nn_mxfp8", "jax_nn_nvfp4")
# The baselines and the peers first: where the compile budget runs out, the rows it drops are fp4jax's.
DEFAULT_VARIANTS = ("bf16", "fp8_mlperf", *PEER_NAMES, "mxfp4_full_h16", "mxfp4_full", "nvfp4_full", "mxfp8")
# One GPU command may run 10 minutes: no variant starts compiling after this many seconds, so that the
# compiled ones are still timed and the check still runs (the rows not compiled say so).
COMPILE_BUDGET_S = 420

# The default size's step (1B, seq 2048 x 16, blocks scanned, remat minimal_attention), not donated:
#   the shared state: 1,179,191,296 float32 params (4.72 GB) and AdamW's two float32 moments (9.43 GB),
#     14.15 GB (13.2 GiB), one copy for every variant;
#   the step's new state, beside it (not donated): another 14.15 GB;
#   its temporaries, 40.8 GB as XLA measured them (docs/performance.md, the donated step): the float32
#     gradients (4.72 GB); the activations remat minimal_attention saves, per token and block the seven
#     projections' bfloat16 outputs (q 2048 + k 512 + v 512 + o 2048 + gate 8192 + up 8192 + down 2048
#     values, 47.1 kB), the block's input (4.1 kB) and cuDNN attention's output and statistics (4.2 kB),
#     55.4 kB x 16 blocks x 32,768 tokens = 29.0 GB; the logits, 32,768 x 50,304 in bfloat16 and their
#     float32 softmax and gradient (3.3 + 6.6 GB, partly overlapping).
# About 69 GB (64 GiB) in all. On an H100 80GB (79.6 GiB) JAX's pool is 75 % of the GPU by default,
# 59.7 GiB: too small (its out-of-memory log: one 36.3 GiB block of temporaries asked for while 45 % of
# the pool, the state and the new state, was in use). MEMORY_FRACTION gives the pool 75.7 GiB there
# (133 GiB of an H200's 140), room for the variants' own buffers and XLA's autotuning; a step that still
# does not fit is a row naming the fix (`memory_shortfall`), not an out-of-memory error.
MEMORY_FRACTION = "0.95"


# ------------------------------------------------------------------------------------------ variants


@dataclasses.dataclass
class Variant:
    """One row: `model` is what train_step applies (None until built), `skip` why it cannot run here."""

    name: str
    family: str
    numerics: str
    needs_key: bool = False
    fp8_meta_model: Any = None  # the Llama whose fp8_meta collection this variant's state needs
    model: Any = None
    skip: str | None = None
    # A failed step's known cause, looked for in the step's program (its jaxpr): a line, or None.
    explain: Callable[[Any], str | None] | None = None


@dataclasses.dataclass(frozen=True)
class RoutedModel:
    """`llama` (a linen Llama, or qwix's quantized copy of one) whose projections' dot_general is
    `dot_general`: every call of fp4jax's QuantDotGeneral is handed to it instead. Quacks like the model
    for train_step (`apply`)."""

    llama: Any
    dot_general: Callable

    def apply(self, variables, *args, **kwargs):
        with nn.intercept_methods(self._route):
            return self.llama.apply(variables, *args, **kwargs)

    def _route(self, next_fun, args, kwargs, context):
        if isinstance(context.module, QuantDotGeneral) and context.method_name == "__call__":
            return in_model_dtype(self.dot_general, *args, **kwargs)
        return next_fun(*args, **kwargs)


def in_model_dtype(dot_general, lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """`dot_general`'s product cast to the dtype the model's own dot_general returns (lax.dot_general's:
    the preferred type, else the operands' promoted dtype, bfloat16 in the bf16 model).

    Why: a peer may return another dtype. qwix 0.1.8 on a GPU multiplies MXFP4 operands with
    jax.nn.scaled_matmul, whose result is float32 where no preferred type is passed (its emulation on
    other platforms returns the operands' dtype); a float32 projection output then turns the bfloat16
    residual stream float32, and with scanned blocks the scan's carry changes type, a TypeError."""
    out = dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)
    return out.astype(preferred_element_type or jnp.result_type(lhs, rhs))


def as_matrix_product(dot_general: Callable) -> Callable:
    """`dot_general` handed each call as one 2-D product (lhs's free axes x its contracting axes) @
    (contracting x rhs's free), the result reshaped back: a projection has no batch axes.

    Why for qwix: it tiles only the last contracting axis and shares one scale across the others, so on
    a Dense layer's own shapes a Wgrad block (contracting batch and sequence) spans the whole batch, and
    an o projection's (contracting heads and head_dim) every head. As a matrix product every block is 32
    contiguous elements of one row, as MX defines it and as fp4jax blocks (it flattens the same way)."""

    def matrix_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        (lhs_contract, rhs_contract), (lhs_batch, rhs_batch) = dimension_numbers
        if lhs_batch or rhs_batch:
            raise ValueError(f"a projection's dot_general has no batch axes, got {dimension_numbers}")
        lhs_free = [a for a in range(lhs.ndim) if a not in lhs_contract]
        rhs_free = [a for a in range(rhs.ndim) if a not in rhs_contract]
        k = math.prod(lhs.shape[a] for a in lhs_contract)
        lhs_2d = jnp.transpose(lhs, (*lhs_free, *lhs_contract)).reshape(-1, k)
        rhs_2d = jnp.transpose(rhs, (*rhs_contract, *rhs_free)).reshape(k, -1)
        out = dot_general(lhs_2d, rhs_2d, (((1,), (0,)), ((), ())), precision, preferred_element_type)
        return out.reshape(*(lhs.shape[a] for a in lhs_free), *(rhs.shape[a] for a in rhs_free))

    return matrix_dot_general


def ceil_recipe() -> Recipe:
    """mxfp4_full with qwix's scale rule: every operand of the three GEMMs MXFP4 (E2M1, 32, ceil, RNE)."""
    spec = dataclasses.replace(MXFP4, scale_mode="ceil")
    gemm = GemmSpec(spec, spec)
    return Recipe(fprop=gemm, dgrad=gemm, wgrad=gemm, name=CEIL_RECIPE_NAME)


def fp4jax_variant(name: str, config, base) -> Variant:
    """A preset under the config's fp8_scaling, sr_rng and fp8_divide (as the trainer resolves it), or the
    ceil twin of qwix."""
    recipe = ceil_recipe() if name == CEIL_RECIPE_NAME else setup.run_recipe(config, name)
    recipe, execution = resolve_execution(recipe)
    model = base.clone(recipe=recipe)
    numerics = f"back end {execution.backend}; quantizer {execution.quantizer_runs}"
    if all(spec.format is None for spec in recipe.operands):
        numerics = "unquantized: the model's dtype in every GEMM"  # back end and quantizer never run
    meta = model if recipe.uses_delayed_fp8 else None
    return Variant(name, "fp4jax", numerics, recipe.needs_key, meta, model)


def qwix_missing() -> str | None:
    if importlib.util.find_spec("qwix") is None:
        return f"qwix is not installed: {INSTALL_QWIX}"
    version = importlib.metadata.version("qwix")
    if version != QWIX_VERSION:
        return f"qwix {version} is installed, this row is written for {QWIX_VERSION}: {INSTALL_QWIX}"
    return None


def qwix_rule():
    """qwix's QtRule for every projection: MXFP4 (its 32-element tiles along the last contracting axis)
    on both forward operands, on the incoming gradient of both backward GEMMs, and on their residual
    operands (x for Wgrad, W for Dgrad), which qwix re-quantizes along the new contracting axis. The
    projection's dot_general runs in fp4jax's QuantDotGeneral module, which holds no params, so qwix sees
    both operands as activations: the tile sizes of the backward GEMMs are set directly."""
    import qwix

    backward = dict(
        dlhs_tile_size=MX_BLOCK,
        drhs_tile_size=MX_BLOCK,
        dlhs_residual_qtype="mxfp4",
        drhs_residual_qtype="mxfp4",
    )
    return qwix.QtRule(
        module_path=r".*/QuantDotGeneral_0",
        weight_qtype="mxfp4",
        act_qtype="mxfp4",
        bwd_qtype="mxfp4",
        tile_size=MX_BLOCK,
        additional_qt_config=backward,
    )


def qwix_lax_dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
    """jax.lax.dot_general looked up at call time: qwix's provider replaces it while the model runs."""
    return jax.lax.dot_general(lhs, rhs, dimension_numbers, precision, preferred_element_type)


def qwix_variant(base) -> Variant:
    numerics = "MXFP4 (qwix's ceil rule in the operand's dtype) on both operands of Fprop, Dgrad, Wgrad"
    variant = Variant("qwix_mxfp4", f"qwix {QWIX_VERSION}", numerics, skip=qwix_missing())
    if variant.skip is None:
        import qwix

        quantized = qwix.quantize_model(base, qwix.QtProvider([qwix_rule()]))
        variant.model = RoutedModel(quantized, as_matrix_product(qwix_lax_dot_general))
        variant.explain = qwix_scale_mismatch
    return variant


def qwix_scale_mismatch(closed_jaxpr) -> str | None:
    """Why qwix 0.1.8's step fails on a GPU, where its program shows it (None where it does not): some
    of jax.nn.scaled_matmul's calls get the two operands' block scales in different dtypes. On the
    H200 (jax 0.11.2) the float32 check's step ran, every call's scales float32; the bfloat16 step
    failed ("INTERNAL: Input datatypes do not match"), its forward calls' scales bfloat16 on both
    sides and Dgrad's and Wgrad's float32 with bfloat16: the only calls whose two inputs' dtypes
    differ (every call's operands float4_e2m1fn; jax.nn's own rows, scales in another dtype than
    operands and result, ran).

    How qwix gets there (qwix/_src/...): on a GPU both MXFP4 operands go to jax.nn.scaled_matmul with
    each QArray's scale as it is (core/mxfp_dot.py:101, :83), and a scale has the dtype of the array it
    was computed from (core/qarray.py:609). qwix's forward returns scaled_matmul's default float32
    (mxfp_dot.py:88; dot_general_qt.py:236 and providers/qt.py:97 pass no preferred type), so in a
    bfloat16 model the gradient reaching its backward is float32, and Dgrad and Wgrad multiply it,
    quantized in float32 (dot_general_qt.py:302), with the bfloat16 operand saved from the forward and
    quantized in bfloat16 (:196, :319, :321). Only qwix can fix it without changing what it computes:
    operands cast to float32 here would move its ceil into float32 and save float32 copies for the
    backward."""
    pairs = [
        tuple(str(v.aval.dtype) for v in eqn.invars[2:4])
        for eqn in equations(closed_jaxpr)
        if eqn.primitive.name.startswith(SCALED_MATMUL) and len(eqn.invars) == 4
    ]
    mixed = [pair for pair in pairs if pair[0] != pair[1]]
    if not mixed:
        return None
    kinds = ", ".join(f"{a} with {b}" for a, b in sorted(set(mixed)))
    return (
        f"qwix {QWIX_VERSION} on GPUs: {len(mixed)} of the {len(pairs)} jax.nn.scaled_matmul calls in its "
        f"step (Dgrad, Wgrad) get block scales of two dtypes ({kinds}): the gradient is float32, qwix's "
        "forward returning scaled_matmul's float32 (qwix/_src/core/mxfp_dot.py:88), the saved operand "
        "bfloat16, and each scale keeps its operand's dtype (core/qarray.py:609, core/dot_general_qt.py:321)"
    )


# NVFP4's per-tensor scale maps the operand's amax to e4m3's largest block scale times E2M1's largest value.
NVFP4_TENSOR_RANGE = 448.0 * 6.0


def jax_nn_dot_general(mode: str) -> Callable:
    """lax.dot_general's signature over jax.nn.scaled_dot_general; the output in the operands' dtype.

    The configs are made here, once, outside any trace: jax.nn passes them to its custom_vjp as static
    (nondiff) arguments, so an array in them must be a constant. A per-call global_scale (a traced amax)
    there is a tracer that jax.nn's gradient closes over, which fails to lower where the blocks are
    scanned ("No constant handler for type: DynamicJaxprTracer"). NVFP4 keeps the default global_scale,
    a constant 1, and gets its per-tensor scales around the call (`nvfp4_tensor_scaled`)."""
    configs = [jax.nn.get_scaled_dot_general_config(mode)] * 3

    def dot_general(lhs, rhs, dimension_numbers, precision=None, preferred_element_type=None):
        out_dtype = preferred_element_type or jnp.result_type(lhs, rhs)
        if mode == "nvfp4":
            call = functools.partial(
                jax.nn.scaled_dot_general,
                dimension_numbers=dimension_numbers,
                preferred_element_type=jnp.float32,
                configs=configs,
            )
            return nvfp4_tensor_scaled(call, dimension_numbers, jnp.dtype(out_dtype), lhs, rhs)
        return jax.nn.scaled_dot_general(
            lhs, rhs, dimension_numbers, preferred_element_type=out_dtype, configs=configs
        )

    return dot_general


def tensor_scale(x: jax.Array) -> jax.Array:
    """NVFP4's per-tensor decode scale, Transformer Engine's: amax / (448 * 6) in float32, per call."""
    amax = jnp.max(jnp.abs(x)).astype(jnp.float32)
    return jnp.maximum(amax / NVFP4_TENSOR_RANGE, jnp.finfo(jnp.float32).tiny)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def nvfp4_tensor_scaled(call, dimension_numbers, out_dtype, lhs, rhs):
    """jax.nn's NVFP4 product with per-tensor scales, as TE's and as jax.nn computes a global_scale in
    its configs: each operand divided by its scale in float32 before the block quantization (`call`,
    global_scale 1), the float32 product multiplied by both scales after, then cast to `out_dtype`.

    The gradient is jax.nn's NVFP4 gradient (jax 0.10 to 0.11): both gradient GEMMs unquantized, on the
    saved operands in their dtype; its straight-through mask (|x| <= global_scale * 448 * 6) passes every
    element under the per-tensor scale, so it is left out. Written out because differentiating through
    the division would hand jax.nn float32 quotients, and its gradient GEMMs would run in float32."""
    return _nvfp4_forward(call, dimension_numbers, out_dtype, lhs, rhs)[0]


def _nvfp4_forward(call, dimension_numbers, out_dtype, lhs, rhs):
    s_lhs, s_rhs = tensor_scale(lhs), tensor_scale(rhs)
    out = call(lhs.astype(jnp.float32) / s_lhs, rhs.astype(jnp.float32) / s_rhs) * (s_lhs * s_rhs)
    return out.astype(out_dtype), (lhs, rhs)


def _nvfp4_backward(call, dimension_numbers, out_dtype, residuals, g):
    lhs, rhs = residuals
    dot = functools.partial(
        jax.lax.dot_general, dimension_numbers=dimension_numbers, preferred_element_type=out_dtype
    )
    d_lhs, d_rhs = jax.vjp(dot, lhs, rhs)[1](g)
    return d_lhs.astype(lhs.dtype), d_rhs.astype(rhs.dtype)


nvfp4_tensor_scaled.defvjp(_nvfp4_forward, _nvfp4_backward)


def _probe_operands():
    lhs = jax.random.normal(jax.random.key(1), (2, 64, 64), jnp.bfloat16)
    rhs = jax.random.normal(jax.random.key(2), (64, 32), jnp.bfloat16)
    return lhs, rhs, (((2,), (0,)), ((), ()))


def jax_nn_missing(mode: str) -> str | None:
    """Why jax.nn.scaled_dot_general(`mode`) cannot run here (None: a small one's value and gradients
    compiled; the value too, or XLA drops the forward GEMM and a device without it passes)."""
    if not hasattr(jax.nn, "scaled_dot_general") or not hasattr(jax.nn, "get_scaled_dot_general_config"):
        return f"jax {jax.__version__} has no jax.nn.scaled_dot_general"
    lhs, rhs, dims = _probe_operands()
    dot = jax_nn_dot_general(mode)
    loss = lambda a, b: dot(a, b, dims).astype(jnp.float32).sum()  # noqa: E731
    try:
        jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).lower(lhs, rhs).compile()
    except Exception as e:  # noqa: BLE001 - any failure to compile is the reason, reported in full
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        platform = jax.devices()[0].platform
        return f"jax {jax.__version__}'s scaled_dot_general({mode!r}) does not compile on {platform}: {first}"
    return None


# jax.nn.scaled_matmul's primitive: `scaled_matmul_wrapper` as jax 0.10 binds it, `scaled_matmul` lowered.
SCALED_MATMUL = "scaled_matmul"  # its operands: lhs, rhs, lhs_scales, rhs_scales


def equations(closed_jaxpr):
    """Every equation of a program, its sub-programs' (scan, custom_vjp, pjit) included, each once as
    written."""

    def walk(jaxpr):
        for eqn in jaxpr.eqns:
            yield eqn
            for sub in jax.extend.core.jaxprs_in_params(eqn.params):
                yield from walk(sub)

    return walk(closed_jaxpr.jaxpr)


def count_primitive(closed_jaxpr, prefix: str) -> int:
    """How many equations of a primitive whose name starts with `prefix` a program holds, its
    sub-programs (scan, custom_vjp, pjit) included, each counted once as written."""
    return sum(eqn.primitive.name.startswith(prefix) for eqn in equations(closed_jaxpr))


def backward_gemms_quantized(mode: str) -> int:
    """How many of a scaled_dot_general's three GEMMs (forward, both gradients) multiply block-scaled
    operands in this jax: scaled_matmul equations in its value-and-gradient's program (found, not
    assumed: jax 0.10's NVFP4 gradients multiply unquantized)."""
    lhs, rhs, dims = _probe_operands()
    dot = jax_nn_dot_general(mode)  # its configs made outside the trace, as the model's are
    loss = lambda a, b: dot(a, b, dims).astype(jnp.float32).sum()  # noqa: E731
    return count_primitive(
        jax.make_jaxpr(jax.value_and_grad(loss, argnums=(0, 1)))(lhs, rhs), "scaled_matmul"
    )


def jax_nn_variant(mode: str, base) -> Variant:
    name = f"jax_nn_{mode}"
    variant = Variant(name, "jax.nn", "", skip=jax_nn_missing(mode))
    if variant.skip is None:
        n = backward_gemms_quantized(mode)
        variant.numerics = (
            f"{mode.upper()} in {n} of the 3 GEMMs (jax.nn.scaled_dot_general; the others unquantized)"
        )
        variant.model = RoutedModel(base, jax_nn_dot_general(mode))
    return variant


def make_variant(name: str, config, base) -> Variant:
    if name in PRESETS or name == CEIL_RECIPE_NAME:
        return fp4jax_variant(name, config, base)
    if name == "qwix_mxfp4":
        return qwix_variant(base)
    if name.startswith("jax_nn_"):
        return jax_nn_variant(name.removeprefix("jax_nn_"), base)
    raise ValueError(  # checked before anything runs (check_names)
        f"unknown variant {name!r}: use fp4jax presets, {CEIL_RECIPE_NAME} or {', '.join(PEER_NAMES)}"
    )


def check_names(names: list[str]) -> None:
    known = {*PRESETS, CEIL_RECIPE_NAME, *PEER_NAMES}
    unknown = [n for n in names if n not in known]
    if unknown:
        raise SystemExit(
            f"error: unknown variant(s) {', '.join(unknown)}: use fp4jax presets ({', '.join(PRESETS)}), "
            f"{CEIL_RECIPE_NAME} or {', '.join(PEER_NAMES)}"
        )


# ------------------------------------------------------------------------------------------ the step


@dataclasses.dataclass
class Setup:
    """What every variant shares: the config, the bf16 Llama, optimizer, mesh, state, batch and key."""

    config: Any
    base: Any
    tx: Any
    schedule: Any
    mesh: Any
    state: TrainState
    batch: dict
    quant_key: jax.Array


def build_setup(config) -> Setup:
    """The trainer's model (recipe bf16), optimizer and sharded step-0 state, and a batch of random
    tokens. No tokenizer: the vocabulary is the config's model.vocab_size (the sizes set it), else the
    size's preset."""
    config = config.copy_and_resolve_references()
    config.recipe = "bf16"
    config = setup.resolve_config(config)  # the trainer's derived defaults and checks
    model_cfg = setup.model_config(config, vocab_size=None)
    base = Llama(model_cfg, recipe="bf16")
    tx, schedule = make_optimizer(config.optimizer)
    mesh = setup.make_run_mesh(config)
    state, _ = setup.init_train_state(base, tx, mesh, config.seed, config.seq_len)
    rng = np.random.default_rng(config.seed)
    tokens = rng.integers(0, model_cfg.vocab_size, (config.global_batch, config.seq_len + 1), dtype=np.int32)
    batch = setup.device_batch({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}, mesh)
    return Setup(config, base, tx, schedule, mesh, state, batch, setup.quant_key(config.seed))


def state_for(shared: Setup, variant: Variant) -> TrainState:
    """The shared state, with zero amax histories where the variant keeps delayed-FP8 state."""
    if variant.fp8_meta_model is None:
        return shared.state
    tokens = shared.batch["inputs"]
    with sharding_context(shared.mesh):
        shapes = jax.eval_shape(lambda: variant.fp8_meta_model.init(jax.random.key(0), tokens))["fp8_meta"]
    meta = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    return shared.state.replace(fp8_meta=meta)


def variant_step(shared: Setup, variant: Variant) -> Callable:
    """The trainer's pure step (state, batch, key) with the variant's model."""
    return functools.partial(
        train_step, model=variant.model, tx=shared.tx, schedule=shared.schedule, needs_key=variant.needs_key
    )


def compile_step(shared: Setup, variant: Variant, state: TrainState):
    """The variant's jitted train_step, compiled for the shared state and batch (not donated)."""
    with sharding_context(shared.mesh):
        return jax.jit(variant_step(shared, variant)).lower(state, shared.batch, shared.quant_key).compile()


def step_program(shared: Setup, variant: Variant, state: TrainState):
    """The program compile_step compiles, as a closed jaxpr (traced only: nothing runs)."""
    with sharding_context(shared.mesh):
        return jax.make_jaxpr(variant_step(shared, variant))(state, shared.batch, shared.quant_key)


# ------------------------------------------------------------------------------------------ memory


def default_memory_fraction(environ) -> str:
    """XLA_PYTHON_CLIENT_MEM_FRACTION as the run uses it: the user's, else MEMORY_FRACTION, set in
    `environ` (JAX reads it when it starts the GPU client, at the first use of a device)."""
    return environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", MEMORY_FRACTION)


def step_buffers(compiled) -> int | None:
    """Bytes a call of the compiled step allocates beside its arguments: its outputs (the step's new
    state) and temporaries, from XLA's buffer assignment (None where the back end does not say)."""
    try:
        analysis = compiled.memory_analysis()
    except Exception:  # noqa: BLE001 - a back end without the analysis: nothing to check
        return None
    if analysis is None:
        return None
    return int(analysis.temp_size_in_bytes + analysis.output_size_in_bytes - analysis.alias_size_in_bytes)


def memory_shortfall(need: int | None, stats: dict | None) -> str | None:
    """One line naming the fix where a step needing `need` bytes beside its arguments does not fit in
    what the device's pool has free (`stats`: Device.memory_stats(), None on the CPU), else None."""
    if need is None or not stats or "bytes_limit" not in stats:
        return None
    limit, in_use = stats["bytes_limit"], stats.get("bytes_in_use", 0)
    if need <= limit - in_use:
        return None
    fraction = os.environ.get("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.75")
    fix = "lower --config.global_batch"
    if float(fraction) < float(MEMORY_FRACTION):
        fix = f"set XLA_PYTHON_CLIENT_MEM_FRACTION={MEMORY_FRACTION} (it is {fraction}) or {fix}"
    gib = 2.0**30
    return (
        f"out of memory: the step needs {need / gib:.1f} GiB beside the {in_use / gib:.1f} GiB in use, "
        f"JAX's pool holds {limit / gib:.1f} GiB: {fix}"
    )


# ------------------------------------------------------------------------------------------ the run


class Results:
    """The JSON of --out, rewritten atomically after every change: meta, one entry per variant, check."""

    def __init__(self, path: str, meta: dict):
        self.path, self.meta = path, meta
        self.entries: dict[str, dict] = {}
        self.check: list[dict] = []

    def update(self, name: str, **fields) -> None:
        self.entries.setdefault(name, {"variant": name}).update(fields)
        self._ratios()
        self.write()

    def _ratios(self) -> None:
        for base in ("bf16", "fp8_mlperf"):
            ref = self.entries.get(base, {}).get("tokens_per_s")
            for entry in self.entries.values():
                if ref and entry.get("tokens_per_s"):
                    entry[f"vs_{base}"] = entry["tokens_per_s"] / ref

    def write(self) -> None:
        if not self.path:
            return
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(
                {"meta": self.meta, "variants": list(self.entries.values()), "check": self.check}, f, indent=1
            )
        os.replace(tmp, self.path)


def first_line(error: BaseException) -> str:
    text = str(error).strip()
    return f"{type(error).__name__}: {text.splitlines()[0] if text else ''}"


def failure_reason(shared: Setup, variant: Variant, error: BaseException) -> str:
    """One line: the error's first, after the cause the variant finds in its step's program where it
    knows one (`Variant.explain`; XLA's GPU errors name no operation)."""
    reason = first_line(error)
    if variant.explain is None:
        return reason
    try:
        cause = variant.explain(step_program(shared, variant, state_for(shared, variant)))
    except Exception:  # noqa: BLE001 - no cause found: the error alone
        return reason
    return f"{cause}; the step failed: {reason}" if cause else reason


def prepare(shared: Setup, name: str, warmup: int, results: Results) -> Callable | None:
    """Builds the variant, compiles its step and runs `warmup` steps; records the first step's loss and
    gradient norm. Returns the compiled step, or None where it was skipped or failed (recorded with the
    reason)."""
    try:
        variant = make_variant(name, shared.config, shared.base)
    except Exception as e:  # noqa: BLE001 - a variant that cannot be built is a row that says so
        print(f"FAILED {name}: {first_line(e)}", flush=True)
        results.update(name, status="failed", reason=first_line(e))
        return None
    base = {"family": variant.family, "numerics": variant.numerics}
    if variant.skip:
        print(f"SKIPPED {name}: {variant.skip}", flush=True)
        results.update(name, **base, status="skipped", reason=variant.skip)
        return None
    try:
        state = state_for(shared, variant)
        start = time.perf_counter()
        compiled = compile_step(shared, variant, state)
        compile_s = time.perf_counter() - start
        need = step_buffers(compiled)
        fields = {"compile_s": compile_s, "step_buffers_gib": None if need is None else need / 2.0**30}
        shortfall = memory_shortfall(need, jax.devices()[0].memory_stats())
        if shortfall:  # not run: an allocation that fails can leave buffers behind (release_buffers)
            print(f"FAILED {name}: {shortfall}", flush=True)
            results.update(name, **base, **fields, status="failed", reason=shortfall)
            return None
        first = warm_up(compiled, state, shared, warmup)
    except Exception as e:  # noqa: BLE001 - a variant that fails is a row that says so; the others go on
        reason = failure_reason(shared, variant, e)
        print(f"FAILED {name}: {reason}", flush=True)
        results.update(name, **base, status="failed", reason=reason)
        release_buffers()
        return None
    finite = all(math.isfinite(v) for v in first.values())
    results.update(name, **base, **fields, status="warm", first_step=first, finite=finite)
    print(f"{name}: compiled in {compile_s:.1f} s, first loss {first['loss']:.4f}", flush=True)
    if not finite:  # timed like the others; the table says so (a peer's NaN is its finding, not a crash)
        print(f"NOT FINITE {name}: first step {first}", flush=True)
    return functools.partial(compiled, state, shared.batch, shared.quant_key)


def warm_up(compiled, state: TrainState, shared: Setup, warmup: int) -> dict:
    """`warmup` steps (at least one); the first one's loss and gradient norm, as Python floats."""
    for i in range(max(warmup, 1)):
        _, metrics = compiled(state, shared.batch, shared.quant_key)
        metrics = jax.device_get(metrics)
        if i == 0:
            first = {"loss": float(metrics["loss"]), "grad_norm": float(metrics["grad_norm"])}
    return first


def release_buffers() -> None:
    """Frees the device buffers nothing references any more. A failed step's exception holds frames of
    the call, and through them possibly its outputs (at 1B the new state, 13.2 GiB), in reference
    cycles that only the cycle collector breaks: on the H100 each failed step left about that much more
    in use, until the later ones failed for want of 1 GiB. Collected before the next program runs."""
    gc.collect()


def time_rounds(steps: dict[str, Callable], rounds: int, tokens_per_step: int, results: Results) -> None:
    """`rounds` rounds of one synchronised step per variant, in turn; each entry's median so far."""
    times: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in list(steps.items()):
            start = time.perf_counter()
            try:
                jax.block_until_ready(step())
            except Exception as e:  # noqa: BLE001 - recorded; the other variants go on
                print(f"FAILED {name} while timed: {first_line(e)}", flush=True)
                results.update(name, status="failed", reason=first_line(e))
                del steps[name]
                release_buffers()
                continue
            times[name].append(time.perf_counter() - start)
            median = statistics.median(times[name])
            done = len(times[name]) == rounds
            results.update(
                name,
                status="done" if done else "timing",
                step_s=median,
                step_times_s=times[name],
                tokens_per_s=tokens_per_step / median,
            )


# ------------------------------------------------------------------------------------------ --check


def contract_band(amax: np.ndarray, dtype) -> np.ndarray:
    """The blocks where qwix's floating-point ceil may part from the exact one: amax / 6 within two ulps
    (of `dtype`, at log2's magnitude) plus the quotient's rounding of a power of two, or below 6 * 2^-63
    (qwix's scale is 1 there)."""
    q = amax.astype(np.float64) / E2M1_MAX
    with np.errstate(divide="ignore"):
        log = np.log2(q)
    eps = float(jnp.finfo(dtype).eps)
    ulp = eps * 2.0 ** np.floor(np.log2(np.maximum(np.abs(log), 1.0)))
    near = np.abs(log - np.round(log)) <= 2 * ulp + 2 * eps * math.log2(math.e)
    return near | (q < 2.0**-63)


def qwix_quantize_check(name: str, x: jax.Array) -> dict:
    """fp4jax's quantize_mx (ceil) against qwix.quantize('mxfp4') of `x` along its last axis: differing
    blocks outside the contract band (must be 0) and inside it, max |difference| of the values."""
    import qwix

    ours = np.asarray(
        quantize_mx(x, axis=-1, elem="e2m1", block_size=MX_BLOCK, scale_mode="ceil").dequantize()
    )
    q = qwix.quantize(
        x, "mxfp4", channelwise_axes=tuple(range(x.ndim - 1)), tiled_axes={x.ndim - 1: MX_BLOCK}
    )
    theirs = np.asarray(qwix.dequantize(q).astype(jnp.float32))
    blocks = lambda a: a.reshape(*a.shape[:-1], -1, MX_BLOCK)  # noqa: E731
    differ = (blocks(ours).view(np.uint32) != blocks(theirs).view(np.uint32)).any(-1)
    amax = np.abs(blocks(np.asarray(x.astype(jnp.float32)))).max(-1)
    band = contract_band(amax, x.dtype)
    outside, inside = int((differ & ~band).sum()), int((differ & band).sum())
    return {
        "what": f"quantizer: {name}, {x.dtype} {tuple(x.shape)}",
        "blocks": int(differ.size),
        "band_blocks": int(band.sum()),
        "differ_outside_band": outside,
        "differ_in_band": inside,
        "max_abs_diff": float(np.abs(ours - theirs).max()),
        "bits_equal": outside + inside == 0,
        "contract_holds": outside == 0,
        "why": "" if outside + inside == 0 else BAND_WHY,
    }


BAND_WHY = (
    "qwix computes 2^ceil(log2(amax/6)) in the operand's dtype: where amax/6 lies within its rounding of a "
    "power of two the exponent is one off (the block's largest value then clips to 6, or the scale doubles)"
)


def edge_operand(rows: int, dtype) -> jax.Array:
    """Blocks whose amax is 6 * 2^k and its float32 neighbours, k in [-40, 40]: inside the band. Each
    block also holds 0.4 * amax / 6, which lands on different grid points under the two scales."""
    amax = []
    for k in range(-40, 41):
        value = np.float32(E2M1_MAX * 2.0**k)
        amax += [value, np.nextafter(value, np.float32(np.inf)), np.nextafter(value, np.float32(0))]
    amax = np.asarray(amax[: rows or None], np.float32)
    x = np.zeros((len(amax), MX_BLOCK), np.float32)
    x[:, 0], x[:, 1], x[:, 2] = amax, amax * np.float32(0.4 / E2M1_MAX), amax * np.float32(0.3)
    return jnp.asarray(x, dtype)


def qwix_gemm_check(x: jax.Array, w: jax.Array) -> dict:
    """One Fprop GEMM y = x W (a projection's dimension numbers) on float32 operands: fp4jax's
    mxfp4_full_ceil as the trainer resolves it against qwix.quantize + qwix.dot_general."""
    import qwix

    dims = (((x.ndim - 1,), (0,)), ((), ()))
    recipe, execution = resolve_execution(ceil_recipe())
    ours = np.asarray(jax.jit(lambda a, b: bind_recipe(recipe)(a, b, dims))(x, w), np.float32)
    qx = qwix.quantize(
        x, "mxfp4", channelwise_axes=tuple(range(x.ndim - 1)), tiled_axes={x.ndim - 1: MX_BLOCK}
    )
    qw = qwix.quantize(w, "mxfp4", channelwise_axes=(1,), tiled_axes={0: MX_BLOCK})
    theirs = np.asarray(jax.jit(lambda a, b: qwix.dot_general(a, b, dims))(qx, qw), np.float32)
    equal = bool(np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)))
    scale = float(np.abs(theirs).max()) or 1.0
    return {
        "what": f"Fprop GEMM, float32 {tuple(x.shape)} x {tuple(w.shape)}: fp4jax (back end "
        f"{execution.backend}) against qwix.dot_general",
        "max_abs_diff": float(np.abs(ours - theirs).max()),
        "max_rel_diff": float(np.abs(ours - theirs).max()) / scale,
        "bits_equal": equal,
        "why": "" if equal else GEMM_WHY,
    }


GEMM_WHY = (
    "the same quantized operands multiplied by different kernels (fp4jax's back end against qwix's "
    "dequantize-then-dot, or jax.nn.scaled_matmul on GPUs), whose float32 sums run in different orders"
)


def float32_step_check(shared: Setup) -> dict:
    """One step's loss and gradients with float32 activations, where the quantizers agree bit for bit:
    fp4jax's mxfp4_full_ceil against qwix_mxfp4, on the size's widths with at most 2 blocks and one
    sequence of the shared batch (the full model at float32 would not fit beside the timed state)."""
    cfg = shared.base.config
    cfg = dataclasses.replace(
        cfg, dtype="float32", n_layers=min(cfg.n_layers, 2), bf16_first_blocks=0, bf16_last_blocks=0
    )
    base = Llama(cfg, recipe="bf16")
    batch = {k: v[:1] for k, v in shared.batch.items()}
    with sharding_context(shared.mesh):
        params = nn.meta.unbox(jax.jit(base.init)(jax.random.key(shared.config.seed), batch["inputs"]))
    models = {"fp4jax": fp4jax_variant(CEIL_RECIPE_NAME, shared.config, base).model}
    models["qwix"] = qwix_variant(base).model
    got = {}
    for who, model in models.items():
        loss = lambda p, model=model: token_losses(model, p, {}, batch, None).mean()  # noqa: E731
        with sharding_context(shared.mesh):
            got[who] = jax.device_get(jax.jit(jax.value_and_grad(loss))(params["params"]))
    leaves = [jax.tree.leaves(got[who]) for who in ("fp4jax", "qwix")]
    pairs = [(np.asarray(a, np.float32), np.asarray(b, np.float32)) for a, b in zip(*leaves, strict=True)]
    equal = all(np.array_equal(a.view(np.uint32), b.view(np.uint32)) for a, b in pairs)
    return {
        "what": f"one step at float32 activations ({cfg.n_layers} blocks, 1 x {batch['inputs'].shape[1]} "
        f"tokens): loss and every gradient, {CEIL_RECIPE_NAME} against qwix_mxfp4",
        "loss": [float(got["fp4jax"][0]), float(got["qwix"][0])],
        "max_abs_diff": max(float(np.abs(a - b).max()) for a, b in pairs),
        "bits_equal": equal,
        "why": "" if equal else GEMM_WHY,
    }


def bfloat16_step_check(results: Results) -> dict | None:
    """The timed variants' first step (bfloat16 activations): mxfp4_full_ceil against qwix_mxfp4."""
    ours, theirs = (results.entries.get(n, {}).get("first_step") for n in (CEIL_RECIPE_NAME, "qwix_mxfp4"))
    if not ours or not theirs:
        return None
    equal = ours == theirs
    return {
        "what": f"first timed step (bfloat16 activations): loss and gradient norm, {CEIL_RECIPE_NAME} "
        "against qwix_mxfp4",
        "loss": [ours["loss"], theirs["loss"]],
        "grad_norm": [ours["grad_norm"], theirs["grad_norm"]],
        "max_abs_diff": max(abs(ours[k] - theirs[k]) for k in ours),
        "bits_equal": equal,
        "why": ""
        if equal
        else "not expected equal: qwix's ceil in bfloat16 parts from the exact one in the band's blocks "
        "(the bfloat16 quantizer rows), and the GEMMs may sum in different orders",
    }


WEIGHTS = "weights N(0, 0.02^2), rows along K"
EDGE = "amax at 6 * 2^k and its neighbours"


def bf16(x: jax.Array) -> jax.Array:
    return x.astype(jnp.bfloat16)


def run_check(shared: Setup, results: Results) -> None:
    """The --check rows (module docstring), into results.check and stdout."""
    missing = qwix_missing()
    if missing:
        results.check.append({"what": "qwix bit-equality", "skipped": missing})
        print(f"SKIPPED check: {missing}", flush=True)
        results.write()
        return
    cfg = shared.base.config
    rows = min(shared.config.global_batch * shared.config.seq_len, 4096)
    key_x, key_w = jax.random.split(jax.random.key(shared.config.seed))
    x = jax.random.normal(key_x, (rows, cfg.d_model), jnp.float32)
    w = jax.random.normal(key_w, (cfg.d_model, cfg.d_ff), jnp.float32) * 0.02
    checks = [
        ("quantizer, float32 activations", lambda: qwix_quantize_check("activations N(0, 1)", x)),
        ("quantizer, float32 weights", lambda: qwix_quantize_check(WEIGHTS, w.T)),
        ("quantizer, bfloat16 activations", lambda: qwix_quantize_check("activations N(0, 1)", bf16(x))),
        ("quantizer, bfloat16 weights", lambda: qwix_quantize_check(WEIGHTS, bf16(w.T))),
        ("quantizer, the band's edge", lambda: qwix_quantize_check(EDGE, edge_operand(0, jnp.float32))),
        ("Fprop GEMM", lambda: qwix_gemm_check(x.reshape(1, rows, cfg.d_model), w)),
        ("one step at float32 activations", lambda: float32_step_check(shared)),
        ("first timed step", lambda: bfloat16_step_check(results)),
    ]
    for what, check in checks:
        try:
            row = check()
        except Exception as e:  # noqa: BLE001 - a check that cannot run is a row that says so
            row = {"what": what, "error": first_line(e)}
        if row is not None:
            results.check.append(row)
            print(f"check: {json.dumps(row)}", flush=True)
            results.write()


# ------------------------------------------------------------------------------------------ the table


def to_markdown(results: Results, command: str) -> str:
    m = results.meta
    lines = [
        harness.heading("Peers side by side: the train step", m["devices"]),
        "",
        f"Model `{m['size']}` ({m['params']:,} params), batch {m['global_batch']} x seq {m['seq_len']}, "
        f"remat `{m['remat']}`, blocks {m['blocks']}; the same initial state and batch for every row; "
        f"medians of {m['steps']} interleaved steps. Command: `{command}`",
        "",
        "| variant | family | tokens/s | vs bf16 | vs fp8_mlperf | step s | first loss | compile s "
        "| numerics / why not run |",
        "|---|---|---:|---:|---:|---:|---:|---:|---|",
    ]
    fmt = lambda v, f: "-" if v is None else format(v, f)  # noqa: E731
    for e in results.entries.values():
        loss = e.get("first_step", {}).get("loss")
        note = e.get("reason") or e.get("numerics", "")
        if e.get("status") in ("skipped", "failed"):
            note = f"**{e['status']}**: {note}"
        elif e.get("finite") is False:
            values = ", ".join(f"{k} {v:.4g}" for k, v in e["first_step"].items())
            note = f"**not finite** (first step: {values}): {note}"
        lines.append(
            f"| {e['variant']} | {e.get('family', '')} | {fmt(e.get('tokens_per_s'), ',.0f')} "
            f"| {fmt(e.get('vs_bf16'), '.3f')} | {fmt(e.get('vs_fp8_mlperf'), '.3f')} "
            f"| {fmt(e.get('step_s'), '.3f')} "
            f"| {fmt(loss, '.4f')} | {fmt(e.get('compile_s'), '.1f')} | {note} |"
        )
    if results.check:
        lines += ["", "Bit-equality with qwix (`--check`):", ""]
        for c in results.check:
            if "skipped" in c or "error" in c:
                lines.append(
                    f"- {c['what']}: **{'skipped' if 'skipped' in c else 'failed'}**: "
                    f"{c.get('skipped') or c.get('error')}"
                )
                continue
            verdict = "bits equal" if c["bits_equal"] else f"not equal: {c['why']}"
            detail = f" (max |diff| {c['max_abs_diff']:.3g})" if "max_abs_diff" in c else ""
            band = ""
            if "differ_outside_band" in c:
                band = (
                    f"; {c['differ_in_band']} of {c['band_blocks']} band blocks differ, "
                    f"{c['differ_outside_band']} outside the band "
                    f"(contract {'holds' if c['contract_holds'] else 'BROKEN'})"
                )
            lines.append(f"- {c['what']}: {verdict}{detail}{band}")
    return "\n".join(lines) + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", choices=tuple(SIZES), default="1b")
    parser.add_argument("--config", default="", help="a config file instead of the size's")
    parser.add_argument("--variants", default=",".join(DEFAULT_VARIANTS))
    parser.add_argument("--warmup", type=int, default=2, help="untimed steps per variant after compiling")
    parser.add_argument("--steps", type=int, default=5, help="timed rounds (one step per variant each)")
    parser.add_argument("--check", action="store_true", help="bit-equality with qwix; adds mxfp4_full_ceil")
    parser.add_argument("--out", default="", help="JSON, rewritten as each variant progresses")
    parser.add_argument(
        "--compile-budget-s", type=float, default=COMPILE_BUDGET_S, help="no variant starts compiling later"
    )
    args, overrides = parser.parse_known_args()
    started = time.perf_counter()
    memory_fraction = default_memory_fraction(os.environ)  # before JAX's first use of the device
    names = [n for n in args.variants.split(",") if n]
    if args.check and CEIL_RECIPE_NAME not in names:  # beside qwix's row, the pair the check compares
        at = names.index("qwix_mxfp4") + 1 if "qwix_mxfp4" in names else len(names)
        names.insert(at, CEIL_RECIPE_NAME)
    check_names(names)
    config_path, size_overrides = SIZES[args.size]
    config = load_config(args.config or config_path, [*size_overrides, *overrides])
    print(f"xla options: {setup.apply_xla_options(config)}", flush=True)  # as the trainer's command line
    shared = build_setup(config)
    cfg = shared.base.config
    meta = {
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        "jax": jax.__version__,
        "size": args.size,
        "params": int(sum(x.size for x in jax.tree.leaves(shared.state.params))),
        "global_batch": config.global_batch,
        "seq_len": config.seq_len,
        "remat": cfg.remat,
        "blocks": "scanned" if cfg.scan_layers else "inline",
        "warmup": args.warmup,
        "steps": args.steps,
        "compile_budget_s": args.compile_budget_s,
        "memory_fraction": memory_fraction,
    }
    results = Results(args.out, meta)
    steps = {}
    for name in names:
        if time.perf_counter() - started > args.compile_budget_s:
            reason = f"not compiled: --compile-budget-s {args.compile_budget_s:.0f} s spent before it"
            print(f"SKIPPED {name}: {reason}", flush=True)
            results.update(name, status="skipped", reason=reason)
            continue
        step = prepare(shared, name, args.warmup, results)
        if step is not None:
            steps[name] = step
    time_rounds(steps, args.steps, config.global_batch * config.seq_len, results)
    steps.clear()  # the compiled steps and their closures, before the check runs its own programs
    release_buffers()
    if args.check:
        run_check(shared, results)
    command = " ".join(["python benchmarks/bench_peers.py", *sys.argv[1:]])
    harness.emit(to_markdown(results, command))


if __name__ == "__main__":
    main()
