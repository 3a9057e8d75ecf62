"""The production chat tokenizer (a Hugging Face tokenizer directory) and how the config finds it.

The tokenizer here is real: a byte-level BPE trained by ``tokenizers`` on a few lines, saved as a
Hugging Face directory with a Qwen-style tool-use chat template, loaded by transformers'
``AutoTokenizer`` exactly as slime loads ``--hf-checkpoint``. SmolLM2's own tokenizer, converted from
its GGUF, is held against llama.cpp in ``test_real_model.py`` (the ``llm`` tests).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from shopsimrl.config import ConfigError
from shopsimrl.training.config import load_training_config
from shopsimrl.training.hf_tokenizer import ChatTemplateError, HfChatTokenizer, chat_messages
from shopsimrl.training.worker import tokenizer_for

# Importing transformers takes over a second: every test here is in the slow tier.
pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[2]
SPLITS = REPO / "configs/splits/persona_splits.v1.json"

# Qwen2.5's way with tools, in short: the tools as JSON lines in the system turn, each call's
# arguments rendered with tojson (so they must be objects, not JSON strings), tool results in a
# user turn.
TEMPLATE = (
    "{% for message in messages %}"
    "{% if message.role == 'system' %}{{ '<|im_start|>system\\n' + message.content }}"
    "{% if tools %}{{ '\\n<tools>' }}{% for tool in tools %}{{ '\\n' + tool | tojson }}{% endfor %}{{ '\\n</tools>' }}{% endif %}"
    "{{ '<|im_end|>\\n' }}"
    "{% elif message.role == 'assistant' %}{{ '<|im_start|>assistant\\n' + message.content }}"
    '{% for call in message.tool_calls or [] %}{{ \'\\n<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \' }}'
    "{{ call.function.arguments | tojson }}{{ '}\\n</tool_call>' }}{% endfor %}{{ '<|im_end|>\\n' }}"
    "{% elif message.role == 'tool' %}{{ '<|im_start|>user\\n<tool_response>\\n' + message.content + '\\n</tool_response><|im_end|>\\n' }}"
    "{% else %}{{ '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "click",
            "description": "点击",
            "parameters": {"type": "object", "properties": {"value": {"type": "string", "enum": ["购买", "返回"]}}},
        },
    }
]
CONVERSATION = [
    {"role": "system", "content": "你是购物助手。"},
    {"role": "user", "content": "买一个水壶"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "click", "arguments": '{"value": "购买"}'}}],
    },
    {"role": "tool", "tool_call_id": "c1", "content": "页面：已购买"},
]


def _tokenizer_dir(path: Path, *, template: str | None = TEMPLATE) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    lines = ["买一个水壶", "你是购物助手。", '{"name": "click", "arguments": {"value": "购买"}}', "<tool_response>"] * 20
    tokenizer.train_from_iterator(lines, trainer=trainer)
    path.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(path / "tokenizer.json"))
    config: dict[str, object] = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "clean_up_tokenization_spaces": False,
    }
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config, ensure_ascii=False), encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return _tokenizer_dir(tmp_path_factory.mktemp("hf") / "qwenlike")


def _config(tmp_path: Path, model: str) -> Path:
    path = tmp_path / "training.yaml"
    path.write_text(f"tasks: {{split_file: {SPLITS}, split: train}}\nmodel: {{{model}}}\n", encoding="utf-8")
    return path


def test_the_model_template_renders_what_sglang_would_and_ids_decode_back(tokenizer_dir: Path, tmp_path: Path) -> None:
    config = load_training_config(_config(tmp_path, f"tokenizer: hf, tokenizer_path: {tokenizer_dir}"))
    tokenizer = tokenizer_for(config)
    assert isinstance(tokenizer, HfChatTokenizer)
    ids = tokenizer.render(CONVERSATION, TOOLS)
    text = tokenizer.decode(ids)
    # content null rendered as "", the arguments string rendered as the object it spells (not a
    # JSON string inside JSON), the tools block from the template, the generation prompt last.
    assert (
        '<|im_start|>assistant\n\n<tool_call>\n{"name": "click", "arguments": {"value": "购买"}}\n</tool_call><|im_end|>' in text
    )
    assert '"enum": ["购买", "返回"]' in text and text.endswith("<|im_start|>assistant\n")
    assert text.startswith("<|im_start|>system\n你是购物助手。\n<tools>")
    assert tokenizer.decode(ids, skip_special_tokens=True).count("<|im_start|>") == 0
    assert tokenizer.eos_token_id == tokenizer.tokenizer.convert_tokens_to_ids("<|im_end|>")
    # The caller's messages are left as they were.
    assert CONVERSATION[2]["content"] is None
    assert CONVERSATION[2]["tool_calls"][0]["function"]["arguments"] == '{"value": "购买"}'  # type: ignore[index]
    identity = tokenizer.identity()
    assert identity["tokenizer"] == "hf" and identity["name_or_path"] == str(tokenizer_dir)
    assert identity["chat_template_sha256"] == hashlib.sha256(TEMPLATE.encode()).hexdigest()
    assert identity["vocab_size"] == len(tokenizer.tokenizer) and len(identity["vocab_sha256"]) == 64


def test_arguments_that_are_not_a_json_object_are_rendered_as_written() -> None:
    odd = [
        {"role": "assistant", "content": "x", "tool_calls": [{"function": {"name": "f", "arguments": "not json"}}]},
        {"role": "assistant", "content": "y", "tool_calls": [{"function": {"name": "f", "arguments": '"{\\"a\\": 1}"'}}]},
    ]
    out = chat_messages(odd)
    assert out[0]["tool_calls"][0]["function"]["arguments"] == "not json"
    assert out[1]["tool_calls"][0]["function"]["arguments"] == '"{\\"a\\": 1}"'


def test_inside_slime_the_tokenizer_is_slimes_hf_checkpoint(tokenizer_dir: Path, tmp_path: Path) -> None:
    config = load_training_config(_config(tmp_path, "tokenizer: hf"))
    tokenizer = tokenizer_for(config, SimpleNamespace(hf_checkpoint=str(tokenizer_dir)))
    assert isinstance(tokenizer, HfChatTokenizer) and tokenizer.source == str(tokenizer_dir)
    with pytest.raises(ConfigError, match=r"model\.tokenizer_path is not set and there is no slime --hf-checkpoint"):
        tokenizer_for(config)
    # A relative tokenizer_path is the YAML file's directory's.
    relative = load_training_config(_config(tokenizer_dir.parent, f"tokenizer: hf, tokenizer_path: {tokenizer_dir.name}"))
    found = tokenizer_for(relative, SimpleNamespace(hf_checkpoint="/elsewhere"))
    assert isinstance(found, HfChatTokenizer) and found.source == str(tokenizer_dir)


def test_a_wrong_tokenizer_setting_is_refused_naming_it(tokenizer_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model: .*tokenizer_path applies to tokenizer 'hf' only, and tokenizer is 'testbed'"):
        load_training_config(_config(tmp_path, f"tokenizer: testbed, tokenizer_path: {tokenizer_dir}"))
    with pytest.raises(ConfigError, match=r"model\.tokenizer"):
        load_training_config(_config(tmp_path, "tokenizer: qwen"))
    config = load_training_config(_config(tmp_path, f"tokenizer: hf, tokenizer_path: {tmp_path / 'absent'}"))
    with pytest.raises(ConfigError, match=r"model\.tokenizer_path .*absent is not a directory"):
        tokenizer_for(config)
    (tmp_path / "empty").mkdir()
    config = load_training_config(_config(tmp_path, f"tokenizer: hf, tokenizer_path: {tmp_path / 'empty'}"))
    with pytest.raises(ConfigError, match=r"cannot load a Hugging Face tokenizer from .*empty"):
        tokenizer_for(config)
    bare = _tokenizer_dir(tmp_path / "no-template", template=None)
    config = load_training_config(_config(tmp_path, f"tokenizer: hf, tokenizer_path: {bare}"))
    with pytest.raises(ConfigError, match="has no chat template"):
        tokenizer_for(config)


def test_a_template_that_cannot_render_names_the_tokenizer(tmp_path: Path) -> None:
    strict = _tokenizer_dir(tmp_path / "strict", template="{{ raise_exception('only user turns') }}")
    tokenizer = HfChatTokenizer.load(str(strict))
    with pytest.raises(ChatTemplateError, match=rf"chat template of {strict} cannot render.*only user turns"):
        tokenizer.render(CONVERSATION, TOOLS)


@pytest.mark.parametrize(
    ("blocked", "model", "words"),
    [
        ("shopsimrl.testbed", "tokenizer: testbed", "needs the shopsimrl-testbed distribution"),
        ("transformers", "tokenizer: hf, tokenizer_path: TOKDIR", "needs the transformers package"),
    ],
)
def test_a_missing_optional_part_is_a_config_error_not_an_import_error(
    tokenizer_dir: Path, tmp_path: Path, blocked: str, model: str, words: str
) -> None:
    # The core never needs the testbed nor transformers: without them the worker names what is missing.
    config = _config(tmp_path, model.replace("TOKDIR", str(tokenizer_dir)))
    code = (
        f"import sys; sys.modules[{blocked!r}] = None\n"
        "from shopsimrl.config import ConfigError\n"
        "from shopsimrl.training.config import load_training_config\n"
        "from shopsimrl.training.worker import tokenizer_for\n"
        f"config = load_training_config({str(config)!r})\n"
        "try:\n    tokenizer_for(config)\nexcept ConfigError as exc:\n    print(exc); sys.exit(2)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert done.returncode == 2, done.stderr
    assert words in done.stdout
