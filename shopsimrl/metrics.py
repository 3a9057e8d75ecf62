"""Summary metrics from episode traces: pure, streaming, bounded memory.

``SummaryAccumulator`` takes the latest trace record of each episode (de-duplication is the
caller's job: the store or the reducer) and keeps only sums, counters, fixed-size histograms
and eight floats per distinct task (the clustered statistics need per-task sums, and repeats
of a task can arrive far apart), never a trace: memory grows with the number of tasks, not
with the number of episodes or repeats.

Reference-compatible keys (same names, same formulas as ``shopsimrl-eval-summary-v2``):
``counts.{requested, trace_files, completed, failed, scored, coverage}``,
``primary.{reward_mean, reward_sem, success_rate}``, ``reward_components.r_*``,
``behavior.*``, ``cost.{duration_ms_mean, tokens}`` and ``errors``. A record is completed
when :attr:`EpisodeTrace.completed <shopsimrl.records.EpisodeTrace.completed>` says so; every other record is failed. Reward,
behaviour, cost, latency and per-step retry metrics use completed records only.
Two deliberate departures: a NaN or infinite value (reward, component, duration) is ignored
like a non-numeric one, where the reference would have produced a NaN mean; and
``reward_sem`` (and ``success_sem``) are clustered by task: identical to the reference's
SD/√n when every task ran once, and not shrunk by repeats that merely agree with each other
(the reference's SE fell by √repeats for a deterministic policy). One addition to a reference
key: ``behavior.termination_reasons`` counts ``time_limit`` for an episode the runtime ended at its
time limit (:func:`termination_reason`); the environment, which was sent ``action_limit``, says
``action_limit`` in its ``final``, and a run without a time limit counts exactly as the reference.

Keys added by ``shopsimrl-eval-summary-v3``:

================================  ==========================================================
key                               meaning
================================  ==========================================================
``counts.missing``                requested − completed − failed (≥ 0); null unless the
                                  requested episode ids are known
``counts.not_in_plan``            records whose ``episode_id`` is not a requested id; they
                                  are counted nowhere else
``counts.not_in_plan_ids_sample`` the first 20 such ids seen
``primary.reward_ci95``           95 % interval of reward_mean, clustered by task, inside
                                  [0, 1] (:func:`clustered_mean`); null below two tasks
``primary.success_sem``           task-clustered SE of the ``r_success`` values
``primary.success_ci95``          the same interval for success_rate (a proportion)
``primary.score``                 reward_mean × 100 (WebShop-style score)
``primary.reward_mean_itt``,      intent to treat: completed episodes plus every failed
``primary.success_rate_itt``      episode whose failure is an outcome (not ``infrastructure``
                                  or ``configuration_error``), the latter as 0
``intent_to_treat``               that denominator, its SEs, intervals and score;
                                  ``rerolled``: scored episodes that replaced an earlier
                                  attempt whose failure was an outcome
``intervals``                     the interval method, the cluster key and count, and a
                                  note per interval that is missing or fell back
``per_task``                      tasks, episodes per task, and with repeats the unbiased
                                  pass@k and pass^k (keys are k) with the tasks counted
``behavior.policy_failure_codes`` counter of ``policy_failure.code`` over steps
``latency.model_step_ms``         ``{p50, p95, mean, count}`` of per-step ``model.latency_ms``
``latency.episode_ms``            ``{p50, p95}`` of ``duration_ms``
``retries.model_calls_retried``   steps whose model call took more than one attempt
                                  (``attempt_count`` > 1 or more than one ``attempts`` entry)
``retries.model_retry_attempts``  sum of the extra attempts of those steps
``retries.episodes_retried``      completed records whose ``attempt`` is > 1
``retries.superseded_attempts``   earlier attempts reported via ``note_superseded_attempt``
``throughput.episodes_per_hour``  completed / (latest ``ended_at`` − earliest
                                  ``started_at``), over every record and superseded attempt;
                                  null when the span is unknown or not positive
``throughput.span_seconds``       that span (latest ``ended_at`` − earliest ``started_at``)
``throughput.active_seconds``     wall seconds with an episode in flight: the union of every
                                  record's span, pauses up to 60 s bridged
                                  (:class:`shopsimrl.cost.ActiveTime`)
``cost.tokens_all_attempts``      tokens summed over every record: failed episodes,
                                  superseded attempts and duplicates too (what was spent)
``cost.pricing``, ``cost.money``, the run's recorded prices, accelerator hours (active hours
``cost.accelerator_hours``        × accelerators × server share) and money per item and in
                                  total (:mod:`shopsimrl.cost`); null without prices
``failure_classes``               counter of ``failure_class`` over failed records
                                  (``"unknown"`` when absent, as in legacy traces)
``run``                           added by the caller, not here: the run's identity
                                  (:func:`shopsimrl.manifest.run_identity`)
================================  ==========================================================

Percentiles are nearest-rank (the smallest value with at least q·n values at or below it),
read from a log-bucketed histogram: 2,765 buckets with ratio γ = 1.005/0.995 over 1 µs …
1e9 ms, each reported at the point whose relative distance to both bucket edges is 0.5 %.
So p50/p95 are within 0.5 % of the exact nearest-rank value (clamped to the observed min and
max); values outside the range clamp to the end buckets. Means are exact (compensated sums,
equal to ``statistics.fmean``). The Student t quantile comes from the regularised incomplete
beta function (continued fraction), with a Cornish-Fisher expansion for df > 1000.

Categorical counters keep at most 256 distinct keys; later new keys count under ``"<other>"``.
At most 64 distinct ``r_*`` reward components are tracked. Output is JSON-safe: no NaN or inf.
"""

from __future__ import annotations

import math
import string
from array import array
from collections import Counter
from collections.abc import Collection, Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import lru_cache
from statistics import NormalDist
from typing import Any

from shopsimrl.cost import ActiveTime, cost_block, read_pricing
from shopsimrl.records import EpisodeTrace, ErrorInfo, JobRecord, ModelTurn, Step, read_trace
from shopsimrl.records.trace import EXCUSED_FAILURE_CLASSES
from shopsimrl.schemas import SUMMARY_SCHEMA_VERSION

