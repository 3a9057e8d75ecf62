"""The Helm chart, rendered by a real Helm 3 and checked against Kubernetes' own schemas.

Helm comes from scripts/install-helm.sh (the PyPI wheel here, a checksummed release where
HELM_SOURCE=release); every rendered document must pass ``kubernetes_validate`` in strict mode
for Kubernetes 1.30 and 1.37, and a JobSet against the JobSet CRD's own schema (vendored in
tests/fixtures/jobset/). The k8s/ kustomizations are rendered with the kubectl of the same
install and validated the same way.
"""

from __future__ import annotations

import functools
import gzip
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml
from kubernetes_validate.utils import latest_version

from shopsimrl.exitcodes import ExitCode

pytestmark = [pytest.mark.chart, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
CHART = ROOT / "helm" / "shopsimrl"
CI_VALUES = sorted((CHART / "ci").glob("*.yaml"))
# The oldest minor the issue asks for and the newest kubernetes-validate ships.
K8S_VERSIONS = ("1.30.0", "1.37.0")
RELEASE = "eval-ckpt100"
# Looks like a credential; must never show up in anything the chart renders.
SENTINEL = "sk-SENTINEL-0f9e8d7c6b5a4f3e2d1c"
OPTIONAL_TEMPLATES = {
    "vllm.enabled": {"deployment-vllm.yaml", "service-vllm.yaml", "pdb-vllm.yaml"},
    "shopsimulator.enabled": {"deployment-shopsimulator.yaml", "service-shopsimulator.yaml", "pdb-shopsimulator.yaml"},
    "testbed.enabled": {
        "deployment-testbed-shop.yaml",
        "service-testbed-shop.yaml",
        "deployment-testbed-policy.yaml",
        "service-testbed-policy.yaml",
    },
    "reducer.enabled": {"job-reducer.yaml"},
    "networkPolicy.enabled": {"networkpolicy-worker.yaml"},
}
ALWAYS = {"configmap-config.yaml", "job-worker.yaml"}


# --------------------------------------------------------------------------- helm harness


@dataclass(frozen=True)
class Helm:
    binary: Path
    kubectl: Path
    env: dict[str, str]

    def run(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run([str(self.binary), *args], capture_output=True, text=True, env=self.env, timeout=120)
        if check and proc.returncode != 0:
            raise AssertionError(f"helm {' '.join(args)} failed:\n{proc.stderr}")
        return proc

    def template(
        self,
        *values: Path,
        sets: dict[str, str] | None = None,
        release: str = RELEASE,
        set_strings: dict[str, str] | None = None,
        check: bool = True,
    ) -> subprocess.CompletedProcess[str]:
        args = ["template", release, str(CHART), "--namespace", "evals"]
        for path in values:
            args += ["-f", str(path)]
        for key, value in (sets or {}).items():
            args += ["--set", f"{key}={value}"]
        for key, value in (set_strings or {}).items():
            args += ["--set-string", f"{key}={value}"]
        return self.run(*args, check=check)

    def render(
        self, *values: Path, sets: dict[str, str] | None = None, release: str = RELEASE, set_strings: dict[str, str] | None = None
    ) -> list[Doc]:
        return parse_docs(self.template(*values, sets=sets, release=release, set_strings=set_strings).stdout)


@dataclass(frozen=True)
class Doc:
    source: str
    body: dict[str, Any]

    @property
    def kind(self) -> str:
        return str(self.body["kind"])


def parse_docs(text: str) -> list[Doc]:
    docs = []
    for chunk in re.split(r"^---\s*$", text, flags=re.M):
        match = re.search(r"^# Source: shopsimrl/templates/(\S+)$", chunk, flags=re.M)
        body = yaml.safe_load(chunk)
        if body:
            docs.append(Doc(match.group(1) if match else "?", body))
    return docs


@pytest.fixture(scope="session")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Helm:
    env = {**os.environ, "PYTHON": sys.executable}
    proc = subprocess.run(
        ["bash", str(ROOT / "scripts" / "install-helm.sh")],
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )
    assert proc.returncode == 0, f"scripts/install-helm.sh failed:\n{proc.stderr}"
    binary = Path(proc.stdout.strip().splitlines()[-1])
    home = tmp_path_factory.mktemp("helm-home")
    env = {
        "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
        "HOME": str(home),
        "HELM_CACHE_HOME": str(home / "cache"),
        "HELM_CONFIG_HOME": str(home / "config"),
        "HELM_DATA_HOME": str(home / "data"),
        # Helm never reads these; set so a render that leaked the process env would show it.
        "AWS_SECRET_ACCESS_KEY": SENTINEL,
        "OPENAI_API_KEY": SENTINEL,
    }
    version = subprocess.run([str(binary), "version", "--short"], capture_output=True, text=True, env=env)
    assert version.stdout.startswith("v3."), version.stdout
    return Helm(binary=binary, kubectl=binary.parent / "kubectl", env=env)


@pytest.fixture(scope="module")
def matrix(helm: Helm) -> dict[str, list[Doc]]:
    return {path.name: helm.render(path) for path in CI_VALUES}


def only(docs: list[Doc], kind: str, source: str | None = None) -> dict[str, Any]:
    """The one document of ``kind`` (from ``source``). A release with jobSet.enabled has no worker
    or reducer Job of its own: asked for one, this answers the JobSet's replicated Job instead
    (as the JobSet controller will create it)."""
    found = [d.body for d in docs if d.kind == kind and (source is None or d.source == source)]
    if not found and kind == "Job":
        found = [d.body for d in expand_jobsets(docs) if d.kind == kind and (source is None or d.source == source)]
    assert len(found) == 1, f"expected one {kind} ({source}), found {len(found)}"
    return found[0]


# The JobSet replicated Jobs of the chart and the plain templates they stand for.
JOBSET_SOURCES = {"worker": "job-worker.yaml", "reducer": "job-reducer.yaml"}


def expand_jobsets(docs: list[Doc]) -> list[Doc]:
    """``docs`` with each JobSet replaced by the Jobs its controller creates from it (replica 0
    of each replicated Job, named <jobset>-<replicated job>-0)."""
    out = []
    for doc in docs:
        if doc.kind != "JobSet":
            out.append(doc)
            continue
        for replicated in doc.body["spec"]["replicatedJobs"]:
            template = replicated["template"]
            name = f"{doc.body['metadata']['name']}-{replicated['name']}-0"
            body = {
                "apiVersion": "batch/v1",
                "kind": "Job",
                "metadata": {**template.get("metadata", {}), "name": name},
                "spec": template["spec"],
            }
            out.append(Doc(JOBSET_SOURCES[replicated["name"]], body))
    return out


def container(pod_spec: dict[str, Any], name: str) -> dict[str, Any]:
    for c in [*pod_spec.get("initContainers", []), *pod_spec["containers"]]:
        if c["name"] == name:
            return c
    raise AssertionError(f"no container {name}")


def env_of(c: dict[str, Any]) -> dict[str, dict[str, Any]]:
    return {e["name"]: e for e in c.get("env", [])}


JOBSET_CRD = ROOT / "tests" / "fixtures" / "jobset" / "jobset.x-k8s.io_jobsets.v0.9.1.yaml.gz"


def _closed(node: Any) -> Any:
    """The CRD schema with every object that lists its properties closed to others (what the API
    server's strict field validation does with unknown fields); open maps stay open."""
    if isinstance(node, dict):
        node = {key: _closed(value) for key, value in node.items()}
        if "properties" in node and "additionalProperties" not in node and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        return node
    if isinstance(node, list):
        return [_closed(item) for item in node]
    return node


@functools.cache
def _jobset_schema() -> tuple[dict[str, Any], list[str]]:
    """The v1alpha2 openAPIV3Schema of the vendored CRD, closed, and its CEL rules."""
    crd = yaml.safe_load(gzip.decompress(JOBSET_CRD.read_bytes()))
    (version,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha2"]
    schema = version["schema"]["openAPIV3Schema"]
    rules: list[str] = []

    def collect(node: Any, path: str) -> None:
        if isinstance(node, dict):
            # The pod template's own CEL rules are Kubernetes' (checked by kubernetes-validate).
            if ".template.spec.template" not in path:
                rules.extend(rule["rule"] for rule in node.get("x-kubernetes-validations", []))
            for key, value in node.items():
                collect(value, f"{path}.{key}")
        elif isinstance(node, list):
            for item in node:
                collect(item, path)

    collect(schema, "")
    return _closed(schema), rules


def _dns1035(name: str) -> bool:
    return len(name) <= 63 and re.fullmatch(r"[a-z]([-a-z0-9]*[a-z0-9])?", name) is not None


def validate_jobset(body: dict[str, Any], origin: str) -> None:
    """A JobSet as the API server and JobSet's webhook would take it: the CRD's schema (unknown
    fields refused), its CEL rules that apply to a create, the webhook's name and dependsOn
    rules, the metadata as an ObjectMeta, and each replicated Job as a batch/v1 Job."""
    import jsonschema

    schema, rules = _jobset_schema()
    errors = sorted(jsonschema.Draft7Validator(schema).iter_errors(body), key=lambda e: list(e.absolute_path))
    assert not errors, f"{origin}: JobSet invalid for the CRD: " + "; ".join(
        f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in errors[:5]
    )
    # The CRD's CEL rules: immutability (self == oldSelf, updates only) and one that applies here.
    assert set(rules) == {
        "self == oldSelf",
        "!(has(self.startupPolicy) && self.startupPolicy.startupPolicyOrder == 'InOrder' && self.replicatedJobs.exists(x, has(x.dependsOn)))",
    }, rules
    spec = body["spec"]
    assert not ("startupPolicy" in spec and any("dependsOn" in r for r in spec["replicatedJobs"]))
    name = body["metadata"]["name"]
    seen: list[str] = []
    for replicated in spec["replicatedJobs"]:
        job = replicated["template"]["spec"]
        replicas = replicated.get("replicas", 1)
        assert _dns1035(f"{name}-{replicated['name']}-{replicas - 1}"), f"{origin}: Job names of {replicated['name']} too long"
        if job.get("completionMode") == "Indexed":
            pod = f"{name}-{replicated['name']}-{replicas - 1}-{job['completions'] - 1}-abcde"
            assert _dns1035(pod), f"{origin}: pod name {pod} is no DNS-1035 label of at most 63 characters"
        for dependency in replicated.get("dependsOn", []):
            assert seen and dependency["name"] in seen, f"{origin}: {replicated['name']} depends on a later replicated Job"
        seen.append(replicated["name"])
    validate_all(iter([{"apiVersion": "v1", "kind": "ConfigMap", "metadata": body["metadata"]}]), f"{origin} (JobSet metadata)")
    validate_all((d.body for d in expand_jobsets([Doc("jobset.yaml", body)])), f"{origin} (JobSet's Jobs)")


def validate_all(docs: Iterator[dict[str, Any]], origin: str) -> int:
    count = 0
    for body in docs:
        if body["kind"] == "JobSet":
            validate_jobset(body, origin)
            count += 1
            continue
        for version in K8S_VERSIONS:
            try:
                kubernetes_validate.validate(body, version, strict=True)
            except kubernetes_validate.ValidationError as exc:
                name = body.get("metadata", {}).get("name")
                raise AssertionError(f"{origin}: {body['kind']} {name} invalid for {version}: {exc}") from None
        count += 1
    return count


# --------------------------------------------------------------------------- lint and schema validity


def test_ci_matrix_is_complete() -> None:
    names = {p.name for p in CI_VALUES}
    assert names >= {
        "default-values.yaml",
        "testbed-smoke-values.yaml",
        "external-services-values.yaml",
        "vllm-values.yaml",
        "s3-secret-values.yaml",
        "networkpolicy-values.yaml",
    }
    assert latest_version() >= K8S_VERSIONS[1], f"kubernetes-validate ships no schema for {K8S_VERSIONS[1]}"


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.stem)
def test_helm_lint_strict(helm: Helm, values: Path) -> None:
    for kube in ("1.29.0", *K8S_VERSIONS):
        proc = helm.run("lint", "--strict", "--kube-version", kube, str(CHART), "-f", str(values))
        assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.stem)
def test_every_rendered_document_is_valid_kubernetes(matrix: dict[str, list[Doc]], values: Path) -> None:
    docs = matrix[values.name]
    assert validate_all((d.body for d in docs), values.name) == len(docs) >= 2


def test_missing_storage_location_names_the_keys(helm: Helm) -> None:
    # Lint reports a template `fail` only as information; rendering for real refuses.
    lint = helm.run("lint", "--strict", str(CHART))
    assert "set storage.baseUri" in lint.stdout + lint.stderr
    proc = helm.template(CHART / "ci" / "default-values.yaml", sets={"storage.baseUri": ""}, check=False)
    assert proc.returncode != 0
    assert "set storage.baseUri (runs go to <baseUri>/<run name>) or run.uri" in proc.stderr


def test_missing_config_says_how_to_give_it(helm: Helm) -> None:
    for sets in ({}, {"config": ""}):
        proc = helm.run(
            "template",
            RELEASE,
            str(CHART),
            "--set",
            "storage.baseUri=s3://b/r",
            *[a for k, v in sets.items() for a in ("--set", f"{k}={v}")],
            check=False,
        )
        assert proc.returncode != 0
        assert "config: missing; give the experiment YAML, e.g. --set-file config=" in proc.stderr


def test_renders_print_no_warnings(helm: Helm, tmp_path: Path) -> None:
    """A mapping config (every ci/ values file but one), a YAML string and an inline split all
    render without Helm's coalesce warnings on stderr ("skipped value for shopsimrl.config: Not
    a table" when the default was a string)."""
    as_string = tmp_path / "string.yaml"
    as_string.write_text(yaml.safe_dump({"config": (ROOT / "configs" / "qwen35_4b_val.yaml").read_text()}))
    renders = [[path] for path in CI_VALUES] + [[CHART / "ci" / "default-values.yaml", as_string]]
    assert any(
        "config" in yaml.safe_load(path.read_text()) and isinstance(yaml.safe_load(path.read_text())["config"], dict)
        for path in CI_VALUES
    )
    for values in renders:
        proc = helm.template(*values)
        assert proc.stderr == "", f"{[v.name for v in values]}: {proc.stderr}"


def test_old_clusters_are_refused(helm: Helm) -> None:
    proc = helm.template(CHART / "ci" / "default-values.yaml", check=False)
    assert proc.returncode == 0
    old = helm.run(
        "template", RELEASE, str(CHART), "-f", str(CHART / "ci" / "default-values.yaml"), "--kube-version", "1.28.0", check=False
    )
    assert old.returncode != 0 and "kubeVersion" in old.stderr


# --------------------------------------------------------------------------- the worker Job


def test_worker_job_is_an_indexed_job_with_the_agreed_policy(matrix: dict[str, list[Doc]]) -> None:
    job = only(matrix["default-values.yaml"], "Job", "job-worker.yaml")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed"
    assert spec["completions"] == 8 and spec["parallelism"] == 8
    assert spec["backoffLimitPerIndex"] == 2
    assert "maxFailedIndexes" not in spec  # default: every index runs to the end
    assert spec["podReplacementPolicy"] == "Failed"
    assert "ttlSecondsAfterFinished" not in spec and spec["activeDeadlineSeconds"] == 172800
    rules = spec["podFailurePolicy"]["rules"]
    ignore = [r for r in rules if r["action"] == "Ignore"]
    assert ignore == [{"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]}]
    fail_index = [r for r in rules if r["action"] == "FailIndex"]
    assert [r["onExitCodes"]["containerName"] for r in fail_index] == ["wait-ready", "worker"]
    for rule in fail_index:
        assert rule["onExitCodes"]["operator"] == "In"
        assert rule["onExitCodes"]["values"] == [ExitCode.BAD_INPUT, ExitCode.FINGERPRINT_MISMATCH]
    pod = spec["template"]["spec"]
    assert pod["restartPolicy"] == "Never"
    assert spec["template"]["metadata"]["annotations"]["karpenter.sh/do-not-disrupt"] == "true"


def _run_objects(docs: list[Doc]) -> dict[tuple[str, str], dict[str, Any]]:
    return {(d.kind, d.body["metadata"]["name"]): d.body for d in docs if d.kind in ("Job", "JobSet")}


def _ttls(body: dict[str, Any]) -> list[Any]:
    """Every ttlSecondsAfterFinished of a Job or a JobSet (its own and its Job templates')."""
    found = [body["spec"].get("ttlSecondsAfterFinished")]
    for replicated in body["spec"].get("replicatedJobs", []):
        found.append(replicated["template"]["spec"].get("ttlSecondsAfterFinished"))
    return [ttl for ttl in found if ttl is not None]


def test_helm_owns_the_run_objects_and_an_upgrade_never_restarts_a_finished_run(helm: Helm, tmp_path: Path) -> None:
    """Helm recreates any object of the release manifest that is missing from the cluster, and
    cannot tell a Job the TTL controller deleted from one never created: a TTL on a Helm-owned
    Job means the next `helm upgrade` starts every shard pod (and the reducer) again. The chart's
    model (docs/kubernetes.md, "Who owns the Jobs"): Helm owns the run's Jobs (or its JobSet) for
    the life of the release, none has a TTL, `helm uninstall` removes them. Rendered as an install
    and as an upgrade: the same objects under the same names (Helm patches, never recreates),
    none able to delete itself; a new run.attempt is a new name, the one explicit rerun."""
    for values in (
        "testbed-smoke-values.yaml",
        "vllm-values.yaml",
        "default-values.yaml",
        "judge-values.yaml",
        "skills-values.yaml",
        "jobset-values.yaml",
    ):
        install = _run_objects(helm.render(CHART / "ci" / values))
        upgrade = _run_objects(
            parse_docs(
                helm.run(
                    "template", RELEASE, str(CHART), "--namespace", "evals", "--is-upgrade", "-f", str(CHART / "ci" / values)
                ).stdout
            )
        )
        assert install and install == upgrade, values
        assert not {name: _ttls(body) for name, body in install.items() if _ttls(body)}, (
            f"{values}: a Helm-owned run object with a TTL"
        )
        rerun = _run_objects(helm.render(CHART / "ci" / values, sets={"run.attempt": "2"}))
        assert not set(rerun) & set(install), f"{values}: run.attempt=2 must be new objects, not a patch of the old"
    proc = helm.template(CHART / "ci" / "default-values.yaml", sets={"job.ttlSecondsAfterFinished": "3600"}, check=False)
    assert proc.returncode != 0
    assert "job.ttlSecondsAfterFinished: Helm owns the run's Jobs" in proc.stderr and "helm uninstall" in proc.stderr, proc.stderr


def test_shard_index_reaches_the_worker_from_the_indexed_job(matrix: dict[str, list[Doc]]) -> None:
    for name, docs in matrix.items():
        job = only(docs, "Job", "job-worker.yaml")
        pod = job["spec"]["template"]["spec"]
        worker = container(pod, "worker")
        env = env_of(worker)
        # JOB_COMPLETION_INDEX is injected by the Job controller; an explicit value would pin
        # every pod to one shard.
        assert "JOB_COMPLETION_INDEX" not in env, name
        assert not any("shard-index" in a or "JOB_COMPLETION_INDEX" in a for a in worker["args"]), name
        first = {"judge-values.yaml": ["judge", "worker"], "skills-values.yaml": ["skills", "worker"]}
        assert worker["args"][:2] == first.get(name, ["worker", "--run"])
        assert env["SHOPSIMRL_SHARDS"]["value"] == str(job["spec"]["completions"]), name
        assert env["SHOPSIMRL_RUN"]["value"].startswith(("s3://", "/")), name
        assert env["SHOPSIMRL_CONFIG"]["value"].startswith("/app/configs/"), name
        assert env["SHOPSIMRL_LOG_FORMAT"]["value"] == "json"


def test_test_split_needs_the_explicit_final_test_flag(helm: Helm) -> None:
    def worker_args(**sets: str) -> list[str]:
        job = only(helm.render(CHART / "ci" / "default-values.yaml", sets=sets), "Job", "job-worker.yaml")
        return container(job["spec"]["template"]["spec"], "worker")["args"]

    assert "--final-test" not in worker_args()
    assert worker_args(**{"run.finalTest": "true", "config.tasks.split": "test"})[-1] == "--final-test"


def test_run_overrides_reach_the_readiness_check_and_every_worker(helm: Helm, tmp_path: Path) -> None:
    overrides = ["model.checkpoint_id=ckpt-200", "model.temperature=0.6"]
    values = tmp_path / "overrides.yaml"
    values.write_text(yaml.safe_dump({"run": {"overrides": overrides}}), encoding="utf-8")
    job = only(helm.render(CHART / "ci" / "testbed-smoke-values.yaml", values), "Job", "job-worker.yaml")
    pod = job["spec"]["template"]["spec"]
    expected = ["--set", overrides[0], "--set", overrides[1]]
    for args in (container(pod, "worker")["args"], pod["initContainers"][0]["args"]):
        start = args.index("--set")
        assert args[start : start + 4] == expected
    values.write_text(yaml.safe_dump({"run": {"overrides": ["checkpoint ckpt-200"]}}), encoding="utf-8")
    proc = helm.template(CHART / "ci" / "testbed-smoke-values.yaml", values, check=False)
    assert proc.returncode != 0 and "overrides" in proc.stderr


def test_readiness_init_container_is_bounded(matrix: dict[str, list[Doc]]) -> None:
    job = only(matrix["testbed-smoke-values.yaml"], "Job", "job-worker.yaml")
    pod = job["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]
    assert init["args"][0] == "wait-ready"
    assert init["args"][init["args"].index("--timeout") + 1] == "180"
    assert env_of(init)["SHOPSIMRL_MODEL_BASE_URL"] == env_of(container(pod, "worker"))["SHOPSIMRL_MODEL_BASE_URL"]


def _kubelet_probe(probe: dict[str, Any], base_url: str) -> bool:
    """One probe as the kubelet runs it, against a server on ``base_url``: httpGet succeeds on a
    status from 200 to 399 (the body is never read); exec succeeds on exit 0 (run here with this
    interpreter as the image's python3, the port swapped for the server's)."""
    import httpx

    if "httpGet" in probe:
        try:
            status = httpx.get(f"{base_url}{probe['httpGet']['path']}", timeout=probe.get("timeoutSeconds", 1)).status_code
        except httpx.HTTPError:
            return False
        return 200 <= status < 400
    command = list(probe["exec"]["command"])
    assert command[0] == "python3", command
    command[0] = sys.executable
    command[-1] = base_url.rsplit(":", 1)[1]
    return subprocess.run(command, capture_output=True, timeout=30).returncode == 0


def _shop_pod(docs: list[Doc], source: str) -> dict[str, Any]:
    return dict(only(docs, "Deployment", source)["spec"]["template"]["spec"]["containers"][0])


def test_shop_readiness_fails_while_the_shop_is_not_ready(helm: Helm) -> None:
    """The kubelet reads only the status of an HTTP probe. The testbed shop answers /healthz 503
    while not ready; the real ShopSimulator answers 200 with "ready": false while it builds its
    slot environments (shopsimulator_contract.md §1.8), so the chart's ShopSimulator probes read
    the body. Both probes are run against both behaviours: ready passes, not ready fails."""
    from shopsimrl.testbed.serving import running_server
    from shopsimrl.testbed.shop import create_app as create_shop_app
    from tests.shop_stub import Reply, ShopStub

    testbed = _shop_pod(helm.render(CHART / "ci" / "testbed-smoke-values.yaml"), "deployment-testbed-shop.yaml")
    sim_sets = {"shopsimulator.enabled": "true", "shopsimulator.image.repository": "s", "shopsimulator.image.tag": "v8"}
    sim = _shop_pod(helm.render(CHART / "ci" / "default-values.yaml", sets=sim_sets), "deployment-shopsimulator.yaml")
    base = yaml.safe_load((ROOT / "k8s" / "base" / "shopsimulator-deployment.yaml").read_text())
    shared = base["spec"]["template"]["spec"]["containers"][0]
    gates = {
        "testbed readiness": testbed["readinessProbe"],
        "shopsimulator startup": sim["startupProbe"],
        "shopsimulator readiness": sim["readinessProbe"],
        "k8s/base startup": shared["startupProbe"],
        "k8s/base readiness": shared["readinessProbe"],
    }
    app = create_shop_app()
    with running_server(app) as shop_url:
        assert all(_kubelet_probe(p, shop_url) for p in gates.values()), "a ready testbed shop fails a probe"
        app.state.shop.ready = False
        assert not [name for name, p in gates.items() if _kubelet_probe(p, shop_url)], "a not-ready testbed passes"
        # Liveness must not restart a shop that is merely not ready yet.
        assert _kubelet_probe(testbed["livenessProbe"], shop_url)
        # readyCheck status: an HTTP probe, for images without python3 that answer non-2xx.
        sim_sets["shopsimulator.readyCheck"] = "status"
        by_status = _shop_pod(helm.render(CHART / "ci" / "default-values.yaml", sets=sim_sets), "deployment-shopsimulator.yaml")
        assert by_status["readinessProbe"]["httpGet"]["path"] == "/healthz"
        assert not _kubelet_probe(by_status["readinessProbe"], shop_url)
        app.state.shop.ready = True
        assert _kubelet_probe(by_status["readinessProbe"], shop_url)
    # The real ShopSimulator's answer while it builds (the stub scripts it: one reply per probe).
    body_gates = {name: p for name, p in gates.items() if name != "testbed readiness"}
    stub = ShopStub()
    with running_server(stub.app) as stub_url:
        stub.script("healthz", *[Reply(patch={"ready": False}) for _ in body_gates])
        passed = [name for name, p in body_gates.items() if _kubelet_probe(p, stub_url)]
        assert passed == [], f"probes that take a 200 with ready: false for ready: {passed}"
        assert all(_kubelet_probe(p, stub_url) for p in body_gates.values())
    # The body check covers the ShopSimulator's whole start: the startup budget is unchanged.
    assert sim["startupProbe"]["periodSeconds"] * sim["startupProbe"]["failureThreshold"] >= 600


def test_wait_ready_sees_a_shop_that_is_not_ready_either_way(helm: Helm, tmp_path: Path) -> None:
    """The client side of the same readiness: the smoke release's wait-ready init container, run
    as the pod runs it, reports environment_not_ready (exit 3) for a testbed answering 503 and
    for a ShopSimulator answering 200 with "ready": false, and passes once ready."""
    from shopsimrl.testbed.policy import create_app as create_policy_app
    from shopsimrl.testbed.serving import running_server
    from shopsimrl.testbed.shop import create_app as create_shop_app
    from tests.shop_stub import Reply, ShopStub

    docs = helm.render(CHART / "ci" / "testbed-smoke-values.yaml", sets={"readiness.timeoutSeconds": "1"})
    pod = only(docs, "Job", "job-worker.yaml")["spec"]["template"]["spec"]
    config_path = _materialize_config(docs, tmp_path)
    shop_app, stub = create_shop_app(), ShopStub()
    with (
        running_server(create_policy_app()) as policy_url,
        running_server(shop_app) as shop_url,
        running_server(stub.app) as stub_url,
    ):

        def wait_ready(env_url: str) -> subprocess.CompletedProcess[str]:
            overrides = {
                "SHOPSIMRL_CONFIG": str(config_path),
                "SHOPSIMRL_MODEL_BASE_URL": f"{policy_url}/v1",
                "SHOPSIMRL_ENV_BASE_URL": env_url,
                "SHOPSIMRL_LOG_FORMAT": "console",
            }
            argv, env = _pod_command(container(pod, "wait-ready"), overrides)
            return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)

        assert wait_ready(shop_url).returncode == ExitCode.OK
        shop_app.state.shop.ready = False
        stub.script("healthz", Reply(patch={"ready": False}))
        for what, url in (("testbed (503)", shop_url), ("ShopSimulator (200)", stub_url)):
            result = wait_ready(url)
            assert result.returncode == ExitCode.RETRYABLE, (what, result.stderr)
            assert "environment_not_ready: /healthz says" in result.stderr and "'ready': False" in result.stderr, (
                what,
                result.stderr,
            )
        assert wait_ready(stub_url).returncode == ExitCode.OK


def test_readiness_init_container_gets_no_object_storage_settings(matrix: dict[str, list[Doc]]) -> None:
    """wait-ready only probes the model and the shop: S3 credentials there would be a secret
    handed to a container that never uses it. The worker and the reducer keep them."""
    for name, docs in matrix.items():
        pod = only(docs, "Job", "job-worker.yaml")["spec"]["template"]["spec"]
        if "initContainers" not in pod:
            continue
        readiness = env_of(container(pod, "wait-ready"))
        assert not [key for key in readiness if key.startswith("AWS_")], name
        worker = env_of(container(pod, "worker"))
        # The probe reads what the worker reads to reach the services: same URLs, key, extras.
        assert all(worker[key] == value for key, value in readiness.items()), name
        services = {
            "SHOPSIMRL_CONFIG",
            "SHOPSIMRL_MODEL_BASE_URL",
            "SHOPSIMRL_JUDGE_BASE_URL",
            "SHOPSIMRL_ANALYST_BASE_URL",
            "SHOPSIMRL_ENV_BASE_URL",
            "SHOPSIMRL_API_KEY",
        }
        assert services & set(worker) <= set(readiness), name
    s3 = only(matrix["s3-secret-values.yaml"], "Job", "job-worker.yaml")["spec"]["template"]["spec"]
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"} <= set(env_of(container(s3, "worker")))
    reducer = only(matrix["testbed-smoke-values.yaml"], "Job", "job-reducer.yaml")["spec"]["template"]["spec"]
    assert {"AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_ENDPOINT_URL"} <= set(env_of(container(reducer, "reducer")))


def test_fail_index_covers_every_container_that_reads_the_config(helm: Helm, matrix: dict[str, list[Doc]]) -> None:
    """wait-ready exits 2 on the same bad input as the worker; a rule names one container, and
    the API server refuses a containerName that is not in the pod template."""
    renders = {**matrix, "readiness off": helm.render(CHART / "ci" / "default-values.yaml", sets={"readiness.enabled": "false"})}
    for name, docs in renders.items():
        spec = only(docs, "Job", "job-worker.yaml")["spec"]
        pod = spec["template"]["spec"]
        containers = {c["name"] for c in [*pod.get("initContainers", []), *pod["containers"]]}
        named = {r["onExitCodes"]["containerName"] for r in spec["podFailurePolicy"]["rules"] if r["action"] == "FailIndex"}
        assert named == containers, name
        assert ("wait-ready" in named) is (name != "readiness off"), name


def test_reducer_ends_with_a_partial_summary_and_is_not_retried_once_it_wrote_one(matrix: dict[str, list[Doc]]) -> None:
    docs = matrix["vllm-values.yaml"]
    job = only(docs, "Job", "job-reducer.yaml")
    pod = job["spec"]["template"]["spec"]
    args = container(pod, "reducer")["args"]
    assert args[:3] == ["reduce", "$(SHOPSIMRL_RUN)", "--wait"] and "--partial-on-timeout" in args
    assert "--worker-job" not in args and pod["automountServiceAccountToken"] is False
    assert not [d for d in docs if d.kind in ("Role", "RoleBinding")]  # no API access unless asked
    rules = job["spec"]["podFailurePolicy"]["rules"]
    (fail_job,) = [r for r in rules if r["action"] == "FailJob"]
    assert fail_job["onExitCodes"] == {
        "containerName": "reducer",
        "operator": "In",
        "values": [ExitCode.EPISODES_FAILED, ExitCode.BAD_INPUT, ExitCode.FINGERPRINT_MISMATCH],
    }
    assert ExitCode.RETRYABLE not in fail_job["onExitCodes"]["values"]


def test_reducer_may_watch_its_worker_job_with_the_least_rights(helm: Helm, matrix: dict[str, list[Doc]]) -> None:
    docs = matrix["testbed-smoke-values.yaml"]
    worker_job = only(docs, "Job", "job-worker.yaml")
    reducer = only(docs, "Job", "job-reducer.yaml")["spec"]["template"]["spec"]
    args = container(reducer, "reducer")["args"]
    assert args[args.index("--worker-job") + 1] == worker_job["metadata"]["name"]
    assert args[args.index("--namespace") + 1] == "evals"
    assert reducer["automountServiceAccountToken"] is True  # the reducer only: workers never get a token
    # Reading the Job takes the Kubernetes client, which only the kube image has.
    assert container(reducer, "reducer")["image"] == "shopsimrl-kube:dev"
    assert container(worker_job["spec"]["template"]["spec"], "worker")["image"] == "shopsimrl:dev"
    no_image = helm.template(CHART / "ci" / "testbed-smoke-values.yaml", sets={"reducer.image.repository": ""}, check=False)
    assert no_image.returncode != 0
    assert (
        "reducer.watchWorkerJob needs the Kubernetes client" in no_image.stderr and "reducer.image.repository" in no_image.stderr
    )
    assert worker_job["spec"]["template"]["spec"]["automountServiceAccountToken"] is False
    role = only(docs, "Role")
    assert role["rules"] == [
        {"apiGroups": ["batch"], "resources": ["jobs"], "resourceNames": [worker_job["metadata"]["name"]], "verbs": ["get"]},
        {"apiGroups": [""], "resources": ["pods"], "verbs": ["list"]},
    ]
    binding = only(docs, "RoleBinding")
    assert binding["roleRef"] == {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": role["metadata"]["name"]}
    # Without the reducer there is nothing to grant.
    off = helm.render(CHART / "ci" / "testbed-smoke-values.yaml", sets={"reducer.enabled": "false"})
    assert not [d for d in off if d.kind in ("Role", "RoleBinding")]
    # Without the watch the reducer runs the worker image.
    unwatched = helm.render(
        CHART / "ci" / "testbed-smoke-values.yaml", sets={"reducer.watchWorkerJob": "false", "reducer.image.repository": ""}
    )
    assert (
        container(only(unwatched, "Job", "job-reducer.yaml")["spec"]["template"]["spec"], "reducer")["image"] == "shopsimrl:dev"
    )


def _service_account_of(pod: dict[str, Any]) -> str:
    return str(pod.get("serviceAccountName") or "default")


def test_only_the_reducer_runs_as_the_identity_that_may_read_the_job(helm: Helm) -> None:
    """The Role that may read the worker Job and list pods is bound to a ServiceAccount of the
    reducer alone: never the namespace's `default` (every pod without its own would hold the
    rights), never the workers' (an IRSA identity many pods share). That account mounts no
    token unless a pod asks, and only the reducer's pod asks."""
    irsa = {"worker.serviceAccountName": "evals-s3"}
    annotated = {"reducer.serviceAccount.annotations.eks\\.amazonaws\\.com/role-arn": "arn:aws:iam::1:role/reader"}
    for sets in ({}, irsa, {**irsa, **annotated}):
        docs = helm.render(CHART / "ci" / "testbed-smoke-values.yaml", sets=sets)
        validate_all((d.body for d in docs), f"reducer identity {sets}")
        (subject,) = only(docs, "RoleBinding")["subjects"]
        assert subject["kind"] == "ServiceAccount" and subject["name"] not in ("default", "evals-s3"), sets
        account = only(docs, "ServiceAccount")
        assert account["metadata"]["name"] == subject["name"] and account["automountServiceAccountToken"] is False
        pods = {d.source: d.body["spec"]["template"]["spec"] for d in docs if d.kind in ("Job", "Deployment")}
        assert _service_account_of(pods.pop("job-reducer.yaml")) == subject["name"]
        assert pods and all(_service_account_of(pod) != subject["name"] for pod in pods.values()), sets
        assert all(pod["automountServiceAccountToken"] is False for pod in pods.values())
        if annotated.keys() <= sets.keys():
            assert account["metadata"]["annotations"] == {"eks.amazonaws.com/role-arn": "arn:aws:iam::1:role/reader"}
    # An existing account instead of a created one: its own, not default, not the workers'.
    own = helm.render(
        CHART / "ci" / "testbed-smoke-values.yaml",
        sets={"reducer.serviceAccount.create": "false", "reducer.serviceAccount.name": "evals-reducer"},
    )
    assert not [d for d in own if d.kind == "ServiceAccount"]
    assert only(own, "RoleBinding")["subjects"][0]["name"] == "evals-reducer"
    for sets, message in (
        ({"reducer.serviceAccount.create": "false"}, "reducer.serviceAccount.name: empty"),
        ({"reducer.serviceAccount.create": "false", "reducer.serviceAccount.name": "default"}, "must not be default"),
        (
            {**irsa, "reducer.serviceAccount.create": "false", "reducer.serviceAccount.name": "evals-s3"},
            "must not be worker.serviceAccountName",
        ),
    ):
        proc = helm.template(CHART / "ci" / "testbed-smoke-values.yaml", sets=sets, check=False)
        assert proc.returncode != 0 and message in proc.stderr, proc.stderr
    # Without the watch the reducer needs no API identity: it runs as the workers do, no account.
    unwatched = helm.render(CHART / "ci" / "testbed-smoke-values.yaml", sets={**irsa, "reducer.watchWorkerJob": "false"})
    assert not [d for d in unwatched if d.kind in ("ServiceAccount", "Role", "RoleBinding")]
    assert only(unwatched, "Job", "job-reducer.yaml")["spec"]["template"]["spec"]["serviceAccountName"] == "evals-s3"


def test_pod_hardening(matrix: dict[str, list[Doc]]) -> None:
    for name, docs in matrix.items():
        for doc in docs:
            if doc.kind not in ("Job", "Deployment") or doc.source in ("deployment-vllm.yaml", "deployment-shopsimulator.yaml"):
                continue
            pod = doc.body["spec"]["template"]["spec"]
            assert pod["securityContext"]["runAsNonRoot"] is True, (name, doc.source)
            assert pod["securityContext"]["runAsUser"] == 10001
            assert pod["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
            watching = doc.source == "job-reducer.yaml" and "--worker-job" in pod["containers"][0]["args"]
            assert pod["automountServiceAccountToken"] is watching, (name, doc.source)
            mounts_tmp = {v["name"] for v in pod["volumes"] if "emptyDir" in v}
            assert "tmp" in mounts_tmp
            for c in [*pod.get("initContainers", []), *pod["containers"]]:
                sc = c["securityContext"]
                assert sc["readOnlyRootFilesystem"] is True, (name, c["name"])
                assert sc["allowPrivilegeEscalation"] is False
                assert sc["capabilities"] == {"drop": ["ALL"]}
                assert sc["seccompProfile"] == {"type": "RuntimeDefault"}
                assert any(m["mountPath"] == "/tmp" for m in c["volumeMounts"])
                assert c["resources"]["requests"] and c["resources"]["limits"]


def test_scheduling_and_queue_values_reach_the_pod(matrix: dict[str, list[Doc]]) -> None:
    job = only(matrix["external-services-values.yaml"], "Job", "job-worker.yaml")
    assert job["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "eval-queue"
    assert job["spec"]["parallelism"] == 4 and job["spec"]["maxFailedIndexes"] == 2
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeSelector"] == {"node-pool": "cpu-batch"}
    assert pod["tolerations"][0]["key"] == "batch"
    assert "podAntiAffinity" in pod["affinity"]
    assert pod["imagePullSecrets"] == [{"name": "registry-pull"}]
    assert container(pod, "worker")["image"] == "registry.example.com/ml/shopsimrl:0.5.0"
    assert env_of(container(pod, "worker"))["SHOPSIMRL_CONCURRENCY"]["value"] == "16"


def test_kueue_admits_the_reducer_through_the_same_queue(helm: Helm) -> None:
    """Under Kueue a Job without the queue label is held (manageJobsWithoutQueueName) or runs
    outside every quota: the reducer Job carries the worker Job's queue and is created suspended
    with it, for Kueue to admit."""
    for sets in ({"reducer.enabled": "true"}, {"reducer.enabled": "true", "job.suspend": "true"}):
        docs = helm.render(CHART / "ci" / "external-services-values.yaml", sets=sets)
        worker = only(docs, "Job", "job-worker.yaml")
        reducer = only(docs, "Job", "job-reducer.yaml")
        queue = "kueue.x-k8s.io/queue-name"
        assert reducer["metadata"]["labels"][queue] == worker["metadata"]["labels"][queue] == "eval-queue"
        assert reducer["spec"]["suspend"] == worker["spec"]["suspend"] == (sets.get("job.suspend") == "true")
        validate_all((d.body for d in docs), f"kueue {sets}")
    plain = only(helm.render(CHART / "ci" / "testbed-smoke-values.yaml"), "Job", "job-reducer.yaml")
    assert "kueue.x-k8s.io/queue-name" not in plain["metadata"]["labels"] and plain["spec"]["suspend"] is False


# --------------------------------------------------------------------------- names


def test_job_name_is_stable_and_changes_with_the_evaluation(helm: Helm) -> None:
    base = CHART / "ci" / "default-values.yaml"

    def job_name(**sets: str) -> str:
        return only(helm.render(base, sets=sets), "Job", "job-worker.yaml")["metadata"]["name"]

    first = job_name()
    assert first == job_name(), "same values must give the same Job"
    assert re.fullmatch(rf"{RELEASE}-[0-9a-f]{{8}}", first)
    changed = {
        job_name(**{"config.model.checkpoint_id": "ckpt-200"}),
        job_name(**{"run.attempt": "2"}),
        job_name(**{"job.shards": "4"}),
        job_name(**{"run.name": "other-run"}),
    }
    assert first not in changed and len(changed) == 4
    # Transport knobs do not make a new evaluation.
    assert job_name(**{"worker.concurrency": "4"}) == first


def test_long_names_stay_valid_dns_labels(helm: Helm) -> None:
    release = "eval-" + "x" * 48
    docs = helm.render(
        CHART / "ci" / "testbed-smoke-values.yaml", release=release, sets={"run.name": "Run_Name.With-" + "y" * 40}
    )
    job = only(docs, "Job", "job-worker.yaml")
    name = job["metadata"]["name"]
    # Pod hostnames are "<job>-<index>": keep room for a five-digit index.
    assert len(name) <= 52 and re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name)
    for doc in docs:
        assert len(doc.body["metadata"]["name"]) <= 63
    validate_all((d.body for d in docs), "long names")


# --------------------------------------------------------------------------- config


def test_config_map_mounts_the_config_beside_the_image_configs(matrix: dict[str, list[Doc]]) -> None:
    docs = matrix["default-values.yaml"]
    cm = only(docs, "ConfigMap")
    job = only(docs, "Job", "job-worker.yaml")
    assert cm["metadata"]["name"] == job["metadata"]["name"] + "-config"
    config = yaml.safe_load(cm["data"][f"{RELEASE}.yaml"])
    assert config["tasks"] == {"split_file": "splits/persona_splits.v1.json", "split": "val", "sample_size": None, "repeats": 1}
    # An explicit null is meaningful (no API key) and must survive Helm's value merging.
    assert "api_key_env" in config["model"] and config["model"]["api_key_env"] is None
    # Exactly the user's config: nothing merged in from chart defaults.
    given = yaml.safe_load((CHART / "ci" / "default-values.yaml").read_text())["config"]
    assert config == given
    worker = container(job["spec"]["template"]["spec"], "worker")
    (mount,) = [m for m in worker["volumeMounts"] if m["name"] == "config"]
    assert mount == {
        "name": "config",
        "mountPath": f"/app/configs/{RELEASE}.yaml",
        "subPath": f"{RELEASE}.yaml",
        "readOnly": True,
    }
    assert env_of(worker)["SHOPSIMRL_CONFIG"]["value"] == mount["mountPath"]


def test_config_string_is_kept_verbatim_and_inline_split_is_wired(matrix: dict[str, list[Doc]]) -> None:
    docs = matrix["external-services-values.yaml"]
    cm = only(docs, "ConfigMap")
    run_file = "ckpt-100_val.yaml"
    config = yaml.safe_load(cm["data"][run_file])
    # The inline split file replaces the image's, under the file name the config names (part of the
    # plan fingerprint); everything else is the user's config.
    assert config["tasks"]["split_file"] == "inline/split/persona_splits.v1.json"
    assert config["model"]["checkpoint_id"] == "qwen35-4b-grpo-step100"
    split = json.loads(cm["data"]["split.json"])
    assert split["splits"]["val"]["task_ids"] == [19, 20, 30]
    worker = container(only(docs, "Job", "job-worker.yaml")["spec"]["template"]["spec"], "worker")
    mounts = {m["mountPath"]: m for m in worker["volumeMounts"]}
    assert mounts["/app/configs/inline/split/persona_splits.v1.json"]["subPath"] == "split.json"
    assert mounts[f"/app/configs/{run_file}"]["subPath"] == run_file


@pytest.mark.parametrize("values", CI_VALUES, ids=lambda p: p.stem)
def test_rendered_config_loads_with_shopsimrl_as_the_pod_would(
    matrix: dict[str, list[Doc]], values: Path, tmp_path: Path
) -> None:
    """Lay the ConfigMap over a copy of the image's /app/configs and load it with shopsimrl."""
    from shopsimrl.config import load_experiment_config
    from shopsimrl.research.judge.config import load_judge_config, load_rubric
    from shopsimrl.tasks import load_task_split

    config_path = _materialize_config(matrix[values.name], tmp_path)
    if values.name == "judge-values.yaml":
        judge = load_judge_config(config_path)
        assert load_rubric(judge.resolve(judge.rubric)).version == "shopsimrl-judge-rubric-v1"
        return
    if values.name == "skills-values.yaml":
        from shopsimrl.research.skills.build import load_skills_config

        skills = load_skills_config(config_path)
        assert skills.analyst_model.name == "Qwen/Qwen3.5-27B" and skills.experiment.expected_trajectories == 400
        return
    config = load_experiment_config(config_path, load_dotenv=False)
    split = load_task_split(config.resolve(config.tasks.split_file), config.tasks.split)
    assert split.task_ids
    if config.prompt.system_prompt_file:
        assert config.resolve(config.prompt.system_prompt_file).is_file()
    if config.skills.path:  # an inline skills file: the provider reads it, as the worker will
        from shopsimrl.skills import open_skill_provider

        provider = open_skill_provider(config.resolve(config.skills.path)).identity()["provider"]
        assert provider in ("assigned_skills", "json_skillbank")


def _materialize_config(docs: list[Doc], root: Path) -> Path:
    """Copy the image's configs to ``root`` and lay the ConfigMap's mounts over them."""
    app_configs = root / "app" / "configs"
    shutil.copytree(ROOT / "configs", app_configs)
    worker = container(only(docs, "Job", "job-worker.yaml")["spec"]["template"]["spec"], "worker")
    cm = only(docs, "ConfigMap")
    for mount in worker["volumeMounts"]:
        if mount["name"] == "config":
            target = app_configs / Path(mount["mountPath"]).relative_to("/app/configs")
            target.parent.mkdir(parents=True, exist_ok=True)  # the kubelet creates a mount's directories
            target.write_text(cm["data"][mount["subPath"]])
    return app_configs / Path(env_of(worker)["SHOPSIMRL_CONFIG"]["value"]).relative_to("/app/configs")


def _pod_command(
    c: dict[str, Any], overrides: dict[str, str], extra: dict[str, str] | None = None
) -> tuple[list[str], dict[str, str]]:
    """The process a container of the rendered pod runs, with Kubernetes' $(VAR) expansion."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SHOPSIMRL_", "JOB_COMPLETION"))}
    for name, entry in env_of(c).items():
        # Secrets are referenced, never rendered: stand in for what the kubelet would inject.
        env[name] = entry.get("value", "testing")
    env.update(overrides)
    env.update(extra or {})
    args = [re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], a) for a in c["args"]]
    return [sys.executable, "-m", "shopsimrl", *args], env


@pytest.mark.slow
def test_rendered_smoke_pods_run_a_sharded_evaluation_end_to_end(matrix: dict[str, list[Doc]], tmp_path: Path) -> None:
    """Run the smoke release's containers as local processes: wait-ready, each shard, reducer.

    Services are the same testbed apps the chart deploys, S3 is a moto server standing in for
    MinIO; only the in-cluster URLs are swapped for loopback ones.
    """
    import s3fs
    from moto.server import ThreadedMotoServer

    from shopsimrl.testbed.policy import create_app as create_policy_app
    from shopsimrl.testbed.serving import running_server
    from shopsimrl.testbed.shop import create_app as create_shop_app

    docs = matrix["testbed-smoke-values.yaml"]
    job = only(docs, "Job", "job-worker.yaml")
    pod = job["spec"]["template"]["spec"]
    config_path = _materialize_config(docs, tmp_path)
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    moto.start()
    try:
        host, port = moto.get_host_and_port()
        s3_url = f"http://{host}:{port}"
        fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": s3_url}, use_listings_cache=False)
        fs.mkdir("shopsimrl")
        with running_server(create_shop_app()) as shop_url, running_server(create_policy_app()) as policy_url:
            overrides = {
                "SHOPSIMRL_CONFIG": str(config_path),
                "SHOPSIMRL_MODEL_BASE_URL": f"{policy_url}/v1",
                "SHOPSIMRL_ENV_BASE_URL": shop_url,
                "AWS_ENDPOINT_URL": s3_url,
                "SHOPSIMRL_LOG_FORMAT": "console",
            }
            argv, env = _pod_command(container(pod, "wait-ready"), overrides)
            ready = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
            assert ready.returncode == ExitCode.OK, ready.stderr

            shards = job["spec"]["completions"]
            workers = []
            for index in range(shards):
                argv, env = _pod_command(container(pod, "worker"), overrides, {"JOB_COMPLETION_INDEX": str(index)})
                workers.append(subprocess.Popen(argv, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
            for index, proc in enumerate(workers):
                out, _ = proc.communicate(timeout=300)
                assert proc.returncode == ExitCode.OK, f"shard {index}:\n{out[-3000:]}"

            reducer = only(docs, "Job", "job-reducer.yaml")["spec"]["template"]["spec"]["containers"][0]
            argv, env = _pod_command(reducer, overrides)
            reduced = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
            assert reduced.returncode == ExitCode.OK, reduced.stdout + reduced.stderr

        run_uri = env_of(container(pod, "worker"))["SHOPSIMRL_RUN"]["value"]
        assert run_uri == "s3://shopsimrl/runs/smoke"
        summary = json.loads(fs.cat(f"{run_uri}/summary.json"))
        assert summary["counts"]["requested"] == 8
        assert summary["counts"]["coverage"] == 1.0
        assert summary["shards"]["committed"] == shards
        assert fs.exists(f"{run_uri}/shards/00001/_SUCCESS.json")
    finally:
        moto.stop()


@pytest.mark.slow
def test_jobset_pods_reach_the_reducer_despite_failed_episodes(helm: Helm, tmp_path: Path) -> None:
    """The JobSet's containers as local processes (testbed apps, a moto S3), with a policy that
    in some conversations searches for what the shop answers HTTP 500 to, so some episodes fail
    as the agent's. Each worker commits its shard and exits 0 (the rendered
    --succeed-once-committed): the index succeeds, so the JobSet creates the reducer. Without
    the flag the same committed shard exits 1, the index would fail after its retries and the
    reducer would never exist. The reducer, run once, writes summary.json with the failures."""
    import s3fs
    from moto.server import ThreadedMotoServer

    from shopsimrl.testbed.policy import PolicySettings
    from shopsimrl.testbed.policy import create_app as create_policy_app
    from shopsimrl.testbed.serving import running_server
    from shopsimrl.testbed.shop import create_app as create_shop_app

    # moto keeps every server's buckets in this process: a bucket of this test's own, so that no
    # other test's run of the same plan is resumed here.
    bucket = f"jobset-{uuid.uuid4().hex[:12]}"
    sets = {
        "jobSet.enabled": "true",
        "reducer.watchWorkerJob": "false",
        "reducer.image.repository": "",
        "run.uri": f"s3://{bucket}/runs/smoke",
    }
    docs = helm.render(CHART / "ci" / "testbed-smoke-values.yaml", sets=sets)
    validate_all((d.body for d in docs), "jobset smoke")
    worker_pod = only(docs, "Job", "job-worker.yaml")["spec"]["template"]["spec"]
    reducer = container(only(docs, "Job", "job-reducer.yaml")["spec"]["template"]["spec"], "reducer")
    assert container(worker_pod, "worker")["args"][-1] == "--succeed-once-committed"
    config_path = _materialize_config(docs, tmp_path)
    policy = create_policy_app(PolicySettings(rate_server_crash=0.5, fault_seed=7))
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0)
    moto.start()
    try:
        host, port = moto.get_host_and_port()
        s3_url = f"http://{host}:{port}"
        fs = s3fs.S3FileSystem(key="testing", secret="testing", client_kwargs={"endpoint_url": s3_url}, use_listings_cache=False)
        fs.mkdir(bucket)
        with running_server(create_shop_app()) as shop_url, running_server(policy) as policy_url:
            overrides = {
                "SHOPSIMRL_CONFIG": str(config_path),
                "SHOPSIMRL_MODEL_BASE_URL": f"{policy_url}/v1",
                "SHOPSIMRL_ENV_BASE_URL": shop_url,
                "AWS_ENDPOINT_URL": s3_url,
                "SHOPSIMRL_LOG_FORMAT": "console",
            }
            worker = container(worker_pod, "worker")
            for index in range(2):
                argv, env = _pod_command(worker, overrides, {"JOB_COMPLETION_INDEX": str(index)})
                done = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
                assert done.returncode == ExitCode.OK, f"shard {index}:\n{done.stderr[-3000:]}"
            without_flag = {**worker, "args": [a for a in worker["args"] if a != "--succeed-once-committed"]}
            argv, env = _pod_command(without_flag, overrides, {"JOB_COMPLETION_INDEX": "0"})
            plain = [subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300).returncode]
            argv, env = _pod_command(without_flag, overrides, {"JOB_COMPLETION_INDEX": "1"})
            plain.append(subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300).returncode)
            assert ExitCode.EPISODES_FAILED in plain, "no shard had failed episodes: the policy's fault rate did nothing"
            argv, env = _pod_command(reducer, overrides)
            reduced = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=300)
        summary = json.loads(fs.cat(f"s3://{bucket}/runs/smoke/summary.json"))
        assert reduced.returncode == ExitCode.EPISODES_FAILED, reduced.stderr[-2000:]
        counts = summary["counts"]
        assert counts["requested"] == 8 and counts["failed"] > 0 and counts["completed"] + counts["failed"] == 8, counts
        assert summary["shards"]["committed"] == 2
    finally:
        moto.stop()


def test_repository_config_via_set_file(helm: Helm, tmp_path: Path) -> None:
    """The documented path: `--set-file config=configs/qwen35_4b_val.yaml`, verbatim, loadable."""
    from shopsimrl.config import load_experiment_config

    source = ROOT / "configs" / "qwen35_4b_val.yaml"
    proc = helm.run("template", RELEASE, str(CHART), "--set", "storage.baseUri=s3://b/evals", "--set-file", f"config={source}")
    docs = parse_docs(proc.stdout)
    assert only(docs, "ConfigMap")["data"][f"{RELEASE}.yaml"].strip() == source.read_text().strip()
    config = load_experiment_config(_materialize_config(docs, tmp_path), load_dotenv=False)
    assert config.model.name == "Qwen/Qwen3.5-4B"


def _pod_plan_fingerprint(docs: list[Doc], root: Path) -> str:
    """The plan fingerprint a worker pod computes from exactly the files the chart mounts."""
    from shopsimrl.config import load_experiment_config
    from shopsimrl.runner.experiment import prepare
    from shopsimrl.schemas import fingerprint

    config = load_experiment_config(_materialize_config(docs, root), load_dotenv=False)
    return fingerprint(prepare(config).plan())


def _local_plan_fingerprint(config_path: Path) -> str:
    from shopsimrl.config import load_experiment_config
    from shopsimrl.runner.experiment import prepare
    from shopsimrl.schemas import fingerprint

    return fingerprint(prepare(load_experiment_config(config_path, load_dotenv=False)).plan())


def test_inline_split_keeps_the_plan_fingerprint_of_the_local_freeze(helm: Helm, tmp_path: Path) -> None:
    """A release shipping the split inline plans exactly what `shopsimrl plan` plans locally from
    the same config and split: the split's file name (part of its identity) is kept."""
    source = ROOT / "configs" / "qwen35_4b_val.yaml"
    split = ROOT / "configs" / "splits" / "persona_splits.v1.json"
    proc = helm.run(
        "template",
        RELEASE,
        str(CHART),
        "--set",
        "storage.baseUri=s3://b/evals",
        "--set-file",
        f"config={source}",
        "--set-file",
        f"run.inlineSplitFile={split}",
    )
    docs = parse_docs(proc.stdout)
    assert validate_all((d.body for d in docs), "inline split") == len(docs)
    cm = only(docs, "ConfigMap")
    assert yaml.safe_load(cm["data"][f"{RELEASE}.yaml"])["tasks"]["split_file"] == "inline/split/persona_splits.v1.json"
    # The image's own copy of the split is gone from the pod's view: only the inline one can be read.
    (tmp_path / "pod").mkdir()
    assert _pod_plan_fingerprint(docs, tmp_path / "pod") == _local_plan_fingerprint(source)


def test_inline_skills_file_is_mounted_under_the_name_the_config_gives(helm: Helm, tmp_path: Path) -> None:
    bank = {
        "schema_version": "shopsimrl-skillbank-v1",
        "bank_version": "b1",
        "skills": [{"skill_id": "s1", "content": "对照用户要求选规格。"}],
    }
    config = yaml.safe_load((ROOT / "configs" / "qwen35_4b_val.yaml").read_text())
    config["skills"] = {"path": "../banks/my_bank.json", "max_skills": None}
    (tmp_path / "banks").mkdir()
    (tmp_path / "banks" / "my_bank.json").write_text(json.dumps(bank, ensure_ascii=False))
    local = tmp_path / "configs" / "local.yaml"
    local.parent.mkdir()
    shutil.copytree(ROOT / "configs" / "prompts", tmp_path / "configs" / "prompts")
    shutil.copytree(ROOT / "configs" / "splits", tmp_path / "configs" / "splits")
    local.write_text(yaml.safe_dump(config, allow_unicode=True))
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "config": config,
                "storage": {"baseUri": "s3://b/r"},
                "run": {"inlineSkillsFile": json.dumps(bank, ensure_ascii=False)},
            },
            allow_unicode=True,
        )
    )
    docs = helm.render(values)
    assert validate_all((d.body for d in docs), "inline skills") == len(docs)
    cm = only(docs, "ConfigMap")
    assert yaml.safe_load(cm["data"][f"{RELEASE}.yaml"])["skills"]["path"] == "inline/skills/my_bank.json"
    worker = container(only(docs, "Job", "job-worker.yaml")["spec"]["template"]["spec"], "worker")
    mounts = {m["mountPath"]: m for m in worker["volumeMounts"]}
    assert mounts["/app/configs/inline/skills/my_bank.json"]["subPath"] == "skills.json"
    (tmp_path / "pod").mkdir()
    assert _pod_plan_fingerprint(docs, tmp_path / "pod") == _local_plan_fingerprint(local)

    config["skills"] = {"path": None}
    values.write_text(
        yaml.safe_dump({"config": config, "storage": {"baseUri": "s3://b/r"}, "run": {"inlineSkillsFile": {"a": 1}}})
    )
    proc = helm.template(values, check=False)
    assert proc.returncode != 0 and "run.inlineSkillsFile needs config.skills.path" in proc.stderr


def test_config_map_over_one_mebibyte_fails_the_render_naming_the_values(helm: Helm, tmp_path: Path) -> None:
    config = yaml.safe_load((ROOT / "configs" / "qwen35_4b_val.yaml").read_text())
    config["skills"] = {"path": "bank.json"}
    big = json.dumps({"schema_version": "shopsimrl-skillbank-v1", "skills": [], "padding": "x" * (1024 * 1024)})
    values = tmp_path / "values.yaml"
    values.write_text(yaml.safe_dump({"config": config, "storage": {"baseUri": "s3://b/r"}, "run": {"inlineSkillsFile": big}}))
    proc = helm.template(values, check=False)
    assert proc.returncode != 0
    assert "over Kubernetes' 1 MiB (1048576 bytes) limit" in proc.stderr and "skills.json 1048" in proc.stderr
    # Just under the limit renders, and the API server's count (keys + values) stays within it.
    fitting = big[: len(big) - 20_000]
    values.write_text(
        yaml.safe_dump({"config": config, "storage": {"baseUri": "s3://b/r"}, "run": {"inlineSkillsFile": fitting}})
    )
    cm = only(helm.render(values), "ConfigMap")
    assert sum(len(k.encode()) + len(v.encode()) for k, v in cm["data"].items()) <= 1024 * 1024


def test_config_string_without_rewrite_keeps_comments(helm: Helm, tmp_path: Path) -> None:
    text = "# checkpoint 7\ntasks: {split: val, split_file: splits/persona_splits.v1.json}\nmodel: {top_p: 1.0}\n"
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"config": text, "storage": {"baseUri": "s3://b/r"}}))
    cm = only(helm.render(path), "ConfigMap")
    assert cm["data"][f"{RELEASE}.yaml"] == text


