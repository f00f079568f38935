"""Orbax checkpoints of the train state and the data iterator.

Layout: <workdir>/checkpoints/<step>/{state, data, meta}. `state` (StandardSave) is the TrainState pytree:
step, params, opt_state, fp8_meta. `data` (JsonSave) is the data iterator's state, so that a resumed run
reads exactly the next batch. `meta` (JsonSave) is the run's progress that is not an array: the evaluation
history, the step that reached the target, the config. Saves are asynchronous: `save` returns once the
arrays are copied to host, so the next (donating) train step may run while the files are written.
"""

import os

import jax
import orbax.checkpoint as ocp

ITEMS = ("state", "data", "meta")


def make_manager(workdir: str, *, keep: int, async_save: bool = True) -> ocp.CheckpointManager:
    options = ocp.CheckpointManagerOptions(
        max_to_keep=keep, enable_async_checkpointing=async_save, create=True
    )
    return ocp.CheckpointManager(
        os.path.join(os.path.abspath(workdir), "checkpoints"), options=options, item_names=ITEMS
    )


def save(manager: ocp.CheckpointManager, step: int, state, data_state: dict, meta: dict):
    """Starts an asynchronous save of step `step` (skipped when that step is already saved)."""
    if step in manager.all_steps():
        return
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state), meta=ocp.args.JsonSave(meta)
    )
    manager.save(step, args=args)


def abstract_like(state, shardings):
    """ShapeDtypeStructs with the target shardings: what `restore` lays the arrays out as."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


def restore(manager_or_dir, abstract_state, step: int | None = None):
    """(state, data_state, meta) of `step` (default: the latest) from a manager or a checkpoints directory.

    A directory argument is one step's directory or a checkpoints directory (its latest step).
    FileNotFoundError when there is nothing to restore.
    """
    manager = manager_or_dir
    if isinstance(manager_or_dir, str):
        manager, step = _manager_for_path(manager_or_dir, step)
    step = manager.latest_step() if step is None else step
    if step is None:
        raise FileNotFoundError(f"no checkpoint in {manager.directory}")
    args = ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=ocp.args.JsonRestore(),
        meta=ocp.args.JsonRestore(),
    )
    restored = manager.restore(step, args=args)
    return restored.state, restored.data, restored.meta


def _manager_for_path(path: str, step: int | None):
    path = os.path.abspath(path)
    if not os.path.isdir(path):
        raise FileNotFoundError(
            f"checkpoint path {path} does not exist; give a run's workdir/checkpoints or one step in it"
        )
    base = os.path.basename(path)
    if base.isdigit() and os.path.isdir(os.path.join(path, "state")):
        path, step = os.path.dirname(path), int(base)
    elif os.path.isdir(os.path.join(path, "checkpoints")):
        path = os.path.join(path, "checkpoints")
    options = ocp.CheckpointManagerOptions(read_only=True, create=False)
    return ocp.CheckpointManager(path, options=options, item_names=ITEMS), step
