"""The skill curriculum (shopsimrl/training/curriculum.py) against the earlier implementation's
formulas, written out again here from docs/training.md and the reference (§1.6), not imported:

- the draw: the first 8 bytes of sha256(f"{seed}:{state_id}:{group}:{t}"), big-endian, over 2**64;
- rho = clip(rho_min + (rho_max - rho_min)·effect/scale, rho_min, rho_max), scale the largest effect;
- the state id: sha256 of the canonical JSON of the state's content; the earlier one also hashed
  the bank's absolute path.

tests/fixtures/curriculum/ holds a gate-selected bank, a state built from it, a state of the
earlier (path-bound) rule and golden.json: draws and group assignments computed with the formulas
below and frozen, so a change of the formula, the id or the order of draws shows up as a diff.
"""

from __future__ import annotations

import copy
import hashlib
import json
import math
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from shopsimrl.storage.local import RunWriteError
from shopsimrl.training import curriculum as module
from shopsimrl.training.curriculum import (
    CONTENT_RULE,
    EARLIER_RULE,
    CurriculumError,
    build_curriculum_state,
    check_against_bank,
    load_curriculum,
    write_curriculum_state,
)

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "curriculum"
BANK = FIXTURES / "selected_skillbank.json"
STATE = FIXTURES / "state.json"
EARLIER_STATE = FIXTURES / "state_earlier.json"
GOLDEN = FIXTURES / "golden.json"
# The options the fixture states were built with.
OPTIONS: dict[str, Any] = {
    "round_id": "round-001",
    "seed": 20260901,
    "skill_free_probability": 0.2,
    "rho_min": 0.2,
    "rho_max": 0.9,
}
CREATED_AT = "2026-09-01T00:00:00Z"
EARLIER_BANK_PATH = "/home/researcher/shopsimrl/runs/gate-demo/gate/selected_skillbank.json"
SIGMAS = 4.0


# --------------------------------------------------------------------------- the formulas, written out


def reference_draw(seed: int, state_id: str, group_key: str, treatment: str) -> float:
    digest = hashlib.sha256(f"{seed}:{state_id}:{group_key}:{treatment}".encode()).hexdigest()
    return int(digest[:16], 16) / 2**64  # 16 hex digits = the first 8 bytes, most significant first


def reference_fingerprint(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode()).hexdigest()


def reference_ids(state: dict[str, Any]) -> tuple[str, str]:
    """(content id, earlier path-bound id) of a state document."""
    core = {key: state[key] for key in ("round_id", "seed", "skill_free_probability", "chunks", "source")}
    earlier = reference_fingerprint(core)
    core["source"] = {key: value for key, value in state["source"].items() if key != "skillbank_path"}
    return reference_fingerprint(core), earlier


def reference_state(bank_path: str, *, scale: float | None = None, **options: Any) -> dict[str, Any]:
    """A content-rule state of the bank at ``bank_path`` (its recorded path), built by hand."""
    bank = json.loads(BANK.read_text(encoding="utf-8"))
    options = {**OPTIONS, **options}
    enabled = [record for record in bank["skills"] if record.get("enabled", True)]
    largest = max(record["metadata"]["estimated_effect"] for record in enabled)
    lo, hi, s = options["rho_min"], options["rho_max"], largest if scale is None else scale
    state = {
        "schema_version": "shopsimrl-skill-curriculum-v1",
        "created_at": CREATED_AT,
        "round_id": options["round_id"],
        "seed": options["seed"],
        "skill_free_probability": options["skill_free_probability"],
        "chunks": [
            {
                "skill_id": r["skill_id"],
                "version": r["version"],
                "content": r["content"],
                "metadata": r["metadata"],
                "contribution": r["metadata"]["estimated_effect"],
                "inclusion_probability": min(hi, max(lo, lo + (hi - lo) * r["metadata"]["estimated_effect"] / s)),
            }
            for r in enabled
        ],
        "source": {
            "skillbank_path": bank_path,
            "skillbank_sha256": reference_fingerprint(bank),
            "probability_mapping": {
                "name": "clipped_linear_positive_contribution",
                "rho_min": lo,
                "rho_max": hi,
                "contribution_scale": s,
                "scale_source": "largest_active_contribution" if scale is None else "explicit",
            },
        },
    }
    state["state_id"] = reference_ids(state)[0]
    return state


