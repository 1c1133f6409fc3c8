"""Every conditional write is one conditional statement, whatever receivers a project has.

Audit and history packages connect ``pre_delete``/``post_delete`` receivers
without a sender. ``QuerySet.delete()`` then no longer deletes in one
statement: Django's collector SELECTs the matching rows, sends the signals,
and deletes by primary key alone, so whatever changed in between (a
takeover, an extended retention) is deleted anyway. These tests connect
such receivers and make another writer act in exactly that gap, if there
is one.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

import pytest
from django.db import connection, connections
from django.db.models import F
from django.db.models.signals import post_delete, post_save, pre_delete, pre_save
from django.test.utils import CaptureQueriesContext
from django.utils import timezone

from django_idempotency import _store as store
from django_idempotency.fingerprint import fingerprint
from django_idempotency.models import IdempotencyRecord
from django_idempotency.responses import StoredResponse, Verdict
from django_idempotency.scope import Scope
from tests.factories import RecordFactory
from tests.test_admin import run, staff, stuck_record

pytestmark = pytest.mark.django_db(transaction=True)
State = IdempotencyRecord.State
TABLE = IdempotencyRecord._meta.db_table
LEASE = timedelta(minutes=2)


@dataclass
class Receivers:
    """Model signal receivers connected without a sender, as audit packages connect them."""

    #: The delete signals sent for records, by name. (Save receivers are
    #: connected too: an update sends none, and must stay one statement.)
    calls: list[str] = field(default_factory=list)
    #: Run once, by the first ``pre_delete``: another writer acting between
    #: a delete's SELECT and its DELETE, if the delete has such a gap.
    meanwhile: Callable[[], None] | None = None
    acted_meanwhile: bool = False

    def __call__(self, sender: Any, signal: Any, **kwargs: Any) -> None:
        if sender is not IdempotencyRecord or signal not in (pre_delete, post_delete):
            return
        self.calls.append(next(name for name, known in SIGNALS.items() if known is signal))
        if signal is pre_delete and self.meanwhile is not None and not self.acted_meanwhile:
            self.acted_meanwhile = True
            self.meanwhile()


SIGNALS = {
    "pre_delete": pre_delete,
    "post_delete": post_delete,
    "pre_save": pre_save,
    "post_save": post_save,
}


@pytest.fixture
def receivers() -> Iterator[Receivers]:
    connected = Receivers()
    for signal in SIGNALS.values():
        signal.connect(connected, weak=False)
    try:
        yield connected
    finally:
        for signal in SIGNALS.values():
            signal.disconnect(connected)


def elsewhere(pk: int, **values: Any) -> Callable[[], None]:
    """An UPDATE of the record committed by another connection (another worker).

    SQLite has one writer at a time: there the same connection writes it, which
    leaves the row changed for the DELETE that follows just the same.
    """

    def act() -> None:
        if connection.vendor == "sqlite":
            IdempotencyRecord.objects.filter(pk=pk).update(**values)
            return
        other = connections.create_connection("default")
        try:
            IdempotencyRecord.objects.using(_register(other)).filter(pk=pk).update(**values)
        finally:
            _unregister(other)

    return act


def _register(other: Any) -> str:
    alias = "default__other_worker"
    connections[alias] = other
    return alias


def _unregister(other: Any) -> None:
    other.close()
    del connections["default__other_worker"]


def taken_over(pk: int) -> Callable[[], None]:
    return elsewhere(pk, fencing_token=F("fencing_token") + 1, lease_owner="other-worker")


def claimed(key: str = "k") -> store.Claim:
    held = store.claim(
        Scope("tenant", "POST op", key),
        fingerprint({}),
        ttl=timedelta(hours=1),
        lease=LEASE,
        using="default",
    )
    assert held is not None
    return held


def survivor(pk: int) -> IdempotencyRecord | None:
    return IdempotencyRecord.objects.filter(pk=pk).first()


def test_a_release_never_deletes_a_record_taken_over_before_its_delete(
    receivers: Receivers,
) -> None:
    held = claimed()
    receivers.meanwhile = taken_over(held.record_id)

    released = store.release(held)

    record = survivor(held.record_id)
    assert not (receivers.acted_meanwhile and record is None)
    assert released == (record is None)
    assert receivers.calls == []


def test_a_stale_owners_release_deletes_nothing_with_delete_receivers_connected(
    receivers: Receivers,
) -> None:
    held = claimed()
    taken_over(held.record_id)()

    assert store.release(held) is False

    record = survivor(held.record_id)
    assert record is not None and record.fencing_token == held.fencing_token + 1


def test_a_discard_never_deletes_a_record_whose_retention_was_extended_before_its_delete(
    receivers: Receivers,
) -> None:
    record = RecordFactory.create(expires_at=timezone.now() - timedelta(seconds=1))
    receivers.meanwhile = elsewhere(record.pk, expires_at=timezone.now() + timedelta(days=1))

    discarded = store.discard_expired(record, using="default")

    kept = survivor(record.pk)
    assert not (receivers.acted_meanwhile and kept is None)
    assert discarded == (kept is None)
    assert receivers.calls == []


def test_a_purge_never_deletes_a_record_whose_retention_was_extended_before_its_delete(
    receivers: Receivers,
) -> None:
    record = RecordFactory.create(expires_at=timezone.now() - timedelta(seconds=1))
    receivers.meanwhile = elsewhere(record.pk, expires_at=timezone.now() + timedelta(days=1))

    deleted, _ = store.purge_expired_batch(limit=10, using="default")

    kept = survivor(record.pk)
    assert not (receivers.acted_meanwhile and kept is None)
    assert deleted == (0 if kept else 1)
    assert receivers.calls == []


def test_the_admin_release_never_deletes_a_record_taken_over_before_its_delete(
    receivers: Receivers,
) -> None:
    record = stuck_record(state=State.CLAIMED)
    receivers.meanwhile = taken_over(record.pk)

    run(staff("release"), "release", record, apply="1")

    kept = survivor(record.pk)
    assert not (receivers.acted_meanwhile and kept is None)
    assert receivers.calls == []


def test_the_admin_release_leaves_a_record_taken_over_after_the_operator_looked(
    receivers: Receivers,
) -> None:
    record = stuck_record(state=State.CLAIMED)
    seen = {f"token-{record.pk}": record.fencing_token, f"state-{record.pk}": "CLAIMED"}
    taken_over(record.pk)()

    run(staff("release"), "release", record, apply="1", **seen)

    kept = survivor(record.pk)
    assert kept is not None and kept.fencing_token == record.fencing_token + 1


def _table_statements(queries: CaptureQueriesContext) -> list[str]:
    return [query["sql"] for query in queries.captured_queries if TABLE in query["sql"]]


WRITES: dict[str, Callable[[store.Claim], Any]] = {
    "release": lambda held: store.release(held),
    "begin_external": lambda held: store.begin_external(held, "p" * 64, lease=LEASE),
    "renew_lease": lambda held: store.renew_lease(held, lease=LEASE),
    "mark_uncertain": lambda held: store.mark_uncertain(
        held, provider_key="p", provider_operation_id="op"
    ),
    "postpone": lambda held: store.postpone(held, LEASE),
    "complete": lambda held: store.complete(
        held, Verdict.COMPLETED, StoredResponse(201, [], b"{}"), ttl=timedelta(hours=1)
    ),
    "extend_retention": lambda held: store.extend_retention(
        [held.record_id], until=timezone.now() + timedelta(days=2), using="default"
    ),
}


@pytest.mark.parametrize("write", WRITES)
def test_each_owner_write_is_one_statement_with_model_signal_receivers_connected(
    receivers: Receivers, write: str
) -> None:
    held = claimed()

    with CaptureQueriesContext(connection) as queries:
        WRITES[write](held)

    assert len(_table_statements(queries)) == 1
    assert receivers.calls == []


def test_set_provider_operation_is_one_statement_with_model_signal_receivers_connected(
    receivers: Receivers,
) -> None:
    held = claimed()
    store.begin_external(held, "p" * 64, lease=LEASE)

    with CaptureQueriesContext(connection) as queries:
        store.set_provider_operation(held, "ch_1", lease=LEASE)

    assert len(_table_statements(queries)) == 1
    assert receivers.calls == []


@pytest.mark.parametrize("write", ["discard_expired", "take_over", "take_over_for_operator"])
def test_each_takeover_and_discard_is_one_statement_with_model_signal_receivers_connected(
    receivers: Receivers, write: str
) -> None:
    past = timezone.now() - timedelta(seconds=1)
    state = State.COMPLETED if write == "discard_expired" else State.CLAIMED
    record = RecordFactory.create(state=state, expires_at=past, lease_expires_at=past)
    scope = Scope(record.tenant, record.operation, record.key)

    with CaptureQueriesContext(connection) as queries:
        if write == "discard_expired":
            done: Any = store.discard_expired(record, using="default")
        elif write == "take_over":
            done = store.take_over(record, scope, lease=LEASE, using="default")
        else:
            done = store.take_over_for_operator(
                record, seen_state=state, operator="op", lease=LEASE, using="default"
            )

    assert done
    assert len(_table_statements(queries)) == 1
    assert receivers.calls == []


@pytest.mark.skipif(
    connection.vendor == "sqlite", reason="one writer at a time: no lock to wait on"
)
def test_a_release_waiting_on_a_takeovers_row_lock_rechecks_its_conditions(
    receivers: Receivers,
) -> None:
    """The race over two real connections: the takeover holds the row when the release comes.

    The release's DELETE waits on the takeover's row lock; when the takeover
    commits, the database evaluates the DELETE's conditions again on the new
    row, and the fencing token no longer matches. A delete by primary key
    alone, after a SELECT that saw the old row, deletes it.
    """
    held = claimed()
    other = connections.create_connection("default")
    alias = _register(other)
    outcome: list[bool] = []

    def release_in_another_thread() -> None:
        try:
            outcome.append(store.release(held))
        finally:
            connections["default"].close()

    try:
        with other.cursor() as cursor:
            other.set_autocommit(False)
            IdempotencyRecord.objects.using(alias).filter(pk=held.record_id).update(
                fencing_token=F("fencing_token") + 1, lease_owner="other-worker"
            )
            releasing = threading.Thread(target=release_in_another_thread)
            releasing.start()
            _wait_until_a_statement_waits_on_a_lock(cursor)
            other.commit()
            releasing.join(timeout=30)
    finally:
        other.set_autocommit(True)
        _unregister(other)

    assert outcome == [False]
    record = survivor(held.record_id)
    assert record is not None and record.fencing_token == held.fencing_token + 1


def _wait_until_a_statement_waits_on_a_lock(cursor: Any) -> None:
    query = (
        "SELECT count(*) FROM pg_locks WHERE NOT granted"
        if connection.vendor == "postgresql"
        else "SELECT count(*) FROM information_schema.innodb_trx WHERE trx_state = 'LOCK WAIT'"
    )
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        cursor.execute(query)
        if cursor.fetchone()[0]:
            return
        # InnoDB refreshes its transaction list only after 0.1 s without a read.
        time.sleep(0.15)
    raise AssertionError("the release never waited on the takeover's row lock")
