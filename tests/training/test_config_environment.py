"""The training config's service addresses from the environment, checked like the file's."""

from __future__ import annotations

from pathlib import Path

import pytest

from shopsimrl.config import ConfigError
from shopsimrl.training.config import ENV_URL_VARIABLE, TOKEN_URL_VARIABLE, load_training_config

REPO = Path(__file__).resolve().parents[2]
DEMO = REPO / "configs/train_demo/training.yaml"


def test_the_file_alone() -> None:
    config = load_training_config(DEMO, {})
    assert (config.environment.base_url, config.model.base_url) == ("http://127.0.0.1:5700", "http://127.0.0.1:8000")
    assert config.run_dir == (REPO / "runs/train-demo/round-001").resolve()


def test_environment_replaces_both_addresses_and_nothing_else() -> None:
    plain = load_training_config(DEMO, {})
    moved = load_training_config(DEMO, {ENV_URL_VARIABLE: "http://shop.ns.svc:5700", TOKEN_URL_VARIABLE: "http://router:30000"})
    assert (moved.environment.base_url, moved.model.base_url) == ("http://shop.ns.svc:5700", "http://router:30000")
    assert moved.source_path == plain.source_path and moved.run_dir == plain.run_dir
    assert moved.model_dump(exclude={"environment", "model"}) == plain.model_dump(exclude={"environment", "model"})


@pytest.mark.parametrize("variable", [ENV_URL_VARIABLE, TOKEN_URL_VARIABLE])
def test_a_bad_address_names_the_variable_and_hides_credentials(variable: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load_training_config(DEMO, {variable: "http://user:secret@host:1"})
    assert variable in str(caught.value) and "secret" not in str(caught.value)
