"""The chunks a gate measures: a Gate A draft (1–16 ordered chunks) or an online candidate pool.

Gate A reads the earlier implementation's pair of files: ``initial_skill_draft.json``
(``shopsimrl-initial-skill-draft-v2``: ``chunks`` with ``chunk_id``, ``order`` 1…n, ``title``;
``active_skill_budget``, ``skill_title``) and the draft skill bank beside it
(``shopsimrl-skillbank-v1`` holding the same ids in the same order, every one global and marked
``metadata.draft_only: true``). ``draft_path`` may instead name a skill bank snapshot
(``shopsimrl skills snapshot``, ``shopsimrl-skillbank-snapshot-v1``) of a draft: its content
address is checked, and it carries both the draft of its enabled (accepted) chunks and their bank,
so the bank path is not read.

The online gate reads a candidate pool (``shopsimrl-skill-candidate-pool-v1``: ``current_skills``,
``candidates`` with ``candidate_id``, ``operation`` ADD or REWRITE, ``target_chunk_id`` for a
REWRITE, ``content``; ``pool_sha256`` over everything but itself and ``created_at``) and lays it
out in slots: one per current chunk with its REWRITE candidates (sorted by id) as further
versions, then one per ADD candidate (sorted by id). The columns are the versions, slot by slot.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeGuard

from shopsimrl.research.gate.masks import Slot
from shopsimrl.schemas import fingerprint, read_json_file
from shopsimrl.skills import SNAPSHOT_SCHEMA_VERSION, JsonSkillBank, SkillBankError, unwrap_snapshot

__all__ = [
    "CANDIDATE_POOL_SCHEMA_VERSION",
    "DRAFT_SCHEMA_VERSION",
    "MAX_CHUNKS",
    "Chunk",
    "DraftError",
    "GateADraft",
    "OnlinePool",
    "load_candidate_pool",
    "load_gate_a_draft",
]

DRAFT_SCHEMA_VERSION: Final = "shopsimrl-initial-skill-draft-v2"
CANDIDATE_POOL_SCHEMA_VERSION: Final = "shopsimrl-skill-candidate-pool-v1"
MAX_CHUNKS: Final = 16


class DraftError(ValueError):
    """A draft, draft bank or candidate pool that cannot be gated (exit 2); names file and field."""


@dataclass(frozen=True)
class Chunk:
    """One column of the gate: a chunk (or a version of one) as it is injected."""

    chunk_id: str
    content: str
    version: str
    metadata: dict[str, Any]
    title: str | None = None
    order: int = 0
    """Gate A: its place in the draft (1…n). Online: its family's place (current chunks first)."""
    kind: str = "draft"
    """``draft``; online: ``current`` or ``candidate``."""
    logical_chunk_id: str | None = None
    operation: str | None = None
    """Online: ``ADD`` or ``REWRITE`` for a candidate, None for a current chunk."""

    def bank_record(self) -> dict[str, Any]:
        """Its record in the assignment file the masked rollouts run with."""
        return {"skill_id": self.chunk_id, "content": self.content, "version": self.version, "metadata": self.metadata}


@dataclass(frozen=True)
class GateADraft:
    draft: dict[str, Any]
    sha256: str
    chunks: list[Chunk]
    budget: int
    history: list[dict[str, Any]] = field(default_factory=list)
    """The proposal ledger beside the draft, if any."""
    snapshot_id: str | None = None
    """Read from a skill bank snapshot: its content address (recorded in the gate's protocol)."""

    @property
    def chunk_ids(self) -> list[str]:
        return [chunk.chunk_id for chunk in self.chunks]


@dataclass(frozen=True)
class OnlinePool:
    pool: dict[str, Any]
    sha256: str
    slots: list[Slot]
    chunks: list[Chunk]
    """Every version, in column order."""
    history: list[dict[str, Any]] = field(default_factory=list)
    """The proposal ledger beside the pool, if any (earlier rounds' rows)."""

    @property
    def columns(self) -> list[str]:
        return [chunk.chunk_id for chunk in self.chunks]


def _read(path: Path, what: str) -> Any:
    if not path.exists():
        raise DraftError(f"{what} {path} does not exist")
    return read_json_file(path, what, DraftError)


