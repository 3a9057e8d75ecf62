"""The group-consistent skill curriculum: which chunks of a gate-selected bank each GRPO group gets.

A curriculum state is built once per training round from a gate-selected skill bank (every enabled
record carries the gate's ``metadata.estimated_effect``), or a skill bank snapshot of one (``skills
snapshot --selected``: read as the bank it carries, its content address checked), and frozen as
one JSON document::

    {"schema_version": "shopsimrl-skill-curriculum-v1", "created_at": "…",
     "round_id": "round-001", "seed": 20260901, "skill_free_probability": 0.2,
     "chunks": [{"skill_id": "…", "version": "…", "content": "…", "metadata": {…},
                 "contribution": 0.0799, "inclusion_probability": 0.9}],
     "source": {"skillbank_path": "/abs/selected_skillbank.json", "skillbank_sha256": "…",
                "probability_mapping": {"name": "clipped_linear_positive_contribution",
                                        "rho_min": 0.2, "rho_max": 0.9,
                                        "contribution_scale": 0.0799,
                                        "scale_source": "largest_active_contribution"}},
     "state_id": "…"}

``contribution`` is the chunk's estimated effect and ``inclusion_probability`` its rho =
clip(rho_min + (rho_max − rho_min)·effect/scale, rho_min, rho_max), ``scale`` the largest effect
unless given. Every rollout of group ``g`` then draws, from the state alone::

    draw(t) = int.from_bytes(sha256(f"{seed}:{state_id}:{g}:{t}").digest()[:8], "big") / 2**64

``skill_free`` when ``draw("skill-free") < q``; else each chunk when ``draw(f"chunk:{id}") < rho``
(mode ``assisted``, or ``assisted_empty`` when no chunk was drawn). The group key is slime's
``group_index``, so every sample of a prompt gets the same skills, whatever the worker or order.

The state id is content-addressed: the sha256 of the canonical JSON
(:func:`shopsimrl.schemas.fingerprint`) of ``round_id``, ``seed``, ``skill_free_probability``,
``chunks`` and ``source`` without ``skillbank_path`` (recorded, never hashed), so the same bank
copied elsewhere gives the same state and the same draws. The earlier implementation hashed the
path too (:data:`EARLIER_RULE`); a state file it wrote still loads, and its draws use the state id
stored in it, so its groups get exactly the skills they got then. A file whose id matches neither
rule has been edited and is refused. A state file is never overwritten with another state
(:func:`write_curriculum_state`).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final, Literal

from shopsimrl.schemas import Skill, fingerprint, read_json_file
from shopsimrl.skills import JsonSkillBank, SkillBankError, check_public_context
from shopsimrl.storage.local import RunWriteError

__all__ = [
    "CONTENT_RULE",
    "CURRICULUM_SCHEMA_VERSION",
    "DEFAULT_SEED",
    "EARLIER_RULE",
    "PROBABILITY_MAPPING",
    "CurriculumChunk",
    "CurriculumError",
    "CurriculumSkills",
    "SkillAssignment",
    "SkillCurriculum",
    "build_curriculum_state",
    "check_against_bank",
    "draw",
    "earlier_state_id",
    "load_curriculum",
    "open_curriculum",
    "state_id_of",
    "write_curriculum_state",
]

CURRICULUM_SCHEMA_VERSION: Final = "shopsimrl-skill-curriculum-v1"
PROBABILITY_MAPPING: Final = "clipped_linear_positive_contribution"
DEFAULT_SEED: Final = 20260901
CONTENT_RULE: Final = "content"
"""The state id hashes the state's content, the bank's path left out."""
EARLIER_RULE: Final = "earlier_path_bound"
"""The earlier implementation's state id, which also hashed the bank's absolute path."""

Mode = Literal["skill_free", "assisted", "assisted_empty", "full"]

_TOP_KEYS: Final = frozenset(
    {"schema_version", "created_at", "round_id", "seed", "skill_free_probability", "chunks", "source", "state_id"}
)
_CORE_KEYS: Final = ("round_id", "seed", "skill_free_probability", "chunks", "source")
_CHUNK_KEYS: Final = frozenset({"skill_id", "version", "content", "metadata", "contribution", "inclusion_probability"})


class CurriculumError(ValueError):
    """A curriculum state or its bank that cannot be used; the message names the file and the field."""


# --------------------------------------------------------------------------- identity and the draw


def _core(document: Mapping[str, Any]) -> dict[str, Any]:
    return {key: document[key] for key in _CORE_KEYS}


def state_id_of(document: Mapping[str, Any]) -> str:
    """The content-addressed state id: everything the draws depend on, not the bank's path."""
    core = _core(document)
    core["source"] = {key: value for key, value in core["source"].items() if key != "skillbank_path"}
    return fingerprint(core)


