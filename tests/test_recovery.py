"""Recovery: records whose owner's lease ran out are settled, never lost.

``recovery.recover_stale_records`` (and the ``idempotency_recover`` command
and the Celery task doing the same work) in-process, on the real test
database. Each test registers its reconcilers under operation names of its
own and removes them afterwards.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from io import StringIO
from typing import Any

import pytest
from django.core.management import call_command
from django.db import connections
from django.db.models import F
from django.utils import timezone

from django_idempotency import recovery, signals, tasks
from django_idempotency._store.clock import to_the_second
from django_idempotency.conf import idempotency_settings
from django_idempotency.models import IdempotencyRecord
from django_idempotency.recovery import Completed, Failed, Release, Retry, register_reconciler
from tests.factories import RecordFactory
from tests.testapp.models import Charge
from tests.utils import SentSignals, raw_body, signals_sent

pytestmark = [pytest.mark.django_db(transaction=True), pytest.mark.guarantees]
State = IdempotencyRecord.State
UNRESOLVED = [State.CLAIMED, State.IN_PROGRESS, State.UNCERTAIN]
#: Slack for comparing timestamps taken by the code under test with ours.
SLACK = timedelta(seconds=5)


# -- helpers ---------------------------------------------------------------------------


def ago(seconds: float) -> datetime:
    return timezone.now() - timedelta(seconds=seconds)


def ahead(seconds: float) -> datetime:
    return timezone.now() + timedelta(seconds=seconds)


def stale(state: str, operation: str, **fields: Any) -> IdempotencyRecord:
    """An unresolved record whose owner's lease ran out a minute ago."""
    values: dict[str, Any] = {
        "state": state,
        "operation": operation,
        "lease_owner": "dead-host:1:1",
        "lease_expires_at": ago(60),
        "fencing_token": 3,
        "response_status": None,
        "response_body": None,
        "response_headers": [],
    }
    if state != State.CLAIMED:
        values["provider_key"] = f"pk-{uuid.uuid4().hex[:16]}"
    values.update(fields)
    return RecordFactory.create(**values)


def fresh(record: IdempotencyRecord) -> IdempotencyRecord | None:
    return IdempotencyRecord.objects.filter(pk=record.pk).first()


def snapshot() -> list[tuple[Any, ...]]:
    return list(
        IdempotencyRecord.objects.order_by("pk").values_list(
            "pk", "state", "fencing_token", "lease_owner", "lease_expires_at", "updated_at"
        )
    )


@pytest.fixture
def operation() -> Iterator[str]:
    """A unique operation name; any reconciler registered for it is removed afterwards."""
    name = f"POST recovery-test/{uuid.uuid4().hex[:10]}"
    yield name
    recovery._reconcilers.pop(name, None)


@pytest.fixture
def reconcile(operation: str) -> Callable[[Callable[[IdempotencyRecord], Any]], list[int]]:
    """Register a reconciler for ``operation``; returns the ids of the records it saw."""

    def register(decide: Callable[[IdempotencyRecord], Any]) -> list[int]:
        seen: list[int] = []

        @register_reconciler(operation)
        def reconciler(record: IdempotencyRecord) -> Any:
            seen.append(record.pk)
            return decide(record)

        return seen

    return register


@pytest.fixture
def sent() -> Iterator[SentSignals]:
    by_name = {
        "claim_released": signals.claim_released,
        "record_unreconciled": signals.record_unreconciled,
    }
    with signals_sent(by_name) as log:
        yield log


def charge_in_reconciler(record: IdempotencyRecord) -> Charge:
    """The reconciler's own write: what it learned from the provider."""
    return Charge.objects.create(tenant=record.tenant, amount=42, note=f"reconciled {record.key}")


def reconciled_charges(record: IdempotencyRecord) -> int:
    return Charge.objects.filter(note=f"reconciled {record.key}").count()


# -- CLAIMED: released -------------------------------------------------------------------


