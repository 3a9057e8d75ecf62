"""The compiler: the consolidated clusters into one draft skill of at most 16 chunks, written in
the files Gate A reads.

One structured call of ``submit_initial_skill`` (5 attempts; every invalid attempt is kept in
``compiler_invalid_attempts.jsonl``): a ``skill_title`` and at most ``validation_dimension_cap``
chunks, every cluster id exactly once in a chunk's ``evidence_cluster_ids`` or in
``evidence_only_cluster_ids``, no chunk that breaks the firewall. A chunk's id is
``safe_name(title).lower()``, or ``chunk-`` + the first 12 hex digits of the fingerprint of its
title and sorted cluster ids when the title keeps no ASCII; ``-2``, ``-3`` … on a collision.

Outputs, in the earlier implementation's formats:

- ``initial_skill_draft.json`` (``shopsimrl-initial-skill-draft-v2``): the chunks in order with
  their fields and evidence, ``active_skill_budget`` = min(the configured budget, chunks);
- ``initial_skillbank.json`` (``shopsimrl-skillbank-v1``, ``bank_version: draft-1``): one global
  record per chunk, ``metadata.draft_only: true``, its content rendered as
  ``### title / - 适用情形 / - 步骤 1. … / - 验证 / - 避免``;
- ``initial_skill_draft.md``: the skill for people;
- ``proposal_ledger.jsonl``: one ``proposed`` ADD row per chunk (``candidate_id`` = chunk id), which
  the gate carries forward with its verdict;
- ``trace2skill_manifest.json``: status, every input's digest, the compiler's identity, prompt and
  tool digests, limits and every output's digest.

A rerun with the same input (``compilation_input_sha256``) and a complete manifest calls nothing.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Final

import orjson
import structlog

from shopsimrl.config import safe_name
from shopsimrl.model import OpenAICompatibleChatModel, OpenAICompatibleSettings
from shopsimrl.research.outputs import replacing
from shopsimrl.research.skills.analyst import PIPELINE_VERSION, SEED, SkillInputError, append_record, settings_identity
from shopsimrl.research.skills.cards import INITIAL_SKILL_TOOL, InitialSkill, SkillChunk, accounted_once, tool, validate_arguments
from shopsimrl.research.skills.consolidate import BATCHES_NAME, read_batches
from shopsimrl.research.skills.firewall import card_text, firewall_findings
from shopsimrl.research.skills.prompts import COMPILER_PROMPT, prompt_sha256
from shopsimrl.research.skills.structured import COMPILER_ATTEMPTS, structured_call
from shopsimrl.schemas import fingerprint, json_bytes, read_json_file, sha256_hex
from shopsimrl.skills import SKILLBANK_SCHEMA_VERSION

__all__ = [
    "ACTIVE_SKILL_BUDGET",
    "BANK_NAME",
    "DRAFT_BANK_VERSION",
    "DRAFT_NAME",
    "INVALID_ATTEMPTS_NAME",
    "LEDGER_NAME",
    "MANIFEST_NAME",
    "MARKDOWN_NAME",
    "VALIDATION_DIMENSION_CAP",
    "CompilerConfig",
    "chunk_ids",
    "compile_skill",
    "render_chunk",
]

log = structlog.get_logger("shopsimrl.research.skills")

DRAFT_NAME: Final = "initial_skill_draft.json"
BANK_NAME: Final = "initial_skillbank.json"
MARKDOWN_NAME: Final = "initial_skill_draft.md"
LEDGER_NAME: Final = "proposal_ledger.jsonl"
MANIFEST_NAME: Final = "trace2skill_manifest.json"
INVALID_ATTEMPTS_NAME: Final = "compiler_invalid_attempts.jsonl"
DRAFT_SCHEMA_VERSION: Final = "shopsimrl-initial-skill-draft-v2"
MANIFEST_VERSION: Final = "shopsimrl-trace2skill-manifest-v1"
DRAFT_BANK_VERSION: Final = "draft-1"
VALIDATION_DIMENSION_CAP: Final = 16
ACTIVE_SKILL_BUDGET: Final = 10
TOOL_DESCRIPTION: Final = "Submit the compiled skill; every cluster id exactly once, in a chunk or evidence-only."


@dataclass(frozen=True, kw_only=True)
class CompilerConfig:
    model: OpenAICompatibleSettings
    seed: int = SEED
    validation_dimension_cap: int = VALIDATION_DIMENSION_CAP
    active_skill_budget: int = ACTIVE_SKILL_BUDGET
    attempts: int = COMPILER_ATTEMPTS
    proposal_checkpoint: str = "initial"
    """Names the policy the proposals were built for, in every ledger row."""

    def __post_init__(self) -> None:
        if not 1 <= self.validation_dimension_cap <= VALIDATION_DIMENSION_CAP:
            raise SkillInputError(
                f"validation_dimension_cap must be 1 to {VALIDATION_DIMENSION_CAP}, got {self.validation_dimension_cap}"
            )
        if not 1 <= self.active_skill_budget <= self.validation_dimension_cap:
            raise SkillInputError(
                f"active_skill_budget must be 1 to validation_dimension_cap ({self.validation_dimension_cap}), "
                f"got {self.active_skill_budget}"
            )


def chunk_ids(chunks: list[SkillChunk]) -> list[str]:
    """Each chunk's id (module docstring), unique in the list."""
    ids: list[str] = []
    for chunk in chunks:
        base = safe_name(chunk.title).lower()
        if not any(c.isalnum() for c in base):
            base = "chunk-" + fingerprint({"title": chunk.title, "clusters": sorted(chunk.evidence_cluster_ids)})[:12]
        candidate, number = base, 1
        while candidate in ids:
            number += 1
            candidate = f"{base}-{number}"
        ids.append(candidate)
    return ids


