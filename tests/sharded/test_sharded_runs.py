"""Real ``shopsimrl worker`` processes against the real testbed services, on a local dir and on
S3 servers: the local Job emulation (run --shards), resume after kill -9, SIGTERM, two writers
on one shard, injected object-store faults, junk in shard folders, fingerprint and shard-count
refusals."""

from __future__ import annotations

import json
import random
import signal
import socket
import time
from pathlib import Path
from typing import Any

import pytest

from shopsimrl.runner.reduce import reduce_run
from shopsimrl.runner.status import shard_status
from shopsimrl.schemas import fingerprint
from shopsimrl.storage.sharded import ShardedRunStore, iter_part_records

from .conftest import S3_TEST_ENV, Backend, S3Server, Testbed, cli, start_worker, worker_env, write_config
from .faultproxy import FaultPlan, FaultProxy, Scripted

pytestmark = pytest.mark.slow


def test_sharded_run_end_to_end(backend: Backend, testbed: Testbed, tmp_path: Path) -> None:
    config = write_config(tmp_path, testbed, episodes=6)
    uri = backend.uri("e2e")
    env = worker_env(backend)
    result = cli("run", str(config), "--shards", "2", "--run", uri, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "2/2 committed" in result.stdout
    store = ShardedRunStore(uri)
    summary = json.loads(store.read_bytes("summary.json"))
    assert summary["counts"]["completed"] == 6 and summary["counts"]["missing"] == 0
    assert summary["shards"]["duplicate_records"] == 0
    marker = json.loads(store.read_bytes("shards/00001/_SUCCESS.json"))
    assert marker["episodes"] == {"completed": 3, "failed": 0} and marker["parts"]
    assert set(marker) >= {"schema_version", "shard", "plan_fingerprint", "episode_ids_sha256", "parts", "written_at"}
    # Secrets never reach the run's objects.
    for name in ("manifest.json", "shards.json", "summary.json", "shards/00000/_SUCCESS.json"):
        assert "testing-secret" not in store.read_bytes(name).decode()

    # A worker on a committed shard has nothing to do and writes nothing.
    again = start_worker(backend, uri, config, 0, 2, tmp_path / "logs")
    assert again.wait() == 0
    assert any(line.get("event") == "shard_already_committed" for line in again.log_lines())
    # The same plan with another shard count is refused; another plan exits 42.
    assert start_worker(backend, uri, config, 0, 3, tmp_path / "logs").wait() == 2
    other = write_config(tmp_path, testbed, episodes=6, temperature=0.7)
    refused = start_worker(backend, uri, other, 0, 2, tmp_path / "logs")
    assert refused.wait() == 42
    assert any("model.sampling.temperature" in str(line.get("reason")) for line in refused.log_lines())
    status = cli("status", uri, env=env)
    assert status.returncode == 0 and "2/2 shards committed" in status.stdout


def test_junk_in_a_shard_folder_is_reported_not_fatal(backend: Backend, testbed: Testbed, tmp_path: Path) -> None:
    config = write_config(tmp_path, testbed, episodes=3)
    uri = backend.uri("junk")
    assert cli("plan", str(config), "--run", uri, "--shards", "1", env=worker_env(backend)).returncode == 0
    store = ShardedRunStore(uri)
    store.create("shards/00000/part-00007-0badc0de.jsonl", b'{"schema_version": "shopsimrl-episode-v4", "episode_id": "task-')
    store.create("shards/00000/README.txt", b"not a part")
    worker = start_worker(backend, uri, config, 0, None, tmp_path / "logs")
    assert worker.wait() == 0
    summary = reduce_run(store)
    assert summary["counts"]["completed"] == 3
    assert summary["shards"]["unreadable_lines"] == 1
    assert summary["shards"]["foreign_objects"] == ["shards/00000/README.txt"]
    # Every line of the worker's JSON log is bound to run and shard; episode lines to their episode.
    lines = worker.log_lines()
    assert all(line.get("run") == store.display_uri and line.get("shard") == 0 for line in lines), lines[:3]
    finished = [line for line in lines if line.get("event") == "episode_finished"]
    assert len(finished) == 3 and all(line["episode_id"].startswith("task-") for line in finished)


def test_sigterm_flushes_then_resume_completes(backend: Backend, testbed: Testbed, tmp_path: Path) -> None:
    # Enough episodes that the signal lands mid-run even on a loaded machine.
    config = write_config(tmp_path, testbed, episodes=40)
    uri = backend.uri("term")
    # Flush thresholds far away: whatever is saved was saved by the SIGTERM path.
    env = worker_env(backend, SHOPSIMRL_FLUSH_EPISODES="1000", SHOPSIMRL_FLUSH_SECONDS="600")
    worker = start_worker(backend, uri, config, 0, 1, tmp_path / "logs", env=env)
    deadline = time.monotonic() + 60
    while len(worker.finished_episodes()) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    worker.process.send_signal(signal.SIGTERM)
    assert worker.wait() == 3
    store = ShardedRunStore(uri)
    finished_before = set(worker.finished_episodes())
    listing = store.list_shard(0)
    # The stop flushes at once, and again after the episodes in flight are cancelled: an episode
    # that finished between the two lands in a second part. Nothing is committed.
    assert 1 <= len(listing.parts) <= 2 and not listing.marker
    saved = {
        record.episode_id
        for part in listing.parts
        for record in iter_part_records(part, store.read_part(0, part) or b"")
        if record is not None
    }
    # Every logged episode was flushed. The signal may also land between an episode's save and
    # its log line (the save is shielded from the cancel, the line is not written), once per
    # episode runner: the parts can hold up to `concurrency` (2) more than the log shows.
    assert finished_before <= saved and len(saved - finished_before) <= 2

    resumed = start_worker(backend, uri, config, 0, 1, tmp_path / "logs")
    assert resumed.wait() == 0
    assert not set(resumed.finished_episodes()) & saved  # nothing saved is rerun
    summary = reduce_run(store)
    assert summary["counts"]["completed"] == 40 and summary["shards"]["duplicate_records"] == 0


def test_two_workers_on_one_shard_are_deduplicated(backend: Backend, testbed: Testbed, tmp_path: Path) -> None:
    config = write_config(tmp_path, testbed, episodes=8)
    uri = backend.uri("twin")
    env = worker_env(backend)
    assert cli("plan", str(config), "--run", uri, "--shards", "1", env=env).returncode == 0
    first = start_worker(backend, uri, config, 0, None, tmp_path / "logs")
    second = start_worker(backend, uri, config, 0, None, tmp_path / "logs")
    assert first.wait() == 0 and second.wait() == 0
    ran = len(first.finished_episodes()) + len(second.finished_episodes())
    summary = reduce_run(ShardedRunStore(uri))
    shards = summary["shards"]
    assert summary["counts"]["completed"] == 8 and summary["counts"]["missing"] == 0
    # Every completed record beyond the first of its episode is a counted duplicate (or was
    # written after the commit and left out of the marker).
    assert shards["duplicate_records"] + 8 <= ran
    assert summary["counts"]["completed"] + shards["duplicate_records"] <= ran


def test_kill_minus_9_at_random_moments_loses_only_the_unflushed_tail(backend: Backend, testbed: Testbed, tmp_path: Path) -> None:
    if backend.kind == "minio":
        pytest.skip("covered on the local dir and moto")
    rng = random.Random(20260829)
    # Enough jobs that every trial's kill lands while work remains: a fast testbed finishes a
    # dozen episodes in the random extra wait, and a worker that finishes its shard is no kill.
    jobs, flush_episodes, trials = 80, 3, 4
    config = write_config(tmp_path, testbed, episodes=jobs, concurrency=2)
    uri = backend.uri("crash")
    env = worker_env(backend, SHOPSIMRL_FLUSH_EPISODES=str(flush_episodes), SHOPSIMRL_FLUSH_SECONDS="30")
    finished: list[str] = []
    kills = 0
    for _ in range(trials):
        worker = start_worker(backend, uri, config, 0, 1, tmp_path / "logs", env=env)
        # A random moment within the run: after a random number of finished episodes, plus a
        # random fraction of an episode (so kills land mid-buffer, mid-episode, mid-write).
        target = rng.randint(1, 4)
        deadline = time.monotonic() + 60
        while len(worker.finished_episodes()) < target and worker.process.poll() is None and time.monotonic() < deadline:
            time.sleep(0.02)
        time.sleep(rng.uniform(0.0, 0.3))
        if worker.process.poll() is None:
            worker.process.kill()
            kills += 1
        worker.wait()
        finished += worker.finished_episodes()
    final = start_worker(backend, uri, config, 0, 1, tmp_path / "logs", env=env)
    assert final.wait() == 0
    finished += final.finished_episodes()

    summary = reduce_run(ShardedRunStore(uri))
    shards = summary["shards"]
    assert kills == trials
    assert summary["counts"]["completed"] == jobs and summary["counts"]["missing"] == 0
    assert shards["duplicate_records"] == 0  # sequential restarts never persist an episode twice
    reruns = len(finished) - len(set(finished))
    # Each kill loses at most one unflushed buffer (< flush_episodes records, or one part in flight).
    assert reruns <= kills * flush_episodes, (reruns, kills)
    print(
        f"\n[crash-test {backend.kind}] trials={trials} kills={kills} jobs={jobs} episodes_run={len(finished)} "
        f"reruns={reruns} duplicates={shards['duplicate_records']}"
    )
    # kill -9 may leak the slots of resets in flight (docs/sharded_runs.md, "Leases"; measured in
    # tests/test_lease_stress.py): give the shared shop back clean to the tests that follow.
    testbed.release_all()


@pytest.mark.s3
def test_run_completes_through_object_store_faults(moto_endpoint: str, testbed: Testbed, tmp_path: Path) -> None:
    from .conftest import S3_TEST_ENV, _make_bucket

    bucket = _make_bucket(moto_endpoint, S3_TEST_ENV["AWS_ACCESS_KEY_ID"], S3_TEST_ENV["AWS_SECRET_ACCESS_KEY"])
    proxy = FaultProxy(
        moto_endpoint,
        FaultPlan(seed=3, burst_probability=0.05, burst_length=3, drop_probability=0.04, lost_response_probability=0.04),
    )
    endpoint = proxy.start()
    try:
        backend = Backend("s3", f"s3://{bucket}/runs", {**S3_TEST_ENV, "AWS_ENDPOINT_URL": endpoint})
        config = write_config(tmp_path, testbed, episodes=6)
        uri = backend.uri("faulty")
        result = cli("run", str(config), "--shards", "2", "--run", uri, env=worker_env(backend, SHOPSIMRL_FLUSH_EPISODES="1"))
        assert result.returncode == 0, result.stderr[-3000:]
        assert sum(proxy.injected.values()) > 0, proxy.injected
    finally:
        proxy.stop()
    import os

    os.environ.update({**S3_TEST_ENV, "AWS_ENDPOINT_URL": moto_endpoint})
    summary = reduce_run(ShardedRunStore(uri), write=False)
    assert summary["counts"]["completed"] == 6 and summary["shards"]["committed"] == 2


@pytest.mark.s3
def test_a_store_that_stays_down_exits_3(moto_endpoint: str, testbed: Testbed, tmp_path: Path) -> None:
    from .conftest import S3_TEST_ENV

    dead = FaultProxy(moto_endpoint, FaultPlan(always_503=True))
    endpoint = dead.start()
    try:
        backend = Backend("s3", "s3://no-such-bucket-ever/runs", {**S3_TEST_ENV, "AWS_ENDPOINT_URL": endpoint})
        config = write_config(tmp_path, testbed, episodes=2)
        worker = start_worker(
            backend,
            backend.uri("down"),
            config,
            0,
            1,
            tmp_path / "logs",
            env=worker_env(backend, SHOPSIMRL_STORE_RETRY_BUDGET_S="2"),
        )
        assert worker.wait() == 3
        assert any(line.get("event") == "store_unavailable" for line in worker.log_lines())
        assert not any("testing-secret" in json.dumps(line) for line in worker.log_lines())
    finally:
        dead.stop()


def test_reduce_wait_times_out_with_exit_3_and_status_shows_progress(backend: Backend, testbed: Testbed, tmp_path: Path) -> None:
    config = write_config(tmp_path, testbed, episodes=4)
    uri = backend.uri("wait")
    env = worker_env(backend)
    assert cli("plan", str(config), "--run", uri, "--shards", "2", env=env).returncode == 0
    assert start_worker(backend, uri, config, 1, 2, tmp_path / "logs").wait() == 0
    waited = cli("reduce", uri, "--wait", "--timeout", "1", env=env)
    assert waited.returncode == 3 and "[0]" in waited.stderr
    report = shard_status(ShardedRunStore(uri))
    assert [row["state"] for row in report["shards"]] == ["pending", "committed"]
    partial = cli("reduce", uri, env=env)
    assert partial.returncode == 1 and "1/2 committed" in partial.stdout


def test_a_marker_with_a_bad_checksum_is_not_trusted_and_the_shard_heals(
    backend: Backend, testbed: Testbed, tmp_path: Path
) -> None:
    config = write_config(tmp_path, testbed, episodes=4)
    uri = backend.uri("badsum")
    assert start_worker(backend, uri, config, 0, 1, tmp_path / "logs").wait() == 0
    store = ShardedRunStore(uri)
    marker = json.loads(store.read_bytes("shards/00000/_SUCCESS.json"))
    bad_part = marker["parts"][0]["name"]
    marker["parts"][0]["sha256"] = "0" * 64
    store.overwrite("shards/00000/_SUCCESS.json", json.dumps(marker).encode())
    assert reduce_run(store, write=False)["shards"]["corrupt"] == [0]

    healer = start_worker(backend, uri, config, 0, 1, tmp_path / "logs")
    assert healer.wait() == 0
    lines = healer.log_lines()
    events = [line.get("event") for line in lines]
    assert "shard_already_committed" not in events and "marker_not_verified" in events and "shard_committed" in events
    assert any(line.get("event") == "parts_not_trusted" and line.get("parts") == [bad_part] for line in lines)
    # The part whose bytes differ from its commit is not trusted: its episodes ran again.
    rerun = set(healer.finished_episodes())
    distrusted = {record.episode_id for record in iter_part_records(bad_part, store.read_part(0, bad_part) or b"") if record}
    assert rerun == distrusted
    summary = reduce_run(store)
    assert summary["complete"] and summary["shards"]["committed"] == 1 and summary["counts"]["completed"] == 4
    assert summary["shards"]["per_shard"][0]["ignored_markers"] == 1
    # Healed means healed: the next worker trusts the new commit.
    again = start_worker(backend, uri, config, 0, 1, tmp_path / "logs")
    assert again.wait() == 0 and any(line.get("event") == "shard_already_committed" for line in again.log_lines())


def test_failed_episodes_retried_later_are_committed(backend: Backend, testbed: Testbed, tmp_path: Path) -> None:
    config = write_config(tmp_path, testbed, episodes=4)
    config.write_text(config.read_text().replace("max_retries: 5", "max_retries: 1"))  # fail fast while the model is away
    uri = backend.uri("recommit")
    assert cli("plan", str(config), "--run", uri, "--shards", "2", env=worker_env(backend)).returncode == 0
    assert start_worker(backend, uri, config, 0, None, tmp_path / "logs").wait() == 0
    with socket.socket() as closed:  # a port nobody listens on: every model call is refused
        closed.bind(("127.0.0.1", 0))
        dead_model = f"http://127.0.0.1:{closed.getsockname()[1]}/v1"
    away = start_worker(
        backend, uri, config, 1, None, tmp_path / "logs", env=worker_env(backend, SHOPSIMRL_MODEL_BASE_URL=dead_model)
    )
    assert away.wait() == 1  # committed with failures
    assert reduce_run(ShardedRunStore(uri), write=False)["shards"]["coverage"] == 0.5

    back = start_worker(backend, uri, config, 1, None, tmp_path / "logs")
    assert back.wait() == 0, back.log_lines()[-3:]
    assert len(back.finished_episodes()) == 2
    summary = reduce_run(ShardedRunStore(uri))
    assert summary["shards"]["coverage"] == 1.0 and summary["counts"]["completed"] == 4 and summary["complete"]
    assert ShardedRunStore(uri).list_shard(1).markers == ["_SUCCESS-" + back.log_lines()[0]["writer"] + ".json", "_SUCCESS.json"]


@pytest.mark.s3
def test_plan_and_worker_ride_out_lost_put_responses(s3_server: S3Server, testbed: Testbed, tmp_path: Path) -> None:
    """The answer to each create-only PUT is lost once: manifest, a part, the commit marker."""
    script = [
        Scripted("PUT", r"/manifest\.json$", "lost_response"),
        Scripted("PUT", r"/part-00000-[0-9a-f]+\.jsonl\.zst$", "lost_response"),
        Scripted("PUT", r"/_SUCCESS\.json$", "lost_response"),
    ]
    proxy = FaultProxy(s3_server.endpoint, FaultPlan(script=script))
    endpoint = proxy.start()
    try:
        backend = Backend(s3_server.kind, f"s3://{s3_server.bucket}/runs", {**S3_TEST_ENV, "AWS_ENDPOINT_URL": endpoint})
        config = write_config(tmp_path, testbed, episodes=3)
        uri = backend.uri("lost")
        planned = cli("plan", str(config), "--run", uri, "--shards", "1", env=worker_env(backend))
        assert planned.returncode == 0, planned.stderr[-2000:]
        worker = start_worker(backend, uri, config, 0, None, tmp_path / "logs")
        assert worker.wait() == 0, worker.log_lines()[-3:]
    finally:
        proxy.stop()
    assert all(entry.fired for entry in script), script
    summary = reduce_run(ShardedRunStore(uri), write=False)
    assert summary["complete"] and summary["counts"]["completed"] == 3
    assert ShardedRunStore(uri).list_shard(0).markers == ["_SUCCESS.json"]


def _edit_json(store: ShardedRunStore, name: str, edit) -> None:  # type: ignore[no-untyped-def]
    document = json.loads(store.read_bytes(name))
    edit(document)
    store.overwrite(name, json.dumps(document, indent=2).encode())


def test_reduce_and_status_refuse_what_the_worker_refuses(backend: Backend, testbed: Testbed, tmp_path: Path) -> None:
    config = write_config(tmp_path, testbed, episodes=4)
    env = worker_env(backend)
    for case in ("plan", "shard-map"):
        uri = backend.uri(case)
        assert cli("plan", str(config), "--run", uri, "--shards", "2", env=env).returncode == 0
        store = ShardedRunStore(uri)
        if case == "plan":
            # The stored plan no longer matches its fingerprint (a hand edit).
            _edit_json(store, "manifest.json", lambda m: m["plan"]["model"]["sampling"].update(temperature=0.9))
            expected = "plan_fingerprint does not match the plan it stores"
        else:
            # Episodes moved between shards, with the per-shard digests recomputed to match.
            def swap(shard_map: dict) -> None:
                a, b = shard_map["shards"]
                a["episode_ids"][0], b["episode_ids"][0] = b["episode_ids"][0], a["episode_ids"][0]
                for entry in (a, b):
                    entry["episode_ids_sha256"] = fingerprint(entry["episode_ids"])

            _edit_json(store, "shards.json", swap)
            expected = "assigns episodes differently"
        worker = start_worker(backend, uri, config, 0, None, tmp_path / "logs")
        assert worker.wait() == 2 and any(expected in str(line.get("reason")) for line in worker.log_lines())
        for command in (("reduce", uri), ("status", uri)):
            refused = cli(*command, env=env)
            assert refused.returncode == 2, (command, refused.stdout[-500:], refused.stderr[-500:])
            assert expected in refused.stderr and "Traceback" not in refused.stderr


# --------------------------------------------------------------------------- the reducer's end


def _kube_api(job: Any, pods: list[Any]) -> Any:
    """The two endpoints the reducer reads, serving one Job and its pods like an API server."""
    from kubernetes import client as k8s
    from starlette.applications import Starlette
    from starlette.responses import JSONResponse
    from starlette.routing import Route

    serialize = k8s.ApiClient().sanitize_for_serialization

    async def read_job(request: Any) -> JSONResponse:
        if request.path_params["name"] != job.metadata.name:
            return JSONResponse({"kind": "Status", "status": "Failure", "reason": "NotFound", "code": 404}, status_code=404)
        return JSONResponse(serialize(job))

    async def list_pods(request: Any) -> JSONResponse:
        return JSONResponse({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": [serialize(p) for p in pods]})

    return Starlette(
        routes=[Route("/apis/batch/v1/namespaces/{ns}/jobs/{name}", read_job), Route("/api/v1/namespaces/{ns}/pods", list_pods)]
    )


def _kubeconfig(path: Path, server: str) -> Path:
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "current-context": "stub",
                "clusters": [{"name": "stub", "cluster": {"server": server}}],
                "users": [{"name": "stub", "user": {}}],
                "contexts": [{"name": "stub", "context": {"cluster": "stub", "user": "stub"}}],
            }
        )
    )
    return path