def reference_assign(state: dict[str, Any], group_key: str) -> tuple[str, list[str]]:
    seed, state_id = state["seed"], state["state_id"]
    if reference_draw(seed, state_id, group_key, "skill-free") < state["skill_free_probability"]:
        return "skill_free", []
    chosen = [
        c["skill_id"]
        for c in state["chunks"]
        if reference_draw(seed, state_id, group_key, f"chunk:{c['skill_id']}") < c["inclusion_probability"]
    ]
    return ("assisted" if chosen else "assisted_empty"), chosen


def write_fixtures() -> None:
    """Regenerate the fixture states and golden.json (run by hand; the tests only read them)."""
    state = reference_state("/data/gates/round-000/selected_skillbank.json")
    earlier = copy.deepcopy(state)
    earlier["source"]["skillbank_path"] = EARLIER_BANK_PATH
    earlier["state_id"] = reference_ids(earlier)[1]
    for path, document in ((STATE, state), (EARLIER_STATE, earlier)):
        path.write_text(json.dumps(document, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    draws = [
        [seed, state_id, key, treatment, reference_draw(seed, state_id, key, treatment)]
        for seed in (0, 20260901)
        for state_id in (state["state_id"], earlier["state_id"])
        for key in ("0", "1", "17", "4095", "group-ü")
        for treatment in ("skill-free", "chunk:choose-options", "chunk:search-terms")
    ]
    assignments = {
        name: [[str(g), *reference_assign(document, str(g))] for g in range(48)]
        for name, document in (("state.json", state), ("state_earlier.json", earlier))
    }

    def rows(items: list[Any]) -> str:
        return ",\n".join("    " + json.dumps(item, ensure_ascii=False) for item in items)

    blocks = ",\n".join(f'    "{name}": [\n{rows(table)}\n    ]' for name, table in assignments.items())
    GOLDEN.write_text(f'{{\n  "draws": [\n{rows(draws)}\n  ],\n  "assignments": {{\n{blocks}\n  }}\n}}\n', encoding="utf-8")


def _bounds(p: float, n: int) -> tuple[float, float]:
    """The count of a binomial(n, p) within SIGMAS standard deviations."""
    sd = math.sqrt(n * p * (1 - p))
    return n * p - SIGMAS * sd, n * p + SIGMAS * sd


# --------------------------------------------------------------------------- golden vectors


def test_golden_draws_are_the_reference_formula_and_the_module_draws_them() -> None:
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    assert len(golden["draws"]) == 60
    for seed, state_id, key, treatment, value in golden["draws"]:
        assert reference_draw(seed, state_id, key, treatment) == value
        assert module.draw(seed, state_id, key, treatment) == value
        assert 0.0 <= value < 1.0


def test_the_fixture_states_carry_the_ids_of_their_rules() -> None:
    state, earlier = (json.loads(p.read_text(encoding="utf-8")) for p in (STATE, EARLIER_STATE))
    assert state["state_id"] == reference_ids(state)[0] != reference_ids(state)[1]
    assert earlier["state_id"] == reference_ids(earlier)[1] != reference_ids(earlier)[0]
    assert reference_ids(state)[0] == reference_ids(earlier)[0], "same content, other path: one content id"
    assert load_curriculum(STATE).rule == CONTENT_RULE and load_curriculum(EARLIER_STATE).rule == EARLIER_RULE


@pytest.mark.parametrize("name", ["state.json", "state_earlier.json"])
def test_golden_assignments_of_both_rules_reproduce(name: str) -> None:
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))["assignments"][name]
    document = json.loads((FIXTURES / name).read_text(encoding="utf-8"))
    curriculum = load_curriculum(FIXTURES / name)
    assert curriculum.state_id == document["state_id"], "the draws use the stored id"
    modes = set()
    for key, mode, skill_ids in golden:
        assert reference_assign(document, key) == (mode, skill_ids)
        got = curriculum.assign(int(key))
        assert (got.mode, got.skill_ids, got.group_key, got.state_id) == (mode, skill_ids, key, document["state_id"])
        assert curriculum.assign(key) == got, "slime's int group_index and its string are one key"
        modes.add(mode)
    assert modes == {"skill_free", "assisted", "assisted_empty"}, "the table covers every mode"


