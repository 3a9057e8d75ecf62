"""Every file a page of the documentation names is one a clone has (``git ls-files``).

A path is a backticked or linked name with a directory and a file extension, looked up as
written, relative to the page, or relative to ``shopsimrl/`` (the module map writes
``sharded/status.py``). Places a run or a tool creates (``runs/…``, ``.cache/…``, a run's
``shards/…``, the home directory) are not files of the repository and are left out."""

from __future__ import annotations

import posixpath
import re
import subprocess
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["README.md", *sorted(str(p.relative_to(ROOT)) for p in (ROOT / "docs").glob("*.md")), "shopsimrl/testbed/data/README.md"]
CREATED = ("runs/", ".cache/", "shards/", "leases/", "~/", "/", "$")
NAME = re.compile(r"`([^`\s]+)`|\]\(([^)#\s]+)")
FILE = re.compile(r"^[\w.~$/-]*/[\w.-]+\.[A-Za-z][\w.]*$")


def tracked() -> set[str]:
    listing = subprocess.run(["git", "ls-files"], capture_output=True, text=True, cwd=ROOT, check=True).stdout
    return set(listing.splitlines())


def named_files(page: str) -> set[str]:
    text = (ROOT / page).read_text(encoding="utf-8")
    names = {a or b for a, b in NAME.findall(text)}
    return {name for name in names if "://" not in name and FILE.match(name) and not name.startswith(CREATED)}


@pytest.mark.parametrize("page", PAGES)
def test_every_file_a_page_names_is_in_the_repository(page: str) -> None:
    files = tracked()
    here = posixpath.dirname(page)
    missing = sorted(
        name
        for name in named_files(page)
        if not {posixpath.normpath(name), posixpath.normpath(posixpath.join(here, name)), f"shopsimrl/{name}"} & files
    )
    assert not missing, f"{page} names files a clone does not have: {missing}"
