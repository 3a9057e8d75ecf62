"""The paired statistics against independent computations: scipy's exact binomial test for
McNemar, an exhaustive enumeration of every bootstrap resample on small inputs, the textbook
t interval on a large one, and clustered against unclustered resampling on repeats."""

from __future__ import annotations

import itertools
import math

import numpy as np
import pytest
from scipy.stats import binomtest

from shopsimrl.research.paired_stats import (
    BOOTSTRAP_RESAMPLES,
    bootstrap_p_value,
    cluster_sums,
    holm_adjust,
    mcnemar_exact,
    percentile_interval,
    resampled_differences,
)


@pytest.mark.parametrize("only_a", [*range(13), 40, 131, 2_400, 19_000])
def test_mcnemar_is_scipys_exact_two_sided_binomial_test(only_a: int) -> None:
    for only_b in [*range(13), 37, 150, 2_300, 19_400]:
        n = only_a + only_b
        expected = 1.0 if n == 0 else binomtest(min(only_a, only_b), n, 0.5, alternative="two-sided").pvalue
        assert mcnemar_exact(only_a, only_b) == pytest.approx(expected, rel=1e-9, abs=1e-300), (only_a, only_b)


def test_mcnemar_rejects_negative_counts() -> None:
    with pytest.raises(ValueError, match="non-negative"):
        mcnemar_exact(-1, 3)


# Five tasks with 1–3 paired episodes each: rewards of run A and run B, and one task that B
# fails to improve. Small enough to enumerate all 5**5 = 3,125 equally likely resamples.
TASKS = ["t1", "t2", "t2", "t3", "t3", "t3", "t4", "t5", "t5"]
A = [0.2, 1.0, 0.5, 0.0, 0.25, 0.75, 1.0, 0.0, 0.5]
B = [0.8, 1.0, 1.0, 0.5, 0.25, 1.0, 0.0, 1.0, 0.5]


def _exact_distribution(tasks: list[str], a: list[float], b: list[float]) -> tuple[np.ndarray, np.ndarray]:
    """Every resample of the clusters with replacement, by brute force: the differences of the
    pooled means B − A, each with its probability (all draws are equally likely)."""
    clusters = list(dict.fromkeys(tasks))
    members = {c: [i for i, t in enumerate(tasks) if t == c] for c in clusters}
    values = []
    for draw in itertools.product(clusters, repeat=len(clusters)):
        picked = [i for c in draw for i in members[c]]
        values.append(sum(b[i] for i in picked) / len(picked) - sum(a[i] for i in picked) / len(picked))
    return np.array(values), np.full(len(values), 1.0 / len(values))


def test_the_bootstrap_matches_every_resample_enumerated() -> None:
    exact, weights = _exact_distribution(TASKS, A, B)
    sampled = resampled_differences(cluster_sums(TASKS, A, B))[:, 0]
    assert sampled.shape == (BOOTSTRAP_RESAMPLES,)
    exact_mean = float(exact @ weights)
    exact_sd = math.sqrt(float(((exact - exact_mean) ** 2) @ weights))
    assert sampled.mean() == pytest.approx(exact_mean, abs=4 * exact_sd / math.sqrt(sampled.size))
    assert sampled.std() == pytest.approx(exact_sd, rel=0.05)
    (interval,) = percentile_interval(sampled[:, None])
    assert interval.low is not None and interval.high is not None
    for bound, tail in ((interval.low, 0.025), (interval.high, 0.975)):
        # The exact distribution puts about `tail` of its mass below the sampled bound
        # (the distribution is discrete: compare the mass strictly below and at or below).
        below, at_or_below = weights[exact < bound].sum(), weights[exact <= bound].sum()
        assert below - 0.01 <= tail <= at_or_below + 0.01, (bound, below, at_or_below)


