"""The import graph of shopsimrl/: no cycles, and imports that point one way, layer by layer.

Every module is parsed with ``ast`` (nothing is imported), every import statement is found:
at module level, under ``if TYPE_CHECKING:`` and inside functions. A new module must be given
its layer in ``LAYERS`` below; README.md ("Where things are") says what each holds.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "shopsimrl"

# Highest first. An import may point into its own layer or any layer below it, never above.
LAYERS: dict[str, tuple[str, ...]] = {
    # The commands: the core's (shopsimrl/cli/) and those of the optional parts, which the core
    # registers by name only (CORE_CLI below may not import them).
    "cli": (
        "shopsimrl.__main__",
        "shopsimrl.cli",
        "shopsimrl.cli.common",
        "shopsimrl.cli.env",
        "shopsimrl.cli.evalset",
        "shopsimrl.cli.evalset_extras",
        "shopsimrl.cli.errors",
        "shopsimrl.cli.run",
        "shopsimrl.cli.runs",
        "shopsimrl.cli.shards",
        "shopsimrl.cli.status",
        "shopsimrl.cli.training",
        "shopsimrl.research.cli",
        "shopsimrl.testbed.cli",
    ),
    # Tools over finished runs; they read runs through the layers below, nothing below imports them.
    "research": (
        "shopsimrl.research",
        "shopsimrl.research.analysis",
        "shopsimrl.research.compare",
        "shopsimrl.research.dedup",
        "shopsimrl.research.episodes",
        "shopsimrl.research.export",
        "shopsimrl.research.gate",
        "shopsimrl.research.gate.checks",
        "shopsimrl.research.gate.commands",
        "shopsimrl.research.gate.drafts",
        "shopsimrl.research.gate.earlier",
        "shopsimrl.research.gate.fit",
        "shopsimrl.research.gate.freeze",
        "shopsimrl.research.gate.helm",
        "shopsimrl.research.gate.masks",
        "shopsimrl.research.gate.outputs",
        "shopsimrl.research.gate.spec",
        "shopsimrl.research.judge",
        "shopsimrl.research.judge.call",
        "shopsimrl.research.judge.commands",
        "shopsimrl.research.judge.config",
        "shopsimrl.research.judge.local",
        "shopsimrl.research.judge.sharded",
        "shopsimrl.research.judge.summary",
        "shopsimrl.research.labels",
        "shopsimrl.research.outputs",
        "shopsimrl.research.paired_stats",
        "shopsimrl.research.redaction",
        "shopsimrl.research.report",
        "shopsimrl.research.runset",
        "shopsimrl.research.skills",
        "shopsimrl.research.skills.analyst",
        "shopsimrl.research.skills.cards",
        "shopsimrl.research.skills.compact",
        "shopsimrl.research.skills.build",
        "shopsimrl.research.skills.compile",
        "shopsimrl.research.skills.consolidate",
        "shopsimrl.research.skills.failure",
        "shopsimrl.research.skills.firewall",
        "shopsimrl.research.skills.online",
        "shopsimrl.research.skills.inputs",
        "shopsimrl.research.skills.prompts",
        "shopsimrl.research.skills.sharded",
        "shopsimrl.research.skills.snapshot",
        "shopsimrl.research.skills.structured",
        "shopsimrl.research.tables",
        "shopsimrl.research.tracking",
        "shopsimrl.research.tracking.base",
        "shopsimrl.research.tracking.evaluation",
        "shopsimrl.research.tracking.stages",
        "shopsimrl.research.tracking.trackers",
        "shopsimrl.research.training",
        "shopsimrl.research.transcript",
        "shopsimrl.research.viewer",
    ),
    # Training rollouts: the token-level model adapter, trajectories, the trainer's samples, slime's
    # hooks. They run the episode engine and the runner's lease journal; nothing below imports them.
    "training": (
        "shopsimrl.training",
        "shopsimrl.training.chat",
        "shopsimrl.training.config",
        "shopsimrl.training.curriculum",
        "shopsimrl.training.grpo",
        "shopsimrl.training.hf_tokenizer",
        "shopsimrl.training.metrics",
        "shopsimrl.training.preflight",
        "shopsimrl.training.rollout",
        "shopsimrl.training.samples",
        "shopsimrl.training.slime_adapter",
        "shopsimrl.training.slime_step",
        "shopsimrl.training.store",
        "shopsimrl.training.task_data",
        "shopsimrl.training.token_model",
        "shopsimrl.training.trajectory",
        "shopsimrl.training.triage",
        "shopsimrl.training.worker",
    ),
    # Running a plan: scheduling, signals, the commands around a run. It writes and reads runs
    # through the stores below it.
    "runner": (
        "shopsimrl.runner",
        "shopsimrl.runner.driver",
        "shopsimrl.runner.evalset",
        "shopsimrl.runner.evalset_helm",
        "shopsimrl.runner.experiment",
        "shopsimrl.runner.kube",
        "shopsimrl.runner.lease_journal",
        "shopsimrl.runner.local",
        "shopsimrl.runner.local_job",
        "shopsimrl.runner.progress",
        "shopsimrl.runner.reduce",
        "shopsimrl.runner.runs",
        "shopsimrl.runner.scheduler",
        "shopsimrl.runner.slots",
        "shopsimrl.runner.status",
        "shopsimrl.runner.worker",
        "shopsimrl.runner.worker_processes",
    ),
    # Run stores and their readers: they know records, never how episodes run.
    "storage": (
        "shopsimrl.storage",
        "shopsimrl.storage.base",
        "shopsimrl.storage.local",
        "shopsimrl.storage.objectstore",
        "shopsimrl.storage.reading",
        "shopsimrl.storage.sharded",
        "shopsimrl.storage.training",
    ),
    "episode": ("shopsimrl.episode",),
    "adapters": (
        "shopsimrl.environment",
        "shopsimrl.httpclient",
        "shopsimrl.inflight",
        "shopsimrl.model",
        "shopsimrl.prompts",
        "shopsimrl.retry",
        "shopsimrl.skills",
    ),
    # Records and what every layer uses: trace/plan/summary shapes, config and splits, exit
    # codes, logging, the event loop and signal handling.
    "records": (
        "shopsimrl",
        "shopsimrl.config",
        "shopsimrl.cost",
        "shopsimrl.eventloop",
        "shopsimrl.exitcodes",
        "shopsimrl.logs",
        "shopsimrl.manifest",
        "shopsimrl.metrics",
        "shopsimrl.planning",
        "shopsimrl.records",
        "shopsimrl.records.__main__",
        "shopsimrl.records._base",
        "shopsimrl.records.io",
        "shopsimrl.records.jsonschema",
        "shopsimrl.records.manifest",
        "shopsimrl.records.marker",
        "shopsimrl.records.summary",
        "shopsimrl.records.trace",
        "shopsimrl.records.winner",
        "shopsimrl.schemas",
        "shopsimrl.stopping",
        "shopsimrl.tasks",
    ),
}
RANK = {layer: rank for rank, layer in enumerate(reversed(LAYERS))}
LAYER_OF = {module: layer for layer, modules in LAYERS.items() for module in modules}
TESTBED = "shopsimrl.testbed"
TESTBED_MAY_IMPORT = ("records",)
"""The testbed stands in for the services: it may use the core's records, nothing above them."""
STARTS_THE_TESTBED = ("shopsimrl.testbed.cli",)
CORE_CLI = ("shopsimrl.__main__", "shopsimrl.cli")
"""The core's commands (the modules and their submodules): they run without the optional parts,
so they import neither (shopsimrl/cli/__init__.py loads those with importlib, by name)."""
OPTIONAL_PARTS = ("shopsimrl.research", "shopsimrl.testbed")


