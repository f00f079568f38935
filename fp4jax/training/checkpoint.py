"""Orbax checkpoints of the train state and the data iterator, verified on restore.

Layout: <workdir>/checkpoints/<step>/{state, data, meta, fp4jax_manifest.json}. `state` (StandardSave) is
the TrainState pytree: step, params, opt_state, fp8_meta. `data` (JsonSave) is the data iterator's state,
so that a resumed run reads exactly the next batch. `meta` (JsonSave) is the run's progress that is not an
array: evaluations, the step that reached the target, the divergence guard's window, the config. Saves are
asynchronous by default: `save` returns once the arrays are copied to host; when orbax has finalised a
step, its manifest (training.integrity) is written in orbax's background thread. Synchronous saves
(config.async_checkpointing=False) return once the step is finalised, and write the manifest then.

Restore takes the newest step whose manifest verifies; a bad step is reported in one line, moved to
checkpoints/quarantine/ and the next older one is tried.
"""

import dataclasses
import errno
import functools
import logging
import os
import shutil
import time

import jax
import numpy as np
import orbax.checkpoint as ocp
from jax.experimental import multihost_utils

from fp4jax.data import DataError
from fp4jax.training import distributed, integrity
from fp4jax.training.errors import CheckpointError, ConfigError, DiskFullError

__all__ = [
    "Restored",
    "abstract_like",
    "checkpoints_dir",
    "finish",
    "make_manager",
    "open_init_checkpoint",
    "restore_newest_good",
    "run_step_dir",
    "run_step_dirs",
    "save",
    "verified_run_step_dir",
    "verify_step_dir",
]

log = logging.getLogger(__name__)

ITEMS = ("state", "data", "meta")
META_KEYS = ("evals", "target_step")


def checkpoints_dir(workdir: str) -> str:
    """<workdir>/checkpoints, absolute: where a run's step directories are."""
    return os.path.join(os.path.abspath(workdir), "checkpoints")


def make_manager(workdir: str, *, keep: int, async_save: bool = True, keep_steps=()) -> ocp.CheckpointManager:
    """The run's manager: the newest `keep` checkpoints are kept, and those of `keep_steps` for good.
    Asynchronous: orbax calls back when a step is finalised and the manifest is written then. Synchronous:
    `save` returns once the step is finalised and writes the manifest itself (orbax refuses a finalisation
    callback without its AsyncCheckpointer)."""
    directory = checkpoints_dir(workdir)
    on_finalized = functools.partial(_after_finalize, directory)
    async_options = ocp.AsyncOptions(post_finalization_callback=on_finalized) if async_save else None
    policies = [ocp.checkpoint_managers.LatestN(n=keep), ocp.checkpoint_managers.CustomSteps(keep_steps)]
    options = ocp.CheckpointManagerOptions(
        preservation_policy=ocp.checkpoint_managers.AnyPreservationPolicy(policies),
        enable_async_checkpointing=async_save,
        create=True,
        async_options=async_options,
    )
    return ocp.CheckpointManager(directory, options=options, item_names=ITEMS)


def _after_finalize(directory: str):
    if jax.process_index() == 0:
        integrity.write_missing_manifests(directory)


def save(manager: ocp.CheckpointManager, step: int, state, data_state: dict, meta: dict):
    """Starts an asynchronous save of step `step` (skipped when that step is already saved).

    DiskFullError (one line: the checkpoint, the space it needs) when this or the previous save ran out
    of space on any process, raised by every process alike (`_agreed_disk_full`); the failed save's
    temporary directory is removed and older checkpoints stay intact.
    """
    if step in manager.all_steps():
        return
    args = ocp.args.Composite(
        state=ocp.args.StandardSave(state), data=ocp.args.JsonSave(data_state), meta=ocp.args.JsonSave(meta)
    )
    needed = state_bytes(state)
    # The previous save's error first, agreed before any process starts this save's collective part.
    _agreed_disk_full(manager, needed, manager.wait_until_finished)

    def start():
        manager.save(step, args=args)
        if not manager.is_saving_in_progress():  # finalised: a synchronous save (no callback), or an
            # asynchronous one whose callback has already run (then no manifest is missing)
            _after_finalize(str(manager.directory))

    _agreed_disk_full(manager, needed, start)


