"""A run's episodes and steps as Arrow tables and pandas DataFrames (for notebooks, through
:mod:`shopsimrl.research.analysis`), and their export to Parquet or CSV (``shopsimrl export table``).

Episodes: one row per episode, :func:`shopsimrl.research.episodes.episode_row` typed, the reward
components (``r_*``) after the fixed columns. Steps: one row per model call (:data:`STEP_SCHEMA`),
read with the summary's own step reading (:func:`shopsimrl.metrics.step_facts`).

Many runs (:mod:`shopsimrl.research.runset`): every reader also takes a location holding several
runs, a list of runs or a :class:`~shopsimrl.research.runset.RunSet`; each row then starts with
its run's identity columns (:data:`~shopsimrl.research.runset.RUN_COLUMNS`). A single run's
tables keep their columns (``identity=True`` adds the run's). Every table's schema metadata, and
every Parquet export's key/value metadata, lists the runs read (``shopsimrl.runs``) and those
left out (``shopsimrl.skipped_runs``).

Memory: records stream from the run (:meth:`Run.records`) and become Arrow row batches of
``batch_rows`` rows. A steps export writes each batch as it is full, so it never holds the steps
table, and over many runs holds one run's reader at a time; the episodes table (a few MB for
40,000 episodes) is written once it is complete, because which ``r_*`` columns it has is known
only then.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, Any, Literal

# Neither ships type information (pandas-stubs is not a dependency): typed as Any here.
import pandas as pd  # type: ignore[import-untyped]
import pyarrow as pa  # type: ignore[import-untyped]
import pyarrow.csv as pa_csv  # type: ignore[import-untyped]
import pyarrow.parquet as pq  # type: ignore[import-untyped]

from shopsimrl.metrics import step_facts
from shopsimrl.records import CodedMessage, EpisodeTrace, ToolCallRecord
from shopsimrl.research.episodes import episode_row
from shopsimrl.research.outputs import OutputError, check_output_location, replacing
from shopsimrl.research.runset import (
    RUN_COLUMNS,
    RunIdentity,
    RunSet,
    RunsLike,
    SkippedRun,
    Skips,
    metadata,
    open_member,
    resolve,
    runs_metadata,
)
from shopsimrl.schemas import escape_lone_surrogates
from shopsimrl.storage.reading import Run, RunReadError

__all__ = [
    "EPISODE_TYPES",
    "STEP_SCHEMA",
    "ExportError",
    "episodes",
    "episodes_table",
    "export_table",
    "read_csv_table",
    "step_batches",
    "step_rows",
    "steps",
    "steps_table",
    "to_frame",
]

BATCH_ROWS = 8192
"""Rows per Arrow batch (a Parquet row group of a steps export): ~1 MB of step rows."""
_TIMESTAMP = pa.timestamp("us", tz="UTC")

EPISODE_TYPES: dict[str, pa.DataType] = {
    "episode_id": pa.string(),
    "task_id": pa.int64(),
    "sample_id": pa.int64(),
    "seed": pa.int64(),
    "split": pa.string(),
    "status": pa.string(),
    "completed": pa.bool_(),
    "failure_class": pa.string(),
    "error_type": pa.string(),
    "termination_reason": pa.string(),
    "category": pa.string(),
    "reward": pa.float64(),
    "reward_itt": pa.float64(),
    "success": pa.float64(),
    "success_itt": pa.float64(),
    "steps": pa.int64(),
    "actions": pa.int64(),
    "invalid_actions": pa.int64(),
    "invalid_action_rate": pa.float64(),
    "protocol_errors": pa.int64(),
    "policy_failures": pa.int64(),
    "prompt_tokens": pa.int64(),
    "completion_tokens": pa.int64(),
    "total_tokens": pa.int64(),
    "reasoning_tokens": pa.int64(),
    "model_latency_ms_total": pa.float64(),
    "model_latency_ms_max": pa.float64(),
    "model_retries": pa.int64(),
    "duration_ms": pa.float64(),
    "attempt": pa.int64(),
    "started_at": _TIMESTAMP,
    "ended_at": _TIMESTAMP,
}
"""The Arrow type of each of :data:`~shopsimrl.research.episodes.CORE_COLUMNS`; ``r_*`` are float64."""

STEP_SCHEMA = pa.schema(
    [
        ("episode_id", pa.string()),
        ("task_id", pa.int64()),
        ("sample_id", pa.int64()),
        ("step_index", pa.int64()),
        ("page_type", pa.string()),  # the page the model was on when it was called
        ("tools_offered", pa.string()),  # tool names offered, comma-separated
        ("tool_calls", pa.int64()),
        ("tool_name", pa.string()),  # of the first tool call
        ("arguments_json", pa.string()),  # of the first tool call: its parsed arguments, else the raw text
        ("action", pa.string()),  # what reached the environment (search[…] / click[…])
        ("finish_reason", pa.string()),
        ("protocol_error", pa.string()),  # code
        ("policy_failure", pa.string()),  # code
        ("feedback_valid", pa.bool_()),
        ("feedback_reason", pa.string()),
        ("feedback_message", pa.string()),
        ("step_reward", pa.float64()),
        ("done", pa.bool_()),
        ("latency_ms", pa.float64()),
        ("http_attempts", pa.int64()),
        ("retries", pa.int64()),
        ("prompt_tokens", pa.int64()),
        ("completion_tokens", pa.int64()),
        ("total_tokens", pa.int64()),
        ("reasoning_tokens", pa.int64()),
        ("observation_chars", pa.int64()),
        ("content_chars", pa.int64()),
        ("reasoning_chars", pa.int64()),
    ]
)
"""One row per step (model call). Texts (observation, reasoning) are left out, their lengths kept:
``Run.record(episode_id)``, ``shopsimrl show`` and ``shopsimrl view`` have them."""


ExportError = OutputError
"""The output path is refused or cannot be created (exit 2); a write that fails partway is an
:class:`~shopsimrl.research.outputs.OutputStorageError` (an OSError)."""


RunLike = Run | str | Path
"""One run: opened, or its location."""
OnSkip = Callable[[SkippedRun], None] | None


def _identity_wanted(identity: bool | None) -> None:
    """A multi-run read: its rows need their run's columns to be told apart."""
    if identity is False:
        raise ValueError("identity=False: the rows of several runs need their run's identity columns")


