"""Runs as tables, for notebooks (in the shopsimrl-research distribution: pandas and pyarrow).

    from shopsimrl.research import analysis

    episodes = analysis.episodes("s3://bucket/runs/ckpt-1200")   # pandas, one row per episode
    steps = analysis.steps("runs/qwen35-4b-val-base-free")        # pandas, one row per model call
    table = analysis.episodes_table(run)                          # the same as a pyarrow.Table
    for batch in analysis.step_batches(run):                      # a large run's steps, streamed
        ...
    run = analysis.open_run(location)                             # open once, use many times
    run.record("task-000012__sample-001")                         # one episode's whole trace

Every function takes a run location (a local run directory, a sharded run at any fsspec URL,
a directory of v4 traces) or a :class:`Run` from :func:`open_run`. The columns are documented in
docs/research.md ("analysis API") and :mod:`shopsimrl.research.tables`.
"""

from __future__ import annotations

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
    "STEP_SCHEMA",
    "Run",
    "RunReadError",
    "episodes",
    "episodes_table",
    "export_table",
    "open_run",
    "read_csv_table",
    "step_batches",
    "step_rows",
    "steps",
    "steps_table",
]