def render_chunk(chunk: SkillChunk) -> str:
    """The text a policy reads: title, when it applies, the numbered procedure, the check, the trap."""
    steps = "\n".join(f"   {n}. {step}" for n, step in enumerate(chunk.procedure, start=1))
    return (
        f"### {chunk.title}\n- 适用情形：{chunk.applicable_when}\n- 步骤：\n{steps}\n"
        f"- 验证：{chunk.verification}\n- 避免：{chunk.common_failure}"
    )


def _clusters(output_dir: Path) -> tuple[list[dict[str, Any]], str]:
    """The clusters of every consolidated batch, in batch order, and the batches file's digest."""
    path = output_dir / BATCHES_NAME
    if not path.is_file():
        raise SkillInputError(f"{path}: missing; run the consolidation first")
    summary_path = output_dir / "consolidation_summary.json"
    if summary_path.is_file():
        summary = read_json_file(summary_path, "the consolidation summary", SkillInputError)
        if isinstance(summary, dict) and summary.get("status") != "complete":
            failed = (summary.get("batches") or {}).get("failed_batch_ids")
            raise SkillInputError(
                f"{summary_path}: the consolidation is incomplete (failed batches: {failed}); run it again first"
            )
    batches = read_batches(path)
    clusters = [
        dict(cluster)
        for record in sorted(batches.values(), key=lambda r: (str(r.get("channel")), int(r.get("batch_index") or 0)))
        if record.get("status") == "ok"
        for cluster in record.get("clusters") or []
    ]
    if not clusters:
        raise SkillInputError(f"{path}: no clusters to compile (every card evidence-only, or no batch consolidated)")
    return clusters, sha256_hex(path.read_bytes())


