"""Fixtures that serve the ShopSimulator stand-in on a free loopback port."""

from __future__ import annotations

import gzip
import json
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any

import httpx
import pytest

from shopsimrl.testbed.serving import running_server
from shopsimrl.testbed.shop import ShopSettings, create_app

FIXTURES = Path(__file__).parent / "fixtures"
SMALL_CATALOG = FIXTURES / "catalog_small.json"


def write_bulk_catalog(path: Path, count: int) -> Path:
    """A gzip catalog of ``count`` near-identical cups, all matching the query 测试水杯."""
    records = []
    for i in range(count):
        records.append(
            {
                "asin": f"{500000000000 + i:012d}",
                "title": f"测试水杯 第{i}款",
                "shop_name": "杯具专营店",
                "category": "家居›杯具›水杯",
                "pricing": [10.0 + i],
                "customization_options": {},
                "attribute": ["玻璃"],
                "full_description": "",
                "small_description": "",
                "images": ["https://img.example.invalid/cup.jpg"],
                "instructions": [
                    {
                        "task_id": 10_000 + i,
                        "task_uid": f"shopsim-{i:024x}",
                        "instruction_index": 0,
                        "instruction": "买一个玻璃水杯",
                        "instruction_simple": None,
                        "attributes": ["玻璃"],
                        "instruction_options": [],
                        "price_upper": None,
                    }
                ],
            }
        )
    path.write_bytes(gzip.compress(json.dumps(records, ensure_ascii=False).encode("utf-8")))
    return path


class ShopClient:
    """A thin JSON helper over httpx; every call checks the ``{"result": …}`` envelope."""

    def __init__(self, base_url: str) -> None:
        self.base_url = base_url
        self.http = httpx.Client(base_url=base_url, timeout=httpx.Timeout(30.0), trust_env=False)

    def call(self, **payload: Any) -> tuple[int, dict[str, Any]]:
        response = self.http.post("/api/shop_agent", json=payload)
        body = response.json()
        assert set(body) == {"result"}, body
        return response.status_code, body["result"]

    def ok(self, **payload: Any) -> dict[str, Any]:
        status, result = self.call(**payload)
        assert status == 200 and "error" not in result, (status, result)
        return result

    def reset(self, idx: int, **flags: Any) -> dict[str, Any]:
        return self.ok(action="reset", idx=idx, **flags)

    def act(self, episode: dict[str, Any], response: str) -> dict[str, Any]:
        return self.ok(action="interact", env_idx=episode["env_idx"], lease_id=episode["lease_id"], response=response)

    def terminate(self, episode: dict[str, Any], reason: str = "generation_length") -> dict[str, Any]:
        return self.ok(action="terminate", env_idx=episode["env_idx"], lease_id=episode["lease_id"], termination_reason=reason)

    def release(self, episode: dict[str, Any]) -> tuple[int, dict[str, Any]]:
        return self.call(action="release_one", env_idx=episode["env_idx"], lease_id=episode["lease_id"])

    def health(self) -> dict[str, Any]:
        response = self.http.get("/healthz")
        assert response.status_code == 200
        return response.json()

    def close(self) -> None:
        self.http.close()


@contextmanager
def _serve(catalog: Path = SMALL_CATALOG, **settings: Any) -> Iterator[ShopClient]:
    app = create_app(ShopSettings(**settings), catalog_path=catalog)
    with running_server(app) as url:
        client = ShopClient(url)
        try:
            yield client
        finally:
            client.close()


@pytest.fixture
def make_shop() -> Callable[..., AbstractContextManager[ShopClient]]:
    """Start a dedicated server: ``with make_shop(slots=1) as shop: …``."""
    return _serve


@pytest.fixture(scope="module")
def _shared_shop() -> Iterator[ShopClient]:
    with _serve(slots=4) as client:
        yield client


@pytest.fixture
def shop(_shared_shop: ShopClient) -> ShopClient:
    """The module's shared 4-slot server over the small fixture catalog, with every slot free."""
    _shared_shop.ok(action="release_all")
    return _shared_shop


@pytest.fixture(scope="module")
def bulk_shop(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ShopClient]:
    """A server over 160 matching products (more than the 150 search results kept)."""
    catalog = write_bulk_catalog(tmp_path_factory.mktemp("bulk") / "bulk.json.gz", 160)
    with _serve(catalog, slots=2) as client:
        client.ok(action="release_all")
        yield client
