"""Prompt tokens a token server must prefill per training episode, and how much a prefix cache saves.

The real path: `shopsimrl testbed up --token-endpoint` in its own process (shop and policy over
HTTP) and the training worker slime's adapter holds, playing train episodes with the testbed's
Qwen-style chat template. Per model call the adapter renders the whole conversation to ids; a
server with a prefix cache (SGLang's radix cache, vLLM's automatic prefix caching) prefills
only the ids after the longest cached prefix. Printed per episode:

- sent: every call's prompt ids (a server without prefix caching prefills all of them);
- cached: ids left after the common prefix with the previous call's prompt and reply (what a
  prefix cache of that conversation saves today);
- ideal: ids left if every call's prompt extended the previous call's tokens (only the new
  observation and template ids);
- stable tools: the same conversation rendered with the tools block's click ``enum`` left out
  (the values stay in the observation text), a counterfactual rendering that is never sent: what
  the cache could save if the top of the prompt did not follow the page.

Ratios are against the ideal. Forks are the trajectory's (each breaks the token contiguity).
``--calls-out FILE`` writes every call's prompt length and reusable prefix under each rendering,
the input of bench/prefill_gpu.py (what those prefills cost on a GPU).

The testbed counts a Chinese character as three ids. ``--bpe RANKS`` counts the same prompts and
replies in a real vocabulary instead: a rank file in tiktoken's format (one base64 token and its
rank a line), with Qwen's pre-tokenizer and ChatML special tokens. Qwen's (the regular vocabulary
Qwen2 and Qwen3 keep) is ``qwen_agent/utils/qwen.tiktoken`` in the ``qwen-agent`` wheel on PyPI.

    .venv/bin/python bench/training_prefix.py [--episodes 400] [--concurrency 16] [--calls-out FILE] [--bpe RANKS]
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextvars
import functools
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

import regex  # noqa: E402

from shopsimrl.testbed.chat_tokens import ByteTokenizer, TestbedChatTokenizer  # noqa: E402
from shopsimrl.training.config import load_training_config  # noqa: E402
from shopsimrl.training.worker import Sampling, TrainingWorker  # noqa: E402

_episode: contextvars.ContextVar[str] = contextvars.ContextVar("episode")


def _without_enum(value: Any) -> Any:
    if isinstance(value, dict):
        return {key: _without_enum(item) for key, item in value.items() if key != "enum"}
    if isinstance(value, list):
        return [_without_enum(item) for item in value]
    return value


class CounterfactualTokenizer(TestbedChatTokenizer):
    """The testbed tokenizer, which also renders every prompt with enum-free tools (never sent)."""

    def __init__(self) -> None:
        super().__init__()
        self.stable: dict[str, list[list[int]]] = defaultdict(list)

    def render(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, *, add_generation_prompt: bool = True
    ) -> list[int]:
        ids = super().render(messages, tools, add_generation_prompt=add_generation_prompt)
        stable_tools = _without_enum(list(tools)) if tools else tools
        self.stable[_episode.get()].append(super().render(messages, stable_tools, add_generation_prompt=add_generation_prompt))
        return ids


# Qwen's pre-tokenizer and its first special tokens (the ids follow the 151,643 regular ones).
QWEN_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"""
)
QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")