def test_the_builder_writes_the_reference_state() -> None:
    built = build_curriculum_state(BANK, created_at=CREATED_AT, **OPTIONS)
    expected = reference_state(str(BANK.resolve()))
    assert built == expected
    assert built["state_id"] == json.loads(STATE.read_text(encoding="utf-8"))["state_id"]
    rhos = [c["inclusion_probability"] for c in built["chunks"]]
    assert rhos[0] == 0.8999999999999999 and rhos[0] > rhos[1] > rhos[2] > 0.2  # 0.2 + 0.7·1.0, below the clip
    assert [c["skill_id"] for c in built["chunks"]] == ["choose-options", "price-check", "search-terms"], "enabled, bank order"
    explicit = build_curriculum_state(BANK, created_at=CREATED_AT, contribution_scale=0.04, **OPTIONS)
    assert explicit == reference_state(str(BANK.resolve()), scale=0.04)
    assert [c["inclusion_probability"] for c in explicit["chunks"]][:2] == [0.9, 0.8999999999999999], "the first clipped"


def test_the_reference_figures_of_the_earlier_gate_demo_bank(tmp_path: Path) -> None:
    """§1.6: one chunk of effect 0.0799, q 0.2, rho in [0.2, 0.9] → rho 0.8999999999999999; the
    earlier run's counts over 20,000 groups came from its own state id (not reproducible without
    its file), so the frequencies are checked against q and rho instead."""
    bank = json.loads(BANK.read_text(encoding="utf-8"))
    bank["skills"] = bank["skills"][:1]
    path = tmp_path / "selected_skillbank.json"
    path.write_text(json.dumps(bank), encoding="utf-8")
    state = build_curriculum_state(path, **OPTIONS)
    (chunk,) = state["chunks"]
    assert chunk["contribution"] == 0.0799 and chunk["inclusion_probability"] == 0.8999999999999999
    curriculum = module.SkillCurriculum.from_document(state)
    n = 20_000
    modes = [curriculum.assign(g).mode for g in range(n)]
    skill_free, assisted = modes.count("skill_free"), modes.count("assisted")
    low, high = _bounds(0.2, n)
    assert low <= skill_free <= high, skill_free
    low, high = _bounds(0.8999999999999999, n - skill_free)
    assert low <= assisted <= high, (assisted, n - skill_free)


def test_group_frequencies_over_20000_groups_are_within_binomial_bounds() -> None:
    curriculum = load_curriculum(STATE)
    n = 20_000
    assignments = [curriculum.assign(g) for g in range(n)]
    skill_free = sum(a.mode == "skill_free" for a in assignments)
    low, high = _bounds(curriculum.skill_free_probability, n)
    assert low <= skill_free <= high, skill_free
    assisted = [a for a in assignments if a.mode != "skill_free"]
    for chunk in curriculum.chunks:
        included = sum(chunk.skill_id in a.skill_ids for a in assisted)
        low, high = _bounds(chunk.inclusion_probability, len(assisted))
        assert low <= included <= high, (chunk.skill_id, included / len(assisted), chunk.inclusion_probability)
    empty = math.prod(1 - c.inclusion_probability for c in curriculum.chunks)
    low, high = _bounds(empty, len(assisted))
    assert low <= sum(a.mode == "assisted_empty" for a in assisted) <= high
    # Independence of the draws: two chunks together as often as the product says.
    a, b = curriculum.chunks[0], curriculum.chunks[2]
    low, high = _bounds(a.inclusion_probability * b.inclusion_probability, len(assisted))
    assert low <= sum(a.skill_id in x.skill_ids and b.skill_id in x.skill_ids for x in assisted) <= high


# --------------------------------------------------------------------------- the fix: no path in the id


def test_the_same_bank_elsewhere_gives_the_same_state_and_the_same_groups(tmp_path: Path) -> None:
    here, there = tmp_path / "a" / "selected_skillbank.json", tmp_path / "b" / "c" / "renamed.json"
    for path in (here, there):
        path.parent.mkdir(parents=True)
        shutil.copyfile(BANK, path)
    first, second = (build_curriculum_state(path, created_at=CREATED_AT, **OPTIONS) for path in (here, there))
    assert first["source"]["skillbank_path"] == str(here.resolve())
    assert second["source"]["skillbank_path"] == str(there.resolve())
    assert first["state_id"] == second["state_id"]
    # The earlier rule would have given two states, and other skills to the same groups.
    assert module.earlier_state_id(first) != module.earlier_state_id(second)
    a, b = (module.SkillCurriculum.from_document(d) for d in (first, second))
    assert [a.assign(g) for g in range(2000)] == [b.assign(g) for g in range(2000)]
    # Written to files and moved: the file still loads, with the same draws.
    write_curriculum_state(tmp_path / "state.json", first)
    moved = tmp_path / "moved" / "state.json"
    moved.parent.mkdir()
    os.rename(tmp_path / "state.json", moved)
    assert load_curriculum(moved).assign(7) == a.assign(7)


