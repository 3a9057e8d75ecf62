"""The all-wrong triage: why did every sample of a GRPO group fail?

A group whose samples all failed gives GRPO nothing to learn from (no reward spread). It is also
the failure frontier the skill builder analyses: can the model do the task with every skill of the
curriculum, or not even then? When the **last** sample of a group (slime's ``group_index``; a
group has ``args.n_samples_per_prompt`` samples) finishes, :class:`GroupTriage` classifies the
group and writes ``<run dir>/training/triage/group-<group:09d>.json`` (schema
:data:`TRIAGE_SCHEMA_VERSION`, written atomically; on an object store the object of that name
under the run's location, created once), one file per group:

==========================================  ========================================================
classification                              when
==========================================  ========================================================
``not_frontier``                            a sample succeeded (``r_success`` 1)
``environment_or_runtime_error``            a sample has no score (abort placeholder: shop down,
                                            lease lost, model failing): no diagnostic is run; or
                                            the diagnostic itself ended without a score
``model_internalization_deficit``           all scored and failed; the diagnostic with every
                                            curriculum chunk succeeded
``full_skill_failure_pending_analysis``     all scored and failed; the diagnostic failed too
``all_wrong_retry_disabled``                all scored and failed; no diagnostic
                                            (``triage.full_skill_retry`` false, or no chunk to
                                            give: ``diagnostic_skipped`` says which)
==========================================  ========================================================

**The diagnostic** is one more episode of the group's task with every curriculum chunk
(``TrainingWorker.full_skills()``), played by the same worker and engine. It is never returned to
the trainer: its trace is saved in a run directory of its own, ``<run dir>/training/triage/
diagnostics/`` (``traces.jsonl`` and ``training/samples.jsonl`` like the training run's), which
the research tools read (``shopsimrl show``/``view``/``labels``/``export``). Its episode id is
``task-<task>__sample-<group>`` (the sample number there is the **group** index: one diagnostic
per group), so nothing in the training run's traces collides with it and its success never counts
in the training run's figures; its seed is :func:`diagnostic_seed`, drawn apart from every
training sample's.

**Group completion** is counted per group by distinct sample ``index`` in the rollout process's
event loop (:class:`GroupTracker`), without an ``await`` between counting and deciding, so exactly
one sample is the last however the group's samples interleave. A sample slime cancels (the
surplus of an over-sampling round) or whose rollout raised counts as *lost*: the group closes
when its last sample is done or lost, and a group with a lost sample is not triaged (slime never
trains on it; nothing is written). A group whose ``triage.json`` exists is not triaged again (a
rollout process restarted from a checkpoint plays the same groups again): the file keeps the first
triage and no second diagnostic runs. The last sample's call waits for the diagnostic and the
write (so a rollout step never ends with a diagnostic still running against a server slime is
about to pause for its weight update); a cancelled diagnostic writes nothing.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import structlog

from shopsimrl.config import ConfigError
from shopsimrl.storage.local import atomic_write_json
from shopsimrl.storage.objectstore import ObjectStore
from shopsimrl.training.rollout import EpisodeRollout
from shopsimrl.training.samples import curriculum_of

__all__ = [
    "CLASSIFICATIONS",
    "DIAGNOSTICS_DIR",
    "INTERNALIZATION_DEFICIT",
    "NOT_FRONTIER",
    "PENDING_ANALYSIS",
    "RETRY_DISABLED",
    "RUNTIME_ERROR",
    "TRIAGE_DIR",
    "TRIAGE_SCHEMA_VERSION",
    "EpisodeOutcome",
    "GroupTracker",
    "GroupTriage",
    "TriageRecords",
    "classify",
    "diagnostic_seed",
    "read_triage",
    "triage_path",
]

_log = structlog.get_logger("shopsimrl.training.triage")

TRIAGE_SCHEMA_VERSION = "shopsimrl-training-failure-triage-v1"
TRIAGE_DIR = Path("training") / "triage"
"""Under the run directory: one ``group-<group:09d>.json`` per triaged group."""
DIAGNOSTICS_DIR = TRIAGE_DIR / "diagnostics"
"""Under the run directory: the run directory of the diagnostic rollouts."""

NOT_FRONTIER = "not_frontier"
RUNTIME_ERROR = "environment_or_runtime_error"
INTERNALIZATION_DEFICIT = "model_internalization_deficit"
PENDING_ANALYSIS = "full_skill_failure_pending_analysis"
RETRY_DISABLED = "all_wrong_retry_disabled"
CLASSIFICATIONS = (NOT_FRONTIER, RUNTIME_ERROR, INTERNALIZATION_DEFICIT, PENDING_ANALYSIS, RETRY_DISABLED)


def triage_path(run_dir: str | Path, group_index: int) -> Path:
    return Path(run_dir) / TRIAGE_DIR / f"group-{group_index:09d}.json"


class TriageRecords:
    """Where a run's triage records are: files under a local run directory, or objects under an
    object store location (any URL with ``://``, as ``run.output_dir``)."""

    def __init__(self, location: str | Path) -> None:
        text = str(location)
        self._objects = ObjectStore(text) if "://" in text else None
        self._dir = None if self._objects is not None else Path(text)

    @staticmethod
    def _rel(group_index: int) -> str:
        return f"{TRIAGE_DIR.as_posix()}/group-{group_index:09d}.json"

    def where(self, group_index: int) -> str:
        if self._objects is not None:
            return f"{self._objects.display_uri}/{self._rel(group_index)}"
        assert self._dir is not None
        return str(triage_path(self._dir, group_index))

    def exists(self, group_index: int) -> bool:
        """Blocking I/O on an object store: call it off the event loop."""
        return self.read(group_index) is not None

    def read(self, group_index: int) -> bytes | None:
        if self._objects is not None:
            return self._objects.read_bytes(self._rel(group_index))
        assert self._dir is not None
        try:
            return triage_path(self._dir, group_index).read_bytes()
        except FileNotFoundError:
            return None

    def write(self, group_index: int, record: dict[str, Any]) -> None:
        """Whole or not at all. On an object store create-only: a record already there stays."""
        if self._objects is None:
            assert self._dir is not None
            atomic_write_json(triage_path(self._dir, group_index), record)
            return
        data = (json.dumps(record, ensure_ascii=False, indent=2, allow_nan=False) + "\n").encode("utf-8")
        if not self._objects.create(self._rel(group_index), data):
            _log.warning("triage_exists", group_index=group_index, where=self.where(group_index))


def diagnostic_seed(run_seed: int, task_id: int, group_index: int) -> int:
    """The diagnostic's episode seed: apart from every training sample's ``sha256(seed:task:index)``."""
    digest = hashlib.sha256(f"{run_seed}:triage:{task_id}:{group_index}".encode("ascii")).digest()
    return int.from_bytes(digest[:4], "big")


@dataclass(frozen=True)
class EpisodeOutcome:
    """What triage keeps of one rollout (a sample of the group, or the diagnostic)."""

    index: int
    task_id: int
    episode_id: str
    attempt: int | None
    seed: int
    rollout_id: int
    scored: bool
    reward: dict[str, float] | None
    status: str
    failure_class: str | None
    skills: list[str]
    curriculum: dict[str, Any] | None

    @classmethod
    def of(cls, rollout: EpisodeRollout, *, index: int) -> EpisodeOutcome:
        trace = rollout.trace
        first = rollout.samples[0] if rollout.samples else None
        return cls(
            index=index,
            task_id=trace.job.task_id,
            episode_id=trace.episode_id,
            attempt=trace.attempt,
            seed=trace.job.seed,
            rollout_id=first.rollout_id if first is not None else index,
            scored=rollout.scored,
            reward=dict(first.reward) if rollout.scored and first is not None else None,
            status=trace.status,
            failure_class=trace.failure_class,
            skills=[str(skill.skill_id) for skill in trace.selected_skills],
            curriculum=curriculum_of(first.metadata) if first is not None else None,
        )

    @property
    def succeeded(self) -> bool:
        return self.scored and self.reward is not None and self.reward.get("r_success") == 1.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "episode_id": self.episode_id,
            "attempt": self.attempt,
            "seed": self.seed,
            "rollout_id": self.rollout_id,
            "scored": self.scored,
            "reward": self.reward,
            "succeeded": self.succeeded,
            "status": self.status,
            "failure_class": self.failure_class,
            "skills": list(self.skills),
            "curriculum": self.curriculum,
        }


