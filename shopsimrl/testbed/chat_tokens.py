"""The testbed's tokenizer and its Qwen-style chat template, for the token endpoint (``/generate``).

A training rollout needs the exact token ids a model sampled, so the testbed's token endpoint
speaks ids, and both sides (the endpoint and the adapter under test) need one tokenizer and one
chat template. This module is that pair, deterministic and dependency-free:

**Tokenizer** (:class:`ByteTokenizer`): byte-level. Ids 0–255 are the UTF-8 bytes; three special
tokens follow: ``<|endoftext|>`` (256), ``<|im_start|>`` (257), ``<|im_end|>`` (258, the end of a
turn and the token a reply stops on). Encoding splits the text at the special tokens' spellings
and takes every other part's UTF-8 bytes, so ``decode(encode(s)) == s`` for every valid Unicode
string (any script, Chinese included); a lone surrogate (not valid Unicode) is refused with its
index. Decoding a sequence that ends inside a multi-byte character (a reply cut by the token
limit) gives U+FFFD for the incomplete bytes, as real tokenizers do. Chinese text costs three
tokens a character, more than a real model's vocabulary: counts here are not a real model's.

**Chat template** (:class:`ChatTemplate`), shaped like Qwen's (ChatML turns, the tools block at the
top of the system turn, ``<tool_call>`` JSON blocks, tool results as ``<tool_response>`` blocks in a
user turn), in this project's own wording::

    <|im_start|>system
    {system text}

    # Tools
    Call functions by writing one JSON object {"name": ..., "arguments": {...}} inside
    <tool_call></tool_call> tags. Available functions, one JSON signature a line:
    <tools>
    {tool 1 as JSON}
    {tool 2 as JSON}
    </tools><|im_end|>
    <|im_start|>user
    {text}<|im_end|>
    <|im_start|>assistant
    {content, then per call: "\\n" (unless first and no content)}<tool_call>
    {"name": "click", "arguments": {"value": "购买"}}
    </tool_call><|im_end|>
    <|im_start|>user
    <tool_response>
    {tool result}
    </tool_response><|im_end|>
    <|im_start|>assistant
    {generation starts here}

Consecutive tool messages share one user turn. An assistant message's ``reasoning_content`` is
not rendered (as Qwen3's template drops the thinking of earlier turns), so a reply that thought
aloud is not a prefix of the next prompt: the trajectory forks there. A call's ``arguments``
string is rendered as sent (an object as compact-free ``json.dumps``), so a reply written in the
canonical form re-renders to the same tokens. :meth:`ChatTemplate.parse` inverts the rendering
(what the testbed's policy needs to decide from ids); text that itself spells a special token or
a ``</tool_response>`` tag is not told apart from the template's own.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

__all__ = [
    "END_OF_TEXT",
    "IM_END",
    "IM_START",
    "ByteTokenizer",
    "ChatTemplate",
    "ParsedPrompt",
    "TemplateParseError",
    "TestbedChatTokenizer",
]

END_OF_TEXT = 256
IM_START = 257
IM_END = 258
SPECIAL_TOKENS: dict[str, int] = {"<|endoftext|>": END_OF_TEXT, "<|im_start|>": IM_START, "<|im_end|>": IM_END}
_SPECIAL_TEXT = {token_id: text for text, token_id in SPECIAL_TOKENS.items()}
_SPECIAL_SPLIT = re.compile("(" + "|".join(re.escape(text) for text in SPECIAL_TOKENS) + ")")

TOOLS_HEADER = (
    "\n\n# Tools\n"
    'Call functions by writing one JSON object {"name": ..., "arguments": {...}} inside '
    "<tool_call></tool_call> tags. Available functions, one JSON signature a line:\n<tools>\n"
)
TOOLS_FOOTER = "\n</tools>"
TOOL_CALL_OPEN = "<tool_call>\n"
TOOL_CALL_CLOSE = "\n</tool_call>"
TOOL_RESPONSE_OPEN = "<tool_response>\n"
TOOL_RESPONSE_CLOSE = "\n</tool_response>"
TEMPLATE_VERSION = "testbed-chatml-tools-v1"


class TemplateParseError(ValueError):
    """The ids are not a prompt this template renders; the message says where."""


class ByteTokenizer:
    """UTF-8 bytes plus three special tokens (module docstring)."""

    vocab_size = 259
    eos_token_id = IM_END

    def encode(self, text: str) -> list[int]:
        ids: list[int] = []
        for part in _SPECIAL_SPLIT.split(text):
            special = SPECIAL_TOKENS.get(part)
            if special is not None:
                ids.append(special)
            elif part:
                try:
                    ids.extend(part.encode("utf-8"))
                except UnicodeEncodeError as exc:
                    raise ValueError(f"text is not valid Unicode: a lone surrogate at index {exc.start} of a segment") from None
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        out: list[str] = []
        run = bytearray()
        for position, token in enumerate(ids):
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
                raise ValueError(
                    f"token id at position {position} is not in the vocabulary (0..{self.vocab_size - 1}): {token!r}"
                )
            if token < 256:
                run.append(token)
                continue
            out.append(run.decode("utf-8", errors="replace"))
            run.clear()
            if not skip_special_tokens:
                out.append(_SPECIAL_TEXT[token])
        out.append(run.decode("utf-8", errors="replace"))
        return "".join(out)

    def identity(self) -> dict[str, Any]:
        return {"tokenizer": "testbed-byte-v1", "vocab_size": self.vocab_size, "special_tokens": dict(SPECIAL_TOKENS)}


@dataclass
class ParsedPrompt:
    """What a rendered prompt says: OpenAI-style messages and tools, and whether it ends in a
    generation prompt (an open assistant turn)."""

    messages: list[dict[str, Any]] = field(default_factory=list)
    tools: list[dict[str, Any]] = field(default_factory=list)
    generation_prompt: bool = False


def _call_text(call: dict[str, Any]) -> str:
    inner = call.get("function")
    function: dict[str, Any] = inner if isinstance(inner, dict) else call
    name = function.get("name")
    arguments = function.get("arguments")
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments if arguments is not None else {}, ensure_ascii=False)
    return (
        TOOL_CALL_OPEN
        + '{"name": '
        + json.dumps(name, ensure_ascii=False)
        + ', "arguments": '
        + arguments
        + "}"
        + TOOL_CALL_CLOSE
    )


def _text(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # OpenAI content parts
        return "".join(part.get("text", "") for part in content if isinstance(part, dict))
    return str(content)


class ChatTemplate:
    """Renders messages and tools as text in the shape of the module docstring, and parses it back."""

    version = TEMPLATE_VERSION

    def render(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, *, add_generation_prompt: bool
    ) -> str:
        parts: list[str] = []
        system = ""
        rest = list(messages)
        if rest and rest[0].get("role") == "system":
            system = _text(rest.pop(0).get("content"))
        if tools:
            lines = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
            system = system + TOOLS_HEADER + lines + TOOLS_FOOTER
        if system or tools:
            parts.append(f"<|im_start|>system\n{system}<|im_end|>\n")
        index = 0
        while index < len(rest):
            message = rest[index]
            role = message.get("role")
            if role == "tool":
                responses = []
                while index < len(rest) and rest[index].get("role") == "tool":
                    responses.append(TOOL_RESPONSE_OPEN + _text(rest[index].get("content")) + TOOL_RESPONSE_CLOSE)
                    index += 1
                parts.append("<|im_start|>user\n" + "\n".join(responses) + "<|im_end|>\n")
                continue
            if role == "assistant":
                body = _text(message.get("content"))
                for position, call in enumerate(message.get("tool_calls") or []):
                    if position > 0 or body:
                        body += "\n"
                    body += _call_text(call)
                parts.append(f"<|im_start|>assistant\n{body}<|im_end|>\n")
            elif role in ("user", "system"):
                parts.append(f"<|im_start|>{role}\n{_text(message.get('content'))}<|im_end|>\n")
            else:
                raise ValueError(f"messages[{index}] has role {role!r}; the template knows system, user, assistant, tool")
            index += 1
        if add_generation_prompt:
            parts.append("<|im_start|>assistant\n")
        return "".join(parts)

    def parse(self, text: str) -> ParsedPrompt:
        """The messages and tools a rendered prompt holds (tool-call ids are not rendered: the
        parsed calls get ``call_<turn>_<n>``)."""
        parsed = ParsedPrompt()
        turns = text.split("<|im_start|>")
        if turns[0]:
            raise TemplateParseError(f"the prompt must start with <|im_start|>, got {turns[0][:40]!r}")
        for number, turn in enumerate(turns[1:], start=1):
            role, newline, body = turn.partition("\n")
            if not newline:
                raise TemplateParseError(f"turn {number} has no newline after its role {role[:20]!r}")
            if number == len(turns) - 1 and role == "assistant" and body == "":
                parsed.generation_prompt = True
                break
            if not body.endswith("<|im_end|>\n") and not (number == len(turns) - 1 and body.endswith("<|im_end|>")):
                raise TemplateParseError(f"turn {number} ({role}) does not end with <|im_end|>")
            body = body[: body.rindex("<|im_end|>")]
            if role == "system":
                system, header, tools = body.partition(TOOLS_HEADER)
                if header:
                    if not tools.endswith(TOOLS_FOOTER):
                        raise TemplateParseError("the tools block of the system turn does not end with </tools>")
                    for line_number, line in enumerate(tools[: -len(TOOLS_FOOTER)].split("\n"), start=1):
                        try:
                            parsed.tools.append(json.loads(line))
                        except ValueError:
                            raise TemplateParseError(f"tools line {line_number} is not JSON: {line[:60]!r}") from None
                if system or not header:
                    parsed.messages.append({"role": "system", "content": system})
            elif role == "user" and body.startswith(TOOL_RESPONSE_OPEN) and body.endswith(TOOL_RESPONSE_CLOSE):
                inner = body[len(TOOL_RESPONSE_OPEN) : -len(TOOL_RESPONSE_CLOSE)]
                for piece in inner.split(TOOL_RESPONSE_CLOSE + "\n" + TOOL_RESPONSE_OPEN):
                    parsed.messages.append({"role": "tool", "content": piece})
            elif role == "assistant":
                content, calls = split_tool_calls(body)
                message: dict[str, Any] = {"role": "assistant", "content": content or None}
                if calls:
                    message["tool_calls"] = [
                        {"id": f"call_{number}_{n}", "type": "function", "function": {"name": name, "arguments": arguments}}
                        for n, (name, arguments) in enumerate(calls)
                    ]
                parsed.messages.append(message)
            elif role == "user":
                parsed.messages.append({"role": "user", "content": body})
            else:
                raise TemplateParseError(f"turn {number} has unknown role {role[:20]!r}")
        return parsed


_CALL_BLOCK = re.compile(r"\n?<tool_call>\n(.*?)\n</tool_call>", re.DOTALL)


def split_tool_calls(body: str) -> tuple[str, list[tuple[str, str]]]:
    """An assistant turn's text → (text outside the call blocks, [(name, arguments JSON)]). A block
    that is not ``{"name": str, "arguments": object}`` stays in the text."""
    calls: list[tuple[str, str]] = []
    kept: list[str] = []
    last = 0
    for match in _CALL_BLOCK.finditer(body):
        try:
            call = json.loads(match.group(1))
        except ValueError:
            continue
        if not (isinstance(call, dict) and isinstance(call.get("name"), str) and isinstance(call.get("arguments"), dict)):
            continue
        kept.append(body[last : match.start()])
        last = match.end()
        calls.append((call["name"], json.dumps(call["arguments"], ensure_ascii=False)))
    kept.append(body[last:])
    return "".join(kept), calls


class TestbedChatTokenizer:
    """The tokenizer and the template together: messages and tools → prompt ids, ids → text.
    This is the shape the training adapter asks of a tokenizer (``shopsimrl.training.chat``)."""

    __test__ = False  # not a pytest class, whatever its name

    def __init__(self) -> None:
        self.tokenizer = ByteTokenizer()
        self.template = ChatTemplate()
        self.eos_token_id = self.tokenizer.eos_token_id

    def render(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, *, add_generation_prompt: bool = True
    ) -> list[int]:
        return self.tokenizer.encode(self.template.render(messages, tools, add_generation_prompt=add_generation_prompt))

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text)

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)

    def parse(self, ids: Sequence[int]) -> ParsedPrompt:
        return self.template.parse(self.tokenizer.decode(ids))

    def identity(self) -> dict[str, Any]:
        return {**self.tokenizer.identity(), "chat_template": self.template.version}
