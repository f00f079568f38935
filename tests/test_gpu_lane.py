"""The GPU lane's shards (tests/shards.py, `pytest --shard K/N`, benchmarks/gpu_lane.sh): together they run
every collected test exactly once, and they are balanced by the measured seconds."""

import json
import os
import subprocess
import sys

import pytest
import shards
from long_lane import SLOW

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
IDS = (
    [f"tests/test_a.py::test_{i}" for i in range(7)]
    + [f"tests/test_multiprocess.py::test_{i}" for i in range(5)]
    + [f"tests/test_b.py::test_x[{p}]" for p in ("p0", "p1", "p2")]
)


def _assert_partition(parts, ids):
    together = [i for part in parts for i in part]
    assert sorted(together) == sorted(ids) and len(together) == len(set(together))


@pytest.mark.parametrize("n", [1, 2, 3, 5, 20])
def test_every_test_in_exactly_one_shard_with_or_without_seconds(n):
    seconds = {i: float(len(i) % 7) for i in IDS[::2]}  # some measured (zeros too), others not
    for measured in ({}, seconds):
        parts = shards.partition(IDS, n, measured)
        assert len(parts) == n
        _assert_partition(parts, IDS)
        for part in parts:  # each shard keeps the collection order
            assert part == [i for i in IDS if i in part]


def test_shards_depend_on_the_ids_not_their_order():
    seconds = {IDS[0]: 30.0, IDS[9]: 12.0}
    assert shards.partition(IDS[::-1], 3, seconds) == [p[::-1] for p in shards.partition(IDS, 3, seconds)]


def test_a_module_that_stays_together_is_in_one_shard():
    for n in (2, 3, 4):
        holding = [p for p in shards.partition(IDS, n) if any("test_multiprocess" in i for i in p)]
        assert len(holding) == 1 and sum("test_multiprocess" in i for i in holding[0]) == 5


def test_without_seconds_each_module_is_dealt_round_robin():
    ids = [f"tests/test_{m}.py::test_{i:02d}" for m in "abc" for i in range(12)]
    for part in shards.partition(ids, 4):
        assert [sum(f"test_{m}.py" in i for i in part) for m in "abc"] == [3, 3, 3]


def test_measured_seconds_balance_the_shards():
    """Longest first to the emptiest shard: no shard exceeds an even share by more than one unit's cost;
    a test not measured costs the mean of the measured ones."""
    ids = [f"tests/test_m.py::test_{i:02d}" for i in range(40)]
    seconds = {i: float((k * 37) % 23 + 1) for k, i in enumerate(ids[:30])}
    mean = sum(seconds.values()) / len(seconds)
    cost = lambda i: seconds.get(i, mean)
    loads = [sum(map(cost, part)) for part in shards.partition(ids, 3, seconds)]
    assert max(loads) - sum(loads) / 3 <= max(map(cost, ids)) + 1e-9, loads
    one_heavy = {i: 100.0 if i == ids[0] else 1.0 for i in ids}
    assert shards.partition(ids, 2, one_heavy)[0] == [ids[0]]  # it alone outweighs the other 39


def test_bad_shard_arguments_are_one_line_errors():
    assert shards.parse_shard("2/3") == (2, 3) and shards.parse_shard(" 1 / 1 ") == (1, 1)
    for bad in ("0/3", "4/3", "3", "a/b", "1/0"):
        with pytest.raises(ValueError, match="write K/N with 1 <= K <= N"):
            shards.parse_shard(bad)


def test_the_seconds_file_is_made_from_the_lanes_durations(tmp_path):
    log = tmp_path / "shard.log"
    log.write_text(
        "============ slowest durations ============\n"
        "45.10s call     tests/test_f.py::test_compiled[none--1-mxfp6]\n"
        "3.00s setup    tests/test_f.py::test_compiled[none--1-mxfp6]\n"
        "0.20s teardown tests/test_g.py::test_y\n"
        "(1200 durations < 0.05s hidden.  Use -vv to show these durations.)\n"
        "PASSED tests/test_g.py::test_y\n"
    )
    cmd = [sys.executable, os.path.join(ROOT, "tests", "shards.py"), "seconds", "--on", "a day, a GPU"]
    out = subprocess.run([*cmd, str(log)], capture_output=True, text=True, check=True).stdout
    table = json.loads(out)
    assert table == {
        "measured": "a day, a GPU",
        "seconds": {"tests/test_f.py::test_compiled[none--1-mxfp6]": 48.1, "tests/test_g.py::test_y": 0.2},
    }
    path = tmp_path / "seconds.json"
    path.write_text(out)
    assert shards.load_seconds(str(path)) == table["seconds"]
    assert shards.load_seconds(str(tmp_path / "none.json")) == {}


@SLOW
def test_the_seconds_log_holds_each_phase_once_as_it_ends(tmp_path):
    """--seconds-log under pytest-xdist: one line per phase of each test, written by the main process
    alone (not again by the worker), in the lines `shards.py seconds` reads."""
    ids = [
        "tests/test_gpu_lane.py::test_bad_shard_arguments_are_one_line_errors",
        "tests/test_gpu_lane.py::test_shards_depend_on_the_ids_not_their_order",
    ]
    path = tmp_path / "shard.seconds"
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-o", "addopts=", "-n", "2"]
    done = subprocess.run(
        [*cmd, "--seconds-log", str(path), *ids], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    lines = path.read_text().splitlines()
    assert sorted(line.split(" ", 1)[1] for line in lines) == sorted(
        f"{phase} {i}" for i in ids for phase in ("setup", "call", "teardown")
    )
    assert set(shards.seconds_from_logs(lines)) == set(ids)


def _collect(*args) -> list[str]:
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "", "-p", "no:cacheprovider"]
    result = subprocess.run(
        [*cmd, "-o", "addopts=", *args, "tests"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    return [line for line in result.stdout.splitlines() if "::" in line]


@SLOW
def test_the_shards_partition_the_collected_suite():
    """The whole suite as collected (both lanes), dealt into 3 shards by the committed seconds file: every
    test in exactly one shard; `--shard 2/3` keeps exactly the second."""
    everything = _collect()
    assert len(everything) > 1000  # the suite, not a collection error's handful
    parts = shards.partition(everything, 3, shards.load_seconds())
    _assert_partition(parts, everything)
    assert all(parts)
    assert sorted(_collect("--shard", "2/3")) == sorted(parts[1])
