"""Mechanism instruments: what one MXFP4 GEMM stage does to a gradient and to the update it drives (beside
gemm_errors, the per-GEMM diagnostics it builds on; its command line is `python -m fp4jax.study
instruments`, which reads a study run's checkpoints).

Run on a saved checkpoint (params and AdamW state), with ONE GEMM stage in MXFP4 at a time (`stage_recipe`:
fprop only, dgrad only or wgrad only; the other two GEMMs of every linear layer in bf16), against a bf16
shadow: the same params, the same batches, the `bf16` recipe. On K disjoint batches b_1..b_K (K even), with
g(b) the bf16 gradient of the mean next-token loss, g_q(b) the stage's, and e_k = g_q(b_k) - g(b_k):

  noise_ratio   sqrt(mean_k ||e_k||^2) / sqrt(mean_i ||g(b_{2i-1}) - g(b_{2i})||^2)
                the gradient's error against minibatch noise at this batch size (the denominator over the
                K/2 disjoint pairs); 1 means the stage moves the gradient as far as drawing another batch.
                (E||g(A) - g(B)||^2 = 2 tr(Sigma) / batch: the denominator is sqrt(2) times one batch's
                noise.)
  coherence     ||sum_k e_k|| / sqrt(sum_k ||e_k||^2), in [0, sqrt(K)]: 1 for zero-mean errors independent
                across batches, sqrt(K) for one fixed error (a bias: it does not average out over updates).
                For e_k = b + n_k with n_k independent, zero-mean, E||n_k||^2 = s^2:
                coherence^2 ~ (K ||b||^2 + s^2) / (||b||^2 + s^2).
  grad_coherence  the same of the bf16 gradients g(b_k): an error that follows the gradient (e ~ c g)
                has the gradient's coherence, so this is the reference an error's coherence is read against.
  update        u = AdamW's update (the run's own optax chain, clipping included) from the checkpoint's
                optimizer state: u_q from g_q(b_k), u from g(b_k). Pooled over the K batches:
                rel_err = sqrt(sum ||u_q - u||^2 / sum ||u||^2), cos = sum <u_q, u> / sqrt(sum ||u_q||^2
                sum ||u||^2), sign_agree = fraction of elements with sign(u_q) = sign(u) (0 counts as a
                sign).
  sqrt3_ratio   sqrt(sum_k ||g(b_k)||^2 / (3 sum_k ||e_k||^2)): Chmiel et al.'s criterion (B. Chmiel, M.
                Fishman, R. Banner, D. Soudry, "FP4 All the Way: Fully Quantized Training of LLMs", 2025,
                arXiv:2505.19115): quantized training stops helping once the gradient norm falls below about
                sqrt(3) times the quantization noise's norm (sigma_q sqrt(d) for d elements of per-element
                standard deviation sigma_q, which is ||e|| for zero-mean noise). Below 1: past the threshold.

Tokens per step: with `accumulate` A, each b_k is the mean gradient over A disjoint micro-batches of
`batch` sequences (gradient accumulation, no training step), so every figure above (the minibatch-noise
denominator, coherence, update error, sqrt3_ratio) is at A x batch x seq_len tokens per step without more
memory. A call reads K x A x batch sequences, each used once (micro-batch j of b_k is window k A + j).

Where the batches come from (`data`): the validation split (`config`, as python -m fp4jax.diagnose; the same
batches at every checkpoint), or `next`: per checkpoint, the K x A batches the run itself trains on next (its
training iterator restored from the checkpoint's data state), text the model has not yet seen. `next` is
for tokens per step beyond what the validation split holds (K x A x batch windows of it), and its noise
is the run's own minibatch noise; it refuses batches that would run into the next epoch (seen text).

Each figure is given per parameter group (`param_group`: the layer kinds q, k, v, o, gate, up, down over
all blocks, then embed, lm_head, norm) and for the whole model ("all"). The math is small pure functions
over pytrees (`sq_norms`, `update_sums`, `gradient_metrics`, `update_metrics`), driven by `measure`, which
takes the gradient and update functions as arguments: the tests plant known errors through the same code
the command line runs (`python -m fp4jax.study instruments`, docs/diagnostics.md).
"""

