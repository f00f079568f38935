r"""Pre-tokenizes a data set into the token cache, so that training starts at once on every host.

    python -m fp4jax.data.prepare --data.path=/data/c4/en \
        --data.train_glob='c4-train.{00768..00895}-of-01024.json.gz' --data.tokenizer=llama3 --processes=16

Flags `--data.*` are the fields of `default_data_config()`. The training split is tokenized in
`--processes` worker processes (one file each) of `--data.num_threads / --processes` threads; the
validation split (the files MLPerf evaluates on) is tokenized whole.
"""

from __future__ import annotations

from absl import app, flags
from ml_collections import config_flags

from fp4jax import logs
from fp4jax.data.cache import available_cpus, cache_root, load_token_stream
from fp4jax.data.config import default_data_config, eval_sources, train_sources
from fp4jax.data.packing import num_windows
from fp4jax.data.tokenizers import load_tokenizer

__all__ = ["main", "prepare"]

_DATA = config_flags.DEFINE_config_dict("data", default_data_config(), "data configuration")
_SPLITS = flags.DEFINE_list("splits", ["train", "eval"], "which splits to tokenize: train, eval")
_PROCESSES = flags.DEFINE_integer("processes", 0, "worker processes for the training files (0 = all CPUs)")
_SEQ_LEN = flags.DEFINE_integer("seq_len", 8192, "sequence length, for the window counts reported")


def prepare(cfg, splits: list[str], processes: int, seq_len: int) -> dict[str, dict[str, int]]:
    """Tokenizes `splits` of `cfg` into the cache; returns {split: {documents, tokens, windows}}."""
    tok = load_tokenizer(cfg.tokenizer)
    summary = {}
    for split in splits:
        sources = train_sources(cfg) if split == "train" else eval_sources(cfg)
        stream = load_token_stream(
            sources,
            tok,
            cache_dir=cfg.cache_dir,
            num_threads=cfg.num_threads,
            on_bad_record=cfg.on_bad_record,
            processes=processes if split == "train" else 1,
            separator=cfg.get("separator", "eod"),
        )
        summary[split] = {
            "files": len(sources),
            "documents": stream.num_documents,
            "tokens": len(stream),
            "windows": num_windows(len(stream), seq_len),
        }
    return summary


def main(argv: list[str]) -> None:
    del argv
    logs.configure()
    cfg = _DATA.value
    unknown = set(_SPLITS.value) - {"train", "eval"}
    if unknown:
        raise app.UsageError(f"--splits takes train and/or eval, got {sorted(unknown)}")
    processes = _PROCESSES.value or available_cpus()
    summary = prepare(cfg, _SPLITS.value, processes, _SEQ_LEN.value)
    print(f"cache: {cache_root(cfg.cache_dir)}  tokenizer: {cfg.tokenizer}")
    for split, row in summary.items():
        print(
            f"{split}: {row['files']} files, {row['documents']:,} documents, {row['tokens']:,} tokens, "
            f"{row['windows']:,} windows of {_SEQ_LEN.value}"
        )


if __name__ == "__main__":
    app.run(main)
