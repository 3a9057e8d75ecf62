"""Review of a compiled draft and the immutable skill bank snapshot frozen from it.

``review``: decisions on a draft's chunks (accepted or rejected, with a reviewer, a note and the
time) appended to ``skill_review.jsonl`` in the draft's folder. Each row is bound to the draft
(its fingerprint) and to the chunk's rendered content (its sha256), so a decision never carries
over to a rebuilt draft whose chunk changed; the latest row of a chunk wins.

``freeze_snapshot``: ``skillbank.snapshot.json`` (``shopsimrl-skillbank-snapshot-v1``), every chunk
with its evidence (card ids, episode/step references from ``evidence_cards.jsonl``), dedup
clusters, review and leakage status, the builder's models and prompt/tool hashes, and a
``shopsimrl-skillbank-v1`` bank of the accepted chunks (what the readers use). Its ``snapshot_id``
is the sha256 of its canonical content; the file is written once: the same content again is a
no-op, different content at the same path is refused. Without ``selected`` it freezes the draft
for Gate A (``stage: draft``: the bank's records are ``draft_only`` and ``draft`` holds the
accepted chunks as a Gate A draft); with a gate's ``selected_skillbank.json`` it freezes the
selected chunks (``stage: selected``, their estimated effects kept: what a curriculum reads).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import yaml

from shopsimrl.research.skills.analyst import CARDS_NAME, SUMMARY_NAME, SkillInputError
from shopsimrl.research.skills.compile import BANK_NAME, DRAFT_NAME, MANIFEST_NAME
from shopsimrl.research.skills.consolidate import CONSOLIDATION_SUMMARY_NAME
from shopsimrl.research.skills.firewall import firewall_findings
from shopsimrl.schemas import fingerprint, read_json_file, sha256_hex
from shopsimrl.skills import SKILLBANK_SCHEMA_VERSION, SNAPSHOT_SCHEMA_VERSION, JsonSkillBank, SkillBankError, snapshot_id_of

__all__ = [
    "REVIEW_NAME",
    "REVIEW_VERSION",
    "SNAPSHOT_NAME",
    "SnapshotConflictError",
    "SnapshotResult",
    "build_snapshot",
    "freeze_snapshot",
    "load_review_file",
    "review",
    "review_status",
]

REVIEW_NAME: Final = "skill_review.jsonl"
REVIEW_VERSION: Final = "shopsimrl-skill-review-v1"
SNAPSHOT_NAME: Final = "skillbank.snapshot.json"


class SnapshotConflictError(SkillInputError):
    """A different snapshot already lies at the path (exit 2): snapshots are never overwritten."""


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z")


def _read_json(path: Path, what: str) -> Any:
    # Checked first so a missing file keeps its hint on how to make it.
    if not path.exists():
        raise SkillInputError(f"{path}: no such {what} (run `shopsimrl skills build` first)")
    return read_json_file(path, what, SkillInputError)


@dataclass(frozen=True)
class _Draft:
    directory: Path
    draft: dict[str, Any]
    fingerprint: str
    contents: dict[str, str]
    """chunk id → its rendered content in the draft bank."""


def _load_draft(directory: Path) -> _Draft:
    draft = _read_json(directory / DRAFT_NAME, "skill draft")
    chunks = draft.get("chunks") if isinstance(draft, dict) else None
    if not isinstance(chunks, list) or not chunks:
        raise SkillInputError(f"{directory / DRAFT_NAME}: 'chunks' must be a non-empty list")
    try:
        bank = JsonSkillBank(directory / BANK_NAME)
    except SkillBankError as exc:
        raise SkillInputError(str(exc)) from None
    contents = {skill.skill_id: skill.content for skill, _ in bank.entries}
    ids = [chunk.get("chunk_id") for chunk in chunks]
    if list(contents) != ids:
        raise SkillInputError(f"{directory / BANK_NAME}: its skills {list(contents)} are not the draft's chunks {ids}")
    return _Draft(directory, draft, fingerprint(draft), contents)


# --------------------------------------------------------------------------- review


def load_review_file(path: Path) -> tuple[str, list[tuple[str, str, str]]]:
    """A review YAML: ``reviewer``, ``decisions: [{chunk_id, decision: accept|reject, note}]``;
    returns the reviewer and (chunk id, accepted|rejected, note) per decision."""
    try:
        data = yaml.safe_load(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise SkillInputError(f"{path}: no such review file") from None
    except (UnicodeDecodeError, yaml.YAMLError) as exc:
        raise SkillInputError(f"{path}: not a readable YAML file: {exc}") from None
    if not isinstance(data, dict) or set(data) - {"reviewer", "decisions"}:
        raise SkillInputError(f"{path}: a review file holds 'reviewer' and 'decisions' only")
    reviewer, decisions = data.get("reviewer"), data.get("decisions")
    if not isinstance(reviewer, str) or not reviewer.strip():
        raise SkillInputError(f"{path}: reviewer: required, a non-blank string")
    if not isinstance(decisions, list) or not decisions:
        raise SkillInputError(f"{path}: decisions: required, a non-empty list")
    found = []
    for index, item in enumerate(decisions):
        where = f"{path}: decisions[{index}]"
        if not isinstance(item, dict) or set(item) - {"chunk_id", "decision", "note"}:
            raise SkillInputError(f"{where}: an object with chunk_id, decision and note only")
        chunk_id, decision, note = item.get("chunk_id"), item.get("decision"), item.get("note", "")
        if not isinstance(chunk_id, str) or not chunk_id.strip():
            raise SkillInputError(f"{where}.chunk_id: required, a non-blank string")
        if decision not in ("accept", "reject"):
            raise SkillInputError(f"{where}.decision: must be accept or reject, got {decision!r}")
        if not isinstance(note, str):
            raise SkillInputError(f"{where}.note: must be a string")
        found.append((chunk_id, "accepted" if decision == "accept" else "rejected", note))
    return reviewer, found


def review(
    directory: Path,
    decisions: Sequence[tuple[str, str, str]],
    reviewer: str,
    *,
    reviewed_at: str | None = None,
) -> list[dict[str, Any]]:
    """Append ``decisions`` ((chunk id, ``accepted``/``rejected``, note)) by ``reviewer`` to the
    draft folder's review log; every chunk id is checked against the draft first (all or nothing)."""
    draft = _load_draft(directory)
    if not reviewer.strip():
        raise SkillInputError("--reviewer: required, a non-blank name")
    if not decisions:
        raise SkillInputError("nothing to review: give --accept or --reject chunk ids, or --file REVIEW.yaml")
    seen: dict[str, str] = {}
    for chunk_id, decision, _note in decisions:
        if chunk_id not in draft.contents:
            raise SkillInputError(f"{directory / DRAFT_NAME}: no chunk {chunk_id!r}; its chunks are {', '.join(draft.contents)}")
        if seen.get(chunk_id, decision) != decision:
            raise SkillInputError(f"chunk {chunk_id!r} is both accepted and rejected in one review")
        seen[chunk_id] = decision
    when = reviewed_at or _now()
    rows = [
        {
            "review_version": REVIEW_VERSION,
            "chunk_id": chunk_id,
            "decision": decision,
            "reviewer": reviewer,
            "note": note,
            "reviewed_at": when,
            "draft_fingerprint": draft.fingerprint,
            "content_sha256": sha256_hex(draft.contents[chunk_id]),
        }
        for chunk_id, decision, note in decisions
    ]
    path = directory / REVIEW_NAME
    _cut_torn_tail(path)
    handle = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        os.write(handle, "".join(json.dumps(row, ensure_ascii=False) + "\n" for row in rows).encode("utf-8"))
        os.fsync(handle)
    finally:
        os.close(handle)
    return rows


