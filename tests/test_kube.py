"""Job status logic of ``shopsimrl status`` on real ``kubernetes.client`` model objects.

The loader is exercised through the real client against a small API stand-in served over
HTTP, and against a real K3s cluster where a Docker engine exists.
"""

from __future__ import annotations

import time
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from kubernetes import client as k8s
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from shopsimrl.exitcodes import ExitCode
from shopsimrl.runner.kube import (
    IndexState,
    api_clients,
    exit_code_meaning,
    format_index_ranges,
    job_report,
    load_release_status,
    parse_index_ranges,
    pod_failures,
    pod_index,
    release_selector,
)
from shopsimrl.testbed.serving import running_server

T0 = datetime(2026, 9, 1, 12, 0, tzinfo=UTC)


# --------------------------------------------------------------------------- builders


def make_job(
    name: str = "eval-ckpt-1a2b3c4d",
    *,
    completions: int = 8,
    completed: str | None = None,
    failed: str | None = None,
    conditions: list[k8s.V1JobCondition] | None = None,
    suspend: bool = False,
    created: datetime = T0,
    uid: str = "uid-1",
) -> k8s.V1Job:
    return k8s.V1Job(
        api_version="batch/v1",
        kind="Job",
        metadata=k8s.V1ObjectMeta(
            name=name,
            namespace="evals",
            uid=uid,
            creation_timestamp=created,
            labels={"app.kubernetes.io/instance": "eval-ckpt", "app.kubernetes.io/component": "worker"},
            annotations={"shopsimrl.io/run-uri": "s3://bucket/runs/ckpt"},
        ),
        spec=k8s.V1JobSpec(
            completions=completions,
            parallelism=4,
            completion_mode="Indexed",
            suspend=suspend,
            template=k8s.V1PodTemplateSpec(spec=k8s.V1PodSpec(containers=[k8s.V1Container(name="worker", image="shopsimrl")])),
        ),
        status=k8s.V1JobStatus(completed_indexes=completed, failed_indexes=failed, conditions=conditions),
    )


def terminated(name: str, code: int, reason: str = "Error", at: datetime = T0, message: str | None = None):
    return k8s.V1ContainerStatus(
        name=name,
        image="shopsimrl",
        image_id="",
        ready=False,
        restart_count=0,
        state=k8s.V1ContainerState(
            terminated=k8s.V1ContainerStateTerminated(exit_code=code, reason=reason, finished_at=at, message=message)
        ),
    )


def running(name: str = "worker"):
    return k8s.V1ContainerStatus(
        name=name,
        image="shopsimrl",
        image_id="",
        ready=True,
        restart_count=0,
        state=k8s.V1ContainerState(running=k8s.V1ContainerStateRunning(started_at=T0)),
    )


def make_pod(
    name: str,
    index: int | None,
    phase: str,
    *,
    containers: list[k8s.V1ContainerStatus] | None = None,
    init: list[k8s.V1ContainerStatus] | None = None,
    failure_count: int | None = None,
    reason: str | None = None,
    conditions: list[k8s.V1PodCondition] | None = None,
) -> k8s.V1Pod:
    annotations: dict[str, str] = {}
    if index is not None:
        annotations["batch.kubernetes.io/job-completion-index"] = str(index)
    if failure_count is not None:
        annotations["batch.kubernetes.io/job-index-failure-count"] = str(failure_count)
    return k8s.V1Pod(
        api_version="v1",
        kind="Pod",
        metadata=k8s.V1ObjectMeta(
            name=name,
            namespace="evals",
            annotations=annotations,
            labels={"batch.kubernetes.io/controller-uid": "uid-1"},
        ),
        status=k8s.V1PodStatus(
            phase=phase,
            container_statuses=containers,
            init_container_statuses=init,
            reason=reason,
            conditions=conditions,
        ),
    )


