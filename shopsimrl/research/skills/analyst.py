"""The success analyst per trajectory, resumable by input fingerprint.

Writes into ``output_dir``::

    trajectory_analyses.jsonl  one record per analysed episode (appended, fsynced; latest wins)
    analysis_errors.jsonl      one record per failed analysis (the episode is tried again)
    evidence_cards.jsonl       every card of the current analyses, flattened (rewritten whole)
    analysis_summary.json      counts, the analyst's identity, the stage's status

Resume: an episode whose latest record carries the same ``input_fingerprint`` (pipeline
version, the trace, the analyst's identity, the prompt and tool hashes, the limits) is not
analysed again; anything else is. A process killed mid-write leaves at most a torn last line,
cut off before the next append.

Successful trajectories (``r_success = 1``) get the success analyst here. Failed ones get the
failure analyst (:mod:`shopsimrl.research.skills.failure`, a live ShopSimulator session) when
one is given, through the same files; without it the summary counts them as pending and the
stage is not ``complete`` while any is.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Protocol

import orjson
import structlog

from shopsimrl.model import OpenAICompatibleChatModel, OpenAICompatibleSettings
from shopsimrl.records import EpisodeTrace
from shopsimrl.records.io import dump_line, iter_trace_lines
from shopsimrl.research.outputs import replacing
from shopsimrl.research.skills.cards import (
    SUCCESS_TOOL,
    SuccessCards,
    placeholder_card,
    success_card_id,
    tool,
    validate_arguments,
)
from shopsimrl.research.skills.compact import compact_trace
from shopsimrl.research.skills.firewall import card_text, firewall_findings
from shopsimrl.research.skills.prompts import SUCCESS_ANALYST_PROMPT, prompt_sha256
from shopsimrl.research.skills.structured import ATTEMPTS, structured_call
from shopsimrl.schemas import fingerprint, json_bytes, parse_json_exact, sha256_hex

__all__ = [
    "ANALYSES_NAME",
    "ANALYSIS_VERSION",
    "CARDS_NAME",
    "ERRORS_NAME",
    "MAX_CARDS",
    "PIPELINE_VERSION",
    "SUMMARY_NAME",
    "AnalystConfig",
    "FailureChannel",
    "SkillInputError",
    "analyse_success",
    "analysis_summary",
    "analyst_identity",
    "append_record",
    "cards_bytes",
    "current_cards",
    "cut_torn_tail",
    "input_fingerprint",
    "latest_traces",
    "plain_settings",
    "r_success",
    "read_analyses",
    "read_latest_records",
    "run_success_analysis",
    "settings_identity",
    "success_tool",
    "summary_block",
    "summary_bytes",
]

log = structlog.get_logger("shopsimrl.research.skills")

PIPELINE_VERSION = "shopsimrl-skill-builder-v1"
ANALYSIS_VERSION = "shopsimrl-trajectory-analysis-v1"
ANALYSES_NAME = "trajectory_analyses.jsonl"
ERRORS_NAME = "analysis_errors.jsonl"
CARDS_NAME = "evidence_cards.jsonl"
SUMMARY_NAME = "analysis_summary.json"
MAX_CARDS = 2
SEED = 20260831
SUCCESS_TOOL_DESCRIPTION = "Submit the success cards of this trajectory (an empty list when no decision was non-trivial)."


class SkillInputError(ValueError):
    """Traces or output files the stage cannot use, naming the file, line and field (exit 2)."""


@dataclass(frozen=True, kw_only=True)
class AnalystConfig:
    model: OpenAICompatibleSettings
    seed: int = SEED
    concurrency: int = 4
    max_cards: int = MAX_CARDS
    attempts: int = ATTEMPTS


class FailureChannel(Protocol):
    """The failure analyst as this stage runs it (:class:`shopsimrl.research.skills.failure.FailureAnalysis`)."""

    def input_fingerprint(self, trace: EpisodeTrace) -> str: ...

    def identity(self) -> dict[str, Any]: ...

    async def open(self, output_dir: Path | None = None, *, concurrency: int = 1) -> None: ...

    async def analyse(self, trace: EpisodeTrace, input_fp: str) -> tuple[bool, dict[str, Any]]: ...

    async def aclose(self) -> None: ...


def success_tool(config: AnalystConfig) -> dict[str, Any]:
    return tool(SUCCESS_TOOL, SUCCESS_TOOL_DESCRIPTION, SuccessCards, cards=config.max_cards)


def plain_settings(value: Any) -> Any:
    """Settings hold read-only mappings; identities are plain JSON."""
    if isinstance(value, Mapping):
        return {str(key): plain_settings(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [plain_settings(item) for item in value]
    return value


def settings_identity(m: OpenAICompatibleSettings, seed: int) -> dict[str, Any]:
    """A model as records name it; part of every input fingerprint. Where the server is reached
    (its URL) is transport: it does not change what the model answers, so it is left out."""
    return {
        "model": m.model,
        "checkpoint_id": m.checkpoint_id,
        "temperature": m.temperature,
        "top_p": m.top_p,
        "max_tokens": m.max_tokens,
        "send_seed": m.send_seed,
        "tool_choice": plain_settings(m.tool_choice),
        "extra_body": plain_settings(m.extra_body),
        "seed": seed,
    }


def analyst_identity(config: AnalystConfig) -> dict[str, Any]:
    return settings_identity(config.model, config.seed)


def trace_sha256(trace: EpisodeTrace) -> str:
    return sha256_hex(dump_line(trace))


def input_fingerprint(trace: EpisodeTrace, config: AnalystConfig) -> str:
    """What the analysis of ``trace`` depends on; unchanged means a resumed stage reuses it."""
    return fingerprint(
        {
            "pipeline_version": PIPELINE_VERSION,
            "channel": "success",
            "trace_sha256": trace_sha256(trace),
            "analyst": analyst_identity(config),
            "prompt_sha256": prompt_sha256(SUCCESS_ANALYST_PROMPT),
            "tool_sha256": fingerprint(success_tool(config)),
            "limits": {"max_cards": config.max_cards, "attempts": config.attempts},
        }
    )


def r_success(trace: EpisodeTrace) -> Any:
    return trace.final.reward_detail.get("r_success") if trace.final is not None else None


def latest_traces(path: Path, *, expected: int | None = None) -> list[EpisodeTrace]:
    """The latest record per episode of a ``traces.jsonl``, in first-seen order, each a completed
    ``train`` episode with a binary ``r_success``; ``expected``: the exact number required."""
    latest: dict[str, EpisodeTrace] = {}
    if not path.exists():
        raise SkillInputError(f"{path}: no such traces file")
    for number, (_offset, record) in enumerate(iter_trace_lines(path), start=1):
        if record is None:
            raise SkillInputError(f"{path}: record {number} is not a readable trace record")
        latest[record.episode_id] = record
    return check_train_traces(latest, str(path), expected=expected)


def check_train_traces(latest: dict[str, EpisodeTrace], where_from: str, *, expected: int | None) -> list[EpisodeTrace]:
    """``latest`` (episode id → its record) as a list, each refused (naming ``where_from`` and the
    episode) unless a completed ``train`` episode with a binary ``r_success``, and their count
    refused unless ``expected``."""
    for episode, record in latest.items():
        where = f"{where_from}: episode {episode}"
        if record.status != "completed":
            raise SkillInputError(f"{where}: status is {record.status!r}; the skill builder reads completed episodes only")
        if record.job.split != "train":
            raise SkillInputError(f"{where}: job.split is {record.job.split!r}; skills are built from train episodes only")
        if r_success(record) not in (0, 1) or isinstance(r_success(record), bool):
            raise SkillInputError(f"{where}: final.reward_detail.r_success is {r_success(record)!r}, not 0 or 1")
    if expected is not None and len(latest) != expected:
        raise SkillInputError(f"{where_from}: {len(latest)} episodes, but exactly {expected} are expected")
    return list(latest.values())


def cut_torn_tail(path: Path) -> bool:
    """Cut a last line a killed writer left without its newline; whether one was cut."""
    if not path.exists():
        return False
    data = path.read_bytes()
    if not data or data.endswith(b"\n"):
        return False
    os.truncate(path, data.rfind(b"\n") + 1)
    return True


def read_latest_records(path: Path, *, key: str, version_key: str, version: str, what: str) -> dict[str, dict[str, Any]]:
    """``record[key]`` → its latest record in a JSONL file this stage appends to (a later line
    supersedes an earlier one; a torn last line is ignored). A line that is not a ``version``
    record, or whose ``key`` is not a string, is refused naming the file and line."""
    found: dict[str, dict[str, Any]] = {}
    if not path.exists():
        return found
    lines = path.read_bytes().split(b"\n")
    for number, raw in enumerate(lines, start=1):
        if not raw.strip() or number == len(lines):  # no newline after the last: a torn write
            continue
        try:
            record = parse_json_exact(raw)
        except ValueError:
            record = None
        if not isinstance(record, dict) or record.get(version_key) != version:
            raise SkillInputError(f"{path}:{number}: not a {what} record ({version})")
        if not isinstance(record.get(key), str):
            raise SkillInputError(f"{path}:{number}: {key} must be a string")
        found[record[key]] = record
    return found


def read_analyses(path: Path) -> dict[str, dict[str, Any]]:
    """episode id → its latest analysis record (a torn last line is ignored)."""
    return read_latest_records(
        path, key="episode_id", version_key="analysis_version", version=ANALYSIS_VERSION, what="trajectory analysis"
    )


def _now() -> str:
    return datetime.now(UTC).isoformat()


def _validator(trace: EpisodeTrace, config: AnalystConfig) -> Any:
    steps = {step.step_index for step in trace.steps}

    def validate(arguments: dict[str, Any]) -> tuple[Any, str | None]:
        value, problem = validate_arguments(SuccessCards, arguments, cards=config.max_cards)
        if value is None:
            return None, problem
        for n, card in enumerate(value.cards):
            for m, item in enumerate(card.observed_evidence):
                if item.step not in steps:
                    return None, f"$.cards[{n}].observed_evidence[{m}].step: {item.step} is not a step of this trajectory"
        return value, None

    return validate


def _cards(trace: EpisodeTrace, value: SuccessCards) -> list[dict[str, Any]]:
    episode = trace.episode_id
    if not value.cards:
        return [placeholder_card(episode)]
    out = []
    for number, card in enumerate(value.cards, start=1):
        findings = firewall_findings(card_text(card), trace)
        out.append(
            {
                "card_id": success_card_id(episode, number),
                "channel": "success",
                "episode_id": episode,
                "placeholder": False,
                "eligible": not findings,
                "ineligible_reasons": ["firewall_finding"] if findings else [],
                "card": card.model_dump(),
                "evidence_refs": [{"episode_id": episode, "step": item.step} for item in card.observed_evidence],
                "firewall_findings": findings,
            }
        )
    return out


async def analyse_success(
    model: OpenAICompatibleChatModel, trace: EpisodeTrace, config: AnalystConfig, input_fp: str
) -> tuple[bool, dict[str, Any]]:
    """(ok, the analysis record) or (False, the error record) of one successful trajectory."""
    started = _now()
    user = {"max_cards": config.max_cards, "trace": compact_trace(trace), "current_skill": None}
    result = await structured_call(
        model,
        system=SUCCESS_ANALYST_PROMPT,
        user=user,
        tool=success_tool(config),
        validate=_validator(trace, config),
        attempts=config.attempts,
        seed=config.seed,
    )
    common = {
        "analysis_version": ANALYSIS_VERSION,
        "episode_id": trace.episode_id,
        "task_id": trace.job.task_id,
        "sample_id": trace.job.sample_id,
        "channel": "success",
        "input_fingerprint": input_fp,
        "attempts": result.attempts,
        "usage": result.usage,
        "started_at": started,
        "ended_at": _now(),
    }
    if result.status != "ok":
        return False, {**common, "status": result.status, "error": result.error}
    cards = _cards(trace, result.value)
    return True, {**common, "status": "ok", "empty": cards[0]["placeholder"], "cards": cards}


def append_record(handle: int, record: dict[str, Any]) -> None:
    # One write per record on an O_APPEND descriptor, then fsync: a kill leaves at most a torn last line.
    os.write(handle, json_bytes(record) + b"\n")
    os.fsync(handle)


async def _analyse_all(
    config: AnalystConfig,
    todo: list[tuple[EpisodeTrace, str]],
    analyses: int,
    errors: int,
    failure: FailureChannel | None,
    output_dir: Path | None = None,
) -> tuple[int, int]:
    model = OpenAICompatibleChatModel(config.model)
    model.check_api_key()
    slots = asyncio.Semaphore(config.concurrency)
    done = failed = 0

    async def one(trace: EpisodeTrace, input_fp: str) -> None:
        nonlocal done, failed
        async with slots:
            if r_success(trace) == 1 or failure is None:
                ok, record = await analyse_success(model, trace, config, input_fp)
            else:
                ok, record = await failure.analyse(trace, input_fp)
            if ok:
                append_record(analyses, record)
                done += 1
            else:
                append_record(errors, record)
                failed += 1
                log.warning("trajectory_analysis_failed", episode_id=trace.episode_id, error=record.get("error"))

    try:
        if failure is not None and any(r_success(trace) == 0 for trace, _ in todo):
            await failure.open(output_dir, concurrency=config.concurrency)
        await asyncio.gather(*(one(trace, input_fp) for trace, input_fp in todo))
    finally:
        try:
            if failure is not None:
                await failure.aclose()
        finally:
            await model.aclose()
    return done, failed


def run_success_analysis(
    traces: Iterable[EpisodeTrace], output_dir: Path, config: AnalystConfig, failure: FailureChannel | None = None
) -> dict[str, Any]:
    """Analyse every successful trajectory (and, with ``failure``, every failed one) not yet
    analysed with the same input; write the cards and the summary; return the summary."""
    traces = list(traces)
    output_dir.mkdir(parents=True, exist_ok=True)
    analyses_path, errors_path = output_dir / ANALYSES_NAME, output_dir / ERRORS_NAME
    for path in (analyses_path, errors_path):
        if cut_torn_tail(path):
            log.warning("torn_last_line_cut", path=str(path))
    existing = read_analyses(analyses_path)
    successes = [trace for trace in traces if r_success(trace) == 1]
    wanted = [trace for trace in traces if r_success(trace) == 1 or failure is not None]
    fingerprints = {
        trace.episode_id: input_fingerprint(trace, config) if r_success(trace) == 1 or failure is None
        else failure.input_fingerprint(trace)
        for trace in wanted
    }  # fmt: skip
    todo = [
        (trace, fingerprints[trace.episode_id])
        for trace in wanted
        if (existing.get(trace.episode_id) or {}).get("input_fingerprint") != fingerprints[trace.episode_id]
    ]
    analyses = os.open(analyses_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    errors = os.open(errors_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
    try:
        analysed_now, failed_now = asyncio.run(_analyse_all(config, todo, analyses, errors, failure, output_dir))
    finally:
        os.close(analyses)
        os.close(errors)
    current = read_analyses(analyses_path)
    cards, missing = current_cards([(trace.episode_id, fingerprints[trace.episode_id]) for trace in wanted], current)
    with replacing(output_dir / CARDS_NAME) as out:
        out.write(cards_bytes(cards))
    summary = analysis_summary(
        summary_block(config),
        len(traces),
        len(successes),
        cards,
        missing,
        analysed_now,
        failed_now,
        failure.identity() if failure is not None else None,
    )
    with replacing(output_dir / SUMMARY_NAME) as out:
        out.write(summary_bytes(summary))
    return summary


def current_cards(wanted: list[tuple[str, str]], current: Mapping[str, dict[str, Any]]) -> tuple[list[dict[str, Any]], list[str]]:
    """The cards of the current analyses of ``wanted`` ((episode id, input fingerprint) in
    trace order) and the episodes without one (no record, or one of another input)."""
    cards: list[dict[str, Any]] = []
    missing: list[str] = []
    for episode, input_fp in wanted:
        record = current.get(episode)
        if record is None or record.get("input_fingerprint") != input_fp:
            missing.append(episode)
            continue
        cards.extend(record["cards"])
    return cards, missing


def cards_bytes(cards: list[dict[str, Any]]) -> bytes:
    return b"".join(json_bytes(card) + b"\n" for card in cards)


def summary_bytes(summary: dict[str, Any]) -> bytes:
    return orjson.dumps(summary, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE)


def summary_block(config: AnalystConfig) -> dict[str, Any]:
    """The analyst's part of the summary: identity, prompt and tool hashes, limits."""
    return {
        "analyst": analyst_identity(config),
        "prompt_sha256": prompt_sha256(SUCCESS_ANALYST_PROMPT),
        "tool_sha256": fingerprint(success_tool(config)),
        "limits": {"max_cards": config.max_cards, "attempts": config.attempts, "concurrency": config.concurrency},
    }


