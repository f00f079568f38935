"""The study's statistics on plain data (numbers and arrays, no run directories): the paired arm x block
model and its contrasts, the unpaired Welch comparison beside it, the iso-loss token ratio through the
baseline's fitted curve, and the per-run metrics they take. docs/study_analysis.md states the formulas.

- Paired model. A metric y[arm, block], where a block (a seed shared by all arms, or a trunk all arms branch
  from) is common to every arm run in it, follows y = mu + a_arm + b_block + e, e independent N(0, sigma^2)
  with one sigma for the whole table. Missing cells are NaN. Fitted by least squares on the design matrix;
  sigma^2 is pooled from the whole table's residuals, df = observed cells - rank of the design. A contrast
  (weights over arms summing to 0) has a t-based interval with those df.
- Paired t beside it: a contrast's value in each block where all its arms are observed, their mean and the
  one-sample t interval (n - 1 df, a variance per contrast rather than one for the table).
- Fieller's interval for the ratio of two contrasts (e.g. Wgrad's share of full's cost): the set of r for
  which num - r den is not significantly non-zero, from either model; unbounded where den is not
  significantly non-zero.
- Holm's step-down correction over a named family of pre-registered contrasts controls the family-wise error.
- Iso-loss token ratio. The baseline's eval curve is fitted as L(T) = E + A T^-alpha. An arm whose loss at
  tokens T0 exceeds the baseline's by delta is taken to be the baseline stretched in tokens by a factor rho
  (L_arm(T) = L(T / rho)); rho - 1 is the arm's token overhead: positive when the arm needs more tokens for
  the same loss. Its error carries the contrast's SE and the curve's parameter covariance (delta method).
  Per branch token (a branch that starts from a trunk's T0 tokens): L_arm(T) = L(T0 + (T - T0) / rho_b),
  the same iso-loss equality with the trunk's tokens taken out of both counts.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, Sequence

import numpy as np
import scipy.optimize
import scipy.sparse.csgraph
import scipy.stats

from fp4jax.training.divergence import DivergenceGuard

__all__ = [
    "AdditiveFit",
    "PowerLaw",
    "block_values",
    "cells_to_table",
    "contrast",
    "contrast_family",
    "crossing",
    "fieller",
    "fit_additive",
    "fit_power_law",
    "fit_ratio",
    "holm",
    "iso_loss_overhead",
    "loss_spikes",
    "paired_ratio",
    "paired_t",
    "per_branch_token",
    "primary_metric",
    "primary_metrics",
    "t_quantile",
    "tokens_to_target",
    "weights_text",
    "welch",
]

LEVEL = 0.95  # two-sided confidence level of every interval
ALPHA = 0.05  # family-wise error rate of Holm's decisions
OVERHEAD_METHOD = "delta method, Satterthwaite df"
OVERHEAD_KEYS = (  # iso_loss_overhead's numbers, all None when the arm's loss is unreachable
    "overhead",
    "token_ratio",
    "se",
    "se_from_loss",
    "se_from_curve",
    "df",
    "ci_low",
    "ci_high",
    "baseline_tokens",
)


def t_quantile(df: float, level: float = LEVEL) -> float:
    """The Student-t quantile of a two-sided `level` interval with `df` > 0 degrees of freedom (df may be
    fractional, as Satterthwaite's is): the interval is estimate +- t_quantile(df) x se."""
    return float(scipy.stats.t.ppf(0.5 + level / 2, df))


# ------------------------------------------------------------------------------------ the paired model


@dataclasses.dataclass(frozen=True)
class AdditiveFit:
    """Least-squares fit of y = mu + a_arm + b_block + e to the observed cells of a table.

    The design has one indicator column per arm and one per block (rank-deficient by construction: only
    contrasts are estimable, never an arm's own level). coef is the minimum-norm solution; an estimable
    contrast's estimate does not depend on which solution. Invariants: df = n_cells - rank; sigma2 is the
    residual sum of squares / df (None when df = 0); component[i] labels the set of arms connected through
    shared blocks that arm i belongs to.
    """

    arms: tuple[str, ...]
    blocks: tuple[str, ...]
    coef: np.ndarray
    xtx_pinv: np.ndarray  # (X'X)^+, the unscaled covariance of coef
    sigma2: float | None
    df: int
    n_cells: int
    component: np.ndarray


def cells_to_table(cells: Mapping[tuple[str, str], float], arms=None, blocks=None):
    """(y[arm, block] with NaN where no cell, arms, blocks) from {(arm, block): value}; arms and blocks in
    the given order, else sorted."""
    arms = tuple(arms) if arms is not None else tuple(sorted({a for a, _ in cells}))
    blocks = tuple(blocks) if blocks is not None else tuple(sorted({b for _, b in cells}))
    y = np.full((len(arms), len(blocks)), np.nan)
    for (arm, block), value in cells.items():
        y[arms.index(arm), blocks.index(block)] = value
    return y, arms, blocks


def _design(observed: np.ndarray) -> np.ndarray:
    """X: one row an observed cell (row-major order), columns = arm indicators then block indicators."""
    arm_idx, block_idx = np.nonzero(observed)
    n_arms, n_blocks = observed.shape
    x = np.zeros((arm_idx.size, n_arms + n_blocks))
    x[np.arange(arm_idx.size), arm_idx] = 1.0
    x[np.arange(arm_idx.size), n_arms + block_idx] = 1.0
    return x


def _arm_components(observed: np.ndarray) -> np.ndarray:
    """Per arm, a label of the set of arms it is connected to through shared blocks (its component)."""
    sharing = observed.astype(int) @ observed.T.astype(int) > 0  # arms sharing a block, itself included
    return scipy.sparse.csgraph.connected_components(sharing, directed=False)[1]


def _check_table(y: np.ndarray, arms: Sequence[str], blocks: Sequence[str]) -> None:
    if y.ndim != 2 or y.shape != (len(arms), len(blocks)):
        raise ValueError(f"table shape {y.shape} is not (arms, blocks) = ({len(arms)}, {len(blocks)})")
    if np.isinf(y).any():
        raise ValueError("table holds an infinite value: mark a missing cell NaN, drop a diverged run's cell")
    if len(set(arms)) != len(arms) or len(set(blocks)) != len(blocks):
        raise ValueError(f"arm or block names repeat: arms {list(arms)}, blocks {list(blocks)}")
    empty = [a for a, row in zip(arms, y, strict=True) if np.isnan(row).all()]
    if empty:
        raise ValueError(f"arms {empty} have no observed cell: drop them from the table")


def fit_additive(y, arms: Sequence[str], blocks: Sequence[str] | None = None) -> AdditiveFit:
    """Fits the additive arm + block model to y[arm, block] (NaN = missing cell).

    Unbalanced tables are handled exactly by least squares; a block observed in one arm only absorbs its
    cell (no information, no df). Assumes additivity (no arm x block interaction) and independent errors of
    one variance."""
    y = np.asarray(y, dtype=float)
    blocks = tuple(blocks) if blocks is not None else tuple(f"block{j}" for j in range(y.shape[-1]))
    _check_table(y, arms, blocks)
    observed = ~np.isnan(y)
    x, values = _design(observed), y[observed]
    # One SVD gives the rank, the least-squares solution X^+ y and (X'X)^+ = V S^-2 V'.
    u, s, vt = np.linalg.svd(x, full_matrices=False)
    keep = s > s.max() * max(x.shape) * np.finfo(float).eps
    u, s, vt = u[:, keep], s[keep], vt[keep]
    coef = vt.T @ ((u.T @ values) / s)
    df = values.size - int(keep.sum())
    rss = float(np.sum((values - x @ coef) ** 2))
    return AdditiveFit(
        arms=tuple(arms),
        blocks=blocks,
        coef=coef,
        xtx_pinv=(vt.T / s**2) @ vt,
        sigma2=rss / df if df > 0 else None,
        df=df,
        n_cells=values.size,
        component=_arm_components(observed),
    )


def _weight_vector(fit: AdditiveFit, weights: Mapping[str, float], name: str) -> np.ndarray:
    """The contrast over the fit's coefficients (block part 0), after checking its weights."""
    unknown = sorted(set(weights) - set(fit.arms))
    if unknown:
        raise ValueError(f"contrast {name!r} names arms {unknown} not in the table (arms: {list(fit.arms)})")
    w = np.array([float(weights.get(a, 0.0)) for a in fit.arms])
    scale = np.abs(w).sum()
    if scale == 0 or abs(w.sum()) > 1e-9 * scale:
        raise ValueError(
            f"contrast {name!r} weights sum to {w.sum():g}, not 0 (and not all 0): {dict(weights)}"
        )
    for label in np.unique(fit.component):
        if abs(w[fit.component == label].sum()) > 1e-9 * scale:
            raise ValueError(_not_estimable(fit, w, name))
    return np.concatenate([w, np.zeros(len(fit.blocks))])


def _not_estimable(fit: AdditiveFit, w: np.ndarray, name: str) -> str:
    groups = [
        [a for a, c, wi in zip(fit.arms, fit.component, w, strict=True) if c == label and wi != 0]
        for label in np.unique(fit.component)
    ]
    groups = [g for g in groups if g]
    return (
        f"contrast {name!r} is not estimable: arms {groups} share no block, directly or through other arms; "
        "run them on a common seed or trunk"
    )


def weights_text(weights: Mapping[str, float]) -> str:
    """A contrast's weights as text, e.g. "+1 full -1 fprop_dgrad" (its default name, and report tables)."""
    return " ".join(f"{w:+g} {a}" for a, w in weights.items())


def contrast(fit: AdditiveFit, weights: Mapping[str, float], name: str | None = None, level=LEVEL) -> dict:
    """Estimate, SE, t-based interval and two-sided p-value of sum_i w_i a_i (weights over arms, sum 0).

    SE = sqrt(sigma2 * c' (X'X)^+ c); the interval is estimate +- t_{df, (1 + level) / 2} SE with the pooled
    residual df. Raises when the contrast is not estimable (its arms are not connected through shared
    blocks) or the table has no residual df."""
    name = name or weights_text(weights)
    c = _weight_vector(fit, weights, name)
    if fit.df == 0:
        raise ValueError(
            f"contrast {name!r}: the table has no residual degrees of freedom ({fit.n_cells} cells, as many "
            "parameters): no interval; add seeds or trunks"
        )
    estimate = float(c @ fit.coef)
    se = math.sqrt(fit.sigma2 * float(c @ fit.xtx_pinv @ c))
    t = estimate / se if se > 0 else math.copysign(math.inf, estimate)
    half = t_quantile(fit.df, level) * se
    return {
        "name": name,
        "weights": dict(weights),
        "estimate": estimate,
        "se": se,
        "df": fit.df,
        "t": t,
        "p": float(2 * scipy.stats.t.sf(abs(t), fit.df)),
        "level": level,
        "ci_low": estimate - half,
        "ci_high": estimate + half,
    }


def holm(p_values: Sequence[float]) -> np.ndarray:
    """Holm's step-down adjusted p-values, in the input's order: sorted ascending, the i-th (from 0) of m is
    multiplied by m - i, made non-decreasing, capped at 1. Rejecting where adjusted p <= alpha controls the
    family-wise error at alpha under any dependence between the tests."""
    p = np.asarray(p_values, dtype=float)
    order = np.argsort(p)
    stepped = np.maximum.accumulate(p[order] * (p.size - np.arange(p.size)))
    adjusted = np.empty_like(p)
    adjusted[order] = np.minimum(stepped, 1.0)
    return adjusted


def contrast_family(fit: AdditiveFit, family: Mapping[str, Mapping[str, float]], alpha=ALPHA, level=LEVEL):
    """Every contrast of a named pre-registered family, with Holm's adjusted p ("p_holm") and the decision
    at family-wise level alpha ("reject"). The intervals are per-contrast (level), not simultaneous."""
    rows = [contrast(fit, weights, name, level) for name, weights in family.items()]
    for row, adjusted in zip(rows, holm([r["p"] for r in rows]), strict=True):
        row.update(p_holm=float(adjusted), reject=bool(adjusted <= alpha), alpha=alpha)
    return rows


def welch(a: Sequence[float], b: Sequence[float], level=LEVEL) -> dict:
    """Unpaired comparison mean(a) - mean(b) with Welch's SE sqrt(s_a^2 / n_a + s_b^2 / n_b), Satterthwaite
    df, t interval and p (scipy's ttest_ind). NaNs are dropped. It ignores any block shared by a and b:
    the paired model's contrast is the estimate of a blocked design; this is what not pairing costs."""
    a, b = (np.asarray(v, dtype=float) for v in (a, b))
    a, b = a[~np.isnan(a)], b[~np.isnan(b)]
    if a.size < 2 or b.size < 2:
        raise ValueError(f"Welch's test needs 2 or more values a side, got {a.size} and {b.size}")
    result = scipy.stats.ttest_ind(a, b, equal_var=False)
    interval = result.confidence_interval(level)
    return {
        "estimate": float(a.mean() - b.mean()),
        "se": float(math.sqrt(a.var(ddof=1) / a.size + b.var(ddof=1) / b.size)),
        "df": float(result.df),
        "p": float(result.pvalue),
        "level": level,
        "ci_low": float(interval.low),
        "ci_high": float(interval.high),
    }


# --------------------------------------------------------------------- paired t and Fieller's ratio


def block_values(y, arms: Sequence[str], blocks: Sequence[str], weights: Mapping[str, float]):
    """(values, blocks used): sum_i w_i y[arm_i, b] for every block b where each arm the contrast weights
    is observed (NaN = missing), in the table's block order."""
    y = np.asarray(y, dtype=float)
    unknown = sorted(set(weights) - set(arms))
    if unknown:
        raise ValueError(f"contrast names arms {unknown} not in the table (arms: {list(arms)})")
    rows = [list(arms).index(a) for a, w in weights.items() if w != 0]
    w = np.array([float(weights[arms[i]]) for i in rows])
    complete = ~np.isnan(y[rows]).any(axis=0)
    return w @ y[rows][:, complete], tuple(b for b, keep in zip(blocks, complete, strict=True) if keep)


def paired_t(values: Sequence[float], level=LEVEL) -> dict:
    """The mean of per-block contrast values with its one-sample t interval and two-sided p against 0
    (scipy's ttest_1samp; df = n - 1, SE = sd / sqrt(n)). Needs 2 or more values."""
    values = np.asarray(values, dtype=float)
    if values.size < 2 or np.isnan(values).any():
        raise ValueError(f"a paired t interval needs 2 or more finite block values, got {values.tolist()}")
    result = scipy.stats.ttest_1samp(values, 0.0)
    interval = result.confidence_interval(level)
    return {
        "estimate": float(values.mean()),
        "se": float(values.std(ddof=1) / math.sqrt(values.size)),
        "df": int(values.size - 1),
        "t": float(result.statistic),
        "p": float(result.pvalue),
        "level": level,
        "ci_low": float(interval.low),
        "ci_high": float(interval.high),
        "n_blocks": int(values.size),
    }


def fieller(num: float, den: float, var_num: float, var_den: float, cov: float, df: float, level=LEVEL):
    """Fieller's interval for num / den: {r : (num - r den)^2 <= t^2 var(num - r den)}, t the two-sided
    `level` quantile with df degrees of freedom, var(num - r den) = var_num - 2 r cov + r^2 var_den.

    With q = t^2: (den^2 - q var_den) r^2 - 2 (num den - q cov) r + num^2 - q var_num <= 0. Where den is
    significantly non-zero (den^2 > q var_den) the set is the interval between the roots ("interval");
    otherwise it is unbounded: all r outside the roots ("two half-lines", the roots in `excluded`) or every r
    ("whole line"). lo and hi are None unless bounded."""
    q = t_quantile(df, level) ** 2
    a, b, c = den * den - q * var_den, num * den - q * cov, num * num - q * var_num
    disc = b * b - a * c
    out = {"estimate": num / den if den != 0 else None, "lo": None, "hi": None, "level": level, "df": df}
    if a > 0:  # the estimate lies inside, so disc >= 0 up to rounding
        half = math.sqrt(max(disc, 0.0))
        return {**out, "lo": (b - half) / a, "hi": (b + half) / a, "bounded": True, "kind": "interval"}
    if a < 0 and disc > 0:
        roots = sorted(((b - math.sqrt(disc)) / a, (b + math.sqrt(disc)) / a))
        return {**out, "bounded": False, "kind": "two half-lines", "excluded": roots}
    return {**out, "bounded": False, "kind": "whole line"}


def fit_ratio(fit: AdditiveFit, num: Mapping[str, float], den: Mapping[str, float], level=LEVEL) -> dict:
    """Fieller's interval for the ratio of two contrasts of one pooled fit: their covariance is
    sigma2 c_num' (X'X)^+ c_den, the df the fit's residual df."""
    if fit.df == 0:
        raise ValueError("the ratio of two contrasts needs residual degrees of freedom: add seeds or trunks")
    c_num, c_den = _weight_vector(fit, num, "numerator"), _weight_vector(fit, den, "denominator")
    cov = fit.sigma2 * np.array([c_num, c_den]) @ fit.xtx_pinv @ np.array([c_num, c_den]).T
    estimates = c_num @ fit.coef, c_den @ fit.coef
    return fieller(*map(float, estimates), cov[0, 0], cov[1, 1], cov[0, 1], fit.df, level)


def paired_ratio(num_values: Sequence[float], den_values: Sequence[float], level=LEVEL) -> dict:
    """Fieller's interval for mean(num) / mean(den) from per-block values of two contrasts (the same blocks,
    in order): the means' variances and covariance are the sample ones / n, df = n - 1."""
    values = np.asarray([num_values, den_values], dtype=float)
    n = values.shape[1]
    if n < 2 or np.isnan(values).any():
        raise ValueError(f"a paired ratio needs 2 or more finite blocks of both contrasts, got {n}")
    cov = np.cov(values, ddof=1) / n
    return fieller(*values.mean(axis=1), cov[0, 0], cov[1, 1], cov[0, 1], n - 1, level) | {"n_blocks": n}


# ------------------------------------------------------------------------------ the baseline's curve


@dataclasses.dataclass(frozen=True)
class PowerLaw:
    """L(T) = E + B (T / t_ref)^-alpha = E + A T^-alpha with A = B t_ref^alpha. B is the excess over the
    asymptote E at t_ref (the fit's tokens' geometric mean), which keeps the fit well scaled.

    cov: covariance of (E, B, alpha) from the fit, scaled by the residual variance (residuals taken
    independent, one variance); df = points - 3; tokens_range and loss_range: the data's."""

    E: float
    B: float
    alpha: float
    t_ref: float
    cov: np.ndarray
    df: int
    residual_sd: float
    tokens_range: tuple[float, float]
    loss_range: tuple[float, float]

    @property
    def A(self) -> float:
        return self.B * self.t_ref**self.alpha

    def loss(self, tokens):
        return self.E + self.B * (np.asarray(tokens, dtype=float) / self.t_ref) ** -self.alpha

    def tokens_at(self, loss: float) -> float:
        """The tokens at which the curve reaches `loss` (inf at or below E)."""
        excess = loss - self.E
        return math.inf if excess <= 0 else self.t_ref * (excess / self.B) ** (-1 / self.alpha)


def _power_law(t_rel, e, b, alpha):
    return e + b * t_rel**-alpha


# The fit's bounds: 0 <= E <= min(L), B >= _B_MIN, alpha in _ALPHA_RANGE; alpha is first located on a
# log grid (the residual sum of squares of each grid point's best E and B), then refined.
_B_MIN = 1e-12
_ALPHA_RANGE = (1e-3, 5.0)
_ALPHA_GRID = np.geomspace(*_ALPHA_RANGE, 400)


def _linear_part(t_rel: np.ndarray, loss: np.ndarray, alpha: float) -> tuple[float, float]:
    """(E, B) with the least squared residuals at this alpha, within the bounds: the model is linear in
    them, so this is a closed form (the unconstrained solution, else the best one on a bound)."""
    x = t_rel**-alpha
    dx = x - x.mean()
    b = float(dx @ (loss - loss.mean())) / float(dx @ dx)
    e = float(loss.mean() - b * x.mean())
    e_max = float(loss.min())
    if 0.0 <= e <= e_max and b >= _B_MIN:
        return e, b
    # On a bound: E at either end with its best B, or B at its floor with its best E; the feasible one
    # with the least residuals (the constrained optimum lies on one of them).
    on_e = [(e_end, max(_B_MIN, float(x @ (loss - e_end)) / float(x @ x))) for e_end in (0.0, e_max)]
    on_b = [(min(max(float(np.mean(loss - _B_MIN * x)), 0.0), e_max), _B_MIN)]
    return min(on_e + on_b, key=lambda p: float(np.sum((_power_law(t_rel, p[0], p[1], alpha) - loss) ** 2)))


def _rss_slope(t_rel: np.ndarray, loss: np.ndarray, alpha: float) -> float:
    """d RSS / d alpha of the profiled fit (E and B at their best for each alpha): by the envelope theorem
    only alpha's own partial derivative, -2 B sum(r x ln t), with r the residuals and x = t^-alpha."""
    e, b = _linear_part(t_rel, loss, alpha)
    x = t_rel**-alpha
    residual = e + b * x - loss
    return -2.0 * b * float(np.sum(residual * x * np.log(t_rel)))


def _fit(t_rel: np.ndarray, loss: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(E, B, alpha) and their covariance, by variable projection: E and B in closed form for each alpha,
    alpha where the profiled residual sum of squares has zero slope (brentq between the best grid point's
    neighbours; a bound where the minimum lies on one).

    Why not a general least-squares solver from a start: the curve's valley is long and flat (E and B
    trade off, each with s.e. comparable to E itself), so a solver's stopping rule leaves its answer some
    1e-5 from the minimum, at a place that depends on the start and on the library's version. The slope's
    root is determined to rounding, so the reports built on the curve regenerate on any machine.
    Covariance: the residual variance times (J^T J)^-1 at the optimum, J the model's Jacobian in
    (E, B, alpha), through J's singular values (as scipy's curve_fit computes it)."""
    rss = [
        float(np.sum((_power_law(t_rel, *_linear_part(t_rel, loss, a), a) - loss) ** 2)) for a in _ALPHA_GRID
    ]
    k = int(np.argmin(rss))
    if k in (0, len(_ALPHA_GRID) - 1):
        alpha = float(_ALPHA_GRID[k])
    else:
        low, high = float(_ALPHA_GRID[k - 1]), float(_ALPHA_GRID[k + 1])
        if _rss_slope(t_rel, loss, low) > 0 or _rss_slope(t_rel, loss, high) < 0:
            raise ValueError("the curve L = E + A T^-alpha did not fit these points (no single minimum)")
        alpha = scipy.optimize.brentq(
            lambda a: _rss_slope(t_rel, loss, a), low, high, xtol=1e-15, rtol=4 * np.finfo(float).eps
        )
    e, b = _linear_part(t_rel, loss, alpha)
    x = t_rel**-alpha
    jacobian = np.stack([np.ones_like(x), x, -b * x * np.log(t_rel)], axis=1)
    _, singular, vt = np.linalg.svd(jacobian, full_matrices=False)
    if singular[-1] <= singular[0] * np.finfo(float).eps * jacobian.shape[0]:
        raise ValueError("the curve L = E + A T^-alpha did not fit these points (no finite covariance)")
    residual_var = float(np.sum((_power_law(t_rel, e, b, alpha) - loss) ** 2)) / (t_rel.size - 3)
    cov = (vt.T / singular**2) @ vt * residual_var
    return np.array([e, b, alpha]), cov


def fit_power_law(tokens, losses) -> PowerLaw:
    """Least-squares fit of L(T) = E + A T^-alpha to (tokens, eval loss) pairs, pooled over the baseline's
    seeds or their mean at each eval. Bounds: 0 <= E <= min(L), B > 0, 0.001 <= alpha <= 5. Fit only where
    the curve is a power law (after warm-up). Pooling seeds whose curves differ by a constant leaves
    (B, alpha) unchanged and inflates the residual variance, so their covariance is conservative."""
    t, loss = np.asarray(tokens, dtype=float).ravel(), np.asarray(losses, dtype=float).ravel()
    if (
        t.shape != loss.shape
        or not (np.isfinite(t).all() and np.isfinite(loss).all())
        or (t <= 0).any()
        or (loss <= 0).any()
    ):
        raise ValueError("the curve needs matching finite (tokens > 0, loss > 0) pairs")
    if np.unique(t).size < 4:
        raise ValueError(
            f"the curve has {np.unique(t).size} distinct token counts: a 3-parameter fit needs 4+"
        )
    t_ref = float(np.exp(np.log(t).mean()))
    p, cov = _fit(t / t_ref, loss)
    rss = float(np.sum((loss - _power_law(t / t_ref, *p)) ** 2))
    return PowerLaw(
        E=float(p[0]),
        B=float(p[1]),
        alpha=float(p[2]),
        t_ref=t_ref,
        cov=cov,
        df=t.size - 3,
        residual_sd=math.sqrt(rss / (t.size - 3)),
        tokens_range=(float(t.min()), float(t.max())),
        loss_range=(float(loss.min()), float(loss.max())),
    )


def iso_loss_overhead(curve: PowerLaw, tokens, delta: float, delta_se: float, delta_df: float, level=LEVEL):
    """The arm's token overhead rho - 1 from its loss contrast delta = L_arm - L_baseline at `tokens` (one
    count, or the eval tokens a mean-of-last-k metric averaged over).

    Model: L_arm(T) = L(T / rho), L the baseline's curve. Then the excess over E scales by rho^alpha, so
    rho = (1 + delta / X)^(1 / alpha) with X = mean over `tokens` of L(T) - E: E and the seeds' common
    level cancel, only the curve's shape (B, alpha) enters. Error by the delta method: var = g_d^2
    delta_se^2 + g' cov g (the contrast and the curve taken independent); df by Satterthwaite from
    delta_df and the curve's df; interval overhead +- t quantile x se. `note` says when the baseline's
    tokens T / rho for this loss lie outside the fitted range (the curve, not data, decides), or when the
    arm's loss is below the curve's asymptote (no token count reaches it: no overhead)."""
    if delta_se < 0 or delta_df <= 0:
        raise ValueError(f"delta_se {delta_se} and delta_df {delta_df}: the contrast's SE >= 0 and df > 0")
    t = np.atleast_1d(np.asarray(tokens, dtype=float)) / curve.t_ref
    scaled = t**-curve.alpha
    excess = curve.B * float(scaled.mean())
    u = 1 + delta / excess
    if u <= 0:
        below = -delta - excess
        note = f"the arm's loss is {below:.4g} nats below the baseline curve's asymptote E (unreachable)"
        return {**dict.fromkeys(OVERHEAD_KEYS), "level": level, "method": OVERHEAD_METHOD, "note": note}
    rho = float(u ** (1 / curve.alpha))
    d_log_rho_d_excess = -delta / (curve.alpha * u * excess**2)
    d_excess_d_alpha = -curve.B * float(np.mean(scaled * np.log(t)))
    grad_curve = rho * np.array(
        [
            0.0,
            d_log_rho_d_excess * scaled.mean(),
            -math.log(u) / curve.alpha**2 + d_log_rho_d_excess * d_excess_d_alpha,
        ]
    )
    var_loss = (rho / (curve.alpha * u * excess) * delta_se) ** 2
    var_curve = float(grad_curve @ curve.cov @ grad_curve)
    df = _satterthwaite((var_loss, delta_df), (var_curve, curve.df))
    se = math.sqrt(var_loss + var_curve)
    half = t_quantile(df, level) * se
    return {
        "overhead": rho - 1,
        "token_ratio": rho,
        "se": se,
        "se_from_loss": math.sqrt(var_loss),
        "se_from_curve": math.sqrt(var_curve),
        "df": df,
        "level": level,
        "ci_low": rho - 1 - half,
        "ci_high": rho - 1 + half,
        "baseline_tokens": [float(x) for x in t * curve.t_ref / rho],
        "method": OVERHEAD_METHOD,
        "note": _extrapolation(curve, t * curve.t_ref / rho),
    }


def per_branch_token(curve: PowerLaw, tokens, trunk_tokens: float, whole: Mapping) -> dict:
    """A branch's token overhead counted from its branch point: the whole-run overhead `whole`
    (iso_loss_overhead's dict) restated with the trunk's tokens T0 taken out of both counts.

    Model: L_arm(T) = L(T0 + (T - T0) / rho_b), L the baseline's curve, rho_b solved from the equality that
    gives the whole-run ratio rho (the mean over `tokens` of L_arm equals that of L(T / rho)). rho_b rises
    with rho, so the whole-run interval's end points map to this one's (the same coverage); with T0 = 0,
    rho_b = rho. A number is None where the whole-run one is, or where the arm's loss is at or above the
    baseline's at the branch point (no count of branch tokens reaches it)."""
    t = np.atleast_1d(np.asarray(tokens, dtype=float))
    if trunk_tokens < 0 or not (t > trunk_tokens).all():
        raise ValueError(f"per branch token: tokens {t.tolist()} must lie past the trunk's {trunk_tokens}")
    out = {
        key: _branch_overhead(curve, t, trunk_tokens, whole.get(key))
        for key in ("overhead", "ci_low", "ci_high")
    }
    note = None if out["overhead"] is not None else "no count of branch tokens reaches the arm's loss"
    return {**out, "trunk_tokens": float(trunk_tokens), "level": whole.get("level", LEVEL), "note": note}


def _branch_overhead(curve: PowerLaw, t: np.ndarray, trunk_tokens: float, overhead) -> float | None:
    """rho_b - 1 with mean L(T0 + (T - T0) / rho_b) = mean L(T / rho), rho = 1 + overhead (brentq in
    log rho_b; the left side rises with rho_b from about E to L(T0))."""
    if overhead is None or overhead <= -1:
        return None
    target = float(np.mean(curve.loss(t / (1 + overhead))))

    def gap(log_rho_b: float) -> float:
        stretched = trunk_tokens + (t - trunk_tokens) / math.exp(log_rho_b)
        return float(np.mean(curve.loss(stretched))) - target

    low, high = -30.0, 30.0
    if gap(low) >= 0 or gap(high) <= 0:
        return None
    return math.exp(scipy.optimize.brentq(gap, low, high, xtol=1e-14)) - 1


def _satterthwaite(*parts: tuple[float, float]) -> float:
    """Effective df of a sum of variance estimates (variance, its df)."""
    total = sum(v for v, _ in parts)
    denominator = sum(v * v / df for v, df in parts if v > 0)
    return total * total / denominator if denominator > 0 else math.inf


def _extrapolation(curve: PowerLaw, baseline_tokens: np.ndarray) -> str | None:
    low, high = curve.tokens_range
    if baseline_tokens.min() < low or baseline_tokens.max() > high:
        return (
            f"extrapolated: the baseline would reach this loss at {baseline_tokens.min():.4g}-"
            f"{baseline_tokens.max():.4g} tokens, outside its fitted {low:.4g}-{high:.4g}"
        )
    return None


# --------------------------------------------------------------------------------------- run metrics


def primary_metric(evals, last_k: int) -> tuple[float, tuple[int, ...]]:
    """The study's primary metric of one run, the only place it is computed: (the mean eval loss of its
    last `last_k` evaluations, their tokens), from its runs.Eval records."""
    if last_k < 1 or len(evals) < last_k:
        raise ValueError(f"mean of the last {last_k} evals: the run has {len(evals)} (k must be 1..that)")
    last = evals[-last_k:]
    return float(np.mean([e.loss for e in last])), tuple(int(e.tokens) for e in last)


def primary_metrics(evals_by_run: Mapping, last_k: int) -> tuple[dict, tuple[int, ...]]:
    """({run: its primary metric}, the tokens they share). Raises unless every run's last k evaluations
    are at the same tokens: a fixed-tokens metric compares runs at the same tokens."""
    means, tokens = {}, {}
    for key, evals in evals_by_run.items():
        means[key], tokens[key] = primary_metric(evals, last_k)
    distinct = {}
    for key, toks in tokens.items():
        distinct.setdefault(toks, key)
    if len(distinct) > 1:
        shown = "; ".join(f"{key!r} at {list(toks)}" for toks, key in distinct.items())
        raise ValueError(
            f"runs' last {last_k} evals are at different tokens ({shown}): use one eval schedule"
        )
    return means, next(iter(distinct), ())


def crossing(evals, target: float) -> dict | None:
    """Interpolated tokens to target of one run's runs.Eval records, linear in tokens between the last
    evaluation above the target and the first at or below it, with that bracket; None when no evaluation
    is at or below the target (the first evaluation alone: its tokens, an upper bound)."""
    for i, (_, t1, l1) in enumerate(evals):
        if l1 > target:
            continue
        if i == 0:
            return {"tokens": float(t1), "interval": t1, "bracket": None, "first_eval": True}
        _, t0, l0 = evals[i - 1]
        tokens = t0 + (l0 - target) / (l0 - l1) * (t1 - t0)
        return {"tokens": tokens, "interval": t1 - t0, "bracket": [[t0, l0], [t1, l1]], "first_eval": False}
    return None


def tokens_to_target(evals, target: float) -> float | None:
    """Tokens at which a run's evals first reach `target` (crossing's rule); None when none reaches it."""
    hit = crossing(evals, target)
    return None if hit is None else hit["tokens"]


def loss_spikes(steps, losses, spike_nats: float, window: int) -> list[dict]:
    """Loss spikes of a training-loss series under the trainer's rule (training.divergence): at a step the
    mean of the last `window` losses exceeds the lowest such mean so far by more than spike_nats. A spike is
    a maximal run of consecutive steps where the rule fires: {"start_step", "end_step", "peak_mean"}. The
    trainer stops at the first; counted here over a run trained with the rule off (spike_nats = 0)."""
    if spike_nats <= 0 or window < 1:
        raise ValueError(
            f"spike_nats {spike_nats} and window {window}: counting needs spike_nats > 0, window >= 1"
        )
    if len(steps) != len(losses) or not np.isfinite(losses).all():
        raise ValueError("loss_spikes needs one finite loss a step (a non-finite loss is a divergence)")
    guard = DivergenceGuard(spike_nats, window)
    spikes, in_spike = [], False
    for step, loss in zip(steps, losses, strict=True):
        # The guard checks grad_norm first; a finite stand-in leaves its loss rule alone.
        hit = guard.check(int(step), {"loss": float(loss), "grad_norm": 0.0})
        if hit is not None and not in_spike:
            spikes.append({"start_step": int(step), "end_step": int(step), "peak_mean": hit.value})
        elif hit is not None:
            spikes[-1].update(end_step=int(step), peak_mean=max(spikes[-1]["peak_mean"], hit.value))
        in_spike = hit is not None
    return spikes
