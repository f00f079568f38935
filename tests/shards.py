"""The suite split into N shards for a machine lent for a fixed time (the GPU lane, docs/testing.md).

`pytest --shard K/N` (conftest.py) keeps the K-th of N shards of whatever was collected; the N shards
together hold every collected test exactly once, and which shard a test lands in depends only on the
collected node ids and the measured seconds file, never on the order of collection or the machine.

How tests are dealt (longest-processing-time first): each unit (one test; or a whole module of TOGETHER,
whose tests build on each other's runs through shared fixtures) costs its seconds in SECONDS_FILE, the
sum of its setup, call and teardown in the last measured GPU run; a test not measured there costs the
mean of the measured ones (1 where nothing is measured, so that without the file every module is dealt
round-robin by node id, about 1/N of each module to each shard). Units are taken most expensive first
(ties by node id) and each goes to the shard with the fewest seconds so far (ties to the lowest), so no
shard exceeds an even share by more than its most expensive unit.

The seconds come from the lane's own logs: `python tests/shards.py seconds --on "DATE, DEVICE, jax V,
COMMIT" LOG... > tests/gpu_lane_seconds.json` reads lines in the form of pytest's `--durations=0` report:
the `.seconds` files that benchmarks/gpu_lane.sh has the lane write as each test ends (conftest.py's
`--seconds-log`, kept by a shard cut short), or a log with that report. A stale file makes the shards
uneven, never wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys

__all__ = ["SECONDS_FILE", "TOGETHER", "load_seconds", "parse_shard", "partition", "seconds_from_logs"]

SECONDS_FILE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "gpu_lane_seconds.json")
# Modules whose tests stay in one shard: test_multiprocess's runs continue each other's checkpoints
# (session and module fixtures), so split across shards each shard would train the chain again.
TOGETHER = ("tests/test_multiprocess.py",)
_DURATION = re.compile(r"^\s*([0-9.]+)s (setup|call|teardown)\s+(\S.*?)\s*$")


def parse_shard(text: str) -> tuple[int, int]:
    """(K, N) from "K/N", 1 <= K <= N; a one-line ValueError otherwise."""
    match = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not match or not 1 <= int(match.group(1)) <= int(match.group(2)):
        raise ValueError(f"--shard {text!r}: write K/N with 1 <= K <= N, e.g. --shard 2/3")
    return int(match.group(1)), int(match.group(2))


def _unit(nodeid: str) -> str:
    module = nodeid.split("::")[0]
    return module if module in TOGETHER else nodeid


def partition(nodeids: list[str], n: int, seconds: dict[str, float] | None = None) -> list[list[str]]:
    """The node ids dealt into n shards (module docstring), each shard's ids in their given order."""
    seconds = seconds or {}
    known = [seconds[i] for i in nodeids if i in seconds]
    default = sum(known) / len(known) if known else 1.0
    cost: dict[str, float] = {}
    for nodeid in nodeids:
        unit = _unit(nodeid)
        cost[unit] = cost.get(unit, 0.0) + seconds.get(nodeid, default)
    load, shard_of = [0.0] * n, {}
    for unit in sorted(cost, key=lambda u: (-cost[u], u)):
        shard = min(range(n), key=lambda s: (load[s], s))
        shard_of[unit] = shard
        load[shard] += cost[unit]
    shards: list[list[str]] = [[] for _ in range(n)]
    for nodeid in nodeids:
        shards[shard_of[_unit(nodeid)]].append(nodeid)
    return shards


def load_seconds(path: str = SECONDS_FILE) -> dict[str, float]:
    """{node id: seconds} of the measured file; {} where there is none."""
    if not os.path.exists(path):
        return {}
    with open(path) as f:
        return {k: float(v) for k, v in json.load(f)["seconds"].items()}


def seconds_from_logs(lines) -> dict[str, float]:
    """{node id: setup + call + teardown seconds} from `--durations=0` report or `--seconds-log` lines."""
    out: dict[str, float] = {}
    for line in lines:
        match = _DURATION.match(line)
        if match:
            out[match.group(3)] = out.get(match.group(3), 0.0) + float(match.group(1))
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python tests/shards.py", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    seconds = sub.add_parser("seconds", help="the seconds file (JSON on stdout) from the lane's logs")
    seconds.add_argument("--on", required=True, help='what was measured: "date, device, jax version, commit"')
    seconds.add_argument("logs", nargs="+", help="the shards' .seconds files (or logs with --durations=0)")
    args = parser.parse_args(argv)
    found: dict[str, float] = {}
    for path in args.logs:
        with open(path, errors="replace") as f:
            found.update(seconds_from_logs(f))
    if not found:
        parser.error("no seconds lines in those files: give the .seconds files benchmarks/gpu_lane.sh writes")
    table = {k: round(v, 2) for k, v in sorted(found.items())}
    json.dump({"measured": args.on, "seconds": table}, sys.stdout, indent=0)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
