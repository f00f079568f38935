"""Per-GEMM quantization diagnostics: what a recipe does to each GEMM of each linear layer.

Method (docs/diagnostics.md):
  1. Capture. One high-precision forward and backward of the model (recipe "bf16", the model's own
     dtype) on a batch records, for every quantized linear layer (q, k, v, o, gate, up, down of every
     block), the operands its three GEMMs see: x (input), W (kernel, cast to the compute dtype) and dy
     (the cotangent of the layer's output under the mean next-token loss). They are recorded through
     `nn.intercept_methods` on `QuantDotGeneral` (sow for x and W, a zero perturbation of the output for
     dy), already in mx_dot_general's canonical (batch, free, contraction) layout. The model runs with
     scan_layers=False (same params, unstacked), so each block is its own module.
  2. Recompute. Each GEMM is re-run from those operands by mx_dot_general's own per-GEMM functions
     (quantized_dot.rotated_gemm_operands: pad, rotate both operands, quantize along the contraction
     axis; multiply_gemm_operands: float32 accumulation on the `emulate` back end), and compared with
     the exact GEMM of the same unrotated operands (exact products summed in float32:
     `reference_output`):

        GEMM    operands (a, c)    contraction   output
        fprop   x, W               K             y  = x W
        dgrad   dy, W              N             dx = dy W^T
        wgrad   x, dy              T (tokens)    dW = x^T dy

So every figure is the error one GEMM adds given exact inputs (local error; errors propagated from
other quantized layers are not included), and every recipe sees the same operands.

Quantities per GEMM (`gemm_stats`): out_rel_err = ||out - ref|| / ||ref||, out_cos; per quantized
operand (named x, w, dy), measured in the basis the GEMM quantizes in (after the rotation, against the
rotated unquantized operand): rel_err, cos, flush (fraction of non-zero inputs that quantize to 0), sat
(fraction of non-zero inputs beyond the element range: |x| > max_elem * 2^e for MX, |x * scale| > max
for FP8, |x| > 6 s_b S_dec for NVFP4), exp_min / exp_max (block scale exponents of non-zero MX blocks;
NVFP4: floor(log2(s_b S_dec))), fold_flush (E2M1 and E2M3 MX only: fraction of non-zero blocks the fp8
back end's fold into float8_e4m3fn rows would flush, fold.py). For GEMMs
that draw random numbers (stochastic rounding, random Hadamard signs), over n_draws draws:
out_bias_rel = ||mean - ref|| / ||ref||, out_bias_se = sqrt(sum var / n) / ||ref|| (the value
out_bias_rel takes when the rounding is unbiased: the noise floor of the mean of n draws),
out_bias_net = sqrt(max(out_bias_rel^2 - out_bias_se^2, 0)) (the bias with that noise floor removed),
out_var_rel = sum var / ||ref||^2.

Delayed FP8 scaling is measured with current scaling (the probe has no amax history).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax import traverse_util

from fp4jax import xla_flags
from fp4jax.models.llama import Llama, LlamaConfig, block_segments, unstack_layer_params
from fp4jax.ops import GEMMS, GemmSpec, QuantDotGeneral, QuantSpec, Recipe, get_elem_format, get_recipe
from fp4jax.ops.kernels.fold import count_fold_flushes, is_foldable
from fp4jax.ops.quantize import ldexp_exact
from fp4jax.ops.quantized_dot import multiply_gemm_operands, operand_layouts, rotated_gemm_operands, to_bfc

__all__ = [
    "GEMMS",
    "GEMM_INDEX",
    "LAYER_KINDS",
    "OPERANDS",
    "OPERAND_NAMES",
    "OUTPUT_NAMES",
    "LayerOperands",
    "capture_model",
    "capture_operands",
    "gemm_operands",
    "gemm_stats",
    "high_precision_layers",
    "layer_key",
    "layer_recipes",
    "layer_stats",
    "make_training_probe",
    "operand_stats",
    "per_block_params",
    "quantized_output",
    "record_operands",
    "recorded_loss",
    "reference_output",
    "summarize",
]

GEMM_INDEX = {g: i for i, g in enumerate(GEMMS)}  # mx_dot_general folds its key with this per GEMM
OPERAND_NAMES = {"fprop": ("x", "w"), "dgrad": ("dy", "w"), "wgrad": ("x", "dy")}
OUTPUT_NAMES = {"fprop": "y", "dgrad": "dx", "wgrad": "dW"}
LAYER_KINDS = ("q", "k", "v", "o", "gate", "up", "down")
DIAG_BACKEND = "emulate"  # the reference numerics; `native` is tested equal to it

OPERANDS = "diag_operands"  # the collection record_operands sows x and W into
_COTANGENTS = "diag_cotangents"  # zero perturbations of each layer's output; their gradient is dy
_EXP_SENTINEL = 1 << 20


# ----------------------------------------------------------------------------------------------------
# capture


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class LayerOperands:
    """One linear layer's GEMM operands in canonical layout: x (B, M, K), w (B, N, K), dy (B, M, N)."""

    x: jax.Array
    w: jax.Array
    dy: jax.Array


