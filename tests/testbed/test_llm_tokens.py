"""The llama.cpp token endpoint's sampler and request checks, without the model.

The sampler is the one the server runs (``shopsimrl/testbed/llm_tokens.py``, numpy only); the
server itself, with SmolLM2, is exercised by ``tests/training/test_real_model.py`` (``llm``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import pytest

from shopsimrl.model import context_overflow
from shopsimrl.testbed.llm_tokens import (
    GenerateRequestError,
    context_length_message,
    parse_token_request,
    sample_next,
)

LOGITS = np.array([2.0, 1.0, 0.5, -1.0, -3.0], dtype=np.float32)


def _log_softmax(values: np.ndarray, temperature: float) -> np.ndarray:
    scaled = values.astype(np.float64) / temperature
    return scaled - np.log(np.exp(scaled - scaled.max()).sum()) - scaled.max()


def test_greedy_is_the_arg_max_with_the_raw_log_softmax() -> None:
    rng = np.random.Generator(np.random.PCG64(0))
    for temperature in (0.0, 1e-7):
        token, value = sample_next(LOGITS, temperature=temperature, top_p=1.0, top_k=-1, rng=rng)
        assert token == 0 and value == pytest.approx(_log_softmax(LOGITS, 1.0)[0], abs=1e-12)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 1.7])
def test_a_sampled_token_carries_its_log_probability_under_the_temperature(temperature: float) -> None:
    rng = np.random.Generator(np.random.PCG64(3))
    expected = _log_softmax(LOGITS, temperature)
    for _ in range(50):
        token, value = sample_next(LOGITS, temperature=temperature, top_p=1.0, top_k=-1, rng=rng)
        assert value == pytest.approx(expected[token], abs=1e-12)


def test_the_draws_follow_the_tempered_distribution_and_a_seed_repeats_them() -> None:
    temperature, n = 0.8, 20_000
    expected = np.exp(_log_softmax(LOGITS, temperature))
    rng = np.random.Generator(np.random.PCG64(11))
    draws = [sample_next(LOGITS, temperature=temperature, top_p=1.0, top_k=-1, rng=rng)[0] for _ in range(n)]
    counts = np.bincount(draws, minlength=len(LOGITS))
    for token, p in enumerate(expected):
        bound = 5 * math.sqrt(n * p * (1 - p)) + 1  # five standard deviations of a binomial count
        assert abs(counts[token] - n * p) <= bound, (token, counts[token], n * p)
    again = np.random.Generator(np.random.PCG64(11))
    assert [sample_next(LOGITS, temperature=temperature, top_p=1.0, top_k=-1, rng=again)[0] for _ in range(200)] == draws[:200]


def test_top_k_and_top_p_truncate_the_draw_but_not_the_log_probability() -> None:
    rng = np.random.Generator(np.random.PCG64(5))
    full = _log_softmax(LOGITS, 1.0)
    seen_k = {sample_next(LOGITS, temperature=1.0, top_p=1.0, top_k=2, rng=rng)[0] for _ in range(500)}
    assert seen_k == {0, 1}
    # Probabilities 0.607, 0.223, 0.135, ...: the mass before each is 0, 0.607, 0.830: top_p 0.7 keeps 0 and 1.
    seen_p: set[int] = set()
    for _ in range(500):
        token, value = sample_next(LOGITS, temperature=1.0, top_p=0.7, top_k=-1, rng=rng)
        seen_p.add(token)
        assert value == pytest.approx(full[token], abs=1e-12)
    assert seen_p == {0, 1}


@pytest.mark.parametrize(
    ("body", "words"),
    [
        ([1, 2], "must be a JSON object"),
        ({"text": "hi"}, r"unsupported request field\(s\) \['text'\]"),
        ({"input_ids": []}, "input_ids must be a non-empty list"),
        ({"input_ids": [1, 99]}, r"input_ids\[1\] is not a token id of the model \(0..49\)"),
        ({"input_ids": [1], "stream": True}, "stream"),
        ({"input_ids": [1], "sampling_params": {"min_p": 0.1}}, r"sampling_params \['min_p'\] not supported"),
        ({"input_ids": [1], "sampling_params": {"temperature": -1}}, "temperature must be >= 0"),
        ({"input_ids": [1], "sampling_params": {"temperature": float("nan")}}, "temperature must be a finite number"),
        ({"input_ids": [1], "sampling_params": {"top_p": 0}}, r"top_p must be in \(0, 1\]"),
        ({"input_ids": [1], "sampling_params": {"top_k": 0}}, "top_k must be -1 or >= 1"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": True}}, "max_new_tokens must be an integer"),
        ({"input_ids": [1], "sampling_params": {"sampling_seed": "7"}}, "sampling_seed must be an integer"),
        ({"input_ids": [1], "sampling_params": {"ignore_eos": 1}}, "ignore_eos must be a boolean"),
        ({"input_ids": [1], "return_logprob": "yes"}, "return_logprob must be a boolean"),
    ],
)
def test_a_bad_request_is_refused_naming_the_field(body: Any, words: str) -> None:
    with pytest.raises(GenerateRequestError, match=words):
        parse_token_request(body, vocab_size=50)


def test_what_slime_sends_is_accepted() -> None:
    # slime's GenerateState sampling_params (with None for the unset stops), and the adapter's own.
    params = {
        "temperature": 0.6, "top_p": 1.0, "top_k": -1, "max_new_tokens": 512, "stop": None, "stop_token_ids": None,
        "skip_special_tokens": False, "no_stop_trim": True, "spaces_between_special_tokens": False, "sampling_seed": 1234,
    }  # fmt: skip
    request = parse_token_request({"input_ids": [1, 2], "sampling_params": params, "return_logprob": True, "rid": "r"}, 50)
    assert request.seed == 1234 and request.max_new_tokens == 512 and not request.skip_special_tokens
    assert request.stop == () and request.stop_token_ids == frozenset() and request.return_logprob


def test_the_context_refusals_are_read_by_the_adapter_as_context_length() -> None:
    too_long = context_length_message(9000, 64, 8192)
    no_room = context_length_message(8100, 200, 8192)
    assert too_long and no_room and context_length_message(100, 64, 8192) is None
    for message in (too_long, no_room):
        found = context_overflow({"error": {"message": message}}, message)
        assert found is not None and found[1] == 8192
