"""The training run: set-up, restore, the loop of updates, evaluations, checkpoints and the summary.

`train(config, workdir)` is the entry point (python -m fp4jax.train only parses flags and calls it). The
loop reads top to bottom in `_run_updates`; each update s:
  probe (every diagnostics.every updates) -> dispatch update s -> prepare batch s + 1 while it runs ->
  [dispatch update s + 1 ahead] -> fetch update s's metrics (waits for it) -> divergence guard ->
  metrics line -> evaluation, checkpoint or stop, when due.
Dispatching ahead (config.dispatch_ahead) keeps the device busy while the host fetches, logs and
dispatches: it is done only after updates that the schedule leaves plain (no evaluation or checkpoint
due after s, no probe before s + 1, no profile starting or stopping), a rule every process computes
alike. A stop requested meanwhile is honoured after update s + 1; a divergence at s discards s + 1.
A state is evaluated or saved only after its metrics were fetched and found finite.
"""

import dataclasses
import time

import jax
import ml_collections

from fp4jax.data import DataError, make_train_iterator
from fp4jax.models.llama import flops_per_token
from fp4jax.models.sharding import sharding_context
from fp4jax.training import (
    branch,
    checkpoint,
    distributed,
    evaluation,
    hooks,
    integrity,
    metrics,
    setup,
    weights,
)
from fp4jax.training import summary as summaries
from fp4jax.training.divergence import DivergenceGuard, describe
from fp4jax.training.preemption import StopSignals

__all__ = ["Run", "build_run", "data_hint", "load_data", "restore", "run_loop", "train"]


@dataclasses.dataclass
class Run:
    """Everything the loop needs; `state` and `meta` change as it runs."""

    config: ml_collections.ConfigDict
    workdir: str
    mesh: object
    train_iter: object
    eval_batches: list
    manager: object
    state: object
    meta: dict  # evals, target_step, guard: progress that is not an array, saved with the state
    resumed_from: int | None
    train_fn: object
    eval_fn: object
    quant_key: object
    probe: object
    mfu_per_token_s: float | None
    last_step: int
    final_eval_batches: list = dataclasses.field(default_factory=list)  # config.final_eval_sequences

    @property
    def start_step(self) -> int:
        return 0 if self.resumed_from is None else self.resumed_from


