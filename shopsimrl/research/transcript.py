"""One episode as a person reads it: the transcript that ``shopsimrl show`` prints and
``shopsimrl view`` renders as a page.

:func:`read_transcript` turns a trace record into a :class:`Transcript`: the instruction and the
public persona, then per model call the observation as the model saw it, its thinking, the tool
call, the action and the environment's feedback, the per-call latency, usage and HTTP attempts,
and at the end the reward detail. Every text in it comes from the trace, i.e. from the model or
the environment: whoever renders it escapes it (:func:`terminal_safe` here, HTML escaping in
the viewer).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, TypeVar

from rich.console import Console, Group, RenderableType
from rich.panel import Panel
from rich.rule import Rule
from rich.table import Table
from rich.text import Text

from shopsimrl.metrics import step_facts
from shopsimrl.records import ActionFeedback, CallAttempt, CodedMessage, EpisodeTrace, ErrorInfo, Record, Step, plain
from shopsimrl.research.episodes import episode_row
from shopsimrl.storage.reading import EpisodeSource

__all__ = [
    "THINKING_PREVIEW_CHARS",
    "StepView",
    "ToolCallView",
    "Transcript",
    "headline",
    "outline",
    "read_transcript",
    "render_terminal",
    "step_usage",
    "terminal_safe",
]

THINKING_PREVIEW_CHARS = 160
"""How much of a step's thinking ``show`` prints without ``--thinking``."""


def _map(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _text(value: Any) -> str | None:
    return value if isinstance(value, str) else None


def _json_text(value: Any) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False, sort_keys=True)


R = TypeVar("R", bound=Record)


def _given(value: R | None) -> R | None:
    """The object when it holds a key: an empty ``{}`` in a trace is shown as nothing."""
    return value if value is not None and plain(value) else None


@dataclass
class ToolCallView:
    name: str | None
    arguments: str
    """The parsed arguments as JSON, else the raw text the model sent."""


@dataclass
class StepView:
    """One model call and what followed it."""

    index: int
    page_type: str | None
    observation: str | None
    """The page (the first one with the task) exactly as sent to the model."""
    tools: list[str]
    click_values: list[str]
    content: str | None
    reasoning: str | None
    tool_calls: list[ToolCallView]
    finish_reason: str | None
    action: str | None
    protocol_error: CodedMessage | None
    protocol_feedback: str | None
    """What was sent back to the model after an unusable reply (its next observation)."""
    policy_failure: CodedMessage | None
    feedback: ActionFeedback | None
    """The environment's ``action_feedback``: valid, reason, message."""
    reward: float | None
    done: bool | None
    latency_ms: float | None
    tokens: dict[str, int]
    attempts: list[CallAttempt]
    """HTTP attempts of the call: attempt, latency_ms, status, error, backoff_ms."""
    retries: int
    raw_response: Any
    """A rejected output's raw server answer."""


@dataclass
class Transcript:
    episode_id: str
    row: dict[str, Any]
    """The episode's :func:`episode_row` (status, reward, counts)."""
    records_seen: int | None
    """Attempts of this episode recorded in the run (this record is the winning one)."""
    instruction: str | None
    persona: Any
    system_prompt: str | None
    skills: list[str]
    model: str | None
    steps: list[StepView] = field(default_factory=list)
    reward_detail: dict[str, Any] = field(default_factory=dict)
    goal: Any = None
    purchase: Any = None
    final_message: str | None = None
    error: ErrorInfo | None = None


def _offered_tools(step: Step) -> tuple[list[str], list[str]]:
    """The names of the tools offered and the click tool's values (the schemas are the model
    server's open objects, read as such)."""
    tools, click_values = [], []
    for tool in step.tools:
        function = _map(_map(tool).get("function"))
        if isinstance(function.get("name"), str):
            tools.append(function["name"])
        enum = _map(_map(_map(function.get("parameters")).get("properties")).get("value")).get("enum")
        if function.get("name") == "click" and isinstance(enum, list):
            click_values = [str(value) for value in enum]
    return tools, click_values


def _step_view(step: Step, page_type: str | None) -> StepView:
    facts = step_facts(step)
    model = step.model
    environment = step.environment
    tools, click_values = _offered_tools(step)
    # The step's own error, else the model's copy (an empty object at the step shows the model's).
    protocol_error = _given(step.protocol_error) or _given(model.protocol_error)
    feedback = step.protocol_feedback
    return StepView(
        index=step.step_index,
        page_type=page_type,
        observation=step.observation,
        tools=tools,
        click_values=click_values,
        content=model.content,
        reasoning=model.reasoning,
        tool_calls=[
            ToolCallView(call.name, _json_text(call.arguments) if call.arguments is not None else call.raw_arguments or "")
            for call in model.tool_calls
        ],
        finish_reason=model.finish_reason,
        action=step.action,
        protocol_error=protocol_error if facts.protocol_error else None,
        protocol_feedback=None if feedback is None else _json_text(feedback),
        policy_failure=_given(step.effective_policy_failure),
        feedback=_given(environment.action_feedback) if environment is not None else None,
        reward=environment.reward if environment is not None else None,
        done=environment.done if environment is not None else None,
        latency_ms=facts.latency_ms,
        tokens=facts.tokens,
        attempts=list(model.attempts),
        retries=facts.retries,
        raw_response=model.raw_response,
    )


