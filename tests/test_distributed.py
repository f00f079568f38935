"""fp4jax.training.distributed and the integrity shares without several processes: the timeout variables,
the lost coordinator's SIGABRT handler (in a subprocess that aborts), agreement on one process, and the
split of a checkpoint's verification over processes. The runs of several processes: test_multiprocess.py."""

import json
import os
import signal
import socket
import subprocess
import sys

import pytest

from fp4jax.training import distributed, integrity
from fp4jax.training.errors import ConfigError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture
def clean_env(monkeypatch):
    for var in distributed.ENV_VARS.values():
        monkeypatch.delenv(var, raising=False)
    return monkeypatch


def test_timeouts_default_and_from_the_environment(clean_env):
    assert distributed.timeouts() == {"heartbeat": 60, "init": 300, "shutdown": 300}
    clean_env.setenv("FP4JAX_HEARTBEAT_TIMEOUT_S", "7")
    clean_env.setenv("FP4JAX_SHUTDOWN_TIMEOUT_S", " 20 ")
    assert distributed.timeouts() == {"heartbeat": 7, "init": 300, "shutdown": 20}
    # jax's own heartbeat is a backstop at twice fp4jax's; the others are passed as they are
    assert distributed.jax_timeouts() == {"heartbeat": 14, "init": 300, "shutdown": 20}


@pytest.mark.parametrize(
    "var", ["FP4JAX_HEARTBEAT_TIMEOUT_S", "FP4JAX_INIT_TIMEOUT_S", "FP4JAX_SHUTDOWN_TIMEOUT_S"]
)
@pytest.mark.parametrize("value", ["0", "-5", "1.5", "ten", ""])
def test_a_bad_timeout_is_one_line_naming_the_variable(clean_env, var, value):
    clean_env.setenv(var, value)
    with pytest.raises(ConfigError) as info:
        distributed.timeouts()
    message = str(info.value)
    assert "\n" not in message
    assert message.startswith(
        f"{var}={value.strip()!r} is not a whole number of seconds >= 1; set it like {var}="
    )


def test_a_bad_timeout_through_the_command_line_exits_2_before_connecting(tmp_path):
    """The check comes before jax.distributed is started: nothing listens at the coordinator's address."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FP4JAX_", "JAX_", "SLURM_"))}
    env |= {
        "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{_closed_port()}",
        "JAX_NUM_PROCESSES": "2",
        "JAX_PROCESS_ID": "1",
        "JAX_PLATFORMS": "cpu",
        "FP4JAX_INIT_TIMEOUT_S": "soon",
    }
    cmd = [sys.executable, "-m", "fp4jax.train", "--config", "configs/tiny_c4_h16.py"]
    cmd += ["--workdir", str(tmp_path / "run")]
    result = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error")]
    assert result.returncode == 2, result.stderr[-2000:]
    assert errors == [
        "error: FP4JAX_INIT_TIMEOUT_S='soon' is not a whole number of seconds >= 1; set it like "
        "FP4JAX_INIT_TIMEOUT_S=300 (or unset it for that default)"
    ]


def _closed_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]  # closed again on leaving: nothing listens there


def test_coordinator_answers():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        assert distributed.coordinator_answers(f"127.0.0.1:{server.getsockname()[1]}")
    assert not distributed.coordinator_answers(f"127.0.0.1:{_closed_port()}")
    assert not distributed.coordinator_answers("no port")


# A process that aborts with the lost-coordinator handler installed. While the coordinator's port answers,
# the handler asks again for ABORT_PROBE_S (2 s) before the abort goes on; how long it asks is not what
# these tests check, and 2 s was most of the answering test's time, so the child asks for 0.2 s.
ABORTS = (
    "import os, sys; from fp4jax.training import distributed; distributed.ABORT_PROBE_S = 0.2; "
    "distributed.CoordinatorLoss.install(sys.argv[1], 1, 3); os.abort()"
)


def test_an_abort_while_the_coordinator_is_gone_is_one_line_and_exit_4():
    result = subprocess.run(
        [sys.executable, "-c", ABORTS, f"127.0.0.1:{_closed_port()}"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == distributed.EXIT_LOST_PROCESS, result.stderr[-2000:]
    assert result.stderr.splitlines() == [
        "error: lost process 0 of 3 (the coordinator, its coordination service is gone, its port refuses "
        "connections: killed, crashed or its host is down); process 1 stops with exit 4; run the same "
        "command again to continue from the newest checkpoint"
    ]


def test_an_abort_while_the_coordinator_answers_stays_an_abort():
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        address = f"127.0.0.1:{server.getsockname()[1]}"
        result = subprocess.run(
            [sys.executable, "-c", ABORTS, address], cwd=ROOT, capture_output=True, text=True, timeout=120
        )
    assert result.returncode == -signal.SIGABRT, result.stderr[-2000:]
    assert "lost process" not in result.stderr


def test_agree_on_one_process_is_its_own_value():
    assert distributed.agree("x") == ["x"]


def _step_dir(tmp_path, n_files: int) -> str:
    step_dir = tmp_path / "7"
    for i in range(n_files):
        (step_dir / "state" / f"f{i}").parent.mkdir(parents=True, exist_ok=True)
        (step_dir / "state" / f"f{i}").write_bytes(bytes([i]) * (100 + i))
    integrity.write_manifest(str(step_dir))
    return str(step_dir)


@pytest.mark.parametrize("count", [1, 2, 3, 4])
def test_each_file_is_verified_by_exactly_one_share(tmp_path, count):
    step_dir = _step_dir(tmp_path, 7)
    assert all(integrity.verify(step_dir, share=(i, count)) is None for i in range(count))
    with open(os.path.join(step_dir, integrity.MANIFEST)) as f:
        files = sorted(json.load(f)["files"])
    for k, rel in enumerate(files):
        path = os.path.join(step_dir, rel)
        original = open(path, "rb").read()
        with open(path, "wb") as f:
            f.write(bytes([original[0] ^ 1]) + original[1:])  # one flipped bit, same size
        problems = [integrity.verify(step_dir, share=(i, count)) for i in range(count)]
        assert [i for i, p in enumerate(problems) if p] == [k % count], (rel, problems)
        assert problems[k % count] == f"{rel} does not match the checksum written with it"
        with open(path, "wb") as f:
            f.write(original)
