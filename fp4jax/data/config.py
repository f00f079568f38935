"""The data configuration and the document sources it names.

MLPerf llama3.1_8b C4 layouts (set `path` to the directory):
- allenai/c4 `en` files: `train_glob=MLPERF_TRAIN_GLOB` (files 00768-00895), the default `eval_glob`
  (validation files 00000-00007; MLPerf evaluates on their first 91,205 documents, i.e. a prefix).
- MLPerf's merged files: `train_glob=MLPERF_MERGED_TRAIN_GLOB`, `eval_glob=MLPERF_MERGED_EVAL_GLOB`.
"""

from __future__ import annotations

import ml_collections

from fp4jax.data.errors import DataError
from fp4jax.data.sources import (
    DocumentSource,
    check_bad_record_policy,
    eval_files,
    json_sources,
    tfds_source,
    train_files,
)
from fp4jax.data.tokenizers import SEPARATORS

__all__ = [
    "MLPERF_MERGED_EVAL_GLOB",
    "MLPERF_MERGED_TRAIN_GLOB",
    "MLPERF_TRAIN_GLOB",
    "SOURCES",
    "check_data_config",
    "default_data_config",
    "eval_sources",
    "train_sources",
]

MLPERF_TRAIN_GLOB = "c4-train.{00768..00895}-of-01024.json.gz"
MLPERF_MERGED_TRAIN_GLOB = "c4-train.en_6.json.gz"
MLPERF_MERGED_EVAL_GLOB = "c4-validation-91205-samples.en.json.gz"
SOURCES = ("json", "tfds")


def default_data_config() -> ml_collections.ConfigDict:
    """The embedded default: the bundled C4 sample, GPT-2 tokenizer, shuffled training windows."""
    cfg = ml_collections.ConfigDict()
    cfg.source = "json"  # "json" | "tfds"
    cfg.path = "bundled"  # "bundled" | a directory | a glob of training files (json source)
    cfg.train_glob = "c4-train.*.json.gz"  # relative to `path` when it is a directory; {a..b} ranges expand
    cfg.eval_glob = "c4-validation.*.json.gz"  # relative to `path`'s directory
    cfg.tfds_name = "c4/en:3.0.1"
    cfg.tfds_data_dir = ""  # "" => TFDS's default ($TFDS_DATA_DIR or ~/tensorflow_datasets)
    cfg.tfds_train_split = "train"
    cfg.tfds_eval_split = "validation"
    cfg.tokenizer = "gpt2"  # "gpt2" | "llama3" | a path to a tiktoken / Llama 3 tokenizer.model file
    # Between documents: "eod" (EOD after each; GPT-2's convention), "bos" (BOS before each) or "none".
    # The MLPerf llama3.1_8b configs set "none", as the reference's preprocessing does (docs/data.md).
    cfg.separator = "eod"
    cfg.cache_dir = ""  # "" => $FP4JAX_CACHE or ~/.cache/fp4jax
    cfg.shuffle = True  # a seeded permutation of the training windows per epoch
    cfg.on_bad_record = "error"  # "error" | "skip" (skip and count malformed records)
    cfg.num_threads = 0  # tokenizer threads; 0 => all CPUs of this process
    return cfg


def check_data_config(cfg: ml_collections.ConfigDict) -> None:
    """Raises DataError for a value no reader accepts."""
    if cfg.source not in SOURCES:
        raise DataError(f"data source must be one of {SOURCES}, got {cfg.source!r}")
    check_bad_record_policy(cfg.on_bad_record)
    if cfg.get("separator", "eod") not in SEPARATORS:
        raise DataError(
            f"unknown data.separator {cfg.separator!r}: "
            f"set --config.data.separator to one of {', '.join(SEPARATORS)}"
        )
    if cfg.num_threads < 0:
        raise DataError(f"num_threads must be >= 0 (0 = all CPUs), got {cfg.num_threads}")


def train_sources(cfg: ml_collections.ConfigDict) -> list[DocumentSource]:
    """The training documents named by `cfg`, in stream order."""
    check_data_config(cfg)
    if cfg.source == "tfds":
        return [tfds_source(cfg.tfds_name, cfg.tfds_data_dir, cfg.tfds_train_split)]
    return json_sources(train_files(cfg.path, cfg.train_glob), cfg.on_bad_record)


def eval_sources(cfg: ml_collections.ConfigDict) -> list[DocumentSource]:
    """The validation documents named by `cfg`, in stream (unshuffled) order."""
    check_data_config(cfg)
    if cfg.source == "tfds":
        return [tfds_source(cfg.tfds_name, cfg.tfds_data_dir, cfg.tfds_eval_split)]
    return json_sources(eval_files(cfg.path, cfg.eval_glob), cfg.on_bad_record)