__all__ = [
    "CI_METHOD",
    "ClusteredEstimate",
    "SummaryAccumulator",
    "clustered_mean",
    "format_money",
    "format_summary_table",
    "pass_at_k",
    "pass_hat_k",
    "student_t_quantile",
    "summarize_traces",
    "termination_reason",
    "unfinished_view",
    "wilson_interval",
]

_Z975 = NormalDist().inv_cdf(0.975)
CI_METHOD = "task-clustered-score-t"
"""Names the interval method of :func:`clustered_mean` in ``summary.json``."""
_MAX_COUNTER_KEYS = 256
_MAX_COMPONENTS = 64
_NOT_IN_PLAN_SAMPLE = 20
_TOKEN_KEYS = ("prompt_tokens", "completion_tokens", "total_tokens")


# --------------------------------------------------------------------------- statistics helpers


def _number(value: Any) -> float | None:
    """A finite non-bool int/float as float, else None (bools are not scores)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    result = float(value)
    return result if math.isfinite(result) else None


def _finite(value: float | None) -> float | None:
    return value if value is not None and math.isfinite(value) else None


def _reg_inc_beta(a: float, b: float, x: float, y: float) -> float:
    """I_x(a, b), with y = 1 − x passed in separately so tails near x = 1 keep precision."""
    if x <= 0.0:
        return 0.0
    if y <= 0.0:
        return 1.0
    front = math.exp(math.lgamma(a + b) - math.lgamma(a) - math.lgamma(b) + a * math.log(x) + b * math.log(y))
    # The continued fraction converges fast only below the mean; use the symmetry otherwise.
    if x < (a + 1.0) / (a + b + 2.0):
        return front * _beta_cf(a, b, x) / a
    return 1.0 - front * _beta_cf(b, a, y) / b


def _beta_cf(a: float, b: float, x: float) -> float:
    """Continued fraction of the incomplete beta function (modified Lentz)."""
    tiny = 1e-300
    c, d = 1.0, 1.0 - (a + b) * x / (a + 1.0)
    d = 1.0 / (d if abs(d) > tiny else tiny)
    h = d
    for m in range(1, 1000):
        m2 = 2 * m
        for numerator in (
            m * (b - m) * x / ((a - 1.0 + m2) * (a + m2)),
            -(a + m) * (a + b + m) * x / ((a + m2) * (a + 1.0 + m2)),
        ):
            d = 1.0 + numerator * d
            d = 1.0 / (d if abs(d) > tiny else tiny)
            c = 1.0 + numerator / c
            c = c if abs(c) > tiny else tiny
            delta = c * d
            h *= delta
        if abs(delta - 1.0) < 1e-15:
            break
    return h


def _t_upper_tail(t: float, df: float) -> float:
    """P(T > t) for t ≥ 0."""
    denom = df + t * t
    return 0.5 * _reg_inc_beta(df / 2.0, 0.5, df / denom, t * t / denom)


@lru_cache(maxsize=512)
def student_t_quantile(p: float, df: float) -> float:
    """The p-quantile of Student's t distribution with ``df`` degrees of freedom."""
    if not 0.0 < p < 1.0:
        raise ValueError(f"student_t_quantile: p must be in (0, 1), got {p!r}")
    if not df > 0 or not math.isfinite(df):
        raise ValueError(f"student_t_quantile: df must be a positive finite number, got {df!r}")
    if p < 0.5:
        return -student_t_quantile(1.0 - p, df)
    if p == 0.5:
        return 0.0
    z = NormalDist().inv_cdf(p)
    if df > 1000:
        # Cornish-Fisher expansion around the normal quantile; the error is O(df**-5).
        z2 = z * z
        g1 = (z2 + 1) * z / 4
        g2 = ((5 * z2 + 16) * z2 + 3) * z / 96
        g3 = (((3 * z2 + 19) * z2 + 17) * z2 - 15) * z / 384
        g4 = ((((79 * z2 + 776) * z2 + 1482) * z2 - 1920) * z2 - 945) * z / 92160
        return z + g1 / df + g2 / df**2 + g3 / df**3 + g4 / df**4
    target = 1.0 - p
    lo, hi = 0.0, max(2.0 * z, 1.0)
    while _t_upper_tail(hi, df) > target:
        lo, hi = hi, hi * 2.0
    for _ in range(200):  # bisection: the tail is monotone, so this cannot diverge
        mid = 0.5 * (lo + hi)
        if _t_upper_tail(mid, df) > target:
            lo = mid
        else:
            hi = mid
        if hi - lo <= 1e-13 * hi:
            break
    return 0.5 * (lo + hi)


def wilson_interval(p_hat: float, n: float, z: float = _Z975) -> tuple[float, float]:
    """Wilson score interval for a proportion ``p_hat`` observed over ``n`` trials.

    ``n`` may be an effective (non-integer) sample size, as :func:`clustered_mean` passes."""
    if n <= 0:
        raise ValueError(f"wilson_interval: n must be positive, got {n!r}")
    if not 0.0 <= p_hat <= 1.0:
        raise ValueError(f"wilson_interval: p_hat must be in [0, 1], got {p_hat!r}")
    z2n = z * z / n
    centre = (p_hat + z2n / 2.0) / (1.0 + z2n)
    half = z / (1.0 + z2n) * math.sqrt(p_hat * (1.0 - p_hat) / n + z2n / (4.0 * n))
    # At p_hat 0 or 1 the bound is exact; rounding must not leave a 1e-17 residue there.
    low = 0.0 if p_hat == 0.0 else max(0.0, centre - half)
    high = 1.0 if p_hat == 1.0 else min(1.0, centre + half)
    return low, high


@dataclass(frozen=True)
class ClusteredEstimate:
    """A mean over episodes with its task-clustered standard error and 95 % interval."""

    mean: float | None
    sem: float | None
    ci95: tuple[float, float] | None
    note: str | None
    """Why the interval is missing or not the plain computed one; None otherwise."""
    clusters: int
    observations: int


# Below this the clustered SE is rounding noise of equal task means, not spread.
_ZERO_SE = 1e-12


