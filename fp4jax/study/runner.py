"""Runs a study's grid (rung x peak LR x seed) with `python -m fp4jax.train`, several at once, one per GPU.

Invariants:
- each run trains in its own directory (runs.py's layout) and logs to <run dir>/train.log;
- a run whose summary has a final status is never started again; any other resumes from its checkpoints;
- every run that ends has a summary.json: the trainer's, or one the ladder writes (status "failed" for a
  crash or a timeout, "diverged" for exit code 3) when the trainer wrote none during this attempt;
- <run dir>/ladder_run.json counts the attempts and keeps each one's command, exit code and wall time.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import re
import signal
import subprocess
import sys
import time

from fp4jax import logs
from fp4jax.study import runs

__all__ = [
    "POLL_S",
    "TERM_GRACE_S",
    "Job",
    "RunSpec",
    "Rung",
    "MEM_FRACTION",
    "MEM_FRACTION_ENV",
    "accelerator_kind",
    "child_env",
    "config_infos",
    "default_gpus",
    "derive",
    "describe",
    "device_env",
    "finish",
    "load_config",
    "plan",
    "poll",
    "progress_line",
    "record_attempt",
    "run_grid",
    "slot_sharing",
    "start",
    "stop_all",
]

MEM_FRACTION_ENV = "XLA_PYTHON_CLIENT_MEM_FRACTION"  # the share of a GPU's memory jax preallocates
MEM_FRACTION = 0.9  # split between the runs that share a GPU (jax's default 0.75 is for one process)
TERM_GRACE_S = 180  # after SIGTERM a run saves a checkpoint; then it is killed
POLL_S = 0.5


@dataclasses.dataclass(frozen=True)
class Rung:
    """A config file under a name (the file's stem unless given), with overrides of its own and, when set,
    its own seeds (instead of the ladder's)."""

    name: str
    config: str
    overrides: tuple[str, ...] = ()
    seeds: tuple[int, ...] | None = None


@dataclasses.dataclass(frozen=True)
class RunSpec:
    rung: Rung
    seed: int
    lr: float | None = None

    @property
    def label(self) -> str:
        lr = "" if self.lr is None else f"/lr{self.lr:g}"
        return f"{self.rung.name}{lr}/seed{self.seed}"

    def directory(self, root: str) -> str:
        return os.path.join(root, *self.label.split("/"))

    def config_args(self, overrides: list[str]) -> list[str]:
        """Ladder-wide overrides, then the rung's, then the seed and LR (the last of a key wins)."""
        args = [*overrides, *self.rung.overrides, f"--config.seed={self.seed}"]
        return args + ([] if self.lr is None else [f"--config.optimizer.peak_lr={self.lr!r}"])

    def argv(self, root: str, overrides: list[str]) -> list[str]:
        """The trainer's command line."""
        cmd = [sys.executable, "-m", "fp4jax.train", "--config", self.rung.config]
        return cmd + ["--workdir", self.directory(root), *self.config_args(overrides)]


def plan(rungs: list[Rung], seeds: list[int], lrs: list[float] | None) -> list[RunSpec]:
    """The grid, seed-major (every rung's first seed comes before any second seed), rungs in given order;
    a rung with seeds of its own runs those."""
    all_seeds = sorted({*seeds, *(s for r in rungs for s in r.seeds or ())})
    return [
        RunSpec(r, s, lr)
        for s in all_seeds
        for lr in (lrs or [None])
        for r in rungs
        if s in (seeds if r.seeds is None else r.seeds)
    ]


# ---------------------------------------------------------------------------------------------- devices


def accelerator_kind() -> str | None:
    """ "rocm", "cuda" or None (CPU: runs are not pinned), from the device files the drivers create."""
    if os.environ.get("JAX_PLATFORMS", "").strip() == "cpu":
        return None
    if os.path.exists("/dev/kfd"):
        return "rocm"
    return "cuda" if os.path.exists("/dev/nvidia0") or os.path.exists("/dev/nvidiactl") else None


def default_gpus(count: int) -> list[str]:
    """The first `count` GPU ids the ladder may use: those already made visible to it, else 0..count-1."""
    for var in ("CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES"):
        if os.environ.get(var):
            return os.environ[var].split(",")[:count]
    return [str(i) for i in range(count)]


def device_env(gpus: list[str], kind: str | None, env: dict[str, str]) -> dict[str, str]:
    """`env` with the run pinned to `gpus` through every platform's visible-devices variable.

    CUDA reads CUDA_VISIBLE_DEVICES (physical ids). ROCm filters by ROCR_VISIBLE_DEVICES first and then reads
    HIP_VISIBLE_DEVICES / CUDA_VISIBLE_DEVICES as indices into what is left, so there those two count 0..n-1.
    """
    if kind is None or not gpus:
        return dict(env)
    physical, local = ",".join(gpus), ",".join(str(i) for i in range(len(gpus)))
    return dict(
        env,
        CUDA_VISIBLE_DEVICES=local if kind == "rocm" else physical,
        ROCR_VISIBLE_DEVICES=physical,
        HIP_VISIBLE_DEVICES=local if kind == "rocm" else physical,
    )


def child_env(gpus: list[str], kind: str | None, env: dict[str, str], runs_per_gpu: int) -> dict[str, str]:
    """A run's environment: `env` pinned to `gpus` (device_env) and, where `runs_per_gpu` > 1 runs share a
    GPU, XLA_PYTHON_CLIENT_MEM_FRACTION = MEM_FRACTION / runs_per_gpu, so that each preallocates its share
    instead of 75 % of the device and the second one fits; a value the caller set is kept. On CPU (kind
    None) nothing is pinned or preallocated."""
    out = device_env(gpus, kind, env)
    if kind is not None and runs_per_gpu > 1 and MEM_FRACTION_ENV not in out:
        out[MEM_FRACTION_ENV] = f"{MEM_FRACTION / runs_per_gpu:.3g}"
    return out


# ------------------------------------------------------------------------------------------------ a run


@dataclasses.dataclass
class Job:
    """One attempt of a run in flight."""

    spec: RunSpec
    run_dir: str
    proc: subprocess.Popen
    log_file: object
    summary_mtime: float | None
    started: float
    gpus: list[str]
    timeout_s: float | None
    runs_per_gpu: int = 1  # the runs this call lets share the job's devices (recorded, so wall times compare)
    terminated_at: float | None = None
    timed_out: bool = False


def _mtime(path: str) -> float | None:
    return os.path.getmtime(path) if os.path.exists(path) else None


def start(
    spec: RunSpec, root: str, overrides: list[str], gpus, kind, timeout_s, env=None, runs_per_gpu: int = 1
) -> Job:
    """Launches the trainer for `spec` in its own session (so the ladder decides which signals it gets),
    in `env` (default: this process's environment) pinned to `gpus` with its share of the GPU's memory
    (child_env); `runs_per_gpu` (slot_sharing) is recorded with the attempt."""
    run_dir = spec.directory(root)
    os.makedirs(run_dir, exist_ok=True)
    cmd = spec.argv(root, overrides)
    log_path = os.path.join(run_dir, "train.log")
    log = open(log_path, "a", encoding="utf-8")
    stamp = datetime.datetime.now().isoformat(timespec="seconds")
    log.write(f"=== ladder {stamp} gpus={','.join(gpus) or '-'}: {' '.join(cmd)}\n")
    log.flush()
    # The summary's mtime before the launch: a trainer that ends before Popen returns control here (a
    # fast one on a loaded machine) has written its summary already, which must count as fresh.
    summary_before = _mtime(runs.summary_path(run_dir))
    proc = subprocess.Popen(
        cmd,
        stdout=log,
        stderr=subprocess.STDOUT,
        env=child_env(gpus, kind, dict(os.environ) if env is None else env, runs_per_gpu),
        start_new_session=True,
    )
    return Job(
        spec,
        run_dir,
        proc,
        log,
        summary_before,
        time.monotonic(),
        gpus,
        timeout_s,
        runs_per_gpu,
    )


def poll(job: Job) -> int | None:
    """The exit code once the job has ended, else None; past its timeout it gets SIGTERM, then SIGKILL."""
    code = job.proc.poll()
    if code is not None:
        return code
    now = time.monotonic()
    if job.timeout_s and job.terminated_at is None and now - job.started > job.timeout_s:
        job.timed_out, job.terminated_at = True, now
        job.proc.send_signal(signal.SIGTERM)
    elif job.terminated_at is not None and now - job.terminated_at > TERM_GRACE_S:
        job.proc.kill()
    return None


def finish(job: Job, code: int, config_info: dict) -> dict:
    """Closes the attempt: makes sure the run has its summary, records the attempt; returns the summary."""
    job.log_file.close()
    wall = time.monotonic() - job.started
    path = runs.summary_path(job.run_dir)
    fresh = _mtime(path) not in (None, job.summary_mtime)
    summary = runs.read_json(path) if fresh else None
    if job.timed_out:
        failure = f"timeout after {job.timeout_s / 60:g} min"
    else:
        failure = None if code in (0, runs.DIVERGED_EXIT) else _exit_failure(job, code)
    if summary is None:
        failure = failure or ("exit code 0 without summary.json" if code == 0 else None)
        summary = derive(job, code, failure, config_info, wall)
        runs.write_json(path, summary)
    elif job.timed_out or code == runs.DIVERGED_EXIT:
        status = "failed" if job.timed_out else "diverged"
        summary = dict(summary, status=status, failure=failure, exit_code=code)
        runs.write_json(path, summary)
    record_attempt(job, code, wall, summary)
    return summary


_ERROR_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception)\b[^:\s]*: ")
_ERROR_CHARS = 300  # of the error line kept in the failure


def _exit_failure(job: Job, code: int) -> str:
    """Why a run's process failed: its exit code, the last Python error line of its train.log, and the
    likely fix where the error is the GPU's memory and other runs shared the GPU."""
    line = _last_error_line(os.path.join(job.run_dir, "train.log"))
    failure = f"exit code {code}" + (f": {line}" if line else "")
    if line and "RESOURCE_EXHAUSTED" in line and job.runs_per_gpu > 1:
        failure += f" ({job.runs_per_gpu} runs shared the GPU: run fewer at once, e.g. --parallel 1)"
    return failure


def _last_error_line(log_path: str) -> str | None:
    """The last line of the log's end that reads like a Python exception ("ValueError: ..."), cut to
    _ERROR_CHARS; None without one."""
    lines = (ln.strip() for ln in reversed(logs.log_tail(log_path)))
    line = next((ln for ln in lines if _ERROR_LINE.match(ln)), None)
    return None if line is None else line[:_ERROR_CHARS]


def derive(job: Job, code: int, failure: str | None, config_info: dict, wall: float) -> dict:
    summary = runs.derive_summary(
        runs.read_records(job.run_dir),
        exit_code=code,
        failure=failure,
        target=config_info.get("target_eval_loss"),
        recipe=config_info.get("recipe"),
        seed=job.spec.seed,
    )
    return dict(summary, wall_time_s=wall)


def record_attempt(job: Job, code: int, wall: float, summary: dict) -> None:
    path = os.path.join(job.run_dir, runs.RECORD_FILE)
    record = runs.read_json(path) or {"rung": job.spec.rung.name, "attempts": 0, "history": []}
    record.update(seed=job.spec.seed, lr=job.spec.lr, config=job.spec.rung.config, command=job.proc.args)
    record["attempts"] += 1
    record["history"].append(
        {
            "exit_code": code,
            "wall_time_s": wall,
            "gpus": job.gpus,
            "runs_per_gpu": job.runs_per_gpu,
            "status": runs.status_of(summary),
        }
    )
    runs.write_json(path, record)


# ------------------------------------------------------------------------------------------- the grid


def load_config(config: str, overrides: list[str]):
    """The run's config as the trainer will see it (ml_collections' config_flags on the same arguments):
    one-line ValueError for a missing file or a bad override, before any run starts."""
    from absl import flags
    from ml_collections import config_flags

    if not os.path.isfile(config):
        raise ValueError(f"config file {config} does not exist; the configs are in configs/*.py")
    root = os.path.dirname(os.path.dirname(os.path.abspath(config)))
    if root not in sys.path:  # configs written as `from configs import base` (as the trainer allows)
        sys.path.insert(0, root)
    fv = flags.FlagValues()
    argv = ["ladder", f"--config={config}", *overrides]
    holder = config_flags.DEFINE_config_file("config", None, "", flag_values=fv, sys_argv=argv)
    try:
        fv(argv)
    except (AttributeError, KeyError) as exc:  # config_flags' way of saying "no such key"
        key = str(exc.args[0] if exc.args else exc).strip("\"'")
        raise ValueError(
            f"unknown config key {key!r} in the overrides of {config}: see configs/base.py"
        ) from None
    except (flags.Error, TypeError, ValueError) as exc:
        raise ValueError(f"{config} with {' '.join(overrides)}: {str(exc).splitlines()[0]}") from None
    return holder.value


def config_infos(specs: list[RunSpec], overrides: list[str]) -> dict[RunSpec, dict]:
    """target_eval_loss and recipe of each run, read from its config (which also checks every override)."""
    infos = {}
    for spec in specs:
        c = load_config(spec.rung.config, spec.config_args(overrides))
        infos[spec] = {"target_eval_loss": c.get("target_eval_loss"), "recipe": c.get("recipe")}
    return infos


def describe(summary: dict) -> str:
    """One phrase for a run's outcome: reached / diverged @ step N / not reached / failed (why)."""
    status = runs.status_of(summary)
    tokens = lambda key: "?" if summary.get(key) is None else f"{summary[key]:,}"
    if status == "reached":
        return f"reached the target at {tokens('tokens_to_target')} tokens"
    if status == "diverged":
        return f"diverged @ step {summary.get('diverged_step')} ({summary.get('divergence_reason')})"
    if status == "not_reached":
        return f"not reached within budget ({tokens('tokens')} tokens)"
    if status == "failed":
        return f"failed ({summary.get('failure')})"
    return str(status)


def run_grid(
    specs: list[RunSpec],
    root: str,
    overrides: list[str],
    *,
    parallel: int = 1,
    gpus: list[str] | None = None,
    gpus_per_run: int = 1,
    timeout_min: float | None = None,
    retry_failed: bool = False,
    log=print,
) -> dict[str, dict]:
    """Runs every unfinished spec, `parallel` at a time; returns {label: summary} of the runs done now.
    `retry_failed` first reopens the runs recorded as failed (runs.reopen_failed), so they run again.

    With an accelerator and parallel > 1, pool slot i gets gpus[i * gpus_per_run : (i + 1) * gpus_per_run];
    one run at a time sees every device the ladder sees. On CPU runs are not pinned.
    """
    infos = config_infos(specs, overrides)
    todo = []
    for s in specs:
        failed = runs.reopen_failed(s.directory(root)) if retry_failed else None
        if failed is not None:
            log(f"ladder: {s.label}: failed before ({failed.get('failure')}), to run again")
        if runs.is_finished(s.directory(root)):
            log(f"ladder: {s.label}: finished before ({describe(_summary(s, root))}), not rerun")
        else:
            todo.append(s)
    kind = accelerator_kind()
    slots = _slots(parallel, gpus, gpus_per_run, kind)
    timeout_s = timeout_min * 60 if timeout_min else None
    sharing = slot_sharing(slots)
    running: dict[int, Job] = {}
    done: dict[str, dict] = {}
    try:
        while todo or running:
            for slot in [i for i in range(len(slots)) if i not in running][: len(todo)]:
                spec = todo.pop(0)
                running[slot] = start(
                    spec, root, overrides, slots[slot], kind, timeout_s, runs_per_gpu=sharing[slot]
                )
                where = f" on GPU {','.join(slots[slot])}" if slots[slot] else ""
                log(f"ladder: start {spec.label}{where}")
            for slot, job in list(running.items()):
                code = poll(job)
                if code is not None:
                    del running[slot]
                    done[job.spec.label] = finish(job, code, infos[job.spec])
                    total = len(done) + len(todo) + len(running)
                    log(f"ladder: [{len(done)}/{total}] {progress_line(job, code, done[job.spec.label])}")
            time.sleep(POLL_S if running else 0)
    except KeyboardInterrupt:
        stop_all(running, log)
        raise
    return done


def _summary(spec: RunSpec, root: str) -> dict:
    return runs.read_json(runs.summary_path(spec.directory(root)))


def progress_line(job: Job, code: int, summary: dict) -> str:
    minutes = (time.monotonic() - job.started) / 60
    log = os.path.join(job.run_dir, "train.log")
    return f"{job.spec.label}: {describe(summary)}; exit {code}, {minutes:.1f} min; log {log}"


def slot_sharing(slots: list[list[str]]) -> list[int]:
    """Per slot, how many slots may run on one of its devices at once: the slots naming one of its GPUs
    (`--gpus 0,0` gives 2 each), or every slot where runs are not pinned (CPU). A run's wall time depends
    on it, so measured wall times are compared only between attempts with the same value."""
    if not any(slots):
        return [len(slots)] * len(slots)
    return [max(sum(gpu in other for other in slots) for gpu in slot) if slot else 1 for slot in slots]


def _slots(parallel: int, gpus, gpus_per_run: int, kind) -> list[list[str]]:
    if parallel < 1 or gpus_per_run < 1:
        raise ValueError(f"--parallel {parallel} and --gpus-per-run {gpus_per_run} must be >= 1")
    if kind is None or (parallel == 1 and not gpus):
        return [[] for _ in range(parallel)]
    ids = gpus or default_gpus(parallel * gpus_per_run)
    if len(ids) < parallel * gpus_per_run:
        raise ValueError(
            f"--parallel {parallel} x --gpus-per-run {gpus_per_run} needs {parallel * gpus_per_run} GPUs, "
            f"have {len(ids)} ({','.join(ids)}); lower --parallel or pass --gpus"
        )
    return [ids[i * gpus_per_run : (i + 1) * gpus_per_run] for i in range(parallel)]


def stop_all(running: dict[int, Job], log) -> None:
    """Ctrl-C / SIGTERM of the ladder: each run gets SIGTERM (it saves and exits 0, resumable), then waits."""
    for job in running.values():
        if job.proc.poll() is None:
            job.proc.send_signal(signal.SIGTERM)
    for job in running.values():
        try:
            job.proc.wait(timeout=TERM_GRACE_S)
        except subprocess.TimeoutExpired:
            job.proc.kill()
        job.log_file.close()
        log(f"ladder: {job.spec.label} stopped (exit {job.proc.returncode}); the next invocation resumes it")
