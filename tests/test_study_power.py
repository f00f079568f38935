"""study/power.py's exact power against a simulation of the study's own analysis (stats.fit_additive and
Fieller's interval from stats.fit_ratio) on tables drawn from the additive model it assumes."""

from pathlib import Path

import numpy as np
import pytest

from fp4jax.study import power, stats

ARMS = ("fp8", "fprop", "fprop_dgrad", "full", "full_h16", "wgrad")
SHARE = ({"full": 1.0, "fprop_dgrad": -1.0}, {"full": 1.0, "fp8": -1.0})  # Wgrad's share: num, den


def _inside(interval: dict, r: float) -> bool:
    """Whether r lies in a stats.fieller set (an interval, two half-lines or the whole line)."""
    if interval["kind"] == "interval":
        return interval["lo"] <= r <= interval["hi"]
    if interval["kind"] == "two half-lines":
        low, high = interval["excluded"]
        return r <= low or r >= high
    return True


def _simulated(share, bound, noise_to_cost, trunks, draws, seed):
    """The fractions of `draws` tables (full - fp8 = 1, fprop_dgrad = 1 - share, the other arms anywhere,
    trunk effects and noise of sd noise_to_cost) whose Fieller interval for the share excludes `bound`,
    lies wholly above it and wholly below it."""
    rng = np.random.default_rng(seed)
    means = np.array([0.0, 0.4, 1.0 - share, 1.0, 0.6, 0.2])[:, None]
    counts = dict.fromkeys(power.SIDES, 0)
    for _ in range(draws):
        y = means + rng.normal(0, 3 * noise_to_cost, (1, trunks)) + rng.normal(0, noise_to_cost, (6, trunks))
        interval = stats.fit_ratio(stats.fit_additive(y, ARMS), *SHARE)
        if not _inside(interval, bound):
            counts["excludes"] += 1
            counts["above" if interval["estimate"] > bound else "below"] += 1
    return {side: n / draws for side, n in counts.items()}


@pytest.mark.parametrize(
    "share, bound, noise_to_cost, trunks",
    [(0.29, 0.60, 0.16, 3), (0.60, 0.53, 0.10, 4), (0.45, 0.45, 0.16, 3), (0.60, 0.29, 0.25, 2)],
)
def test_the_exact_power_is_what_the_analysis_gives(share, bound, noise_to_cost, trunks):
    """Each side within 4.5 binomial standard errors of 2,000 simulated sets; at share == bound the
    interval leaves the truth out 5 % of the time (its coverage), half of it on each side."""
    draws = 2000
    simulated = _simulated(share, bound, noise_to_cost, trunks, draws, seed=trunks)
    for side in power.SIDES:
        exact = power.interval_power(share, bound, noise_to_cost, trunks, side=side)
        assert abs(simulated[side] - exact) <= 4.5 * np.sqrt(exact * (1 - exact) / draws), (side, simulated)
    if share == bound:
        assert power.interval_power(share, bound, noise_to_cost, trunks) == pytest.approx(0.05, abs=1e-9)
        assert power.interval_power(share, bound, noise_to_cost, trunks, side="above") == pytest.approx(0.025)


def test_power_grows_with_trunks_and_falls_with_noise():
    by_trunks = [power.interval_power(0.29, 0.60, 0.16, k) for k in (2, 3, 4, 6)]
    assert by_trunks == sorted(by_trunks) and by_trunks[0] < 0.5 < by_trunks[-1]
    assert power.interval_power(0.29, 0.60, 0.25, 3) < power.interval_power(0.29, 0.60, 0.10, 3)


def test_a_set_too_small_for_an_interval_is_one_clear_error():
    with pytest.raises(ValueError, match="2 or more trunks and 3 or more arms, got 1 and 6"):
        power.interval_power(0.3, 0.6, 0.1, 1)
    with pytest.raises(ValueError, match="noise_to_cost must be positive"):
        power.interval_power(0.3, 0.6, 0.0, 3)
    with pytest.raises(ValueError, match="unknown side 'inside': use one of excludes, above, below"):
        power.interval_power(0.3, 0.6, 0.1, 3, side="inside")


def test_the_table_lists_every_setting():
    table = power.power_table(noise_to_cost=(0.16,), trunks=(2, 3))
    assert "P(wholly above 0.53 \\| share 0.60)" in table.splitlines()[0]
    rows = table.splitlines()[2:]
    assert len(rows) == 2 and rows[1].startswith("| 0.16 | 3 | 10 |")


def test_the_plans_table_is_the_generated_one():
    """docs/study_plan.md quotes `python -m fp4jax.study.power`'s table as it prints it."""
    plan = (Path(__file__).resolve().parents[1] / "docs" / "study_plan.md").read_text()
    assert power.power_table() in plan