def test_invalid_config_yaml_fails_with_a_clear_message(helm: Helm, tmp_path: Path) -> None:
    path = tmp_path / "values.yaml"
    path.write_text(yaml.safe_dump({"config": "tasks: [\n", "storage": {"baseUri": "s3://b/r"}}))
    proc = helm.template(path, check=False)
    assert proc.returncode != 0 and "config: not valid YAML" in proc.stderr


# --------------------------------------------------------------------------- secrets


def test_secrets_only_by_reference(helm: Helm, matrix: dict[str, list[Doc]]) -> None:
    docs = matrix["s3-secret-values.yaml"]
    assert not [d for d in docs if d.kind == "Secret"], "the chart must not create Secrets"
    pod = only(docs, "Job", "job-worker.yaml")["spec"]["template"]["spec"]
    for c in (container(pod, "worker"), container(pod, "wait-ready")):
        env = env_of(c)
        refs = {"SHOPSIMRL_API_KEY": ("shopsimrl-model", "api-key")}
        if c["name"] == "worker":
            refs |= {
                "AWS_ACCESS_KEY_ID": ("shopsimrl-s3", "AWS_ACCESS_KEY_ID"),
                "AWS_SECRET_ACCESS_KEY": ("shopsimrl-s3", "AWS_SECRET_ACCESS_KEY"),
            }
            assert env["AWS_ENDPOINT_URL"]["value"] == "https://s3.example.internal"
            assert env["AWS_DEFAULT_REGION"]["value"] == "eu-central-1"
        for name, (secret, key) in refs.items():
            assert "value" not in env[name], name
            assert env[name]["valueFrom"] == {"secretKeyRef": {"name": secret, "key": key}}
    # The config names the variable when the values do not.
    ext = only(matrix["external-services-values.yaml"], "Job", "job-worker.yaml")["spec"]["template"]["spec"]
    assert env_of(container(ext, "worker"))["SHOPSIMRL_MODEL_API_KEY"]["valueFrom"]["secretKeyRef"] == {
        "name": "model-api-key",
        "key": "token",
    }


