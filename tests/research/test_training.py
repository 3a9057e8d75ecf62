"""The training boundary: turns aligned with the conversation, SFT records in the chat format
and back, RL records with their training namespace and back, GRPO advantages, rollout requests
and back; on hand-made traces and on real testbed runs (local, sharded on moto S3, v4)."""

from __future__ import annotations

import ast
import copy
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import orjson
import pytest

from shopsimrl.prompts import persona_section
from shopsimrl.records import read_trace
from shopsimrl.research.redaction import RedactionError, public_persona, removed_persona_fields
from shopsimrl.research.training import (
    ROLLOUT_REQUEST_VERSION,
    TraceShapeError,
    attach_training,
    check_chat_record,
    episode_turns,
    grpo_advantages,
    job_from_rollout_request,
    rl_record,
    rl_turns,
    rollout_request,
    sft_records,
    sft_turns,
)
from shopsimrl.schemas import EpisodeJob
from shopsimrl.storage.reading import open_run

from .conftest import ResearchRuns
from .handmade import CATEGORY, GOAL_ASIN, PERSONA, Episode, good_episode, product, results

TRAINING = Path(__file__).resolve().parents[2] / "shopsimrl" / "research" / "training.py"


def repaired_episode() -> dict[str, Any]:
    """Every kind of reply: protocol errors with and without calls and text, an invalid action,
    valid actions, then a cut-off reply."""
    episode = Episode()
    episode.protocol_error("tool_call_count")
    episode.act("search", "台灯", results((GOAL_ASIN, CATEGORY)), reasoning="先搜索。")
    episode.protocol_error("mixed_content", content="我先看看")
    episode.act("click", GOAL_ASIN, product(GOAL_ASIN), reasoning="打开第一个。")
    episode.protocol_error("invalid_arguments_json", with_call=True)
    episode.act("click", "buy now", reason="incomplete_options", reasoning="直接买。")
    return episode.policy_failure().done()


# --------------------------------------------------------------------------- turns


def test_turns_follow_the_conversation_step_by_step() -> None:
    record = repaired_episode()
    turns = episode_turns(read_trace(record))
    assert [turn.outcome for turn in turns] == [
        "protocol_error",
        "action",
        "protocol_error",
        "action",
        "protocol_error",
        "invalid_action",
        "policy_failure",
    ]
    conversation = record["conversation"]
    previous: dict[str, Any] | None = None
    for turn, step in zip(turns, record["steps"], strict=True):
        assert turn.step_index == step["step_index"] and turn.tools == step["tools"]
        assert turn.prompt[1:] == conversation[1 : len(turn.prompt)]
        # The last message sent is the page the step answered, or the repair feedback after an unusable reply.
        if previous is None or "protocol_feedback" not in previous:
            assert turn.prompt[-1]["content"] == step["observation"]
        else:
            assert turn.prompt[-1]["content"] == previous["protocol_feedback"]
        previous = step
    # The reply of a cut-off call is not in the conversation; it is rebuilt from the model output.
    assert turns[-1].reply["tool_calls"][0]["function"]["arguments"] == '{"query": "台'
    # A valid action's reply is the conversation's own message, raw arguments and id as made.
    second = turns[1]
    assert second.reply == conversation[len(second.prompt)] and second.action == "search[台灯]"


def test_a_conversation_that_does_not_match_its_steps_is_refused() -> None:
    record = good_episode()
    del record["conversation"][3]  # the tool answer of step 1
    with pytest.raises(TraceShapeError, match=r"step 1: conversation\[3\] should be a tool message, found assistant"):
        episode_turns(read_trace(record))
    record = good_episode()
    record["conversation"][2]["tool_calls"][0]["id"] = "someone-else"
    with pytest.raises(TraceShapeError, match="step 1"):
        episode_turns(read_trace(record))


