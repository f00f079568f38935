"""The study's plan file and its budgeted, resumable runner, with a fake trainer (a script that writes a
summary, or waits for SIGTERM and writes a "preempted" one): a second call runs nothing, a run the budget
stops is resumed by the next call, the gate's arithmetic, and one-line errors for bad plans."""

import dataclasses
import json
import math
import os
import re
import sys

import pytest
from study_plans import stage_toml

from fp4jax import logs
from fp4jax.study import designs, plan, progress, report, reuse, runner, runs, schedule
from fp4jax.study.gate import gate_result

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAN = os.path.join(ROOT, "fp4jax", "study", "plans", "proxy125m.toml")


def _stage(name: str, arms: dict[str, str], *, seeds=(0, 1), backend: str = "auto", extra: str = "") -> str:
    """One [[stages]] block of the tiny plans (the gate's design, config, horizon and LR)."""
    return stage_toml(name, arms, seeds=seeds, backend=backend, extra=extra)


TINY_PLAN = (
    '\nname = "tiny"'
    + _stage("gate", {"a": "fp8", "b": "mxfp4_full"})
    + """[stages.gate]
arm = "b"
against = "a"
last_evals = 2
smallest_overhead = 0.05
sigmas = 2.0
"""
)
# A trainer that finishes at once: evals falling as 5 - ln(tokens) / 10, arm b 0.01 nats higher.
FINISHER = """
import json, math, os, sys
workdir = sys.argv[sys.argv.index("--workdir") + 1]
b = any(a == "--config.recipe=mxfp4_full" for a in sys.argv)
evals = [[s, s, 1000 * s, 5 - math.log(1000 * s) / 10 + (0.01 if b else 0)] for s in (1, 2, 3, 4)]
with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump({"status": "not_reached", "steps": 4, "evals": evals}, f)
"""
# A trainer that runs until SIGTERM, then saves "checkpoint 2" and a preempted summary.
WAITER = """
import json, os, signal, sys, time
workdir = sys.argv[sys.argv.index("--workdir") + 1]
def stop(*_):
    os.makedirs(os.path.join(workdir, "checkpoints", "2"), exist_ok=True)
    with open(os.path.join(workdir, "summary.json"), "w") as f:
        json.dump({"status": "preempted", "steps": 2}, f)
    sys.exit(0)
signal.signal(signal.SIGTERM, stop)
time.sleep(120)
"""


