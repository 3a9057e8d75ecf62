"""The episode trace, ``shopsimrl-episode-v4``: one record per episode attempt (docs/runtime_eval.md §2).

The key set and order are the earlier implementation's (its 15 keys), then this one's additive
keys. Payloads the environment and the model server define (reset, observation state, reward
detail, usage, tools) are open objects: the keys shopsimrl reads are typed here, every other key
is kept as it came. Field order is part of the file format: changing it changes the written
lines, so it goes with a new schema version.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Final, Literal

from pydantic import Field, field_validator

from shopsimrl.records._base import Count, FlexBool, FlexStr, Number, Object, Objects, OptObject, Payload, Record

__all__ = [
    "EXCUSED_FAILURE_CLASSES",
    "FAILURE_CLASSES",
    "TRACE_SCHEMA_VERSION",
    "TRACE_SCHEMA_VERSIONS",
    "ActionFeedback",
    "CallAttempt",
    "CodedMessage",
    "EnvironmentResult",
    "EpisodeTrace",
    "ErrorInfo",
    "FailureClass",
    "JobRecord",
    "ModelTurn",
    "SelectedSkill",
    "Step",
    "TimeLimit",
    "ToolCallRecord",
    "Usage",
]

TRACE_SCHEMA_VERSION: Final = "shopsimrl-episode-v4"
"""Every trace line written by this package carries this version (reference-compatible)."""
TRACE_SCHEMA_VERSIONS = (TRACE_SCHEMA_VERSION,)
"""The versions this shopsimrl reads."""

FailureClass = Literal["infrastructure", "configuration_error", "environment_error", "model_error", "runtime_error"]
FAILURE_CLASSES: tuple[FailureClass, ...] = (
    "infrastructure",
    "configuration_error",
    "environment_error",
    "model_error",
    "runtime_error",
)
"""``failure_class`` of a failed record (docs/runtime_eval.md §4 has the attribution table)."""
EXCUSED_FAILURE_CLASSES: frozenset[str] = frozenset({"infrastructure", "configuration_error"})
"""Failures that say nothing about the agent: outside the intent-to-treat score, and run again by
the next invocation. Every other failure (and one without a class: traces of the earlier
implementation) is an outcome of the episode: a 0 in the score, final once recorded."""


def _finite(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    result = float(value)
    return result if math.isfinite(result) else None


class JobRecord(Record):
    """The frozen unit of work the attempt ran."""

    task_id: int = Field(strict=True, ge=0)
    sample_id: int = Field(strict=True, ge=0)
    seed: int = Field(strict=True, ge=0)
    split: str = Field(strict=True, min_length=1)

    ALWAYS_WRITTEN: ClassVar[tuple[str, ...]] = ("task_id", "sample_id", "seed", "split")


class ToolCallRecord(Record):
    """One tool call of a model reply, as the adapter read it."""

    call_id: FlexStr = None
    name: FlexStr = None
    arguments: OptObject = None
    """The parsed JSON object, None when the raw argument string was not one."""
    raw_arguments: FlexStr = None
    """The argument string exactly as the model wrote it."""


class CodedMessage(Record):
    """A protocol error or a policy failure: a code and a human-readable message."""

    code: FlexStr = None
    message: FlexStr = None


class Usage(Payload):
    """The model server's token usage, as it reported it."""

    DOCUMENTED: ClassVar[dict[str, dict[str, Any]]] = {
        "prompt_tokens": {"type": "integer"},
        "completion_tokens": {"type": "integer"},
        "total_tokens": {"type": "integer"},
        "completion_tokens_details": {"type": "object", "description": "``reasoning_tokens`` among others"},
    }

    @property
    def prompt_tokens(self) -> int | None:
        return self._count("prompt_tokens")

    @property
    def completion_tokens(self) -> int | None:
        return self._count("completion_tokens")

    @property
    def total_tokens(self) -> int | None:
        return self._count("total_tokens")

    @property
    def reasoning_tokens(self) -> int | None:
        details = self._object("completion_tokens_details") or {}
        value = details.get("reasoning_tokens")
        return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


class CallAttempt(Record):
    """One HTTP attempt of a model call."""

    attempt: Count = None
    latency_ms: Number = None
    status: Count = None
    error: FlexStr = None
    backoff_ms: Number = None