def load_gate_a_draft(draft_path: Path, bank_path: Path, budget: int | None) -> GateADraft:
    draft = _read(draft_path, "the skill draft")
    bank_document: Any = None
    snapshot_id = None
    if isinstance(draft, dict) and draft.get("schema_version") == SNAPSHOT_SCHEMA_VERSION:
        try:
            bank_document = unwrap_snapshot(draft_path, draft)
        except SkillBankError as exc:
            raise DraftError(str(exc)) from None
        if draft.get("stage") != "draft" or not isinstance(draft.get("draft"), dict):
            raise DraftError(
                f"{draft_path}: a snapshot of stage {draft.get('stage')!r} holds no draft; Gate A measures a snapshot "
                "frozen from a draft (`skills snapshot DRAFT_DIR` without --selected)"
            )
        snapshot_id, draft, bank_path = str(draft["snapshot_id"]), draft["draft"], draft_path
    if not isinstance(draft, dict) or draft.get("schema_version") != DRAFT_SCHEMA_VERSION:
        version = draft.get("schema_version") if isinstance(draft, dict) else None
        raise DraftError(f"{draft_path}: schema_version is {version!r}; Gate A reads a {DRAFT_SCHEMA_VERSION} draft")
    chunks = draft.get("chunks")
    if not isinstance(chunks, list) or not 1 <= len(chunks) <= MAX_CHUNKS:
        raise DraftError(f"{draft_path}: 'chunks' must list 1 to {MAX_CHUNKS} chunks")
    ids: list[str] = []
    for index, chunk in enumerate(chunks):
        chunk_id = chunk.get("chunk_id") if isinstance(chunk, dict) else None
        if not isinstance(chunk_id, str) or not chunk_id.strip() or chunk_id in ids:
            raise DraftError(
                f"{draft_path}: chunks[{index}].chunk_id must be a non-empty string not used before, got {chunk_id!r}"
            )
        if chunk.get("order") != index + 1:
            raise DraftError(f"{draft_path}: chunks[{index}].order must be {index + 1} (contiguous, in list order)")
        ids.append(chunk_id)
    try:
        bank = JsonSkillBank(bank_path, document=bank_document)
    except SkillBankError as exc:
        raise DraftError(str(exc)) from None
    entries = bank.entries
    if [skill.skill_id for skill, _ in entries] != ids:
        raise DraftError(
            f"{bank_path}: the enabled skills {[skill.skill_id for skill, _ in entries]} must be the draft's chunks {ids}, in order"
        )
    for skill, task_ids in entries:
        if task_ids is not None:
            raise DraftError(f"{bank_path}: skill {skill.skill_id!r} is task-scoped; a draft chunk is global")
        if skill.metadata.get("draft_only") is not True:
            raise DraftError(f"{bank_path}: skill {skill.skill_id!r} needs metadata.draft_only: true (it is a draft chunk)")
    draft_budget = draft.get("active_skill_budget")
    if budget is None:
        if isinstance(draft_budget, bool) or not isinstance(draft_budget, int):
            raise DraftError(f"{draft_path}: no active_skill_budget; set gate_a.active_skill_budget")
        budget = draft_budget
    elif draft_budget is not None and draft_budget != budget:
        raise DraftError(f"gate_a.active_skill_budget is {budget} but the draft {draft_path} froze {draft_budget}")
    if not 1 <= budget <= len(ids):
        raise DraftError(f"the active skill budget must be between 1 and {len(ids)} (the chunk count), got {budget}")
    columns = [
        Chunk(
            chunk_id=skill.skill_id,
            content=skill.content,
            version=skill.version,
            metadata={k: v for k, v in skill.metadata.items() if k != "selection_scope"},
            title=chunk.get("title"),
            order=index + 1,
        )
        for index, ((skill, _), chunk) in enumerate(zip(entries, chunks, strict=True))
    ]
    ledger = _ledger(draft_path.with_name("proposal_ledger.jsonl"))
    return GateADraft(draft, fingerprint(draft), columns, budget, ledger, snapshot_id)


# --------------------------------------------------------------------------- the online pool


def _text(value: Any) -> TypeGuard[str]:
    return isinstance(value, str) and bool(value.strip())