def test_the_persona_stays_as_the_policy_saw_it_without_its_identifying_fields() -> None:
    """The replies depend on the profile (the system prompt says to match it), so it stays; the
    user id goes, the section re-rendered as the prompt builder renders it. Included, it is whole."""
    record = good_episode()
    system = record["conversation"][0]["content"]
    assert PERSONA["用户ID"] in system
    redacted = episode_turns(read_trace(record))[0].prompt[0]["content"]
    public = {key: value for key, value in PERSONA.items() if key != "用户ID"}
    assert PERSONA["用户ID"] not in redacted and "用户ID" not in redacted
    assert redacted == system.replace(persona_section(PERSONA), persona_section(public))
    assert "极简北欧风格" in redacted and "性价比" in redacted
    assert episode_turns(read_trace(record), include=frozenset({"persona"}))[0].prompt[0]["content"] == system
    assert (
        removed_persona_fields(read_trace(record), frozenset()) == ["用户ID"]
        and removed_persona_fields(read_trace(record), frozenset({"persona"})) == []
    )


def test_an_identifying_field_repeated_outside_the_persona_makes_the_episode_unusable() -> None:
    """A reply that typed the user id into a search: the id cannot leave the pair, so the episode
    is refused rather than exported with the id in its context."""
    record = good_episode()
    call = record["conversation"][2]["tool_calls"][0]
    call["function"]["arguments"] = json.dumps({"query": f"台灯 {PERSONA['用户ID']}"}, ensure_ascii=False)
    with pytest.raises(RedactionError, match=r"conversation\[2\] repeats an identifying persona field \(用户ID\)"):
        episode_turns(read_trace(record))
    assert episode_turns(read_trace(record), include=frozenset({"persona"}))  # in full, nothing is removed
    nested = {"基本信息": {"注册时间": "2021-03-04 10:00:00", "城市": "杭州"}, "用户ID": "U1"}
    assert public_persona(nested) == ({"基本信息": {"城市": "杭州"}}, {"注册时间": ["2021-03-04 10:00:00"], "用户ID": ["U1"]})


def test_a_persona_that_cannot_be_separated_is_an_error_not_a_leak() -> None:
    record = good_episode()
    conversation = record["conversation"]
    conversation[0]["content"] = conversation[0]["content"].replace('", "', '","')  # rendered some other way
    with pytest.raises(RedactionError, match="persona"):
        episode_turns(read_trace(record))


def test_reasoning_only_on_the_reply_and_only_when_included() -> None:
    record = good_episode(reasoning="这是思考")
    assert all(
        "reasoning_content" not in json.dumps(turn.prompt)
        for turn in episode_turns(read_trace(record), include=frozenset({"reasoning"}))
    )
    replies = [
        turn.reply.get("reasoning_content") for turn in episode_turns(read_trace(record), include=frozenset({"reasoning"}))
    ]
    assert replies == ["这是思考", "这是思考", "这是思考", None]  # the purchase came without reasoning
    assert "这是思考" not in json.dumps([turn.__dict__ for turn in episode_turns(read_trace(record))], ensure_ascii=False)


# --------------------------------------------------------------------------- SFT


def test_sft_records_are_valid_actions_in_the_chat_format_and_round_trip() -> None:
    record = repaired_episode()
    records = sft_records(read_trace(record))
    turns = [turn for turn in episode_turns(read_trace(record)) if turn.outcome == "action"]
    assert len(records) == 2
    for item in records:
        assert check_chat_record(item) == []
        assert [m.get("weight") for m in item["messages"] if m["role"] == "assistant"][-1] == 1
        assert all(m["weight"] == 0 for m in item["messages"][:-1] if m["role"] == "assistant")
    # The tools are each call's own: the click enum follows the page.
    assert [item["tools"] for item in records] == [turn.tools for turn in turns]
    assert records[0]["tools"] != records[1]["tools"]
    assert sft_turns(records) == [(turn.prompt, turn.tools, turn.reply) for turn in turns]
    assert sft_turns(orjson.loads(orjson.dumps(item)) for item in records) == sft_turns(records)


