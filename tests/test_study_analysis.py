"""The study's analysis on synthetic runs: interpolated crossing, seed statistics against an independent
computation, overhead and speed-up spreads by their stated rules, diverged / missing / old-style runs, the
summary the ladder derives when the trainer wrote none, and the report's files."""

import json
import math
import os

import numpy as np
import pytest

from fp4jax.study import analysis, plots, report, runs, tables

TOKENS_PER_STEP = 100


def write_run(
    run_dir,
    evals,
    *,
    status="reached",
    target=3.3,
    tokens_per_s=1000.0,
    extra=None,
    summary=True,
    runs_per_gpu=1,
):
    """A run as the trainer writes it (training/summary.py): evals [(step, loss)], metrics.jsonl with 10
    train steps a eval, and summary.json; and the runner's record of one attempt with `runs_per_gpu` runs
    sharing its GPU (none for runs_per_gpu=None)."""
    os.makedirs(run_dir, exist_ok=True)
    record = os.path.join(run_dir, runs.RECORD_FILE)
    if runs_per_gpu is None and os.path.exists(record):
        os.remove(record)
    if runs_per_gpu is not None:
        attempt = {"exit_code": 0, "wall_time_s": 60.0, "runs_per_gpu": runs_per_gpu, "status": status}
        runs.write_json(record, {"attempts": 1, "history": [attempt]})
    last = evals[-1][0] if evals else 10
    lines = [
        {"step": s, "loss": 5.0, "tokens": TOKENS_PER_STEP * s, "sequences": s, "tokens_per_s": tokens_per_s}
        for s in range(1, last + 1)
    ]
    lines += [{"step": s, "loss": v, "eval_loss": v, "tokens": TOKENS_PER_STEP * s} for s, v in evals]
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    if summary:
        s = {
            "status": status,
            "target_eval_loss": target,
            "tokens": TOKENS_PER_STEP * last,
            "evals": [[st, st, TOKENS_PER_STEP * st, v] for st, v in evals],
            "tokens_per_s_median": tokens_per_s,
            **(extra or {}),
        }
        runs.write_json(os.path.join(run_dir, "summary.json"), s)


def independent_crossing(evals, target):
    """Slow reference: scan pairs, solve the line through the bracket for the target."""
    for (s0, l0), (s1, l1) in zip(evals, evals[1:], strict=False):
        if l0 > target >= l1:
            slope = (l1 - l0) / ((s1 - s0) * TOKENS_PER_STEP)
            return s0 * TOKENS_PER_STEP + (target - l0) / slope
    return None


# Baseline and "h16" reach 3.3 at different points per seed; "full" diverges on seed 1 and runs out on 2.
BASE = {0: [(10, 4.0), (20, 3.5), (30, 3.0)], 1: [(10, 4.0), (20, 3.4), (30, 3.2)], 2: [(10, 3.9), (20, 3.3)]}
H16 = {
    0: [(10, 4.1), (20, 3.6), (30, 3.25)],
    1: [(10, 4.0), (20, 3.5), (30, 3.1)],
    2: [(10, 4.0), (20, 3.45), (30, 3.3)],
}


@pytest.fixture
def study(tmp_path):
    for seed, evals in BASE.items():
        write_run(tmp_path / "fp8" / f"seed{seed}", evals, tokens_per_s=1000.0)
    for seed, evals in H16.items():
        write_run(tmp_path / "h16" / f"seed{seed}", evals, tokens_per_s=1250.0)
    write_run(tmp_path / "full" / "seed0", [(10, 4.2), (20, 3.8), (30, 3.29)], tokens_per_s=1300.0)
    diverged = {"diverged_step": 17, "diverged_tokens": 1700, "divergence_reason": "non_finite_loss"}
    write_run(tmp_path / "full" / "seed1", [(10, 4.3)], status="diverged", extra=diverged)
    write_run(tmp_path / "full" / "seed2", [(10, 4.2), (20, 3.9), (30, 3.6)], status="not_reached")
    return tmp_path


def test_crossing_interpolates_linearly_between_the_bracketing_evaluations():
    evals = [(1, 100, 4.0), (2, 200, 3.5), (3, 300, 3.0), (4, 400, 2.0)]
    hit = analysis.crossing(evals, 3.25)
    assert hit["tokens"] == 250.0 and hit["interval"] == 100  # 200 + (3.5 - 3.25) / (3.5 - 3.0) * 100
    assert hit["bracket"] == [[200, 3.5], [300, 3.0]]
    assert analysis.crossing(evals, 3.0)["tokens"] == 300.0  # exactly on an evaluation
    first = analysis.crossing(evals, 4.5)
    assert first["first_eval"] and first["tokens"] == 100.0 and first["bracket"] is None
    assert analysis.crossing(evals, 1.0) is None
    for seed_evals in list(BASE.values()) + list(H16.values()):
        ev = [(s, s * TOKENS_PER_STEP, v) for s, v in seed_evals]
        want = independent_crossing(seed_evals, 3.3)
        got = analysis.crossing(ev, 3.3)
        assert (got is None and want is None) or got["tokens"] == pytest.approx(want, rel=1e-12)


