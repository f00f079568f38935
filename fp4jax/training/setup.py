"""Set-up of a run before its first step: config checks, workdir, model, sharded state, jitted steps.

Every check of user input here raises a `UserError` (or `fp4jax.data.DataError`) with a one-line message
before anything is compiled; the ValueErrors of the library functions that validate config values are
re-raised as ConfigError at their call sites only, so a ValueError from a bug elsewhere stays a bug.
"""

import contextlib
import dataclasses
import functools
import logging
import os
import shutil
import tempfile

import jax
import ml_collections
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from fp4jax import xla_flags
from fp4jax.data import DataError, load_tokenizer
from fp4jax.models.llama import (
    PALLAS_ATTENTION_BLOCK,
    Llama,
    deterministic_attention,
    llama_config,
    padded_vocab_size,
    pallas_attention_fits,
)
from fp4jax.models.sharding import (
    batch_sharding,
    check_global_batch,
    data_parallel_size,
    lazy_init_sharded,
    make_mesh,
)
from fp4jax.ops import BACKENDS, QUANTIZERS, get_recipe, resolve_execution
from fp4jax.ops.recipes import high_precision_blocks, resolve_recipe
from fp4jax.training import distributed
from fp4jax.training.errors import ConfigError, WorkdirError
from fp4jax.training.optimizer import make_optimizer, mlperf_lr
from fp4jax.training.state import eval_step, make_init_fn, train_step
from fp4jax.training.summary import say

__all__ = [
    "GEMM_BACKEND_ENV",
    "QUANTIZER_ENV",
    "XLA_OPTIONS",
    "apply_xla_options",
    "build_model",
    "build_model_and_optimizer",
    "check_init_checkpoint",
    "deterministic_ops",
    "device_batch",
    "evaluating",
    "execution_overrides",
    "init_key",
    "init_train_state",
    "initialize_distributed",
    "jit_steps",
    "lazy_train_state",
    "make_run_mesh",
    "model_config",
    "new_directory",
    "prepare_workdir",
    "quant_key",
    "remove_new_directory",
    "resolve_config",
    "resolve_run_execution",
    "total_steps",
]

INIT_KEY_SALT, QUANT_KEY_SALT = 0, 1
# The environment variables a user sets to override a recipe's GEMM back end and quantizer (the library
# reads none: they are mapped onto Recipe.backend / Recipe.quantizer here, and by the self-check).
GEMM_BACKEND_ENV = "FP4JAX_GEMM_BACKEND"
QUANTIZER_ENV = "FP4JAX_QUANTIZE_IMPL"
POSITIVE_KEYS = ("steps", "global_batch", "seq_len", "grad_accum", "eval_sequences", "eval_batch_size")


@contextlib.contextmanager
def config_values(what: str = ""):
    """Re-raises the ValueError of a library call that validates config values as a ConfigError."""
    try:
        yield
    except DataError:
        raise
    except ValueError as exc:
        message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ConfigError(f"{what}{message}") from exc


def initialize_distributed():
    """jax.distributed under SLURM with several tasks or with JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES
    and JAX_PROCESS_ID, with fp4jax's timeouts and a lost process reported in one line
    (`fp4jax.training.distributed`); nothing for a single process."""
    distributed.initialize()


# The XLA options a config sets, each a boolean config key and the XLA flag it writes. Set before jax
# starts its backends: XLA reads XLA_FLAGS once.
#
# xla_gpu_triton_gemm: XLA's Triton GEMM fusions take a dot together with the elementwise ops producing
# its operands. The per-tensor FP8 GEMMs write bfloat16 with their scale in cuBLASLt's epilogue only
# through a dequantized-operand spelling (backends.fp8_scaled_matmul) that such a fusion takes away from
# cuBLASLt's FP8 GEMM; the library then keeps their float32 output (same numbers, slower). Off, the fp8
# recipes' 1B step ran 6.7 % faster on an H200, bf16 and mxfp4_full_h16 unchanged (docs/performance.md).
#
# xla_gpu_deterministic_ops: without it XLA's GPU programs sum some gradients with atomics (scatter-adds,
# as in the embedding gradient), so the same update twice differs in its last bits, and MXFP4's rounding
# makes that visible in the loss (benchmarks/probe_repeatability.py; docs/training.md, Repeatability).
XLA_OPTIONS = {
    "xla_gpu_triton_gemm": xla_flags.TRITON_GEMM,
    "xla_gpu_deterministic_ops": xla_flags.DETERMINISTIC_OPS,
}


