"""ShopSimulator over HTTP: the environment seam of the runtime and its HTTP adapter.

One :class:`ShopSimulatorEnvironment` per process owns a connection pool (:class:`~shopsimrl.httpclient.HttpService`);
each episode opens an :class:`EnvironmentEpisode`, which holds at most one server lease
(``env_idx`` + ``lease_id``) from ``reset`` until ``close``.

Leases. ShopSimulator has a fixed pool of slots, no lease expiry, and a ``reset`` that waits
without a timeout while every slot is leased; a reset the client gives up on is still granted
later, to nobody. So the adapter never abandons a request that may hold a slot:

- ``reset`` runs as a task of its own. When the episode stops waiting for it (cancellation,
  ``reset_timeout``), the request stays open and the lease it returns is released at once.
- ``close`` hands the release to a task of its own, so a cancelled ``close`` cannot lose a lease.
- ``max_leases`` bounds the leases held or requested by the process (the rest wait here, not in
  the server's queue); ``aclose`` waits up to ``cleanup_grace_seconds`` for pending resets and
  releases. A :class:`LeaseObserver` (the run's lease journal) sees every change, so a process
  that is killed outright leaves a record of what it held.
- While resets wait for a slot, a line "waiting for a ShopSimulator slot (0/20 free, N queued)"
  is logged at most every ``slot_wait_log_seconds``.

Errors::

    ShopEnvironmentError                  anything the environment adapter raises on purpose
    ├── EnvironmentUnavailableError       infrastructure: connect/read failures, timeouts,
    │                                     HTTP 502/503/504, a 500 without the server's
    │                                     envelope, a 5xx whose envelope says the state is
    │                                     unchanged (after the retries that are safe);
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
are retried only when the request provably never reached the server (connection refused,
connect or pool timeout, a reset before the server's TCP stack took any byte of it: a listen
backlog that never accepted the connection) or when the server says it changed nothing (a 5xx whose envelope
carries ``"state_unchanged": true``, as the testbed's injected faults do). ``reset`` is retried
in those cases and on HTTP 502/503, where a proxy did not reach the server; it has no read
timeout (the server answers once a slot is free). ``release_one`` and ``GET /healthz`` are retried on any transport error and on any 5xx;
a 409 on a ``release_one`` retry, after an attempt that may have reached the server, means that
attempt already released the lease.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any, Final, Protocol, runtime_checkable

import structlog

from shopsimrl.httpclient import HttpService, PoolTimeout, ReadTimeout, Response, Timeout, TransportError, request_not_sent
from shopsimrl.retry import Attempt, Backoff, retry_async
from shopsimrl.schemas import parse_json, redact_uri, wire_json

__all__ = [
    "ADAPTER_NAME",
    "TERMINATION_REASONS",
    "EnvironmentEpisode",
    "EnvironmentResponseError",
    "EnvironmentUnavailableError",
    "EnvironmentVersionError",
    "LeaseError",
    "LeaseObserver",
    "ShopEnvironment",
    "ShopEnvironmentError",
    "ShopSimulatorEnvironment",
    "ShopSimulatorEpisode",
    "ShopSimulatorSettings",
    "SlotUsage",
    "lease_budget",
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
        state_unchanged: bool = False,
    ) -> None:
        super().__init__(message, action=action, status=status)
        self.request_sent = request_sent
        self.attempts = attempts
        self.state_unchanged = state_unchanged
        """The server said the request changed nothing: sending it again is safe for every action."""


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


class LeaseObserver(Protocol):
    """Told of every lease event of a process, as it happens (a lease journal listens here)."""

    def reset_sent(self) -> None:
        """A reset is about to leave the process: from now on the server may grant it a slot."""

    async def recorded(self) -> None:
        """Return once the events seen so far are stored where a successor finds them (the
        reset leaves only then; a journal that cannot be written returns anyway)."""

    def reset_answered(self, lease: tuple[int, str] | None) -> None:
        """The reset came back: with ``(env_idx, lease_id)``, or without a lease (a failure)."""

    def lease_released(self, env_idx: int, lease_id: str) -> None:
        """The server confirmed the release (or no longer knew the lease)."""


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
    """How long an episode waits for its reset (the server queues resets while every slot is
    leased) before it fails as an infrastructure failure. The request itself stays open: a
    lease granted later is released at once. None waits without limit."""
    max_leases: int | None = None
    """Leases this process holds or requests at once; further resets wait here, not in the
    server's queue. None: no bound of its own (see :func:`lease_budget`)."""
    cleanup_grace_seconds: float = 30.0
    """``aclose`` waits this long for pending resets and releases before it gives up on them."""
    slot_wait_log_seconds: float = 30.0
    """While resets wait for a slot, log the pool's state at most this often."""
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
            raise ValueError(f"interaction_mode must be one of {list(INTERACTION_MODES)}, got {self.interaction_mode!r}")
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
        if self.max_leases is not None and (
            isinstance(self.max_leases, bool) or not isinstance(self.max_leases, int) or self.max_leases < 1
        ):
            raise ValueError(f"max_leases must be an integer >= 1 or None, got {self.max_leases!r}")
        for name in ("cleanup_grace_seconds", "slot_wait_log_seconds"):
            value = getattr(self, name)
            if not (isinstance(value, int | float) and 0 < value < float("inf")):
                raise ValueError(f"{name} must be a finite number of seconds > 0, got {value!r}")
        for name in ("expected_environment_version", "expected_observation_version"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, str) or not value.strip()):
                raise ValueError(f"{name} must be a non-empty string or None, got {value!r}")