@dataclass
class _Open:
    size: int
    outcomes: dict[int, EpisodeOutcome] = field(default_factory=dict)
    lost: set[int] = field(default_factory=set)

    @property
    def complete(self) -> bool:
        return len(self.outcomes) + len(self.lost) >= self.size


class GroupTracker:
    """Samples per group until the group's last one is done (module docstring). Not thread-safe:
    one event loop calls it, and no method awaits."""

    def __init__(self) -> None:
        self._open: dict[int, _Open] = {}

    def _group(self, group_index: int, size: int) -> _Open:
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ConfigError(f"the group size (slime's n_samples_per_prompt) must be a positive integer, got {size!r}")
        state = self._open.setdefault(group_index, _Open(size))
        if state.size != size:
            raise ConfigError(
                f"group {group_index}: a sample says the group has {size} samples, an earlier one said {state.size}"
            )
        return state

    def finished(self, group_index: int, size: int, outcome: EpisodeOutcome) -> list[EpisodeOutcome] | None:
        """Record a finished sample; the group's outcomes (by index) when this one completes an
        untouched group, else None (not complete yet, or a sample was lost)."""
        state = self._group(group_index, size)
        state.lost.discard(outcome.index)
        state.outcomes[outcome.index] = outcome
        return self._close(group_index, state)

    def lost(self, group_index: int, size: int, index: int) -> None:
        """Record a sample that will not finish (cancelled, or its rollout raised)."""
        state = self._group(group_index, size)
        if index not in state.outcomes:
            state.lost.add(index)
        self._close(group_index, state)

    def _close(self, group_index: int, state: _Open) -> list[EpisodeOutcome] | None:
        if not state.complete:
            return None
        del self._open[group_index]
        if state.lost:
            _log.info("triage_skipped_lost_samples", group_index=group_index, lost=sorted(state.lost))
            return None
        return [state.outcomes[index] for index in sorted(state.outcomes)]

    @property
    def open_groups(self) -> dict[int, tuple[int, int]]:
        """Group → (samples done, samples lost), for the groups still open."""
        return {group: (len(state.outcomes), len(state.lost)) for group, state in self._open.items()}


