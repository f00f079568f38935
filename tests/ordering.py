"""The order in which the suite's tests are handed to pytest-xdist's workers (conftest.py applies it).

`--dist worksteal` gives worker i the i-th of n equal runs of the collected items (by count, not by time);
a worker that runs out steals the second half of the longest queue left. In file order, the slow modules
(several-process and multi-device training, interpret-mode kernels) sit where they happen to be, so one
worker can be left with a minute-long test while the other has nothing to steal. `deal` puts the slow
modules at the front of the runs, dealt so that each worker starts on about the same seconds of them
(longest first), and fills the rest of every run with the fast tests in file order; stealing then evens
out the end with short tests. A slow module stays in one run (its module fixtures are built once). Only the
order changes: every collected test runs, and nothing in a test depends on another module running first.
"""

from __future__ import annotations

__all__ = ["DEFAULT_LANE", "LONG_LANE", "deal", "lane_seconds", "run_sizes"]

# Seconds of each lane's slowest modules on 2 cores (2026-12-04, at 21b6bfa): the default lane's are
# CPU-seconds per module (user + system, a test's subprocesses included), which on an idle machine are its
# worker seconds and stay near them when others share the machine; the long lane's are `--durations` worker
# seconds (its several-process runs use more cores than their worker). The lanes: tests/long_lane.py.
# Only an ordering: a stale figure makes the suite slower, never different.
DEFAULT_LANE = {
    "test_faults.py": 50,
    "test_fused_quantize.py": 35,
    "test_train.py": 29,
    "test_mx_dot.py": 26,
    "test_diagnostics.py": 24,
    "test_fold.py": 22,
    "test_branch.py": 21,
    "test_llama.py": 21,
    "test_selfcheck.py": 21,
    "test_flax_adapters.py": 20,
    "test_gemm_operands.py": 15,
    "test_formats_train.py": 15,
    "test_quantize.py": 15,
    "test_configs.py": 13,
    "test_readme.py": 10,
    "test_formats_nvfp4_gemm.py": 10,
    "test_evaluation_selection.py": 9,
    "test_instruments.py": 7,
    "test_multidevice.py": 7,
    "test_formats_mxfp6.py": 6,
}
LONG_LANE = {
    "test_multiprocess.py": 228,
    "test_multidevice.py": 56,
    "test_train.py": 49,
    "test_formats_train.py": 43,
    "test_fused_quantize.py": 37,
    "test_ladder.py": 29,
    "test_instruments.py": 28,
    "test_gemm_operands.py": 28,
    "test_bench_train.py": 20,
    "test_selfcheck.py": 18,
}


def lane_seconds(markexpr: str) -> dict[str, float]:
    """The seconds `deal` orders by for pytest's `-m` expression: one lane's, or both summed (`-m ""`)."""
    lanes = {"not slow": DEFAULT_LANE, "slow": LONG_LANE}
    if markexpr.strip() in lanes:
        return lanes[markexpr.strip()]
    return {m: DEFAULT_LANE.get(m, 0) + LONG_LANE.get(m, 0) for m in {**DEFAULT_LANE, **LONG_LANE}}


def run_sizes(n: int, workers: int) -> list[int]:
    """How many of n items worksteal's first distribution sends each of `workers` idle workers."""
    sizes = []
    for i in range(workers):
        sizes.append(n // (workers - i))
        n -= sizes[-1]
    return sizes


def _pick_run(runs: list[list[int]], sizes: list[int], load: list[float], count: int) -> int:
    """The run with the fewest seconds that has room for `count` more items; where none has, the one with
    the most room (the runs after it then start a little later)."""
    fits = [r for r in range(len(runs)) if len(runs[r]) + count <= sizes[r]]
    if fits:
        return min(fits, key=lambda r: (load[r], r))
    return max(range(len(runs)), key=lambda r: sizes[r] - len(runs[r]))


def deal(modules: list[str], workers: int, seconds: dict[str, float] = DEFAULT_LANE) -> list[int]:
    """A new order of the items whose modules are `modules` (one name per item, in collection order), as
    indices into it: `workers` runs of run_sizes' lengths, each starting with its share of the slow
    modules (longest first, each to the run with the fewest seconds so far that has room for it), then
    fast items in collection order."""
    by_module: dict[str, list[int]] = {}
    for i, module in enumerate(modules):
        by_module.setdefault(module, []).append(i)
    sizes = run_sizes(len(modules), workers)
    runs: list[list[int]] = [[] for _ in sizes]
    load = [0.0] * len(sizes)
    slow = sorted((m for m in by_module if m in seconds), key=lambda m: (-seconds[m], m))
    for module in slow:
        items = by_module[module]
        r = _pick_run(runs, sizes, load, len(items))
        runs[r] += items
        load[r] += seconds[module]
    fast = [i for m, items in by_module.items() if m not in seconds for i in items]
    for r, run in enumerate(runs):
        take = max(0, sizes[r] - len(run))
        run += fast[:take]
        fast = fast[take:]
    runs[-1] += fast
    return [i for run in runs for i in run]
