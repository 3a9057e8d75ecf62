"""The store interface the runner writes through and the readers read through.

A local directory (:class:`~shopsimrl.storage.local.LocalRunStore`) is a one-shard store; an
object-store prefix (:class:`~shopsimrl.storage.sharded.ShardedRunStore`) an N-shard one. Both
freeze a plan (create the manifest, or verify that the one there freezes the same plan), open a
writer for a shard, take summaries; :func:`shopsimrl.storage.reading.open_run` reads either.
"""

from __future__ import annotations

from typing import Any, Protocol

from shopsimrl.records import EpisodeTrace

__all__ = ["RunStore", "TraceWriter"]


class TraceWriter(Protocol):
    """Where a runner saves the attempts it finished."""

    def save_traces(self, records: list[EpisodeTrace]) -> None:
        """Append ``records`` (one group commit of the scheduler); called off the event loop."""

    def flush(self) -> None:
        """Make everything saved so far durable (a sharded writer writes its buffered part)."""


class RunStore(Protocol):
    """A run's location."""

    display_uri: str
    """Where the run is, credentials removed."""

    def read_manifest(self) -> dict[str, Any] | None:
        """The frozen plan there is, verified against its fingerprint; None before the first freeze."""

    def freeze_plan(self, plan: dict[str, Any], execution: dict[str, Any] | None = None) -> dict[str, Any]:
        """Create the manifest, or verify that the one there freezes the same plan
        (:class:`~shopsimrl.manifest.FingerprintMismatchError` otherwise); returns it."""

    def write_summary(self, summary: dict[str, Any]) -> None:
        """Replace the run's summary whole."""
