"""slime's custom-generate entry point, called as slime calls it, against the testbed over HTTP.

slime itself (torch, Ray) is not installed here: its ``Sample`` is the field contract of
``tests/training/slime_contract.py``, put where the adapter's converter imports it from.
"""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import pytest

from shopsimrl.config import ConfigError
from shopsimrl.model import ModelConfigError
from shopsimrl.planning import episode_seed
from shopsimrl.storage.reading import open_run
from shopsimrl.testbed.policy import PolicySettings
from shopsimrl.testbed.policy import create_app as create_policy_app
from shopsimrl.testbed.serving import running_server
from shopsimrl.testbed.shop import ShopSettings
from shopsimrl.testbed.shop import create_app as create_shop_app
from shopsimrl.training import slime_adapter
from shopsimrl.training.config import CONFIG_ENV, config_path, load_training_config
from shopsimrl.training.grpo import TrainingStalledError, fully_scored_group_filter, normalize_grpo_advantages
from shopsimrl.training.samples import Sample
from shopsimrl.training.store import read_training_samples
from tests.training.slime_contract import ContractSample, installed

REPO = Path(__file__).resolve().parents[2]
SPLITS = REPO / "configs/splits/persona_splits.v1.json"
TRAIN_IDS: list[int] = json.loads(SPLITS.read_text())["splits"]["train"]["task_ids"]
TEST_IDS: list[int] = json.loads(SPLITS.read_text())["splits"]["test"]["task_ids"]
PARAMS: dict[str, Any] = {
    # What slime's GenerateState builds from --rollout-* flags.
    "temperature": 0.6,
    "top_p": 1.0,
    "top_k": -1,
    "max_new_tokens": 512,
    "stop": None,
    "stop_token_ids": None,
    "skip_special_tokens": False,
    "no_stop_trim": True,
    "spaces_between_special_tokens": False,
}


@contextmanager
def _services(slots: int, **policy: Any) -> Iterator[tuple[str, str]]:
    with (
        running_server(create_shop_app(ShopSettings(slots=slots))) as shop,
        running_server(create_policy_app(PolicySettings(token_endpoint=True, **policy))) as model,
    ):
        yield shop, model


def _config(tmp_path: Path, shop: str, *, model_retries: int = 5, extra: str = "") -> Path:
    path = tmp_path / "training.yaml"
    path.write_text(
        f"run: {{name: round-001, output_dir: {tmp_path / 'runs'}, concurrency: 4}}\n"
        f"tasks: {{split_file: {SPLITS}, split: train}}\n"
        f"environment: {{base_url: '{shop}', persona: true}}\n"
        f"model: {{name: testbed-policy, max_retries: {model_retries}, retry_backoff_seconds: 0.0}}\n" + extra
    )
    return path


def _args(config: Path, model_url: str, **more: Any) -> SimpleNamespace:
    router = urlsplit(model_url)
    values: dict[str, Any] = {
        "shopsim_training_config": str(config),
        "sglang_router_ip": router.hostname,
        "sglang_router_port": router.port,
        "partial_rollout": False,
        "group_rm": False,
        "n_samples_per_prompt": 4,
    }
    return SimpleNamespace(**{**values, **more})


def _group(task_id: int, group_index: int, n: int) -> list[ContractSample]:
    # As slime's data source hands them out: the prompt is the task data's, metadata its metadata.
    return [
        ContractSample(
            group_index=group_index,
            index=group_index * n + i,
            prompt=str(task_id),
            label="kept",
            metadata={"task_id": task_id, "split": "train"},
        )
        for i in range(n)
    ]


async def _generate_groups(args: SimpleNamespace, groups: list[list[ContractSample]]) -> list[list[list[ContractSample]]]:
    # slime's generate_and_rm_group: every sample of a group at once, each with its own params copy.
    try:
        return [
            list(
                await asyncio.gather(
                    # With deterministic inference slime adds rollout_seed + position: equal across groups.
                    *(
                        slime_adapter.generate(args, s, {**PARAMS, "sampling_seed": 1234 + i}, evaluation=False)
                        for i, s in enumerate(group)
                    )
                )
            )
            for group in groups
        ]
    finally:
        await slime_adapter.close_workers()