def _run_arrays(identity: RunIdentity, rows: int) -> list[pa.Array]:
    return [
        pa.nulls(rows, pa.string()) if value is None else pa.repeat(pa.scalar(value, pa.string()), rows)
        for value in identity.columns().values()
    ]


def _identified(table: pa.Table, identity: RunIdentity) -> pa.Table:
    """``table`` with the run's identity columns first."""
    schema = pa.schema([*RUN_COLUMNS, *table.schema])
    return pa.Table.from_arrays([*_run_arrays(identity, table.num_rows), *table.columns], schema=schema)


def _identified_batch(batch: pa.RecordBatch, identity: RunIdentity) -> pa.RecordBatch:
    schema = pa.schema([*RUN_COLUMNS, *batch.schema])
    return pa.RecordBatch.from_arrays([*_run_arrays(identity, batch.num_rows), *batch.columns], schema=schema)


# --------------------------------------------------------------------------- value coercion


def _int(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and -(2**63) <= value < 2**63 else None


def _float(value: Any) -> float | None:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) else None


def _str(value: Any) -> str | None:
    # Arrow strings are UTF-8: a lone surrogate a model server sent is shown as its escape.
    return escape_lone_surrogates(value) if isinstance(value, str) else None


def _bool(value: Any) -> bool | None:
    return value if isinstance(value, bool) else None


def _timestamp(value: Any) -> datetime | None:
    if not isinstance(value, str):
        return None
    try:
        parsed = datetime.fromisoformat(value)
    except ValueError:
        return None
    return parsed if parsed.tzinfo is not None else parsed.replace(tzinfo=UTC)