def test_the_point_estimate_is_the_pooled_ratio_of_the_pairs() -> None:
    sums = cluster_sums(TASKS, A, B)
    mean_a, mean_b, difference = sums.estimates()
    assert (mean_a[0], mean_b[0]) == (pytest.approx(sum(A) / len(A)), pytest.approx(sum(B) / len(B)))
    assert difference[0] == pytest.approx((sum(B) - sum(A)) / len(A))
    assert sums.a_num.shape == (5, 1)  # one row per task, first-seen order
    # A rate: Σ numerator / Σ denominator per run (invalid actions over actions).
    rate = cluster_sums(["t1", "t1", "t2"], [1, 0, 3], [0, 0, 1], a_den=[4, 2, 6], b_den=[5, 5, 5]).estimates()
    assert (rate[0][0], rate[1][0]) == (pytest.approx(4 / 12), pytest.approx(1 / 15))


def test_one_episode_per_task_gives_the_t_interval_on_a_large_sample() -> None:
    """With one pair per task and many tasks, the percentile interval of the paired bootstrap
    approaches the textbook mean ± 1.96 · SD/√n of the paired differences."""
    rng = np.random.default_rng(7)
    a = rng.uniform(0, 1, 800)
    b = np.clip(a + rng.normal(0.05, 0.2, 800), 0, 1)
    (interval,) = percentile_interval(resampled_differences(cluster_sums([f"t{i}" for i in range(800)], a, b)))
    d = b - a
    half = 1.96 * d.std(ddof=1) / math.sqrt(d.size)
    assert interval.low == pytest.approx(d.mean() - half, abs=0.1 * half)
    assert interval.high == pytest.approx(d.mean() + half, abs=0.1 * half)


