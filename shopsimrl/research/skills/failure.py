"""The gold-aware failure analyst: a live counterfactual ShopSimulator session per failed
trajectory, then one failure card.

Per failed train trajectory (``r_success = 0``) the analyst model gets, as JSON::

    {"analysis_contract": {"current_skill", "stage", "max_live_actions"},
     "failed_trace_and_privileged_gold": compact_trace(include_gold=True) + "chosen_purchase",
     "fresh_live_session": {"trial", "instruction", "persona", "observation", "state"}}

and at most ``max_failure_steps`` calls (12; ``max_live_actions`` is one less). Each call offers
the page's action tools (the runtime's own schemas, :func:`shopsimrl.prompts.action_tools`) and
``submit_failure_card``; the last call offers only ``submit_failure_card``, which it gets up to
``attempts`` (3) tries at, each after a repair turn. An unusable answer (no call, several, an
unknown tool, bad arguments, a card the validator refuses) gets a repair message and costs its
call. An action goes to the environment; its result (``feedback``, ``done``, ``observation``,
``state``, ``reward``, ``reward_detail``, ``purchase``) is the tool message. A purchase (or any
``done``) ends a *trial*: the episode is closed and, while fewer than ``max_trials`` (3) trials
ran, a fresh one is reset on the same task and shown in the same tool message
(``next_trial``); after the last trial only ``submit_failure_card`` is offered.

The live session holds its own lease (the environment adapter of the runtime: reset, step,
close) and releases it on every path: a card, an error, an exception of the model, a
cancellation (Ctrl-C cancels the stage's task). The card is validated (``earliest_divergence.step``
must be a step of the trajectory), then :func:`~shopsimrl.research.skills.firewall.forced_no_proposal_reasons`
turns a proposal without a valid live action, without a successful trial, a REWRITE at cold
start or of a target that is no active skill, or one the firewall refuses, into NO_PROPOSAL.
A NO_PROPOSAL card is kept, ineligible. The live transcript (every call, action, feedback and
trial reward) is part of the analysis record.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson

from shopsimrl.environment import ADAPTER_NAME, ShopEnvironmentError, ShopSimulatorEnvironment, ShopSimulatorSettings
from shopsimrl.episode import ACTION_PROTOCOL, public_reset
from shopsimrl.model import ModelRequestError, OpenAICompatibleChatModel, OpenAICompatibleSettings
from shopsimrl.prompts import TOOL_VERSION, InvalidToolArguments, PromptError, action_tools, canonical_action
from shopsimrl.records import EpisodeTrace
from shopsimrl.research.judge.call import FATAL_STATUS, JudgeModelError, generate_reply, raw_answer, usage_of
from shopsimrl.research.redaction import public_persona
from shopsimrl.research.skills.analyst import (
    ANALYSIS_VERSION,
    PIPELINE_VERSION,
    SEED,
    settings_identity,
    trace_sha256,
)
from shopsimrl.research.skills.cards import FAILURE_TOOL, FailureCard, tool, validate_arguments
from shopsimrl.research.skills.compact import compact_trace
from shopsimrl.research.skills.firewall import (
    Stage,
    card_text,
    enforce_no_proposal,
    firewall_findings,
    forced_no_proposal_reasons,
    page_findings,
)
from shopsimrl.research.skills.prompts import FAILURE_ANALYST_PROMPT, prompt_sha256
from shopsimrl.research.skills.structured import ATTEMPTS, repair_message
from shopsimrl.runner.lease_journal import DirectoryJournalStorage, JournalStorage, LeaseJournal, start_lease_tracking
from shopsimrl.schemas import ModelOutput, fingerprint, json_bytes

__all__ = [
    "LEASES_DIR",
    "MAX_FAILURE_STEPS",
    "MAX_TRIALS",
    "AnalystModels",
    "FailureAnalysis",
    "FailureConfig",
    "analyse_failure",
    "environment_identity",
    "failure_card_id",
    "failure_fingerprint",
    "failure_tool",
]

MAX_FAILURE_STEPS = 12
MAX_TRIALS = 3
LEASES_DIR = "leases"
"""Under the stage's output directory: the lease journals of the processes that ran its live
sessions (:mod:`shopsimrl.runner.lease_journal`)."""
FAILURE_TOOL_DESCRIPTION = (
    "Submit the failure card of this trajectory: the privileged audit and, when a live trial "
    "verified the repair, the deployable abstraction."
)
_PURCHASE_KEYS = ("name", "title", "brand", "category", "price", "options", "selected_options")


@dataclass(frozen=True, kw_only=True)
class FailureConfig:
    model: OpenAICompatibleSettings
    """The analyst; a ``tool_choice`` naming a function forces ``submit_failure_card`` on the
    last call and becomes ``required`` on the others (where the page's tools are offered too)."""
    environment: ShopSimulatorSettings = field(default_factory=lambda: ShopSimulatorSettings(persona=True))
    seed: int = SEED
    max_failure_steps: int = MAX_FAILURE_STEPS
    max_trials: int = MAX_TRIALS
    attempts: int = ATTEMPTS
    """Tries at the last call (only ``submit_failure_card`` offered)."""
    live_tool_choice: str = "required"
    """What the calls that also offer the page's tools send when ``model.tool_choice`` names a
    function: ``required``, or ``auto`` for a server that refuses ``required`` (llama.cpp)."""

    def __post_init__(self) -> None:
        for name in ("max_failure_steps", "max_trials", "attempts"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
        if self.live_tool_choice not in ("required", "auto"):
            raise ValueError(f"live_tool_choice must be 'required' or 'auto', got {self.live_tool_choice!r}")


def failure_tool() -> dict[str, Any]:
    return tool(FAILURE_TOOL, FAILURE_TOOL_DESCRIPTION, FailureCard)


def failure_card_id(episode_id: str, number: int = 1) -> str:
    return f"failure-{episode_id}-{number:02d}"


def environment_identity(settings: ShopSimulatorSettings) -> dict[str, Any]:
    """What of the environment changes a live session's outcome: the adapter, persona, the
    interaction mode, pinned versions and the page tools' contract; not the URL (transport)."""
    identity: dict[str, Any] = {
        "adapter": ADAPTER_NAME,
        "persona": settings.persona,
        "interaction_mode": settings.interaction_mode,
        "tool_version": TOOL_VERSION,
        "action_protocol": ACTION_PROTOCOL,
    }
    for key in ("expected_environment_version", "expected_observation_version"):
        if getattr(settings, key) is not None:
            identity[key] = getattr(settings, key)
    return identity


def failure_fingerprint(
    trace: EpisodeTrace,
    config: FailureConfig,
    *,
    stage: Stage = "cold_start",
    current_skill: Any = None,
    active_skill_ids: Iterable[str] = (),
) -> str:
    """What a failure analysis depends on; unchanged means a resumed stage reuses it."""
    return fingerprint(
        {
            "pipeline_version": PIPELINE_VERSION,
            "channel": "failure",
            "trace_sha256": trace_sha256(trace),
            "analyst": settings_identity(config.model, config.seed),
            "prompt_sha256": prompt_sha256(FAILURE_ANALYST_PROMPT),
            "tool_sha256": fingerprint(failure_tool()),
            "environment": environment_identity(config.environment),
            "limits": _limits(config),
            "stage": stage,
            "current_skill": current_skill,
            "active_skill_ids": sorted(active_skill_ids),
        }
    )


def _limits(config: FailureConfig) -> dict[str, Any]:
    limits: dict[str, Any] = {
        "max_failure_steps": config.max_failure_steps,
        "max_trials": config.max_trials,
        "attempts": config.attempts,
    }
    if config.live_tool_choice != "required":  # absent at the default: earlier fingerprints stay valid
        limits["live_tool_choice"] = config.live_tool_choice
    return limits


@dataclass
class AnalystModels:
    """The analyst's two clients: ``live`` for calls that offer the page's tools too, ``final``
    for the calls that offer only ``submit_failure_card`` (forced where the settings force)."""

    live: OpenAICompatibleChatModel
    final: OpenAICompatibleChatModel

    @classmethod
    def open(cls, settings: OpenAICompatibleSettings, live_tool_choice: str = "required") -> AnalystModels:
        forced = not isinstance(settings.tool_choice, str)
        live = replace(settings, tool_choice=live_tool_choice) if forced else settings
        final = replace(settings, tool_choice={"type": "function", "function": {"name": FAILURE_TOOL}}) if forced else settings
        models = cls(OpenAICompatibleChatModel(live), OpenAICompatibleChatModel(final))
        models.live.check_api_key()
        return models

    async def aclose(self) -> None:
        try:
            await self.live.aclose()
        finally:
            await self.final.aclose()


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _public_purchase(purchase: Any) -> dict[str, Any] | None:
    if not isinstance(purchase, dict) or not purchase:
        return None
    return {key: purchase[key] for key in _PURCHASE_KEYS if key in purchase}


class _LiveSession:
    """Trials of one task on the environment, one lease at a time (held only by ``episode``)."""

    def __init__(self, environment: ShopSimulatorEnvironment, task_id: int, max_trials: int) -> None:
        self.environment = environment
        self.task_id = task_id
        self.max_trials = max_trials
        self.episode: Any = None
        self.trials: list[dict[str, Any]] = []
        self.state: dict[str, Any] = {}
        self.pages: list[dict[str, Any]] = []
        """Every page state the session showed (what the firewall checks a card against too)."""
        self.valid_actions = 0

    @property
    def exhausted(self) -> bool:
        return self.episode is None

    @property
    def successful_trials(self) -> int:
        return sum(1 for trial in self.trials if trial.get("r_success") == 1)

    async def new_trial(self) -> dict[str, Any]:
        """Reset a fresh episode of the task; what the model is shown of it."""
        self.episode = self.environment.open_episode()  # owned before the reset: close() releases
        public = public_reset(await self.episode.reset(self.task_id))
        self.state = public.get("observation_state") or {}
        self.pages.append(self.state)
        self.trials.append({"trial": len(self.trials) + 1, "actions": [], "done": False})
        persona = public.get("user_persona")
        return {
            "trial": len(self.trials),
            "instruction": public.get("task_instruction"),
            "persona": public_persona(persona)[0] if isinstance(persona, dict) else None,
            "observation": public.get("observation"),
            "state": self.state,
        }

    async def step(self, call: int, action: str) -> dict[str, Any]:
        """Send ``action``; the tool result. A ``done`` closes the trial and starts the next one."""
        result = await self.episode.step(action)
        feedback = result.get("action_feedback") if isinstance(result.get("action_feedback"), dict) else None
        valid = feedback.get("valid") is not False if feedback is not None else True
        self.valid_actions += int(valid)
        self.state = result.get("observation_state") or {}
        self.pages.append(self.state)
        detail = result.get("reward_detail") if isinstance(result.get("reward_detail"), dict) else {}
        trial = self.trials[-1]
        done = result.get("done") is True
        trial["actions"].append(
            {"call": call, "action": action, "valid": valid, "feedback": feedback, "done": done, "reward": result.get("reward")}
        )
        out: dict[str, Any] = {
            "trial": trial["trial"],
            "feedback": feedback,
            "done": done,
            "observation": result.get("observation"),
            "state": self.state,
            "reward": result.get("reward"),
            "reward_detail": detail or None,
            "purchase": result.get("purchase") or None,
        }
        if done:
            trial.update(
                done=True,
                reward=result.get("reward"),
                r_success=detail.get("r_success"),
                purchase=_public_purchase(result.get("purchase")),
                termination_reason=result.get("termination_reason"),
            )
            await self.close()
            out["next_trial"] = await self.new_trial() if len(self.trials) < self.max_trials else None
        return out

    async def close(self) -> None:
        episode, self.episode = self.episode, None
        if episode is not None:
            await episode.close()

    def transcript(self) -> dict[str, Any]:
        return {
            "task_id": self.task_id,
            "trials": self.trials,
            "valid_live_actions": self.valid_actions,
            "successful_trials": self.successful_trials,
        }


def _validator(trace: EpisodeTrace) -> Callable[[dict[str, Any]], tuple[FailureCard | None, str | None]]:
    steps = {step.step_index for step in trace.steps}

    def validate(arguments: dict[str, Any]) -> tuple[FailureCard | None, str | None]:
        value, problem = validate_arguments(FailureCard, arguments)
        if value is None:
            return None, problem
        step = value.privileged_audit.earliest_divergence.step
        if step not in steps:
            return None, f"$.privileged_audit.earliest_divergence.step: {step} is not a step of this trajectory"
        return value, None

    return validate


def _one_call(output: ModelOutput, offered: list[str]) -> tuple[str | None, dict[str, Any] | None, str | None]:
    """(tool name, arguments, None) of a usable answer, else (None, None, the problem)."""
    if output.policy_failure is not None:
        return None, None, f"{output.policy_failure.get('code')}: {output.policy_failure.get('message')}"
    if output.protocol_error is not None:
        return None, None, f"{output.protocol_error.get('code')}: {output.protocol_error.get('message')}"
    if len(output.tool_calls) != 1:
        return None, None, f"{len(output.tool_calls)} tool calls; call exactly one of {', '.join(offered)}"
    (call,) = output.tool_calls
    if call.name not in offered:
        return None, None, f"{call.name!r} is not offered now; call one of {', '.join(offered)}"
    arguments = call.arguments
    if arguments is None:
        try:
            arguments = orjson.loads(call.raw_arguments)
        except orjson.JSONDecodeError as exc:
            return None, None, f"the arguments of {call.name} are not valid JSON ({exc})"
    if not isinstance(arguments, dict):
        return None, None, f"the arguments of {call.name} are not a JSON object"
    return str(call.name), arguments, None


def _assistant(output: ModelOutput) -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": output.content,
        "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.raw_arguments}}
            for call in output.tool_calls
        ],
    }


