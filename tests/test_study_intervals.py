"""The verdicts' intervals (docs/study_plan.md, amendment of 2026-12-05) against statsmodels and scipy: the
pooled arm x block contrasts and Holm's correction (hand-written in stats.py) against statsmodels' OLS
and multipletests; the paired t interval against statsmodels' one-sample t; Fieller's ratio interval
against the t tests it inverts, its unbounded sets, and its coverage of a planted share over simulated
tables; the overhead per branch token on a planted trunk + branch curve.

Coverage checks: n tables, nominal 0.95; the count must lie within 4 binomial sd of 0.95 n (seeded).
"""

import math

import numpy as np
import pytest

from fp4jax.study import stats

# statsmodels (and pandas, which it imports) are loaded by the tests that use them, not while every
# pytest-xdist worker collects this module (about 0.5 s each).

ARMS = ("fp8", "fprop_dgrad", "full", "full_sr")
SHARE_NUM = {"full": 1, "fprop_dgrad": -1}  # C1
SHARE_DEN = {"full": 1, "fp8": -1}  # full - fp8
EFFECTS = np.array([0.0, 0.02, 0.05, 0.05])  # a planted share of (0.05 - 0.02) / 0.05 = 0.6
PLANTED_SHARE = 0.6


def table(rng, n_blocks=3, noise_sd=0.005, block_sd=0.05, missing=()):
    y = EFFECTS[:, None] + rng.normal(0, block_sd, n_blocks) + rng.normal(0, noise_sd, (len(ARMS), n_blocks))
    for cell in missing:
        y[cell] = np.nan
    return 4.0 + y


def blocks(n):
    return tuple(f"seed{k}" for k in range(n))


def ols(y):
    """statsmodels' OLS of loss ~ arm + block over the observed cells (fp8 and seed0 the reference)."""
    import pandas as pd
    import statsmodels.formula.api as smf

    rows = [
        {"loss": y[i, j], "arm": arm, "block": f"seed{j}"}
        for i, arm in enumerate(ARMS)
        for j in range(y.shape[1])
        if not np.isnan(y[i, j])
    ]
    return smf.ols("loss ~ C(arm, Treatment('fp8')) + C(block)", pd.DataFrame(rows)).fit()


def ols_vector(result, weights):
    """A contrast over arms as a vector over the OLS parameters (the reference arm's effect is 0)."""
    vector = np.zeros(len(result.params))
    for arm, w in weights.items():
        name = f"C(arm, Treatment('fp8'))[T.{arm}]"
        if arm != "fp8":
            vector[list(result.params.index).index(name)] = w
    return vector


def ols_ratio_p(result, r):
    """statsmodels' two-sided p of num - r den = 0 (the test Fieller's interval inverts)."""
    vector = ols_vector(result, SHARE_NUM) - r * ols_vector(result, SHARE_DEN)
    return float(result.t_test(vector).pvalue)


# ------------------------------------------------------------------- hand-written code against statsmodels


@pytest.mark.parametrize("missing", [(), ((1, 0),), ((1, 0), (3, 2))])
def test_pooled_contrasts_match_statsmodels_ols(missing):
    y = table(np.random.default_rng(5), n_blocks=4, missing=missing)
    fit = stats.fit_additive(y, ARMS, blocks(4))
    reference = ols(y)
    for weights in (SHARE_NUM, SHARE_DEN, {"full": 1, "fprop_dgrad": -2, "fp8": 1}):
        ours = stats.contrast(fit, weights)
        theirs = reference.t_test(ols_vector(reference, weights))
        assert ours["estimate"] == pytest.approx(float(theirs.effect[0]), abs=1e-12)
        assert ours["se"] == pytest.approx(float(theirs.sd[0, 0]), rel=1e-9)
        assert ours["p"] == pytest.approx(float(theirs.pvalue), rel=1e-7)
        assert [ours["ci_low"], ours["ci_high"]] == pytest.approx(list(theirs.conf_int()[0]), rel=1e-9)
        assert ours["df"] == reference.df_resid


def test_holm_matches_statsmodels():
    from statsmodels.stats.multitest import multipletests

    p = np.random.default_rng(2).uniform(0, 0.2, 9)
    assert stats.holm(p) == pytest.approx(multipletests(p, method="holm")[1], abs=1e-15)