def test_the_reducer_ends_with_a_partial_summary_when_a_shard_fails_for_good(testbed: Testbed, tmp_path: Path) -> None:
    from shopsimrl.testbed.serving import running_server
    from tests.test_kube import make_job, make_pod, terminated

    backend = Backend("local", str(tmp_path / "runs"))
    config = write_config(tmp_path, testbed, episodes=4)
    uri = backend.uri("partial")
    env = worker_env(backend)
    assert cli("plan", str(config), "--run", uri, "--shards", "2", env=env).returncode == 0
    assert start_worker(backend, uri, config, 1, 2, tmp_path / "logs").wait() == 0
    # Shard 0 never ran: its wait-ready init container found bad input, and FailIndex ended it.
    job = make_job("eval-x", completions=2, completed="1", failed="0")
    pods = [make_pod("eval-x-0-a", 0, "Failed", init=[terminated("wait-ready", 2, message="bad config")], failure_count=0)]
    with running_server(_kube_api(job, pods)) as api:
        kube_env = {**env, "KUBECONFIG": str(_kubeconfig(tmp_path / "kubeconfig", api))}
        # A day-long timeout: only the Job's view can end this wait (the subprocess timeout guards it).
        reduced = cli(
            "reduce",
            uri,
            "--wait",
            "--timeout",
            "86400",
            "--worker-job",
            "eval-x",
            "--namespace",
            "evals",
            env=kube_env,
            timeout=120,
        )
    assert reduced.returncode == 1, reduced.stderr[-2000:]
    summary = json.loads(ShardedRunStore(uri).read_bytes("summary.json"))
    assert summary["complete"] is False and summary["counts"]["completed"] == 2 and summary["shards"]["committed"] == 1
    assert summary["incomplete"]["reason"] == "the worker Job eval-x reports failed indexes 0; 1 shards will not commit"
    (missing,) = summary["incomplete"]["missing_shards"]
    assert missing["shard"] == 0 and missing["state"] == "uncommitted"
    assert missing["why"].startswith(
        "index 0 failed in Job eval-x; last exit 2 (bad_input) in container wait-ready; no commit marker and no parts"
    )
    assert "shard 0 missing: index 0 failed" in reduced.stderr

    # Without access to the API the Job's view is missing: the deadline ends the wait instead.
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        no_api = _kubeconfig(tmp_path / "kubeconfig-closed", f"http://127.0.0.1:{closed.getsockname()[1]}")
    blind = {**env, "KUBECONFIG": str(no_api)}
    timed_out = cli("reduce", uri, "--wait", "--timeout", "1", "--worker-job", "eval-x", "--namespace", "evals", env=blind)
    assert timed_out.returncode == 3 and "cannot read Job eval-x in evals" in timed_out.stderr
    deadline = cli("reduce", uri, "--wait", "--timeout", "1", "--partial-on-timeout", "--worker-job", "eval-x", env=blind)
    assert deadline.returncode == 1, deadline.stderr[-2000:]
    summary = json.loads(ShardedRunStore(uri).read_bytes("summary.json"))
    assert summary["incomplete"]["reason"] == "the reducer stopped waiting after 1 s (--timeout) with 1 shards uncommitted"
    assert summary["incomplete"]["missing_shards"][0]["why"].startswith("no commit marker and no parts")
    assert "Traceback" not in timed_out.stderr + deadline.stderr