def read_transcript(record: EpisodeTrace, source: EpisodeSource | None = None) -> Transcript:
    """The transcript of one trace record; ``source`` (from ``Run.index()``) adds how many
    attempts of the episode the run recorded."""
    reset = record.reset or {}
    conversation = record.conversation
    system = _map(conversation[0]) if conversation else {}
    final = record.final
    provenance_model = _map(record.provenance.get("model"))
    transcript = Transcript(
        episode_id=record.episode_id,
        row=episode_row(record),
        records_seen=source.attempts if source is not None else None,
        instruction=_text(reset.get("task_instruction")),
        persona=reset.get("user_persona"),
        system_prompt=_text(system.get("content")) if system.get("role") == "system" else None,
        skills=[f"{skill.skill_id} (v{skill.version})" for skill in record.selected_skills],
        model=_text(provenance_model.get("checkpoint_id")) or _text(provenance_model.get("model")),
    )
    if final is not None:
        transcript.reward_detail = {
            key: value for key, value in final.reward_detail.items() if not isinstance(value, dict | list)
        }
        transcript.goal = final.get("goal") or None
        transcript.purchase = final.get("purchase") or None
        transcript.final_message = _text(final.get("message"))
    transcript.error = _given(record.error)
    page = _map(reset.get("observation_state")).get("page_type")
    for step in record.steps:
        transcript.steps.append(_step_view(step, page if isinstance(page, str) else None))
        if step.environment is not None:  # a repair turn stays on the same page
            page = (step.environment.observation_state or {}).get("page_type")
    return transcript


def outline(value: Any, indent: str = "") -> str:
    """Nested JSON as indented ``key: value`` lines (a persona, a goal) for reading."""
    lines: list[str] = []
    if isinstance(value, dict):
        for key, item in value.items():
            if isinstance(item, list) and all(not isinstance(entry, dict | list) for entry in item):
                lines.append(f"{indent}{key}: {'、'.join(_scalar(entry) for entry in item)}")
            elif isinstance(item, dict | list) and item:
                lines.append(f"{indent}{key}:")
                lines.append(outline(item, indent + "  "))
            else:
                lines.append(f"{indent}{key}: {_scalar(item)}")
    elif isinstance(value, list):
        if all(not isinstance(item, dict | list) for item in value):
            return f"{indent}{'、'.join(_scalar(item) for item in value)}"
        for item in value:
            lines.append(f"{indent}-")
            lines.append(outline(item, indent + "  "))
    else:
        return f"{indent}{_scalar(value)}"
    return "\n".join(lines)


def _scalar(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False)


# --------------------------------------------------------------------------- the terminal

_CONTROL = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f\ud800-\udfff]")
"""Control characters but newline and tab (rich strips only a few of them and passes ESC), and
lone surrogates (text that is not valid Unicode, which no terminal encoding can carry)."""


def terminal_safe(text: str) -> str:
    """Text from a trace made harmless for a terminal: control characters (an escape sequence a
    model wrote could move the cursor or retitle the window) shown as ``\\xNN``, a lone surrogate
    as ``\\uXXXX``, the escape the trace file holds."""
    return _CONTROL.sub(lambda m: f"\\x{ord(m.group()):02x}" if ord(m.group()) < 0x100 else f"\\u{ord(m.group()):04x}", text)


def _t(text: Any, style: str = "") -> Text:
    return Text(terminal_safe(text if isinstance(text, str) else _scalar(text)), style=style)


def _number(value: Any, digits: int = 2) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def headline(transcript: Transcript) -> str:
    """One line: status, ending, reward, success, steps (the table row's essentials)."""
    row = transcript.row
    parts = [str(row["status"])]
    if row.get("termination_reason"):
        parts.append(str(row["termination_reason"]))
    if row.get("failure_class"):
        parts.append(f"failure {row['failure_class']}")
    parts += [f"reward {_number(row['reward'])}", f"success {_number(row['success'], 0)}", f"{row['steps']} steps"]
    attempt = f"attempt {row['attempt']}"
    if transcript.records_seen is not None:
        attempt += f" ({transcript.records_seen} recorded)"
    parts.append(attempt)
    return " · ".join(parts)


def step_usage(step: StepView) -> str:
    """Latency, tokens and retries of one call, for a step's heading."""
    parts = [f"{step.latency_ms:.0f} ms" if step.latency_ms is not None else "latency –"]
    tokens = step.tokens
    if tokens:
        usage = f"tokens {tokens.get('prompt_tokens', '–')} in / {tokens.get('completion_tokens', '–')} out"
        if "reasoning_tokens" in tokens:
            usage += f" ({tokens['reasoning_tokens']} thinking)"
        parts.append(usage)
    if step.retries:
        parts.append(f"{step.retries} {'retry' if step.retries == 1 else 'retries'}")
    return " · ".join(parts)