@dataclass(frozen=True)
class SlotUsage:
    """The shop's lease pool as ``GET /healthz`` reports it (None where a key is missing)."""

    environment_slots: int | None
    free_slots: int | None

    @classmethod
    def from_healthz(cls, body: Mapping[str, Any]) -> SlotUsage:
        def count(key: str) -> int | None:
            value = body.get(key)
            return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None

        return cls(count("environment_slots"), count("free_slots"))

    def sizing_warning(self, *, concurrency: int, processes: int, lease_limit: int) -> str | None:
        """A sentence when ``processes × concurrency`` episodes in flight exceed the pool."""
        slots, in_flight = self.environment_slots, concurrency * processes
        if slots is None or in_flight <= slots:
            return None
        return (
            f"{processes} process(es) × concurrency {concurrency} = {in_flight} episodes in flight, but "
            f"ShopSimulator has {slots} slots: each process holds at most {lease_limit} leases at a time and the "
            "other episodes wait; raise SHOPSIM_ENV_SLOTS or lower the concurrency"
        )

    def describe(self) -> str:
        if self.environment_slots is None:
            return "slot count unknown (/healthz has no environment_slots)"
        free = "?" if self.free_slots is None else str(self.free_slots)
        return f"{free}/{self.environment_slots} slots free"


