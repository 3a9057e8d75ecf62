"""The trackers' own stores, read back: a real MLflow tracking server (``mlflow server`` with a
sqlite store, started as a subprocess) and W&B's offline run directory.

W&B offline has no API to read a run back (``wandb.Api`` needs the server), and wandb 0.31 no
longer ships its Python reader of the ``.wandb`` file, so :func:`wandb_records` reads that file's
framing as the writer lays it out (a LevelDB log: a 7-byte ``:W&B`` header, 32 KiB blocks of
records with a CRC-32, a length and a FULL/FIRST/MIDDLE/LAST type) and decodes each record with
wandb's own protobuf classes. Tables are read from the files W&B writes (``files/media/table``),
artifacts from the staged copies the artifact records name (their MD5 checked).
"""

from __future__ import annotations

import base64
import contextlib
import hashlib
import json
import os
import signal
import socket
import struct
import subprocess
import sys
import time
import zlib
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from shopsimrl.testbed.serving import free_port

_HEADER = struct.Struct("<4sHB")
_RECORD = struct.Struct("<IHB")
_BLOCK = 32 * 1024
_FULL, _FIRST, _MIDDLE, _LAST = 1, 2, 3, 4


def wandb_environment(root: Path) -> dict[str, str]:
    """W&B's own directories under ``root`` (nothing in the home directory), no credentials or
    project from the caller's environment."""
    env = {key: value for key, value in os.environ.items() if not key.startswith(("WANDB_", "MLFLOW_"))}
    for name in ("CACHE", "CONFIG", "DATA", "ARTIFACT"):
        (root / name.lower()).mkdir(parents=True, exist_ok=True)
        env[f"WANDB_{name}_DIR"] = str(root / name.lower())
    return env


def wandb_records(path: Path) -> Iterator[Any]:
    """Every record of a ``.wandb`` file, decoded by wandb's protobuf ``Record``; each checksum checked."""
    from wandb.proto import wandb_internal_pb2

    data = path.read_bytes()
    ident, magic, version = _HEADER.unpack_from(data, 0)
    assert (ident, magic, version) == (b":W&B", 0xBEE1, 0), (ident, magic, version)
    position, pending = _HEADER.size, b""
    while position + _RECORD.size <= len(data):
        left = _BLOCK - position % _BLOCK
        if left < _RECORD.size:  # the writer pads a block's tail that cannot hold a header
            position += left
            continue
        checksum, length, kind = _RECORD.unpack_from(data, position)
        if (checksum, length, kind) == (0, 0, 0):
            position += left
            continue
        chunk = data[position + _RECORD.size : position + _RECORD.size + length]
        assert zlib.crc32(chunk, zlib.crc32(bytes([kind]))) == checksum, f"{path}: bad checksum at {position}"
        position += _RECORD.size + length
        if kind == _FULL:
            yield wandb_internal_pb2.Record.FromString(chunk)
        elif kind == _FIRST:
            pending = chunk
        elif kind == _MIDDLE:
            pending += chunk
        elif kind == _LAST:
            yield wandb_internal_pb2.Record.FromString(pending + chunk)


@dataclass
class WandbOfflineRun:
    directory: Path
    project: str = ""
    name: str = ""
    job_type: str = ""
    tags: list[str] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    summary: dict[str, Any] = field(default_factory=dict)
    history: list[tuple[int, dict[str, Any]]] = field(default_factory=list)
    """``(step, values)`` per ``run.log`` call, in order."""
    artifacts: list[Any] = field(default_factory=list)
    exit_code: int | None = None

    def table(self, name: str) -> dict[str, Any]:
        """A logged table as W&B wrote it: ``{"columns": [...], "data": [[...], ...]}``."""
        (path,) = (self.directory / "files" / "media" / "table").glob(f"{name}_*.table.json")
        return json.loads(path.read_text(encoding="utf-8"))  # type: ignore[no-any-return]

    def artifact_files(self, kind: str) -> dict[str, bytes]:
        """The files of the artifact of type ``kind``, from their staged copies, MD5 checked."""
        (artifact,) = [a for a in self.artifacts if a.type == kind]
        files = {}
        for entry in artifact.manifest.contents:
            payload = Path(entry.local_path).read_bytes()
            assert base64.b64encode(hashlib.md5(payload).digest()).decode() == entry.digest, entry.path
            files[entry.path] = payload
        return files


