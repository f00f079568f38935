"""Stopping on request: SIGTERM (preemption, SLURM's time limit) and SIGINT (Ctrl-C) alike.

The first signal sets a flag: the loop finishes the update in flight, saves it, writes the summary and
the command exits 0. A second one raises KeyboardInterrupt at once (the command exits 130, nothing saved).

Several processes may see the signal at different updates, so the flag is agreed on by an all-gather
(which waits for the update in flight) every SYNC_EVERY updates, and every process saves the same step.
orbax's `reached_preemption` covers only SIGTERM through jax's preemption service; this covers both.
"""

import signal
import sys

import jax
import numpy as np
from jax.experimental import multihost_utils

__all__ = ["SIGNALS", "StopSignals"]

SIGNALS = (signal.SIGTERM, signal.SIGINT)


class StopSignals:
    SYNC_EVERY = 5

    def __init__(self):
        self.requested = None  # the name of the first signal received
        self._previous = {}

    def __enter__(self):
        for sig in SIGNALS:
            try:
                self._previous[sig] = signal.signal(sig, self.handle)
            except ValueError:  # not the main thread: no signal handling
                pass
        return self

    def handle(self, signum, frame):
        name = signal.Signals(signum).name
        if self.requested:
            raise KeyboardInterrupt(f"{name} after {self.requested}")
        self.requested = name
        # print, not logging: logging's handlers take locks that a signal handler may interrupt mid-write.
        print(
            f"{name}: stopping after this update with a checkpoint (send it again to stop at once, unsaved)",
            file=sys.stderr,
            flush=True,
        )

    def __exit__(self, *exc):
        for sig, previous in self._previous.items():
            signal.signal(sig, previous)

    def agreed(self, step: int) -> bool:
        """True when this run must stop after `step` (the same answer on every process)."""
        if jax.process_count() == 1:
            return self.requested is not None
        if step % self.SYNC_EVERY:
            return False
        return bool(multihost_utils.process_allgather(np.int32(self.requested is not None)).any())
