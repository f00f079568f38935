r"""Per-GEMM quantization error of several recipes on the same batches through the same weights.

    python -m fp4jax.diagnose --config configs/llama125m_pg_h16.py [--checkpoint RUN_DIR] \
        --recipes bf16,fp8,mxfp4_full,mxfp4_full_sr,mxfp4_full_rht,mxfp4_full_h16 \
        [--batches 1] [--batch 1] [--seq-len T] [--size SIZE] [--data config|bundled|synthetic] \
        [--layers 0,5,11] [--draws 8] [--out DIR] [--config.KEY=VALUE ...]

Weights: the config's random init (the trainer's: seed config.seed) or, with --checkpoint, the params of
a trainer checkpoint (a run directory, its checkpoints/ or one step's directory; the newest step), read
alone (no optimizer state).
Batches: the first batches x batch windows of the validation stream of the config's data ("config"), of
the bundled C4 sample ("bundled", the config's tokenizer), or uniform random tokens ("synthetic").
For each batch, one bf16 forward/backward captures every linear layer's x, W and dy
(fp4jax.gemm_errors); then, recipe by recipe and layer by layer, each GEMM is quantized as the recipe
says and compared with the float32 GEMM of the same operands; only scalars are kept.

Prints one table (relative error of y, dx and dW by layer kind, the mean over layers and batches) and
writes OUT/diagnose.json (every statistic: by kind, per layer) and OUT/diagnose.png. Exit codes: 0 done,
2 bad input (one line on stderr). Definitions: docs/diagnostics.md.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import time

import flax.linen as nn
import jax
import jax.numpy as jnp
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from absl import flags
from ml_collections import config_flags

from fp4jax import gemm_errors as diag
from fp4jax import logs
from fp4jax.data import DataError, default_data_config, load_tokenizer, make_eval_batches
from fp4jax.models import llama
from fp4jax.models.llama import SIZES, Llama, LlamaConfig, padded_vocab_size
from fp4jax.ops import get_recipe
from fp4jax.report_files import save_png, write_json
from fp4jax.training import checkpoint, integrity, setup

__all__ = [
    "DATA_MODES",
    "OUTPUTS",
    "UsageError",
    "checkpoint_state_dir",
    "init_params",
    "load_config_tokenizer",
    "main",
    "make_batches",
    "measure",
    "parse_flags",
    "plot",
    "restore_params",
    "run",
    "recipe_results",
    "table",
]

DATA_MODES = ("config", "bundled", "synthetic")
OUTPUTS = diag.OUTPUT_NAMES  # fprop: y, dgrad: dx, wgrad: dW


class UsageError(ValueError):
    """Bad input: reported in one line, exit code 2."""


# ----------------------------------------------------------------------------------------------------
# model, weights and batches


def load_config_tokenizer(config, data: str):
    """The tokenizer the batches need (None for synthetic data when the config's cannot be loaded)."""
    try:
        return load_tokenizer(config.data.tokenizer)
    except DataError:
        if data == "synthetic":
            return None
        raise


def init_params(model_cfg: LlamaConfig, seed: int) -> dict:
    """The trainer's step-0 params (its init function and key, training.setup), unboxed."""
    tokens = jnp.zeros((1, min(model_cfg.max_seq_len, 64)), jnp.int32)
    init = functools.partial(llama.init_variables, Llama(model_cfg))
    return nn.meta.unbox(jax.jit(init)({"params": setup.init_key(seed)}, tokens)["params"])


def checkpoint_state_dir(path: str) -> str:
    """<step>/state of the newest good step of a run directory, its checkpoints/ or one step's directory:
    the trainer's init_checkpoint lookup (training.checkpoint.open_init_checkpoint), and a step whose
    manifest's checksums fail is passed over as the trainer passes it over."""
    manager, max_step = checkpoint.open_init_checkpoint(path)
    found = integrity.step_dirs(str(manager.directory))
    for step in sorted((s for s in found if max_step is None or s <= max_step), reverse=True):
        step_dir = found[step]
        good = not integrity.has_manifest(step_dir) or integrity.verify(step_dir) is None
        if good and os.path.isdir(os.path.join(step_dir, "state")):
            return os.path.join(step_dir, "state")
    raise UsageError(
        f"no checkpoint under {path}: give a run directory, its checkpoints/ or one step's directory"
    )


def restore_params(path: str) -> dict:
    """The params of a trainer checkpoint (the TrainState pytree saved by orbax), onto the first device.

    Only the params are read (orbax partial restore, shapes from the checkpoint's own metadata), so an 8B
    checkpoint's optimizer state never reaches host memory.
    """
    state_dir = checkpoint_state_dir(path)
    checkpointer = ocp.PyTreeCheckpointer()
    tree = checkpointer.metadata(state_dir).item_metadata.tree
    if not isinstance(tree, dict) or "params" not in tree:
        raise UsageError(f"{state_dir} holds no params: not a fp4jax train state")
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params = tree["params"]
    item = {"params": jax.tree.map(lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype), params)}
    restore_args = {"params": jax.tree.map(lambda m: ocp.ArrayRestoreArgs(sharding=device), params)}
    args = ocp.args.PyTreeRestore(item=item, restore_args=restore_args, partial_restore=True)
    return checkpointer.restore(state_dir, args=args)["params"]


