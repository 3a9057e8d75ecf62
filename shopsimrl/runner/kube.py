"""The Kubernetes side of ``shopsimrl status``: what a release's worker Job is doing.

The Helm chart (``helm/shopsimrl``) is the one source of the Job spec; this module only reads.
It is split in two:

- pure functions over ``kubernetes.client`` model objects (``V1Job``, ``V1Pod``) that build a
  typed report: per shard index succeeded / failed / active / pending, and recent pod failures
  with the worker's exit codes named (42 ``fingerprint_mismatch``, 3 ``retryable`` ...);
- a thin loader, :func:`load_release_status`, that lists the Jobs and pods of a release through
  ``BatchV1Api`` / ``CoreV1Api`` (in-cluster config, else the kubeconfig).

Index sets come from the Job's ``status.completedIndexes`` / ``status.failedIndexes`` (the
"0-3,7" format, see :func:`parse_index_ranges`) and from each pod's
``batch.kubernetes.io/job-completion-index`` annotation and phase.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from enum import StrEnum
from typing import Any

from kubernetes import client as k8s
from kubernetes import config as k8s_config

from shopsimrl.exitcodes import ExitCode
from shopsimrl.schemas import redact_uri

__all__ = [
    "COMPLETION_INDEX_ANNOTATION",
    "IndexState",
    "IndexStatus",
    "JobReport",
    "KubeUnavailableError",
    "PodFailure",
    "ReleaseStatus",
    "api_clients",
    "exit_code_meaning",
    "format_index_ranges",
    "give_up_on_failed_indexes",
    "job_report",
    "load_job_report",
    "load_release_status",
    "parse_index_ranges",
    "pod_failures",
    "pod_index",
    "release_selector",
]

COMPLETION_INDEX_ANNOTATION = "batch.kubernetes.io/job-completion-index"
INDEX_FAILURE_COUNT_ANNOTATION = "batch.kubernetes.io/job-index-failure-count"
CONTROLLER_UID_LABEL = "batch.kubernetes.io/controller-uid"
RUN_URI_ANNOTATION = "shopsimrl.io/run-uri"

_EXIT_MEANINGS: dict[int, str] = {
    ExitCode.OK: "ok",
    ExitCode.EPISODES_FAILED: "episodes_failed",
    ExitCode.BAD_INPUT: "bad_input",
    ExitCode.RETRYABLE: "retryable",
    ExitCode.FINGERPRINT_MISMATCH: "fingerprint_mismatch",
    # 128 + signal: what the container runtime reports for a process killed by a signal.
    137: "killed",
    143: "terminated",
}


class KubeUnavailableError(RuntimeError):
    """Neither an in-cluster service account nor a kubeconfig could be loaded."""


class IndexState(StrEnum):
    """Where one shard index stands; a later state in this list never hides an earlier one."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    ACTIVE = "active"
    PENDING = "pending"


@dataclass(frozen=True)
class PodFailure:
    """One failed pod (or failed container of a still-listed pod)."""

    pod: str
    index: int | None
    container: str | None
    exit_code: int | None
    reason: str
    """Kubernetes' own reason: ``Error``, ``OOMKilled``, ``Evicted``, ``DeadlineExceeded`` ..."""
    meaning: str
    """What it means for the run: ``fingerprint_mismatch``, ``retryable``, ``oom_killed`` ..."""
    message: str | None = None
    finished_at: datetime | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "pod": self.pod,
            "index": self.index,
            "container": self.container,
            "exit_code": self.exit_code,
            "reason": self.reason,
            "meaning": self.meaning,
            "message": self.message,
            "finished_at": self.finished_at.isoformat() if self.finished_at else None,
        }


@dataclass(frozen=True)
class IndexStatus:
    """State of one shard index and how often its pods failed."""

    index: int
    state: IndexState
    pods: int = 0
    failures: int = 0


