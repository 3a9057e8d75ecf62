"""Check that an environment holds exactly what ``make install`` declares.

Run by ``.ci/run`` after the test suite (``make check-venv``) with the project venv's interpreter:
the suite must leave ``.venv`` as ``make install`` made it. It walks the declared requirements of
``shopsimrl[test]`` and of the distributions named by ``--with`` (``make install`` installs
shopsimrl-research and shopsimrl-testbed from this checkout next to it) through the installed
distributions' metadata (extras and markers evaluated here) and fails, naming each, on

* an installed distribution that nothing declares (something installed into the venv by hand or
  by a test, e.g. the llama.cpp server's packages, which belong in the
  machine's LLM cache, ~/.cache/shopsimrl/llm/venv);
* a declared one that is missing;
* with ``--constraints FILE``: an installed version that the file does not pin exactly (the
  venv was not installed from it, or a new dependency needs ``make constraints``).

Version conflicts between installed distributions are ``pip check``'s part (make check-venv).
Exit 0 when clean, 1 otherwise.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Iterable
from importlib import metadata
from pathlib import Path

from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import NormalizedName, canonicalize_name

# A venv's own installers: `python -m venv` puts them there, no project declares them.
BOOTSTRAP = {canonicalize_name(name) for name in ("pip", "setuptools", "wheel")}


def installed(paths: list[str] | None = None) -> dict[NormalizedName, metadata.Distribution]:
    """Distributions importable from ``paths`` (default ``sys.path``); the first of a name wins, as for imports."""
    found: dict[NormalizedName, metadata.Distribution] = {}
    for dist in metadata.distributions(path=paths if paths is not None else sys.path):
        name = dist.metadata["Name"]
        if name:
            found.setdefault(canonicalize_name(name), dist)
    return found


def declared_closure(
    root: str, extras: Iterable[str], dists: dict[NormalizedName, metadata.Distribution]
) -> tuple[set[NormalizedName], set[str]]:
    """Names ``root[extras]`` needs, transitively, and the declared requirements not installed."""
    wanted: dict[NormalizedName, set[str]] = {}
    missing: set[str] = set()
    todo: list[tuple[str, set[str]]] = [(root, set(extras))]
    while todo:
        name, with_extras = todo.pop()
        key = canonicalize_name(name)
        if key in wanted and with_extras <= wanted[key]:
            continue
        wanted.setdefault(key, set()).update(with_extras)
        dist = dists.get(key)
        if dist is None:
            missing.add(name)
            continue
        for text in dist.requires or []:
            try:
                requirement = Requirement(text)
            except InvalidRequirement:
                continue  # metadata pip would reject too; `pip check` reports such a distribution
            # A requirement applies when its marker holds for the base install or one of the extras asked for.
            environments = [{"extra": extra} for extra in sorted(wanted[key]) or [""]] + [{"extra": ""}]
            if requirement.marker is None or any(requirement.marker.evaluate(env) for env in environments):
                todo.append((requirement.name, set(requirement.extras)))
    return set(wanted), missing


def pinned(constraints: Path) -> dict[NormalizedName, str]:
    pins: dict[NormalizedName, str] = {}
    for number, line in enumerate(constraints.read_text(encoding="utf-8").splitlines(), start=1):
        text = line.split("#", 1)[0].strip()
        if not text:
            continue
        try:
            requirement = Requirement(text)
        except InvalidRequirement as exc:
            raise SystemExit(f"{constraints}:{number}: not a requirement: {exc}") from None
        specs = list(requirement.specifier)
        if len(specs) != 1 or specs[0].operator != "==":
            raise SystemExit(f"{constraints}:{number}: {text!r} is not an exact pin (NAME==VERSION)")
        pins[canonicalize_name(requirement.name)] = specs[0].version
    return pins


def problems(
    dists: dict[NormalizedName, metadata.Distribution],
    root: str,
    extras: list[str],
    pins: dict[NormalizedName, str] | None,
    others: Iterable[str] = (),
) -> list[str]:
    """What is wrong with ``dists`` against ``root[extras]`` plus the distributions ``others``
    (this repository's own, unpinned like ``root``)."""
    wanted, missing = declared_closure(root, extras, dists)
    own = {canonicalize_name(root)}
    for other in others:
        also, also_missing = declared_closure(other, [], dists)
        wanted |= also
        missing |= also_missing
        own.add(canonicalize_name(other))
    what = f"{root}[{','.join(extras)}]" + "".join(f" + {other}" for other in others)
    found = []
    for name in sorted(missing):
        found.append(f"declared but not installed: {name}")
    for key in sorted(set(dists) - wanted - BOOTSTRAP):
        found.append(f"installed but not declared by {what}: {dists[key].metadata['Name']} {dists[key].version}")
    if pins is not None:
        for key in sorted(wanted & set(dists) - own):
            version = dists[key].version
            if pins.get(key) != version:
                pin = f"pins {pins[key]}" if key in pins else "does not pin it"
                found.append(
                    f"{dists[key].metadata['Name']} {version} is installed, the constraints file {pin} (make constraints)"
                )
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--project", default="shopsimrl", help="distribution whose declaration is the reference")
    parser.add_argument("--extras", default="test", help="comma-separated extras of it (default: test)")
    parser.add_argument("--constraints", type=Path, help="also require every version to be pinned by this file")
    parser.add_argument(
        "--with",
        dest="others",
        default="",
        help="comma-separated further distributions of this repository installed next to it (make install: "
        "shopsimrl-research,shopsimrl-testbed); their closures count as declared, they need no pin",
    )
    args = parser.parse_args(argv)
    extras = [e for e in args.extras.split(",") if e]
    others = [o for o in args.others.split(",") if o]
    found = problems(installed(), args.project, extras, pinned(args.constraints) if args.constraints else None, others)
    where = Path(sys.prefix)
    what = f"{args.project}[{args.extras}]" + "".join(f" + {other}" for other in others)
    if found:
        print(f"{where}: {len(found)} problem(s):", *(f"  {line}" for line in found), sep="\n", file=sys.stderr)
        return 1
    print(f"{where}: exactly the distributions {what} declares, each as pinned")
    return 0


if __name__ == "__main__":
    sys.exit(main())