@pytest.mark.parametrize(
    "key",
    [
        "model.apiKey.value",
        "model.apiKey.apiKey",
        "storage.credentials.secretAccessKey",
        "storage.credentials.accessKeyId",
        "vllm.hfToken.token",
        "storage.secretAccessKey",
    ],
)
def test_no_value_can_carry_a_secret_inline(helm: Helm, key: str) -> None:
    proc = helm.template(CHART / "ci" / "s3-secret-values.yaml", set_strings={key: SENTINEL}, check=False)
    assert proc.returncode != 0
    assert "Additional property" in proc.stderr
    assert SENTINEL not in proc.stdout


def test_sentinel_never_appears_in_any_render(matrix: dict[str, list[Doc]]) -> None:
    # The harness runs Helm with AWS_SECRET_ACCESS_KEY / OPENAI_API_KEY set to the sentinel.
    for name, docs in matrix.items():
        assert SENTINEL not in yaml.safe_dump_all([d.body for d in docs]), name


def _values_file(tmp_path: Path, base: Path, name: str = "values.yaml", **overrides: Any) -> Path:
    """``base`` with ``overrides`` deep-merged in (dotted keys), written to ``tmp_path``."""
    data = yaml.safe_load(base.read_text())
    for dotted, value in overrides.items():
        node = data
        *parents, last = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[last] = value
    path = tmp_path / name
    path.write_text(yaml.safe_dump(data, allow_unicode=True))
    return path


