"""A training rollout process for the kill -9 test (``python -m tests.training.rollout_process``).

It plays ``task:index`` rollouts at once through a :class:`TrainingWorker`, as slime's rollout
process would, and writes one JSON line to stdout per event: ``returned`` (a rollout's call came
back: its samples would now be with the trainer) and, once ``--freeze-at`` rollouts wait in the
store's buffer after at least one commit and with a lease journaled as held, ``frozen`` with
what is buffered. Then it stops its event loop (a blocking sleep), so nothing more is written
or released before the test kills it.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
from typing import Any

from shopsimrl.logs import configure_logging
from shopsimrl.training.config import load_training_config
from shopsimrl.training.store import ObjectTrainingRunStore
from shopsimrl.training.worker import Sampling, TrainingWorker


def _say(**fields: Any) -> None:
    print(json.dumps(fields), flush=True)


async def _main(config: str, model_url: str, rollouts: list[tuple[int, int]], freeze_at: int) -> None:
    worker = TrainingWorker(
        load_training_config(config), base_url=model_url, sampling=Sampling(temperature=0.6, max_new_tokens=512)
    )
    await worker.start()
    store = worker.store
    assert isinstance(store, ObjectTrainingRunStore)

    async def play(task_id: int, index: int) -> None:
        rollout = await worker.rollout(task_id=task_id, index=index, group_index=0)
        _say(returned=[rollout.trace.episode_id, rollout.trace.attempt])

    async def freeze() -> None:
        while True:
            await asyncio.sleep(0.002)
            if store.commits >= 1 and len(store.buffered) >= freeze_at and worker.journal.state.held:
                await worker.journal.recorded()  # the held lease is in the stored journal
                if len(store.buffered) >= freeze_at and worker.journal.state.held:
                    _say(frozen=store.buffered, commits=store.commits, held=len(worker.journal.state.held))
                    time.sleep(600)  # noqa: ASYNC251  the loop stops here: nothing is written or released until the kill

    watcher = asyncio.ensure_future(freeze()) if freeze_at else None
    try:
        await asyncio.gather(*(play(task_id, index) for task_id, index in rollouts))
    finally:
        if watcher is not None:
            watcher.cancel()
        await worker.aclose()
    _say(finished=True)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("config")
    parser.add_argument("model_url")
    parser.add_argument("rollouts", nargs="+", help="task:index")
    parser.add_argument("--freeze-at", type=int, default=0)
    args = parser.parse_args()
    configure_logging()  # to stderr: stdout carries the events
    rollouts = [(int(task), int(index)) for task, index in (item.split(":") for item in args.rollouts)]
    asyncio.run(_main(args.config, args.model_url, rollouts, args.freeze_at))


if __name__ == "__main__":
    main()
