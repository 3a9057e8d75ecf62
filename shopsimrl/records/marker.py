"""A shard's commit marker, ``shopsimrl-shard-commit-v1`` (docs/sharded_runs.md).

``_SUCCESS.json`` (or ``_SUCCESS-<writer>.json``) lists every part a shard's writer committed,
with its sha256 and record count; the reducer trusts only parts a verified marker lists.
"""

from __future__ import annotations

from typing import Final, Literal

from shopsimrl.records._base import FlexStr, Record

__all__ = ["MARKER_SCHEMA_VERSION", "MarkerEpisodes", "MarkerPart", "ShardMarker"]

MARKER_SCHEMA_VERSION: Final = "shopsimrl-shard-commit-v1"


class MarkerPart(Record):
    """One committed part."""

    name: str
    sha256: str
    records: int | None = None


class MarkerEpisodes(Record):
    """The shard's episodes by outcome when it was committed."""

    completed: int
    failed: int


class ShardMarker(Record):
    """The commit of one shard of one plan."""

    schema_version: Literal["shopsimrl-shard-commit-v1"] = MARKER_SCHEMA_VERSION
    shard: int
    plan_fingerprint: str
    episodes: MarkerEpisodes
    episode_ids_sha256: str
    """Digest of the shard's episode ids (the shard map's assignment it commits)."""
    parts: list[MarkerPart]
    writer: FlexStr = None
    written_at: FlexStr = None
