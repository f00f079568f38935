"""The branching design of a study stage (fp4jax/study/branching.py) with a fake trainer: the trunks run
first with their branch points kept, then every arm x branch step x seed from its trunk's checkpoint; a
second call runs nothing; the analysis pairs each branch with the baseline's from the same trunk and step;
bad branch stages are one-line errors. The real trainer's init_from is tested in tests/test_branch.py."""

import json
import math
import os
import re
import shutil
import statistics
import sys

import pytest
from long_lane import SLOW
from study_plans import CLAIMS_FROM

from fp4jax.study import __main__ as study_cli
from fp4jax.study import branch_analysis, branching, claims, designs, plan, progress, runner, schedule

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BRANCH_PLAN = (
    """
name = "tiny_branch"
"""
    + CLAIMS_FROM
    + """[[stages]]
name = "branches"
design = "branch"
config = "configs/tiny_c4_h16.py"
baseline = "a"
trunk_arm = "a"
branch_steps = [2, 4]
branch_length = 3
seeds = [0, 1]
warmup_steps = 1
peak_lr = 1e-3
backend = "auto"
run_minutes = 0.01
[stages.arms]
a = "fp8"
b = "mxfp4_full"
"""
)
# A trainer that finishes at once. The trunk (no init_from) writes a checkpoint with a manifest at each of
# keep_checkpoint_steps; a branch refuses (exit 2) unless its trunk has the checkpoint it starts from, and
# evaluates every step after it: 5 - ln(tokens) / 10, arm b 0.01 + 0.003 x seed nats higher (or, from
# FAKE_OFFSETS, {recipe: [offset, per_seed]}: offset + per_seed x seed nats higher).
FAKE = """
import json, math, os, sys
args = dict(a[9:].split("=", 1) for a in sys.argv if a.startswith("--config."))
workdir = sys.argv[sys.argv.index("--workdir") + 1]
steps, seed = int(args["steps"]), int(args["seed"])
if "init_from" in args:
    source = os.path.join(args["init_from"], "checkpoints", args["init_from_step"], "fp4jax_manifest.json")
    if not os.path.exists(source):
        sys.exit(2)
    first = int(args["init_from_step"])
else:
    first = 0
    for step in args["keep_checkpoint_steps"].strip("()").split(","):
        if step:
            os.makedirs(os.path.join(workdir, "checkpoints", step), exist_ok=True)
            open(os.path.join(workdir, "checkpoints", step, "fp4jax_manifest.json"), "w").write("{}")
offset, per_seed = json.loads(os.environ.get("FAKE_OFFSETS", '{"mxfp4_full": [0.01, 0.003]}')).get(
    args["recipe"], [0, 0])
evals = [[s, s, 1000 * s, 5 - math.log(1000 * s) / 10 + offset + per_seed * seed]
         for s in range(first + 1, steps + 1)]
with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    for s in range(first + 1, steps + 1):
        line = {"step": s, "tokens": 1000 * s, "loss": 9 - s / 7 - seed / 3, "grad_norm": 1 + s / 9}
        f.write(json.dumps(line) + "\\n")
with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump({"status": "not_reached", "steps": steps, "evals": evals}, f)
"""


