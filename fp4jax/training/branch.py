"""A run branched from another run's checkpoint (config.init_from + config.init_from_step).

A branch starts a new workdir from one exact checkpoint of a source run (the trunk) and trains on with its
own config, recipe included. What it takes from the source's step N:
- step, params and optimizer state (Adam's moments and counters), as saved: the branch's first update is
  update N + 1, its LR is its own schedule's at N + 1 (the trunk's schedule when the optimizer config is
  the same; a different one is reported in one line, not refused);
- the data iterator's position: its first batch is the one the trunk read after update N;
- the seed is the branch config's own (config.seed): the quantization key of update s is derived from it
  and s, as in any run, so a branch with the trunk's seed and recipe is the trunk's continuation.
Recipe-specific state, rule: each leaf of the branch recipe's fp8_meta (a delayed-FP8 amax history of one
layer, operand role) is the source's where the source has that leaf with the same shape and dtype, and
fresh (as at step 0: zeros) where the source lacks it or its shape differs (another history length). So
a branch of the source's own recipe continues it exactly; an MXFP4 recipe, which keeps no histories,
takes none; a recipe whose remaining FP8 GEMMs keep histories of the source's length inherits them.
Not taken: the source's evaluations, target step and divergence-guard window (the branch's own progress
starts empty; meta["branched_from"] records the source as config.init_from gave it, relative or not,
and the step).

The workdir's own checkpoints win: a branch that has saved one resumes from its newest good one and never
reads init_from again. Bad input (no such directory or step, a checkpoint that does not verify, a model
whose params differ in shape) is a one-line ConfigError / CheckpointError before the train step is
compiled (the missing ones before anything is built).
"""

import logging
import os

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.sharding import NamedSharding, PartitionSpec

from fp4jax.training import checkpoint, integrity
from fp4jax.training.errors import ConfigError
from fp4jax.training.summary import say

__all__ = ["check_config", "merge_fp8_meta", "source_step_dir", "start_branch"]

log = logging.getLogger(__name__)


def check_config(config, workdir: str) -> None:
    """The branch keys make sense together, and the source step exists unless the workdir has checkpoints
    of its own (then the source is never read): ConfigError of one line otherwise."""
    if not config.init_from:
        return
    if config.init_checkpoint:
        raise ConfigError("init_from and init_checkpoint are both set: a run starts from one; unset one")
    if config.init_from_step < 1:
        raise ConfigError(
            f"init_from {config.init_from} needs init_from_step, the step of its checkpoint to branch from "
            "(set --config.init_from_step=N)"
        )
    if config.steps <= config.init_from_step:
        raise ConfigError(
            f"steps {config.steps} must exceed init_from_step {config.init_from_step}: steps counts the "
            "trunk's updates too; set --config.steps to init_from_step + the branch's updates"
        )
    if not integrity.step_dirs(checkpoint.checkpoints_dir(workdir)):
        source_step_dir(config.init_from, config.init_from_step)


# How the init_from options name the source and pick another step, in the one-line errors of
# checkpoint.run_step_dir (no such step) and checkpoint.verify_step_dir (a bad one).
_SOURCE = {"label": "init_from", "fix": "set --config.init_from_step to one of them"}


def source_step_dir(init_from: str, step: int) -> str:
    """The directory of checkpoint `step` of the run at `init_from` (its workdir or its checkpoints/),
    unverified; ConfigError naming the steps it has when there is no such checkpoint."""
    return checkpoint.run_step_dir(init_from, step, **_SOURCE)