class ModelTurn(Record):
    """What one model call returned (``steps[i].model``), after the adapter's protocol checks."""

    content: FlexStr = None
    reasoning: FlexStr = None
    tool_calls: list[ToolCallRecord] = Field(default_factory=list)
    finish_reason: FlexStr = None
    usage: Usage | None = None
    response_id: FlexStr = None
    metadata: Object = Field(default_factory=dict)
    latency_ms: Number = None
    """Latency of the successful attempt, without backoff sleeps."""
    protocol_error: CodedMessage | None = None
    policy_failure: CodedMessage | None = None
    raw_response: Any = None
    """The whole response body, kept only for rejected outputs."""
    attempt_count: Count = None
    """HTTP attempts the call took (additive)."""
    attempts: list[CallAttempt] = Field(default_factory=list)
    """Per attempt: latency, status or error, backoff (additive)."""

    ALWAYS_WRITTEN: ClassVar[tuple[str, ...]] = (
        "content", "reasoning", "tool_calls", "finish_reason", "usage", "response_id", "metadata",
        "latency_ms", "protocol_error", "policy_failure", "raw_response",
    )  # fmt: skip

    @field_validator("tool_calls", "attempts", mode="before")
    @classmethod
    def _list_or_empty(cls, value: Any) -> Any:
        return value if isinstance(value, list) else []

    @field_validator("usage", "protocol_error", "policy_failure", mode="before")
    @classmethod
    def _object_or_none(cls, value: Any) -> Any:
        return value if isinstance(value, dict | Record) else None

    @property
    def tries(self) -> int:
        """HTTP attempts, at least one: the larger of the count and the attempts listed."""
        return max(self.attempt_count or 0, len(self.attempts), 1)


class ActionFeedback(Payload):
    """The environment's verdict on an action, as it sent it."""

    DOCUMENTED: ClassVar[dict[str, dict[str, Any]]] = {
        "valid": {"type": "boolean"},
        "reason": {"type": "string", "description": "``executed``, ``invalid_format``, ``search_unavailable`` …"},
        "message": {"type": "string"},
        "action": {"type": "string"},
    }

    @property
    def valid(self) -> bool | None:
        return self._flag("valid")

    @property
    def reason(self) -> str | None:
        return self._text("reason")


class EnvironmentResult(Payload):
    """A step or terminal payload of the environment, minus the lease keys, as it sent it."""

    DOCUMENTED: ClassVar[dict[str, dict[str, Any]]] = {
        "done": {"type": "boolean"},
        "reward": {"type": "number", "description": "equal to ``reward_detail.r_strict`` when done"},
        "reward_detail": {"type": "object", "description": "``r_type``, ``r_att``, ``r_option``, ``r_price``, ``r_loose``, ``r_strict``, ``r_success`` and their evidence"},
        "observation": {"type": "string"},
        "observation_state": {"type": "object"},
        "action_feedback": {"type": "object"},
        "termination_reason": {"type": "string", "description": "``purchase``, ``action_limit``, ``generation_length``, ``environment_done``"},
        "goal": {"type": "object", "description": "the private goal, revealed when done"},
        "purchase": {"description": "what was bought"},
    }  # fmt: skip

    @property
    def done(self) -> bool | None:
        return self._flag("done")

    @property
    def reward(self) -> float | None:
        return self._number("reward")

    @property
    def reward_detail(self) -> dict[str, Any]:
        return self._object("reward_detail") or {}

    @property
    def observation(self) -> str | None:
        return self._text("observation")

    @property
    def observation_state(self) -> dict[str, Any] | None:
        return self._object("observation_state")

    @property
    def termination_reason(self) -> str | None:
        return self._text("termination_reason")

    @property
    def action_feedback(self) -> ActionFeedback | None:
        feedback = self._object("action_feedback")
        return None if feedback is None else ActionFeedback.model_validate(feedback)

    def component(self, key: str) -> float | None:
        """A reward component (``r_success``, ``r_strict`` …) as a finite number, else None."""
        return _finite(self.reward_detail.get(key))


class Step(Record):
    """One model call and what followed it (docs/runtime_eval.md §2)."""

    step_index: int = Field(strict=True)
    observation: FlexStr = None
    """The text the model was answering."""
    tools: Objects = Field(default_factory=list)
    """The tool schemas offered."""
    model: ModelTurn = Field(default_factory=ModelTurn)
    action: FlexStr = None
    """The canonical action sent (``search[…]`` / ``click[…]``), None when none was."""
    environment: EnvironmentResult | None = None
    """The environment's answer to the action, None when no action was sent."""
    protocol_error: CodedMessage | None = None
    protocol_feedback: str | dict[str, Any] | None = None
    """The repair message sent back (the earlier implementation stored it as an object)."""
    policy_failure: CodedMessage | None = None

    ALWAYS_WRITTEN: ClassVar[tuple[str, ...]] = ("step_index", "observation", "tools", "model", "action", "environment")

    @field_validator("model", mode="before")
    @classmethod
    def _model_object(cls, value: Any) -> Any:
        return value if isinstance(value, dict | Record) else {}

    @field_validator("environment", "protocol_error", "policy_failure", mode="before")
    @classmethod
    def _object_or_none(cls, value: Any) -> Any:
        return value if isinstance(value, dict | Record) else None

    @property
    def effective_protocol_error(self) -> CodedMessage | None:
        """The step's own protocol error; the model's copy for writers that set only that one."""
        if "protocol_error" in self.model_fields_set:
            return self.protocol_error
        return self.model.protocol_error

    @property
    def effective_policy_failure(self) -> CodedMessage | None:
        """The step's own policy failure; the model's copy for writers that set only that one."""
        if "policy_failure" in self.model_fields_set:
            return self.policy_failure
        return self.model.policy_failure


