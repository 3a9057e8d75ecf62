"""``skills build`` from a sharded train run on a real S3 server (moto and SeaweedFS), written by
the real CLI's shard workers against the real testbed: the analyst gets exactly the requests it
gets from a local copy of the same run; a plain local run directory works too; a count other than
the expected one is refused naming the location."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import orjson
import pytest
import s3fs
from typer.testing import CliRunner

from shopsimrl.cli import app
from tests.openai_stub import OpenAIStub
from tests.research.test_skills_build import answer
from tests.sharded.conftest import S3_TEST_ENV, Backend, S3Server, cli, worker_env, write_config
from tests.testbed_process import LocalTestbed

pytestmark = pytest.mark.slow

EPISODES = 6


def _train_config(directory: Path, testbed: LocalTestbed) -> Path:
    config = write_config(directory, testbed, episodes=EPISODES, name="train")
    config.write_text(config.read_text(encoding="utf-8").replace("  split: val\n", "  split: train\n"), encoding="utf-8")
    return config


def _build(directory: Path, traces: str, url: str, shop: str, expected: int = EPISODES) -> Any:
    """``shop``: where the failure analyst replays the run's failed trajectories."""
    directory.mkdir(parents=True, exist_ok=True)
    config = directory / "skills.yaml"
    config.write_text(
        f"experiment: {{traces: '{traces}', output_dir: out, expected_trajectories: {expected}, concurrency: 2}}\n"
        f"environment: {{base_url: '{shop}'}}\n"
        f"analyst_model: {{name: stub-model, base_url: '{url}', api_key_env: null, max_retries: 1}}\n",
        encoding="utf-8",
    )
    return CliRunner().invoke(app, ["skills", "build", str(config)], prog_name="shopsimrl")


def _asked(server: OpenAIStub) -> list[str]:
    """What the analyst was shown, one user message per request, in a fixed order."""
    return sorted(request.json["messages"][1]["content"] for request in server.completions)


def _cards(out: Path) -> list[dict[str, Any]]:
    return [orjson.loads(line) for line in (out / "evidence_cards.jsonl").read_bytes().splitlines()]


def test_a_sharded_run_on_s3_gives_the_analyst_what_a_local_copy_gives(
    tmp_path: Path, testbed: LocalTestbed, s3_server: S3Server, served: tuple[OpenAIStub, str]
) -> None:
    server, url = served
    uri = f"s3://{s3_server.bucket}/runs/train"
    env = worker_env(Backend(s3_server.kind, "", {**S3_TEST_ENV, "AWS_ENDPOINT_URL": s3_server.endpoint}))
    ran = cli("run", str(_train_config(tmp_path / "cfg", testbed)), "--shards", "2", "--run", uri, env=env)
    assert ran.returncode == 0, ran.stderr[-3000:]

    server.reset()
    server.responder = answer
    from_s3 = _build(tmp_path / "from-s3", uri, url, testbed.shop_url)
    assert from_s3.exit_code == 0, from_s3.output
    asked_s3 = _asked(server)
    assert len([r for r in server.completions if r.json["tools"][0]["function"]["name"] == "submit_success_cards"]) > 0

    local = tmp_path / "local-copy"
    fs = s3fs.S3FileSystem(
        key=S3_TEST_ENV["AWS_ACCESS_KEY_ID"],
        secret=S3_TEST_ENV["AWS_SECRET_ACCESS_KEY"],
        client_kwargs={"endpoint_url": s3_server.endpoint},
        skip_instance_cache=True,
    )
    fs.get(f"{s3_server.bucket}/runs/train/", str(local), recursive=True)
    assert (local / "shards.json").is_file()
    server.reset()
    server.responder = answer
    from_local = _build(tmp_path / "from-local", str(local), url, testbed.shop_url)
    assert from_local.exit_code == from_s3.exit_code, from_local.output
    assert _asked(server) == asked_s3
    assert _cards(tmp_path / "from-local/out") == _cards(tmp_path / "from-s3/out")
    summaries = [json.loads((tmp_path / d / "out/analysis_summary.json").read_text()) for d in ("from-s3", "from-local")]
    assert summaries[0]["episodes"]["total"] == summaries[1]["episodes"]["total"] == EPISODES

    refused = _build(tmp_path / "too-many", uri, url, testbed.shop_url, expected=EPISODES + 1)
    assert refused.exit_code == 2 and f"{uri}: {EPISODES} episodes, but exactly {EPISODES + 1} are expected" in refused.output


def test_a_local_run_directory_is_read_through_the_run_reader(
    tmp_path: Path, testbed: LocalTestbed, served: tuple[OpenAIStub, str]
) -> None:
    server, url = served
    config = _train_config(tmp_path / "cfg", testbed)
    ran = cli("run", str(config), env=worker_env(Backend("local", str(tmp_path))))
    assert ran.returncode == 0, ran.stderr[-3000:]
    (run_dir,) = (tmp_path / "cfg/local-runs").iterdir()
    server.reset()
    server.responder = answer
    built = _build(tmp_path / "from-dir", str(run_dir), url, testbed.shop_url)
    assert built.exit_code == 0, built.output
    summary = json.loads((tmp_path / "from-dir/out/analysis_summary.json").read_text(encoding="utf-8"))
    assert summary["episodes"]["total"] == EPISODES
    manifest = json.loads((tmp_path / "from-dir/out/trace2skill_manifest.json").read_text(encoding="utf-8"))
    assert "traces" in manifest["inputs"] and "traces.jsonl" not in manifest["inputs"]

    bad = _build(tmp_path / "nowhere", str(tmp_path / "no-such-run"), url, testbed.shop_url)
    assert bad.exit_code == 2 and "experiment.traces:" in bad.output and "does not exist" in bad.output
