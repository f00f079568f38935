"""Params-only checkpoints and runs that start from them (config.init_params).

A params-only checkpoint is a run's checkpoint without optimizer state or data position:
<dir>/checkpoints/0/{state, meta, fp4jax_manifest.json}, `state` the orbax pytree {"step": 0, "params"}
(float32, each array saved in its sharding), `meta` JSON {"config": {"model": {"size", field: value}},
"converted_from": {...}}. `python -m fp4jax.convert from-hf` writes them. Every reader of params here
reads a run's checkpoint too (its `state` holds more, which is not read; its meta holds the whole config).

config.init_params names such a checkpoint, or a run's workdir, its checkpoints/ or one step's directory
(then that step, else the newest; its manifest must verify). The run starts with its params, a fresh
optimizer state (Adam's moments zero, as at step 0), step 0 and the data from its start; its own
checkpoints win once it has one (init_params is then never read again). Checked before anything is
restored, each a one-line ConfigError: the architecture recorded with the params (ARCH_FIELDS: widths,
heads, rope_theta, norm_eps, ...) equals the run's model config, and every param has the run's shape.
The layer layout may differ (model.scan_layers, bf16_first_blocks / bf16_last_blocks split the stacked
blocks differently): the params are restored in the saved layout, sharded as the run shards them, and
re-laid out on the devices.
"""

import dataclasses
import functools
import json
import math
import os
import pathlib
import re

import jax
import ml_collections
import numpy as np
import orbax.checkpoint as ocp
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec

from fp4jax.models.llama import LlamaConfig, llama_config, stack_layer_params, unstack_layer_params
from fp4jax.training import checkpoint, integrity
from fp4jax.training.errors import ConfigError

__all__ = [
    "ARCH_FIELDS",
    "PARAMS_ITEMS",
    "check_config",
    "find_step_dir",
    "flat_tree",
    "params_metadata",
    "read_leaf",
    "saved_meta",
    "saved_model_config",
    "start_from_params",
    "write_params_checkpoint",
]

PARAMS_ITEMS = ("state", "meta")
SAVE_GB = 1  # how much orbax may copy from the devices to the host at once while writing params
ARCH_FIELDS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "n_kv_heads",
    "head_dim",
    "d_ff",
    "rope_theta",
    "rope_scaling",
    "norm_eps",
)


