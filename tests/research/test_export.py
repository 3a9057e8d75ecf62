"""Exporters: the SFT file in the chat format with nothing private by default, deduplicated with
a report; the judge input; the test split refused; the commands on a local, a sharded (moto S3)
and a v4 run."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import orjson
import pytest

from shopsimrl.manifest import build_manifest
from shopsimrl.records import read_trace, to_plain
from shopsimrl.research.export import (
    ExportError,
    _normalised_ids,
    check_sft_file,
    export_judge_input,
    export_sft,
    judge_input,
)
from shopsimrl.research.redaction import IDENTIFYING_PERSONA_FIELDS, ExportRefusedError, persona_of, public_persona
from shopsimrl.storage.local import LocalRunStore
from shopsimrl.storage.reading import open_run
from tests.sharded.conftest import cli

from .conftest import ResearchRuns
from .handmade import CATEGORY, GOAL_ASIN, PERSONA, Episode, good_episode, product, results


def _keys(value: Any) -> set[str]:
    if isinstance(value, dict):
        return set(value) | {key for item in value.values() for key in _keys(item)}
    if isinstance(value, list):
        return {key for item in value for key in _keys(item)}
    return set()


def _lines(path: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in path.read_bytes().splitlines()]


def _run_dir(tmp_path: Path, records: list[dict[str, Any]], name: str = "run") -> Path:
    """A run directory of these traces and no manifest (as the earlier implementation left them)."""
    store = LocalRunStore(tmp_path / name)
    store.save_traces([read_trace(record) for record in records])
    return store.run_dir


def _all_text(path: Path) -> str:
    """Every key and string value of a JSONL file, decoded (in the file itself quotes and line
    breaks are escaped, which would hide a leak from a substring search)."""
    parts: list[str] = []

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                parts.append(key)
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)
        elif isinstance(value, str):
            parts.append(value)

    for record in _lines(path):
        walk(record)
    return "\n".join(parts)


def _private_texts(run_location: Path | str) -> dict[str, set[str]]:
    """What must not appear in a default export, gathered from the run's own traces."""
    private: dict[str, set[str]] = {"reasoning": set(), "persona": set(), "goal": set()}
    for trace in open_run(run_location).records():
        persona = persona_of(trace)
        record = to_plain(trace)
        for step in record["steps"]:
            if step["model"].get("reasoning"):
                private["reasoning"].add(step["model"]["reasoning"])
        if persona:
            # The profile stays (the replies depend on it); what identifies the user does not.
            private["persona"].add(json.dumps(persona, ensure_ascii=False, sort_keys=True))
            private["persona"] |= {str(persona[key]) for key in IDENTIFYING_PERSONA_FIELDS if key in persona}
        goal = (record.get("final") or {}).get("goal") or {}
        for key in ("instruction_text", "task_uid"):
            if goal.get(key) and goal[key] != (record.get("reset") or {}).get("task_instruction"):
                private["goal"].add(str(goal[key]))
        reasoning = (goal.get("user_persona") or {}).get("__reasoning__")
        if reasoning:
            private["goal"].add(reasoning)
    return private


# --------------------------------------------------------------------------- SFT


