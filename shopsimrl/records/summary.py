"""The run summary, ``shopsimrl-eval-summary-v3`` (docs/runtime_eval.md §5 defines every number).

v3 is the earlier implementation's v2 key set plus intervals, intent to treat, latency
percentiles, retry statistics and the run's identity; a v2 summary of the earlier implementation
is read through the same model (the v3 blocks are then empty).

Later additions inside v3's open blocks (``cost.tokens_all_attempts``, ``cost.pricing``,
``cost.accelerator_hours``, ``cost.money``, ``throughput.active_seconds`` and
``throughput.span_seconds``) keep the version: every reader of v3 reads them (the blocks took any
keys from the start), and a summary written before them reads them as absent.
"""

from __future__ import annotations

from typing import Annotated, Any, Final, Literal

from pydantic import Field, PlainValidator

from shopsimrl.records._base import FlexStr, Number, Object, OptObject, Record

__all__ = [
    "SUMMARY_SCHEMA_VERSION",
    "SUMMARY_SCHEMA_VERSIONS",
    "Behavior",
    "Cost",
    "Counts",
    "EvalSummary",
    "IntentToTreat",
    "Intervals",
    "PerTask",
    "Primary",
    "RunIdentity",
]

SUMMARY_SCHEMA_VERSION: Final = "shopsimrl-eval-summary-v3"
SUMMARY_SCHEMA_VERSIONS = ("shopsimrl-eval-summary-v2", SUMMARY_SCHEMA_VERSION)


def _texts(value: Any) -> list[str]:
    return [item for item in value if isinstance(item, str)] if isinstance(value, list) else []


Texts = Annotated[list[str], PlainValidator(_texts, json_schema_input_type=list[str])]
"""A list of strings (anything else in it dropped; [] for anything that is not a list)."""

Interval = list[float] | None
"""``[low, high]``, or None where there is no interval (a note says why)."""


class Counts(Record):
    requested: int | None = None
    """Jobs in the plan."""
    trace_files: int | None = None
    """Episodes with a winning record in the plan."""
    completed: int = 0
    failed: int = 0
    scored: int = 0
    """Completed episodes with a numeric reward."""
    coverage: float | None = None
    """completed / requested."""
    missing: int | None = None
    """requested − completed − failed; None without a plan."""
    not_in_plan: int = 0
    not_in_plan_ids_sample: list[str] = Field(default_factory=list)
    unreadable_lines: int | None = None


class Primary(Record):
    """Means over completed episodes (conditional on completing) and the two ITT means."""

    reward_mean: float | None = None
    reward_sem: float | None = None
    success_rate: float | None = None
    reward_ci95: Interval = None
    success_sem: float | None = None
    success_ci95: Interval = None
    score: float | None = None
    reward_mean_itt: float | None = None
    success_rate_itt: float | None = None


class IntentToTreat(Record):
    """The headline: every planned episode with an outcome, the agent's failures as 0."""

    episodes: int = 0
    failed_counted_as_zero: int = 0
    failed_unclassified: int = 0
    failed_infrastructure_excluded: int = 0
    failed_configuration_excluded: int = 0
    rerolled: int = 0
    reward_mean: float | None = None
    reward_sem: float | None = None
    reward_ci95: Interval = None
    success_rate: float | None = None
    success_sem: float | None = None
    success_ci95: Interval = None
    score: float | None = None


class Intervals(Record):
    confidence: float = 0.95
    method: FlexStr = None
    cluster: FlexStr = None
    clusters: int | None = None
    notes: dict[str, str] = Field(default_factory=dict)


class PerTask(Record):
    tasks: int = 0
    episodes_per_task: dict[str, int] | None = None
    pass_at_k: dict[str, float] | None = None
    pass_hat_k: dict[str, float] | None = None
    tasks_at_k: dict[str, int] | None = None
    pass_at_k_ci95: dict[str, Interval] | None = None
    pass_hat_k_ci95: dict[str, Interval] | None = None
    pass_k_notes: dict[str, str] = Field(default_factory=dict)


class Behavior(Record):
    steps_mean: float | None = None
    model_steps: int = 0
    protocol_errors: int = 0
    protocol_error_rate: float | None = None
    policy_failures: int = 0
    policy_failure_rate: float | None = None
    policy_failure_codes: dict[str, int] = Field(default_factory=dict)
    total_actions: int = 0
    invalid_actions: int = 0
    invalid_action_rate: float | None = None
    termination_reasons: dict[str, int] = Field(default_factory=dict)


class Cost(Record):
    """What the run spent (docs/runtime_eval.md §5, "Cost"); the keys after ``tokens`` are absent
    from summaries written before them."""

    duration_ms_mean: Number = None
    tokens: Object = Field(default_factory=dict)
    """Summed ``usage`` tokens of completed episodes (the reference's key)."""
    tokens_all_attempts: Object = Field(default_factory=dict)
    """Summed ``usage`` tokens of every record: failed episodes, superseded attempts, duplicates."""
    pricing: OptObject = None
    """The prices used (the manifest's ``execution.cost``), null without any."""
    accelerator_hours: Number = None
    """Active wall hours × accelerators × the model server's share; null without ``accelerators``."""
    money: OptObject = None
    """``currency``, an amount per priced item (``prompt_tokens``, ``completion_tokens``,
    ``accelerator``) and ``total`` (null when a priced item is unknown); null without prices."""
    notes: Texts = Field(default_factory=list)
    """Why an amount is unknown or approximate."""


class RunIdentity(Record):
    """Which run the numbers belong to (no credentials in ``uri``)."""

    uri: FlexStr = None
    experiment: FlexStr = None
    model_id: FlexStr = None
    model_name: FlexStr = None
    checkpoint_id: FlexStr = None
    plan_fingerprint: FlexStr = None
    split: dict[str, Any] = Field(default_factory=dict)
    versions: dict[str, Any] = Field(default_factory=dict)


class EvalSummary(Record):
    """``summary.json`` of a run (local or reduced from shards)."""

    schema_version: Literal["shopsimrl-eval-summary-v2", "shopsimrl-eval-summary-v3"] = SUMMARY_SCHEMA_VERSION
    created_at: FlexStr = None
    counts: Counts = Field(default_factory=Counts)
    primary: Primary = Field(default_factory=Primary)
    intent_to_treat: IntentToTreat = Field(default_factory=IntentToTreat)
    intervals: Intervals = Field(default_factory=Intervals)
    per_task: PerTask = Field(default_factory=PerTask)
    reward_components: dict[str, float | None] = Field(default_factory=dict)
    behavior: Behavior = Field(default_factory=Behavior)
    cost: Cost = Field(default_factory=Cost)
    errors: dict[str, int] = Field(default_factory=dict)
    latency: dict[str, Any] = Field(default_factory=dict)
    """``model_step_ms.{p50,p95,mean,count}``, ``episode_ms.{p50,p95}``."""
    retries: dict[str, int] = Field(default_factory=dict)
    throughput: dict[str, float | None] = Field(default_factory=dict)
    failure_classes: dict[str, int] = Field(default_factory=dict)
    run: RunIdentity | None = None
    model_inflight: dict[str, Any] | None = None
    """The adaptive model in-flight limit over the run's invocations (shopsimrl.inflight); local
    runs with ``model.adaptive_concurrency`` only (a sharded worker logs its own)."""
