"""MLPerf packing: the token stream, windows of seq_len + 1 at stride seq_len, the sharded stream, and
the document separator switch."""

import gzip
import json

import numpy as np
import pytest

from fp4jax.data import (
    DataError,
    TokenStream,
    default_data_config,
    make_batch,
    make_eval_batches,
    num_windows,
    pack_documents,
)
from fp4jax.data.assets import BUNDLED_DATA_DIR
from fp4jax.data.config import check_data_config

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


def test_pack_documents_without_separator():
    np.testing.assert_array_equal(pack_documents([[1, 2, 3], [4, 5]], None), [1, 2, 3, 4, 5])


# ----------------------------------------------------------------------------------------------------
# the separator switch, end to end: config -> cache -> eval windows


@pytest.mark.parametrize("separator", ["eod", "none"])
def test_separator_switch_reaches_the_windows(tmp_path, gpt2, separator):
    """The eval windows are the first windows of the validation documents joined as `separator` says;
    each separator has its own cache shard (reading one never returns the other's stream)."""
    with gzip.open(BUNDLED_DATA_DIR / "c4-validation.00000-of-00001.json.gz", "rt") as f:
        texts = [json.loads(line)["text"] for line in f][:40]
    after = [gpt2.eod_id] if separator == "eod" else []
    stream = np.concatenate([np.append(gpt2.encode(t), after) for t in texts])
    cfg = default_data_config()
    cfg.cache_dir = str(tmp_path)
    for sep in ("eod", "none") if separator == "none" else (separator,):  # build the other shard first
        cfg.separator = sep
        batches = make_eval_batches(cfg, tokenizer=gpt2, seq_len=256, num_sequences=8, batch_size=8)
    expected = np.stack([stream[i * 256 : i * 256 + 256] for i in range(8)])
    np.testing.assert_array_equal(batches[0]["inputs"], expected)
    assert (int(np.sum(batches[0]["inputs"] == gpt2.eod_id)) > 0) == (separator == "eod")


def test_bad_separator_is_one_line_naming_the_flag():
    cfg = default_data_config()
    cfg.separator = "newline"
    with pytest.raises(DataError, match="set --config.data.separator to one of eod, bos, none"):
        check_data_config(cfg)
