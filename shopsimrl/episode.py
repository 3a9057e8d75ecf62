"""One episode: the tool-calling loop between a ChatModel and a ShopSimulator lease → a v4 trace.

The runtime takes no scheduling decisions and touches no storage. ``AgentRuntime.run`` never
raises for an episode-level problem: every outcome, including a crash in the middle, becomes a
trace record whose ``status`` says whether it counts.

Outcomes per model call (``steps[i]``):
- normal step: one valid tool call, turned into ``search[…]`` / ``click[…]`` and sent to the
  environment (an out-of-enum click is sent too: the environment judges it);
- protocol error: the reply was unusable; a repair turn is appended (tool messages when the reply
  had tool calls, else a user message) and the model answers again on the same page; the step
  counts against ``max_steps``;
- policy failure: ``generation_length`` (the reply was cut off by the token limit without
  exactly one valid call) or ``context_length`` (the server refused the prompt: the
  conversation outgrew the context window). The episode is terminated through the environment
  with zero reward and still counts as scored. ShopSimulator accepts only ``action_limit`` and
  ``generation_length`` as termination reasons, so both are sent as ``generation_length``; the
  step's ``policy_failure.code`` keeps which one it was.

The loop ends on ``done``; after ``max_steps`` calls without ``done`` the runtime terminates with
``action_limit``. With ``max_model_seconds`` (the time limit), before each further call the
runtime adds up the model time spent so far (each reply's ``latency_ms``: the answering HTTP
attempt, no retries, backoff or queueing) and, once it has reached the limit, terminates instead;
ShopSimulator knows no time limit, so it is sent as ``action_limit`` and the trace's ``time_limit``
says it was one. The lease is always released; a failed release makes the episode ``failed``.

Additive trace keys (beyond ``shopsimrl-episode-v4``): ``failure_class`` (``null`` for a
completed episode; see :func:`classify_failure`), ``attempt`` (set by the scheduler) and
``time_limit`` (only on an episode the time limit ended).
"""

from __future__ import annotations

import math
import time
import traceback
from datetime import UTC, datetime
from typing import Any

import structlog

from shopsimrl.environment import (
    EnvironmentUnavailableError,
    EnvironmentVersionError,
    LeaseError,
    ShopEnvironment,
    ShopEnvironmentError,
)
from shopsimrl.logs import brief
from shopsimrl.model import ChatModel, ModelConfigError, ModelRequestError
from shopsimrl.prompts import (
    InvalidToolArguments,
    PromptBuilder,
    action_tools,
    canonical_action,
    protocol_feedback,
)
from shopsimrl.records import (
    CodedMessage,
    EnvironmentResult,
    EpisodeTrace,
    ErrorInfo,
    JobRecord,
    ModelTurn,
    SelectedSkill,
    Step,
    TimeLimit,
)
from shopsimrl.records.trace import FailureClass
from shopsimrl.schemas import EpisodeJob, ModelOutput, find_lone_surrogate, replace_lone_surrogates
from shopsimrl.skills import SkillProvider

__all__ = ["ACTION_PROTOCOL", "AgentRuntime", "classify_failure", "failed_trace"]

ACTION_PROTOCOL = "openai-function-tools-repair-v3"
POLICY_FAILURE_CODES = ("generation_length", "context_length")
POLICY_TERMINATION_REASON = "generation_length"
"""What a policy failure is sent to ShopSimulator as: the one reason it accepts besides action_limit."""
TIME_LIMIT_TERMINATION_REASON = "action_limit"
"""What the time limit is sent as: like the action limit, the agent ran out of budget before buying."""

LEASE_KEYS = ("env_idx", "lease_id")
PRIVATE_RESET_KEYS = ("private_task_instruction", "goal_options", "reason_key")
MAX_TRACEBACK_CHARS = 4000

log = structlog.get_logger("shopsimrl.episode")


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _without(payload: dict[str, Any], keys: tuple[str, ...]) -> dict[str, Any]:
    return {key: value for key, value in payload.items() if key not in keys}


def public_reset(result: dict[str, Any]) -> dict[str, Any]:
    """The reset payload minus the lease and anything private to the goal."""
    public = _without(result, LEASE_KEYS + PRIVATE_RESET_KEYS)
    persona = public.get("user_persona")
    if isinstance(persona, dict) and "__reasoning__" in persona:
        public["user_persona"] = {k: v for k, v in persona.items() if k != "__reasoning__"}
    return public


_CONFIGURATION_STATUSES = frozenset({401, 403, 404})
"""Model answers no conversation can cause: authentication, permission, an unknown model."""


