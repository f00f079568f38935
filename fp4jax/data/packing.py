"""MLPerf packing: documents joined into one token stream, cut into overlapping windows.

Documents are marked by the data config's `separator` (EOD after each, BOS before each, or nothing: the
MLPerf reference's pre-tokenized C4 has nothing between documents; docs/data.md).

With T = seq_len, window i is `stream[i*T : i*T + T + 1]`: inputs are its first T tokens, targets its last
T. Consecutive windows share one token (the last target of window i is the first input of window i+1), so
every token after the first is a target exactly once per epoch, as in Megatron/NeMo's GPTDataset that the
MLPerf reference uses. Attention is causal across document boundaries (no masking at them); the tail of
fewer than T + 1 tokens is dropped.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import numpy as np

from fp4jax.data.errors import DataError

__all__ = ["TokenStream", "make_batch", "num_windows", "pack_documents"]


def pack_documents(documents: Iterable[Sequence[int]], eod_id: int | None) -> np.ndarray:
    """The token stream: each document's ids followed by `eod_id` (None: nothing), concatenated (int64)."""
    after = [] if eod_id is None else [eod_id]
    parts = [np.append(np.asarray(doc, np.int64), after).astype(np.int64) for doc in documents]
    return np.concatenate(parts) if parts else np.zeros(0, np.int64)


def num_windows(num_tokens: int, seq_len: int) -> int:
    """How many windows of seq_len + 1 tokens, at stride seq_len, fit in `num_tokens` tokens."""
    if seq_len < 1:
        raise DataError(f"seq_len must be >= 1, got {seq_len}")
    return max(0, (num_tokens - 1) // seq_len)


class TokenStream:
    """Read-only concatenation of token arrays (memmapped cache shards) without copying them.

    Invariant: `read(s, n)` equals `np.concatenate(arrays)[s:s + n]` as int32.
    """

    def __init__(self, arrays: Sequence[np.ndarray], num_documents: int = 0):
        self.arrays = [a for a in arrays if len(a)]
        self.offsets = np.cumsum([0] + [len(a) for a in self.arrays])
        self.num_documents = num_documents

    def __len__(self) -> int:
        return int(self.offsets[-1])

    def read(self, start: int, length: int) -> np.ndarray:
        if start < 0 or start + length > len(self):
            raise IndexError(f"tokens [{start}, {start + length}) outside the stream of {len(self)}")
        out = np.empty(length, np.int32)
        shard = int(np.searchsorted(self.offsets, start, side="right")) - 1
        done = 0
        while done < length:
            lo = start + done - int(self.offsets[shard])
            piece = self.arrays[shard][lo : lo + length - done]
            out[done : done + len(piece)] = piece
            done += len(piece)
            shard += 1
        return out


def make_batch(stream: TokenStream, window_ids: Sequence[int], seq_len: int) -> dict[str, np.ndarray]:
    """{"inputs", "targets"}: int32[len(window_ids), seq_len]; targets[:, :-1] == inputs[:, 1:]."""
    windows = np.stack([stream.read(int(i) * seq_len, seq_len + 1) for i in window_ids])
    windows = windows.reshape(len(window_ids), seq_len + 1)
    return {"inputs": np.ascontiguousarray(windows[:, :-1]), "targets": np.ascontiguousarray(windows[:, 1:])}