def classify(outcomes: list[EpisodeOutcome], diagnostic: EpisodeOutcome | None, *, retried: bool) -> str:
    """The group's classification (module docstring) from its samples and the diagnostic."""
    if not all(outcome.scored for outcome in outcomes):
        return RUNTIME_ERROR
    if any(outcome.succeeded for outcome in outcomes):
        return NOT_FRONTIER
    if not retried:
        return RETRY_DISABLED
    if diagnostic is None or not diagnostic.scored:
        return RUNTIME_ERROR
    return INTERNALIZATION_DEFICIT if diagnostic.succeeded else PENDING_ANALYSIS


Diagnose = Callable[[int, int], Awaitable[EpisodeRollout]]
"""``(task_id, group_index)`` → the diagnostic rollout, saved in the diagnostics run directory."""


class GroupTriage:
    """Triage of the groups of one run directory (module docstring)."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        run_name: str,
        full_skill_retry: bool,
        diagnose: Diagnose,
        has_chunks: Callable[[], bool],
    ) -> None:
        self.records = TriageRecords(run_dir)
        """The run directory, or the object store location, the records go to."""
        self.run_name = run_name
        self.full_skill_retry = full_skill_retry
        self.diagnose = diagnose
        self.has_chunks = has_chunks
        self.tracker = GroupTracker()
        self.running: set[int] = set()
        """Groups whose triage is under way (a second completion of one of them is skipped)."""
        self.diagnostics_started = 0
        self.skipped: Counter[str] = Counter()
        """Completed groups not triaged, by why: ``running`` (already under way), ``exists`` (triaged before)."""

    def sample_lost(self, group_index: int, size: int, index: int) -> None:
        self.tracker.lost(group_index, size, index)

    async def sample_finished(self, group_index: int, size: int, rollout: EpisodeRollout, *, index: int) -> dict[str, Any] | None:
        """Record a finished sample; when it is the group's last, triage the group and return the
        record written (None otherwise, or when the group was triaged before)."""
        outcomes = self.tracker.finished(group_index, size, EpisodeOutcome.of(rollout, index=index))
        if outcomes is None:
            return None
        # Decided without an await since the count: one caller per completed group gets here.
        if group_index in self.running:
            _log.warning("triage_already_running", group_index=group_index)
            self.skipped["running"] += 1
            return None
        self.running.add(group_index)
        try:
            if await asyncio.to_thread(self.records.exists, group_index):
                _log.info("triage_exists", group_index=group_index, path=self.records.where(group_index))
                self.skipped["exists"] += 1
                return None
            return await self._triage(group_index, size, outcomes)
        finally:
            self.running.discard(group_index)

    async def _triage(self, group_index: int, size: int, outcomes: list[EpisodeOutcome]) -> dict[str, Any]:
        tasks = sorted({outcome.task_id for outcome in outcomes})
        if len(tasks) != 1:
            raise ConfigError(f"group {group_index} holds samples of tasks {tasks}; a GRPO group is one prompt")
        task_id = tasks[0]
        all_wrong = all(outcome.scored and not outcome.succeeded for outcome in outcomes)
        skipped: str | None = None
        diagnostic: EpisodeOutcome | None = None
        if not all(outcome.scored for outcome in outcomes):
            skipped = "group_not_scored"
        elif not all_wrong:
            skipped = "not_all_wrong"
        elif not self.full_skill_retry:
            skipped = "retry_disabled"
        elif not self.has_chunks():
            skipped = "no_chunks"
        else:
            self.diagnostics_started += 1
            rollout = await self.diagnose(task_id, group_index)
            diagnostic = EpisodeOutcome.of(rollout, index=group_index)
        retried = diagnostic is not None
        classification = classify(outcomes, diagnostic, retried=retried)
        curricula = [outcome.curriculum for outcome in outcomes if outcome.curriculum is not None]
        record: dict[str, Any] = {
            "schema_version": TRIAGE_SCHEMA_VERSION,
            "run": self.run_name,
            "group_index": group_index,
            "task_id": task_id,
            "classification": classification,
            "all_wrong": all_wrong,
            "group_size": size,
            "samples": len(outcomes),
            "scored": sum(outcome.scored for outcome in outcomes),
            "successes": sum(outcome.succeeded for outcome in outcomes),
            "episode_ids": [outcome.episode_id for outcome in outcomes],
            "episodes": [outcome.to_dict() for outcome in outcomes],
            "skills": sorted({skill for outcome in outcomes for skill in outcome.skills}),
            "curriculum": curricula[0] if curricula else None,
            "full_skill_retry": self.full_skill_retry,
            "diagnostic_skipped": skipped,
            "diagnostic": None if diagnostic is None else {**diagnostic.to_dict(), "run_dir": DIAGNOSTICS_DIR.as_posix()},
            "written_at": datetime.now(UTC).isoformat(timespec="seconds").replace("+00:00", "Z"),
        }
        # Off the loop; a cancellation while it runs still leaves a whole file or none.
        await asyncio.to_thread(self.records.write, group_index, record)
        _log.info("group_triaged", group_index=group_index, task_id=task_id, classification=classification)
        return record


def read_triage(run_dir: str | Path, group_indices: Mapping[int, Any] | list[int] | set[int]) -> dict[int, dict[str, Any]]:
    """The triage records of ``group_indices`` that exist, in a run directory or at an object store
    location (a torn or foreign record is skipped with a warning)."""
    records = TriageRecords(run_dir)
    found: dict[int, dict[str, Any]] = {}
    for group_index in group_indices:
        try:
            data = records.read(group_index)
        except OSError as exc:
            _log.warning("triage_unreadable", path=records.where(group_index), error=str(exc))
            continue
        if data is None:
            continue
        try:
            value = json.loads(data.decode("utf-8"))
        except ValueError as exc:
            _log.warning("triage_unreadable", path=records.where(group_index), error=str(exc))
            continue
        if not isinstance(value, dict) or value.get("schema_version") != TRIAGE_SCHEMA_VERSION:
            _log.warning("triage_unreadable", path=records.where(group_index), error="not a triage record of this schema")
            continue
        found[group_index] = value
    return found
