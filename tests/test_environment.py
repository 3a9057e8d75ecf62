"""The ShopSimulator HTTP adapter against a real loopback HTTP server (tests/shop_stub.py)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack
from typing import Any

import pytest

from shopsimrl.environment import (
    EnvironmentEpisode,
    EnvironmentResponseError,
    EnvironmentUnavailableError,
    EnvironmentVersionError,
    LeaseError,
    ShopEnvironment,
    ShopEnvironmentError,
    ShopSimulatorEnvironment,
    ShopSimulatorSettings,
)
from shopsimrl.testbed.serving import free_port, running_server
from tests.polling import busy_until_closed_by_server, open_connections_to, until
from tests.shop_stub import DROP, ENVIRONMENT_VERSION, OBSERVATION_VERSION, Reply, ShopStub

Factory = Callable[..., ShopSimulatorEnvironment]


@pytest.fixture
def stub() -> Iterator[ShopStub]:
    shop = ShopStub()
    with running_server(shop.app) as url:
        shop.base_url = url  # type: ignore[attr-defined]
        try:
            yield shop
        finally:
            shop.open_gate()  # end delayed handlers so the server stops at once


@pytest.fixture
def sleeps() -> list[float]:
    return []


@pytest.fixture
async def make_env(stub: ShopStub, sleeps: list[float]) -> AsyncIterator[Factory]:
    made: list[ShopSimulatorEnvironment] = []

    async def no_sleep(seconds: float) -> None:
        sleeps.append(seconds)

    def factory(**overrides: Any) -> ShopSimulatorEnvironment:
        overrides.setdefault("base_url", stub.base_url)  # type: ignore[attr-defined]
        env = ShopSimulatorEnvironment(ShopSimulatorSettings(**overrides), sleep=no_sleep)
        made.append(env)
        return env

    yield factory
    # Scripted delays end now: a reset a test abandoned is answered (and its lease released) at
    # once instead of keeping aclose waiting out its grace period for the scripted delay.
    stub.open_gate()
    for env in made:
        await env.aclose()


# --------------------------------------------------------------------------- happy path and payloads


async def test_episode_payloads_results_and_identity(stub: ShopStub, make_env: Factory) -> None:
    env = make_env(persona=True)
    assert isinstance(env, ShopEnvironment)
    assert env.identity()["environment_version"] is None
    episode = env.open_episode()
    assert isinstance(episode, EnvironmentEpisode)

    reset = await episode.reset(19)
    assert reset["env_idx"] == 0 and len(reset["lease_id"]) == 32  # the full server result
    assert reset["task_mode"] == "persona"
    step = await episode.step("search[台灯 护眼]")
    assert step["done"] is False and step["action_feedback"]["valid"] is True
    final = await episode.terminate("generation_length")
    assert final["done"] is True and final["termination_reason"] == "generation_length"
    await episode.close()

    lease = reset["lease_id"]
    assert stub.requests == [
        {
            "action": "reset",
            "idx": 19,
            "if_persona": True,
            "include_private_goal": False,
            "interaction_mode": "single_turn",
        },
        {"action": "interact", "env_idx": 0, "lease_id": lease, "response": "search[台灯 护眼]"},
        {"action": "terminate", "env_idx": 0, "lease_id": lease, "termination_reason": "generation_length"},
        {"action": "release_one", "env_idx": 0, "lease_id": lease},
    ]
    assert stub.leases == {}
    assert (episode.environment_version, episode.observation_version) == (ENVIRONMENT_VERSION, OBSERVATION_VERSION)
    assert env.identity() == {
        "adapter": "shopsimulator_http",
        "base_url": stub.base_url,  # type: ignore[attr-defined]
        "persona": True,
        "interaction_mode": "single_turn",
        "environment_version": ENVIRONMENT_VERSION,
        "observation_version": OBSERVATION_VERSION,
    }


def test_semantic_identity_leaves_out_location_and_timeouts() -> None:
    plain = ShopSimulatorEnvironment(ShopSimulatorSettings(base_url="http://a:1", timeout=5))
    moved = ShopSimulatorEnvironment(ShopSimulatorSettings(base_url="http://b:2", timeout=50, max_retries=0))
    assert (
        plain.semantic_identity()
        == moved.semantic_identity()
        == {
            "adapter": "shopsimulator_http",
            "persona": False,
            "interaction_mode": "single_turn",
        }
    )
    pinned = ShopSimulatorEnvironment(ShopSimulatorSettings(expected_observation_version=OBSERVATION_VERSION))
    assert pinned.semantic_identity()["expected_observation_version"] == OBSERVATION_VERSION
    assert "expected_environment_version" not in pinned.semantic_identity()


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("base_url", "shop:5700"),
        ("interaction_mode", "chat"),
        ("timeout", 0),
        ("reset_timeout", -1.0),
        ("max_retries", -1),
    ],
)
def test_settings_reject_bad_values(field: str, value: Any) -> None:
    with pytest.raises(ValueError, match=field):
        ShopSimulatorSettings(**{field: value})


# --------------------------------------------------------------------------- timeouts (V1) and retries


@pytest.mark.slow
async def test_reset_waits_for_a_slot_longer_than_the_call_timeout(stub: ShopStub, make_env: Factory) -> None:
    stub.script("reset", Reply(delay=0.6))  # a queued reset: the answer comes once a slot frees
    episode = make_env(timeout=0.2, reset_timeout=30.0).open_episode()
    reset = await episode.reset(3)
    assert reset["lease_id"] in stub.leases.values()
    await episode.close()


async def test_reset_wait_is_capped_by_reset_timeout(stub: ShopStub, make_env: Factory, sleeps: list[float]) -> None:
    stub.script("reset", Reply(delay=30.0))
    episode = make_env(timeout=5.0, reset_timeout=0.3).open_episode()
    with pytest.raises(EnvironmentUnavailableError, match=r"reset_timeout=0\.3"):
        await episode.reset(3)
    assert stub.actions() == ["reset"] and sleeps == []  # a timed-out reset is never resent
    await episode.close()  # nothing leased locally: no release is sent
    assert stub.actions() == ["reset"]


async def test_step_is_not_resent_after_a_read_timeout(stub: ShopStub, make_env: Factory, sleeps: list[float]) -> None:
    episode = make_env(timeout=0.2).open_episode()
    await episode.reset(1)
    stub.script("interact", Reply(delay=5.0))
    with pytest.raises(EnvironmentUnavailableError) as caught:
        await episode.step("search[耳机]")
    assert caught.value.request_sent is True and caught.value.attempts == 1
    assert stub.actions().count("interact") == 1 and sleeps == []
    await episode.close()
    assert stub.actions()[-1] == "release_one"


async def test_step_5xx_is_not_retried_and_classified(stub: ShopStub, make_env: Factory) -> None:
    episode = make_env().open_episode()
    await episode.reset(1)
    # The application's own refusal (500 + result.error) is deterministic ...
    stub.script("interact", Reply(status=500, result={"error": "episode is already terminated; reset before stepping"}))
    with pytest.raises(EnvironmentResponseError, match="already terminated") as refused:
        await episode.step("click[buy now]")
    assert refused.value.status == 500 and refused.value.action == "interact"
    assert not isinstance(refused.value, EnvironmentUnavailableError)
    # ... a gateway error means the service is unavailable (infrastructure).
    stub.script("interact", Reply(status=503, raw="service unavailable"))
    with pytest.raises(EnvironmentUnavailableError, match="503"):
        await episode.step("click[buy now]")
    assert stub.actions().count("interact") == 2
    await episode.close()
    assert stub.leases == {}


async def test_a_5xx_that_says_the_state_is_unchanged_is_sent_again(stub: ShopStub, make_env: Factory) -> None:
    """The testbed's injected faults say so in the envelope: resending is safe for every action."""
    episode = make_env().open_episode()
    unchanged = {"error": "injected fault: the testbed answered 500 without changing state", "state_unchanged": True}
    stub.script("reset", Reply(status=500, result=unchanged, effect=False))
    await episode.reset(1)
    for action, call in (("interact", episode.step("search[耳机]")), ("terminate", episode.terminate("action_limit"))):
        stub.script(action, Reply(status=500, result=unchanged, effect=False))
        await call
        assert stub.actions().count(action) == 2
    assert stub.actions() == ["reset", "reset", "interact", "interact", "terminate", "terminate"]
    # Every attempt failing the same way ends as infrastructure, never as the agent's outcome.
    for _ in range(4):
        stub.script("interact", Reply(status=500, result=unchanged, effect=False))
    with pytest.raises(EnvironmentUnavailableError, match="without changing state") as caught:
        await episode.step("search[耳机]")
    assert caught.value.state_unchanged and caught.value.attempts == 4
    await episode.close()


