"""The offline judge stage: kappa against hand-computed values, the rubric's schema check, the
config's errors, and the stage end to end against the real testbed judge (served by ``shopsimrl
testbed up`` as the model ``shopsim-judge``): locally, with the repair and unparseable paths,
resumed after kill -9 without duplicate verdicts, and sharded on moto S3 with the same verdicts
as the local stage."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson
import pytest

from shopsimrl.research.judge.config import JudgeConfigError, load_judge_config, load_rubric, rubric_from_bytes, schema_errors
from shopsimrl.research.judge.summary import agreement, cohen_kappa
from shopsimrl.testbed.judge import judge_reply, verdict_of
from tests.sharded.conftest import _make_bucket, cli
from tests.testbed_process import LocalTestbed, start_testbed

from .conftest import ResearchRuns

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
RUBRIC = REPO / "configs" / "judge_rubric.v1.yaml"


def _lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines() if line.strip()]


def _config(
    tmp_path: Path, source: str, model_url: str, *, output: Path | None = None, name: str = "judge.yaml", **extra: Any
) -> Path:
    output = output or tmp_path / "judge-out"
    concurrency = extra.pop("concurrency", 4)
    select = extra.pop("select", "all")
    flush_every = extra.pop("flush_every", 3)
    path = tmp_path / name
    path.write_text(
        f"""name: test-judge
source: {source}
rubric: {RUBRIC}
output: {output}
model:
  model: shopsim-judge
  base_url: {model_url}
  timeout: 30
  retry_backoff_seconds: 0.05