def finish(manager: ocp.CheckpointManager, state):
    """Waits for the save in flight (its manifest included); DiskFullError as in `save`."""

    def wait():
        manager.wait_until_finished()
        _after_finalize(str(manager.directory))

    _agreed_disk_full(manager, state_bytes(state), wait)


def _agreed_disk_full(manager, needed_bytes: int, action):
    """Runs `action` (part of a save); when it ran out of space on any process, every process raises the
    same DiskFullError: the first such process's line, naming it when there are several. A process that
    went on while another stopped would wait in the next collective for a peer that never comes."""
    error = None
    try:
        with _disk_full_as_error(manager, needed_bytes):
            action()
    except DiskFullError as exc:
        error = exc
    lines = distributed.agree("" if error is None else str(error))
    found = [(i, line) for i, line in enumerate(lines) if line]
    if not found:
        return
    if jax.process_count() == 1:
        raise error
    where, line = found[0]
    raise DiskFullError(f"process {where} of {jax.process_count()}: {line}") from error


def state_bytes(state) -> int:
    """Global bytes of the state's arrays: what one checkpoint of it occupies, before compression."""
    return sum(int(np.prod(x.shape)) * np.dtype(x.dtype).itemsize for x in jax.tree.leaves(state))


class _disk_full_as_error:
    """Context manager: a save that failed for lack of space -> DiskFullError, its tmp directory removed."""

    def __init__(self, manager, needed_bytes: int):
        self.manager, self.needed = manager, needed_bytes

    def __enter__(self):
        return self

    def __exit__(self, kind, exc, tb):
        if exc is None or not isinstance(exc, Exception) or not _is_disk_full(exc):
            return False
        directory = str(self.manager.directory)
        failed = _remove_failed_save(self.manager) if jax.process_index() == 0 else []
        name = os.path.join(directory, failed[0].split(".")[0]) if failed else directory
        steps = integrity.step_dirs(directory)
        kept = f"checkpoint {steps[max(steps)]} is intact" if steps else "there is no earlier checkpoint"
        free = shutil.disk_usage(directory).free
        raise DiskFullError(
            f"no space left on the device while writing checkpoint {name}: it needs about "
            f"{self.needed / 1e9:.2f} GB, {free / 1e9:.2f} GB are free; {kept}; free space or lower "
            "--config.keep_checkpoints"
        ) from exc


def _remove_failed_save(manager) -> list[str]:
    """Removes the temporary directory of a failed save; returns its name(s). orbax's threads of that save
    may still write into it after the error surfaced, so the manager is closed first and the removal is
    repeated until the directory stays gone (the next start removes any that is left)."""
    try:
        manager.close()
    except Exception:  # the save's own error, raised again
        pass
    removed = []
    for _ in range(20):
        names = integrity.remove_orbax_tmp_dirs(str(manager.directory))
        removed += [n for n in names if n not in removed]
        if removed and not names:
            break
        time.sleep(0.25)
    return removed


def _is_disk_full(exc: BaseException) -> bool:
    seen = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(exc)  # tensorstore: "RESOURCE_EXHAUSTED: Error writing ..."; not XLA's out-of-memory
        if "No space left on device" in text or ("RESOURCE_EXHAUSTED" in text and "Error writing" in text):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


def abstract_like(state, shardings):
    """ShapeDtypeStructs with the target shardings: what `restore` lays the arrays out as."""
    return jax.tree.map(lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), state, shardings)


def restore(manager, abstract_state, step: int):
    """(state, data_state, meta) of `step`, without verification (see `restore_newest_good`)."""
    args = ocp.args.Composite(
        state=ocp.args.StandardRestore(abstract_state),
        data=ocp.args.JsonRestore(),
        meta=ocp.args.JsonRestore(),
    )
    restored = manager.restore(step, args=args)
    return restored.state, restored.data, restored.meta


@dataclasses.dataclass
class Restored:
    state: object
    meta: dict
    step: int


