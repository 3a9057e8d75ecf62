"""The per-trajectory analysis as an Indexed Job, like the judge: ``skills plan`` → workers →
``skills reduce``.

It uses the judge's sharded layout and helpers (:mod:`shopsimrl.research.judge.sharded`: the
frozen inputs, parts written once, commit markers listing each part with its sha256, a shard's
committed parts as the union of the markers that verify). At a location (a directory or any
fsspec URI)::

    skills_plan.json                   the frozen plan: the traces' digest, every episode with its
                                       channel and input fingerprint, each analyst's identity,
                                       prompt and tool hashes and limits, the shard map
                                       (create-only, written last)
    inputs/00003.jsonl.zst             shard 3's traces, frozen by the planner (create-only)
    shards/00003/part-00000-<w>.jsonl.zst  analysis records (ok or error) of worker <w>
    shards/00003/_SUCCESS*.json        commit markers
    trajectory_analyses.jsonl          written by the reducer, with analysis_errors.jsonl,
    evidence_cards.jsonl               the same files the local stage writes
    analysis_summary.json

A worker analyses the trajectories of its shard with the per-trajectory analysts
(:class:`TrajectoryAnalyst`, one per channel: the success analyst, and the failure analyst whose
live ShopSimulator sessions each hold a lease, released on every path; ``environment.base_url``
or ``SHOPSIMRL_ENV_BASE_URL`` says where the shop is), writing a part every
``flush_every`` records (1: an analysis is minutes of model calls, so none is held unsaved). A
restarted worker skips every episode whose ``ok`` record with the planned input fingerprint is
in a part already there (a killed predecessor's too). It commits when its shard is done and
exits 1 when some analyses ended in ``invalid`` or ``error`` (the Job's retry of the index asks
them again); at SIGTERM/SIGINT it writes what it holds and exits 3 without a marker.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from pathlib import Path
from typing import Any, Protocol

import orjson
import structlog

from shopsimrl import eventloop
from shopsimrl.environment import ShopSimulatorEnvironment
from shopsimrl.exitcodes import ExitCode
from shopsimrl.manifest import FingerprintMismatchError
from shopsimrl.model import OpenAICompatibleChatModel
from shopsimrl.records import EpisodeTrace
from shopsimrl.records.io import dump_line, read_trace
from shopsimrl.research.judge.sharded import (
    ShardOutput,
    committed_parts,
    freeze_shard_inputs,
    part_records,
    read_plan_document,
    shard_input,
    shard_rows,
    stream_inputs,
)
from shopsimrl.research.outputs import replacing
from shopsimrl.research.skills.analyst import (
    ANALYSES_NAME,
    CARDS_NAME,
    ERRORS_NAME,
    PIPELINE_VERSION,
    SUMMARY_NAME,
    AnalystConfig,
    SkillInputError,
    analyse_success,
    analysis_summary,
    cards_bytes,
    current_cards,
    input_fingerprint,
    r_success,
    summary_block,
    summary_bytes,
)
from shopsimrl.research.skills.build import SkillsConfig, analyst_config, failure_config
from shopsimrl.research.skills.failure import FailureAnalysis, FailureConfig
from shopsimrl.research.skills.inputs import read_train_traces
from shopsimrl.runner.experiment import ServiceCheck, poll_until_ready, probe_environment, probe_model
from shopsimrl.runner.lease_journal import JournalStorage, shard_journal_storage
from shopsimrl.schemas import fingerprint, json_bytes
from shopsimrl.storage.sharded import ShardedRunStore, ShardMapError

__all__ = [
    "FLUSH_EVERY",
    "PLAN_NAME",
    "SKILLS_PLAN_VERSION",
    "AnalystSession",
    "SkillsPlan",
    "SkillsPlanError",
    "SkillsReduceResult",
    "TrajectoryAnalyst",
    "analysts_for",
    "failure_analyst",
    "format_reduce",
    "format_status",
    "plan_skills",
    "reduce_skills",
    "run_skills_worker",
    "skills_status",
    "skills_wait_ready",
    "success_analyst",
]

log = structlog.get_logger("shopsimrl.research.skills.sharded")

SKILLS_PLAN_VERSION = "shopsimrl-skills-plan-v1"
PLAN_NAME = "skills_plan.json"
FLUSH_EVERY = 1
_PLAN_DIFFERS = ["episodes / analysts: the traces, their input fingerprints or the analysts differ from the plan's"]


class SkillsPlanError(SkillInputError):
    """No skills plan at the location, one that cannot be read, or inputs that differ from it (exit 2)."""


class AnalystSession(Protocol):
    """An analyst opened for one worker: its clients (and, for the failure analyst, its
    environment adapter), shared by every trajectory it analyses."""

    async def analyse(self, trace: EpisodeTrace, input_fp: str) -> tuple[bool, dict[str, Any]]: ...

    async def aclose(self) -> None: ...


@dataclass(frozen=True)
class TrajectoryAnalyst:
    """One per-trajectory analyst as the sharded stage runs it: the trajectories it takes
    (``applies``), the input fingerprint of one, and ``open`` giving the session whose
    ``analyse`` gives (ok, the record to keep). ``block`` is what ``analysis_summary.json``
    says of it (success: identity, prompt and tool hashes, limits; failure: its
    ``failure_analyst``); the plan freezes it."""

    channel: str
    concurrency: int
    block: dict[str, Any]
    applies: Callable[[EpisodeTrace], bool]
    fingerprint: Callable[[EpisodeTrace], str]
    open: Callable[[], Awaitable[AnalystSession]]

    @property
    def identity(self) -> str:
        """What must match between the planner and a worker: the block without concurrency,
        which changes how fast, not what, the analyst answers."""
        limits = {key: value for key, value in self.block["limits"].items() if key != "concurrency"}
        return fingerprint({**self.block, "limits": limits})


class _SuccessSession:
    def __init__(self, config: AnalystConfig) -> None:
        self.config = config
        self.model = OpenAICompatibleChatModel(config.model)

    async def analyse(self, trace: EpisodeTrace, input_fp: str) -> tuple[bool, dict[str, Any]]:
        return await analyse_success(self.model, trace, self.config, input_fp)

    async def aclose(self) -> None:
        await self.model.aclose()


def success_analyst(config: AnalystConfig) -> TrajectoryAnalyst:
    async def open_session() -> AnalystSession:
        session = _SuccessSession(config)
        try:
            session.model.check_api_key()
        except BaseException:
            await session.aclose()
            raise
        return session

    return TrajectoryAnalyst(
        channel="success",
        concurrency=config.concurrency,
        block=summary_block(config),
        applies=lambda trace: r_success(trace) == 1,
        fingerprint=lambda trace: input_fingerprint(trace, config),
        open=open_session,
    )


def failure_analyst(
    config: FailureConfig, concurrency: int, journal: Callable[[], JournalStorage] | None = None
) -> TrajectoryAnalyst:
    """The gold-aware failure analyst: each failed trajectory in a live ShopSimulator session
    that holds its own lease (:mod:`shopsimrl.research.skills.failure`); ``journal``: where a
    worker journals those leases (its shard's), so that a worker killed outright leaves no slot
    taken once its index runs again."""
    channel = FailureAnalysis(config)

    async def open_session() -> AnalystSession:
        session = FailureAnalysis(config)
        try:
            await session.open(concurrency=concurrency, journal_storage=None if journal is None else journal())
        except BaseException:
            await session.aclose()
            raise
        return session

    return TrajectoryAnalyst(
        channel="failure",
        concurrency=concurrency,
        block=channel.identity(),
        applies=lambda trace: r_success(trace) == 0,
        fingerprint=channel.input_fingerprint,
        open=open_session,
    )


def analysts_for(config: SkillsConfig, journal: Callable[[], JournalStorage] | None = None) -> list[TrajectoryAnalyst]:
    """The per-trajectory analysts of SKILLS.yaml, one per channel (``journal``: where the failure
    analyst journals its leases)."""
    return [
        success_analyst(analyst_config(config)),
        failure_analyst(failure_config(config), config.experiment.concurrency, journal),
    ]


def _channel(trace: EpisodeTrace) -> str:
    return "success" if r_success(trace) == 1 else "failure"


@dataclass
class SkillsPlan:
    document: dict[str, Any]

    @property
    def fingerprint(self) -> str:
        return str(self.document["plan_fingerprint"])

    @property
    def shards(self) -> int:
        return len(self.document["shard_map"])


def read_plan(store: ShardedRunStore) -> SkillsPlan:
    return read_plan_document(
        store,
        PLAN_NAME,
        SkillsPlan,
        SkillsPlanError,
        stage="skills",
        version_key="skills_plan_version",
        version=SKILLS_PLAN_VERSION,
    )


def _analyst_identities(analysts: Iterable[TrajectoryAnalyst]) -> dict[str, str]:
    return {analyst.channel: analyst.identity for analyst in analysts}


def plan_skills(config: SkillsConfig, uri: str, shards: int) -> SkillsPlan:
    """Freeze the traces of SKILLS.yaml (exactly ``expected_trajectories``), every episode's
    input fingerprint and the analysts into ``shards`` shards at ``uri``. Planning again with
    the same inputs and shard count finds the plan; other inputs are refused."""
    store = ShardedRunStore(uri)
    traces = read_train_traces(config.location(config.experiment.traces), expected=config.experiment.expected_trajectories)
    analysts = {analyst.channel: analyst for analyst in analysts_for(config)}
    episodes = []
    for trace in traces:
        analyst = analysts.get(_channel(trace))
        input_fp = analyst.fingerprint(trace) if analyst is not None and analyst.applies(trace) else None
        episodes.append({"episode_id": trace.episode_id, "channel": _channel(trace), "input_fingerprint": input_fp})
    identities = _analyst_identities(analysts.values())
    plan_fp = fingerprint({"pipeline_version": PIPELINE_VERSION, "analysts": identities, "episodes": episodes})
    if store.read_bytes(PLAN_NAME) is not None:
        plan = read_plan(store)
        if plan.fingerprint != plan_fp:
            raise FingerprintMismatchError(store.display_uri, plan.fingerprint, plan_fp, _PLAN_DIFFERS)
        if plan.shards != shards:
            raise ShardMapError(f"{store.display_uri} is frozen with {plan.shards} shards, not {shards}")
        return plan
    lines = ((trace.episode_id, dump_line(trace).rstrip(b"\n")) for trace in traces)
    shard_map, inputs = freeze_shard_inputs(store, lines, shards)
    document = {
        "skills_plan_version": SKILLS_PLAN_VERSION,
        "created_at": datetime.now(UTC).isoformat(),
        "plan_fingerprint": plan_fp,
        "pipeline_version": PIPELINE_VERSION,
        "source": {"traces": traces.location, "input": traces.input_name, "digest": traces.digest},
        "analysts": {
            channel: {"identity": identities[channel], "summary": analyst.block} for channel, analyst in analysts.items()
        },
        "episodes": episodes,
        "flush_every": FLUSH_EVERY,
        "shard_map": shard_map,
        "inputs": inputs,
    }
    if not store.create(PLAN_NAME, orjson.dumps(document, option=orjson.OPT_INDENT_2 | orjson.OPT_APPEND_NEWLINE)):
        plan = read_plan(store)  # a concurrent planner won: the same plan, or a mismatch
        if plan.fingerprint != plan_fp or plan.shards != shards:
            raise FingerprintMismatchError(store.display_uri, plan.fingerprint, plan_fp, _PLAN_DIFFERS)
        return plan
    return SkillsPlan(document)


def _planned(plan: SkillsPlan) -> dict[str, dict[str, Any]]:
    return {str(episode["episode_id"]): episode for episode in plan.document["episodes"]}


def _is_current(planned: dict[str, dict[str, Any]]) -> Callable[[dict[str, Any]], bool]:
    """Whether a record is an ``ok`` analysis with the planned input fingerprint."""

    def current(record: dict[str, Any]) -> bool:
        episode = planned.get(str(record.get("episode_id")))
        return (
            record.get("status") == "ok"
            and episode is not None
            and episode["input_fingerprint"] is not None
            and record.get("input_fingerprint") == episode["input_fingerprint"]
        )

    return current


async def _analyse(
    analysts: dict[str, TrajectoryAnalyst],
    todo: list[tuple[TrajectoryAnalyst, EpisodeTrace, str]],
    sink: Callable[[bool, dict[str, Any]], None],
) -> None:
    # Only the channels with work are opened: a shard of successes needs no ShopSimulator.
    sessions: dict[str, AnalystSession] = {}
    try:
        for channel in sorted({analyst.channel for analyst, _, _ in todo}):
            sessions[channel] = await analysts[channel].open()
        slots = {channel: asyncio.Semaphore(analysts[channel].concurrency) for channel in sessions}

        async def one(analyst: TrajectoryAnalyst, trace: EpisodeTrace, input_fp: str) -> None:
            async with slots[analyst.channel]:
                ok, record = await sessions[analyst.channel].analyse(trace, input_fp)
                sink(ok, record)

        await asyncio.gather(*(one(*item) for item in todo))
    finally:
        for session in sessions.values():
            await session.aclose()


async def _analyse_until_stopped(
    analysts: dict[str, TrajectoryAnalyst],
    todo: list[tuple[TrajectoryAnalyst, EpisodeTrace, str]],
    sink: Callable[[bool, dict[str, Any]], None],
) -> bool:
    from shopsimrl.runner.driver import drive

    driven = await drive(_analyse(analysts, todo, sink), cleanup="saving the analyses made so far")
    return driven.interrupted


def run_skills_worker(config: SkillsConfig, uri: str, index: int) -> ExitCode:
    """Analyse shard ``index`` of the plan at ``uri`` (resuming it) and commit it."""
    store = ShardedRunStore(uri)
    plan = read_plan(store)
    if not 0 <= index < plan.shards:
        raise ShardMapError(f"shard index {index} is outside the plan's {plan.shards} shards")
    journal = partial(shard_journal_storage, store, index)  # a restarted index frees what a killed one held
    analysts = {analyst.channel: analyst for analyst in analysts_for(config, journal)}
    ours = _analyst_identities(analysts.values())
    frozen = {channel: block["identity"] for channel, block in plan.document["analysts"].items()}
    if ours != frozen:
        differing = sorted(channel for channel in {*ours, *frozen} if ours.get(channel) != frozen.get(channel))
        raise FingerprintMismatchError(
            store.display_uri,
            plan.fingerprint,
            fingerprint(ours),
            [f"analysts.{channel}: the analyst's model, prompt, tool or limits differ from the plan" for channel in differing],
        )
    spec = plan.document["inputs"][index]
    data = shard_input(store, spec, SkillsPlanError)
    planned = _planned(plan)
    output = ShardOutput(
        store, index, flush_every=int(plan.document.get("flush_every") or FLUSH_EVERY), is_done=_is_current(planned)
    )
    todo: list[tuple[TrajectoryAnalyst, EpisodeTrace, str]] = []
    applicable = 0
    for item in stream_inputs(data):
        trace = read_trace(item, f"{store.display_uri}/{spec['name']}")
        episode = planned.get(trace.episode_id)
        analyst = analysts.get(episode["channel"]) if episode is not None else None
        if episode is None or analyst is None or episode["input_fingerprint"] is None:
            continue  # no analyst for its channel yet: the summary counts it as pending
        applicable += 1
        if analyst.fingerprint(trace) != episode["input_fingerprint"]:
            raise SkillsPlanError(f"{store.display_uri}/{spec['name']}: episode {trace.episode_id} differs from the plan")
        if trace.episode_id not in output.done:
            todo.append((analyst, trace, episode["input_fingerprint"]))
    log.info(
        "skills_shard_started", shard=index, episodes=spec["records"], already_analysed=len(output.done), writer=output.writer
    )

    def sink(ok: bool, record: dict[str, Any]) -> None:
        if not ok:
            log.warning("trajectory_analysis_failed", episode_id=record.get("episode_id"), error=record.get("error"))
        output.add(record, ok=ok)

    try:
        stopped = eventloop.run(_analyse_until_stopped(analysts, todo, sink))
    finally:
        output.flush()  # on every path, a signal's too: what was analysed is saved before the exit
    if stopped:
        log.warning("skills_shard_interrupted", shard=index, analysed=len(output.done), parts=len(output.entries))
        return ExitCode.RETRYABLE
    name = output.commit(plan_fingerprint=plan.fingerprint, ids_sha256=spec["ids_sha256"])
    log.info("skills_shard_committed", shard=index, marker=name, analysed=len(output.done), errors=output.errors)
    return ExitCode.EPISODES_FAILED if output.errors or len(output.done) < applicable else ExitCode.OK


@dataclass
class SkillsReduceResult:
    summary: dict[str, Any]
    location: str
    output_dir: Path | None
    missing_shards: list[int]

    @property
    def code(self) -> ExitCode:
        if self.missing_shards or self.summary["episodes"]["missing"]:
            return ExitCode.EPISODES_FAILED
        return ExitCode.OK


def _committed(store: ShardedRunStore, plan: SkillsPlan, index: int) -> list[tuple[str, bytes]] | None:
    spec = plan.document["inputs"][index]
    return committed_parts(store, index, plan_fingerprint=plan.fingerprint, ids_sha256=spec["ids_sha256"])


def _wait(store: ShardedRunStore, wait_s: float) -> None:
    """Wait at most ``wait_s`` for the plan, then for every shard to commit (the chart's reducer
    starts beside the workers)."""
    deadline = time.monotonic() + wait_s
    while store.read_bytes(PLAN_NAME) is None and time.monotonic() < deadline:
        time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))
    while store.read_bytes(PLAN_NAME) is not None:
        plan = read_plan(store)
        missing = [index for index in range(plan.shards) if _committed(store, plan, index) is None]
        if not missing or time.monotonic() >= deadline:
            return
        log.info("waiting_for_shards", missing=len(missing))
        time.sleep(min(5.0, max(0.0, deadline - time.monotonic())))


def reduce_skills(uri: str, *, output_dir: Path | None = None, wait_s: float | None = None) -> SkillsReduceResult:
    """The committed shards' analyses → the local stage's four files at the location and, with
    ``output_dir``, there too (where ``skills build`` consolidates and compiles them)."""
    store = ShardedRunStore(uri)
    if wait_s is not None:
        _wait(store, wait_s)
    plan = read_plan(store)
    planned = _planned(plan)
    current = _is_current(planned)
    chosen: dict[str, dict[str, Any]] = {}
    missing_shards = []
    for index in range(plan.shards):
        parts = _committed(store, plan, index)
        if parts is None:
            missing_shards.append(index)
            continue
        for name, data in parts:
            for record in part_records(name, data):
                episode = str(record.get("episode_id"))
                if episode not in planned:
                    continue
                held = chosen.get(episode)
                # The first current analysis wins; without one, the latest failure tells why.
                if held is None or not current(held):
                    chosen[episode] = record
    order = [str(episode["episode_id"]) for episode in plan.document["episodes"]]
    analyses = {episode: chosen[episode] for episode in order if episode in chosen and current(chosen[episode])}
    errors = [chosen[episode] for episode in order if episode in chosen and not current(chosen[episode])]
    wanted = [
        (str(e["episode_id"]), str(e["input_fingerprint"]))
        for e in plan.document["episodes"]
        if e["input_fingerprint"] is not None
    ]
    cards, missing = current_cards(wanted, analyses)
    failure = plan.document["analysts"].get("failure")
    summary = analysis_summary(
        plan.document["analysts"]["success"]["summary"],
        len(order),
        sum(1 for e in plan.document["episodes"] if e["channel"] == "success"),
        cards,
        missing,
        len(analyses),
        len(errors),
        failure["summary"] if failure is not None else None,
    )
    summary["shards"] = {"count": plan.shards, "committed": plan.shards - len(missing_shards), "missing": missing_shards}
    files = {
        ANALYSES_NAME: b"".join(json_bytes(record) + b"\n" for record in analyses.values()),
        ERRORS_NAME: b"".join(json_bytes(record) + b"\n" for record in errors),
        CARDS_NAME: cards_bytes(cards),
        SUMMARY_NAME: summary_bytes(summary),
    }
    for name, data in files.items():
        store.overwrite(name, data)
    if output_dir is not None:
        output_dir.mkdir(parents=True, exist_ok=True)
        for name, data in files.items():
            with replacing(output_dir / name) as out:
                out.write(data)
    return SkillsReduceResult(summary, store.display_uri, output_dir, missing_shards)


def skills_status(uri: str) -> dict[str, Any]:
    """Per-shard progress of an analysis location from its commit markers and part listings; no
    part is read. A committed shard's counts are its marker's (the reducer verifies the parts);
    an uncommitted one shows its parts (one analysis each with the default ``flush_every``)."""
    store = ShardedRunStore(uri)
    plan = read_plan(store)
    rows = shard_rows(store, plan.document["inputs"][: plan.shards], plan.fingerprint, done="analysed")
    committed = [row for row in rows if row["state"] == "committed"]
    summary_over: int | None = None
    data = store.read_bytes(SUMMARY_NAME)
    if data is not None:
        try:
            summary_over = int(orjson.loads(data)["shards"]["committed"])
        except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
            summary_over = None
    return {
        "location": store.display_uri,
        "plan_fingerprint": plan.fingerprint,
        "episodes": len(plan.document["episodes"]),
        "to_analyse": sum(1 for e in plan.document["episodes"] if e["input_fingerprint"] is not None),
        "flush_every": int(plan.document.get("flush_every") or FLUSH_EVERY),
        "committed_shards": len(committed),
        "analysed_in_committed_shards": sum(row["analysed"] for row in committed),
        "summary_over_shards": summary_over,
        "shards": rows,
    }


def format_status(report: dict[str, Any]) -> str:
    """What ``skills status`` prints: a head line and one line per shard."""
    lines = [
        f"skills {report['location']} · {report['plan_fingerprint'][:12]} · {report['episodes']} episodes "
        f"({report['to_analyse']} to analyse) · {report['committed_shards']}/{len(report['shards'])} shards committed "
        f"({report['analysed_in_committed_shards']} analysed) · summary over "
        + ("no reduce yet" if report["summary_over_shards"] is None else f"{report['summary_over_shards']} shards")
    ]
    for row in report["shards"]:
        if row["state"] == "committed":
            detail = f"{row['analysed']} analysed" + (f" · errors {row['errors']}" if row["errors"] else "")
        elif row["parts"]:
            detail = f"at most {row['parts'] * report['flush_every']} analyses in {row['parts']} parts"
        else:
            detail = f"{row['episodes']} episodes"
        lines.append(f"  shard {row['shard']:>5}  {row['state']:<14} {detail}")
    return "\n".join(lines)


def format_reduce(result: SkillsReduceResult) -> str:
    """What ``skills reduce`` prints."""
    s, e = result.summary, result.summary["episodes"]
    shards = s["shards"]
    if "failure" in e:
        analysed = f"{e['analysed']} of {e['total']} trajectories analysed ({e['success']} successful, {e['failure']} failed)"
    else:  # a plan frozen without the failure analyst
        analysed = f"{e['analysed']} of {e['success']} successful trajectories analysed"
    statuses = (s.get("failure_cards") or {}).get("status") or {}
    proposals = sum(count for status, count in statuses.items() if status != "NO_PROPOSAL")
    lines = [
        f"analysis  {analysed}, {s['cards']['eligible']} eligible cards of {s['cards']['total']}; "
        + (
            f"{proposals} failure proposals, {statuses.get('NO_PROPOSAL', 0)} NO_PROPOSAL"
            if "failure" in e
            else f"{e['failure_pending']} failed trajectories not analysed"
        ),
        f"shards    {shards['committed']} of {shards['count']} committed"
        + (f", missing {shards['missing']}" if shards["missing"] else ""),
        f"files     {result.location}" + (f" and {result.output_dir}" if result.output_dir is not None else ""),
    ]
    return "\n".join(lines)


def shop_configured(config: SkillsConfig) -> bool:
    """Whether SKILLS.yaml (or ``SHOPSIMRL_ENV_BASE_URL``, which sets it) names the failure
    analyst's ShopSimulator; the section's default address is not a shop anyone set up."""
    return "base_url" in config.environment.model_fields_set


def skills_wait_ready(config: SkillsConfig, *, timeout: float, interval: float, processes: int = 1) -> ServiceCheck:
    """Probe until the analyst server lists ``analyst_model.name`` and, when a shop is
    configured (:func:`shop_configured`), ShopSimulator says ready, at most ``timeout`` seconds:
    the last check. A worker pod's init container, so that an analyst still loading does not turn
    a shard's trajectories into error records. A shop without a free slot counts as ready: other
    shards hold slots legitimately. ``processes``: worker pods at once (the slot sizing warning)."""
    settings = analyst_config(config).model
    model = OpenAICompatibleChatModel(settings)
    model.check_api_key()
    environment = ShopSimulatorEnvironment(config.environment.settings()) if shop_configured(config) else None

    async def once() -> ServiceCheck:
        not_ready = await probe_model(model, settings)
        if not_ready is not None:
            return not_ready
        served = f"{settings.model!r} is served"
        if environment is None:
            return ServiceCheck(True, None, f"{served}; no ShopSimulator configured (environment.base_url): not probed")
        check = await probe_environment(
            environment,
            concurrency=config.experiment.concurrency,
            processes=processes,
            configured_leases=None,
            require_free_slot=False,
        )
        if check.ready:
            check.detail = f"{served}; ShopSimulator {check.detail}"
        return check

    async def wait() -> ServiceCheck:
        try:
            return await poll_until_ready(once, timeout=timeout, interval=interval)
        finally:
            await model.aclose()
            if environment is not None:
                await environment.aclose()

    return eventloop.run(wait())
