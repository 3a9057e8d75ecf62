"""``shopsimrl skills wait-ready``, the skills pods' init container, as a process against real
HTTP servers: the OpenAI-compatible stub as the analyst server and the testbed's ShopSimulator.
Ready; a model that comes to be listed during the wait (forced: the stub lists it only after a
delay); not ready within the timeout (model not listed, shop unreachable); the URL overrides the
workers honour; no shop configured; a missing key and a bad config (exit 2)."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.openai_stub import OpenAIStub
from tests.sharded.conftest import cli
from tests.testbed_process import LocalTestbed, start_testbed

pytestmark = pytest.mark.slow

NOBODY = "http://127.0.0.1:9"
"""A port nothing listens on: connections are refused at once."""


def _env(**extra: str) -> dict[str, str]:
    env = {key: value for key, value in os.environ.items() if not key.startswith("SHOPSIMRL_")}
    return {**env, **extra}


def _config(tmp_path: Path, analyst: str, *, shop: str | None, model: str = "stub-model", key: str = "null") -> Path:
    path = tmp_path / "skills.yaml"
    environment = f"environment: {{base_url: '{shop}'}}\n" if shop is not None else ""
    path.write_text(
        "experiment: {traces: traces.jsonl, output_dir: out, expected_trajectories: 1}\n"
        f"{environment}"
        f"analyst_model: {{name: {model}, base_url: '{analyst}', api_key_env: {key}}}\n",
        encoding="utf-8",
    )
    return path


@pytest.fixture(scope="module")
def shop() -> Iterator[LocalTestbed]:
    with start_testbed() as bed:
        yield bed


@pytest.fixture
def analyst(served: tuple[OpenAIStub, str]) -> tuple[OpenAIStub, str]:
    served[0].reset()
    return served


def test_ready_when_the_model_is_listed_and_the_shop_is_ready(
    tmp_path: Path, analyst: tuple[OpenAIStub, str], shop: LocalTestbed
) -> None:
    stub, url = analyst
    ready = cli("skills", "wait-ready", str(_config(tmp_path, url, shop=shop.shop_url)), "--timeout", "0", env=_env())
    assert ready.returncode == 0, ready.stderr
    assert ready.stdout.startswith("ready: 'stub-model' is served; ShopSimulator environment is ready (")
    assert "slots free" in ready.stdout
    assert [r.path for r in stub.requests] == ["/v1/models"]


def test_waits_until_the_model_is_listed(tmp_path: Path, analyst: tuple[OpenAIStub, str], shop: LocalTestbed) -> None:
    stub, url = analyst
    stub.served_models = ["still-loading"]
    listed = threading.Timer(1.5, lambda: setattr(stub, "served_models", ["stub-model"]))
    listed.start()
    try:
        started = time.monotonic()
        ready = cli(
            "skills", "wait-ready", str(_config(tmp_path, url, shop=shop.shop_url)), "--timeout", "60", "--interval", "0.2",
            env=_env(),
        )  # fmt: skip
        waited = time.monotonic() - started
    finally:
        listed.cancel()
    assert ready.returncode == 0, ready.stderr
    assert waited >= 1.5 and "ready: 'stub-model' is served" in ready.stdout
    assert len([r for r in stub.requests if r.path == "/v1/models"]) >= 3


def test_not_ready_within_the_timeout_exits_3_naming_why(
    tmp_path: Path, analyst: tuple[OpenAIStub, str], shop: LocalTestbed
) -> None:
    stub, url = analyst
    wrong = cli(
        "skills", "wait-ready", str(_config(tmp_path, url, shop=shop.shop_url, model="no-such-analyst")),
        "--timeout", "0.5", "--interval", "0.1", env=_env(),
    )  # fmt: skip
    assert wrong.returncode == 3, wrong.stderr
    assert "model_not_listed after 0.5 s: 'no-such-analyst' is not among the served models ['stub-model']" in wrong.stderr
    assert len([r for r in stub.requests if r.path == "/v1/models"]) >= 2
    no_shop = cli(
        "skills", "wait-ready", str(_config(tmp_path, url, shop=NOBODY)), "--timeout", "0.3", "--interval", "0.1",
        env=_env(),
    )  # fmt: skip
    assert no_shop.returncode == 3
    assert f"environment_unreachable after 0.3 s: {NOBODY}/healthz" in no_shop.stderr
    no_model = cli(
        "skills", "wait-ready", str(_config(tmp_path, NOBODY + "/v1", shop=shop.shop_url)), "--timeout", "0", env=_env()
    )
    assert no_model.returncode == 3 and f"model_unreachable after 0 s: {NOBODY}/v1/models" in no_model.stderr


def test_the_workers_url_overrides_are_what_is_probed(
    tmp_path: Path, analyst: tuple[OpenAIStub, str], shop: LocalTestbed
) -> None:
    stub, url = analyst
    config = _config(tmp_path, NOBODY + "/v1", shop=NOBODY)
    moved = cli(
        "skills", "wait-ready", str(config), "--timeout", "0",
        env=_env(SHOPSIMRL_ANALYST_BASE_URL=url, SHOPSIMRL_ENV_BASE_URL=shop.shop_url),
    )  # fmt: skip
    assert moved.returncode == 0, moved.stderr
    assert "ShopSimulator environment is ready" in moved.stdout and stub.requests
    only_shop = cli("skills", "wait-ready", str(config), "--timeout", "0", env=_env(SHOPSIMRL_ENV_BASE_URL=NOBODY))
    assert only_shop.returncode == 3 and "model_unreachable" in only_shop.stderr
    # No environment.base_url in the YAML: the variable alone configures the shop, so it is probed.
    unset = _config(tmp_path, url, shop=None)
    probed = cli("skills", "wait-ready", str(unset), "--timeout", "0", env=_env(SHOPSIMRL_ENV_BASE_URL=NOBODY))
    assert probed.returncode == 3 and "environment_unreachable" in probed.stderr
    bad = cli("skills", "wait-ready", str(config), "--timeout", "0", env=_env(SHOPSIMRL_ENV_BASE_URL="shop:5700"))
    assert bad.returncode == 2 and "SHOPSIMRL_ENV_BASE_URL" in bad.stderr and "'shop:5700'" in bad.stderr


def test_no_shop_configured_probes_the_analyst_only(tmp_path: Path, analyst: tuple[OpenAIStub, str]) -> None:
    _stub, url = analyst
    ready = cli("skills", "wait-ready", str(_config(tmp_path, url, shop=None)), "--timeout", "0", env=_env())
    assert ready.returncode == 0, ready.stderr
    assert ready.stdout.strip() == (
        "ready: 'stub-model' is served; no ShopSimulator configured (environment.base_url): not probed"
    )


def test_bad_input_exits_2_before_any_probe(tmp_path: Path, analyst: tuple[OpenAIStub, str]) -> None:
    stub, url = analyst
    keyed = _config(tmp_path, url, shop=None, key="SHOPSIMRL_TEST_ANALYST_KEY")
    no_key = cli("skills", "wait-ready", str(keyed), "--timeout", "30", env=_env())
    assert no_key.returncode == 2 and "SHOPSIMRL_TEST_ANALYST_KEY" in no_key.stderr
    broken = tmp_path / "broken.yaml"
    broken.write_text(keyed.read_text() + "analysts: 2\n", encoding="utf-8")
    refused = cli("skills", "wait-ready", str(broken), "--timeout", "30", env=_env())
    assert refused.returncode == 2 and "analysts: unknown key" in refused.stderr and str(broken) in refused.stderr
    assert stub.requests == []
