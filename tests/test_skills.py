"""Skill providers: the JSON skill bank's selection, identity and validation."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shopsimrl.schemas import fingerprint
from shopsimrl.skills import (
    PRIVATE_CONTEXT_KEYS,
    AssignedSkills,
    JsonSkillBank,
    NoSkills,
    PrivateContextError,
    SkillBankError,
    SkillProvider,
    open_skill_provider,
)

BANK: dict[str, Any] = {
    "schema_version": "shopsimrl-skillbank-v1",
    "bank_version": "2024-11-a",
    "skills": [
        {"skill_id": "task-9", "content": "只对任务 9。", "task_ids": [9]},
        {"skill_id": "global", "content": "先搜品类词。", "version": "3", "metadata": {"origin": "trace2skill"}},
        {"skill_id": "off", "content": "已停用。", "enabled": False},
        {"skill_id": "task-4", "content": "  任务 4：先选尺码。 ", "task_ids": [4, 8], "enabled": True},
        {"skill_id": "global-2", "content": "比较价格。"},
    ],
}


def _context(task_id: int = 4, **extra: Any) -> dict[str, Any]:
    return {
        "task_id": task_id,
        "sample_id": 0,
        "split": "val",
        "task_instruction": "买一双 42 码的跑鞋",
        "user_persona": {},
        "observation_state": {"page_type": "search_home"},
        "task_mode": "standard",
        **extra,
    }


def _write(tmp_path: Path, bank: Any, name: str = "bank.json") -> Path:
    path = tmp_path / name
    path.write_text(json.dumps(bank, ensure_ascii=False), encoding="utf-8")
    return path


def test_selection_keeps_file_order_global_and_task_scoped(tmp_path: Path) -> None:
    bank = JsonSkillBank(_write(tmp_path, BANK))
    assert isinstance(bank, SkillProvider)
    selected = bank.select(_context(4))
    assert [skill.skill_id for skill in selected] == ["global", "task-4", "global-2"]
    assert [skill.metadata["selection_scope"] for skill in selected] == ["global", "task", "global"]
    assert selected[0].metadata["origin"] == "trace2skill" and selected[0].version == "3"
    assert selected[1].version == "1" and selected[1].content == "  任务 4：先选尺码。 "  # the renderer strips
    assert [skill.skill_id for skill in bank.select(_context(9))] == ["task-9", "global", "global-2"]
    assert [skill.skill_id for skill in bank.select(_context(5))] == ["global", "global-2"]


def test_reference_pair_global_then_task(tmp_path: Path) -> None:
    path = _write(
        tmp_path,
        {
            "bank_version": "7",
            "skills": [
                {"skill_id": "global", "content": "通用提示"},
                {"skill_id": "task-4", "content": "任务 4 提示", "task_ids": [4]},
                {"skill_id": "task-5", "content": "任务 5 提示", "task_ids": [5]},
            ],
        },
    )
    bank = JsonSkillBank(path)
    assert [skill.skill_id for skill in bank.select(_context(4))] == ["global", "task-4"]
    assert bank.identity()["bank_version"] == "7"
    assert bank.identity()["schema_version"] == "shopsimrl-skillbank-v1"  # the default when absent


def test_disabled_skills_are_never_selected(tmp_path: Path) -> None:
    bank = JsonSkillBank(_write(tmp_path, BANK))
    assert all(skill.skill_id != "off" for task in (4, 9, 100) for skill in bank.select(_context(task)))
    assert len(bank) == 4


def test_max_skills_stops_in_file_order(tmp_path: Path) -> None:
    path = _write(tmp_path, BANK)
    assert [skill.skill_id for skill in JsonSkillBank(path, max_skills=2).select(_context(4))] == ["global", "task-4"]
    assert JsonSkillBank(path, max_skills=0).select(_context(4)) == []
    with pytest.raises(SkillBankError, match="max_skills"):
        JsonSkillBank(path, max_skills=-1)


def test_identity_hashes_the_whole_bank(tmp_path: Path) -> None:
    path = _write(tmp_path, BANK)
    identity = JsonSkillBank(path, max_skills=3).identity()
    assert identity == {
        "provider": "json_skillbank",
        "schema_version": "shopsimrl-skillbank-v1",
        "bank_version": "2024-11-a",
        "bank_sha256": fingerprint(BANK),
        "max_skills": 3,
    }
    # Reformatting the file does not change the hash; editing a disabled skill does.
    pretty = tmp_path / "pretty.json"
    pretty.write_text(json.dumps(BANK, ensure_ascii=True, indent=2), encoding="utf-8")
    assert JsonSkillBank(pretty, max_skills=3).identity() == identity
    edited = json.loads(json.dumps(BANK))
    edited["skills"][2]["content"] = "改过的停用技能"
    assert JsonSkillBank(_write(tmp_path, edited, "edited.json")).identity()["bank_sha256"] != identity["bank_sha256"]


def test_no_skills() -> None:
    provider = NoSkills()
    assert isinstance(provider, SkillProvider)
    assert provider.select(_context()) == []
    assert provider.identity() == {"provider": "none"}


@pytest.mark.parametrize("key", sorted(PRIVATE_CONTEXT_KEYS))
def test_private_context_is_refused(tmp_path: Path, key: str) -> None:
    assert {"private_task_instruction", "goal_options", "reason_key", "goal"} == PRIVATE_CONTEXT_KEYS
    for provider in (NoSkills(), JsonSkillBank(_write(tmp_path, BANK))):
        with pytest.raises(PrivateContextError, match=key):
            provider.select(_context(**{key: "secret"}))


def test_context_needs_an_integer_task_id(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="task_id"):
        JsonSkillBank(_write(tmp_path, BANK)).select(_context(task_id="4"))  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("bank", "message"),
    [
        ([], r"top level must be a JSON object"),
        ({"schema_version": "shopsimrl-skillbank-v2", "skills": []}, r"'schema_version' is 'shopsimrl-skillbank-v2'"),
        ({"bank_version": 1, "skills": []}, r"'bank_version' must be a non-empty string"),
        ({"skills": {"a": 1}}, r"'skills' must be a list"),
        ({"skills": ["text"]}, r"skills\[0\] must be an object"),
        ({"skills": [{"content": "x"}]}, r"skills\[0\]\.skill_id must be a non-empty string"),
        (
            {"skills": [{"skill_id": "a", "content": "x"}, {"skill_id": "a", "content": "y"}]},
            r"skills\[1\] \('a'\) duplicates",
        ),
        ({"skills": [{"skill_id": "a", "content": "  "}]}, r"skills\[0\] \('a'\)\.content must be a non-blank string"),
        ({"skills": [{"skill_id": "a", "content": "x", "enabled": "no"}]}, r"\.enabled must be true or false"),
        ({"skills": [{"skill_id": "a", "content": "x", "task_ids": "4"}]}, r"\.task_ids must be a non-empty list"),
        ({"skills": [{"skill_id": "a", "content": "x", "task_ids": []}]}, r"\.task_ids must be a non-empty list"),
        (
            {"skills": [{"skill_id": "a", "content": "x", "task_ids": [4, True]}]},
            r"\.task_ids must hold non-negative integers",
        ),
        ({"skills": [{"skill_id": "a", "content": "x", "metadata": []}]}, r"\.metadata must be an object"),
        ({"skills": [{"skill_id": "a", "content": "x", "version": None}]}, r"\.version must be a non-empty string"),
        ({"skills": [{"skill_id": "a", "content": "x", "enable": False}]}, r"unknown keys \['enable'\]"),
    ],
)
def test_bad_banks_name_the_file_and_field(tmp_path: Path, bank: Any, message: str) -> None:
    path = _write(tmp_path, bank)
    with pytest.raises(SkillBankError, match=message) as caught:
        JsonSkillBank(path)
    assert str(path) in str(caught.value)


def test_invalid_json_reports_line_and_column(tmp_path: Path) -> None:
    path = tmp_path / "broken.json"
    path.write_text('{\n  "skills": [\n    {"skill_id": "a",}\n  ]\n}\n', encoding="utf-8")
    with pytest.raises(SkillBankError, match=r"broken\.json is not valid JSON at line 3 column 22"):
        JsonSkillBank(path)
    with pytest.raises(SkillBankError, match=r"missing\.json"):
        JsonSkillBank(tmp_path / "missing.json")


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_bank_refuses_nan_and_infinity(tmp_path: Path, constant: str) -> None:
    # The curriculum reads the same bank; both refuse what is not JSON, with the same words.
    path = tmp_path / "bank.json"
    path.write_text('{"skills": [{"skill_id": "a", "content": "x", "weight": ' + constant + "}]}", encoding="utf-8")
    with pytest.raises(SkillBankError, match=rf"bank\.json is not valid JSON: {constant} is not JSON"):
        JsonSkillBank(path)


# --------------------------------------------------------------------------- assigned skills

ASSIGNMENTS: dict[str, Any] = {
    "schema_version": "shopsimrl-skill-assignments-v1",
    "skills": [
        {"skill_id": "chunk-a", "content": "先选规格。", "metadata": {"draft_order": 1}},
        {"skill_id": "chunk-b", "content": "比较价格。", "version": "2"},
        {"skill_id": "chunk-c", "content": "看评价。"},
    ],
    "assignments": [
        {"split": "val", "task_id": 4, "sample_id": 0, "skill_ids": ["chunk-a", "chunk-c"]},
        {"split": "val", "task_id": 4, "sample_id": 1, "skill_ids": []},
        {"split": "val", "task_id": 9, "sample_id": 0, "skill_ids": ["chunk-b"]},
    ],
    "protocol": {"mask_seed": 7},
}


def test_assigned_skills_give_each_episode_exactly_its_skills_in_bank_order(tmp_path: Path) -> None:
    provider = open_skill_provider(_write(tmp_path, ASSIGNMENTS))
    assert isinstance(provider, AssignedSkills) and isinstance(provider, SkillProvider)
    first = provider.select(_context(4))
    assert [skill.skill_id for skill in first] == ["chunk-a", "chunk-c"]
    assert first[0].metadata == {"draft_order": 1, "selection_scope": "assigned"}
    assert provider.select(_context(4, sample_id=1)) == []
    assert [(s.skill_id, s.version) for s in provider.select(_context(9))] == [("chunk-b", "2")]
    with pytest.raises(SkillBankError, match="no entry for split 'val', task 9, sample 1"):
        provider.select(_context(9, sample_id=1))
    with pytest.raises(PrivateContextError):
        provider.select(_context(4, goal={}))
    identity = provider.identity()
    assert identity == {
        "provider": "assigned_skills",
        "schema_version": "shopsimrl-skill-assignments-v1",
        "assignments_sha256": fingerprint(ASSIGNMENTS),
        "skills": 3,
        "episodes": 3,
    }
    # The protocol block is not read, but it is hashed: a changed gate protocol changes the plan.
    changed = {**ASSIGNMENTS, "protocol": {"mask_seed": 8}}
    assert (
        open_skill_provider(_write(tmp_path, changed, "b.json")).identity()["assignments_sha256"]
        != identity["assignments_sha256"]
    )
    assert isinstance(open_skill_provider(_write(tmp_path, BANK, "bank.json")), JsonSkillBank)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda d: d["assignments"][0].update(skill_ids=["chunk-c", "chunk-a"]), r"assignments\[0\].skill_ids.*in the order"),
        (lambda d: d["assignments"][0].update(skill_ids=["chunk-a", "chunk-a"]), r"at most once"),
        (lambda d: d["assignments"][2].update(skill_ids=["chunk-z"]), r"assignments\[2\].skill_ids must list skill ids"),
        (lambda d: d["assignments"][1].update(sample_id=0), r"assignments\[1\] assigns split 'val', task 4, sample 0 a second"),
        (lambda d: d["assignments"][1].update(task_id=True), r"assignments\[1\].task_id must be a non-negative integer"),
        (lambda d: d["assignments"][1].pop("split"), r"assignments\[1\] must be an object with exactly the keys"),
        (lambda d: d["skills"][1].update(skill_id="chunk-a"), r"skills\[1\].skill_id must be a non-empty string not used"),
        (lambda d: d["skills"][2].update(content=" "), r"skills\[2\].content must be a non-blank string"),
        (lambda d: d.update(extra=1), r"top level has unknown keys \['extra'\]"),
        (lambda d: d.update(skills=[]), r"'skills' must be a non-empty list"),
    ],
)
def test_bad_assignment_files_name_the_field(tmp_path: Path, mutate: Any, message: str) -> None:
    document = json.loads(json.dumps(ASSIGNMENTS))
    mutate(document)
    with pytest.raises(SkillBankError, match=message) as raised:
        open_skill_provider(_write(tmp_path, document))
    assert str(tmp_path / "bank.json") in str(raised.value)


def test_max_skills_cannot_cut_an_assignment(tmp_path: Path) -> None:
    with pytest.raises(SkillBankError, match="max_skills cannot apply"):
        open_skill_provider(_write(tmp_path, ASSIGNMENTS), max_skills=1)