@dataclass(frozen=True)
class JobReport:
    """One worker Job: overall condition, every index, and the most recent pod failures."""

    name: str
    namespace: str
    completions: int
    parallelism: int | None
    condition: str
    """``Complete``, ``Failed``, ``Suspended`` or ``Running``."""
    condition_reason: str | None
    indexes: tuple[IndexStatus, ...]
    failures: tuple[PodFailure, ...] = ()
    run_uri: str | None = None
    created_at: datetime | None = None

    def _with(self, state: IndexState) -> tuple[int, ...]:
        return tuple(s.index for s in self.indexes if s.state is state)

    @property
    def succeeded(self) -> tuple[int, ...]:
        return self._with(IndexState.SUCCEEDED)

    @property
    def failed(self) -> tuple[int, ...]:
        return self._with(IndexState.FAILED)

    @property
    def active(self) -> tuple[int, ...]:
        return self._with(IndexState.ACTIVE)

    @property
    def pending(self) -> tuple[int, ...]:
        return self._with(IndexState.PENDING)

    @property
    def finished(self) -> bool:
        return self.condition in ("Complete", "Failed")

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "namespace": self.namespace,
            "run_uri": self.run_uri,
            "created_at": self.created_at.isoformat() if self.created_at else None,
            "condition": self.condition,
            "condition_reason": self.condition_reason,
            "completions": self.completions,
            "parallelism": self.parallelism,
            "succeeded": format_index_ranges(self.succeeded),
            "failed": format_index_ranges(self.failed),
            "active": format_index_ranges(self.active),
            "pending": format_index_ranges(self.pending),
            "counts": {state.value: len(self._with(state)) for state in IndexState},
            "indexes": [{"index": s.index, "state": s.state.value, "pods": s.pods, "failures": s.failures} for s in self.indexes],
            "failures": [f.to_dict() for f in self.failures],
        }


@dataclass(frozen=True)
class ReleaseStatus:
    """All worker Jobs of one Helm release, newest first (a bumped ``run.attempt`` adds one)."""

    namespace: str
    release: str
    jobs: tuple[JobReport, ...] = field(default_factory=tuple)

    def to_dict(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "release": self.release,
            "jobs": [job.to_dict() for job in self.jobs],
        }


# --------------------------------------------------------------------------- index ranges


def parse_index_ranges(text: str | None) -> tuple[int, ...]:
    """Parse Kubernetes' compressed index list ("0-3,7") into sorted, unique indexes.

    ``None`` and ``""`` mean no index. Raises ``ValueError`` naming the bad part otherwise.

        >>> parse_index_ranges("0-3,7")
        (0, 1, 2, 3, 7)
    """
    if text is None or not text.strip():
        return ()
    indexes: set[int] = set()
    for raw in text.split(","):
        part = raw.strip()
        first, sep, last = part.partition("-")
        try:
            lo = _index(first)
            hi = _index(last) if sep else lo
        except ValueError:
            raise ValueError(f"invalid index range {part!r} in {text!r}: expected N or N-M") from None
        if hi < lo:
            raise ValueError(f"invalid index range {part!r} in {text!r}: end below start")
        indexes.update(range(lo, hi + 1))
    return tuple(sorted(indexes))


def _index(token: str) -> int:
    # int() would accept "+3", " 3" or "3_0"; Kubernetes only writes plain digits.
    if not token.isascii() or not token.isdigit():
        raise ValueError(token)
    return int(token)


def format_index_ranges(indexes: Iterable[int]) -> str:
    """Inverse of :func:`parse_index_ranges`: ``[0, 1, 2, 3, 7]`` -> ``"0-3,7"``."""
    spans: list[list[int]] = []
    for i in sorted(set(indexes)):
        if spans and i == spans[-1][1] + 1:
            spans[-1][1] = i
        else:
            spans.append([i, i])
    return ",".join(str(lo) if lo == hi else f"{lo}-{hi}" for lo, hi in spans)


# --------------------------------------------------------------------------- pods


def exit_code_meaning(code: int) -> str:
    """Name an exit code for people: the worker's codes, then signals, then ``exit_<n>``."""
    return _EXIT_MEANINGS.get(code, f"exit_{code}")


def _meta(obj: k8s.V1Pod | k8s.V1Job) -> k8s.V1ObjectMeta:
    """An object's metadata; the client's models make it optional, the API server always sends it."""
    return obj.metadata or k8s.V1ObjectMeta()


def pod_index(pod: k8s.V1Pod) -> int | None:
    """Shard index of a pod of an Indexed Job (annotation, or the label newer versions add)."""
    meta = _meta(pod)
    for source in (meta.annotations or {}, meta.labels or {}):
        value = source.get(COMPLETION_INDEX_ANNOTATION)
        if value is not None and str(value).isdigit():
            return int(value)
    return None


def _is_disrupted(pod: k8s.V1Pod) -> bool:
    conditions = (pod.status.conditions if pod.status else None) or []
    return any(c.type == "DisruptionTarget" and c.status == "True" for c in conditions)


