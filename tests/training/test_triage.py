"""The all-wrong triage: real rollouts on the testbed (shop and token endpoint over HTTP).

The testbed policy runs with ``options_need_skill``: it chooses the options a user wants only when
a skill in its prompt carries ``[[testbed:choose-options]]`` (docs/testbed.md, "Skills"). So a
group played without skills can fail on every sample while the diagnostic with that chunk
succeeds. The (task, group) pairs below were found by playing them (run seed 20260901; samples
``4g..4g+3`` with their episode seeds, the diagnostic with :func:`diagnostic_seed`); each test
asserts the outcomes it relies on, so a changed policy fails loudly instead of testing nothing.

Interleavings are forced with events and barriers (never with sleeps): samples held after their
episode until the whole group is there, a diagnostic held until another group's is running too, a
sample parked inside a model call when it is cancelled.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from shopsimrl.config import ConfigError
from shopsimrl.environment import ShopSimulatorEnvironment, ShopSimulatorSettings
from shopsimrl.planning import episode_seed
from shopsimrl.skills import NoSkills
from shopsimrl.storage.reading import open_run
from shopsimrl.testbed.policy import PolicySettings
from shopsimrl.testbed.policy import create_app as create_policy_app
from shopsimrl.testbed.serving import running_server
from shopsimrl.testbed.shop import ShopSettings
from shopsimrl.testbed.shop import create_app as create_shop_app
from shopsimrl.training.config import load_training_config
from shopsimrl.training.rollout import EpisodeRollout
from shopsimrl.training.store import read_training_samples
from shopsimrl.training.triage import (
    DIAGNOSTICS_DIR,
    INTERNALIZATION_DEFICIT,
    NOT_FRONTIER,
    PENDING_ANALYSIS,
    RETRY_DISABLED,
    RUNTIME_ERROR,
    TRIAGE_SCHEMA_VERSION,
    EpisodeOutcome,
    GroupTracker,
    classify,
    diagnostic_seed,
    triage_path,
)
from shopsimrl.training.worker import Sampling, TrainingWorker
from tests.sharded.conftest import cli

REPO = Path(__file__).resolve().parents[2]
SPLITS = REPO / "configs/splits/persona_splits.v1.json"
SAMPLING = Sampling(temperature=0.6, max_new_tokens=512)
RUN_SEED = 20260901
N = 4

# Played without skills, every sample fails; the diagnostic with choose-options succeeds.
DEFICIT = [(9, 0), (9, 1)]
# Every sample fails, and so does the diagnostic with choose-options.
PENDING = (3, 1)
# One sample of the group succeeds without skills.
FRONTIERLESS = (6, 2)


def _bank(tmp_path: Path) -> Path:
    """The gate demo's helpful chunk alone: every chunk of the 'curriculum' the diagnostic gets."""
    bank = json.loads((REPO / "configs/gate_demo/initial_skillbank.json").read_text(encoding="utf-8"))
    bank["skills"] = [skill for skill in bank["skills"] if skill["skill_id"] == "choose-options"]
    path = tmp_path / "bank.json"
    path.write_text(json.dumps(bank, ensure_ascii=False), encoding="utf-8")
    return path


async def _no_wait(seconds: float) -> None:
    """Backoff waits are skipped: the attempts, not the time between them, are under test."""


@contextmanager
def _services(slots: int = 8, **policy: Any) -> Iterator[tuple[str, str]]:
    with (
        running_server(create_shop_app(ShopSettings(slots=slots))) as shop,
        running_server(create_policy_app(PolicySettings(token_endpoint=True, options_need_skill=True, **policy))) as model,
    ):
        yield shop, model


def _config(tmp_path: Path, shop: str, *, bank: Path | None, retry: bool = True, concurrency: int = 8, retries: int = 5) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "training.yaml"
    path.write_text(
        f"run: {{name: round-001, output_dir: {tmp_path / 'runs'}, seed: {RUN_SEED}, concurrency: {concurrency}}}\n"
        f"tasks: {{split_file: {SPLITS}, split: train}}\n"
        f"environment: {{base_url: '{shop}', persona: true}}\n"
        f"model: {{name: testbed-policy, max_retries: {retries}}}\n"
        f"skills: {{path: {json.dumps(str(bank)) if bank else 'null'}}}\n"
        f"triage: {{full_skill_retry: {'true' if retry else 'false'}}}\n"
    )
    return path


