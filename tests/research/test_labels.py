"""Rule labels: each label on a hand-made trace that shows it (and a near miss that must not),
the counts, the labels file, and the command on a local, a sharded (moto S3) and a v4 run."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import orjson
import pytest

from shopsimrl.records import EpisodeTrace, read_trace
from shopsimrl.research.episodes import episode_row
from shopsimrl.research.labels import (
    LABELS_VERSION,
    TAXONOMY,
    LabelsFileError,
    episode_labels,
    label_counts,
    read_labels,
    write_labels,
)
from shopsimrl.research.outputs import OutputLocationError
from shopsimrl.storage.reading import open_run
from tests.sharded.conftest import cli

from .conftest import FIXTURES, ResearchRuns
from .handmade import CATEGORY, GOAL_ASIN, Episode, good_episode, product, results, search_home

OTHER = "100000000002"
ELSEWHERE = "900000000009"


def labelled(record: dict) -> dict:  # type: ignore[type-arg]
    labels = episode_labels(read_trace(record))
    assert labels["labels_version"] == LABELS_VERSION
    assert labels["labels"] == [name for name in TAXONOMY if name in labels["labels"]], "taxonomy order"
    assert set(labels["details"]) == set(labels["labels"])
    return labels


def test_a_clean_success_has_no_label() -> None:
    labels = labelled(good_episode())
    assert labels["labels"] == [] and labels["outcome"]["success"] == 1 and labels["category"] == CATEGORY


def test_retrieval_failure_when_no_relevant_product_was_reached() -> None:
    episode = Episode()
    episode.act("search", "灯", results((ELSEWHERE, "家电›厨房›电饭煲")))
    episode.act("click", ELSEWHERE, product(ELSEWHERE, "家电›厨房›电饭煲"))
    record = episode.purchase(ELSEWHERE, r_type=0.0, r_att=0.0).done()
    labels = labelled(record)
    assert labels["labels"] == ["retrieval_failure", "wrong_product"]
    (evidence,) = labels["details"]["retrieval_failure"]["evidence"]
    assert evidence["goal_asin"] == GOAL_ASIN and evidence["searches"] == [{"step": 1, "query": "灯", "results": 1}]
    assert labels["details"]["wrong_product"]["evidence"][0]["goal_listed_at_step"] is None


def test_a_product_of_the_goal_category_counts_as_reached_and_no_search_is_no_retrieval_failure() -> None:
    episode = Episode()
    episode.act("search", "台灯", results((OTHER, CATEGORY)))
    episode.act("click", OTHER, product(OTHER))
    labels = labelled(episode.purchase(OTHER, r_att=0.5).done())
    assert "retrieval_failure" not in labels["labels"]

    never_searched = Episode().policy_failure().done()
    assert labelled(never_searched)["labels"] == ["generation_length"]


def test_wrong_product_points_at_the_purchase_the_opening_and_the_goal_listing() -> None:
    episode = Episode()
    episode.act("search", "台灯", results((GOAL_ASIN, CATEGORY), (OTHER, CATEGORY)))
    episode.act("click", OTHER, product(OTHER))
    episode.act("click", "颜色分类=白色", product(OTHER, options=("颜色分类=黑色",)))
    labels = labelled(episode.purchase(OTHER, r_att=0.5).done())
    assert labels["labels"] == ["wrong_product"]
    (evidence,) = labels["details"]["wrong_product"]["evidence"]
    assert evidence == {
        "step": 4,
        "purchased_asin": OTHER,
        "goal_asin": GOAL_ASIN,
        "opened_at_step": 2,
        "goal_listed_at_step": 1,
        "r_type": 1.0,
        "r_att": 0.5,
    }


def test_missing_and_wrong_options() -> None:
    missing = Episode()
    missing.act("search", "台灯", results((GOAL_ASIN, CATEGORY)))
    missing.act("click", GOAL_ASIN, product(GOAL_ASIN))
    labels = labelled(missing.purchase(GOAL_ASIN, r_option=0.0).done())
    assert labels["labels"] == ["wrong_or_missing_options"]
    assert labels["details"]["wrong_or_missing_options"]["codes"] == {"missing": 1}

    wrong = Episode()
    wrong.act("search", "台灯", results((GOAL_ASIN, CATEGORY)))
    wrong.act("click", GOAL_ASIN, product(GOAL_ASIN))
    wrong.act("click", "颜色分类=黑色", product(GOAL_ASIN, options=("颜色分类=白色",)))
    labels = labelled(wrong.purchase(GOAL_ASIN, r_option=0.0).done())
    details = labels["details"]["wrong_or_missing_options"]
    assert details["codes"] == {"wrong": 1}
    assert details["evidence"][0]["chosen"] == {"颜色分类": "黑色"} and details["evidence"][0]["option_clicks"] == [3]


def test_budget_violation_over_budget() -> None:
    episode = Episode()
    episode.act("search", "台灯", results((GOAL_ASIN, CATEGORY)))
    episode.act("click", GOAL_ASIN, product(GOAL_ASIN))
    episode.act("click", "颜色分类=白色", product(GOAL_ASIN, options=("颜色分类=黑色",)))
    labels = labelled(episode.purchase(GOAL_ASIN, r_price=0.0).done())
    assert labels["labels"] == ["budget_violation"]
    details = labels["details"]["budget_violation"]
    assert details["codes"] == {"over_budget": 1}
    assert details["evidence"][0] == {
        "step": 4,
        "price": 250.0,
        "price_upper": 200.0,
        "resolution": "pass",
        "method": "selected_price_axis",
    }


def test_invalid_actions_by_feedback_code() -> None:
    episode = Episode()
    episode.act("search", "台灯", results((GOAL_ASIN, CATEGORY)))
    episode.act("click", GOAL_ASIN, product(GOAL_ASIN))
    episode.act("click", "buy now", reason="incomplete_options")
    episode.act("click", "颜色分类=白色", product(GOAL_ASIN, options=("颜色分类=黑色",)))
    episode.act("click", "颜色分类=白色", reason="already_selected")
    labels = labelled(episode.purchase(GOAL_ASIN).done())
    assert labels["labels"] == ["invalid_action"]
    details = labels["details"]["invalid_action"]
    assert details["codes"] == {"already_selected": 1, "incomplete_options": 1}
    assert [item["step"] for item in details["evidence"]] == [3, 5]


def test_repeated_action_on_the_same_page() -> None:
    episode = Episode()
    listing = results((GOAL_ASIN, CATEGORY))
    episode.act("search", "台灯", listing)
    episode.act("click", "back to search", search_home())
    episode.act("search", "台灯", listing)
    episode.act("click", "back to search", search_home())  # the same page, the same action: step 2 again
    labels = labelled(episode.action_limit(by_environment=False).done())
    assert "repeated_action" in labels["labels"]
    assert labels["details"]["repeated_action"]["evidence"] == [{"step": 4, "action": "click[back to search]", "repeats_step": 2}]

    # Opening a product again from a page that reads differently (it shows another last action) is not a repeat.
    varied = Episode()
    varied.act("search", "台灯", listing)
    varied.act("click", GOAL_ASIN, product(GOAL_ASIN))
    varied.act("click", "< prev", listing)
    varied.act("click", GOAL_ASIN, product(GOAL_ASIN))
    assert "repeated_action" not in labelled(varied.action_limit(by_environment=False).done())["labels"]


def test_protocol_errors_by_code() -> None:
    episode = Episode()
    episode.protocol_error("tool_call_count")
    episode.protocol_error("mixed_content", content="我想想")
    episode.protocol_error("invalid_arguments_json", with_call=True)
    episode.act("search", "台灯", results((GOAL_ASIN, CATEGORY)))
    episode.act("click", GOAL_ASIN, product(GOAL_ASIN))
    episode.act("click", "颜色分类=白色", product(GOAL_ASIN, options=("颜色分类=黑色",)))
    labels = labelled(episode.purchase(GOAL_ASIN).done())
    assert labels["labels"] == ["protocol_error"]
    assert labels["details"]["protocol_error"]["codes"] == {"invalid_arguments_json": 1, "mixed_content": 1, "tool_call_count": 1}
    assert [item["step"] for item in labels["details"]["protocol_error"]["evidence"]] == [1, 2, 3]


@pytest.mark.parametrize("code", ["generation_length", "context_length"])
def test_generation_and_context_length(code: str) -> None:
    episode = Episode()
    episode.act("search", "台灯", results((GOAL_ASIN, CATEGORY)))
    labels = labelled(episode.policy_failure(code).done())
    assert labels["labels"] == [code]
    finish_reason = "length" if code == "generation_length" else None  # a refused prompt generates nothing
    assert labels["details"][code]["evidence"] == [{"step": 2, "finish_reason": finish_reason}]


@pytest.mark.parametrize(("by_environment", "code"), [(True, "environment"), (False, "runtime")])
def test_action_limit_says_who_counted(by_environment: bool, code: str) -> None:
    episode = Episode(max_steps=2)
    episode.act("search", "台灯", results((GOAL_ASIN, CATEGORY)))
    episode.act("click", GOAL_ASIN, product(GOAL_ASIN))
    labels = labelled(episode.action_limit(by_environment=by_environment).done())
    assert labels["labels"] == ["action_limit"]
    assert labels["details"]["action_limit"] == {"codes": {code: 1}, "evidence": [{"step": 2, "model_steps": 2, "actions": 2}]}


def test_infrastructure_failure_points_at_the_step_that_failed() -> None:
    episode = Episode()
    episode.act("search", "台灯", results((GOAL_ASIN, CATEGORY)))
    record = episode.fail("environment_step_2", "EnvironmentUnavailableError", "shop unreachable", "infrastructure").done()
    labels = labelled(record)
    assert labels["labels"] == ["infrastructure_failure"]
    assert labels["details"]["infrastructure_failure"]["evidence"] == [
        {"step": 2, "stage": "environment_step_2", "error_type": "EnvironmentUnavailableError", "message": "shop unreachable"}
    ]
    assert labels["outcome"]["completed"] is False


@pytest.mark.parametrize(
    ("failure_class", "error_type", "message", "label", "code", "inferred"),
    [
        ("environment_error", "ShopEnvironmentError", "HTTP 500", "episode_error", "environment_error", False),
        (
            None,
            "ModelRequestError",
            "model request failed after 3 attempts: HTTP 503",
            "infrastructure_failure",
            "infrastructure",
            True,
        ),
        (None, "ModelRequestError", "HTTP 400: bad request", "episode_error", "model_error", True),
        (None, "RuntimeError", "custom runtime crashed", "episode_error", "runtime_error", True),
    ],
)
def test_failures_by_class_and_legacy_inference(
    failure_class: str | None, error_type: str, message: str, label: str, code: str, inferred: bool
) -> None:
    record = Episode().fail("model_step_1", error_type, message, failure_class).done()
    labels = labelled(record)
    assert labels["labels"] == [label]
    assert labels["details"][label]["codes"] == {code: 1}
    assert labels["details"][label]["evidence"][0].get("inferred_class", False) is inferred


def test_label_counts_count_episodes_once_per_label() -> None:
    repeated = Episode()
    repeated.protocol_error("tool_call_count")
    repeated.protocol_error("tool_call_count")
    repeated.protocol_error("mixed_content", content="嗯")
    records = [episode_labels(read_trace(good_episode())), episode_labels(read_trace(repeated.policy_failure().done()))]
    counts = label_counts(records)
    assert counts.episodes == 2 and counts.clean == 1
    assert list(counts.labels) == list(TAXONOMY)
    assert counts.labels["protocol_error"] == 1 and counts.labels["generation_length"] == 1
    assert sum(counts.labels.values()) == 2
    assert counts.codes == {"protocol_error": {"mixed_content": 1, "tool_call_count": 1}}
    assert counts.to_dict()["labels"]["wrong_product"] == 0


def test_reading_a_labels_file_names_the_bad_line(tmp_path: Path) -> None:
    path = tmp_path / "labels.jsonl"
    good = orjson.dumps(episode_labels(read_trace(good_episode()))).decode()
    path.write_text(good + "\n\n" + good.replace(LABELS_VERSION, "shopsimrl-labels-v0") + "\n")
    with pytest.raises(LabelsFileError, match=r"labels\.jsonl:3: labels_version 'shopsimrl-labels-v0'"):
        list(read_labels(path))
    path.write_text(good + "\n{not json\n")
    with pytest.raises(LabelsFileError, match=r"labels\.jsonl:2: not a JSON line"):
        list(read_labels(path))
    with pytest.raises(LabelsFileError, match="cannot read"):
        list(read_labels(tmp_path / "missing.jsonl"))


# --------------------------------------------------------------------------- real runs


def _consistent(record: EpisodeTrace, labels: dict) -> None:  # type: ignore[type-arg]
    """What the labels say agrees with the trace's own outcome."""
    row = episode_row(record)
    names = set(labels["labels"])
    if row["success"] == 1:
        assert not names & {"wrong_product", "wrong_or_missing_options", "budget_violation", "retrieval_failure"}
    if "wrong_product" in names:
        assert min(row.get("r_type", 1), row.get("r_att", 1)) < 1
    assert ("protocol_error" in names) == (row["protocol_errors"] > 0)
    assert ("invalid_action" in names) == (row["invalid_actions"] > 0)
    assert ("action_limit" in names) == (row["termination_reason"] == "action_limit")
    assert (not row["completed"]) == bool(names & {"infrastructure_failure", "episode_error"})


