"""Unit cost per step of the runtime and scheduler with in-process fakes, on one core.

NOT the real path: the model and environment are in-process fakes that answer instantly, so no
HTTP client, connection pool, socket or JSON over the wire is measured. What it measures is
shopsimrl's own work per model call: building tools from the page, the protocol checks,
conversation and trace bookkeeping, and (second row) persisting each trace with fsync. For
throughput and CPU per step of `shopsimrl run` against real servers, use bench/throughput.py.

    .venv/bin/python bench/runtime_overhead.py [--episodes 400] [--steps 20]

Ideal = the fakes alone (a loop calling them without the runtime); the ratio shows what the
runtime adds on top.
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shopsimrl.episode import AgentRuntime
from shopsimrl.prompts import PromptBuilder
from shopsimrl.runner.scheduler import Evaluator
from shopsimrl.schemas import EpisodeJob
from shopsimrl.skills import NoSkills
from shopsimrl.storage.local import LocalRunStore
from tests.fakes import FakeEnvironment, FakeModel, env_result, purchase_result, results_state, tool_output

ACTIONS = ["back to search", "next >"] + [f"{100000000000 + i}" for i in range(20)]


def scripted(steps: int) -> tuple[FakeModel, FakeEnvironment]:
    search = tool_output("search", {"query": "蓝牙 耳机 降噪"})
    click = tool_output("click", {"value": "next >"})
    buy = tool_output("click", {"value": "buy now"})
    page = env_result(results_state(ACTIONS), observation="页面：搜索结果\n" + "商品标题 ASIN 价格\n" * 20)

    def reply(messages: list, tools: list) -> object:
        turn = (len(messages) - 2) // 2
        return search if turn == 0 else (buy if turn == steps - 1 else click)

    env = FakeEnvironment(steps=[page] * (steps - 1) + [purchase_result()])
    env.steps = [page] * (steps - 1) + [purchase_result()]
    return FakeModel(reply), env


async def bench(episodes: int, steps: int, persist: bool) -> tuple[float, int]:
    model, env = scripted(steps)

    class ResettingEnv(FakeEnvironment):
        def open_episode(self):  # a fresh script per episode
            env.actions.clear()
            return env.open_episode()

    runtime = AgentRuntime(
        model=model, environment=ResettingEnv(), prompts=PromptBuilder(), skills=NoSkills(), max_steps=steps + 1
    )
    jobs = [EpisodeJob(task_id=i, sample_id=0, seed=i, split="bench") for i in range(episodes)]
    with tempfile.TemporaryDirectory() as tmp:

        class NullSink:
            def save_traces(self, records: list[dict]) -> None:
                pass

        sink = LocalRunStore(Path(tmp)) if persist else NullSink()
        evaluator = Evaluator(runtime, sink, concurrency=1)
        started = time.perf_counter()
        outcome = await evaluator.run(jobs)
        elapsed = time.perf_counter() - started
    assert outcome.completed == episodes, outcome
    return elapsed, episodes * steps


async def ideal(episodes: int, steps: int) -> float:
    model, env = scripted(steps)
    started = time.perf_counter()
    for _ in range(episodes):
        env.actions.clear()
        episode = env.open_episode()
        await episode.reset(1)
        messages: list = [{}, {}]
        for _ in range(steps):
            await model.generate(messages, [], seed=0)
            await episode.step("x")
            messages += [{}, {}]
        await episode.close()
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--episodes", type=int, default=400)
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})  # one core
    base = asyncio.run(ideal(args.episodes, args.steps))
    print("UNIT COST with in-process fakes (no HTTP, no sockets): not the real path; see bench/throughput.py")
    print(f"one core, {args.episodes} episodes x {args.steps} steps, zero-latency in-process model and environment")
    print(f"{'path':<34}{'steps/s':>10}{'us/step':>10}{'vs fakes alone':>16}")
    print(
        f"{'fakes alone (ideal)':<34}{args.episodes * args.steps / base:>10.0f}{base / (args.episodes * args.steps) * 1e6:>10.1f}{1.0:>16.2f}"
    )
    for label, persist in (("runtime + scheduler", False), ("runtime + scheduler + fsync'd trace", True)):
        elapsed, steps = asyncio.run(bench(args.episodes, args.steps, persist))
        print(f"{label:<34}{steps / elapsed:>10.0f}{elapsed / steps * 1e6:>10.1f}{elapsed / base:>16.2f}")


if __name__ == "__main__":
    main()
