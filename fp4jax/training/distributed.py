"""jax.distributed for the trainer: set up from SLURM or JAX_* variables with bounded timeouts, and a lost
process reported in one line.

A lost process (killed, crashed, its host down) leaves the others waiting in a collective that never
ends (NCCL), or failing one with a message that does not say who is gone (gloo, on CPU); jax's own
heartbeat ends them later with a native abort and a page of log lines. So every process of a run keeps
a heartbeat of its own in jax's key-value store (a thread, `Watchdog`): a peer whose heartbeat stops
for FP4JAX_HEARTBEAT_TIMEOUT_S seconds (default 60), or that left the run with an error while this one
still runs after that long, is named in one line, `error: lost process 1 of 2 (...)`, and the process
exits EXIT_LOST_PROCESS (4) at once. When the coordinator (process 0, which runs jax's coordination
service) is the one lost, jax's client aborts the others natively at once, before the store's silence
could be noticed, and jax 0.10 cannot call a Python callback instead (std::bad_cast): `CoordinatorLoss`,
a SIGABRT handler, turns that abort into the same one line and exit 4 (after jax's own lines). jax's
heartbeat is set to twice fp4jax's timeout, a backstop that fires later. Decisions that every process
must take alike (a checkpoint found bad by one process, a full disk on one) are agreed with `agree`.

Timeouts (seconds, from the environment, else DEFAULT_TIMEOUTS_S): FP4JAX_HEARTBEAT_TIMEOUT_S above;
FP4JAX_INIT_TIMEOUT_S, how long a process waits for the others to join at the start;
FP4JAX_SHUTDOWN_TIMEOUT_S, how long a finished process waits for the others at the end. Each is passed
only where the installed jax.distributed.initialize takes it (checked at run time; jax >= 0.10 takes
heartbeat_timeout_seconds, initialization_timeout and shutdown_timeout_seconds).
"""

import contextlib
import ctypes
import functools
import inspect
import itertools
import os
import re
import signal
import socket
import sys
import threading
import time

import jax
import numpy as np

from fp4jax.training.errors import ConfigError

__all__ = [
    "EXIT_LOST_PROCESS",
    "CoordinatorLoss",
    "Watchdog",
    "agree",
    "coordinator_answers",
    "initialize",
    "lost_process_line",
    "lost_process_reported",
    "timeouts",
]

EXIT_LOST_PROCESS = 4
ABORT_PROBE_S = 2.0  # how long an abort handler keeps asking whether the coordinator's port still answers
DEFAULT_TIMEOUTS_S = {"heartbeat": 60, "init": 300, "shutdown": 300}
ENV_VARS = {"heartbeat": "FP4JAX_HEARTBEAT_TIMEOUT_S", "init": "FP4JAX_INIT_TIMEOUT_S"}
ENV_VARS["shutdown"] = "FP4JAX_SHUTDOWN_TIMEOUT_S"
# jax.distributed.initialize's keyword for each timeout.
KEYWORDS = {
    "heartbeat": "heartbeat_timeout_seconds",
    "init": "initialization_timeout",
    "shutdown": "shutdown_timeout_seconds",
}
# What a collective says when the process at its other end is gone (gloo on CPU; NCCL and the gRPC
# transfers on GPUs), as opposed to an error of this process's own (out of memory, a bug).
_PEER_GONE = re.compile(r"Gloo|NCCL|Connection (closed|reset)|UNAVAILABLE|heartbeat", re.IGNORECASE)


def timeouts() -> dict[str, int]:
    """{"heartbeat", "init", "shutdown"}: seconds, from the environment or the defaults; ConfigError (one
    line: the variable, its value, what it takes) for a value that is not a whole number >= 1."""
    out = {}
    for name, default in DEFAULT_TIMEOUTS_S.items():
        var = ENV_VARS[name]
        text = os.environ.get(var, str(default)).strip()
        if not text.isdigit() or int(text) < 1:
            raise ConfigError(
                f"{var}={text!r} is not a whole number of seconds >= 1; set it like {var}={default} "
                "(or unset it for that default)"
            )
        out[name] = int(text)
    return out


def initialize():
    """jax.distributed.initialize() under SLURM with several tasks (jax reads SLURM's environment), or with
    JAX_COORDINATOR_ADDRESS plus JAX_NUM_PROCESSES and JAX_PROCESS_ID; nothing for a single process."""
    kwargs = {}
    if int(os.environ.get("SLURM_NTASKS", "1")) > 1:
        pass  # jax reads SLURM's environment
    elif "JAX_COORDINATOR_ADDRESS" in os.environ:
        count, index = os.environ.get("JAX_NUM_PROCESSES"), os.environ.get("JAX_PROCESS_ID")
        kwargs.update(
            num_processes=None if count is None else int(count),
            process_id=None if index is None else int(index),
        )
    else:
        return
    accepted = inspect.signature(jax.distributed.initialize).parameters
    kwargs.update({KEYWORDS[k]: v for k, v in jax_timeouts().items() if KEYWORDS[k] in accepted})
    with _service_errors_reported():
        jax.distributed.initialize(**kwargs)
    from jax._src import distributed as jax_distributed  # where jax keeps its client

    state = jax_distributed.global_state
    if state.client is not None and jax.process_count() > 1 and hasattr(state.client, "key_value_dir_get"):
        global _watchdog
        index, count = jax.process_index(), jax.process_count()
        _watchdog = Watchdog(state.client, index, count, timeouts()["heartbeat"])
        _watchdog.start()
        if index != 0:
            CoordinatorLoss.install(state.coordinator_address, index, count)