def _coercer(kind: pa.DataType) -> Any:
    if pa.types.is_integer(kind):
        return _int
    if pa.types.is_floating(kind):
        return _float
    if pa.types.is_boolean(kind):
        return _bool
    if pa.types.is_timestamp(kind):
        return _timestamp
    return _str


_EPISODE_COERCE = {name: _coercer(kind) for name, kind in EPISODE_TYPES.items()}


def _map(value: Any) -> dict[str, Any]:
    return value if isinstance(value, dict) else {}


# --------------------------------------------------------------------------- episodes


_Compact = tuple[tuple[Any, ...], tuple[tuple[str, float | None], ...]]


def _compact_row(record: EpisodeTrace) -> _Compact:
    """:func:`episode_row` typed and kept small: the fixed columns' values in order, then the
    reward components as pairs (a tuple holds a 40,000-episode run in tens of MB, dicts in
    hundreds). A value of the wrong type (hand-edited or foreign traces) becomes null rather
    than failing the table."""
    row = episode_row(record)
    fixed = tuple(_EPISODE_COERCE[name](row.get(name)) for name in EPISODE_TYPES)
    return fixed, tuple((key, _float(value)) for key, value in row.items() if key.startswith("r_") and key not in EPISODE_TYPES)


def _episode_batch(rows: list[_Compact]) -> pa.RecordBatch:
    components = sorted({key for _, pairs in rows for key, _ in pairs})
    schema = pa.schema([*EPISODE_TYPES.items(), *((name, pa.float64()) for name in components)])
    columns = [
        pa.array([fixed[position] for fixed, _ in rows], type=kind) for position, kind in enumerate(EPISODE_TYPES.values())
    ]
    by_name = [dict(pairs) for _, pairs in rows]
    columns += [pa.array([values.get(name) for values in by_name], type=pa.float64()) for name in components]
    return pa.RecordBatch.from_arrays(columns, schema=schema)


def episodes_table(
    runs: RunsLike,
    *,
    batch_rows: int = BATCH_ROWS,
    identity: bool | None = None,
    strict: bool = False,
    on_skip: OnSkip = None,
) -> pa.Table:
    """One row per episode (its winning record), in the run's reading order: the fixed columns
    of ``episode_row`` in order, then the reward components ``r_*`` (null where an episode has
    none: not completed). One pass over the run (:meth:`Run.winner_views`).

    Several runs (a location holding runs, a list, a RunSet): their tables one after the other,
    each row starting with its run's identity columns, the ``r_*`` columns those of every run
    (null where a run has none). A run that cannot be read is skipped (``on_skip``, by default a
    warning) or, ``strict``, fails the read. ``identity=True`` adds the identity columns to a
    single run's table too. The schema metadata lists the runs read and those skipped."""
    source = resolve(runs)
    if isinstance(source, Run):
        table = _run_episodes(source, batch_rows)
        own = RunIdentity.of_run(source)
        if identity:
            table = _identified(table, own)
        return table.replace_schema_metadata(metadata([(own, table.num_rows)], []))
    _identity_wanted(identity)
    skips = Skips(strict, on_skip)
    parts: list[pa.Table] = []
    read: list[tuple[RunIdentity, int]] = []
    for own, table in source.each(lambda run: _run_episodes(run, batch_rows), skips):
        parts.append(_identified(table, own))
        read.append((own, table.num_rows))
    if not read:
        raise skips.none_read(len(source))
    combined = pa.concat_tables(parts, promote_options="default")
    components = sorted(name for name in combined.column_names if name not in EPISODE_TYPES and name not in RUN_COLUMNS.names)
    combined = combined.select([*RUN_COLUMNS.names, *EPISODE_TYPES, *components]).combine_chunks()
    return combined.replace_schema_metadata(metadata(read, skips.skipped))


def _run_episodes(run: Run, batch_rows: int) -> pa.Table:
    rows = run.winner_views(_compact_row)
    batches = [_episode_batch(rows[start : start + batch_rows]) for start in range(0, len(rows), batch_rows)] or [
        _episode_batch([])
    ]
    table = pa.concat_tables([pa.Table.from_batches([batch]) for batch in batches], promote_options="default")
    components = sorted(name for name in table.column_names if name not in EPISODE_TYPES)
    return table.select([*EPISODE_TYPES, *components]).combine_chunks()


