"""Config loading rules (reference §10.1, C1–C5) and the environment overrides of worker settings."""

from __future__ import annotations

import os
import re
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
    assert (m.temperature, m.top_p, m.max_tokens, m.tool_choice, m.api_key_env, m.trust_env) == (
        0.6,
        1.0,
        4096,
        "auto",
        None,
        False,
    )
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


def test_dotenv_syntax_is_python_dotenv_and_never_overrides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / ".env").write_text(
        "# model key\nSHOPSIMRL_T3=\"a b\"  # a comment\n\nSHOPSIMRL_T4=\nSHOPSIMRL_T5='${HOME}'\nSHOPSIMRL_T6 = x=y\n",
        encoding="utf-8",
    )
    for key in ("SHOPSIMRL_T3", "SHOPSIMRL_T4", "SHOPSIMRL_T5", "SHOPSIMRL_T6"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("SHOPSIMRL_T6", "kept")
    load_experiment_config(write(tmp_path, MINIMAL + "experiment: {dotenv: .env}\n"))
    assert os.environ["SHOPSIMRL_T3"] == "a b" and os.environ["SHOPSIMRL_T4"] == ""
    assert os.environ["SHOPSIMRL_T5"] == "${HOME}"  # no expansion, as before
    assert os.environ["SHOPSIMRL_T6"] == "kept"


@pytest.mark.parametrize(
    "statement",
    ["OPENAI_API_KEY sk-SECRET-123", "sk-SECRET-123", "SHOPSIMRL-KEY=sk-SECRET-123", "SHOPSIMRL_T8='sk-SECRET-123"],
)
def test_malformed_dotenv_names_file_and_line_and_sets_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, statement: str
) -> None:
    dotenv = tmp_path / "secrets.env"
    dotenv.write_text(f"# keys\nSHOPSIMRL_T7=1\n\n{statement}\n", encoding="utf-8")
    monkeypatch.delenv("SHOPSIMRL_T7", raising=False)
    with pytest.raises(ConfigError) as raised:
        load_experiment_config(write(tmp_path, MINIMAL + "experiment: {dotenv: secrets.env}\n"))
    message = str(raised.value)
    assert message.startswith(f"{dotenv}:4: expected KEY=VALUE") and "\n" not in message
    assert "SECRET" not in message  # the file holds secrets: its statements are never echoed
    assert "SHOPSIMRL_T7" not in os.environ  # a malformed file sets nothing


@pytest.mark.slow
def test_malformed_dotenv_exits_2_in_one_line(tmp_path: Path) -> None:
    import subprocess
    import sys

    (tmp_path / ".env").write_text("A=1\nnot a statement\n", encoding="utf-8")
    config = write(tmp_path, MINIMAL + "experiment: {dotenv: .env}\n")
    result = subprocess.run([sys.executable, "-m", "shopsimrl", "plan", str(config)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 2
    assert result.stderr.strip() == f"error: {tmp_path / '.env'}:2: expected KEY=VALUE (KEY a variable name: letters, digits, _)"


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


# --------------------------------------------------------------------------- bad input (issue 10)

SPLIT_FILE = ROOT / "configs" / "splits" / "persona_splits.v1.json"


@pytest.mark.parametrize(
    ("section", "named"),
    [
        ("experiment: {seed: -5}", r"experiment\.seed: Input should be greater than or equal to 0"),
        ("experiment: {seed: true}", r"experiment\.seed: Input should be a valid integer"),
        ("experiment: {concurrency: true}", r"experiment\.concurrency: Input should be a valid integer"),
        ("tasks: {split_file: splits.json, split: val, repeats: 2.0}", r"tasks\.repeats: Input should be a valid integer"),
        ("runtime: {max_steps: '30'}", r"runtime\.max_steps: Input should be a valid integer"),
        ("experiment: {resume: 'no'}", r"experiment\.resume: Input should be a valid boolean"),
        ("environment: {persona: 1}", r"environment\.persona: Input should be a valid boolean"),
        ("environment: {reset_timeout: .inf}", r"environment\.reset_timeout: Input should be a finite number"),
        ("environment: {timeout: .inf}", r"environment\.timeout: Input should be a finite number"),
    ],
)
def test_numbers_and_flags_are_strict_and_finite(tmp_path: Path, section: str, named: str) -> None:
    """A negative seed would sample the tasks of its positive; a bool is never an int; inf is no timeout."""
    text = MINIMAL.replace("tasks: {split_file: splits.json, split: val}\n", "") if section.startswith("tasks:") else MINIMAL
    with pytest.raises(ConfigError, match=named):
        load_experiment_config(write(tmp_path, text + section + "\n"))


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("temperature", ".inf", "model.temperature"),
        ("max_tokens", "'512'", "model.max_tokens"),
        ("max_retries", "true", "model.max_retries"),
        ("stream", "1", "model.stream"),
    ],
)
def test_model_numbers_and_flags_are_strict_and_finite(tmp_path: Path, field: str, value: str, named: str) -> None:
    with pytest.raises(ConfigError, match=named):
        load_experiment_config(write(tmp_path, MINIMAL.replace("name: m,", f"name: m, {field}: {value},")))