async def test_reset_retries_when_nothing_reached_the_server(sleeps: list[float]) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there: connection refused
    env = ShopSimulatorEnvironment(
        ShopSimulatorSettings(base_url=dead, max_retries=2, retry_backoff_seconds=0.25),
        sleep=lambda seconds: _record(sleeps, seconds),
    )
    try:
        with pytest.raises(EnvironmentUnavailableError) as caught:
            await env.open_episode().reset(1)
        assert caught.value.request_sent is False and caught.value.attempts == 3
        assert sleeps == [0.25, 0.5]
        with pytest.raises(EnvironmentUnavailableError):
            await env.healthz()
    finally:
        await env.aclose()


async def _record(sleeps: list[float], seconds: float) -> None:
    sleeps.append(seconds)


async def test_step_is_retried_when_the_connection_is_refused() -> None:
    stub, port = ShopStub(), free_port()
    with ExitStack() as servers:
        servers.enter_context(running_server(stub.app, port=port))

        async def restart_server(seconds: float) -> None:
            # The server comes back during the backoff, as after a pod restart.
            servers.enter_context(running_server(stub.app, port=port))

        env = ShopSimulatorEnvironment(ShopSimulatorSettings(base_url=f"http://127.0.0.1:{port}"), sleep=restart_server)
        try:
            episode = env.open_episode()
            await episode.reset(1)
            servers.close()  # the server goes away between two calls ...
            # ... and the client's loop sees its pooled connection close (closes its own end).
            await until(lambda: not open_connections_to(port), "the client closes the connection the server closed")
            step = await episode.step("search[耳机]")
            assert step["done"] is False
            assert stub.actions() == ["reset", "interact"]  # delivered exactly once
            await episode.close()
            assert stub.leases == {}
        finally:
            await env.aclose()


