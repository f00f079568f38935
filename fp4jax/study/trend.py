"""The scale and batch trend (docs/study_plan.md, amendment "the scale and batch trend", H-scale): Wgrad's
share of full MXFP4's cost and H16's recovery per setting (parameters x tokens per step), each from its
setting's claims report, beside the study's 8B point and the MLPerf production point.

    python -m fp4jax.study trend --settings fp4jax/study/plans/scale_trend.toml --out docs/results

A settings file lists, per setting, its label, parameters, tokens per step, the claims report (a
`<stage>_claims_at<step>.json` the study's `report` wrote) and the plan that produces it; a setting whose
report does not exist yet is listed as not run. Its `[[instruments]]` entries name sets of the mechanism
instruments across tokens per step (study.instrument_trend), each with the checkpoint step read and the
tokens per step at which the amendment's condition for a larger-batch branching set is evaluated. Writes
OUT/scale_trend.md, .json and .png, and OUT/scale_trend_instruments.png where a set exists. The decision
is the amendment's rule, applied to the pooled Fieller intervals:
- supported when Wgrad's share's interval at the largest setting run lies wholly above the first
  setting's (the 125M one);
- refuted when that interval lies wholly below the study's 8B share while its estimate does not exceed
  the first setting's;
- otherwise not resolved (and so with fewer than two settings run, or an unbounded interval).
"""

from __future__ import annotations

import dataclasses
import json
import os
import tomllib

from fp4jax.study import instrument_trend, plots, report

__all__ = ["InstrumentSet", "Setting", "decide", "load_settings", "to_markdown", "trend", "write_trend"]

MEASURES = ("wgrad_share", "h16_recovery")


@dataclasses.dataclass(frozen=True)
class Setting:
    """One point of the trend: `claims` is the path of its claims report (JSON), `plan` the plan that
    produces it."""

    label: str
    params: int
    tokens_per_step: int
    claims: str
    plan: str


@dataclasses.dataclass(frozen=True)
class InstrumentSet:
    """The instruments on one checkpoint at several tokens per step: `directory` holds A<k>/instruments.json
    (study.instrument_trend); `condition_tokens_per_step` is where the amendment's condition is read."""

    label: str
    params: int
    directory: str
    step: int
    condition_tokens_per_step: int


def _entries(path: str, table: dict, key: str, cls) -> list:
    fields = {f.name for f in dataclasses.fields(cls)}
    out = []
    for i, entry in enumerate(table.get(key, [])):
        if set(entry) != fields:
            raise ValueError(f"{path}: {key}[{i}] needs exactly {sorted(fields)}, not {sorted(entry)}")
        out.append(cls(**entry))
    return out


def load_settings(path: str) -> tuple[list[Setting], dict, list[InstrumentSet]]:
    """The settings file's [[settings]] (in order: the first is the reference setting), [references] and
    [[instruments]]."""
    with open(path, "rb") as f:
        table = tomllib.load(f)
    settings = _entries(path, table, "settings", Setting)
    if not settings:
        raise ValueError(f"{path}: no [[settings]]: list at least the 125M setting")
    return settings, dict(table.get("references", {})), _entries(path, table, "instruments", InstrumentSet)


def _interval(measure: dict | None) -> dict | None:
    """{estimate, lo, hi} of a Fieller result (lo and hi None where the set is unbounded), with the
    paired-t one beside it."""
    if measure is None:
        return None
    out = {k: measure["estimate"] if k == "estimate" else (measure[k] if measure["bounded"] else None)
           for k in ("estimate", "lo", "hi")}  # fmt: skip
    paired = measure.get("paired")
    if paired is not None:
        out["paired"] = _interval({**paired, "paired": None})
    return out


def _entry(setting: Setting) -> dict:
    entry = {
        "label": setting.label,
        "params": setting.params,
        "tokens_per_step": setting.tokens_per_step,
        "claims": setting.claims,
        "plan": setting.plan,
    }
    if not os.path.isfile(setting.claims):
        return {**entry, "status": "not run", **{m: None for m in MEASURES}}
    with open(setting.claims, encoding="utf-8") as f:
        claims = json.load(f)
    return {**entry, "status": _status(claims), **{m: _interval(claims.get(m)) for m in MEASURES}}


def _status(claims: dict) -> str:
    """Interim while an arm the measures read has a planned run missing or pending (the report's other
    arms, such as a design's later additions, do not make its share interim), else "measured"."""
    measures = [claims[m] for m in MEASURES if claims.get(m) is not None]
    if not measures or any("arms" not in m for m in measures):
        return "interim" if claims.get("interim") else "measured"
    pending = {cell.split("/")[0] for cell in claims.get("cells_pending", [])}
    unsettled = set(claims.get("arms_missing", [])) | pending
    return "interim" if any(unsettled & set(m["arms"]) for m in measures) else "measured"


