"""The dynamic-sampling filter and the GRPO normaliser against hand-computed values."""

from __future__ import annotations

import random
import struct
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

from shopsimrl.config import ConfigError
from shopsimrl.research.training import grpo_advantages
from shopsimrl.training.config import FilterSection
from shopsimrl.training.grpo import (
    FilterDecision,
    GroupFilter,
    TrainingStalledError,
    fully_scored_group_filter,
    normalize_grpo_advantages,
)
from tests.training.slime_contract import ContractSample

ARGS = SimpleNamespace(reward_key="reward", rollout_top_p=1.0, rollout_top_k=-1, grpo_std_normalization=True)
Status = ContractSample.Status


def _sample(group: int, rollout: int, reward: float, *, sibling: int = 0, aborted: bool = False) -> ContractSample:
    return ContractSample(
        group_index=group,
        index=rollout,
        rollout_id=rollout,
        reward={"reward": reward, "r_strict": reward, "r_success": float(reward == 1.0)},
        status=Status.ABORTED if aborted else Status.COMPLETED,
        remove_sample=aborted,
        metadata={"scored": not aborted, "sibling": sibling},
    )


def _episode(group: int, rollout: int, reward: float, siblings: int = 1, aborted: bool = False) -> list[ContractSample]:
    """What the custom-generate function returns for one sample: its siblings."""
    return [_sample(group, rollout, reward, sibling=s, aborted=aborted) for s in range(siblings)]


def test_normaliser_matches_hand_computed_advantages_and_broadcasts_to_siblings() -> None:
    samples = [
        # group 0: rewards 1, 0, 0, 1 over four rollouts; rollout 1 forked into 2 samples, rollout 3 into 3.
        *_episode(0, 0, 1.0),
        *_episode(0, 1, 0.0, siblings=2),
        *_episode(0, 2, 0.0),
        *_episode(0, 3, 1.0, siblings=3),
        # group 1: 0.2, 0.2, 0.8: mean 0.4, unbiased std sqrt(0.12).
        *_episode(1, 10, 0.2),
        *_episode(1, 11, 0.2),
        *_episode(1, 12, 0.8, siblings=2),
        # group 2: one rollout: nothing to compare with.
        *_episode(2, 20, 1.0),
        # group 3: an abort placeholder counts in no group; the two others give 1 and 0.
        *_episode(3, 30, 0.0, aborted=True),
        *_episode(3, 31, 1.0),
        *_episode(3, 32, 0.0),
    ]
    raw, advantages = normalize_grpo_advantages(ARGS, samples)
    assert raw == [s.reward["reward"] for s in samples]  # type: ignore[index]
    a0, a1, a1_up, a3 = 0.8660239037870368, -0.5773486025277704, 1.1546972050555409, 0.7071057811879616
    expected = [
        *[a0],
        *[-a0] * 2,
        *[-a0],
        *[a0] * 3,
        *[a1, a1],
        *[a1_up] * 2,
        0.0,
        0.0,
        a3,
        -a3,
    ]
    assert advantages == pytest.approx(expected, rel=1e-6, abs=1e-7)
    # float32, as slime's reward tensor holds them
    assert all(value == struct.unpack("f", struct.pack("f", value))[0] for value in advantages)

    centred = normalize_grpo_advantages(SimpleNamespace(**{**vars(ARGS), "grpo_std_normalization": False}), samples)[1]
    assert centred[:7] == pytest.approx([0.5, -0.5, -0.5, -0.5, 0.5, 0.5, 0.5], rel=1e-6)
    assert centred[7:11] == pytest.approx([-0.2, -0.2, 0.4, 0.4], rel=1e-6)


