"""study.trend: the scale trend's entries from each setting's claims report, the amendment's decision on
planted intervals, bad settings files in one line, and the committed scale_trend report regenerating."""

import json
import os

import pytest

from fp4jax.study import trend
from fp4jax.study.__main__ import main

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _fieller(estimate, lo, hi):
    bounded = lo is not None
    paired = {"estimate": estimate, "lo": None, "hi": None, "bounded": False}
    return {"estimate": estimate, "lo": lo, "hi": hi, "bounded": bounded, "paired": paired}


def _entry(params, share, status="measured"):
    return {"label": f"{params}", "params": params, "status": status, "wgrad_share": share}


def test_the_decision_follows_the_amendments_rule():
    first = _entry(1e8, {"estimate": 0.3, "lo": 0.1, "hi": 0.5})
    above = _entry(1e9, {"estimate": 0.75, "lo": 0.55, "hi": 0.9})
    below = _entry(1e9, {"estimate": 0.25, "lo": 0.05, "hi": 0.45})
    overlapping = _entry(1e9, {"estimate": 0.45, "lo": 0.3, "hi": 0.7})
    unbounded = _entry(1e9, {"estimate": 0.45, "lo": None, "hi": None})
    assert trend.decide([first, above], 0.6)["verdict"] == "supported"
    assert trend.decide([first, below], 0.6)["verdict"] == "refuted"
    assert trend.decide([first, overlapping], 0.6)["verdict"] == "not resolved"
    assert trend.decide([first, unbounded], 0.6)["why"] == "an unbounded Fieller interval"
    assert trend.decide([first, _entry(1e9, None, "not run")], 0.6)["verdict"] == "not resolved"
    # the largest setting run decides, not the last listed
    assert trend.decide([first, above, _entry(5e8, below["wgrad_share"])], 0.6)["verdict"] == "supported"


def test_entries_come_from_the_claims_reports_and_a_missing_one_is_not_run(tmp_path):
    report = tmp_path / "claims.json"
    report.write_text(json.dumps({"interim": False, "wgrad_share": _fieller(0.3, 0.1, 0.5),
                                  "h16_recovery": _fieller(0.5, None, None)}))  # fmt: skip
    settings = [
        trend.Setting("small", 150_000_000, 32768, str(report), "a.toml"),
        trend.Setting("large", 1_000_000_000, 32768, str(tmp_path / "absent.json"), "b.toml"),
    ]
    result = trend.trend(settings, {"study_8b": {"params": 8e9, "tokens_per_step": 262144, "wgrad_share": 0.6,
                                                "source": "s"}})  # fmt: skip
    small, large = result["settings"]
    assert small["status"] == "measured" and small["wgrad_share"]["lo"] == 0.1
    assert small["wgrad_share"]["paired"] == {"estimate": 0.3, "lo": None, "hi": None}
    assert small["h16_recovery"] == {
        "estimate": 0.5,
        "lo": None,
        "hi": None,
        "paired": small["h16_recovery"]["paired"],
    }
    assert large["status"] == "not run" and large["wgrad_share"] is None
    assert result["decision"]["verdict"] == "not resolved"
    text = trend.to_markdown(result)
    assert (
        "| small | 150M | 32,768 | measured | 0.30 [0.10, 0.50] (paired unbounded) | 0.50 unbounded" in text
    )


def test_a_bad_settings_file_is_one_line_naming_the_fix(tmp_path):
    path = tmp_path / "trend.toml"
    path.write_text('[[settings]]\nlabel = "x"\nparams = 1\n')
    with pytest.raises(
        ValueError, match=r"settings\[0\] needs exactly \['claims', 'label', 'params', 'plan'"
    ):
        trend.load_settings(str(path))
    path.write_text("")
    with pytest.raises(ValueError, match="no \\[\\[settings\\]\\]"):
        trend.load_settings(str(path))


def test_the_committed_scale_trend_regenerates(tmp_path):
    cwd = os.getcwd()
    os.chdir(ROOT)  # the settings' report paths are relative to the repository's root
    try:
        settings = os.path.join("fp4jax", "study", "plans", "scale_trend.toml")
        assert main(["trend", "--settings", settings, "--out", str(tmp_path)]) == 0
    finally:
        os.chdir(cwd)
    committed = os.path.join(ROOT, "docs", "results")
    with open(os.path.join(committed, "scale_trend.md"), "rb") as f:
        assert (tmp_path / "scale_trend.md").read_bytes() == f.read()
    with open(os.path.join(committed, "scale_trend.json"), encoding="utf-8") as f:
        assert json.loads((tmp_path / "scale_trend.json").read_text()) == json.load(f)
    assert (tmp_path / "scale_trend.png").stat().st_size > 10_000
