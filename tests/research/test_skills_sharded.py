"""The per-trajectory analysis as an Indexed Job (``skills plan`` → ``skills worker`` processes
→ ``skills reduce``) against the real HTTP model stub: the reduced files equal the local
stage's (local directory, moto server, SeaweedFS), ``skills build`` continues from them, a worker
killed with SIGKILL at a forced point resumes without losing or redoing an analysis, and a torn
part or a marker whose checksum does not match is not trusted."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

import orjson
import pytest

from shopsimrl.research.skills.analyst import (
    ANALYSES_NAME,
    CARDS_NAME,
    ERRORS_NAME,
    SUMMARY_NAME,
    latest_traces,
    run_success_analysis,
)
from shopsimrl.research.skills.build import analyst_config, failure_config, load_skills_config
from shopsimrl.research.skills.failure import FailureAnalysis
from shopsimrl.research.skills.inputs import read_train_traces
from tests.openai_stub import OpenAIStub, Received, Reply, completion, tool_call
from tests.research.test_skill_builder import cards_reply, good_card, numbered, request_episode, write_traces
from tests.research.test_skills_build import answer
from tests.sharded.conftest import S3_TEST_ENV, _make_bucket, cli, seaweedfs_endpoint
from tests.testbed_process import LocalTestbed

from .conftest import all_free, hold_at, options_train_run, stopped_while_held

__all__ = ["seaweedfs_endpoint"]  # the session fixture, used by name

REPO = Path(__file__).resolve().parents[2]
FILES = (ANALYSES_NAME, ERRORS_NAME, CARDS_NAME, SUMMARY_NAME)
TIMES = ("started_at", "ended_at", "written_at", "latency_ms", "proposed_at")


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("AWS_", "SHOPSIMRL_"))}
    return {**env, **(extra or {})}


def _config(
    tmp_path: Path,
    url: str,
    *,
    expected: int,
    concurrency: int = 1,
    output: str = "out",
    shop: str = "http://127.0.0.1:1",
    model: str = "stub-model",
    traces: str = "traces.jsonl",
) -> Path:
    """SKILLS.yaml; ``shop``: the failure analyst's ShopSimulator (the default refuses at once)."""
    path = tmp_path / "skills.yaml"
    path.write_text(
        f"experiment: {{traces: '{traces}', output_dir: {output}, expected_trajectories: {expected}, "
        f"concurrency: {concurrency}}}\n"
        f"environment: {{base_url: '{shop}'}}\n"
        "proposal_checkpoint: qwen35-4b-initial\n"
        f"analyst_model: {{name: {model}, base_url: '{url}', api_key_env: null, max_retries: 1, "
        "retry_backoff_seconds: 0}\n",
        encoding="utf-8",
    )
    return path


def _traces(tmp_path: Path, successes: int = 6, failures: int = 1) -> Path:
    records = [numbered(n) for n in range(1, successes + 1)]
    records += [numbered(successes + n, success=False) for n in range(1, failures + 1)]
    return write_traces(tmp_path / "traces.jsonl", records)


def _timeless(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _timeless(item) for key, item in value.items() if key not in TIMES and key != "shards"}
    if isinstance(value, list):
        return [_timeless(item) for item in value]
    return value


def _read(files: dict[str, bytes]) -> dict[str, Any]:
    """The four files, parsed, without times (and the reducer's shard counts)."""
    parsed: dict[str, Any] = {}
    for name, data in files.items():
        if name.endswith(".json"):
            parsed[name] = _timeless(orjson.loads(data))
        else:
            parsed[name] = [_timeless(orjson.loads(line)) for line in data.splitlines() if line.strip()]
    return parsed


def _dir_files(path: Path) -> dict[str, bytes]:
    return {name: (path / name).read_bytes() for name in FILES}


