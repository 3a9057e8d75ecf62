"""The kind smoke run's tooling (.github/workflows/smoke.yml, scripts/smoke-k8s.sh,
mk/kubernetes.mk), checked without a cluster: what the workflow triggers on and uploads, what the
script checks and in which order, and its helpers run for real where they can."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
WORKFLOW = ROOT / ".github" / "workflows" / "smoke.yml"
SCRIPT = ROOT / "scripts" / "smoke-k8s.sh"
SMOKE_VALUES = ROOT / "helm" / "shopsimrl" / "ci" / "testbed-smoke-values.yaml"


def _workflow() -> dict[str, Any]:
    data = yaml.safe_load(WORKFLOW.read_text(encoding="utf-8"))
    data["on"] = data.pop(True, data.get("on"))  # YAML 1.1 reads the key `on` as true
    return dict(data)


def _tracked() -> list[str]:
    out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return [line for line in out.splitlines() if (ROOT / line).is_file()]


def _github_glob(pattern: str) -> re.Pattern[str]:
    """GitHub's path filter syntax: ``**`` crosses directories, ``*`` does not."""
    out = ""
    for part in re.split(r"(\*\*/?|\*)", pattern):
        out += {"**/": "(?:.*/)?", "**": ".*", "*": "[^/]*"}.get(part, re.escape(part))
    return re.compile(out + r"\Z")


def _used_files() -> set[str]:
    """What the smoke job reads: the Makefile (make reads it whole), the build context and the
    Dockerfiles, and every repository path named by the workflow's steps, by the make file of its
    targets, and by the scripts those name, followed transitively."""
    tracked = _tracked()
    rules = [r.strip() for r in (ROOT / ".dockerignore").read_text().splitlines() if r.strip() and not r.startswith("#")]
    context = [r[1:].rstrip("/") for r in rules if r.startswith("!")]
    used = {"Makefile", ".dockerignore", "Dockerfile", WORKFLOW.relative_to(ROOT).as_posix()}
    # `make install` (a step) installs from these; the images install from docker/requirements/.
    used |= {"pyproject.toml", "constraints.txt"}
    used |= {f for f in tracked if any(f == c or f.startswith(c + "/") for c in context)}
    texts = [str(step.get("run", "")) for step in _workflow()["jobs"]["kind"]["steps"]]
    read = {"mk/kubernetes.mk"}  # the included make file with every target the job runs
    texts.append((ROOT / "mk/kubernetes.mk").read_text())
    while texts:
        for token in set(re.findall(r"[\w.-]+(?:/[\w.*-]+)+", texts.pop())):
            token = token.rstrip("/.")
            found = {f for f in tracked if f == token or f.startswith(token + "/")}
            used |= found
            for script in sorted(f for f in found - read if f.startswith(("scripts/", "mk/"))):
                read.add(script)
                texts.append((ROOT / script).read_text())
    return used | read


@pytest.mark.slow
def test_path_filters_cover_every_file_the_smoke_workflow_uses() -> None:
    filters = [_github_glob(p) for p in _workflow()["on"]["pull_request"]["paths"]]
    used = _used_files()
    # The derivation found the files this test exists for.
    assert {
        "Makefile",
        ".dockerignore",
        "tests/test_chart.py",
        "mk/kubernetes.mk",
        "constraints.txt",
        "scripts/smoke-k8s.sh",
        "docker/testbed.Dockerfile",
        "k8s/overlays/smoke/kustomization.yaml",
    } <= used
    uncovered = sorted(f for f in used if not any(pattern.match(f) for pattern in filters))
    assert uncovered == [], f"smoke.yml's path filters miss files it uses: {uncovered}"


def test_the_workflow_uploads_what_the_script_collects_passed_or_failed() -> None:
    job = _workflow()["jobs"]["kind"]
    (upload,) = [s for s in job["steps"] if str(s.get("uses", "")).startswith("actions/upload-artifact@")]
    assert upload["if"] == "always()"
    assert upload["with"]["path"] == "${{ env.ARTIFACTS_DIR }}" and "ARTIFACTS_DIR" in job["env"]
    script = SCRIPT.read_text()
    # Collected from the EXIT trap, so a failing step still leaves its evidence.
    assert re.search(r"""trap '[^']*collect_artifacts""", script)
    body = script[script.index("collect_artifacts() {") : script.index("\n}\n", script.index("collect_artifacts() {"))]
    for what in ("describe jobs,pods", 'logs "$pod" --all-containers', "get events", "get jobs,pods"):
        assert what in body, what
    assert "secret" not in body.lower(), "artifacts never hold a Secret"
    for summary in ("summary-reducer.json", "summary.json"):
        assert f'"$ARTIFACTS_DIR/{summary}"' in script


