"""HTTP layer of the ShopSimulator stand-in: ``POST /api/shop_agent`` and ``GET /healthz``.

One endpoint dispatched on the JSON field ``action`` (reset / interact / terminate / release_one /
release_all), every answer wrapped as ``{"result": …}`` with the real server's status codes and
error texts. Sessions live on a pool of leased slots: ``reset`` waits (without timeout) for a free
slot, a terminal episode keeps its slot until ``release_one``, and a stale lease gets 409.

Everything runs on the event loop: the per-call work is small (an FTS5 query at most), so there
is no thread per request and thousands of open leases cost only their session objects.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import random
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from pathlib import Path
from typing import Any, TypeGuard

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import HTMLResponse, Response
from starlette.routing import Route

from shopsimrl.testbed.serving import serve_forever
from shopsimrl.testbed.shop.actions import EPISODE_LIMITS, step, terminate
from shopsimrl.testbed.shop.catalog import Catalog, load_catalog
from shopsimrl.testbed.shop.pages import OBSERVATION_VERSION, Session, build_observation_state, render_observation_state
from shopsimrl.testbed.shop.search import SearchIndex, ServerFault

__all__ = ["DEFAULT_CATALOG", "ENVIRONMENT_VERSION", "LeasePool", "ShopSettings", "create_app", "serve"]

ENVIRONMENT_VERSION = "shopsimulator-paper-aligned-v8"
PRIMARY_REWARD = "r_strict"
DEFAULT_CATALOG = Path(__file__).resolve().parent.parent / "data" / "catalog.v1.json.gz"
_log = logging.getLogger(__name__)

# env variable -> settings field (SHOPSIM_ENV_SLOTS is the real server's name for the pool size)
_ENV = {
    "SHOPSIM_ENV_SLOTS": "slots",
    "SHOPSIM_CATALOG": "catalog",
    "SHOPSIM_LATENCY_MS": "latency_ms",
    "SHOPSIM_LATENCY_JITTER_MS": "latency_jitter_ms",
    "SHOPSIM_FAULT_RATE_5XX": "fault_rate_5xx",
    "SHOPSIM_SLOW_RATE": "slow_rate",
    "SHOPSIM_SLOW_MS": "slow_ms",
    "SHOPSIM_SEED": "seed",
    "SHOPSIM_KEEP_ORPHAN_RESETS": "keep_orphan_resets",
}


@dataclass(frozen=True, slots=True)
class ShopSettings:
    """Server knobs. Latency and faults exist for benchmarks and reliability tests only."""

    slots: int = 20
    catalog: Path | None = None  # None: SHOPSIM_CATALOG, else the packaged synthetic catalog
    latency_ms: float = 0.0  # added to every /api/shop_agent call
    latency_jitter_ms: float = 0.0  # plus uniform [0, jitter)
    fault_rate_5xx: float = 0.0  # probability of a 500 on reset/interact/terminate, state untouched
    slow_rate: float = 0.0  # probability of an extra slow_ms delay
    slow_ms: float = 0.0
    seed: int | None = None  # seeds the latency/fault RNG
    keep_orphan_resets: bool = False
    """True: a queued reset whose client has gone still takes a slot when one frees, as the real
    (threaded Werkzeug) server does; that slot is then leased to nobody. False: such a reset is
    dropped and logged, so the testbed itself never creates phantom leases."""

    def __post_init__(self) -> None:
        if isinstance(self.slots, bool) or not isinstance(self.slots, int) or self.slots < 1:
            raise ValueError(f"ShopSettings.slots must be an integer >= 1, got {self.slots!r}")
        for name in ("latency_ms", "latency_jitter_ms", "slow_ms"):
            if getattr(self, name) < 0:
                raise ValueError(f"ShopSettings.{name} must be >= 0, got {getattr(self, name)!r}")
        for name in ("fault_rate_5xx", "slow_rate"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"ShopSettings.{name} must be within [0, 1], got {getattr(self, name)!r}")

    @classmethod
    def from_env(cls, environ: Mapping[str, str] | None = None, **overrides: Any) -> ShopSettings:
        """Read ``SHOPSIM_*`` variables; keyword overrides win over the environment."""
        env = os.environ if environ is None else environ
        types = {f.name: f.type for f in fields(cls)}
        values: dict[str, Any] = {}
        for variable, name in _ENV.items():
            raw = env.get(variable)
            if raw is None or raw.strip() == "":
                continue
            try:
                if name == "catalog":
                    values[name] = Path(raw)
                elif name == "keep_orphan_resets":
                    values[name] = _parse_flag(variable, raw)
                elif name in ("slots", "seed"):
                    values[name] = int(raw)
                else:
                    values[name] = float(raw)
            except ValueError:
                raise ValueError(f"{variable}={raw!r} is not a valid {types[name]}") from None
        values.update(overrides)
        return cls(**values)

    def catalog_path(self) -> Path:
        return Path(self.catalog) if self.catalog is not None else DEFAULT_CATALOG


def _parse_flag(variable: str, raw: str) -> bool:
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{variable}={raw!r} is not a valid flag (use 1 or 0)")


class LeasePool:
    """Slots with explicit leases; ``acquire`` waits until a slot is free (no timeout).

    The free slots are a Python ``set`` of ints, built, popped and refilled as the real server's
    pool does (``set(range(size))`` at start and on ``release_all``, ``pop()`` per grant, ``add()``
    per release): CPython's ``set.pop`` order, which depends on where each int sits in the set's
    table and on the removals before, is then the same, grant for grant.
    """

    def __init__(self, size: int) -> None:
        self.size = size
        self._free: set[int] = set(range(size))
        self._leases: dict[int, str] = {}
        self._waiting = 0
        self._cond: asyncio.Condition | None = None
        self._loop: asyncio.AbstractEventLoop | None = None

    def _condition(self) -> asyncio.Condition:
        # Bound to the loop that serves the app; a new loop (a restarted server) gets a new one.
        loop = asyncio.get_running_loop()
        if self._cond is None or self._loop is not loop:
            self._cond, self._loop = asyncio.Condition(), loop
        return self._cond

    @property
    def free_count(self) -> int:
        return len(self._free)

    async def acquire(self) -> tuple[int, str]:
        cond = self._condition()
        async with cond:
            if not self._free:
                _log.info("no environment slot is available; queuing reset")
            self._waiting += 1
            try:
                while not self._free:
                    await cond.wait()
            finally:
                self._waiting -= 1
            return self._grant()

    def try_acquire(self) -> tuple[int, str] | None:
        """A slot at once, or None when none is free or earlier resets are queued (then wait)."""
        return self._grant() if self._free and not self._waiting else None

    def _grant(self) -> tuple[int, str]:
        slot = self._free.pop()
        lease = uuid.uuid4().hex
        self._leases[slot] = lease
        return slot, lease

    def validate(self, slot: int, lease_id: object) -> bool:
        return self._leases.get(slot) == str(lease_id)

    async def release(self, slot: int) -> bool:
        cond = self._condition()
        async with cond:
            was_leased = slot not in self._free
            self._free.add(slot)
            self._leases.pop(slot, None)
            if was_leased:
                cond.notify()
            return was_leased

    async def wake_one(self) -> None:
        cond = self._condition()
        async with cond:
            cond.notify()

    async def reset(self) -> None:
        cond = self._condition()
        async with cond:
            self._free = set(range(self.size))  # a new set, as the real pool's reset makes
            self._leases = {}
            cond.notify_all()


class _ClientGone(Exception):
    """The client of a queued reset disconnected; no answer can reach it."""


class _Failure(Exception):
    """An error answer: HTTP status plus the ``result.error`` text."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


