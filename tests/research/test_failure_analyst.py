"""The failure analyst (``shopsimrl.research.skills.failure``): live counterfactual sessions on the
real testbed shop, the analyst played by the scripted HTTP stub (the contract: the last call
offers only the card, repairs, trials, the forced NO_PROPOSAL rules, the lease back on every
path, resume by fingerprint) and by the testbed's deterministic analyst over a real train run."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

import orjson
import pytest

from shopsimrl.environment import ShopSimulatorSettings
from shopsimrl.model import OpenAICompatibleSettings
from shopsimrl.records import EpisodeTrace
from shopsimrl.records.io import read_trace
from shopsimrl.research.judge.call import JudgeModelError
from shopsimrl.research.skills.analyst import (
    ANALYSES_NAME,
    CARDS_NAME,
    ERRORS_NAME,
    AnalystConfig,
    latest_traces,
    run_success_analysis,
)
from shopsimrl.research.skills.cards import FAILURE_TOOL, SUCCESS_TOOL
from shopsimrl.research.skills.compact import product_ids
from shopsimrl.research.skills.failure import (
    FailureAnalysis,
    FailureConfig,
    analyse_failure,
    failure_fingerprint,
)
from shopsimrl.testbed.heuristics_skills import CHOOSE_OPTIONS
from tests.openai_stub import OpenAIStub, Received, Reply, completion, tool_call
from tests.research.test_skill_builder import numbered, write_traces
from tests.testbed_process import LocalTestbed

from .conftest import all_free, options_train_run, stopped_while_held

REPO = Path(__file__).resolve().parents[2]
FORCED = {"type": "function", "function": {"name": FAILURE_TOOL}}


def settings(url: str, model: str = "stub-model", tool: str = FAILURE_TOOL) -> OpenAICompatibleSettings:
    return OpenAICompatibleSettings(
        model=model, base_url=url, api_key_env=None, max_retries=1, retry_backoff_seconds=0.0, max_tokens=1024,
        tool_choice={"type": "function", "function": {"name": tool}},
    )  # fmt: skip


def config(url: str, shop: str, **limits: Any) -> FailureConfig:
    return FailureConfig(model=settings(url), environment=ShopSimulatorSettings(base_url=shop, persona=True), **limits)


def failed_trace() -> EpisodeTrace:
    """The fixture's failed lamp episode as a train trace of task 4 (the testbed has a task 4)."""
    return read_trace(numbered(4, success=False))


def card(status: str = "PROPOSE_ADD", *, target: str | None = None, content: str = "下单前逐项选中要求的规格") -> dict[str, Any]:
    out: dict[str, Any] = {
        "status": status,
        "privileged_audit": {
            "gold_asins": [],
            "failure_surface": "规格没选对",
            "earliest_divergence": {"step": 2, "description": "没有选规格就购买"},
            "oracle_comparison": "要求的颜色没有选",
            "replay_evidence": [],
            "minimal_repair": "先选规格再买",
            "repair_validation_result": "试验成功",
        },
    }
    if status != "NO_PROPOSAL":
        out["deployable_abstraction"] = {
            "mechanism": "规格决定买到的款式",
            "applicable_when": "商品有可选规格时",
            "trigger": "商品页有未选规格",
            "corrective_procedure": ["逐项选中要求的规格", "再点击购买"],
            "verification": "已选规格与要求一致",
            "target": target,
            "proposed_content": content,
        }
    return out


def call(name: str, arguments: Any, call_id: str = "call-1") -> Reply:
    raw = arguments if isinstance(arguments, str) else orjson.dumps(arguments).decode()
    return Reply(json=completion(tool_calls=[tool_call(name, raw, call_id)]))


def offered(request: Received) -> list[str]:
    return [t["function"]["name"] for t in request.json["tools"]]


def latest_result(request: Received) -> dict[str, Any]:
    """The latest live page the conversation shows: a tool result's, or the fresh session's."""
    messages = request.json["messages"]
    for message in reversed(messages):
        if message["role"] == "tool":
            try:
                result = orjson.loads(message["content"])
            except orjson.JSONDecodeError:
                continue
            if isinstance(result, dict) and "state" in result:
                return result
    return {"state": orjson.loads(messages[1]["content"])["fresh_live_session"]["state"], "done": False}