selection: {{select: {select}, include: [goal]}}
max_repairs: 2
concurrency: {concurrency}
flush_every: {flush_every}
""",
        encoding="utf-8",
    )
    return path


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("AWS_", "SHOPSIMRL_"))}
    return {**env, **(extra or {})}


def _verdicts(records: list[dict[str, Any]]) -> dict[str, tuple[str, Any]]:
    return {record["episode_id"]: (record["status"], record["verdict"]) for record in records}


# --------------------------------------------------------------------------- kappa


def test_kappa_matches_hand_computed_values() -> None:
    # p_o = 35/50 = 0.7; judge yes 25/50, other yes 30/50: p_e = 0.5·0.6 + 0.5·0.4 = 0.5; κ = 0.2/0.5
    assert cohen_kappa(20, 5, 10, 15) == (pytest.approx(0.4), None)
    # p_o = 0.9, p_e = 0.5: κ = 0.8
    assert cohen_kappa(45, 5, 5, 45) == (pytest.approx(0.8), None)
    # p_o = 0.9; judge yes 0.7, other yes 0.6: p_e = 0.42 + 0.12 = 0.54; κ = 0.36/0.46
    assert cohen_kappa(6, 1, 0, 3)[0] == pytest.approx(0.7826086956521738)
    assert cohen_kappa(0, 10, 10, 0) == (pytest.approx(-1.0), None)


def test_kappa_is_undefined_on_degenerate_tables() -> None:
    kappa, why = cohen_kappa(12, 0, 0, 0)
    assert kappa is None and why is not None and "chance agreement is 1" in why
    assert cohen_kappa(0, 0, 0, 0) == (None, "no episodes")
    block = agreement([(task, True, True) for task in range(5)], resamples=200)
    assert block["kappa"] is None and block["kappa_ci95"] is None and block["raw_agreement"] == 1.0


def test_agreement_table_and_interval_over_tasks() -> None:
    pairs = [(0, True, True)] * 20 + [(1, True, False)] * 5 + [(2, False, True)] * 10 + [(3, False, False)] * 15
    block = agreement(pairs, resamples=500)
    assert block["table"] == {"both": 20, "judge_only": 5, "other_only": 10, "neither": 15}
    assert block["kappa"] == pytest.approx(0.4) and block["raw_agreement"] == pytest.approx(0.7)
    interval = block["kappa_ci95"]
    assert interval["cluster"] == "task" and interval["low"] <= 0.4 <= interval["high"]
    assert agreement(pairs, resamples=500) == block  # seeded


# --------------------------------------------------------------------------- rubric and config


def test_rubric_schema_is_enforced() -> None:
    rubric = load_rubric(RUBRIC)
    assert rubric.version == "shopsimrl-judge-rubric-v1" and len(rubric.sha256) == 64
    good = {"verdict": "partial", "score": 0.5, "failure_categories": ["wrong_options"], "rationale": "x"}
    assert schema_errors(good, rubric.verdict_schema) == []
    bad = {"verdict": "great", "score": 1.5, "failure_categories": ["x", "x"], "extra": 1}
    errors = schema_errors(bad, rubric.verdict_schema)
    assert any("'great' is not one of" in e for e in errors) and any("above the maximum" in e for e in errors)
    assert any("'rationale' is missing" in e for e in errors) and any("unexpected property 'extra'" in e for e in errors)
    assert any("$.failure_categories[0]" in e for e in errors) and any("not unique" in e for e in errors)
    assert schema_errors(
        {"verdict": "success", "score": True, "failure_categories": [], "rationale": ""}, rubric.verdict_schema
    ) == ["$.score: expected number, got bool"]


def test_length_bounds_can_be_left_out_of_the_tool_and_are_still_checked(tmp_path: Path) -> None:
    rubric = load_rubric(RUBRIC)
    sent = rubric.tool(length_bounds=False)["function"]["parameters"]
    assert b"maxLength" in orjson.dumps(rubric.tool()) and b"maxLength" not in orjson.dumps(sent)
    assert sent["properties"]["verdict"] == rubric.verdict_schema["properties"]["verdict"]
    too_long = {"verdict": "success", "score": 1.0, "failure_categories": [], "rationale": "x" * 2001}
    assert any(error.startswith("$.rationale") for error in schema_errors(too_long, rubric.verdict_schema))
    # The default is frozen as before the setting existed (earlier plans keep their fingerprint).
    path = _config(tmp_path, str(tmp_path / "run"), "http://127.0.0.1:9/v1")
    assert "send_length_bounds" not in load_judge_config(path).frozen()["model"]
    off = tmp_path / "off.yaml"
    off.write_text(path.read_text().replace("  timeout: 30\n", "  timeout: 30\n  send_length_bounds: false\n"))
    assert load_judge_config(off).frozen()["model"]["send_length_bounds"] is False


def test_rubric_with_unsupported_keywords_is_refused() -> None:
    text = RUBRIC.read_text(encoding="utf-8").replace("uniqueItems: true", "pattern: '^a'")
    with pytest.raises(JudgeConfigError, match="unsupported JSON Schema keyword"):
        rubric_from_bytes(text.encode("utf-8"), "edited.yaml")


@pytest.mark.parametrize("name", ["judge_testbed.yaml", "judge_smoke_llm.yaml", "judge_demo/judge.yaml"])
def test_shipped_judge_configs_load(name: str) -> None:
    config = load_judge_config(REPO / "configs" / name)
    assert load_rubric(config.resolve(config.rubric)).sha256 == load_rubric(RUBRIC).sha256
    assert config.output is not None and not config.resolve(config.output).startswith(config.source_location + "/")


def test_config_errors_name_the_file_and_key(tmp_path: Path) -> None:
    path = _config(tmp_path, "/nowhere", "http://127.0.0.1:1/v1")
    text = path.read_text(encoding="utf-8")
    path.write_text(text.replace("max_repairs: 2", "max_repairs: 2\nmax_repair: 3"), encoding="utf-8")
    with pytest.raises(JudgeConfigError, match=r"judge.yaml: max_repair: unknown key"):
        load_judge_config(path)
    path.write_text(text.replace("select: all", "select: best"), encoding="utf-8")
    with pytest.raises(JudgeConfigError, match=r"selection.select: .*must be one of"):
        load_judge_config(path)
    path.write_text(text.replace("http://127.0.0.1:1/v1", "http://user:pw@127.0.0.1:1/v1"), encoding="utf-8")
    result = cli("judge", str(path), env=_env())
    assert result.returncode == 2 and "model.base_url" in result.stderr and "pw" not in result.stderr


def test_output_inside_the_run_is_refused(tmp_path: Path, research_runs: ResearchRuns, testbed: LocalTestbed) -> None:
    path = _config(tmp_path, str(research_runs.local), testbed.model_url, output=research_runs.local / "judge")
    result = cli("judge", str(path), env=_env())
    assert result.returncode == 2 and "inside the run" in result.stderr
    assert not (research_runs.local / "judge").exists()


# --------------------------------------------------------------------------- the testbed judge


def test_testbed_judge_is_deterministic_and_faults_by_episode() -> None:
    item = {
        "episode_id": "task-000001__sample-000",
        "task_instruction": "找一双皮鞋",
        "goal": {"category": "鞋›皮鞋", "attributes": ["手工缝制", "款式：系带"], "goal_options": ["棕色"], "price_upper": 500.0},
        "transcript": [{"action": "click[1]", "observation": ""}, {"action": "click[buy now]", "observation": "手工缝制 系带"}],
        "outcome": {
            "completed": True,
            "purchase": {"asin": "1", "name": "皮鞋", "category": "鞋›皮鞋", "price": 600.0, "options": {"颜色": "棕色"}},
        },
    }
    verdict = verdict_of(item)
    assert verdict["verdict"] == "partial" and verdict["failure_categories"] == ["over_budget"]
    assert verdict_of({**item, "outcome": {"completed": False}})["failure_categories"] == ["no_purchase"]
    messages = [{"role": "system", "content": "x"}, {"role": "user", "content": orjson.dumps(item).decode()}]
    assert judge_reply(messages, 0.0) == judge_reply(messages, 0.0)
    kinds = {}
    for number in range(200):
        data = {**item, "episode_id": f"task-{number:06d}__sample-000"}
        first = judge_reply([messages[0], {"role": "user", "content": orjson.dumps(data).decode()}], 0.5)
        repaired = judge_reply([messages[0], {"role": "user", "content": orjson.dumps(data).decode()}, {}, {}], 0.5)
        kinds[number] = (first[1] is None, first[1] is not None and not first[1].endswith("}"), repaired[1] is None)
    assert any(no_call and still for no_call, _, still in kinds.values())  # never calls: unparseable
    assert any(bad and not still for _, bad, still in kinds.values())  # bad JSON, then repaired
    assert sum(not any(kind) for kind in kinds.values()) > 50


# --------------------------------------------------------------------------- end to end


def test_judge_end_to_end_on_the_testbed(tmp_path: Path, research_runs: ResearchRuns, testbed: LocalTestbed) -> None:
    path = _config(tmp_path, str(research_runs.local), testbed.model_url)
    result = cli("judge", str(path), env=_env({"SHOPSIMRL_LOG_FORMAT": "json"}))
    assert result.returncode == 0, result.stderr[-3000:]
    out = tmp_path / "judge-out"
    records = _lines(out / "judge_outputs.jsonl")
    assert len(records) == research_runs.episodes == len({r["episode_id"] for r in records})
    rubric = load_rubric(RUBRIC)
    for record in records:
        assert record["judge_output_version"] == "shopsimrl-judge-output-v1" and record["status"] == "ok"
        assert record["rubric_sha256"] == rubric.sha256 and record["rubric_version"] == rubric.version
        assert record["judge_model"] == {"model": "shopsim-judge", "base_url": testbed.model_url, "checkpoint_id": None}
        assert record["verdict"]["verdict"] in ("success", "partial", "failure") and record["attempts"][0]["raw"]["tool_calls"]
        assert record["usage"]["total_tokens"] > 0
    summary = orjson.loads((out / "judge_summary.json").read_bytes())
    manifest = orjson.loads((out / "judge_manifest.json").read_bytes())
    assert summary["judge_summary_version"] == "shopsimrl-judge-summary-v1"
    assert summary["rubric"]["rubric_sha256"] == manifest["rubric"]["rubric_sha256"] == rubric.sha256
    assert summary["status"] == {"ok": research_runs.episodes, "unparseable": 0, "error": 0}
    reward = summary["agreement"]["reward"]
    assert reward["episodes"] == research_runs.episodes and reward["kappa"] is not None and reward["kappa"] > 0.8
    assert set(summary["agreement"]["labels"]) >= {"clean", "wrong_product~wrong_product", "over_budget~budget_violation"}
    assert "judge outputs:" in result.stdout and "kappa" in result.stdout

    again = cli("judge", str(path), env=_env())  # nothing left to judge: the same file
    assert again.returncode == 0 and _verdicts(_lines(out / "judge_outputs.jsonl")) == _verdicts(records)

    other = path.read_text(encoding="utf-8").replace("max_repairs: 2", "max_repairs: 1")
    path.write_text(other, encoding="utf-8")
    refused = cli("judge", str(path), env=_env())
    assert refused.returncode == 2 and "another output" in refused.stderr


def test_wait_ready_waits_for_the_judge_model(tmp_path: Path, research_runs: ResearchRuns, testbed: LocalTestbed) -> None:
    served = _config(tmp_path, str(research_runs.local), testbed.model_url)
    ready = cli("judge", "wait-ready", str(served), "--timeout", "0", env=_env())
    assert ready.returncode == 0 and ready.stdout.startswith("ready: 'shopsim-judge' is served"), ready.stderr
    other = tmp_path / "other-model.yaml"
    other.write_text(served.read_text().replace("model: shopsim-judge", "model: no-such-judge"))
    missing = cli("judge", "wait-ready", str(other), "--timeout", "0.3", "--interval", "0.1", env=_env())
    assert missing.returncode == 3
    assert "model_not_listed: 'no-such-judge' is not among the served models" in missing.stderr
    keyed = tmp_path / "keyed.yaml"
    keyed.write_text(served.read_text().replace("  timeout: 30\n", "  timeout: 30\n  api_key_env: SHOPSIMRL_TEST_JUDGE_KEY\n"))
    no_key = cli("judge", "wait-ready", str(keyed), "--timeout", "0", env=_env())
    assert no_key.returncode == 2 and "SHOPSIMRL_TEST_JUDGE_KEY" in no_key.stderr


def test_repairs_and_unparseable_answers_keep_every_raw_output(tmp_path: Path, research_runs: ResearchRuns) -> None:
    with start_testbed(SHOPSIM_POLICY_JUDGE_FAULT_RATE="0.5") as bed:
        path = _config(tmp_path, str(research_runs.local), bed.model_url)
        result = cli("judge", str(path), env=_env())
    assert result.returncode == 0, result.stderr[-3000:]
    records = _lines(tmp_path / "judge-out" / "judge_outputs.jsonl")
    unparseable = [r for r in records if r["status"] == "unparseable"]
    repaired = [r for r in records if r["status"] == "ok" and r["repairs"]]
    assert unparseable and repaired and len(records) == research_runs.episodes
    for record in unparseable:
        assert record["verdict"] is None and len(record["attempts"]) == 3  # 1 + max_repairs
        assert all(a["error"].startswith("no call to submit_verdict") and a["raw"]["content"] for a in record["attempts"])
    for record in repaired:
        first, second = record["attempts"]
        assert "not valid JSON" in first["error"] and first["raw"]["tool_calls"][0]["arguments"]
        assert second["error"] is None and record["verdict"] == orjson.loads(second["raw"]["tool_calls"][0]["arguments"])
        assert record["usage"]["total_tokens"] == first["usage"]["total_tokens"] + second["usage"]["total_tokens"]
    summary = orjson.loads((tmp_path / "judge-out" / "judge_summary.json").read_bytes())
    assert summary["status"]["unparseable"] == len(unparseable) and summary["repaired"] == len(repaired)
    assert summary["agreement"]["reward"]["episodes"] == research_runs.episodes - len(unparseable)


def test_resume_after_kill_9_without_duplicate_verdicts(tmp_path: Path, research_runs: ResearchRuns) -> None:
    with start_testbed(SHOPSIM_POLICY_LATENCY_MS="150") as bed:
        path = _config(tmp_path, str(research_runs.local), bed.model_url, concurrency=2)
        outputs = tmp_path / "judge-out" / "judge_outputs.jsonl"
        process = subprocess.Popen(
            [sys.executable, "-m", "shopsimrl", "judge", str(path)],
            cwd=REPO,
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        deadline = time.monotonic() + 120
        while not (outputs.exists() and len(outputs.read_bytes().splitlines()) >= 4):
            assert process.poll() is None and time.monotonic() < deadline, "the judge ended before it could be killed"
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        before = _lines(outputs)
        assert 4 <= len(before) < research_runs.episodes
        with outputs.open("ab") as handle:  # what a write cut by the kill leaves
            handle.write(b'{"judge_output_version":"shopsimrl-judge-output-v1","episode_id":"task-')
        resumed = cli("judge", str(path), env=_env({"SHOPSIMRL_LOG_FORMAT": "json"}))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "judge_outputs_repaired" in resumed.stderr and '"torn_last_line": true' in resumed.stderr
    records = _lines(outputs)
    ids = [r["episode_id"] for r in records]
    assert len(ids) == len(set(ids)) == research_runs.episodes
    assert all(r["status"] == "ok" for r in records)
    assert _verdicts(records[: len(before)]) == _verdicts(before)  # judged once, kept as written


@pytest.mark.s3
def test_sharded_judge_on_moto_matches_the_local_stage(
    tmp_path: Path, research_runs: ResearchRuns, testbed: LocalTestbed, moto_endpoint: str
) -> None:
    env = _env(research_runs.env)
    bucket = _make_bucket(moto_endpoint, env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])
    uri = f"s3://{bucket}/judge/research"
    path = _config(tmp_path, research_runs.sharded, testbed.model_url)

    local = cli("judge", str(path), env=env)
    assert local.returncode == 0, local.stderr[-3000:]
    local_records = _lines(tmp_path / "judge-out" / "judge_outputs.jsonl")

    planned = cli("judge", "plan", str(path), "--shards", "3", "--out", uri, env=env)
    assert planned.returncode == 0, planned.stderr[-3000:]
    assert cli("judge", "plan", str(path), "--shards", "3", "--out", uri, env=env).returncode == 0  # idempotent
    assert cli("judge", "plan", str(path), "--shards", "2", "--out", uri, env=env).returncode == 2
    early = cli("judge", "reduce", uri, env=env)
    assert early.returncode == 1 and "0 of 3 committed" in early.stdout
    planned_only = cli("judge", "status", uri, env=env)
    assert planned_only.returncode == 0, planned_only.stderr[-3000:]
    assert "0/3 shards committed (0 judged) · summary over 0 shards" in planned_only.stdout
    assert planned_only.stdout.count("not started") == 3
    wrong_command = cli("status", uri, env=env)
    assert wrong_command.returncode == 2 and f"judge status {uri}" in wrong_command.stderr
    for index in range(3):
        worker = cli("judge", "worker", str(path), "--out", uri, env={**env, "JOB_COMPLETION_INDEX": str(index)})
        assert worker.returncode == 0, worker.stderr[-3000:]
    rerun = cli("judge", "worker", str(path), "--out", uri, "--index", "1", env=env)  # a retried index: nothing to redo
    assert rerun.returncode == 0
    reduced = cli("judge", "reduce", uri, env=env)
    assert reduced.returncode == 0, reduced.stderr[-3000:]
    assert "3 of 3 committed" in reduced.stdout
    done = orjson.loads(cli("judge", "status", uri, "--json", env=env).stdout)
    assert done["committed_shards"] == done["summary_over_shards"] == 3
    assert done["judged_in_committed_shards"] == len(local_records) == sum(row["episodes"] for row in done["shards"])

    import s3fs

    fs = s3fs.S3FileSystem(
        key=env["AWS_ACCESS_KEY_ID"], secret=env["AWS_SECRET_ACCESS_KEY"], client_kwargs={"endpoint_url": moto_endpoint}
    )
    sharded_records = [orjson.loads(line) for line in fs.cat_file(f"{bucket}/judge/research/judge_outputs.jsonl").splitlines()]
    assert [r["episode_id"] for r in sharded_records] == sorted(r["episode_id"] for r in local_records)
    assert _verdicts(sharded_records) == _verdicts(local_records)
    summary = orjson.loads(fs.cat_file(f"{bucket}/judge/research/judge_summary.json"))
    local_summary = orjson.loads((tmp_path / "judge-out" / "judge_summary.json").read_bytes())
    assert summary["agreement"] == local_summary["agreement"] and summary["verdicts"] == local_summary["verdicts"]
    for name in ("judge_plan.json", "judge_summary.json", "judge_outputs.jsonl"):
        assert env["AWS_SECRET_ACCESS_KEY"] not in fs.cat_file(f"{bucket}/judge/research/{name}").decode()


def test_sharded_worker_resumes_its_shard_after_kill_9(tmp_path: Path, research_runs: ResearchRuns) -> None:
    """A worker killed mid-shard leaves whole parts; its successor (the Job's retry of the index)
    judges only what they lack, and the reducer keeps one record per episode."""
    out = str(tmp_path / "judge-location")
    with start_testbed(SHOPSIM_POLICY_LATENCY_MS="150") as bed:
        path = _config(tmp_path, str(research_runs.local), bed.model_url, concurrency=1)
        assert cli("judge", "plan", str(path), "--shards", "1", "--out", out, env=_env()).returncode == 0
        shard = tmp_path / "judge-location" / "shards" / "00000"
        process = subprocess.Popen(
            [sys.executable, "-m", "shopsimrl", "judge", "worker", str(path), "--out", out, "--index", "0"],
            cwd=REPO,
            env=_env(),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 120
        while not (shard.exists() and len(list(shard.glob("part-*"))) >= 2):
            assert process.poll() is None and time.monotonic() < deadline, "the worker ended before it could be killed"
            time.sleep(0.02)
        os.kill(process.pid, signal.SIGKILL)
        process.wait(timeout=30)
        assert not list(shard.glob("_SUCCESS*"))
        (killed,) = orjson.loads(cli("judge", "status", out, "--json", env=_env()).stdout)["shards"]
        assert killed["state"] == "started" and killed["parts"] == len(list(shard.glob("part-*"))) >= 2
        resumed = cli("judge", "worker", str(path), "--out", out, "--index", "0", env=_env({"SHOPSIMRL_LOG_FORMAT": "json"}))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (started,) = [
        line
        for line in map(orjson.loads, (raw for raw in resumed.stderr.splitlines() if raw.startswith("{")))
        if line.get("event") == "judge_shard_started"
    ]
    assert 6 <= started["already_judged"] < research_runs.episodes and started["already_judged"] % 3 == 0  # whole parts of 3
    reduced = cli("judge", "reduce", out, env=_env())
    assert reduced.returncode == 0, reduced.stderr[-3000:]
    records = _lines(tmp_path / "judge-location" / "judge_outputs.jsonl")
    assert len(records) == len({r["episode_id"] for r in records}) == research_runs.episodes
    parts = [orjson.loads(line) for part in shard.glob("part-*") for line in _part_lines(part)]
    assert len(parts) == research_runs.episodes  # nothing judged twice


class _HoldingProxy:
    """A real HTTP server in front of the judge model that forwards the first ``answers``
    completions and holds every later one until closed: with concurrency 1, once a held request
    has arrived the worker holds exactly ``answers`` verdicts, none of them written yet."""

    def __init__(self, upstream: str, answers: int) -> None:
        import http.server
        import threading

        import httpx

        self.received = 0
        self.holding = threading.Event()
        self.release = threading.Event()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _forward(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                if self.path.endswith("/chat/completions"):
                    outer.received += 1
                    if outer.received > answers and not outer.release.is_set():
                        outer.holding.set()
                        outer.release.wait(60)
                        self.send_error(503)
                        return
                reply = httpx.request(method, upstream.rstrip("/") + self.path.removeprefix("/v1"), content=body, timeout=30)
                self.send_response(reply.status_code)
                self.send_header("Content-Type", reply.headers.get("content-type", "application/json"))
                self.send_header("Content-Length", str(len(reply.content)))
                self.end_headers()
                self.wfile.write(reply.content)

            def do_GET(self) -> None:
                self._forward("GET")

            def do_POST(self) -> None:
                self._forward("POST")

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.release.set()
        self.server.shutdown()
        self.server.server_close()


def test_sharded_worker_saves_its_verdicts_on_sigterm(tmp_path: Path, research_runs: ResearchRuns, testbed: LocalTestbed) -> None:
    """SIGTERM while a judge call is in flight: the verdicts the worker holds (none flushed yet,
    flush_every is larger) are written as a part, no marker is made, the exit is 3 (retryable),
    and the next worker of the index judges only the rest."""
    out = str(tmp_path / "judge-location")
    shard = tmp_path / "judge-location" / "shards" / "00000"
    held_answers = 5
    proxy = _HoldingProxy(testbed.model_url, held_answers)
    try:
        path = _config(tmp_path, str(research_runs.local), proxy.url, concurrency=1, flush_every=1000)
        assert cli("judge", "plan", str(path), "--shards", "1", "--out", out, env=_env()).returncode == 0
        process = subprocess.Popen(
            [sys.executable, "-m", "shopsimrl", "judge", "worker", str(path), "--out", out, "--index", "0"],
            cwd=REPO,
            env=_env({"SHOPSIMRL_LOG_FORMAT": "json"}),
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        assert proxy.holding.wait(120), "the worker never reached its held call"
        assert not list(shard.glob("part-*"))  # nothing flushed before the signal
        process.send_signal(signal.SIGTERM)
        _, stderr = process.communicate(timeout=60)
        assert process.returncode == 3, stderr.decode()[-3000:]
        events = [orjson.loads(raw) for raw in stderr.splitlines() if raw.startswith(b"{")]
        (interrupted,) = [line for line in events if line.get("event") == "judge_shard_interrupted"]
        assert interrupted["judged"] == held_answers
        assert not list(shard.glob("_SUCCESS*"))
        (part,) = shard.glob("part-*")
        assert len(_part_lines(part)) == held_answers
        proxy.release.set()  # from now on every call is answered
        resumed = cli("judge", "worker", str(path), "--out", out, "--index", "0", env=_env({"SHOPSIMRL_LOG_FORMAT": "json"}))
    finally:
        proxy.close()
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    (started,) = [
        line
        for line in map(orjson.loads, (raw for raw in resumed.stderr.splitlines() if raw.startswith("{")))
        if line.get("event") == "judge_shard_started"
    ]
    assert started["already_judged"] == held_answers
    parts = [orjson.loads(line) for part in shard.glob("part-*") for line in _part_lines(part)]
    assert len(parts) == len({r["episode_id"] for r in parts}) == research_runs.episodes  # nothing judged twice


def _part_lines(path: Path) -> list[bytes]:
    from shopsimrl.storage.sharded import part_lines

    lines, whole = part_lines(path.name, path.read_bytes())
    assert whole
    return [line for line in lines.splitlines() if line.strip()]


class _Gateway:
    """A real HTTP server in front of the judge model, as a misconfigured gateway: it answers the
    next ``html_left`` chat completions with an HTML page and status 200, then forwards."""

    PAGE = b"<!DOCTYPE html><html><head><title>502 Bad Gateway</title></head><body><h1>Bad Gateway</h1></body></html>"

    def __init__(self, upstream: str, html_left: int) -> None:
        import http.server
        import threading

        import httpx

        self.html_left = html_left
        self.html_sent = 0
        self.forwarded = 0
        lock = threading.Lock()
        outer = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                with lock:
                    page = outer.html_left > 0
                    if page:
                        outer.html_left -= 1
                        outer.html_sent += 1
                    else:
                        outer.forwarded += 1
                if page:
                    status, content, kind = 200, _Gateway.PAGE, "text/html"
                else:
                    reply = httpx.post(upstream.rstrip("/") + self.path.removeprefix("/v1"), content=body, timeout=30)
                    status, content, kind = reply.status_code, reply.content, reply.headers.get("content-type", "")
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(content)))
                self.end_headers()
                self.wfile.write(content)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_an_html_page_with_status_200_is_never_a_verdict(
    tmp_path: Path, research_runs: ResearchRuns, testbed: LocalTestbed
) -> None:
    """A gateway answering HTML with 200: every call is made again (the model's max_retries
    attempts); when every attempt gets the page the episode is `error`, not `unparseable`, the
    run exits 1, and the next run judges it. A page now and then costs nothing but a retry."""
    episodes = research_runs.episodes
    gateway = _Gateway(testbed.model_url, html_left=10**9)
    try:
        path = _config(tmp_path, str(research_runs.local), gateway.url)
        broken = cli("judge", str(path), env=_env())
        assert broken.returncode == 1, broken.stderr[-3000:]
        out = tmp_path / "judge-out"
        records = _lines(out / "judge_outputs.jsonl")
        assert len(records) == episodes and {r["status"] for r in records} == {"error"}
        for record in records:
            assert record["verdict"] is None and record["attempts"] == []
            assert "not the chat-completions API's JSON" in record["error"]["message"]
            assert "502 Bad Gateway" in record["error"]["message"]
        assert gateway.html_sent == episodes * 5 and gateway.forwarded == 0  # max_retries attempts per episode
        summary = orjson.loads((out / "judge_summary.json").read_bytes())
        assert summary["status"] == {"ok": 0, "unparseable": 0, "error": episodes}

        gateway.html_left = 7  # the gateway mends, but still answers a page now and then
        mended = cli("judge", str(path), env=_env())
    finally:
        gateway.close()
    assert mended.returncode == 0, mended.stderr[-3000:]
    records = _lines(out / "judge_outputs.jsonl")
    assert len(records) == episodes and {r["status"] for r in records} == {"ok"}
    assert all(len(r["attempts"]) == 1 + r["repairs"] for r in records)  # the pages were no repair turns
    assert gateway.html_sent == episodes * 5 + 7 and gateway.forwarded >= episodes


def test_unparseable_records_of_html_pages_are_judged_again(tmp_path: Path) -> None:
    """Outputs written before such replies were retried hold `unparseable` records whose
    attempts were gateway pages: a resumed stage drops them and judges the episodes again."""
    from shopsimrl.research.judge.call import judged
    from shopsimrl.research.judge.local import read_outputs

    rubric = load_rubric(RUBRIC)
    page = {"code": "invalid_json_response", "message": "the response body is not JSON"}
    base = {"judge_output_version": "shopsimrl-judge-output-v1", "rubric_sha256": rubric.sha256, "verdict": None}
    tainted = {**base, "episode_id": "e1", "status": "unparseable", "attempts": [{"raw": {"protocol_error": page}}] * 3}
    answered = {**base, "episode_id": "e2", "status": "unparseable", "attempts": [{"raw": {"protocol_error": None}}] * 3}
    ok = {**base, "episode_id": "e3", "status": "ok", "attempts": [{"raw": {"protocol_error": None}}]}
    path = tmp_path / "judge_outputs.jsonl"
    path.write_bytes(b"".join(orjson.dumps(record) + b"\n" for record in (tainted, answered, ok)))
    found = read_outputs(path, rubric.sha256)
    assert sorted(found.done) == ["e2", "e3"] and [record["episode_id"] for record in found.errors] == ["e1"]
    assert not judged(tainted) and judged(answered) and judged(ok) and not judged({**base, "status": "error"})


def test_rubric_and_url_errors_name_the_right_problem_in_one_line(tmp_path: Path) -> None:
    rubric = tmp_path / "rubric.yaml"
    rubric.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR")
    with pytest.raises(JudgeConfigError) as caught:
        load_rubric(rubric)
    assert str(caught.value) == f"rubric {rubric} is not UTF-8 text (byte 0x89 at offset 0); it must be a YAML file"
    rubric.write_text("rubric_version: v1\ninstructions: [unclosed\n  verdict_schema: {}\n", encoding="utf-8")
    with pytest.raises(JudgeConfigError) as caught:
        load_rubric(rubric)
    assert str(caught.value) == f"rubric {rubric} is not valid YAML at line 3, column 17: expected ',' or ']', but got ':'"

    path = _config(tmp_path, "/nowhere", "http://user:secret-pw@127.0.0.1:1/v1")
    refused = cli("judge", str(path), env=_env())
    assert refused.returncode == 2 and refused.stderr.count("\n") == 1, refused.stderr
    assert "model.base_url" in refused.stderr and "model.api_key_env of the judge config" in refused.stderr
    assert "ShopSimulator" not in refused.stderr and "secret-pw" not in refused.stderr
    path = _config(tmp_path, "/nowhere", "http://127.0.0.1:1/v1")
    overridden = cli("judge", str(path), env=_env({"SHOPSIMRL_JUDGE_BASE_URL": "http://user:secret-pw@127.0.0.1:1/v1"}))
    assert overridden.returncode == 2 and overridden.stderr.startswith("error: SHOPSIMRL_JUDGE_BASE_URL"), overridden.stderr
    assert "model.api_key_env" in overridden.stderr and "secret-pw" not in overridden.stderr
