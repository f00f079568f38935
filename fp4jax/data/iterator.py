"""The training iterator (deterministic, resumable, host-sharded) and the evaluation batches.

Global order: training window slot g = 0, 1, 2, ... is window `perm_e[g mod W]` of epoch e = g // W, where W
is windows_per_epoch and perm_e a permutation seeded by (seed, e) (the identity without shuffle). Batch k
is slots [kB, (k + 1)B); process p of P holds rows [p B/P, (p + 1) B/P) of it and reads only those windows.
Batches run on across epoch boundaries, so no window is dropped.
"""

from __future__ import annotations

from collections.abc import Sequence

import ml_collections
import numpy as np

from fp4jax.data.cache import load_token_stream
from fp4jax.data.config import eval_sources, train_sources
from fp4jax.data.errors import DataError
from fp4jax.data.packing import TokenStream, make_batch, num_windows
from fp4jax.data.tokenizers import Tokenizer, load_tokenizer

__all__ = [
    "EVAL_SELECTIONS",
    "STATE_VERSION",
    "TrainIterator",
    "check_sharding",
    "eval_window_ids",
    "make_eval_batches",
    "make_train_iterator",
]

STATE_VERSION = 1
_CHECKED_STATE = ("seed", "seq_len", "windows_per_epoch", "shuffle")


def check_sharding(batch: int, process_index: int, process_count: int, what: str = "global batch") -> None:
    """Raises DataError unless `batch` rows split evenly over `process_count` processes."""
    if process_count < 1 or not 0 <= process_index < process_count:
        raise DataError(f"process_index {process_index} is outside [0, process_count={process_count})")
    if batch < 1:
        raise DataError(f"{what} must be >= 1, got {batch}")
    if batch % process_count:
        raise DataError(f"{what} {batch} is not divisible by process_count {process_count}")


