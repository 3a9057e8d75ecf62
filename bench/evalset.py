"""An eval set's members run one after another (three `shopsimrl run`) against all at once
sharing the slots (one `shopsimrl evalset`).

It starts `shopsimrl testbed up` as a separate process whose policy server answers each chat
completion after --latency-ms, then runs the real CLI: --members runs of --episodes episodes
each with --slots episodes in flight, one after another; then the same members as one eval set
with `concurrency: --slots`:

    .venv/bin/python bench/evalset.py                 # 3 members x 32 episodes, 16 slots, 2,000 ms
    .venv/bin/python bench/evalset.py --latency-ms 200

Per way (and per run of the first) it prints the window (earliest episode start to latest end, over all members), the busy
slot-seconds (the sum of the episodes' durations from the traces) and the window efficiency,
busy / (slots x window): 1.0 is every slot busy for the whole window. Then the ratio of the two
windows. Timings depend on the machine; nothing here is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from model_overload import ROOT, SPLITS, free_port, wait_ready


def write_config(directory: Path, episodes: int, slots: int) -> Path:
    path = directory / "base.yaml"
    path.write_text(
        f"experiment: {{name: base, output_dir: {directory / 'runs'}, seed: 20260830, concurrency: {slots}}}\n"
        f"tasks: {{split_file: {SPLITS}, split: train, sample_size: {episodes}}}\n"
        "environment: {base_url: http://127.0.0.1:1, timeout: 120}\n"
        "runtime: {max_steps: 30, max_episode_retries: 0}\n"
        "model: {name: shopsim-heuristic, base_url: http://127.0.0.1:1/v1, api_key_env: null, timeout: 60}\n",
        encoding="utf-8",
    )
    return path


def spans(run_dirs: list[Path]) -> list[tuple[datetime, datetime]]:
    found = []
    for run_dir in run_dirs:
        for line in (run_dir / "traces.jsonl").read_text(encoding="utf-8").splitlines():
            record = json.loads(line)
            found.append((datetime.fromisoformat(record["started_at"]), datetime.fromisoformat(record["ended_at"])))
    return found


def measure(name: str, run_dirs: list[Path], slots: int, process_s: float | None) -> dict[str, object]:
    episodes = spans(run_dirs)
    window = (max(end for _, end in episodes) - min(start for start, _ in episodes)).total_seconds()
    busy = sum((end - start).total_seconds() for start, end in episodes)
    completed = 0
    for run_dir in run_dirs:
        completed += json.loads((run_dir / "summary.json").read_text(encoding="utf-8"))["counts"]["completed"]
    return {
        "way": name,
        "episodes": len(episodes),
        "completed": completed,
        "window_s": window,
        "busy_slot_s": busy,
        "efficiency": busy / (slots * window),
        "process_s": process_s,
    }


def shopsimrl(env: dict[str, str], *args: str) -> float:
    started = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "shopsimrl", *args, "--no-progress"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=env,
        timeout=3600,
    )
    if proc.returncode != 0:
        raise SystemExit(f"shopsimrl {' '.join(args)} exited {proc.returncode}:\n{proc.stderr[-2000:]}")
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--members", type=int, default=3)
    parser.add_argument("--episodes", type=int, default=32, help="episodes per member")
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--latency-ms", type=float, default=2000.0)
    parser.add_argument("--json", type=Path, help="also write the figures here")
    args = parser.parse_args()
    if min(args.members, args.episodes, args.slots) < 1 or args.latency_ms < 0:
        parser.error("--members, --episodes, --slots must be >= 1 and --latency-ms >= 0")

    shop_port, policy_port = free_port(), free_port()
    knobs = {"SHOPSIM_POLICY_LATENCY_MS": str(args.latency_ms), "SHOPSIM_ENV_SLOTS": str(args.slots + 16)}
    server = subprocess.Popen(
        [sys.executable, "-m", "shopsimrl", "testbed", "up", "--shop-port", str(shop_port), "--policy-port", str(policy_port)],
        cwd=ROOT,
        env={**os.environ, **knobs},
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    shop, model = f"http://127.0.0.1:{shop_port}", f"http://127.0.0.1:{policy_port}/v1"
    names = [f"member-{index}" for index in range(1, args.members + 1)]
    try:
        wait_ready(shop, model)
        env = {**os.environ, "SHOPSIMRL_MODEL_BASE_URL": model, "SHOPSIMRL_ENV_BASE_URL": shop}
        with tempfile.TemporaryDirectory() as scratch:
            base = write_config(Path(scratch), args.episodes, args.slots)
            apart = Path(scratch) / "apart"
            process_s = sum(shopsimrl(env, "run", str(base), "--checkpoint", name, "--run", str(apart / name)) for name in names)
            rows = [measure(f"run {name}", [apart / name], args.slots, None) for name in names]
            rows.append(measure("runs in a row", [apart / name for name in names], args.slots, process_s))
            set_path = Path(scratch) / "set.yaml"
            set_path.write_text(
                f"location: together\nconfig: base.yaml\nconcurrency: {args.slots}\nmembers:\n"
                + "".join(f"  - {{name: {name}, checkpoint: {name}}}\n" for name in names),
                encoding="utf-8",
            )
            process_s = shopsimrl(env, "evalset", str(set_path), "--no-report")
            rows.append(measure("one evalset", [Path(scratch) / "together" / name for name in names], args.slots, process_s))
    finally:
        server.terminate()
        server.wait(timeout=30)

    print(
        f"{args.members} members x {args.episodes} episodes, {args.slots} slots, policy latency {args.latency_ms:g} ms, "
        f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.2f}"
    )
    print(f"{'way':<17}{'completed':>10}{'window s':>10}{'busy slot-s':>13}{'eff':>6}{'process s':>11}")
    for row in rows:
        print(
            f"{row['way']:<17}{row['completed']:>10}{row['window_s']:>10.1f}{row['busy_slot_s']:>13.1f}"
            f"{row['efficiency']:>6.2f}{'' if row['process_s'] is None else format(row['process_s'], '.1f'):>11}"
        )
    apart_row, together_row = rows[-2:]
    print(
        f"evalset window / runs-in-a-row window: {float(together_row['window_s']) / float(apart_row['window_s']):.2f}; "  # type: ignore[arg-type]
        f"efficiency {float(apart_row['efficiency']):.2f} -> {float(together_row['efficiency']):.2f}"  # type: ignore[arg-type]
    )
    if args.json:
        args.json.write_text(
            json.dumps({"args": vars(args) | {"json": str(args.json)}, "rows": rows}, indent=2), encoding="utf-8"
        )


if __name__ == "__main__":
    main()
