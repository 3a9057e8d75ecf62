"""The figures README.md and docs/ quote that a script can know: checked, or rewritten with --write.

    .venv/bin/python scripts/doc-figures.py            # check: exit 1 naming each stale figure
    .venv/bin/python scripts/doc-figures.py --write    # rewrite them in place (make doc-figures)

Counted here, from the repository and the running environment (run it with .venv's Python):

* tests: ``pytest --collect-only -q -m "not slow"`` gives the fast tier (``make test-fast``) and
  the whole suite (``make test``); a documented count may lag the collected one by up to 3 %
  (branches merged in parallel add tests), ``--write`` makes it exact;
* distributions, the project and its dependencies, as the declared closure of each install
  (scripts/check-venv.py's walk of the installed metadata; a venv adds pip and setuptools): the
  development ``.venv`` (``shopsimrl[test]`` with shopsimrl-research and shopsimrl-testbed), the
  demo's ``.venv-demo`` (``shopsimrl[testbed,research]``: the core and both sub-distributions)
  and the worker image (the core alone; its pins in docker/requirements/worker.txt plus the
  project, which must agree).

Measured, so not here: times (the suite's, the fast tier's, installs') and sizes are figures of a
machine at a moment, kept in docs/benchmarks.md with when and under what load. The two sizes a
test can measure are checked within a tolerance by the tests that build them
(tests/test_doc_figures.py: ``.venv``; tests/test_images.py: the worker venv), with
:func:`documented`.
"""

from __future__ import annotations

import argparse
import importlib.util
import re
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "shopsimrl"
# make install's distributions next to the core's test extra (which names neither).
SUB_DISTRIBUTIONS = ("shopsimrl-research", "shopsimrl-testbed")


@dataclass(frozen=True)
class Figure:
    path: str
    pattern: str
    """A regular expression (re.S) around the number, in a group named ``n`` written ``(?P<n>{NUM})``."""
    value: str
    """A key of :data:`VALUES`."""
    tolerance: float = 0.0
    """How far the documented number may be from the counted one, relative to it."""

    @property
    def regex(self) -> str:
        return self.pattern.replace("{NUM}", NUM)


NUM = r"\d{1,3}(?:,\d{3})+|\d+"
"""A count as the docs write it (1,486 or 806), never taking the comma after it."""

FIGURES = [
    Figure("README.md", r"test-fast`?\s.{0,80}?\((?P<n>{NUM}) tests", "fast_tests", 0.03),
    Figure("README.md", r"\| pytest \|[^|]*\|[^|]*?\((?P<n>{NUM}) tests", "all_tests", 0.03),
    Figure("README.md", r"runs the (?P<n>{NUM}) tests not marked `slow`", "fast_tests", 0.03),
    Figure("README.md", r"`make\s+test` and `\.ci/run` run all (?P<n>{NUM})", "all_tests", 0.03),
    Figure("README.md", r"`test` extra \((?P<n>{NUM}) distributions", "install"),
    Figure("README.md", r"no test\s+tools \((?P<n>{NUM}) distributions", "demo"),
    Figure("docs/benchmarks.md", r"the core's `test` extra \(kube \+ the test tools\) \| (?P<n>{NUM}) \|", "install"),
    Figure("docs/benchmarks.md", r"\| the core, `shopsimrl-testbed`, `shopsimrl-research` \| (?P<n>{NUM}) \|", "demo"),
    Figure("docs/benchmarks.md", r"\| worker venv \(`\./Dockerfile`, no extras\) \| (?P<n>{NUM}) \(", "worker"),
    Figure("docs/benchmarks.md", r"\| worker venv \(`\./Dockerfile`, no extras\) \| [\d,]+ \((?P<n>{NUM}) hashed", "worker_pins"),
    Figure("docs/kubernetes.md", r"compilers: (?P<n>{NUM}) distributions", "worker"),
    Figure("docs/kubernetes.md", r"the project and the (?P<n>{NUM})\s+of `docker/requirements/worker\.txt`", "worker_pins"),
    Figure("docs/kubernetes.md", r"not the (?P<n>{NUM}) distributions under it", "worker_pins"),
]