def load_candidate_pool(path: Path) -> OnlinePool:
    pool = _read(path, "the candidate pool")
    if not isinstance(pool, dict) or pool.get("schema_version") != CANDIDATE_POOL_SCHEMA_VERSION:
        raise DraftError(f"{path}: not a {CANDIDATE_POOL_SCHEMA_VERSION} candidate pool")
    expected = fingerprint({k: v for k, v in pool.items() if k not in ("created_at", "pool_sha256")})
    if pool.get("pool_sha256") != expected:
        raise DraftError(f"{path}: pool_sha256 does not match the pool's contents (edited after it was built?)")
    current, candidates = pool.get("current_skills"), pool.get("candidates")
    if not isinstance(current, list) or not isinstance(candidates, list):
        raise DraftError(f"{path}: 'current_skills' and 'candidates' must be lists")

    current_ids: list[str] = []
    for index, record in enumerate(current):
        skill_id = record.get("skill_id") if isinstance(record, dict) else None
        if not _text(skill_id) or skill_id in current_ids:
            raise DraftError(f"{path}: current_skills[{index}].skill_id must be a non-empty string not used before")
        if not _text(record.get("content")):
            raise DraftError(f"{path}: current_skills[{index}] ({skill_id!r}) has empty content")
        current_ids.append(skill_id)
    rewrites: dict[str, list[dict[str, Any]]] = {}
    additions: list[dict[str, Any]] = []
    seen: set[str] = set()
    for index, candidate in enumerate(candidates):
        where = f"{path}: candidates[{index}]"
        candidate_id = candidate.get("candidate_id") if isinstance(candidate, dict) else None
        if not _text(candidate_id) or candidate_id in seen or candidate_id in current_ids:
            raise DraftError(f"{where}.candidate_id must be a non-empty string, unique, and not a current skill's id")
        seen.add(candidate_id)
        if not _text(candidate.get("content")):
            raise DraftError(f"{where} ({candidate_id!r}) has empty content")
        operation, target = candidate.get("operation"), candidate.get("target_chunk_id")
        if operation == "ADD" and target in (None, ""):
            additions.append(candidate)
        elif operation == "REWRITE" and target in current_ids:
            rewrites.setdefault(target, []).append(candidate)
        elif operation == "ADD":
            raise DraftError(f"{where} ({candidate_id!r}): an ADD candidate has no target_chunk_id")
        elif operation == "REWRITE":
            raise DraftError(f"{where} ({candidate_id!r}): target_chunk_id {target!r} is not a current skill")
        else:
            raise DraftError(f"{where} ({candidate_id!r}): operation must be ADD or REWRITE, got {operation!r}")

    slots: list[Slot] = []
    chunks: list[Chunk] = []
    for order, record in enumerate(current, 1):
        old_id = record["skill_id"]
        family = sorted(rewrites.get(old_id, []), key=lambda c: c["candidate_id"])
        chunks.append(
            Chunk(
                old_id,
                record["content"],
                str(record.get("version", "1")),
                dict(record.get("metadata") or {}),
                order=order,
                kind="current",
                logical_chunk_id=old_id,
            )
        )
        for candidate in family:
            metadata = {**dict(candidate.get("metadata") or {}), "operation": "REWRITE", "target_chunk_id": old_id}
            chunks.append(_candidate(candidate, metadata, order, old_id, "REWRITE"))
        slots.append(Slot(old_id, (old_id, *(c["candidate_id"] for c in family)), old_id))
    for order, candidate in enumerate(sorted(additions, key=lambda c: c["candidate_id"]), len(current) + 1):
        metadata = {**dict(candidate.get("metadata") or {}), "operation": "ADD"}
        chunks.append(_candidate(candidate, metadata, order, candidate["candidate_id"], "ADD"))
        slots.append(Slot(candidate["candidate_id"], (candidate["candidate_id"],), None))
    if not chunks:
        raise DraftError(f"{path}: the pool holds no current skill and no candidate")
    return OnlinePool(pool, pool["pool_sha256"], slots, chunks, _ledger(path.with_name("proposal_ledger.jsonl")))


def _candidate(candidate: dict[str, Any], metadata: dict[str, Any], order: int, logical: str, operation: str) -> Chunk:
    return Chunk(
        candidate["candidate_id"],
        candidate["content"],
        str(candidate.get("version", "candidate")),
        metadata,
        order=order,
        kind="candidate",
        logical_chunk_id=logical,
        operation=operation,
    )


def _ledger(path: Path) -> list[dict[str, Any]]:
    if not path.is_file():
        return []
    rows = []
    for number, line in enumerate(path.read_bytes().decode("utf-8", errors="replace").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise DraftError(f"{path}:{number}: the proposal ledger line is not JSON") from None
        if not isinstance(row, dict):
            raise DraftError(f"{path}:{number}: a proposal ledger row must be an object")
        rows.append(row)
    return rows
