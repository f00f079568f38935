"""How well a branching set can tell two values of a cost share apart, before it runs.

A share is a ratio of two contrasts of the pooled additive fit (stats.fit_ratio): Wgrad's share of full's
cost is (full - fprop_dgrad) / (full - fp8). Fieller's interval for it excludes a value r exactly when the
t-test of the linear contrast L_r = (full - fprop_dgrad) - r (full - fp8) rejects L_r = 0 (stats.fieller's
definition of the set). With every arm run on every trunk, L_r's estimate has variance
sigma^2 sum(c^2) / K (K trunks, c its arm weights: 1 - r, -1 and r) on (arms - 1)(K - 1) degrees of
freedom, and mean (share - r) (full - fp8). So the probability that the interval excludes r when the true
share is `share` is a noncentral t's tail, exact under the fit's own assumptions (additive arm and trunk
effects, independent errors of one variance sigma). It depends on the noise only through
noise_to_cost = sigma / (full - fp8).

    python -m fp4jax.study.power      # the table docs/study_plan.md quotes (H-scale's decisions)
"""

from __future__ import annotations

import math

from scipy import stats as scipy_stats

from fp4jax.study.stats import LEVEL, t_quantile

__all__ = ["SIDES", "interval_power", "power_table"]

SCALE_SET_ARMS = 6  # fp8, fprop, fprop_dgrad, full, full_h16, wgrad (plans/scale350m.toml, scale1b.toml)
# What the interval does with the bound: leaves it out, or lies wholly above or wholly below it.
SIDES = ("excludes", "above", "below")
# H-scale's decision (docs/study_plan.md): supported when the largest setting's interval lies wholly above
# the 125M interval (its upper end 0.53), refuted when it lies wholly below the 8B study's 0.60.
SHARE_125M, SHARE_125M_HI, SHARE_8B = 0.29, 0.53, 0.60


def interval_power(
    share: float,
    bound: float,
    noise_to_cost: float,
    trunks: int,
    arms: int = SCALE_SET_ARMS,
    side: str = "excludes",
    level: float = LEVEL,
) -> float:
    """P(the pooled Fieller interval for (full - fprop_dgrad) / (full - fp8) excludes `bound`, or lies
    wholly above or below it) when the true ratio is `share`, for a complete table of `arms` arms x
    `trunks` trunks whose residual standard deviation is noise_to_cost x (full - fp8) > 0.

    The interval lies wholly above the bound exactly when the bound is excluded and L_bound's estimate is
    positive (full - fp8 estimated positive: the case these tables are made for). At share == bound,
    "excludes" is 1 - level (the test's size)."""
    if side not in SIDES:
        raise ValueError(f"unknown side {side!r}: use one of {', '.join(SIDES)}")
    if trunks < 2 or arms < 3:
        raise ValueError(
            f"a ratio's interval needs 2 or more trunks and 3 or more arms, got {trunks} and {arms}"
        )
    if noise_to_cost <= 0:
        raise ValueError(f"noise_to_cost must be positive, got {noise_to_cost}")
    df = (arms - 1) * (trunks - 1)
    weights_squared = (1 - bound) ** 2 + 1 + bound**2
    ncp = (share - bound) / (noise_to_cost * math.sqrt(weights_squared / trunks))
    t = t_quantile(df, level)
    above, below = scipy_stats.nct.sf(t, df, ncp), scipy_stats.nct.cdf(-t, df, ncp)
    return float({"excludes": above + below, "above": above, "below": below}[side])


def power_table(noise_to_cost=(0.10, 0.15, 0.20, 0.25), trunks=(2, 3, 4, 6)) -> str:
    """Markdown: for each noise-to-cost ratio and number of trunks, the chance of each of H-scale's two
    decisions when the share is the 8B study's and when it is the 125M one."""
    lines = [
        "| sigma / (full - fp8) | trunks | df "
        f"| P(wholly above {SHARE_125M_HI:.2f} \\| share {SHARE_8B:.2f}) "
        f"| P(wholly below {SHARE_8B:.2f} \\| share {SHARE_125M:.2f}) |",
        "|---:|---:|---:|---:|---:|",
    ]
    for ratio in noise_to_cost:
        for k in trunks:
            df = (SCALE_SET_ARMS - 1) * (k - 1)
            support = interval_power(SHARE_8B, SHARE_125M_HI, ratio, k, side="above")
            refute = interval_power(SHARE_125M, SHARE_8B, ratio, k, side="below")
            lines.append(f"| {ratio:.2f} | {k} | {df} | {support:.2f} | {refute:.2f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(power_table())