def _worker(config: Path, model_url: str) -> TrainingWorker:
    return TrainingWorker(load_training_config(config), base_url=model_url, sampling=SAMPLING, sleep=_no_wait)


def _group(worker: TrainingWorker, task: int, group: int) -> list[Awaitable[EpisodeRollout]]:
    # Skill-free samples (the curriculum's skill_free draw); the diagnostic gets full_skills().
    return [
        worker.rollout(task_id=task, index=group * N + i, group_index=group, group_size=N, skills=NoSkills()) for i in range(N)
    ]


def _successes(rollouts: list[EpisodeRollout]) -> list[float]:
    return [r.samples[0].reward["r_success"] for r in rollouts]


def _triage(worker: TrainingWorker, group: int) -> dict[str, Any]:
    return dict(json.loads(triage_path(worker.config.run_dir, group).read_text(encoding="utf-8")))


async def _free_slots(shop: str) -> int | None:
    environment = ShopSimulatorEnvironment(ShopSimulatorSettings(base_url=shop, persona=True))
    try:
        return (await environment.slot_usage()).free_slots
    finally:
        await environment.aclose()


def _diagnostic_traces(worker: TrainingWorker) -> list[Any]:
    directory = worker.config.run_dir / DIAGNOSTICS_DIR
    return list(open_run(directory).records()) if (directory / "traces.jsonl").exists() else []


# --------------------------------------------------------------------------- pure parts


def _outcome(index: int, *, scored: bool = True, success: float = 0.0, task: int = 1) -> EpisodeOutcome:
    return EpisodeOutcome(
        index=index,
        task_id=task,
        episode_id=f"task-{task:06d}__sample-{index:03d}",
        attempt=1,
        seed=index,
        rollout_id=index,
        scored=scored,
        reward={"reward": success, "r_strict": success, "r_success": success} if scored else None,
        status="completed" if scored else "failed",
        failure_class=None if scored else "infrastructure",
        skills=[],
        curriculum=None,
    )


def test_classification_follows_the_samples_then_the_diagnostic() -> None:
    wrong = [_outcome(0), _outcome(1)]
    assert classify([_outcome(0), _outcome(1, success=1.0)], None, retried=False) == NOT_FRONTIER
    assert classify([_outcome(0), _outcome(1, scored=False)], None, retried=True) == RUNTIME_ERROR
    # An unscored sample wins over a success: the group is not a clean observation of the policy.
    assert classify([_outcome(0, success=1.0), _outcome(1, scored=False)], None, retried=True) == RUNTIME_ERROR
    assert classify(wrong, None, retried=False) == RETRY_DISABLED
    assert classify(wrong, _outcome(9, success=1.0), retried=True) == INTERNALIZATION_DEFICIT
    assert classify(wrong, _outcome(9), retried=True) == PENDING_ANALYSIS
    assert classify(wrong, _outcome(9, scored=False), retried=True) == RUNTIME_ERROR


def test_a_group_closes_once_on_its_last_sample_and_never_with_a_lost_one() -> None:
    tracker = GroupTracker()
    assert tracker.finished(7, 3, _outcome(2)) is None
    assert tracker.finished(7, 3, _outcome(2)) is None, "the same sample twice counts once"
    assert tracker.finished(7, 3, _outcome(0)) is None
    done = tracker.finished(7, 3, _outcome(1))
    assert done is not None and [o.index for o in done] == [0, 1, 2]
    assert tracker.open_groups == {}
    # A cancelled sample closes the group without a triage, whichever sample comes last.
    tracker.lost(8, 2, 4)
    assert tracker.finished(8, 2, _outcome(5)) is None
    assert tracker.finished(9, 2, _outcome(6)) is None
    tracker.lost(9, 2, 7)
    assert tracker.open_groups == {}
    with pytest.raises(ConfigError, match="group 10: a sample says the group has 3 samples, an earlier one said 2"):
        tracker.finished(10, 2, _outcome(8))
        tracker.finished(10, 3, _outcome(9))
    with pytest.raises(ConfigError, match="n_samples_per_prompt"):
        tracker.finished(11, 0, _outcome(10))