# --------------------------------------------------------------------------- index ranges


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("0-3,7", (0, 1, 2, 3, 7)),
        ("5", (5,)),
        ("", ()),
        (None, ()),
        ("1,3-5,7-7,9", (1, 3, 4, 5, 7, 9)),
        ("3-4,0-1", (0, 1, 3, 4)),
        ("0-2,1-3", (0, 1, 2, 3)),
    ],
)
def test_parse_index_ranges(text: str | None, expected: tuple[int, ...]) -> None:
    assert parse_index_ranges(text) == expected


@pytest.mark.parametrize("bad", ["a", "3-1", "1,,2", "-1", "1-", "1-2-3", "+3", "0x1", "٣"])
def test_parse_index_ranges_rejects_bad_input_naming_the_part(bad: str) -> None:
    with pytest.raises(ValueError, match="invalid index range"):
        parse_index_ranges(bad)


def test_format_index_ranges_round_trips() -> None:
    assert format_index_ranges([7, 0, 1, 2, 3, 3]) == "0-3,7"
    assert format_index_ranges([]) == ""
    for text in ["0-3,7", "1,3-5,9", "0-99999"]:
        assert format_index_ranges(parse_index_ranges(text)) == text


# --------------------------------------------------------------------------- pods


def test_exit_code_meanings_follow_the_exit_code_table() -> None:
    assert exit_code_meaning(ExitCode.FINGERPRINT_MISMATCH) == "fingerprint_mismatch"
    assert exit_code_meaning(ExitCode.RETRYABLE) == "retryable"
    assert exit_code_meaning(ExitCode.BAD_INPUT) == "bad_input"
    assert exit_code_meaning(ExitCode.EPISODES_FAILED) == "episodes_failed"
    assert exit_code_meaning(137) == "killed"
    assert exit_code_meaning(99) == "exit_99"


def test_pod_index_reads_annotation_then_label() -> None:
    assert pod_index(make_pod("p", 5, "Running")) == 5
    labelled = make_pod("p", None, "Running")
    labelled.metadata.labels["batch.kubernetes.io/job-completion-index"] = "3"
    assert pod_index(labelled) == 3
    assert pod_index(make_pod("p", None, "Running")) is None


def test_pod_failures_name_exit_codes_and_order_recent_first() -> None:
    pods = [
        make_pod("w-1-aaaa", 1, "Failed", containers=[terminated("worker", 42, at=T0)]),
        make_pod("w-2-bbbb", 2, "Failed", containers=[terminated("worker", 3, at=T0 + timedelta(minutes=5))]),
        make_pod("w-3-cccc", 3, "Failed", containers=[terminated("worker", 137, "OOMKilled", T0 + timedelta(minutes=1))]),
        make_pod("w-0-dddd", 0, "Succeeded", containers=[terminated("worker", 0)]),
        make_pod("w-4-eeee", 4, "Running", containers=[running()]),
    ]
    failures = pod_failures(pods)
    assert [f.pod for f in failures] == ["w-2-bbbb", "w-3-cccc", "w-1-aaaa"]
    by_pod = {f.pod: f for f in failures}
    assert by_pod["w-1-aaaa"].meaning == "fingerprint_mismatch"
    assert by_pod["w-1-aaaa"].exit_code == ExitCode.FINGERPRINT_MISMATCH
    assert by_pod["w-1-aaaa"].index == 1 and by_pod["w-1-aaaa"].container == "worker"
    assert by_pod["w-2-bbbb"].meaning == "retryable"
    assert by_pod["w-3-cccc"].meaning == "oom_killed" and by_pod["w-3-cccc"].reason == "OOMKilled"
    assert len(pod_failures(pods, limit=1)) == 1


def test_failed_readiness_init_container_is_reported() -> None:
    pod = make_pod(
        "w-5-ffff",
        5,
        "Failed",
        init=[terminated("wait-ready", 3, message="environment_not_ready after 600 s")],
        containers=[
            k8s.V1ContainerStatus(
                name="worker",
                image="x",
                image_id="",
                ready=False,
                restart_count=0,
                state=k8s.V1ContainerState(waiting=k8s.V1ContainerStateWaiting(reason="PodInitializing")),
            )
        ],
    )
    (failure,) = pod_failures([pod])
    assert failure.container == "wait-ready"
    assert failure.meaning == "retryable"
    assert failure.message == "environment_not_ready after 600 s"