def classify_failure(exc: BaseException, *, agent_acted: bool = True, agent_spoke: bool = True) -> FailureClass:
    """Whose failure it is (docs/runtime_eval.md §4, "Who a failure is charged to").

    ``agent_acted``: an action of the agent (or a termination its reply caused) reached the
    environment in this episode. ``agent_spoke``: the conversation sent to the model holds the
    agent's own replies. A failure that neither can have caused is never the agent's:

    - ``infrastructure``: unreachable services, timeouts, 5xx after the retries, a lost lease, a
      changed environment version, and any environment failure before the agent's first action;
      retried within the invocation and by the next one, outside the intent-to-treat score;
    - ``configuration_error``: the model server refuses what the run's settings alone decide (a
      missing key, 401/403/404, ``max_tokens`` not below the context window, a 4xx on the
      episode's first prompt); not retried within the invocation (it would fail again), run again
      by the next one, outside the score;
    - ``environment_error``: the environment failed on an agent's action (the real server answers
      500 to some agent inputs, deterministically); ``model_error``: the model server refused a
      conversation holding the agent's replies; ``runtime_error``: a bug. These are outcomes of
      the episode: a 0 in the intent-to-treat score, final once recorded.
    """
    if isinstance(exc, (EnvironmentUnavailableError, LeaseError, EnvironmentVersionError)):
        return "infrastructure"
    if isinstance(exc, ShopEnvironmentError):
        return "environment_error" if agent_acted else "infrastructure"
    if isinstance(exc, ModelConfigError):
        return "configuration_error"
    if isinstance(exc, ModelRequestError):
        status = exc.status_code
        if not (isinstance(status, int) and 400 <= status < 500 and status not in (408, 409, 429)):
            return "infrastructure"
        if exc.configuration or status in _CONFIGURATION_STATUSES or not agent_spoke:
            return "configuration_error"
        return "model_error"
    if isinstance(exc, (TimeoutError, ConnectionError)):
        return "infrastructure"
    return "runtime_error"


def _error(stage: str, exc: BaseException) -> ErrorInfo:
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    return ErrorInfo(stage=stage, type=type(exc).__name__, message=str(exc), traceback=text[-MAX_TRACEBACK_CHARS:])


def new_trace(job: EpisodeJob) -> EpisodeTrace:
    """The record of an attempt of ``job`` that has not started."""
    return EpisodeTrace.start(JobRecord(task_id=job.task_id, sample_id=job.sample_id, seed=job.seed, split=job.split))


def failed_trace(job: EpisodeJob, exc: BaseException, *, stage: str = "evaluator_boundary") -> EpisodeTrace:
    """The trace written when the runtime object itself raised (reference fallback shape)."""
    trace = new_trace(job)
    trace.ended_at = _now()
    trace.error = ErrorInfo(stage=stage, type=type(exc).__name__, message=str(exc))
    trace.failure_class = classify_failure(exc)
    return trace


