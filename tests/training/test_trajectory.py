"""Trajectories and samples from an episode's calls, with the testbed's real tokenizer and template."""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

import pytest

from shopsimrl.model import ModelConfigError
from shopsimrl.prompts import action_tools
from shopsimrl.records import EnvironmentResult, EpisodeTrace, JobRecord, Step
from shopsimrl.records.trace import CodedMessage
from shopsimrl.testbed.chat_tokens import TestbedChatTokenizer
from shopsimrl.training.chat import ChatTokenizer, parse_reply
from shopsimrl.training.samples import Sample, SampleContractError, SampleStatus, check_siblings
from shopsimrl.training.token_model import TokenModelSettings, TurnRecord
from shopsimrl.training.trajectory import build_trajectory, episode_samples, reward_of
from tests.training.invariants import assert_episode_samples

TOKENIZER = TestbedChatTokenizer()
HOME = {"page_type": "search_home", "search_available": True, "actions": []}
PAGES = [
    {"page_type": "search_results", "search_available": False, "actions": ["100000000002", "下一页"]},
    {"page_type": "product", "search_available": False, "actions": ["黑色", "白色", "购买", "返回"]},
]
FINAL = {
    "done": True,
    "reward": 0.75,
    "reward_detail": {"r_type": 1.0, "r_att": 0.5, "r_strict": 0.75, "r_success": 0.0, "evidence": {"why": "x"}},
    "termination_reason": "purchase",
}


def _play(*, reasoning: bool = False, same_tools: bool = False) -> list[TurnRecord]:
    """Three calls of a shopping episode as the adapter records them: each prompt rendered from the
    conversation so far, each reply the ids of the policy's text and the end-of-turn token."""
    messages: list[dict[str, Any]] = [
        {"role": "system", "content": "你是购物助手。"},
        {"role": "user", "content": "购物任务：\n买一副黑色降噪耳机\n\n页面：搜索首页"},
    ]
    states = [HOME, *PAGES]
    calls = [("search", {"query": "降噪耳机"}), ("click", {"value": "100000000002"}), ("click", {"value": "购买"})]
    turns = []
    for step, (state, (name, arguments)) in enumerate(zip(states, calls, strict=True), start=1):
        tools = action_tools(HOME if same_tools else state)
        prompt = TOKENIZER.render(messages, tools)
        thought = f"<think>\n第{step}步，先想一想。\n</think>\n\n" if reasoning else ""
        text = (
            thought + "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments}, ensure_ascii=False) + "\n</tool_call>"
        )
        output = [*TOKENIZER.encode(text), TOKENIZER.eos_token_id]
        turns.append(TurnRecord(step, prompt, output, [-0.01 * (i % 7) for i in range(len(output))], "stop"))
        reply = parse_reply(TOKENIZER.decode(output, skip_special_tokens=True))
        call_id = f"c{step}"
        messages.append(
            {
                "role": "assistant",
                "content": reply.content,
                "tool_calls": [
                    {"id": call_id, "type": "function", "function": {"name": reply.calls[0][0], "arguments": reply.calls[0][1]}}
                ],
            }
        )
        messages.append({"role": "tool", "tool_call_id": call_id, "content": f"页面：第{step + 1}页"})
    return turns


def _trace(*, status: str = "completed", final: dict[str, Any] | None = None, last_failure: str | None = None) -> EpisodeTrace:
    trace = EpisodeTrace.start(JobRecord(task_id=12, sample_id=3, seed=99, split="train"))
    trace.status = status  # type: ignore[assignment]
    trace.final = EnvironmentResult.model_validate(final if final is not None else FINAL)
    trace.steps = [Step(step_index=i) for i in (1, 2, 3)]
    if last_failure is not None:
        trace.steps[-1].policy_failure = CodedMessage(code=last_failure, message="cut")
    return trace


def test_the_testbed_tokenizer_satisfies_the_adapters_interface() -> None:
    assert isinstance(TOKENIZER, ChatTokenizer)


def test_parse_reply_reads_thinking_calls_and_leaves_broken_blocks_in_the_text() -> None:
    reply = parse_reply(
        '<think>\n想一想\n</think>\n\n<tool_call>\n{"name": "click", "arguments": {"value": "购买"}}\n</tool_call>'
    )
    assert (reply.reasoning, reply.content, reply.calls) == ("想一想", None, [("click", '{"value": "购买"}')])
    broken = parse_reply('<tool_call>\n{"name": "click", "arguments": {"value": \n</tool_call>')
    assert broken.calls == [] and broken.content is not None and "<tool_call>" in broken.content
    cut = parse_reply("<think>\n还没想完")
    assert cut.reasoning == "还没想完" and cut.content is None


