"""Local run directory: torn tails, garbage lines, fingerprint refusal with a diff, the lock, a full
disk, file modes under the umask, a resume with nothing to run."""

from __future__ import annotations

import hashlib
import json
import math
import os
import resource
import shutil
import signal
import stat
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from shopsimrl.manifest import FingerprintMismatchError, ManifestError
from shopsimrl.records import read_trace
from shopsimrl.storage.local import LocalRunStore, RunLockedError, atomic_write_json
from tests.testbed_process import start_testbed, write_config


def trace(episode_id: str, status: str = "completed", reward: float = 1.0) -> dict:
    """A trace as written (the JSON object of its line)."""
    return {
        "schema_version": "shopsimrl-episode-v4",
        "episode_id": episode_id,
        "status": status,
        "job": {"task_id": 1, "sample_id": 0, "seed": 1, "split": "val"},
        "final": {"done": status == "completed", "reward": reward},
        "steps": [],
    }


def save(store: LocalRunStore, record: dict) -> None:
    store.save_traces([read_trace(record)])


PLAN = {"experiment": "x", "model": {"model": "m", "sampling": {"temperature": 0.6}}, "jobs": [{"task_id": 1}]}


def test_torn_tail_and_garbage_are_skipped_and_sealed(tmp_path: Path) -> None:
    store = LocalRunStore(tmp_path / "run")
    save(store, trace("task-000001__sample-000"))
    with store.traces_path.open("ab") as handle:  # a crash mid-write, cut inside a multi-byte character
        handle.write(json.dumps(trace("task-000002__sample-000"), ensure_ascii=False).encode()[:30] + "中".encode()[:2])
    index = store.load_index()
    assert index.is_complete("task-000001__sample-000") and "task-000002__sample-000" not in index.episodes
    assert index.bad_lines == 1
    save(store, trace("task-000002__sample-000"))
    with store.traces_path.open("ab") as handle:
        handle.write(b"not json at all\n[1,2]\n\xff\xfe\n\n")
    index = store.load_index()
    assert index.is_complete("task-000002__sample-000") and index.bad_lines == 4
    assert store.traces_path.read_bytes().count(b"\n") == 7  # the torn fragment stays a line of its own


def test_latest_record_wins_and_attempts_count(tmp_path: Path) -> None:
    store = LocalRunStore(tmp_path)
    save(store, trace("e", "failed"))
    save(store, trace("e", "completed", 0.5))
    save(store, trace("f", "failed"))
    index = store.load_index()
    assert index.attempts("e") == 2 and index.is_complete("e") and not index.is_complete("f")
    latest = [(flag, r.status) for flag, r in store.iter_records(index) if r.episode_id == "e"]
    assert latest == [(False, "failed"), (True, "completed")]


def test_unserialisable_payload_is_repaired_not_fatal(tmp_path: Path) -> None:
    store = LocalRunStore(tmp_path)
    record = trace("e")
    record["final"]["reward"] = math.nan
    record["final"]["odd"] = object()
    save(store, record)
    (saved,) = [r for _, r in store.iter_records()]
    assert saved.final is not None and saved.final.get("reward", "absent") is None and saved.serialization_repaired is True


def test_documents_keep_a_lone_surrogate_as_its_escape(tmp_path: Path) -> None:
    """summary.json and the sharded documents are indented JSON from the standard library; a lone
    surrogate (a model's text that is not valid Unicode) must not make them unwritable."""
    from shopsimrl.storage.sharded import _json_bytes

    value = {"note": "台灯\ud800", "nested": ["\udfff"]}
    atomic_write_json(tmp_path / "summary.json", value)
    data = (tmp_path / "summary.json").read_bytes()
    assert b"\\ud800" in data and json.loads(data.decode("utf-8")) == value
    assert json.loads(_json_bytes({**value, "big": 2**70}).decode("utf-8")) == {**value, "big": 2**70}


