"""The study's statistics on synthetic data with planted effects and known noise: the paired arm x block
model against independent least-squares references (balanced and with missing cells), its intervals'
coverage over many simulated tables (and the under-coverage of a wrong df or SE), Holm's family-wise error
under the null, paired against unpaired, the fitted-curve token overhead recovering a planted overhead with
covering intervals, the per-run metrics, and the errors.

Coverage checks: n tables, nominal 0.95; the count must lie within 4 binomial sd of 0.95 n (seeded, so
deterministic; a wrong df or SE moves it further than that, as the tests show).
"""

import dataclasses
import math

import numpy as np
import pytest
import scipy.stats

from fp4jax.study import analysis, stats
from fp4jax.study.runs import Eval

ARMS = ("fp8", "fprop", "fprop_dgrad", "full")
EFFECTS = np.array([0.0, 0.05, 0.07, 0.30])  # planted arm effects
BLOCK_SD, NOISE_SD = 0.5, 0.05
N_TABLES = 2000
MISSING = ((1, 0), (3, 2))  # (arm, block) cells never observed in the coverage tables
DIFF = {"full": 1, "fprop_dgrad": -1}
ACROSS_GAPS = {"full": 1, "fprop": -1}  # both arms miss a cell, in different blocks
DIFF_OF_DIFFS = {"full": 1, "fprop_dgrad": -1, "fprop": -1, "fp8": 1}  # (full - fprop_dgrad) - (fprop - fp8)


def binomial_band(n: int, p: float = 0.95) -> tuple[float, float]:
    sd = math.sqrt(n * p * (1 - p))
    return n * p - 4 * sd, n * p + 4 * sd


def simulated_table(rng, effects=EFFECTS, n_blocks=3, block_sd=BLOCK_SD, missing=MISSING):
    y = (
        effects[:, None]
        + rng.normal(0, block_sd, n_blocks)[None, :]
        + rng.normal(0, NOISE_SD, (len(effects), n_blocks))
    )
    for cell in missing:
        y[cell] = np.nan
    return 1.0 + y


def truth(weights):
    return sum(w * EFFECTS[ARMS.index(a)] for a, w in weights.items())


# ----------------------------------------------------------------------- against independent references


def test_balanced_table_matches_two_way_anova():
    rng = np.random.default_rng(1)
    y = simulated_table(rng, missing=(), n_blocks=5)
    fit = stats.fit_additive(y, ARMS)
    resid = y - y.mean(1, keepdims=True) - y.mean(0, keepdims=True) + y.mean()
    sigma2 = (resid**2).sum() / ((4 - 1) * (5 - 1))
    row = stats.contrast(fit, DIFF)
    assert fit.df == 12
    assert row["estimate"] == pytest.approx(y[3].mean() - y[2].mean(), abs=1e-12)
    assert row["se"] == pytest.approx(math.sqrt(2 * sigma2 / 5), rel=1e-10)
    t_half = scipy.stats.t.ppf(0.975, 12) * row["se"]
    assert (row["ci_low"], row["ci_high"]) == pytest.approx(
        (row["estimate"] - t_half, row["estimate"] + t_half)
    )
    assert row["p"] == pytest.approx(2 * scipy.stats.t.sf(abs(row["estimate"] / row["se"]), 12))


def reference_coded_fit(y):
    """Full-rank design (intercept, arms 1.., blocks 1..), solved from the normal equations."""
    cells = [(i, j) for i in range(y.shape[0]) for j in range(y.shape[1]) if not np.isnan(y[i, j])]
    x = np.zeros((len(cells), y.shape[0] + y.shape[1] - 1))
    for r, (i, j) in enumerate(cells):
        x[r, 0] = 1
        if i:
            x[r, i] = 1
        if j:
            x[r, y.shape[0] - 1 + j] = 1
    v = np.array([y[c] for c in cells])
    xtx_inv = np.linalg.inv(x.T @ x)
    beta = xtx_inv @ x.T @ v
    df = len(cells) - x.shape[1]
    return beta, xtx_inv, ((v - x @ beta) ** 2).sum() / df, df


@pytest.mark.parametrize("weights", [DIFF, DIFF_OF_DIFFS])
def test_missing_cells_match_a_reference_coded_fit(weights):
    rng = np.random.default_rng(2)
    y = simulated_table(rng, n_blocks=4, missing=MISSING + ((0, 3),))
    beta, xtx_inv, sigma2, df = reference_coded_fit(y)
    c = np.zeros(beta.size)
    for arm, w in weights.items():
        if ARMS.index(arm):
            c[ARMS.index(arm)] = w
    row = stats.contrast(stats.fit_additive(y, ARMS), weights)
    assert row["df"] == df == 16 - 3 - 7
    assert row["estimate"] == pytest.approx(c @ beta, abs=1e-12)
    assert row["se"] == pytest.approx(math.sqrt(sigma2 * c @ xtx_inv @ c), rel=1e-10)


