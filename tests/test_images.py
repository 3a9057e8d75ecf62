"""The images: a worker image with only what a worker runs, a testbed image, both buildable.

No Docker engine runs here, so the Dockerfiles are checked by hadolint and by what they copy
and install: the worker package is built exactly as the worker Dockerfile's builder stage does
and inspected. What a worker imports is checked on real processes (``python -X importtime``)
running the worker path end to end against the testbed services.
"""

from __future__ import annotations

import email
import os
import re
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.testbed_process import start_testbed, write_config

ROOT = Path(__file__).resolve().parents[1]
WORKER_DOCKERFILE = ROOT / "Dockerfile"
TESTBED_DOCKERFILE = ROOT / "docker" / "testbed.Dockerfile"
# What a worker pod never needs: the testbed, its ASGI server, the Kubernetes client.
NOT_FOR_WORKERS = ("shopsimrl.testbed", "starlette", "uvicorn", "kubernetes")


def _imported(stderr: str) -> set[str]:
    """Module names from ``-X importtime`` lines: ``import time: self | cumulative | name``."""
    return {line.rsplit("|", 1)[1].strip() for line in stderr.splitlines() if line.startswith("import time:") and "|" in line} - {
        "imported package"
    }


def _forbidden(modules: set[str]) -> list[str]:
    return sorted(m for m in modules if any(m == root or m.startswith(root + ".") for root in NOT_FOR_WORKERS))


def _shopsimrl(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "shopsimrl", *args],
        capture_output=True, text=True, cwd=ROOT, env=env, timeout=300,
    )  # fmt: skip


# --------------------------------------------------------------------------- what a worker imports


@pytest.mark.slow
def test_the_worker_path_imports_neither_the_testbed_nor_kubernetes(tmp_path: Path) -> None:
    """Every command a worker pod runs, run for real: help, plan, wait-ready, both shards, reduce."""
    with start_testbed() as bed:
        config = write_config(tmp_path, name="slim", sample_size=4)
        run = str(tmp_path / "run")
        env = bed.env(SHOPSIMRL_LOG_FORMAT="json")
        steps = {
            "worker --help": _shopsimrl("worker", "--help", env=env),
            "plan": _shopsimrl("plan", str(config), "--shards", "2", "--run", run, env=env),
            "wait-ready": _shopsimrl("wait-ready", "--config", str(config), "--timeout", "60", env=env),
            "worker 0": _shopsimrl("worker", "--run", run, "--config", str(config), "--shard-index", "0", env=env),
            "worker 1": _shopsimrl("worker", "--run", run, "--config", str(config), "--shard-index", "1", env=env),
            "reduce": _shopsimrl("reduce", run, env=env),
        }
    for name, result in steps.items():
        assert result.returncode == 0, f"{name}: {result.stdout[-2000:]}\n{result.stderr[-2000:]}"
        modules = _imported(result.stderr)
        assert "shopsimrl.cli" in modules, f"{name}: -X importtime listed no shopsimrl modules"
        assert _forbidden(modules) == [], name
    # The shards really ran: the worker imported its own modules and the reducer wrote a summary.
    assert {"shopsimrl.sharded.worker", "shopsimrl.episode", "shopsimrl.sharded.layout"} <= _imported(steps["worker 0"].stderr)
    assert (tmp_path / "run" / "summary.json").is_file()


def test_the_import_check_sees_the_testbed_where_it_is_imported() -> None:
    """The control for the test above: the same parsing finds what the testbed imports."""
    probe = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", "import shopsimrl.testbed.policy"],
        capture_output=True, text=True, cwd=ROOT, timeout=120,
    )  # fmt: skip
    assert probe.returncode == 0, probe.stderr
    assert {"shopsimrl.testbed", "shopsimrl.testbed.policy", "starlette"} <= set(_forbidden(_imported(probe.stderr)))


# A module made unimportable the way Python documents it (None in sys.modules), then the CLI.
_WITHOUT = """
import sys
for name in sys.argv[1].split(","):
    sys.modules[name] = None
sys.argv = ["shopsimrl", *sys.argv[2:]]
from shopsimrl.cli import main
main()
"""