def make_batches(config, tokenizer, data: str, *, n: int, batch: int, seq_len: int, vocab: int, seed: int):
    """n batches {"inputs", "targets"} int32[batch, seq_len] (see the module doc for `data`)."""
    if data == "synthetic":
        rng = np.random.default_rng(seed)
        out = []
        for _ in range(n):
            tokens = rng.integers(0, vocab, (batch, seq_len + 1), dtype=np.int32)
            out.append({"inputs": tokens[:, :-1], "targets": tokens[:, 1:]})
        return out
    data_cfg = ml_collections.ConfigDict(config.data.to_dict())
    if data == "bundled":
        data_cfg.source, data_cfg.path = "json", "bundled"
        data_cfg.eval_glob = default_data_config().eval_glob
    return make_eval_batches(data_cfg, tokenizer, seq_len=seq_len, num_sequences=n * batch, batch_size=batch)


# ----------------------------------------------------------------------------------------------------
# the measurement


@functools.cache
def _layer_stats_fn(recipe, n_draws: int):
    return jax.jit(lambda ops, key: diag.layer_stats(ops, recipe, key, n_draws=n_draws))


def measure(model_cfg, params, batches, recipes, *, layers=None, n_draws=8, seed=0, log=print) -> dict:
    """{recipe: {(layer, kind): {gemm: {quantity: float}}}}, each statistic the mean over the batches.

    Holds one batch's captured operands at a time and, per recipe, one layer's GEMMs: the rest is scalars.
    """
    capture = jax.jit(functools.partial(diag.capture_operands, model_cfg))
    totals = {r: {} for r in recipes}
    for b, batch in enumerate(batches):
        t0 = time.perf_counter()
        loss, operands = capture(params, {k: jnp.asarray(v) for k, v in batch.items()})
        log(f"batch {b}: bf16 loss {float(loss):.4f}, operands captured in {time.perf_counter() - t0:.1f} s")
        batch_key = jax.random.fold_in(jax.random.key(seed), b)
        for name in recipes:
            t0 = time.perf_counter()
            layer_recipes = diag.layer_recipes(model_cfg, name)
            for layer, kind in operands:
                if layers is not None and layer not in layers:
                    continue
                recipe = layer_recipes[layer]
                key = diag.layer_key(batch_key, layer, kind) if recipe.needs_key else None
                stats = jax.device_get(_layer_stats_fn(recipe, n_draws)(operands[(layer, kind)], key))
                item = totals[name].setdefault((layer, kind), {})
                for gemm, quantities in stats.items():
                    for q, v in quantities.items():
                        item.setdefault(gemm, {}).setdefault(q, 0.0)
                        item[gemm][q] += float(v) / len(batches)
            log(f"batch {b}: {name} in {time.perf_counter() - t0:.1f} s")
        del operands
    return totals


def recipe_results(model_cfg, totals: dict) -> dict:
    """Per recipe: by_kind {kind: {gemm: {quantity}}}, per_layer {layer: {kind: ...}}, layer_wgrad_rel_err."""
    out = {}
    for name, items in totals.items():
        flat = diag.summarize(items, diag.high_precision_layers(model_cfg))
        by_kind, per_layer_wgrad = {}, {}
        for key, value in flat.items():
            _, group, gemm, quantity = key.split("/")
            if group.startswith("layer_"):
                per_layer_wgrad[int(group.removeprefix("layer_"))] = float(value)
            else:
                by_kind.setdefault(group, {}).setdefault(gemm, {})[quantity] = float(value)
        per_layer = {}
        for (layer, kind), stats in sorted(items.items()):
            per_layer.setdefault(str(layer), {})[kind] = {
                g: {q: v for q, v in s.items() if q not in ("out_err_sq", "out_ref_sq")}
                for g, s in stats.items()
            }
        out[name] = {"by_kind": by_kind, "per_layer": per_layer, "layer_wgrad_rel_err": per_layer_wgrad}
    return out