def test_a_stale_claim_is_released(operation: str, sent: list[Any]) -> None:
    record = stale(State.CLAIMED, operation)

    report = recovery.recover_stale_records()

    assert fresh(record) is None
    assert (report.released, report.handled) == (1, 1)
    assert [name for name, _ in sent] == ["claim_released"]
    scope, reason = sent[0][1]["scope"], sent[0][1]["reason"]
    assert (scope.tenant, scope.operation, scope.key, reason) == (
        record.tenant,
        operation,
        record.key,
        "recovery",
    )


def test_a_stale_claim_is_released_even_with_a_reconciler(
    operation: str, reconcile: Callable[..., list[int]]
) -> None:
    """A CLAIMED owner began no external call: nothing to ask a provider about."""
    seen = reconcile(lambda record: Completed(status=201))
    record = stale(State.CLAIMED, operation)

    assert recovery.recover_stale_records().released == 1
    assert fresh(record) is None
    assert seen == []


# -- IN_PROGRESS / UNCERTAIN without a reconciler: stays UNCERTAIN -----------------------


@pytest.mark.parametrize("state", [State.IN_PROGRESS, State.UNCERTAIN])
def test_without_a_reconciler_a_record_stays_uncertain_and_is_reported(
    operation: str,
    state: str,
    sent: list[Any],
    caplog: pytest.LogCaptureFixture,
) -> None:
    record = stale(state, operation, expires_at=ago(3600))  # past retention too
    before = timezone.now()

    with caplog.at_level(logging.ERROR, logger="django_idempotency"):
        report = recovery.recover_stale_records()

    after = fresh(record)
    assert after is not None
    assert after.state == State.UNCERTAIN
    assert after.fencing_token == record.fencing_token + 1
    assert after.lease_owner == ""
    assert after.provider_key == record.provider_key
    assert after.lease_expires_at is not None
    backoff = recovery.DEFAULT_BACKOFF
    assert before + backoff - SLACK <= after.lease_expires_at <= timezone.now() + backoff + SLACK
    assert (report.unreconciled, report.handled) == (1, 1)

    assert [name for name, _ in sent] == ["record_unreconciled"]
    assert sent[0][1]["record"].pk == record.pk
    assert sent[0][1]["scope"].key == record.key
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(errors) == 1
    assert operation in errors[0].getMessage()
    assert "No reconciler" in errors[0].getMessage()

    # The lease was pushed out: the next run leaves it alone (and says nothing).
    caplog.clear()
    sent.clear()
    assert recovery.recover_stale_records().handled == 0
    assert sent == [] and caplog.records == []

    # However often its lease runs out again, it is never deleted.
    for _ in range(3):
        IdempotencyRecord.objects.filter(pk=record.pk).update(lease_expires_at=ago(1))
        assert recovery.recover_stale_records().unreconciled == 1
    last = fresh(record)
    assert last is not None and last.state == State.UNCERTAIN


# -- reconciler outcomes ----------------------------------------------------------------


@pytest.mark.not_under(
    "encryption", reason="reads the stored body raw; ENCRYPTION_KEYS seals it at rest"
)
@pytest.mark.parametrize("state", [State.IN_PROGRESS, State.UNCERTAIN])
def test_completed_stores_the_response_and_commits_the_reconcilers_writes(
    operation: str, reconcile: Callable[..., list[int]], state: str
) -> None:
    received: list[IdempotencyRecord] = []

    def decide(record: IdempotencyRecord) -> Completed:
        received.append(record)
        charge = charge_in_reconciler(record)
        return Completed(
            status=201, body={"id": charge.pk, "amount": 42}, headers={"Location": "/charges/7"}
        )

    seen = reconcile(decide)
    record = stale(state, operation, provider_operation_id="ch_123")
    before = timezone.now()

    report = recovery.recover_stale_records()

    assert seen == [record.pk]
    # The reconciler is handed the record, with what the owner committed.
    given = received[0]
    assert (given.operation, given.key, given.state) == (operation, record.key, state)
    assert (given.provider_key, given.provider_operation_id) == (record.provider_key, "ch_123")

    after = fresh(record)
    assert after is not None
    charge = Charge.objects.get(note=f"reconciled {record.key}")
    assert after.state == State.COMPLETED
    assert after.response_status == 201
    assert raw_body(after) == f'{{"id":{charge.pk},"amount":42}}'.encode()
    assert dict(after.response_headers) == {
        "Location": "/charges/7",
        "Content-Type": "application/json",
    }
    assert after.lease_owner == "" and after.lease_expires_at is None
    ttl = idempotency_settings.TTL
    assert before + ttl - SLACK <= after.expires_at <= timezone.now() + ttl + SLACK
    assert (report.completed, report.handled) == (1, 1)