def _answer(output: ModelOutput, content: str) -> list[dict[str, Any]]:
    """The turns that answer ``output``: a tool message per call, else a user message."""
    if output.tool_calls:
        return [_assistant(output)] + [
            {"role": "tool", "tool_call_id": call.call_id, "content": content} for call in output.tool_calls
        ]
    spoken = [{"role": "assistant", "content": output.content}] if output.content and output.content.strip() else []
    return [*spoken, {"role": "user", "content": content}]


async def analyse_failure(
    trace: EpisodeTrace,
    config: FailureConfig,
    *,
    stage: Stage = "cold_start",
    current_skill: Any = None,
    active_skill_ids: Iterable[str] = (),
    models: AnalystModels | None = None,
    environment: ShopSimulatorEnvironment | None = None,
    input_fp: str | None = None,
) -> tuple[bool, dict[str, Any]]:
    """(True, the analysis record) or (False, the error record) of one failed trajectory (module
    docstring). Raises for an analyst endpoint that refuses the request (401/403/404) and for
    bugs; the live session's lease is released on every path."""
    active = sorted(active_skill_ids)
    if input_fp is None:
        input_fp = failure_fingerprint(trace, config, stage=stage, current_skill=current_skill, active_skill_ids=active)
    own_models, own_environment = models is None, environment is None
    models = models or AnalystModels.open(config.model, config.live_tool_choice)
    environment = environment or ShopSimulatorEnvironment(config.environment)
    session = _LiveSession(environment, trace.job.task_id, config.max_trials)
    try:
        return await _analyse(trace, config, stage, current_skill, active, models, session, input_fp)
    finally:
        try:
            await session.close()
        finally:
            try:
                if own_environment:
                    await environment.aclose()
            finally:
                if own_models:
                    await models.aclose()