def test_evicted_and_disrupted_pods_without_exit_codes() -> None:
    evicted = make_pod("w-6-gggg", 6, "Failed", reason="Evicted")
    disrupted = make_pod(
        "w-7-hhhh",
        7,
        "Failed",
        conditions=[k8s.V1PodCondition(type="DisruptionTarget", status="True", last_transition_time=T0)],
    )
    deadline = make_pod("w-1-iiii", 1, "Failed", reason="DeadlineExceeded")
    by_pod = {f.pod: f for f in pod_failures([evicted, disrupted, deadline])}
    assert by_pod["w-6-gggg"].meaning == "evicted" and by_pod["w-6-gggg"].exit_code is None
    assert by_pod["w-7-hhhh"].meaning == "disrupted" and by_pod["w-7-hhhh"].finished_at == T0
    assert by_pod["w-1-iiii"].meaning == "deadline_exceeded"


# --------------------------------------------------------------------------- jobs


def test_job_report_combines_job_status_and_pods() -> None:
    job = make_job(completions=8, completed="0-3", failed="5")
    pods = [
        *(make_pod(f"w-{i}-ok", i, "Succeeded", containers=[terminated("worker", 0)]) for i in range(4)),
        make_pod("w-4-run", 4, "Running", containers=[running()], failure_count=1),
        make_pod("w-4-old", 4, "Failed", containers=[terminated("worker", 3)]),
        make_pod("w-5-fp", 5, "Failed", containers=[terminated("worker", 42)]),
        make_pod("w-6-wait", 6, "Pending"),
    ]
    report = job_report(job, pods)
    assert report.succeeded == (0, 1, 2, 3)
    assert report.failed == (5,)
    assert report.active == (4, 6)
    assert report.pending == (7,)
    assert report.condition == "Running" and not report.finished
    assert report.run_uri == "s3://bucket/runs/ckpt"
    index4 = report.indexes[4]
    assert index4.state is IndexState.ACTIVE and index4.pods == 2 and index4.failures == 1
    assert report.indexes[5].failures == 1
    assert report.indexes[7].pods == 0
    assert {f.meaning for f in report.failures} == {"retryable", "fingerprint_mismatch"}

    data = report.to_dict()
    assert data["succeeded"] == "0-3" and data["failed"] == "5" and data["active"] == "4,6"
    assert data["counts"] == {"succeeded": 4, "failed": 1, "active": 2, "pending": 1}
    assert data["failures"][0]["finished_at"] == T0.isoformat()


def test_job_report_failure_counts_use_the_controller_annotation() -> None:
    # Third attempt of index 2 failed too: two earlier failures stamped on it, plus its own.
    pods = [
        make_pod("w-2-a", 2, "Failed", containers=[terminated("worker", 1)]),
        make_pod("w-2-b", 2, "Failed", containers=[terminated("worker", 1)], failure_count=1),
        make_pod("w-2-c", 2, "Failed", containers=[terminated("worker", 1)], failure_count=2),
    ]
    report = job_report(make_job(completions=3, failed="2"), pods)
    assert report.indexes[2].failures == 3
    assert report.indexes[2].state is IndexState.FAILED
    # A disruption is ignored by the chart's podFailurePolicy and must not count.
    disrupted = make_pod(
        "w-1-d",
        1,
        "Failed",
        conditions=[k8s.V1PodCondition(type="DisruptionTarget", status="True")],
    )
    assert job_report(make_job(completions=3), [disrupted]).indexes[1].failures == 0