def clustered_mean(
    clusters: Sequence[tuple[float, float]], *, proportion: bool = False, bounded: bool = True
) -> ClusteredEstimate:
    """Mean, task-clustered SE and 95 % interval from per-task ``(count, sum)`` pairs.

    The mean is the ratio estimator Σ sums / Σ counts (every episode weighs the same). Its SE
    is the cluster-robust one, √(G/(G−1) · Σ_c (S_c − n_c·μ)²) / N over G tasks and N
    episodes: with one episode per task it is exactly the sample SD/√N, with balanced repeats
    it is the SD of the task means/√G. The interval (see docs/runtime_eval.md §5):

    * ``bounded`` (every value in [0, 1]): the Wilson score interval with the t(0.975, G−1)
      quantile and the effective sample size n_eff = μ(1−μ)/SE² (a quasi-binomial score
      interval: it stays inside [0, 1]); for a ``proportion`` n_eff is capped at N
      (design effect ≥ 1, Korn & Graubard);
    * all task means equal (SE 0): n_eff = G, the widest spread a [0, 1] value with this mean
      can have, one observation per task; ``note`` says so;
    * not ``bounded``: mean ± t(0.975, G−1)·SE, with a note;
    * fewer than two tasks: no SE and no interval, with a note.
    """
    pairs = [(n, s) for n, s in clusters if n > 0]
    count = len(pairs)
    observations = math.fsum(n for n, _ in pairs)
    if not count:
        return ClusteredEstimate(None, None, None, "no values", 0, 0)
    mean = _finite(math.fsum(s for _, s in pairs) / observations)
    if mean is None:
        return ClusteredEstimate(None, None, None, "the values do not add up to a finite mean", count, int(observations))
    if count < 2:
        note: str | None = "one task: the spread between tasks cannot be estimated, so there is no interval"
        return ClusteredEstimate(mean, None, None, note, count, int(observations))
    squares = math.fsum((s - n * mean) ** 2 for n, s in pairs)
    sem = _finite(math.sqrt(count / (count - 1) * squares) / observations)
    if sem is None:
        return ClusteredEstimate(mean, None, None, "the spread between tasks is not finite", count, int(observations))
    q = student_t_quantile(0.975, count - 1)
    note = None
    if not bounded or not 0.0 <= mean <= 1.0:
        low, high = mean - q * sem, mean + q * sem
        note = "values outside [0, 1] were seen: Student t interval, not bounded"
    elif sem > _ZERO_SE and 0.0 < mean < 1.0:
        effective = mean * (1.0 - mean) / (sem * sem)
        if proportion:
            effective = min(effective, observations)
        low, high = wilson_interval(mean, effective, q)
    else:
        low, high = wilson_interval(mean, count, q)
        sem = 0.0
        note = (
            f"all {count} task means equal {mean:.6g}: no spread between tasks was seen, so the interval "
            f"assumes the largest spread a [0, 1] value with this mean can have, one observation per task"
        )
    ci = (_finite(low), _finite(high))
    return ClusteredEstimate(mean, sem, ci if None not in ci else None, note, count, int(observations))  # type: ignore[arg-type]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k of one task: P(at least one of k draws without replacement from n
    attempts with c successes succeeds) = 1 − C(n−c, k)/C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.prod((n - c - i) / (n - i) for i in range(k))