_CREDENTIAL_URL = f"https://evals:{SENTINEL}@host.example.internal"


@pytest.mark.parametrize(
    ("base", "key", "value"),
    [
        ("default-values.yaml", "model.baseUrl", f"{_CREDENTIAL_URL}/v1"),
        ("default-values.yaml", "environment.baseUrl", _CREDENTIAL_URL),
        ("default-values.yaml", "storage.endpointUrl", _CREDENTIAL_URL),
        ("default-values.yaml", "storage.baseUri", f"s3://evals:{SENTINEL}@bucket/runs"),
        ("default-values.yaml", "run.uri", f"s3://evals:{SENTINEL}@bucket/runs/x"),
        ("default-values.yaml", "config.model.base_url", f"{_CREDENTIAL_URL}/v1"),
        ("default-values.yaml", "config.environment.base_url", _CREDENTIAL_URL),
        ("judge-values.yaml", "config.source", f"s3://evals:{SENTINEL}@shopsimrl/runs/testbed-val"),
        ("vllm-values.yaml", "vllm.extraArgs", ["--download-dir", f"{_CREDENTIAL_URL}/weights"]),
    ],
    ids=lambda v: v if isinstance(v, str) and "://" not in v and not v.endswith(".yaml") else "",
)
def test_a_url_with_credentials_fails_the_render_naming_the_value(
    helm: Helm, tmp_path: Path, base: str, key: str, value: Any
) -> None:
    """The CLI refuses user:password@ in a URL (exit 2); the chart must not have rendered it into
    env vars, the run-URI annotation or the ConfigMap first. The message names the value and
    never repeats the password."""
    proc = helm.template(_values_file(tmp_path, CHART / "ci" / base, **{key: value}), check=False)
    assert proc.returncode != 0, f"{key} with credentials rendered"
    shown = key if key != "vllm.extraArgs" else "vllm.extraArgs[1]"
    assert f"{shown}: a URL with user:password@ credentials" in proc.stderr, proc.stderr
    assert SENTINEL not in proc.stderr + proc.stdout


