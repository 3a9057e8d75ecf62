"""`gate fit` on a Gate A directory of the earlier implementation, built here by hand from the
formats the reference documents (shared/reference/shopsimrl_v4_reference.md §§1-4, 9): a bare run
directory (v4 manifest and traces), and a gate directory holding the masked rollouts as a run, the
masks and the earlier fit. The masks are computed with the documented formula in this file, and the
outcomes are exact (dyadic) main effects, so the earlier fit's coefficients are known without
running any of this project's code."""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from tests.sharded.conftest import cli

from .conftest import FIXTURES
from .test_gate_cli import CHUNKS, write_draft

pytestmark = pytest.mark.slow

MASK_SEED = 20260901
EFFECTS = {"options": 0.25, "quiet": -0.125}
TASKS = range(3, 15)


def canonical(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, sort_keys=True, separators=(",", ":"))


def v4_fingerprint(value: Any) -> str:
    return hashlib.sha256(canonical(value).encode("utf-8")).hexdigest()


def episode_seed(seed: int, task_id: int, sample_id: int) -> int:
    return int.from_bytes(hashlib.sha256(f"{seed}:{task_id}:{sample_id}".encode()).digest()[:4], "big")


def chunk_bit(task_id: int, chunk_id: str) -> int:
    digest = hashlib.sha256(f"{MASK_SEED}:val:{task_id}:0:{chunk_id}".encode()).digest()
    return int(int.from_bytes(digest[:8], "big") < 2**63)


