"""Issue 10 on the real testbed processes: context overflow is scored, repeats are clustered,
and summary.json names its run (`shopsimrl run` and `summarize` as users run them)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from shopsimrl import __version__
from shopsimrl.records import read_trace
from shopsimrl.schemas import MANIFEST_SCHEMA_VERSION, SUMMARY_SCHEMA_VERSION, TRACE_SCHEMA_VERSION
from tests.testbed_process import ROOT, start_testbed, write_config

pytestmark = pytest.mark.slow

# The policy counts two characters a token; on the val split a conversation grows from about
# 650 to 2,600–3,600 tokens over its steps. With a window of 3,600 and the default max_tokens
# of 512, episodes with four or more steps outgrow it at their fourth model call.
WINDOW = "3600"


def run(config: Path, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shopsimrl", "run", str(config), "--no-progress", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=ROOT,
        timeout=240,
    )


def records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "traces.jsonl").read_text(encoding="utf-8").splitlines() if line]


def with_repeats(config: Path, sample_size: int, repeats: int) -> Path:
    text = config.read_text(encoding="utf-8")
    config.write_text(text.replace(f"sample_size: {sample_size}}}", f"sample_size: {sample_size}, repeats: {repeats}}}"))
    return config


def test_context_overflow_on_the_testbed_is_a_scored_zero(tmp_path: Path) -> None:
    with start_testbed(SHOPSIM_POLICY_MAX_MODEL_LEN=WINDOW) as bed:
        result = run(write_config(tmp_path, name="overflow", sample_size=8), bed.env())
        assert result.returncode == 0, result.stderr[-3000:]  # every episode completed: nothing failed
        health = bed.healthz()
        assert health["free_slots"] == health["environment_slots"]
    run_dir = tmp_path / "runs/overflow"
    traces = records(run_dir)
    overflowed = [r for r in traces if any((s.get("policy_failure") or {}).get("code") == "context_length" for s in r["steps"])]
    assert 0 < len(overflowed) < len(traces)
    for record in overflowed:
        assert read_trace(record).completed and record["failure_class"] is None
        assert record["final"]["reward"] == 0.0 and record["final"]["termination_reason"] == "generation_length"
        last = record["steps"][-1]
        assert last["policy_failure"]["code"] == "context_length" and last["environment"] is None
        assert "This model's maximum context length is 3600 tokens" in last["policy_failure"]["message"]
        assert last["model"]["attempts"][-1]["status"] == 400
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    assert summary["counts"]["completed"] == summary["counts"]["scored"] == 8 and summary["counts"]["failed"] == 0
    assert summary["behavior"]["policy_failure_codes"] == {"context_length": len(overflowed)}
    assert summary["behavior"]["termination_reasons"]["generation_length"] == len(overflowed)
    rewards = [r["final"]["reward"] for r in traces]
    assert summary["primary"]["reward_mean"] == pytest.approx(sum(rewards) / 8)  # the zeros are in the mean
    assert summary["intent_to_treat"]["episodes"] == 8
    assert summary["primary"]["reward_mean_itt"] == pytest.approx(summary["primary"]["reward_mean"])


def test_repeats_on_the_testbed_do_not_shrink_the_interval(tmp_path: Path) -> None:
    """Issue 10: the deterministic policy with repeats 3 gave an SE √3 smaller than repeats 1."""
    with start_testbed() as bed:
        once = run(write_config(tmp_path, name="once", sample_size=10), bed.env())
        thrice = run(with_repeats(write_config(tmp_path, name="thrice", sample_size=10), 10, 3), bed.env())
    assert once.returncode == 0 and thrice.returncode == 0, (once.stderr[-2000:], thrice.stderr[-2000:])
    one = json.loads((tmp_path / "runs/once/summary.json").read_text(encoding="utf-8"))
    three = json.loads((tmp_path / "runs/thrice/summary.json").read_text(encoding="utf-8"))
    assert three["counts"]["completed"] == 30 and three["per_task"]["episodes_per_task"] == {"min": 3, "max": 3}
    per_task = {}
    for record in records(tmp_path / "runs/thrice"):  # the policy is deterministic at temperature 0
        per_task.setdefault(record["job"]["task_id"], set()).add(record["final"]["reward"])
    assert all(len(rewards) == 1 for rewards in per_task.values())
    assert len({next(iter(r)) for r in per_task.values()}) > 1  # the tasks themselves differ
    for key in ("reward_mean", "reward_sem", "reward_ci95", "success_rate", "success_sem", "success_ci95"):
        assert three["primary"][key] == pytest.approx(one["primary"][key], rel=1e-9), key
    assert three["intervals"]["clusters"] == one["intervals"]["clusters"] == 10
    low, high = three["primary"]["reward_ci95"]
    assert 0.0 <= low < high <= 1.0
    # Deterministic repeats agree, so pass^k equals pass@1 and pass@k for every k.
    assert set(three["per_task"]["pass_hat_k"]) == {"1", "2", "3"}
    assert len(set(three["per_task"]["pass_hat_k"].values()) | set(three["per_task"]["pass_at_k"].values())) == 1
    assert one["per_task"]["pass_hat_k"] is None


def test_summary_json_names_its_run_and_summarize_of_legacy_traces_says_what_it_cannot_know(tmp_path: Path) -> None:
    with start_testbed() as bed:
        config = write_config(tmp_path, name="named", sample_size=2, extra_model="  checkpoint_id: ckpt-0042")
        result = run(config, bed.env())
        assert result.returncode == 0, result.stderr[-3000:]
    run_dir = tmp_path / "runs/named"
    manifest = json.loads((run_dir / "manifest.json").read_text(encoding="utf-8"))
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    split = manifest["plan"]["task_split"]
    assert summary["run"] == {
        "uri": str(run_dir.resolve()),
        "experiment": "named",
        "model_id": "shopsim-heuristic",
        "model_name": "shopsim-heuristic",
        "checkpoint_id": "ckpt-0042",
        "plan_fingerprint": manifest["plan_fingerprint"],
        "split": {"name": "val", "task_count": split["task_count"], "task_ids_sha256": split["task_ids_sha256"]},
        "versions": {
            "shopsimrl": __version__,
            "pipeline": manifest["plan"]["pipeline_version"],
            "fingerprint": manifest["fingerprint_version"],
            "manifest_schema": MANIFEST_SCHEMA_VERSION,
            "trace_schema": TRACE_SCHEMA_VERSION,
            "summary_schema": SUMMARY_SCHEMA_VERSION,
        },
    }
    assert "named · model shopsim-heuristic (shopsim-heuristic, checkpoint ckpt-0042) · split val" in result.stdout

    resummarized = subprocess.run(
        [sys.executable, "-m", "shopsimrl", "summarize", str(run_dir)], capture_output=True, text=True, cwd=ROOT, timeout=60
    )
    assert resummarized.returncode == 0, resummarized.stderr
    assert json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))["run"] == summary["run"]

    legacy = tmp_path / "legacy"
    legacy.mkdir()
    shutil.copy(ROOT / "tests/fixtures/legacy_v4_traces.jsonl", legacy / "traces.jsonl")
    old = subprocess.run(
        [sys.executable, "-m", "shopsimrl", "summarize", str(legacy), "--requested", "6"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
    )
    assert old.returncode == 0, old.stderr
    identity = json.loads((legacy / "summary.json").read_text(encoding="utf-8"))["run"]
    assert identity["uri"] == str(legacy.resolve())
    for key in ("experiment", "model_id", "model_name", "checkpoint_id", "plan_fingerprint"):
        assert identity[key] is None, key
    assert identity["split"] == {"name": None, "task_count": None, "task_ids_sha256": None}
    assert identity["versions"]["manifest_schema"] is None and identity["versions"]["pipeline"] is None
    assert identity["versions"]["shopsimrl"] == __version__


def test_an_agent_action_the_server_fails_on_is_an_environment_error_counted_in_itt(tmp_path: Path) -> None:
    """An agent whose own action makes ShopSimulator answer 500 (here the `<a>` search prefix the
    real server crashes on) fails the episode as `environment_error`: not retried, left out of
    `reward_mean`, a 0 in the intent-to-treat score, and its lease is released."""
    from shopsimrl.testbed.serving import running_server
    from tests.openai_stub import OpenAIStub, Reply, completion, tool_call

    stub = OpenAIStub()
    stub.served_models = ["shopsim-heuristic"]
    stub.queue(Reply(json=completion(tool_calls=[tool_call("search", '{"query": "<a> 红色"}')])))
    with start_testbed() as bed, running_server(stub) as model_url:
        env = {**bed.env(), "SHOPSIMRL_MODEL_BASE_URL": model_url + "/v1"}
        result = run(write_config(tmp_path, name="agent500", sample_size=1), env)
        health = bed.healthz()
    assert result.returncode == 1, result.stderr[-3000:]  # some episodes failed
    assert health["free_slots"] == health["environment_slots"]
    assert len(stub.completions) == 1  # no second attempt of the episode
    (record,) = records(tmp_path / "runs/agent500")
    assert record["status"] == "failed" and record["failure_class"] == "environment_error"
    assert "500" in json.dumps(record["error"], ensure_ascii=False)
    summary = json.loads((tmp_path / "runs/agent500/summary.json").read_text(encoding="utf-8"))
    assert summary["counts"]["failed"] == 1 and summary["counts"]["scored"] == 0
    assert summary["primary"]["reward_mean"] is None
    assert summary["intent_to_treat"]["episodes"] == 1 and summary["primary"]["reward_mean_itt"] == 0.0


FAULTY = {
    # 3 % of resets, actions and terminations answer 500 "state unchanged" (infrastructure) ...
    "SHOPSIM_FAULT_RATE_5XX": "0.03",
    "SHOPSIM_SEED": "11",
    # ... and the agent sometimes searches with the `<a>` prefix the real server fails on (its outcome).
    "SHOPSIM_POLICY_RATE_SERVER_CRASH": "0.1",
}


def faulty_config(directory: Path, name: str) -> Path:
    """40 val episodes; no in-place retry of the shop's faults, so each one fails its episode as
    infrastructure and the scheduler runs it again (with a budget no episode exhausts)."""
    config = write_config(directory, name=name, sample_size=40)
    text = config.read_text(encoding="utf-8")
    text = text.replace(
        "environment: {base_url: http://127.0.0.1:1}", "environment: {base_url: http://127.0.0.1:1, max_retries: 1}"
    )
    text = text.replace("max_episode_retries: 2", "max_episode_retries: 25")
    config.write_text(text, encoding="utf-8")
    return config


def outcomes(run_dir: Path) -> dict[str, object]:
    """Per planned episode, what the summary scores: the reward, or the failure's class."""
    scored: dict[str, object] = {}
    for record in records(run_dir):
        if read_trace(record).completed:
            scored[record["episode_id"]] = record["final"]["reward"]
        elif record["failure_class"] != "infrastructure":
            scored.setdefault(record["episode_id"], record["failure_class"])
    return scored