def test_seed_statistics_overhead_and_speedup(study):
    result = analysis.analyze(analysis.load_runs(str(study)), "fp8")
    assert result["target_eval_loss"] == 3.3 and result["target_rule"] == "the configs' target_eval_loss"
    groups = {g["rung"]: g for g in result["groups"]}
    t_b = np.array([independent_crossing(BASE[s], 3.3) for s in range(3)])
    t_h = np.array([independent_crossing(H16[s], 3.3) for s in range(3)])
    b, h = groups["fp8"], groups["h16"]
    assert b["tokens_to_target_mean"] == pytest.approx(t_b.mean())
    assert b["tokens_to_target_sd"] == pytest.approx(t_b.std(ddof=1))
    assert h["tokens_to_target_sd"] == pytest.approx(t_h.std(ddof=1))
    assert h["eval_intervals"] == [1000]
    # delta method on the ratio of means, se = sd / sqrt(n)
    ratio = t_h.mean() / t_b.mean()
    rel = np.sqrt((t_h.std(ddof=1) / 3**0.5 / t_h.mean()) ** 2 + (t_b.std(ddof=1) / 3**0.5 / t_b.mean()) ** 2)
    assert h["token_overhead"] == pytest.approx(ratio - 1)
    assert h["token_overhead_se"] == pytest.approx(ratio * rel)
    assert h["paired"]["mean"] == pytest.approx(np.mean(t_h / t_b - 1))
    assert h["paired"]["sd"] == pytest.approx(np.std(t_h / t_b - 1, ddof=1))
    # T = tokens / throughput; speed-up T_b / T_h, time saved 1 - T_h / T_b
    speed = (t_b.mean() / 1000.0) / (t_h.mean() / 1250.0)
    assert h["step_speedup"] == pytest.approx(1.25)
    assert h["end_to_end_speedup"] == pytest.approx(speed)
    assert h["time_saved"] == pytest.approx(1 - 1 / speed)
    assert h["end_to_end_speedup_se"] == pytest.approx(speed * rel)
    assert b["token_overhead"] == 0.0


@pytest.mark.parametrize("h16_sharing", [3, None])
def test_throughputs_under_different_or_unrecorded_gpu_sharing_give_no_speedup(study, h16_sharing):
    write_run(study / "h16" / "seed1", H16[1], tokens_per_s=1250.0, runs_per_gpu=h16_sharing)
    result = analysis.analyze(analysis.load_runs(str(study)), "fp8")
    h = {g["rung"]: g for g in result["groups"]}["h16"]
    assert h["runs_per_gpu"] is None and h["tokens_per_s"] == pytest.approx(1250.0)
    assert h["step_speedup"] is None and h["end_to_end_speedup"] is None and h["time_saved"] is None
    assert h["token_overhead"] is not None  # the token metrics do not depend on the sharing
    line = next(row for row in tables.ladder_table(result) if row.startswith("| h16 "))
    # The other seeds ran alone: seed 1's recorded 3 makes the group mixed, its missing record unknown.
    assert ("1,250 (mixed: 1, 3 runs per GPU)" if h16_sharing else "1,250 (sharing not recorded)") in line


def test_a_run_filled_from_an_earlier_stage_has_that_runs_gpu_sharing(tmp_path):
    write_run(tmp_path / "first" / "a" / "seed0", BASE[0], runs_per_gpu=2)
    write_run(tmp_path / "second" / "a" / "seed0", BASE[0], runs_per_gpu=None)
    record = {"attempts": 0, "history": [], "reused_from": "first/a/seed0"}
    runs.write_json(str(tmp_path / "second" / "a" / "seed0" / runs.RECORD_FILE), record)
    run = analysis.load_run("a", None, 0, str(tmp_path / "second" / "a" / "seed0"))
    assert run.runs_per_gpu == 2


def test_a_diverged_seed_is_counted_not_averaged_and_reads_diverged(study):
    result = analysis.analyze(analysis.load_runs(str(study)), "fp8")
    full = next(g for g in result["groups"] if g["rung"] == "full")
    assert full["counts"] == {"reached": 1, "not_reached": 1, "diverged": 1, "failed": 0, "unfinished": 0}
    assert full["tokens_to_target_n"] == 1 and full["tokens_to_target_sd"] is None
    assert full["token_overhead_se"] is None  # one seed reached: no spread to propagate
    table = tables.to_markdown(result)
    line = next(line for line in table.splitlines() if line.startswith("| full |"))
    assert "s1: diverged @ step 17" in line and "s2: not reached within budget (3,000 tokens)" in line
    assert "| 1 / 1 / 1 |" in line


