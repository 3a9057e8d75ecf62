"""Skill selection: which strategy hints go into an episode's system prompt.

A :class:`SkillProvider` sees only the public context of an episode (what the agent itself
sees at reset, plus the job coordinates); a context carrying the private goal is refused, so
no provider can leak the answer into the prompt. Its ``identity()`` enters the plan
fingerprint.

Skill bank file (``JsonSkillBank``)::

    {"schema_version": "shopsimrl-skillbank-v1", "bank_version": "1",
     "skills": [{"skill_id": "global", "content": "…", "version": "1", "enabled": true,
                 "task_ids": [4, 9], "metadata": {}}]}

A skill without ``task_ids`` (absent or null) is global; one with ``task_ids`` applies to those
tasks only. Selection keeps file order and stops at ``max_skills``.

Skill assignment file (``AssignedSkills``: each episode gets exactly the skills assigned to it,
in bank order; what a skill gate's masked rollouts run with)::

    {"schema_version": "shopsimrl-skill-assignments-v1",
     "skills": [{"skill_id": "chunk-a", "content": "…", "version": "1", "metadata": {}}],
     "assignments": [{"split": "val", "task_id": 4, "sample_id": 0, "skill_ids": ["chunk-a"]}],
     "protocol": {}}

A skill bank snapshot (``shopsimrl-skillbank-snapshot-v1``, written by ``shopsimrl skills
snapshot``) is read wherever a bank is: it carries a ``shopsimrl-skillbank-v1`` bank in its
``bank`` key, and its ``snapshot_id`` (the sha256 of its canonical content without that key) is
checked on every read, so a snapshot edited after it was frozen is refused.

``protocol`` is not read by the provider; it is hashed with the rest, so whatever a gate freezes
there (mask seed, the bare baseline's digest) enters the plan fingerprint. ``skills.path`` may
name either kind of file: :func:`open_skill_provider` tells them apart by ``schema_version``.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any, Final, Protocol, runtime_checkable

from shopsimrl.schemas import Skill, fingerprint, read_json_file

__all__ = [
    "ASSIGNMENTS_SCHEMA_VERSION",
    "PRIVATE_CONTEXT_KEYS",
    "PUBLIC_CONTEXT_KEYS",
    "SKILLBANK_SCHEMA_VERSION",
    "SNAPSHOT_SCHEMA_VERSION",
    "AssignedSkills",
    "JsonSkillBank",
    "NoSkills",
    "PrivateContextError",
    "SkillBankError",
    "SkillProvider",
    "check_public_context",
    "open_skill_provider",
    "snapshot_id_of",
    "unwrap_snapshot",
]

SKILLBANK_SCHEMA_VERSION: Final = "shopsimrl-skillbank-v1"
ASSIGNMENTS_SCHEMA_VERSION: Final = "shopsimrl-skill-assignments-v1"
SNAPSHOT_SCHEMA_VERSION: Final = "shopsimrl-skillbank-snapshot-v1"
DEFAULT_BANK_VERSION: Final = "1"

PUBLIC_CONTEXT_KEYS: Final = frozenset(
    {"task_id", "sample_id", "split", "task_instruction", "user_persona", "observation_state", "task_mode"}
)
PRIVATE_CONTEXT_KEYS: Final = frozenset({"private_task_instruction", "goal_options", "reason_key", "goal"})

_RECORD_KEYS: Final = frozenset({"skill_id", "content", "version", "enabled", "task_ids", "metadata"})


class SkillBankError(ValueError):
    """A skill bank file that cannot be used; the message names the file and the field."""


class PrivateContextError(ValueError):
    """A selection context that carries private goal information."""


@runtime_checkable
class SkillProvider(Protocol):
    def select(self, context: Mapping[str, Any]) -> list[Skill]:
        """Skills for one episode, in prompt order, from its public context."""
        ...

    def identity(self) -> dict[str, Any]: ...


def check_public_context(context: Mapping[str, Any]) -> None:
    leaked = sorted(PRIVATE_CONTEXT_KEYS.intersection(context))
    if leaked:
        raise PrivateContextError(f"skill selection context must not contain private goal fields: {leaked}")


class NoSkills:
    """The skill-free baseline."""

    def select(self, context: Mapping[str, Any]) -> list[Skill]:
        check_public_context(context)
        return []

    def identity(self) -> dict[str, Any]:
        return {"provider": "none"}


class JsonSkillBank:
    """Global and task-scoped skills from one JSON file, loaded and validated once."""

    def __init__(self, path: str | Path, max_skills: int | None = None, *, document: Any | None = None) -> None:
        """``document``: the file's parsed JSON when the caller has read it (then ``path`` only names it)."""
        if max_skills is not None and (isinstance(max_skills, bool) or not isinstance(max_skills, int) or max_skills < 0):
            raise SkillBankError(f"max_skills must be a non-negative integer or None, got {max_skills!r}")
        self.path = Path(path)
        self.max_skills = max_skills
        bank = _read_json(self.path) if document is None else document
        self.snapshot_id: str | None = None
        if isinstance(bank, dict) and bank.get("schema_version") == SNAPSHOT_SCHEMA_VERSION:
            inner = unwrap_snapshot(self.path, bank)
            self.snapshot_id, bank = str(bank["snapshot_id"]), inner
        self.schema_version, self.bank_version, self._entries = _parse_bank(self.path, bank)
        self._sha256 = fingerprint(bank)

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def entries(self) -> list[tuple[Skill, frozenset[int] | None]]:
        """The enabled skills in file order, each with its task ids (None: global)."""
        return list(self._entries)

    def select(self, context: Mapping[str, Any]) -> list[Skill]:
        check_public_context(context)
        task_id = context.get("task_id")
        if isinstance(task_id, bool) or not isinstance(task_id, int):
            raise ValueError(f"skill selection context needs an integer 'task_id', got {task_id!r}")
        selected: list[Skill] = []
        for skill, task_ids in self._entries:
            if self.max_skills is not None and len(selected) >= self.max_skills:
                break
            if task_ids is None or task_id in task_ids:
                selected.append(skill)
        return selected

    def identity(self) -> dict[str, Any]:
        return {
            "provider": "json_skillbank",
            "schema_version": self.schema_version,
            "bank_version": self.bank_version,
            "bank_sha256": self._sha256,
            "max_skills": self.max_skills,
            **({"snapshot_id": self.snapshot_id} if self.snapshot_id is not None else {}),
        }


