"""Online failure analysis: a training round's triage → failure cards → ``candidate_pool.json``.

While GRPO trains with a skill bank, the triage (:mod:`shopsimrl.training.triage`) writes one
``group-<g:09d>.json`` per all-wrong group; a group classified
``full_skill_failure_pending_analysis`` failed even in its diagnostic retry with every current
chunk. Each such retry gets the Failure Analyst in stage ``online`` (a REWRITE of an active chunk
is allowed); its card lands in ``failure_cards.jsonl``. The drain-and-compile step then asks the
compiler model once (tool ``submit_online_candidates``) for at most ``max_candidates`` ADD or
REWRITE candidates and writes the pool the online gate reads as it comes.

Files in ``output_dir``::

    failure_cards.jsonl            one card per retry episode (appended, fsynced; latest wins)
    candidate_pool.json            shopsimrl-skill-candidate-pool-v1
    proposal_ledger.jsonl          one ``proposed`` row per candidate, stage ``online``
    analysis_summary.json          status, counts, compilation_input_sha256, digests
    online_invalid_attempts.jsonl  every invalid answer of the compiler model

The round is a local run directory or the training run's object store location (``s3://…``:
the triage records are objects there and the diagnostics run is read through
:func:`~shopsimrl.storage.reading.open_run`); :func:`round_source` picks the reader.

The analysis of one retry is one call of the failure analyst (:class:`FailureAnalyst`;
:func:`default_failure_analyst` calls :func:`~shopsimrl.research.skills.failure.analyse_failure`). Whatever it raises becomes an ``ANALYST_ERROR`` card:
ineligible, analysed again by the next ``analyze`` or ``watch`` process.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import signal
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import Any, Final, Protocol

import orjson
import structlog
from pydantic import BaseModel, ConfigDict, Field

from shopsimrl.config import TrackingSection
from shopsimrl.model import OpenAICompatibleChatModel, OpenAICompatibleSettings
from shopsimrl.records import EpisodeTrace
from shopsimrl.records.io import iter_trace_lines
from shopsimrl.research.outputs import replacing
from shopsimrl.research.skills.analyst import (
    PIPELINE_VERSION,
    SEED,
    SkillInputError,
    append_record,
    cut_torn_tail,
    read_latest_records,
    settings_identity,
    trace_sha256,
)
from shopsimrl.research.skills.build import AnalysisSection, EnvironmentSection, ModelSection, read_stage_config
from shopsimrl.research.skills.cards import (
    FAILURE_TOOL,
    ONLINE_CANDIDATES_TOOL,
    FailureCard,
    OnlineCandidate,
    OnlineCandidates,
    SkillChunk,
    accounted_once,
    tool,
    validate_arguments,
)
from shopsimrl.research.skills.compile import render_chunk
from shopsimrl.research.skills.failure import MAX_TRIALS, FailureConfig, analyse_failure, failure_tool
from shopsimrl.research.skills.firewall import card_text, enforce_no_proposal, firewall_findings, forced_no_proposal_reasons
from shopsimrl.research.skills.prompts import FAILURE_ANALYST_PROMPT, ONLINE_CONSOLIDATOR_PROMPT, prompt_sha256
from shopsimrl.research.skills.structured import ATTEMPTS, COMPILER_ATTEMPTS, structured_call
from shopsimrl.schemas import fingerprint, json_bytes, parse_json_exact, sha256_hex
from shopsimrl.skills import JsonSkillBank, SkillBankError
from shopsimrl.storage.objectstore import ObjectStore, RunLocationError, StoreUnavailableError
from shopsimrl.storage.reading import RunReadError, open_run
from shopsimrl.training.triage import DIAGNOSTICS_DIR, PENDING_ANALYSIS, TRIAGE_DIR, TRIAGE_SCHEMA_VERSION

__all__ = [
    "ANALYST_ERROR",
    "CARDS_NAME",
    "CARD_VERSION",
    "LEDGER_NAME",
    "MAX_CANDIDATES",
    "POOL_NAME",
    "POOL_SCHEMA_VERSION",
    "SUMMARY_NAME",
    "FailureAnalysisError",
    "FailureAnalyst",
    "FailureTask",
    "LocalRound",
    "ObjectRound",
    "OnlineConfig",
    "OnlineResult",
    "PendingRetry",
    "RoundSource",
    "analyze",
    "candidate_id",
    "candidate_signature",
    "default_failure_analyst",
    "failure_input_fingerprint",
    "load_online_config",
    "read_failure_cards",
    "read_pending_in",
    "round_source",
    "watch",
]

log = structlog.get_logger("shopsimrl.research.skills")

CARD_VERSION: Final = "shopsimrl-online-failure-card-v1"
SUMMARY_VERSION: Final = "shopsimrl-online-analysis-summary-v1"
POOL_SCHEMA_VERSION: Final = "shopsimrl-skill-candidate-pool-v1"
CARDS_NAME: Final = "failure_cards.jsonl"
POOL_NAME: Final = "candidate_pool.json"
LEDGER_NAME: Final = "proposal_ledger.jsonl"
SUMMARY_NAME: Final = "analysis_summary.json"
INVALID_ATTEMPTS_NAME: Final = "online_invalid_attempts.jsonl"
LOCK_NAME: Final = ".online-analysis.lock"
MAX_CANDIDATES: Final = 6
MAX_CANDIDATES_CAP: Final = 16
ANALYST_ERROR: Final = "ANALYST_ERROR"
TOOL_DESCRIPTION: Final = "Submit the online candidates; every card id exactly once, in a candidate or evidence-only."


# --------------------------------------------------------------------------- config


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class OnlineSection(_Strict):
    name: str = Field(min_length=1)
    training_round_dir: str = Field(min_length=1)
    current_skillbank_path: str = Field(min_length=1)
    output_dir: str = Field(min_length=1)
    proposal_ledger_history_path: str | None = None
    proposal_checkpoint: str = Field(min_length=1)
    max_candidates: int = Field(MAX_CANDIDATES, ge=1, le=MAX_CANDIDATES_CAP)
    resume: bool = True


class OnlineConfig(_Strict):
    online_analysis: OnlineSection
    seed: int = SEED
    analysis: AnalysisSection = Field(default_factory=AnalysisSection)
    environment: EnvironmentSection = Field(default_factory=EnvironmentSection)
    analyst_model: ModelSection
    compiler_model: ModelSection | None = None
    tracking: TrackingSection | None = None
    """The round's figures to W&B / MLflow (``skills analyze --track`` adds backends)."""
    source_path: Path | None = None

    def resolve(self, value: str) -> Path:
        path = Path(value).expanduser()
        if path.is_absolute() or self.source_path is None:
            return path
        return (self.source_path.parent / path).resolve()

    @property
    def output_dir(self) -> Path:
        return self.resolve(self.online_analysis.output_dir)

    @property
    def compiler(self) -> ModelSection:
        return self.compiler_model or self.analyst_model