def test_cells_to_table_places_cells_and_leaves_the_rest_missing():
    y, arms, blocks = stats.cells_to_table({("a", "s1"): 1.0, ("b", "s0"): 2.0, ("b", "s1"): 3.0})
    assert arms == ("a", "b") and blocks == ("s0", "s1")
    np.testing.assert_array_equal(y, [[np.nan, 1.0], [2.0, 3.0]])


# ------------------------------------------------------------------------------------------- coverage


@pytest.fixture(scope="module")
def coverage_runs():
    """N_TABLES fits of 4 arms x 3 blocks with 2 missing cells (df = 10 - 6 = 4), two contrasts each."""
    rng = np.random.default_rng(3)
    rows = {"diff": [], "dod": [], "gaps": []}
    for _ in range(N_TABLES):
        fit = stats.fit_additive(simulated_table(rng), ARMS)
        rows["diff"].append({**stats.contrast(fit, DIFF), "sigma2": fit.sigma2})
        rows["dod"].append({**stats.contrast(fit, DIFF_OF_DIFFS), "sigma2": fit.sigma2})
        rows["gaps"].append({**stats.contrast(fit, ACROSS_GAPS), "sigma2": fit.sigma2})
    fields = ("estimate", "se", "ci_low", "ci_high", "df", "sigma2")
    return {k: {f: np.array([r[f] for r in v]) for f in fields} for k, v in rows.items()}


@pytest.mark.parametrize("name, weights", [("diff", DIFF), ("dod", DIFF_OF_DIFFS), ("gaps", ACROSS_GAPS)])
def test_estimates_are_unbiased_and_intervals_cover(coverage_runs, name, weights):
    runs = coverage_runs[name]
    assert (runs["df"] == 4).all()
    assert runs["sigma2"].mean() == pytest.approx(NOISE_SD**2, rel=0.1)  # pooled variance unbiased
    estimate = runs["estimate"]
    assert abs(estimate.mean() - truth(weights)) < 4 * estimate.std() / math.sqrt(N_TABLES)
    # The SE is right on average: mean of SE^2 matches the estimates' variance (within 10 %, ~4 sd at 2000).
    assert np.mean(runs["se"] ** 2) == pytest.approx(estimate.var(), rel=0.1)
    covered = np.sum((runs["ci_low"] <= truth(weights)) & (truth(weights) <= runs["ci_high"]))
    low, high = binomial_band(N_TABLES)
    assert low <= covered <= high


def test_wrong_df_or_wrong_se_under_covers(coverage_runs):
    """What the coverage test would catch: a normal quantile with 4 df, or the SE of a complete table
    sqrt(2 sigma^2 / 3), blind to the missing cells (the right variance factor is 1.2, not 2 / 3)."""
    runs, target = coverage_runs["gaps"], truth(ACROSS_GAPS)
    low, _ = binomial_band(N_TABLES)
    normal = np.sum(np.abs(runs["estimate"] - target) <= 1.959964 * runs["se"])
    t = scipy.stats.t.ppf(0.975, 4)
    complete = np.sum(np.abs(runs["estimate"] - target) <= t * np.sqrt(2 * runs["sigma2"] / 3))
    assert normal < low and complete < low


# ------------------------------------------------------------------------------------------------ Holm


def test_holm_adjusts_by_the_step_down_rule():
    np.testing.assert_allclose(stats.holm([0.01, 0.04, 0.03, 0.005]), [0.03, 0.06, 0.06, 0.02])
    np.testing.assert_allclose(stats.holm([0.5, 0.9]), [1.0, 1.0])


def test_holm_controls_family_wise_error_under_the_null():
    rng = np.random.default_rng(4)
    null = np.zeros(5)
    arms = ARMS + ("full_h16",)
    family = {f"{a} - fp8": {a: 1, "fp8": -1} for a in arms[1:]}
    any_holm = any_raw = 0
    for _ in range(N_TABLES):
        rows = stats.contrast_family(stats.fit_additive(simulated_table(rng, null, missing=()), arms), family)
        any_holm += any(r["reject"] for r in rows)
        any_raw += any(r["p"] <= 0.05 for r in rows)
    sd = math.sqrt(N_TABLES * 0.05 * 0.95)
    assert any_holm <= N_TABLES * 0.05 + 4 * sd  # at most nominal (Holm is conservative for correlated tests)
    assert any_holm >= N_TABLES * 0.02  # not vacuous
    assert any_raw > N_TABLES * 0.05 + 4 * sd  # without the correction, the family errs more often


