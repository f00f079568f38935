"""Run metrics: metrics.jsonl, TensorBoard events, the progress bar, and MFU.

metrics.jsonl holds one JSON object per line. Training lines: step, loss, grad_norm, lr, tokens, sequences,
step_time_s, tokens_per_s, mfu (when the device's peak is known), peak_memory_gb (when the device reports
it), and every diagnostics.every updates the probe's diag/... values and diag_time_s. Evaluation lines:
step, loss (= eval_loss), eval_loss, tokens, sequences, eval_time_s. `step` counts optimizer updates done;
a training line's loss is the loss of the batch that update `step` used.
"""

import json
import os
import statistics
import time

import jax

__all__ = [
    "PEAK_BF16_FLOPS",
    "WARMUP_STEPS",
    "MetricsWriter",
    "StepTimer",
    "median_tokens_per_s",
    "metrics_path",
    "peak_flops_per_device",
    "peak_memory_gb",
    "read_metrics",
    "train_records",
    "truncate_metrics",
]

# Updates 1..WARMUP_STEPS include compilation (the first update and each first evaluation/checkpoint),
# so their tokens/s says nothing about the steady state: they are left out of the median throughput.
WARMUP_STEPS = 3

# Peak dense BF16 FLOP/s per device, matched by substring of jax's device_kind, most specific first.
# H100/H200 SXM: 989.4 TFLOP/s. MI355X: 256 CUs x 4096 BF16 FLOP/clk x 2.4 GHz = 2.52 PFLOP/s (AMD lists
# 2.5 PF dense FP16/BF16); MI350X at 2.2 GHz: 2.3 PF. MI300X/MI325X: 1307 TFLOP/s. B200: 2.25 PFLOP/s.
PEAK_BF16_FLOPS = (
    ("MI355", 2.5e15),
    ("MI350", 2.3e15),
    ("MI325", 1.307e15),
    ("MI300X", 1.307e15),
    ("H200", 989e12),
    ("H100", 989e12),
    ("B200", 2.25e15),
    ("A100", 312e12),
)


def peak_flops_per_device(device_kind: str) -> float | None:
    """Peak dense BF16 FLOP/s of one device of this kind, or None when unknown (CPU: MFU is omitted)."""
    for key, flops in PEAK_BF16_FLOPS:
        if key.lower() in device_kind.lower():
            return flops
    return None


class StepTimer:
    """Wall time of each update: from the moment the host saw the previous update finish (or the loop
    resumed after an evaluation or a save) to the moment it sees this one finish.

    Without dispatching ahead the loop waits for update s's metrics before it dispatches update s + 1,
    so every update is timed over at least its device time plus the host's work in between. With it
    (trainer.py), update s + 1 runs on the device while the host fetches s and logs, so a lap is update
    s + 1's device time, give or take how late the host noticed each end: the laps of a run add up to its
    wall time, and in steady state each is the device time.
    """

    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.last = clock()

    def lap(self) -> float:
        now = self.clock()
        elapsed, self.last = now - self.last, now
        return elapsed

    def exclude(self, seconds: float):
        """Leaves out time the host spent on something else between updates (e.g. the probe)."""
        self.last += seconds

    def restart(self):
        self.last = self.clock()


def peak_memory_gb() -> float | None:
    """The largest peak_bytes_in_use over this process's devices, in GB (None where not reported: CPU)."""
    peaks = []
    for device in jax.local_devices():
        try:
            stats = device.memory_stats()
        except Exception:  # some back ends raise instead of returning None
            stats = None
        if stats and "peak_bytes_in_use" in stats:
            peaks.append(stats["peak_bytes_in_use"])
    return max(peaks) / 1e9 if peaks else None


def metrics_path(workdir: str) -> str:
    """<workdir>/metrics.jsonl, where a run's metric lines live (the writer's and every reader's path)."""
    return os.path.join(workdir, "metrics.jsonl")


class MetricsWriter:
    """Appends metric lines to <workdir>/metrics.jsonl and TensorBoard; only process 0 writes."""

    def __init__(
        self, workdir: str, *, tensorboard: bool = True, resume_step: int = 0, progress_total: int = 0
    ):
        """progress_total > 0: also a tqdm bar (stderr) from resume_step to progress_total updates."""
        self.enabled = jax.process_index() == 0
        self.path = metrics_path(workdir)
        self.tb = self.bar = None
        if not self.enabled:
            return
        truncate_metrics(self.path, resume_step)
        self.file = open(self.path, "a", encoding="utf-8")
        if tensorboard:
            from tensorboardX import SummaryWriter

            self.tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
        if progress_total > 0:
            from tqdm import tqdm

            self.bar = tqdm(
                total=progress_total, initial=resume_step, desc="train", unit="step", dynamic_ncols=True
            )

    def write(self, record: dict):
        if not self.enabled:
            return
        self.file.write(json.dumps(record, sort_keys=True) + "\n")
        self.file.flush()
        evaluation = "eval_loss" in record or "final_eval_loss" in record
        if self.bar is not None and not evaluation:
            self.bar.update(record["step"] - self.bar.n)
            self.bar.set_postfix(loss=f"{record['loss']:.3f}", refresh=False)
        if self.tb is not None:
            prefix = "eval/" if evaluation else "train/"
            for key, value in record.items():
                if key != "step" and isinstance(value, int | float):
                    tag = key if key.startswith("diag/") else prefix + key
                    self.tb.add_scalar(tag, value, record["step"])

    def close(self):
        if not self.enabled:
            return
        self.file.close()
        if self.tb is not None:
            self.tb.close()
        if self.bar is not None:
            self.bar.close()


def truncate_metrics(path: str, last_step: int):
    """Drop lines after `last_step` (written by a run that was interrupted after its last checkpoint).

    A resumed run re-does those steps, so keeping them would list them twice; at last_step 0 the file
    starts empty.
    """
    if not os.path.exists(path):
        return
    with open(path, encoding="utf-8") as f:
        lines = [line for line in f if line.strip() and json.loads(line)["step"] <= last_step]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(lines)


def train_records(records: list[dict]) -> list[dict]:
    """The training lines of a run's metric records (not its evaluation lines)."""
    return [r for r in records if "eval_loss" not in r and "loss" in r]


def read_metrics(workdir: str) -> list[dict]:
    """All records of <workdir>/metrics.jsonl; FileNotFoundError naming the file when the run has none."""
    path = metrics_path(workdir)
    if not os.path.exists(path):
        raise FileNotFoundError(f"{path} does not exist: train into {workdir} first")
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def median_tokens_per_s(records: list[dict]) -> float | None:
    """The run's throughput: the median tokens/s of its training lines after update WARMUP_STEPS; None when
    it logged none. The one rule for summary.json's tokens_per_s_median and the study's throughput."""
    rates = [r["tokens_per_s"] for r in records if r.get("tokens_per_s") and r["step"] > WARMUP_STEPS]
    return statistics.median(rates) if rates else None