def record_operands(next_fun, args, kwargs, context, *, perturb: bool = True):
    """Interceptor (nn.intercept_methods): sows each QuantDotGeneral call's operands into OPERANDS as x and
    w in canonical (B, F, C) layout, and with `perturb` tags its output y with a zero perturbation (in the
    private cotangents collection) whose gradient is dy. Other modules' methods run unchanged."""
    module = context.module
    if not (isinstance(module, QuantDotGeneral) and context.method_name == "__call__"):
        return next_fun(*args, **kwargs)
    lhs, rhs, dimension_numbers = args[:3]
    lhs_layout, rhs_layout = operand_layouts(lhs.shape, rhs.shape, dimension_numbers)
    module.sow(OPERANDS, "x", to_bfc(lhs, lhs_layout))
    module.sow(OPERANDS, "w", to_bfc(rhs, rhs_layout))
    out = next_fun(*args, **kwargs)
    return module.perturb("y", out, collection=_COTANGENTS) if perturb else out


def per_block_params(params: Any, model_cfg: LlamaConfig) -> dict:
    """Unboxed params with one `block_{i}` entry per block, whether they were scanned or not."""
    params = nn.meta.unbox(params)
    if any(key.startswith("blocks_") for key in params):
        return unstack_layer_params(params, model_cfg)
    return params


def _capture_attention(option: str) -> str:
    """The attention kernel for the capture: the model's, except under XLA's deterministic GPU ops.

    With --xla_gpu_deterministic_ops (the GPU test lane sets it) XLA fails to compile this program when it
    holds cuDNN flash attention (jax 0.11.2 on an H200: `IndexError: absl::container_internal::raw_hash_map<>
    ::at`; either change alone compiles: benchmarks/gpu_repro_diagnostics.py). The capture measures the
    GEMMs, whose operands XLA's attention changes only by rounding, so it takes XLA's attention there.
    """
    deterministic = xla_flags.boolean(xla_flags.DETERMINISTIC_OPS) is True
    return "xla" if deterministic and option in ("auto", "cudnn") else option


def capture_model(model_cfg: LlamaConfig) -> Llama:
    """The model the capture runs: recipe bf16, blocks unscanned (each its own module, taking the params
    as per_block_params gives them), the capture's attention (_capture_attention)."""
    attention = _capture_attention(model_cfg.attention)
    return Llama(dataclasses.replace(model_cfg, scan_layers=False, attention=attention), recipe="bf16")


def recorded_loss(model: Llama, variables: dict, batch: dict, mutable: list[str], *, perturb: bool = True):
    """(mean next-token cross-entropy of `batch`, the sown collections `mutable`) of `model` run under
    record_operands (`perturb` as there). `batch` has int32 "inputs" and "targets" [B, T]. The loss is
    the training loss, so the dy a perturbation records is the cotangent training differentiates."""
    with nn.intercept_methods(functools.partial(record_operands, perturb=perturb)):
        logits, sown = model.apply(variables, batch["inputs"], mutable=mutable)
    losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), batch["targets"])
    return losses.mean(), sown


def capture_operands(model_cfg: LlamaConfig, params: Any, batch: dict) -> tuple[jax.Array, dict]:
    """(loss, {(layer, kind): LayerOperands}) from one forward/backward of `batch` by capture_model, the
    loss and dy as recorded_loss gives them. Pure and jit-able."""
    model, params = capture_model(model_cfg), per_block_params(params, model_cfg)

    def run(cotangents):
        variables = {"params": params} if cotangents is None else {"params": params, _COTANGENTS: cotangents}
        mutable = [OPERANDS] if cotangents is not None else [OPERANDS, _COTANGENTS]
        return recorded_loss(model, variables, batch, mutable)

    shapes = jax.eval_shape(run, None)[1][_COTANGENTS]
    zeros = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), shapes)
    loss, vjp, sown = jax.vjp(run, zeros, has_aux=True)
    (cotangents,) = vjp(jnp.ones_like(loss))
    return loss, _group_by_layer(sown[OPERANDS], cotangents)