def write_params_checkpoint(directory: str, params, mesh, model: dict, source: dict) -> str:
    """Writes params (float32 jax arrays, sharded on `mesh`) as step 0 of <directory>/checkpoints, with
    meta {"config": {"model": model}, "converted_from": source} and a manifest; returns the step's
    directory. Synchronous: the files are complete when it returns."""
    step = jax.device_put(np.int32(0), NamedSharding(mesh, PartitionSpec()))
    options = ocp.CheckpointManagerOptions(enable_async_checkpointing=False, create=True)
    # orbax copies arrays to the host to write them, by default up to 96 GB at once: the whole model.
    # SAVE_GB at a time (or one device's slice of the largest param, the least orbax accepts) keeps the
    # host's share bounded; the files are the same as StandardSave's.
    largest = max(
        math.prod(x.sharding.shard_shape(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(params)
    )
    limit_gb = max(SAVE_GB, math.ceil(largest / 1e9))
    handlers = {
        "state": ocp.PyTreeCheckpointHandler(
            save_concurrent_gb=limit_gb, save_device_host_concurrent_gb=limit_gb
        ),
        "meta": ocp.JsonCheckpointHandler(),
    }
    manager = ocp.CheckpointManager(
        checkpoint.checkpoints_dir(directory),
        options=options,
        item_names=PARAMS_ITEMS,
        item_handlers=handlers,
    )
    meta = {"config": {"model": model}, "converted_from": source}
    try:
        args = ocp.args.Composite(
            state=ocp.args.PyTreeSave({"step": step, "params": params}), meta=ocp.args.JsonSave(meta)
        )
        manager.save(0, args=args)
        manager.wait_until_finished()
    finally:
        manager.close()
    step_dir = os.path.join(checkpoint.checkpoints_dir(directory), "0")
    if jax.process_index() == 0:
        integrity.write_manifest(step_dir)
    return step_dir


def check_config(config, workdir: str) -> None:
    """init_params is the run's only start and exists (unless the workdir has checkpoints of its own,
    then it is never read): ConfigError of one line otherwise. Nothing is verified or read yet."""
    if not config.init_params:
        return
    for other in ("init_from", "init_checkpoint"):
        if config[other]:
            raise ConfigError(f"init_params and {other} are both set: a run starts from one; unset one")
    if not integrity.step_dirs(checkpoint.checkpoints_dir(workdir)):
        find_step_dir(config.init_params, None, "init_params", verify=False)


def find_step_dir(path: str, step: int | None, label: str, verify: bool = True) -> str:
    """The step directory of `path` (a run's workdir, its checkpoints/, or one step's directory; `step`
    None: the newest step, or the one `path` names), its manifest verified (`verify`). ConfigError /
    CheckpointError of one line naming `label` (the option that gave `path`) otherwise."""
    path = os.path.abspath(path)
    base = os.path.basename(path)
    if base.isdigit() and os.path.isdir(os.path.join(path, "state")):
        if step is not None and step != int(base):
            raise ConfigError(f"{label} {path} is the directory of step {base}, not {step}")
        path, step = os.path.dirname(path), int(base)
    if not os.path.exists(path):
        raise ConfigError(f"{label} {path} does not exist; pass a checkpoint or a run's workdir")
    steps = checkpoint.run_step_dirs(path, label)
    step = max(steps) if step is None else step
    if step not in steps:
        have = ", ".join(str(s) for s in sorted(steps))
        raise ConfigError(f"{label} {path} has no checkpoint at step {step} (it has: {have})")
    if verify:
        checkpoint.verify_step_dir(steps[step], label, "use another step or checkpoint")
    if not os.path.isdir(os.path.join(steps[step], "state")):
        raise ConfigError(f"{label} {steps[step]} holds no state/: not an fp4jax checkpoint")
    return steps[step]


def _state_handler() -> ocp.PyTreeCheckpointHandler:
    """orbax's handler of the `state` item, used directly: a Checkpointer would look for checkpoint
    metadata beside the item (the manager keeps it one directory up) and warn at every read."""
    return ocp.PyTreeCheckpointHandler()


def params_metadata(step_dir: str) -> dict:
    """The saved params' tree of array metadata (shape, dtype); nothing is read into memory."""
    handler = _state_handler()
    try:
        tree = handler.metadata(pathlib.Path(step_dir, "state"))
    finally:
        handler.close()
    tree = getattr(tree, "tree", tree)
    if not isinstance(tree, dict) or "params" not in tree:
        raise ConfigError(f"{step_dir}/state holds no params: not an fp4jax checkpoint")
    return tree["params"]


def _restore(step_dir: str, item: dict, restore_args: dict) -> dict:
    """The params of `item` (ShapeDtypeStructs) alone from the step's state, laid out by `restore_args`."""
    args = ocp.args.PyTreeRestore(
        item={"params": item}, restore_args={"params": restore_args}, partial_restore=True
    )
    handler = _state_handler()
    try:
        return handler.restore(pathlib.Path(step_dir, "state"), args=args)["params"]
    finally:
        handler.close()


def saved_meta(step_dir: str) -> dict:
    path = os.path.join(step_dir, "meta", "metadata")
    try:
        with open(path, encoding="utf-8") as f:
            return json.load(f)
    except (OSError, ValueError) as exc:
        raise ConfigError(
            f"{step_dir} has no readable meta ({type(exc).__name__}): not an fp4jax checkpoint"
        ) from exc


def flat_tree(tree) -> dict[tuple[str, ...], object]:
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: hasattr(x, "shape"))[0]
    return {tuple(str(getattr(k, "key", k)) for k in p): v for p, v in leaves}


def saved_model_config(step_dir: str) -> LlamaConfig:
    """The LlamaConfig the params of `step_dir` were trained or converted as: the model keys of its meta
    (the vocabulary from the embedding's shape where they leave it to the tokenizer), its layer layout
    from the saved params' names."""
    meta = saved_meta(step_dir)
    config = meta.get("config") or {}
    model = dict(config.get("model") or {})
    if "size" not in model:
        raise ConfigError(f"{step_dir}'s meta records no model config: not an fp4jax checkpoint")
    flat = flat_tree(params_metadata(step_dir))
    overrides = {k: v for k, v in model.items() if k != "size" and v is not None}
    overrides.setdefault("vocab_size", int(flat[("embed", "embedding")].shape[0]))
    overrides.update(_layout(flat, overrides.get("n_layers") or llama_config(model["size"]).n_layers))
    try:
        cfg = llama_config(model["size"], **overrides)
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"{step_dir}'s meta records a model fp4jax cannot build ({exc})") from exc
    seq_len = config.get("seq_len") or 0
    return dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, seq_len))


def _layout(flat: dict, n_layers: int) -> dict:
    """scan_layers, bf16_first_blocks and bf16_last_blocks that give the saved params' block names (only
    the split into stacked segments matters for the params)."""
    ranges = sorted(
        (int(m[1]), int(m[2])) for m in (re.fullmatch(r"blocks_(\d+)_(\d+)", k[0]) for k in flat) if m
    )
    if not ranges:
        return {"scan_layers": False, "bf16_first_blocks": 0, "bf16_last_blocks": 0}
    starts = sorted({a for a, _ in ranges})
    first = starts[1] if len(starts) >= 2 and starts[0] == 0 else 0
    last = n_layers - starts[2] if len(starts) == 3 else 0
    return {"scan_layers": True, "bf16_first_blocks": first, "bf16_last_blocks": last}


def read_leaf(step_dir: str, path: tuple[str, ...]) -> np.ndarray:
    """One saved param (the whole array, float32 as saved) into host memory, read alone."""
    metadata = flat_tree(params_metadata(step_dir))[path]
    cpu = jax.sharding.SingleDeviceSharding(jax.devices("cpu")[0])
    item = traverse_util.unflatten_dict({path: jax.ShapeDtypeStruct(metadata.shape, metadata.dtype)})
    value = _restore(step_dir, item, traverse_util.unflatten_dict({path: ocp.ArrayRestoreArgs(sharding=cpu)}))
    for key in path:
        value = value[key]
    return np.asarray(value)


