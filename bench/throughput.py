"""Throughput of the real path: `shopsimrl run` against the testbed shop and policy processes.

For each policy latency it starts `shopsimrl testbed shop` and `shopsimrl testbed policy` as
separate processes (SHOPSIM_ENV_SLOTS = the largest C + 16, so no reset ever queues), then for
each concurrency C runs the real CLI, `python -m shopsimrl run CONFIG --no-progress
--concurrency C`, as a subprocess over loopback HTTP, and reports one row per (latency, C):

    .venv/bin/python bench/throughput.py                       # C = 1,16,64,256,1024 × policy 0, 200 ms
    .venv/bin/python bench/throughput.py --concurrency 1,16 --policy-latency-ms 0 --episodes 30
    .venv/bin/python bench/throughput.py --json results.json   # also write every figure as JSON

Episodes are the first N tasks of a seeded sample of the `train` split (3,726 tasks, all served by
the testbed catalog); N = --episodes, default max(50, 4·C) capped at 3,726. Definitions:

- window: from the earliest episode `started_at` to the latest `ended_at` in the run's traces
  (the span `summary.json` uses); it leaves out the runner's start-up (imports, plan) and its
  summary at the end.
- S, steps per episode: `behavior.steps_mean` of the run's summary (model calls per episode; each
  is followed by one `interact`, and every episode also does one reset and one release).
- episodes/s = completed episodes / window; steps/s = `behavior.model_steps` / window.
- latency bound: min(C, N) / (S × (policy latency + shop latency)) episodes/s, with the injected
  latencies (--policy-latency-ms, --shop-latency-ms): what C episodes in flight would reach if
  each step cost exactly its injected waits and nothing else. Efficiency = episodes/s / bound.
  With both latencies 0 the bound is unbounded and no efficiency is printed.
- runner CPU ms/step: the runner's user + sys CPU over the window (sampled from
  /proc/PID/stat every 0.1 s and interpolated to the window's ends) / model steps. The
  "process" figure divides the runner's whole CPU, from os.wait4 on that child, by the same
  steps; the difference is the fixed cost of start-up and summary.
- peak RSS: ru_maxrss of the runner from os.wait4. Linux carries the spawning process's RSS
  into it as a floor; this harness imports only the standard library, and its own peak is in the
  JSON (`harness_max_rss_mb`) to show that floor.
- where efficiency goes: efficiency = busy × step eff, exactly. busy = mean episodes in flight
  over the window / min(C, N) (slots filling at the start, the drain of a finite list at the
  end); step eff = S × injected latency / mean episode duration (what each step cost beyond its
  injected wait: queueing in the servers, their CPU, the runner's). steady eff = step eff × the
  busy share from the window's start to the last episode's start, i.e. without the drain: what an
  endless job list would reach.
- server CPU: each server's user + sys CPU seconds (/proc/PID/stat before and after the run), per
  model step (ms/step), and the share of one core that runner, shop and policy each used over the
  window: with 2 cores, a process near 100 % is the bottleneck.

Timings depend on the machine and its load: the header prints the CPU, core count and load
average before and after. Nothing here is asserted; it only prints.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import platform
import resource
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from dataclasses import asdict, dataclass, field
from datetime import datetime
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SPLIT_FILE = ROOT / "configs" / "splits" / "persona_splits.v1.json"
SPLIT, SPLIT_SIZE = "train", 3726
DEFAULT_CONCURRENCY = (1, 16, 64, 256, 1024)
DEFAULT_POLICY_LATENCIES_MS = (0.0, 200.0)
SAMPLE_INTERVAL_S = 0.1
CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------- arguments


def _int_list(text: str) -> list[int]:
    try:
        values = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None
    if not values or any(value < 1 for value in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1, got {text!r}")
    return values


def _latency_list(text: str) -> list[float]:
    try:
        values = [float(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated milliseconds, got {text!r}") from None
    if not values or any(not 0 <= value < float("inf") for value in values):
        raise argparse.ArgumentTypeError(f"expected finite milliseconds >= 0, got {text!r}")
    return values


def _milliseconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected milliseconds, got {text!r}") from None
    if not 0 <= value < float("inf"):
        raise argparse.ArgumentTypeError(f"expected finite milliseconds >= 0, got {text!r}")
    return value


def _episodes(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if not 1 <= value <= SPLIT_SIZE:
        raise argparse.ArgumentTypeError(f"must be between 1 and {SPLIT_SIZE} (the {SPLIT} split), got {value}")
    return value


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--concurrency",
        type=_int_list,
        default=list(DEFAULT_CONCURRENCY),
        help="comma-separated episode concurrencies C (default: 1,16,64,256,1024)",
    )
    parser.add_argument(
        "--policy-latency-ms",
        type=_latency_list,
        default=list(DEFAULT_POLICY_LATENCIES_MS),
        help="comma-separated policy latencies, one server start each (default: 0,200)",
    )
    parser.add_argument(
        "--shop-latency-ms", type=_milliseconds, default=0.0, help="latency the shop adds to every call (default: 0)"
    )
    parser.add_argument(
        "--episodes", type=_episodes, default=None, help=f"episodes per row (default: max(50, 4*C), at most {SPLIT_SIZE})"
    )
    parser.add_argument("--json", metavar="FILE", type=Path, default=None, help="also write the results as JSON")
    parser.add_argument("--keep", action="store_true", help="keep the run directories and logs (path printed)")  # fmt: skip
    args = parser.parse_args(argv)
    if args.json is not None and not args.json.parent.is_dir():
        parser.error(f"argument --json: directory {args.json.parent} does not exist")
    return args


# ----------------------------------------------------------------------------- processes


def cpu_seconds(pid: int) -> float | None:
    """utime + stime of a live process; None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # the command name may contain spaces
    return (int(fields[11]) + int(fields[12])) / CLOCK_TICKS


