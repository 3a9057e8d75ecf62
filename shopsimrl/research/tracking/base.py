"""What every tracked stage shares: the settings, the run's identity, the fan-out to the trackers,
their failures kept from the caller, and what may leave this machine.

A stage (an evaluation run's summary, a gate's fit, a judge's summary, a training step) opens a
:class:`Tracking` with its :class:`TrackedRun`, logs scalars, tables and files through it, and
closes it. Each tracker (:mod:`.trackers`) is started, fed and finished behind a guard: the first
exception a tracker raises (its package missing, the network, a refused key, a bad value) is
logged once, that tracker is finished as failed and skipped from then on, and the caller goes on;
nothing here raises for a tracker's sake, so a run's exit code never depends on a tracker.

Nothing secret leaves: every text (parameter, tag, table cell, file, the message of a tracker's
error) goes through :class:`Redactor` first, which removes ``user:password@`` and credential-like
query values from any URL in it (:func:`shopsimrl.schemas.redact_uri`, the rule of traces and
manifests) and masks the values of this process's secret-looking environment variables (API keys,
tokens, passwords) wherever they appear.
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import structlog

from shopsimrl.config import TRACKERS, TrackingSection
from shopsimrl.schemas import redact_uri

__all__ = [
    "DEFAULT_PROJECT",
    "Redactor",
    "TrackedRun",
    "Tracker",
    "TrackerOutcome",
    "Tracking",
    "finite_scalars",
    "flat_params",
]

_log = structlog.get_logger("shopsimrl.tracking")

DEFAULT_PROJECT = "shopsimrl"
"""The W&B project and MLflow experiment when neither the settings nor the trackers' own
variables (``WANDB_PROJECT``, ``MLFLOW_EXPERIMENT_NAME``) name one."""

_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>()\[\]{}]+")
_SECRET_VARIABLE = re.compile(r"(KEY|TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH)", re.I)
_MIN_SECRET = 8
"""Shorter values of secret-looking variables are not masked (``1``, ``true`` would mask noise)."""


class Redactor:
    """Removes credentials from what goes to a tracker: URLs' ``user:password@`` and credential
    query values, and the values of secret-looking environment variables (read when made)."""

    def __init__(self, environ: Mapping[str, str] | None = None, extra_secrets: Sequence[str] = ()) -> None:
        env = os.environ if environ is None else environ
        secrets = {value for name, value in env.items() if _SECRET_VARIABLE.search(name) and len(value) >= _MIN_SECRET}
        secrets.update(value for value in extra_secrets if len(value) >= _MIN_SECRET)
        # Longest first, so a secret that contains another is masked whole.
        self._secrets = sorted(secrets, key=len, reverse=True)

    def text(self, value: str) -> str:
        value = _URL.sub(lambda match: redact_uri(match.group(0)), value)
        for secret in self._secrets:
            if secret in value:
                value = value.replace(secret, "REDACTED")
        return value

    def value(self, value: Any) -> Any:
        """``value`` with every string in it redacted (mappings and sequences walked)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, Mapping):
            return {self.text(str(key)): self.value(item) for key, item in value.items()}
        if isinstance(value, (list, tuple)):
            return [self.value(item) for item in value]
        return value

    def data(self, payload: bytes) -> bytes:
        """A file's bytes, redacted when they are UTF-8 text (a binary file is passed as is)."""
        try:
            text = payload.decode("utf-8")
        except UnicodeDecodeError:
            return payload
        cleaned = self.text(text)
        return payload if cleaned == text else cleaned.encode("utf-8")


@dataclass(frozen=True)
class TrackedRun:
    """What a tracker's run is: its name, the stage (``evaluation``, ``gate``, ``judge``,
    ``training``), the run identity (config/parameters) and tags."""

    name: str
    kind: str
    identity: dict[str, Any]
    """Nested; W&B takes it as the run config, MLflow as flattened parameters."""
    tags: dict[str, str] = field(default_factory=dict)
    """Identity tags (``shopsimrl.experiment`` …): MLflow tags; W&B takes the values that are short."""


class Tracker(Protocol):
    """One tracker's adapter (:mod:`.trackers`). Any method may raise; :class:`Tracking` guards them."""

    name: str

    def start(self, run: TrackedRun, settings: TrackingSection) -> None: ...

    def log_scalars(self, scalars: Mapping[str, float], step: int | None) -> None: ...

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None: ...

    def log_files(self, name: str, kind: str, files: Mapping[str, Path]) -> None: ...

    def finish(self, failed: bool) -> str:
        """Close the run; returns where it went (a directory, a run id and server), credentials removed."""
        ...


@dataclass
class TrackerOutcome:
    tracker: str
    ok: bool
    where: str | None = None
    error: str | None = None
    """The first failure (stage and redacted message); None when every call went through."""

    def line(self) -> str:
        if self.ok:
            return f"tracked in {self.tracker}: {self.where}"
        return f"not tracked in {self.tracker}: {self.error}; the run's results are unaffected"


def _new_tracker(name: str) -> Tracker:
    from shopsimrl.research.tracking.trackers import MlflowTracker, WandbTracker

    return WandbTracker() if name == "wandb" else MlflowTracker()