def _group_by_layer(operands: dict, cotangents: dict) -> dict[tuple[int, str], LayerOperands]:
    """Sown trees keyed by module path -> {(layer index, kind)}; a path reads block_i/.../kind/<dot>/name."""
    found: dict[tuple[int, str], dict] = {}
    for tree in (operands, cotangents):
        for path, value in traverse_util.flatten_dict(tree).items():
            layer = int(path[0].removeprefix("block_"))
            kind = path[-3]
            found.setdefault((layer, kind), {})[path[-1]] = value[0] if isinstance(value, tuple) else value
    out = {}
    for (layer, kind), v in sorted(found.items()):
        x, w = v["x"], v["w"]
        out[(layer, kind)] = LayerOperands(x=x, w=w, dy=v["y"].reshape(x.shape[:2] + w.shape[1:2]))
    return out


# ----------------------------------------------------------------------------------------------------
# one GEMM, as mx_dot_general computes it


def gemm_operands(ops: LayerOperands, gemm: str) -> tuple[jax.Array, jax.Array]:
    """(a, c) with out[b, m, n] = sum_k a[b, m, k] c[b, n, k] for `gemm` (the table in the module doc)."""
    swap = lambda t: jnp.swapaxes(t, 1, 2)  # noqa: E731
    if gemm == "fprop":
        return ops.x, ops.w
    if gemm == "dgrad":
        return ops.dy, swap(ops.w)
    if gemm == "wgrad":
        return swap(ops.x), swap(ops.dy)
    raise ValueError(f"unknown GEMM {gemm!r}: use one of {', '.join(GEMMS)}")


def quantized_output(a, c, gemm: GemmSpec, key) -> jax.Array:
    """The GEMM's float32 output under `gemm`: equal to what mx_dot_general computes with this key."""
    operands = rotated_gemm_operands(a, c, gemm, key)
    return multiply_gemm_operands(operands.qa, operands.qc, gemm, backend=DIAG_BACKEND)


def reference_output(a, c) -> jax.Array:
    """The high-precision GEMM: the exact products of the operands, summed in float32.

    Two bfloat16 operands (what the model's layers pass) multiply exactly in float32, so their GEMM with
    float32 accumulation equals the float32 GEMM at precision HIGHEST up to summation order, and runs on
    the bf16 matrix units instead of the far slower float32 path; other dtypes go through float32 at
    precision HIGHEST.
    """
    if a.dtype == c.dtype == jnp.bfloat16:
        return jnp.einsum("bmk,bnk->bmn", a, c, preferred_element_type=jnp.float32)
    return jnp.einsum(
        "bmk,bnk->bmn", a.astype(jnp.float32), c.astype(jnp.float32), precision=jax.lax.Precision.HIGHEST
    )


# ----------------------------------------------------------------------------------------------------
# statistics


def _ratio(num, den):
    """num / den, 0 for 0/0 (an all-zero tensor reproduced exactly), inf for x/0."""
    safe = jnp.where(den > 0, den, 1.0)
    return jnp.where(den > 0, num / safe, jnp.where(num > 0, jnp.inf, 0.0))


def _compare(q: jax.Array, ref: jax.Array) -> dict[str, jax.Array]:
    """Squared norms of the error and the reference, and the two derived scores (float32 scalars)."""
    q, ref = q.astype(jnp.float32), ref.astype(jnp.float32)
    err_sq = jnp.sum(jnp.square(q - ref))
    ref_sq = jnp.sum(jnp.square(ref))
    q_sq = jnp.sum(jnp.square(q))
    cos = _ratio(jnp.sum(q * ref), jnp.sqrt(ref_sq) * jnp.sqrt(q_sq))
    cos = jnp.where((ref_sq == 0) & (q_sq == 0), 1.0, cos)
    return {"err_sq": err_sq, "ref_sq": ref_sq, "rel_err": jnp.sqrt(_ratio(err_sq, ref_sq)), "cos": cos}