@pytest.mark.slow
def test_sft_export_of_a_run_with_reasoning_leaves_out_reasoning_goal_and_who_the_user_is(
    reasoning_run: Path, tmp_path: Path
) -> None:
    private = _private_texts(reasoning_run)
    assert private["reasoning"] and private["persona"] and private["goal"], "the run must have something to leave out"
    report = export_sft(open_run(reasoning_run), tmp_path / "sft.jsonl", select="completed")
    output = tmp_path / "sft.jsonl"
    assert check_sft_file(output) == []
    text = _all_text(output)
    assert "reasoning" not in text and "weight" in text
    for kind, values in private.items():
        leaked = [value for value in values if value in text]
        assert not leaked, f"{kind} leaked: {leaked[:1]}"
    persona_report = report["redaction"].pop("persona")
    assert report["redaction"] == {"included": [], "left_out": ["reasoning", "goal"]}
    assert persona_report["identifying_fields"] == sorted(IDENTIFYING_PERSONA_FIELDS)
    assert persona_report["kept_episodes_with_fields_removed"] == {"用户ID": report["kept"]}
    assert persona_report["episodes_refused"] == 0
    assert report["records"] == len(_lines(output)) == sum(item["records"] for item in report["episodes"])
    # Every line is one model call of a kept episode, in the order the report lists them.
    episodes = report["episodes"]
    assert [item["first_line"] for item in episodes] == [
        1 + sum(e["records"] for e in episodes[:i]) for i in range(len(episodes))
    ]
    assert [item["episode_id"] for item in episodes] == sorted(item["episode_id"] for item in episodes)

    included = export_sft(
        open_run(reasoning_run), tmp_path / "full.jsonl", select="completed", include=frozenset({"reasoning", "persona"})
    )
    full = _all_text(tmp_path / "full.jsonl")
    assert check_sft_file(tmp_path / "full.jsonl", reasoning=True) == []
    assert check_sft_file(tmp_path / "full.jsonl") != [], "reasoning_content is refused where reasoning was not asked for"
    assert "reasoning_content" in full
    kept = {item["episode_id"] for item in included["episodes"]}
    for record in open_run(reasoning_run).records():
        if record.episode_id in kept:
            assert json.dumps(persona_of(record), ensure_ascii=False, sort_keys=True) in full
    assert not [value for value in private["goal"] if value in full]
    assert included["kept"] == report["kept"]


def _target_words(item: dict[str, Any]) -> set[str]:
    """The words (two characters or more) of the arguments of a record's target reply."""
    words: set[str] = set()
    for call in item["messages"][-1].get("tool_calls") or []:
        for value in json.loads(call["function"]["arguments"]).values():
            words |= {word for word in str(value).split() if len(word) >= 2}
    return words


@pytest.mark.slow
def test_sft_targets_keep_the_profile_their_words_come_from(reasoning_run: Path, tmp_path: Path) -> None:
    """The policy searches with words of the user's profile. Every word of a target that the
    profile holds is in that record's messages, so input and target still pair up; the report
    counts the records that depend on the profile, and none of them holds the user id."""
    records = {record.episode_id: record for record in open_run(reasoning_run).records()}
    report = export_sft(open_run(reasoning_run), tmp_path / "sft.jsonl", select="completed")
    lines = _lines(tmp_path / "sft.jsonl")
    dependent = 0
    for entry in report["episodes"]:
        persona = persona_of(records[entry["episode_id"]])
        public_text = json.dumps(public_persona(persona)[0], ensure_ascii=False)
        for item in lines[entry["first_line"] - 1 : entry["first_line"] - 1 + entry["records"]]:
            prompt = json.dumps(item["messages"][:-1], ensure_ascii=False)
            from_profile = {word for word in _target_words(item) if word in public_text}
            assert all(word in prompt for word in from_profile), (entry["episode_id"], from_profile)
            task = str(item["messages"][1]["content"])
            dependent += any(
                word not in task and word not in json.dumps(item["messages"][2:-1], ensure_ascii=False) for word in from_profile
            )
            assert persona["用户ID"] not in prompt
    assert dependent > 0, "the run must have targets that take words from the profile"
    assert report["redaction"]["persona"]["records_using_persona_words"] == dependent


@pytest.mark.slow
def test_sft_selects_successes_by_default(reasoning_run: Path, tmp_path: Path) -> None:
    run = open_run(reasoning_run)
    successes = {
        record["episode_id"]
        for record in map(to_plain, run.records())
        if (record.get("final") or {}).get("reward_detail", {}).get("r_success") == 1
    }
    report = export_sft(run, tmp_path / "sft.jsonl")
    assert report["selection"]["selected"] == len(successes) > 0
    assert {item["episode_id"] for item in report["episodes"]} | {
        d["episode_id"] for d in report["dropped"]["episodes"]
    } == successes
    assert report["selection"]["not_selected"] == {"not successful (r_success != 1)": 16 - len(successes)}


def _near_copy(record: dict[str, Any], sample_id: int) -> dict[str, Any]:
    """The same episode as another sample whose results page lists two other products."""
    text = json.dumps(record, ensure_ascii=False)
    for shelf_item in ("100000000029", "100000000028"):
        text = text.replace(shelf_item, "9" + shelf_item[1:])
    twin: dict[str, Any] = json.loads(text)
    twin["episode_id"] = f"task-{record['job']['task_id']:06d}__sample-{sample_id:03d}"
    twin["job"]["sample_id"] = sample_id
    return twin