def _pod_failure(pod: k8s.V1Pod) -> PodFailure | None:
    status = pod.status
    if status is None:
        return None
    name = _meta(pod).name or ""
    index = pod_index(pod)
    # Init containers first: a failed readiness wait means the worker never started.
    statuses = [*(status.init_container_statuses or []), *(status.container_statuses or [])]
    for cs in statuses:
        term = cs.state.terminated if cs.state else None
        if term is None or term.exit_code in (None, 0):
            continue
        reason = term.reason or "Error"
        meaning = "oom_killed" if reason == "OOMKilled" else exit_code_meaning(term.exit_code)
        return PodFailure(
            pod=name,
            index=index,
            container=cs.name,
            exit_code=term.exit_code,
            reason=reason,
            meaning=meaning,
            message=term.message,
            finished_at=term.finished_at,
        )
    if status.phase != "Failed":
        return None
    # Failed without a container exit code: evicted, deadline, node lost ...
    reason = status.reason or ("DisruptionTarget" if _is_disrupted(pod) else "Unknown")
    meaning = "disrupted" if _is_disrupted(pod) else _snake(reason)
    return PodFailure(
        pod=name,
        index=index,
        container=None,
        exit_code=None,
        reason=reason,
        meaning=meaning,
        message=status.message,
        finished_at=_last_transition(status),
    )


def _snake(reason: str) -> str:
    out = []
    for i, ch in enumerate(reason):
        if ch.isupper() and i and not reason[i - 1].isupper():
            out.append("_")
        out.append(ch.lower())
    return "".join(out)


def _last_transition(status: k8s.V1PodStatus) -> datetime | None:
    times = [c.last_transition_time for c in (status.conditions or []) if c.last_transition_time]
    return max(times) if times else None


def pod_failures(pods: Iterable[k8s.V1Pod], *, limit: int | None = 10) -> tuple[PodFailure, ...]:
    """Failed pods, most recent first (unknown times last), at most ``limit`` of them."""
    failures = [f for f in (_pod_failure(p) for p in pods) if f is not None]
    failures.sort(key=lambda f: (f.finished_at is not None, f.finished_at or datetime.min.replace(tzinfo=UTC)), reverse=True)
    return tuple(failures if limit is None else failures[:limit])


# --------------------------------------------------------------------------- jobs


def _job_condition(job: k8s.V1Job) -> tuple[str, str | None]:
    for cond in (job.status.conditions if job.status else None) or []:
        if cond.status == "True" and cond.type in ("Complete", "Failed"):
            return cond.type, cond.reason
    if job.spec is not None and job.spec.suspend:
        return "Suspended", None
    return "Running", None


def _index_failures(pods: Sequence[k8s.V1Pod]) -> int:
    # The controller stamps each new pod with the failures of its index so far; the pod's own
    # failure is added unless it was a disruption, which the chart's policy ignores.
    best = 0
    for pod in pods:
        raw = (_meta(pod).annotations or {}).get(INDEX_FAILURE_COUNT_ANNOTATION, "0")
        before = int(raw) if str(raw).isdigit() else 0
        failed_now = pod.status is not None and pod.status.phase == "Failed" and not _is_disrupted(pod)
        best = max(best, before + int(failed_now))
    return best


def job_report(job: k8s.V1Job, pods: Iterable[k8s.V1Pod], *, max_failures: int | None = 10) -> JobReport:
    """Report on one Indexed Job from the Job object and the pods it owns."""
    pods = list(pods)
    spec, status, meta = job.spec, job.status, job.metadata
    completions = int(spec.completions or 0) if spec else 0
    succeeded = set(parse_index_ranges(status.completed_indexes if status else None))
    failed = set(parse_index_ranges(status.failed_indexes if status else None))

    by_index: dict[int, list[k8s.V1Pod]] = {}
    for pod in pods:
        idx = pod_index(pod)
        if idx is not None:
            by_index.setdefault(idx, []).append(pod)

    states: list[IndexStatus] = []
    for idx in range(completions):
        own = by_index.get(idx, [])
        if idx in succeeded:
            state = IndexState.SUCCEEDED
        elif idx in failed:
            state = IndexState.FAILED
        elif any(p.status is not None and p.status.phase in ("Pending", "Running") for p in own):
            state = IndexState.ACTIVE
        else:
            state = IndexState.PENDING
        states.append(IndexStatus(index=idx, state=state, pods=len(own), failures=_index_failures(own)))

    condition, reason = _job_condition(job)
    annotations = (meta.annotations or {}) if meta else {}
    return JobReport(
        name=(meta.name if meta else None) or "",
        namespace=(meta.namespace if meta else None) or "",
        completions=completions,
        parallelism=spec.parallelism if spec else None,
        condition=condition,
        condition_reason=reason,
        indexes=tuple(states),
        failures=pod_failures(pods, limit=max_failures),
        run_uri=redact_uri(annotations[RUN_URI_ANNOTATION]) if annotations.get(RUN_URI_ANNOTATION) else None,
        created_at=meta.creation_timestamp if meta else None,
    )


