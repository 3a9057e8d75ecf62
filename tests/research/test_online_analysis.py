"""Online failure analysis (shopsimrl/research/skills/online.py): a training round's triage files
and diagnostic retries, failure cards (fixture records in the documented format, or from the
failure analyst's seam), the online consolidation against the real HTTP model stub and the
testbed's analyst, the pool read back by the online gate's own reader, and ``skills watch``
stopped by SIGTERM and by its stop file in real subprocesses."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import orjson
import pytest
from typer.testing import CliRunner

from shopsimrl.cli import app
from shopsimrl.records.io import dump_line, read_trace
from shopsimrl.research.gate.drafts import load_candidate_pool
from shopsimrl.research.skills import online
from shopsimrl.research.skills.analyst import SkillInputError
from shopsimrl.research.skills.cards import ONLINE_CANDIDATES_TOOL, OnlineCandidate, OnlineCandidates, validate_arguments
from shopsimrl.research.skills.firewall import card_text, firewall_findings
from shopsimrl.schemas import fingerprint, sha256_hex
from shopsimrl.testbed.analyst import online_candidates_of
from shopsimrl.testbed.heuristics_skills import BUY_FIRST, CHOOSE_OPTIONS
from shopsimrl.testbed.policy import PolicySettings, create_app
from shopsimrl.testbed.serving import running_server
from shopsimrl.training.triage import INTERNALIZATION_DEFICIT, NOT_FRONTIER, PENDING_ANALYSIS, TRIAGE_SCHEMA_VERSION
from tests.openai_stub import OpenAIStub, Received, Reply, completion, tool_call
from tests.research.test_skill_builder import failure_card, train_trace
from tests.sharded.conftest import cli
from tests.testbed_process import start_testbed

from .conftest import reaped

REPO = Path(__file__).resolve().parents[2]
SKILLS = [
    {"skill_id": "check-options", "version": "3", "content": f"### 选规格\n- 步骤：先逐项选规格再购买。{CHOOSE_OPTIONS}"},
    {"skill_id": "search-attributes", "version": "1", "content": "### 搜索\n- 步骤：用品类词加属性词搜索。"},
]
UNREACHABLE = "http://127.0.0.1:1/v1"


# --------------------------------------------------------------------------- a training round


def retry_record(task: int, group: int, skills: list[dict[str, Any]] = SKILLS) -> dict[str, Any]:
    """The diagnostic retry of group ``group``: the fixture's failed lamp episode with every chunk."""
    record = train_trace(task, success=False)
    record["episode_id"] = f"task-{task:06d}__sample-{group:03d}"
    record["job"]["sample_id"] = group
    record["selected_skills"] = [{**skill, "metadata": {}} for skill in skills]
    return record


def triage_record(group: int, task: int, classification: str = PENDING_ANALYSIS) -> dict[str, Any]:
    retried = classification in (PENDING_ANALYSIS, INTERNALIZATION_DEFICIT)
    return {
        "schema_version": TRIAGE_SCHEMA_VERSION,
        "run": "train-round",
        "group_index": group,
        "task_id": task,
        "classification": classification,
        "all_wrong": classification != NOT_FRONTIER,
        "group_size": 4,
        "diagnostic": {"episode_id": f"task-{task:06d}__sample-{group:03d}", "run_dir": "training/triage/diagnostics"}
        if retried
        else None,
    }


