"""What every benchmark here shares: how a jitted function is timed, how a table is headed and written.

Timing rule (docs/performance.md): warm up first (compilation and autotuning stay out), cycle over
several input sets so one buffer does not sit in L2, and report a median. Two clocks:

- `median_seconds`: each call from dispatch to `block_until_ready`. Per-call synchronisation is in every
  figure: for kernels of a few hundred microseconds it is a visible share.
- `amortized_seconds`: `calls` back-to-back dispatches, one wait at the end, divided by `calls`, median
  over `repeats`. Dispatch is asynchronous, so while the device is the bottleneck this is the device time
  per call (the GPU queue stays full); use it for kernels shorter than a few milliseconds.
"""

from __future__ import annotations

import datetime
import json
import os
import statistics
import time
from collections.abc import Callable, Sequence

import jax


def median_seconds(fn: Callable, arg_sets: Sequence[tuple], iters: int, warmup: int = 2) -> float:
    """Median wall time of `fn(*args)` over `iters` calls, cycling over `arg_sets`, after `warmup` rounds."""
    for _ in range(warmup):
        for args in arg_sets:
            jax.block_until_ready(fn(*args))
    times = []
    for i in range(iters):
        args = arg_sets[i % len(arg_sets)]
        start = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def amortized_seconds(fn: Callable, arg_sets: Sequence[tuple], calls: int = 20, repeats: int = 5) -> float:
    """Median over `repeats` of (wall time of `calls` back-to-back calls, one sync at the end) / calls."""
    for args in arg_sets:  # warm-up: compilation and autotuning stay out
        jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        results = [fn(*arg_sets[i % len(arg_sets)]) for i in range(calls)]
        jax.block_until_ready(results)
        times.append((time.perf_counter() - start) / calls)
    return statistics.median(times)


def kernel_count(fn: Callable, *args) -> int:
    """How many device kernels the compiled program launches: top-level fusions, custom calls (GEMMs,
    Triton), copies, transposes, reduces and dots of its entry computation (a proxy for memory passes)."""
    text = jax.jit(fn).lower(*args).compile().as_text()
    entry = text[text.index("ENTRY") :]
    entry = entry[: entry.index("\n}")]
    kinds = (" fusion(", " custom-call(", " copy(", " transpose(", " reduce(", " dot(")
    return sum(any(k in line for k in kinds) for line in entry.splitlines())


def heading(what: str, devices: str | None = None) -> str:
    """'### <what> on <device> (<date>, jax <version>)': every table names its device, date and jax."""
    device = devices or jax.devices()[0].device_kind
    return f"### {what} on {device} ({datetime.date.today().isoformat()}, jax {jax.__version__})"


def emit(table: str, out: str = "") -> None:
    """Prints the markdown table and, with `out`, writes it there too."""
    if out:
        with open(out, "w", encoding="utf-8") as f:
            f.write(table)
    print(table, flush=True)


class JsonRows:
    """The rows so far as one JSON document at `path` (none: nothing written), rewritten whole after every
    row through a temporary file and a rename, so the file is never half-written."""

    def __init__(self, path: str, command: str):
        self.path = path
        self.doc = {
            "device": f"{jax.device_count()} x {jax.devices()[0].device_kind}",
            "date": datetime.date.today().isoformat(),
            "jax": jax.__version__,
            "command": command,
            "rows": [],
        }

    def add(self, row: dict) -> None:
        self.doc["rows"].append(row)
        if not self.path:
            return
        tmp = f"{self.path}.tmp"
        with open(tmp, "w", encoding="utf-8") as f:
            json.dump(self.doc, f, indent=1)
        os.replace(tmp, self.path)