class RankBPE:
    """Byte-level BPE from a tiktoken rank file: pieces split by the pre-tokenizer, each merged
    pairwise lowest rank first; the special tokens' spellings are one id each."""

    def __init__(self, ranks: dict[bytes, int], pattern: str = QWEN_PATTERN, special: Sequence[str] = QWEN_SPECIAL) -> None:
        self.ranks = ranks
        self.pattern = regex.compile(pattern)
        self.special = {name: len(ranks) + i for i, name in enumerate(special)}
        self.splitter = re.compile("(" + "|".join(re.escape(name) for name in special) + ")")
        self._piece = functools.lru_cache(maxsize=1 << 18)(self._merge)

    @classmethod
    def load(cls, path: Path) -> RankBPE:
        ranks: dict[bytes, int] = {}
        for number, line in enumerate(path.read_text(encoding="ascii").splitlines(), start=1):
            if not line:
                continue
            token, _, rank = line.partition(" ")
            try:
                ranks[base64.b64decode(token, validate=True)] = int(rank)
            except ValueError as exc:
                raise SystemExit(f"{path}:{number}: not a tiktoken rank line ({exc})") from None
        return cls(ranks)

    def _merge(self, piece: bytes) -> tuple[int, ...]:
        parts = [piece[i : i + 1] for i in range(len(piece))]
        while len(parts) > 1:
            best, at = None, -1
            for i in range(len(parts) - 1):
                rank = self.ranks.get(parts[i] + parts[i + 1])
                if rank is not None and (best is None or rank < best):
                    best, at = rank, i
            if best is None:
                break
            parts[at : at + 2] = [parts[at] + parts[at + 1]]
        return tuple(self.ranks[part] for part in parts)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in self.splitter.split(text):
            if part in self.special:
                ids.append(self.special[part])
                continue
            for piece in self.pattern.findall(part):
                ids.extend(self._piece(piece.encode("utf-8")))
        return ids


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _wait(url: str, process: subprocess.Popen[bytes], timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"testbed exited with {process.returncode}")
        try:
            with urllib.request.urlopen(url, timeout=2) as answer:
                if answer.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise SystemExit(f"{url} not ready after {timeout_s:.0f} s")


def _common(left: Sequence[int], right: Sequence[int]) -> int:
    n = min(len(left), len(right))
    i = 0
    while i < n and left[i] == right[i]:
        i += 1
    return i


def _counts(prompts: Sequence[Sequence[int]], replies: Sequence[Sequence[int]]) -> tuple[int, int, int]:
    """(sent, left after the cached prefix, left if every prompt extended the previous call)."""
    sent = cached = ideal = 0
    previous: list[int] | None = None
    for prompt, reply in zip(prompts, replies, strict=True):
        sent += len(prompt)
        cached += len(prompt) - (_common(prompt, previous) if previous is not None else 0)
        ideal += len(prompt) - (len(previous) if previous is not None else 0)
        previous = [*prompt, *reply]
    return sent, cached, ideal


def _call_lengths(
    prompts: Sequence[Sequence[int]], replies: Sequence[Sequence[int]], stable: Sequence[Sequence[int]]
) -> list[dict[str, int]]:
    """Per call: prompt length and the prefix a cache could reuse (``cached``: common with the
    previous call's prompt and reply; ``ideal``: the whole previous call), and the same for the
    enum-free rendering."""
    rows: list[dict[str, int]] = []
    previous: list[int] | None = None
    previous_stable: list[int] | None = None
    for prompt, reply, stable_prompt in zip(prompts, replies, stable, strict=True):
        rows.append(
            {
                "prompt": len(prompt),
                "cached": _common(prompt, previous) if previous is not None else 0,
                "ideal": len(previous) if previous is not None else 0,
                "stable_prompt": len(stable_prompt),
                "stable_cached": _common(stable_prompt, previous_stable) if previous_stable is not None else 0,
            }
        )
        previous = [*prompt, *reply]
        previous_stable = [*stable_prompt, *reply]
    return rows