class Round:
    def __init__(self, tmp_path: Path, url: str = UNREACHABLE, extra: str = "", history: str | None = None) -> None:
        self.base = tmp_path
        self.run = tmp_path / "run"
        self.triage = self.run / "training" / "triage"
        (self.triage / "diagnostics").mkdir(parents=True)
        self.bank = tmp_path / "bank.json"
        self.write_bank(SKILLS)
        self.out = tmp_path / "out"
        history_line = f"  proposal_ledger_history_path: {history}\n" if history else ""
        self.config_path = tmp_path / "online.yaml"
        self.config_path.write_text(
            "online_analysis:\n  name: round-1\n  training_round_dir: run/training\n  current_skillbank_path: bank.json\n"
            f"  output_dir: out\n  proposal_checkpoint: ckpt-100\n{history_line}"
            f"analyst_model: {{name: stub-model, base_url: '{url}', api_key_env: null, max_retries: 1, "
            "retry_backoff_seconds: 0}\n" + (extra or "environment: {base_url: 'http://127.0.0.1:1', timeout: 2}\n"),
            encoding="utf-8",
        )

    def write_bank(self, skills: list[dict[str, Any]]) -> None:
        bank = {"schema_version": "shopsimrl-skillbank-v1", "bank_version": "7", "skills": skills}
        self.bank.write_bytes(orjson.dumps(bank))

    @property
    def config(self) -> online.OnlineConfig:
        return online.load_online_config(self.config_path)

    def add(self, group: int, task: int, classification: str = PENDING_ANALYSIS, retry: dict[str, Any] | None = None) -> Path:
        """A triage file, and for a retried group its retry trace (written first, as training does)."""
        if classification in (PENDING_ANALYSIS, INTERNALIZATION_DEFICIT):
            record = retry or retry_record(task, group)
            with (self.triage / "diagnostics" / "traces.jsonl").open("ab") as out:
                out.write(dump_line(read_trace(record)))
        path = self.triage / f"group-{group:09d}.json"
        temporary = path.with_suffix(".tmp")
        temporary.write_bytes(orjson.dumps(triage_record(group, task, classification)))
        temporary.rename(path)
        return path

    def fixture_card(self, group: int, card: Any, analyst: online.FailureAnalyst | None = None) -> None:
        """A failure card record in the documented format, as the failure analyst writes it."""
        config = self.config
        bank = online.load_bank(self.bank)
        retry = online.read_pending(self.triage / f"group-{group:09d}.json", bank, online._TraceCache())
        assert isinstance(retry, online.PendingRetry)
        seam = analyst or online.default_failure_analyst()
        input_fp = online.failure_input_fingerprint(retry.trace, config, bank, seam)
        result = {"card": card, "valid_live_actions": 3, "successful_trials": 1}
        record = asyncio.run(online.analyse_retry(retry, config, bank, online.FailureAnalyst(_const(result), {}), input_fp))
        self.out.mkdir(exist_ok=True)
        with (self.out / online.CARDS_NAME).open("ab") as out:
            out.write(orjson.dumps(record) + b"\n")

    def cards(self) -> list[dict[str, Any]]:
        path = self.out / online.CARDS_NAME
        return [orjson.loads(line) for line in path.read_bytes().splitlines()] if path.exists() else []

    def summary(self) -> dict[str, Any]:
        return dict(orjson.loads((self.out / online.SUMMARY_NAME).read_bytes()))


def _const(result: Mapping[str, Any]) -> Callable[[online.FailureTask], Any]:
    async def analyse(task: online.FailureTask) -> Mapping[str, Any]:
        return result

    return analyse


def scripted(answers: dict[int, Any], calls: list[int] | None = None) -> online.FailureAnalyst:
    """The failure analyst's seam answering per task id: a card, (card, live facts) or an exception."""

    async def analyse(task: online.FailureTask) -> Mapping[str, Any]:
        assert task.stage == "online" and task.active_skill_ids == ["check-options", "search-attributes"]
        if calls is not None:
            calls.append(task.trace.job.task_id)
        answer = answers[task.trace.job.task_id]
        if isinstance(answer, Exception):
            raise answer
        card, facts = answer if isinstance(answer, tuple) else (answer, {"valid_live_actions": 3, "successful_trials": 1})
        return {"card": card, **facts}

    return online.FailureAnalyst(analyse, {"failure_analyst": "scripted-v1"})


def invoke(*args: str) -> Any:
    return CliRunner().invoke(app, ["skills", *args], prog_name="shopsimrl")


# --------------------------------------------------------------------------- the compiler model


def _user(request: Received) -> dict[str, Any]:
    return dict(orjson.loads(request.json["messages"][1]["content"]))


def candidate(operation: str, card_ids: list[str], target: str | None = None, title: str = "Check options") -> dict[str, Any]:
    return {
        "operation": operation,
        "target_chunk_id": target,
        "title": title,
        "workflow_stage": "商品页：选择规格",
        "failure_mechanism": "未选全规格就购买",
        "applicable_when": "商品页有未选的规格",
        "procedure": ["逐项选择任务要求的规格", "全部选中后再购买"],
        "verification": "已选规格与要求一致",
        "common_failure": "用默认取值直接购买",
        "evidence_card_ids": card_ids,
    }