def decide(entries: list[dict], share_at_8b: float) -> dict:
    """The amendment's decision on Wgrad's share (module docstring), with the reason."""
    run = [e for e in entries if e["status"] != "not run" and e["wgrad_share"] is not None]
    if len(run) < 2 or run[0] is not entries[0]:
        return {"verdict": "not resolved", "why": "fewer than two settings run (the first one included)"}
    first, largest = run[0]["wgrad_share"], max(run[1:], key=lambda e: e["params"])
    last = largest["wgrad_share"]
    if None in (first["lo"], first["hi"], last["lo"], last["hi"]):
        return {"verdict": "not resolved", "why": "an unbounded Fieller interval"}
    if last["lo"] > first["hi"]:
        return {
            "verdict": "supported",
            "why": f"{largest['label']}'s interval lies above the first setting's",
        }
    if last["hi"] < share_at_8b and last["estimate"] <= first["estimate"]:
        why = f"{largest['label']}'s interval lies below {share_at_8b:.2f} and its estimate does not rise"
        return {"verdict": "refuted", "why": why}
    return {"verdict": "not resolved", "why": "the intervals overlap, or rise without clearing the first"}


def _instrument_entry(spec: InstrumentSet) -> dict:
    entry = dataclasses.asdict(spec)
    if not os.path.isdir(spec.directory):
        return {**entry, "status": "not run", "rows": [], "condition": None}
    measured = instrument_trend.load_set(spec.directory, spec.step)
    condition = instrument_trend.condition(measured, spec.condition_tokens_per_step)
    return {**entry, "status": "measured", **measured, "condition": condition}


def trend(settings: list[Setting], references: dict, instruments: list[InstrumentSet] = ()) -> dict:
    """The trend as JSON-ready data: one entry per setting, the references, the decision, and each
    instrument set with its condition."""
    entries = [_entry(s) for s in settings]
    share_at_8b = references.get("study_8b", {}).get("wgrad_share", 0.6)
    return {
        "settings": entries,
        "references": references,
        "decision": decide(entries, share_at_8b),
        "instruments": [_instrument_entry(i) for i in instruments],
    }


def _ends(interval: dict) -> str:
    return "unbounded" if interval["lo"] is None else f"[{interval['lo']:.2f}, {interval['hi']:.2f}]"


def _cell(interval: dict | None) -> str:
    if interval is None:
        return "-"
    paired = interval.get("paired")
    return f"{interval['estimate']:.2f} {_ends(interval)}" + (f" (paired {_ends(paired)})" if paired else "")


def to_markdown(result: dict) -> str:
    lines = [
        "Wgrad's share of full MXFP4's cost, C1 / (full - fp8), and H16's recovery, (full - full_h16) / "
        "(full - fp8), per setting: pooled Fieller 95 % intervals, the paired-t ones beside them; "
        "interim: an arm the measures read still has planned runs pending.",
        "",
        "| setting | parameters | tokens / step | status | Wgrad's share | H16's recovery |",
        "|---|---:|---:|---|---|---|",
    ]
    for e in result["settings"]:
        cells = [e["label"], f"{e['params'] / 1e6:,.0f}M", f"{e['tokens_per_step']:,}", e["status"]]
        cells += [_cell(e[m]) for m in MEASURES]
        lines.append("| " + " | ".join(cells) + " |")
    for name, ref in result["references"].items():
        share = ref.get("wgrad_share")
        recovery = ref.get("h16_recovery")
        cells = [name, f"{ref['params'] / 1e6:,.0f}M", f"{ref['tokens_per_step']:,}", "reference"]
        cells += ["-" if share is None else f"{share:.2f}", "-" if recovery is None else f"{recovery:.2f}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines.append("")
    for name, ref in result["references"].items():
        lines.append(f"- {name}: {ref['source']}")
    decision = result["decision"]
    lines += ["", f"H-scale: **{decision['verdict']}** ({decision['why']})."]
    for entry in result.get("instruments", []):
        lines += ["", *_instruments_markdown(entry)]
    return "\n".join(lines) + "\n"


def _instruments_markdown(entry: dict) -> list[str]:
    head = f"### Instruments: {entry['label']} ({entry['params'] / 1e6:,.0f}M parameters)"
    if entry["status"] == "not run":
        return [head, "", f"Not run (no {entry['directory']})."]
    shared = entry["shared"]
    lines = [
        head,
        "",
        f"Checkpoint {shared['step']} of `{shared['run']}` ({shared['recipe']}), {shared['batches']} batches "
        f"of A x {shared['batch']} sequences of {shared['seq_len']} tokens from `{shared['data']}`; one GEMM "
        "stage in MXFP4 at a time against bf16, whole-model figures (docs/diagnostics.md). Point figures "
        "from one checkpoint: no interval.",
        "",
        *instrument_trend.rows_markdown(entry),
    ]
    condition = entry["condition"]
    met = {True: "met", False: "not met", None: "not evaluated"}[condition["met"]]
    lines += [
        "",
        f"Condition for a branching set at {condition['tokens_per_step']:,} tokens per step (Wgrad's "
        f"error-to-noise ratio above Fprop's there): **{met}** ({condition['why']}).",
    ]
    return lines


def write_trend(settings_path: str, out: str | None) -> dict:
    """The trend of `settings_path`'s settings, printed and written to OUT/scale_trend.md/.json/.png."""
    result = trend(*load_settings(settings_path))
    base = None if out is None else os.path.join(out, "scale_trend")
    report.write(base, to_markdown(result), result, draw=lambda b: _draw(result, b))
    return result


def _draw(result: dict, base: str) -> list[str]:
    paths = [plots.plot_trend(result, base + ".png")]
    measured = [e for e in result["instruments"] if e["status"] == "measured"]
    if measured:
        paths.append(plots.plot_instrument_trend(measured, base + "_instruments.png"))
    return paths