def load_online_config(path: str | Path) -> OnlineConfig:
    """ONLINE.yaml; :class:`SkillInputError` naming the file and every bad key otherwise."""
    return read_stage_config(OnlineConfig, Path(path), "online analysis config")


# --------------------------------------------------------------------------- the failure analyst seam


@dataclass(frozen=True)
class FailureTask:
    """What the failure analyst gets for one diagnostic retry."""

    trace: EpisodeTrace
    current_skills: list[dict[str, Any]]
    active_skill_ids: list[str]
    model: OpenAICompatibleSettings
    environment: EnvironmentSection
    max_failure_steps: int
    seed: int
    stage: str = "online"


@dataclass(frozen=True)
class FailureAnalyst:
    """One retry → ``{"card": FailureCard or its arguments, ...}`` with either the live
    session's facts (``valid_live_actions``, ``successful_trials``: the stage applies every
    forced NO_PROPOSAL rule) or ``forced_no_proposal_reasons`` (the analyst applied the
    live-session rules itself; the stage still applies the target and firewall rules).
    ``identity``: what the answers depend on besides the trace and the model (its prompt and
    tool digests, its limits), part of every card's input fingerprint."""

    analyse: Callable[[FailureTask], Awaitable[Mapping[str, Any]]]
    identity: Mapping[str, Any]


class FailureAnalysisError(RuntimeError):
    """The failure analyst finished without a card (its error record's message)."""


def default_failure_analyst() -> FailureAnalyst:
    """The project's Failure Analyst (:func:`shopsimrl.research.skills.failure.analyse_failure`)
    in stage ``online``: the current skills as ``current_skill``, their ids as the targets a
    REWRITE may name; its live session on ``environment``."""

    async def analyse(task: FailureTask) -> Mapping[str, Any]:
        config = FailureConfig(
            model=task.model,
            environment=task.environment.settings(),
            seed=task.seed,
            max_failure_steps=task.max_failure_steps,
        )
        ok, record = await analyse_failure(
            task.trace,
            config,
            stage="online",
            current_skill=[{k: skill[k] for k in ("skill_id", "version", "content")} for skill in task.current_skills],
            active_skill_ids=task.active_skill_ids,
        )
        if not ok or not record.get("cards"):
            error = record.get("error") or {}
            raise FailureAnalysisError(f"{record.get('status')}: {error.get('message')}")
        entry = record["cards"][0]
        # The analyst enforced the live-session rules itself (it knows the session's facts).
        return {
            "card": entry["card"],
            "forced_no_proposal_reasons": list(entry.get("forced_no_proposal_reasons") or []),
            "proposed_status": entry.get("proposed_status"),
            "usage": record.get("usage") or {},
        }

    identity = {
        "failure_analyst": "shopsimrl.research.skills.failure",
        "prompt_sha256": prompt_sha256(FAILURE_ANALYST_PROMPT),
        "tool_sha256": fingerprint(failure_tool()),
        "max_trials": MAX_TRIALS,
        "attempts": ATTEMPTS,
    }
    return FailureAnalyst(analyse, identity)


# --------------------------------------------------------------------------- inputs


@dataclass(frozen=True)
class PendingRetry:
    triage_file: str
    """The triage record's name (``group-<g:09d>.json``)."""
    group_index: int
    task_id: int
    trace: EpisodeTrace


@dataclass(frozen=True)
class Bank:
    path: Path
    sha256: str
    skills: list[dict[str, Any]]

    @property
    def ids(self) -> list[str]:
        return [str(skill["skill_id"]) for skill in self.skills]


def load_bank(path: Path) -> Bank:
    try:
        bank = JsonSkillBank(path)
    except SkillBankError as exc:
        raise SkillInputError(f"online_analysis.current_skillbank_path: {exc}") from None
    skills = [
        {"skill_id": skill.skill_id, "version": str(skill.version), "content": skill.content, "metadata": dict(skill.metadata)}
        for skill, _tasks in bank.entries
    ]
    return Bank(path, sha256_hex(path.read_bytes()), skills)


def triage_dir(round_dir: Path) -> Path:
    """``<round>/triage`` (the run's ``training/`` folder given) or ``<round>/training/triage``
    (the run directory given)."""
    for candidate in (round_dir / "triage", round_dir / "training" / "triage"):
        if candidate.is_dir():
            return candidate
    raise SkillInputError(
        f"online_analysis.training_round_dir: {round_dir} holds neither triage/ nor training/triage/ "
        "(the training run's triage records)"
    )


def _r_success(trace: EpisodeTrace) -> Any:
    return trace.final.reward_detail.get("r_success") if trace.final is not None else None


def _skill_key(skill: Any) -> tuple[str, str, str]:
    get = skill.get if isinstance(skill, dict) else lambda name: getattr(skill, name)
    return (str(get("skill_id")), str(get("version")), str(get("content")))


class _NotReady(Exception):
    """A triage record whose diagnostic trace is not (yet) in the diagnostics run."""


class _TraceCache:
    """The diagnostics runs' traces, read again only when a file grew."""

    def __init__(self) -> None:
        self._files: dict[Path, tuple[int, dict[str, EpisodeTrace]]] = {}

    def get(self, path: Path) -> dict[str, EpisodeTrace]:
        try:
            size = path.stat().st_size
        except FileNotFoundError:
            return {}
        cached = self._files.get(path)
        if cached is not None and cached[0] == size:
            return cached[1]
        latest: dict[str, EpisodeTrace] = {}
        for _offset, record in iter_trace_lines(path):
            if record is not None:
                latest[record.episode_id] = record
        self._files[path] = (size, latest)
        return latest


