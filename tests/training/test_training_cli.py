"""``shopsimrl training build-curriculum | prepare-data | check``: the files of a round and the
offline preflight, through the CLI (its exit codes and ``error: …`` lines)."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from shopsimrl.cli import app
from shopsimrl.training.curriculum import state_id_of

REPO = Path(__file__).resolve().parents[2]
SPLITS = REPO / "configs/splits/persona_splits.v1.json"
PROMPT = REPO / "configs/prompts/persona_single_turn.txt"
BANK = REPO / "tests/fixtures/curriculum/selected_skillbank.json"
DRAFT_BANK = REPO / "configs/gate_demo/initial_skillbank.json"
BUILD = ["--round-id", "round-001", "--skill-free-probability", "0.2", "--rho-min", "0.2", "--rho-max", "0.9"]


def shopsimrl(*args: str | Path) -> Any:
    return CliRunner().invoke(app, [str(a) for a in args], prog_name="shopsimrl")


class Round:
    """A round's inputs in a directory: bank, state, task data, prompt and the training config."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.bank = root / "gate" / "selected_skillbank.json"
        self.bank.parent.mkdir()
        shutil.copyfile(BANK, self.bank)
        self.state = root / "curricula" / "round-001.json"
        self.data = root / "data" / "shopsim_train.jsonl"
        self.prompt = root / "prompts" / "system.txt"
        self.prompt.parent.mkdir()
        shutil.copyfile(PROMPT, self.prompt)
        self.config = root / "training.yaml"
        built = shopsimrl("training", "build-curriculum", self.bank, self.state, *BUILD)
        assert built.exit_code == 0, built.output
        prepared = shopsimrl("training", "prepare-data", SPLITS, "train", self.data)
        assert prepared.exit_code == 0, prepared.output
        self.write()

    def write(self, **sections: str) -> None:
        default = {
            "run": "{name: round-001, output_dir: runs, concurrency: 16, seed: 20260901}",
            "tasks": f"{{split_file: {SPLITS}, split: train}}",
            "environment": "{base_url: 'http://127.0.0.1:5700', persona: true}",
            "runtime": "{max_steps: 30}",
            "prompt": "{system_prompt_file: prompts/system.txt}",
            "skills": "{path: null}",
            "filter": "{max_consecutive_unscored_groups: 8}",
            "curriculum": "{state: curricula/round-001.json, skillbank: gate/selected_skillbank.json}",
        }
        self.config.write_text("".join(f"{key}: {value}\n" for key, value in {**default, **sections}.items() if value))

    def check(self, data: Path | None = None) -> Any:
        return shopsimrl("training", "check", self.config, "--task-data", data or self.data)

    def forge_state(self, edit: Callable[[dict[str, Any]], None]) -> None:
        """Edit the state and give it the id of its new content, as a careless script would."""
        document = json.loads(self.state.read_text())
        edit(document)
        document["state_id"] = state_id_of(document)
        self.state.write_text(json.dumps(document))


def test_a_round_prepared_by_the_commands_checks_ready(tmp_path: Path) -> None:
    r = Round(tmp_path)
    result = r.check()
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    state = json.loads(r.state.read_text())
    assert report["status"] == "ready" and report["scope"] == "offline_inputs_only"
    assert report["split"]["name"] == "train" and report["split"]["task_count"] == 3726 and report["persona"] is True
    assert report["task_data"]["records"] == 3726 and report["task_data"]["path"] == str(r.data.resolve())
    assert report["curriculum"]["state_id"] == state["state_id"] and report["curriculum"]["state_id_rule"] == "content"
    assert [c["skill_id"] for c in report["curriculum"]["chunks"]] == ["choose-options", "price-check", "search-terms"]
    assert report["curriculum"]["skillbank_path"] == str(r.bank.resolve())
    assert report["run"] == {"seed": 20260901, "concurrency": 16} and report["runtime"] == {"max_steps": 30}
    assert report["prompt"]["system_prompt_file"] == str(r.prompt.resolve())
    assert report["run_dir"] == str(tmp_path / "runs" / "round-001")
    # Without a curriculum the same round checks ready too, with curriculum null.
    r.write(curriculum="")
    plain = r.check()
    assert plain.exit_code == 0, plain.output
    assert json.loads(plain.stdout)["curriculum"] is None


def _prompt_missing(r: Round) -> None:
    r.prompt.unlink()


