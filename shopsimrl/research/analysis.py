"""Runs as tables, for notebooks (in the shopsimrl-research distribution: pandas and pyarrow).

    from shopsimrl.research import analysis

    episodes = analysis.episodes("s3://bucket/runs/ckpt-1200")   # pandas, one row per episode
    steps = analysis.steps("runs/qwen35-4b-val-base-free")        # pandas, one row per model call
    table = analysis.episodes_table(run)                          # the same as a pyarrow.Table
    for batch in analysis.step_batches(run):                      # a large run's steps, streamed
        ...
    run = analysis.open_run(location)                             # open once, use many times
    run.record("task-000012__sample-001")                         # one episode's whole trace

    sweep = analysis.episodes("s3://bucket/runs")                 # every run under a prefix, one table,
    sweep.groupby("run_checkpoint")["reward_itt"].mean()          # each row with its run's identity
    steps = analysis.steps(["runs/ckpt-1", "runs/ckpt-2"])        # or a list of runs

Every function takes a run location (a local run directory, a sharded run at any fsspec URL,
a directory of v4 traces) or a :class:`Run` from :func:`open_run` — or several runs: a location
holding runs (found as ``shopsimrl runs`` finds them), a list, or a :class:`RunSet` from
:func:`open_runs`; then every row starts with its run's identity columns (:data:`RUN_COLUMNS`).
The columns are documented in docs/research.md ("analysis API") and :mod:`shopsimrl.research.tables`.
"""

from __future__ import annotations

from shopsimrl.research.runset import (
    RUN_COLUMNS,
    RunIdentity,
    RunSet,
    RunSkippedWarning,
    SkippedRun,
    open_runs,
    runs_metadata,
)
from shopsimrl.research.tables import (
    EPISODE_TYPES,
    STEP_SCHEMA,
    episodes,
    episodes_table,
    export_table,
    read_csv_table,
    step_batches,
    step_rows,
    steps,
    steps_table,
)
from shopsimrl.storage.reading import Run, RunReadError, open_run

__all__ = [
    "EPISODE_TYPES",
    "RUN_COLUMNS",
    "STEP_SCHEMA",
    "Run",
    "RunIdentity",
    "RunReadError",
    "RunSet",
    "RunSkippedWarning",
    "SkippedRun",
    "episodes",
    "episodes_table",
    "export_table",
    "open_run",
    "open_runs",
    "read_csv_table",
    "runs_metadata",
    "step_batches",
    "step_rows",
    "steps",
    "steps_table",
]
