"""``shopsimrl judge``: the command bodies (the CLI turns their errors into exit codes).

- ``judge JUDGE.yaml``: judge locally into ``output`` (resumable); with ``--shards N --out URI``
  plan, run N judge workers as a local Indexed Job (the pods' code path) and reduce;
- ``judge plan JUDGE.yaml --shards N --out URI``: freeze the selection, rubric and settings;
- ``judge worker JUDGE.yaml --out URI``: one shard (``JOB_COMPLETION_INDEX``), resumable;
- ``judge reduce URI``: ``judge_outputs.jsonl`` and ``judge_summary.json`` from committed shards;
- ``judge status URI``: per-shard progress of a judge location (no part read);
- ``judge wait-ready JUDGE.yaml``: wait until the judge model is served (a pod's init container).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from shopsimrl import eventloop
from shopsimrl.exitcodes import ExitCode
from shopsimrl.research.export import iter_judge_inputs
from shopsimrl.research.judge.call import wait_for_judge_model
from shopsimrl.research.judge.config import JudgeConfig, JudgeConfigError, Rubric, load_judge_config, load_rubric
from shopsimrl.research.judge.local import JudgeResult, run_local_judge
from shopsimrl.research.judge.sharded import (
    JudgePlan,
    ReduceResult,
    judge_status,
    plan_judge,
    reduce_judge,
    run_judge_worker,
)
from shopsimrl.runner.local_job import run_indexed
from shopsimrl.storage.objectstore import StoreUnavailableError
from shopsimrl.storage.reading import Run, open_run

__all__ = [
    "format_summary",
    "judge_plan",
    "judge_reduce",
    "judge_run",
    "judge_status",
    "judge_wait_ready",
    "judge_worker",
]


def _load(config_path: Path) -> tuple[JudgeConfig, Rubric, Run]:
    config = load_judge_config(config_path)
    rubric = load_rubric(config.resolve(config.rubric))
    return config, rubric, open_run(config.source_location)


def _inputs(config: JudgeConfig) -> Any:
    def select(run: Run) -> Iterator[tuple[dict[str, Any], dict[str, Any]]]:
        return iter_judge_inputs(run, select=config.selection.select, include=frozenset(config.selection.include))

    return select


def judge_plan(config_path: Path, shards: int, out: str) -> JudgePlan:
    config, rubric, run = _load(config_path)
    text = Path(config.resolve(config.rubric)).read_bytes().decode("utf-8")  # the hashed bytes, newlines untouched
    return plan_judge(config, rubric, text, run, out, shards, (item for _row, item in _inputs(config)(run)))


def judge_worker(config_path: Path, out: str, index: int | None) -> ExitCode:
    config = load_judge_config(config_path)
    if index is None:
        raw = os.environ.get("SHOPSIMRL_SHARD_INDEX") or os.environ.get("JOB_COMPLETION_INDEX")
        if raw is None or not raw.isdigit():
            raise JudgeConfigError("no shard index: pass --index, or set JOB_COMPLETION_INDEX (an Indexed Job sets it)")
        index = int(raw)
    return run_judge_worker(config, out, index)


def judge_wait_ready(config_path: Path, *, timeout: float, interval: float) -> tuple[bool, str]:
    config = load_judge_config(config_path)
    return eventloop.run(wait_for_judge_model(config, timeout=timeout, interval=interval))


def judge_reduce(uri: str, wait_s: float | None = None) -> ReduceResult:
    return reduce_judge(uri, wait_s=wait_s)


def judge_run(
    config_path: Path, *, shards: int | None = None, out: str | None = None, parallelism: int | None = None
) -> JudgeResult | ReduceResult:
    if shards is None:
        if out is not None:
            raise JudgeConfigError("--out goes with --shards (a local judge writes the config's output directory)")
        config, rubric, run = _load(config_path)
        return run_local_judge(config, rubric, run, select_inputs=_inputs(config))
    if out is None:
        raise JudgeConfigError("--shards needs --out URI (the judge location: a directory or an s3:// URI)")
    judge_plan(config_path, shards, out)
    command = [sys.executable, "-m", "shopsimrl", "judge", "worker", str(config_path), "--out", out]
    result = run_indexed(out, config_path, shards, parallelism=parallelism, command=command)
    if result.interrupted:
        raise StoreUnavailableError("interrupted; run the same command again to resume")
    return reduce_judge(out)


def _kappa(block: dict[str, Any]) -> str:
    if block["kappa"] is None:
        return f"kappa undefined ({block['kappa_undefined']}) · n {block['episodes']}"
    ci = block.get("kappa_ci95")
    interval = f" [{ci['low']:.3f}, {ci['high']:.3f}]" if ci else ""
    return f"kappa {block['kappa']:.3f}{interval} · raw agreement {block['raw_agreement']:.3f} · n {block['episodes']}"


def format_summary(summary: dict[str, Any], outputs: str, summary_path: str) -> str:
    status, episodes = summary["status"], summary["episodes"]
    verdicts = " · ".join(f"{name} {count}" for name, count in summary["verdicts"].items()) or "none"
    lines = [
        f"judged {episodes['judged']} of {episodes['selected']} selected · ok {status['ok']} · "
        f"unparseable {status['unparseable']} · error {status['error']} · repaired {summary['repaired']}",
        f"verdicts: {verdicts}",
        f"agreement with the reward (success vs r_success = 1): {_kappa(summary['agreement']['reward'])}",
    ]
    for name, block in summary["agreement"]["labels"].items():
        lines.append(f"agreement with the rule labels, {name}: {_kappa(block)}")
    if "shards" in summary:
        shards = summary["shards"]
        lines.append(
            f"shards: {shards['committed']} of {shards['count']} committed"
            + (f", missing {shards['missing']}" if shards["missing"] else "")
        )
    lines += [f"judge outputs: {outputs}", f"judge summary: {summary_path}"]
    return "\n".join(lines)
