"""The ladder end to end on the tiny config: a rung forced to diverge (debug_nan_at_step) and a rung that
crashes are recorded and the ladder finishes; the report reads "diverged @ step N"; a second invocation
reruns nothing. Also: timeouts, stale summaries, device pinning and the command line's one-line errors.

Each trainer run is a subprocess on one CPU device (a 32-token tiny model for 6 steps).
"""

import json
import math
import os
import sys

import pytest
from long_lane import SLOW
from tiny_runs import TINY_OVERRIDES

from fp4jax import ladder
from fp4jax.study import runner, runs

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONFIG = os.path.join(ROOT, "configs", "tiny_c4_h16.py")
# The trainer tests' tiny run, with the plain fp8 recipe, evaluations every 2 updates and no TensorBoard.
TINY = {**TINY_OVERRIDES, "recipe": "fp8", "eval_every_sequences": 16, "tensorboard": False}


@pytest.fixture
def child_env(tmp_path_factory, monkeypatch):
    """Trainer subprocesses on one CPU device (conftest's 8 fake devices would only slow them down; its
    compile-speed flags are kept), sharing a compilation cache."""
    flags = os.environ.get("XLA_FLAGS", "").split()
    one_device = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
    monkeypatch.setenv("XLA_FLAGS", " ".join(one_device))
    monkeypatch.setenv("JAX_PLATFORMS", "cpu")
    monkeypatch.setenv("JAX_COMPILATION_CACHE_DIR", str(tmp_path_factory.mktemp("xla")))
    monkeypatch.setenv("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")
    monkeypatch.chdir(ROOT)
    return tmp_path_factory.mktemp("tokens")


def run_args(root, token_cache):
    sets = [f"--set={k}={v}" for k, v in {**TINY, "data.cache_dir": token_cache}.items()]
    return [
        "run",
        "--root",
        str(root),
        "--parallel",
        "2",
        f"fp8={CONFIG}",
        f"nan={CONFIG}",
        f"broken={CONFIG}",
        "--rung-set",
        "nan:debug_nan_at_step=3",
        "--rung-set",
        "broken:data.path=/no/such/dir",
        *sets,
    ]


def _state(root):
    """(summary mtime, metrics mtime, attempts) of every run."""
    out = {}
    for rung in ("fp8", "nan", "broken"):
        d = root / rung / "seed0"
        metrics = d / "metrics.jsonl"
        attempts = json.loads((d / "ladder_run.json").read_text())["attempts"]
        out[rung] = (
            os.path.getmtime(d / "summary.json"),
            metrics.exists() and os.path.getmtime(metrics),
            attempts,
        )
    return out


@SLOW
def test_ladder_survives_divergence_and_a_crash_and_reruns_nothing(tmp_path, child_env, capsys):
    root = tmp_path / "ladder"
    assert ladder.main(run_args(root, child_env)) == 0
    log = capsys.readouterr().out
    assert log.count("ladder: start") == 3 and "[3/3]" in log, log
    summaries = {
        r: runs.read_json(str(root / r / "seed0" / "summary.json")) for r in ("fp8", "nan", "broken")
    }
    assert runs.status_of(summaries["fp8"]) == "not_reached" and summaries["fp8"]["steps"] == 6
    assert summaries["nan"]["status"] == "diverged" and summaries["nan"]["diverged_step"] == 3
    assert [step for step, _ in summaries["nan"]["last_finite_losses"]] == [1, 2]
    assert summaries["broken"]["status"] == "failed" and summaries["broken"]["failure"] == "exit code 2"
    assert "error: " in (root / "broken" / "seed0" / "train.log").read_text()

    out = tmp_path / "report" / "ladder"
    assert ladder.main(["report", "--root", str(root), "--baseline", "fp8", "--out", str(out)]) == 0
    table = (tmp_path / "report" / "ladder.md").read_text()
    assert "| nan | 0 / 1 / 0 | diverged @ step 3 |" in table, table
    assert "| fp8 | 0 / 0 / 1 | not reached within budget (1,536 tokens) |" in table, table
    assert "failed (exit code 2)" in table
    assert json.loads((tmp_path / "report" / "ladder.json").read_text())["target_eval_loss"] == 7.5

    before = _state(root)
    capsys.readouterr()
    assert ladder.main(run_args(root, child_env)) == 0
    log = capsys.readouterr().out
    assert "ladder: start" not in log and log.count("not rerun") == 3, log
    assert _state(root) == before and before["nan"][2] == 1


SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]
CRASHER = [sys.executable, "-c", "import sys; print('Traceback: boom'); sys.exit(1)"]


def _fake_grid(tmp_path, monkeypatch, command, **kwargs):
    monkeypatch.setattr(runner.RunSpec, "argv", lambda self, root, overrides: command)
    # The fake commands end (or time out) in well under a second: a shorter wait between polls changes no
    # decision (the timeout's clock is its own), only how long the test waits (0.5 s a poll by default).
    monkeypatch.setattr(runner, "POLL_S", 0.05)
    spec = runner.RunSpec(runner.Rung("tiny", CONFIG), seed=0)
    return spec, runner.run_grid([spec], str(tmp_path), [], log=lambda line: None, **kwargs)