def _json(payload: Any, status: int = 200) -> Response:
    # Flask's jsonify: sorted keys, ASCII escapes, compact separators, trailing newline.
    body = json.dumps(payload, sort_keys=True, ensure_ascii=True, separators=(",", ":")) + "\n"
    return Response(body, status_code=status, media_type="application/json")


def _is_json_mimetype(content_type: str) -> bool:
    mimetype = content_type.split(";", 1)[0].strip().lower()
    return mimetype == "application/json" or (mimetype.startswith("application/") and mimetype.endswith("+json"))


def _valid_slot_args(env_idx: object, lease_id: object) -> TypeGuard[int]:
    """An int ``env_idx`` (the guard narrows it) and a non-empty ``lease_id``."""
    return isinstance(env_idx, int) and not isinstance(env_idx, bool) and bool(lease_id)


class ShopService:
    """All server state: catalog, search index, lease pool and one session per leased slot."""

    def __init__(self, catalog: Catalog, settings: ShopSettings) -> None:
        self.catalog = catalog
        self.settings = settings
        self.index = SearchIndex(catalog.products)
        self.pool = LeasePool(settings.slots)
        self.sessions: dict[int, Session] = {}
        self._rng = random.Random(settings.seed)

    # ------------------------------------------------------------------ knobs

    async def _delay(self) -> None:
        s = self.settings
        delay = s.latency_ms + (self._rng.uniform(0, s.latency_jitter_ms) if s.latency_jitter_ms else 0.0)
        if s.slow_rate and self._rng.random() < s.slow_rate:
            delay += s.slow_ms
        if delay > 0:
            await asyncio.sleep(delay / 1000.0)

    def _faulted(self) -> bool:
        rate = self.settings.fault_rate_5xx
        return bool(rate) and self._rng.random() < rate

    # ------------------------------------------------------------------ dispatch

    async def handle(self, data: dict[str, Any], client_gone: asyncio.Event | None = None) -> tuple[int, dict[str, Any]]:
        """Answer one request; ``client_gone`` is set when the caller's connection closes."""
        action = data.get("action")
        await self._delay()
        if action in ("reset", "interact", "terminate") and self._faulted():
            # Says so in the envelope: a client may send the request again, whatever the action.
            return 500, {"error": "injected fault: the testbed answered 500 without changing state", "state_unchanged": True}
        env_idx, lease_id = data.get("env_idx"), data.get("lease_id")
        try:
            if action == "release_all":
                self.sessions.clear()
                await self.pool.reset()
                return 200, {"message": "All environments have been initialized"}
            if action == "release_one":
                if not _valid_slot_args(env_idx, lease_id):
                    raise _Failure(400, "release_one requires a valid env_idx and lease_id")
                if not self.pool.validate(env_idx, lease_id):
                    raise _Failure(409, f"stale or invalid lease for environment {env_idx}")
                self.sessions.pop(env_idx, None)
                if await self.pool.release(env_idx):
                    return 200, {"message": f"Environment {env_idx} has been released"}
                return 200, {"message": f"Environment {env_idx} is already free"}
            if action == "reset":
                if env_idx is not None:
                    raise _Failure(400, "reset must not include env_idx; the server assigns a slot")
                return 200, await self._reset(data, client_gone)
            if action in ("interact", "terminate"):
                if not _valid_slot_args(env_idx, lease_id):
                    raise _Failure(400, f"{action} requires a valid env_idx and lease_id")
                if not self.pool.validate(env_idx, lease_id):
                    raise _Failure(409, f"stale or invalid lease for environment {env_idx}")
                session = self.sessions[env_idx]
                if action == "interact":
                    result = self._interact(env_idx, session, data.get("response"))
                else:
                    result = self._terminate(env_idx, session, str(data.get("termination_reason", "action_limit")))
                result["lease_id"] = lease_id
                return 200, result
            raise _Failure(400, f"unsupported action: {action!r}")
        except _Failure as failure:
            return failure.status, {"error": str(failure)}
        except _ClientGone:
            return 499, {"error": "client closed the connection while its reset was queued"}
        except ServerFault as fault:  # a mirrored failure of the real server, not a testbed bug
            _log.info("%s answered 500 as the real server does: %s", action, fault)
            return 500, {"error": str(fault)}
        except KeyError as exc:  # the real server reports str() of a KeyError, quotes included
            return 500, {"error": str(exc)}
        except Exception as exc:  # every failure is answered, as the real server does
            _log.exception("request failed")
            return 500, {"error": str(exc)}

    async def _reset(self, data: dict[str, Any], client_gone: asyncio.Event | None) -> dict[str, Any]:
        granted = self.pool.try_acquire()
        if granted is None:
            granted = await self._wait_for_slot(data, client_gone)
        slot, lease = granted
        try:
            result = self._start(slot, data)
        except Exception:
            # A failed reset gives its freshly taken slot back.
            self.sessions.pop(slot, None)
            await self.pool.release(slot)
            raise
        result["lease_id"] = lease
        return result

    async def _wait_for_slot(self, data: dict[str, Any], client_gone: asyncio.Event | None) -> tuple[int, str]:
        if client_gone is None or self.settings.keep_orphan_resets:
            return await self.pool.acquire()
        acquire = asyncio.ensure_future(self.pool.acquire())
        gone = asyncio.ensure_future(client_gone.wait())
        try:
            await asyncio.wait({acquire, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
        if not client_gone.is_set():
            return acquire.result()
        # The client hung up while queued: nobody would learn this lease, so do not take one.
        acquire.cancel()
        outcome = (await asyncio.gather(acquire, return_exceptions=True))[0]
        if isinstance(outcome, tuple):  # granted just before the cancellation landed
            await self.pool.release(outcome[0])
        else:  # a wake-up this waiter may have swallowed goes to the next one
            await self.pool.wake_one()
        _log.warning("dropped a queued reset of task %s: its client disconnected", data.get("idx"))
        raise _ClientGone

    def _start(self, slot: int, data: dict[str, Any]) -> dict[str, Any]:
        idx = data.get("idx")
        if idx is None:
            raise ValueError("reset action requires idx parameter")
        if isinstance(idx, bool) or not isinstance(idx, int):
            raise ValueError("task idx must be an integer")
        if idx not in self.catalog.goals:
            raise KeyError(f"unknown or inactive task_id {idx}")
        mode = str(data.get("interaction_mode", "single_turn"))
        if mode not in EPISODE_LIMITS:
            raise ValueError(f"unsupported interaction_mode {mode!r}; choose one of {sorted(EPISODE_LIMITS)}")
        if_persona = bool(data.get("if_persona", False))
        goal = dict(self.catalog.goals[idx])
        session = Session(task_id=idx, goal=goal, max_actions=EPISODE_LIMITS[mode])
        state = build_observation_state(session, self.catalog)
        observation = render_observation_state(state)
        self.sessions[slot] = session
        persona = {k: v for k, v in goal["user_persona"].items() if k != "__reasoning__"}
        result: dict[str, Any] = {
            "task_instruction": (goal["instruction_simple"] if if_persona and goal["user_persona"] else goal["instruction_text"]),
            "observation": observation,
            "observation_state": state,
            "message": f"Task {idx} started",
            "env_idx": slot,
            "idx": idx,
            "task_mode": "persona" if if_persona else "standard",
            "interaction_mode": mode,
            "environment_version": ENVIRONMENT_VERSION,
            "user_persona": persona,
        }
        if bool(data.get("include_private_goal", False)):
            result["private_task_instruction"] = goal["instruction_text"]
            result["goal_options"] = goal["goal_options"]
            result["reason_key"] = goal.get("reason_key")
        return result

    def _page(self, session: Session) -> tuple[dict[str, Any], str]:
        state = build_observation_state(session, self.catalog)
        return state, render_observation_state(state)

    def _interact(self, slot: int, session: Session, response: object) -> dict[str, Any]:
        if response is None:
            raise ValueError("interact action requires response parameter")
        if not isinstance(response, str):
            raise TypeError(f"'{type(response).__name__}' object has no attribute 'replace'")
        if session.done:
            raise RuntimeError("episode is already terminated; reset before stepping")
        outcome = step(session, response, self.catalog, self.index)
        state, observation = self._page(session)
        result: dict[str, Any] = {
            "done": outcome.done,
            "over": outcome.done,
            "reward": outcome.reward,
            "observation": observation,
            "observation_state": state,
            "action_feedback": outcome.feedback,
            "message": "Continue interaction" if outcome.feedback.get("valid") else "Invalid action",
            "env_idx": slot,
            "idx": f"slot-{slot}-{session.task_id}",
            "reward_detail": outcome.reward_detail if outcome.done else {},
            "purchase": outcome.purchase if outcome.done else {},
            "goal": session.goal if outcome.done else {},
        }
        if outcome.done:
            result["termination_reason"] = outcome.termination_reason or "environment_done"
        return result

    def _terminate(self, slot: int, session: Session, reason: str) -> dict[str, Any]:
        detail = terminate(session, reason)
        state, observation = self._page(session)
        return {
            "done": True,
            "over": True,
            "reward": 0.0,
            "observation": observation,
            "observation_state": state,
            "message": f"Episode terminated: {reason}",
            "env_idx": slot,
            "idx": f"slot-{slot}-{session.task_id}",
            "reward_detail": detail,
            "purchase": {},
            "goal": session.goal,
            "termination_reason": reason,
        }

    ready = True
    """What ``/healthz`` reports; the catalog and pool are built before the app serves."""

    def health(self) -> dict[str, Any]:
        return {
            "ready": self.ready,
            "environment_slots": self.pool.size,
            "free_slots": self.pool.free_count,
            "tasks": len(self.catalog.goals),
            "environment_version": ENVIRONMENT_VERSION,
            "primary_reward": PRIMARY_REWARD,
            "observation_version": OBSERVATION_VERSION,
            "debug_ui": "/debug-ui",
            "replay_ui": "/replay-ui",
        }


_INTERNAL_ERROR_PAGE = (
    "<!doctype html>\n<html lang=en>\n<title>500 Internal Server Error</title>\n"
    "<h1>Internal Server Error</h1>\n<p>The server encountered an internal error and was unable to "
    "complete your request. Either the server is overloaded or there is an error in the application.</p>\n"
)

_UI_PAGE = (
    "<!doctype html><html><head><meta charset='utf-8'><title>ShopSimulator testbed</title></head>"
    "<body><p>ShopSimulator testbed stand-in: this {what} is not provided. "
    "The Agent API is <code>POST /api/shop_agent</code>; health is <code>GET /healthz</code>.</p></body></html>"
)


def create_app(settings: ShopSettings | None = None, *, catalog_path: str | Path | None = None) -> Starlette:
    """Build the ASGI app; the catalog is loaded and indexed here, before the first request.

    ``settings`` defaults to :meth:`ShopSettings.from_env`; ``catalog_path`` overrides
    ``settings.catalog`` (default: ``SHOPSIM_CATALOG`` or the packaged synthetic catalog).
    """
    settings = settings if settings is not None else ShopSettings.from_env()
    if catalog_path is not None:
        settings = replace(settings, catalog=Path(catalog_path))
    service = ShopService(load_catalog(settings.catalog_path()), settings)

    async def shop_agent(request: Request) -> Response:
        body = await request.body()
        data: Any = None
        if _is_json_mimetype(request.headers.get("content-type", "")):
            try:
                data = json.loads(body) if body else None
            except (ValueError, UnicodeDecodeError):
                data = None
        if data is None:  # the real server answers this one with status 200
            return _json({"result": {"error": "No JSON data provided"}})
        if not isinstance(data, dict):
            # JSON that is not an object (array, string, number, true/false) crashes the real
            # server's handler before its own error handling: its framework's HTML 500 page.
            return HTMLResponse(_INTERNAL_ERROR_PAGE, status_code=500)
        if data.get("action") != "reset":
            status, result = await service.handle(data)
            return _json({"result": result}, status)
        # A reset may wait for a slot: watch the connection meanwhile, so a queued reset whose
        # client has gone can be dropped (see ShopSettings.keep_orphan_resets).
        client_gone = asyncio.Event()

        async def watch() -> None:
            while (await request.receive())["type"] != "http.disconnect":
                pass
            client_gone.set()

        watcher = asyncio.ensure_future(watch())
        try:
            status, result = await service.handle(data, client_gone)
        finally:
            watcher.cancel()
        return _json({"result": result}, status)

    async def healthz(request: Request) -> Response:
        health = service.health()
        # An HTTP probe (the kubelet's) reads only the status: not ready must not answer 200.
        return _json(health, 200 if health["ready"] is True else 503)

    async def debug_ui(request: Request) -> Response:
        return HTMLResponse(_UI_PAGE.format(what="Agent-view inspector"))

    async def replay_ui(request: Request) -> Response:
        return HTMLResponse(_UI_PAGE.format(what="replay dashboard"))

    app = Starlette(
        routes=[
            Route("/api/shop_agent", shop_agent, methods=["POST"]),
            Route("/healthz", healthz, methods=["GET"]),
            Route("/debug-ui", debug_ui, methods=["GET"]),
            Route("/replay-ui", replay_ui, methods=["GET"]),
        ]
    )
    app.state.shop = service
    return app


def serve(host: str = "127.0.0.1", port: int = 5700, settings: ShopSettings | None = None) -> None:
    """Run the shop server in the foreground until interrupted."""
    serve_forever(create_app(settings), host, port)