def operand_stats(used: jax.Array, q: Any, spec: QuantSpec) -> dict[str, jax.Array]:
    """Quantization statistics of one operand; `used` is its unquantized value in the GEMM's basis.

    flush and sat are fractions of the non-zero elements of `used`; exp_min / exp_max range over MX
    blocks holding a non-zero element (0 when there is none).

    `spec` quantizes (spec.format is not None); its FORMATS row picks the statistics: one scale per
    tensor (block_size None) gives sat only; block scales under a tensor scale get _nvfp4_stats; E8M0
    blocks get sat, the exponent range and, where the fp8 back end folds them, fold_flush.
    """
    used = used.astype(jnp.float32) * spec.prescale  # what the elements represent
    deq = q.dequantize(jnp.float32)
    stats = _compare(deq, used)
    stats = {"rel_err": stats["rel_err"], "cos": stats["cos"]}
    nonzero = used != 0
    count = jnp.maximum(jnp.sum(nonzero), 1).astype(jnp.float32)
    stats["flush"] = jnp.sum(nonzero & (deq == 0)) / count
    fmt = get_elem_format(spec.elem)
    if spec.format.block_size is None:  # one scale per tensor (FP8): no blocks, so no binades to range over
        stats["sat"] = jnp.sum(jnp.abs(used * q.scale) > fmt.max_value) / count
        return stats
    if spec.format.tensor_scale is not None:  # block scales under a per-tensor scale (NVFP4)
        return {**stats, **_nvfp4_stats(used, q, nonzero, count)}
    exponent = q.scale_exponent()  # (..., blocks)
    limit = ldexp_exact(jnp.full(exponent.shape, fmt.max_value, jnp.float32), exponent)
    limit = jnp.repeat(limit, q.block_size, axis=-1)  # a NaN block (exponent 128) gives inf: no clip
    stats["sat"] = jnp.sum(jnp.abs(used) > limit) / count
    block_nonzero = jnp.any(nonzero.reshape(*exponent.shape, q.block_size), axis=-1)
    any_block = jnp.any(block_nonzero)
    exp_min = jnp.min(jnp.where(block_nonzero, exponent, _EXP_SENTINEL))
    exp_max = jnp.max(jnp.where(block_nonzero, exponent, -_EXP_SENTINEL))
    stats["exp_min"] = jnp.where(any_block, exp_min, 0).astype(jnp.float32)
    stats["exp_max"] = jnp.where(any_block, exp_max, 0).astype(jnp.float32)
    if is_foldable(q):
        blocks = jnp.maximum(jnp.sum(block_nonzero), 1).astype(jnp.float32)
        stats["fold_flush"] = count_fold_flushes(q).astype(jnp.float32) / blocks
    return stats


def _nvfp4_stats(used, q, nonzero, count) -> dict[str, jax.Array]:
    """sat (|x| > 6 s_b S_dec: beyond its block's range) and exp_min / exp_max (floor(log2(s_b S_dec)),
    the block scale's binade, over blocks holding a non-zero element) of an NVFP4 operand."""
    block_scale = q.element_scales() * q.decode_scale()
    limit = jnp.where(jnp.isnan(block_scale), jnp.inf, 6.0 * block_scale)
    stats = {"sat": jnp.sum(jnp.abs(used) > limit) / count}
    binade = jnp.floor(jnp.log2(jnp.where(nonzero & (block_scale > 0), block_scale, 1.0)))
    has = nonzero & (block_scale > 0)
    stats["exp_min"] = jnp.where(jnp.any(has), jnp.min(jnp.where(has, binade, _EXP_SENTINEL)), 0.0)
    stats["exp_max"] = jnp.where(jnp.any(has), jnp.max(jnp.where(has, binade, -_EXP_SENTINEL)), 0.0)
    return {k: v.astype(jnp.float32) for k, v in stats.items()}


def _draw_stats(a, c, gemm: GemmSpec, key, ref, ref_sq, n_draws: int) -> dict[str, jax.Array]:
    """Bias and variance of the output over n_draws keys fold_in(key, d) (sequential: one output live)."""

    def body(carry, d):
        total, total_sq = carry
        err = quantized_output(a, c, gemm, jax.random.fold_in(key, d)) - ref
        return (total + err, total_sq + jnp.square(err)), None

    zeros = jnp.zeros_like(ref)
    (total, total_sq), _ = jax.lax.scan(body, (zeros, zeros), jnp.arange(n_draws))
    mean = total / n_draws
    var_sum = jnp.sum(jnp.maximum(total_sq - n_draws * jnp.square(mean), 0.0)) / (n_draws - 1)
    bias_sq, noise_sq = _ratio(jnp.sum(jnp.square(mean)), ref_sq), _ratio(var_sum / n_draws, ref_sq)
    return {
        "out_bias_rel": jnp.sqrt(bias_sq),
        "out_bias_se": jnp.sqrt(noise_sq),
        # E||mean - ref||^2 = ||bias||^2 + sum var / n: subtracting the noise leaves an unbiased estimate.
        "out_bias_net": jnp.sqrt(jnp.maximum(bias_sq - noise_sq, 0.0)),
        "out_var_rel": _ratio(var_sum, ref_sq),
    }


