"""The three distributions of this repository: ``shopsimrl`` (the core, ./pyproject.toml),
``shopsimrl-research`` (shopsimrl/research/pyproject.toml) and ``shopsimrl-testbed``
(shopsimrl/testbed/pyproject.toml), one version for all.

The declarations are read as files; the wheels are built for real (``pip wheel``, the build
backend the Dockerfiles use, from a copy of the sources so no ``build/`` lands in the package)
and installed into fresh venvs the way the images install them: the dependencies from the hashed
requirement files of docker/requirements/, the project's own wheels with ``--no-index``. What each
install can import is asked of its own interpreter.
"""

from __future__ import annotations

import email
import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PYPROJECTS = {
    "shopsimrl": ROOT / "pyproject.toml",
    "shopsimrl-research": ROOT / "shopsimrl" / "research" / "pyproject.toml",
    "shopsimrl-testbed": ROOT / "shopsimrl" / "testbed" / "pyproject.toml",
}
SUBS = {"shopsimrl-research": "research", "shopsimrl-testbed": "testbed"}
REQUIREMENTS = ROOT / "docker" / "requirements"
# What only the research tools or the testbed need: never in the core's closure.
NOT_IN_THE_CORE = ("numpy", "pandas", "pyarrow", "matplotlib", "starlette", "uvicorn", "wandb", "mlflow")


def _project(name: str) -> dict:  # type: ignore[type-arg]
    return tomllib.loads(PYPROJECTS[name].read_text(encoding="utf-8"))


def _requirements(texts: list[str]) -> dict[str, Requirement]:
    return {canonicalize_name(r.name): r for r in map(Requirement, texts)}


def test_one_version_and_the_sub_distributions_pin_the_core_to_it() -> None:
    projects = {name: _project(name)["project"] for name in PYPROJECTS}
    assert {name: p["name"] for name, p in projects.items()} == {name: name for name in PYPROJECTS}
    versions = {p["version"] for p in projects.values()}
    assert len(versions) == 1, {name: p["version"] for name, p in projects.items()}
    (version,) = versions
    for sub, extra in SUBS.items():
        core = _requirements(projects[sub]["dependencies"])["shopsimrl"]
        assert str(core.specifier) == f"=={version}" and not core.extras and core.marker is None, f"{sub}: {core}"
        # For index users the core's extra of the same name fetches the sub-distribution at this version.
        assert projects["shopsimrl"]["optional-dependencies"][extra] == [f"{sub}=={version}"]
    # The development extra must resolve without an index holding the sub-distributions: it names
    # neither, directly or through the core's own extras (make install adds them from the checkout).
    extras = projects["shopsimrl"]["optional-dependencies"]
    todo, seen = ["test"], set()
    while todo:
        extra = todo.pop()
        seen.add(extra)
        for requirement in map(Requirement, extras[extra]):
            assert canonicalize_name(requirement.name) not in SUBS, f"[{extra}] needs {requirement} from an index"
            if canonicalize_name(requirement.name) == "shopsimrl":
                todo += sorted(set(requirement.extras) - seen)
    assert seen >= {"test", "kube"}


def test_each_distribution_declares_exactly_its_packages() -> None:
    """The core's find leaves both sub-packages out; each sub-distribution lists every package of
    its directory (a new subpackage left off its list would ship in no wheel)."""
    find = _project("shopsimrl")["tool"]["setuptools"]["packages"]["find"]
    assert set(find["exclude"]) == {"shopsimrl.research", "shopsimrl.research.*", "shopsimrl.testbed", "shopsimrl.testbed.*"}
    for sub, package in SUBS.items():
        setuptools = _project(sub)["tool"]["setuptools"]
        assert setuptools["package-dir"] == {f"shopsimrl.{package}": "."}
        here = ROOT / "shopsimrl" / package
        found = {
            ".".join(("shopsimrl", package, *init.parent.relative_to(here).parts))
            for init in here.rglob("__init__.py")
            if "build" not in init.relative_to(here).parts
        }
        assert set(setuptools["packages"]) == found, sub
        assert setuptools["include-package-data"] is False


# --------------------------------------------------------------------------- the wheels, built


