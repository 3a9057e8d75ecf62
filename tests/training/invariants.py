"""The invariants every training sample must hold, checked against the calls it came from."""

from __future__ import annotations

import math
from collections.abc import Sequence

from shopsimrl.training.samples import Sample, SampleStatus, check_siblings
from shopsimrl.training.token_model import TurnRecord


def assert_sample_matches_calls(sample: Sample, turns: Sequence[TurnRecord]) -> None:
    """``sample`` holds each call it trains exactly as sent and sampled: the ids before the call's
    sampled ids are that call's whole prompt, the sampled ids follow with mask 1 and their
    log-probs, and every other response position has mask 0 (template, tool result, observation)."""
    sample.check()
    if sample.status is SampleStatus.ABORTED:
        assert sample.remove_sample and not any(sample.loss_mask)
        return
    by_step = {turn.step_index: turn for turn in turns}
    prompt_length = sample.prompt_length
    expected_mask = [0] * sample.response_length
    for step in sample.metadata["trained_steps"]:
        turn = by_step[step]
        start = len(turn.prompt_ids)
        assert sample.tokens[:start] == turn.prompt_ids, f"call {step}: the ids before its reply are not its prompt"
        assert sample.tokens[start : start + len(turn.output_ids)] == turn.output_ids, f"call {step}: sampled ids differ"
        assert start >= prompt_length, f"call {step}: its reply lies in the sample's prompt"
        for offset, value in enumerate(turn.output_log_probs):
            position = start - prompt_length + offset
            expected_mask[position] = 1
            assert sample.rollout_log_probs[position] == value, f"call {step}: log-prob {offset} is not aligned"
            assert math.isfinite(value)
    assert sample.loss_mask == expected_mask, "mask 1 exactly on the sampled ids, 0 elsewhere"
    assert all(value == 0.0 for value, bit in zip(sample.rollout_log_probs, sample.loss_mask, strict=True) if bit == 0)


def assert_episode_samples(samples: Sequence[Sample], turns: Sequence[TurnRecord]) -> None:
    """Each sample matches its calls; siblings share rollout id, reward and status; every sampled
    call is trained exactly once across the siblings."""
    check_siblings(samples)
    for sample in samples:
        assert_sample_matches_calls(sample, turns)
    if samples[0].status is not SampleStatus.ABORTED:
        trained = [step for sample in samples for step in sample.metadata["trained_steps"]]
        assert trained == [turn.step_index for turn in turns if turn.output_ids], "each sampled call trained once, in order"