def test_an_earlier_state_loads_and_keeps_its_groups_skills() -> None:
    earlier = load_curriculum(EARLIER_STATE)
    document = json.loads(EARLIER_STATE.read_text(encoding="utf-8"))
    assert earlier.rule == EARLIER_RULE and earlier.state_id == document["state_id"]
    assert module.state_id_of(document) != earlier.state_id
    for g in range(200):
        assert (earlier.assign(g).mode, earlier.assign(g).skill_ids) == reference_assign(document, str(g))
    # It records the bank's digest as the earlier implementation computed it: the bank checks out.
    check_against_bank(earlier, BANK)
    assert earlier.identity()["state_id_rule"] == "earlier_path_bound"


@pytest.mark.parametrize(
    ("name", "edit"),
    [
        ("state.json", lambda d: d["chunks"][0].update(content="Buy the first result.")),
        ("state.json", lambda d: d["chunks"][1].update(inclusion_probability=0.95)),
        ("state.json", lambda d: d.update(skill_free_probability=0.5)),
        ("state.json", lambda d: d["source"].update(skillbank_sha256="0" * 64)),
        ("state.json", lambda d: d.update(state_id="f" * 64)),
        ("state_earlier.json", lambda d: d["source"].update(skillbank_path="/elsewhere/selected_skillbank.json")),
        ("state_earlier.json", lambda d: d.update(seed=1)),
    ],
)
def test_an_edited_state_matches_neither_rule_and_is_refused_naming_the_file(tmp_path: Path, name: str, edit: Any) -> None:
    document = json.loads((FIXTURES / name).read_text(encoding="utf-8"))
    edit(document)
    path = tmp_path / name
    path.write_text(json.dumps(document), encoding="utf-8")
    with pytest.raises(CurriculumError, match="matches neither its content") as caught:
        load_curriculum(path)
    assert str(path) in str(caught.value) and "'state_id'" in str(caught.value)


def test_a_content_state_with_another_recorded_path_still_loads(tmp_path: Path) -> None:
    # The path is a record, not part of the identity: relocating the bank and editing the path
    # to say so changes nothing a rollout sees.
    document = json.loads(STATE.read_text(encoding="utf-8"))
    document["source"]["skillbank_path"] = "/mnt/other/selected_skillbank.json"
    path = tmp_path / "state.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    assert load_curriculum(path).assign(3) == load_curriculum(STATE).assign(3)


# --------------------------------------------------------------------------- refusals


def _bank(tmp_path: Path, edit: Any) -> Path:
    bank = json.loads(BANK.read_text(encoding="utf-8"))
    edit(bank)
    path = tmp_path / "bank.json"
    path.write_text(json.dumps(bank), encoding="utf-8")
    return path


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (
            lambda b: b["skills"][1]["metadata"].pop("estimated_effect"),
            r"skills\[1\] \('price-check'\) has no numeric metadata\.estimated_effect.*draft bank",
        ),
        (lambda b: b["skills"][0].update(metadata={}), r"skills\[0\] \('choose-options'\) has no numeric"),
        (lambda b: b["skills"][3]["metadata"].update(estimated_effect="0.01"), r"skills\[3\] \('search-terms'\) has no numeric"),
        (lambda b: b["skills"][3]["metadata"].update(estimated_effect=True), r"skills\[3\] .*has no numeric"),
        (lambda b: b["skills"][0]["metadata"].update(estimated_effect=0), r"skills\[0\] .*finite and positive, got 0"),
        (lambda b: b["skills"][0]["metadata"].update(estimated_effect=-0.02), r"finite and positive, got -0\.02"),
        (lambda b: b["skills"][0].update(task_ids=[4]), r"skills\[0\] \('choose-options'\) is task-scoped"),
        (lambda b: b["skills"][0].update(content=" "), r"skills\[0\] \('choose-options'\)\.content"),
        (lambda b: b.update(schema_version="other"), r"'schema_version'"),
    ],
)
def test_a_bank_without_gate_effects_is_refused_naming_the_record(tmp_path: Path, edit: Any, words: str) -> None:
    path = _bank(tmp_path, edit)
    with pytest.raises(CurriculumError, match=words) as caught:
        build_curriculum_state(path, **OPTIONS)
    assert str(path) in str(caught.value)