# --------------------------------------------------------------------------- steps


def _arguments_json(call: ToolCallRecord) -> str | None:
    if call.arguments is not None:
        return escape_lone_surrogates(json.dumps(call.arguments, ensure_ascii=False, sort_keys=True))
    return _str(call.raw_arguments)


def _length(value: str | None) -> int | None:
    return len(value) if value is not None else None


def _code(problem: CodedMessage | None) -> str | None:
    return (problem.code or "unknown") if problem is not None else None


def step_rows(record: EpisodeTrace) -> Iterator[dict[str, Any]]:
    """The step rows of one trace record, in step order (:data:`STEP_SCHEMA`'s columns)."""
    page = _map((record.reset or {}).get("observation_state")).get("page_type")
    for step in record.steps:
        facts = step_facts(step)
        model = step.model
        calls = model.tool_calls
        environment = step.environment
        feedback = environment.action_feedback if environment is not None else None
        tools = [_map(tool.get("function")).get("name") for tool in step.tools if isinstance(tool, dict)]
        yield {
            "episode_id": _str(record.episode_id),
            "task_id": _int(record.job.task_id),
            "sample_id": _int(record.job.sample_id),
            "step_index": _int(step.step_index),
            "page_type": _str(page),
            "tools_offered": ",".join(name for name in tools if isinstance(name, str)),
            "tool_calls": len(calls),
            "tool_name": _str(calls[0].name) if calls else None,
            "arguments_json": _arguments_json(calls[0]) if calls else None,
            "action": _str(step.action),
            "finish_reason": _str(model.finish_reason),
            "protocol_error": _code(step.effective_protocol_error),
            "policy_failure": facts.policy_failure,
            "feedback_valid": feedback.valid if feedback is not None else None,
            "feedback_reason": _str(feedback.reason) if feedback is not None else None,
            "feedback_message": _str(feedback.get("message")) if feedback is not None else None,
            "step_reward": _float(environment.get("reward")) if environment is not None else None,
            "done": environment.done if environment is not None else None,
            "latency_ms": facts.latency_ms,
            # Only where the writer recorded its attempts (the earlier implementation did not).
            "http_attempts": model.tries if {"attempts", "attempt_count"} & model.model_fields_set else None,
            "retries": facts.retries,
            "prompt_tokens": facts.tokens.get("prompt_tokens"),
            "completion_tokens": facts.tokens.get("completion_tokens"),
            "total_tokens": facts.tokens.get("total_tokens"),
            "reasoning_tokens": facts.tokens.get("reasoning_tokens"),
            "observation_chars": _length(step.observation),
            "content_chars": _length(model.content),
            "reasoning_chars": _length(model.reasoning),
        }
        if environment is not None and environment.as_dict():
            # The next call is on the page this action led to; after a repair, the same page.
            page = _map(environment.observation_state).get("page_type")


def step_batches(
    runs: RunsLike,
    *,
    batch_rows: int = BATCH_ROWS,
    identity: bool | None = None,
    strict: bool = False,
    on_skip: OnSkip = None,
) -> Iterator[pa.RecordBatch]:
    """The steps of every episode as record batches of at most ``batch_rows`` rows
    (:data:`STEP_SCHEMA`), streamed: only one batch and the run reader's current part are held.

    Several runs: run after run, each opened only when its turn comes (one run's reader held at
    a time), a batch never spanning two runs, each row starting with its run's identity columns
    (:data:`~shopsimrl.research.runset.RUN_COLUMNS`). A run that cannot be read is skipped (or,
    ``strict``, fails the read) as in :func:`episodes_table`; one that fails after some of its
    batches were handed out fails the read."""
    return _StepStream(runs, batch_rows, identity, Skips(strict, on_skip)).batches


