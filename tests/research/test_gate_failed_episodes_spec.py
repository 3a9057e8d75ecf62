"""GATE.yaml's failed_episodes / max_dropped_share and the flags that override them: defaults,
validation naming the field, and the flags winning over the file."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from shopsimrl.research.gate.spec import GateSpecError, load_gate_spec

BASE: dict[str, Any] = {"output_dir": "gate", "experiment_config": "val.yaml", "bare_run_dir": "bare"}


def write(tmp_path: Path, section: str = "gate_a", **keys: Any) -> Path:
    body = {**BASE, **({"draft_path": "draft.json"} if section == "gate_a" else {"candidate_pool_path": "pool.json"}), **keys}
    path = tmp_path / "GATE.yaml"
    path.write_text(yaml.safe_dump({section: body}), encoding="utf-8")
    return path


@pytest.mark.parametrize("section", ["gate_a", "online_gate"])
def test_refuse_is_the_default_with_a_two_percent_cap(tmp_path: Path, section: str) -> None:
    spec = load_gate_spec(write(tmp_path, section))
    assert (spec.failed_episodes, spec.max_dropped_share) == ("refuse", 0.02)
    assert spec.raw is not None and spec.raw["failed_episodes"] == "refuse"


@pytest.mark.parametrize("section", ["gate_a", "online_gate"])
def test_the_file_sets_drop_and_the_cap(tmp_path: Path, section: str) -> None:
    spec = load_gate_spec(write(tmp_path, section, failed_episodes="drop", max_dropped_share=0.05))
    assert (spec.failed_episodes, spec.max_dropped_share) == ("drop", 0.05)


@pytest.mark.parametrize(
    ("keys", "message"),
    [
        ({"failed_episodes": "skip"}, "gate_a.failed_episodes"),
        ({"max_dropped_share": 1.5}, "gate_a.max_dropped_share"),
        ({"max_dropped_share": -0.1}, "gate_a.max_dropped_share"),
        ({"max_dropped_share": "lots"}, "gate_a.max_dropped_share"),
    ],
)
def test_bad_values_in_the_file_name_the_field(tmp_path: Path, keys: dict[str, Any], message: str) -> None:
    path = write(tmp_path, **keys)
    with pytest.raises(GateSpecError) as caught:
        load_gate_spec(path)
    assert message in str(caught.value) and str(path) in str(caught.value)


def test_flags_override_the_file(tmp_path: Path) -> None:
    path = write(tmp_path, "online_gate", failed_episodes="drop", max_dropped_share=0.05)
    spec = load_gate_spec(path, failed_episodes="refuse", max_dropped_share=0.1)
    assert (spec.failed_episodes, spec.max_dropped_share) == ("refuse", 0.1)
    assert spec.raw is not None and spec.raw["max_dropped_share"] == 0.1
    assert load_gate_spec(path, max_dropped_share=0.0).failed_episodes == "drop"


@pytest.mark.parametrize(
    ("flags", "message"),
    [
        ({"failed_episodes": "skip"}, "--failed-episodes must be refuse or drop, not 'skip' (overrides gate_a.failed_episodes"),
        ({"max_dropped_share": 2.0}, "--max-dropped-share must be between 0 and 1, not 2.0 (overrides gate_a.max_dropped_share"),
    ],
)
def test_bad_flags_name_the_flag_and_the_field(tmp_path: Path, flags: dict[str, Any], message: str) -> None:
    with pytest.raises(GateSpecError, match=None) as caught:
        load_gate_spec(write(tmp_path), **flags)
    assert message in str(caught.value)