def reply_with(arguments: dict[str, Any]) -> Reply:
    return Reply(json=completion(tool_calls=[tool_call(ONLINE_CANDIDATES_TOOL, orjson.dumps(arguments).decode())]))


def one_per_status(request: Received) -> Reply:
    """An ADD from the PROPOSE_ADD cards, a REWRITE of check-options from the PROPOSE_REWRITE ones."""
    cards = _user(request)["cards"]
    adds = [c["card_id"] for c in cards if c["status"] == "PROPOSE_ADD"]
    rewrites = [c["card_id"] for c in cards if c["status"] == "PROPOSE_REWRITE"]
    out = []
    if adds:
        out.append(candidate("ADD", adds, title="Verify price"))
    if rewrites:
        out.append(candidate("REWRITE", rewrites, target="check-options"))
    return reply_with({"candidates": out, "evidence_only_card_ids": []})


# --------------------------------------------------------------------------- inputs and refusals


def test_a_config_names_its_bad_key_and_exits_2(tmp_path: Path) -> None:
    bad = Round(tmp_path, extra="analysis: {max_failure_steps: 0}\n")
    text = bad.config_path.read_text(encoding="utf-8").replace("  proposal_checkpoint: ckpt-100\n", "  max_candidates: 17\n")
    bad.config_path.write_text(text, encoding="utf-8")
    result = invoke("analyze", str(bad.config_path))
    assert result.exit_code == 2, result.output
    for problem in (
        "online_analysis.proposal_checkpoint: required key is missing",
        "online_analysis.max_candidates: Input should be less than or equal to 16",
        "analysis.max_failure_steps: Input should be greater than or equal to",
    ):
        assert problem in result.output
    assert "Traceback" not in result.output and not bad.out.exists()


def _mutated(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    record = retry_record(5, 1)
    change(record)
    return record


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (lambda r: r["job"].update(split="val"), "job.split is 'val'"),
        (lambda r: r["final"]["reward_detail"].update(r_success=1), "r_success is 1, not 0"),
        (lambda r: r.update(status="failed"), "status is 'failed'"),
        (lambda r: r["selected_skills"][0].update(version="2"), "are not the enabled records of"),
        (lambda r: r["selected_skills"].pop(), "are not the enabled records of"),
        (lambda r: r["selected_skills"][1].update(content="改过的内容"), "same ids, versions and contents"),
    ],
)
def test_a_retry_the_stage_cannot_use_is_refused_naming_the_group_file(
    tmp_path: Path, change: Callable[[dict[str, Any]], None], message: str
) -> None:
    bed = Round(tmp_path)
    bed.add(1, 5, retry=_mutated(change))
    with pytest.raises(online.OnlineAnalysisFailed) as caught:
        online.analyze(bed.config, scripted({}))
    assert isinstance(caught.value.cause, SkillInputError)
    assert "group-000000001.json: diagnostic retry task-000005__sample-001: " in str(caught.value.cause)
    assert message in str(caught.value.cause)
    # The failure still leaves a pool with no candidate, so the gate runs on the current bank.
    summary = bed.summary()
    assert summary["status"] == "failed" and "group-000000001.json" in summary["error"]["message"]
    pool = load_candidate_pool(bed.out / online.POOL_NAME)
    assert pool.columns == ["check-options", "search-attributes"] and pool.pool["candidates"] == []


def test_a_pending_group_whose_retry_trace_is_missing_is_refused(tmp_path: Path) -> None:
    bed = Round(tmp_path)
    path = bed.triage / "group-000000004.json"
    path.write_bytes(orjson.dumps(triage_record(4, 9)))
    result = invoke("analyze", str(bed.config_path))
    assert result.exit_code == 2, result.output
    assert "group-000000004.json: the diagnostic retry task-000009__sample-004 is not in" in result.output
    assert "candidates     failed" in result.output and bed.summary()["status"] == "failed"


# --------------------------------------------------------------------------- cards from the seam