def test_the_script_waits_for_the_reducer_job_and_checks_its_summary() -> None:
    main = SCRIPT.read_text().split("main() {", 1)[1]
    worker_wait = main.index('wait_for_job "$job"')
    reducer_wait = main.index('wait_for_job "$reducer"')
    reducer_summary = main.index('check_summary "$run_uri" "$ARTIFACTS_DIR/summary-reducer.json"')
    local_reduce = main.index('"$MAKE" reduce RUN="$run_uri"')
    assert worker_wait < reducer_wait < reducer_summary < local_reduce
    assert "job_of reducer" in main and 'die "no reducer Job' in main
    # The smoke values deploy the reducer with the Job watch, from the kube image the script loads.
    values = yaml.safe_load(SMOKE_VALUES.read_text())
    assert values["reducer"]["enabled"] and values["reducer"]["watchWorkerJob"]
    assert values["reducer"]["image"]["repository"] == "shopsimrl-kube" and '"$IMAGE-kube"' in main
    assert values["testbed"]["image"]["repository"] == "shopsimrl-testbed" and '"$IMAGE-testbed"' in main


def test_the_smoke_values_name_the_overlay_the_script_applies() -> None:
    overlay = re.search(r'^OVERLAY="([^"]+)"', SCRIPT.read_text(), re.M)
    assert overlay and 'apply -k "$OVERLAY"' in SCRIPT.read_text()
    comments = " ".join(line for line in SMOKE_VALUES.read_text().splitlines() if line.startswith("#"))
    assert re.findall(r"k8s/overlays/\w+", comments) == [overlay.group(1)]
    assert (ROOT / overlay.group(1) / "kustomization.yaml").is_file()


def _bash(snippet: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """Run ``snippet`` after sourcing the script for its functions (sourcing runs nothing)."""
    return subprocess.run(
        ["bash", "-c", f'source "{SCRIPT}"; {snippet}'],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": shutil.which("python3") or "python3"},
        timeout=timeout,
    )


@pytest.mark.slow
def test_wait_for_port_fails_unless_the_port_opens() -> None:
    with socket.socket() as listening:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        port = listening.getsockname()[1]
        opened = _bash(f"rc=0; wait_for_port {port} 5 || rc=$?; echo rc=$rc")
    assert opened.stdout.strip() == "rc=0", opened.stderr
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
        port = closed.getsockname()[1]
        refused = _bash(f"rc=0; wait_for_port {port} 2 || rc=$?; echo rc=$rc")
        # A port-forward process that is gone ends the wait at once, whatever the tries.
        gone = _bash(f"sleep 0 & pid=$!; wait $pid; rc=0; wait_for_port {port} 600 $pid || rc=$?; echo rc=$rc")
    assert refused.stdout.strip() == "rc=1", refused.stderr
    assert gone.stdout.strip() == "rc=1", gone.stderr


def _make(*args: str, **env: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        ["make", "--no-print-directory", *args], cwd=ROOT, capture_output=True, text=True, env={**os.environ, **env}, timeout=120
    )


@pytest.mark.slow
@pytest.mark.parametrize("target", ["smoke-k8s", "image", "images", "image-testbed"])
def test_without_docker_make_says_so_before_any_build(tmp_path: Path, target: str) -> None:
    result = _make(target, f"DOCKER={tmp_path / 'docker'}")
    assert result.returncode != 0
    assert f"needs Docker ({tmp_path / 'docker'} is not on PATH)" in result.stderr
    assert " build " not in result.stdout + result.stderr  # no docker build was started


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("docker") is None, reason="needs the docker client (the daemon must be unreachable)")
@pytest.mark.parametrize("target", ["smoke-k8s", "image"])
def test_without_a_docker_daemon_make_says_so_before_any_build(tmp_path: Path, target: str) -> None:
    result = _make(target, DOCKER_HOST=f"unix://{tmp_path}/no-daemon.sock")
    assert result.returncode != 0
    assert "needs a running Docker daemon" in result.stderr
    assert "docker build" not in result.stdout + result.stderr


