"""The production chat tokenizer: a Hugging Face tokenizer and the model's own chat template.

A training rollout renders every prompt itself (:class:`~shopsimrl.training.chat.ChatTokenizer`),
so the ids it sends must be the ids the model's server would have built from the same
conversation, or training would see prompts evaluation never shows. :class:`HfChatTokenizer` is
that tokenizer for a real model: ``AutoTokenizer.from_pretrained(path)`` — the call slime makes on
``--hf-checkpoint`` (``slime.utils.processing_utils.load_tokenizer``) — and the chat template that
directory ships, never one of the project's own.

What it renders is what SGLang's OpenAI endpoint renders for the same request (its
``serving_chat._apply_jinja_template``), so a model evaluated through ``/v1/chat/completions`` and
trained through ``/generate`` sees the same text: each message is copied, a ``content`` of null
becomes ``""`` (templates concatenate it), a tool call's ``arguments`` JSON string becomes the
object it spells (tool-use templates render it with ``tojson``; a string that is not a JSON object
is left as written), and ``apply_chat_template(messages, tools=tools or None,
add_generation_prompt=True, tokenize=True)`` gives the ids. A template that cannot render the
conversation raises :class:`ChatTemplateError` naming the tokenizer; the rollout fails as an
infrastructure error, never with a made-up prompt.

transformers is imported only when a tokenizer is loaded: slime's process has it; elsewhere it
comes with the project's test extra (no torch needed for a tokenizer). :meth:`HfChatTokenizer.
identity` names the directory and the transformers version and fingerprints the vocabulary and the
template (SHA-256), so samples record exactly which tokenizer and template made their prompts.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
from collections.abc import Mapping, Sequence
from typing import Any

from shopsimrl.config import ConfigError

__all__ = ["ChatTemplateError", "HfChatTokenizer", "chat_messages"]


class ChatTemplateError(ValueError):
    """The model's chat template could not render a conversation."""


def _arguments(value: Any) -> Any:
    if not isinstance(value, str):
        return value
    try:
        parsed = json.loads(value)
    except ValueError:
        return value
    return parsed if isinstance(parsed, dict) else value


def chat_messages(messages: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """The messages as SGLang hands them to the chat template (module docstring); the input is
    not modified."""
    out: list[dict[str, Any]] = []
    for message in messages:
        copied = copy.deepcopy(dict(message))
        if copied.get("content") is None:
            copied["content"] = ""
        calls = copied.get("tool_calls")
        if copied.get("role") == "assistant" and isinstance(calls, list):
            for call in calls:
                function = call.get("function") if isinstance(call, dict) else None
                if isinstance(function, dict) and "arguments" in function:
                    function["arguments"] = _arguments(function["arguments"])
        out.append(copied)
    return out


def _digest(value: Any) -> str:
    return hashlib.sha256(json.dumps(value, ensure_ascii=False, sort_keys=True).encode("utf-8")).hexdigest()


class HfChatTokenizer:
    """A loaded Hugging Face tokenizer with its chat template (module docstring)."""

    def __init__(self, tokenizer: Any, *, source: str, transformers_version: str | None = None) -> None:
        template = getattr(tokenizer, "chat_template", None)
        if not template or not isinstance(template, (str, dict)):
            raise ConfigError(
                f"the tokenizer at {source} has no chat template (tokenizer_config.json 'chat_template' or "
                "chat_template.jinja); the prompts must be rendered with the model's own template"
            )
        eos = getattr(tokenizer, "eos_token_id", None)
        if isinstance(eos, bool) or not isinstance(eos, int):
            raise ConfigError(f"the tokenizer at {source} has no eos_token_id")
        self.tokenizer = tokenizer
        self.source = source
        self.eos_token_id: int = eos
        self._identity: dict[str, Any] = {
            "tokenizer": "hf",
            "name_or_path": source,
            "class": type(tokenizer).__name__,
            "transformers": transformers_version,
            "vocab_size": len(tokenizer),
            "vocab_sha256": _digest(sorted(tokenizer.get_vocab().items(), key=lambda item: item[1])),
            "eos_token_id": eos,
            "chat_template_sha256": hashlib.sha256(template.encode("utf-8")).hexdigest()
            if isinstance(template, str)
            else _digest(template),
        }

    @classmethod
    def load(cls, path: str, *, trust_remote_code: bool = False) -> HfChatTokenizer:
        """``AutoTokenizer.from_pretrained(path)``; :class:`ConfigError` naming the path (or the
        missing transformers) otherwise."""
        try:
            transformers: Any = importlib.import_module("transformers")
        except ImportError as exc:
            raise ConfigError(
                f"model.tokenizer 'hf' needs the transformers package ({exc}); slime's process has it, elsewhere "
                "install it (pip install transformers; no torch is needed for a tokenizer)"
            ) from None
        try:
            tokenizer = transformers.AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ConfigError(f"cannot load a Hugging Face tokenizer from {path}: {exc}") from None
        return cls(tokenizer, source=str(path), transformers_version=getattr(transformers, "__version__", None))

    def render(
        self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None, *, add_generation_prompt: bool = True
    ) -> list[int]:
        try:
            ids = self.tokenizer.apply_chat_template(
                chat_messages(messages),
                tools=[dict(tool) for tool in tools] if tools else None,
                add_generation_prompt=add_generation_prompt,
                tokenize=True,
                return_dict=False,
            )
        except Exception as exc:  # jinja2's errors, and a template's raise_exception(...)
            raise ChatTemplateError(f"the chat template of {self.source} cannot render the conversation: {exc}") from exc
        if isinstance(ids, Mapping):  # some versions answer a BatchEncoding whatever return_dict says
            ids = ids["input_ids"]
        return [int(token) for token in ids]

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = False) -> str:
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def identity(self) -> dict[str, Any]:
        return dict(self._identity)
