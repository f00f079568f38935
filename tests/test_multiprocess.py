"""Several jax processes on one machine, through the real command line: 2 processes x 4 CPU devices
against the 1 x 8 good run, files written once, and a lost process (SIGKILL) reported in one line.

Each process is `python -m fp4jax.train` (with the byte-level tokenizer of the tiny runs) in the
environment `fp4jax.launch_local` gives it. Every subprocess has a watchdog (communicate's timeout), so
a hang fails the test instead of CI.

Bound on the losses: 2 x 4 sums gradients and amaxes in another order than 1 x 8. Measured on the tiny
run (fp8_delayed, 6 updates, jax 0.10.2 CPU): the largest relative difference of a logged loss was
3.3e-5 (update 5), 1.3e-5 for the evaluation; LOSS_RTOL = 1e-4 allows three times that.
"""

import json
import os
import signal
import subprocess
import sys
import time

import pytest
from tiny_runs import BYTES_CLI, ROOT, cli_args, compare, compilation_cache, xla_cache_env

from fp4jax import launch_local
from fp4jax.training import distributed, integrity

FIXTURES = (compilation_cache,)
LOSS_RTOL = 1e-4
HEARTBEAT_S = 10  # FP4JAX_HEARTBEAT_TIMEOUT_S of these runs
RUN_TIMEOUT_S = 300  # a watchdog on every process of a run


def _start(workdir, token_cache, xla_cache, processes=2, devices=4, **overrides):
    """The processes of one run (Popen objects; logs under workdir.logs)."""
    logs = f"{workdir}.logs"
    os.makedirs(logs, exist_ok=True)
    plan = launch_local.plan(processes, devices, logs, launch_local.free_port())
    cmd = [sys.executable, "-c", BYTES_CLI, *cli_args(workdir, token_cache, **overrides)]
    env = xla_cache_env(xla_cache) | {distributed.ENV_VARS["heartbeat"]: str(HEARTBEAT_S)}
    out = []
    for p in plan:
        log = open(p.log, "w")
        out.append(subprocess.Popen(cmd, cwd=ROOT, env=env | p.env, stdout=log, stderr=subprocess.STDOUT))
    return out, [p.log for p in plan]


def _wait(procs, timeout=RUN_TIMEOUT_S) -> list[int]:
    deadline = time.monotonic() + timeout
    try:
        return [p.wait(timeout=max(1, deadline - time.monotonic())) for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()


def _read(path) -> str:
    with open(path, errors="replace") as f:
        return f.read()


@pytest.fixture(scope="module")
def two_process_run(tmp_path_factory, token_cache, xla_cache):
    """The good run's config on 2 processes x 4 CPU devices (checkpoints 2, 4, 6), shared by the tests."""
    workdir = tmp_path_factory.mktemp("two_process") / "run"
    procs, logs = _start(workdir, token_cache, xla_cache)
    codes = _wait(procs)
    assert codes == [0, 0], [_read(log)[-2000:] for log in logs]
    return workdir


def test_launcher_dry_run_starts_nothing(tmp_path):
    cmd = [sys.executable, "-m", "fp4jax.launch_local", "-n", "2", "--cpu", "--dry-run", "--"]
    cmd += ["no-such-python", "-m", "fp4jax.train", "--workdir", str(tmp_path / "run")]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    lines = [line for line in result.stdout.splitlines() if line.startswith("would run:")]
    assert len(lines) == 2
    for i, line in enumerate(lines):
        assert f"JAX_PROCESS_ID={i}" in line and "JAX_NUM_PROCESSES=2" in line
        assert "--xla_force_host_platform_device_count=4" in line and "JAX_PLATFORMS=cpu" in line
        assert line.endswith(f"> {tmp_path / 'run' / 'logs' / f'process_{i}.log'} 2>&1")
    port = {line.split("JAX_COORDINATOR_ADDRESS=")[1].split()[0] for line in lines}
    assert len(port) == 1  # one coordinator for both
    assert not (tmp_path / "run").exists()


def test_two_processes_match_one_within_the_bound(two_process_run, good_run):
    two, one = compare(two_process_run), compare(good_run)
    assert [(r["step"], r["eval_loss"] is None) for r in two] == [
        (r["step"], r["eval_loss"] is None) for r in one
    ]
    for a, b in zip(two, one, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=LOSS_RTOL), (a, b)
        assert a["tokens"] == b["tokens"] and a["lr"] == b["lr"]


def test_two_processes_write_each_file_once(two_process_run):
    lines = (two_process_run / "metrics.jsonl").read_text().splitlines()
    keys = [(r["step"], "eval_loss" in r) for r in map(json.loads, lines)]
    assert len(keys) == len(set(keys)) == 7  # 6 updates and the evaluation at 4, once each
    assert len(os.listdir(two_process_run / "tensorboard")) == 1
    summary = json.loads((two_process_run / "summary.json").read_text())
    assert summary["devices"] == "8 x cpu" and summary["steps"] == 6
    ckpts = two_process_run / "checkpoints"
    assert sorted(integrity.step_dirs(str(ckpts))) == [2, 4, 6]
    for step in (2, 4, 6):
        step_dir = ckpts / str(step)
        assert integrity.verify(str(step_dir)) is None
        assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(os.listdir(step_dir / "state"))  # by both
    assert not [n for n in os.listdir(ckpts) if integrity.ORBAX_TMP in n]


@pytest.mark.slow
def test_a_killed_process_is_named_in_one_line_and_the_other_exits_4(tmp_path, token_cache, xla_cache):
    """SIGKILL of process 1 (a host lost) after update 7: process 0 exits 4 within the heartbeat timeout
    plus its polling interval and slack for a busy machine, with one line naming process 1; the newest
    checkpoint (4, the one before the kill) verifies."""
    workdir = tmp_path / "run"
    procs, logs = _start(workdir, token_cache, xla_cache, steps=100_000)
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 8):
            assert all(p.poll() is None for p in procs), [_read(log)[-2000:] for log in logs]
            assert time.monotonic() < deadline, "no 7 updates logged in time"
            time.sleep(0.1)
        procs[1].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        code = procs[0].wait(timeout=HEARTBEAT_S * 3 + 30)
        took = time.monotonic() - killed_at
    finally:
        _wait(procs, timeout=5)
    log = _read(logs[0])
    assert code == distributed.EXIT_LOST_PROCESS, log[-3000:]
    assert took < HEARTBEAT_S * 1.2 + 20, took
    errors = [line for line in log.splitlines() if line.startswith("error")]
    assert len(errors) == 1 and errors[0].startswith("error: lost process 1 of 2 (no heartbeat"), errors
    assert "Traceback" not in log
    ckpts = workdir / "checkpoints"
    verified = [s for s, d in integrity.step_dirs(str(ckpts)).items() if integrity.has_manifest(d)]
    assert max(verified) >= 4 and integrity.verify(str(ckpts / str(max(verified)))) is None