@pytest.mark.parametrize(
    ("entry", "named"),
    [
        ({"name": "OPENAI_API_KEY", "value": SENTINEL}, "worker.extraEnv[1] (OPENAI_API_KEY)"),
        ({"name": "HF_TOKEN", "value": SENTINEL}, "worker.extraEnv[1] (HF_TOKEN)"),
        ({"name": "DB_PASSWORD", "value": SENTINEL}, "worker.extraEnv[1] (DB_PASSWORD)"),
        (
            {"name": "AWS_SECRET_ACCESS_KEY", "valueFrom": {"configMapKeyRef": {"name": "plain", "key": "k"}}},
            "worker.extraEnv[1] (AWS_SECRET_ACCESS_KEY)",
        ),
        ({"name": "HTTPS_PROXY", "value": f"http://me:{SENTINEL}@proxy:3128"}, "worker.extraEnv[1] (HTTPS_PROXY)"),
    ],
    ids=["api-key", "token", "password", "secret-by-configmap", "proxy-credentials"],
)
def test_a_literal_secret_in_extra_env_fails_the_render(helm: Helm, tmp_path: Path, entry: dict[str, Any], named: str) -> None:
    base = CHART / "ci" / "s3-secret-values.yaml"
    extra = [*yaml.safe_load(base.read_text())["worker"]["extraEnv"][:1], entry]
    proc = helm.template(_values_file(tmp_path, base, **{"worker.extraEnv": extra}), check=False)
    assert proc.returncode != 0, f"{entry['name']} rendered as a literal"
    assert named in proc.stderr and "secretKeyRef" in proc.stderr, proc.stderr
    assert SENTINEL not in proc.stderr + proc.stdout
    # The same rule for the ShopSimulator the chart deploys.
    sets = {"shopsimulator.enabled": True, "shopsimulator.image": {"repository": "s", "tag": "v8", "pullPolicy": "IfNotPresent"}}
    proc = helm.template(_values_file(tmp_path, base, "sim.yaml", **sets, **{"shopsimulator.env": [entry]}), check=False)
    assert proc.returncode != 0 and f"shopsimulator.env[0] ({entry['name']})" in proc.stderr, proc.stderr


def test_plain_urls_and_references_still_render(helm: Helm, matrix: dict[str, list[Doc]]) -> None:
    """The control: the ci/ values (a proxy URL without credentials, a token by secretKeyRef,
    a non-secret literal) render, and an '@' in a path is not userinfo."""
    env = env_of(container(only(matrix["s3-secret-values.yaml"], "Job", "job-worker.yaml")["spec"]["template"]["spec"], "worker"))
    assert env["HTTPS_PROXY"]["value"] == "http://proxy.example.internal:3128"
    assert env["EXTRA_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "extra", "key": "token"}
    docs = helm.render(CHART / "ci" / "default-values.yaml", set_strings={"run.uri": "s3://bucket/runs/ckpt@step100"})
    assert (
        only(docs, "Job", "job-worker.yaml")["metadata"]["annotations"]["shopsimrl.io/run-uri"] == "s3://bucket/runs/ckpt@step100"
    )


# --------------------------------------------------------------------------- values schema


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        ({"job.shards": "-1"}, "job.shards: Must be greater than or equal to 1"),
        ({"job.shards": "0"}, "job.shards: Must be greater than or equal to 1"),
        ({"job.parallelism": "many"}, "job.parallelism: Invalid type"),
        ({"worker.imag.repository": "x"}, "worker: Additional property imag is not allowed"),
        ({"bogus": "1"}, "Additional property bogus is not allowed"),
        ({"worker.logFormat": "xml"}, "worker.logFormat: worker.logFormat must be one of"),
        ({"run.name": "bad/name"}, "run.name: Does not match pattern"),
        ({"worker.resources.requests.cpu": "lots"}, "worker.resources.requests.cpu: Does not match pattern"),
        ({"job.failIndexExitCodes[0]": "300"}, "Must be less than or equal to 255"),
        ({"readiness.enabled": "maybe"}, "readiness.enabled: Invalid type"),
        ({"storage.endpointUrl": "minio:9000"}, "storage.endpointUrl: Does not match pattern"),
        ({"networkPolicy.dns.port": "70000"}, "networkPolicy.dns.port: Must be less than or equal to 65535"),
    ],
)
def test_schema_rejects_bad_values(helm: Helm, sets: dict[str, str], message: str) -> None:
    proc = helm.template(CHART / "ci" / "default-values.yaml", sets=sets, check=False)
    assert proc.returncode != 0
    assert "values don't meet the specifications of the schema" in proc.stderr
    assert message in proc.stderr, proc.stderr


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        ({"testbed.enabled": "true", "vllm.enabled": "true"}, "testbed.enabled replaces the model"),
        ({"job.parallelism": "9"}, "job.parallelism (9) exceeds job.shards (8)"),
        ({"job.maxFailedIndexes": "9"}, "job.maxFailedIndexes (9) exceeds job.shards (8)"),
        ({"shopsimulator.enabled": "true"}, "shopsimulator.enabled needs shopsimulator.image.repository"),
        # default-values: 8 shards, config concurrency 32
        (
            {"environment.slots": "64"},
            "8 worker pods at once × concurrency 32 = 256 episodes in flight exceed the 64 "
            "ShopSimulator slots (environment.slots)",
        ),
        ({"environment.slots": "64", "worker.concurrency": "16"}, "8 worker pods at once × concurrency 16 = 128"),
        (
            {"environment.slots": "256", "worker.processes": "2"},
            "8 worker pods at once × 2 processes × concurrency 32 = 512 episodes in flight exceed the 256",
        ),
        (
            {
                "shopsimulator.enabled": "true",
                "shopsimulator.image.repository": "s",
                "shopsimulator.image.tag": "v8",
                "shopsimulator.slots": "100",
            },
            "= 256 episodes in flight exceed the 100 ShopSimulator slots (shopsimulator.slots)",
        ),
        (
            {"testbed.enabled": "true", "testbed.shop.slots": "20", "job.parallelism": "2"},
            "2 worker pods at once × concurrency 32 = 64 episodes in flight exceed the 20 ShopSimulator slots (testbed.shop.slots)",
        ),
        (
            {
                "shopsimulator.enabled": "true",
                "shopsimulator.image.repository": "s",
                "shopsimulator.image.tag": "v8",
                "shopsimulator.env[0].name": "SHOPSIM_ENV_SLOTS",
                "shopsimulator.env[0].value": "nine",
            },
            "shopsimulator.env sets SHOPSIM_ENV_SLOTS; set shopsimulator.slots instead",
        ),
    ],
)
def test_inconsistent_values_fail_with_the_keys_named(helm: Helm, sets: dict[str, str], message: str) -> None:
    proc = helm.template(CHART / "ci" / "default-values.yaml", sets=sets, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_slots_that_fit_render_and_reach_the_shop_and_the_workers(helm: Helm) -> None:
    sets = {"environment.slots": "256", "job.parallelism": "4", "worker.concurrency": "64"}  # 4 × 64 = 256: fits
    docs = helm.render(CHART / "ci" / "default-values.yaml", sets=sets)
    pod = only(docs, "Job", "job-worker.yaml")["spec"]["template"]["spec"]
    for container in (*pod["initContainers"], *pod["containers"]):
        env = {e["name"]: e.get("value") for e in container["env"]}
        assert env["SHOPSIMRL_PARALLELISM"] == "4" and env["SHOPSIMRL_SHARDS"] == "8"
    assert "--no-require-free-slot" in pod["initContainers"][0]["args"]  # see the template's comment
    testbed = helm.render(CHART / "ci" / "testbed-smoke-values.yaml")
    shop = only(testbed, "Deployment", "deployment-testbed-shop.yaml")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "SHOPSIM_ENV_SLOTS", "value": "256"} in shop["env"]
    sets = {"shopsimulator.enabled": "true", "shopsimulator.image.repository": "s", "shopsimulator.image.tag": "v8"}
    real = helm.render(CHART / "ci" / "default-values.yaml", sets=sets)
    container = only(real, "Deployment", "deployment-shopsimulator.yaml")["spec"]["template"]["spec"]["containers"][0]
    assert container["env"][0] == {"name": "SHOPSIM_ENV_SLOTS", "value": "256"}


def test_the_shipped_manifests_and_docs_agree_on_slots() -> None:
    """k8s/base sizes ShopSimulator for the documented example evaluation."""
    base = yaml.safe_load((ROOT / "k8s/base/shopsimulator-deployment.yaml").read_text())
    env = base["spec"]["template"]["spec"]["containers"][0]["env"]
    slots = int(next(e["value"] for e in env if e["name"] == "SHOPSIM_ENV_SLOTS"))
    docs = (ROOT / "docs/kubernetes.md").read_text()
    example = yaml.safe_load(
        docs.split("A minimal `my-values.yaml` for the shared services:")[1].split("```yaml")[1].split("```")[0]
    )
    in_flight = example["job"]["shards"] * example["config"]["experiment"]["concurrency"]
    assert in_flight <= slots == example["environment"]["slots"]


def _values_tree() -> dict[str, Any]:
    return yaml.safe_load((CHART / "values.yaml").read_text())


def _schema() -> dict[str, Any]:
    return json.loads((CHART / "values.schema.json").read_text())