def test_a_stable_prompt_gives_one_contiguous_sample() -> None:
    turns = _play(same_tools=True)
    trajectory = build_trajectory(turns)
    assert trajectory.forks == 0 and len(trajectory.segments) == 1
    result = episode_samples(_trace(), turns, index=7, group_index=2)
    (sample,) = result.samples
    assert_episode_samples(result.samples, turns)
    assert sample.tokens[: sample.prompt_length] == turns[0].prompt_ids
    assert sample.tokens == turns[2].prompt_ids + turns[2].output_ids, "the last prompt plus its reply is the whole trajectory"
    assert sum(sample.loss_mask) == sum(len(t.output_ids) for t in turns)
    assert (sample.rollout_id, sample.index, sample.group_index, sample.status) == (7, 7, 2, SampleStatus.COMPLETED)
    assert sample.reward == {"reward": 0.75, "r_type": 1.0, "r_att": 0.5, "r_strict": 0.75, "r_success": 0.0}
    assert sample.metadata["episode_id"] == "task-000012__sample-003" and sample.metadata["forks"] == 0
    whole_previous = [len(t.prompt_ids) + len(t.output_ids) for t in turns[:-1]]
    assert trajectory.reused_prefix_tokens[1:] == whole_previous, "each prompt extends the last call's prompt and reply"


def test_dropped_thinking_forks_into_siblings_that_share_reward_and_rollout() -> None:
    turns = _play(reasoning=True, same_tools=True)
    result = episode_samples(_trace(), turns, index=4, group_index=1)
    assert result.trajectory is not None and result.trajectory.forks == 2
    assert len(result.samples) == 3
    assert_episode_samples(result.samples, turns)
    assert [s.metadata["sibling"] for s in result.samples] == [0, 1, 2]
    assert {s.rollout_id for s in result.samples} == {4}


def test_a_tools_block_that_follows_the_page_breaks_the_prefix_at_the_top() -> None:
    turns = _play()
    trajectory = build_trajectory(turns)
    assert trajectory.forks == 2
    # The tools block sits in the system turn: a new tool or enum changes the prompt inside that turn.
    for turn, reused in zip(turns[1:], trajectory.reused_prefix_tokens[1:], strict=True):
        assert 0 < reused < turn.prompt_ids.index(TOKENIZER.eos_token_id)
    assert_episode_samples(episode_samples(_trace(), turns, index=0).samples, turns)


def test_generation_length_is_truncated_and_a_failed_episode_is_the_abort_placeholder() -> None:
    turns = _play(same_tools=True)
    (truncated,) = episode_samples(_trace(last_failure="generation_length"), turns, index=1).samples
    assert truncated.status is SampleStatus.TRUNCATED
    (context,) = episode_samples(_trace(last_failure="context_length"), turns, index=1).samples
    assert context.status is SampleStatus.COMPLETED
    failed = episode_samples(_trace(status="failed"), turns, index=5, group_index=9)
    (abort,) = failed.samples
    assert not failed.scored and abort.status is SampleStatus.ABORTED and abort.remove_sample
    assert (abort.tokens, abort.response_length, abort.loss_mask, abort.rollout_log_probs) == ([0, 0], 1, [0], [0.0])
    assert abort.rollout_id == 5 and abort.metadata["abort_reason"] == "no_score"
    assert_episode_samples(failed.samples, turns)
    (empty,) = episode_samples(_trace(), [], index=5).samples
    assert empty.status is SampleStatus.ABORTED and empty.metadata["abort_reason"] == "no_sampled_token"


def test_reward_must_be_r_strict_and_scored() -> None:
    assert reward_of(_trace(final={**FINAL, "done": False})) is None
    assert reward_of(_trace(final={**FINAL, "reward_detail": {"r_strict": 0.75, "r_success": 0.5}})) is None
    with pytest.raises(ValueError, match=r"reward 0.5 is not reward_detail.r_strict 0.75"):
        reward_of(_trace(final={**FINAL, "reward": 0.5}))