class _StepStream:
    """The step batches of one run or several, and once they are all read, which runs gave how
    many rows (the table's metadata)."""

    def __init__(self, runs: RunsLike, batch_rows: int, identity: bool | None, skips: Skips) -> None:
        if batch_rows < 1:
            raise ValueError(f"batch_rows must be at least 1, got {batch_rows}")
        source = resolve(runs)  # now: a bad location fails the call, not the first batch
        self.skips = skips
        self.read: list[tuple[RunIdentity, int]] = []
        self.schema = STEP_SCHEMA
        if isinstance(source, Run):
            own = RunIdentity.of_run(source)
            if identity:
                self.schema = pa.schema([*RUN_COLUMNS, *STEP_SCHEMA])
            self.batches = self._one(source, own, bool(identity), batch_rows)
        else:
            _identity_wanted(identity)
            self.schema = pa.schema([*RUN_COLUMNS, *STEP_SCHEMA])
            self.batches = self._many(source, batch_rows)

    def _one(self, run: Run, own: RunIdentity, identity: bool, batch_rows: int) -> Iterator[pa.RecordBatch]:
        rows = 0
        for batch in _run_step_batches(run, batch_rows):
            rows += batch.num_rows
            yield _identified_batch(batch, own) if identity else batch
        self.read.append((own, rows))

    def _many(self, runs: RunSet, batch_rows: int) -> Iterator[pa.RecordBatch]:
        for member in runs.members:
            rows, handed = 0, False
            try:
                # The run's reader lives in this loop's generator only: gone before the next opens.
                for batch in _run_step_batches(open_member(member), batch_rows):
                    rows += batch.num_rows
                    handed = True
                    yield _identified_batch(batch, member.identity)
            except ValueError as exc:
                if handed:  # its rows are out already: leaving the run out now would hide that
                    raise RunReadError(f"{member.identity.location}: {exc} (after {rows} of its step rows were read)") from exc
                self.skips.refuse(member, exc)
                continue
            self.read.append((member.identity, rows))
        if not self.read:
            raise self.skips.none_read(len(runs))

    @property
    def metadata(self) -> dict[str, str]:
        return metadata(self.read, self.skips.skipped)


def _run_step_batches(run: Run, batch_rows: int) -> Iterator[pa.RecordBatch]:
    return _batches((row for record in run.records() for row in step_rows(record)), batch_rows)


def _batches(rows: Iterable[dict[str, Any]], batch_rows: int) -> Iterator[pa.RecordBatch]:
    if batch_rows < 1:
        raise ValueError(f"batch_rows must be at least 1, got {batch_rows}")
    pending: list[dict[str, Any]] = []
    for row in rows:
        pending.append(row)
        if len(pending) >= batch_rows:
            yield pa.RecordBatch.from_pylist(pending, schema=STEP_SCHEMA)
            pending = []
    if pending:
        yield pa.RecordBatch.from_pylist(pending, schema=STEP_SCHEMA)


def steps_table(runs: RunsLike, *, identity: bool | None = None, strict: bool = False, on_skip: OnSkip = None) -> pa.Table:
    """Every step of the run as one table (:data:`STEP_SCHEMA`; several runs: with their identity
    columns first, as :func:`step_batches`); see :func:`step_batches` to stream a large run
    instead. The schema metadata lists the runs read and those skipped."""
    stream = _StepStream(runs, BATCH_ROWS, identity, Skips(strict, on_skip))
    table = pa.Table.from_batches(list(stream.batches), schema=stream.schema)
    return table.replace_schema_metadata(stream.metadata)


# --------------------------------------------------------------------------- pandas


def _pandas_type(kind: pa.DataType) -> Any:
    """Nullable pandas dtypes for integer and boolean columns: a missing token count stays a
    missing Int64, not a float NaN."""
    if pa.types.is_integer(kind):
        return pd.Int64Dtype()
    if pa.types.is_boolean(kind):
        return pd.BooleanDtype()
    return None