def _resolve(schema: dict[str, Any], node: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        node = schema["definitions"][node["$ref"].rsplit("/", 1)[1]]
    return node


def test_schema_and_values_describe_the_same_keys() -> None:
    schema = _schema()
    missing: list[str] = []

    def walk(values: dict[str, Any], node: dict[str, Any], path: str) -> None:
        node = _resolve(schema, node)
        assert node.get("additionalProperties") is False, f"{path or 'root'}: additionalProperties must be false"
        props = node["properties"]
        missing.extend(f"{path}{k} (in values.yaml, not in the schema)" for k in values if k not in props)
        missing.extend(
            f"{path}{k} (in the schema, not in values.yaml)"
            for k in props
            if k not in values and not (path == "" and k == "global")
        )
        for key, value in values.items():
            if key not in props:
                continue
            child = _resolve(schema, props[key])
            assert "description" in props[key] or "description" in child, f"{path}{key}: no description"
            if isinstance(value, dict) and child.get("properties") and key != "config":
                walk(value, child, f"{path}{key}.")

    walk(_values_tree(), schema, "")
    assert not missing, missing


def test_every_values_key_has_a_doc_comment() -> None:
    """Each leaf key carries a `# --` comment, or sits under a key that has one."""
    undocumented = []
    stack: list[tuple[int, str, bool]] = []
    comment = False
    in_config = False
    for line in (CHART / "values.yaml").read_text().splitlines():
        stripped = line.strip()
        if stripped.startswith("# --"):
            comment = True
            continue
        if not stripped or stripped.startswith(("#", "- ")):
            continue
        match = re.match(r"^(\s*)([A-Za-z0-9_.\-/]+):(.*)$", line)
        if not match:
            continue
        indent, key, rest = len(match.group(1)), match.group(2), match.group(3).strip()
        while stack and stack[-1][0] >= indent:
            stack.pop()
        if indent == 0:
            in_config = key == "config"
        documented = comment or any(doc for _, _, doc in stack)
        stack.append((indent, key, documented))
        comment = False
        is_leaf = rest != ""
        if is_leaf and not documented and not in_config:
            undocumented.append(".".join(k for _, k, _ in stack))
    assert not undocumented, undocumented


# --------------------------------------------------------------------------- optional components


def test_defaults_render_only_the_config_and_the_worker_job(matrix: dict[str, list[Doc]]) -> None:
    assert {d.source for d in matrix["default-values.yaml"]} == ALWAYS


@pytest.mark.parametrize("flag", sorted(OPTIONAL_TEMPLATES))
def test_optional_component_renders_only_when_enabled(helm: Helm, flag: str) -> None:
    values = [CHART / "ci" / "default-values.yaml"]
    extra = {"shopsimulator.image.repository": "shopsim", "shopsimulator.image.tag": "v8"}
    off = {d.source for d in helm.render(*values, sets={flag: "false", **extra})}
    on_docs = helm.render(*values, sets={flag: "true", **extra})
    on = {d.source for d in on_docs}
    assert off == ALWAYS, "disabled must render nothing"
    assert on == ALWAYS | OPTIONAL_TEMPLATES[flag]
    validate_all((d.body for d in on_docs), flag)


def test_testbed_mode_points_the_workers_at_its_services(matrix: dict[str, list[Doc]]) -> None:
    docs = matrix["testbed-smoke-values.yaml"]
    services = {d.body["metadata"]["name"]: d.body for d in docs if d.kind == "Service"}
    deployments = {d.body["metadata"]["name"]: d.body for d in docs if d.kind == "Deployment"}
    env = env_of(container(only(docs, "Job", "job-worker.yaml")["spec"]["template"]["spec"], "worker"))
    model = re.fullmatch(r"http://([a-z0-9-]+):(\d+)/v1", env["SHOPSIMRL_MODEL_BASE_URL"]["value"])
    shop = re.fullmatch(r"http://([a-z0-9-]+):(\d+)", env["SHOPSIMRL_ENV_BASE_URL"]["value"])
    assert model and shop
    for match, command in ((model, "policy"), (shop, "shop")):
        svc = services[match.group(1)]
        assert svc["spec"]["ports"][0]["port"] == int(match.group(2))
        (deploy,) = [d for d in deployments.values() if d["spec"]["selector"]["matchLabels"] == svc["spec"]["selector"]]
        c = deploy["spec"]["template"]["spec"]["containers"][0]
        assert c["args"][:2] == ["testbed", command]
        # The testbed's own image (docker/testbed.Dockerfile), with the worker image's tag.
        assert c["image"] == "shopsimrl-testbed:dev" and c["imagePullPolicy"] == "Never"
        assert c["ports"][0]["containerPort"] == int(match.group(2))
    # The testbed serves model id shopsim-heuristic: the smoke config must ask for it.
    cm = only(docs, "ConfigMap")
    assert yaml.safe_load(cm["data"]["smoke.yaml"])["model"]["name"] == "shopsim-heuristic"
    assert env["AWS_ENDPOINT_URL"]["value"] == "http://minio:9000"
    reducer = only(docs, "Job", "job-reducer.yaml")
    args = reducer["spec"]["template"]["spec"]["containers"][0]["args"]
    assert args[:4] == ["reduce", "$(SHOPSIMRL_RUN)", "--wait", "--timeout"]


def test_vllm_component(matrix: dict[str, list[Doc]]) -> None:
    docs = matrix["vllm-values.yaml"]
    deploy = only(docs, "Deployment", "deployment-vllm.yaml")
    pod = deploy["spec"]["template"]["spec"]
    c = pod["containers"][0]
    assert c["resources"]["requests"]["nvidia.com/gpu"] == 1 == c["resources"]["limits"]["nvidia.com/gpu"]
    assert c["startupProbe"]["httpGet"]["path"] == "/v1/models"
    assert c["startupProbe"]["periodSeconds"] * c["startupProbe"]["failureThreshold"] == 600
    assert c["readinessProbe"]["httpGet"]["path"] == "/v1/models"
    served = [a.split("=", 1)[1] for a in c["args"] if a.startswith("--served-model-name=")]
    cm = only(docs, "ConfigMap")
    config = yaml.safe_load(cm["data"][f"{RELEASE}.yaml"])
    assert served == [config["model"]["name"]], "the worker's model name must be the one vLLM lists"
    assert "--max-num-seqs=32" in c["args"] and "--enable-prefix-caching" in c["args"]
    assert env_of(c)["HF_TOKEN"]["valueFrom"]["secretKeyRef"] == {"name": "hf-token", "key": "token"}
    assert {"name": "cache", "persistentVolumeClaim": {"claimName": "hf-cache"}} in pod["volumes"]
    svc = only(docs, "Service", "service-vllm.yaml")
    worker_env = env_of(container(only(docs, "Job", "job-worker.yaml")["spec"]["template"]["spec"], "worker"))
    assert worker_env["SHOPSIMRL_MODEL_BASE_URL"]["value"] == f"http://{svc['metadata']['name']}:8000/v1"
    sim = only(docs, "Service", "service-shopsimulator.yaml")
    assert worker_env["SHOPSIMRL_ENV_BASE_URL"]["value"] == f"http://{sim['metadata']['name']}:5700"


def test_a_node_drain_does_not_evict_the_model_or_the_shop_mid_run(helm: Helm, matrix: dict[str, list[Doc]]) -> None:
    """A PodDisruptionBudget for the release's vLLM and ShopSimulator, selecting exactly their
    pods: no voluntary eviction of a single replica (a drain waits), one at a time when vLLM has
    replicas to spare; off on request. The shared services of k8s/base get the same."""
    docs = matrix["vllm-values.yaml"]
    budgets = {d.source: d.body for d in docs if d.kind == "PodDisruptionBudget"}
    assert set(budgets) == {"pdb-vllm.yaml", "pdb-shopsimulator.yaml"}
    for source, budget in budgets.items():
        deploy = only(docs, "Deployment", source.replace("pdb-", "deployment-"))
        assert budget["spec"]["selector"] == {"matchLabels": deploy["spec"]["selector"]["matchLabels"]}
        assert all(
            deploy["spec"]["template"]["metadata"]["labels"][k] == v for k, v in budget["spec"]["selector"]["matchLabels"].items()
        )
        assert budget["spec"]["maxUnavailable"] == 0 and deploy["spec"]["replicas"] == 1, source
    spare = helm.render(CHART / "ci" / "vllm-values.yaml", sets={"vllm.replicas": "3"})
    assert only(spare, "Deployment", "deployment-vllm.yaml")["spec"]["replicas"] == 3
    assert only(spare, "PodDisruptionBudget", "pdb-vllm.yaml")["spec"]["maxUnavailable"] == 1
    assert only(spare, "PodDisruptionBudget", "pdb-shopsimulator.yaml")["spec"]["maxUnavailable"] == 0
    validate_all((d.body for d in spare), "vllm replicas 3")
    off = helm.render(
        CHART / "ci" / "vllm-values.yaml",
        sets={"vllm.podDisruptionBudget.enabled": "false", "shopsimulator.podDisruptionBudget.enabled": "false"},
    )
    assert not [d for d in off if d.kind == "PodDisruptionBudget"]
    proc = subprocess.run(
        [str(helm.kubectl), "kustomize", str(ROOT / "k8s" / "base")], capture_output=True, text=True, timeout=120, env=helm.env
    )
    shared = [d for d in yaml.safe_load_all(proc.stdout) if d]
    for name in ("vllm", "shopsimulator"):
        deploy = next(d for d in shared if d["kind"] == "Deployment" and d["metadata"]["name"] == name)
        (budget,) = [d for d in shared if d["kind"] == "PodDisruptionBudget" and d["metadata"]["name"] == name]
        assert budget["spec"] == {"maxUnavailable": 0, "selector": {"matchLabels": deploy["spec"]["selector"]["matchLabels"]}}


def test_network_policy_allows_only_what_the_worker_needs(matrix: dict[str, list[Doc]]) -> None:
    docs = matrix["networkpolicy-values.yaml"]
    policy = only(docs, "NetworkPolicy")["spec"]
    assert policy["policyTypes"] == ["Ingress", "Egress"] and "ingress" not in policy
    egress = policy["egress"]
    assert all(rule.get("to") for rule in egress), "a rule without `to` would allow any destination"
    dns = egress[0]
    assert {p["port"] for p in dns["ports"]} == {53} and {p["protocol"] for p in dns["ports"]} == {"UDP", "TCP"}
    components = {
        r["to"][0]["podSelector"]["matchLabels"].get("app.kubernetes.io/component")
        for r in egress[1:]
        if "podSelector" in r["to"][0] and "namespaceSelector" not in r["to"][0]
    }
    assert components == {"testbed-policy", "testbed-shop"}
    storage = egress[-1]
    assert {"ipBlock": {"cidr": "52.95.0.0/16"}} in storage["to"]
    assert {p["port"] for p in storage["ports"]} == {443, 9000}
    selected = policy["podSelector"]["matchExpressions"][0]
    assert selected["values"] == ["worker", "reducer"]
    worker_labels = only(docs, "Job", "job-worker.yaml")["spec"]["template"]["metadata"]["labels"]
    assert worker_labels["app.kubernetes.io/component"] == "worker"
    assert all(worker_labels[k] == v for k, v in policy["podSelector"]["matchLabels"].items())


def _chart_copy(tmp_path: Path, name: str, **chart_fields: str) -> Path:
    """A copy of the chart with Chart.yaml fields replaced (a version bump)."""
    chart = tmp_path / name / "shopsimrl"
    shutil.copytree(CHART, chart)
    meta = yaml.safe_load((chart / "Chart.yaml").read_text())
    meta.update(chart_fields)
    (chart / "Chart.yaml").write_text(yaml.safe_dump(meta))
    return chart


def _render_chart(helm: Helm, chart: Path, *values: Path, extra: tuple[str, ...] = ()) -> list[Doc]:
    args = ["template", RELEASE, str(chart), "--namespace", "evals", *extra]
    for path in values:
        args += ["-f", str(path)]
    return parse_docs(helm.run(*args).stdout)


def test_a_chart_bump_rolls_no_pod_and_the_shop_never_runs_twice(helm: Helm, tmp_path: Path) -> None:
    """ShopSimulator keeps its leases in one process: a rolling update would run a second shop,
    with its own pool, behind the same Service while the first still serves (releases land on
    the wrong pod, slots count twice). Its Deployment (and the testbed shop's) must be Recreate,
    and no pod template may carry a label that changes with the chart version: a chart bump
    must not roll the shop, nor try to patch the immutable pod template of an existing Job."""
    sim_values = tmp_path / "sim.yaml"
    sim_values.write_text(yaml.safe_dump({"shopsimulator": {"enabled": True, "image": {"repository": "s", "tag": "v8"}}}))
    renders = {
        "testbed": [CHART / "ci" / "testbed-smoke-values.yaml"],
        "vllm+shopsimulator": [CHART / "ci" / "vllm-values.yaml"],
        "shopsimulator": [CHART / "ci" / "default-values.yaml", sim_values],
    }
    bumped = _chart_copy(tmp_path, "bumped", version="9.9.9", appVersion="9.9.9")
    for name, values in renders.items():
        # Images are pinned in these values (or default to the chart's appVersion only where the
        # tag is empty): pin the worker tag so that an appVersion bump changes no image.
        pinned = tmp_path / f"{name}-pin.yaml"
        pinned.write_text(yaml.safe_dump({"worker": {"image": {"tag": "0.5.0"}}}))
        before = _render_chart(helm, CHART, *values, pinned)
        after = _render_chart(helm, bumped, *values, pinned, extra=("--is-upgrade",))
        templates = {
            (d.kind, d.body["metadata"]["name"]): d.body["spec"]["template"] for d in before if d.kind in ("Deployment", "Job")
        }
        assert templates, name
        for doc in after:
            key = (doc.kind, doc.body["metadata"]["name"])
            if key in templates:
                assert doc.body["spec"]["template"] == templates.pop(key), f"{name}: a chart bump changes {key}'s pod template"
        assert not templates, f"{name}: objects renamed by a chart bump: {sorted(templates)}"
        assert any(d.body["metadata"]["labels"]["helm.sh/chart"] == "shopsimrl-9.9.9" for d in after)  # the bump is real
        for doc in before:
            if doc.source in ("deployment-shopsimulator.yaml", "deployment-testbed-shop.yaml", "deployment-vllm.yaml"):
                assert doc.body["spec"]["strategy"] == {"type": "Recreate"}, (name, doc.source)
                assert doc.body["spec"]["replicas"] == 1
    base = yaml.safe_load((ROOT / "k8s" / "base" / "shopsimulator-deployment.yaml").read_text())
    assert base["spec"]["replicas"] == 1 and base["spec"]["strategy"] == {"type": "Recreate"}


def _cluster_urls(text: str) -> list[str]:
    """In-cluster Service URLs in a text: http(s)://<name>.<namespace>.svc…"""
    return re.findall(r"https?://[a-z0-9<>-]+\.[a-z0-9<>-]+\.svc[^\s`'\")]*", text)


def test_in_cluster_names_resolve_in_one_lookup(helm: Helm, matrix: dict[str, list[Doc]]) -> None:
    """Kubernetes' resolv.conf has ndots:5: a name with fewer dots walks the search list first
    (<name>.<ns>.svc.cluster.local, svc.cluster.local, cluster.local, the node's domains), an
    NXDOMAIN pair per entry on every new connection. The docs, values and k8s/ name shared
    Services fully qualified, and the chart's pods resolve with an ndots those names reach, so
    they are asked for as they are; in-release Services stay short (the first search entry)."""
    texts = {
        path.relative_to(ROOT).as_posix(): path.read_text()
        for path in [
            ROOT / "docs" / "kubernetes.md",
            CHART / "values.yaml",
            *CHART.glob("ci/*.yaml"),
            *(ROOT / "k8s").rglob("*.yaml"),
        ]
    }
    urls = {name: _cluster_urls(text) for name, text in texts.items()}
    assert urls["docs/kubernetes.md"], "the docs name no in-cluster URL"
    short = {name: [u for u in found if ".svc.cluster.local" not in u] for name, found in urls.items()}
    assert not {k: v for k, v in short.items() if v}, "in-cluster URLs that walk the search list"
    example = yaml.safe_load(
        texts["docs/kubernetes.md"]
        .split("A minimal `my-values.yaml` for the shared services:")[1]
        .split("```yaml")[1]
        .split("```")[0]
    )
    example["config"]["tasks"]["split_file"] = "splits/persona_splits.v1.json"
    path = CHART / "ci" / "default-values.yaml"
    docs = helm.render(
        path, sets={"model.baseUrl": example["model"]["baseUrl"], "environment.baseUrl": example["environment"]["baseUrl"]}
    )
    for source in ("job-worker.yaml", "job-reducer.yaml"):
        rendered = helm.render(path, sets={"reducer.enabled": "true"}) if source == "job-reducer.yaml" else docs
        pod = only(rendered, "Job", source)["spec"]["template"]["spec"]
        (ndots,) = [int(o["value"]) for o in pod["dnsConfig"]["options"] if o["name"] == "ndots"]
        for url in (example["model"]["baseUrl"], example["environment"]["baseUrl"], "https://s3.eu-central-1.amazonaws.com"):
            host = re.sub(r"^https?://([^:/]+).*$", r"\1", url)
            assert host.count(".") >= ndots, f"{host} would walk the search list under ndots:{ndots}"
        # ... and a short in-release Service name still gets the search list (it needs it).
        assert ndots >= 1
    env = env_of(container(only(docs, "Job", "job-worker.yaml")["spec"]["template"]["spec"], "worker"))
    assert env["SHOPSIMRL_MODEL_BASE_URL"]["value"] == "http://vllm.shopsimrl.svc.cluster.local:8000/v1"
    validate_all((d.body for d in docs), "dnsConfig")
    cluster_default = helm.render(path, sets={"worker.dnsConfig": "null"})
    assert "dnsConfig" not in only(cluster_default, "Job", "job-worker.yaml")["spec"]["template"]["spec"]


def test_network_policy_names_extra_dns_peers(helm: Helm) -> None:
    """NodeLocal DNSCache answers on a link-local address on each node, not from kube-dns pods:
    the policy must let the workers reach it, or every lookup times out."""
    local = {"ipBlock": {"cidr": "169.254.20.10/32"}}
    path = CHART / "ci" / "networkpolicy-values.yaml"
    args = ("--set-json", f"networkPolicy.dns.extraPeers={json.dumps([local])}")
    docs = parse_docs(helm.run("template", RELEASE, str(CHART), "--namespace", "evals", "-f", str(path), *args).stdout)
    dns = only(docs, "NetworkPolicy")["spec"]["egress"][0]
    assert local in dns["to"] and any("podSelector" in peer for peer in dns["to"])
    assert {(p["protocol"], p["port"]) for p in dns["ports"]} == {("UDP", 53), ("TCP", 53)}
    validate_all((d.body for d in docs), "dns extra peers")


def test_labels_come_from_the_helpers(matrix: dict[str, list[Doc]]) -> None:
    for docs in matrix.values():
        for doc in docs:
            labels = doc.body["metadata"]["labels"]
            for key in (
                "app.kubernetes.io/name",
                "app.kubernetes.io/instance",
                "app.kubernetes.io/component",
                "app.kubernetes.io/managed-by",
                "app.kubernetes.io/part-of",
                "helm.sh/chart",
            ):
                assert key in labels, (doc.source, key)


def render_notes(helm: Helm, tmp_path: Path, *sets: str) -> str:
    # `helm install --dry-run` needs a cluster; render NOTES.txt through the same engine from a
    # copy of the chart that exposes it as a manifest.
    chart = tmp_path / "shopsimrl"
    if not chart.exists():
        shutil.copytree(CHART, chart)
        shutil.copy(chart / "templates" / "NOTES.txt", chart / "notes.txt")
        (chart / "templates" / "notes-preview.yaml").write_text('notes: {{ tpl (.Files.Get "notes.txt") . | toJson }}\n')
    proc = helm.run(
        "template",
        RELEASE,
        str(chart),
        "-f",
        str(CHART / "ci" / "default-values.yaml"),
        "--namespace",
        "evals",
        "--show-only",
        "templates/notes-preview.yaml",
        *[arg for pair in sets for arg in ("--set", pair)],
    )
    return str(yaml.safe_load(proc.stdout)["notes"])


def test_notes_tell_how_to_follow_and_reduce(helm: Helm, tmp_path: Path) -> None:
    notes = render_notes(helm, tmp_path)
    run = f"s3://shopsimrl-evals/runs/{RELEASE}"
    assert f"shopsimrl status {run} --namespace evals --release {RELEASE}" in notes
    assert f"make reduce RUN={run}" in notes
    assert f"shopsimrl reduce {run} --wait" in notes
    assert "--set run.attempt=2" in notes
    job = only(helm.render(CHART / "ci" / "default-values.yaml"), "Job", "job-worker.yaml")
    assert f"get job {job['metadata']['name']}" in notes


def test_a_rerun_removes_the_old_job_before_its_replacement_writes(helm: Helm, tmp_path: Path) -> None:
    """podReplacementPolicy: Failed keeps one writer per shard within one Job. A run.attempt bump
    makes a new Job while Helm deletes the old one in the background: the old pods may write for
    up to their grace period beside the new ones (safe for the store, whose part names carry the
    writer and whose writes are create-only, but the lease journal assumes one live worker per
    shard). The notes remove the old Job with foreground cascade (it is gone only once its pods
    are) before the upgrade, and the docs say exactly that."""
    notes = render_notes(helm, tmp_path)
    job = only(helm.render(CHART / "ci" / "default-values.yaml"), "Job", "job-worker.yaml")["metadata"]["name"]
    delete = notes.index(f"kubectl -n evals delete job {job} --cascade=foreground --wait")
    upgrade = notes.index("--set run.attempt=2")
    assert delete < upgrade
    docs = (ROOT / "docs" / "kubernetes.md").read_text()
    assert "never has two writers" not in docs
    assert "--cascade=foreground" in docs and "terminationGracePeriodSeconds" in docs
    comment = (CHART / "templates" / "job-worker.yaml").read_text()
    assert "one writer per shard at a time." not in comment


@pytest.mark.parametrize(("shards", "retries", "streams"), [(2, 0, 2), (8, 2, 24), (16, 2, 48), (400, 1, 800)])
def test_notes_follow_every_worker_pod_the_job_can_create(
    helm: Helm, tmp_path: Path, shards: int, retries: int, streams: int
) -> None:
    """`kubectl logs -l … -f` refuses to follow more pods than --max-log-requests (default 5):
    the notes ask for one stream per shard and retry, from the values, never a fixed number."""
    notes = render_notes(helm, tmp_path, f"job.shards={shards}", f"job.backoffLimitPerIndex={retries}")
    (follow,) = [line.strip() for line in notes.splitlines() if " logs -l " in line]
    assert follow.endswith(f" -f --prefix --max-log-requests {streams}"), follow
    assert "app.kubernetes.io/component=worker" in follow


# --------------------------------------------------------------------------- k8s/ kustomizations


@pytest.mark.parametrize("overlay", ["base", "overlays/dev", "overlays/prod", "overlays/smoke"])
def test_kustomizations_render_valid_manifests(helm: Helm, overlay: str) -> None:
    proc = subprocess.run(
        [str(helm.kubectl), "kustomize", str(ROOT / "k8s" / overlay)], capture_output=True, text=True, timeout=120, env=helm.env
    )
    assert proc.returncode == 0, proc.stderr
    docs = [d for d in yaml.safe_load_all(proc.stdout) if d]
    assert validate_all(iter(docs), overlay) == len(docs) > 0
    kinds = {(d["kind"], d["metadata"]["name"]) for d in docs}
    if overlay != "overlays/smoke":
        assert ("Deployment", "vllm") in kinds and ("Service", "shopsimulator") in kinds
        vllm = next(d for d in docs if d["kind"] == "Deployment" and d["metadata"]["name"] == "vllm")
        c = vllm["spec"]["template"]["spec"]["containers"][0]
        assert "Qwen/Qwen3.5-4B" in c["args"]
        assert c["readinessProbe"]["httpGet"]["path"] == "/v1/models"
        assert c["resources"]["limits"]["nvidia.com/gpu"] == 1
    if overlay in ("overlays/dev", "overlays/smoke"):
        assert ("Deployment", "minio") in kinds and ("Secret", "minio-credentials") in kinds
        # The chart's smoke values read these keys from this Secret.
        secret = next(d for d in docs if d["kind"] == "Secret")
        smoke = yaml.safe_load((CHART / "ci" / "testbed-smoke-values.yaml").read_text())
        creds = smoke["storage"]["credentials"]
        assert {creds["accessKeyIdKey"], creds["secretAccessKeyKey"]} <= set(secret["data"])
    if overlay == "overlays/prod":
        assert ("PersistentVolumeClaim", "hf-cache") in kinds
        assert not any(k == "minio" for _, k in kinds)


# --------------------------------------------------------------------------- JobSet


def test_jobset_runs_the_workers_then_the_reducer_as_one_object(helm: Helm, matrix: dict[str, list[Doc]]) -> None:
    """jobSet.enabled: one JobSet (valid against JobSet v0.9.1's CRD) holding the plain path's
    worker Job and, created only once that Job is Complete, the reducer Job, which then reduces
    at once instead of polling. One object for Kueue (the queue label is on the JobSet, not on
    the Jobs it creates), no second Job, no Role, no TTL."""
    docs = matrix["jobset-values.yaml"]
    assert {d.kind for d in docs} == {"ConfigMap", "JobSet"}
    jobset = only(docs, "JobSet")
    assert validate_all(iter([jobset]), "jobset") == 1
    spec = jobset["spec"]
    assert [r["name"] for r in spec["replicatedJobs"]] == ["worker", "reducer"]
    assert all(r.get("replicas", 1) == 1 for r in spec["replicatedJobs"])
    assert spec["replicatedJobs"][1]["dependsOn"] == [{"name": "worker", "status": "Complete"}]
    assert spec["failurePolicy"] == {"maxRestarts": 0} and spec["network"] == {"enableDNSHostnames": False}
    assert jobset["metadata"]["labels"]["kueue.x-k8s.io/queue-name"] == "eval-queue" and spec["suspend"] is False
    assert not _ttls(jobset)
    # The same worker Job as the plain path, with one flag: a shard committed with failed
    # episodes exits 0, or the JobSet would never create the reducer.
    plain = helm.render(CHART / "ci" / "jobset-values.yaml", sets={"jobSet.enabled": "false"})
    plain_worker, plain_reducer = only(plain, "Job", "job-worker.yaml"), only(plain, "Job", "job-reducer.yaml")
    worker, reducer = only(docs, "Job", "job-worker.yaml"), only(docs, "Job", "job-reducer.yaml")
    expected = {k: v for k, v in plain_worker["spec"].items() if k != "suspend"}
    container(expected["template"]["spec"], "worker")["args"].append("--succeed-once-committed")
    assert worker["spec"] == expected
    assert container(reducer["spec"]["template"]["spec"], "reducer")["args"] == ["reduce", "$(SHOPSIMRL_RUN)"]
    assert {k: v for k, v in reducer["spec"].items() if k not in ("suspend", "template")} == {
        k: v for k, v in plain_reducer["spec"].items() if k not in ("suspend", "template")
    }
    for job in (worker, reducer):
        labels = job["metadata"]["labels"]
        assert "kueue.x-k8s.io/queue-name" not in labels, "a child Job with a queue would be a second workload"
        assert job["metadata"]["annotations"]["shopsimrl.io/run-uri"] == "s3://shopsimrl-evals/runs/ckpt-300-val"
    # `shopsimrl status --release` lists the worker Jobs by these labels.
    from shopsimrl.runner.kube import release_selector

    wanted = dict(pair.split("=") for pair in release_selector(RELEASE).split(","))
    assert wanted.items() <= worker["metadata"]["labels"].items()
    assert not (wanted.items() <= reducer["metadata"]["labels"].items())


def test_jobset_names_fit_and_a_chart_bump_leaves_its_jobs_alone(helm: Helm, tmp_path: Path) -> None:
    """JobSet names pods <jobset>-worker-0-<index>-<5 random> and its webhook refuses a name that
    would make any of them longer than 63 characters or not a DNS-1035 label; its replicated
    Jobs are immutable, so a chart bump must not change them."""
    release = "eval-" + "x" * 48
    for shards in ("1", "10", "400", "100000"):
        docs = helm.render(
            CHART / "ci" / "jobset-values.yaml",
            release=release,
            sets={"job.shards": shards, "run.name": "Run_Name.With-" + "y" * 40, "environment.slots": "null"},
        )
        jobset = only(docs, "JobSet")
        validate_jobset(jobset, f"{shards} shards")
        assert jobset["metadata"]["name"].endswith("-" + only(docs, "ConfigMap")["metadata"]["name"].split("-")[-2])
    proc = helm.template(CHART / "ci" / "jobset-values.yaml", release="7-eval", sets={"run.name": "7run"}, check=False)
    assert proc.returncode != 0 and "must start with a letter" in proc.stderr, proc.stderr
    bumped = _chart_copy(tmp_path, "bumped", version="9.9.9", appVersion="9.9.9")
    pin = tmp_path / "pin.yaml"
    pin.write_text(yaml.safe_dump({"worker": {"image": {"tag": "0.5.0"}}}))
    before = only(_render_chart(helm, CHART, CHART / "ci" / "jobset-values.yaml", pin), "JobSet")
    after = only(_render_chart(helm, bumped, CHART / "ci" / "jobset-values.yaml", pin, extra=("--is-upgrade",)), "JobSet")
    assert after["metadata"]["labels"]["helm.sh/chart"] == "shopsimrl-9.9.9"
    assert after["metadata"]["name"] == before["metadata"]["name"] and after["spec"] == before["spec"]


@pytest.mark.parametrize(
    ("sets", "message"),
    [
        ({"reducer.watchWorkerJob": "true", "reducer.image.repository": "shopsimrl-kube"}, "reducer.watchWorkerJob has no use"),
        ({"mode": "judge"}, "jobSet.enabled runs rollouts only"),
    ],
)
def test_jobset_refuses_what_it_cannot_run(helm: Helm, sets: dict[str, str], message: str) -> None:
    values = CHART / "ci" / ("judge-values.yaml" if sets.get("mode") == "judge" else "jobset-values.yaml")
    proc = helm.template(values, sets={**sets, "jobSet.enabled": "true"}, check=False)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr


def test_notes_of_a_jobset_release_name_the_jobset(helm: Helm, tmp_path: Path) -> None:
    notes = render_notes(helm, tmp_path, "jobSet.enabled=true", "reducer.enabled=true")
    jobset = only(helm.render(CHART / "ci" / "default-values.yaml", sets={"jobSet.enabled": "true"}), "JobSet")["metadata"][
        "name"
    ]
    assert f"get jobset {jobset}" in notes and f"get job {jobset}-worker-0 -o wide" in notes
    assert notes.index(f"delete jobset {jobset} --cascade=foreground --wait") < notes.index("--set run.attempt=2")


# --------------------------------------------------------------------------- judge mode


def test_judge_mode_runs_the_judge_stage_in_the_same_jobs(matrix: dict[str, list[Doc]]) -> None:
    docs = matrix["judge-values.yaml"]
    job = only(docs, "Job", "job-worker.yaml")
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 4
    pod = job["spec"]["template"]["spec"]
    (init,) = pod["initContainers"]  # the judge model only: a judge pod never calls the shop
    assert init["args"][:3] == ["judge", "wait-ready", "$(SHOPSIMRL_CONFIG)"] and init["args"][3] == "--timeout"
    assert "SHOPSIMRL_JUDGE_BASE_URL" in env_of(init) and "SHOPSIMRL_ENV_BASE_URL" not in env_of(init)
    worker = container(pod, "worker")
    assert worker["args"] == ["judge", "worker", "$(SHOPSIMRL_CONFIG)", "--out", "$(SHOPSIMRL_RUN)"]
    env = env_of(worker)
    assert env["SHOPSIMRL_RUN"]["value"] == "s3://shopsimrl/judge/testbed-val"
    assert (
        env["SHOPSIMRL_JUDGE_BASE_URL"]["value"].endswith(":8000/v1")
        and "testbed-policy" in env["SHOPSIMRL_JUDGE_BASE_URL"]["value"]
    )
    assert "SHOPSIMRL_MODEL_BASE_URL" not in env and "SHOPSIMRL_ENV_BASE_URL" not in env
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "minio-credentials"
    reducer = container(only(docs, "Job", "job-reducer.yaml")["spec"]["template"]["spec"], "reducer")
    assert reducer["args"][:5] == ["judge", "reduce", "$(SHOPSIMRL_RUN)", "--wait", "--timeout"]
    config = yaml.safe_load(only(docs, "ConfigMap")["data"]["testbed-val-judge.yaml"])
    assert config["source"] == "s3://shopsimrl/runs/testbed-val" and config["model"]["model"] == "shopsim-judge"


def test_judge_release_init_container_waits_for_the_judge_model(helm: Helm, tmp_path: Path) -> None:
    """The judge release's wait-ready container run as the pod runs it, against the testbed's
    policy server (which serves the judge model): ready while the model is served, exit 3 naming
    the last probe once it is gone."""
    from shopsimrl.testbed.policy import create_app as create_policy_app
    from shopsimrl.testbed.serving import running_server

    docs = helm.render(CHART / "ci" / "judge-values.yaml", sets={"readiness.timeoutSeconds": "1"})
    pod = only(docs, "Job", "job-worker.yaml")["spec"]["template"]["spec"]
    config_path = _materialize_config(docs, tmp_path)
    with running_server(create_policy_app()) as policy_url:
        overrides = {"SHOPSIMRL_CONFIG": str(config_path), "SHOPSIMRL_JUDGE_BASE_URL": f"{policy_url}/v1"}
        argv, env = _pod_command(container(pod, "wait-ready"), overrides)
        ready = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert ready.returncode == ExitCode.OK, ready.stderr
    assert ready.stdout.startswith("ready: 'shopsim-judge' is served at")
    gone = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)
    assert gone.returncode == ExitCode.RETRYABLE, gone.stderr
    assert "the judge model is not ready after 1 s: model_unreachable" in gone.stderr