def _long_episode(task_id: int, sample_id: int, query: str, *, repaired: bool = False) -> dict[str, Any]:
    """An episode with a long results page; its shelf of products depends on the task.
    ``repaired``: an unusable first reply, repaired, before the same actions."""
    episode = Episode(task_id, sample_id)
    if repaired:
        episode.protocol_error("tool_call_count")
    shelf = [(f"{task_id}{n:011d}", CATEGORY) for n in range(30)]
    episode.act("search", query, results((GOAL_ASIN, CATEGORY), *shelf, query=query))
    episode.act("click", GOAL_ASIN, product(GOAL_ASIN))
    episode.act("click", "颜色分类=白色", product(GOAL_ASIN, options=("颜色分类=黑色",)))
    return episode.purchase(GOAL_ASIN).done()


def test_exact_and_near_duplicates_are_dropped_and_reported(tmp_path: Path) -> None:
    first = _long_episode(1, 0, "护眼台灯")
    again = _long_episode(1, 1, "护眼台灯")  # the same calls, other call ids
    near = _near_copy(first, 2)
    repaired = _long_episode(1, 3, "护眼台灯", repaired=True)  # the same trajectory through the shop
    other = _long_episode(2, 0, "落地灯 客厅 大功率 暖光")
    unseparable = good_episode(3, 0)
    unseparable["conversation"][0]["content"] += f"\n用户个人文档（另一种写法）：{PERSONA['用户ID']}"
    failed = Episode(4, 0).fail("model_step_1", "ModelRequestError", "HTTP 503", "infrastructure").done()
    run = open_run(_run_dir(tmp_path, [other, near, repaired, again, first, unseparable, failed]))

    report = export_sft(run, tmp_path / "out" / "sft.jsonl")
    dropped = {item["episode_id"]: item for item in report["dropped"]["episodes"]}
    assert [item["episode_id"] for item in report["episodes"]] == ["task-000001__sample-000", "task-000002__sample-000"]
    assert dropped["task-000001__sample-001"] == {
        "episode_id": "task-000001__sample-001",
        "reason": "exact_duplicate",
        "of": "task-000001__sample-000",
    }
    assert (
        dropped["task-000001__sample-002"]["reason"] == "near_duplicate"
        and dropped["task-000001__sample-002"]["of"] == "task-000001__sample-000"
    )
    assert 0.9 <= dropped["task-000001__sample-002"]["similarity"] < 1.0
    assert dropped["task-000001__sample-003"] == {
        "episode_id": "task-000001__sample-003",
        "reason": "near_duplicate",
        "of": "task-000001__sample-000",
        "similarity": 1.0,
    }
    assert dropped["task-000003__sample-000"] == {
        "episode_id": "task-000003__sample-000",
        "reason": "unusable",
        "detail": "conversation[0] repeats an identifying persona field (用户ID): it cannot be removed from the pair",
    }
    assert report["redaction"]["persona"]["episodes_refused"] == 1
    assert report["dropped"]["by_reason"] == {"exact_duplicate": 1, "near_duplicate": 2, "unusable": 1}
    assert report["selection"] == {"select": "success", "episodes_in_run": 7, "selected": 6, "not_selected": {"not completed": 1}}
    assert report["coverage"]["tasks"] == {"in_run": 4, "selected": 3, "kept": 2}
    assert report["coverage"]["categories"] == {
        CATEGORY: {"in_run": 6, "selected": 6, "kept": 2},
        "unknown": {"in_run": 1, "selected": 0, "kept": 0},
    }
    assert report["kept"] == 2 and report["records"] == 8 == len(_lines(tmp_path / "out" / "sft.jsonl"))
    assert json.loads((tmp_path / "out" / "sft.report.json").read_text()) == report

    # A stricter threshold keeps the near copy; reading order never changes the outcome.
    strict = export_sft(
        open_run(_run_dir(tmp_path, [first, near, again, other], "run2")), tmp_path / "strict.jsonl", near_duplicate=1.0
    )
    assert [item["episode_id"] for item in strict["episodes"]] == [
        "task-000001__sample-000",
        "task-000001__sample-002",
        "task-000002__sample-000",
    ]