def read_wandb_run(directory: Path) -> WandbOfflineRun:
    """An offline run directory (``…/wandb/offline-run-*``) as its ``.wandb`` file records it."""
    (path,) = directory.glob("run-*.wandb")
    run = WandbOfflineRun(directory)
    for record in wandb_records(path):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run.project, run.name, run.job_type = record.run.project, record.run.display_name, record.run.job_type
            run.tags = list(record.run.tags)
            run.config = {item.key: json.loads(item.value_json) for item in record.run.config.update}
        elif kind == "summary":
            for item in record.summary.update:
                run.summary["/".join(item.nested_key) if item.nested_key else item.key] = json.loads(item.value_json)
        elif kind == "history":
            values = {
                "/".join(item.nested_key) if item.nested_key else item.key: json.loads(item.value_json)
                for item in record.history.item
            }
            run.history.append((record.history.step.num, values))
        elif kind == "artifact":
            run.artifacts.append(record.artifact)
        elif kind == "exit":
            run.exit_code = record.exit.exit_code
    return run


def offline_runs(root: Path) -> list[Path]:
    return sorted((root / "wandb").glob("offline-run-*"))


@dataclass
class MlflowServer:
    uri: str
    store: Path
    artifacts: Path
    process: subprocess.Popen[bytes]

    def stop(self) -> None:
        """End the server and its uvicorn worker (its own process group), and wait until its port
        refuses connections: after this, a request to it fails for sure."""
        if self.process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.process.pid, signal.SIGTERM)
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(timeout=20)
        port = int(self.uri.rsplit(":", 1)[1])
        deadline = time.monotonic() + 30
        while True:
            with socket.socket() as probe:
                if probe.connect_ex(("127.0.0.1", port)) != 0:
                    return
            assert time.monotonic() < deadline, f"{self.uri} still accepts connections"
            time.sleep(0.1)


@contextmanager
def start_mlflow_server(root: Path) -> Iterator[MlflowServer]:
    """``mlflow server`` on a free loopback port: a sqlite backend store and a local artifact
    destination under ``root``, one worker, no job runner."""
    root.mkdir(parents=True, exist_ok=True)
    port = free_port()
    store, artifacts = root / "mlflow.sqlite", root / "artifacts"
    env = {key: value for key, value in os.environ.items() if not key.startswith("MLFLOW_")}
    env["MLFLOW_SERVER_ENABLE_JOB_EXECUTION"] = "false"  # the GenAI job runner needs huey; nothing here uses it
    log = (root / "server.log").open("wb")
    process = subprocess.Popen(
        [
            *(sys.executable, "-m", "mlflow", "server"),
            *("--backend-store-uri", f"sqlite:///{store}"),
            *("--artifacts-destination", str(artifacts)),
            *("--host", "127.0.0.1", "--port", str(port), "--workers", "1"),
        ],
        cwd=root,
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,  # the server and its uvicorn worker end together (MlflowServer.stop)
    )
    server = MlflowServer(f"http://127.0.0.1:{port}", store, artifacts, process)
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                if httpx.get(f"{server.uri}/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(
                    f"mlflow server did not start (exit {process.poll()}): {(root / 'server.log').read_text()[-2000:]}"
                )
            time.sleep(0.2)
        yield server
    finally:
        server.stop()
        log.close()


def mlflow_runs(uri: str, experiment: str) -> list[Any]:
    from mlflow import MlflowClient

    client = MlflowClient(tracking_uri=uri)
    found = client.get_experiment_by_name(experiment)
    assert found is not None, f"no MLflow experiment {experiment!r}"
    return list(client.search_runs([found.experiment_id]))


def mlflow_artifact(uri: str, run_id: str, path: str, into: Path) -> bytes:
    from mlflow import MlflowClient

    local = MlflowClient(tracking_uri=uri).download_artifacts(run_id, path, str(into))
    return Path(local).read_bytes()


def files_holding(root: Path, *secrets: str) -> list[str]:
    """Files under ``root`` whose bytes contain any of ``secrets``."""
    found = []
    for path in root.rglob("*"):
        if path.is_file() and not path.is_symlink():
            data = path.read_bytes()
            found += [f"{path}: {secret[:4]}…" for secret in secrets if secret.encode() in data]
    return found