def _copy_sources(target: Path) -> None:
    """What a build reads (the Dockerfiles copy the same), without build leftovers or caches."""
    shutil.copy(ROOT / "pyproject.toml", target / "pyproject.toml")
    shutil.copy(ROOT / "README.md", target / "README.md")
    shutil.copytree(ROOT / "shopsimrl", target / "shopsimrl", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info", "build"))


@pytest.fixture(scope="module")
def wheels(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The three wheels, built as the Dockerfiles' builder stages build theirs: the hashed build
    backend (docker/requirements/build.txt) in a venv of its own, no build isolation, no index."""
    src = tmp_path_factory.mktemp("src")
    _copy_sources(src)
    build = _venv(src / "build-venv")
    _pip(build, "--require-hashes", "--only-binary=:all:", "-r", str(REQUIREMENTS / "build.txt"))
    dist = src / "dist"
    done = subprocess.run(
        [str(build), "-m", "pip", "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--wheel-dir", str(dist), ".", "./shopsimrl/research", "./shopsimrl/testbed"],
        cwd=src, capture_output=True, text=True, env=_clean_env(), timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    built = {}
    for name in PYPROJECTS:
        (wheel,) = dist.glob(f"{name.replace('-', '_')}-*.whl")
        built[name] = wheel
    return built


def _names(wheel: Path) -> list[str]:
    with zipfile.ZipFile(wheel) as archive:
        return archive.namelist()


def _metadata(wheel: Path) -> email.message.Message:
    with zipfile.ZipFile(wheel) as archive:
        return email.message_from_bytes(archive.read(next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))))


def _sources(package: str) -> set[str]:
    here = ROOT / "shopsimrl" / package
    return {
        f"shopsimrl/{package}/{path.relative_to(here).as_posix()}"
        for path in here.rglob("*.py")
        if not {"build", "__pycache__"} & set(path.relative_to(here).parts)
    }


@pytest.mark.slow
def test_each_wheel_holds_its_own_files_only(wheels: dict[str, Path]) -> None:
    core = _names(wheels["shopsimrl"])
    assert {
        "shopsimrl/__init__.py",
        "shopsimrl/cli/__init__.py",
        "shopsimrl/cli/errors.py",
        "shopsimrl/runner/worker.py",
        "shopsimrl/py.typed",
    } <= set(core)
    assert [n for n in core if n.startswith("shopsimrl/records/schemas/") and n.endswith(".json")], "the JSON Schemas"
    assert [n for n in core if n.startswith(("shopsimrl/research/", "shopsimrl/testbed/"))] == []
    assert [n for n in core if n.startswith("shopsimrl/") and n.count("/") == 1 and n.endswith("analysis.py")] == []
    for sub, package in SUBS.items():
        names = _names(wheels[sub])
        files = [n for n in names if ".dist-info/" not in n]
        assert all(n.startswith(f"shopsimrl/{package}/") for n in files), [
            n for n in files if not n.startswith(f"shopsimrl/{package}/")
        ]
        assert "shopsimrl/__init__.py" not in names
        assert {n for n in files if n.endswith(".py")} == _sources(package), sub
        assert not [n for n in files if n.endswith(("pyproject.toml", ".egg-info"))], files
        requires = _requirements(_metadata(wheels[sub]).get_all("Requires-Dist") or [])
        assert str(requires["shopsimrl"].specifier) == f"=={_metadata(wheels['shopsimrl'])['Version']}"
    assert {"shopsimrl/testbed/data/catalog.v1.json.gz", "shopsimrl/testbed/data/README.md"} <= set(
        _names(wheels["shopsimrl-testbed"])
    )
    meta = _metadata(wheels["shopsimrl"])
    base = [r for r in meta.get_all("Requires-Dist") or [] if "extra ==" not in r]
    assert not set(_requirements(base)) & {*NOT_IN_THE_CORE, "kubernetes", *SUBS}, base
    assert {"research", "testbed", "kube", "test"} <= set(meta.get_all("Provides-Extra") or [])


def _clean_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}


def _venv(path: Path) -> Path:
    base_python = getattr(sys, "_base_executable", sys.executable)
    done = subprocess.run([base_python, "-m", "venv", str(path)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return path / "bin" / "python"


def _pip(python: Path, *args: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(python), "-m", "pip", "install", "--quiet", "--no-compile", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=900,
    )
    assert done.returncode == 0, f"pip install {' '.join(args)}:\n{done.stderr[-3000:]}"


# Asked of a venv's own interpreter, from a neutral directory (never this checkout on sys.path).
_PROBE = """
import importlib, importlib.metadata, importlib.util, json, sys
found = {}
for name in sys.argv[1].split(","):
    try:
        found[name] = importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        found[name] = False
for name in sys.argv[2].split(",") if sys.argv[2] else []:
    importlib.import_module(name)
dists = sorted({d.metadata["Name"] for d in importlib.metadata.distributions()})
print(json.dumps({"found": found, "dists": dists}))
"""


def _probe(python: Path, cwd: Path, look_for: list[str], imports: list[str]) -> dict:  # type: ignore[type-arg]
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    done = subprocess.run(
        [str(python), "-c", _PROBE, ",".join(look_for), ",".join(imports)],
        cwd=cwd,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(done.stdout)  # type: ignore[no-any-return]


def _hashed(python: Path, image: str, *wheels: Path) -> None:
    """An image's install: its hashed dependencies, then the project's wheels without an index."""
    _pip(python, "--require-hashes", "--only-binary=:all:", "-r", str(REQUIREMENTS / f"{image}.txt"))
    _pip(python, "--no-deps", "--no-index", *map(str, wheels))
    check = subprocess.run([str(python), "-m", "pip", "check"], capture_output=True, text=True, timeout=120)
    assert check.returncode == 0, check.stdout + check.stderr


@pytest.mark.slow
def test_the_core_alone_runs_a_worker_without_research_testbed_or_their_dependencies(
    wheels: dict[str, Path], tmp_path: Path
) -> None:
    if sys.version_info[:2] != (3, 11):
        pytest.skip("the hashes are of CPython 3.11 wheels")
    python = _venv(tmp_path / "venv")
    _hashed(python, "worker", wheels["shopsimrl"])
    look_for = ["shopsimrl.research", "shopsimrl.testbed", *NOT_IN_THE_CORE, "kubernetes"]
    seen = _probe(python, tmp_path, look_for, ["shopsimrl.runner.worker", "shopsimrl.cli", "shopsimrl.storage.sharded"])
    assert seen["found"] == dict.fromkeys(look_for, False)
    assert not {"shopsimrl-research", "shopsimrl-testbed"} & set(seen["dists"])
    cli = tmp_path / "venv" / "bin" / "shopsimrl"
    env = _clean_env()
    for args in (["--help"], ["worker", "--help"]):
        done = subprocess.run([str(cli), *args], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
        assert done.returncode == 0 and "Usage" in done.stdout, done.stderr
    # The testbed's command is there and says where the testbed is.
    missing = subprocess.run([str(cli), "testbed", "shop"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert missing.returncode == 2 and "shopsimrl[testbed]" in missing.stderr and "Traceback" not in missing.stderr


@pytest.mark.slow
def test_the_core_and_the_testbed_serve_the_testbed_without_research(wheels: dict[str, Path], tmp_path: Path) -> None:
    if sys.version_info[:2] != (3, 11):
        pytest.skip("the hashes are of CPython 3.11 wheels")
    python = _venv(tmp_path / "venv")
    _hashed(python, "testbed", wheels["shopsimrl"], wheels["shopsimrl-testbed"])
    look_for = ["shopsimrl.research", "pandas", "pyarrow", "matplotlib"]
    seen = _probe(
        python, tmp_path, look_for, ["shopsimrl.testbed.shop.server", "shopsimrl.testbed.policy", "shopsimrl.testbed.up"]
    )
    assert seen["found"] == dict.fromkeys(look_for, False)
    # The catalog ships as package data, next to the module that reads it.
    site = next((tmp_path / "venv" / "lib").glob("python3.*/site-packages"))
    assert (site / "shopsimrl" / "testbed" / "data" / "catalog.v1.json.gz").stat().st_size > 1_000_000
    assert (site / "shopsimrl" / "__init__.py").is_file()  # the core's, shared by both


@pytest.mark.slow
def test_the_core_and_research_run_the_research_tools_without_the_testbed(wheels: dict[str, Path], tmp_path: Path) -> None:
    """No image carries the research tools, so no hashed file: their dependencies as constraints.txt pins them."""
    python = _venv(tmp_path / "venv")
    _pip(
        python,
        "--only-binary=:all:",
        "--constraint",
        str(ROOT / "constraints.txt"),
        str(wheels["shopsimrl"]),
        str(wheels["shopsimrl-research"]),
    )
    # The trackers are the research tools' `tracking` extra: not installed here, their module imports all the same.
    look_for = ["shopsimrl.testbed", "httptools", "wandb", "mlflow"]
    imports = [
        "shopsimrl.research.analysis",
        "shopsimrl.research.compare",
        "shopsimrl.research.report",
        "shopsimrl.research.tracking",
        "shopsimrl.research.viewer",
    ]
    seen = _probe(python, tmp_path, look_for, imports)
    assert seen["found"] == dict.fromkeys(look_for, False)
    assert {"shopsimrl", "shopsimrl-research"} <= set(seen["dists"])
