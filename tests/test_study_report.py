"""Every committed study report regenerates from the committed run records: for the 125M study, `python
-m fp4jax.study records unpack records/study125m --root runs/study`, then `report --root runs/study`, writes
the same files as docs/results/study125m holds; so do the 350M set's (records/scale350m, runs/scale350m).

The markdown must match byte for byte. The JSON must hold the same keys and values, numbers equal to
1e-9 relative or 1e-12 absolute: the pooled fit's SVD and least squares sum in an order that the CPU's
BLAS kernels choose, so its last bits differ between machines (on one machine the files repeat byte for
byte). The absolute floor is for numbers that are a difference of two nearly equal ones: an interval's
bound near zero (estimate 4.0e-3 minus t x s.e. 4.0e-3 = 1.0e-6) keeps the inputs' absolute error (about
1e-15 here) but not their relative one. The figures'
bytes depend on matplotlib's and FreeType's versions, so only their presence is checked.
"""

import json
import math
import os

import pytest

from fp4jax.study.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# (plan, records, the runs' root the reports were written from, committed reports), as docs/results.md runs
# each: the JSON reports name run directories under that root.
STUDIES = {
    "study125m": ("proxy125m.toml", "study125m", os.path.join("runs", "study"), "study125m"),
    "scale350m": ("scale350m.toml", "scale350m", os.path.join("runs", "scale350m"), "scale350m"),
}


def same(a, b, where: str = "") -> None:
    """a == b, floats to 1e-9 relative or 1e-12 absolute, naming the first place they differ."""
    if isinstance(a, float) or isinstance(b, float):
        assert isinstance(a, (int, float)) and isinstance(b, (int, float)), where
        assert math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12), f"{where}: {a!r} != {b!r}"
    elif isinstance(a, dict):
        assert isinstance(b, dict) and sorted(a) == sorted(b), f"{where}: keys differ"
        for key in a:
            same(a[key], b[key], f"{where}.{key}")
    elif isinstance(a, list):
        assert isinstance(b, list) and len(a) == len(b), f"{where}: lengths differ"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            same(x, y, f"{where}[{i}]")
    else:
        assert a == b, f"{where}: {a!r} != {b!r}"


def regenerate(study: str, out, workdir) -> str:
    """`study`'s report as docs/results.md runs it: its records unpacked into its runs' root under
    `workdir` (the JSON records run directories as given), the report into `out`; returns the directory
    of the committed reports."""
    plan, records, runs, committed = STUDIES[study]
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        assert main(["records", "unpack", os.path.join(ROOT, "records", records), "--root", runs]) == 0
        plan = os.path.join(ROOT, "fp4jax", "study", "plans", plan)
        assert main(["report", "--plan", plan, "--root", runs, "--out", str(out)]) == 0
    finally:
        os.chdir(cwd)
    return os.path.join(ROOT, "docs", "results", committed)


@pytest.mark.parametrize("study", sorted(STUDIES))
def test_every_committed_report_regenerates_from_the_committed_runs(study, tmp_path):
    """One regeneration (several seconds) for every file: the same names, the markdown byte for byte, the
    JSON to 1e-9."""
    out = tmp_path / "out"
    expected = regenerate(study, out, tmp_path)
    assert sorted(os.listdir(out)) == sorted(os.listdir(expected))
    for name in sorted(os.listdir(expected)):
        committed, fresh = os.path.join(expected, name), out / name
        if name.endswith(".md"):
            with open(committed, "rb") as f:
                assert fresh.read_bytes() == f.read(), f"{name} differs: rerun the report (docs/results.md)"
        elif name.endswith(".json"):
            with open(committed, encoding="utf-8") as f:
                same(json.loads(fresh.read_text()), json.load(f), name)
