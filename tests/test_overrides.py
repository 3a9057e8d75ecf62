"""Command-line overrides (issue 26, item 1): ``--set KEY=VALUE`` and its short forms plan and
fingerprint exactly as the same edit of the YAML, are validated like it, never carry a secret,
and take precedence over the ``SHOPSIMRL_*`` variables."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from shopsimrl.cli.common import command_line_overrides
from shopsimrl.config import ConfigError, ConfigOverride, WorkerSettings, load_experiment_config, parse_set_option
from shopsimrl.runner.experiment import prepare
from shopsimrl.schemas import fingerprint

ROOT = Path(__file__).resolve().parents[1]
SPLIT_FILE = ROOT / "configs" / "splits" / "persona_splits.v1.json"

BASE: dict[str, Any] = {
    "experiment": {"name": "ckpt", "seed": 20260830, "concurrency": 4},
    "tasks": {"split_file": str(SPLIT_FILE), "split": "val", "sample_size": 3},
    "runtime": {"max_steps": 30},
    "model": {
        "name": "shopsim-heuristic",
        "base_url": "http://127.0.0.1:1/v1",
        "api_key_env": None,
        "temperature": 0.0,
        "extra_body": {"chat_template_kwargs": {"enable_thinking": True}},
    },
}


def write(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")  # JSON is YAML
    return path


def edited(key: str, value: Any) -> dict[str, Any]:
    data = json.loads(json.dumps(BASE))
    *sections, last = key.split(".")
    node = data
    for section in sections:
        node = node.setdefault(section, {})
    node[last] = value
    return data


def plan_bytes(config: Any) -> tuple[bytes, str]:
    plan = prepare(config).plan()
    return json.dumps(plan, sort_keys=True, ensure_ascii=False).encode(), fingerprint(plan)


SEMANTIC = [
    ("model.checkpoint_id", "grpo-round-3", "--set model.checkpoint_id=grpo-round-3"),
    ("model.name", "Qwen/Qwen3.5-4B", "--set model.name=Qwen/Qwen3.5-4B"),
    ("model.temperature", 0.7, "--set model.temperature=0.7"),
    ("model.top_p", 0.95, "--set model.top_p=0.95"),
    (
        "model.extra_body.chat_template_kwargs.enable_thinking",
        False,
        "--set model.extra_body.chat_template_kwargs.enable_thinking=false",
    ),
    ("model.extra_body", {"top_k": 20}, "--set model.extra_body={top_k: 20}"),
    ("runtime.max_steps", 12, "--set runtime.max_steps=12"),
    ("runtime.max_model_seconds", 90.5, "--set runtime.max_model_seconds=90.5"),
    ("tasks.sample_size", 2, "--set tasks.sample_size=2"),
    ("tasks.repeats", 3, "--set tasks.repeats=3"),
    ("experiment.seed", 7, "--set experiment.seed=7"),
    ("experiment.name", "ckpt-b", "--set experiment.name=ckpt-b"),
    ("prompt.system_prompt", "你是购物助手。", "--set prompt.system_prompt=你是购物助手。"),
]
NOT_SEMANTIC = [
    ("experiment.concurrency", 64, "--set experiment.concurrency=64"),
    ("model.timeout", 30.0, "--set model.timeout=30.0"),
    ("model.max_retries", 2, "--set model.max_retries=2"),
    ("model.base_url", "http://vllm.eval.svc:8000/v1", "--set model.base_url=http://vllm.eval.svc:8000/v1"),
    ("environment.max_leases", 8, "--set environment.max_leases=8"),
    ("runtime.max_episode_retries", 5, "--set runtime.max_episode_retries=5"),
]


@pytest.mark.parametrize(("key", "value", "flag"), SEMANTIC + NOT_SEMANTIC, ids=[row[0] for row in SEMANTIC + NOT_SEMANTIC])
def test_set_plans_exactly_as_the_same_yaml_edit(tmp_path: Path, key: str, value: Any, flag: str) -> None:
    base = write(tmp_path / "base.yaml", BASE)
    by_file = load_experiment_config(write(tmp_path / "edited.yaml", edited(key, value)))
    by_flag = load_experiment_config(base, overrides=[parse_set_option(flag.removeprefix("--set "))])
    assert by_flag.model_dump() == by_file.model_dump()
    flag_plan, flag_fp = plan_bytes(by_flag)
    file_plan, file_fp = plan_bytes(by_file)
    assert flag_plan == file_plan and flag_fp == file_fp
    semantic = (key, value, flag) in SEMANTIC
    assert (flag_fp != plan_bytes(load_experiment_config(base))[1]) is semantic
    assert by_flag.overrides == (ConfigOverride(key, value, "--set"),)


def test_short_forms_are_text_and_equal_their_set(tmp_path: Path) -> None:
    base = write(tmp_path / "base.yaml", BASE)
    short = command_line_overrides(None, model="m-2", checkpoint="0123", experiment="true", concurrency=9)
    config = load_experiment_config(base, overrides=short)
    # Read as YAML, 0123 would be the int 123 and true a boolean: a short form's value is what was typed.
    assert (config.model.name, config.model.checkpoint_id, config.experiment.name, config.experiment.concurrency) == (
        "m-2",
        "0123",
        "true",
        9,
    )
    quoted = [
        parse_set_option(text)
        for text in ("model.name=m-2", "model.checkpoint_id='0123'", "experiment.name='true'", "experiment.concurrency=9")
    ]
    assert plan_bytes(config) == plan_bytes(load_experiment_config(base, overrides=quoted))
    assert [o.source for o in config.overrides] == ["--model", "--checkpoint", "--experiment", "--concurrency", "--model"]
    assert config.run_dir.name == "true"  # --experiment names the run directory, as experiment.name does


def test_model_short_form_relabels_the_run(tmp_path: Path) -> None:
    labelled = {**BASE, "model": {**BASE["model"], "id": "base-label"}}
    base = write(tmp_path / "base.yaml", labelled)
    config = load_experiment_config(base, overrides=command_line_overrides(None, model="grpo-round-3"))
    assert config.model_id == "grpo-round-3"
    # The same as editing the YAML: the new name, no id.
    yaml_edit = {**labelled, "model": {k: v for k, v in labelled["model"].items() if k != "id"} | {"name": "grpo-round-3"}}
    assert plan_bytes(config) == plan_bytes(load_experiment_config(write(tmp_path / "edit.yaml", yaml_edit)))
    # An id given on the command line is kept.
    kept = load_experiment_config(base, overrides=command_line_overrides(["model.id=r3"], model="grpo-round-3"))
    assert (kept.model.name, kept.model_id) == ("grpo-round-3", "r3")


@pytest.mark.parametrize(
    "value",
    [
        "0123",
        "x",
        "",
        None,
        True,
        7,
        1e-05,
        0.7,
        [1, "2"],
        {"a": {"b": False}},
        "yes",
        "中文",
        "null",
        "a: b",
        "#c",
        "http://h:1/v1?x=1",
    ],
)
def test_an_override_travels_to_a_worker_unchanged(value: Any) -> None:
    """What ``run --shards`` hands each worker as ``--set`` reads back to the same key and value."""
    back = parse_set_option(ConfigOverride("model.extra_body.k", value, "--checkpoint").as_set_option())
    assert back.key == "model.extra_body.k" and back.value == value and type(back.value) is type(value)


@pytest.mark.parametrize(
    ("sets", "fragments"),
    [
        (["model.temperatur=0.5"], ["model.temperatur: unknown key", "[from --set model.temperatur]"]),
        (["modle.name=x"], ["modle: unknown key", "[from --set modle.name]"]),
        (
            ["model.temperature=-1"],
            ["model.temperature: Input should be greater than or equal to 0", "[from --set model.temperature]"],
        ),
        (["runtime.max_steps='30'"], ["runtime.max_steps: Input should be a valid integer", "[from --set runtime.max_steps]"]),
        (["runtime.max_model_seconds=0"], ["runtime.max_model_seconds: Input should be greater than 0", "[from --set"]),
        (["runtime.max_model_seconds=.nan"], ["runtime.max_model_seconds", "finite", "[from --set"]),
        (
            ["model.checkpoint_id=1000"],
            ["model.checkpoint_id: Input should be a valid string", "--set 'model.checkpoint_id=\"1000\"'"],
        ),
        (["experiment.name=///"], ["experiment.name '///' has no usable characters [from --set experiment.name]"]),
        (["model=3"], ["model: Input should be a valid dictionary", "[from --set model]"]),
        (["source_path=/etc"], ["--set source_path: unknown key"]),
        (["model.name=a", "model.name=b"], ["model.name is set twice on the command line"]),
        (["model.extra_body={a: 1}", "model.extra_body.b=2"], ["model.extra_body is set twice on the command line"]),
        (["model.name.x=1"], ["model.name is not a mapping"]),
        (["prompt.system_prompt=a", "prompt.system_prompt_file=b.txt"], ["mutually exclusive", "--set prompt.system_prompt"]),
    ],
)
def test_bad_overrides_name_the_key_and_the_flag(tmp_path: Path, sets: list[str], fragments: list[str]) -> None:
    with pytest.raises(ConfigError) as raised:
        load_experiment_config(write(tmp_path / "base.yaml", BASE), overrides=[parse_set_option(text) for text in sets])
    message = str(raised.value)
    for fragment in fragments:
        assert fragment in message, message


@pytest.mark.parametrize("text", ["nokey", "=1", "a..b=1", " =x", "model name=x"])
def test_malformed_set_options_are_refused(text: str) -> None:
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        parse_set_option(text)


def test_a_value_that_is_no_yaml_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"--set model\.name: the value is not YAML"):
        parse_set_option("model.name=[")


@pytest.mark.parametrize(
    ("text", "named"),
    [
        ("model.api_key=sk-live-S3CRET", "--set model.api_key: refused"),
        ("model.extra_body.api_key=sk-live-S3CRET", "--set model.extra_body.api_key: refused"),
        ("model.extra_body.headers.Authorization=Bearer sk-live-S3CRET", "--set model.extra_body.headers.Authorization: refused"),
        ("model.extra_body={x: 1, client_secret: sk-live-S3CRET}", "(model.extra_body.client_secret): refused"),
        ("model.extra_body.access-token=sk-live-S3CRET", "refused"),
        ("model.password=sk-live-S3CRET", "refused"),
    ],
)
def test_secrets_are_refused_on_the_command_line_without_echoing_them(tmp_path: Path, text: str, named: str) -> None:
    with pytest.raises(ConfigError) as raised:
        load_experiment_config(write(tmp_path / "base.yaml", BASE), overrides=[parse_set_option(text)])
    message = str(raised.value)
    assert named in message and "model.api_key_env" in message and "S3CRET" not in message


def test_settings_whose_names_look_secret_are_settings(tmp_path: Path) -> None:
    """A declared key is no secret: api_key_env names a variable, max_tokens counts tokens."""
    sets = ["model.api_key_env=VLLM_KEY", "model.max_tokens=256", "model.extra_body.max_completion_tokens=64"]
    config = load_experiment_config(write(tmp_path / "base.yaml", BASE), overrides=[parse_set_option(t) for t in sets])
    assert (config.model.api_key_env, config.model.max_tokens) == ("VLLM_KEY", 256)


def test_command_line_paths_are_relative_to_the_current_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "configs").mkdir()
    base = write(tmp_path / "configs" / "base.yaml", {**BASE, "skills": {"path": "bank.json"}})
    (tmp_path / "here").mkdir()
    monkeypatch.chdir(tmp_path / "here")
    config = load_experiment_config(base, overrides=[parse_set_option("experiment.output_dir=out")])
    assert config.run_dir == tmp_path / "here" / "out" / "ckpt"
    assert config.resolve(config.skills.path or "") == tmp_path / "configs" / "bank.json"  # the YAML's stay the YAML's


def test_precedence_yaml_then_environment_then_command_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    base = write(tmp_path / "base.yaml", BASE)
    monkeypatch.setenv("SHOPSIMRL_MODEL_BASE_URL", "http://from-env:8000/v1")
    monkeypatch.setenv("SHOPSIMRL_ENV_BASE_URL", "http://shop-from-env:5700")
    monkeypatch.setenv("SHOPSIMRL_CONCURRENCY", "12")
    settings = WorkerSettings()
    plain = load_experiment_config(base).with_overrides(settings)
    assert (plain.model.base_url, plain.environment.base_url, plain.experiment.concurrency) == (
        "http://from-env:8000/v1",
        "http://shop-from-env:5700",
        12,
    )
    assert [(o.key, o.source) for o in plain.overrides] == [
        ("model.base_url", "SHOPSIMRL_MODEL_BASE_URL"),
        ("environment.base_url", "SHOPSIMRL_ENV_BASE_URL"),
        ("experiment.concurrency", "SHOPSIMRL_CONCURRENCY"),
    ]
    overrides = [parse_set_option("model.base_url=http://from-flag:9000/v1"), *command_line_overrides(None, concurrency=3)]
    flagged = load_experiment_config(base, overrides=overrides).with_overrides(settings)
    assert (flagged.model.base_url, flagged.environment.base_url, flagged.experiment.concurrency) == (
        "http://from-flag:9000/v1",
        "http://shop-from-env:5700",
        3,
    )
    assert [(o.key, o.source) for o in flagged.overrides] == [
        ("model.base_url", "--set"),
        ("experiment.concurrency", "--concurrency"),
        ("environment.base_url", "SHOPSIMRL_ENV_BASE_URL"),
    ]


def test_overrides_are_recorded_in_the_execution_settings_with_urls_redacted(tmp_path: Path) -> None:
    base = write(tmp_path / "base.yaml", BASE)
    overrides = [
        parse_set_option("model.base_url=https://gateway.example/v1?api-version=1&api_key=LEAKED"),
        *command_line_overrides(None, checkpoint="grpo-3"),
    ]
    execution = prepare(load_experiment_config(base, overrides=overrides)).execution()
    assert execution["overrides"] == [
        {"key": "model.base_url", "value": "https://gateway.example/v1?api-version=1&api_key=REDACTED", "from": "--set"},
        {"key": "model.checkpoint_id", "value": "grpo-3", "from": "--checkpoint"},
    ]
    assert "LEAKED" not in json.dumps(execution)
    assert "overrides" not in prepare(load_experiment_config(base)).execution()  # nothing new without overrides


def test_run_dir_is_an_execution_setting(tmp_path: Path) -> None:
    config = load_experiment_config(write(tmp_path / "base.yaml", BASE))
    elsewhere = config.at_run_dir(tmp_path / "elsewhere")
    assert elsewhere.run_dir == tmp_path / "elsewhere" and config.run_dir == (tmp_path / ".." / "runs" / "ckpt").resolve()
    assert plan_bytes(elsewhere) == plan_bytes(config)
