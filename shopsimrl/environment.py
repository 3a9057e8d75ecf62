"""ShopSimulator over HTTP: the environment seam of the runtime and its httpx adapter.

One :class:`ShopSimulatorEnvironment` per process owns a pooled ``httpx.AsyncClient``;
each episode opens an :class:`EnvironmentEpisode`, which holds at most one server lease
(``env_idx`` + ``lease_id``) from ``reset`` until ``close``.

Errors::

    ShopEnvironmentError                  anything the environment adapter raises on purpose
    ├── EnvironmentUnavailableError       infrastructure: connect/read failures, timeouts,
    │                                     HTTP 502/503/504, a 500 without the server's
    │                                     envelope (after the retries that are safe);
    │                                     the scheduler may retry the whole episode
    ├── EnvironmentResponseError          the server answered, and the answer is a failure:
    │   │                                 HTTP 4xx, a 500 carrying ``result.error`` (the
    │   │                                 application refused: unknown task, episode already
    │   │                                 terminated), ``result.error`` (even with HTTP 200),
    │   │                                 a body that is not ``{"result": {...}}``, a missing
    │   │                                 or mistyped field, a terminate reason not echoed
    │   └── LeaseError                    HTTP 409: the lease is stale or invalid
    └── EnvironmentVersionError           a pinned version differs from the server's, or the
                                          observation version changed within an episode

Misuse (a reset while a lease is held, a step without one, an unknown termination reason)
raises ``RuntimeError``/``ValueError`` instead, so ``except ShopEnvironmentError`` never
hides a bug.

Retries. ``interact`` and ``terminate`` change server state and are not idempotent, so they
are retried only when the request provably never left this process (connection refused,
connect or pool timeout). ``reset`` is retried in those cases and on HTTP 502/503, where a
proxy did not reach the server; a reset that timed out is *not* retried, because the server
may still grant it a slot. ``release_one`` and ``GET /healthz`` are retried on any transport
error and on any 5xx; a 409 on a ``release_one`` retry, after an attempt that may have
reached the server, means that attempt already released the lease.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, Final, Protocol, runtime_checkable

import httpx
import structlog

from shopsimrl.schemas import redact_uri

__all__ = [
    "ADAPTER_NAME",
    "TERMINATION_REASONS",
    "EnvironmentEpisode",
    "EnvironmentResponseError",
    "EnvironmentUnavailableError",
    "EnvironmentVersionError",
    "LeaseError",
    "ShopEnvironment",
    "ShopEnvironmentError",
    "ShopSimulatorEnvironment",
    "ShopSimulatorEpisode",
    "ShopSimulatorSettings",
]

ADAPTER_NAME: Final = "shopsimulator_http"
TERMINATION_REASONS: Final = ("action_limit", "generation_length")
INTERACTION_MODES: Final = ("single_turn", "multi_turn")

_log = structlog.get_logger("shopsimrl.environment")


# --------------------------------------------------------------------------- errors


class ShopEnvironmentError(Exception):
    """Base of every deliberate environment adapter failure."""

    def __init__(self, message: str, *, action: str | None = None, status: int | None = None) -> None:
        super().__init__(message)
        self.action = action
        self.status = status


class EnvironmentUnavailableError(ShopEnvironmentError):
    """The environment could not be reached or failed internally; retrying later may work."""

    def __init__(
        self,
        message: str,
        *,
        action: str | None = None,
        status: int | None = None,
        request_sent: bool = True,
        attempts: int = 1,
    ) -> None:
        super().__init__(message, action=action, status=status)
        self.request_sent = request_sent
        self.attempts = attempts


class EnvironmentResponseError(ShopEnvironmentError):
    """The server answered with a failure or with a body that breaks the contract."""

    def __init__(
        self, message: str, *, action: str | None = None, status: int | None = None, server_message: str | None = None
    ) -> None:
        super().__init__(message, action=action, status=status)
        self.server_message = server_message


class LeaseError(EnvironmentResponseError):
    """HTTP 409: the server no longer recognises this ``env_idx``/``lease_id`` pair."""


class EnvironmentVersionError(ShopEnvironmentError):
    """The server's environment or observation version is not the expected one."""


# --------------------------------------------------------------------------- protocols


@runtime_checkable
class EnvironmentEpisode(Protocol):
    """One lease, one episode: ``reset`` → ``step``/``terminate`` … → ``close``."""

    environment_version: str | None
    observation_version: str | None

    async def reset(self, task_id: int) -> dict[str, Any]: ...

    async def step(self, action: str) -> dict[str, Any]: ...

    async def terminate(self, reason: str) -> dict[str, Any]: ...

    async def close(self) -> None: ...


