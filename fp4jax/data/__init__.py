"""C4 input pipeline: json.gz / TFDS readers, tiktoken tokenizers, MLPerf packing, a token cache, and a
deterministic, resumable, host-sharded training iterator. See docs/data.md.

    cfg = default_data_config()                      # the bundled C4 sample and GPT-2, offline
    tok = load_tokenizer(cfg.tokenizer)
    it = make_train_iterator(cfg, tok, seq_len=T, global_batch=B, seed=0,
                             process_index=jax.process_index(), process_count=jax.process_count())
    batch = next(it)                                 # {"inputs", "targets"}: int32[B // P, T]
    state = it.get_state(); it.set_state(state)      # JSON-serialisable; resumes with the next batch
    evals = make_eval_batches(cfg, tok, seq_len=T, num_sequences=N, batch_size=b)
"""

from fp4jax.data.cache import load_token_stream
from fp4jax.data.config import (
    MLPERF_MERGED_EVAL_GLOB,
    MLPERF_MERGED_TRAIN_GLOB,
    MLPERF_TRAIN_GLOB,
    default_data_config,
    eval_sources,
    train_sources,
)
from fp4jax.data.errors import DataError
from fp4jax.data.iterator import (
    EVAL_SELECTIONS,
    TrainIterator,
    eval_window_ids,
    make_eval_batches,
    make_train_iterator,
)
from fp4jax.data.packing import TokenStream, make_batch, num_windows, pack_documents
from fp4jax.data.tokenizers import Tokenizer, load_tokenizer

__all__ = [
    "EVAL_SELECTIONS",
    "MLPERF_MERGED_EVAL_GLOB",
    "MLPERF_MERGED_TRAIN_GLOB",
    "MLPERF_TRAIN_GLOB",
    "DataError",
    "TokenStream",
    "Tokenizer",
    "TrainIterator",
    "default_data_config",
    "eval_sources",
    "eval_window_ids",
    "load_token_stream",
    "load_tokenizer",
    "make_batch",
    "make_eval_batches",
    "make_train_iterator",
    "num_windows",
    "pack_documents",
    "train_sources",
]