def first_result_buyer(state: dict[str, Any]) -> tuple[str, dict[str, str]]:
    """A shopper that buys the first listed product with each axis's first value."""
    if state.get("search_available"):
        return "search", {"query": "台灯"}
    if state["page_type"] == "search_results":
        return "click", {"value": state["products"][0]["asin"].casefold()}
    selected = state.get("selected_options") or {}
    for axis, values in (state.get("available_options") or {}).items():
        if axis not in selected and f"{axis}={values[0]}" in state["actions"]:
            return "click", {"value": f"{axis}={values[0]}"}
    return "click", {"value": "buy now"}


def run(coroutine: Any) -> Any:
    return asyncio.run(coroutine)


@pytest.fixture
def shop(testbed: LocalTestbed) -> Iterator[LocalTestbed]:
    testbed.release_all()
    assert all_free(testbed)
    yield testbed


# --------------------------------------------------------------------------- fingerprints (no servers)


def test_the_fingerprint_covers_the_environment_and_limits_but_not_the_urls() -> None:
    trace = failed_trace()
    base = config("http://127.0.0.1:1/v1", "http://127.0.0.1:2")
    fp = failure_fingerprint(trace, base)
    assert (
        failure_fingerprint(trace, replace(base, environment=ShopSimulatorSettings(base_url="http://shop:5700", persona=True)))
        == fp
    )
    assert failure_fingerprint(trace, replace(base, model=settings("http://elsewhere/v1"))) == fp
    assert failure_fingerprint(trace, replace(base, environment=ShopSimulatorSettings(persona=False))) != fp
    assert failure_fingerprint(trace, replace(base, max_failure_steps=6)) != fp
    assert failure_fingerprint(trace, replace(base, max_trials=1)) != fp
    assert failure_fingerprint(trace, base, stage="online", active_skill_ids=["a"]) != fp
    assert failure_fingerprint(trace, replace(base, live_tool_choice="auto")) != fp
    with pytest.raises(ValueError, match="live_tool_choice must be 'required' or 'auto'"):
        replace(base, live_tool_choice="none")
    with pytest.raises(ValueError, match="max_failure_steps must be an integer >= 1"):
        replace(base, max_failure_steps=0)


# --------------------------------------------------------------------------- the contract, scripted


