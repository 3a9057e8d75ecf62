"""The CLI's one exception → exit code table (shopsimrl/cli/errors.py) and its table of command
modules (shopsimrl/cli/__init__.py): every class of the table ends a command with its code and
its ``error: …`` line, no entry shadows another, every command is where the table says, and the
core's commands run and list the optional parts without importing them."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
import typer.main
from typer.testing import CliRunner

from shopsimrl.cli import COMMANDS, OPTIONAL_PARTS, app
from shopsimrl.cli.errors import RULES, HandledGroup, PartMissingError, Rule, context, exit_for
from shopsimrl.exitcodes import ExitCode
from tests.testbed_process import write_config

ROOT = Path(__file__).resolve().parents[1]


def shadowed(rules: tuple[Rule, ...]) -> list[str]:
    """Entries that can never match: listed twice, or after an entry for one of their bases."""
    classes = [rule.resolve(load=True) for rule in rules]
    problems = [f"{rule.error} does not name an exception class" for rule, cls in zip(rules, classes, strict=True) if cls is None]
    for later, (rule, cls) in enumerate(zip(rules, classes, strict=True)):
        for earlier in range(later):
            base = classes[earlier]
            if cls is not None and base is not None and issubclass(cls, base):
                problems.append(f"{rule.error} comes after {rules[earlier].error}, which it is (or subclasses)")
    return problems


def test_no_entry_of_the_table_is_a_duplicate_or_shadowed_by_an_earlier_one() -> None:
    assert shadowed(RULES) == []
    assert RULES[-1].error == "builtins:OSError", "the broadest entry goes last"


def test_the_shadow_check_finds_a_subclass_after_its_base_and_a_duplicate() -> None:
    """The control for the test above."""
    rules = (
        Rule("shopsimrl.config:ConfigError", ExitCode.BAD_INPUT),
        Rule("builtins:OSError", ExitCode.RETRYABLE),
        Rule("shopsimrl.research.outputs:OutputStorageError", ExitCode.RETRYABLE),  # an OSError
        Rule("shopsimrl.config:ConfigError", ExitCode.BAD_INPUT),
        Rule("shopsimrl.config:NoSuchError", ExitCode.BAD_INPUT),
    )
    assert shadowed(rules) == [
        "shopsimrl.config:NoSuchError does not name an exception class",
        "shopsimrl.research.outputs:OutputStorageError comes after builtins:OSError, which it is (or subclasses)",
        "shopsimrl.config:ConfigError comes after shopsimrl.config:ConfigError, which it is (or subclasses)",
    ]


def _instance(cls: type[BaseException], **attributes: Any) -> BaseException:
    """An instance of ``cls`` whose message is ``boom``, whatever its constructor asks for."""
    if issubclass(cls, PartMissingError):
        return cls("shopsimrl.research.cli", "research", "numpy")
    exc = cls.__new__(cls)
    exc.args = ("boom",)
    for name, value in attributes.items():
        setattr(exc, name, value)
    return exc


def _cases() -> list[tuple[str, BaseException, ExitCode]]:
    cases: list[tuple[str, BaseException, ExitCode]] = []
    for rule in RULES:
        cls = rule.resolve(load=True)
        assert cls is not None, rule.error
        if rule.error.endswith(":RunStopped"):
            cases += [(rule.error, _instance(cls, code=code), code) for code in (ExitCode.RETRYABLE, ExitCode.BAD_INPUT)]
        elif rule.error.endswith(":RunWriteError"):
            cases += [
                (rule.error, _instance(cls, retryable=True), ExitCode.RETRYABLE),
                (rule.error, _instance(cls, retryable=False), ExitCode.BAD_INPUT),
            ]
        else:
            assert not callable(rule.code), f"{rule.error}: add its cases here"
            cases.append((rule.error, _instance(cls), rule.code))
    return cases


def _probe(raise_it: Any) -> Any:
    """A command group with the CLI's handler and one command, ``go``, that runs ``raise_it``."""
    probe = typer.Typer(cls=HandledGroup, rich_markup_mode=None)

    @probe.callback()
    def _root() -> None:
        pass

    @probe.command("go")
    def _go() -> None:
        raise_it()

    return CliRunner().invoke(probe, ["go"])


@pytest.mark.parametrize(("error", "exc", "code"), _cases(), ids=[f"{error}->{int(code)}" for error, _, code in _cases()])
def test_every_exception_of_the_table_ends_a_command_with_its_code_and_one_error_line(
    error: str, exc: BaseException, code: ExitCode
) -> None:
    def raise_it() -> None:
        raise exc

    result = _probe(raise_it)
    assert result.exit_code == int(code), (error, result.output)
    assert result.stdout == ""
    assert result.stderr == f"error: {exc}\n"
    assert result.exception is None or isinstance(result.exception, SystemExit)


def test_an_exception_outside_the_table_is_not_swallowed() -> None:
    def raise_it() -> None:
        raise KeyError("a bug")

    result = _probe(raise_it)
    assert isinstance(result.exception, KeyError) and result.exit_code == 1


def test_the_innermost_context_names_where_the_error_comes_from() -> None:
    from shopsimrl.research.outputs import OutputStorageError

    def raise_it() -> None:
        with context(OSError, prefix="outer: "), context(OutputStorageError, prefix="-o: ", suffix=" (kept)"):
            raise OutputStorageError(28, "disk full")

    result = _probe(raise_it)
    assert (result.exit_code, result.stderr) == (3, "error: -o: disk full (kept)\n")
    assert exit_for(ValueError("not ours")) is None


