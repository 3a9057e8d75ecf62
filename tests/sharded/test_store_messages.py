"""What a sharded command says when the S3 location cannot be used: wrong or missing credentials,
a bucket that does not exist. Against real S3 servers: moto with its authentication on (IAM
keys it checks, in its own process) and SeaweedFS (auth on with the test keys)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.sharded.conftest import REPO, S3_TEST_ENV, _free_port, _make_bucket

pytestmark = [pytest.mark.s3, pytest.mark.slow]

MOTO_WITH_AUTH = """
import os, sys, time
os.environ["INITIAL_NO_AUTH_ACTION_COUNT"] = "3"  # the IAM user, its policy and its key; then every call is checked
from moto.server import ThreadedMotoServer
server = ThreadedMotoServer(ip_address="127.0.0.1", port=int(sys.argv[1]), verbose=False)
server.start()
print("ready", flush=True)
sys.stdin.read()  # until the test closes the pipe
server.stop()
"""


@dataclass
class Store:
    kind: str
    endpoint: str
    key: str
    secret: str
    bucket: str


@pytest.fixture(scope="module")
def moto_with_auth() -> Iterator[Store]:
    """A moto server that checks credentials: one IAM user with an allow-all policy and its key."""
    import boto3

    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-c", MOTO_WITH_AUTH, str(port)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == "ready"
        endpoint = f"http://127.0.0.1:{port}"
        unsigned = {"endpoint_url": endpoint, "region_name": "us-east-1", "aws_access_key_id": "x", "aws_secret_access_key": "y"}
        iam = boto3.client("iam", **unsigned)
        iam.create_user(UserName="runner")
        policy = {"Version": "2012-10-17", "Statement": [{"Effect": "Allow", "Action": "*", "Resource": "*"}]}
        iam.put_user_policy(UserName="runner", PolicyName="all", PolicyDocument=json.dumps(policy))
        key = iam.create_access_key(UserName="runner")["AccessKey"]
        bucket = f"shopsimrl-{int(time.time() * 1000) % 10**9}"
        signed = {**unsigned, "aws_access_key_id": key["AccessKeyId"], "aws_secret_access_key": key["SecretAccessKey"]}
        boto3.client("s3", **signed).create_bucket(Bucket=bucket)
        yield Store("moto", endpoint, key["AccessKeyId"], key["SecretAccessKey"], bucket)
    finally:
        if server.stdin is not None:
            server.stdin.close()
        try:
            server.wait(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()


@pytest.fixture(params=["moto", "seaweedfs"])
def store(request: pytest.FixtureRequest) -> Store:
    if request.param == "moto":
        return request.getfixturevalue("moto_with_auth")  # type: ignore[no-any-return]
    endpoint = request.getfixturevalue("seaweedfs_endpoint")
    key, secret = S3_TEST_ENV["AWS_ACCESS_KEY_ID"], S3_TEST_ENV["AWS_SECRET_ACCESS_KEY"]
    return Store("seaweedfs", endpoint, key, secret, _make_bucket(endpoint, key, secret))


def shopsimrl(store: Store, *args: str, key: str | None, secret: str | None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("AWS_", "SHOPSIMRL_"))}
    env.update(AWS_DEFAULT_REGION="us-east-1", AWS_ENDPOINT_URL=store.endpoint, HOME=str(REPO / "no-such-home"))
    if key is not None:
        env["AWS_ACCESS_KEY_ID"] = key
    if secret is not None:
        env["AWS_SECRET_ACCESS_KEY"] = secret
    return subprocess.run(
        [sys.executable, "-m", "shopsimrl", *args], capture_output=True, text=True, cwd=REPO, env=env, timeout=120
    )


def commands(uri: str, tmp_path: Path) -> list[list[str]]:
    config = tmp_path / "plan.yaml"
    config.write_text(
        f"""experiment: {{name: messages, output_dir: {tmp_path / "runs"}, seed: 1, concurrency: 2}}
tasks: {{split_file: {REPO / "configs" / "splits" / "persona_splits.v1.json"}, split: val, sample_size: 4}}
environment: {{base_url: "http://127.0.0.1:9"}}
model: {{id: m, name: m, base_url: "http://127.0.0.1:9/v1", api_key_env: null}}
""",
        encoding="utf-8",
    )
    return [["status", uri], ["reduce", uri], ["plan", str(config), "--shards", "2", "--run", uri]]


def assert_bad_input_naming(result: subprocess.CompletedProcess[str], uri: str, *said: str, secret: str) -> None:
    assert result.returncode == 2, (result.returncode, result.stderr[-2000:])
    assert "Traceback" not in result.stderr and "──" not in result.stderr, result.stderr[-2000:]
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith(f"error: {uri}: "), line
    for words in said:
        assert words in line, line
    assert secret not in result.stderr + result.stdout


@pytest.mark.parametrize(
    ("case", "said"),
    [
        ("wrong key", ["InvalidAccessKeyId", "AWS_ACCESS_KEY_ID"]),
        ("wrong secret", ["SignatureDoesNotMatch", "AWS_SECRET_ACCESS_KEY"]),
    ],
)
def test_wrong_credentials_name_the_location_and_what_is_wrong(store: Store, tmp_path: Path, case: str, said: list[str]) -> None:
    uri = f"s3://{store.bucket}/runs/x"
    key, secret = ("AKIANOSUCHKEY0000000", store.secret) if case == "wrong key" else (store.key, "not-the-secret-0123456789")
    for command in commands(uri, tmp_path):
        assert_bad_input_naming(shopsimrl(store, *command, key=key, secret=secret), uri, "access denied", *said, secret=secret)


def test_missing_credentials_name_the_location(store: Store, tmp_path: Path) -> None:
    uri = f"s3://{store.bucket}/runs/x"
    for command in commands(uri, tmp_path):
        result = shopsimrl(store, *command, key=None, secret=None)
        assert_bad_input_naming(result, uri, "no usable S3 credentials", "AWS_SECRET_ACCESS_KEY", secret=store.secret)


def test_a_missing_bucket_is_named_not_reported_as_a_missing_manifest(store: Store, tmp_path: Path) -> None:
    uri = "s3://shopsimrl-no-such-bucket/runs/x"
    for command in commands(uri, tmp_path):
        result = shopsimrl(store, *command, key=store.key, secret=store.secret)
        assert_bad_input_naming(result, uri, "the bucket 'shopsimrl-no-such-bucket' does not exist", secret=store.secret)
        assert "manifest" not in result.stderr


def test_the_right_credentials_still_work(store: Store, tmp_path: Path) -> None:
    uri = f"s3://{store.bucket}/runs/ok"
    planned = shopsimrl(store, *commands(uri, tmp_path)[2], key=store.key, secret=store.secret)
    assert planned.returncode == 0, planned.stderr[-2000:]
    status = shopsimrl(store, "status", uri, key=store.key, secret=store.secret)
    assert status.returncode == 0, status.stderr[-2000:]
