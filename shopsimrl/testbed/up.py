"""``shopsimrl testbed up``: the shop and the heuristic policy in one process, until Ctrl-C."""

from __future__ import annotations

import asyncio

import uvicorn
from starlette.applications import Starlette

from shopsimrl.testbed.policy import PolicySettings
from shopsimrl.testbed.policy import create_app as create_policy_app
from shopsimrl.testbed.shop import create_app as create_shop_app

__all__ = ["serve_both"]


def _server(app: Starlette, host: str, port: int) -> uvicorn.Server:
    return uvicorn.Server(
        uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, backlog=4096, lifespan="auto")
    )


def serve_both(host: str = "127.0.0.1", shop_port: int = 5700, policy_port: int = 8000, *, token_endpoint: bool = False) -> None:
    shop = _server(create_shop_app(), host, shop_port)
    policy = _server(create_policy_app(PolicySettings(token_endpoint=True) if token_endpoint else None), host, policy_port)

    async def main() -> None:
        tasks = [asyncio.create_task(shop.serve()), asyncio.create_task(policy.serve())]
        while not (shop.started and policy.started):
            if any(task.done() for task in tasks):
                break
            await asyncio.sleep(0.05)
        if shop.started and policy.started:
            print(
                f"shop (ShopSimulator-compatible): http://{host}:{shop_port}   healthz: http://{host}:{shop_port}/healthz",
                flush=True,
            )
            print(f"policy (OpenAI-compatible):      http://{host}:{policy_port}/v1   model: shopsim-heuristic", flush=True)
            if token_endpoint:
                print(f"token endpoint (SGLang /generate): http://{host}:{policy_port}/generate", flush=True)
            print("Ctrl-C stops both.", flush=True)
        # uvicorn installs the signal handlers; on Ctrl-C both servers leave serve() cleanly.
        done, pending = await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        shop.should_exit = policy.should_exit = True
        await asyncio.gather(*pending, return_exceptions=True)
        for task in done:
            task.result()

    asyncio.run(main())
