"""SGLang's native ``POST /generate`` over llama.cpp: a real model's token ids and log-probabilities.

The training adapter (:mod:`shopsimrl.training.token_model`) speaks token ids to SGLang; the
testbed's own ``/generate`` (:mod:`shopsimrl.testbed.generate`) answers with a deterministic policy
and a byte tokenizer. This server answers with a real model (SmolLM2-135M from its GGUF, on CPU), so
a test can check what only a real tokenizer and a real sampler show: that the ids a rollout keeps
decode to exactly the text the model produced, and how often a re-rendered prompt extends the
previous one under the model's own chat template.

It runs in the llama.cpp environment (:mod:`shopsimrl.testbed.llm`), started as
``python -I llm_tokens.py --model M --port P`` by that environment's interpreter: it imports only
the standard library, numpy and llama-cpp-python (never the project), like ``llm.py run-server``.

Routes (one request generates at a time; the others wait):

``POST /generate``, the subset of SGLang's request the adapter and slime send::

    {"input_ids": [...], "return_logprob": true, "rid": "...",
     "sampling_params": {"max_new_tokens": 64, "temperature": 0.7, "top_p": 1.0, "top_k": -1,
                         "sampling_seed": 7, "stop_token_ids": [...], "stop": [...],
                         "ignore_eos": false, "skip_special_tokens": true,
                         "no_stop_trim": false, "spaces_between_special_tokens": true}}

answered as SGLang (and the testbed's ``/generate``) answers::

    {"text": "...", "output_ids": [...],
     "meta_info": {"id": "...", "finish_reason": {"type": "stop", "matched": 2},
                   "prompt_tokens": 812, "completion_tokens": 41, "cached_tokens": 790,
                   "output_token_logprobs": [[-0.31, 504, null], ...]}}

``output_ids`` include the end-of-turn token the reply stopped on; ``text`` is their
detokenisation by llama.cpp (special tokens left out unless ``skip_special_tokens`` is false), cut
before a matched stop string. ``finish_reason`` is ``{"type": "stop", "matched": id or string}`` or
``{"type": "length", "length": max_new_tokens}``. Other request keys are refused by name (400,
``{"error": {"message": ...}}``), and so is a prompt that with ``max_new_tokens`` does not fit the
context window, in SGLang's words (the adapter reads them as its ``context_length`` failure).

**Sampling and log-probabilities, as SGLang defines them.** A temperature below 1e-6 is greedy
(SGLang sets temperature 1 and top-k 1): the arg-max, with the log-softmax of the raw logits.
Otherwise the logits are divided by the temperature; the returned log-probability of the sampled
token is its log-softmax under that temperature, over the whole vocabulary (before top-k/top-p
truncation: SGLang's default, ``SGLANG_RETURN_ORIGINAL_LOGPROB`` unset), which is what slime's
trainer recomputes (its logits divided by ``--rollout-temperature``). ``-inf`` is clamped to the
float32 minimum, as SGLang clamps, so every value is finite. The token is drawn from that
distribution, truncated by ``top_k`` (the k most likely) and ``top_p`` (the smallest prefix, most
likely first, whose mass before the token is at most ``top_p``) and renormalised, by inverting its
cumulative sum at one uniform number per token from numpy's PCG64 seeded with ``sampling_seed``: the
same prompt and seed give the same reply. Without a seed each request draws a fresh one.

**Prefix cache.** The context keeps the previous request's tokens; a prompt that starts with them
evaluates only the rest (``meta_info.cached_tokens``), as SGLang's radix cache would, so an episode's
calls that extend each other cost little. ``--no-prefix-cache`` evaluates every prompt whole. The
answer does not depend on it: llama.cpp runs with flash attention and micro-batches of
:data:`BATCH` tokens, where its CPU forward pass gives a token the same logits however the prompt
was split (measured bit-identical for a 1,200-token prompt evaluated 1, 17, 32, 56, 64 and 1,200
tokens at a time; with larger micro-batches, or without flash attention, the logits differ by up to
1.2 and so does the arg-max). Same request and seed, same reply, whatever was served before.

``POST /tokenize`` ``{"text": str}`` → ``{"input_ids": [...]}`` (special tokens parsed, no BOS) and
``POST /detokenize`` ``{"input_ids": [...], "skip_special_tokens": bool}`` → ``{"text": str}`` are
this server's own (not SGLang's), for a test to hold the project's tokenizer against llama.cpp's.
``GET /health`` answers 200; ``GET /get_model_info`` names the model, its context window, the
end-of-turn id and the SHA-256 of the GGUF's chat template.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import json
import math
import sys
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

__all__ = [
    "GREEDY_EPSILON",
    "GenerateRequestError",
    "TokenRequest",
    "context_length_message",
    "parse_token_request",
    "sample_next",
]

GREEDY_EPSILON = 1e-6
"""SGLang's ``_SAMPLING_EPS``: a temperature below it samples greedily."""
DEFAULT_MAX_NEW_TOKENS = 128
BATCH = 32
"""Tokens per llama.cpp micro-batch: below the size where its CPU backend changes matrix kernels."""
FLOAT32_MIN = -3.4028234663852886e38
"""SGLang clamps a log-probability of ``-inf`` to ``torch.finfo(float32).min``."""