def _within(module: str, roots: tuple[str, ...]) -> bool:
    return any(module == root or module.startswith(root + ".") for root in roots)


def _is_testbed(module: str) -> bool:
    """A module of the testbed proper; its commands (``shopsimrl.testbed.cli``) are of the cli layer."""
    return module.startswith(TESTBED) and module not in LAYER_OF


@dataclass(frozen=True)
class Import:
    source: str
    target: str
    where: str
    """``path:line``, for the failure message."""
    kind: str
    """``module``, ``type_checking`` or ``function``."""

    def __str__(self) -> str:
        return f"{self.where}: {self.source} imports {self.target}" + ("" if self.kind == "module" else f" ({self.kind})")


def module_names(package: Path) -> dict[str, Path]:
    names = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        names[".".join(parts)] = path
    return names


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def imports_of(module: str, path: Path, known: dict[str, Path], package_dir: Path) -> list[Import]:
    """Every import of another module of the package that ``module`` makes, with its context."""
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    root = next(iter(known)).split(".")[0]
    found: list[Import] = []

    def resolve(name: str) -> str | None:
        while name and name not in known:
            name = name.rpartition(".")[0]
        return name or None

    def add(target: str | None, node: ast.stmt, kind: str) -> None:
        if target is not None and target != module:
            found.append(Import(module, target, f"{path.relative_to(package_dir.parent)}:{node.lineno}", kind))

    def visit(node: ast.AST, kind: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
                visit(child, "function")
            elif isinstance(child, ast.If) and _is_type_checking(child.test):
                for inner in child.body:
                    visit_statement(inner, "type_checking" if kind == "module" else kind)
                for inner in child.orelse:
                    visit_statement(inner, kind)
            else:
                visit_statement(child, kind)

    def visit_statement(node: ast.AST, kind: str) -> None:
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == root:
                    add(resolve(alias.name), node, kind)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            if source.split(".")[0] != root:
                return
            for alias in node.names:
                full = f"{source}.{alias.name}"
                add(full if full in known else resolve(source), node, kind)
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            visit(node, "function")
        else:
            visit(node, kind)

    visit(tree, "module")
    return found


def import_graph(package: Path) -> tuple[dict[str, Path], list[Import]]:
    known = module_names(package)
    return known, [edge for module, path in known.items() for edge in imports_of(module, path, known, package)]


def cycles(edges: list[Import]) -> list[list[Import]]:
    """One cycle (as its imports) per strongly connected group of modules, module-level and
    TYPE_CHECKING imports only: a function's import runs after every module has loaded."""
    graph: dict[str, list[Import]] = {}
    for edge in edges:
        if edge.kind != "function":
            graph.setdefault(edge.source, []).append(edge)
    found, seen = [], set()
    for start in sorted(graph):
        if start in seen:
            continue
        stack: list[tuple[str, list[Import]]] = [(start, [])]
        visited: set[str] = set()
        while stack:
            module, path = stack.pop()
            for edge in graph.get(module, []):
                if edge.target == start:
                    found.append([*path, edge])
                    seen.update(e.source for e in [*path, edge])
                    stack.clear()
                    break
                if edge.target not in visited:
                    visited.add(edge.target)
                    stack.append((edge.target, [*path, edge]))
    return found


def layer_problems(edges: list[Import]) -> list[str]:
    problems = []
    for edge in edges:
        if _within(edge.source, CORE_CLI) and _within(edge.target, OPTIONAL_PARTS):
            problems.append(
                f"{edge}: the core's commands may not import an optional part (register it in shopsimrl/cli/__init__.py)"
            )
            continue
        source_tb, target_tb = _is_testbed(edge.source), _is_testbed(edge.target)
        if source_tb and target_tb:
            continue
        if target_tb:
            if edge.source not in STARTS_THE_TESTBED:
                problems.append(f"{edge}: only {', '.join(STARTS_THE_TESTBED)} may start the testbed")
            continue
        target_layer = LAYER_OF.get(edge.target)
        if source_tb:
            if target_layer not in TESTBED_MAY_IMPORT:
                problems.append(
                    f"{edge}: the testbed may import only the core's {', '.join(TESTBED_MAY_IMPORT)} layer, not {target_layer}"
                )
            continue
        source_layer = LAYER_OF.get(edge.source)
        if source_layer is not None and target_layer is not None and RANK[target_layer] > RANK[source_layer]:
            problems.append(f"{edge}: upward, from the {source_layer} layer to the {target_layer} layer")
    return problems


def distribution_problems(edges: list[Import]) -> list[str]:
    """The core distribution (the worker image) installs without shopsimrl-research and
    shopsimrl-testbed, so no module outside those two packages imports either, in any form."""
    problems = []
    for edge in edges:
        if _within(edge.target, OPTIONAL_PARTS) and not _within(edge.source, OPTIONAL_PARTS):
            problems.append(f"{edge}: a core module imports a distribution of its own")
    return problems


def test_every_module_has_a_declared_layer_and_every_declared_module_exists() -> None:
    known = module_names(PACKAGE)
    core = {name for name in known if not name.startswith(TESTBED)}
    assert sorted(core - set(LAYER_OF)) == [], "declare the layer of these modules in LAYERS"
    assert sorted(set(LAYER_OF) - set(known)) == [], "these modules in LAYERS no longer exist"
    assert [name for name in LAYER_OF if name.startswith(TESTBED)] == ["shopsimrl.testbed.cli"], (
        "only its commands leave the testbed"
    )
    declared = [module for modules in LAYERS.values() for module in modules]
    assert len(declared) == len(set(declared)), "a module is declared in two layers"


@pytest.mark.slow
def test_no_import_cycles_at_module_level_including_type_checking() -> None:
    _, edges = import_graph(PACKAGE)
    found = cycles(edges)
    assert found == [], "import cycles:\n" + "\n".join(" → ".join(str(edge) for edge in cycle) for cycle in found)


@pytest.mark.slow
def test_imports_point_down_the_layers_and_the_testbed_stays_apart() -> None:
    _, edges = import_graph(PACKAGE)
    assert edges, "the parser found no imports at all"
    problems = layer_problems(edges)
    assert problems == [], "\n".join(problems)


def test_the_research_layer_is_the_research_distribution() -> None:
    """What the research layer holds ships in shopsimrl-research, nothing of it in the core."""
    assert [m for m in LAYERS["research"] if not _within(m, ("shopsimrl.research",))] == []


def test_the_core_distribution_imports_neither_research_nor_testbed() -> None:
    _, edges = import_graph(PACKAGE)
    problems = distribution_problems(edges)
    assert problems == [], "\n".join(problems)


def test_the_checks_find_what_they_are_for(tmp_path: Path) -> None:
    """The control: a package with a TYPE_CHECKING cycle, an upward import inside a function,
    a relative import, the testbed reaching up and the core's commands importing an optional part
    are caught, naming each offending import; the testbed's own commands may use the core's."""
    package = tmp_path / "shopsimrl"
    (package / "testbed").mkdir(parents=True)
    (package / "runner").mkdir()
    (package / "research").mkdir()
    files = {
        "__init__.py": "",
        "cli.py": "import shopsimrl.testbed.up\ndef load():\n    from shopsimrl.research import compare\n",
        "research/__init__.py": "",
        "testbed/cli.py": "from shopsimrl.cli import load\nimport shopsimrl.testbed.up\n",
        "schemas.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from shopsimrl.traces import x\n",
        "traces.py": "from shopsimrl import schemas\n",
        "model.py": "def call():\n    from shopsimrl.episode import run\n",
        "episode.py": "from .model import call\n",
        "testbed/__init__.py": "",
        "testbed/up.py": "from shopsimrl.runner.scheduler import Evaluator\n",
        "runner/__init__.py": "",
        "runner/scheduler.py": "import shopsimrl.testbed\n",
        "research/tables.py": "",
        "metrics.py": "def table():\n    from shopsimrl.research.tables import steps\n",
    }
    for name, text in files.items():
        (package / name).write_text(text)
    _, edges = import_graph(package)
    (cycle,) = cycles(edges)
    assert {(e.source, e.target, e.kind) for e in cycle} == {
        ("shopsimrl.schemas", "shopsimrl.traces", "type_checking"),
        ("shopsimrl.traces", "shopsimrl.schemas", "module"),
    }
    assert ("shopsimrl.episode", "shopsimrl.model", "module") in {(e.source, e.target, e.kind) for e in edges}
    problems = "\n".join(layer_problems(edges))
    assert "shopsimrl/model.py:2: shopsimrl.model imports shopsimrl.episode (function): upward" in problems
    assert "shopsimrl/testbed/up.py:1: shopsimrl.testbed.up imports shopsimrl.runner.scheduler" in problems
    assert (
        "shopsimrl/runner/scheduler.py:1: shopsimrl.runner.scheduler imports shopsimrl.testbed: only shopsimrl.testbed.cli"
        in problems
    )
    assert "shopsimrl/cli.py:1: shopsimrl.cli imports shopsimrl.testbed.up: the core's commands may not import" in problems
    assert "shopsimrl/cli.py:3: shopsimrl.cli imports shopsimrl.research (function): the core's commands may not" in problems
    assert "shopsimrl.testbed.cli imports" not in problems
    boundary = "\n".join(distribution_problems(edges))
    assert "shopsimrl/metrics.py:2: shopsimrl.metrics imports shopsimrl.research.tables (function): a core module" in boundary
    assert "shopsimrl/runner/scheduler.py:1: shopsimrl.runner.scheduler imports shopsimrl.testbed: a core module" in boundary
    assert "shopsimrl/cli.py:3: shopsimrl.cli imports shopsimrl.research (function): a core module" in boundary
    assert "shopsimrl.testbed.cli imports" not in boundary