def test_a_disabled_draft_record_is_not_asked_for_an_effect(tmp_path: Path) -> None:
    # The fixture's disabled record has no estimated_effect; a fully disabled bank gives no chunks.
    path = _bank(tmp_path, lambda b: [r.update(enabled=False) for r in b["skills"]])
    state = module.SkillCurriculum.from_document(build_curriculum_state(path, **OPTIONS))
    assert state.chunks == ()
    assert {state.assign(g).mode for g in range(200)} == {"skill_free", "assisted_empty"}


def test_a_bank_with_nan_is_refused_as_not_json(tmp_path: Path) -> None:
    path = tmp_path / "bank.json"
    path.write_text(BANK.read_text(encoding="utf-8").replace('"estimated_effect": 0.04', '"estimated_effect": NaN'))
    with pytest.raises(CurriculumError, match=f"skill bank {path} is not valid JSON.*NaN"):
        build_curriculum_state(path, **OPTIONS)


@pytest.mark.parametrize(
    ("change", "words"),
    [
        ({"skill_free_probability": 1.5}, r"skill_free_probability must be a number in \[0, 1\], got 1\.5"),
        ({"skill_free_probability": float("nan")}, r"skill_free_probability must be a number"),
        ({"rho_min": 0.95}, r"rho_min \(0\.95\) is greater than rho_max \(0\.9\)"),
        ({"rho_max": -0.1}, r"rho_max must be a number in \[0, 1\]"),
        ({"contribution_scale": 0.0}, r"contribution_scale must be finite and positive, got 0\.0"),
        ({"contribution_scale": float("inf")}, r"contribution_scale must be finite and positive"),
        ({"round_id": " "}, r"round_id must be a non-empty string"),
    ],
)
def test_bad_options_are_refused_naming_them(change: dict[str, Any], words: str) -> None:
    with pytest.raises(CurriculumError, match=words):
        build_curriculum_state(BANK, **{**OPTIONS, **change})


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda d: d.update(extra=1), r"top level has unknown keys \['extra'\]"),
        (lambda d: d.pop("source"), r"top level lacks \['source'\]"),
        (
            lambda d: d.update(schema_version="shopsimrl-skill-curriculum-v2"),
            r"'schema_version' is 'shopsimrl-skill-curriculum-v2'",
        ),
        (lambda d: d.update(seed="1"), r"'seed' must be an integer"),
        (lambda d: d["chunks"][0].pop("contribution"), r"chunks\[0\] must have exactly the keys"),
        (
            lambda d: d["chunks"][1].update(contribution=-0.1),
            r"chunks\[1\] \('price-check'\)\.contribution must be a finite positive",
        ),
        (lambda d: d["chunks"][2].update(inclusion_probability=1.2), r"chunks\[2\] \('search-terms'\)\.inclusion_probability"),
        (lambda d: d["chunks"].append(dict(d["chunks"][0])), r"chunks\[3\]\.skill_id 'choose-options' appears twice"),
        (lambda d: d["source"].pop("skillbank_sha256"), r"source\.skillbank_sha256 must be a non-empty string"),
    ],
)
def test_a_malformed_state_is_refused_naming_the_file_and_field(tmp_path: Path, edit: Any, words: str) -> None:
    document = json.loads(STATE.read_text(encoding="utf-8"))
    edit(document)
    path = tmp_path / "state.json"
    path.write_text(json.dumps(document), encoding="utf-8")
    with pytest.raises(CurriculumError, match=words) as caught:
        load_curriculum(path)
    assert f"curriculum state {path}" in str(caught.value)


