"""Several jax processes on one machine, through the real command line: 2 processes x 4 CPU devices
against the 1 x 8 good run, files written once, a lost process (SIGKILL of process 1 or of the
coordinator) reported in one line, SIGTERM, a checkpoint file bad for one process only and a full disk on
one process (every process takes the same decision), and checkpoints continued on another layout
(2 x 4 -> 4 x 2 -> 2 x 4; 1 x 8 -> 2 x 4 -> 1 x 8, the 2 x 4 leg saving with async_checkpointing=False,
the synchronous saves across processes), and a start from another run's params (init_params) on 2
processes. Runs are shared (module fixtures, copies of a finished run).

Each process is `python -m fp4jax.train` (with the byte-level tokenizer of the tiny runs) in the
environment `fp4jax.launch_local` gives it. Every subprocess has a watchdog (communicate's timeout), so
a hang fails the test instead of CI (`_wait`'s deadline, the
waits' timeouts).

The runs are on CPU devices on every lane (launch_local pins each process to JAX_PLATFORMS=cpu), so the one
process they are compared with is a CPU run too: the 1 x 8 good run on the CPU lane, and on a GPU lane
(where the session's good run trained on the GPU, whose GEMMs round otherwise) the same tiny run trained
by one `python -m fp4jax.train` process on 8 CPU devices (`cpu_good_run`).

Bound on the losses: 2 x 4 sums gradients and amaxes in another order than 1 x 8. Measured on the tiny
run (fp8_delayed, 6 updates, jax 0.10.2 CPU): the largest relative difference of a logged loss was
3.3e-5 (update 5), 1.3e-5 for the evaluation; LOSS_RTOL = 1e-4 allows three times that.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import jax
import pytest
from long_lane import SLOW
from tiny_runs import BYTES_CLI, ROOT, cli_args, compare, compilation_cache, once_per_session, xla_cache_env

from fp4jax import launch_local
from fp4jax.training import distributed, integrity

FIXTURES = (compilation_cache,)
LOSS_RTOL = 1e-4
HEARTBEAT_S = 10  # FP4JAX_HEARTBEAT_TIMEOUT_S of these runs
RUN_TIMEOUT_S = 300  # a watchdog on every process of a run


def _start(workdir, token_cache, xla_cache, processes=2, devices=4, prelude="", **overrides):
    """The processes of one run (Popen objects; logs under workdir.logs); `prelude`: Python run first in
    each process (a test's fault, e.g. FULL_DISK_ON_PROCESS_1)."""
    logs = f"{workdir}.logs"
    os.makedirs(logs, exist_ok=True)
    plan = launch_local.plan(processes, devices, logs, launch_local.free_port())
    cmd = [sys.executable, "-c", prelude + BYTES_CLI, *cli_args(workdir, token_cache, **overrides)]
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


def _cpu_env(devices: int) -> dict:
    """The variables that pin one process to `devices` CPU devices, as launch_local sets them."""
    (only,) = launch_local.plan(1, devices, "", 0)
    return {k: only.env[k] for k in ("JAX_PLATFORMS", "XLA_FLAGS")}


def _train_one_cpu_process(workdir, token_cache, xla_cache, **overrides):
    """The tiny run's command line in one process on 8 CPU devices (whatever this lane's devices are)."""
    log = f"{workdir}.log"
    env = xla_cache_env(xla_cache) | _cpu_env(8)
    with open(log, "w") as out:
        proc = subprocess.Popen(
            [sys.executable, "-c", BYTES_CLI, *cli_args(workdir, token_cache, **overrides)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
        )
    assert _wait([proc]) == [0], _read(log)[-3000:]


@pytest.fixture(scope="session")
def cpu_good_run(request, tmp_path_factory, token_cache, xla_cache):
    """The good run's config on 1 process x 8 CPU devices: the good run itself where it trains on the CPU
    lane's 8 CPU devices, else (a GPU lane) the same run trained once in a CPU process."""
    if jax.default_backend() == "cpu" and jax.device_count() == 8:
        return request.getfixturevalue("good_run")
    with once_per_session(tmp_path_factory, "cpu_good_run") as root:
        workdir, done = root / "run", root / "done"
        if not done.exists():
            shutil.rmtree(workdir, ignore_errors=True)
            _train_one_cpu_process(workdir, token_cache, xla_cache)
            done.touch()
    return workdir


@pytest.fixture(scope="session")
def two_process_run(tmp_path_factory, token_cache, xla_cache):
    """The good run's config on 2 processes x 4 CPU devices (checkpoints 2, 4, 6), shared by the tests
    and run once per session even where pytest-xdist's workers split this module between them."""
    with once_per_session(tmp_path_factory, "two_process") as root:
        workdir, done = root / "run", root / "done"
        if not done.exists():
            shutil.rmtree(workdir, ignore_errors=True)  # what a failed attempt left
            procs, logs = _start(workdir, token_cache, xla_cache)
            codes = _wait(procs)
            assert codes == [0, 0], [_read(log)[-2000:] for log in logs]
            done.touch()
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


@SLOW
def test_two_processes_match_one_within_the_bound(two_process_run, cpu_good_run):
    two, one = compare(two_process_run), compare(cpu_good_run)
    assert [(r["step"], r["eval_loss"] is None) for r in two] == [
        (r["step"], r["eval_loss"] is None) for r in one
    ]
    for a, b in zip(two, one, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=LOSS_RTOL), (a, b)
        assert a["tokens"] == b["tokens"] and a["lr"] == b["lr"]


@SLOW
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


@SLOW
@pytest.mark.parametrize("killed", [1, 0])
def test_a_killed_process_is_named_in_one_line_and_the_other_exits_4(
    killed, tmp_path, token_cache, xla_cache
):
    """SIGKILL of process 1 (a host lost) or of process 0 (the coordinator, which runs jax's coordination
    service) after update 7: the survivor exits 4 within the heartbeat timeout plus its polling interval
    and slack for a busy machine (the coordinator's loss at once: its port closes), with one line naming
    the lost process; the newest checkpoint (4, the one before the kill) verifies. jax's own lines about
    the lost service may come before that line (docs/training.md), but no Python traceback."""
    workdir = tmp_path / "run"
    procs, logs = _start(workdir, token_cache, xla_cache, steps=100_000)
    survivor = 1 - killed
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    try:
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 8):
            assert all(p.poll() is None for p in procs), [_read(log)[-2000:] for log in logs]
            assert time.monotonic() < deadline, "no 7 updates logged in time"
            time.sleep(0.1)
        procs[killed].send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        code = procs[survivor].wait(timeout=HEARTBEAT_S * 3 + 30)
        took = time.monotonic() - killed_at
    finally:
        _wait(procs, timeout=5)
    log = _read(logs[survivor])
    assert code == distributed.EXIT_LOST_PROCESS, log[-3000:]
    assert took < (HEARTBEAT_S * 1.2 + 20 if killed else 10), took
    errors = [line for line in log.splitlines() if line.startswith("error")]
    why = "(no heartbeat" if killed else "(the coordinator, its coordination service is gone"
    assert len(errors) == 1 and errors[0].startswith(f"error: lost process {killed} of 2 {why}"), errors
    assert f"process {survivor} stops with exit 4" in errors[0]
    assert "Traceback" not in log
    ckpts = workdir / "checkpoints"
    verified = [s for s, d in integrity.step_dirs(str(ckpts)).items() if integrity.has_manifest(d)]
    assert max(verified) >= 4 and integrity.verify(str(ckpts / str(max(verified)))) is None


@SLOW
@pytest.mark.parametrize("who", ["one", "all"])
def test_sigterm_stops_every_process_at_one_step_and_resumes_exactly(
    who, two_process_run, tmp_path, token_cache, xla_cache
):
    """SIGTERM to process 1 only (one host preempted first), or to both (a cluster preemption), after
    update 2: both stop after the same update (the flag is agreed every 5), one checkpoint of it, exit 0;
    the same command to 6 updates then logs the uninterrupted 2-process run's numbers bit for bit."""
    workdir = tmp_path / "run"
    # Without dispatching ahead the stop comes after update 5 itself, not after 6 already in flight, so
    # that the run resumes before the good run's end (dispatching ahead changes no number: test_train).
    procs, logs = _start(workdir, token_cache, xla_cache, steps=100_000, dispatch_ahead=False)
    metrics = workdir / "metrics.jsonl"
    deadline = time.monotonic() + RUN_TIMEOUT_S
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        assert all(p.poll() is None for p in procs), [_read(log)[-2000:] for log in logs]
        assert time.monotonic() < deadline, "no 2 updates logged in time"
        time.sleep(0.1)
    for p in procs[1:] if who == "one" else procs:
        p.send_signal(signal.SIGTERM)
    assert _wait(procs) == [0, 0], [_read(log)[-2000:] for log in logs]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["status"] == "preempted" and summary["steps"] == 5
    stopped = [line for log in logs for line in _read(log).splitlines() if line.startswith("stopped by")]
    assert len(stopped) == 1 and "after update 5; saved checkpoint" in stopped[0], stopped  # process 0's
    assert "another process" in stopped[0] if who == "one" else "SIGTERM" in stopped[0]
    assert sorted(integrity.step_dirs(str(workdir / "checkpoints"))) == [2, 4, 5]

    procs, logs = _start(workdir, token_cache, xla_cache, steps=6)
    assert _wait(procs) == [0, 0], [_read(log)[-2000:] for log in logs]
    assert compare(workdir) == compare(two_process_run)


@pytest.fixture(scope="module")
def one_to_two_process_continuation(cpu_good_run, tmp_path_factory, token_cache, xla_cache):
    """The 1 x 8 good run's checkpoint 4 continued by 2 processes x 4 devices to update 6, saving after
    every update with synchronous checkpointing (--config.async_checkpointing=False): checkpoints 5 and 6
    are written by 2 processes through orbax's synchronous Checkpointer (its barriers among the
    processes), each manifest by process 0 once `save` returns."""
    workdir = _copy_until(cpu_good_run, tmp_path_factory.mktemp("one_to_two") / "run", 4)
    procs, logs = _start(workdir, token_cache, xla_cache, checkpoint_every_steps=1, async_checkpointing=False)
    assert _wait(procs) == [0, 0], [_read(log)[-2000:] for log in logs]
    return workdir


@SLOW
def test_one_process_checkpoint_continues_on_two_processes_saving_synchronously(
    one_to_two_process_continuation, cpu_good_run
):
    """Checkpoint 4 of the 1 x 8 run restored by 2 processes (its data iterator's state too): updates 5
    and 6 read the same batches, so their losses match the 1 x 8 run's within the bound. The synchronous
    saves of 5 and 6 (`one_to_two_process_continuation`, async_checkpointing=False) hold both processes'
    files and a manifest that verifies; 5's manifest was written when its save returned, before any file
    of 6 (not by the end of the run's `finish`, which writes the missing ones); no orbax tmp dir is left."""
    workdir = one_to_two_process_continuation
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["resumed_from_step"] == 4 and summary["steps"] == 6 and summary["devices"] == "8 x cpu"
    _continues_within_the_bound(workdir, cpu_good_run, updates=2)
    ckpts = workdir / "checkpoints"
    meta = json.loads((ckpts / "6" / "meta" / "metadata").read_text())
    assert meta["config"]["async_checkpointing"] is False  # the flag reached the run
    assert sorted(integrity.step_dirs(str(ckpts))) == [4, 5, 6]  # keep_checkpoints 3
    for step in (5, 6):
        step_dir = ckpts / str(step)
        assert integrity.has_manifest(str(step_dir)), step
        assert integrity.verify(str(step_dir)) is None, step
        assert {"ocdbt.process_0", "ocdbt.process_1"} <= set(os.listdir(step_dir / "state")), step
    files_of_6 = [os.path.join(root, n) for root, _, names in os.walk(ckpts / "6") for n in names]
    first_of_6 = min(os.stat(f).st_mtime_ns for f in files_of_6 if integrity.MANIFEST not in f)
    assert os.stat(ckpts / "5" / integrity.MANIFEST).st_mtime_ns <= first_of_6
    assert not [n for n in os.listdir(ckpts) if integrity.ORBAX_TMP in n]


@SLOW
def test_two_process_checkpoint_continues_on_one_process(
    one_to_two_process_continuation, cpu_good_run, tmp_path, token_cache, xla_cache
):
    """Checkpoint 5 of the 2 x 4 continuation (saved synchronously by 2 processes) restored by 1 process x
    8 CPU devices (its data iterator's state too): update 6 reads the same batch, so its loss matches the
    1 x 8 run's within the bound."""
    workdir = _copy_until(one_to_two_process_continuation, tmp_path / "run", 5)
    _train_one_cpu_process(workdir, token_cache, xla_cache)
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["resumed_from_step"] == 5 and summary["steps"] == 6 and summary["devices"] == "8 x cpu"
    _continues_within_the_bound(workdir, cpu_good_run, updates=1)


@SLOW
def test_two_processes_start_from_params_as_one_process_does(cpu_good_run, tmp_path, token_cache, xla_cache):
    """--config.init_params (the good run's newest checkpoint, params only) on 2 processes x 4 devices,
    each restoring its shards of the params: its two updates' losses match the same start on 1 process x
    8 devices within the bound, and both differ from the good run's first updates (the params were
    loaded, not initialised)."""
    source = str(cpu_good_run / "checkpoints")
    one, two = tmp_path / "one", tmp_path / "two"
    _train_one_cpu_process(one, token_cache, xla_cache, init_params=source, steps=2)
    procs, logs = _start(two, token_cache, xla_cache, init_params=source, steps=2)
    assert _wait(procs) == [0, 0], [_read(log)[-2000:] for log in logs]
    started, again, fresh = compare(one), compare(two), compare(cpu_good_run)
    assert [r["step"] for r in again] == [r["step"] for r in started] and started[-1]["step"] == 2
    for a, b in zip(again, started, strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=LOSS_RTOL), (a, b)
    assert started[0]["step"] == fresh[0]["step"] == 1
    assert started[0]["loss"] != pytest.approx(fresh[0]["loss"], rel=100 * LOSS_RTOL)
    summary = json.loads((two / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["devices"] == "8 x cpu"


def _copy_until(run, workdir, step: int):
    """A copy of a finished run as it was after checkpoint `step` (later checkpoints, summary removed)."""
    shutil.copytree(run, workdir)
    for later in [s for s in integrity.step_dirs(str(workdir / "checkpoints")) if s > step]:
        shutil.rmtree(workdir / "checkpoints" / str(later))
    (workdir / "summary.json").unlink()
    return workdir


def _errors(log) -> list[str]:
    return [line for line in _read(log).splitlines() if line.startswith("error")]


# Process 1's disk is full when the save of checkpoint 4 finishes: ENOSPC there the next time the trainer
# waits for its saves (as orbax raises a background write's error), process 0's save is fine.
FULL_DISK_ON_PROCESS_1 = """
import errno, os
import orbax.checkpoint as ocp
if os.environ["JAX_PROCESS_ID"] == "1":
    _save, _wait = ocp.CheckpointManager.save, ocp.CheckpointManager.wait_until_finished
    _saved = []
    def save(self, step, *args, **kwargs):
        out = _save(self, step, *args, **kwargs)  # orbax waits for its saves inside too: not those
        _saved.append(step)
        return out
    def wait_until_finished(self):
        _wait(self)
        if _saved and _saved[-1] == 4:
            _saved.append("failed")
            raise OSError(errno.ENOSPC, "No space left on device (a test's fault)")
    ocp.CheckpointManager.save, ocp.CheckpointManager.wait_until_finished = save, wait_until_finished
"""


@SLOW
def test_a_full_disk_on_one_process_stops_every_process_with_the_same_line(
    two_process_run, tmp_path, token_cache, xla_cache
):
    """Process 1 runs out of space on the save of checkpoint 4 (FULL_DISK_ON_PROCESS_1, a fault injected
    into that process only): the failure is agreed before either process starts the next save (whose
    collective part would wait for a peer that never comes), so both stop at once with exit 2 and the
    same line naming process 1, and checkpoint 2 is intact."""
    workdir = _copy_until(two_process_run, tmp_path / "run", 2)
    procs, logs = _start(workdir, token_cache, xla_cache, prelude=FULL_DISK_ON_PROCESS_1, steps=6)
    assert _wait(procs) == [2, 2], [_read(log)[-2000:] for log in logs]
    errors = [_errors(log) for log in logs]
    assert errors[0] == errors[1] and len(errors[0]) == 1, errors
    assert errors[0][0].startswith(
        "error: process 1 of 2: no space left on the device while writing checkpoint"
    )
    assert not any("lost process" in _read(log) or "Traceback" in _read(log) for log in logs)
    assert not (workdir / "summary.json").exists()
    assert integrity.verify(str(workdir / "checkpoints" / "2")) is None


@pytest.fixture(scope="module")
def four_process_continuation(two_process_run, tmp_path_factory, token_cache, xla_cache):
    """The 2 x 4 run's checkpoint 4 continued by 4 processes x 2 devices to update 6, saving after every
    update (checkpoints 5 and 6 written by 4 processes)."""
    workdir = _copy_until(two_process_run, tmp_path_factory.mktemp("four_process") / "run", 4)
    procs, logs = _start(workdir, token_cache, xla_cache, processes=4, devices=2, checkpoint_every_steps=1)
    assert _wait(procs) == [0] * 4, [_read(log)[-2000:] for log in logs]
    return workdir


def _continues_within_the_bound(resumed, good_run, updates: int):
    one, again = compare(good_run), compare(resumed)
    assert [r["step"] for r in again] == [r["step"] for r in one]
    for a, b in zip(again[-updates:], one[-updates:], strict=True):
        assert a["loss"] == pytest.approx(b["loss"], rel=LOSS_RTOL), (a, b)
        assert a["tokens"] == b["tokens"] and a["lr"] == b["lr"]


@SLOW
def test_two_process_checkpoint_continues_on_four_processes(four_process_continuation, cpu_good_run):
    """Restored by 4 processes (its data iterator's state too): updates 5 and 6 read the same batches, so
    their losses match the 1 x 8 run's within the bound."""
    summary = json.loads((four_process_continuation / "summary.json").read_text())
    assert summary["resumed_from_step"] == 4 and summary["steps"] == 6 and summary["devices"] == "8 x cpu"
    _continues_within_the_bound(four_process_continuation, cpu_good_run, updates=2)
    state = four_process_continuation / "checkpoints" / "5" / "state"
    assert {f"ocdbt.process_{i}" for i in range(4)} <= set(os.listdir(state))


def _flip_a_byte_of_process_1s_share(step_dir) -> str:
    """Damages the first file of process 1's share of a 2-process verification (integrity.verify's
    `share`); returns its path relative to the step."""
    files = sorted(json.loads((step_dir / integrity.MANIFEST).read_text())["files"])
    bad = step_dir / files[1::2][0]
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    assert integrity.verify(str(step_dir), share=(0, 2)) is None  # process 0 sees nothing wrong
    return files[1::2][0]


@SLOW
def test_four_process_checkpoint_continues_on_two_processes_past_a_file_bad_for_one(
    four_process_continuation, cpu_good_run, tmp_path, token_cache, xla_cache
):
    """The 4-process run's checkpoints restored by 2 processes x 4 devices. Its newest (6) has a flipped
    byte in a file of process 1's share, seen by process 1 only: the verdicts are agreed, so both
    processes quarantine 6 and restore 5 (written by 4 processes), and update 6 matches the 1 x 8 run's
    within the bound."""
    workdir = _copy_until(four_process_continuation, tmp_path / "run", 6)
    bad = _flip_a_byte_of_process_1s_share(workdir / "checkpoints" / "6")
    procs, logs = _start(workdir, token_cache, xla_cache, checkpoint_every_steps=1, steps=6)
    assert _wait(procs) == [0, 0], [_read(log)[-2000:] for log in logs]
    summary = json.loads((workdir / "summary.json").read_text())
    assert summary["resumed_from_step"] == 5 and summary["steps"] == 6
    _continues_within_the_bound(workdir, cpu_good_run, updates=1)
    for log in logs:  # each process says the same about checkpoint 6
        bad_lines = [line for line in _read(log).splitlines() if "is bad:" in line]
        assert len(bad_lines) == 1 and f"/6 is bad: {bad} does not match" in bad_lines[0], bad_lines
        assert "(seen by process 1)" in bad_lines[0]
    assert [n.split("-")[0] for n in os.listdir(workdir / "checkpoints" / integrity.QUARANTINE)] == ["6"]
