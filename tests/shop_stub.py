"""A scriptable ShopSimulator-like ASGI app for adapter tests.

By default it behaves like a tiny ShopSimulator: ``reset`` leases a slot with a fresh
``lease_id``, ``interact``/``terminate``/``release_one`` check the lease (409 when stale),
and ``GET /healthz`` reports versions. Tests queue :class:`Reply` objects per action to
answer differently once (an error, a patched body, raw text, a delay), and read
``stub.requests`` to see exactly what the adapter sent.
"""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from collections import defaultdict, deque
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

ENVIRONMENT_VERSION = "shopsimulator-paper-aligned-v8"
OBSERVATION_VERSION = "shopping-observation-v7"
HOME_TEXT = "页面：搜索首页\n\n页面能力：\n- 支持商品搜索\n"

DROP = object()
"""A ``Reply.patch`` value that removes the key from the default result."""


@dataclass
class Reply:
    """One scripted answer. Without ``result``/``raw`` the default handler runs and its
    result is ``patch``-ed; ``effect`` overrides whether the default handler changes state."""

    status: int | None = None
    result: dict[str, Any] | None = None
    raw: str | None = None
    patch: dict[str, Any] = field(default_factory=dict)
    delay: float = 0.0
    effect: bool | None = None


class ShopStub:
    def __init__(self, *, slots: int = 4) -> None:
        self.requests: list[dict[str, Any]] = []
        self.scripts: dict[str, deque[Reply]] = defaultdict(deque)
        self.free = list(range(slots))
        self.leases: dict[int, str] = {}
        self._gate = threading.Event()  # set on teardown so every delayed handler ends at once
        self.app = Starlette(
            routes=[
                Route("/api/shop_agent", self._shop_agent, methods=["POST"]),
                Route("/healthz", self._healthz, methods=["GET"]),
            ]
        )

    def script(self, action: str, *replies: Reply) -> None:
        self.scripts[action].extend(replies)

    def actions(self) -> list[str]:
        return [str(request.get("action")) for request in self.requests]

    def open_gate(self) -> None:
        self._gate.set()

    async def _wait(self, seconds: float) -> None:
        deadline = time.monotonic() + seconds
        # The gate is a threading.Event, set from the test's thread: polled, it cannot be awaited.
        while time.monotonic() < deadline and not self._gate.is_set():  # noqa: ASYNC110
            await asyncio.sleep(0.01)

    # -- HTTP handlers

    async def _healthz(self, request: Request) -> Response:
        self.requests.append({"action": "healthz"})
        default = {
            "ready": True,
            "environment_slots": len(self.free) + len(self.leases),
            "free_slots": len(self.free),
            "environment_version": ENVIRONMENT_VERSION,
            "observation_version": OBSERVATION_VERSION,
            "primary_reward": "r_strict",
        }
        reply = self.scripts["healthz"].popleft() if self.scripts["healthz"] else Reply()
        await self._wait(reply.delay)
        if reply.raw is not None:
            return Response(reply.raw, status_code=reply.status or 200, media_type="application/json")
        body = reply.result if reply.result is not None else _patched(default, reply.patch)
        return JSONResponse(body, status_code=reply.status or 200)

    async def _shop_agent(self, request: Request) -> Response:
        raw = await request.body()
        try:
            payload = json.loads(raw)
        except ValueError:
            self.requests.append({"_raw": raw.decode("utf-8", "replace")})
            return JSONResponse({"result": {"error": "No JSON data provided"}})
        self.requests.append(payload)
        action = payload.get("action")
        queue = self.scripts[str(action)]
        reply = queue.popleft() if queue else Reply()
        await self._wait(reply.delay)
        if reply.raw is not None:
            if reply.effect:
                self._default(payload)
            return Response(reply.raw, status_code=reply.status or 200, media_type="application/json")
        if reply.result is not None:
            if reply.effect:
                self._default(payload)
            return JSONResponse({"result": reply.result}, status_code=reply.status or 200)
        status, result = (200, {}) if reply.effect is False else self._default(payload)
        return JSONResponse({"result": _patched(result, reply.patch)}, status_code=reply.status or status)

    # -- default behaviour: a minimal lease pool

    def _default(self, payload: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        action = payload.get("action")
        if action == "reset":
            if payload.get("env_idx") is not None:
                return 400, {"error": "reset must not include env_idx; the server assigns a slot"}
            if not self.free:
                return 503, {"error": "stub has no free slot"}
            env_idx = self.free.pop(0)
            lease_id = uuid.uuid4().hex
            self.leases[env_idx] = lease_id
            task = payload.get("idx")
            return 200, {
                "task_instruction": f"给我找一款适合任务 {task} 的商品",
                "observation": HOME_TEXT,
                "observation_state": _home_state(),
                "message": f"Task {task} started",
                "env_idx": env_idx,
                "idx": task,
                "task_mode": "persona" if payload.get("if_persona") else "standard",
                "interaction_mode": payload.get("interaction_mode"),
                "environment_version": ENVIRONMENT_VERSION,
                "user_persona": {},
                "lease_id": lease_id,
            }
        if action not in ("interact", "terminate", "release_one"):
            return 400, {"error": f"unsupported action: {action!r}"}
        slot: Any = payload.get("env_idx")
        lease: Any = payload.get("lease_id")
        if isinstance(slot, bool) or not isinstance(slot, int) or not lease:
            return 400, {"error": f"{action} requires a valid env_idx and lease_id"}
        if self.leases.get(slot) != lease:
            return 409, {"error": f"stale or invalid lease for environment {slot}"}
        if action == "release_one":
            del self.leases[slot]
            self.free.append(slot)
            return 200, {"message": f"Environment {slot} has been released"}
        common = {
            "observation": HOME_TEXT,
            "observation_state": _home_state(),
            "env_idx": slot,
            "idx": f"slot-{slot}-0",
            "lease_id": lease,
            "purchase": {},
            "goal": {},
            "reward_detail": {},
        }
        if action == "terminate":
            reason = payload.get("termination_reason", "action_limit")
            return 200, {
                **common,
                "done": True,
                "over": True,
                "reward": 0.0,
                "message": f"Episode terminated: {reason}",
                "termination_reason": reason,
            }
        return 200, {
            **common,
            "done": False,
            "over": False,
            "reward": 0.0,
            "message": "Continue interaction",
            "action_feedback": {
                "action": payload.get("response"),
                "valid": True,
                "reason": "executed",
                "message": "搜索已执行",
            },
        }


def _home_state() -> dict[str, Any]:
    return {
        "observation_version": OBSERVATION_VERSION,
        "page_type": "search_home",
        "search_available": True,
        "actions": [],
    }


def _patched(result: dict[str, Any], patch: dict[str, Any]) -> dict[str, Any]:
    out = dict(result)
    for key, value in patch.items():
        if value is DROP:
            out.pop(key, None)
        else:
            out[key] = value
    return out
