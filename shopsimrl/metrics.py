"""Summary metrics from episode traces: pure, streaming, bounded memory.

``SummaryAccumulator`` takes the latest trace record of each episode (de-duplication is the
caller's job: the store or the reducer) and keeps only sums, counters and fixed-size
histograms, so summarising a million episodes costs the same memory as summarising ten.

Reference-compatible keys (same names, same formulas as ``shopsimrl-eval-summary-v2``):
``counts.{requested, trace_files, completed, failed, scored, coverage}``,
``primary.{reward_mean, reward_sem, success_rate}``, ``reward_components.r_*``,
``behavior.*``, ``cost.{duration_ms_mean, tokens}`` and ``errors``. A record is completed
when :func:`shopsimrl.schemas.is_completed` says so; every other record is failed. Reward,
behaviour, cost, latency and per-step retry metrics use completed records only.
One deliberate departure: a NaN or infinite value (reward, component, duration) is ignored
like a non-numeric one, where the reference would have produced a NaN mean.

Keys added by ``shopsimrl-eval-summary-v3``:

================================  ==========================================================
key                               meaning
================================  ==========================================================
``counts.missing``                requested − completed − failed (≥ 0); null unless the
                                  requested episode ids are known
``counts.not_in_plan``            records whose ``episode_id`` is not a requested id; they
                                  are counted nowhere else
``counts.not_in_plan_ids_sample`` the first 20 such ids seen
``primary.reward_ci95``           [lo, hi]: mean ± t(0.975, n−1) · reward_sem (n ≥ 2)
``primary.success_sem``           sample SD (n−1) / √n of the ``r_success`` values (n ≥ 2)
``primary.success_ci95``          Wilson score interval (z = 1.95996) for success_rate
``primary.score``                 reward_mean × 100 (WebShop-style score)
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
``failure_classes``               counter of ``failure_class`` over failed records
                                  (``"unknown"`` when absent, as in legacy traces)
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
from collections.abc import Collection, Iterable, Mapping
from datetime import datetime, timezone
from functools import lru_cache
from statistics import NormalDist
from typing import Any

from shopsimrl.schemas import SUMMARY_SCHEMA_VERSION, is_completed

__all__ = [
    "SummaryAccumulator",
    "format_summary_table",
    "student_t_quantile",
    "summarize_traces",
    "wilson_interval",
]

_Z975 = NormalDist().inv_cdf(0.975)
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


def wilson_interval(p_hat: float, n: int, z: float = _Z975) -> tuple[float, float]:
    """Wilson score interval for a proportion ``p_hat`` observed over ``n`` trials."""
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
    """Count, exact mean and Welford's sum of squared deviations."""

    __slots__ = ("n", "total", "_mean", "_m2")

    def __init__(self) -> None:
        self.n = 0
        self.total = _ExactSum()
        self._mean = 0.0
        self._m2 = 0.0

    def add(self, x: float) -> None:
        self.n += 1
        self.total.add(x)
        delta = x - self._mean
        self._mean += delta / self.n
        self._m2 += delta * (x - self._mean)

    def mean(self) -> float | None:
        return _finite(self.total.value() / self.n) if self.n else None

    def sem(self) -> float | None:
        if self.n < 2:
            return None
        return _finite(math.sqrt(max(self._m2, 0.0) / (self.n - 1)) / math.sqrt(self.n))


class _LogHistogram:
    """Fixed-size log-bucketed histogram: nearest-rank quantiles within ALPHA relative error."""

    ALPHA = 0.005
    GAMMA = (1.0 + ALPHA) / (1.0 - ALPHA)
    MIN_VALUE = 1e-3
    MAX_VALUE = 1e9
    _LOG_GAMMA = math.log(GAMMA)
    SIZE = math.ceil(math.log(MAX_VALUE / MIN_VALUE) / _LOG_GAMMA) + 1

    __slots__ = ("buckets", "zeros", "stats", "low", "high")

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
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=timezone.utc)


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