def _local(tmp_path: Path, config: Path) -> dict[str, Any]:
    """The local stage's files over the config's traces (read as ``skills build`` reads them)
    with its analysts, the failure analyst's live sessions included (concurrency 1: the records
    in trace order, as the reducer writes them)."""
    out = tmp_path / "local-out"
    skills = load_skills_config(config)
    e = skills.experiment
    traces = read_train_traces(skills.location(e.traces), expected=e.expected_trajectories)
    run_success_analysis(traces, out, analyst_config(skills), FailureAnalysis(failure_config(skills)))
    return _read(_dir_files(out))


def _workers(config: Path, run: str, shards: int, env: dict[str, str]) -> None:
    """Every index as its own process, started together like an Indexed Job's pods."""
    processes = [
        subprocess.Popen(
            [sys.executable, "-m", "shopsimrl", "skills", "worker", str(config), "--run", run],
            cwd=REPO,
            env={**env, "JOB_COMPLETION_INDEX": str(index)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        for index in range(shards)
    ]
    for process in processes:
        _, err = process.communicate(timeout=180)
        assert process.returncode == 0, err.decode()[-3000:]


def _worker(config: Path, run: str, stderr: int = subprocess.PIPE) -> subprocess.Popen[bytes]:
    """Index 0's worker as a process of its own, to be stopped at a forced point."""
    return subprocess.Popen(
        [sys.executable, "-m", "shopsimrl", "skills", "worker", str(config), "--run", run, "--index", "0"],
        cwd=REPO,
        env=_env(),
        stdout=subprocess.DEVNULL,
        stderr=stderr,
    )


def _worker_held_at(
    server: OpenAIStub, config: Path, run: str, n: int, waiting_for: str
) -> AbstractContextManager[subprocess.Popen[bytes]]:
    """Index 0's worker with the stub holding its ``n``-th request (good cards otherwise): the
    body stops the worker while it waits (``stopped_while_held``)."""
    asked, release = threading.Event(), threading.Event()
    server.reset()
    server.responder = hold_at(server, n, asked, release, lambda: cards_reply(good_card()))
    return stopped_while_held(_worker(config, run), asked, release, waiting_for)


def _plan(tmp_path: Path, config: Path, shards: int) -> str:
    """Plans the run ``analysis`` under ``tmp_path`` in ``shards`` shards; returns its location."""
    run = str(tmp_path / "analysis")
    assert cli("skills", "plan", str(config), "--run", run, "--shards", str(shards), env=_env()).returncode == 0
    return run


def _successes_planned(tmp_path: Path, url: str, successes: int, shards: int) -> tuple[Path, str]:
    """Traces of ``successes`` successful episodes, their config and their run planned in ``shards``."""
    _traces(tmp_path, successes=successes, failures=0)
    config = _config(tmp_path, url, expected=successes)
    return config, _plan(tmp_path, config, shards)


def _holding_the_live_session(in_session: threading.Event, stopped: threading.Event) -> Callable[[Received], Awaitable[Reply]]:
    """A responder that answers as ``answer`` does but holds the failure analyst's live session:
    its first call searches, the answer to that search waits for ``stopped``."""

    async def held(request: Received) -> Reply:
        if "submit_failure_card" not in [t["function"]["name"] for t in request.json["tools"]]:
            return answer(request)
        if request.json["messages"][-1]["role"] != "tool":
            return Reply(json=completion(tool_calls=[tool_call("search", orjson.dumps({"query": "台灯"}).decode())]))
        in_session.set()  # the search ran in the live session, which holds its lease now
        await asyncio.to_thread(stopped.wait, 120)
        return answer(request)

    return held


def _served(served: tuple[OpenAIStub, str]) -> tuple[OpenAIStub, str]:
    server, url = served
    server.reset()
    server.responder = answer
    return server, url


def _tool(request: Received) -> str:
    return str(request.json["tools"][0]["function"]["name"])


def _asked(request: Received) -> int:
    """The task id of the trace an analyst's request carries (either channel)."""
    user = orjson.loads(request.json["messages"][1]["content"])
    if "failed_trace_and_privileged_gold" in user:
        return int(user["failed_trace_and_privileged_gold"]["instruction"].split("#")[-1])
    return request_episode(request)


@pytest.mark.slow
def test_local_sharded_equals_unsharded_and_skills_build_continues(
    tmp_path: Path, served: tuple[OpenAIStub, str], testbed: LocalTestbed
) -> None:
    server, url = _served(served)
    testbed.release_all()
    _traces(tmp_path)
    config = _config(tmp_path, url, expected=7, shop=testbed.shop_url)
    local = _local(tmp_path, config)
    assert local[SUMMARY_NAME]["episodes"]["analysed"] == 7 and len(local[CARDS_NAME]) == 7
    assert local[SUMMARY_NAME]["failure_cards"]["status"] == {"NO_PROPOSAL": 1}
    run = str(tmp_path / "analysis")

    planned = cli("skills", "plan", str(config), "--run", run, "--shards", "3", env=_env())
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert "7 episodes (7 to analyse) · 3 shards" in planned.stdout
    assert cli("skills", "plan", str(config), "--run", run, "--shards", "3", env=_env()).returncode == 0  # idempotent
    other = cli("skills", "plan", str(config), "--run", run, "--shards", "2", env=_env())
    assert other.returncode == 2 and "frozen with 3 shards" in other.stderr
    fewer = tmp_path / "fewer.yaml"  # other traces (one trajectory less) at the same location
    write_traces(tmp_path / "fewer.jsonl", [numbered(n) for n in range(1, 7)])
    fewer.write_text(
        config.read_text()
        .replace("traces: 'traces.jsonl'", "traces: 'fewer.jsonl'")
        .replace("trajectories: 7", "trajectories: 6"),
        encoding="utf-8",
    )
    refused_plan = cli("skills", "plan", str(fewer), "--run", run, "--shards", "3", env=_env())
    assert refused_plan.returncode == 42 and "the traces, their input fingerprints or the analysts" in refused_plan.stderr
    early = cli("skills", "reduce", run, env=_env())
    assert early.returncode == 1 and "0 of 3 committed" in early.stdout
    planned_only = cli("skills", "status", run, env=_env())
    assert planned_only.returncode == 0, planned_only.stderr[-3000:]
    assert "7 episodes (7 to analyse) · 0/3 shards committed (0 analysed)" in planned_only.stdout
    assert planned_only.stdout.count("not started") == 3

    # A worker whose analyst differs from the plan's (another max_cards) is refused before any call.
    changed = tmp_path / "changed.yaml"
    changed.write_text(config.read_text() + "analysis: {max_cards_per_trajectory: 1}\n", encoding="utf-8")
    server.reset()
    server.responder = answer
    refused = cli("skills", "worker", str(changed), "--run", run, "--index", "0", env=_env())
    assert refused.returncode == 42 and "analysts.success" in refused.stderr and not server.completions

    _workers(config, run, 3, _env())
    assert sorted(_asked(r) for r in server.completions) == [1, 2, 3, 4, 5, 6, 7]
    assert all_free(testbed)  # each live session gave its lease back
    server.reset()
    server.responder = answer
    again = cli("skills", "worker", str(config), "--run", run, "--index", "1", env=_env())  # a retried index
    assert again.returncode == 0 and not server.completions

    out = tmp_path / "out"
    reduced = cli("skills", "reduce", run, "--output", str(out), env=_env())
    assert reduced.returncode == 0, reduced.stderr[-3000:]
    assert "3 of 3 committed" in reduced.stdout
    assert _read(_dir_files(out)) == local
    assert _read(_dir_files(tmp_path / "analysis")) == local
    summary = orjson.loads((out / SUMMARY_NAME).read_bytes())
    assert summary["shards"] == {"count": 3, "committed": 3, "missing": []}
    done = orjson.loads(cli("skills", "status", run, "--json", env=_env()).stdout)
    assert done["committed_shards"] == done["summary_over_shards"] == 3
    assert done["analysed_in_committed_shards"] == 7 and sum(row["episodes"] for row in done["shards"]) == 7

    # skills build over the reduced files: no analysis asked again, straight to the draft.
    server.reset()
    server.responder = answer
    built = cli("skills", "build", str(config), env=_env())
    assert built.returncode == 0, built.stderr[-3000:] + built.stdout
    assert [_tool(r) for r in server.completions] == ["submit_clusters", "submit_initial_skill"]
    assert (out / "initial_skill_draft.json").exists()
    assert orjson.loads((out / SUMMARY_NAME).read_bytes())["episodes"]["reused"] == 7


@pytest.mark.slow
@pytest.mark.s3
@pytest.mark.parametrize("kind", ["moto", "seaweedfs"])
def test_sharded_on_s3_equals_local(
    tmp_path: Path, served: tuple[OpenAIStub, str], testbed: LocalTestbed, kind: str, request: pytest.FixtureRequest
) -> None:
    endpoint = str(request.getfixturevalue({"moto": "moto_endpoint", "seaweedfs": "seaweedfs_endpoint"}[kind]))
    server, url = _served(served)
    testbed.release_all()
    _traces(tmp_path, successes=5, failures=2)
    config = _config(tmp_path, url, expected=7, shop=testbed.shop_url)
    local = _local(tmp_path, config)
    s3 = {**S3_TEST_ENV, "AWS_ENDPOINT_URL": endpoint}
    bucket = _make_bucket(endpoint, s3["AWS_ACCESS_KEY_ID"], s3["AWS_SECRET_ACCESS_KEY"])
    run = f"s3://{bucket}/skills/analysis"
    env = _env(s3)
    planned = cli("skills", "plan", str(config), "--run", run, "--shards", "2", env=env)
    assert planned.returncode == 0, planned.stderr[-3000:]
    server.reset()
    server.responder = answer
    _workers(config, run, 2, env)
    assert sorted(_asked(r) for r in server.completions) == [1, 2, 3, 4, 5, 6, 7]
    assert all_free(testbed)
    out = tmp_path / "out"
    reduced = cli("skills", "reduce", run, "--output", str(out), env=env)
    assert reduced.returncode == 0, reduced.stderr[-3000:]
    assert "2 of 2 committed" in reduced.stdout
    assert "7 of 7 trajectories analysed (5 successful, 2 failed)" in reduced.stdout
    assert "0 failure proposals, 2 NO_PROPOSAL" in reduced.stdout
    assert _read(_dir_files(out)) == local

    import s3fs

    fs = s3fs.S3FileSystem(
        key=s3["AWS_ACCESS_KEY_ID"], secret=s3["AWS_SECRET_ACCESS_KEY"], client_kwargs={"endpoint_url": endpoint}
    )
    stored = {name: fs.cat_file(f"{bucket}/skills/analysis/{name}") for name in FILES}
    assert _read(stored) == local
    for name in (*FILES, "skills_plan.json"):
        assert s3["AWS_SECRET_ACCESS_KEY"] not in fs.cat_file(f"{bucket}/skills/analysis/{name}").decode()


def _part_records(shard: Path) -> list[dict[str, Any]]:
    import zstandard

    found = []
    for part in sorted(shard.glob("part-*")):
        data = zstandard.ZstdDecompressor().decompressobj().decompress(part.read_bytes())
        found += [orjson.loads(line) for line in data.splitlines() if line.strip()]
    return found


@pytest.mark.slow
def test_worker_killed_mid_shard_resumes_losing_and_redoing_nothing(tmp_path: Path, served: tuple[OpenAIStub, str]) -> None:
    server, url = _served(served)
    config, run = _successes_planned(tmp_path, url, successes=5, shards=1)
    shard = tmp_path / "analysis" / "shards" / "00000"
    # The worker is killed while it waits for the third answer: two analyses are saved, none held.
    with _worker_held_at(server, config, run, 3, "no 3rd request") as worker:
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait(30)
    assert not list(shard.glob("_SUCCESS*"))
    (killed,) = orjson.loads(cli("skills", "status", run, "--json", env=_env()).stdout)["shards"]
    assert killed["state"] == "started" and killed["parts"] == 2
    before = _part_records(shard)
    assert sorted(r["episode_id"] for r in before) == ["task-000001__sample-000", "task-000002__sample-000"]

    server.reset()
    server.responder = lambda request: cards_reply(good_card())
    resumed = cli("skills", "worker", str(config), "--run", run, "--index", "0", env=_env({"SHOPSIMRL_LOG_FORMAT": "json"}))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert sorted(request_episode(r) for r in server.completions) == [3, 4, 5]  # nothing redone
    started = [
        line
        for line in map(orjson.loads, (raw for raw in resumed.stderr.splitlines() if raw.startswith("{")))
        if line.get("event") == "skills_shard_started"
    ]
    assert [line["already_analysed"] for line in started] == [2]
    after = _part_records(shard)
    assert len(after) == 5 and all(r["status"] == "ok" for r in after)  # every analysis made once
    assert [r for r in after if r["episode_id"] in {b["episode_id"] for b in before}] == before  # nothing lost
    reduced = cli("skills", "reduce", run, env=_env())
    assert reduced.returncode == 0, reduced.stderr[-3000:]
    summary = orjson.loads((tmp_path / "analysis" / SUMMARY_NAME).read_bytes())
    assert summary["status"] == "complete" and summary["episodes"]["analysed"] == 5


@pytest.mark.slow
def test_a_torn_part_and_a_bad_checksum_marker_are_not_trusted(tmp_path: Path, served: tuple[OpenAIStub, str]) -> None:
    server, url = _served(served)
    config, run = _successes_planned(tmp_path, url, successes=4, shards=2)
    _workers(config, run, 2, _env())
    shard0, shard1 = (tmp_path / "analysis" / "shards" / f"{n:05d}" for n in range(2))

    # Shard 0: a part cut short (its marker's sha256 no longer matches).
    torn = sorted(shard0.glob("part-*"))[0]
    torn_episode = _part_records(shard0)[0]["episode_id"]
    data = torn.read_bytes()
    torn.write_bytes(data[: len(data) // 2])
    # Shard 1: its only marker forged with another checksum for a part that is intact.
    (marker_path,) = shard1.glob("_SUCCESS*")
    marker = orjson.loads(marker_path.read_bytes())
    marker["parts"][0]["sha256"] = "0" * 64
    marker_path.write_bytes(orjson.dumps(marker))

    reduced = cli("skills", "reduce", run, env=_env())
    assert reduced.returncode == 1 and "0 of 2 committed, missing [0, 1]" in reduced.stdout
    summary = orjson.loads((tmp_path / "analysis" / SUMMARY_NAME).read_bytes())
    assert summary["status"] == "incomplete" and summary["episodes"]["missing"] == 4
    assert not (tmp_path / "analysis" / ANALYSES_NAME).read_bytes()

    # The retried index 0 analyses the torn part's episode again, and only it; index 1 has
    # nothing to redo and commits anew with a marker that verifies.
    server.reset()
    server.responder = lambda request: cards_reply(good_card())
    for index in range(2):
        again = cli("skills", "worker", str(config), "--run", run, "--index", str(index), env=_env())
        assert again.returncode == 0, again.stderr[-3000:]
    assert [request_episode(r) for r in server.completions] == [int(torn_episode.split("-")[1].split("__")[0])]
    reduced = cli("skills", "reduce", run, env=_env())
    assert reduced.returncode == 0, reduced.stderr[-3000:]
    assert "2 of 2 committed" in reduced.stdout
    records = [orjson.loads(line) for line in (tmp_path / "analysis" / ANALYSES_NAME).read_bytes().splitlines()]
    assert sorted(r["episode_id"] for r in records) == [f"task-{n:06d}__sample-000" for n in range(1, 5)]


def test_the_analyst_url_override_is_checked_and_left_out_of_the_fingerprint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shopsimrl.research.skills.analyst import SkillInputError
    from shopsimrl.research.skills.sharded import analysts_for

    config = _config(tmp_path, "http://127.0.0.1:9/v1", expected=1)
    plain = load_skills_config(config)
    monkeypatch.setenv("SHOPSIMRL_ANALYST_BASE_URL", "http://analyst.models.svc.cluster.local:8001/v1")
    moved = load_skills_config(config)
    assert moved.analyst_model.base_url == "http://analyst.models.svc.cluster.local:8001/v1"
    assert [a.identity for a in analysts_for(moved)] == [a.identity for a in analysts_for(plain)]
    monkeypatch.setenv("SHOPSIMRL_ANALYST_BASE_URL", "http://user:hunter2@analyst:8001/v1")
    with pytest.raises(SkillInputError, match="SHOPSIMRL_ANALYST_BASE_URL") as caught:
        load_skills_config(config)
    assert "hunter2" not in str(caught.value)


@pytest.mark.slow
def test_failed_analyses_exit_1_reach_the_errors_file_and_only_they_are_asked_again(
    tmp_path: Path, served: tuple[OpenAIStub, str]
) -> None:
    server, url = _served(served)
    config, run = _successes_planned(tmp_path, url, successes=3, shards=1)

    def invalid_for_the_second(request: Received) -> Reply:
        return cards_reply(raw="not json") if request_episode(request) == 2 else cards_reply(good_card())

    server.reset()
    server.responder = invalid_for_the_second
    failed = cli("skills", "worker", str(config), "--run", run, "--index", "0", env=_env())
    assert failed.returncode == 1, failed.stderr[-3000:]
    (marker_path,) = (tmp_path / "analysis" / "shards" / "00000").glob("_SUCCESS*")
    assert orjson.loads(marker_path.read_bytes())["episodes"] == {"completed": 2, "failed": 1}
    reduced = cli("skills", "reduce", run, env=_env())
    assert reduced.returncode == 1 and "2 of 3 trajectories analysed (3 successful, 0 failed)" in reduced.stdout
    (error,) = [orjson.loads(line) for line in (tmp_path / "analysis" / ERRORS_NAME).read_bytes().splitlines()]
    assert error["episode_id"] == "task-000002__sample-000" and error["status"] == "invalid"
    assert len(error["attempts"]) == 3 and all("not valid JSON" in a["error"] for a in error["attempts"])

    server.reset()
    server.responder = lambda request: cards_reply(good_card())
    again = cli("skills", "worker", str(config), "--run", run, "--index", "0", env=_env())
    assert again.returncode == 0, again.stderr[-3000:]
    assert [request_episode(r) for r in server.completions] == [2]
    reduced = cli("skills", "reduce", run, env=_env())
    assert reduced.returncode == 0 and "3 of 3 trajectories analysed (3 successful, 0 failed)" in reduced.stdout
    assert not (tmp_path / "analysis" / ERRORS_NAME).read_bytes()


@pytest.mark.slow
def test_sigterm_saves_what_was_analysed_and_exits_3_without_a_marker(tmp_path: Path, served: tuple[OpenAIStub, str]) -> None:
    server, url = _served(served)
    config, run = _successes_planned(tmp_path, url, successes=4, shards=1)
    shard = tmp_path / "analysis" / "shards" / "00000"
    with _worker_held_at(server, config, run, 2, "no 2nd request") as worker:
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=60)
    assert worker.returncode == 3, err.decode()[-3000:]
    assert not list(shard.glob("_SUCCESS*"))
    assert [r["episode_id"] for r in _part_records(shard)] == ["task-000001__sample-000"]


@pytest.mark.slow
def test_skills_build_with_shards_gives_the_draft_the_unsharded_build_gives(
    tmp_path: Path, served: tuple[OpenAIStub, str], testbed: LocalTestbed
) -> None:
    server, url = _served(served)
    testbed.release_all()
    drafts = {}
    for kind in ("unsharded", "sharded"):
        folder = tmp_path / kind
        folder.mkdir()
        _traces(folder, successes=5, failures=1)
        config = _config(folder, url, expected=6, shop=testbed.shop_url)
        server.reset()
        server.responder = answer
        args = ["--shards", "3", "--run", str(folder / "analysis")] if kind == "sharded" else []
        built = cli("skills", "build", str(config), *args, env=_env())
        assert built.returncode == 0, built.stderr[-3000:] + built.stdout
        # The failure analyst's one call offers the page's tools first (search) and its card.
        assert sorted(_tool(r) for r in server.completions) == sorted(
            ["search"] + ["submit_success_cards"] * 5 + ["submit_clusters", "submit_initial_skill"]
        )
        out = folder / "out"
        drafts[kind] = {
            name: _read({name: (out / name).read_bytes()})[name]
            for name in (CARDS_NAME, "initial_skill_draft.json", "initial_skillbank.json", "proposal_ledger.jsonl")
        }
    assert "3 of 3 committed" in built.stdout
    assert drafts["sharded"] == drafts["unsharded"]
    mixed = cli("skills", "build", str(tmp_path / "sharded" / "skills.yaml"), "--shards", "3", env=_env())
    assert mixed.returncode == 2 and "--shards and --run go together" in mixed.stderr


def test_the_environment_url_override_is_checked_and_left_out_of_the_fingerprint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from shopsimrl.research.skills.analyst import SkillInputError
    from shopsimrl.research.skills.sharded import analysts_for

    monkeypatch.delenv("SHOPSIMRL_ENV_BASE_URL", raising=False)
    monkeypatch.delenv("SHOPSIMRL_ANALYST_BASE_URL", raising=False)
    config = _config(tmp_path, "http://127.0.0.1:9/v1", expected=1)
    plain = load_skills_config(config)
    failed = latest_traces(write_traces(tmp_path / "traces.jsonl", [numbered(4, success=False)]))[0]
    monkeypatch.setenv("SHOPSIMRL_ENV_BASE_URL", "http://shopsimulator.shopsimrl.svc.cluster.local:5700")
    moved = load_skills_config(config)
    assert moved.environment.base_url == "http://shopsimulator.shopsimrl.svc.cluster.local:5700"
    assert failure_config(moved).environment.base_url == moved.environment.base_url
    assert [a.identity for a in analysts_for(moved)] == [a.identity for a in analysts_for(plain)]
    assert [a.channel for a in analysts_for(moved)] == ["success", "failure"]
    assert analysts_for(moved)[1].fingerprint(failed) == analysts_for(plain)[1].fingerprint(failed)
    for bad, message in (
        ("http://user:hunter2@shop:5700", "credentials"),
        ("shop:5700", "SHOPSIMRL_ENV_BASE_URL (overrides environment.base_url of"),
    ):
        monkeypatch.setenv("SHOPSIMRL_ENV_BASE_URL", bad)
        with pytest.raises(SkillInputError, match="SHOPSIMRL_ENV_BASE_URL") as caught:
            load_skills_config(config)
        assert message in str(caught.value) and "hunter2" not in str(caught.value)


@pytest.mark.slow
def test_sigterm_mid_live_session_gives_the_lease_back_and_the_retry_commits(
    tmp_path: Path, served: tuple[OpenAIStub, str], testbed: LocalTestbed
) -> None:
    server, url = _served(served)
    testbed.release_all()
    write_traces(tmp_path / "traces.jsonl", [numbered(1), numbered(4, success=False)])
    config = _config(tmp_path, url, expected=2, shop=testbed.shop_url)
    run = _plan(tmp_path, config, 1)
    shard = tmp_path / "analysis" / "shards" / "00000"
    in_session, stopped = threading.Event(), threading.Event()
    server.responder = _holding_the_live_session(in_session, stopped)
    with stopped_while_held(_worker(config, run), in_session, stopped, "") as worker:
        assert not all_free(testbed)
        worker.send_signal(signal.SIGTERM)
        _, err = worker.communicate(timeout=60)
    assert worker.returncode == 3, err.decode()[-3000:]
    assert all_free(testbed)  # the cut session released its lease before the exit
    assert not list(shard.glob("_SUCCESS*"))
    assert [(r["channel"], r["status"]) for r in _part_records(shard)] in ([], [("success", "ok")])

    server.reset()
    server.responder = answer
    again = cli("skills", "worker", str(config), "--run", run, "--index", "0", env=_env())
    assert again.returncode == 0, again.stderr[-3000:]
    assert _asked(server.completions[-1]) == 4 and all_free(testbed)
    reduced = cli("skills", "reduce", run, env=_env())
    assert reduced.returncode == 0 and "2 of 2 trajectories analysed (1 successful, 1 failed)" in reduced.stdout


@pytest.mark.slow
def test_a_worker_killed_mid_live_session_leaves_the_slot_to_its_retry(
    tmp_path: Path, served: tuple[OpenAIStub, str], testbed: LocalTestbed
) -> None:
    """kill -9 while the live session holds its lease: the slot stays taken (a lease never
    expires), the shard's journal names it, and the index's next run releases it before it
    analyses anything; afterwards every slot is free."""
    server, url = _served(served)
    testbed.release_all()
    write_traces(tmp_path / "traces.jsonl", [numbered(1), numbered(4, success=False)])
    config = _config(tmp_path, url, expected=2, shop=testbed.shop_url)
    run = _plan(tmp_path, config, 1)
    in_session, stopped = threading.Event(), threading.Event()
    server.responder = _holding_the_live_session(in_session, stopped)
    worker = _worker(config, run, stderr=subprocess.DEVNULL)
    with stopped_while_held(worker, in_session, stopped, "the live session never started"):
        worker.kill()
        assert worker.wait(timeout=60) == -signal.SIGKILL
    assert not all_free(testbed)  # nobody released the killed session's lease
    assert list((tmp_path / "analysis" / "leases" / "00000").glob("*.jsonl"))

    server.reset()
    server.responder = answer
    again = cli("skills", "worker", str(config), "--run", run, "--index", "0", env=_env({"SHOPSIMRL_LOG_FORMAT": "json"}))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "released the leases of stopped processes" in again.stderr
    assert all_free(testbed)
    reduced = cli("skills", "reduce", run, env=_env())
    assert reduced.returncode == 0 and "2 of 2 trajectories analysed (1 successful, 1 failed)" in reduced.stdout


@pytest.fixture(scope="module")
def options_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalTestbed, Path]]:
    """A train run of 12 persona tasks that bought without the wanted options (``options_train_run``)."""
    with options_train_run(tmp_path_factory.mktemp("skills-train"), sample_size=12, concurrency=4) as run:
        yield run


@pytest.mark.slow
def test_the_testbed_analysts_sharded_equal_the_unsharded_stage(tmp_path: Path, options_run: tuple[LocalTestbed, Path]) -> None:
    bed, traces = options_run
    bed.release_all()
    # The run directory, not its traces.jsonl: the planner reads a run as skills build does.
    config = _config(tmp_path, bed.model_url, expected=12, shop=bed.shop_url, model="shopsim-analyst", traces=str(traces.parent))
    local = _local(tmp_path, config)
    episodes = local[SUMMARY_NAME]["episodes"]
    assert local[SUMMARY_NAME]["status"] == "complete" and episodes["failure"] >= 2 and episodes["success"] >= 1
    failures = [r for r in local[ANALYSES_NAME] if r["channel"] == "failure"]
    assert all(r["live_session"]["trials"] for r in failures)  # each one acted in a live session
    assert all_free(bed)

    run = _plan(tmp_path, config, 3)
    source = orjson.loads((tmp_path / "analysis" / "skills_plan.json").read_bytes())["source"]
    assert source["input"] == "traces" and source["traces"] == str(traces.parent)
    _workers(config, run, 3, _env())
    assert all_free(bed)
    reduced = cli("skills", "reduce", run, "--output", str(tmp_path / "out"), env=_env())
    assert reduced.returncode == 0, reduced.stderr[-3000:]
    assert _read(_dir_files(tmp_path / "out")) == local