def render_terminal(transcript: Transcript, console: Console, *, thinking: bool = False, location: str | None = None) -> None:
    """Print the transcript; thinking is shortened to its first line unless ``thinking``."""
    row = transcript.row
    head = Table.grid(padding=(0, 2))
    head.add_column(style="bold")
    head.add_column()
    job = f"task {row['task_id']} · sample {row['sample_id']} · seed {row['seed']} · split {row['split']}"
    head.add_row("outcome", _t(headline(transcript)))
    for name, value in (
        ("run", location),
        ("job", job),
        ("model", transcript.model),
        ("category", row.get("category")),
        ("skills", ", ".join(transcript.skills) or None),
        ("duration", f"{row['duration_ms'] / 1000:.1f} s" if row.get("duration_ms") is not None else None),
    ):
        if value is not None:
            head.add_row(name, _t(value))
    console.print(Panel(head, title=_t(transcript.episode_id, "bold"), title_align="left"))
    console.print(Text("Instruction", style="bold"))
    console.print(_t(transcript.instruction or "(none recorded)"))
    if transcript.persona:
        console.print(Text("Persona (public)", style="bold"))
        console.print(_t(outline(transcript.persona, "  ")))

    for step in transcript.steps:
        console.print(Rule(_t(f"step {step.index} · {step.page_type or '?'} · {step_usage(step)}"), align="left"))
        console.print(_step_terminal(step, thinking=thinking))

    console.print(Rule(Text("end"), align="left"))
    if transcript.error:
        error = transcript.error
        console.print(_t(f"error at {error.stage}: {error.type}: {error.message}", "red"))
    if transcript.reward_detail:
        detail = Table("reward detail", "value", show_edge=False, box=None)
        for key, value in transcript.reward_detail.items():
            detail.add_row(_t(key), _t(_number(value, 3) if isinstance(value, float) else value))
        console.print(detail)
    for name, value in (("goal", transcript.goal), ("purchase", transcript.purchase)):
        if value:
            console.print(Text(name, style="bold"))
            console.print(_t(outline(value, "  ")))


def _step_terminal(step: StepView, *, thinking: bool) -> RenderableType:
    parts: list[RenderableType] = [Text("observation", style="bold"), _t(step.observation or "(none recorded)", "dim")]
    tools = ", ".join(step.tools) or "none"
    if step.click_values:
        tools += f" ({len(step.click_values)} click values)"
    parts.append(Text.assemble(("tools offered: ", "bold"), _t(tools)))
    if step.reasoning:
        shown = step.reasoning if thinking else _abbreviated(step.reasoning)
        parts.append(Text.assemble(("thinking: ", "bold magenta"), _t(shown, "magenta")))
    if step.content:
        parts.append(Text.assemble(("text: ", "bold"), _t(step.content)))
    for call in step.tool_calls:
        parts.append(Text.assemble(("call: ", "bold cyan"), _t(f"{call.name} {call.arguments}", "cyan")))
    if step.protocol_error:
        parts.append(_t(f"protocol error {step.protocol_error.code}: {step.protocol_error.message}", "yellow"))
        if step.protocol_feedback:
            parts.append(Text.assemble(("sent back: ", "bold yellow"), _t(step.protocol_feedback, "yellow")))
    if step.policy_failure:
        parts.append(_t(f"policy failure {step.policy_failure.code}: {step.policy_failure.message}", "red"))
    if step.action is not None:
        outcome = Text.assemble(("action: ", "bold"), _t(step.action))
        if step.feedback:
            valid = step.feedback.valid
            outcome.append_text(
                _t(f" → {'valid' if valid else 'INVALID' if valid is False else '?'}", "green" if valid else "red")
            )
            outcome.append_text(_t(f" {step.feedback.reason}: {step.feedback.get('message')}"))
        if step.reward is not None:
            outcome.append_text(_t(f" · reward {_number(step.reward)}{' · done' if step.done else ''}"))
        parts.append(outcome)
    for attempt in step.attempts:
        if attempt.error or (attempt.status is not None and attempt.status != 200):
            parts.append(
                _t(
                    f"HTTP attempt {attempt.attempt}: status {attempt.status} · {attempt.error} · "
                    f"{_number(attempt.latency_ms, 0)} ms, then {_number(attempt.backoff_ms, 0)} ms backoff",
                    "yellow",
                )
            )
    return Group(*parts)


def _abbreviated(text: str) -> str:
    flat = " ".join(text.split())
    if len(flat) <= THINKING_PREVIEW_CHARS:
        return flat
    return f"{flat[:THINKING_PREVIEW_CHARS]}… ({len(text)} chars; --thinking shows all)"