def _count_value(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


# --------------------------------------------------------------------------- accumulator


class SummaryAccumulator:
    """Streams trace records (the winning record per episode, chosen by the caller) into a
    summary; memory does not grow with the number of episodes (sums, counters and fixed-size
    histograms only).

    ``requested_episode_ids``: the planned episodes. Records outside it are only counted under
    ``counts.not_in_plan``. ``requested``: the planned count when the ids are not at hand.
    """

    def __init__(
        self, *, requested_episode_ids: Collection[str] | None = None, requested: int | None = None
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
                raise ValueError(
                    f"requested={requested} disagrees with {len(self._plan_ids)} requested_episode_ids"
                )
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

    # ------------------------------------------------------------------ input

    def _in_plan(self, record: Mapping[str, Any]) -> bool:
        if not isinstance(record, Mapping):
            raise TypeError(f"a trace record must be a JSON object, got {type(record).__name__}")
        if self._plan_ids is None:
            return True
        episode_id = record.get("episode_id")
        return isinstance(episode_id, str) and episode_id in self._plan_ids

    def _note_span(self, record: Mapping[str, Any]) -> None:
        started, ended = _parse_time(record.get("started_at")), _parse_time(record.get("ended_at"))
        if started is not None and (self._first_start is None or started < self._first_start):
            self._first_start = started
        if ended is not None and (self._last_end is None or ended > self._last_end):
            self._last_end = ended

    def add(self, record: Mapping[str, Any]) -> None:
        """Count one episode's winning record."""
        if not self._in_plan(record):
            self._not_in_plan += 1
            if len(self._not_in_plan_sample) < _NOT_IN_PLAN_SAMPLE:
                self._not_in_plan_sample.append(str(record.get("episode_id")))
            return
        self._records += 1
        self._note_span(record)
        if not is_completed(dict(record) if not isinstance(record, dict) else record):
            error = _mapping(record.get("error"))
            self._errors.add(str(error.get("type") or "unknown"))
            failure_class = record.get("failure_class")
            self._failure_classes.add(str(failure_class) if failure_class else "unknown")
            return
        self._completed += 1
        final = _mapping(record.get("final"))
        reward = _number(final.get("reward"))
        if reward is not None:
            self._reward.add(reward)
        detail = _mapping(final.get("reward_detail"))
        success = _number(detail.get("r_success"))
        if success is not None:
            self._success.add(success)
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
        reason = final.get("termination_reason", "unknown")
        self._terminations.add(str(reason))
        duration = _number(record.get("duration_ms"))
        if duration is not None and duration >= 0:
            self._episode_ms.add(duration)
        attempt = record.get("attempt")
        if isinstance(attempt, int) and not isinstance(attempt, bool) and attempt > 1:
            self._episodes_retried += 1
        steps = record.get("steps")
        if isinstance(steps, list):
            self._steps += len(steps)
            for step in steps:
                if isinstance(step, Mapping):
                    self._add_step(step)

    def _add_step(self, step: Mapping[str, Any]) -> None:
        model = _mapping(step.get("model"))
        # The step-level objects are authoritative; the model's copies cover writers that omit them.
        if isinstance(step.get("protocol_error"), Mapping) or (
            "protocol_error" not in step and isinstance(model.get("protocol_error"), Mapping)
        ):
            self._protocol_errors += 1
        if isinstance(step.get("policy_failure"), Mapping) or (
            "policy_failure" not in step and isinstance(model.get("policy_failure"), Mapping)
        ):
            self._policy_failures += 1
        environment = step.get("environment")
        if isinstance(environment, Mapping):
            self._actions += 1
            feedback = environment.get("action_feedback")
            if isinstance(feedback, Mapping) and feedback and feedback.get("valid") is False:
                self._invalid_actions += 1
        usage = _mapping(model.get("usage"))
        for key in _TOKEN_KEYS:
            count = _count_value(usage.get(key))
            if count is not None:
                self._tokens[key] = self._tokens.get(key, 0) + count
        reasoning = _count_value(_mapping(usage.get("completion_tokens_details")).get("reasoning_tokens"))
        if reasoning is not None:
            self._tokens["reasoning_tokens"] = self._tokens.get("reasoning_tokens", 0) + reasoning
        latency = _number(model.get("latency_ms"))
        if latency is not None and latency >= 0:
            self._step_latency.add(latency)
        attempt_count = _count_value(model.get("attempt_count", step.get("attempt_count"))) or 1
        attempts = model.get("attempts", step.get("attempts"))
        tries = max(attempt_count, len(attempts) if isinstance(attempts, list) else 0, 1)
        if tries > 1:
            self._calls_retried += 1
            self._retry_attempts += tries - 1

    def note_superseded_attempt(self, record: Mapping[str, Any]) -> None:
        """Count an earlier attempt of an episode (e.g. a failed try later retried).

        It appears under ``retries.superseded_attempts`` and widens the throughput time span;
        it never enters the episode metrics.
        """
        if self._in_plan(record):
            self._superseded += 1
            self._note_span(record)

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

        reward_mean, reward_sem = self._reward.mean(), self._reward.sem()
        reward_ci = None
        if reward_mean is not None and reward_sem is not None:
            half = student_t_quantile(0.975, self._reward.n - 1) * reward_sem
            reward_ci = [_finite(reward_mean - half), _finite(reward_mean + half)]
        success_rate = self._success.mean()
        success_ci = None
        if success_rate is not None and 0.0 <= success_rate <= 1.0:
            success_ci = list(wilson_interval(success_rate, self._success.n))

        steps = self._steps
        span_hours = None
        if self._first_start is not None and self._last_end is not None:
            seconds = (self._last_end - self._first_start).total_seconds()
            span_hours = seconds / 3600.0 if seconds > 0 else None
        latency = self._step_latency

        return {
            "schema_version": SUMMARY_SCHEMA_VERSION,
            "created_at": created_at or datetime.now(timezone.utc).isoformat(),
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
                "reward_sem": reward_sem,
                "success_rate": success_rate,
                "reward_ci95": reward_ci,
                "success_sem": self._success.sem(),
                "success_ci95": success_ci,
                "score": _finite(reward_mean * 100.0) if reward_mean is not None else None,
            },
            "reward_components": {key: self._components[key].mean() for key in sorted(self._components)},
            "behavior": {
                "steps_mean": _finite(steps / completed) if completed else None,
                "model_steps": steps,
                "protocol_errors": self._protocol_errors,
                "protocol_error_rate": self._protocol_errors / steps if steps else None,
                "policy_failures": self._policy_failures,
                "policy_failure_rate": self._policy_failures / steps if steps else None,
                "total_actions": self._actions,
                "invalid_actions": self._invalid_actions,
                "invalid_action_rate": self._invalid_actions / self._actions if self._actions else None,
                "termination_reasons": self._terminations.as_dict(),
            },
            "cost": {
                "duration_ms_mean": self._episode_ms.stats.mean(),
                "tokens": {
                    key: self._tokens[key] for key in (*_TOKEN_KEYS, "reasoning_tokens") if key in self._tokens
                },
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
            },
            "failure_classes": self._failure_classes.as_dict(),
        }


def summarize_traces(
    records: Iterable[Mapping[str, Any]],
    *,
    requested_episode_ids: Collection[str] | None = None,
    requested: int | None = None,
    created_at: str | None = None,
) -> dict[str, Any]:
    """Summarise the winning record of each episode (see :class:`SummaryAccumulator`)."""
    accumulator = SummaryAccumulator(requested_episode_ids=requested_episode_ids, requested=requested)
    for record in records:
        accumulator.add(record)
    return accumulator.result(created_at=created_at)


# --------------------------------------------------------------------------- table

_TABLE_ROWS = (
    ("episodes", "requested {counts.requested} · completed {counts.completed} · failed {counts.failed}"
                 " · scored {counts.scored} · coverage {counts.coverage:%} · missing {counts.missing}"
                 " · not in plan {counts.not_in_plan}"),
    ("reward", "mean {primary.reward_mean} · sem {primary.reward_sem} · 95% CI {primary.reward_ci95:ci}"
               " · score {primary.score:.2f}"),
    ("success", "rate {primary.success_rate:%} · sem {primary.success_sem:%} · 95% CI {primary.success_ci95:ci%}"),
    ("components", "{reward_components:kv}"),
    ("steps", "mean {behavior.steps_mean:.2f} · model steps {behavior.model_steps}"
              " · protocol errors {behavior.protocol_errors} ({behavior.protocol_error_rate:%})"
              " · policy failures {behavior.policy_failures} ({behavior.policy_failure_rate:%})"),
    ("actions", "total {behavior.total_actions} · invalid {behavior.invalid_actions}"
                " ({behavior.invalid_action_rate:%})"),
    ("termination", "{behavior.termination_reasons:kv}"),
    ("latency", "model step p50 {latency.model_step_ms.p50:.0f} ms · p95 {latency.model_step_ms.p95:.0f} ms"
                " · mean {latency.model_step_ms.mean:.0f} ms (n={latency.model_step_ms.count})"
                " · episode p50 {latency.episode_ms.p50:.0f} ms · p95 {latency.episode_ms.p95:.0f} ms"),
    ("cost", "episode mean {cost.duration_ms_mean:.0f} ms · tokens {cost.tokens:kv}"),
    ("retries", "model calls {retries.model_calls_retried} (+{retries.model_retry_attempts} attempts)"
                " · episodes {retries.episodes_retried} · superseded {retries.superseded_attempts}"),
    ("throughput", "{throughput.episodes_per_hour:.1f} episodes/h"),
    ("errors", "{errors:kv}"),
    ("failures", "{failure_classes:kv}"),
)


class _TableFormatter(string.Formatter):
    """Resolves dotted summary paths; a missing or null value prints as a dash.

    Specs: ``%`` (percent), ``ci`` / ``ci%`` (an interval pair), ``kv`` (a counter or mapping).
    """

    def get_field(self, field_name: str, args: Any, kwargs: Any) -> tuple[Any, str]:
        value: Any = kwargs["summary"]
        for part in field_name.split("."):
            value = value.get(part) if isinstance(value, Mapping) else None
        return value, field_name

    def format_field(self, value: Any, format_spec: str) -> str:
        if value is None:
            return "–"
        if format_spec in ("ci", "ci%"):
            if not (isinstance(value, (list, tuple)) and len(value) == 2):
                return "–"
            inner = "%" if format_spec == "ci%" else ""
            return f"[{self.format_field(value[0], inner)}, {self.format_field(value[1], inner)}]"
        if format_spec == "kv":
            if not isinstance(value, Mapping) or not value:
                return "–"
            return ", ".join(f"{key} {self.format_field(item, '.3f')}" for key, item in value.items())
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return str(value)
        if format_spec == "%":
            return f"{value * 100.0:.1f}%"
        if isinstance(value, int):
            return str(value)
        return format(value, format_spec or ".4f")


def format_summary_table(summary: Mapping[str, Any]) -> str:
    """A compact plain-text table of a summary (v2 summaries without the v3 keys work too)."""
    formatter = _TableFormatter()
    width = max(len(label) for label, _ in _TABLE_ROWS)
    lines = [formatter.format("summary {schema_version} · created {created_at}", summary=summary)]
    lines += [f"{label.ljust(width)}  {formatter.format(row, summary=summary)}" for label, row in _TABLE_ROWS]
    return "\n".join(lines)