async def _analyse(
    trace: EpisodeTrace,
    config: FailureConfig,
    stage: Stage,
    current_skill: Any,
    active: list[str],
    models: AnalystModels,
    session: _LiveSession,
    input_fp: str,
) -> tuple[bool, dict[str, Any]]:
    started = _now()
    calls: list[dict[str, Any]] = []
    common: dict[str, Any] = {
        "analysis_version": ANALYSIS_VERSION,
        "episode_id": trace.episode_id,
        "task_id": trace.job.task_id,
        "sample_id": trace.job.sample_id,
        "channel": "failure",
        "stage": stage,
        "input_fingerprint": input_fp,
        "attempts": calls,
        "started_at": started,
    }

    def finish(status: str, **extra: Any) -> dict[str, Any]:
        usage: dict[str, int] = {}
        for call in calls:
            for key, value in call["usage"].items():
                usage[key] = usage.get(key, 0) + value
        return {**common, "status": status, **extra, "usage": usage, "live_session": session.transcript(), "ended_at": _now()}

    try:
        card = await _converse(trace, config, stage, current_skill, models, session, calls)
    except ModelRequestError as exc:
        if exc.status_code in FATAL_STATUS:
            raise JudgeModelError(f"the analyst model refused the request: {exc}") from None
        return False, finish(
            "error", error={"type": type(exc).__name__, "message": str(exc)[:500], "status_code": exc.status_code}
        )
    except ShopEnvironmentError as exc:
        return False, finish("error", error={"type": type(exc).__name__, "message": str(exc)[:500], "status_code": exc.status})
    if card is None:
        last = calls[-1]["error"] if calls else None
        message = f"{len(calls)} calls without a valid call of {FAILURE_TOOL}: {last}"
        return False, finish("invalid", error={"type": "ContractError", "message": message})
    reasons = forced_no_proposal_reasons(
        card,
        stage=stage,
        valid_live_actions=session.valid_actions,
        successful_trials=session.successful_trials,
        active_skill_ids=active,
        trace=trace,
    )
    abstraction = card.deployable_abstraction
    findings: list[dict[str, str]] = []
    if abstraction is not None:
        text = card_text(abstraction)
        findings = firewall_findings(text, trace)
        # The live pages show products the trace never did: their facts may not leak either.
        findings += [item for item in page_findings(text, session.pages) if item not in findings]
        if findings and card.status != "NO_PROPOSAL" and "firewall_finding" not in reasons:
            reasons.append("firewall_finding")
    final, reasons = enforce_no_proposal(card, reasons)
    eligible = final.status != "NO_PROPOSAL"
    entry = {
        "card_id": failure_card_id(trace.episode_id),
        "channel": "failure",
        "episode_id": trace.episode_id,
        "placeholder": False,
        "eligible": eligible,
        "ineligible_reasons": [] if eligible else (reasons or ["no_proposal"]),
        "proposed_status": card.status,
        "forced_no_proposal_reasons": reasons,
        "card": final.model_dump(),
        "evidence_refs": [{"episode_id": trace.episode_id, "step": card.privileged_audit.earliest_divergence.step}],
        "firewall_findings": findings,
    }
    return True, finish("ok", empty=False, cards=[entry], forced_no_proposal_reasons=reasons)