@pytest.mark.parametrize(
    ("conditions", "suspend", "expected"),
    [
        ([k8s.V1JobCondition(type="Complete", status="True")], False, ("Complete", None)),
        (
            [
                k8s.V1JobCondition(type="FailureTarget", status="True", reason="FailedIndexes"),
                k8s.V1JobCondition(type="Failed", status="True", reason="FailedIndexes"),
            ],
            False,
            ("Failed", "FailedIndexes"),
        ),
        ([k8s.V1JobCondition(type="Failed", status="False")], False, ("Running", None)),
        (None, True, ("Suspended", None)),
        (None, False, ("Running", None)),
    ],
)
def test_job_condition(conditions, suspend, expected) -> None:
    report = job_report(make_job(conditions=conditions, suspend=suspend), [])
    assert (report.condition, report.condition_reason) == expected
    assert report.finished == (expected[0] in ("Complete", "Failed"))


def test_completed_index_wins_over_a_stale_failed_pod() -> None:
    # Index 0 failed once, was retried and succeeded: it is succeeded, the failure stays listed.
    pods = [
        make_pod("w-0-a", 0, "Failed", containers=[terminated("worker", 3)]),
        make_pod("w-0-b", 0, "Succeeded", containers=[terminated("worker", 0)], failure_count=1),
    ]
    report = job_report(make_job(completions=1, completed="0"), pods)
    assert report.succeeded == (0,)
    assert report.indexes[0].failures == 1
    assert [f.pod for f in report.failures] == ["w-0-a"]


# --------------------------------------------------------------------------- loader over HTTP


def _api_stub(jobs: list[k8s.V1Job], pods: list[k8s.V1Pod], seen: list[tuple[str, str]]) -> Starlette:
    """The two list endpoints of a Kubernetes API server, serving the given objects."""
    serialize = k8s.ApiClient().sanitize_for_serialization

    def selected(obj: Any, selector: str) -> bool:
        labels = obj.metadata.labels or {}
        return all(labels.get(k) == v for k, v in (term.split("=", 1) for term in selector.split(",") if term))

    async def list_jobs(request: Request) -> JSONResponse:
        selector = request.query_params.get("labelSelector", "")
        seen.append(("jobs", selector))
        items = [serialize(j) for j in jobs if selected(j, selector)]
        return JSONResponse({"apiVersion": "batch/v1", "kind": "JobList", "metadata": {}, "items": items})

    async def list_pods(request: Request) -> JSONResponse:
        selector = request.query_params.get("labelSelector", "")
        seen.append(("pods", selector))
        items = [serialize(p) for p in pods if selected(p, selector)]
        return JSONResponse({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items})

    return Starlette(
        routes=[
            Route("/apis/batch/v1/namespaces/{ns}/jobs", list_jobs),
            Route("/api/v1/namespaces/{ns}/pods", list_pods),
        ]
    )


@pytest.mark.slow
def test_load_release_status_through_the_api(tmp_path) -> None:
    old = make_job(
        "eval-ckpt-00000000",
        completions=2,
        completed="0-1",
        uid="uid-0",
        conditions=[k8s.V1JobCondition(type="Complete", status="True")],
    )
    new = make_job("eval-ckpt-11111111", completions=2, completed="0", failed="1", uid="uid-1", created=T0 + timedelta(hours=1))
    other_release = make_job("other-22222222", uid="uid-2")
    other_release.metadata.labels["app.kubernetes.io/instance"] = "other"
    pods = [
        make_pod("new-0", 0, "Succeeded", containers=[terminated("worker", 0)]),
        make_pod("new-1", 1, "Failed", containers=[terminated("worker", 42, message="fingerprint differs")]),
    ]
    seen: list[tuple[str, str]] = []
    with running_server(_api_stub([old, new, other_release], pods, seen)) as url:
        configuration = k8s.Configuration(host=url)
        api = k8s.ApiClient(configuration)
        status = load_release_status("evals", "eval-ckpt", batch_api=k8s.BatchV1Api(api), core_api=k8s.CoreV1Api(api))
    assert [j.name for j in status.jobs] == ["eval-ckpt-11111111", "eval-ckpt-00000000"]
    newest = status.jobs[0]
    assert newest.failed == (1,) and newest.succeeded == (0,)
    (failure,) = newest.failures
    assert failure.meaning == "fingerprint_mismatch" and failure.message == "fingerprint differs"
    assert status.jobs[1].condition == "Complete" and status.jobs[1].failures == ()
    assert ("jobs", release_selector("eval-ckpt")) in seen
    assert ("pods", "batch.kubernetes.io/controller-uid=uid-1") in seen
    assert status.to_dict()["jobs"][0]["failed"] == "1"