async def test_step_on_a_pooled_connection_the_server_closed_goes_out_once_on_a_new_one() -> None:
    """The server closes the pooled connection while the client's event loop is busy (here:
    stopping the server blocks it), so its FIN waits unread: the client finds the connection
    stale before writing, sends the interact on a new connection, once."""
    stub, port = ShopStub(), free_port()
    with ExitStack() as servers:
        servers.enter_context(running_server(stub.app, port=port))
        env = ShopSimulatorEnvironment(ShopSimulatorSettings(base_url=f"http://127.0.0.1:{port}"))
        try:
            episode = env.open_episode()
            await episode.reset(1)
            servers.close()  # closed while the client still holds the connection in its pool
            assert open_connections_to(port) == ["CLOSE_WAIT"]  # the client has not seen it yet
            servers.enter_context(running_server(stub.app, port=port))
            step = await episode.step("search[耳机]")
            assert step["done"] is False and stub.actions() == ["reset", "interact"]
            await episode.close()
        finally:
            await env.aclose()


async def test_step_whose_connection_is_dropped_after_the_server_read_it_is_not_resent(stub: ShopStub) -> None:
    """A request that reached the server on a connection then closed without an answer may have
    been acted on: an interact is never sent twice, the failure is infrastructure (the episode is
    retried whole). A proxy in front of the shop forwards the interact and hangs up on the client."""

    async def relay(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream_reader, upstream_writer = await asyncio.open_connection("127.0.0.1", int(stub.base_url.rsplit(":", 1)[1]))  # type: ignore[attr-defined]

        async def answers() -> None:
            while data := await upstream_reader.read(65536):
                writer.write(data)
                await writer.drain()

        back = asyncio.create_task(answers())
        try:
            while data := await reader.read(65536):
                if b'"interact"' in data:
                    back.cancel()  # the shop acts on it; its answer never reaches the client
                    upstream_writer.write(data)
                    await upstream_writer.drain()
                    await until(lambda: "interact" in stub.actions(), "the shop received the interact")
                    break
                upstream_writer.write(data)
                await upstream_writer.drain()
        finally:
            back.cancel()
            writer.close()
            upstream_writer.close()

    proxy = await asyncio.start_server(relay, "127.0.0.1", 0)
    url = f"http://127.0.0.1:{proxy.sockets[0].getsockname()[1]}"
    env = ShopSimulatorEnvironment(ShopSimulatorSettings(base_url=url, cleanup_grace_seconds=1.0))
    try:
        episode = env.open_episode()
        await episode.reset(1)
        with pytest.raises(EnvironmentUnavailableError) as failure:
            await episode.step("search[耳机]")
        assert failure.value.request_sent and failure.value.attempts == 1
        assert stub.actions() == ["reset", "interact"]  # it arrived, once
    finally:
        await env.aclose()
        proxy.close()
        await proxy.wait_closed()


async def test_reset_retries_503_but_not_500(stub: ShopStub, make_env: Factory, sleeps: list[float]) -> None:
    env = make_env()
    stub.script("reset", Reply(status=503, result={"error": "upstream unavailable"}))
    episode = env.open_episode()
    await episode.reset(2)
    assert stub.actions() == ["reset", "reset"] and sleeps == [0.5]
    await episode.close()

    stub.script("reset", Reply(status=500, result={"error": "'unknown or inactive task_id 7'"}))
    with pytest.raises(EnvironmentResponseError, match="unknown or inactive task_id 7"):
        await env.open_episode().reset(7)
    assert stub.actions().count("reset") == 3


# --------------------------------------------------------------------------- failed answers


async def test_result_error_with_http_200_is_a_failure(stub: ShopStub, make_env: Factory) -> None:
    stub.script("reset", Reply(status=200, result={"error": "No JSON data provided"}))
    episode = make_env().open_episode()
    with pytest.raises(EnvironmentResponseError) as caught:
        await episode.reset(4)
    assert caught.value.status == 200 and caught.value.server_message == "No JSON data provided"
    assert "reset" in str(caught.value) and "No JSON data provided" in str(caught.value)
    assert not episode.holds_lease  # type: ignore[attr-defined]


async def test_stale_lease_is_a_lease_error(stub: ShopStub, make_env: Factory) -> None:
    episode = make_env().open_episode()
    await episode.reset(4)
    stub.leases.clear()  # as after release_all: the server forgot this lease
    stub.free = [0, 1, 2, 3]
    with pytest.raises(LeaseError, match="stale or invalid lease for environment 0") as caught:
        await episode.step("search[x]")
    assert caught.value.status == 409 and isinstance(caught.value, EnvironmentResponseError)
    with pytest.raises(LeaseError):
        await episode.close()  # the first release itself is rejected: reported, lease dropped
    assert not episode.holds_lease  # type: ignore[attr-defined]


async def test_4xx_and_malformed_bodies_are_response_errors(stub: ShopStub, make_env: Factory) -> None:
    episode = make_env().open_episode()
    await episode.reset(4)
    stub.script("interact", Reply(status=400, result={"error": "interact requires a valid env_idx and lease_id"}))
    with pytest.raises(EnvironmentResponseError, match="HTTP 400: interact requires a valid env_idx") as caught:
        await episode.step("search[x]")
    assert not isinstance(caught.value, EnvironmentUnavailableError)
    stub.script("interact", Reply(raw="<html>oops</html>"))
    with pytest.raises(EnvironmentResponseError, match="not a JSON object"):
        await episode.step("search[x]")
    stub.script("interact", Reply(raw='{"result": [1, 2]}'))
    with pytest.raises(EnvironmentResponseError, match="not a JSON object"):
        await episode.step("search[x]")
    await episode.close()
    assert stub.leases == {}


@pytest.mark.parametrize(
    ("patch", "message"),
    [
        ({"task_instruction": DROP}, "task_instruction"),
        ({"observation": DROP}, "'observation'"),
        ({"observation_state": "home"}, "'observation_state'"),
        ({"observation_state": {"page_type": "search_home"}}, "observation_version"),
        ({"instruction": "buy a lamp"}, "'instruction'"),
        ({"environment_version": 8}, "environment_version"),
    ],
)
async def test_reset_missing_fields_fail_and_the_lease_is_still_released(
    stub: ShopStub, make_env: Factory, patch: dict[str, Any], message: str
) -> None:
    stub.script("reset", Reply(patch=patch))
    episode = make_env().open_episode()
    with pytest.raises(EnvironmentResponseError, match=message):
        await episode.reset(5)
    assert len(stub.leases) == 1  # the server did lease a slot
    await episode.close()
    assert stub.leases == {} and stub.actions() == ["reset", "release_one"]


@pytest.mark.parametrize("patch", [{"env_idx": DROP}, {"env_idx": True}, {"lease_id": ""}])
async def test_reset_without_a_usable_lease_is_an_error(stub: ShopStub, make_env: Factory, patch: dict[str, Any]) -> None:
    stub.script("reset", Reply(patch=patch))
    with pytest.raises(EnvironmentResponseError, match=r"env_idx|lease_id"):
        await make_env().open_episode().reset(5)


async def test_step_needs_done_and_observation(stub: ShopStub, make_env: Factory) -> None:
    episode = make_env().open_episode()
    await episode.reset(5)
    stub.script("interact", Reply(patch={"done": DROP}), Reply(patch={"observation": None}))
    with pytest.raises(EnvironmentResponseError, match="'done'"):
        await episode.step("search[x]")
    with pytest.raises(EnvironmentResponseError, match="'observation'"):
        await episode.step("search[x]")
    await episode.close()


async def test_terminate_must_echo_the_reason(stub: ShopStub, make_env: Factory) -> None:
    episode = make_env().open_episode()
    await episode.reset(5)
    stub.script("terminate", Reply(patch={"termination_reason": "action_limit"}))
    with pytest.raises(EnvironmentResponseError, match="server is outdated"):
        await episode.terminate("generation_length")
    with pytest.raises(ValueError, match="termination reason"):
        await episode.terminate("finish")
    assert stub.actions().count("terminate") == 1  # the bad reason was never sent
    await episode.close()
    assert stub.leases == {}


# --------------------------------------------------------------------------- versions


async def test_pinned_version_mismatch_fails_and_releases(stub: ShopStub, make_env: Factory) -> None:
    episode = make_env(expected_environment_version="shopsimulator-paper-aligned-v9").open_episode()
    with pytest.raises(EnvironmentVersionError, match="shopsimulator-paper-aligned-v9"):
        await episode.reset(6)
    await episode.close()
    assert stub.leases == {}

    pinned = make_env(expected_environment_version=ENVIRONMENT_VERSION, expected_observation_version=OBSERVATION_VERSION)
    episode = pinned.open_episode()
    await episode.reset(6)
    await episode.close()


async def test_observation_version_change_mid_episode(stub: ShopStub, make_env: Factory) -> None:
    episode = make_env().open_episode()
    await episode.reset(6)
    newer = {
        "observation_version": "shopping-observation-v8",
        "page_type": "search_home",
        "search_available": True,
        "actions": [],
    }
    stub.script("interact", Reply(patch={"observation_state": newer}))
    with pytest.raises(EnvironmentVersionError, match="changed during the episode"):
        await episode.step("search[x]")
    await episode.close()
    assert stub.leases == {}


# --------------------------------------------------------------------------- lease lifecycle


async def test_close_is_idempotent_and_reset_needs_a_free_episode(stub: ShopStub, make_env: Factory) -> None:
    episode = make_env().open_episode()
    await episode.close()  # never reset: nothing to release
    assert stub.requests == []
    with pytest.raises(RuntimeError, match="reset"):
        await episode.step("search[x]")
    await episode.reset(8)
    with pytest.raises(RuntimeError, match="holding lease"):
        await episode.reset(9)
    await episode.close()
    await episode.close()
    assert stub.actions() == ["reset", "release_one"]


async def test_release_is_retried_on_5xx(stub: ShopStub, make_env: Factory, sleeps: list[float]) -> None:
    episode = make_env().open_episode()
    await episode.reset(8)
    stub.script("release_one", Reply(status=503, raw="boom"))
    await episode.close()
    assert stub.actions() == ["reset", "release_one", "release_one"] and sleeps == [0.5]
    assert stub.leases == {}


async def test_release_whose_answer_was_lost_counts_as_released(stub: ShopStub, make_env: Factory) -> None:
    episode = make_env().open_episode()
    await episode.reset(8)
    # The server releases the slot, but a proxy answers 502: the retry then meets a 409.
    stub.script("release_one", Reply(status=502, raw="bad gateway", effect=True))
    await episode.close()
    assert stub.actions() == ["reset", "release_one", "release_one"]
    assert stub.leases == {} and not episode.holds_lease  # type: ignore[attr-defined]


async def test_release_failure_is_raised_but_the_local_lease_is_cleared(stub: ShopStub, make_env: Factory) -> None:
    episode = make_env(max_retries=1).open_episode()
    await episode.reset(8)
    stub.script("release_one", *[Reply(status=503, raw="down")] * 2)
    with pytest.raises(EnvironmentUnavailableError, match="down") as caught:
        await episode.close()
    assert caught.value.attempts == 2
    assert not episode.holds_lease  # type: ignore[attr-defined]
    await episode.close()  # nothing left to release
    assert stub.actions().count("release_one") == 2


# --------------------------------------------------------------------------- healthz


async def test_healthz(stub: ShopStub, make_env: Factory, sleeps: list[float]) -> None:
    env = make_env(expected_observation_version=OBSERVATION_VERSION)
    stub.script("healthz", Reply(status=500, raw="starting"))
    health = await env.healthz()
    assert health["ready"] is True and health["free_slots"] == 4
    assert stub.actions() == ["healthz", "healthz"] and sleeps == [0.5]

    stub.script("healthz", Reply(patch={"observation_version": "shopping-observation-v6"}))
    with pytest.raises(EnvironmentVersionError, match="shopping-observation-v6"):
        await env.healthz()
    stub.script("healthz", Reply(raw="not json"))
    with pytest.raises(EnvironmentResponseError, match="not a JSON object"):
        await env.healthz()


async def test_healthz_of_a_shop_that_is_not_ready(stub: ShopStub, make_env: Factory, sleeps: list[float]) -> None:
    """Not ready is an answer either way: the real ShopSimulator's 200 with "ready": false and
    the testbed's 503 with the same body both come back as the body, at once, never retried; a
    503 without that body is still an outage, retried."""
    env = make_env()
    stub.script("healthz", Reply(patch={"ready": False}), Reply(status=503, patch={"ready": False}))
    for _ in range(2):
        health = await env.healthz()
        assert health["ready"] is False and health["environment_slots"] == 4
    assert stub.actions() == ["healthz", "healthz"] and sleeps == []
    stub.script("healthz", Reply(status=503, raw="upstream connect error"))
    assert (await env.healthz())["ready"] is True
    assert stub.actions()[2:] == ["healthz", "healthz"] and sleeps == [0.5]


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads Linux's /proc/net/tcp")
async def test_interacts_after_the_shop_closed_idle_connections_under_a_busy_loop_go_out_once() -> None:
    """A shop with a 1 s keep-alive (uvicorn's default is 5 s; the testbed's 30 s). 8 episodes
    step at once, then the event loop stays busy until the shop has closed every pooled
    connection (their FINs wait unread), then all 8 step again, 3 rounds: each interact must go
    out exactly once and succeed. Written into a connection the server had closed, an interact
    fails, and it is never sent again (the server may have acted on it): the episode would fail."""
    episodes, rounds = 8, 3
    shop = ShopStub(slots=episodes)
    with running_server(shop.app, timeout_keep_alive=1) as url:
        port = int(url.rsplit(":", 1)[1])
        env = ShopSimulatorEnvironment(ShopSimulatorSettings(base_url=url, max_connections=episodes))
        closed_by_server = 0
        try:
            opened = [env.open_episode() for _ in range(episodes)]
            await asyncio.gather(*(episode.reset(n + 1) for n, episode in enumerate(opened)))
            for round_ in range(rounds):
                await asyncio.gather(*(episode.step(f"search[round {round_} a]") for episode in opened))
                closed_by_server += busy_until_closed_by_server(port, len(open_connections_to(port)))
                await asyncio.gather(*(episode.step(f"search[round {round_} b]") for episode in opened))
            await asyncio.gather(*(episode.close() for episode in opened))
        finally:
            await env.aclose()
    assert closed_by_server >= rounds * episodes  # the fault, every round
    interacts = [request["response"] for request in shop.requests if request.get("action") == "interact"]
    expected = [f"search[round {r} {p}]" for r in range(rounds) for p in "ab" for _ in range(episodes)]
    assert sorted(interacts) == sorted(expected)  # each exactly once


def test_error_hierarchy() -> None:
    assert issubclass(LeaseError, EnvironmentResponseError)
    for cls in (EnvironmentUnavailableError, EnvironmentResponseError, EnvironmentVersionError):
        assert issubclass(cls, ShopEnvironmentError)
    assert not issubclass(EnvironmentUnavailableError, EnvironmentResponseError)
