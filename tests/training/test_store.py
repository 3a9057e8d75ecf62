"""Training rollouts leave a run directory the research tools read, with the trainer's fields beside it.

Real parts: the testbed shop and token endpoint over HTTP, the worker with its lease journal, the
run directory on disk, and the research commands (`shopsimrl show`, `labels`, `export table`) as
subprocesses.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from shopsimrl.environment import ShopSimulatorEnvironment, ShopSimulatorSettings
from shopsimrl.episode import new_trace
from shopsimrl.research.episodes import episode_row
from shopsimrl.research.transcript import read_transcript
from shopsimrl.schemas import EpisodeJob
from shopsimrl.storage.local import RunLockedError
from shopsimrl.storage.reading import open_run
from shopsimrl.testbed.policy import PolicySettings
from shopsimrl.testbed.policy import create_app as create_policy_app
from shopsimrl.testbed.serving import running_server
from shopsimrl.testbed.shop import ShopSettings
from shopsimrl.testbed.shop import create_app as create_shop_app
from shopsimrl.training.config import load_training_config
from shopsimrl.training.rollout import EpisodeRollout
from shopsimrl.training.samples import Sample, SampleStatus, abort_sample, check_siblings
from shopsimrl.training.store import SAMPLES_FILE, TrainingRunStore, read_training_samples
from shopsimrl.training.worker import Sampling, TrainingWorker
from tests.research.test_viewer import serving
from tests.sharded.conftest import cli
from tests.training.invariants import assert_episode_samples

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SPLITS = REPO / "configs/splits/persona_splits.v1.json"
TRAIN_IDS: list[int] = json.loads(SPLITS.read_text())["splits"]["train"]["task_ids"]
TRAINING_KEYS = ("loss_mask", "rollout_log_probs", "output_ids", "input_ids", "response_length", "rollout_id")
SAMPLING = Sampling(temperature=0.6, max_new_tokens=512)


async def _no_wait(seconds: float) -> None:
    """Backoff waits are skipped: the attempts, not the time between them, are under test."""


@contextmanager
def _services(slots: int, **policy: Any) -> Iterator[tuple[str, str]]:
    with (
        running_server(create_shop_app(ShopSettings(slots=slots))) as shop,
        running_server(create_policy_app(PolicySettings(token_endpoint=True, **policy))) as model,
    ):
        yield shop, model


def _config(tmp_path: Path, shop: str, *, concurrency: int = 4, model_retries: int = 5) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "training.yaml"
    path.write_text(
        f"run: {{name: round-001, output_dir: {tmp_path / 'runs'}, concurrency: {concurrency}}}\n"
        f"tasks: {{split_file: {SPLITS}, split: train}}\n"
        f"environment: {{base_url: '{shop}', persona: true}}\n"
        f"model: {{name: testbed-policy, max_retries: {model_retries}}}\n"
    )
    return path


def _worker(config: Path, model_url: str) -> TrainingWorker:
    return TrainingWorker(load_training_config(config), base_url=model_url, sampling=SAMPLING, sleep=_no_wait)


async def _free_slots(shop: str) -> int | None:
    environment = ShopSimulatorEnvironment(ShopSimulatorSettings(base_url=shop, persona=True))
    try:
        return (await environment.slot_usage()).free_slots
    finally:
        await environment.aclose()


async def _play(worker: TrainingWorker, groups: int, per_group: int, *, first_index: int = 0) -> list[EpisodeRollout]:
    await worker.start()
    try:
        return list(
            await asyncio.gather(
                *(
                    worker.rollout(task_id=TRAIN_IDS[g], index=first_index + g * per_group + s, group_index=g)
                    for g in range(groups)
                    for s in range(per_group)
                )
            )
        )
    finally:
        await worker.aclose()


def _journals(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "leases").glob("*.jsonl")) if (run_dir / "leases").exists() else []


async def test_rollouts_leave_a_run_the_research_tools_read_with_samples_beside_the_traces(tmp_path: Path) -> None:
    with _services(slots=4) as (shop, model_url):
        config = _config(tmp_path, shop)
        worker = _worker(config, model_url)
        done = await _play(worker, groups=3, per_group=4)
        free = await _free_slots(shop)
    assert free == 4, "every lease was released"
    run_dir = worker.config.run_dir
    assert run_dir == tmp_path / "runs" / "round-001"
    assert _journals(run_dir) == [], "the journal is removed when the process holds nothing"

    # The research tools' reader: every rollout is an episode of the run, one flat row each.
    run = open_run(run_dir)
    assert run.kind == "local" and run.manifest is None
    records = {record.episode_id: record for record in run.records()}
    assert set(records) == {rollout.trace.episode_id for rollout in done}
    assert len(records) == 12, "slime's sample index makes each rollout's episode id unique"
    for rollout in done:
        row = episode_row(records[rollout.trace.episode_id])
        assert row["completed"] and row["reward"] == rollout.samples[0].reward["reward"]
        assert row["attempt"] == 1
        record, source = run.find(rollout.trace.episode_id)
        assert read_transcript(record, source).episode_id == rollout.trace.episode_id

    # No training field in the traces; all of them in training/samples.jsonl, joined by episode and attempt.
    text = (run_dir / "traces.jsonl").read_text()
    assert not any(f'"{key}"' in text for key in TRAINING_KEYS)
    assert (run_dir / SAMPLES_FILE).is_file()
    stored = read_training_samples(run_dir)
    assert stored.missing == [] and stored.bad_lines == []
    assert len(stored.records) == 12
    for position, rollout in enumerate(done):
        line = stored.records[(rollout.trace.episode_id, 1)]
        assert line["group_index"] == position // 4 and line["index"] == position == line["rollout_id"]
        assert line["forks"] == (rollout.trajectory.forks if rollout.trajectory else 0)
        samples = [Sample.from_dict(item) for item in line["samples"]]
        assert [s.to_dict() for s in samples] == [s.to_dict() for s in rollout.samples]
        check_siblings(samples)
        assert_episode_samples(samples, rollout.turns)

    # The commands themselves read it.
    env = {**os.environ, "COLUMNS": "2000"}
    some = done[5].trace.episode_id
    shown = cli("show", str(run_dir), some, env=env)
    assert shown.returncode == 0, shown.stderr
    assert some in shown.stdout
    labelled = cli("labels", str(run_dir), "-o", str(tmp_path / "labels.jsonl"), env=env)
    assert labelled.returncode == 0, labelled.stderr
    assert "12 episodes" in labelled.stdout
    with serving(str(run_dir), env) as viewer:
        page = viewer.get("/")
        assert page.status_code == 200 and "12 of 12 episodes" in page.text
        episode = viewer.get(f"/episodes/{some}")
        assert episode.status_code == 200 and some in episode.text
    table = cli("export", "table", str(run_dir), "--to", "csv", "-o", str(tmp_path / "table.csv"), env=env)
    assert table.returncode == 0, table.stderr
    assert len((tmp_path / "table.csv").read_text().strip().splitlines()) == 13


async def test_failed_and_cancelled_rollouts_release_every_lease_and_are_saved(tmp_path: Path) -> None:
    # A model that always answers 500: every rollout is an abort placeholder, saved, its lease released.
    with _services(slots=2, rate_500=1.0) as (shop, model_url):
        worker = _worker(_config(tmp_path, shop, concurrency=2, model_retries=2), model_url)
        done = await _play(worker, groups=1, per_group=4)
        free = await _free_slots(shop)
    assert free == 2
    assert all(r.samples[0].status is SampleStatus.ABORTED and r.samples[0].remove_sample for r in done)
    stored = read_training_samples(worker.config.run_dir)
    assert stored.missing == [] and len(stored.records) == 4
    assert all(line["scored"] is False for line in stored.records.values())

    # Rollouts cancelled mid-episode (slime cancels what it no longer needs): the model answers
    # slowly, so the episodes hold their leases when the cancel lands.
    with _services(slots=2, latency_ms=400) as (shop, model_url):
        worker = _worker(_config(tmp_path / "slow", shop, concurrency=2), model_url)
        await worker.start()
        tasks = [asyncio.ensure_future(worker.rollout(task_id=TRAIN_IDS[0], index=i, group_index=0)) for i in range(2)]
        for _ in range(200):
            await asyncio.sleep(0.02)
            if await _free_slots(shop) == 0:
                break
        held = await _free_slots(shop)
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await worker.aclose()
        free = await _free_slots(shop)
    assert held == 0, "both rollouts held a lease when they were cancelled"
    assert all(isinstance(result, asyncio.CancelledError) for result in results)
    assert free == 2, "cancelled rollouts released their leases"
    assert _journals(worker.config.run_dir) == []


async def test_a_second_process_is_refused_and_a_restart_numbers_the_next_attempt(tmp_path: Path) -> None:
    with _services(slots=2) as (shop, model_url):
        config = _config(tmp_path, shop, concurrency=2)
        first = _worker(config, model_url)
        await first.start()
        try:
            with pytest.raises(RunLockedError):
                await _worker(config, model_url).start()
            await first.rollout(task_id=TRAIN_IDS[0], index=7, group_index=1)
        finally:
            await first.aclose()
        # slime resumed from a checkpoint hands sample 7 out again: the same episode, attempt 2.
        again = await _play(_worker(config, model_url), groups=1, per_group=1, first_index=7)
    assert again[0].trace.attempt == 2
    stored = read_training_samples(first.config.run_dir)
    episode = again[0].trace.episode_id
    assert set(stored.records) == {(episode, 1), (episode, 2)}
    run = open_run(first.config.run_dir)
    assert [record.attempt for _, record in run.all_records()] == [1, 2]


def _unscored_rollout(task_id: int, index: int) -> EpisodeRollout:
    trace = new_trace(EpisodeJob(task_id=task_id, sample_id=index, seed=index, split="train"))
    sample = abort_sample(rollout_id=index, group_index=0, index=index, metadata={"episode_id": trace.episode_id})
    return EpisodeRollout(trace=trace, samples=[sample], turns=[], trajectory=None, scored=False)


def test_a_crash_between_the_two_writes_or_inside_one_is_reported_not_hidden(tmp_path: Path) -> None:
    store = TrainingRunStore(tmp_path / "run")
    with store:
        store.save(_unscored_rollout(3, 0))
        # The process dies after the trace line of rollout 1 and inside the samples line of rollout 2.
        lost = _unscored_rollout(3, 1)
        lost.trace.attempt = 1
        store.runs.save_traces([lost.trace])
        with store.samples_path.open("ab") as handle:
            handle.write(b'{"schema_version": "shopsimrl-training-samples-v1", "episode_id": "task-0')
    with TrainingRunStore(tmp_path / "run") as restarted:
        restarted.save(_unscored_rollout(3, 2))
        restarted.save(_unscored_rollout(3, 1))  # played again: its next attempt
    found = read_training_samples(tmp_path / "run")
    assert found.missing == [("task-000003__sample-001", 1)]
    assert found.bad_lines == [2], "the torn line stays a line of its own, sealed before the next append"
    assert set(found.records) == {
        ("task-000003__sample-000", 1),
        ("task-000003__sample-002", 1),
        ("task-000003__sample-001", 2),
    }
    assert [Sample.from_dict(s).status for line in found.records.values() for s in line["samples"]] == [SampleStatus.ABORTED] * 3