@pytest.mark.parametrize(
    ("missing", "args", "extra"),
    [
        ("shopsimrl.testbed", ["testbed", "shop"], "testbed"),
        ("starlette,uvicorn", ["testbed", "policy"], "testbed"),
        ("shopsimrl.testbed", ["testbed", "up"], "testbed"),
        ("kubernetes", ["reduce", "RUN", "--wait", "--worker-job", "eval-0123", "--namespace", "evals"], "kube"),
    ],
)
def test_a_command_of_a_missing_extra_exits_2_naming_it(tmp_path: Path, missing: str, args: list[str], extra: str) -> None:
    """What the worker image answers to the testbed commands and to a reducer without the client."""
    args = [str(tmp_path) if a == "RUN" else a for a in args]
    result = subprocess.run(
        [sys.executable, "-c", _WITHOUT, missing, *args], capture_output=True, text=True, cwd=ROOT, timeout=120
    )
    assert result.returncode == 2, result.stderr
    (line,) = result.stderr.strip().splitlines()
    assert line.startswith("error: ") and f"pip install 'shopsimrl[{extra}]'" in line and f"shopsimrl-{extra} image" in line
    assert "Traceback" not in result.stderr


# --------------------------------------------------------------------------- the Dockerfiles


@pytest.fixture(scope="module")
def hadolint() -> Path:
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "install-hadolint.sh")],
        capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable}, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, f"scripts/install-hadolint.sh failed:\n{proc.stderr}"
    return Path(proc.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("dockerfile", [WORKER_DOCKERFILE, TESTBED_DOCKERFILE], ids=["worker", "testbed"])
def test_dockerfiles_pass_hadolint(hadolint: Path, dockerfile: Path) -> None:
    proc = subprocess.run([str(hadolint), "--no-color", str(dockerfile)], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0 and proc.stdout == "", proc.stdout + proc.stderr


def _copy_sources(dockerfile: Path) -> set[str]:
    """Paths a Dockerfile copies from the build context (COPY without --from)."""
    sources = set()
    for line in dockerfile.read_text().splitlines():
        words = line.split()
        if words[:1] == ["COPY"] and not any(w.startswith("--from") for w in words):
            sources.update(w.rstrip("/") for w in words[1:-1] if not w.startswith("--"))
    return sources


def test_the_build_context_holds_everything_both_dockerfiles_copy() -> None:
    rules = [
        line.strip() for line in (ROOT / ".dockerignore").read_text().splitlines() if line.strip() and not line.startswith("#")
    ]
    assert rules[0] == "*", "the context is an allow-list"
    allowed = {rule[1:].rstrip("/") for rule in rules if rule.startswith("!")}
    for dockerfile in (WORKER_DOCKERFILE, TESTBED_DOCKERFILE):
        sources = _copy_sources(dockerfile)
        assert "constraints.txt" in sources, f"{dockerfile.name} installs unpinned"
        assert sources <= allowed, f"{dockerfile.name} copies {sorted(sources - allowed)}, which .dockerignore leaves out"
        assert all((ROOT / source).exists() for source in sources)


def _builder_install(dockerfile: Path) -> str:
    """The builder stage's RUN that installs the project, joined across continuation lines."""
    text = dockerfile.read_text().replace("\\\n", " ")
    (run,) = [line for line in text.splitlines() if line.startswith("RUN ") and "pip install" in line]
    return run


def test_the_worker_image_package_has_no_testbed_and_needs_no_extra(tmp_path: Path) -> None:
    """Build the worker's wheel the way its Dockerfile's builder stage does, and look inside."""
    run = _builder_install(WORKER_DOCKERFILE)
    assert re.search(r"rm -rf shopsimrl/testbed .*pip install --no-cache-dir --constraint constraints\.txt ", run), run
    assert _builder_install(TESTBED_DOCKERFILE).count('".[testbed]"') == 1
    context = tmp_path / "src"
    context.mkdir()
    for source in _copy_sources(WORKER_DOCKERFILE) - {"configs"}:
        copy = shutil.copytree if (ROOT / source).is_dir() else shutil.copy
        copy(ROOT / source, context / source)
    shutil.rmtree(context / "shopsimrl" / "testbed")
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(tmp_path / "dist"), str(context)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "dist").glob("shopsimrl-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        meta = email.message_from_bytes(archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))))
    assert "shopsimrl/sharded/worker.py" in names and "shopsimrl/cli.py" in names
    assert not [n for n in names if n.startswith("shopsimrl/testbed")], "the testbed ships in the worker image"
    base = [r for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
    assert not [r for r in base if re.match(r"(starlette|uvicorn|kubernetes)\b", r)], base
    assert {"testbed", "kube", "test"} <= set(meta.get_all("Provides-Extra"))
