"""Training rollouts written to an object store: parts, commits and the lease journal on S3.

Real parts: moto's S3 server and SeaweedFS (every test runs on both), the testbed shop and token
endpoint over HTTP, the worker with its lease journal, a rollout process killed with SIGKILL,
the fault-injecting proxy in front of the store, and the research commands as subprocesses.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import s3fs

from shopsimrl.config import ConfigError
from shopsimrl.environment import ShopSimulatorEnvironment, ShopSimulatorSettings
from shopsimrl.research.episodes import episode_row
from shopsimrl.research.transcript import read_transcript
from shopsimrl.storage.objectstore import StoreUnavailableError
from shopsimrl.storage.reading import open_run
from shopsimrl.storage.sharded import part_lines
from shopsimrl.storage.training import TrainingObjects, TrainingRunError, committed_state
from shopsimrl.testbed.policy import PolicySettings
from shopsimrl.testbed.policy import create_app as create_policy_app
from shopsimrl.testbed.serving import running_server
from shopsimrl.testbed.shop import ShopSettings
from shopsimrl.testbed.shop import create_app as create_shop_app
from shopsimrl.training.config import load_training_config
from shopsimrl.training.rollout import EpisodeRollout
from shopsimrl.training.samples import Sample, SampleStatus, check_siblings
from shopsimrl.training.store import ObjectTrainingRunStore, read_training_samples
from shopsimrl.training.worker import Sampling, TrainingWorker
from tests.research.test_viewer import serving
from tests.sharded.conftest import S3_TEST_ENV, S3Server, cli
from tests.sharded.faultproxy import FaultPlan, FaultProxy, Scripted
from tests.training.invariants import assert_episode_samples

pytestmark = [pytest.mark.slow, pytest.mark.s3]

REPO = Path(__file__).resolve().parents[2]
SPLITS = REPO / "configs/splits/persona_splits.v1.json"
TRAIN_IDS: list[int] = json.loads(SPLITS.read_text())["splits"]["train"]["task_ids"]
TRAINING_KEYS = ("loss_mask", "rollout_log_probs", "output_ids", "input_ids", "response_length", "rollout_id")
SAMPLING = Sampling(temperature=0.6, max_new_tokens=512)


async def _no_wait(seconds: float) -> None:
    """Model backoff waits are skipped: the attempts, not the time between them, are under test."""


@contextmanager
def _services(slots: int, **policy: Any) -> Iterator[tuple[str, str]]:
    with (
        running_server(create_shop_app(ShopSettings(slots=slots))) as shop,
        running_server(create_policy_app(PolicySettings(token_endpoint=True, **policy))) as model,
    ):
        yield shop, model


def _config(
    tmp_path: Path,
    shop: str,
    output_dir: str,
    *,
    concurrency: int = 4,
    flush_rollouts: int = 5,
    flush_seconds: float = 300.0,
    model_retries: int = 5,
) -> Path:
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "training.yaml"
    path.write_text(
        f"run: {{name: round-001, output_dir: '{output_dir}', concurrency: {concurrency}, "
        f"flush_rollouts: {flush_rollouts}, flush_seconds: {flush_seconds}}}\n"
        f"tasks: {{split_file: {SPLITS}, split: train}}\n"
        f"environment: {{base_url: '{shop}', persona: true}}\n"
        f"model: {{name: testbed-policy, max_retries: {model_retries}}}\n"
    )
    return path


def _worker(config: Path, model_url: str) -> TrainingWorker:
    return TrainingWorker(load_training_config(config), base_url=model_url, sampling=SAMPLING, sleep=_no_wait)


def _fs(endpoint: str) -> Any:
    return s3fs.S3FileSystem(
        key=S3_TEST_ENV["AWS_ACCESS_KEY_ID"],
        secret=S3_TEST_ENV["AWS_SECRET_ACCESS_KEY"],
        client_kwargs={"endpoint_url": endpoint},
        skip_instance_cache=True,
        use_listings_cache=False,
    )


def _names(fs: Any, location: str, prefix: str) -> list[str]:
    """The objects under ``prefix`` (SeaweedFS also lists a folder left by deleted objects: not one)."""
    path = f"{location.removeprefix('s3://')}/{prefix}"
    if not fs.exists(path):
        return []
    names = (entry["name"].rsplit("/", 1)[-1] for entry in fs.ls(path, detail=True) if entry.get("type") != "directory")
    return sorted(name for name in names if name)  # SeaweedFS's folder marker ends with '/': no name


def _assert_no_secret(fs: Any, location: str, *outputs: str) -> None:
    """The store's secret key is in no object under ``location`` and in none of ``outputs``."""
    secret = S3_TEST_ENV["AWS_SECRET_ACCESS_KEY"]
    # SeaweedFS may list a folder marker (a name ending in '/'): not an object to read.
    names = [name for name in fs.find(location.removeprefix("s3://")) if not name.endswith("/")]
    assert names, f"no object under {location}"
    for name in names:
        assert secret.encode() not in fs.cat_file(name), name
    for position, output in enumerate(outputs):
        assert secret not in output, f"output {position}"


