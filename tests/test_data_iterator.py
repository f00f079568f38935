"""The training iterator (exact resume, host sharding, per-epoch shuffling) and the evaluation batches."""

import gzip
import json

import numpy as np
import pytest

from fp4jax.data import (
    DataError,
    TokenStream,
    TrainIterator,
    default_data_config,
    make_eval_batches,
    make_train_iterator,
)
from fp4jax.data.assets import BUNDLED_DATA_DIR

T = 100  # seq_len of the synthetic stream: tokens 0..10_000 give W = 100 windows, window i starts at i*T


def _stream():
    flat = np.arange(10_001, dtype=np.uint32)
    return TokenStream([flat[:3_333], flat[3_333:]])  # two shards: windows cross a shard boundary


def _iterator(batch=8, seed=0, index=0, count=1, shuffle=True):
    return TrainIterator(
        _stream(),
        seq_len=T,
        global_batch=batch,
        seed=seed,
        process_index=index,
        process_count=count,
        shuffle=shuffle,
    )


def _window_ids(batch):
    return (batch["inputs"][:, 0] // T).tolist()


def _equal(a, b):
    return all(np.array_equal(a[k], b[k]) for k in ("inputs", "targets"))


def test_batches_are_packed_windows():
    it = _iterator()
    assert (it.windows_per_epoch, it.tokens_per_epoch) == (100, 10_000)
    batch = next(it)
    assert batch["inputs"].shape == batch["targets"].shape == (8, T)
    np.testing.assert_array_equal(batch["targets"][:, :-1], batch["inputs"][:, 1:])
    np.testing.assert_array_equal(batch["inputs"] - batch["inputs"][:, :1], np.tile(np.arange(T), (8, 1)))


def test_each_epoch_is_a_permutation_of_all_windows():
    it = _iterator(batch=10)
    epochs = [[w for _ in range(10) for w in _window_ids(next(it))] for _ in range(2)]
    assert sorted(epochs[0]) == sorted(epochs[1]) == list(range(100))
    assert epochs[0] != epochs[1] and epochs[0] != list(range(100))


def test_deterministic_from_the_seed():
    a, b, c = _iterator(seed=3), _iterator(seed=3), _iterator(seed=4)
    assert all(_equal(next(a), next(b)) for _ in range(5))
    assert _window_ids(next(a)) != _window_ids(next(c))


def test_unshuffled_order():
    it = _iterator(shuffle=False)
    assert [w for _ in range(13) for w in _window_ids(next(it))] == [*range(100), *range(4)]


@pytest.mark.parametrize("k", [0, 5, 12, 13, 30])  # 12: the batch spans epochs 0 and 1; 13: inside epoch 1
def test_resume_is_exact(k):
    reference = _iterator()
    batches = [next(reference) for _ in range(k + 3)]
    run = _iterator()
    for _ in range(k):
        next(run)
    state = json.loads(json.dumps(run.get_state()))  # what the checkpoint holds
    assert state["epoch"] * 100 + state["position"] == 8 * k
    resumed = _iterator()
    resumed.set_state(state)
    assert all(_equal(next(resumed), b) for b in batches[k:])


def test_resume_from_checkpointed_numpy_scalars():
    run = _iterator()
    for _ in range(14):
        next(run)
    state = {k: np.asarray(v) for k, v in run.get_state().items()}  # as a pytree checkpoint restores it
    resumed = _iterator()
    resumed.set_state(state)
    assert _equal(next(resumed), next(run))


def test_two_processes_read_disjoint_halves_of_the_global_batch():
    whole, p0, p1 = _iterator(), _iterator(index=0, count=2), _iterator(index=1, count=2)
    for _ in range(15):
        b, b0, b1 = next(whole), next(p0), next(p1)
        assert b0["inputs"].shape == (4, T)
        assert not set(_window_ids(b0)) & set(_window_ids(b1))
        assert _equal(b, {k: np.concatenate([b0[k], b1[k]]) for k in b})


def test_resume_with_another_process_layout():
    single = _iterator()
    for _ in range(7):
        next(single)
    state = single.get_state()
    halves = [_iterator(index=i, count=2) for i in range(2)]
    for h in halves:
        h.set_state(state)
    parts = [next(h) for h in halves]
    assert _equal(next(single), {k: np.concatenate([p[k] for p in parts]) for k in parts[0]})


def test_state_of_another_run_is_rejected():
    state = _iterator(seed=1).get_state()
    with pytest.raises(DataError, match="seed=1"):
        _iterator(seed=2).set_state(state)
    with pytest.raises(DataError, match="lacks"):
        _iterator().set_state({"epoch": 0})


def test_global_batch_not_divisible_by_process_count():
    with pytest.raises(DataError, match="global batch 6 is not divisible by process_count 4"):
        _iterator(batch=6, count=4)


def test_too_few_tokens_for_one_window():
    with pytest.raises(DataError, match="fewer than one window") as err:
        TrainIterator(TokenStream([np.arange(100, dtype=np.uint16)]), seq_len=100, global_batch=1)
    assert "\n" not in str(err.value)


# --------------------------------------------------------------------------------------------------------
# End to end on the bundled sample (tokenized once per module into a temporary cache).


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    cfg = default_data_config()
    cfg.cache_dir = str(tmp_path_factory.mktemp("cache"))
    return cfg


def test_bundled_training_iterator(cfg, gpt2):
    it = make_train_iterator(cfg, tokenizer=gpt2, seq_len=1024, global_batch=4, seed=0)
    assert it.windows_per_epoch == (442_918 + 91_120 + 1200 - 1) // 1024
    assert it.tokens_per_epoch == it.windows_per_epoch * 1024
    batch = next(it)
    assert batch["inputs"].shape == (4, 1024) and batch["inputs"].dtype == np.int32
    assert batch["inputs"].max() < gpt2.vocab_size


def test_eval_is_the_first_windows_of_the_validation_stream_in_order(cfg, gpt2):
    with gzip.open(BUNDLED_DATA_DIR / "c4-validation.00000-of-00001.json.gz", "rt") as f:
        texts = [json.loads(line)["text"] for line in f][:40]
    stream = np.concatenate([np.append(gpt2.encode(t), gpt2.eod_id) for t in texts])
    seq_len, n, b = 256, 12, 4
    expected = np.stack([stream[i * seq_len : i * seq_len + seq_len + 1] for i in range(n)])
    batches = make_eval_batches(cfg, tokenizer=gpt2, seq_len=seq_len, num_sequences=n, batch_size=b)
    assert len(batches) == n // b
    np.testing.assert_array_equal(np.concatenate([x["inputs"] for x in batches]), expected[:, :-1])
    np.testing.assert_array_equal(np.concatenate([x["targets"] for x in batches]), expected[:, 1:])
    shares = [
        make_eval_batches(
            cfg,
            tokenizer=gpt2,
            seq_len=seq_len,
            num_sequences=n,
            batch_size=b,
            process_index=p,
            process_count=2,
        )
        for p in range(2)
    ]
    for k, batch in enumerate(batches):
        np.testing.assert_array_equal(
            np.concatenate([shares[0][k]["inputs"], shares[1][k]["inputs"]]), batch["inputs"]
        )


def test_eval_wants_more_sequences_than_exist(cfg, gpt2):
    # 479,224 validation tokens hold 58 windows of 8192.
    with pytest.raises(
        DataError, match="eval wants 64 sequences of 8,192 tokens .* only 58 sequences"
    ) as err:
        make_eval_batches(cfg, tokenizer=gpt2, seq_len=8192, num_sequences=64, batch_size=8)
    assert "\n" not in str(err.value)


def test_eval_sizes_are_checked(cfg, gpt2):
    with pytest.raises(DataError, match="not a positive multiple of batch_size 4"):
        make_eval_batches(cfg, tokenizer=gpt2, seq_len=64, num_sequences=10, batch_size=4)
    with pytest.raises(DataError, match="eval batch_size 4 is not divisible by process_count 3"):
        make_eval_batches(cfg, tokenizer=gpt2, seq_len=64, num_sequences=8, batch_size=4, process_count=3)
