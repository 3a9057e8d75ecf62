"""What may leave a run in an exported data set: the redaction rules every exporter and converter
applies.

By default an export holds what the model saw and did, minus three things, each added back only
when asked for by name (``--include reasoning,persona,goal``):

- ``reasoning``: the model's thinking (``steps[i].model.reasoning``). The conversation never
  holds it (the runtime does not send it back), so it is absent unless added.
- ``persona``: the user profile, in full. The model saw it in the system message, as the section
  :func:`shopsimrl.prompts.persona_section` renders, and its replies depend on it (the system
  prompt tells it to match the profile; search queries take words from it). So by default the
  section stays as the policy saw it, minus the fields that identify the user and teach nothing
  (:data:`IDENTIFYING_PERSONA_FIELDS`: user id, registration and update times), re-rendered the
  same way. A system message whose section cannot be found verbatim, or an identifying value
  still present anywhere in the exported messages (a reply or a page that repeats it), makes the
  episode unusable (fail closed), never a leak.
- ``goal``: the private goal the environment reveals after the episode (``final.goal``: the
  product, its attributes, options and budget). The model never saw it; only the judge input
  can carry it.

Episodes of the held-out test split are never exported (:func:`refuse_test_split`).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from typing import Any

from shopsimrl.prompts import persona_section
from shopsimrl.records import EpisodeTrace
from shopsimrl.storage.reading import Run

__all__ = [
    "IDENTIFYING_PERSONA_FIELDS",
    "INCLUDABLE",
    "ExportRefusedError",
    "RedactionError",
    "parse_include",
    "persona_of",
    "public_persona",
    "redacted_conversation",
    "refuse_test_split",
    "refusing_test_records",
    "removed_persona_fields",
]

INCLUDABLE = ("reasoning", "persona", "goal")
IDENTIFYING_PERSONA_FIELDS = frozenset({"用户ID", "注册时间", "最后更新时间", "更新时间"})
"""Persona keys (at any depth) left out of a default export: who the user is and when the record
was made, which no reply should depend on."""

_SENTINEL_CHARS = 4
"""Removed persona values this long or longer must not be left in the exported messages (shorter
ones, a single digit, say, turn up by chance)."""


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


def refusing_test_records(records: Iterable[EpisodeTrace], location: str) -> Iterator[EpisodeTrace]:
    """The records, raising :class:`ExportRefusedError` at the first of a test-split job (runs
    without a manifest, e.g. the earlier implementation's, are checked episode by episode)."""
    for record in records:
        if _is_test(record.job.split):
            raise ExportRefusedError(
                f"{location}: episode {record.episode_id} belongs to the held-out test split; it is never exported"
            )
        yield record


def persona_of(record: EpisodeTrace) -> dict[str, Any]:
    """The public persona the model was shown (``reset.user_persona``), {} when none."""
    persona = (record.reset or {}).get("user_persona")
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


def public_persona(persona: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, list[str]]]:
    """The persona without its identifying fields (at any depth), and what was removed: field
    name → the removed values as text."""
    removed: dict[str, list[str]] = {}

    def strip(value: Any) -> Any:
        if isinstance(value, Mapping):
            kept = {}
            for key, item in value.items():
                if key in IDENTIFYING_PERSONA_FIELDS:
                    removed.setdefault(str(key), []).extend(_leaves(item) if isinstance(item, dict | list) else [str(item)])
                else:
                    kept[key] = strip(item)
            return kept
        if isinstance(value, list):
            return [strip(item) for item in value]
        return value

    return strip(persona), removed


def removed_persona_fields(record: EpisodeTrace, include: frozenset[str]) -> list[str]:
    """The identifying persona fields a default export removes from this episode (none when the
    persona is included in full)."""
    if "persona" in include:
        return []
    return sorted(public_persona(persona_of(record))[1])


def _public_system(content: str, persona: dict[str, Any]) -> tuple[str, list[str]]:
    """The system message with the persona section re-rendered without identifying fields, and
    the removed values that must then appear nowhere in the messages. A system message without
    the section verbatim (the earlier implementation's prompts showed no persona) is left as it
    is: the check of the removed values still fails it if it shows them some other way."""
    public, removed = public_persona(persona)
    if not removed:
        return content, []
    content = content.replace(persona_section(persona), persona_section(public), 1)
    return content, [value for values in removed.values() for value in values if len(value) >= _SENTINEL_CHARS]


def _message_texts(message: Mapping[str, Any]) -> Iterator[str]:
    content = message.get("content")
    if isinstance(content, str):
        yield content
    for call in message.get("tool_calls") or []:
        function = call.get("function") if isinstance(call, dict) else None
        if isinstance(function, dict) and isinstance(function.get("arguments"), str):
            yield function["arguments"]


def redacted_conversation(record: EpisodeTrace, include: frozenset[str]) -> list[dict[str, Any]]:
    """A copy of the episode's conversation (the messages as sent), the persona section without
    its identifying fields unless ``persona`` is included in full."""
    messages = [dict(message) if isinstance(message, dict) else message for message in record.conversation]
    if "persona" not in include and messages and isinstance(messages[0], dict) and messages[0].get("role") == "system":
        content = messages[0].get("content")
        if isinstance(content, str):
            messages[0]["content"], removed = _public_system(content, persona_of(record))
            for position, message in enumerate(messages):
                texts = _message_texts(message) if isinstance(message, dict) else iter(())
                if any(value in text for text in texts for value in removed):
                    raise RedactionError(
                        f"conversation[{position}] repeats an identifying persona field "
                        f"({', '.join(sorted(public_persona(persona_of(record))[1]))}): it cannot be removed from the pair"
                    )
    return messages