@pytest.mark.slow
def test_the_llm_smoke_script_reads_its_run_directory_from_the_plan() -> None:
    """`make smoke-llm` starts each run fresh by removing the run directory `shopsimrl plan`
    names: run the script's own line (it broke once when `plan` began printing a table)."""
    line = next(text for text in (ROOT / "scripts" / "llm-smoke.sh").read_text().splitlines() if text.startswith("RUN_DIR="))
    script = f'set -euo pipefail\nBIN={Path(sys.executable).parent}\nCONFIG=configs/smoke_llm.yaml\n{line}\necho "$RUN_DIR"\n'
    env = {key: value for key, value in os.environ.items() if not key.startswith("SHOPSIMRL_")}
    done = subprocess.run(["bash", "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == str(ROOT / "runs" / "smoke-llm")


# --------------------------------------------------------------------------- pins, cache, summary


def _pin(text: str, name: str) -> str:
    found = re.search(rf'^{name}="\$\{{{name}:-([^}}]+)\}}"', text, re.M) or re.search(rf'^{name}="([^"]+)"', text, re.M)
    assert found, name
    return found.group(1)


def test_kind_and_its_node_image_are_pinned_to_the_kubectl_minor() -> None:
    """The workflow and the script pin the same kind and node image (by digest), and the node's
    Kubernetes minor is the one of the kubectl that scripts/install-helm.sh installs."""
    job = _workflow()["jobs"]["kind"]
    script = SCRIPT.read_text()
    install = (ROOT / "scripts" / "install-helm.sh").read_text()
    kind_version, node_image = _pin(script, "KIND_VERSION"), _pin(script, "KIND_NODE_IMAGE")
    kubectl = _pin(install, "KUBECTL_VERSION")
    assert job["env"]["KIND_VERSION"] == kind_version == "v0.27.0"
    assert job["env"]["KIND_NODE_IMAGE"] == node_image
    assert job["env"]["KUBECTL_VERSION"] == kubectl
    image = re.fullmatch(r"kindest/node:v(\d+\.\d+)\.\d+@sha256:[0-9a-f]{64}", node_image)
    assert image and kubectl.startswith(f"v{image.group(1)}."), (node_image, kubectl)
    (kind_step,) = [s for s in job["steps"] if str(s.get("uses", "")).startswith("helm/kind-action@")]
    assert kind_step["with"]["version"] == "${{ env.KIND_VERSION }}"
    assert kind_step["with"]["node_image"] == "${{ env.KIND_NODE_IMAGE }}"
    assert kind_step["with"]["kubectl_version"] == "${{ env.KUBECTL_VERSION }}"
    assert 'create cluster --name "$KIND_CLUSTER" --image "$KIND_NODE_IMAGE"' in script
    # Third-party actions run pinned to a commit.
    for step in job["steps"]:
        uses = str(step.get("uses", ""))
        if uses and not uses.startswith("actions/"):
            assert re.fullmatch(r"[\w.-]+/[\w.-]+@[0-9a-f]{40}", uses), uses
    assert job["env"]["HELM_SOURCE"] == "release"


@pytest.mark.slow
def test_the_image_builds_are_cached_and_not_built_twice() -> None:
    job = _workflow()["jobs"]["kind"]
    builds = [s for s in job["steps"] if str(s.get("uses", "")).startswith("docker/build-push-action@")]
    assert {b["with"]["file"] for b in builds} == {"Dockerfile", "docker/testbed.Dockerfile"} and len(builds) == 3
    scopes = set()
    for build in builds:
        scope = re.fullmatch(r"type=gha,scope=([\w-]+)", build["with"]["cache-from"])
        assert scope and build["with"]["cache-to"] == f"type=gha,scope={scope.group(1)},mode=max"
        assert build["with"]["load"] is True
        scopes.add(scope.group(1))
    assert len(scopes) == 3, "each image its own cache scope"
    tags = {b["with"]["tags"] for b in builds}
    assert tags == {f"${{{{ env.IMAGE }}}}{suffix}:${{{{ env.IMAGE_TAG }}}}" for suffix in ("", "-kube", "-testbed")}
    smoke = [s for s in job["steps"] if "make smoke-k8s" in str(s.get("run", ""))]
    assert len(smoke) == 1 and "SMOKE_BUILD=0" in smoke[0]["run"]
    dry = _make("-n", "smoke-k8s", "SMOKE_BUILD=0")
    assert " build " not in dry.stdout, "SMOKE_BUILD=0 must not build the images again"
    assert " build " in _make("-n", "smoke-k8s").stdout


def _fake_tools(tmp_path: Path, kind_version: str, node: str, client: str) -> dict[str, str]:
    kind = tmp_path / "kind"
    kind.write_text(f'#!/bin/sh\n[ "$1" = version ] && echo "kind {kind_version} go1.23.6 linux/amd64"\n')
    kubectl = tmp_path / "kubectl"
    kubectl.write_text(
        "#!/bin/sh\n"
        'case "$*" in\n'
        f'  *"get nodes"*) printf %s "{node}" ;;\n'
        f'  *"version --client"*) printf "Client Version: {client}\\nKustomize Version: v5.5.0\\n" ;;\n'
        "esac\n"
    )
    for tool in (kind, kubectl):
        tool.chmod(0o755)
    docker = tmp_path / "docker"
    docker.write_text("#!/bin/sh\nexit 0\n")
    docker.chmod(0o755)
    return {"KIND": str(kind), "KUBECTL": str(kubectl), "DOCKER": str(docker), "PYTHON": sys.executable}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("kind_version", "node", "client", "fails_with"),
    [
        ("v0.27.0", "v1.32.2", "v1.32.3", None),
        ("v0.26.0", "v1.32.2", "v1.32.3", "needs kind v0.27.0"),
        ("v0.27.0", "v1.33.1", "v1.32.3", "the cluster's nodes run v1.33.1, not v1.32"),
        ("v0.27.0", "v1.32.2", "v1.35.0", "kubectl is v1.35.0, not the nodes' minor v1.32"),
    ],
)
def test_the_script_refuses_another_kind_or_kubernetes_minor(
    tmp_path: Path, kind_version: str, node: str, client: str, fails_with: str | None
) -> None:
    env = _fake_tools(tmp_path, kind_version, node, client)
    exports = " ".join(f"{k}={v}" for k, v in env.items())
    done = _bash(f"{exports}; preflight && check_versions && echo ok")
    if fails_with is None:
        assert done.stdout.strip() == "ok", done.stderr
    else:
        assert done.returncode != 0 and fails_with in done.stderr, done.stderr


def _summary(counts: dict[str, Any], committed: int = 2) -> dict[str, Any]:
    return {"complete": True, "counts": {"coverage": 1.0, **counts}, "shards": {"committed": committed}}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("summary", "fails_with"),
    [
        (_summary({"requested": 8, "completed": 8, "failed": 0, "missing": 0}), None),
        (_summary({"requested": 8, "completed": 7, "failed": 1, "missing": 0}), "expected {'requested': 8, 'completed': 8"),
        (_summary({"requested": 4, "completed": 4, "failed": 0, "missing": 0}), "FAILED: counts"),
        (_summary({"requested": 8, "completed": 8, "failed": 0, "missing": 0}, committed=1), "over 2 shards"),
        ({**_summary({"requested": 8}), "complete": False, "incomplete": {"missing_shards": [1]}}, "complete False"),
    ],
    ids=["every-episode", "a-failed-episode", "fewer-planned", "a-shard-short", "incomplete"],
)
def test_the_script_asserts_the_reducers_summary(tmp_path: Path, summary: dict[str, Any], fails_with: str | None) -> None:
    """check_summary, run for real on a summary.json: every episode the smoke values plan
    (sample_size x repeats) completed, none failed, every shard committed, complete."""
    run = tmp_path / "run"
    run.mkdir()
    (run / "summary.json").write_text(json.dumps(summary))
    done = subprocess.run(
        ["bash", "-c", f'source "{SCRIPT}"; PYTHON={sys.executable}; check_summary "{run}" "{tmp_path / "copy.json"}"'],
        capture_output=True, text=True, cwd=ROOT, timeout=60,
    )  # fmt: skip
    if fails_with is None:
        assert done.returncode == 0, done.stderr
        assert json.loads((tmp_path / "copy.json").read_text()) == summary, "the artifact copy"
    else:
        assert done.returncode != 0 and fails_with in done.stderr, done.stderr