def test_a_lone_diverged_rung_reads_diverged_at_its_step(tmp_path):
    write_run(tmp_path / "fp8" / "seed0", BASE[0])
    extra = {"diverged_step": 12, "diverged_tokens": 1200, "divergence_reason": "loss_spike"}
    write_run(tmp_path / "sr" / "seed0", [(10, 4.3)], status="diverged", extra=extra)
    table = tables.to_markdown(analysis.analyze(analysis.load_runs(str(tmp_path)), "fp8"))
    assert "| sr | 0 / 1 / 0 | diverged @ step 12 |" in table


def test_missing_rung_and_missing_baseline(study):
    all_runs = analysis.load_runs(str(study))
    result = analysis.analyze(all_runs, "fp8", rungs=["fp8", "h16", "h32"])
    assert result["missing_rungs"] == ["h32"] and [g["rung"] for g in result["groups"]] == ["fp8", "h16"]
    assert "| h32 | missing: no runs under the root |" in tables.to_markdown(result)
    with pytest.raises(ValueError, match="baseline run 'bf16' has no runs"):
        analysis.analyze(all_runs, "bf16")


def test_old_style_summaries_and_one_seed_layout(tmp_path):
    """An older trainer's summary (target_reached, evals without tokens) in <root>/<rung>/ directly."""
    write_run(tmp_path / "fp8", BASE[0], summary=False)
    old = {"status": "target_reached", "target_eval_loss": 3.3, "evals": [[10, 10, 4.0], [20, 20, 3.5]]}
    runs.write_json(str(tmp_path / "fp8" / "summary.json"), old)
    write_run(tmp_path / "h16", H16[0], summary=False)
    runs.write_json(str(tmp_path / "h16" / "summary.json"), dict(old, status="budget_exhausted"))
    loaded = {r.rung: r for r in analysis.load_runs(str(tmp_path))}
    assert loaded["fp8"].status == "reached" and loaded["h16"].status == "not_reached"
    assert loaded["fp8"].seed == 0 and loaded["fp8"].evals[-1] == (30, 3000, 3.0)  # tokens from metrics
    result = analysis.analyze(list(loaded.values()), "fp8")
    assert result["groups"][0]["tokens_to_target_mean"] == pytest.approx(independent_crossing(BASE[0], 3.3))


def test_targets_config_given_and_auto(study):
    all_runs = analysis.load_runs(str(study))
    assert analysis.resolve_target(all_runs, "fp8", "3.25") == (3.25, "given (--target)")
    target, rule = analysis.resolve_target(all_runs, "fp8", "auto+0.05")
    assert target == pytest.approx(3.3 + 0.05) and "worst of the baseline's 3 run(s)' best eval loss" in rule
    write_run(study / "h32" / "seed0", H16[0], target=3.0)
    with pytest.raises(ValueError, match=r"target_eval_loss values are \[3.0, 3.3\]"):
        analysis.resolve_target(analysis.load_runs(str(study)), "fp8", "config")
    with pytest.raises(ValueError, match="--target 'soon'"):
        analysis.resolve_target(all_runs, "fp8", "soon")


def test_derived_summary_of_a_diverged_and_a_crashed_run(tmp_path):
    write_run(tmp_path, [(4, 6.0)], summary=False)
    with open(tmp_path / "metrics.jsonl", "a") as f:
        f.write(json.dumps({"step": 5, "loss": 5.5, "tokens": 500, "sequences": 5}) + "\n")
    records = runs.read_records(str(tmp_path))
    no_nan = runs.derive_summary(records, exit_code=3, failure=None)
    assert no_nan["diverged_step"] == 6 and no_nan["divergence"]["kind"] is None  # after the last one logged
    rejected = {"step": 6, "loss": 5.2, "grad_norm": float("inf"), "tokens": 600, "sequences": 6}
    records.append(json.loads(json.dumps(rejected)))  # the trainer logs the update its guard rejects
    d = runs.derive_summary(records, exit_code=3, failure=None, target=5.9)
    assert d["status"] == "diverged" and d["diverged_step"] == 6 and d["diverged_tokens"] == 600
    assert d["divergence"] == {"kind": "non_finite_grad_norm", "step": 6, "value": float("inf")}
    assert d["divergence_reason"] == "non_finite_grad_norm"
    assert d["last_finite_losses"][-1] == [5, 5.5] and len(d["last_finite_losses"]) == 5
    assert d["evals"] == [[4, None, 400, 6.0]] and d["tokens_to_target"] is None
    crash = runs.derive_summary(records, exit_code=1, failure="exit code 1", target=6.5)
    assert crash["status"] == "failed" and crash["diverged_step"] is None and crash["tokens_to_target"] == 400
    assert runs.status_of(crash) == "failed" and not math.isnan(crash["tokens_per_s_median"])