def pass_hat_k(n: int, c: int, k: int) -> float:
    """Unbiased pass^k of one task (tau-bench): P(all of k draws without replacement succeed)
    = C(c, k)/C(n, k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_hat_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if c < k:
        return 0.0
    return math.prod((c - i) / (n - i) for i in range(k))


class _ExactSum:
    """Shewchuk's exactly rounded running sum. The partials never overlap, so their number is
    bounded by the float exponent range (a few dozen at most), not by the number of values."""

    __slots__ = ("partials",)

    def __init__(self) -> None:
        self.partials: list[float] = []

    def add(self, x: float) -> None:
        i = 0
        partials = self.partials
        for y in partials:
            if abs(x) < abs(y):
                x, y = y, x
            hi = x + y
            lo = y - (hi - x)
            if lo:
                partials[i] = lo
                i += 1
            x = hi
        partials[i:] = [x]

    def value(self) -> float:
        try:
            return math.fsum(self.partials)
        except (OverflowError, ValueError):  # sums beyond the float range
            return math.nan


class _Moments:
    """Count and exact mean (the spread is computed per task, in :func:`clustered_mean`)."""

    __slots__ = ("n", "total")

    def __init__(self) -> None:
        self.n = 0
        self.total = _ExactSum()

    def add(self, x: float) -> None:
        self.n += 1
        self.total.add(x)

    def mean(self) -> float | None:
        return _finite(self.total.value() / self.n) if self.n else None


class _LogHistogram:
    """Fixed-size log-bucketed histogram: nearest-rank quantiles within ALPHA relative error."""

    ALPHA = 0.005
    GAMMA = (1.0 + ALPHA) / (1.0 - ALPHA)
    MIN_VALUE = 1e-3
    MAX_VALUE = 1e9
    _LOG_GAMMA = math.log(GAMMA)
    SIZE = math.ceil(math.log(MAX_VALUE / MIN_VALUE) / _LOG_GAMMA) + 1

    __slots__ = ("buckets", "high", "low", "stats", "zeros")

    def __init__(self) -> None:
        self.buckets = [0] * self.SIZE
        self.zeros = 0
        self.stats = _Moments()
        self.low = math.inf
        self.high = -math.inf

    def add(self, x: float) -> None:
        self.stats.add(x)
        self.low = min(self.low, x)
        self.high = max(self.high, x)
        if x <= 0.0:
            self.zeros += 1
            return
        # Bucket i >= 1 holds (MIN·γ^(i−1), MIN·γ^i]; bucket 0 holds (0, MIN].
        index = math.ceil(math.log(x / self.MIN_VALUE) / self._LOG_GAMMA) if x > self.MIN_VALUE else 0
        self.buckets[min(max(index, 0), self.SIZE - 1)] += 1

    @property
    def count(self) -> int:
        return self.stats.n

    def quantile(self, q: float) -> float | None:
        if self.count == 0:
            return None
        rank = max(1, math.ceil(q * self.count - 1e-9))
        seen = self.zeros
        if rank <= seen:
            return max(self.low, 0.0)
        for index, bucket in enumerate(self.buckets):
            seen += bucket
            if seen >= rank:
                value = self.MIN_VALUE * 2.0 * self.GAMMA**index / (self.GAMMA + 1.0) if index else self.MIN_VALUE
                return min(max(value, self.low), self.high)
        return self.high  # unreachable: the counts add up to self.count

    def percentiles(self) -> dict[str, float | None]:
        return {"p50": self.quantile(0.50), "p95": self.quantile(0.95)}


class _TaskTable:
    """Per-task sums for the clustered statistics: a few floats per task, never a trace.

    Repeats of one task can arrive far apart (other episodes, other shards), so the sums stay
    until the end; memory grows with the number of distinct tasks, not with episodes."""

    REWARD_N, REWARD_SUM, SUCCESS_N, SUCCESS_SUM, PASSES, ITT_N, ITT_REWARD, ITT_SUCCESS = range(8)
    WIDTH = 8

    __slots__ = ("rows", "values")

    def __init__(self) -> None:
        self.rows: dict[Hashable, int] = {}
        self.values = array("d")

    def row(self, key: Hashable) -> int:
        row = self.rows.get(key)
        if row is None:
            row = self.rows[key] = len(self.rows)
            self.values.extend([0.0] * self.WIDTH)
        return row

    def add(self, row: int, field: int, value: float) -> None:
        self.values[row * self.WIDTH + field] += value

    def pairs(self, count_field: int, sum_field: int) -> list[tuple[float, float]]:
        """``(count, sum)`` of every task with a positive count."""
        values, width = self.values, self.WIDTH
        pairs = []
        for base in range(0, len(values), width):
            n = values[base + count_field]
            if n > 0:
                pairs.append((n, values[base + sum_field]))
        return pairs


def _task_key(record: EpisodeTrace) -> Hashable:
    """The cluster of an episode: its task id."""
    return record.job.task_id


class _BoundedCounter:
    """A counter over categorical values that stops adding new keys after a limit."""

    __slots__ = ("counts", "limit")

    def __init__(self, limit: int = _MAX_COUNTER_KEYS) -> None:
        self.counts: dict[str, int] = {}
        self.limit = limit

    def add(self, key: str) -> None:
        if key not in self.counts and len(self.counts) >= self.limit:
            key = "<other>"
        self.counts[key] = self.counts.get(key, 0) + 1

    def as_dict(self) -> dict[str, int]:
        return dict(sorted(self.counts.items()))


def _parse_time(value: Any) -> datetime | None:
    if not isinstance(value, str) or not value:
        return None
    try:
        parsed = datetime.fromisoformat(value.replace("Z", "+00:00"))
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


# --------------------------------------------------------------------------- compact records


def unfinished_view(record: EpisodeTrace) -> EpisodeTrace:
    """What :meth:`SummaryAccumulator.add` and :meth:`~SummaryAccumulator.note_superseded_attempt`
    read of a record that is not completed: a few scalars instead of a partial episode's steps
    and observations. A reducer holds these while it waits to see whether a later attempt of
    the episode completed. Keep it in step with the failed branch of ``add`` (tests/test_metrics.py
    compares the two)."""
    return EpisodeTrace(
        episode_id=record.episode_id,
        status="failed",
        job=JobRecord(task_id=record.job.task_id, sample_id=record.job.sample_id, seed=record.job.seed, split=record.job.split),
        started_at=record.started_at,
        ended_at=record.ended_at,
        failure_class=record.failure_class,
        error=ErrorInfo(type=record.error.type if record.error is not None else None),
        # The tokens it spent: each step's usage only (a few numbers, not its observations).
        steps=[
            Step(step_index=step.step_index, model=ModelTurn(usage=step.model.usage))
            for step in record.steps
            if step.model.usage is not None
        ],
    )


# --------------------------------------------------------------------------- accumulator


def termination_reason(record: EpisodeTrace) -> str:
    """How a completed episode ended: the environment's ``final.termination_reason``, except
    ``time_limit`` for one the runtime ended at its time limit (sent to the shop as ``action_limit``)."""
    if record.time_limit is not None:
        return "time_limit"
    final = record.final
    return str(final.get("termination_reason", "unknown")) if final is not None else "unknown"


@dataclass(slots=True)
class StepFacts:
    """What the metrics count of one step (the summary's and the research tools' one reading)."""

    protocol_error: bool
    policy_failure: str | None
    """The policy failure's code (``unknown`` when it has none), None without one."""
    acted: bool
    """An action reached the environment."""
    invalid_action: bool
    tokens: dict[str, int]
    latency_ms: float | None
    retries: int
    """Model-call attempts beyond the first."""


def step_facts(step: Step) -> StepFacts:
    model = step.model
    # The step-level objects are authoritative; the model's copies cover writers that omit them.
    policy_failure = step.effective_policy_failure
    environment = step.environment
    feedback = environment.action_feedback if environment is not None else None
    tokens = {}
    usage = model.usage
    if usage is not None:
        for key, count in (
            ("prompt_tokens", usage.prompt_tokens),
            ("completion_tokens", usage.completion_tokens),
            ("total_tokens", usage.total_tokens),
            ("reasoning_tokens", usage.reasoning_tokens),
        ):
            if count is not None:
                tokens[key] = count
    latency = model.latency_ms
    return StepFacts(
        protocol_error=step.effective_protocol_error is not None,
        policy_failure=(policy_failure.code or "unknown") if policy_failure is not None else None,
        acted=environment is not None,
        invalid_action=feedback is not None and bool(feedback.as_dict()) and feedback.valid is False,
        tokens=tokens,
        latency_ms=latency if latency is not None and latency >= 0 else None,
        retries=model.tries - 1,
    )