_REQUEST_KEYS = frozenset({"input_ids", "sampling_params", "return_logprob", "rid", "stream", "logprob_start_len"})
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
        # slime sends these two; they change only how SGLang spells the text, not the ids.
        "no_stop_trim",
        "spaces_between_special_tokens",
    }
)


class GenerateRequestError(ValueError):
    """A request this server refuses (HTTP 400); the message names the field."""


@dataclass(frozen=True)
class TokenRequest:
    input_ids: list[int]
    max_new_tokens: int
    temperature: float
    top_p: float
    top_k: int
    stop: tuple[str, ...]
    stop_token_ids: frozenset[int]
    ignore_eos: bool
    skip_special_tokens: bool
    no_stop_trim: bool
    seed: int | None
    return_logprob: bool
    rid: str | None


def _number(params: dict[str, Any], key: str, default: float) -> float:
    value = params.get(key)
    value = default if value is None else value
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise GenerateRequestError(f"sampling_params.{key} must be a finite number, got {value!r}")
    return float(value)


def _integer(params: dict[str, Any], key: str, default: int | None) -> int | None:
    value = params.get(key)
    value = default if value is None else value
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise GenerateRequestError(f"sampling_params.{key} must be an integer, got {value!r}")
    return value


def _flag(params: dict[str, Any], key: str, default: bool) -> bool:
    value = params.get(key)
    if value is None:
        return default
    if not isinstance(value, bool):
        raise GenerateRequestError(f"sampling_params.{key} must be a boolean, got {value!r}")
    return value


def parse_token_request(body: Any, vocab_size: int) -> TokenRequest:
    """The request's fields, checked; :class:`GenerateRequestError` naming the first bad one."""
    if not isinstance(body, dict):
        raise GenerateRequestError("request body must be a JSON object")
    unknown = sorted(set(body) - _REQUEST_KEYS)
    if unknown:
        raise GenerateRequestError(f"unsupported request field(s) {unknown}; this server takes {sorted(_REQUEST_KEYS)}")
    if body.get("stream"):
        raise GenerateRequestError("stream: this server answers whole replies only (stream false)")
    ids = body.get("input_ids")
    if not isinstance(ids, list) or not ids:
        raise GenerateRequestError("input_ids must be a non-empty list of token ids (text prompts and batches are not supported)")
    for position, token in enumerate(ids):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise GenerateRequestError(f"input_ids[{position}] is not a token id of the model (0..{vocab_size - 1}): {token!r}")
    params = body.get("sampling_params")
    params = {} if params is None else params
    if not isinstance(params, dict):
        raise GenerateRequestError("sampling_params must be an object")
    unknown = sorted(set(params) - _SAMPLING_KEYS)
    if unknown:
        raise GenerateRequestError(f"sampling_params {unknown} not supported; this server takes {sorted(_SAMPLING_KEYS)}")
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
    seed = _integer(params, "sampling_seed", None)
    if not isinstance(body.get("return_logprob", False), bool):
        raise GenerateRequestError("return_logprob must be a boolean")
    rid = body.get("rid")
    if rid is not None and not isinstance(rid, str):
        raise GenerateRequestError("rid must be a string")
    _flag(params, "spaces_between_special_tokens", True)
    return TokenRequest(
        input_ids=list(ids),
        max_new_tokens=max_new,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop=tuple(stop),
        stop_token_ids=frozenset(stop_ids),
        ignore_eos=_flag(params, "ignore_eos", False),
        skip_special_tokens=_flag(params, "skip_special_tokens", True),
        no_stop_trim=_flag(params, "no_stop_trim", False),
        seed=seed,
        return_logprob=body.get("return_logprob", False),
        rid=rid,
    )


def context_length_message(prompt_tokens: int, max_new_tokens: int, max_model_len: int) -> str | None:
    """SGLang's refusals of a prompt that does not fit (its tokenizer manager's words), or None."""
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