def test_api_clients_from_a_kubeconfig_file(tmp_path) -> None:
    kubeconfig = tmp_path / "config"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: c\n"
        "clusters: [{name: k, cluster: {server: 'http://127.0.0.1:9'}}]\n"
        "contexts: [{name: c, context: {cluster: k, user: u}}]\n"
        "users: [{name: u, user: {token: abc}}]\n"
    )
    batch, core = api_clients(kubeconfig=str(kubeconfig))
    assert batch.api_client.configuration.host == "http://127.0.0.1:9"
    assert core.api_client is batch.api_client


def test_api_clients_without_any_config_says_so(tmp_path, monkeypatch) -> None:
    from shopsimrl.runner.kube import KubeUnavailableError

    monkeypatch.delenv("KUBERNETES_SERVICE_HOST", raising=False)
    with pytest.raises(KubeUnavailableError, match="no Kubernetes access"):
        api_clients(kubeconfig=str(tmp_path / "missing"))


# --------------------------------------------------------------------------- real cluster


def _docker_ok() -> bool:
    try:
        import docker

        docker.from_env().ping()
        return True
    except Exception:
        return False


@pytest.mark.slow
@pytest.mark.skipif(not _docker_ok(), reason="no Docker engine: K3s end-to-end test needs one")
def test_status_of_a_real_indexed_job_on_k3s() -> None:
    import yaml
    from kubernetes import config as k8s_config
    from testcontainers.community.k3s import K3SContainer

    with K3SContainer() as k3s:
        api = k8s_config.new_client_from_config_dict(yaml.safe_load(k3s.config_yaml()))
        batch, core = k8s.BatchV1Api(api), k8s.CoreV1Api(api)
        labels = {"app.kubernetes.io/instance": "e2e", "app.kubernetes.io/component": "worker"}
        # Index 1 exits 42 (fingerprint mismatch): FailIndex must stop it without a retry.
        script = 'if [ "$JOB_COMPLETION_INDEX" = 1 ]; then exit 42; fi; exit 0'
        job = k8s.V1Job(
            metadata=k8s.V1ObjectMeta(name="e2e-worker", labels=labels),
            spec=k8s.V1JobSpec(
                completions=3,
                parallelism=3,
                completion_mode="Indexed",
                backoff_limit_per_index=2,
                pod_failure_policy=k8s.V1PodFailurePolicy(
                    rules=[
                        k8s.V1PodFailurePolicyRule(
                            action="FailIndex",
                            on_exit_codes=k8s.V1PodFailurePolicyOnExitCodesRequirement(
                                container_name="worker",
                                operator="In",
                                values=[int(ExitCode.FINGERPRINT_MISMATCH)],
                            ),
                        )
                    ]
                ),
                template=k8s.V1PodTemplateSpec(
                    metadata=k8s.V1ObjectMeta(labels=labels),
                    spec=k8s.V1PodSpec(
                        restart_policy="Never",
                        containers=[k8s.V1Container(name="worker", image="busybox:1.36", command=["sh", "-c", script])],
                    ),
                ),
            ),
        )
        batch.create_namespaced_job("default", job)
        deadline = time.monotonic() + 240
        status = load_release_status("default", "e2e", batch_api=batch, core_api=core)
        while not (status.jobs and status.jobs[0].finished) and time.monotonic() < deadline:
            time.sleep(2)
            status = load_release_status("default", "e2e", batch_api=batch, core_api=core)
        (report,) = status.jobs
        assert report.condition == "Failed"
        assert report.succeeded == (0, 2)
        assert report.failed == (1,)
        assert report.indexes[1].pods == 1  # FailIndex: never retried
        assert [f.meaning for f in report.failures] == ["fingerprint_mismatch"]