def test_analyst_errors_forced_no_proposals_and_resume_by_fingerprint(tmp_path: Path) -> None:
    bed = Round(tmp_path)
    bed.add(1, 11)
    bed.add(2, 12)
    bed.add(3, 13)
    bed.add(4, 14, NOT_FRONTIER)
    bed.add(5, 15, INTERNALIZATION_DEFICIT)
    calls: list[int] = []
    first = scripted(
        {
            11: RuntimeError("the live session lost its lease"),
            12: failure_card("PROPOSE_REWRITE", target="no-such-chunk"),
            13: (failure_card(), {"valid_live_actions": 2, "successful_trials": 0}),
        },
        calls,
    )
    result = online.analyze(bed.config, first)  # no eligible card: the compiler model is never asked
    assert calls == [11, 12, 13] and result.exit_code == 1
    cards = {card["task_id"]: card for card in bed.cards()}
    assert cards[11]["status"] == "ANALYST_ERROR" and cards[11]["error"]["message"] == "the live session lost its lease"
    assert cards[12]["status"] == "NO_PROPOSAL" and cards[12]["forced_no_proposal_reasons"] == ["invalid_rewrite_target"]
    assert cards[12]["proposed_status"] == "PROPOSE_REWRITE"
    assert cards[13]["forced_no_proposal_reasons"] == ["proposal_without_successful_counterfactual"]
    assert cards[13]["card"]["privileged_audit"]["earliest_divergence"]["step"] == 3
    assert cards[13]["evidence_refs"] == [{"episode_id": "task-000013__sample-003", "step": 3}]
    summary = result.summary
    assert summary["status"] == "complete" and summary["candidates"] == 0
    assert summary["triage"] == {
        "by_classification": {INTERNALIZATION_DEFICIT: 1, NOT_FRONTIER: 1, PENDING_ANALYSIS: 3},
        "pending": 3,
    }
    assert summary["cards"] | {} == {
        "total": 3,
        "eligible": 0,
        "no_proposal": 2,
        "analyst_errors": 1,
        "analysed_now": 2,
        "errors_now": 1,
        "reused": 2 - 2,
        "missing": 0,
    }
    assert summary["forced_no_proposal"] == {"invalid_rewrite_target": 1, "proposal_without_successful_counterfactual": 1}

    # Resume: only the error card is asked again; the others' input fingerprints are unchanged.
    calls.clear()
    second = scripted({11: (failure_card(), {"valid_live_actions": 1, "successful_trials": 0})}, calls)
    again = online.analyze(bed.config, online.FailureAnalyst(second.analyse, first.identity))
    assert calls == [11] and again.exit_code == 0 and again.summary["cards"]["reused"] == 2
    assert len(bed.cards()) == 4  # appended; the latest card of an episode wins

    # A changed limit changes every fingerprint: all three are analysed again.
    calls.clear()
    bed.config_path.write_text(bed.config_path.read_text() + "analysis: {max_failure_steps: 20}\n", encoding="utf-8")
    third = scripted({t: failure_card("NO_PROPOSAL") for t in (11, 12, 13)}, calls)
    online.analyze(bed.config, online.FailureAnalyst(third.analyse, first.identity))
    assert calls == [11, 12, 13]


# --------------------------------------------------------------------------- consolidation