@pytest.fixture
def branch_plan(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    monkeypatch.setattr(runner.RunSpec, "argv_real", runner.RunSpec.argv, raising=False)
    monkeypatch.setattr(runner, "POLL_S", 0.05)  # the fake trainer ends at once: wait less between polls
    monkeypatch.setattr(
        runner.RunSpec, "argv", lambda self, root, o: [sys.executable, "-c", FAKE, *self.argv_real(root, o)]
    )
    path = tmp_path / "branch.toml"
    path.write_text(BRANCH_PLAN)
    return designs.load_plan(str(path))


def _command(root, label):
    with open(os.path.join(root, "branches", *label.split("/"), "ladder_run.json")) as f:
        return json.load(f)["command"]


def test_trunks_run_first_then_every_branch_and_a_second_call_runs_nothing(branch_plan, tmp_path):
    root = str(tmp_path / "runs")
    lines = []
    done = schedule.run_plan(branch_plan, root, budget_minutes=5, log=lines.append)
    started = [line.split("start branches/")[1] for line in lines if "start branches/" in line]
    trunks = ["trunk/seed0", "trunk/seed1"]
    # Per seed, per arm, both branch points in turn (an arm's compiled step serves both).
    branches = [f"{arm}/at{at}/seed{seed}" for seed in (0, 1) for arm in "ab" for at in (2, 4)]
    assert started == trunks + branches and sorted(done) == sorted(started)
    assert all(s["status"] == "not_reached" for s in done.values())  # no branch was refused its trunk

    trunk = _command(root, "trunk/seed1")
    assert "--config.recipe=fp8" in trunk and "--config.keep_checkpoint_steps=(2,4,)" in trunk
    assert "--config.steps=4" in trunk and "--config.seed=1" in trunk
    branch = _command(root, "b/at4/seed1")
    assert branch[-2:] == [f"--config.init_from={root}/branches/trunk/seed1", "--config.init_from_step=4"]
    assert "--config.recipe=mxfp4_full" in branch and branch.index("--config.steps=7") > branch.index(
        "--config.steps=4"
    )  # the branch's horizon comes after the stage's: the last one wins
    assert progress.stage_complete(root, branch_plan.stages[0])

    again = []
    assert schedule.run_plan(branch_plan, root, budget_minutes=5, log=again.append) == {}
    assert sum("not rerun" in line for line in again) == 10 and not any("start" in line for line in again)


def test_two_slots_start_branches_of_different_arms_together(branch_plan, tmp_path):
    """With two runs at once, an arm's second branch waits for its first (it then reads the compiled step
    from the cache) while another arm's branch takes the free slot; one slot keeps the plain order."""
    root = str(tmp_path / "runs")
    lines = []
    schedule.run_plan(
        branch_plan, root, budget_minutes=5, parallel=2, gpus=["0", "0"], seeds=[0], log=lines.append
    )
    started = [
        line.split("start branches/")[1].split(" on GPU")[0] for line in lines if "start branches/" in line
    ]
    assert started[0] == "trunk/seed0" and sorted(started[1:]) == sorted(
        f"{arm}/at{at}/seed0" for arm in "ab" for at in (2, 4)
    )
    assert started[1:3] == ["a/at2/seed0", "b/at2/seed0"]  # not a/at2 beside a/at4


def test_the_analysis_pairs_each_branch_with_the_baselines_from_the_same_trunk(branch_plan, tmp_path):
    root = str(tmp_path / "runs")
    schedule.run_plan(branch_plan, root, budget_minutes=5, log=lambda line: None)
    result = branch_analysis.analyze(plan.stage_root(root, branch_plan.stages[0]), branch_plan.stages[0])
    early, late = result["points"]
    assert early["at"] == 2 and [e["tokens"] for e in early["evals"]] == [3000, 4000, 5000]
    assert [e["tokens"] for e in late["evals"]] == [5000, 6000, 7000] and not late["missing"]
    row = late["evals"][-1]["arms"]["b"]
    diffs = [0.01, 0.013]
    assert row["difference"] == pytest.approx({"0": diffs[0], "1": diffs[1]})
    assert row["loss"]["1"] == pytest.approx(5 - math.log(7000) / 10 + 0.013)
    c = row["contrast"]  # two arms: the paired t interval of the per-trunk differences
    assert c["estimate"] == pytest.approx(statistics.fmean(diffs)) and c["df"] == 1
    assert c["se"] == pytest.approx(statistics.stdev(diffs) / math.sqrt(2))
    for key in ("estimate", "se", "df", "ci_low", "ci_high"):  # with two arms the two models coincide
        assert row["paired"][key] == pytest.approx(c[key])
    baseline = late["evals"][0]["arms"]["a"]
    assert baseline["mean_difference"] == 0 and baseline["contrast"] is None and baseline["paired"] is None
    text = branch_analysis.to_markdown(result)
    assert "Branched at step 4:" in text and "| b | +0.0115 |" in text

    out = tmp_path / "report"
    assert study_cli.main(["report", "--plan", branch_plan.path, "--root", root, "--out", str(out)]) == 0
    assert (out / "branches.md").read_text() == text
    assert (out / "branches.png").stat().st_size > 0  # the differences against tokens, per branch step
    assert json.loads((out / "branches.json").read_text())["points"][1]["at"] == 4


# The ten arms of the pre-registered contrasts with planted effects (nats above fp8, and a small
# per-trunk term so the model has a residual): Wgrad's MXFP4 costs the most, no stabiliser helps, H16
# restores full to within 0.001 nats of fprop (about 1 % tokens on the fake's curve).
LADDER_OFFSETS = {
    "fp8_mlperf": [0, 0],
    "mxfp4_fprop": [0.004, 0.0002],
    "mxfp4_fprop_dgrad": [0.006, -0.0001],
    "mxfp4_full": [0.030, 0.0001],
    "mxfp4_full_sr": [0.031, -0.0002],
    "mxfp4_full_sr_prescale": [0.0305, 0.0001],
    "mxfp4_full_rht": [0.0302, 0],
    "mxfp4_full_h16": [0.005, 0.0001],
    "mxfp4_full_h32": [0.0055, -0.0001],
    "mxfp4_full_h16_wgrad_only": [0.012, 0.0002],
}
LADDER_ARMS = dict(
    zip(
        ("fp8", "fprop", "fprop_dgrad", "full", "full_sr", "full_sr_prescale", "full_rht", "full_h16",
         "full_h32", "h16_wgrad_only"),
        LADDER_OFFSETS,
        strict=True,
    )
)  # fmt: skip


@SLOW  # 66 trainer subprocesses; the default lane tests the branch analysis with the same fake trainer
def test_the_report_judges_the_claims_per_branch_step_with_trunks_as_blocks(
    branch_plan, tmp_path, monkeypatch
):
    """A branch stage with every contrast's arms gets the pre-registered analysis per branch step
    (claims.analyze on its branches, the trunk as the block): planted effects give the planted verdicts;
    with one trunk the claims are not yet estimable; a stage without those arms gets none."""
    monkeypatch.setenv("FAKE_OFFSETS", json.dumps(LADDER_OFFSETS))
    text = BRANCH_PLAN.replace('baseline = "a"', 'baseline = "fp8"').replace(
        'trunk_arm = "a"', 'trunk_arm = "fp8"'
    )
    text = text.replace("seeds = [0, 1]", "seeds = [0, 1, 2]").replace(
        "branch_length = 3", "branch_length = 6"
    )
    text = text.split("[stages.arms]")[0]
    path = tmp_path / "ladder.toml"
    path.write_text(text + "[stages.arms]\n" + "".join(f'{a} = "{r}"\n' for a, r in LADDER_ARMS.items()))
    ladder = designs.load_plan(str(path))
    root, out = str(tmp_path / "runs"), tmp_path / "report"
    report = ["report", "--plan", ladder.path, "--root", root, "--out", str(out)]
    schedule.run_plan(ladder, root, budget_minutes=5, seeds=[0], log=lambda line: None)
    assert study_cli.main(report) == 0
    one = json.loads((out / "branches_claims_at4.json").read_text())
    # (b) is judged on divergence first: no branch diverged, so it is not testable as stated at any df.
    verdicts = {claim: v["verdict"] for claim, v in one["verdicts"].items()}
    assert one["df"] == 0 and verdicts.pop("b") == "not testable as stated"
    assert set(verdicts.values()) == {"not yet estimable"}
    assert one["interim"] and "fp8/seed1" in one["cells_pending"]  # trunks 1 and 2 are planned

    schedule.run_plan(ladder, root, budget_minutes=5, log=lambda line: None)
    assert study_cli.main(report) == 0
    for at, tokens in ((2, [4000, 5000, 6000, 7000, 8000]), (4, [6000, 7000, 8000, 9000, 10000])):
        result = json.loads((out / f"branches_claims_at{at}.json").read_text())
        assert result["metric_tokens"] == tokens  # the branches' last 5 evaluations
        assert result["df"] == 18 and not result["interim"]  # 10 arms x 3 trunks
        c1 = next(r for r in result["contrasts"] if r["name"] == "C1")
        assert c1["estimate"] == pytest.approx(0.024, abs=1e-3) and c1["reject"]
        assert {k: v["verdict"] for k, v in result["verdicts"].items()} == {
            "a": "supported",
            "b": "not testable as stated",  # no branch diverged (study_plan.md, verdicts restated)
            "c": "supported",
        }
        assert (out / f"branches_claims_at{at}.png").exists()
        assert "Branched at step" in (out / f"branches_claims_at{at}.md").read_text()

    assert (
        study_cli.main(
            [
                "report",
                "--plan",
                branch_plan.path,
                "--root",
                str(tmp_path / "r2"),
                "--out",
                str(tmp_path / "o2"),
            ]
        )
        == 0
    )
    assert not list((tmp_path / "o2").glob("*claims_at*"))


def test_branches_wait_for_their_trunks_checkpoint(branch_plan, tmp_path):
    """A trunk that saved only its early branch point: the late branches wait, the early ones run."""
    root = str(tmp_path / "runs")
    stage = branch_plan.stages[0]
    specs = plan.stage_specs(stage)
    sroot = plan.stage_root(root, stage)
    for seed in (0, 1):
        step_dir = os.path.join(sroot, "trunk", f"seed{seed}", "checkpoints", "2")
        os.makedirs(step_dir)
        open(os.path.join(step_dir, "fp4jax_manifest.json"), "w").write("{}")
    lines = []
    trunks, regenerations, ready = branching.phases(specs, sroot, ["b"], lines.append)
    assert [s.label for s in trunks] == ["trunk/seed0", "trunk/seed1"] and regenerations == []
    assert [s.label for s in ready] == ["b/at2/seed0", "b/at2/seed1"]
    assert lines == [f"study: b/at4/seed{k} waits: its trunk has no checkpoint at step 4 yet" for k in (0, 1)]


def _lose_checkpoints_and_late_branches(root):
    """What a fresh machine sees of a committed stage: no trunk checkpoints; here the late b branches are
    also not done yet."""
    sroot = os.path.join(root, "branches")
    for seed in (0, 1):
        shutil.rmtree(os.path.join(sroot, "trunk", f"seed{seed}", "checkpoints"))
        shutil.rmtree(os.path.join(sroot, "b", "at4", f"seed{seed}"))
    return sroot


def test_a_finished_trunk_without_its_checkpoints_is_trained_again_and_branched_from(branch_plan, tmp_path):
    root = str(tmp_path / "runs")
    schedule.run_plan(branch_plan, root, budget_minutes=5, log=lambda line: None)
    sroot = _lose_checkpoints_and_late_branches(root)
    lines = []
    done = schedule.run_plan(branch_plan, root, budget_minutes=5, log=lines.append)
    started = [line.split("start branches/")[1] for line in lines if "start branches/" in line]
    assert started == ["trunk/seed0/regenerated", "trunk/seed1/regenerated", "b/at4/seed0", "b/at4/seed1"]
    assert sorted(done) == sorted(started)
    regen = _command(root, "trunk/seed1/regenerated")
    assert regen[regen.index("--workdir") + 1] == os.path.join(sroot, "trunk", "seed1", "regenerated")
    assert regen[-1] == "--config.steps=4" and "--config.keep_checkpoint_steps=(2,4,)" in regen
    branch = _command(root, "b/at4/seed1")
    assert branch[-2:] == [f"--config.init_from={sroot}/trunk/seed1/regenerated", "--config.init_from_step=4"]
    with open(os.path.join(sroot, "trunk", "seed1", "regenerated", "identity.json")) as f:
        assert json.load(f)["4"]["first_difference"] is None
    # The copy is scratch (the analysis reads the branches), and a third call runs nothing.
    late = branch_analysis.analyze(sroot, branch_plan.stages[0])["points"][1]
    assert late["at"] == 4 and not late["missing"]
    again = []
    assert schedule.run_plan(branch_plan, root, budget_minutes=5, log=again.append) == {}


def test_a_trunk_that_does_not_repeat_leaves_its_branches_waiting(branch_plan, tmp_path):
    root = str(tmp_path / "runs")
    schedule.run_plan(branch_plan, root, budget_minutes=5, log=lambda line: None)
    sroot = _lose_checkpoints_and_late_branches(root)
    metrics = os.path.join(sroot, "trunk", "seed0", "metrics.jsonl")
    with open(metrics) as f:
        records = [json.loads(line) for line in f]
    records[2]["grad_norm"] += 1e-7  # the committed trunk's update 3 is not what the copy computes
    with open(metrics, "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in records)
    lines = []
    done = schedule.run_plan(branch_plan, root, budget_minutes=5, log=lines.append)
    assert sorted(done) == ["b/at4/seed1", "trunk/seed0/regenerated", "trunk/seed1/regenerated"]
    assert any("trunk/seed0/regenerated differs from its trunk from step 3" in line for line in lines)
    assert "study: b/at4/seed0 waits: its trunk has no checkpoint at step 4 yet" in lines
    again = []
    assert schedule.run_plan(branch_plan, root, budget_minutes=5, log=again.append) == {}  # not retried


def test_a_call_for_one_seed_trains_only_that_trunk_again(branch_plan, tmp_path):
    root = str(tmp_path / "runs")
    schedule.run_plan(branch_plan, root, budget_minutes=5, log=lambda line: None)
    sroot = _lose_checkpoints_and_late_branches(root)
    done = schedule.run_plan(branch_plan, root, budget_minutes=5, seeds=[1], log=lambda line: None)
    assert sorted(done) == ["b/at4/seed1", "trunk/seed1/regenerated"]
    assert not os.path.exists(os.path.join(sroot, "trunk", "seed0", "regenerated"))
    with pytest.raises(ValueError, match="--seed 7: not a seed of these stages; use 0, 1"):
        schedule.run_plan(branch_plan, root, budget_minutes=5, seeds=[7], log=lambda line: None)


def test_progress_counts_what_is_left_and_the_report_writes_it(branch_plan, tmp_path, capsys):
    root = str(tmp_path / "runs")
    (before,) = progress.progress(branch_plan, root)
    assert (before["runs"], before["finished"], before["left"], before["waits_for"]) == (10, 0, 10, None)
    # run_minutes 0.01 a branch of 3 updates; a trunk of 4 updates counts 4 / 3 of it.
    assert before["gpu_minutes_left"] == round(8 * 0.01 + 2 * 0.01 * 4 / 3, 1)
    run = ["run", "--plan", branch_plan.path, "--root", root, "--budget-minutes", "5", "--seed", "0"]
    assert study_cli.main(run) == 0
    assert "| branches | branch | 10 | 5 | 0 | 5 |" in capsys.readouterr().out  # a call ends with it
    (half,) = progress.progress(branch_plan, root)
    assert (half["finished"], half["left"], half["diverged_or_failed"]) == (5, 5, 0)
    out = tmp_path / "report"
    assert study_cli.main(["report", "--plan", branch_plan.path, "--root", root, "--out", str(out)]) == 0
    assert "| branches | branch | 10 | 5 | 0 | 5 |" in (out / "progress.md").read_text()
    assert json.loads((out / "progress.json").read_text())["stages"][0]["left"] == 5


@pytest.mark.parametrize(
    "edit,message",
    [
        (("warmup_steps = 1", "warmup_steps = 1\nsteps = 9"), "a branch stage sets no steps"),
        (("branch_steps = [2, 4]", "branch_steps = [4, 2]"), "branch_steps is an ascending list"),
        (("branch_length = 3", "branch_length = 0"), "branch_length (updates per branch) is an integer"),
        (('trunk_arm = "a"', 'trunk_arm = "c"'), "trunk_arm is one of the arms"),
        (('trunk_arm = "a"\n', ""), "missing keys ['trunk_arm']"),
        (('design = "branch"', 'design = "scratch_paired"\nsteps = 4'), "unknown keys ['branch_length'"),
        (
            ("seeds = [0, 1]", "seeds = [0, 1]\narm_branch_steps = { c = [4] }"),
            "names 'c', not one of the arms",
        ),
        (("seeds = [0, 1]", "seeds = [0, 1]\narm_branch_steps = { a = [4] }"), "other than the baseline"),
        (("seeds = [0, 1]", "seeds = [0, 1]\narm_branch_steps = { b = [3] }"), "subset of branch_steps"),
        (("seeds = [0, 1]", "seeds = [0, 1]\narm_branch_steps = { b = [] }"), "subset of branch_steps"),
    ],
)
def test_bad_branch_stages_are_one_line_errors(tmp_path, edit, message):
    path = tmp_path / "bad.toml"
    path.write_text(BRANCH_PLAN.replace(*edit))
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        designs.load_plan(str(path))
    assert "\n" not in str(info.value)


def test_a_branch_expects_its_own_updates_only(branch_plan, tmp_path):
    """Before any run is measured: a branch's time is run_minutes whatever its trunk step, the trunk's
    scales with its updates, and a branch resumed part-way has the rest of its own updates left."""
    stage = branch_plan.stages[0]
    specs = {s.label: s for s in plan.stage_specs(stage)}
    fresh = str(tmp_path / "fresh")
    assert progress.expected_minutes(specs["trunk/seed0"], fresh, stage, {}) == pytest.approx(0.01 * 4 / 3)
    assert progress.expected_minutes(specs["b/at4/seed0"], fresh, stage, {}) == pytest.approx(0.01)
    resumed = tmp_path / "resumed"
    (resumed / "checkpoints" / "5").mkdir(parents=True)
    left = progress.expected_minutes(specs["b/at4/seed0"], str(resumed), stage, {})
    assert left == pytest.approx(0.01 * 2 / 3 + progress.RESUME_OVERHEAD_MINUTES)


def test_the_example_plan_loads_and_its_trunk_keeps_the_branch_points(monkeypatch):
    monkeypatch.chdir(ROOT)
    stage = designs.load_plan(os.path.join(ROOT, "fp4jax", "study", "plans", "branch125m.toml")).stages[0]
    specs = plan.stage_specs(stage)
    assert (stage.steps, stage.options.branch_steps, len(specs)) == (600, (250, 600), 3 + 5 * 2 * 3)
    trunk = runner.load_config(stage.config, specs[0].config_args([]))
    assert trunk.keep_checkpoint_steps == (250, 600) and trunk.recipe == "fp8_mlperf" and trunk.steps == 600
    late = next(s for s in specs if s.label == "full_h16/at600/seed2")
    branch = runner.load_config(stage.config, late.config_args([]))
    assert (branch.steps, branch.recipe, branch.seed) == (850, "mxfp4_full_h16", 2)


def test_an_arm_branched_at_some_points_only(tmp_path):
    """arm_branch_steps: `b` branches from step 4 only; every other arm from every branch step."""
    path = tmp_path / "late.toml"
    path.write_text(BRANCH_PLAN.replace("seeds = [0, 1]", "seeds = [0, 1]\narm_branch_steps = { b = [4] }"))
    stage = designs.load_plan(str(path)).stages[0]
    labels = [s.label for s in plan.stage_specs(stage)]
    assert labels == [
        "trunk/seed0", "trunk/seed1",
        "a/at2/seed0", "a/at4/seed0", "b/at4/seed0", "a/at2/seed1", "a/at4/seed1", "b/at4/seed1",
    ]  # fmt: skip
    assert branching.steps_of(stage, "b") == (4,) and branching.steps_of(stage, "a") == (2, 4)


def test_the_decomposition_arms_branch_from_the_late_point_only(monkeypatch):
    """proxy125m's stage `branching` (study_plan.md, amendments "H16's channel" and "the newer recipes"):
    ten arms at 250 and 600, the three decomposition arms and the seven newer recipes at 600 only, each
    with the preset its amendment names."""
    monkeypatch.chdir(ROOT)
    stage = designs.load_plan(os.path.join(ROOT, "fp4jax", "study", "plans", "proxy125m.toml")).stage(
        "branching"
    )
    specs = plan.stage_specs(stage)
    assert len(specs) == 3 + 10 * 2 * 3 + (3 + 7) * 3
    late = {
        "wgrad": "mxfp4_wgrad",
        "h16_fprop": "mxfp4_full_h16_fprop",
        "h16_fprop_dgrad": "mxfp4_full_h16_fprop_dgrad",
        "full_oas": "mxfp4_full_oas",
        "tseng": "mxfp4_tseng",
        "nvidia": "mxfp4_nvidia",
        "nvfp4": "nvfp4_full",
        "nvfp4_nvidia": "nvfp4_nvidia",
        "nvfp4_4over6": "nvfp4_4over6",
        "nvfp4_quartet2": "nvfp4_quartet2",
    }
    assert {arm: stage.arms[arm] for arm in late} == late
    assert all(branching.steps_of(stage, arm) == (600,) for arm in late)
    assert not [s for s in specs if schedule.arm_of(s) in late and s.at != 600]


def test_the_350m_confirmation_plan_loads_and_plans_every_claims_contrast_but_c4(monkeypatch):
    """fp4jax/study/plans/confirm350m.toml (study_plan.md, amendment "the 350M confirmation"): 3 trunks to
    600 updates, 8 arms x 3 trunks branches of 250, the 350M model at the pre-registered LR; its arms
    make every contrast that a claim's verdict uses (C1-C3, C5-C7, C10), and C4 is outside its design."""
    monkeypatch.chdir(ROOT)
    confirmation = designs.load_plan(os.path.join(ROOT, "fp4jax", "study", "plans", "confirm350m.toml"))
    stage = confirmation.stages[0]
    H = claims.Hypotheses.from_plan(confirmation)  # the 125M plan's claims (claims_from)
    specs = plan.stage_specs(stage)
    assert (stage.steps, stage.options.branch_steps, len(specs)) == (600, (600,), 3 + 8 * 3)
    trunk = runner.load_config(stage.config, specs[0].config_args([]))
    assert (trunk.model.size, trunk.recipe, trunk.keep_checkpoint_steps) == ("350m", "fp8_mlperf", (600,))
    assert trunk.optimizer.peak_lr == pytest.approx(1.5e-3 * 768 / 1024)
    assert trunk.xla_gpu_deterministic_ops and trunk.model.attention == "pallas"
    planned = {name for name, w in H.contrasts.items() if set(w) <= set(stage.arms)}
    assert planned == set(H.contrasts) - {"C4"}