def _cut_torn_tail(path: Path) -> None:
    if path.exists():
        data = path.read_bytes()
        if data and not data.endswith(b"\n"):
            os.truncate(path, data.rfind(b"\n") + 1)


def review_status(directory: Path) -> dict[str, dict[str, Any]]:
    """chunk id → its review (``status`` accepted/rejected/unreviewed, reviewer, note, time) for
    the draft as it is now: rows of another draft or another content of the chunk do not count."""
    draft = _load_draft(directory)
    status: dict[str, dict[str, Any]] = {
        chunk_id: {"status": "unreviewed", "reviewer": None, "note": None, "reviewed_at": None} for chunk_id in draft.contents
    }
    path = directory / REVIEW_NAME
    if not path.exists():
        return status
    lines = path.read_bytes().split(b"\n")
    for number, raw in enumerate(lines, start=1):
        if not raw.strip() or number == len(lines):  # the last piece has no newline: torn, or empty
            continue
        try:
            row = json.loads(raw)
        except json.JSONDecodeError:
            raise SkillInputError(f"{path}:{number}: the review log line is not JSON") from None
        if not isinstance(row, dict) or row.get("review_version") != REVIEW_VERSION:
            raise SkillInputError(f"{path}:{number}: not a review row ({REVIEW_VERSION})")
        chunk_id = row.get("chunk_id")
        if (
            row.get("draft_fingerprint") == draft.fingerprint
            and chunk_id in draft.contents
            and row.get("content_sha256") == sha256_hex(draft.contents[chunk_id])
        ):
            status[chunk_id] = {
                "status": row["decision"],
                "reviewer": row["reviewer"],
                "note": row["note"],
                "reviewed_at": row["reviewed_at"],
            }
    return status