class SummaryAccumulator:
    """Streams trace records (the winning record per episode, chosen by the caller) into a
    summary; memory does not grow with the number of episodes (sums, counters and fixed-size
    histograms only).

    ``requested_episode_ids``: the planned episodes. Records outside it are only counted under
    ``counts.not_in_plan``. ``requested``: the planned count when the ids are not at hand.
    ``execution``: the manifest's execution block, whose ``cost`` prices the run (none: no money).
    """

    def __init__(
        self,
        *,
        requested_episode_ids: Collection[str] | None = None,
        requested: int | None = None,
        execution: Mapping[str, Any] | None = None,
    ) -> None:
        self._plan_ids: frozenset[str] | None = None
        if requested_episode_ids is not None:
            if isinstance(requested_episode_ids, str):
                raise TypeError("requested_episode_ids must be a collection of episode ids, not a string")
            self._plan_ids = frozenset(requested_episode_ids)
        if requested is not None:
            if isinstance(requested, bool) or not isinstance(requested, int) or requested < 0:
                raise ValueError(f"requested must be a non-negative integer, got {requested!r}")
            if self._plan_ids is not None and requested != len(self._plan_ids):
                raise ValueError(f"requested={requested} disagrees with {len(self._plan_ids)} requested_episode_ids")
        self._requested = requested
        self._records = 0
        self._completed = 0
        self._not_in_plan = 0
        self._not_in_plan_sample: list[str] = []
        self._reward = _Moments()
        self._success = _Moments()
        self._components: dict[str, _Moments] = {}
        self._steps = 0
        self._protocol_errors = 0
        self._policy_failures = 0
        self._actions = 0
        self._invalid_actions = 0
        self._terminations = _BoundedCounter()
        self._errors = _BoundedCounter()
        self._failure_classes = _BoundedCounter()
        self._tokens: dict[str, int] = {}
        self._step_latency = _LogHistogram()
        self._episode_ms = _LogHistogram()
        self._calls_retried = 0
        self._retry_attempts = 0
        self._episodes_retried = 0
        self._superseded = 0
        self._first_start: datetime | None = None
        self._last_end: datetime | None = None
        self._tasks = _TaskTable()
        self._rewards_bounded = True
        self._successes_bounded = True
        self._failed_counted_zero = 0
        self._failed_infrastructure = 0
        self._failed_configuration = 0
        self._failed_unclassified = 0
        # Re-rolls: episodes with a superseded attempt that was an outcome, less those whose
        # winner is excused (not scored). Both sets hold failures only, never every episode.
        self._outcomes_superseded: set[str] = set()
        self._excused_winners: set[str] = set()
        self._policy_codes = _BoundedCounter()
        # Cost: tokens of every record read (failed and superseded ones too) and the wall time
        # with an episode in flight; prices from the manifest.
        self._tokens_all: dict[str, int] = {}
        self._active = ActiveTime()
        self._pricing, self._pricing_note = read_pricing(execution)

    # ------------------------------------------------------------------ input

    def _in_plan(self, record: EpisodeTrace) -> bool:
        if not isinstance(record, EpisodeTrace):
            raise TypeError(f"a trace record must be an EpisodeTrace, got {type(record).__name__}")
        return self._plan_ids is None or record.episode_id in self._plan_ids

    def _note_span(self, record: EpisodeTrace) -> None:
        started, ended = _parse_time(record.started_at), _parse_time(record.ended_at)
        if started is not None and (self._first_start is None or started < self._first_start):
            self._first_start = started
        if ended is not None and (self._last_end is None or ended > self._last_end):
            self._last_end = ended

    def add(self, record: EpisodeTrace) -> None:
        """Count one episode's winning record."""
        if not self._in_plan(record):
            self._not_in_plan += 1
            if len(self._not_in_plan_sample) < _NOT_IN_PLAN_SAMPLE:
                self._not_in_plan_sample.append(record.episode_id)
            return
        self._records += 1
        self._note_span(record)
        self._active.add_times(record.started_at, record.ended_at)
        tasks = self._tasks
        final = record.final
        if not record.completed or final is None:
            self._add_spent_tokens(record)
            self._errors.add((record.error.type if record.error is not None else None) or "unknown")
            failure_class = record.failure_class
            self._failure_classes.add(failure_class or "unknown")
            # Intent to treat: only a failure known to say nothing about the agent is excused.
            if failure_class in EXCUSED_FAILURE_CLASSES:
                if failure_class == "infrastructure":
                    self._failed_infrastructure += 1
                else:
                    self._failed_configuration += 1
                self._excused_winners.add(record.episode_id)
            else:
                self._failed_counted_zero += 1
                self._failed_unclassified += not failure_class
                tasks.add(tasks.row(_task_key(record)), tasks.ITT_N, 1.0)
            return
        self._completed += 1
        row = tasks.row(_task_key(record))
        reward = final.reward
        if reward is not None:
            self._reward.add(reward)
            self._rewards_bounded = self._rewards_bounded and 0.0 <= reward <= 1.0
            tasks.add(row, tasks.REWARD_N, 1.0)
            tasks.add(row, tasks.REWARD_SUM, reward)
        detail = final.reward_detail
        success = _number(detail.get("r_success"))
        if success is not None:
            self._success.add(success)
            self._successes_bounded = self._successes_bounded and 0.0 <= success <= 1.0
            tasks.add(row, tasks.SUCCESS_N, 1.0)
            tasks.add(row, tasks.SUCCESS_SUM, success)
            if abs(success - 1.0) <= 1e-6:  # tau-bench's success test
                tasks.add(row, tasks.PASSES, 1.0)
        tasks.add(row, tasks.ITT_N, 1.0)
        tasks.add(row, tasks.ITT_REWARD, reward or 0.0)
        tasks.add(row, tasks.ITT_SUCCESS, success or 0.0)
        for key, value in detail.items():
            component = _number(value)
            if not (isinstance(key, str) and key.startswith("r_")) or component is None:
                continue
            moments = self._components.get(key)
            if moments is None:
                if len(self._components) >= _MAX_COMPONENTS:
                    continue
                moments = self._components[key] = _Moments()
            moments.add(component)
        self._terminations.add(termination_reason(record))
        duration = record.duration_ms
        if duration is not None and duration >= 0:
            self._episode_ms.add(duration)
        if record.attempt is not None and record.attempt > 1:
            self._episodes_retried += 1
        self._steps += len(record.steps)
        for step in record.steps:
            self._add_step(step)

    def _add_step(self, step: Step) -> None:
        facts = step_facts(step)
        self._protocol_errors += facts.protocol_error
        if facts.policy_failure is not None:
            self._policy_failures += 1
            self._policy_codes.add(facts.policy_failure)
        self._actions += facts.acted
        self._invalid_actions += facts.invalid_action
        for key, count in facts.tokens.items():
            self._tokens[key] = self._tokens.get(key, 0) + count
            self._tokens_all[key] = self._tokens_all.get(key, 0) + count
        if facts.latency_ms is not None:
            self._step_latency.add(facts.latency_ms)
        if facts.retries:
            self._calls_retried += 1
            self._retry_attempts += facts.retries

    def note_superseded_attempt(self, record: EpisodeTrace) -> None:
        """Count an earlier attempt of an episode (e.g. a failed try later retried).

        It appears under ``retries.superseded_attempts`` and widens the throughput time span;
        it never enters the episode metrics.
        """
        if self._in_plan(record):
            self._superseded += 1
            self._note_span(record)
            self._active.add_times(record.started_at, record.ended_at)
            self._add_spent_tokens(record)
            if record.failed_as_outcome:
                self._outcomes_superseded.add(record.episode_id)

    def note_duplicate(self, record: EpisodeTrace) -> None:
        """Count a further completed record of an episode that already has one (a replaced pod
        ran it again): only what it spent, its tokens and its time, never its outcome."""
        if self._in_plan(record):
            self._active.add_times(record.started_at, record.ended_at)
            self._add_spent_tokens(record)

    def _add_spent_tokens(self, record: EpisodeTrace) -> None:
        """The tokens of a record that is not a counted completed episode (those count theirs
        step by step in ``_add_step``)."""
        for step in record.steps:
            usage = step.model.usage
            if usage is None:
                continue
            for key, count in (
                ("prompt_tokens", usage.prompt_tokens),
                ("completion_tokens", usage.completion_tokens),
                ("total_tokens", usage.total_tokens),
                ("reasoning_tokens", usage.reasoning_tokens),
            ):
                if count is not None:
                    self._tokens_all[key] = self._tokens_all.get(key, 0) + count

    # ------------------------------------------------------------------ output

    def result(self, *, created_at: str | None = None) -> dict[str, Any]:
        """The ``summary.json`` object (JSON-serialisable, no NaN)."""
        if self._plan_ids is not None:
            requested = len(self._plan_ids)
        elif self._requested is not None:
            requested = self._requested
        else:
            requested = self._records
        completed, failed = self._completed, self._records - self._completed
        missing = max(0, requested - completed - failed) if self._plan_ids is not None else None

        reward_mean, success_rate = self._reward.mean(), self._success.mean()
        tasks = self._tasks
        reward = clustered_mean(tasks.pairs(tasks.REWARD_N, tasks.REWARD_SUM), bounded=self._rewards_bounded)
        success = clustered_mean(
            tasks.pairs(tasks.SUCCESS_N, tasks.SUCCESS_SUM), proportion=True, bounded=self._successes_bounded
        )
        itt_pairs = tasks.pairs(tasks.ITT_N, tasks.ITT_REWARD)
        itt_reward = clustered_mean(itt_pairs, bounded=self._rewards_bounded)
        itt_success = clustered_mean(
            tasks.pairs(tasks.ITT_N, tasks.ITT_SUCCESS), proportion=True, bounded=self._successes_bounded
        )
        notes = {
            name: estimate.note
            for name, estimate in (
                ("reward", reward),
                ("success", success),
                ("reward_itt", itt_reward),
                ("success_itt", itt_success),
            )
            if estimate.note is not None and estimate.observations
        }

        steps = self._steps
        span_hours = span_seconds = None
        if self._first_start is not None and self._last_end is not None:
            span_seconds = (self._last_end - self._first_start).total_seconds()
            span_hours = span_seconds / 3600.0 if span_seconds > 0 else None
        latency = self._step_latency
        active_seconds = self._active.seconds()
        spent = {key: self._tokens_all[key] for key in (*_TOKEN_KEYS, "reasoning_tokens") if key in self._tokens_all}
        cost = cost_block(spent, active_seconds, self._pricing, self._pricing_note)
        if self._active.bridged_over_limit_s:
            cost["notes"].append(
                f"active time includes {self._active.bridged_over_limit_s:.0f} s of pauses joined to keep its span list bounded"
            )

        return {
            "schema_version": SUMMARY_SCHEMA_VERSION,
            "created_at": created_at or datetime.now(UTC).isoformat(),
            "counts": {
                "requested": requested,
                "trace_files": self._records,
                "completed": completed,
                "failed": failed,
                "scored": self._reward.n,
                "coverage": completed / requested if requested else 0.0,
                "missing": missing,
                "not_in_plan": self._not_in_plan,
                "not_in_plan_ids_sample": list(self._not_in_plan_sample),
            },
            "primary": {
                "reward_mean": reward_mean,
                "reward_sem": reward.sem,
                "success_rate": success_rate,
                "reward_ci95": _pair(reward.ci95),
                "success_sem": success.sem,
                "success_ci95": _pair(success.ci95),
                "score": _finite(reward_mean * 100.0) if reward_mean is not None else None,
                "reward_mean_itt": itt_reward.mean,
                "success_rate_itt": itt_success.mean,
            },
            "intent_to_treat": {
                "episodes": itt_reward.observations,
                "failed_counted_as_zero": self._failed_counted_zero,
                "failed_unclassified": self._failed_unclassified,
                "failed_infrastructure_excluded": self._failed_infrastructure,
                "failed_configuration_excluded": self._failed_configuration,
                "rerolled": len(self._outcomes_superseded - self._excused_winners),
                "reward_mean": itt_reward.mean,
                "reward_sem": itt_reward.sem,
                "reward_ci95": _pair(itt_reward.ci95),
                "success_rate": itt_success.mean,
                "success_sem": itt_success.sem,
                "success_ci95": _pair(itt_success.ci95),
                "score": _finite(itt_reward.mean * 100.0) if itt_reward.mean is not None else None,
            },
            "intervals": {
                "confidence": 0.95,
                "method": CI_METHOD,
                "cluster": "task_id",
                "clusters": reward.clusters,
                "notes": notes,
            },
            "per_task": self._per_task(),
            "reward_components": {key: self._components[key].mean() for key in sorted(self._components)},
            "behavior": {
                "steps_mean": _finite(steps / completed) if completed else None,
                "model_steps": steps,
                "protocol_errors": self._protocol_errors,
                "protocol_error_rate": self._protocol_errors / steps if steps else None,
                "policy_failures": self._policy_failures,
                "policy_failure_rate": self._policy_failures / steps if steps else None,
                "policy_failure_codes": self._policy_codes.as_dict(),
                "total_actions": self._actions,
                "invalid_actions": self._invalid_actions,
                "invalid_action_rate": self._invalid_actions / self._actions if self._actions else None,
                "termination_reasons": self._terminations.as_dict(),
            },
            "cost": {
                "duration_ms_mean": self._episode_ms.stats.mean(),
                "tokens": {key: self._tokens[key] for key in (*_TOKEN_KEYS, "reasoning_tokens") if key in self._tokens},
                **cost,
            },
            "errors": self._errors.as_dict(),
            "latency": {
                "model_step_ms": {**latency.percentiles(), "mean": latency.stats.mean(), "count": latency.count},
                "episode_ms": self._episode_ms.percentiles(),
            },
            "retries": {
                "model_calls_retried": self._calls_retried,
                "model_retry_attempts": self._retry_attempts,
                "episodes_retried": self._episodes_retried,
                "superseded_attempts": self._superseded,
            },
            "throughput": {
                "episodes_per_hour": _finite(completed / span_hours) if span_hours else None,
                "span_seconds": span_seconds,
                "active_seconds": active_seconds,
            },
            "failure_classes": self._failure_classes.as_dict(),
        }

    def _per_task(self) -> dict[str, Any]:
        """Tasks, repeats per task and, with repeats, pass@k and pass^k (unbiased estimators)."""
        tasks = self._tasks
        shapes: Counter[tuple[int, int]] = Counter(
            (round(n), round(passes)) for n, passes in tasks.pairs(tasks.SUCCESS_N, tasks.PASSES)
        )
        sizes = [n for n, _ in shapes]
        block: dict[str, Any] = {
            "tasks": sum(shapes.values()),
            "episodes_per_task": {"min": min(sizes), "max": max(sizes)} if sizes else None,
            "pass_at_k": None,
            "pass_hat_k": None,
            "tasks_at_k": None,
            "pass_at_k_ci95": None,
            "pass_hat_k_ci95": None,
            "pass_k_notes": {},
        }
        largest = max(sizes, default=0)
        if largest < 2:
            return block
        pass_at, pass_hat, counted = {}, {}, {}
        intervals: dict[str, dict[str, list[float] | None]] = {"pass_at_k": {}, "pass_hat_k": {}}
        notes: dict[str, str] = {}
        for k in _report_ks(largest):
            usable = [(n, c, weight) for (n, c), weight in shapes.items() if n >= k]
            total = sum(weight for *_, weight in usable)
            pass_at[str(k)] = math.fsum(pass_at_k(n, c, k) * w for n, c, w in usable) / total
            pass_hat[str(k)] = math.fsum(pass_hat_k(n, c, k) * w for n, c, w in usable) / total
            counted[str(k)] = total
            # The task is the unit: a t interval over the per-task estimates, bounded in [0, 1]
            # and never zero-width (clustered_mean with one value per task).
            for name, estimator in (("pass_at_k", pass_at_k), ("pass_hat_k", pass_hat_k)):
                per_task = [pair for n, c, w in usable for pair in [(1.0, estimator(n, c, k))] * w]
                estimate = clustered_mean(per_task)
                intervals[name][str(k)] = _pair(estimate.ci95)
                if estimate.note is not None:
                    notes[f"{name}[{k}]"] = estimate.note
        block.update(
            pass_at_k=pass_at,
            pass_hat_k=pass_hat,
            tasks_at_k=counted,
            pass_at_k_ci95=intervals["pass_at_k"],
            pass_hat_k_ci95=intervals["pass_hat_k"],
            pass_k_notes=notes,
        )
        return block


