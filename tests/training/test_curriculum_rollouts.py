"""The curriculum in training rollouts: slime's custom-generate function against the testbed shop
and token endpoint over HTTP, with ``curriculum:`` in the training config. Every sample of a
group gets the skills its ``group_index`` draws, the trace and the sample metadata say which,
and the worker hands out every chunk for a replay of a failed group."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from types import SimpleNamespace
from typing import Any
from urllib.parse import urlsplit

import pytest

from shopsimrl.config import ConfigError
from shopsimrl.prompts import render_skills
from shopsimrl.storage.reading import open_run
from shopsimrl.testbed.policy import PolicySettings
from shopsimrl.testbed.policy import create_app as create_policy_app
from shopsimrl.testbed.serving import running_server
from shopsimrl.testbed.shop import ShopSettings
from shopsimrl.testbed.shop import create_app as create_shop_app
from shopsimrl.training import slime_adapter
from shopsimrl.training.config import load_training_config
from shopsimrl.training.curriculum import CurriculumError, build_curriculum_state, load_curriculum, write_curriculum_state
from shopsimrl.training.worker import Sampling, TrainingWorker
from tests.training.slime_contract import ContractSample, installed

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SPLITS = REPO / "configs/splits/persona_splits.v1.json"
TRAIN_IDS: list[int] = json.loads(SPLITS.read_text())["splits"]["train"]["task_ids"]
BANK = REPO / "tests/fixtures/curriculum/selected_skillbank.json"
PARAMS: dict[str, Any] = {"temperature": 0.6, "top_p": 1.0, "top_k": -1, "max_new_tokens": 512}
SAMPLES = 3


def _round(tmp_path: Path, shop: str, *, curriculum: bool = True) -> Path:
    bank = tmp_path / "gate" / "selected_skillbank.json"
    bank.parent.mkdir(exist_ok=True)
    shutil.copyfile(BANK, bank)
    state = tmp_path / "round-001.json"
    if not state.exists():
        document = build_curriculum_state(
            bank, round_id="round-001", seed=20260901, skill_free_probability=0.3, rho_min=0.2, rho_max=0.9
        )
        write_curriculum_state(state, document)
    config = tmp_path / "training.yaml"
    config.write_text(
        f"run: {{name: round-001, output_dir: {tmp_path / 'runs'}, concurrency: 4}}\n"
        f"tasks: {{split_file: {SPLITS}, split: train}}\n"
        f"environment: {{base_url: '{shop}', persona: true}}\n"
        "model: {name: testbed-policy, retry_backoff_seconds: 0.0}\n"
        + ("curriculum: {state: round-001.json, skillbank: gate/selected_skillbank.json}\n" if curriculum else "")
    )
    return config


def _groups_covering_every_mode(state: Path) -> dict[int, Any]:
    """Group indices whose draws give each mode, and two assisted groups with other chunks."""
    curriculum = load_curriculum(state)
    chosen: dict[int, Any] = {}
    seen: set[tuple[str, tuple[str, ...]]] = set()
    for g in range(500):
        assignment = curriculum.assign(g)
        kind = (assignment.mode, tuple(assignment.skill_ids))
        modes = [a.mode for a in chosen.values()]
        if kind not in seen and (modes.count(assignment.mode) < (2 if assignment.mode == "assisted" else 1)):
            chosen[g] = assignment
            seen.add(kind)
        if len(chosen) == 4:
            break
    assert sorted(a.mode for a in chosen.values()) == ["assisted", "assisted", "assisted_empty", "skill_free"]
    return chosen


async def test_every_sample_of_a_group_gets_the_skills_its_group_index_draws(tmp_path: Path) -> None:
    with (
        running_server(create_shop_app(ShopSettings(slots=4))) as shop,
        running_server(create_policy_app(PolicySettings(token_endpoint=True))) as model_url,
        installed(),
    ):
        config = _round(tmp_path, shop)
        groups = _groups_covering_every_mode(tmp_path / "round-001.json")
        router = urlsplit(model_url)
        args = SimpleNamespace(
            shopsim_training_config=str(config),
            sglang_router_ip=router.hostname,
            sglang_router_port=router.port,
            partial_rollout=False,
            group_rm=False,
            n_samples_per_prompt=SAMPLES,
        )
        samples = {
            g: [
                ContractSample(group_index=g, index=g * SAMPLES + i, prompt=str(TRAIN_IDS[n]), metadata={"task_id": TRAIN_IDS[n]})
                for i in range(SAMPLES)
            ]
            for n, g in enumerate(groups)
        }
        try:
            # Samples of different groups interleaved, as slime's concurrent rollouts finish.
            flat = [s for i in range(SAMPLES) for group in samples.values() for s in group[i : i + 1]]
            returned = await asyncio.gather(*(slime_adapter.generate(args, s, dict(PARAMS)) for s in flat))
        finally:
            await slime_adapter.close_workers()
    by_index = {base.index: out for base, out in zip(flat, returned, strict=True)}
    run_dir = load_training_config(config).run_dir
    traces = {record.episode_id: record for record in open_run(run_dir).records()}
    assert len(traces) == len(groups) * SAMPLES
    state = load_curriculum(tmp_path / "round-001.json")
    contents = {c.skill_id: c.content for c in state.chunks}
    for g, assignment in groups.items():
        expected = assignment.to_dict()
        assert expected == {
            "state_id": state.state_id,
            "group_key": str(g),
            "mode": assignment.mode,
            "skill_ids": assignment.skill_ids,
            "q": state.skill_free_probability,
            "rho": {c.skill_id: c.inclusion_probability for c in state.chunks},
        }
        for base in samples[g]:
            for sample in by_index[base.index]:
                assert sample.metadata["curriculum"] == expected
                assert sample.metadata["skills"] == assignment.skill_ids
            trace = traces[f"task-{base.metadata['task_id']:06d}__sample-{base.index:03d}"]
            assert trace.status == "completed", trace.error
            assert [s.skill_id for s in trace.selected_skills] == assignment.skill_ids
            assert all(s.metadata["selection_scope"] == "curriculum" for s in trace.selected_skills)
            assert trace.provenance["skills"] == {
                "provider": "skill_curriculum",
                "schema_version": "shopsimrl-skill-curriculum-v1",
                "round_id": "round-001",
                **expected,
            }
            system = trace.conversation[0]["content"]
            # The evaluation's renderer: the chosen chunks' block ends the system message; the
            # other chunks are nowhere in it.
            block = render_skills(state.skills_for(g).select({"task_id": base.metadata["task_id"]}))
            assert bool(block) is bool(assignment.skill_ids) and system.endswith(block)
            for skill_id, content in contents.items():
                assert (content.strip() in system) is (skill_id in assignment.skill_ids), (g, skill_id)


async def test_full_skills_replays_a_group_with_every_chunk(tmp_path: Path) -> None:
    with (
        running_server(create_shop_app(ShopSettings(slots=2))) as shop,
        running_server(create_policy_app(PolicySettings(token_endpoint=True))) as model_url,
    ):
        config = load_training_config(_round(tmp_path, shop))
        worker = TrainingWorker(config, base_url=model_url, sampling=Sampling(temperature=0.6, max_new_tokens=512))
        await worker.start()
        try:
            full = worker.full_skills()
            assert full.identity()["mode"] == "full"
            rollout = await worker.rollout(task_id=TRAIN_IDS[0], index=0, group_index=5, skills=full)
            with pytest.raises(ConfigError, match="no group_index: the curriculum draws"):
                await worker.rollout(task_id=TRAIN_IDS[0], index=1, group_index=None)
        finally:
            await worker.aclose()
    ids = ["choose-options", "price-check", "search-terms"]
    assert [s.skill_id for s in rollout.trace.selected_skills] == ids
    assert all(sample.metadata["curriculum"]["mode"] == "full" for sample in rollout.samples)
    assert rollout.samples[0].metadata["curriculum"]["skill_ids"] == ids

    # Without a curriculum: the config's own skills provider.
    plain = load_training_config(_round(tmp_path, "http://127.0.0.1:9", curriculum=False))
    worker = TrainingWorker(plain, base_url="http://127.0.0.1:9", sampling=Sampling(temperature=0.6, max_new_tokens=512))
    assert worker.curriculum is None and worker.full_skills() is worker.rollouts.skills
    assert worker.full_skills().identity() == {"provider": "none"}


def test_a_worker_refuses_a_curriculum_whose_bank_changed(tmp_path: Path) -> None:
    config = _round(tmp_path, "http://127.0.0.1:9")
    bank = tmp_path / "gate" / "selected_skillbank.json"
    bank.write_text(bank.read_text().replace("0.0799", "0.08"))
    with pytest.raises(CurriculumError, match=r"was built from a skill bank with sha256 .* has sha256"):
        TrainingWorker(load_training_config(config), base_url="http://127.0.0.1:9", sampling=Sampling(0.6, 512))
