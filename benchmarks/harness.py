"""What every benchmark here shares: how a jitted function is timed, how a table is headed and written.

Timing rule (docs/performance.md): warm up first (compilation and autotuning stay out), then time each
call from dispatch to `block_until_ready`, cycling over several input sets so one buffer does not sit in
L2, and report the median. Per-call synchronisation is included in every figure: for kernels of a few
hundred microseconds it is a visible share (compare against the plain copy each table carries).
"""

from __future__ import annotations

import datetime
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
