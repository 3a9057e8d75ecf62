"""Where and how the research tools write derived files: never into a run, and whole or not at
all (a temporary file next to the target, renamed into place)."""

from __future__ import annotations

import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO

from shopsimrl.research.runs import Run

__all__ = ["OutputLocationError", "OutputWriteError", "check_output_location", "replacing"]


class OutputLocationError(ValueError):
    """An output path inside the run being read (exit 2)."""


class OutputWriteError(ValueError):
    """An output that cannot be written (a missing permission, a full disk), naming it (exit 2)."""


def check_output_location(run: Run, output: Path) -> None:
    """Refuse an output inside a local run directory: derived files never go into a run."""
    if "://" in run.location:
        return
    run_dir = Path(run.location).resolve()
    target = Path(output).resolve()
    if target == run_dir or run_dir in target.parents:
        raise OutputLocationError(
            f"{output} is inside the run {run.location}; derived files are written elsewhere, never into a run"
        )


@contextmanager
def replacing(path: Path) -> Iterator[IO[bytes]]:
    """A temporary file next to ``path`` that becomes ``path`` when the block succeeds (and is
    removed when it fails), so a reader never sees half a file."""
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        # os.open with 0o666 leaves the mode to the umask, as for any file a user creates.
        handle = os.fdopen(os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb")
    except OSError as exc:
        raise OutputWriteError(f"{path}: cannot write ({exc.strerror or exc})") from None
    try:
        with handle:
            yield handle
            try:
                handle.flush()
                os.fsync(handle.fileno())
            except OSError as exc:
                raise OutputWriteError(f"{path}: cannot write ({exc.strerror or exc})") from None
        try:
            os.replace(temporary, path)
        except OSError as exc:
            raise OutputWriteError(f"{path}: cannot write ({exc.strerror or exc})") from None
    except BaseException:
        temporary.unlink(missing_ok=True)
        raise