def gemm_stats(
    a, c, gemm: GemmSpec, key=None, *, n_draws: int = 0, names: tuple[str, str] = ("a", "c")
) -> dict[str, jax.Array]:
    """Every statistic of one GEMM (module doc); float32 scalars, operand ones prefixed by `names`.

    `key` is the GEMM's key (required when gemm.needs_key). out_err_sq / out_ref_sq are kept so that
    several GEMMs can be pooled into one relative norm. Bias/variance only when gemm.needs_key and
    n_draws >= 2.
    """
    if gemm.needs_key and key is None:
        raise ValueError("this GEMM rounds stochastically or draws random signs: pass key=...")
    ref = reference_output(a, c)
    operands = rotated_gemm_operands(a, c, gemm, key)
    used_a, used_c, qa, qc = operands.a, operands.c, operands.qa, operands.qc
    out = _compare(multiply_gemm_operands(qa, qc, gemm, backend=DIAG_BACKEND), ref)
    stats = {f"out_{k}": v for k, v in out.items()}
    for name, used, q, spec in zip(names, (used_a, used_c), (qa, qc), (gemm.lhs, gemm.rhs), strict=True):
        if spec.format is not None:  # a quantized operand
            stats.update({f"{name}_{k}": v for k, v in operand_stats(used, q, spec).items()})
    if gemm.needs_key and n_draws >= 2:
        stats.update(_draw_stats(a, c, gemm, key, ref, out["ref_sq"], n_draws))
    return stats


def layer_stats(ops: LayerOperands, recipe: Recipe, key=None, *, n_draws: int = 0) -> dict:
    """{gemm: {quantity: scalar}} for one linear layer; operand quantities named x_, w_, dy_.

    `key` is the layer's call key: GEMM g uses fold_in(key, GEMM_INDEX[g]), as in mx_dot_general.
    """
    out = {}
    for gemm_name in GEMMS:
        gemm = getattr(recipe, gemm_name)
        gemm_key = None if key is None else jax.random.fold_in(key, GEMM_INDEX[gemm_name])
        a, c = gemm_operands(ops, gemm_name)
        out[gemm_name] = gemm_stats(a, c, gemm, gemm_key, n_draws=n_draws, names=OPERAND_NAMES[gemm_name])
    return out


# ----------------------------------------------------------------------------------------------------
# a whole model


def layer_recipes(model_cfg: LlamaConfig, recipe: str | Recipe) -> list[Recipe]:
    """The recipe each block actually runs: "bf16" in the config's high-precision first/last blocks."""
    recipe, bf16 = get_recipe(recipe), get_recipe("bf16")
    out = []
    for start, stop, high_precision in block_segments(model_cfg):
        out += [bf16 if high_precision else recipe] * (stop - start)
    return out


def layer_key(key, layer: int, kind: str):
    """The call key of one layer's diagnostics: distinct per layer and kind."""
    return (
        None if key is None else jax.random.fold_in(jax.random.fold_in(key, layer), LAYER_KINDS.index(kind))
    )


def _signature(ops: LayerOperands) -> tuple:
    return tuple((a.shape, str(a.dtype)) for a in (ops.x, ops.w, ops.dy))