def test_the_score_of_a_faulty_plan_does_not_depend_on_how_often_run_was_invoked(tmp_path: Path) -> None:
    """One invocation, an interrupted and resumed one, and a run followed by a rerun of one faulty
    plan score the same episodes the same way: the shop's faults are retried (never the agent's
    zeros), the agent's failures are final once recorded, and the score is the fault-free one."""
    import signal
    import time

    with start_testbed(**FAULTY) as faulty:
        once = run(faulty_config(tmp_path, "once"), faulty.env())
        assert once.returncode == 1, once.stderr[-3000:]  # the agent's own failures

        twice = faulty_config(tmp_path, "twice")
        first, second = run(twice, faulty.env()), run(twice, faulty.env())
        assert first.returncode == second.returncode == 1
        assert "0 to run" in second.stderr  # the agent's failures are final: nothing runs again

        resumed = faulty_config(tmp_path, "resumed")
        process = subprocess.Popen(
            [sys.executable, "-m", "shopsimrl", "run", str(resumed), "--no-progress"],
            env=faulty.env(),
            cwd=ROOT,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        traces = tmp_path / "runs/resumed/traces.jsonl"
        deadline = time.monotonic() + 120
        while not (traces.exists() and traces.read_bytes().count(b"\n") >= 10) and time.monotonic() < deadline:
            time.sleep(0.02)
        process.send_signal(signal.SIGINT)
        _, stderr = process.communicate(timeout=120)
        assert process.returncode == 3, stderr[-3000:]  # interrupted mid-plan, safe to retry
        interrupted_at = len(records(tmp_path / "runs/resumed"))
        assert 10 <= interrupted_at < 40 + 10  # some attempts were saved, the plan was not done
        assert run(resumed, faulty.env()).returncode == 1
        health = faulty.healthz()
        assert health["free_slots"] == health["environment_slots"]

    with start_testbed(SHOPSIM_POLICY_RATE_SERVER_CRASH=FAULTY["SHOPSIM_POLICY_RATE_SERVER_CRASH"]) as clean:
        fault_free = run(faulty_config(tmp_path, "clean"), clean.env())
        assert fault_free.returncode == 1

    reference = outcomes(tmp_path / "runs/clean")
    assert len(reference) == 40  # every planned episode has an outcome
    failed = [eid for eid, outcome in reference.items() if outcome == "environment_error"]
    assert 0 < len(failed) < 40
    summaries = {}
    for name in ("once", "twice", "resumed", "clean"):
        assert outcomes(tmp_path / f"runs/{name}") == reference, name
        summaries[name] = json.loads((tmp_path / f"runs/{name}/summary.json").read_text(encoding="utf-8"))
    infrastructure = [r for r in records(tmp_path / "runs/once") if r["failure_class"] == "infrastructure"]
    assert infrastructure  # the shop's faults did happen, and were run again
    assert all("without changing state" in r["error"]["message"] for r in infrastructure)
    for name, summary in summaries.items():
        itt = summary["intent_to_treat"]
        assert itt["episodes"] == 40 and itt["failed_counted_as_zero"] == len(failed), name
        assert itt["failed_infrastructure_excluded"] == 0 and itt["rerolled"] == 0, name
        assert itt["reward_mean"] == pytest.approx(summaries["clean"]["intent_to_treat"]["reward_mean"], abs=1e-12), name
        assert summary["failure_classes"] == {"environment_error": len(failed)}, name
