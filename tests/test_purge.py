"""Eviction: resolved records past ``expires_at`` are deleted, in bounded batches.

``purge.purge_expired_records`` (and the ``idempotency_purge`` command
and the Celery task doing the same work) in-process, on the real test
database. Unresolved records are never deleted, however old.
"""

from __future__ import annotations

import re
from datetime import datetime, timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import CommandError, call_command
from django.utils import timezone

from django_idempotency import _store as store
from django_idempotency import purge, tasks
from django_idempotency.models import IdempotencyRecord
from tests.factories import RecordFactory

pytestmark = pytest.mark.django_db(transaction=True)
State = IdempotencyRecord.State
RESOLVED = [State.COMPLETED, State.FAILED]
UNRESOLVED = [State.CLAIMED, State.IN_PROGRESS, State.UNCERTAIN]


def ago(seconds: float) -> datetime:
    return timezone.now() - timedelta(seconds=seconds)


def expired(state: str = State.COMPLETED, seconds: float = 60, **fields: Any) -> IdempotencyRecord:
    values: dict[str, Any] = {"state": state, "expires_at": ago(seconds)}
    if state not in RESOLVED:
        values.update(
            lease_owner="dead-host:1:1",
            lease_expires_at=ago(seconds),
            response_status=None,
            response_body=None,
            response_headers=[],
        )
    values.update(fields)
    return RecordFactory.create(**values)


def remaining() -> set[int]:
    return set(IdempotencyRecord.objects.values_list("pk", flat=True))


def test_only_resolved_records_past_expiry_are_deleted() -> None:
    gone = [expired(State.COMPLETED), expired(State.FAILED, response_status=402)]
    kept = [
        RecordFactory.create(
            state=State.COMPLETED, expires_at=timezone.now() + timedelta(seconds=30)
        ),
        RecordFactory.create(state=State.FAILED, expires_at=timezone.now() + timedelta(hours=1)),
    ]
    # Unresolved ones, even years past expiry and lease: recovery's business.
    kept += [expired(state, seconds=3 * 365 * 86400) for state in UNRESOLVED]

    report = purge.purge_expired_records()

    assert (report.deleted, report.batches) == (2, 1)
    assert remaining() == {record.pk for record in kept}
    assert not remaining() & {record.pk for record in gone}


@pytest.mark.parametrize("state", UNRESOLVED)
def test_an_unresolved_record_is_never_purged(state: str) -> None:
    record = expired(state, seconds=86400)

    assert purge.purge_expired_records(batch_size=1).deleted == 0
    assert purge.expired_count() == 0
    assert remaining() == {record.pk}


def test_purging_nothing_is_a_no_op() -> None:
    RecordFactory.create()  # not expired
    report = purge.purge_expired_records()
    assert (report.deleted, report.batches) == (0, 0)
    assert len(remaining()) == 1


def test_batches_of_the_given_size_until_done() -> None:
    for i in range(7):
        expired(seconds=100 + i)

    report = purge.purge_expired_records(batch_size=3, batch_seconds=60)

    assert (report.deleted, report.batches) == (7, 3)  # 3 + 3 + 1
    assert remaining() == set()
    assert report.longest_batch >= 0


def test_a_full_last_batch_is_followed_by_an_empty_check() -> None:
    for _ in range(6):
        expired()

    report = purge.purge_expired_records(batch_size=3, batch_seconds=60)

    assert (report.deleted, report.batches) == (6, 2)
    assert remaining() == set()


def test_max_batches_bounds_a_run_oldest_first() -> None:
    records = [expired(seconds=1000 - i * 10) for i in range(7)]  # oldest first
    unresolved = expired(State.UNCERTAIN, seconds=5000)

    report = purge.purge_expired_records(batch_size=2, max_batches=2, batch_seconds=60)

    assert (report.deleted, report.batches) == (4, 2)
    assert remaining() == {record.pk for record in records[4:]} | {unresolved.pk}

    report = purge.purge_expired_records(batch_size=2, max_batches=2, batch_seconds=60)
    assert (report.deleted, report.batches) == (3, 2)
    assert remaining() == {unresolved.pk}


class BatchClock:
    """``monotonic`` for the purge: each batch takes the next given duration."""

    def __init__(self, durations: list[float]) -> None:
        self.durations = durations
        self.now = 0.0
        self.started = False

    def __call__(self) -> float:
        if self.started:  # the end of a batch
            self.now += self.durations.pop(0) if self.durations else 0.0
        self.started = not self.started
        return self.now