# --------------------------------------------------------------------------- real rollouts

slow = pytest.mark.slow


@slow
async def test_an_all_wrong_group_whose_diagnostic_succeeds_is_an_internalization_deficit(tmp_path: Path) -> None:
    task, group = DEFICIT[0]
    with _services() as (shop, model_url):
        worker = _worker(_config(tmp_path, shop, bank=_bank(tmp_path)), model_url)
        await worker.start()
        try:
            rollouts = await asyncio.gather(*_group(worker, task, group))
        finally:
            await worker.aclose()
        free = await _free_slots(shop)
    assert free == 8, "every lease was released, the diagnostic's too"
    assert _successes(rollouts) == [0.0] * N and all(r.scored for r in rollouts)

    record = _triage(worker, group)
    diagnostic = record["diagnostic"]
    assert record["schema_version"] == TRIAGE_SCHEMA_VERSION
    assert record["classification"] == INTERNALIZATION_DEFICIT and record["all_wrong"] is True
    assert (record["run"], record["group_index"], record["task_id"]) == ("round-001", group, task)
    assert (record["group_size"], record["samples"], record["scored"], record["successes"]) == (N, N, N, 0)
    assert record["episode_ids"] == [f"task-{task:06d}__sample-{group * N + i:03d}" for i in range(N)]
    assert [e["seed"] for e in record["episodes"]] == [episode_seed(RUN_SEED, task, group * N + i) for i in range(N)]
    assert all(e["skills"] == [] and e["scored"] and not e["succeeded"] for e in record["episodes"])
    assert record["skills"] == [] and record["curriculum"] is None and record["diagnostic_skipped"] is None
    assert diagnostic["episode_id"] == f"task-{task:06d}__sample-{group:03d}" and diagnostic["attempt"] == 1
    assert diagnostic["skills"] == ["choose-options"] and diagnostic["succeeded"] is True
    assert diagnostic["seed"] == diagnostic_seed(RUN_SEED, task, group)
    assert diagnostic["run_dir"] == "training/triage/diagnostics"

    # The diagnostic is in its own run directory, which the research tools read; the training
    # run holds the group's four rollouts only.
    training = list(open_run(worker.config.run_dir).records())
    assert sorted(t.episode_id for t in training) == record["episode_ids"]
    (trace,) = _diagnostic_traces(worker)
    assert trace.episode_id == diagnostic["episode_id"] and trace.final.reward_detail["r_success"] == 1.0
    assert [s.skill_id for s in trace.selected_skills] == ["choose-options"]
    assert read_training_samples(worker.config.run_dir / DIAGNOSTICS_DIR).missing == []
    shown = cli("show", str(worker.config.run_dir / DIAGNOSTICS_DIR), diagnostic["episode_id"])
    assert shown.returncode == 0 and "choose-options" in shown.stdout, shown.stderr


@slow
@pytest.mark.parametrize(("retry", "with_bank", "skipped"), [(False, True, "retry_disabled"), (True, False, "no_chunks")])
async def test_an_all_wrong_group_without_a_diagnostic_is_retry_disabled(
    tmp_path: Path, retry: bool, with_bank: bool, skipped: str
) -> None:
    task, group = DEFICIT[0]
    with _services() as (shop, model_url):
        worker = _worker(_config(tmp_path, shop, bank=_bank(tmp_path) if with_bank else None, retry=retry), model_url)
        await worker.start()
        try:
            rollouts = await asyncio.gather(*_group(worker, task, group))
        finally:
            await worker.aclose()
    assert _successes(rollouts) == [0.0] * N
    record = _triage(worker, group)
    assert record["classification"] == RETRY_DISABLED and record["all_wrong"] is True
    assert record["diagnostic"] is None and record["diagnostic_skipped"] == skipped
    assert record["full_skill_retry"] is retry
    assert _diagnostic_traces(worker) == [] and worker.triage.diagnostics_started == 0


