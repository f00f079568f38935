"""The report layer's markdown for a from-scratch stage or a ladder: tables from analysis.analyze's dict
(with, for a stage that counts them, its runs' loss spikes under "spikes": lr_stress.stage_spikes); the
JSON beside them holds every number (report.write writes both)."""

from __future__ import annotations

from fp4jax.study import lr_stress
from fp4jax.study.analysis import GEMMS, first_probed

__all__ = [
    "SEED_OUTCOMES",
    "diagnostics_table",
    "group_line",
    "ladder_table",
    "lr_table",
    "seed_outcome",
    "to_markdown",
    "tokens_cell",
]

SEED_OUTCOMES = (("reached", "reached"), ("diverged", "diverged"), ("not_reached", "ran out"))


def _num(value, spec: str, missing: str = "-") -> str:
    return missing if value is None else format(value, spec)


def _pm(value, err, spec: str) -> str:
    """'value ± err' (just value without an error, '-' without a value)."""
    if value is None:
        return "-"
    return format(value, spec) + ("" if err is None else " ± " + format(err, spec.lstrip("+")))


def seed_outcome(row: dict) -> str:
    """One seed's result: its tokens to target, 'diverged @ step N', 'not reached (T tokens)' or 'failed'."""
    o = row["outcome"]
    if o == "reached":
        first = " (first eval)" if row["crossing"]["first_eval"] else ""
        return f"{row['tokens_to_target']:,.0f}{first}"
    if o == "diverged":
        return f"diverged @ step {row['diverged_step']}"
    if o == "not_reached" and row["status"] == "reached":  # stopped at its config's target, above this one
        return f"not reached (stopped at its own target, {_num(row['tokens_trained'], ',')} tokens)"
    if o == "not_reached":
        return f"not reached within budget ({_num(row['tokens_trained'], ',')} tokens)"
    if o == "failed":
        return f"failed ({row['failure']})"
    return "unfinished"


def tokens_cell(g: dict) -> str:
    """Mean ± sd over the seeds that reached; a lone seed's own outcome (so a diverged rung reads so)."""
    if len(g["runs"]) == 1:
        return seed_outcome(g["runs"][0])
    if g["tokens_to_target_mean"] is None:
        return "none reached"
    return _pm(g["tokens_to_target_mean"], g["tokens_to_target_sd"], ",.0f")


def group_line(g: dict, with_lr: bool) -> str:
    counts = " / ".join(str(g["counts"][k]) for k, _ in SEED_OUTCOMES)
    extra = g["counts"]["failed"] + g["counts"]["unfinished"]
    counts += f" (+{extra} failed/unfinished)" if extra else ""
    per_seed = "; ".join(f"s{r['seed']}: {seed_outcome(r)}" for r in g["runs"])
    paired = g["paired"]
    cells = [
        g["rung"],
        *([_num(g["lr"], "g")] if with_lr else []),
        counts,
        tokens_cell(g),
        ", ".join(f"{i:,}" for i in g["eval_intervals"]) or "-",
        per_seed,
        _pm(g["token_overhead"], g["token_overhead_se"], "+.1%"),
        "-" if not paired else f"{_pm(paired['mean'], paired['sd'], '+.1%')} (n={paired['n']})",
        tokens_per_s_cell(g),
        _num(g["step_speedup"], ".3f"),
        _pm(g["end_to_end_speedup"], g["end_to_end_speedup_se"], ".3f"),
        _pm(g["time_saved"], g["time_saved_se"], "+.1%"),
    ]
    return "| " + " | ".join(cells) + " |"


def tokens_per_s_cell(g: dict) -> str:
    """The rung's mean tokens/s and the GPU sharing it was measured under (runs.gpu_sharing)."""
    if g["tokens_per_s"] is None:
        return "-"
    n, mixed = g.get("runs_per_gpu"), g.get("gpu_sharings")
    if mixed:
        where = f"mixed: {', '.join(map(str, mixed))} runs per GPU"
    elif n is None:
        where = "sharing not recorded"
    else:
        where = "alone on its GPU" if n == 1 else f"{n} runs per GPU"
    return f"{g['tokens_per_s']:,.0f} ({where})"


