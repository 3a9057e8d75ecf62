"""Unit cost of the typed trace records: reading and writing one trace line, on one core.

NOT the real path (no run, no store, no HTTP): it measures what the typed models add to the JSON
codec per trace. The real path's figures are bench/throughput.py (runner CPU per step) and
bench/reduce_bench.py (reducer MB per CPU second).

    .venv/bin/python bench/records_codec.py RUN_DIR/traces.jsonl [--repeat 5]

Ideal = orjson on plain dicts (what the stores did before the records were typed); the ratio is
the typed path over it:

- read: ``orjson.loads`` → ``read_trace`` (validation into EpisodeTrace) vs ``orjson.loads`` alone;
- write: ``dump_line(EpisodeTrace)`` vs ``orjson.dumps(dict)``;
- build: what the runtime adds per episode to make the typed record (its steps, model turns and
  environment answers from their dicts), the cost it pays once per episode.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from shopsimrl.records import EpisodeTrace, dump_line, read_trace


def best(function: Callable[[Any], Any], items: Sequence[Any], repeat: int) -> float:
    """The fastest of ``repeat`` passes over ``items``, in µs per item."""
    fastest = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        for item in items:
            function(item)
        fastest = min(fastest, time.perf_counter() - start)
    return fastest / len(items) * 1e6


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("traces", type=Path, help="a traces.jsonl (a testbed run's: make demo writes runs/testbed-demo/)")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    lines = [line for line in args.traces.read_bytes().splitlines() if line.strip()]
    plain = [orjson.loads(line) for line in lines]
    typed = [read_trace(record) for record in plain]
    steps = sum(len(record.steps) for record in typed)
    size = sum(len(line) for line in lines) / len(lines)
    print(
        f"{len(lines)} traces, {steps / len(lines):.1f} steps and {size / 1024:.1f} KiB each; µs per trace, best of {args.repeat}"
    )

    def typed_read(line: bytes) -> EpisodeTrace:
        return read_trace(orjson.loads(line))

    def build(record: dict[str, Any]) -> EpisodeTrace:
        return EpisodeTrace.model_validate(record)

    rows = [
        ("read", best(typed_read, lines, args.repeat), best(orjson.loads, lines, args.repeat)),
        ("write", best(dump_line, typed, args.repeat), best(orjson.dumps, plain, args.repeat)),
    ]
    print(f"{'':8} {'typed':>10} {'ideal':>10} {'ratio':>7}")
    for name, cost, ideal in rows:
        print(f"{name:8} {cost:10.1f} {ideal:10.1f} {cost / ideal:7.2f}")
    print(f"{'build':8} {best(build, plain, args.repeat):10.1f}  (typed record from its dicts, once per episode)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