@pytest.mark.slow
def test_labels_of_local_and_sharded_runs_agree_and_follow_the_traces(
    research_runs: ResearchRuns, s3_env: dict[str, str], tmp_path: Path
) -> None:
    local = open_run(research_runs.local)
    counts = write_labels(local, tmp_path / "local.jsonl")
    write_labels(open_run(research_runs.sharded), tmp_path / "sharded.jsonl")
    assert (tmp_path / "local.jsonl").read_bytes() == (tmp_path / "sharded.jsonl").read_bytes()
    records = {record.episode_id: record for record in local.records()}
    labels = list(read_labels(tmp_path / "local.jsonl"))
    assert counts.episodes == len(labels) == research_runs.episodes
    assert [item["episode_id"] for item in labels] == sorted(records)
    for item in labels:
        _consistent(records[item["episode_id"]], item)
    assert label_counts(local) == counts == label_counts(labels)


@pytest.mark.slow
def test_labels_are_never_written_into_the_run(research_runs: ResearchRuns, tmp_path: Path) -> None:
    with pytest.raises(OutputLocationError, match="inside the run"):
        write_labels(open_run(research_runs.local), research_runs.local / "labels.jsonl")
    assert not (research_runs.local / "labels.jsonl").exists()


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["local", "sharded", "legacy"])
def test_labels_command(research_runs: ResearchRuns, tmp_path: Path, kind: str) -> None:
    location = {"local": str(research_runs.local), "sharded": research_runs.sharded, "legacy": str(research_runs.legacy)}[kind]
    output = tmp_path / "out" / "episode_labels.jsonl"
    done = cli("labels", location, "-o", str(output), env={**_env(), **research_runs.env})
    assert done.returncode == 0, done.stderr[-2000:]
    labels = list(read_labels(output))
    assert len(labels) == (6 if kind == "legacy" else research_runs.episodes)
    assert f"{len(labels)} episodes" in done.stdout and "labels: " in done.stdout
    for name in TAXONOMY:
        assert name in done.stdout
    if kind == "legacy":
        by_id = {item["episode_id"]: item["labels"] for item in labels}
        assert by_id == {
            "task-000003__sample-000": [],
            "task-000004__sample-000": ["invalid_action", "action_limit"],
            "task-000005__sample-001": ["generation_length"],
            "task-000006__sample-000": ["wrong_product", "wrong_or_missing_options", "protocol_error"],
            "task-000009__sample-000": ["infrastructure_failure"],
            "task-000011__sample-000": ["episode_error"],
        }