@pytest.mark.slow
def test_repairs_then_the_last_call_offers_only_the_card(shop: LocalTestbed, stub: tuple[OpenAIStub, str]) -> None:
    server, url = stub
    script: list[Callable[[Received], Reply]] = [
        lambda r: Reply(json=completion(content="我先想想", finish_reason="stop")),  # no call: a repair
        lambda r: call("search", {"query": "台灯"}),
        lambda r: Reply(json=completion(tool_calls=[tool_call("click", '{"value": "back to search"}', "a"), tool_call(FAILURE_TOOL, "{}", "b")])),
        lambda r: call(FAILURE_TOOL, {"status": "PROPOSE_ADD"}),  # the last call: invalid, repaired
        lambda r: call(FAILURE_TOOL, card()),
    ]  # fmt: skip
    server.responder = lambda request: script[len(server.completions) - 1](request)
    ok, record = run(analyse_failure(failed_trace(), config(url, shop.shop_url, max_failure_steps=4)))
    assert ok, record
    requests = [r.json for r in server.completions]
    assert [offered(r) for r in server.completions] == [
        ["search", FAILURE_TOOL],
        ["search", FAILURE_TOOL],
        ["click", FAILURE_TOOL],
        [FAILURE_TOOL],
        [FAILURE_TOOL],
    ]
    assert [r["tool_choice"] for r in requests] == ["required"] * 3 + [FORCED, FORCED]
    user = orjson.loads(requests[0]["messages"][1]["content"])
    assert set(user) == {"analysis_contract", "failed_trace_and_privileged_gold", "fresh_live_session"}
    assert user["analysis_contract"] == {"current_skill": None, "stage": "cold_start", "max_live_actions": 3}
    assert user["failed_trace_and_privileged_gold"]["gold"]["attributes"] == ["护眼"]
    assert "chosen_purchase" in user["failed_trace_and_privileged_gold"]
    assert set(user["fresh_live_session"]) == {"trial", "instruction", "persona", "observation", "state"}
    # Each repair answers the unusable reply: a user message after text, tool messages after calls.
    assert requests[1]["messages"][-1]["role"] == "user" and "could not be used" in requests[1]["messages"][-1]["content"]
    assert [m["role"] for m in requests[3]["messages"][-2:]] == ["tool", "tool"]
    assert "got 2" in requests[3]["messages"][-1]["content"]
    assert "$.privileged_audit" in requests[4]["messages"][-1]["content"]
    search = orjson.loads(requests[2]["messages"][-1]["content"])
    assert set(search) == {"trial", "feedback", "done", "observation", "state", "reward", "reward_detail", "purchase"}
    assert search["state"]["page_type"] == "search_results" and search["done"] is False

    (entry,) = record["cards"]
    assert entry["card_id"] == "failure-task-000004__sample-000-01" and entry["channel"] == "failure"
    assert entry["proposed_status"] == "PROPOSE_ADD" and entry["card"]["status"] == "NO_PROPOSAL"
    assert entry["forced_no_proposal_reasons"] == ["proposal_without_successful_counterfactual"]
    assert entry["eligible"] is False and entry["evidence_refs"] == [{"episode_id": "task-000004__sample-000", "step": 2}]
    live = record["live_session"]
    assert live["valid_live_actions"] == 1 and live["successful_trials"] == 0
    assert [a["action"] for a in live["trials"][0]["actions"]] == ["search[台灯]"]
    assert [a["error"] is None for a in record["attempts"]] == [False, True, False, False, True]
    assert all_free(shop)


@pytest.mark.slow
def test_live_calls_send_auto_when_the_server_refuses_required(shop: LocalTestbed, stub: tuple[OpenAIStub, str]) -> None:
    server, url = stub
    server.responder = lambda r: call("search", {"query": "台灯"}) if len(server.completions) == 1 else call(FAILURE_TOOL, card())
    ok, record = run(analyse_failure(failed_trace(), config(url, shop.shop_url, max_failure_steps=2, live_tool_choice="auto")))
    assert ok, record
    assert [r.json["tool_choice"] for r in server.completions] == ["auto", FORCED]  # the card stays forced
    assert [offered(r) for r in server.completions] == [["search", FAILURE_TOOL], [FAILURE_TOOL]]
    assert all_free(shop)


@pytest.mark.slow
def test_a_purchase_ends_the_trial_and_a_fresh_one_starts_until_none_is_left(
    shop: LocalTestbed, stub: tuple[OpenAIStub, str]
) -> None:
    server, url = stub
    bought: list[dict[str, Any]] = []

    def play(request: Received) -> Reply:
        result = latest_result(request)
        if result.get("done"):
            bought.append(result)
        if offered(request) == [FAILURE_TOOL]:
            return call(FAILURE_TOOL, card())
        state = (result.get("next_trial") or {}).get("state") or result["state"]
        name, arguments = first_result_buyer(state)
        return call(name, arguments)

    server.responder = play
    ok, record = run(analyse_failure(failed_trace(), config(url, shop.shop_url, max_trials=2)))
    assert ok, record
    trials = record["live_session"]["trials"]
    assert len(trials) == 2 and all(t["done"] and t["actions"][-1]["action"] == "click[buy now]" for t in trials)
    assert all(isinstance(t["reward"], float) and t["r_success"] in (0, 1) and t["purchase"] for t in trials)
    first, second = bought
    assert first["reward_detail"]["r_success"] in (0, 1) and first["purchase"]
    assert first["next_trial"]["trial"] == 2 and first["next_trial"]["state"]["page_type"] == "search_home"
    assert second["next_trial"] is None  # no trial left: only the card is offered next
    assert offered(server.completions[-1]) == [FAILURE_TOOL]
    assert len(server.completions) < 12
    successes = sum(t["r_success"] for t in trials)
    (entry,) = record["cards"]
    assert entry["card"]["status"] == ("PROPOSE_ADD" if successes else "NO_PROPOSAL")
    assert all_free(shop)


