"""What a terminal shows: run a command on a pseudo-terminal and replay its output on a tiny screen.

Only the control sequences rich's live display and structlog's colours use are interpreted:
carriage return, newline, ``ESC[nA`` (cursor up), ``ESC[2K`` (erase the line), ``ESC[?25l/h``
(cursor visibility) and SGR colours (ignored). The screen keeps every line ever written
(scrollback included), so a test sees each line the user saw, in order.
"""

from __future__ import annotations

import fcntl
import os
import pty
import re
import select
import struct
import subprocess
import termios
import time
from pathlib import Path

_CONTROL = re.compile(r"\x1b\[(\??)([0-9;]*)([A-Za-z])|\x1b\][^\x07]*\x07|\r|\n|[^\x1b\r\n]+")


def screen_lines(output: str) -> list[str]:
    """Replay ``output`` on a screen; returns its lines, trailing spaces stripped."""
    lines = [""]
    row = col = 0
    for match in _CONTROL.finditer(output):
        token = match.group(0)
        if token == "\n":
            row, col = row + 1, 0
            if row == len(lines):
                lines.append("")
        elif token == "\r":
            col = 0
        elif token.startswith("\x1b["):
            private, argument, command = match.group(1), match.group(2), match.group(3)
            if private:
                continue
            if command == "A":
                row = max(0, row - int(argument or 1))
            elif command == "K" and argument == "2":
                lines[row] = ""
            elif command == "K":  # erase to the end of the line
                lines[row] = lines[row][:col]
        elif token.startswith("\x1b]"):
            continue  # an operating system command (window title, hyperlink)
        else:
            line = lines[row].ljust(col)
            lines[row] = line[:col] + token + line[col + len(token) :]
            col += len(token)
    return [line.rstrip() for line in lines]


def run_on_terminal(
    command: list[str], *, env: dict[str, str], cwd: Path, timeout: float = 300, columns: int = 200
) -> tuple[int, str]:
    """Run ``command`` with stdin, stdout and stderr on one pseudo-terminal; returns (exit code, output)."""
    leader, follower = pty.openpty()
    fcntl.ioctl(follower, termios.TIOCSWINSZ, struct.pack("HHHH", 50, columns, 0, 0))
    env = {**env, "COLUMNS": str(columns), "LINES": "50", "TERM": "xterm-256color"}
    env.pop("NO_COLOR", None)
    process = subprocess.Popen(command, stdin=follower, stdout=follower, stderr=follower, env=env, cwd=cwd, close_fds=True)
    os.close(follower)
    chunks: list[bytes] = []
    deadline = time.monotonic() + timeout
    try:
        # Read until every holder of the terminal has closed it (EIO): the output's end. Whether
        # the process has exited says nothing of it: its last bytes may be written between an
        # empty select and the exit, and a reader that stops at the exit loses them.
        while True:
            ready, _, _ = select.select([leader], [], [], 0.2)
            if ready:
                try:
                    data = os.read(leader, 65536)
                except OSError:  # EIO: every process holding the terminal has closed it
                    break
                if not data:
                    break
                chunks.append(data)
            if time.monotonic() > deadline:
                process.kill()
                raise TimeoutError(f"{command} did not finish within {timeout:g} s (or a child kept its terminal open)")
        code = process.wait(timeout=30)
    finally:
        os.close(leader)
        if process.poll() is None:
            process.kill()
    return code, b"".join(chunks).decode("utf-8", errors="replace")