def sample_next(logits: Any, *, temperature: float, top_p: float, top_k: int, rng: Any) -> tuple[int, float]:
    """One token from ``logits`` (a float vector over the vocabulary) and its log-probability, as
    the module docstring defines them; ``rng`` is a ``numpy.random.Generator``."""
    import numpy as np

    values = np.asarray(logits, dtype=np.float64)
    if temperature < GREEDY_EPSILON:
        temperature, top_k = 1.0, 1
    scaled = values / temperature
    peak = float(scaled.max())
    log_probs = scaled - (peak + math.log(float(np.exp(scaled - peak).sum())))
    if top_k == 1:
        token = int(np.argmax(scaled))
    else:
        probs = np.exp(log_probs)
        if top_k == -1 and top_p >= 1.0:
            order = None
            cumulative = np.cumsum(probs)
        else:
            order = np.argsort(-probs, kind="stable")
            kept = probs[order]
            if top_k > 0:
                kept[top_k:] = 0.0
            if top_p < 1.0:
                kept[(np.cumsum(kept) - kept) > top_p] = 0.0
            cumulative = np.cumsum(kept)
        position = int(np.searchsorted(cumulative, rng.random() * cumulative[-1], side="right"))
        position = min(position, len(cumulative) - 1)
        token = int(order[position]) if order is not None else position
    return token, max(float(log_probs[token]), FLOAT32_MIN)


def _common_prefix(left: Sequence[int], right: Sequence[int]) -> int:
    n = min(len(left), len(right))
    i = 0
    while i < n and left[i] == right[i]:
        i += 1
    return i


class _Model:
    """llama.cpp's model and one context, used by one request at a time."""

    def __init__(self, model: Path, *, n_ctx: int, n_threads: int, prefix_cache: bool) -> None:
        from llama_cpp import Llama

        self.path = model
        # Batch invariance: a token's logits must not depend on how its prompt was split into
        # batches (whole, in chunks, or partly from the cache), or a seeded request would answer
        # differently depending on what the cache held. Measured on llama.cpp's CPU backend with
        # SmolLM2: without flash attention a 1-token and a 2-token batch differ by up to 0.9 in the
        # logits; with it, batches of up to 56 tokens agree bit for bit and 64 or more take another
        # matrix kernel (differing by up to 1.2, another arg-max). Hence flash attention and
        # micro-batches of BATCH tokens: prompts prefill at about half the speed, identically.
        self.llama = Llama(
            model_path=str(model),
            n_ctx=n_ctx,
            n_threads=n_threads,
            n_threads_batch=n_threads,
            n_batch=BATCH,
            n_ubatch=BATCH,
            logits_all=False,
            flash_attn=True,
            verbose=False,
        )
        self.n_vocab = int(self.llama.n_vocab())
        self.n_ctx = int(self.llama.n_ctx())
        self.eos = int(self.llama.token_eos())
        self.prefix_cache = prefix_cache
        self.lock = threading.Lock()
        self._pieces: dict[tuple[int, bool], bytes] = {}
        template = self.llama.metadata.get("tokenizer.chat_template", "")
        self.info = {
            "model_path": str(model),
            "tokenizer_path": str(model),
            "is_generation": True,
            "max_model_len": self.n_ctx,
            "vocab_size": self.n_vocab,
            "eos_token_id": self.eos,
            "chat_template_sha256": hashlib.sha256(template.encode("utf-8")).hexdigest() if template else None,
        }

    def piece(self, token: int, special: bool) -> bytes:
        """The bytes of one token, exactly (llama-cpp-python's own ``detokenize`` drops a leading
        space after a BOS token, which the model's tokenizer does not)."""
        import llama_cpp

        key = (token, special)
        cached = self._pieces.get(key)
        if cached is not None:
            return cached
        size = 64
        while True:
            buffer = ctypes.create_string_buffer(size)
            n = llama_cpp.llama_token_to_piece(self.llama._model.vocab, token, buffer, size, 0, special)
            if n >= 0:
                break
            size = -n
        self._pieces[key] = buffer.raw[:n]
        return self._pieces[key]

    def detokenize(self, ids: Sequence[int], *, skip_special_tokens: bool) -> str:
        return b"".join(self.piece(token, not skip_special_tokens) for token in ids).decode("utf-8", errors="replace")

    def tokenize(self, text: str) -> list[int]:
        return [int(t) for t in self.llama.tokenize(text.encode("utf-8"), add_bos=False, special=True)]

    def _logits(self) -> Any:
        import numpy as np

        pointer = self.llama._ctx.get_logits_ith(-1)
        return np.ctypeslib.as_array(pointer, shape=(self.n_vocab,)).copy()

    def generate(self, request: TokenRequest) -> dict[str, Any]:
        import numpy as np

        prompt = request.input_ids
        rng = np.random.Generator(np.random.PCG64(request.seed))
        with self.lock:
            cached = self.llama.input_ids[: self.llama.n_tokens].tolist() if self.prefix_cache else []
            # At least the prompt's last token is evaluated: its logits are the first step's.
            reuse = min(_common_prefix(cached, prompt), len(prompt) - 1)
            self.llama.n_tokens = reuse
            self.llama.eval(prompt[reuse:])
            ids: list[int] = []
            log_probs: list[float] = []
            finish: dict[str, Any] = {"type": "length", "length": request.max_new_tokens}
            visible_end: int | None = None
            while len(ids) < request.max_new_tokens:
                token, value = sample_next(
                    self._logits(), temperature=request.temperature, top_p=request.top_p, top_k=request.top_k, rng=rng
                )
                ids.append(token)
                log_probs.append(value)
                if token in request.stop_token_ids or (token == self.eos and not request.ignore_eos):
                    finish = {"type": "stop", "matched": token}
                    break
                if request.stop:
                    text = self.detokenize(ids, skip_special_tokens=True)
                    hits = sorted((text.find(s), s) for s in request.stop if s in text)
                    if hits:
                        finish = {"type": "stop", "matched": hits[0][1]}
                        visible_end = None if request.no_stop_trim else hits[0][0]
                        break
                if len(ids) < request.max_new_tokens:
                    self.llama.eval([token])
        text = self.detokenize(ids, skip_special_tokens=request.skip_special_tokens)
        if visible_end is not None:
            text = self.detokenize(ids, skip_special_tokens=True)[:visible_end]
        meta: dict[str, Any] = {
            "id": request.rid or hashlib.sha256(json.dumps(prompt).encode()).hexdigest()[:32],
            "finish_reason": finish,
            "prompt_tokens": len(prompt),
            "completion_tokens": len(ids),
            "cached_tokens": reuse,
        }
        if request.return_logprob:
            meta["output_token_logprobs"] = [[value, token, None] for value, token in zip(log_probs, ids, strict=True)]
        return {"text": text, "output_ids": ids, "meta_info": meta}


