"""``env slots`` and ``env release-all``: operate a ShopSimulator server."""

from __future__ import annotations

import json
from typing import Any

import typer

from shopsimrl import eventloop
from shopsimrl.cli.common import HELP_STYLE, QUIET, VERBOSE, setup_logging
from shopsimrl.cli.errors import BadInputError, context
from shopsimrl.config import check_environment_url

app = typer.Typer(rich_markup_mode=None)
env_app = typer.Typer(help="Operate a ShopSimulator server: slot usage, releasing every lease.", **HELP_STYLE)
app.add_typer(env_app, name="env")


ENV_URL = typer.Option(..., "--url", envvar="SHOPSIMRL_ENV_BASE_URL", help="ShopSimulator base URL, e.g. http://shop:5700.")


def _operator_environment(url: str) -> Any:
    from shopsimrl.environment import ShopSimulatorEnvironment, ShopSimulatorSettings

    try:
        check_environment_url(url)
        return ShopSimulatorEnvironment(ShopSimulatorSettings(base_url=url, timeout=10.0, max_retries=1))
    except ValueError as exc:
        # A ValueError (the settings' validation among them) is too broad for the table; here it is --url's.
        raise BadInputError(f"--url: {exc}") from exc


@env_app.command("slots")
def env_slots(
    url: str = ENV_URL,
    as_json: bool = typer.Option(False, "--json", help="Print JSON."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Show the server's slot pool: size, free, leased (exit 3 when unreachable)."""
    from shopsimrl.environment import ShopEnvironmentError
    from shopsimrl.schemas import redact_uri

    setup_logging(quiet, verbose)
    environment = _operator_environment(url)

    async def probe() -> Any:
        try:
            return await environment.slot_usage()
        finally:
            await environment.aclose()

    with context(ShopEnvironmentError, prefix=f"{redact_uri(url)}: "):
        usage = eventloop.run(probe())
    leased = None if usage.environment_slots is None or usage.free_slots is None else usage.environment_slots - usage.free_slots
    if as_json:
        typer.echo(
            json.dumps(
                {
                    "url": redact_uri(url),
                    "environment_slots": usage.environment_slots,
                    "free_slots": usage.free_slots,
                    "leased": leased,
                }
            )
        )
    else:
        typer.echo(f"{redact_uri(url)}: {usage.describe()}" + ("" if leased is None else f", {leased} leased"))


@env_app.command("release-all")
def env_release_all(
    url: str = ENV_URL,
    yes: bool = typer.Option(False, "--yes", help="Confirm: every client of the server loses its leases."),
    quiet: bool = QUIET,
    verbose: bool = VERBOSE,
) -> None:
    """Free every slot of the server (release_all). Every client's leases become invalid, including
    runs in progress elsewhere: their episodes fail with a stale lease and are retried."""
    from shopsimrl.environment import ShopEnvironmentError
    from shopsimrl.schemas import redact_uri

    setup_logging(quiet, verbose)
    if not yes:
        raise BadInputError(
            f"release-all frees every slot of {redact_uri(url)} and invalidates the leases of EVERY client of that "
            "server, including runs in progress; add --yes to do it",
        )
    environment = _operator_environment(url)

    async def release() -> tuple[Any, str, Any]:
        try:
            before = await environment.slot_usage()
            message = await environment.release_all()
            return before, message, await environment.slot_usage()
        finally:
            await environment.aclose()

    with context(ShopEnvironmentError, prefix=f"{redact_uri(url)}: "):
        before, message, after = eventloop.run(release())
    typer.echo(f"{redact_uri(url)}: {message or 'released'}; before {before.describe()}, now {after.describe()}")
