"""The ``rollout/shopsim/*`` metrics through slime's two hooks, against hand-computed values, then
end to end through slime's custom-generate entry point on the testbed."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from structlog.testing import capture_logs

from shopsimrl.skills import JsonSkillBank, SkillProvider
from shopsimrl.storage.local import atomic_write_json
from shopsimrl.training import slime_adapter
from shopsimrl.training.grpo import fully_scored_group_filter
from shopsimrl.training.metrics import (
    PREFIX,
    enrich_rollout_metrics,
    record_generated_rollout_groups,
    rollout_metrics,
    summarize_groups,
)
from shopsimrl.training.samples import (
    CURRICULUM,
)
from shopsimrl.training.store import read_training_samples
from shopsimrl.training.triage import INTERNALIZATION_DEFICIT, PENDING_ANALYSIS, TRIAGE_SCHEMA_VERSION, triage_path
from shopsimrl.training.worker import TrainingWorker
from tests.training.slime_contract import ContractSample, installed
from tests.training.test_slime_adapter import PARAMS, _args
from tests.training.test_triage import DEFICIT, FRONTIERLESS, PENDING, N, _bank, _services

Status = ContractSample.Status
RHO = {"c1": 0.9, "c2": 0.5, "c3": 0.2}


def _config(tmp_path: Path) -> Path:
    splits = Path(__file__).resolve().parents[2] / "configs/splits/persona_splits.v1.json"
    path = tmp_path / "training.yaml"
    path.write_text(f"run: {{name: r, output_dir: {tmp_path / 'runs'}}}\ntasks: {{split_file: {splits}}}\n")
    return path


def _draw(mode: str, chunks: list[str]) -> dict[str, Any]:
    return {
        CURRICULUM: {"state_id": "0cc2608d", "group_key": "0", "mode": mode, "skill_ids": chunks, "q": 0.2, "rho": dict(RHO)},
    }


def _episode(
    group: int, rollout: int, reward: float, success: float, draw: dict[str, Any], *, siblings: int = 1, aborted: bool = False
) -> list[ContractSample]:
    """What the custom-generate function returns for one sample: its siblings."""
    return [
        ContractSample(
            group_index=group,
            index=rollout,
            rollout_id=rollout,
            reward={"reward": 0.0, "r_strict": 0.0, "r_success": 0.0}
            if aborted
            else {"reward": reward, "r_strict": reward, "r_success": success},
            status=Status.ABORTED if aborted else Status.COMPLETED,
            remove_sample=aborted,
            metadata={"scored": not aborted, "sibling": s, **draw},
        )
        for s in range(siblings)
    ]


def _triage(run_dir: Path, group: int, classification: str, *, all_wrong: bool, diagnostic: dict[str, Any] | None) -> None:
    atomic_write_json(
        triage_path(run_dir, group),
        {
            "schema_version": TRIAGE_SCHEMA_VERSION,
            "group_index": group,
            "classification": classification,
            "all_wrong": all_wrong,
            "diagnostic": diagnostic,
        },
    )


def _slime_step(args: Any, groups: list[list[list[ContractSample]]], target: int) -> tuple[list[Any], dict[str, int]]:
    """slime's generate_rollout_async over finished groups (624b824): the dynamic filter per group,
    ``should_drop_dynamic_filter_output`` with ``remaining_batch_size``, its MetricGatherer counts;
    the trained groups, flattened as RolloutManager hands them to the log function."""
    remaining = len(groups)
    data: list[list[list[ContractSample]]] = []
    gathered: dict[str, int] = {}
    for group in groups:
        output = fully_scored_group_filter(args, group)
        drop = not output.keep and not (output.keep_when_insufficient and remaining <= target)
        if drop:
            gathered[f"rollout/dynamic_filter/drop_{output.reason}"] = (
                gathered.get(f"rollout/dynamic_filter/drop_{output.reason}", 0) + 1
            )
            remaining -= 1
            continue
        if len(data) < target:
            data.append(group)
    return [sample for group in data for episode in group for sample in episode], gathered


def test_metrics_match_hand_computed_values(tmp_path: Path) -> None:
    args = SimpleNamespace(
        shopsim_training_config=str(_config(tmp_path)), reward_key="reward", rollout_top_p=1.0, rollout_top_k=-1
    )
    run_dir = tmp_path / "runs" / "r"
    groups = [
        # group 10, assisted c1+c2: rollout 20 succeeded (forked into 2 samples), rollout 21 scored 0.5.
        [
            _episode(10, 20, 1.0, 1.0, _draw("assisted", ["c1", "c2"]), siblings=2),
            _episode(10, 21, 0.5, 0.0, _draw("assisted", ["c1", "c2"])),
        ],
        # group 11, skill_free: both 0 (no spread; slime keeps it: too few groups remain).
        [_episode(11, 22, 0.0, 0.0, _draw("skill_free", [])), _episode(11, 23, 0.0, 0.0, _draw("skill_free", []))],
        # group 12, assisted_empty: an abort placeholder and a 0 (dropped: technical).
        [
            _episode(12, 24, 0.0, 0.0, _draw("assisted_empty", []), aborted=True),
            _episode(12, 25, 0.0, 0.0, _draw("assisted_empty", [])),
        ],
        # group 13, assisted c1: both 0, dropped (no spread) while enough groups remained.
        [_episode(13, 26, 0.0, 0.0, _draw("assisted", ["c1"])), _episode(13, 27, 0.0, 0.0, _draw("assisted", ["c1"]))],
    ]
    # slime meets them in the order 13, 12, 11, 10 with a target of 2 groups: 13 is dropped (4
    # remain), 12 too (technical), 11 is kept (2 remain, not more than the target), 10 is kept.
    trained, gathered = _slime_step(args, groups[::-1], target=2)
    assert gathered == {
        "rollout/dynamic_filter/drop_shopsim_zero_std_group": 1,
        "rollout/dynamic_filter/drop_shopsim_unscored_technical_group": 1,
    }
    _triage(run_dir, 10, "not_frontier", all_wrong=False, diagnostic=None)
    _triage(run_dir, 12, "environment_or_runtime_error", all_wrong=False, diagnostic=None)
    _triage(run_dir, 13, INTERNALIZATION_DEFICIT, all_wrong=True, diagnostic={"succeeded": True})
    _triage(run_dir, 99, PENDING_ANALYSIS, all_wrong=True, diagnostic={"succeeded": False})  # another step's
    record_generated_rollout_groups(args, groups, None)
    extra: dict[str, Any] = dict(gathered)
    assert enrich_rollout_metrics(5, args, trained, extra, 12.5) is False, "slime goes on with its own logging"
    got = {key.removeprefix(PREFIX): value for key, value in extra.items() if key.startswith(PREFIX)}
    assert {key: value for key, value in extra.items() if not key.startswith(PREFIX)} == gathered, "slime's own kept"
    assert got == pytest.approx(
        {
            "trajectory_count": 8.0,  # 9 samples: rollout 20's siblings count once
            "group_count": 4.0,
            "train_trajectory_count": 4.0,
            "train_group_count": 2.0,
            "scored_rate": 7 / 8,
            "reward_mean": 1.5 / 7,
            "strict_reward_mean": 1.5 / 7,
            "success_rate": 1 / 7,
            "q": 0.2,
            "rho_min": 0.2,
            "rho_mean": 1.6 / 3,
            "rho_max": 0.9,
            "skill_free_group_rate": 0.25,
            "assisted_empty_group_rate": 0.25,
            "skills_per_assisted_group_mean": 1.0,  # (2 + 0 + 1) / 3 groups not skill_free
            "chunk/c1/inclusion_rate": 2 / 3,
            "chunk/c2/inclusion_rate": 1 / 3,
            "chunk/c3/inclusion_rate": 0.0,
            "chunk/c1/target_rho": 0.9,
            "chunk/c2/target_rho": 0.5,
            "chunk/c3/target_rho": 0.2,
            "triage_group_count": 3.0,  # group 11 has no record, group 99 is not this step's
            "all_wrong_group_rate": 1 / 3,
            "full_skill_retry_rate": 1 / 3,
            "full_skill_retry_success_rate": 1.0,
            "internalization_deficit_rate": 1 / 3,
            "pending_analysis_rate": 0.0,
            "runtime_error_group_rate": 1 / 3,
            "technical_group_drop_count": 1.0,
            "technical_group_drop_rate": 0.25,  # 1 / (2 trained + 2 dropped)
            "zero_std_group_drop_count": 1.0,
            "zero_std_group_drop_rate": 0.25,
        },
        rel=1e-12,
    )
    assert all(type(value) is float for value in got.values())

    # The next step starts afresh: its own groups and filter answers only.
    next_step = [[_episode(14, 28, 1.0, 1.0, {}), _episode(14, 29, 0.0, 0.0, {})]]
    trained, gathered = _slime_step(args, next_step, target=1)
    record_generated_rollout_groups(args, next_step, None)
    extra = {}
    enrich_rollout_metrics(6, args, trained, extra, 1.0)
    assert extra[PREFIX + "group_count"] == 1.0 and extra[PREFIX + "technical_group_drop_count"] == 0.0
    assert extra[PREFIX + "zero_std_group_drop_rate"] == 0.0 and extra[PREFIX + "triage_group_count"] == 0.0
    # Without a curriculum draw and without a triaged group, those figures are left out, not 0.
    assert not any(key.startswith((PREFIX + "q", PREFIX + "rho", PREFIX + "chunk/", PREFIX + "all_wrong")) for key in extra)


def test_without_the_all_samples_hook_only_trained_counts_and_drops_are_given(tmp_path: Path) -> None:
    args = SimpleNamespace(
        shopsim_training_config=str(_config(tmp_path)), reward_key="reward", rollout_top_p=1.0, rollout_top_k=-1
    )
    groups = [
        [_episode(1, 2, 1.0, 1.0, {}, siblings=3), _episode(1, 3, 0.0, 0.0, {})],
        [_episode(2, 4, 0.0, 0.0, {}), _episode(2, 5, 0.0, 0.0, {})],
    ]
    trained, _ = _slime_step(args, groups, target=1)
    extra: dict[str, Any] = {}
    with capture_logs() as logs:
        enrich_rollout_metrics(0, args, trained, extra, 1.0)
    assert extra == {
        PREFIX + "train_trajectory_count": 2.0,
        PREFIX + "train_group_count": 1.0,
        PREFIX + "technical_group_drop_count": 0.0,
        PREFIX + "technical_group_drop_rate": 0.0,
        PREFIX + "zero_std_group_drop_count": 1.0,
        PREFIX + "zero_std_group_drop_rate": 0.5,
    }
    assert any("--rollout-all-samples-process-path" in str(entry.get("hint")) for entry in logs)
    # slime without a metric dict (its debug replay): the figures have nowhere to go, nothing breaks.
    assert enrich_rollout_metrics(1, args, trained, None, 1.0) is False


@pytest.mark.slow
async def test_metrics_and_triage_end_to_end_through_slimes_entry_point(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Three groups through ``generate`` as slime calls it, samples skill-free, the diagnostic with
    the chunk (``full_skills()``, the curriculum's every chunk, stands in as the bank here); the
    curriculum draw in the metadata slime hands in, as the curriculum's data source will."""
    bank = JsonSkillBank(_bank(tmp_path))

    def full_skills(self: TrainingWorker) -> SkillProvider:
        return bank

    monkeypatch.setattr(TrainingWorker, "full_skills", full_skills)
    plan = [
        (DEFICIT[0], _draw("skill_free", [])),
        (PENDING, _draw("assisted_empty", [])),
        (FRONTIERLESS, _draw("assisted", ["c1"])),
    ]
    with _services() as (shop, model_url), installed():
        from tests.training.test_slime_adapter import _config as adapter_config

        config = adapter_config(tmp_path, shop)
        args = SimpleNamespace(**vars(_args(config, model_url)), reward_key="reward", rollout_top_p=1.0, rollout_top_k=-1)
        try:
            groups = [
                list(
                    await asyncio.gather(
                        *(
                            slime_adapter.generate(
                                args,
                                ContractSample(
                                    group_index=group,
                                    index=group * N + i,
                                    prompt=str(task),
                                    metadata={"task_id": task, **draw},
                                ),
                                dict(PARAMS),
                            )
                            for i in range(N)
                        )
                    )
                )
                for (task, group), draw in plan
            ]
        finally:
            await slime_adapter.close_workers()
    run_dir = tmp_path / "runs" / "round-001"
    records = {g: json.loads(triage_path(run_dir, g).read_text()) for g in (0, 1, 2)}
    assert [records[g]["classification"] for g in (0, 1, 2)] == [INTERNALIZATION_DEFICIT, PENDING_ANALYSIS, "not_frontier"]
    assert records[0]["diagnostic"]["skills"] == ["choose-options"]

    trained, gathered = _slime_step(args, groups, target=1)
    record_generated_rollout_groups(args, sorted(groups, key=lambda g: g[0][0].index), None)
    extra: dict[str, Any] = dict(gathered)
    enrich_rollout_metrics(0, args, trained, extra, 3.0)
    got = {key.removeprefix(PREFIX): value for key, value in extra.items() if key.startswith(PREFIX)}

    # Expected values from the run directory (the traces' training lines), not from the samples.
    lines = read_training_samples(run_dir).records.values()
    rewards = [line["samples"][0]["reward"] for line in lines]
    assert len(rewards) == 3 * N and all(line["scored"] for line in lines)
    assert len(trained) > N, "the trained group's episodes forked into siblings, counted once"
    assert got == pytest.approx(
        {
            "trajectory_count": 12.0,
            "group_count": 3.0,
            "train_trajectory_count": 4.0,
            "train_group_count": 1.0,
            "scored_rate": 1.0,
            "reward_mean": sum(r["reward"] for r in rewards) / 12,
            "strict_reward_mean": sum(r["r_strict"] for r in rewards) / 12,
            "success_rate": 1 / 12,
            "q": 0.2,
            "rho_min": 0.2,
            "rho_mean": 1.6 / 3,
            "rho_max": 0.9,
            "skill_free_group_rate": 1 / 3,
            "assisted_empty_group_rate": 1 / 3,
            "skills_per_assisted_group_mean": 0.5,
            "chunk/c1/inclusion_rate": 0.5,
            "chunk/c2/inclusion_rate": 0.0,
            "chunk/c3/inclusion_rate": 0.0,
            "chunk/c1/target_rho": 0.9,
            "chunk/c2/target_rho": 0.5,
            "chunk/c3/target_rho": 0.2,
            "triage_group_count": 3.0,
            "all_wrong_group_rate": 2 / 3,
            "full_skill_retry_rate": 2 / 3,
            "full_skill_retry_success_rate": 0.5,
            "internalization_deficit_rate": 1 / 3,
            "pending_analysis_rate": 1 / 3,
            "runtime_error_group_rate": 0.0,
            "technical_group_drop_count": 0.0,
            "technical_group_drop_rate": 0.0,
            "zero_std_group_drop_count": 2.0,  # groups 0 and 1 (all wrong) while enough remained
            "zero_std_group_drop_rate": 2 / 3,
        },
        rel=1e-9,
    )
    assert gathered == {"rollout/dynamic_filter/drop_shopsim_zero_std_group": 2}, "slime's own count agrees"