def model_stats(
    model_cfg: LlamaConfig, recipe: str | Recipe, operands: dict, key=None, *, n_draws: int = 0
) -> dict[tuple[int, str], dict[str, dict[str, jax.Array]]]:
    """{(layer, kind): {gemm: {quantity: scalar}}} for captured `operands` (capture_operands).

    Layers with the same operand shapes and recipe (every block's q and o, k and v, gate and up, ...)
    run under one lax.scan over their stacked operands, so a jitted probe compiles the statistics of
    each distinct GEMM shape once, not once per layer and kind.
    """
    recipes = layer_recipes(model_cfg, recipe)
    groups: dict[tuple, list[tuple[int, str]]] = {}
    for layer, kind in operands:
        groups.setdefault((_signature(operands[(layer, kind)]), recipes[layer]), []).append((layer, kind))
    out = {}
    for (_, group_recipe), items in groups.items():
        if group_recipe.needs_key and key is None:
            raise ValueError(f"recipe {group_recipe.name!r} draws random numbers: pass a key")
        stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *[operands[item] for item in items])
        keys = None
        if group_recipe.needs_key:
            keys = jnp.stack([layer_key(key, layer, kind) for layer, kind in items])

        def body(_, xs, group_recipe=group_recipe):
            ops, k = xs
            return None, layer_stats(ops, group_recipe, k, n_draws=n_draws)

        stats = jax.lax.scan(body, None, (stacked, keys))[1]
        for j, item in enumerate(items):
            out[item] = jax.tree.map(lambda v, j=j: v[j], stats)
    return out


def _reduction(quantity: str):
    if quantity.endswith("exp_min"):
        return jnp.min
    return jnp.max if quantity.endswith("exp_max") else jnp.mean


def summarize(stats: dict, high_precision_layers: tuple[int, ...] = ()) -> dict[str, jax.Array]:
    """Flat scalars from model_stats' output.

    "diag/<kind>/<gemm>/<quantity>": the mean over the layers that run the recipe (layers in
    `high_precision_layers`, the config's bf16 blocks, are left out unless every layer is one; exp_min /
    exp_max: the min / max). "diag/layer_<i>/wgrad/out_rel_err": the relative error of layer i's whole
    weight gradient, its seven kinds pooled: sqrt(sum err^2 / sum ref^2).
    """
    layers = sorted({layer for layer, _ in stats})
    counted = [i for i in layers if i not in high_precision_layers] or layers
    flat = {}
    for kind in LAYER_KINDS:
        for gemm in GEMMS:
            per_layer = [stats[(i, kind)][gemm] for i in counted if (i, kind) in stats]
            for name in per_layer[0] if per_layer else ():
                if name not in ("out_err_sq", "out_ref_sq"):
                    values = jnp.stack([s[name] for s in per_layer])
                    flat[f"diag/{kind}/{gemm}/{name}"] = _reduction(name)(values)
    for i in layers:
        wgrad = [s["wgrad"] for (layer, _), s in stats.items() if layer == i]
        err_sq, ref_sq = sum(w["out_err_sq"] for w in wgrad), sum(w["out_ref_sq"] for w in wgrad)
        flat[f"diag/layer_{i:02d}/wgrad/out_rel_err"] = jnp.sqrt(_ratio(err_sq, ref_sq))
    return flat


def high_precision_layers(model_cfg: LlamaConfig) -> tuple[int, ...]:
    """The blocks that run "bf16" whatever the recipe (config bf16_first_blocks / bf16_last_blocks)."""
    return tuple(i for start, stop, hp in block_segments(model_cfg) if hp for i in range(start, stop))


def make_training_probe(
    model: Llama, recipe: str | Recipe, *, n_draws: int = 4, max_sequences: int | None = None
):
    """probe(params, batch, key) -> {"diag/...": float32 scalar}: jitted, no side effects.

    params: the train state's params (scanned or not, boxed or not); batch: {"inputs", "targets"}
    int32[B, T] (one micro-batch; with `max_sequences`, only its first rows are used, which bounds the
    cost); key: a PRNG key for the recipe's random draws (ignored by deterministic recipes).
    `float(v)` / `jax.device_get` turns the values into Python floats.

    Cost, in units of one bf16 GEMM of the batch per linear layer: the capture is a forward and a
    backward without weight gradients (about 2, plus the remat recompute), then 3 reference and 3
    quantized GEMMs, plus 2 x n_draws per randomised GEMM, plus the element-wise quantization passes.
    """
    model_cfg, recipe = model.config, get_recipe(recipe)
    if max_sequences is not None and max_sequences < 1:
        raise ValueError(f"max_sequences must be >= 1 or None, got {max_sequences}")

    def probe(params, batch, key):
        if max_sequences is not None:
            batch = {k: v[:max_sequences] for k, v in batch.items()}
        _, operands = capture_operands(model_cfg, params, batch)
        stats = model_stats(model_cfg, recipe, operands, key if recipe.needs_key else None, n_draws=n_draws)
        return summarize(stats, high_precision_layers(model_cfg))

    return jax.jit(probe)