def lease_budget(*, concurrency: int, processes: int, environment_slots: int | None, configured: int | None) -> int:
    """Leases one process may hold or request at once.

    ``configured`` (``environment.max_leases``) wins. Otherwise each of the ``processes`` that
    run at once gets an equal share of the shop's slots, at most its episode concurrency and at
    least one; with the slot count unknown, the concurrency.
    """
    if configured is not None:
        return configured
    if environment_slots is None or environment_slots < 1:
        return concurrency
    return max(1, min(concurrency, environment_slots // max(1, processes)))


# --------------------------------------------------------------------------- retry policy


@dataclass(frozen=True)
class _RetryPolicy:
    after_sent: bool
    """Retry failures where the request may have reached the server."""
    statuses: frozenset[int]
    """HTTP statuses (5xx) worth another attempt."""

    def allows(self, exc: EnvironmentUnavailableError) -> bool:
        if exc.state_unchanged:
            return True
        if exc.status is not None:
            return exc.status in self.statuses
        if isinstance(exc.__cause__, PoolTimeout):
            # The local pool stayed saturated for a whole timeout; waiting again rarely helps.
            return False
        return self.after_sent or not exc.request_sent


_FIVE_XX = frozenset(range(500, 600))
_NOT_SENT_ONLY = _RetryPolicy(after_sent=False, statuses=frozenset())
_RESET = _RetryPolicy(after_sent=False, statuses=frozenset({502, 503}))
_IDEMPOTENT = _RetryPolicy(after_sent=True, statuses=_FIVE_XX)

_JSON_HEADERS = {"Content-Type": "application/json"}


# --------------------------------------------------------------------------- adapter


@dataclass
class _ResetState:
    since: float
    sent: bool = False
    """The request left (or may have left) this process: only then can the server grant it."""


class ShopSimulatorEnvironment:
    """The ShopSimulator HTTP API (``POST /api/shop_agent``, ``GET /healthz``) behind ``ShopEnvironment``."""

    def __init__(
        self,
        settings: ShopSimulatorSettings | None = None,
        *,
        http: HttpService | None = None,
        sleep: Callable[[float], Awaitable[Any]] = asyncio.sleep,
        lease_observer: LeaseObserver | None = None,
    ) -> None:
        self.settings = settings or ShopSimulatorSettings()
        self._base_url = self.settings.base_url.rstrip("/")
        self._agent_url = f"{self._base_url}/api/shop_agent"
        self._owns_http = http is None
        self._http = http or HttpService(max_connections=self.settings.max_connections, trust_env=self.settings.trust_env)
        self._sleep = sleep
        self._environment_version: str | None = None
        self._observation_version: str | None = None
        # Lease bookkeeping (see the module docstring). Everything runs on one event loop.
        self.lease_observer = lease_observer
        self._lease_limit = self.settings.max_leases
        self._permits: asyncio.Semaphore | None = None
        self._lease_requests_started = False
        self._unreleased: dict[int, str] = {}
        """Leases granted to this process and not yet confirmed released."""
        self._resets_in_flight = 0
        self._background: set[asyncio.Task[Any]] = set()
        """Abandoned resets and releases still running; ``aclose`` waits for them."""
        self._waiting: dict[int, _ResetState] = {}
        """Resets not yet granted."""
        self._reporter: asyncio.Task[None] | None = None

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
        body = await self._call("healthz", None, timeout=Timeout(self.settings.timeout), policy=_IDEMPOTENT)
        self._check_pins(body, action="healthz")
        return body

    async def slot_usage(self) -> SlotUsage:
        """The shop's pool size and free slots, from ``GET /healthz``."""
        return SlotUsage.from_healthz(await self.healthz())

    async def release_lease(self, env_idx: int, lease_id: str) -> bool:
        """Release a lease this process does not hold (one a stopped process left behind).

        True: released. False: the server no longer knows it (already released, reassigned,
        or the server restarted) — harmless either way."""
        try:
            await self._call(
                "release_one",
                {"action": "release_one", "env_idx": env_idx, "lease_id": lease_id},
                timeout=Timeout(self.settings.timeout),
                policy=_IDEMPOTENT,
                stale_lease_means_done=True,
            )
        except LeaseError:
            return False
        return True

    async def release_all(self) -> str:
        """``release_all``: frees every slot and invalidates every client's leases."""
        result = await self._call(
            "release_all", {"action": "release_all"}, timeout=Timeout(self.settings.timeout), policy=_IDEMPOTENT
        )
        return str(result.get("message", ""))

    def limit_leases(self, limit: int | None) -> None:
        """Bound the leases held or requested at once; only before the first reset."""
        if self._lease_requests_started:
            raise RuntimeError("limit_leases() must be called before the first reset")
        if limit is not None and limit < 1:
            raise ValueError(f"the lease limit must be >= 1, got {limit!r}")
        self._lease_limit = limit

    @property
    def lease_limit(self) -> int | None:
        return self._lease_limit

    @property
    def unreleased_leases(self) -> dict[int, str]:
        """``env_idx → lease_id`` granted to this process and not yet confirmed released."""
        return dict(self._unreleased)

    async def aclose(self) -> None:
        """Wait (up to ``cleanup_grace_seconds``) for abandoned resets and pending releases,
        then close the connection pool."""
        try:
            await self._settle(self.settings.cleanup_grace_seconds)
        finally:
            if self._reporter is not None:
                self._reporter.cancel()
            if self._owns_http:
                await self._http.aclose()

    # -- leases

    async def _settle(self, grace: float) -> None:
        deadline = time.monotonic() + grace
        while self._background:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            # An abandoned reset that is granted starts a release: loop until both are done.
            await asyncio.wait(set(self._background), timeout=remaining)
        if not self._background:
            return
        resets = self._resets_in_flight
        _log.warning(
            "lease cleanup incomplete",
            grace_s=grace,
            resets_still_queued=resets,
            unreleased_leases=len(self._unreleased),
            consequence=(
                "a reset the server grants later leaks its slot until `shopsimrl env release-all`; "
                "unreleased leases stay in the lease journal and are released when the run restarts"
            ),
        )
        for task in list(self._background):
            task.cancel()
        await asyncio.gather(*self._background, return_exceptions=True)

    def _spawn(self, coroutine: Awaitable[Any]) -> asyncio.Task[Any]:
        task = asyncio.ensure_future(coroutine)
        self._background.add(task)
        task.add_done_callback(self._settled)
        return task

    def _settled(self, task: asyncio.Task[Any]) -> None:
        self._background.discard(task)
        # Retrieved here, whoever else looks: a close() cancelled while it waited for its release
        # no longer does, and an abandoned reset's release has nobody waiting. A failed release
        # keeps its lease among the unreleased ones (and in the journal); aclose() says so.
        if not task.cancelled() and (exc := task.exception()) is not None:
            _log.debug("lease release failed", error=f"{type(exc).__name__}: {exc}")

    def _observe(self, event: str, *args: Any) -> None:
        if self.lease_observer is not None:
            try:
                getattr(self.lease_observer, event)(*args)
            except Exception as exc:  # a journal problem must not break the episode
                _log.warning("lease observer failed", lease_event=event, error=f"{type(exc).__name__}: {exc}")

    async def _recorded(self) -> None:
        if self.lease_observer is not None:
            try:
                await self.lease_observer.recorded()
            except Exception as exc:  # a journal problem must not break the episode
                _log.warning("lease observer failed", lease_event="recorded", error=f"{type(exc).__name__}: {exc}")

    async def _request_lease(self, payload: dict[str, Any], state: _ResetState) -> dict[str, Any]:
        """Take a permit, send the reset, record the lease; the permit stays taken until the
        lease is released (or the reset fails without one)."""
        self._lease_requests_started = True
        self._waiting[id(state)] = state
        self._start_reporter()
        try:
            if self._lease_limit is not None:
                if self._permits is None:
                    self._permits = asyncio.Semaphore(self._lease_limit)
                await self._permits.acquire()
            self._resets_in_flight += 1
            self._observe("reset_sent")
            lease: tuple[int, str] | None = None
            try:
                # The journal records the reset as in flight before it leaves: after kill -9 the
                # successor knows how many resets may have been granted to nobody.
                await self._recorded()
                state.sent = True  # from here on the server may grant a slot for this request
                result = await self._call("reset", payload, timeout=self._reset_timeout(), policy=_RESET)
                env_idx, lease_id = result.get("env_idx"), result.get("lease_id")
                if isinstance(env_idx, bool) or not isinstance(env_idx, int):
                    raise _contract_error("reset", f"needs an integer 'env_idx', got {env_idx!r}")
                if not isinstance(lease_id, str) or not lease_id:
                    raise _contract_error("reset", f"needs a non-empty string 'lease_id', got {lease_id!r}")
                lease = (env_idx, lease_id)
            except BaseException:
                self._return_permit()
                raise
            finally:
                self._resets_in_flight -= 1
                if lease is not None:
                    self._unreleased[lease[0]] = lease[1]
                self._observe("reset_answered", lease)
        finally:
            self._waiting.pop(id(state), None)
        return result

    def _return_permit(self) -> None:
        if self._permits is not None:
            self._permits.release()

    async def _release(self, env_idx: int, lease_id: str) -> None:
        """Release one of this process's leases; its permit comes back whatever happens."""
        try:
            await self._call(
                "release_one",
                {"action": "release_one", "env_idx": env_idx, "lease_id": lease_id},
                timeout=Timeout(self.settings.timeout),
                policy=_IDEMPOTENT,
                stale_lease_means_done=True,
            )
        except LeaseError:
            # The server no longer knows the lease (release_all, a restart): nothing is held.
            self._forget(env_idx, lease_id)
            raise
        except BaseException:
            # Unconfirmed: keep it among the unreleased leases, so the journal keeps it too.
            self._return_permit()
            raise
        self._forget(env_idx, lease_id)

    def _forget(self, env_idx: int, lease_id: str) -> None:
        if self._unreleased.get(env_idx) == lease_id:
            del self._unreleased[env_idx]
        self._return_permit()
        self._observe("lease_released", env_idx, lease_id)

    def _abandon(self, request: asyncio.Task[dict[str, Any]], state: _ResetState) -> None:
        """Nobody waits for ``request`` any more: cancel it while it has not been sent (it only
        waits for a permit here), else let it finish and release the lease it obtains."""
        if not state.sent:
            request.cancel()
            return
        self._background.add(request)

        def settled(task: asyncio.Task[dict[str, Any]]) -> None:
            self._background.discard(task)
            if task.cancelled() or task.exception() is not None:
                return
            result = task.result()
            _log.info("releasing the lease of an abandoned reset", env_idx=result["env_idx"])
            self._spawn(self._release(result["env_idx"], result["lease_id"]))

        request.add_done_callback(settled)

    # -- waiting for slots, made visible

    def _start_reporter(self) -> None:
        if self._reporter is None or self._reporter.done():
            self._reporter = asyncio.ensure_future(self._report_waits())

    async def _report_waits(self) -> None:
        interval = self.settings.slot_wait_log_seconds
        first = min(5.0, interval)
        last_report = float("-inf")
        while self._waiting:
            await asyncio.sleep(min(1.0, first))
            now = time.monotonic()
            waits = list(self._waiting.values())
            if not waits or now - min(w.since for w in waits) < first or now - last_report < interval:
                continue
            last_report = now
            try:
                async with asyncio.timeout(min(10.0, self.settings.timeout)):
                    usage = await self.slot_usage()
                pool = usage.describe()
            except Exception as exc:  # the report itself must never fail an episode
                pool = f"/healthz unavailable: {type(exc).__name__}"
            at_shop = sum(1 for w in waits if w.sent)
            _log.warning(
                f"waiting for a ShopSimulator slot ({pool}, {len(waits)} queued)",
                queued_at_shop=at_shop,
                queued_here=len(waits) - at_shop,
                lease_limit=self._lease_limit,
                waited_s=round(now - min(w.since for w in waits), 1),
            )

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

    def _reset_timeout(self) -> Timeout:
        # The server answers a reset only once a slot is free, and a reset given up on the client
        # side is still granted later, to nobody: no read timeout (as the real clients do); the
        # episode's own wait is bounded by reset_timeout instead (see ShopSimulatorEpisode.reset).
        return Timeout(connect=self.settings.timeout, read=None, write=self.settings.timeout, pool=None)

    async def _call(
        self,
        action: str,
        payload: dict[str, Any] | None,
        *,
        timeout: Timeout,
        policy: _RetryPolicy,
        stale_lease_means_done: bool = False,
    ) -> dict[str, Any]:
        """One logical call with the retries ``policy`` allows; returns ``result`` (or the healthz body)."""
        may_have_arrived = False

        async def attempt(current: Attempt) -> dict[str, Any]:
            nonlocal may_have_arrived
            try:
                return await self._send(action, payload, timeout)
            except LeaseError:
                if stale_lease_means_done and may_have_arrived:
                    # An earlier attempt released the lease, and its answer was lost.
                    return {"message": "lease already released by an earlier attempt"}
                raise
            except EnvironmentUnavailableError as exc:
                may_have_arrived = may_have_arrived or exc.request_sent
                exc.attempts = current.number
                raise

        def on_retry(failed: Attempt) -> None:
            _log.warning(
                "environment call retried", action=action, attempt=failed.number, error=str(failed.error), delay=failed.delay_s
            )

        return await retry_async(
            attempt,
            Backoff(attempts=self.settings.max_retries + 1, base_delay_s=self.settings.retry_backoff_seconds),
            retryable=lambda exc: isinstance(exc, EnvironmentUnavailableError) and policy.allows(exc),
            on_retry=on_retry,
            sleep=self._sleep,
        )

    async def _send(self, action: str, payload: dict[str, Any] | None, timeout: Timeout) -> dict[str, Any]:
        try:
            if payload is None:
                response = await self._http.request("GET", f"{self._base_url}/healthz", timeout=timeout)
            else:
                response = await self._http.request(
                    "POST", self._agent_url, content=wire_json(payload), headers=_JSON_HEADERS, timeout=timeout
                )
        except ReadTimeout as exc:
            raise EnvironmentUnavailableError(
                f"ShopSimulator {action}: no answer within the read timeout ({exc.__class__.__name__})", action=action
            ) from exc
        except TransportError as exc:
            raise EnvironmentUnavailableError(
                f"ShopSimulator {action}: {_describe(exc)}", action=action, request_sent=not request_not_sent(exc)
            ) from exc
        return _decode(action, response, enveloped=payload is not None)


def _describe(exc: TransportError) -> str:
    return f"{type(exc).__name__}: {exc or 'transport error'}"


def _decode(action: str, response: Response, *, enveloped: bool) -> dict[str, Any]:
    status = response.status_code
    try:
        body = parse_json(response.content)
    except ValueError:
        body = None
    result = body.get("result") if enveloped and isinstance(body, dict) else body
    server_message = None
    if isinstance(result, dict) and result.get("error"):
        server_message = str(result["error"])
    elif not isinstance(result, dict):
        server_message = response.text[:300] or None
    if not enveloped and status == 503 and isinstance(result, dict) and "ready" in result and result["ready"] is not True:
        # /healthz of a shop that is not ready yet: the real ShopSimulator says so with a 200 and
        # "ready": false, the testbed (so that an HTTP probe sees it) with a 503 and the same body.
        # Either is an answer, not an outage: the caller reads "ready", nothing is retried.
        return result
    detail = f"HTTP {status}" + (f": {server_message}" if server_message else "")
    if status >= 500 and isinstance(result, dict) and result.get("state_unchanged") is True:
        raise EnvironmentUnavailableError(
            f"ShopSimulator {action} failed without changing state: {detail}", action=action, status=status, state_unchanged=True
        )
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
            raise RuntimeError(f"reset while holding lease {self.lease_id} on slot {self.env_idx}; close() the episode first")
        settings = self._env.settings
        payload = {
            "action": "reset",
            "idx": task_id,
            "if_persona": settings.persona,
            "include_private_goal": False,
            "interaction_mode": settings.interaction_mode,
        }
        # The request runs on its own: if this episode stops waiting, the request is not
        # dropped (the server would still grant it a slot, to nobody) but left to finish and
        # its lease released.
        state = _ResetState(time.monotonic())
        request = asyncio.ensure_future(self._env._request_lease(payload, state))
        # asyncio.wait, not wait_for: on Python 3.11 wait_for can swallow a cancellation that
        # arrives as the request completes, and the episode would run on after a stop.
        try:
            done, _ = await asyncio.wait({request}, timeout=settings.reset_timeout)
        except asyncio.CancelledError:
            self._env._abandon(request, state)
            raise
        if not done:
            self._env._abandon(request, state)
            raise EnvironmentUnavailableError(
                f"ShopSimulator reset of task {task_id} got no free slot within reset_timeout="
                f"{settings.reset_timeout}s; the request stays queued and a lease granted later is released at once",
                action="reset",
            )
        result = request.result()
        # Own the lease before any other check, so close() always releases it.
        self.env_idx, self.lease_id = result["env_idx"], result["lease_id"]
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
        result = await self._env._call("interact", payload, timeout=Timeout(self._env.settings.timeout), policy=_NOT_SENT_ONLY)
        self._check_same_versions("interact", result)
        return result

    async def terminate(self, reason: str) -> dict[str, Any]:
        if reason not in TERMINATION_REASONS:
            raise ValueError(f"termination reason must be one of {list(TERMINATION_REASONS)}, got {reason!r}")
        payload = self._leased("terminate", termination_reason=reason)
        result = await self._env._call("terminate", payload, timeout=Timeout(self._env.settings.timeout), policy=_NOT_SENT_ONLY)
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
        """Release the lease (with safe retries); a no-op without one.

        The release runs as a task the environment tracks: the episode gives up its lease
        without an ``await`` in between, so a cancelled ``close`` cannot lose it, and
        ``environment.aclose()`` waits for the release to finish."""
        if self.lease_id is None or self.env_idx is None:
            self.env_idx = self.lease_id = None
            return
        release = self._env._spawn(self._env._release(self.env_idx, self.lease_id))
        self.env_idx = self.lease_id = None
        await asyncio.shield(release)

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
