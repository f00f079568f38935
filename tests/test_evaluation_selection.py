"""Which validation windows an evaluation reads: "first" (the MLPerf prefix) and "spread" (evenly strided
over the whole stream), the same for every seed and recipe; the final evaluation's size, its record in the
metrics and the summary, and the one-line errors for bad values."""

from fractions import Fraction

import numpy as np
import pytest
from tiny_runs import COMPARED, bytes_tokenizer, compilation_cache, tiny_config

from fp4jax.data import DataError, eval_sources, eval_window_ids, load_token_stream, make_eval_batches
from fp4jax.data.packing import make_batch, num_windows
from fp4jax.training import evaluation, setup, trainer
from fp4jax.training.errors import ConfigError
from fp4jax.training.metrics import read_metrics

# The tiny runs' byte-level tokenizer in the trainer too (pytest finds the module fixture here), so that
# the runs below evaluate on the stream these tests read.
FIXTURES = (compilation_cache,)


@pytest.mark.parametrize("available,n", [(752, 256), (752, 752), (10, 3), (1000, 1), (7, 7), (100, 64)])
def test_spread_reads_the_window_at_the_middle_of_each_of_n_equal_strata(available, n):
    ids = eval_window_ids(available, n, "spread")
    assert len(ids) == n and len(set(ids.tolist())) == n and list(ids) == sorted(ids)
    for i, window in enumerate(ids.tolist()):  # window w holds positions [w, w + 1) of the stream
        middle = (i + Fraction(1, 2)) * Fraction(available, n)
        assert window <= middle < window + 1
    assert ids[0] < available / n and ids[-1] >= available - available / n  # both ends of the stream


def test_first_is_the_prefix_and_bad_values_are_one_line_errors():
    assert eval_window_ids(752, 4, "first").tolist() == [0, 1, 2, 3]
    with pytest.raises(DataError, match="set --config.eval_selection to one of first, spread"):
        eval_window_ids(752, 4, "shuffled")
    with pytest.raises(DataError, match="eval of 753 sequences from 752 available"):
        eval_window_ids(752, 753, "spread")


@pytest.fixture(scope="module")
def stream(token_cache):
    """The bundled C4 sample's validation stream, byte-level (what tiny_config's runs evaluate on)."""
    cfg = tiny_config(token_cache).data
    return cfg, load_token_stream(
        eval_sources(cfg), bytes_tokenizer(), cache_dir=cfg.cache_dir, num_threads=1
    )


def test_spread_batches_are_the_strided_windows_of_the_whole_stream(stream):
    cfg, tokens = stream
    seq_len, n, b = 32, 24, 8
    available = num_windows(len(tokens), seq_len)
    batches = make_eval_batches(
        cfg, bytes_tokenizer(), seq_len=seq_len, num_sequences=n, batch_size=b, selection="spread"
    )
    rows = np.concatenate([x["inputs"] for x in batches])
    stride = Fraction(available, n)
    expected = [int((i + Fraction(1, 2)) * stride) for i in range(n)]  # the middle of each stratum
    assert np.array_equal(rows, make_batch(tokens, expected, seq_len)["inputs"])
    assert expected[-1] > available * (n - 1) // n  # the last stratum of the stream is read
    first = make_eval_batches(cfg, bytes_tokenizer(), seq_len=seq_len, num_sequences=n, batch_size=b)
    assert np.array_equal(
        np.concatenate([x["inputs"] for x in first]), make_batch(tokens, range(n), 32)["inputs"]
    )


def test_at_most_takes_every_window_to_a_multiple_of_the_batch(stream):
    cfg, tokens = stream
    available = num_windows(len(tokens), 32)
    batches = make_eval_batches(
        cfg,
        bytes_tokenizer(),
        seq_len=32,
        num_sequences=10**7,
        batch_size=8,
        selection="spread",
        at_most=True,
    )
    assert sum(len(x["inputs"]) for x in batches) == available // 8 * 8
    with pytest.raises(DataError, match="only"):
        make_eval_batches(cfg, bytes_tokenizer(), seq_len=32, num_sequences=10**7 // 8 * 8, batch_size=8)


def _eval_set(token_cache, **overrides):
    config = setup.resolve_config(tiny_config(token_cache, **overrides))
    return evaluation.load_eval_set(config, bytes_tokenizer(), setup.make_run_mesh(config))


def test_the_eval_set_does_not_depend_on_the_seed_or_the_recipe(token_cache):
    spread = {"eval_selection": "spread", "eval_sequences": 16}
    sets = [
        _eval_set(token_cache, **spread, seed=seed, recipe=recipe)
        for seed, recipe in [(0, "fp8_delayed"), (1, "fp8_delayed"), (7, "mxfp4_full"), (2, "bf16")]
    ]
    flat = [np.concatenate([np.asarray(b["inputs"]) for b in s]) for s in sets]
    assert all(np.array_equal(flat[0], f) for f in flat[1:])
    prefix = np.concatenate([np.asarray(b["inputs"]) for b in _eval_set(token_cache, eval_sequences=16)])
    assert not np.array_equal(flat[0], prefix)  # spread is not the prefix


@pytest.mark.parametrize(
    "overrides,message",
    [
        ({"eval_selection": "random"}, "unknown eval_selection 'random': set --config.eval_selection"),
        ({"final_eval_sequences": -1}, "final_eval_sequences must be an integer >= 0"),
        ({"final_eval_sequences": 4}, "final_eval_sequences 4 is below eval_batch_size 8"),
    ],
)
def test_bad_eval_settings_are_one_line_config_errors(token_cache, overrides, message):
    with pytest.raises(ConfigError, match=message) as info:
        evaluation.check_eval_config(tiny_config(token_cache, **overrides))
    assert "\n" not in str(info.value)


def test_the_final_evaluation_is_recorded_apart_from_the_periodic_ones(tmp_path, token_cache):
    """A tiny run with a final evaluation of 44 windows (cut to 40, a multiple of the eval batch; the
    data-level cut to what the validation set holds is tested above): the periodic evaluations and the
    training lines are those of the same run without it."""
    spread = {"eval_selection": "spread", "eval_at_end": True}
    with_final = trainer.train(
        tiny_config(token_cache, **spread, final_eval_sequences=44), str(tmp_path / "a")
    )
    without = trainer.train(tiny_config(token_cache, **spread), str(tmp_path / "b"))
    final = with_final["final_eval"]
    assert (final["step"], final["tokens"], final["final_eval_selection"]) == (6, 6 * 8 * 32, "spread")
    assert final["final_eval_sequences"] == 40
    assert np.isfinite(final["final_eval_loss"]) and "final_eval" not in without
    assert (
        with_final["evals"] == without["evals"] and with_final["last_eval_loss"] == without["last_eval_loss"]
    )
    lines = read_metrics(str(tmp_path / "a"))
    assert [r for r in lines if "final_eval_loss" in r] == [final]
    assert "loss" not in final and "eval_loss" not in final
    periodic = lambda run: [
        {k: r.get(k) for k in COMPARED} for r in read_metrics(str(run)) if "final_eval_loss" not in r
    ]
    assert periodic(tmp_path / "a") == periodic(tmp_path / "b")