def table(results: dict, quantity: str = "out_rel_err") -> str:
    """One text table: a row per recipe and GEMM output, a column per layer kind and their mean."""
    kinds = [k for k in diag.LAYER_KINDS if any(k in r["by_kind"] for r in results.values())]
    width = max(len("recipe"), *(len(r) for r in results)) + 2
    head = "recipe".ljust(width) + "out".ljust(5) + "".join(k.rjust(10) for k in kinds) + "mean".rjust(10)
    lines = [head, "-" * len(head)]
    for name, r in results.items():
        for i, (gemm, output) in enumerate(OUTPUTS.items()):
            values = [r["by_kind"].get(k, {}).get(gemm, {}).get(quantity, float("nan")) for k in kinds]
            cells = "".join(f"{v:10.2e}" for v in values) + f"{float(np.mean(values)):10.2e}"
            lines.append((name if i == 0 else "").ljust(width) + output.ljust(5) + cells)
    return "\n".join(lines)


def _rounded(obj):
    """obj with every float to 6 significant digits (nested dicts and lists; other values as they are)."""
    if isinstance(obj, float):
        return float(f"{obj:.6g}")
    if isinstance(obj, dict):
        return {k: _rounded(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_rounded(v) for v in obj]
    return obj


def plot(results: dict, path: str, quantity: str = "out_rel_err") -> None:
    """Grouped bars (a group per layer kind, a bar per recipe), one panel per GEMM output, log scale."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    kinds = list(diag.LAYER_KINDS)
    values = {
        (name, gemm): np.array([r["by_kind"].get(k, {}).get(gemm, {}).get(quantity, np.nan) for k in kinds])
        for name, r in results.items()
        for gemm in OUTPUTS
    }
    visible = [v for vs in values.values() for v in vs if v >= 1e-6]  # bf16 sits at float32 rounding
    floor = min(visible, default=1e-6) / 3
    top = 2 * np.nanmax([v for vs in values.values() for v in vs] + [floor])
    fig, axes = plt.subplots(1, 3, figsize=(16, 4.8), sharey=True)
    width = 0.8 / max(len(results), 1)
    for ax, (gemm, output) in zip(axes, OUTPUTS.items(), strict=True):
        for j, name in enumerate(results):
            x = np.arange(len(kinds)) + (j - (len(results) - 1) / 2) * width
            ax.bar(x, np.maximum(values[(name, gemm)], floor), width, label=name)
        ax.set_xticks(np.arange(len(kinds)), kinds)
        ax.set_yscale("log")
        ax.set_ylim(floor, top)
        ax.set_title(f"{gemm}: {output}")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel(f"relative error vs exact GEMM\n(bars at the axis: < {floor:.1e})")
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    save_png(fig, path, dpi=120)


# ----------------------------------------------------------------------------------------------------
# command line


def _define_flags(fv, argv):
    config_flag = config_flags.DEFINE_config_file(
        "config", None, "ml_collections config file (configs/*.py)", flag_values=fv, sys_argv=list(argv)
    )
    flags.DEFINE_string("checkpoint", None, "trainer run dir / checkpoints dir / step dir", flag_values=fv)
    flags.DEFINE_string(
        "recipes",
        "bf16,fp8,mxfp4_full,mxfp4_full_sr,mxfp4_full_rht,mxfp4_full_h16",
        'comma-separated recipe presets to measure (docs/numerics.md, "The GEMM recipe")',
        flag_values=fv,
    )
    flags.DEFINE_integer("batches", 1, "batches to average over", flag_values=fv)
    flags.DEFINE_integer("batch", 1, "sequences per batch", flag_values=fv)
    flags.DEFINE_integer(
        "seq-len", None, "tokens per sequence (default: the config's seq_len)", flag_values=fv
    )
    flags.DEFINE_string("size", None, f"model size override, one of {', '.join(SIZES)}", flag_values=fv)
    flags.DEFINE_enum("data", "config", DATA_MODES, "where the batches come from", flag_values=fv)
    flags.DEFINE_string(
        "layers", None, "comma-separated block indices to measure (default: all)", flag_values=fv
    )
    flags.DEFINE_integer("draws", 8, "draws for the bias/variance of random recipes", flag_values=fv)
    flags.DEFINE_integer("seed", None, "init / data / draw seed (default: the config's seed)", flag_values=fv)
    flags.DEFINE_string("out", None, "output directory (default runs/diagnose/<config name>)", flag_values=fv)
    return config_flag


def parse_flags(argv):
    fv = flags.FlagValues()
    config_flag = _define_flags(fv, argv)
    if any(a in ("-h", "--help") for a in argv[1:]):
        print(__doc__ + "\nflags:\n" + fv.get_help())
        raise SystemExit(0)
    try:
        fv(argv)
    except flags.Error as exc:
        raise UsageError(str(exc).splitlines()[0]) from exc
    if fv.config is None:
        raise UsageError("--config is required, e.g. --config configs/tiny_c4_h16.py")
    try:
        config = config_flag.value
    except (AttributeError, KeyError) as exc:
        raise UsageError(f"bad config override: {str(exc).splitlines()[0]}") from exc
    return config, fv


def run(config, fv) -> dict:
    recipes = [r for r in fv.recipes.split(",") if r]
    for name in recipes:
        get_recipe(name)  # ValueError naming the presets
    if fv.size:
        config.model.size = fv.size
    if fv["seq-len"].value:
        config.seq_len = fv["seq-len"].value
    if min(fv.batches, fv.batch, fv.draws, config.seq_len) < 1:
        raise UsageError("--batches, --batch, --draws and the sequence length must be >= 1")
    seed = config.seed if fv.seed is None else fv.seed
    tokenizer = load_config_tokenizer(config, fv.data)
    vocab = padded_vocab_size(tokenizer.vocab_size) if tokenizer is not None else None
    model_cfg = setup.model_config(config, vocab)
    layers = None if fv.layers is None else {int(i) for i in fv.layers.split(",") if i}
    if layers is not None and not layers <= set(range(model_cfg.n_layers)):
        raise UsageError(f"--layers {fv.layers}: blocks are 0..{model_cfg.n_layers - 1}")
    params = restore_params(fv.checkpoint) if fv.checkpoint else init_params(model_cfg, seed)
    params = jax.jit(functools.partial(diag.per_block_params, model_cfg=model_cfg))(params)
    batches = make_batches(
        config,
        tokenizer,
        fv.data,
        n=fv.batches,
        batch=fv.batch,
        seq_len=config.seq_len,
        vocab=model_cfg.vocab_size,
        seed=seed,
    )
    log = functools.partial(print, file=sys.stderr, flush=True)
    totals = measure(model_cfg, params, batches, recipes, layers=layers, n_draws=fv.draws, seed=seed, log=log)
    results = recipe_results(model_cfg, totals)
    return {
        "config": config_flags.get_config_filename(fv["config"]),
        "checkpoint": fv.checkpoint,
        "model": dataclasses.asdict(model_cfg),
        "data": fv.data,
        "batches": fv.batches,
        "batch": fv.batch,
        "seq_len": config.seq_len,
        "draws": fv.draws,
        "seed": seed,
        "layers": sorted(layers) if layers is not None else None,
        "recipes": results,
    }


def main(argv=None) -> int:
    argv = sys.argv if argv is None else list(argv)
    logs.configure()
    try:
        config, fv = parse_flags(argv)
        result = run(config, fv)
    except (UsageError, ValueError, DataError, FileNotFoundError) as exc:
        print(f"error: {str(exc).splitlines()[0]}", file=sys.stderr, flush=True)
        return 2
    name = os.path.splitext(os.path.basename(result["config"]))[0]
    out = fv.out or os.path.join("runs", "diagnose", name)
    os.makedirs(out, exist_ok=True)
    text = table(result["recipes"])
    print(
        "relative error of each GEMM's output against the exact-product float32 GEMM of the same operands, "
        f"mean over layers; {result['batches']} batch(es) of {result['batch']} x {result['seq_len']} tokens, "
        f"{result['data']} data; operands from one bf16 forward/backward\n{text}"
    )
    # Recipes in command-line order; every figure to 6 significant digits (float32 measurements, whose
    # seventh digit is noise between draws), which keeps the committed reports small.
    write_json(_rounded(result), os.path.join(out, "diagnose.json"), sort_keys=False)
    with open(os.path.join(out, "diagnose.txt"), "w", encoding="utf-8") as f:
        f.write(text + "\n")
    plot(result["recipes"], os.path.join(out, "diagnose.png"))
    print(f"wrote {out}/diagnose.json, diagnose.txt, diagnose.png", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