from __future__ import annotations

import dataclasses
import math
import os
from collections.abc import Callable, Sequence

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp

from fp4jax import diagnose, gemm_errors
from fp4jax.data.iterator import make_train_iterator
from fp4jax.models.llama import Llama, padded_vocab_size
from fp4jax.ops import GemmSpec, Recipe, resolve_execution
from fp4jax.ops.recipes import MXFP4
from fp4jax.report_files import save_png, write_json
from fp4jax.training import checkpoint, setup
from fp4jax.training.optimizer import make_optimizer
from fp4jax.training.state import make_init_fn, token_losses

__all__ = [
    "ALL",
    "DATA_MODES",
    "PANELS",
    "STAGES",
    "abstract_state",
    "accumulated",
    "coherence",
    "gradient_metrics",
    "group_micro_batches",
    "leaf_groups",
    "load_state",
    "next_training_batches",
    "loss_grad_fn",
    "measure",
    "param_group",
    "plot",
    "run_config",
    "run_instruments",
    "sq_norms",
    "stage_recipe",
    "table",
    "update_fn",
    "update_metrics",
    "update_sums",
    "verified_steps",
    "write",
]

STAGES = gemm_errors.GEMMS  # fprop, dgrad, wgrad
ALL = "all"
NEXT = "next"  # the run's own next training batches after each checkpoint (module docstring)
DATA_MODES = (*diagnose.DATA_MODES, NEXT)
UPDATE_SUMS = ("err_sq", "ref_sq", "q_sq", "dot", "same_sign", "count")


def stage_recipe(stage: str) -> Recipe:
    """The recipe with `stage`'s GEMM in MXFP4 (the study's operand, both sides, no rotation) and the
    other two GEMMs unquantized (bf16 operands, float32 accumulation): one stage's error, alone."""
    if stage not in STAGES:
        raise ValueError(f"unknown GEMM stage {stage!r}: use one of {', '.join(STAGES)}")
    return Recipe(**{stage: GemmSpec(MXFP4, MXFP4)}, name=f"mxfp4_{stage}_only")


# ----------------------------------------------------------------------------------------------------
# parameter groups and pure math over pytrees


def param_group(path: Sequence[str]) -> str:
    """A parameter's group from its path: the layer kind it belongs to (q ... down, over all blocks),
    "norm" for RMSNorm scales, else its top-level name (embed, lm_head)."""
    for name in path:
        if name in gemm_errors.LAYER_KINDS:
            return name
    if any(name.endswith("norm") for name in path):
        return "norm"
    return path[0]


def _key_name(key) -> str:
    for attr in ("key", "name", "idx"):
        if hasattr(key, attr):
            return str(getattr(key, attr))
    return str(key)


def leaf_groups(tree) -> list[str]:
    """param_group of every leaf of `tree`, in jax.tree.leaves order."""
    paths = jax.tree_util.tree_flatten_with_path(tree)[0]
    return [param_group([_key_name(k) for k in path]) for path, _ in paths]


def _group_sums(fn: Callable, *trees) -> dict:
    """{group: sum over the group's leaves of fn(*leaves)} and ALL (every leaf); fn returns a scalar or a
    dict of scalars (summed entry by entry)."""
    out: dict = {}
    for group, *leaves in zip(leaf_groups(trees[0]), *map(jax.tree.leaves, trees), strict=True):
        value = fn(*leaves)
        for name in (group, ALL):
            out[name] = value if name not in out else jax.tree.map(jnp.add, out[name], value)
    return out


def sq_norms(tree) -> dict:
    """{group: squared L2 norm of the group's leaves (float32)}, ALL included."""
    return _group_sums(lambda x: jnp.sum(jnp.square(x.astype(jnp.float32))), tree)