def write_run(directory: Path, plan: dict[str, Any], records: list[dict[str, Any]]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    manifest = {
        "schema_version": "shopsimrl-run-manifest-v1",
        "created_at": "2025-09-01T10:00:00+00:00",
        "plan_fingerprint": v4_fingerprint(plan),
        "plan": plan,
    }
    (directory / "manifest.json").write_text(json.dumps(manifest, ensure_ascii=False, indent=2), encoding="utf-8")
    lines = "".join(json.dumps(r, ensure_ascii=False, allow_nan=False) + "\n" for r in records)
    (directory / "traces.jsonl").write_text(lines, encoding="utf-8")


def trace(
    template: dict[str, Any], job: dict[str, Any], reward: float, skills: list[dict[str, Any]], provider: Any
) -> dict[str, Any]:
    record = copy.deepcopy(template)
    record["episode_id"] = f"task-{job['task_id']:06d}__sample-{job['sample_id']:03d}"
    record["job"] = dict(job)
    record["selected_skills"] = skills
    record["provenance"]["skills"] = provider
    record["final"]["reward"] = reward
    record["final"]["reward_detail"] = {
        "reward_version": "shopsimulator-paper-reward-v2",
        "termination_reason": "purchase",
        "r_strict": reward,
        "r_success": int(reward >= 1.0),
        "r_option": 1.0 if reward > 0.5 else 0.0,
    }
    return record


@pytest.fixture
def earlier(tmp_path: Path) -> dict[str, Path]:
    return build_earlier(tmp_path, TASKS)


def noise(task_id: int) -> float:
    """A dyadic, task-dependent residual: the fit is not exact, so which rows enter it shows."""
    return ((task_id * 7) % 5 - 2) / 64


def build_earlier(tmp_path: Path, tasks: range, *, failed: tuple[int, ...] = (), noisy: bool = False) -> dict[str, Path]:
    """An earlier Gate A directory over ``tasks``; the masked episodes of ``failed`` ended failed
    (the d020cbb gate then dropped them and recorded ``dropped_episode_ids``)."""
    template = json.loads((FIXTURES / "legacy_v4_traces.jsonl").read_text(encoding="utf-8").splitlines()[0])
    provenance = template["provenance"]
    jobs = [{"task_id": t, "sample_id": 0, "seed": episode_seed(20260830, t, 0), "split": "val"} for t in tasks]
    base_plan = {
        "pipeline_version": "shopsimrl-v0.4",
        "model_id": "qwen35-4b",
        "model": provenance["model"],
        "task_split": {"name": "val", "source_path": "/home/earlier/shopsimrl/configs/splits/persona_splits.v1.json"},
        "jobs": jobs,
        "environment": {k: provenance["environment"][k] for k in ("adapter", "base_url", "persona", "interaction_mode")},
        "runtime": {**provenance["runtime"], "concurrency": 32},
        "prompt": provenance["prompt"],
    }
    bare_rewards = {t: (0.5 if t % 2 else 0.25) for t in tasks}
    bare_dir = tmp_path / "runs" / "val-bare"
    bare_records = [trace(template, job, bare_rewards[job["task_id"]], [], {"provider": "none"}) for job in jobs]
    write_run(bare_dir, {**base_plan, "experiment": "val-bare", "skills": {"provider": "none"}}, bare_records)

    draft = write_draft(tmp_path / "draft", CHUNKS)
    bank = json.loads((tmp_path / "draft" / "initial_skillbank.json").read_text(encoding="utf-8"))
    chunk_ids = list(CHUNKS)
    assigned = {
        "provider": "assigned_json_skillbank",
        "bank": {"bank_sha256": v4_fingerprint(bank)},
        "assignment": {"mask_seed": MASK_SEED},
    }
    rows, masked_records = [], []
    for job in jobs:
        mask = [chunk_bit(job["task_id"], c) for c in chunk_ids]
        included = [c for c, bit in zip(chunk_ids, mask, strict=True) if bit]
        episode_id = f"task-{job['task_id']:06d}__sample-000"
        rows.append({"episode_id": episode_id, **job, "mask": mask, "included_chunk_ids": included})
        shown = [
            {
                "skill_id": s["skill_id"],
                "content": s["content"],
                "version": "1",
                "metadata": s["metadata"],
                "content_sha256": hashlib.sha256(s["content"].encode("utf-8")).hexdigest(),
            }
            for s in bank["skills"]
            if s["skill_id"] in included
        ]
        reward = bare_rewards[job["task_id"]] + sum(EFFECTS[c] for c in included)
        reward += noise(job["task_id"]) if noisy else 0.0
        record = trace(template, job, reward, shown, assigned)
        if job["task_id"] in failed:
            record |= {"status": "failed", "error": {"type": "ModelError", "message": "HTTP 500"}}
            record["final"]["done"] = False
        masked_records.append(record)
    gate_dir = tmp_path / "runs" / "gate-a"
    masked_plan = {
        **base_plan,
        "experiment": "gate-a",
        # Another checkout and concurrency than the bare run's: not part of the protocol.
        "task_split": {"name": "val", "source_path": "/srv/other/configs/splits/persona_splits.v1.json"},
        "runtime": {**provenance["runtime"], "concurrency": 8},
        "skills": assigned,
        "trace2skill_gate": {"mask_seed": MASK_SEED, "chunk_ids": chunk_ids},
    }
    write_run(gate_dir, masked_plan, masked_records)
    masks = {"mask_seed": MASK_SEED, "mask_probability": 0.5, "chunk_ids": chunk_ids, "assignments": rows}
    (gate_dir / "mask_assignments.json").write_text(
        json.dumps(
            {"schema_version": "shopsimrl-chunk-mask-assignments-v1", "created_at": "2025-09-01T11:00:00+00:00", **masks}
            | {"assignment_sha256": v4_fingerprint(masks)},
            indent=2,
        ),
        encoding="utf-8",
    )
    earlier_rows = [
        {"chunk_id": "options", "draft_order": 1, "coefficient": 0.25, "rank": 1, "status": "selected"},
        {"chunk_id": "quiet", "draft_order": 2, "coefficient": -0.125, "rank": None, "status": "non_positive"},
    ]
    (gate_dir / "contributions.json").write_text(
        json.dumps({"schema_version": "shopsimrl-trace2skill-contributions-v1", "contributions": earlier_rows}), encoding="utf-8"
    )
    (gate_dir / "gate_a_manifest.json").write_text(json.dumps({"status": "complete"}), encoding="utf-8")
    gate_yaml = tmp_path / "configs" / "gate_a.yaml"
    gate_yaml.parent.mkdir()
    gate_yaml.write_text(
        yaml.safe_dump(
            {
                "gate_a": {
                    "name": "trace2skill-gate-a",
                    "output_dir": "../runs/gate-a",
                    "experiment_config": "val.yaml",
                    "bare_run_dir": "../runs/val-bare",
                    "draft_path": str(draft),
                    "mask_seed": MASK_SEED,
                    "mask_probability": 0.5,
                    "active_skill_budget": 1,
                }
            }
        ),
        encoding="utf-8",
    )
    return {"gate_yaml": gate_yaml, "gate_dir": gate_dir, "bare_dir": bare_dir, "masks": gate_dir / "mask_assignments.json"}


def snapshot(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir() if p.is_file()}


def test_fit_reproduces_the_earlier_gate_and_leaves_its_files_alone(earlier: dict[str, Path]) -> None:
    gate_dir = earlier["gate_dir"]
    before = snapshot(gate_dir)
    fitted = cli("gate", "fit", str(earlier["gate_yaml"]))
    assert fitted.returncode == 0, fitted.stderr[-3000:]
    assert "earlier fit (../contributions.json): reproduced" in fitted.stdout
    assert snapshot(gate_dir) == before  # the earlier implementation's files are untouched
    refit = gate_dir / "refit"
    document = json.loads((refit / "contributions.json").read_text(encoding="utf-8"))
    rows = {row["chunk_id"]: row for row in document["contributions"]}
    assert rows["options"]["coefficient"] == pytest.approx(0.25, abs=1e-12) and rows["options"]["status"] == "selected"
    assert rows["quiet"]["coefficient"] == pytest.approx(-0.125, abs=1e-12) and rows["quiet"]["status"] == "non_positive"
    assert document["observations"] == len(TASKS) and document["selected_chunk_ids"] == ["options"]
    assert document["estimates"]["r_success"]["coefficients"] == {"options": 0.0, "quiet": 0.0}
    manifest = json.loads((refit / "gate_a_manifest.json").read_text(encoding="utf-8"))
    assert manifest["status"] == "complete" and manifest["earlier_fit"]["reproduced"] is True
    assert manifest["runs"]["bare"] == "../../val-bare" and manifest["runs"]["masked"] == ".."
    assert manifest["runs"]["masked_plan_fingerprint"] == json.loads((gate_dir / "manifest.json").read_text())["plan_fingerprint"]
    assert json.loads((refit / "selected_skillbank.json").read_text(encoding="utf-8"))["skills"][0]["skill_id"] == "options"

    # An earlier gate directory is refitted, never planned or run over.
    planned = cli("gate", "plan", str(earlier["gate_yaml"]))
    assert planned.returncode == 2 and "a gate of the earlier implementation" in planned.stderr
    assert snapshot(gate_dir) == before


def _edit_json(path: Path, edit: Any) -> None:
    document = json.loads(path.read_text(encoding="utf-8"))
    edit(document)
    path.write_text(json.dumps(document), encoding="utf-8")


def _flip_first_mask(document: dict[str, Any]) -> None:
    row = document["assignments"][0]
    row["mask"] = [1 - bit for bit in row["mask"]]
    row["included_chunk_ids"] = [c for c, bit in zip(document["chunk_ids"], row["mask"], strict=True) if bit]


@pytest.mark.parametrize(
    ("damage", "message"),
    [
        (
            lambda e: (e["gate_dir"] / "mask_assignments.json").unlink(),
            "mask_assignments.json: missing; an earlier gate directory holds the masks",
        ),
        (
            lambda e: (e["gate_dir"] / "mask_assignments.json").write_text('{"schema_version": '),
            "mask_assignments.json is not valid JSON at line 1",
        ),
        (
            lambda e: _edit_json(
                e["gate_dir"] / "mask_assignments.json",
                lambda d: d.update(schema_version="shopsimrl-online-skill-assignments-v1"),
            ),
            "an online gate of the earlier implementation",
        ),
        (lambda e: _edit_json(e["gate_dir"] / "mask_assignments.json", _flip_first_mask), "the formula's (mask_seed 20260901)"),
        (
            lambda e: _edit_json(
                e["gate_dir"] / "mask_assignments.json",
                lambda d: d["assignments"][1].update(included_chunk_ids=["quiet", "options"]),
            ),
            "assignments[1].included_chunk_ids",
        ),
        (
            lambda e: _edit_json(e["gate_dir"] / "mask_assignments.json", lambda d: d["assignments"][2].pop("seed")),
            "assignments[2].seed must be an integer",
        ),
        (lambda e: (e["bare_dir"] / "manifest.json").unlink(), "has no manifest.json"),
        (lambda e: (e["gate_dir"] / "manifest.json").write_text("{}"), "unsupported manifest schema_version"),
        (
            lambda e: (e["gate_dir"] / "contributions.json").write_text('{"contributions": 3}'),
            "contributions must be a list of rows",
        ),
    ],
    ids=[
        "no-masks",
        "masks-not-json",
        "online",
        "tampered-mask",
        "included-order",
        "no-seed",
        "no-bare-manifest",
        "bad-masked-manifest",
        "bad-earlier-fit",
    ],
)
def test_missing_or_malformed_files_are_one_line_with_exit_2(earlier: dict[str, Path], damage: Any, message: str) -> None:
    damage(earlier)
    fitted = cli("gate", "fit", str(earlier["gate_yaml"]))
    assert fitted.returncode == 2, (fitted.returncode, fitted.stdout[-1000:], fitted.stderr[-2000:])
    assert message in fitted.stderr, fitted.stderr[-2000:]
    assert "Traceback" not in fitted.stderr and len(fitted.stderr.strip().splitlines()) == 1


def test_a_masked_rollout_shown_other_chunks_than_its_mask_is_refused(earlier: dict[str, Path]) -> None:
    traces = earlier["gate_dir"] / "traces.jsonl"
    records = [json.loads(line) for line in traces.read_text(encoding="utf-8").splitlines()]
    records[0]["selected_skills"] = [*records[0]["selected_skills"][::-1], records[0]["selected_skills"][0]]
    traces.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    fitted = cli("gate", "fit", str(earlier["gate_yaml"]))
    assert fitted.returncode == 2 and "its frozen mask assigns" in fitted.stderr, fitted.stderr[-2000:]


def test_an_earlier_gate_that_dropped_failed_episodes_is_refit_with_the_same_drops(tmp_path: Path) -> None:
    failed = (17, 160, 333)
    built = build_earlier(tmp_path, range(3, 403), failed=failed, noisy=True)
    gate_dir = built["gate_dir"]
    rows = json.loads(built["masks"].read_text(encoding="utf-8"))["assignments"]
    kept = [row for row in rows if row["task_id"] not in failed]
    # The earlier fit, computed here independently: OLS on the kept pairs' deltas.
    design = np.array([row["mask"] for row in kept], dtype=float)
    deltas = np.array([sum(EFFECTS[c] for c in row["included_chunk_ids"]) + noise(row["task_id"]) for row in kept], dtype=float)
    beta = np.linalg.lstsq(design, deltas, rcond=None)[0]
    assert beta[0] > 0 > beta[1]
    dropped_ids = sorted(f"task-{t:06d}__sample-000" for t in failed)
    earlier_fit = {
        "schema_version": "shopsimrl-chunk-contributions-v2",
        "observations": len(kept),
        "requested_observations": len(rows),
        "dropped_episode_ids": dropped_ids,
        "contributions": [
            {"chunk_id": "options", "draft_order": 1, "coefficient": float(beta[0]), "rank": 1, "status": "selected"},
            {"chunk_id": "quiet", "draft_order": 2, "coefficient": float(beta[1]), "rank": None, "status": "non_positive"},
        ],
    }
    (gate_dir / "contributions.json").write_text(json.dumps(earlier_fit), encoding="utf-8")

    fitted = cli("gate", "fit", str(built["gate_yaml"]))
    assert fitted.returncode == 0, fitted.stderr[-3000:]
    assert "reproduced" in fitted.stdout and "dropped episodes agree" in fitted.stdout
    refit = gate_dir / "refit"
    document = json.loads((refit / "contributions.json").read_text(encoding="utf-8"))
    coefficients = {row["chunk_id"]: row["coefficient"] for row in document["contributions"]}
    assert abs(coefficients["options"] - beta[0]) <= 1e-12 and abs(coefficients["quiet"] - beta[1]) <= 1e-12
    assert document["dropped_episode_ids"] == dropped_ids
    assert (document["requested_observations"], document["dropped_observations"], document["observations"]) == (400, 3, 397)
    manifest = json.loads((refit / "gate_a_manifest.json").read_text(encoding="utf-8"))
    assert manifest["earlier_fit"]["dropped_episodes_agree"] is True and manifest["earlier_fit"]["reproduced"] is True

    # Recorded drops that are not the failed episodes: the refit says so.
    earlier_fit["dropped_episode_ids"] = dropped_ids[:2]
    (gate_dir / "contributions.json").write_text(json.dumps(earlier_fit), encoding="utf-8")
    differing = cli("gate", "fit", str(built["gate_yaml"]))
    assert differing.returncode == 0, differing.stderr[-3000:]
    assert "NOT reproduced" in differing.stdout and "dropped episodes differ" in differing.stdout
