"""A run at high concurrency against a model server that cannot take it: adaptive in-flight limit
on and off.

It starts `shopsimrl testbed up` as a separate process whose policy server answers at most
--capacity chat completions at once (SHOPSIM_POLICY_MAX_INFLIGHT; one more gets HTTP 429 with
Retry-After: 1, as a server with a full queue does), each after --latency-ms, then runs the real
CLI twice, `python -m shopsimrl run CONFIG --no-progress --set model.adaptive_concurrency=X`,
with C = --concurrency episodes in flight:

    .venv/bin/python bench/model_overload.py                      # C = 1,024, capacity 16, 200 ms
    .venv/bin/python bench/model_overload.py --concurrency 256 --episodes 256 --capacity 8

Per run it prints completed and failed episodes, model attempts refused with 429, the window
(earliest episode start to latest end) and its efficiency against the ideal: the server busy at
capacity for the whole window, i.e. model steps x latency / capacity seconds. Model calls use
the default retry policy (5 attempts, 1 s backoff doubling, Retry-After honoured): a call refused
five times fails its episode. Timings depend on the machine; nothing here is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPLITS = ROOT / "configs" / "splits" / "persona_splits.v1.json"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_ready(shop: str, model: str) -> None:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with (
                urllib.request.urlopen(f"{shop}/healthz", timeout=2) as a,
                urllib.request.urlopen(f"{model}/models", timeout=2) as b,
            ):
                if a.status == 200 and b.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.2)
    raise SystemExit("the testbed did not become ready within 60 s")


def write_config(directory: Path, name: str, episodes: int, concurrency: int) -> Path:
    path = directory / f"{name}.yaml"
    path.write_text(
        f"experiment: {{name: {name}, output_dir: {directory / 'runs'}, seed: 20260830, concurrency: {concurrency}}}\n"
        f"tasks: {{split_file: {SPLITS}, split: train, sample_size: {episodes}}}\n"
        "environment: {base_url: http://127.0.0.1:1, timeout: 120}\n"
        "runtime: {max_steps: 30, max_episode_retries: 0}\n"
        "model: {name: shopsim-heuristic, base_url: http://127.0.0.1:1/v1, api_key_env: null, timeout: 30}\n",
        encoding="utf-8",
    )
    return path


def window_s(traces: Path) -> float:
    starts, ends = [], []
    for line in traces.read_text(encoding="utf-8").splitlines():
        record = json.loads(line)
        starts.append(datetime.fromisoformat(record["started_at"]))
        ends.append(datetime.fromisoformat(record["ended_at"]))
    return (max(ends) - min(starts)).total_seconds()


def refused(traces: Path) -> int:
    count = 0
    for line in traces.read_text(encoding="utf-8").splitlines():
        for step in json.loads(line).get("steps") or []:
            count += sum(1 for attempt in (step.get("model") or {}).get("attempts") or [] if attempt.get("status") == 429)
    return count


def run_once(config: Path, adaptive: bool, env: dict[str, str]) -> dict[str, object]:
    started = time.monotonic()
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "shopsimrl",
            "run",
            str(config),
            "--no-progress",
            "--set",
            f"model.adaptive_concurrency={str(adaptive).lower()}",
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=3600,
    )
    wall = time.monotonic() - started
    run_dir = config.parent / "runs" / config.stem
    if not (run_dir / "summary.json").exists():
        raise SystemExit(f"the run wrote no summary (exit {proc.returncode}):\n{proc.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))
    traces = run_dir / "traces.jsonl"
    return {
        "adaptive": adaptive,
        "exit": proc.returncode,
        "completed": summary["counts"].get("completed"),
        "failed": summary["counts"].get("failed"),
        "model_steps": summary["behavior"].get("model_steps"),
        "refused_429": refused(traces),
        "failure_classes": summary.get("failure_classes") or {},
        "errors": summary.get("errors") or {},
        "window_s": window_s(traces),
        "process_s": wall,
        "inflight": {k: v for k, v in (summary.get("model_inflight") or {}).items() if k != "history"},
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--concurrency", type=int, default=1024)
    parser.add_argument("--episodes", type=int, default=1024)
    parser.add_argument("--capacity", type=int, default=16, help="chat completions the policy server answers at once")
    parser.add_argument("--latency-ms", type=float, default=200.0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if min(args.concurrency, args.episodes, args.capacity) < 1 or args.latency_ms <= 0:
        parser.error("--concurrency, --episodes, --capacity must be >= 1 and --latency-ms > 0")

    shop_port, policy_port = free_port(), free_port()
    knobs = {
        "SHOPSIM_POLICY_MAX_INFLIGHT": str(args.capacity),
        "SHOPSIM_POLICY_LATENCY_MS": str(args.latency_ms),
        "SHOPSIM_ENV_SLOTS": str(args.concurrency + 16),
    }
    server = subprocess.Popen(
        [sys.executable, "-m", "shopsimrl", "testbed", "up", "--shop-port", str(shop_port), "--policy-port", str(policy_port)],
        cwd=ROOT,
        env={**os.environ, **knobs},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    shop, model = f"http://127.0.0.1:{shop_port}", f"http://127.0.0.1:{policy_port}/v1"
    rows = []
    try:
        wait_ready(shop, model)
        env = {**os.environ, "SHOPSIMRL_MODEL_BASE_URL": model, "SHOPSIMRL_ENV_BASE_URL": shop}
        with tempfile.TemporaryDirectory() as scratch:
            for adaptive in (False, True):
                name = "adaptive" if adaptive else "fixed"
                rows.append(run_once(write_config(Path(scratch), name, args.episodes, args.concurrency), adaptive, env))
    finally:
        server.terminate()
        server.wait(timeout=30)

    print(
        f"C = {args.concurrency}, {args.episodes} episodes, server capacity {args.capacity}, "
        f"latency {args.latency_ms:g} ms, {os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}"
    )
    header = f"{'limit':<9}{'completed':>10}{'failed':>8}{'429s*':>8}{'steps':>8}{'window s':>10}{'ideal s':>9}{'eff':>6}"
    print(header)
    for row in rows:
        steps = int(row["model_steps"] or 0)
        ideal = steps * args.latency_ms / 1000.0 / args.capacity
        window = float(row["window_s"])  # type: ignore[arg-type]
        row["ideal_s"], row["efficiency"] = ideal, ideal / window if window else None
        print(
            f"{'adaptive' if row['adaptive'] else 'fixed':<9}{row['completed']:>10}{row['failed']:>8}{row['refused_429']:>8}"
            f"{steps:>8}{window:>10.1f}{ideal:>9.1f}{ideal / window:>6.2f}"
        )
    for row in rows:
        print(f"{'adaptive' if row['adaptive'] else 'fixed'} failures: {json.dumps(row['errors'], sort_keys=True)}")
    adaptive_row = rows[-1]["inflight"]
    print(f"adaptive limit: {json.dumps(adaptive_row, sort_keys=True)}")
    print("* 429s in the steps of the traces (attempts of calls that failed for good are in the failures)")
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=2), encoding="utf-8"
        )


if __name__ == "__main__":
    main()