def update_sums(u_q, u_ref) -> dict:
    """{group: {err_sq, ref_sq, q_sq, dot, same_sign, count}}: the additive terms of update_metrics for
    one update pair (sums over the group's elements), so several batches pool by adding them."""

    def terms(q, r):
        q, r = q.astype(jnp.float32), r.astype(jnp.float32)
        return {
            "err_sq": jnp.sum(jnp.square(q - r)),
            "ref_sq": jnp.sum(jnp.square(r)),
            "q_sq": jnp.sum(jnp.square(q)),
            "dot": jnp.sum(q * r),
            "same_sign": jnp.sum(jnp.sign(q) == jnp.sign(r)).astype(jnp.float32),
            "count": jnp.asarray(r.size, jnp.float32),
        }

    return _group_sums(terms, u_q, u_ref)


def _div(num: float, den: float) -> float:
    """num / den as a Python float, NaN where den is 0 (undefined: reported as null in JSON)."""
    return float(num) / float(den) if float(den) > 0 else math.nan


def coherence(sum_sq, sq_sum) -> float:
    """||sum_k x_k|| / sqrt(sum_k ||x_k||^2) from sum_sq = ||sum_k x_k||^2 and sq_sum = sum_k ||x_k||^2."""
    return math.sqrt(_div(sum_sq, sq_sum))


