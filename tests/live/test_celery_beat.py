"""Item 9: a real ``celery beat`` and a real worker run recovery and eviction on schedule.

A fresh PostgreSQL database, a Redis broker (a dedicated database, flushed
before and after), ``celery beat`` and ``celery worker`` processes running
``tests.live.celery_app``, whose schedule is the shipped
``django_idempotency.tasks.BEAT_SCHEDULE`` with every interval shortened to
one second: same entry names, same task names, so a wrong name would never
run.

Seeded: expired COMPLETED and FAILED records (purged), a live COMPLETED one
(kept), a CLAIMED record whose owner's lease ran out (released by recovery),
a CLAIMED one whose lease still runs (kept), and IN_PROGRESS / UNCERTAIN
records with expired leases, past retention, whose operation has no
reconciler: they stay, UNCERTAIN, their lease pushed out. A second batch
seeded after the first is settled proves the tasks keep firing.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest

from django_idempotency import tasks
from tests.live.celery_harness import (
    CeleryProcess,
    celery_database,
    celery_environment,
    new_queue,
    redis_db,
    require_redis,
    wait_until,
)
from tests.live.server import LiveDatabase

INTERVAL = 1.0
TIMEOUT = 30.0
ORPHAN_OPERATION = "POST beat-test/no-reconciler"


def now() -> datetime:
    return datetime.now(UTC)


def insert_record(
    database: LiveDatabase,
    state: str,
    *,
    expires_in: float,
    lease_in: float | None = None,
    operation: str = "POST beat-test/charges",
) -> int:
    """A record as the package would have left it; times relative to now, in seconds."""
    at = now()
    resolved = state in ("COMPLETED", "FAILED")
    rows = database.query(
        "INSERT INTO django_idempotency_record (tenant, operation, key, fingerprint, state, "
        "lease_owner, lease_expires_at, fencing_token, provider_key, provider_operation_id, "
        "response_status, response_headers, response_body, created_at, updated_at, expires_at) "
        "VALUES (%s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s, %s) RETURNING id",
        [
            "beat-test",
            operation,
            f"{state.lower()}-{uuid.uuid4().hex[:12]}",
            "0" * 64,
            state,
            "" if resolved else "dead-host:1:1",
            None if lease_in is None else at + timedelta(seconds=lease_in),
            4,
            "" if state in ("COMPLETED", "FAILED", "CLAIMED") else uuid.uuid4().hex,
            "",
            201 if state == "COMPLETED" else 402 if state == "FAILED" else None,
            json.dumps([["Content-Type", "application/json"]] if resolved else []),
            b'{"ok":true}' if resolved else None,
            at - timedelta(hours=2),
            at - timedelta(hours=2),
            at + timedelta(seconds=expires_in),
        ],
    )
    return int(rows[0][0])


def states(database: LiveDatabase) -> dict[int, tuple[str, int, datetime | None]]:
    rows = database.query(
        "SELECT id, state, fencing_token, lease_expires_at FROM django_idempotency_record"
    )
    return {int(row[0]): (row[1], int(row[2]), row[3]) for row in rows}


@pytest.fixture
def processes() -> Iterator[list[CeleryProcess]]:
    started: list[CeleryProcess] = []
    try:
        yield started
    finally:
        for process in reversed(started):
            process.stop()


def test_the_shipped_schedule_names_the_shipped_tasks() -> None:
    names = {entry["task"] for entry in tasks.BEAT_SCHEDULE.values()}
    assert names == {
        tasks.recover_stale_records.name,
        tasks.purge_expired_records.name,
        tasks.observe_records.name,
    }
    assert names == {
        "django_idempotency.tasks.recover_stale_records",
        "django_idempotency.tasks.purge_expired_records",
        "django_idempotency.tasks.observe_records",
    }


@pytest.mark.postgres
@pytest.mark.live
def test_beat_fires_recovery_and_eviction_on_schedule(
    tmp_path: Path, processes: list[CeleryProcess]
) -> None:
    broker = require_redis()
    with redis_db(broker), celery_database(tmp_path) as database:
        try:
            run(database, broker, tmp_path, processes)
        finally:
            # Before the database is dropped under them.
            for process in reversed(processes):
                process.stop()


def run(
    database: LiveDatabase, broker: str, tmp_path: Path, processes: list[CeleryProcess]
) -> None:
    # -- seed -------------------------------------------------------------------------------
    purged = {
        insert_record(database, "COMPLETED", expires_in=-3600),
        insert_record(database, "FAILED", expires_in=-60),
    }
    released = {insert_record(database, "CLAIMED", expires_in=3600, lease_in=-60)}
    orphans = {
        insert_record(database, state, expires_in=-3600, lease_in=-60, operation=ORPHAN_OPERATION)
        for state in ("IN_PROGRESS", "UNCERTAIN")
    }
    kept = {
        insert_record(database, "COMPLETED", expires_in=3600),
        insert_record(database, "CLAIMED", expires_in=3600, lease_in=3600),
    }
    before = states(database)

    # -- start ------------------------------------------------------------------------------
    env = celery_environment(
        database, broker, new_queue(), IDEMPOTENCY_TEST_BEAT_INTERVAL=str(INTERVAL)
    )
    worker = CeleryProcess.worker(env, tmp_path / "worker.log")
    processes.append(worker)
    worker.start_worker()
    # The worker registered the shipped tasks under the shipped names.
    banner = worker.log_text()
    for entry in tasks.BEAT_SCHEDULE.values():
        assert f". {entry['task']}" in banner, worker.diagnostics()
    beat = CeleryProcess.beat(env, tmp_path / "beat.log", state_dir=tmp_path)
    processes.append(beat)
    beat.start()

    def describe() -> str:
        return (
            f"records now: {states(database)}\nbefore: {before}\n"
            f"{beat.diagnostics(40)}\n{worker.diagnostics(60)}"
        )

    # -- first round: expired ones purged, the stale claim released ----------------------------
    gone = purged | released
    wait_until(lambda: not gone & set(states(database)), TIMEOUT, describe)

    def postponed(pk: int) -> bool:
        state, _, lease = states(database)[pk]
        return state == "UNCERTAIN" and lease is not None and lease > now() + timedelta(minutes=4)

    wait_until(lambda: all(postponed(pk) for pk in orphans), TIMEOUT, describe)
    after = states(database)
    assert set(after) == kept | orphans, describe()
    for pk in kept:
        assert after[pk] == before[pk], describe()
    for pk in orphans:
        state, token, lease = after[pk]
        assert state == "UNCERTAIN"
        assert token == before[pk][1] + 1
        # Pushed out by the backoff: recovery leaves it alone until then.
        assert lease is not None and lease > now() + timedelta(minutes=4), describe()

    # -- second round: the tasks keep firing ----------------------------------------------------
    second = {
        insert_record(database, "COMPLETED", expires_in=-1),
        insert_record(database, "CLAIMED", expires_in=3600, lease_in=-1),
    }
    wait_until(lambda: not second & set(states(database)), TIMEOUT, describe)
    final = states(database)
    assert set(final) == kept | orphans, describe()
    for pk in orphans:
        assert final[pk][:2] == after[pk][:2], describe()  # not handled again: backoff

    # -- what the processes said ------------------------------------------------------------
    def each_task_ran_twice() -> bool:
        """Each entry sent and run at least twice (a second run may still be finishing)."""
        beat_log, worker_log = beat.log_text(), worker.log_text()
        for name, entry in tasks.BEAT_SCHEDULE.items():
            sent = re.findall(
                rf"Sending due task {re.escape(name)} \({re.escape(entry['task'])}\)", beat_log
            )
            task = re.escape(entry["task"])
            succeeded = re.findall(rf"Task {task}\[\S+\] succeeded", worker_log)
            if len(sent) < 2 or len(succeeded) < 2:
                return False
        return True

    wait_until(each_task_ran_twice, TIMEOUT, describe)
    beat_log = beat.log_text()
    worker_log = worker.log_text()
    assert "No reconciler for 'POST beat-test/no-reconciler'" in worker_log, describe()
    assert "Traceback" not in worker_log + beat_log, describe()
    assert "received unregistered task" not in worker_log.lower(), describe()
    # Beat kept its schedule state in the test's temporary directory.
    assert list(tmp_path.glob("celerybeat-schedule*")), sorted(tmp_path.iterdir())