# ------------------------------------------------------------------------------------ paired vs unpaired


def test_welch_matches_its_formula():
    a, b = np.array([1.0, 2.0, 3.5, np.nan]), np.array([2.0, 3.0, 5.0, 6.0])
    row = stats.welch(a, b)
    va, vb = np.var(a[:3], ddof=1) / 3, np.var(b, ddof=1) / 4
    df = (va + vb) ** 2 / (va**2 / 2 + vb**2 / 3)
    assert row["estimate"] == pytest.approx(a[:3].mean() - b.mean())
    assert row["se"] == pytest.approx(math.sqrt(va + vb)) and row["df"] == pytest.approx(df)
    assert row["ci_high"] - row["estimate"] == pytest.approx(
        scipy.stats.t.ppf(0.975, df) * math.sqrt(va + vb)
    )


def test_paired_beats_unpaired_when_blocks_dominate():
    rng = np.random.default_rng(5)
    effects, arms, n = np.array([0.0, 0.1]), ("fp8", "full"), 1000
    paired, unpaired = [], []
    for _ in range(n):
        y = simulated_table(rng, effects, n_blocks=6, block_sd=10 * NOISE_SD, missing=())
        paired.append(stats.contrast(stats.fit_additive(y, arms), {"full": 1, "fp8": -1}))
        unpaired.append(stats.welch(y[1], y[0]))
    width = {
        k: np.mean([r["ci_high"] - r["ci_low"] for r in rows]) for k, rows in (("p", paired), ("u", unpaired))
    }
    cover = {
        k: sum(r["ci_low"] <= 0.1 <= r["ci_high"] for r in rows)
        for k, rows in (("p", paired), ("u", unpaired))
    }
    low, high = binomial_band(n)
    assert low <= cover["p"] <= high
    assert cover["u"] >= low  # Welch ignores the shared block: valid but over-wide
    assert width["p"] < 0.25 * width["u"]


# --------------------------------------------------------------------------------- the fitted curve

E, A, ALPHA = 2.6, 400.0, 0.38
TOKENS = np.linspace(2e6, 3.2e7, 16)
CURVE_SD = 0.02  # eval-loss noise around the baseline's curve


def curve_loss(tokens):
    return E + A * np.asarray(tokens, dtype=float) ** -ALPHA


def test_power_law_fit_recovers_a_noiseless_curve():
    curve = stats.fit_power_law(np.tile(TOKENS, 2), np.tile(curve_loss(TOKENS), 2))
    assert (curve.E, curve.A, curve.alpha) == pytest.approx((E, A, ALPHA), rel=1e-6)
    assert curve.tokens_at(float(curve_loss(1e7))) == pytest.approx(1e7, rel=1e-6)
    assert curve.tokens_at(E - 0.1) == math.inf


def test_power_law_fit_is_the_least_squares_minimum_to_rounding():
    """On noisy points (a long flat valley: E's s.e. is most of E), the fit is the minimum itself: no
    bounded least-squares solve from nearby starts finds a lower sum of squares, the residuals are
    orthogonal to the model's Jacobian, a 1-ulp change in the data moves no parameter beyond 1e-9, and
    the covariance is the residual variance times (J^T J)^-1 computed here from the normal equations."""
    rng = np.random.default_rng(11)
    loss = curve_loss(TOKENS) + rng.normal(0, CURVE_SD, TOKENS.size)
    curve = stats.fit_power_law(TOKENS, loss)
    p = np.array([curve.E, curve.B, curve.alpha])
    t = TOKENS / curve.t_ref

    def residuals(q):
        return q[0] + q[1] * t ** -q[2] - loss

    rss = float(np.sum(residuals(p) ** 2))
    bounds = ([0.0, 1e-12, 1e-3], [float(loss.min()), np.inf, 5.0])
    for factor in (0.9, 1.1):
        other = scipy.optimize.least_squares(residuals, p * factor, bounds=bounds, ftol=1e-15, xtol=1e-15)
        assert rss <= float(np.sum(other.fun**2)) * (1 + 1e-12)
    x = t**-curve.alpha
    jacobian = np.stack([np.ones_like(x), x, -curve.B * x * np.log(t)], axis=1)
    assert np.abs(jacobian.T @ residuals(p)).max() < 1e-12 * np.abs(jacobian).sum(axis=0).max()
    nudged = stats.fit_power_law(
        TOKENS, loss * (1 + rng.choice([-1.0, 1.0], loss.size) * np.finfo(float).eps)
    )
    assert np.array([nudged.E, nudged.B, nudged.alpha]) == pytest.approx(p, rel=1e-9)
    want = np.linalg.inv(jacobian.T @ jacobian) * rss / (TOKENS.size - 3)
    assert curve.cov == pytest.approx(want, rel=1e-6)