def apply_xla_options(config: ml_collections.ConfigDict) -> str:
    """Adds each of `XLA_OPTIONS`' flags with its config value to XLA_FLAGS, except a flag XLA_FLAGS already
    names (the user's setting wins). Returns what it did, in words. Only takes effect in a process whose
    jax backends have not started yet (the command line's case); later it changes nothing and says so."""
    flags = os.environ.get("XLA_FLAGS", "")
    done, wanted = [], []
    for key, flag in XLA_OPTIONS.items():
        if xla_flags.values(flag):
            done.append(f"XLA_FLAGS already sets {flag}")
        else:
            wanted.append(f"{flag}={str(bool(config[key])).lower()}")
    if wanted and _backends_started():
        done.append(f"jax already started: {' '.join(wanted)} not applied (set XLA_FLAGS before jax starts)")
    elif wanted:
        os.environ["XLA_FLAGS"] = " ".join([flags, *wanted]).strip()
        done.append(f"XLA_FLAGS += {' '.join(wanted)}")
    return "; ".join(done)


def deterministic_ops(config: ml_collections.ConfigDict) -> bool:
    """Whether this run asks for XLA's deterministic GPU ops: in XLA_FLAGS if it names the flag (the user's
    setting wins, as in apply_xla_options), else config.xla_gpu_deterministic_ops."""
    named = xla_flags.boolean(xla_flags.DETERMINISTIC_OPS)
    return bool(config.xla_gpu_deterministic_ops) if named is None else named


def _backends_started() -> bool:
    from jax._src import xla_bridge  # the only place jax says whether its backends exist

    started = getattr(xla_bridge, "backends_are_initialized", None)
    return bool(started()) if started is not None else True