@pytest.mark.slow
def test_labels_command_bad_input(research_runs: ResearchRuns, tmp_path: Path) -> None:
    missing = cli("labels", str(tmp_path / "nowhere"), "-o", str(tmp_path / "l.jsonl"), env=_env())
    assert missing.returncode == 2 and "does not exist" in missing.stderr and "Traceback" not in missing.stderr
    inside = cli("labels", str(research_runs.local), "-o", str(research_runs.local / "l.jsonl"), env=_env())
    assert inside.returncode == 2 and "inside the run" in inside.stderr


def _env() -> dict[str, str]:
    import os

    return {key: value for key, value in os.environ.items() if not key.startswith(("AWS_", "SHOPSIMRL_"))}


@pytest.mark.slow
def test_labels_are_written_beside_the_run_by_default(tmp_path: Path) -> None:
    run = tmp_path / "runs" / "legacy-run"
    run.mkdir(parents=True)
    (run / "traces.jsonl").write_bytes((FIXTURES / "legacy_v4_traces.jsonl").read_bytes())
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = subprocess.run(
        [sys.executable, "-m", "shopsimrl", "labels", str(run)],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        env=_env(),
        timeout=180,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    beside = tmp_path / "runs" / "legacy-run.labels.jsonl"
    assert len(list(read_labels(beside))) == 6 and f"labels: {beside}" in done.stdout
    assert list(elsewhere.iterdir()) == [] and sorted(p.name for p in run.iterdir()) == ["traces.jsonl"]

    remote = subprocess.run(
        [sys.executable, "-m", "shopsimrl", "labels", "s3://bucket/runs/x"],
        capture_output=True,
        text=True,
        cwd=elsewhere,
        env=_env(),
    )
    assert remote.returncode == 2 and "-o/--output" in remote.stderr and list(elsewhere.iterdir()) == []
