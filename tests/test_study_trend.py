"""study.trend: the scale trend's entries from each setting's claims report, the amendment's decision on
planted intervals, the instruments across tokens per step and their condition on planted figures, bad
settings files and instrument sets in one line, and the committed scale_trend report regenerating."""

import json
import math
import os

import pytest

from fp4jax.study import instrument_trend, trend
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


def test_a_setting_is_interim_only_while_an_arm_its_measures_read_is_unsettled(tmp_path):
    """A report is interim while any planned cell is pending; its share and recovery are interim only while
    one of their arms is (a design's later arms, pending, leave them measured)."""

    def status(pending, missing=()):
        share = {**_fieller(0.3, 0.1, 0.5), "arms": ["fp8", "fprop_dgrad", "full"]}
        recovery = {**_fieller(0.5, 0.2, 0.8), "arms": ["fp8", "full", "full_h16"]}
        claims = {"interim": bool(pending or missing), "cells_pending": pending,
                  "arms_missing": list(missing), "wgrad_share": share, "h16_recovery": recovery}  # fmt: skip
        path = tmp_path / "claims.json"
        path.write_text(json.dumps(claims))
        setting = trend.Setting("s", 150_000_000, 32768, str(path), "a.toml")
        return trend.trend([setting], {})["settings"][0]["status"]

    assert status([]) == "measured"
    assert status(["nvfp4/seed0", "tseng/seed1"], missing=["quartet"]) == "measured"
    assert status(["fprop_dgrad/seed1"]) == "interim"
    assert status(["full_h16/seed0"]) == "interim"
    assert status([], missing=["fp8"]) == "interim"


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
    assert (tmp_path / "scale_trend_instruments.png").stat().st_size > 10_000


def _instruments_file(directory, accumulate, ratios, *, step=600, run="runs/x", batches=8, per_batch=None):
    """An instruments.json as the command writes it, with planted whole-model figures per stage (and,
    given `per_batch` {stage: [||e_k||^2, ...]}, each batch's squared error)."""

    def stage(ratio):
        gradient = {"noise_ratio": ratio, "coherence": 1.5, "grad_coherence": 2.0, "sqrt3_ratio": 1 / ratio,
                    "err_norm": ratio * 0.1, "noise_norm": 0.1}  # fmt: skip
        return {
            "gradient": {"all": gradient, "q": gradient},
            "update": {"all": {"rel_err": ratio / 3, "cos": 0.99}},
        }

    data = {"run": run, "recipe": "fp8_mlperf", "batches": batches, "batch": 32, "seq_len": 1024,
            "data": "next", "accumulate": accumulate, "tokens_per_step": accumulate * 32 * 1024,
            "steps": {str(step): {s: stage(r) for s, r in ratios.items()}}}  # fmt: skip
    for stage, each in (per_batch or {}).items():
        data["steps"][str(step)][stage]["per_batch"] = {"err_sq": {"all": each, "q": each}}
    path = directory / f"A{accumulate}"
    path.mkdir(parents=True)
    (path / "instruments.json").write_text(json.dumps(data))


def test_the_instrument_set_reads_every_A_and_the_condition_compares_wgrad_with_fprop(tmp_path):
    _instruments_file(tmp_path, 8, {"fprop": 0.3, "dgrad": 0.1, "wgrad": 0.5})
    _instruments_file(tmp_path, 1, {"fprop": 0.2, "dgrad": 0.1, "wgrad": 0.1})
    (tmp_path / "notes").mkdir()  # not an A<k> directory: ignored
    measured = instrument_trend.load_set(str(tmp_path), 600)
    assert [r["accumulate"] for r in measured["rows"]] == [1, 8]  # ascending tokens per step
    assert measured["rows"][1]["wgrad"]["noise_ratio"] == 0.5
    assert measured["rows"][1]["fprop"]["update_rel_err"] == 0.3 / 3
    met = instrument_trend.condition(measured, 262144)
    assert met["met"] is True and met["wgrad_noise_ratio"] == 0.5 and met["fprop_noise_ratio"] == 0.3
    assert instrument_trend.condition(measured, 32768)["met"] is False  # equal is not above
    assert instrument_trend.condition(measured, 65536)["met"] is None
    text = "\n".join(instrument_trend.rows_markdown(measured))
    assert "| 262,144 | 8 | wgrad | 0.500 | 1.50 (2.00) | 2.00 | 0.1667 | 0.9900 |" in text