def _widths(tasks: list[str], episodes: list[str], a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    widths = []
    for labels in (tasks, episodes):
        (interval,) = percentile_interval(resampled_differences(cluster_sums(labels, a, b)))
        assert interval.low is not None and interval.high is not None
        widths.append(interval.high - interval.low)
    return widths[0], widths[1]


def test_clustering_by_task_widens_the_interval_when_repeats_agree() -> None:
    """40 tasks, 5 repeats each. When the repeats of a task agree (the difference is a property
    of the task), resampling episodes as if independent understates the uncertainty by about
    √5; resampling tasks does not. When the repeats are independent noise, both agree."""
    rng = np.random.default_rng(11)
    tasks = [f"t{t}" for t in range(40) for _ in range(5)]
    episodes = [f"{task}-s{i % 5}" for i, task in enumerate(tasks)]
    a = rng.uniform(0, 1, 200)
    task_effect = np.repeat(rng.normal(0.1, 0.3, 40), 5)
    clustered, unclustered = _widths(tasks, episodes, a, a + task_effect)
    assert 1.8 < clustered / unclustered < 2.8  # √5 ≈ 2.24
    noise = rng.normal(0.1, 0.3, 200)
    clustered, unclustered = _widths(tasks, episodes, a, a + noise)
    assert 0.8 < clustered / unclustered < 1.25


def test_resampling_is_seeded_and_shared_across_metrics() -> None:
    one = cluster_sums(TASKS, A, B)
    both = cluster_sums(TASKS, np.column_stack([A, B]), np.column_stack([B, A]))
    alone = resampled_differences(one, seed=5)
    together = resampled_differences(both, seed=5)
    assert np.array_equal(alone[:, 0], together[:, 0])  # adding a metric changes no other interval
    assert np.array_equal(together[:, 1], -together[:, 0])
    assert not np.array_equal(alone, resampled_differences(one, seed=6))


def test_resamples_without_a_denominator_are_left_out_and_counted() -> None:
    """A rate whose only actions are in one task: resamples that miss it have no rate."""
    sums = cluster_sums(["t1", "t2", "t3"], [1, 0, 0], [0, 0, 0], a_den=[2, 0, 0], b_den=[2, 0, 0])
    (interval,) = percentile_interval(resampled_differences(sums, resamples=2000))
    expected_hits = 2000 * (1 - (2 / 3) ** 3)  # resamples that draw t1 at least once
    assert interval.resamples_used == pytest.approx(expected_hits, rel=0.08)
    assert interval.low == interval.high == -0.5


def test_the_interval_covers_no_difference_about_95_percent_of_the_time() -> None:
    """400 seeded null experiments (60 tasks × 2 repeats, B = A + a task effect and noise of
    mean 0, rewards in [0, 1] shapes): the 95% interval contains 0 in about 95% of them."""
    rng = np.random.default_rng(2026)
    tasks = [t for t in range(60) for _ in range(2)]
    covered = 0
    for trial in range(400):
        a = rng.uniform(0, 1, 120)
        b = a + np.repeat(rng.normal(0, 0.2, 60), 2) + rng.normal(0, 0.1, 120)
        (interval,) = percentile_interval(resampled_differences(cluster_sums(tasks, a, b), resamples=1000, seed=trial))
        assert interval.low is not None and interval.high is not None
        covered += interval.low <= 0 <= interval.high
    assert 0.91 <= covered / 400 <= 0.985, covered


def test_the_bootstrap_p_value_is_about_uniform_under_no_difference() -> None:
    """The null experiments above: p < 0.05 in about 5 % of them, and never 0 (a finite number of
    resamples cannot rule a difference out entirely)."""
    rng = np.random.default_rng(2027)
    tasks = [t for t in range(60) for _ in range(2)]
    p_values = []
    for trial in range(400):
        a = rng.uniform(0, 1, 120)
        b = a + np.repeat(rng.normal(0, 0.2, 60), 2) + rng.normal(0, 0.1, 120)
        p = bootstrap_p_value(resampled_differences(cluster_sums(tasks, a, b), resamples=1000, seed=trial)[:, 0])
        assert p is not None and 0.0 < p <= 1.0
        p_values.append(p)
    assert 0.015 <= np.mean(np.array(p_values) < 0.05) <= 0.09
    assert 0.3 <= np.mean(np.array(p_values) < 0.5) <= 0.7
    # Every resample on one side: the smallest p these resamples can give; all equal to 0: 1.
    assert bootstrap_p_value(np.full(999, 0.25)) == pytest.approx(2 / 1000)
    assert bootstrap_p_value(np.zeros(999)) == 1.0
    assert bootstrap_p_value(np.full(10, np.nan)) is None


def test_holm_adjusts_step_down_and_keeps_order() -> None:
    # Hand-computed: sorted 0.01, 0.02, 0.04, 0.30 of m = 4 -> 0.04, 0.06, 0.08, 0.30.
    assert holm_adjust([0.04, 0.01, 0.30, None, 0.02]) == [
        pytest.approx(0.08),
        pytest.approx(0.04),
        pytest.approx(0.30),
        None,
        pytest.approx(0.06),
    ]
    # Monotone: a later (larger) p never gets a smaller adjusted value than an earlier one; capped at 1.
    assert holm_adjust([0.02, 0.021, 0.9]) == [pytest.approx(0.06), pytest.approx(0.06), pytest.approx(0.9)]
    assert holm_adjust([0.6, 0.7]) == [1.0, 1.0] and holm_adjust([]) == []


def test_holm_keeps_the_family_wise_error_rate_over_twenty_null_slices() -> None:
    """Twenty independent null slices of McNemar tests, 500 seeded families: some unadjusted p < 0.05
    in most families, some Holm-adjusted one in about 5 % at most."""
    rng = np.random.default_rng(11)
    any_raw = any_holm = 0
    for _ in range(500):
        p_values: list[float | None] = []
        for _ in range(20):
            discordant = int(rng.integers(5, 40))
            only_a = int(rng.binomial(discordant, 0.5))
            p_values.append(mcnemar_exact(only_a, discordant - only_a))
        any_raw += any(p is not None and p < 0.05 for p in p_values)
        any_holm += any(p is not None and p < 0.05 for p in holm_adjust(p_values))
    assert any_raw / 500 > 0.4 and any_holm / 500 <= 0.07, (any_raw, any_holm)
