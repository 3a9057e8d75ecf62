"""The figures README.md and docs/ quote are what scripts/doc-figures.py counts (``make
doc-figures`` rewrites them), and the check names a stale one."""

from __future__ import annotations

import importlib.util
import shutil
import sys
from pathlib import Path
from types import ModuleType

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("doc_figures", ROOT / "scripts" / "doc-figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


doc_figures = _load()
COUNTED = [figure for figure in doc_figures.FIGURES if not figure.value.endswith("_tests")]
TEST_COUNTS = [figure for figure in doc_figures.FIGURES if figure.value.endswith("_tests")]


def test_the_distribution_counts_in_the_docs_are_the_counted_ones() -> None:
    assert doc_figures.stale(COUNTED) == [], "run `make doc-figures`"


@pytest.mark.slow
def test_the_test_counts_in_the_readme_are_what_pytest_collects() -> None:
    assert doc_figures.stale(TEST_COUNTS) == [], "run `make doc-figures`"


def _copy_docs(target: Path) -> None:
    for page in {figure.path for figure in doc_figures.FIGURES}:
        (target / page).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(ROOT / page, target / page)


def test_a_stale_figure_is_named_with_its_line_and_rewritten(tmp_path: Path) -> None:
    _copy_docs(tmp_path)
    readme = tmp_path / "README.md"
    current = readme.read_text(encoding="utf-8")
    counted = doc_figures.VALUES["install"]()
    edited = current.replace(f"`test` extra ({counted:,} distributions", f"`test` extra ({counted + 5:,} distributions")
    assert edited != current
    readme.write_text(edited, encoding="utf-8")
    line = edited[: edited.index(f"({counted + 5:,} distributions")].count("\n") + 1
    assert doc_figures.stale(COUNTED, root=tmp_path) == [f"README.md:{line}: says {counted + 5:,} install, counted {counted:,}"]
    assert doc_figures.stale(COUNTED, write=True, root=tmp_path) == []
    assert readme.read_text(encoding="utf-8") == current


def test_a_sentence_that_lost_its_figure_is_reported(tmp_path: Path) -> None:
    _copy_docs(tmp_path)
    kubernetes = tmp_path / "docs" / "kubernetes.md"
    kubernetes.write_text(
        kubernetes.read_text(encoding="utf-8").replace("distributions under it", "packages under it"), encoding="utf-8"
    )
    (problem,) = doc_figures.stale(COUNTED, root=tmp_path)
    assert problem.startswith("docs/kubernetes.md: no text matches") and "update scripts/doc-figures.py" in problem


@pytest.mark.slow
def test_the_development_venv_is_the_documented_size_within_a_quarter() -> None:
    """Disk usage (as ``du``) of the environment this suite runs in, when it is ``make install``'s."""
    if Path(sys.prefix).resolve() != (ROOT / ".venv").resolve():
        pytest.skip(f"not running in {ROOT / '.venv'}")
    used = sum(path.lstat().st_blocks * 512 for path in Path(sys.prefix).rglob("*") if not path.is_symlink())
    gigabytes = doc_figures.documented("README.md", r"`test` extra \([\d,]+ distributions, (?P<n>[\d.]+) GB\)")
    assert abs(used / 2**30 - gigabytes) <= gigabytes / 4, f"{used / 2**30:.2f} GB used, README.md says {gigabytes} GB"
