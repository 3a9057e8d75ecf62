"""The JSON Schema of every record version, as checked in under ``shopsimrl/records/schemas/``.

``python -m shopsimrl.records`` rewrites them from the models; a test fails while a checked-in
schema differs from its model, so a model change cannot slip past a reviewer without its schema.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from shopsimrl.records._base import Record
from shopsimrl.records.manifest import MANIFEST_SCHEMA_VERSION, RunManifest
from shopsimrl.records.marker import MARKER_SCHEMA_VERSION, ShardMarker
from shopsimrl.records.summary import SUMMARY_SCHEMA_VERSION, EvalSummary
from shopsimrl.records.trace import TRACE_SCHEMA_VERSION, EpisodeTrace

__all__ = ["SCHEMA_DIR", "SCHEMA_MODELS", "schema_document", "write_schemas"]

SCHEMA_DIR = Path(__file__).resolve().parent / "schemas"

SCHEMA_MODELS: dict[str, type[Record]] = {
    TRACE_SCHEMA_VERSION: EpisodeTrace,
    MANIFEST_SCHEMA_VERSION: RunManifest,
    MARKER_SCHEMA_VERSION: ShardMarker,
    SUMMARY_SCHEMA_VERSION: EvalSummary,
}
"""The version each model writes. Versions read but no longer written (manifest v1, summary v2)
are read through the current model and have no schema of their own here."""


def schema_document(version: str) -> dict[str, Any]:
    """The JSON Schema (draft 2020-12) of the records written as ``version``."""
    schema = SCHEMA_MODELS[version].model_json_schema(mode="serialization")
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", "$id": f"{version}.schema.json", **schema}


def render(version: str) -> str:
    return json.dumps(schema_document(version), ensure_ascii=False, indent=2, sort_keys=False) + "\n"


def write_schemas(directory: Path = SCHEMA_DIR) -> list[Path]:
    directory.mkdir(parents=True, exist_ok=True)
    written = []
    for version in SCHEMA_MODELS:
        path = directory / f"{version}.schema.json"
        path.write_text(render(version), encoding="utf-8")
        written.append(path)
    return written
