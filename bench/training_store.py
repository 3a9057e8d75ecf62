"""What storing training rollouts costs: a local run directory against an object store.

The real path: the testbed shop and token endpoint (in this process, over HTTP), the training
worker slime's adapter holds, and for the object store a moto S3 server behind the project's
fault proxy (no fault injected: it counts requests and bytes, and ``--store-delay`` adds a round
trip per request, as a store that is not on loopback has). Printed per layout:

- wall time of the whole round and its rollouts per second;
- how long a rollout's call waited in ``store.commit`` (the local layout: its two fsynced
  appends; the object store: until the commit of the part holding it is stored);
- requests and bytes stored per rollout (object store), and the seconds ``open_run`` takes to
  read every record back.

    .venv/bin/python bench/training_store.py [--rollouts 64] [--concurrency 16] [--store-delay 0.03]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from shopsimrl.storage.reading import open_run  # noqa: E402
from shopsimrl.testbed.policy import PolicySettings  # noqa: E402
from shopsimrl.testbed.policy import create_app as create_policy_app  # noqa: E402
from shopsimrl.testbed.serving import running_server  # noqa: E402
from shopsimrl.testbed.shop import ShopSettings  # noqa: E402
from shopsimrl.testbed.shop import create_app as create_shop_app  # noqa: E402
from shopsimrl.training.config import load_training_config  # noqa: E402
from shopsimrl.training.worker import Sampling, TrainingWorker  # noqa: E402
from tests.sharded.faultproxy import FaultPlan, FaultProxy  # noqa: E402

SPLITS = REPO / "configs/splits/persona_splits.v1.json"
TRAIN_IDS: list[int] = json.loads(SPLITS.read_text())["splits"]["train"]["task_ids"]


async def _round(config: Path, model_url: str, rollouts: int, per_group: int) -> tuple[float, list[float]]:
    worker = TrainingWorker(
        load_training_config(config), base_url=model_url, sampling=Sampling(temperature=0.6, max_new_tokens=512)
    )
    waits: list[float] = []
    commit = worker.store.commit

    async def timed(rollout: Any) -> None:
        started = time.perf_counter()
        await commit(rollout)
        waits.append(time.perf_counter() - started)

    worker.store.commit = timed  # type: ignore[method-assign]  # measured, not changed
    await worker.start()
    started = time.perf_counter()
    try:
        await asyncio.gather(
            *(
                worker.rollout(task_id=TRAIN_IDS[i // per_group % len(TRAIN_IDS)], index=i, group_index=i // per_group)
                for i in range(rollouts)
            )
        )
    finally:
        await worker.aclose()
    return time.perf_counter() - started, waits


def _config(directory: Path, shop: str, output_dir: str, concurrency: int) -> Path:
    path = directory / "training.yaml"
    path.write_text(
        f"run: {{name: bench, output_dir: '{output_dir}', concurrency: {concurrency}}}\n"
        f"tasks: {{split_file: {SPLITS}, split: train}}\n"
        f"environment: {{base_url: '{shop}', persona: true}}\n"
        "model: {name: testbed-policy}\n"
    )
    return path


def _report(name: str, rollouts: int, wall: float, waits: list[float]) -> None:
    waits = sorted(waits)
    print(
        f"{name}: {rollouts} rollouts in {wall:.1f} s ({rollouts / wall:.1f}/s); commit wait "
        f"mean {statistics.mean(waits) * 1000:.0f} ms, p50 {waits[len(waits) // 2] * 1000:.0f} ms, "
        f"p95 {waits[int(len(waits) * 0.95)] * 1000:.0f} ms, max {waits[-1] * 1000:.0f} ms"
    )


def _read_back(location: str) -> tuple[int, float]:
    started = time.perf_counter()
    count = sum(1 for _ in open_run(location).records())
    return count, time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--rollouts", type=int, default=64)
    parser.add_argument("--per-group", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--store-delay", type=float, default=0.0, help="seconds added to every S3 request")
    args = parser.parse_args()

    import logging

    import s3fs
    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # moto's access log

    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    host, port = moto.get_host_and_port()
    proxy = FaultProxy(f"http://{host}:{port}", FaultPlan(delay_s=args.store_delay))
    endpoint = proxy.start()
    os.environ.update(
        {
            "AWS_ACCESS_KEY_ID": "bench",
            "AWS_SECRET_ACCESS_KEY": "bench",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint,
        }
    )
    s3fs.S3FileSystem(client_kwargs={"endpoint_url": endpoint}, skip_instance_cache=True).mkdir("bench")
    try:
        with (
            tempfile.TemporaryDirectory() as tmp,
            running_server(create_shop_app(ShopSettings(slots=args.concurrency))) as shop,
            running_server(create_policy_app(PolicySettings(token_endpoint=True))) as model,
        ):
            directory = Path(tmp)
            wall, waits = asyncio.run(
                _round(_config(directory, shop, str(directory / "runs"), args.concurrency), model, args.rollouts, args.per_group)
            )
            _report("local directory", args.rollouts, wall, waits)
            count, seconds = _read_back(str(directory / "runs" / "bench"))
            print(f"  open_run read {count} records back in {seconds:.2f} s")

            proxy.transferred.clear()
            proxy.requests.clear()
            wall, waits = asyncio.run(
                _round(_config(directory, shop, "s3://bench/runs", args.concurrency), model, args.rollouts, args.per_group)
            )
            _report(f"object store (moto, +{args.store_delay * 1000:.0f} ms a request)", args.rollouts, wall, waits)
            requests = proxy.forwarded
            by_prefix: Counter[str] = Counter()
            for (method, key), size in proxy.transferred.items():
                if method == "PUT":
                    by_prefix[key.split("/")[3] if key.count("/") >= 3 else key] += size
            print(
                f"  requests per rollout: {', '.join(f'{m} {n / args.rollouts:.2f}' for m, n in sorted(requests.items()))}; "
                f"bytes stored per rollout: {', '.join(f'{p} {n / args.rollouts / 1024:.1f} KiB' for p, n in sorted(by_prefix.items()))}"
            )
            count, seconds = _read_back("s3://bench/runs/bench")
            print(f"  open_run read {count} records back in {seconds:.2f} s")
    finally:
        proxy.stop()
        moto.stop()


if __name__ == "__main__":
    main()