async def _converse(
    trace: EpisodeTrace,
    config: FailureConfig,
    stage: Stage,
    current_skill: Any,
    models: AnalystModels,
    session: _LiveSession,
    calls: list[dict[str, Any]],
) -> FailureCard | None:
    """The conversation of the live session (module docstring); the accepted card or None."""
    compact = compact_trace(trace, include_gold=True)
    fresh = await session.new_trial()
    user = {
        "analysis_contract": {
            "current_skill": current_skill,
            "stage": stage,
            "max_live_actions": config.max_failure_steps - 1,
        },
        "failed_trace_and_privileged_gold": {**compact, "chosen_purchase": compact["outcome"]["purchase"]},
        "fresh_live_session": fresh,
    }
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": FAILURE_ANALYST_PROMPT},
        {"role": "user", "content": json_bytes(user).decode("utf-8")},
    ]
    validate = _validator(trace)
    submit = failure_tool()
    number = 0
    last_tries = 0
    while True:
        number += 1
        last = number >= config.max_failure_steps
        if last:
            last_tries += 1
            if last_tries > config.attempts:
                return None
        page = [] if last or session.exhausted else _page_tools(session.state)
        only_submit = not page
        tools = [*page, submit]
        offered = [item["function"]["name"] for item in tools]
        model = models.final if only_submit else models.live
        output = await generate_reply(model, messages, tools, config.seed + number - 1)
        name, arguments, problem = _one_call(output, offered)
        call: dict[str, Any] = {
            "attempt": number,
            "offered": offered,
            "raw": raw_answer(output),
            "action": None,
            "error": None,
            "usage": usage_of(output),
            "latency_ms": output.latency_ms,
        }
        calls.append(call)
        if problem is None and name == FAILURE_TOOL:
            card, problem = validate(arguments or {})
            if problem is None and isinstance(card, FailureCard):
                return card
        elif problem is None and name is not None:
            try:
                action = canonical_action(name, arguments)
            except InvalidToolArguments as exc:
                problem = str(exc)
            else:
                call["action"] = action
                result = await session.step(number, action)
                call["feedback"] = result["feedback"]
                messages += _answer(output, json_bytes(result).decode("utf-8"))
                continue
        call["error"] = problem
        quoted = output.tool_calls[-1].raw_arguments if output.tool_calls else (output.content or "")
        if only_submit or name == FAILURE_TOOL:
            repair = repair_message(FAILURE_TOOL, str(problem), quoted)
        else:
            repair = (
                f"Your previous answer could not be used: {problem}\nNothing reached the environment. Call "
                f"exactly one of the offered functions ({', '.join(offered)}) with a JSON object matching its parameters."
            )
        messages += _answer(output, repair)