@runtime_checkable
class ShopEnvironment(Protocol):
    """Process-wide handle on one environment service."""

    def identity(self) -> dict[str, Any]: ...

    def semantic_identity(self) -> dict[str, Any]: ...

    def open_episode(self) -> EnvironmentEpisode: ...

    async def healthz(self) -> dict[str, Any]: ...

    async def aclose(self) -> None: ...


# --------------------------------------------------------------------------- settings


@dataclass(frozen=True, kw_only=True)
class ShopSimulatorSettings:
    """Connection settings of the ShopSimulator adapter.

    ``ShopSimulatorSettings(base_url="http://shop:5700", persona=True)``
    ``ShopSimulatorSettings(reset_timeout=None)``  # wait for a free slot without limit
    """

    base_url: str = "http://127.0.0.1:5700"
    persona: bool = False
    interaction_mode: str = "single_turn"
    timeout: float = 30.0
    """Seconds for connect/read/write of every call except the read of ``reset``."""
    reset_timeout: float | None = 900.0
    """Cap on how long ``reset`` waits for its answer; the server queues resets while every
    slot is leased. None waits without limit."""
    max_retries: int = 3
    """Extra attempts, only where a retry is safe (see the module docstring)."""
    retry_backoff_seconds: float = 0.5
    expected_environment_version: str | None = None
    expected_observation_version: str | None = None
    max_connections: int = 512
    trust_env: bool = False

    def __post_init__(self) -> None:
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"environment base_url must start with http:// or https://, got {self.base_url!r}")
        if self.interaction_mode not in INTERACTION_MODES:
            raise ValueError(
                f"interaction_mode must be one of {list(INTERACTION_MODES)}, got {self.interaction_mode!r}"
            )
        if not self.timeout > 0:
            raise ValueError(f"environment timeout must be > 0 seconds, got {self.timeout!r}")
        if self.reset_timeout is not None and not self.reset_timeout > 0:
            raise ValueError(f"reset_timeout must be > 0 seconds or None, got {self.reset_timeout!r}")
        if isinstance(self.max_retries, bool) or not isinstance(self.max_retries, int) or self.max_retries < 0:
            raise ValueError(f"max_retries must be an integer >= 0, got {self.max_retries!r}")
        if self.retry_backoff_seconds < 0:
            raise ValueError(f"retry_backoff_seconds must be >= 0, got {self.retry_backoff_seconds!r}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections!r}")
        for name in ("expected_environment_version", "expected_observation_version"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")


# --------------------------------------------------------------------------- retry policy


@dataclass(frozen=True)
class _RetryPolicy:
    after_sent: bool
    """Retry failures where the request may have reached the server."""
    statuses: frozenset[int]
    """HTTP statuses (5xx) worth another attempt."""

    def allows(self, exc: EnvironmentUnavailableError) -> bool:
        if exc.status is not None:
            return exc.status in self.statuses
        if isinstance(exc.__cause__, httpx.PoolTimeout):
            # The local pool stayed saturated for a whole timeout; waiting again rarely helps.
            return False
        return self.after_sent or not exc.request_sent


_FIVE_XX = frozenset(range(500, 600))
_NOT_SENT_ONLY = _RetryPolicy(after_sent=False, statuses=frozenset())
_RESET = _RetryPolicy(after_sent=False, statuses=frozenset({502, 503}))
_IDEMPOTENT = _RetryPolicy(after_sent=True, statuses=_FIVE_XX)

# These httpx errors are raised before a single byte of the request was written.
_NOT_SENT_ERRORS: tuple[type[Exception], ...] = (httpx.ConnectError, httpx.ConnectTimeout, httpx.PoolTimeout)

_PUBLIC_STATE_FIELDS = ("observation", "observation_state")


# --------------------------------------------------------------------------- adapter


class ShopSimulatorEnvironment:
    """The ShopSimulator HTTP API (``POST /api/shop_agent``, ``GET /healthz``) behind ``ShopEnvironment``."""

    def __init__(
        self,
        settings: ShopSimulatorSettings | None = None,
        *,
        client: httpx.AsyncClient | None = None,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
    ) -> None:
        self.settings = settings or ShopSimulatorSettings()
        self._base_url = self.settings.base_url.rstrip("/")
        self._owns_client = client is None
        self._client = client or httpx.AsyncClient(
            timeout=self.settings.timeout,
            limits=httpx.Limits(
                max_connections=self.settings.max_connections,
                max_keepalive_connections=self.settings.max_connections,
            ),
            trust_env=self.settings.trust_env,
        )
        self._sleep = sleep
        self._environment_version: str | None = None
        self._observation_version: str | None = None

    # -- identity

    def identity(self) -> dict[str, Any]:
        """``provenance.environment``: settings plus the versions seen by the latest reset."""
        return {
            "adapter": ADAPTER_NAME,
            "base_url": redact_uri(self._base_url),
            "persona": self.settings.persona,
            "interaction_mode": self.settings.interaction_mode,
            "environment_version": self._environment_version,
            "observation_version": self._observation_version,
        }

    def semantic_identity(self) -> dict[str, Any]:
        """What changes episode outcomes: no URL, no timeouts, no retries."""
        identity: dict[str, Any] = {
            "adapter": ADAPTER_NAME,
            "persona": self.settings.persona,
            "interaction_mode": self.settings.interaction_mode,
        }
        if self.settings.expected_environment_version is not None:
            identity["expected_environment_version"] = self.settings.expected_environment_version
        if self.settings.expected_observation_version is not None:
            identity["expected_observation_version"] = self.settings.expected_observation_version
        return identity

    # -- lifecycle

    def open_episode(self) -> ShopSimulatorEpisode:
        return ShopSimulatorEpisode(self)

    async def healthz(self) -> dict[str, Any]:
        """``GET /healthz``; pinned versions are checked against the versions it reports."""
        body = await self._call("healthz", None, timeout=httpx.Timeout(self.settings.timeout), policy=_IDEMPOTENT)
        self._check_pins(body, action="healthz")
        return body

    async def aclose(self) -> None:
        if self._owns_client:
            await self._client.aclose()

    # -- plumbing shared with episodes

    def _record_versions(self, environment_version: str | None, observation_version: str) -> None:
        self._environment_version = environment_version
        self._observation_version = observation_version

    def _check_pins(self, payload: dict[str, Any], *, action: str) -> None:
        for key, expected in (
            ("environment_version", self.settings.expected_environment_version),
            ("observation_version", self.settings.expected_observation_version),
        ):
            if expected is None:
                continue
            if key == "observation_version" and action != "healthz":
                actual = payload.get("observation_state", {}).get(key)
            else:
                actual = payload.get(key)
            if actual != expected:
                raise EnvironmentVersionError(
                    f"ShopSimulator {action}: {key} is {actual!r}, but the configuration pins {expected!r}",
                    action=action,
                )

    def _reset_timeout(self) -> httpx.Timeout:
        # The server answers a reset only once a slot is free, so the read (and the wait for a
        # pooled connection) is bounded by reset_timeout instead of the per-call timeout.
        cap = self.settings.reset_timeout
        return httpx.Timeout(connect=self.settings.timeout, read=cap, write=self.settings.timeout, pool=cap)

    async def _call(
        self,
        action: str,
        payload: dict[str, Any] | None,
        *,
        timeout: httpx.Timeout,
        policy: _RetryPolicy,
        stale_lease_means_done: bool = False,
    ) -> dict[str, Any]:
        """One logical call with the retries ``policy`` allows; returns ``result`` (or the healthz body)."""
        may_have_arrived = False
        attempts = self.settings.max_retries + 1
        for attempt in range(1, attempts + 1):
            try:
                return await self._send(action, payload, timeout)
            except LeaseError:
                if stale_lease_means_done and may_have_arrived:
                    # An earlier attempt released the lease, and its answer was lost.
                    return {"message": "lease already released by an earlier attempt"}
                raise
            except EnvironmentUnavailableError as exc:
                may_have_arrived = may_have_arrived or exc.request_sent
                exc.attempts = attempt
                if attempt == attempts or not policy.allows(exc):
                    raise
                delay = self.settings.retry_backoff_seconds * 2 ** (attempt - 1)
                _log.warning("environment call retried", action=action, attempt=attempt, error=str(exc), delay=delay)
                await self._sleep(delay)
        raise AssertionError("unreachable")  # the loop always returns or raises

    async def _send(self, action: str, payload: dict[str, Any] | None, timeout: httpx.Timeout) -> dict[str, Any]:
        try:
            if payload is None:
                response = await self._client.get(f"{self._base_url}/healthz", timeout=timeout)
            else:
                response = await self._client.post(f"{self._base_url}/api/shop_agent", json=payload, timeout=timeout)
        except httpx.ReadTimeout as exc:
            raise EnvironmentUnavailableError(
                f"ShopSimulator {action}: no answer within the read timeout ({exc.__class__.__name__})", action=action
            ) from exc
        except httpx.TransportError as exc:
            raise EnvironmentUnavailableError(
                f"ShopSimulator {action}: {exc.__class__.__name__}: {exc or 'transport error'}",
                action=action,
                request_sent=not isinstance(exc, _NOT_SENT_ERRORS),
            ) from exc
        return _decode(action, response, enveloped=payload is not None)


def _decode(action: str, response: httpx.Response, *, enveloped: bool) -> dict[str, Any]:
    status = response.status_code
    try:
        body = json.loads(response.content)
    except ValueError:
        body = None
    result = body.get("result") if enveloped and isinstance(body, dict) else body
    server_message = None
    if isinstance(result, dict) and result.get("error"):
        server_message = str(result["error"])
    elif not isinstance(result, dict):
        server_message = response.text[:300] or None
    detail = f"HTTP {status}" + (f": {server_message}" if server_message else "")
    # A 500 that carries the server's own {"result": {"error": …}} is a refusal by the application
    # (unknown task, episode already terminated): deterministic, retrying cannot help. Gateway
    # errors and 500s without the envelope mean the service itself is unavailable.
    if status >= 500 and not (status == 500 and enveloped and server_message is not None and isinstance(result, dict)):
        raise EnvironmentUnavailableError(f"ShopSimulator {action} failed: {detail}", action=action, status=status)
    if status >= 500:
        raise EnvironmentResponseError(
            f"ShopSimulator {action} refused: {detail}", action=action, status=status, server_message=server_message
        )
    if status == 409:
        raise LeaseError(
            f"ShopSimulator {action} rejected a stale lease: {detail}",
            action=action,
            status=status,
            server_message=server_message,
        )
    if not 200 <= status < 300:
        raise EnvironmentResponseError(
            f"ShopSimulator {action} failed: {detail}", action=action, status=status, server_message=server_message
        )
    if not isinstance(result, dict):
        shape = 'a JSON object {"result": {...}}' if enveloped else "a JSON object"
        raise EnvironmentResponseError(
            f"ShopSimulator {action}: HTTP {status} body is not {shape}: {(response.text[:300])!r}",
            action=action,
            status=status,
        )
    if server_message is not None:
        raise EnvironmentResponseError(
            f"ShopSimulator {action} failed: {detail}", action=action, status=status, server_message=server_message
        )
    return result


def _contract_error(action: str, problem: str) -> EnvironmentResponseError:
    return EnvironmentResponseError(f"ShopSimulator {action} response {problem}", action=action, status=200)


def _check_public_state(action: str, result: dict[str, Any]) -> str:
    """Check the fields every reset/interact/terminate answer carries; return its observation_version."""
    if not isinstance(result.get("observation"), str):
        raise _contract_error(action, "needs a string 'observation'")
    state = result.get("observation_state")
    if not isinstance(state, dict):
        raise _contract_error(action, "needs an object 'observation_state'")
    version = state.get("observation_version")
    if not isinstance(version, str):
        raise _contract_error(action, "needs a string 'observation_state.observation_version'")
    if "instruction" in result:
        raise _contract_error(action, "has an 'instruction' key, which the contract forbids (outdated server?)")
    if action != "reset" and not isinstance(result.get("done"), bool):
        raise _contract_error(action, "needs a boolean 'done'")
    return version


# --------------------------------------------------------------------------- episode


class ShopSimulatorEpisode:
    """One lease on a ShopSimulator slot. Not safe for concurrent calls (nor is the server's slot)."""

    def __init__(self, environment: ShopSimulatorEnvironment) -> None:
        self._env = environment
        self.environment_version: str | None = None
        self.observation_version: str | None = None
        self.env_idx: int | None = None
        self.lease_id: str | None = None

    @property
    def holds_lease(self) -> bool:
        return self.lease_id is not None

    async def reset(self, task_id: int) -> dict[str, Any]:
        if isinstance(task_id, bool) or not isinstance(task_id, int) or task_id < 0:
            raise ValueError(f"task_id must be a non-negative integer, got {task_id!r}")
        if self.holds_lease:
            raise RuntimeError(
                f"reset while holding lease {self.lease_id} on slot {self.env_idx}; close() the episode first"
            )
        settings = self._env.settings
        payload = {
            "action": "reset",
            "idx": task_id,
            "if_persona": settings.persona,
            "include_private_goal": False,
            "interaction_mode": settings.interaction_mode,
        }
        try:
            result = await self._env._call("reset", payload, timeout=self._env._reset_timeout(), policy=_RESET)
        except EnvironmentUnavailableError as exc:
            if exc.status is None and isinstance(exc.__cause__, httpx.ReadTimeout | httpx.PoolTimeout):
                raise EnvironmentUnavailableError(
                    f"ShopSimulator reset of task {task_id} got no free slot within reset_timeout="
                    f"{settings.reset_timeout}s; if the server grants the slot later, that lease is "
                    "orphaned until release_all or a restart",
                    action="reset",
                    attempts=exc.attempts,
                ) from exc
            raise
        # Take ownership of the lease before any other check, so close() always releases it.
        env_idx, lease_id = result.get("env_idx"), result.get("lease_id")
        if isinstance(env_idx, bool) or not isinstance(env_idx, int):
            raise _contract_error("reset", f"needs an integer 'env_idx', got {env_idx!r}")
        if not isinstance(lease_id, str) or not lease_id:
            raise _contract_error("reset", f"needs a non-empty string 'lease_id', got {lease_id!r}")
        self.env_idx, self.lease_id = env_idx, lease_id
        observation_version = _check_public_state("reset", result)
        if not isinstance(result.get("task_instruction"), str):
            raise _contract_error("reset", "needs a string 'task_instruction'")
        environment_version = result.get("environment_version")
        if environment_version is not None and not isinstance(environment_version, str):
            raise _contract_error("reset", f"has a non-string 'environment_version': {environment_version!r}")
        self.environment_version, self.observation_version = environment_version, observation_version
        self._env._record_versions(environment_version, observation_version)
        self._env._check_pins(result, action="reset")
        return result

    async def step(self, action: str) -> dict[str, Any]:
        if not isinstance(action, str):
            raise TypeError(f"action must be a string such as 'search[...]', got {type(action).__name__}")
        payload = self._leased("interact", response=action)
        # interact is not idempotent: never resend a request that may have reached the server.
        result = await self._env._call(
            "interact", payload, timeout=httpx.Timeout(self._env.settings.timeout), policy=_NOT_SENT_ONLY
        )
        self._check_same_versions("interact", result)
        return result

    async def terminate(self, reason: str) -> dict[str, Any]:
        if reason not in TERMINATION_REASONS:
            raise ValueError(f"termination reason must be one of {list(TERMINATION_REASONS)}, got {reason!r}")
        payload = self._leased("terminate", termination_reason=reason)
        result = await self._env._call(
            "terminate", payload, timeout=httpx.Timeout(self._env.settings.timeout), policy=_NOT_SENT_ONLY
        )
        self._check_same_versions("terminate", result)
        echoed = result.get("termination_reason")
        if echoed != reason:
            raise _contract_error(
                "terminate",
                f"has termination_reason {echoed!r} instead of the requested {reason!r}; "
                "the server is outdated, restart it with a current ShopSimulator",
            )
        return result

    async def close(self) -> None:
        """Release the lease (with safe retries); a no-op without one. The local lease is cleared first."""
        if self.lease_id is None or self.env_idx is None:
            self.env_idx = self.lease_id = None
            return
        payload = {"action": "release_one", "env_idx": self.env_idx, "lease_id": self.lease_id}
        self.env_idx = self.lease_id = None
        await self._env._call(
            "release_one",
            payload,
            timeout=httpx.Timeout(self._env.settings.timeout),
            policy=_IDEMPOTENT,
            stale_lease_means_done=True,
        )

    def _leased(self, action: str, **fields: Any) -> dict[str, Any]:
        if self.lease_id is None:
            raise RuntimeError(f"{action} needs a lease: call reset() first (or the episode was closed)")
        return {"action": action, "env_idx": self.env_idx, "lease_id": self.lease_id, **fields}

    def _check_same_versions(self, action: str, result: dict[str, Any]) -> None:
        observation_version = _check_public_state(action, result)
        if observation_version != self.observation_version:
            raise EnvironmentVersionError(
                f"ShopSimulator observation_version changed during the episode: reset reported "
                f"{self.observation_version!r}, {action} reported {observation_version!r}",
                action=action,
            )
        environment_version = result.get("environment_version")
        if environment_version is not None and environment_version != self.environment_version:
            raise EnvironmentVersionError(
                f"ShopSimulator environment_version changed during the episode: reset reported "
                f"{self.environment_version!r}, {action} reported {environment_version!r}",
                action=action,
            )
