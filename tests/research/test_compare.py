"""``shopsimrl compare`` on real testbed runs (local, sharded on moto S3, v4 traces), and its
pairing and population rules on runs written for the purpose."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shopsimrl.metrics import student_t_quantile, wilson_interval
from shopsimrl.records import read_trace
from shopsimrl.research.compare import CompareError, compare_loaded, compare_runs, format_comparison, load_run
from shopsimrl.research.labels import TAXONOMY, label_counts
from shopsimrl.research.paired_stats import cluster_sums, holm_adjust, mcnemar_exact, percentile_interval, resampled_differences
from shopsimrl.schemas import TRACE_SCHEMA_VERSION, fingerprint
from shopsimrl.storage.local import LocalRunStore
from shopsimrl.storage.reading import open_run

from .conftest import ResearchRuns

REPO = Path(__file__).resolve().parents[2]


def shopsimrl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    import os

    return subprocess.run(
        [sys.executable, "-m", "shopsimrl", *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env={**os.environ, **(env or {})},
        timeout=300,
    )


def metric(comparison: dict[str, Any], name: str) -> dict[str, Any]:
    return next(entry for entry in comparison["metrics"] if entry["metric"] == name)


# --------------------------------------------------------------------------- the Done-means check


@pytest.mark.slow
def test_the_naive_policy_is_found_worse_with_an_interval_excluding_zero(research_runs: ResearchRuns, naive_run: Path) -> None:
    """Two testbed runs of one plan, the second served by SHOPSIM_POLICY_STRATEGY=naive."""
    result = compare_runs([str(research_runs.local), str(naive_run)])
    (comparison,) = result["comparisons"]
    assert comparison["plan_differences"] == [] and comparison["episodes"] == research_runs.episodes
    reward, success = metric(comparison, "reward"), metric(comparison, "success")
    assert reward["difference"] < 0 and reward["ci95"][1] < 0, reward
    assert success["difference"] < 0 and success["mcnemar"]["only_a"] > success["mcnemar"]["only_b"], success
    assert metric(comparison, "r_option")["difference"] < 0  # it never chooses the options asked for
    per_task = comparison["per_task"]
    assert per_task["loss"] > per_task["win"] and per_task["win"] + per_task["tie"] + per_task["loss"] == research_runs.episodes
    # The run blocks are each run's summary.json headline, and the paired means agree with it
    # when every episode completed in both runs.
    for block, location in zip(result["runs"], (research_runs.local, naive_run), strict=True):
        summary = json.loads((location / "summary.json").read_text())
        assert block["reward_mean"] == pytest.approx(summary["primary"]["reward_mean"])
        assert block["reward_ci95"] == pytest.approx(summary["primary"]["reward_ci95"])
    assert reward["a"] == pytest.approx(result["runs"][0]["reward_mean"]) and reward["b"] == pytest.approx(
        result["runs"][1]["reward_mean"]
    )
    text = format_comparison(result)
    assert "plan differences: none" in text and "McNemar p=" in text
    # Rule labels, labelled from the traces: each run's counts are those of `shopsimrl labels`,
    # and per label the paired episodes that gained or lost it.
    for block, location in zip(result["runs"], (research_runs.local, naive_run), strict=True):
        assert block["labels"] == label_counts(open_run(location)).to_dict()
    labels = {row["label"]: row for row in comparison["labels"]["rows"]}
    assert list(labels) == list(TAXONOMY) and comparison["labels"]["episodes"] == research_runs.episodes
    for row in labels.values():
        assert row["a"] + row["gained"] - row["lost"] == row["b"], row
    options = labels["wrong_or_missing_options"]
    assert options["gained"] > 0 and options["b"] == result["runs"][1]["labels"]["labels"]["wrong_or_missing_options"]
    line = next(line for line in text.splitlines() if line.strip().startswith("wrong_or_missing_options"))
    assert line.split() == [
        "wrong_or_missing_options",
        str(options["a"]),
        str(options["b"]),
        f"+{options['gained']}",
        f"-{options['lost']}",
    ]
    assert "rule labels over the 24 paired episodes" in text


@pytest.mark.slow
def test_two_runs_of_the_same_policy_include_zero_local_against_sharded(
    research_runs: ResearchRuns, s3_env: dict[str, str]
) -> None:
    result = compare_runs([str(research_runs.local), research_runs.sharded])
    (comparison,) = result["comparisons"]
    assert result["runs"][1]["kind"] == "sharded" and comparison["plan_differences"] == []
    # The same episodes, episode by episode: every resample differs by 0. That is no spread, not
    # an exact 0: the interval is the summary's widest-spread one on [-1, 1], or none off that scale.
    tasks = research_runs.episodes
    widest = wilson_interval(0.5, tasks, student_t_quantile(0.975, tasks - 1))
    for name in ("reward", "success", "reward_itt", "r_option"):
        entry = metric(comparison, name)
        assert entry["difference"] == 0 and entry["ci95"] == [pytest.approx(2 * widest[0] - 1), pytest.approx(2 * widest[1] - 1)]
        assert f"all {tasks} tasks differ by 0" in entry["ci95_note"], entry
    steps = metric(comparison, "steps")
    assert steps["ci95"] is None and "no interval" in steps["ci95_note"]
    assert metric(comparison, "success")["mcnemar"]["p_value"] == 1.0
    assert "* no spread between tasks" in format_comparison(compare_runs([str(research_runs.local), research_runs.sharded]))
    assert comparison["termination_transitions"] == [{"a": "purchase", "b": "purchase", "episodes": research_runs.episodes}]
    # The same labels episode by episode: nothing gained or lost, the same counts as the local run.
    assert all(row["gained"] == row["lost"] == 0 and row["a"] == row["b"] for row in comparison["labels"]["rows"])
    assert result["runs"][0]["labels"] == result["runs"][1]["labels"]


@pytest.mark.slow
def test_the_cli_compares_each_run_with_the_first_in_order(research_runs: ResearchRuns, naive_run: Path, tmp_path: Path) -> None:
    """Local baseline, then the sharded run on S3, then the naive run: two comparisons in that
    order; --json writes the same comparison the table shows."""
    out = tmp_path / "compare.json"
    done = shopsimrl(
        "compare", str(research_runs.local), research_runs.sharded, str(naive_run), "--json", str(out), env=research_runs.env
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert [c["b"] for c in result["comparisons"]] == [research_runs.sharded, str(naive_run)]
    assert [c["a"] for c in result["comparisons"]] == [str(research_runs.local)] * 2
    same, naive = result["comparisons"]
    assert metric(same, "reward")["difference"] == 0 and metric(naive, "reward")["ci95"][1] < 0
    assert done.stdout.index(f"{research_runs.sharded}  vs") < done.stdout.index(f"{naive_run}  vs")
    assert "testing-secret" not in done.stdout + out.read_text()
    # The sharded run as the baseline: the naive run is still worse.
    done = shopsimrl("compare", research_runs.sharded, str(naive_run), "--json", "-", env=research_runs.env)
    assert done.returncode == 0, done.stderr
    assert metric(json.loads(done.stdout)["comparisons"][0], "reward")["ci95"][1] < 0


# --------------------------------------------------------------------------- v4 traces


def _edit_records(source: Path, target: Path, edit: Any) -> Path:
    target.mkdir()
    lines = []
    for line in (source / "traces.jsonl").read_text(encoding="utf-8").splitlines():
        record = edit(json.loads(line))
        if record is not None:
            lines.append(json.dumps(record, ensure_ascii=False))
    (target / "traces.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    return target


@pytest.mark.slow
def test_v4_traces_of_the_earlier_implementation(research_runs: ResearchRuns, tmp_path: Path) -> None:
    """The legacy run (4 completed, 2 failed without a failure class) against a copy where the
    first episode lost its success: reward pairs are the completed ones, the intent-to-treat
    pairs every one (failures count 0)."""

    def worse(record: dict[str, Any]) -> dict[str, Any]:
        if record["episode_id"] == "task-000003__sample-000":
            record["final"]["reward"] = 0.5
            record["final"]["reward_detail"].update(r_success=0, r_strict=0.5)
        return record

    copy = _edit_records(research_runs.legacy, tmp_path / "legacy-worse", worse)
    result = compare_runs([str(research_runs.legacy), str(copy)])
    (comparison,) = result["comparisons"]
    assert [run["kind"] for run in result["runs"]] == ["legacy", "legacy"]
    assert comparison["plan_differences"] == [
        f"{research_runs.legacy} has no manifest: its plan is unknown",
        f"{copy} has no manifest: its plan is unknown",
    ]
    assert (comparison["completed_in_both"], comparison["failed_in_both"]) == (4, 2)
    reward, itt = metric(comparison, "reward"), metric(comparison, "reward_itt")
    assert (reward["pairs"], itt["pairs"]) == (4, 6)
    assert reward["difference"] == pytest.approx(-0.5 / 4) and itt["difference"] == pytest.approx(-0.5 / 6)
    assert metric(comparison, "success")["mcnemar"] == {"only_a": 1, "only_b": 0, "both": 0, "neither": 3, "p_value": 1.0}
    transitions = {(t["a"], t["b"]): t["episodes"] for t in comparison["termination_transitions"]}
    assert transitions[("failed: unknown", "failed: unknown")] == 2 and transitions[("purchase", "purchase")] == 2


# --------------------------------------------------------------------------- pairing rules


def _copy_with_plan(source: Path, target: Path, edit_plan: Any, keep: Any = None) -> Path:
    """A copy of a local run whose frozen plan was made by ``edit_plan`` (fingerprint recomputed,
    as a run of that plan would have it), keeping the records ``keep`` accepts."""
    shutil.copytree(source, target, ignore=shutil.ignore_patterns(".lock"))
    manifest = json.loads((target / "manifest.json").read_text())
    edit_plan(manifest["plan"])
    manifest["plan_fingerprint"] = fingerprint(manifest["plan"])
    (target / "manifest.json").write_text(json.dumps(manifest))
    if keep is not None:
        lines = (target / "traces.jsonl").read_text(encoding="utf-8").splitlines()
        (target / "traces.jsonl").write_text("".join(line + "\n" for line in lines if keep(json.loads(line))), encoding="utf-8")
    return target


@pytest.mark.slow
def test_job_keys_that_differ_are_refused_unless_partial(research_runs: ResearchRuns, tmp_path: Path) -> None:
    jobs = json.loads((research_runs.local / "manifest.json").read_text())["plan"]["jobs"]
    changed_id = f"task-{jobs[0]['task_id']:06d}__sample-000"

    def reseed(plan: dict[str, Any]) -> None:
        plan["jobs"][0]["seed"] += 1

    other = _copy_with_plan(research_runs.local, tmp_path / "reseeded", reseed)
    with pytest.raises(CompareError) as refused:
        compare_runs([str(research_runs.local), str(other)])
    message = str(refused.value)
    assert (
        changed_id in message and f"seed {jobs[0]['seed']} -> {jobs[0]['seed'] + 1}" in message and "--allow-partial" in message
    )
    done = shopsimrl("compare", str(research_runs.local), str(other))
    assert done.returncode == 2 and "another job key" in done.stderr and "Traceback" not in done.stderr

    result = compare_runs([str(research_runs.local), str(other)], allow_partial=True)
    (comparison,) = result["comparisons"]
    assert comparison["episodes"] == research_runs.episodes - 1 and comparison["dropped"] == {"another job key (seed, split)": 1}
    assert "dropped 1 (1 another job key (seed, split))" in format_comparison(result)


@pytest.mark.slow
def test_planned_episodes_without_a_record_are_refused_unless_partial(research_runs: ResearchRuns, tmp_path: Path) -> None:
    first = json.loads((research_runs.local / "manifest.json").read_text())["plan"]["jobs"][0]
    lost = f"task-{first['task_id']:06d}__sample-000"
    unfinished = _copy_with_plan(
        research_runs.local, tmp_path / "unfinished", lambda plan: None, keep=lambda r: r["episode_id"] != lost
    )
    with pytest.raises(CompareError, match=rf"has no record of 1 planned episodes \(an unfinished run\?\): {lost}"):
        compare_runs([str(research_runs.local), str(unfinished)])
    (comparison,) = compare_runs([str(unfinished), str(research_runs.local)], allow_partial=True)["comparisons"]
    assert comparison["episodes"] == research_runs.episodes - 1 and comparison["dropped"] == {"no record in the baseline": 1}


@pytest.mark.slow
def test_differing_plan_keys_are_listed(research_runs: ResearchRuns, tmp_path: Path) -> None:
    def warmer(plan: dict[str, Any]) -> None:
        plan["model"]["sampling"]["temperature"] = 0.7
        plan["prompt"]["prompt_version"] = "shopsim-shopping-agent-tools-v3"

    other = _copy_with_plan(research_runs.local, tmp_path / "warmer", warmer)
    (comparison,) = compare_runs([str(research_runs.local), str(other)])["comparisons"]
    assert comparison["plan_differences"] == [
        "model.sampling.temperature: 0.0 -> 0.7",
        "prompt.prompt_version: 'shopsim-shopping-agent-tools-v2' -> 'shopsim-shopping-agent-tools-v3'",
    ]


@pytest.mark.slow
def test_bad_input_exits_2_with_one_message(tmp_path: Path) -> None:
    done = shopsimrl("compare", str(tmp_path / "missing"), str(tmp_path))
    assert done.returncode == 2 and "missing does not exist" in done.stderr and "Traceback" not in done.stderr
    done = shopsimrl("compare", str(tmp_path))
    assert done.returncode == 2 and "at least two runs" in done.stderr
    (tmp_path / "manifest.json").write_text("{}")
    (tmp_path / "traces.jsonl").write_text("")
    done = shopsimrl("compare", str(tmp_path), str(tmp_path))
    assert done.returncode == 2 and "manifest.json" in done.stderr and "Traceback" not in done.stderr


# --------------------------------------------------------------------------- repeats and failures


def _record(
    task: int, sample: int, reward: float | None, *, failure: str | None = None, category: str = "家居›灯具›台灯"
) -> dict[str, Any]:
    job = {"task_id": task, "sample_id": sample, "seed": 1000 * task + sample, "split": "val"}
    record: dict[str, Any] = {
        "schema_version": TRACE_SCHEMA_VERSION,
        "episode_id": f"task-{task:06d}__sample-{sample:03d}",
        "job": job,
    }
    step = {
        "step_index": 0,
        "model": {"latency_ms": 10.0, "usage": {"prompt_tokens": 100, "completion_tokens": 10, "total_tokens": 110}},
        "action": {"valid": True},
    }
    if failure is not None:
        return {**record, "status": "failed", "failure_class": failure, "final": None, "error": {"type": "X"}, "steps": [step]}
    detail = {"r_success": 1 if reward == 1.0 else 0, "r_type": 1.0}
    final = {
        "done": True,
        "reward": reward,
        "reward_detail": detail,
        "termination_reason": "purchase",
        "goal": {"category": category},
    }
    return {**record, "status": "completed", "final": final, "steps": [step, {**step, "step_index": 1}]}


def _write_run(path: Path, records: list[dict[str, Any]]) -> str:
    store = LocalRunStore(path)
    store.save_traces([read_trace(record) for record in records])
    return str(path)


def test_repeats_are_resampled_by_task_and_failures_enter_as_the_summary_counts_them(tmp_path: Path) -> None:
    """Ten tasks, three samples each; in run B every sample of tasks 0–4 gains 0.5 and of tasks
    5–9 loses 0.25, so the repeats of a task agree. Episode 0/0 failed for infrastructure in B
    (excused everywhere), 1/0 for the policy (0 in the intent-to-treat rows)."""
    a_records, b_records = [], []
    for task in range(10):
        for sample in range(3):
            base = 0.25 + 0.05 * sample
            a_records.append(_record(task, sample, base))
            b_records.append(_record(task, sample, base + (0.5 if task < 5 else -0.25)))
    b_records[0] = _record(0, 0, None, failure="infrastructure")
    b_records[3] = _record(1, 0, None, failure="policy")
    runs = [load_run(_write_run(tmp_path / "a", a_records)), load_run(_write_run(tmp_path / "b", b_records))]
    result = compare_loaded(runs)
    (comparison,) = result["comparisons"]
    assert (comparison["repeats"], comparison["tasks"], comparison["episodes"]) == (3, 10, 30)
    assert (comparison["completed_in_both"], comparison["failed_only_in_b"]) == (28, 2)
    reward, itt = metric(comparison, "reward"), metric(comparison, "reward_itt")
    assert (reward["pairs"], itt["pairs"]) == (28, 29)  # the infrastructure failure is excused
    assert itt["b"] == pytest.approx(sum(r["final"]["reward"] for r in b_records if r["final"]) / 29)

    # The interval is the task-clustered bootstrap of these pairs, wider than resampling episodes.
    pairs = [(a, b) for a, b in zip(a_records, b_records, strict=True) if b["final"] is not None]
    a_values, b_values = [a["final"]["reward"] for a, _ in pairs], [b["final"]["reward"] for _, b in pairs]
    tasks = [a["job"]["task_id"] for a, _ in pairs]
    (by_task,) = percentile_interval(resampled_differences(cluster_sums(tasks, a_values, b_values)))
    assert reward["ci95"] == [pytest.approx(by_task.low), pytest.approx(by_task.high)]
    (by_episode,) = percentile_interval(resampled_differences(cluster_sums(range(len(pairs)), a_values, b_values)))
    assert by_task.high - by_task.low > 1.3 * (by_episode.high - by_episode.low)
    assert "up to 3 per task, resampled by task" in format_comparison(result)
    assert comparison["per_task"]["win"] == 5 and comparison["per_task"]["loss"] == 5


def test_the_headline_rows_count_failures_and_a_crashing_checkpoint_does_not_look_better(tmp_path: Path) -> None:
    """B does better than A on the easy tasks and fails every hard one (a model error). Over the
    pairs completed in both, B gains 0.1; over every paired episode (ITT, a failure as 0) it loses
    0.27. The ITT rows come first, in the JSON and the text, and the per-task verdict is on them.
    An infrastructure failure leaves its pair out of the ITT rows, counted in ``itt_excused``."""
    a_records, b_records = [], []
    for task in range(10):
        for sample in range(2):
            easy = task < 5
            a_records.append(_record(task, sample, 0.5 if easy else 0.6))
            b_records.append(_record(task, sample, 0.6) if easy else _record(task, sample, None, failure="model_error"))
    a_records[1] = _record(0, 1, None, failure="infrastructure")
    result = compare_loaded([load_run(_write_run(tmp_path / "a", a_records)), load_run(_write_run(tmp_path / "b", b_records))])
    (comparison,) = result["comparisons"]
    assert [entry["metric"] for entry in comparison["metrics"][:4]] == ["reward_itt", "success_itt", "reward", "success"]
    itt, completed = metric(comparison, "reward_itt"), metric(comparison, "reward")
    assert completed["pairs"] == 9 and completed["difference"] == pytest.approx(0.1)
    assert itt["pairs"] == 19 and itt["a"] == pytest.approx((9 * 0.5 + 10 * 0.6) / 19) and itt["b"] == pytest.approx(9 * 0.6 / 19)
    assert itt["difference"] < 0 and itt["ci95"][1] < 0
    assert comparison["itt_excused"] == {"only_a": 1, "only_b": 0, "both": 0}
    assert comparison["per_task"]["metric"] == "reward_itt"
    assert (comparison["per_task"]["win"], comparison["per_task"]["loss"]) == (5, 5)
    block = result["runs"][1]
    assert block["reward_mean"] == pytest.approx(0.6) and block["reward_mean_itt"] == pytest.approx(0.3)
    assert block["coverage"] == 0.5 and block["itt_episodes"] == 20

    text = format_comparison(result)
    run_line = next(line for line in text.splitlines() if line.startswith("  B  "))
    assert "(coverage 50.0%) · reward (ITT) 0.300 [" in run_line
    assert run_line.index("reward (ITT)") < run_line.index("reward (completed) 0.600")
    header = next(line for line in text.splitlines() if line.strip().startswith("metric"))
    body = text.splitlines()[text.splitlines().index(header) + 1 :]
    assert [line.split("  ")[1] for line in body[:4]] == [
        "reward (ITT)",
        "success (ITT)",
        "reward (completed)",
        "success (completed)",
    ]
    assert "left out of the (ITT) rows, an infrastructure failure: 1 pairs (only in A 1, only in B 0, in both 0)" in text


def test_small_categories_are_folded_and_slice_p_values_are_holm_adjusted(tmp_path: Path) -> None:
    """Three categories of 12, 10 and 6 tasks and one of 3: the two small ones become one "other"
    slice. B succeeds where A failed on every third task of the first category only. Each
    metric's slice p-values are Holm-adjusted together."""
    sizes = {"家居›灯具›台灯": 12, "食品›茶›绿茶": 10, "数码›电脑›键盘": 6, "服饰›鞋›跑鞋": 3}
    categories = [name for name, size in sizes.items() for _ in range(size)]
    a_records = [_record(task, 0, 0.5, category=name) for task, name in enumerate(categories)]
    b_records = [
        _record(task, 0, 1.0 if name == "家居›灯具›台灯" and task % 3 == 0 else 0.5, category=name)
        for task, name in enumerate(categories)
    ]
    runs = [load_run(_write_run(tmp_path / "a", a_records)), load_run(_write_run(tmp_path / "b", b_records))]
    result = compare_loaded(runs, resamples=2000)
    (comparison,) = result["comparisons"]
    slices = {piece["category"]: piece for piece in comparison["categories"]}
    assert list(slices) == ["家居›灯具›台灯", "食品›茶›绿茶", "other"]
    assert slices["other"]["folded"] == ["数码›电脑›键盘", "服饰›鞋›跑鞋"] and slices["other"]["episodes"] == 9
    assert comparison["category_slices"] == {"min_pairs": 10, "p_adjust": "holm", "family": "the slices of one metric"}
    for j in (0, 1):
        raw = [piece["metrics"][j]["p_value"] for piece in comparison["categories"]]
        assert [piece["metrics"][j]["p_holm"] for piece in comparison["categories"]] == holm_adjust(raw)
    lamps = slices["家居›灯具›台灯"]["metrics"]
    assert lamps[0]["metric"] == "reward_itt" and lamps[0]["difference"] == pytest.approx(4 * 0.5 / 12)
    assert lamps[1]["p_value"] == mcnemar_exact(0, 4) and lamps[1]["p_holm"] == pytest.approx(min(1.0, 3 * mcnemar_exact(0, 4)))
    text = format_comparison(result)
    assert "fewer than 10 pairs folded into other" in text and "other (2 categories)" in text and "p (Holm)" in text
