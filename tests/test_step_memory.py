"""benchmarks/step_memory.py: the live-range parser, and one compile-only run on the tiny config."""

import os
import subprocess
import sys

import pytest
from helpers import benchmark_script
from tiny_runs import subprocess_env

from fp4jax.training.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sm = benchmark_script("step_memory")

LIVE_RANGE = """HloLiveRange (max 5):
  BufferLiveRange:
    x.1{}:0-5
  Live ranges at 4 (peak):
    dot{}: 16777216 bytes (cumulative: 16777216 bytes)
    x.1{}: 33554432 bytes (cumulative: 50331648 bytes)
    fusion.2{0}: 8388608 bytes (cumulative: 58720256 bytes)
  Stack trace breakdown for peak usage: 58 720 256 bytes
    main.1 (100.0%, total: 58 720 256 bytes)
"""


def test_peak_buffers_reads_the_peak_section_largest_first():
    assert sm.peak_buffers(LIVE_RANGE) == [("x.1{}", 33554432), ("dot{}", 16777216), ("fusion.2{0}", 8388608)]
    assert sm.peak_buffers("HloLiveRange (max 5):\n") == []


def test_step_memory_runs_on_the_tiny_config(tmp_path):
    out = tmp_path / "memory.md"
    scratch = tmp_path / "tmp"  # the process's temporary folder: its dump must not be left there
    scratch.mkdir()
    env = subprocess_env(ROOT, JAX_PLATFORMS="cpu", TMPDIR=str(scratch))
    cmd = [sys.executable, "benchmarks/step_memory.py", "--config", "configs/tiny_c4_h16.py"]
    cmd += ["--recipes", "bf16", "--top", "3", "--out", str(out)]
    subprocess.run(cmd, cwd=ROOT, env=env, check=True, capture_output=True, timeout=300)
    table = out.read_text()
    row = next(line for line in table.splitlines() if line.startswith("| bf16 |"))
    temp_gb, buffers = float(row.split("|")[2]), int(row.split("|")[6])
    assert temp_gb > 0 and buffers > 0  # the dump was written and its peak section parsed
    assert table.count("| `") == 3  # --top 3 buffers listed
    assert not list(scratch.glob("step_memory_*"))  # the temporary dump is removed


def test_a_named_dump_folder_is_made_and_used(tmp_path, monkeypatch):
    monkeypatch.setenv("XLA_FLAGS", "")
    folder = tmp_path / "dump"
    assert sm.request_dump(str(folder)) == str(folder) and folder.is_dir()
    assert f"--xla_dump_to={folder}" in os.environ["XLA_FLAGS"]


def test_unknown_recipe_is_a_one_line_error(tmp_path):
    config = sm.bench_train.load_config(os.path.join(ROOT, "configs", "tiny_c4_h16.py"), [])
    with pytest.raises(ConfigError, match="no_such_recipe") as raised:
        sm.measure(config, "no_such_recipe", str(tmp_path))
    assert "\n" not in str(raised.value)