def test_timeout_is_recorded_as_failed_and_retried_only_when_asked(tmp_path, monkeypatch):
    spec, done = _fake_grid(tmp_path, monkeypatch, SLEEPER, timeout_min=0.01)
    summary = done[spec.label]
    assert summary["status"] == "failed" and summary["failure"] == "timeout after 0.01 min"
    assert summary["target_eval_loss"] == 7.5 and summary["recipe"] == "mxfp4_full_h16"  # from the config
    _, again = _fake_grid(tmp_path, monkeypatch, SLEEPER, timeout_min=0.01)
    assert again == {}
    _, retried = _fake_grid(tmp_path, monkeypatch, SLEEPER, timeout_min=0.01, retry_failed=True)
    assert list(retried) == [spec.label]
    run_dir = str(tmp_path / "tiny" / "seed0")
    assert runs.read_json(os.path.join(run_dir, "ladder_run.json"))["attempts"] == 2
    kept = runs.read_json(os.path.join(run_dir, runs.FAILED_SUMMARY))  # the failure it replaced, kept to read
    assert kept["status"] == "failed" and kept["failure"] == "timeout after 0.01 min"


def test_a_crash_after_a_preempted_attempt_is_not_read_as_preempted(tmp_path, monkeypatch):
    run_dir = tmp_path / "tiny" / "seed0"
    os.makedirs(run_dir)
    runs.write_json(str(run_dir / "summary.json"), {"status": "preempted", "steps": 4})
    spec, done = _fake_grid(tmp_path, monkeypatch, CRASHER)
    assert done[spec.label]["status"] == "failed" and done[spec.label]["failure"] == "exit code 1"
    assert "Traceback: boom" in (run_dir / "train.log").read_text()


def test_a_divergence_without_summary_gets_one_from_the_metrics(tmp_path, monkeypatch):
    """Exit 3 and no summary.json (the trainer died before writing it): the ladder derives the summary
    from metrics.jsonl, whose last training line is the update the guard rejected."""
    run_dir = tmp_path / "tiny" / "seed0"
    lines = [
        {"step": s, "loss": 9.0 - s, "grad_norm": 1.0, "tokens": 256 * s, "sequences": 8 * s} for s in (1, 2)
    ]
    lines.append({"step": 3, "loss": float("nan"), "grad_norm": 1.0, "tokens": 768, "sequences": 24})
    text = "".join(json.dumps(r) + "\n" for r in lines)
    script = f"import sys\nopen({str(run_dir / 'metrics.jsonl')!r}, 'w').write({text!r})\nsys.exit(3)\n"
    spec, done = _fake_grid(tmp_path, monkeypatch, [sys.executable, "-c", script])
    summary = runs.read_json(str(run_dir / "summary.json"))
    assert summary["written_by"] == "ladder" and summary["status"] == "diverged"
    assert (summary["diverged_step"], summary["diverged_tokens"]) == (3, 768)
    assert summary["divergence_reason"] == "non_finite_loss" and summary["divergence"]["step"] == 3
    assert summary["last_finite_losses"] == [[1, 8.0], [2, 7.0]]
    assert math.isnan(done[spec.label]["divergence"]["value"])


def test_device_env_pins_one_gpu_on_cuda_and_rocm():
    cuda = runner.device_env(["3"], "cuda", {"PATH": "x"})
    assert cuda["CUDA_VISIBLE_DEVICES"] == "3" and cuda["PATH"] == "x"
    rocm = runner.device_env(["3"], "rocm", {})
    assert rocm["ROCR_VISIBLE_DEVICES"] == "3"  # ROCm filters first; HIP/CUDA index what is left
    assert rocm["HIP_VISIBLE_DEVICES"] == rocm["CUDA_VISIBLE_DEVICES"] == "0"
    assert runner.device_env(["3"], None, {"A": "1"}) == {"A": "1"}
    assert runner._slots(2, ["4", "5", "6", "7"], 2, "cuda") == [["4", "5"], ["6", "7"]]
    with pytest.raises(ValueError, match="needs 4 GPUs, have 2"):
        runner._slots(2, ["0", "1"], 2, "cuda")


def test_grid_order_directories_and_commands():
    rungs = ladder.parse_rungs([CONFIG, f"nan={CONFIG}"], ["nan:debug_nan_at_step=3"])
    specs = runner.plan(rungs, [0, 1], [1e-3, 3e-3])
    assert [s.label for s in specs[:3]] == [
        "tiny_c4_h16/lr0.001/seed0",
        "nan/lr0.001/seed0",
        "tiny_c4_h16/lr0.003/seed0",
    ]
    three = ladder.parse_rungs([f"a={CONFIG}", f"b={CONFIG}"], [], ["b:0,1,2"])
    assert [s.label for s in runner.plan(three, [0], None)] == ["a/seed0", "b/seed0", "b/seed1", "b/seed2"]
    by_recipe = ladder.parse_rungs([CONFIG], ["fp8:steps=2"], [], ["fp8", "mxfp4_full"])
    assert [(r.name, r.overrides) for r in by_recipe] == [
        ("fp8", ("--config.recipe=fp8", "--config.steps=2")),
        ("mxfp4_full", ("--config.recipe=mxfp4_full",)),
    ]
    argv = specs[1].argv("R", ["--config.steps=9"])
    assert argv[argv.index("--workdir") + 1] == os.path.join("R", "nan", "lr0.001", "seed0")
    assert argv[-4:] == [
        "--config.steps=9",
        "--config.debug_nan_at_step=3",
        "--config.seed=0",
        "--config.optimizer.peak_lr=0.001",
    ]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--set", "seed=1"], "use --seeds 0,1,2"),
        (["--set", "no_such_key=1"], "no_such_key"),
        (["--rung-set", "h99:steps=1"], "--rung-set 'h99:steps=1'"),
        (["--lrs", "1e-3", "--", "--config.optimizer.peak_lr=1"], "--lrs sets optimizer.peak_lr"),
    ],
)
def test_bad_command_lines_are_one_line_errors(args, message, tmp_path, capsys):
    assert ladder.main(["run", "--root", str(tmp_path), CONFIG, *args]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not os.listdir(tmp_path)  # nothing started