@pytest.mark.slow
def test_the_forced_no_proposal_rules_are_wired(shop: LocalTestbed, stub: tuple[OpenAIStub, str]) -> None:
    server, url = stub
    trace = failed_trace()
    known_id = sorted(product_ids(trace))[0]
    cases = [
        ("cold_start", (), card(), []),
        ("cold_start", (), card("PROPOSE_REWRITE", target="x"), ["rewrite_at_cold_start"]),
        ("online", ("a",), card("PROPOSE_REWRITE", target="x"), ["invalid_rewrite_target"]),
        ("online", ("x",), card("PROPOSE_REWRITE", target="x"), []),
        ("cold_start", (), card(content=f"买 {known_id} 这一款"), ["firewall_finding"]),
        ("cold_start", (), None, ["firewall_finding"]),  # a title only the live results page showed
    ]
    for stage, active, submitted, expected in cases:
        server.reset()

        # One search (a valid live action), then the card.
        def respond(request: Received, submitted: dict[str, Any] | None = submitted) -> Reply:
            if len(server.completions) == 1:
                return call("search", {"query": "台灯"})
            if submitted is None:  # copy the first listed title the live search showed
                title = latest_result(request)["state"]["products"][0]["title"]
                submitted = card(content=f"直接买「{title}」")
            return call(FAILURE_TOOL, submitted)

        server.responder = respond
        ok, record = run(analyse_failure(trace, config(url, shop.shop_url), stage=stage, active_skill_ids=active))  # type: ignore[arg-type]
        assert ok, record
        reasons = record["cards"][0]["forced_no_proposal_reasons"]
        # Every case also has no successful trial (nothing was bought): that reason comes first.
        assert reasons == ["proposal_without_successful_counterfactual", *expected], (stage, expected)
        assert record["cards"][0]["card"]["status"] == "NO_PROPOSAL" and record["stage"] == stage
    # No valid live action at all: the card on the first call.
    server.reset()
    server.responder = lambda r: call(FAILURE_TOOL, card())
    ok, record = run(analyse_failure(trace, config(url, shop.shop_url)))
    assert record["cards"][0]["forced_no_proposal_reasons"] == [
        "proposal_without_grounded_live_action",
        "proposal_without_successful_counterfactual",
    ]
    assert record["cards"][0]["firewall_findings"] == []
    assert all_free(shop)


@pytest.mark.slow
def test_the_lease_comes_back_after_model_failures(shop: LocalTestbed, stub: tuple[OpenAIStub, str]) -> None:
    server, url = stub
    for status in (500, 401):
        server.reset()
        server.responder = lambda r, s=status: (
            call("search", {"query": "台灯"})
            if len(server.completions) == 1
            else Reply(status=s, json={"error": {"message": "boom"}})
        )
        if status == 401:
            with pytest.raises(JudgeModelError, match="refused"):
                run(analyse_failure(failed_trace(), config(url, shop.shop_url)))
        else:
            ok, record = run(analyse_failure(failed_trace(), config(url, shop.shop_url)))
            assert not ok and record["status"] == "error" and record["error"]["status_code"] == 500
            assert record["live_session"]["valid_live_actions"] == 1
        assert all_free(shop), status


def _held_after_a_search(
    server: OpenAIStub, asked: threading.Event, release: threading.Event
) -> Callable[[Received], Awaitable[Reply]]:
    """A responder whose first answer searches in the live session (which then holds its lease)
    and whose next one waits for ``release`` (setting ``asked``) before it submits the card."""

    async def held(request: Received) -> Reply:
        if len(server.completions) == 1:
            return call("search", {"query": "台灯"})
        asked.set()
        await asyncio.to_thread(release.wait, 60)
        return call(FAILURE_TOOL, card())

    return held