def _report_ks(largest: int) -> list[int]:
    """Every k up to 16, then powers of two, and the largest repeat count itself."""
    ks = set(range(1, min(largest, 16) + 1))
    power = 32
    while power < largest:
        ks.add(power)
        power *= 2
    ks.add(largest)
    return sorted(ks)


def _pair(interval: tuple[float, float] | None) -> list[float] | None:
    return list(interval) if interval is not None else None


def summarize_traces(
    records: Iterable[EpisodeTrace | Mapping[str, Any]],
    *,
    requested_episode_ids: Collection[str] | None = None,
    requested: int | None = None,
    created_at: str | None = None,
) -> dict[str, Any]:
    """Summarise the winning record of each episode (see :class:`SummaryAccumulator`); records
    given as parsed JSON objects are read as :class:`~shopsimrl.records.EpisodeTrace` first."""
    accumulator = SummaryAccumulator(requested_episode_ids=requested_episode_ids, requested=requested)
    for record in records:
        accumulator.add(record if isinstance(record, EpisodeTrace) else read_trace(record))
    return accumulator.result(created_at=created_at)


# --------------------------------------------------------------------------- table

# The intent-to-treat rows come first: they count every planned episode with an outcome (a
# failure as 0), so a checkpoint that fails on hard tasks cannot look better than one that
# finishes them; the means over completed episodes follow, named as conditional.
_TABLE_ROWS = (
    (
        "run",
        "{run.experiment} · model {run.model_id} ({run.model_name}, checkpoint {run.checkpoint_id})"
        " · split {run.split.name} · plan {run.plan_fingerprint:short}",
    ),
    (
        "episodes",
        "requested {counts.requested} · completed {counts.completed} · failed {counts.failed}"
        " · scored {counts.scored} · coverage {counts.coverage:%} · missing {counts.missing}"
        " · not in plan {counts.not_in_plan}",
    ),
    (
        "reward (ITT)",
        "mean {intent_to_treat.reward_mean} · 95% CI {intent_to_treat.reward_ci95:ci} · score {intent_to_treat.score:.2f}"
        " · coverage {counts.coverage:%} · over {intent_to_treat.episodes} episodes"
        " (failures as 0: {intent_to_treat.failed_counted_as_zero},"
        " excluded: infrastructure {intent_to_treat.failed_infrastructure_excluded},"
        " configuration {intent_to_treat.failed_configuration_excluded} · re-rolled {intent_to_treat.rerolled})",
    ),
    ("success (ITT)", "rate {intent_to_treat.success_rate:%} · 95% CI {intent_to_treat.success_ci95:ci%}"),
    (
        "reward (completed)",
        "mean {primary.reward_mean} · sem {primary.reward_sem} · 95% CI {primary.reward_ci95:ci} · score {primary.score:.2f}"
        " · conditional: only the {counts.scored} scored episodes",
    ),
    ("success (completed)", "rate {primary.success_rate:%} · sem {primary.success_sem:%} · 95% CI {primary.success_ci95:ci%}"),
    ("tasks", "{per_task.tasks} · episodes per task {per_task.episodes_per_task.min}–{per_task.episodes_per_task.max}"),
    ("pass@k", "{per_task:pass_at_k}"),
    ("pass^k", "{per_task:pass_hat_k}"),
    ("components", "{reward_components:kv}"),
    (
        "steps",
        "mean {behavior.steps_mean:.2f} · model steps {behavior.model_steps}"
        " · protocol errors {behavior.protocol_errors} ({behavior.protocol_error_rate:%})"
        " · policy failures {behavior.policy_failures} ({behavior.policy_failure_rate:%})"
        " {behavior.policy_failure_codes:kv}",
    ),
    ("actions", "total {behavior.total_actions} · invalid {behavior.invalid_actions} ({behavior.invalid_action_rate:%})"),
    ("termination", "{behavior.termination_reasons:kv}"),
    (
        "latency",
        "model step p50 {latency.model_step_ms.p50:.0f} ms · p95 {latency.model_step_ms.p95:.0f} ms"
        " · mean {latency.model_step_ms.mean:.0f} ms (n={latency.model_step_ms.count})"
        " · episode p50 {latency.episode_ms.p50:.0f} ms · p95 {latency.episode_ms.p95:.0f} ms",
    ),
    ("cost", "episode mean {cost.duration_ms_mean:.0f} ms · tokens {cost.tokens:kv}"),
    (
        "spent",
        "tokens (every attempt) {cost.tokens_all_attempts:kv} · accelerator hours {cost.accelerator_hours:.4f}"
        " · money {cost.money:money}",
    ),
    (
        "retries",
        "model calls {retries.model_calls_retried} (+{retries.model_retry_attempts} attempts)"
        " · episodes {retries.episodes_retried} · superseded {retries.superseded_attempts}",
    ),
    (
        "throughput",
        "{throughput.episodes_per_hour:.1f} episodes/h · active {throughput.active_seconds:.1f} s"
        " of {throughput.span_seconds:.1f} s from first start to last end",
    ),
    ("errors", "{errors:kv}"),
    ("failures", "{failure_classes:kv}"),
)