@pytest.mark.parametrize(
    ("spoil", "words"),
    [
        # The curriculum against its bank.
        (
            lambda r: r.bank.write_text(r.bank.read_text().replace("0.04", "0.05")),
            r"was built from a skill bank with sha256 \w+ .*gate/selected_skillbank\.json has sha256",
        ),
        (
            lambda r: r.write(curriculum="{state: curricula/round-001.json, skillbank: " + str(DRAFT_BANK) + "}"),
            r"initial_skillbank\.json has sha256",
        ),
        (
            lambda r: r.forge_state(lambda d: d["chunks"][0].update(content="Buy the first item.")),
            r"chunks\[0\]\.content is 'Buy the first item\.'; the bank's enabled record 0 \('choose-options'\) has content",
        ),
        (lambda r: r.forge_state(lambda d: d["chunks"].pop()), r"has 2 chunks; .* has 3 enabled records"),
        (
            lambda r: r.forge_state(lambda d: d["chunks"][1].update(contribution=-0.04)),
            r"chunks\[1\] \('price-check'\)\.contribution must be a finite positive number, got -0\.04",
        ),
        (
            lambda r: r.state.write_text(r.state.read_text().replace('"seed": 20260901', '"seed": 1')),
            r"'state_id' \w+ matches neither its content",
        ),
        (lambda r: r.state.unlink(), r"cannot read curriculum state .*round-001\.json"),
        (lambda r: r.write(curriculum="{state: curricula/round-001.json}"), r"curriculum\.skillbank: .*required"),
        (lambda r: r.write(skills=f"{{path: {BANK}}}"), r"curriculum and skills\.path are mutually exclusive"),
        # The config's numbers.
        (lambda r: r.write(run="{concurrency: 0}"), r"run\.concurrency"),
        (lambda r: r.write(runtime="{max_steps: 0}"), r"runtime\.max_steps"),
        (lambda r: r.write(filter="{max_consecutive_unscored_groups: 0}"), r"filter\.max_consecutive_unscored_groups"),
        (lambda r: r.write(run="{concurrency: 2.5}"), r"run\.concurrency"),
        # The prompt file, the split and its persona.
        (_prompt_missing, r"cannot read system_prompt_file .*prompts/system\.txt"),
        (lambda r: r.write(environment="{persona: false}"), r"environment\.persona is False but split 'train' is persona=True"),
        (lambda r: r.write(tasks=f"{{split_file: {SPLITS}, split: test}}"), r"tasks\.split 'test' is .*held-out test split"),
        (
            lambda r: r.write(tasks=f"{{split_file: {SPLITS}, split: training}}"),
            r"split 'training' not found in .*persona_splits\.v1\.json; available: test, train, val",
        ),
        # The task data against the split.
        (
            lambda r: r.data.write_text("".join(r.data.read_text().splitlines(keepends=True)[1:])),
            r"shopsim_train\.jsonl lacks 1 of the 3726 tasks",
        ),
        (
            lambda r: r.data.write_text(r.data.read_text().replace('"split":"train"', '"split":"val"', 1)),
            r"shopsim_train\.jsonl line 1: metadata\.split is 'val'",
        ),
    ],
)
def test_a_spoiled_input_exits_2_naming_it(tmp_path: Path, spoil: Any, words: str) -> None:
    r = Round(tmp_path)
    spoil(r)
    result = r.check()
    assert result.exit_code == 2, result.output
    assert result.stdout == ""
    line = result.stderr.strip()
    assert line.startswith("error: ") and "\n" not in line, result.stderr
    assert re.search(words, line), line


def test_check_without_the_task_data_file_exits_2(tmp_path: Path) -> None:
    r = Round(tmp_path)
    result = r.check(tmp_path / "nowhere.jsonl")
    assert result.exit_code == 2 and "--task-data" in result.stderr and "nowhere.jsonl" in result.stderr


def test_build_curriculum_refuses_a_draft_bank_and_another_state_in_place(tmp_path: Path) -> None:
    out = tmp_path / "state.json"
    draft = shopsimrl("training", "build-curriculum", DRAFT_BANK, out, *BUILD)
    assert draft.exit_code == 2
    assert "has no numeric metadata.estimated_effect" in draft.stderr and "initial_skillbank.json" in draft.stderr
    assert not out.exists()
    first = shopsimrl("training", "build-curriculum", BANK, out, *BUILD)
    assert first.exit_code == 0, first.output
    report = json.loads(first.stdout)
    assert report["written"] is True and report["state_id_rule"] == "content" and report["seed"] == 20260901
    assert report["chunks"][0]["inclusion_probability"] == 0.8999999999999999
    before = out.read_bytes()
    again = shopsimrl("training", "build-curriculum", BANK, out, *BUILD)
    assert again.exit_code == 0 and json.loads(again.stdout)["written"] is False and out.read_bytes() == before
    other = shopsimrl("training", "build-curriculum", BANK, out, *BUILD, "--seed", "7")
    assert other.exit_code == 2 and f"{out.name} already holds curriculum state {report['state_id']}" in other.stderr
    assert out.read_bytes() == before
    bad = shopsimrl("training", "build-curriculum", BANK, tmp_path / "x.json", *BUILD[:-1], "1.5")
    assert bad.exit_code == 2 and "rho_max must be a number in [0, 1], got 1.5" in bad.stderr
    scaled = shopsimrl("training", "build-curriculum", BANK, tmp_path / "s.json", *BUILD, "--contribution-scale", "0.04")
    assert scaled.exit_code == 0, scaled.output
    assert json.loads((tmp_path / "s.json").read_text())["source"]["probability_mapping"]["scale_source"] == "explicit"


def test_prepare_data_refuses_the_test_split(tmp_path: Path) -> None:
    result = shopsimrl("training", "prepare-data", SPLITS, "test", tmp_path / "t.jsonl")
    assert result.exit_code == 2 and "held-out test split" in result.stderr and not (tmp_path / "t.jsonl").exists()


@pytest.mark.slow
def test_the_commands_run_as_a_process(tmp_path: Path) -> None:
    def run(*args: str | Path) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [sys.executable, "-m", "shopsimrl", *map(str, args)], capture_output=True, text=True, cwd=tmp_path, timeout=120
        )

    r = Round(tmp_path)
    ready = run("training", "check", r.config, "--task-data", r.data)
    assert ready.returncode == 0, ready.stderr
    assert json.loads(ready.stdout)["status"] == "ready"
    r.data.write_text("")
    empty = run("training", "check", r.config, "--task-data", r.data)
    assert empty.returncode == 2 and empty.stderr.startswith("error: task data ") and "lacks 3726 of the 3726" in empty.stderr