@pytest.mark.slow
def test_the_lease_comes_back_when_the_analysis_is_cancelled(shop: LocalTestbed, stub: tuple[OpenAIStub, str]) -> None:
    server, url = stub
    second_asked, release = threading.Event(), threading.Event()
    server.responder = _held_after_a_search(server, second_asked, release)

    async def cancel_mid_session() -> None:
        task = asyncio.ensure_future(analyse_failure(failed_trace(), config(url, shop.shop_url)))
        assert await asyncio.to_thread(second_asked.wait, 60)
        assert not all_free(shop)  # the live session holds its lease now
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    try:
        run(cancel_mid_session())
    finally:
        release.set()
    assert all_free(shop)


CHILD = """
import asyncio, sys
sys.path.insert(0, sys.argv[3])
from shopsimrl.environment import ShopSimulatorSettings
from shopsimrl.research.skills.failure import FailureConfig, analyse_failure
from tests.research.test_failure_analyst import failed_trace, settings
config = FailureConfig(model=settings(sys.argv[1]), environment=ShopSimulatorSettings(base_url=sys.argv[2], persona=True))
asyncio.run(analyse_failure(failed_trace(), config))
"""


@pytest.mark.slow
def test_ctrl_c_mid_session_gives_the_lease_back(shop: LocalTestbed, stub: tuple[OpenAIStub, str]) -> None:
    server, url = stub
    second_asked, release = threading.Event(), threading.Event()
    server.responder = _held_after_a_search(server, second_asked, release)
    child = subprocess.Popen([sys.executable, "-c", CHILD, url, shop.shop_url, str(REPO)], cwd=REPO, stderr=subprocess.PIPE)
    with stopped_while_held(child, second_asked, release, "no 2nd call"):
        assert not all_free(shop)
        os.kill(child.pid, signal.SIGINT)
        assert child.wait(60) != 0
    assert all_free(shop)


@pytest.mark.slow
def test_the_stage_records_failures_and_resumes_by_fingerprint(
    tmp_path: Path, shop: LocalTestbed, stub: tuple[OpenAIStub, str]
) -> None:
    server, url = stub
    traces = latest_traces(write_traces(tmp_path / "traces.jsonl", [numbered(1), numbered(4, success=False)]))

    def answer(request: Received) -> Reply:
        if offered(request) == [SUCCESS_TOOL]:
            return call(SUCCESS_TOOL, {"cards": []})
        return call(FAILURE_TOOL, card("NO_PROPOSAL"))

    server.responder = answer
    out = tmp_path / "out"
    success = AnalystConfig(model=settings(url, tool=SUCCESS_TOOL), concurrency=2)

    def analysis(**limits: Any) -> dict[str, Any]:
        return run_success_analysis(traces, out, success, FailureAnalysis(config(url, shop.shop_url, **limits)))

    summary = analysis()
    assert summary["status"] == "complete" and "failure_pending" not in summary["episodes"]
    assert summary["episodes"] | {"missing_episode_ids": None} == {
        "total": 2, "success": 1, "failure": 1, "analysed": 2, "analysed_now": 2, "reused": 0,
        "errors_now": 0, "missing": 0, "missing_episode_ids": None,
    }  # fmt: skip
    assert summary["failure_cards"] == {"status": {"NO_PROPOSAL": 1}, "forced_no_proposal": {}}
    assert summary["failure_analyst"]["environment"]["persona"] is True
    cards = [orjson.loads(line) for line in (out / CARDS_NAME).read_bytes().splitlines()]
    assert [c["card_id"] for c in cards] == ["success-task-000001__sample-000-00", "failure-task-000004__sample-000-01"]
    assert cards[1]["ineligible_reasons"] == ["no_proposal"]
    records = [orjson.loads(line) for line in (out / ANALYSES_NAME).read_bytes().splitlines()]
    assert {r["channel"] for r in records} == {"success", "failure"}

    server.reset()
    server.responder = answer
    again = analysis()
    assert server.completions == [] and again["episodes"]["reused"] == 2 and again["episodes"]["analysed_now"] == 0

    server.reset()
    server.responder = answer
    changed = analysis(max_failure_steps=6)
    assert [offered(r) for r in server.completions] == [["search", FAILURE_TOOL]]  # only the failure again
    assert changed["episodes"]["analysed_now"] == 1 and changed["episodes"]["reused"] == 1

    # An unreachable shop: the failure becomes an error record and the stage is incomplete.
    server.reset()
    server.responder = answer
    unreachable = run_success_analysis(
        traces, out, success, FailureAnalysis(replace(config(url, "http://127.0.0.1:1"), max_failure_steps=7))
    )
    assert unreachable["status"] == "incomplete" and unreachable["episodes"]["missing_episode_ids"] == ["task-000004__sample-000"]
    error = [orjson.loads(line) for line in (out / ERRORS_NAME).read_bytes().splitlines()][-1]
    assert error["channel"] == "failure" and error["status"] == "error"
    assert all_free(shop)