def _mutated(change: Any) -> dict[str, Any]:
    record = copy.deepcopy(sft_records(read_trace(good_episode()))[-1])
    change(record)
    return record


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda r: r["messages"][3].__setitem__("tool_call_id", "nobody"), "answers no open call"),
        (
            lambda r: r["messages"][2]["tool_calls"][0]["function"].__setitem__("arguments", {"query": "x"}),
            "must be a JSON string",
        ),
        (lambda r: r["messages"][2]["tool_calls"][0]["function"].__setitem__("arguments", '{"query": '), "not valid JSON"),
        (lambda r: r["messages"][2]["tool_calls"][0]["function"].__setitem__("arguments", '["x"]'), "JSON object"),
        (lambda r: r["messages"][2]["tool_calls"][0].__setitem__("id", ""), "non-empty string"),
        (lambda r: r["messages"][2]["tool_calls"][0].__setitem__("type", "code"), "type must be 'function'"),
        (lambda r: r["messages"].__setitem__(1, {"role": "robot", "content": "x"}), "role must be one of"),
        (lambda r: r["messages"][-1].pop("weight"), "weight must be 0 or 1"),
        (lambda r: r["messages"][-1].__setitem__("reasoning_content", "想"), "'reasoning_content' is not allowed"),
        (lambda r: r.__setitem__("metadata", {}), "unknown key 'metadata'"),
        (lambda r: r["messages"].pop(3), "were not answered"),
        (lambda r: r["messages"].pop(), "the last message must be the assistant reply"),
        (lambda r: r["tools"][-1]["function"].__setitem__("name", "tap"), "do not offer"),
        (lambda r: r.__setitem__("parallel_tool_calls", True), "parallel_tool_calls must be false"),
    ],
)
def test_the_format_check_catches_each_departure(change: Any, error: str) -> None:
    errors = check_chat_record(_mutated(change))
    assert any(error in message for message in errors), errors


# --------------------------------------------------------------------------- RL records


def _render(messages: list[dict[str, Any]], tools: list[dict[str, Any]], generation: bool) -> list[int]:
    """A small chat template (tools in the first block, one block per message) over UTF-8 bytes."""
    text = "<tools>" + json.dumps(tools, ensure_ascii=False, sort_keys=True) + "</tools>"
    for message in messages:
        body = message.get("content") or ""
        if message.get("reasoning_content"):
            body = f"<think>{message['reasoning_content']}</think>" + body
        if message.get("tool_calls"):
            body += json.dumps(message["tool_calls"], ensure_ascii=False, sort_keys=True)
        text += f"<|{message['role']}|>{body}<|end|>"
    return list((text + ("<|assistant|>" if generation else "")).encode("utf-8"))


def _render_closing(messages: list[dict[str, Any]], tools: list[dict[str, Any]], generation: bool) -> list[int]:
    """A template that is not prefix-stable: the generation prompt differs from the reply's opening."""
    return _render(messages, tools, False) + (list(b"<|gen|>") if generation else [])


def test_rl_records_round_trip_and_carry_training_fields_apart() -> None:
    record = repaired_episode()
    rl = rl_record(read_trace(record), include=frozenset({"reasoning"}))
    assert "training" not in rl and rl["group"] == "1" and rl["reward"] == 0.0
    assert rl_turns(rl) == episode_turns(read_trace(record), include=frozenset({"reasoning"}))
    assert rl_turns(orjson.loads(orjson.dumps(rl))) == rl_turns(rl)

    logprobs = {2: [-0.5] * len(_render([{"role": "assistant", **rl["turns"][1]["reply"]}], [], False))}
    with pytest.raises(ValueError, match="old logprobs for a reply of"):
        attach_training(rl, tokenize=_render, old_logprobs=logprobs)
    trained = attach_training(rl, tokenize=_render, advantage=0.75, tokenizer_name="bytes")
    assert {key: value for key, value in trained.items() if key != "training"} == rl, "training fields stay in their namespace"
    training = trained["training"]
    assert training["tokenizer"] == "bytes" and training["advantage"] == 0.75
    for turn, tokens in zip(rl["turns"], training["turns"], strict=True):
        prompt = rl["conversation"][: turn["prompt_messages"]]
        length = tokens["response_length"]
        assert tokens["token_ids"][:-length] == _render(prompt, turn["tools"], True)
        reply = bytes(tokens["token_ids"][-length:]).decode("utf-8")
        assert reply.endswith("<|end|>") and (turn["reply"].get("reasoning_content") or "") in reply
        assert tokens["loss_mask"] == [1] * length and tokens["advantages"] == [0.75] * length
        assert tokens["old_logprobs"] is None

    exact = {
        turn["step_index"]: [-0.1] * tokens["response_length"]
        for turn, tokens in zip(rl["turns"], training["turns"], strict=True)
    }
    with_logprobs = attach_training(rl, tokenize=_render, old_logprobs=exact)
    assert [turn["old_logprobs"] for turn in with_logprobs["training"]["turns"]] == list(exact.values())
    with pytest.raises(ValueError, match="prefix"):
        attach_training(rl, tokenize=_render_closing)