def _handler(model: _Model) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            """Quiet: one line per request would flood the test's log."""

        def _answer(self, status: int, body: Any) -> None:
            payload = json.dumps(body, ensure_ascii=False).encode("utf-8")
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _error(self, status: int, message: str) -> None:
            self._answer(status, {"error": {"message": message}, "object": "error", "code": status})

        def do_GET(self) -> None:
            if self.path == "/health":
                self._answer(200, {})
            elif self.path == "/get_model_info":
                self._answer(200, model.info)
            else:
                self._error(404, f"no route GET {self.path}")

        def do_POST(self) -> None:
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            try:
                body = json.loads(raw)
            except ValueError:
                self._error(400, "the request body is not JSON")
                return
            try:
                if self.path == "/generate":
                    request = parse_token_request(body, model.n_vocab)
                    refusal = context_length_message(len(request.input_ids), request.max_new_tokens, model.n_ctx)
                    if refusal is not None:
                        raise GenerateRequestError(refusal)
                    self._answer(200, model.generate(request))
                elif self.path == "/tokenize":
                    if not isinstance(body, dict) or not isinstance(body.get("text"), str):
                        raise GenerateRequestError("text must be a string")
                    with model.lock:
                        self._answer(200, {"input_ids": model.tokenize(body["text"])})
                elif self.path == "/detokenize":
                    ids = body.get("input_ids") if isinstance(body, dict) else None
                    if not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < model.n_vocab for t in ids):
                        raise GenerateRequestError("input_ids must be a list of token ids of the model")
                    skip = body.get("skip_special_tokens", False)
                    self._answer(200, {"text": model.detokenize(ids, skip_special_tokens=bool(skip))})
                else:
                    self._error(404, f"no route POST {self.path}")
            except GenerateRequestError as exc:
                self._error(400, str(exc))

    return Handler


def serve(model: Path, *, host: str, port: int, n_ctx: int, n_threads: int, prefix_cache: bool) -> None:
    """Serve until interrupted (SIGTERM ends the process)."""
    loaded = _Model(model, n_ctx=n_ctx, n_threads=n_threads, prefix_cache=prefix_cache)
    server = ThreadingHTTPServer((host, port), _handler(loaded))
    server.daemon_threads = True
    print(f"serving {model.name} at http://{host}:{port}/generate", file=sys.stderr, flush=True)
    server.serve_forever()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, required=True, help="GGUF file")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8098)
    parser.add_argument("--n-ctx", type=int, default=8192)
    parser.add_argument("--n-threads", type=int, default=2)
    parser.add_argument("--no-prefix-cache", action="store_true", help="evaluate every prompt whole")
    args = parser.parse_args(argv)
    serve(
        args.model,
        host=args.host,
        port=args.port,
        n_ctx=args.n_ctx,
        n_threads=args.n_threads,
        prefix_cache=not args.no_prefix_cache,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
