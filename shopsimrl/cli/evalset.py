"""``shopsimrl evalset SET.yaml``: several checkpoints or configs run as one set, one run each
under the set's location (see :mod:`shopsimrl.runner.evalset`)."""

from __future__ import annotations

import json
from pathlib import Path

import typer

from shopsimrl.cli.common import HELP_STYLE, QUIET, VERBOSE, prepare, setup_logging, worker_settings
from shopsimrl.cli.errors import BadInputError
from shopsimrl.exitcodes import ExitCode

__all__ = ["app"]

app = typer.Typer(**HELP_STYLE)


@app.command("evalset")
def evalset(
    set_path: Path = typer.Argument(..., metavar="SET", help="Eval set YAML: location, members."),
    status: bool = typer.Option(False, "--status", help="Print each member's state; run nothing."),
    as_json: bool = typer.Option(False, "--json", help="With --status: JSON lines."),
    progress: bool = typer.Option(True, "--progress/--no-progress", help="Show a live progress bar."),
    report: bool = typer.Option(True, "--report/--no-report", help="End with the runs leaderboard of the set."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Run (or resume) every member of an eval set: one run per member under the set's
    location, each with its own frozen plan; then the runs leaderboard. Ctrl-C exits 3 and the
    same command resumes; a member whose plan changed since it froze exits 42 naming it."""
    from shopsimrl.config import ConfigError
    from shopsimrl.runner.evalset import load_evalset, member_state

    setup_logging(quiet, verbose)
    try:
        the_set = load_evalset(set_path)
    except ConfigError as exc:
        raise BadInputError(str(exc)) from None
    if status:
        for member in the_set.members:
            state = member_state(the_set, member)
            typer.echo(json.dumps(state) if as_json else f"{member.name:<24} {state['state']:<8} {state['run']}")
        return
    from shopsimrl.runner.local import RunStopped, run_local

    # Every config is checked before anything runs: a typo in the last member costs no run.
    try:
        settings = worker_settings()
        configs = [the_set.member_config(member, settings) for member in the_set.members]
    except ConfigError as exc:
        raise BadInputError(str(exc)) from None
    worst = ExitCode.OK
    for index, (member, config) in enumerate(zip(the_set.members, configs, strict=True), start=1):
        typer.echo(f"[{index}/{len(configs)}] {member.name}: {the_set.run_dir(member)}", err=True)
        prepared = prepare(config, False)
        prepared.model().check_api_key()
        try:
            _, summary = run_local(prepared, show_progress=progress, announce=lambda line: typer.echo(line, err=True))
        except RunStopped as exc:
            raise RunStopped(exc.code, f"member {member.name!r}: {exc}") from None
        if summary.get("failed"):
            worst = ExitCode.EPISODES_FAILED
    if report:
        from shopsimrl.cli.runs import runs as leaderboard

        leaderboard(
            str(the_set.location), sort="score", ascending=None, group=True, depth=1, as_json=False, quiet=quiet, verbose=verbose
        )
    if worst:
        raise typer.Exit(int(worst))
