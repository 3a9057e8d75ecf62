"""Start the testbed services (`shopsimrl testbed up`) as a real subprocess for end-to-end tests,
and find the testbed's llama.cpp server environment for the tests of a real model."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import httpx

from shopsimrl.testbed.llm import default_cache_dir, installed_server
from shopsimrl.testbed.serving import free_port

ROOT = Path(__file__).resolve().parents[1]


def llm_environment() -> tuple[Path, Path]:
    """The installed llama.cpp server environment (its python, the model file); without one the
    calling test is skipped, or fails where SHOPSIMRL_LLM_REQUIRED is set."""
    import pytest  # here, not above: bench/viewer_scale.py imports this module outside pytest

    found = installed_server()
    if found is None:
        message = f"no llama.cpp server environment in {default_cache_dir()}: run `make llm-server` first"
        if os.environ.get("SHOPSIMRL_LLM_REQUIRED"):
            pytest.fail(message)
        pytest.skip(message)
    return found


@dataclass
class LocalTestbed:
    __test__ = False  # a fixture value, not a test class
    shop_url: str
    model_url: str
    process: subprocess.Popen[bytes]

    def healthz(self) -> dict:
        return httpx.get(f"{self.shop_url}/healthz", timeout=10).json()

    def release_all(self) -> None:
        httpx.post(f"{self.shop_url}/api/shop_agent", json={"action": "release_all"}, timeout=10).raise_for_status()

    def env(self, **extra: str) -> dict[str, str]:
        """Environment for a `shopsimrl` subprocess pointed at this testbed."""
        env = {**os.environ, "SHOPSIMRL_MODEL_BASE_URL": self.model_url, "SHOPSIMRL_ENV_BASE_URL": self.shop_url}
        env.update(extra)
        return env


@contextmanager
def start_testbed(*options: str, **knobs: str) -> Iterator[LocalTestbed]:
    """``options``: more flags of ``testbed up`` (``--token-endpoint``); ``knobs``: SHOPSIM_* /
    SHOPSIM_POLICY_* variables (latency, fault rates, slots)."""
    shop_port, policy_port = free_port(), free_port()
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "shopsimrl",
            "testbed",
            "up",
            "--shop-port",
            str(shop_port),
            "--policy-port",
            str(policy_port),
            *options,
        ],
        cwd=ROOT,
        env={**os.environ, **knobs},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    bed = LocalTestbed(f"http://127.0.0.1:{shop_port}", f"http://127.0.0.1:{policy_port}/v1", process)
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if bed.healthz().get("ready") and httpx.get(f"{bed.model_url}/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"testbed did not start (exit {process.poll()})")
            time.sleep(0.1)
        yield bed
    finally:
        process.terminate()
        try:
            process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            process.kill()


def write_config(
    directory: Path, *, name: str, sample_size: int, concurrency: int = 4, extra_model: str = "", max_steps: int = 30
) -> Path:
    """A testbed config in ``directory`` with absolute paths (runs land in ``directory/runs``)."""
    path = directory / f"{name}.yaml"
    path.write_text(
        f"""
experiment: {{name: {name}, output_dir: {directory / "runs"}, seed: 20260830, concurrency: {concurrency}}}
tasks: {{split_file: {ROOT / "configs/splits/persona_splits.v1.json"}, split: val, sample_size: {sample_size}}}
environment: {{base_url: http://127.0.0.1:1}}
runtime: {{max_steps: {max_steps}, max_episode_retries: 2}}
model:
  name: shopsim-heuristic
  base_url: http://127.0.0.1:1/v1
  api_key_env: null
  max_retries: 6
  retry_backoff_seconds: 0.05
  timeout: 20
{extra_model}
""",
        encoding="utf-8",
    )
    return path