class SelectedSkill(Record):
    """A skill injected into the system prompt."""

    skill_id: FlexStr = None
    content: FlexStr = None
    version: FlexStr = None
    metadata: Object = Field(default_factory=dict)
    content_sha256: FlexStr = None


class ErrorInfo(Record):
    """Why an attempt failed."""

    stage: FlexStr = None
    """Where: ``reset``, ``model_step_3``, ``cleanup``, ``evaluator_boundary`` … (docs/runtime_eval.md §2)."""
    type: FlexStr = None
    """The exception's class name."""
    message: FlexStr = None
    traceback: FlexStr = None
    cleanup_errors: list[str] | None = None


class TimeLimit(Record):
    """Why the runtime ended an episode at its time limit (``runtime.max_model_seconds``)."""

    max_model_seconds: Number = None
    """The limit: model time per episode, in seconds."""
    model_seconds: Number = None
    """The model time the episode had used when it was ended: the sum of its replies' ``latency_ms``."""
    model_steps: Count = None
    """Model calls made (the last one crossed the limit)."""
    sent_as: FlexStr = None
    """The termination reason sent to the environment (``action_limit``: ShopSimulator knows no time limit)."""


class EpisodeTrace(Record):
    """One episode attempt. ``status == "completed"`` with ``final.done`` true is a result; anything
    else is a failed attempt whose ``failure_class`` says who it is charged to."""

    schema_version: Literal["shopsimrl-episode-v4"] = TRACE_SCHEMA_VERSION
    episode_id: str
    status: Literal["completed", "failed"] = "failed"
    job: JobRecord
    provenance: Object = Field(default_factory=dict)
    """Identities of the model, environment, prompt, skills and runtime that produced the attempt."""
    started_at: FlexStr = None
    ended_at: FlexStr = None
    duration_ms: Number = None
    reset: OptObject = None
    """The public reset payload (no lease, no private goal)."""
    selected_skills: list[SelectedSkill] = Field(default_factory=list)
    conversation: Objects = Field(default_factory=list)
    """The exact message list sent to the model, as it stood at the end."""
    steps: list[Step] = Field(default_factory=list)
    final: EnvironmentResult | None = None
    """The terminal environment payload; None when no terminal state was reached."""
    error: ErrorInfo | None = None
    failure_class: FlexStr = None
    """None when completed; else who the failure is charged to, one of :data:`FAILURE_CLASSES`
    (additive; absent in the earlier implementation's records, whose failures count as the
    agent's, as does a class this version does not know)."""
    attempt: Count = None
    """1-based attempt number of the episode in its run (additive)."""
    rerolled_from: FlexStr = None
    """Only on an attempt ``--reroll-failed`` ran: the class of the outcome it replaces (additive)."""
    serialization_repaired: FlexBool = None
    """A payload held a value JSON cannot; it was made safe instead of aborting the run (additive)."""
    time_limit: TimeLimit | None = None
    """Only on an episode the runtime ended at its time limit: the limit and the model time used
    (additive; ``final`` is the environment's answer to the ``action_limit`` it was sent as)."""

    ALWAYS_WRITTEN: ClassVar[tuple[str, ...]] = (
        "schema_version", "episode_id", "status", "job", "provenance", "started_at", "ended_at", "duration_ms",
        "reset", "selected_skills", "conversation", "steps", "final", "error", "failure_class",
    )  # fmt: skip

    @field_validator("status", mode="before")
    @classmethod
    def _completed_or_failed(cls, value: Any) -> Any:
        return "completed" if value == "completed" else "failed"

    @field_validator("final", "error", "time_limit", mode="before")
    @classmethod
    def _object_or_none(cls, value: Any) -> Any:
        return value if isinstance(value, dict | Record) else None

    @field_validator("selected_skills", "steps", mode="before")
    @classmethod
    def _list_or_empty(cls, value: Any) -> Any:
        return value if isinstance(value, list) else []

    @classmethod
    def start(cls, job: JobRecord) -> EpisodeTrace:
        """The record of an attempt that has not started: every v4 key, with its empty value."""
        return cls(
            schema_version=TRACE_SCHEMA_VERSION,
            episode_id=f"task-{job.task_id:06d}__sample-{job.sample_id:03d}",
            status="failed",
            job=job,
            provenance={},
            started_at=None,
            ended_at=None,
            duration_ms=None,
            reset=None,
            selected_skills=[],
            conversation=[],
            steps=[],
            final=None,
            error=None,
            failure_class=None,
        )

    @property
    def completed(self) -> bool:
        """The one completion predicate: status completed and a final with done true."""
        return self.status == "completed" and self.final is not None and self.final.done is True

    @property
    def failed_as_outcome(self) -> bool:
        """A failed attempt that scores as the agent's 0 (and is not run again unless re-rolled)."""
        return not self.completed and self.failure_class not in EXCUSED_FAILURE_CLASSES

    @property
    def attempt_rank(self) -> tuple[int, str]:
        """How unfinished attempts of one episode order (higher wins): ``attempt``, then ``ended_at``."""
        return (self.attempt or 0, self.ended_at or "")
