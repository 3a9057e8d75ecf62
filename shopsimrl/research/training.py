"""The training boundary: pure converters from frozen traces to what trainers read, and between
the plan's jobs and rollout requests. No training framework is imported here; a tokenizer, when
one is needed, is passed in as a function.

- :func:`episode_turns`: the model calls of an episode, each as it happened: the messages sent,
  the tools offered (they follow the page, so they differ from call to call), the reply.
- :func:`sft_records`: one OpenAI chat fine-tuning record per valid action (``messages``,
  ``tools``, ``parallel_tool_calls``): the prompt exactly as sent, earlier assistant turns with
  ``weight: 0``, the reply with ``weight: 1``. :func:`check_chat_record` validates the format.
- :func:`rl_record`: one GRPO/RL record per episode: the trajectory, the reward, and, after
  :func:`attach_training`, the training-only fields (token ids, loss mask, old logprobs,
  advantages) in a separate ``training`` namespace. :func:`grpo_advantages` computes
  group-normalised advantages over the samples of each task.
- :func:`rollout_request` / :func:`job_from_rollout_request`: an episode job as a slime-style
  rollout sample request (``group_index``, ``index``, ``status``, ``metadata``) and back.

Every converter applies the redaction rules of :mod:`shopsimrl.research.redaction`.
"""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from shopsimrl.metrics import step_facts
from shopsimrl.records import EpisodeTrace, ModelTurn, to_plain
from shopsimrl.research.episodes import episode_row, task_key
from shopsimrl.research.redaction import redacted_conversation
from shopsimrl.schemas import EpisodeJob, TraceFormatError

__all__ = [
    "RL_RECORD_VERSION",
    "ROLLOUT_REQUEST_VERSION",
    "ChatTokenizer",
    "TraceShapeError",
    "Turn",
    "attach_training",
    "check_chat_record",
    "episode_turns",
    "grpo_advantages",
    "job_from_rollout_request",
    "rl_record",
    "rl_turns",
    "rollout_request",
    "sft_records",
    "sft_turns",
]

RL_RECORD_VERSION = "shopsimrl-rl-record-v1"
ROLLOUT_REQUEST_VERSION = "shopsimrl-rollout-request-v1"

ChatTokenizer = Callable[[list[dict[str, Any]], list[dict[str, Any]], bool], list[int]]
"""``tokenize(messages, tools, add_generation_prompt) → token ids``: a chat template, e.g.
``lambda m, t, g: tok.apply_chat_template(m, tools=t, add_generation_prompt=g, tokenize=True)``."""


class TraceShapeError(ValueError):
    """A trace whose conversation does not match its steps (converters refuse it)."""


@dataclass(frozen=True)
class Turn:
    """One model call: what was sent, what was offered, what came back."""

    step_index: int
    prompt: list[dict[str, Any]]
    """The messages sent, in order (redacted)."""
    tools: list[dict[str, Any]]
    reply: dict[str, Any]
    """The assistant message as the model made it (``reasoning_content`` added when included)."""
    outcome: str
    """What became of the reply: ``action`` (a valid action), ``invalid_action`` (the shop rejected
    it), ``protocol_error`` (unusable, repaired), ``policy_failure`` (cut off or refused: episode
    terminated) or ``unanswered`` (the shop's answer never came: a failed episode)."""
    action: str | None


# --------------------------------------------------------------------------- turns