def restore_newest_good(
    manager, abstract_state, train_iter, *, may_move: bool = True, max_step: int | None = None
) -> Restored | None:
    """The newest checkpoint that verifies and restores, with the data iterator set to it; None when there
    is no checkpoint at all (steps above `max_step` are not considered). A bad one is reported in one line
    (stderr) and moved to the quarantine (only with `may_move`: never in another run's directory);
    CheckpointError when every checkpoint is bad.

    A checkpoint whose manifest verifies but does not fit this run (another model or data config) raises
    CheckpointError without moving anything: it is not corrupt.
    """
    directory = str(manager.directory)
    tried = [s for s in integrity.step_dirs(directory) if max_step is not None and s > max_step]
    skipped = len(tried)
    while (step := _newest_verified(directory, may_move, tried)) is not None:
        step_dir = os.path.join(directory, str(step))
        restored, reason = _restore_everywhere(manager, abstract_state, train_iter, step)
        if restored is None:
            _report_bad(step_dir, f"unverified and unreadable: {reason}", may_move)
            tried.append(step)
            continue
        state, meta = restored
        if len(tried) > skipped:
            log.warning(f"restored checkpoint {step_dir}, the newest good one")
        return Restored(state, meta, step)
    if len(tried) > skipped:
        raise CheckpointError(
            f"every checkpoint in {directory} is bad"
            + (f", moved to {os.path.join(directory, integrity.QUARANTINE)}" if may_move else "")
            + "; start again in a new --workdir (or remove the checkpoints) to train from scratch"
        )
    return None


def _restore_everywhere(manager, abstract_state, train_iter, step: int):
    """((state, meta), None) when every process restored `step` (the data iterator set to it), else
    (None, the first failure's one-line reason), alike on every process (`distributed.agree`). A verified
    step that fails raises instead: CheckpointError (it fits another config) on every process, or the
    error itself, with its traceback, on a process where it was not a ValueError or KeyError (a bug)."""
    step_dir = os.path.join(str(manager.directory), str(step))
    manager.reload()
    failure, restored = None, None
    try:
        state, data_state, meta = restore(manager, abstract_state, step)
        _check_meta(meta)
        train_iter.set_state(data_state)
        restored = (state, meta)
    except Exception as exc:
        failure = exc
    reason = (
        "" if failure is None else (str(failure).strip().splitlines() or [type(failure).__name__])[0][:200]
    )
    found = [(i, r) for i, r in enumerate(distributed.agree(reason)) if r]
    if not found:
        return restored, None
    where, reason = found[0]
    reason += f", on process {where}" if jax.process_count() > 1 else ""
    if not integrity.has_manifest(step_dir):
        return None, reason
    if failure is not None and not isinstance(failure, ValueError | KeyError):
        raise failure
    raise CheckpointError(
        f"checkpoint {step_dir} is intact but does not fit this run ({reason}); use the config it was "
        "written with (model.scan_layers too: it sets the params' layout), or a new --workdir"
    ) from failure


def _check_meta(meta):
    missing = [k for k in META_KEYS if not isinstance(meta, dict) or k not in meta]
    if missing:
        raise DataError(f"meta lacks {missing}")


def _newest_verified(directory: str, may_move: bool, tried: list[int]) -> int | None:
    """The newest step not yet tried whose manifest verifies (or that has none: restored unverified); bad
    steps are appended to `tried`. Every process verifies its share of the step's files and the verdicts
    are agreed (`distributed.agree`): a file that is bad for one process only makes the step bad for all,
    so that every process restores the same step (or none). The candidate is process 0's."""
    index, count = jax.process_index(), jax.process_count()
    while True:
        candidates = [s for s in sorted(integrity.step_dirs(directory), reverse=True) if s not in tried]
        step = int(distributed.agree(str(candidates[0] if candidates else -1))[0])
        if step < 0:
            return None
        step_dir = os.path.join(directory, str(step))
        if not integrity.has_manifest(step_dir):
            problem = ""
            if index == 0:
                log.warning(
                    f"checkpoint {step_dir} has no manifest (older fp4jax, or stopped before writing it): "
                    "restoring it unverified"
                )
        else:
            problem = integrity.verify(step_dir, share=(index, count)) or ""
        found = [(i, p) for i, p in enumerate(distributed.agree(problem)) if p]
        if not found:
            return step
        where, problem = found[0]
        _report_bad(step_dir, problem if count == 1 else f"{problem} (seen by process {where})", may_move)
        tried.append(step)


