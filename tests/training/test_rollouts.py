"""Training rollouts end to end: the episode engine, the testbed shop and the token endpoint, over HTTP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from shopsimrl.environment import ShopSimulatorEnvironment, ShopSimulatorSettings
from shopsimrl.prompts import PromptBuilder
from shopsimrl.records.io import dump_line, read_trace
from shopsimrl.schemas import EpisodeJob
from shopsimrl.skills import NoSkills
from shopsimrl.testbed.chat_tokens import TestbedChatTokenizer
from shopsimrl.testbed.policy import PolicySettings
from shopsimrl.testbed.policy import create_app as create_policy_app
from shopsimrl.testbed.serving import running_server
from shopsimrl.testbed.shop import ShopSettings
from shopsimrl.testbed.shop import create_app as create_shop_app
from shopsimrl.training.rollout import EpisodeRollout, TrainingRollouts
from shopsimrl.training.samples import SampleStatus
from shopsimrl.training.token_model import TokenModel, TokenModelSettings
from tests.training.invariants import assert_episode_samples

pytestmark = pytest.mark.slow

TRAIN_IDS = json.loads((Path(__file__).resolve().parents[2] / "configs/splits/persona_splits.v1.json").read_text())["splits"][
    "train"
]["task_ids"]
TRAINING_KEYS = ("loss_mask", "rollout_log_probs", "output_ids", "input_ids", "response_length", "rollout_id")


async def _no_wait(seconds: float) -> None:
    """Backoff waits are skipped: the attempts, not the time between them, are under test."""


@contextmanager
def _services(slots: int, **policy: Any) -> Iterator[tuple[str, str]]:
    with (
        running_server(create_shop_app(ShopSettings(slots=slots))) as shop,
        running_server(create_policy_app(PolicySettings(token_endpoint=True, **policy))) as model,
    ):
        yield shop, model


async def _roll(
    shop: str, model_url: str, jobs: list[EpisodeJob], *, max_steps: int = 30, **settings: Any
) -> tuple[list[EpisodeRollout], int | None]:
    model = TokenModel(
        TokenModelSettings(base_url=model_url, max_new_tokens=512, temperature=0.6, **settings),
        TestbedChatTokenizer(),
        sleep=_no_wait,
    )
    environment = ShopSimulatorEnvironment(ShopSimulatorSettings(base_url=shop, persona=True))
    rollouts = TrainingRollouts(
        model=model, environment=environment, prompts=PromptBuilder(), skills=NoSkills(), max_steps=max_steps
    )
    gate = asyncio.Semaphore(5)

    async def one(position: int, job: EpisodeJob) -> EpisodeRollout:
        async with gate:
            return await rollouts.run(job, index=position, group_index=position // 4)

    try:
        done = await asyncio.gather(*(one(position, job) for position, job in enumerate(jobs)))
        free = (await environment.slot_usage()).free_slots
    finally:
        await environment.aclose()
        await model.aclose()
    return list(done), free


def _jobs(count: int) -> list[EpisodeJob]:
    # Four samples of each task, as a GRPO group; the seed differs per sample.
    return [EpisodeJob(task_id=TRAIN_IDS[i // 4], sample_id=i % 4, seed=1000 + i, split="train") for i in range(count)]


async def test_twenty_four_training_episodes_give_exact_samples_and_v4_traces() -> None:
    jobs = _jobs(24)
    with _services(slots=8) as (shop, model_url):
        done, free = await _roll(shop, model_url, jobs)
    assert free == 8, "every lease was released"
    assert all(rollout.trace.status == "completed" and rollout.scored for rollout in done)
    forks = 0
    for position, rollout in enumerate(done):
        trace = rollout.trace
        assert trace.episode_id == jobs[position].episode_id
        assert_episode_samples(rollout.samples, rollout.turns)
        assert len(rollout.turns) == len(trace.steps), "one recorded call per engine step"
        final = trace.final
        assert final is not None
        for sample in rollout.samples:
            assert sample.reward["reward"] == final.reward == final.reward_detail["r_strict"]
            assert sample.rollout_id == position and sample.group_index == position // 4
            assert sample.status in (SampleStatus.COMPLETED, SampleStatus.TRUNCATED)
            assert sample.metadata["episode_id"] == trace.episode_id
        assert rollout.trajectory is not None
        forks += rollout.trajectory.forks
        # The trace is the evaluation's v4 record: it round-trips, and holds no training field.
        line = dump_line(trace)
        assert read_trace(json.loads(line)).episode_id == trace.episode_id
        text = line.decode()
        assert not any(f'"{key}"' in text for key in TRAINING_KEYS)
        assert trace.provenance["model"]["provider"] == "sglang_generate_tokens"
    # The tools block at the top of the prompt follows the page: most calls fork the trajectory.
    assert forks > 0
    assert sum(len(r.samples) for r in done) == len(done) + forks


async def test_a_model_that_keeps_failing_gives_abort_placeholders_and_releases_every_lease() -> None:
    jobs = _jobs(4)
    with _services(slots=4, rate_500=1.0) as (shop, model_url):
        done, free = await _roll(shop, model_url, jobs, max_retries=2)
    assert free == 4
    for position, rollout in enumerate(done):
        assert rollout.trace.status == "failed" and rollout.trace.failure_class == "infrastructure"
        (sample,) = rollout.samples
        assert sample.status is SampleStatus.ABORTED and sample.remove_sample and sample.rollout_id == position
        assert_episode_samples(rollout.samples, rollout.turns)


async def test_repair_turns_cut_replies_and_thinking_keep_every_sample_exact() -> None:
    # Replies without a call get the engine's repair turn, cut replies end the episode as
    # generation_length (TRUNCATED), and thinking the template drops forks the next call.
    jobs = _jobs(16)
    with _services(slots=8, reasoning=True, rate_no_tool_call=0.25, rate_length=0.1, fault_seed=11) as (shop, model_url):
        done, free = await _roll(shop, model_url, jobs)
    assert free == 8
    repaired = truncated = 0
    for rollout in done:
        assert rollout.scored, rollout.trace.error
        assert_episode_samples(rollout.samples, rollout.turns)
        trajectory = rollout.trajectory
        assert trajectory is not None
        for position, (turn, step) in enumerate(zip(rollout.turns[:-1], rollout.trace.steps, strict=False)):
            extended = trajectory.reused_prefix_tokens[position + 1] == len(turn.prompt_ids) + len(turn.output_ids)
            # A plain-text reply (no thinking) is re-rendered as sampled, and its repair turn
            # offers the same page: the next prompt extends it. A reply that thought does not.
            thought = "<think>" in TestbedChatTokenizer().decode(turn.output_ids)
            assert extended is not thought, (rollout.trace.episode_id, step.step_index)
            repaired += step.protocol_error is not None and extended
        truncated += rollout.samples[0].status is SampleStatus.TRUNCATED
        if rollout.samples[0].status is SampleStatus.TRUNCATED:
            assert rollout.turns[-1].finish_type == "length"
            assert rollout.trace.steps[-1].policy_failure is not None
    assert repaired > 0 and truncated > 0, "the seeded faults produced repair turns and cut replies"


async def test_the_action_limit_ends_a_scored_episode_never_an_abort() -> None:
    # Running out of actions is the policy's failure: a zero reward the trainer learns from, with
    # every sampled call kept, and never the abort placeholder a technical failure gets.
    jobs = _jobs(4)
    with _services(slots=4) as (shop, model_url):
        done, free = await _roll(shop, model_url, jobs, max_steps=2)
    assert free == 4, "every lease was released"
    for rollout in done:
        trace = rollout.trace
        assert trace.status == "completed" and len(trace.steps) == 2 and rollout.scored
        assert trace.final is not None and trace.final.termination_reason == "action_limit"
        assert_episode_samples(rollout.samples, rollout.turns)
        for sample in rollout.samples:
            assert sample.status is SampleStatus.COMPLETED and not sample.remove_sample
            assert sample.reward["reward"] == sample.reward["r_success"] == 0.0
            assert sample.metadata["scored"] is True
