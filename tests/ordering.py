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

import os

__all__ = ["SECONDS_FILE", "SLOW_MODULE_SECONDS", "deal", "module_seconds", "run_sizes"]

# The CPU lanes' measured seconds per test, in tests/shards.py's format ({"measured": ..., "seconds":
# {node id: setup + call + teardown}}), written from a run with `--durations=0` (docs/testing.md):
#   python -m pytest -m "" --durations=0 > cpu.log; python tests/shards.py seconds --on "..." cpu.log
# Only an ordering: a stale or missing file makes the suite slower, never different.
SECONDS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "cpu_lane_seconds.json")
# A module whose collected tests measured this many seconds together starts first (dealt longest first);
# the rest fill the runs in collection order.
SLOW_MODULE_SECONDS = 5.0


def module_seconds(nodeids: list[str], seconds: dict[str, float]) -> dict[str, float]:
    """{module file name: its collected tests' measured seconds} for the modules at or above
    SLOW_MODULE_SECONDS: what `deal` orders by. Only the collected tests count, so each lane (`-m`) and
    each shard weighs its own share of a module; a test not measured counts nothing."""
    total: dict[str, float] = {}
    for nodeid in nodeids:
        module = os.path.basename(nodeid.split("::")[0])
        total[module] = total.get(module, 0.0) + seconds.get(nodeid, 0.0)
    return {m: t for m, t in total.items() if t >= SLOW_MODULE_SECONDS}


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


def deal(modules: list[str], workers: int, seconds: dict[str, float]) -> list[int]:
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
