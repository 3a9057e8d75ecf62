"""An episode's model calls → one token-contiguous trajectory → the trainer's samples.

Every call of an episode was sent as prompt ids and answered with sampled ids
(:class:`~shopsimrl.training.token_model.TurnRecord`). The trajectory lays them end to end: the
first call's prompt, its sampled ids (loss mask 1, their log-probs), then for each next call the
ids its prompt adds after everything so far (the end of the turn's template, the tool result or
the repair message, the next generation prompt: loss mask 0), then its sampled ids, and so on.
The trainer then sees exactly the ids that were sent and sampled, once each.

That works while each call's prompt starts with the tokens so far. It does not when the chat
template renders an earlier turn differently from how it was sampled (a reply's thinking dropped
from the history, arguments re-serialised, a tools block that changed at the top of the prompt):
then the trajectory **forks**: the sample so far is closed and a sibling starts whose prompt is
the new call's whole prompt, so no sampled id is trained twice and none is trained in a context
the model did not see. Siblings share the episode's ``rollout_id`` and reward (slime's contract for
one rollout split into segments). ``forks`` counts them.

For the prefix-cache figures, each call also records how much of its prompt extends the previous
call's prompt and reply (``reused_prefix_tokens``: the common prefix with them).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from shopsimrl.records import EpisodeTrace
from shopsimrl.training.samples import Sample, SampleContractError, SampleStatus, abort_sample
from shopsimrl.training.token_model import TurnRecord

__all__ = ["EpisodeSamples", "Segment", "Trajectory", "build_trajectory", "episode_samples", "reward_of"]

REWARD_TOLERANCE = 1e-12


@dataclass
class Segment:
    """One sample's worth of trajectory."""

    prompt_length: int
    tokens: list[int]
    loss_mask: list[int] = field(default_factory=list)
    log_probs: list[float] = field(default_factory=list)
    steps: list[int] = field(default_factory=list)
    """The calls (``step_index``) whose sampled ids it trains."""

    @property
    def trainable(self) -> int:
        return sum(self.loss_mask)


@dataclass
class Trajectory:
    segments: list[Segment]
    forks: int
    """Calls whose prompt did not extend the tokens so far (each started a sibling)."""
    prompt_tokens: list[int]
    """Per call: the ids its prompt had (what a server without prefix caching prefills)."""
    reused_prefix_tokens: list[int]
    """Per call: how many leading ids of its prompt equal the previous call's prompt + reply (0 for the first)."""


def _common_prefix(left: Sequence[int], right: Sequence[int]) -> int:
    n = min(len(left), len(right))
    i = 0
    while i < n and left[i] == right[i]:
        i += 1
    return i


def build_trajectory(turns: Sequence[TurnRecord]) -> Trajectory:
    segments: list[Segment] = []
    forks = 0
    prompt_tokens: list[int] = []
    reused: list[int] = []
    previous: list[int] | None = None
    current: Segment | None = None
    for turn in turns:
        if len(turn.output_ids) != len(turn.output_log_probs):
            raise SampleContractError(
                f"call {turn.step_index}: {len(turn.output_ids)} sampled ids but {len(turn.output_log_probs)} log-probs"
            )
        prompt = turn.prompt_ids
        prompt_tokens.append(len(prompt))
        reused.append(0 if previous is None else _common_prefix(prompt, previous))
        previous = [*prompt, *turn.output_ids]
        extends = current is not None and len(prompt) >= len(current.tokens) and prompt[: len(current.tokens)] == current.tokens
        if current is not None and extends:
            gap = prompt[len(current.tokens) :]
            current.tokens.extend(gap)
            current.loss_mask.extend([0] * len(gap))
            current.log_probs.extend([0.0] * len(gap))
        else:
            if current is not None:
                forks += 1
            current = Segment(prompt_length=len(prompt), tokens=list(prompt))
            segments.append(current)
        if turn.output_ids:
            current.tokens.extend(turn.output_ids)
            current.loss_mask.extend([1] * len(turn.output_ids))
            current.log_probs.extend(float(value) for value in turn.output_log_probs)
            current.steps.append(turn.step_index)
    return Trajectory(
        segments=[segment for segment in segments if segment.trainable],
        forks=forks,
        prompt_tokens=prompt_tokens,
        reused_prefix_tokens=reused,
    )


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return None
    return float(value)


