"""Train a Llama on C4, MLPerf llama3.1_8b style, with a quantized GEMM recipe.

    python -m fp4jax.train --config configs/tiny_c4_h16.py [--workdir DIR] [--config.KEY=VALUE ...]

`main` only parses flags; `train(config, workdir)` is the importable entry point and returns the run's
summary (also written to <workdir>/summary.json). The run resumes from the latest checkpoint in
<workdir>/checkpoints and continues bit-identically. Exit codes: 0 done (target reached, budget spent or
preempted by SIGTERM after a clean save), 2 bad input (one line on stderr, "error: ..."), 3 non-finite loss
or gradient (the last good checkpoint is kept). Formats: docs/training.md.
"""

import dataclasses
import functools
import json
import math
import os
import signal
import sys
import time

import jax
import ml_collections
import numpy as np
from absl import flags
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec
from ml_collections import config_flags

from fp4jax.data import DataError, load_tokenizer, make_eval_batches, make_train_iterator
from fp4jax.models.llama import Llama, flops_per_token, llama_config, padded_vocab_size
from fp4jax.models.sharding import (
    batch_sharding,
    check_global_batch,
    data_parallel_size,
    init_sharded,
    make_mesh,
    sharding_context,
)
from fp4jax.ops import get_recipe
from fp4jax.training import checkpoint, metrics
from fp4jax.training.optimizer import make_optimizer, mlperf_lr
from fp4jax.training.state import eval_step, make_init_fn, train_step

INIT_KEY_SALT, QUANT_KEY_SALT = 0, 1


class NonFiniteError(RuntimeError):
    """The loss or the gradient norm of an update was NaN or Inf."""


# ----------------------------------------------------------------------------------------------------
# set-up


def initialize_distributed():
    """jax.distributed.initialize() under SLURM with several tasks (jax reads SLURM's environment), or with
    JAX_COORDINATOR_ADDRESS plus JAX_NUM_PROCESSES and JAX_PROCESS_ID; nothing for a single process."""
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        jax.distributed.initialize()
    elif "JAX_COORDINATOR_ADDRESS" in os.environ:
        count, index = os.environ.get("JAX_NUM_PROCESSES"), os.environ.get("JAX_PROCESS_ID")
        jax.distributed.initialize(
            num_processes=None if count is None else int(count),
            process_id=None if index is None else int(index),
        )


def resolve_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy with the derived defaults filled in: MLPerf LR and warmup by global batch."""
    config = ml_collections.ConfigDict(config.to_dict())
    opt = config.optimizer
    if opt.peak_lr is None or opt.warmup_steps is None:
        peak_lr, warmup = mlperf_lr(config.global_batch)
        opt.peak_lr = peak_lr if opt.peak_lr is None else opt.peak_lr
        opt.warmup_steps = warmup if opt.warmup_steps is None else opt.warmup_steps
    for key in ("steps", "global_batch", "seq_len", "grad_accum", "eval_sequences", "eval_batch_size"):
        if config[key] < 1:
            raise ValueError(f"config {key} must be >= 1, got {config[key]}")
    return config


def build_model(config, tokenizer):
    """(Llama module, LlamaConfig): the size preset with the config's non-None `model` overrides."""
    overrides = {k: v for k, v in config.model.items() if k != "size" and v is not None}
    overrides.setdefault("vocab_size", padded_vocab_size(tokenizer.vocab_size))
    if overrides["vocab_size"] < tokenizer.vocab_size:
        raise ValueError(
            f"model.vocab_size {overrides['vocab_size']} is smaller than tokenizer {tokenizer.name}'s "
            f"{tokenizer.vocab_size}; leave model.vocab_size unset to derive it"
        )
    model_cfg = llama_config(config.model.size, **overrides)
    if model_cfg.max_seq_len < config.seq_len:
        model_cfg = dataclasses.replace(model_cfg, max_seq_len=config.seq_len)
    return Llama(model_cfg, recipe=config.recipe), model_cfg