def snapshot_id_of(document: Mapping[str, Any]) -> str:
    """A snapshot's content address: the sha256 of its canonical JSON without ``snapshot_id``."""
    return fingerprint({key: value for key, value in document.items() if key != "snapshot_id"})


def unwrap_snapshot(path: Path, document: Mapping[str, Any]) -> dict[str, Any]:
    """The ``shopsimrl-skillbank-v1`` bank a snapshot carries, after its content address is checked."""
    if document.get("schema_version") != SNAPSHOT_SCHEMA_VERSION:
        raise SkillBankError(f"skill bank snapshot {path}: 'schema_version' is not {SNAPSHOT_SCHEMA_VERSION!r}")
    recorded, actual = document.get("snapshot_id"), snapshot_id_of(document)
    if recorded != actual:
        raise SkillBankError(
            f"skill bank snapshot {path}: its content has sha256 {actual} but its snapshot_id is {recorded!r}: "
            "it was changed after it was frozen (a snapshot is never edited; freeze a new one)"
        )
    bank = document.get("bank")
    if not isinstance(bank, dict):
        raise SkillBankError(f"skill bank snapshot {path}: 'bank' must be a {SKILLBANK_SCHEMA_VERSION} object")
    return bank


class AssignedSkills:
    """Per-episode skill lists fixed in advance (a skill gate's masks), keyed by
    ``(split, task_id, sample_id)``; each episode gets its listed skills in bank order."""

    def __init__(self, path: str | Path, document: Any | None = None) -> None:
        self.path = Path(path)
        document = _read_json(self.path) if document is None else document
        self._skills, self._assigned = _parse_assignments(self.path, document)
        self._sha256 = fingerprint(document)

    def __len__(self) -> int:
        return len(self._assigned)

    def select(self, context: Mapping[str, Any]) -> list[Skill]:
        check_public_context(context)
        split, task_id, sample_id = context.get("split"), context.get("task_id"), context.get("sample_id")
        assigned = self._assigned.get((split, task_id, sample_id))  # type: ignore[arg-type]  # a bad key finds nothing
        if assigned is None:
            raise SkillBankError(
                f"skill assignments {self.path} hold no entry for split {split!r}, task {task_id!r}, sample {sample_id!r}"
            )
        return [self._skills[skill_id] for skill_id in assigned]

    def identity(self) -> dict[str, Any]:
        return {
            "provider": "assigned_skills",
            "schema_version": ASSIGNMENTS_SCHEMA_VERSION,
            "assignments_sha256": self._sha256,
            "skills": len(self._skills),
            "episodes": len(self._assigned),
        }