def test_fingerprint_mismatch_names_the_keys(tmp_path: Path) -> None:
    store = LocalRunStore(tmp_path)
    first = store.freeze_plan(PLAN, {"concurrency": 4})
    again = store.freeze_plan(PLAN, {"concurrency": 64})  # execution settings never block resume
    assert again.created_at == first.created_at
    changed = {**PLAN, "model": {"model": "m", "sampling": {"temperature": 0.7}}, "jobs": [{"task_id": 2}]}
    with pytest.raises(FingerprintMismatchError) as info:
        store.freeze_plan(changed)
    message = str(info.value)
    assert "model.sampling.temperature: 0.6 -> 0.7" in message and "jobs: 1 jobs" in message


def test_edited_manifest_is_refused(tmp_path: Path) -> None:
    store = LocalRunStore(tmp_path)
    store.freeze_plan(PLAN)
    manifest = json.loads(store.manifest_path.read_text())
    manifest["plan"]["experiment"] = "edited"
    store.manifest_path.write_text(json.dumps(manifest))
    with pytest.raises(ManifestError, match="edited"):
        store.read_manifest()
    store.manifest_path.write_text('{"schema_version": "shopsimrl-run-manifest-v9"}')
    with pytest.raises(ManifestError, match="unsupported manifest schema_version"):
        store.read_manifest()


def test_summary_write_is_atomic_and_refuses_nan(tmp_path: Path) -> None:
    store = LocalRunStore(tmp_path)
    summary = {"schema_version": "shopsimrl-eval-summary-v3", "a": 1}
    store.write_summary(summary)
    with pytest.raises(ValueError):
        store.write_summary({**summary, "a": math.nan})
    with pytest.raises(ValueError, match="not a run summary"):
        store.write_summary({"a": 2})  # what is written fits its schema version
    assert json.loads(store.summary_path.read_text()) == summary
    assert not list(tmp_path.glob(".summary.json.*"))


def test_one_process_per_run_directory(tmp_path: Path) -> None:
    with LocalRunStore(tmp_path), pytest.raises(RunLockedError):
        LocalRunStore(tmp_path).acquire()
    with LocalRunStore(tmp_path):
        pass


def test_completion_is_sticky_when_a_failed_record_follows(tmp_path: Path) -> None:
    # e.g. traces concatenated from two machines: a completed episode must never be rerun
    store = LocalRunStore(tmp_path)
    save(store, trace("e", "completed", 0.5))
    save(store, trace("e", "failed"))
    index = store.load_index()
    assert index.is_complete("e") and index.attempts("e") == 2
    winners = [r.status for flag, r in store.iter_records(index) if flag]
    assert winners == ["completed"]


def test_local_and_sharded_layouts_never_mix(tmp_path: Path) -> None:
    (tmp_path / "shards.json").write_text("{}")
    with pytest.raises(ManifestError, match="sharded run"):
        LocalRunStore(tmp_path).freeze_plan(PLAN)


# --------------------------------------------------------------------------- a full disk
#
# Two real ways to run out of space, without root and without mocks:
# - "tmpfs": a 1 MiB tmpfs, filled to the last page, in a private user+mount namespace
#   (`unshare -rm`): the writes get the real ENOSPC of a full filesystem. Skipped, with the
#   reason, where the kernel does not allow unprivileged namespaces.
# - "fsize": RLIMIT_FSIZE in the child (with SIGXFSZ ignored): any write past the limit gets
#   EFBIG. It runs everywhere, and a file size limit is a case of its own worth handling.

REPO = Path(__file__).resolve().parents[1]
SPLIT_FILE = REPO / "configs" / "splits" / "persona_splits.v1.json"
_LIST_FILES = (
    "import hashlib, json, os, sys\n"
    "root = sys.argv[1]\n"
    "print(json.dumps({os.path.relpath(os.path.join(d, f), root): hashlib.sha256(open(os.path.join(d, f), 'rb').read()).hexdigest()\n"
    "                  for d, _, files in os.walk(root) for f in files if f != '.filler'}))\n"
)


@dataclass
class FullDiskResult:
    code: int
    stderr: str
    files: dict[str, str]
    """Every file left on the disk afterwards: relative path → sha256."""


def _cli_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SHOPSIMRL_", "AWS_"))}
    return {**env, "SHOPSIMRL_STORE_RETRY_BUDGET_S": "1", **extra}