# --------------------------------------------------------------------------- snapshot


@dataclass(frozen=True)
class SnapshotResult:
    path: Path
    snapshot: dict[str, Any]
    written: bool
    """False: the same snapshot was already there (a no-op)."""

    @property
    def enabled(self) -> list[str]:
        return [skill["skill_id"] for skill in self.snapshot["bank"]["skills"]]

    @property
    def unreviewed(self) -> list[str]:
        return [s["skill_id"] for s in self.snapshot["skills"] if s["review"]["status"] == "unreviewed"]


def _evidence_refs(directory: Path) -> dict[str, list[dict[str, Any]]]:
    """card id → its episode/step references, from the draft folder's ``evidence_cards.jsonl``."""
    path = directory / CARDS_NAME
    refs: dict[str, list[dict[str, Any]]] = {}
    if not path.exists():
        raise SkillInputError(f"{path}: no such evidence cards file (the draft's cards are frozen with it)")
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), start=1):
        if not line.strip():
            continue
        try:
            card = json.loads(line)
            # A placeholder (an empty answer) cites no steps and has no evidence_refs key.
            cited = [] if card.get("placeholder") is True and "evidence_refs" not in card else card["evidence_refs"]
            refs[card["card_id"]] = [{"episode_id": r["episode_id"], "step": r["step"]} for r in cited]
        except (json.JSONDecodeError, KeyError, TypeError):
            raise SkillInputError(f"{path}:{number}: not an evidence card with card_id and evidence_refs") from None
    return refs


def _builder(directory: Path) -> dict[str, Any]:
    """Who built the draft: each stage's model identity and prompt/tool hashes."""
    manifest = _read_json(directory / MANIFEST_NAME, "compilation manifest")
    if not isinstance(manifest, dict) or manifest.get("status") != "complete":
        raise SkillInputError(f"{directory / MANIFEST_NAME}: the compilation is not complete; nothing to freeze")
    analysis = _read_json(directory / SUMMARY_NAME, "analysis summary")
    consolidation = _read_json(directory / CONSOLIDATION_SUMMARY_NAME, "consolidation summary")

    def stage(summary: Mapping[str, Any], model_key: str) -> dict[str, Any]:
        keys = (model_key, "prompt_sha256", "tool_sha256", "limits")
        return {key: summary.get(key) for key in keys if key in summary}

    return {
        "pipeline_version": manifest.get("pipeline_version"),
        "analyst": stage(analysis, "analyst"),
        "consolidator": stage(consolidation, "consolidator"),
        "compiler": stage(manifest, "compiler"),
        "compilation_input_sha256": manifest.get("compilation_input_sha256"),
        "inputs": manifest.get("inputs") or {},
    }


def _selected(path: Path, draft: _Draft) -> dict[str, dict[str, Any]]:
    """skill id → record of a gate's selected bank; each must be a draft chunk, content unchanged."""
    try:
        bank = JsonSkillBank(path)
    except SkillBankError as exc:
        raise SkillInputError(str(exc)) from None
    document = _read_json(path, "selected skill bank")
    records = {record["skill_id"]: record for record in document["skills"] if record.get("enabled", True) is not False}
    for skill, _ in bank.entries:
        if skill.skill_id not in draft.contents:
            raise SkillInputError(f"{path}: skill {skill.skill_id!r} is no chunk of the draft in {draft.directory}")
        if skill.content != draft.contents[skill.skill_id]:
            raise SkillInputError(f"{path}: skill {skill.skill_id!r} differs from the draft's chunk of that id")
    return records