@pytest.mark.not_under(
    "encryption", reason="reads the stored body raw; ENCRYPTION_KEYS seals it at rest"
)
def test_completed_keeps_bytes_and_given_content_type(
    operation: str, reconcile: Callable[..., list[int]]
) -> None:
    reconcile(
        lambda record: Completed(
            status=200, body=b"<ok/>", headers={"Content-Type": "application/xml"}
        )
    )
    record = stale(State.UNCERTAIN, operation)

    recovery.recover_stale_records()

    after = fresh(record)
    assert after is not None and after.state == State.COMPLETED
    assert raw_body(after) == b"<ok/>"
    assert after.response_headers == [["Content-Type", "application/xml"]]


@pytest.mark.not_under(
    "encryption", reason="reads the stored body raw; ENCRYPTION_KEYS seals it at rest"
)
def test_failed_stores_a_failed_outcome(
    operation: str, reconcile: Callable[..., list[int]]
) -> None:
    reconcile(lambda record: Failed(status=402, body="card declined"))
    record = stale(State.IN_PROGRESS, operation)

    report = recovery.recover_stale_records()

    after = fresh(record)
    assert after is not None
    assert (after.state, after.response_status) == (State.FAILED, 402)
    assert raw_body(after) == b"card declined"
    assert after.response_headers == [["Content-Type", "text/plain; charset=utf-8"]]
    assert (report.failed, report.handled) == (1, 1)


@pytest.mark.parametrize("after", [30, 30.0, timedelta(seconds=30)], ids=["int", "float", "td"])
def test_retry_postpones_to_now_plus_after_and_rolls_back_its_writes(
    operation: str, reconcile: Callable[..., list[int]], after: Any
) -> None:
    def decide(record: IdempotencyRecord) -> Retry:
        charge_in_reconciler(record)
        return Retry(after=after)

    seen = reconcile(decide)
    record = stale(State.IN_PROGRESS, operation)
    before = timezone.now()

    report = recovery.recover_stale_records()

    later = fresh(record)
    assert later is not None
    assert later.state == State.UNCERTAIN
    assert later.lease_owner == ""
    assert later.lease_expires_at is not None
    lower, upper = before + timedelta(seconds=30), timezone.now() + timedelta(seconds=30)
    assert lower - timedelta(seconds=1) <= later.lease_expires_at <= upper + timedelta(seconds=1)
    assert reconciled_charges(record) == 0
    assert (report.retried, report.handled) == (1, 1)

    # Not asked again before then; asked again once it is due.
    assert recovery.recover_stale_records().handled == 0
    IdempotencyRecord.objects.filter(pk=record.pk).update(lease_expires_at=ago(1))
    assert recovery.recover_stale_records().retried == 1
    assert seen == [record.pk, record.pk]


def test_release_deletes_the_record_and_rolls_back_its_writes(
    operation: str, reconcile: Callable[..., list[int]], sent: list[Any]
) -> None:
    def decide(record: IdempotencyRecord) -> Release:
        charge_in_reconciler(record)
        return Release()

    reconcile(decide)
    record = stale(State.UNCERTAIN, operation)

    report = recovery.recover_stale_records()

    assert fresh(record) is None
    assert reconciled_charges(record) == 0
    assert (report.released, report.handled) == (1, 1)
    assert [(name, kwargs["reason"]) for name, kwargs in sent] == [("claim_released", "reconciled")]