@slow
async def test_a_group_of_abort_placeholders_is_a_runtime_error_without_a_diagnostic(tmp_path: Path) -> None:
    with _services(rate_500=1.0) as (shop, model_url):
        worker = _worker(_config(tmp_path, shop, bank=_bank(tmp_path), retries=2), model_url)
        await worker.start()
        try:
            rollouts = await asyncio.gather(*_group(worker, *DEFICIT[0]))
        finally:
            await worker.aclose()
    assert not any(r.scored for r in rollouts)
    record = _triage(worker, DEFICIT[0][1])
    assert record["classification"] == RUNTIME_ERROR and record["all_wrong"] is False
    assert record["diagnostic"] is None and record["diagnostic_skipped"] == "group_not_scored"
    assert record["scored"] == 0 and {e["failure_class"] for e in record["episodes"]} == {"infrastructure"}
    assert _diagnostic_traces(worker) == []


@slow
async def test_samples_finishing_together_and_two_diagnostics_at_once_triage_each_group_once(tmp_path: Path) -> None:
    (task, first), (_, second) = DEFICIT
    with _services() as (shop, model_url):
        worker = _worker(_config(tmp_path, shop, bank=_bank(tmp_path), concurrency=8), model_url)
        # Every sample of both groups is held after its episode until all eight are there.
        barrier = asyncio.Barrier(2 * N)
        play = worker.rollouts.run
        held = 0

        async def held_run(job: Any, **kwargs: Any) -> EpisodeRollout:
            nonlocal held
            rollout = await play(job, **kwargs)
            if held < 2 * N and not (kwargs.get("metadata") or {}).get("triage_diagnostic"):
                held += 1
                await barrier.wait()
            return rollout

        # Each diagnostic waits until both have started: they run at the same time.
        both_started = asyncio.Barrier(2)
        diagnose = worker.triage.diagnose
        replayed: list[EpisodeRollout] = []

        async def held_diagnose(task_id: int, group_index: int) -> EpisodeRollout:
            await both_started.wait()
            if group_index == first:
                # While group `first` is being triaged, its samples finish once more (a replay):
                # the group completes again but is not triaged twice.
                replayed.extend(await asyncio.gather(*_group(worker, task, first)))
            return await diagnose(task_id, group_index)

        worker.rollouts.run = held_run  # type: ignore[method-assign]
        worker.triage.diagnose = held_diagnose
        await worker.start()
        try:
            rollouts = await asyncio.gather(*_group(worker, task, first), *_group(worker, task, second))
        finally:
            await worker.aclose()
    assert _successes(rollouts) == [0.0] * (2 * N)
    assert worker.triage.diagnostics_started == 2 and worker.triage.running == set()
    assert worker.triage.tracker.open_groups == {}
    assert len(replayed) == N and all(r.trace.attempt == 2 for r in replayed), "the replay really ran"
    assert worker.triage.skipped["running"] == 1, "the replayed group completed while its triage ran"
    for group in (first, second):
        record = _triage(worker, group)
        assert record["classification"] == INTERNALIZATION_DEFICIT and record["group_index"] == group
        assert [e["attempt"] for e in record["episodes"]] == [1] * N
    traces = _diagnostic_traces(worker)
    assert sorted(t.episode_id for t in traces) == [f"task-{task:06d}__sample-{g:03d}" for g in (first, second)]


def _park(worker: TrainingWorker, session_prefix: str) -> asyncio.Event:
    """The episode whose model session id starts with ``session_prefix`` parks in its first model
    call (holding its lease) until cancelled; the returned event says it is parked."""
    parked = asyncio.Event()
    open_session = worker.model.session

    def session(session_id: str) -> Any:
        opened = open_session(session_id)
        if session_id.startswith(session_prefix):

            async def generate(*args: Any, **kwargs: Any) -> Any:
                parked.set()
                await asyncio.Event().wait()  # never set: only a cancel ends it

            opened.generate = generate  # type: ignore[method-assign]
        return opened

    worker.model.session = session  # type: ignore[method-assign]
    return parked