def reward_of(trace: EpisodeTrace) -> dict[str, float] | None:
    """``{"reward", "r_*"...}`` of a scored episode; None when the episode has no score (failed,
    not done, or a reward that is missing or not finite). A reward that is not ``r_strict`` is a
    broken environment contract and raises."""
    final = trace.final
    if trace.status != "completed" or final is None or final.done is not True:
        return None
    reward = _number(final.reward)
    detail = final.reward_detail
    strict, success = _number(detail.get("r_strict")), _number(detail.get("r_success"))
    if reward is None or strict is None or success is None or success not in (0.0, 1.0):
        return None
    if abs(reward - strict) > REWARD_TOLERANCE:
        raise ValueError(f"episode {trace.episode_id}: reward {reward!r} is not reward_detail.r_strict {strict!r}")
    components = {key: number for key, value in detail.items() if key.startswith("r_") and (number := _number(value)) is not None}
    return {"reward": reward, **components}


@dataclass
class EpisodeSamples:
    samples: list[Sample]
    trajectory: Trajectory | None
    scored: bool


def _status(trace: EpisodeTrace) -> SampleStatus:
    last = trace.steps[-1] if trace.steps else None
    if last is not None and last.policy_failure is not None and last.policy_failure.code == "generation_length":
        return SampleStatus.TRUNCATED
    return SampleStatus.COMPLETED


def episode_samples(
    trace: EpisodeTrace,
    turns: Sequence[TurnRecord],
    *,
    index: int,
    group_index: int | None = None,
    rollout_id: int | None = None,
    metadata: dict[str, Any] | None = None,
) -> EpisodeSamples:
    """The trainer's samples of one episode: the trajectory's segments with the episode's reward
    (siblings share it and ``rollout_id``, default ``index``), or the abort placeholder when the
    episode has no score or no sampled token."""
    rollout = index if rollout_id is None else rollout_id
    base = {
        "task_id": trace.job.task_id,
        "sample_id": trace.job.sample_id,
        "episode_id": trace.episode_id,
        "split": trace.job.split,
        "seed": trace.job.seed,
        "skills": [skill.skill_id for skill in trace.selected_skills],
        "episode_status": trace.status,
        "failure_class": trace.failure_class,
        "steps": len(trace.steps),
        **(metadata or {}),
    }
    reward = reward_of(trace)
    trajectory = build_trajectory(turns) if turns else None
    if reward is None or trajectory is None or not trajectory.segments:
        why = "no_score" if reward is None else "no_sampled_token"
        return EpisodeSamples(
            samples=[
                abort_sample(rollout_id=rollout, group_index=group_index, index=index, metadata={**base, "abort_reason": why})
            ],
            trajectory=trajectory,
            scored=False,
        )
    status = _status(trace)
    siblings = len(trajectory.segments)
    samples = [
        Sample(
            tokens=segment.tokens,
            response_length=len(segment.tokens) - segment.prompt_length,
            loss_mask=segment.loss_mask,
            rollout_log_probs=segment.log_probs,
            reward=dict(reward),
            status=status,
            rollout_id=rollout,
            group_index=group_index,
            index=index,
            metadata={
                **base,
                "scored": True,
                "forks": trajectory.forks,
                "sibling": position,
                "siblings": siblings,
                "trained_steps": list(segment.steps),
            },
        )
        for position, segment in enumerate(trajectory.segments)
    ]
    return EpisodeSamples(samples=samples, trajectory=trajectory, scored=True)