def test_the_curriculum_figures_are_the_states_own_values() -> None:
    # The gate demo's one-chunk state (§1.6 of the reference): a plain sum of equal values drifted
    # in the last bits, so the step reported a q and a rho the state does not hold.
    rho = 0.2 + 0.7
    draw = {
        CURRICULUM: {"state_id": "s", "group_key": "0", "mode": "assisted", "skill_ids": ["c1"], "q": 0.2, "rho": {"c1": rho}}
    }
    for groups in (16, 10, 7):
        generated = summarize_groups([_episode(g, g, 1.0, 1.0, draw) for g in range(groups)], "reward")
        got = rollout_metrics(generated=generated, trained={}, triage={}, decisions={})
        assert got[PREFIX + "q"] == 0.2, groups
        for name in ("rho_min", "rho_mean", "rho_max", "chunk/c1/target_rho"):
            assert got[PREFIX + name] == rho == 0.8999999999999999, (groups, name)
    # Unequal values are still averaged.
    other = {CURRICULUM: {**draw[CURRICULUM], "q": 0.4, "rho": {"c1": 0.5}}}
    generated = summarize_groups([_episode(0, 0, 1.0, 1.0, draw), _episode(1, 1, 1.0, 1.0, other)], "reward")
    got = rollout_metrics(generated=generated, trained={}, triage={}, decisions={})
    assert got[PREFIX + "q"] == pytest.approx(0.3) and got[PREFIX + "chunk/c1/target_rho"] == pytest.approx(0.7)