def run_on_a_full_disk(mode: str, seed: Path, disk: Path, args: list[str]) -> FullDiskResult:
    """``shopsimrl ARGS`` with ``disk`` holding a copy of ``seed`` and no room for anything more."""
    command = [sys.executable, "-m", "shopsimrl", *args]
    listing = disk.parent / f"{disk.name}.listing.json"
    disk.mkdir()
    if mode == "tmpfs":
        probe = subprocess.run(["unshare", "-rm", "true"], capture_output=True, text=True)
        if probe.returncode != 0:
            pytest.skip(f"no unprivileged user+mount namespaces here (unshare -rm: {probe.stderr.strip()!r})")
        script = (
            'mount -t tmpfs -o size=1m tmpfs "$0" || exit 97\n'
            'cp -a "$1/." "$0/" || exit 98\n'
            'dd if=/dev/zero of="$0/.filler" bs=4096 2>/dev/null\n'  # until ENOSPC: the disk is full
            'shift 4; "$@"; code=$?\n'
            f'"{sys.executable}" -c "$_LIST" "$DISK" > "$LISTING"; exit $code\n'
        )
        proc = subprocess.run(
            ["unshare", "-rm", "bash", "-c", script, str(disk), str(seed), "-", "-", "-", *command],
            capture_output=True,
            text=True,
            cwd=REPO,
            timeout=120,
            env={**_cli_env(), "_LIST": _LIST_FILES, "DISK": str(disk), "LISTING": str(listing)},
        )
        assert proc.returncode not in (97, 98), proc.stderr
    else:
        shutil.copytree(seed, disk, dirs_exist_ok=True)

        def limit_file_size() -> None:
            signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # EFBIG instead of being killed
            resource.setrlimit(resource.RLIMIT_FSIZE, (256, 256))

        proc = subprocess.run(
            command, capture_output=True, text=True, cwd=REPO, timeout=120, env=_cli_env(), preexec_fn=limit_file_size
        )
        listing.write_text(
            subprocess.run([sys.executable, "-c", _LIST_FILES, str(disk)], capture_output=True, text=True, check=True).stdout
        )
    return FullDiskResult(proc.returncode, proc.stderr, json.loads(listing.read_text()))


