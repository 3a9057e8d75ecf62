"""Config loading rules (reference §10.1, C1–C5) and the environment overrides of worker settings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from shopsimrl.config import ConfigError, WorkerSettings, load_experiment_config

ROOT = Path(__file__).resolve().parents[1]
MINIMAL = """
tasks: {split_file: splits.json, split: val}
model: {name: m, base_url: http://127.0.0.1:1/v1}
"""


def write(tmp_path: Path, text: str, name: str = "exp.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("name", ["qwen35_4b_val.yaml", "qwen35_4b_test.yaml"])
def test_c1_shipped_qwen_configs(name: str) -> None:
    config = load_experiment_config(ROOT / "configs" / name)
    m = config.model
    assert (m.id, m.name, m.checkpoint_id) == ("qwen35-4b", "Qwen/Qwen3.5-4B", "qwen35-4b-base-hf")
    assert (m.temperature, m.top_p, m.max_tokens, m.tool_choice, m.api_key_env, m.trust_env) == (0.6, 1.0, 4096, "auto", None, False)
    assert m.extra_body == {"chat_template_kwargs": {"enable_thinking": True}} and "thinking_budget" not in str(m.extra_body)
    assert config.runtime.max_steps == 30 and config.skills.path is None and config.skills.max_skills is None
    assert config.tasks.split == name.split("_")[2].split(".")[0]
    assert config.resolve(config.tasks.split_file) == ROOT / "configs" / "splits" / "persona_splits.v1.json"
    assert config.resolve(config.prompt.system_prompt_file) == ROOT / "configs" / "prompts" / "persona_single_turn.txt"


def test_defaults_and_relative_paths(tmp_path: Path) -> None:
    config = load_experiment_config(write(tmp_path, MINIMAL))
    assert config.name == "exp" and config.run_dir == (tmp_path / ".." / "runs" / "exp").resolve()
    assert config.resolve(config.tasks.split_file) == tmp_path / "splits.json"
    assert config.experiment.seed == 20260828 and config.model.max_retries == 5 and config.model.api_key_env == "OPENAI_API_KEY"


def test_unknown_keys_are_rejected_with_their_path(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model\.max_token: unknown key"):
        load_experiment_config(write(tmp_path, MINIMAL.replace("name: m,", "name: m, max_token: 5,")))
    with pytest.raises(ConfigError, match=r"runtim: unknown key"):
        load_experiment_config(write(tmp_path, MINIMAL + "runtim: {max_steps: 3}\n"))


def test_bad_values_name_the_field(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"experiment\.concurrency"):
        load_experiment_config(write(tmp_path, MINIMAL + "experiment: {concurrency: 0}\n"))
    with pytest.raises(ConfigError, match=r"model\.checkpoint_id"):
        load_experiment_config(write(tmp_path, MINIMAL.replace("name: m,", "name: m, checkpoint_id: ' ',")))
    with pytest.raises(ConfigError, match=r"tasks\.split: required key is missing"):
        load_experiment_config(write(tmp_path, MINIMAL.replace(", split: val", "")))
    with pytest.raises(ConfigError, match="line 3"):
        load_experiment_config(write(tmp_path, "a: 1\nb: [\n"))


def test_c5_models_list_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="one model mapping"):
        load_experiment_config(write(tmp_path, MINIMAL + "models: []\n"))


def test_prompt_sources_are_exclusive(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="mutually exclusive"):
        load_experiment_config(write(tmp_path, MINIMAL + "prompt: {system_prompt: a, system_prompt_file: b.txt}\n"))


def test_c2_dotenv_never_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / ".env").write_text("export SHOPSIMRL_T1='from-file'\nSHOPSIMRL_T2=\"x\"\n", encoding="utf-8")
    monkeypatch.setenv("SHOPSIMRL_T1", "from-process")
    monkeypatch.delenv("SHOPSIMRL_T2", raising=False)
    load_experiment_config(write(tmp_path, MINIMAL + "experiment: {dotenv: .env}\n"))
    assert os.environ["SHOPSIMRL_T1"] == "from-process" and os.environ["SHOPSIMRL_T2"] == "x"
    monkeypatch.delenv("SHOPSIMRL_T2")


def test_worker_settings_override_urls(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SHOPSIMRL_MODEL_BASE_URL", "http://vllm.eval.svc:8000/v1")
    monkeypatch.setenv("SHOPSIMRL_ENV_BASE_URL", "http://shop.eval.svc:5700")
    monkeypatch.setenv("SHOPSIMRL_CONCURRENCY", "12")
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "7")
    settings = WorkerSettings()
    assert settings.shard_index == 7
    config = load_experiment_config(write(tmp_path, MINIMAL)).with_overrides(settings)
    assert config.model.base_url == "http://vllm.eval.svc:8000/v1"
    assert config.environment.base_url == "http://shop.eval.svc:5700"
    assert config.experiment.concurrency == 12