class RoundSource(Protocol):
    """Where a training round's triage records and diagnostics runs are: a local run directory
    or an object store location."""

    def triaged(self) -> bool:
        """Whether the round has a triage folder (a watch waits until it has)."""
        ...

    def group_files(self) -> list[str]:
        """The names of the triage records, ``group-*.json``, sorted."""
        ...

    def read(self, name: str) -> bytes: ...

    def where(self, name: str) -> str:
        """The record as errors name it (a path, or the object's URI without credentials)."""
        ...

    def diagnostics(self, relative: str, name: str) -> tuple[str, dict[str, EpisodeTrace]]:
        """The diagnostics run at ``relative`` (to the run) as errors name it, and its latest
        record per episode; :class:`SkillInputError` naming record ``name`` when ``relative``
        leaves the run."""
        ...


@dataclass
class LocalRound:
    """A round in a local run directory (``training_round_dir`` the run or its ``training/``)."""

    round_dir: Path
    traces: _TraceCache = field(default_factory=_TraceCache)

    def _triage(self) -> Path:
        return triage_dir(self.round_dir)

    def triaged(self) -> bool:
        return (self.round_dir / "triage").is_dir() or (self.round_dir / "training" / "triage").is_dir()

    def group_files(self) -> list[str]:
        return sorted(path.name for path in self._triage().glob("group-*.json"))

    def read(self, name: str) -> bytes:
        return (self._triage() / name).read_bytes()

    def where(self, name: str) -> str:
        return str(self._triage() / name)

    def diagnostics(self, relative: str, name: str) -> tuple[str, dict[str, EpisodeTrace]]:
        run_dir = self._triage().parent.parent
        traces_path = (run_dir / relative / "traces.jsonl").resolve()
        if not traces_path.is_relative_to(run_dir.resolve()):
            raise SkillInputError(f"{self.where(name)}: diagnostic.run_dir {relative!r} leaves the run directory")
        return str(traces_path), self.traces.get(traces_path)


@dataclass
class ObjectRound:
    """A round on an object store (``training_round_dir`` the run's ``s3://…`` location, as the
    training store writes it: ``training/triage/group-*.json`` objects, the diagnostics run a
    training run of parts and commits under ``training/triage/diagnostics``). The diagnostics
    run is read again on every pass (its committed parts only)."""

    location: str
    store: ObjectStore = field(init=False)

    def __post_init__(self) -> None:
        self.location = self.location.rstrip("/")
        try:
            self.store = ObjectStore(self.location)
        except RunLocationError as exc:
            raise SkillInputError(f"online_analysis.training_round_dir: {exc}") from None

    def _names(self) -> list[str]:
        try:
            names = self.store.listdir(TRIAGE_DIR.as_posix())
        except (OSError, RunLocationError, StoreUnavailableError) as exc:
            raise SkillInputError(f"online_analysis.training_round_dir: {exc}") from None
        return sorted(name for name in names if name.startswith("group-") and name.endswith(".json"))

    def triaged(self) -> bool:
        return bool(self._names())

    def group_files(self) -> list[str]:
        names = self._names()
        if not names:
            raise SkillInputError(
                f"online_analysis.training_round_dir: {self.store.display_uri} holds no "
                f"{TRIAGE_DIR.as_posix()}/group-*.json objects (the training run's triage records)"
            )
        return names

    def read(self, name: str) -> bytes:
        try:
            data = self.store.read_bytes(f"{TRIAGE_DIR.as_posix()}/{name}")
        except (OSError, RunLocationError, StoreUnavailableError) as exc:
            raise SkillInputError(f"{self.where(name)}: {exc}") from None
        if data is None:
            raise SkillInputError(f"{self.where(name)}: the object is gone")
        return data

    def where(self, name: str) -> str:
        return f"{self.store.display_uri}/{TRIAGE_DIR.as_posix()}/{name}"

    def diagnostics(self, relative: str, name: str) -> tuple[str, dict[str, EpisodeTrace]]:
        parts = PurePosixPath(relative).parts
        if PurePosixPath(relative).is_absolute() or ".." in parts or not parts:
            raise SkillInputError(f"{self.where(name)}: diagnostic.run_dir {relative!r} leaves the run location")
        location = f"{self.location}/{PurePosixPath(*parts).as_posix()}"
        shown = f"{self.store.display_uri}/{PurePosixPath(*parts).as_posix()}"
        try:
            run = open_run(location)
        except RunReadError:
            return shown, {}  # no rollout committed there yet
        latest: dict[str, EpisodeTrace] = {}
        for record in run.records():
            latest[record.episode_id] = record
        return shown, latest


def round_source(config: OnlineConfig) -> RoundSource:
    """The round ``online_analysis.training_round_dir`` names: a URL with ``://`` is an object
    store location, anything else a local path (relative to the config file)."""
    value = config.online_analysis.training_round_dir
    if "://" in value:
        return ObjectRound(value)
    return LocalRound(config.resolve(value))


def read_pending(path: Path, bank: Bank, traces: _TraceCache) -> PendingRetry | str:
    """:func:`read_pending_in` for the triage file at ``path`` of a local run directory."""
    return read_pending_in(LocalRound(path.parent.parent.parent, traces), path.name, bank)


def read_pending_in(source: RoundSource, name: str, bank: Bank) -> PendingRetry | str:
    """The retry triage record ``name`` asks to analyse, or its classification when it asks for
    none. :class:`SkillInputError` naming the record for a record or a retry the stage cannot
    use; :class:`_NotReady` when the retry's trace is not there yet."""
    where_file = source.where(name)
    try:
        record = parse_json_exact(source.read(name))
    except ValueError as exc:
        raise SkillInputError(f"{where_file}: not a JSON triage record ({exc})") from None
    if not isinstance(record, dict) or record.get("schema_version") != TRIAGE_SCHEMA_VERSION:
        raise SkillInputError(f"{where_file}: schema_version is not {TRIAGE_SCHEMA_VERSION!r}")
    classification = str(record.get("classification"))
    if classification != PENDING_ANALYSIS:
        return classification
    diagnostic = record.get("diagnostic")
    if not isinstance(diagnostic, dict) or not isinstance(diagnostic.get("episode_id"), str):
        raise SkillInputError(f"{where_file}: classification {PENDING_ANALYSIS} but no diagnostic.episode_id")
    episode = diagnostic["episode_id"]
    relative = str(diagnostic.get("run_dir") or DIAGNOSTICS_DIR.as_posix())
    shown, traces = source.diagnostics(relative, name)
    trace = traces.get(episode)
    if trace is None:
        raise _NotReady(f"{where_file}: the diagnostic retry {episode} is not in {shown}")
    where = f"{where_file}: diagnostic retry {episode}"
    if trace.status != "completed":
        raise SkillInputError(f"{where}: status is {trace.status!r}; only a completed retry is analysed")
    if trace.job.split != "train":
        raise SkillInputError(f"{where}: job.split is {trace.job.split!r}; only train episodes are analysed")
    if _r_success(trace) != 0 or isinstance(_r_success(trace), bool):
        raise SkillInputError(f"{where}: final.reward_detail.r_success is {_r_success(trace)!r}, not 0")
    used = sorted(_skill_key(skill) for skill in trace.selected_skills)
    current = sorted(_skill_key(skill) for skill in bank.skills)
    if used != current:
        used_ids = [key[0] + "@" + key[1] for key in used]
        current_ids = [key[0] + "@" + key[1] for key in current]
        raise SkillInputError(
            f"{where}: its skills {used_ids} are not the enabled records of {bank.path} {current_ids} "
            "(same ids, versions and contents); was the retry played with another bank?"
        )
    task = record.get("task_id")
    return PendingRetry(
        name, int(record.get("group_index") or 0), int(task) if isinstance(task, int) else trace.job.task_id, trace
    )