def test_an_instrument_set_that_varies_more_than_A_is_refused_in_one_line(tmp_path):
    _instruments_file(tmp_path, 1, {"fprop": 0.2, "dgrad": 0.1, "wgrad": 0.1})
    _instruments_file(tmp_path, 2, {"fprop": 0.2, "dgrad": 0.1, "wgrad": 0.1}, run="runs/other")
    with pytest.raises(ValueError, match=r"A2/instruments.json: differs from .* in \['run'\]"):
        instrument_trend.load_set(str(tmp_path), 600)
    with pytest.raises(ValueError, match="no checkpoint step 250"):
        instrument_trend.load_set(str(tmp_path / "A1" / ".."), 250)
    with pytest.raises(ValueError, match="no A<k>/instruments.json"):
        instrument_trend.load_set(str(tmp_path / "notes"), 600)


def test_a_settings_files_instrument_set_enters_the_trend_and_its_report(tmp_path):
    _instruments_file(tmp_path / "set", 8, {"fprop": 0.3, "dgrad": 0.1, "wgrad": 0.1})
    settings = [trend.Setting("small", 150_000_000, 32768, str(tmp_path / "absent.json"), "a.toml")]
    sets = [trend.InstrumentSet("small trunk", 150_000_000, str(tmp_path / "set"), 600, 262144),
            trend.InstrumentSet("absent", 1, str(tmp_path / "none"), 600, 262144)]  # fmt: skip
    result = trend.trend(settings, {}, sets)
    measured, absent = result["instruments"]
    assert measured["condition"]["met"] is False and absent["status"] == "not run"
    text = trend.to_markdown(result)
    assert "### Instruments: small trunk (150M parameters)" in text
    assert "**not met** (Wgrad's error-to-noise ratio 0.100 <= Fprop's 0.300; no interval" in text
    assert "Not run (no " in text


def test_the_conditions_interval_is_a_paired_bootstrap_over_the_batches(tmp_path):
    """Wgrad's and Fprop's ratios share the noise, so their quotient is sqrt(sum W_k / sum F_k): exactly 2
    with no spread where every batch has W_k = 4 F_k; otherwise an interval around the estimate that
    pairing keeps narrower than resampling the two stages independently would."""
    fprop = [1.0, 3.0, 0.5, 2.0, 1.5, 4.0, 0.8, 2.5]
    _instruments_file(tmp_path / "exact", 8, {"fprop": 0.2, "dgrad": 0.1, "wgrad": 0.4},
                      per_batch={"fprop": fprop, "wgrad": [4 * f for f in fprop]})  # fmt: skip
    exact = instrument_trend.condition(instrument_trend.load_set(str(tmp_path / "exact"), 600), 262144)
    assert exact["wgrad_over_fprop"] == pytest.approx({"estimate": 2.0, "lo": 2.0, "hi": 2.0, "batches": 8})
    assert "Wgrad / Fprop 2.00 [2.00, 2.00], bootstrap over 8 batches" in exact["why"]
    wgrad = [0.3 * f + 0.1 * (-1) ** k for k, f in enumerate(fprop)]
    _instruments_file(tmp_path / "spread", 8, {"fprop": 0.2, "dgrad": 0.1, "wgrad": 0.1},
                      per_batch={"fprop": fprop, "wgrad": wgrad})  # fmt: skip
    spread = instrument_trend.condition(instrument_trend.load_set(str(tmp_path / "spread"), 600), 262144)
    q = spread["wgrad_over_fprop"]
    assert q["estimate"] == pytest.approx(math.sqrt(sum(wgrad) / sum(fprop)))
    assert q["lo"] < q["estimate"] < q["hi"] and q["hi"] - q["lo"] < 0.2
    again = instrument_trend.condition(instrument_trend.load_set(str(tmp_path / "spread"), 600), 262144)
    assert again == spread  # a fixed seed: the report regenerates
    _instruments_file(tmp_path / "old", 8, {"fprop": 0.2, "dgrad": 0.1, "wgrad": 0.1})
    old = instrument_trend.condition(instrument_trend.load_set(str(tmp_path / "old"), 600), 262144)
    assert old["wgrad_over_fprop"] is None and "no interval" in old["why"]