def _check_venv() -> ModuleType:
    spec = importlib.util.spec_from_file_location("check_venv", ROOT / "scripts" / "check-venv.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@cache
def closure(*extras: str, others: tuple[str, ...] = ()) -> int:
    """Distributions ``shopsimrl[extras]`` and the distributions ``others`` install, the project
    included (this environment must hold them)."""
    check_venv = _check_venv()
    dists = check_venv.installed()
    wanted, missing = check_venv.declared_closure(PROJECT, list(extras), dists)
    for other in others:
        also, also_missing = check_venv.declared_closure(other, [], dists)
        wanted, missing = wanted | also, missing | also_missing
    if missing:
        raise SystemExit(f"{sys.prefix} lacks {sorted(missing)}: run this with the Python of `make install`'s .venv")
    return len(wanted)


def pins(path: Path) -> int:
    return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if re.match(r"[A-Za-z0-9][\w.-]*==", line))


@cache
def collected() -> tuple[int, int]:
    """(tests not marked slow, all tests), as ``pytest --collect-only`` finds them."""
    done = subprocess.run(
        [sys.executable, "-m", "pytest", "--collect-only", "-q", "-m", "not slow", "-p", "no:cacheprovider"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=600,
    )
    found = re.search(r"^(\d+)/(\d+) tests collected", done.stdout, re.M) or re.search(
        r"^(\d+) tests collected", done.stdout, re.M
    )
    if done.returncode != 0 or found is None:
        raise SystemExit(f"pytest --collect-only exited {done.returncode}:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    fast = int(found.group(1))
    return fast, int(found.group(2)) if found.lastindex == 2 else fast


def worker() -> int:
    counted, pinned = closure(), pins(ROOT / "docker" / "requirements" / "worker.txt") + 1
    if counted != pinned:
        raise SystemExit(f"the worker image: {counted} distributions declared, docker/requirements/worker.txt pins {pinned - 1}")
    return counted


VALUES: dict[str, Callable[[], int]] = {
    "fast_tests": lambda: collected()[0],
    "all_tests": lambda: collected()[1],
    "install": lambda: closure("test", others=SUB_DISTRIBUTIONS),
    "demo": lambda: closure("testbed", "research"),
    "worker": worker,
    "worker_pins": lambda: pins(ROOT / "docker" / "requirements" / "worker.txt"),
}


def stale(figures: list[Figure], write: bool = False, root: Path = ROOT) -> list[str]:
    """What is wrong with ``figures`` in the documents under ``root`` (rewritten first, when ``write``)."""
    found: list[str] = []
    texts = {figure.path: (root / figure.path).read_text(encoding="utf-8") for figure in figures}
    for figure in figures:
        text = texts[figure.path]
        matches = list(re.finditer(figure.regex, text, re.S))
        if not matches:
            found.append(
                f"{figure.path}: no text matches {figure.pattern!r} (the sentence changed: update scripts/doc-figures.py)"
            )
            continue
        value = VALUES[figure.value]()
        for match in reversed(matches):
            documented = int(match.group("n").replace(",", ""))
            line = text.count("\n", 0, match.start("n")) + 1
            if write and documented != value:  # exact, whatever the tolerance of the check
                text = text[: match.start("n")] + f"{value:,}" + text[match.end("n") :]
            elif abs(documented - value) > figure.tolerance * value:
                found.append(f"{figure.path}:{line}: says {documented:,} {figure.value}, counted {value:,}")
        texts[figure.path] = text
    if write:
        for path, text in texts.items():
            if (root / path).read_text(encoding="utf-8") != text:
                (root / path).write_text(text, encoding="utf-8")
                print(f"rewrote the figures of {path}")
    return found


def documented(path: str, pattern: str) -> float:
    """The number a document gives in ``pattern``'s group ``n`` (for the tests that measure sizes)."""
    match = re.search(pattern, (ROOT / path).read_text(encoding="utf-8"), re.S)
    if match is None:
        raise LookupError(f"{path}: no text matches {pattern!r}")
    return float(match.group("n").replace(",", ""))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--write", action="store_true", help="rewrite the stale figures in place")
    parser.add_argument("--no-collect", action="store_true", help="skip the test counts (no pytest run)")
    args = parser.parse_args(argv)
    figures = [f for f in FIGURES if not (args.no_collect and f.value.endswith("_tests"))]
    found = stale(figures, args.write)
    if found:
        print(*found, sep="\n", file=sys.stderr)
        return 1
    print(f"{len(figures)} figures of README.md and docs/ agree with what they count")
    return 0


if __name__ == "__main__":
    sys.exit(main())
