"""The consolidator: eligible evidence cards, per channel, in batches, into clusters.

Cards are taken in the order of ``evidence_cards.jsonl``, eligible ones only, grouped by
channel and cut into batches of ``batch_size`` (40). Each batch is one structured call of
``submit_clusters`` with at most ``min(max_clusters, cards)`` clusters (12); every card id of the
batch must appear exactly once, in one cluster or in ``evidence_only_card_ids``, and no cluster
may break the firewall (checked against the traces of the cards it cites when they are given).
Both are contract errors, so the model is asked to repair them.

``cluster_batches.jsonl`` holds one record per batch (appended, fsynced; the latest record of a
batch id wins). A rerun skips a batch whose latest record is ``ok`` with the same
``input_fingerprint`` (pipeline version, the batch's cards, the consolidator's identity, the
prompt and tool hashes, the limits). Cluster ids are ``{channel}-batch-NNN-cluster-NN``.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import orjson
import structlog

from shopsimrl.model import OpenAICompatibleChatModel, OpenAICompatibleSettings
from shopsimrl.records import EpisodeTrace
from shopsimrl.research.outputs import replacing
from shopsimrl.research.skills.analyst import (
    PIPELINE_VERSION,
    SEED,
    SkillInputError,
    append_record,
    cut_torn_tail,
    read_latest_records,
    settings_identity,
)
from shopsimrl.research.skills.cards import CLUSTERS_TOOL, Clusters, accounted_once, tool, validate_arguments
from shopsimrl.research.skills.firewall import card_text, firewall_findings
from shopsimrl.research.skills.prompts import CONSOLIDATOR_PROMPT, prompt_sha256
from shopsimrl.research.skills.structured import ATTEMPTS, structured_call
from shopsimrl.schemas import fingerprint, parse_json_exact

__all__ = [
    "BATCHES_NAME",
    "BATCH_SIZE",
    "BATCH_VERSION",
    "CONSOLIDATION_SUMMARY_NAME",
    "MAX_CLUSTERS",
    "ConsolidatorConfig",
    "batches_of",
    "cluster_id",
    "read_batches",
    "read_cards",
    "run_consolidation",
]

log = structlog.get_logger("shopsimrl.research.skills")

BATCH_VERSION = "shopsimrl-cluster-batch-v1"
BATCHES_NAME = "cluster_batches.jsonl"
CONSOLIDATION_SUMMARY_NAME = "consolidation_summary.json"
BATCH_SIZE = 40
MAX_CLUSTERS = 12
CLUSTERS_TOOL_DESCRIPTION = "Submit the clusters of this batch; every card id exactly once, in a cluster or evidence-only."
_CARD_FIELDS = ("mechanism", "applicable_when", "decisive_behavior", "generalizable_lesson", "observed_evidence", "confidence")


@dataclass(frozen=True, kw_only=True)
class ConsolidatorConfig:
    model: OpenAICompatibleSettings
    seed: int = SEED
    concurrency: int = 4
    batch_size: int = BATCH_SIZE
    max_clusters: int = MAX_CLUSTERS
    attempts: int = ATTEMPTS


def batch_id(channel: str, index: int) -> str:
    return f"{channel}-batch-{index:03d}"


def cluster_id(channel: str, index: int, number: int) -> str:
    return f"{batch_id(channel, index)}-cluster-{number:02d}"


def read_cards(path: Path) -> list[dict[str, Any]]:
    """The cards of an ``evidence_cards.jsonl``; a line that is not a card names its line."""
    cards = []
    for number, raw in enumerate(path.read_bytes().splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            card = parse_json_exact(raw)
        except ValueError:
            card = None
        if not isinstance(card, dict) or not isinstance(card.get("card_id"), str) or not isinstance(card.get("channel"), str):
            raise SkillInputError(f"{path}:{number}: not an evidence card (card_id and channel are required)")
        cards.append(card)
    return cards


def batches_of(cards: Iterable[dict[str, Any]], batch_size: int) -> list[tuple[str, int, list[dict[str, Any]]]]:
    """(channel, 1-based batch index, cards) for the eligible cards, per channel in first-seen order."""
    by_channel: dict[str, list[dict[str, Any]]] = {}
    for card in cards:
        if card.get("eligible"):
            by_channel.setdefault(card["channel"], []).append(card)
    out = []
    for channel, items in by_channel.items():
        for start in range(0, len(items), batch_size):
            out.append((channel, start // batch_size + 1, items[start : start + batch_size]))
    return out


def _shown(card: dict[str, Any]) -> dict[str, Any]:
    """What the consolidator sees of a card: its id and the deployable fields (of a failure
    card: its status and deployable abstraction, never the privileged audit)."""
    inner = card.get("card") or {}
    if card.get("channel") == "failure":
        return {"card_id": card["card_id"], "status": inner.get("status"), **(inner.get("deployable_abstraction") or {})}
    return {"card_id": card["card_id"], **{key: inner[key] for key in _CARD_FIELDS if key in inner}}


def _tool(config: ConsolidatorConfig) -> dict[str, Any]:
    return tool(CLUSTERS_TOOL, CLUSTERS_TOOL_DESCRIPTION, Clusters, clusters=config.max_clusters)


def batch_fingerprint(cards: list[dict[str, Any]], config: ConsolidatorConfig) -> str:
    return fingerprint(
        {
            "pipeline_version": PIPELINE_VERSION,
            "cards": [_shown(card) for card in cards],
            "consolidator": settings_identity(config.model, config.seed),
            "prompt_sha256": prompt_sha256(CONSOLIDATOR_PROMPT),
            "tool_sha256": fingerprint(_tool(config)),
            "limits": {"batch_size": config.batch_size, "max_clusters": config.max_clusters, "attempts": config.attempts},
        }
    )


def _validator(cards: list[dict[str, Any]], limit: int, traces: Mapping[str, EpisodeTrace]) -> Any:
    ids = [card["card_id"] for card in cards]
    episodes = {card["card_id"]: card.get("episode_id") for card in cards}

    def validate(arguments: dict[str, Any]) -> tuple[Any, str | None]:
        value, problem = validate_arguments(Clusters, arguments, clusters=limit)
        if value is None:
            return None, problem
        cited = [card_id for cluster in value.clusters for card_id in cluster.evidence_card_ids]
        cited += value.evidence_only_card_ids
        problem = accounted_once(ids, cited, "card", "cluster", "evidence-only")
        if problem is not None:
            return None, problem
        for n, cluster in enumerate(value.clusters):
            text = card_text(cluster.model_dump(exclude={"evidence_card_ids"}))
            sources = sorted({str(episodes[card_id]) for card_id in cluster.evidence_card_ids})
            checks: list[EpisodeTrace | None] = [traces[e] for e in sources if e in traces] or [None]
            for trace in checks:
                findings = firewall_findings(text, trace)
                if findings:
                    rules = ", ".join(sorted({f["rule"] for f in findings}))
                    return None, f"$.clusters[{n}]: the firewall refuses it ({rules}); generalise, name no instance"
        return value, None

    return validate


def read_batches(path: Path) -> dict[str, dict[str, Any]]:
    """batch id → its latest record (a torn last line is ignored)."""
    return read_latest_records(path, key="batch_id", version_key="batch_version", version=BATCH_VERSION, what="cluster batch")


def _now() -> str:
    return datetime.now(UTC).isoformat()


async def _consolidate(
    config: ConsolidatorConfig,
    todo: list[tuple[str, int, list[dict[str, Any]], str]],
    traces: Mapping[str, EpisodeTrace],
    handle: int,
) -> None:
    model = OpenAICompatibleChatModel(config.model)
    model.check_api_key()
    slots = asyncio.Semaphore(config.concurrency)

    async def one(channel: str, index: int, cards: list[dict[str, Any]], input_fp: str) -> None:
        async with slots:
            started = _now()
            limit = min(config.max_clusters, len(cards))
            result = await structured_call(
                model,
                system=CONSOLIDATOR_PROMPT,
                user={"channel": channel, "max_clusters": limit, "cards": [_shown(card) for card in cards]},
                tool=_tool(config),
                validate=_validator(cards, limit, traces),
                attempts=config.attempts,
                seed=config.seed,
            )
            record: dict[str, Any] = {
                "batch_version": BATCH_VERSION,
                "batch_id": batch_id(channel, index),
                "channel": channel,
                "batch_index": index,
                "card_ids": [card["card_id"] for card in cards],
                "input_fingerprint": input_fp,
                "status": result.status,
                "clusters": [],
                "evidence_only_card_ids": [],
                "attempts": result.attempts,
                "usage": result.usage,
                "error": result.error,
                "started_at": started,
                "ended_at": _now(),
            }
            if result.status == "ok":
                record["clusters"] = [
                    {"cluster_id": cluster_id(channel, index, number), **cluster.model_dump()}
                    for number, cluster in enumerate(result.value.clusters, start=1)
                ]
                record["evidence_only_card_ids"] = list(result.value.evidence_only_card_ids)
            else:
                log.warning("consolidation_batch_failed", batch_id=record["batch_id"], error=result.error)
            append_record(handle, record)

    try:
        await asyncio.gather(*(one(*item) for item in todo))
    finally:
        await model.aclose()


def run_consolidation(
    cards: Iterable[dict[str, Any]],
    output_dir: Path,
    config: ConsolidatorConfig,
    traces: Mapping[str, EpisodeTrace] | None = None,
) -> dict[str, Any]:
    """Consolidate every batch not yet consolidated with the same input; return the summary
    (also written to ``consolidation_summary.json``)."""
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / BATCHES_NAME
    if cut_torn_tail(path):
        log.warning("torn_last_line_cut", path=str(path))
    existing = read_batches(path)
    batches = [
        (channel, index, items, batch_fingerprint(items, config))
        for channel, index, items in batches_of(cards, config.batch_size)
    ]
    todo = [
        item
        for item in batches
        if not (
            (record := existing.get(batch_id(item[0], item[1]))) is not None
            and record.get("status") == "ok"
            and record.get("input_fingerprint") == item[3]
        )
    ]
    handle = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        asyncio.run(_consolidate(config, todo, traces or {}, handle))
    finally:
        os.close(handle)
    current = read_batches(path)
    done = [
        current[batch_id(channel, index)]
        for channel, index, _items, input_fp in batches
        if current.get(batch_id(channel, index), {}).get("status") == "ok"
        and current[batch_id(channel, index)].get("input_fingerprint") == input_fp
    ]
    failed = [
        batch_id(channel, index)
        for channel, index, _items, _fp in batches
        if batch_id(channel, index) not in {r["batch_id"] for r in done}
    ]
    summary = {
        "consolidation_summary_version": "shopsimrl-consolidation-summary-v1",
        "pipeline_version": PIPELINE_VERSION,
        "status": "incomplete" if failed else "complete",
        "batches": {"total": len(batches), "ok": len(done), "consolidated_now": len(todo), "failed_batch_ids": failed},
        "cards": sum(len(items) for _c, _i, items, _f in batches),
        "clusters": sum(len(record["clusters"]) for record in done),
        "evidence_only_cards": sum(len(record["evidence_only_card_ids"]) for record in done),
        "consolidator": settings_identity(config.model, config.seed),
        "prompt_sha256": prompt_sha256(CONSOLIDATOR_PROMPT),
        "limits": {"batch_size": config.batch_size, "max_clusters": config.max_clusters, "attempts": config.attempts},
        "written_at": _now(),
    }
    with replacing(output_dir / CONSOLIDATION_SUMMARY_NAME) as out:
        out.write(orjson.dumps(summary, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE))
    return summary