@pytest.mark.slow
def test_sft_refuses_what_it_cannot_export(research_runs: ResearchRuns, tmp_path: Path) -> None:
    run = open_run(research_runs.local)
    with pytest.raises(ExportError, match="never saw the goal"):
        export_sft(run, tmp_path / "sft.jsonl", include=frozenset({"goal"}))
    with pytest.raises(ExportError, match="choose success or completed"):
        export_sft(run, tmp_path / "sft.jsonl", select="all")
    assert not list(tmp_path.iterdir()), "nothing is written when the export is refused"


@pytest.mark.slow
def test_the_held_out_test_split_is_never_exported(research_runs: ResearchRuns, tmp_path: Path) -> None:
    # A run whose frozen plan is the held-out split (its manifest names it, fingerprint intact) ...
    held_out = tmp_path / "held-out"
    shutil.copytree(research_runs.local, held_out)
    manifest = json.loads((held_out / "manifest.json").read_text())
    plan = manifest["plan"] | {"test_guard": {"held_out_split": True, "final_test": True}}
    (held_out / "manifest.json").write_text(json.dumps(to_plain(build_manifest(plan))))
    for export in (export_sft, export_judge_input):
        with pytest.raises(ExportRefusedError, match="held-out test split"):
            export(open_run(held_out), tmp_path / "out" / "x.jsonl")
    # ... and traces without a manifest whose jobs are of the test split.
    bare = _run_dir(tmp_path, [good_episode(1, 0), good_episode(2, 0, split="test")], "bare")
    with pytest.raises(ExportRefusedError, match="task-000002__sample-000 belongs to the held-out test split"):
        export_sft(open_run(bare), tmp_path / "out" / "y.jsonl")
    assert not (tmp_path / "out").exists() or not any(p.suffix == ".jsonl" for p in (tmp_path / "out").iterdir())


# --------------------------------------------------------------------------- judge input


@pytest.mark.slow
def test_judge_input_shows_the_episode_but_no_reward_goal_persona_or_reasoning(reasoning_run: Path, tmp_path: Path) -> None:
    private = _private_texts(reasoning_run)
    report = export_judge_input(open_run(reasoning_run), tmp_path / "judge.jsonl")
    records = _lines(tmp_path / "judge.jsonl")
    assert report["records"] == len(records) == 16
    text = (tmp_path / "judge.jsonl").read_text(encoding="utf-8")
    for forbidden in (
        '"reward',
        '"r_success"',
        '"r_type"',
        '"goal"',
        '"persona"',
        '"reasoning"',
        '"labels"',
        '"instruction_text"',
    ):
        assert forbidden not in text, forbidden
    for kind, values in private.items():
        assert not [value for value in values if value in text], kind
    traces = {record.episode_id: to_plain(record) for record in open_run(reasoning_run).records()}
    for item in records:
        trace = traces[item["episode_id"]]
        assert item["task_instruction"] == trace["reset"]["task_instruction"]
        assert [entry["action"] for entry in item["transcript"]] == [step["action"] for step in trace["steps"]]
        assert item["outcome"]["termination_reason"] == trace["final"]["termination_reason"]

    export_judge_input(open_run(reasoning_run), tmp_path / "all.jsonl", include=frozenset({"goal", "persona", "reasoning"}))
    full = _lines(tmp_path / "all.jsonl")
    assert all(item["goal"] and "user_persona" not in item["goal"] and item["persona"] for item in full)
    assert any(entry.get("reasoning") for item in full for entry in item["transcript"])


def test_judge_input_of_a_failed_and_a_repaired_episode() -> None:
    repaired = Episode()
    repaired.protocol_error("mixed_content", content="看一下")
    repaired.act("search", "台灯", results((GOAL_ASIN, CATEGORY)))
    item = judge_input(read_trace(repaired.policy_failure().done()))
    assert [entry.get("protocol_error", {}).get("code") for entry in item["transcript"]] == ["mixed_content", None, None]
    assert item["transcript"][1]["feedback"] == {"valid": True, "reason": "executed", "message": "executed"}
    assert item["transcript"][2]["policy_failure"]["code"] == "generation_length"
    final_observation = item["outcome"].pop("final_observation")
    assert item["outcome"] == {
        "status": "completed",
        "completed": True,
        "steps": 3,
        "termination_reason": "generation_length",
        "purchase": None,
    }
    assert final_observation.startswith("页面：search_results")
    failed = judge_input(
        read_trace(Episode().fail("reset", "LeaseError", "no slot http://user:pw@shop", "infrastructure").done())
    )
    assert failed["outcome"] == {
        "status": "failed",
        "completed": False,
        "steps": 0,
        "error": {"stage": "reset", "type": "LeaseError"},
    }


