"""``shopsimrl evalset SET.yaml``: several checkpoints or configs run as one set, one run each
under the set's location (see :mod:`shopsimrl.runner.evalset`)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import typer

from shopsimrl.cli.common import HELP_STYLE, QUIET, VERBOSE, prepare, setup_logging, worker_settings
from shopsimrl.cli.errors import BadInputError
from shopsimrl.exitcodes import ExitCode

__all__ = ["app"]

app = typer.Typer(**HELP_STYLE)
COMPARE_RESAMPLES, COMPARE_SEED = 10_000, 20260901
"""``shopsimrl compare``'s defaults, for the comparison that ends a set."""


@app.command("evalset")
def evalset(
    set_path: Path = typer.Argument(..., metavar="SET", help="Eval set YAML: location, members."),
    status: bool = typer.Option(False, "--status", help="Print each member's state; run nothing."),
    as_json: bool = typer.Option(False, "--json", help="With --status: JSON lines."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Live progress bar of the first member."),
    report: bool = typer.Option(
        True, "--report/--no-report", help="End with the leaderboard and a compare against the first member."
    ),
    helm_values: Path | None = typer.Option(
        None, "--helm-values", metavar="DIR", help="Write DIR/<member>.yaml for the chart; run nothing."
    ),
    shards: int = typer.Option(1, "--shards", min=1, metavar="N", help="With --helm-values: worker pods per release."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Run (or resume) every member of an eval set: one run per member under the set's
    location, each with its own frozen plan, all at once sharing the set's slots (the
    earliest member first); then the runs leaderboard. Ctrl-C exits 3 and the same command
    resumes; a member whose plan changed since it froze exits 42 naming it.
    --helm-values: one Helm release per member instead (docs/research.md)."""
    from shopsimrl.config import ConfigError
    from shopsimrl.runner.evalset import load_evalset, member_state

    setup_logging(quiet, verbose)
    if helm_values is not None:
        from shopsimrl.cli.evalset_extras import print_helm_values

        print_helm_values(set_path, helm_values, shards)
        return
    try:
        the_set = load_evalset(set_path)
    except ConfigError as exc:
        raise BadInputError(str(exc)) from None
    if status:
        for member in the_set.members:
            state = member_state(the_set, member)
            typer.echo(json.dumps(state) if as_json else f"{member.name:<24} {state['state']:<8} {state['run']}")
        return
    from shopsimrl.runner.local import LocalRun, run_local_together

    # Every config is checked before anything runs: a typo in the last member costs no run.
    try:
        settings = worker_settings()
        configs = [the_set.member_config(member, settings) for member in the_set.members]
    except ConfigError as exc:
        raise BadInputError(str(exc)) from None
    from shopsimrl.cli.evalset_extras import set_tracking, track_member

    tracking = set_tracking(the_set)
    # Every member's frozen plan is checked before any runs: a member edited since it froze
    # stops the set at once (exit 42 naming it), not after the members before it have run.
    prepared_members = [prepare(config, False) for config in configs]
    for member, prepared in zip(the_set.members, prepared_members, strict=True):
        _check_frozen_plan(member.name, prepared)
    for prepared in prepared_members:
        prepared.model().check_api_key()
    concurrency = the_set.concurrency or max(prepared.config.experiment.concurrency for prepared in prepared_members)
    for index, member in enumerate(the_set.members, start=1):
        typer.echo(f"[{index}/{len(configs)}] {member.name}: {the_set.run_dir(member)}", err=True)
    runs = [
        LocalRun(prepared, name=f"member {member.name!r}")
        for member, prepared in zip(the_set.members, prepared_members, strict=True)
    ]
    # All members run at once on one event loop, sharing `concurrency` slots (the earliest
    # member first), so the next member fills the slots a draining one frees.
    summaries = run_local_together(
        runs, concurrency=concurrency, show_progress=progress, announce=lambda line: typer.echo(line, err=True)
    )
    for member, summary in zip(the_set.members, summaries, strict=True):
        track_member(tracking, the_set, member, summary)
    worst = ExitCode.EPISODES_FAILED if any(summary.get("failed") for summary in summaries) else ExitCode.OK
    if report:
        from shopsimrl.cli.runs import runs as leaderboard

        leaderboard(
            str(the_set.location), sort="score", ascending=None, group=True, depth=1, as_json=False, quiet=quiet, verbose=verbose
        )
        if len(the_set.members) > 1:
            _compare_with_first([str(the_set.run_dir(member)) for member in the_set.members])
    if worst:
        raise typer.Exit(int(worst))


def _compare_with_first(runs: list[str]) -> None:
    """``shopsimrl compare`` of every member against the first, when the research part is
    installed; a set whose runs cannot be compared (a partial member) says why and goes on."""
    from shopsimrl.cli.errors import PartMissingError, import_part

    try:
        compare = import_part("shopsimrl.research.compare", "research")
    except PartMissingError as exc:
        typer.echo(f"compare against the first member skipped: {exc}", err=True)
        return
    try:
        result = compare.compare_runs(runs, allow_partial=False, resamples=COMPARE_RESAMPLES, seed=COMPARE_SEED)
    except compare.CompareError as exc:
        typer.echo(f"compare against the first member skipped: {exc}", err=True)
        return
    typer.echo(compare.format_comparison(result))


def _check_frozen_plan(name: str, prepared: Any) -> None:
    """Exit 42 naming member ``name`` when its run folder froze another plan."""
    from shopsimrl.manifest import ManifestError
    from shopsimrl.runner.local import RunStopped
    from shopsimrl.schemas import fingerprint
    from shopsimrl.storage.local import LocalRunStore

    try:
        existing = LocalRunStore(prepared.config.run_dir).read_manifest()
    except (ManifestError, OSError, ValueError) as exc:
        raise RunStopped(ExitCode.BAD_INPUT, f"member {name!r}: {exc}") from None
    if existing is not None and existing.plan_fingerprint != fingerprint(prepared.plan()):
        raise RunStopped(
            ExitCode.FINGERPRINT_MISMATCH,
            f"member {name!r}: {prepared.config.run_dir} froze another plan ({existing.plan_fingerprint[:12]}); "
            "undo the change or give the member a new name",
        )