@slow
async def test_a_cancelled_sample_or_diagnostic_leaves_no_triage_and_the_replay_triages(tmp_path: Path) -> None:
    (task, first), (_, second) = DEFICIT
    with _services() as (shop, model_url):
        worker = _worker(_config(tmp_path, shop, bank=_bank(tmp_path)), model_url)
        await worker.start()
        try:
            # 1. slime cancels a sample of group `first` mid-episode, after its siblings finished.
            victim = first * N + 2
            parked = _park(worker, f"task-{task:06d}__sample-{victim:03d}-")
            tasks = [asyncio.ensure_future(rollout) for rollout in _group(worker, task, first)]
            await parked.wait()
            siblings = [t for i, t in enumerate(tasks) if i != 2]
            await asyncio.gather(*siblings)
            assert worker.triage.tracker.open_groups == {first: (N - 1, 0)}
            held_free = await _free_slots(shop)
            tasks[2].cancel()
            (cancelled,) = await asyncio.gather(tasks[2], return_exceptions=True)
            assert isinstance(cancelled, asyncio.CancelledError)
            assert worker.triage.tracker.open_groups == {}, "the group closed on its lost sample"
            assert not triage_path(worker.config.run_dir, first).exists()
            assert await _free_slots(shop) == 8 and held_free == 7

            # 2. The last sample of group `second` is cancelled while its diagnostic is mid-episode.
            parked = _park(worker, f"task-{task:06d}__sample-{second:03d}-{second}")
            tasks = [asyncio.ensure_future(rollout) for rollout in _group(worker, task, second)]
            await parked.wait()
            pending = [t for t in tasks if not t.done()]
            assert len(pending) == 1, "only the group's last sample waits: for its diagnostic"
            assert await _free_slots(shop) == 7, "the diagnostic holds a lease"
            pending[0].cancel()
            results = await asyncio.gather(*tasks, return_exceptions=True)
            assert sum(isinstance(r, asyncio.CancelledError) for r in results) == 1
            assert not triage_path(worker.config.run_dir, second).exists() and worker.triage.running == set()
            assert _diagnostic_traces(worker) == [], "a cancelled diagnostic leaves no trace"
            assert await _free_slots(shop) == 8

            # 3. slime plays group `second` again: now it is triaged.
            del worker.model.session  # the parking wrapper: back to the class's method
            replay = await asyncio.gather(*_group(worker, task, second))
        finally:
            await worker.aclose()
    assert all(r.trace.attempt == 2 for r in replay)
    record = _triage(worker, second)
    assert record["classification"] == INTERNALIZATION_DEFICIT
    assert [e["attempt"] for e in record["episodes"]] == [2] * N and record["diagnostic"]["attempt"] == 1
    assert len(_diagnostic_traces(worker)) == 1
    # The cancelled rollouts left no trace; every finished one did.
    traces = list(open_run(worker.config.run_dir).records())
    assert f"task-{task:06d}__sample-{victim:03d}" not in {t.episode_id for t in traces}


@slow
async def test_a_restarted_rollout_process_does_not_triage_a_group_again(tmp_path: Path) -> None:
    task, group = DEFICIT[0]
    with _services() as (shop, model_url):
        config = _config(tmp_path, shop, bank=_bank(tmp_path))
        first = _worker(config, model_url)
        await first.start()
        try:
            await asyncio.gather(*_group(first, task, group))
        finally:
            await first.aclose()
        path = triage_path(first.config.run_dir, group)
        written = path.read_bytes()
        # slime resumed from its checkpoint hands the same group out again, to a new process.
        second = _worker(config, model_url)
        await second.start()
        try:
            again = await asyncio.gather(*_group(second, task, group))
        finally:
            await second.aclose()
    assert first.triage.diagnostics_started == 1
    assert all(r.trace.attempt == 2 for r in again), "the group really was played again"
    assert second.triage.diagnostics_started == 0 and second.triage.skipped["exists"] == 1
    assert path.read_bytes() == written, "the first triage is kept"
    assert len(_diagnostic_traces(second)) == 1
