"""``shopsimrl testbed shop|policy|up``: the local stand-ins for the services. The core CLI
registers these from its table of optional parts (:mod:`shopsimrl.cli`); module level imports
typer and the core CLI only, the servers (starlette, uvicorn) load when a command runs."""

from __future__ import annotations

import typer

from shopsimrl.cli.common import HELP_STYLE
from shopsimrl.cli.errors import import_part

app = typer.Typer(rich_markup_mode=None)
testbed_app = typer.Typer(help="Local stand-ins: a ShopSimulator-compatible shop and a heuristic policy model.", **HELP_STYLE)
app.add_typer(testbed_app, name="testbed")


@testbed_app.command("shop")
def testbed_shop(
    host: str = typer.Option("127.0.0.1", help="Bind address."),
    port: int = typer.Option(5700, help="Port."),
) -> None:
    """Serve the ShopSimulator-compatible shop (POST /api/shop_agent, GET /healthz)."""
    import_part("shopsimrl.testbed.shop.server", "testbed").serve(host=host, port=port)


@testbed_app.command("policy")
def testbed_policy(
    host: str = typer.Option("127.0.0.1", help="Bind address."),
    port: int = typer.Option(8000, help="Port."),
    token_endpoint: bool = typer.Option(
        False,
        "--token-endpoint",
        help="Also serve SGLang's native POST /generate (token ids in, token ids and log-probabilities out) "
        "with the testbed tokenizer and chat template, for training rollouts (SHOPSIM_POLICY_TOKEN_ENDPOINT=1 does the same).",
    ),
) -> None:
    """Serve the heuristic policy as an OpenAI-compatible model (POST /v1/chat/completions)."""
    policy = import_part("shopsimrl.testbed.policy", "testbed")
    settings = policy.PolicySettings(token_endpoint=True) if token_endpoint else None
    policy.serve(host=host, port=port, settings=settings)


@testbed_app.command("up")
def testbed_up(
    host: str = typer.Option("127.0.0.1", help="Bind address of both services."),
    shop_port: int = typer.Option(5700, help="Shop port."),
    policy_port: int = typer.Option(8000, help="Policy port."),
    token_endpoint: bool = typer.Option(
        False, "--token-endpoint", help="The policy also serves SGLang's POST /generate (see `testbed policy --help`)."
    ),
) -> None:
    """Serve both testbed services until Ctrl-C."""
    import_part("shopsimrl.testbed.up", "testbed").serve_both(
        host=host, shop_port=shop_port, policy_port=policy_port, token_endpoint=token_endpoint
    )