async def _play(
    config_path: Path, base_url: str, task_ids: list[int], concurrency: int
) -> tuple[list[Any], CounterfactualTokenizer]:
    config = load_training_config(config_path)
    tokenizer = CounterfactualTokenizer()
    worker = TrainingWorker(
        config, base_url=base_url, sampling=Sampling(temperature=0.6, max_new_tokens=512), tokenizer=tokenizer
    )
    await worker.start()

    async def one(index: int, task_id: int) -> Any:
        _episode.set(f"{index}")
        return index, await worker.rollout(task_id=task_id, index=index, group_index=index // 4)

    try:
        return await asyncio.gather(*(one(i, t) for i, t in enumerate(task_ids))), tokenizer
    finally:
        await worker.aclose()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--episodes", type=int, default=400)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--calls-out", type=Path, help="write each call's prompt and prefix lengths (JSON)")
    parser.add_argument("--bpe", type=Path, help="count in this tiktoken rank file's vocabulary (Qwen's)")
    args = parser.parse_args(argv)
    splits = json.loads((REPO / "configs/splits/persona_splits.v1.json").read_text(encoding="utf-8"))
    train: list[int] = splits["splits"]["train"]["task_ids"]
    task_ids = [train[i % len(train)] for i in range(args.episodes)]
    shop_port, policy_port = _free_port(), _free_port()
    with tempfile.TemporaryDirectory(prefix="shopsimrl-prefix-") as work:
        log = open(Path(work) / "testbed.log", "wb")  # noqa: SIM115 - closed with the process
        testbed = subprocess.Popen(
            [str(Path(sys.executable).parent / "shopsimrl"), "testbed", "up", "--token-endpoint",
             "--shop-port", str(shop_port), "--policy-port", str(policy_port)],
            stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "SHOPSIM_ENV_SLOTS": str(max(20, args.concurrency))},
        )  # fmt: skip
        try:
            _wait(f"http://127.0.0.1:{shop_port}/healthz", testbed)
            _wait(f"http://127.0.0.1:{policy_port}/v1/models", testbed)
            config = Path(work) / "training.yaml"
            config.write_text(
                json.dumps(
                    {
                        "run": {"name": "prefix", "output_dir": work, "concurrency": args.concurrency},
                        "tasks": {"split_file": str(REPO / "configs/splits/persona_splits.v1.json"), "split": "train"},
                        "environment": {"base_url": f"http://127.0.0.1:{shop_port}"},
                    }
                ),
                encoding="utf-8",
            )
            started = time.monotonic()
            played, tokenizer = asyncio.run(_play(config, f"http://127.0.0.1:{policy_port}", task_ids, args.concurrency))
            elapsed = time.monotonic() - started
        finally:
            testbed.terminate()
            testbed.wait(timeout=30)
            log.close()
    bpe = RankBPE.load(args.bpe) if args.bpe is not None else None
    unit = "Qwen BPE ids" if bpe is not None else "testbed byte ids"
    byte_tokenizer = ByteTokenizer()

    def ids(sequence: Sequence[int]) -> list[int]:
        return bpe.encode(byte_tokenizer.decode(sequence)) if bpe is not None else list(sequence)

    totals: dict[str, int] = defaultdict(int)
    shares: list[float] = []
    calls: list[list[dict[str, int]]] = []
    for index, rollout in played:
        turns = rollout.turns
        if not turns:
            continue
        prompts = [ids(turn.prompt_ids) for turn in turns]
        replies = [ids(turn.output_ids) for turn in turns]
        stable = [ids(prompt) for prompt in tokenizer.stable[f"{index}"][: len(turns)]]
        calls.append(_call_lengths(prompts, replies, stable))
        sent, cached, ideal = _counts(prompts, replies)
        _, stable_cached, _ = _counts(stable, replies)
        totals["episodes"] += 1
        totals["calls"] += len(turns)
        totals["forks"] += rollout.trajectory.forks if rollout.trajectory is not None else 0
        totals["sent"] += sent
        totals["cached"] += cached
        totals["ideal"] += ideal
        totals["stable_sent"] += sum(len(prompt) for prompt in stable)
        totals["stable_cached"] += stable_cached
        totals["scored"] += int(rollout.scored)
        for call in calls[-1][1:]:
            shares.append(call["cached"] / call["prompt"])
            totals["later_prompt"] += call["prompt"]
            totals["later_reused"] += call["cached"]
    if args.calls_out is not None:
        args.calls_out.write_text(json.dumps({"tokenizer": unit, "episodes": calls}), encoding="utf-8")
    n = totals["episodes"]
    if not n:
        raise SystemExit("no episode made a model call")
    print(f"episodes {n} ({totals['scored']} scored) in {elapsed:.1f} s; {totals['calls'] / n:.2f} calls, "
          f"{totals['forks'] / n:.2f} forks an episode (Qwen-style template; counted in {unit})")  # fmt: skip
    print(f"prompt ids to prefill per episode ({unit})   ids   ratio to ideal")
    for label, key in (
        ("sent, no prefix cache", "sent"),
        ("prefix cache (today's prompts)", "cached"),
        ("ideal: every call extends the last", "ideal"),
        ("stable tools: enum-free, no cache", "stable_sent"),
        ("stable tools: enum-free, prefix cache", "stable_cached"),
    ):
        print(f"  {label:<38}{totals[key] / n:>9.0f}   {totals[key] / totals['ideal']:>6.2f}")
    print(f"share of a later call's prompt that extends the previous call: mean {sum(shares) / max(len(shares), 1):.3f} "
          f"over {len(shares)} calls, token-weighted {totals['later_reused'] / max(totals['later_prompt'], 1):.3f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