def _page_tools(state: dict[str, Any]) -> list[dict[str, Any]]:
    """The page's action tools as the runtime offers them; none on a page that has none."""
    try:
        return action_tools(state)
    except PromptError:
        return []


class FailureAnalysis:
    """The failure analyst as the analysis stage runs it: shared clients and one environment
    adapter for every failed trajectory of a run (each session still holds its own lease)."""

    def __init__(
        self,
        config: FailureConfig,
        *,
        stage: Stage = "cold_start",
        current_skill: Any = None,
        active_skill_ids: Iterable[str] = (),
    ) -> None:
        self.config = config
        self.stage: Stage = stage
        self.current_skill = current_skill
        self.active_skill_ids = sorted(active_skill_ids)
        self._models: AnalystModels | None = None
        self._environment: ShopSimulatorEnvironment | None = None
        self._journal: LeaseJournal | None = None

    def input_fingerprint(self, trace: EpisodeTrace) -> str:
        return failure_fingerprint(
            trace, self.config, stage=self.stage, current_skill=self.current_skill, active_skill_ids=self.active_skill_ids
        )

    def identity(self) -> dict[str, Any]:
        c = self.config
        return {
            "analyst": settings_identity(c.model, c.seed),
            "prompt_sha256": prompt_sha256(FAILURE_ANALYST_PROMPT),
            "tool_sha256": fingerprint(failure_tool()),
            "environment": environment_identity(c.environment),
            "stage": self.stage,
            "limits": _limits(c),
        }

    async def open(
        self, output_dir: Path | None = None, *, concurrency: int = 1, journal_storage: JournalStorage | None = None
    ) -> None:
        """Open the clients and the environment adapter. With ``output_dir``, the live sessions'
        leases are journaled in ``output_dir/leases/`` (as a run journals its episodes'), or in
        ``journal_storage`` (a skills worker's shard): a ShopSimulator lease never expires, so a
        process killed outright would keep its session's slot; the next process on the same
        journal releases what dead predecessors left there before its first reset."""
        self._models = AnalystModels.open(self.config.model, self.config.live_tool_choice)
        self._environment = ShopSimulatorEnvironment(self.config.environment)
        if journal_storage is None and output_dir is not None:
            journal_storage = DirectoryJournalStorage(output_dir / LEASES_DIR)
        if journal_storage is None:
            return
        journal = LeaseJournal(journal_storage, environment_url=self.config.environment.base_url)
        try:
            await start_lease_tracking(self._environment, journal, concurrency=concurrency, processes=1, configured=None)
        except BaseException:
            await self.aclose()
            await journal.aclose()
            raise
        self._journal = journal

    async def analyse(self, trace: EpisodeTrace, input_fp: str) -> tuple[bool, dict[str, Any]]:
        if self._models is None or self._environment is None:
            raise RuntimeError("FailureAnalysis.open() must run before analyse()")
        return await analyse_failure(
            trace,
            self.config,
            stage=self.stage,
            current_skill=self.current_skill,
            active_skill_ids=self.active_skill_ids,
            models=self._models,
            environment=self._environment,
            input_fp=input_fp,
        )

    async def aclose(self) -> None:
        models, environment, journal = self._models, self._environment, self._journal
        self._models = self._environment = None
        self._journal = None
        try:
            if environment is not None:
                await environment.aclose()
        finally:
            try:
                if journal is not None:  # after the adapter: its releases are journaled first
                    await journal.aclose()
            finally:
                if models is not None:
                    await models.aclose()