@pytest.fixture
def tiny_plan(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = tmp_path / "tiny.toml"
    path.write_text(TINY_PLAN)
    return designs.load_plan(str(path))


def _fake(monkeypatch, script):
    monkeypatch.setattr(
        runner.RunSpec, "argv", lambda self, root, o: [sys.executable, "-c", script, *self.argv_real(root, o)]
    )


@pytest.fixture(autouse=True)
def keep_real_argv(monkeypatch):
    monkeypatch.setattr(runner.RunSpec, "argv_real", runner.RunSpec.argv, raising=False)
    # The fake trainers end in milliseconds: a shorter wait between polls changes no decision (the
    # budget's and the kill's clocks are their own), only how long the test waits for them.
    monkeypatch.setattr(runner, "POLL_S", 0.05)


def test_the_committed_plan_loads_with_the_gate_first():
    p = designs.load_plan(PLAN)
    gate = p.stages[0]
    assert gate.name == "calibration" and gate.arms == {"fp8": "fp8_mlperf", "full": "mxfp4_full"}
    assert (gate.seeds, gate.steps, gate.warmup_steps, gate.backend) == ((0, 1, 2), 1000, 100, "auto")
    assert p.stages[1].requires == ("calibration",) and len(p.stages[1].arms) == 10
    labels = [s.label for s in plan.stage_specs(gate)]
    assert labels == ["fp8/seed0", "full/seed0", "fp8/seed1", "full/seed1", "fp8/seed2", "full/seed2"]


def test_the_committed_125m_plan_keeps_its_runs_fp8_divide_and_the_newer_plans_take_ieee():
    """The 125M study's runs were trained with the back end's divide for FP8 scales: every stage pins it,
    so a regenerated trunk repeats the committed one; plans with no committed runs take the default."""
    for stage in designs.load_plan(PLAN).stages:
        assert stage.overrides.get("fp8_divide") == "xla", stage.name
        assert "--config.fp8_divide=xla" in plan.common_overrides(stage)
    for name in ("scale350m.toml", "scale1b.toml", "confirm350m.toml"):
        for stage in designs.load_plan(os.path.join(os.path.dirname(PLAN), name)).stages:
            assert "fp8_divide" not in stage.overrides, (name, stage.name)


def test_a_second_call_runs_nothing_and_the_gate_reads_the_runs(tiny_plan, tmp_path, monkeypatch):
    _fake(monkeypatch, FINISHER)
    root = str(tmp_path / "runs")
    done = schedule.run_plan(tiny_plan, root, budget_minutes=5, log=lambda line: None)
    assert sorted(done) == ["a/seed0", "a/seed1", "b/seed0", "b/seed1"]
    lines = []
    assert schedule.run_plan(tiny_plan, root, budget_minutes=5, log=lines.append) == {}
    assert sum("not rerun" in line for line in lines) == 4 and not any("start" in line for line in lines)
    gate = gate_result(root, tiny_plan.stage("gate"))
    assert gate["complete"] and gate["mean_difference"] == pytest.approx(0.01) and gate["paired_sd"] < 1e-12
    assert gate["slope"] == pytest.approx(0.1) and gate["passed"]
    assert gate["paired_sd_max"] == pytest.approx(0.1 * math.log(1.05) * math.sqrt(2) / 2)


def test_the_gates_interval_is_the_t_interval_of_the_paired_differences(tiny_plan, tmp_path):
    """Two seeds whose differences are 0.01 and 0.03 nats: the interval is mean +- t(0.975, 1 df) x sd /
    sqrt(2), with the quantile of 1 df in closed form (the Cauchy's: tan(0.475 pi) = 12.7062...)."""
    stage = tiny_plan.stage("gate")
    offsets = {("a", 0): 0.0, ("a", 1): 0.0, ("b", 0): 0.01, ("b", 1): 0.03}
    for spec in plan.stage_specs(stage):
        directory = spec.directory(plan.stage_root(str(tmp_path), stage))
        os.makedirs(directory)
        extra = offsets[(spec.rung.name, spec.seed)]
        evals = [[s, s, 1000 * s, 5 - math.log(1000 * s) / 10 + extra] for s in (1, 2, 3, 4)]
        runs.write_json(runs.summary_path(directory), {"status": "not_reached", "steps": 4, "evals": evals})
    gate = gate_result(str(tmp_path), stage)
    sd = 0.02 / math.sqrt(2)
    half = math.tan(0.475 * math.pi) * sd / math.sqrt(2)
    assert gate["mean_difference"] == pytest.approx(0.02) and gate["paired_sd"] == pytest.approx(sd)
    assert gate["ci95"] == pytest.approx([0.02 - half, 0.02 + half], rel=1e-9)
    assert gate["token_ratio_ci95"] == pytest.approx([math.exp(x / 0.1) for x in gate["ci95"]])
    assert not gate["passed"]  # sd 0.0141 > the 0.0035 nats that 5 % tokens allow at 2 seeds


def test_the_budget_stops_a_run_with_a_checkpoint_and_the_next_call_resumes_it(
    tiny_plan, tmp_path, monkeypatch
):
    monkeypatch.setattr(schedule, "STOP_MARGIN_S", 0)
    monkeypatch.setattr(schedule, "MIN_START_MINUTES", 0.0)
    _fake(monkeypatch, WAITER)
    root = str(tmp_path / "runs")
    lines = []
    done = schedule.run_plan(tiny_plan, root, budget_minutes=0.05, log=lines.append)  # 3 s
    assert [s["status"] for s in done.values()] == ["preempted"], lines
    first = os.path.join(root, "gate", "a", "seed0")
    assert reuse.steps_done(first) == 2 and not runs.is_finished(first)
    assert any("left for the next call" in line for line in lines), lines
    _fake(monkeypatch, FINISHER)
    done = schedule.run_plan(tiny_plan, root, budget_minutes=5, log=lambda line: None)
    assert "a/seed0" in done and runs.is_finished(first)
    record = json.loads(open(os.path.join(first, "ladder_run.json")).read())
    assert record["attempts"] == 2 and [h["status"] for h in record["history"]] == [
        "preempted",
        "not_reached",
    ]


def test_slot_sharing_counts_the_runs_that_may_share_a_device():
    assert runner.slot_sharing([["0"], ["0"], ["0"]]) == [3, 3, 3]
    assert runner.slot_sharing([["0"], ["1"]]) == [1, 1]
    assert runner.slot_sharing([["0", "1"], ["1"], ["2"]]) == [2, 2, 1]
    assert runner.slot_sharing([[], []]) == [2, 2]  # not pinned (CPU): every run shares the machine


def _finished_run(root, stage, arm, seed, walls_by_sharing):
    directory = os.path.join(root, stage, arm, f"seed{seed}")
    os.makedirs(directory)
    runs.write_json(os.path.join(directory, "summary.json"), {"status": "not_reached", "steps": 4})
    history = [{"wall_time_s": w, "runs_per_gpu": n, "status": "x"} for n, w in walls_by_sharing]
    record = {"attempts": len(history), "history": history}
    runs.write_json(os.path.join(directory, "ladder_run.json"), record)


def test_measured_wall_times_are_used_only_under_the_same_gpu_sharing(tiny_plan, tmp_path):
    root = str(tmp_path)
    _finished_run(root, "gate", "a", 0, [(1, 60.0), (1, 30.0)])  # two attempts alone: 1.5 min
    _finished_run(root, "gate", "a", 1, [(3, 300.0)])  # three to a GPU
    _finished_run(root, "gate", "b", 0, [(None, 120.0)])  # recorded before the setting was
    gate = tiny_plan.stage("gate")
    assert progress.measured_minutes(root, gate, 1) == {"a": pytest.approx(1.5)}
    assert progress.measured_minutes(root, gate, 3) == {"a": pytest.approx(5.0)}
    assert progress.measured_minutes(root, gate, 2) == {}
    # An arm without a comparable measurement is expected at the plan's run_minutes.
    spec_b = next(s for s in plan.stage_specs(gate) if s.rung.name == "b")
    fresh = str(tmp_path / "fresh")
    measured = progress.measured_minutes(root, gate, 1)
    assert progress.expected_minutes(spec_b, fresh, gate, measured) == gate.run_minutes


def test_runs_share_one_compilation_cache_under_the_root_unless_the_caller_names_one(tiny_plan, monkeypatch):
    gate = tiny_plan.stage("gate")
    monkeypatch.delenv(schedule.COMPILE_CACHE_ENV, raising=False)
    expected = os.path.join(ROOT, "runs", "x", ".jax_cache")
    assert schedule.run_env(gate, "runs/x", print)[schedule.COMPILE_CACHE_ENV] == expected
    monkeypatch.setenv(schedule.COMPILE_CACHE_ENV, "/elsewhere")
    assert schedule.run_env(gate, "runs/x", print)[schedule.COMPILE_CACHE_ENV] == "/elsewhere"


@pytest.mark.parametrize(
    "kind, gpus, sharing",
    [
        (None, None, 2),  # a CPU machine: two unpinned runs share it
        ("cuda", ["0", "0"], 2),  # both slots on GPU 0
        ("cuda", ["0", "1"], 1),  # a GPU each
    ],
    ids=["cpu", "one_gpu_twice", "two_gpus"],
)
def test_an_attempt_records_how_many_runs_shared_its_gpu(
    tiny_plan, tmp_path, monkeypatch, kind, gpus, sharing
):
    """Two runs at a time (--parallel 2) on the machine the test says (runner.accelerator_kind), not on the
    one it runs on: the fake trainers use no device."""
    _fake(monkeypatch, FINISHER)
    monkeypatch.setattr(runner, "accelerator_kind", lambda: kind)
    root = str(tmp_path / "runs")
    schedule.run_plan(tiny_plan, root, budget_minutes=5, parallel=2, gpus=gpus, log=lambda line: None)
    record = runs.read_json(os.path.join(root, "gate", "a", "seed0", "ladder_run.json"))
    assert [h["runs_per_gpu"] for h in record["history"]] == [sharing]


# FINISHER, but arm b's process dies as a GPU out of memory does: a traceback on stderr, exit code 1.
OUT_OF_MEMORY_B = (
    """
import sys
if "--config.recipe=mxfp4_full" in sys.argv:
    print("Traceback (most recent call last):", file=sys.stderr)
    print("jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate 30.19GiB",
          file=sys.stderr)
    sys.exit(1)
"""
    + FINISHER
)


def test_a_failed_run_names_its_error_blocks_later_stages_and_reruns_with_retry_failed(tmp_path, monkeypatch):
    """A crash is the harness's failure, not a result: its summary names the error line (and, for a GPU
    out of memory with runs sharing the GPU, the fix), a stage requiring its stage waits, and
    --retry-failed runs it again; the failure it replaces is kept in summary.failed.json."""
    monkeypatch.chdir(ROOT)
    path = tmp_path / "plan.toml"
    path.write_text(
        TINY_PLAN + _stage("after", {"a": "mxfp4_full_h16"}, seeds=(0,), extra='requires = ["gate"]\n')
    )
    the_plan = designs.load_plan(str(path))
    monkeypatch.setattr(runner, "accelerator_kind", lambda: "cuda")
    root = str(tmp_path / "runs")
    _fake(monkeypatch, OUT_OF_MEMORY_B)
    lines = []
    schedule.run_plan(the_plan, root, budget_minutes=5, parallel=2, gpus=["0", "0"], log=lines.append)
    failed = runs.read_json(os.path.join(root, "gate", "b", "seed0", "summary.json"))
    assert failed["status"] == "failed"
    assert failed["failure"] == (
        "exit code 1: jax.errors.JaxRuntimeError: RESOURCE_EXHAUSTED: Out of memory while trying to allocate "
        "30.19GiB (2 runs shared the GPU: run fewer at once, e.g. --parallel 1)"
    )
    waits = "study: stage after waits: stage gate has 2 failed run(s) (b/seed0, ...): rerun them with "
    waits += "--retry-failed"
    assert any(line.startswith(waits) for line in lines), lines
    assert not os.path.exists(os.path.join(root, "after"))

    lines.clear()  # without --retry-failed nothing changes
    assert schedule.run_plan(the_plan, root, budget_minutes=5, log=lines.append) == {}
    _fake(monkeypatch, FINISHER)
    done = schedule.run_plan(the_plan, root, budget_minutes=5, retry_failed=True, log=lambda line: None)
    assert sorted(done) == ["a/seed0", "b/seed0", "b/seed1"]
    assert runs.run_status(os.path.join(root, "gate", "b", "seed0")) == "not_reached"
    kept = runs.read_json(os.path.join(root, "gate", "b", "seed0", runs.FAILED_SUMMARY))
    assert kept["failure"] == failed["failure"]
    record = runs.read_json(os.path.join(root, "gate", "b", "seed0", "ladder_run.json"))
    assert [h["status"] for h in record["history"]] == ["failed", "not_reached"]


def test_the_error_line_is_the_last_exception_of_the_logs_end(tmp_path):
    log = tmp_path / "train.log"
    log.write_text("step 1\nValueError: first\n  File x, line 2\nKeyError: 'loss'\nexiting\n")
    assert runner._last_error_line(str(log)) == "KeyError: 'loss'"
    log.write_text("step 1\nan Error: in prose is not one\n")
    assert runner._last_error_line(str(log)) is None
    assert runner._last_error_line(str(tmp_path / "missing.log")) is None


def test_a_logs_tail_reads_only_its_end(tmp_path):
    """logs.log_tail (the study's failure line, launch_local's last lines of a failed process) reads at
    most max_bytes from the end, so a long run's log is never read whole; bad bytes do not stop it."""
    log = tmp_path / "train.log"
    log.write_bytes(b"".join(b"line %04d\n" % i for i in range(1000)) + b"\xff end\n")
    assert logs.log_tail(str(log), max_bytes=25) == ["ine 0998", "line 0999", "\ufffd end"]  # first line cut
    assert logs.log_tail(str(log))[0] == "line 0000" and len(logs.log_tail(str(log))) == 1001
    assert logs.log_tail(str(tmp_path / "missing.log")) == []


@pytest.mark.parametrize(
    "edit,message",
    [
        (('design = "scratch_paired"', 'design = "forked"'), "design 'forked' is not one of"),
        (('backend = "auto"', 'backend = "fast"'), "backend 'fast' is not one of"),
        (('baseline = "a"', 'baseline = "c"'), "includes the baseline"),
        (("run_minutes = 0.01", "run_minutes = 0.01\nhorizon = 3"), "unknown keys ['horizon']"),
    ],
)
def test_bad_plans_are_one_line_errors(tmp_path, edit, message):
    path = tmp_path / "bad.toml"
    path.write_text(TINY_PLAN.replace(*edit))
    with pytest.raises(ValueError, match=re.escape(message)) as info:
        designs.load_plan(str(path))
    assert "\n" not in str(info.value)


def test_arm_runs_only_the_named_arms_and_an_unknown_arm_is_one_line(tiny_plan, tmp_path, monkeypatch):
    _fake(monkeypatch, FINISHER)
    root = str(tmp_path / "runs")
    done = schedule.run_plan(tiny_plan, root, budget_minutes=5, arms=["b"], log=lambda line: None)
    assert sorted(done) == ["b/seed0", "b/seed1"]
    assert not gate_result(root, tiny_plan.stage("gate"))["complete"]  # arm a is still to run
    with pytest.raises(ValueError, match=r"--arm c: not an arm of these stages; use a, b"):
        schedule.run_plan(tiny_plan, root, budget_minutes=5, arms=["c"], log=lambda line: None)


# ------------------------------------------------------------------------------------- shared runs

# A second stage after the gate: arm a is the gate's arm a (same config, recipe, horizon, LR, overrides,
# seeds), arm c is new; a third stage repeats arm a under another GEMM back end (a different run).
SHARED_STAGES = _stage("again", {"a": "fp8", "c": "mxfp4_full_h16"}, extra='requires = ["gate"]\n') + _stage(
    "emulated", {"a": "fp8"}, seeds=(0,), backend="emulate"
)
# FINISHER, plus the files a real run leaves: its metrics and a checkpoint (which a reuse leaves behind).
FINISHER_WITH_FILES = (
    FINISHER
    + """
os.makedirs(os.path.join(workdir, "checkpoints", "4"), exist_ok=True)
with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"step": 4, "argv": sys.argv[sys.argv.index("--workdir") + 2 :]}) + "\\n")
"""
)


def test_an_identical_run_of_an_earlier_stage_is_reused_not_rerun(tmp_path, monkeypatch):
    monkeypatch.chdir(ROOT)
    path = tmp_path / "shared.toml"
    path.write_text(TINY_PLAN + SHARED_STAGES)
    p = designs.load_plan(str(path))
    _fake(monkeypatch, FINISHER_WITH_FILES)
    root = str(tmp_path / "runs")
    lines = []
    schedule.run_plan(p, root, budget_minutes=5, log=lines.append)
    started = sorted(line.split("start ")[1] for line in lines if " start " in f" {line}")
    assert started == sorted(
        ["gate/a/seed0", "gate/b/seed0", "gate/a/seed1", "gate/b/seed1"]
        + ["again/c/seed0", "again/c/seed1", "emulated/a/seed0"]
    ), lines
    reused = [line for line in lines if "the same run as" in line]
    assert reused == [
        "study: again/a/seed0: the same run as gate/a/seed0, filled from it, not rerun",
        "study: again/a/seed1: the same run as gate/a/seed1, filled from it, not rerun",
    ]
    for seed in (0, 1):
        source, copy = (os.path.join(root, stage, "a", f"seed{seed}") for stage in ("gate", "again"))
        for name in ("metrics.jsonl", "summary.json", "train.log"):
            assert open(os.path.join(copy, name)).read() == open(os.path.join(source, name)).read(), name
        assert not os.path.exists(os.path.join(copy, "checkpoints"))
        record = runs.read_json(os.path.join(copy, "ladder_run.json"))
        assert record["reused_from"] == f"gate/a/seed{seed}" and record["attempts"] == 0
    assert progress.stage_complete(root, p.stage("again"))
    assert "a" not in progress.measured_minutes(root, p.stage("again"))  # no wall time of its own
    # Resumed, nothing starts and nothing is copied again.
    lines = []
    assert schedule.run_plan(p, root, budget_minutes=5, log=lines.append) == {}
    assert not any(" start " in f" {line}" or "the same run as" in line for line in lines), lines


def test_run_identity_is_the_command_without_workdir_under_one_back_end(tiny_plan):
    gate = tiny_plan.stage("gate")
    spec = plan.stage_specs(gate)[0]
    sets = ["--config.data.path=d"]
    identity = reuse.run_identity(spec, gate, sets)
    assert "--workdir" not in identity and "--config.data.path=d" in identity
    assert identity[0] == f"{plan.BACKEND_ENV}=auto"
    elsewhere = dataclasses.replace(gate, name="elsewhere")  # another stage's directory, the same run
    assert reuse.run_identity(spec, elsewhere, sets) == identity
    assert reuse.run_identity(spec, dataclasses.replace(gate, backend="emulate"), sets) != identity
    assert reuse.run_identity(spec, gate, ["--config.data.path=e"]) != identity


def test_the_committed_plan_shares_runs_between_its_stages():
    """The ladder's fp8 and full arms and the literature stage's fp8 arm are the calibration stage's runs;
    the literature stage pairs tseng and nvidia with them on the same seeds, horizon, LR and back end."""
    p = designs.load_plan(PLAN)
    calibration, ladder, literature = (p.stage(n) for n in ("calibration", "ladder", "literature"))
    assert literature.arms == {"fp8": "fp8_mlperf", "tseng": "mxfp4_tseng", "nvidia": "mxfp4_nvidia"}
    assert literature.requires == ("calibration",) and literature.baseline == "fp8"
    same = ("config", "seeds", "steps", "warmup_steps", "peak_lr", "backend", "overrides")
    assert all(getattr(literature, k) == getattr(ladder, k) == getattr(calibration, k) for k in same)
    identities = {}
    for stage in (calibration, ladder, literature):
        for spec in plan.stage_specs(stage):
            identities.setdefault(reuse.run_identity(spec, stage, []), []).append(
                f"{stage.name}/{spec.label}"
            )
    shared = sorted(labels for labels in identities.values() if len(labels) > 1)
    want = [
        [f"calibration/{arm}/seed{k}", f"ladder/{arm}/seed{k}"]
        + ([f"literature/fp8/seed{k}"] if arm == "fp8" else [])
        for arm in ("fp8", "full")
        for k in (0, 1, 2)
    ]
    assert shared == sorted(want)


def test_the_plans_back_ends_and_their_variable_are_the_trainers():
    from fp4jax.ops import BACKENDS
    from fp4jax.training.setup import GEMM_BACKEND_ENV

    assert sorted(plan.BACKENDS) == sorted(BACKENDS) and plan.BACKEND_ENV == GEMM_BACKEND_ENV


@pytest.mark.parametrize(
    "runs_per_gpu,given,expected", [(1, None, None), (2, None, "0.45"), (3, None, "0.3"), (2, "0.2", "0.2")]
)
def test_runs_sharing_a_gpu_each_get_their_share_of_its_memory_unless_the_caller_set_one(
    runs_per_gpu, given, expected
):
    """`--parallel 2 --gpus 0,0`: each child preallocates 0.9 / 2 of the GPU (jax's default 0.75 twice
    does not fit); a value in the caller's environment is kept; a run alone and a CPU run get none."""
    env = {} if given is None else {runner.MEM_FRACTION_ENV: given}
    child = runner.child_env(["0"], "cuda", env, runs_per_gpu)
    assert child.get(runner.MEM_FRACTION_ENV) == expected and child["CUDA_VISIBLE_DEVICES"] == "0"
    assert runner.MEM_FRACTION_ENV not in runner.child_env([], None, {}, 2)


class ToyDesign:
    """A design added by one table entry: one run per seed of the baseline arm only, reported as a line."""

    name, keys, optional_keys, implied = "toy", frozenset({"note"}), frozenset(), frozenset()

    def options(self, raw, where, earlier):
        return {"note": raw["note"]}, {}

    def specs(self, stage, common):
        rung = runner.Rung(
            stage.baseline, stage.config, (*common, f"--config.recipe={stage.arms[stage.baseline]}")
        )
        return runner.plan([rung], list(stage.seeds), None)

    def phases(self, stage, specs, sroot, arms, log):
        return [specs]

    def span(self, spec, stage):
        return 0, stage.steps

    def default_minutes(self, stage, first, last):
        return stage.run_minutes

    def report(self, stage, the_plan, root, out, target, emit):
        done = [
            s.label
            for s in plan.stage_specs(stage)
            if runs.is_finished(s.directory(plan.stage_root(root, stage)))
        ]
        report.write(
            os.path.join(out, stage.name), f"toy {stage.options['note']}: {done}\n", {"done": done}, emit=emit
        )
        return {}


def test_a_design_added_by_one_table_entry_is_scheduled_and_reported(tmp_path, monkeypatch):
    from fp4jax.study.__main__ import main

    monkeypatch.chdir(ROOT)
    monkeypatch.setitem(designs.DESIGNS, "toy", ToyDesign())
    _fake(monkeypatch, FINISHER)
    path = tmp_path / "toy.toml"
    path.write_text(
        '\nname = "toy"'
        + _stage("t", {"a": "fp8", "b": "mxfp4_full"}).replace(
            'design = "scratch_paired"', 'design = "toy"\nnote = "hello"'
        )
    )
    root, out = str(tmp_path / "runs"), tmp_path / "out"
    done = schedule.run_plan(designs.load_plan(str(path)), root, budget_minutes=5, log=lambda line: None)
    assert sorted(done) == ["a/seed0", "a/seed1"]
    assert main(["report", "--plan", str(path), "--root", root, "--out", str(out)]) == 0
    assert (out / "t.md").read_text() == "toy hello: ['a/seed0', 'a/seed1']\n"
    assert "| t | toy | 2 | 2 | 0 | 0 |" in (out / "progress.md").read_text()