def _report_bad(step_dir: str, problem: str, may_move: bool):
    where = ""
    if may_move and jax.process_index() == 0:
        where = f"; moved to {integrity.quarantine(step_dir, problem)}"
    log.warning(f"checkpoint {step_dir} is bad: {problem}{where}; trying the next older one")


def open_init_checkpoint(path: str) -> tuple[ocp.CheckpointManager, int | None]:
    """(read-only manager, newest step to consider) over another run's checkpoints: its workdir, its
    checkpoints/, or one step's directory (then that step, or an older one if it is bad)."""
    path, max_step = os.path.abspath(path), None
    base = os.path.basename(path)
    if base.isdigit() and os.path.isdir(os.path.join(path, "state")):
        path, max_step = os.path.dirname(path), int(base)
    elif os.path.isdir(os.path.join(path, "checkpoints")):
        path = os.path.join(path, "checkpoints")
    options = ocp.CheckpointManagerOptions(read_only=True, create=False)
    return ocp.CheckpointManager(path, options=options, item_names=ITEMS), max_step


# ----------------------------------------------------------------------------------------------------
# another run's checkpoints, read by step (a branch's source, the study's instruments)


def run_step_dirs(run: str, label: str) -> dict[int, str]:
    """{step: directory} of the checkpoints of the run at `run`: its workdir (which holds checkpoints/) or
    a checkpoints directory itself. ConfigError (a ValueError) of one line when there is none; `label`
    names the option that gave `run` (e.g. "init_from")."""
    base = checkpoints_dir(run)
    found = integrity.step_dirs(base if os.path.isdir(base) else os.path.abspath(run))
    if not found:
        raise ConfigError(f"{label} {run} has no checkpoints/ with a step in it; pass a run's workdir")
    return found


def run_step_dir(run: str, step: int, *, label: str, fix: str) -> str:
    """The directory of checkpoint `step` of the run at `run` (as `run_step_dirs` finds them), unverified
    (see `verify_step_dir`); ConfigError of one line naming the steps the run has, ending in `fix` (how the
    caller's option picks another), when there is no such checkpoint."""
    steps = run_step_dirs(run, label)
    if step not in steps:
        have = ", ".join(str(s) for s in sorted(steps))
        raise ConfigError(f"{label} {run} has no checkpoint at step {step} (it has: {have}); {fix}")
    return steps[step]


def verify_step_dir(step_dir: str, label: str, fix: str) -> None:
    """CheckpointError of one line (ending in `fix`) unless the step's manifest verifies: process 0 reads
    it and every process gets its answer. A step without a manifest passes unverified, with a warning (as
    on resume)."""
    problem = None
    if jax.process_index() == 0:
        if not integrity.has_manifest(step_dir):
            log.warning(f"{label} checkpoint {step_dir} has no manifest: restoring it unverified")
        else:
            problem = integrity.verify(step_dir)
    bad = problem is not None
    if jax.process_count() > 1:
        bad = bool(multihost_utils.broadcast_one_to_all(np.int32(bad)))
    if bad:
        raise CheckpointError(f"{label} checkpoint {step_dir} is bad: {problem or 'see process 0'}; {fix}")


def verified_run_step_dir(run: str, step: int, *, label: str, fix: str, bad_fix: str) -> str:
    """The directory of checkpoint `step` of the run at `run`, found (`run_step_dir`: ConfigError ending in
    `fix`) and its manifest verified (`verify_step_dir`: CheckpointError ending in `bad_fix`): what every
    reader of another run's checkpoint calls before restoring from it (a branch, the instruments)."""
    step_dir = run_step_dir(run, step, label=label, fix=fix)
    verify_step_dir(step_dir, label, bad_fix)
    return step_dir
