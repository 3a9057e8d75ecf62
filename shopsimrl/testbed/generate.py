"""The token endpoint of the testbed policy: SGLang's native ``POST /generate``, over token ids.

Training rollouts need what a model sampled as token ids with their log-probabilities, not text:
SGLang's ``/generate`` gives that (``input_ids`` in, ``output_ids`` and ``meta_info`` out). The
policy server (:mod:`shopsimrl.testbed.policy`) serves this route when its ``token_endpoint``
setting is on; this module holds the request checks and the answer's shape.

Request (a JSON object; the fields SGLang names, a subset):

- ``input_ids`` (list of ints) or ``text`` (a string, encoded with the testbed tokenizer), one of
  the two; a batch (a list of prompts) is refused;
- ``sampling_params``: ``max_new_tokens`` (default 128, as SGLang's), ``temperature`` (≥ 0),
  ``top_p`` (0, 1], ``top_k`` (−1 or ≥ 1), ``stop`` (a string or a list), ``stop_token_ids``,
  ``ignore_eos``, ``skip_special_tokens`` (default true), ``sampling_seed``; other keys of
  SGLang's are refused by name, as SGLang refuses unknown ones;
- ``return_logprob`` (bool), ``rid`` (echoed as ``meta_info.id``), ``stream`` (refused: false only),
  ``logprob_start_len`` (accepted, ignored: no prompt log-probabilities are returned).

Answer, shaped as SGLang shapes it::

    {"text": "...", "output_ids": [...],
     "meta_info": {"id": "...", "finish_reason": {"type": "stop", "matched": 258},
                   "prompt_tokens": 812, "completion_tokens": 41, "cached_tokens": 0,
                   "output_token_logprobs": [[-0.013, 60, null], ...]}}   # with return_logprob

``finish_reason`` is ``{"type": "stop", "matched": <token id or stop string>}``, ``{"type":
"length", "length": max_new_tokens}`` or ``{"type": "abort", "message": ...}``. ``output_ids``
include the token the reply stopped on (``<|im_end|>``), as SGLang's do; ``text`` leaves special
tokens out unless ``skip_special_tokens`` is false, and ends before a matched stop string.

The policy decides from the conversation the ids spell (:meth:`ChatTemplate.parse`), so the reply
is the heuristic decision written as the template writes calls (``<tool_call>`` + JSON +
``</tool_call>``, then ``<|im_end|>``), behind ``<think>…</think>`` when the server's ``reasoning``
is on. Log-probabilities are deterministic: a function of the prompt ids, the position and the
token, in (−1, 0], finite. Errors: 400 with SGLang's ``{"error": {"message": ...}}``; a prompt
that with ``max_new_tokens`` does not fit ``max_model_len`` gets SGLang's context-length text.
"""

from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Any

from shopsimrl.schemas import sha256_hex
from shopsimrl.testbed.chat_tokens import IM_END, TestbedChatTokenizer

__all__ = ["GenerateRequest", "GenerateRequestError", "context_length_message", "parse_generate_request", "shape_reply"]

DEFAULT_MAX_NEW_TOKENS = 128
_SAMPLING_KEYS = frozenset(
    {
        "max_new_tokens",
        "temperature",
        "top_p",
        "top_k",
        "stop",
        "stop_token_ids",
        "ignore_eos",
        "skip_special_tokens",
        "sampling_seed",
    }
)
_SGLANG_ONLY_KEYS = frozenset(
    {
        "min_p",
        "frequency_penalty",
        "presence_penalty",
        "repetition_penalty",
        "min_new_tokens",
        "n",
        "json_schema",
        "regex",
        "ebnf",
    }
)
_REQUEST_KEYS = frozenset({"input_ids", "text", "sampling_params", "return_logprob", "rid", "stream", "logprob_start_len"})


class GenerateRequestError(ValueError):
    """A request this endpoint refuses (HTTP 400), naming the field."""


@dataclass(frozen=True)
class GenerateRequest:
    input_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    skip_special_tokens: bool
    seed: int | None
    return_logprob: bool
    rid: str | None


def _number(params: dict[str, Any], key: str, default: float) -> float:
    value = params.get(key, default)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise GenerateRequestError(f"sampling_params.{key} must be a finite number, got {value!r}")
    return float(value)