class TrainIterator:
    """Infinite iterator of this process's share of each global batch (see the module docstring).

    Invariant: after k batches, `get_state()` restored with `set_state` into a fresh iterator over the same
    data makes its next batch equal batch k of the uninterrupted run, for any process layout.
    """

    def __init__(
        self,
        stream: TokenStream,
        *,
        seq_len: int,
        global_batch: int,
        seed: int = 0,
        process_index: int = 0,
        process_count: int = 1,
        shuffle: bool = True,
    ):
        check_sharding(global_batch, process_index, process_count)
        if seed < 0:
            raise DataError(f"seed must be >= 0, got {seed}")
        self.windows_per_epoch = num_windows(len(stream), seq_len)
        if self.windows_per_epoch == 0:
            raise DataError(
                f"the training data has {len(stream):,} tokens, fewer than one window of "
                f"seq_len + 1 = {seq_len + 1:,}"
            )
        self.tokens_per_epoch = self.windows_per_epoch * seq_len  # target tokens seen per epoch
        self.stream, self.seq_len, self.global_batch = stream, seq_len, global_batch
        self.seed, self.shuffle = int(seed), bool(shuffle)
        self.local_batch = global_batch // process_count
        self._first_row = process_index * self.local_batch
        self._slot = 0  # global window slot of the next batch's first row
        self._perms: dict[int, np.ndarray] = {}

    def __iter__(self) -> TrainIterator:
        return self

    def __next__(self) -> dict[str, np.ndarray]:
        first = self._slot + self._first_row
        ids = [self._window(first + row) for row in range(self.local_batch)]
        self._slot += self.global_batch
        return make_batch(self.stream, ids, self.seq_len)

    def _window(self, slot: int) -> int:
        epoch, index = divmod(slot, self.windows_per_epoch)
        return int(self._permutation(epoch)[index]) if self.shuffle else index

    def _permutation(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:  # a batch spans at most two epochs that matter at once
                del self._perms[min(self._perms)]
            rng = np.random.default_rng([self.seed, epoch])
            self._perms[epoch] = rng.permutation(self.windows_per_epoch)
        return self._perms[epoch]

    def get_state(self) -> dict:
        """Where the next batch starts (epoch, position in it) plus the settings a resume must share."""
        epoch, position = divmod(self._slot, self.windows_per_epoch)
        return {
            "version": STATE_VERSION,
            "epoch": epoch,
            "position": position,
            "seed": self.seed,
            "seq_len": self.seq_len,
            "windows_per_epoch": self.windows_per_epoch,
            "shuffle": self.shuffle,
        }

    def set_state(self, state: dict) -> None:
        """Continues from `state` (from `get_state`, possibly through JSON or orbax)."""
        missing = [k for k in ("epoch", "position", *_CHECKED_STATE) if k not in state]
        if missing:
            raise DataError(f"data iterator state lacks {missing}: {state}")
        current = self.get_state()
        for key in _CHECKED_STATE:
            if _scalar(state[key]) != current[key]:
                raise DataError(
                    f"data state has {key}={_scalar(state[key])}, this iterator has {current[key]}"
                )
        epoch, position = int(_scalar(state["epoch"])), int(_scalar(state["position"]))
        if epoch < 0 or not 0 <= position < self.windows_per_epoch:
            raise DataError(f"data state epoch={epoch} position={position} is out of range")
        self._slot = epoch * self.windows_per_epoch + position


def _scalar(value):
    """A Python scalar from a value that may have become a 0-d numpy array in a checkpoint."""
    return value.item() if isinstance(value, np.ndarray | np.generic) else value


def make_train_iterator(
    cfg: ml_collections.ConfigDict,
    tokenizer: Tokenizer | str | None = None,
    *,
    seq_len: int,
    global_batch: int,
    seed: int = 0,
    process_index: int = 0,
    process_count: int = 1,
    progress: bool = True,
) -> TrainIterator:
    """The training iterator over `cfg`'s data; tokenizes into the cache on first use."""
    check_sharding(global_batch, process_index, process_count)
    tok = load_tokenizer(tokenizer or cfg.tokenizer)
    stream = _stream(cfg, tok, train_sources(cfg), None, progress)
    return TrainIterator(
        stream,
        seq_len=seq_len,
        global_batch=global_batch,
        seed=seed,
        process_index=process_index,
        process_count=process_count,
        shuffle=cfg.shuffle,
    )


EVAL_SELECTIONS = ("first", "spread")


def eval_window_ids(available: int, num_sequences: int, selection: str) -> np.ndarray:
    """Which of the validation stream's `available` windows an evaluation of `num_sequences` reads, in
    stream order.

    "first": windows 0 .. N-1 (the MLPerf protocol: a prefix of the unshuffled stream). "spread": with
    W = available, window (2i + 1) W // 2N for i < N, the window holding the middle of each of N equal
    strata of the stream, so every part of the validation set is read (the ids are distinct: the middles
    are W / N >= 1 windows apart).
    Either depends on nothing but (W, N): every run, seed and recipe evaluates the same windows.
    """
    if selection not in EVAL_SELECTIONS:
        raise DataError(
            f"unknown eval selection {selection!r}: set --config.eval_selection to one of "
            f"{', '.join(EVAL_SELECTIONS)}"
        )
    if not 1 <= num_sequences <= available:
        raise DataError(f"eval of {num_sequences:,} sequences from {available:,} available windows")
    if selection == "first":
        return np.arange(num_sequences, dtype=np.int64)
    i = np.arange(num_sequences, dtype=np.int64)
    return (2 * i + 1) * available // (2 * num_sequences)


def make_eval_batches(
    cfg: ml_collections.ConfigDict,
    tokenizer: Tokenizer | str | None = None,
    *,
    seq_len: int,
    num_sequences: int,
    batch_size: int,
    process_index: int = 0,
    process_count: int = 1,
    progress: bool = True,
    selection: str = "first",
    at_most: bool = False,
) -> list[dict[str, np.ndarray]]:
    """`num_sequences` windows of the unshuffled validation stream chosen by `selection`
    (`eval_window_ids`), in stream order, as global batches of `batch_size`, of which this process holds
    rows [p b/P, (p + 1) b/P). With `at_most`, a validation set with fewer windows gives all it has, cut
    down to a multiple of `batch_size`; without it, that is a DataError."""
    check_sharding(batch_size, process_index, process_count, what="eval batch_size")
    if num_sequences < 1 or (num_sequences % batch_size and not at_most):
        raise DataError(
            f"eval num_sequences {num_sequences} is not a positive multiple of batch_size {batch_size}"
        )
    eval_window_ids(1, 1, selection)  # an unknown selection fails before any tokenizing
    tok = load_tokenizer(tokenizer or cfg.tokenizer)
    prefix = num_sequences * seq_len + 1 if selection == "first" else None  # "spread" reads it all
    stream = _stream(cfg, tok, eval_sources(cfg), prefix, progress)
    available = num_windows(len(stream), seq_len)
    if at_most:
        num_sequences = min(num_sequences, available) // batch_size * batch_size
    if available < num_sequences or num_sequences < 1:
        raise DataError(
            f"eval wants {max(num_sequences, batch_size):,} sequences of {seq_len:,} tokens but the "
            f"validation data has {len(stream):,} tokens, only {available:,} sequences"
        )
    ids = eval_window_ids(available, num_sequences, selection)
    local = batch_size // process_count
    starts = range(process_index * local, num_sequences, batch_size)
    return [make_batch(stream, ids[s : s + local], seq_len) for s in starts]


def _stream(cfg, tok: Tokenizer, sources: Sequence, min_tokens: int | None, progress: bool) -> TokenStream:
    return load_token_stream(
        sources,
        tok,
        cache_dir=cfg.cache_dir,
        num_threads=cfg.num_threads,
        on_bad_record=cfg.on_bad_record,
        min_tokens=min_tokens,
        progress=progress,
        separator=cfg.get("separator", "eod"),
    )
