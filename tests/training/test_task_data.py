"""slime's prompt data (shopsimrl/training/task_data.py): written from the frozen split, read back
by the preflight line by line."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest

from shopsimrl.tasks import load_task_split
from shopsimrl.training.task_data import TaskDataError, check_task_data, write_task_data

REPO = Path(__file__).resolve().parents[2]
SPLITS = REPO / "configs/splits/persona_splits.v1.json"
TRAIN_IDS: list[int] = json.loads(SPLITS.read_text())["splits"]["train"]["task_ids"]


def test_every_frozen_train_id_once_in_the_reference_line_schema(tmp_path: Path) -> None:
    out = tmp_path / "data" / "shopsim_train.jsonl"
    summary = write_task_data(SPLITS, "train", out)
    data = out.read_bytes()
    lines = data.decode("utf-8").split("\n")
    assert lines[-1] == "" and len(lines) - 1 == len(TRAIN_IDS) == 3726 == summary.records
    # The earlier implementation's bytes: compact JSON, prompt first, metadata keys in this order.
    for line, task_id in zip(lines, TRAIN_IDS, strict=False):
        assert line == (
            f'{{"prompt":"{task_id}","metadata":{{"schema_version":"shopsimrl-slime-tasks-v1","task_id":{task_id},"split":"train"}}}}'
        )
    assert summary.sha256 == hashlib.sha256(data).hexdigest()
    assert summary.to_dict()["split"]["task_ids_sha256"] == load_task_split(SPLITS, "train").identity()["task_ids_sha256"]
    assert sorted(p.name for p in out.parent.iterdir()) == ["shopsim_train.jsonl"], "no temporary file left"
    # Written again over an older file: replaced whole.
    out.write_text("old\n")
    write_task_data(SPLITS, "train", out)
    assert out.read_bytes() == data
    assert check_task_data(out, load_task_split(SPLITS, "train")).records == 3726


def test_the_held_out_test_split_is_never_written(tmp_path: Path) -> None:
    out = tmp_path / "test.jsonl"
    with pytest.raises(TaskDataError, match=r"'test' .*held-out test split"):
        write_task_data(SPLITS, "test", out)
    assert not out.exists()


def _lines(task_ids: list[int], split: str = "train") -> list[dict[str, Any]]:
    return [
        {"prompt": str(t), "metadata": {"schema_version": "shopsimrl-slime-tasks-v1", "task_id": t, "split": split}}
        for t in task_ids
    ]


@pytest.mark.parametrize(
    ("edit", "words"),
    [
        (lambda rows: rows.pop(100), r"lacks 1 of the 3726 tasks of split 'train' \(\d+\)"),
        (lambda rows: rows.__delitem__(slice(0, 7)), r"lacks 7 of the 3726 tasks .*, …\)"),
        (lambda rows: rows.insert(5, rows[2]), r"line 6: task \d+ appears a second time \(first on line 3\)"),
        (lambda rows: rows[9]["metadata"].update(schema_version="v0"), r"line 10: metadata\.schema_version is 'v0'"),
        (lambda rows: rows[0]["metadata"].update(split="val"), r"line 1: metadata\.split is 'val', the config trains on 'train'"),
        (lambda rows: rows[3].update(prompt="find shoes"), r"line 4: prompt is 'find shoes', expected the task id"),
        (lambda rows: rows[3]["metadata"].update(task_id="4"), r"line 4: metadata\.task_id must be an integer"),
        (lambda rows: rows[3].update(label="x"), r"line 4: must be an object with exactly the keys \['metadata', 'prompt'\]"),
        (lambda rows: rows[3]["metadata"].pop("split"), r"line 4: metadata must be an object with exactly the keys"),
        (
            lambda rows: rows.append(_lines([999_999])[0]),
            r"line 3727: task 999999 is not in split 'train' of persona_splits\.v1\.json",
        ),
    ],
)
def test_task_data_that_does_not_hold_the_split_once_is_refused_naming_the_line(tmp_path: Path, edit: Any, words: str) -> None:
    rows = _lines(TRAIN_IDS)
    edit(rows)
    path = tmp_path / "train.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    with pytest.raises(TaskDataError, match=words) as caught:
        check_task_data(path, load_task_split(SPLITS, "train"))
    assert str(path) in str(caught.value)


def test_a_line_that_is_not_json_or_a_blank_line_is_named(tmp_path: Path) -> None:
    path = tmp_path / "train.jsonl"
    text = "".join(json.dumps(row) + "\n" for row in _lines(TRAIN_IDS))
    path.write_text(text.replace("\n", "\n\n", 1))
    with pytest.raises(TaskDataError, match=f"task data {path} line 2: not a JSON object"):
        check_task_data(path, load_task_split(SPLITS, "train"))
    path.write_bytes(b"\xff\n")
    with pytest.raises(TaskDataError, match="not valid UTF-8"):
        check_task_data(path, load_task_split(SPLITS, "train"))
    with pytest.raises(TaskDataError, match="cannot read task data"):
        check_task_data(tmp_path / "missing.jsonl", load_task_split(SPLITS, "train"))