def test_judge_mode_config_is_checked_by_schema_and_template(helm: Helm, tmp_path: Path) -> None:
    values = CHART / "ci" / "judge-values.yaml"
    data = yaml.safe_load(values.read_text())
    del data["config"]["source"]
    broken = tmp_path / "no-source.yaml"
    broken.write_text(yaml.safe_dump(data))
    proc = helm.template(broken, check=False)
    assert proc.returncode != 0 and "source" in proc.stderr
    as_string = tmp_path / "string.yaml"
    as_string.write_text(
        yaml.safe_dump(
            {
                **data,
                "config": yaml.safe_dump({k: v for k, v in data["config"].items() if k != "rubric"} | {"source": "s3://b/r"}),
            }
        )
    )
    proc = helm.template(as_string, check=False)
    assert proc.returncode != 0 and "config.rubric: missing; in judge mode" in proc.stderr
    proc = helm.template(values, sets={"mode": "grade"}, check=False)
    assert proc.returncode != 0 and "mode" in proc.stderr
    # An experiment config in judge mode lacks the judge's keys; a judge config in rollout mode lacks tasks.
    proc = helm.template(CHART / "ci" / "default-values.yaml", sets={"mode": "judge"}, check=False)
    assert proc.returncode != 0 and "source" in proc.stderr
    proc = helm.template(values, sets={"mode": "rollout"}, check=False)
    assert proc.returncode != 0 and "tasks" in proc.stderr
    # A judge reads frozen traces: inline split or skill files have no place in its release.
    for key in ("inlineSplitFile", "inlineSkillsFile"):
        proc = helm.template(values, set_strings={f"run.{key}": "x.json"}, check=False)
        assert proc.returncode != 0 and f"run.{key}: a judge reads frozen traces" in proc.stderr, proc.stderr