def test_the_agents_failures_stay_final_in_a_sharded_run_and_are_rerolled_only_when_asked(
    backend: Backend, tmp_path: Path
) -> None:
    from tests.testbed_process import start_testbed

    with start_testbed(SHOPSIM_POLICY_RATE_SERVER_CRASH="0.3") as bed:
        config = write_config(tmp_path, bed, episodes=8)
        uri = backend.uri("final")
        env = worker_env(backend)
        first = cli("run", str(config), "--shards", "2", "--run", uri, env=env)
        assert first.returncode == 1, first.stderr[-2000:]
        store = ShardedRunStore(uri)
        before = reduce_run(store, write=False)
        failed = before["failure_classes"].get("environment_error", 0)
        assert 0 < failed == before["counts"]["failed"] and before["intent_to_treat"]["rerolled"] == 0
        parts = {i: store.list_shard(i).parts for i in (0, 1)}

        again = cli("run", str(config), "--shards", "2", "--run", uri, env=env)
        assert again.returncode == 1
        assert {i: store.list_shard(i).parts for i in (0, 1)} == parts  # nothing ran, nothing was written
        assert reduce_run(store, write=False)["intent_to_treat"] == before["intent_to_treat"]

        rerolled = cli("run", str(config), "--shards", "2", "--run", uri, "--reroll-failed", env=env)
        assert rerolled.returncode == 1  # the same actions fail the same way
        after = reduce_run(store, write=False)
        assert after["intent_to_treat"]["rerolled"] == failed and after["counts"]["failed"] == failed
        marked = [
            record
            for i in (0, 1)
            for name in store.list_shard(i).parts
            for record in iter_part_records(name, store.read_part(i, name) or b"")
            if record and record.rerolled_from
        ]
        assert len(marked) == failed and {r.rerolled_from for r in marked} == {"environment_error"}
