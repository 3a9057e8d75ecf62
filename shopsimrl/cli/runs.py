"""``runs``: the runs under a folder or ``s3://`` prefix, grouped by job list: a leaderboard."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from shopsimrl.cli.common import QUIET, VERBOSE, setup_logging
from shopsimrl.cli.errors import BadInputError

if TYPE_CHECKING:
    from shopsimrl.runner.runs import RunEntry

app = typer.Typer(rich_markup_mode=None)

_SORT_HELP = (
    "Order runs by this column: name, experiment, model, checkpoint, split, fingerprint, created, state, "
    "score, success, coverage, completed, failed, requested, tokens, cost, accelerator_hours, kind. "
    "Scores (score, success, coverage) best first, the rest ascending; runs without the value last."
)


@app.command("runs")
def runs(
    location: str = typer.Argument(
        ..., metavar="LOCATION", help="A folder, file:// or s3:// prefix holding runs (or one run): local and sharded runs."
    ),
    sort: str = typer.Option("score", "--sort", metavar="COLUMN", help=_SORT_HELP),
    ascending: bool | None = typer.Option(
        None, "--ascending/--descending", help="Force the order of --sort (default: best scores first, the rest ascending)."
    ),
    group: bool = typer.Option(
        True,
        "--group/--no-group",
        help="Group runs of the same job list (split, seed, sample size, repeats): one leaderboard per group. "
        "--no-group: one list.",
    ),
    depth: int = typer.Option(8, "--depth", min=0, max=64, help="How many folders below LOCATION to look for runs."),
    as_json: bool = typer.Option(
        False, "--json", help="Print JSON (every field of every run, and the groups) instead of a table."
    ),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """List the runs under LOCATION with their identity (experiment, model, checkpoint, split,
    plan fingerprint, created) and headline (intent-to-treat score with its 95% interval, success,
    coverage, failures, tokens, cost), sorted, grouped by job list. Reads manifests' heads,
    summaries, progress files and, for a sharded run without a summary, its commit markers:
    never a trace. A run without a summary is listed with its state; one that cannot be read, with
    its error. Exit 0 even then; 2 when LOCATION cannot hold runs."""
    from shopsimrl.runner.runs import COLUMN_KEYS, group_runs, list_runs, sort_runs

    setup_logging(quiet, verbose)
    if sort not in COLUMN_KEYS:
        raise BadInputError(f"--sort: unknown column {sort!r}; one of {', '.join(COLUMN_KEYS)}")
    if "://" not in location and not Path(location).is_dir():
        raise BadInputError(f"{location}: {'not a folder' if Path(location).exists() else 'does not exist'}")
    entries = sort_runs(list_runs(location, max_depth=depth), sort, descending=None if ascending is None else not ascending)
    groups: list[tuple[str | None, str | None, list[RunEntry]]] = group_runs(entries) if group else [(None, None, entries)]
    if as_json:
        document: dict[str, Any] = {
            "location": _shown(location),
            "sort": sort,
            "runs": [entry.as_dict() for entry in entries],
            "groups": [
                {"job_list": key, "label": label, "runs": [entry.name for entry in members]} for key, label, members in groups
            ]
            if group
            else [],
        }
        typer.echo(json.dumps(document, ensure_ascii=False, indent=2))
        return
    if not entries:
        typer.echo(f"no runs under {_shown(location)}")
        return
    typer.echo(_table(entries, groups, group))


def _shown(location: str) -> str:
    from shopsimrl.schemas import redact_uri

    return redact_uri(location) if "://" in location else location


def _table(entries: list[RunEntry], groups: list[tuple[str | None, str | None, list[RunEntry]]], grouped: bool) -> str:
    from shopsimrl.runner.runs import COLUMNS

    columns = [column for column in COLUMNS if column.key != "kind"]
    cells = {id(entry): [column.show(entry) for column in columns] for entry in entries}
    widths = [max(len(column.title), *(len(cells[id(entry)][i]) for entry in entries)) for i, column in enumerate(columns)]

    def line(values: list[str]) -> str:
        return "  ".join(value.ljust(width) for value, width in zip(values, widths, strict=True)).rstrip()

    out: list[str] = []
    for key, label, members in groups:
        if grouped:
            heading = f"job list {key}: {label}" if key is not None else "no job list (no readable manifest)"
            out.append(f"{heading} · {len(members)} run{'s' if len(members) != 1 else ''}")
        out.append("  #  " + line([column.title for column in columns]))
        for rank, entry in enumerate(members, start=1):
            out.append(f"{rank:>3}  " + line(cells[id(entry)]))
            notes = [text for text in (entry.detail, entry.error and f"error: {entry.error}") if text]
            if notes:
                out.append("       " + " · ".join(notes))
        out.append("")
    if any(entry.tokens_scope == "completed episodes" for entry in entries):
        out.append("tokens*: completed episodes only (a summary written before tokens of every attempt were summed)")
    return "\n".join(out).rstrip()