@pytest.mark.slow
def test_fixture_cards_to_a_pool_the_online_gate_reads_then_a_rerun_asks_nothing(
    tmp_path: Path, stub: tuple[OpenAIStub, str]
) -> None:
    server, url = stub
    server.responder = one_per_status
    bed = Round(tmp_path, url)
    for group, task in ((1, 21), (2, 22), (3, 23)):
        bed.add(group, task)
    bed.add(4, 24, NOT_FRONTIER)
    bed.fixture_card(1, failure_card())
    bed.fixture_card(2, failure_card("PROPOSE_REWRITE", target="check-options"))
    bed.fixture_card(3, failure_card("NO_PROPOSAL"))

    result = invoke("analyze", str(bed.config_path))
    assert result.exit_code == 0, result.output
    assert "failure cards  3 (0 now, 3 reused): 2 eligible, 1 NO_PROPOSAL, 0 ANALYST_ERROR" in result.stdout
    (request,) = server.completions
    assert request.json["tool_choice"]["function"]["name"] == ONLINE_CANDIDATES_TOOL
    user = _user(request)
    assert [c["card_id"] for c in user["cards"]] == ["failure-task-000021__sample-001", "failure-task-000022__sample-002"]
    assert user["max_candidates"] == 2 and [s["skill_id"] for s in user["current_skills"]] == [
        "check-options",
        "search-attributes",
    ]
    assert "privileged_audit" not in request.json["messages"][1]["content"] and "10000001" not in str(user)
    tool = request.json["tools"][0]["function"]
    assert tool["parameters"]["properties"]["candidates"]["maxItems"] == 2

    # The online gate's own reader takes the pool as it comes.
    pool = load_candidate_pool(bed.out / online.POOL_NAME)
    rewrite, add = (next(c for c in pool.pool["candidates"] if c["operation"] == op) for op in ("REWRITE", "ADD"))
    for c in (rewrite, add):
        assert (
            c["candidate_id"]
            == "online-"
            + fingerprint({"operation": c["operation"], "target_chunk_id": c["target_chunk_id"], "content": c["content"]})[:16]
        )
    assert [slot.versions for slot in pool.slots] == [
        ("check-options", rewrite["candidate_id"]),
        ("search-attributes",),
        (add["candidate_id"],),
    ]
    assert rewrite["content"].startswith("### Check options\n- 适用情形：商品页有未选的规格\n- 步骤：\n   1. ")
    assert add["metadata"]["evidence_card_ids"] == ["failure-task-000021__sample-001"]
    assert pool.pool["proposal_checkpoint"] == "ckpt-100" and pool.pool["round_id"] == "round-1"
    ledger = pool.history
    assert [row["candidate_id"] for row in ledger] == [c["candidate_id"] for c in pool.pool["candidates"]]
    assert all(row["stage"] == "online" and row["status"] == "proposed" for row in ledger)
    assert ledger[1]["replacement_family_id"] == "check-options" or ledger[0]["replacement_family_id"] == "check-options"
    summary = bed.summary()
    assert summary["status"] == "complete" and summary["pool_sha256"] == pool.sha256
    assert len(summary["compilation_input_sha256"]) == 64

    server.reset()
    again = invoke("analyze", str(bed.config_path))
    assert again.exit_code == 0, again.output
    assert server.completions == [] and "nothing asked" in again.stdout
    assert load_candidate_pool(bed.out / online.POOL_NAME).sha256 == pool.sha256


@pytest.mark.slow
def test_each_contract_error_is_repaired_in_turn(tmp_path: Path, stub: tuple[OpenAIStub, str]) -> None:
    server, url = stub
    bed = Round(tmp_path, url)
    bed.add(1, 31)
    bed.add(2, 32)
    bed.fixture_card(1, failure_card())
    bed.fixture_card(2, failure_card())
    a, b = "failure-task-000031__sample-001", "failure-task-000032__sample-002"
    good = candidate("ADD", [a, b])
    answers = [
        {"candidates": [candidate("ADD", [a]), candidate("ADD", [a, b], title="Other")]},
        {"candidates": [candidate("REWRITE", [a, b], target="gone-chunk")]},
        {"candidates": [candidate("ADD", [a, b], title="光明店 options")]},
        {"candidates": [candidate("ADD", [a]), candidate("ADD", [b])]},
        {"candidates": [good]},
    ]
    server.queue(*(reply_with(answer) for answer in answers))
    result = online.analyze(bed.config)  # every card is a fixture: the failure analyst is not asked
    assert result.summary["status"] == "complete" and result.summary["attempts"] == 5
    repairs = [r.json["messages"][-1]["content"] for r in server.completions[1:]]
    assert "card ids given more than once: " + a in repairs[0]
    assert "$.candidates[0].target_chunk_id: 'gone-chunk' is not an active chunk" in repairs[1]
    assert "$.candidates[0]: the firewall refuses it (copies_instance_brand)" in repairs[2]
    assert "$.candidates[1]: the same candidate as candidates[0]" in repairs[3]
    assert len((bed.out / "online_invalid_attempts.jsonl").read_bytes().splitlines()) == 4


