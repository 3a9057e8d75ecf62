"""Where ``skills build`` reads a train run's traces from: a local ``traces.jsonl``, a local run
directory, or a sharded run (a local directory with ``shards.json``, or ``s3://`` and any other
location :func:`shopsimrl.storage.reading.open_run` reads).

A file is read as before (the latest record per episode, in first-seen order). A run is read
through the run readers every other command uses, so sharded parts and object storage give each
episode's winning record; those come in the order of the run's frozen job list (episode id order
without one), so a local run and a sharded run of the same plan give the analyst the same traces
in the same order.
"""

from __future__ import annotations

from pathlib import Path

from shopsimrl.records import EpisodeTrace
from shopsimrl.research.skills.analyst import SkillInputError, check_train_traces, latest_traces, trace_sha256
from shopsimrl.schemas import fingerprint, redact_uri, sha256_hex
from shopsimrl.storage.reading import RunReadError, open_run

__all__ = ["TrainTraces", "read_train_traces"]


class TrainTraces(list[EpisodeTrace]):
    """The traces, with where they came from (credentials removed) and a digest of them."""

    location: str
    input_name: str
    """Its name among the manifest's inputs: ``traces.jsonl`` (a file) or ``traces`` (a run)."""
    digest: str
    """A file: its sha256. A run: the fingerprint of every episode's id and trace sha256, in order."""


def read_train_traces(location: str | Path, *, expected: int | None) -> TrainTraces:
    """The train traces at ``location`` (module docstring), refused (:class:`SkillInputError`
    naming the location and the episode) unless each is a completed train episode with a binary
    ``r_success`` and there are exactly ``expected``."""
    text = str(location)
    shown = redact_uri(text) if "://" in text else text
    path = Path(text)
    if "://" not in text and path.is_file():
        found = TrainTraces(latest_traces(path, expected=expected))
        found.location, found.input_name, found.digest = shown, "traces.jsonl", sha256_hex(path.read_bytes())
        return found
    try:
        run = open_run(text)
        records = {record.episode_id: record for record in run.records()}
        jobs = run.jobs
    except RunReadError as exc:
        raise SkillInputError(f"experiment.traces: {exc}") from None
    rank = {job.episode_id: index for index, job in enumerate(jobs or [])}
    ordered = sorted(records, key=lambda episode: (rank.get(episode, len(rank)), episode))
    found = TrainTraces(check_train_traces({e: records[e] for e in ordered}, shown, expected=expected))
    found.location, found.input_name = shown, "traces"
    found.digest = fingerprint([[trace.episode_id, trace_sha256(trace)] for trace in found])
    return found
