"""Hugging Face Llama 3.1 checkpoints into fp4jax and out again.

    python -m fp4jax.convert from-hf --hf DIR --out CKPT [--model NAME]
    python -m fp4jax.convert to-hf --ckpt CKPT [--step N] --out DIR [--dtype bfloat16|float32]
        [--max-shard-gb 5]

from-hf reads a Hugging Face `LlamaForCausalLM` directory (config.json, safetensors with their index),
checks its architecture (against model NAME when given: every field of llama ARCH_FIELDS), and writes a
params-only fp4jax checkpoint (fp4jax.training.weights), float32, tensor by tensor onto this process's
devices (a mesh sharding the params over all of them, as the trainer does). A run starts from it with
`--config.init_params=CKPT` (params loaded, optimizer state fresh, step 0); the command prints the
model keys that run needs.

to-hf reads a checkpoint's float32 params (a converted one, or a run's workdir / checkpoints/ / step
directory; `--step`: that step, else the newest) one param at a time on the CPU and writes config.json
and model-XXXXX-of-YYYYY.safetensors with model.safetensors.index.json, rounded to `--dtype` (round to
nearest even): what `transformers.LlamaForCausalLM.from_pretrained(DIR)` loads. No quantized state is
exported: a recipe's MX or FP8 values are derived from these masters at every step, never stored.

Both write nothing on bad input: every check runs before the first byte is written, the output is built
in a sibling directory `.NAME.partial` and renamed into place when complete, and an existing output is
never replaced. Exit codes: 0 done, 2 bad input (one line "error: ..." on stderr). docs/checkpoints.md.
"""

import argparse
import contextlib
import json
import os
import shutil
import sys
import time

import jax
from jax.experimental import multihost_utils

from fp4jax import logs
from fp4jax.data import DataError, load_tokenizer
from fp4jax.interop import hf_llama
from fp4jax.interop.hf_llama import ConversionError
from fp4jax.models.sharding import logical_shardings, make_mesh
from fp4jax.training import setup, weights
from fp4jax.training.errors import UserError

__all__ = ["from_hf", "main", "to_hf"]


# ------------------------------------------------------------------------------------- staged output


def _sync(name: str) -> None:
    if jax.process_count() > 1:
        multihost_utils.sync_global_devices(name)


@contextlib.contextmanager
def staged_output(out: str):
    """Yields a sibling temporary directory of `out` (the same name on every process), renamed to `out`
    when the block completes and removed when it raises. ConversionError when `out` exists."""
    out = os.path.abspath(out)
    parent, name = os.path.split(out)
    if os.path.lexists(out):
        raise ConversionError(f"{out} exists; choose a new --out (nothing is overwritten)")
    if not os.path.isdir(parent):
        raise ConversionError(f"the directory {parent} of --out does not exist; create it first")
    partial = os.path.join(parent, f".{name}.partial")
    if jax.process_index() == 0:
        shutil.rmtree(partial, ignore_errors=True)  # an earlier conversion cut off by a kill
        os.makedirs(partial)
    _sync("fp4jax.convert: staged")
    try:
        yield partial
        _sync("fp4jax.convert: written")
    except BaseException:
        if jax.process_index() == 0:
            shutil.rmtree(partial, ignore_errors=True)
        raise
    if jax.process_index() == 0:
        os.rename(partial, out)


# ------------------------------------------------------------------------------------------- from-hf


def from_hf(hf_dir: str, out: str, model: str | None = None, mesh=None) -> dict:
    """Converts a Hugging Face Llama directory into a params-only fp4jax checkpoint at `out` (see the
    module docstring); returns the trainer's model keys for it. `mesh`: where the params are placed
    while converting (default: FSDP over every device, as the trainer's default mesh)."""
    hf = hf_llama.read_hf_config(hf_dir)
    cfg = hf_llama.llama_config_from_hf(hf, model)
    tied = bool(hf.get("tie_word_embeddings", False))
    specs = hf_llama.tensor_specs(hf_llama.tensor_files(hf_dir))
    hf_llama.check_tensors(specs, cfg, tied)
    if mesh is None:
        mesh = make_mesh(data=1, fsdp=-1, tensor=1)
    try:
        logical_shardings(hf_llama.abstract_params(cfg), mesh)
    except ValueError as exc:
        raise ConversionError(f"the params do not shard over {mesh.devices.size} devices: {exc}") from exc
    trainer_model = hf_llama.trainer_model(cfg, model)
    source = {
        "format": "huggingface",
        "path": hf_dir,
        "tie_word_embeddings": tied,
        **{k: hf[k] for k in ("bos_token_id", "eos_token_id") if k in hf},
    }
    if tied:
        _say("config.json ties the embeddings: the LM head starts as a copy of the embedding, trained apart")
    with staged_output(out) as partial:
        params = hf_llama.load_params(hf_dir, cfg, mesh, tied)
        weights.write_params_checkpoint(partial, params, mesh, trainer_model, source)
    return trainer_model


def _model_flags(trainer_model: dict) -> str:
    return " ".join(f"--config.model.{k}={v}" for k, v in trainer_model.items())


# --------------------------------------------------------------------------------------------- to-hf