def test_a_reconciler_that_raises_postpones_and_rolls_back(
    operation: str, reconcile: Callable[..., list[int]], caplog: pytest.LogCaptureFixture
) -> None:
    def decide(record: IdempotencyRecord) -> Completed:
        charge_in_reconciler(record)
        raise ConnectionError("provider unreachable")

    reconcile(decide)
    record = stale(State.IN_PROGRESS, operation)
    before = timezone.now()

    with caplog.at_level(logging.ERROR, logger="django_idempotency"):
        report = recovery.recover_stale_records()

    after = fresh(record)
    assert after is not None
    assert after.state == State.UNCERTAIN
    assert after.lease_expires_at is not None
    backoff = recovery.DEFAULT_BACKOFF
    assert before + backoff - SLACK <= after.lease_expires_at <= timezone.now() + backoff + SLACK
    assert reconciled_charges(record) == 0
    assert (report.retried, report.handled) == (1, 1)
    failures = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert len(failures) == 1 and failures[0].exc_info is not None
    assert "provider unreachable" in caplog.text


def test_a_reconciler_failing_on_one_record_does_not_stop_the_others(
    operation: str, reconcile: Callable[..., list[int]]
) -> None:
    bad = stale(State.IN_PROGRESS, operation, lease_expires_at=ago(120))
    good = stale(State.IN_PROGRESS, operation, lease_expires_at=ago(60))

    def decide(record: IdempotencyRecord) -> Completed:
        if record.pk == bad.pk:
            raise RuntimeError("boom")
        return Completed(status=201)

    reconcile(decide)

    report = recovery.recover_stale_records()

    assert (report.retried, report.completed) == (1, 1)
    assert fresh(bad).state == State.UNCERTAIN  # type: ignore[union-attr]
    assert fresh(good).state == State.COMPLETED  # type: ignore[union-attr]


def test_a_record_resolved_meanwhile_is_counted_stale_and_not_overwritten(
    operation: str, reconcile: Callable[..., list[int]]
) -> None:
    """Someone else (an operator, another worker) moved the fencing token on
    while the reconciler ran: its outcome changes nothing, its writes roll back."""

    def decide(record: IdempotencyRecord) -> Completed:
        charge_in_reconciler(record)
        IdempotencyRecord.objects.filter(pk=record.pk).update(fencing_token=F("fencing_token") + 1)
        return Completed(status=201)

    reconcile(decide)
    record = stale(State.IN_PROGRESS, operation)

    report = recovery.recover_stale_records()

    assert report.stale == 1 and report.completed == 0
    assert reconciled_charges(record) == 0
    after = fresh(record)
    assert after is not None and after.state == State.IN_PROGRESS


# -- what recovery leaves alone ---------------------------------------------------------


@pytest.mark.parametrize("state", UNRESOLVED)
def test_records_whose_lease_still_runs_are_untouched(
    operation: str, reconcile: Callable[..., list[int]], state: str
) -> None:
    seen = reconcile(lambda record: Completed(status=201))
    stale(state, operation, lease_expires_at=ahead(30))
    before = snapshot()

    report = recovery.recover_stale_records()

    assert report.handled == 0 and report.stale == 0
    assert snapshot() == before
    assert seen == []


@pytest.mark.parametrize("state", [State.COMPLETED, State.FAILED])
def test_resolved_records_are_never_recovered(operation: str, state: str) -> None:
    RecordFactory.create(
        state=state, operation=operation, lease_expires_at=ago(60), expires_at=ago(60)
    )
    before = snapshot()

    assert recovery.recover_stale_records().handled == 0
    assert snapshot() == before