def check_batch(config, mesh):
    """The global batch (and each micro-batch) must split evenly over the data-parallel devices."""
    check_global_batch(config.global_batch, mesh)
    shards = data_parallel_size(mesh)
    micro, rem = divmod(config.global_batch, config.grad_accum)
    if rem:
        raise ValueError(
            f"global_batch {config.global_batch} is not divisible by grad_accum {config.grad_accum}; "
            "set --config.global_batch to a multiple of grad_accum"
        )
    if micro % shards:
        raise ValueError(
            f"micro-batch {micro} (global_batch {config.global_batch} / grad_accum {config.grad_accum}) is "
            f"not divisible by the {shards} data-parallel shards (mesh data x fsdp); set "
            f"--config.global_batch to a multiple of {shards * config.grad_accum} or change --config.mesh"
        )
    evaluating = config.eval_every_sequences > 0 or config.eval_at_end
    if evaluating and (config.eval_batch_size % shards or config.eval_sequences % config.eval_batch_size):
        raise ValueError(
            f"eval_batch_size {config.eval_batch_size} must be a multiple of the {shards} data-parallel "
            f"shards and divide eval_sequences {config.eval_sequences}; adjust --config.eval_batch_size"
        )


def init_train_state(model, tx, mesh, seed: int, seq_len: int):
    """(step-0 TrainState, its shardings): initialised directly into the sharded layout."""
    init_key = jax.random.fold_in(jax.random.key(seed), INIT_KEY_SALT)
    init_fn = make_init_fn(model, tx, (data_parallel_size(mesh), min(seq_len, 64)))
    return init_sharded(init_fn, mesh, init_key)


def jit_steps(config, model, tx, schedule, mesh, shardings):
    """(train step, eval step): each jitted once with explicit shardings; the train step donates the state."""
    needs_key = get_recipe(config.recipe).needs_key
    batch_sh = batch_sharding(mesh)
    replicated = NamedSharding(mesh, PartitionSpec())
    micro_sh = NamedSharding(mesh, PartitionSpec(None, *batch_sh.spec))
    step = functools.partial(
        train_step,
        model=model,
        tx=tx,
        schedule=schedule,
        needs_key=needs_key,
        grad_accum=config.grad_accum,
        micro_sharding=micro_sh,
        nan_at_step=config.debug_nan_at_step,
    )
    batch_shs = {"inputs": batch_sh, "targets": batch_sh}
    train_fn = jax.jit(
        step,
        in_shardings=(shardings, batch_shs, replicated),
        out_shardings=(shardings, replicated),
        donate_argnums=0,
    )
    eval_fn = jax.jit(
        functools.partial(eval_step, model=model, needs_key=needs_key),
        in_shardings=(shardings, batch_shs, replicated),
        out_shardings=replicated,
    )
    return train_fn, eval_fn


def device_batch(local_batch: dict, mesh) -> dict:
    """Process-local numpy rows -> global jax arrays laid out as the model's batch sharding."""
    sharding = batch_sharding(mesh)
    return {
        k: jax.make_array_from_process_local_data(sharding, np.asarray(v)) for k, v in local_batch.items()
    }


def load_eval_set(config, tokenizer, mesh) -> list[dict]:
    """The fixed validation batches, on device ([] when the run never evaluates)."""
    if config.eval_every_sequences <= 0 and not config.eval_at_end:
        return []
    local = make_eval_batches(
        config.data,
        tokenizer,
        seq_len=config.seq_len,
        num_sequences=config.eval_sequences,
        batch_size=config.eval_batch_size,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    return [device_batch(b, mesh) for b in local]


def evaluate(eval_fn, state, eval_batches, quant_key) -> float:
    """Mean next-token loss (nats) over the fixed validation set."""
    sums = jax.device_get([eval_fn(state, batch, quant_key) for batch in eval_batches])
    return float(sum(np.float64(total) for total, _ in sums) / sum(np.float64(n) for _, n in sums))


class Preemption:
    """SIGTERM sets a flag; the loop saves at the next step boundary and exits cleanly.

    With several processes, each may get the signal at a different step, so the flag is agreed on (an
    all-gather, which waits for the step in flight) every SYNC_EVERY steps, and all save the same step.
    """

    SYNC_EVERY = 5

    def __init__(self):
        self.requested = False
        self._previous = None

    def __enter__(self):
        try:
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        except ValueError:  # not the main thread: no signal handling
            self._previous = None
        return self

    def _handle(self, signum, frame):
        self.requested = True

    def __exit__(self, *exc):
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)

    def agreed(self, step: int) -> bool:
        """True when this run must stop after `step` (the same answer on every process)."""
        if jax.process_count() == 1:
            return self.requested
        if step % self.SYNC_EVERY:
            return False
        return bool(multihost_utils.process_allgather(np.int32(self.requested)).any())


