"""Live progress of a run on the terminal: a rich bar with the running reward mean and failures."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

__all__ = ["RunProgress"]


class RunProgress:
    """Feed it every persisted trace; it shows completed/failed counts and the reward mean so far."""

    def __init__(self, total: int, *, description: str = "episodes", enabled: bool = True) -> None:
        self.total = total
        self.completed = 0
        self.failed = 0
        self.retries = 0
        self._reward_sum = 0.0
        self._scored = 0
        self._progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("reward {task.fields[reward]}  failed {task.fields[failed]}  retried {task.fields[retries]}"),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            disable=not enabled,
        )
        self._task = self._progress.add_task(description, total=total, reward="-", failed=0, retries=0)

    def __enter__(self) -> RunProgress:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def on_trace(self, record: dict[str, Any], will_retry: bool = False) -> None:
        if record.get("status") == "completed":
            self.completed += 1
            reward = (record.get("final") or {}).get("reward")
            if isinstance(reward, (int, float)) and not isinstance(reward, bool):
                self._reward_sum += float(reward)
                self._scored += 1
            advance = 1
        elif will_retry:
            self.retries += 1
            advance = 0
        else:
            self.failed += 1
            advance = 1
        mean = f"{self._reward_sum / self._scored:.3f}" if self._scored else "-"
        self._progress.update(self._task, advance=advance, reward=mean, failed=self.failed, retries=self.retries)