def to_frame(table: pa.Table) -> pd.DataFrame:
    """An Arrow table of this module as a DataFrame, integer and boolean columns nullable; the
    runs it holds (and those skipped) as ``frame.attrs["runs"]`` and ``["skipped_runs"]``."""
    frame = table.to_pandas(types_mapper=_pandas_type)
    if table.schema.metadata:
        frame.attrs.update(runs_metadata(table))
    return frame


def episodes(runs: RunsLike, *, identity: bool | None = None, strict: bool = False, on_skip: OnSkip = None) -> pd.DataFrame:
    """:func:`episodes_table` as a DataFrame (nullable Int64/boolean columns)."""
    return to_frame(episodes_table(runs, identity=identity, strict=strict, on_skip=on_skip))


def steps(runs: RunsLike, *, identity: bool | None = None, strict: bool = False, on_skip: OnSkip = None) -> pd.DataFrame:
    """:func:`steps_table` as a DataFrame (nullable Int64/boolean columns)."""
    return to_frame(steps_table(runs, identity=identity, strict=strict, on_skip=on_skip))


# --------------------------------------------------------------------------- export


def export_table(
    runs: RunsLike,
    path: str | os.PathLike[str],
    *,
    to: Literal["parquet", "csv"],
    level: Literal["episodes", "steps"],
    batch_rows: int = BATCH_ROWS,
    identity: bool | None = None,
    strict: bool = False,
    on_skip: OnSkip = None,
) -> int:
    """Write the episodes or steps table of ``runs`` (one run or several, as the readers take
    them) to ``path``; returns the rows written. A Parquet file carries the runs read and those
    skipped as key/value metadata (``shopsimrl.runs``, ``shopsimrl.skipped_runs``: JSON lists,
    :func:`~shopsimrl.research.runset.runs_metadata` reads them back); a CSV file the columns only.

    The research tools' one output rule (:mod:`shopsimrl.research.outputs`): never into a run read,
    missing folders created, the file whole or not at all (a temporary file beside ``path``,
    renamed at the end). Raises the errors of that module."""
    target = Path(path)
    source = resolve(runs)
    check_output_location(source if isinstance(source, Run) else _local_locations(source), target)
    with replacing(target) as out:
        if level == "episodes":
            table = episodes_table(source, batch_rows=batch_rows, identity=identity, strict=strict, on_skip=on_skip)
            rows = int(table.num_rows)
            if to == "parquet":
                pq.write_table(table, out, row_group_size=batch_rows)
            else:
                pa_csv.write_csv(table, out)
        else:
            rows = _write_steps(_StepStream(source, batch_rows, identity, Skips(strict, on_skip)), out, to)
    return rows


def _local_locations(runs: RunSet) -> list[Run | str]:
    """What the output rule checks: each run's own location (a local path, ``file://`` removed)."""
    return [member.source if isinstance(member.source, Run | str) else member.identity.location for member in runs.members]


def _write_steps(stream: _StepStream, out: IO[bytes], to: Literal["parquet", "csv"]) -> int:
    rows = 0
    writer: pq.ParquetWriter | pa_csv.CSVWriter
    # The runs and their rows are known only at the end, so they go into the footer's key/value
    # metadata then; without the Arrow schema stored at the start (which would carry metadata of
    # its own, fixed before the first row) pyarrow reads that metadata as the schema's.
    writer = pq.ParquetWriter(out, stream.schema, store_schema=False) if to == "parquet" else pa_csv.CSVWriter(out, stream.schema)
    with writer:
        for batch in stream.batches:
            writer.write_batch(batch)
            rows += int(batch.num_rows)
        if isinstance(writer, pq.ParquetWriter):
            writer.add_key_value_metadata(stream.metadata)
    return rows


def read_csv_table(path: str | os.PathLike[str], schema: pa.Schema) -> pa.Table:
    """A CSV export read back with its types: an unquoted empty field is null, a quoted one
    (``""``) the empty string, as the writer wrote them."""
    options = pa_csv.ConvertOptions(column_types=schema, strings_can_be_null=True, quoted_strings_can_be_null=False)
    return pa_csv.read_csv(path, convert_options=options)