class _TableFormatter(string.Formatter):
    """Resolves dotted summary paths; a missing or null value prints as a dash.

    Specs: ``%`` (percent), ``ci`` / ``ci%`` / ``ci.3f`` (an interval pair, its bounds formatted
    by the rest of the spec), ``kv`` (a counter or mapping), ``pass_at_k`` / ``pass_hat_k`` (of the
    ``per_task`` block: each k with its interval), ``short`` (the first 12 characters of a digest).
    """

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> tuple[Any, str]:
        value: Any = kwargs["summary"]
        for part in field_name.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        return value, field_name

    def format_field(self, value: Any, format_spec: str) -> str:
        if value is None:
            return "–"
        if format_spec.startswith("ci"):
            if not (isinstance(value, (list, tuple)) and len(value) == 2):
                return "–"
            inner = format_spec[2:]
            return f"[{self.format_field(value[0], inner)}, {self.format_field(value[1], inner)}]"
        if format_spec == "money":
            return format_money(value)
        if format_spec == "kv":
            if not isinstance(value, Mapping) or not value:
                return "–"
            return ", ".join(f"{key} {self.format_field(item, '.3f')}" for key, item in value.items())
        if format_spec in ("pass_at_k", "pass_hat_k"):
            # ``value`` is the per_task block: each k's estimate with its interval beside it.
            estimates = value.get(format_spec) if isinstance(value, Mapping) else None
            if not isinstance(estimates, Mapping) or not estimates:
                return "–"
            intervals = value.get(f"{format_spec}_ci95")
            intervals = intervals if isinstance(intervals, Mapping) else {}
            return " · ".join(
                f"k={k} {self.format_field(item, '.3f')} {self.format_field(intervals.get(k), 'ci.3f')}"
                for k, item in estimates.items()
            )
        if format_spec == "short" and isinstance(value, str):
            return value[:12]
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return str(value)
        if format_spec == "%":
            return f"{value * 100.0:.1f}%"
        if isinstance(value, int):
            return str(value)
        return format(value, format_spec or ".4f")