def _no_space_said(result: FullDiskResult, mode: str, path: str) -> None:
    assert "Traceback" not in result.stderr, result.stderr[-3000:]
    reason = "No space left on device" if mode == "tmpfs" else "File too large"
    assert f"cannot write {path}" in result.stderr and reason in result.stderr, result.stderr[-2000:]
    assert len([line for line in result.stderr.splitlines() if line.startswith("error:")]) == 1


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tmpfs", "fsize"])
def test_a_full_disk_while_writing_the_manifest_exits_3_and_leaves_nothing(tmp_path: Path, mode: str) -> None:
    disk = tmp_path / "disk"
    config = tmp_path / "config.yaml"
    config.write_text(f"""experiment:
  name: full
  output_dir: {disk}
tasks:
  split_file: {SPLIT_FILE}
  split: val
  sample_size: 3
environment:
  base_url: http://127.0.0.1:9
model:
  id: m
  name: m
  base_url: http://127.0.0.1:9/v1
  api_key_env: null
""")
    (tmp_path / "seed").mkdir()
    result = run_on_a_full_disk(mode, tmp_path / "seed", disk, ["run", str(config), "--no-progress"])
    assert result.code == 3, result.stderr[-3000:]
    _no_space_said(result, mode, f"{disk}/full/manifest.json")
    assert set(result.files) == {"full/.lock"}  # no manifest, no temporary file


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tmpfs", "fsize"])
def test_a_full_disk_while_rewriting_the_summary_exits_3_and_keeps_the_old_one(tmp_path: Path, mode: str) -> None:
    seed = tmp_path / "seed"
    store = LocalRunStore(seed / "run")
    for n in range(1, 6):
        save(store, trace(f"task-{n:06d}__sample-000", reward=n / 5))
    (seed / "run" / "summary.json").write_text('{"previous": true}\n')
    result = run_on_a_full_disk(mode, seed, tmp_path / "disk", ["summarize", str(tmp_path / "disk" / "run")])
    assert result.code == 3, result.stderr[-3000:]
    _no_space_said(result, mode, f"{tmp_path / 'disk' / 'run'}/summary.json")
    assert "shopsimrl summarize" in result.stderr  # says how to get it once there is room
    assert set(result.files) == {"run/traces.jsonl", "run/summary.json"}
    assert result.files["run/summary.json"] == hashlib.sha256(b'{"previous": true}\n').hexdigest()


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["tmpfs", "fsize"])
def test_a_full_disk_while_reducing_a_sharded_run_exits_3_and_leaves_no_temporary_files(tmp_path: Path, mode: str) -> None:
    from shopsimrl.schemas import EpisodeJob, fingerprint
    from shopsimrl.storage.sharded import ShardedRunStore, commit_shard

    jobs = [EpisodeJob(task_id=t, sample_id=0, seed=t, split="val") for t in range(1, 5)]
    plan = {"experiment": "x", "jobs": [job.to_dict() for job in jobs]}
    seed = ShardedRunStore(str(tmp_path / "seed" / "run"))
    seed.freeze_plan(plan)
    ids = seed.ensure_shard_map(jobs, 1, fingerprint(plan)).episode_ids[0]
    seed.write_part(0, 0, "abcdef01", b"".join(json.dumps(trace(i)).encode() + b"\n" for i in ids))
    commit_shard(seed, 0, ids, plan_fp=fingerprint(plan), writer="abcdef01")
    before = {name for name in os.listdir(tmp_path / "seed" / "run") if name != "shards"}
    result = run_on_a_full_disk(mode, tmp_path / "seed", tmp_path / "disk", ["reduce", str(tmp_path / "disk" / "run")])
    assert result.code == 3, result.stderr[-3000:]
    assert "Traceback" not in result.stderr and "summary.json" in result.stderr and "still failing" in result.stderr
    assert not [name for name in result.files if "/.tmp-" in name or name.startswith(".tmp-")], result.files
    assert {name.split("/")[1] for name in result.files if name.count("/") == 1} == before  # no summary.json


def test_atomic_json_files_get_the_mode_the_umask_gives(tmp_path: Path) -> None:
    # The writer of manifest.json, summary.json and a gate's contributions.json.
    previous = os.umask(0o002)
    try:
        atomic_write_json(tmp_path / "contributions.json", {"a": 1})
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "contributions.json").stat().st_mode) == 0o664
    assert [p.name for p in tmp_path.iterdir()] == ["contributions.json"]  # no temporary file left


@pytest.mark.slow
def test_a_local_run_honours_the_umask_and_a_resume_with_nothing_to_run_keeps_the_summary(tmp_path: Path) -> None:
    config = write_config(tmp_path, name="modes", sample_size=3)
    run_dir = tmp_path / "runs" / "modes"
    with start_testbed() as bed:
        env = {**_cli_env(), "SHOPSIMRL_MODEL_BASE_URL": bed.model_url, "SHOPSIMRL_ENV_BASE_URL": bed.shop_url}

        def run() -> subprocess.CompletedProcess[str]:
            return subprocess.run(
                [sys.executable, "-m", "shopsimrl", "run", str(config), "--no-progress"],
                capture_output=True,
                text=True,
                cwd=REPO,
                env=env,
                timeout=180,
                preexec_fn=lambda: os.umask(0o027),
            )

        first = run()
        assert first.returncode == 0, first.stderr[-3000:]
        names = ("manifest.json", "summary.json", "traces.jsonl", "progress.json")
        modes = {name: stat.S_IMODE((run_dir / name).stat().st_mode) for name in names}
        assert modes == dict.fromkeys(names, 0o640), {name: oct(mode) for name, mode in modes.items()}

        summary = (run_dir / "summary.json").read_bytes()
        again = run()
        assert again.returncode == 0, again.stderr[-3000:]
        assert "3 already completed, 0 to run" in again.stdout + again.stderr
        assert (run_dir / "summary.json").read_bytes() == summary  # created_at included
