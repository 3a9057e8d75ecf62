"""Eval sets: SET.yaml validation (file:line and field) and the slot pool's order of grants."""

from __future__ import annotations

from pathlib import Path

import pytest

from shopsimrl.runner.evalset import EvalSetError, load_evalset, member_state
from shopsimrl.runner.slots import SlotPool
from tests.testbed_process import write_config


def write_set(directory: Path, text: str) -> Path:
    path = directory / "set.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_members_get_shared_and_own_overrides_and_folders(tmp_path: Path) -> None:
    write_config(tmp_path, name="base", sample_size=3)
    path = write_set(
        tmp_path,
        "location: sets/one\nconfig: base.yaml\nset: {runtime.max_steps: 20}\nconcurrency: 6\nmembers:\n"
        "  - {name: round-1, checkpoint: ck1}\n"
        "  - name: round-2\n    checkpoint: '0123'\n    set: {model.temperature: 0.5}\n",
    )
    the_set = load_evalset(path)
    assert [member.name for member in the_set.members] == ["round-1", "round-2"]
    assert the_set.run_dir(the_set.members[1]) == tmp_path / "sets/one/round-2"
    second = the_set.member_config(the_set.members[1])
    assert second.model.checkpoint_id == "0123"  # text, as `run --checkpoint 0123`
    assert second.model.temperature == 0.5 and second.runtime.max_steps == 20
    assert second.experiment.concurrency == 6
    assert second.run_dir == tmp_path / "sets/one/round-2"
    assert member_state(the_set, the_set.members[0])["state"] == "pending"


@pytest.mark.parametrize(
    ("text", "where"),
    [
        ("location: x\nconfig: base.yaml\nmembers:\n  - {name: a}\n  - {name: a}\n", ":5: members[1].name"),
        ("location: x\nconfig: base.yaml\nmembers:\n  - name: a/b\n", ":4: members[0].name"),
        ("location: x\nconfig: base.yaml\nmembers:\n  - name: a\n    chekpoint: c\n", ":5: members[0].chekpoint"),
        ("location: x\nconfig: base.yaml\nconcurrency: 0\nmembers:\n  - {name: a}\n", ":3: concurrency"),
        ("location: x\nmembers:\n  - {name: a}\n", ":3: members[0].config"),
        ("config: base.yaml\nmembers:\n  - {name: a}\n", ":1: location"),
        ("location: x\nconfig: base.yaml\nmembers: []\n", ":3: members"),
        ("location: x\nconfg: base.yaml\nmembers:\n  - {name: a}\n", ":2: confg"),
        ("location: s3://bucket/p\nconfig: base.yaml\nmembers:\n  - {name: a}\n", ":1: location"),
        ("location: x\nconfig: base.yaml\nmembers:\n  - {name: a, set: [1]}\n", ":4: members[0].set"),
    ],
)
def test_bad_sets_name_file_line_and_field(tmp_path: Path, text: str, where: str) -> None:
    path = write_set(tmp_path, text)
    with pytest.raises(EvalSetError) as caught:
        load_evalset(path)
    assert f"{path}{where}" in str(caught.value)


def test_s3_location_points_to_the_helm_route(tmp_path: Path) -> None:
    path = write_set(tmp_path, "location: s3://b/p\nconfig: c.yaml\nmembers:\n  - {name: a}\n")
    with pytest.raises(EvalSetError, match="--helm-values"):
        load_evalset(path)


def test_a_bad_override_names_the_member(tmp_path: Path) -> None:
    write_config(tmp_path, name="base", sample_size=3)
    path = write_set(tmp_path, "location: x\nconfig: base.yaml\nmembers:\n  - {name: a, set: {runtime.max_stepz: 3}}\n")
    the_set = load_evalset(path)
    with pytest.raises(EvalSetError, match=r"set.yaml:4: member 'a'"):
        the_set.member_config(the_set.members[0])


def test_a_freed_slot_goes_to_the_earliest_member_with_waiting_episodes() -> None:
    pool = SlotPool(total=4)
    first = pool.add("shop", "m1", waiting=5)
    second = pool.add("shop", "m2", waiting=3)
    assert pool.fill() == [first] * 4
    pool.release(first)
    assert pool.fill() == [first]  # the first member still waits: it keeps priority
    for _ in range(4):
        pool.release(first)
    # The first member drains (none waiting): its freed slots go to the next member.
    assert pool.fill() == [second, second, second]
    assert pool.busy == 3 and pool.done(first) and not pool.done(second)


def test_budgets_per_shop_and_per_model_server_bound_each_member() -> None:
    pool = SlotPool(total=6, shop_budget={"shopA": 3}, model_budget={"m1": 2})
    a = pool.add("shopA", "m1", waiting=10)
    b = pool.add("shopA", "m2", waiting=10)
    c = pool.add("shopB", "m2", waiting=10)
    # a stops at its model's 2, b takes shop A's last slot, c fills the rest.
    assert pool.fill() == [a, a, b, c, c, c]
    pool.release(b)
    assert pool.fill() == [b]
    pool.release(a, requeue=True)  # a retry waits again, and a has priority over b
    assert pool.fill() == [a]


def test_releasing_a_slot_never_held_is_an_error() -> None:
    pool = SlotPool(total=1)
    index = pool.add("s", "m", waiting=1)
    with pytest.raises(ValueError, match="holds no slot"):
        pool.release(index)
    with pytest.raises(ValueError):
        SlotPool(total=0)


def test_the_example_set_loads() -> None:
    path = Path(__file__).resolve().parent.parent / "configs/evalset_testbed.yaml"
    the_set = load_evalset(path)
    configs = [the_set.member_config(member) for member in the_set.members]
    assert [config.model.checkpoint_id for config in configs] == ["round-1", "round-2", "round-3"]
    assert len({config.run_dir for config in configs}) == 3


def test_a_path_in_set_is_relative_to_the_members_config(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """As if written in that config: the Helm route mounts the config next to the same files."""
    configs = tmp_path / "configs"
    configs.mkdir()
    write_config(configs, name="base", sample_size=3)
    (configs / "banks").mkdir()
    example = Path(__file__).resolve().parent.parent / "configs/evalset/buy_first_bank.json"
    (configs / "banks" / "weak.json").write_bytes(example.read_bytes())
    path = write_set(
        tmp_path, "location: sets\nconfig: configs/base.yaml\nmembers:\n  - {name: weak, set: {skills.path: banks/weak.json}}\n"
    )
    monkeypatch.chdir(tmp_path)  # not the config's folder: a path relative to it would miss the bank
    the_set = load_evalset(path)
    (member,) = the_set.members
    assert Path(str(the_set.member_config(member).skills.path)) == configs / "banks" / "weak.json"


def test_the_example_sets_members_differ_in_policy() -> None:
    path = Path(__file__).resolve().parent.parent / "configs/evalset_testbed.yaml"
    the_set = load_evalset(path)
    weak, short, plain = (the_set.member_config(member) for member in the_set.members)
    assert weak.skills.path is not None and Path(str(weak.skills.path)).is_file()
    assert (short.runtime.max_steps, plain.skills.path) == (6, None)
