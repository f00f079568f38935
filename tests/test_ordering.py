"""tests/ordering.py: the slow modules, by their tests' measured seconds, are dealt between pytest-xdist's
workers and every test still runs; tests/long_lane.py: which parametrized cases the long lane takes."""

import long_lane
import ordering
import pytest
import shards

SECONDS = {"slow_a.py": 100, "slow_b.py": 60, "slow_c.py": 50, "slow_d.py": 10}
# Collection order: fast modules between the slow ones, as the file names fall.
MODULES = (
    ["fast_1.py"] * 5 + ["slow_a.py"] * 3 + ["fast_2.py"] * 7 + ["slow_b.py"] * 2
    + ["slow_c.py"] * 4 + ["fast_3.py"] * 6 + ["slow_d.py"] * 2 + ["fast_4.py"] * 3
)  # fmt: skip


def _runs(order, workers):
    runs, start = [], 0
    for size in ordering.run_sizes(len(order), workers):
        runs.append([MODULES[i] for i in order[start : start + size]])
        start += size
    return runs


def test_run_sizes_are_worksteals_first_distribution():
    assert ordering.run_sizes(32, 2) == [16, 16] and ordering.run_sizes(33, 2) == [16, 17]
    assert ordering.run_sizes(10, 4) == [2, 2, 3, 3] and sum(ordering.run_sizes(799, 3)) == 799


def test_every_item_once_and_each_slow_module_in_one_piece():
    for workers in (1, 2, 3):
        order = ordering.deal(MODULES, workers, SECONDS)
        assert sorted(order) == list(range(len(MODULES)))
        dealt = [MODULES[i] for i in order]
        pieces = [m for k, m in enumerate(dealt) if k == 0 or dealt[k - 1] != m]
        slow = [m for m in pieces if m in SECONDS]
        assert len(slow) == len(set(slow)) == len(SECONDS), pieces  # fast ones may span two runs
        for module in set(MODULES):  # a module's own items keep their order
            assert [i for i in order if MODULES[i] == module] == [
                i for i, m in enumerate(MODULES) if m == module
            ]


def test_each_worker_starts_on_its_share_of_the_slow_modules_longest_first():
    first, second = _runs(ordering.deal(MODULES, 2, SECONDS), 2)
    # Longest first to the run with fewer seconds: a (100) | b (60), c (50): 100 | 110, then d to the first.
    assert first[:5] == ["slow_a.py"] * 3 + ["slow_d.py"] * 2 and set(first[5:]) <= {"fast_1.py", "fast_2.py"}
    assert second[:6] == ["slow_b.py"] * 2 + ["slow_c.py"] * 4
    assert all(m.startswith("fast") for m in second[6:])
    # One worker: the slow modules first, longest first, then the rest in collection order.
    alone = [MODULES[i] for i in ordering.deal(MODULES, 1, SECONDS)]
    assert alone[:11] == ["slow_a.py"] * 3 + ["slow_b.py"] * 2 + ["slow_c.py"] * 4 + ["slow_d.py"] * 2
    assert alone[11:] == [m for m in MODULES if m.startswith("fast")]


def test_a_module_larger_than_a_run_still_runs_once():
    modules = ["slow_a.py"] * 9 + ["fast_1.py"] * 3
    order = ordering.deal(modules, 2, SECONDS)
    assert sorted(order) == list(range(12)) and order[:9] == list(range(9))


def test_modules_are_weighed_by_their_collected_tests_measured_seconds():
    measured = {"tests/slow_a.py::t[1]": 4.0, "tests/slow_a.py::t[2]": 3.0, "tests/b.py::t": 4.9}
    measured["tests/slow_a.py::only_in_the_other_lane"] = 100.0
    collected = ["tests/slow_a.py::t[1]", "tests/slow_a.py::t[2]", "tests/b.py::t", "tests/new.py::t"]
    # slow_a: 7 s of collected tests (the other lane's test does not count); b under the threshold; new
    # unmeasured
    assert ordering.module_seconds(collected, measured) == {"slow_a.py": 7.0}
    assert ordering.module_seconds(collected[2:], measured) == {}
    with_other = ordering.module_seconds([*collected, "tests/slow_a.py::only_in_the_other_lane"], measured)
    assert with_other == {"slow_a.py": 107.0}


def test_the_measured_file_weighs_the_default_lanes_slow_modules():
    """The committed file is read, and it names slow modules of the default lane (a file that lost its
    measurements would leave the suite in collection order, slower, silently)."""
    measured = shards.load_seconds(ordering.SECONDS_FILE)
    assert measured, f"{ordering.SECONDS_FILE} is missing or empty"
    slow = ordering.module_seconds(list(measured), measured)
    assert len(slow) >= 5 and all(m.startswith("test_") and m.endswith(".py") for m in slow)


def _lanes(values) -> list[str]:
    return ["long" if "slow" in [m.name for m in getattr(v, "marks", ())] else "default" for v in values]


def test_long_lane_parametrize_keeps_the_chosen_values_in_the_default_lane():
    names, values = long_lane.parametrize("a, b", [(1, 2), (3, 4), pytest.param(5, 6, id="x")]).mark.args
    assert names == "a, b" and values[0] == (1, 2) and _lanes(values) == ["default", "long", "long"]
    assert [v.values for v in values[1:]] == [(3, 4), (5, 6)] and values[2].id == "x"
    _, single = long_lane.parametrize("a", [(1, 2), (3, 4), (5, 6)], default=(0, 2)).mark.args
    assert _lanes(single) == ["default", "long", "default"] and single[1].values == ((3, 4),)