def gradient_metrics(sums: dict, k: int) -> dict:
    """{group: {noise_ratio, coherence, err_norm, noise_norm, grad_norm, grad_coherence, sqrt3_ratio}}
    from per-group sums over K batches (K/2 pairs), each {group: scalar}: err_sq = sum_k ||e_k||^2,
    err_sum_sq = ||sum_k e_k||^2, noise_sq = sum over pairs of ||g(A) - g(B)||^2,
    grad_sq = sum_k ||g(b_k)||^2, grad_sum_sq = ||sum_k g(b_k)||^2 (module doc). Norms are root mean squares
    over batches (pairs for noise_norm)."""
    out = {}
    for group, err_sq in sums["err_sq"].items():
        err_ms, noise_ms = float(err_sq) / k, float(sums["noise_sq"][group]) / (k // 2)
        out[group] = {
            "noise_ratio": math.sqrt(_div(err_ms, noise_ms)),
            "coherence": coherence(sums["err_sum_sq"][group], err_sq),
            "err_norm": math.sqrt(err_ms),
            "noise_norm": math.sqrt(noise_ms),
            "grad_norm": math.sqrt(float(sums["grad_sq"][group]) / k),
            "grad_coherence": coherence(sums["grad_sum_sq"][group], sums["grad_sq"][group]),
            "sqrt3_ratio": math.sqrt(_div(sums["grad_sq"][group], 3.0 * float(err_sq))),
        }
    return out


def update_metrics(sums: dict) -> dict:
    """{group: {rel_err, cos, sign_agree}} from update_sums' terms (summed over batches)."""
    return {
        group: {
            "rel_err": math.sqrt(_div(s["err_sq"], s["ref_sq"])),
            "cos": _div(s["dot"], math.sqrt(float(s["q_sq"]) * float(s["ref_sq"]))),
            "sign_agree": _div(s["same_sign"], s["count"]),
        }
        for group, s in sums.items()
    }


# ----------------------------------------------------------------------------------------------------
# the measurement on one checkpoint


@jax.jit
def _batch_terms(g_q, g_ref, u_q, u_ref):
    """(e = g_q - g_ref, sq_norms(e), update_sums(u_q, u_ref)) for one batch and stage."""
    err = jax.tree.map(lambda q, r: q.astype(jnp.float32) - r.astype(jnp.float32), g_q, g_ref)
    return err, sq_norms(err), update_sums(u_q, u_ref)


def _add(total, value):
    return value if total is None else jax.tree.map(jnp.add, total, value)


def measure(grad_fn: Callable, update: Callable, params, opt_state, batches: Sequence, stages: Sequence[str]):
    """{stage: {"gradient": gradient_metrics, "update": update_metrics, "per_batch": {"err_sq": {group:
    [||e_k||^2 for each batch k]}}}} on one checkpoint.

    grad_fn(stage, params, batch) -> gradient pytree (stage None: the bf16 shadow); update(grads,
    opt_state, params) -> the optimizer's update pytree. `batches` are K disjoint batches, K even >= 2:
    pairs (b_1, b_2), (b_3, b_4), ... give the minibatch noise. Holds per stage one running sum of the
    errors (a gradient-sized pytree) and scalars.
    """
    k = len(batches)
    if k < 2 or k % 2:
        raise ValueError(f"the instruments need an even number >= 2 of batches, got {k}: set --batches")
    noise_sq = grad_sq = grad_sum = previous = None
    err_sq, err_sum, upd = ({s: None for s in stages} for _ in range(3))
    err_sq_each = {s: [] for s in stages}  # per batch, for intervals over batches (instrument_trend)
    for i, batch in enumerate(batches):
        g_ref = grad_fn(None, params, batch)
        u_ref = update(g_ref, opt_state, params)
        grad_sq, grad_sum = _add(grad_sq, sq_norms(g_ref)), _add(grad_sum, g_ref)
        if i % 2:
            noise_sq = _add(noise_sq, sq_norms(jax.tree.map(jnp.subtract, previous, g_ref)))
        previous = g_ref
        for stage in stages:
            g_q = grad_fn(stage, params, batch)
            err, e_sq, sums = _batch_terms(g_q, g_ref, update(g_q, opt_state, params), u_ref)
            err_sq[stage], err_sum[stage] = _add(err_sq[stage], e_sq), _add(err_sum[stage], err)
            upd[stage] = _add(upd[stage], sums)
            err_sq_each[stage].append(e_sq)
    shared = jax.device_get({"noise_sq": noise_sq, "grad_sq": grad_sq, "grad_sum_sq": sq_norms(grad_sum)})
    out = {}
    for stage in stages:
        sums = {**shared, **jax.device_get({"err_sq": err_sq[stage], "err_sum_sq": sq_norms(err_sum[stage])})}
        each = jax.device_get(err_sq_each[stage])
        out[stage] = {
            "gradient": gradient_metrics(sums, k),
            "update": update_metrics(jax.device_get(upd[stage])),
            "per_batch": {"err_sq": {g: [float(e[g]) for e in each] for g in each[0]}},
        }
    return out


def accumulated(grad_fn: Callable) -> Callable:
    """grad_fn over a group of micro-batches: (stage, params, micro_batches) -> the mean of grad_fn's
    gradients over them (gradient accumulation: one gradient-sized running sum, never a larger batch)."""

    def mean_grad(stage, params, micro_batches):
        total = None
        for micro in micro_batches:
            total = _add(total, grad_fn(stage, params, micro))
        return jax.tree.map(lambda x: x / len(micro_batches), total)

    return mean_grad


def group_micro_batches(micro_batches: Sequence, k: int, accumulate: int) -> list[tuple]:
    """K groups of `accumulate` micro-batches, group k = micro-batches k A .. k A + A - 1: each used once."""
    if accumulate < 1:
        raise ValueError(f"--accumulate {accumulate}: give an integer >= 1")
    if len(micro_batches) != k * accumulate:
        raise ValueError(f"{len(micro_batches)} micro-batches for {k} batches x {accumulate} accumulated")
    return [tuple(micro_batches[i * accumulate : (i + 1) * accumulate]) for i in range(k)]


def loss_grad_fn(model_cfg, recipe: Recipe) -> Callable:
    """Jitted (params, batch) -> gradient of the mean next-token loss (the training loss) under `recipe`."""
    model = Llama(model_cfg, recipe=recipe)

    def grads(params, batch):
        return jax.grad(lambda p: token_losses(model, p, {}, batch, None).mean())(params)

    return jax.jit(grads)


def update_fn(tx) -> Callable:
    """Jitted (grads, opt_state, params) -> the update optax transform `tx` would apply (state unchanged)."""
    return jax.jit(lambda grads, opt_state, params: tx.update(grads, opt_state, params)[0])


# ----------------------------------------------------------------------------------------------------
# checkpoints of a run directory


def verified_steps(run_dir: str, steps: Sequence[int] | None) -> list[int]:
    """The chosen checkpoint steps of the run (default: all), ascending, each found and its manifest
    verified once, before any is read (checkpoint.verified_run_step_dir, as a branch checks its source)."""
    steps = sorted(steps or checkpoint.run_step_dirs(run_dir, "--run"))
    for step in steps:
        checkpoint.verified_run_step_dir(
            run_dir, step, label="--run", fix="set --steps to some of them", bad_fix="choose another step"
        )
    return steps


def _manager(run_dir: str):
    """A read-only checkpoint manager over the run's checkpoints (the trainer's init_checkpoint lookup)."""
    return checkpoint.open_init_checkpoint(run_dir)[0]


def run_config(run_dir: str, step: int) -> ml_collections.ConfigDict:
    """The resolved config the run saved with checkpoint `step` (its meta item; see verified_steps)."""
    meta = _manager(run_dir).restore(step, args=ocp.args.Composite(meta=ocp.args.JsonRestore())).meta
    if not isinstance(meta, dict) or not isinstance(meta.get("config"), dict):
        raise ValueError(f"checkpoint {step} of {run_dir} holds no config: not a fp4jax run checkpoint")
    return ml_collections.ConfigDict(meta["config"])


def abstract_state(config, model_cfg, tx):
    """The trainer's TrainState of the run's model and optimizer as shapes on the first device: what a
    checkpoint of the run restores into (built once, for every step)."""
    recipe = setup.run_recipe(config)
    model = Llama(model_cfg, recipe=recipe)
    init = make_init_fn(model, tx, (1, min(config.seq_len, 64)))
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shapes = jax.eval_shape(lambda key: nn.meta.unbox(init(key)), setup.init_key(config.seed))
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=device), shapes)