def _integer(params: dict[str, Any], key: str, default: int | None) -> int | None:
    value = params.get(key, default)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise GenerateRequestError(f"sampling_params.{key} must be an integer, got {value!r}")
    return value


def parse_generate_request(body: Any, tokenizer: TestbedChatTokenizer) -> GenerateRequest:
    if not isinstance(body, dict):
        raise GenerateRequestError("request body must be a JSON object")
    unknown = sorted(set(body) - _REQUEST_KEYS)
    if unknown:
        raise GenerateRequestError(f"unsupported request field(s) {unknown}; this endpoint takes {sorted(_REQUEST_KEYS)}")
    if body.get("stream"):
        raise GenerateRequestError("stream: the testbed token endpoint answers whole replies only (stream false)")
    has_ids, has_text = body.get("input_ids") is not None, body.get("text") is not None
    if has_ids == has_text:
        raise GenerateRequestError("give exactly one of input_ids and text")
    if has_ids:
        ids = body["input_ids"]
        if not isinstance(ids, list) or not ids:
            raise GenerateRequestError("input_ids must be a non-empty list of token ids (a batch is not supported)")
        for position, token in enumerate(ids):
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < tokenizer.tokenizer.vocab_size:
                raise GenerateRequestError(f"input_ids[{position}] is not a token id of the testbed tokenizer: {token!r}")
    else:
        if not isinstance(body["text"], str) or not body["text"]:
            raise GenerateRequestError("text must be a non-empty string (a batch is not supported)")
        try:
            ids = tokenizer.encode(body["text"])
        except ValueError as exc:
            raise GenerateRequestError(f"text: {exc}") from None
    params = body.get("sampling_params") or {}
    if not isinstance(params, dict):
        raise GenerateRequestError("sampling_params must be an object")
    for key in params:
        if key in _SGLANG_ONLY_KEYS:
            raise GenerateRequestError(f"sampling_params.{key} is not supported by the testbed token endpoint")
        if key not in _SAMPLING_KEYS:
            raise GenerateRequestError(f"sampling_params.{key} is not a sampling parameter")
    max_new = _integer(params, "max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    if max_new is None or max_new < 0:
        raise GenerateRequestError(f"sampling_params.max_new_tokens must be an integer >= 0, got {max_new!r}")
    temperature = _number(params, "temperature", 1.0)
    if temperature < 0:
        raise GenerateRequestError(f"sampling_params.temperature must be >= 0, got {temperature}")
    top_p = _number(params, "top_p", 1.0)
    if not 0 < top_p <= 1:
        raise GenerateRequestError(f"sampling_params.top_p must be in (0, 1], got {top_p}")
    top_k = _integer(params, "top_k", -1)
    if top_k is None or (top_k != -1 and top_k < 1):
        raise GenerateRequestError(f"sampling_params.top_k must be -1 or >= 1, got {top_k!r}")
    stop = params.get("stop") or ()
    stop = (stop,) if isinstance(stop, str) else stop
    if not isinstance(stop, (list, tuple)) or not all(isinstance(s, str) and s for s in stop):
        raise GenerateRequestError("sampling_params.stop must be a non-empty string or a list of them")
    stop_ids = params.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise GenerateRequestError("sampling_params.stop_token_ids must be a list of token ids")
    for key in ("ignore_eos", "skip_special_tokens"):
        if not isinstance(params.get(key, False), bool):
            raise GenerateRequestError(f"sampling_params.{key} must be a boolean")
    if not isinstance(body.get("return_logprob", False), bool):
        raise GenerateRequestError("return_logprob must be a boolean")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise GenerateRequestError("rid must be a string")
    return GenerateRequest(
        input_ids=list(ids),
        max_new_tokens=max_new,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop=tuple(stop),
        stop_token_ids=frozenset(stop_ids),
        ignore_eos=params.get("ignore_eos", False),
        skip_special_tokens=params.get("skip_special_tokens", True),
        seed=_integer(params, "sampling_seed", None),
        return_logprob=body.get("return_logprob", False),
        rid=rid,
    )


def context_length_message(prompt_tokens: int, max_new_tokens: int, max_model_len: int) -> str | None:
    """SGLang's two refusals (its tokenizer manager's texts), or None when the request fits."""
    if prompt_tokens >= max_model_len:
        return f"The input ({prompt_tokens} tokens) is longer than the model's context length ({max_model_len} tokens)."
    if prompt_tokens + max_new_tokens > max_model_len:
        return (
            f"Requested token count exceeds the model's maximum context length of {max_model_len} tokens. "
            f"You requested a total of {prompt_tokens + max_new_tokens} tokens: {prompt_tokens} tokens from the input "
            f"messages and {max_new_tokens} tokens for the completion. Please reduce the number of tokens in the input "
            "messages or the completion to fit within the limit."
        )
    return None


def reply_text(name: str | None, arguments: dict[str, Any] | None, reasoning: str | None, plain: str | None) -> str:
    """The reply as the model writes it, before the end-of-turn token."""
    text = f"<think>\n{reasoning}\n</think>\n\n" if reasoning else ""
    if name is not None:
        text += "<tool_call>\n" + json.dumps({"name": name, "arguments": arguments or {}}, ensure_ascii=False) + "\n</tool_call>"
    return text + (plain or "")


def _logprobs(input_ids: list[int], output_ids: list[int], temperature: float) -> list[float]:
    """Deterministic log-probabilities in (−1, 0]: the same prompt and reply give the same values."""
    rng = random.Random(sha256_hex(json.dumps([input_ids, output_ids, temperature])))
    return [-round(rng.random() ** 2, 6) for _ in output_ids]


def shape_reply(
    request: GenerateRequest, text: str, tokenizer: TestbedChatTokenizer, *, prompt_digest: str, cut_to: int | None = None
) -> dict[str, Any]:
    """The SGLang-shaped answer for a reply ``text`` (the end-of-turn token follows it); ``cut_to``
    ends it after that many tokens as if the token limit had been reached there."""
    ids = tokenizer.encode(text)
    if not request.ignore_eos:
        ids.append(IM_END)
    finish: dict[str, Any] | None = None
    for position, token in enumerate(ids):
        if token in request.stop_token_ids or (token == IM_END and not request.ignore_eos):
            ids, finish = ids[: position + 1], {"type": "stop", "matched": token}
            break
    visible_end: int | None = None
    if request.stop:
        # The reply ends at the first token whose text completes a stop string (SGLang checks the tail).
        decoded = ""
        for position in range(len(ids)):
            decoded = tokenizer.decode(ids[: position + 1], skip_special_tokens=True)
            hits = [(decoded.find(s), s) for s in request.stop if s in decoded]
            if hits:
                at, matched = min(hits)
                ids, finish, visible_end = ids[: position + 1], {"type": "stop", "matched": matched}, at
                break
    if cut_to is not None and cut_to < len(ids):
        ids, finish, visible_end = ids[:cut_to], {"type": "length", "length": cut_to}, None
    if len(ids) > request.max_new_tokens:
        ids, finish, visible_end = ids[: request.max_new_tokens], {"type": "length", "length": request.max_new_tokens}, None
    if finish is None:  # ignore_eos and no stop: the reply ran to its end
        finish = {"type": "length", "length": request.max_new_tokens}
    out_text = tokenizer.decode(ids, skip_special_tokens=request.skip_special_tokens)
    if visible_end is not None:
        out_text = tokenizer.decode(ids, skip_special_tokens=True)[:visible_end]
    meta: dict[str, Any] = {
        "id": request.rid or prompt_digest[:32],
        "finish_reason": finish,
        "prompt_tokens": len(request.input_ids),
        "completion_tokens": len(ids),
        "cached_tokens": 0,
    }
    if request.return_logprob:
        values = _logprobs(request.input_ids, ids, request.temperature)
        meta["output_token_logprobs"] = [[value, token, None] for value, token in zip(values, ids, strict=True)]
    return {"text": out_text, "output_ids": ids, "meta_info": meta}


def abort_reply(request: GenerateRequest, prompt_digest: str, message: str) -> dict[str, Any]:
    """SGLang's answer to a request aborted before any token (e.g. while weights are updated)."""
    meta: dict[str, Any] = {
        "id": request.rid or prompt_digest[:32],
        "finish_reason": {"type": "abort", "message": message, "status_code": None, "err_type": None},
        "prompt_tokens": len(request.input_ids),
        "completion_tokens": 0,
        "cached_tokens": 0,
    }
    if request.return_logprob:
        meta["output_token_logprobs"] = []
    return {"text": "", "output_ids": [], "meta_info": meta}
