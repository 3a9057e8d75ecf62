"""The GPU prefill benchmark's own arithmetic: the scenarios' prefills, the cost fit, the grid.

The GPU part is never run here (it needs CUDA and measures; tests never time anything).
"""

from __future__ import annotations

import pytest

from tests.bench_scripts import load_bench

prefill_gpu = load_bench("prefill_gpu")

CALLS = [
    {"prompt": 100, "cached": 0, "ideal": 0, "stable_prompt": 98, "stable_cached": 0},
    {"prompt": 180, "cached": 40, "ideal": 130, "stable_prompt": 176, "stable_cached": 150},
]


def test_each_scenario_prefills_what_its_cache_leaves() -> None:
    assert prefill_gpu.prefills(CALLS, "prompt", None) == [(0, 100), (0, 180)]
    assert prefill_gpu.prefills(CALLS, "prompt", "cached") == [(0, 100), (40, 140)]
    assert prefill_gpu.prefills(CALLS, "prompt", "ideal") == [(0, 100), (130, 50)]
    assert prefill_gpu.prefills(CALLS, "stable_prompt", "stable_cached") == [(0, 98), (150, 26)]
    # a reusable prefix longer than the prompt (the previous reply ran past it) reuses the prompt
    assert prefill_gpu.prefills([{"prompt": 10, "ideal": 12}], "prompt", "ideal") == [(10, 0)]


def test_the_fit_recovers_the_cost_it_was_given() -> None:
    truth = (2e-3, 5e-8, 3e-12)
    points = [(p, n, prefill_gpu.predict(truth, p, n)) for p, n in prefill_gpu.grid(90_000)]
    fitted = prefill_gpu.fit_cost(points)
    assert fitted == pytest.approx(truth, rel=1e-6)


def test_episode_seconds_sum_the_calls_of_each_scenario() -> None:
    per_token = prefill_gpu.episode_seconds([CALLS], lambda p, n: float(n))
    assert per_token["sent, no prefix cache"] == 280
    assert per_token["prefix cache (today's prompts)"] == 240
    assert per_token["ideal: every call extends the last"] == 150
    assert per_token["stable tools: enum-free, no cache"] == 274
    assert per_token["stable tools: enum-free, prefix cache"] == 124


def test_the_grid_covers_the_longest_prompt() -> None:
    points = prefill_gpu.grid(94_389)
    assert (0, 94_389) in points
    assert all(p + n <= 94_389 + 2048 for p, n in points)
    assert {p for p, _ in points} >= {0, 2048, 8192, 65536}


def test_flops_count_the_layers_attention_and_last_logits() -> None:
    shape = prefill_gpu.Shape(name="toy", layers=2, hidden=8, intermediate=16, heads=2, kv_heads=1, head_dim=4, vocab=10)
    # per layer: qkv 8*(8+2*4) + o 8*8 + mlp 3*8*16 = 128 + 64 + 384
    assert prefill_gpu.layer_weights(shape) == 2 * 576
    # 3 new tokens after 5 cached: 3*5 + 3*4/2 = 21 query-key pairs
    assert prefill_gpu.flops(shape, 5, 3) == 2 * 1152 * 3 + 4 * 2 * 4 * 2 * 21 + 2 * 8 * 10
    assert prefill_gpu.flops(shape, 5, 0) == 0
    assert prefill_gpu.layer_weights(prefill_gpu.Shape()) == 3_633_315_840  # Qwen3-4B's layers
