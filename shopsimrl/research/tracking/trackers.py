"""The two trackers: W&B (``wandb``) and MLflow (``mlflow-skinny``'s client), each imported only
when a run asks for it. Both are the :class:`~shopsimrl.research.tracking.base.Tracker` shape; what
they log is decided by the stage (:mod:`.evaluation`, :mod:`.stages`), how a failure is handled by
:class:`~shopsimrl.research.tracking.base.Tracking`.

W&B is asked not to collect what no one asked to send: no console capture, no code, no git
state (a remote URL can carry a token), no system metadata (command line, host, user) and no
system metrics. An online run without a configured key fails at once instead of prompting.
MLflow is driven through ``MlflowClient``, never the fluent API: no process-wide active run, and
none of the fluent API's automatic tags (user, source file, git commit). Its HTTP retries are
bounded (two, with the settings' timeout) unless the environment sets its own, so an unreachable
server costs the run seconds, not minutes.
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from shopsimrl.config import TrackingSection, safe_name
from shopsimrl.research.tracking.base import DEFAULT_PROJECT, TrackedRun, environment_defaults, flat_params

__all__ = ["MlflowTracker", "WandbTracker"]

_MLFLOW_BATCH = 100
"""Parameters (and tags) per ``log_batch`` call: the REST API's limit."""
_MLFLOW_PARAM_CHARS = 6000
_WANDB_TAG_CHARS = 64
_MLFLOW_NAME = re.compile(r"[^A-Za-z0-9_\-. :/]")
"""What MLflow refuses in a metric, parameter or tag name (one such name fails a whole batch)."""


def _mlflow_name(name: str) -> str:
    return _MLFLOW_NAME.sub("_", name)


def _artifact_name(name: str) -> str:
    return safe_name(name)[:128] or "shopsimrl"


class WandbTracker:
    name = "wandb"

    def __init__(self) -> None:
        self._run: Any = None
        self._offline = False

    def start(self, run: TrackedRun, settings: TrackingSection) -> None:
        import wandb

        mode = settings.mode or os.environ.get("WANDB_MODE") or "online"
        self._offline = mode in ("offline", "dryrun")
        wandb_settings = wandb.Settings(
            console="off",
            save_code=False,
            disable_git=True,
            disable_job_creation=True,
            x_disable_meta=True,
            x_disable_stats=True,
            x_disable_machine_info=True,
            x_save_requirements=False,
            silent=True,
            init_timeout=settings.timeout_seconds,
        )
        if not self._offline and not wandb.login(prompt=False, verify=True, timeout=int(settings.timeout_seconds)):
            raise RuntimeError("no W&B API key: set WANDB_API_KEY (or run `wandb login`), or use tracking.mode: offline")
        directory = settings.dir
        if directory is not None:
            Path(directory).mkdir(parents=True, exist_ok=True)
        tags = [tag for tag in [*settings.tags, run.kind] if len(tag) <= _WANDB_TAG_CHARS]
        self._run = wandb.init(
            project=settings.project or os.environ.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            entity=settings.entity,
            name=run.name,
            job_type=run.kind,
            tags=list(dict.fromkeys(tags)),
            config={"shopsimrl": run.identity},
            dir=directory,
            mode="offline" if self._offline else "online",
            reinit="create_new",
            settings=wandb_settings,
        )

    def log_scalars(self, scalars: Mapping[str, float], step: int | None) -> None:
        self._run.log(dict(scalars), step=step)
        if step is None:
            # A one-off stage (an evaluation's headline): the run's summary holds each number.
            self._run.summary.update(dict(scalars))

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        import wandb

        self._run.log({name: wandb.Table(columns=list(columns), data=[list(row) for row in rows], allow_mixed_types=True)})

    def log_files(self, name: str, kind: str, files: Mapping[str, Path]) -> None:
        import wandb

        artifact = wandb.Artifact(_artifact_name(name), type=_artifact_name(kind))
        for file_name, path in files.items():
            artifact.add_file(str(path), name=file_name)
        self._run.log_artifact(artifact)

    def finish(self, failed: bool) -> str:
        run, self._run = self._run, None
        if run is None:
            return "no run"
        where = run.settings.sync_dir if self._offline else run.url
        run.finish(exit_code=1 if failed else 0)
        if self._offline:
            return f"W&B offline run {run.id} in {where} (upload it with `wandb sync {where}`)"
        return f"W&B run {where}"