# --------------------------------------------------------------------------- failure cards


def card_id(episode_id: str) -> str:
    return f"failure-{episode_id}"


def failure_input_fingerprint(trace: EpisodeTrace, config: OnlineConfig, bank: Bank, analyst: FailureAnalyst) -> str:
    """What a retry's card depends on; unchanged means a resumed stage reuses it."""
    return fingerprint(
        {
            "pipeline_version": PIPELINE_VERSION,
            "channel": "online_failure",
            "trace_sha256": trace_sha256(trace),
            "analyst": settings_identity(config.analyst_model.settings(FAILURE_TOOL), config.seed),
            "failure_analyst": dict(analyst.identity),
            "current_skills": [_skill_key(skill) for skill in bank.skills],
            "environment": {"persona": config.environment.persona},
            "limits": {"max_failure_steps": config.analysis.max_failure_steps},
        }
    )


def read_failure_cards(path: Path) -> dict[str, dict[str, Any]]:
    """episode id → its latest card record (a torn last line is ignored)."""
    return read_latest_records(path, key="episode_id", version_key="card_version", version=CARD_VERSION, what="failure card")


def _now() -> str:
    return datetime.now(UTC).isoformat()


async def analyse_retry(
    retry: PendingRetry, config: OnlineConfig, bank: Bank, analyst: FailureAnalyst, input_fp: str
) -> dict[str, Any]:
    """The card record of one retry; an analyst exception gives an ``ANALYST_ERROR`` card."""
    trace = retry.trace
    started = _now()
    common: dict[str, Any] = {
        "card_version": CARD_VERSION,
        "card_id": card_id(trace.episode_id),
        "channel": "failure",
        "stage": "online",
        "episode_id": trace.episode_id,
        "group_index": retry.group_index,
        "task_id": retry.task_id,
        "triage_file": retry.triage_file,
        "input_fingerprint": input_fp,
    }
    task = FailureTask(
        trace=trace,
        current_skills=[dict(skill) for skill in bank.skills],
        active_skill_ids=bank.ids,
        model=config.analyst_model.settings(FAILURE_TOOL),
        environment=config.environment,
        max_failure_steps=config.analysis.max_failure_steps,
        seed=config.seed,
    )
    try:
        result = dict(await analyst.analyse(task))
        raw = result.get("card")
        card = raw if isinstance(raw, FailureCard) else FailureCard.model_validate(raw)
        proposed = str(result.get("proposed_status") or card.status)
        # The live-session rules need the session's facts; an analyst that reports its own
        # enforcement instead (forced_no_proposal_reasons) is taken at its word for those two.
        told = "valid_live_actions" in result or "successful_trials" in result
        earlier = [str(reason) for reason in result.get("forced_no_proposal_reasons") or []]
        reasons = forced_no_proposal_reasons(
            card,
            stage="online",
            valid_live_actions=int(result.get("valid_live_actions") or 0) if told else 1,
            successful_trials=int(result.get("successful_trials") or 0) if told else 1,
            active_skill_ids=bank.ids,
            trace=trace,
        )
        reasons = [*earlier, *(reason for reason in reasons if reason not in earlier)]
        card, reasons = enforce_no_proposal(card, reasons)
    except asyncio.CancelledError:
        raise
    except Exception as exc:  # any analyst failure is recorded, never fatal to the stage
        log.warning("failure_analysis_error", episode_id=trace.episode_id, error=str(exc)[:300])
        return {
            **common,
            "status": ANALYST_ERROR,
            "eligible": False,
            "ineligible_reasons": ["analyst_error"],
            "forced_no_proposal_reasons": [],
            "card": None,
            "evidence_refs": [],
            "error": {"type": type(exc).__name__, "message": str(exc)[:1000]},
            "started_at": started,
            "ended_at": _now(),
        }
    eligible = card.status != "NO_PROPOSAL"
    divergence = card.privileged_audit.earliest_divergence.step
    return {
        **common,
        "status": card.status,
        "proposed_status": proposed,
        "eligible": eligible,
        "ineligible_reasons": [] if eligible else (reasons or ["no_proposal"]),
        "forced_no_proposal_reasons": reasons,
        "card": card.model_dump(),
        "evidence_refs": [{"episode_id": trace.episode_id, "step": divergence}],
        "valid_live_actions": result.get("valid_live_actions"),
        "successful_trials": result.get("successful_trials"),
        "usage": result.get("usage") or {},
        "error": None,
        "started_at": started,
        "ended_at": _now(),
    }


@dataclass
class DrainState:
    """What the analysis found so far (one ``analyze`` or one ``watch`` process)."""

    classifications: dict[str, int] = field(default_factory=dict)
    pending: dict[str, PendingRetry] = field(default_factory=dict)
    """Retry episode id → its retry, for every pending triage file read."""
    analysed_now: int = 0
    errors_now: int = 0
    reused: int = 0
    attempted: set[str] = field(default_factory=set)
    """Retry episodes analysed by this process (a watch does not ask again for an error card)."""
    reported: set[str] = field(default_factory=set)
    """Triage files a watch refused (reported once, left for ``analyze``)."""


Stop = Callable[[], bool]


