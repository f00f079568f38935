"""The LR stress stages: the committed plan's, the plan keys count_spikes and lr_reference (one-line
errors), and the report's spike counts, divergences, paired differences across LR points and verdicts on
fake run directories written as the trainer writes them (metrics.jsonl, summary.json)."""

import json
import math
import os
import re

import pytest
from study_plans import CLAIMS_FROM, stage_toml

from fp4jax.study import __main__ as study_cli
from fp4jax.study import designs, lr_stress, plan, report, reuse, runner, runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAN = os.path.join(ROOT, "fp4jax", "study", "plans", "proxy125m.toml")
STEPS, EVERY, TOKENS = 200, 20, 1000  # a fake run: 200 updates of 1,000 tokens, an evaluation every 20


def _stage(name: str, lr: float, extra: str = "") -> str:
    """A stage of the tiny series: arms a (fp8, the baseline) and b (mxfp4_full), 200 updates at `lr`."""
    arms = {"a": "fp8", "b": "mxfp4_full"}
    return stage_toml(name, arms, steps=STEPS, warmup_steps=10, peak_lr=lr, extra=extra)


STRESS = 'lr_reference = "ref"\ncount_spikes = { spike_nats = 0.1, window = 20 }\n'
TINY = (
    'name = "tiny"\n'
    + CLAIMS_FROM
    + _stage("ref", 1e-3)
    + _stage("x4", 4e-3, STRESS)
    + _stage("x16", 1.6e-2, STRESS)
)


