"""The token cache: reuse on the second run, invalidation when a file changes, partial shards rebuilt."""

import gzip
import shutil

import numpy as np
import pytest

import fp4jax.data.cache as cache
from fp4jax.data import DataError, default_data_config, load_tokenizer, make_train_iterator
from fp4jax.data.assets import BUNDLED_DATA_DIR
from fp4jax.data.cache import load_token_stream
from fp4jax.data.sources import json_sources, train_files

SMALL = "c4-train.00001-of-00002.json.gz"  # 200 documents, 91,120 GPT-2 tokens


@pytest.fixture
def data_dir(tmp_path):
    shutil.copy(BUNDLED_DATA_DIR / SMALL, tmp_path / SMALL)
    return tmp_path


def _stream(data_dir, tok, cache_dir, on_bad_record="error", **kwargs):
    sources = json_sources(train_files(str(data_dir), "c4-train.*.json.gz"), on_bad_record)
    return load_token_stream(
        sources,
        tok,
        cache_dir=str(cache_dir),
        num_threads=2,
        on_bad_record=on_bad_record,
        progress=False,
        **kwargs,
    )


def _bins(cache_dir):
    return sorted(cache_dir.glob("tokens/*/*.bin"))


def test_second_run_reads_the_cache(data_dir, tmp_path, gpt2, monkeypatch):
    cfg = default_data_config()
    cfg.path, cfg.cache_dir = str(data_dir), str(tmp_path / "cache")
    first = make_train_iterator(cfg, tokenizer=gpt2, seq_len=512, global_batch=2, progress=False)
    (shard,) = _bins(tmp_path / "cache")
    mtime = shard.stat().st_mtime_ns

    def fail(*args, **kwargs):
        raise AssertionError("the tokenizer ran again")

    monkeypatch.setattr(cache, "build_shard", fail)
    second = make_train_iterator(cfg, tokenizer=gpt2, seq_len=512, global_batch=2, progress=False)
    assert second.windows_per_epoch == first.windows_per_epoch
    assert all(np.array_equal(a, b) for a, b in zip(next(first).values(), next(second).values(), strict=True))
    assert shard.stat().st_mtime_ns == mtime
    assert len(np.fromfile(shard, np.uint16)) == 91_120 + 200


def test_changed_file_is_tokenized_again(data_dir, tmp_path, gpt2):
    before = _stream(data_dir, gpt2, tmp_path / "cache")
    with open(data_dir / SMALL, "ab") as f:
        f.write(gzip.compress(b'{"text":"hello world"}\n'))
    after = _stream(data_dir, gpt2, tmp_path / "cache")
    assert len(after) == len(before) + 3 and after.num_documents == 201
    assert len(_bins(tmp_path / "cache")) == 2


def test_partial_shard_is_rebuilt(data_dir, tmp_path, gpt2):
    full = len(_stream(data_dir, gpt2, tmp_path / "cache"))
    (shard,) = _bins(tmp_path / "cache")
    shard.write_bytes(shard.read_bytes()[:1000])  # e.g. a copy that was cut short
    assert len(_stream(data_dir, gpt2, tmp_path / "cache")) == full


def test_tokenizer_keys_the_cache(data_dir, tmp_path, gpt2, monkeypatch):
    _stream(data_dir, gpt2, tmp_path / "cache")
    other = load_tokenizer("gpt2")
    object.__setattr__(other, "fingerprint", "0" * 16)
    _stream(data_dir, other, tmp_path / "cache")
    assert len(_bins(tmp_path / "cache")) == 2


def test_skipped_records_are_remembered(data_dir, tmp_path, gpt2):
    with open(data_dir / SMALL, "ab") as f:
        f.write(gzip.compress(b"{not json\n"))
    with pytest.raises(DataError, match=r":201: malformed JSON"):
        _stream(data_dir, gpt2, tmp_path / "cache")
    stream = _stream(data_dir, gpt2, tmp_path / "cache", on_bad_record="skip")
    assert stream.num_documents == 200
    with pytest.raises(DataError, match="1 bad records skipped"):
        _stream(data_dir, gpt2, tmp_path / "cache")


def test_min_tokens_reads_a_prefix_of_the_files(tmp_path, gpt2):
    for name in ("c4-train.00000-of-00002.json.gz", SMALL):
        shutil.copy(BUNDLED_DATA_DIR / name, tmp_path / name)
    stream = _stream(tmp_path, gpt2, tmp_path / "cache", min_tokens=1000)
    assert stream.num_documents == 1000 and len(_bins(tmp_path / "cache")) == 1


def test_worker_processes_build_the_same_shards(tmp_path, gpt2):
    for name in ("c4-train.00000-of-00002.json.gz", SMALL):
        shutil.copy(BUNDLED_DATA_DIR / name, tmp_path / name)
    in_process = _stream(tmp_path, gpt2, tmp_path / "a")
    in_workers = _stream(tmp_path, gpt2, tmp_path / "b", processes=2)
    assert len(in_workers) == len(in_process) == 442_918 + 91_120 + 1200
    np.testing.assert_array_equal(in_workers.read(0, len(in_workers)), in_process.read(0, len(in_process)))