def build_snapshot(directory: Path, *, selected: Path | None = None) -> dict[str, Any]:
    """The snapshot document of the draft in ``directory`` and its review (module docstring)."""
    draft = _load_draft(directory)
    reviews = review_status(directory)
    refs = _evidence_refs(directory)
    chosen = _selected(selected, draft) if selected is not None else None
    skills: list[dict[str, Any]] = []
    enabled_chunks: list[dict[str, Any]] = []
    records: list[dict[str, Any]] = []
    for chunk in draft.draft["chunks"]:
        chunk_id, content = chunk["chunk_id"], draft.contents[chunk["chunk_id"]]
        cards = list(chunk.get("evidence_card_ids") or [])
        missing = [card for card in cards if card not in refs]
        if missing:
            raise SkillInputError(f"{directory / CARDS_NAME}: chunk {chunk_id!r} cites cards not in it: {missing}")
        findings = firewall_findings(content)
        accepted = reviews[chunk_id]["status"] == "accepted"
        if accepted and findings:
            rules = sorted({finding["rule"] for finding in findings})
            raise SkillInputError(f"chunk {chunk_id!r} is accepted but the firewall finds {rules} in its text")
        enabled = accepted and (chosen is None or chunk_id in chosen)
        skills.append(
            {
                "skill_id": chunk_id,
                "draft_order": chunk["order"],
                "title": chunk.get("title"),
                "workflow_stage": chunk.get("workflow_stage"),
                "content_sha256": sha256_hex(content),
                "enabled": enabled,
                "evidence": {
                    "card_ids": cards,
                    "refs": [{"card_id": card, **ref} for card in cards for ref in refs[card]],
                },
                "dedup_cluster_ids": list(chunk.get("evidence_cluster_ids") or []),
                "review": reviews[chunk_id],
                "leakage": {"status": "findings" if findings else "clean", "findings": findings},
                **({"gate": {"selected": chunk_id in chosen}} if chosen is not None else {}),
            }
        )
        if not enabled:
            continue
        if chosen is not None:
            records.append({**chosen[chunk_id], "enabled": True})
        else:
            order = len(enabled_chunks) + 1
            enabled_chunks.append({**chunk, "order": order})
            metadata = {"draft_only": True, "title": chunk.get("title"), "workflow_stage": chunk.get("workflow_stage")}
            records.append({"skill_id": chunk_id, "content": content, "metadata": metadata})
    if not records:
        why = "no accepted chunk was selected by the gate" if chosen is not None else "no chunk is accepted"
        raise SkillInputError(f"{directory}: {why}; review the draft first (`shopsimrl skills review`)")
    document: dict[str, Any] = {
        "schema_version": SNAPSHOT_SCHEMA_VERSION,
        "stage": "selected" if chosen is not None else "draft",
        "skill_title": draft.draft.get("skill_title"),
        "source": {
            "draft_fingerprint": draft.fingerprint,
            "draft_sha256": sha256_hex((directory / DRAFT_NAME).read_bytes()),
            "draft_skillbank_sha256": sha256_hex((directory / BANK_NAME).read_bytes()),
            "evidence_cards_sha256": sha256_hex((directory / CARDS_NAME).read_bytes()),
            **({"selected_skillbank_sha256": sha256_hex(selected.read_bytes())} if selected is not None else {}),
        },
        "builder": _builder(directory),
        "skills": skills,
        "bank": {
            "schema_version": SKILLBANK_SCHEMA_VERSION,
            "bank_version": "snapshot-selected" if chosen is not None else "snapshot-draft",
            "skills": records,
        },
    }
    if chosen is None:
        budget = draft.draft.get("active_skill_budget")
        document["draft"] = {
            **draft.draft,
            "chunks": enabled_chunks,
            "active_skill_budget": min(budget if isinstance(budget, int) else len(enabled_chunks), len(enabled_chunks)),
        }
    document["snapshot_id"] = snapshot_id_of(document)
    return document


def freeze_snapshot(directory: Path, out: Path | None = None, *, selected: Path | None = None) -> SnapshotResult:
    """Build the snapshot and write it once to ``out`` (default: ``skillbank.snapshot.json`` in
    the draft folder). The same snapshot there already: nothing is written. Another one there:
    :class:`SnapshotConflictError` naming the file."""
    document = build_snapshot(directory, selected=selected)
    path = out or directory / SNAPSHOT_NAME
    data = (json.dumps(document, ensure_ascii=False, indent=2, sort_keys=True) + "\n").encode("utf-8")
    if path.exists():
        try:
            existing = json.loads(path.read_bytes().decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            existing = None
        same = isinstance(existing, dict) and existing.get("snapshot_id") == document["snapshot_id"]
        if same and snapshot_id_of(existing) == document["snapshot_id"]:
            return SnapshotResult(path, existing, written=False)
        raise SnapshotConflictError(
            f"{path} already holds another snapshot; a snapshot is never overwritten "
            f"(this one would be {document['snapshot_id']}): write it elsewhere with --out"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    with tmp.open("wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())
    try:
        os.link(tmp, path)  # fails when another writer got there first: never replaces a snapshot
    except FileExistsError:
        return freeze_snapshot(directory, out, selected=selected)  # the same content is a no-op, else refused
    finally:
        tmp.unlink()
    return SnapshotResult(path, document, written=True)