def resolve_config(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
    """A copy with the derived defaults filled in (MLPerf LR and warmup by global batch), values checked."""
    config = ml_collections.ConfigDict(config.to_dict())
    opt = config.optimizer
    if opt.peak_lr is None or opt.warmup_steps is None:
        with config_values():
            peak_lr, warmup = mlperf_lr(config.global_batch)
        opt.peak_lr = peak_lr if opt.peak_lr is None else opt.peak_lr
        opt.warmup_steps = warmup if opt.warmup_steps is None else opt.warmup_steps
    for key in POSITIVE_KEYS:
        if config[key] < 1:
            raise ConfigError(f"config {key} must be >= 1, got {config[key]}; set --config.{key}")
    if config.divergence.window < 1 or config.divergence.spike_nats < 0:
        raise ConfigError("divergence.window must be >= 1 and divergence.spike_nats >= 0 (0 = no spike rule)")
    with config_values():
        get_recipe(config.recipe)  # unknown preset: the message lists the presets
        deterministic = deterministic_ops(config)  # a flag value XLA cannot read: one line naming it
    _apply_high_precision_blocks(config)
    if deterministic and config.model.get("attention") in (None, "auto"):
        # cuDNN flash attention does not compile under the flag (jax 0.11.2): llama.deterministic_attention.
        config.model.attention = deterministic_attention(config.seq_len)
    if config.model.get("attention") == "pallas" and not pallas_attention_fits(config.seq_len):
        block = PALLAS_ATTENTION_BLOCK
        raise ConfigError(
            f"model.attention=pallas tiles the sequence in blocks of {block}, but seq_len is "
            f"{config.seq_len}: set --config.seq_len to a multiple of {block} (or at most {block}), or "
            "--config.model.attention=xla"
        )
    return config


def _apply_high_precision_blocks(config: ml_collections.ConfigDict) -> None:
    """Sets model.bf16_first_blocks / bf16_last_blocks from a preset that carries them
    (recipes.HIGH_PRECISION_BLOCKS), so that a study arm naming the preset gets its BF16 blocks; a config
    that sets another non-zero number is refused rather than overridden."""
    counts = high_precision_blocks(config.recipe)
    if counts == (0, 0):
        return
    for key, count in zip(("bf16_first_blocks", "bf16_last_blocks"), counts, strict=True):
        given = config.model.get(key)
        if given not in (None, 0, count):
            raise ConfigError(
                f"recipe {config.recipe} keeps {count} as model.{key}, but the config sets {given}: drop "
                f"--config.model.{key} or train recipe nvfp4_nvidia with it"
            )
        config.model[key] = count


def total_steps(config) -> int:
    """The update budget: `steps`, or fewer when the token budget `max_tokens` runs out first."""
    tokens_per_step = config.global_batch * config.seq_len
    return min(config.steps, config.max_tokens // tokens_per_step) if config.max_tokens else config.steps


def prepare_workdir(workdir: str) -> str:
    """The absolute workdir, created if needed; WorkdirError naming it if it cannot be created or written."""
    path = os.path.abspath(workdir)
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path):
            pass
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise WorkdirError(
            f"workdir {path} cannot be created or written ({reason}); pass a writable --workdir"
        ) from exc
    return path


def new_directory(workdir: str) -> str | None:
    """The top-most directory that prepare_workdir(workdir) would create (workdir or one of its parents),
    or None when workdir exists: what `remove_new_directory` takes away after a failed start."""
    path, missing = os.path.abspath(workdir), None
    while not os.path.exists(path):
        missing, parent = path, os.path.dirname(path)
        if parent == path:
            break
        path = parent
    return missing


def remove_new_directory(new: str | None) -> None:
    """Removes `new` (from new_directory, before the start) with whatever the failed start put in it, so a
    run that never started leaves no workdir behind; a workdir that existed (new None) stays as it was."""
    if new is not None:
        shutil.rmtree(new, ignore_errors=True)


def make_run_mesh(config):
    """The device mesh of config.mesh, with the batch checked against it."""
    with config_values("mesh: "):
        mesh = make_mesh(data=config.mesh.data, fsdp=config.mesh.fsdp, tensor=config.mesh.tensor)
    check_batch(config, mesh)
    return mesh


def check_batch(config, mesh):
    """The global batch (and each micro-batch, and the eval batch) must split evenly over the data shards."""
    with config_values():
        check_global_batch(config.global_batch, mesh)
    shards = data_parallel_size(mesh)
    micro, rem = divmod(config.global_batch, config.grad_accum)
    if rem:
        raise ConfigError(
            f"global_batch {config.global_batch} is not divisible by grad_accum {config.grad_accum}; "
            "set --config.global_batch to a multiple of grad_accum"
        )
    if micro % shards:
        raise ConfigError(
            f"micro-batch {micro} (global_batch {config.global_batch} / grad_accum {config.grad_accum}) is "
            f"not divisible by the {shards} data-parallel shards (mesh data x fsdp); set "
            f"--config.global_batch to a multiple of {shards * config.grad_accum} or change --config.mesh"
        )
    uneven = config.eval_batch_size % shards or config.eval_sequences % config.eval_batch_size
    if evaluating(config) and uneven:
        raise ConfigError(
            f"eval_batch_size {config.eval_batch_size} must be a multiple of the {shards} data-parallel "
            f"shards and divide eval_sequences {config.eval_sequences}; adjust --config.eval_batch_size"
        )


def evaluating(config) -> bool:
    """Whether the run evaluates at all (periodically or at its end); the evaluation module asks too."""
    return config.eval_every_sequences > 0 or config.eval_at_end


def check_init_checkpoint(config):
    if config.init_checkpoint and not os.path.isdir(config.init_checkpoint):
        raise ConfigError(
            f"init_checkpoint {config.init_checkpoint} does not exist; fix the path or set it to ''"
        )


def execution_overrides(environ=None) -> dict[str, str]:
    """The Recipe fields the environment overrides: {"backend": ..., "quantizer": ...} for each of
    GEMM_BACKEND_ENV and QUANTIZER_ENV set to something other than "auto"; ConfigError for a bad value."""
    environ = os.environ if environ is None else environ
    overrides = {}
    for var, field, choices in (
        (GEMM_BACKEND_ENV, "backend", BACKENDS),
        (QUANTIZER_ENV, "quantizer", QUANTIZERS),
    ):
        value = environ.get(var, "").strip()
        if value and value not in choices:
            raise ConfigError(f"unknown {var}={value!r}: use one of {', '.join(choices)}")
        if value and value != "auto":
            overrides[field] = value
    return overrides


def run_recipe(config, recipe: str | None = None):
    """The Recipe the config trains with: its preset (or the preset named `recipe`) under its fp8_scaling
    (so the FP8 stages of every rung scale alike), sr_rng and fp8_divide; "preset" where a config
    predates a key."""
    modes = (config.get(key, "preset") for key in ("fp8_scaling", "sr_rng", "fp8_divide"))
    with config_values():
        return resolve_recipe(recipe or config.recipe, *modes)


def resolve_run_execution(config, environ=None):
    """(the Recipe the run trains with, ops.Execution): run_recipe(config), the environment's overrides
    applied, the back end resolved and checked here, before anything is traced."""
    recipe = run_recipe(config)
    overrides = execution_overrides(environ)
    source = f"environment variable {GEMM_BACKEND_ENV}"
    with config_values(f"recipe {config.recipe}: "):
        return resolve_execution(recipe, **overrides, source=source)


def model_config(config, vocab_size: int | None):
    """The LlamaConfig: the size preset with the config's non-None `model` overrides, `vocab_size` where the
    config sets none (None: the preset's), and max_seq_len at least the config's seq_len."""
    overrides = {k: v for k, v in config.model.items() if k != "size" and v is not None}
    if vocab_size is not None:
        overrides.setdefault("vocab_size", vocab_size)
    with config_values("model: "):
        model_cfg = llama_config(config.model.size, **overrides)
    if model_cfg.max_seq_len < config.seq_len:
        model_cfg = dataclasses.replace(model_cfg, max_seq_len=config.seq_len)
    return model_cfg


def build_model(config, tokenizer):
    """(Llama module, LlamaConfig): model_config with the tokenizer's padded vocabulary, and the recipe."""
    model_cfg = model_config(config, padded_vocab_size(tokenizer.vocab_size))
    if model_cfg.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size {model_cfg.vocab_size} is smaller than tokenizer {tokenizer.name}'s "
            f"{tokenizer.vocab_size}; leave model.vocab_size unset to derive it"
        )
    with _library_backend_line_left_out():  # said once, below, with the quantizer
        recipe, execution = resolve_run_execution(config)  # here, not while tracing: a one-line error
    say(
        f"GEMM back end {execution.backend} ({execution.backend_reason}); "
        f"quantizer {execution.quantizer}: {execution.quantizer_runs}"
    )
    return Llama(model_cfg, recipe=recipe), model_cfg


