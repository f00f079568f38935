"""The report layer's figures: a scratch stage's (analysis.analyze's dict: loss curves, overhead bars, LR
sensitivity, per-GEMM diagnostics), a branch stage's differences, an LR series, and the forest plots of
the claims' analysis (claims.analyze's dict, by design). Only report.py's writer calls them."""

from __future__ import annotations

import math

from fp4jax.report_files import save_png
from fp4jax.study import claims
from fp4jax.study.analysis import GEMMS, first_probed
from fp4jax.study.stats import weights_text

__all__ = [
    "claims_by_design",
    "claims_forest",
    "plot_all",
    "plot_branches",
    "plot_curves",
    "plot_diagnostics",
    "plot_forest",
    "plot_forest_by_design",
    "plot_lr",
    "plot_lr_series",
    "plot_overhead",
    "plot_trend",
]


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _label(g: dict) -> str:
    return g["rung"] if g["lr"] is None else f"{g['rung']} lr {g['lr']:g}"


def plot_curves(result: dict, path: str) -> None:
    """Eval loss against tokens: per (rung, LR) the mean over seeds at each evaluation, the band between the
    seeds' lowest and highest, and an x where a seed diverged."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for g in result["groups"]:
        by_tokens: dict[int, list[float]] = {}
        for run in g["runs"]:
            for _, tokens, loss in run["evals"]:
                by_tokens.setdefault(tokens, []).append(loss)
        if not by_tokens:
            continue
        xs = sorted(by_tokens)
        (line,) = ax.plot(xs, [sum(by_tokens[x]) / len(by_tokens[x]) for x in xs], label=_label(g), lw=1.2)
        lo, hi = [min(by_tokens[x]) for x in xs], [max(by_tokens[x]) for x in xs]
        ax.fill_between(xs, lo, hi, color=line.get_color(), alpha=0.2, lw=0)
        for run in g["runs"]:
            if run["outcome"] == "diverged" and run["evals"]:
                ax.plot(run["evals"][-1][1], run["evals"][-1][2], "x", color=line.get_color(), ms=9)
    ax.axhline(result["target_eval_loss"], color="k", ls="--", lw=0.8, label="target")
    ax.set(xlabel="training tokens", ylabel="eval loss (nats/token)", title="eval loss (band: seed range)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    _save(fig, path)


def plot_overhead(result: dict, path: str) -> None:
    """Token overhead against the baseline, error bars one standard error; groups without an estimate are
    labelled with their seeds' outcome."""
    plt = _pyplot()
    groups = result["groups"]
    fig, ax = plt.subplots(figsize=(max(5, 0.9 * len(groups)), 4.5))
    for i, g in enumerate(groups):
        value = g["token_overhead"]
        if value is None:
            ax.text(i, 0, _missing(g), rotation=90, ha="center", va="bottom", fontsize=7)
            continue
        err = g["token_overhead_se"]
        ax.bar(i, 100 * value, yerr=None if err is None else 100 * err, capsize=4, color="C0")
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xticks(range(len(groups)), [_label(g) for g in groups], rotation=30, ha="right", fontsize=8)
    ax.set(ylabel="token overhead vs baseline (%)", title="token overhead (± 1 s.e.)")
    ax.grid(alpha=0.3, axis="y")
    _save(fig, path)


def _missing(g: dict) -> str:
    counts = {k: v for k, v in g["counts"].items() if v}
    return ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in counts.items())