def test_the_batch_size_is_respected_oldest_lease_first(operation: str) -> None:
    records = [stale(State.CLAIMED, operation, lease_expires_at=ago(600 - i)) for i in range(5)]

    first = recovery.recover_stale_records(batch_size=2)

    assert first.released == 2
    remaining = set(IdempotencyRecord.objects.values_list("pk", flat=True))
    assert remaining == {record.pk for record in records[2:]}

    assert recovery.recover_stale_records(batch_size=2).released == 2
    assert recovery.recover_stale_records(batch_size=2).released == 1
    assert recovery.recover_stale_records(batch_size=2).handled == 0
    assert not IdempotencyRecord.objects.exists()


# -- the management command and the Celery task ---------------------------------------


def run_command(*args: str) -> str:
    out = StringIO()
    call_command("idempotency_recover", *args, stdout=out)
    return out.getvalue()


@pytest.fixture
def mixed(operation: str, reconcile: Callable[..., list[int]]) -> dict[str, IdempotencyRecord]:
    """One stale record of each kind, plus one whose lease still runs."""
    other = f"{operation}-unreconciled"
    reconcile(lambda record: Completed(status=201, body={"ok": True}))
    return {
        "claimed": stale(State.CLAIMED, operation, lease_expires_at=ago(300)),
        "reconciled": stale(State.IN_PROGRESS, operation, lease_expires_at=ago(200)),
        "orphan": stale(State.UNCERTAIN, other, lease_expires_at=ago(100)),
        "live": stale(State.CLAIMED, operation, lease_expires_at=ahead(60)),
    }


def test_the_command_dry_run_lists_and_changes_nothing(
    mixed: dict[str, IdempotencyRecord],
) -> None:
    before = snapshot()

    output = run_command("--dry-run")

    assert snapshot() == before
    lines = output.strip().splitlines()
    assert lines[-2] == "3 stale record(s) would be handled (dry run)."
    listed = [line.split("\t") for line in lines[:-2]]
    assert [(int(row[0]), row[1], row[-1]) for row in listed] == [
        (mixed["claimed"].pk, "CLAIMED", "release"),
        (mixed["reconciled"].pk, "IN_PROGRESS", "reconcile"),
        (mixed["orphan"].pk, "UNCERTAIN", "no reconciler"),
    ]

    limited = run_command("--dry-run", "--batch-size", "2")
    assert limited.strip().splitlines()[-2] == "2 stale record(s) would be handled (dry run)."
    assert snapshot() == before


def test_the_command_dry_run_counts_the_records_whose_lease_still_runs(
    mixed: dict[str, IdempotencyRecord], operation: str
) -> None:
    first_end = ahead(30).replace(microsecond=0)
    stale(State.UNCERTAIN, operation, lease_expires_at=first_end)  # e.g. postponed by a run
    stale(State.IN_PROGRESS, operation, lease_expires_at=ahead(600))
    stale(State.COMPLETED, operation, lease_expires_at=ahead(60))  # resolved: not waiting

    output = run_command("--dry-run")

    # mixed["live"] and the two above; the next lease to end is the earliest.
    assert output.strip().splitlines()[-1] == (
        "3 unresolved record(s) skipped: their lease still runs (held by their owner, "
        f"or postponed by recovery); the first one ends at {to_the_second(first_end)}."
    )


def test_the_command_dry_run_says_when_no_lease_runs(operation: str) -> None:
    stale(State.CLAIMED, operation)

    output = run_command("--dry-run")

    assert output.strip().splitlines()[-1] == (
        "0 unresolved record(s) skipped: no lease still runs."
    )


def test_the_command_dry_run_prints_stored_text_with_its_control_characters_escaped() -> None:
    # A tab would forge a column, ESC and CR act on the operator's terminal.
    hostile = "POST \x1b[2J\tCLAIMED\trelease\rok\nstatus"
    record = stale(State.UNCERTAIN, hostile)
    try:
        output = run_command("--dry-run")
    finally:
        recovery._reconcilers.pop(hostile, None)

    row = output.splitlines()[0]
    assert [char for char in output if not char.isprintable() and char not in "\t\n"] == []
    assert row.split("\t") == [
        str(record.pk),
        "UNCERTAIN",
        "POST \\x1b[2J\\tCLAIMED\\trelease\\rok\\nstatus",
        record.key,
        "no reconciler",
    ]