def to_hf(ckpt: str, out: str, step: int | None = None, dtype: str = "bfloat16", max_shard_gb: float = 5.0):
    """Exports the params of an fp4jax checkpoint as a Hugging Face Llama directory at `out` (see the
    module docstring); returns the index written."""
    if dtype not in hf_llama.EXPORT_DTYPES:
        raise ConversionError(f"unknown --dtype {dtype}; use one of {', '.join(hf_llama.EXPORT_DTYPES)}")
    if not max_shard_gb > 0:
        raise ConversionError(f"--max-shard-gb must be positive, got {max_shard_gb}")
    step_dir = weights.find_step_dir(ckpt, step, "--ckpt")
    cfg = weights.saved_model_config(step_dir)
    _check_saved_params(step_dir, cfg)
    config_json = hf_llama.hf_config(cfg, dtype, _token_ids(step_dir))
    with staged_output(out) as partial:
        with open(os.path.join(partial, "config.json"), "w", encoding="utf-8") as f:
            json.dump(config_json, f, indent=2)
        tensors = hf_llama.hf_tensors(cfg, lambda path: weights.read_leaf(step_dir, path))
        index = hf_llama.write_safetensors(partial, tensors, dtype, int(max_shard_gb * 1e9))
    return index


def _check_saved_params(step_dir: str, cfg) -> None:
    """ConversionError unless the saved params are exactly those of Llama(cfg), in name and shape."""
    saved = {k: tuple(v.shape) for k, v in weights.flat_tree(weights.params_metadata(step_dir)).items()}
    for leaf in hf_llama.leaves(cfg):
        shape = (len(leaf.names), *leaf.layer_shape) if leaf.stacked else leaf.layer_shape
        if saved.get(leaf.path) != shape:
            raise ConversionError(
                f"{step_dir}: param {'/'.join(leaf.path)} is {saved.get(leaf.path, 'absent')}, its model "
                f"config implies {shape}: the checkpoint's meta and params disagree"
            )


def _token_ids(step_dir: str) -> dict:
    """bos_token_id / eos_token_id for config.json: those of the Hugging Face directory the params came
    from, else those of the run's tokenizer (its end-of-document token is the eos); {} (said in a line)
    when neither is known."""
    meta = weights.saved_meta(step_dir)
    source = meta.get("converted_from") or {}
    if "eos_token_id" in source or "bos_token_id" in source:
        return {k: source[k] for k in ("bos_token_id", "eos_token_id") if k in source}
    name = ((meta.get("config") or {}).get("data") or {}).get("tokenizer")
    try:
        tokenizer = load_tokenizer(name) if name else None
    except DataError as exc:
        _say(f"config.json gets no bos/eos token ids: the run's tokenizer {name} is not available ({exc})")
        return {}
    if tokenizer is None:
        _say("config.json gets no bos/eos token ids: the checkpoint records no tokenizer")
        return {}
    return {"bos_token_id": tokenizer.bos_id, "eos_token_id": tokenizer.eod_id}


# ---------------------------------------------------------------------------------------- command line


def _say(line: str) -> None:
    if jax.process_index() == 0:
        print(line, flush=True)


def parse_args(argv) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m fp4jax.convert", description=__doc__.split("\n\n")[0].strip()
    )
    commands = parser.add_subparsers(dest="command", required=True)
    imp = commands.add_parser("from-hf", help="Hugging Face Llama directory -> params-only fp4jax checkpoint")
    imp.add_argument("--hf", required=True, help="directory with config.json and *.safetensors")
    imp.add_argument("--out", required=True, help="the checkpoint directory to write (must not exist)")
    imp.add_argument(
        "--model", help="the fp4jax model the weights must be (8b, 1b, ...); default: config.json's"
    )
    exp = commands.add_parser("to-hf", help="fp4jax checkpoint -> Hugging Face Llama directory")
    exp.add_argument(
        "--ckpt", required=True, help="a converted checkpoint, a run's workdir or a step's directory"
    )
    exp.add_argument("--step", type=int, help="the step to export; default: the newest")
    exp.add_argument("--out", required=True, help="the directory to write (must not exist)")
    exp.add_argument("--dtype", default="bfloat16", choices=tuple(hf_llama.EXPORT_DTYPES))
    exp.add_argument("--max-shard-gb", type=float, default=5.0, help="largest safetensors file, GB")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    """The command line; returns the exit code (see the module docstring)."""
    args = parse_args(sys.argv[1:] if argv is None else argv)
    logs.configure()
    t0 = time.perf_counter()
    try:
        if args.command == "from-hf":
            setup.initialize_distributed()
            trainer_model = from_hf(args.hf, args.out, args.model)
            _say(f"wrote {os.path.abspath(args.out)} in {time.perf_counter() - t0:.1f} s")
            _say(f"start a run from it: --config.init_params={args.out} {_model_flags(trainer_model)}")
        else:
            index = to_hf(args.ckpt, args.out, args.step, args.dtype, args.max_shard_gb)
            files = len(set(index["weight_map"].values()))
            _say(
                f"wrote {os.path.abspath(args.out)}: {len(index['weight_map'])} tensors, "
                f"{index['metadata']['total_size'] / 1e9:.2f} GB {args.dtype} in {files} files, "
                f"in {time.perf_counter() - t0:.1f} s"
            )
    except UserError as exc:
        print(f"error: {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
