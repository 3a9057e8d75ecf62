"""Paired statistics for comparing two runs of one frozen job list: the paired bootstrap over
clusters (tasks) and the exact McNemar test.

Every metric is a ratio of sums over episodes, ``Σ numerator / Σ denominator`` (a mean has a
denominator of one per episode; the invalid-action rate is invalid actions over actions), the
ratio estimator the summary uses, so each episode weighs the same whatever its task's repeats.
The difference of two runs is ``B − A`` over the same pairs.

The bootstrap resamples clusters with replacement: ``G`` draws from the ``G`` clusters, each
cluster bringing every pair it holds, run A's and run B's episodes together (that is what makes
it paired). The clusters are tasks: with one episode per task that is the plain paired
bootstrap over episodes; with repeats, the episodes of a task move together, so agreement
between repeats does not pass for independent evidence. The interval is the percentile
interval of the resampled differences. Resampling weights come from one seeded generator and
are shared by every metric of a comparison, so a metric's interval does not depend on which
other metrics are computed.
"""

from __future__ import annotations

import math
from collections.abc import Hashable, Sequence
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt

__all__ = [
    "BOOTSTRAP_RESAMPLES",
    "BOOTSTRAP_SEED",
    "ClusterSums",
    "Interval",
    "bootstrap_p_value",
    "cluster_sums",
    "holm_adjust",
    "mcnemar_exact",
    "percentile_interval",
    "resampled_differences",
]

BOOTSTRAP_RESAMPLES = 10_000
BOOTSTRAP_SEED = 20260901
_WEIGHTS_PER_CHUNK = 4_000_000
"""Bound on the resampling weights held at once (resamples × clusters): about 100 MB with the draws."""

Floats = npt.NDArray[np.float64]


@dataclass(frozen=True)
class ClusterSums:
    """Per-cluster sums of one or more metrics over the pairs: arrays of shape (clusters, metrics)."""

    a_num: Floats
    a_den: Floats
    b_num: Floats
    b_den: Floats

    def estimates(self) -> tuple[Floats, Floats, Floats]:
        """(A, B, B − A) per metric, over every pair; NaN where a run's denominator sums to 0."""
        with np.errstate(invalid="ignore", divide="ignore"):
            a = self.a_num.sum(axis=0) / self.a_den.sum(axis=0)
            b = self.b_num.sum(axis=0) / self.b_den.sum(axis=0)
        return a, b, b - a


def cluster_sums(
    labels: Sequence[Hashable],
    a_num: npt.ArrayLike,
    b_num: npt.ArrayLike,
    a_den: npt.ArrayLike | None = None,
    b_den: npt.ArrayLike | None = None,
) -> ClusterSums:
    """Sums by cluster over pairs, clusters in first-seen order. Each value array holds one entry
    per pair (one metric) or one row per pair and a column per metric. Without denominators
    each pair counts one (a mean). A pair that does not count for a metric has 0 in both its
    numerator and denominator there."""
    index: dict[Hashable, int] = {}
    codes = np.fromiter((index.setdefault(label, len(index)) for label in labels), dtype=np.intp, count=len(labels))
    numerators = [np.asarray(values, dtype=np.float64) for values in (a_num, b_num)]
    shape = numerators[0].shape
    if shape[:1] != codes.shape or numerators[1].shape != shape:
        raise ValueError(f"cluster_sums: values of shape {shape} and {numerators[1].shape} for {codes.shape[0]} pairs")

    def summed(values: npt.ArrayLike | None) -> Floats:
        matrix = np.ones(shape) if values is None else np.asarray(values, dtype=np.float64)
        if matrix.shape != shape:
            raise ValueError(f"cluster_sums: a denominator of shape {matrix.shape} for values of shape {shape}")
        matrix = matrix.reshape(-1, 1) if matrix.ndim == 1 else matrix
        return np.stack([np.bincount(codes, weights=column, minlength=len(index)) for column in matrix.T], axis=1)

    return ClusterSums(summed(a_num), summed(a_den), summed(b_num), summed(b_den))