def plot_lr(curves: dict, path: str) -> None:
    """Final eval loss against peak LR (log x), mean ± sd over seeds; an x on the top edge where every seed
    diverged at that LR."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    finite = [row[1] for rows in curves.values() for row in rows if row[1] is not None]
    top = max(finite) + 0.05 * (max(finite) - min(finite) + 1e-3) if finite else 1.0
    for rung, rows in curves.items():
        ok = [r for r in rows if r[1] is not None]
        (line,) = ax.plot([r[0] for r in ok], [r[1] for r in ok], marker="o", label=rung)
        sds = [r[2] if r[2] is not None and math.isfinite(r[2]) else 0.0 for r in ok]
        ax.errorbar([r[0] for r in ok], [r[1] for r in ok], yerr=sds, fmt="none", color=line.get_color())
        gone = [r[0] for r in rows if r[1] is None and r[4]]
        ax.plot(gone, [top] * len(gone), "x", color=line.get_color(), ms=9, clip_on=False)
    ax.set_xscale("log")
    ax.set(xlabel="peak learning rate", ylabel="final eval loss (nats/token)")
    ax.set_title("LR sensitivity (x: every seed diverged)")
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7)
    _save(fig, path)


def plot_diagnostics(result: dict, path: str) -> None:
    """Top: each GEMM's output relative error (mean over layer kinds) against step, one line a (rung, LR)
    (its first probed seed). Bottom: the last probe's error by layer kind, bars grouped by rung."""
    plt = _pyplot()
    probed = [(g, _first_diag(g)) for g in result["groups"] if _first_diag(g)]
    width = 0.8 / max(len(probed), 1)
    fig, axes = plt.subplots(2, 3, figsize=(15, 8))
    for col, gemm in enumerate(GEMMS):
        top, bottom = axes[0][col], axes[1][col]
        for i, (g, d) in enumerate(probed):
            if gemm in d["out_rel_err"]:
                top.plot(d["steps"], d["out_rel_err"][gemm], marker=".", label=_label(g))
            values = {k.split("/")[0]: v for k, v in d["last_out_rel_err"].items() if k.endswith("/" + gemm)}
            bottom.bar([j + i * width for j in range(len(values))], list(values.values()), width=width)
            bottom.set_xticks([j + 0.4 - width / 2 for j in range(len(values))], list(values))
        top.set(yscale="log", xlabel="step", ylabel="output relative error", title=f"{gemm} over training")
        bottom.set(yscale="log", ylabel="output relative error", title=f"{gemm} by layer kind (last probe)")
        top.grid(alpha=0.3, which="both")
        bottom.grid(alpha=0.3, axis="y")
    axes[0][0].legend(fontsize=7)
    _save(fig, path)


def _first_diag(g: dict) -> dict | None:
    run = first_probed(g)
    return run and run["diagnostics"]


FOREST_XLABEL = "token overhead (iso-loss, 95 % interval)"


def plot_forest(rows: list[tuple[str, dict]], band: float, path: str, xlabel: str = FOREST_XLABEL) -> None:
    """(label, token overhead with ci_low / ci_high) per row, top to bottom, each with its 95 % interval;
    +-band shaded (claim (c)'s equivalence band)."""
    plt = _pyplot()
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7, 0.4 * len(rows) + 1.5))
    ys = list(range(len(rows)))[::-1]
    for y, (_, t) in zip(ys, rows, strict=True):
        err = [[t["overhead"] - t["ci_low"]], [t["ci_high"] - t["overhead"]]]
        ax.errorbar(t["overhead"], y, xerr=err, fmt="o")
    ax.axvline(0, color="k", lw=0.8)
    ax.axvspan(-band, band, color="0.9", zorder=0)
    ax.set_yticks(ys, [label for label, _ in rows], fontsize=8)
    ax.set(xlabel=xlabel, title="arms against fp8, and the contrasts")
    ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.grid(alpha=0.3, axis="x")
    _save(fig, path)