def _valid() -> Sample:
    return Sample([1, 2, 3, 4], 3, [1, 0, 1], [-0.5, 0.0, -0.1], {"reward": 1.0}, SampleStatus.COMPLETED, rollout_id=0)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"loss_mask": [1, 0]}, "loss_mask has 2 entries, response_length is 3"),
        ({"rollout_log_probs": [-0.5, 0.0]}, "rollout_log_probs has 2 entries"),
        ({"rollout_log_probs": [-0.5, -0.2, -0.1]}, r"rollout_log_probs\[1\] is -0.2 where loss_mask is 0"),
        ({"rollout_log_probs": [float("nan"), 0.0, -0.1]}, r"rollout_log_probs\[0\] is not finite"),
        (
            {"response_length": 4, "loss_mask": [1, 0, 1, 1], "rollout_log_probs": [0.0] * 4},
            r"response_length 4 must be in 1..len\(tokens\) - 1 = 3",
        ),
        ({"loss_mask": [0, 0, 0], "rollout_log_probs": [0.0] * 3}, "must keep remove_sample false and hold a trainable token"),
        ({"reward": {"r_strict": 1.0}}, "reward must be a dict with a 'reward' key"),
    ],
)
def test_sample_check_names_the_broken_field(change: dict[str, Any], message: str) -> None:
    sample = _valid()
    for key, value in change.items():
        setattr(sample, key, value)
    with pytest.raises(SampleContractError, match=message):
        sample.check()


def test_siblings_must_share_reward_and_rollout() -> None:
    other = _valid()
    other.reward = {"reward": 0.0}
    with pytest.raises(SampleContractError, match="sibling 1 has reward"):
        check_siblings([_valid(), other])
    other = _valid()
    other.rollout_id = 1
    with pytest.raises(SampleContractError, match="sibling 1 has rollout_id 1"):
        check_siblings([_valid(), other])


def test_to_slime_without_slime_says_where_to_call_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "slime", None)  # as where slime is not installed
    with pytest.raises(RuntimeError, match="inside slime's rollout process"):
        _valid().to_slime()


def test_to_slime_fills_slimes_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    # slime needs torch and Ray, which this machine does not install; this stand-in has the fields
    # and the Status enum of THUDM/slime's slime/utils/types.py (7985bf2), without rollout_id as a
    # field (newer slime has it; the converter sets it either way).
    @dataclass
    class StandInSample:
        group_index: int | None = None
        index: int | None = None
        prompt: str = ""
        tokens: list[int] = field(default_factory=list)
        response: str = ""
        response_length: int = 0
        reward: float | dict[str, Any] | None = None
        loss_mask: list[int] | None = None
        rollout_log_probs: list[float] | None = None
        remove_sample: bool = False

        class Status(Enum):
            PENDING = "pending"
            COMPLETED = "completed"
            TRUNCATED = "truncated"
            ABORTED = "aborted"
            FAILED = "failed"

        status: Status = Status.PENDING
        metadata: dict[str, Any] = field(default_factory=dict)

    module = types.ModuleType("slime.utils.types")
    module.Sample = StandInSample  # type: ignore[attr-defined]
    for name, value in (
        ("slime", types.ModuleType("slime")),
        ("slime.utils", types.ModuleType("slime.utils")),
        ("slime.utils.types", module),
    ):
        monkeypatch.setitem(sys.modules, name, value)
    turns = _play(reasoning=True, same_tools=True)
    ours = episode_samples(_trace(last_failure="generation_length"), turns, index=6, group_index=3).samples
    base = StandInSample(group_index=3, index=6, prompt="12", metadata={"task_id": 12, "from_slime": True})
    converted = [sample.to_slime(base) for sample in ours]
    assert [c.tokens for c in converted] == [s.tokens for s in ours]
    for mine, theirs in zip(ours, converted, strict=True):
        assert theirs.status is StandInSample.Status.TRUNCATED
        assert (theirs.response_length, theirs.loss_mask, theirs.rollout_log_probs) == (
            mine.response_length,
            mine.loss_mask,
            mine.rollout_log_probs,
        )
        assert theirs.rollout_id == 6 and theirs.prompt == "12" and theirs.metadata["from_slime"] is True
        assert theirs.reward == mine.reward and theirs is not base
    assert base.tokens == [] and base.status is StandInSample.Status.PENDING, "the sample slime handed in is not changed"


@pytest.mark.parametrize(("field", "value"), [("top_p", 0.9), ("top_k", 20), ("max_new_tokens", 0), ("base_url", "sglang:30000")])
def test_settings_refuse_what_the_trainer_cannot_use(field: str, value: Any) -> None:
    settings: dict[str, Any] = {"base_url": "http://127.0.0.1:1", field: value}
    with pytest.raises(ModelConfigError, match=field):
        TokenModelSettings(**settings)