def test_grpo_advantages_are_normalised_within_each_task() -> None:
    def rl(task: int, sample: int, reward: float | None) -> dict[str, Any]:
        return {"episode_id": f"t{task}s{sample}", "group": str(task), "reward": reward}

    records = [rl(1, 0, 1.0), rl(1, 1, 0.0), rl(1, 2, 0.5), rl(2, 0, 1.0), rl(3, 0, None), rl(3, 1, 0.25)]
    advantages = grpo_advantages(records, epsilon=0.0)
    # Task 1: mean 0.5, sample standard deviation 0.5.
    assert advantages == {"t1s0": 1.0, "t1s1": -1.0, "t1s2": 0.0, "t2s0": 0.0, "t3s1": 0.0}
    assert grpo_advantages(records, scale=False)["t1s0"] == 0.5


# --------------------------------------------------------------------------- rollout requests


@pytest.mark.parametrize("job", [EpisodeJob(0, 0, 0, "val"), EpisodeJob(4242, 7, 2**31 - 1, "train")])
def test_jobs_round_trip_through_rollout_requests(job: EpisodeJob) -> None:
    request = rollout_request(job, index=3, sampling={"temperature": 0.6})
    assert request["group_index"] == job.task_id and request["status"] == "pending"
    assert job_from_rollout_request(orjson.loads(orjson.dumps(request))) == job


@pytest.mark.parametrize(
    ("change", "error"),
    [
        (lambda r: r["metadata"].__setitem__("request_version", "v0"), "request_version"),
        (lambda r: r["metadata"].__setitem__("episode_id", "task-000001__sample-009"), "is not the job's"),
        (lambda r: r.__setitem__("group_index", 99), "group_index 99"),
        (lambda r: r["metadata"]["job"].__setitem__("seed", -1), "seed"),
        (lambda r: r.__setitem__("metadata", None), "metadata must be an object"),
    ],
)
def test_a_bad_rollout_request_is_named(change: Any, error: str) -> None:
    request = rollout_request(EpisodeJob(1, 0, 5, "val"), index=0)
    assert request["metadata"]["request_version"] == ROLLOUT_REQUEST_VERSION
    change(request)
    with pytest.raises(ValueError, match=error):
        job_from_rollout_request(request)


@pytest.mark.slow
def test_the_converters_import_no_training_framework() -> None:
    tree = ast.parse(TRAINING.read_text(encoding="utf-8"))
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import) for alias in node.names}
    imported |= {node.module.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom) and node.module}
    assert imported <= {"__future__", "copy", "json", "math", "collections", "dataclasses", "typing", "shopsimrl"}
    loaded = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, shopsimrl.research.training; print(sorted(m for m in ('torch','transformers','numpy','slime','sglang') if m in sys.modules))",
        ],
        capture_output=True,
        text=True,
        check=True,
    )
    assert loaded.stdout.strip() == "[]"


# --------------------------------------------------------------------------- real runs


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["local", "sharded", "legacy", "reasoning"])
def test_every_episode_of_a_real_run_converts_and_round_trips(
    research_runs: ResearchRuns, s3_env: dict[str, str], reasoning_run: Path, kind: str
) -> None:
    location = {
        "local": research_runs.local,
        "sharded": research_runs.sharded,
        "legacy": research_runs.legacy,
        "reasoning": reasoning_run,
    }[kind]
    include = frozenset({"reasoning"})
    converted = 0
    for record in open_run(location).records():
        turns = episode_turns(record, include=include)
        assert len(turns) == len(record.steps)
        records = sft_records(record, include=include)
        for item in records:
            assert check_chat_record(item, reasoning=True) == []
        assert sft_turns(records) == [(t.prompt, t.tools, t.reply) for t in turns if t.outcome == "action"]
        rl = rl_record(record, include=include)
        assert rl_turns(orjson.loads(orjson.dumps(rl))) == turns
        converted += bool(records)
    assert converted >= 4