# --------------------------------------------------------------------------- the commands on real runs


def _env(research_runs: ResearchRuns) -> dict[str, str]:
    base = {key: value for key, value in os.environ.items() if not key.startswith(("AWS_", "SHOPSIMRL_"))}
    return base | research_runs.env


@pytest.mark.slow
def test_local_and_sharded_exports_are_identical(research_runs: ResearchRuns, tmp_path: Path) -> None:
    """Two runs of one plan by a deterministic policy: the same file, but for the servers' random
    tool-call ids (numbered in order of appearance before comparing)."""
    for command in ("sft", "judge-input"):
        outputs = []
        for location in (str(research_runs.local), research_runs.sharded):
            output = tmp_path / f"{command}-{len(outputs)}.jsonl"
            done = cli("export", command, location, "-o", str(output), "--select", "completed", env=_env(research_runs))
            assert done.returncode == 0, done.stderr[-2000:]
            outputs.append([_normalised_ids([record]) for record in _lines(output)])
        assert outputs[0] == outputs[1] and outputs[0]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["local", "sharded", "legacy"])
def test_export_commands(research_runs: ResearchRuns, tmp_path: Path, kind: str) -> None:
    location = {"local": str(research_runs.local), "sharded": research_runs.sharded, "legacy": str(research_runs.legacy)}[kind]
    env = _env(research_runs)
    sft = cli("export", "sft", location, "-o", str(tmp_path / "sft.jsonl"), env=env)
    assert sft.returncode == 0, sft.stderr[-2000:]
    report = json.loads((tmp_path / "sft.report.json").read_text())
    assert check_sft_file(tmp_path / "sft.jsonl") == [] and report["records"] == len(_lines(tmp_path / "sft.jsonl")) > 0
    assert f"kept {report['kept']}" in sft.stdout and "report: " in sft.stdout
    assert report["run"]["kind"] == ("sharded" if kind == "sharded" else "local") and "testing-secret" not in json.dumps(report)

    judge = cli("export", "judge-input", location, "-o", str(tmp_path / "judge.jsonl"), "--select", "all", env=env)
    assert judge.returncode == 0, judge.stderr[-2000:]
    episodes = 6 if kind == "legacy" else research_runs.episodes
    assert len(_lines(tmp_path / "judge.jsonl")) == episodes and f"{episodes} records" in judge.stdout


@pytest.mark.slow
@pytest.mark.parametrize(
    ("arguments", "message"),
    [
        (["sft", "{run}", "-o", "{tmp}/x.jsonl", "--include", "thoughts"], "thoughts cannot be included"),
        (["sft", "{run}", "-o", "{tmp}/x.jsonl", "--include", "goal"], "never saw the goal"),
        (["sft", "{run}", "-o", "{tmp}/x.jsonl", "--select", "all"], "choose success or completed"),
        (["sft", "{run}", "-o", "{tmp}/x.jsonl", "--near-duplicate", "0"], "--near-duplicate must be in (0, 1]"),
        (["sft", "{run}", "-o", "{run}/sft.jsonl"], "inside the run"),
        (["judge-input", "{run}", "-o", "{tmp}/x.jsonl", "--select", "some"], "choose one of success, completed, all"),
        (["judge-input", "{tmp}/nowhere", "-o", "{tmp}/x.jsonl"], "does not exist"),
        (["judge-input", "{run}", "-o", "/proc/x.jsonl"], "/proc/x.jsonl: cannot write"),
    ],
)
def test_export_bad_input_exits_2_naming_it(
    research_runs: ResearchRuns, tmp_path: Path, arguments: list[str], message: str
) -> None:
    filled = [argument.format(run=research_runs.local, tmp=tmp_path) for argument in arguments]
    done = cli("export", *filled, env=_env(research_runs))
    assert done.returncode == 2, done.stdout + done.stderr
    assert message in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "x.jsonl").exists() and not (research_runs.local / "sft.jsonl").exists()