async def _free_slots(shop: str) -> int | None:
    environment = ShopSimulatorEnvironment(ShopSimulatorSettings(base_url=shop, persona=True))
    try:
        return (await environment.slot_usage()).free_slots
    finally:
        await environment.aclose()


async def _play(worker: TrainingWorker, rollouts: list[tuple[int, int]], *, group: int = 0) -> list[EpisodeRollout]:
    await worker.start()
    try:
        return list(await asyncio.gather(*(worker.rollout(task_id=t, index=i, group_index=group) for t, i in rollouts)))
    finally:
        await worker.aclose()


def _groups(groups: int, per_group: int) -> list[tuple[int, int]]:
    return [(TRAIN_IDS[g], g * per_group + s) for g in range(groups) for s in range(per_group)]


async def test_rollouts_on_s3_are_read_back_by_open_run_and_the_commands(s3_server: S3Server, tmp_path: Path) -> None:
    location = f"s3://{s3_server.bucket}/training"
    with _services(slots=4) as (shop, model_url):
        worker = _worker(_config(tmp_path, shop, location), model_url)
        await worker.start()
        try:
            done = list(
                await asyncio.gather(
                    *(worker.rollout(task_id=t, index=i, group_index=i // 4) for t, i in _groups(groups=3, per_group=4))
                )
            )
        finally:
            await worker.aclose()
        free = await _free_slots(shop)
    run_location = f"{location}/round-001"
    assert worker.store.location == run_location
    assert free == 4, "every lease was released"
    fs = _fs(s3_server.endpoint)
    assert _names(fs, run_location, "leases") == [], "the journal object is deleted when the process holds nothing"

    # Parts and commits: several flushes (5 rollouts a part, or fewer when nothing else was playing).
    state = committed_state(TrainingObjects(run_location))
    assert len(state.commits) >= 3 and state.uncommitted == [] and state.problems == []
    assert sum(len(commit.rollouts) for commit in state.commits) == 12
    assert all(len(commit.rollouts) <= 5 for commit in state.commits)
    assert _names(fs, run_location, "traces") == _names(fs, run_location, "training") == [c.traces.name for c in state.commits]

    # The research tools' reader: a training run, every rollout an episode of it.
    run = open_run(run_location)
    assert run.kind == "training" and run.manifest is None
    assert run.identity["experiment"] == "round-001" and run.identity["model_name"] == "testbed-policy"
    records = {record.episode_id: record for record in run.records()}
    assert set(records) == {rollout.trace.episode_id for rollout in done} and len(records) == 12
    for rollout in done:
        row = episode_row(records[rollout.trace.episode_id])
        assert row["completed"] and row["reward"] == rollout.samples[0].reward["reward"] and row["attempt"] == 1
        record, source = open_run(run_location).find(rollout.trace.episode_id)
        assert read_transcript(record, source).episode_id == rollout.trace.episode_id
        assert run.record(rollout.trace.episode_id).episode_id == rollout.trace.episode_id

    # No training field in a trace part; the samples read back equal what the rollouts returned.
    for commit, data in TrainingObjects(run_location).committed_parts("traces", state.commits):
        text = part_lines(commit.traces.name, data)[0].decode()
        assert not any(f'"{key}"' in text for key in TRAINING_KEYS)
    stored = read_training_samples(run_location)
    assert stored.missing == [] and stored.problems == [] and stored.uncommitted == []
    assert len(stored.records) == 12
    for rollout in done:
        line = stored.records[(rollout.trace.episode_id, 1)]
        samples = [Sample.from_dict(item) for item in line["samples"]]
        assert [s.to_dict() for s in samples] == [s.to_dict() for s in rollout.samples]
        check_siblings(samples)
        assert_episode_samples(samples, rollout.turns)

    # The commands themselves read it (the AWS_* variables of the test point at the server).
    env = {**os.environ, "COLUMNS": "2000"}
    some = done[5].trace.episode_id
    shown = cli("show", run_location, some, env=env)
    assert shown.returncode == 0, shown.stderr
    assert some in shown.stdout and run_location in shown.stdout
    table = cli("export", "table", run_location, "--to", "csv", "-o", str(tmp_path / "table.csv"), env=env)
    assert table.returncode == 0, table.stderr
    assert len((tmp_path / "table.csv").read_text().strip().splitlines()) == 13
    labelled = cli("labels", run_location, "-o", str(tmp_path / "labels.jsonl"), env=env)
    assert labelled.returncode == 0, labelled.stderr
    assert "12 episodes" in labelled.stdout
    missing = cli("show", run_location, "task-999999__sample-000", env=env)
    assert missing.returncode == 2 and "no episode" in missing.stderr
    compared = cli("compare", run_location, run_location, "--json", str(tmp_path / "compare.json"), env=env)
    assert compared.returncode == 0, compared.stderr
    assert json.loads((tmp_path / "compare.json").read_text())["runs"][0]["kind"] == "legacy"  # a run without a plan
    with serving(run_location, env) as viewer:
        page = viewer.get("/")
        assert page.status_code == 200 and "12 of 12 episodes" in page.text and "training run" in page.text
        episode = viewer.get(f"/episodes/{some}")
        assert episode.status_code == 200 and some in episode.text

    # Secrets never land in the run: no object of it, no command's output, no file it wrote.
    written = [(tmp_path / name).read_text() for name in ("table.csv", "labels.jsonl", "compare.json")]
    commands = [f"{r.stdout}{r.stderr}" for r in (shown, table, labelled, missing, compared)]
    _assert_no_secret(fs, run_location, *commands, *written, page.text, episode.text)


async def test_failed_and_cancelled_rollouts_release_their_leases_on_s3(s3_server: S3Server, tmp_path: Path) -> None:
    location = f"s3://{s3_server.bucket}/training"
    fs = _fs(s3_server.endpoint)
    # A model that always answers 500: every rollout is an abort placeholder, committed, its lease released.
    with _services(slots=2, rate_500=1.0) as (shop, model_url):
        worker = _worker(_config(tmp_path / "failing", shop, f"{location}/failing", concurrency=2, model_retries=2), model_url)
        done = await _play(worker, _groups(1, 4))
        free = await _free_slots(shop)
    assert free == 2
    assert all(r.samples[0].status is SampleStatus.ABORTED and r.samples[0].remove_sample for r in done)
    stored = read_training_samples(worker.store.location)
    assert stored.missing == [] and len(stored.records) == 4
    assert all(line["scored"] is False for line in stored.records.values())
    assert _names(fs, worker.store.location, "leases") == []

    # Cancelled (slime cancels what it no longer needs): one slot, three rollouts. The first ends
    # and waits for its part (nothing is written while others play and the buffer is short), the
    # second holds the slot mid-episode (a slow model), the third waits for a slot.
    with _services(slots=1, latency_ms=300) as (shop, model_url):
        worker = _worker(_config(tmp_path / "slow", shop, f"{location}/slow", concurrency=3, flush_rollouts=10), model_url)
        await worker.start()
        store = worker.store
        assert isinstance(store, ObjectTrainingRunStore)
        tasks = [asyncio.ensure_future(worker.rollout(task_id=TRAIN_IDS[i], index=i, group_index=0)) for i in range(3)]
        held = None
        for _ in range(3000):
            await asyncio.sleep(0.02)
            if store.buffered and (held := await _free_slots(shop)) == 0:
                break
        waiting = list(store.buffered)
        for task in tasks:
            task.cancel()
        results = await asyncio.gather(*tasks, return_exceptions=True)
        await worker.aclose()
        free = await _free_slots(shop)
    assert len(waiting) == 1 and held == 0, "one rollout waited for its part while another held the slot"
    assert all(isinstance(result, asyncio.CancelledError) for result in results)
    assert free == 1, "the cancelled rollouts released their lease"
    assert _names(fs, store.location, "leases") == []
    stored = read_training_samples(store.location)
    assert set(stored.records) == set(waiting), (
        "the finished rollout is written though its caller left; the others leave no trace"
    )
    assert [record.episode_id for record in open_run(store.location).records()] == [waiting[0][0]]


async def test_a_rollout_process_killed_mid_run_loses_only_its_buffer_and_the_next_resumes(
    s3_server: S3Server, tmp_path: Path
) -> None:
    location = f"s3://{s3_server.bucket}/training"
    fs = _fs(s3_server.endpoint)
    rollouts = _groups(3, 4)
    with _services(slots=2) as (shop, model_url):
        config = _config(tmp_path, shop, location, concurrency=2, flush_rollouts=4)
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "tests.training.rollout_process",
            str(config),
            model_url,
            *(f"{t}:{i}" for t, i in rollouts),
            "--freeze-at",
            "2",
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.DEVNULL,
            cwd=REPO,
            env={**os.environ, "SHOPSIMRL_STORE_RETRY_BUDGET_S": "20"},
        )
        assert process.stdout is not None
        returned: list[tuple[str, int]] = []
        frozen: dict[str, Any] = {}
        async for line in process.stdout:
            event = json.loads(line)
            if "returned" in event:
                returned.append((event["returned"][0], event["returned"][1]))
            if "frozen" in event or "finished" in event:
                frozen = event
                break
        assert "frozen" in frozen, f"the process ended before its buffer held 2 rollouts: {frozen}"
        process.send_signal(signal.SIGKILL)
        assert await asyncio.wait_for(process.wait(), 30) == -signal.SIGKILL
        leaked = await _free_slots(shop)
        journals = _names(fs, f"{location}/round-001", "leases")

        first = committed_state(TrainingObjects(f"{location}/round-001"))
        committed = set(first.rollouts())
        buffered = {(key[0], key[1]) for key in frozen["frozen"]}
        # Every call that came back was committed first; the buffer is what is lost, and it is
        # short of a part (a full buffer is written at once).
        assert set(returned) <= committed and len(returned) >= 4
        assert buffered and not buffered & committed and len(buffered) < 4
        assert leaked is not None and leaked < 2 and journals, "the killed process held a journaled lease"

        # The next process plays every rollout again (slime resumed from its checkpoint).
        again = await _play(_worker(config, model_url), rollouts)
        free = await _free_slots(shop)
    assert free == 2, "the killed process's leases were released by its successor, its own at close"
    assert _names(fs, f"{location}/round-001", "leases") == []
    ids = {episode_id for episode_id, _ in committed}
    assert {(r.trace.episode_id, r.trace.attempt) for r in again} == {
        (f"task-{t:06d}__sample-{i:03d}", 2 if f"task-{t:06d}__sample-{i:03d}" in ids else 1) for t, i in rollouts
    }
    stored = read_training_samples(f"{location}/round-001")
    assert stored.missing == [] and stored.problems == []
    assert set(stored.records) == committed | {(r.trace.episode_id, r.trace.attempt) for r in again}
    run = open_run(f"{location}/round-001")
    attempts = sorted((record.episode_id, record.attempt) for _, record in run.all_records())
    assert attempts == sorted(stored.records), "one record per committed attempt, none twice"


async def test_a_store_answering_503_is_retried(s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    location = f"s3://{s3_server.bucket}/training"
    script = [
        Scripted("PUT", r"/training/round-001/commits/", "503"),
        Scripted("PUT", r"/training/round-001/traces/", "503"),
        Scripted("PUT", r"/training/round-001/leases/", "503"),
        Scripted("GET", r"/training/round-001/training.json", "503"),
    ]
    proxy = FaultProxy(s3_server.endpoint, FaultPlan(seed=25, burst_probability=0.05, burst_length=2, script=script))
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.start())
    try:
        with _services(slots=2) as (shop, model_url):
            worker = _worker(_config(tmp_path, shop, location, concurrency=2, flush_rollouts=3), model_url)
            done = await _play(worker, _groups(2, 4))
            free = await _free_slots(shop)
    finally:
        proxy.stop()
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    assert all(entry.fired for entry in script) and proxy.injected["503"] >= len(script)
    assert free == 2
    stored = read_training_samples(worker.store.location)
    assert stored.missing == [] and stored.problems == [] and stored.uncommitted == []
    assert {key: [Sample.from_dict(s).to_dict() for s in line["samples"]] for key, line in stored.records.items()} == {
        (r.trace.episode_id, 1): [s.to_dict() for s in r.samples] for r in done
    }


async def test_an_unreachable_store_a_dead_one_and_a_wrong_location_are_named(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    location = f"s3://{s3_server.bucket}/training"
    monkeypatch.setenv("SHOPSIMRL_STORE_RETRY_BUDGET_S", "1")
    with _services(slots=2) as (shop, model_url):
        # Nothing listens at the endpoint; then a store that answers 503 to everything.
        monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")
        worker = _worker(_config(tmp_path / "a", shop, location), model_url)
        with pytest.raises(StoreUnavailableError, match=f"object store at {location}/round-001 cannot be reached"):
            await worker.start()
        dead = FaultProxy(s3_server.endpoint, FaultPlan(always_503=True))
        monkeypatch.setenv("AWS_ENDPOINT_URL", dead.start())
        try:
            with pytest.raises(StoreUnavailableError, match=f"object store at {location}/round-001 cannot be reached"):
                await _worker(_config(tmp_path / "b", shop, location), model_url).start()
        finally:
            dead.stop()
        assert dead.injected["503"] >= 2
        assert await _free_slots(shop) == 2, "no lease was taken"

        # A location that holds an evaluation run; a location with credentials in it.
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
        _fs(s3_server.endpoint).pipe_file(f"{s3_server.bucket}/training/round-001/manifest.json", b"{}")
        with pytest.raises(TrainingRunError, match="holds an evaluation run"):
            await _worker(_config(tmp_path / "c", shop, location), model_url).start()
        with pytest.raises(ConfigError, match=r"run\.output_dir: .*credentials") as caught:
            _worker(_config(tmp_path / "d", shop, f"s3://user:hunter2@{s3_server.bucket}/x"), model_url)
        assert "hunter2" not in str(caught.value)


async def test_a_store_down_mid_run_fails_the_rollouts_and_keeps_them_for_a_later_flush(
    s3_server: S3Server, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    location = f"s3://{s3_server.bucket}/training"
    monkeypatch.setenv("SHOPSIMRL_STORE_RETRY_BUDGET_S", "1")
    proxy = FaultProxy(s3_server.endpoint)
    monkeypatch.setenv("AWS_ENDPOINT_URL", proxy.start())
    try:
        with _services(slots=2) as (shop, model_url):
            worker = _worker(_config(tmp_path, shop, location, concurrency=2, flush_rollouts=2), model_url)
            await worker.start()
            first = await asyncio.gather(*(worker.rollout(task_id=t, index=i, group_index=0) for t, i in _groups(1, 2)))
            proxy.plan.always_503 = True
            failed = await asyncio.gather(
                *(worker.rollout(task_id=t, index=10 + i, group_index=1) for t, i in _groups(1, 2)), return_exceptions=True
            )
            proxy.plan.always_503 = False
            await worker.aclose()
            free = await _free_slots(shop)
    finally:
        proxy.stop()
        monkeypatch.setenv("AWS_ENDPOINT_URL", s3_server.endpoint)
    assert all(isinstance(result, StoreUnavailableError) for result in failed), failed
    assert free == 2
    stored = read_training_samples(worker.store.location)
    assert set(stored.records) == {(r.trace.episode_id, 1) for r in first} | {
        (f"task-{TRAIN_IDS[0]:06d}__sample-{10 + i:03d}", 1) for i in range(2)
    }, "the rollouts whose callers got the error were written at close, once the store answered again"


async def test_a_triaged_group_on_s3_leaves_its_record_and_a_diagnostics_run_there(s3_server: S3Server, tmp_path: Path) -> None:
    from shopsimrl.skills import NoSkills
    from shopsimrl.training.triage import DIAGNOSTICS_DIR, INTERNALIZATION_DEFICIT, read_triage
    from tests.training.test_triage import DEFICIT, _bank

    task, group = DEFICIT[0]
    location = f"s3://{s3_server.bucket}/training"
    config = tmp_path / "training.yaml"
    with _services(slots=4, options_need_skill=True) as (shop, model_url):
        _config(tmp_path, shop, location, concurrency=4)
        config.write_text(config.read_text() + f"skills: {{path: {json.dumps(str(_bank(tmp_path)))}}}\n")

        async def play_group(worker: TrainingWorker) -> list[EpisodeRollout]:
            await worker.start()
            try:
                return list(
                    await asyncio.gather(
                        *(
                            worker.rollout(task_id=task, index=group * 4 + i, group_index=group, group_size=4, skills=NoSkills())
                            for i in range(4)
                        )
                    )
                )
            finally:
                await worker.aclose()

        first = _worker(config, model_url)
        rollouts = await play_group(first)
        again = _worker(config, model_url)
        await play_group(again)  # a restart plays the group again: its record stays, no second diagnostic
        free = await _free_slots(shop)
    assert free == 4, "every lease was released, the diagnostic's too"
    assert all(r.samples[0].reward["r_success"] == 0.0 for r in rollouts)
    run_location = f"{location}/round-001"
    record = read_triage(run_location, {group})[group]
    assert record["classification"] == INTERNALIZATION_DEFICIT and record["episode_ids"] == [
        f"task-{task:06d}__sample-{group * 4 + i:03d}" for i in range(4)
    ]
    assert first.triage.diagnostics_started == 1 and again.triage.diagnostics_started == 0
    assert again.triage.skipped["exists"] == 1

    # The training run holds the group's rollouts (twice: two attempts), the diagnostics run the diagnostic.
    training = sorted((r.episode_id, r.attempt) for _, r in open_run(run_location).all_records())
    assert training == sorted((episode_id, attempt) for episode_id in record["episode_ids"] for attempt in (1, 2))
    diagnostics = open_run(f"{run_location}/{DIAGNOSTICS_DIR.as_posix()}")
    (trace,) = list(diagnostics.records())
    assert diagnostics.kind == "training" and trace.episode_id == record["diagnostic"]["episode_id"]
    assert trace.final is not None and trace.final.reward_detail["r_success"] == 1.0
    assert read_training_samples(f"{run_location}/{DIAGNOSTICS_DIR.as_posix()}").missing == []
    shown = cli("show", f"{run_location}/{DIAGNOSTICS_DIR.as_posix()}", trace.episode_id, env={**os.environ, "COLUMNS": "2000"})
    assert shown.returncode == 0 and "choose-options" in shown.stdout, shown.stderr
    _assert_no_secret(_fs(s3_server.endpoint), run_location, shown.stdout + shown.stderr)