def test_lr_sweep_table_and_report_files(tmp_path):
    for lr, loss in ((1e-4, 3.6), (1e-3, 3.2), (1e-2, None)):
        for seed in (0, 1):
            d = tmp_path / "fp8" / f"lr{lr:g}" / f"seed{seed}"
            if loss is None:
                extra = {"diverged_step": 3, "divergence_reason": "non_finite_loss"}
                write_run(d, [(2, 9.0)], status="diverged", extra=extra)
            else:
                write_run(d, [(10, 4.0), (20, loss + 0.01 * seed)], status="not_reached", target=3.0)
    result = analysis.analyze(analysis.load_runs(str(tmp_path)), "fp8", "3.0")
    curve = result["lr_sensitivity"]["fp8"]
    assert [row[0] for row in curve] == [1e-4, 1e-3, 1e-2]
    assert curve[0][1] == pytest.approx(3.605) and curve[0][2] == pytest.approx(np.std([3.6, 3.61], ddof=1))
    assert curve[2][1:] == [None, None, 0, 2]
    assert result["groups"][0]["token_overhead"] is None  # the baseline never reached: no overhead, not 0
    table = tables.to_markdown(result)
    assert "| fp8 | 3.6050 ± 0.0071 | 3.2050 ± 0.0071 | (2 diverged) |" in table
    paths = report.write(
        str(tmp_path / "out" / "lr"), tables.to_markdown(result), result, lambda b: plots.plot_all(result, b)
    )
    names = ["lr.md", "lr.json", "lr.png", "lr_overhead.png", "lr_lr.png"]
    assert [os.path.basename(p) for p in paths] == names
    assert all(os.path.getsize(p) > 500 for p in paths)
    with open(paths[1]) as f:
        assert json.load(f)["lr_sensitivity"]["fp8"][2][4] == 2


def test_diagnostics_over_training_are_reduced_tabled_and_plotted(tmp_path):
    """Probe lines (diag/<kind>/<gemm>/<quantity>) on steps 5 and 10: the mean over layer kinds per GEMM, the
    last probe by kind, and the overhead sum(diag_time_s) / sum(step_time_s)."""
    write_run(tmp_path / "fp8" / "seed0", BASE[0])
    path = tmp_path / "fp8" / "seed0" / "metrics.jsonl"
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    errs = {("q", "wgrad"): (0.1, 0.3), ("down", "wgrad"): (0.2, 0.5), ("q", "fprop"): (0.01, 0.02)}
    for line in lines:
        line["step_time_s"] = 0.5
        if "eval_loss" not in line and line["step"] in (5, 10):
            i = line["step"] // 5 - 1
            line.update({f"diag/{k}/{g}/out_rel_err": v[i] for (k, g), v in errs.items()})
            line.update(
                {"diag/layer_00/wgrad/out_rel_err": 0.4, "diag/q/wgrad/x_rel_err": 9.0}
                | {"diag_time_s": (2.0, 0.05)[i]}  # the first probe compiles
            )
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = analysis.analyze(analysis.load_runs(str(tmp_path)), "fp8")
    d = result["groups"][0]["runs"][0]["diagnostics"]
    assert d["steps"] == [5, 10] and list(d["out_rel_err"]) == ["fprop", "wgrad"]
    assert d["out_rel_err"]["wgrad"] == pytest.approx([0.15, 0.4]) and d["out_rel_err"]["fprop"] == [
        0.01,
        0.02,
    ]
    assert d["last_out_rel_err"] == {"q/wgrad": 0.3, "down/wgrad": 0.5, "q/fprop": 0.02}
    assert d["last_wgrad_by_layer"] == [0.4]
    assert d["overhead"] == pytest.approx((2.0 + 0.05) / (30 * 0.5))  # 30 training lines of 0.5 s
    assert d["probe_steps"] == pytest.approx(0.05 / 0.5)  # the first probe compiles: left out
    assert "| fp8 | 0 | 10 | 2.000e-02 | - | 4.000e-01 | 13.67% | 0.10 |" in tables.to_markdown(result)
    paths = report.write(
        str(tmp_path / "out" / "d"), tables.to_markdown(result), result, lambda b: plots.plot_all(result, b)
    )
    assert paths[-1].endswith("d_diagnostics.png") and os.path.getsize(paths[-1]) > 1000
