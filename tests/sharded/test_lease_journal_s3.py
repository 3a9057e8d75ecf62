"""The lease journal of a sharded run on a real S3 server (objects, not files)."""

from __future__ import annotations

import json

import pytest

from shopsimrl.environment import LeaseError
from shopsimrl.lease_journal import LeaseJournal, ProcessIdentity, StoreJournalStorage, start_lease_tracking
from tests.test_leases import TASK, environment, health, shop, until

pytestmark = pytest.mark.slow


@pytest.mark.s3
async def test_the_journal_on_a_real_s3_server(moto_endpoint: str, monkeypatch: pytest.MonkeyPatch) -> None:
    from shopsimrl.sharded.layout import ShardedRunStore
    from tests.sharded.conftest import S3_TEST_ENV, _make_bucket

    for key, value in S3_TEST_ENV.items():
        monkeypatch.setenv(key, value)
    monkeypatch.setenv("AWS_ENDPOINT_URL", moto_endpoint)
    bucket = _make_bucket(moto_endpoint, S3_TEST_ENV["AWS_ACCESS_KEY_ID"], S3_TEST_ENV["AWS_SECRET_ACCESS_KEY"])
    store = ShardedRunStore(f"s3://{bucket}/journal-run")
    storage = StoreJournalStorage(store, "leases/00003")
    with shop(2) as (url, _):
        journal = LeaseJournal(storage, environment_url=url, min_interval=0.05)
        async with environment(url) as env:
            await start_lease_tracking(env, journal, concurrency=2, processes=1, configured=None)
            episode = env.open_episode()
            await episode.reset(TASK)

            def stored() -> dict:
                raw = storage.read(journal.name)
                return json.loads(raw) if raw else {}

            await until(lambda: bool(stored().get("leases")), "the journal object names the lease")
            stored = stored()
            assert stored["leases"] == [{"env_idx": episode.env_idx, "lease_id": episode.lease_id}]
            # A replacement worker on another host finds the object and releases the lease.
            document = {**stored, "process": ProcessIdentity("gone-pod", 7, 1, "pid:[9]").to_dict()}
            storage.write("5ucce550.json", json.dumps(document).encode())
            successor = LeaseJournal(storage, environment_url=url)
            report = await successor.recover(env)
            assert report.released == 1 and "5ucce550.json" not in storage.names()
            with pytest.raises(LeaseError):  # the successor took it back from under the episode
                await episode.close()
        await journal.aclose()
        assert storage.names() == []
        assert health(url)["free_slots"] == 2