def test_the_command_settles_and_prints_the_counts(mixed: dict[str, IdempotencyRecord]) -> None:
    output = run_command()

    assert output.strip() == (
        "released 1, handed back 0, completed 1, failed 0, retry later 0, no reconciler 1, "
        "taken over meanwhile 0"
    )
    assert fresh(mixed["claimed"]) is None
    assert fresh(mixed["reconciled"]).state == State.COMPLETED  # type: ignore[union-attr]
    assert fresh(mixed["orphan"]).state == State.UNCERTAIN  # type: ignore[union-attr]
    assert fresh(mixed["live"]).state == State.CLAIMED  # type: ignore[union-attr]

    assert run_command().strip() == (
        "released 0, handed back 0, completed 0, failed 0, retry later 0, no reconciler 0, "
        "taken over meanwhile 0"
    )


def test_the_command_respects_the_batch_size(mixed: dict[str, IdempotencyRecord]) -> None:
    output = run_command("--batch-size", "1")

    assert output.strip().startswith("released 1, handed back 0, completed 0,")
    assert fresh(mixed["claimed"]) is None
    assert fresh(mixed["reconciled"]).state == State.IN_PROGRESS  # type: ignore[union-attr]


def test_the_celery_task_does_the_same_work(mixed: dict[str, IdempotencyRecord]) -> None:
    result = tasks.recover_stale_records.apply(kwargs={"batch_size": 2}).get()

    assert result == {
        "released": 1,
        "completed": 1,
        "failed": 0,
        "retried": 0,
        "unreconciled": 0,
        "stale": 0,
        "handed_back": 0,
    }
    assert tasks.recover_stale_records.apply().get()["unreconciled"] == 1


# -- several workers at once ------------------------------------------------------------


@pytest.mark.postgres
def test_concurrent_runs_never_handle_one_record_twice(
    operation: str, reconcile: Callable[..., list[int]]
) -> None:
    """Two recovery runs at once (two threads, two connections) over one stale
    set: SKIP LOCKED shares the work, no record is reconciled twice."""
    total = 60
    handled_by: dict[int, list[str]] = {}
    lock = threading.Lock()

    def decide(record: IdempotencyRecord) -> Completed:
        with lock:
            handled_by.setdefault(record.pk, []).append(threading.current_thread().name)
        time.sleep(0.005)  # keep the runs overlapping
        return Completed(status=201)

    reconcile(decide)
    records = [stale(State.IN_PROGRESS, operation) for _ in range(total)]
    barrier = threading.Barrier(2, timeout=10)
    reports: dict[str, list[recovery.RecoveryReport]] = {"a": [], "b": []}
    errors: list[BaseException] = []

    def work(name: str) -> None:
        try:
            barrier.wait()
            while True:
                report = recovery.recover_stale_records(batch_size=7)
                reports[name].append(report)
                if report.handled == 0:
                    break
        except BaseException as exc:  # reported below, never lost in a thread
            errors.append(exc)
        finally:
            connections.close_all()

    threads = [threading.Thread(target=work, args=(name,), name=name) for name in reports]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)

    assert errors == []
    assert not any(thread.is_alive() for thread in threads)
    twice = {pk: names for pk, names in handled_by.items() if len(names) > 1}
    assert twice == {}
    assert set(handled_by) == {record.pk for record in records}
    completed = sum(report.completed for runs in reports.values() for report in runs)
    assert completed == total
    assert sum(report.stale for runs in reports.values() for report in runs) == 0
    by_thread = Counter(names[0] for names in handled_by.values())
    assert set(by_thread) == {"a", "b"}, f"one run did all the work: {by_thread}"
    assert set(
        IdempotencyRecord.objects.filter(operation=operation).values_list("state", flat=True)
    ) == {State.COMPLETED}