def test_normaliser_equals_grpo_advantages_within_float32_over_seeded_groups() -> None:
    rng = random.Random(7)
    for trial in range(300):
        samples: list[ContractSample] = []
        records: list[dict[str, Any]] = []
        rollout = 0
        for group in range(rng.randint(1, 6)):
            for _ in range(rng.randint(1, 8)):
                reward = rng.choice([0.0, 1.0, rng.random(), round(rng.random(), 1)])
                samples += _episode(group, rollout, reward, siblings=rng.randint(1, 4))
                records.append({"episode_id": str(rollout), "group": group, "reward": reward})
                rollout += 1
        rng.shuffle(samples)  # slime's flat list need not keep a group's samples together
        _, advantages = normalize_grpo_advantages(ARGS, samples)
        reference = grpo_advantages(records)
        for sample, value in zip(samples, advantages, strict=True):
            assert value == pytest.approx(reference[str(sample.rollout_id)], rel=2e-7, abs=1e-6), trial


def test_normaliser_refuses_siblings_with_two_rewards_truncated_sampling_and_missing_groups() -> None:
    with pytest.raises(ValueError, match="siblings of rollout 1 disagree"):
        normalize_grpo_advantages(ARGS, [_sample(0, 1, 1.0), _sample(0, 1, 0.0, sibling=1), _sample(0, 2, 0.0)])
    with pytest.raises(ConfigError, match=r"--rollout-top-p must be 1\.0"):
        normalize_grpo_advantages(SimpleNamespace(**{**vars(ARGS), "rollout_top_p": 0.95}), [_sample(0, 1, 1.0)])
    with pytest.raises(ConfigError, match="--rollout-top-k must be -1"):
        GroupFilter()(SimpleNamespace(**{**vars(ARGS), "rollout_top_k": 50}), [_episode(0, 1, 1.0)])
    orphan = _sample(0, 1, 1.0)
    orphan.group_index = None
    with pytest.raises(ValueError, match="sample 1 has no group_index"):
        normalize_grpo_advantages(ARGS, [orphan])


def test_filter_drops_unscored_and_spreadless_groups_and_stops_after_n_unscored_in_a_row() -> None:
    decide = GroupFilter(FilterSection(max_consecutive_unscored_groups=3))
    spread = [_episode(0, 0, 1.0, siblings=2), _episode(0, 1, 0.0)]
    assert decide(ARGS, spread) == FilterDecision(keep=True)
    # Siblings count once: two samples of reward 1 and one of 1 is no spread at all.
    flat = [*_episode(1, 2, 1.0, siblings=2), *_episode(1, 3, 1.0)]
    assert decide(ARGS, flat) == FilterDecision(False, "shopsim_zero_std_group", keep_when_insufficient=True)
    # Spread no larger than filter.reward_spread is none.
    assert not decide(ARGS, [_episode(2, 4, 0.5), _episode(2, 5, 0.5 + 1e-7)]).keep

    unscored = [_episode(3, 6, 1.0), _episode(3, 7, 0.0, aborted=True)]
    first = decide(ARGS, unscored)
    assert first == FilterDecision(False, "shopsim_unscored_technical_group", keep_when_insufficient=False)
    assert not decide(ARGS, unscored).keep and decide.consecutive_unscored == 2
    assert decide(ARGS, spread).keep and decide.consecutive_unscored == 0, "a scored group ends the run"
    decide(ARGS, unscored)
    decide(ARGS, unscored)
    with pytest.raises(TrainingStalledError, match="3 groups in a row had an unscored sample"):
        decide(ARGS, unscored)
    # A sample with no reward is unscored too, whatever its status says.
    missing = _sample(4, 8, 1.0)
    missing.reward = None
    assert GroupFilter()(ARGS, [[missing], _episode(4, 9, 0.0)]).reason == "shopsim_unscored_technical_group"


def test_the_slime_filter_takes_its_settings_from_the_training_config(tmp_path: Path) -> None:
    config = tmp_path / "training.yaml"
    config.write_text("tasks: {split_file: s.json}\nfilter: {max_consecutive_unscored_groups: 2}\n")
    args = SimpleNamespace(**{**vars(ARGS), "shopsim_training_config": str(config)})
    unscored = [_episode(0, 0, 1.0, aborted=True), _episode(0, 1, 0.0)]
    assert fully_scored_group_filter(args, unscored).reason == "shopsim_unscored_technical_group"
    with pytest.raises(TrainingStalledError, match="is 2"):
        fully_scored_group_filter(args, unscored)