def resampled_differences(sums: ClusterSums, *, resamples: int = BOOTSTRAP_RESAMPLES, seed: int = BOOTSTRAP_SEED) -> Floats:
    """B − A of every metric in each of ``resamples`` cluster resamples: shape (resamples, metrics).
    A resample whose drawn clusters leave a run's denominator at 0 gives NaN."""
    if resamples < 1:
        raise ValueError(f"resamples must be at least 1, got {resamples}")
    clusters, metrics = sums.a_num.shape
    out = np.full((resamples, metrics), np.nan)
    if clusters == 0:
        return out
    rng = np.random.default_rng(seed)
    chunk = max(1, min(resamples, _WEIGHTS_PER_CHUNK // clusters))
    for start in range(0, resamples, chunk):
        rows = min(chunk, resamples - start)
        drawn = rng.integers(0, clusters, size=(rows, clusters))
        # How often each cluster was drawn in each resample: one bincount over row-offset codes.
        offsets = (drawn + (np.arange(rows) * clusters)[:, None]).ravel()
        weights = np.bincount(offsets, minlength=rows * clusters).reshape(rows, clusters).astype(np.float64)
        with np.errstate(invalid="ignore", divide="ignore"):
            a = (weights @ sums.a_num) / (weights @ sums.a_den)
            b = (weights @ sums.b_num) / (weights @ sums.b_den)
        out[start : start + rows] = b - a
    return out


@dataclass(frozen=True)
class Interval:
    low: float | None
    high: float | None
    resamples_used: int
    """Resamples with a defined difference (a draw can leave a ratio's denominator at 0)."""


def percentile_interval(differences: Floats, confidence: float = 0.95) -> list[Interval]:
    """The percentile interval of each metric's resampled differences (columns of ``differences``).
    None bounds when fewer than half of the resamples are defined."""
    tail = (1.0 - confidence) / 2.0
    intervals = []
    for column in differences.T:
        finite = column[np.isfinite(column)]
        if finite.size * 2 < column.size or finite.size == 0:
            intervals.append(Interval(None, None, int(finite.size)))
            continue
        low, high = np.quantile(finite, [tail, 1.0 - tail])
        intervals.append(Interval(float(low), float(high), int(finite.size)))
    return intervals


def bootstrap_p_value(differences: Floats) -> float | None:
    """Two-sided bootstrap p-value of "no difference" from one metric's resampled differences:
    twice the smaller share of resamples at or beyond 0 on either side, each share counted as
    (k + 1)/(B + 1) so that a finite number of resamples never claims p = 0; at most 1. None
    when fewer than half of the resamples are defined (as :func:`percentile_interval`)."""
    finite = differences[np.isfinite(differences)]
    if finite.size == 0 or finite.size * 2 < differences.size:
        return None
    below, above = int((finite <= 0).sum()), int((finite >= 0).sum())
    return min(1.0, 2.0 * (min(below, above) + 1) / (finite.size + 1))


def holm_adjust(p_values: Sequence[float | None]) -> list[float | None]:
    """Holm's step-down adjustment of a family of p-values (None entries are not in the family
    and stay None): the i-th smallest of m becomes max over j ≤ i of min(1, (m − j + 1)·p_(j)).
    It keeps the family-wise error rate at the nominal level under any dependence."""
    known = sorted((p, i) for i, p in enumerate(p_values) if p is not None)
    adjusted: list[float | None] = [None] * len(p_values)
    running = 0.0
    for rank, (p, index) in enumerate(known):
        running = max(running, min(1.0, (len(known) - rank) * p))
        adjusted[index] = running
    return adjusted


def mcnemar_exact(only_a: int, only_b: int) -> float:
    """Two-sided exact McNemar p-value from the discordant pairs: ``only_a`` pairs where only run A
    succeeded, ``only_b`` where only run B did. Under no difference each discordant pair goes
    either way with probability 1/2, so the smaller count is Binomial(n, 1/2); the p-value is
    twice its lower tail, at most 1 (the binomial is symmetric, so this is the usual two-sided
    exact test). No discordant pair gives 1.

    The tail is summed in log space (log-gamma binomial coefficients, log-sum-exp): exact to about
    1e-12 relative, and fast for the tens of thousands of discordant pairs of a large run, where
    exact integer binomials would take minutes."""
    if only_a < 0 or only_b < 0:
        raise ValueError(f"discordant counts must be non-negative, got {only_a}, {only_b}")
    n = only_a + only_b
    if n == 0:
        return 1.0
    low = min(only_a, only_b)
    log_n = math.lgamma(n + 1) - n * math.log(2.0)
    logs = [log_n - math.lgamma(k + 1) - math.lgamma(n - k + 1) for k in range(low + 1)]
    top = max(logs)
    tail = math.exp(top) * math.fsum(math.exp(value - top) for value in logs)
    return min(1.0, 2.0 * tail)