def check_finite(step: int, record: dict):
    for key in ("loss", "grad_norm"):
        if not math.isfinite(record[key]):
            raise NonFiniteError(
                f"non-finite {key} ({record[key]}) at step {step}; the last good checkpoint is kept; "
                "lower optimizer.peak_lr or try a more stable recipe"
            )


def write_summary(workdir: str, summary: dict):
    if jax.process_index() == 0:
        with open(os.path.join(workdir, "summary.json"), "w", encoding="utf-8") as f:
            json.dump(summary, f, indent=2, sort_keys=True)
            f.write("\n")
        print("summary: " + json.dumps(summary, sort_keys=True), flush=True)


# ----------------------------------------------------------------------------------------------------
# the run


def train(config: ml_collections.ConfigDict, workdir: str) -> dict:
    """Trains until the eval target, the step/token budget or SIGTERM; returns the run's summary.

    Bad input (unknown preset, a mesh that does not fit the devices, an indivisible batch, a missing data
    or checkpoint path) raises ValueError / DataError / FileNotFoundError with a one-line message before
    any compilation; a non-finite loss or gradient raises NonFiniteError naming the step.
    """
    config = resolve_config(config)
    get_recipe(config.recipe)  # unknown preset: ValueError listing the presets, before any work
    mesh = make_mesh(data=config.mesh.data, fsdp=config.mesh.fsdp, tensor=config.mesh.tensor)
    check_batch(config, mesh)
    if config.init_checkpoint and not os.path.isdir(config.init_checkpoint):
        raise FileNotFoundError(
            f"init_checkpoint {config.init_checkpoint} does not exist; fix the path or set it to ''"
        )
    with sharding_context(mesh):
        return _train(config, workdir, mesh)