class MlflowTracker:
    name = "mlflow"

    def __init__(self) -> None:
        self._client: Any = None
        self._run_id: str | None = None
        self._experiment = ""
        self._experiment_id = ""
        self._timeout = 60.0

    @contextmanager
    def _quiet(self) -> Iterator[None]:
        """Bounded HTTP retries and timeout (unless the environment sets its own), and MLflow's info
        lines (a "view run" URL per run) kept off the run's terminal."""
        logger = logging.getLogger("mlflow")
        level = logger.level
        logger.setLevel(max(level, logging.WARNING))
        limits = {
            "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2",
            "MLFLOW_HTTP_REQUEST_BACKOFF_FACTOR": "1",
            "MLFLOW_HTTP_REQUEST_TIMEOUT": str(max(1, round(self._timeout))),
            # MLflow writes "View run … at URL" to stdout, where the command's own output goes.
            "MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT": "true",
        }
        try:
            with environment_defaults(limits):
                yield
        finally:
            logger.setLevel(level)

    def start(self, run: TrackedRun, settings: TrackingSection) -> None:
        from mlflow import MlflowClient
        from mlflow.entities import Param

        self._timeout = settings.timeout_seconds
        with self._quiet():
            client = MlflowClient(tracking_uri=settings.tracking_uri)
            self._experiment = settings.project or os.environ.get("MLFLOW_EXPERIMENT_NAME") or DEFAULT_PROJECT
            experiment = client.get_experiment_by_name(self._experiment)
            if experiment is None:
                try:
                    experiment_id = client.create_experiment(self._experiment)
                except Exception:  # another process created it between the two calls: read it again
                    experiment = client.get_experiment_by_name(self._experiment)
                    if experiment is None:
                        raise
                    experiment_id = experiment.experiment_id
            else:
                experiment_id = experiment.experiment_id
            self._experiment_id = str(experiment_id)
            tags = {
                _mlflow_name(k): v
                for k, v in {**run.tags, **dict.fromkeys(settings.tags, "true"), "shopsimrl.kind": run.kind}.items()
            }
            created = client.create_run(experiment_id, run_name=run.name, tags=tags)
            self._client, self._run_id = client, created.info.run_id
            params = [Param(_mlflow_name(key), value[:_MLFLOW_PARAM_CHARS]) for key, value in flat_params(run.identity)]
            for start in range(0, len(params), _MLFLOW_BATCH):
                client.log_batch(self._run_id, params=params[start : start + _MLFLOW_BATCH])

    def log_scalars(self, scalars: Mapping[str, float], step: int | None) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_mlflow_name(key), value, now, step or 0) for key, value in scalars.items()]
        with self._quiet():
            for start in range(0, len(metrics), _MLFLOW_BATCH):
                self._client.log_batch(self._run_id, metrics=metrics[start : start + _MLFLOW_BATCH])

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        data = {column: [row[index] for row in rows] for index, column in enumerate(columns)}
        with self._quiet():
            self._client.log_table(self._run_id, data=data, artifact_file=f"tables/{_artifact_name(name)}.json")

    def log_files(self, name: str, kind: str, files: Mapping[str, Path]) -> None:
        with self._quiet():
            for path in files.values():
                self._client.log_artifact(self._run_id, str(path), artifact_path=_artifact_name(name))

    def finish(self, failed: bool) -> str:
        client, run_id = self._client, self._run_id
        self._client = self._run_id = None
        if client is None or run_id is None:
            return "no run"
        with self._quiet():
            client.set_terminated(run_id, "FAILED" if failed else "FINISHED")
        uri = str(client.tracking_uri)
        if uri.startswith(("http://", "https://")):
            return (
                f"MLflow run {uri.rstrip('/')}/#/experiments/{self._experiment_id}/runs/{run_id} (experiment {self._experiment})"
            )
        return f"MLflow run {run_id} in experiment {self._experiment} at {uri}"