def test_a_state_file_that_is_not_json_names_the_line(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text('{\n"round_id": NaN}\n')
    with pytest.raises(CurriculumError, match=f"{path} is not valid JSON"):
        load_curriculum(path)
    path.write_text("{\n  oops\n}\n")
    with pytest.raises(CurriculumError, match="at line 2 column 3"):
        load_curriculum(path)


def test_the_bank_check_names_what_differs(tmp_path: Path) -> None:
    state = load_curriculum(STATE)
    check_against_bank(state, BANK)
    edited = _bank(tmp_path, lambda b: b["skills"][0].update(content="Other words."))
    with pytest.raises(CurriculumError, match=f"sha256 {state.source['skillbank_sha256']}.*{edited} has sha256"):
        check_against_bank(state, edited)


# --------------------------------------------------------------------------- writing: immutable snapshots


def test_a_state_is_written_once_and_never_replaced_by_another(tmp_path: Path) -> None:
    path = tmp_path / "curricula" / "round-001.json"
    document = build_curriculum_state(BANK, **OPTIONS)
    state, written = write_curriculum_state(path, document)
    assert written and state.state_id == document["state_id"]
    before = path.read_bytes()
    assert json.loads(before) == document
    # The same state again (a rerun of the command, another created_at): left as it is.
    again = build_curriculum_state(BANK, **OPTIONS, created_at="2030-01-01T00:00:00Z")
    state, written = write_curriculum_state(path, again)
    assert not written and state.state_id == document["state_id"] and path.read_bytes() == before
    other = build_curriculum_state(BANK, **{**OPTIONS, "skill_free_probability": 0.3})
    with pytest.raises(CurriculumError, match=f"{path} already holds curriculum state {document['state_id']}"):
        write_curriculum_state(path, other)
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["round-001.json"], "no temporary file left"


def test_a_state_landing_first_from_another_writer_is_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Two builders race for one file: the other one's state lands between our temporary file and
    its link; ours is refused, theirs stays whole."""
    path = tmp_path / "state.json"
    ours = build_curriculum_state(BANK, **OPTIONS)
    theirs = build_curriculum_state(BANK, **{**OPTIONS, "round_id": "round-002"})
    link, landed = os.link, []

    def racing_link(source: Any, target: Any) -> None:
        if Path(target) == path and not landed:
            landed.append(True)
            write_curriculum_state(path, theirs)
        link(source, target)

    monkeypatch.setattr(os, "link", racing_link)
    with pytest.raises(CurriculumError, match=f"already holds curriculum state {theirs['state_id']}"):
        write_curriculum_state(path, ours)
    assert landed == [True], "the other writer's state landed in between"
    assert load_curriculum(path).state_id == theirs["state_id"]
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]


def test_a_file_that_is_not_a_state_is_never_overwritten(tmp_path: Path) -> None:
    path = tmp_path / "state.json"
    path.write_text("notes\n")
    with pytest.raises(CurriculumError, match="exists and is not a curriculum state"):
        write_curriculum_state(path, build_curriculum_state(BANK, **OPTIONS))
    assert path.read_text() == "notes\n"


def test_an_unwritable_location_is_a_write_error(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(RunWriteError, match=f"cannot write {blocker / 'state.json'}"):
        write_curriculum_state(blocker / "state.json", build_curriculum_state(BANK, **OPTIONS))


# --------------------------------------------------------------------------- the providers


def test_the_group_provider_renders_its_chunks_and_says_what_was_drawn() -> None:
    curriculum = load_curriculum(STATE)
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))["assignments"]["state.json"]
    key, mode, skill_ids = next(row for row in golden if row[1] == "assisted" and len(row[2]) >= 2)
    provider = curriculum.skills_for(int(key))
    skills = provider.select({"task_id": 4, "sample_id": 0, "split": "train"})
    assert [s.skill_id for s in skills] == skill_ids
    assert all(s.metadata["selection_scope"] == "curriculum" for s in skills)
    assert skills[0].content == next(c.content for c in curriculum.chunks if c.skill_id == skill_ids[0])
    assert provider.identity() == {
        "provider": "skill_curriculum",
        "schema_version": "shopsimrl-skill-curriculum-v1",
        "round_id": "round-001",
        "state_id": curriculum.state_id,
        "group_key": key,
        "mode": mode,
        "skill_ids": skill_ids,
        "q": curriculum.skill_free_probability,
        "rho": {c.skill_id: c.inclusion_probability for c in curriculum.chunks},
    }
    full = curriculum.full_skills()
    assert [s.skill_id for s in full.select({"task_id": 1})] == ["choose-options", "price-check", "search-terms"]
    assert full.identity()["mode"] == "full"
    with pytest.raises(ValueError, match="private goal"):
        provider.select({"task_id": 4, "goal": {}})
    with pytest.raises(CurriculumError, match="group key"):
        curriculum.assign(True)