def start_branch(config, abstract_state, train_iter) -> checkpoint.Restored:
    """The branch's starting state (see the module docstring) with the data iterator set to the source's
    position; meta holds only branched_from."""
    step_dir = checkpoint.verified_run_step_dir(
        config.init_from, config.init_from_step, **_SOURCE, bad_fix="branch from another step"
    )
    saved = _saved_tree(step_dir)
    _check_params(saved["params"], abstract_state.params, step_dir)
    replicated = NamedSharding(_mesh_of(abstract_state), PartitionSpec())
    source_fp8 = jax.tree.map(
        lambda m: jax.ShapeDtypeStruct(m.shape, m.dtype, sharding=replicated), saved.get("fp8_meta") or {}
    )
    target = abstract_state.replace(fp8_meta=source_fp8)
    manager = ocp.CheckpointManager(
        os.path.dirname(step_dir),
        options=ocp.CheckpointManagerOptions(read_only=True, create=False),
        item_names=checkpoint.ITEMS,
    )
    try:
        state, data_state, meta = checkpoint.restore(manager, target, config.init_from_step)
    except (ValueError, KeyError) as exc:  # params matched: the optimizer's state has another structure
        reason = str(exc).splitlines()[0][:200] if str(exc) else type(exc).__name__
        raise ConfigError(
            f"init_from checkpoint {step_dir} does not fit this run's optimizer ({reason}); branch with the "
            "source's optimizer config"
        ) from exc
    finally:
        manager.close()
    train_iter.set_state(data_state)
    _note_optimizer(config, meta, step_dir)
    fp8_meta, carried = merge_fp8_meta(state.fp8_meta, abstract_state.fp8_meta)
    say(f"branched from {config.init_from} at step {int(state.step)}: {carried} amax histories carried over")
    # Recorded as the user gave it (a relative path stays relative, so a run's records do not name the
    # machine it ran on); step_dir, resolved, is only for opening.
    branched = {"init_from": config.init_from, "step": int(config.init_from_step)}
    return checkpoint.Restored(state.replace(fp8_meta=fp8_meta), {"branched_from": branched}, int(state.step))


def merge_fp8_meta(source: dict, abstract: dict) -> tuple[dict, int]:
    """(this run's fp8_meta, how many leaves came from `source`): each leaf of `abstract` (this run's,
    ShapeDtypeStructs with shardings) is the source's array at the same path when shape and dtype match,
    else zeros (the step-0 value of an amax history)."""
    found = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(source)[0]}
    carried = 0

    def leaf(path, spec):
        nonlocal carried
        value = found.get(jax.tree_util.keystr(path))
        if value is not None and value.shape == spec.shape and value.dtype == spec.dtype:
            carried += 1
            return jax.device_put(value, spec.sharding)
        return jax.device_put(np.zeros(spec.shape, spec.dtype), spec.sharding)

    return jax.tree_util.tree_map_with_path(leaf, abstract), carried


def _saved_tree(step_dir: str) -> dict:
    """The saved TrainState's tree of array metadata (shapes and dtypes; nothing is read into memory)."""
    checkpointer = ocp.StandardCheckpointer()
    try:
        metadata = checkpointer.metadata(os.path.join(step_dir, "state"))
    finally:
        checkpointer.close()
    tree = getattr(metadata, "item_metadata", metadata)
    return dict(getattr(tree, "tree", tree))


def _check_params(saved, params, step_dir: str) -> None:
    """ConfigError naming the first param whose path, shape or dtype differs between source and run."""
    ours = {jax.tree_util.keystr(p): v for p, v in jax.tree_util.tree_flatten_with_path(params)[0]}
    theirs = {
        jax.tree_util.keystr(p): v
        for p, v in jax.tree_util.tree_flatten_with_path(saved, is_leaf=lambda x: hasattr(x, "shape"))[0]
    }
    for key in sorted(set(ours) | set(theirs)):
        a, b = theirs.get(key), ours.get(key)
        there = "absent" if a is None else f"{tuple(a.shape)} {np.dtype(a.dtype).name}"
        here = "absent" if b is None else f"{tuple(b.shape)} {np.dtype(b.dtype).name}"
        if there != here:
            raise ConfigError(
                f"init_from checkpoint {step_dir} is another model: param {key} is {there} there and {here} "
                "here; branch with the source's model config (model.scan_layers included)"
            )


def _mesh_of(abstract_state):
    return jax.tree.leaves(abstract_state.params)[0].sharding.mesh


def _note_optimizer(config, meta: dict, step_dir: str) -> None:
    source = (meta.get("config") or {}).get("optimizer")
    ours = config.optimizer.to_dict()
    if source is not None and source != ours:
        changed = sorted(k for k in set(source) | set(ours) if source.get(k) != ours.get(k))
        say(
            f"the branch's optimizer config differs from {step_dir}'s in {', '.join(changed)}: its LR "
            "schedule is its own, evaluated from the source's step on"
        )