# --------------------------------------------------------------------------- the testbed analyst, live


@pytest.fixture(scope="module")
def options_run(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalTestbed, Path]]:
    """A train run of 24 persona tasks that bought without the wanted options (``options_train_run``)."""
    with options_train_run(tmp_path_factory.mktemp("failure-train"), sample_size=24, concurrency=8) as run:
        yield run


@pytest.mark.slow
def test_the_testbed_analyst_verifies_its_repairs_in_live_sessions(
    tmp_path: Path, options_run: tuple[LocalTestbed, Path]
) -> None:
    bed, traces_path = options_run
    traces = latest_traces(traces_path, expected=24)
    failed = [t for t in traces if t.final is not None and t.final.reward_detail["r_success"] == 0]
    assert len(failed) >= 5
    analyst = FailureConfig(
        model=settings(bed.model_url, model="shopsim-analyst"),
        environment=ShopSimulatorSettings(base_url=bed.shop_url, persona=True),
    )
    success = AnalystConfig(model=settings(bed.model_url, model="shopsim-analyst", tool=SUCCESS_TOOL))
    summary = run_success_analysis(traces, tmp_path, success, FailureAnalysis(analyst))
    assert summary["status"] == "complete" and summary["episodes"]["failure"] == len(failed)
    records = [orjson.loads(line) for line in (tmp_path / ANALYSES_NAME).read_bytes().splitlines()]
    failures = [r for r in records if r["channel"] == "failure"]
    assert len(failures) == len(failed)
    proposals = 0
    for record in failures:
        (entry,) = record["cards"]
        assert entry["firewall_findings"] == [] and entry["forced_no_proposal_reasons"] == []
        assert record["live_session"]["successful_trials"] >= 1  # the gold-guided repair bought right
        if entry["card"]["status"] == "PROPOSE_ADD":
            proposals += 1
            assert entry["eligible"] and CHOOSE_OPTIONS in entry["card"]["deployable_abstraction"]["proposed_content"]
            actions = [a["action"] for a in record["live_session"]["trials"][0]["actions"]]
            assert any("=" in action for action in actions) and actions[-1] == "click[buy now]"
    assert proposals >= 1
    assert all_free(bed)

    # Too few calls to buy anything: the proposal it submits is forced to NO_PROPOSAL.
    ok, record = run(analyse_failure(failed[0], replace(analyst, max_failure_steps=2)))
    assert ok and record["cards"][0]["proposed_status"] == "PROPOSE_ADD"
    assert record["cards"][0]["forced_no_proposal_reasons"] == ["proposal_without_successful_counterfactual"]
    assert record["live_session"]["trials"][0]["actions"][0]["action"].startswith("search[")
    assert all_free(bed)


# --------------------------------------------------------------------------- kill -9 mid-run, then resume

STAGE_CHILD = """
import sys
from pathlib import Path
sys.path.insert(0, sys.argv[4])
from shopsimrl.environment import ShopSimulatorSettings
from shopsimrl.research.skills.analyst import AnalystConfig, latest_traces, run_success_analysis
from shopsimrl.research.skills.cards import SUCCESS_TOOL
from shopsimrl.research.skills.failure import FailureAnalysis, FailureConfig
from tests.research.test_failure_analyst import settings
failure = FailureConfig(model=settings(sys.argv[1]), environment=ShopSimulatorSettings(base_url=sys.argv[2], persona=True))
success = AnalystConfig(model=settings(sys.argv[1], tool=SUCCESS_TOOL), concurrency=1)
run_success_analysis(latest_traces(Path(sys.argv[3])), Path(sys.argv[5]), success, FailureAnalysis(failure))
"""


