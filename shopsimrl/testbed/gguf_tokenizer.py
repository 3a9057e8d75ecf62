"""A GGUF model's tokenizer and chat template as a Hugging Face tokenizer directory.

The training adapter renders prompts with a Hugging Face tokenizer (``AutoTokenizer`` over a
checkpoint directory, as slime loads ``--hf-checkpoint``): :class:`shopsimrl.training.hf_tokenizer.
HfChatTokenizer`. The real model of the tests is SmolLM2-135M as a GGUF file served by llama.cpp
(:mod:`shopsimrl.testbed.llm_tokens`), and transformers reads a GGUF's tokenizer only with torch
installed (``AutoTokenizer.from_pretrained(dir, gguf_file=...)`` imports it, in 4.57 and 5.x alike),
which the project does not install. :func:`export_hf_tokenizer` therefore writes the GGUF's own
tokenizer (vocabulary, merges, special tokens) and chat template into a directory that
``AutoTokenizer.from_pretrained`` loads without torch:

- ``tokenizer.json``: a byte-level BPE (``tokenizers``) with the GGUF's vocabulary and merges, in
  order; its pre-tokenizer is the one llama.cpp applies for the GGUF's ``tokenizer.ggml.pre``
  (``smollm``: every digit apart, then GPT-2's split; ``gpt2``: GPT-2's split); tokens of type
  CONTROL are special tokens (left out by ``decode(skip_special_tokens=True)``, as llama.cpp leaves
  them out of a text), USER_DEFINED ones are added tokens;
- ``tokenizer_config.json``: the chat template (``tokenizer.chat_template``) verbatim, the BOS,
  EOS, unknown and padding tokens, no BOS added (``add_bos_token`` of the GGUF is false), the
  context length.

Only byte-level BPE (``tokenizer.ggml.model == "gpt2"``) with those two pre-tokenizers is
converted; any other is refused by name, never approximated. The conversion claims no more than it
is checked for: the ``llm`` tests hold the exported tokenizer against llama.cpp's own on every
prompt of their episodes (the same ids for the same text, the same text for the same ids).

Needs the ``gguf`` and ``tokenizers`` packages (the project's test extra has both).
"""

from __future__ import annotations

import importlib
import json
from pathlib import Path
from typing import Any

__all__ = ["GgufTokenizerError", "export_hf_tokenizer"]

CONTROL = 3
USER_DEFINED = 4
_PRE_TOKENIZERS = ("smollm", "gpt2")


class GgufTokenizerError(ValueError):
    """The GGUF has no tokenizer this module converts exactly; the message names the field."""


def _field(reader: Any, key: str, path: Path, *, required: bool = True) -> Any:
    field = reader.fields.get(key)
    if field is None:
        if required:
            raise GgufTokenizerError(f"{path}: the GGUF has no {key}")
        return None
    return field.contents()


def export_hf_tokenizer(gguf_path: str | Path, out_dir: str | Path) -> Path:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` for the GGUF's tokenizer into
    ``out_dir`` (created); returns it."""
    gguf = importlib.import_module("gguf")
    tokenizers = importlib.import_module("tokenizers")
    path = Path(gguf_path)
    reader = gguf.GGUFReader(str(path))
    kind = _field(reader, "tokenizer.ggml.model", path)
    if kind != "gpt2":
        raise GgufTokenizerError(f"{path}: tokenizer.ggml.model is {kind!r}; only byte-level BPE ('gpt2') is converted")
    pre = _field(reader, "tokenizer.ggml.pre", path, required=False) or "gpt2"
    if pre not in _PRE_TOKENIZERS:
        raise GgufTokenizerError(f"{path}: tokenizer.ggml.pre is {pre!r}; only {list(_PRE_TOKENIZERS)} are converted")
    tokens: list[str] = _field(reader, "tokenizer.ggml.tokens", path)
    types: list[int] = _field(reader, "tokenizer.ggml.token_type", path)
    merges: list[str] = _field(reader, "tokenizer.ggml.merges", path)
    template = _field(reader, "tokenizer.chat_template", path)
    if len(types) != len(tokens):
        raise GgufTokenizerError(f"{path}: {len(tokens)} tokens but {len(types)} token types")
    if len(set(tokens)) != len(tokens):
        raise GgufTokenizerError(f"{path}: tokenizer.ggml.tokens has duplicates; ids would not round-trip")
    pairs: list[tuple[str, str]] = []
    for number, merge in enumerate(merges):
        left, space, right = merge.partition(" ")
        if not space or not left or not right:
            raise GgufTokenizerError(f"{path}: tokenizer.ggml.merges[{number}] is not two tokens: {merge!r}")
        pairs.append((left, right))

    models, pre_tokenizers, decoders = tokenizers.models, tokenizers.pre_tokenizers, tokenizers.decoders
    tokenizer = tokenizers.Tokenizer(
        models.BPE(vocab={text: i for i, text in enumerate(tokens)}, merges=pairs, fuse_unk=False, byte_fallback=False)
    )
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    # llama.cpp's "smollm" splits every digit apart before GPT-2's pattern (llama-vocab.cpp).
    tokenizer.pre_tokenizer = (
        pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True), byte_level]) if pre == "smollm" else byte_level
    )
    tokenizer.decoder = decoders.ByteLevel()
    special = [tokenizers.AddedToken(tokens[i], special=True, normalized=False) for i, t in enumerate(types) if t == CONTROL]
    added = [tokenizers.AddedToken(tokens[i], special=False, normalized=False) for i, t in enumerate(types) if t == USER_DEFINED]
    tokenizer.add_special_tokens(special)
    tokenizer.add_tokens(added)

    def token_of(key: str) -> str | None:
        value = _field(reader, key, path, required=False)
        return tokens[int(value)] if value is not None else None

    context = _field(reader, f"{_field(reader, 'general.architecture', path)}.context_length", path, required=False)
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": token_of("tokenizer.ggml.bos_token_id"),
        "eos_token": token_of("tokenizer.ggml.eos_token_id"),
        "unk_token": token_of("tokenizer.ggml.unknown_token_id"),
        "pad_token": token_of("tokenizer.ggml.padding_token_id"),
        "add_bos_token": bool(_field(reader, "tokenizer.ggml.add_bos_token", path, required=False)),
        "clean_up_tokenization_spaces": False,
        "model_max_length": int(context) if context is not None else None,
        "chat_template": template,
    }
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False, indent=2) + "\n", encoding="utf-8")
    return out