class _NotTheBackendLine(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("GEMM back end")


@contextlib.contextmanager
def _library_backend_line_left_out():
    """The library says "GEMM back end ..." when it first resolves `auto` in a process (at INFO, from a
    logger of fp4jax.ops); the trainer says the same back end with its quantizer right after, so the
    library's line is left out while the trainer resolves it. (A logger's filter sees only the records
    of that logger, hence one per fp4jax.ops logger.)"""
    names = [n for n in logging.Logger.manager.loggerDict if n == "fp4jax.ops" or n.startswith("fp4jax.ops.")]
    loggers = [logging.getLogger(n) for n in names]
    line_filter = _NotTheBackendLine()
    for logger in loggers:
        logger.addFilter(line_filter)
    try:
        yield
    finally:
        for logger in loggers:
            logger.removeFilter(line_filter)


def build_model_and_optimizer(config):
    """(tokenizer, model, model config, optax transform, LR schedule) of the config."""
    tokenizer = load_tokenizer(config.data.tokenizer)
    model, model_cfg = build_model(config, tokenizer)
    with config_values("optimizer: "):
        tx, schedule = make_optimizer(config.optimizer)
    return tokenizer, model, model_cfg, tx, schedule


def init_train_state(model, tx, mesh, seed: int, seq_len: int):
    """(step-0 TrainState, its shardings): initialised directly into the sharded layout."""
    _, shardings, init = lazy_train_state(model, tx, mesh, seed, seq_len)
    return init(), shardings


def lazy_train_state(model, tx, mesh, seed: int, seq_len: int):
    """(abstract step-0 TrainState, its shardings, init): init() returns init_train_state's state, for a
    run that finds no checkpoint to restore into the abstract one."""
    init_fn = make_init_fn(model, tx, (data_parallel_size(mesh), min(seq_len, 64)))
    return lazy_init_sharded(init_fn, mesh, init_key(seed))


def init_key(seed: int):
    """The key the step-0 params are drawn from."""
    return jax.random.fold_in(jax.random.key(seed), INIT_KEY_SALT)


def quant_key(seed: int):
    """The run's quantization key; update s uses fold_in(quant_key, s) (see training.state)."""
    return jax.random.fold_in(jax.random.key(seed), QUANT_KEY_SALT)


def jit_steps(config, model, tx, schedule, mesh, shardings):
    """(train step, eval step): each jitted once with explicit shardings; the train step donates the state."""
    needs_key = get_recipe(model.recipe).needs_key  # the run's recipe as resolved for the model
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