def _shown(cluster: Mapping[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in cluster.items() if key != "evidence_card_ids"}


def _tool(config: CompilerConfig) -> dict[str, Any]:
    return tool(INITIAL_SKILL_TOOL, TOOL_DESCRIPTION, InitialSkill, chunks=config.validation_dimension_cap)


def _validator(ids: list[str], cap: int) -> Any:
    def validate(arguments: dict[str, Any]) -> tuple[Any, str | None]:
        value, problem = validate_arguments(InitialSkill, arguments, chunks=cap)
        if value is None:
            return None, problem
        cited = [cid for chunk in value.chunks for cid in chunk.evidence_cluster_ids] + value.evidence_only_cluster_ids
        problem = accounted_once(ids, cited, "cluster", "chunk", "evidence-only")
        if problem is not None:
            return None, problem
        for n, chunk in enumerate(value.chunks):
            findings = firewall_findings(card_text(chunk.model_dump(exclude={"evidence_cluster_ids"})))
            if findings:
                rules = ", ".join(sorted({f["rule"] for f in findings}))
                return None, f"$.chunks[{n}]: the firewall refuses it ({rules}); generalise, name no instance"
        return value, None

    return validate


def _input_fingerprint(clusters: list[dict[str, Any]], config: CompilerConfig) -> str:
    return fingerprint(
        {
            "pipeline_version": PIPELINE_VERSION,
            "clusters": [_shown(cluster) for cluster in clusters],
            "compiler": settings_identity(config.model, config.seed),
            "prompt_sha256": prompt_sha256(COMPILER_PROMPT),
            "tool_sha256": fingerprint(_tool(config)),
            "limits": {
                "validation_dimension_cap": config.validation_dimension_cap,
                "active_skill_budget": config.active_skill_budget,
                "attempts": config.attempts,
            },
            "proposal_checkpoint": config.proposal_checkpoint,
        }
    )


def _write(path: Path, data: bytes) -> str:
    with replacing(path) as out:
        out.write(data)
    return sha256_hex(data)


def _pretty(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE)


def _now() -> str:
    return datetime.now(UTC).isoformat()


def compile_skill(output_dir: Path, config: CompilerConfig, *, inputs: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Compile the clusters of ``output_dir``'s consolidation into the draft files there; return
    the manifest (status ``complete`` or ``failed``). ``inputs``: more digests for the manifest
    (the traces, the evidence cards)."""
    clusters, batches_sha256 = _clusters(output_dir)
    input_fp = _input_fingerprint(clusters, config)
    manifest_path = output_dir / MANIFEST_NAME
    if manifest_path.is_file():
        earlier = read_json_file(manifest_path, "the skill build manifest", SkillInputError)
        if (
            isinstance(earlier, dict)
            and earlier.get("status") == "complete"
            and earlier.get("compilation_input_sha256") == input_fp
            and all((output_dir / name).is_file() for name in (DRAFT_NAME, BANK_NAME, MARKDOWN_NAME, LEDGER_NAME))
        ):
            log.info("compilation_unchanged", manifest=str(manifest_path))
            return earlier
    ids = [str(cluster["cluster_id"]) for cluster in clusters]
    cap = min(config.validation_dimension_cap, len(ids))
    result = asyncio.run(_call(clusters, ids, cap, config))
    invalid = [attempt for attempt in result.attempts if attempt["error"] is not None]
    if invalid:
        handle = os.open(output_dir / INVALID_ATTEMPTS_NAME, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            for attempt in invalid:
                append_record(handle, {"compilation_input_sha256": input_fp, "written_at": _now(), **attempt})
        finally:
            os.close(handle)
    manifest: dict[str, Any] = {
        "manifest_version": MANIFEST_VERSION,
        "pipeline_version": PIPELINE_VERSION,
        "status": "failed",
        "compilation_input_sha256": input_fp,
        "inputs": {**(inputs or {}), BATCHES_NAME: batches_sha256},
        "compiler": settings_identity(config.model, config.seed),
        "prompt_sha256": prompt_sha256(COMPILER_PROMPT),
        "tool_sha256": fingerprint(_tool(config)),
        "limits": {
            "validation_dimension_cap": config.validation_dimension_cap,
            "active_skill_budget": config.active_skill_budget,
            "attempts": config.attempts,
        },
        "clusters": len(ids),
        "attempts": len(result.attempts),
        "usage": result.usage,
        "outputs": {},
        "written_at": _now(),
    }
    if result.status != "ok":
        manifest["error"] = result.error
        log.warning("compilation_failed", error=result.error)
        _write(manifest_path, _pretty(manifest))
        return manifest
    skill: InitialSkill = result.value
    by_id = {str(cluster["cluster_id"]): cluster for cluster in clusters}
    chunk_id_list = chunk_ids(skill.chunks)
    chunks = []
    for order, (chunk_id, chunk) in enumerate(zip(chunk_id_list, skill.chunks, strict=True), start=1):
        cards = [card for cid in chunk.evidence_cluster_ids for card in by_id[cid].get("evidence_card_ids") or []]
        chunks.append({"chunk_id": chunk_id, "order": order, **chunk.model_dump(), "evidence_card_ids": cards})
    draft = {
        "schema_version": DRAFT_SCHEMA_VERSION,
        "stage": "cold_start_draft_pre_validation",
        "skill_title": skill.skill_title,
        "active_skill_budget": min(config.active_skill_budget, len(chunks)),
        "validation_dimension_cap": config.validation_dimension_cap,
        "chunks": chunks,
        "evidence_only_cluster_ids": list(skill.evidence_only_cluster_ids),
        "conflicts_resolved": list(skill.conflicts_resolved),
        "compilation_input_sha256": input_fp,
    }
    rendered = {chunk_id: render_chunk(chunk) for chunk_id, chunk in zip(chunk_id_list, skill.chunks, strict=True)}
    bank = {
        "schema_version": SKILLBANK_SCHEMA_VERSION,
        "bank_version": DRAFT_BANK_VERSION,
        "skills": [
            {
                "skill_id": chunk["chunk_id"],
                "content": rendered[chunk["chunk_id"]],
                "metadata": {
                    "draft_only": True,
                    "title": chunk["title"],
                    "workflow_stage": chunk["workflow_stage"],
                    "evidence_cluster_ids": chunk["evidence_cluster_ids"],
                },
            }
            for chunk in chunks
        ],
    }
    markdown = f"# {skill.skill_title}\n\n" + "\n\n".join(rendered[chunk_id] for chunk_id in chunk_id_list) + "\n"
    written = _now()
    ledger = b"".join(
        json_bytes(
            {
                "candidate_id": chunk["chunk_id"],
                "operation": "ADD",
                "stage": "cold_start",
                "status": "proposed",
                "proposal_checkpoint": config.proposal_checkpoint,
                "content_sha256": sha256_hex(rendered[chunk["chunk_id"]]),
                "evidence_cluster_ids": chunk["evidence_cluster_ids"],
                "evidence_card_ids": chunk["evidence_card_ids"],
                "compilation_input_sha256": input_fp,
                "proposed_at": written,
            }
        )
        + b"\n"
        for chunk in chunks
    )
    manifest["outputs"] = {
        DRAFT_NAME: _write(output_dir / DRAFT_NAME, _pretty(draft)),
        BANK_NAME: _write(output_dir / BANK_NAME, _pretty(bank)),
        MARKDOWN_NAME: _write(output_dir / MARKDOWN_NAME, markdown.encode("utf-8")),
        LEDGER_NAME: _write(output_dir / LEDGER_NAME, ledger),
    }
    manifest.update(status="complete", chunks=len(chunks), chunk_ids=chunk_id_list, skill_title=skill.skill_title)
    _write(manifest_path, _pretty(manifest))
    return manifest


async def _call(clusters: list[dict[str, Any]], ids: list[str], cap: int, config: CompilerConfig) -> Any:
    model = OpenAICompatibleChatModel(config.model)
    model.check_api_key()
    try:
        return await structured_call(
            model,
            system=COMPILER_PROMPT,
            user={"validation_dimension_cap": cap, "clusters": [_shown(cluster) for cluster in clusters]},
            tool=_tool(config),
            validate=_validator(ids, cap),
            attempts=config.attempts,
            seed=config.seed,
        )
    finally:
        await model.aclose()