def plot_forest_by_design(
    labels: list[str], series: dict[str, list], band: float, path: str, xlabel: str = FOREST_XLABEL
) -> None:
    """One row per label, one marker per design (series: design -> a token-overhead dict with ci_low /
    ci_high, or None, per label), each with its 95 % interval, offset within the row; +-band shaded."""
    plt = _pyplot()
    import matplotlib.ticker

    fig, ax = plt.subplots(figsize=(7.5, 0.55 * len(labels) + 1.8))
    ys = list(range(len(labels)))[::-1]
    step = 0.6 / max(len(series), 1)
    for i, (design, rows) in enumerate(series.items()):
        offset = 0.3 - step * (i + 0.5)
        points = [(y + offset, t) for y, t in zip(ys, rows, strict=True) if t and t["overhead"] is not None]
        if not points:
            continue
        y, t = zip(*points, strict=True)
        low = [r["overhead"] - r["ci_low"] for r in t]
        high = [r["ci_high"] - r["overhead"] for r in t]
        ax.errorbar([r["overhead"] for r in t], y, xerr=[low, high], fmt="o", ms=4, label=design)
    ax.axvline(0, color="k", lw=0.8)
    ax.axvspan(-band, band, color="0.9", zorder=0)
    ax.set_yticks(ys, labels, fontsize=8)
    ax.set(xlabel=xlabel, title="the contrasts, by design")
    ax.xaxis.set_major_formatter(matplotlib.ticker.PercentFormatter(1.0))
    ax.grid(alpha=0.3, axis="x")
    ax.legend(fontsize=8, loc="upper left")  # the top rows sit right of zero
    _save(fig, path)