@pytest.fixture
def tiny(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = tmp_path / "tiny.toml"
    path.write_text(TINY)
    return designs.load_plan(str(path))


def write_run(run_dir, offset: float, *, bump=None, stop=None):
    """A run at training loss 3.0 with `bump` = (first step, last step, nats) added, evaluated every EVERY
    updates at 4 - step / 1000 + offset. stop = (step, kind): the trainer stopped there, diverged (a
    non_finite_loss run logs NaN at that step), and wrote its divergence into summary.json."""
    os.makedirs(run_dir)
    last = stop[0] if stop else STEPS
    loss = {s: 3.0 + (bump[2] if bump and bump[0] <= s <= bump[1] else 0.0) for s in range(1, last + 1)}
    if stop and stop[1] == "non_finite_loss":
        loss[last] = math.nan
    lines = [{"step": s, "loss": v, "tokens": TOKENS * s, "sequences": s} for s, v in loss.items()]
    evals = [[s, s, TOKENS * s, 4 - s / 1000 + offset] for s in range(EVERY, last + 1, EVERY)]
    lines += [{"step": e[0], "loss": e[3], "eval_loss": e[3], "tokens": e[2]} for e in evals]
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
    summary = {
        "status": "not_reached",
        "steps": last,
        "evals": evals,
        "target_eval_loss": 1.0,
        "divergence": None,
    }
    if stop:
        window_mean = sum(loss[s] for s in range(last - 19, last + 1)) / 20
        divergence = {"kind": stop[1], "step": last, "value": window_mean}
        summary.update(
            status="diverged", divergence=divergence, diverged_step=last, divergence_reason=stop[1]
        )
        summary["exit_code"] = runs.DIVERGED_EXIT
    runs.write_json(runs.summary_path(run_dir), summary)


# Eval offsets per stage, arm and seed: b - a is 0.010 and 0.012 at 1x, 0.030 and 0.034 at 4x.
OFFSETS = {
    "ref": {"a": (0.0, 0.004), "b": (0.010, 0.016)},
    "x4": {"a": (0.0, 0.002), "b": (0.030, 0.036)},
    "x16": {"a": (0.05, 0.052), "b": (0.06, 0.064)},
}
SPIKED = {("x4", "b", 0): {"bump": (101, 130, 0.3)}}  # 0.3 nats for 30 updates: one counted spike
DIVERGED = {  # 16x, arm b: a 1.5-nat jump the trainer's 1-nat rule stops at update 164; a NaN at 90
    ("x16", "b", 0): {"bump": (151, STEPS, 1.5), "stop": (164, "loss_spike")},
    ("x16", "b", 1): {"stop": (90, "non_finite_loss")},
}


def write_stages(root, stages=("ref", "x4", "x16"), offsets=OFFSETS, special=None):
    special = {**SPIKED, **DIVERGED} if special is None else special
    for stage in stages:
        for arm, by_seed in offsets[stage].items():
            for seed, offset in enumerate(by_seed):
                directory = os.path.join(root, stage, arm, f"seed{seed}")
                write_run(directory, offset, **special.get((stage, arm, seed), {}))


def test_the_committed_plan_runs_the_lr_stress_test_at_4x_and_16x_against_the_ladder():
    p = designs.load_plan(PLAN)
    ladder = p.stage("ladder")
    arms = {"fp8": "fp8_mlperf", "full": "mxfp4_full"}
    arms |= {"full_h16": "mxfp4_full_h16", "full_sr_prescale": "mxfp4_full_sr_prescale"}
    for name, times in (("lr_stress_4x", 4), ("lr_stress_16x", 16)):
        s = p.stage(name)
        assert s.arms == arms and s.seeds == (0, 1) and s.options.lr_reference == "ladder"
        assert s.peak_lr == pytest.approx(times * ladder.peak_lr) and s.requires == ("calibration",)
        assert s.options.count_spikes == {"spike_nats": 0.1, "window": 20}
        rule = {"divergence.spike_nats": 1.0, "divergence.window": 20}
        assert s.overrides == {**ladder.overrides, **rule}
        spec = plan.stage_specs(s)[-1]
        config = runner.load_config(spec.rung.config, spec.config_args([]))  # the override path works
        assert (config.divergence.spike_nats, config.divergence.window) == (1.0, 20)
        assert config.optimizer.peak_lr == pytest.approx(times * 1.5e-3) and config.steps == 1000
    assert lr_stress.references(p) == ["ladder"]
    stress = [s for s in p.stages if lr_stress.reference_of(s)]
    earlier = {
        reuse.run_identity(spec, s, [])
        for s in p.stages
        if not lr_stress.reference_of(s)
        for spec in plan.stage_specs(s)
    }
    assert not earlier & {
        reuse.run_identity(spec, s, []) for s in stress for spec in plan.stage_specs(s)
    }  # all run


def test_spikes_divergences_differences_and_verdicts_of_a_series(tiny, tmp_path):
    root = str(tmp_path / "runs")
    write_stages(root)
    spikes = lr_stress.stage_spikes(root, tiny.stage("x4"))
    by_run = {(r["arm"], r["seed"]): r for r in spikes["runs"]}
    assert by_run[("b", 0)]["spikes"] == 1 and by_run[("b", 0)]["first_spike_step"] == 107
    assert by_run[("b", 0)]["spike_steps"] == [[107, 143]]
    assert [by_run[k]["spikes"] for k in (("a", 0), ("a", 1), ("b", 1))] == [0, 0, 0]
    assert spikes["arms"]["b"] == {
        "runs": 2,
        "ended": 2,
        "with_spikes": 1,
        "spikes": 1,
        "diverged": 0,
        "unstable": 1,
    }

    rows = {r["seed"]: r for r in lr_stress.stage_spikes(root, tiny.stage("x16"))["runs"] if r["arm"] == "b"}
    assert rows[0]["divergence"] == {
        "kind": "loss_spike",
        "step": 164,
        "value": pytest.approx(3.0 + 1.5 * 14 / 20),
    }
    assert rows[0]["spikes"] == 1 and rows[0]["first_spike_step"] == 152  # 0.1 nats after 2 updates
    assert rows[1]["divergence"]["kind"] == "non_finite_loss" and rows[1]["divergence"]["step"] == 90
    assert rows[1]["spikes"] == 0 and all(r["diverged"] for r in rows.values())

    result = lr_stress.series(tiny, root, "ref")
    one, four, sixteen = (p["arms"]["b"] for p in result["points"])
    assert [p["label"] for p in result["points"]] == ["1x", "4x", "16x"]
    assert one["difference"] == pytest.approx(0.011) and four["difference"] == pytest.approx(0.032)
    assert sixteen["difference"] is None and [m["outcome"] for m in sixteen["no_metric"]] == [
        "diverged @ step 164 (loss_spike)",
        "diverged @ step 90 (non_finite_loss)",
    ]
    growth = result["growth"]["b"]
    assert growth["4x"]["estimate"] == pytest.approx(0.021) and growth["16x"] is None
    assert growth["4x"]["se"] == pytest.approx(result["pooled_sd"] * math.sqrt(2))  # a complete 2 x 2 table
    assert result["verdicts"]["b"]["verdict"] == lr_stress.LESS_STABLE
    assert "every seed spiked or diverged at 16x" in result["verdicts"]["b"]["why"]


@pytest.mark.parametrize(
    "b_at_16x, verdict",
    [((0.06, 0.066), lr_stress.LESS_STABLE), ((0.061, 0.063), lr_stress.NOT_SHOWN)],
)
def test_the_growth_from_1x_to_the_top_point_decides_when_no_run_diverged(tiny, tmp_path, b_at_16x, verdict):
    """b - a at 16x is 0.063 on average, up 0.052 from 1x (2 SE: 0.006), or 0.012, up 0.001 (2 SE: 0.004)."""
    root = str(tmp_path / "runs")
    offsets = dict(
        OFFSETS, x16={"a": (0.0, 0.0) if verdict == lr_stress.LESS_STABLE else (0.05, 0.05), "b": b_at_16x}
    )
    write_stages(root, offsets=offsets, special={})
    result = lr_stress.series(tiny, root, "ref")
    top = result["growth"]["b"]["16x"]
    assert top["grew"] == (verdict == lr_stress.LESS_STABLE) and top["threshold"] == pytest.approx(
        2 * top["se"]
    )
    assert result["verdicts"]["b"]["verdict"] == verdict


def test_the_claims_table_leaves_out_a_check_stage_on_another_back_end(tmp_path, monkeypatch):
    """A stage that reruns a cell on another back end against another baseline (the study's
    backend_check) must not fill a missing cell of the claims' table."""
    monkeypatch.chdir(ROOT)
    check = stage_toml("check", {"b": "mxfp4_full"}, seeds=(1,), steps=STEPS, backend="emulate")
    path = tmp_path / "plan.toml"
    path.write_text(
        'name = "c"\n' + CLAIMS_FROM + _stage("ref", 1e-3) + check.replace('baseline = "a"', 'baseline = "b"')
    )
    the_plan = designs.load_plan(str(path))
    root = str(tmp_path / "runs")
    for arm, seed in (("a", 0), ("a", 1), ("b", 0)):
        write_run(os.path.join(root, "ref", arm, f"seed{seed}"), 0.0)
    write_run(os.path.join(root, "check", "b", "seed1"), 0.0)
    result = report.write_claims(the_plan, root, None)
    assert "b/seed1" not in result["cells"] and result["cells_pending"] == ["b/seed1"]


def test_rule_2_needs_the_arm_and_fp8_in_a_shared_seed_at_the_point():
    """study_plan.md: where A or fp8 has no primary metric at 16x in a shared seed, (2) cannot be computed
    (the model alone could link them through a third arm's seeds)."""
    cells = {("b@16x", "seed0@16x"): 4.1, ("c@16x", "seed0@16x"): 4.2, ("c@16x", "seed1@16x"): 4.2,
             ("a@16x", "seed1@16x"): 4.0}  # fmt: skip
    assert not lr_stress.paired_at(cells, "b", "a", "16x") and lr_stress.paired_at(cells, "c", "a", "16x")
    assert not lr_stress.paired_at(cells, "b", "a", "4x")  # no cell at that point


def test_the_report_writes_spikes_per_stage_and_says_not_run_for_a_stage_without_runs(tiny, tmp_path, capsys):
    """The stress stages ran, the reference did not: each stage's report lists its runs' spikes and
    divergences, the series reads "not run" at 1x, and the claims (at the study's LR) have no stage."""
    root, out = str(tmp_path / "runs"), tmp_path / "report"
    write_stages(root, stages=("x4", "x16"))
    assert study_cli.main(["report", "--plan", tiny.path, "--root", root, "--out", str(out)]) == 0
    assert "study: stage ref: not run (no runs yet)" in capsys.readouterr().out
    four = (out / "x4.md").read_text()
    assert "| b | 0 | finished | 1 | 107 |" in four and "| b | 2 / 2 | 1 | 1 | 0 |" in four
    assert json.loads((out / "x4.json").read_text())["spikes"]["arms"]["b"]["spikes"] == 1
    sixteen = (out / "x16.md").read_text()
    assert "| b | 0 | diverged @ step 164 (loss_spike) | 1 | 152 |" in sixteen
    assert "| b | 1 | diverged @ step 90 (non_finite_loss) | 0 | - |" in sixteen
    assert "| a | 2 / 2 | 0 | 0 | 0 |" in sixteen and "| b | 2 / 2 | 1 | 1 | 2 |" in sixteen
    series = (out / "lr_stress_ref.md").read_text()
    b_row = next(line for line in series.splitlines() if line.startswith("| b |"))
    assert b_row.startswith(
        "| b | not run | +0.0320 (s0 +0.0300, s1 +0.0340); 1 spike in 1 of 2 ended runs |"
    )
    assert "s0 diverged @ step 164 (loss_spike): no metric" in b_row and lr_stress.LESS_STABLE in b_row
    assert (out / "lr_stress_ref.png").stat().st_size > 10_000  # the series' figure, written beside it
    assert not (out / "claims.json").exists()


def _edit(tmp_path, old: str, new: str) -> str:
    assert old in TINY
    path = tmp_path / "bad.toml"
    path.write_text(TINY.replace(old, new, 1))
    return str(path)


@pytest.mark.parametrize(
    "old, new, message",
    [
        (
            "window = 20",
            "windw = 20",
            "count_spikes is {spike_nats = NATS, window = UPDATES}, not ['spike_nats', 'windw']",
        ),
        ("spike_nats = 0.1", "spike_nats = 0", "count_spikes wants spike_nats > 0 (nats) and window >= 1"),
        ("window = 20", "window = 2.5", "count_spikes wants spike_nats > 0 (nats) and window >= 1"),
        ('lr_reference = "ref"', 'lr_reference = "x16"', "lr_reference 'x16' must be an earlier stage"),
        ("peak_lr = 0.004", "peak_lr = 0.001", "lr_reference 'ref' must have this stage's arms"),
        (
            'b = "mxfp4_full"\n\n[[stages]]\nname = "x4"',
            'b = "mxfp4_fprop"\n\n[[stages]]\nname = "x4"',
            "this stage's arms",
        ),
        (  # x4's rule made 0.2 nats, x16's stays 0.1: one series counts by one rule
            "spike_nats = 0.1",
            "spike_nats = 0.2",
            "stage 'x16': the stages of lr_reference 'ref' share arms, seeds, count_spikes",
        ),
    ],
)
def test_bad_spike_and_reference_keys_are_one_line_errors(tmp_path, old, new, message):
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        designs.load_plan(_edit(tmp_path, old, new))
    assert "\n" not in str(info.value) and re.search("stage 'x(4|16)'", str(info.value))


def test_a_branch_stage_counts_no_spikes(tmp_path):
    branch = '\n[[stages]]\nname = "br"\ndesign = "branch"\nconfig = "configs/tiny_c4_h16.py"\n'
    branch += 'baseline = "a"\ntrunk_arm = "a"\nbranch_steps = [2]\nbranch_length = 2\nseeds = [0]\n'
    branch += 'warmup_steps = 1\npeak_lr = 1e-3\nbackend = "auto"\nrun_minutes = 0.01\n'
    branch += 'count_spikes = { spike_nats = 0.1, window = 20 }\n[stages.arms]\na = "fp8"\n'
    path = tmp_path / "branch.toml"
    path.write_text('name = "b"\n' + branch)
    with pytest.raises(ValueError, match=re.escape("unknown keys ['count_spikes']")):
        designs.load_plan(str(path))