@pytest.mark.slow
async def test_generate_returns_slime_samples_per_episode_with_siblings_sharing_the_rollout_id(tmp_path: Path) -> None:
    with _services(slots=4) as (shop, model_url), installed():
        args = _args(_config(tmp_path, shop), model_url)
        groups = [_group(TRAIN_IDS[g], g, 4) for g in range(3)]
        out = await _generate_groups(args, groups)
    run_dir = load_training_config(args.shopsim_training_config).run_dir
    stored = read_training_samples(run_dir)
    assert stored.missing == [] and len(stored.records) == 12
    # Episode seeds are the run's (seed, task, slime's index), not slime's sampling_seed.
    config = load_training_config(args.shopsim_training_config)
    seeds = {record.episode_id: record.job.seed for record in open_run(run_dir).records()}
    for group in groups:
        for base in group:
            episode = f"task-{base.metadata['task_id']:06d}__sample-{base.index:03d}"
            assert seeds[episode] == episode_seed(config.run.seed, base.metadata["task_id"], base.index)
    assert len(set(seeds.values())) == 12
    forked = 0
    for group, results in zip(groups, out, strict=True):
        for base, returned in zip(group, results, strict=True):
            assert returned and all(isinstance(s, ContractSample) for s in returned)
            assert all(s is not base for s in returned), "copies of the sample slime handed in"
            line = stored.records[(f"task-{base.metadata['task_id']:06d}__sample-{base.index:03d}", 1)]
            expected = [Sample.from_dict(item) for item in line["samples"]]
            assert len(returned) == len(expected)
            forked += len(returned) > 1
            for got, want in zip(returned, expected, strict=True):
                assert got.tokens == want.tokens and got.loss_mask == want.loss_mask
                assert got.rollout_log_probs == want.rollout_log_probs
                assert got.response_length == want.response_length == len(got.loss_mask)
                assert got.rollout_id == base.index and got.index == base.index and got.group_index == base.group_index
                assert got.status is ContractSample.Status.COMPLETED and not got.remove_sample
                assert isinstance(got.reward, dict) and set(got.reward) >= {"reward", "r_strict", "r_success"}
                assert got.reward == returned[0].reward
                assert got.prompt == base.prompt and got.label == "kept"
                assert got.metadata["task_id"] == base.metadata["task_id"] and got.metadata["episode_id"] == line["episode_id"]
    assert forked > 0, "the testbed's page-following tools block forks trajectories into siblings"

    # slime's next steps on these groups: the filter per group, then the normaliser on the flat list.
    filter_args = SimpleNamespace(**vars(args), reward_key="reward", rollout_top_p=1.0, rollout_top_k=-1)
    for results in out:
        decision = fully_scored_group_filter(filter_args, results)
        spread = len({episode[0].reward["reward"] for episode in results}) > 1
        assert decision.keep is spread and (decision.reason is None) is spread
    flat = [sample for results in out for episode in results for sample in episode]
    raw, advantages = normalize_grpo_advantages(filter_args, flat)
    assert raw == [sample.reward["reward"] for sample in flat]
    by_rollout: dict[int, set[float]] = {}
    for sample, value in zip(flat, advantages, strict=True):
        by_rollout.setdefault(sample.rollout_id, set()).add(value)
    assert len(by_rollout) == 12 and all(len(values) == 1 for values in by_rollout.values()), "siblings share one"


@pytest.mark.slow
async def test_a_failing_model_gives_abort_placeholders_that_slime_removes(tmp_path: Path) -> None:
    with _services(slots=2, rate_500=1.0) as (shop, model_url), installed():
        args = _args(_config(tmp_path, shop, model_retries=2), model_url)
        (results,) = await _generate_groups(args, [_group(TRAIN_IDS[0], 0, 4)])
    for position, returned in enumerate(results):
        (placeholder,) = returned
        assert placeholder.status is ContractSample.Status.ABORTED and placeholder.remove_sample
        assert placeholder.loss_mask == [0] and placeholder.response_length == 1
        assert placeholder.rollout_id == position and placeholder.metadata["scored"] is False


@pytest.mark.slow
async def test_a_killed_shop_gives_placeholders_that_the_filter_drops_then_stops_on(tmp_path: Path) -> None:
    # The shop serves the first group, then is stopped; the worker (and its connections) live on,
    # as in slime's rollout process when the shop's pod dies.
    with running_server(create_policy_app(PolicySettings(token_endpoint=True))) as model_url, installed():
        shop_context = running_server(create_shop_app(ShopSettings(slots=4)))
        shop = shop_context.__enter__()
        config = _config(tmp_path, shop, extra="filter: {max_consecutive_unscored_groups: 2}\n")
        config.write_text(config.read_text().replace("persona: true}", "persona: true, max_retries: 1}"))
        args = SimpleNamespace(**vars(_args(config, model_url)), reward_key="reward")
        try:
            first = await asyncio.gather(*(slime_adapter.generate(args, s, dict(PARAMS)) for s in _group(TRAIN_IDS[0], 0, 4)))
            shop_context.__exit__(None, None, None)
            later = [
                await asyncio.gather(*(slime_adapter.generate(args, s, dict(PARAMS)) for s in _group(TRAIN_IDS[g], g, 4)))
                for g in (1, 2)
            ]
        finally:
            await slime_adapter.close_workers()
    assert all(episode[0].status is ContractSample.Status.COMPLETED for episode in first)
    for group in later:
        for episode in group:
            (placeholder,) = episode
            assert placeholder.status is ContractSample.Status.ABORTED and placeholder.remove_sample
            assert placeholder.metadata["failure_class"] == "infrastructure"
    first_decision = fully_scored_group_filter(args, list(first))
    assert first_decision.reason in (None, "shopsim_zero_std_group")
    assert fully_scored_group_filter(args, list(later[0])).reason == "shopsim_unscored_technical_group"
    with pytest.raises(TrainingStalledError, match="2 groups in a row"):
        fully_scored_group_filter(args, list(later[1]))
    # Every rollout left its trace, the failed ones too.
    stored = read_training_samples(load_training_config(config).run_dir)
    assert stored.missing == [] and len(stored.records) == 12
    assert sum(line["scored"] for line in stored.records.values()) == 4