def failure_episode(request: Received) -> int:
    """The task id of the failed trace a failure analyst's request carries (``numbered``)."""
    user = orjson.loads(request.json["messages"][1]["content"])
    return int(user["failed_trace_and_privileged_gold"]["instruction"].split("#")[-1])


def search_then_no_proposal(request: Received) -> Reply:
    """One live action (the session's reset already holds its lease), then the card."""
    if offered(request) != [FAILURE_TOOL] and request.json["messages"][-1]["role"] == "user":
        return call("search", {"query": "台灯"})
    return call(FAILURE_TOOL, card("NO_PROPOSAL"))


@pytest.mark.slow
def test_kill_9_mid_failure_analysis_then_resume_releases_the_dead_lease(
    tmp_path: Path, shop: LocalTestbed, stub: tuple[OpenAIStub, str]
) -> None:
    server, url = stub
    tasks = [1, 2, 3, 4, 5]
    path = write_traces(tmp_path / "traces.jsonl", [numbered(n, success=False) for n in tasks])
    out = tmp_path / "out"
    held, killed = threading.Event(), threading.Event()
    kill_at = (3, 2)  # the third failed episode's second call: its live session holds a lease

    async def hold(request: Received) -> Reply:
        episode = failure_episode(request)
        if (episode, sum(failure_episode(r) == episode for r in server.completions)) == kill_at:
            held.set()
            await asyncio.to_thread(killed.wait, 120)  # the child dies waiting for this answer
        return search_then_no_proposal(request)

    server.responder = hold
    args = [url, shop.shop_url, str(path), str(REPO), str(out)]
    child = subprocess.Popen([sys.executable, "-c", STAGE_CHILD, *args], cwd=REPO, stderr=subprocess.PIPE)
    with stopped_while_held(child, held, killed, "not held"):
        os.kill(child.pid, signal.SIGKILL)
        assert child.wait(30) == -signal.SIGKILL
    asked_before = [failure_episode(r) for r in server.completions]
    assert asked_before == [1, 1, 2, 2, 3, 3]
    before = [orjson.loads(line) for line in (out / ANALYSES_NAME).read_bytes().splitlines()]
    assert [r["episode_id"] for r in before] == ["task-000001__sample-000", "task-000002__sample-000"]
    # The dead process still holds its session's lease: ShopSimulator leases never expire.
    health = shop.healthz()
    assert health["free_slots"] == health["environment_slots"] - 1
    (journal,) = (out / "leases").iterdir()  # what the restart releases it from
    assert journal.suffix == ".jsonl"
    # A torn write on top (the kill landing mid-line): cut off before the next append.
    with (out / ANALYSES_NAME).open("ab") as handle:
        handle.write(b'{"analysis_version": "shopsimrl-traj')

    server.reset()
    server.responder = search_then_no_proposal
    success = AnalystConfig(model=settings(url, tool=SUCCESS_TOOL), concurrency=1)
    summary = run_success_analysis(latest_traces(path), out, success, FailureAnalysis(config(url, shop.shop_url)))
    # Redone: only what had not finished, each from its first call (2 calls per episode).
    assert [failure_episode(r) for r in server.completions] == [3, 3, 4, 4, 5, 5]
    after = [orjson.loads(line) for line in (out / ANALYSES_NAME).read_bytes().splitlines()]
    assert after[:2] == before  # nothing lost
    assert [r["episode_id"] for r in after] == [f"task-{n:06d}__sample-000" for n in tasks]
    assert summary["status"] == "complete" and summary["failure_cards"]["status"] == {"NO_PROPOSAL": 5}
    assert all_free(shop)  # the dead process's lease too, released from its journal
    assert not (out / "leases").exists() or list((out / "leases").iterdir()) == []  # nothing held: no journal
