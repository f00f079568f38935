"""MLPerf packing: the token stream, windows of seq_len + 1 at stride seq_len, and the sharded stream."""

import numpy as np
import pytest

from fp4jax.data import DataError, TokenStream, make_batch, num_windows, pack_documents

EOD = 0


def test_pack_documents_hand_example():
    stream = pack_documents([[1, 2, 3], [4, 5], [6, 7, 8, 9]], EOD)
    np.testing.assert_array_equal(stream, [1, 2, 3, 0, 4, 5, 0, 6, 7, 8, 9, 0])


def test_windows_hand_example():
    # 12 tokens, T = 4: windows [0, 5) and [4, 9); the tail [8, 12) is shorter than T + 1 and dropped.
    stream = TokenStream([pack_documents([[1, 2, 3], [4, 5], [6, 7, 8, 9]], EOD)])
    assert num_windows(len(stream), 4) == 2
    batch = make_batch(stream, [0, 1], seq_len=4)
    np.testing.assert_array_equal(batch["inputs"], [[1, 2, 3, 0], [4, 5, 0, 6]])
    np.testing.assert_array_equal(batch["targets"], [[2, 3, 0, 4], [5, 0, 6, 7]])
    assert batch["inputs"].dtype == batch["targets"].dtype == np.int32


@pytest.mark.parametrize(
    ("num_tokens", "seq_len", "expected"), [(0, 4, 0), (4, 4, 0), (5, 4, 1), (9, 4, 2), (8, 4, 1)]
)
def test_num_windows(num_tokens, seq_len, expected):
    assert num_windows(num_tokens, seq_len) == expected


def test_num_windows_rejects_bad_seq_len():
    with pytest.raises(DataError, match="seq_len"):
        num_windows(10, 0)


def test_token_stream_reads_across_shards():
    flat = np.arange(100, dtype=np.uint32)
    stream = TokenStream([flat[:7], flat[7:7], flat[7:40], flat[40:]])
    assert len(stream) == 100
    for start, length in [(0, 100), (5, 3), (6, 2), (6, 40), (39, 2), (99, 1), (0, 0)]:
        np.testing.assert_array_equal(stream.read(start, length), flat[start : start + length])
    with pytest.raises(IndexError):
        stream.read(95, 6)


def test_batch_targets_are_shifted_inputs():
    stream = TokenStream([np.arange(1000, dtype=np.uint16)])
    batch = make_batch(stream, [3, 0, 7], seq_len=16)
    assert batch["inputs"].shape == batch["targets"].shape == (3, 16)
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    np.testing.assert_array_equal(batch["inputs"][:, 0], [48, 0, 112])