def format_money(money: Any) -> str:
    """A summary's ``cost.money``: the total with its currency, then each priced item; a dash
    without prices, ``unknown`` where a priced amount could not be computed."""
    if not isinstance(money, Mapping):
        return "–"
    currency = str(money.get("currency") or "")

    def amount(value: Any) -> str:
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return "unknown"
        return f"{value:.2f}" if abs(value) >= 1 else f"{value:.4f}"  # cents hide a small run's cost

    items = [f"{key.removesuffix('_tokens')} {amount(value)}" for key, value in money.items() if key not in ("currency", "total")]
    return f"{amount(money.get('total'))} {currency}".strip() + (f" ({', '.join(items)})" if items else "")


def format_summary_table(summary: Mapping[str, Any]) -> str:
    """A compact plain-text table of a summary (v2 summaries without the v3 keys work too)."""
    formatter = _TableFormatter()
    width = max(len(label) for label, _ in _TABLE_ROWS)
    lines = [formatter.format("summary {schema_version} · created {created_at}", summary=summary)]
    lines += [f"{label.ljust(width)}  {formatter.format(row, summary=summary)}" for label, row in _TABLE_ROWS]
    notes = summary.get("intervals", {}).get("notes") if isinstance(summary.get("intervals"), Mapping) else None
    if isinstance(notes, Mapping):
        lines += [f"{'note'.ljust(width)}  {name} interval: {text}" for name, text in notes.items()]
    cost = summary.get("cost")
    cost_notes = cost.get("notes") if isinstance(cost, Mapping) else None
    if isinstance(cost_notes, list):
        lines += [f"{'note'.ljust(width)}  cost: {text}" for text in cost_notes]
    per_task = summary.get("per_task")
    pass_notes = per_task.get("pass_k_notes") if isinstance(per_task, Mapping) else None
    if isinstance(pass_notes, Mapping):
        # One line per distinct note: the same fallback usually holds for many k.
        grouped: dict[str, list[str]] = {}
        for name, text in pass_notes.items():
            grouped.setdefault(str(text), []).append(str(name))
        lines += [f"{'note'.ljust(width)}  {', '.join(names)} intervals: {text}" for text, names in grouped.items()]
    return "\n".join(lines)