def test_one_problem_is_one_line(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as caught:
        load_experiment_config(write(tmp_path, MINIMAL + "experiment: {seed: -1}\n"))
    assert "\n" not in str(caught.value) and str(tmp_path / "exp.yaml") in str(caught.value)


def test_experiment_name_without_usable_characters_is_refused_when_loading(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"exp\.yaml: experiment\.name '///' has no usable characters"):
        load_experiment_config(write(tmp_path, MINIMAL + "experiment: {name: '///'}\n"))


async def _environment_attempts(config_text: str, tmp_path: Path) -> int:
    from shopsimrl.environment import EnvironmentUnavailableError, ShopSimulatorEnvironment
    from shopsimrl.runner.experiment import prepare

    prepared = prepare(load_experiment_config(write(tmp_path, config_text)))

    async def no_sleep(seconds: float) -> None:
        return None

    environment = ShopSimulatorEnvironment(prepared.environment_settings, sleep=no_sleep)
    try:
        with pytest.raises(EnvironmentUnavailableError) as caught:
            await environment.open_episode().reset(1)  # connection refused: always safe to retry
        return caught.value.attempts
    finally:
        await environment.aclose()


async def test_environment_and_model_max_retries_both_count_total_attempts(tmp_path: Path) -> None:
    from shopsimrl.model import ModelRequestError
    from shopsimrl.runner.experiment import prepare
    from shopsimrl.testbed.serving import free_port

    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: every attempt is refused
    text = (
        f"tasks: {{split_file: {SPLIT_FILE}, split: val, sample_size: 1}}\n"
        f"environment: {{base_url: '{dead}', max_retries: ENV}}\n"
        f"model: {{name: m, base_url: '{dead}/v1', api_key_env: null, max_retries: 2, retry_backoff_seconds: 0}}\n"
    )
    assert await _environment_attempts(text.replace("ENV", "1"), tmp_path) == 1  # 1 = no retry, as for the model
    assert await _environment_attempts(text.replace("ENV", "3"), tmp_path) == 3

    model = prepare(load_experiment_config(write(tmp_path, text.replace("ENV", "3")))).model()
    try:
        with pytest.raises(ModelRequestError) as caught:
            await model.generate([{"role": "user", "content": "x"}], [])
        assert caught.value.attempt_count == 2
    finally:
        await model.aclose()

    default = load_experiment_config(write(tmp_path, MINIMAL))
    assert default.environment.max_retries == 4 and default.model.max_retries == 5
    with pytest.raises(ConfigError, match=r"environment\.max_retries: Input should be greater than or equal to 1"):
        load_experiment_config(write(tmp_path, MINIMAL + "environment: {max_retries: 0}\n"))


@pytest.mark.parametrize("section", ["model", "environment"])
def test_service_urls_with_credentials_are_refused_without_echoing_them(tmp_path: Path, section: str) -> None:
    url = "http://alice:s3cr3t-pw@127.0.0.1:1/v1" if section == "model" else "http://alice:s3cr3t-pw@127.0.0.1:1"
    text = (
        MINIMAL.replace("base_url: http://127.0.0.1:1/v1", f"base_url: '{url}'")
        if section == "model"
        else MINIMAL + f"environment: {{base_url: '{url}'}}\n"
    )
    with pytest.raises(ConfigError) as caught:
        load_experiment_config(write(tmp_path, text))
    message = str(caught.value)
    assert f"{section}.base_url: must not contain user:password@ credentials" in message
    assert "s3cr3t-pw" not in message and "alice" not in message
    if section == "model":
        assert "model.api_key_env" in message


@pytest.mark.parametrize(
    ("variable", "value", "expected"),
    [
        (
            "SHOPSIMRL_MODEL_BASE_URL",
            "http://alice:s3cr3t-pw@vllm:8000/v1",
            "SHOPSIMRL_MODEL_BASE_URL: must not contain user:password@",
        ),
        ("SHOPSIMRL_ENV_BASE_URL", "http://alice:s3cr3t-pw@shop:5700", "SHOPSIMRL_ENV_BASE_URL: must not contain user:password@"),
        ("SHOPSIMRL_ENV_BASE_URL", "http://shop:5700/?x=1", "SHOPSIMRL_ENV_BASE_URL: must not have a ?query"),
        ("SHOPSIMRL_FLUSH_SECONDS", "inf", "SHOPSIMRL_FLUSH_SECONDS: Input should be a finite number"),
        ("SHOPSIMRL_FLUSH_SECONDS", "nan", "SHOPSIMRL_FLUSH_SECONDS: Input should be a finite number"),
    ],
)
def test_bad_worker_settings_are_named_and_masked(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, expected: str
) -> None:
    from pydantic import ValidationError

    from shopsimrl.config import describe_settings_error

    monkeypatch.setenv(variable, value)
    with pytest.raises(ValidationError) as caught:
        WorkerSettings()
    message = describe_settings_error(caught.value)
    assert expected in message and "\n" not in message and "s3cr3t-pw" not in message


@pytest.mark.parametrize(
    ("section", "url", "problem"),
    [
        ("environment", "http://127.0.0.1:5700/?debug=1", "must not have a ?query"),
        ("environment", "http://127.0.0.1:5700/#top", "must not have a #fragment"),
        ("model", "http://127.0.0.1:1/v1#x", "must not have a #fragment"),
        ("model", "ftp://127.0.0.1/v1", "must start with http:// or https://"),
        ("model", "http://:8000/v1", "needs a host"),
        ("model", "http://127.0.0.1:0/v1", "needs a host"),
    ],
)
def test_malformed_service_urls_are_refused(tmp_path: Path, section: str, url: str, problem: str) -> None:
    text = (
        MINIMAL.replace("base_url: http://127.0.0.1:1/v1", f"base_url: '{url}'")
        if section == "model"
        else MINIMAL + f"environment: {{base_url: '{url}'}}\n"
    )
    with pytest.raises(ConfigError, match=rf"{section}\.base_url: {re.escape(problem)}"):
        load_experiment_config(write(tmp_path, text))


def test_a_model_url_may_carry_a_query(tmp_path: Path) -> None:
    config = load_experiment_config(
        write(tmp_path, MINIMAL.replace("http://127.0.0.1:1/v1", "'http://127.0.0.1:1/v1?api-version=2024-06-01'"))
    )
    assert config.model.base_url == "http://127.0.0.1:1/v1?api-version=2024-06-01"
