"""The install is pinned (constraints.txt) and checkable (scripts/check-venv.py, run by .ci/run).

The check itself runs on the real environment after the suite (``make check-venv``); these tests
show that it names what it must: an undeclared distribution (as a test that installed
llama-cpp-python into .venv would leave), a missing one, a version the constraints do not pin.
Each adds a real distribution (a ``.dist-info`` directory on PYTHONPATH), nothing is mocked.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
CHECK = ROOT / "scripts" / "check-venv.py"
CONSTRAINTS = ROOT / "constraints.txt"
OWN = {"shopsimrl", "shopsimrl-research", "shopsimrl-testbed"}


def _distribution(site: Path, name: str, version: str, *requires: str) -> None:
    info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    lines = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}", *(f"Requires-Dist: {r}" for r in requires)]
    (info / "METADATA").write_text("\n".join(lines) + "\n", encoding="utf-8")


def _check(*args: str, site: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(site)} if site else {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    return subprocess.run([sys.executable, str(CHECK), *args], capture_output=True, text=True, env=env, timeout=120)


def test_an_undeclared_distribution_is_named(tmp_path: Path) -> None:
    _distribution(tmp_path, "llama_cpp_python", "0.3.36", "numpy>=1.20", "fastapi>=0.100; extra == 'server'")
    result = _check(site=tmp_path)
    assert result.returncode == 1
    assert "installed but not declared by shopsimrl[test]: llama_cpp_python 0.3.36" in result.stderr


def test_a_declared_distribution_that_is_missing_is_named(tmp_path: Path) -> None:
    # A project declaring one installed and one absent requirement, the absent one behind an extra.
    _distribution(tmp_path, "demo-project", "1.0", "httpx>=0.27", "not-installed-anywhere>=1; extra == 'more'")
    result = _check("--project", "demo-project", "--extras", "more", site=tmp_path)
    assert result.returncode == 1
    assert "declared but not installed: not-installed-anywhere" in result.stderr
    assert "declared but not installed: httpx" not in result.stderr


def test_a_version_the_constraints_do_not_pin_is_named(tmp_path: Path) -> None:
    pins = [line for line in CONSTRAINTS.read_text(encoding="utf-8").splitlines() if not line.startswith("httpx==")]
    (tmp_path / "constraints.txt").write_text("\n".join([*pins, "orjson==0.0.1"]) + "\n", encoding="utf-8")
    result = _check("--constraints", str(tmp_path / "constraints.txt"))
    assert result.returncode == 1
    assert "the constraints file does not pin it (make constraints)" in result.stderr and "httpx " in result.stderr
    assert "the constraints file pins 0.0.1 (make constraints)" in result.stderr and "orjson " in result.stderr


def test_a_constraints_line_that_is_no_exact_pin_is_refused(tmp_path: Path) -> None:
    (tmp_path / "constraints.txt").write_text("# header\nhttpx>=0.27\n", encoding="utf-8")
    result = _check("--constraints", str(tmp_path / "constraints.txt"))
    assert result.returncode == 1 and f"{tmp_path / 'constraints.txt'}:2: 'httpx>=0.27' is not an exact pin" in result.stderr


def test_constraints_pin_every_requirement_the_project_declares() -> None:
    """A new dependency without `make constraints` would install unpinned (and slowly)."""
    declared = []
    for path in ("pyproject.toml", "shopsimrl/research/pyproject.toml", "shopsimrl/testbed/pyproject.toml"):
        project = tomllib.loads((ROOT / path).read_text(encoding="utf-8"))["project"]
        declared += [*project["dependencies"], *(r for extra in project.get("optional-dependencies", {}).values() for r in extra)]
    pinned = {
        canonicalize_name(Requirement(line).name): Requirement(line)
        for line in CONSTRAINTS.read_text(encoding="utf-8").splitlines()
        if line.strip() and not line.startswith("#")
    }
    for text in declared:
        requirement = Requirement(text)
        if canonicalize_name(requirement.name) in OWN:
            continue  # the repository's own distributions (extras and sub-distributions name them), never pinned
        pin = pinned.get(canonicalize_name(requirement.name))
        assert pin is not None, f"{requirement.name} is not in constraints.txt (make constraints)"
        (version,) = [spec.version for spec in pin.specifier if spec.operator == "=="]
        assert requirement.specifier.contains(version, prereleases=True), f"constraints.txt pins {pin}, pyproject wants {text}"


def test_the_development_install_is_the_test_extra_and_the_two_sub_distributions() -> None:
    """`make check-venv` on this .venv: shopsimrl-research and shopsimrl-testbed are not in the
    test extra (it needs no index holding them); `--with` names them as installed next to it."""
    bare = _check("--constraints", str(CONSTRAINTS))
    assert bare.returncode == 1
    for name in ("shopsimrl-research", "shopsimrl-testbed"):
        assert f"installed but not declared by shopsimrl[test]: {name} 0.5.0" in bare.stderr
    full = _check("--constraints", str(CONSTRAINTS), "--with", "shopsimrl-research,shopsimrl-testbed")
    assert full.returncode == 0, full.stderr
    assert "exactly the distributions shopsimrl[test] + shopsimrl-research + shopsimrl-testbed declares" in full.stdout


def test_the_development_install_imports_the_checkout_from_anywhere(tmp_path: Path) -> None:
    """Started outside the checkout (no cwd on sys.path), the console script and the interpreter of
    the development install import the checkout's regular `shopsimrl` package, its research and
    testbed parts included, not the empty namespace package the sub-distributions' editable
    finders declare (the Makefile's CORE_ON_PATH)."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    probe = "import shopsimrl, shopsimrl.research.cli, shopsimrl.testbed.cli; print(shopsimrl.__file__)"
    found = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert found.returncode == 0, found.stderr
    assert found.stdout.strip() == str(ROOT / "shopsimrl" / "__init__.py")
    script = Path(sys.executable).with_name("shopsimrl")
    version = subprocess.run([str(script), "--version"], cwd=tmp_path, capture_output=True, text=True, env=env, timeout=120)
    assert version.returncode == 0, version.stderr
    assert version.stdout.startswith("shopsimrl ")