@pytest.mark.slow
@pytest.mark.parametrize(
    ("change", "error", "words"),
    [
        ({"evaluation": True}, ConfigError, "training rollouts only"),
        ({"args": {"partial_rollout": True}}, ConfigError, "--partial-rollout"),
        ({"args": {"group_rm": True}}, ConfigError, "--group-rm"),
        ({"params": {"top_p": 0.9}}, ModelConfigError, "'top_p' must be 1.0"),
        ({"params": {"top_k": 20}}, ModelConfigError, "'top_k' must be -1"),
        ({"params": {"max_new_tokens": None}}, ModelConfigError, "max_new_tokens"),
        ({"sample": {"metadata": {}, "prompt": "find me shoes"}}, ConfigError, "no task id"),
        ({"sample": {"metadata": {"task_id": TEST_IDS[0]}}}, ConfigError, "is not in split 'train'"),
    ],
)
async def test_what_cannot_be_trained_on_is_refused_naming_it(
    tmp_path: Path, change: dict[str, Any], error: type[Exception], words: str
) -> None:
    with _services(slots=1) as (shop, model_url), installed():
        args = _args(_config(tmp_path, shop), model_url, **change.get("args", {}))
        sample = _group(TRAIN_IDS[0], 0, 1)[0]
        for key, value in change.get("sample", {}).items():
            setattr(sample, key, value)
        try:
            with pytest.raises(error, match=words):
                await slime_adapter.generate(
                    args, sample, {**PARAMS, **change.get("params", {})}, evaluation=change.get("evaluation", False)
                )
        finally:
            await slime_adapter.close_workers()
    assert sample.status is ContractSample.Status.PENDING, "the sample slime handed in is left alone"


def test_the_config_is_found_through_slime_args_or_the_environment(tmp_path: Path) -> None:
    a, b = tmp_path / "a.yaml", tmp_path / "b.yaml"
    assert config_path(SimpleNamespace(shopsim_training_config=str(a)), {}) == a
    assert config_path(SimpleNamespace(), {CONFIG_ENV: str(b)}) == b
    assert config_path(SimpleNamespace(shopsim_training_config=str(a)), {CONFIG_ENV: str(a)}) == a
    with pytest.raises(ConfigError, match="name different configs"):
        config_path(SimpleNamespace(shopsim_training_config=str(a)), {CONFIG_ENV: str(b)})
    with pytest.raises(ConfigError, match=f"shopsim_training_config.*{CONFIG_ENV}"):
        config_path(SimpleNamespace(), {})


@pytest.mark.parametrize(
    ("text", "words"),
    [
        ("tasks: {split_file: s.json}\nrun: {concurency: 3}\n", r"run\.concurency: unknown key"),
        ("tasks: {split_file: s.json}\nrun: {concurrency: true}\n", r"run\.concurrency"),
        ("run: {seed: 1}\n", r"tasks: required key is missing"),
        ("tasks: {split_file: s.json}\nmodel: {base_url: 'http://u:p@host:1'}\n", r"model\.base_url: .*credentials"),
        ("tasks: {split_file: s.json}\nfilter: {max_consecutive_unscored_groups: 0}\n", r"filter\.max_consecutive"),
        ("tasks: [\n", r"not valid YAML at line"),
    ],
)
def test_a_bad_training_config_is_refused_naming_the_key(tmp_path: Path, text: str, words: str) -> None:
    path = tmp_path / "training.yaml"
    path.write_text(text)
    with pytest.raises(ConfigError, match=words) as caught:
        load_training_config(path)
    assert str(path) in str(caught.value)
    assert "u:p" not in str(caught.value)


@pytest.mark.slow
def test_the_adapter_imports_without_slime() -> None:
    code = (
        "import sys, shopsimrl.training.slime_adapter as a, shopsimrl.training.grpo as g; "
        "assert not any(m == 'slime' or m.startswith('slime.') for m in sys.modules), 'slime imported'; "
        "import inspect; "
        "assert inspect.iscoroutinefunction(a.generate); "
        "assert list(inspect.signature(a.generate).parameters)[:4] == ['args', 'sample', 'sampling_params', 'evaluation']; "
        "assert list(inspect.signature(g.fully_scored_group_filter).parameters) == ['args', 'samples', 'kwargs']; "
        "assert list(inspect.signature(g.normalize_grpo_advantages).parameters) == ['args', 'samples']"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 0, done.stderr