def test_a_slow_batch_halves_the_next_and_quick_ones_grow_it_back(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for i in range(20):
        expired(seconds=1000 - i)
    limits: list[int] = []
    real_batch = store.purge_expired_batch

    def batch(**arguments: Any) -> tuple[int, Any]:
        limits.append(arguments["limit"])
        return real_batch(**arguments)

    monkeypatch.setattr(store, "purge_expired_batch", batch)
    # A checkpoint makes the first two batches slow; the rest are quick.
    monkeypatch.setattr(purge, "monotonic", BatchClock([0.5, 0.3, 0.01, 0.01]))
    pauses: list[float] = []
    monkeypatch.setattr(purge, "sleep", pauses.append)

    report = purge.purge_expired_records(batch_size=8, batch_seconds=0.1, pause_factor=2)

    assert limits[:5] == [8, 4, 2, 4, 8]
    assert report.deleted == 20 and remaining() == set()
    assert report.longest_batch == 0.5
    # After each full batch, twice as long as it took; none after the last.
    assert pauses[:4] == pytest.approx([1.0, 0.6, 0.02, 0.02])
    assert len(pauses) == report.batches - 1


def test_no_pauses_with_a_pause_factor_of_zero(monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(5):
        expired(seconds=100 + i)
    pauses: list[float] = []
    monkeypatch.setattr(purge, "sleep", pauses.append)

    report = purge.purge_expired_records(batch_size=2, pause_factor=0, batch_seconds=60)

    assert (report.deleted, report.batches, pauses) == (5, 3, [])


def test_no_pause_after_the_last_batch_a_run_may_make(monkeypatch: pytest.MonkeyPatch) -> None:
    for i in range(6):
        expired(seconds=100 + i)
    pauses: list[float] = []
    monkeypatch.setattr(purge, "sleep", pauses.append)

    report = purge.purge_expired_records(batch_size=2, max_batches=2, batch_seconds=60)

    assert (report.deleted, report.batches, len(pauses)) == (4, 2, 1)


def test_each_batch_scans_on_from_where_the_last_one_ended() -> None:
    first = [expired(seconds=3000 + i) for i in range(3)]
    later = [expired(seconds=1000 + i) for i in range(3)]
    using = "default"

    deleted, reached = store.purge_expired_batch(limit=3, using=using)
    assert deleted == 3 and remaining() == {record.pk for record in later}
    assert reached == max(record.expires_at for record in first)

    # A record expiring before that point is past the scan: the next run's.
    straggler = expired(seconds=5000)
    deleted, reached_next = store.purge_expired_batch(limit=3, using=using, after=reached)
    assert deleted == 3 and remaining() == {straggler.pk}
    assert reached_next == max(record.expires_at for record in later)
    assert purge.purge_expired_records().deleted == 1


def test_expired_count_counts_what_a_purge_would_delete() -> None:
    for state in RESOLVED:
        expired(state)
        expired(state)
    for state in UNRESOLVED:
        expired(state)
    RecordFactory.create()

    assert purge.expired_count() == 4
    assert purge.purge_expired_records().deleted == 4


# -- the management command and the Celery task ---------------------------------------


def run_command(*args: str) -> str:
    out = StringIO()
    call_command("idempotency_purge", *args, stdout=out)
    return out.getvalue().strip()


@pytest.fixture
def five_expired() -> list[IdempotencyRecord]:
    records = [expired(seconds=500 - i) for i in range(5)]
    RecordFactory.create()  # live
    expired(State.UNCERTAIN)
    return records


def test_the_command_dry_run_counts_and_deletes_nothing(
    five_expired: list[IdempotencyRecord],
) -> None:
    before = remaining()

    assert run_command("--dry-run") == "5 expired record(s) would be deleted."
    assert run_command("--dry-run", "--batch-size", "2") == "5 expired record(s) would be deleted."
    assert remaining() == before


def test_the_command_deletes_in_batches_and_prints_the_counts(
    five_expired: list[IdempotencyRecord],
) -> None:
    output = run_command("--batch-size", "2", "--batch-seconds", "60")

    match = re.fullmatch(
        r"deleted 5 record\(s\) in 3 batch\(es\); longest batch \d+\.\d ms", output
    )
    assert match, output
    assert len(remaining()) == 2


def test_the_command_respects_max_batches(five_expired: list[IdempotencyRecord]) -> None:
    output = run_command("--batch-size", "2", "--max-batches", "1", "--batch-seconds", "60")

    assert output.startswith("deleted 2 record(s) in 1 batch(es);"), output
    assert not remaining() & {record.pk for record in five_expired[:2]}
    assert remaining() >= {record.pk for record in five_expired[2:]}


@pytest.mark.parametrize("value", ["0", "-1", "inf", "nan", "soon"])
def test_the_command_refuses_a_batch_time_that_is_not_a_positive_number(value: str) -> None:
    with pytest.raises(CommandError, match="--batch-seconds"):
        run_command("--batch-seconds", value)


@pytest.mark.parametrize("value", ["-1", "inf", "nan", "soon"])
def test_the_command_refuses_a_negative_pause_factor(value: str) -> None:
    with pytest.raises(CommandError, match="--pause-factor"):
        run_command("--pause-factor", value)


def test_the_command_passes_its_pacing_on(
    five_expired: list[IdempotencyRecord], monkeypatch: pytest.MonkeyPatch
) -> None:
    pauses: list[float] = []
    monkeypatch.setattr(purge, "sleep", pauses.append)

    run_command("--batch-size", "2", "--pause-factor", "0", "--batch-seconds", "60")
    assert pauses == [] and len(remaining()) == 2


def test_the_celery_task_does_the_same_work(five_expired: list[IdempotencyRecord]) -> None:
    arguments = {"batch_size": 2, "max_batches": 2, "batch_seconds": 60}
    result = tasks.purge_expired_records.apply(kwargs=arguments).get()

    assert (result["deleted"], result["batches"]) == (4, 2)
    assert isinstance(result["longest_batch"], float)
    assert tasks.purge_expired_records.apply().get()["deleted"] == 1
    assert len(remaining()) == 2
