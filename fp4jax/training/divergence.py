"""When a run has diverged: a non-finite loss or gradient norm, or a loss spike.

The run summary (training/summary.py) records it as data, `divergence: {kind, step, value}`, which the
study reads; `describe` is the one line for the user.

Loss spike: with divergence.spike_nats > 0, the mean of the last divergence.window training losses exceeds
the lowest such mean seen so far by more than spike_nats nats. The guard's window and lowest mean travel
in the checkpoint's meta, so a resumed run decides exactly as an uninterrupted one.
"""

import collections
import dataclasses
import math

__all__ = ["KINDS", "LAST_FINITE", "Divergence", "DivergenceGuard", "describe", "non_finite"]

KINDS = ("non_finite_loss", "non_finite_grad_norm", "loss_spike")

LAST_FINITE = 10  # how many (step, loss) pairs the summary reports


def non_finite(record: dict) -> tuple[str, float] | None:
    """(kind, value) for the first non-finite of a metrics line's loss and grad_norm (absent keys are
    skipped), else None: the guard's rule, and the study's when it reads a run's metrics.jsonl."""
    for key, kind in (("loss", "non_finite_loss"), ("grad_norm", "non_finite_grad_norm")):
        if key in record and not math.isfinite(record[key]):
            return kind, record[key]
    return None


@dataclasses.dataclass(frozen=True)
class Divergence:
    kind: str  # one of KINDS
    step: int
    value: float  # the offending loss or grad norm; for a spike, the window's mean loss


class DivergenceGuard:
    """Checks each update's metrics in order; `check` returns a Divergence or None."""

    def __init__(self, spike_nats: float, window: int, saved: dict | None = None):
        self.spike_nats, self.window = float(spike_nats), int(window)
        saved = saved or {}
        self.recent = collections.deque(saved.get("recent", []), maxlen=max(self.window, LAST_FINITE))
        self.best_mean = saved.get("best_mean")

    def check(self, step: int, record: dict) -> Divergence | None:
        bad = non_finite(record)
        if bad is not None:
            return Divergence(bad[0], step, bad[1])
        self.recent.append([step, record["loss"]])
        if self.spike_nats <= 0 or len(self.recent) < self.window:
            return None
        mean = sum(loss for _, loss in list(self.recent)[-self.window :]) / self.window
        if self.best_mean is not None and mean > self.best_mean + self.spike_nats:
            return Divergence("loss_spike", step, mean)
        self.best_mean = mean if self.best_mean is None else min(self.best_mean, mean)
        return None

    def last_finite(self) -> list[list]:
        """[[step, loss], ...]: the last (up to 10) finite training losses, oldest first."""
        return [list(x) for x in list(self.recent)[-LAST_FINITE:]]

    def state(self) -> dict:
        return {"recent": [list(x) for x in self.recent], "best_mean": self.best_mean}


def describe(
    div: Divergence, last_finite: list, resumed_from: int | None, newest_checkpoint: int | None
) -> str:
    """One line saying what is known about a divergence: where, the last finite loss, the restore."""
    if div.kind == "loss_spike":
        what = f"loss spike at step {div.step}: the mean training loss of the last window is {div.value:.4f}"
    else:
        key = "loss" if div.kind == "non_finite_loss" else "gradient norm"
        what = f"non-finite {key} ({div.value}) at step {div.step}"
    last = (
        f"last finite loss {last_finite[-1][1]:.4f} at step {last_finite[-1][0]}"
        if last_finite
        else ("no finite loss in this run yet")
    )
    start = "started from scratch" if resumed_from is None else f"restored from step {resumed_from}"
    kept = (
        "no checkpoint" if newest_checkpoint is None else f"the newest checkpoint is step {newest_checkpoint}"
    )
    return f"{what}; {last}; this invocation {start}; {kept} (only checked states are saved)"