def open_skill_provider(path: str | Path, *, max_skills: int | None = None) -> SkillProvider:
    """The provider of a ``skills.path`` file: a skill bank or a skill assignment file."""
    path = Path(path)
    document = _read_json(path)
    if isinstance(document, dict) and document.get("schema_version") == ASSIGNMENTS_SCHEMA_VERSION:
        if max_skills is not None:
            raise SkillBankError(f"{path} assigns each episode its skills; skills.max_skills cannot apply to it (set it to null)")
        return AssignedSkills(path, document)
    return JsonSkillBank(path, max_skills=max_skills)


# --------------------------------------------------------------------------- loading


def _read_json(path: Path) -> Any:
    return read_json_file(path, "skill bank", SkillBankError)


def _parse_bank(path: Path, bank: Any) -> tuple[str, str, list[tuple[Skill, frozenset[int] | None]]]:
    def fail(where: str, problem: str) -> SkillBankError:
        return SkillBankError(f"skill bank {path}: {where} {problem}")

    if not isinstance(bank, dict):
        raise fail("top level", f"must be a JSON object, got {type(bank).__name__}")
    schema_version = bank.get("schema_version", SKILLBANK_SCHEMA_VERSION)
    if schema_version != SKILLBANK_SCHEMA_VERSION:
        raise fail("'schema_version'", f"is {schema_version!r}; this reader understands {SKILLBANK_SCHEMA_VERSION!r}")
    bank_version = bank.get("bank_version", DEFAULT_BANK_VERSION)
    if not isinstance(bank_version, str) or not bank_version.strip():
        raise fail("'bank_version'", f"must be a non-empty string, got {bank_version!r}")
    records = bank.get("skills")
    if not isinstance(records, list):
        raise fail("'skills'", f"must be a list, got {type(records).__name__}")

    entries: list[tuple[Skill, frozenset[int] | None]] = []
    seen: set[str] = set()
    for index, record in enumerate(records):
        where = f"skills[{index}]"
        if not isinstance(record, dict):
            raise fail(where, f"must be an object, got {type(record).__name__}")
        unknown = sorted(set(record) - _RECORD_KEYS)
        if unknown:
            raise fail(where, f"has unknown keys {unknown}; allowed: {sorted(_RECORD_KEYS)}")
        skill_id = record.get("skill_id")
        if not isinstance(skill_id, str) or not skill_id.strip():
            raise fail(f"{where}.skill_id", f"must be a non-empty string, got {skill_id!r}")
        where = f"skills[{index}] ({skill_id!r})"
        if skill_id in seen:
            raise fail(where, "duplicates an earlier skill_id")
        seen.add(skill_id)
        content = record.get("content")
        if not isinstance(content, str) or not content.strip():
            raise fail(f"{where}.content", "must be a non-blank string")
        version = record.get("version", "1")
        if isinstance(version, bool) or not isinstance(version, (str, int)) or not str(version).strip():
            raise fail(f"{where}.version", f"must be a non-empty string, got {version!r}")
        enabled = record.get("enabled", True)
        if not isinstance(enabled, bool):
            raise fail(f"{where}.enabled", f"must be true or false, got {enabled!r}")
        metadata = record.get("metadata", {})
        if metadata is None:
            metadata = {}
        if not isinstance(metadata, dict):
            raise fail(f"{where}.metadata", f"must be an object, got {type(metadata).__name__}")
        try:
            task_ids = _task_ids(record.get("task_ids"))
        except ValueError as exc:
            raise fail(f"{where}.task_ids", str(exc)) from None
        if not enabled:
            continue
        scope = "global" if task_ids is None else "task"
        skill = Skill(skill_id=skill_id, content=content, version=str(version), metadata={**metadata, "selection_scope": scope})
        entries.append((skill, task_ids))
    return schema_version, bank_version, entries