@pytest.mark.slow
def test_a_repeat_of_a_historical_candidate_is_refused_and_the_failure_leaves_an_empty_pool(
    tmp_path: Path, stub: tuple[OpenAIStub, str]
) -> None:
    server, url = stub
    server.responder = one_per_status
    earlier = Round(tmp_path / "earlier", url)
    earlier.add(1, 41)
    earlier.fixture_card(1, failure_card())
    assert online.analyze(earlier.config).summary["candidates"] == 1

    bed = Round(tmp_path / "now", url, history=str(earlier.out / online.LEDGER_NAME))
    bed.add(1, 42)
    bed.fixture_card(1, failure_card())
    server.reset()
    server.responder = one_per_status  # the same ADD again, every attempt
    result = invoke("analyze", str(bed.config_path))
    assert result.exit_code == 1, result.output
    assert "candidates     failed: the online consolidation failed: 5 attempts" in result.stdout
    assert len(server.completions) == 5
    user = _user(server.completions[0])
    assert [h["operation"] for h in user["historical_candidates"]] == ["ADD"]
    assert "repeats a candidate of an earlier round" in server.completions[1].json["messages"][-1]["content"]
    summary = bed.summary()
    assert summary["status"] == "failed" and summary["candidates"] == 0
    pool = load_candidate_pool(bed.out / online.POOL_NAME)
    assert pool.columns == ["check-options", "search-attributes"] and pool.history == []


@pytest.mark.slow
def test_the_testbed_analyst_proposes_one_candidate_per_marker(tmp_path: Path) -> None:
    with running_server(create_app(PolicySettings(model_id="shopsim-heuristic"))) as base:
        bed = Round(tmp_path, base + "/v1")
        text = bed.config_path.read_text().replace("name: stub-model", "name: shopsim-analyst")
        bed.config_path.write_text(text, encoding="utf-8")
        for group, task in ((1, 51), (2, 52), (3, 53)):
            bed.add(group, task)
        bed.fixture_card(1, failure_card(content=f"逐项选规格后再购买。{CHOOSE_OPTIONS}"))
        bed.fixture_card(2, failure_card(content=f"直接买第一个结果。{BUY_FIRST}"))
        bed.fixture_card(3, failure_card(content="没有标记的建议"))
        result = invoke("analyze", str(bed.config_path))
    assert result.exit_code == 0, result.output
    pool = load_candidate_pool(bed.out / online.POOL_NAME)
    by_op = {c["operation"]: c for c in pool.pool["candidates"]}
    assert by_op["REWRITE"]["target_chunk_id"] == "check-options" and CHOOSE_OPTIONS in by_op["REWRITE"]["content"]
    assert BUY_FIRST in by_op["ADD"]["content"]
    assert bed.summary()["evidence_only_card_ids"] == ["failure-task-000053__sample-003"]


def test_the_testbed_answer_keeps_the_contract_and_skips_a_historical_marker() -> None:
    data = {
        "max_candidates": 6,
        "current_skills": SKILLS,
        "historical_candidates": [{"operation": "ADD", "target_chunk_id": None, "content": f"x {BUY_FIRST}"}],
        "cards": [
            {"card_id": "c1", "status": "PROPOSE_ADD", "proposed_content": f"a {CHOOSE_OPTIONS}"},
            {"card_id": "c2", "status": "PROPOSE_ADD", "proposed_content": f"b {BUY_FIRST}"},
        ],
    }
    arguments = online_candidates_of(data)
    value, problem = validate_arguments(OnlineCandidates, arguments, candidates=6)
    assert problem is None and value is not None
    (only,) = value.candidates
    assert (only.operation, only.target_chunk_id, only.evidence_card_ids) == ("REWRITE", "check-options", ["c1"])
    assert arguments["evidence_only_card_ids"] == ["c2"]
    assert firewall_findings(card_text(only)) == []


# --------------------------------------------------------------------------- watch


def test_a_signal_during_an_analysis_records_nothing_for_it_and_tears_nothing(tmp_path: Path) -> None:
    bed = Round(tmp_path)
    bed.add(1, 61)
    bed.add(2, 62)
    entered: list[int] = []

    async def analyse(task: online.FailureTask) -> Mapping[str, Any]:
        entered.append(task.trace.job.task_id)
        if task.trace.job.task_id == 62:
            os.kill(os.getpid(), signal.SIGTERM)  # the signal arrives while this analysis runs
            await asyncio.sleep(60)
        return {"card": failure_card("NO_PROPOSAL"), "valid_live_actions": 1, "successful_trials": 1}

    lines: list[str] = []
    result = online.watch(bed.config, poll_seconds=0.05, analyst=online.FailureAnalyst(analyse, {}), echo=lines.append)
    assert result.stopped_by == "SIGTERM" and result.analysed == 1 and entered == [61, 62]
    assert [card["task_id"] for card in bed.cards()] == [61]
    assert (bed.out / online.CARDS_NAME).read_bytes().endswith(b"\n")