def plot_branches(result: dict, path: str) -> None:
    """A branch stage (branching.analyze's dict): one panel per branch step, each arm's eval loss minus the
    baseline's branch from the same trunk against tokens, the mean over trunks and each trunk's points."""
    plt = _pyplot()
    points = [p for p in result["points"] if p["evals"]]
    if not points:
        return
    fig, axes = plt.subplots(1, len(points), figsize=(6 * len(points), 4.5), squeeze=False)
    for ax, point in zip(axes[0], points, strict=True):
        xs = [e["tokens"] for e in point["evals"]]
        arms = [a for a in point["evals"][-1]["arms"] if a != result["baseline"]]
        for i, arm in enumerate(arms):
            rows = [e["arms"].get(arm) for e in point["evals"]]
            mean = [math.nan if not r or r["mean_difference"] is None else r["mean_difference"] for r in rows]
            # Ten colours in matplotlib's cycle: the next ten arms repeat them dashed, so no two look alike.
            style = {"color": f"C{i % 10}", "ls": ("-", "--", ":")[i // 10 % 3]}
            (line,) = ax.plot(xs, mean, label=arm, lw=1.2, **style)
            for x, r in zip(xs, rows, strict=True):
                for d in (r or {}).get("difference", {}).values():
                    ax.plot(x, d, ".", color=line.get_color(), ms=3, alpha=0.5)
        ax.axhline(0, color="k", lw=0.8)
        ax.set(
            xlabel="tokens",
            ylabel=f"eval loss - {result['baseline']} branch (nats)",
            title=f"branched at step {point['at']}",
        )
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    _save(fig, path)


def plot_lr_series(result: dict, path: str) -> None:
    """An LR series (lr_stress.series's dict): each arm's eval loss minus the baseline's at the same peak
    LR, against the LR's multiple of the study's: each seed (dots), their mean (line), a run without the
    metric (diverged or failed) as an x on the upper edge (black: the baseline's), and each cell's counted
    spikes beside it."""
    plt = _pyplot()
    points, base = result["points"], result["baseline"]
    xs = [p["peak_lr"] / points[0]["peak_lr"] for p in points]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    arms = [a for a in result["arms"] if a != base]
    for i, arm in enumerate(arms):
        color, cells = f"C{i}", [p["arms"][arm] for p in points]
        shown = [(x, c["difference"]) for x, c in zip(xs, cells, strict=True) if c["difference"] is not None]
        ax.plot([x for x, _ in shown], [d for _, d in shown], "-", color=color, label=arm, lw=1.2)
        for x, cell in zip(xs, cells, strict=True):
            seeds = [d for d in cell["per_seed"].values() if d is not None]
            ax.plot([x] * len(seeds), seeds, "o", color=color, ms=4, alpha=0.6)
            lost = [m for m in cell["no_metric"] if m["outcome"] != "not run"]
            if lost:  # at the top of the axes, whatever the data's range
                ax.plot(x, 0.97, "x", color=color, ms=8, transform=ax.get_xaxis_transform(), clip_on=False)
            if cell["spikes"]:
                ax.annotate(f"{cell['spikes']} sp.", (x, 0.92 - 0.05 * i), xycoords=("data", "axes fraction"),
                            color=color, fontsize=7, ha="center")  # fmt: skip
    for x, point in zip(xs, points, strict=True):  # the baseline's own lost runs leave no difference
        if any(m["outcome"] != "not run" for m in point["arms"][base]["no_metric"]):
            ax.plot(x, 0.97, "x", color="k", ms=8, transform=ax.get_xaxis_transform(), clip_on=False)
    ax.axhline(0, color="k", lw=0.8)
    ax.set_xscale("log", base=2)
    ax.set_xticks(xs, [p["label"] for p in points])
    ax.set(
        xlabel="peak LR, multiple of the study's",
        ylabel=f"eval loss - {base} at the same LR (nats)",
        title="LR stress: x = a run without the metric (diverged); sp. = spikes counted",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    _save(fig, path)


def claims_forest(result: dict, h, path: str) -> None:
    """Each arm's and contrast's token overhead with its 95 % interval (plot_forest), in the unit
    the bands apply in: per branch token in a branch design."""
    every = result["versus_baseline"] + result["contrasts"] + result["derived"] + result["reported"]
    rows = [(_claim_label(r, h), claims.band_tokens(r)) for r in every if _plotted(claims.band_tokens(r))]
    branch = result.get("trunk_tokens") is not None
    unit = "token overhead per branch token" if branch else "token overhead"
    plot_forest(rows, h.token_band, path, xlabel=f"{unit} (iso-loss, 95 % interval)")


def _plotted(tok: dict) -> bool:
    return all(tok[k] is not None for k in ("overhead", "ci_low", "ci_high"))


def claims_by_design(results: dict[str, dict], h, path: str) -> None:
    """The pre-registered contrasts (and full against the baseline) of several analyses side by side:
    results maps a design's name (e.g. "from scratch", "branched at 250") to its `analyze` dict. Token
    overheads in the unit the bands apply in (per branch token for a branch design)."""
    names = ["full - fp8", *h.contrasts, *h.derived]
    labels, series = [], {design: [] for design in results}
    for name in names:
        found = {d: _find_row(r, name) for d, r in results.items()}
        if not any(found.values()):
            continue
        labels.append(_claim_label(next(row for row in found.values() if row), h))
        for design, row in found.items():
            tok = row and claims.band_tokens(row)
            series[design].append(tok if tok and _plotted(tok) else None)
    xlabel = "token overhead, iso-loss, 95 % (branched: per branch token)"
    plot_forest_by_design(labels, series, h.token_band, path, xlabel=xlabel)


def _find_row(result: dict, name: str) -> dict | None:
    rows = result["versus_baseline"] + result["contrasts"] + result["derived"]
    return next((r for r in rows if r["name"] == name), None)


def _claim_label(row: dict, h) -> str:
    if row["name"] in h.derived:
        return f"{row['name']}: " + weights_text(row["weights"])
    if row["name"] not in {**h.contrasts, **h.reported} or " " in row["name"]:
        return row["name"]
    return f"{row['name']}: " + " - ".join(
        a for a, _ in sorted(row["weights"].items(), key=lambda kv: -kv[1])
    )


def _save(fig, path: str) -> None:
    fig.tight_layout()
    save_png(fig, path, dpi=120)


def plot_all(result: dict, out: str) -> list[str]:
    """OUT.png (curves), OUT_overhead.png, OUT_lr.png when the runs swept the LR and OUT_diagnostics.png when
    runs were probed; returns the paths."""
    paths = [out + ".png", out + "_overhead.png"]
    plot_curves(result, paths[0])
    plot_overhead(result, paths[1])
    if result["lr_sensitivity"]:
        paths.append(out + "_lr.png")
        plot_lr(result["lr_sensitivity"], paths[-1])
    if any(_first_diag(g) for g in result["groups"]):
        paths.append(out + "_diagnostics.png")
        plot_diagnostics(result, paths[-1])
    return paths


def plot_trend(result: dict, path: str) -> str:
    """The scale trend (study.trend): Wgrad's share and H16's recovery against parameters, one colour per
    tokens per step, pooled Fieller intervals as bars (an unbounded one as an open marker), the
    references as stars; returns the path."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    points = result["settings"] + [
        {**ref, "label": name, "reference": True} for name, ref in result["references"].items()
    ]
    batches = sorted({p["tokens_per_step"] for p in points})
    colour = {b: f"C{i % 10}" for i, b in enumerate(batches)}
    titles = {"wgrad_share": "Wgrad's share of full's cost", "h16_recovery": "H16's recovery of full's cost"}
    for ax, measure in zip(axes, titles, strict=True):
        for p in points:
            value, c = p.get(measure), colour[p["tokens_per_step"]]
            if value is None:
                continue
            if p.get("reference"):
                ax.plot(p["params"], value, "*", ms=14, color=c)
                ax.annotate(
                    p["label"], (p["params"], value), xytext=(6, 6), textcoords="offset points", fontsize=7
                )
                continue
            bounded = value["lo"] is not None
            err = [[value["estimate"] - value["lo"]], [value["hi"] - value["estimate"]]] if bounded else None
            face = c if bounded else "none"
            ax.errorbar(p["params"], value["estimate"], yerr=err, fmt="o", color=c, mfc=face, capsize=4)
        for p in result["settings"]:  # settings planned but not run: a grey mark on the axis
            if p["status"] == "not run":
                ax.plot(p["params"], 0, "|", ms=14, color="0.6", transform=ax.get_xaxis_transform())
        ax.axhline(0, color="k", lw=0.8)
        ax.set(xscale="log", xlabel="parameters (grey: planned, not run)", title=titles[measure])
        ticks = [1e8, 3e8, 1e9, 3e9, 1e10]
        ax.set_xticks(ticks, ["100M", "300M", "1B", "3B", "10B"])
        ax.set_xticks([], minor=True)
        ax.set_xlim(8e7, 1.5e10)
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("share (pooled Fieller 95 %)")
    for b in batches:
        axes[1].plot([], [], "o", color=colour[b], label=f"{b:,} tokens / step")
    axes[1].legend(fontsize=8, loc="lower right")
    fig.tight_layout()
    save_png(fig, path, dpi=120)
    return path


def plot_instrument_trend(sets: list[dict], path: str) -> str:
    """The instruments across tokens per step (study.instrument_trend): per GEMM stage alone in MXFP4, the
    gradient's error against minibatch noise and the update's relative error, one line per stage (one
    line style per set); point figures, no intervals. Returns the path."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2))
    panels = (
        ("noise_ratio", "gradient error / minibatch noise"),
        ("update_rel_err", "update relative error"),
    )
    styles = ("-", "--", ":", "-.")
    for ax, (field, title) in zip(axes, panels, strict=True):
        for i, entry in enumerate(sets):
            x = [row["tokens_per_step"] for row in entry["rows"]]
            for j, stage in enumerate(("fprop", "dgrad", "wgrad")):
                y = [row[stage][field] for row in entry["rows"]]
                label = f"{stage}, {entry['label']}" if len(sets) > 1 else stage
                ax.plot(x, y, styles[i % len(styles)], marker="o", color=f"C{j}", label=label)
        ax.set(xscale="log", yscale="log", xlabel="tokens per step (gradient accumulation)", title=title)
        ticks = sorted({row["tokens_per_step"] for entry in sets for row in entry["rows"]})
        ax.set_xticks(ticks, [f"{t // 1024}k" for t in ticks])
        ax.set_xticks([], minor=True)
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8)
    fig.suptitle("One GEMM stage in MXFP4 at a time, against bf16, on one FP8 checkpoint", fontsize=10)
    fig.tight_layout()
    save_png(fig, path, dpi=120)
    return path
