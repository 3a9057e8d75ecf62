"""Reading a sharded run's parts from S3 one by one against several at a time, on moto.

    .venv/bin/python bench/part_reads.py [--parts 400] [--shards 1] [--concurrency 1,4,16]

Starts a moto S3 server process, writes ``--parts`` small committed parts (one ~300-byte
episode each) over ``--shards`` shards, then times ``reduce_run`` (no summary written) and the
research reader's pass over every record (``open_run(...).records()``, what view and compare
start with) for each read concurrency (``SHOPSIMRL_STORE_READ_CONCURRENCY``). Prints seconds per
reader and the speed-up against one by one; the results are checked equal. Moto answers on
loopback: without ``--latency-ms`` this measures per-request CPU, which overlapping cannot
save on a busy machine. A real S3 endpoint adds a round trip to every GET; the fault proxy of
the tests, in front of moto, waits ``--latency-ms`` per request to emulate it.
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shopsimrl.runner.reduce import reduce_run
from shopsimrl.storage.reading import open_run
from shopsimrl.storage.sharded import ShardedRunStore
from tests.sharded.faultproxy import FaultPlan, FaultProxy
from tests.sharded.test_parallel_reads import write_run

KEYS = {"AWS_ACCESS_KEY_ID": "bench", "AWS_SECRET_ACCESS_KEY": "bench-secret", "AWS_DEFAULT_REGION": "us-east-1"}


def measure(uri: str, args: argparse.Namespace, latency_ms: float) -> None:
    print(f"\n{args.parts} parts over {args.shards} shards on moto, {latency_ms:g} ms added per request")
    print(f"{'concurrency':>11}  {'reduce s':>8}  {'records s':>9}  {'speed-up':>8}")
    baseline = None
    reference = None
    for concurrency in (int(c) for c in args.concurrency.split(",")):
        os.environ["SHOPSIMRL_STORE_READ_CONCURRENCY"] = str(concurrency)
        started = time.perf_counter()
        summary = reduce_run(ShardedRunStore(uri), write=False)
        reduce_s = time.perf_counter() - started
        started = time.perf_counter()
        ids = [record["episode_id"] for record in open_run(uri).records()]
        records_s = time.perf_counter() - started
        result = (summary["counts"], summary["primary"], ids)
        reference = reference or result
        assert result == reference, "the readers disagree"
        baseline = baseline or reduce_s + records_s
        print(f"{concurrency:>11}  {reduce_s:>8.2f}  {records_s:>9.2f}  {baseline / (reduce_s + records_s):>7.1f}x")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--parts", type=int, default=400)
    parser.add_argument("--shards", type=int, default=1)
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument(
        "--latency-ms", default="0,20", help="Round trips to emulate, one table each (a proxy waits this long per request)."
    )
    args = parser.parse_args()
    # moto in its own process: in this one it would share the GIL with the reader it serves.
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    server = subprocess.Popen(
        [str(Path(sys.executable).parent / "moto_server"), "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    host = "127.0.0.1"
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection((host, port), timeout=1).close()
            break
        except OSError:
            if time.monotonic() > deadline or server.poll() is not None:
                raise SystemExit("moto_server did not start") from None
            time.sleep(0.2)
    try:
        endpoint = f"http://{host}:{port}"
        os.environ.update({**KEYS, "AWS_ENDPOINT_URL": endpoint})
        import boto3

        boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="bench")
        uri = "s3://bench/part-reads"
        write_run(uri, args.parts, args.shards, torn_part=False, retry=None)
        for latency_ms in (float(ms) for ms in args.latency_ms.split(",")):
            proxy = FaultProxy(endpoint, FaultPlan(delay_s=latency_ms / 1000))
            os.environ["AWS_ENDPOINT_URL"] = proxy.start()
            try:
                measure(uri, args, latency_ms)
            finally:
                proxy.stop()
    finally:
        server.terminate()
        server.wait(timeout=20)


if __name__ == "__main__":
    main()