def ladder_table(result: dict) -> list[str]:
    with_lr = any(g["lr"] is not None for g in result["groups"])
    head = ["rung", *(["peak LR"] if with_lr else []), "seeds reached / diverged / ran out"]
    head += ["tokens to target (mean ± sd)", "eval interval (tokens)", "each seed"]
    head += ["token overhead ± s.e.", "paired overhead (mean ± sd)", "tokens/s", "step speed-up"]
    head += ["end-to-end speed-up ± s.e.", "time saved ± s.e."]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += [group_line(g, with_lr) for g in result["groups"]]
    lines += [f"| {name} | missing: no runs under the root |" for name in result["missing_rungs"]]
    return lines


def lr_table(curves: dict) -> list[str]:
    """Final eval loss (mean ± sd over seeds) per rung and peak LR; diverged seeds named."""
    lrs = sorted({row[0] for rows in curves.values() for row in rows})
    lines = ["| rung | " + " | ".join(f"LR {lr:g}" for lr in lrs) + " |", "|" + "---|" * (len(lrs) + 1)]
    for rung, rows in curves.items():
        by_lr = {row[0]: row for row in rows}
        cells = [_lr_cell(by_lr.get(lr)) for lr in lrs]
        lines.append(f"| {rung} | " + " | ".join(cells) + " |")
    return lines


def _lr_cell(row) -> str:
    if row is None:
        return "-"
    _, mean, sd, n_ok, n_div = row
    cell = _pm(mean, sd, ".4f") if n_ok else ""
    return (cell + (f" ({n_div} diverged)" if n_div else "")).strip() or "-"


def diagnostics_table(groups: list[dict]) -> list[str]:
    """Per (rung, LR), its first probed seed: the last probe's output relative error per GEMM (mean over
    layer kinds), the probe's share of this run's training time (its compilation included) and its steady
    cost in training steps (overhead at N = 100 is about cost / 100)."""
    head = "| rung | seed | last probed step | Fprop | Dgrad | Wgrad | probe overhead (run) | probe (steps) |"
    lines = [head, "|" + "---|" * 8]
    for g in groups:
        run = first_probed(g)
        if run is None:
            continue
        d = run["diagnostics"]
        errs = [_num(d["out_rel_err"].get(gemm, [None])[-1], ".3e") for gemm in GEMMS]
        name = g["rung"] if g["lr"] is None else f"{g['rung']} (LR {g['lr']:g})"
        cost = _num(d.get("probe_steps"), ".2f")
        cells = [name, str(run["seed"]), str(d["last_step"]), *errs, _num(d["overhead"], ".2%"), cost]
        lines.append("| " + " | ".join(cells) + " |")
    return lines if len(lines) > 2 else []


def to_markdown(result: dict) -> str:
    lines = [
        f"Target eval loss {result['target_eval_loss']:.4f} nats ({result['target_rule']}); "
        f"baseline `{result['baseline']}`.",
        "",
        *ladder_table(result),
        "",
        "Tokens to target: interpolated linearly in tokens between the two evaluations that bracket the "
        "target (resolution: the eval interval beside it); mean ± sample sd over the seeds that reached it. "
        "Overhead: mean_rung / mean_baseline - 1, s.e. by the delta method from both means' standard "
        "errors; paired: per-seed ratios against the baseline's same seed. End-to-end speed-up = "
        "T_baseline / T_rung, time saved = 1 - T_rung / T_baseline, T = tokens to target / tokens/s.",
    ]
    if result["lr_sensitivity"]:
        lines += ["", "Final eval loss against peak LR (mean ± sd over seeds):", ""]
        lines += lr_table(result["lr_sensitivity"])
    diag = diagnostics_table(result["groups"])
    if diag:
        lines += [
            "",
            "Per-GEMM diagnostics, output relative error against the high-precision GEMM:",
            "",
            *diag,
        ]
    if result.get("spikes"):
        lines += ["", *lr_stress.spikes_markdown(result["spikes"])]
    return "\n".join(lines) + "\n"
