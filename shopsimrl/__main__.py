import signal

from shopsimrl.exitcodes import ExitCode


def _stop_early(signum: int, frame: object) -> None:
    # Until a command installs its own handling, a signal ends the process at once with the
    # retryable code: nothing is held yet. Installed before the CLI's imports (a second or so),
    # where Ctrl-C would otherwise end in a KeyboardInterrupt traceback.
    raise SystemExit(int(ExitCode.RETRYABLE))


for _signum in (signal.SIGTERM, signal.SIGINT):
    signal.signal(_signum, _stop_early)
# A shard worker starts with both blocked (sharded.local_job): one that came while this
# interpreter started is delivered now, to the handler above.
signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM, signal.SIGINT})

from shopsimrl.cli import main  # noqa: E402 - after the handlers, on purpose

main()