# --------------------------------------------------------------------------- skills mode


def test_skills_mode_runs_the_per_trajectory_analysts_in_the_same_jobs(matrix: dict[str, list[Doc]]) -> None:
    docs = matrix["skills-values.yaml"]
    job = only(docs, "Job", "job-worker.yaml")
    assert job["spec"]["completionMode"] == "Indexed" and job["spec"]["completions"] == 4
    pod = job["spec"]["template"]["spec"]
    worker = container(pod, "worker")
    assert worker["args"] == ["skills", "worker", "$(SHOPSIMRL_CONFIG)", "--run", "$(SHOPSIMRL_RUN)"]
    env = env_of(worker)
    assert env["SHOPSIMRL_RUN"]["value"] == "s3://shopsimrl/skills/qwen35-4b-initial"
    assert env["SHOPSIMRL_ANALYST_BASE_URL"]["value"] == "http://analyst.models.svc.cluster.local:8001/v1"
    assert "SHOPSIMRL_MODEL_BASE_URL" not in env
    # The failure analyst's shop, as a rollout worker gets it: environment.baseUrl here.
    assert env["SHOPSIMRL_ENV_BASE_URL"]["value"] == "http://shopsimulator.shopsimrl.svc.cluster.local:5700"
    # The analyst's key: the variable the config's analyst_model names, from the Secret.
    assert env["ANALYST_API_KEY"]["valueFrom"]["secretKeyRef"] == {"name": "analyst-key", "key": "api-key"}
    assert env["AWS_SECRET_ACCESS_KEY"]["valueFrom"]["secretKeyRef"]["name"] == "minio-credentials"
    reducer = container(only(docs, "Job", "job-reducer.yaml")["spec"]["template"]["spec"], "reducer")
    assert reducer["args"][:5] == ["skills", "reduce", "$(SHOPSIMRL_RUN)", "--wait", "--timeout"]
    config = yaml.safe_load(only(docs, "ConfigMap")["data"]["qwen35-4b-initial-skills.yaml"])
    assert config["analyst_model"]["name"] == "Qwen/Qwen3.5-27B" and config["experiment"]["expected_trajectories"] == 400


def test_skills_pods_wait_for_the_analyst_and_the_shop_unless_readiness_is_off(helm: Helm, matrix: dict[str, list[Doc]]) -> None:
    """readiness.enabled: `skills wait-ready` as the init container, reading what the worker
    reads, with its own FailIndex rule (it exits 2 on the same bad config); off: none. Both
    renders are valid Kubernetes objects."""
    values = CHART / "ci" / "skills-values.yaml"
    renders = {"on": matrix["skills-values.yaml"], "off": helm.render(values, sets={"readiness.enabled": "false"})}
    for name, docs in renders.items():
        assert validate_all((d.body for d in docs), f"skills, readiness {name}") == len(docs)
    on = only(renders["on"], "Job", "job-worker.yaml")["spec"]
    (init,) = on["template"]["spec"]["initContainers"]
    assert init["name"] == "wait-ready"
    assert init["args"] == ["skills", "wait-ready", "$(SHOPSIMRL_CONFIG)", "--timeout", "600"]
    worker = env_of(container(on["template"]["spec"], "worker"))
    readiness = env_of(init)
    for key in ("SHOPSIMRL_CONFIG", "SHOPSIMRL_ANALYST_BASE_URL", "SHOPSIMRL_ENV_BASE_URL", "ANALYST_API_KEY"):
        assert readiness[key] == worker[key], key
    fail_index = [r["onExitCodes"] for r in on["podFailurePolicy"]["rules"] if r["action"] == "FailIndex"]
    assert [r["containerName"] for r in fail_index] == ["wait-ready", "worker"]
    assert all(r["values"] == [ExitCode.BAD_INPUT, ExitCode.FINGERPRINT_MISMATCH] for r in fail_index)
    off = only(renders["off"], "Job", "job-worker.yaml")["spec"]
    assert "initContainers" not in off["template"]["spec"]
    assert [r["onExitCodes"]["containerName"] for r in off["podFailurePolicy"]["rules"] if "onExitCodes" in r] == ["worker"]


def test_the_rendered_skills_wait_ready_runs_against_real_servers(helm: Helm, tmp_path: Path) -> None:
    """The skills release's init container as the pod runs it, against the analyst stub and the
    testbed shop over real HTTP: ready, then exit 3 naming the reason while the analyst model is
    not listed or the shop is not ready."""
    from shopsimrl.testbed.serving import running_server
    from shopsimrl.testbed.shop import create_app as create_shop_app
    from tests.openai_stub import OpenAIStub

    docs = helm.render(CHART / "ci" / "skills-values.yaml", sets={"readiness.timeoutSeconds": "1"})
    pod = only(docs, "Job", "job-worker.yaml")["spec"]["template"]["spec"]
    config_path = tmp_path / "skills.yaml"
    config_path.write_text(only(docs, "ConfigMap")["data"]["qwen35-4b-initial-skills.yaml"], encoding="utf-8")
    analyst, shop_app = OpenAIStub(), create_shop_app()
    analyst.served_models = ["Qwen/Qwen3.5-27B"]
    with running_server(analyst) as analyst_url, running_server(shop_app) as shop_url:

        def wait_ready() -> subprocess.CompletedProcess[str]:
            overrides = {
                "SHOPSIMRL_CONFIG": str(config_path),
                "SHOPSIMRL_ANALYST_BASE_URL": f"{analyst_url}/v1",
                "SHOPSIMRL_ENV_BASE_URL": shop_url,
                "SHOPSIMRL_LOG_FORMAT": "console",
            }
            argv, env = _pod_command(container(pod, "wait-ready"), overrides)
            return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=120)

        ready = wait_ready()
        assert ready.returncode == ExitCode.OK, ready.stderr
        assert ready.stdout.startswith("ready: 'Qwen/Qwen3.5-27B' is served; ShopSimulator environment is ready")
        shop_app.state.shop.ready = False
        not_ready = wait_ready()
        assert not_ready.returncode == ExitCode.RETRYABLE and "environment_not_ready after 1 s" in not_ready.stderr
        shop_app.state.shop.ready = True
        analyst.served_models = ["Qwen/Qwen3.5-9B"]
        unlisted = wait_ready()
        assert unlisted.returncode == ExitCode.RETRYABLE
        assert "model_not_listed after 1 s: 'Qwen/Qwen3.5-27B' is not among the served models" in unlisted.stderr


def test_skills_mode_workers_reach_the_release_shop_like_rollout_workers(helm: Helm) -> None:
    """The release's ShopSimulator or testbed shop Service beats environment.baseUrl, in skills
    mode as in rollout mode; the config the workers load takes the URL from the variable."""
    from shopsimrl.research.skills.build import load_skills_config

    values = CHART / "ci" / "skills-values.yaml"
    shop = {
        "shopsimulator.enabled": "true",
        "shopsimulator.image.repository": "registry.example.com/ml/shopsimulator",
        "shopsimulator.image.tag": "paper-aligned-v8",
    }
    for sets, service in ((shop, "service-shopsimulator.yaml"), ({"testbed.enabled": "true"}, "service-testbed-shop.yaml")):
        docs = helm.render(values, sets=sets)
        svc = only(docs, "Service", service)
        port = svc["spec"]["ports"][0]["port"]
        worker = container(only(docs, "Job", "job-worker.yaml")["spec"]["template"]["spec"], "worker")
        url = env_of(worker)["SHOPSIMRL_ENV_BASE_URL"]["value"]
        assert url == f"http://{svc['metadata']['name']}:{port}", service
        with pytest.MonkeyPatch.context() as patch, tempfile.TemporaryDirectory() as folder:
            config = Path(folder) / "skills.yaml"
            config.write_text(only(docs, "ConfigMap")["data"]["qwen35-4b-initial-skills.yaml"], encoding="utf-8")
            patch.delenv("SHOPSIMRL_ANALYST_BASE_URL", raising=False)
            patch.setenv("SHOPSIMRL_ENV_BASE_URL", url)
            assert load_skills_config(config).environment.base_url == url
    # The shop's slots bound the failure analyst's live sessions: pods at once × experiment.concurrency.
    assert helm.template(values, sets={"environment.slots": "16"}).returncode == 0  # 4 pods × 4
    proc = helm.template(values, sets={"environment.slots": "15"}, check=False)
    assert proc.returncode != 0 and "4 worker pods at once × config experiment.concurrency 4 = 16 live sessions" in proc.stderr
    assert "(environment.slots)" in proc.stderr, proc.stderr
    assert helm.template(values, sets={"environment.slots": "8", "job.parallelism": "2"}).returncode == 0
    judge = helm.render(CHART / "ci" / "judge-values.yaml", sets={"environment.baseUrl": "http://shop:5700"})
    worker = container(only(judge, "Job", "job-worker.yaml")["spec"]["template"]["spec"], "worker")
    assert "SHOPSIMRL_ENV_BASE_URL" not in env_of(worker)  # a judge reads frozen traces only


def test_skills_mode_config_is_checked_by_schema_and_template(helm: Helm, tmp_path: Path) -> None:
    values = CHART / "ci" / "skills-values.yaml"
    data = yaml.safe_load(values.read_text())
    del data["config"]["analyst_model"]
    broken = tmp_path / "no-analyst.yaml"
    broken.write_text(yaml.safe_dump(data))
    proc = helm.template(broken, check=False)
    assert proc.returncode != 0 and "analyst_model" in proc.stderr
    as_string = tmp_path / "string.yaml"
    as_string.write_text(yaml.safe_dump({**data, "config": yaml.safe_dump(data["config"])}))
    proc = helm.template(as_string, check=False)
    assert proc.returncode != 0 and "config.analyst_model: missing; in skills mode" in proc.stderr
    # An experiment config in skills mode lacks the skill builder's keys.
    proc = helm.template(CHART / "ci" / "default-values.yaml", sets={"mode": "skills"}, check=False)
    assert proc.returncode != 0 and "analyst_model is required" in proc.stderr
    for key in ("inlineSplitFile", "inlineSkillsFile"):
        proc = helm.template(values, set_strings={f"run.{key}": "x.json"}, check=False)
        assert proc.returncode != 0 and f"run.{key}: the skill analysts read frozen traces" in proc.stderr, proc.stderr
    proc = helm.template(values, sets={"jobSet.enabled": "true"}, check=False)
    assert proc.returncode != 0 and "a skills release (mode: skills) uses the plain Jobs" in proc.stderr, proc.stderr
