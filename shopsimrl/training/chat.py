"""What the training adapter needs of a tokenizer and chat template, and the reply parser.

:class:`ChatTokenizer` is the small interface: the testbed's tokenizer and template
(``shopsimrl.testbed.chat_tokens.TestbedChatTokenizer``) satisfy it, and a Hugging Face tokenizer
can be wrapped to (``apply_chat_template(messages, tools=tools, add_generation_prompt=True,
tokenize=True)`` and ``decode``). The adapter never re-tokenizes a reply: what the trainer sees are
the ids the server sampled; the text is decoded from them only to find the tool call in it.

:func:`parse_reply` reads a reply in the Qwen / Hermes shape the chat template asks for: an
optional ``<think>…</think>`` block first (the thinking), then visible text and
``<tool_call>{"name": …, "arguments": {…}}</tool_call>`` blocks. A block that is not that JSON
object stays in the visible text, so the engine's protocol checks see it (``tool_call_count``),
as they would see an OpenAI server's unparsed reply. The arguments are kept as
``json.dumps(arguments, ensure_ascii=False)``: what the template renders back, and what a
server's tool parser hands on.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

__all__ = ["ChatTokenizer", "ParsedReply", "parse_reply"]


@runtime_checkable
class ChatTokenizer(Protocol):
    """A tokenizer with its chat template."""

    eos_token_id: int

    def render(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, *, add_generation_prompt: bool = True
    ) -> list[int]:
        """The prompt ids of ``messages`` with ``tools`` (the template's tools block)."""
        ...

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str: ...

    def identity(self) -> dict[str, Any]:
        """JSON-safe: which tokenizer and template (recorded beside the samples)."""
        ...


@dataclass
class ParsedReply:
    content: str | None
    reasoning: str | None
    calls: list[tuple[str, str]] = field(default_factory=list)
    """(name, arguments as JSON text) per call, in order."""


_THINK_OPEN = "<think>"
_THINK_CLOSE = "</think>"
_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def parse_reply(text: str) -> ParsedReply:
    reasoning: str | None = None
    rest = text
    if _THINK_CLOSE in rest:
        thought, _, rest = rest.partition(_THINK_CLOSE)
        reasoning = thought.strip().removeprefix(_THINK_OPEN).strip()
    elif rest.lstrip().startswith(_THINK_OPEN):  # cut off while thinking: all of it is thinking
        reasoning, rest = rest.lstrip()[len(_THINK_OPEN) :].strip(), ""
    calls: list[tuple[str, str]] = []
    kept: list[str] = []
    last = 0
    for match in _CALL.finditer(rest):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if not isinstance(call, dict) or not isinstance(call.get("name"), str):
            continue
        arguments = call.get("arguments", {})
        # Some models write the arguments as a JSON string: kept as written.
        raw = arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)
        kept.append(rest[last : match.start()])
        last = match.end()
        calls.append((call["name"], raw))
    kept.append(rest[last:])
    content = "".join(kept).strip()
    return ParsedReply(content=content or None, reasoning=reasoning or None, calls=calls)