def _train(config, workdir, mesh) -> dict:
    tokenizer = load_tokenizer(config.data.tokenizer)
    model, model_cfg = build_model(config, tokenizer)
    tx, schedule = make_optimizer(config.optimizer)
    train_iter = make_train_iterator(
        config.data,
        tokenizer,
        seq_len=config.seq_len,
        global_batch=config.global_batch,
        seed=config.seed,
        process_index=jax.process_index(),
        process_count=jax.process_count(),
    )
    eval_batches = load_eval_set(config, tokenizer, mesh)
    os.makedirs(workdir, exist_ok=True)

    state, shardings = init_train_state(model, tx, mesh, config.seed, config.seq_len)
    manager = checkpoint.make_manager(
        workdir, keep=config.keep_checkpoints, async_save=config.async_checkpointing
    )
    meta = {"evals": [], "target_step": None}  # progress that is not an array; checkpointed with the state
    restore_from = manager if manager.latest_step() is not None else config.init_checkpoint or None
    if restore_from is not None:
        state, data_state, meta = checkpoint.restore(restore_from, checkpoint.abstract_like(state, shardings))
        train_iter.set_state(data_state)
    start_step = int(state.step)
    train_fn, eval_fn = jit_steps(config, model, tx, schedule, mesh, shardings)
    quant_key = jax.random.fold_in(jax.random.key(config.seed), QUANT_KEY_SALT)

    tokens_per_step = config.global_batch * config.seq_len
    total_steps = (
        min(config.steps, config.max_tokens // tokens_per_step) if config.max_tokens else config.steps
    )
    if meta["target_step"] is not None and config.stop_at_target:
        total_steps = start_step  # a run that reached its target, restarted: nothing left to do
    mfu_scale = mfu_denominator(model_cfg, config.seq_len)
    writer = metrics.MetricsWriter(workdir, tensorboard=config.tensorboard, resume_step=start_step)
    progress = make_progress_bar(config, total_steps, start_step)

    def fetch(step, device_metrics, t_start) -> dict:
        """Waits for update `step`, checks it, and returns its metrics line (the one-step-behind fetch)."""
        record = {k: float(v) for k, v in jax.device_get(device_metrics).items()}
        check_finite(step, record)
        step_time = time.perf_counter() - t_start
        record.update(
            step=step,
            sequences=step * config.global_batch,
            tokens=step * tokens_per_step,
            step_time_s=step_time,
            tokens_per_s=tokens_per_step / step_time,
        )
        if mfu_scale:
            record["mfu"] = record["tokens_per_s"] * mfu_scale
        if progress is not None:
            progress.update(step - progress.n)
            progress.set_postfix(loss=f"{record['loss']:.3f}", refresh=False)
        return record

    status, t_run = "budget_exhausted", time.perf_counter()
    pending = None  # (step, device metrics, start time) of the update not yet fetched
    try:
        with Preemption() as preemption:
            t_last = time.perf_counter()
            for step in range(start_step + 1, total_steps + 1):
                batch = device_batch(next(train_iter), mesh)
                state, step_metrics = train_fn(state, batch, quant_key)
                if pending is not None:
                    writer.write(fetch(*pending))
                    t_last = time.perf_counter()
                pending = (step, step_metrics, t_last)

                seqs = step * config.global_batch
                eval_due = crossed(seqs, config.global_batch, config.eval_every_sequences) or (
                    step == total_steps and config.eval_at_end
                )
                ckpt_due = config.checkpoint_every_steps > 0 and step % config.checkpoint_every_steps == 0
                preempted = preemption.agreed(step)
                if not (eval_due or ckpt_due or preempted or step == total_steps):
                    continue
                # A boundary: the state after `step` is checked (finite) before it is evaluated or saved.
                writer.write(fetch(*pending))
                pending = None
                if eval_due:
                    t_eval = time.perf_counter()
                    eval_loss = evaluate(eval_fn, state, eval_batches, quant_key)
                    meta["evals"].append([step, seqs, eval_loss])
                    if eval_loss <= config.target_eval_loss and meta["target_step"] is None:
                        meta["target_step"] = step
                    eval_time = time.perf_counter() - t_eval
                    writer.write(
                        {
                            "step": step,
                            "loss": eval_loss,
                            "eval_loss": eval_loss,
                            "sequences": seqs,
                            "tokens": step * tokens_per_step,
                            "eval_time_s": eval_time,
                        }
                    )
                stop = preempted or (config.stop_at_target and meta["target_step"] == step)
                if ckpt_due or stop or step == total_steps:
                    data_state = train_iter.get_state()
                    checkpoint.save(manager, step, state, data_state, dict(meta, config=config.to_dict()))
                if stop:
                    status = "preempted" if preempted else "target_reached"
                    break
                t_last = time.perf_counter()
    finally:
        manager.wait_until_finished()  # a save in flight is of a checked state: let it complete
        writer.close()
        if progress is not None:
            progress.close()

    summary = run_summary(config, meta, status, int(state.step), tokens_per_step)
    summary["wall_time_s"] = time.perf_counter() - t_run
    write_summary(workdir, summary)
    return summary


def crossed(sequences: int, global_batch: int, every: int) -> bool:
    """True when the last update's batch took the sequence count past a multiple of `every`."""
    return every > 0 and sequences // every > (sequences - global_batch) // every


def mfu_denominator(model_cfg, seq_len: int) -> float | None:
    """MFU per token/s: training FLOPs per token / (peak FLOP/s of all devices); None when the peak is
    unknown (CPU)."""
    peak = metrics.peak_flops_per_device(jax.devices()[0].device_kind)
    return flops_per_token(model_cfg, seq_len) / (peak * jax.device_count()) if peak else None


def make_progress_bar(config, total_steps: int, start_step: int):
    if not config.progress_bar or jax.process_index() != 0:
        return None
    from tqdm import tqdm

    return tqdm(total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True)


def run_summary(config, meta: dict, status: str, end_step: int, tokens_per_step: int) -> dict:
    """The run's result: tokens (sequences, steps) to reach the eval target, null when not reached."""
    target_step, evals = meta["target_step"], meta["evals"]
    if target_step is not None and status != "preempted":
        status = "target_reached"
    return {
        "status": status,
        "recipe": config.recipe,
        "steps": end_step,
        "sequences": end_step * config.global_batch,
        "tokens": end_step * tokens_per_step,
        "target_eval_loss": config.target_eval_loss,
        "steps_to_target": target_step,
        "sequences_to_target": None if target_step is None else target_step * config.global_batch,
        "tokens_to_target": None if target_step is None else target_step * tokens_per_step,
        "last_eval_loss": evals[-1][2] if evals else None,
        "evals": evals,
        "devices": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
    }


# ----------------------------------------------------------------------------------------------------
# command line


def parse_flags(argv) -> tuple[ml_collections.ConfigDict, str, bool]:
    """(config, workdir, debug) from the command line; flags live in a fresh FlagValues per call."""
    fv = flags.FlagValues()
    config_flag = config_flags.DEFINE_config_file(
        "config", None, "ml_collections config file (configs/*.py)", flag_values=fv, sys_argv=list(argv)
    )
    flags.DEFINE_string("workdir", None, "run directory; default runs/<config file name>", flag_values=fv)
    flags.DEFINE_bool("debug", False, "Python tracebacks instead of one-line errors", flag_values=fv)
    if any(a in ("-h", "--help", "--helpfull") for a in argv[1:]):
        print(__doc__ + "\nflags:\n" + fv.get_help())
        raise SystemExit(0)
    fv(argv)
    if fv.config is None:
        raise ValueError("--config is required, e.g. --config configs/tiny_c4_h16.py")
    path = config_flags.get_config_filename(fv["config"])
    if not os.path.isfile(path):
        raise FileNotFoundError(f"config file {path} does not exist; the configs are in configs/*.py")
    config = config_flag.value
    name = os.path.splitext(os.path.basename(path))[0]
    return config, fv.workdir or os.path.join("runs", name), fv.debug


def _flag_error(exc: Exception, argv) -> str:
    """One line for a bad command line; config_flags reports an unknown key as an unknown flag or a bare
    KeyError, depending on where it is found."""
    key = None
    if isinstance(exc, flags.UnrecognizedFlagError) and exc.flagname.startswith("config."):
        key = exc.flagname
    elif isinstance(exc, AttributeError | KeyError):
        name = str(exc.args[0] if exc.args else exc).strip("\"'")
        key = next((a[2:].split("=")[0] for a in argv if a.startswith("--config.") and name in a), None)
    if key:
        return f"unknown config key --{key}: the valid keys are those of configs/base.py"
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


def _add_config_root(argv):
    """Puts the directory holding configs/ on sys.path, so a config file can `from configs import base`."""
    paths = [a.split("=", 1)[1] for a in argv if a.startswith("--config=")]
    paths += [b for a, b in zip(argv, argv[1:], strict=False) if a == "--config"]
    for path in paths:
        root = os.path.dirname(os.path.dirname(os.path.abspath(path)))
        if root not in sys.path:
            sys.path.insert(0, root)


def _fail(message: str, code: int = 2) -> int:
    print(f"error: {message}", file=sys.stderr, flush=True)
    return code


def main(argv=None) -> int:
    """The command line. Returns the exit code: 0 done, 2 bad input, 3 non-finite loss or gradient."""
    argv = sys.argv if argv is None else list(argv)
    debug = "--debug" in argv
    _add_config_root(argv)
    try:
        config, workdir, debug = parse_flags(argv)
        initialize_distributed()
        train(config, workdir)
    except NonFiniteError as exc:
        if debug:
            raise
        return _fail(str(exc), code=3)
    except (
        flags.Error,
        AttributeError,
        KeyError,
        TypeError,
        ValueError,
        DataError,
        OSError,
        SyntaxError,
    ) as exc:
        if debug:
            raise
        return _fail(_flag_error(exc, argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