def test_overhead_is_exact_for_a_stretched_curve_over_a_window():
    curve = stats.fit_power_law(TOKENS, curve_loss(TOKENS))
    window = TOKENS[-3:]
    for rho in (0.9, 1.0, 1.15):
        delta = float(np.mean(curve_loss(window / rho) - curve_loss(window)))
        row = stats.iso_loss_overhead(curve, window, delta, 1e-3, 8)
        assert row["overhead"] == pytest.approx(rho - 1, abs=1e-6)
        assert (row["note"] is None) == (rho >= 1)  # a better arm's loss lies beyond the baseline's last eval
    assert "extrapolated" in stats.iso_loss_overhead(curve, window, -0.01, 1e-3, 8)["note"]


def test_overhead_below_the_asymptote_is_not_reported():
    curve = stats.fit_power_law(TOKENS, curve_loss(TOKENS))
    row = stats.iso_loss_overhead(curve, TOKENS[-1], -(curve_loss(TOKENS[-1]) - E) - 0.01, 1e-3, 8)
    assert row["overhead"] is None and row["ci_low"] is None and "asymptote" in row["note"]
    assert set(row) == set(stats.iso_loss_overhead(curve, TOKENS[-1], 0.01, 1e-3, 8))  # one schema


def test_curve_error_matches_a_numerical_gradient():
    rng = np.random.default_rng(6)
    curve = stats.fit_power_law(TOKENS, curve_loss(TOKENS) + rng.normal(0, 0.01, TOKENS.size))
    window, delta = TOKENS[-2:], 0.03
    row = stats.iso_loss_overhead(curve, window, delta, 0.0, 8)

    def overhead(params):
        e, b, alpha = params
        moved = dataclasses.replace(curve, E=e, B=b, alpha=alpha)
        return stats.iso_loss_overhead(moved, window, delta, 0.0, 8)["overhead"]

    p = np.array([curve.E, curve.B, curve.alpha])
    steps = 1e-6 * np.abs(p)
    grad = np.array([(overhead(p + s) - overhead(p - s)) / (2 * s[i]) for i, s in enumerate(np.diag(steps))])
    assert row["se_from_curve"] == pytest.approx(math.sqrt(grad @ curve.cov @ grad), rel=1e-4)
    assert row["se_from_loss"] == 0.0


def test_overhead_recovers_a_planted_overhead_and_its_interval_covers():
    """The baseline's curve observed with noise sd CURVE_SD at 16 evals; the arm = the baseline stretched by
    1.08 in tokens, its loss contrast observed with sd 0.001 and an SE estimated with 8 df. The curve's
    error is most of the total here: intervals from the contrast's SE alone under-cover."""
    rng = np.random.default_rng(7)
    planted, window, df, sd, n = 0.08, TOKENS[-2:], 8, 0.001, 300
    delta_true = float(np.mean(curve_loss(window / (1 + planted)) - curve_loss(window)))
    rows = []
    for _ in range(n):
        curve = stats.fit_power_law(TOKENS, curve_loss(TOKENS) + rng.normal(0, CURVE_SD, TOKENS.size))
        delta_se = sd * math.sqrt(rng.chisquare(df) / df)
        rows.append(stats.iso_loss_overhead(curve, window, delta_true + rng.normal(0, sd), delta_se, df))
    estimate = np.array([r["overhead"] for r in rows])
    assert abs(estimate.mean() - planted) < 4 * estimate.std() / math.sqrt(n)
    low, high = binomial_band(n)
    assert low <= sum(r["ci_low"] <= planted <= r["ci_high"] for r in rows) <= high
    loss_only = scipy.stats.t.ppf(0.975, df) * np.array([r["se_from_loss"] for r in rows])
    assert np.sum(np.abs(estimate - planted) <= loss_only) < low


# ------------------------------------------------------------------------------------------ run metrics


def evals_of(losses, every=100, tokens_per_step=1000):
    return [Eval(every * (i + 1), every * (i + 1) * tokens_per_step, v) for i, v in enumerate(losses)]


