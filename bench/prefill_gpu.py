"""What prefilling the training adapter's prompts costs on a GPU, with and without a prefix cache.

Input: the per-call lengths `bench/training_prefix.py --calls-out` wrote (a prompt's length and
the prefix a cache could reuse, under each rendering). On a CUDA device this builds a decoder of
a dense model's shape (default: Qwen3-4B's published configuration) with random bf16 weights, as
a serving engine runs a prefill: fused QKV and gate/up projections, q/k RMSNorm, rotary
positions, grouped-query attention through PyTorch's fused SDPA kernels (the math kernel is
refused) over a KV cache already holding the cached prefix, logits of the last position only.
Prefill time does not depend on the weights' values, so none are loaded.

It times N new tokens after a cached prefix of P tokens over a grid of (P, N), fits
``t = c0 + c1·N + c2·(N·P + N·(N+1)/2)`` (the linear layers scale with the new tokens, attention
with the query-key pairs), checks the fit against whole episodes timed call by call, and prints
the GPU seconds of prefill per episode for each rendering and cache:

- sent: every call prefills its whole prompt (no prefix cache);
- cached: every call reuses its common prefix with the previous call's prompt and reply;
- ideal: every call reuses the whole previous call (the prompt extends it);
- stable tools, no cache / cached: the enum-free rendering (never sent; the counterfactual).

    python bench/prefill_gpu.py CALLS.json [--out RESULT.json] [--check-episodes 8]
    python bench/prefill_gpu.py CALLS.json --flops     # no GPU: the arithmetic of each prefill

``--flops`` needs no torch: it counts each prefill's floating-point operations for the shape
(2 per weight per new token in the layers, 4·heads·head_dim per query-key pair per layer for
attention; norms, rotary and softmax left out) and divides by ``--peak-tflops`` (an H200's dense
bf16 rate by default) for a lower bound of the seconds.

No serving engine: no batching with other sequences, no paged KV cache, no CUDA graphs; a server's
prefill runs the same matrix products and attention, so the per-token cost is of this order.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

# (name, key of the prompt length, key of the reusable prefix or None for no cache)
SCENARIOS: tuple[tuple[str, str, str | None], ...] = (
    ("sent, no prefix cache", "prompt", None),
    ("prefix cache (today's prompts)", "prompt", "cached"),
    ("ideal: every call extends the last", "prompt", "ideal"),
    ("stable tools: enum-free, no cache", "stable_prompt", None),
    ("stable tools: enum-free, prefix cache", "stable_prompt", "stable_cached"),
)


@dataclass(frozen=True)
class Shape:
    """A dense decoder's dimensions (Qwen3-4B's by default)."""

    name: str = "Qwen3-4B"
    layers: int = 36
    hidden: int = 2560
    intermediate: int = 9728
    heads: int = 32
    kv_heads: int = 8
    head_dim: int = 128
    vocab: int = 151_936
    rope_theta: float = 1_000_000.0


def prefills(calls: Sequence[dict[str, int]], prompt_key: str, prefix_key: str | None) -> list[tuple[int, int]]:
    """``(cached prefix P, new tokens N)`` of each call under one scenario."""
    out = []
    for call in calls:
        prompt = call[prompt_key]
        prefix = min(call[prefix_key], prompt) if prefix_key is not None else 0
        out.append((prefix, prompt - prefix))
    return out


def layer_weights(shape: Shape) -> int:
    """Weights a new token is multiplied by in all layers (embedding and logits left out)."""
    q_dim, kv_dim = shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    per_layer = shape.hidden * (q_dim + 2 * kv_dim) + q_dim * shape.hidden + 3 * shape.hidden * shape.intermediate
    return per_layer * shape.layers


def flops(shape: Shape, p: int, n: int) -> float:
    """Floating-point operations of prefilling ``n`` new tokens after a cached prefix of ``p``."""
    if n <= 0:
        return 0.0
    attention = 4 * shape.heads * shape.head_dim * shape.layers * _pairs(p, n)
    return 2 * layer_weights(shape) * n + attention + 2 * shape.hidden * shape.vocab


def _pairs(p: int, n: int) -> float:
    return n * p + n * (n + 1) / 2


def fit_cost(points: Sequence[tuple[int, int, float]]) -> tuple[float, float, float]:
    """Least squares of ``t = c0 + c1·N + c2·pairs(P, N)``, each point weighted by 1/t so that
    short and long prefills count alike (relative error)."""
    rows = [(1.0 / t, n / t, _pairs(p, n) / t) for p, n, t in points]
    # Normal equations of the weighted system (rows · c ≈ 1), solved by Gaussian elimination.
    a = [[sum(r[i] * r[j] for r in rows) for j in range(3)] for i in range(3)]
    b = [sum(r[i] for r in rows) for i in range(3)]
    for col in range(3):
        pivot = max(range(col, 3), key=lambda i: abs(a[i][col]))
        a[col], a[pivot] = a[pivot], a[col]
        b[col], b[pivot] = b[pivot], b[col]
        for i in range(col + 1, 3):
            f = a[i][col] / a[col][col]
            a[i] = [x - f * y for x, y in zip(a[i], a[col], strict=True)]
            b[i] -= f * b[col]
    c = [0.0, 0.0, 0.0]
    for i in (2, 1, 0):
        c[i] = (b[i] - sum(a[i][j] * c[j] for j in range(i + 1, 3))) / a[i][i]
    return c[0], c[1], c[2]


def predict(coefficients: tuple[float, float, float], p: int, n: int) -> float:
    if n <= 0:
        return 0.0
    c0, c1, c2 = coefficients
    return c0 + c1 * n + c2 * _pairs(p, n)


def episode_seconds(episodes: Sequence[Sequence[dict[str, int]]], cost: Callable[[int, int], float]) -> dict[str, float]:
    """Mean GPU seconds of prefill per episode for each scenario."""
    return {
        name: sum(sum(cost(p, n) for p, n in prefills(calls, prompt, prefix)) for calls in episodes) / len(episodes)
        for name, prompt, prefix in SCENARIOS
    }


def grid(longest: int) -> list[tuple[int, int]]:
    """(P, N) points covering prompts up to ``longest`` tokens."""
    top = 1 << max(10, math.ceil(math.log2(longest)))
    news = sorted({64, 256, 1024, *(1 << k for k in range(12, top.bit_length())), longest})
    prefixes = sorted({0, 2048, *(1 << k for k in range(13, top.bit_length()))})
    return [(p, n) for p in prefixes for n in news if p + n <= longest + 2048]


# --------------------------------------------------------------------------- the GPU part


class Decoder:
    """The prefill of a dense decoder with random weights and a preallocated KV cache."""

    def __init__(self, shape: Shape, capacity: int, device: str) -> None:
        import torch

        self.torch = torch
        self.shape = shape
        self.device = device
        self.warm = False
        dtype = torch.bfloat16
        gen = torch.Generator(device=device).manual_seed(0)

        def weight(*dims: int) -> Any:
            return (torch.randn(*dims, generator=gen, device=device, dtype=torch.float32) * 0.02).to(dtype)

        s = shape
        q_dim, kv_dim = s.heads * s.head_dim, s.kv_heads * s.head_dim
        self.embed = weight(s.vocab, s.hidden)
        self.layers = [
            {
                "norm1": torch.ones(s.hidden, device=device, dtype=dtype),
                "qkv": weight(s.hidden, q_dim + 2 * kv_dim),
                "q_norm": torch.ones(s.head_dim, device=device, dtype=dtype),
                "k_norm": torch.ones(s.head_dim, device=device, dtype=dtype),
                "o": weight(q_dim, s.hidden),
                "norm2": torch.ones(s.hidden, device=device, dtype=dtype),
                "gate_up": weight(s.hidden, 2 * s.intermediate),
                "down": weight(s.intermediate, s.hidden),
                "k_cache": weight(1, s.kv_heads, capacity, s.head_dim),
                "v_cache": weight(1, s.kv_heads, capacity, s.head_dim),
            }
            for _ in range(s.layers)
        ]
        self.final_norm = torch.ones(s.hidden, device=device, dtype=dtype)
        inv = 1.0 / (s.rope_theta ** (torch.arange(0, s.head_dim, 2, device=device, dtype=torch.float32) / s.head_dim))
        angles = torch.outer(torch.arange(capacity, device=device, dtype=torch.float32), inv)
        self.cos, self.sin = angles.cos().to(dtype), angles.sin().to(dtype)

    def _rope(self, x: Any, start: int) -> Any:
        n = x.shape[2]
        cos, sin = self.cos[start : start + n], self.sin[start : start + n]
        half = x.shape[-1] // 2
        x1, x2 = x[..., :half], x[..., half:]
        return self.torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)

    def prefill(self, prefix: int, new: int) -> Any:
        """Logits of the last of ``new`` tokens whose first ``prefix`` positions are cached."""
        torch = self.torch
        from torch.nn import functional
        from torch.nn.attention import SDPBackend, sdpa_kernel
        from torch.nn.attention.bias import causal_lower_right

        s = self.shape
        q_dim, kv_dim = s.heads * s.head_dim, s.kv_heads * s.head_dim
        ids = torch.randint(0, s.vocab, (new,), device=self.device)
        x = self.embed[ids]
        end = prefix + new
        mask = causal_lower_right(new, end)
        group = s.heads // s.kv_heads
        backends = [SDPBackend.FLASH_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION]
        if self.device == "cpu":
            backends.append(SDPBackend.MATH)
        for layer in self.layers:
            h = functional.rms_norm(x, (s.hidden,), layer["norm1"], 1e-6)
            q, k, v = (h @ layer["qkv"]).split((q_dim, kv_dim, kv_dim), dim=-1)
            q = functional.rms_norm(q.view(new, s.heads, s.head_dim), (s.head_dim,), layer["q_norm"], 1e-6)
            k = functional.rms_norm(k.view(new, s.kv_heads, s.head_dim), (s.head_dim,), layer["k_norm"], 1e-6)
            q = self._rope(q.transpose(0, 1).unsqueeze(0), prefix)
            layer["k_cache"][:, :, prefix:end] = self._rope(k.transpose(0, 1).unsqueeze(0), prefix)
            layer["v_cache"][:, :, prefix:end] = v.view(new, s.kv_heads, s.head_dim).transpose(0, 1).unsqueeze(0)
            keys = layer["k_cache"][:, :, :end].repeat_interleave(group, dim=1)
            values = layer["v_cache"][:, :, :end].repeat_interleave(group, dim=1)
            with sdpa_kernel(backends):
                attended = functional.scaled_dot_product_attention(q, keys, values, attn_mask=mask)
            x = x + attended.squeeze(0).transpose(0, 1).reshape(new, q_dim) @ layer["o"]
            h = functional.rms_norm(x, (s.hidden,), layer["norm2"], 1e-6)
            gate, up = (h @ layer["gate_up"]).split(s.intermediate, dim=-1)
            x = x + (functional.silu(gate) * up) @ layer["down"]
        last = functional.rms_norm(x[-1:], (s.hidden,), self.final_norm, 1e-6)
        return last @ self.embed.T

    def seconds(self, prefix: int, new: int, repeats: int) -> float:
        """Median wall seconds of ``repeats`` synchronised prefills (the first call also warms
        the kernels up, untimed)."""
        if new <= 0:
            return 0.0
        torch = self.torch
        times = []
        with torch.no_grad():
            if not self.warm:
                self.prefill(prefix, new)
                self.warm = True
            for _ in range(repeats):
                if self.device != "cpu":
                    torch.cuda.synchronize()
                started = time.perf_counter()
                self.prefill(prefix, new)
                if self.device != "cpu":
                    torch.cuda.synchronize()
                times.append(time.perf_counter() - started)
        return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("calls", type=Path, help="the file bench/training_prefix.py --calls-out wrote")
    parser.add_argument("--out", type=Path, help="write the grid, the fit and the results (JSON)")
    parser.add_argument("--check-episodes", type=int, default=8, help="episodes timed call by call")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--tiny", action="store_true", help="a 2-layer toy shape (to try the script on a CPU)")
    parser.add_argument("--flops", action="store_true", help="count each prefill's operations; no GPU")
    parser.add_argument("--peak-tflops", type=float, default=790.0, help="the rate --flops divides by")
    args = parser.parse_args(argv)

    document = json.loads(args.calls.read_text(encoding="utf-8"))
    episodes: list[list[dict[str, int]]] = document["episodes"]
    shape = (
        Shape(name="tiny", layers=2, hidden=64, intermediate=128, heads=4, kv_heads=2, head_dim=16, vocab=512)
        if args.tiny
        else Shape()
    )
    longest = max(max(call["prompt"], call["stable_prompt"]) for calls in episodes for call in calls)
    if args.flops:
        counted = episode_seconds(episodes, lambda p, n: flops(shape, p, n))
        ideal = counted[SCENARIOS[2][0]]
        print(f"{shape.name} shape ({layer_weights(shape) / 1e9:.2f} B layer weights), {len(episodes)} episodes, "
              f"prompts up to {longest} tokens ({document.get('tokenizer')})")  # fmt: skip
        print(f"prefill per episode{'':<34}TFLOP   ratio   s at {args.peak_tflops:.0f} TFLOP/s")
        for name, *_ in SCENARIOS:
            seconds = counted[name] / (args.peak_tflops * 1e12)
            print(f"  {name:<48}{counted[name] / 1e12:>8.1f}   {counted[name] / ideal:>5.2f}   {seconds:>8.3f}")
        return 0

    import torch

    device_name = torch.cuda.get_device_name() if args.device == "cuda" else args.device
    decoder = Decoder(shape, capacity=longest + 4096, device=args.device)
    print(f"{shape.name} shape, bf16 random weights, on {device_name}, torch {torch.__version__}; "
          f"{len(episodes)} episodes, prompts up to {longest} tokens")  # fmt: skip

    measured = []
    for p, n in grid(longest):
        t = decoder.seconds(p, n, args.repeats)
        measured.append((p, n, t))
        print(f"  P {p:>6}  N {n:>6}  {t * 1e3:9.2f} ms  {n / t:>10.0f} new tokens/s")
    coefficients = fit_cost(measured)
    worst = max(abs(predict(coefficients, p, n) - t) / t for p, n, t in measured)
    print(f"fit: c0 {coefficients[0] * 1e3:.3f} ms, c1 {coefficients[1] * 1e9:.2f} ns/token, "
          f"c2 {coefficients[2] * 1e12:.4f} ps/pair; worst grid point off by {worst:.1%}")  # fmt: skip

    step = max(1, len(episodes) // max(args.check_episodes, 1))
    checked = episodes[::step][: args.check_episodes]
    direct = episode_seconds(checked, lambda p, n: decoder.seconds(p, n, 1))
    fitted = episode_seconds(checked, lambda p, n: predict(coefficients, p, n))
    print(f"check on {len(checked)} episodes timed call by call (seconds per episode: timed / fit):")
    for name, *_ in SCENARIOS:
        print(f"  {name:<40}{direct[name]:>8.3f} / {fitted[name]:.3f}  ({fitted[name] / direct[name] - 1:+.1%})")

    results = episode_seconds(episodes, lambda p, n: predict(coefficients, p, n))
    ideal = results[SCENARIOS[2][0]]
    print(f"GPU seconds of prefill per episode (fit, all {len(episodes)} episodes)   seconds   ratio to ideal")
    for name, *_ in SCENARIOS:
        print(f"  {name:<52}{results[name]:>8.3f}   {results[name] / ideal:>6.2f}")
    if args.out is not None:
        args.out.write_text(
            json.dumps(
                {
                    "shape": asdict(shape),
                    "device": device_name,
                    "torch": torch.__version__,
                    "tokenizer": document.get("tokenizer"),
                    "grid": [{"prefix": p, "new": n, "seconds": t} for p, n, t in measured],
                    "fit": coefficients,
                    "check": {"episodes": len(checked), "timed": direct, "fit": fitted},
                    "per_episode_seconds": results,
                },
                indent=1,
            ),
            encoding="utf-8",
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
