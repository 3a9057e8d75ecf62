"""What may leave a run in an exported data set: the redaction rules every exporter and converter
applies.

By default an export holds what the model saw and did, minus three things, each added back only
when asked for by name (``--include reasoning,persona,goal``):

- ``reasoning``: the model's thinking (``steps[i].model.reasoning``). The conversation never
  holds it (the runtime does not send it back), so it is absent unless added.
- ``persona``: the user profile. The model saw it in the system message, as the section
  :func:`shopsimrl.prompts.persona_section` renders; that section is removed. A system message
  from which it cannot be removed cleanly makes the episode unusable (fail closed), never a leak.
- ``goal``: the private goal the environment reveals after the episode (``final.goal``: the
  product, its attributes, options and budget). The model never saw it; only the judge input
  can carry it.

Episodes of the held-out test split are never exported (:func:`refuse_test_split`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from shopsimrl.prompts import persona_section
from shopsimrl.research.runs import Run

__all__ = [
    "INCLUDABLE",
    "ExportRefusedError",
    "RedactionError",
    "parse_include",
    "persona_of",
    "redacted_conversation",
    "refuse_test_split",
    "refusing_test_records",
]

INCLUDABLE = ("reasoning", "persona", "goal")

_PERSONA_LABEL = persona_section({}).partition("\n")[0]
_SENTINEL_CHARS = 4
"""Persona values this long or longer must not be left in a redacted system message."""


class RedactionError(ValueError):
    """One episode cannot be redacted safely; exporters drop it and say why."""


class ExportRefusedError(ValueError):
    """The run may not be exported at all (the held-out test split); exit 2."""


def parse_include(text: str | None, allowed: Iterable[str] = INCLUDABLE) -> frozenset[str]:
    """``"reasoning,persona"`` → the names; an unknown or disallowed name is a ValueError naming it."""
    allowed = tuple(allowed)
    names = frozenset(part.strip() for part in (text or "").split(",") if part.strip())
    unknown = sorted(names - set(allowed))
    if unknown:
        raise ValueError(f"--include: {', '.join(unknown)} cannot be included here; choose from {', '.join(allowed)}")
    return names


def _is_test(split: Any) -> bool:
    return isinstance(split, str) and split.casefold() == "test"


def refuse_test_split(run: Run) -> None:
    """Raise :class:`ExportRefusedError` when the run's plan is a held-out test split."""
    plan = run.plan or {}
    guard, split = plan.get("test_guard"), plan.get("task_split")
    guard = guard if isinstance(guard, dict) else {}
    split = split if isinstance(split, dict) else {}
    if guard.get("held_out_split") is True or _is_test(split.get("name")) or _is_test(split.get("role")):
        raise ExportRefusedError(f"{run.location} is a run of the held-out test split; its episodes are never exported")


def refusing_test_records(records: Iterable[dict[str, Any]], location: str) -> Iterator[dict[str, Any]]:
    """The records, raising :class:`ExportRefusedError` at the first of a test-split job (runs
    without a manifest, e.g. the earlier implementation's, are checked episode by episode)."""
    for record in records:
        job = record.get("job")
        if isinstance(job, dict) and _is_test(job.get("split")):
            raise ExportRefusedError(
                f"{location}: episode {record.get('episode_id')} belongs to the held-out test split; it is never exported"
            )
        yield record


def persona_of(record: Mapping[str, Any]) -> dict[str, Any]:
    """The public persona the model was shown (``reset.user_persona``), {} when none."""
    reset = record.get("reset")
    persona = reset.get("user_persona") if isinstance(reset, dict) else None
    return persona if isinstance(persona, dict) else {}


def _leaves(value: Any) -> Iterator[str]:
    if isinstance(value, dict):
        for item in value.values():
            yield from _leaves(item)
    elif isinstance(value, list):
        for item in value:
            yield from _leaves(item)
    elif isinstance(value, str | int | float) and not isinstance(value, bool):
        yield str(value)


def _without_persona(content: str, persona: dict[str, Any]) -> str:
    section = persona_section(persona)
    if persona:
        # PromptBuilder joins sections with a blank line; the persona is never the first section.
        content = content.replace("\n\n" + section, "", 1)
    leaked = _PERSONA_LABEL in content or any(len(value) >= _SENTINEL_CHARS and value in content for value in _leaves(persona))
    if leaked:
        raise RedactionError("the persona could not be separated from the system message")
    return content


def redacted_conversation(record: Mapping[str, Any], include: frozenset[str]) -> list[dict[str, Any]]:
    """A copy of the episode's conversation (the messages as sent) with the persona section
    removed from the system message unless ``persona`` is included."""
    conversation = record.get("conversation")
    if not isinstance(conversation, list):
        return []
    messages = [dict(message) if isinstance(message, dict) else message for message in conversation]
    if "persona" not in include and messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
        content = messages[0].get("content")
        if isinstance(content, str):
            messages[0]["content"] = _without_persona(content, persona_of(record))
    return messages
