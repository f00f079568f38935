"""benchmarks/bench_train.py: a process per recipe, so each row's peak memory is its own."""

import json
import os
import subprocess
import sys

import pytest
from helpers import benchmark_script
from long_lane import SLOW
from tiny_runs import subprocess_env

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@SLOW
def test_each_recipe_runs_in_its_own_process(tmp_path):
    out = tmp_path / "train.md"
    env = subprocess_env(ROOT, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "benchmarks/bench_train.py", "--config", "configs/tiny_c4_h16.py"]
    cmd += ["--recipes", "bf16,fp8", "--steps", "3", "--skip", "1", "--out", str(out)]
    cmd += ["--config.seq_len=32", "--config.global_batch=8"]
    done = subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=600)
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    assert [r["recipe"] for r in rows] == ["bf16", "fp8"]  # one row each, not the child's copy too
    assert all(r["tokens_per_s"] > 0 and r["last_loss"] > 0 for r in rows)
    table = out.read_text()
    assert "| peak GB |" in table and "so far" not in table
    assert "blocks scanned, updates dispatched ahead." in table  # the tiny set-up's layout, the default
    assert table.count("\n| bf16 |") == 1 and table.count("\n| fp8 |") == 1


def test_a_failing_recipe_stops_with_one_line(monkeypatch):
    """The script's main in this process (its `python benchmarks/bench_train.py` start-up is the long
    lane's above); the recipe's own process fails, and the script stops with one line naming it."""
    bench_train = benchmark_script("bench_train")
    argv = ["benchmarks/bench_train.py", "--config", "configs/tiny_c4_h16.py"]
    monkeypatch.setattr(sys, "argv", [*argv, "--recipes", "no_such_recipe", "--steps", "2"])
    monkeypatch.chdir(ROOT)
    with pytest.raises(SystemExit) as stopped:
        bench_train.main()
    message = stopped.value.code  # what the interpreter prints last, with exit status 1
    assert isinstance(message, str) and "\n" not in message
    assert message.startswith("error: recipe no_such_recipe failed (exit ")


@SLOW
def test_recipes_on_another_bit_generator_side_by_side_with_json_rows(tmp_path):
    """NAME@RNG trains preset NAME with sr_rng=RNG in the same process as NAME; --json holds every row."""
    out = tmp_path / "rows.json"
    env = subprocess_env(ROOT, JAX_PLATFORMS="cpu")
    cmd = [sys.executable, "benchmarks/bench_train.py", "--config", "configs/tiny_c4_h16.py", "--one-process"]
    cmd += ["--recipes", "mxfp4_full_sr,mxfp4_full_sr@threefry13", "--steps", "3", "--skip", "1"]
    cmd += ["--json", str(out), "--config.seq_len=32", "--config.global_batch=8"]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, text=True, timeout=600)
    rows = json.loads(out.read_text())["rows"]
    assert [r["recipe"] for r in rows] == ["mxfp4_full_sr", "mxfp4_full_sr@threefry13"]
    assert rows[0]["last_loss"] != rows[1]["last_loss"]  # the generator reached the rounding