def next_training_batches(run_dir: str, step: int, config, tokenizer, *, n: int, batch: int) -> list[dict]:
    """The n batches of `batch` sequences (the run's seq_len) that the run reads after checkpoint `step`:
    its training iterator, built as the trainer builds it, set to the checkpoint's data state. Every window
    lies in the checkpoint's epoch, so none has been trained on by `step` (a ValueError otherwise)."""
    data_state = _manager(run_dir).restore(step, args=ocp.args.Composite(data=ocp.args.JsonRestore())).data
    train_iter = make_train_iterator(
        config.data, tokenizer, seq_len=config.seq_len, global_batch=batch, seed=config.seed, progress=False
    )
    train_iter.set_state(data_state)
    left = train_iter.windows_per_epoch - int(data_state["position"])
    if n * batch > left:
        raise ValueError(
            f"--data next at step {step}: {n} x {batch} sequences, but only {left:,} unseen ones are left in "
            "the epoch; ask for fewer --batches, --accumulate or --batch"
        )
    return [next(train_iter) for _ in range(n)]


def load_state(run_dir: str, step: int, abstract) -> tuple:
    """(params, opt_state) of checkpoint `step`, in the trainer's own tree structure (`abstract_state`;
    see verified_steps)."""
    args = ocp.args.Composite(state=ocp.args.StandardRestore(abstract))
    state = _manager(run_dir).restore(step, args=args).state
    return state.params, state.opt_state


# ----------------------------------------------------------------------------------------------------
# the command: python -m fp4jax.study instruments