def test_paired_t_matches_statsmodels_one_sample_t():
    from statsmodels.stats.weightstats import DescrStatsW

    values = np.array([0.012, 0.004, 0.021, 0.009])
    ours = stats.paired_t(values)
    reference = DescrStatsW(values)
    t, p, df = reference.ttest_mean(0.0)
    assert (ours["t"], ours["p"], ours["df"]) == pytest.approx((t, p, df), rel=1e-12)
    assert [ours["ci_low"], ours["ci_high"]] == pytest.approx(list(reference.tconfint_mean()), rel=1e-12)
    assert ours["se"] == pytest.approx(reference.std_mean, rel=1e-12) and ours["n_blocks"] == 4


def test_block_values_use_only_blocks_where_every_weighted_arm_ended():
    y = table(np.random.default_rng(1), n_blocks=4, missing=((1, 0), (3, 2)))
    values, used = stats.block_values(y, ARMS, blocks(4), SHARE_NUM)  # full and fprop_dgrad: not seed0
    assert used == ("seed1", "seed2", "seed3")
    assert values == pytest.approx(y[2, 1:] - y[1, 1:])
    with pytest.raises(ValueError, match="not in the table"):
        stats.block_values(y, ARMS, blocks(4), {"nvidia": 1, "fp8": -1})
    with pytest.raises(ValueError, match="2 or more"):
        stats.paired_t([0.01])


# -------------------------------------------------------------------------------------------- Fieller


def test_pooled_fieller_ends_are_where_statsmodels_t_test_reaches_p_0_05():
    y = table(np.random.default_rng(3), n_blocks=3, missing=((0, 1),))
    share = stats.fit_ratio(stats.fit_additive(y, ARMS, blocks(3)), SHARE_NUM, SHARE_DEN)
    reference = ols(y)
    assert share["bounded"] and share["kind"] == "interval" and share["df"] == reference.df_resid
    assert share["lo"] < share["estimate"] < share["hi"]
    assert ols_ratio_p(reference, share["lo"]) == pytest.approx(0.05, abs=1e-7)
    assert ols_ratio_p(reference, share["hi"]) == pytest.approx(0.05, abs=1e-7)
    assert ols_ratio_p(reference, share["estimate"]) == pytest.approx(1.0)
    for r in np.linspace(share["lo"] - 1, share["hi"] + 1, 41):
        assert (ols_ratio_p(reference, r) >= 0.05) == (share["lo"] <= r <= share["hi"]), r


def paired_p(num, den, r):
    from statsmodels.stats.weightstats import DescrStatsW

    return DescrStatsW(np.asarray(num) - r * np.asarray(den)).ttest_mean(0.0)[1]


def test_paired_fieller_inverts_the_one_sample_t_test():
    num, den = [0.010, 0.004, 0.007, 0.006], [0.021, 0.015, 0.019, 0.020]
    share = stats.paired_ratio(num, den)
    assert share["bounded"] and share["df"] == 3 and share["n_blocks"] == 4
    assert share["estimate"] == pytest.approx(np.mean(num) / np.mean(den))
    for end in (share["lo"], share["hi"]):
        assert paired_p(num, den, end) == pytest.approx(0.05, abs=1e-9)


def test_fieller_is_unbounded_where_the_denominator_is_not_significant():
    """Two half-lines: the test rejects only inside the excluded interval; the whole line: never."""
    num, den = [0.010, 0.004, 0.007], [0.02, -0.004, 0.012]  # den's mean not significantly non-zero
    share = stats.paired_ratio(num, den)
    assert not share["bounded"] and share["kind"] == "two half-lines"
    assert share["lo"] is None and share["hi"] is None
    low, high = share["excluded"]
    for end in (low, high):
        assert paired_p(num, den, end) == pytest.approx(0.05, abs=1e-9)
    assert paired_p(num, den, (low + high) / 2) < 0.05
    assert paired_p(num, den, low - 1) > 0.05 and paired_p(num, den, high + 1) > 0.05

    num, den = [0.01, -0.01, 0.004], [0.01, 0.0, -0.012]  # neither mean significantly non-zero
    whole = stats.paired_ratio(num, den)
    assert whole["kind"] == "whole line" and not whole["bounded"]
    assert all(paired_p(num, den, r) > 0.05 for r in np.linspace(-50, 50, 201))
    assert stats.fieller(0.01, 0.0, 1e-6, 1e-6, 0.0, 5)["estimate"] is None


def covers(share, value):
    if share["bounded"]:
        return share["lo"] <= value <= share["hi"]
    if share["kind"] == "two half-lines":
        return not share["excluded"][0] < value < share["excluded"][1]
    return True