def _watch(bed: Round, *extra: str) -> subprocess.Popen[str]:
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, "-m", "shopsimrl", "skills", "watch", str(bed.config_path), "--poll-seconds", "0.1", *extra]
    return subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _wait_for(condition: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


@pytest.mark.slow
@pytest.mark.parametrize("stop", ["SIGTERM", "SIGINT", "stop file"])
def test_watch_analyses_new_triage_files_and_stops_cleanly(tmp_path: Path, stop: str) -> None:
    bed = Round(tmp_path)
    bed.triage.rename(tmp_path / "not-yet")  # training has triaged nothing when the watch starts
    stop_file = tmp_path / "stop-watch"
    process = _watch(bed, "--stop-file", str(stop_file))
    with reaped(process):
        time.sleep(0.5)
        assert process.poll() is None
        (tmp_path / "not-yet").rename(bed.triage)
        bed.add(1, 71)
        bed.fixture_card(1, failure_card("NO_PROPOSAL"))  # done before: reused, never asked
        bed.add(2, 72)
        bed.add(3, 73, NOT_FRONTIER)
        _wait_for(lambda: any(card["task_id"] == 72 for card in bed.cards()), "the card of group 2")
        bed.add(4, 74)
        _wait_for(lambda: any(card["task_id"] == 74 for card in bed.cards()), "the card of group 4")
        # The drain-and-compile step refuses while the watch still writes there.
        refused = invoke("analyze", str(bed.config_path))
        assert refused.exit_code == 2 and "another skills analyze or skills watch is writing here" in refused.output
        assert not (bed.out / online.POOL_NAME).exists()
        if stop == "stop file":
            stop_file.touch()
        else:
            process.send_signal(getattr(signal, stop))
        out, err = process.communicate(timeout=30)
    assert process.returncode == 0, err[-3000:]
    assert f"watch stopped ({stop})" in out and "analysed group-000000002.json" in out
    assert "analysed group-000000001.json" not in out
    data = (bed.out / online.CARDS_NAME).read_bytes()
    assert data.endswith(b"\n") and [card["task_id"] for card in bed.cards()] == [71, 72, 74]
    # The failure analyst ran for the new ones; its live session's shop is unreachable here.
    assert [card["status"] for card in bed.cards()] == ["NO_PROPOSAL", "ANALYST_ERROR", "ANALYST_ERROR"]
    assert bed.cards()[1]["error"]["type"] == "FailureAnalysisError"
    assert online.read_failure_cards(bed.out / online.CARDS_NAME).keys() == {
        "task-000071__sample-001",
        "task-000072__sample-002",
        "task-000074__sample-004",
    }
    if stop != "SIGTERM":
        return  # the drain after a stop is the same whichever way the watch stopped
    # Then the drain-and-compile step runs: it asks again for the error cards only (no eligible
    # card: no model call) and writes the pool.
    drained = invoke("analyze", str(bed.config_path))
    assert (bed.out / online.POOL_NAME).is_file() and "failure cards  3" in drained.stdout, drained.output


# --------------------------------------------------------------------------- with the failure analyst


@pytest.mark.slow
def test_the_failure_analyst_and_the_testbed_analyst_from_real_retries_to_a_pool(tmp_path: Path) -> None:
    """Real retries (testbed episodes played with the bank), the real failure analyst replaying
    each in a live testbed shop, the testbed analyst consolidating: a pool the gate reads."""
    skill = {"skill_id": "buy-first", "version": "1", "content": f"### 直接购买\n- 步骤：打开第一个结果后直接购买。{BUY_FIRST}"}
    with start_testbed(SHOPSIM_POLICY_OPTIONS_NEED_SKILL="1") as bed:
        bank = tmp_path / "bank.json"
        bank.write_bytes(orjson.dumps({"schema_version": "shopsimrl-skillbank-v1", "bank_version": "1", "skills": [skill]}))
        train = (REPO / "configs" / "skills_demo" / "train.yaml").read_text(encoding="utf-8")
        train = train.replace("../../runs/skills-demo", str(tmp_path / "plays")).replace("sample_size: 60", "sample_size: 16")
        train = train.replace("../splits/", str(REPO / "configs" / "splits") + "/").replace("path: null", f"path: {bank}")
        (tmp_path / "train.yaml").write_text(train, encoding="utf-8")
        played = cli("run", str(tmp_path / "train.yaml"), "--no-progress", "-q", env=bed.env())
        assert played.returncode in (0, 1), played.stderr[-3000:]
        (traces_path,) = (tmp_path / "plays").rglob("traces.jsonl")
        failed = [
            line
            for line in traces_path.read_bytes().splitlines()
            if orjson.loads(line)["final"]["reward_detail"]["r_success"] == 0
        ][:3]
        assert len(failed) >= 2
        environment = f"environment: {{base_url: '{bed.shop_url}', timeout: 30, persona: true}}\n"
        bed_round = Round(tmp_path / "round", bed.model_url, extra=environment)
        bed_round.bank.write_bytes(bank.read_bytes())
        for group, line in enumerate(failed, start=1):
            record = orjson.loads(line)
            bed_round.add(group, int(record["job"]["task_id"]), retry=record)
            path = bed_round.triage / f"group-{group:09d}.json"
            triage = orjson.loads(path.read_bytes())
            triage["diagnostic"]["episode_id"] = record["episode_id"]
            path.write_bytes(orjson.dumps(triage))
        text = bed_round.config_path.read_text().replace("name: stub-model", "name: shopsim-analyst")
        bed_round.config_path.write_text(text, encoding="utf-8")
        result = invoke("analyze", str(bed_round.config_path))
    assert result.exit_code == 0, result.output
    cards = bed_round.cards()
    assert len(cards) == len(failed) and all(card["status"] in ("PROPOSE_ADD", "NO_PROPOSAL") for card in cards)
    assert any(card["eligible"] for card in cards)
    pool = load_candidate_pool(bed_round.out / online.POOL_NAME)
    (added,) = pool.pool["candidates"]
    assert added["operation"] == "ADD" and CHOOSE_OPTIONS in added["content"]
    assert [slot.versions for slot in pool.slots] == [("buy-first",), (added["candidate_id"],)]


def test_a_torn_last_card_is_cut_and_its_retry_analysed_again(tmp_path: Path) -> None:
    bed = Round(tmp_path)
    bed.add(1, 81)
    bed.add(2, 82)
    analyst = scripted({81: failure_card("NO_PROPOSAL"), 82: failure_card("NO_PROPOSAL")})
    online.analyze(bed.config, analyst)
    whole = (bed.out / online.CARDS_NAME).read_bytes()
    first, second = whole.splitlines()
    # A writer killed mid-append leaves part of a line: the first card whole, the second torn.
    (bed.out / online.CARDS_NAME).write_bytes(first + b"\n" + second[: len(second) // 2])
    calls: list[int] = []
    again = online.analyze(bed.config, scripted({82: failure_card("NO_PROPOSAL")}, calls))
    assert calls == [82] and again.summary["cards"]["reused"] == 1
    assert [card["task_id"] for card in bed.cards()] == [81, 82]


def test_a_cold_start_ledger_row_without_content_still_counts_as_history(tmp_path: Path) -> None:
    proposal = OnlineCandidate.model_validate(candidate("ADD", ["c1"]))
    content = online.render_candidate(proposal)
    ledger = tmp_path / "proposal_ledger.jsonl"
    row = {"candidate_id": "check-options", "operation": "ADD", "stage": "cold_start", "content_sha256": sha256_hex(content)}
    ledger.write_bytes(orjson.dumps(row) + b"\n")
    history = online.read_history(ledger)
    bank = online.Bank(tmp_path / "bank.json", "0" * 64, [{**SKILLS[0], "metadata": {}}])
    validate = online._validator(["c1"], 6, bank, history, {}, {})
    assert validate({"candidates": [candidate("ADD", ["c1"])]})[1] == (
        "$.candidates[0]: repeats a candidate of an earlier round (historical_candidates); propose another"
    )
    assert validate({"candidates": [candidate("ADD", ["c1"], title="Another title")]})[1] is None
    with pytest.raises(SkillInputError, match=r"proposal_ledger\.jsonl:2: the proposal ledger line is not JSON"):
        ledger.write_bytes(orjson.dumps(row) + b"\n{torn")
        online.read_history(ledger)