def run_instruments(
    run_dir: str,
    *,
    steps: Sequence[int] | None = None,
    stages: Sequence[str] = STAGES,
    n_batches: int = 4,
    accumulate: int = 1,
    batch: int | None = None,
    seq_len: int | None = None,
    data: str = "config",
    log=print,
) -> dict:
    """Every stage's instruments on each checkpoint `steps` (default: all) of a run; the JSON document.

    Batches: the first n_batches x accumulate x batch sequences of the run's validation stream (`data` as
    in python -m fp4jax.diagnose), the same at every step, or with data "next" the run's own next ones
    after each step (`next_training_batches`; seq_len must be the run's), in n_batches disjoint groups of
    `accumulate` micro-batches (tokens per step: accumulate x batch x seq_len); batch default: the run's
    global batch (the minibatch noise of one update), seq_len default: the run's.
    """
    if not stages or len(set(stages)) < len(stages):
        raise ValueError(f"--stages {','.join(stages)!r}: give distinct ones of {', '.join(STAGES)}")
    for stage in stages:
        stage_recipe(stage)
    if data not in DATA_MODES:
        raise ValueError(f"unknown --data {data!r}: use one of {', '.join(DATA_MODES)}")
    steps = verified_steps(run_dir, steps)
    config = run_config(run_dir, steps[-1])
    batch, seq_len = batch or config.global_batch, seq_len or config.seq_len
    if min(n_batches, accumulate, batch, seq_len) < 1:
        raise ValueError("--batches, --accumulate, --batch and --seq-len must be >= 1")
    tokenizer = setup.load_tokenizer(config.data.tokenizer)  # the trainer's lookup (tests replace it)
    model_cfg = setup.model_config(config, padded_vocab_size(tokenizer.vocab_size))
    model_cfg = dataclasses.replace(model_cfg, max_seq_len=max(model_cfg.max_seq_len, seq_len))
    tx, _ = make_optimizer(config.optimizer)
    if data == NEXT and seq_len != config.seq_len:
        raise ValueError(
            f"--data next reads the run's own windows of {config.seq_len} tokens: drop --seq-len"
        )
    n = n_batches * accumulate

    def micro_batches(step: int | None) -> list[tuple]:
        if data == NEXT:
            drawn = next_training_batches(run_dir, step, config, tokenizer, n=n, batch=batch)
        else:
            drawn = diagnose.make_batches(
                config,
                tokenizer,
                data,
                n=n,
                batch=batch,
                seq_len=seq_len,
                vocab=model_cfg.vocab_size,
                seed=config.seed,
            )
        drawn = [{k: jnp.asarray(v) for k, v in b.items()} for b in drawn]
        return group_micro_batches(drawn, n_batches, accumulate)

    shared_batches = None if data == NEXT else micro_batches(None)  # the same at every step
    recipes = {None: "bf16", **{s: stage_recipe(s) for s in stages}}
    grads = {s: loss_grad_fn(model_cfg, resolve_execution(r)[0]) for s, r in recipes.items()}
    mean_grad = accumulated(lambda s, p, b: grads[s](p, b))
    update = update_fn(tx)
    abstract = abstract_state(config, model_cfg, tx)
    results = {}
    for step in steps:
        params, opt_state = load_state(run_dir, step, abstract)
        batches = shared_batches or micro_batches(step)
        results[str(step)] = measure(mean_grad, update, params, opt_state, batches, stages)
        log(f"step {step}: " + "; ".join(f"{s} {_summary(results[str(step)][s])}" for s in stages))
    return {
        "run": run_dir,
        "recipe": config.recipe,
        "stages": list(stages),
        "batches": n_batches,
        "accumulate": accumulate,
        "batch": batch,
        "seq_len": seq_len,
        "tokens_per_step": accumulate * batch * seq_len,
        "data": data,
        "coherence_bias": math.sqrt(n_batches),
        "steps": results,
    }


def _summary(stage_result: dict) -> str:
    g, u = stage_result["gradient"][ALL], stage_result["update"][ALL]
    return f"noise_ratio {g['noise_ratio']:.3g} coherence {g['coherence']:.3g} update cos {u['cos']:.4f}"


# (column, part, quantity, format) of the text table
_COLUMNS = (
    ("noise_ratio", "gradient", "noise_ratio", "12.3e"),
    ("coherence", "gradient", "coherence", "10.3f"),
    ("sqrt3_ratio", "gradient", "sqrt3_ratio", "12.3e"),
    ("upd_rel_err", "update", "rel_err", "12.3e"),
    ("upd_cos", "update", "cos", "8.4f"),
    ("sign", "update", "sign_agree", "7.4f"),
)