# --------------------------------------------------------------------------- the command table


def test_every_command_is_defined_where_the_table_says_and_the_table_lists_them_all() -> None:
    import importlib

    defined: dict[str, str] = {}
    for module in dict.fromkeys(COMMANDS.values()):
        for name in typer.main.get_group(importlib.import_module(module).app).commands:
            assert name not in defined, f"{name} is defined in {defined.get(name)} and {module}"
            defined[name] = module
    assert defined == COMMANDS
    assert set(OPTIONAL_PARTS) <= set(COMMANDS.values())
    assert list(typer.main.get_command(app).commands) == list(COMMANDS)


# --------------------------------------------------------------------------- real invocations


def _shopsimrl(*args: str, cwd: Path = ROOT) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "shopsimrl", *args], capture_output=True, text=True, cwd=cwd, timeout=180)


# Parts made unimportable the way Python documents it (None in sys.modules), then the CLI.
# At exit, the names of the modules it imported, as the last line on stderr.
_WITHOUT = """
import atexit, json, sys
for name in sys.argv[1].split(","):
    if name:
        sys.modules[name] = None
atexit.register(lambda: print(json.dumps(sorted(sys.modules)), file=sys.stderr))
sys.argv = ["shopsimrl", *sys.argv[2:]]
from shopsimrl.cli import main
main()
"""


def _without(missing: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", _WITHOUT, missing, *args], capture_output=True, text=True, cwd=ROOT, timeout=180)


@pytest.mark.slow
def test_a_real_invocation_exits_with_each_code_of_the_table(tmp_path: Path) -> None:
    """One representative per code, through ``python -m shopsimrl``: the flags (2, the CLI's
    own), an unreachable ShopSimulator (3, with the URL as context), a run planned with another
    plan (42), a config that does not exist (2, ConfigError)."""
    bad_flags = _shopsimrl("summarize", "s3://bucket/run")
    assert bad_flags.returncode == 2
    assert bad_flags.stderr.splitlines()[-1] == (
        "error: s3://bucket/run is a run location URI; summarize reads a local run directory "
        "(the summary of a sharded run is written by `shopsimrl reduce s3://bucket/run`)"
    )
    unreachable = _shopsimrl("env", "slots", "--url", "http://127.0.0.1:9")
    assert unreachable.returncode == 3
    assert unreachable.stderr.splitlines()[-1].startswith("error: http://127.0.0.1:9: ")
    no_config = _shopsimrl("plan", str(tmp_path / "missing.yaml"))
    assert no_config.returncode == 2 and no_config.stderr.startswith("error: ") and "missing.yaml" in no_config.stderr
    run = str(tmp_path / "sharded")
    first = _shopsimrl("plan", str(write_config(tmp_path, name="a", sample_size=2)), "--shards", "2", "--run", run)
    assert first.returncode == 0, first.stderr
    other = _shopsimrl("plan", str(write_config(tmp_path, name="b", sample_size=3)), "--shards", "2", "--run", run)
    assert other.returncode == 42, other.stderr
    assert other.stderr.startswith("error: ") and "Traceback" not in other.stderr


@pytest.mark.slow
def test_the_core_lists_and_runs_without_the_optional_parts_and_help_imports_no_heavy_library() -> None:
    """``shopsimrl --help`` reads neither the research modules nor the testbed's servers; without
    the research part its commands are still listed, and running one exits 2 naming the
    install; the core's commands import no optional part."""
    heavy = ("numpy", "pandas", "pyarrow", "scipy", "starlette", "uvicorn", "kubernetes", "aiohttp")
    helped = _without("", "--help")
    assert helped.returncode == 0, helped.stderr
    loaded = json.loads(helped.stderr.strip().splitlines()[-1])
    assert [m for m in loaded if m.split(".")[0] in heavy] == []
    assert "shopsimrl.research.cli" in loaded and "shopsimrl.research.compare" not in loaded

    bare = _without("shopsimrl.research.cli,shopsimrl.testbed.cli", "--help")
    assert bare.returncode == 0, bare.stderr
    listed = [line.split()[0] for line in bare.stdout.split("Commands:")[1].splitlines() if line.strip()]
    assert listed == list(COMMANDS)
    for args in (["compare", "a", "b", "--json", "-"], ["gate", "plan", "g.yaml"], ["testbed", "up", "--shop-port", "1"]):
        refused = _without("shopsimrl.research.cli,shopsimrl.testbed.cli", *args)
        assert refused.returncode == 2, refused.stderr
        line = refused.stderr.splitlines()[0]
        extra = "testbed" if args[0] == "testbed" else "research"
        assert line.startswith("error: ") and f"pip install 'shopsimrl[{extra}]'" in line, line

    assert _without("shopsimrl.research,shopsimrl.testbed", "worker", "--help").returncode == 0
    worker = _without("", "worker", "--help")
    assert worker.returncode == 0, worker.stderr
    imported = json.loads(worker.stderr.strip().splitlines()[-1])
    assert not [m for m in imported if m.startswith(("shopsimrl.research", "shopsimrl.testbed"))]