def free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def wait_http_ok(url: str, process: subprocess.Popen[bytes], timeout_s: float = 120.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as reply:
                if reply.status == 200:
                    return
        except OSError:
            pass
        if process.poll() is not None:
            raise RuntimeError(f"{process.args!r} exited with {process.returncode} before {url} answered")
        if time.monotonic() > deadline:
            raise RuntimeError(f"{url} did not answer within {timeout_s:.0f} s")
        time.sleep(0.2)


@dataclass
class Servers:
    shop_url: str
    policy_url: str
    shop: subprocess.Popen[bytes]
    policy: subprocess.Popen[bytes]

    def stop(self) -> None:
        for process in (self.shop, self.policy):
            process.terminate()
        for process in (self.shop, self.policy):
            try:
                process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()


def start_servers(slots: int, policy_latency_ms: float, shop_latency_ms: float, logs: Path) -> Servers:
    shop_port, policy_port = free_port(), free_port()
    env = {key: value for key, value in os.environ.items() if not key.startswith("SHOPSIM_")}
    shop_env = {**env, "SHOPSIM_ENV_SLOTS": str(slots), "SHOPSIM_LATENCY_MS": str(shop_latency_ms)}
    policy_env = {**env, "SHOPSIM_POLICY_LATENCY_MS": str(policy_latency_ms)}
    tag = f"policy{policy_latency_ms:g}ms"
    with open(logs / f"shop-{tag}.log", "wb") as shop_log, open(logs / f"policy-{tag}.log", "wb") as policy_log:
        shop = subprocess.Popen(
            [sys.executable, "-m", "shopsimrl", "testbed", "shop", "--port", str(shop_port)],
            cwd=ROOT, env=shop_env, stdout=shop_log, stderr=subprocess.STDOUT,
        )  # fmt: skip
        policy = subprocess.Popen(
            [sys.executable, "-m", "shopsimrl", "testbed", "policy", "--port", str(policy_port)],
            cwd=ROOT, env=policy_env, stdout=policy_log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    servers = Servers(f"http://127.0.0.1:{shop_port}", f"http://127.0.0.1:{policy_port}/v1", shop, policy)
    try:
        wait_http_ok(f"{servers.shop_url}/healthz", shop)
        wait_http_ok(f"{servers.policy_url}/models", policy)
    except BaseException:
        servers.stop()
        raise
    return servers


# ----------------------------------------------------------------------------- one row


@dataclass
class Row:
    concurrency: int
    policy_latency_ms: float
    shop_latency_ms: float
    episodes_requested: int
    exit_code: int | None = None
    error: str | None = None
    completed: int = 0
    failed: int = 0
    steps: int = 0
    steps_per_episode: float | None = None
    wall_s: float | None = None
    window_s: float | None = None
    episodes_per_s: float | None = None
    steps_per_s: float | None = None
    latency_bound_episodes_per_s: float | None = None
    efficiency: float | None = None
    busy_share: float | None = None
    steady_busy_share: float | None = None
    step_efficiency: float | None = None
    steady_efficiency: float | None = None
    runner_cpu_window_s: float | None = None
    runner_cpu_process_s: float | None = None
    runner_cpu_ms_per_step: float | None = None
    runner_cpu_ms_per_step_process: float | None = None
    runner_core_share: float | None = None
    runner_max_rss_mb: float | None = None
    shop_cpu_s: float | None = None
    policy_cpu_s: float | None = None
    shop_core_share: float | None = None
    policy_core_share: float | None = None
    shop_cpu_ms_per_step: float | None = None
    policy_cpu_ms_per_step: float | None = None
    reward_mean: float | None = None


@dataclass
class Samples:
    """(wall time, CPU seconds) of runner, shop and policy, every SAMPLE_INTERVAL_S."""

    points: dict[str, list[tuple[float, float]]] = field(default_factory=lambda: {"runner": [], "shop": [], "policy": []})

    def take(self, pids: dict[str, int]) -> None:
        now = time.time()
        for name, pid in pids.items():
            cpu = cpu_seconds(pid)
            if cpu is not None:
                self.points[name].append((now, cpu))

    def cpu_between(self, name: str, start: float, end: float) -> float | None:
        points = self.points[name]
        if len(points) < 2 or start < points[0][0] or end > points[-1][0]:
            return None
        return _interpolate(points, end) - _interpolate(points, start)


def _interpolate(points: list[tuple[float, float]], at: float) -> float:
    for (t0, c0), (t1, c1) in itertools.pairwise(points):
        if t0 <= at <= t1:
            return c0 if t1 == t0 else c0 + (c1 - c0) * (at - t0) / (t1 - t0)
    return points[-1][1]


def write_config(directory: Path, name: str, servers: Servers, episodes: int, concurrency: int) -> Path:
    path = directory / f"{name}.yaml"
    # Generous model timeout: the benchmark measures throughput, a timeout would measure retries.
    path.write_text(
        f"""
experiment: {{name: {name}, output_dir: {directory / "runs"}, seed: 20260830, concurrency: {concurrency}}}
tasks: {{split_file: {SPLIT_FILE}, split: {SPLIT}, sample_size: {episodes}}}
environment: {{base_url: {servers.shop_url}}}
runtime: {{max_steps: 30}}
model:
  name: shopsim-heuristic
  base_url: {servers.policy_url}
  api_key_env: null
  timeout: 600
""",
        encoding="utf-8",
    )
    return path


def _timestamp(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def episode_intervals(traces: Path) -> list[tuple[float, float]]:
    """(start, end) of every episode with both timestamps, in trace order."""
    intervals = []
    with traces.open(encoding="utf-8") as lines:
        for line in lines:
            record = json.loads(line)
            if record.get("started_at") and record.get("ended_at"):
                intervals.append((_timestamp(record["started_at"]), _timestamp(record["ended_at"])))
    return intervals


def trace_window(traces: Path) -> tuple[float, float] | None:
    intervals = episode_intervals(traces)
    if not intervals:
        return None
    return min(s for s, _ in intervals), max(e for _, e in intervals)


def busy_share(intervals: list[tuple[float, float]], slots: int, start: float, end: float) -> float | None:
    """Mean number of episodes in flight over [start, end] / slots: the share of the run's slots
    that held an episode. Below 1 at the start (slots filling) and at the end (the drain)."""
    if end <= start or slots <= 0:
        return None
    held = sum(max(0.0, min(e, end) - max(s, start)) for s, e in intervals)
    return held / (slots * (end - start))


def run_row(row: Row, servers: Servers, work: Path) -> Row:
    name = f"c{row.concurrency}-p{row.policy_latency_ms:g}"
    config = write_config(work, name, servers, row.episodes_requested, row.concurrency)
    env = {key: value for key, value in os.environ.items() if not key.startswith("SHOPSIMRL_")}
    env.update(SHOPSIMRL_MODEL_BASE_URL=servers.policy_url, SHOPSIMRL_ENV_BASE_URL=servers.shop_url)
    before = {"shop": cpu_seconds(servers.shop.pid), "policy": cpu_seconds(servers.policy.pid)}
    log = work / f"{name}.log"
    started = time.time()
    with log.open("wb") as output:
        runner = subprocess.Popen(
            [sys.executable, "-m", "shopsimrl", "run", str(config), "--no-progress", "--concurrency", str(row.concurrency)],
            cwd=ROOT, env=env, stdout=output, stderr=subprocess.STDOUT,
        )  # fmt: skip
        pids = {"runner": runner.pid, "shop": servers.shop.pid, "policy": servers.policy.pid}
        samples = Samples()
        while True:
            samples.take(pids)
            # wait4 on this one child: its own rusage, not the sum over every child of the harness
            pid, status, usage = os.wait4(runner.pid, os.WNOHANG)
            if pid:
                break
            time.sleep(SAMPLE_INTERVAL_S)
    exited = time.time()
    samples.take({"shop": servers.shop.pid, "policy": servers.policy.pid})
    row.wall_s = exited - started
    runner.returncode = row.exit_code = os.waitstatus_to_exitcode(status)
    row.runner_cpu_process_s = usage.ru_utime + usage.ru_stime
    # its CPU at exit closes the runner's samples, so the window's end is always covered
    samples.points["runner"].append((exited, row.runner_cpu_process_s))
    row.runner_max_rss_mb = usage.ru_maxrss / 1024
    after = {"shop": cpu_seconds(servers.shop.pid), "policy": cpu_seconds(servers.policy.pid)}
    if before["shop"] is not None and after["shop"] is not None:
        row.shop_cpu_s = after["shop"] - before["shop"]
    if before["policy"] is not None and after["policy"] is not None:
        row.policy_cpu_s = after["policy"] - before["policy"]

    run_dir = work / "runs" / name
    summary_path = run_dir / "summary.json"
    if row.exit_code not in (0, 1) or not summary_path.is_file():
        tail = log.read_text(encoding="utf-8", errors="replace").strip().splitlines()[-5:]
        row.error = f"runner exited {row.exit_code}: " + " | ".join(tail)
        return row
    summary = json.loads(summary_path.read_text(encoding="utf-8"))
    row.completed, row.failed = summary["counts"]["completed"], summary["counts"]["failed"]
    row.steps = summary["behavior"]["model_steps"]
    row.steps_per_episode = summary["behavior"]["steps_mean"]
    row.reward_mean = summary["primary"]["reward_mean"]
    window = trace_window(run_dir / "traces.jsonl")
    if window is None or window[1] <= window[0] or not row.steps:
        row.error = "no completed episode with timestamps in the traces"
        return row
    start, end = window
    intervals = episode_intervals(run_dir / "traces.jsonl")
    slots = min(row.concurrency, row.episodes_requested)
    row.busy_share = busy_share(intervals, slots, start, end)
    # Before the last episode started every finished episode was replaced at once; after it
    # the list is empty and slots only empty (the drain of a finite job list).
    row.steady_busy_share = busy_share(intervals, slots, start, max(s for s, _ in intervals))
    row.window_s = end - start
    row.episodes_per_s = row.completed / row.window_s
    row.steps_per_s = row.steps / row.window_s
    row.runner_cpu_ms_per_step_process = row.runner_cpu_process_s / row.steps * 1000
    row.runner_cpu_window_s = samples.cpu_between("runner", start, end)
    if row.runner_cpu_window_s is not None:
        row.runner_cpu_ms_per_step = row.runner_cpu_window_s / row.steps * 1000
        row.runner_core_share = row.runner_cpu_window_s / row.window_s
    for server in ("shop", "policy"):
        cpu = samples.cpu_between(server, start, end)
        if cpu is not None:
            setattr(row, f"{server}_core_share", cpu / row.window_s)
    if row.shop_cpu_s is not None:
        row.shop_cpu_ms_per_step = row.shop_cpu_s / row.steps * 1000
    if row.policy_cpu_s is not None:
        row.policy_cpu_ms_per_step = row.policy_cpu_s / row.steps * 1000
    step_latency_s = (row.policy_latency_ms + row.shop_latency_ms) / 1000
    if step_latency_s > 0 and row.steps_per_episode:
        in_flight = min(row.concurrency, row.episodes_requested)
        row.latency_bound_episodes_per_s = in_flight / (row.steps_per_episode * step_latency_s)
        row.efficiency = row.episodes_per_s / row.latency_bound_episodes_per_s
        # efficiency = busy share × step efficiency, exactly: the second says how long a step
        # took against its injected latency, the first how many slots were busy meanwhile.
        episode_seconds = sum(e - s for s, e in intervals)
        if episode_seconds > 0:
            row.step_efficiency = row.steps * step_latency_s / episode_seconds
            if row.steady_busy_share is not None:
                row.steady_efficiency = row.step_efficiency * row.steady_busy_share
    return row


# ----------------------------------------------------------------------------- report


COLUMNS = [
    # header, width, value of a row
    ("C", 5, lambda r: f"{r.concurrency}"),
    ("policy ms", 9, lambda r: f"{r.policy_latency_ms:g}"),
    ("done/fail", 10, lambda r: f"{r.completed}/{r.failed}"),
    ("steps/ep", 8, lambda r: _fmt(r.steps_per_episode, ".2f")),
    ("eps/s", 8, lambda r: _fmt(r.episodes_per_s, ".2f")),
    ("steps/s", 8, lambda r: _fmt(r.steps_per_s, ".1f")),
    ("bound eps/s", 11, lambda r: _fmt(r.latency_bound_episodes_per_s, ".1f")),
    ("eff", 5, lambda r: _fmt(r.efficiency, ".2f")),
    ("busy", 5, lambda r: _fmt(r.busy_share, ".2f")),
    ("step eff", 8, lambda r: _fmt(r.step_efficiency, ".2f")),
    ("steady eff", 10, lambda r: _fmt(r.steady_efficiency, ".2f")),
    ("CPU ms/step", 11, lambda r: _fmt(r.runner_cpu_ms_per_step, ".2f")),
    ("(process)", 9, lambda r: _fmt(r.runner_cpu_ms_per_step_process, ".2f")),
    ("runner %", 8, lambda r: _fmt(r.runner_core_share and r.runner_core_share * 100, ".0f")),
    ("shop %", 6, lambda r: _fmt(r.shop_core_share and r.shop_core_share * 100, ".0f")),
    ("policy %", 8, lambda r: _fmt(r.policy_core_share and r.policy_core_share * 100, ".0f")),
    ("shop ms/step", 12, lambda r: _fmt(r.shop_cpu_ms_per_step, ".2f")),
    ("policy ms/step", 14, lambda r: _fmt(r.policy_cpu_ms_per_step, ".2f")),
    ("peak RSS MB", 11, lambda r: _fmt(r.runner_max_rss_mb, ".0f")),
    ("wall s", 7, lambda r: _fmt(r.wall_s, ".1f")),
]


def _fmt(value: float | None, spec: str) -> str:
    return "–" if value is None else format(value, spec)


def print_row(row: Row) -> None:
    print("  ".join(f"{render(row):>{width}}" for _, width, render in COLUMNS), flush=True)
    if row.error:
        print(f"      error: {row.error}", flush=True)


def machine() -> dict[str, object]:
    model = next(
        (
            line.split(":", 1)[1].strip()
            for line in Path("/proc/cpuinfo").read_text().splitlines()
            if line.startswith("model name")
        ),
        platform.processor() or "unknown",
    )
    return {"cpu": model, "cores": os.cpu_count(), "python": platform.python_version(), "load_before": os.getloadavg()}


def raise_open_file_limit() -> None:
    # C episodes hold ~2C sockets in the runner and C in each server.
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    raise_open_file_limit()
    info = machine()
    work = Path(tempfile.mkdtemp(prefix="shopsimrl-throughput-"))
    print(f"machine: {info['cpu']}, {info['cores']} cores, Python {info['python']}; "
          f"load average before: {' '.join(f'{x:.2f}' for x in info['load_before'])}")  # fmt: skip
    print(f"runner: python -m shopsimrl run --no-progress; {SPLIT} split; shop latency {args.shop_latency_ms:g} ms; "
          f"CPU ms/step over the episode window, (process) over the runner's whole life; % = share of one core")  # fmt: skip
    print("  ".join(f"{header:>{width}}" for header, width, _ in COLUMNS), flush=True)
    rows: list[Row] = []
    slots = max(args.concurrency) + 16
    try:
        for policy_latency_ms in args.policy_latency_ms:
            servers = start_servers(slots, policy_latency_ms, args.shop_latency_ms, work)
            try:
                for concurrency in args.concurrency:
                    episodes = args.episodes or min(SPLIT_SIZE, max(50, 4 * concurrency))
                    row = run_row(Row(concurrency, policy_latency_ms, args.shop_latency_ms, episodes), servers, work)
                    rows.append(row)
                    print_row(row)
            finally:
                servers.stop()
    finally:
        info["load_after"] = os.getloadavg()
        info["harness_max_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print(f"load average after: {' '.join(f'{x:.2f}' for x in info['load_after'])}")
        if args.json is not None:
            args.json.write_text(json.dumps({"machine": info, "rows": [asdict(r) for r in rows]}, indent=2) + "\n")
            print(f"results: {args.json}")
        if args.keep:
            print(f"runs and logs kept in {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)
    return 0 if rows and all(row.error is None for row in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