def test_fieller_intervals_cover_a_planted_share_at_the_nominal_rate():
    """400 simulated tables (3 blocks, the study's size) with Wgrad's share planted at 0.6, a denominator
    about 3 SE from 0 so some sets are unbounded: pooled (one cell missing) and paired both cover at 95 %."""
    rng = np.random.default_rng(11)
    n, pooled, paired, unbounded = 400, 0, 0, 0
    for _ in range(n):
        y = table(rng, n_blocks=3, noise_sd=0.012, missing=((3, 0),))
        share = stats.fit_ratio(stats.fit_additive(y, ARMS, blocks(3)), SHARE_NUM, SHARE_DEN)
        pooled += covers(share, PLANTED_SHARE)
        unbounded += not share["bounded"]
        by_block = stats.paired_ratio(y[2] - y[1], y[2] - y[0])
        paired += covers(by_block, PLANTED_SHARE)
    sd = math.sqrt(n * 0.95 * 0.05)
    assert 0.95 * n - 4 * sd <= pooled <= 0.95 * n + 4 * sd
    assert 0.95 * n - 4 * sd <= paired <= 0.95 * n + 4 * sd
    assert unbounded > 0  # the unbounded case occurs, and counts as covering only where it should


# ------------------------------------------------------------------------------- per branch token


def branch_curve():
    return stats.PowerLaw(
        E=3.0, B=1.2, alpha=0.35, t_ref=2e7, cov=np.zeros((3, 3)), df=10, residual_sd=0.0,
        tokens_range=(8e6, 3e7), loss_range=(4.0, 5.0),
    )  # fmt: skip


TRUNK = 19_660_800  # 600 updates of 32 x 1,024 tokens
METRIC_TOKENS = [TRUNK + 32_768 * k for k in (180, 200, 220, 240, 250)]


@pytest.mark.parametrize("planted", [0.08, -0.03, 0.0])
def test_per_branch_token_recovers_a_branch_stretched_in_branch_tokens(planted):
    """An arm whose branch is the baseline's stretched in branch tokens, L_arm(T) = L(T0 + (T - T0) / rho_b):
    its loss difference gives a whole-run overhead diluted by the trunk's tokens, and per branch token
    the planted rho_b - 1; the interval's ends map the same way."""
    curve, t = branch_curve(), np.array(METRIC_TOKENS, dtype=float)
    arm = curve.loss(TRUNK + (t - TRUNK) / (1 + planted))
    delta = float(arm.mean() - curve.loss(t).mean())
    whole = stats.iso_loss_overhead(curve, METRIC_TOKENS, delta, 0.001, 14)
    per_branch = stats.per_branch_token(curve, METRIC_TOKENS, TRUNK, whole)
    assert per_branch["overhead"] == pytest.approx(planted, abs=1e-9)
    dilution = (t.mean() - TRUNK) / t.mean()  # about 1 / 3.8 at the 600 branch point
    assert whole["overhead"] == pytest.approx(planted * dilution, abs=0.15 * abs(planted) + 1e-12)
    assert per_branch["ci_low"] < per_branch["overhead"] < per_branch["ci_high"]
    for end in ("ci_low", "ci_high"):
        alone = stats.per_branch_token(curve, METRIC_TOKENS, TRUNK, {"overhead": whole[end]})
        assert per_branch[end] == pytest.approx(alone["overhead"], abs=1e-12)


def test_per_branch_token_from_scratch_is_the_whole_run_overhead():
    curve = branch_curve()
    whole = stats.iso_loss_overhead(curve, METRIC_TOKENS, 0.01, 0.002, 14)
    same = stats.per_branch_token(curve, METRIC_TOKENS, 0, whole)
    for key in ("overhead", "ci_low", "ci_high"):
        assert same[key] == pytest.approx(whole[key], rel=1e-9)


def test_per_branch_token_is_none_where_no_branch_token_count_reaches_the_loss():
    curve = branch_curve()
    above_the_trunk = float(curve.loss(TRUNK) - curve.loss(np.array(METRIC_TOKENS)).mean()) + 0.01
    whole = stats.iso_loss_overhead(curve, METRIC_TOKENS, above_the_trunk, 0.001, 14)
    result = stats.per_branch_token(curve, METRIC_TOKENS, TRUNK, whole)
    assert result["overhead"] is None and "no count of branch tokens" in result["note"]
    assert stats.per_branch_token(curve, METRIC_TOKENS, TRUNK, {"overhead": None})["overhead"] is None
    with pytest.raises(ValueError, match="must lie past the trunk's"):
        stats.per_branch_token(curve, [TRUNK, TRUNK + 1], TRUNK, whole)