def earlier_state_id(document: Mapping[str, Any]) -> str:
    """The earlier implementation's state id (``source.skillbank_path`` hashed too)."""
    return fingerprint(_core(document))


def draw(seed: int, state_id: str, group_key: str, treatment: str) -> float:
    """The uniform draw in [0, 1) of one treatment of one group (module docstring)."""
    digest = hashlib.sha256(f"{seed}:{state_id}:{group_key}:{treatment}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / float(1 << 64)


# --------------------------------------------------------------------------- the state


@dataclass(frozen=True)
class CurriculumChunk:
    skill_id: str
    version: str
    content: str
    metadata: dict[str, Any]
    contribution: float
    """The gate's estimated effect of the chunk (positive)."""
    inclusion_probability: float
    """rho: the chance an assisted group gets this chunk."""

    def skill(self, state_id: str) -> Skill:
        """The chunk as the prompt's skill renderer takes it; ``selection_scope`` says who chose it."""
        metadata = {**self.metadata, "selection_scope": "curriculum", "curriculum_state_id": state_id}
        return Skill(skill_id=self.skill_id, content=self.content, version=self.version, metadata=metadata)


@dataclass(frozen=True)
class SkillAssignment:
    """What one group gets: ``mode`` and the chunks drawn, in the curriculum's order."""

    state_id: str
    group_key: str
    mode: Mode
    chunks: tuple[CurriculumChunk, ...]
    skill_free_probability: float
    """q of the state the group was drawn from."""
    inclusion: tuple[tuple[str, float], ...]
    """Every chunk of that state with its rho (what the group could have got)."""

    @property
    def skill_ids(self) -> list[str]:
        return [chunk.skill_id for chunk in self.chunks]

    def to_dict(self) -> dict[str, Any]:
        """What a sample's metadata and the trace's ``provenance.skills`` record."""
        return {
            "state_id": self.state_id,
            "group_key": self.group_key,
            "mode": self.mode,
            "skill_ids": self.skill_ids,
            "q": self.skill_free_probability,
            "rho": dict(self.inclusion),
        }


class CurriculumSkills:
    """The :class:`~shopsimrl.skills.SkillProvider` of one assignment: every episode of the group
    gets its chunks, rendered by the prompt builder like any selected skill."""

    def __init__(self, assignment: SkillAssignment, *, round_id: str | None = None) -> None:
        self.assignment = assignment
        self.round_id = round_id

    def select(self, context: Mapping[str, Any]) -> list[Skill]:
        check_public_context(context)
        return [chunk.skill(self.assignment.state_id) for chunk in self.assignment.chunks]

    def identity(self) -> dict[str, Any]:
        return {
            "provider": "skill_curriculum",
            "schema_version": CURRICULUM_SCHEMA_VERSION,
            "round_id": self.round_id,
            **self.assignment.to_dict(),
        }


@dataclass(frozen=True)
class SkillCurriculum:
    """A loaded, checked curriculum state (module docstring)."""

    state_id: str
    round_id: str
    seed: int
    skill_free_probability: float
    chunks: tuple[CurriculumChunk, ...]
    source: dict[str, Any]
    rule: str
    """:data:`CONTENT_RULE`, or :data:`EARLIER_RULE` for a state the earlier implementation wrote."""
    document: dict[str, Any] = field(repr=False, compare=False)

    @classmethod
    def from_document(cls, document: Any, *, where: str = "curriculum state") -> SkillCurriculum:
        """Check the document's shape and its state id; :class:`CurriculumError` naming ``where``
        (the file) and the field otherwise."""

        def fail(field_name: str, problem: str) -> CurriculumError:
            return CurriculumError(f"{where}: {field_name} {problem}")

        if not isinstance(document, dict):
            raise fail("top level", f"must be a JSON object, got {type(document).__name__}")
        if document.get("schema_version") != CURRICULUM_SCHEMA_VERSION:
            raise fail(
                "'schema_version'",
                f"is {document.get('schema_version')!r}; this reader understands {CURRICULUM_SCHEMA_VERSION!r}",
            )
        unknown = sorted(set(document) - _TOP_KEYS)
        if unknown:
            raise fail("top level", f"has unknown keys {unknown}")
        missing = [key for key in (*_CORE_KEYS, "state_id") if key not in document]
        if missing:
            raise fail("top level", f"lacks {missing}")
        round_id, seed = document["round_id"], document["seed"]
        if not isinstance(round_id, str) or not round_id.strip():
            raise fail("'round_id'", f"must be a non-empty string, got {round_id!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise fail("'seed'", f"must be an integer, got {seed!r}")
        q = _probability(document["skill_free_probability"], lambda p: fail("'skill_free_probability'", p))
        raw_chunks = document["chunks"]
        if not isinstance(raw_chunks, list):
            raise fail("'chunks'", f"must be a list, got {type(raw_chunks).__name__}")
        chunks: list[CurriculumChunk] = []
        for index, record in enumerate(raw_chunks):
            chunks.append(_chunk(record, lambda name, problem, i=index: fail(f"chunks[{i}]{name}", problem)))
        seen: set[str] = set()
        for index, chunk in enumerate(chunks):
            if chunk.skill_id in seen:
                raise fail(f"chunks[{index}].skill_id", f"{chunk.skill_id!r} appears twice")
            seen.add(chunk.skill_id)
        source = document["source"]
        if not isinstance(source, dict):
            raise fail("'source'", "must be an object")
        for key in ("skillbank_path", "skillbank_sha256"):
            if not isinstance(source.get(key), str) or not source[key]:
                raise fail(f"source.{key}", f"must be a non-empty string, got {source.get(key)!r}")
        if not isinstance(source.get("probability_mapping"), dict):
            raise fail("source.probability_mapping", "must be an object")
        stored = document["state_id"]
        if not isinstance(stored, str) or not stored:
            raise fail("'state_id'", f"must be a non-empty string, got {stored!r}")
        try:
            if stored == state_id_of(document):
                rule = CONTENT_RULE
            elif stored == earlier_state_id(document):
                rule = EARLIER_RULE
            else:
                raise fail(
                    "'state_id'",
                    f"{stored} matches neither its content ({state_id_of(document)}) nor the earlier "
                    "path-bound rule: the file was edited after it was written; build a new state instead",
                )
        except (TypeError, ValueError) as exc:
            if isinstance(exc, CurriculumError):
                raise
            raise fail("top level", f"is not canonical JSON ({exc})") from None
        return cls(
            state_id=stored,
            round_id=round_id,
            seed=seed,
            skill_free_probability=q,
            chunks=tuple(chunks),
            source=dict(source),
            rule=rule,
            document=document,
        )

    def draw(self, group_key: int | str, treatment: str) -> float:
        return draw(self.seed, self.state_id, _group_key(group_key), treatment)

    def assign(self, group_key: int | str) -> SkillAssignment:
        """The group's skills: skill-free with probability q, else each chunk with its rho."""
        key = _group_key(group_key)
        if self.draw(key, "skill-free") < self.skill_free_probability:
            return self._assignment(key, "skill_free", ())
        chosen = tuple(chunk for chunk in self.chunks if self.draw(key, f"chunk:{chunk.skill_id}") < chunk.inclusion_probability)
        return self._assignment(key, "assisted" if chosen else "assisted_empty", chosen)

    def _assignment(self, key: str, mode: Mode, chunks: tuple[CurriculumChunk, ...]) -> SkillAssignment:
        rho = tuple((chunk.skill_id, chunk.inclusion_probability) for chunk in self.chunks)
        return SkillAssignment(self.state_id, key, mode, chunks, self.skill_free_probability, rho)

    def skills_for(self, group_key: int | str) -> CurriculumSkills:
        return CurriculumSkills(self.assign(group_key), round_id=self.round_id)

    def full_skills(self, group_key: int | str = "all") -> CurriculumSkills:
        """Every chunk (mode ``full``): a failed group replayed with the whole curriculum."""
        return CurriculumSkills(self._assignment(_group_key(group_key), "full", self.chunks), round_id=self.round_id)

    def identity(self) -> dict[str, Any]:
        return {
            "schema_version": CURRICULUM_SCHEMA_VERSION,
            "state_id": self.state_id,
            "state_id_rule": self.rule,
            "round_id": self.round_id,
            "seed": self.seed,
            "skill_free_probability": self.skill_free_probability,
            "chunk_ids": [chunk.skill_id for chunk in self.chunks],
            "skillbank_path": self.source["skillbank_path"],
            "skillbank_sha256": self.source["skillbank_sha256"],
        }


def _group_key(value: int | str) -> str:
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise CurriculumError(f"a group key is slime's group_index (an integer) or a string, got {value!r}")
    return str(value)


def _probability(value: Any, fail: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or not 0.0 <= value <= 1.0:
        raise fail(f"must be a number in [0, 1], got {value!r}")
    return float(value)


def _chunk(record: Any, fail: Any) -> CurriculumChunk:
    if not isinstance(record, dict):
        raise fail("", f"must be an object, got {type(record).__name__}")
    if set(record) != _CHUNK_KEYS:
        raise fail("", f"must have exactly the keys {sorted(_CHUNK_KEYS)}, got {sorted(record)}")
    skill_id, version, content, metadata = record["skill_id"], record["version"], record["content"], record["metadata"]
    if not isinstance(skill_id, str) or not skill_id.strip():
        raise fail(".skill_id", f"must be a non-empty string, got {skill_id!r}")
    label = f" ({skill_id!r})"
    if not isinstance(version, str) or not version.strip():
        raise fail(f"{label}.version", f"must be a non-empty string, got {version!r}")
    if not isinstance(content, str) or not content.strip():
        raise fail(f"{label}.content", "must be a non-blank string")
    if not isinstance(metadata, dict):
        raise fail(f"{label}.metadata", "must be an object")
    contribution = record["contribution"]
    if (
        isinstance(contribution, bool)
        or not isinstance(contribution, int | float)
        or not math.isfinite(contribution)
        or contribution <= 0
    ):
        raise fail(f"{label}.contribution", f"must be a finite positive number, got {contribution!r}")
    rho = _probability(record["inclusion_probability"], lambda problem: fail(f"{label}.inclusion_probability", problem))
    return CurriculumChunk(skill_id, version, content, dict(metadata), float(contribution), rho)


def load_curriculum(path: str | Path) -> SkillCurriculum:
    """Read and check a state file (module docstring); :class:`CurriculumError` naming it otherwise."""
    path = Path(path)
    document = _read_json(path, "curriculum state")
    return SkillCurriculum.from_document(document, where=f"curriculum state {path}")


def _read_json(path: Path, what: str) -> Any:
    return read_json_file(path, what, CurriculumError)


# --------------------------------------------------------------------------- building


@dataclass(frozen=True)
class _Bank:
    path: Path
    sha256: str
    records: list[tuple[int, dict[str, Any]]]
    """The enabled records as written, in file order, each with its index in ``skills``."""


def _read_bank(path: Path) -> _Bank:
    """The bank's enabled records as written (no ``selection_scope`` added) and its digest, checked
    by the skill bank reader so a bank evaluation refuses is refused here too."""
    document = _read_json(path, "skill bank")
    try:
        bank = JsonSkillBank(path, document=document)
    except SkillBankError as exc:
        raise CurriculumError(str(exc)) from None
    if bank.snapshot_id is not None:  # a skill bank snapshot: its records are those of the bank it carries
        document = document["bank"]
    records = [(index, record) for index, record in enumerate(document["skills"]) if record.get("enabled", True) is not False]
    return _Bank(path=path, sha256=bank.identity()["bank_sha256"], records=records)


def _effects(bank: _Bank) -> list[tuple[dict[str, Any], float]]:
    found = []
    for index, record in bank.records:
        where = f"skill bank {bank.path}: skills[{index}] ({record['skill_id']!r})"
        if record.get("task_ids") is not None:
            # A group's chunks go to whatever task the group plays: a task-scoped skill would leak.
            raise CurriculumError(f"{where} is task-scoped (task_ids); a curriculum gives its chunks to every task")
        effect = (record.get("metadata") or {}).get("estimated_effect")
        if isinstance(effect, bool) or not isinstance(effect, int | float):
            raise CurriculumError(
                f"{where} has no numeric metadata.estimated_effect (got {effect!r}): build a curriculum from the bank a "
                f"skill gate selected (selected_skillbank.json), not from a draft bank"
            )
        if not math.isfinite(effect) or effect <= 0:
            raise CurriculumError(f"{where}: metadata.estimated_effect must be finite and positive, got {effect!r}")
        found.append((record, float(effect)))
    return found


def build_curriculum_state(
    bank_path: str | Path,
    *,
    round_id: str,
    seed: int = DEFAULT_SEED,
    skill_free_probability: float,
    rho_min: float,
    rho_max: float,
    contribution_scale: float | None = None,
    created_at: str | None = None,
) -> dict[str, Any]:
    """The state document of a gate-selected bank (module docstring), checked as a loaded one is."""
    q = _probability(skill_free_probability, lambda p: CurriculumError(f"skill_free_probability {p}"))
    lower = _probability(rho_min, lambda p: CurriculumError(f"rho_min {p}"))
    upper = _probability(rho_max, lambda p: CurriculumError(f"rho_max {p}"))
    if lower > upper:
        raise CurriculumError(f"rho_min ({lower}) is greater than rho_max ({upper})")
    if not isinstance(round_id, str) or not round_id.strip():
        raise CurriculumError(f"round_id must be a non-empty string, got {round_id!r}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise CurriculumError(f"seed must be an integer, got {seed!r}")
    path = Path(bank_path)
    bank = _read_bank(path)
    effects = _effects(bank)
    if contribution_scale is None:
        scale = max((effect for _, effect in effects), default=1.0)
    else:
        if isinstance(contribution_scale, bool) or not isinstance(contribution_scale, int | float):
            raise CurriculumError(f"contribution_scale must be a number, got {contribution_scale!r}")
        scale = float(contribution_scale)
    if not math.isfinite(scale) or scale <= 0:
        raise CurriculumError(f"contribution_scale must be finite and positive, got {scale!r}")
    chunks = [
        {
            "skill_id": record["skill_id"],
            "version": str(record.get("version", "1")),
            "content": record["content"],
            "metadata": dict(record.get("metadata") or {}),
            "contribution": effect,
            "inclusion_probability": min(upper, max(lower, lower + (upper - lower) * effect / scale)),
        }
        for record, effect in effects
    ]
    document: dict[str, Any] = {
        "schema_version": CURRICULUM_SCHEMA_VERSION,
        "created_at": created_at or datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        "round_id": round_id,
        "seed": seed,
        "skill_free_probability": q,
        "chunks": chunks,
        "source": {
            "skillbank_path": str(path.resolve()),
            "skillbank_sha256": bank.sha256,
            "probability_mapping": {
                "name": PROBABILITY_MAPPING,
                "rho_min": lower,
                "rho_max": upper,
                "contribution_scale": scale,
                "scale_source": "largest_active_contribution" if contribution_scale is None else "explicit",
            },
        },
    }
    document["state_id"] = state_id_of(document)
    SkillCurriculum.from_document(document, where=f"curriculum of {path}")
    return document


def check_against_bank(curriculum: SkillCurriculum, bank_path: str | Path, *, where: str = "curriculum") -> None:
    """The bank the state was built from: the same digest, and its enabled records are the
    state's chunks (id, version, content, contribution = estimated effect, in order)."""
    bank = _read_bank(Path(bank_path))
    recorded = curriculum.source["skillbank_sha256"]
    if bank.sha256 != recorded:
        raise CurriculumError(
            f"{where} was built from a skill bank with sha256 {recorded} ({curriculum.source['skillbank_path']}); "
            f"{bank.path} has sha256 {bank.sha256}: point curriculum.skillbank at that bank, or build a new state"
        )
    expected = [
        (
            record["skill_id"],
            str(record.get("version", "1")),
            record["content"],
            (record.get("metadata") or {}).get("estimated_effect"),
        )
        for _, record in bank.records
    ]
    found = [(c.skill_id, c.version, c.content, c.contribution) for c in curriculum.chunks]
    if len(expected) != len(found):
        raise CurriculumError(f"{where} has {len(found)} chunks; {bank.path} has {len(expected)} enabled records")
    for index, (want, got) in enumerate(zip(expected, found, strict=True)):
        for name, a, b in zip(("skill_id", "version", "content", "contribution"), want, got, strict=True):
            if a != b:
                raise CurriculumError(
                    f"{where}: chunks[{index}].{name} is {b!r}; the bank's enabled record {index} ({want[0]!r}) has "
                    f"{'metadata.estimated_effect' if name == 'contribution' else name} {a!r}"
                )


def open_curriculum(state: str | Path, skillbank: str | Path) -> SkillCurriculum:
    """A state file checked against the bank it names (:func:`check_against_bank`)."""
    curriculum = load_curriculum(state)
    check_against_bank(curriculum, skillbank, where=f"curriculum state {state}")
    return curriculum


# --------------------------------------------------------------------------- writing


def write_curriculum_state(path: str | Path, document: Mapping[str, Any]) -> tuple[SkillCurriculum, bool]:
    """Write the state to ``path`` whole or not at all, never replacing another state: returns the
    state at ``path`` and whether it was written now (False: the same state was already there,
    left as it is). :class:`CurriculumError` when ``path`` holds a different state or anything else."""
    path = Path(path)
    state = SkillCurriculum.from_document(dict(document), where=f"curriculum state for {path}")
    if state.rule != CONTENT_RULE:
        raise CurriculumError(f"curriculum state for {path}: new states use the content-addressed state id")
    data = (json.dumps(document, ensure_ascii=False, indent=2, allow_nan=False) + "\n").encode("utf-8")
    if _create_only(path, data):
        return state, True
    try:
        existing = load_curriculum(path)
    except CurriculumError as exc:
        raise CurriculumError(f"{path} exists and is not a curriculum state ({exc}); a state is never overwritten") from None
    if existing.state_id != state.state_id:
        raise CurriculumError(
            f"{path} already holds curriculum state {existing.state_id}; this is state {state.state_id}. A state is "
            f"never overwritten (rollouts may have drawn from it): write the new one to another file"
        )
    return existing, False


def _create_only(path: Path, data: bytes) -> bool:
    """``path`` created with ``data`` (complete and fsynced before its name appears); False if it exists."""
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "xb") as handle:
            handle.write(data)
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(tmp, path)
        except FileExistsError:
            return False
    except OSError as exc:
        raise RunWriteError(path, exc) from exc
    finally:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    with contextlib.suppress(OSError):
        fd = os.open(path.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return True
