"""Typed, versioned records: what shopsimrl writes and reads (docs/runtime_eval.md §2, §3, §5).

One model per schema version, a JSON Schema per version checked in beside them
(``shopsimrl/records/schemas/``, written by ``python -m shopsimrl.records``), and one reader
per kind that refuses versions it does not know:

    from shopsimrl.records import read_trace, dump_line
    trace = read_trace(orjson.loads(line))        # EpisodeTrace
    trace.final.reward, trace.steps[0].model.usage.total_tokens
"""

from shopsimrl.records._base import Record, RecordVersionError
from shopsimrl.records.io import (
    ManifestIntegrityError,
    RecordFormatError,
    decode_json,
    dump_document,
    dump_line,
    iter_trace_lines,
    parse_trace_line,
    plain,
    read_manifest,
    read_marker,
    read_summary,
    read_trace,
    to_plain,
)
from shopsimrl.records.manifest import MANIFEST_SCHEMA_VERSION, MANIFEST_SCHEMA_VERSIONS, RunManifest, RunPlan
from shopsimrl.records.marker import MARKER_SCHEMA_VERSION, MarkerEpisodes, MarkerPart, ShardMarker
from shopsimrl.records.summary import SUMMARY_SCHEMA_VERSION, SUMMARY_SCHEMA_VERSIONS, EvalSummary, RunIdentity
from shopsimrl.records.trace import (
    TRACE_SCHEMA_VERSION,
    TRACE_SCHEMA_VERSIONS,
    ActionFeedback,
    CallAttempt,
    CodedMessage,
    EnvironmentResult,
    EpisodeTrace,
    ErrorInfo,
    JobRecord,
    ModelTurn,
    SelectedSkill,
    Step,
    TimeLimit,
    ToolCallRecord,
    Usage,
)

__all__ = [
    "MANIFEST_SCHEMA_VERSION",
    "MANIFEST_SCHEMA_VERSIONS",
    "MARKER_SCHEMA_VERSION",
    "SUMMARY_SCHEMA_VERSION",
    "SUMMARY_SCHEMA_VERSIONS",
    "TRACE_SCHEMA_VERSION",
    "TRACE_SCHEMA_VERSIONS",
    "ActionFeedback",
    "CallAttempt",
    "CodedMessage",
    "EnvironmentResult",
    "EpisodeTrace",
    "ErrorInfo",
    "EvalSummary",
    "JobRecord",
    "ManifestIntegrityError",
    "MarkerEpisodes",
    "MarkerPart",
    "ModelTurn",
    "Record",
    "RecordFormatError",
    "RecordVersionError",
    "RunIdentity",
    "RunManifest",
    "RunPlan",
    "SelectedSkill",
    "ShardMarker",
    "Step",
    "TimeLimit",
    "ToolCallRecord",
    "Usage",
    "decode_json",
    "dump_document",
    "dump_line",
    "iter_trace_lines",
    "parse_trace_line",
    "plain",
    "read_manifest",
    "read_marker",
    "read_summary",
    "read_trace",
    "to_plain",
]