def _task_ids(value: Any) -> frozenset[int] | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value:
        raise ValueError(f"must be a non-empty list of task ids, or absent for a global skill; got {value!r}")
    for item in value:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise ValueError(f"must hold non-negative integers, got {item!r}")
    return frozenset(value)


_ASSIGNED_SKILL_KEYS: Final = frozenset({"skill_id", "content", "version", "metadata"})
_ASSIGNMENT_KEYS: Final = frozenset({"split", "task_id", "sample_id", "skill_ids"})


def _parse_assignments(path: Path, document: Any) -> tuple[dict[str, Skill], dict[tuple[str, int, int], tuple[str, ...]]]:
    def fail(where: str, problem: str) -> SkillBankError:
        return SkillBankError(f"skill assignments {path}: {where} {problem}")

    if not isinstance(document, dict) or document.get("schema_version") != ASSIGNMENTS_SCHEMA_VERSION:
        raise fail("'schema_version'", f"must be {ASSIGNMENTS_SCHEMA_VERSION!r}")
    unknown = sorted(set(document) - {"schema_version", "skills", "assignments", "protocol"})
    if unknown:
        raise fail("top level", f"has unknown keys {unknown}")
    records, rows = document.get("skills"), document.get("assignments")
    if not isinstance(records, list) or not records:
        raise fail("'skills'", "must be a non-empty list")
    if not isinstance(rows, list) or not rows:
        raise fail("'assignments'", "must be a non-empty list")
    if not isinstance(document.get("protocol", {}), dict):
        raise fail("'protocol'", "must be an object")

    skills: dict[str, Skill] = {}
    for index, record in enumerate(records):
        where = f"skills[{index}]"
        if not isinstance(record, dict) or set(record) - _ASSIGNED_SKILL_KEYS:
            raise fail(where, f"must be an object with keys among {sorted(_ASSIGNED_SKILL_KEYS)}")
        skill_id, content = record.get("skill_id"), record.get("content")
        if not isinstance(skill_id, str) or not skill_id.strip() or skill_id in skills:
            raise fail(f"{where}.skill_id", f"must be a non-empty string not used before, got {skill_id!r}")
        if not isinstance(content, str) or not content.strip():
            raise fail(f"{where}.content", "must be a non-blank string")
        version, metadata = record.get("version", "1"), record.get("metadata") or {}
        if not isinstance(version, str) or not version.strip():
            raise fail(f"{where}.version", f"must be a non-empty string, got {version!r}")
        if not isinstance(metadata, dict):
            raise fail(f"{where}.metadata", "must be an object")
        skills[skill_id] = Skill(skill_id, content, version, {**metadata, "selection_scope": "assigned"})

    order = {skill_id: index for index, skill_id in enumerate(skills)}
    assigned: dict[tuple[str, int, int], tuple[str, ...]] = {}
    for index, row in enumerate(rows):
        where = f"assignments[{index}]"
        if not isinstance(row, dict) or set(row) != _ASSIGNMENT_KEYS:
            raise fail(where, f"must be an object with exactly the keys {sorted(_ASSIGNMENT_KEYS)}")
        split, task_id, sample_id, ids = row["split"], row["task_id"], row["sample_id"], row["skill_ids"]
        if not isinstance(split, str) or not split:
            raise fail(f"{where}.split", "must be a non-empty string")
        for name, value in (("task_id", task_id), ("sample_id", sample_id)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise fail(f"{where}.{name}", f"must be a non-negative integer, got {value!r}")
        if not isinstance(ids, list) or any(skill_id not in order for skill_id in ids):
            raise fail(f"{where}.skill_ids", f"must list skill ids of 'skills', got {ids!r}")
        positions = [order[skill_id] for skill_id in ids]
        if positions != sorted(set(positions)):
            raise fail(f"{where}.skill_ids", "must list each skill at most once, in the order of 'skills'")
        key = (split, task_id, sample_id)
        if key in assigned:
            raise fail(where, f"assigns split {split!r}, task {task_id}, sample {sample_id} a second time")
        assigned[key] = tuple(ids)
    return skills, assigned