def jax_timeouts() -> dict[str, int]:
    """What jax.distributed is given: fp4jax's timeouts, jax's heartbeat at twice fp4jax's (a backstop)."""
    out = timeouts()
    return out | {"heartbeat": 2 * out["heartbeat"]}


class Watchdog(threading.Thread):
    """Every `timeout_s / 5` seconds: this process's heartbeat counter into the key-value store, and every
    peer's read back. A peer is lost when its counter has not moved for `timeout_s`, or when it left
    with an error (`leave(failed=True)`) and this process still runs `timeout_s` later; a peer that left
    cleanly is not waited for. Lost: one line on stderr, and the process exits EXIT_LOST_PROCESS."""

    PREFIX = "fp4jax_heartbeat/"

    def __init__(self, client, index: int, count: int, timeout_s: float):
        super().__init__(name="fp4jax-watchdog", daemon=True)
        self.client, self.index, self.count, self.timeout_s = client, index, count, timeout_s
        self.stopping = threading.Event()

    def key(self, index: int) -> str:
        return f"{self.PREFIX}{index}"

    def run(self):
        start = time.monotonic()
        seen = {peer: (None, start) for peer in range(self.count) if peer != self.index}
        last_answer, beat = start, 0
        while not self.stopping.wait(self.timeout_s / 5):
            beat, now = beat + 1, time.monotonic()
            try:
                self.client.key_value_set(self.key(self.index), str(beat), allow_overwrite=True)
                values = dict(self.client.key_value_dir_get(self.PREFIX))
            except Exception as exc:  # the store (process 0) does not answer
                if self.index != 0 and now - last_answer > self.timeout_s:
                    self.lost(0, f"the coordinator has not answered for {now - last_answer:.0f} s: {exc}")
                continue
            last_answer = now
            for peer, (value, since) in seen.items():
                new = values.get(self.key(peer))
                if new == "left":
                    continue
                if new != value:
                    seen[peer] = (new, now)
                elif now - since > self.timeout_s:
                    why = "it left with an error" if new == "failed" else "no heartbeat"
                    self.lost(peer, f"{why} for {now - since:.0f} s")

    def lost(self, peer: int, why: str):
        # print, not logging (as _exit_lost): the process ends by os._exit right after.
        print(lost_process_line(peer, self.count, self.index, why), file=sys.stderr, flush=True)
        os._exit(EXIT_LOST_PROCESS)

    def leave(self, failed: bool):
        """This process is done with the run: peers stop waiting for it (or count it lost after
        timeout_s, when it failed)."""
        self.stopping.set()
        try:
            self.client.key_value_set(
                self.key(self.index), "failed" if failed else "left", allow_overwrite=True
            )
        except Exception:  # the store is gone: the peers find out by themselves
            pass


_watchdog: Watchdog | None = None
_agreements = itertools.count()


def agree(value: str) -> list[str]:
    """Every process's `value`, in process order: what a decision that every process must take alike is
    made from (a checkpoint's verdict, a failed save), so that no process goes another way. Every process
    calls it at the same points of the run, in the same order. [value] for a single process. Through
    jax.distributed's key-value store (no device collective: it may come while updates are in flight);
    waits up to FP4JAX_INIT_TIMEOUT_S for a peer (a lost one ends this process through the watchdog)."""
    if jax.process_count() == 1:
        return [value]
    if _watchdog is None:  # jax.distributed set up elsewhere: a collective instead
        return _allgather_strings(value)
    n, client, index = next(_agreements), _watchdog.client, _watchdog.index
    client.key_value_set(f"fp4jax_agree/{n}/{index}", value)
    wait_ms = 1000 * timeouts()["init"]
    return [
        value if i == index else client.blocking_key_value_get(f"fp4jax_agree/{n}/{i}", wait_ms)
        for i in range(_watchdog.count)
    ]


def _allgather_strings(value: str, width: int = 1024) -> list[str]:
    from jax.experimental import multihost_utils

    data = np.zeros(width, np.uint8)
    raw = value.encode()[:width]
    data[: len(raw)] = np.frombuffer(raw, np.uint8)
    rows = np.asarray(multihost_utils.process_allgather(data))
    return [bytes(row).rstrip(b"\0").decode(errors="replace") for row in rows.reshape(-1, width)]


