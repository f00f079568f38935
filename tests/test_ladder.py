"""The ladder report: tokens to target, overhead and speed-ups against hand-computed values."""

import json
import os

import pytest

from fp4jax import ladder


def _write_run(root, name, evals, tokens_per_s):
    os.makedirs(root / name)
    lines = [{"step": s, "loss": 5.0, "tokens": 100 * s, "tokens_per_s": tokens_per_s} for s in range(1, 11)]
    lines[0]["tokens_per_s"] = 1.0  # a compile step: excluded from throughput
    lines += [{"step": 0, "loss": loss, "eval_loss": loss, "tokens": tokens} for tokens, loss in evals]
    with open(root / name / "metrics.jsonl", "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)


@pytest.fixture
def runs(tmp_path):
    _write_run(tmp_path, "fp8", [(100, 4.0), (200, 3.4), (300, 3.2)], tokens_per_s=1000.0)
    _write_run(tmp_path, "h16", [(100, 4.1), (200, 3.5), (300, 3.35), (400, 3.25)], tokens_per_s=1200.0)
    _write_run(tmp_path, "full", [(100, 4.5), (200, 4.4)], tokens_per_s=1250.0)
    return tmp_path


def test_tokens_to_target_is_the_first_eval_at_or_below_target():
    assert ladder.tokens_to_target([(1, 4.0), (2, 3.3), (3, 3.1)], 3.3) == 2
    assert ladder.tokens_to_target([(1, 4.0)], 3.3) is None


def test_overhead_and_speedups(runs):
    records = {n: ladder.read_metrics(str(runs / n)) for n in ("fp8", "h16", "full")}
    results = [ladder.summarize(n, records[n], 3.3) for n in ("fp8", "h16", "full")]
    rows = {r["run"]: r for r in ladder.ladder_rows(results, results[0])}
    assert rows["fp8"]["token_overhead"] == 0.0
    assert rows["h16"]["tokens_to_target"] == 400
    assert rows["h16"]["token_overhead"] == pytest.approx(400 / 300 - 1)
    assert rows["h16"]["step_speedup"] == pytest.approx(1.2)
    # time to target: fp8 300/1000 s, h16 400/1200 s
    assert rows["h16"]["end_to_end_speedup"] == pytest.approx((300 / 1000) / (400 / 1200))
    assert rows["full"]["tokens_to_target"] is None and rows["full"]["end_to_end_speedup"] is None


def test_report_writes_table_and_plot(runs, tmp_path):
    out = str(tmp_path / "out" / "ladder")
    table = ladder.report(str(runs), "fp8", "3.3", out)
    assert "| h16 | 400 | +33.3% |" in table and "| full | not reached |" in table
    assert os.path.getsize(out + ".png") > 1000


def test_auto_target_is_the_baselines_best_eval_loss(runs):
    table = ladder.report(str(runs), "fp8", "auto", None)
    assert "Target eval loss 3.2000" in table
    assert "| fp8 | 300 | +0.0% |" in table and "| h16 | not reached |" in table


def test_report_names_a_missing_baseline(runs):
    with pytest.raises(ValueError, match="baseline run 'bf16'"):
        ladder.report(str(runs), "bf16", "3.3", None)