def test_the_primary_metric_averages_the_last_k_at_shared_tokens():
    runs = {"a": evals_of([4.0, 3.5, 3.2, 3.0]), "b": evals_of([4.1, 3.6, 3.4, 3.3])}
    means, tokens = stats.primary_metrics(runs, 2)
    assert means == pytest.approx({"a": 3.1, "b": 3.35}) and tokens == (300_000, 400_000)
    runs["c"] = evals_of([4.0, 3.5, 3.2], every=130)
    with pytest.raises(ValueError, match="different tokens"):
        stats.primary_metrics(runs, 2)
    with pytest.raises(ValueError, match="last 5 evals"):
        stats.primary_metric(runs["a"], 5)


def test_tokens_to_target_interpolates_as_the_ladder_does():
    evals = evals_of([4.0, 3.5, 3.2, 3.0])
    assert stats.tokens_to_target(evals, 3.3) == pytest.approx(200_000 + (3.5 - 3.3) / (3.5 - 3.2) * 100_000)
    assert stats.tokens_to_target(evals, 3.3) == analysis.crossing(evals, 3.3)["tokens"]
    assert stats.tokens_to_target(evals, 2.9) is None


def reference_spikes(losses, spike_nats, window):
    """Independent statement of the rule: rolling means; the lowest mean so far counts unflagged steps."""
    best, flagged = None, []
    for t in range(window - 1, len(losses)):
        mean = float(np.mean(losses[t - window + 1 : t + 1]))
        if best is not None and mean > best + spike_nats:
            flagged.append(t)
        else:
            best = mean if best is None else min(best, mean)
    episodes = []
    for t in flagged:
        if episodes and episodes[-1][1] == t - 1:
            episodes[-1][1] = t
        else:
            episodes.append([t, t])
    return episodes


def test_loss_spikes_count_episodes_of_the_trainers_rule():
    rng = np.random.default_rng(8)
    losses = 3.0 + 2.0 * np.exp(-np.arange(400) / 60) + rng.normal(0, 0.02, 400)
    losses[150:170] += 0.6  # a spike, recovered
    losses[300:305] += 0.5  # a shorter one
    steps = np.arange(1, 401)
    spikes = stats.loss_spikes(steps, losses, spike_nats=0.2, window=10)
    expected = reference_spikes(losses, 0.2, 10)
    assert len(spikes) == len(expected) == 2
    assert [[s["start_step"], s["end_step"]] for s in spikes] == [[steps[a], steps[b]] for a, b in expected]
    assert stats.loss_spikes(steps, 3.0 + 0 * losses, spike_nats=0.2, window=10) == []


# ---------------------------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "y, arms, weights, message",
    [
        (
            [[1.0, 2.0, np.nan, np.nan], [np.nan, np.nan, 3.0, 4.0]],
            ("a", "b"),
            {"a": 1, "b": -1},
            "not estimable",
        ),
        ([[1.0, 2.0], [3.0, np.nan]], ("a", "b"), {"a": 1, "b": -1}, "no residual degrees of freedom"),
        ([[1.0, 2.0], [3.0, 5.0], [1.0, 1.5]], ("a", "b", "c"), {"a": 1, "b": -2}, "sum to -1"),
        ([[1.0, 2.0], [3.0, 5.0], [1.0, 1.5]], ("a", "b", "c"), {"a": 1, "z": -1}, "arms \\['z'\\] not in"),
    ],
)
def test_contrast_errors(y, arms, weights, message):
    with pytest.raises(ValueError, match=message):
        stats.contrast(stats.fit_additive(np.array(y), arms), weights)


@pytest.mark.parametrize(
    "y, arms, message",
    [
        ([[1.0, 2.0], [np.nan, np.nan]], ("a", "b"), "no observed cell"),
        ([[1.0, 2.0], [3.0, np.inf]], ("a", "b"), "infinite"),
        ([[1.0, 2.0], [3.0, 4.0]], ("a",), "not \\(arms, blocks\\)"),
    ],
)
def test_table_errors(y, arms, message):
    with pytest.raises(ValueError, match=message):
        stats.fit_additive(np.array(y), arms)


def test_other_input_errors():
    with pytest.raises(ValueError, match="2 or more values a side"):
        stats.welch([1.0], [2.0, 3.0])
    with pytest.raises(ValueError, match="distinct token counts"):
        stats.fit_power_law(TOKENS[:3], curve_loss(TOKENS[:3]))
    with pytest.raises(ValueError, match="df > 0"):
        stats.iso_loss_overhead(stats.fit_power_law(TOKENS, curve_loss(TOKENS)), TOKENS[-1], 0.01, 1e-3, 0)
    with pytest.raises(ValueError, match="spike_nats > 0"):
        stats.loss_spikes([1, 2], [3.0, 3.0], spike_nats=0.0, window=1)