# --------------------------------------------------------------------------- loader


def release_selector(release: str) -> str:
    """Label selector of a release's worker Jobs (labels set by the chart's helpers)."""
    return f"app.kubernetes.io/instance={release},app.kubernetes.io/component=worker"


def api_clients(*, kubeconfig: str | None = None, context: str | None = None) -> tuple[k8s.BatchV1Api, k8s.CoreV1Api]:
    """API clients from the pod's service account, else from the kubeconfig."""
    api_client: k8s.ApiClient | None = None
    if kubeconfig is None and context is None:
        try:
            k8s_config.load_incluster_config()
            api_client = k8s.ApiClient()
        except k8s_config.ConfigException:
            api_client = None
    if api_client is None:
        try:
            api_client = k8s_config.new_client_from_config(config_file=kubeconfig, context=context)
        except (k8s_config.ConfigException, OSError) as exc:
            raise KubeUnavailableError(f"no Kubernetes access: not in a cluster and no usable kubeconfig ({exc})") from exc
    return k8s.BatchV1Api(api_client), k8s.CoreV1Api(api_client)


def load_release_status(
    namespace: str,
    release: str,
    *,
    batch_api: k8s.BatchV1Api | None = None,
    core_api: k8s.CoreV1Api | None = None,
    max_failures: int | None = 10,
) -> ReleaseStatus:
    """List the worker Jobs of ``release`` in ``namespace`` and their pods; build the report."""
    if batch_api is None or core_api is None:
        batch_api, core_api = api_clients()
    jobs = batch_api.list_namespaced_job(namespace, label_selector=release_selector(release)).items
    reports = []
    for job in jobs:
        # controller-uid, not the name: a recreated Job of the same name must not see old pods.
        selector = f"{CONTROLLER_UID_LABEL}={_meta(job).uid}"
        pods = core_api.list_namespaced_pod(namespace, label_selector=selector).items
        reports.append(job_report(job, pods, max_failures=max_failures))
    reports.sort(key=lambda r: (r.created_at is not None, r.created_at or datetime.min.replace(tzinfo=UTC)), reverse=True)
    return ReleaseStatus(namespace=namespace, release=release, jobs=tuple(reports))


def load_job_report(
    namespace: str,
    name: str,
    *,
    batch_api: k8s.BatchV1Api | None = None,
    core_api: k8s.CoreV1Api | None = None,
    max_failures: int | None = 10,
) -> JobReport:
    """Read one Job by name and its pods (the in-cluster reducer watching its worker Job)."""
    if batch_api is None or core_api is None:
        batch_api, core_api = api_clients()
    job = batch_api.read_namespaced_job(name, namespace)
    pods = core_api.list_namespaced_pod(namespace, label_selector=f"{CONTROLLER_UID_LABEL}={_meta(job).uid}").items
    return job_report(job, pods, max_failures=max_failures)


def give_up_on_failed_indexes(
    job: str, namespace: str, *, warn: Callable[[str], None]
) -> Callable[[list[int]], tuple[str, dict[int, str]] | None]:
    """A ``give_up`` for :func:`~shopsimrl.runner.reduce.wait_for_markers`: the worker Job's own view.

    Waiting ends once every pending shard is a failed index of the Job, or the Job has finished.
    Without API access (no RBAC, no cluster) it ``warn``s once and the wait runs to its timeout.
    """
    warned: list[str] = []

    def give_up(pending: list[int]) -> tuple[str, dict[int, str]] | None:
        try:
            report = load_job_report(namespace, job)
        except Exception as exc:  # ApiException, no kubeconfig, connection refused: best effort only
            if not warned:
                warned.append(str(exc))
                warn(f"cannot read Job {job} in {namespace} ({type(exc).__name__}: {str(exc)[:200]}); waiting for the timeout")
            return None
        failed = set(report.failed)
        if not (set(pending) <= failed or report.finished):
            return None
        last_exit = {}
        for failure in reversed(report.failures):  # most recent last, so it wins
            if failure.index is not None and failure.exit_code is not None:
                last_exit[failure.index] = f"; last exit {failure.exit_code} ({failure.meaning}) in container {failure.container}"
        why = {
            index: (f"index {index} failed in Job {job}" if index in failed else f"Job {job} is {report.condition} without it")
            + last_exit.get(index, "")
            for index in pending
        }
        state = f"is {report.condition}" if report.finished else f"reports failed indexes {format_index_ranges(sorted(failed))}"
        return f"the worker Job {job} {state}; {len(pending)} shards will not commit", why

    return give_up