def analysis_summary(
    block: dict[str, Any],
    total: int,
    success: int,
    cards: list[dict[str, Any]],
    missing: list[str],
    analysed_now: int,
    failed_now: int,
    failure_analyst: dict[str, Any] | None,
) -> dict[str, Any]:
    """``analysis_summary.json``: ``block`` is :func:`summary_block`; ``total`` and ``success``
    count the trajectories; ``failure_analyst`` is the failure analyst's identity where it ran."""
    findings: dict[str, int] = {}
    for card in cards:
        for finding in card["firewall_findings"]:
            findings[finding["rule"]] = findings.get(finding["rule"], 0) + 1
    failures = total - success
    analysed_total = success + (failures if failure_analyst is not None else 0)
    reasons = []
    if missing:
        reasons.append(f"{len(missing)} trajectories have no current analysis (see {ERRORS_NAME})")
    if failures and failure_analyst is None:
        reasons.append(f"{failures} failed trajectories wait for the failure analyst, which did not run")
    episodes: dict[str, Any] = {"total": total, "success": success}
    episodes["failure" if failure_analyst is not None else "failure_pending"] = failures
    episodes.update(
        analysed=analysed_total - len(missing),
        analysed_now=analysed_now,
        reused=analysed_total - len(missing) - analysed_now,
        errors_now=failed_now,
        missing=len(missing),
        missing_episode_ids=missing,
    )
    summary: dict[str, Any] = {
        "analysis_summary_version": "shopsimrl-analysis-summary-v1",
        "pipeline_version": PIPELINE_VERSION,
        "status": "incomplete" if reasons else "complete",
        "incomplete_reasons": reasons,
        "episodes": episodes,
        "cards": {
            "total": len(cards),
            "eligible": sum(1 for card in cards if card["eligible"]),
            "placeholders": sum(1 for card in cards if card["placeholder"]),
        },
        "firewall_findings": dict(sorted(findings.items())),
        **block,
        "written_at": _now(),
    }
    if failure_analyst is not None:
        statuses: dict[str, int] = {}
        forced: dict[str, int] = {}
        for card in cards:
            if card["channel"] != "failure":
                continue
            status = (card.get("card") or {}).get("status", "none")
            statuses[status] = statuses.get(status, 0) + 1
            for reason in card.get("forced_no_proposal_reasons") or []:
                forced[reason] = forced.get(reason, 0) + 1
        summary["failure_cards"] = {"status": dict(sorted(statuses.items())), "forced_no_proposal": dict(sorted(forced.items()))}
        summary["failure_analyst"] = failure_analyst
    return summary
