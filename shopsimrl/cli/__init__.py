"""``shopsimrl`` command line: plan, run, worker, reduce, status, runs, evalset, summarize, wait-ready, env, training, testbed;
over finished runs (``shopsimrl/research/``): compare, report, view, show, labels, export, gate, judge.

One module per command group (see :data:`COMMANDS`); every command runs under the handler of
:mod:`shopsimrl.cli.errors`, whose one table maps exceptions to exit codes: those of
:mod:`shopsimrl.exitcodes` (0 done, 1 some episodes failed, 2 bad input, 3 interrupted/retryable,
42 the run exists with another fingerprint).
"""

from __future__ import annotations

import importlib
import importlib.metadata
import signal
from collections.abc import Iterator, MutableMapping
from typing import Any

import typer
import typer.main

from shopsimrl.cli.common import HELP_STYLE
from shopsimrl.cli.errors import HandledGroup, PartMissingError, install_hint
from shopsimrl.exitcodes import ExitCode

__all__ = ["COMMANDS", "OPTIONAL_PARTS", "app", "main"]

# Every top-level command and group, in `shopsimrl --help` order, and the module that defines
# it (its `app`). A module is imported when one of its commands runs or `--help` lists them all.
COMMANDS: dict[str, str] = {
    "plan": "shopsimrl.cli.run",
    "run": "shopsimrl.cli.run",
    "summarize": "shopsimrl.cli.run",
    "worker": "shopsimrl.cli.shards",
    "reduce": "shopsimrl.cli.shards",
    "status": "shopsimrl.cli.status",
    "runs": "shopsimrl.cli.runs",
    "evalset": "shopsimrl.cli.evalset",
    "wait-ready": "shopsimrl.cli.run",
    "compare": "shopsimrl.research.cli",
    "report": "shopsimrl.research.cli",
    "labels": "shopsimrl.research.cli",
    "show": "shopsimrl.research.cli",
    "view": "shopsimrl.research.cli",
    "testbed": "shopsimrl.testbed.cli",
    "env": "shopsimrl.cli.env",
    "training": "shopsimrl.cli.training",
    "gate": "shopsimrl.research.cli",
    "judge": "shopsimrl.research.cli",
    "skills": "shopsimrl.research.cli",
    "export": "shopsimrl.research.cli",
}
# Parts installed apart, or not at all (the worker image has neither): never imported statically
# by the core. Without one, its commands stay listed and exit 2 naming what to install.
OPTIONAL_PARTS: dict[str, str] = {"shopsimrl.research.cli": "research", "shopsimrl.testbed.cli": "testbed"}


def _missing_part(name: str, module: str, extra: str, missing: str | None) -> Any:
    """``name`` of a part that is not installed: listed, and any use of it exits 2 with the hint."""
    part = typer.Typer(rich_markup_mode=None)

    @part.command(
        name,
        help=install_hint(module, extra, missing),
        context_settings={"ignore_unknown_options": True, "allow_extra_args": True},
    )
    def refuse() -> None:
        raise PartMissingError(module, extra, missing)

    return typer.main.get_group(part).commands[name]


class _Commands(MutableMapping[str, Any]):
    """The root group's commands: the names of :data:`COMMANDS`, each module loaded on first
    use, so that ``shopsimrl worker`` imports neither the research tools nor the testbed."""

    def __init__(self, loaded: MutableMapping[str, Any]) -> None:
        self._loaded = dict(loaded)

    def _load(self, module: str) -> None:
        try:
            part = importlib.import_module(module)
        except ModuleNotFoundError as exc:
            if module not in OPTIONAL_PARTS:
                raise
            for name in (name for name, owner in COMMANDS.items() if owner == module):
                self._loaded[name] = _missing_part(name, module, OPTIONAL_PARTS[module], exc.name)
            return
        # The part's commands and groups as click commands; help style and all as at the root.
        self._loaded.update(typer.main.get_group(part.app).commands)

    def __getitem__(self, name: str) -> Any:
        if name not in self._loaded and name in COMMANDS:
            self._load(COMMANDS[name])
        return self._loaded[name]

    def __setitem__(self, name: str, command: Any) -> None:
        self._loaded[name] = command

    def __delitem__(self, name: str) -> None:
        del self._loaded[name]

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys([*COMMANDS, *self._loaded]))

    def __len__(self) -> int:
        return len(set(COMMANDS) | set(self._loaded))

    def __contains__(self, name: object) -> bool:
        return name in COMMANDS or name in self._loaded


class _Root(HandledGroup):
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.commands = _Commands(self.commands)


app = typer.Typer(
    cls=_Root, add_completion=False, help="Frozen, resumable rollouts of shopping agents on ShopSimulator.", **HELP_STYLE
)


def _print_version(requested: bool) -> None:
    if requested:
        typer.echo(f"shopsimrl {importlib.metadata.version('shopsimrl')}")
        raise typer.Exit


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", is_eager=True, callback=_print_version, help="Print the version and exit."),
) -> None:
    pass  # --version acts in its callback; the commands do the rest


def _stop_early(signum: int, frame: object) -> None:
    # Until a command installs its own handling (a run's graceful stop), a signal ends the process
    # at once with the retryable code: nothing is held yet that needs cleaning up.
    raise SystemExit(int(ExitCode.RETRYABLE))


def main() -> None:
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, _stop_early)
    # A shard worker starts with both blocked (sharded.local_job); from here they are handled.
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})
    app()