async def drain(
    config: OnlineConfig,
    bank: Bank,
    analyst: FailureAnalyst,
    state: DrainState,
    source: RoundSource,
    *,
    strict: bool,
    stop: Stop = lambda: False,
    echo: Callable[[str], None] = lambda line: None,
) -> None:
    """Analyse every pending retry whose card is missing or stale. ``strict`` (``analyze``): a
    triage file the stage cannot use raises; else (``watch``) it is reported once and left, and
    a retry whose trace is not written yet waits for the next poll."""
    if not strict and not source.triaged():
        return  # training has triaged no group yet
    names = source.group_files()
    output_dir = config.output_dir
    output_dir.mkdir(parents=True, exist_ok=True)
    cards_path = output_dir / CARDS_NAME
    if cut_torn_tail(cards_path):
        log.warning("torn_last_line_cut", path=str(cards_path))
    existing = read_failure_cards(cards_path) if config.online_analysis.resume else {}
    classifications: dict[str, int] = {}
    for name in names:
        if stop():
            return
        try:
            found = read_pending_in(source, name, bank)
        except _NotReady as exc:
            if strict:
                raise SkillInputError(str(exc)) from None
            continue
        except SkillInputError as exc:
            if strict:
                raise
            if name not in state.reported:
                state.reported.add(name)
                echo(f"skipped {name}: {exc}")
            continue
        if isinstance(found, str):
            classifications[found] = classifications.get(found, 0) + 1
            continue
        classifications[PENDING_ANALYSIS] = classifications.get(PENDING_ANALYSIS, 0) + 1
        episode = found.trace.episode_id
        state.pending[episode] = found
        input_fp = failure_input_fingerprint(found.trace, config, bank, analyst)
        earlier = existing.get(episode)
        current = earlier is not None and earlier.get("input_fingerprint") == input_fp
        if current and (earlier or {}).get("status") != ANALYST_ERROR and episode not in state.attempted:
            state.reused += 1
            state.attempted.add(episode)
        if current and episode in state.attempted:
            continue
        record = await analyse_retry(found, config, bank, analyst, input_fp)
        handle = os.open(cards_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            append_record(handle, record)
        finally:
            os.close(handle)
        existing[episode] = record
        state.attempted.add(episode)
        if record["status"] == ANALYST_ERROR:
            state.errors_now += 1
        else:
            state.analysed_now += 1
        echo(f"analysed {name}: {record['card_id']} {record['status']}")
    state.classifications = classifications


# --------------------------------------------------------------------------- online consolidation


def candidate_signature(operation: str, target: str | None, content: str) -> str:
    """Two candidates with the same signature are the same proposal."""
    return fingerprint({"operation": operation, "target_chunk_id": target or None, "content": content})


def candidate_id(operation: str, target: str | None, content: str) -> str:
    return "online-" + candidate_signature(operation, target, content)[:16]


def render_candidate(candidate: OnlineCandidate) -> str:
    """The candidate's chunk text, rendered as the cold-start compiler renders a chunk."""
    chunk = SkillChunk(
        title=candidate.title,
        workflow_stage=candidate.workflow_stage,
        applicable_when=candidate.applicable_when,
        procedure=list(candidate.procedure),
        verification=candidate.verification,
        common_failure=candidate.common_failure,
        evidence_cluster_ids=list(candidate.evidence_card_ids),
    )
    return render_chunk(chunk)


@dataclass(frozen=True)
class History:
    signatures: frozenset[str]
    digests: frozenset[tuple[str, str | None, str]]
    """(operation, target, content sha256) of rows that carry a digest but not the text."""
    shown: list[dict[str, Any]]


def read_history(path: Path | None) -> History:
    """Every earlier proposal of the ledger at ``path`` (none when there is no path)."""
    signatures: set[str] = set()
    digests: set[tuple[str, str | None, str]] = set()
    shown: list[dict[str, Any]] = []
    if path is None:
        return History(frozenset(), frozenset(), [])
    if not path.is_file():
        raise SkillInputError(f"online_analysis.proposal_ledger_history_path: {path} does not exist")
    for number, line in enumerate(path.read_bytes().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = parse_json_exact(line)
        except ValueError:
            raise SkillInputError(f"{path}:{number}: the proposal ledger line is not JSON") from None
        if not isinstance(row, dict):
            raise SkillInputError(f"{path}:{number}: a proposal ledger row must be an object")
        operation = str(row.get("operation") or "ADD")
        target = row.get("target_chunk_id") or None
        content = row.get("content")
        if isinstance(content, str) and content:
            signatures.add(candidate_signature(operation, target, content))
            shown.append({"operation": operation, "target_chunk_id": target, "content": content})
        elif isinstance(row.get("content_sha256"), str):
            digests.add((operation, target, row["content_sha256"]))
    return History(frozenset(signatures), frozenset(digests), shown)


def _shown_card(record: Mapping[str, Any]) -> dict[str, Any]:
    """What the compiler model sees of a card: its id, status and deployable part (never the
    privileged audit, which holds the gold)."""
    card = record.get("card") or {}
    return {"card_id": record["card_id"], "status": record["status"], **(card.get("deployable_abstraction") or {})}


def _tool(max_candidates: int) -> dict[str, Any]:
    return tool(ONLINE_CANDIDATES_TOOL, TOOL_DESCRIPTION, OnlineCandidates, candidates=max_candidates)


def _validator(
    ids: list[str], cap: int, bank: Bank, history: History, traces: Mapping[str, EpisodeTrace], episode_of: Mapping[str, str]
) -> Callable[[dict[str, Any]], tuple[Any, str | None]]:
    active = set(bank.ids)

    def validate(arguments: dict[str, Any]) -> tuple[Any, str | None]:
        value, problem = validate_arguments(OnlineCandidates, arguments, candidates=cap)
        if value is None:
            return None, problem
        cited = [cid for candidate in value.candidates for cid in candidate.evidence_card_ids] + value.evidence_only_card_ids
        problem = accounted_once(ids, cited, "card", "candidate", "evidence-only")
        if problem is not None:
            return None, problem
        seen: dict[str, int] = {}
        for n, candidate in enumerate(value.candidates):
            where = f"$.candidates[{n}]"
            if candidate.operation == "REWRITE" and candidate.target_chunk_id not in active:
                return None, f"{where}.target_chunk_id: {candidate.target_chunk_id!r} is not an active chunk ({sorted(active)})"
            text = card_text(candidate.model_dump(exclude={"evidence_card_ids"}))
            for card in candidate.evidence_card_ids:
                findings = firewall_findings(text, traces.get(episode_of.get(card, "")))
                if findings:
                    rules = ", ".join(sorted({f["rule"] for f in findings}))
                    return None, f"{where}: the firewall refuses it ({rules}); generalise, name no instance"
            content = render_candidate(candidate)
            signature = candidate_signature(candidate.operation, candidate.target_chunk_id, content)
            if signature in seen:
                return None, f"{where}: the same candidate as candidates[{seen[signature]}]"
            seen[signature] = n
            digest = (candidate.operation, candidate.target_chunk_id, sha256_hex(content))
            if signature in history.signatures or digest in history.digests:
                return None, f"{where}: repeats a candidate of an earlier round (historical_candidates); propose another"
        return value, None

    return validate


def _pretty(value: Any) -> bytes:
    return orjson.dumps(value, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE)


def _write(path: Path, data: bytes) -> str:
    with replacing(path) as out:
        out.write(data)
    return sha256_hex(data)


def build_pool(
    round_id: str, checkpoint: str, bank_sha256: str | None, current: list[dict[str, Any]], candidates: list[dict[str, Any]]
) -> dict[str, Any]:
    """A ``shopsimrl-skill-candidate-pool-v1`` document, its digest over everything but
    ``created_at`` and ``pool_sha256``."""
    pool: dict[str, Any] = {
        "schema_version": POOL_SCHEMA_VERSION,
        "round_id": round_id,
        "proposal_checkpoint": checkpoint,
        "current_skillbank_sha256": bank_sha256,
        "current_skills": current,
        "candidates": candidates,
    }
    return {**pool, "pool_sha256": fingerprint(pool), "created_at": _now()}


@dataclass
class CompileOutcome:
    status: str
    input_fp: str
    candidates: list[dict[str, Any]]
    evidence_only: list[str]
    attempts: int = 0
    usage: dict[str, int] = field(default_factory=dict)
    error: dict[str, Any] | None = None
    reused: bool = False


class CompileError(RuntimeError):
    """The compiler model gave no valid candidates within its attempts."""


def _compilation_input(config: OnlineConfig, bank: Bank, shown: list[dict[str, Any]], history: History) -> str:
    o = config.online_analysis
    return fingerprint(
        {
            "pipeline_version": PIPELINE_VERSION,
            "round_id": o.name,
            "proposal_checkpoint": o.proposal_checkpoint,
            "current_skills": [_skill_key(skill) for skill in bank.skills],
            "cards": shown,
            "history": sorted(history.signatures) + sorted("|".join(map(str, d)) for d in history.digests),
            "compiler": settings_identity(config.compiler.settings(ONLINE_CANDIDATES_TOOL), config.seed),
            "prompt_sha256": prompt_sha256(ONLINE_CONSOLIDATOR_PROMPT),
            "tool_sha256": fingerprint(_tool(o.max_candidates)),
            "limits": {"max_candidates": o.max_candidates, "attempts": COMPILER_ATTEMPTS},
        }
    )


async def _ask(config: OnlineConfig, user: dict[str, Any], validate: Any, cap: int) -> Any:
    model = OpenAICompatibleChatModel(config.compiler.settings(ONLINE_CANDIDATES_TOOL))
    model.check_api_key()
    try:
        return await structured_call(
            model,
            system=ONLINE_CONSOLIDATOR_PROMPT,
            user=user,
            tool=_tool(cap),
            validate=validate,
            attempts=COMPILER_ATTEMPTS,
            seed=config.seed,
        )
    finally:
        await model.aclose()


def compile_candidates(
    config: OnlineConfig, bank: Bank, cards: list[dict[str, Any]], traces: Mapping[str, EpisodeTrace], history: History
) -> CompileOutcome:
    """The candidates of the eligible cards (one structured call; none when no card is eligible)."""
    o = config.online_analysis
    eligible = [card for card in cards if card.get("eligible")]
    shown = [_shown_card(card) for card in eligible]
    input_fp = _compilation_input(config, bank, shown, history)
    if not eligible:
        return CompileOutcome("complete", input_fp, [], [])
    ids = [card["card_id"] for card in eligible]
    cap = min(o.max_candidates, len(ids))
    episode_of = {card["card_id"]: card["episode_id"] for card in eligible}
    user = {
        "round_id": o.name,
        "max_candidates": cap,
        "current_skills": [{k: skill[k] for k in ("skill_id", "version", "content")} for skill in bank.skills],
        "historical_candidates": history.shown,
        "cards": shown,
    }
    result = asyncio.run(_ask(config, user, _validator(ids, cap, bank, history, traces, episode_of), cap))
    invalid = [attempt for attempt in result.attempts if attempt["error"] is not None]
    if invalid:
        handle = os.open(config.output_dir / INVALID_ATTEMPTS_NAME, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o666)
        try:
            for attempt in invalid:
                append_record(handle, {"compilation_input_sha256": input_fp, "written_at": _now(), **attempt})
        finally:
            os.close(handle)
    if result.status != "ok":
        message = (result.error or {}).get("message") or result.status
        raise CompileError(f"the online consolidation failed: {message}")
    value: OnlineCandidates = result.value
    by_card = {card["card_id"]: card for card in eligible}
    candidates = []
    for number, candidate in enumerate(value.candidates, start=1):
        content = render_candidate(candidate)
        mechanisms = [
            ((by_card[cid].get("card") or {}).get("deployable_abstraction") or {}).get("mechanism")
            for cid in candidate.evidence_card_ids
        ]
        candidates.append(
            {
                "candidate_id": candidate_id(candidate.operation, candidate.target_chunk_id, content),
                "operation": candidate.operation,
                "target_chunk_id": candidate.target_chunk_id,
                "content": content,
                "metadata": {
                    "title": candidate.title,
                    "workflow_stage": candidate.workflow_stage,
                    "failure_mechanism": candidate.failure_mechanism,
                    "card_mechanisms": [m for m in mechanisms if m],
                    "evidence_card_ids": list(candidate.evidence_card_ids),
                    "evidence_episode_ids": sorted({by_card[cid]["episode_id"] for cid in candidate.evidence_card_ids}),
                    "consolidation_cluster_id": f"{o.name}-candidate-{number:02d}",
                    "signature": candidate_signature(candidate.operation, candidate.target_chunk_id, content),
                    "stage": "online",
                },
            }
        )
    return CompileOutcome(
        "complete",
        input_fp,
        candidates,
        list(value.evidence_only_card_ids),
        attempts=len(result.attempts),
        usage=result.usage,
    )


# --------------------------------------------------------------------------- the two commands


@dataclass(frozen=True)
class OnlineResult:
    output_dir: Path
    summary: dict[str, Any]

    @property
    def exit_code(self) -> int:
        """0: a complete pool from a card for every retry; 1: a pool was written but some retry
        has an ``ANALYST_ERROR`` card or the consolidation failed (rerun)."""
        s = self.summary
        return 0 if s["status"] == "complete" and not s["cards"]["analyst_errors"] else 1


def _current_cards(output_dir: Path, state: DrainState) -> list[dict[str, Any]]:
    cards = read_failure_cards(output_dir / CARDS_NAME)
    return [cards[episode] for episode in sorted(state.pending) if episode in cards]


def _write_outputs(
    config: OnlineConfig,
    bank: Bank | None,
    state: DrainState,
    cards: list[dict[str, Any]],
    outcome: CompileOutcome | None,
    error: BaseException | None,
) -> dict[str, Any]:
    o = config.online_analysis
    output_dir = config.output_dir
    candidates = outcome.candidates if outcome is not None and error is None else []
    pool = build_pool(
        o.name,
        o.proposal_checkpoint,
        bank.sha256 if bank is not None else None,
        [dict(skill) for skill in bank.skills] if bank is not None else [],
        candidates,
    )
    written = _now()
    ledger = b"".join(
        json_bytes(
            {
                "candidate_id": c["candidate_id"],
                "operation": c["operation"],
                "target_chunk_id": c["target_chunk_id"],
                "stage": "online",
                "status": "proposed",
                "round_id": o.name,
                "proposal_checkpoint": o.proposal_checkpoint,
                "content": c["content"],
                "content_sha256": sha256_hex(c["content"]),
                "signature": c["metadata"]["signature"],
                "source_card_ids": c["metadata"]["evidence_card_ids"],
                "failure_mechanism": c["metadata"]["failure_mechanism"],
                "consolidation_cluster_id": c["metadata"]["consolidation_cluster_id"],
                "replacement_family_id": c["target_chunk_id"] if c["operation"] == "REWRITE" else None,
                "compilation_input_sha256": outcome.input_fp if outcome is not None else None,
                "proposed_at": written,
            }
        )
        + b"\n"
        for c in candidates
    )
    forced: dict[str, int] = {}
    for card in cards:
        for reason in card.get("forced_no_proposal_reasons") or []:
            forced[reason] = forced.get(reason, 0) + 1
    outputs = {POOL_NAME: _write(output_dir / POOL_NAME, _pretty(pool)), LEDGER_NAME: _write(output_dir / LEDGER_NAME, ledger)}
    if (output_dir / CARDS_NAME).is_file():
        outputs[CARDS_NAME] = sha256_hex((output_dir / CARDS_NAME).read_bytes())
    summary: dict[str, Any] = {
        "summary_version": SUMMARY_VERSION,
        "pipeline_version": PIPELINE_VERSION,
        "round_id": o.name,
        "status": "failed" if error is not None else "complete",
        "error": None if error is None else {"type": type(error).__name__, "message": str(error)[:2000]},
        "triage": {"by_classification": dict(sorted(state.classifications.items())), "pending": len(state.pending)},
        "cards": {
            "total": len(cards),
            "eligible": sum(1 for card in cards if card.get("eligible")),
            "no_proposal": sum(1 for card in cards if card.get("status") == "NO_PROPOSAL"),
            "analyst_errors": sum(1 for card in cards if card.get("status") == ANALYST_ERROR),
            "analysed_now": state.analysed_now,
            "errors_now": state.errors_now,
            "reused": state.reused,
            "missing": len(state.pending) - len(cards),
        },
        "forced_no_proposal": dict(sorted(forced.items())),
        "candidates": len(candidates),
        "candidate_ids": [c["candidate_id"] for c in candidates],
        "evidence_only_card_ids": outcome.evidence_only if outcome is not None and error is None else [],
        "compilation_input_sha256": outcome.input_fp if outcome is not None else None,
        "compilation_reused": bool(outcome is not None and outcome.reused),
        "current_skillbank_sha256": bank.sha256 if bank is not None else None,
        "proposal_checkpoint": o.proposal_checkpoint,
        "pool_sha256": pool["pool_sha256"],
        "compiler": settings_identity(config.compiler.settings(ONLINE_CANDIDATES_TOOL), config.seed),
        "prompt_sha256": prompt_sha256(ONLINE_CONSOLIDATOR_PROMPT),
        "tool_sha256": fingerprint(_tool(o.max_candidates)),
        "limits": {"max_candidates": o.max_candidates, "attempts": COMPILER_ATTEMPTS},
        "attempts": outcome.attempts if outcome is not None else 0,
        "usage": outcome.usage if outcome is not None else {},
        "outputs": outputs,
        "written_at": written,
    }
    _write(output_dir / SUMMARY_NAME, _pretty(summary))
    return summary


def _reusable(config: OnlineConfig, input_fp: str) -> dict[str, Any] | None:
    """The summary of a complete earlier compilation of the same input, if its files are there."""
    if not config.online_analysis.resume:
        return None
    output_dir = config.output_dir
    try:
        earlier = orjson.loads((output_dir / SUMMARY_NAME).read_bytes())
    except (OSError, orjson.JSONDecodeError):
        return None
    if not isinstance(earlier, dict) or earlier.get("status") != "complete":
        return None
    if earlier.get("compilation_input_sha256") != input_fp:
        return None
    outputs = earlier.get("outputs") or {}
    for name in (POOL_NAME, LEDGER_NAME):
        path = output_dir / name
        if not path.is_file() or sha256_hex(path.read_bytes()) != outputs.get(name):
            return None
    return earlier


@contextlib.contextmanager
def exclusive(output_dir: Path) -> Iterator[None]:
    """One ``analyze`` or ``watch`` at a time per output folder: two would analyse the same
    retry twice (two live sessions) and race on the pool. The lock goes with the process."""
    output_dir.mkdir(parents=True, exist_ok=True)
    path = output_dir / LOCK_NAME
    handle = os.open(path, os.O_WRONLY | os.O_CREAT, 0o666)
    try:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise SkillInputError(
                f"{output_dir}: another skills analyze or skills watch is writing here (it holds {path}); stop it first"
            ) from None
        yield
    finally:
        os.close(handle)


def analyze(config: OnlineConfig, analyst: FailureAnalyst | None = None) -> OnlineResult:
    """Drain the triage (analyse every retry without a current card), then compile the pool.
    Any exception after the config was read writes an empty pool and a ``failed`` summary (the
    gate then runs on the current bank) and is raised again."""
    with exclusive(config.output_dir):
        return _analyze(config, analyst or default_failure_analyst())


def _analyze(config: OnlineConfig, analyst: FailureAnalyst) -> OnlineResult:
    output_dir = config.output_dir
    state = DrainState()
    bank: Bank | None = None
    cards: list[dict[str, Any]] = []
    outcome: CompileOutcome | None = None
    try:
        bank = load_bank(config.resolve(config.online_analysis.current_skillbank_path))
        history_path = config.online_analysis.proposal_ledger_history_path
        history = read_history(config.resolve(history_path) if history_path else None)
        asyncio.run(drain(config, bank, analyst, state, round_source(config), strict=True))
        cards = _current_cards(output_dir, state)
        eligible = [card for card in cards if card.get("eligible")]
        input_fp = _compilation_input(config, bank, [_shown_card(card) for card in eligible], history)
        earlier = _reusable(config, input_fp)
        if earlier is not None:
            log.info("online_compilation_unchanged", summary=str(output_dir / SUMMARY_NAME))
            if state.analysed_now == 0 and state.errors_now == 0:
                return OnlineResult(output_dir, {**earlier, "compilation_reused": True})
            pool = orjson.loads((output_dir / POOL_NAME).read_bytes())
            outcome = CompileOutcome(
                "complete", input_fp, list(pool["candidates"]), list(earlier["evidence_only_card_ids"]), reused=True
            )
        else:
            by_episode = {episode: retry.trace for episode, retry in state.pending.items()}
            outcome = compile_candidates(config, bank, cards, by_episode, history)
    except Exception as exc:
        log.warning("online_analysis_failed", error=str(exc)[:500])
        output_dir.mkdir(parents=True, exist_ok=True)
        summary = _write_outputs(config, bank, state, cards, outcome, exc)
        raise OnlineAnalysisFailed(OnlineResult(output_dir, summary), exc) from exc
    return OnlineResult(output_dir, _write_outputs(config, bank, state, cards, outcome, None))


class OnlineAnalysisFailed(Exception):
    """``analyze`` failed after it wrote the empty pool and the failed summary."""

    def __init__(self, result: OnlineResult, cause: BaseException) -> None:
        super().__init__(str(cause))
        self.result = result
        self.cause = cause


@dataclass(frozen=True)
class WatchResult:
    polls: int
    analysed: int
    errors: int
    stopped_by: str


def watch(
    config: OnlineConfig,
    *,
    poll_seconds: float = 5.0,
    stop_file: Path | None = None,
    analyst: FailureAnalyst | None = None,
    echo: Callable[[str], None] = print,
) -> WatchResult:
    """Analyse new triage files every ``poll_seconds`` until SIGTERM, SIGINT or ``stop_file``
    exists. An analysis under way when the signal comes is cancelled and records nothing (the
    next run does it again); a card being appended is always written whole."""
    analyst = analyst or default_failure_analyst()
    bank = load_bank(config.resolve(config.online_analysis.current_skillbank_path))
    value = config.online_analysis.training_round_dir
    if "://" not in value and not config.resolve(value).is_dir():
        raise SkillInputError(f"online_analysis.training_round_dir: {config.online_analysis.training_round_dir} is not a folder")
    with exclusive(config.output_dir):
        return asyncio.run(_watch(config, bank, analyst, poll_seconds, stop_file, echo))


async def _watch(
    config: OnlineConfig,
    bank: Bank,
    analyst: FailureAnalyst,
    poll_seconds: float,
    stop_file: Path | None,
    echo: Callable[[str], None],
) -> WatchResult:
    loop = asyncio.get_running_loop()
    stopping = asyncio.Event()
    why: list[str] = []

    def on_signal(name: str) -> None:
        why.append(name)
        stopping.set()

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)

    def stop_requested() -> bool:
        if stop_file is not None and stop_file.exists() and not stopping.is_set():
            why.append("stop file")
            stopping.set()
        return stopping.is_set()

    state = DrainState()
    source = round_source(config)
    polls = 0
    try:
        while not stop_requested():
            polls += 1
            work = asyncio.ensure_future(
                drain(config, bank, analyst, state, source, strict=False, stop=stop_requested, echo=echo)
            )
            stopper = asyncio.ensure_future(stopping.wait())
            done, _ = await asyncio.wait({work, stopper}, return_when=asyncio.FIRST_COMPLETED)
            if work not in done:
                work.cancel()  # cards are appended between awaits: a cancelled drain tears nothing
                await asyncio.gather(work, return_exceptions=True)
                break
            stopper.cancel()
            work.result()
            deadline = loop.time() + poll_seconds
            while not stop_requested() and loop.time() < deadline:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(stopping.wait(), timeout=min(0.2, max(0.0, deadline - loop.time())))
    finally:
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.remove_signal_handler(sig)
    return WatchResult(polls, state.analysed_now, state.errors_now, why[0] if why else "stop file")


def format_summary(result: OnlineResult) -> str:
    """What ``skills analyze`` prints."""
    s = result.summary
    c = s["cards"]
    lines = [
        f"triage         {s['triage']['pending']} retries pending analysis "
        f"({', '.join(f'{k} {v}' for k, v in s['triage']['by_classification'].items()) or 'no triage files'})",
        f"failure cards  {c['total']} ({c['analysed_now']} now, {c['reused']} reused): {c['eligible']} eligible, "
        f"{c['no_proposal']} NO_PROPOSAL, {c['analyst_errors']} ANALYST_ERROR",
    ]
    if s["status"] == "complete":
        reused = " (unchanged input: nothing asked)" if s.get("compilation_reused") else ""
        ids = ", ".join(s["candidate_ids"]) or "none"
        lines.append(f"candidates     {s['candidates']}{reused}: {ids}")
    else:
        lines.append(f"candidates     failed: {(s.get('error') or {}).get('message')}; the pool holds no candidate")
    lines.append(f"pool           {result.output_dir / POOL_NAME} (online_gate.candidate_pool_path)")
    return "\n".join(lines)