@contextlib.contextmanager
def _service_errors_reported():
    """jax.distributed.initialize with a fatal-error callback of fp4jax's given to jax's client (in place
    of its native abort). jax 0.10 cannot call it (std::bad_cast, then an abort: CoordinatorLoss), but
    with it the abort prints 3 lines instead of a stack trace, and a jax that can call it reports the
    error in one line."""
    from jax._src import distributed as jax_distributed

    module = jax_distributed._jax
    original = getattr(module, "get_distributed_runtime_client", None)
    if original is None or "missed_heartbeat_callback" not in (original.__doc__ or ""):
        yield
        return
    module.get_distributed_runtime_client = functools.partial(
        original, missed_heartbeat_callback=_on_service_error
    )
    try:
        yield
    finally:
        module.get_distributed_runtime_client = original


def _on_service_error(status=None, *args):
    """jax's client saw a fatal error of the distributed service: one line, exit EXIT_LOST_PROCESS."""
    from jax._src import distributed as jax_distributed

    state = jax_distributed.global_state
    index, count = state.process_id, state.num_processes
    if not coordinator_answers(state.coordinator_address):
        _exit_lost(lost_process_line(0, count, index, "its coordination service is gone"))
    _exit_lost(
        f"error: jax's distributed service reported a fatal error ({str(status).splitlines()[0]}); "
        f"process {index} of {count} stops with exit {EXIT_LOST_PROCESS}"
    )


def _exit_lost(line: str):
    # print, not logging: os._exit skips logging's flush at exit, and this line is the user's only clue.
    print(line, file=sys.stderr, flush=True)
    os._exit(EXIT_LOST_PROCESS)


def coordinator_answers(address: str, timeout_s: float = 2.0) -> bool:
    """Whether something accepts a TCP connection at the coordinator's "host:port" (jax's service)."""
    host, _, port = address.rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout_s):
            return True
    except (OSError, ValueError):
        return False


class CoordinatorLoss:
    """On a process other than 0: a lost coordinator (process 0, which runs jax's coordination service)
    reported in one line. jax's client sees the service's socket close at once and aborts this process
    natively (SIGABRT) before the heartbeat could be missed, and jax 0.10 gives Python no way to stop it
    (`_service_errors_reported`). So a C-level SIGABRT handler (ctypes): an abort while the coordinator's
    port refuses connections prints `error: lost process 0 of N (the coordinator, ...)` and exits
    EXIT_LOST_PROCESS; any other abort goes on as it would (glibc aborts again, with the default action,
    once the handler returns). jax's native lines about the lost service come before the line."""

    handler = None  # the ctypes function: it must stay alive while it is the handler

    @classmethod
    def install(cls, address: str, index: int, count: int):
        try:
            libc = ctypes.CDLL(None)
        except OSError:  # no C library to call (not POSIX): jax's abort stays as it is
            return
        kind = ctypes.CFUNCTYPE(None, ctypes.c_int)

        def on_abort(signum):
            # The service's port can still answer for a moment after jax's client has seen it fail, so an
            # answering port is asked again for up to ABORT_PROBE_S before the abort goes on.
            deadline = time.monotonic() + ABORT_PROBE_S
            while coordinator_answers(address, timeout_s=ABORT_PROBE_S):
                if time.monotonic() >= deadline:
                    return
                time.sleep(0.1)
            why = "its coordination service is gone, its port refuses connections"
            _exit_lost(lost_process_line(0, count, index, why))

        cls.handler = kind(on_abort)
        libc.signal.argtypes, libc.signal.restype = [ctypes.c_int, kind], ctypes.c_void_p
        libc.signal(signal.SIGABRT, cls.handler)


def lost_process_line(peer: int, count: int, index: int, why: str) -> str:
    what = "the coordinator, " if peer == 0 else ""
    return (
        f"error: lost process {peer} of {count} ({what}{why}: killed, crashed or its host is down); "
        f"process {index} stops with exit {EXIT_LOST_PROCESS}; run the same command again to continue from "
        "the newest checkpoint"
    )


@contextlib.contextmanager
def lost_process_reported():
    """Around a run: on leaving it, this process tells its peers (`Watchdog.leave`). A collective that
    failed because its peer is gone waits (up to twice the heartbeat timeout) for the watchdog to name
    the lost process and end this one; any other error, or no report in time, propagates as it is."""
    try:
        yield
    except BaseException as exc:
        if _watchdog is not None and isinstance(exc, Exception) and _PEER_GONE.search(str(exc)):
            time.sleep(2 * _watchdog.timeout_s + 10)  # the watchdog ends the process meanwhile
        if _watchdog is not None:
            _watchdog.leave(failed=True)
        raise
    else:
        if _watchdog is not None:
            _watchdog.leave(failed=False)