def _map(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


def _reply_from_model(model: ModelTurn) -> dict[str, Any]:
    """The assistant message of a reply that the conversation does not hold (a cut-off reply,
    or one whose action never got an answer), built as the runtime builds it."""
    message: dict[str, Any] = {"role": "assistant", "content": model.content}
    if model.tool_calls:
        message["tool_calls"] = [
            {
                "id": call.call_id,
                "type": "function",
                "function": {"name": call.name, "arguments": call.raw_arguments},
            }
            for call in model.tool_calls
        ]
    return message


def _call_ids(message: dict[str, Any]) -> list[Any]:
    return [_map(call).get("id") for call in message.get("tool_calls") or []]


def episode_turns(record: EpisodeTrace, *, include: frozenset[str] = frozenset()) -> list[Turn]:
    """Every model call of the episode, in order, aligned with its conversation. Raises
    :class:`TraceShapeError` when the conversation does not match the steps, and
    :class:`~shopsimrl.research.redaction.RedactionError` when the persona cannot be removed."""
    conversation = redacted_conversation(record, include)
    steps = record.steps
    if not steps:
        return []
    if len(conversation) < 2 or _map(conversation[0]).get("role") != "system" or _map(conversation[1]).get("role") != "user":
        raise TraceShapeError("the conversation does not open with the system and the task messages")
    turns: list[Turn] = []
    at = 2

    def expect(role: str, step_index: int) -> dict[str, Any]:
        message = conversation[at] if at < len(conversation) else None
        if not isinstance(message, dict) or message.get("role") != role:
            found = message.get("role") if isinstance(message, dict) else "nothing"
            raise TraceShapeError(f"step {step_index}: conversation[{at}] should be a {role} message, found {found}")
        return message

    for step in steps:
        index = step.step_index
        model = step.model
        facts = step_facts(step)
        prompt = conversation[:at]
        calls = model.tool_calls
        if facts.policy_failure is not None:
            reply, outcome = _reply_from_model(model), "policy_failure"
        elif facts.protocol_error:
            outcome = "protocol_error"
            content = model.content
            if calls:
                reply = expect("assistant", index)
                if _call_ids(reply) != [call.call_id for call in calls]:
                    raise TraceShapeError(f"step {index}: conversation[{at}] holds other tool calls than the step")
                at += 1
                for _ in calls:
                    expect("tool", index)
                    at += 1
            else:
                if content is not None and content.strip():
                    reply = expect("assistant", index)
                    at += 1
                else:
                    reply = _reply_from_model(model)
                expect("user", index)
                at += 1
        elif facts.acted:
            reply = expect("assistant", index)
            if _call_ids(reply)[:1] != [calls[0].call_id if calls else None]:
                raise TraceShapeError(f"step {index}: conversation[{at}] holds another tool call than the step's action")
            at += 1
            expect("tool", index)
            at += 1
            outcome = "invalid_action" if facts.invalid_action else "action"
        else:
            reply, outcome = _reply_from_model(model), "unanswered"
        reply = dict(reply)
        if "reasoning" in include and model.reasoning:
            reply["reasoning_content"] = model.reasoning
        turns.append(Turn(index, list(prompt), list(step.tools), reply, outcome, step.action))
    return turns


# --------------------------------------------------------------------------- SFT


def _weighted(message: dict[str, Any], weight: int) -> dict[str, Any]:
    return {**message, "weight": weight} if message.get("role") == "assistant" else dict(message)


def sft_records(record: EpisodeTrace, *, include: frozenset[str] = frozenset()) -> list[dict[str, Any]]:
    """One chat fine-tuning record per model call that made a valid action: the messages sent
    (earlier assistant turns ``weight: 0``: context, not targets), the tools offered at that
    call, and the reply (``weight: 1``). Unusable, rejected and cut-off replies are never targets."""
    return [
        {
            "messages": [_weighted(message, 0) for message in turn.prompt] + [_weighted(turn.reply, 1)],
            "tools": turn.tools,
            "parallel_tool_calls": False,
        }
        for turn in episode_turns(record, include=include)
        if turn.outcome == "action"
    ]


def _unweighted(message: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in message.items() if key != "weight"}


def sft_turns(records: Iterable[Mapping[str, Any]]) -> list[tuple[list[dict[str, Any]], list[dict[str, Any]], dict[str, Any]]]:
    """The (prompt, tools, reply) of each SFT record: the inverse of :func:`sft_records`."""
    return [
        ([_unweighted(m) for m in record["messages"][:-1]], list(record["tools"]), _unweighted(record["messages"][-1]))
        for record in records
    ]


_RECORD_KEYS = frozenset({"messages", "tools", "parallel_tool_calls"})
_MESSAGE_KEYS = {
    "system": frozenset({"role", "content"}),
    "user": frozenset({"role", "content"}),
    "assistant": frozenset({"role", "content", "tool_calls", "weight"}),
    "tool": frozenset({"role", "tool_call_id", "content"}),
}


def _check_tool_call(call: Any, where: str) -> tuple[str | None, list[str]]:
    errors: list[str] = []
    if not isinstance(call, dict) or set(call) != {"id", "type", "function"}:
        return None, [f"{where}: a tool call needs exactly id, type, function"]
    call_id = call["id"]
    if not isinstance(call_id, str) or not call_id:
        errors.append(f"{where}: tool call id must be a non-empty string")
    if call["type"] != "function":
        errors.append(f"{where}: tool call type must be 'function'")
    function = call["function"]
    if not isinstance(function, dict) or set(function) != {"name", "arguments"} or not isinstance(function.get("name"), str):
        return None, [*errors, f"{where}: function needs exactly a string name and arguments"]
    arguments = function["arguments"]
    if not isinstance(arguments, str):
        errors.append(f"{where}: arguments must be a JSON string, got {type(arguments).__name__}")
    else:
        try:
            parsed = json.loads(arguments)
        except json.JSONDecodeError:
            parsed = None
            errors.append(f"{where}: arguments are not valid JSON")
        if parsed is not None and not isinstance(parsed, dict):
            errors.append(f"{where}: arguments must be a JSON object")
    return (call_id if isinstance(call_id, str) else None), errors


def check_chat_record(record: Any, *, reasoning: bool = False) -> list[str]:
    """Every way ``record`` departs from the chat fine-tuning format this package writes: known
    keys only; roles system/user/assistant/tool; assistant tool calls with ids, type function and
    arguments that are JSON object strings; every tool message answering an open call of the
    assistant message before it, and every call answered before the next turn; a final
    assistant message with weight 1 calling offered tools. ``reasoning``: allow
    ``reasoning_content`` on assistant messages (only when reasoning was included)."""
    if not isinstance(record, dict):
        return ["a record must be a JSON object"]
    errors = [f"unknown key {key!r}" for key in sorted(set(record) - _RECORD_KEYS)]
    tools, messages = record.get("tools"), record.get("messages")
    offered: set[str] = set()
    if not isinstance(tools, list) or not tools:
        errors.append("tools must be a non-empty list")
    else:
        for number, tool in enumerate(tools):
            function = _map(_map(tool).get("function"))
            if _map(tool).get("type") != "function" or not isinstance(function.get("name"), str):
                errors.append(f"tools[{number}]: needs type 'function' and a function name")
            elif not isinstance(function.get("parameters"), dict):
                errors.append(f"tools[{number}]: parameters must be a JSON schema object")
            else:
                offered.add(function["name"])
    if record.get("parallel_tool_calls") not in (None, False):
        errors.append("parallel_tool_calls must be false: the agent makes one call per turn")
    if not isinstance(messages, list) or len(messages) < 2:
        return [*errors, "messages must be a list of at least two messages"]
    open_calls: list[str] = []
    for number, message in enumerate(messages):
        where = f"messages[{number}]"
        if not isinstance(message, dict) or message.get("role") not in _MESSAGE_KEYS:
            errors.append(f"{where}: role must be one of {', '.join(_MESSAGE_KEYS)}")
            continue
        role = message["role"]
        allowed = _MESSAGE_KEYS[role] | ({"reasoning_content"} if reasoning and role == "assistant" else set())
        errors += [f"{where}: key {key!r} is not allowed on a {role} message" for key in sorted(set(message) - allowed)]
        if number == 0 and role not in ("system", "user"):
            errors.append(f"{where}: the first message must be system or user")
        content = message.get("content")
        if role == "tool":
            call_id = message.get("tool_call_id")
            if call_id not in open_calls:
                errors.append(f"{where}: tool_call_id {call_id!r} answers no open call of the assistant message before it")
            else:
                open_calls.remove(call_id)
            if not isinstance(content, str):
                errors.append(f"{where}: tool content must be a string")
            continue
        if open_calls:
            errors.append(f"{where}: tool calls {open_calls} were not answered before this message")
            open_calls = []
        if role != "assistant":
            if not isinstance(content, str):
                errors.append(f"{where}: {role} content must be a string")
            continue
        if content is not None and not isinstance(content, str):
            errors.append(f"{where}: assistant content must be a string or null")
        weight = message.get("weight")
        if weight not in (0, 1) or isinstance(weight, bool):
            errors.append(f"{where}: weight must be 0 or 1")
        calls = message.get("tool_calls")
        if calls is not None and (not isinstance(calls, list) or not calls):
            errors.append(f"{where}: tool_calls must be a non-empty list when present")
            calls = None
        if calls is None and not (isinstance(content, str) and content):
            errors.append(f"{where}: an assistant message needs content or tool calls")
        for call_number, call in enumerate(calls or []):
            call_id, call_errors = _check_tool_call(call, f"{where}.tool_calls[{call_number}]")
            errors += call_errors
            if call_id is not None:
                open_calls.append(call_id)
    last = messages[-1] if isinstance(messages[-1], dict) else {}
    if last.get("role") != "assistant" or last.get("weight") != 1:
        errors.append("the last message must be the assistant reply with weight 1")
    else:
        for call in last.get("tool_calls") or []:
            name = _map(_map(call).get("function")).get("name")
            if offered and name not in offered:
                errors.append(f"the reply calls {name!r}, which the record's tools do not offer")
    if not any(_map(message).get("weight") == 1 for message in messages):
        errors.append("no assistant message has weight 1: nothing to train on")
    return errors


# --------------------------------------------------------------------------- RL records


def rl_record(record: EpisodeTrace, *, include: frozenset[str] = frozenset()) -> dict[str, Any]:
    """The GRPO/RL record of one episode: its group (the task: samples of one task are compared),
    reward, redacted conversation and turns. Each turn's prompt is the conversation's first
    ``prompt_messages`` messages (prompts only ever grow). No ``training`` namespace yet:
    :func:`attach_training` adds it."""
    turns = episode_turns(record, include=include)
    conversation = redacted_conversation(record, include)
    row = episode_row(record)
    for turn in turns:
        if turn.prompt != conversation[: len(turn.prompt)]:
            raise TraceShapeError(f"step {turn.step_index}: the prompt is not a prefix of the conversation")
    return {
        "rl_record_version": RL_RECORD_VERSION,
        "episode_id": record.episode_id,
        "group": task_key(record),
        "job": to_plain(record.job),
        "status": row["status"],
        "completed": row["completed"],
        "termination_reason": row["termination_reason"],
        "reward": row["reward"],
        "success": row["success"],
        "conversation": copy.deepcopy(conversation),
        "turns": [
            {
                "step_index": turn.step_index,
                "prompt_messages": len(turn.prompt),
                "tools": copy.deepcopy(turn.tools),
                "reply": copy.deepcopy(turn.reply),
                "outcome": turn.outcome,
                "action": turn.action,
            }
            for turn in turns
        ],
    }


def rl_turns(record: Mapping[str, Any]) -> list[Turn]:
    """The turns of an RL record, as :func:`episode_turns` gives them (the inverse of
    :func:`rl_record`)."""
    conversation = record["conversation"]
    return [
        Turn(
            turn["step_index"],
            list(conversation[: turn["prompt_messages"]]),
            list(turn["tools"]),
            dict(turn["reply"]),
            turn["outcome"],
            turn["action"],
        )
        for turn in record["turns"]
    ]


def grpo_advantages(records: Iterable[Mapping[str, Any]], *, scale: bool = True, epsilon: float = 1e-6) -> dict[str, float]:
    """GRPO's group-relative advantage of every RL record with a reward: its reward minus the
    mean reward of its group (the samples of its task), divided by the group's standard deviation
    (sample, n − 1) plus ``epsilon`` when ``scale``. A group of one sample gets 0. Records without
    a reward (failed episodes) get none."""
    groups: dict[str, list[tuple[str, float]]] = {}
    for record in records:
        reward = record.get("reward")
        if isinstance(reward, int | float) and not isinstance(reward, bool) and math.isfinite(reward):
            groups.setdefault(str(record.get("group")), []).append((str(record["episode_id"]), float(reward)))
    advantages: dict[str, float] = {}
    for members in groups.values():
        rewards = [reward for _, reward in members]
        mean = sum(rewards) / len(rewards)
        spread = math.sqrt(sum((r - mean) ** 2 for r in rewards) / (len(rewards) - 1)) if len(rewards) > 1 else 0.0
        for episode_id, reward in members:
            centred = reward - mean if len(rewards) > 1 else 0.0
            # Equal rewards (spread 0) centre to 0: nothing to prefer, whatever epsilon is.
            advantages[episode_id] = centred / (spread + epsilon) if scale and spread > 0 else centred
    return advantages


def attach_training(
    record: Mapping[str, Any],
    *,
    tokenize: ChatTokenizer,
    advantage: float | None = None,
    old_logprobs: Mapping[int, Sequence[float]] | None = None,
    tokenizer_name: str | None = None,
) -> dict[str, Any]:
    """A copy of the RL record with its ``training`` namespace: per turn, ``token_ids`` (prompt
    then reply, rendered by ``tokenize``), ``response_length``, ``loss_mask`` (1 per reply token:
    every reply was generated by the policy), ``old_logprobs`` (per reply token, from the rollout
    service, keyed by step index; traces record none) and ``advantages`` (``advantage`` on every
    reply token). Raises ValueError when the template does not render the prompt as a prefix of
    prompt plus reply, or when logprobs do not match the reply's length."""
    result = copy.deepcopy(dict(record))
    conversation = result["conversation"]
    training_turns = []
    for turn in result["turns"]:
        prompt = conversation[: turn["prompt_messages"]]
        prompt_ids = list(tokenize(prompt, turn["tools"], True))
        full_ids = list(tokenize([*prompt, turn["reply"]], turn["tools"], False))
        if full_ids[: len(prompt_ids)] != prompt_ids:
            raise ValueError(
                f"step {turn['step_index']}: the chat template does not render the prompt as a prefix of prompt + reply"
            )
        length = len(full_ids) - len(prompt_ids)
        logprobs = None if old_logprobs is None else old_logprobs.get(turn["step_index"])
        if logprobs is not None and len(logprobs) != length:
            raise ValueError(f"step {turn['step_index']}: {len(logprobs)} old logprobs for a reply of {length} tokens")
        training_turns.append(
            {
                "step_index": turn["step_index"],
                "token_ids": full_ids,
                "response_length": length,
                "loss_mask": [1] * length,
                "old_logprobs": None if logprobs is None else [float(value) for value in logprobs],
                "advantages": None if advantage is None else [float(advantage)] * length,
            }
        )
    result["training"] = {"tokenizer": tokenizer_name, "advantage": advantage, "turns": training_turns}
    return result


# --------------------------------------------------------------------------- rollout requests


def rollout_request(job: EpisodeJob, *, index: int, sampling: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """The request a slime-style rollout service gets for one episode: a pending sample of group
    ``task_id`` (GRPO compares the samples of one task) whose ``metadata`` carries the job. The
    prompt is empty: the episode's first messages exist only after the environment's reset."""
    if isinstance(index, bool) or not isinstance(index, int) or index < 0:
        raise ValueError(f"index must be a non-negative integer, got {index!r}")
    return {
        "group_index": job.task_id,
        "index": index,
        "prompt": "",
        "label": None,
        "status": "pending",
        "metadata": {
            "request_version": ROLLOUT_REQUEST_VERSION,
            "episode_id": job.episode_id,
            "job": job.to_dict(),
            "sampling": dict(sampling or {}),
        },
    }


def job_from_rollout_request(request: Mapping[str, Any]) -> EpisodeJob:
    """The job a rollout request carries; ValueError naming what is wrong (version, job fields,
    an episode id or group that disagrees with the job)."""
    metadata = request.get("metadata")
    if not isinstance(metadata, dict):
        raise ValueError("rollout request: metadata must be an object")
    version = metadata.get("request_version")
    if version != ROLLOUT_REQUEST_VERSION:
        raise ValueError(f"rollout request: metadata.request_version {version!r}; this version reads {ROLLOUT_REQUEST_VERSION!r}")
    job_data = metadata.get("job")
    if not isinstance(job_data, dict):
        raise ValueError("rollout request: metadata.job must be an object")
    try:
        job = EpisodeJob.from_dict(job_data)
    except TraceFormatError as exc:
        raise ValueError(f"rollout request: {exc}") from None
    if metadata.get("episode_id") != job.episode_id:
        raise ValueError(
            f"rollout request: metadata.episode_id {metadata.get('episode_id')!r} is not the job's {job.episode_id!r}"
        )
    if request.get("group_index") != job.task_id:
        raise ValueError(f"rollout request: group_index {request.get('group_index')!r} is not the job's task_id {job.task_id}")
    return job
