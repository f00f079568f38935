"""Every committed report of the 125M study regenerates from the committed run records: `python -m
fp4jax.study records unpack records/study125m --root runs/study`, then `report --root runs/study`, writes
the same files as docs/results/study125m holds.

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

from fp4jax.study.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLAN = os.path.join(ROOT, "fp4jax", "study", "plans", "proxy125m.toml")
RECORDS = os.path.join(ROOT, "records", "study125m")
COMMITTED = os.path.join(ROOT, "docs", "results", "study125m")


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


def regenerate(out, workdir) -> None:
    """The report as docs/results.md runs it: the records unpacked into runs/study under `workdir` (the
    JSON records run directories as given, runs/study/...), the report into `out`."""
    cwd = os.getcwd()
    os.chdir(workdir)
    try:
        runs = os.path.join("runs", "study")
        assert main(["records", "unpack", RECORDS, "--root", runs]) == 0
        assert main(["report", "--plan", PLAN, "--root", runs, "--out", str(out)]) == 0
    finally:
        os.chdir(cwd)


def test_every_committed_report_regenerates_from_the_committed_runs(tmp_path):
    """One regeneration (several seconds) for every file: the same names, the markdown byte for byte, the
    JSON to 1e-9."""
    out = tmp_path / "out"
    regenerate(out, tmp_path)
    assert sorted(os.listdir(out)) == sorted(os.listdir(COMMITTED))
    for name in sorted(os.listdir(COMMITTED)):
        committed, fresh = os.path.join(COMMITTED, name), out / name
        if name.endswith(".md"):
            with open(committed, "rb") as f:
                assert fresh.read_bytes() == f.read(), f"{name} differs: rerun the report (docs/results.md)"
        elif name.endswith(".json"):
            with open(committed, encoding="utf-8") as f:
                same(json.loads(fresh.read_text()), json.load(f), name)
