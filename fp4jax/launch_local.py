"""Several jax processes on this machine, as a cluster would start them: one command, N copies.

    python -m fp4jax.launch_local --processes 2 [--devices-per-process 4] [--log-dir DIR] [--dry-run] \\
        -- python -m fp4jax.train --config configs/tiny_c4_h16.py --workdir runs/two

Each copy gets the environment `fp4jax.training.setup.initialize_distributed` reads
(JAX_COORDINATOR_ADDRESS on a free local port, JAX_NUM_PROCESSES, JAX_PROCESS_ID) and its share of the
devices: on a machine with GPUs, its slice of them (CUDA_VISIBLE_DEVICES or HIP_VISIBLE_DEVICES); else
`--devices-per-process` fake CPU devices (XLA's --xla_force_host_platform_device_count, JAX_PLATFORMS=cpu).
Process i's stdout and stderr go to <log dir>/process_<i>.log (default log dir: <workdir>/logs when the
command names --workdir, else logs/).

The launcher passes SIGTERM and SIGINT on to every process (a cluster's preemption) and exits with the
first non-zero exit code of a process (0 when all exit 0), printing the tail of each failed process's log.
When one process fails, the others have `--grace` seconds to fail on their own (fp4jax's heartbeat
timeout, docs/training.md) before they are killed. `--dry-run` prints each process's environment and
command and starts nothing.
"""

import argparse
import dataclasses
import glob
import os
import shlex
import signal
import socket
import subprocess
import sys
import time

from fp4jax import logs

__all__ = ["Process", "free_port", "gpu_platform", "main", "plan"]

GPU_VISIBILITY = {"cuda": "CUDA_VISIBLE_DEVICES", "rocm": "HIP_VISIBLE_DEVICES"}
TAIL_LINES = 5


@dataclasses.dataclass
class Process:
    index: int
    env: dict  # only the variables the launcher sets (on top of its own environment)
    log: str


def free_port() -> int:
    """A TCP port nobody listens on now (the coordinator binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def gpu_platform() -> tuple[str | None, int]:
    """("cuda" or "rocm", GPU count) from the driver's files, without starting jax; (None, 0) without GPUs."""
    nvidia = glob.glob("/dev/nvidia[0-9]*")
    if nvidia:
        return "cuda", len(nvidia)
    nodes = glob.glob("/sys/class/kfd/kfd/topology/nodes/*/gpu_id")  # CPU nodes have gpu_id 0
    amd = [p for p in nodes if open(p).read().strip() != "0"]
    return ("rocm", len(amd)) if amd else (None, 0)


def workdir_of(command: list[str]) -> str | None:
    for i, arg in enumerate(command):
        if arg == "--workdir" and i + 1 < len(command):
            return command[i + 1]
        if arg.startswith("--workdir="):
            return arg.split("=", 1)[1]
    return None


def plan(processes: int, devices_per_process: int, log_dir: str, port: int, platform=None, gpus=0):
    """The processes to start: each one's own environment variables and log file."""
    if processes < 1:
        raise SystemExit("launch_local: --processes must be >= 1")
    if platform is not None and gpus % processes:
        raise SystemExit(f"launch_local: {gpus} GPUs do not split evenly over {processes} processes")
    out = []
    for i in range(processes):
        env = {
            "JAX_COORDINATOR_ADDRESS": f"127.0.0.1:{port}",
            "JAX_NUM_PROCESSES": str(processes),
            "JAX_PROCESS_ID": str(i),
        }
        if platform is None:
            flags = os.environ.get("XLA_FLAGS", "").split()
            flags = [f for f in flags if not f.startswith("--xla_force_host_platform_device_count")]
            flags.append(f"--xla_force_host_platform_device_count={devices_per_process}")
            env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=" ".join(flags))
        else:
            share = gpus // processes
            env[GPU_VISIBILITY[platform]] = ",".join(str(d) for d in range(i * share, (i + 1) * share))
        out.append(Process(i, env, os.path.join(log_dir, f"process_{i}.log")))
    return out


def run(processes: list[Process], command: list[str], grace_s: float) -> int:
    """Starts every process, forwards SIGTERM / SIGINT to all, waits; the first non-zero exit code or 0."""
    os.makedirs(os.path.dirname(processes[0].log) or ".", exist_ok=True)
    children = []
    for p in processes:
        with open(p.log, "w") as log:
            children.append(
                subprocess.Popen(command, env={**os.environ, **p.env}, stdout=log, stderr=subprocess.STDOUT)
            )

    def forward(signum, frame):
        for child in children:
            if child.poll() is None:
                child.send_signal(signum)

    previous = {sig: signal.signal(sig, forward) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        first_failure, deadline = None, None
        while any(c.poll() is None for c in children):
            failed = [c for c in children if c.returncode not in (None, 0)]
            if failed and deadline is None:
                first_failure, deadline = failed[0], time.monotonic() + grace_s
            if deadline is not None and time.monotonic() > deadline:
                for i, child in enumerate(children):
                    if child.poll() is None:
                        print(f"launch_local: process {i} still runs {grace_s:.0f} s after a failure: killed")
                        child.kill()
            time.sleep(0.1)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    codes = [c.wait() for c in children]
    for p, code in zip(processes, codes, strict=True):
        if code != 0:
            print(f"launch_local: process {p.index} exited {code}; the end of {p.log}:", file=sys.stderr)
            for line in logs.log_tail(p.log)[-TAIL_LINES:]:
                print(f"  {line}", file=sys.stderr)
    if first_failure is not None:
        return first_failure.returncode if first_failure.returncode > 0 else 128 - first_failure.returncode
    return next((c if c > 0 else 128 - c for c in codes if c != 0), 0)


def parse_args(argv):
    parser = argparse.ArgumentParser(
        prog="python -m fp4jax.launch_local",
        description=__doc__.splitlines()[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--processes", "-n", type=int, default=2, help="processes to start (default 2)")
    parser.add_argument(
        "--devices-per-process", type=int, default=4, help="fake CPU devices of each process, without GPUs"
    )
    parser.add_argument("--log-dir", help="where process_<i>.log go (default <workdir>/logs)")
    parser.add_argument("--grace", type=float, default=120.0, help="seconds the others get after a failure")
    parser.add_argument("--cpu", action="store_true", help="fake CPU devices even where there are GPUs")
    parser.add_argument("--dry-run", action="store_true", help="print what would run, start nothing")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- the command of one process")
    args = parser.parse_args(argv)
    if args.command[:1] == ["--"]:
        args.command = args.command[1:]
    if not args.command:
        parser.error("no command: add -- python -m fp4jax.train --config ... after the options")
    return args


def main(argv=None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    platform, gpus = (None, 0) if args.cpu else gpu_platform()
    workdir = workdir_of(args.command)
    log_dir = args.log_dir or (os.path.join(workdir, "logs") if workdir else "logs")
    processes = plan(args.processes, args.devices_per_process, log_dir, free_port(), platform, gpus)
    where = f"{gpus} {platform} GPUs" if platform else f"{args.devices_per_process} CPU devices each"
    print(f"launch_local: {len(processes)} processes ({where}), logs in {log_dir}", file=sys.stderr)
    if args.dry_run:
        for p in processes:
            env = " ".join(f"{k}={shlex.quote(v)}" for k, v in p.env.items())
            print(f"would run: {env} {shlex.join(args.command)} > {p.log} 2>&1")
        return 0
    return run(processes, args.command, args.grace)


if __name__ == "__main__":
    sys.exit(main())
