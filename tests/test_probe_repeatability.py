"""benchmarks/probe_repeatability.py: runs compared bit for bit, per update, within and across processes."""

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "benchmarks"))

import probe_repeatability as probe  # noqa: E402


def _run(losses, norms=None):
    return {"loss": list(losses), "grad_norm": list(norms or [1.0] * len(losses))}


def test_the_first_differing_update_is_found_in_either_field():
    a = _run([10.5, 9.25, 8.0])
    assert probe.first_difference(a, _run([10.5, 9.25, 8.0])) is None
    assert probe.first_difference(a, _run([10.5, 9.25, 8.0 + 2**-20])) == 3  # one ulp-scale change counts
    assert probe.first_difference(a, _run([10.5, 9.25, 8.0], [1.0, 1.0 + 1e-12, 1.0])) == 2


def test_a_group_reports_its_earliest_difference():
    base = _run([3.0, 2.0, 1.0])
    assert probe.describe([base, _run([3.0, 2.0, 1.0])]) == "same"
    later, earlier = _run([3.0, 2.0, 1.5]), _run([3.0, 2.5, 1.0])
    assert probe.describe([base, later, earlier]) == "differ from update 2"


def test_a_row_separates_within_from_across_processes():
    same = [_run([2.0, 1.0]), _run([2.0, 1.0])]
    other = [_run([2.0, 1.25]), _run([2.0, 1.25])]
    line = probe.row("mxfp4_full_h16", "default", [same, other])
    cells = [c.strip() for c in line.strip("|").split("|")]
    assert cells[:4] == ["mxfp4_full_h16", "default", "same; same", "differ from update 2"]
    assert cells[5] == "2.50e-01"


def test_an_unknown_variant_is_one_line(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["probe", "--config", "configs/tiny_c4_h16.py", "--variants", "fast"])
    with pytest.raises(SystemExit, match="unknown variant 'fast': use some of default, deterministic"):
        probe.main()