def _cell(value, spec: str) -> str:
    width = int(spec.split(".")[0])
    undefined = value is None or (isinstance(value, float) and math.isnan(value))
    return "null".rjust(width) if undefined else format(value, spec)


def table(result: dict) -> str:
    """One text table of the whole-model figures: a row per step and stage."""
    head = f"{'step':>8} {'stage':<6} " + " ".join(c.rjust(int(f.split(".")[0])) for c, _, _, f in _COLUMNS)
    lines = [head, "-" * len(head)]
    for step, stages in result["steps"].items():
        for stage, r in stages.items():
            cells = (_cell(r[part][ALL][q], spec) for _, part, q, spec in _COLUMNS)
            lines.append(f"{step:>8} {stage:<6} " + " ".join(cells))
    return "\n".join(lines)


def _series(result: dict, stage: str, part: str, quantity: str) -> dict[str, list[float]]:
    steps = list(result["steps"])
    groups = list(result["steps"][steps[0]][stage][part])
    return {g: [result["steps"][s][stage][part][g][quantity] for s in steps] for g in groups}


PANELS = (
    ("gradient", "noise_ratio", "||g_q - g|| / ||g(A) - g(B)||", True),
    ("gradient", "coherence", "coherence over K batches", False),
    ("update", "rel_err", "AdamW update: relative error", True),
    ("update", "sign_agree", "AdamW update: sign agreement", False),
)


def plot(result: dict, stage: str, path: str) -> None:
    """Four panels over training steps for one stage, a line per parameter group (ALL thick, black); an
    undefined value (a group the stage leaves exact has no coherence) or a zero on a log axis is not drawn."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [int(s) for s in result["steps"]]
    fig, axes = plt.subplots(1, len(PANELS), figsize=(5 * len(PANELS), 4.2))
    for ax, (part, quantity, title, log_scale) in zip(axes, PANELS, strict=True):
        for group, values in _series(result, stage, part, quantity).items():
            style = {"color": "k", "lw": 2.5} if group == ALL else {"lw": 1.0}
            ax.plot(steps, [np.nan if v is None else v for v in values], marker="o", label=group, **style)
        if quantity == "coherence":
            reference = _series(result, stage, part, "grad_coherence")[ALL]
            ax.plot(
                steps, [np.nan if v is None else v for v in reference], "k--", lw=1, label="bf16 grad (all)"
            )
            for level, name in ((1.0, "noise"), (result["coherence_bias"], "bias")):
                ax.axhline(level, color="k", ls=":", lw=1)
                ax.annotate(name, (steps[0], level), fontsize=8, va="bottom")
        ax.set_yscale("log" if log_scale else "linear")
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("checkpoint step")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7, ncol=2)
    fig.suptitle(
        f"{stage} only in MXFP4 (others bf16); "
        f"{result['batches']} batches of {result['accumulate']} x {result['batch']} x {result['seq_len']}"
        " tokens"
    )
    fig.tight_layout()
    save_png(fig, path, dpi=110)


def _json_safe(obj):
    """NaN (an undefined ratio) -> None, so the file is strict JSON."""
    if isinstance(obj, dict):
        return {k: _json_safe(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_json_safe(v) for v in obj]
    return None if isinstance(obj, float) and math.isnan(obj) else obj


def write(result: dict, out: str) -> list[str]:
    """OUT/instruments.json, instruments.txt and instruments_<stage>.png; returns the paths."""
    os.makedirs(out, exist_ok=True)
    result = _json_safe(result)
    paths = [os.path.join(out, "instruments.json"), os.path.join(out, "instruments.txt")]
    write_json(result, paths[0], sort_keys=False)
    with open(paths[1], "w", encoding="utf-8") as f:
        f.write(table(result) + "\n")
    for stage in result["stages"]:
        paths.append(os.path.join(out, f"instruments_{stage}.png"))
        plot(result, stage, paths[-1])
    return paths
