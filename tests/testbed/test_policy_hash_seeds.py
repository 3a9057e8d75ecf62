"""The heuristic policy decides the same for a conversation whatever the process's string hash seed.

``fixtures/policy_conversations.json.gz`` holds 24 decision inputs (messages, tools, seed) taken
from testbed runs of the val and train splits: the first five are the results pages on which the
policy once opened a different listing under some ``PYTHONHASHSEED`` values (a float sum over a
set of tokens, whose order follows the hash seed, broke near-ties), the rest a spread of search,
results and product pages. Each seed runs in its own interpreter, since the hash seed is fixed
when a process starts.
"""

from __future__ import annotations

import gzip
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow

FIXTURE = Path(__file__).parent / "fixtures" / "policy_conversations.json.gz"
HASH_SEEDS = range(13)

# Every way the served policy decides: the default, sampled (temperature > 0), the options skill,
# and the naive strategy.
_DECIDE_ALL = """
import gzip, json, sys
from shopsimrl.testbed.heuristics import decide
from shopsimrl.testbed.heuristics_naive import decide_naive

conversations = json.loads(gzip.decompress(open(sys.argv[1], "rb").read()))
out = []
for c in conversations:
    m, t, seed = c["messages"], c["tools"], c["seed"]
    for d in (
        decide(m, t, seed=seed),
        decide(m, t, seed=seed, temperature=0.7),
        decide(m, t, seed=seed, options_need_skill=True),
        decide_naive(m, t),
    ):
        out.append(None if d is None else [d.tool, d.arguments, d.reasoning])
json.dump(out, sys.stdout, ensure_ascii=False)
"""


def test_decisions_do_not_depend_on_the_hash_seed() -> None:
    conversations = json.loads(gzip.decompress(FIXTURE.read_bytes()))
    assert len(conversations) == 24
    processes = {
        seed: subprocess.Popen(
            [sys.executable, "-c", _DECIDE_ALL, str(FIXTURE)],
            env={**os.environ, "PYTHONHASHSEED": str(seed)},
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for seed in HASH_SEEDS
    }
    decisions = {}
    for seed, process in processes.items():
        stdout, stderr = process.communicate(timeout=300)
        assert process.returncode == 0, stderr[-2000:]
        decisions[seed] = json.loads(stdout)
    reference = decisions[0]
    assert len(reference) == 4 * len(conversations) and all(d is not None for d in reference)
    for seed, other in decisions.items():
        differing = [i // 4 for i, (a, b) in enumerate(zip(reference, other, strict=True)) if a != b]
        assert not differing, f"PYTHONHASHSEED={seed} changes the decision on conversations {sorted(set(differing))}"
