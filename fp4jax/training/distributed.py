"""jax.distributed for the trainer: set up from SLURM or JAX_* variables with bounded timeouts, and a lost
process reported in one line.

A lost process (killed, crashed, its host down) leaves the others waiting in a collective that never
ends (NCCL), or failing one with a message that does not say who is gone (gloo, on CPU); jax's own
heartbeat ends them later with a native abort and a page of log lines. So every process of a run keeps
a heartbeat of its own in jax's key-value store (a thread, `Watchdog`): a peer whose heartbeat stops
for FP4JAX_HEARTBEAT_TIMEOUT_S seconds (default 60), or that left the run with an error while this one
still runs after that long, is named in one line, `error: lost process 1 of 2 (...)`, and the process
exits EXIT_LOST_PROCESS (4) at once. When the coordinator (process 0) is the one lost, jax's client
aborts the others natively at once (seen with jax 0.10: its missed_heartbeat_callback cannot be given
from Python, std::bad_cast), before the store's silence would be noticed here. jax's heartbeat is
set to twice that timeout, a backstop that fires later.

Timeouts (seconds, from the environment, else DEFAULT_TIMEOUTS_S): FP4JAX_HEARTBEAT_TIMEOUT_S above;
FP4JAX_INIT_TIMEOUT_S, how long a process waits for the others to join at the start;
FP4JAX_SHUTDOWN_TIMEOUT_S, how long a finished process waits for the others at the end. Each is passed
only where the installed jax.distributed.initialize takes it (checked at run time; jax >= 0.10 takes
heartbeat_timeout_seconds, initialization_timeout and shutdown_timeout_seconds).
"""

import contextlib
import inspect
import os
import re
import sys
import threading
import time

import jax

__all__ = [
    "EXIT_LOST_PROCESS",
    "Watchdog",
    "initialize",
    "lost_process_line",
    "lost_process_reported",
    "timeouts",
]

EXIT_LOST_PROCESS = 4
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
    """{"heartbeat", "init", "shutdown"}: seconds, from the environment or the defaults; one-line
    SystemExit for a value that is not a positive integer."""
    out = {}
    for name, default in DEFAULT_TIMEOUTS_S.items():
        text = os.environ.get(ENV_VARS[name], str(default))
        if not text.isdigit() or int(text) < 1:
            raise SystemExit(f"error: {ENV_VARS[name]}={text!r} must be a positive number of seconds")
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
    jax.distributed.initialize(**kwargs)
    from jax._src import distributed as jax_distributed  # where jax keeps its client

    client = jax_distributed.global_state.client
    if client is not None and jax.process_count() > 1 and hasattr(client, "key_value_dir_get"):
        global _watchdog
        _watchdog = Watchdog(client, jax.process_index(), jax.process_count(), timeouts()["heartbeat"])
        _watchdog.start()


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
