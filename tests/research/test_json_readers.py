"""User-given JSON files the gate reads are strict JSON: NaN or Infinity in one, or text that is
not JSON, is refused with an error naming the file (and the line and column of bad JSON). The
skills stages' own JSONL files keep each id's latest record, ignore a torn last line and name the
line of anything else."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from shopsimrl.research.gate.drafts import DraftError, load_gate_a_draft
from shopsimrl.research.gate.freeze import GATE_PLAN_FILE, GatePlanError, read_gate_plan
from shopsimrl.research.skills.analyst import SkillInputError, read_latest_records


@pytest.mark.parametrize("constant", ["NaN", "Infinity", "-Infinity"])
def test_a_gate_a_draft_holding_a_non_finite_number_is_refused(tmp_path: Path, constant: str) -> None:
    draft, bank = tmp_path / "draft.json", tmp_path / "bank.json"
    draft.write_text('{"chunks": [], "budget": ' + constant + "}", encoding="utf-8")
    bank.write_text('{"skills": []}', encoding="utf-8")
    with pytest.raises(DraftError) as refused:
        load_gate_a_draft(draft, bank, None)
    assert str(refused.value) == f"the skill draft {draft} is not valid JSON: {constant} is not JSON"


def test_a_gate_a_draft_that_is_missing_or_not_json_is_refused_naming_where(tmp_path: Path) -> None:
    draft, bank = tmp_path / "draft.json", tmp_path / "bank.json"
    with pytest.raises(DraftError, match=f"^the skill draft {draft} does not exist$"):
        load_gate_a_draft(draft, bank, None)
    draft.write_text('{\n  "chunks": [,]\n}', encoding="utf-8")
    with pytest.raises(DraftError, match=rf"^the skill draft {draft} is not valid JSON at line 2 column 14: "):
        load_gate_a_draft(draft, bank, None)


def test_a_gate_plan_holding_nan_or_bad_json_is_refused_naming_the_file(tmp_path: Path) -> None:
    assert read_gate_plan(tmp_path) is None  # no plan yet: nothing to read
    path = tmp_path / GATE_PLAN_FILE
    path.write_text('{"schema_version": "x", "shards": NaN}', encoding="utf-8")
    with pytest.raises(GatePlanError) as refused:
        read_gate_plan(tmp_path)
    assert str(refused.value) == f"the gate plan {path} is not valid JSON: NaN is not JSON"
    path.write_bytes(b'{"schema_version": "\xff"}')
    with pytest.raises(GatePlanError, match=rf"^the gate plan {path} is not valid UTF-8 \(byte offset 20\)$"):
        read_gate_plan(tmp_path)


def test_the_stages_jsonl_files_keep_the_latest_record_and_ignore_a_torn_tail(tmp_path: Path) -> None:
    path = tmp_path / "cards.jsonl"
    first = {"card_version": "v1", "episode_id": "a", "n": 1}
    later = {"card_version": "v1", "episode_id": "a", "n": 2}
    other = {"card_version": "v1", "episode_id": "b", "n": 3}
    torn = b'{"card_version": "v1", "episode_id": "c"'
    path.write_bytes(b"".join(json.dumps(r).encode() + b"\n" for r in (first, other, later)) + torn)
    found = read_latest_records(path, key="episode_id", version_key="card_version", version="v1", what="failure card")
    assert found == {"a": later, "b": other}
    assert read_latest_records(tmp_path / "absent.jsonl", key="episode_id", version_key="v", version="v1", what="x") == {}


@pytest.mark.parametrize(
    ("line", "message"),
    [
        (b"not json", r"cards\.jsonl:2: not a failure card record \(v1\)"),
        (b'{"card_version": "v0", "episode_id": "b"}', r"cards\.jsonl:2: not a failure card record \(v1\)"),
        (b'{"card_version": "v1", "episode_id": 7}', r"cards\.jsonl:2: episode_id must be a string"),
    ],
)
def test_a_line_of_another_kind_is_refused_naming_file_and_line(tmp_path: Path, line: bytes, message: str) -> None:
    path = tmp_path / "cards.jsonl"
    path.write_bytes(b'{"card_version": "v1", "episode_id": "a"}\n' + line + b"\n")
    with pytest.raises(SkillInputError, match=message):
        read_latest_records(path, key="episode_id", version_key="card_version", version="v1", what="failure card")
