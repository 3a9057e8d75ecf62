"""Where and how the research tools write derived files: the one rule of ``report``, ``compare
--json``, ``labels``, ``export sft|judge-input|table`` and the judge's output directory.

- **Never into a run.** An output at or under a local run location (a run directory, a sharded
  run held in a local directory) is refused before anything is read or written
  (:class:`OutputLocationError`, exit 2). So is an output that is a directory.
- **Missing folders are created.** The parent folders of an output are made as it is written,
  by every command alike.
- **Whole or not at all.** An output is written to a temporary file in its own folder, flushed
  and fsynced, renamed over the target, and the folder fsynced (:func:`replacing`). A failure
  removes the temporary file and leaves an earlier file at the target as it was. A target that
  cannot be created (permission, a file where a folder should be) is
  :class:`OutputWriteError` (exit 2); a write that fails partway (disk full, quota, file size
  limit, I/O error) is :class:`OutputStorageError` (exit 3: safe to retry once there is room).

What a run must hold to be read at all is the reader's rule (:mod:`shopsimrl.storage.reading`).
"""

from __future__ import annotations

import contextlib
import errno
import io
import os
import secrets
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import IO, TYPE_CHECKING

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer

from shopsimrl.storage.reading import Run

__all__ = [
    "OutputError",
    "OutputLocationError",
    "OutputStorageError",
    "OutputWriteError",
    "check_output_location",
    "replacing",
    "write_output",
]


class OutputError(ValueError):
    """An output refused or that cannot be created (exit 2)."""


class OutputLocationError(OutputError):
    """An output path inside a run being read, or a directory (exit 2)."""


class OutputWriteError(OutputError):
    """An output that cannot be created (a missing permission, a file where a folder should be),
    naming it (exit 2)."""


class OutputStorageError(OSError):
    """Writing an output failed partway (a full disk, a quota, a file size limit); the earlier
    file at the target is untouched (exit 3)."""

    def __str__(self) -> str:
        return str(self.strerror)


def _run_location(run: Run | str) -> str:
    return run.location if isinstance(run, Run) else str(run)


def check_output_location(runs: Run | str | Iterable[Run | str], output: Path) -> None:
    """Refuse ``output`` when it is a directory, or lies at or under a local run location
    (a run directory; a traces file's directory); runs at URIs hold no local path to protect."""
    if isinstance(runs, (Run, str)):
        runs = [runs]
    output = Path(output)
    if output.is_dir():
        raise OutputLocationError(f"{output} is a directory; give the file to write")
    target = output.resolve()
    for run in runs:
        location = _run_location(run)
        if "://" in location:
            continue
        run_dir = Path(location).resolve()
        if run_dir.is_file():
            run_dir = run_dir.parent
        if target == run_dir or run_dir in target.parents:
            raise OutputLocationError(
                f"{output} is inside the run {location}; derived files are written elsewhere, never into a run"
            )


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc)


# Errors of the storage rather than of the path: the same command succeeds once there is room.
_STORAGE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.EIO})


def _fsync_dir(folder: Path) -> None:
    """Make the rename durable; a filesystem that cannot fsync a directory is left as it is."""
    try:
        fd = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(fd)
    finally:
        os.close(fd)


def _write_failure(path: Path, exc: OSError) -> OutputStorageError | OutputWriteError:
    """A write that failed partway: the storage's fault (retry) or the path's (bad input)."""
    if exc.errno not in _STORAGE_ERRNOS:
        return OutputWriteError(f"{path}: cannot write ({_reason(exc)})")
    kept = "the earlier file is unchanged" if path.is_file() else "nothing was written"
    return OutputStorageError(exc.errno, f"{path}: writing failed ({_reason(exc)}); {kept}")


class _OutputFile(io.FileIO):
    """The temporary file: a failed write is an :class:`OutputStorageError` naming the target,
    told apart from an error of whatever the block reads while it writes."""

    def __init__(self, fd: int, target: Path) -> None:
        super().__init__(fd, "wb", closefd=True)
        self._target = target
        self._dropped = False

    def drop(self) -> None:
        """The output is abandoned: what is still buffered is discarded, not written."""
        self._dropped = True

    def write(self, data: ReadableBuffer, /) -> int:
        if self._dropped:
            return len(memoryview(data))
        try:
            return super().write(data)
        except OSError as exc:
            raise _write_failure(self._target, exc) from None


@contextmanager
def replacing(path: Path) -> Iterator[IO[bytes]]:
    """A temporary file next to ``path`` that becomes ``path`` when the block succeeds (and is
    removed when it fails), so a reader never sees half a file and a failed write never costs
    the earlier file. Raises :class:`OutputWriteError` when the file cannot be created and
    :class:`OutputStorageError` when writing it fails partway."""
    path = Path(path)
    temporary = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except (FileExistsError, NotADirectoryError):
        raise OutputWriteError(f"{path}: cannot write (a file is in the way of its folder {path.parent})") from None
    except OSError as exc:
        if exc.errno in _STORAGE_ERRNOS:
            raise OutputStorageError(exc.errno, f"{path}: cannot write ({_reason(exc)}); nothing was changed") from None
        raise OutputWriteError(f"{path}: cannot create its folder {path.parent} ({_reason(exc)})") from None
    try:
        # os.open with 0o666 leaves the mode to the umask, as for any file a user creates.
        fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)
    except OSError as exc:
        if exc.errno in _STORAGE_ERRNOS:
            raise OutputStorageError(exc.errno, f"{path}: cannot write ({_reason(exc)}); nothing was changed") from None
        raise OutputWriteError(f"{path}: cannot write ({_reason(exc)})") from None
    raw = _OutputFile(fd, path)
    handle = io.BufferedWriter(raw)
    try:
        yield handle
        try:
            handle.flush()
            os.fsync(handle.fileno())
            handle.close()
            os.replace(temporary, path)
        except OutputStorageError:
            raise
        except OSError as exc:
            raise _write_failure(path, exc) from None
    except BaseException:
        raw.drop()
        with contextlib.suppress(OSError, ValueError):
            handle.close()
        temporary.unlink(missing_ok=True)
        raise
    _fsync_dir(path.parent)


def write_output(path: Path, data: bytes) -> None:
    """``data`` as the whole of ``path`` (:func:`replacing`)."""
    with replacing(path) as out:
        out.write(data)