def _restore_params(step_dir: str, abstract: dict) -> dict:
    """The saved params laid out as `abstract` (ShapeDtypeStructs with shardings): only they are read."""
    return _restore(
        step_dir, abstract, jax.tree.map(lambda s: ocp.ArrayRestoreArgs(sharding=s.sharding), abstract)
    )


def _check_architecture(saved: LlamaConfig, run: LlamaConfig, step_dir: str) -> None:
    for field in ARCH_FIELDS:
        there, here = getattr(saved, field), getattr(run, field)
        if there != here:
            raise ConfigError(
                f"init_params {step_dir} holds a model with {field}={there}, this run's has {here}: set "
                f"--config.model.{field}={there} (or start from another checkpoint)"
            )


def _layer_specs(run_shardings: dict) -> dict[tuple[str, ...], PartitionSpec]:
    """{path inside a block: the spec of one layer} from the run's param shardings."""
    specs = {}
    for keys, sharding in _flat_shardings(run_shardings):
        if keys[0].startswith("blocks_"):
            specs[keys[1:]] = PartitionSpec(*tuple(sharding.spec)[1:])
        elif keys[0].startswith("block_"):
            specs[keys[1:]] = sharding.spec
    return specs


def _flat_shardings(tree):
    leaves = jax.tree_util.tree_flatten_with_path(tree, is_leaf=lambda x: isinstance(x, NamedSharding))[0]
    return [(tuple(str(getattr(k, "key", k)) for k in p), s) for p, s in leaves]


def _saved_abstract(saved_tree: dict, run_shardings: dict, mesh) -> dict:
    """The saved params as ShapeDtypeStructs, each sharded as the run shards that param (a stacked
    layer axis unsharded, as the run's rules have it)."""
    layer_specs = _layer_specs(run_shardings)
    top = {k: s for k, s in _flat_shardings(run_shardings) if not k[0].startswith("block")}
    out = {}
    for keys, meta in flat_tree(saved_tree).items():
        if keys[0].startswith("blocks_"):
            spec = PartitionSpec(None, *layer_specs[keys[1:]])
        elif keys[0].startswith("block_"):
            spec = layer_specs[keys[1:]]
        else:
            spec = top[keys].spec
        out[keys] = jax.ShapeDtypeStruct(meta.shape, meta.dtype, sharding=NamedSharding(mesh, spec))
    return traverse_util.unflatten_dict(out)


def _relayout(params: dict, saved_cfg: LlamaConfig, run_cfg: LlamaConfig) -> dict:
    """Params in saved_cfg's layer layout -> run_cfg's (per-block in between)."""
    per_block = unstack_layer_params(params, saved_cfg) if saved_cfg.scan_layers else params
    return stack_layer_params(per_block, run_cfg) if run_cfg.scan_layers else per_block


def start_from_params(config: ml_collections.ConfigDict, state, shardings, model_cfg: LlamaConfig):
    """`state` (the run's step-0 TrainState) with the params of config.init_params, laid out and sharded
    as `shardings.params`; (state, {"init_params": ...}) to record in meta. See the module docstring."""
    step_dir = find_step_dir(config.init_params, None, "init_params")
    saved_cfg = saved_model_config(step_dir)
    _check_architecture(saved_cfg, model_cfg, step_dir)
    saved_tree = params_metadata(step_dir)
    run_abstract = jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state.params, shardings.params
    )
    mesh = jax.tree.leaves(shardings.params)[0].mesh
    same_layout = set(flat_tree(saved_tree)) == set(flat_tree(run_abstract))
    if same_layout:
        _check_shapes(flat_tree(saved_tree), flat_tree(run_abstract), step_dir)
    jax.tree.map(lambda x: x.delete(), state.params)  # the random init: its memory is needed now
    if same_layout:
        params = _restore_params(step_dir, run_abstract)
    else:
        saved = _restore_params(step_dir, _saved_abstract(saved_tree, shardings.params, mesh))
        relayout = functools.partial(_relayout, saved_cfg=saved_cfg, run_cfg=model_cfg)
        # Not donated: a stacked input and the unstacked outputs share no buffer shapes. Both layouts are
        # on the devices for the call only: the saved one is freed when it returns.
        params = jax.jit(relayout, out_shardings=shardings.params)(saved)
    return state.replace(params=params), {
        "init_params": {"path": config.init_params, "step": int(os.path.basename(step_dir))}
    }


def _check_shapes(saved: dict, run: dict, step_dir: str) -> None:
    for keys in sorted(run):
        a, b = saved[keys], run[keys]
        there = f"{tuple(a.shape)} {np.dtype(a.dtype).name}"
        here = f"{tuple(b.shape)} {np.dtype(b.dtype).name}"
        if there != here:
            raise ConfigError(
                f"init_params {step_dir}: param {'/'.join(keys)} is {there} there and {here} here; start "
                "from a checkpoint of this model"
            )
