"""The README's two set-up commands, as make plans them (``make -n``: the real Makefile, nothing
built): ``make demo`` installs a light venv (the core, testbed and research, no test tools) unless
the development install is there; ``make test`` says what it builds before it builds it."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]


def plan(*args: str) -> list[str]:
    done = subprocess.run(
        ["make", "-n", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True, env=os.environ, timeout=60
    )
    assert done.returncode == 0, done.stderr
    return done.stdout.splitlines()


def test_make_demo_without_the_development_install_builds_only_the_light_venv(tmp_path: Path) -> None:
    lines = plan("demo", f"VENV={tmp_path / 'dev'}", f"DEMO_VENV={tmp_path / 'demo'}")
    installs = [line for line in lines if " install " in line]
    assert installs == [
        f"{tmp_path / 'demo'}/bin/pip install --progress-bar off --constraint constraints.txt"
        " -e . -e ./shopsimrl/testbed -e ./shopsimrl/research",
        f"{tmp_path / 'demo'}/bin/pip install --progress-bar off --constraint constraints.txt"
        " --no-deps --config-settings editable_mode=compat -e .",
    ]
    assert lines[-1] == f"BIN={tmp_path / 'demo'}/bin scripts/testbed-run.sh configs/testbed_demo.yaml"
    assert not any("[test]" in line or "llm" in line for line in lines)


def test_make_demo_uses_the_development_install_when_it_is_there(tmp_path: Path) -> None:
    stamp = tmp_path / "dev" / ".installed"
    stamp.parent.mkdir()
    stamp.touch()
    inputs = ("pyproject.toml", "shopsimrl/research/pyproject.toml", "shopsimrl/testbed/pyproject.toml", "constraints.txt")
    newest = max((ROOT / name).stat().st_mtime for name in inputs)
    os.utime(stamp, (newest + 60, newest + 60))  # up to date: make has nothing to install
    lines = plan("demo", f"VENV={tmp_path / 'dev'}", f"DEMO_VENV={tmp_path / 'demo'}")
    assert lines == [f"BIN={tmp_path / 'dev'}/bin scripts/testbed-run.sh configs/testbed_demo.yaml"]


def test_make_test_says_what_it_builds_before_building_it(tmp_path: Path) -> None:
    lines = plan("test", f"VENV={tmp_path / 'dev'}", f"LLM_CACHE={tmp_path / 'llm'}")
    first_build = next(i for i, line in enumerate(lines) if "-m venv" in line)
    said = "\n".join(lines[:first_build])
    assert "test extra" in said and f"llama.cpp for the real-LLM test in {tmp_path / 'llm'}" in said and "8-25 min" in said
    assert "chromium" in said and "pytest" in said
    assert any(line.endswith("-e '.[test]' -e ./shopsimrl/research -e ./shopsimrl/testbed") for line in lines[first_build:])