class Tracking:
    """The trackers of ``settings.backends`` for one tracked run, as a context manager. Every call
    goes to each tracker still alive; a tracker's exception ends that tracker, never the caller.
    ``outcomes`` (after the ``with``) says, per tracker, where the run went or why it did not."""

    def __init__(
        self,
        settings: TrackingSection,
        run: TrackedRun,
        *,
        redactor: Redactor | None = None,
        make_tracker: Callable[[str], Tracker] = _new_tracker,
    ) -> None:
        self.settings = settings
        self.run = run
        self.redact = redactor or Redactor()
        self._make = make_tracker
        self._alive: list[Tracker] = []
        self.outcomes: list[TrackerOutcome] = []
        self._by_name: dict[str, TrackerOutcome] = {}

    # -- the guard -------------------------------------------------------------------------

    def _fail(self, tracker: str, stage: str, exc: BaseException) -> None:
        message = self.redact.text(f"{type(exc).__name__}: {exc}".strip().rstrip(":"))
        message = message if len(message) <= 500 else message[:500] + "…"
        outcome = self._by_name[tracker]
        outcome.ok, outcome.error = False, f"{stage} failed ({message})"
        _log.warning("tracker_failed", tracker=tracker, stage=stage, error=message, note="not tracked there; results unaffected")

    def _each(self, stage: str, call: Callable[[Tracker], None]) -> None:
        for tracker in list(self._alive):
            try:
                call(tracker)
            except Exception as exc:  # a tracker's failure of any kind must not reach the run
                self._fail(tracker.name, stage, exc)
                self._alive.remove(tracker)
                self._close(tracker, failed=True)

    def _close(self, tracker: Tracker, *, failed: bool) -> None:
        try:
            where = tracker.finish(failed)
        except Exception as exc:  # as in _each
            if self._by_name[tracker.name].ok:
                self._fail(tracker.name, "finish", exc)
            return
        if self._by_name[tracker.name].ok:
            self._by_name[tracker.name].where = self.redact.text(where)

    # -- the stage's calls -----------------------------------------------------------------

    def __enter__(self) -> Tracking:
        for name in self.settings.backends:
            if name not in TRACKERS:  # the settings model refuses it; a caller's own list may not
                continue
            outcome = TrackerOutcome(name, ok=True)
            self.outcomes.append(outcome)
            self._by_name[name] = outcome
            try:
                tracker = self._make(name)
                tracker.start(self._clean_run(), self.settings)
            except ImportError as exc:
                missing = exc.name or name
                self._fail(
                    name,
                    "start",
                    ImportError(f"{missing} is not installed; pip install 'shopsimrl[tracking]' (shopsimrl-research[tracking])"),
                )
                continue
            except Exception as exc:  # as in _each
                self._fail(name, "start", exc)
                continue
            self._alive.append(tracker)
        return self

    def __exit__(self, kind: object, exc: object, tb: object) -> None:
        for tracker in self._alive:
            self._close(tracker, failed=exc is not None)
        self._alive = []

    def _clean_run(self) -> TrackedRun:
        return TrackedRun(
            self.redact.text(self.run.name),
            self.run.kind,
            self.redact.value(self.run.identity),
            {self.redact.text(key): self.redact.text(value) for key, value in self.run.tags.items()},
        )

    @property
    def active(self) -> bool:
        return bool(self._alive)

    def log_scalars(self, scalars: Mapping[str, Any], step: int | None = None) -> None:
        """Finite numbers only (None, NaN and text are left out: a tracker's chart takes numbers)."""
        clean = finite_scalars(scalars)
        if clean:
            self._each("log scalars", lambda tracker: tracker.log_scalars(clean, step))

    def log_table(self, name: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> None:
        cleaned = [[self._cell(cell) for cell in row] for row in rows]
        self._each(f"log table {name}", lambda tracker: tracker.log_table(name, list(columns), cleaned))

    def log_files(self, name: str, kind: str, files: Mapping[str, bytes | Path]) -> None:
        """One artifact ``name`` of ``kind`` holding ``files`` (file name → contents or a local
        file), each redacted and staged in a private temporary directory first."""
        if not self._alive:
            return
        import tempfile

        with tempfile.TemporaryDirectory(prefix="shopsimrl-tracking-") as tmp:
            staged: dict[str, Path] = {}
            for file_name, content in files.items():
                payload = content.read_bytes() if isinstance(content, Path) else content
                target = Path(tmp) / Path(file_name).name
                target.write_bytes(self.redact.data(payload))
                staged[target.name] = target
            self._each(f"log artifact {name}", lambda tracker: tracker.log_files(name, kind, staged))

    def _cell(self, value: Any) -> Any:
        if isinstance(value, float) and not math.isfinite(value):
            return None
        if isinstance(value, str):
            return self.redact.text(value)
        return value

    def report_lines(self) -> list[str]:
        return [outcome.line() for outcome in self.outcomes]


def finite_scalars(values: Mapping[str, Any]) -> dict[str, float]:
    """The entries of ``values`` that are finite numbers (bools as 0/1), as floats."""
    found: dict[str, float] = {}
    for key, value in values.items():
        if isinstance(value, bool) or (isinstance(value, (int, float)) and math.isfinite(value)):
            found[key] = float(value)
    return found


def flat_params(value: Mapping[str, Any], prefix: str = "") -> Iterator[tuple[str, str]]:
    """Nested identity → ``dotted.key`` and text (MLflow parameters), None as ``null``."""
    for key, item in value.items():
        dotted = f"{prefix}{key}"
        if isinstance(item, Mapping) and item:
            yield from flat_params(item, dotted + ".")
        elif isinstance(item, (list, tuple)):
            yield dotted, ",".join(map(str, item))
        else:
            yield dotted, "null" if item is None else str(item).lower() if isinstance(item, bool) else str(item)


@contextmanager
def environment_defaults(values: Mapping[str, str]) -> Iterator[None]:
    """``values`` as environment variables where the process has none, for the duration (the
    trackers read their timeouts and retries from variables); restored after."""
    added = [name for name in values if name not in os.environ]
    for name in added:
        os.environ[name] = values[name]
    try:
        yield
    finally:
        for name in added:
            os.environ.pop(name, None)