def train(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Trains until the eval target, the step/token budget, a divergence or a stop signal; returns the
    summary (also <workdir>/summary.json). A finished run is left untouched and its summary returned.

    Bad input raises a UserError or DataError with a one-line message before anything is compiled. A run
    that fails before its first update leaves no directory it created (a workdir that existed stays).
    """
    config = setup.resolve_config(config)
    last_step = setup.total_steps(config)
    done = summaries.finished_summary(workdir, config, last_step)
    if done is not None:
        summaries.say(summaries.finished_line(workdir, done, config))
        return done
    new_directory = setup.new_directory(workdir)  # removed again if the run fails to start
    started = False
    try:
        workdir = setup.prepare_workdir(workdir)
        mesh = setup.make_run_mesh(config)
        setup.check_init_checkpoint(config)
        weights.check_config(config, workdir)
        branch.check_config(config, workdir)
        with sharding_context(mesh), distributed.lost_process_reported():
            run = build_run(config, workdir, mesh, last_step)
            started = True
            return run_loop(run)
    except BaseException:
        if not started:
            setup.remove_new_directory(new_directory)
        raise


def build_run(config, workdir: str, mesh, last_step: int) -> Run:
    """Model, data, state (restored from the newest good checkpoint, if any), jitted steps."""
    tokenizer, model, model_cfg, tx, schedule = setup.build_model_and_optimizer(config)
    train_iter, eval_batches, final_eval_batches = load_data(config, tokenizer, mesh)
    # The step-0 state is initialised only where nothing is restored into its abstract form.
    abstract, shardings, init_state = setup.lazy_train_state(model, tx, mesh, config.seed, config.seq_len)
    manager = checkpoint.make_manager(
        workdir,
        keep=config.keep_checkpoints,
        async_save=config.async_checkpointing,
        keep_steps=tuple(config.keep_checkpoint_steps),
    )
    restored = restore(config, manager, checkpoint.abstract_like(abstract, shardings), train_iter)
    meta = {"evals": [], "target_step": None, "guard": {}}
    if restored is not None:
        state, meta = restored.state, {**meta, **restored.meta}
    else:
        state = init_state()
        if config.init_params:
            state, started = weights.start_from_params(config, state, shardings, model_cfg)
            meta.update(started)
    train_fn, eval_fn = setup.jit_steps(config, model, tx, schedule, mesh, shardings)
    peak = metrics.peak_flops_per_device(jax.devices()[0].device_kind)
    return Run(
        config=config,
        workdir=workdir,
        mesh=mesh,
        train_iter=train_iter,
        eval_batches=eval_batches,
        manager=manager,
        state=state,
        meta=meta,
        resumed_from=None if restored is None else int(state.step),
        train_fn=train_fn,
        eval_fn=eval_fn,
        quant_key=setup.quant_key(config.seed),
        probe=hooks.make_probe(config, model),
        mfu_per_token_s=flops_per_token(model_cfg, config.seq_len) / (peak * jax.device_count())
        if peak
        else None,
        last_step=last_step,
        final_eval_batches=final_eval_batches,
    )


def load_data(config, tokenizer, mesh):
    """(training iterator, device eval batches, device final-eval batches); DataError messages say which
    flag to set."""
    try:
        train_iter = make_train_iterator(
            config.data,
            tokenizer,
            seq_len=config.seq_len,
            global_batch=config.global_batch,
            seed=config.seed,
            process_index=jax.process_index(),
            process_count=jax.process_count(),
        )
        eval_batches = evaluation.load_eval_set(config, tokenizer, mesh)
        return train_iter, eval_batches, evaluation.load_final_eval_set(config, tokenizer, mesh)
    except DataError as exc:
        raise DataError(data_hint(str(exc))) from exc


def data_hint(message: str) -> str:
    """fp4jax.data's message with the command-line flag that fixes it."""
    message = message.replace("set on_bad_record='skip'", "set --config.data.on_bad_record=skip")
    if message.startswith(("no files match", "data directory", "data path")):
        message += "; set --config.data.path to the directory that holds the data files (docs/data.md)"
    return message


def restore(config, manager, abstract_state, train_iter):
    """The workdir's newest good checkpoint, else the branch start of init_from (training.branch), else
    init_checkpoint's, else None (start from scratch, or from init_params' params: build_run)."""
    if jax.process_index() == 0:
        integrity.remove_orbax_tmp_dirs(str(manager.directory))  # saves cut off mid-way
    restored = checkpoint.restore_newest_good(manager, abstract_state, train_iter)
    if restored is None and config.init_from:
        return branch.start_branch(config, abstract_state, train_iter)
    if restored is None and config.init_checkpoint:
        other, max_step = checkpoint.open_init_checkpoint(config.init_checkpoint)
        restored = checkpoint.restore_newest_good(
            other, abstract_state, train_iter, may_move=False, max_step=max_step
        )
    return restored


def run_loop(run: Run) -> dict:
    """Runs the updates, waits for the last save, writes and returns the summary."""
    config, t_run = run.config, time.perf_counter()
    writer = metrics.MetricsWriter(
        run.workdir,
        tensorboard=config.tensorboard,
        resume_step=run.start_step,
        progress_total=run.last_step if config.progress_bar else 0,
    )
    guard = DivergenceGuard(config.divergence.spike_nats, config.divergence.window, run.meta.get("guard"))
    try:
        with StopSignals() as signals, hooks.Profiler(config, run.workdir) as profiler:
            step, stop, divergence = _run_updates(run, writer, guard, signals, profiler)
        checkpoint.finish(run.manager, run.state)
    except BaseException as exc:
        if not isinstance(exc, KeyboardInterrupt):  # let a save in flight (of a checked state) complete
            _finish_quietly(run.manager)
        raise
    finally:
        writer.close()
    status = stop or ("diverged" if divergence else "reached" if run.meta["target_step"] else "not_reached")
    extra = {k: run.meta[k] for k in ("final_eval", "branched_from", "init_params") if k in run.meta}
    if divergence is not None:
        newest = max(integrity.step_dirs(str(run.manager.directory)), default=None)
        extra["divergence_message"] = describe(divergence, guard.last_finite(), run.resumed_from, newest)
    summary = summaries.run_summary(
        config,
        run.meta,
        status=status,
        step=step,
        devices=f"{jax.device_count()} x {jax.devices()[0].device_kind}",
        divergence=divergence,
        last_finite_losses=guard.last_finite(),
        tokens_per_s_median=summaries.median_tokens_per_s(run.workdir),
        resumed_from_step=run.resumed_from,
        wall_time_s=time.perf_counter() - t_run,
        execution=setup.resolve_run_execution(config)[1].as_dict(),
        **extra,
    )
    summaries.write_summary(run.workdir, summary)
    if status == "preempted":
        saved = integrity.step_dirs(str(run.manager.directory)).get(step)
        summaries.say(
            f"stopped by {signals.requested or 'a stop signal on another process'} after update {step}; "
            f"saved checkpoint {saved}; run the same command to continue"
        )
    return summary


@dataclasses.dataclass
class _Dispatched:
    """An update in flight: its device metrics, where a checkpoint of it resumes reading, the next batch."""

    device_metrics: dict
    data_state: dict
    next_batch: dict | None


def _run_updates(run: Run, writer, guard, signals, profiler):
    """The loop. Returns (last update run, stop status or None, Divergence or None)."""
    timer = metrics.StepTimer()
    batch, step, stop_pending = _next_batch(run), run.start_step, False
    ahead = None  # update `step`, when the previous iteration dispatched it ahead
    for step in range(run.start_step + 1, run.last_step + 1):
        probe_record = {}
        if ahead is None:
            profiler.before(step)
            probe_record = _maybe_probe(run, batch, step, timer)
            ahead = _dispatch(run, step, batch)
        current = ahead
        may_go_ahead = _may_dispatch_ahead(run, step, profiler, stop_pending)
        ahead = _dispatch(run, step + 1, current.next_batch) if may_go_ahead else None
        batch = current.next_batch
        record = _fetch(run, step, current.device_metrics, timer)
        profiler.after(step)
        divergence = guard.check(step, record)
        writer.write({**record, **probe_record})
        if divergence is not None:
            return step, None, divergence  # an update dispatched ahead is discarded, never saved
        stop_pending = stop_pending or signals.agreed(step)
        if ahead is not None:  # run.state is already update step + 1's: nothing is due after `step`
            continue
        stop = _boundary(run, step, current.data_state, stop_pending, writer, guard, timer)
        if stop:
            return step, stop, None
    return step, None, None


def _dispatch(run: Run, step: int, batch: dict) -> _Dispatched:
    """Dispatches update `step` (run.state becomes its result, still on its way) and reads batch step + 1
    while the device runs."""
    run.state, device_metrics = run.train_fn(run.state, batch, run.quant_key)
    data_state = run.train_iter.get_state()  # where a checkpoint of update `step` resumes reading
    next_batch = _next_batch(run) if step < run.last_step else None
    return _Dispatched(device_metrics, data_state, next_batch)


def _may_dispatch_ahead(run: Run, step: int, profiler, stop_pending: bool) -> bool:
    """Whether update step + 1 may be dispatched before update `step`'s metrics are fetched: nothing is
    due in between. Every input is the same on every process (stop_pending is an agreed stop)."""
    config = run.config
    return (
        config.dispatch_ahead
        and not stop_pending
        and step < run.last_step
        and not evaluation.eval_due(config, step, run.last_step)
        and not _checkpoint_due(config, step)
        and not _probe_due(run, step + 1)
        and not profiler.changes_between(step, step + 1)
    )


def _checkpoint_due(config, step: int) -> bool:
    every = config.checkpoint_every_steps
    return (every > 0 and step % every == 0) or step in config.keep_checkpoint_steps


def _next_batch(run: Run) -> dict:
    return setup.device_batch(next(run.train_iter), run.mesh)


def _probe_due(run: Run, step: int) -> bool:
    return run.probe is not None and step % run.config.diagnostics.every == 0


def _maybe_probe(run: Run, batch, step: int, timer) -> dict:
    if not _probe_due(run, step):
        return {}
    record = hooks.run_probe(run.probe, run.state, batch, run.quant_key, step)
    timer.exclude(record["diag_time_s"])
    return record


def _fetch(run: Run, step: int, device_metrics, timer) -> dict:
    """Update `step`'s metrics line: waits for the update, then takes its time."""
    config = run.config
    record = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
    step_time = timer.lap()
    tokens_per_step = config.global_batch * config.seq_len
    record.update(
        step=step,
        sequences=step * config.global_batch,
        tokens=step * tokens_per_step,
        step_time_s=step_time,
        tokens_per_s=tokens_per_step / step_time,
    )
    if run.mfu_per_token_s:
        record["mfu"] = record["tokens_per_s"] * run.mfu_per_token_s
    peak = metrics.peak_memory_gb()
    if peak is not None:
        record["peak_memory_gb"] = peak
    return record


def _boundary(
    run: Run, step: int, data_state: dict, stop_requested: bool, writer, guard, timer
) -> str | None:
    """Evaluation, checkpoint and stop decisions after update `step`; returns "preempted", "reached" or
    None (go on). Time spent here is not counted in the next update's time."""
    config = run.config
    eval_due = evaluation.eval_due(config, step, run.last_step)
    if eval_due:
        _evaluate(run, step, writer)
    if step == run.last_step and run.final_eval_batches:
        _final_evaluate(run, step, writer)
    reached = config.stop_at_target and run.meta["target_step"] == step
    stop = "preempted" if stop_requested else "reached" if reached else None
    if _checkpoint_due(config, step) or stop or step == run.last_step:
        meta = dict(run.meta, guard=guard.state(), config=config.to_dict())
        checkpoint.save(run.manager, step, run.state, data_state, meta)
        timer.restart()
    elif eval_due:
        timer.restart()
    return stop


def _final_evaluate(run: Run, step: int, writer):
    """The larger final evaluation, kept apart from the periodic ones (meta["final_eval"], saved with the
    last checkpoint and written to the summary)."""
    t0 = time.perf_counter()
    eval_loss = evaluation.evaluate(run.eval_fn, run.state, run.final_eval_batches, run.quant_key)
    record = evaluation.final_eval_record(
        run.config, step, eval_loss, run.final_eval_batches, time.perf_counter() - t0
    )
    run.meta["final_eval"] = record
    writer.write(record)
    summaries.say(
        f"update {step}: final eval loss {eval_loss:.4f} ({record['final_eval_sequences']} sequences)"
    )


def _evaluate(run: Run, step: int, writer):
    config, t0 = run.config, time.perf_counter()
    eval_loss = evaluation.evaluate(run.eval_fn, run.state, run.eval_batches, run.quant_key)
    seqs, tokens = step * config.global_batch, step * config.global_batch * config.seq_len
    run.meta["evals"].append([step, seqs, tokens, eval_loss])
    sequences = len(run.eval_batches) * config.eval_batch_size
    line = f"update {step}: eval loss {eval_loss:.4f} ({sequences} sequences)"
    if eval_loss <= config.target_eval_loss and run.meta["target_step"] is None:
        run.meta["target_step"] = step
        line += f"; target {config.target_eval_loss} reached"
    summaries.say(line)
    writer.write(
        {
            "step": step,
            "loss": eval_loss,
            "eval_loss": eval_loss,
            "sequences": seqs,
            "tokens": tokens,
            "eval_time_s": time.perf_counter() - t0,
        }
    )


def _finish_quietly(manager):
    try:
        manager.wait_until_finished()
    except Exception:  # the error being raised already says what went wrong
        pass