class _ProtocolViolation(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def _check_single_call(output: ModelOutput) -> tuple[str, str, str]:
    """Re-check what a custom ChatModel may not have: one call, no visible text, valid arguments,
    and only valid Unicode in what would reach the conversation or the environment."""
    if output.protocol_error:
        raise _ProtocolViolation(output.protocol_error["code"], output.protocol_error.get("message", ""))
    spoken = {"content": output.content, "tool_calls": [call.to_dict() for call in output.tool_calls]}
    invalid_text = find_lone_surrogate(spoken)
    if invalid_text is not None:
        where, index, code_point = invalid_text
        raise _ProtocolViolation("invalid_unicode", f"{where} holds a lone surrogate ({code_point}) at index {index}")
    if len(output.tool_calls) != 1:
        raise _ProtocolViolation("tool_call_count", f"expected exactly one tool call, got {len(output.tool_calls)}")
    if output.content and output.content.strip():
        raise _ProtocolViolation("mixed_content", "a tool call must come without visible text")
    call = output.tool_calls[0]
    try:
        action = canonical_action(call.name, call.arguments if isinstance(call.arguments, dict) else {})
    except InvalidToolArguments as exc:
        raise _ProtocolViolation("invalid_tool_arguments", str(exc)) from None
    return call.call_id, call.name, action


def _valid_text(text: str | None) -> str | None:
    """``text`` with U+FFFD for each lone surrogate (which no request body can carry)."""
    return None if text is None else str(replace_lone_surrogates(text))


def _assistant_tool_message(output: ModelOutput) -> dict[str, Any]:
    # A custom ChatModel may hand over text that is not valid Unicode (the HTTP adapter never does):
    # the conversation gets U+FFFD in its place, so the next request can be sent; the step's
    # ``model`` record keeps the exact text.
    return {
        "role": "assistant",
        "content": _valid_text(output.content),
        "tool_calls": [
            {
                "id": _valid_text(call.call_id),
                "type": "function",
                "function": {"name": _valid_text(call.name), "arguments": _valid_text(call.raw_arguments)},
            }
            for call in output.tool_calls
        ],
    }


class AgentRuntime:
    """Runs one episode at a time per call; safe to share across concurrent episodes."""

    def __init__(
        self,
        *,
        model: ChatModel,
        environment: ShopEnvironment,
        prompts: PromptBuilder,
        skills: SkillProvider,
        max_steps: int = 30,
        max_model_seconds: float | None = None,
    ) -> None:
        if max_steps < 1:
            raise ValueError("max_steps must be >= 1")
        if max_model_seconds is not None and not max_model_seconds > 0:
            raise ValueError("max_model_seconds must be > 0 or None")
        self.model = model
        self.environment = environment
        self.prompts = prompts
        self.skills = skills
        self.max_steps = max_steps
        self.max_model_seconds = max_model_seconds

    def runtime_identity(self) -> dict[str, Any]:
        """The runtime's part of the plan; the time limit only when set, so that the plans (and
        fingerprints) of runs without one stay what they were."""
        identity: dict[str, Any] = {"max_steps": self.max_steps, "action_protocol": ACTION_PROTOCOL}
        if self.max_model_seconds is not None:
            identity["max_model_seconds"] = self.max_model_seconds
        return identity

    async def run(self, job: EpisodeJob) -> EpisodeTrace:
        started_at, started = _now(), time.perf_counter()
        episode = self.environment.open_episode()
        elog = log.bind(episode_id=job.episode_id)
        trace = new_trace(job)
        trace.started_at = started_at
        progress: dict[str, Any] = {"stage": "reset", "agent_acted": False, "agent_spoke": False}
        try:
            await self._play(job, episode, trace, progress)
            if trace.final is None or trace.final.done is not True:
                raise RuntimeError("the episode ended without a terminal environment state (done is not true)")
            trace.status = "completed"
        except Exception as exc:  # every episode-level failure becomes a failed trace
            trace.status = "failed"
            trace.error = _error(progress["stage"], exc)
            trace.failure_class = classify_failure(exc, agent_acted=progress["agent_acted"], agent_spoke=progress["agent_spoke"])
            # Info, one short line: the live bar counts failures and the trace has the whole error.
            elog.info("episode_failed", stage=trace.error.stage, error=type(exc).__name__, message=brief(str(exc)))
        finally:
            cleanup_error: BaseException | None = None
            try:
                await episode.close()
            except Exception as exc:  # a leaked lease must be visible, never silently "completed"
                cleanup_error = exc
            trace.provenance = self._provenance(episode)
            if cleanup_error is not None:
                message = f"{type(cleanup_error).__name__}: {cleanup_error}"
                if trace.error is None:
                    trace.error = ErrorInfo(stage="cleanup", type="CleanupError", message=message)
                else:
                    trace.error.cleanup_errors = [message]
                trace.status = "failed"
                trace.failure_class = trace.failure_class or "infrastructure"
                elog.warning("lease_release_failed", message=message[:300])
            trace.ended_at = _now()
            trace.duration_ms = (time.perf_counter() - started) * 1000.0
        return trace

    def _provenance(self, episode: Any) -> dict[str, Any]:
        environment = dict(self.environment.identity())
        environment["environment_version"] = getattr(episode, "environment_version", None)
        environment["observation_version"] = getattr(episode, "observation_version", None)
        return {
            "model": self.model.identity(),
            "environment": environment,
            "prompt": self.prompts.identity(),
            "skills": self.skills.identity(),
            "runtime": self.runtime_identity(),
        }

    async def _play(self, job: EpisodeJob, episode: Any, trace: EpisodeTrace, progress: dict[str, Any]) -> None:
        """Play the episode into ``trace``; ``progress`` says where a failure happened (``stage``)
        and whether the agent had spoken or acted by then (who the failure is charged to)."""
        reset = await episode.reset(job.task_id)
        public = public_reset(reset)
        trace.reset = public

        progress["stage"] = "skill_selection"
        context = {
            "task_id": job.task_id,
            "sample_id": job.sample_id,
            "split": job.split,
            "task_instruction": public.get("task_instruction"),
            "user_persona": public.get("user_persona") or {},
            "observation_state": public.get("observation_state"),
            "task_mode": public.get("task_mode"),
        }
        skills = self.skills.select(context)
        trace.selected_skills = [SelectedSkill.model_validate(skill.to_dict()) for skill in skills]

        conversation = trace.conversation
        conversation.append(self.prompts.system_message(public, skills))
        first_user = self.prompts.initial_user_message(public)
        conversation.append(first_user)
        observation_text: str = first_user["content"]
        state: dict[str, Any] = public.get("observation_state") or {}
        # Milliseconds, as the trace records them, summed exactly: an audit that adds up the steps'
        # latency_ms (ten replies of 100 ms against a 1 s limit) reaches the runtime's decision.
        model_ms: list[float] = []

        for step_index in range(1, self.max_steps + 1):
            if self.max_model_seconds is not None and math.fsum(model_ms) >= self.max_model_seconds * 1000.0:
                # Checked before a call, as the action limit is: the call that crossed the limit
                # was answered and acted on; no further one is made.
                progress["stage"] = "time_limit_termination"
                trace.time_limit = TimeLimit(
                    max_model_seconds=self.max_model_seconds,
                    model_seconds=round(math.fsum(model_ms) / 1000.0, 6),
                    model_steps=len(trace.steps),
                    sent_as=TIME_LIMIT_TERMINATION_REASON,
                )
                final = await episode.terminate(TIME_LIMIT_TERMINATION_REASON)
                trace.final = _environment_result(final)
                return

            progress["stage"] = f"tools_step_{step_index}"
            tools = action_tools(state)
            tool_names = [tool["function"]["name"] for tool in tools]

            progress["stage"] = f"model_step_{step_index}"
            called = time.perf_counter()
            output = await self.model.generate(list(conversation), tools, seed=job.seed + step_index - 1)
            progress["agent_spoke"] = True
            model_ms.append(_model_ms(output, time.perf_counter() - called))
            step = Step(
                step_index=step_index,
                observation=observation_text,
                tools=tools,
                model=ModelTurn.model_validate(output.to_dict()),
                action=None,
                environment=None,
            )
            trace.steps.append(step)

            if output.policy_failure:
                progress["stage"] = f"policy_termination_step_{step_index}"
                step.policy_failure = CodedMessage.model_validate(output.policy_failure)
                code = output.policy_failure.get("code")
                if code not in POLICY_FAILURE_CODES:
                    raise RuntimeError(f"unsupported policy failure {code!r}")
                progress["agent_acted"] = True
                final = await episode.terminate(POLICY_TERMINATION_REASON)
                trace.final = _environment_result(final)
                return

            try:
                call_id, _name, action = _check_single_call(output)
            except _ProtocolViolation as violation:
                error = CodedMessage(code=violation.code, message=violation.message)
                feedback = protocol_feedback(violation.code, violation.message, tool_names)
                step.protocol_error = error
                step.protocol_feedback = feedback
                step.model.protocol_error = error
                if output.tool_calls:
                    conversation.append(_assistant_tool_message(output))
                    for call in output.tool_calls:
                        conversation.append({"role": "tool", "tool_call_id": _valid_text(call.call_id), "content": feedback})
                else:
                    if output.content and output.content.strip():
                        conversation.append({"role": "assistant", "content": _valid_text(output.content)})
                    conversation.append({"role": "user", "content": feedback})
                continue

            progress["stage"] = f"environment_step_{step_index}"
            step.action = action
            progress["agent_acted"] = True
            result = await episode.step(action)
            step.environment = _environment_result(result)
            conversation.append(_assistant_tool_message(output))
            observation_text = result.get("observation", "")
            conversation.append({"role": "tool", "tool_call_id": call_id, "content": observation_text})
            state = result.get("observation_state") or {}
            if result.get("done") is True:
                trace.final = _environment_result(result)
                return

        progress["stage"] = "action_limit_termination"
        final = await episode.terminate("action_limit")
        trace.final = _environment_result(final)


def _model_ms(output: ModelOutput, measured_s: float) -> float:
    """The time limit's share of one model call: the reply's ``latency_ms`` (the answering attempt,
    as the trace records it), or the call as measured when a custom ChatModel reports none."""
    latency = output.latency_ms
    if isinstance(latency, (int, float)) and not isinstance(latency, bool) and math.isfinite(latency) and latency >= 0:
        return float(latency)
    return measured_s * 1000.0


def _environment_result(payload: dict[str, Any]) -> EnvironmentResult:
    """An environment answer as stored: everything it said but the lease."""
    return EnvironmentResult.model_validate(_without(payload, LEASE_KEYS))
